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
# Each start figure is the median with its quartiles (p25-p75). With --baseline DIR the berth
# binary DIR/berth (an older build) runs in the same runs, interleaved with this tree's: the
# steps' berth is a symlink flipped between the two (the SPANK plugin is this tree's for both),
# and `berth run` runs each.
# Usage: sudo bench/mpi/run.sh [--runs N] [--rounds N] [--debug] [--baseline DIR]
#   --debug         use the debug build in target/debug (no release build; for a quick look, or
#                   against a debug baseline such as /tmp/berth-r4)
#   --baseline DIR  also measure DIR/berth (start times only; the ping-pong is this tree's)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
runs=30
rounds=5
profile=release
baseline=
while [ $# -gt 0 ]; do
  case $1 in
    --baseline) baseline=${2:?--baseline needs a directory holding berth}; shift 2 ;;
    --runs) runs=${2:?}; shift 2 ;;
    --rounds) rounds=${2:?}; shift 2 ;;
    --debug) profile=debug; shift ;;
    -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/mpi: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "bench/mpi: must run as root (it starts Slurm)" >&2; exit 1; }
[ -z "$baseline" ] || [ -x "$baseline/berth" ] || { echo "bench/mpi: $baseline/berth is not an executable" >&2; exit 1; }
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
# The steps' berth: a symlink (outside the state directory, which start.sh wipes) flipped
# between this tree's build and the baseline's.
# This tree's berth and plugin are copied first: another build in the same target directory
# would replace them mid-run.
link=$state.berth
own=$state.build
rm -rf "$own" && mkdir -p "$own"
cp "$target/$profile/berth" "$target/$profile/libspank_berth.so" "$own/"
use() { ln -sfn "$1" "$link.tmp" && mv -Tf "$link.tmp" "$link"; }
use "$own/berth"
bash integration/slurm/start.sh --state "$state" --plugin "$own/libspank_berth.so" \
  --berth "$link" --berth-config "$cfg" >/dev/null
trap 'bash integration/slurm/stop.sh --state "$state" >/dev/null 2>&1 || true; rm -rf "$cfg" "$link" "$own"' EXIT
export SLURM_CONF=$state/etc/slurm.conf

