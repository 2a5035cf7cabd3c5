#!/usr/bin/env bash
# The whole test suite: dependencies -> configure -> build -> every test through CTest
# (unit tests, AddressSanitizer tests, and multi-rank tests under mpirun -np 2).
set -euo pipefail
cd "$(dirname "$0")/.."
./launch/install-deps.sh
./launch/build.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure --timeout 600 --parallel "$(nproc)" "$@"
