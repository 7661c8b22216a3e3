# shellcheck shell=bash # sourced by bash scripts, so no shebang
# Shared by the GPU scripts (run.sh, proof.sh): unpack what .carry/ brought, start a private
# containerd and gpu-mps-manager, run containers through ctr, record results, tear down.
# Sourced after the caller set OUT and opened its log; builds on scripts/ctr-node.sh. Never
# changes compute mode, clocks, MIG or persistence; quits every MPS daemon started under its root on EXIT.
W=/tmp/gpu-mps-gpu
# Per-container outputs and logs go to $D and come back as one archive: the device machine
# returns at most 8 files.
D=$W/out
RESULTS=$OUT/results.tsv
: >"$RESULTS"

source scripts/ctr-node.sh

log() { echo "[$(date +%H:%M:%S)] $*"; }
# An MPS server's command line, anchored at its start: a bare `pgrep -f nvidia-cuda-mps-server`
# also matches any shell whose command line names it (the device machine's own command did, and
# F7 then killed that shell instead of the server).
MPS_SERVER_COMMAND='^([^ ]*/)?nvidia-cuda-mps-server( |$)'

# row <id> <PASS|FAIL|INFO> <what> <measured>
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" | tee -a "$RESULTS"; }
check() { # check <id> <what> <measured> <condition: one shell expression, e.g. '[ "$X" = 1 ] && [ "$Y" = 2 ]'>
    local id=$1 what=$2 measured=$3 cond=$4
    if eval "$cond"; then row "$id" PASS "$what" "$measured"; else row "$id" FAIL "$what" "$measured"; fi
}
jget() { python3 -c "import json,sys; d=json.loads(sys.argv[1]); print(eval(sys.argv[2], {}, {'d': d}))" "$1" "$2" 2>/dev/null; }
last_json() { grep -E '^\{' "$1" | tail -n1; }

