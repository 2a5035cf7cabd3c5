#!/usr/bin/env bash
# The whole GPU verification, phase by phase, most important first: the emulator's reading of
# the hardware, the CUDA kernel and op tests against the CPU, the training step against the CPU
# step, retain-train on the GPU (1,000-step loss curves), the communicator and FSDP on device
# buffers, compute-sanitizer on small shapes, 32K/128K attention against float64, the training
# step at Qwen3 shapes (retain-bench train, with the issue's 50 GB / 60 s verdicts), the
# attention benchmark against FlexAttention and cuDNN/flash SDPA, Nsight Compute metrics, and
# the training step against the TRIM-KV authors' trainer on the same shapes and tokens.
#
# usage: launch/gpu-verify.sh [--bundle DIR] [--out DIR] [--work DIR] [--only PHASES]
#                             [--deadline SECONDS] [--dry-run] [--seq LIST] [--iters N]
#                             [--train-models LIST]
#   --bundle DIR    run the programs of a launch/gpu-bundle.sh folder (a GPU machine without
#                   retain's build dependencies; DIR.tar.xz is unpacked first), and its Open MPI
#                   (DIR/mpi/env.sh) where it has one; cuBLAS and NCCL come from this machine's
#                   CUDA or Python packages; default: build with launch/build.sh, use build/bin
#   --out DIR       what comes back (default $OUT if set, else build/gpu-verify): summary.txt and
#                   gpu-verify.tar.gz (every log and JSON), both rewritten after every step, so a
#                   call cut off at its time limit still returns what finished
#   --work DIR      logs, JSON and the Qwen3-shaped models (default ${TMPDIR:-/tmp}/retain-gpu-verify)
#   --only LIST     comma-separated phases, run in the order below (default: all of them):
#                   emu kernels step train-tests comm sanitizers long train bench ncu reference
#                   or one of the parts sized for a device lease (30 minutes, 10 per call):
#                   part1 = emu,kernels,step,train-tests,comm,sanitizers   (correctness)
#                   part2 = train                                          (issue 12's targets)
#                   part3 = bench,long,ncu                                 (speed, long T)
#                   part4 = reference: retain vs the TRIM-KV authors' trainer (issue 14; needs
#                   the wheels of launch/gpu-wheels.sh carried as .whl/; resumes over calls)
#   --deadline S    start no step after S seconds and cut the running one there (a device call
#                   gets 600: give ~560); steps left are listed as NOT RUN
#   --dry-run       print the steps (phase, name, time limit, command) and run nothing
#   --seq LIST      attention benchmark lengths (default 8192,32768,131072)
#   --iters N       timed benchmark iterations (default 5)
#   --train-models LIST  Qwen3 shapes of the train phase, in order (default 4B,1.7B,0.6B)
# Exit status: 0 every step ran and passed; 1 a step failed, timed out, or skipped tests it
# should not skip on a GPU machine; 3 nothing failed but something did not run (deadline, or
# compute-sanitizer/ncu unusable on this machine); 2 a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle="" out="${OUT:-build/gpu-verify}" work="${TMPDIR:-/tmp}/retain-gpu-verify" only=all seq="8192,32768,131072"
iters=5 deadline=0 dry=0 train_models="4B,1.7B,0.6B"
usage_error() { echo "gpu-verify: $1 (see --help)" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle|--out|--work|--only|--seq|--iters|--train-models|--deadline)
      [ $# -ge 2 ] || usage_error "$1 needs a value"
      case "$1" in
        --bundle) bundle=$2 ;; --out) out=$2 ;; --work) work=$2 ;; --only) only=$2 ;; --seq) seq=$2 ;;
        --iters) iters=$2 ;; --train-models) train_models=$2 ;; --deadline) deadline=$2 ;;
      esac
      shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n 2,37p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done
all_phases="emu,kernels,step,train-tests,comm,sanitizers,long,train,bench,ncu,reference"
case "$only" in
  all) only=$all_phases ;;
  part1) only="emu,kernels,step,train-tests,comm,sanitizers" ;;
  part2) only="train" ;;
  part3) only="bench,long,ncu" ;;
  part4) only="reference" ;;
