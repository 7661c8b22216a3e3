#!/usr/bin/env bash
# The DaemonSet image, built and run for real (issue 9, item 1):
#   1. the release binaries (scripts/build-release.sh; cargo skips what is up to date),
#   2. a base image from Debian's own packages: tests/support/debian-root.sh (mmdebstrap, cached)
#      imported into a private buildah storage (no registry anywhere),
#   3. packaging/container/Dockerfile built with buildah (Debian 12's) on that base, named as
#      packaging/kubernetes/gpu-mps.yaml names it, exported as an OCI archive:
#      target/image/gpu-mps.oci.tar,
#   4. tests/e2e/tests/cri_daemonset.rs, which imports it into a private containerd and runs the
#      DaemonSet's init container, its manager container, a GPU container and the uninstall Job
#      through CRI, as kubelet would.
#
#   bash tests/image.sh            (root; GPU_MPS_E2E_SUITES=bookworm for one containerd line)
#
# Any failure fails the script; the e2e test is told the image must be there.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "tests/image.sh: run as root (mmdebstrap, buildah and containerd need it)" >&2; exit 1; }
export GPU_MPS_CACHE=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}
started=$(date +%s)
phase_start=$started
phase() {
    local now; now=$(date +%s)
    echo "image: $1 ($(( now - phase_start )) s)"
    phase_start=$now
}

if ! command -v buildah >/dev/null; then
    echo "image: installing buildah from Debian"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah >/dev/null ||
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah >/dev/null; }
fi
buildah --version
phase "buildah ready"

bash scripts/build-release.sh >/dev/null
phase "release binaries in target/dist"

# A private storage: vfs works on every file system (overlay cannot sit on an overlay root),
# and nothing of the machine's own containers storage is touched. The base image is cached there
# under a tag naming the root tarball's build time.
storage=$GPU_MPS_CACHE/buildah
runroot=$(mktemp -d /tmp/gpu-mps-buildah-run.XXXXXX)
trap 'rm -rf "$runroot"' EXIT
bh() { buildah --root "$storage" --runroot "$runroot" --storage-driver vfs "$@"; }

root_tar=$(bash tests/support/debian-root.sh image-base --variant=minbase)
base=localhost/gpu-mps-base:bookworm-$(stat -c %Y "$root_tar")
if ! bh inspect --type image "$base" >/dev/null 2>&1; then
    bh images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/gpu-mps-base:' | xargs -r -n1 buildah \
        --root "$storage" --runroot "$runroot" --storage-driver vfs rmi >/dev/null || true
    working=$(bh from scratch)
    bh add "$working" "$root_tar" /
    bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$working"
    bh commit -q --rm "$working" "$base" >/dev/null
fi
phase "base image $base from $root_tar"

# The name the manifests run (the first `image:` of the DaemonSet).
image=$(awk '$1 == "image:" { print $2; exit }' packaging/kubernetes/gpu-mps.yaml)
[ -n "$image" ] || { echo "image: no image: in packaging/kubernetes/gpu-mps.yaml" >&2; exit 1; }
# The same Containerfile and ignore file (packaging/container/Dockerfile.dockerignore, which
# buildah reads next to the Containerfile as docker's BuildKit does) operators use. The
# Containerfile has no RUN step; one would run under chroot isolation (checked here as root: no
# runc set-up or user namespace needed).
bh bud --quiet --isolation chroot --pull=never --build-arg "BASE=$base" \
    -f packaging/container/Dockerfile -t "$image" . >/dev/null
mkdir -p target/image
archive=target/image/gpu-mps.oci.tar
rm -f "$archive"
bh push --quiet "$image" "oci-archive:$archive:$image"
# Only the base stays in the storage (vfs keeps a whole copy of every image).
bh rmi "$image" >/dev/null
phase "built $image: $archive ($(du -h "$archive" | cut -f1))"

# What the e2e test needs besides the image (no-ops after tests/run.sh's build step).
cargo build --workspace --bins --locked
RUSTFLAGS='-C target-feature=+crt-static' cargo build -p gpu-mps-checker --target x86_64-unknown-linux-gnu --locked
GPU_MPS_E2E_REQUIRE_IMAGE=1 GPU_MPS_E2E_IMAGE_ARCHIVE=$PWD/$archive \
    cargo test -p gpu-mps-e2e --locked --test cri_daemonset -- --nocapture
phase "cri_daemonset passed"
echo "image: done in $(( $(date +%s) - started )) s"
