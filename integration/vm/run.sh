#!/usr/bin/env bash
# Runs a shell script as root inside a throwaway VM with real cgroup v2 (the VM test tier).
#
# Usage: integration/vm/run.sh [--file HOSTPATH[:VMPATH]]... [--mem MB] [--smp N] [--timeout S]
#                              [--initramfs-root] SCRIPT_FILE
#
#   --file HOSTPATH[:VMPATH]  copy a file or a directory into the VM (default VMPATH: HOSTPATH made
#                             absolute). Directories are copied recursively, symlinks kept. A
#                             dynamically linked ELF file also gets the libraries `ldd` lists and
#                             the loader, at their host paths. The directory of each file is put
#                             on PATH, ahead of the standard directories.
#   --mem MB                  guest memory (default 1024)
#   --smp N                   guest CPUs (default 2)
#   --timeout S               wall-clock limit for the whole VM (default 300)
#   --initramfs-root          run on the initramfs (rootfs) itself, as a diskless node booted
#                             without a tmpfs root does: pivot_root(2) fails there with EINVAL
#
# SCRIPT_FILE runs with busybox /bin/sh as root, stdin /dev/null, cwd /, after /init has set up:
# /proc, /sys, /dev (devtmpfs, plus /dev/pts and /dev/shm), /tmp and /run (tmpfs), cgroup2 at
# /sys/fs/cgroup with "+cpu +cpuset +memory +pids +io" in the root's cgroup.subtree_control, the
# modules in the kernel cache loaded (overlay, squashfs, loop, erofs, fuse, veth), lo up, hostname
# berth-vm, /etc/{passwd,group,hosts,hostname,resolv.conf} (root and nobody; no DNS). No network
# device, no disk. The root is a bind mount of the initramfs moved onto /, not rootfs itself, so
# pivot_root(2) works in the VM (unless --initramfs-root).
#
# The script's stdout and stderr come out on this script's stdout, without CR characters, and this
# script exits with the script's exit status. When the VM does not report one (kernel panic,
# /init failure, timeout, QEMU error) it says why on stderr and exits 125.
#
# Environment: BERTH_VM_CACHE (kernel cache, default <repo>/.cache/vm; filled by prepare.sh when
# empty), BERTH_VM_BUSYBOX (static busybox to use, default: busybox on PATH),
# BERTH_VM_QEMU (default qemu-system-x86_64), BERTH_VM_DEBUG=1 (show the whole console and keep
# the work directory), BERTH_VM_APPEND (extra kernel command line), BERTH_VM_KERNEL_IMAGE (boot
# this kernel image instead of the cached one, e.g. an uncompressed vmlinux via PVH).
#
# Needs: qemu-system-x86 cpio busybox-static (Debian 12), and for prepare.sh apt + dpkg.
set -euo pipefail
shopt -s lastpipe

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${BERTH_VM_CACHE:-$repo/.cache/vm}
qemu=${BERTH_VM_QEMU:-qemu-system-x86_64}
debug=${BERTH_VM_DEBUG:-0}

die() { echo "vm: $*" >&2; exit 125; }
usage() {
  echo "usage: integration/vm/run.sh [--file HOSTPATH[:VMPATH]]... [--mem MB] [--smp N] [--timeout S] [--initramfs-root] SCRIPT_FILE" >&2
  exit 125
}

files=()
mem=1024
smp=2
timeout=300
initramfs_root=0
script=
while [ $# -gt 0 ]; do
  case $1 in
    --file) [ $# -ge 2 ] || usage; files+=("$2"); shift 2 ;;
    --file=*) files+=("${1#--file=}"); shift ;;
    --mem) [ $# -ge 2 ] || usage; mem=$2; shift 2 ;;
    --smp) [ $# -ge 2 ] || usage; smp=$2; shift 2 ;;
    --timeout) [ $# -ge 2 ] || usage; timeout=$2; shift 2 ;;
    --initramfs-root) initramfs_root=1; shift ;;
    -h|--help) sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    -*) echo "vm: unknown option: $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -eq 1 ] || usage
script=$1
[ -f "$script" ] || die "script not found: $script"
for n in "$mem" "$smp" "$timeout"; do
  case $n in ''|*[!0-9]*) die "not a number: $n" ;; esac
