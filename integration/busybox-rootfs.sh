#!/usr/bin/env bash
# Builds a minimal container root filesystem from Debian's busybox-static into DEST.
# Usage: integration/busybox-rootfs.sh DEST
# The tree is built under a temporary name and renamed into place, so DEST is either absent or
# complete; an existing DEST is left as it is.
set -euo pipefail
dest=${1:?usage: busybox-rootfs.sh DEST}
[ -d "$dest" ] && exit 0
bb=$(command -v busybox || true)
if [ -z "$bb" ] || ! file -L "$bb" 2>/dev/null | grep -q 'statically linked'; then
  bb=/bin/busybox
fi
[ -x "$bb" ] || { echo "busybox-rootfs: busybox not found: apt-get install busybox-static" >&2; exit 1; }
tmp="$dest.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,root,home,var/tmp}
cp "$bb" "$tmp/bin/busybox"
for applet in $("$tmp/bin/busybox" --list); do
  [ "$applet" = busybox ] || ln -sf busybox "$tmp/bin/$applet"
done
chmod 1777 "$tmp/tmp" "$tmp/var/tmp"
cat > "$tmp/etc/passwd" <<'P'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
P
cat > "$tmp/etc/group" <<'G'
root:x:0:
tty:x:5:
nogroup:x:65534:
G
cat > "$tmp/etc/os-release" <<'O'
NAME="berth test busybox"
ID=berth-busybox
PRETTY_NAME="berth test image (busybox)"
O
mv -T "$tmp" "$dest"
