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
# -timeout: one input taking longer is a hang (a finding). -rss_limit_mb/-malloc_limit_mb: an
# input that makes a parser allocate gigabytes is a finding too (a header may not size buffers).
# -print_final_stats: execs/s for docs/reliability.md.
exec "$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$work/seeds"
