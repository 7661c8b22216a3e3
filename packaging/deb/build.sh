#!/usr/bin/env bash
# Builds the gpu-mps Debian package with dpkg-deb from release binaries that are already built:
#
#   scripts/build-release.sh && packaging/deb/build.sh
#
# Output: target/debian/gpu-mps_<version>_<arch>.deb (version from [workspace.package] in Cargo.toml).
# Binaries are taken from $GPU_MPS_BIN_DIR, else ${CARGO_TARGET_DIR:-target}/dist (scripts/build-release.sh).
#
#   packaging/deb/build.sh --stub-binaries
#
# packages shell stubs instead of missing binaries, to test the packaging alone; the version gets a
# "~stub" suffix and the stubs fail when run. Never install such a package on a real node.
#
# Needs dpkg-deb; dpkg-shlibdeps (dpkg-dev), when present, adds the shared library dependencies.
set -euo pipefail

die() { echo "build.sh: $*" >&2; exit 1; }

stubs=no
for arg in "$@"; do
    case "$arg" in
    --stub-binaries) stubs=yes ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) die "unknown argument: $arg (see --help)" ;;
    esac
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
packaging=$(dirname "$here")
repo=$(dirname "$packaging")
command -v dpkg-deb >/dev/null || die "dpkg-deb not found: apt-get install dpkg"

# [workspace.package] version = "x.y.z"
version=$(awk '
    /^\[/ { section = $0; next }
    section == "[workspace.package]" && $1 == "version" { gsub(/[" ]/, "", $3); print $3; exit }
' "$repo/Cargo.toml")
[ -n "$version" ] || die "no version in [workspace.package] of $repo/Cargo.toml"
arch=$(dpkg --print-architecture)
bin_dir=${GPU_MPS_BIN_DIR:-${CARGO_TARGET_DIR:-$repo/target}/dist}
binaries=(gpu-mps-shim gpu-mps-hook gpu-mps-manager gpu-mps)

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/root
install -d -m 0755 "$root/DEBIAN" "$root/usr/local/bin" "$root/etc/gpu-mps" \
    "$root/usr/lib/systemd/system" "$root/usr/lib/tmpfiles.d" "$root/usr/share/doc/gpu-mps"

stubbed=()
for b in "${binaries[@]}"; do
    if [ -f "$bin_dir/$b" ] && [ -x "$bin_dir/$b" ]; then
        install -m 0755 "$bin_dir/$b" "$root/usr/local/bin/$b"
    elif [ "$stubs" = yes ]; then
        printf '#!/bin/sh\necho "%s: stub from packaging/deb/build.sh --stub-binaries, not a real build" >&2\nexit 1\n' \
            "$b" >"$root/usr/local/bin/$b"
        chmod 0755 "$root/usr/local/bin/$b"
        stubbed+=("$b")
    else
        die "$bin_dir/$b is missing: run scripts/build-release.sh first (or set GPU_MPS_BIN_DIR)"
    fi
done
if [ ${#stubbed[@]} -gt 0 ]; then
    version="$version~stub"
    echo "build.sh: WARNING: stub binaries for ${stubbed[*]}: version $version is for testing the packaging only" >&2
fi

install -m 0644 "$packaging/config.toml" "$root/etc/gpu-mps/config.toml"
install -m 0644 "$packaging/systemd/gpu-mps-manager.service" "$root/usr/lib/systemd/system/"
install -m 0644 "$packaging/systemd/gpu-mps.conf" "$root/usr/lib/tmpfiles.d/"
install -m 0644 "$packaging/README.md" "$root/usr/share/doc/gpu-mps/README.md"
cat >"$root/usr/share/doc/gpu-mps/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: gpu-mps

Files: *
License: Apache-2.0
 On Debian systems the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
EOF
chmod 0644 "$root/usr/share/doc/gpu-mps/copyright"

for script in postinst prerm postrm; do
    install -m 0755 "$here/$script" "$root/DEBIAN/$script"
done
install -m 0644 "$here/conffiles" "$root/DEBIAN/conffiles"

# Shared library dependencies of the real binaries (libc6, libgcc-s1), as debhelper would add them.
shlibs=""
elves=()
for b in "${binaries[@]}"; do
    if head -c 4 "$root/usr/local/bin/$b" | grep -q 'ELF'; then elves+=("$root/usr/local/bin/$b"); fi
done
if [ ${#elves[@]} -gt 0 ]; then
    if command -v dpkg-shlibdeps >/dev/null; then
        mkdir -p "$stage/shlibs/debian"
        printf 'Source: gpu-mps\n\nPackage: gpu-mps\nArchitecture: any\n' >"$stage/shlibs/debian/control"
        deps=$(cd "$stage/shlibs" && dpkg-shlibdeps -O "${elves[@]}" 2> >(grep -v 'should already be installed' >&2)) ||
            die "dpkg-shlibdeps failed"
        deps=${deps#shlibs:Depends=}
        [ -z "$deps" ] || shlibs=", $deps"
    else
        echo "build.sh: dpkg-shlibdeps not found (apt-get install dpkg-dev): no libc6 dependency recorded" >&2
    fi
fi

installed_size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" -e "s|@INSTALLED_SIZE@|$installed_size|" \
    -e "s|@SHLIBS_DEPENDS@|$shlibs|" "$here/control.in" >"$root/DEBIAN/control"
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) \
    >"$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/md5sums"

out=$repo/target/debian
mkdir -p "$out"
deb=$out/gpu-mps_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "$deb"
