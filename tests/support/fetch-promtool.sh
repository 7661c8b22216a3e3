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
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

die() { echo "fetch-promtool: $*" >&2; exit 1; }

# The first Debian archive URI of the machine's apt sources (deb822 or one-line format).
debian_mirror() {
    local uri=""
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
        uri=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' /etc/apt/sources.list.d/*.sources |
            grep -v -- '-security' | grep '/debian/\?$' | head -n1 || true)
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) { print $i; break } }' \
            /etc/apt/sources.list | grep -v -- '-security' | head -n1 || true)
    fi
    [ -n "$uri" ] || die "no Debian archive URI found in /etc/apt/sources.list{,.d}; set one up first"
    echo "${uri%/}"
}

command -v apt-get >/dev/null || die "apt-get not found: this script needs a Debian machine"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found"
[ -r "$keyring" ] || die "$keyring missing: install debian-archive-keyring"

dest="$cache/promtool"
# The same private apt state as fetch-containerd.sh's bookworm suite: one index for both.
apt_dir="$cache/apt/$suite"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/debs-promtool"
echo "deb [signed-by=$keyring] $(debian_mirror) $suite main" >"$apt_dir/sources.list"
apt_opts=(
    -o "Dir::State=$apt_dir" -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::State::status=/dev/null"
    -o "Dir::Cache=$apt_dir" -o "Dir::Cache::archives=$apt_dir/archives"
    -o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
    -o "APT::Architecture=amd64" -o "Acquire::Languages=none" -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
    -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root"
)
stamp="$apt_dir/lists/.updated"
if [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +1440)" ]; then
    apt-get "${apt_opts[@]}" -qq update || die "apt-get update failed for suite $suite"
    touch "$stamp"
fi
version=$(apt-cache "${apt_opts[@]}" policy prometheus | awk '/Candidate:/ { print $2 }')
[ -n "$version" ] && [ "$version" != "(none)" ] || die "suite $suite has no prometheus package"
if [ -x "$dest/usr/bin/promtool" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "prometheus $version" ]; then
    echo "fetch-promtool: cached: prometheus $version" >&2
else
    rm -rf "$dest" && mkdir -p "$dest"
    (cd "$apt_dir/debs-promtool" && rm -f ./*.deb && apt-get "${apt_opts[@]}" -qq download prometheus) ||
        die "apt-get download prometheus failed"
    # Only promtool is kept: the server and its service files are of no use here.
    tmp=$(mktemp -d)
    dpkg-deb -x "$apt_dir"/debs-promtool/prometheus_*.deb "$tmp"
    mkdir -p "$dest/usr/bin"
    mv "$tmp/usr/bin/promtool" "$dest/usr/bin/promtool"
    rm -rf "$tmp" "$apt_dir"/debs-promtool/*.deb
    printf 'prometheus %s' "$version" >"$dest/VERSION"
    echo "fetch-promtool: fetched: prometheus $version" >&2
fi
"$dest/usr/bin/promtool" --version >/dev/null 2>&1 || die "$dest/usr/bin/promtool does not run"
echo "$dest/usr/bin/promtool"
