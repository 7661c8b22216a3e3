#!/usr/bin/env bash
# The shape probe (issue 7, docs/gpu-results.md section 7): builds mps-check and runs
# tests/gpu/shape-probe.py with private MPS daemons. Needs no containerd and nothing from .carry/.
#   OUT=<dir> bash tests/gpu/shape-probe.sh     # on the GPU machine, as root, from the repo root
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
W=$(mktemp -d)
chmod 755 "$W"
nvcc -O2 -o "$W/mps-check" tests/gpu/mps-check.cu || exit 1
chmod 755 "$W/mps-check"
PYTHONUNBUFFERED=1 timeout 500 python3 tests/gpu/shape-probe.py --check "$W/mps-check" --out "$W/out" 2>&1 | tee "$OUT/shape-probe.log"
cp "$W/out/shape-probe.json" "$W/out/shape-traces.json" "$OUT/" 2>/dev/null
tar -C "$W/out" -cJf "$OUT/daemon-logs.tar.xz" . 2>/dev/null
pgrep -a nvidia-cuda-mps || echo "no MPS process left"
for p in /run/shape-probe-*/*/pipe; do
    [ -S "$p/control" ] && echo quit | CUDA_MPS_PIPE_DIRECTORY=$p nvidia-cuda-mps-control >/dev/null 2>&1
done
rm -rf /run/shape-probe-* "$W"
