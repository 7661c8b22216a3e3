#!/usr/bin/env bash
# The gpu-mps demo: containerd + runc + gpu-mps on this machine, and containers with limits.
#
#   sudo bash demo/run.sh
#
# With an NVIDIA GPU (nvidia-smi, nvidia-cuda-mps-control and nvcc present): real MPS. Without:
# a SIMULATED MPS daemon (tests/support/fake-mps-control, a test double) stands in for
# nvidia-cuda-mps-control, and every line that comes from it says so.
#
# What it shows, under the default policy `exact`:
#   1. two containers asking 4Gi / 25% run at the same time on one GPU, through one MPS daemon
#      that gpu-mps-manager started on demand, each held to 4Gi / 25% by the MPS server;
#   2. a container asking 8Gi / 50% starts while they run, on the SAME server, held to its own
#      8Gi / 50% (each container's /tmp/nvidia-mps is a gate the manager serves);
#   3. once all are gone the idle daemon stops.
# Everything runs privately: its own containerd (Debian 12's, fetched into a cache, not installed),
# its own state under /tmp/gpu-mps-demo and /run/gpu-mps-demo. Nothing is left running.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "demo: run as root (containerd and runc need it): sudo bash demo/run.sh" >&2; exit 1; }

source scripts/ctr-node.sh
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
bash scripts/setup-debian.sh
# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
export GPU_MPS_CACHE=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}
GPU_MPS_SUITES=bookworm bash tests/support/fetch-containerd.sh "$GPU_MPS_CACHE"
SUITE=$GPU_MPS_CACHE/containerd/bookworm

say "building gpu-mps"
cargo build --locked -p gpu-mps-shim -p gpu-mps-hook -p gpu-mps-manager -p gpu-mps-cli -p fake-mps-control
RUSTFLAGS='-C target-feature=+crt-static' cargo build --locked -p gpu-mps-checker --target x86_64-unknown-linux-gnu
B=$PWD/target/debug
CHECKER=$PWD/target/x86_64-unknown-linux-gnu/debug/gpu-mps-checker

W=/tmp/gpu-mps-demo
ROOT=/run/gpu-mps-demo
MGR_PID=""
CTD_PID=""
cleanup() {
    set +e
    for id in $(ctr_ task ls -q 2>/dev/null); do ctr_ task kill -s KILL "$id"; done >/dev/null 2>&1
    sleep 0.5
    [ -n "$MGR_PID" ] && kill "$MGR_PID" 2>/dev/null && wait "$MGR_PID" 2>/dev/null
    quit_mps_daemons "$ROOT" "$CONTROL"
    [ -n "$CTD_PID" ] && kill "$CTD_PID" 2>/dev/null && wait "$CTD_PID" 2>/dev/null
    echo "demo: stopped everything it started; logs in $W"
}
trap cleanup EXIT
rm -rf "$W" "$ROOT"
mkdir -p "$W/rootfs/check"

REAL=false
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && command -v nvidia-cuda-mps-control >/dev/null && command -v nvcc >/dev/null; then
    REAL=true
fi
if $REAL; then
    say "GPU found: REAL MPS (nvidia-cuda-mps-control), GPU $(nvidia-smi --query-gpu=name,uuid --format=csv,noheader | head -n1)"
    CONTROL=nvidia-cuda-mps-control
    GPU=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -n1)
    nvcc -O2 -o "$W/rootfs/check/client" tests/gpu/mps-check.cu
    CLIENT=(/check/client --alloc-mib 3000 --alloc-mib 5000 --hold-seconds 5)
    CLIENT_BIG=(/check/client --alloc-mib 7000 --alloc-mib 9000)
    DEVS=$(nvidia_device_flags)
    MNTS=$(host_userland_flags "$W/rootfs")
    INVENTORY=()
