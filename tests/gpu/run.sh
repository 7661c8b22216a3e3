#!/usr/bin/env bash
# The GPU suite: real containerd + runc + gpu-mps + real CUDA containers on a machine with an
# NVIDIA GPU, MPS binaries and nvcc, but no containerd (carried in .carry/, see tests/gpu/pack.sh).
#
#   tests/gpu/pack.sh          # here: fill .carry/
#   bash tests/gpu/run.sh      # there, as root, from the repo root; results under $OUT
#
# What it shows (issue 2, point 7): Q1 through real containers (only the pipe dir), Q2 under
# both policies, uniform and ceiling enforcement, refusal and later start, idle stop, and the
# ctr run overhead of gpu-mps against plain runc. It never changes compute mode, clocks, MIG or
# persistence, and quits every MPS daemon it started (trap on EXIT).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
source tests/gpu/lib.sh

# ---------------------------------------------------------------------------------------
# load <name>: the last JSON line of a container's output into SMS, A0, A1 (first and second
# allocation ok?), OK, INIT and J.
load() {
    J=$(last_json "$D/$1.out")
    SMS=$(jget "$J" "d['sms']"); A0=$(jget "$J" "d['allocs'][0]['ok']"); A1=$(jget "$J" "d['allocs'][1]['ok']")
    OK=$(jget "$J" "d['ok']"); INIT=$(jget "$J" "d['init_s']")
    SEEN="sms=${SMS:-?} alloc0=${A0:-?} alloc1=${A1:-?}"
}
quarter='[ "${SMS:-0}" -ge 30 ] && [ "${SMS:-0}" -le 35 ]'
half='[ "${SMS:-0}" -ge 64 ] && [ "${SMS:-0}" -le 68 ]'

log "E1 (Q1): one container, 4Gi/25%, only the pipe dir injected; private IPC, PID, /dev/shm"
write_config uniform
start_manager uniform || exit 1
run_ctr q1 gpu-mps 4Gi 25 -- /check/mps-check --alloc-mib 3000 --alloc-mib 5000 --tag q1
load q1
check E1.sm "25% container sees a quarter of the SMs (of $SMS_TOTAL)" "$SEEN" "$quarter"
check E1.mem "4Gi limit: 3000 MiB allocates, 5000 MiB fails" "$SEEN" '[ "$A0" = True ] && [ "$A1" = False ]'
run_ctr q1-ns gpu-mps 4Gi 25 -- /check/checker report
J=$(last_json "$D/q1-ns.out")
HOST_IPC=$(readlink /proc/self/ns/ipc)
C_IPC=$(jget "$J" "d['namespaces']['ipc']")
RO=$(jget "$J" "d['mps_pipe_dir']['create_file']")
SMI=$(jget "$J" "sorted(p for p, v in d['nvidia_smi'].items() if v['exists'] and v['masked'])")
UNMASKED=$(jget "$J" "sorted(p for p, v in d['nvidia_smi'].items() if v['exists'] and not v['masked'])")
MARKER=$(jget "$J" "d['dev_shm']['marker']")
check E1.ipc "container IPC namespace is its own" "host=$HOST_IPC container=$C_IPC" '[ -n "$C_IPC" ] && [ "$C_IPC" != "$HOST_IPC" ]'
check E1.ro "/tmp/nvidia-mps is read-only in the container" "create=$RO" '[ "$RO" = EROFS ]'
check E1.smi "nvidia-smi (host /usr is mounted in) is masked" "masked=$SMI unmasked=$UNMASKED" '[ "$SMI" != "[]" ] && [ "$UNMASKED" = "[]" ]'
check E1.shm "/dev/shm is the container's own (its marker is not on the host)" "marker=$MARKER" '[ -n "$MARKER" ] && [ ! -e "$MARKER" ]'

