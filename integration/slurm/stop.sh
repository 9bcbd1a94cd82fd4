#!/usr/bin/env bash
# Stops the one-host Slurm cluster started by integration/slurm/start.sh: cancels its jobs,
# waits for them to end, then stops each slurmd, slurmctld and munged by the PID in its pid file
# (TERM, then KILL after 10 s). The state directory (logs) is kept for inspection.
#
# Usage: integration/slurm/stop.sh [--state DIR]   [default: $BERTH_SLURM_STATE or /tmp/berth-slurm]
set -uo pipefail

state=${BERTH_SLURM_STATE:-/tmp/berth-slurm}
while [ $# -gt 0 ]; do
  case $1 in
    --state) state=${2:?--state needs a directory}; shift 2 ;;
    -h | --help) sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "slurm/stop.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ -d "$state" ] || exit 0
export SLURM_CONF=$state/etc/slurm.conf

# Stops the process whose pid is in $1, if it is still the program $2.
stop_pid() {
  local file=$1 prog=$2 pid i
  [ -f "$file" ] || return 0
  pid=$(cat "$file" 2>/dev/null) || return 0
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(readlink -f "$(command -v "$prog")")" ] || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  echo "slurm/stop.sh: $prog ($pid) ignored TERM for 10 s; killing it" >&2
  kill -KILL "$pid" 2>/dev/null
}

if [ -f "$SLURM_CONF" ] && { [ -f "$state/run/slurmctld.pid" ] || [ -f "$state/etc/netns" ]; }; then
  jobs=$(squeue -h -o %i 2>/dev/null)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086 # one job id per word
    scancel $jobs 2>/dev/null
    for _ in $(seq 100); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
fi

for f in "$state"/run/slurmd-*.pid; do
  [ -e "$f" ] && stop_pid "$f" slurmd
done
stop_pid "$state/run/slurmctld.pid" slurmctld
# start.sh --ha: the two head nodes' slurmctld, then their network namespaces.
for f in "$state"/run/ctld-*/slurmctld.pid; do
  [ -e "$f" ] && stop_pid "$f" slurmctld
done
if [ -f "$state/etc/netns" ]; then
  for ns in $(cat "$state/etc/netns"); do ip netns del "$ns" 2>/dev/null; done
  rm -f "$state/etc/netns"
fi
if [ -f "$state/etc/bridge" ]; then
  ip link del "$(cat "$state/etc/bridge")" 2>/dev/null
  rm -f "$state/etc/bridge"
fi
stop_pid "$state/munge/munged.pid" munged

# Images berth mounted under the state directory (shared squashfs mounts outlive the jobs that
# used them): unmount them, deepest first, so the directory can be removed.
awk -v s="$state/" 'index($5, s) == 1 { print $5 }' /proc/self/mountinfo | sort -r |
  while read -r m; do umount -l "$m" 2>/dev/null || true; done

# Slurm's task/cgroup plugin on cgroup v1 leaves empty job directories behind; remove the ones
# of this cluster's nodes (empty directories only, deepest first).
nodes=$(sed -n 's/^# nodes: //p' "$SLURM_CONF" 2>/dev/null)
for n in $nodes; do
  for d in /sys/fs/cgroup/*/slurm_"$n"; do
    [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
  done
done
exit 0
