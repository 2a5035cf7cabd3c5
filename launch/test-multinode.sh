#!/usr/bin/env bash
# Multi-node training on one machine: retain-train under launch/mpirun.sh --hostfile, across test
# hosts that are Linux network namespaces on a private bridge (each its own interface, address and
# hostname; MPI between them over TCP), through launch/netns-agent.sh where a cluster uses ssh:
#
#   launch/test-multinode.sh            # after launch/build.sh (launch/test.sh runs it)
#
# What it checks (docs/training.md, "Several nodes: a test on one machine"):
#   1. 2 hosts x 1 rank and 2 hosts x 2 ranks train the gates of one rank (within 1e-5, as the
#      one-host rank tests), their FSDP all-gathers crossing the hosts' links; the checkpoint is
#      one directory, read from every host; resumed on 3 hosts (2+1+1 ranks) it finishes exactly
#      as the uninterrupted 2 x 2 run (bit for bit);
#   2. a host dies (kill -9 of every process in its namespace): the launcher ends within 30 s
#      with one line naming the host and its ranks, exit 75, every other rank gone, the last
#      checkpoint complete (a resume from it runs);
#   3. the network is cut (the host's link set down mid-run, --timeout 5): the watchdog's line
#      names the unreachable rank, every process this side can reach is gone within
#      --timeout + 30 s, the launcher exits 75 although mpirun cannot reach the cut host, nothing
#      is half-written (every step directory and metrics line complete, the checkpoint resumes);
#   4. a slow link (tc: netem delay and rate, or a tbf rate where netem is missing): the run
#      completes and its step lines show the communication time and the part of it exposed.
# Everything it creates (namespaces retain-mnN-h1..3, bridge rmnNbr, veths rmnNv1..3, tc
# qdiscs, processes, the scratch directory) is removed on every exit path, Ctrl-C included, and
# checked gone at the end; N (the subnet 10.213.N.0/24) is picked under a lock, so that runs at
# the same time do not collide.
# Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 (ip, tc), util-linux (unshare,
# setsid, flock), OpenMPI, python3, and the build (BUILD_DIR, default build). Where network
# namespaces cannot be made it prints "SKIPPED: <why>" and exits 0. Exit 1 when a check fails.
# RETAIN_MULTINODE_LOGS=DIR keeps the runs' logs (what a user sees on each failure) in DIR;
# RETAIN_MULTINODE_PARTS=2,3 runs only those parts.
# About 1 minute on 2 cores.
set -uo pipefail
me=test-multinode.sh
case "${1:-}" in
  -h | --help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p;}' "$0"; exit 0 ;;
  "") ;;
  *) echo "$me: error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
root=$PWD
bin=$root/${BUILD_DIR:-build}/bin
fixtures=$root/tests/fixtures/trainer
start=$EPOCHREALTIME

say() { echo "$me: $*"; }
skip() { say "SKIPPED: $*"; exit 0; }
failures=0
check() {  # check STATUS MESSAGE [LOG]: ok, or FAIL (counted) and the end of LOG
  if [ "$1" -eq 0 ]; then say "ok: $2"; return; fi
  say "FAIL: $2"
  failures=$((failures + 1))
  if [ -n "${3:-}" ]; then tail -n 8 "$3" | sed 's/^/    | /'; fi
}
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 <= b + 0) }'; }  # le A B: A <= B (any number format)

for t in retain-train retain-pack retain-make-tiny retain-export; do
  [ -x "$bin/$t" ] || { echo "$me: error: $bin/$t not found (build first: launch/build.sh)" >&2; exit 1; }
done
command -v python3 >/dev/null || { echo "$me: error: python3 not found (it compares the gates)" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "$me: error: mpirun not found (launch/install-deps.sh)" >&2; exit 1; }

