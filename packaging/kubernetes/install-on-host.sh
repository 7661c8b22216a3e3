#!/bin/sh
# What the gpu-mps DaemonSet's init container runs (gpu-mps.yaml), with the host's / mounted at
# $HOST_ROOT; and what the uninstall Job runs (uninstall/gpu-mps-uninstall.yaml) with the argument
# `uninstall`.
#
#   install-on-host.sh [install]   the binaries (those the image's binaries.txt lists) into
#                                  $GPU_MPS_PREFIX/bin, the node config if there is none, the
#                                  gpu-mps runtime handler in containerd's config
#                                  (`gpu-mps install-containerd`, run inside the host's root, so it
#                                  finds and checks the host's own containerd)
#   install-on-host.sh uninstall   the handler out of containerd's config (`gpu-mps
#                                  uninstall-containerd`: the config as it was before the install,
#                                  byte for byte, with backups of it left next to it), the binaries
#                                  and the manager's state root removed; the node config is kept
#                                  unless PURGE_NODE_CONFIG=true. Waits for a manager that still
#                                  answers to stop (MANAGER_WAIT_SECONDS), then refuses.
#
# Every path below is a path on the host; the defaults are the DaemonSet's.
#   HOST_ROOT                  where the host's / is mounted in this container (/host)
#   GPU_MPS_PREFIX             the binaries go to $GPU_MPS_PREFIX/bin (/usr/local); a prefix other
#                              than /usr/local is written into a new node config as hook_path
#   GPU_MPS_CONFIG             the node config (/etc/gpu-mps/config.toml)
#   CONTAINERD_CONFIG          containerd's main config (/etc/containerd/config.toml)
#   CONTAINERD_DROP_IN         the drop-in written for containerd 2.x (gpu-mps's default)
#   CONTAINERD_BINARY          the host's containerd (found on PATH inside the host's root)
#   RESTART_CONTAINERD         true: restart containerd when its config changed (false)
#   CONTAINERD_RESTART_COMMAND how, run with the host's /bin/sh inside the host's root
#                              (systemctl restart containerd)
#   PURGE_NODE_CONFIG          uninstall only: true removes the node config too (false)
#   MANAGER_WAIT_SECONDS       uninstall only: how long to wait for a gpu-mps-manager that still
#                              answers to stop, as the DaemonSet's pod leaves a node whose label
#                              was taken off (120)
set -eu

mode=${1:-install}
host=${HOST_ROOT:-/host}
dist=${GPU_MPS_DIST:-/opt/gpu-mps}
prefix=${GPU_MPS_PREFIX:-/usr/local}
node_config=${GPU_MPS_CONFIG:-/etc/gpu-mps/config.toml}
containerd_config=${CONTAINERD_CONFIG:-/etc/containerd/config.toml}
restart_command=${CONTAINERD_RESTART_COMMAND:-systemctl restart containerd}
say() { echo "install-on-host: $*"; }
die() { say "$*" >&2; exit 1; }
# The binaries to install and to remove: the image's copy of packaging/binaries.txt (first column).
binaries=$(awk '{ sub(/#.*/, "") } NF { printf "%s%s", sep, $1; sep = " " }' "$dist/binaries.txt") ||
    die "cannot read the list of binaries $dist/binaries.txt (GPU_MPS_DIST)"
[ -n "$binaries" ] || die "$dist/binaries.txt lists no binaries"

case "$mode" in
    install | uninstall) ;;
    *) die "unknown mode '$mode': use install (the default) or uninstall" ;;
