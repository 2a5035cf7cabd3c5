#!/usr/bin/env bash
# The main job on the built-in model (models/recall-qwen3, a 2-layer Qwen3 pretrained to recall
# key-value records scattered through long filler): build; write recall tasks and pack them;
# train TRIM-KV gates with two ranks (mpirun -np 2); then evaluate on held-out tasks with the
# cache bounded to 10% of the context: full cache vs StreamingLLM, H2O and the trained gates.
# A few minutes on 2 CPU cores once built. docs/results.md has the whole experiment.
set -euo pipefail
cd "$(dirname "$0")/.."
./launch/install-deps.sh
./launch/build.sh --target retain-eval retain-pack retain-train
BIN=${BUILD_DIR:-build}/bin
WORK=${BUILD_DIR:-build}/quickstart
MODEL=models/recall-qwen3
mkdir -p "$WORK"

echo "== 1. the built-in model: $MODEL (config.json, BF16 model.safetensors, tokenizer.json)"
ls -l "$MODEL"

echo "== 2. 512 training tasks (seed 1): 512 tokens of filler holding 8 key-value records, 4 keys"
echo "      asked at the end (the answers are the distillation targets), packed one per 544-token row"
"$BIN/retain-eval" --model "$MODEL" --task recall --context 512 --pairs 8 --queries 4 --samples 512 --seed 1 \
  --dump-task "$WORK/train.jsonl"
"$BIN/retain-pack" --tokenizer "$MODEL" --seq-len 544 --packing bfd --seed 1 --quiet --out "$WORK/train.h5" "$WORK/train.jsonl"

echo "== 3. train trimkv gates with 2 ranks: distill the full-cache model at the answers (KL) under a"
echo "      memory budget of M = 64 tokens per layer and KV head (capacity loss), 150 steps of 8 rows"
rm -rf "$WORK/run"
# launch/mpirun.sh prints the mpirun command it runs (one OpenMP thread per core and rank,
# shared memory, --allow-run-as-root when root).
./launch/mpirun.sh -np 2 -- "$BIN/retain-train" --model "$MODEL" --data "$WORK/train.h5" --out "$WORK/run" \
  --gate trimkv --gate-hidden 32 --bias-init 8 --memory 64 --kl-weight 1 --ntp-weight 0 \
  --lr 0.01 --min-lr 0.001 --warmup 20 --steps 150 --global-batch 8 --save-every 150 --log-every 25 --seed 1

echo "== 4. 64 held-out tasks (seed 1000) with 1024 tokens of filler: the cache bounded to 102 tokens"
echo "      (10%): StreamingLLM (window), H2O and the trained gates (trimkv) against the full cache"
"$BIN/retain-eval" --model "$MODEL" --gates "$WORK/run/gates.safetensors" --task recall --context 1024 --pairs 8 \
  --samples 64 --seed 1000 --policy full,window,h2o,trimkv --budget 102 --out "$WORK/recall.json"
echo "quickstart: done; tasks $WORK/train.jsonl, packed $WORK/train.h5, trained gates $WORK/run/gates.safetensors,"
echo "            metrics $WORK/run/metrics.jsonl, evaluation $WORK/recall.json"
