#!/usr/bin/env bash
# Builds the MPI test image once and prints its path: Debian bookworm (debootstrap
# --variant=minbase) with Open MPI and a small MPI program, /usr/local/bin/allreduce, that sums
# the ranks with MPI_Allreduce; packed as an Enroot-style squashfs. tests/root_slurm.rs runs it with
# `srun --mpi=pmix --container-image=<it>`.
#
# Usage: integration/slurm/mpi-image.sh [--cache DIR]
#
#   --cache DIR   where built images are kept (default /var/cache/berth-test); an image is rebuilt
#                 only when this script changes (its hash names the file)
#
# Needs root, debootstrap, mksquashfs and the host's mpicc (integration/setup.sh installs them),
# and the Debian mirror apt uses. The program is compiled on the host, which runs the same Debian
# release, so it links against the image's Open MPI.
set -euo pipefail

cache=/var/cache/berth-test
while [ $# -gt 0 ]; do
  case $1 in
    --cache) cache=$2; shift 2 ;;
    -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "mpi-image.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "mpi-image.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap)"
for tool in debootstrap mksquashfs mpicc; do
  command -v "$tool" >/dev/null || die "$tool not found: run integration/setup.sh"
done

key=$(sha256sum "$0" | cut -c1-16)
image="$cache/mpi-bookworm-$key.sqsh"
if [ -s "$image" ]; then
  echo "$image"
  exit 0
fi
mkdir -p "$cache"

# The mirror apt already uses (deb822 or one-line sources), so no other host must be reachable.
mirror=$(grep -rhoE '^(URIs:|deb) *http[^ ]*/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
  | grep -oE 'http[^ ]*' | head -n1 || true)
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d "$cache/mpi-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
root="$work/root"
echo "mpi-image.sh: debootstrap bookworm minbase + openmpi-bin from $mirror (a few minutes, once)" >&2
debootstrap --variant=minbase --include=openmpi-bin bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*

cat >"$work/allreduce.c" <<'C'
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
    int rank, size, one, sum = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    one = rank + 1;
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank %d of %d: sum %d\n", rank, size, sum);
    MPI_Finalize();
    return 0;
}
C
mpicc -O2 -o "$root/usr/local/bin/allreduce" "$work/allreduce.c"

mksquashfs "$root" "$work/image.sqsh" -comp zstd -quiet -noappend >/dev/null
mv "$work/image.sqsh" "$image"
# Older builds of the image are of no further use.
find "$cache" -maxdepth 1 -name 'mpi-bookworm-*.sqsh' ! -name "$(basename "$image")" -delete
echo "$image"
