#!/usr/bin/env bash
# `gpu-mps doctor` on a real GPU node (issue 9, point 4): what it says of the real NVML, driver,
# MPS binaries and GPUs, of a containerd it registered gpu-mps in, and of a manager that is down,
# then up with a CUDA container running through it.
#
#   tests/gpu/pack.sh           # here: fill .carry/
#   bash tests/gpu/doctor.sh    # there, as root, from the repo root; results under $OUT
#
# D1 install-containerd registers gpu-mps in the private containerd's config (checked there
#    with `containerd config dump`).
# D2 the manager down: doctor fails the manager check (exit 1) with a fix, and still reads the
#    real NVML, MPS binaries and GPUs.
# D3 the manager up, a CUDA container running with its lease: no check fails (exit 0); the
#    containerd, runc, nvml, manager, node-config, descriptors and mps-binaries checks pass, and
#    what doctor reports matches nvidia-smi (driver version, GPU count, compute mode).
# D4 the CUDA container ran under MPS with its own limits while doctor looked.
# Never changes compute mode, clocks, MIG or persistence; quits every MPS daemon it started.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/doctor.log") 2>&1
source tests/gpu/lib.sh
CHECK=/check/mps-check
BENCH=/check/mps-bench
export GPU_MPS_LOG=info

write_config exact
CTD_CONFIG=$W/containerd.toml
DROP_IN=$W/conf.d/gpu-mps.toml
doctor() { # doctor <label>: JSON to $OUT/doctor-<label>.json, text to $OUT/doctor-<label>.txt; sets RC and MS
    local args=(--config "$CFG" --containerd-config "$CTD_CONFIG" --drop-in "$DROP_IN"
        --shim "$W/bin/gpu-mps-shim" --containerd "$W/ctd/bin/containerd")
    local t0 t1
    t0=$(date +%s%3N)
    gpu-mps doctor "${args[@]}" --json >"$OUT/doctor-$1.json" 2>"$D/doctor-$1.err"
    RC=$?
    t1=$(date +%s%3N)
    MS=$((t1 - t0))
    gpu-mps doctor "${args[@]}" >"$OUT/doctor-$1.txt" 2>&1
    J=$(cat "$OUT/doctor-$1.json")
}
status_of() { jget "$J" "[c['status'] for c in d['checks'] if c['check'] == '$1'][0]"; }
found_of() { jget "$J" "[c['found'] for c in d['checks'] if c['check'] == '$1'][0]"; }
fix_of() { jget "$J" "[c['fix'] for c in d['checks'] if c['check'] == '$1'][0]"; }
all_rows() { # every check of the last doctor as an INFO row
    local c
    for c in $(jget "$J" "' '.join(c['check'] for c in d['checks'])"); do
        row "$1.$c" INFO "doctor's $c check ($2)" "$(status_of "$c"): $(found_of "$c" | cut -c1-240)"
    done
}

log "D1: install-containerd into the private containerd's config"
# containerd started moments ago: the config must change past doctor's start-time slack (2 s),
# so that doctor can tell a containerd that has not read it yet.
sleep 3
gpu-mps --config "$CFG" install-containerd --containerd-config "$CTD_CONFIG" --drop-in "$DROP_IN" \
    --shim "$W/bin/gpu-mps-shim" --containerd "$W/ctd/bin/containerd" >"$D/install.out" 2>&1
install_rc=$?
dumped=$(containerd --config "$CTD_CONFIG" config dump 2>/dev/null | grep -c "BinaryName = \"$W/bin/gpu-mps-shim\"")
check D1.install "install-containerd registers gpu-mps; containerd's config dump has the shim as BinaryName" \
    "rc=$install_rc, BinaryName lines in the dump: $dumped; $(tail -n2 "$D/install.out" | tr '\n' ' ' | cut -c1-200)" \
    '[ "$install_rc" = 0 ] && [ "${dumped:-0}" -ge 1 ]'

SMI_DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1)
SMI_GPUS=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | wc -l)

log "D2: doctor with the manager down"
doctor down
row D2.time INFO "doctor's wall time, manager down" "$MS ms"
check D2.exit "doctor exits 1 and its manager check fails with a fix when no manager listens" \
    "exit=$RC manager=$(status_of manager): $(found_of manager | cut -c1-160); fix: $(fix_of manager | cut -c1-160)" \
    '[ "$RC" = 1 ] && [ "$(status_of manager)" = FAIL ] && [ -n "$(fix_of manager)" ] && [ "$(fix_of manager)" != None ]'