log "E2: two 4Gi/25% containers concurrently; 8Gi/50% refused while they run, starts after"
run_ctr u-a gpu-mps 4Gi 25 -- /check/mps-check --alloc-mib 3000 --alloc-mib 5000 --busy-seconds 6 --tag u-a &
PA=$!
run_ctr u-b gpu-mps 4Gi 25 -- /check/mps-check --alloc-mib 3000 --alloc-mib 5000 --busy-seconds 6 --tag u-b &
PB=$!
sleep 3
S=$(status_json)
LEASES=$(jget "$S" "len(d['leases'])"); DAEMONS=$(jget "$S" "len(d['daemons'])")
check E2.shared "both containers lease the GPU's one daemon" "leases=$LEASES daemons=$DAEMONS" '[ "$LEASES" = 2 ] && [ "$DAEMONS" = 1 ]'
run_ctr u-big-refused gpu-mps 8Gi 50 -- /check/mps-check --tag refused
RC=$?
MSG=$(tr '\n' ' ' <"$D/u-big-refused.err" | grep -o 'gpu-mps: .*' | cut -c1-240)
check E2.refused "8Gi/50% refused while the 4Gi/25% class runs" "rc=$RC $MSG" '[ $RC -ne 0 ] && grep -q "limit class 4Gi/25%" "$D/u-big-refused.err"'
wait $PA $PB
for c in u-a u-b; do
    load $c
    check "E2.$c" "$c held to 4Gi/25% while sharing" "$SEEN launches/s=$(jget "$J" "d['launches_per_s']")" "$quarter"' && [ "$A0" = True ] && [ "$A1" = False ]'
done
run_ctr u-big gpu-mps 8Gi 50 -- /check/mps-check --alloc-mib 7000 --alloc-mib 9000 --tag big
load u-big
check E2.after "8Gi/50% starts once the GPU is free, with its own limits" "$SEEN" "$half"' && [ "$A0" = True ] && [ "$A1" = False ]'

log "E3 (Q2, uniform): a container that raises, unsets or redirects its own MPS env"
run_ctr esc-raise gpu-mps 4Gi 25 -- /usr/bin/env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=64G /check/mps-check --alloc-mib 3000 --alloc-mib 5000 --tag raise
load esc-raise
check E3.raise "env raised to 100%/64G: the server still holds it to 4Gi/25%" "$SEEN" "$quarter"' && [ "$A1" = False ]'
run_ctr esc-unset gpu-mps 4Gi 25 -- /usr/bin/env -u CUDA_MPS_PIPE_DIRECTORY -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -u CUDA_MPS_PINNED_DEVICE_MEM_LIMIT /check/mps-check --alloc-mib 3000 --alloc-mib 5000 --tag unset
load esc-unset
check E3.unset "env unset: the default path /tmp/nvidia-mps still reaches MPS, limits hold" "$SEEN" "$quarter"' && [ "$A1" = False ]'
run_ctr esc-redirect gpu-mps 4Gi 25 -- /usr/bin/env CUDA_MPS_PIPE_DIRECTORY=/tmp/elsewhere /check/mps-check --alloc-mib 3000 --alloc-mib 5000 --tag redirect
load esc-redirect
row E3.redirect INFO "pipe dir pointed elsewhere; compute mode is $MODE (EXCLUSIVE_PROCESS not allowed on this shared GPU)" "$SEEN ok=$OK error=$(jget "$J" "d.get('error','')")"
stop_manager

log "E4: policy ceiling 8Gi/50%: 4Gi/25% and 8Gi/50% together, each with its own limits"
write_config ceiling 8Gi 50
start_manager ceiling || exit 1
run_ctr c-small gpu-mps 4Gi 25 -- /check/mps-check --alloc-mib 3000 --alloc-mib 5000 --busy-seconds 5 --tag c-small &
PA=$!
run_ctr c-big gpu-mps 8Gi 50 -- /check/mps-check --alloc-mib 7000 --alloc-mib 9000 --busy-seconds 5 --tag c-big &
PB=$!
sleep 2.5
S=$(status_json)
LEASES=$(jget "$S" "len(d['leases'])"); DAEMONS=$(jget "$S" "len(d['daemons'])")
check E4.together "both leased at once on one daemon" "leases=$LEASES daemons=$DAEMONS" '[ "$LEASES" = 2 ] && [ "$DAEMONS" = 1 ]'
wait $PA $PB
load c-small
check E4.small "4Gi/25% container under ceiling sees its own limits" "$SEEN" "$quarter"' && [ "$A0" = True ] && [ "$A1" = False ]'
load c-big
check E4.big "8Gi/50% container under ceiling sees its own limits" "$SEEN" "$half"' && [ "$A0" = True ] && [ "$A1" = False ]'

