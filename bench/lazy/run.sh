#!/usr/bin/env bash
# Lazily loaded images (issue 19, point 5): cold time-to-first-exec of a ~5 GiB image through
# `berth run --image lazy:REF` (chunks fetched on first access) against a full `berth import`
# then `berth run`, same registry, same content, page cache dropped before each arm.
# See bench/README.md ("Lazy loading").
#
# Usage: sudo bench/lazy/run.sh [--gib N] [--rounds N] [--work DIR] [--keep] [--srun]
#
#   --gib N       image size in GiB (default 5): busybox + small files + N GiB of data files,
#                 half random, half repetitive, as bench/import's (gzip ~ 55 %)
#   --rounds N    run the arms N times, interleaved (default 1); every figure is printed
#   --work DIR    where the trees, registry storage and store go (default
#                 /var/tmp/berth-bench-lazy); all of it is removed at exit unless --keep
#   --srun        also the Slurm arms (issue 30), on a one-host Slurm of the run's own
#                 (integration/slurm/start.sh under DIR/slurm, BERTH_SLURM_PORT or a free port)
#   BERTH=PATH    berth binary (default: cargo build --release, honouring CARGO_TARGET_DIR)
#   PLUGIN=PATH   the SPANK plugin for --srun (default: libspank_berth.so beside BERTH, built
#                 with cargo build -p berth-spank of BERTH's profile when missing)
#
# The arms:
#   import+run  an empty store: berth import REF, then berth run --image REF -- /bin/true
#   lazy cold   an empty chunk cache: berth run --image lazy:LAZYREF -- /bin/true
#   lazy warm   the same again, its chunks now in the node's cache (the page cache dropped)
# With --srun, the time to first exec through Slurm (srun's wall time, the job's Prolog included:
# it pre-imports the job's image, which the step waits for):
#   srun full   an empty store: srun --container-image=REF /bin/true
#   srun lazy   no server, an empty chunk cache: srun --container-image=lazy:LAZYREF /bin/true
# and the job's total wall time for a workload that reads ~10 % of the image (the first tenth of
# its data shards, cat to /dev/null), from an empty store / no server and an empty chunk cache:
#   srun work full   srun --container-image=REF sh -c 'cat SHARDS >/dev/null'
#   srun work lazy   srun --container-image=lazy:LAZYREF sh -c 'cat SHARDS >/dev/null'
# (srun's wall time: the Prolog, the image, the read; the ratio lazy/full is printed, goal <= 0.5).
set -euo pipefail

gib=5
rounds=1
work=/var/tmp/berth-bench-lazy
keep=0
srun_arms=0
while [ $# -gt 0 ]; do
  case $1 in
    --gib) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: $1 needs a count" >&2; exit 2; }; gib=$2; shift 2 ;;
    --rounds) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: $1 needs a count" >&2; exit 2; }; rounds=$2; shift 2 ;;
    --work) [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }; work=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --srun) srun_arms=1; shift ;;
    -h | --help) sed -n '6,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "bench/lazy: error: $*" >&2; exit 1; }
say() { echo "bench/lazy: $*" >&2; }
settle() { sync; echo 3 >/proc/sys/vm/drop_caches; }
now() { date +%s%N; }
secs() { awk -v ns="$1" 'BEGIN { printf "%.3f", ns / 1e9 }'; }

[ "$(id -u)" -eq 0 ] || die "must run as root (berth's store, FUSE and loop mounts): sudo $0"
for t in docker-registry skopeo python3 gzip tar sha256sum mksquashfs; do
  command -v "$t" >/dev/null || die "$t not found: run integration/setup.sh"
done
[ -e /dev/fuse ] || die "/dev/fuse missing: modprobe fuse"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
registry_sh=$repo/integration/registry/registry.sh
mkdir -p "$work"
work=$(cd "$work" && pwd)
need=$(((gib * 3 + 2) * 1024 * 1024))
avail=$(df -k --output=avail "$work" | tail -1)
[ "$avail" -gt "$need" ] || die "$work has $((avail / 1024 / 1024)) GiB free; this needs ~$((gib * 3 + 2)) GiB (--gib, --work)"

