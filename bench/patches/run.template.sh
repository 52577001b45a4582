#!/bin/bash
# Device call (bench/patches/README.md): this tree (@NEW@) against main (old/, @OLD@, its own Python and kernels), one
# card. Steps run in the order that decides a landing first, each only if BUDGET (seconds of command time) still holds
# it, with its timeout cut to what is left; every step saves /tmp/r into $OUT/r.tgz, so a cut call keeps what ran.
#   BUDGET >= ~560: steps 1, 3b, 2-4;  ~300: GDN pair, the (V, K) experiment, the GDN tests;  ~180: GDN pair, (V, K).
# Argument: A (default: 1 3b 2 3 4 5: what a landing needs, and the layout experiment second: ~100 s that decide
# issue 37's plan), B (4b 4c 4d 6 7: the open questions, second pairs,
# racecheck; a second call right after A, within the machine's 30 s idle release, starts no new machine), or all.
# V: step 3b alone (a last, short call).
cd "$(dirname "$0")"; ROOT=$PWD
T0=$(date +%s); BUDGET=${BUDGET:-560}
case ${1:-A} in A) STEPS="1 3b 2 3 4 5";; B) STEPS="4b 4c 4d 6 7";; V) STEPS="3b";; N) STEPS="n1 n2";; S) STEPS="s1 s2 s3 s4";; E) STEPS="e1 e2 e3";; SE) STEPS="s1 s2 s3 e1 e2 e3";; S3) STEPS="s1 s2 s3";; SP) STEPS="s1 s2 s3 s5 n3";; R) STEPS="s1 r1 s5";; L) STEPS="s1 s2 s3 r2";; EG) STEPS="e1 e2 e3 g1";; P) STEPS="s1 p1 p2 r2";; RB) STEPS="s1 rb s2 s3";; A16) STEPS="s1 s3 rv s2 g1";; NF) STEPS="nf";;
  all) STEPS="1 3b 2 3 4 4b 4c 4d 5 6 7";; *) echo "part: A, B, V (the layout experiment alone), N (the next measurements, no A/B), S (a KDA A/B: tests, pairs, sanitizers), E (a GDN A/B), SE (both) or all"; exit 2;; esac
