#!/bin/sh
# run_fuzz.sh FUZZER SECONDS CI_RUNS WORKDIR SEED... : fuzzes FUZZER (a libFuzzer binary).
# Seeds (files, or directories of files) are copied into WORKDIR/seeds; a crashing input
# is written to WORKDIR/crash-<sha1> (the test fails; see docs/reliability.md for turning it
# into a committed regression input). Exit status: the fuzzer's (0 = nothing found).
#   Exploring (default): SECONDS of fuzzing; new inputs go to WORKDIR/corpus and are kept for
#   the next run.
#   FUZZ_CI=1 (launch/test.sh): a repeatable run: CI_RUNS inputs (about 10 s of this target on
#   the 2-core machine) from the seeds alone (a fresh WORKDIR/ci-corpus), mutation seed
#   RETAIN_FUZZ_SEED (default 1). No time limit decides what is run, so a CI run and the same
#   command here (FUZZ_CI=1 launch/fuzz.sh) try the same inputs and find the same things.
set -eu
fuzzer=$1 seconds=$2 ci_runs=$3 work=$4
shift 4
# Seeds are numbered as given: several named config.json (one per fixture model) all stay.
rm -rf "$work/seeds"
mkdir -p "$work/corpus" "$work/seeds"
i=0
for s in "$@"; do
  if [ -d "$s" ]; then
    for f in $(find "$s" -maxdepth 1 -type f ! -name README.md | sort); do
      i=$((i + 1)); cp -f "$f" "$work/seeds/$i-$(basename "$f")"
    done
  else
    i=$((i + 1)); cp -f "$s" "$work/seeds/$i-$(basename "$s")"
  fi
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
common="-timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1048576 -print_final_stats=1 -artifact_prefix=$work/"
if [ "${FUZZ_CI:-0}" = 1 ]; then
  rm -rf "$work/ci-corpus" && mkdir -p "$work/ci-corpus"
  # -use_cmp=0 -use_memmem=0: the operands of traced comparisons include heap addresses, which
  # differ from run to run and would steer the mutations differently (measured: with them, two
  # runs of one seed diverge within 11,000 inputs; without them, they are identical).
  exec "$fuzzer" -seed="${RETAIN_FUZZ_SEED:-1}" -runs="$ci_runs" -use_cmp=0 -use_memmem=0 -reload=0 $common \
    "$work/ci-corpus" "$work/seeds"
fi
exec "$fuzzer" ${RETAIN_FUZZ_SEED:+-seed="$RETAIN_FUZZ_SEED"} -max_total_time="$seconds" $common \
  "$work/corpus" "$work/seeds"
