#!/usr/bin/env bash
# Runs a retain program on N ranks with OpenMPI, on this host or across the nodes of a
# hostfile, with the MCA choices that matter for it, and prints the whole mpirun command
# first (so that it can be rerun or adapted by hand).
#
#   launch/mpirun.sh -np 8 [--hostfile launch/hostfile.example] [--dry-run] -- \
#       build/bin/retain-train --model DIR --data FILE.h5 --out RUN_DIR ...
#   launch/mpirun.sh --nproc 8 -- build/bin/retain-train --device cuda ...      # one node, 8 GPUs
#   launch/mpirun.sh -np 16 --gpus-per-node 8 --hostfile hosts -- build/bin/retain-train --device cuda ...
#
# Options: -np N (ranks; one per GPU), --hostfile FILE (nodes and their slots; without it,
# all ranks run here), --dry-run (print the command only), -h/--help, and:
#   --nproc N   N ranks on this host (instead of -np; no --hostfile, and not inside a Slurm
#               allocation of several nodes). When `nvidia-smi -L` works and the ranks will
#               compute on cuda (the program's arguments say --device cuda, or they name no
#               --device and RETAIN_DEVICE is not cpu: retain's tools then default to cuda on
#               a GPU machine), N above the visible GPUs (CUDA_VISIBLE_DEVICES' entries when
#               set, else nvidia-smi's) is an error; use -np to put several ranks on one GPU
#               (--comm mpi tests), or --device cpu.
#   --gpus-per-node G   place G ranks on each node (--map-by ppr:G:node), so that a rank's
#               node-local rank, which picks its GPU, runs 0..G-1 on every node; with
#               RETAIN_THREADS_PER_RANK=T it is --map-by ppr:G:node:PE=T --bind-to core.
#               -np must then be at most G x the nodes (on one host, at most G).
#
# What it decides, and the environment variables that override it:
#   transport   RETAIN_MPI_TRANSPORT=auto|shm|tcp|ucx. auto: shared memory only on one host
#               (pml ob1, btl self,vader: no seconds lost probing network devices); across
#               nodes UCX when this OpenMPI has it (InfiniBand/RoCE), else TCP.
#   interface   RETAIN_MPI_IFACE=eth0 (or a CIDR such as 10.0.0.0/16): the network TCP and
#               the runtime use between nodes; without it OpenMPI may try docker0/virbr0 and hang.
#   single copy RETAIN_MPI_SINGLE_COPY=auto|cma|none. Large shared-memory messages go by CMA
#               (process_vm_readv), which containers refuse without CAP_SYS_PTRACE; auto
#               picks none in a container lacking it (slower for big gathers, but works).
#   threads     RETAIN_THREADS_PER_RANK=T: OpenMP threads per rank, each rank bound to T cores.
#               Without it: on one host OMP_NUM_THREADS = cores / ranks and no binding (OpenMPI
#               would otherwise bind each rank to ONE core, all its threads on it); across
#               nodes OMP_NUM_THREADS is passed on as it is set here (if at all).
#   oversubscribe  RETAIN_MPI_OVERSUBSCRIBE=1: more ranks than cores/slots (tests on small
#               machines); ranks waiting in a collective then yield their core.
#   agent       RETAIN_MPI_AGENT=CMD: how mpirun starts its daemon on the other nodes of a hostfile
#               (MCA plm_rsh_agent; default ssh, e.g. "ssh -p 2222"). Inside a Slurm allocation
#               mpirun uses srun by itself. launch/netns-agent.sh runs the daemon in a network
#               namespace of this machine instead: the simulated hosts of launch/test-multinode.sh.
#   end grace   RETAIN_MPI_END_GRACE=S (default 10): once mpirun has said the job is ending (a rank
#               called MPI_Abort, as retain-train's --timeout watchdog does; a rank died; a host was
#               lost) it should be gone within seconds; if it is still running S seconds later it
#               is waiting for a host it cannot reach (a network cut), and this stops it and the
#               launch agents (ssh) it started, with one line saying so.
#   extra       RETAIN_MPI_EXTRA="...": more mpirun arguments, word-split, added last.
#   wait policy OMP_WAIT_POLICY (default PASSIVE here): idle OpenMP threads sleep.
# NCCL (retain-train --device cuda with several ranks) reads its own variables; every NCCL_*
# variable set here is passed to every rank (-x). The ones that matter most:
#   NCCL_DEBUG=WARN|INFO      WARN: NCCL's warnings and errors only; INFO adds its set-up (version,
#                             the network and transports chosen, rings/trees): read it when a run
#                             hangs at start or is slow between nodes.
#   NCCL_SOCKET_IFNAME=eth0   the IP interface(s) for NCCL's bootstrap and socket transport (a prefix
#                             such as ib, or ^docker,lo to exclude); set it when nodes have several.
#   NCCL_IB_HCA=mlx5_0,mlx5_1 which InfiniBand/RoCE adapters (optionally :port) NCCL uses between nodes.
#   NCCL_IB_DISABLE=1         no InfiniBand/RoCE: between nodes NCCL uses TCP sockets (slow).
#   NCCL_P2P_DISABLE=1        no direct GPU-to-GPU copies (NVLink/PCIe P2P) inside a node; data goes
#                             through host memory (a workaround where P2P is broken, e.g. some VMs).
# Output: the ranks' lines as they come; OpenMPI's many-line help boxes become one line each
# (launch/mpirun-output.awk, on stderr), or none where the failing rank printed its own error,
# which is then the last line. mpirun's lines that matter become these (stderr):
#   launch/mpirun.sh: error: rank 1 (PID 4242 on node02) was killed by signal 9 (Killed); ...
#   launch/mpirun.sh: error: lost host node02 (ranks 2, 3): its processes ended without a word ...
#   launch/mpirun.sh: error: -np 5 asks for more ranks than the 2 slots of this host (one per core): ...
# Exit status: mpirun's, except: 75 (EX_TEMPFAIL: resume from the last checkpoint) when a rank
# was killed from outside (signal 9, 15, 1, 2) or a host was lost, 70 when a rank died of another
# signal (a crash), 2 when -np exceeds the slots, the abort's code (75 for the watchdog) when
# mpirun had to be stopped after the end grace; and 0 when a SIGINT/SIGTERM the ranks answer by
# saving and stopping (retain-train, through RETAIN_STOP_FILE in TMPDIR: one host, or a TMPDIR
# every node shares), as a clean stop should for requeue scripts.
# Running as root (containers) adds --allow-run-as-root. OMP_NUM_THREADS, PATH,
# LD_LIBRARY_PATH and every RETAIN_*, NCCL_* and CUDA_* variable set here are exported to
# every rank (-x), so that remote nodes see the same settings.
set -euo pipefail

