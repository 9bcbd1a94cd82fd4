#!/usr/bin/env bash
# Builds berth's packages: a .deb (dpkg-deb) and an .rpm (rpmbuild), from one staged tree each.
#
# Usage: packaging/build.sh [--out DIR] [--profile NAME] [--no-deb] [--no-rpm]
#
#   --out DIR        where the packages go [default: <target>/packages]
#   --profile NAME   cargo profile of the binaries [default: release]
#   --no-deb         skip the .deb;  --no-rpm  skip the .rpm (also skipped when rpmbuild is missing)
#
# <target> is $CARGO_TARGET_DIR, else the repository's target/. Prints each package's path.
# The SPANK plugin is built against the Slurm headers of this machine (SLURM_INCLUDE_DIR,
# default /usr/include): the packages declare that Slurm major.minor and refuse any other.
# Needs: cargo, dpkg-deb, gzip; rpmbuild for the .rpm (Debian: apt-get install rpm).
#
# Contents (Debian path / RHEL-family path where they differ):
#   /usr/bin/berth, /usr/bin/berth-controller
#   /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_berth.so  /  /usr/lib64/slurm/spank_berth.so
#   /usr/lib/x86_64-linux-gnu/security/pam_berth.so  /  /usr/lib64/security/pam_berth.so
#                                              sshd's node access (docs/admin-guide.md, "Node access (ssh)")
#   /usr/libexec/berth/{prolog,epilog}.sh      Slurm Prolog/Epilog wrappers (slurm.conf names them)
#   /etc/berth/berth.toml                      conffile: every key, at its default
#   /etc/slurm/plugstack.conf.d/berth.conf     conffile: the plugin line (plugstack.conf untouched)
#   /usr/lib/systemd/system/berth-{agent,controller,gc,cgroup}.service, berth-gc.timer
#                                              (berth-controller: enable it on the 1 or 3 controller hosts)
#   /usr/lib/tmpfiles.d/berth.conf             /run/berth, root's, 0711
#   bash, zsh and fish completions; man pages (berth(1), berth-VERB(1))
#   /usr/share/doc/berth/                      LICENSE, README.md, docs/*.md, Slurm config snippets
set -euo pipefail

die() { echo "packaging/build.sh: $*" >&2; exit 1; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
out=
profile=release
deb=1
rpm=1
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --profile) profile=${2:?--profile needs a name}; shift 2 ;;
    --no-deb) deb=0; shift ;;
    --no-rpm) rpm=0; shift ;;
    -h | --help) sed -n '4,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
out=${out:-$target/packages}
case $profile in
  release) dir=release ;;
  dev) dir=debug ;;
  *) dir=$profile ;;
esac
for cmd in cargo gzip; do command -v "$cmd" >/dev/null || die "$cmd not found"; done
[ "$deb" -eq 0 ] || command -v dpkg-deb >/dev/null || die "dpkg-deb not found: apt-get install dpkg"
if [ "$rpm" -eq 1 ] && ! command -v rpmbuild >/dev/null; then
  echo "packaging/build.sh: rpmbuild not found (apt-get install rpm): no .rpm" >&2
  rpm=0
fi

