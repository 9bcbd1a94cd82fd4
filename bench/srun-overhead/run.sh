#!/usr/bin/env bash
# What berth adds to a Slurm step: `srun true` against `srun --container-image=<cached image> true`,
# interleaved, ≥ 20 runs each, as steps of one allocation, on a one-host Slurm with berth's
# plugin (release builds). Prints the medians and the milliseconds added. Goal: ≤ 100 ms.
# Usage: sudo bench/srun-overhead/run.sh [--runs N] [--image dir|sqsh]   (default: a busybox .sqsh)
#
# Cold big image (issue 19): sudo bench/srun-overhead/run.sh --image REF --cold [--runs N]
#   REF: a registry image (HOST:PORT#REPO:TAG, its registry plain HTTP), or `bench/import` for
#   bench/import's 1.2 GB 4-layer image (its registry is started from BENCH_IMPORT_WORK, default
#   /var/tmp/berth-bench-import; run bench/import/run.sh once first to generate the image).
#   Each round, interleaved: (a) store emptied, writeback settled, page cache dropped, then
#   `srun --container-image=REF true` (import + start through Slurm); (b) the same emptying, then
#   `berth import REF` alone plus one warm `srun --container-image=REF true`. Prints the medians
#   and the ratio a/b. Goal: ≤ 1.1×. Default 3 rounds. The step runs CMD (default `true`;
#   `/bin/sh -c true` for bench/import's busybox image, which has no `true` on its PATH).
#   --cpus N: the allocation's CPUs (salloc -c N; default: every CPU of this host, which is what
#   `berth import` alone gets). The test cluster confines a step to its CPUs (ConstrainCores=yes)
#   and the import inside `srun --container-image` runs in the step, charged to the job: with
#   fewer CPUs than `berth import` alone has, the ratio measures the allocation, not berth.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
runs=
image=
cold=0
cpus=$(nproc)
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=${2:?}; shift 2 ;;
    --image) image=${2:?}; shift 2 ;;
    --cold) cold=1; shift ;;
    --cpus) cpus=${2:?}; shift 2 ;;
    *) echo "srun-overhead: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "srun-overhead: must run as root (it starts Slurm)" >&2; exit 1; }
[ "$cold" -eq 0 ] || [ -n "$image" ] || { echo "srun-overhead: --cold needs --image REF" >&2; exit 2; }
cargo build --release --workspace --quiet
target=${CARGO_TARGET_DIR:-$root/target}
state=${BERTH_SLURM_STATE:-/tmp/berth-bench-slurm}

if [ "$cold" -eq 0 ]; then
  runs=${runs:-30}
  if [ -z "$image" ]; then
    mkdir -p "$target/bench"
    bash integration/busybox-rootfs.sh "$target/bench/busybox-rootfs"
    image=$target/bench/busybox.sqsh
    [ -f "$image" ] || mksquashfs "$target/bench/busybox-rootfs" "$image" -comp zstd -quiet -no-progress -noappend
  fi
  bash integration/slurm/start.sh --state "$state" \
    --plugin "$target/release/libspank_berth.so" --berth "$target/release/berth" >/dev/null
  trap 'bash integration/slurm/stop.sh --state "$state" >/dev/null 2>&1 || true' EXIT
  # overhead.sh runs one untimed step first, which imports and mounts the image: the runs measure
  # a cached image.
  bash integration/slurm/overhead.sh --runs "$runs" --state "$state" "$image"
  exit 0
fi

