#!/usr/bin/env bash
# The GPU proof (issue 3): throughput against time-slicing (Q5), cold start (Q6), 48 clients on one
# GPU, faults (Q4) and limits under stress, all through real containerd + runc + gpu-mps.
#
#   tests/gpu/pack.sh            # here: fill .carry/
#   bash tests/gpu/proof.sh      # there, as root, from the repo root; results under $OUT
#
# Every figure is a row of $OUT/results.tsv; per-container outputs and logs are in
# $OUT/artifacts.tar.xz. Policy `exact` (Q7) is measured by tests/gpu/exact.sh; this script runs
# under `uniform`, as when its figures were taken.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/proof.log") 2>&1
source tests/gpu/lib.sh
[ -x "$W/rootfs-base/check/mps-bench" ] || { log "mps-bench missing: cannot run the proof"; exit 1; }
BENCH=/check/mps-bench
SECONDS_PER_RUN=${SECONDS_PER_RUN:-4}

# field <container-name> <python expr on d>
field() { jget "$(last_json "$D/$1.out")" "$2"; }
# burst <label> <count> <runc|gpu-mps> <mem> <threads> <mps-bench args...>: <count> containers of
# one size started together; burst_mixed (lib.sh) runs them and prints "total_it_s p50_ms p99_ms
# ok_count".
burst() {
    local label=$1 count=$2 rt=$3 mem=$4 thr=$5; shift 5
    burst_mixed "$label" "$rt" "$(for _ in $(seq "$count"); do printf '%s:%s ' "$mem" "$thr"; done)" "$@"
}

# ---------------------------------------------------------------------------------------
log "P1 (Q5): N small jobs (bf16 matmul 1024, cuBLAS) on one GPU: gpu-mps at 100/N % vs time-slicing"
write_config uniform
start_manager proof || exit 1
for n in 1 2 4 8; do
    pct=$((100 / n))
    mem=$((120 / n))Gi
    wait_no_daemon
    read -r ts_it ts_p50 ts_p99 ts_ok <<<"$(burst "ts$n" "$n" runc - - matmul --n 1024 --seconds "$SECONDS_PER_RUN")"
    read -r solo_it _ _ _ <<<"$(burst "solo$n" 1 gpu-mps "$mem" "$pct" matmul --n 1024 --seconds "$SECONDS_PER_RUN")"
    read -r mps_it mps_p50 mps_p99 mps_ok <<<"$(burst "mps$n" "$n" gpu-mps "$mem" "$pct" matmul --n 1024 --seconds "$SECONDS_PER_RUN")"
    ratio=$(python3 -c "print(f'{$mps_it / max($ts_it, 1):.2f}')")
    ideal=$((n * solo_it))
    of_ideal=$(python3 -c "print(f'{100 * $mps_it / max($ideal, 1):.0f}')")
    row "P1.n$n" INFO "N=$n x matmul 1024: time-slicing vs gpu-mps $pct% (it/s total; p50/p99 ms per iteration)" \
        "ts=$ts_it ($ts_ok ok, p50 $ts_p50, p99 $ts_p99) mps=$mps_it ($mps_ok ok, p50 $mps_p50, p99 $mps_p99) ratio=$ratio ideal=N*solo($solo_it)=$ideal mps/ideal=$of_ideal%"
    [ "$n" = 4 ] && check P1.n4.target "N=4: gpu-mps >= 2x time-slicing and >= 90% of ideal" "ratio=$ratio of_ideal=$of_ideal%" \
        "python3 -c 'import sys; sys.exit(0 if $ratio >= 2 and $of_ideal >= 90 else 1)'"
done
wait_no_daemon
read -r ts_it ts_p50 ts_p99 _ <<<"$(burst big-ts 4 runc - - matmul --n 4096 --seconds "$SECONDS_PER_RUN")"
read -r mps_it mps_p50 mps_p99 _ <<<"$(burst big-mps 4 gpu-mps 30Gi 25 matmul --n 4096 --seconds "$SECONDS_PER_RUN")"
row P1.large INFO "contrast: N=4 x matmul 4096 (a GPU-filling job): time-slicing vs gpu-mps 25%" \
    "ts=$ts_it (p50 $ts_p50, p99 $ts_p99) mps=$mps_it (p50 $mps_p50, p99 $mps_p99)"

log "P2 (Q6): container create to first finished kernel: no daemon, warm daemon, plain runc"
sed -i 's/^idle_grace_seconds = 4$/idle_grace_seconds = 1/' "$CFG"
stop_manager; start_manager cold || exit 1
for rep in 1 2 3 4 5; do
    wait_no_daemon
    t0=$(date +%s%N); run_ctr "cold$rep" gpu-mps 4Gi 25 -- "$BENCH" first-kernel --t0-ns "$t0" --tag cold
