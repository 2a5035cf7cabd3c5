#!/usr/bin/env bash
# launch/slurm.sbatch run as sbatch would run it on the allocation's first node, with stub
# srun and scontrol on PATH (no Slurm needed): the srun line (--mpi=pmix, --cpu-bind=cores,
# retain-train with the script's arguments unchanged), the environment the ranks inherit
# (RETAIN_DEVICE, NCCL_DEBUG, OMP_NUM_THREADS, NCCL_* knobs set by the user), srun's exit
# status passed on, a missing build named before srun, and #SBATCH lines sbatch actually reads.
set -uo pipefail
script=$(realpath "$1")
fails=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The stubs: srun records its arguments (one per line) and the ranks' environment; scontrol
# expands the node list.
mkdir -p "$tmp/stubs" "$tmp/repo/build/bin"
cat >"$tmp/stubs/srun" <<STUB
#!/usr/bin/env bash
printf '%s\n' "\$@" >"$tmp/srun.args"
env | grep -E '^(RETAIN|NCCL|OMP)_' | sort >"$tmp/srun.env"
exit \${STUB_SRUN_RC:-0}
STUB
cat >"$tmp/stubs/scontrol" <<'STUB'
#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && printf 'gpu01\ngpu02\n'
STUB
printf '#!/bin/sh\nexit 0\n' >"$tmp/repo/build/bin/retain-train"
chmod +x "$tmp/stubs/srun" "$tmp/stubs/scontrol" "$tmp/repo/build/bin/retain-train"

# run [VAR=value | -uVAR]...: the script in the fake repository as sbatch starts it, with the
# variables Slurm sets for `#SBATCH --nodes=2 --ntasks-per-node=8 --cpus-per-task=12` (-uVAR
# leaves VAR out) and none of the user's RETAIN_/NCCL_/OMP_ ones unless given; its output in
# $out, its exit status in $rc.
run() {
  local slurm=(SLURM_JOB_NUM_NODES=2 SLURM_NTASKS_PER_NODE=8 SLURM_CPUS_PER_TASK=12 'SLURM_JOB_NODELIST=gpu[01-02]')
  local vars=() a
  for a in "${slurm[@]}"; do [[ " $* " == *" -u${a%%=*} "* ]] || vars+=("$a"); done
  for a in "$@"; do [[ "$a" == -u* ]] || vars+=("$a"); done
  local clear=()
  for a in $(compgen -e | grep -E '^(RETAIN|NCCL|OMP|SLURM)_' || true); do clear+=(-u "$a"); done
  rm -f "$tmp/srun.args" "$tmp/srun.env"
  out=$(cd "$tmp/repo" && env "${clear[@]}" PATH="$tmp/stubs:$PATH" "${vars[@]}" bash "$script" \
    --model /models/Qwen3-8B --data '/data/my train.h5' --out runs/r1 --resume 2>&1)
  rc=$?
}
check() {  # check WHAT CONDITION...: one verdict line
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what (output: $out)"; fails=$((fails + 1)); fi
}
has_env() { grep -qx -- "$1" "$tmp/srun.env" 2>/dev/null; }
lacks_env() { [ -f "$tmp/srun.env" ] && ! grep -q -- "^$1=" "$tmp/srun.env"; }

bash -n "$script" || { echo "FAIL: bash -n $script"; exit 1; }

run
want=$'--mpi=pmix\n--cpu-bind=cores\nbuild/bin/retain-train\n--model\n/models/Qwen3-8B\n--data\n/data/my train.h5\n--out\nruns/r1\n--resume'
check "exit 0" test "$rc" -eq 0
check "srun line" test "$(cat "$tmp/srun.args" 2>/dev/null)" = "$want"
check "RETAIN_DEVICE=cuda by default" has_env RETAIN_DEVICE=cuda
check "NCCL_DEBUG=WARN by default" has_env NCCL_DEBUG=WARN
check "OMP_NUM_THREADS = cpus per task" has_env OMP_NUM_THREADS=12
check "no NCCL interface unless asked" lacks_env NCCL_SOCKET_IFNAME
check "names the nodes" grep -q 'on 2 nodes x 8 ranks: gpu01 gpu02' <<<"$out"

# What the user exported before sbatch (Slurm passes the submit environment on) wins.
run RETAIN_DEVICE=cpu NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5_0
check "RETAIN_DEVICE kept" has_env RETAIN_DEVICE=cpu
check "NCCL_DEBUG kept" has_env NCCL_DEBUG=INFO
check "NCCL_SOCKET_IFNAME passed on" has_env NCCL_SOCKET_IFNAME=ib0
check "NCCL_IB_HCA passed on" has_env NCCL_IB_HCA=mlx5_0

# srun's failure is the job's (exit 75: the collective watchdog's verdict).
run STUB_SRUN_RC=75
check "srun's exit status passed on" test "$rc" -eq 75

# Without --ntasks-per-node in the environment (sbatch --ntasks overriding it) the log line
# must not end the job under set -u.
run -uSLURM_NTASKS_PER_NODE
check "runs without SLURM_NTASKS_PER_NODE" test "$rc" -eq 0 -a -f "$tmp/srun.args"

# Submitted from elsewhere than the repository root: one line naming the missing build, no srun.
rm "$tmp/repo/build/bin/retain-train"
run
check "missing build: exit 1, no srun" test "$rc" -eq 1 -a ! -f "$tmp/srun.args"
check "missing build: says so" grep -q 'build/bin/retain-train' <<<"$out"

# sbatch reads #SBATCH lines only before the first command: none may come after it, and the
# GPUs per node must equal the tasks per node (one rank per GPU).
first_cmd=$(grep -nvE '^[[:space:]]*(#|$)' "$script" | head -1 | cut -d: -f1)
last_directive=$(grep -n '^#SBATCH' "$script" | tail -1 | cut -d: -f1)
check "#SBATCH lines before the first command" test "$last_directive" -lt "$first_cmd"
tasks=$(sed -n 's/^#SBATCH --ntasks-per-node=//p' "$script")
gpus=$(sed -n 's/^#SBATCH --gpus-per-node=//p' "$script")
check "one rank per GPU ($tasks tasks, $gpus GPUs per node)" test -n "$tasks" -a "$tasks" = "$gpus"
check "SIGTERM ahead of the time limit, requeue" grep -q '^#SBATCH --signal=TERM@' "$script"

[ $fails -eq 0 ] || { echo "$fails check(s) failed"; exit 1; }
