#!/bin/sh
# The init container of the gpu-mps DaemonSet (gpu-mps.yaml) runs this with the host's / mounted at
# $HOST_ROOT. It does on a Kubernetes node what the Debian package does: install the binaries into
# /usr/local/bin, the node config if there is none, /run/gpu-mps, and `gpu-mps install-containerd`
# (run inside the host's root, so it finds and checks the host's own containerd).
#
# containerd is restarted only with RESTART_CONTAINERD=true, and only when its config changed.
set -eu

host=${HOST_ROOT:-/host}
dist=${GPU_MPS_DIST:-/opt/gpu-mps}
say() { echo "install-on-host: $*"; }

[ -d "$host/etc" ] || { say "no host root at $host"; exit 1; }

install -d -m 0755 "$host/usr/local/bin"
for b in gpu-mps-shim gpu-mps-hook gpu-mps-manager gpu-mps gpu-mps-device-plugin; do
    # A rename, never a write in place: runc may be running the old shim or hook right now.
    install -m 0755 "$dist/bin/$b" "$host/usr/local/bin/.$b.gpu-mps-new"
    mv -f "$host/usr/local/bin/.$b.gpu-mps-new" "$host/usr/local/bin/$b"
done
say "installed gpu-mps-shim, gpu-mps-hook, gpu-mps-manager, gpu-mps and gpu-mps-device-plugin into /usr/local/bin"

# The node's config belongs to the node once it exists: edit it there (or manage it with your
# configuration tool); a new image never overwrites it.
if [ -e "$host/etc/gpu-mps/config.toml" ]; then
    say "kept /etc/gpu-mps/config.toml"
else
    install -d -m 0755 "$host/etc/gpu-mps"
    install -m 0644 "$dist/config.toml" "$host/etc/gpu-mps/config.toml"
    say "wrote the default /etc/gpu-mps/config.toml"
fi
install -d -m 0755 "$host/run/gpu-mps"

config_state() {
    cat "$host/etc/containerd/config.toml" "$host/etc/containerd/conf.d/gpu-mps.toml" 2>/dev/null | md5sum
}
before=$(config_state)
chroot "$host" /usr/local/bin/gpu-mps install-containerd
if [ "$before" = "$(config_state)" ]; then
    say "containerd config unchanged"
    exit 0
fi
if [ "${RESTART_CONTAINERD:-false}" = true ]; then
    # Running containers keep running (their shims do not depend on containerd); pods being
    # created at this moment fail once and kubelet retries them.
    say "containerd config changed: restarting containerd"
    chroot "$host" systemctl restart containerd
else
    say "containerd config changed: gpu-mps pods can start on this node after 'systemctl restart containerd' there (or set RESTART_CONTAINERD=true)"
fi
