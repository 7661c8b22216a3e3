#!/usr/bin/env bash
# Faults 2 and 7 of issue 8 on the real GPU, through real containerd + runc + gpu-mps:
#
#   tests/gpu/pack.sh           # here: fill .carry/
#   bash tests/gpu/faults.sh    # there, as root, from the repo root; results under $OUT
#
# F2 the MPS control daemon is SIGKILLed while a pod's CUDA process runs: how soon the manager
#    replaces it (gpu-mps status), the lease marked, what the running process saw, and a new pod
#    held to its own limits by the new daemon.
# F7 the MPS server is SIGKILLed while a pod's CUDA process runs (policy exact): what the running
#    process saw; new pods of two other sizes each held to their own limits by the new server.
# F7.handshake the server is SIGKILLed while 4 pods of 4 sizes make their first CUDA call: none
#    ever runs past its own limits; pods started after are held to theirs.
# Never changes compute mode, clocks, MIG or persistence; quits every MPS daemon it started.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/faults.log") 2>&1
source tests/gpu/lib.sh
[ -x "$W/rootfs-base/check/mps-bench" ] || { log "mps-bench missing"; exit 1; }
CHECK=/check/mps-check
BENCH=/check/mps-bench
export GPU_MPS_LOG=info
sms_near() { python3 -c "import sys; s,p=int(sys.argv[1]),int(sys.argv[2]); e=$SMS_TOTAL*p/100; sys.exit(0 if e-4<=s<=e+0.5 else 1)" "${1:-0}" "$2"; }
f() { echo "ok=$(jget "$1" "d.get('ok')") sms=$(jget "$1" "d.get('sms')") allocs=$(jget "$1" "[a['ok'] for a in d.get('allocs',[])]") error=$(jget "$1" "d.get('error')")"; }
# held <name> <percent> : its last mps-check line shows its SMs, the first allocation fits, the second does not
held() {
    local j; j=$(last_json "$D/$1.out")
    sms_near "$(jget "$j" "d.get('sms')")" "$2" && [ "$(jget "$j" "d['allocs'][0]['ok']")" = True ] && [ "$(jget "$j" "d['allocs'][1]['ok']")" = False ]
}
# pod <name> <mem> <pct> <ok-mib> <over-mib>: one mps-check in a gpu-mps pod
pod() { run_ctr "$1" gpu-mps "$2" "$3" -- "$CHECK" --alloc-mib "$4" --alloc-mib "$5" --tag "$1"; }
control_pid() { jget "$(status_json)" "d['daemons'][0]['control_pid'] if d['daemons'] else 0"; }
server_pid() { pgrep -f "$MPS_SERVER_COMMAND" | head -n1; }
now_ms() { date +%s%3N; }

write_config exact
# The manager's Prometheus metrics (docs/metrics.md), read at the end of the run.
printf '\n[metrics]\nlisten = "127.0.0.1:9401"\n' >>"$CFG"
start_manager faults || exit 1

log "F2: the control daemon is SIGKILLed under a running CUDA process"
# The container outlives its CUDA process (which MPS ends with its daemon): its lease stays.
run_ctr f2-running gpu-mps 4Gi 25 -- /bin/sh -c "$BENCH busy --seconds 12 --tag f2-running; sleep 8" &
RUNNING=$!
for _ in $(seq 100); do [ -n "$(server_pid)" ] && break; sleep 0.1; done
sleep 2
old=$(control_pid)
t0=$(now_ms)
kill -KILL "$old"
new=$old
for _ in $(seq 100); do
    new=$(control_pid)
    [ "$new" != 0 ] && [ "$new" != "$old" ] && kill -0 "$new" 2>/dev/null && break
    sleep 0.05
done
t1=$(now_ms)
lost=$(jget "$(status_json)" "[l['daemon_lost_unix'] for l in d['leases']]")
# shellcheck disable=SC2034 # read by the condition that check() evaluates
marked=$(jget "$(status_json)" "len(d['leases']) > 0 and all(l['daemon_lost_unix'] > 0 for l in d['leases'])")
check F2.noticed "the manager replaces a SIGKILLed control daemon within 2 s (a lease still uses it)" \
    "old pid $old, new pid $new after $((t1 - t0)) ms; leases' daemon_lost_unix=$lost" \
    '[ "$new" != "$old" ] && [ "$new" != 0 ] && [ $((t1 - t0)) -le 2000 ] && [ "$marked" = True ]'
grep -m1 'MPS control daemon died while containers use it' "$D/manager-faults.log" | cut -c1-300 | sed 's/^/    log: /'
wait "$RUNNING"
row F2.running INFO "what the running CUDA process saw when its daemon was SIGKILLed" "$(last_json "$D/f2-running.out" | cut -c1-300) $(tail -n2 "$D/f2-running.err" | tr '\n' ' ' | cut -c1-200)"
pod f2-new 4Gi 25 3300 4700
check F2.new-pod "a new 4Gi/25 % pod is held to its limits by the new daemon" "$(f "$(last_json "$D/f2-new.out")")" 'held f2-new 25'