cd "$repo"
version=$(sed -n '/^\[package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
[ -n "$version" ] || die "no [package] version in Cargo.toml"

# The Slurm release the plugin is built for: SLURM_VERSION_NUMBER is 0xMMmmpp.
header=${SLURM_INCLUDE_DIR:-/usr/include}/slurm/slurm_version.h
number=$(awk '$1 == "#define" && $2 == "SLURM_VERSION_NUMBER" { gsub(/[()]/, "", $3); print $3 }' "$header" 2>/dev/null) ||
  true
[ -n "$number" ] || die "no SLURM_VERSION_NUMBER in $header: install libslurm-dev or set SLURM_INCLUDE_DIR"
slurm=$(printf '%d.%02d' $((number >> 16)) $(((number >> 8) & 0xff)))
slurm_next=$(printf '%d.%02d' $((number >> 16)) $((((number >> 8) & 0xff) + 1)))

echo "packaging/build.sh: building berth $version (profile $profile) for Slurm $slurm" >&2
cargo build --profile "$profile" -p berth --bin berth --example gen-docs
cargo build --profile "$profile" -p berth-spank
cargo build --profile "$profile" -p berth-pam
cargo build --profile "$profile" -p berth-controller --bin berth-controller
bin=$target/$dir/berth
plugin=$target/$dir/libspank_berth.so
pam=$target/$dir/libpam_berth.so
gen=$target/$dir/examples/gen-docs
controller=$target/$dir/berth-controller
for f in "$bin" "$plugin" "$pam" "$gen" "$controller"; do [ -f "$f" ] || die "$f not built"; done

work=$(mktemp -d "${TMPDIR:-/tmp}/berth-packaging.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$gen" "$work/docs"

# glibc the binary and plugin need: the highest GLIBC_x.y version they reference.
glibc=$( (strings -a "$bin" "$plugin" "$pam" "$controller" 2>/dev/null || true) | sed -n 's/^GLIBC_\([0-9][0-9.]*\)$/\1/p' |
  sort -V | tail -n 1)
glibc=${glibc:-2.34}

# stage ROOT PLUGIN_DIR ZSH_DIR PAM_DIR: the installed tree.
stage() {
  local root=$1 plugdir=$2 zshdir=$3 pamdir=$4 v
  install -D -m 0755 "$bin" "$root/usr/bin/berth"
  install -D -m 0755 "$controller" "$root/usr/bin/berth-controller"
  install -D -m 0644 "$plugin" "$root$plugdir/spank_berth.so"
  install -D -m 0644 "$pam" "$root$pamdir/pam_berth.so"
  for v in prolog epilog; do
    install -d -m 0755 "$root/usr/libexec/berth"
    sed -e 's|^BERTH=.*|BERTH=/usr/bin/berth|' \
      -e "s|^# Install as in configs/slurm/README.md: slurm.conf \(.*\)=.*|# Installed by the berth package: slurm.conf \1=/usr/libexec/berth/$v.sh|" \
      "configs/slurm/$v.sh" >"$root/usr/libexec/berth/$v.sh"
    chmod 0755 "$root/usr/libexec/berth/$v.sh"
  done
  install -D -m 0644 configs/berth.toml "$root/etc/berth/berth.toml"
  install -d -m 0755 "$root/etc/slurm/plugstack.conf.d"
  {
    echo "# berth's SPANK plugin (from the berth package). slurmd and srun read it through"
    echo "#   include /etc/slurm/plugstack.conf.d/*.conf"
    echo "# in plugstack.conf (Debian's default plugstack.conf has it; add it elsewhere). It replaces"
    echo "# Pyxis: remove Pyxis's line, since both define the same --container-* options. The"
    echo "# arguments are documented in /usr/share/doc/berth/slurm/plugstack.conf. Restart slurmd after"
    echo "# a change."
    echo "required $plugdir/spank_berth.so berth=/usr/bin/berth"
  } >"$root/etc/slurm/plugstack.conf.d/berth.conf"
  chmod 0644 "$root/etc/slurm/plugstack.conf.d/berth.conf"
  for u in berth-agent.service berth-controller.service berth-gc.service berth-gc.timer berth-cgroup.service; do
    install -D -m 0644 "packaging/systemd/$u" "$root/usr/lib/systemd/system/$u"
  done
  install -D -m 0644 packaging/tmpfiles.conf "$root/usr/lib/tmpfiles.d/berth.conf"
  install -D -m 0644 "$work/docs/completions/berth.bash" "$root/usr/share/bash-completion/completions/berth"
  install -D -m 0644 "$work/docs/completions/_berth" "$root$zshdir/_berth"
  install -D -m 0644 "$work/docs/completions/berth.fish" "$root/usr/share/fish/vendor_completions.d/berth.fish"
  install -d -m 0755 "$root/usr/share/man/man1"
  for m in "$work"/docs/man/*.1; do
    gzip -9n <"$m" >"$root/usr/share/man/man1/$(basename "$m").gz"
  done
  install -D -m 0644 LICENSE "$root/usr/share/doc/berth/LICENSE"
  install -D -m 0644 README.md "$root/usr/share/doc/berth/README.md"
  for f in docs/*.md; do install -D -m 0644 "$f" "$root/usr/share/doc/berth/$f"; done
  for f in plugstack.conf slurm.conf cgroup.conf README.md; do
    install -D -m 0644 "configs/slurm/$f" "$root/usr/share/doc/berth/slurm/$f"
  done
}

mkdir -p "$out"
description="Container runtime and job executor for Slurm GPU clusters"

if [ "$deb" -eq 1 ]; then
  root=$work/deb
  stage "$root" /usr/lib/x86_64-linux-gnu/slurm-wlm /usr/share/zsh/vendor-completions \
    /usr/lib/x86_64-linux-gnu/security
  cat >"$root/usr/share/doc/berth/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: berth

Files: *
License: Apache-2.0
 On Debian systems, the full text of the Apache License version 2.0 can be found in
 /usr/share/common-licenses/Apache-2.0 (and in /usr/share/doc/berth/LICENSE).
EOF
  install -d -m 0755 "$root/DEBIAN"
  size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
  cat >"$root/DEBIAN/control" <<EOF
Package: berth
Version: $version
Architecture: amd64
Maintainer: berth developers <berth@localhost>
Installed-Size: $size
Depends: libc6 (>= $glibc)
Recommends: squashfs-tools
Suggests: podman
Breaks: slurmd (<< $slurm), slurmd (>= $slurm_next), slurm-client (<< $slurm), slurm-client (>= $slurm_next)
Section: admin
Priority: optional
Homepage: https://github.com/berth/berth
Description: $description
 berth runs Slurm job steps inside containers (srun --container-image=...), as
 Pyxis and Enroot do: a SPANK plugin, a node-side executor isolating each step
 with cgroup v2 and namespaces, an image store for registry images, Enroot
 squashfs, Apptainer SIF and Docker/Podman archives, and data staging from the
 Prolog/Epilog. The plugin is built for Slurm $slurm.
EOF
  printf '%s\n' /etc/berth/berth.toml /etc/slurm/plugstack.conf.d/berth.conf >"$root/DEBIAN/conffiles"
  install -m 0755 packaging/deb/postinst packaging/deb/postrm "$root/DEBIAN/"
  debfile=$out/berth_${version}_amd64.deb
  dpkg-deb --root-owner-group -Zxz --build "$root" "$debfile" >/dev/null
  echo "$debfile"
fi

if [ "$rpm" -eq 1 ]; then
  root=$work/rpmroot
  stage "$root" /usr/lib64/slurm /usr/share/zsh/site-functions /usr/lib64/security
  top=$work/rpmbuild
  mkdir -p "$top"/{SPECS,RPMS,BUILD,BUILDROOT}
  {
    cat <<EOF
Name: berth
Version: $version
Release: 1
Summary: $description
License: Apache-2.0
BuildArch: x86_64
AutoReqProv: no
Requires: glibc >= $glibc
Recommends: squashfs-tools
Conflicts: slurm < $slurm, slurm >= $slurm_next
%global debug_package %{nil}
%global __os_install_post %{nil}
%global _build_id_links none

%description
berth runs Slurm job steps inside containers (srun --container-image=...), as Pyxis and Enroot
do. The plugin is built for Slurm $slurm.

%install
cp -a "$root/." "%{buildroot}/"

%post
if [ -d /run/systemd/system ]; then
  systemd-tmpfiles --create /usr/lib/tmpfiles.d/berth.conf || true
  systemctl daemon-reload || true
fi

%postun
if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi

%files
%defattr(-,root,root,-)
%dir /etc/berth
%config(noreplace) /etc/berth/berth.toml
%config(noreplace) /etc/slurm/plugstack.conf.d/berth.conf
%license /usr/share/doc/berth/LICENSE
EOF
    (cd "$root" && find . -type f ! -path ./etc/\* ! -name LICENSE | sed 's|^\.||' | sort)
    echo "%dir /usr/libexec/berth"
    echo "%dir /usr/share/doc/berth"
  } >"$top/SPECS/berth.spec"
  rpmbuild --quiet -bb --define "_topdir $top" --define "_rpmdir $top/RPMS" \
    --define "_binary_payload w6.xzdio" "$top/SPECS/berth.spec" >/dev/null
  rpmfile=$(find "$top/RPMS" -name '*.rpm' | head -n 1)
  [ -n "$rpmfile" ] || die "rpmbuild made no package"
  cp "$rpmfile" "$out/"
  echo "$out/$(basename "$rpmfile")"
fi
