#!/usr/bin/env bash
# Start latency of a trivial container: `berth run` against `runc run` and a bare
# `unshare + chroot`, interleaved, on the same busybox rootfs. See bench/README.md.
#
# Usage: sudo bench/start-latency/run.sh [-n ROUNDS] [--tools berth,runc,unshare] [--parallel P]
#                                        [--baseline BIN]
#
#   -n, --rounds N   timed rounds (default 30, or $BENCH_ROUNDS); 3 untimed warm-up rounds first
#   --tools LIST     arms to run, comma-separated, from berth,runc,unshare (default: all three)
#   --parallel P     then starts per second with P in flight (default 8; 0 skips it), 3 rounds
#                    of $BENCH_STARTS starts (default 400) per arm
#   --state-disk     berth's state_dir on the temp dir's filesystem instead of a tmpfs
#   --baseline BIN   also time BIN (another berth, e.g. a release build of an earlier commit)
#                    with the same config and rootfs, as the arm `base`, and print berth/base:
#                    before/after of a change in one run
#   BERTH_BENCH_CONFIG=FILE   berth config to use instead of the generated one, which sets
#                             [cgroup] root = "/sys/fs/cgroup/unified/berth-bench" and
#                             [runtime] state_dir = a tmpfs under the bench's temp dir
#
# Builds berth with `cargo build --release` (honours CARGO_TARGET_DIR). Everything it creates
# (rootfs, OCI bundle, runc state, config, the berth-bench cgroup if it made it) is removed at exit.
set -euo pipefail

rounds=${BENCH_ROUNDS:-30}
starts=${BENCH_STARTS:-400}
tools=berth,runc,unshare
parallel=8
state_disk=0
baseline=
while [ $# -gt 0 ]; do
  case $1 in
    -n | --rounds) [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }; rounds=$2; shift 2 ;;
    --tools) [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }; tools=$2; shift 2 ;;
    --parallel) [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }; parallel=$2; shift 2 ;;
    --state-disk) state_disk=1; shift ;;
    --baseline) [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }; baseline=$2; shift 2 ;;
    -h | --help) sed -n '5,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "start-latency: error: $*" >&2; exit 1; }

if ! [[ $rounds =~ ^[1-9][0-9]*$ ]]; then die "rounds must be a positive integer, got '$rounds'"; fi
if ! [[ $parallel =~ ^[0-9]+$ ]]; then die "--parallel must be a number (0 skips the arm), got '$parallel'"; fi
if ! [[ $starts =~ ^[1-9][0-9]*$ ]]; then die "BENCH_STARTS must be a positive integer, got '$starts'"; fi
want() { [[ ,$tools, == *",$1,"* ]]; }
if [ -n "$baseline" ]; then
  [ -x "$baseline" ] || die "--baseline $baseline: not an executable file"
  want berth || die "--baseline needs the berth arm (--tools berth,...)"
fi
for t in ${tools//,/ }; do
  case $t in berth | runc | unshare) ;; *) die "unknown tool '$t' in --tools (expected berth, runc, unshare)" ;; esac
done

[ "$(id -u)" -eq 0 ] || die "must run as root (containers, namespaces, cgroups): sudo $0"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"

if ! command -v cargo >/dev/null && want berth; then
  for d in "${CARGO_HOME:-}/bin" "$HOME/.cargo/bin" /root/.cargo/bin; do
    if [ -x "$d/cargo" ]; then PATH="$d:$PATH"; break; fi
  done
fi
needs=(python3 unshare chroot)
want berth && needs+=(cargo)
want runc && needs+=(runc)
for c in "${needs[@]}"; do
  command -v "$c" >/dev/null || die "'$c' not found; run integration/setup.sh (as root) first"
done

# --- everything below is removed by cleanup() -----------------------------------------------
tmp=$(mktemp -d /tmp/berth-bench.XXXXXX)
runc_root=$tmp/runc-state
bench_cgroup=/sys/fs/cgroup/unified/berth-bench
made_cgroup=0

