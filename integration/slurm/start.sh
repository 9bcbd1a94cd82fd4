#!/usr/bin/env bash
# Brings up a one-host Slurm cluster with berth's SPANK plugin: munged, slurmctld and 1-4 slurmd,
# all as root, every file (configs, keys, spool, logs, pid files) under one state directory.
#
# Usage: integration/slurm/start.sh [OPTIONS]
#
#   --state DIR         state directory, wiped first [default: $BERTH_SLURM_STATE or /tmp/berth-slurm]
#   --nodes N           1 to 4 slurmd on this host [default: 1]
#   --plugin FILE       the SPANK plugin [default: <target>/debug/libspank_berth.so]
#   --berth FILE        the berth binary [default: <target>/debug/berth]
#   --berth-config FILE berth's configuration [default: a test one written to DIR/etc/berth.toml]
#   --plugstack-arg A   extra plugin argument in plugstack.conf (repeatable), e.g. sbatch_support=0
#   --no-prolog         configure no Prolog/Epilog (berth without the prolog/epilog verbs)
#   --wrappers DIR      the Prolog/Epilog wrappers DIR/prolog.sh, DIR/epilog.sh (e.g. a package's,
#                       /usr/libexec/berth) [default: the repository's configs/slurm]
#
# <target> is $CARGO_TARGET_DIR, else the repository's target/. Then, for clients:
#   export SLURM_CONF=DIR/etc/slurm.conf; srun --container-image=… cmd
# Stop with integration/slurm/stop.sh (same --state). A running instance in the state directory
# is stopped first. Logs: DIR/log/. Needs: slurmctld slurmd slurm-client munge (setup.sh).
set -euo pipefail

usage() { sed -n '5,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "slurm/start.sh: $*" >&2; exit 1; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}

state=${BERTH_SLURM_STATE:-/tmp/berth-slurm}
nodes=1
plugin=$target/debug/libspank_berth.so
berth=$target/debug/berth
berth_config=
plugstack_args=()
prolog=1
wrappers=$repo/configs/slurm
while [ $# -gt 0 ]; do
  case $1 in
    --state) state=${2:?--state needs a directory}; shift 2 ;;
    --nodes) nodes=${2:?--nodes needs 1 to 4}; shift 2 ;;
    --plugin) plugin=${2:?--plugin needs a file}; shift 2 ;;
    --berth) berth=${2:?--berth needs a file}; shift 2 ;;
    --berth-config) berth_config=${2:?--berth-config needs a file}; shift 2 ;;
    --plugstack-arg) plugstack_args+=("${2:?--plugstack-arg needs KEY=VALUE}"); shift 2 ;;
    --no-prolog) prolog=0; shift ;;
    --wrappers) wrappers=${2:?--wrappers needs a directory}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument '$1'" ;;
  esac
done

[ "$(id -u)" -eq 0 ] || die "must run as root (slurmd and munged need it)"
case $nodes in 1 | 2 | 3 | 4) ;; *) die "--nodes must be 1 to 4, not '$nodes'" ;; esac
for cmd in munged slurmctld slurmd srun sinfo scontrol; do
  command -v "$cmd" >/dev/null ||
    die "$cmd not found: apt-get install slurmctld slurmd slurm-client munge (integration/setup.sh)"
