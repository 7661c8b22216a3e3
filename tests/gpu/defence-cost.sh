#!/usr/bin/env bash
# What the gate's defences cost a legitimate container (issue 21): its first CUDA call and the
# ctr run overhead, with this commit's binaries against a baseline commit's, alternated run by
# run on the same GPU and the same warm daemon, in one run.
#
#   tests/gpu/pack.sh                         # here: .carry/ with this commit's binaries
#   BASE=<commit> tests/gpu/pack-base.sh      # here: .carry/gpu-mps-bin-base.tar.xz from BASE
#   bash tests/gpu/defence-cost.sh            # there, as root, from the repo root; rows under $OUT
#
# D1 warm create-to-first-kernel (mps-bench first-kernel, a holder pod keeps the daemon up):
#    median of REPS per build, and the ratio current / base
# D2 ctr run --rm of a trivial GPU container, gpu-mps against plain runc, per build
# Never changes compute mode, clocks, MIG or persistence; quits every MPS daemon it started.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/defence-cost.log") 2>&1
source tests/gpu/lib.sh
REPS=${REPS:-8}
BENCH=/check/mps-bench
[ -f .carry/gpu-mps-bin-base.tar.xz ] || { log "no .carry/gpu-mps-bin-base.tar.xz (tests/gpu/pack-base.sh)"; exit 1; }
mkdir -p "$W/bin-base" "$W/bin-current"
tar -C "$W/bin-base" -xJf .carry/gpu-mps-bin-base.tar.xz
cp -a "$W/bin/." "$W/bin-current/"
BASE_COMMIT=$(cat .carry/BASE-COMMIT 2>/dev/null || echo unknown)
log "current $COMMIT, base $BASE_COMMIT"

use_build() { # use_build <base|current>: the manager and the binaries the shim and hook run
    stop_manager
    pkill -f 'gpu-mps-manager --gate-keeper /run/gpu-mps-test$' 2>/dev/null
    quit_mps_daemons /run/gpu-mps-test nvidia-cuda-mps-control
    cp -f "$W/bin-$1"/gpu-mps* "$W/bin/"
    write_config exact
    sed -i 's/idle_grace_seconds = 4/idle_grace_seconds = 600/' "$CFG"
    # A baseline from before the [gpus] section refuses the unknown key (a typo is refused);
    # it took NVIDIA_VISIBLE_DEVICES as a GPU source anyway.
    [ "$1" = base ] && sed -i '/^\[gpus\]$/,/^trust_visible_devices_env/d' "$CFG"
    start_manager "cost-$1" || exit 1
}
: >"$D/cost.tsv"
for _ in $(seq "$REPS"); do
    for build in base current; do
        use_build "$build"
        run_ctr "holder-$build" gpu-mps 4Gi 25 -- "$BENCH" busy --seconds 60 --tag holder &
        holder=$!
        sleep 3
        t0=$(date +%s%N); run_ctr "first-$build" gpu-mps 4Gi 25 -- "$BENCH" first-kernel --t0-ns "$t0" --tag first
        ms=$(jget "$(last_json "$D/first-$build.out")" "d['t0_to_kernel_ms'] if d.get('ok') else -1")
        t0=$(date +%s%N); run_ctr "trivial-$build" gpu-mps 4Gi 25 -- /check/checker exit 0; t1=$(date +%s%N)
        t2=$(date +%s%N); run_ctr "trivial-runc" runc - - -- /check/checker exit 0; t3=$(date +%s%N)
        printf '%s\t%s\t%s\t%s\n' "$build" "${ms:--1}" $(((t1 - t0) / 1000)) $(((t3 - t2) / 1000)) | tee -a "$D/cost.tsv"
        ctr_ task kill -s KILL "$(ctr_ task ls | awk '$1 ~ /^holder-/ {print $1}')" >/dev/null 2>&1
        wait $holder
    done
done
cp "$D/cost.tsv" "$OUT/cost.tsv"
read -r base_ms cur_ms base_ratio cur_ratio n_ok <<<"$(python3 - "$D/cost.tsv" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
def med(build, col):
    xs = [float(r[col]) for r in rows if r[0] == build and float(r[1]) >= 0]
    return statistics.median(xs) if xs else -1
def ratio(build):
    xs = [float(r[2]) / float(r[3]) for r in rows if r[0] == build]
    return statistics.median(xs) if xs else -1
ok = sum(1 for r in rows if float(r[1]) >= 0)
print(f"{med('base', 1):.1f} {med('current', 1):.1f} {ratio('base'):.3f} {ratio('current'):.3f} {ok}")
EOF
)"
row D1.first-call INFO "warm create-to-first-kernel, median of $REPS alternating runs (ms): base $BASE_COMMIT vs current $COMMIT" \
    "base=$base_ms current=$cur_ms ok_runs=$n_ok"
row D2.overhead INFO "ctr run --rm of a trivial GPU container, gpu-mps / plain runc, median of $REPS per build" \
    "base=$base_ratio current=$cur_ratio"
check D1.within "the defences cost the first CUDA call at most 20 ms (median) over the base" "current-base=$(python3 -c "print(round($cur_ms-$base_ms,1))") ms" \
    "python3 -c 'import sys; sys.exit(0 if $cur_ms - $base_ms <= 20 and $cur_ms > 0 and $base_ms > 0 else 1)'"
echo
(column -t -s $'\t' "$RESULTS" 2>/dev/null || cat "$RESULTS") | cut -c1-400