esac
for p in ${only//,/ }; do
  [[ ",$all_phases," == *",$p,"* ]] || usage_error "unknown phase '$p' in --only"
done
[[ "$deadline" =~ ^[0-9]+$ ]] || usage_error "--deadline must be whole seconds, not '$deadline'"
[[ "$iters" =~ ^[1-9][0-9]*$ ]] || usage_error "--iters must be a positive count, not '$iters'"
for m in ${train_models//,/ }; do
  case "$m" in 0.6B|1.7B|4B) ;; *) usage_error "unknown --train-models entry '$m' (0.6B, 1.7B, 4B)" ;; esac
done

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
  if [[ "$bundle" == *.tar.xz ]] && [ "$dry" = 0 ]; then  # the archive gpu-bundle.sh writes beside the folder
    unpacked=${TMPDIR:-/tmp}/retain-gpu-bundle
    rm -rf "$unpacked" && mkdir -p "$unpacked" && tar -C "$unpacked" -xJf "$bundle" ||
      { echo "gpu-verify: cannot unpack $bundle" >&2; exit 1; }
    bundle=$unpacked/$(basename "$bundle" .tar.xz)
  fi
  bundle=${bundle%.tar.xz}
  [ "$dry" = 1 ] || [ -d "$bundle/bin" ] || { echo "gpu-verify: $bundle/bin: no such folder (not a gpu-bundle.sh folder)" >&2; exit 1; }
  bin=$bundle/bin
  if [ "$dry" = 0 ]; then
    bundle=$(cd "$bundle" && pwd) bin=$bundle/bin
    export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    for lib in libcublasLt.so.13 libcublas.so.13 libnccl.so.2; do find_lib "$lib"; done
    # The bundled mpirun (first on PATH) and the settings that relocate it to DIR.
    # shellcheck disable=SC1091
    if [ -f "$bundle/mpi/env.sh" ]; then source "$bundle/mpi/env.sh"; fi
  fi
else
  if [ "$dry" = 0 ]; then ./launch/build.sh || { echo "gpu-verify: build failed" >&2; exit 1; }; fi
  bin=build/bin
fi
export PATH="$PATH:/usr/local/cuda/bin"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ "$dry" = 0 ]; then
  rm -rf "$work" && mkdir -p "$work" "$out" || { echo "gpu-verify: cannot create $work or $out" >&2; exit 1; }
  out=$(cd "$out" && pwd) work=$(cd "$work" && pwd)
