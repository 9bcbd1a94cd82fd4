#!/usr/bin/env bash
# Registry import: `berth import` against the pipeline Enroot's users effectively run
# (skopeo copy → umoci unpack → mksquashfs) and against `skopeo copy` alone, on a ~1.2 GiB,
# 4-layer gzip image in a local docker-registry. See bench/import/README.md.
#
# Usage: sudo bench/import/run.sh [--arms skopeo,pipeline,berth,before] [--rounds N] [--work DIR]
#                                  [--keep] [--out-fs auto|here|journal]
#
#   --arms LIST   arms to run (default: skopeo,pipeline,berth; berth also runs a warm re-import;
#                 before: the same cold import with BERTH_BEFORE, for an A/B in one run)
#   --rounds N    run every arm N times, interleaved, the first arm rotating (default 1); the
#                 report gives medians, min-max and CPU time (user + system)
#   --work DIR    where the image, registry storage and outputs go (default
#                 /var/tmp/berth-bench-import); the generated image and the registry storage
#                 are reused by later runs, outputs are removed at exit unless --keep
#   --out-fs F    where the arms write: here (the work dir's file system), journal (a journaled
#                 ext4 on a loop device with direct I/O, made in the work dir), auto (default:
#                 journal when the work dir is on an ext4 without a journal, else here)
#   BERTH=PATH    berth binary (default: cargo build --release, honouring CARGO_TARGET_DIR)
#   BERTH_BEFORE=PATH   the berth binary of the before arm
#   ENROOT_SQUASH_OPTIONS   mksquashfs options of the pipeline arm (default Enroot's:
#                 -comp lzo -noI -noD -noF -noX -no-duplicates)
#
# Goals: berth cold ≥ 3× faster than the pipeline, warm re-import < 50 ms (issue 3); berth cold
# ≤ 1.05× skopeo copy, the download alone (issue 19).
set -euo pipefail

arms=skopeo,pipeline,berth
work=/var/tmp/berth-bench-import
keep=0
rounds=1
out_fs=auto
while [ $# -gt 0 ]; do
  case $1 in
    --arms) [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }; arms=$2; shift 2 ;;
    --rounds) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: $1 needs a count" >&2; exit 2; }; rounds=$2; shift 2 ;;
    --work) [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }; work=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --out-fs)
      case ${2:-} in auto | here | journal) out_fs=$2 ;; *) echo "run.sh: $1 takes auto, here or journal" >&2; exit 2 ;; esac
      shift 2 ;;
    -h | --help) sed -n '6,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
squash_opts=${ENROOT_SQUASH_OPTIONS:--comp lzo -noI -noD -noF -noX -no-duplicates}

die() { echo "bench/import: error: $*" >&2; exit 1; }
say() { echo "bench/import: $*" >&2; }
want() { [[ ,$arms, == *",$1,"* ]]; }
# Every arm starts from the same state: the previous arm's dirty pages written back and the page
# cache dropped, so each one reads the registry's blobs from disk (a cold import) and none pays
# for another's writeback.
settle() { sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true; }
for a in ${arms//,/ }; do
  case $a in skopeo | pipeline | berth | before) ;; *) die "unknown arm '$a' (expected skopeo, pipeline, berth, before)" ;; esac
done
[ "$(id -u)" -eq 0 ] || die "must run as root (umoci unpack keeps ownership; berth's store): sudo $0"
for t in docker-registry skopeo python3 gzip tar sha256sum; do
  command -v "$t" >/dev/null || die "$t not found: run integration/setup.sh"
done
if want pipeline; then
  for t in umoci mksquashfs; do command -v "$t" >/dev/null || die "$t not found: run integration/setup.sh"; done
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
registry_sh=$repo/integration/registry/registry.sh
mkdir -p "$work"
work=$(cd "$work" && pwd)
out=$work/out
loopdev=
cleanup() {
  bash "$registry_sh" stop "$work/registry" || true
  if [ -n "$loopdev" ]; then
    umount "$out" || true
    losetup -d "$loopdev" || true
    rm -f "$work/out.img"
  fi
  [ "$keep" -eq 1 ] || rm -rf "$out"
}
trap cleanup EXIT
if mountpoint -q "$out"; then umount "$out"; fi
rm -rf "$out"
mkdir -p "$out"

