#!/usr/bin/env bash
# What node access under Slurm costs a login: `ssh user@node true`, interleaved, against four sshd
# that differ only in the account and session stacks of their PAM configuration:
#   (a) none        no module (pam_permit.so)
#   (b) slurm_adopt Slurm's pam_slurm_adopt.so (libpam-slurm-adopt) in the account stack
#   (c) berth       pam_berth.so with container=0: into the job's extern step
#   (d) berth+ctr   pam_berth.so: into the extern step and the job's berth container
# on a one-host Slurm (integration/slurm/start.sh --contain) where a non-root user (berthbench,
# made if missing and removed again) has one running job with a container (the busybox rootfs).
# Each sshd is the root tier's (tests/root_pam.rs): its own sshd_config and host key, a loopback
# port, its PAM stack bound over /etc/pam.d/sshd in a private mount namespace (the host's PAM
# files are never touched). Each arm is checked once first (it lets the user in and lands where it
# should). Prints medians, p10/p90, min, the ratios c/a, d/a, c/b, d/b and the ms added.
# Goal (issue 28): c and d add <= 20 ms over a and are no slower than b.
#
# Usage: sudo bench/ssh-login/run.sh [-n ROUNDS]   (default 30, or BENCH_ROUNDS)
# pam_berth.so is a release build (cargo build --release -p berth-pam); berth and its SPANK plugin
# are the debug builds (the login does not run them; start.sh's jobs do).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
rounds=${BENCH_ROUNDS:-30}
while [ $# -gt 0 ]; do
  case $1 in
    -n) rounds=${2:?-n needs a number}; shift 2 ;;
    *) echo "ssh-login: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
die() { echo "ssh-login: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "must run as root (it starts Slurm and sshd)"
adopt=/lib/security/pam_slurm_adopt.so
[ -f "$adopt" ] || adopt=/lib/x86_64-linux-gnu/security/pam_slurm_adopt.so
[ -f "$adopt" ] || die "pam_slurm_adopt.so not found: apt-get install libpam-slurm-adopt (integration/setup.sh)"
[ -x /usr/sbin/sshd ] || die "sshd not found: apt-get install openssh-server"

target=${CARGO_TARGET_DIR:-$root/target}
cargo build --release --quiet -p berth-pam || die "cargo build --release -p berth-pam failed"
[ -x "$target/debug/berth" ] || cargo build --quiet --bin berth || die "cargo build --bin berth failed"
[ -f "$target/debug/libspank_berth.so" ] || cargo build --quiet -p berth-spank ||
  die "cargo build -p berth-spank failed"
module=$target/release/libpam_berth.so

work=${BENCH_WORK:-/tmp/berth-bench-ssh-login}
state=$work/slurm
user=berthbench
made_user=0
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  bash integration/slurm/stop.sh --state "$state" >/dev/null 2>&1 || true
  [ "$made_user" -eq 0 ] || userdel "$user" 2>/dev/null || true
}
trap cleanup EXIT

rm -rf "$work/ssh"
mkdir -p "$work/ssh" "$target/bench"
bash integration/busybox-rootfs.sh "$target/bench/busybox-rootfs"
if ! id "$user" >/dev/null 2>&1; then
  useradd -M -s /bin/sh "$user" || die "useradd $user failed"
  made_user=1
fi
cat >"$work/berth.toml" <<EOF
# bench/ssh-login: start.sh's test configuration, with a cgroup root of its own.
[cgroup]
root = "/sys/fs/cgroup/unified/berth-bench-ssh"
[runtime]
state_dir = "$state/berth/state"
[squashfs]
mount_dir = "$state/berth/images"
EOF
# Two free consecutive ports (slurmctld's, slurmd's): a fixed one may be another cluster's here.
free_pair() {
  python3 -c 'import socket
for _ in range(100):
    s = socket.socket(); s.bind(("0.0.0.0", 0)); p = s.getsockname()[1]
    t = socket.socket()
    try:
        t.bind(("0.0.0.0", p + 1)); print(p); break
    except OSError:
        pass'
}
BERTH_SLURM_PORT=${BERTH_SLURM_PORT:-$(free_pair)} bash integration/slurm/start.sh --state "$state" \
  --contain --berth-config "$work/berth.toml" >/dev/null || die "integration/slurm/start.sh failed"
export SLURM_CONF=$state/etc/slurm.conf
node=$(sed -n 's/^# nodes: //p' "$SLURM_CONF")

cwd=$work/cwd
rm -rf "$cwd"
mkdir -p "$cwd"
chmod 1777 "$cwd"
job=$(cd "$cwd" && runuser -u "$user" -- sbatch --parsable --output=/dev/null \
  --container-image="$target/bench/busybox-rootfs" --container-name=bench --wrap 'sleep 3600') ||
  die "sbatch failed"
