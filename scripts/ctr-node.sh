# shellcheck shell=bash # sourced by bash scripts, so no shebang
# A private one-node setup for scripts that run containers through gpu-mps with plain ctr:
# demo/run.sh (any Debian machine) and tests/gpu/lib.sh (the GPU machine). Sourced, defines
# functions only. Nothing here changes a GPU's compute mode, clocks, MIG or persistence.

# nvidia_device_flags: `--device` flags for the NVIDIA device nodes this machine has.
nvidia_device_flags() {
    local d flags=""
    for d in /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do
        [ -e "$d" ] && flags="$flags --device $d"
    done
    echo "$flags"
}

# host_userland_flags <rootfs>: `--mount` flags that show the host's userland read-only in a
# container (its CUDA program, libcuda, ld.so). On merged-/usr systems (Ubuntu 24.04) /lib,
# /lib64, /bin and /sbin are symlinks into /usr: the rootfs gets the same symlinks, and only real
# directories are bind-mounted.
host_userland_flags() {
    local rootfs=$1 m flags=""
    for m in /usr /lib /lib64 /bin /sbin /etc; do
        if [ -L "$m" ]; then
            rmdir "$rootfs$m" 2>/dev/null
            ln -sfn "$(readlink "$m")" "$rootfs$m"
        elif [ -d "$m" ]; then
            mkdir -p "$rootfs$m"
            flags="$flags --mount type=bind,src=$m,dst=$m,options=rbind:ro"
        fi
    done
    echo "$flags"
}

# start_private_containerd <dir> <containerd> <log> <gpu-mps config>: containerd with its own
# root, state and socket (<dir>/containerd.sock) under <dir>; GPU_MPS_CONFIG reaches gpu-mps-shim
# through it. Sets CTD_PID. The caller puts runc on PATH first.
start_private_containerd() {
    local dir=$1 containerd=$2 log=$3 gpu_mps_config=$4
    cat >"$dir/containerd.toml" <<EOF
version = 2
root = "$dir/containerd-root"
state = "$dir/containerd-state"
[grpc]
  address = "$dir/containerd.sock"
EOF
    GPU_MPS_CONFIG=$gpu_mps_config "$containerd" --config "$dir/containerd.toml" >"$log" 2>&1 &
    # shellcheck disable=SC2034 # read by the scripts that source this file (their EXIT traps)
    CTD_PID=$!
    for _ in $(seq 100); do
        [ -S "$dir/containerd.sock" ] && return 0
        sleep 0.1
    done
    echo "containerd did not start:" >&2
    tail -n 20 "$log" >&2
    return 1
}

# write_node_config <file> <root> <hook> <runc> <control binary> <policy> <idle grace s>
#                   [<ceiling memory> <ceiling threads>]
# A gpu-mps node config with default limits 4Gi / 25 %, EXCLUSIVE_PROCESS off, and GPUs taken from
# the env (ctr --env NVIDIA_VISIBLE_DEVICES=<gpu>).
write_node_config() {
    local file=$1 root=$2 hook=$3 runc=$4 control=$5 policy=$6 grace=$7 ceil_mem=${8:-} ceil_thr=${9:-}
    {
        echo "root = \"$root\""
        echo "hook_path = \"$hook\""
        echo "runc_path = \"$runc\""
        echo "[limits]"
        echo "policy = \"$policy\""
        echo "default_memory_limit = \"4Gi\""
        echo "default_active_thread_percentage = 25"
        [ -n "$ceil_mem" ] && echo "ceiling_memory_limit = \"$ceil_mem\""
        [ -n "$ceil_thr" ] && echo "ceiling_active_thread_percentage = $ceil_thr"
        echo "[daemon]"
        echo "control_binary = \"$control\""
        echo "# Never change the compute mode of a shared or borrowed GPU (a real node sets it: true)."
        echo "exclusive_process = false"
        echo "idle_grace_seconds = $grace"
        echo "# ctr hands the GPU over as NVIDIA_VISIBLE_DEVICES, as the device plugin's envvar strategy does."
        echo "[gpus]"
        echo "trust_visible_devices_env = true"
    } >"$file"
}

# quit_mps_daemons <root> <control binary>: `quit` every MPS control daemon under <root>, also
# one the manager left behind (a script's EXIT trap calls it).
quit_mps_daemons() {
    local root=$1 control=$2 p
    for p in "$root"/daemons/*/pipe; do
        [ -S "$p/control" ] && echo quit | CUDA_MPS_PIPE_DIRECTORY=$p "$control" >/dev/null 2>&1
    done
    return 0
}
