#!/usr/bin/env bash
# What MPS's client priority (CUDA_MPS_CLIENT_PRIORITY, set by gpu-mps.io/priority) does, on the
# GPU machine, as root, from the repo root:
#   bash tests/gpu/priority-probe.sh        (results: $OUT/priority.jsonl, $OUT/priority.log)
# Under a private MPS daemon (no containerd: the shim's env line is covered by the golden specs),
# two clients run the same bf16 matmul loop at once: both normal, then one below normal, then the
# other; and each alone. Rows: iterations/s of each. Changes nothing of the GPU's settings; quits
# the MPS daemon it starts.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/priority.log") 2>&1
S=/tmp/gpu-mps-priority
J=$OUT/priority.jsonl
: >"$J"
rm -rf "$S" && mkdir -p "$S"/{pipe,log}
log() { echo "[$(date +%H:%M:%S)] $*"; }
quit_daemon() { echo quit | CUDA_MPS_PIPE_DIRECTORY=$S/pipe nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1; pgrep -a nvidia-cuda-mps || log "no MPS process left"; }
trap quit_daemon EXIT
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader
CUDA_LIB=$(readlink -f "$(dirname "$(command -v nvcc)")/../lib64")
nvcc -O2 -o "$S/mps-bench" tests/gpu/mps-bench.cu -lcublas -Xlinker -rpath="$CUDA_LIB" || exit 1
CUDA_MPS_PIPE_DIRECTORY=$S/pipe CUDA_MPS_LOG_DIRECTORY=$S/log nvidia-cuda-mps-control -d || exit 1
export CUDA_MPS_PIPE_DIRECTORY=$S/pipe
N=${N:-4096} SECONDS_EACH=${SECONDS_EACH:-6}
# run_pair <round> <priority of a> <priority of b>: both start at the same second.
run_pair() {
    local round=$1 start=$(($(date +%s) + 3))
    CUDA_MPS_CLIENT_PRIORITY=$2 "$S/mps-bench" matmul --n "$N" --seconds "$SECONDS_EACH" --start-at "$start" --tag "$round/a/p$2" >"$S/a.out" 2>&1 &
    local a=$!
    CUDA_MPS_CLIENT_PRIORITY=$3 "$S/mps-bench" matmul --n "$N" --seconds "$SECONDS_EACH" --start-at "$start" --tag "$round/b/p$3" >"$S/b.out" 2>&1 &
    local b=$!
    wait "$a" "$b"
    for side in a b; do grep -E '^\{' "$S/$side.out" | tail -n1 | tee -a "$J"; grep -vE '^\{' "$S/$side.out" | head -n3; done
}
run_alone() {
    CUDA_MPS_CLIENT_PRIORITY=$1 "$S/mps-bench" matmul --n "$N" --seconds "$SECONDS_EACH" --tag "alone/p$1" 2>&1 | grep -E '^\{' | tail -n1 | tee -a "$J"
}
log "alone"; run_alone 0; run_alone 1
for rep in 1 2; do
    log "pairs, repetition $rep"
    run_pair "r$rep-both-normal" 0 0
    run_pair "r$rep-b-below" 0 1
    run_pair "r$rep-a-below" 1 0
done
echo "== control daemon's view" && echo get_default_client_priority | nvidia-cuda-mps-control