me=launch/mpirun.sh
usage() {  # the header comment
  sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p;}' "$0"
}
die() {  # usage errors: exit 2
  echo "$me: error: $*" >&2
  exit 2
}

np="" nproc_ranks="" gpus_per_node="" hostfile="" dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -np | -n | --np)
      [ $# -ge 2 ] || die "$1 needs a number of ranks"
      np=$2
      shift 2
      ;;
    --nproc)
      [ $# -ge 2 ] || die "$1 needs a number of ranks"
      nproc_ranks=$2
      shift 2
      ;;
    --gpus-per-node)
      [ $# -ge 2 ] || die "$1 needs a number of GPUs"
      gpus_per_node=$2
      shift 2
      ;;
    --hostfile | -hostfile)
      [ $# -ge 2 ] || die "$1 needs a file"
      hostfile=$2
      shift 2
      ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option '$1' (options: -np N, --nproc N, --gpus-per-node G, --hostfile FILE, --dry-run; then -- PROGRAM ARGS...)" ;;
    *) break ;;
  esac
done
if [ -n "$nproc_ranks" ]; then
  [ -z "$np" ] || die "-np and --nproc exclude each other (--nproc N: N ranks on this host)"
  [ -z "$hostfile" ] || die "--nproc runs every rank on this host; with --hostfile use -np"
  [[ "$nproc_ranks" =~ ^[1-9][0-9]*$ ]] || die "--nproc '$nproc_ranks' is not a positive number of ranks"
  [ "${SLURM_JOB_NUM_NODES:-1}" -le 1 ] ||
    die "--nproc runs on this host only, but this Slurm allocation has $SLURM_JOB_NUM_NODES nodes; use -np N --gpus-per-node G"
  np=$nproc_ranks
