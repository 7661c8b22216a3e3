#!/usr/bin/env bash
# What the packaging steps of tests/run.sh download (Debian packages, two Debian roots, promtool,
# rustup's arm64 target), fetched in the background while the workspace compiles: on a fresh CI
# machine these are minutes of waiting on the network, which the compile hides. Each step still
# fetches what it finds missing, so a failure here costs time, never a result.
#   bash tests/support/prefetch.sh              (as root)
#   bash tests/support/prefetch.sh --prebuild   (then cargo-deny, the release binaries, the arm64
#                                                cross build and the fuzz targets; tests/run.sh runs this in
#                                                the background)
# The builds run at the lowest CPU priority: on 2 cores they take only what clippy, the build and
# the tests leave idle (the end-to-end tests mostly wait on containerd), and each step then finds
# its build up to date.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
start=$SECONDS
prebuild=no
case "${1:-}" in
    "") ;;
    --prebuild) prebuild=yes ;;
    *) echo "prefetch: unknown argument '$1' (allowed: --prebuild)" >&2; exit 2 ;;
esac

# image.sh: buildah; deb.sh: lintian, dpkg-dev, binutils, util-linux; arm64.sh: the cross
# toolchain and qemu-user; manifests.sh: python3-venv; debian-root.sh: mmdebstrap; fuzz-smoke.sh: g++.
packages=(buildah lintian dpkg-dev binutils util-linux gcc-aarch64-linux-gnu libc6-dev-arm64-cross
    qemu-user-static python3-venv mmdebstrap g++)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "prefetch: packages ready after $((SECONDS - start)) s (installed: ${missing[*]:-none})"
if command -v rustup >/dev/null; then
    rustup target list --installed | grep -qx aarch64-unknown-linux-gnu || rustup target add aarch64-unknown-linux-gnu
fi
# The same names and options as tests/image.sh and tests/deb.sh: the cache key.
bash tests/support/debian-root.sh image-base --variant=minbase >/dev/null
bash tests/support/debian-root.sh deb-root --variant=minbase --include=ca-certificates >/dev/null
bash tests/support/fetch-promtool.sh >/dev/null
echo "prefetch: done in $((SECONDS - start)) s"
[ "$prebuild" = yes ] || exit 0
for build in "tests/deny.sh --install-only" "scripts/build-release.sh" "tests/arm64.sh --build-only" "tests/fuzz-smoke.sh --build-only"; do
    phase=$SECONDS
    # shellcheck disable=SC2086 # a script and its argument
    nice -n 19 bash $build >/dev/null 2>&1 || { echo "prefetch: $build failed (its step builds again)"; continue; }
    echo "prefetch: built ahead: $build in $((SECONDS - phase)) s"
done
