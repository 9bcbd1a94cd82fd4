#!/usr/bin/env bash
# bench/stage: berth stage in vs cp -a, rsync -a and find|xargs -P4 cp --parents, on
#   (a) SMALL_FILES files of 4-64 KiB in 200 directories, (b) LARGE_FILES files of LARGE_MIB MiB;
# cold (page cache dropped before each arm) and warm; plus O_DIRECT dd as the device limit for (b)
# and an unchanged re-stage, next to statfloor.c (the lstat of every entry on both sides, in C:
# the least a re-stage that checks both sides can take); and the dataset cache: a first job that
# fills it, a second job served from it (hardlinks), against berth's plain first copy. Every arm's time includes `sync -f` of its
# destination (berth syncs before writing its completion marker), so no arm is timed writing only
# to page cache.
# The source stays under BENCH_DIR (the shared-storage stand-in); the destination is node-local
# scratch: a journaled ext4 on a loop device (direct I/O to a preallocated file), made afresh
# before each arm. So every arm starts from the same state and crosses filesystems as a real stage
# does; and none pays for the previous arm's deletions: this machine's root ext4 has no journal,
# and there creating files where thousands were deleted in the last minutes makes the inode
# allocator skip each "recently deleted" inode again on every create (found with perf: a third of
# the CPU of a copy went to ext4's recently_deleted()).
# Every arm runs ROUNDS times (3), interleaved with the others; the medians are printed.
# Needs root (drop_caches, mkfs, mount), rsync, python3, a C compiler. Usage: bench/stage/run.sh [BERTH_BINARY]
set -euo pipefail
BERTH=${1:-${BERTH:-target/release/berth}}
DIR=${BENCH_DIR:-/var/tmp/berth-bench-stage}
SMALL_FILES=${SMALL_FILES:-20000}
LARGE_FILES=${LARGE_FILES:-4}
LARGE_MIB=${LARGE_MIB:-512}
WORKERS=${WORKERS:-16}
MODES=${MODES:-"cold warm"}
ROUNDS=${ROUNDS:-3}
SETS=${SETS:-"small large"}
[ "$(id -u)" = 0 ] || { echo "bench/stage: needs root (drop_caches)" >&2; exit 1; }
command -v rsync >/dev/null || { echo "bench/stage: apt-get install rsync" >&2; exit 1; }
command -v cc >/dev/null || { echo "bench/stage: apt-get install gcc (for statfloor.c)" >&2; exit 1; }
mkdir -p "$DIR" "$DIR/dst"
# The yardstick for the re-stage: every entry's lstat on both sides, in C, nothing else.
FLOOR=$DIR/statfloor
cc -O2 -pthread -o "$FLOOR" "$(dirname "$0")/statfloor.c"

if [ ! -e "$DIR/small.done" ]; then
  rm -rf "$DIR/small"
  python3 - "$DIR/small" "$SMALL_FILES" <<'PY'
import os, random, sys
root, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(42)
for i in range(n):
    d = os.path.join(root, f"d{i % 200:03d}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i:05d}"), "wb") as f:
        f.write(os.urandom(rng.randint(4, 64) * 1024))
PY
  touch "$DIR/small.done"
fi
if [ ! -e "$DIR/large.done" ]; then
  rm -rf "$DIR/large"; mkdir -p "$DIR/large"
  for i in $(seq 1 "$LARGE_FILES"); do
    head -c "$((LARGE_MIB << 20))" /dev/urandom > "$DIR/large/f$i"
  done
  touch "$DIR/large.done"
fi

