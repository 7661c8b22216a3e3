#!/usr/bin/env bash
# Builds the gpu-mps Debian package with dpkg-deb from release binaries that are already built:
#
#   scripts/build-release.sh && packaging/deb/build.sh
#   packaging/deb/build.sh --arch arm64      # from target/dist-arm64/ (the arm64 cross build)
#
# Output: target/debian/gpu-mps_<version>_<arch>.deb (version from [workspace.package] in Cargo.toml).
# The binaries of packaging/binaries.txt are taken from $GPU_MPS_BIN_DIR, else
# ${CARGO_TARGET_DIR:-target}/dist here, .../dist-<arch> for another architecture.
# Layout (Debian policy, FHS): /usr/bin, /usr/lib/systemd/system, /usr/lib/tmpfiles.d,
# /usr/share/doc/gpu-mps, /etc/gpu-mps/config.toml.
#
#   packaging/deb/build.sh --stub-binaries
#
# packages shell stubs instead of missing binaries, to test the packaging alone; the version gets a
# "~stub" suffix and the stubs fail when run. Never install such a package on a real node.
#
# Needs dpkg-deb; dpkg-shlibdeps (dpkg-dev) for the shared library dependencies of this machine's
# architecture, readelf (binutils) for another one's (GPU_MPS_DEB_DEPENDS_FROM=readelf uses that
# rule here too: tests/deb.sh checks that both agree); strip for the architecture (binutils, or
# binutils-aarch64-linux-gnu for arm64).
set -euo pipefail

die() { echo "build.sh: $*" >&2; exit 1; }

stubs=no
arch=""
while [ $# -gt 0 ]; do
    case "$1" in
    --stub-binaries) stubs=yes ;;
    --arch) [ $# -ge 2 ] || die "--arch needs a Debian architecture: amd64 or arm64"; arch=$2; shift ;;
    --arch=*) arch=${1#--arch=} ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
packaging=$(dirname "$here")
repo=$(dirname "$packaging")
command -v dpkg-deb >/dev/null || die "dpkg-deb not found: apt-get install dpkg"

native=$(dpkg --print-architecture)
arch=${arch:-$native}
case "$arch" in
amd64) elf_machine="X86-64" triplet=x86_64-linux-gnu ;;
arm64) elf_machine="AArch64" triplet=aarch64-linux-gnu ;;
*) die "--arch $arch: gpu-mps is packaged for amd64 and arm64" ;;
esac