done
run_ctr holder gpu-mps 4Gi 25 -- "$BENCH" busy --seconds 30 --tag holder &
HOLDER=$!
sleep 3
for rep in 1 2 3 4 5; do
    t0=$(date +%s%N); run_ctr "warm$rep" gpu-mps 4Gi 25 -- "$BENCH" first-kernel --t0-ns "$t0" --tag warm
done
ctr_ task kill -s KILL "$(ctr_ task ls | awk '$1 ~ /^holder-/ {print $1}')" >/dev/null 2>&1
wait $HOLDER
for rep in 1 2 3 4 5; do
    t0=$(date +%s%N); run_ctr "plain$rep" runc - - -- "$BENCH" first-kernel --t0-ns "$t0" --tag plain
done
read -r cold warm plain <<<"$(python3 - "$D" <<'EOF'
import json, statistics, sys
d = sys.argv[1]
def med(kind):
    xs = []
    for i in range(1, 6):
        try:
            r = json.loads([l for l in open(f"{d}/{kind}{i}.out") if l.startswith("{")][-1])
            if r.get("ok"): xs.append(r["t0_to_kernel_ms"])
        except Exception:
            pass
    return statistics.median(xs) if xs else -1
print(f"{med('cold'):.0f} {med('warm'):.0f} {med('plain'):.0f}")
EOF
)"
row P2.times INFO "create-to-first-kernel, median of 5 (ms)" "no-daemon=$cold warm=$warm plain-runc=$plain"
check P2.cold "on-demand daemon start costs at most 0.5 s more than warm" "cold-warm=$((cold - warm)) ms" '[ $((cold - warm)) -le 500 ]'
check P2.warm "warm gpu-mps costs at most 0.1 s more than plain runc" "warm-plain=$((warm - plain)) ms" '[ $((warm - plain)) -le 100 ]'

log "P3: 48 containers at once, 2Gi / 2% each, fill to the limit and run kernels; a 49th is refused"
sed -i 's/^idle_grace_seconds = 1$/idle_grace_seconds = 4/' "$CFG"
stop_manager; start_manager scale || exit 1
pids=()
for i in $(seq 48); do
    run_ctr "s$i" gpu-mps 2Gi 2 -- "$BENCH" fill --mib 3072 --chunk-mib 128 --seconds 8 --tag "s$i" &
    pids+=($!)
done
sleep 6
LEASES=$(jget "$(status_json)" "len(d['leases'])")
run_ctr s49 gpu-mps 2Gi 2 -- "$BENCH" fill --mib 1024 --tag s49
RC=$?
MSG=$(tr '\n' ' ' <"$D/s49.err" | grep -o 'gpu-mps: .*' | cut -c1-200)
wait "${pids[@]}"
read -r ok maxgot kernels <<<"$(python3 - "$D" <<'EOF'
import json, sys
d = sys.argv[1]
rows = []
for i in range(1, 49):
    try:
        rows.append(json.loads([l for l in open(f"{d}/s{i}.out") if l.startswith("{")][-1]))
    except Exception:
        pass
ok = [r for r in rows if r.get("ok") and r.get("kernels", 0) > 0]
print(len(ok), max((r["got_mib"] for r in rows), default=-1), min((r.get("kernels", 0) for r in rows), default=0))
EOF
)"
check P3.run "48 containers ran kernels at once, none got past 2Gi" "ok=$ok of 48, leases at peak=$LEASES, max allocated=${maxgot} MiB, min kernels=$kernels" \
    '[ "$ok" = 48 ] && [ "$maxgot" -lt 2048 ]'
check P3.49th "the 49th is refused by the manager, not by CUDA" "rc=$RC $MSG" '[ $RC -ne 0 ] && grep -q "already serves 48" "$D/s49.err"'
LAT=$(grep -o 'lease acquired.*elapsed_us=[0-9]*' "$D/manager-scale.log" | grep -o 'elapsed_us=[0-9]*' | cut -d= -f2 |
    python3 -c 'import sys,statistics; x=sorted(int(l) for l in sys.stdin); print(f"n={len(x)} p50={x[len(x)//2]/1000:.2f}ms p99={x[min(len(x)-1,(len(x)*99)//100)]/1000:.2f}ms max={x[-1]/1000:.2f}ms")')
row P3.acquire INFO "manager Acquire latency under the 48-container burst (manager side)" "$LAT"

