# shellcheck shell=bash # sourced by bash scripts, so no shebang
# Sourced, not run: defines debian_mirror, which prints the first Debian archive URI of this
# machine's own apt sources (deb822 or one-line format), without a trailing slash.
# A node behind a proxy or a local mirror so uses that mirror; no host name is written here.
#   . tests/support/debian-mirror.sh; mirror=$(debian_mirror)
# DEBIAN_MIRROR, when set, is used as it is.
debian_mirror() {
    local uri=""
    # An explicit choice wins (a node whose sources name no plain Debian archive).
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "${DEBIAN_MIRROR%/}"
        return 0
    fi
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
        uri=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' /etc/apt/sources.list.d/*.sources |
            grep -v -- '-security' | grep '/debian/\?$' | head -n1 || true)
        # Debian's cloud images name a mirror list (mirror+file:///etc/apt/mirrors/debian.list):
        # its first entry is the mirror.
        if [ -z "$uri" ]; then
            local list
            list=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' /etc/apt/sources.list.d/*.sources |
                sed -n 's|^mirror+file://||p' | grep -v -- '-security' | head -n1 || true)
            [ -n "$list" ] && [ -r "$list" ] && uri=$(grep -Eo '^(https?|file)://[^[:space:]]+' "$list" | head -n1 || true)
        fi
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) { print $i; break } }' \
            /etc/apt/sources.list | grep -v -- '-security' | head -n1 || true)
    fi
    if [ -z "$uri" ]; then
        echo "debian_mirror: no Debian archive URI found in /etc/apt/sources.list{,.d}; set DEBIAN_MIRROR=<archive URI> or set one up there" >&2
        return 1
    fi
    echo "${uri%/}"
}