fi
[ -n "$np" ] || die "missing -np N (or --nproc N)"
[[ "$np" =~ ^[1-9][0-9]*$ ]] || die "-np '$np' is not a positive number of ranks"
if [ -n "$gpus_per_node" ]; then
  [[ "$gpus_per_node" =~ ^[1-9][0-9]*$ ]] || die "--gpus-per-node '$gpus_per_node' is not a positive number"
fi
[ $# -ge 1 ] || die "missing the program to run (after --)"
if [ -n "$hostfile" ]; then
  [ -f "$hostfile" ] || die "$hostfile: no such hostfile"
  grep -Eq '^[[:space:]]*[^#[:space:]]' "$hostfile" || die "$hostfile: names no host"
fi
program=$1
if [[ "$program" == */* ]]; then
  [ -x "$program" ] || die "$program: not an executable file (build it first: launch/build.sh)"
else
  command -v "$program" >/dev/null || die "$program: not found on PATH"
fi
command -v mpirun >/dev/null || die "mpirun not found (install OpenMPI: launch/install-deps.sh)"

# One host or several: a hostfile, or a Slurm allocation of more than one node.
multi_node=0
if [ -n "$hostfile" ] || [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then multi_node=1; fi
if [ $multi_node -eq 0 ] && [ -n "$gpus_per_node" ] && [ "$np" -gt "$gpus_per_node" ]; then
  die "$np ranks do not fit one host at --gpus-per-node $gpus_per_node (name the nodes with --hostfile)"
fi

# --nproc on cuda: one GPU per rank, so no more ranks than visible GPUs (retain-train binds
# node-local rank modulo the GPUs, and NCCL refuses two ranks on one GPU). The device is the
# last --device among the program's arguments; without one, $RETAIN_DEVICE; without that, cuda
# (retain's tools take cuda when a GPU is visible, and nvidia-smi just said one is).
if [ -n "$nproc_ranks" ] && nvidia-smi -L >/dev/null 2>&1; then
  device="" prev=""
  for a in "$@"; do
    case "$a" in --device=*) device=${a#--device=} ;; esac
    if [ "$prev" = --device ]; then device=$a; fi
    prev=$a
  done
  if [ -n "$device" ]; then
    how="with --device $device"
  elif [ -n "${RETAIN_DEVICE:-}" ]; then
    device=$RETAIN_DEVICE how="with RETAIN_DEVICE=$device"
  else
    device=cuda how="on cuda (the default with a GPU visible: no --device, no RETAIN_DEVICE)"
  fi
  if [ "$device" = cuda ]; then
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
      IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
      gpus=0
      for d in "${visible[@]}"; do if [ -n "${d// /}" ]; then gpus=$((gpus + 1)); fi; done
      seen="CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
    else
      gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
      seen="nvidia-smi -L"
    fi
    [ "$nproc_ranks" -le "$gpus" ] ||
      die "--nproc $nproc_ranks $how: $nproc_ranks ranks but $gpus visible GPUs ($seen); one GPU per rank (-np N shares GPUs; --device cpu computes on the CPU)"
  fi
fi

args=(mpirun -np "$np")
[ -n "$hostfile" ] && args+=(--hostfile "$hostfile")
[ "$(id -u)" -eq 0 ] && args+=(--allow-run-as-root)

# Transport.
transport=${RETAIN_MPI_TRANSPORT:-auto}
if [ "$transport" = auto ]; then
  if [ $multi_node -eq 0 ]; then
    transport=shm
  elif ompi_info 2>/dev/null | grep -q 'MCA pml: ucx'; then
    transport=ucx
  else
    transport=tcp
  fi
fi
case "$transport" in
  shm) args+=(--mca pml ob1 --mca btl "self,vader") ;;
  tcp) args+=(--mca pml ob1 --mca btl "self,vader,tcp") ;;
  ucx) args+=(--mca pml ucx --mca btl "^openib,uct") ;;  # UCX moves the data; no BTL fights it
  *) die "RETAIN_MPI_TRANSPORT='$transport' is not auto, shm, tcp or ucx" ;;
esac
if [ -n "${RETAIN_MPI_IFACE:-}" ]; then
  args+=(--mca btl_tcp_if_include "$RETAIN_MPI_IFACE" --mca oob_tcp_if_include "$RETAIN_MPI_IFACE")
fi

# Single-copy shared memory: CMA needs ptrace rights, which a container may not grant.
single_copy=${RETAIN_MPI_SINGLE_COPY:-auto}
if [ "$single_copy" = auto ]; then
  single_copy=cma
  if [ -e /.dockerenv ] || [ -e /run/.containerenv ] || [ -n "${container:-}" ]; then
    cap_eff=$(awk '/^CapEff:/ {print $2}' /proc/self/status 2>/dev/null || echo 0)
    # CAP_SYS_PTRACE is capability 19.
    if [ $(( (16#${cap_eff:-0} >> 19) & 1 )) -eq 0 ]; then single_copy=none; fi
  fi
fi
case "$single_copy" in
  cma | none) args+=(--mca btl_vader_single_copy_mechanism "$single_copy") ;;
  *) die "RETAIN_MPI_SINGLE_COPY='$single_copy' is not auto, cma or none" ;;
esac

# Threads and binding.
exports=()
# --gpus-per-node G: G ranks per node (ppr), so that node-local rank = GPU; with threads per
# rank, one --map-by carries both (OpenMPI 4/5 accept ppr:G:node:PE=T).
map_by=slot
[ -n "$gpus_per_node" ] && map_by=ppr:$gpus_per_node:node
if [ -n "${RETAIN_THREADS_PER_RANK:-}" ]; then
  [[ "$RETAIN_THREADS_PER_RANK" =~ ^[1-9][0-9]*$ ]] ||
    die "RETAIN_THREADS_PER_RANK='$RETAIN_THREADS_PER_RANK' is not a positive number"
  args+=(--map-by "$map_by:PE=$RETAIN_THREADS_PER_RANK" --bind-to core)
  exports+=("OMP_NUM_THREADS=$RETAIN_THREADS_PER_RANK")
else
  [ -n "$gpus_per_node" ] && args+=(--map-by "$map_by")
  args+=(--bind-to none)
  if [ $multi_node -eq 0 ]; then
    threads=$(( $(nproc) / np ))
    exports+=("OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}")
  elif [ -n "${OMP_NUM_THREADS:-}" ]; then
    exports+=("OMP_NUM_THREADS=$OMP_NUM_THREADS")
  fi
fi

# Idle OpenMP threads sleep instead of spinning: the CPU ops alternate OpenMP loops with
# OpenBLAS's own threads, and spinning OpenMP workers steal their cores (measured: a 1-rank,
# 2-thread retain-train step 14.1 s spinning vs 9.6 s passive; docs/benchmarks.md).
exports+=("OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}")

# How mpirun reaches the other nodes (ssh by default).
if [ -n "${RETAIN_MPI_AGENT:-}" ]; then args+=(--mca plm_rsh_agent "$RETAIN_MPI_AGENT"); fi
# No --quiet: it hides the one message that names a rank killed by a signal, and the one that says
# -np exceeds the slots. mpirun's help boxes are shortened to a line each instead (below).

if [ "${RETAIN_MPI_OVERSUBSCRIBE:-0}" = 1 ]; then
  args+=(--oversubscribe --mca mpi_yield_when_idle 1)
fi

# The environment every rank must share (remote nodes do not inherit ours): by name, so that
# mpirun passes on the values of the shell it runs in.
for name in PATH LD_LIBRARY_PATH $(compgen -e | grep -E '^(RETAIN|NCCL|CUDA)_' || true); do
  if [ -n "${!name:-}" ]; then exports+=("$name"); fi
done
for e in "${exports[@]}"; do args+=(-x "$e"); done

grace=${RETAIN_MPI_END_GRACE:-10}
[[ "$grace" =~ ^[0-9]+$ ]] || die "RETAIN_MPI_END_GRACE='$grace' is not a number of seconds"

if [ -n "${RETAIN_MPI_EXTRA:-}" ]; then
  read -r -a extra <<<"$RETAIN_MPI_EXTRA"
  args+=("${extra[@]}")
fi
args+=("$@")

# The command, quoted (only where needed) so that it can be pasted back into a shell.
line=$me:
for a in "${args[@]}"; do
  if [[ "$a" =~ ^[A-Za-z0-9_@%+=:,./^-]+$ ]]; then line+=" $a"; else line+=" $(printf '%q' "$a")"; fi
done
echo "$line" >&2
[ $dry_run -eq 1 ] && exit 0

# mpirun exits 1 once it has forwarded a SIGINT/SIGTERM, however cleanly the ranks stopped;
# retain-train says it saved and stopped through RETAIN_STOP_FILE, and then this exits 0 (what
# requeue scripts expect of a clean stop). $state: what this script and the output filter share.
stop_file=$(mktemp "${TMPDIR:-/tmp}/retain-stop.XXXXXX")
state=$(mktemp -d "${TMPDIR:-/tmp}/retain-mpirun.XXXXXX")
trap 'rm -rf "$stop_file" "$state"' EXIT
export RETAIN_STOP_FILE=$stop_file
args=("${args[@]:0:1}" -x RETAIN_STOP_FILE "${args[@]:1}")

# The hostfile as OpenMPI places ranks on it (nodes in the file's order, each filled to its
# slots=N, or G per node with --gpus-per-node): "RANK NODE" lines in $state/map, to name the
# ranks of a lost node. Left empty where that is not known here: a line without slots=, more
# ranks than slots. (mpirun --display-map would say, but with it mpirun holds back all the
# ranks' output until it exits.) Also the slots' total, for the line saying -np exceeds them.
slots="" advice=""
if [ -n "$hostfile" ]; then
  total=$(awk -v np="$np" -v ppr="$gpus_per_node" -v map="$state/map" '
    { sub(/#.*/, "") }
    NF == 0 { next }
    { s = ""
      for (i = 2; i <= NF; i++) if ($i ~ /^slots=[0-9]+$/) s = substr($i, 7)
      if (s == "") unknown = 1
      if (!($1 in slots)) order[++n] = $1
      slots[$1] += s
      total += s }
    END {
      if (!unknown) print total
      if (unknown && ppr == "") exit
      r = 0
      for (k = 1; k <= n && r < np; k++)
        for (j = 0; j < (ppr != "" ? ppr : slots[order[k]]) && r < np; j++) { line[r] = r " " order[k]; r++ }
      if (r == np) for (r = 0; r < np; r++) print line[r] > map
    }' "$hostfile")
  slots=${total:+$total slots of }$hostfile${total:-"'s slots (slots=N, else one per core of each node)"}
  advice="run fewer ranks, give the nodes more slots (slots=N in $hostfile)"
elif [ -n "${SLURM_JOB_ID:-}" ]; then
  slots="tasks of this Slurm allocation" advice="run fewer ranks, or ask Slurm for more tasks"
else
  # OpenMPI's default: one slot per core (not per hardware thread).
  cores=$(lscpu -p=CORE,SOCKET 2>/dev/null | grep -v '^#' | sort -u | wc -l)
  [ "${cores:-0}" -gt 0 ] || cores=$(nproc)
  slots="$cores slots of this host (one per core)" advice="run fewer ranks (--hostfile adds nodes)"
fi
advice+=", or set RETAIN_MPI_OVERSUBSCRIBE=1 to run several ranks per slot"

# mpirun's stderr goes through launch/mpirun-output.awk (it writes what it saw into $state),
# which ignores INT/TERM (a Ctrl-C reaches the whole process group) and ends with the pipe.
# mawk (Debian's awk) fills its input buffer before it reads a line from a pipe, so that a line
# would wait for more output, or for mpirun's exit: -W interactive makes it read line by line.
mkfifo "$state/err"
awk_flags=()
if awk -W version 2>/dev/null | grep -q mawk; then awk_flags=(-W interactive); fi
(
  trap '' INT TERM
  exec awk "${awk_flags[@]}" -f "$(dirname "$0")/mpirun-output.awk" -v me="$me" -v dir="$state" -v np="$np" \
    -v slots="$slots" -v advice="$advice"
) <"$state/err" >&2 &
filter=$!
# mpirun runs in the background so that this shell can forward a signal to it, and watch it.
signalled=0
"${args[@]}" 2>"$state/err" &
pid=$!
trap 'signalled=1; kill -TERM $pid 2>/dev/null || true' INT TERM

# The process's state letter (Z: exited, not yet reaped), or nothing once it is gone.
proc_state() { local s; if read -r _ _ s _ 2>/dev/null <"/proc/$1/stat"; then echo "$s"; fi; }
# The processes whose parent is $1.
children_of() {
  local f ppid
  for f in /proc/[0-9]*/stat; do
    if read -r _ _ _ ppid _ 2>/dev/null <"$f" && [ "$ppid" = "$1" ]; then f=${f#/proc/}; echo "${f%/stat}"; fi
  done
}

# Wait for mpirun, watching for the end it announced (the filter's "end" file): a job that is
# ending should be gone within seconds; mpirun still there after the grace waits for a host it
# cannot reach (its daemons wait for it too, and its ranks were killed), so stop it.
ended_at="" stopped_code=""
while [ -n "$(proc_state $pid)" ] && [ "$(proc_state $pid)" != Z ]; do
  if [ -z "$ended_at" ] && [ -s "$state/end" ]; then ended_at=$SECONDS; fi
  if [ -n "$ended_at" ] && [ $((SECONDS - ended_at)) -ge "$grace" ]; then
    read -r stopped_code why <"$state/end"
    [[ "$stopped_code" =~ ^[0-9]+$ ]] || stopped_code=75
    # Its children first: the launch agents (ssh) of the nodes it still waits for, and any rank of
    # its own node still there; mpirun reaps them (nothing is left to init) and, its daemons gone,
    # may finish by itself. What runs on the unreachable host ends when it notices mpirun is gone.
    children=$(children_of $pid)
    [ -z "$children" ] || kill -KILL $children 2>/dev/null || true
    for _ in $(seq 10); do [ "$(proc_state $pid)" = Z ] && break; sleep 0.2; done
    kill -KILL $pid 2>/dev/null || true
    echo "$me: error: mpirun was still waiting ${grace} s after the job's end ($why): a host it cannot reach" \
      "(a network cut?) kept it from finishing; stopped it and its launch agents (exit $stopped_code)" >&2
    break
  fi
  sleep 0.2
done
rc=0
wait $pid 2>/dev/null || rc=$?  # (no "Killed" line from bash: this script said what happened)
# The filter ends with the pipe, unless a process on an unreachable host still holds it: then
# what it read within 2 s is all there is.
for _ in $(seq 20); do
  if [ -z "$(proc_state $filter)" ] || [ "$(proc_state $filter)" = Z ]; then break; fi
  sleep 0.1
done
kill -KILL $filter 2>/dev/null || true  # it ignores TERM
wait $filter 2>/dev/null || true

# A lost host, named with the ranks it ran.
if [ -e "$state/lost" ]; then
  host=$(cat "$state/lost")
  ranks=""
  if [ -s "$state/map" ]; then
    ranks=$(awk -v h="$host" '$2 == h { r = r (n++ ? ", " : "") $1 } END { if (n) print (n > 1 ? "ranks " : "rank ") r }' \
      "$state/map")
  fi
  echo "$me: error: lost host $host${ranks:+ ($ranks)}: its processes ended" \
    "without a word (the host went down, or they were killed); the ranks on the other hosts were ended" \
    "(exit 75: resume from the last checkpoint)" >&2
fi
if [ $rc -ne 0 ] && [ $signalled -eq 1 ] && grep -q '^stopped ' "$stop_file"; then
  echo "$me: stopped cleanly ($(cat "$stop_file")); continue with --resume" >&2
  exit 0
fi
if [ -n "$stopped_code" ]; then exit "$stopped_code"; fi
if [ $rc -ne 0 ] && [ -s "$state/verdict" ]; then exit "$(cat "$state/verdict")"; fi
exit $rc