fi
summary=$work/summary.txt
failed=0 incomplete=0 phase_now=""
[ "$dry" = 1 ] || : >"$summary"
phase() { [[ ",$only," == *",$1,"* ]] && phase_now=$1; }
note() { if [ "$dry" = 1 ]; then echo "# $*"; else echo "$*" | tee -a "$summary"; fi; }
# pack: what comes back, rewritten after every step (a device call returns at most 8 files).
pack() {
  [ "$dry" = 1 ] && return 0
  cp "$summary" "$out/summary.txt.tmp" && mv "$out/summary.txt.tmp" "$out/summary.txt"
  tar -C "$work" --exclude=./models --exclude=./reference-site -czf "$out/gpu-verify.tar.gz.tmp" . 2>/dev/null &&
    mv "$out/gpu-verify.tar.gz.tmp" "$out/gpu-verify.tar.gz"
}
# Tests that skip on a machine with one GPU by design: StepCudaNoDevice checks the no-GPU error.
# A step may allow more in SKIPS_OK (a regex of test names). Any other skip fails the step.
expected_skips='^StepCudaNoDevice\.DeviceWeightsWithoutAGpuSayWhy$'
# step NAME LOG LIMIT CMD...: runs CMD with a time limit (cut at --deadline), appends its output
# to LOG, and records PASS / FAIL / TIMEOUT / SKIPS / CUT with the wall time in the summary.
step() {
  local name=$1 log=$2 limit=$3; shift 3
  if [ "$dry" = 1 ]; then printf '%-12s | %-70s | %4ss | %s\n' "$phase_now" "$name" "$limit" "$*"; return 0; fi
  local cut=0
  if [ "$deadline" -gt 0 ]; then
    local left=$((deadline - SECONDS - 10))  # 10 s to pack what came back
    if [ "$left" -lt 20 ]; then
      printf '%-66s %-14s\n' "$name" "NOT RUN(deadline)" | tee -a "$summary"; incomplete=1; return 0
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left cut=1; fi
  fi
  local t0=$SECONDS rc start
  start=1
  if [ -f "$log" ]; then start=$(($(wc -l <"$log") + 1)); fi
  echo "=== $name: $*" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1; rc=$?
  local verdict=PASS skipped
  skipped=$(tail -n +"$start" "$log" | sed -n 's/^\[  SKIPPED \] \([A-Za-z0-9_/]*\.[A-Za-z0-9_/]*\).*/\1/p' | sort -u |
            grep -Ev "$expected_skips${SKIPS_OK:+|$SKIPS_OK}" || true)
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    if [ "$cut" = 1 ]; then verdict="CUT(deadline)"; incomplete=1; else verdict="TIMEOUT(${limit}s)"; failed=1; fi
  elif [ $rc -eq 75 ] && [ -n "${PARTIAL_OK:-}" ]; then verdict="PARTIAL(rc=75)"; incomplete=1
  elif [ $rc -ne 0 ]; then verdict="FAIL(rc=$rc)"; failed=1
  elif [ -n "$skipped" ]; then verdict="SKIPS($(wc -l <<<"$skipped"))"; failed=1; fi
  printf '%-66s %-14s %5ds\n' "$name" "$verdict" $((SECONDS - t0)) | tee -a "$summary"
  [ -z "$skipped" ] || sed 's/^/    skipped: /' <<<"$skipped" | tee -a "$summary"
  echo "=== $name: $verdict after $((SECONDS - t0)) s" >>"$log"
  pack
}
# usable TOOL LOG CMD...: whether a profiler runs on this machine at all (compute-sanitizer and
# ncu have refused some lent runtimes: "Device not supported", "LibraryNotLoaded"). A tool that
# cannot start is UNAVAILABLE (exit 3), not a kernel failure.
usable() {
  local tool=$1 log=$2; shift 2
  if [ "$dry" = 1 ]; then printf '%-12s | %-70s | %4ss | %s\n' "$phase_now" "preflight: $tool" 120 "$*"; return 0; fi
  echo "=== preflight $tool: $*" >>"$log"
  local text rc
  text=$(timeout 120 "$@" 2>&1); rc=$?
  echo "$text" >>"$log"
  if [ $rc -ne 0 ] && grep -Eqi 'not supported|LibraryNotLoaded|ERR_NVGPUCTRPERM|error 999|No such file|not found|cannot execute' <<<"$text"; then
    note "$tool cannot run on this machine (see $(basename "$log")): its steps are UNAVAILABLE"
    incomplete=1
    return 1
  fi
  return 0
}

{
  echo "gpu-verify $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') phases $only$([ "$deadline" = 0 ] || echo " deadline ${deadline}s")"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  nvcc --version 2>/dev/null | tail -1
} | if [ "$dry" = 1 ]; then sed 's/^/# /'; else tee -a "$summary"; fi
L=$work  # logs and JSON
gtest=(--gtest_color=no)

if phase emu; then
  # The CUDA emulator's reading of ldmatrix/mma.sync, wgmma, cp.async and the warp collectives
  # against the hardware: every emulated CI result rests on it.
  step "test_cuda_emu (ldmatrix + mma.sync, wgmma, shuffles, votes vs their definitions)" "$L/tests.log" 120 \
    "$bin/test_cuda_emu" "${gtest[@]}"
fi

if phase kernels; then
  log=$L/tests.log
  step "test_gated_attention_cuda (mma.sync and wgmma vs the CPU)" "$log" 300 "$bin/test_gated_attention_cuda" "${gtest[@]}"
  step "test_capacity_cuda" "$log" 300 "$bin/test_capacity_cuda" "${gtest[@]}"
  step "test_kvpop_cuda (target, mLSTM fwd/bwd vs CPU)" "$log" 300 "$bin/test_kvpop_cuda" "${gtest[@]}"
  step "test_ops_cuda (embedding, RMSNorm, RoPE, SwiGLU fwd/bwd, add vs CPU)" "$log" 300 "$bin/test_ops_cuda" "${gtest[@]}"
  step "test_gemm_cuda (cuBLASLt linear fwd/bwd, cast vs CPU)" "$log" 300 "$bin/test_gemm_cuda" "${gtest[@]}"
  step "test_loss_cuda (fused chunked KL+NTP vs CPU)" "$log" 300 "$bin/test_loss_cuda" "${gtest[@]}"
  step "test_gates_cuda (gate MLPs fwd/bwd vs CPU)" "$log" 300 "$bin/test_gates_cuda" "${gtest[@]}"
