#!/usr/bin/env bash
# The main job end to end on a fresh machine: install what berth needs (Slurm, munge, squashfs
# tools), build berth and its SPANK plugin, build a busybox image locally as an Enroot-style
# .sqsh, bring up a one-host Slurm with the plugin, and run containerized srun steps in it.
# Usage: sudo integration/demo.sh [CMD [ARG...]]   (default: show the container's view)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
[ "$(id -u)" -eq 0 ] || { echo "demo.sh: must run as root (it installs packages and starts Slurm): sudo $0" >&2; exit 1; }
if ! command -v cargo >/dev/null; then
  for d in "$HOME/.cargo/bin" /root/.cargo/bin; do [ -x "$d/cargo" ] && PATH="$d:$PATH" && break; done
fi
BERTH_SETUP_NO_VM=1 bash integration/setup.sh
echo "demo: building berth and the SPANK plugin"
cargo build --workspace --quiet
mkdir -p target/demo
rootfs=target/demo/busybox-rootfs
image=$root/target/demo/busybox.sqsh
bash integration/busybox-rootfs.sh "$rootfs"
[ -f "$image" ] || mksquashfs "$rootfs" "$image" -comp zstd -quiet -no-progress -noappend
state=/tmp/berth-demo-slurm
echo "demo: starting a one-host Slurm with berth's plugin (state in $state)"
bash integration/slurm/start.sh --state "$state"
trap 'bash integration/slurm/stop.sh --state "$state" >/dev/null 2>&1 || true' EXIT
export SLURM_CONF=$state/etc/slurm.conf
if [ $# -eq 0 ]; then
  set -- sh -c 'echo "== $(. /etc/os-release; echo "$PRETTY_NAME"), task $SLURM_PROCID of $SLURM_NTASKS on $(hostname), uid $(id -u)"; \
    grep -E "^(CapEff|NoNewPrivs)" /proc/self/status | tr "\n" " "; echo; mount | grep " / "'
fi
echo "+ srun --container-image=$image -n 2 $*"
srun --container-image="$image" -n 2 "$@"
