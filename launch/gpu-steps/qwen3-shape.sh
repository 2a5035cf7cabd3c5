#!/usr/bin/env bash
# Makes a Qwen3-shaped model with random bf16 weights (retain-make-tiny; a training step's cost
# does not depend on the values) once per device call in $WORK/models/qwen3-NAME, and prints
# its folder. usage: qwen3-shape.sh 0.6B|1.7B|4B
set -euo pipefail
case "${1:-}" in  # layers hidden heads kv-heads intermediate (head_dim 128, vocab 151936, YaRN x4)
  0.6B) shape=(--layers 28 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 3072 --tie) ;;
  1.7B) shape=(--layers 28 --hidden 2048 --heads 16 --kv-heads 8 --intermediate 6144 --tie) ;;
  4B) shape=(--layers 36 --hidden 2560 --heads 32 --kv-heads 8 --intermediate 9728 --tie) ;;
  *) echo "qwen3-shape.sh: usage: qwen3-shape.sh 0.6B|1.7B|4B" >&2; exit 2 ;;
esac
dir=$WORK/models/qwen3-$1
if [ ! -f "$dir/.complete" ]; then
  rm -rf "$dir" && mkdir -p "$WORK/models"
  "$BIN/retain-make-tiny" --out "$dir" "${shape[@]}" --head-dim 128 --vocab 151936 --yarn-factor 4 --seed 1 \
    --max-gib 16 >&2
  touch "$dir/.complete"
fi
echo "$dir"
