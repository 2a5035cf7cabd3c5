#!/usr/bin/env bash
# Configures and builds retain into build/ (Release, Ninja, warnings as errors).
# Extra arguments are passed to `cmake --build` (e.g. a target list: --target retain-forward).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DRETAIN_WERROR=ON
fi
cmake --build "$BUILD_DIR" --parallel "$(nproc)" "$@"
