#!/usr/bin/env bash
# Issue 25 probe (the slice view), on the GPU machine, as root, from the repo root:
#   bash tests/gpu/slice-view/probe.sh        (results: $OUT/slice.jsonl, $OUT/slice.log)
# Builds a shadow libcuda.so.1 and libnvidia-ml.so.1 (shadow-*.c) that report
# GPU_MPS_SLICE_MEMORY_BYTES as the device's memory and forward the rest to the real driver, then
# asks CUDA and NVML for the memory through every route an application takes (static and shared
# cudart, dlopen of libcuda.so and libcuda.so.1, dlsym, cuGetProcAddress v1 and v2, PyTorch, NVML,
# nvidia-smi, JAX), with the shadow first on the library path, as LD_PRELOAD, bind-mounted over the
# real library's file in a private mount namespace (the real one mounted at a fixed path), and not
# at all, under a
# private MPS daemon with a 4 GiB client limit. Also: kernel launch cost with and without it, and
# what LD_PRELOAD of it costs a process that never uses CUDA. Changes nothing of the GPU's
# settings; quits the MPS daemon it starts.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/slice.log") 2>&1
here=$(cd "$(dirname "$0")" && pwd)
S=/tmp/gpu-mps-slice
J=$OUT/slice.jsonl
: >"$J"
rm -rf "$S" && mkdir -p "$S"/{lib,real,bin,pipe,log}
log() { echo "[$(date +%H:%M:%S)] $*"; }
P=$S/pipe
quit_daemon() { echo quit | CUDA_MPS_PIPE_DIRECTORY=$P nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1; pgrep -a nvidia-cuda-mps || log "no MPS process left"; }
trap quit_daemon EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader
real_lib() { readlink -f "$(ldconfig -p | awk -v n="$1" '$1 == n && /x86-64/ { print $NF; exit }')"; }
cuda=$(real_lib libcuda.so.1) nvml=$(real_lib libnvidia-ml.so.1)
log "real driver: $cuda, real NVML: $nvml"
# A stub without a SONAME at the fixed path makes the linker record that path as the dependency;
# the path then points at the real library.
for pair in "cuda:$cuda:CUDA" "nvidia-ml:$nvml:NVML"; do
    IFS=: read -r name file macro <<<"$pair"
    gcc -shared -o "$S/real/lib$name.so" -x c /dev/null
    gcc -shared -fPIC -O2 "-DREAL_$macro=\"$S/real/lib$name.so\"" -Wl,-soname,"lib$name.so.1" -Wl,--no-as-needed \
        -o "$S/lib/lib$name.so.1" "$here/shadow-$name.c" "$S/real/lib$name.so" -ldl || exit 1
    ln -sf "$file" "$S/real/lib$name.so"
done
ln -s libcuda.so.1 "$S/lib/libcuda.so"
readelf -d "$S/lib/libcuda.so.1" | grep -E 'NEEDED|SONAME'
nvcc -O2 -o "$S/bin/view-static" "$here/view.cu" || exit 1
nvcc -O2 -cudart shared -DROUTE=\"cudart-shared\" -o "$S/bin/view-shared" "$here/view.cu" || exit 1
nvcc -O2 -o "$S/bin/launch" "$here/launch.cu" || exit 1
gcc -O2 -o "$S/bin/dl" "$here/dl.c" -ldl && gcc -O2 -o "$S/bin/nvml" "$here/nvml.c" -ldl || exit 1
gcc -O2 -o "$S/bin/driver" "$here/driver.c" -L"$(dirname "$cuda")" -l:libcuda.so.1 || exit 1
# mount: the layout a container would get with no env at all: the real library bind-mounted at a
# fixed path, the shadow (depending on that path) bind-mounted over the real library's file.
mkdir -p "$S/mnt"
for pair in "cuda:$cuda:CUDA" "nvidia-ml:$nvml:NVML"; do
    IFS=: read -r name file macro <<<"$pair"
    gcc -shared -o "$S/mnt/lib$name.real.so" -x c /dev/null
    gcc -shared -fPIC -O2 "-DREAL_$macro=\"$S/mnt/lib$name.real.so\"" -Wl,-soname,"lib$name.so.1" -Wl,--no-as-needed \
        -o "$S/mnt/lib$name.shadow.so" "$here/shadow-$name.c" "$S/mnt/lib$name.real.so" -ldl || exit 1
done