cleanup() {
  if [ "$srun_arms" -eq 1 ]; then
    bash "$repo/integration/slurm/stop.sh" --state "$work/slurm" >/dev/null 2>&1 || true
    "${BERTH:-berth}" --config "$work/berth.toml" gc >/dev/null 2>&1 || true
  fi
  bash "$registry_sh" stop "$work/registry" >/dev/null 2>&1 || true
  [ "$keep" -eq 1 ] || rm -rf "$work"
}
trap cleanup EXIT

if [ -z "${BERTH:-}" ]; then
  say "building berth (cargo build --release)"
  (cd "$repo" && cargo build --release --quiet --bin berth)
  BERTH=${CARGO_TARGET_DIR:-$repo/target}/release/berth
fi

# --- the image: one tree → a gzip layer (OCI layout) and a squashfs -------------------------
tree=$work/tree
layout=$work/layout
sqsh=$work/image.sqsh
say "generating a $gib GiB tree"
rm -rf "$tree" "$layout"
python3 - "$tree" /bin/busybox "$gib" <<'EOF'
import os, shutil, sys
dest, busybox, gib = sys.argv[1], sys.argv[2], int(sys.argv[3])
MIB = 1 << 20
for d in ("bin", "etc", "tmp", "usr/share/small", "data"):
    os.makedirs(os.path.join(dest, d), exist_ok=True)
shutil.copy(busybox, os.path.join(dest, "bin/busybox"))
os.chmod(os.path.join(dest, "bin/busybox"), 0o755)
for n in ("sh", "true", "cat"):
    os.symlink("busybox", os.path.join(dest, "bin", n))
with open(os.path.join(dest, "etc/passwd"), "w") as f:
    f.write("root:x:0:0:root:/root:/bin/sh\n")
for i in range(5000):
    with open(os.path.join(dest, "usr/share/small", "f%05d.txt" % i), "wb") as f:
        f.write((b"berth lazy benchmark %d\n" % i) * (20 + i % 150))
pattern = (b"berth benchmark: partially compressible filler line 0123456789\n" * 9000)[: MIB // 2]
for i in range(gib * 4):
    with open(os.path.join(dest, "data", "shard-%03d.bin" % i), "wb") as f:
        for _ in range(256):
            f.write(os.urandom(MIB // 2))
            f.write(pattern)
EOF
size=$(du -sb "$tree" | cut -f1)
mkdir -p "$layout/blobs/sha256"
say "making the OCI layer (tar | gzip -1) and the squashfs (mksquashfs -comp zstd)"
(
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$tree" -cf - . |
    tee >(sha256sum | cut -d' ' -f1 >"$layout/diffid.tmp" && mv "$layout/diffid.tmp" "$layout/diffid") |
    gzip -n -1 >"$layout/layer.gz"
) &
mksquashfs "$tree" "$sqsh" -noappend -quiet -no-progress -comp zstd -Xcompression-level 3 &
wait
for _ in $(seq 1 600); do [ -s "$layout/diffid" ] && break; sleep 0.1; done
[ -s "$layout/diffid" ] || die "the layer's sha256 did not come"
rm -rf "$tree"
d=$(sha256sum "$layout/layer.gz" | cut -d' ' -f1)
lsize=$(stat -c %s "$layout/layer.gz")
mv "$layout/layer.gz" "$layout/blobs/sha256/$d"
config="{\"architecture\":\"amd64\",\"os\":\"linux\",\"config\":{\"Env\":[\"PATH=/bin\"],\"Cmd\":[\"/bin/sh\"]},\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$(cat "$layout/diffid")\"]}}"
printf '%s' "$config" >"$layout/c.json"
cd_=$(sha256sum "$layout/c.json" | cut -d' ' -f1)
mv "$layout/c.json" "$layout/blobs/sha256/$cd_"
manifest="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$cd_\",\"size\":${#config}},\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:$d\",\"size\":$lsize}]}"
printf '%s' "$manifest" >"$layout/m.json"
md=$(sha256sum "$layout/m.json" | cut -d' ' -f1)
mv "$layout/m.json" "$layout/blobs/sha256/$md"
printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"1"}}]}' \
  "$md" "${#manifest}" >"$layout/index.json"