cleanup() {
  local rc=$? id
  if [ -d "$runc_root" ]; then
    for id in $(runc --root "$runc_root" list -q 2>/dev/null); do
      runc --root "$runc_root" delete -f "$id" >/dev/null 2>&1 ||
        echo "start-latency: warning: could not delete runc container $id" >&2
    done
  fi
  if [ "$made_cgroup" -eq 1 ] && [ -d "$bench_cgroup" ]; then
    # Children first; rmdir only removes cgroups without processes.
    find "$bench_cgroup" -depth -type d -exec rmdir {} + 2>/dev/null || true
    [ ! -d "$bench_cgroup" ] ||
      echo "start-latency: warning: could not remove $bench_cgroup (still populated?)" >&2
  fi
  # Nothing should be mounted under $tmp (berth and runc mount in their own namespaces); if
  # something is, unmount it rather than delete through it.
  local m
  while IFS= read -r m; do
    umount -l "$m" 2>/dev/null || echo "start-latency: warning: could not unmount $m" >&2
  done < <(awk -v t="$tmp/" 'index($2, t) == 1 { print $2 }' /proc/self/mounts | sort -r)
  rm -rf --one-file-system "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rootfs=$tmp/rootfs
echo "start-latency: building busybox rootfs"
bash integration/busybox-rootfs.sh "$rootfs" || die "integration/busybox-rootfs.sh failed"
[ -x "$rootfs/bin/true" ] || die "rootfs has no /bin/true: $rootfs"

arms=()
ratios=()
if want berth; then
  echo "start-latency: cargo build --release"
  cargo build --release --bin berth || die "cargo build --release failed"
  target_dir=$(cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])') ||
    die "cargo metadata failed"
  berth=$target_dir/release/berth
  [ -x "$berth" ] || die "no berth binary at $berth after the build"

  if [ -n "${BERTH_BENCH_CONFIG:-}" ]; then
    config=$BERTH_BENCH_CONFIG
    [ -f "$config" ] || die "BERTH_BENCH_CONFIG=$config: no such file"
  else
    if [ "$(stat -f -c %T "${bench_cgroup%/*}" 2>/dev/null)" != cgroup2fs ]; then
      die "${bench_cgroup%/*} is not a cgroup2 mount; set BERTH_BENCH_CONFIG to a config with a cgroup v2 root"
    fi
    [ -d "$bench_cgroup" ] || made_cgroup=1
    config=$tmp/berth.toml
    # berth's default state_dir, /run/berth, is on a tmpfs on a node (systemd mounts /run).
    # This machine's /run and /tmp are on its disk, shared with other jobs: a state directory
    # there times the disk's metadata queue (--state-disk does that), not berth.
    state=$tmp/berth-state
    if [ "$state_disk" -eq 0 ]; then
      mkdir -p "$tmp/run"
      mount -t tmpfs -o mode=755,size=16m,nosuid,nodev berth-bench-run "$tmp/run" ||
        die "could not mount a tmpfs on $tmp/run for the state directory (or use --state-disk)"
      state=$tmp/run/berth
    fi
    printf '[cgroup]\nroot = "%s"\n\n[runtime]\nstate_dir = "%s"\n' "$bench_cgroup" "$state" >"$config"
    echo "start-latency: berth's state_dir: $state ($(stat -f -c %T "${state%/*}"))"
  fi
  # A berth that exits 0 without running anything would time as fast as can be: first check
  # that the command really runs inside the rootfs.
  out=$("$berth" --config "$config" run --rootfs "$rootfs" -- /bin/cat /etc/os-release 2>&1) ||
    die "berth run failed (exit $?): $berth --config $config run --rootfs $rootfs -- /bin/cat /etc/os-release
$out"
  grep -q '^ID=berth-busybox$' <<<"$out" ||
    die "berth run did not run the command in the rootfs: /bin/cat /etc/os-release printed:
$out"
  arms+=("berth run=$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' \
    "$berth" --config "$config" run --rootfs "$rootfs" -- /bin/true)")
  if [ -n "$baseline" ]; then
    out=$("$baseline" --config "$config" run --rootfs "$rootfs" -- /bin/cat /etc/os-release 2>&1) ||
      die "the baseline's run failed (exit $?): $out"
    arms+=("base run=$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' \
      "$baseline" --config "$config" run --rootfs "$rootfs" -- /bin/true)")
    ratios+=(--ratio berth/base:1.05)
  fi
  want runc && ratios+=(--ratio berth/runc:0.5)
  want unshare && ratios+=(--ratio berth/unshare:1.5)
fi

if want runc; then
  bundle=$tmp/bundle
  mkdir -p "$bundle" "$runc_root"
  runc spec --bundle "$bundle" || die "runc spec failed"
  # runc's default spec, with our rootfs and /bin/true, and no terminal.
  python3 - "$bundle/config.json" "$rootfs" <<'PY' || die "could not edit $bundle/config.json"
import json, sys
path, rootfs = sys.argv[1], sys.argv[2]
with open(path) as f:
    spec = json.load(f)
spec["root"]["path"] = rootfs
spec["process"]["args"] = ["/bin/true"]
spec["process"]["terminal"] = False
with open(path, "w") as f:
    json.dump(spec, f, indent=1)
PY
  arms+=("runc run=$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' \
    runc --root "$runc_root" run --bundle "$bundle" '{id}')")
fi

if want unshare; then
  arms+=("unshare+chroot=$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' \
    unshare -m -p -f -u -i chroot "$rootfs" /bin/true)")
fi

echo "start-latency: $rounds rounds of: ${tools//,/, }"
python3 "$here/measure.py" --rounds "$rounds" \
  --cleanup "[\"runc\", \"--root\", \"$runc_root\", \"delete\", \"-f\", \"{id}\"]" \
  "${ratios[@]}" "${arms[@]}" || die "measurement failed (see above)"

if [ "$parallel" -gt 0 ]; then
  echo
  echo "start-latency: starts per second, $parallel in parallel, $starts starts per arm and round"
  tratios=()
  want berth && want unshare && tratios+=(--ratio berth/unshare)
  want berth && want runc && tratios+=(--ratio berth/runc)
  [ -n "$baseline" ] && tratios+=(--ratio berth/base)
  python3 "$here/throughput.py" --parallel "$parallel" --starts "$starts" --rounds 3 \
    "${tratios[@]}" "${arms[@]}" || die "throughput measurement failed (see above)"
  want berth && echo "goal: berth >= 200/s with $parallel in parallel"
fi