log "F7: the MPS server is SIGKILLed under a running CUDA process"
run_ctr f7-running gpu-mps 4Gi 25 -- "$BENCH" busy --seconds 12 --tag f7-running &
RUNNING=$!
for _ in $(seq 100); do [ -n "$(server_pid)" ] && break; sleep 0.1; done
sleep 2
srv=$(server_pid)
daemon_before=$(control_pid)
kill -KILL "$srv"
wait "$RUNNING"
row F7.running INFO "what the running CUDA process saw when its server was SIGKILLed" "$(last_json "$D/f7-running.out" | cut -c1-300) $(tail -n2 "$D/f7-running.err" | tr '\n' ' ' | cut -c1-200)"
pod f7-new-8 8Gi 50 7400 8800
pod f7-new-2 2Gi 12 1300 2700
new_srv=$(server_pid)
check F7.new-pods "after the server was killed, pods of 8Gi/50 % and 2Gi/12 % are each held to their own limits by a new server" \
    "server $srv -> ${new_srv:-none}, daemon $daemon_before -> $(control_pid); 8Gi: $(f "$(last_json "$D/f7-new-8.out")"); 2Gi: $(f "$(last_json "$D/f7-new-2.out")")" \
    'held f7-new-8 50 && held f7-new-2 12 && [ "${new_srv:-x}" != "$srv" ]'

log "F7.handshake: the server is SIGKILLed while 4 pods make their first CUDA call"
pids=()
i=0
for spec in 2Gi:12:1300:2700 4Gi:25:3300:4700 6Gi:25:5300:6700 8Gi:50:7400:8800; do
    i=$((i + 1))
    IFS=: read -r mem pct okm overm <<<"$spec"
    pod "f7h-$i" "$mem" "$pct" "$okm" "$overm" &
    pids+=($!)
done
# Each pod's create takes about a second; its first CUDA call follows at once.
sleep 1.2
srv=$(server_pid)
[ -n "$srv" ] && kill -KILL "$srv"
wait "${pids[@]}"
escaped=0; held_n=0; failed=0; detail=""
i=0
for spec in 2Gi:12 4Gi:25 6Gi:25 8Gi:50; do
    i=$((i + 1))
    pct=${spec##*:}
    j=$(last_json "$D/f7h-$i.out")
    if [ "$(jget "$j" "d.get('ok')")" = True ]; then
        if held "f7h-$i" "$pct"; then held_n=$((held_n + 1)); else escaped=$((escaped + 1)); fi
    else
        failed=$((failed + 1))
    fi
    detail="$detail ${spec}: $(f "$j" | cut -c1-120);"
done
check F7.handshake "server SIGKILLed (pid ${srv:-none}) during 4 pods' first CUDA call: every pod that ran was held to its own limits" \
    "held=$held_n failed_cleanly=$failed escaped=$escaped;$detail" '[ "$escaped" = 0 ]'
pod f7h-after-6 6Gi 25 5300 6700
pod f7h-after-2 2Gi 12 1300 2700
check F7.handshake.after "afterwards 6Gi/25 % and 2Gi/12 % pods are each held to their own limits" \
    "6Gi: $(f "$(last_json "$D/f7h-after-6.out")"); 2Gi: $(f "$(last_json "$D/f7h-after-2.out")")" \
    'held f7h-after-6 25 && held f7h-after-2 12'
row F.sets INFO "limit settings by the daemon's owner in this run" "$(grep -c 'server limits set and read back' "$D/manager-faults.log")"

log "metrics: /metrics of the manager that went through these faults, against NVML and gpu-mps status"
python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9401/metrics", timeout=5).read().decode())' >"$D/metrics.txt" 2>"$D/metrics.err"
metric() { # metric <name>{<labels regex>}: the first sample's value, or "none"
    awk -v re="^$1 " '$0 ~ re { print $NF; found = 1; exit } END { if (!found) print "none" }' "$D/metrics.txt"
}
nvml_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
mem=$(metric 'gpu_mps_gpu_memory_bytes[{][^}]*[}]')
restarted=$(metric 'gpu_mps_daemon_starts_total[{][^}]*how="restarted"[^}]*[}]')
started=$(metric 'gpu_mps_daemon_starts_total[{][^}]*how="started"[^}]*[}]')
leases_metric=$(awk '/^gpu_mps_leases[{]/ { n += $NF } END { print n + 0 }' "$D/metrics.txt")
leases_status=$(jget "$(status_json)" "len(d['leases'])")
acquired=$(metric 'gpu_mps_acquire_duration_seconds_count[{][^}]*outcome="acquired"[^}]*[}]')
check M.families "the manager serves its metrics on the GPU: memory from NVML, the F2 restart, leases as status" \
    "gpu_memory_bytes=$mem (nvidia-smi ${nvml_mib} MiB) daemon_starts started=$started restarted=$restarted leases=$leases_metric (status $leases_status) acquires=$acquired; $(grep -c '^gpu_mps_' "$D/metrics.txt") samples" \
    '[ "$mem" != none ] && python3 -c "import sys; sys.exit(0 if abs(float(\"$mem\") / 2**20 - $nvml_mib) <= 1 else 1)" && [ "${restarted%.*}" -ge 1 ] 2>/dev/null && [ "$leases_metric" = "$leases_status" ]'

log "summary"
cut -c1-250 "$RESULTS"
grep -q $'\tFAIL\t' "$RESULTS" && exit 1
exit 0