cleanup() {
    log "teardown"
    for id in $(ctr_ task ls -q 2>/dev/null); do ctr_ task kill -s KILL "$id" >/dev/null 2>&1; done
    sleep 1
    for id in $(ctr_ containers ls -q 2>/dev/null); do ctr_ task delete -f "$id" >/dev/null 2>&1; ctr_ containers rm "$id" >/dev/null 2>&1; done
    stop_manager
    quit_mps_daemons /run/gpu-mps-test nvidia-cuda-mps-control
    # The gate keeper outlives managers by design (it holds the gates' sockets across restarts).
    pkill -f 'gpu-mps-manager --gate-keeper /run/gpu-mps-test$' 2>/dev/null
    [ -n "${CTD_PID:-}" ] && kill "$CTD_PID" 2>/dev/null && wait "$CTD_PID" 2>/dev/null
    cp /run/gpu-mps-test/daemons/*/log/*.log "$D/" 2>/dev/null
    pgrep -a nvidia-cuda-mps || log "no MPS process left"
    tar -C "$W" -cJf "$OUT/artifacts.tar.xz" out 2>/dev/null
}
trap cleanup EXIT

rm -rf "$W" /run/gpu-mps-test && mkdir -p "$W"/{ctd,bin,rootfs-base/check,out}
log "unpack"
tar -C "$W/ctd" -xJf .carry/containerd-trixie.tar.xz
tar -C "$W/bin" -xJf .carry/gpu-mps-bin.tar.xz
export PATH=$W/ctd/sbin:$W/ctd/bin:$W/bin:$PATH
COMMIT=$(head -n1 .carry/COMMIT 2>/dev/null || echo unknown)
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -n1)
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1)
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)
MODE=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader | head -n1)
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $COMMIT ($(sed -n 2p .carry/COMMIT 2>/dev/null))"
    echo "gpu: $GPU_NAME $UUID, driver $DRIVER, compute mode $MODE"
    echo "containerd: $(containerd --version)"
    echo "runc: $(runc --version | head -n1)"
    echo "kernel: $(uname -r), cgroup: $(stat -fc %T /sys/fs/cgroup)"
} | tee "$OUT/env.txt" "$D/env.txt"

log "build mps-check"
nvcc -O2 -o "$W/rootfs-base/check/mps-check" tests/gpu/mps-check.cu || exit 1
# mps-bench links cuBLAS from the toolkit; the container sees the host's /usr, so an rpath to the
# toolkit's lib dir finds it there too.
CUDA_LIB=$(readlink -f "$(dirname "$(command -v nvcc)")/../lib64")
nvcc -O2 -o "$W/rootfs-base/check/mps-bench" tests/gpu/mps-bench.cu -lcublas -Xlinker -rpath="$CUDA_LIB" ||
    log "mps-bench did not build (only tests/gpu/proof.sh needs it)"
cp "$W/bin/gpu-mps-checker" "$W/rootfs-base/check/checker"
cp tests/gpu/hostile-client.py tests/gpu/relay.py tests/gpu/torch-procs.py "$W/rootfs-base/check/"
SMS_TOTAL=$(jget "$("$W/rootfs-base/check/mps-check" --tag host)" "d['sms']")
log "GPU has $SMS_TOTAL SMs (direct context on the host, before any daemon)"
mkdir -p "$W/rootfs-base"/{proc,sys,dev,tmp,usr,lib,lib64,bin,etc,sbin}

CFG=$W/gpu-mps.toml
start_private_containerd "$W" containerd "$D/containerd.log" "$CFG" || exit 1
ctr_() { ctr --address "$W/containerd.sock" "$@"; }

write_config() { # write_config <policy> [ceiling-mem ceiling-threads]
    write_node_config "$CFG" /run/gpu-mps-test "$W/bin/gpu-mps-hook" "$W/ctd/sbin/runc" nvidia-cuda-mps-control "$1" 4 "${2:-}" "${3:-}"
}
MGR_PID=""
start_manager() { # start_manager <label>
    GPU_MPS_CONFIG=$CFG gpu-mps-manager >"$D/manager-$1.log" 2>&1 &
    MGR_PID=$!
    for _ in $(seq 100); do [ -S /run/gpu-mps-test/manager.sock ] && return 0; sleep 0.1; done
    log "manager did not start"; tail "$D/manager-$1.log"; return 1
}
stop_manager() {
    [ -n "$MGR_PID" ] || return 0
    kill -TERM "$MGR_PID" 2>/dev/null
    wait "$MGR_PID" 2>/dev/null
    MGR_PID=""
}
status_json() { GPU_MPS_CONFIG=$CFG gpu-mps status --json; }

wait_no_daemon() { # the MPS daemon gone (idle stop), so time-slicing runs without MPS
    for _ in $(seq 40); do
        [ "$(jget "$(status_json)" "len(d['daemons'])")" = 0 ] && ! pgrep -f "$MPS_SERVER_COMMAND" >/dev/null && return 0
        sleep 0.25
    done
    log "warning: an MPS daemon is still running"
}

# burst_mixed <label> <runtime> "<mem>:<threads> ..." <mps-bench args...>: one container per
# entry, started together (a shared --start-at), waited for; prints "total_it_s p50_ms p99_ms
# ok_count" (outputs in $D/<label>-<i>.out).
burst_mixed() {
    local label=$1 rt=$2 specs=$3; shift 3
    local at i=0 pids=() s
    at=$(python3 -c 'import time; print(f"{time.time() + 4:.3f}")')
    for s in $specs; do
        i=$((i + 1))
        run_ctr "$label-$i" "$rt" "${s%%:*}" "${s##*:}" -- "$BENCH" "$@" --start-at "$at" --tag "$label-$i" &
        pids+=($!)
    done
    wait "${pids[@]}"
    python3 - "$D" "$label" "$i" <<'EOF'
import json, statistics, sys
d, label, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
for i in range(1, n + 1):
    try:
        rows.append(json.loads([l for l in open(f"{d}/{label}-{i}.out") if l.startswith("{")][-1]))
    except Exception:
        pass
ok = [r for r in rows if r.get("ok")]
p50 = statistics.median(r["p50_ms"] for r in ok) if ok else 0
p99 = max((r["p99_ms"] for r in ok), default=0)
print(f"{sum(r['it_per_s'] for r in ok):.0f} {p50:.3f} {p99:.3f} {len(ok)}")
EOF
}

DEVS=$(nvidia_device_flags)
MNTS=$(host_userland_flags "$W/rootfs-base")
N=0
# run_ctr <name> <runtime: gpu-mps|runc> <mem|-> <threads|-> -- <command...>; output in $OUT/<name>.out
# CTR_ANNOTATIONS="k=v ..." adds annotations, CTR_MOUNTS="<host dir> ..." read-only bind mounts,
# CTR_USER=uid:gid runs the container's process as that user.
run_ctr() {
    local name=$1 rt=$2 mem=$3 thr=$4; shift 5
    N=$((N + 1))
    local rootfs=$W/rootfs-$name
    rm -rf "$rootfs" && cp -a "$W/rootfs-base" "$rootfs"
    local extra=()
    if [ "$rt" = gpu-mps ]; then
        extra+=(--runc-binary "$W/bin/gpu-mps-shim" --env "NVIDIA_VISIBLE_DEVICES=$UUID")
        [ "$mem" != - ] && extra+=(--annotation "gpu-mps.io/memory-limit=$mem")
        [ "$thr" != - ] && extra+=(--annotation "gpu-mps.io/active-thread-percentage=$thr")
    fi
    local a
    [ -n "${CTR_USER:-}" ] && extra+=(--user "$CTR_USER")
    for a in ${CTR_ANNOTATIONS:-}; do extra+=(--annotation "$a"); done
    for a in ${CTR_MOUNTS:-}; do
        mkdir -p "$rootfs$a"
        extra+=(--mount "type=bind,src=$a,dst=$a,options=rbind:ro")
    done
    # shellcheck disable=SC2086
    timeout 120 ctr --address "$W/containerd.sock" run --rm --rootfs $DEVS $MNTS "${extra[@]}" "$rootfs" "$name-$N" "$@" \
        >"$D/$name.out" 2>"$D/$name.err"
}

