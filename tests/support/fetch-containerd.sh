#!/usr/bin/env bash
# Fetch containerd + runc of three Debian suites (bookworm, trixie, sid) into a private cache,
# WITHOUT installing any of them system-wide.
#
#   tests/support/fetch-containerd.sh [CACHE_DIR]     (default: $GPU_MPS_CACHE or ~/.cache/gpu-mps)
#
# Result: CACHE_DIR/containerd/<suite>/{usr/bin/containerd,ctr,containerd-shim-runc-v2,...,usr/sbin/runc}
# and CACHE_DIR/containerd/<suite>/VERSIONS (one line per package: "<package> <version>").
#
# The mirror is taken from this machine's own apt sources, never hard-coded: a node behind a
# proxy or a local mirror uses that mirror. Each suite gets a private apt state dir, so nothing
# touches the system's apt lists. sid moves: whatever version it carries today is used and printed.
set -euo pipefail

cache=${1:-${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}}
suites=${GPU_MPS_SUITES:-"bookworm trixie sid"}

die() { echo "fetch-containerd: $*" >&2; exit 1; }

. "$(dirname "$0")/private-apt.sh"

mkdir -p "$cache/containerd"

for suite in $suites; do
    dest="$cache/containerd/$suite"
    private_apt_init "$suite" "$cache" || die "no apt index for suite $suite"
    want=""
    for pkg in containerd runc; do
        ver=$(private_apt_candidate "$pkg") || die "suite $suite has no $pkg package"
        want="$want$pkg $ver"$'\n'
    done
    if [ -f "$dest/VERSIONS" ] && [ "$(cat "$dest/VERSIONS")" = "${want%$'\n'}" ] && [ -x "$dest/usr/bin/containerd" ]; then
        echo "fetch-containerd: $suite cached: $(tr '\n' ' ' <"$dest/VERSIONS")"
        continue
    fi
    rm -rf "$dest" && mkdir -p "$dest"
    private_apt_download "$private_apt_dir/debs" containerd runc || die "apt-get download failed for suite $suite"
    for deb in "$private_apt_dir"/debs/*.deb; do dpkg-deb -x "$deb" "$dest"; done
    printf '%s' "${want%$'\n'}" >"$dest/VERSIONS"
    # shellcheck disable=SC2015 # meant: fail when either binary is missing
    [ -x "$dest/usr/bin/containerd" ] && [ -x "$dest/usr/sbin/runc" ] || die "suite $suite: binaries missing after extraction"
    echo "fetch-containerd: $suite fetched: $(tr '\n' ' ' <"$dest/VERSIONS")"
done
