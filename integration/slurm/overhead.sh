#!/usr/bin/env bash
# Measures what berth's SPANK plugin adds to a job step: `srun true` against
# `srun --container-image=IMAGE true`, interleaved, as steps of one allocation (so the
# scheduler's job start and the Prolog/Epilog are not counted), and prints the medians.
#
# Usage: integration/slurm/overhead.sh [--runs N] [--state DIR] IMAGE
#
#   IMAGE       what --container-image gets (a root filesystem directory, a .sqsh, …)
#   --runs N    runs of each [default: 20]
#   --state DIR the cluster of integration/slurm/start.sh [default: $BERTH_SLURM_STATE or /tmp/berth-slurm]
set -euo pipefail

runs=20
state=${BERTH_SLURM_STATE:-/tmp/berth-slurm}
image=
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=${2:?--runs needs a number}; shift 2 ;;
    --state) state=${2:?--state needs a directory}; shift 2 ;;
    -h | --help) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "overhead.sh: unknown option '$1'" >&2; exit 2 ;;
    *) image=$1; shift ;;
  esac
done
[ -n "$image" ] || { echo "overhead.sh: IMAGE missing (see --help)" >&2; exit 2; }
export SLURM_CONF=$state/etc/slurm.conf
[ -f "$SLURM_CONF" ] || { echo "overhead.sh: no cluster at $state: run integration/slurm/start.sh" >&2; exit 1; }

# The loop runs inside the allocation; each srun is one step.
# shellcheck disable=SC2016 # expanded by the inner shell
salloc -Q bash -c '
  set -e
  runs=$1 image=$2
  ms() { echo $(( (${2/./} - ${1/./}) / 1000 )); }
  plain=() contained=()
  srun -Q --container-image="$image" true # warm the image (import, page cache)
  for i in $(seq "$runs"); do
    t0=$EPOCHREALTIME; srun -Q true; t1=$EPOCHREALTIME
    srun -Q --container-image="$image" true; t2=$EPOCHREALTIME
    plain+=("$(ms "$t0" "$t1")") contained+=("$(ms "$t1" "$t2")")
  done
  median() { printf "%s\n" "$@" | sort -n | awk "{a[NR]=\$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}"; }
  p=$(median "${plain[@]}") c=$(median "${contained[@]}")
  echo "runs: $runs each, interleaved, steps of one allocation"
  echo "srun true:                         median $p ms  (all: ${plain[*]})"
  echo "srun --container-image=IMAGE true: median $c ms  (all: ${contained[*]})"
  echo "added by the container:            $(awk "BEGIN {print $c - $p}") ms"
' overhead "$runs" "$image"
