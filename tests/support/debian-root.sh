#!/usr/bin/env bash
# Build (once) a Debian root file system from Debian's own packages with mmdebstrap, as a tarball
# in the cache, and print its path. Used for the DaemonSet image's base (no registry is needed) and
# for the fresh root the Debian package is installed into.
#
#   tests/support/debian-root.sh NAME [mmdebstrap options...]
#   tests/support/debian-root.sh image-base --variant=minbase
#   tests/support/debian-root.sh apt-root --variant=minbase --include=ca-certificates
#
# The result, $GPU_MPS_CACHE/roots/NAME.tar, is rebuilt when the options change or after a week.
# The suite is bookworm (override with DEBIAN_ROOT_SUITE); the mirror is this machine's own
# (tests/support/debian-mirror.sh). Installs mmdebstrap from Debian 12 when it is missing; runs as root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "debian-root: $*" >&2; exit 1; }

[ $# -ge 1 ] || die "usage: debian-root.sh NAME [mmdebstrap options...]  (example: debian-root.sh image-base --variant=minbase)"
name=$1; shift
case "$name" in *[!A-Za-z0-9._-]*|"") die "NAME '$name' may hold only letters, digits, '.', '_' and '-'" ;; esac
[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap's root mode)"
cache=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}
suite=${DEBIAN_ROOT_SUITE:-bookworm}
. "$here/debian-mirror.sh"
mirror=$(debian_mirror) || die "no Debian archive URI in the machine's apt sources"

if ! command -v mmdebstrap >/dev/null; then
    echo "debian-root: installing mmdebstrap" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >&2
fi

mkdir -p "$cache/roots"
out="$cache/roots/$name.tar"
key="$suite $mirror $*"
if [ -f "$out" ] && [ "$(cat "$out.key" 2>/dev/null)" = "$key" ] && [ -z "$(find "$out" -mtime +7)" ]; then
    echo "debian-root: $name cached ($key)" >&2
    echo "$out"; exit 0
fi
rm -f "$out" "$out.key"
echo "debian-root: building $name: mmdebstrap $* $suite from $mirror" >&2
start=$(date +%s)
partial="$cache/roots/.$name.partial.tar"
rm -rf "$partial"
mmdebstrap --mode=root --format=tar --quiet "$@" "$suite" "$partial" "$mirror" >&2 ||
    die "mmdebstrap failed for $name ($key)"
mv "$partial" "$out"
printf '%s' "$key" >"$out.key"
echo "debian-root: $name built in $(( $(date +%s) - start )) s, $(du -h "$out" | cut -f1)" >&2
echo "$out"
