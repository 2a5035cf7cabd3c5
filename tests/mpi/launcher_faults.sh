#!/usr/bin/env bash
# launch/mpirun.sh when the job fails in the launcher's hands (one host, no root needed):
#   - a rank killed (kill -9) mid-run: the launcher exits 75 within 30 s, and its stderr ends
#     with one line naming the rank, the host and the signal (OpenMPI's own message, which
#     `mpirun --quiet` hid, shortened to that line); no other error line, no help box;
#   - -np above the slots: exit 2 with one line saying so and what to do (mpirun alone exits 1
#     and, with --quiet, says nothing).
# Usage: launcher_faults.sh LAUNCHER RETAIN_TRAIN RETAIN_PACK FIXTURES_DIR
set -uo pipefail
launcher=$1 train=$2 pack=$3 fixtures=$4/trainer
fails=0
tmp=$(mktemp -d)
job=""
trap '[ -z "$job" ] || kill -KILL -- -$job 2>/dev/null; rm -rf "$tmp"' EXIT
report() {  # report STATUS WHAT OUTPUT
  if [ "$1" -eq 0 ]; then echo "ok: $2"; else echo "FAIL: $2"; echo "$3" | sed 's/^/    /'; fails=$((fails + 1)); fi
}
export RETAIN_MPI_OVERSUBSCRIBE=1 RETAIN_MPI_SINGLE_COPY=none OMP_NUM_THREADS=1
"$pack" --tokenizer "$fixtures/model" --input "$fixtures/corpus.jsonl" --out "$tmp/data.h5" --seq-len 40 \
  --packing bfd -q >/dev/null || { echo "FAIL: retain-pack"; exit 1; }

# A rank killed: rank 1 is found by its environment (OMPI_COMM_WORLD_RANK, and a tag that is
# this test's own), once the run has saved a checkpoint.
tag=launcher-faults-$$
RETAIN_TEST_TAG=$tag setsid "$launcher" -np 2 -- "$train" --model "$fixtures/model" --data "$tmp/data.h5" \
  --out "$tmp/run" --gate trimkv --init-gates "$fixtures/gates-trimkv.safetensors" --memory 4 --global-batch 4 \
  --loss-chunk 16 --steps 1000000 --save-every 2 --log-every 1000 >"$tmp/out" 2>"$tmp/err" &
job=$!
for _ in $(seq 600); do [ -e "$tmp/run/checkpoints/latest" ] && break; sleep 0.1; done
victim=""
for env in /proc/[0-9]*/environ; do
  if tr '\0' '\n' 2>/dev/null <"$env" | grep -qx "RETAIN_TEST_TAG=$tag" &&
    tr '\0' '\n' 2>/dev/null <"$env" | grep -qx OMPI_COMM_WORLD_RANK=1; then
    victim=${env#/proc/}
    victim=${victim%/environ}
  fi
done
if [ -z "$victim" ]; then
  report 1 "rank 1 of the launcher's job not found" "$(cat "$tmp/err")"
else
  kill -KILL "$victim"
  start=$SECONDS
  while kill -0 $job 2>/dev/null && [ $((SECONDS - start)) -lt 30 ]; do sleep 0.1; done
  kill -0 $job 2>/dev/null && kill -KILL -- -$job
  wait $job
  rc=$?
  job=""
  err=$(cat "$tmp/err")
  last=$(tail -n 1 "$tmp/err")
  [ $rc -eq 75 ] &&
    [[ "$last" =~ ^launch/mpirun\.sh:\ error:\ rank\ 1\ \((PID\ [0-9]+\ )?on\ [^\)]+\)\ was\ killed\ by\ signal\ 9\ \(Killed\)\;\  ]] &&
    [ "$(grep -c 'error:' "$tmp/err")" -eq 1 ] && ! grep -q -- '-----' "$tmp/err"
  report $? "kill -9 of rank 1: exit $rc in $((SECONDS - start)) s, last line: $last" "$err"
fi

# More ranks than slots (without the oversubscription the other case needs).
env -u RETAIN_MPI_OVERSUBSCRIBE "$launcher" -np 1000 -- "$train" --help >"$tmp/out" 2>"$tmp/err"
rc=$?
err=$(cat "$tmp/err")
last=$(tail -n 1 "$tmp/err")
[ $rc -eq 2 ] && [ "$(wc -l <"$tmp/err")" -eq 2 ] &&
  [[ "$last" =~ ^launch/mpirun\.sh:\ error:\ -np\ 1000\ asks\ for\ more\ ranks\ than\ the\ [0-9]+\ slots\ of\ this\ host\ .*RETAIN_MPI_OVERSUBSCRIBE=1 ]]
report $? "-np 1000 on this host: exit $rc, after the command line one line: $last" "$err"

[ $fails -eq 0 ] || { echo "$fails case(s) failed"; exit 1; }
