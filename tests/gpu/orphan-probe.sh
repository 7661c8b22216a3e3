#!/usr/bin/env bash
# What is left when an MPS control daemon dies under its server (issue 8): does the server
# outlive it, how is it found again (its environment names the pipe dir?), does a new daemon on
# the same pipe dir serve clients while the old server runs, and does a client of the old server
# keep running. Seen on the H200 at ee40f89: a server outlived its daemon and was never stopped.
#   bash tests/gpu/orphan-probe.sh   (as root, from the repo root; results under $OUT)
# Never changes compute mode, clocks, MIG or persistence; quits and kills what it starts.
set -u
OUT=${OUT:-/tmp/orphan-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/orphan-probe.log") 2>&1
W=/tmp/gpu-mps-orphan
rm -rf "$W" && mkdir -p "$W/pipe" "$W/log"
export CUDA_MPS_PIPE_DIRECTORY=$W/pipe CUDA_MPS_LOG_DIRECTORY=$W/log
# Anchored at the start of the command line: see lib.sh.
MPS_SERVER_COMMAND='^([^ ]*/)?nvidia-cuda-mps-server( |$)'
ctl() { echo "$1" | timeout 5 nvidia-cuda-mps-control; echo "rc=$?"; }
cleanup() {
    ctl quit >/dev/null 2>&1
    for p in $(pgrep -f "$MPS_SERVER_COMMAND"); do grep -qz "CUDA_MPS_PIPE_DIRECTORY=$W/pipe" "/proc/$p/environ" 2>/dev/null && kill -9 "$p"; done
    pkill -9 -f "$W/mps-check" 2>/dev/null
    pgrep -a nvidia-cuda-mps || echo "no MPS process left"
}
trap cleanup EXIT
nvcc -O2 -o "$W/mps-check" tests/gpu/mps-check.cu || exit 1
nvidia-cuda-mps-control -d; sleep 0.3
D=$(pgrep -xf "nvidia-cuda-mps-control -d" | head -n1)
echo "daemon=$D"; ctl "start_server -uid 0"; sleep 0.5
S=$(ctl get_server_list | head -n1); echo "server=$S"
echo "--- server environ has the pipe dir:"; tr '\0' '\n' <"/proc/$S/environ" | grep CUDA_MPS || echo "no CUDA_MPS vars"
echo "--- server ppid: $(awk '{print $4}' "/proc/$S/stat") comm=$(cat "/proc/$S/comm")"
echo "--- server cmdline: $(tr '\0' ' ' <"/proc/$S/cmdline")"
# a long client of the old server
"$W/mps-check" --busy-seconds 15 --tag old >"$W/old.out" 2>&1 &
OLD=$!
sleep 3
echo "--- kill -9 daemon $D"; kill -9 "$D"; sleep 1
echo "server alive after: $( [ -d "/proc/$S" ] && echo yes || echo no ) ppid=$(awk '{print $4}' "/proc/$S/stat" 2>/dev/null)"
echo "--- new daemon on the same pipe dir"
nvidia-cuda-mps-control -d; sleep 0.3
ctl "start_server -uid 0"; sleep 0.5
echo "servers now: $(ctl get_server_list | tr '\n' ' ')"
timeout 30 "$W/mps-check" --tag new; echo "new client rc=$?"
wait $OLD; echo "old client rc=$? out: $(tail -c 400 "$W/old.out")"
echo "old server alive at end: $( [ -d "/proc/$S" ] && echo yes || echo no )"