check D2.nvml "doctor loads the real NVML: the driver version and GPU count nvidia-smi reports" \
    "$(found_of nvml); nvidia-smi: driver $SMI_DRIVER, $SMI_GPUS GPU(s)" \
    '[ "$(status_of nvml)" = PASS ] && found_of nvml | grep -q "driver $SMI_DRIVER, $SMI_GPUS GPU(s)"'
check D2.restart "doctor says the running containerd started before its config changed, and to restart it" \
    "$(status_of containerd): $(found_of containerd | cut -c1-200)" \
    '[ "$(status_of containerd)" = WARN ] && found_of containerd | grep -q "started before"'
check D2.mps "doctor finds the driver's MPS binaries" "$(status_of mps-binaries): $(found_of mps-binaries | cut -c1-200)" \
    '[ "$(status_of mps-binaries)" = PASS ]'
all_rows D2 "manager down"

log "D3: doctor with containerd restarted, the manager up and a CUDA container running"
kill "$CTD_PID" && wait "$CTD_PID" 2>/dev/null
rm -f "$W/containerd.sock"
GPU_MPS_CONFIG=$CFG containerd --config "$CTD_CONFIG" >>"$D/containerd.log" 2>&1 &
CTD_PID=$!
for _ in $(seq 100); do [ -S "$W/containerd.sock" ] && break; sleep 0.1; done
start_manager doctor || exit 1
run_ctr d3-busy gpu-mps 4Gi 25 -- /bin/sh -c "$CHECK --alloc-mib 3300 --alloc-mib 4700 --tag d3-busy; $BENCH busy --seconds 10 --tag d3-busy" &
BUSY=$!
for _ in $(seq 100); do [ "$(jget "$(status_json)" "len(d['leases'])")" = 1 ] && break; sleep 0.1; done
leases=$(jget "$(status_json)" "len(d['leases'])")
doctor up
row D3.time INFO "doctor's wall time, manager up" "$MS ms"
SMI_MODE=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader | head -n1)
failed=$(jget "$J" "[c['check'] for c in d['checks'] if c['status'] == 'FAIL']")
passed=$(jget "$J" "sorted(c['check'] for c in d['checks'] if c['status'] == 'PASS')")
check D3.exit "with the manager up and a lease held, no check fails (exit 0)" \
    "exit=$RC leases=$leases failed=$failed passed=$passed" \
    '[ "$RC" = 0 ] && [ "$failed" = "[]" ] && [ "$leases" = 1 ]'
must_pass=true
for c in containerd runc nvml manager node-config descriptors mps-binaries; do
    # shellcheck disable=SC2034 # read by the condition that check() evaluates
    [ "$(status_of "$c")" = PASS ] || must_pass=false
done
check D3.pass "containerd, runc, nvml, manager, node-config, descriptors and mps-binaries pass" "$passed" '$must_pass'
check D3.mode "doctor's compute mode is nvidia-smi's (the test config leaves the mode alone: exclusive_process = false)" \
    "$(status_of compute-mode): $(found_of compute-mode | cut -c1-200); nvidia-smi: $SMI_MODE" \
    'found_of compute-mode | tr -d _ | grep -qi "$(echo "$SMI_MODE" | tr -d _)"'
all_rows D3 "manager up"
wait "$BUSY"

log "D4: the container doctor looked at ran under MPS with its own limits"
j=$(grep -E '^\{' "$D/d3-busy.out" | grep -m1 '"allocs"')
sms=$(jget "$j" "d.get('sms')")
check D4.held "the CUDA container ran under MPS held to 4Gi / 25 % (first allocation fits, the second does not)" \
    "sms=$sms of $SMS_TOTAL allocs=$(jget "$j" "[a['ok'] for a in d.get('allocs', [])]")" \
    '[ "$(jget "$j" "d[\"allocs\"][0][\"ok\"]")" = True ] && [ "$(jget "$j" "d[\"allocs\"][1][\"ok\"]")" = False ] && [ "${sms:-0}" -ge $((SMS_TOTAL / 4 - 4)) ] && [ "${sms:-0}" -le $((SMS_TOTAL / 4 + 1)) ]'

stop_manager
log "results"
column -t -s $'\t' "$RESULTS" | cut -c1-220
echo "PASS $(grep -c $'\tPASS\t' "$RESULTS") FAIL $(grep -c $'\tFAIL\t' "$RESULTS") INFO $(grep -c $'\tINFO\t' "$RESULTS")"
