#!/usr/bin/env bash
# Fetch promtool from Debian 12's prometheus package into a private cache, WITHOUT installing the
# package (installing it would start a Prometheus server as a system service).
#
#   tests/support/fetch-promtool.sh [CACHE_DIR]     (default: $GPU_MPS_CACHE or ~/.cache/gpu-mps)
#
# Result: CACHE_DIR/promtool/usr/bin/promtool and CACHE_DIR/promtool/VERSION; the script's last
# line of output is the path of promtool. The mirror comes from this machine's own apt sources
# (as in fetch-containerd.sh), with a private apt state dir: the system's apt lists are untouched.
set -euo pipefail

cache=${1:-${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}}
suite=bookworm

die() { echo "fetch-promtool: $*" >&2; exit 1; }

. "$(dirname "$0")/private-apt.sh"

dest="$cache/promtool"
# The same private apt state as fetch-containerd.sh's bookworm suite: one index for both.
private_apt_init "$suite" "$cache" || die "no apt index for suite $suite"
version=$(private_apt_candidate prometheus) || die "suite $suite has no prometheus package"
if [ -x "$dest/usr/bin/promtool" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "prometheus $version" ]; then
    echo "fetch-promtool: cached: prometheus $version" >&2
else
    rm -rf "$dest" && mkdir -p "$dest"
    private_apt_download "$private_apt_dir/debs-promtool" prometheus || die "apt-get download prometheus failed"
    # Only promtool is kept: the server and its service files are of no use here.
    tmp=$(mktemp -d)
    dpkg-deb -x "$private_apt_dir"/debs-promtool/prometheus_*.deb "$tmp"
    mkdir -p "$dest/usr/bin"
    mv "$tmp/usr/bin/promtool" "$dest/usr/bin/promtool"
    rm -rf "$tmp" "$private_apt_dir"/debs-promtool/*.deb
    printf 'prometheus %s' "$version" >"$dest/VERSION"
    echo "fetch-promtool: fetched: prometheus $version" >&2
fi
"$dest/usr/bin/promtool" --version >/dev/null 2>&1 || die "$dest/usr/bin/promtool does not run"
echo "$dest/usr/bin/promtool"