# --- Can this machine make network namespaces? -------------------------------------------------
for t in ip tc unshare setsid flock; do command -v $t >/dev/null || skip "no '$t' command (iproute2, util-linux)"; done
probe=retain-probe-$$
if ! why=$(ip netns add $probe 2>&1); then skip "cannot create a network namespace here: $why"; fi
why=$(ip link add ${probe:0:11}b type bridge 2>&1) || { ip netns del $probe; skip "cannot create a bridge here: $why"; }
ip link del ${probe:0:11}b
why=$(ip netns exec $probe unshare --uts true 2>&1) || { ip netns del $probe; skip "cannot enter a namespace here: $why"; }
ip netns del $probe

# --- The test hosts ------------------------------------------------------------------------------
# N: the first subnet 10.213.N.0/24 that no interface or route here uses and no other run holds
# (the bridge is made under the lock, so the next run sees it).
scratch="" N="" pgroups=()
cleanup() {
  trap - EXIT INT TERM HUP
  local g p
  for g in "${pgroups[@]}"; do kill -KILL -- -"$g" 2>/dev/null; done  # launchers, mpirun, agents
  if [ -n "$N" ]; then
    for i in 1 2 3; do
      p=$(ip netns pids retain-mn$N-h$i 2>/dev/null)
      [ -z "$p" ] || kill -KILL $p 2>/dev/null
      ip link del rmn${N}v$i 2>/dev/null  # both ends (the namespace's own goes when the kernel frees it)
      ip netns del retain-mn$N-h$i 2>/dev/null
    done
    ip link del rmn${N}br 2>/dev/null
  fi
  if [ -n "$scratch" ] && [ -n "${RETAIN_MULTINODE_LOGS:-}" ]; then
    mkdir -p "$RETAIN_MULTINODE_LOGS" && cp "$scratch"/*.log "$RETAIN_MULTINODE_LOGS"/ 2>/dev/null
  fi
  [ -z "$scratch" ] || rm -rf "$scratch"
  if [ -n "$N" ]; then
    local left
    left=$(ip netns list | grep -E "^retain-mn$N-" ; ip -o link show | grep -oE "rmn${N}(br|v[0-9])" | sort -u)
    if [ -n "$left" ]; then say "FAIL: left behind: $(echo $left)"; failures=$((failures + 1)); fi
  fi
}
interrupted=0
trap 'cleanup; [ $interrupted -eq 0 ] || exit 130; exit $((failures > 0))' EXIT
trap 'say "interrupted"; interrupted=1; exit 130' INT TERM HUP
scratch=$(mktemp -d "${TMPDIR:-/tmp}/retain-multinode.XXXXXX")

exec 9<"$0"  # the lock: this script's own file (a lock file would stay behind)
flock 9
for n in $(seq 1 250); do
  ip link show rmn${n}br >/dev/null 2>&1 && continue
  ip netns list | grep -q "^retain-mn$n-" && continue
  [ -z "$(ip -4 route show to match 10.213.$n.1 | grep -v '^default')" ] || continue
  ip link add rmn${n}br type bridge && N=$n && break
done
flock -u 9
[ -n "$N" ] || { echo "$me: error: no free subnet 10.213.N.0/24 (N = 1..250)" >&2; exit 1; }
net=10.213.$N
hosts=()
make_hosts() {
  ip addr add $net.254/24 dev rmn${N}br && ip link set rmn${N}br up || return 1
  for i in 1 2 3; do
    ns=retain-mn$N-h$i
    ip netns add $ns && ip link add rmn${N}v$i type veth peer name eth0 netns $ns &&
      ip link set rmn${N}v$i master rmn${N}br up && ip -n $ns addr add $net.$i/24 dev eth0 &&
      ip -n $ns link set eth0 up && ip -n $ns link set lo up || return 1
    hosts+=("$net.$i=$ns")
  done
}
make_hosts || { echo "$me: error: making the test hosts failed (the line above says why)" >&2; exit 1; }
say "3 test hosts: $net.1-3 (namespaces retain-mn$N-h1..3 on bridge rmn${N}br, $net.254 here)"

# launch/mpirun.sh reaches them through the agent; TCP between hosts on the test subnet only. The
# TMPDIR holds OpenMPI's session directories, which daemons killed by a test leave behind.
mkdir -p "$scratch/tmp"
export RETAIN_NETNS_HOSTS=$(IFS=,; echo "${hosts[*]}") RETAIN_MPI_AGENT=$root/launch/netns-agent.sh \
  RETAIN_MPI_TRANSPORT=tcp RETAIN_MPI_IFACE=$net.0/24 OMP_NUM_THREADS=1 TMPDIR=$scratch/tmp
unset RETAIN_MPI_OVERSUBSCRIBE RETAIN_MPI_EXTRA RETAIN_THREADS_PER_RANK
hostfile() {  # hostfile NAME SLOTS...: host i gets the i-th number of slots
  local f=$scratch/$1 i=1
  shift
  : >"$f"
  for s in "$@"; do echo "$net.$i slots=$s" >>"$f"; i=$((i + 1)); done
  echo "$f"
}

# --- Data, runs, comparisons ---------------------------------------------------------------------
data=$scratch/data.h5
"$bin/retain-pack" --tokenizer "$fixtures/model" --input "$fixtures/corpus.jsonl" --out "$data" --seq-len 40 \
  --packing bfd -q >/dev/null || { echo "$me: error: retain-pack failed" >&2; exit 1; }
# The fixture run of the one-host rank tests (tests/trainer/train_helpers.h: train_args).
train_args=(--model "$fixtures/model" --data "$data" --gate trimkv --init-gates "$fixtures/gates-trimkv.safetensors"
  --memory 4 --global-batch 4 --seed 3 --warmup 2 --loss-chunk 16 --lr 0.01 --save-every 2)

# launcher LOG NP HOSTFILE [LAUNCHER OPTIONS] -- RETAIN-TRAIN ARGS: launch/mpirun.sh in a session
# of its own (its process group is killed on exit), in the background; sets $job.
launcher() {
  local log=$1 np=$2 hf=$3
  shift 3
  setsid "$root/launch/mpirun.sh" -np "$np" --hostfile "$hf" "$@" >"$log" 2>&1 &
  job=$!
  pgroups+=("$job")
}
run_mpi() {  # run_mpi LOG NP HOSTFILE ... : launcher, waited for; its exit status
  launcher "$@"
  wait $job 2>/dev/null
}
# Processes still running (an exited one is a zombie until reaped: not running).
running() {  # PID
  local s
  read -r s 2>/dev/null <"/proc/$1/stat" || return 1
  s=${s##*) }
  [ "${s%% *}" != Z ]
}
group_alive() {  # PGID: its running processes (a launcher's: itself, mpirun, the agents)
  local f s st pg
  for f in /proc/[0-9]*/stat; do
    read -r s 2>/dev/null <"$f" || continue
    s=${s##*) }
    read -r st _ pg _ <<<"$s"
    if [ "$pg" = "$1" ] && [ "$st" != Z ]; then f=${f#/proc/}; echo "${f%/stat}"; fi
  done
}
ns_alive() {  # NAMESPACE: its running processes (a host's daemon and ranks)
  local p
  for p in $(ip netns pids "$1" 2>/dev/null); do if running $p; then echo $p; fi; done
}
# The bytes host i's link carried (both ways), for showing that the traffic crossed it.
link_bytes() { echo $(($(cat /sys/class/net/rmn${N}v$1/statistics/rx_bytes) + $(cat /sys/class/net/rmn${N}v$1/statistics/tx_bytes))); }
latest() { sed -n 's/^step-0*\([0-9]\)/\1/p' "$1/checkpoints/latest" 2>/dev/null; }
wait_for_checkpoint() {  # RUN STEP PID: true once RUN's latest checkpoint is >= STEP
  for _ in $(seq 600); do
    [ "$(latest "$1")" -ge "$2" ] 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
py() { python3 - "$@"; }
# gates_diff A B: the largest relative difference ‖a − b‖/‖b‖ over the gate tensors of two runs.
gates_diff() {
  py "$1/gates.safetensors" "$2/gates.safetensors" <<'EOF'
import json, math, struct, sys
def read(path):
    b = open(path, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    head = json.loads(b[8:8 + n])
    out = {}
    for name, t in head.items():
        if name == '__metadata__':
            continue
        assert t['dtype'] == 'F32', (name, t['dtype'])
        s, e = t['data_offsets']
        out[name] = struct.unpack('<%df' % ((e - s) // 4), b[8 + n + s:8 + n + e])
    return out
a, b = read(sys.argv[1]), read(sys.argv[2])
assert a.keys() == b.keys(), 'different tensors'
worst = 0.0
for k in a:
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a[k], b[k])))
    den = math.sqrt(sum(y * y for y in b[k]))
    worst = max(worst, num / den if den else num)
print('%.3g' % worst)
EOF
}
same_bytes() { cmp -s "$1/gates.safetensors" "$2/gates.safetensors"; }
# The losses of two runs' metrics.jsonl, equal line for line.
same_losses() {
  py "$1/metrics.jsonl" "$2/metrics.jsonl" <<'EOF'
import json, sys
rows = [[json.loads(l) for l in open(p) if l.strip()] for p in sys.argv[1:]]
keys = ('step', 'loss', 'kl', 'ntp', 'cap', 'grad_norm', 'lr')
sys.exit(0 if [[r[k] for k in keys] for r in rows[0]] == [[r[k] for k in keys] for r in rows[1]] else 1)
EOF
}
# Nothing half-written in RUN: every step directory complete (gates, state, one optimizer shard
# per rank of the run that saved it), `latest` naming one, every metrics line whole JSON.
complete_run() {
  py "$1" <<'EOF'
import glob, json, os, sys
run = sys.argv[1]
bad = []
for d in sorted(glob.glob(run + '/checkpoints/step-*')):
    if d.endswith('.tmp'):
        continue  # never renamed into place: not a checkpoint (the next save removes it)
    names = set(os.listdir(d))
    shards = [n for n in names if n.startswith('optimizer-rank')]
    ranks = int(shards[0].split('-of-')[1].split('.')[0]) if shards else 0
    want = {'gates.safetensors', 'state.json'} | {'optimizer-rank%05d-of-%05d.safetensors' % (r, ranks) for r in range(ranks)}
    if not ranks or names != want:
        bad.append('%s holds %s' % (d, sorted(names)))
    json.load(open(d + '/state.json'))
latest = open(run + '/checkpoints/latest').read().strip()
if not os.path.isdir(run + '/checkpoints/' + latest):
    bad.append('latest names ' + latest)
for i, line in enumerate(open(run + '/metrics.jsonl')):
    try:
        json.loads(line)
    except ValueError:
        bad.append('metrics.jsonl line %d is not whole: %r' % (i + 1, line[:60]))
print('; '.join(bad))
sys.exit(1 if bad else 0)
EOF
}
# The mean comm_ms and comm_exposed_ms of a run's steps after the first (its warm-up).
comm_means() {
  py "$1/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][1:]
busy = [r['comm_ms'] for r in rows]
exp = [r['comm_exposed_ms'] for r in rows]
if not rows or None in busy or None in exp:
    print('none none')
else:
    print('%.1f %.1f' % (sum(busy) / len(busy), sum(exp) / len(exp)))
EOF
}

part() { [[ ",${RETAIN_MULTINODE_PARTS:-1,2,3,4}," == *",$1,"* ]]; }

# --- 1. Same gates as one rank; the checkpoint across hosts; exact resume on 3 hosts ------------
if part 1; then
  t1=$EPOCHREALTIME
  "$bin/retain-train" "${train_args[@]}" --steps 6 --out "$scratch/one" >"$scratch/one.log" 2>&1
  check $? "one rank, no MPI: 6 steps (the reference)"

  before=$(link_bytes 2)
  run_mpi "$scratch/r21.log" 2 "$(hostfile h21 1 1)" -- "$bin/retain-train" "${train_args[@]}" --steps 6 --out "$scratch/r21"
  rc=$?
  crossed=$(( ($(link_bytes 2) - before) / 1024 ))
  diff=$(gates_diff "$scratch/r21" "$scratch/one" 2>&1)
  [ $rc -eq 0 ] && le "$diff" 1e-5 && [ $crossed -gt 0 ]
  check $? "2 hosts x 1 rank: exit $rc, gates within $diff of one rank's (<= 1e-5), $crossed KiB over host 2's link"
  grep -q 'fsdp: .* layer all-gathers' "$scratch/r21.log"
  check $? "2 hosts x 1 rank: the frozen weights sharded across the hosts ($(grep -o 'fsdp: [0-9]* layer requests, [0-9]* layer all-gathers' "$scratch/r21.log"))"

  before=$(link_bytes 2)
  run_mpi "$scratch/r22.log" 4 "$(hostfile h22 2 2)" -- "$bin/retain-train" "${train_args[@]}" --steps 6 --out "$scratch/r22"
  rc=$?
  crossed=$(( ($(link_bytes 2) - before) / 1024 ))
  diff=$(gates_diff "$scratch/r22" "$scratch/one" 2>&1)
  [ $rc -eq 0 ] && le "$diff" 1e-5 && [ $crossed -gt 0 ]
  check $? "2 hosts x 2 ranks: exit $rc, gates within $diff of one rank's (<= 1e-5), $crossed KiB over host 2's link"

  # One checkpoint directory for the 4 ranks (rank 0's gates and state, one optimizer shard per
  # rank), and every host reads it (retain-export run in each namespace, the same bytes out).
  ckpt=$scratch/r22/checkpoints/step-00000004
  out=""
  for i in 1 2 3; do
    ip netns exec retain-mn$N-h$i "$bin/retain-export" --from "$ckpt" --format safetensors \
      --out "$scratch/export-h$i.safetensors" >/dev/null 2>&1 || out+=" h$i:failed"
    cmp -s "$scratch/export-h1.safetensors" "$scratch/export-h$i.safetensors" || out+=" h$i:differs"
  done
  files=$(ls "$ckpt" | tr '\n' ' ')
  [ -z "$out" ] && [ "$files" = "gates.safetensors optimizer-rank00000-of-00004.safetensors optimizer-rank00001-of-00004.safetensors optimizer-rank00002-of-00004.safetensors optimizer-rank00003-of-00004.safetensors state.json " ]
  check $? "2 hosts x 2 ranks: one checkpoint ($files), read alike from hosts 1, 2 and 3${out}"

  # Stopped after step 2 on 2 hosts, resumed on 3 (2 + 1 + 1 ranks, the same 4): the same bytes.
  run_mpi "$scratch/s22.log" 4 "$(hostfile h22 2 2)" -- "$bin/retain-train" "${train_args[@]}" --steps 6 \
    --stop-after 2 --out "$scratch/s22"
  rc1=$?
  run_mpi "$scratch/s211.log" 4 "$(hostfile h211 2 1 1)" -- "$bin/retain-train" "${train_args[@]}" --steps 6 \
    --resume --out "$scratch/s22"
  rc2=$?
  same_bytes "$scratch/s22" "$scratch/r22" && same_losses "$scratch/s22" "$scratch/r22"
  r=$?
  [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ $r -eq 0 ]
  check $? "stopped at step 2 on 2 hosts (exit $rc1), resumed on 3 hosts (2+1+1 ranks, exit $rc2): gates and losses identical to the uninterrupted 2 x 2 run"
  say "(part 1: $(since $t1) s)"
fi

# --- 2. A host dies --------------------------------------------------------------------------------
if part 2; then
  t2=$EPOCHREALTIME
  run=$scratch/dead
  launcher "$scratch/dead.log" 4 "$(hostfile h22 2 2)" -- "$bin/retain-train" "${train_args[@]}" --steps 100000 \
    --log-every 1000 --out "$run"
  if wait_for_checkpoint "$run" 2 $job; then
    survivors=$(for p in $(ns_alive retain-mn$N-h1); do [ "$(cat /proc/$p/comm 2>/dev/null)" = retain-train ] && echo $p; done)
    victims=$(ns_alive retain-mn$N-h2)
    t0=$EPOCHREALTIME
    kill -KILL $victims
    end=""
    for _ in $(seq 300); do
      [ -z "$(group_alive $job)$(ns_alive retain-mn$N-h1)" ] && { end=$(since $t0); break; }
      sleep 0.1
    done
    [ -n "$end" ] || kill -KILL -- -$job
    wait $job 2>/dev/null
    rc=$?
    line=$(grep 'launch/mpirun.sh: error: lost host' "$scratch/dead.log")
    [ -n "$end" ] && [ $rc -eq 75 ] && [ "$(grep -c 'error:' "$scratch/dead.log")" = 1 ] &&
      [[ "$line" == *"lost host $net.2 (ranks 2, 3)"* ]] && [ "$(echo $survivors | wc -w)" = 2 ]
    check $? "host 2 killed (kill -9 of its $(echo $victims | wc -w) processes): ranks 0 and 1 on host 1, the launcher and mpirun gone after ${end:-more than 30} s, exit $rc, one line: $line" \
      "$scratch/dead.log"
    step=$(latest "$run")
    "$bin/retain-train" "${train_args[@]}" --steps 100000 --log-every 1000 --resume --stop-after 2 --out "$run" \
      >"$scratch/dead-resume.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] && [ "$(latest "$run")" = $((step + 2)) ]
    check $? "host 2 killed: the last checkpoint (step $step) is complete: one rank resumes from it to step $((step + 2))" \
      "$scratch/dead-resume.log"
  else
    check 1 "host 2 killed: the run never reached a checkpoint: $(tail -3 "$scratch/dead.log")"
  fi
  say "(part 2: $(since $t2) s)"
fi

# --- 3. The network is cut -------------------------------------------------------------------------
if part 3; then
  t3=$EPOCHREALTIME
  run=$scratch/cut
  timeout=5
  launcher "$scratch/cut.log" 2 "$(hostfile h21 1 1)" -- "$bin/retain-train" "${train_args[@]}" --steps 100000 \
    --log-every 1000 --timeout $timeout --out "$run"
  if wait_for_checkpoint "$run" 2 $job; then
    t0=$EPOCHREALTIME
    ip -n retain-mn$N-h2 link set eth0 down
    end=""
    for _ in $(seq $(((timeout + 30) * 10))); do
      [ -z "$(group_alive $job)$(ns_alive retain-mn$N-h1)" ] && { end=$(since $t0); break; }
      sleep 0.1
    done
    [ -n "$end" ] || kill -KILL -- -$job
    wait $job 2>/dev/null
    rc=$?
    watchdog=$(grep -E "^retain-train: error: rank 0: .* \(--timeout $timeout\) for rank 1, which does not answer" "$scratch/cut.log")
    stopped=$(grep 'launch/mpirun.sh: error: mpirun was still waiting' "$scratch/cut.log")
    left=$(ns_alive retain-mn$N-h2 | wc -l)
    [ -n "$end" ] && [ $rc -eq 75 ] && [ -n "$watchdog" ] && [ -n "$stopped" ]
    check $? "host 2's link cut (--timeout $timeout): every process on this side of the cut gone after ${end:-more than $((timeout + 30))} s (limit $((timeout + 30))), exit $rc; the lines: $watchdog / $stopped" \
      "$scratch/cut.log"
    # What the cut host still runs (its daemon, waiting for mpirun) goes as a real one's would when
    # its connection times out; here it is killed, and the link restored for part 4.
    left=$(ns_alive retain-mn$N-h2)
    say "      (host 2, unreachable, still ran $(echo $left | wc -w) process(es) of the job: $(for p in $left; do cat /proc/$p/comm; done | sort | uniq -c | xargs); killed)"
    [ -z "$left" ] || kill -KILL $left
    ip -n retain-mn$N-h2 link set eth0 up
    why=$(complete_run "$run")
    r=$?
    step=$(latest "$run")
    "$bin/retain-train" "${train_args[@]}" --steps 100000 --log-every 1000 --resume --stop-after 2 --out "$run" \
      >"$scratch/cut-resume.log" 2>&1
    rc=$?
    [ $r -eq 0 ] && [ $rc -eq 0 ] && [ "$(latest "$run")" = $((step + 2)) ]
    check $? "host 2's link cut: nothing half-written (every step directory and metrics line complete${why:+: $why}); one rank resumes from step $step to $((step + 2))" \
      "$scratch/cut-resume.log"
  else
    check 1 "link cut: the run never reached a checkpoint: $(tail -3 "$scratch/cut.log")"
  fi
  say "(part 3: $(since $t3) s)"
fi

# --- 4. A slow link ------------------------------------------------------------------------------
# A model whose layers are worth gathering (4 layers of 2.4 MB in F32: 1.2 MB from the other host
# per layer and pass), 2 hosts x 1 rank, on the bridge as it is and with host 2's link slowed
# both ways: netem (delay and rate) where the kernel has it, else a tbf rate limit.
if part 4; then
  t4=$EPOCHREALTIME
  "$bin/retain-make-tiny" --out "$scratch/wide" --layers 4 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 \
    --intermediate 512 --vocab 512 >/dev/null &&
    "$bin/retain-pack" --tokenizer "$scratch/wide" --input "$fixtures/corpus.jsonl" --out "$scratch/wide.h5" \
      --seq-len 40 --packing bfd -q >/dev/null
  check $? "a 4-layer model of 2.4 MB per layer (retain-make-tiny) and its data"
  wide_args=(--model "$scratch/wide" --data "$scratch/wide.h5" --gate trimkv --gate-hidden 16 --memory 4 --global-batch 2
    --seed 3 --loss-chunk 16 --lr 0.01 --steps 4 --save-every 100)
  slow_link() {  # host 2's link slowed both ways (the bridge's port and the host's interface)
    local q=(netem delay 20ms rate 200mbit)
    slow="netem delay 20ms rate 200mbit"
    if ! tc qdisc add dev rmn${N}v2 root "${q[@]}" 2>/dev/null; then
      q=(tbf rate 200mbit burst 256kb latency 500ms)
      slow="tbf rate 200mbit (this kernel has no netem)"
      tc qdisc add dev rmn${N}v2 root "${q[@]}" 2>/dev/null || return 1
    fi
    tc -n retain-mn$N-h2 qdisc add dev eth0 root "${q[@]}"
  }
  run_mpi "$scratch/fast.log" 2 "$(hostfile h21 1 1)" -- "$bin/retain-train" "${wide_args[@]}" --out "$scratch/fast"
  rc1=$?
  if ! slow_link; then
    say "SKIPPED part 4's slow link: this kernel has neither the netem nor the tbf qdisc"
  else
    run_mpi "$scratch/slow.log" 2 "$(hostfile h21 1 1)" -- "$bin/retain-train" "${wide_args[@]}" --out "$scratch/slow"
    rc2=$?
    tc qdisc del dev rmn${N}v2 root 2>/dev/null
    tc -n retain-mn$N-h2 qdisc del dev eth0 root 2>/dev/null
    read -r fast_busy fast_exposed <<<"$(comm_means "$scratch/fast")"
    read -r slow_busy slow_exposed <<<"$(comm_means "$scratch/slow")"
    for r in fast slow; do  # the last step line, as the log shows it
      say "      $r link: $(grep -o 'step 4/4 .*' "$scratch/$r.log" | sed -E 's/ loss .* tok\/s / /; s/ ETA [^ ]+//; s/ [0-9.]+ TFLOP.*( comm )/\1/; s/ β̄.*//')"
    done
    [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ "$fast_exposed" != none ] && ! le "$slow_exposed" "$fast_exposed"
    check $? "slow link ($slow): both runs complete (exit $rc1, $rc2); communication per step after the first: fast ${fast_busy} ms (${fast_exposed} exposed), slow ${slow_busy} ms (${slow_exposed} exposed)" \
        "$scratch/slow.log"
  fi
  say "(part 4: $(since $t4) s)"
fi

if [ $failures -eq 0 ]; then say "passed ($(since $start) s)"; else say "FAILED: $failures check(s) ($(since $start) s)"; fi
