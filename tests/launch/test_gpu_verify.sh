#!/usr/bin/env bash
# launch/gpu-verify.sh without a GPU: (1) every GPU test program that the tests' CMake files
# build is bundled by gpu-bundle.sh and run by gpu-verify.sh; (2) on a fake bundle of stub
# programs, the verdicts: an expected skip passes, any other skip fails its step, a failing
# program fails, the exit status is 1, and what comes back ($OUT) is two files whose archive
# holds the logs; (3) --deadline cuts the running step and leaves the rest NOT RUN (exit 3);
# (4) usage errors exit 2 with one line; (5) trainer/bench/train_table.py's target verdicts;
# (6) trainer/bench/fsdp_estimate.py's arithmetic.
# usage: test_gpu_verify.sh REPO_ROOT
set -uo pipefail
repo=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAILED: $1"; fails=$((fails + 1)); fi; }

# (1) Coverage: the GPU test programs named in the CMake files (test_*cuda*, and the long test).
gpu_tests=$(grep -rhoE '\btest_[a-z0-9_]*cuda[a-z0-9_]*\b' "$repo"/tests --include=CMakeLists.txt | sort -u)
gpu_tests+=$'\n'test_gated_attention_long
dry=$("$repo/launch/gpu-verify.sh" --dry-run --bundle "$tmp/none"); rc=$?
check "dry run exits 0" '[ $rc -eq 0 ]'
bins=$(sed -n '/^bins=(/,/)/p' "$repo/launch/gpu-bundle.sh")
for t in $gpu_tests; do
  check "gpu-verify runs $t" 'grep -q "/bin/$t " <<<"$dry"'
  check "gpu-bundle packs $t" 'grep -qw "$t" <<<"$bins"'
done

# (2) Verdicts on stub programs.
b=$tmp/bundle
mkdir -p "$b/bin" "$b/lib"
for t in $gpu_tests; do printf '#!/bin/sh\necho "[  PASSED  ] 1 test."\n' >"$b/bin/$t"; done
printf '#!/bin/sh\necho "[  SKIPPED ] StepCudaNoDevice.DeviceWeightsWithoutAGpuSayWhy (0 ms)"\n' >"$b/bin/test_step_cuda"
printf '#!/bin/sh\necho "[  SKIPPED ] GatedAttentionCudaWgmma.SmallShapes/0 (0 ms)"\n' >"$b/bin/test_gated_attention_cuda"
printf '#!/bin/sh\necho "[  FAILED  ] CapacityCuda.X"\nexit 1\n' >"$b/bin/test_capacity_cuda"
chmod +x "$b/bin/"*
out=$tmp/out
TMPDIR=$tmp "$repo/launch/gpu-verify.sh" --bundle "$b" --out "$out" --work "$tmp/work" --only emu,kernels,step \
  >"$tmp/run.txt" 2>&1
rc=$?
s=$(cat "$out/summary.txt" 2>/dev/null)
check "a failure makes exit 1 (got $rc)" '[ $rc -eq 1 ]'
check "an expected skip passes" 'grep -Eq "^test_step_cuda \(the training step vs the CPU step\) +PASS" <<<"$s"'
check "an unexpected skip fails its step and is named" \
  'grep -q "test_gated_attention_cuda.*SKIPS(1)" <<<"$s" && grep -q "skipped: GatedAttentionCudaWgmma.SmallShapes/0" <<<"$s"'
check "a failing program fails" 'grep -q "test_capacity_cuda.*FAIL(rc=1)" <<<"$s"'
check "two files come back" '[ "$(ls "$out" | wc -l)" -eq 2 ]'
check "the archive holds the log" 'tar -xzOf "$out/gpu-verify.tar.gz" ./tests.log | grep -q "CapacityCuda.X"'

# (3) The deadline: the first step is cut, the rest do not run, exit 3.
printf '#!/bin/sh\nsleep 60\n' >"$b/bin/test_cuda_emu"
printf '#!/bin/sh\necho "[  PASSED  ] 1 test."\n' >"$b/bin/test_capacity_cuda"
TMPDIR=$tmp "$repo/launch/gpu-verify.sh" --bundle "$b" --out "$out" --work "$tmp/work" --only emu,step \
  --deadline 32 >"$tmp/run.txt" 2>&1
rc=$?
s=$(cat "$out/summary.txt" 2>/dev/null)
check "an incomplete run exits 3 (got $rc)" '[ $rc -eq 3 ]'
check "the running step is cut" 'grep -q "test_cuda_emu.*CUT(deadline)" <<<"$s"'
check "later steps are listed as not run" '[ "$(grep -c "NOT RUN(deadline)" <<<"$s")" -eq 3 ]'

# (4) Usage errors.
for args in "--only bogus" "--deadline soon" "--iters 0" "--train-models 7B" "--frobnicate" "--out"; do
  # shellcheck disable=SC2086
  err=$("$repo/launch/gpu-verify.sh" $args 2>&1 >/dev/null); rc=$?
  check "'$args' is a usage error" '[ $rc -eq 2 ] && [ "$(wc -l <<<"$err")" -eq 1 ] && grep -q "^gpu-verify: " <<<"$err"'
done

# (5) train_table.py: the 4B rows at 128K get verdicts; other rows none.
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

# (6) fsdp_estimate.py's arithmetic on a hand-computed case: layer 181,200 B (bf16 projections
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

[ "$fails" -eq 0 ] && echo "test_gpu_verify: all checks passed" || { echo "test_gpu_verify: $fails failed"; exit 1; }
