#!/usr/bin/env bash
# What the packaging steps of tests/run.sh download (Debian packages, two Debian roots, promtool,
# rustup's arm64 target), fetched in the background while the workspace compiles: on a fresh CI
# machine these are minutes of waiting on the network, which the compile hides. Each step still
# fetches what it finds missing, so a failure here costs time, never a result.
#   bash tests/support/prefetch.sh      (as root; tests/run.sh runs it in the background)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
start=$SECONDS

# image.sh: buildah; deb.sh: lintian, dpkg-dev, binutils, util-linux; arm64.sh: the cross
# toolchain and qemu-user; manifests.sh: python3-venv; debian-root.sh: mmdebstrap.
packages=(buildah lintian dpkg-dev binutils util-linux gcc-aarch64-linux-gnu libc6-dev-arm64-cross
    qemu-user-static python3-venv mmdebstrap)
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
