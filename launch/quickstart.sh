#!/usr/bin/env bash
# The main job on a tiny built-in model: build, make a random tiny Qwen3 in the Hugging
# Face layout, and run retain-forward on it.
set -euo pipefail
cd "$(dirname "$0")/.."
./launch/install-deps.sh
./launch/build.sh --target retain-make-tiny retain-forward
BIN=${BUILD_DIR:-build}/bin
WORK=${BUILD_DIR:-build}/quickstart
mkdir -p "$WORK"

echo "== 1. a tiny random Qwen3 (HF layout: config.json, model.safetensors, tokenizer.json)"
"$BIN/retain-make-tiny" --out "$WORK/tiny-qwen3" --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 32 --seed 1
ls -l "$WORK/tiny-qwen3"

echo "== 2. its logits for two packed documents (ids 256 = <|endoftext|>)"
"$BIN/retain-forward" --model "$WORK/tiny-qwen3" \
  --ids "72 101 108 108 111 256 87 111 114 108 100 256" \
  --doc-ids "0 0 0 0 0 0 1 1 1 1 1 1" \
  --out "$WORK/logits.safetensors"
echo "quickstart: done; logits are in $WORK/logits.safetensors"
