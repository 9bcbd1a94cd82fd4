#!/usr/bin/env bash
# Installs everything berth's test tiers and benchmarks need on a fresh Debian 12 machine.
# Usage: integration/setup.sh            (as root; idempotent, safe to run before every test run)
#
# - Runs `apt-get update` only when this script has not done so in the last 6 hours (or when apt
#   has no package lists at all), then installs whatever in PACKAGES is missing.
# - Then installs cargo-afl from crates.io (the fuzz step) unless the pinned version is present.
# - Then cargo-machete and cargo-deny (test.sh's deps step), likewise pinned.
# - Then runs integration/vm/prepare.sh (the VM tier's kernel), if that file exists, unless
#   BERTH_SETUP_NO_VM is set (integration/demo.sh needs no VM).
# To add a package, add it to PACKAGES below with a comment saying what needs it.
set -euo pipefail

PACKAGES=(
  busybox-static  # integration/busybox-rootfs.sh: the test and benchmark rootfs; VM initramfs
  runc            # bench/start-latency: the runtime berth is compared with
  qemu-system-x86 # VM tier: boots a kernel with real cgroup v2 controllers (TCG)
  cpio            # VM tier: builds the initramfs
  util-linux      # unshare, mount, losetup: root tier, bench/start-latency
  iproute2        # ip: network namespace tests
  file            # integration/busybox-rootfs.sh: checks busybox is statically linked
  python3         # bench/start-latency: the timing driver; bench/import: image generator
  docker-registry # registry tests (tests/root_registry.rs), bench/import: the local registry
  apache2-utils   # htpasswd: bcrypt logins for the registry's Basic auth tests
  openssl         # registry tests: CA, leaf and token-signing certificates, JWT signatures
  skopeo          # bench/import: pushes the benchmark image; the skopeo and pipeline arms
  umoci           # bench/import: the pipeline arm (umoci unpack)
  squashfs-tools  # berth export (mksquashfs), .sqsh/SIF image tests; bench/import: the pipeline arm
  # skopeo also converts the root tier's test images (tests/root_store.rs) to oci-archive, docker-archive
  podman          # root tier (tests/root_store.rs): podman:// imports (podman image save)
  zstd            # root tier (tests/root_store.rs): zstd-compressed test layers
  slurmctld       # integration/slurm: the one-host Slurm cluster of tests/root_slurm.rs
  slurmd          #   (its compute daemon; slurmstepd loads the SPANK plugin)
  slurm-client    #   (srun, sbatch, sinfo, squeue, scancel)
  munge           #   (Slurm's authentication daemon)
  libslurm-dev    # spank/build.rs: slurm/spank.h, slurm_version.h (plugin_version)
  openssh-server  # tests/root_pam.rs: the sshd that loads pam_berth.so (pam/ needs no PAM
                  #   headers: it declares libpam's few calls itself)
  openssh-client  #   (ssh, ssh-keygen)
  libpam-slurm-adopt # bench/ssh-login: Slurm's pam_slurm_adopt, the arm pam_berth is compared with
  openmpi-bin     # Slurm MPI tests: mpirun, an MPI runtime
  libopenmpi-dev  #   (mpicc for the test program)
  libpmix-dev     #   (libpmix.so, which Slurm's mpi/pmix plugin loads; install before slurmd starts)
  lmod            # tests/root_hostsw.rs: the host's Lmod (and its Lua 5.3) that --container-modules binds
  rsync           # bench/stage: the rsync -a arm berth stage is compared with
  xfsprogs        # root tier (tests/root_stage.rs): an XFS with reflinks, where staging clones
  debootstrap     # integration/slurm/mpi-image.sh: the Debian minbase MPI test image
  rpm             # packaging/build.sh: rpmbuild makes the .rpm; tests/root_package.rs: rpm -qlp
  systemd         # tests/root_package.rs: systemd-analyze verify of the packaged units
)

# apt-get update is skipped while this stamp is younger than this many seconds.
APT_MAX_AGE_S=$((6 * 3600))
APT_STAMP=/var/lib/apt/periodic/berth-update-success-stamp

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export DEBIAN_FRONTEND=noninteractive

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (it installs Debian packages): sudo $0"
command -v apt-get >/dev/null || die "apt-get not found: this script supports Debian 12 only"

apt_lists_fresh() {
  # apt keeps the server's Last-Modified as the mtime of its list files, so their age says
  # nothing about when `apt-get update` last ran: keep a stamp of our own.
  [ -f "$APT_STAMP" ] || return 1
  compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null || return 1
  local age=$(($(date +%s) - $(stat -c %Y "$APT_STAMP")))
  [ "$age" -ge 0 ] && [ "$age" -lt "$APT_MAX_AGE_S" ]
}

apt_update() {
  say "apt-get update"
  apt-get update -qq || die "apt-get update failed (is the Debian mirror reachable?)"
  mkdir -p "$(dirname "$APT_STAMP")"
  touch "$APT_STAMP"
}

missing_packages() {
  local p
  for p in "${PACKAGES[@]}"; do
    if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
      echo "$p"
    fi
  done
}

