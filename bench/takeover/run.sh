#!/bin/bash
# slurmctld failover benchmark (issue 17): the one-host Slurm with a primary and a backup
# slurmctld on two "head nodes" (integration/slurm/start.sh --ha), a running job, then `kill -9`
# of the primary, twice in the same run:
#   berth:       one berth-controller (takeover_after = 3, watch_interval_ms = 1000) tells the
#                backup to take over (`scontrol takeover`);
#   slurm alone: no controller: the backup takes over by itself after SlurmctldTimeout
#                (Slurm's default, 120 s, unless CTLD_TIMEOUT is given).
# For each: seconds from the kill until an `sbatch` is accepted (each try bounded to 1 s: a
# client that reaches the backup before it took over sleeps SlurmctldTimeout/2 by Slurm's rule),
# until that job runs, and whether the running job was left alone. Then the ratio.
#
#   sudo bench/takeover/run.sh [ROUNDS=1]
# Needs: root, the harness's needs (integration/setup.sh), cargo build -p berth -p berth-spank
# -p berth-controller (debug is enough: the controller only pings and calls scontrol).
set -euo pipefail
ROUNDS=${1:-1}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BIN=${BIN:-$TARGET/debug/berth-controller}
[ -x "$BIN" ] || { echo "run.sh: $BIN missing: cargo build -p berth-controller" >&2; exit 1; }
STATE=${BERTH_SLURM_STATE:-/tmp/berth-takeover-bench}
export BERTH_SLURM_PORT=${BERTH_SLURM_PORT:-18830}
WORK=$(mktemp -d /tmp/berth-takeover-bench.XXXXXX)
cleanup() {
  # failover runs in a subshell: its controller's pid is in a file.
  [ -f "$WORK/ctl.pid" ] && kill -9 "$(cat "$WORK/ctl.pid")" 2>/dev/null || true
  bash "$ROOT/integration/slurm/stop.sh" --state "$STATE" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
head -c 32 /dev/urandom | base64 >"$WORK/key"
chmod 600 "$WORK/key"
printf '[controller]\nwatch_interval_ms = 1000\nping_timeout_ms = 1000\ntakeover_after = 3\n' >"$WORK/c.toml"
export SLURM_CONF=$STATE/etc/slurm.conf

now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc; }

# One failover: prints "ACCEPTED_S RUNNING_S UNTOUCHED".
failover() {
  local with=$1 job start t0 new acc ran
  CTL=
  bash "$ROOT/integration/slurm/start.sh" --state "$STATE" --ha --nodes 1 --no-prolog \
    ${CTLD_TIMEOUT:+--ctld-timeout "$CTLD_TIMEOUT"} >/dev/null
  # shellcheck disable=SC1091 # written by start.sh
  . "$STATE/etc/ha.env"
  if [ "$with" = berth ]; then
    rm -rf "$WORK/data"
    "$BIN" --config "$WORK/c.toml" serve --listen "127.0.0.1:$((BERTH_SLURM_PORT + 9))" \
      --data-dir "$WORK/data" --key-file "$WORK/key" 2>"$WORK/controller.log" &
    CTL=$!
    echo "$CTL" >"$WORK/ctl.pid"
    for _ in $(seq 100); do
      curl -s -H "Authorization: Bearer $(cat "$WORK/key")" \
        "http://127.0.0.1:$((BERTH_SLURM_PORT + 9))/v1/slurm" | grep -q '"takeover_armed":true' && break
      sleep 0.2
    done
  fi
  job=$(sbatch --parsable -o /dev/null --wrap 'sleep 900')
  for _ in $(seq 300); do [ "$(squeue -h -j "$job" -o %T)" = RUNNING ] && break; sleep 0.1; done
  # slurmctld saves job state a little after a change (later under load): a kill -9 before it
  # loses the start. The start may be saved before it is seen here, with nothing after it to
  # save again: a change now (a comment) makes a save that holds the running job; wait for it,
  # as tests/root_controller_watch.rs does (a fixed sleep was too short on a loaded host).
  local seen
  scontrol update "jobid=$job" comment=saved
  seen=$(date +%s.%N)
  for _ in $(seq 300); do
    [ "$(echo "$(stat -c %.9Y "$STATE/ctld/job_state" 2>/dev/null || echo 0) > $seen" | bc)" = 1 ] && break
    sleep 0.1
  done
  start=$(scontrol show job "$job" | grep -o 'StartTime=[^ ]*')
  t0=$(now)
  kill -9 "$(cat "$HA_PIDFILE1")"
  new=
  while [ -z "$new" ]; do
    new=$(timeout 1 sbatch --parsable -o /dev/null --wrap 'sleep 60' 2>/dev/null) || new=
    [ "$(echo "$(since "$t0") > 400" | bc)" = 1 ] && { echo "no sbatch accepted in 400 s" >&2; exit 1; }
  done
  acc=$(since "$t0")
  until [ "$(squeue -h -j "$new" -o %T 2>/dev/null)" = RUNNING ]; do
    sleep 0.1
    [ "$(echo "$(since "$t0") > 400" | bc)" = 1 ] && { echo "the new job did not run in 400 s" >&2; exit 1; }
  done
  ran=$(since "$t0")
  local untouched=no
  [ "$(squeue -h -j "$job" -o %T)" = RUNNING ] &&
    [ "$(scontrol show job "$job" | grep -o 'StartTime=[^ ]*')" = "$start" ] && untouched=yes
  if [ -n "$CTL" ]; then
    kill -9 "$CTL" 2>/dev/null || true
    wait "$CTL" 2>/dev/null || true
    CTL=
    rm -f "$WORK/ctl.pid"
  fi
  bash "$ROOT/integration/slurm/stop.sh" --state "$STATE" >/dev/null 2>&1
  printf '%.1f %.1f %s\n' "$acc" "$ran" "$untouched"
}

printf '%-12s %5s %14s %14s %10s\n' MODE ROUND SBATCH_OK_S JOB_RUNS_S RUNNING_JOB
for r in $(seq "$ROUNDS"); do
  read -r ba br bu < <(failover berth)
  printf '%-12s %5s %14s %14s %10s\n' berth "$r" "$ba" "$br" "$bu"
  read -r sa sr su < <(failover slurm)
  printf '%-12s %5s %14s %14s %10s\n' "slurm alone" "$r" "$sa" "$sr" "$su"
  echo "round $r: job running after ${br} s with berth vs ${sr} s with Slurm alone: $(echo "scale=1; $sr / $br" | bc)x faster"
done