done
[ -f "$plugin" ] || die "plugin $plugin not found: cargo build -p berth-spank"
[ -x "$berth" ] || die "berth binary $berth not found: cargo build"
case $state in /*) ;; *) die "--state must be an absolute path" ;; esac

bash "$here/stop.sh" --state "$state" >/dev/null 2>&1 || true
rm -rf "$state"
mkdir -p "$state"/{etc,log,run,ctld,munge,requests,berth}
chmod 755 "$state"
# slurmstepd writes the debug requests with the job user's effective uid.
chmod 1777 "$state/requests"

host=$(hostname -s)
ctld_port=${BERTH_SLURM_PORT:-17817}
# Node names unique to the state directory: slurmd names its cgroup v1 directories after the
# node (slurm_NODE/uid_U/job_J), and two clusters on this host, or a restarted one whose job ids
# start again at 1, must not meet in them.
prefix=b$(printf %s "$state" | md5sum | cut -c1-6)
node_names=()
if [ "$nodes" -eq 1 ]; then
  node_names=("$prefix")
else
  for i in $(seq "$nodes"); do node_names+=("${prefix}n$i"); done
fi

for port in $(seq "$ctld_port" $((ctld_port + nodes))); do
  if ss -Hltn "sport = :$port" 2>/dev/null | grep -q .; then
    die "port $port is in use (another Slurm?): stop it or set BERTH_SLURM_PORT"
  fi
done

# munged with its own key and socket, so the host's munge (if any) is untouched.
dd if=/dev/urandom of="$state/munge/munge.key" bs=1024 count=1 status=none
chown -R munge:munge "$state/munge"
# Clients (srun as any user) connect to the socket in it.
chmod 755 "$state/munge"
chmod 400 "$state/munge/munge.key"
socket=$state/munge/munge.socket
runuser -u munge -- munged --force --socket="$socket" --key-file="$state/munge/munge.key" \
  --pid-file="$state/munge/munged.pid" --log-file="$state/munge/munged.log" \
  --seed-file="$state/munge/munged.seed" ||
  die "munged failed to start: see $state/munge/munged.log"
for _ in $(seq 50); do [ -S "$socket" ] && break; sleep 0.1; done
[ -S "$socket" ] || die "munged did not create $socket: see $state/munge/munged.log"

if [ -z "$berth_config" ]; then
  berth_config=$state/etc/berth.toml
  cat >"$berth_config" <<EOF
# berth configuration of the one-host Slurm test cluster (integration/slurm/start.sh).
[cgroup]
root = "/sys/fs/cgroup/unified/berth-slurm"
[runtime]
state_dir = "$state/berth/state"
# Under the state directory, so that stop.sh unmounts the images the cluster's jobs mounted.
[squashfs]
mount_dir = "$state/berth/images"
EOF
fi

# Prolog/Epilog: the wrappers from configs/slurm/, pointed at this berth and configuration.
for v in prolog epilog; do
  sed -e "s|^BERTH=.*|BERTH=$berth|" -e "s|^BERTH_ARGS=.*|BERTH_ARGS=\"--config $berth_config\"|" \
    "$wrappers/$v.sh" >"$state/etc/$v.sh"
  chmod 755 "$state/etc/$v.sh"
done

echo "required $plugin berth=$berth config=$berth_config debug_request_dir=$state/requests ${plugstack_args[*]}" \
  >"$state/etc/plugstack.conf"

cpus=$(nproc)
# With several slurmd on one host the cgroup v1 hierarchies of a job would collide: track processes
# by their parentage instead.
if [ "$nodes" -eq 1 ]; then
  proctrack=proctrack/cgroup task=task/cgroup,task/affinity
else
  proctrack=proctrack/linuxproc task=task/affinity
fi
{
  cat <<EOF
# slurm.conf of the one-host berth test cluster (integration/slurm/start.sh).
ClusterName=berth
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
SlurmdDebug=debug
SlurmctldDebug=info
TmpFS=$state/tmp/%n
ProctrackType=$proctrack
TaskPlugin=$task
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
InactiveLimit=0
KillWait=5
MinJobAge=5
MessageTimeout=30
PlugStackConfig=$state/etc/plugstack.conf
EOF
  if [ "$prolog" -eq 1 ]; then
    cat <<EOF
PrologFlags=Alloc
Prolog=$state/etc/prolog.sh
Epilog=$state/etc/epilog.sh
EOF
  fi
  i=0
  for n in "${node_names[@]}"; do
    echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$((ctld_port + 1 + i)) CPUs=$cpus State=UNKNOWN"
    i=$((i + 1))
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  # stop.sh reads the node names from here to remove their cgroup directories.
  echo "# nodes: ${node_names[*]}"
} >"$state/etc/slurm.conf"
# cgroup.conf must exist next to slurm.conf, or every step fails "Nodes … are still not ready".
cat >"$state/etc/cgroup.conf" <<EOF
CgroupPlugin=autodetect
ConstrainCores=yes
EOF

export SLURM_CONF=$state/etc/slurm.conf
slurmctld -f "$SLURM_CONF" || die "slurmctld failed to start: see $state/log/slurmctld.log"
# Several slurmd on one host stand for as many hosts: each gets berth's state directory of its own, as a
# node of its own would have (its containers, names and Epilog cleanup are that node's alone).
# A mount namespace per slurmd (inherited by its slurmstepd, Prolog and Epilog) binds
# <state_dir>.<node> over runtime.state_dir; host mounts still propagate into it.
berth_state=$(sed -n 's/^[[:space:]]*state_dir[[:space:]]*=[[:space:]]*"\(.*\)"[[:space:]]*$/\1/p' "$berth_config" | head -n1)
berth_state=${berth_state:-/run/berth}
# The node-local scratch root likewise (two Prologs of one job would make the same <root>/<job>).
berth_scratch=$(awk '/^\[/ { in_scratch = ($0 ~ /^\[scratch\]/) }
  in_scratch && /^[[:space:]]*root[[:space:]]*=/ { sub(/^[^"]*"/, ""); sub(/".*$/, ""); print; exit }' "$berth_config")
berth_scratch=${berth_scratch:-/var/tmp/berth-scratch}
for n in "${node_names[@]}"; do
  mkdir -p "$state/spool/$n" "$state/tmp/$n"
  if [ "$nodes" -eq 1 ]; then
    slurmd -f "$SLURM_CONF" -N "$n" || die "slurmd $n failed to start: see $state/log/slurmd-$n.log"
  else
    mkdir -p "$berth_state" "$berth_state.$n" "$berth_scratch" "$state/scratch/$n"
    chmod 711 "$berth_state" "$berth_state.$n"
    chmod 755 "$berth_scratch" "$state/scratch" "$state/scratch/$n"
    unshare -m --propagation slave sh -c \
      'mount --bind "$1" "$2" && mount --bind "$3" "$4" && exec slurmd -f "$5" -N "$6"' \
      sh "$berth_state.$n" "$berth_state" "$state/scratch/$n" "$berth_scratch" "$SLURM_CONF" "$n" ||
      die "slurmd $n failed to start: see $state/log/slurmd-$n.log"
  fi
done

# Ready when every node is idle.
deadline=$((SECONDS + 30))
while :; do
  idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | wc -l)
  [ "$idle" -eq "$nodes" ] && break
  if [ $SECONDS -ge $deadline ]; then
    sinfo -N 2>&1 | sed 's/^/  /' >&2
    die "nodes not idle after 30 s: see $state/log/"
  fi
  sleep 0.2
done
echo "slurm/start.sh: $nodes node(s) idle; export SLURM_CONF=$SLURM_CONF"
