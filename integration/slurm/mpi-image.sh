#!/usr/bin/env bash
# Builds the MPI test image once and prints its path: Debian bookworm (debootstrap
# --variant=minbase) with Open MPI and small MPI programs: /usr/local/bin/allreduce sums the
# ranks with MPI_Allreduce, /usr/local/bin/mpiwhich also prints MPI_Get_library_version and the
# file libmpi.so was mapped from, /usr/local/bin/pingpong measures latency and bandwidth between
# two ranks (a copy stays beside the image for bench/mpi/run.sh's bare-metal runs); packed as an
# Enroot-style squashfs. tests/root_slurm.rs and tests/root_hostsw.rs run it with
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
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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

# Which MPI a rank runs on: the library's own version line and the file libmpi.so was mapped
# from (tests/root_hostsw.rs: the host's, bound in by --container-mpi=host, or the image's).
cat >"$work/mpiwhich.c" <<'C'
#include <mpi.h>
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING], line[4096], mapped[4096] = "none";
    int len, rank, size, one, sum = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    one = rank + 1;
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Get_library_version(version, &len);
    version[strcspn(version, "\n")] = 0;
    FILE *maps = fopen("/proc/self/maps", "r");
    while (maps && fgets(line, sizeof line, maps)) {
        char *path = strchr(line, '/');
        if (path && strstr(path, "/libmpi.so")) {
            path[strcspn(path, "\n")] = 0;
            snprintf(mapped, sizeof mapped, "%s", path);
            break;
        }
    }
    printf("rank %d of %d: sum %d libmpi %s version %s\n", rank, size, sum, mapped, version);
    MPI_Finalize();
    return 0;
}
C
mpicc -O2 -o "$root/usr/local/bin/mpiwhich" "$work/mpiwhich.c"

# bench/mpi/run.sh's ping-pong between two ranks: latency of 8-byte messages, bandwidth of
# 1 MiB ones (half a round trip each).
cat >"$work/pingpong.c" <<'C'
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    int rank, size, sizes[2] = {8, 1 << 20}, counts[2] = {20000, 500};
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != 2) {
        if (rank == 0) fprintf(stderr, "pingpong: needs exactly 2 ranks, got %d\n", size);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    char *buf = calloc(1, 1 << 20);
    for (int s = 0; s < 2; s++) {
        int n = sizes[s], iters = counts[s], peer = 1 - rank;
        for (int i = -iters / 10; i < iters; i++) {
            if (i == 0) MPI_Barrier(MPI_COMM_WORLD);
            static double t0;
            if (i == 0) t0 = MPI_Wtime();
            if (rank == 0) {
                MPI_Send(buf, n, MPI_CHAR, peer, 0, MPI_COMM_WORLD);
                MPI_Recv(buf, n, MPI_CHAR, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(buf, n, MPI_CHAR, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(buf, n, MPI_CHAR, peer, 0, MPI_COMM_WORLD);
            }
            if (i == iters - 1 && rank == 0) {
                double t = MPI_Wtime() - t0;
                if (s == 0) printf("latency_us %.2f\n", t / iters / 2 * 1e6);
                else printf("bandwidth_MBps %.0f\n", 2.0 * n * iters / t / 1e6);
            }
        }
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
C
mpicc -O2 -o "$root/usr/local/bin/pingpong" "$work/pingpong.c"
# Bare-metal runs of bench/mpi/run.sh use the same binary from the host.
cp "$root/usr/local/bin/pingpong" "$cache/pingpong-$key"

mksquashfs "$root" "$work/image.sqsh" -comp zstd -quiet -noappend >/dev/null
mv "$work/image.sqsh" "$image"
# Older builds of the image are of no further use.
find "$cache" -maxdepth 1 -name 'mpi-bookworm-*.sqsh' ! -name "$(basename "$image")" -delete
find "$cache" -maxdepth 1 -name 'pingpong-*' ! -name "pingpong-$key" -delete
echo "$image"
