#!/bin/sh
# run_fuzz.sh FUZZER SECONDS WORKDIR SEED... : fuzzes FUZZER (a libFuzzer binary) for SECONDS.
# Seeds (files, or directories of files) are copied once into WORKDIR/seeds; new inputs the
# fuzzer finds go to WORKDIR/corpus and are kept for the next run; a crashing input is written
# to WORKDIR/crash-<sha1> (the test fails; see docs/reliability.md for turning it into a
# committed regression input). Exit status: the fuzzer's (0 = nothing found).
set -eu
fuzzer=$1 seconds=$2 work=$3
shift 3
mkdir -p "$work/corpus" "$work/seeds"
for s in "$@"; do
  if [ -d "$s" ]; then find "$s" -maxdepth 1 -type f ! -name README.md -exec cp -f {} "$work/seeds/" \;
  else cp -f "$s" "$work/seeds/"; fi
done
# Leaks inside libraries we cannot fix (libhdf5) are suppressed, nothing else.
export LSAN_OPTIONS="suppressions=$(dirname "$0")/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
# A malloc too large to serve returns null, as it does outside ASan: libhdf5 asks for absurd
# sizes read from damaged metadata and reports the failure cleanly (a parser of ours that does
# the same throws std::bad_alloc, which fuzz_common.h reports as a finding).
export ASAN_OPTIONS="allocator_may_return_null=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
# -timeout: one input taking longer is a hang (a finding). -rss_limit_mb: an input that makes a
# parser use gigabytes is a finding too; single mallocs are not limited (-malloc_limit_mb
# 1 TiB), for the reason above. -print_final_stats: execs/s for docs/reliability.md.
# RETAIN_FUZZ_SEED (CI sets it): the same mutation sequence on every run, so a finding in CI
# recurs rather than appearing at random.
exec "$fuzzer" ${RETAIN_FUZZ_SEED:+-seed="$RETAIN_FUZZ_SEED"} -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1048576 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$work/seeds"