done
command -v "$qemu" >/dev/null || die "$qemu not found: apt-get install qemu-system-x86"
command -v cpio >/dev/null || die "cpio not found: apt-get install cpio"

if [ ! -f "$cache/current/vmlinuz" ]; then
  BERTH_VM_CACHE=$cache "$here/prepare.sh" || die "could not fetch the kernel (integration/vm/prepare.sh)"
fi
kdir=$(readlink -f "$cache/current")

busybox=${BERTH_VM_BUSYBOX:-$(command -v busybox || true)}
if [ -z "$busybox" ] || [ ! -x "$busybox" ]; then
  die "busybox not found: apt-get install busybox-static"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/berth-vm.XXXXXX")
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  # QEMU writes its pid file once started; stop it if we are leaving before it exited.
  if [ -s "$work/qemu.pid" ]; then kill "$(cat "$work/qemu.pid")" 2>/dev/null || true; fi
  if [ "$debug" = 1 ]; then echo "vm: work directory $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
root=$work/root
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,usr/local/bin,usr/local/sbin,etc,root,newroot} \
         "$root"/{proc,sys,dev,tmp,run,mnt,berth/modules}

# copy_libs ELF: copies the shared libraries and the loader ELF needs to their host paths.
copy_libs() {
  local out line lib
  out=$(LC_ALL=C ldd "$1" 2>/dev/null) || return 0   # static, or not a dynamic ELF
  while IFS= read -r line; do
    case $line in
      *"=> not found"*) die "$1: shared library not found: ${line%% =>*}" ;;
      *"=> /"*) lib=${line#*=> }; lib=${lib%% (*} ;;
      *) lib=${line#"${line%%[![:space:]]*}"}; lib=${lib%% (*}; case $lib in /*) ;; *) continue ;; esac ;;
    esac
    [ -e "$root$lib" ] && continue
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done <<< "$out"
}

is_elf() { [ "$(head -c4 "$1" 2>/dev/null)" = $'\x7fELF' ]; }

printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > "$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tberth-vm\n::1\tlocalhost\n' > "$root/etc/hosts"
echo berth-vm > "$root/etc/hostname"
: > "$root/etc/resolv.conf"

# busybox: the VM's userland. Its applet links are made inside the VM (`busybox --install -s`),
# which is faster than hundreds of `ln` here.
cp -L "$busybox" "$root/bin/busybox"
copy_libs "$busybox"

