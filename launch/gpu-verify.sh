#!/usr/bin/env bash
# The whole GPU verification in one call: the CUDA kernel tests (small shapes, long packed
# sequences vs float64), compute-sanitizer memcheck/racecheck/synccheck/initcheck on small
# shapes, the attention benchmark against FlexAttention and SDPA (Qwen3-4B shapes, 1 and 16
# documents), the communicator and FSDP on device buffers (one rank; two ranks sharing the GPU
# where mpirun exists, a bundle's own Open MPI included), the training step at Qwen3 shapes
# (retain-bench train), and Nsight Compute metrics of the attention kernels. Logs and JSON
# under --out, a summary table printed last (and in OUT/summary.txt).
#
# usage: launch/gpu-verify.sh [--bundle DIR] [--out DIR] [--only PHASES] [--seq LIST] [--iters N]
#   --bundle DIR  run the programs of a launch/gpu-bundle.sh folder (a GPU machine without
#                 retain's build dependencies; DIR.tar.xz is unpacked first), and its Open MPI
#                 (DIR/mpi/env.sh) where it has one; cuBLAS and NCCL come from this machine's
#                 CUDA or Python packages; default: build with launch/build.sh, use build/bin
#   --out DIR     where logs go (default $OUT if set, else build/gpu-verify)
#   --only LIST   comma-separated phases: tests,sanitizers,bench,train,ncu (default all)
#   --train-models LIST  Qwen3 shapes for the train phase: 0.6B,1.7B,4B (default all three)
#   --seq LIST    benchmark sequence lengths (default 8192,32768,131072)
#   --iters N     timed benchmark iterations (default 5)
# Exit status: 0 when every phase that ran passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle="" out="${OUT:-build/gpu-verify}" only="tests,sanitizers,bench,train,ncu" seq="8192,32768,131072" iters=5
train_models="0.6B,1.7B,4B"
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --seq) seq=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --train-models) train_models=$2; shift 2 ;;
    -h|--help) sed -n 2,21p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-verify: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
# find_lib NAME: adds the folder of this machine's NAME (a CUDA library the bundle leaves out)
# to LD_LIBRARY_PATH unless the loader already finds it: CUDA's folders, then Python packages.
find_lib() {
  ldconfig -p 2>/dev/null | grep -q "$1" && return 0
  local d f
  for d in ${LD_LIBRARY_PATH//:/ } /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
           $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    f=$(find "$d" -maxdepth 5 -name "$1*" -print -quit 2>/dev/null)
    if [ -n "$f" ]; then
      case ":${LD_LIBRARY_PATH:-}:" in *":$(dirname "$f"):"*) ;; *) export LD_LIBRARY_PATH="$(dirname "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
      return 0
    fi
  done
  echo "gpu-verify: $1 not found on this machine (CUDA or Python packages): programs that need it will fail" >&2
}
if [ -n "$bundle" ]; then
  if [[ "$bundle" == *.tar.xz ]]; then  # the archive gpu-bundle.sh writes beside the folder
    unpacked=${TMPDIR:-/tmp}/retain-gpu-bundle
    rm -rf "$unpacked" && mkdir -p "$unpacked" && tar -C "$unpacked" -xJf "$bundle" ||
      { echo "gpu-verify: cannot unpack $bundle" >&2; exit 1; }
    bundle=$unpacked/$(basename "$bundle" .tar.xz)
  fi
  bundle=$(cd "$bundle" && pwd)
  bin=$bundle/bin
  export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  for lib in libcublasLt.so.13 libcublas.so.13 libnccl.so.2; do find_lib "$lib"; done
  # The bundled mpirun (first on PATH) and the settings that relocate it to DIR.
  # shellcheck disable=SC1091
  if [ -f "$bundle/mpi/env.sh" ]; then source "$bundle/mpi/env.sh"; fi
else
  ./launch/build.sh || { echo "gpu-verify: build failed" >&2; exit 1; }
  bin=build/bin
