#!/usr/bin/env bash
# Issue 13's overlap on one GPU: FSDP forced to gather through NCCL in a one-rank world (a
# device-to-device copy, not a transfer between GPUs), Qwen3-4B at 32K, 4 steps: per-layer
# compute beside its gather, and what of the gather the step still waited for
# (comm_exposed_ms), as FIGURE lines.
set -euo pipefail
dir=$(launch/gpu-steps/qwen3-shape.sh 4B)
ov=$WORK/overlap
rm -rf "$ov" && mkdir -p "$ov"
"$BIN/retain-eval" --model "$dir" --task recall --context 32000 --pairs 8 --queries 4 --samples 4 --seed 1 \
  --dump-task "$ov/t.jsonl"
"$BIN/retain-pack" --tokenizer "$dir" --seq-len 32768 --packing bfd --seed 1 --quiet --out "$ov/t.h5" "$ov/t.jsonl"
"$BIN/retain-train" --device cuda --fsdp-force-gather --model "$dir" --data "$ov/t.h5" --out "$ov/run" --steps 4 \
  --global-batch 1 --save-every 1000 --log-every 1
python3 - "$ov/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])][1:]  # step 1 learns the prefetch order
rows = [r for r in rows if r.get("comm_ms") is not None and r.get("comm_exposed_ms") is not None]
if not rows:
    sys.exit("overlap: no step with comm_ms in metrics.jsonl")
step = sum(1e3 * r["step_seconds"] for r in rows) / len(rows)
comm = sum(r["comm_ms"] for r in rows) / len(rows)
exposed = sum(r["comm_exposed_ms"] for r in rows) / len(rows)
print(f"overlap, Qwen3-4B 32K, 1 GPU forced gather: step {step:.1f} ms, gathers {comm:.1f} ms, exposed "
      f"{exposed:.1f} ms = {100 * exposed / step:.2f}% of the step (steps 2-{1 + len(rows)})")
print(f"FIGURE step_ms={step:.1f}")
print(f"FIGURE gather_ms={comm:.1f}")
print(f"FIGURE exposed_pct={100 * exposed / step:.2f}")
PY