# --- where the arms write -------------------------------------------------------------------
# ext4 without a journal (this development VM's disk) skips, for every inode it allocates, the
# inodes deleted in the last 60 seconds (find_inode_bit -> recently_deleted, which reads their
# inode table blocks): an arm creating 20,000 files right after the previous round deleted its
# 20,000 spent a fifth of its CPU there (perf record), a cost that a node's store, on a journaled
# ext4 or XFS, never pays and that skopeo's few blobs do not show. On such a disk the arms write to
# a journaled ext4 on a loop device with direct I/O (no second page cache), the same for all arms.
if [ "$out_fs" = auto ]; then
  out_fs=here
  dev=$(findmnt -no SOURCE -T "$out" | sed 's|^/dev/||')
  if [ "$(findmnt -no FSTYPE -T "$out")" = ext4 ] && ! ls /proc/fs/jbd2/"$dev"-* >/dev/null 2>&1; then
    out_fs=journal
  fi
fi
if [ "$out_fs" = journal ]; then
  for t in mkfs.ext4 losetup; do command -v "$t" >/dev/null || die "$t not found (e2fsprogs, mount)"; done
  truncate -s 8G "$work/out.img"
  mkfs.ext4 -q -F "$work/out.img" || die "mkfs.ext4 of $work/out.img failed"
  loopdev=$(losetup --direct-io=on -f --show "$work/out.img") || die "losetup of $work/out.img failed"
  mount "$loopdev" "$out" || die "mounting $loopdev on $out failed"
  say "outputs on a journaled ext4 ($loopdev, direct I/O): the work dir's ext4 has no journal"
fi

now() { date +%s%N; }
secs() { awk -v ns="$1" 'BEGIN { printf "%.3f", ns / 1e9 }'; }

# --- the image: layer trees → gzip layers → OCI layout (built once, reused) -------------------
layout=$work/layout
if [ ! -f "$layout/index.json" ]; then
  say "generating the image (one-time, a few minutes)"
  rm -rf "$work/trees" "$layout"
  bb=/bin/busybox
  [ -x "$bb" ] || die "/bin/busybox missing: apt-get install busybox-static"
  python3 "$here/make-image.py" "$work/trees" "$bb"
  mkdir -p "$layout/blobs/sha256"
  for l in l1 l2 l3 l4; do
    (
      tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work/trees/$l" \
        -cf "$layout/$l.tar" .
      sha256sum "$layout/$l.tar" | cut -d' ' -f1 >"$layout/$l.diffid"
      gzip -n -6 <"$layout/$l.tar" >"$layout/$l.gz"
      rm "$layout/$l.tar"
      d=$(sha256sum "$layout/$l.gz" | cut -d' ' -f1)
      mv "$layout/$l.gz" "$layout/blobs/sha256/$d"
      echo "$d" >"$layout/$l.digest"
    ) &
  done
  wait
  diff_ids=() layers=()
  for l in l1 l2 l3 l4; do
    diff_ids+=("\"sha256:$(cat "$layout/$l.diffid")\"")
    d=$(cat "$layout/$l.digest")
    size=$(stat -c %s "$layout/blobs/sha256/$d")
    layers+=("{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:$d\",\"size\":$size}")
  done
  config="{\"architecture\":\"amd64\",\"os\":\"linux\",\"config\":{\"Env\":[\"PATH=/bin\"],\"Cmd\":[\"/bin/sh\"]},\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[$(IFS=,; echo "${diff_ids[*]}")]}}"
  printf '%s' "$config" >"$layout/config.json"
  cd_=$(sha256sum "$layout/config.json" | cut -d' ' -f1)
  mv "$layout/config.json" "$layout/blobs/sha256/$cd_"
  manifest="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$cd_\",\"size\":${#config}},\"layers\":[$(IFS=,; echo "${layers[*]}")]}"
  printf '%s' "$manifest" >"$layout/manifest.json"
  md=$(sha256sum "$layout/manifest.json" | cut -d' ' -f1)
  mv "$layout/manifest.json" "$layout/blobs/sha256/$md"
  printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"1"}}]}' \
    "$md" "${#manifest}" >"$layout/index.json"
  rm -rf "$work/trees"