FLA=$ROOT/../../third_party/fla_peer  # carry "third_party" (scripts/fetch_peers.py --only fla)
want() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local l=$(( $(left) - $2 )); [ $l -gt $1 ] && l=$1; echo $l; }  # min(want, left - reserve)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl 2>&1 | tail -1
rm -rf /tmp/r; mkdir -p /tmp/r; save() { tar -czf $OUT/r.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > /tmp/r/gpu.txt; cat /tmp/r/gpu.txt
new() { (cd $ROOT && env PYTHONPATH=/tmp/site:$ROOT GIT_COMMIT=@NEW@ TRTLLM_REPLAYSSM_CACHE=/tmp/cache_new "$@"); }
old() { (cd $ROOT/old && env PYTHONPATH=/tmp/site:$ROOT/old GIT_COMMIT=@OLD@ TRTLLM_REPLAYSSM_CACHE=/tmp/cache_old "$@"); }
pair() {  # tag, script, want seconds each, args: old then new, same card, same call
  local t=$(( ($(left) - 10) / 2 )); [ $t -gt $3 ] && t=$3; [ $t -lt 35 ] && { echo "skip $1 ($(left)s)"; return; }
  old timeout $t python3 scripts/$2 "${@:4}" --out /tmp/r --tag $1-old > /tmp/r/$1-old.txt 2>&1; tail -8 /tmp/r/$1-old.txt
  new timeout $t python3 scripts/$2 "${@:4}" --out /tmp/r --tag $1-new > /tmp/r/$1-new.txt 2>&1; tail -8 /tmp/r/$1-new.txt; save; }
san() {  # tool, reserve, want, kernel prefix, test file, -k
  local l=$(cap $3 $2); [ $l -lt 30 ] && { echo "skip $1 $4 ($(left)s)"; return; }
  new timeout $l compute-sanitizer --tool $1 --report-api-errors no --kernel-name kns=$4 python3 -m pytest -q -p no:cacheprovider $5 -k "$6" > /tmp/r/san_$1_$4_$(basename $5 .py).txt 2>&1
  echo "$1 $4 rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" /tmp/r/san_$1_$4_$(basename $5 .py).txt | tail -3; save; }
gputests() {  # tag, want seconds, reserve, test files...: the patched tree's GPU tests in 6 workers
  local tag=$1 l=$(cap $2 $3); shift 3; [ $l -gt 30 ] || { echo "skip $tag ($(left)s)"; return; }
  new timeout $l python3 -m pytest -q -p no:cacheprovider -rfE -n 6 "$@" > /tmp/r/$tag.txt 2>&1; tail -3 /tmp/r/$tag.txt; save; }
if want 1; then
echo "== 1 GDN pair $(left)s left"
pair gdn-usumab1 bench_gdn.py 70 --batches 1,8,32,64,256
fi
if want 3b; then
echo "== 3b the layout experiment (issue 37): KDA conventional on a (V, K) state vs (K, V), same inputs $(left)s left"
if [ $(left) -gt 100 ]; then
  new timeout 80 python3 scripts/bench_kda.py --vk --conv-only --geoms kimi_k3_tp8,glm5_3_flash_tp8 \
    --batches 32,256 --out /tmp/r --tag kda-vk > /tmp/r/kda-vk.txt 2>&1; tail -14 /tmp/r/kda-vk.txt
  TL=$(cap 40 40); [ $TL -gt 20 ] && new timeout $TL python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kda_vk.py -m gpu \
    > /tmp/r/kda-vk-tests.txt 2>&1; tail -3 /tmp/r/kda-vk-tests.txt; save
fi
fi
if want 2; then
echo "== 2 GPU suite $(left)s left"
if [ $(left) -gt 250 ]; then
  TL=$(cap 190 60); new timeout $((TL + 25)) python3 scripts/gpu_suite.py --out /tmp/r/suite --time-limit $TL > /tmp/r/suite.txt 2>&1
  tail -6 /tmp/r/suite.txt; save
else  # too little for the whole suite: the GDN patch's tests
  TL=$(cap 120 40); [ $TL -gt 30 ] && new timeout $TL python3 -m pytest -q -p no:cacheprovider -n 6 -rfE tests/test_gdn_gpu.py \
    tests/test_trt_plugin_gdn_gpu.py > /tmp/r/gdn_tests.txt 2>&1; tail -4 /tmp/r/gdn_tests.txt; save
fi
fi
if want 3; then
echo "== 3 KDA pair $(left)s left"
pair kda-uringab1 bench_kda.py 90 --batches 1,32,256
fi
if want 4; then
echo "== 4 memcheck $(left)s left"
san memcheck 60 70 gdn tests/test_gdn_gpu.py "replay_matches or fp32_flush or strong_decay"
san memcheck 10 70 kda tests/test_kda_gpu.py "kimi_k3_tp8 or glm_shadow or odd_f32 or k256 or fp32_flush"
san memcheck 10 40 kda tests/test_kda_vk.py "odd or kimi_k3_tp8_b40"
fi
if want 4b; then
echo "== 4b the layout question (issue 37): GDN's (V, K) kernels at a Kimi-K3 TP8 KDA layer's bytes $(left)s left"
if [ $(left) -gt 150 ]; then
  new timeout 60 python3 scripts/bench_gdn.py --geom 12:12:128:128 --batches 32,256 --out /tmp/r --tag gdn-at-kimi-bytes > /tmp/r/gdn-kimi.txt 2>&1
  tail -4 /tmp/r/gdn-kimi.txt; save
fi
fi
if want 4c; then
echo "== 4c the wave tail at small batch (issue 40): GDN replay modules at 4 blocks an SM (resident 1024) $(left)s left"
if [ $(left) -gt 130 ]; then
  new timeout 70 python3 scripts/bench_gdn.py --batches 8,16,32,64,128 --replay-shape=-:-:-:1024 --out /tmp/r --tag gdn-r1024 > /tmp/r/gdn-r1024.txt 2>&1
  tail -6 /tmp/r/gdn-r1024.txt; save
fi
fi
if want 4d; then
echo "== 4d the wave tail, KDA (issue 37): GLM-5.3-Flash TP8 replay at 3 and 4 blocks an SM, same process $(left)s left"
if [ $(left) -gt 130 ]; then
  new timeout 80 python3 scripts/bench_kda.py --geoms glm5_3_flash_tp8 --sweep 4:4,4:4:512 --sweep-batches 32,64,256 \
    --sweep-only --out /tmp/r --tag kda-glm-r512 > /tmp/r/kda-glm-r512.txt 2>&1; tail -6 /tmp/r/kda-glm-r512.txt; save
fi
fi
if want 5; then
echo "== 5 gdn state error $(left)s left"
if [ $(left) -gt 120 ]; then
  for sh in none bf16; do old timeout 45 python3 scripts/gdn_state_error.py --shadow $sh --out /tmp/r --tag gdn-state-error-$sh-old 2>&1 | tail -1
  new timeout 45 python3 scripts/gdn_state_error.py --shadow $sh --out /tmp/r --tag gdn-state-error-$sh-new 2>&1 | tail -1; done; save
fi
fi
if want 6; then
echo "== 6 second pairs, every batch $(left)s left"
pair gdn-usumab2 bench_gdn.py 90 --batches 1,2,4,8,16,32,64,128,256
pair kda-uringab2 bench_kda.py 120 --batches 1,8,32,64,128,256
fi
if want 7; then
echo "== 7 racecheck $(left)s left"
san racecheck 40 90 gdn tests/test_gdn_gpu.py "replay_matches or fp32_flush"
san racecheck 10 90 kda tests/test_kda_gpu.py "kimi_k3_tp8 or odd_f32 or fp32_flush"
fi
# ---- N: the next measurements (bench/NOTES.md "Next, after the eighteenth session"): no A/B, main's tree
if want n1; then
echo "== n1 KDA replay launch shapes at small batch, both geometries $(left)s left"
for g in glm5_3_flash_tp8 kimi_k3_tp8; do [ $(left) -gt 60 ] && new timeout 70 python3 scripts/bench_kda.py --geoms $g \
  --sweep 2:1,2:2,2:4 --sweep-batches 1,2,4,8 --sweep-only --out /tmp/r --tag kda-small-shapes-$g > /tmp/r/n1-$g.txt 2>&1
  grep -v RESULT_JSON /tmp/r/n1-$g.txt | tail -13; done; save
fi
if want n2; then
echo "== n2 ncu: GDN bs32 at k = 13, KDA GLM bs1 at k = 13 (SASS source pages with stall samples) $(left)s left"
mkdir -p /tmp/r/ncu
prof() { [ $(left) -gt 60 ] || return; new timeout 60 ncu --clock-control none $NCUX --kernel-name regex:$2 --launch-skip 2 \
  --launch-count 1 --set full -o /tmp/r/ncu/$1 -f python3 scripts/${@:3} > /tmp/r/ncu/$1.log 2>&1
  new ncu -i /tmp/r/ncu/$1.ncu-rep --page source --csv --print-source sass > /tmp/r/ncu/$1.sass.csv 2>&1
  new ncu -i /tmp/r/ncu/$1.ncu-rep --page details > /tmp/r/ncu/$1.txt 2>&1; rm -f /tmp/r/ncu/$1.ncu-rep; save; }
prof gdn-b32-k13 gdn_replay profile_gdn.py --batch 32 --k 13
NCUX="--cache-control none" prof gdn-b32-k13-warm gdn_replay profile_gdn.py --batch 32 --k 13  # the bench's warm L2
NCUX="--cache-control none" prof gdn-b32-k1-warm gdn_replay profile_gdn.py --batch 32 --k 1
prof kda-glm-b1-k13 kda_replay profile_kda.py --geom glm5_3_flash_tp8 --batch 1 --k 13
fi
# ---- S: a KDA change against main (first run for the staged ring, 2026-12-07; STAG names the pairs, SBATCH their batches)
if want s1; then
echo "== s1 KDA GPU tests, patched $(left)s left"
gputests s-tests 100 60 tests/test_kda_gpu.py tests/test_kda_verify_gpu.py tests/test_kda_cache_gpu.py \
  tests/test_kda_trt_plugin_gpu.py
fi
if want s2; then
echo "== s2 KDA pair $(left)s left"
pair ${STAG:-kda-stage}ab1 bench_kda.py 70 --batches ${SBATCH:-1,8,32,256}
fi
if want s3; then
echo "== s3 memcheck and racecheck of the patched step $(left)s left"
san memcheck 60 50 kda tests/test_kda_gpu.py "kimi_k3_tp8 or odd_f32 or glm_shadow or k256 or passes"
san racecheck 10 70 kda tests/test_kda_gpu.py "kimi_k3_tp8 or odd_f32 or glm_shadow or passes or k256"
fi
if want s4; then
echo "== s4 second KDA pair $(left)s left"
pair ${STAG:-kda-stage}ab2 bench_kda.py 70 --batches 1,32,256
fi
if want s5; then
echo "== s5 KDA two passes a block (shadow modules) beside the planned ones, same tree, same call $(left)s left"
for p in 1 2; do [ $(left) -gt 45 ] && new timeout $(cap 80 10) python3 scripts/bench_kda.py --batches ${SPBATCH:-32,64,128,256} \
  --shadow-passes $p --fla-path $([ $p = 1 ] && echo $FLA || echo /none) --out /tmp/r --tag kda-passes$p > /tmp/r/s5-$p.txt 2>&1; grep -v RESULT_JSON /tmp/r/s5-$p.txt | tail -9; done; save
fi
# ---- E: a GDN change against main (first run for the GDN eager step, 2026-12-07)
if want e1; then
echo "== e1 GDN GPU tests, patched $(left)s left"
gputests e-tests 120 60 tests/test_gdn_gpu.py tests/test_gdn_cache_gpu.py
fi
if want e2; then
echo "== e2 GDN pair $(left)s left"
pair ${ETAG:-gdn-eager}ab1 bench_gdn.py 60 --batches 1,2,8,32,256
fi
if want e3; then
echo "== e3 memcheck of the eager step $(left)s left"
san memcheck 10 40 gdn tests/test_gdn_gpu.py "eager or qwen3_next or b1"
fi
# ---- G: GDN replay launch shapes at bs 16-64 (issue 40's wave tail; GSHAPES: LANES:RT:WARPS:RESIDENT each)
if want g1; then
echo "== g1 GDN replay shapes at bs ${GBATCH:-16,32,64} $(left)s left"
for sh in ${GSHAPES:--:-:-:512 -:-:4:512}; do [ $(left) -gt 50 ] && new timeout 60 python3 scripts/bench_gdn.py \
  --batches ${GBATCH:-16,32,64} --replay-shape=$sh --out /tmp/r --tag gdn-shape-$(echo $sh | tr -d ':-') > /tmp/r/g1-$(echo $sh | tr -d ':-').txt 2>&1
  grep -v RESULT_JSON /tmp/r/g1-$(echo $sh | tr -d ':-').txt | tail -5; done; save
fi
# ---- r1: racecheck of the K = 256 KDA cases, this tree and main's (is a hazard new, or was it there before?)
if want r1; then
echo "== r1 racecheck, K = 256 KDA cases, new and old $(left)s left"
for t in new old; do [ $(left) -gt 60 ] && $t timeout $(cap 70 40) compute-sanitizer --tool racecheck --report-api-errors no \
  --kernel-name kns=kda --print-limit 20 python3 -m pytest -q -p no:cacheprovider tests/test_kda_gpu.py -k "k256" -v \
  > /tmp/r/san_racecheck_k256_$t.txt 2>&1; echo "$t rc=$?"; grep -E "RACECHECK SUMMARY|passed|failed|PASSED|Race" /tmp/r/san_racecheck_k256_$t.txt | head -12; done; save
fi
# ---- r2: the same racecheck with source lines (TRTLLM_REPLAYSSM_LINEINFO: NVRTC -lineinfo), this tree
if want r2; then
echo "== r2 racecheck with line info, K = 256 KDA cases $(left)s left"
[ $(left) -gt 50 ] && new env TRTLLM_REPLAYSSM_LINEINFO=1 timeout $(cap 70 5) compute-sanitizer --tool racecheck --report-api-errors no \
  --kernel-name kns=kda --print-limit 12 python3 -m pytest -q -p no:cacheprovider tests/test_kda_gpu.py -k "k256" -v \
  > /tmp/r/san_racecheck_k256_lines.txt 2>&1; grep -E "RACECHECK SUMMARY|passed|Race|access at|kda.cuh|\.cuh:" /tmp/r/san_racecheck_k256_lines.txt | head -30; save
fi
# ---- n3: KDA launch shapes at batch 1-4 with 8 warps (the bs1 flush's u-sum apply is 15 FMAs a state value a lane)
if want n3; then
echo "== n3 KDA replay shapes 2:4 / 2:8 / 4:8 at bs 1-4, both geometries $(left)s left"
for g in glm5_3_flash_tp8 kimi_k3_tp8; do [ $(left) -gt 50 ] && new timeout $(cap 60 5) python3 scripts/bench_kda.py --geoms $g \
  --sweep 2:4,2:8,4:8 --sweep-batches 1,4 --sweep-only --out /tmp/r --tag kda-small-w8-$g > /tmp/r/n3-$g.txt 2>&1
  grep -v RESULT_JSON /tmp/r/n3-$g.txt | tail -7; done; save
fi
# ---- rb: racecheck's hazard report (thread indices) of one K = 256 case, main's tree and this one, with source lines
if want rb; then
echo "== rb racecheck hazard report, k256 reference case, old and new $(left)s left"
for t in old new; do [ $(left) -gt 60 ] && $t env TRTLLM_REPLAYSSM_LINEINFO=1 timeout $(cap 60 40) compute-sanitizer --tool racecheck \
  --racecheck-report hazard --report-api-errors no --kernel-name kns=kda --print-limit 40 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kda_gpu.py -k "against_reference and k256" > /tmp/r/san_racecheck_hazards_$t.txt 2>&1
  echo "$t rc=$?"; grep -E "RACECHECK SUMMARY|passed|failed" /tmp/r/san_racecheck_hazards_$t.txt | tail -2
  grep -E "hazard|thread|Write|Read|kda.cuh" /tmp/r/san_racecheck_hazards_$t.txt | head -16; done; save
fi
# ---- rv: racecheck of the verify module's tests (its flush folds with the same tile)
if want rv; then
echo "== rv racecheck, KDA verify tests $(left)s left"
san racecheck 60 80 kda tests/test_kda_verify_gpu.py ""
fi
# ---- nf: the non-flush steps without the flush path's registers (experiment), against the full module, same tree
if want nf; then
echo "== nf KDA non-flush at the registers it needs alone, bs256 sweeps $(left)s left"
for x in "" "--no-flush-experiment"; do for g in ${NFGEOMS:-kimi_k3_tp8}; do [ $(left) -gt 25 ] && new timeout $(cap 45 3) python3 scripts/bench_kda.py \
  --geoms $g --sweep ${NFSHAPES:-4:4,4:4:512,4:4:640} --sweep-batches 256 --sweep-only --fla-path /none $x --out /tmp/r \
  --tag kda-nf$( [ -n "$x" ] && echo 1 || echo 0)-$g > /tmp/r/nf$( [ -n "$x" ] && echo 1 || echo 0)-$g.txt 2>&1
  grep -v RESULT_JSON /tmp/r/nf$( [ -n "$x" ] && echo 1 || echo 0)-$g.txt | tail -5; save; done; done
fi
# ---- P: KDASpec.prefetch (a later block's bytes toward L2), main's planned rows and this tree's at prefetch 0 / 3 / 6
if want p1; then
echo "== p1 KDA prefetch: main, then this tree at --prefetch ${PFS:-0 3 6}, one process each $(left)s left"
[ $(left) -gt 60 ] && old timeout $(cap 60 20) python3 scripts/bench_kda.py --batches ${PBATCH:-64,128,256} --fla-path /none \
  --out /tmp/r --tag kda-pf-main > /tmp/r/p1-main.txt 2>&1; grep -v RESULT_JSON /tmp/r/p1-main.txt | tail -7
for p in ${PFS:-0 3 6}; do [ $(left) -gt 60 ] && new timeout $(cap 60 20) python3 scripts/bench_kda.py --batches ${PBATCH:-64,128,256} \
  --prefetch $p --fla-path /none --out /tmp/r --tag kda-pf$p > /tmp/r/p1-$p.txt 2>&1; grep -v RESULT_JSON /tmp/r/p1-$p.txt | tail -7; done; save
fi
if want p2; then
echo "== p2 memcheck of the prefetch test $(left)s left"
san memcheck 80 40 kda tests/test_kda_gpu.py "prefetch"
fi
echo "== done $(left)s left"; save
