#!/bin/sh
# compute-sanitizer over a CUDA test binary, or exit 77 (CTest: skipped) when the machine has no
# CUDA device. usage: run_sanitizer.sh SANITIZER TOOL BINARY PRESENCE_TEST GTEST_FILTER
# PRESENCE_TEST is a DISABLED_ test of BINARY that fails without a device.
sanitizer=$1 tool=$2 binary=$3 presence=$4 filter=$5
if ! "$binary" --gtest_also_run_disabled_tests --gtest_filter="$presence" >/dev/null 2>&1; then
  echo "no CUDA device: compute-sanitizer --tool $tool skipped"
  exit 77
fi
exec "$sanitizer" --tool "$tool" --error-exitcode 1 "$binary" --gtest_filter="$filter"