fi
uncompressed=0
compressed=0
for l in l1 l2 l3 l4; do
  d=$(cat "$layout/$l.digest")
  compressed=$((compressed + $(stat -c %s "$layout/blobs/sha256/$d")))
done

# --- the registry ---------------------------------------------------------------------------
host=$(bash "$registry_sh" start "$work/registry")
say "registry on $host; pushing bench/big:1 (skipped blobs it already holds)"
skopeo copy --quiet --dest-tls-verify=false "oci:$layout:1" "docker://$host/bench/big:1"
ref_docker="docker://$host/bench/big:1"
ref_enroot="$host#bench/big:1"

declare -A t
report=()

# --- arms -----------------------------------------------------------------------------------
# Each arm's wall time and CPU time (its own process tree: user + system), in ns and seconds.
timed() { # NAME CMD...: runs CMD; appends its wall ns to t[NAME] and its CPU s to c[NAME]
  local name=$1 s e
  shift
  s=$(now)
  /usr/bin/time -f '%U %S' -o "$out/$name.time" "$@" >/dev/null 2>"$out/$name.err" ||
    die "$name failed: $(tail -1 "$out/$name.err")"
  e=$(now)
  t[$name]="${t[$name]:-} $((e - s))"
  c[$name]="${c[$name]:-} $(tail -1 "$out/$name.time" | awk '{ print $1 + $2 }')"
}
declare -A c

if want berth || want before; then
  if [ -z "${BERTH:-}" ]; then
    say "building berth (cargo build --release)"
    (cd "$repo" && cargo build --release --quiet --bin berth)
    BERTH=${CARGO_TARGET_DIR:-$repo/target}/release/berth
  fi
  cfg=$out/berth.toml
  printf '[store]\nroot = "%s"\n[registry]\ninsecure = ["%s"]\n' "$out/berth-store" "$host" >"$cfg"
fi
if want before; then
  [ -x "${BERTH_BEFORE:-}" ] || die "the before arm needs BERTH_BEFORE=PATH (another berth binary)"
fi

arm_skopeo() {
  rm -rf "$out/skopeo"
  settle
  timed skopeo skopeo copy --quiet --src-tls-verify=false "$ref_docker" "oci:$out/skopeo:1"
  rm -rf "$out/skopeo"
}
arm_pipeline() {
  rm -rf "$out/pipeline"
  mkdir -p "$out/pipeline"
  settle
  local s s1 s2 e
  s=$(now)
  skopeo copy --quiet --src-tls-verify=false "$ref_docker" "oci:$out/pipeline/oci:1"
  s1=$(now)
  umoci unpack --image "$out/pipeline/oci:1" "$out/pipeline/bundle" >/dev/null
  s2=$(now)
  # shellcheck disable=SC2086 # the options are a word list, as Enroot passes them
  mksquashfs "$out/pipeline/bundle/rootfs" "$out/pipeline/image.sqsh" $squash_opts -quiet -no-progress >/dev/null
  e=$(now)
  t[pipeline]="${t[pipeline]:-} $((e - s))"
  uncompressed=$(du -sb "$out/pipeline/bundle/rootfs" | cut -f1)
  report+=("pipeline stages: skopeo $(secs $((s1 - s))) s, umoci unpack $(secs $((s2 - s1))) s, mksquashfs $(secs $((e - s2))) s")
  rm -rf "$out/pipeline"
}
arm_berth() { # NAME BINARY: a cold import into an empty store (then, for berth, a warm one)
  rm -rf "$out/berth-store"
  settle
  timed "$1" "$2" --config "$cfg" import "$ref_enroot"
  if [ "$1" = berth ]; then
    local s
    s=$(now)
    "$2" --config "$cfg" import "$ref_enroot" >/dev/null 2>>"$out/berth.err" ||
      die "warm berth import failed: $(tail -1 "$out/berth.err")"
    t[berth_warm]="${t[berth_warm]:-} $(($(now) - s))"
  fi
  rm -rf "$out/berth-store"
}