fi

if phase step; then
  log=$L/tests.log
  step "test_step_cuda (the training step vs the CPU step)" "$log" 300 "$bin/test_step_cuda" "${gtest[@]}"
  step "test_step_cuda, attention on wgmma" "$log" 300 env RETAIN_ATTENTION_FORWARD=wgmma RETAIN_ATTENTION_BACKWARD=wgmma \
    "$bin/test_step_cuda" "${gtest[@]}"
  step "test_kvpop_step_cuda (the KVPOP scorer step vs the CPU step)" "$log" 300 "$bin/test_kvpop_step_cuda" "${gtest[@]}"
fi

if phase train-tests; then
  # retain-train itself: --dump-grads cuda vs cpu, 2 ranks (mpirun) and NCCL vs 1, 1,000 steps vs the CPU run.
  step "test_train_cuda (retain-train on the GPU vs the CPU, loss curves)" "$L/tests.log" 540 \
    env RETAIN_BIN_DIR="$(cd "$bin" 2>/dev/null && pwd || echo "$bin")" \
    RETAIN_FIXTURES_DIR="$PWD/tests/fixtures" RETAIN_MPIEXEC="$(command -v mpirun || echo mpirun)" \
    RETAIN_NVTX_RECORDER="$(cd "$bin/../lib" 2>/dev/null && pwd || echo "$bin/../lib")/libretain_nvtx_recorder.so" \
    "$bin/test_train_cuda" "${gtest[@]}"
fi

if phase comm; then
  log=$L/tests.log
  step "test_comm_cuda (collectives on device buffers, NCCL, FSDP on the GPU; 1 rank)" "$log" 300 \
    env RETAIN_TEST_WORLD_SIZE=1 "$bin/test_comm_cuda" "${gtest[@]}"
  if command -v mpirun >/dev/null || [ "$dry" = 1 ]; then
    # Two ranks on one GPU: the MPI backend stages device buffers. NCCL refuses two ranks on one
    # device, so its cases skip here by design.
    SKIPS_OK='^(CommCuda\.Nccl|FsdpCuda\.Nccl)' step "test_comm_cuda (2 ranks sharing the GPU, staged MPI)" "$log" 300 \
      env RETAIN_TEST_WORLD_SIZE=2 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
      OMPI_MCA_pml=ob1 OMPI_MCA_btl_vader_single_copy_mechanism=none mpirun -np 2 --oversubscribe \
      "$bin/test_comm_cuda" "${gtest[@]}"
  else
    note "test_comm_cuda with 2 ranks: NOT RUN (no mpirun on this machine)"; incomplete=1
  fi
fi