# --- the registry: the image, and its lazy form ---------------------------------------------
host=$(bash "$registry_sh" start "$work/registry")
cfg=$work/berth.toml
printf '[store]\nroot = "%s"\n[squashfs]\nmount_dir = "%s"\n[runtime]\nstate_dir = "%s"\n[scratch]\nroot = "%s"\n[registry]\ninsecure = ["%s"]\n' \
  "$work/store" "$work/images" "$work/state" "$work/scratch" "$host" >"$cfg"
say "registry on $host; pushing bench/lazy:1 ($((lsize / 1048576)) MiB gzip) and its lazy form"
skopeo copy --quiet --dest-tls-verify=false "oci:$layout:1" "docker://$host/bench/lazy:1"
rm -rf "$layout"
"$BERTH" --config "$cfg" lazy publish "$sqsh" "docker://$host/bench/lazy:lazy" >&2
ssize=$(stat -c %s "$sqsh")
rm -f "$sqsh"

if [ "$srun_arms" -eq 1 ]; then
  plugin=${PLUGIN:-$(dirname "$BERTH")/libspank_berth.so}
  if [ ! -e "$plugin" ]; then
    profile=()
    [ "$(basename "$(dirname "$BERTH")")" = release ] && profile=(--release)
    (cd "$repo" && cargo build --quiet "${profile[@]}" -p berth-spank)
  fi
  port=${BERTH_SLURM_PORT:-$(python3 -c 'import socket
for p in range(27000, 28000, 2):
    try:
        for q in (p, p + 1):
            s = socket.socket(); s.bind(("0.0.0.0", q)); s.close()
        print(p); break
    except OSError:
        pass')}
  say "starting a one-host Slurm (port $port)"
  BERTH_SLURM_PORT=$port bash "$repo/integration/slurm/start.sh" --state "$work/slurm" \
    --plugin "$plugin" --berth "$BERTH" --berth-config "$cfg" >&2 </dev/null
fi

# --- arms ------------------------------------------------------------------------------------
declare -A t
out=$work/out
mkdir -p "$out"
timed() { # NAME CMD...: runs CMD, appends its wall ns to t[NAME]
  local name=$1 s e
  shift
  s=$(now)
  "$@" >"$out/$name.out" 2>"$out/$name.err" || die "$name failed: $(tail -2 "$out/$name.err")"
  e=$(now)
  t[$name]="${t[$name]:-} $((e - s))"
}
import_run() {
  "$BERTH" --config "$cfg" import "docker://$host/bench/lazy:1" &&
    "$BERTH" --config "$cfg" run --image "docker://$host/bench/lazy:1" -- /bin/true
}
lazy_run() { "$BERTH" -v --config "$cfg" run --image "lazy:docker://$host/bench/lazy:lazy" -- /bin/true; }
srun_as() { SLURM_CONF=$work/slurm/etc/slurm.conf srun -n1 --container-image="$1" /bin/true; }
srun_full() { srun_as "docker://$host/bench/lazy:1"; }
# Until the job has left the queue: its Epilog opens the store, which must not be removed
# under it.
jobs_done() {
  for _ in $(seq 1 1500); do
    [ -z "$(SLURM_CONF=$work/slurm/etc/slurm.conf squeue -h 2>/dev/null)" ] && return 0
    sleep 0.2
  done
  die "the benchmark's job did not leave the queue within 300 s"
}
srun_lazy() { srun_as "lazy:docker://$host/bench/lazy:lazy"; }
# The first tenth (rounded up) of the gib*4 data shards of 256 MiB each: ~10 % of the image.
shards=$(((gib * 4 + 9) / 10))
work_cmd="cat $(for i in $(seq 0 $((shards - 1))); do printf '/data/shard-%03d.bin ' "$i"; done)>/dev/null"
srun_work() { SLURM_CONF=$work/slurm/etc/slurm.conf srun -n1 --container-image="$1" /bin/sh -c "$work_cmd"; }
srun_work_full() { srun_work "docker://$host/bench/lazy:1"; }
srun_work_lazy() { srun_work "lazy:docker://$host/bench/lazy:lazy"; }
# A cold start for a Slurm arm: no lazy server (the Epilog stops it; gc again to be sure), an
# empty store and chunk cache, the page cache dropped.
cold() {
  "$BERTH" --config "$cfg" gc >/dev/null
  rm -rf "$work/store"
  settle
}
fetched=()
for r in $(seq 1 "$rounds"); do
  if [ "$srun_arms" -eq 1 ]; then
    cold
    timed srun_full srun_full
    jobs_done
    cold
    timed srun_lazy srun_lazy
    jobs_done
    cold
    timed srun_work_full srun_work_full
    jobs_done
    cold
    timed srun_work_lazy srun_work_lazy
    jobs_done
  fi
  rm -rf "$work/store"
  settle
  timed import_run import_run
  rm -rf "$work/store"
  settle
  timed lazy_cold lazy_run
  fetched+=("$(grep -o 'fetched [0-9]* of [0-9]* bytes' "$out/lazy_cold.err" | tail -1)")
  settle
  timed lazy_warm lazy_run
  say "round $r done"
done

median() { tr ' ' '\n' | grep . | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
mi=$(echo "${t[import_run]}" | median)
mc=$(echo "${t[lazy_cold]}" | median)
mw=$(echo "${t[lazy_warm]}" | median)
echo "image: $((size / 1048576)) MiB of files; gzip layer $((lsize / 1048576)) MiB; squashfs $((ssize / 1048576)) MiB; $rounds round(s), medians"
echo "import + run (cold):      $(secs "$mi") s   [all: $(for x in ${t[import_run]}; do printf '%s ' "$(secs "$x")"; done)]"
echo "lazy run, cold cache:     $(secs "$mc") s   [all: $(for x in ${t[lazy_cold]}; do printf '%s ' "$(secs "$x")"; done)]; ${fetched[*]}"
echo "lazy run, warm cache:     $(secs "$mw") s   [all: $(for x in ${t[lazy_warm]}; do printf '%s ' "$(secs "$x")"; done)]"
awk -v a="$mi" -v b="$mc" 'BEGIN { printf "ratio import+run / lazy cold: %.1fx\n", a / b }'
if [ "$srun_arms" -eq 1 ]; then
  sf=$(echo "${t[srun_full]}" | median)
  sl=$(echo "${t[srun_lazy]}" | median)
  echo "srun, full import (cold): $(secs "$sf") s   [all: $(for x in ${t[srun_full]}; do printf '%s ' "$(secs "$x")"; done)]"
  echo "srun, lazy (cold cache):  $(secs "$sl") s   [all: $(for x in ${t[srun_lazy]}; do printf '%s ' "$(secs "$x")"; done)]"
  awk -v a="$sf" -v b="$sl" 'BEGIN { printf "ratio srun lazy / srun full: %.3f (srun full / lazy: %.1fx)\n", b / a, a / b }'
  wf=$(echo "${t[srun_work_full]}" | median)
  wl=$(echo "${t[srun_work_lazy]}" | median)
  echo "job reading $shards of $((gib * 4)) shards (~10 %), srun wall:"
  echo "  full import (cold):     $(secs "$wf") s   [all: $(for x in ${t[srun_work_full]}; do printf '%s ' "$(secs "$x")"; done)]"
  echo "  lazy (cold cache):      $(secs "$wl") s   [all: $(for x in ${t[srun_work_lazy]}; do printf '%s ' "$(secs "$x")"; done)]"
  awk -v a="$wf" -v b="$wl" 'BEGIN { printf "ratio job lazy / job full: %.3f (goal <= 0.5)\n", b / a }'
fi