fi
export PATH="$PATH:/usr/local/cuda/bin"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
summary=$out/summary.txt
: >"$summary"
status=0
phase() { [[ ",$only," == *",$1,"* ]]; }
# step NAME LOG TIMEOUT CMD...: runs CMD with a time limit, appends its output to LOG, records
# PASS/FAIL/TIMEOUT with the wall time in the summary.
step() {
  local name=$1 log=$2 limit=$3; shift 3
  local t0=$SECONDS rc
  echo "=== $name: $*" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1; rc=$?
  local verdict=PASS
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMEOUT(${limit}s)"; status=1
  elif [ $rc -ne 0 ]; then verdict="FAIL(rc=$rc)"; status=1; fi
  printf '%-58s %-14s %5ds\n' "$name" "$verdict" $((SECONDS - t0)) | tee -a "$summary"
  echo "=== $name: $verdict after $((SECONDS - t0)) s" >>"$log"
}

{
  echo "gpu-verify $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  nvcc --version 2>/dev/null | tail -1
} | tee -a "$summary"

if phase tests; then
  log=$out/tests.log
  # First: the CUDA emulator's reading of ldmatrix/mma.sync, wgmma and the warp collectives against the
  # hardware (tests/cuda_emu) — what CI's emulated GPU tests rest on.
  step "test_cuda_emu (ldmatrix + mma.sync, wgmma, shuffles, votes vs their definitions)" "$log" 120 \
    "$bin/test_cuda_emu" --gtest_color=no
  step "test_gated_attention_cuda" "$log" 600 "$bin/test_gated_attention_cuda" --gtest_color=no
  step "test_capacity_cuda" "$log" 600 "$bin/test_capacity_cuda" --gtest_color=no
  step "test_kvpop_cuda (target, mLSTM fwd/bwd vs CPU)" "$log" 600 "$bin/test_kvpop_cuda" --gtest_color=no
  step "test_ops_cuda (embedding, RMSNorm, RoPE, SwiGLU fwd/bwd, add vs CPU)" "$log" 600 "$bin/test_ops_cuda" --gtest_color=no
  step "test_gemm_cuda (cuBLASLt linear fwd/bwd, cast vs CPU)" "$log" 600 "$bin/test_gemm_cuda" --gtest_color=no
  step "test_loss_cuda (fused chunked KL+NTP vs CPU)" "$log" 600 "$bin/test_loss_cuda" --gtest_color=no
  step "test_gates_cuda (gate MLPs fwd/bwd vs CPU)" "$log" 600 "$bin/test_gates_cuda" --gtest_color=no
  step "test_step_cuda (the training step vs the CPU step)" "$log" 600 "$bin/test_step_cuda" --gtest_color=no
  step "test_kvpop_step_cuda (the KVPOP scorer step vs the CPU step)" "$log" 300 "$bin/test_kvpop_step_cuda" --gtest_color=no
  step "test_step_cuda, attention on wgmma" "$log" 600 env RETAIN_ATTENTION_FORWARD=wgmma RETAIN_ATTENTION_BACKWARD=wgmma \
    "$bin/test_step_cuda" --gtest_color=no
  step "test_gated_attention_long (32K, 128K vs float64)" "$log" 600 "$bin/test_gated_attention_long" --gtest_color=no
  step "test_gated_attention_long, wgmma forward and backward" "$log" 600 env RETAIN_ATTENTION_FORWARD=wgmma \
    RETAIN_ATTENTION_BACKWARD=wgmma "$bin/test_gated_attention_long" --gtest_color=no
  # retain-train itself: --dump-grads cuda vs cpu, 2 ranks (mpirun) and NCCL vs 1, 1,000 steps vs the CPU run.
  step "test_train_cuda (retain-train on the GPU vs the CPU)" "$log" 600 env RETAIN_BIN_DIR="$(cd "$bin" && pwd)" \
    RETAIN_FIXTURES_DIR="$PWD/tests/fixtures" RETAIN_MPIEXEC="$(command -v mpirun || echo mpirun)" \
    "$bin/test_train_cuda" --gtest_color=no
  step "test_comm_cuda (collectives on device buffers, NCCL, FSDP on the GPU; 1 rank)" "$log" 300 \
    env RETAIN_TEST_WORLD_SIZE=1 "$bin/test_comm_cuda" --gtest_color=no
  if command -v mpirun >/dev/null; then  # two ranks on one GPU: the MPI backend stages device buffers
    step "test_comm_cuda (2 ranks sharing the GPU, staged MPI)" "$log" 300 env RETAIN_TEST_WORLD_SIZE=2 \
      OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 \
      OMPI_MCA_btl_vader_single_copy_mechanism=none mpirun -np 2 --oversubscribe "$bin/test_comm_cuda" --gtest_color=no
  else
    echo "test_comm_cuda with 2 ranks: not run (no mpirun on this machine)" | tee -a "$summary"
  fi
  grep -q "SKIPPED" "$log" && { echo "gpu-verify: some GPU tests skipped (see tests.log)" | tee -a "$summary"; status=1; }