# [workspace.package] version = "x.y.z"
version=$(awk '
    /^\[/ { section = $0; next }
    section == "[workspace.package]" && $1 == "version" { gsub(/[" ]/, "", $3); print $3; exit }
' "$repo/Cargo.toml")
[ -n "$version" ] || die "no version in [workspace.package] of $repo/Cargo.toml"
target_dir=${CARGO_TARGET_DIR:-$repo/target}
if [ "$arch" = "$native" ]; then
    bin_dir=${GPU_MPS_BIN_DIR:-$target_dir/dist}
else
    bin_dir=${GPU_MPS_BIN_DIR:-$target_dir/dist-$arch}
fi
# Every binary of packaging/binaries.txt, into /usr/bin. The device plugin too, with no unit: it is
# started by whoever runs kubelet (packaging/README.md).
mapfile -t binaries < <(awk '{ sub(/#.*/, "") } NF { print $1 }' "$packaging/binaries.txt")
[ ${#binaries[@]} -gt 0 ] || die "no binaries in $packaging/binaries.txt"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/root
install -d -m 0755 "$root/DEBIAN" "$root/usr/bin" "$root/etc/gpu-mps" "$root/usr/lib/systemd/system" \
    "$root/usr/lib/tmpfiles.d" "$root/usr/share/doc/gpu-mps" "$root/usr/share/lintian/overrides"

stubbed=()
for b in "${binaries[@]}"; do
    if [ -f "$bin_dir/$b" ] && [ -x "$bin_dir/$b" ]; then
        # A binary of the wrong architecture would install and then fail on every container start.
        if command -v readelf >/dev/null; then
            machine=$(readelf -h "$bin_dir/$b" 2>/dev/null | awk -F: '/Machine:/ { gsub(/^ +/, "", $2); print $2 }')
            case "$machine" in
            *"$elf_machine"* | "") ;;
            *) die "$bin_dir/$b is built for $machine, not $arch ($elf_machine)" ;;
            esac
        fi
        install -m 0755 "$bin_dir/$b" "$root/usr/bin/$b"
        # Debug symbols stay in the build (target/dist keeps them), as dh_strip would do.
        strip=$(command -v "$triplet-strip" || { [ "$arch" = "$native" ] && command -v strip; } || true)
        [ -n "$strip" ] || die "no $triplet-strip to strip $b for $arch: apt-get install binutils-$triplet"
        "$strip" --strip-unneeded --remove-section=.comment --remove-section=.note "$root/usr/bin/$b"
    elif [ "$stubs" = yes ]; then
        printf '#!/bin/sh\necho "%s: stub from packaging/deb/build.sh --stub-binaries, not a real build" >&2\nexit 1\n' \
            "$b" >"$root/usr/bin/$b"
        chmod 0755 "$root/usr/bin/$b"
        stubbed+=("$b")
    else
        die "$bin_dir/$b is missing: run scripts/build-release.sh first (or set GPU_MPS_BIN_DIR)"
    fi
done
if [ ${#stubbed[@]} -gt 0 ]; then
    version="$version~stub"
    echo "build.sh: WARNING: stub binaries for ${stubbed[*]}: version $version is for testing the packaging only" >&2
fi

# The node config as shipped, with the hook where this package puts it: the DaemonSet keeps the
# default (/usr/local/bin/gpu-mps-hook), so the package names its own (packaging/README.md).
sed 's|^# hook_path = "/usr/local/bin/gpu-mps-hook"$|hook_path = "/usr/bin/gpu-mps-hook"|' \
    "$packaging/config.toml" >"$root/etc/gpu-mps/config.toml"
grep -qx 'hook_path = "/usr/bin/gpu-mps-hook"' "$root/etc/gpu-mps/config.toml" ||
    die "$packaging/config.toml: no line '# hook_path = \"/usr/local/bin/gpu-mps-hook\"' to point at /usr/bin"
chmod 0644 "$root/etc/gpu-mps/config.toml"
install -m 0644 "$packaging/systemd/gpu-mps-manager.service" "$root/usr/lib/systemd/system/"
install -m 0644 "$packaging/systemd/gpu-mps.conf" "$root/usr/lib/tmpfiles.d/"
install -m 0644 "$packaging/README.md" "$root/usr/share/doc/gpu-mps/README.md"
install -m 0644 "$here/copyright" "$root/usr/share/doc/gpu-mps/copyright"
install -m 0644 "$here/lintian-overrides" "$root/usr/share/lintian/overrides/gpu-mps"

# A native package's changelog (Debian policy 12.7): one entry for this version, dated by the
# commit it is built from, so that two builds of one commit are the same.
date_epoch=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)}
maintainer=$(sed -n 's/^Maintainer: //p' "$here/control.in")
{
    echo "gpu-mps ($version) unstable; urgency=medium"
    echo
    echo "  * Release $version, built from $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo "a source tree")."
    echo "    The changes are in the project's git history."
    echo
    echo " -- $maintainer  $(LC_ALL=C date -u -R -d "@$date_epoch")"
} | gzip -9n >"$root/usr/share/doc/gpu-mps/changelog.gz"
chmod 0644 "$root/usr/share/doc/gpu-mps/changelog.gz"

for script in postinst prerm postrm; do
    install -m 0755 "$here/$script" "$root/DEBIAN/$script"
done
install -m 0644 "$here/conffiles" "$root/DEBIAN/conffiles"

# Shared library dependencies of the real binaries (libc6, libgcc-s1), as debhelper would add them.
# gpu-mps-shim and gpu-mps-hook are static-pie (scripts/build-release.sh): nothing to depend on.
elves=()
for b in "${binaries[@]}"; do
    if head -c 4 "$root/usr/bin/$b" | grep -q 'ELF' && readelf -d "$root/usr/bin/$b" | grep -q '(NEEDED)'; then
        elves+=("$root/usr/bin/$b")
    fi
done

# "libc6 (>= 2.34), libgcc-s1 (>= 4.2)" from the symbol versions the binaries need, for another
# architecture, whose libraries (and so their dpkg symbols files) are not installed here. These
# two are all that Rust binaries of this workspace link dynamically; another library is an error.
foreign_depends() {
    local needed glibc gcc
    needed=$(readelf -d "$@" | awk '/\(NEEDED\)/ { gsub(/[][]/, "", $5); print $5 }' | sort -u)
    for lib in $needed; do
        case "$lib" in
        libc.so.6 | libm.so.6 | libdl.so.2 | libpthread.so.0 | librt.so.1 | libgcc_s.so.1 | ld-linux-*) ;;
        *) die "a binary needs $lib: packaging/deb/build.sh knows only glibc and libgcc_s for --arch $arch" ;;
        esac
    done
    glibc=$(readelf -V "$@" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n1)
    # GCC_4.2.0 is libgcc-s1 4.2 in its symbols file, as dpkg-shlibdeps writes it.
    gcc=$(readelf -V "$@" | grep -o 'GCC_[0-9.]*' | sed 's/GCC_//' | sort -uV | tail -n1 | sed 's/^\([0-9]*\.[0-9]*\)\.0$/\1/')
    local deps=""
    [ -z "$glibc" ] || deps="libc6 (>= $glibc)"
    if echo "$needed" | grep -qx 'libgcc_s.so.1'; then deps="${deps:+$deps, }libgcc-s1 (>= ${gcc:-3.0})"; fi
    echo "$deps"
}

# dpkg-shlibdeps comes with dpkg-dev, which a fresh Debian 12 root lacks: installed as build-release.sh
# installs what it needs (as root, else through sudo).
install_dpkg_dev() {
    local as_root=()
    [ "$(id -u)" = 0 ] || as_root=(sudo)
    echo "deb: installing dpkg-dev (dpkg-shlibdeps)" >&2
    { "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dpkg-dev >/dev/null ||
        { "${as_root[@]}" apt-get update -qq && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dpkg-dev >/dev/null; }; } &&
        command -v dpkg-shlibdeps >/dev/null
}

shlibs=""
if [ ${#elves[@]} -gt 0 ]; then
    if [ "$arch" != "$native" ] || [ "${GPU_MPS_DEB_DEPENDS_FROM:-}" = readelf ]; then
        command -v readelf >/dev/null || die "readelf not found (apt-get install binutils): needed for the dependencies of $arch binaries"
        deps=$(foreign_depends "${elves[@]}")
        [ -z "$deps" ] || shlibs=", $deps"
    elif command -v dpkg-shlibdeps >/dev/null || install_dpkg_dev; then
        mkdir -p "$stage/shlibs/debian"
        printf 'Source: gpu-mps\n\nPackage: gpu-mps\nArchitecture: any\n' >"$stage/shlibs/debian/control"
        deps=$(cd "$stage/shlibs" && dpkg-shlibdeps -O "${elves[@]}" 2> >(grep -v 'should already be installed' >&2)) ||
            die "dpkg-shlibdeps failed"
        deps=${deps#shlibs:Depends=}
        [ -z "$deps" ] || shlibs=", $deps"
    else
        die "dpkg-shlibdeps not found and dpkg-dev could not be installed (apt-get install dpkg-dev): the package would not depend on libc6"
    fi
fi

installed_size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" -e "s|@INSTALLED_SIZE@|$installed_size|" \
    -e "s|@SHLIBS_DEPENDS@|$shlibs|" "$here/control.in" >"$root/DEBIAN/control"
(cd "$root" && find . -path ./DEBIAN -prune -o -path ./etc -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) \
    >"$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/md5sums"
# Every file and directory as root:root, with times from the commit: reproducible.
find "$root" -newermt "@$date_epoch" -print0 | xargs -0 touch --no-dereference --date="@$date_epoch"

out=$repo/target/debian
mkdir -p "$out"
deb=$out/gpu-mps_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "$deb"