cp "$kdir"/modules/*.ko "$root/berth/modules/" 2>/dev/null || true
[ -f "$kdir/modules.load" ] && cp "$kdir/modules.load" "$root/berth/modules.load"

path_dirs=()
for spec in "${files[@]}"; do
  host=${spec%%:*}
  if [ "$host" = "$spec" ]; then vm=; else vm=${spec#*:}; fi
  [ -e "$host" ] || die "--file: not found: $host"
  [ -n "$vm" ] || vm=$(cd "$(dirname "$host")" && pwd)/$(basename "$host")
  case $vm in /*) ;; *) die "--file: VM path must be absolute: $vm" ;; esac
  vm=${vm%/}
  if [ -d "$host" ]; then
    mkdir -p "$root$vm"
    cp -a "$host/." "$root$vm/"
  else
    mkdir -p "$root$(dirname "$vm")"
    cp -L -p "$host" "$root$vm"
    is_elf "$host" && copy_libs "$host"
    path_dirs+=("$(dirname "$vm")")
  fi
done
cp "$script" "$root/berth/script"

# The directories of --file files come first, so a file given to the VM wins over a busybox applet.
path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
extra=
for d in "${path_dirs[@]}"; do
  case ":$extra:$path:" in *":$d:"*) ;; *) extra=${extra:+$extra:}$d ;; esac
done
path=${extra:+$extra:}$path

nonce=$(od -An -N8 -tx8 /dev/urandom | tr -d ' \n')
start_marker="BERTH_VM_START_$nonce"
exit_marker="BERTH_VM_EXIT_$nonce="

cat > "$root/init" <<EOF
#!/bin/busybox sh
# Generated by integration/vm/run.sh.
export PATH=$path HOME=/root TERM=dumb
fail() { echo "vm /init: \$*"; poweroff -f; }
if [ "\$1" != stage2 ]; then
  # Stage 1, on rootfs. pivot_root(2) refuses rootfs as the current root, so make the root a
  # bind mount of it moved onto /: the same files, no copy, and pivot_root works in the VM.
  /bin/busybox --install -s || fail "busybox --install failed"
  [ $initramfs_root = 1 ] && exec /init stage2
  mount --bind / /newroot || fail "bind mount of / failed"
  cd /newroot
  mount --move . / || fail "mount --move failed"
  exec chroot . /init stage2
fi
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=755 tmpfs /run
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup || fail "mount cgroup2 failed"
echo "+cpu +cpuset +memory +pids +io" > /sys/fs/cgroup/cgroup.subtree_control ||
  fail "enabling cgroup controllers failed"
if [ -f /berth/modules.load ]; then
  while read -r m; do
    insmod /berth/modules/\$m.ko || fail "insmod \$m failed"
  done < /berth/modules.load
fi
hostname berth-vm
ip link set lo up 2>/dev/null
stty -F /dev/console -onlcr 2>/dev/null
cd /
echo "$start_marker"
/bin/sh /berth/script < /dev/null
rc=\$?
echo "$exit_marker\$rc"
poweroff -f
EOF
chmod 755 "$root/init"

cpio_owner=()
[ "$(id -u)" = 0 ] || cpio_owner=(-R 0:0)
(cd "$root" && find . -mindepth 1 | cpio -o -H newc "${cpio_owner[@]}" --quiet) > "$work/initrd" ||
  die "building the initramfs failed"

cmdline="console=ttyS0 quiet loglevel=1 panic=-1 rdinit=/init random.trust_cpu=on 8250.nr_uarts=1"
if [ "$debug" = 1 ]; then cmdline="console=ttyS0 loglevel=7 panic=-1 rdinit=/init random.trust_cpu=on"; fi
cmdline="$cmdline ${BERTH_VM_APPEND:-}"

qemu_args=(
  -accel tcg -cpu max -m "$mem" -smp "$smp"
  -nodefaults -no-user-config -display none -no-reboot
  -serial stdio -monitor none -net none -pidfile "$work/qemu.pid"
  -kernel "${BERTH_VM_KERNEL_IMAGE:-$kdir/vmlinuz}" -initrd "$work/initrd" -append "$cmdline"
)

status=
started=0
set +e
timeout --foreground -k 5 "$timeout" "$qemu" "${qemu_args[@]}" < /dev/null 2> "$work/qemu.err" |
while true; do
  nl=1
  IFS= read -r line || { nl=0; [ -n "$line" ] || break; }
  line=${line//$'\r'/}
  if [ "$started" = 0 ]; then
    if [ "$line" = "$start_marker" ]; then
      started=1
    else
      printf '%s\n' "$line" >> "$work/boot.log"
      [ "$debug" = 1 ] && printf '%s\n' "$line" >&2
    fi
    continue
  fi
  case $line in
    *"$exit_marker"*)
      status=${line##*"$exit_marker"}
      printf '%s' "${line%"$exit_marker"*}"
      break ;;
  esac
  if [ "$nl" = 1 ]; then printf '%s\n' "$line"; else printf '%s' "$line"; fi
done
qemu_rc=${PIPESTATUS[0]}
set -e
rm -f "$work/qemu.pid"   # QEMU has exited; never signal a recycled pid

case $status in
  ''|*[!0-9]*) ;;
  *) exit "$status" ;;
esac

if [ "$qemu_rc" = 124 ] || [ "$qemu_rc" = 137 ]; then
  why="timed out after ${timeout}s"
elif [ "$qemu_rc" != 0 ]; then
  why="$qemu exited with status $qemu_rc: $(tail -n 5 "$work/qemu.err" 2>/dev/null)"
elif [ "$started" = 0 ]; then
  why="the VM stopped before the script started (kernel panic or /init failure)"
else
  why="the VM stopped without reporting the script's exit status (kernel panic?)"
fi
echo "vm: $why" >&2
if [ -s "$work/boot.log" ]; then
  echo "vm: console before the script started (last 20 lines):" >&2
  tail -n 20 "$work/boot.log" | sed 's/^/vm:   /' >&2
fi
exit 125