CUDA_MPS_PIPE_DIRECTORY=$P CUDA_MPS_LOG_DIRECTORY=$S/log nvidia-cuda-mps-control -d || exit 1
export CUDA_MPS_PIPE_DIRECTORY=$P CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G
slice=$((4 << 30))
torch_view='import json, torch
f, t = torch.cuda.mem_get_info()
x = torch.randn(4096, 4096, device="cuda"); s = float((x @ x).sum())
print(json.dumps({"route": "pytorch", "ok": True, "free_mib": f >> 20, "total_mib": t >> 20,
                  "prop_total_mib": torch.cuda.get_device_properties(0).total_memory >> 20, "torch": torch.__version__}))'
py=/opt/torch/.venv/bin/python3
# mode: plain (the real driver), path (shadow first on LD_LIBRARY_PATH), preload (LD_PRELOAD)
in_mode() {
    local mode=$1; shift
    case $mode in
        plain) "$@" ;;
        path) env LD_LIBRARY_PATH=$S/lib GPU_MPS_SLICE_MEMORY_BYTES=$slice "$@" ;;
        preload) env LD_PRELOAD=$S/lib/libcuda.so.1:$S/lib/libnvidia-ml.so.1 GPU_MPS_SLICE_MEMORY_BYTES=$slice "$@" ;;
        mount) GPU_MPS_SLICE_MEMORY_BYTES=$slice unshare -m sh -c '
            mount --bind "$1" "$3/libcuda.real.so" && mount --bind "$3/libcuda.shadow.so" "$1" &&
            mount --bind "$2" "$3/libnvidia-ml.real.so" && mount --bind "$3/libnvidia-ml.shadow.so" "$2" &&
            shift 3 && exec "$@"' sh "$cuda" "$nvml" "$S/mnt" "$@" ;;
    esac
}
record() { # mode, then the command: its JSON lines tagged with the mode
    local mode=$1; shift
    in_mode "$mode" "$@" 2>>"$S/stderr.log" | grep '^{' | sed "s/^{/{\"mode\":\"$mode\",/" | tee -a "$J"
}
jax_view='import json, jax, jax.numpy as jnp
x = jnp.ones((4096, 4096)); s = float((x @ x).sum())
st = jax.devices()[0].memory_stats() or {}
print(json.dumps({"route": "jax", "ok": True, "bytes_limit_mib": st.get("bytes_limit", 0) >> 20, "jax": jax.__version__}))'
for mode in plain path preload mount; do
    log "mode $mode"
    record "$mode" "$S/bin/view-static"
    record "$mode" "$S/bin/view-shared"
    record "$mode" "$S/bin/dl" libcuda.so.1
    record "$mode" "$S/bin/dl" libcuda.so
    record "$mode" "$py" -c "$torch_view"
    record "$mode" "$S/bin/driver"
    record "$mode" "$S/bin/nvml"
    # JAX preallocates 75 % of the total it is told; each failed try is one line on stderr.
    jax_out=$(in_mode "$mode" "$py" -c "$jax_view" 2>"$S/jax-$mode.err" | grep '^{')
    fails=$(grep -ci 'failed to allocate\|out of memory' "$S/jax-$mode.err")
    [ -n "$jax_out" ] || jax_out='{"route":"jax","ok":false}'
    echo "$jax_out" | sed "s/^{/{\"mode\":\"$mode\",\"stderr_allocation_failures\":$fails,/" | tee -a "$J"
    in_mode "$mode" nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader |
        sed "s/^/nvidia-smi $mode: /"
done

log "launch cost: 5 pairs of 200000 empty launches, plain then path"
for _ in 1 2 3 4 5; do
    record plain "$S/bin/launch" 200000
    record path "$S/bin/launch" 200000
done
for _ in 1 2 3; do
    record plain "$S/bin/launch" 200000
    record mount "$S/bin/launch" 200000
done
log "LD_PRELOAD cost to a process that never uses CUDA: 500 runs of /bin/true"
for mode in plain preload plain preload; do
    start=$(date +%s%N)
    for _ in $(seq 500); do in_mode "$mode" /bin/true; done
    echo "{\"mode\":\"$mode\",\"route\":\"true x500\",\"per_run_us\":$(( ($(date +%s%N) - start) / 500000 ))}" | tee -a "$J"
done
tail -n 20 "$S/stderr.log" 2>/dev/null; cp "$S"/jax-*.err "$S/stderr.log" "$OUT/" 2>/dev/null
log "done"
