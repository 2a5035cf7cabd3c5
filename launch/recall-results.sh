#!/usr/bin/env bash
# The experiment of docs/results.md on the built-in model (models/recall-qwen3): train trimkv and
# dbtrimkv gates and kvpop scorers on recall-task data with two ranks, then evaluate every policy
# at 5, 10, 20 and 50 % of the 1024-token context on held-out tasks.
#
#   ./launch/recall-results.sh                      # everything, into build/recall-results
#   WORK=/tmp/r EVAL_SAMPLES=64 ./launch/recall-results.sh
#
# Environment: MODEL (the model directory, models/recall-qwen3), WORK (output folder), TRAIN_SAMPLES (tasks packed for training, 2048), STEPS
# (optimizer steps per policy, 300), EVAL_SAMPLES (held-out tasks, 256), POLICIES (of trimkv,
# dbtrimkv, kvpop to train), PLOT (the figure's path, WORK/recall.png). Needs a build
# (./launch/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BUILD_DIR:-build}/bin
MODEL=${MODEL:-models/recall-qwen3}
WORK=${WORK:-${BUILD_DIR:-build}/recall-results}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-2048}
STEPS=${STEPS:-300}
EVAL_SAMPLES=${EVAL_SAMPLES:-256}
POLICIES=${POLICIES:-trimkv dbtrimkv kvpop}
PLOT=${PLOT:-$WORK/recall.png}
mkdir -p "$WORK"

# The task: filler holding 8 key-value records. Training tasks have 512 tokens of it (a gate
# judges a token by the token, so shorter rows teach the same for a quarter of the attention
# cost) and ask 4 keys at the end, every answer a KL position; the held-out tasks (another seed)
# have 1024 and ask one.
echo "== training data: $TRAIN_SAMPLES tasks (seed 1), 4 queries each, packed one per 544-token row"
"$BIN/retain-eval" --model "$MODEL" --task recall --context 512 --pairs 8 --queries 4 --samples "$TRAIN_SAMPLES" --seed 1 \
  --dump-task "$WORK/train.jsonl"
"$BIN/retain-pack" --tokenizer "$MODEL" --seq-len 544 --packing bfd --seed 1 --quiet --out "$WORK/train.h5" "$WORK/train.jsonl"

# Shared training settings: 8 sequences per step over 2 ranks, distillation at the answers only
# (the packed target mask), AdamW with warmup and a cosine to a tenth.
COMMON="--model $MODEL --data $WORK/train.h5 --steps $STEPS --global-batch 8 --lr 0.01 --min-lr 0.001 --warmup 20 \
  --save-every $STEPS --log-every 25 --seed 1"
GATES=()
for P in $POLICIES; do
  echo "== train $P"
  rm -rf "$WORK/$P"
  case $P in
    trimkv|dbtrimkv) ARGS="--gate $P --gate-hidden 32 --bias-init 8 --memory 64 --kl-weight 1 --ntp-weight 0" ;;
    # kvpop: a decay range reaching γ = 0.99 (the paper's is [0.999, 0.999999]): at this length the
    # scorers need a decay of ~0.5 % per token against their target's bonus for age
    # (docs/results.md, "Why KVPOP recalled 32%").
    kvpop) ARGS="--gate kvpop --window 16 --sinks 4 --topk 32 --decay-min 0.99" ;;
    *) echo "recall-results: unknown policy $P" >&2; exit 2 ;;
  esac
  ./launch/mpirun.sh -np 2 -- "$BIN/retain-train" $COMMON $ARGS --out "$WORK/$P"
  GATES+=(--gates "$P=$WORK/$P/gates.safetensors")
done

echo "== evaluate on $EVAL_SAMPLES held-out tasks (seed 1000): budgets 51, 102, 205, 512 = 5, 10, 20, 50 % of 1024"
"$BIN/retain-eval" --model "$MODEL" "${GATES[@]}" --task recall --context 1024 --pairs 8 --samples "$EVAL_SAMPLES" --seed 1000 \
  --policy "full,window,h2o,${POLICIES// /,}" --budget 51,102,205,512 --out "$WORK/recall.json" --plot "$PLOT"
