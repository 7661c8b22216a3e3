#!/usr/bin/env bash
# One-shot probe of the GPU machine, run once before building on assumptions:
#  1. what the machine is (driver, compute mode, cgroups, overlayfs, device nodes, libraries);
#  2. the exact stdout and exit code of every nvidia-cuda-mps-control command the manager uses
#     (the fake control daemon for CI copies these formats);
#  3. whether Debian's containerd + runc (carried in .carry/) run a CUDA client in a container
#     that gets only the pipe dir, read-only, at /tmp/nvidia-mps.
# It never changes compute mode, clocks, MIG or persistence, and quits every daemon it starts.
set -u
OUT=${OUT:-/tmp/probe-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/probe.log") 2>&1
W=/tmp/gpu-mps-probe
rm -rf "$W" && mkdir -p "$W"
section() { echo; echo "=== $*"; }

section machine
uname -a; head -2 /etc/os-release
nvidia-smi --query-gpu=index,uuid,name,memory.total,compute_mode,persistence_mode,mig.mode.current,driver_version --format=csv
mount | grep -E 'cgroup' ; grep -E 'overlay' /proc/filesystems
ls -la /dev/nvidia* 2>&1
ldconfig -p | grep -E 'libcuda\.so|libnvidia-ml\.so' ; command -v nvidia-cuda-mps-control nvidia-cuda-mps-server nvcc
nvcc --version | tail -2
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -n1)

section build
nvcc -O2 -o "$W/mps-check" tests/gpu/mps-check.cu && echo built

section mps-control-formats
P=$W/mps/pipe; L=$W/mps/log; mkdir -p "$P" "$L"
chmod 755 "$W" "$W/mps" "$P"
quit_daemon() { echo quit | CUDA_MPS_PIPE_DIRECTORY=$P nvidia-cuda-mps-control >/dev/null 2>&1; }
cleanup() {
    quit_daemon
    [ -n "${CTD_PID:-}" ] && kill "$CTD_PID" 2>/dev/null
    sleep 1
}
trap cleanup EXIT
ctl() {
    local out rc
    out=$(echo "$1" | CUDA_MPS_PIPE_DIRECTORY=$P nvidia-cuda-mps-control 2>&1); rc=$?
    printf 'CMD [%s] rc=%s OUT [%s]\n' "$1" "$rc" "$(echo "$out" | sed ':a;N;$!ba;s/\n/\\n/g')"
}
ctl "get_server_list"   # before a daemon: expect non-zero
CUDA_VISIBLE_DEVICES=$UUID CUDA_MPS_PIPE_DIRECTORY=$P CUDA_MPS_LOG_DIRECTORY=$L nvidia-cuda-mps-control -d -M; echo "daemon start rc=$?"
sleep 0.5
ls -la "$P"
for c in "get_server_list" "get_default_active_thread_percentage" "set_default_active_thread_percentage 25" \
    "get_default_active_thread_percentage" "set_default_device_pinned_mem_limit 0 4096M" \
    "get_default_device_pinned_mem_limit 0" "set_default_device_pinned_mem_limit 0 4G" \
    "get_default_device_pinned_mem_limit 0" "set_default_device_pinned_mem_limit 7 4G" "get_default_device_pinned_mem_limit 7" \
    "set_default_active_thread_percentage 250" "get_default_active_thread_percentage" "set_default_active_thread_percentage 25" \
    "bogus_command" "set_active_thread_percentage 99999 30" "get_active_thread_percentage 99999" "get_device_client_list" ; do
    ctl "$c"
done
section client-through-default-limits
CUDA_MPS_PIPE_DIRECTORY=$P "$W/mps-check" --alloc-mib 3000 --alloc-mib 5000 --hold-seconds 6 --tag direct &
C1=$!
sleep 3
ctl "get_server_list"
SRV=$(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$P nvidia-cuda-mps-control | head -n1)
for c in "get_client_list $SRV" "get_active_thread_percentage $SRV" "get_device_pinned_mem_limit $SRV 0" \
    "set_active_thread_percentage $SRV 50" "get_active_thread_percentage $SRV" \
    "set_device_pinned_mem_limit $SRV 0 8192M" "get_device_pinned_mem_limit $SRV 0" "get_device_client_list" "get_device_client_list $SRV"; do
    ctl "$c"
done
CUDA_MPS_PIPE_DIRECTORY=$P "$W/mps-check" --alloc-mib 7000 --alloc-mib 9000 --tag after-server-set-50-8g
# env tries to raise: server limits must hold
CUDA_MPS_PIPE_DIRECTORY=$P CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=64G "$W/mps-check" --alloc-mib 9000 --tag env-raise
wait $C1
sleep 1
ctl "get_server_list"
ls -la "$P" "$L"; tail -n 20 "$L/control.log"

section containerd
mkdir -p "$W/ctd/bin" && tar -C "$W/ctd/bin" -xJf .carry/containerd-trixie.tar.xz --strip-components=1 && ls "$W/ctd/bin"
export PATH=$W/ctd/bin:$PATH
cat .carry/containerd-trixie.VERSIONS; echo
"$W/ctd/bin/containerd" --version; "$W/ctd/bin/runc" --version | head -n1
cat >"$W/ctd/config.toml" <<EOF
version = 2
root = "$W/ctd/root"
state = "$W/ctd/state"
[grpc]
  address = "$W/ctd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  disable_apparmor = true
EOF
"$W/ctd/bin/containerd" --config "$W/ctd/config.toml" >"$W/ctd/containerd.log" 2>&1 &
CTD_PID=$!
for _ in $(seq 50); do [ -S "$W/ctd/containerd.sock" ] && break; sleep 0.1; done
CTR="ctr --address $W/ctd/containerd.sock"
$CTR version
R=$W/rootfs; mkdir -p "$R"/{proc,sys,dev,tmp,usr,lib,lib64,bin,etc,check}
cp "$W/mps-check" "$R/check/"
DEVS=""; for d in /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do [ -e $d ] && DEVS="$DEVS --device $d"; done
MNTS=""; for m in /usr /lib /lib64 /bin /etc; do [ -e $m ] && MNTS="$MNTS --mount type=bind,src=$m,dst=$m,options=rbind:ro"; done
set -x
# shellcheck disable=SC2086 # $CTR, $DEVS and $MNTS are a command and flag lists, split on purpose
timeout 60 $CTR run --rm --rootfs $DEVS $MNTS --mount "type=bind,src=$P,dst=/tmp/nvidia-mps,options=rbind:ro" \
    "$R" probe1 /check/mps-check --alloc-mib 7000 --alloc-mib 9000 --tag in-container
echo "ctr rc=$?"
# shellcheck disable=SC2086 # $CTR, $DEVS and $MNTS are a command and flag lists, split on purpose
timeout 60 $CTR run --rm --rootfs $DEVS $MNTS "$R" probe2 /check/mps-check --tag in-container-no-pipe
echo "ctr rc=$?"
set +x
tail -n 30 "$W/ctd/containerd.log"
section "done"
