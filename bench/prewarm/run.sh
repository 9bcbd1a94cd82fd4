#!/usr/bin/env bash
# Image pre-warm: N nodes (berth agents on this host, each with its own store and peers port,
# one berth-controller) warming bench/import's ~1.2 GiB 4-layer gzip image with
# `berth cluster prewarm`, against N independent `berth import`s from the same registry, in the
# same run; one node's cold import as the yardstick; and the floor this host allows: N imports
# at once from a local OCI layout (no network, no registry: the N "nodes" share this host's
# CPUs and disk, so N hashes, inflates and extractions at once take what they take). The
# registry's access log gives the bytes it served to each arm. See bench/README.md ("prewarm").
#
# Usage: sudo bench/prewarm/run.sh [--nodes N] [--fanout K] [--work DIR] [--keep]
#
#   --nodes N     nodes (default 8)
#   --fanout K    berth cluster prewarm --fanout (default 2: a node serves its children every
#                 layer at once, so K x 4 layers = 8 transfers, peers.max_uploads' default)
#   --work DIR    image, registry storage and stores (default /var/tmp/berth-bench-prewarm); the
#                 image and the registry storage are reused, the stores removed after each arm
#   BERTH=PATH BERTH_CONTROLLER=PATH   binaries (default: cargo build --release of both)
#
# Goals (issue 17): registry bytes of the pre-warm = 1x the image (independent imports: Nx);
# wall time until all N hold the image <= 2x one node's cold import.
set -euo pipefail

nodes=8
fanout=2
work=/var/tmp/berth-bench-prewarm
keep=0
while [ $# -gt 0 ]; do
  case $1 in
    --nodes | --fanout | --work)
      [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }
      case $1 in --nodes) nodes=$2 ;; --fanout) fanout=$2 ;; --work) work=$2 ;; esac
      shift 2 ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '8,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "bench/prewarm: error: $*" >&2; exit 1; }
