#!/usr/bin/env bash
# Nsight Compute over the attention and capacity kernels of one retain-bench run at 32K (d 128),
# with RETAIN_ATTENTION_FORWARD/BACKWARD=KERNELS, beside the kernels' static SASS counts of
# launch/sass-report.sh (the bundle's sass-report.txt). Exit 69 (UNAVAILABLE) when ncu cannot
# read counters here ("LibraryNotLoaded", ERR_NVGPUCTRPERM). usage: ncu.sh mma|wgmma
set -uo pipefail
kernels=$1
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
probe=$(timeout 120 "$ncu" --target-processes all --metrics smsp__inst_executed.sum "$BIN/test_cuda_emu" \
        --gtest_filter='CudaEmu.ShufflesVotes*' 2>&1); rc=$?
if [ $rc -ne 0 ] || grep -Eqi 'LibraryNotLoaded|ERR_NVGPUCTRPERM|not supported' <<<"$probe"; then
  echo "$probe"
  echo "ncu.sh: Nsight Compute cannot profile on this machine"
  exit 69
fi
if [ -f "$BIN/../sass-report.txt" ]; then cp "$BIN/../sass-report.txt" "$WORK/"; fi
# Only the metrics this ncu knows (an unknown name fails the whole profile).
metrics=smsp__inst_executed.sum
known=$("$ncu" --query-metrics 2>/dev/null)
for m in sm__pipe_tensor_op_hmma_cycles_active sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_cycles_active; do
  if grep -qw "$m" <<<"$known"; then metrics+=",$m.avg.pct_of_peak_sustained_active"; fi
done
exec env RETAIN_ATTENTION_FORWARD="$kernels" RETAIN_ATTENTION_BACKWARD="$kernels" "$ncu" --target-processes all \
  --kernel-name regex:'_kernel|Scan' --launch-skip 0 --launch-count 60 --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section LaunchStats --metrics "$metrics" \
  "$BIN/retain-bench" attention --device cuda --seq 32768 --iters 1 --warmup 0