if phase sanitizers; then
  log=$L/sanitizers.log
  if usable compute-sanitizer "$log" "$sanitizer" --tool memcheck --error-exitcode 1 "$bin/test_cuda_emu" \
       --gtest_filter='CudaEmu.ShufflesVotes*'; then
    for tool in memcheck racecheck synccheck initcheck; do
      t=${SANITIZER_TIMEOUT:-300}
      run_tool=("$sanitizer" --tool "$tool" --error-exitcode 1)
      step "compute-sanitizer $tool gated_attention (small, weight skip)" "$log" "$t" "${run_tool[@]}" \
        "$bin/test_gated_attention_cuda" --gtest_filter='GatedAttentionCuda*.SmallShapes*:GatedAttentionCuda*.WeightSkip*:GatedAttentionCuda.BadInputs*'
      step "compute-sanitizer $tool capacity (small, opt-in skip)" "$log" "$t" "${run_tool[@]}" \
        "$bin/test_capacity_cuda" --gtest_filter='Shapes/CapacityCuda.*:CapacityCuda.BadInputs*:CapacityCuda.OptInSkip*'
      step "compute-sanitizer $tool kvpop (small)" "$log" "$t" "${run_tool[@]}" \
        "$bin/test_kvpop_cuda" --gtest_filter='Small/*:KvpopCuda.BadInputs*'
      step "compute-sanitizer $tool ops" "$log" "$t" "${run_tool[@]}" "$bin/test_ops_cuda" --gtest_filter='OpsCuda.*'
      for t2 in gemm loss gates; do
        T=$(tr '[:lower:]' '[:upper:]' <<<"${t2:0:1}")${t2:1}
        step "compute-sanitizer $tool $t2" "$log" "$t" "${run_tool[@]}" "$bin/test_${t2}_cuda" --gtest_filter="${T}Cuda.*"
      done
    done
    # The multi-tile steady state (T up to 2,048, several documents), memcheck only.
    step "compute-sanitizer memcheck gated_attention (multi-tile)" "$log" "${SANITIZER_TIMEOUT:-300}" \
      "$sanitizer" --tool memcheck --error-exitcode 1 "$bin/test_gated_attention_cuda" \
      --gtest_filter='GatedAttentionCuda*.LongerSequences*'
  fi
fi

if phase long; then
  log=$L/tests.log
  step "test_gated_attention_long (32K, 128K vs float64)" "$log" 300 "$bin/test_gated_attention_long" "${gtest[@]}"
  step "test_gated_attention_long, wgmma forward and backward" "$log" 300 env RETAIN_ATTENTION_FORWARD=wgmma \
    RETAIN_ATTENTION_BACKWARD=wgmma "$bin/test_gated_attention_long" "${gtest[@]}"
fi

if phase train; then
  # The training step at Qwen3 shapes (random bf16 weights from retain-make-tiny; the step's cost
  # does not depend on the values): tokens/s, TFLOP/s, MFU, peak memory, per phase. The 4B row at
  # 128K is issue 12's target (peak <= 50 GB, step <= 60 s) and runs first.
  log=$L/train.log
  models=$work/models
  # retain-bench train's table and JSON keys on a tiny model, and MFU a number on this card (the
  # device is in trainer/flops.h's peak table), not n/a.
  step "train: retain-bench train JSON keys, MFU known on this GPU" "$log" 120 python3 tests/cuda/bench_train_check.py \
    --bin-dir "$bin" --device cuda --expect-mfu number
  [ "$dry" = 1 ] || mkdir -p "$models"
  for m in ${train_models//,/ }; do
    case "$m" in  # layers hidden heads kv-heads intermediate (head_dim 128, vocab 151936, YaRN x4)
      0.6B) shape=(--layers 28 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 3072 --tie) ;;
      1.7B) shape=(--layers 28 --hidden 2048 --heads 16 --kv-heads 8 --intermediate 6144 --tie) ;;
      4B) shape=(--layers 36 --hidden 2560 --heads 32 --kv-heads 8 --intermediate 9728 --tie) ;;
    esac
    step "train: make Qwen3-$m shapes" "$log" 300 "$bin/retain-make-tiny" --out "$models/qwen3-$m" "${shape[@]}" \
      --head-dim 128 --vocab 151936 --yarn-factor 4 --seed 1 --max-gib 16
    for gate in trimkv dbtrimkv; do
      step "train: retain-bench train Qwen3-$m $gate 128K" "$log" 300 "$bin/retain-bench" train --device cuda \
        --model "$models/qwen3-$m" --seq 131072 --gate $gate --docs 1 --iters 1 --warmup 1 \
        --json "$L/train-$m-$gate-128k.json"
    done
    for gate in trimkv dbtrimkv; do
      step "train: retain-bench train Qwen3-$m $gate 8K,32K" "$log" 300 "$bin/retain-bench" train --device cuda \
        --model "$models/qwen3-$m" --seq 8192,32768 --gate $gate --docs 1 --iters 3 --warmup 1 \
        --json "$L/train-$m-$gate.json"
    done
    # Issue 13's exposed all-gather, estimated from this GPU's 32K step for 8 ranks of one node
    # (FSDP_BUSBW: an assumed NCCL all_gather bus bandwidth, ~80% of H100 NVLink's 450 GB/s per
    # direction; replace it with all_gather_perf's busbw of the target machine).
    if [ "$dry" = 1 ] || [ -f "$L/train-$m-trimkv.json" ]; then
      step "train: FSDP exposed all-gather estimate, Qwen3-$m" "$log" 60 python3 trainer/bench/fsdp_estimate.py \
        --json "$L/train-$m-trimkv.json" --busbw "${FSDP_BUSBW:-360}" --ranks 8
      [ "$dry" = 1 ] || sed -n '/^=== train: FSDP exposed all-gather estimate, Qwen3-'"$m"'/,/^=== .*after/p' "$log" |
        grep -E '^(FSDP|  T=)' | tee -a "$summary" >/dev/null
    fi
    if [ "$m" = 4B ]; then
      # Issue 13's overlap on this GPU: FSDP forced to gather through NCCL in a one-rank world
      # (a device-to-device copy, not a transfer between GPUs): per-layer compute beside its
      # gather, and what of the gather the step still waited for (comm_exposed_ms), at 32K.
      ov=$work/overlap
      [ "$dry" = 1 ] || mkdir -p "$ov"
      step "train: overlap data: 4 recall tasks of 32K tokens" "$log" 120 "$bin/retain-eval" --model "$models/qwen3-$m" \
        --task recall --context 32000 --pairs 8 --queries 4 --samples 4 --seed 1 --dump-task "$ov/t.jsonl"
      step "train: overlap data: packed at 32K" "$log" 120 "$bin/retain-pack" --tokenizer "$models/qwen3-$m" \
        --seq-len 32768 --packing bfd --seed 1 --quiet --out "$ov/t.h5" "$ov/t.jsonl"
      step "train: retain-train --fsdp-force-gather Qwen3-4B 32K, 4 steps" "$log" 300 "$bin/retain-train" --device cuda \
        --fsdp-force-gather --model "$models/qwen3-$m" --data "$ov/t.h5" --out "$ov/run" --steps 4 --global-batch 1 \
        --save-every 1000 --log-every 1
      if [ "$dry" = 0 ] && [ -f "$ov/run/metrics.jsonl" ]; then
        python3 - "$ov/run/metrics.jsonl" <<'PY' | tee -a "$summary"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])][1:]  # step 1 learns the prefetch order
