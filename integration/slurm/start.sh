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
#   --contain           PrologFlags=Contain: every job gets an extern step (pam_berth adopts into it)
#   --wrappers DIR      the Prolog/Epilog wrappers DIR/prolog.sh, DIR/epilog.sh (e.g. a package's,
#                       /usr/libexec/berth) [default: the repository's configs/slurm]
#   --ha                a primary and a backup slurmctld sharing StateSaveLocation, each on a "head
#                       node" of its own: a network namespace (its own address, reached from this
#                       host through a veth pair) and a UTS namespace (its own host name, which is
#                       how slurmctld knows whether it is the primary or the backup). DIR/etc/ha.env
#                       names them (HA_HEAD1/2, HA_NETNS1/2, HA_ADDR1/2, HA_HOST_ADDR, HA_PIDFILE1/2);
#                       SchedulerParameters=bf_interval=2 (why: the comment above the slurmctld start)
#   --ctld-timeout S    SlurmctldTimeout, the backup's own takeover delay [default: Slurm's, 120]
#
# <target> is $CARGO_TARGET_DIR, else the repository's target/. Then, for clients:
#   export SLURM_CONF=DIR/etc/slurm.conf; srun --container-image=… cmd
# Stop with integration/slurm/stop.sh (same --state). A running instance in the state directory
# is stopped first. Logs: DIR/log/. Needs: slurmctld slurmd slurm-client munge (setup.sh).
set -euo pipefail

usage() { sed -n '5,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
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
contain=0
wrappers=$repo/configs/slurm
ha=0
ctld_timeout=
while [ $# -gt 0 ]; do
  case $1 in
    --state) state=${2:?--state needs a directory}; shift 2 ;;
    --nodes) nodes=${2:?--nodes needs 1 to 4}; shift 2 ;;
    --plugin) plugin=${2:?--plugin needs a file}; shift 2 ;;
    --berth) berth=${2:?--berth needs a file}; shift 2 ;;
    --berth-config) berth_config=${2:?--berth-config needs a file}; shift 2 ;;
    --plugstack-arg) plugstack_args+=("${2:?--plugstack-arg needs KEY=VALUE}"); shift 2 ;;
    --no-prolog) prolog=0; shift ;;
    --contain) contain=1; shift ;;
    --wrappers) wrappers=${2:?--wrappers needs a directory}; shift 2 ;;
    --ha) ha=1; shift ;;
    --ctld-timeout) ctld_timeout=${2:?--ctld-timeout needs seconds}; shift 2 ;;
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

# --ha: two "head nodes", each a network namespace with an address of its own on a bridge that
# this host joins too (at the first address of the subnet, where slurmd and the clients are
# reached): one L2 segment, so the head nodes reach each other and this host without routing.
# The subnet's third octet comes from the state directory: two clusters here do not share one.
node_addr=127.0.0.1
ctld_hosts=("$host(127.0.0.1)")
if [ "$ha" -eq 1 ]; then
  command -v ip >/dev/null || die "--ha needs ip (iproute2)"
  octet=$((16#${prefix:1:2}))
  net=10.231.$octet
  node_addr=$net.1
  ctld_hosts=()
  : >"$state/etc/ha.env"
  # stop.sh removes these (the veth pairs and the bridge go with them).
  echo "${prefix}c1 ${prefix}c2" >"$state/etc/netns"
  echo "${prefix}br" >"$state/etc/bridge"
  ip link del "${prefix}br" 2>/dev/null || true
  ip link add "${prefix}br" type bridge || die "creating the bridge ${prefix}br failed"
  ip addr add "$node_addr/24" dev "${prefix}br"
  ip link set "${prefix}br" up
  for i in 1 2; do
    ns=${prefix}c$i
    ip netns del "$ns" 2>/dev/null || true
    ip netns add "$ns" || die "ip netns add $ns failed"
    ip link add "${prefix}h$i" type veth peer name "${prefix}p$i" netns "$ns" ||
      die "creating the veth pair of $ns failed"
    ip link set "${prefix}h$i" master "${prefix}br"
    ip link set "${prefix}h$i" up
    ip -n "$ns" addr add "$net.$((i + 1))/24" dev "${prefix}p$i"
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "${prefix}p$i" up
    ctld_hosts+=("${prefix}-head$i($net.$((i + 1)))")
    mkdir -p "$state/run/ctld-head$i"
    {
      echo "HA_HEAD$i=${prefix}-head$i"
      echo "HA_NETNS$i=$ns"
      echo "HA_ADDR$i=$net.$((i + 1))"
      echo "HA_PIDFILE$i=$state/run/ctld-head$i/slurmctld.pid"
      echo "HA_LOG$i=$state/log/slurmctld-head$i.log"
    } >>"$state/etc/ha.env"
  done
  echo "HA_HOST_ADDR=$node_addr" >>"$state/etc/ha.env"
  mkdir -p "$state/run/ctld"
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
$(for h in "${ctld_hosts[@]}"; do echo "SlurmctldHost=$h"; done)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/run/$([ "$ha" -eq 1 ] && echo ctld/)slurmctld.pid
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
$([ -n "$ctld_timeout" ] && echo "SlurmctldTimeout=$ctld_timeout")
$([ "$ha" -eq 1 ] && echo "SchedulerParameters=bf_interval=2")
PlugStackConfig=$state/etc/plugstack.conf
EOF
  if [ "$prolog" -eq 1 ]; then
    cat <<EOF
PrologFlags=Alloc$([ "$contain" -eq 1 ] && echo ,Contain)
Prolog=$state/etc/prolog.sh
Epilog=$state/etc/epilog.sh
EOF
  fi
  [ "$prolog" -eq 0 ] && [ "$contain" -eq 1 ] && echo "PrologFlags=Contain"
  i=0
  for n in "${node_names[@]}"; do
    echo "NodeName=$n NodeHostname=$host NodeAddr=$node_addr Port=$((ctld_port + 1 + i)) CPUs=$cpus State=UNKNOWN"
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
if [ "$ha" -eq 1 ]; then
  # bf_interval=2 (above): slurmctld 22.05's backup often takes over with its main scheduler
  # thread gone (it exits when it sees the shutdown flag the takeover sets while reloading
  # state, and nothing starts it again), so batch jobs start only on backfill passes; README
  # "Slurm's daemons, fast takeover, leftovers" recommends the same to admins.
  # Each slurmctld in its head node's namespaces: its host name (UTS), its address (network),
  # and its own pid file (a mount namespace binds ctld-headN over run/ctld: both read one
  # slurm.conf). The primary first; the backup then finds it in control.
  for i in 1 2; do
    ip netns exec "${prefix}c$i" unshare -u -m --propagation slave sh -c \
      'hostname "$1" && mount --bind "$2" "$3" && exec slurmctld -f "$4" -L "$5"' \
      sh "${prefix}-head$i" "$state/run/ctld-head$i" "$state/run/ctld" "$SLURM_CONF" \
      "$state/log/slurmctld-head$i.log" ||
      die "slurmctld on head$i failed to start: see $state/log/slurmctld-head$i.log"
    if [ "$i" -eq 1 ]; then
      for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'primary.* UP' && break; sleep 0.1; done
    fi
  done
else
  slurmctld -f "$SLURM_CONF" || die "slurmctld failed to start: see $state/log/slurmctld.log"
fi
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
