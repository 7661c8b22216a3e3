#!/usr/bin/env bash
# Prepare .carry/ for tests/gpu/run.sh on the lent GPU machine, which has no runc, no
# containerd and no network: Debian's containerd + runc (trixie: its runc needs glibc 2.38, the
# GPU machine has 2.39) and our release binaries, xz-compressed, plus the commit they came from.
#   tests/gpu/pack.sh        (run from anywhere in the repo; .carry/ is ignored by git)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.carry/' "$exclude" 2>/dev/null || echo '/.carry/' >>"$exclude"
mkdir -p .carry
cache=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}
GPU_MPS_SUITES=trixie tests/support/fetch-containerd.sh "$cache"
suite=$cache/containerd/trixie
if [ ! -f .carry/containerd-trixie.VERSIONS ] || ! cmp -s "$suite/VERSIONS" .carry/containerd-trixie.VERSIONS; then
    tar -C "$suite/usr" -cJf .carry/containerd-trixie.tar.xz bin/containerd bin/ctr bin/containerd-shim-runc-v2 sbin/runc
    cp "$suite/VERSIONS" .carry/containerd-trixie.VERSIONS
fi
bash scripts/build-release.sh
RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p gpu-mps-checker --target x86_64-unknown-linux-gnu
# The test kubelet of tests/gpu/schedule.sh.
cargo build --release -p gpu-mps-e2e --bin kubelet-gpu-run
stage=$(mktemp -d)
# target/dist/ holds exactly the binaries of packaging/binaries.txt.
cp target/dist/* "$stage/"
cp target/release/kubelet-gpu-run "$stage/"
cp target/x86_64-unknown-linux-gnu/release/gpu-mps-checker "$stage/"
tar -C "$stage" -cJf .carry/gpu-mps-bin.tar.xz .
rm -rf "$stage"
{
    git rev-parse HEAD
    git status --porcelain | grep -q . && echo "dirty" || echo "clean"
} >.carry/COMMIT
du -sh .carry/*
