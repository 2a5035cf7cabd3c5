#!/usr/bin/env bash
# The scripts that turn a GPU verification step's JSON into tables and ledger figures, without a
# GPU: (1) trainer/bench/train_table.py's target verdicts; (2) trainer/bench/fsdp_estimate.py's
# arithmetic; (3) launch/gpu-steps/figures.py's FIGURE lines.
# usage: test_bench_tables.sh REPO_ROOT
set -uo pipefail
repo=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAILED: $1"; fails=$((fails + 1)); fi; }

# (1) train_table.py: the 4B rows at 128K get verdicts; other rows none.
row() {  # seq step_ms peak_gb
  printf '{"seq": %s, "gate": "trimkv", "step_ms": %s, "peak_gb": %s, "tokens_per_s": 1, "tflops": 1.0, "mfu": 0.5,
           "phase_ms": {"teacher": 1, "student": 1, "capacity": 0, "loss": 0, "backward": 1, "optimizer": 0}}' "$@"
}
printf '{"model": "%s", "device": "cuda", "rows": [%s, %s]}' "$tmp/gone/qwen3-4B" "$(row 131072 59000 51.2)" \
  "$(row 32768 9000 20)" >"$tmp/t1.json"
printf '{"model": "%s", "device": "cuda", "rows": [%s]}' "$tmp/gone/qwen3-0.6B" "$(row 131072 20000 30)" >"$tmp/t2.json"
table=$(python3 "$repo/trainer/bench/train_table.py" "$tmp/t1.json" "$tmp/t2.json"); rc=$?
check "train_table exits 0" '[ $rc -eq 0 ]'
check "train_table: one row per result" '[ "$(grep -c "^| qwen3-" <<<"$table")" -eq 3 ]'
check "train_table: the 4B 128K verdicts" \
  'grep -q "TARGET qwen3-4B trimkv T=131072: peak 51.20 GB (<= 50) MISSED; step 59.00 s (<= 60) MET" <<<"$table"'
check "train_table: only the 4B row is judged" '[ "$(grep -c "^TARGET" <<<"$table")" -eq 1 ]'
echo '{"rows": 3}' >"$tmp/bad.json"
err=$(python3 "$repo/trainer/bench/train_table.py" "$tmp/bad.json" 2>&1); rc=$?
check "train_table: a wrong file is one line naming it" '[ $rc -eq 1 ] && grep -q "bad.json: not a retain-bench train JSON" <<<"$err"'

# (2) fsdp_estimate.py's arithmetic on a hand-computed case: layer 181,200 B (bf16 projections
# 90,000 elements, F32 norms 300), embedding 200,000 B; 2 ranks at 10^6 B/s: 90.6 ms per layer,
# 100 ms per embedding gather; exposed = 3·100 + (90.6 + 3·80.6) + 90.6 + 90.6 = 813.6 ms.
mkdir -p "$tmp/m"
echo '{"hidden_size": 100, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 50,
       "intermediate_size": 200, "vocab_size": 1000, "num_hidden_layers": 4}' >"$tmp/m/config.json"
printf '{"model": "%s", "rows": [{"seq": 64, "gate": "trimkv", "step_ms": 2000,
        "phase_ms": {"teacher": 40, "student": 400, "backward": 800}}]}' "$tmp/m" >"$tmp/f.json"
est=$(python3 "$repo/trainer/bench/fsdp_estimate.py" --json "$tmp/f.json" --busbw 0.001 --ranks 2); rc=$?
check "fsdp_estimate exits 0" '[ $rc -eq 0 ]'
check "fsdp_estimate: per-layer and embedding gathers" 'grep -q "90.600 ms per layer, 100.000 ms embedding" <<<"$est"'
check "fsdp_estimate: the exposed total" 'grep -q "exposed all-gather 813.60 ms = 40.680% of the step" <<<"$est"'

# (3) figures.py: the ledger's key figures of a train, an attention and a capacity JSON.
fig=$(python3 "$repo/launch/gpu-steps/figures.py" train "$tmp/t1.json"); rc=$?
check "figures train exits 0" '[ $rc -eq 0 ]'
check "figures train: step seconds and peak" \
  'grep -qx "FIGURE 128k.trimkv.step_s=59.00" <<<"$fig" && grep -qx "FIGURE 32k.trimkv.peak_gb=20.00" <<<"$fig"'
printf '{"rows": [{"seq": 32768, "op": "gated fwd+bwd", "impl": "retain", "ms": 12.5},
                 {"seq": 32768, "op": "gated fwd+bwd", "impl": "flex", "ms": null, "note": "backward unavailable"}],
        "ratios": [{"seq": 32768, "op": "gated fwd+bwd", "retain_over_flex": 2.345, "retain_over_sdpa_cudnn": null},
                   {"seq": 32768, "op": "gated fwd", "retain_over_flex": 9, "retain_over_sdpa_cudnn": 9}]}' >"$tmp/a.json"
fig=$(python3 "$repo/launch/gpu-steps/figures.py" attention "$tmp/a.json"); rc=$?
check "figures attention: the fwd+bwd ratios only" '[ $rc -eq 0 ] && [ "$(grep -c _over_ <<<"$fig")" -eq 2 ] &&
  grep -qx "FIGURE 32k.retain_over_flex=2.35" <<<"$fig" && grep -qx "FIGURE 32k.retain_over_sdpa_cudnn=n/a" <<<"$fig" &&
  grep -qx "FIGURE 32k.retain_fwd_bwd_ms=12.50" <<<"$fig" && ! grep -q flex_fwd_bwd_ms <<<"$fig"'
printf '{"rows": [{"seq": 131072, "op": "capacity fwd+bwd (L=36)", "ms": 30.0, "share_of_gated_fwd_bwd": 0.0212}]}' >"$tmp/c.json"
fig=$(python3 "$repo/launch/gpu-steps/figures.py" capacity "$tmp/c.json"); rc=$?
check "figures capacity: the share" '[ $rc -eq 0 ] && grep -qx "FIGURE 128k.capacity_share_pct=2.12" <<<"$fig"'
err=$(python3 "$repo/launch/gpu-steps/figures.py" train "$tmp/bad.json" 2>&1); rc=$?
check "figures: a wrong file is one line naming it" '[ $rc -eq 1 ] && [ "$(wc -l <<<"$err")" -eq 1 ] && grep -q "bad.json" <<<"$err"'

[ "$fails" -eq 0 ] && echo "test_bench_tables: all checks passed" || { echo "test_bench_tables: $fails failed"; exit 1; }
