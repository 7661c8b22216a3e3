#!/usr/bin/env bash
# The connect-gate probe (Q7, docs/gpu-results.md section 5): builds mps-check and runs
# tests/gpu/gate-probe.py with one private MPS daemon. Needs no containerd and nothing from .carry/.
#   OUT=<dir> bash tests/gpu/gate-probe.sh     # on the GPU machine, as root, from the repo root
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
W=$(mktemp -d)
nvcc -O2 -o "$W/mps-check" tests/gpu/mps-check.cu || exit 1
timeout 400 python3 tests/gpu/gate-probe.py --check "$W/mps-check" --out "$OUT" 2>&1 | tee "$OUT/gate-probe.log"
pgrep -a nvidia-cuda-mps || echo "no MPS process left"
for p in /run/gate-probe-*/daemon/pipe; do
    [ -S "$p/control" ] && echo quit | CUDA_MPS_PIPE_DIRECTORY=$p nvidia-cuda-mps-control >/dev/null 2>&1
done
rm -rf /run/gate-probe-* "$W"
