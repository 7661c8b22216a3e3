#!/usr/bin/env bash
# Builds the release binaries into target/dist/, the one place packaging takes them from:
#   gpu-mps-shim, gpu-mps-hook   static-pie: they are exec'd on every container start (the shim
#                                on every runc call), and skipping the dynamic loader saves about
#                                0.5 ms per exec (docs/benchmarks.md)
#   gpu-mps-manager, gpu-mps     dynamic: the manager dlopens the driver's libnvidia-ml.so.1,
#                                which a static glibc binary cannot do reliably
#   gpu-mps-device-plugin        dynamic: a long-running kubelet plugin, nothing to gain
set -euo pipefail
cd "$(dirname "$0")/.."
target=x86_64-unknown-linux-gnu
cargo build --release --locked -p gpu-mps-manager -p gpu-mps-cli -p gpu-mps-device-plugin
RUSTFLAGS='-C target-feature=+crt-static' cargo build --release --locked --target "$target" -p gpu-mps-shim -p gpu-mps-hook
mkdir -p target/dist
cp target/release/gpu-mps-manager target/release/gpu-mps target/release/gpu-mps-device-plugin target/dist/
cp "target/$target/release/gpu-mps-shim" "target/$target/release/gpu-mps-hook" target/dist/
ls -la target/dist
