#!/usr/bin/env bash
# The main job end to end on a fresh machine: install what berth needs, build it, build a busybox
# root filesystem locally, and run a command in a container on it.
# Usage: sudo integration/demo.sh [CMD [ARG...]]   (default: show the container's view)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
[ "$(id -u)" -eq 0 ] || { echo "demo.sh: must run as root (berth mounts and creates cgroups): sudo $0" >&2; exit 1; }
if ! command -v cargo >/dev/null; then
  for d in "$HOME/.cargo/bin" /root/.cargo/bin; do [ -x "$d/cargo" ] && PATH="$d:$PATH" && break; done
fi
BERTH_SETUP_NO_VM=1 bash integration/setup.sh
cargo build --release --quiet
rootfs=target/demo/busybox-rootfs
mkdir -p target/demo
bash integration/busybox-rootfs.sh "$rootfs"
if [ $# -eq 0 ]; then
  set -- sh -c 'echo "== $(. /etc/os-release; echo "$PRETTY_NAME") as $(id -un 2>/dev/null || id -u) on $(hostname)"; \
    echo "pid $$, cgroup $(tail -1 /proc/self/cgroup)"; grep -E "^(CapEff|NoNewPrivs)" /proc/self/status; \
    mount | grep " / "; ls /dev'
fi
echo "+ berth run --rootfs $rootfs --hostname demo --user nobody -- $*"
exec target/release/berth -v run --rootfs "$rootfs" --hostname demo --user nobody -- "$@"