rows = [r for r in rows if r.get("comm_ms") is not None and r.get("comm_exposed_ms") is not None]
if rows:
    step = sum(1e3 * r["step_seconds"] for r in rows) / len(rows)
    comm = sum(r["comm_ms"] for r in rows) / len(rows)
    exposed = sum(r["comm_exposed_ms"] for r in rows) / len(rows)
    print(f"overlap, Qwen3-4B 32K, 1 GPU forced gather: step {step:.1f} ms, gathers {comm:.1f} ms, "
          f"exposed {exposed:.1f} ms = {100 * exposed / step:.2f}% of the step (steps 2-{1 + len(rows)})")
else:
    print("overlap: no step with comm_ms in metrics.jsonl")
PY
        grep -h 'fsdp: ' "$log" | tail -1 | tee -a "$summary"
      fi
    fi
    [ "$dry" = 1 ] || rm -rf "$models/qwen3-$m"
  done
  # The table of every row and the targets' verdicts, into the summary (a missed target is a
  # finding, not a failure of the verification).
  if [ "$dry" = 1 ]; then
    step "train: table and targets" "$log" 60 python3 trainer/bench/train_table.py "$L/train-*.json"
  elif compgen -G "$L/train-*.json" >/dev/null; then
    python3 trainer/bench/train_table.py "$L"/train-*.json >"$L/train-table.md" 2>>"$log" &&
      tee -a "$summary" <"$L/train-table.md" >/dev/null
    cat "$L/train-table.md" 2>/dev/null
    pack
  fi
fi

