#!/usr/bin/env bash
# launch/mpirun.sh's GPU options, with --dry-run (no ranks start): --nproc N places N ranks on
# this host, --gpus-per-node G maps G ranks per node (and with RETAIN_THREADS_PER_RANK, PE=T
# per rank), and the conflicting or impossible combinations are usage errors (exit 2, one
# line). A fake nvidia-smi with 2 GPUs stands in for the driver.
set -uo pipefail
script=$1
fails=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'GPU 0: Fake (UUID: GPU-0)\nGPU 1: Fake (UUID: GPU-1)\n' >"$tmp/gpus"
printf '#!/bin/sh\n[ "$1" = -L ] && cat %s\n' "$tmp/gpus" >"$tmp/nvidia-smi"
chmod +x "$tmp/nvidia-smi"
printf 'node01 slots=8\nnode02 slots=8\n' >"$tmp/hosts"
export PATH="$tmp:$PATH"
unset CUDA_VISIBLE_DEVICES SLURM_JOB_NUM_NODES RETAIN_THREADS_PER_RANK RETAIN_DEVICE

# expect WANT_RC PATTERN ARGS...: the printed command (or error) matches PATTERN, with status WANT_RC.
expect() {
  local want_rc=$1 pattern=$2; shift 2
  local out rc
  out=$("$script" "$@" 2>&1); rc=$?
  if [ "$rc" -ne "$want_rc" ] || ! grep -Eq -- "$pattern" <<<"$out"; then
    echo "FAIL: $* -> rc $rc (want $want_rc), output: $out (want /$pattern/)"
    fails=$((fails + 1))
  else
    echo "ok: $*"
  fi
}

expect 0 'mpirun -np 2 .*--bind-to none' --nproc 2 --dry-run -- /bin/true --device cuda
expect 2 'error: --nproc 3 with --device cuda: 3 ranks but 2 visible GPUs' --nproc 3 --dry-run -- /bin/true --device cuda
expect 0 'mpirun -np 3 ' --nproc 3 --dry-run -- /bin/true --device cpu
expect 2 'error: -np and --nproc exclude each other' --nproc 2 -np 2 --dry-run -- /bin/true
expect 2 'error: --nproc runs every rank on this host' --nproc 2 --hostfile "$tmp/hosts" --dry-run -- /bin/true
expect 0 'mpirun -np 16 --hostfile .* --map-by ppr:8:node --bind-to none' -np 16 --gpus-per-node 8 --hostfile "$tmp/hosts" --dry-run -- /bin/true
RETAIN_THREADS_PER_RANK=4 expect 0 '--map-by ppr:8:node:PE=4 --bind-to core' -np 16 --gpus-per-node 8 --hostfile "$tmp/hosts" --dry-run -- /bin/true
expect 2 'error: --gpus-per-node .x. is not a positive number' -np 2 --gpus-per-node x --dry-run -- /bin/true
expect 2 'error: 16 ranks do not fit one host at --gpus-per-node 8' -np 16 --gpus-per-node 8 --dry-run -- /bin/true
CUDA_VISIBLE_DEVICES=0 expect 2 '2 ranks but 1 visible GPUs' --nproc 2 --dry-run -- /bin/true --device=cuda
# No --device: retain's tools default to cuda on a GPU machine, so the GPU count still applies,
# unless RETAIN_DEVICE (their default's override) says cpu; --device on the command line wins.
expect 2 'error: --nproc 3 on cuda \(the default.*3 ranks but 2 visible GPUs' --nproc 3 --dry-run -- /bin/true --steps 2
expect 0 'mpirun -np 2 ' --nproc 2 --dry-run -- /bin/true
RETAIN_DEVICE=cpu expect 0 'mpirun -np 3 ' --nproc 3 --dry-run -- /bin/true
RETAIN_DEVICE=cuda expect 2 'error: --nproc 3 with RETAIN_DEVICE=cuda: 3 ranks but 2 visible GPUs' --nproc 3 --dry-run -- /bin/true
RETAIN_DEVICE=cuda expect 0 'mpirun -np 3 ' --nproc 3 --dry-run -- /bin/true --device=cpu
RETAIN_DEVICE=cpu expect 2 'error: --nproc 3 with --device cuda' --nproc 3 --dry-run -- /bin/true --device cuda
[ $fails -eq 0 ] || { echo "$fails case(s) failed"; exit 1; }
