#!/bin/bash
# Rollout benchmark (issue 31): one controller on loopback with a fake Slurm of AGENTS nodes
# (sinfo prints a state file; scontrol rewrites it, as in bench/controller), and
# `berth-controller sim --rollout-per-node-ms` driving AGENTS simulated agents through a rollout
# of every node at MAX unavailable: each agent answers its step's order, reports it done
# PER_NODE_MS later, and passes the health gate with its next heartbeat.
# Prints the sim's summary (wall time against the ideal, batches x per-node time) and the
# leader's CPU over the rollout, from /proc/<pid>/stat (utime + stime), as % of one core.
# Goals (issue 31): wall <= 1.2 x ideal; leader < 50 % of a core.
#
#   bench/rollout/run.sh [AGENTS=1000] [MAX=10%] [PER_NODE_MS=20000] [INTERVAL_MS=5000]
# Needs: cargo build --release -p berth-controller (or BIN=path/to/berth-controller), python3.
set -euo pipefail
AGENTS=${1:-1000}
MAX=${2:-10%}
PER_NODE_MS=${3:-20000}
INTERVAL_MS=${4:-5000}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/berth-controller}
[ -x "$BIN" ] || { echo "run.sh: $BIN missing: cargo build --release -p berth-controller" >&2; exit 1; }
WORK=$(mktemp -d /tmp/berth-rollout-bench.XXXXXX)
CTL=
cleanup() {
  [ -n "$CTL" ] && kill -9 "$CTL" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
head -c 32 /dev/urandom | base64 > "$WORK/key"
chmod 600 "$WORK/key"
: > "$WORK/none.toml"

# The fake Slurm: $WORK/nodes holds "NAME|STATE|REASON" lines (sinfo's -o %N|%T|%E); scontrol
# rewrites it under a lock; squeue lists no job.
for a in $(seq 0 $((AGENTS - 1))); do printf 'sim%05d|idle|none\n' "$a"; done > "$WORK/nodes"
cat > "$WORK/sinfo" <<EOF
#!/bin/sh
exec cat "$WORK/nodes"
EOF
cat > "$WORK/squeue" <<EOF
#!/bin/sh
exit 0
EOF
cat > "$WORK/scontrol" <<EOF
#!/usr/bin/env python3
import fcntl, os, sys
work = "$WORK"
args = sys.argv[1:]
opts = dict(a.split("=", 1) for a in args if "=" in a)
nodes = set(opts.get("NodeName", "").split(","))
with open(work + "/nodes.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    out = []
    for l in open(work + "/nodes").read().splitlines():
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
chmod +x "$WORK/sinfo" "$WORK/scontrol" "$WORK/squeue"
printf '[controller]\nsqueue = "%s"\n' "$WORK/squeue" > "$WORK/ctl.toml"

PORT=$((20000 + RANDOM % 20000))
"$BIN" --config "$WORK/ctl.toml" serve --id 1 --listen "127.0.0.1:$PORT" \
  --data-dir "$WORK/data" --key-file "$WORK/key" --sinfo "$WORK/sinfo" --scontrol "$WORK/scontrol" \
  --reconcile-interval-ms 200 </dev/null >/dev/null 2>>"$WORK/log" &
CTL=$!
sleep 1
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)
echo "== $AGENTS agents, max unavailable $MAX, $PER_NODE_MS ms per node, heartbeat every $INTERVAL_MS ms"
c0=$(ticks "$CTL")
t0=$(date +%s.%N)
"$BIN" sim --agents "$AGENTS" --controller "127.0.0.1:$PORT" --key-file "$WORK/key" \
  --interval-ms "$INTERVAL_MS" --duration-s 3600 --rollout-per-node-ms "$PER_NODE_MS" \
  --rollout-max-unavailable "$MAX" > "$WORK/summary.json"
t1=$(date +%s.%N)
c1=$(ticks "$CTL")
cat "$WORK/summary.json"
python3 - "$c0" "$c1" "$t0" "$t1" "$HZ" "$WORK/summary.json" <<'EOF'
import json, sys
c0, c1, t0, t1, hz = (float(x) for x in sys.argv[1:6])
s = json.load(open(sys.argv[6]))
cpu = (c1 - c0) / hz / (t1 - t0) * 100
print("leader CPU: %.1f %% of one core over %.0f s (registering the agents included)" % (cpu, t1 - t0))
ratio = s.get("wall_over_ideal")
ok = ratio is not None and ratio <= 1.2 and cpu < 50 and s.get("done") == s.get("nodes")
print("rollout: %s, %s of %s nodes done, wall %.1f s vs ideal %.1f s = %.3f x -> %s" % (
    s.get("state"), s.get("done"), s.get("nodes"), s.get("wall_s") or -1, s.get("ideal_s") or -1,
    ratio or -1, "PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
EOF