say() { echo "bench/prewarm: $*" >&2; }
[ "$(id -u)" -eq 0 ] || die "must run as root (berth's stores and agents): sudo $0"
[[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes: a positive number"
[[ $fanout =~ ^[1-9][0-9]*$ ]] || die "--fanout: a positive number"
for t in docker-registry skopeo python3 curl; do
  command -v "$t" >/dev/null || die "$t not found: run integration/setup.sh"
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
registry_sh=$repo/integration/registry/registry.sh
mkdir -p "$work"
work=$(cd "$work" && pwd)
out=$work/out

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  bash "$registry_sh" stop "$work/registry" || true
  [ "$keep" -eq 1 ] || rm -rf "$out"
}
trap cleanup EXIT

now() { date +%s%N; }
secs() { awk -v ns="$1" 'BEGIN { printf "%.1f", ns / 1e9 }'; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
settle() { sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true; }

# --- binaries ---------------------------------------------------------------------------------
if [ -z "${BERTH:-}" ] || [ -z "${BERTH_CONTROLLER:-}" ]; then
  say "building berth and berth-controller (cargo build --release)"
  (cd "$repo" && cargo build --release --quiet -p berth -p berth-controller)
  BERTH=${BERTH:-${CARGO_TARGET_DIR:-$repo/target}/release/berth}
  BERTH_CONTROLLER=${BERTH_CONTROLLER:-${CARGO_TARGET_DIR:-$repo/target}/release/berth-controller}
fi

# --- the image: bench/import's generator and push (its skopeo arm, once) -----------------------
if [ ! -f "$work/layout/index.json" ]; then
  say "generating bench/import's image (one-time, a few minutes)"
  bash "$repo/bench/import/run.sh" --arms skopeo --work "$work" >/dev/null
fi
host=$(bash "$registry_sh" start "$work/registry" --access-log)
skopeo copy --quiet --dest-tls-verify=false "oci:$work/layout:1" "docker://$host/bench/big:1"
ref="$host/bench/big:1"
log=$work/registry/registry.log
compressed=0
for l in l1 l2 l3 l4; do
  compressed=$((compressed + $(stat -c %s "$work/layout/blobs/sha256/$(cat "$work/layout/$l.digest")")))
done

# Bytes of blob GETs the registry sent after line $1 of its access log.
blob_bytes() {
  tail -n +"$(($1 + 1))" "$log" |
    awk '$6 == "\"GET" && $7 ~ /\/blobs\/sha256:/ && ($9 == 200 || $9 == 206) { b += $10 } END { printf "%.0f", b }'
}
blob_gets() {
  tail -n +"$(($1 + 1))" "$log" |
    awk '$6 == "\"GET" && $7 ~ /\/blobs\/sha256:/ && ($9 == 200 || $9 == 206) { n++ } END { printf "%d", n }'
}
mark() { wc -l <"$log"; }

rm -rf "$out"
mkdir -p "$out"
key=$out/cluster.key
head -c 32 /dev/urandom | base64 >"$key"
chmod 600 "$key"
ctl="127.0.0.1:$(free_port)"

# berth.toml of node i; $2: "peers" for an agent of the pre-warm arm.
config() {
  local i=$1 d=$out/n$1
  mkdir -p "$d"
  {
    printf '[store]\nroot = "%s/store"\n[runtime]\nstate_dir = "%s/state"\n' "$d" "$d"
    printf '[squashfs]\nmount_dir = "%s/mnt"\n[scratch]\nroot = "%s/scratch"\n' "$d" "$d"
    printf '[registry]\ninsecure = ["%s"]\n' "$host"
    if [ "${2:-}" = peers ]; then
      printf '[agent]\ncontrollers = ["%s"]\nkey_file = "%s"\ninterval_ms = 1000\n' "$ctl" "$key"
      printf 'metrics_listen = ""\nnode_name = "n%s"\n' "$i"
      printf '[peers]\nlisten = "127.0.0.1:%s"\n' "$(free_port)"
    fi
  } >"$d/berth.toml"
  echo "$d/berth.toml"
}
wipe() { for i in $(seq 1 "$nodes"); do rm -rf "$out/n$i"; done; }
holds() { "$BERTH" --config "$1" images ls 2>/dev/null | grep -q "bench/big:1"; }

# --- one node, cold ---------------------------------------------------------------------------
# The 1-minute load average as each arm starts: other work on this host skews its arm.
load() { cut -d' ' -f1 /proc/loadavg; }
settle
l_one=$(load)
m=$(mark)
cfg=$(config 1)
s=$(now)
"$BERTH" --config "$cfg" import "$ref" >/dev/null 2>"$out/one.err" || die "berth import: $(tail -1 "$out/one.err")"
t_one=$(($(now) - s))
b_one=$(blob_bytes "$m")
unpacked=$(du -sb "$out/n1/store/layers" | cut -f1)
wipe
need=$((nodes * (unpacked + compressed) + (3 << 30)))
avail=$(($(df --output=avail -B1 "$out" | tail -1)))
[ "$avail" -ge "$need" ] ||
  die "the pre-warm arm needs about $((need >> 30)) GiB in $out ($nodes stores and blob caches, store.reserve_bytes and 2 GiB for everyone else), $((avail >> 30)) GiB are free: free space or give --nodes fewer"

# --- N independent imports from the registry --------------------------------------------------
settle
l_indep=$(load)
m=$(mark)
s=$(now)
ipids=()
for i in $(seq 1 "$nodes"); do
  cfg=$(config "$i")
  "$BERTH" --config "$cfg" import "$ref" >/dev/null 2>"$out/indep-$i.err" &
  ipids+=($!)
done
failed=0
for p in "${ipids[@]}"; do wait "$p" || failed=$((failed + 1)); done
t_indep=$(($(now) - s))
[ "$failed" -eq 0 ] || die "$failed independent imports failed: $(tail -1 "$out"/indep-*.err | tail -1)"
b_indep=$(blob_bytes "$m")
g_indep=$(blob_gets "$m")
wipe

# --- the floor: N imports at once from a local OCI layout (no network) ------------------------
settle
l_floor=$(load)
s=$(now)
ipids=()
for i in $(seq 1 "$nodes"); do
  cfg=$(config "$i")
  "$BERTH" --config "$cfg" import "oci:$work/layout:1" >/dev/null 2>"$out/floor-$i.err" &
  ipids+=($!)
done
failed=0
for p in "${ipids[@]}"; do wait "$p" || failed=$((failed + 1)); done
t_floor=$(($(now) - s))
[ "$failed" -eq 0 ] || die "$failed local imports failed: $(tail -1 "$out"/floor-*.err | tail -1)"
wipe

# --- the pre-warm ----------------------------------------------------------------------------
printf '[controller]\n' >"$out/controller.toml"
"$BERTH_CONTROLLER" --config "$out/controller.toml" serve --id 1 --listen "$ctl" \
  --data-dir "$out/controller" --key-file "$key" --sinfo /bin/true --scontrol /bin/true \
  2>"$out/controller.log" &
pids+=($!)
cfgs=()
for i in $(seq 1 "$nodes"); do
  cfgs+=("$(config "$i" peers)")
  "$BERTH" --config "${cfgs[-1]}" agent 2>"$out/agent-$i.log" &
  pids+=($!)
done
for _ in $(seq 1 300); do
  n=$(curl -s -H "Authorization: Bearer $(cat "$key")" "http://$ctl/v1/catalog" |
    python3 -c 'import json,sys; print(sum(1 for n in json.load(sys.stdin) if n.get("peer")))' 2>/dev/null || echo 0)
  [ "$n" -eq "$nodes" ] && break
  sleep 0.2
done
[ "$n" -eq "$nodes" ] || die "only $n of $nodes agents reached the controller: see $out/agent-*.log (--keep)"
settle
l_warm=$(load)
m=$(mark)
s=$(now)
"$BERTH" --config "${cfgs[0]}" cluster prewarm "$ref" --fanout "$fanout" >"$out/prewarm.out" 2>&1 ||
  die "berth cluster prewarm failed: $(tail -3 "$out/prewarm.out")"
t_warm=$(($(now) - s))
b_warm=$(blob_bytes "$m")
g_warm=$(blob_gets "$m")
held=0
for c in "${cfgs[@]}"; do holds "$c" && held=$((held + 1)); done

# --- report ----------------------------------------------------------------------------------
mib() { awk -v b="$1" 'BEGIN { printf "%.0f MiB", b / 1048576 }'; }
times() { awk -v b="$1" -v c="$compressed" 'BEGIN { printf "%.2fx", b / c }'; }
echo
echo "image: 4 gzip layers, $(mib "$compressed") compressed, $(mib "$unpacked") unpacked; $nodes nodes on one host, $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-44s %9s %16s %10s %10s %8s\n' "arm" "wall s" "registry bytes" "x image" "blob GETs" "load"
printf '%-44s %9s %16s %10s %10s %8s\n' "one node, cold berth import" "$(secs "$t_one")" "$(mib "$b_one")" "$(times "$b_one")" "-" "$l_one"
printf '%-44s %9s %16s %10s %10s %8s\n' "$nodes independent berth imports (at once)" "$(secs "$t_indep")" "$(mib "$b_indep")" "$(times "$b_indep")" "$g_indep" "$l_indep"
printf '%-44s %9s %16s %10s %10s %8s\n' "floor: $nodes imports at once, local OCI layout" "$(secs "$t_floor")" "0 MiB" "-" "-" "$l_floor"
printf '%-44s %9s %16s %10s %10s %8s\n' "berth cluster prewarm --fanout $fanout" "$(secs "$t_warm")" "$(mib "$b_warm")" "$(times "$b_warm")" "$g_warm" "$l_warm"
echo "pre-warm: $held of $nodes stores hold the image; its plan:"
sed 's/^/  /' "$out/prewarm.out"
awk -v w="$b_warm" -v c="$compressed" -v i="$b_indep" -v n="$nodes" 'BEGIN {
  printf "registry bytes: pre-warm %.2fx the image (goal 1x: %s), independent %.2fx (%dx expected)\n",
    w / c, (w <= c * 1.01 ? "met" : "NOT met"), i / c, n }'
awk -v w="$t_warm" -v o="$t_one" -v i="$t_indep" -v f="$t_floor" -v n="$nodes" 'BEGIN {
  printf "wall until all hold it: pre-warm %.2fx one cold import (goal <= 2x: %s), independent %.2fx; pre-warm vs independent %.2fx\n",
    w / o, (w <= 2 * o ? "met" : "NOT met"), i / o, i / w
  printf "against the floor (%d local imports at once, %.2fx one cold import on this host): pre-warm %.2fx, independent %.2fx\n",
    n, f / o, w / f, i / f }'
