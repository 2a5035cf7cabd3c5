#!/usr/bin/env bash
# Configures and builds retain into build/ (Release, Ninja, warnings as errors).
# Extra arguments are passed to `cmake --build` (e.g. a target list: --target retain-forward).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# ccache where installed (launch/install-deps.sh installs it): rebuilds after a branch switch,
# and launch/test-emu.sh's build-emu/, whose non-CUDA objects are this build's.
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DRETAIN_WERROR=ON ${launcher[@]+"${launcher[@]}"}
fi
cmake --build "$BUILD_DIR" --parallel "$(nproc)" "$@"