# The scratch filesystem: big enough for the larger set twice (the cache arms hold the cache and
# the job's links to it), plus room for ext4's own.
SCRATCH_IMG=$DIR/scratch.img
set_bytes() { du -sb "$DIR/$1" | cut -f1; }
scratch_gib=$(( ($(set_bytes small) > $(set_bytes large) ? $(set_bytes small) : $(set_bytes large)) * 2 / (1 << 30) + 2 ))
LOOP=
cleanup() {
  mountpoint -q "$DIR/dst" && umount "$DIR/dst"
  [ -n "$LOOP" ] && losetup -d "$LOOP"
  rm -f "$SCRATCH_IMG"
}
trap cleanup EXIT
trap "exit 130" INT TERM
rm -f "$SCRATCH_IMG"
fallocate -l "${scratch_gib}G" "$SCRATCH_IMG"
LOOP=$(losetup --direct-io=on --show -f "$SCRATCH_IMG")
# fresh_scratch: an empty filesystem at $DIR/dst.
fresh_scratch() {
  mountpoint -q "$DIR/dst" && umount "$DIR/dst"
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0,nodiscard "$LOOP"
  mount "$LOOP" "$DIR/dst"
}

# The dataset cache's arms: a config that caches everything under $DIR, the cache on the scratch
# filesystem (as the destination, so the second job gets hardlinks).
CACHE_CFG=$DIR/cache.toml
printf '[stage]\ncache_dir = "%s"\ncache_prefixes = ["%s"]\ncache_max_bytes = 1000000000000\n' \
  "$DIR/dst/cache" "$DIR" > "$CACHE_CFG"
cached() { "$BERTH" --config "$CACHE_CFG" stage in "$DIR/$1:x" --to "$DIR/dst" --workers "$WORKERS"; }

