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
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

die() { echo "fetch-containerd: $*" >&2; exit 1; }

. "$(dirname "$0")/debian-mirror.sh"

command -v apt-get >/dev/null || die "apt-get not found: this script needs a Debian machine"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found"
[ -r "$keyring" ] || die "$keyring missing: install debian-archive-keyring"

mirror=$(debian_mirror) || die "no Debian archive URI in the apt sources"
mkdir -p "$cache/containerd"

for suite in $suites; do
    dest="$cache/containerd/$suite"
    apt_dir="$cache/apt/$suite"
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/debs"
    echo "deb [signed-by=$keyring] $mirror $suite main" >"$apt_dir/sources.list"
    apt_opts=(
        -o "Dir::State=$apt_dir" -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::State::status=/dev/null"
        -o "Dir::Cache=$apt_dir" -o "Dir::Cache::archives=$apt_dir/archives"
        -o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "APT::Architecture=amd64" -o "Acquire::Languages=none" -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
        -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root"
    )
    # Refresh the index at most daily: sid moves, but not within a CI run.
    stamp="$apt_dir/lists/.updated"
    if [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +1440)" ]; then
        apt-get "${apt_opts[@]}" -qq update || die "apt-get update failed for suite $suite at $mirror"
        touch "$stamp"
    fi
    want=""
    for pkg in containerd runc; do
        ver=$(apt-cache "${apt_opts[@]}" policy "$pkg" | awk '/Candidate:/ { print $2 }')
        [ -n "$ver" ] && [ "$ver" != "(none)" ] || die "suite $suite has no $pkg package"
        want="$want$pkg $ver"$'\n'
    done
    if [ -f "$dest/VERSIONS" ] && [ "$(cat "$dest/VERSIONS")" = "${want%$'\n'}" ] && [ -x "$dest/usr/bin/containerd" ]; then
        echo "fetch-containerd: $suite cached: $(tr '\n' ' ' <"$dest/VERSIONS")"
        continue
    fi
    rm -rf "$dest" && mkdir -p "$dest"
    (cd "$apt_dir/debs" && rm -f ./*.deb && apt-get "${apt_opts[@]}" -qq download containerd runc) ||
        die "apt-get download failed for suite $suite"
    for deb in "$apt_dir"/debs/*.deb; do dpkg-deb -x "$deb" "$dest"; done
    printf '%s' "${want%$'\n'}" >"$dest/VERSIONS"
    [ -x "$dest/usr/bin/containerd" ] && [ -x "$dest/usr/sbin/runc" ] || die "suite $suite: binaries missing after extraction"
    echo "fetch-containerd: $suite fetched: $(tr '\n' ' ' <"$dest/VERSIONS")"
done