esac
[ -d "$host/etc" ] || die "no host root at $host (HOST_ROOT): mount the host's / there"
case "$prefix" in
    /*) ;;
    *) die "GPU_MPS_PREFIX='$prefix' is not an absolute path on the host" ;;
esac

# Every file of containerd's config that gpu-mps may write: the main config, a drop-in named by
# CONTAINERD_DROP_IN, and the conf.d/ next to the main config.
config_state() {
    cat "$host$containerd_config" ${CONTAINERD_DROP_IN:+"$host$CONTAINERD_DROP_IN"} \
        "$host$(dirname "$containerd_config")"/conf.d/* 2>/dev/null | md5sum
}

# Runs `<gpu-mps> install-containerd|uninstall-containerd` inside the host's root, then restarts
# containerd when its config changed and RESTART_CONTAINERD=true.
register() {
    cli=$1 command=$2
    set -- --containerd-config "$containerd_config" --shim "$prefix/bin/gpu-mps-shim"
    [ -z "${CONTAINERD_DROP_IN:-}" ] || set -- "$@" --drop-in "$CONTAINERD_DROP_IN"
    [ -z "${CONTAINERD_BINARY:-}" ] || set -- "$@" --containerd "$CONTAINERD_BINARY"
    before=$(config_state)
    chroot "$host" "$cli" "$command" "$@"
    if [ "$before" = "$(config_state)" ]; then
        say "containerd config unchanged"
    elif [ "${RESTART_CONTAINERD:-false}" = true ]; then
        # Running containers keep running (their shims do not depend on containerd); pods being
        # created at this moment fail once and kubelet retries them.
        say "containerd config changed: restarting containerd ($restart_command)"
        chroot "$host" /bin/sh -c "$restart_command"
    else
        say "containerd config changed: run '$restart_command' on the node to apply it (or set RESTART_CONTAINERD=true)"
    fi
}

# The manager's state root, as gpu-mps reads the node config (the image's own gpu-mps: the
# host's may not be installed yet, or be gone). A config it cannot read stops the script here.
state_root() {
    "$dist/bin/gpu-mps" --config "$host$node_config" config get root ||
        die "cannot read the state root from $node_config (the error above): fix the file, then run this again"
}

install_binaries() {
    for b in $binaries; do
        [ -f "$dist/bin/$b" ] || die "the image has no $dist/bin/$b, which $dist/binaries.txt lists: rebuild it after scripts/build-release.sh"
    done
    install -d -m 0755 "$host$prefix/bin"
    for b in $binaries; do
        # A rename, never a write in place: runc may be running the old shim or hook right now.
        install -m 0755 "$dist/bin/$b" "$host$prefix/bin/.$b.gpu-mps-new"
        mv -f "$host$prefix/bin/.$b.gpu-mps-new" "$host$prefix/bin/$b"
    done
    say "installed $binaries into $prefix/bin"
}

# The node's config belongs to the node once it exists: edit it there (or manage it with your
# configuration tool); a new image never overwrites it.
install_node_config() {
    if [ -e "$host$node_config" ]; then
        say "kept $node_config"
        return
    fi
    install -d -m 0755 "$(dirname "$host$node_config")"
    if [ "$prefix" = /usr/local ]; then
        install -m 0644 "$dist/config.toml" "$host$node_config"
    else
        sed "s|^# hook_path = .*|hook_path = \"$prefix/bin/gpu-mps-hook\"|" "$dist/config.toml" >"$host$node_config"
        chmod 0644 "$host$node_config"
    fi
    say "wrote the default $node_config"
}

if [ "$mode" = install ]; then
    install_binaries
    install_node_config
    root=$(state_root)
    install -d -m 0700 "$host$root"
    register "$prefix/bin/gpu-mps" install-containerd
    exit 0
fi

# uninstall: the image's own gpu-mps does it (the host's copy may be gone already), from a
# temporary name inside the host's root, so that it runs against the host's containerd.
root=$(state_root)
cli=$prefix/bin/.gpu-mps.uninstall
install -d -m 0755 "$host$prefix/bin"
install -m 0755 "$dist/bin/gpu-mps" "$host$cli"
trap 'rm -f "$host$cli"' EXIT
manager_answers() { GPU_MPS_CONFIG=$node_config chroot "$host" "$cli" status >/dev/null 2>&1; }
wait_seconds=${MANAGER_WAIT_SECONDS:-120}
case $wait_seconds in '' | *[!0-9]*) die "MANAGER_WAIT_SECONDS=$wait_seconds: expected a number of seconds" ;; esac
if manager_answers; then
    say "a gpu-mps-manager answers on $root/manager.sock: waiting up to $wait_seconds s for it to stop (the DaemonSet's pod leaves once the node's label is off)"
    waited=0
    # `status` answers or fails within a second, so the loop keeps to the limit.
    while [ "$waited" -lt "$wait_seconds" ] && manager_answers; do
        sleep 2
        waited=$((waited + 2))
    done
    if manager_answers; then
        die "a gpu-mps-manager still answers on $root/manager.sock after $wait_seconds s: take the node's label off so that the DaemonSet's pod leaves it (kubectl label node <node> gpu-mps.io/enabled-), or stop the manager (systemctl stop gpu-mps-manager), then run this again"
    fi
    say "the manager stopped after about $waited s"
fi
# Leases the manager left (it was stopped, not drained): their containers still run, and their
# kill and delete go through gpu-mps-shim; removing it now would leave them stuck until containerd
# restarts, and their MPS daemons without their pipe dirs.
# `gpu-mps node live-leases` reads the lease files and checks each container's init process (pid
# and start time; the pod runs with hostPID, so the host's /proc is the chroot's): the same check as
# the Debian package's prerm. (A lease whose process is gone is stale: the manager that would drop
# it is stopped.)
set +e
live=$(GPU_MPS_CONFIG=$node_config chroot "$host" "$cli" node live-leases 2>&1)
live_status=$?
set -e
case $live_status in
    0) ;;
    3)
        if [ "${FORCE:-false}" != true ]; then
            die "gpu-mps containers still run with leases ($root/leases): delete the node's gpu-mps pods first, or set FORCE=true to remove gpu-mps under them: $(echo "$live" | tr '\n' ';')"
        fi
        say "FORCE=true: removing gpu-mps under running containers: $(echo "$live" | tr '\n' ';')"
        ;;
    *)
        [ "${FORCE:-false}" = true ] || die "cannot tell whether gpu-mps containers still run ($live); set FORCE=true to remove gpu-mps anyway"
        ;;
esac
register "$cli" uninstall-containerd
for b in $binaries; do
    rm -f "$host$prefix/bin/$b"
done
say "removed $binaries from $prefix/bin"
# The state root: only what gpu-mps keeps there, then the directory if that was all (a root set
# to a shared directory, root = "/run", loses nothing else), and nothing while an MPS control
# daemon still runs from it: `gpu-mps node remove-state`, the rule the Debian package's prerm
# keeps too. One line per entry removed or kept, and one for the root.
set +e
removed=$(GPU_MPS_CONFIG=$node_config chroot "$host" "$cli" node remove-state 2>&1)
removed_status=$?
set -e
printf '%s\n' "$removed" | while IFS= read -r line; do say "${line#gpu-mps: }"; done
case $removed_status in
    0) ;;
    3)
        # Only FORCE=true gets here with leases; without, an MPS daemon the manager left runs.
        [ "${FORCE:-false}" = true ] ||
            die "the state root $root stays while its MPS control daemons run (the lines above): stop them, then run this again"
        say "FORCE=true: kept the state root $root for the MPS control daemons that still run from it"
        ;;
    *) die "could not remove the state root $root (the line above)" ;;
esac
if [ "${PURGE_NODE_CONFIG:-false}" = true ]; then
    rm -f "$host$node_config"
    rmdir "$(dirname "$host$node_config")" 2>/dev/null || true
    say "removed $node_config"
else
    say "kept $node_config (PURGE_NODE_CONFIG=true removes it)"
fi