log "E5 (Q2, ceiling): a 4Gi/25% container that raises or unsets its env"
run_ctr cesc-raise gpu-mps 4Gi 25 -- /usr/bin/env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=64G /check/mps-check --alloc-mib 7000 --alloc-mib 9000 --tag craise
load cesc-raise
check E5.raise "env raised: reaches the ceiling 8Gi/50%, never more" "$SEEN" '[ "${SMS:-999}" -le 68 ] && [ "$A1" = False ]'
run_ctr cesc-unset gpu-mps 4Gi 25 -- /usr/bin/env -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -u CUDA_MPS_PINNED_DEVICE_MEM_LIMIT -u CUDA_MPS_PIPE_DIRECTORY /check/mps-check --alloc-mib 7000 --alloc-mib 9000 --tag cunset
load cesc-unset
check E5.unset "env unset: reaches the ceiling, never more" "$SEEN" '[ "${SMS:-999}" -le 68 ] && [ "$A1" = False ]'

log "E6: the idle daemon stops after the grace period (4 s)"
sleep 7
S=$(status_json)
DAEMONS=$(jget "$S" "len(d['daemons'])")
check E6.idle "no daemon left after the grace period" "daemons=$DAEMONS mps processes=$(pgrep -c nvidia-cuda-mps || true)" '[ "$DAEMONS" = 0 ]'

log "E7: ctr run --rm of a trivial container (checker exit 0): gpu-mps (warm daemon) vs plain runc"
write_config ceiling 8Gi 50
sed -i 's/idle_grace_seconds = 4/idle_grace_seconds = 600/' "$CFG"
stop_manager; start_manager bench || exit 1
run_ctr warmup gpu-mps 4Gi 25 -- /check/mps-check --tag warm >/dev/null
: >"$D/bench.tsv"
for i in $(seq 15); do
    for rt in runc gpu-mps; do
        t0=$(date +%s%N)
        run_ctr "bench-$rt" "$rt" 4Gi 25 -- /check/checker exit 0
        t1=$(date +%s%N)
        printf '%s\t%s\n' "$rt" $(((t1 - t0) / 1000)) >>"$D/bench.tsv"
    done
done
MED=$(python3 - "$D/bench.tsv" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
m = {rt: statistics.median(int(us) for r, us in rows if r == rt) for rt in ("runc", "gpu-mps")}
print(f"runc={m['runc']/1000:.1f}ms gpu-mps={m['gpu-mps']/1000:.1f}ms ratio={m['gpu-mps']/m['runc']:.3f}")
EOF
)
row E7.overhead INFO "median ctr run --rm, 15 alternating runs each" "$MED"

log "E8: cold start, CreateContainer-to-first-kernel proxy: ctr run of mps-check (init_s = context create)"
stop_manager; start_manager cold || exit 1
for c in cold warm; do
    t0=$(date +%s%N)
    run_ctr "start-$c" gpu-mps 4Gi 25 -- /check/mps-check --tag "$c"
    t1=$(date +%s%N)
    load "start-$c"
    row "E8.$c" INFO "ctr run total / CUDA init in container ($c daemon)" "total=$(((t1 - t0) / 1000000))ms init=${INIT}s"
done
t0=$(date +%s%N)
run_ctr start-plain runc - - -- /check/mps-check --tag plain
t1=$(date +%s%N)
load start-plain
row E8.plain INFO "ctr run total / CUDA init in container (plain runc, no MPS)" "total=$(((t1 - t0) / 1000000))ms init=${INIT}s"

echo
echo "=== results ($(grep -c PASS "$RESULTS") PASS, $(grep -c FAIL "$RESULTS") FAIL)"
(column -t -s $'\t' "$RESULTS" 2>/dev/null || cat "$RESULTS") | cut -c1-240
