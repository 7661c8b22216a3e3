# shellcheck shell=bash # sourced by bash scripts, so no shebang
# Sourced, not run: a Debian root (an unpacked tarball) set up to run like a machine, from inside a
# private mount namespace (`unshare --mount`), so that every mount goes when the namespace ends.
# Used by tests/deb.sh (the package's round trip) and tests/fresh-root.sh (the README's commands).
#
#   mount_root "$R"              /proc, /sys, /dev, a fresh /run; the root itself a mount point
#   trap 'stop_root_processes "$R"' EXIT

mount_root() { # ROOT
    local root=$1
    mount --make-rprivate /
    # The root a mount point, as / is on a machine: runc makes / a slave mount in each container.
    mount --bind "$root" "$root"
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mount --rbind /dev "$root/dev"
    mount -t tmpfs -o mode=0755 tmpfs "$root/run"
}

# Everything that runs inside the root, by pid (never by name).
stop_root_processes() { # ROOT
    local p
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/root" 2>/dev/null)" = "$1" ] && kill -KILL "${p#/proc/}" 2>/dev/null
    done
    return 0
}