fi

if phase sanitizers; then
  log=$out/sanitizers.log
  for tool in memcheck racecheck synccheck initcheck; do
    step "compute-sanitizer $tool gated_attention (small)" "$log" "${SANITIZER_TIMEOUT:-600}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      "$bin/test_gated_attention_cuda" --gtest_filter='GatedAttentionCuda*.SmallShapes*:GatedAttentionCuda.BadInputs*'
    step "compute-sanitizer $tool capacity (small)" "$log" "${SANITIZER_TIMEOUT:-600}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      "$bin/test_capacity_cuda" --gtest_filter='Shapes/CapacityCuda.*:CapacityCuda.BadInputs*'
    step "compute-sanitizer $tool kvpop (small)" "$log" "${SANITIZER_TIMEOUT:-600}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      "$bin/test_kvpop_cuda" --gtest_filter='Small/*:KvpopCuda.BadInputs*'
    step "compute-sanitizer $tool ops (small)" "$log" "${SANITIZER_TIMEOUT:-600}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      "$bin/test_ops_cuda" --gtest_filter='OpsCuda.*'
    for t in gemm loss gates; do
      T=$(tr '[:lower:]' '[:upper:]' <<<"${t:0:1}")${t:1}
      step "compute-sanitizer $tool $t" "$log" "${SANITIZER_TIMEOUT:-600}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
        "$bin/test_${t}_cuda" --gtest_filter="${T}Cuda.*"
    done
  done
fi

