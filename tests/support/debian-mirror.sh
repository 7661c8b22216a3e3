#!/usr/bin/env bash
# Prints the first Debian archive URI of this machine's apt sources (deb822 or one-line format),
# without a trailing slash: the mirror the scripts that fetch packages from other suites use, so a
# node behind a proxy or a local mirror uses that mirror. Never a hard-coded host.
#   mirror=$(bash tests/support/debian-mirror.sh)
set -euo pipefail

uri=""
if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
    uri=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' /etc/apt/sources.list.d/*.sources |
        grep -v -- '-security' | grep '/debian/\?$' | head -n1 || true)
fi
if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) { print $i; break } }' \
        /etc/apt/sources.list | grep -v -- '-security' | head -n1 || true)
fi
[ -n "$uri" ] || { echo "debian-mirror: no Debian archive URI in /etc/apt/sources.list{,.d}; set one up first" >&2; exit 1; }
echo "${uri%/}"
