#!/usr/bin/env bash
# The manager's Prometheus metrics checked with Debian 12's promtool (docs/metrics.md):
#   bash tests/metrics.sh
# Fetches promtool into $GPU_MPS_CACHE (tests/support/fetch-promtool.sh; never installs the
# prometheus package, which would start a server), then runs tests/e2e/tests/metrics.rs with the
# promtool check required: the real gpu-mps-manager with the fake MPS daemon, real Acquires, a
# refusal and a CUDA client through a gate, scraped over HTTP; the values, `promtool check
# metrics`, the Grafana dashboard's metric names, and no port without [metrics] listen.
# Needs the workspace binaries and the static checker built (tests/run.sh builds them first).
set -euo pipefail
cd "$(dirname "$0")/.."
export GPU_MPS_CACHE=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}
GPU_MPS_PROMTOOL=$(bash tests/support/fetch-promtool.sh "$GPU_MPS_CACHE" | tail -n1)
export GPU_MPS_PROMTOOL GPU_MPS_REQUIRE_PROMTOOL=1
cargo test -p gpu-mps-e2e --locked --test metrics -- --nocapture
