#!/usr/bin/env bash
# Schedule by size on the GPU (issue 10, point 8): the test kubelet (tests/e2e, kubelet-gpu-run)
# drives gpu-mps-device-plugin over kubelet's device plugin API, then containerd's CRI with the
# gpu-mps handler, then real MPS. Seven pods of three sizes (8, 16 and 24 units of 1 GiB) are
# placed by units and each is checked against its allocation (SMs, free memory, an allocation
# past the limit refused); then a small PyTorch model runs in all seven at once under the default
# thread cap (2 x the memory share), the fair-share cap, and plain time-slicing (runc).
# First, the memory the MPS server itself takes (the plugin's server_reserve).
#
#   tests/gpu/pack.sh              # here: fill .carry/
#   bash tests/gpu/schedule.sh     # there, as root, from the repo root; results under $OUT
#
# Never changes compute mode, clocks, MIG or persistence; quits every MPS daemon it started.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/schedule.log") 2>&1
source scripts/ctr-node.sh
W=/tmp/gpu-mps-sched
ROOT=/run/gpu-mps-sched
PROBE=$W/mps-probe
MGR_PID=""
log() { echo "[$(date +%H:%M:%S)] $*"; }

# shellcheck disable=SC2317 # not unreachable: it is the EXIT trap set just below
cleanup() {
    log "teardown"
    [ -n "$MGR_PID" ] && kill -TERM "$MGR_PID" 2>/dev/null && wait "$MGR_PID" 2>/dev/null
    quit_mps_daemons "$ROOT" nvidia-cuda-mps-control
    [ -S "$PROBE/control" ] && echo quit | CUDA_MPS_PIPE_DIRECTORY=$PROBE nvidia-cuda-mps-control >/dev/null 2>&1
    pkill -f "gpu-mps-manager --gate-keeper $ROOT$" 2>/dev/null
    pkill -f gpu-mps-device-plugin 2>/dev/null
    sleep 1
    pgrep -a nvidia-cuda-mps || log "no MPS process left"
    cp "$ROOT"/daemons/*/log/*.log "$W/kubelet"/*.log "$OUT/" 2>/dev/null
    tar -C "$OUT" -cJf "$W/logs.tar.xz" . 2>/dev/null && mv "$W/logs.tar.xz" "$OUT/artifacts.tar.xz"
}
trap cleanup EXIT

rm -rf "$W" "$ROOT" && mkdir -p "$W"/{bin,check,kubelet,cache/containerd/trixie/usr} "$PROBE"
log "unpack"
tar -C "$W/cache/containerd/trixie/usr" -xJf .carry/containerd-trixie.tar.xz
cp .carry/containerd-trixie.VERSIONS "$W/cache/containerd/trixie/VERSIONS"
tar -C "$W/bin" -xJf .carry/gpu-mps-bin.tar.xz
cp tests/gpu/slice-model.py "$W/check/"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(head -n1 .carry/COMMIT 2>/dev/null) ($(sed -n 2p .carry/COMMIT 2>/dev/null))"
    echo "gpu: $(nvidia-smi --query-gpu=name,uuid,driver_version,compute_mode,memory.total --format=csv,noheader | head -n1)"
    echo "torch: $(/opt/torch/.venv/bin/python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1)"
} | tee "$OUT/env.txt"

log "the MPS server's own memory: a daemon and its server with no client"
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n1; }
before=$(used)
CUDA_MPS_PIPE_DIRECTORY=$PROBE CUDA_MPS_LOG_DIRECTORY=$PROBE nvidia-cuda-mps-control -d
sleep 1
echo "start_server -uid 0" | CUDA_MPS_PIPE_DIRECTORY=$PROBE nvidia-cuda-mps-control
sleep 3
with_server=$(used)
apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | tr '\n' ';')
echo quit | CUDA_MPS_PIPE_DIRECTORY=$PROBE nvidia-cuda-mps-control
sleep 2
after=$(used)
echo "{\"reserve_probe\": {\"used_before_mib\": $before, \"used_with_idle_server_mib\": $with_server, \"used_after_quit_mib\": $after, \"compute_apps\": \"$apps\"}}" | tee "$OUT/reserve.json"

CFG=$W/gpu-mps.toml
cat >"$CFG" <<TOML
root = "$ROOT"
hook_path = "$W/bin/gpu-mps-hook"
runc_path = "$W/cache/containerd/trixie/usr/sbin/runc"
[limits]
policy = "exact"
[daemon]
control_binary = "nvidia-cuda-mps-control"
# Never change the compute mode of a shared or borrowed GPU (a real node sets it: true).
exclusive_process = false
idle_grace_seconds = 2
[device_plugin]
enabled = true
memory_unit = "1Gi"
server_reserve = "1Gi"
TOML
log "start gpu-mps-manager"
GPU_MPS_CONFIG=$CFG GPU_MPS_LOG=info "$W/bin/gpu-mps-manager" >"$OUT/manager.log" 2>&1 &
MGR_PID=$!
for _ in $(seq 100); do [ -S "$ROOT/manager.sock" ] && break; sleep 0.1; done
[ -S "$ROOT/manager.sock" ] || { log "manager did not start"; tail "$OUT/manager.log"; exit 1; }

log "test kubelet: plugin -> CRI -> MPS"
BIN_DIR=$W/bin GPU_MPS_CACHE=$W/cache GPU_MPS_CONFIG=$CFG KUBELET_DIR=$W/kubelet OUT=$OUT \
    HOST_MOUNTS=/usr,/lib,/lib64,/bin,/sbin,/etc,/opt/torch CHECK_DIR=$W/check \
    PYTHON=/opt/torch/.venv/bin/python3 SECONDS=${SCHEDULE_SECONDS:-10} \
    timeout 300 "$W/bin/kubelet-gpu-run"
rc=$?
log "kubelet-gpu-run exited $rc"
python3 - "$OUT/schedule.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| regime | pod | units | SMs | free MiB | under limit ok | 1 GiB over refused | it/s |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    if "tag" in r:
        over = r.get("over_ok")
        print(f"| {r['regime']} | {r['tag'].split('/')[-1]} | {r['units']} | {r.get('sms')} | {r.get('free_mib')} | {r.get('under_ok', '-')} | {'-' if over is None else (not over)} | {r.get('it_s')} |")
for r in rows:
    if "total_it_s" in r:
        print(f"total {r['regime']}: {r['total_it_s']} it/s, by size {r['by_size']}")
PY
exit $rc
