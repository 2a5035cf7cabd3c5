#!/usr/bin/env bash
# The GPU verification, as a ledger that every lent device call advances (docs/gpu-ledger.md):
# the steps of docs/gpu-ledger.json in priority order — the emulator's reading of the hardware
# and every kernel against the CPU, the training step against the CPU step, the headline
# attention row beside FlexAttention and cuDNN SDPA, Qwen3-4B at 128K, compute-sanitizer,
# retain-train and the communicator on the GPU, then long T, the benchmark tables, the other
# sanitizers, ncu and the TRIM-KV authors' trainer side by side — each recorded with the
# SHA-256 of its sources, so a step counts as verified only for the code it ran on.
#
# usage: launch/gpu-verify.sh (--next | --only STEPS) [--deadline S] [--bundle DIR|DIR.tar.xz]
#                             [--out DIR] [--work DIR] [--dry-run]
#        launch/gpu-verify.sh --preflight [--bundle DIR.tar.xz]   (here, before a device call)
#   --next          the steps not yet PASS for their sources, a step whose last run failed first
#   --only STEPS    comma-separated step names or prefixes (kernels = kernels.*), run even if PASS
#   --deadline S    start no step after S seconds and cut the running one there; the rest are
#                   listed NOT RUN (a device call gets at most 600 s: give 500 with timeout_s 540)
#   --bundle DIR    run the programs of a launch/gpu-bundle.sh folder (DIR.tar.xz is unpacked
#                   first) and its Open MPI; cuBLAS and NCCL come from the machine's CUDA or Python
#                   packages; runs are recorded for the sources the bundle was built from (its
#                   manifest.json); default: build with launch/build.sh and use build/bin
#   --out DIR       what comes back (default $OUT if set, else build/gpu-verify): gpu-ledger.json
#                   (take it in with `python3 launch/gpu_ledger.py absorb FILE`), gpu-ledger.md,
#                   summary.txt and gpu-verify.tar.gz (every log and JSON), rewritten after every
#                   step, so a call cut off at its limit still returns what finished
#   --work DIR      logs, JSON and the Qwen3-shaped models (default ${TMPDIR:-/tmp}/retain-gpu-verify)
#   --dry-run       print the steps that would run (name, time limit, command); run nothing
#   --preflight     no GPU needed: the bundle's manifest against this tree's sources (a stale
#                   bundle wastes the call), its size against a device call's 64 MiB, what --next runs
# Exit status: 0 every step run passed; 1 a step failed; 3 nothing failed but something did not
# run or was cut (deadline, a tool unusable on this machine); 2 a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle="" out="${OUT:-build/gpu-verify}" work="${TMPDIR:-/tmp}/retain-gpu-verify" mode="" only="" deadline=0 dry=0
usage_error() { echo "gpu-verify: $1 (see --help)" >&2; exit 2; }
set_mode() { [ -z "$mode" ] || usage_error "give one of --next, --only, --preflight"; mode=$1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle|--out|--work|--only|--deadline)
      [ $# -ge 2 ] || usage_error "$1 needs a value"
      case "$1" in
        --bundle) bundle=$2 ;; --out) out=$2 ;; --work) work=$2 ;; --deadline) deadline=$2 ;;
        --only) set_mode only; only=$2 ;;
      esac
      shift 2 ;;
    --next) set_mode next; shift ;;
    --preflight) set_mode preflight; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n 2,30p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done
[ -n "$mode" ] || usage_error "give --next, --only STEPS or --preflight"
[[ "$deadline" =~ ^[0-9]+$ ]] || usage_error "--deadline must be whole seconds, not '$deadline'"
if [ "$mode" = only ] && ! [[ "$only" =~ ^[a-z0-9][a-z0-9_.,-]*$ ]]; then
  usage_error "--only takes step names, comma-separated, not '$only'"
fi
if [ "$mode" = preflight ]; then exec python3 launch/gpu_ledger.py preflight "${bundle:-.gpu.tar.xz}"; fi

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
manifest=()
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
    [ ! -f "$bundle/manifest.json" ] || manifest=(--manifest "$bundle/manifest.json")
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
if [ "$dry" = 0 ]; then
  rm -rf "$work" && mkdir -p "$work" "$out" || { echo "gpu-verify: cannot create $work or $out" >&2; exit 1; }
  bin=$(cd "$bin" && pwd)
fi
args=(run --bin "$bin" --work "$work" --out "$out" "${manifest[@]}")
if [ "$mode" = next ]; then args+=(--next); else args+=(--only "$only"); fi
if [ "$deadline" -gt 0 ]; then
  left=$((deadline - SECONDS))  # the unpacking above came out of it
  args+=(--deadline "$((left > 1 ? left : 1))")
fi
[ "$dry" = 0 ] || args+=(--dry-run)
exec python3 launch/gpu_ledger.py "${args[@]}"
