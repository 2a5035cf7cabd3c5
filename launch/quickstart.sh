#!/usr/bin/env bash
# The main job on a tiny built-in model: build; make a random tiny Qwen3 in the Hugging
# Face layout with random retention gates; pack a small corpus (this repository's docs)
# with its tokenizer; run the teacher and the gated student on two documents; then train
# TRIM-KV gates on the packed corpus with two ranks (mpirun -np 2) for a few hundred steps.
set -euo pipefail
cd "$(dirname "$0")/.."
./launch/install-deps.sh
./launch/build.sh --target retain-make-tiny retain-forward retain-pack retain-train
BIN=${BUILD_DIR:-build}/bin
WORK=${BUILD_DIR:-build}/quickstart
mkdir -p "$WORK"

echo "== 1. a tiny random Qwen3 (config.json, model.safetensors, tokenizer.json) with trimkv gates"
"$BIN/retain-make-tiny" --out "$WORK/tiny-qwen3" --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 32 \
  --gates trimkv --gate-hidden 16 --bias-init 2 --seed 1
ls -l "$WORK/tiny-qwen3"

echo "== 2. pack README.md and docs/*.md into 256-token sequences (best-fit-decreasing)"
"$BIN/retain-pack" --tokenizer "$WORK/tiny-qwen3" --format txt --txt-mode line --seq-len 256 --packing bfd \
  --seed 1 --quiet --out "$WORK/docs.h5" README.md docs/*.md

echo "== 3. two packed documents (\"Hello, world.\" and \"The cache\", each ending in <|endoftext|> = 256): teacher, then gated student"
IDS="72 101 108 108 111 44 32 119 111 114 108 100 46 256 84 104 101 32 99 97 99 104 101 256"
DOCS="0 0 0 0 0 0 0 0 0 0 0 0 0 0 1 1 1 1 1 1 1 1 1 1"
"$BIN/retain-forward" --model "$WORK/tiny-qwen3" --ids "$IDS" --doc-ids "$DOCS" --out "$WORK/teacher.safetensors"
"$BIN/retain-forward" --model "$WORK/tiny-qwen3" --ids "$IDS" --doc-ids "$DOCS" \
  --gates "$WORK/tiny-qwen3/gates.safetensors" --gate-kind trimkv --out "$WORK/student.safetensors"
echo "== 4. train trimkv gates with 2 ranks: distill the teacher (KL) under a memory budget of M = 24 tokens"
echo "      per layer and KV head (capacity loss), 400 steps of 8 sequences; rank 0 prints every 25 steps"
rm -rf "$WORK/run"
# launch/mpirun.sh prints the mpirun command it runs (one OpenMP thread per core and rank,
# shared memory, --allow-run-as-root when root).
./launch/mpirun.sh -np 2 -- "$BIN/retain-train" --model "$WORK/tiny-qwen3" --data "$WORK/docs.h5" \
  --out "$WORK/run" --gate trimkv --gate-hidden 16 --bias-init 4 --memory 24 --kl-weight 1 --ntp-weight 0 \
  --lr 0.003 --warmup 20 --min-lr 0.0003 --steps 400 --global-batch 8 --save-every 100 --log-every 25 --seed 1
echo "quickstart: done; dataset $WORK/docs.h5, logits $WORK/teacher.safetensors and $WORK/student.safetensors,"
echo "            trained gates $WORK/run/gates.safetensors, checkpoints in $WORK/run/checkpoints, metrics $WORK/run/metrics.jsonl"