if phase bench; then
  log=$L/bench.log
  # retain (mma.sync, then wgmma) vs FlexAttention (the reference's score_mod) vs cuDNN and flash
  # SDPA, Qwen3-4B attention shapes, 1 and 16 documents.
  for kernels in mma wgmma; do
    for docs in 1 16; do
      step "bench: retain ($kernels) vs flex vs sdpa, docs $docs" "$log" 420 env PYTHONUNBUFFERED=1 \
        RETAIN_ATTENTION_FORWARD=$kernels RETAIN_ATTENTION_BACKWARD=$kernels python3 kernels/bench/bench_attention.py \
        --device cuda --seq "$seq" --heads 32 --kv-heads 8 --head-dim 128 --docs "$docs" --iters "$iters" --warmup 1 \
        --check --retain-bench "$bin/retain-bench" --json "$L/bench-$kernels-docs$docs.json"
    done
    step "bench: retain attention ($kernels), head_dim 64, docs 1" "$log" 300 env RETAIN_ATTENTION_FORWARD=$kernels \
      RETAIN_ATTENTION_BACKWARD=$kernels "$bin/retain-bench" attention --device cuda --seq "$seq" --heads 32 \
      --kv-heads 8 --head-dim 64 --iters "$iters" --warmup 1 --json "$L/bench-$kernels-d64.json"
  done
  # Capacity, 36 layers at 128K: the dense worst case, trained-looking gates with no tile skip
  # (E = 1e9), the exact skip (E = 60, the default) and the opt-in skip at E = 20.
  for run in initial:60 trained-like:1e9 trained-like:60 trained-like:20; do
    logbeta=${run%%:*} skip=${run##*:}
    step "bench: capacity, 36 layers at 128K, logβ $logbeta, skip e^-$skip" "$log" 300 "$bin/retain-bench" attention \
      --device cuda --seq 131072 --layers 36 --logbeta "$logbeta" --capacity-skip "$skip" --iters 3 --warmup 1 \
      --json "$L/capacity-$logbeta-e$skip.json"
  done
fi

if phase ncu; then
  log=$L/ncu.log
  # The kernels' static counts (launch/sass-report.sh), to read beside ncu's smsp__inst_executed:
  # where they disagree, the static model in docs/benchmarks.md is wrong.
  if [ "$dry" = 0 ]; then
    if [ -n "$bundle" ]; then
      if [ -f "$bundle/sass-report.txt" ]; then cp "$bundle/sass-report.txt" "$L/"; fi
    elif ! launch/sass-report.sh >"$L/sass-report.txt" 2>>"$log"; then
      note "gpu-verify: no SASS report (see ncu.log)"
    fi
  fi
  if usable ncu "$log" "$ncu" --target-processes all --metrics smsp__inst_executed.sum "$bin/test_cuda_emu" \
       --gtest_filter='CudaEmu.ShufflesVotes*'; then
    # Only the metrics this ncu knows (an unknown name fails the whole profile).
    metrics=smsp__inst_executed.sum
    known=$([ "$dry" = 1 ] || "$ncu" --query-metrics 2>/dev/null)
    for m in sm__pipe_tensor_op_hmma_cycles_active sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_cycles_active; do
      if [ "$dry" = 1 ] || grep -qw "$m" <<<"$known"; then metrics+=",$m.avg.pct_of_peak_sustained_active"; fi
    done
    sections=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --metrics "$metrics")
    for kernels in mma wgmma; do
      step "ncu: attention and capacity kernels ($kernels) at 32K, d 128" "$log" 300 env RETAIN_ATTENTION_FORWARD=$kernels \
        RETAIN_ATTENTION_BACKWARD=$kernels "$ncu" --target-processes all --kernel-name regex:'_kernel|Scan' --launch-skip 0 --launch-count 60 \
        "${sections[@]}" \
        "$bin/retain-bench" attention --device cuda --seq 32768 --iters 1 --warmup 0
    done
  fi
fi

