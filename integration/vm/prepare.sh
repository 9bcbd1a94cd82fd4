#!/usr/bin/env bash
# Fetches the Debian cloud kernel the VM test tier boots, once, into the cache.
#
# Usage: integration/vm/prepare.sh [--refresh]
#
#   --refresh   resolve the newest linux-image-cloud-amd64 again even when a kernel is cached
#
# Environment:
#   BERTH_VM_CACHE       cache directory (default: <repo>/.cache/vm)
#   BERTH_VM_KERNEL      kernel package to use, e.g. linux-image-6.1.0-57-cloud-amd64
#                        (default: what linux-image-cloud-amd64 depends on)
#   BERTH_VM_KERNEL_DEB  a local .deb of that package to unpack instead of downloading one
#
# Needs: apt-get/apt-cache with current package lists (run `apt-get update` once), dpkg, flock.
# Layout written: $cache/<package>/{vmlinuz,config,modules/*.ko,modules.load} and the symlink
# $cache/current -> <package>. run.sh boots $cache/current. The kernel directory is built under a
# temporary name and renamed into place, so a cached kernel is always complete.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${BERTH_VM_CACHE:-$repo/.cache/vm}

refresh=0
for arg in "$@"; do
  case $arg in
    --refresh) refresh=1 ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "prepare.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

# Modules the VM loads at boot (dependencies are added from each module's modinfo).
# overlay: container rootfs stacking; squashfs, loop, erofs: image mounts; fuse: squashfuse and
# fuse-overlayfs; veth: network namespaces with a link to the host side.
wanted_modules=(overlay squashfs loop erofs fuse veth)

mkdir -p "$cache"
# One preparer at a time (tests may start several VMs at once on a cold cache).
exec 9> "$cache/.lock"
flock 9

if [ -z "${BERTH_VM_KERNEL:-}" ] && [ "$refresh" = 0 ] && [ -f "$cache/current/vmlinuz" ]; then
  exit 0
fi

pkg=${BERTH_VM_KERNEL:-}
if [ -z "$pkg" ]; then
  if [ -n "${BERTH_VM_KERNEL_DEB:-}" ]; then
    pkg=$(dpkg-deb -f "$BERTH_VM_KERNEL_DEB" Package)
  else
    pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
          sed -n 's/^ *Depends: \(linux-image-[^ ]*-cloud-amd64\)$/\1/p' | head -n1)
    if [ -z "$pkg" ]; then
      echo "prepare.sh: cannot resolve linux-image-cloud-amd64 (run 'apt-get update' first)" >&2
      exit 1
    fi
  fi
fi

if [ -f "$cache/$pkg/vmlinuz" ]; then
  ln -sfn "$pkg" "$cache/current"
  exit 0
fi

work=$(mktemp -d "$cache/.prepare.XXXXXX")
trap 'rm -rf "$work"' EXIT

if [ -n "${BERTH_VM_KERNEL_DEB:-}" ]; then
  deb=$BERTH_VM_KERNEL_DEB
else
  echo "prepare.sh: downloading $pkg" >&2
  # apt-get download drops privileges to _apt when it can; let _apt write the directory.
  chmod 755 "$work"
  if [ "$(id -u)" = 0 ] && id _apt >/dev/null 2>&1; then chown _apt "$work"; fi
  (cd "$work" && apt-get download -q "$pkg" >/dev/null)
  deb=$(ls "$work"/"$pkg"_*.deb)
fi

dpkg-deb -x "$deb" "$work/x"
out="$work/$pkg"
mkdir -p "$out/modules"
cp "$work"/x/boot/vmlinuz-* "$out/vmlinuz"
cp "$work"/x/boot/config-* "$out/config"
moddir=$(echo "$work"/x/lib/modules/*)

# Resolve dependencies from each module's .modinfo section (no kmod needed), deepest first.
declare -A seen=()
order=()
add_module() {
  local name=$1 file dep deps
  [ -n "${seen[$name]:-}" ] && return 0
  seen[$name]=1
  file=$(find "$moddir/kernel" -name "$name.ko" -print -quit)
  if [ -z "$file" ]; then
    if grep -q "/$name.ko\$" "$moddir/modules.builtin"; then return 0; fi
    echo "prepare.sh: module $name is neither built in nor shipped in $pkg" >&2
    exit 1
  fi
  deps=$(tr '\0' '\n' < "$file" | sed -n 's/^depends=//p' | head -n1)
  for dep in ${deps//,/ }; do add_module "$dep"; done
  cp "$file" "$out/modules/$name.ko"
  order+=("$name")
}
for m in "${wanted_modules[@]}"; do add_module "$m"; done
printf '%s\n' "${order[@]}" > "$out/modules.load"

rm -rf "${cache:?}/$pkg"
mv "$out" "$cache/$pkg"
ln -sfn "$pkg" "$cache/current"
echo "prepare.sh: cached $pkg in $cache/$pkg" >&2