now() { date +%s.%N; }
# cold: nothing cached; warm: the source read into the page cache just before the arm, so that
# the first arm of a set is not the one that warms it for the others.
settle() {
  sync
  if [ "$1" = cold ]; then
    echo 3 > /proc/sys/vm/drop_caches
  else
    find "$DIR/$2" -type f -print0 | xargs -0 cat > /dev/null
  fi
}
RESULTS=$DIR/results.tsv
: > "$RESULTS"
# arm SET MODE NAME COMMAND...: times COMMAND into a fresh scratch filesystem, then sync.
# KEEP=1: the same filesystem, only the job's directory removed (the cache's second job).
arm() {
  local set=$1 mode=$2 name=$3; shift 3
  if [ "${KEEP:-0}" = 1 ]; then rm -rf "$DIR/dst/x"; else fresh_scratch; fi
  settle "$mode" "$set"
  local t0 t1
  t0=$(now)
  if ! "$@" >/dev/null 2>"$DIR/arm.err"; then
    echo "bench/stage: the $name arm ($set, $mode) failed: $(tail -n 1 "$DIR/arm.err")" >&2
    exit 1
  fi
  sync -f "$DIR/dst"; t1=$(now)
  local bytes; bytes=$(set_bytes "$set")
  echo -e "$set\t$mode\t$name\t$(echo "$t1 - $t0" | bc -l)\t$bytes" | tee -a "$RESULTS"
}
# The directories first: parallel `cp --parents` race to create a shared parent and fail.
xargs_cp() {
  (cd "$DIR/$1" && find . -type d -print0 | (cd "$DIR/dst" && xargs -0 mkdir -p) &&
    find . -type f -print0 | xargs -0 -P4 -n 256 cp --parents -t "$DIR/dst")
}
dd_direct() {
  for f in "$DIR/large"/*; do
    dd if="$f" of="$DIR/dst/$(basename "$f")" bs=16M iflag=direct oflag=direct status=none
  done
}

# The arms of a set, as units that run together (the re-stage needs the berth arm's tree, the
# cache hit the fill's cache).
unit_berth() {
  arm $set $mode berth "$BERTH" stage in "$DIR/$set:x" --to "$DIR/dst" --workers "$WORKERS"
  # An unchanged re-stage of what the berth arm just staged: metadata only.
  settle "$mode" "$set"
  t0=$(now); "$BERTH" stage in "$DIR/$set:x" --to "$DIR/dst" --workers "$WORKERS" 2>/dev/null; t1=$(now)
  echo -e "$set\t$mode\tberth-restage\t$(echo "$t1 - $t0" | bc -l)\t0" | tee -a "$RESULTS"
  # The least any re-stage that checks both sides can take here: statfloor's lstat of every
  # entry of the source and of the destination, with as many threads; and of the source alone
  # (what one that trusted the destination would still have to read).
  floor stat-floor "$DIR/dst/x"
  floor stat-floor-src
}
floor() {
  local name=$1 ms; shift
  settle "$mode" "$set"
  read -r _ ms < <("$FLOOR" "$WORKERS" "$DIR/$set" "$@")
  echo -e "$set\t$mode\t$name\t$(echo "$ms / 1000" | bc -l)\t0" | tee -a "$RESULTS"
}
unit_cp() { arm $set $mode cp-a cp -a "$DIR/$set" "$DIR/dst/x"; }
unit_rsync() { arm $set $mode rsync-a rsync -a "$DIR/$set/" "$DIR/dst/x/"; }
unit_xargs() { arm $set $mode xargs-cp xargs_cp $set; }
unit_dd() { if [ $set = large ]; then arm $set $mode dd-direct dd_direct; fi; }
unit_cache() {
  arm $set $mode berth-cache-fill cached $set
  KEEP=1 arm $set $mode berth-cache-hit cached $set
}
UNITS=(unit_berth unit_cp unit_rsync unit_xargs unit_dd unit_cache)

# Each round runs every arm once, so that the arms are interleaved, starting one unit further
# each round so that no arm always follows the same one; medians are reported.
for mode in $MODES; do
  for set in $SETS; do
    for round in $(seq "$ROUNDS"); do
      for k in "${!UNITS[@]}"; do
        "${UNITS[$(( (k + round - 1) % ${#UNITS[@]} ))]}"
      done
    done
  done
done

python3 - "$RESULTS" <<'PY'
import sys
import statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
runs = {}
for s, m, n, sec, _ in rows:
    runs.setdefault((s, m, n), []).append(float(sec))
t = {k: statistics.median(v) for k, v in runs.items()}
b = {(s, m, n): int(by) for s, m, n, _, by in rows}
print(f"\nmedians of {max(len(v) for v in runs.values())} rounds")
print(f"\n{'set':6} {'mode':5} {'arm':14} {'seconds':>8} {'MB/s':>8} {'berth speed-up':>15}")
for (s, m, n), sec in t.items():
    mbps = b[(s, m, n)] / sec / 1e6 if b[(s, m, n)] else 0
    inverse = {"berth-restage": " (first/restage)", "stat-floor": " (first/floor)", "stat-floor-src": " (first/floor)", "berth-cache-hit": " (first/cached)"}
    ratio = t[(s, m, "berth")] / sec if n in inverse else sec / t[(s, m, "berth")]
    label = f"{ratio:.2f}x" + inverse.get(n, "")
    print(f"{s:6} {m:5} {n:14} {sec:8.2f} {mbps:8.0f} {label:>15}")
for m in {k[1] for k in t}:
    if ("small", m, "rsync-a") in t:
        print(f"goal (a) {m}: berth vs rsync -a = {t[('small', m, 'rsync-a')] / t[('small', m, 'berth')]:.2f}x (goal >= 2x)")
    if ("large", m, "dd-direct") in t:
        print(f"goal (b) {m}: berth / O_DIRECT dd rate = {t[('large', m, 'dd-direct')] / t[('large', m, 'berth')]:.2f} (goal >= 0.9)")
    for s in ("small", "large"):
        if (s, m, "berth-restage") in t:
            floor = f"; the stat floor allows at most {t[(s, m, 'berth')] / t[(s, m, 'stat-floor')]:.0f}x, {t[(s, m, 'berth')] / t[(s, m, 'stat-floor-src')]:.0f}x reading the source alone" if (s, m, "stat-floor") in t else ""
            print(f"goal restage {s} {m}: {t[(s, m, 'berth')] / t[(s, m, 'berth-restage')]:.0f}x faster than the first stage (goal >= 50x{floor})")
        if (s, m, "berth-cache-hit") in t:
            print(f"cache {s} {m}: a second job served from the cache {t[(s, m, 'berth')] / t[(s, m, 'berth-cache-hit')]:.1f}x faster than berth's first copy (the filling job: {t[(s, m, 'berth-cache-fill')] / t[(s, m, 'berth')]:.2f}x its time)")
PY