order=()
for a in skopeo pipeline berth before; do want "$a" && order+=("$a"); done
for ((round = 0; round < rounds; round++)); do
  # The first arm rotates from round to round, so no arm always follows the same one.
  for ((k = 0; k < ${#order[@]}; k++)); do
    a=${order[$(((k + round) % ${#order[@]}))]}
    case $a in
      skopeo) arm_skopeo ;;
      pipeline) arm_pipeline ;;
      berth) arm_berth berth "$BERTH" ;;
      before) arm_berth before "$BERTH_BEFORE" ;;
    esac
  done
  [ "$rounds" -eq 1 ] || say "round $((round + 1))/$rounds done"
done

# --- report ---------------------------------------------------------------------------------
# median, min and max of a list of numbers
stats() { printf '%s\n' $1 | sort -g | awk '{ a[NR] = $1 } END { m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%s %s %s", m, a[1], a[NR] }'; }
med() { stats "$1" | cut -d' ' -f1; }
echo
echo "image: 4 gzip layers, $((compressed / 1048576)) MiB compressed$([ "$uncompressed" -gt 0 ] && echo ", $((uncompressed / 1048576)) MiB unpacked"); $(nproc) CPUs; $rounds round(s), medians (min-max); outputs on $([ -n "$loopdev" ] && echo "a journaled ext4 (loop, direct I/O)" || findmnt -no FSTYPE -T "$out")"
for k in skopeo pipeline berth berth_warm before; do
  [ -n "${t[$k]:-}" ] || continue
  case $k in
    skopeo) label="skopeo copy docker:// → oci: (download only)" ;;
    pipeline) label="skopeo → umoci unpack → mksquashfs ($squash_opts)" ;;
    berth) label="berth import, cold" ;;
    berth_warm) label="berth import, warm (same ref again)" ;;
    before) label="berth import, cold, BERTH_BEFORE" ;;
  esac
  read -r m lo hi <<<"$(stats "${t[$k]}")"
  cpu=
  [ -z "${c[$k]:-}" ] || cpu="  cpu $(med "${c[$k]}") s"
  printf '%-62s %9s s  (%s-%s)%s\n' "$label" "$(secs "$m")" "$(secs "$lo")" "$(secs "$hi")" "$cpu"
done
for line in "${report[@]}"; do echo "$line"; done
if [ -n "${t[berth]:-}" ] && [ -n "${t[pipeline]:-}" ]; then
  awk -v p="$(med "${t[pipeline]}")" -v b="$(med "${t[berth]}")" 'BEGIN { r = p / b; printf "berth cold vs pipeline: %.2fx faster (goal >= 3x: %s)\n", r, (r >= 3 ? "met" : "NOT met") }'
fi
if [ -n "${t[berth]:-}" ] && [ -n "${t[skopeo]:-}" ]; then
  awk -v s="$(med "${t[skopeo]}")" -v b="$(med "${t[berth]}")" 'BEGIN { r = b / s; printf "berth cold / skopeo copy: %.2fx (goal <= 1.05x: %s)\n", r, (r <= 1.05 ? "met" : "NOT met") }'
fi
if [ -n "${t[before]:-}" ] && [ -n "${t[skopeo]:-}" ]; then
  awk -v s="$(med "${t[skopeo]}")" -v b="$(med "${t[before]}")" 'BEGIN { printf "BERTH_BEFORE cold / skopeo copy: %.2fx\n", b / s }'
fi
if [ -n "${t[berth_warm]:-}" ]; then
  awk -v w="$(med "${t[berth_warm]}")" 'BEGIN { ms = w / 1e6; printf "berth warm re-import: %.1f ms (goal < 50 ms: %s)\n", ms, (ms < 50 ? "met" : "NOT met") }'
fi