median() { printf "%s\n" "$@" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
# "p25-p75" of the numbers given (nearest rank).
quartiles() { printf "%s\n" "$@" | sort -n | awk '{a[NR]=$1} END {l=int((NR+3)/4); h=int((3*NR+3)/4); print a[l] "-" a[h]}'; }
# The tenth percentile: what other work on the host disturbs least.
p10() { printf "%s\n" "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+9)/10)]}'; }
builds=(new)
[ -z "$baseline" ] || builds+=(base)
bin_of() { if [ "$1" = new ]; then echo "$own/berth"; else echo "$baseline/berth"; fi; }

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
echo "== step start, $runs runs each, interleaved, steps of one allocation (ms: median, p25-p75)"
[ -z "$baseline" ] || echo "   new: $target/$profile/berth (copied); base: $baseline/berth"
times=$(mktemp)
# shellcheck disable=SC2016 # expanded by the inner shell
salloc -Q bash -c '
  set -e
  runs=$1 image=$2 link=$3 out=$4; shift 4
  use() { ln -sfn "$1" "$link.tmp" && mv -Tf "$link.tmp" "$link"; }
  ms() { echo $(( (${2/./} - ${1/./}) / 1000 )); }
  opts=("" --container-mpi=host --container-modules --container-slurm)
  srun -Q --container-image="$image" true # warm the image
  builds=("$@")
  for i in $(seq "$runs"); do
    for b in "${builds[@]}"; do
      name=${b%%=*}
      use "${b#*=}"
      for o in "${opts[@]}"; do
        t0=$EPOCHREALTIME; srun -Q --container-image="$image" $o true; t1=$EPOCHREALTIME
        echo "$name ${o:-none} $(ms "$t0" "$t1")" >>"$out"
      done
    done
    builds=("${builds[@]:1}" "${builds[0]}") # the first build rotates
  done
' step-start "$runs" "$image" "$link" "$times" $(for b in "${builds[@]}"; do echo "$b=$(bin_of "$b")"; done)
use "$own/berth"
for b in "${builds[@]}"; do
  # shellcheck disable=SC2046 # the lists are space-separated numbers
  base=$(median $(awk -v b="$b" '$1 == b && $2 == "none" {print $3}' "$times"))
  # shellcheck disable=SC2046
  base10=$(p10 $(awk -v b="$b" '$1 == b && $2 == "none" {print $3}' "$times"))
  for o in none --container-mpi=host --container-modules --container-slurm; do
    # shellcheck disable=SC2046
    set -- $(awk -v b="$b" -v o="$o" '$1 == b && $2 == o {print $3}' "$times")
    m=$(median "$@") m10=$(p10 "$@")
    printf "%-5s %-22s median %6s ms (p25-p75 %9s)  p10 %4s ms" "$b" "$o" "$m" "$(quartiles "$@")" "$m10"
    [ "$o" = none ] && echo || echo "  added: median $(awk "BEGIN {print $m - $base}"), p10 $(awk "BEGIN {print $m10 - $base10}") ms"
  done
done
rm -f "$times"

echo
echo "== berth run --image IMG [OPTION] -- true, $runs runs each, interleaved (ms: median, p25-p75):"
echo "   wall clock, and CPU time of berth and its children (perf's task-clock, else time's user+sys"
echo "   in 10 ms ticks): steadier on a loaded host"
opts=("" --mpi=host --modules --slurm)
# CPU milliseconds of a command, written to $cpu.
if command -v perf >/dev/null; then
  cpu_of() { perf stat -x, -e task-clock -o "$cpu" -- "$@" && awk -F, '$3 == "task-clock" {print $1; exit}' "$cpu" >"$cpu.ms"; }
else
  cpu_of() { /usr/bin/time -f "%U %S" -o "$cpu" "$@" && awk '{print ($1 + $2) * 1000}' "$cpu" >"$cpu.ms"; }
fi
"$own/berth" --config "$cfg" run --image "$image" -- true
ms() { echo $(( (${2/./} - ${1/./}) / 1000 )); }
cpu=$(mktemp)
times=$(mktemp)
order=("${builds[@]}")
for _ in $(seq "$runs"); do
  for b in "${order[@]}"; do
    berth=$(bin_of "$b")
    for o in "${opts[@]}"; do
      t0=$EPOCHREALTIME
      # shellcheck disable=SC2086 # an empty option is no argument
      cpu_of "$berth" --config "$cfg" run --image "$image" $o -- true
      t1=$EPOCHREALTIME
      echo "$b ${o:-none} $(ms "$t0" "$t1") $(cat "$cpu.ms")" >>"$times"
    done
  done
  order=("${order[@]:1}" "${order[0]}")
done
rm -f "$cpu" "$cpu.ms"
for b in "${builds[@]}"; do
  # shellcheck disable=SC2046 # the lists are space-separated numbers
  base=$(median $(awk -v b="$b" '$1 == b && $2 == "none" {print $3}' "$times"))
  # shellcheck disable=SC2046
  cbase=$(median $(awk -v b="$b" '$1 == b && $2 == "none" {print $4}' "$times"))
  for o in none --mpi=host --modules --slurm; do
    # shellcheck disable=SC2046
    walls=$(awk -v b="$b" -v o="$o" '$1 == b && $2 == o {print $3}' "$times")
    # shellcheck disable=SC2046
    cpus=$(awk -v b="$b" -v o="$o" '$1 == b && $2 == o {print $4}' "$times")
    # shellcheck disable=SC2086
    m=$(median $walls) cm=$(median $cpus)
    # shellcheck disable=SC2086
    printf "%-5s %-12s wall %6s ms (%9s)  cpu %6s ms (%13s)" "$b" "$o" "$m" "$(quartiles $walls)" \
      "$cm" "$(quartiles $cpus)"
    [ "$o" = none ] && echo || echo "  added: wall $(awk "BEGIN {print $m - $base}") ms, cpu $(awk "BEGIN {print $cm - $cbase}") ms"
  done
done
rm -f "$times"