for _ in $(seq 600); do
  [ "$(squeue -h -o %T -j "$job")" = RUNNING ] && break
  sleep 0.1
done
[ "$(squeue -h -o %T -j "$job")" = RUNNING ] || die "job $job not running after 60 s"
# The container exists once the batch step has started it.
for _ in $(seq 300); do
  grep -qs "\"job\":\"$job\"" "$state"/berth/state/*/state.json && break
  sleep 0.1
done
grep -qs "\"job\":\"$job\"" "$state"/berth/state/*/state.json ||
  die "job $job has no berth container after 30 s: see $state/log/"

d=$work/ssh
ssh-keygen -q -t ed25519 -N '' -f "$d/host_key"
ssh-keygen -q -t ed25519 -N '' -f "$d/client_key"
mkdir -p "$d/keys"
cp "$d/client_key.pub" "$d/keys/$user"
berth_args="nodename=$node slurm_conf=$SLURM_CONF state_dir=$state/berth/state"
declare -A stack=(
  [a]="account required pam_permit.so
session required pam_permit.so"
  [b]="account required $adopt nodename=$node action_adopt_failure=deny
session required pam_permit.so"
  [c]="account required $module $berth_args container=0
session required $module $berth_args container=0"
  [d]="account required $module $berth_args
session required $module $berth_args"
)
mkdir -p /run/sshd
declare -A port
for arm in a b c d; do
  port[$arm]=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  printf 'auth required pam_deny.so\n%s\n' "${stack[$arm]}" >"$d/pam.$arm"
  cat >"$d/sshd_config.$arm" <<EOF
ListenAddress 127.0.0.1
HostKey $d/host_key
PidFile $d/sshd.$arm.pid
UsePAM yes
AuthorizedKeysFile $d/keys/%u
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
Subsystem sftp internal-sftp
EOF
  # SLURM_CONF in sshd's environment is how pam_slurm_adopt finds the test cluster.
  unshare -m --propagation private sh -c \
    'mount --bind "$1" /etc/pam.d/sshd && exec /usr/sbin/sshd -D -e -p "$2" -f "$3"' \
    sh "$d/pam.$arm" "${port[$arm]}" "$d/sshd_config.$arm" >"$d/sshd.$arm.log" 2>&1 &
  pids+=($!)
done
for arm in a b c d; do
  for _ in $(seq 100); do
    (echo >"/dev/tcp/127.0.0.1/${port[$arm]}") 2>/dev/null && break
    sleep 0.1
  done
done

client() {
  printf '["timeout","60","ssh","-i","%s","-o","StrictHostKeyChecking=no","-o","UserKnownHostsFile=/dev/null","-o","BatchMode=yes","-o","LogLevel=ERROR","-p","%s","%s@127.0.0.1"' \
    "$d/client_key" "$1" "$user"
}
# Each arm once, untimed, where it must land: b and c in the job's extern step on the host,
# d in the container, a neither. Up to 20 tries each: on a loaded machine the job's extern step
# may not be registered with its slurmstepd yet when squeue already says RUNNING.
check() {
  local arm=$1 out try
  for try in $(seq 20); do
    out=$(timeout 60 ssh -i "$d/client_key" -o StrictHostKeyChecking=no \
      -o UserKnownHostsFile=/dev/null -o BatchMode=yes -o LogLevel=ERROR -p "${port[$arm]}" \
      "$user@127.0.0.1" 'cat /proc/self/cgroup /etc/os-release' 2>&1) && break
    [ "$try" -lt 20 ] || die "arm $arm: the login failed: $out (sshd log: $d/sshd.$arm.log)"
    sleep 0.5
  done
  local in_step=0 in_image=0
  grep -q "job_$job/step_extern" <<<"$out" && in_step=1
  grep -q 'berth test image' <<<"$out" && in_image=1
  case $arm in
    a) [ "$in_step$in_image" = 00 ] || die "arm a: adopted without a module: $out" ;;
    b | c) [ "$in_step$in_image" = 10 ] || die "arm $arm: not in job $job's extern step on the host: $out" ;;
    d) [ "$in_step$in_image" = 11 ] || die "arm d: not in job $job's container: $out" ;;
  esac
}
for arm in a b c d; do check "$arm"; done

echo "job $job of $user on $node (one job, a berth container); $rounds rounds, interleaved"
python3 bench/ssh-login/measure.py --rounds "$rounds" \
  --pair c/a --pair d/a --pair c/b --pair d/b \
  "a none=$(client "${port[a]}"),\"true\"]" \
  "b pam_slurm_adopt=$(client "${port[b]}"),\"true\"]" \
  "c pam_berth (extern step)=$(client "${port[c]}"),\"true\"]" \
  "d pam_berth (container)=$(client "${port[d]}"),\"true\"]"
