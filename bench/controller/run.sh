#!/bin/bash
# Controller benchmark (issue 16). For each heartbeat rate: 3 controllers on loopback, each with
# its own redb file, a fake Slurm (sinfo prints one state file; scontrol updates it and logs each
# call with its time, the calling controller's id and Raft term), and `berth-controller sim`
# driving AGENTS simulated agents. Three phases, each with a sim of its own:
#   steady:   STEADY_S seconds of load; CPU (% of one core) and RSS of each controller over it,
#             heartbeat latency p50/p99, leader changes (Raft terms gained) during it;
#   failover: KILLS `kill -9` of the leader under load (restarted on its data after each): the
#             time from the kill until a surviving controller names a new leader (p50, max), and
#             the most heartbeats any agent missed in a row;
#   drain:    30 % of the agents start failing a hard check at once (each sends at once): nodes
#             drained (the breaker allows max(2, 10 %)), drain latency from the failure to the
#             scontrol call that makes it visible in `sinfo -R` (p50, p95).
# Goals (issue 16): failover p50 <= 1.0 s, max <= 2.0 s; <= 2 heartbeats missed in a row; 0 leader
# changes under steady load; <= 100 drains of 1000 with 30 % failing; drain p95 <= 3 s; per
# controller < 50 % of a core and < 200 MB; heartbeat p99 < 50 ms.
#
#   bench/controller/run.sh [AGENTS=1000] [RATES="200 1000"] [KILLS=20] [STEADY_S=300]
# Needs: cargo build --release -p berth-controller (or BIN=path/to/berth-controller), curl, bc,
# python3.
set -euo pipefail
AGENTS=${1:-1000}
RATES=${2:-200 1000}
KILLS=${3:-20}
STEADY_S=${4:-300}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/berth-controller}
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
chmod 600 "$WORK/key"
KEY=$(cat "$WORK/key")
: > "$WORK/none.toml"

# The fake Slurm: $WORK/nodes holds "NAME|STATE|REASON" lines; scontrol rewrites it under a lock.
cat > "$WORK/sinfo" <<EOF
#!/bin/sh
exec cat "$WORK/nodes"
EOF
cat > "$WORK/scontrol" <<EOF
#!/usr/bin/env python3
import fcntl, os, sys, time
work = "$WORK"
now = time.time()
args = sys.argv[1:]
with open(work + "/calls", "a") as log:
    log.write("%.3f %s %s %s\n" % (now, os.environ.get("BERTH_CONTROLLER_ID", "?"),
              os.environ.get("BERTH_CONTROLLER_TERM", "?"), " ".join(args)))
