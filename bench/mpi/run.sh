#!/usr/bin/env bash
# The host's MPI injected into a container (issue 29), on a one-host Slurm with berth's plugin:
#  1. a ping-pong between 2 ranks (`srun --mpi=pmix -n 2`; latency of 8-byte messages, bandwidth
#     of 1 MiB ones, /usr/local/bin/pingpong of integration/slurm/mpi-image.sh) with the image's
#     own Open MPI, with the host's injected (--container-mpi=host), and on bare metal (the same
#     binary on the host), interleaved, --rounds rounds; medians;
#  2. the step start time each host-software option adds: `srun --container-image=IMG true`
#     with none, --container-mpi=host, --container-modules, --container-slurm, interleaved, as
#     steps of one allocation, --runs runs each; medians and the milliseconds each option adds
#     (goal: <= 5 ms); and the same four as `berth run` (no Slurm in the way), wall clock and
#     CPU time (steadier when other work shares the host).
# Usage: sudo bench/mpi/run.sh [--runs N] [--rounds N] [--debug]
#   --debug  use the debug build in target/debug (no release build; slower, for a quick look)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
runs=30
rounds=5
profile=release
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=${2:?}; shift 2 ;;
    --rounds) rounds=${2:?}; shift 2 ;;
    --debug) profile=debug; shift ;;
    -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/mpi: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "bench/mpi: must run as root (it starts Slurm)" >&2; exit 1; }
target=${CARGO_TARGET_DIR:-$root/target}
if [ "$profile" = release ]; then
  cargo build --release --quiet --bin berth
  cargo build --release --quiet -p berth-spank
fi
image=$(bash integration/slurm/mpi-image.sh)
key=$(basename "$image" .sqsh)
pingpong=$(dirname "$image")/pingpong-${key#mpi-bookworm-}
[ -x "$pingpong" ] || { echo "bench/mpi: $pingpong missing: remove $image and rerun" >&2; exit 1; }
state=${BERTH_SLURM_STATE:-/tmp/berth-bench-mpi}
export BERTH_SLURM_PORT=${BERTH_SLURM_PORT:-17917}
mkdir -p "$state"
cfg=$state.toml
lib=/usr/lib/$(uname -m)-linux-gnu
# The cluster's own slurm.conf directory; the host's Lmod and Open MPI by berth's defaults.
cat >"$cfg" <<TOML
[runtime]
state_dir = "$state/berth/state"
[store]
root = "$state/berth/store"
[squashfs]
mount_dir = "$state/berth/images"
[scratch]
root = "$state/berth/scratch"
[host_software]
slurm_paths = ["/usr/bin/srun", "/usr/bin/squeue", "/usr/bin/sinfo", "/usr/bin/sbatch",
  "$lib/slurm-wlm", "$lib/libmunge.so.2", "$state/etc"]
TOML
bash integration/slurm/start.sh --state "$state" --plugin "$target/$profile/libspank_berth.so" \
  --berth "$target/$profile/berth" --berth-config "$cfg" >/dev/null
trap 'bash integration/slurm/stop.sh --state "$state" >/dev/null 2>&1 || true; rm -f "$cfg"' EXIT
export SLURM_CONF=$state/etc/slurm.conf

median() { printf "%s\n" "$@" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

echo "== ping-pong, 2 ranks on one node, $rounds rounds interleaved (medians)"
declare -A lat bw
arms=(bare image host)
for r in $(seq "$rounds"); do
  for arm in "${arms[@]}"; do
    case $arm in
      bare) out=$(srun -Q --mpi=pmix -n 2 "$pingpong") ;;
      image) out=$(srun -Q --mpi=pmix -n 2 --container-image="$image" /usr/local/bin/pingpong) ;;
      host) out=$(srun -Q --mpi=pmix -n 2 --container-image="$image" --container-mpi=host /usr/local/bin/pingpong) ;;
    esac
    lat[$arm]+="$(awk '/^latency_us/ {print $2}' <<<"$out") "
    bw[$arm]+="$(awk '/^bandwidth_MBps/ {print $2}' <<<"$out") "
  done
  arms=("${arms[@]:1}" "${arms[0]}") # the first arm rotates
done
printf "%-42s %14s %16s\n" arm "latency (us)" "bandwidth (MB/s)"
for arm in bare image host; do
  case $arm in
    bare) name="bare metal (host's Open MPI)" ;;
    image) name="container, image's Open MPI" ;;
    host) name="container, --container-mpi=host" ;;
  esac
  # shellcheck disable=SC2086 # the lists are space-separated numbers
  printf "%-42s %14s %16s\n" "$name" "$(median ${lat[$arm]})" "$(median ${bw[$arm]})"
done

echo
echo "== step start, $runs runs each, interleaved, steps of one allocation (medians, ms)"
# shellcheck disable=SC2016 # expanded by the inner shell
salloc -Q bash -c '
  set -e
  runs=$1 image=$2
  ms() { echo $(( (${2/./} - ${1/./}) / 1000 )); }
  median() { printf "%s\n" "$@" | sort -n | awk "{a[NR]=\$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}"; }
  opts=("" --container-mpi=host --container-modules --container-slurm)
  declare -A t
  srun -Q --container-image="$image" true # warm the image
  for i in $(seq "$runs"); do
    for o in "${opts[@]}"; do
      t0=$EPOCHREALTIME; srun -Q --container-image="$image" $o true; t1=$EPOCHREALTIME
      t[$o.]+="$(ms "$t0" "$t1") "
    done
  done
  base=$(median ${t[.]})
  printf "%-24s median %6s ms\n" "(none)" "$base"
  for o in "${opts[@]:1}"; do
    m=$(median ${t[$o.]})
    printf "%-24s median %6s ms  added %s ms\n" "$o" "$m" "$(awk "BEGIN {print $m - $base}")"
  done
' step-start "$runs" "$image"

echo
echo "== berth run --image IMG [OPTION] -- true, $runs runs each, interleaved (medians, ms):"
echo "   wall clock, and CPU time (user+sys of berth and its children: steadier on a loaded host)"
berth=$target/$profile/berth
declare -A b c
opts=("" --mpi=host --modules --slurm)
"$berth" --config "$cfg" run --image "$image" -- true
ms() { echo $(( (${2/./} - ${1/./}) / 1000 )); }
cpu=$(mktemp)
for _ in $(seq "$runs"); do
  for o in "${opts[@]}"; do
    t0=$EPOCHREALTIME
    # shellcheck disable=SC2086 # an empty option is no argument
    /usr/bin/time -f "%U %S" -o "$cpu" "$berth" --config "$cfg" run --image "$image" $o -- true
    t1=$EPOCHREALTIME
    b[$o.]+="$(ms "$t0" "$t1") "
    c[$o.]+="$(awk '{print ($1 + $2) * 1000}' "$cpu") "
  done
done
rm -f "$cpu"
# shellcheck disable=SC2086
base=$(median ${b[.]}) cbase=$(median ${c[.]})
printf "%-24s wall %6s ms  cpu %5s ms\n" "(none)" "$base" "$cbase"
for o in "${opts[@]:1}"; do
  # shellcheck disable=SC2086
  m=$(median ${b[$o.]}) cm=$(median ${c[$o.]})
  printf "%-24s wall %6s ms  cpu %5s ms  added: wall %s ms, cpu %s ms\n" "$o" "$m" "$cm" \
    "$(awk "BEGIN {print $m - $base}")" "$(awk "BEGIN {print $cm - $cbase}")"
done