updated=0
if apt_lists_fresh; then
  say "apt lists updated less than $((APT_MAX_AGE_S / 3600)) h ago; not updating"
else
  apt_update
  updated=1
fi

mapfile -t missing < <(missing_packages)
if [ "${#missing[@]}" -eq 0 ]; then
  say "all ${#PACKAGES[@]} packages present"
else
  say "installing: ${missing[*]}"
  if ! apt-get install -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends "${missing[@]}"; then
    # A stale list can name package versions the mirror no longer has: update once and retry.
    [ "$updated" -eq 0 ] || die "apt-get install failed: ${missing[*]}"
    apt_update
    apt-get install -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends "${missing[@]}" ||
      die "apt-get install failed: ${missing[*]}"
  fi
fi

# promtool (tests/root_controller.rs: `promtool check metrics` of the controller's and the
# agent's /metrics, `promtool check rules configs/berth-alerts.yml`). Debian ships it only in the
# `prometheus` package, whose postinst enables and starts a Prometheus server: take the one
# binary out of the downloaded package instead (no maintainer script runs, no service).
if ! command -v promtool >/dev/null; then
  say "promtool from the prometheus package (extracted, not installed)"
  promtool_tmp=$(mktemp -d)
  (cd "$promtool_tmp" && apt-get download -qq prometheus) ||
    die "apt-get download prometheus failed (for promtool)"
  dpkg-deb --fsys-tarfile "$promtool_tmp"/prometheus_*.deb |
    tar -x -C "$promtool_tmp" ./usr/bin/promtool ||
    die "extracting promtool from the prometheus package failed"
  install -m 0755 "$promtool_tmp/usr/bin/promtool" /usr/local/bin/promtool
  rm -rf "$promtool_tmp"
fi

# cargo-afl (test.sh's fuzz step, bench/fuzz/run.sh): AFL++ for Rust on the stable toolchain,
# from crates.io; installing it builds the AFL++ it ships (for the rustc it was built with, so a
# new rustc needs `cargo afl config --build --force`, done here). The version matches the `afl`
# crate of fuzz/Cargo.toml.
CARGO_AFL_VERSION=0.18.2
if ! command -v cargo >/dev/null; then
  for d in "${CARGO_HOME:-}/bin" "$HOME/.cargo/bin" /root/.cargo/bin; do
    if [ -x "$d/cargo" ]; then PATH="$d:$PATH"; break; fi
  done
fi
cargo_bin=$(command -v cargo) || die "cargo not found (install Rust with rustup first): cargo-afl needs it"
afl_version=$("$cargo_bin" afl --version 2>/dev/null || true)
case $afl_version in
  "cargo-afl $CARGO_AFL_VERSION (AFL++ version"*) say "cargo-afl $CARGO_AFL_VERSION present" ;;
  "cargo-afl $CARGO_AFL_VERSION"*)
    say "cargo afl config --build --force (AFL++ for this rustc)"
    "$cargo_bin" afl config --build --force >/dev/null || die "cargo afl config --build failed"
    ;;
  *)
    say "cargo install cargo-afl $CARGO_AFL_VERSION"
    "$cargo_bin" install --locked --force cargo-afl --version "$CARGO_AFL_VERSION" ||
      die "cargo install cargo-afl failed (is crates.io reachable?)"
    case $("$cargo_bin" afl --version 2>/dev/null || true) in
      *"AFL++ version"*) ;;
      *) "$cargo_bin" afl config --build --force >/dev/null || die "cargo afl config --build failed" ;;
    esac
    ;;
esac

# cargo-machete (unused dependencies) and cargo-deny (licences, bans, sources: deny.toml), test.sh's
# deps step. From crates.io, pinned so a new release cannot fail a run that changed nothing.
# Building cargo-deny on a fresh 2-CPU machine takes about 4 minutes (3m36s of CPU, measured),
# once per machine.
CARGO_MACHETE_VERSION=0.9.2
CARGO_DENY_VERSION=0.20.2
lint_tool() { # NAME VERSION: installs cargo-NAME VERSION unless `cargo NAME --version` shows it
  case $("$cargo_bin" "$1" --version 2>/dev/null || true) in
    "$2" | "cargo-$1 $2") say "cargo-$1 $2 present" ;;
    *)
      say "cargo install cargo-$1 $2"
      "$cargo_bin" install --locked --force "cargo-$1" --version "$2" ||
        die "cargo install cargo-$1 failed (is crates.io reachable?)"
      ;;
  esac
}
lint_tool machete "$CARGO_MACHETE_VERSION"
lint_tool deny "$CARGO_DENY_VERSION"

if [ -n "${BERTH_SETUP_NO_VM:-}" ]; then
  say "BERTH_SETUP_NO_VM set: no VM kernel fetched"
elif [ -f "$here/vm/prepare.sh" ]; then
  say "integration/vm/prepare.sh"
  bash "$here/vm/prepare.sh" || die "integration/vm/prepare.sh failed"
else
  say "integration/vm/prepare.sh not present; no VM kernel fetched"
fi
say "done"