# --- cold: a big registry image through Slurm against berth import + one warm step -----------
runs=${runs:-3}
cleanup=()
trap 'for c in "${cleanup[@]}"; do eval "$c" || true; done' EXIT
if [ "$image" = bench/import ]; then
  work=${BENCH_IMPORT_WORK:-/var/tmp/berth-bench-import}
  [ -f "$work/layout/index.json" ] ||
    { echo "srun-overhead: no bench/import image in $work: run bench/import/run.sh --arms skopeo first" >&2; exit 1; }
  host=$(bash integration/registry/registry.sh start "$work/registry")
  cleanup+=("bash integration/registry/registry.sh stop '$work/registry' >/dev/null")
  skopeo copy --quiet --dest-tls-verify=false "oci:$work/layout:1" "docker://$host/bench/big:1"
  image="$host#bench/big:1"
  # busybox without its applet links: `true` is the shell's.
  cmd=${CMD:-/bin/sh -c true}
fi
cmd=${cmd:-${CMD:-true}}
host=${image%%#*}
[ "$host" != "$image" ] || host=${image%%/*}
mkdir -p "$state"
cfg=$(mktemp "${TMPDIR:-/tmp}/srun-overhead-cold.XXXXXX.toml")
store=$state/berth/store
cleanup+=("rm -f '$cfg'")
cat >"$cfg" <<TOML
# bench/srun-overhead --cold: start.sh's test configuration, with a store of its own (emptied
# every round) and the benchmark registry as plain HTTP.
[cgroup]
root = "/sys/fs/cgroup/unified/berth-slurm"
[runtime]
state_dir = "$state/berth/state"
[squashfs]
mount_dir = "$state/berth/images"
[store]
root = "$store"
[registry]
insecure = ["$host"]
TOML
bash integration/slurm/start.sh --state "$state" --berth-config "$cfg" \
  --plugin "$target/release/libspank_berth.so" --berth "$target/release/berth" >/dev/null
cleanup=("bash integration/slurm/stop.sh --state '$state' >/dev/null 2>&1" "${cleanup[@]}")
export SLURM_CONF=$state/etc/slurm.conf
# shellcheck disable=SC2016 # expanded by the inner shell
salloc -Q -c "$cpus" bash -c '
  set -e
  runs=$1 image=$2 berth=$3 cfg=$4 store=$5 cmd=$6
  ms() { echo $(( (${2/./} - ${1/./}) / 1000 )); }
  empty() { rm -rf "$store"; sync; echo 3 >/proc/sys/vm/drop_caches; }
  cold=() imp=() warm=() split=()
  for i in $(seq "$runs"); do
    empty
    # shellcheck disable=SC2086 # the command is a word list
    t0=$EPOCHREALTIME; srun -Q --container-image="$image" $cmd; t1=$EPOCHREALTIME
    cold+=("$(ms "$t0" "$t1")")
    empty
    t0=$EPOCHREALTIME; "$berth" --config "$cfg" import "$image" >/dev/null; t1=$EPOCHREALTIME
    srun -Q --container-image="$image" $cmd; t2=$EPOCHREALTIME
    imp+=("$(ms "$t0" "$t1")") warm+=("$(ms "$t1" "$t2")") split+=("$(ms "$t0" "$t2")")
  done
  median() { printf "%s\n" "$@" | sort -n | awk "{a[NR]=\$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}"; }
  c=$(median "${cold[@]}") s=$(median "${split[@]}")
  echo "rounds: $runs, interleaved; store emptied, writeback settled and page cache dropped before each; steps on $SLURM_CPUS_PER_TASK CPU(s)"
  echo "srun --container-image=REF true, cold:  median $c ms  (all: ${cold[*]})"
  echo "berth import REF alone:                 median $(median "${imp[@]}") ms  (all: ${imp[*]})"
  echo "  + one warm srun --container-image:    median $(median "${warm[@]}") ms  (all: ${warm[*]})"
  echo "  = import + warm step:                 median $s ms  (all: ${split[*]})"
  awk -v c="$c" -v s="$s" "BEGIN { r = c / s; printf \"cold srun / (import + warm step): %.2fx (goal <= 1.1x: %s)\n\", r, (r <= 1.1 ? \"met\" : \"NOT met\") }"
' overhead "$runs" "$image" "$target/release/berth" "$cfg" "$store" "$cmd"
