#!/usr/bin/env bash
# Provisions the gpu-mps Vagrant box (Debian 12) the way a real node is set up, with the same
# artifacts: Debian's containerd and runc, then the gpu-mps .deb built by packaging/deb/build.sh,
# whose postinst runs `gpu-mps install-containerd` and starts gpu-mps-manager. Then it restarts
# containerd, which the package never does on its own, and checks the result. Idempotent: a second
# `vagrant provision` changes nothing.
set -euo pipefail

deb_dir=${GPU_MPS_DEB_DIR:-/gpu-mps-debs}
die() { echo "provision: $*" >&2; exit 1; }

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq containerd runc

# The newest real package; a ~stub one (build.sh --stub-binaries) has binaries that only fail.
deb=$(find "$deb_dir" -maxdepth 1 -name 'gpu-mps_*.deb' ! -name '*~stub*' | sort -V | tail -n 1)
[ -n "$deb" ] || die "no gpu-mps .deb (other than ~stub ones) in $deb_dir: run packaging/deb/build.sh on the host, then vagrant provision"
echo "provision: installing $deb"
apt-get install -y -qq "$deb"

# A no-op right after the postinst; here so that a re-provision repairs a hand-edited config.
gpu-mps install-containerd
systemctl restart containerd

# containerd sees the handler, and its CRI plugin loaded with it.
containerd config dump | grep -A 12 'containerd.runtimes.gpu-mps\]' |
    grep -E 'runtimes.gpu-mps\]|BinaryName|annotations' ||
    die "containerd config dump shows no gpu-mps runtime handler"
for _ in $(seq 1 30); do
    ctr plugins ls >/dev/null 2>&1 && break
    sleep 1
done
ctr plugins ls | awk '$2 == "cri" { seen = 1; if ($NF != "ok") bad = 1 } END { exit (bad || !seen) }' ||
    die "containerd's CRI plugin did not load: journalctl -u containerd"
echo "provision: containerd has the gpu-mps runtime handler"

if systemctl is-active --quiet gpu-mps-manager; then
    echo "provision: gpu-mps-manager is running"
else
    echo "provision: gpu-mps-manager is not running (no NVIDIA driver or GPU in this box?): journalctl -u gpu-mps-manager" >&2
fi
