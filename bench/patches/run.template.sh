#!/bin/bash
# Device call (bench/patches/README.md): this tree (@NEW@) against main (old/, @OLD@, its own Python and kernels), one
# card. Every step saves /tmp/r into $OUT/r.tgz, so a cut call keeps what ran.
cd "$(dirname "$0")"; ROOT=$PWD
T0=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl 2>&1 | tail -1
mkdir -p /tmp/r; save() { tar -czf $OUT/r.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > /tmp/r/gpu.txt; cat /tmp/r/gpu.txt
new() { (cd $ROOT && env PYTHONPATH=/tmp/site:$ROOT GIT_COMMIT=@NEW@ TRTLLM_REPLAYSSM_CACHE=/tmp/cache_new "$@"); }
old() { (cd $ROOT/old && env PYTHONPATH=/tmp/site:$ROOT/old GIT_COMMIT=@OLD@ TRTLLM_REPLAYSSM_CACHE=/tmp/cache_old "$@"); }
B=1,2,4,8,16,32,64,128,256
gdn_pair() {
  old timeout 90 python3 scripts/bench_gdn.py --batches $B --out /tmp/r --tag gdn-usumab$1-old > /tmp/r/g$1o.txt 2>&1; tail -11 /tmp/r/g$1o.txt
  new timeout 90 python3 scripts/bench_gdn.py --batches $B --out /tmp/r --tag gdn-usumab$1-new > /tmp/r/g$1n.txt 2>&1; tail -11 /tmp/r/g$1n.txt; save; }
kda_pair() {
  old timeout 120 python3 scripts/bench_kda.py --out /tmp/r --tag kda-uringab$1-old > /tmp/r/k$1o.txt 2>&1; tail -16 /tmp/r/k$1o.txt
  new timeout 120 python3 scripts/bench_kda.py --out /tmp/r --tag kda-uringab$1-new > /tmp/r/k$1n.txt 2>&1; tail -16 /tmp/r/k$1n.txt; save; }
echo "== 1 gdn pair 1 $(left)s left"; gdn_pair 1
echo "== 2 kda pair 1 $(left)s left"; kda_pair 1
echo "== 3 GPU suite $(left)s left"
new timeout 220 python3 scripts/gpu_suite.py --out /tmp/r/suite --time-limit 190 > /tmp/r/suite.txt 2>&1; tail -6 /tmp/r/suite.txt; save
echo "== 4 gdn state error $(left)s left"
for sh in none bf16; do old timeout 45 python3 scripts/gdn_state_error.py --shadow $sh --out /tmp/r --tag gdn-state-error-$sh-old 2>&1 | tail -1
new timeout 45 python3 scripts/gdn_state_error.py --shadow $sh --out /tmp/r --tag gdn-state-error-$sh-new 2>&1 | tail -1; done; save
san() { L=$(( $(left) - $2 )); [ $L -gt $3 ] && L=$3; [ $L -lt 40 ] && return
  new timeout $L compute-sanitizer --tool $1 --report-api-errors no --kernel-name kns=$4 python3 -m pytest -q -p no:cacheprovider $5 -k "$6" > /tmp/r/san_$1_$4.txt 2>&1
  echo "$1 $4 rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" /tmp/r/san_$1_$4.txt | tail -3; save; }
echo "== 5 memcheck $(left)s left"
san memcheck 200 70 gdn tests/test_gdn_gpu.py "replay_matches or fp32_flush or strong_decay"
san memcheck 150 70 kda tests/test_kda_gpu.py "kimi_k3_tp8 or glm_shadow or odd_f32 or k256 or fp32_flush"
echo "== 6 pair 2 $(left)s left"
[ $(left) -gt 150 ] && gdn_pair 2
[ $(left) -gt 110 ] && kda_pair 2
echo "== 7 racecheck $(left)s left"
san racecheck 40 90 gdn tests/test_gdn_gpu.py "replay_matches or fp32_flush"
san racecheck 20 90 kda tests/test_kda_gpu.py "kimi_k3_tp8 or odd_f32 or fp32_flush"
echo "== done $(left)s left"; save
