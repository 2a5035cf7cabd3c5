#!/usr/bin/env bash
# What the CUDA kernels cost per loop iteration, read from their sm_90a SASS: registers,
# spills, and for every loop the instructions and tensor-core instructions (HMMA) issued per
# iteration on each path (kernels/cuda/sass_report.py). Needs no GPU: nvcc and cuobjdump.
#
#   launch/sass-report.sh [--kernel REGEX] [--json FILE] [--all-loops]
#
# cuobjdump and nvdisasm come from launch/cuda-tools.sh (PATH, /usr/local/cuda/bin, or NVIDIA's
# wheels unpacked into build/tools once). Builds the kernels'
# objects in ${BUILD_DIR:-build} first (./launch/build.sh configures it when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --kernel|--json) [ $# -ge 2 ] || { echo "sass-report: $1 needs a value" >&2; exit 2; }; args+=("$1" "$2"); shift 2 ;;
    --all-loops) args+=(--min-hmma 0); shift ;;
    *) echo "sass-report: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

tooldir=$(BUILD_DIR=$BUILD_DIR launch/cuda-tools.sh) || exit 1  # cuobjdump and nvdisasm
cuobjdump=$tooldir/cuobjdump
export PATH="$tooldir:$PATH"

[ -f "$BUILD_DIR/build.ninja" ] || ./launch/build.sh >&2
grep -q '^RETAIN_CUDA_EMU:BOOL=ON' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null &&
  { echo "sass-report: $BUILD_DIR is an emulator build (no SASS); use the CUDA build" >&2; exit 1; }
cmake --build "$BUILD_DIR" --target retain_attention_cuda retain_kernels >&2
mapfile -t objects < <(find "$BUILD_DIR/kernels" -name '*.cu.o' | sort)
[ ${#objects[@]} -gt 0 ] || { echo "sass-report: no CUDA objects under $BUILD_DIR/kernels (is CUDA enabled?)" >&2; exit 1; }
nvcc=$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt" | head -n 1)
echo "compiled by: $("${nvcc:-nvcc}" --version 2>/dev/null | tail -n 1)"
echo "read by cuobjdump: $("$cuobjdump" --version | tail -n 1)"
exec python3 kernels/cuda/sass_report.py --cuobjdump "$cuobjdump" "${args[@]}" "${objects[@]}"
