#!/usr/bin/env bash
# compute-sanitizer TOOL over a GPU test program's small cases. Exit 69 (the ledger's
# UNAVAILABLE) when compute-sanitizer cannot run on this machine at all (it has refused some
# lent runtimes: "Device not supported", error 999), which is not a kernel's failure.
# usage: sanitize.sh memcheck|racecheck|synccheck|initcheck PROGRAM GTEST_FILTER
set -uo pipefail
tool=$1 program=$2 filter=$3
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
probe=$(timeout 120 "$sanitizer" --tool memcheck --error-exitcode 1 "$BIN/test_cuda_emu" \
        --gtest_filter='CudaEmu.ShufflesVotes*' 2>&1); rc=$?
if [ $rc -ne 0 ] && grep -Eqi 'not supported|LibraryNotLoaded|error 999|No such file|not found|cannot execute' <<<"$probe"; then
  echo "$probe"
  echo "sanitize.sh: compute-sanitizer cannot run on this machine"
  exit 69
fi
exec "$sanitizer" --tool "$tool" --error-exitcode 1 "$BIN/$program" --gtest_color=no --gtest_filter="$filter"