if phase reference; then
  # Issue 14: retain's training step against the TRIM-KV authors' trainer (trimkv 0.1.5, which
  # pins transformers 4.57.1; this image has 5.x) on the same Qwen3 shapes and tokens. Their
  # packages come as wheels (launch/gpu-wheels.sh, carried as .whl/) and are installed into a
  # private folder that only the reference's Python sees. Rows accumulate in compare.json; a
  # call that runs out of time exits 75 (PARTIAL) and the next call on a still-warm machine goes
  # on from REFERENCE_DIR (or carry compare.json back in there). The table and plot are written
  # into a copy of docs/benchmarks.md in the archive, for committing from there.
  log=$L/reference.log
  wheels=${WHEELS:-.whl}
  site=$work/reference-site
  keep=${REFERENCE_DIR:-${TMPDIR:-/tmp}/retain-reference}  # survives the next call's fresh --work
  # compare_train's --time-budget under --deadline: what is left then, less 90 s for the rest
  # of the call (1: start no row); nothing without a deadline.
  time_budget() {
    [ "$deadline" -gt 0 ] || return 0
    local left=$((deadline - SECONDS - 90))
    echo "--time-budget $((left > 1 ? left : 1))"
  }
  [ "$dry" = 1 ] || mkdir -p "$keep"
  if [ "$dry" = 0 ] && ! compgen -G "$wheels/*.whl" >/dev/null; then
    note "reference: NOT RUN: no wheels in $wheels (run launch/gpu-wheels.sh here and carry .whl)"; incomplete=1
  else
    step "reference: install trimkv 0.1.5 + transformers 4.57.1 (private)" "$log" 120 python3 -m pip install --quiet \
      --no-index --no-deps --target "$site" "$wheels"/*.whl
    if [ "$dry" = 0 ]; then
      printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 "$@"\n' "$site" >"$work/reference-python"
      chmod +x "$work/reference-python"
      [ -f "$keep/benchmarks.md" ] || cp docs/benchmarks.md "$keep/benchmarks.md"
    fi
    step "reference: its python sees transformers 4.57.1" "$log" 60 "$work/reference-python" -c \
      'import transformers as t; assert t.__version__ == "4.57.1", t.__version__; print("transformers", t.__version__)'
    PARTIAL_OK=1 step "reference: compare_train Qwen3-4B,1.7B,0.6B, 8K/32K/128K, trimkv/dbtrimkv" "$log" \
      "${REFERENCE_TIMEOUT:-600}" python3 trainer/bench/compare_train.py --shapes 4B,1.7B,0.6B --device cuda \
      --python "$work/reference-python" --bin-dir "$bin" --out "$keep/compare" --keep-models "$keep/models" \
      $(time_budget) --write-docs --docs-file "$keep/benchmarks.md"
    # The loss check with a visible decay: both sides' gates with output projection 0 and bias 2
    # (logβ = logsigmoid(2) ≈ −0.127 for every token, whatever their random weights), so the
    # first-step losses show the gated math; Qwen3-0.6B at 8K, rows of its own (not in the docs).
    PARTIAL_OK=1 step "reference: compare_train Qwen3-0.6B 8K, --gate-init zero-output:2" "$log" \
      "${REFERENCE_TIMEOUT:-600}" python3 trainer/bench/compare_train.py --shapes 0.6B --seq 8192 --device cuda \
      --gate-init zero-output:2 --python "$work/reference-python" --bin-dir "$bin" --out "$keep/compare-visible" \
      --keep-models "$keep/models" $(time_budget)
    if [ "$dry" = 0 ]; then  # what comes back: the rows, the table, the plot and the docs copy
      mkdir -p "$L/reference" && cp -r "$keep/compare" "$keep/benchmarks.md" "$L/reference/" 2>/dev/null
      [ -d "$keep/compare-visible" ] && cp -r "$keep/compare-visible" "$L/reference/"
      [ -d "$keep/images" ] && cp -r "$keep/images" "$L/reference/"
      [ -f "$keep/compare/compare.md" ] && tee -a "$summary" <"$keep/compare/compare.md" >/dev/null
      [ -f "$keep/compare-visible/compare.md" ] && tee -a "$summary" <"$keep/compare-visible/compare.md" >/dev/null
      pack
    fi
  fi
fi

if [ "$dry" = 1 ]; then exit 0; fi
status=0
if [ "$failed" = 1 ]; then status=1; elif [ "$incomplete" = 1 ]; then status=3; fi
case $status in
  0) what="every step passed" ;;
  1) what="a step failed" ;;
  *) what="incomplete: nothing failed, but something did not run" ;;
esac
echo "--- gpu-verify: exit $status, $what; logs and JSON in $out/gpu-verify.tar.gz" >>"$summary"
pack
cat "$summary"
exit $status
