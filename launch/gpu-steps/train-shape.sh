#!/usr/bin/env bash
# retain-bench train on the GPU at a Qwen3 shape: step time per phase, tokens/s, MFU and peak
# memory, as FIGURE lines for the ledger; the Qwen3-4B rows at 128K get issue 12's verdicts
# (trainer/bench/train_table.py: peak <= 50 GB, step <= 60 s).
# usage: train-shape.sh MODEL GATE SEQS ITERS   (e.g. 4B trimkv 131072 1)
set -euo pipefail
model=$1 gate=$2 seqs=$3 iters=$4
dir=$(launch/gpu-steps/qwen3-shape.sh "$model")
json=$WORK/train-$model-$gate-${seqs//,/-}.json
"$BIN/retain-bench" train --device cuda --model "$dir" --seq "$seqs" --gate "$gate" --docs 1 --iters "$iters" \
  --warmup 1 --json "$json"
python3 launch/gpu-steps/figures.py train "$json"
python3 trainer/bench/train_table.py "$json" | tee "$json.md"
grep '^TARGET' "$json.md" | sed 's/^TARGET \(.*\): /FIGURE target=/' || true
