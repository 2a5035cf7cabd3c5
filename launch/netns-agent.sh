#!/usr/bin/env bash
# OpenMPI's launch agent for test hosts that are Linux network namespaces on this machine
# (launch/test-multinode.sh), in place of ssh:
#
#   RETAIN_NETNS_HOSTS=10.213.5.1=retain-mn5-h1,10.213.5.2=retain-mn5-h2 \
#   RETAIN_MPI_AGENT=launch/netns-agent.sh RETAIN_MPI_TRANSPORT=tcp RETAIN_MPI_IFACE=10.213.5.0/24 \
#     launch/mpirun.sh -np 2 --hostfile HOSTS -- build/bin/retain-train ...
#
# Why: mpirun starts its daemon (orted) on every other node of the hostfile by running
# `AGENT HOST COMMAND` (MCA plm_rsh_agent, default ssh). On a cluster the agent is ssh (or srun
# inside a Slurm allocation, which mpirun then uses by itself); here it is this script, which
# runs the daemon inside HOST's namespace, with its own interface and address (so MPI's traffic
# between "nodes" is real TCP over a bridge that a test can slow down or cut) and its own
# hostname (a UTS namespace: retain's node-local rank and OpenMPI's messages tell hosts apart).
#
# It behaves as ssh does, because mpirun's handling of failures depends on it:
#   - rsh semantics: the words after HOST are joined with spaces into one command line for the
#     remote shell (sh -c), as ssh does; options before HOST are ignored;
#   - the agent stays on this side as the client (mpirun's child): it waits for the remote
#     command and exits with its status; if the remote side is killed it prints ssh's line
#     `Connection to HOST closed by remote host.` and exits 255 (launch/mpirun.sh reads that line
#     to name a lost host);
#   - the remote side runs in a session of its own (setsid), so a Ctrl-C or a signal to this
#     process group does not reach it directly (as it would not reach a process over ssh), and
#     killing the agent leaves the remote daemon running, as killing ssh would.
# RETAIN_NETNS_HOSTS maps each host name mpirun uses (the hostfile's entries) to its namespace
# (ADDRESS=NAMESPACE, comma-separated); the namespace's name is also the host's hostname.
# Exit status: the remote command's, 255 when the host is unknown or its side was killed.
set -uo pipefail

me=launch/netns-agent.sh
case "${1:-}" in
  -h | --help)
    sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p;}' "$0"
    exit 0
    ;;
esac
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do shift; done  # ssh-style options (none needed here)
[ $# -ge 2 ] || { echo "$me: usage: $me HOST COMMAND... (see --help)" >&2; exit 255; }
host=$1
shift
ns=""
IFS=, read -r -a pairs <<<"${RETAIN_NETNS_HOSTS:-}"
for p in "${pairs[@]}"; do
  if [ "${p%%=*}" = "$host" ]; then ns=${p#*=}; fi
done
if [ -z "$ns" ]; then
  echo "$me: $host: no such test host (RETAIN_NETNS_HOSTS='${RETAIN_NETNS_HOSTS:-}')" >&2
  exit 255
fi

# The remote shell: set the hostname in a fresh UTS namespace, then run the command line.
setsid -w ip netns exec "$ns" unshare --uts sh -c 'hostname "$1" && exec sh -c "$2"' sh "$ns" "$*" &
remote=$!
rc=0
{ wait "$remote"; } 2>/dev/null || rc=$?  # bash would say "Killed" where ssh says the line below
if [ $rc -gt 128 ]; then
  echo "Connection to $host closed by remote host." >&2  # ssh's words for the same event
  exit 255
fi
exit $rc
