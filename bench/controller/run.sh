#!/bin/bash
# Controller benchmark (issue 16): 3 controllers on loopback, each with its own redb file, a
# fake Slurm (sinfo/scontrol scripts logging each call with the caller's id and term),
# `berth-controller sim` driving AGENTS simulated agents at RATE heartbeats/s, and KILLS
# `kill -9` of the leader (restarted on its data after each failover). Prints the failover time
# of each kill (from the kill until a surviving controller reports a new leader), the sim's
# summary (heartbeat latency p50/p99, failures, most heartbeats missed in a row), and CPU and
# memory of each controller.
#
#   bench/controller/run.sh [AGENTS=1000] [RATE=200] [KILLS=20]
# Needs: cargo build --release -p berth-controller (or BIN=path/to/berth-controller), curl.
set -euo pipefail
AGENTS=${1:-1000}
RATE=${2:-200}
KILLS=${3:-20}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release/berth-controller}
[ -x "$BIN" ] || { echo "run.sh: $BIN missing: cargo build --release -p berth-controller" >&2; exit 1; }
WORK=$(mktemp -d /tmp/berth-ctl-bench.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
head -c 32 /dev/urandom | base64 > "$WORK/key"
KEY=$(cat "$WORK/key")
printf '#!/bin/sh\nexit 0\n' > "$WORK/sinfo"
printf '#!/bin/sh\necho "$(date +%%s.%%N) $BERTH_CONTROLLER_ID $BERTH_CONTROLLER_TERM $*" >> %s/calls\n' "$WORK" > "$WORK/scontrol"
chmod +x "$WORK/sinfo" "$WORK/scontrol"
BASE=$((20000 + RANDOM % 20000))
PEERS=()
for i in 1 2 3; do PEERS+=(--peer "$i=127.0.0.1:$((BASE + i))"); done
declare -A PID
start() {
  "$BIN" --config "$WORK/none.toml" serve --id "$1" --listen "127.0.0.1:$((BASE + $1))" "${PEERS[@]}" \
    --data-dir "$WORK/data$1" --key-file "$WORK/key" --sinfo "$WORK/sinfo" --scontrol "$WORK/scontrol" \
    </dev/null >/dev/null 2>>"$WORK/log$1" &
  PID[$1]=$!
  PIDS+=($!)
}
: > "$WORK/none.toml"
for i in 1 2 3; do start "$i"; done
leader() {  # the id a live controller (not $1) reports as leader and that agrees itself
  for i in 1 2 3; do
    [ "$i" = "${1:-0}" ] && continue
    l=$(curl -s -m 0.5 -H "Authorization: Bearer $KEY" "127.0.0.1:$((BASE + i))/v1/status" \
      | sed -n 's/.*"leader":\([0-9]*\).*/\1/p')
    if [ -n "$l" ] && [ "$l" != "${1:-0}" ]; then echo "$l"; return; fi
  done
}
for _ in $(seq 200); do [ -n "$(leader)" ] && break; sleep 0.05; done
INTERVAL_MS=$((AGENTS * 1000 / RATE))
DURATION=$((KILLS * 4 + 10))
CTLS=()
for i in 1 2 3; do CTLS+=(--controller "127.0.0.1:$((BASE + i))"); done
"$BIN" sim --agents "$AGENTS" "${CTLS[@]}" --key-file "$WORK/key" --interval-ms "$INTERVAL_MS" \
  --duration-s "$DURATION" > "$WORK/sim.json" &
SIM=$!
PIDS+=($SIM)
sleep 5
echo "failover after kill -9 of the leader (s):"
for k in $(seq "$KILLS"); do
  old=$(leader)
  [ -n "$old" ] || { echo "no leader before kill $k" >&2; break; }
  t0=$(date +%s.%N)
  kill -9 "${PID[$old]}"
  wait "${PID[$old]}" 2>/dev/null || true
  new=""
  for _ in $(seq 400); do new=$(leader "$old"); [ -n "$new" ] && break; sleep 0.01; done
  t1=$(date +%s.%N)
  echo "  kill $k: leader $old -> ${new:-none}: $(echo "$t1 - $t0" | bc)"
  start "$old"
  sleep 3
done
echo "controllers (CPU seconds, RSS):"
for i in 1 2 3; do
  p=${PID[$i]}
  [ -r "/proc/$p/stat" ] || continue
  read -r ut st < <(awk '{print $14, $15}' "/proc/$p/stat")
  echo "  $i: cpu $(echo "scale=2; ($ut + $st) / $(getconf CLK_TCK)" | bc) s since its start, $(grep VmRSS "/proc/$p/status" | awk '{print $2 $3}')"
done
wait "$SIM" || true
echo "sim: $(cat "$WORK/sim.json")"
echo "scontrol calls: $(cat "$WORK/calls" 2>/dev/null | wc -l)"
