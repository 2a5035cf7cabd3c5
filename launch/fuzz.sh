#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser (docs/reliability.md).
#   launch/fuzz.sh [SECONDS] [TARGET...]
# builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan, every library
# instrumented) into build-fuzz/ (FUZZ_BUILD_DIR), replays their seeds and committed regression
# inputs, then fuzzes each target for SECONDS (default 10) one after the other. Found inputs
# are kept in build-fuzz/fuzz/<target>/corpus for the next run; a crash leaves
# build-fuzz/fuzz/<target>/crash-* and a non-zero exit. A long run, e.g. overnight:
#   launch/fuzz.sh 3600
# FUZZ_CI=1 (launch/test.sh): each target tries its fixed CI_RUNS inputs from the seeds alone
# with seed RETAIN_FUZZ_SEED (repeatable: what CI tries; tests/fuzz/run_fuzz.sh), and the
# targets that also find bugs of libraries retain cannot fix (THIRD_PARTY_FINDINGS in
# tests/fuzz/CMakeLists.txt: libhdf5) are only replayed.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
shift || true
build=${FUZZ_BUILD_DIR:-build-fuzz}

if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: installing clang (Debian's libFuzzer, ASan and UBSan runtimes come with it)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends clang libclang-rt-dev libomp-dev
fi

# No CUDA, no -Werror (clang's warning set differs from the gcc build CI checks): only the
# fuzz targets and the libraries they link are built.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CUDA_COMPILER= -DRETAIN_FUZZ=ON -DRETAIN_ASAN_TESTS=OFF \
  -DRETAIN_FUZZ_SECONDS="$seconds" >/dev/null
cmake --build "$build" --target retain_fuzz_targets

filter="fuzz\\."
if [ $# -gt 0 ]; then filter="fuzz\\.($(IFS='|'; echo "$*"))\\."; fi
# Serial when exploring: each fuzzer gets a whole core and the per-target numbers stay
# comparable. Under FUZZ_CI each target runs its fixed inputs (the same whatever else runs), so
# the targets share the cores: 2 at once halved this stage's fuzzing on CI's 2 cores.
exclude=()
parallel=1
if [ "${FUZZ_CI:-0}" = 1 ]; then exclude=(-LE fuzz_third_party); parallel=$(nproc); fi
ctest --test-dir "$build" -L fuzz "${exclude[@]}" -R "$filter" --output-on-failure --parallel "$parallel"