else
    say "no NVIDIA GPU here: SIMULATED MPS daemon (tests/support/fake-mps-control, a test double; no GPU work happens)"
    CONTROL=$B/fake-mps-control
    GPU="GPU-demo0000-0000-0000-0000-000000000000"
    cat >"$W/inventory.json" <<EOF
{"source":"demo","gpus":[{"index":0,"uuid":"$GPU","name":"SIMULATED GPU (no hardware)","memory_bytes":17179869184,"compute_mode":"Default","mig_enabled":false}]}
EOF
    CLIENT=(/check/checker mps-client --hold-seconds 5)
    CLIENT_BIG=(/check/checker mps-client)
    DEVS=""; MNTS=""
    INVENTORY=(--fake-inventory "$W/inventory.json")
fi
cp "$CHECKER" "$W/rootfs/check/checker"
mkdir -p "$W/rootfs"/{proc,sys,dev,tmp,etc}

write_node_config "$W/config.toml" "$ROOT" "$B/gpu-mps-hook" "$SUITE/usr/sbin/runc" "$CONTROL" exact 3
export GPU_MPS_CONFIG=$W/config.toml

say "starting gpu-mps-manager and containerd $("$SUITE/usr/bin/containerd" --version | awk '{print $3}')"
"$B/gpu-mps-manager" "${INVENTORY[@]}" >"$W/manager.log" 2>&1 &
MGR_PID=$!
PATH=$SUITE/usr/sbin:$SUITE/usr/bin:$PATH start_private_containerd "$W" "$SUITE/usr/bin/containerd" "$W/containerd.log" "$GPU_MPS_CONFIG"
for _ in $(seq 100); do [ -S "$ROOT/manager.sock" ] && break; sleep 0.1; done
ctr_() { PATH=$SUITE/usr/sbin:$SUITE/usr/bin:$PATH "$SUITE/usr/bin/ctr" --address "$W/containerd.sock" "$@"; }

# run_limited <name> <memory> <threads> <command...>: a container asking for the GPU, as the
# NVIDIA device plugin would hand it over (NVIDIA_VISIBLE_DEVICES), through gpu-mps-shim.
run_limited() {
    local name=$1 mem=$2 thr=$3; shift 3
    # shellcheck disable=SC2086
    ctr_ run --rm --rootfs --runc-binary "$B/gpu-mps-shim" --env "NVIDIA_VISIBLE_DEVICES=$GPU" \
        --annotation "gpu-mps.io/memory-limit=$mem" --annotation "gpu-mps.io/active-thread-percentage=$thr" \
        $DEVS $MNTS "$W/rootfs" "$name" "$@"
}

say "1. two containers asking 4Gi / 25% at the same time"
run_limited small-a 4Gi 25 "${CLIENT[@]}" >"$W/small-a.out" 2>&1 &
A=$!
run_limited small-b 4Gi 25 "${CLIENT[@]}" >"$W/small-b.out" 2>&1 &
Bp=$!
sleep 2.5
"$B/gpu-mps" status

say "2. a container asking 8Gi / 50% while they run: same server, its own limits"
run_limited big 8Gi 50 "${CLIENT_BIG[@]}" | tail -n1
wait $A $Bp || true
for c in small-a small-b; do echo "$c saw: $(grep -E '^\{' "$W/$c.out" | tail -n1)"; done
$REAL || echo "(threads and mem above are what the SIMULATED MPS server hands each client)"

say "3. once they are gone"
echo "the containers have exited and released their leases; the GPU's daemon idles:"
"$B/gpu-mps" daemons
# The manager stops a daemon without leases after the idle grace period (3 s in this config):
# wait for that, bounded, and say what happened (an empty table would show only its header).
waited=0
until [ "$("$B/gpu-mps" daemons --json | tr -d ' \n')" = "[]" ] || [ $waited -ge 20 ]; do
    sleep 1
    waited=$((waited + 1))
done
if [ "$("$B/gpu-mps" daemons --json | tr -d ' \n')" = "[]" ]; then
    echo "after the idle grace period (3 s; gone within ${waited} s of the check): no MPS daemon runs any more (gpu-mps daemons lists none)"
else
    echo "the daemon still runs ${waited} s later, past the idle grace period (3 s):"
    "$B/gpu-mps" daemons
fi
echo
echo "inside a container: CUDA_MPS_* env, /tmp/nvidia-mps read-only, nvidia-smi masked; see"
echo "  gpu-mps explain <bundle>   and docs/internals.md"