log "P4 (Q4): faults with 4 busy clients on one server"
stop_manager; start_manager faults || exit 1
fault_case() { # fault_case <label> <action on client 1: kill|fault|delete>
    local label=$1 action=$2 pids=()
    if [ "$action" = fault ]; then
        run_ctr "$label-1" gpu-mps 8Gi 25 -- "$BENCH" fault --after 3 --seconds 12 --tag "$label-1" &
    else
        run_ctr "$label-1" gpu-mps 8Gi 25 -- "$BENCH" busy --seconds 12 --tag "$label-1" &
    fi
    pids+=($!)
    for i in 2 3 4; do
        run_ctr "$label-$i" gpu-mps 8Gi 25 -- "$BENCH" busy --seconds 12 --tag "$label-$i" &
        pids+=($!)
    done
    sleep 4
    local id pid t_event
    id=$(ctr_ task ls | awk -v p="^$label-1-" '$1 ~ p {print $1}')
    pid=$(ctr_ task ls | awk -v p="^$label-1-" '$1 ~ p {print $2}')
    t_event=$(date +%s.%N)
    case $action in
        kill) kill -9 "$pid" ;;
        delete) ctr_ task delete -f "$id" >/dev/null 2>&1 ;;
        fault) ;;
    esac
    # Recovery: how long until a NEW client on the same daemon runs a kernel.
    local rec=-1 t
    for _ in $(seq 40); do
        run_ctr "$label-probe" gpu-mps 8Gi 25 -- "$BENCH" first-kernel --tag probe
        if [ "$(field "$label-probe" "d['ok']")" = True ]; then
            t=$(date +%s.%N); rec=$(python3 -c "print(f'{$t - $t_event:.2f}')"); break
        fi
        sleep 0.25
    done
    wait "${pids[@]}"
    local others
    others=$(for i in 2 3 4; do printf '%s:%s/%s ' "$i" "$(field "$label-$i" "d['ok']")" "$(field "$label-$i" "d['error']")"; done)
    row "P4.$label" INFO "client 1 $action; clients 2-4 (ok/error); new client runs after (s); leases after" \
        "c1=$(field "$label-1" "d.get('error','-')") others=[$others] recovery=${rec}s leases=$(jget "$(status_json)" "len(d['leases'])") faults reported by the manager=$(jget "$(status_json)" "sum(x['faults'] for x in d['daemons'])")"
    echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=/run/gpu-mps-test/daemons/$UUID/pipe nvidia-cuda-mps-control >"$D/$label-servers.txt" 2>&1
}
fault_case kill kill
fault_case delete delete
fault_case fault fault
FAULTS=$(jget "$(status_json)" "sum(x['faults'] for x in d['daemons'])")
check P4.reported "the manager noticed the fatal fault (gpu-mps status)" "faults=$FAULTS" '[ "${FAULTS:-0}" -ge 1 ]'
grep -h "fatal GPU fault" "$D/manager-faults.log" | tail -n 2
grep -iE 'fault|error|exit' /run/gpu-mps-test/daemons/*/log/server.log | tail -n 30 >"$D/faults-server-log.txt"

log "P5: limits under stress (memory per process, chunk sizes, cudaMallocAsync pools)"
run_ctr two-procs gpu-mps 4Gi 25 -- /bin/sh -c "$BENCH fill --mib 3500 --chunk-mib 250 --tag proc-a & $BENCH fill --mib 3500 --chunk-mib 250 --tag proc-b; wait"
GOT=$(grep -E '^\{' "$D/two-procs.out" | python3 -c 'import json,sys; print("+".join(str(json.loads(l)["got_mib"]) for l in sys.stdin))')
row P5.procs INFO "two CUDA processes in one 4Gi container: the limit is per process" "got MiB = $GOT"
for chunk in 32 512 1024; do
    run_ctr "chunk$chunk" gpu-mps 4Gi 25 -- "$BENCH" fill --mib 8192 --chunk-mib "$chunk" --tag "chunk$chunk"
    row "P5.chunk$chunk" INFO "4Gi container fills in $chunk MiB chunks" "got=$(field "chunk$chunk" "d['got_mib']") MiB, then: $(field "chunk$chunk" "d['first_failure']")"
done
run_ctr pool gpu-mps 4Gi 25 -- "$BENCH" async-pool --mib 5000 --tag pool
check P5.pool "cudaMallocAsync of 5000 MiB in a 4Gi container fails" "malloc_async=$(field pool "d['malloc_async']") sync=$(field pool "d['sync']")" \
    '[ "$(field pool "d[\"ok\"]")" = False ]'
run_ctr pool-ok gpu-mps 4Gi 25 -- "$BENCH" async-pool --mib 3000 --tag pool-ok
row P5.pool-ok INFO "cudaMallocAsync of 3000 MiB in a 4Gi container" "ok=$(field pool-ok "d['ok']") $(field pool-ok "d['malloc_async']")"
for n in 1 2 4 8; do
    row "P5.sm$n" INFO "solo matmul 1024 at $((100 / n))% threads (SMs seen; it/s)" "sms=$(field "solo$n-1" "d['sms']") it/s=$(field "solo$n-1" "d['it_per_s']")"
done

echo
echo "=== proof results ($(grep -c PASS "$RESULTS") PASS, $(grep -c FAIL "$RESULTS") FAIL)"
(column -t -s $'\t' "$RESULTS" 2>/dev/null || cat "$RESULTS") | cut -c1-300