if phase bench; then
  log=$out/bench.log
  for docs in 1 16; do
    step "bench: retain vs flex vs sdpa, docs $docs" "$log" 900 env PYTHONUNBUFFERED=1 python3 kernels/bench/bench_attention.py \
      --device cuda --seq "$seq" --heads 32 --kv-heads 8 --head-dim 128 --docs "$docs" --iters "$iters" --warmup 1 \
      --check --retain-bench "$bin/retain-bench" --json "$out/bench-docs$docs.json"
  done
  # The kernels on wgmma (RETAIN_ATTENTION_FORWARD/BACKWARD=wgmma) against the default mma.sync ones,
  # same shapes, one after the other.
  step "bench: retain attention, wgmma forward and backward, docs 1" "$log" 600 env RETAIN_ATTENTION_FORWARD=wgmma \
    RETAIN_ATTENTION_BACKWARD=wgmma "$bin/retain-bench" \
    attention --device cuda --seq "$seq" --heads 32 --kv-heads 8 --head-dim 128 --iters "$iters" --warmup 1 \
    --json "$out/bench-wgmma-docs1.json"
  step "bench: retain attention, mma.sync forward and backward, docs 1" "$log" 600 "$bin/retain-bench" \
    attention --device cuda --seq "$seq" --heads 32 --kv-heads 8 --head-dim 128 --iters "$iters" --warmup 1 \
    --json "$out/bench-mma-docs1.json"
  # The dense worst case, the exact tile skip with trained-looking gates, and the opt-in skip at E = 20.
  for run in initial:60 trained-like:60 trained-like:20; do
    logbeta=${run%%:*} skip=${run##*:}
    step "bench: capacity, 36 layers at 128K, logβ $logbeta, skip e^-$skip" "$log" 300 "$bin/retain-bench" attention \
      --device cuda --seq 131072 --layers 36 --logbeta "$logbeta" --capacity-skip "$skip" --iters 3 --warmup 1 \
      --json "$out/capacity-$logbeta-e$skip.json"
  done
fi

if phase train; then
  # The training step at Qwen3 shapes (random bf16 weights from retain-make-tiny; the step's cost
  # does not depend on the values): tokens/s, TFLOP/s, MFU, peak memory, per phase.
  log=$out/train.log
  models=$out/models
  mkdir -p "$models"
  for m in ${train_models//,/ }; do
    case "$m" in  # layers hidden heads kv-heads intermediate (head_dim 128, vocab 151936, YaRN x4)
      0.6B) shape="--layers 28 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 3072 --tie" ;;
      1.7B) shape="--layers 28 --hidden 2048 --heads 16 --kv-heads 8 --intermediate 6144 --tie" ;;
      4B) shape="--layers 36 --hidden 2560 --heads 32 --kv-heads 8 --intermediate 9728 --tie" ;;
      *) echo "gpu-verify: unknown --train-models entry '$m'" >&2; status=1; continue ;;
    esac
    # shellcheck disable=SC2086
    step "train: make Qwen3-$m shapes" "$log" 600 "$bin/retain-make-tiny" --out "$models/qwen3-$m" $shape \
      --head-dim 128 --vocab 151936 --yarn-factor 4 --seed 1
    for gate in trimkv dbtrimkv; do
      step "train: retain-bench train Qwen3-$m $gate 8K,32K" "$log" 600 "$bin/retain-bench" train --device cuda \
        --model "$models/qwen3-$m" --seq 8192,32768 --gate $gate --docs 1 --iters 3 --warmup 1 \
        --json "$out/train-$m-$gate.json"
    done
    step "train: retain-bench train Qwen3-$m trimkv 128K" "$log" 600 "$bin/retain-bench" train --device cuda \
      --model "$models/qwen3-$m" --seq 131072 --gate trimkv --docs 1 --iters 2 --warmup 1 --json "$out/train-$m-128k.json"
    rm -rf "$models/qwen3-$m"
  done
fi

if phase ncu; then
  log=$out/ncu.log
  # The same kernels' static counts (launch/sass-report.sh), to read beside ncu's
  # smsp__inst_executed: where they disagree, the static model in docs/benchmarks.md is wrong.
  if [ -n "$bundle" ]; then
    if [ -f "$bundle/sass-report.txt" ]; then cp "$bundle/sass-report.txt" "$out/"; fi
  elif ! launch/sass-report.sh >"$out/sass-report.txt" 2>>"$log"; then
    echo "gpu-verify: no SASS report (see ncu.log)" | tee -a "$summary"
  fi
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  step "ncu: attention and capacity kernels at 32K" "$log" 600 "$ncu" --target-processes all \
    --kernel-name regex:'forward_kernel|dq_kernel|dkdv_kernel|delta_kernel|sums_kernel|grads_kernel' --launch-skip 0 --launch-count 12 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    "$bin/retain-bench" attention --device cuda --seq 32768 --iters 1 --warmup 0
  step "ncu: the wgmma kernels at 32K" "$log" 300 env RETAIN_ATTENTION_FORWARD=wgmma RETAIN_ATTENTION_BACKWARD=wgmma \
    "$ncu" --target-processes all --kernel-name regex:'_wgmma_kernel' --launch-skip 0 --launch-count 6 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    "$bin/retain-bench" attention --device cuda --seq 32768 --iters 1 --warmup 0
fi

echo "--- gpu-verify summary (logs in $out)"
cat "$summary"
exit $status