opts = dict(a.split("=", 1) for a in args if "=" in a)
nodes = set(opts.get("NodeName", "").split(","))
with open(work + "/nodes.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    lines = open(work + "/nodes").read().splitlines()
    out = []
    for l in lines:
        name = l.split("|", 1)[0]
        if name in nodes:
            if opts.get("State") == "DRAIN":
                l = "%s|drained|%s" % (name, opts.get("Reason", ""))
            elif opts.get("State") == "RESUME":
                l = "%s|idle|none" % name
        out.append(l)
    open(work + "/nodes.tmp", "w").write("\n".join(out) + "\n")
    os.rename(work + "/nodes.tmp", work + "/nodes")
EOF
chmod +x "$WORK/sinfo" "$WORK/scontrol"

BASE=$((20000 + RANDOM % 20000))
PEERS=()
for i in 1 2 3; do PEERS+=(--peer "$i=127.0.0.1:$((BASE + i))"); done
CTLS=()
for i in 1 2 3; do CTLS+=(--controller "127.0.0.1:$((BASE + i))"); done
declare -A PID
start() {
  "$BIN" --config "$WORK/none.toml" serve --id "$1" --listen "127.0.0.1:$((BASE + $1))" "${PEERS[@]}" \
    --data-dir "$WORK/data$1" --key-file "$WORK/key" --sinfo "$WORK/sinfo" --scontrol "$WORK/scontrol" \
    </dev/null >/dev/null 2>>"$WORK/log$1" &
  PID[$1]=$!
  PIDS+=($!)
}
status() { curl -s -m 0.5 -H "Authorization: Bearer $KEY" "127.0.0.1:$((BASE + $1))/v1/status"; }
leader() {  # the leader id a live controller (not $1) reports, if not $1
  for i in 1 2 3; do
    [ "$i" = "${1:-0}" ] && continue
    l=$(status "$i" | sed -n 's/.*"leader":\([0-9]*\).*/\1/p')
    if [ -n "$l" ] && [ "$l" != "${1:-0}" ]; then echo "$l"; return; fi
  done
}
term() { for i in 1 2 3; do t=$(status "$i" | sed -n 's/.*"term":\([0-9]*\).*/\1/p'); [ -n "$t" ] && { echo "$t"; return; }; done; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
pct() {  # p-th percentile of the numbers on stdin
  sort -g | awk -v p="$1" '{v[NR]=$1} END {if (NR==0) {print "n/a"; exit} i=int((NR-1)*p+0.5)+1; printf "%.3f\n", v[i]}'
}
sim() {  # duration, extra args...
  local d=$1; shift
  "$BIN" sim --agents "$AGENTS" "${CTLS[@]}" --key-file "$WORK/key" --interval-ms "$INTERVAL_MS" \
    --duration-s "$d" "$@"
}

for RATE in $RATES; do
  INTERVAL_MS=$((AGENTS * 1000 / RATE))
  echo "== $AGENTS agents, $RATE heartbeats/s (each every $INTERVAL_MS ms)"
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
  rm -rf "$WORK"/data* "$WORK/calls"
  for a in $(seq 0 $((AGENTS - 1))); do printf 'sim%05d|idle|none\n' "$a"; done > "$WORK/nodes"
  for i in 1 2 3; do start "$i"; done
  for _ in $(seq 200); do [ -n "$(leader)" ] && break; sleep 0.05; done

  # Steady load.
  sim 5 > /dev/null  # every agent registered first
  t0=$(term)
  declare -A T0
  for i in 1 2 3; do T0[$i]=$(ticks "${PID[$i]}"); done
  s0=$(date +%s.%N)
  sim "$STEADY_S" > "$WORK/steady.json"
  s1=$(date +%s.%N)
  t1=$(term)
  echo "steady ($STEADY_S s): $(cat "$WORK/steady.json")"
  echo "  leader changes under steady load: $((t1 - t0)) (Raft terms gained)"
  hz=$(getconf CLK_TCK)
  for i in 1 2 3; do
    p=${PID[$i]}
    cpu=$(echo "scale=1; 100 * ($(ticks "$p") - ${T0[$i]}) / $hz / ($s1 - $s0)" | bc)
    echo "  controller $i: cpu $cpu % of a core, rss $(awk '/VmRSS/ {printf "%.1f MB", $2 / 1024}' "/proc/$p/status")"
  done

  # Failover.
  sim $((KILLS * 4 + 10)) > "$WORK/failover.json" &
  SIM=$!
  PIDS+=($SIM)
  sleep 3
  : > "$WORK/failovers"
  for k in $(seq "$KILLS"); do
    old=$(leader)
    [ -n "$old" ] || { echo "no leader before kill $k" >&2; break; }
    t0=$(date +%s.%N)
    kill -9 "${PID[$old]}"
    wait "${PID[$old]}" 2>/dev/null || true
    new=""
    for _ in $(seq 1000); do new=$(leader "$old"); [ -n "$new" ] && break; sleep 0.005; done
    t1=$(date +%s.%N)
    echo "$t1 - $t0" | bc >> "$WORK/failovers"
    start "$old"
    sleep 3
  done
  wait "$SIM" || true
  echo "failover over $KILLS kill -9 of the leader (s): p50 $(pct 0.5 < "$WORK/failovers"), max $(sort -g "$WORK/failovers" | tail -1)"
  echo "  all (s): $(tr '\n' ' ' < "$WORK/failovers")"
  echo "  sim during the kills: $(cat "$WORK/failover.json")"

  # 30 % failing at once.
  rm -f "$WORK/calls"
  sim 25 --failing-percent 30 --fail-after-s 5 > "$WORK/drain.json"
  since=$(sed -n 's/.*"failing_since_unix":\([0-9.]*\).*/\1/p' "$WORK/drain.json")
  drained=$(grep -c '|drained|' "$WORK/nodes" || true)
  echo "30 % of $AGENTS failing: $drained drained (limit max(2, 10 %)), $(grep -c 'State=DRAIN' "$WORK/calls" 2>/dev/null || echo 0) scontrol drain calls"
  if [ -s "$WORK/calls" ]; then
    awk -v s="$since" '/State=DRAIN/ { sub("NodeName=", "", $5); n = split($5, a, ","); for (i = 1; i <= n; i++) print $1 - s }' \
      "$WORK/calls" > "$WORK/latency"
    echo "  drain latency, failure to sinfo -R (s): p50 $(pct 0.5 < "$WORK/latency"), p95 $(pct 0.95 < "$WORK/latency"), max $(sort -g "$WORK/latency" | tail -1)"
  fi
  echo "  suppressed by the breaker: $(status "$(leader)" | sed -n 's/.*"suppressed":\([0-9]*\).*/\1/p')"
  echo "  scontrol callers per term (id term): $(awk '{print $2, $3}' "$WORK/calls" 2>/dev/null | sort -u | tr '\n' ';')"
done
