#!/usr/bin/env bash
# What berth adds to a Slurm step: `srun true` against `srun --container-image=<cached image> true`,
# interleaved, ≥ 20 runs each, as steps of one allocation, on a one-host Slurm with berth's
# plugin (release builds). Prints the medians and the milliseconds added. Goal: ≤ 100 ms.
# Usage: sudo bench/srun-overhead/run.sh [--runs N] [--image dir|sqsh]   (default: a busybox .sqsh)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
runs=30
image=
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=${2:?}; shift 2 ;;
    --image) image=${2:?}; shift 2 ;;
    *) echo "srun-overhead: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "srun-overhead: must run as root (it starts Slurm)" >&2; exit 1; }
cargo build --release --workspace --quiet
target=${CARGO_TARGET_DIR:-$root/target}
if [ -z "$image" ]; then
  mkdir -p "$target/bench"
  bash integration/busybox-rootfs.sh "$target/bench/busybox-rootfs"
  image=$target/bench/busybox.sqsh
  [ -f "$image" ] || mksquashfs "$target/bench/busybox-rootfs" "$image" -comp zstd -quiet -no-progress -noappend
fi
state=/tmp/berth-bench-slurm
bash integration/slurm/start.sh --state "$state" \
  --plugin "$target/release/libspank_berth.so" --berth "$target/release/berth" >/dev/null
trap 'bash integration/slurm/stop.sh --state "$state" >/dev/null 2>&1 || true' EXIT
# overhead.sh runs one untimed step first, which imports and mounts the image: the runs measure a
# cached image.
bash integration/slurm/overhead.sh --runs "$runs" --state "$state" "$image"
