#!/bin/bash
# Device call (bench/patches/README.md): this tree (@NEW@) against main (old/, @OLD@, its own Python and kernels), one
# card. Steps run in this file's order, each only if BUDGET (seconds of command time) still holds it,
# with its timeout cut to what is left; every step saves /tmp/r into $OUT/r.tgz, so a cut call keeps what ran.
# Parts: S (a KDA change: its GPU tests, a pair, memcheck / racecheck, a second pair), S3 (S without the second pair),
# SP (S3 and the two-pass rows beside the planned ones, s5),
# E (a GDN change: tests, pair, memcheck), SE (both), A16 (S3 with the verify tests' racecheck and a GDN shape sweep),
# G (GDN launch shapes alone), SW (a KDA launch-shape sweep), SSW (S3 and the sweep),
# PF (ncu of the KDA shadow flush and k = 1 at Kimi-K3 TP8 bs256),
# RO (the flush-first row order: the patched tree's whole GPU suite, sanitizers of the order tests, the mixed / ff /
# ord columns of bench_kda, bench_gdn and bench_kernels (Mamba-2)); RO2 (RO's benchmarks alone, on the warm machine);
# ROS (RO for a short budget: the order's GPU tests instead of the whole suite, then the benchmarks, then sanitizers),
# OL (the longest-first order patch: the order's GPU tests and the order kernel's sanitizers on the patched tree, then
# main's and the patch's benchmarks in one call: the ord columns, Mamba-2, KDA, GDN), OC (the row-order modules'
# lockstep cycle at small batch, --ordered-cycle of bench_kda and bench_gdn: the order made once a step, then LS),
# LS (the KDA and GDN steps at ring lengths LSL (default 4 8) and batches LSBATCH (default 1,8,32): where a short ring
# pays at small batch), CB (main's tree: the KDA persistent streams, KDASpec.bulk: their GPU tests, memcheck and
# racecheck, bench_kda --conv-only --conv-bulk CBSHAPES at CBBATCH over the TP8 and TP1 geometries, then CR), CR
# (bench_kda --replay-bulk CRSHAPES at CRBATCH, TP8: the non-flush replay stream beside the planned cycle), SCB (the
# whole GPU suite of this tree, r1, then CB without CR).
# RO's environment: ROSAN=1 (also the KDA and GDN row-order sanitizers), ROKDA / ROGDN / ROKERNELS (the benchmarks'
# batches / bench_kernels' arguments).
# Environment: STAG / SBATCH (the KDA pair's tag and batches), ETAG (the GDN pair's tag), GSHAPES / GBATCH (g1),
# SPBATCH (s5), SWGEOMS / SWSHAPES / SWBATCH (sw), PFK (pf's positions), RBK (rb's pytest -k).
cd "$(dirname "$0")"; ROOT=$PWD
T0=$(date +%s); BUDGET=${BUDGET:-560}
case ${1:-S} in S) STEPS="s1 s2 s3 s4";; S3) STEPS="s1 s2 s3";; E) STEPS="e1 e2 e3";; SE) STEPS="s1 s2 s3 e1 e2 e3";;
  SP) STEPS="s1 s2 s3 s5";; A16) STEPS="s1 s3 rv s2 g1";; G) STEPS="g1";; SW) STEPS="sw";; SSW) STEPS="s1 s2 s3 sw";; PF) STEPS="pf";; RB) STEPS="rb";;
  RO) STEPS="r1 r3 r2";; RO2) STEPS="r2";; ROS) STEPS="rs r2 r3";; OL) STEPS="ol1 ol2";; OC) STEPS="oc ls";; LS) STEPS="ls";; CB) STEPS="cb cr";; SCB) STEPS="r1 cb";; CR) STEPS="cr";;
  *) echo "part: S, S3, SP, E, SE, A16, G, SW, SSW, PF, RB, RO, RO2, ROS, OL, OC, LS, CB, SCB or CR (see the head of this file)"; exit 2;; esac
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
# ---- S: a KDA change against main (STAG names the pairs, SBATCH their batches)
if want s1; then
echo "== s1 KDA GPU tests, patched $(left)s left"
gputests s-tests 100 60 tests/test_kda_gpu.py tests/test_kda_verify_gpu.py tests/test_kda_cache_gpu.py \
  tests/test_kda_trt_plugin_gpu.py
fi
if want s2; then
echo "== s2 KDA pair $(left)s left"
pair ${STAG:-kda}ab1 bench_kda.py 70 --batches ${SBATCH:-1,8,32,256}
fi
if want s3; then
echo "== s3 memcheck and racecheck of the patched step $(left)s left"
san memcheck 60 50 kda tests/test_kda_gpu.py "kimi_k3_tp8 or odd_f32 or glm_shadow or k256 or passes"
san racecheck 10 70 kda tests/test_kda_gpu.py "kimi_k3_tp8 or odd_f32 or glm_shadow or passes or k256"
fi
if want s4; then
echo "== s4 second KDA pair $(left)s left"
pair ${STAG:-kda}ab2 bench_kda.py 70 --batches 1,32,256
fi
if want s5; then
echo "== s5 KDA two passes a block (shadow modules) beside the planned ones, same tree, same call $(left)s left"
for p in 1 2; do [ $(left) -gt 45 ] && new timeout $(cap 80 10) python3 scripts/bench_kda.py --batches ${SPBATCH:-32,64,128,256} \
  --shadow-passes $p --fla-path $([ $p = 1 ] && echo $FLA || echo /none) --out /tmp/r --tag kda-passes$p > /tmp/r/s5-$p.txt 2>&1; grep -v RESULT_JSON /tmp/r/s5-$p.txt | tail -9; done; save
fi
# ---- E: a GDN change against main (ETAG names the pair)
if want e1; then
echo "== e1 GDN GPU tests, patched $(left)s left"
gputests e-tests 120 60 tests/test_gdn_gpu.py tests/test_gdn_cache_gpu.py
fi
if want e2; then
echo "== e2 GDN pair $(left)s left"
pair ${ETAG:-gdn}ab1 bench_gdn.py 60 --batches 1,2,8,32,256
fi
if want e3; then
echo "== e3 memcheck of the GDN step $(left)s left"
san memcheck 10 40 gdn tests/test_gdn_gpu.py "qwen3_next or b1"
fi
# ---- G: GDN replay launch shapes (GSHAPES: LANES:RT:WARPS[:RESIDENT] each, - the planner's; GBATCH the batches)
if want g1; then
echo "== g1 GDN replay shapes at bs ${GBATCH:-16,32,64} $(left)s left"
for sh in ${GSHAPES:--:-:-:512 -:-:4:512}; do [ $(left) -gt 50 ] && new timeout 60 python3 scripts/bench_gdn.py \
  --batches ${GBATCH:-16,32,64} --replay-shape=$sh --out /tmp/r --tag gdn-shape-$(echo $sh | tr -d ':-') > /tmp/r/g1-$(echo $sh | tr -d ':-').txt 2>&1
  grep -v RESULT_JSON /tmp/r/g1-$(echo $sh | tr -d ':-').txt | tail -5; done; save
fi
# ---- rb: racecheck's hazard report (both threads of each report, source lines) of the KDA tests -k RBK, old and new
if want rb; then
echo "== rb racecheck hazard report, KDA tests -k '${RBK:-against_reference and k256}', old and new $(left)s left"
for t in old new; do [ $(left) -gt 60 ] && $t env TRTLLM_REPLAYSSM_LINEINFO=1 timeout $(cap 60 40) compute-sanitizer --tool racecheck \
  --racecheck-report hazard --report-api-errors no --kernel-name kns=kda --print-limit 40 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kda_gpu.py -k "${RBK:-against_reference and k256}" > /tmp/r/san_racecheck_hazards_$t.txt 2>&1
  echo "$t rc=$?"; grep -E "RACECHECK SUMMARY|passed|failed" /tmp/r/san_racecheck_hazards_$t.txt | tail -2
  grep -E "hazard|thread|Write|Read|kda.cuh" /tmp/r/san_racecheck_hazards_$t.txt | head -16; done; save
fi
# ---- rv: racecheck of the verify module's tests (its flush folds with the same tile)
if want rv; then
echo "== rv racecheck, KDA verify tests $(left)s left"
san racecheck 60 80 kda tests/test_kda_verify_gpu.py ""
fi
# ---- sw: KDA launch-shape sweep of the patched tree (SWGEOMS, SWSHAPES col_lanes:warps[:resident], SWBATCH), then
# the Kimi-K3 TP8 bs256 verify module (T = 4) at its planned 384 and at 512 resident threads
if want sw; then
echo "== sw KDA shape sweep $(left)s left"
for g in ${SWGEOMS:-kimi_k3_tp8}; do
  [ $(left) -gt 25 ] && new timeout $(cap 80 3) python3 scripts/bench_kda.py --geoms $g --sweep ${SWSHAPES:-4:4:384,4:4:512,4:4:640} \
    --sweep-batches ${SWBATCH:-64,256} --sweep-only --fla-path /none --out /tmp/r --tag kda-sw-$g > /tmp/r/sw-$g.txt 2>&1
  grep -v RESULT_JSON /tmp/r/sw-$g.txt | tail -5; save; done
[ $(left) -gt 40 ] && new timeout $(cap 60 3) python3 scripts/bench_kda.py --geoms kimi_k3_tp8 --batches 256 --verify 4 \
  --verify-resident 512 --fla-path /none --out /tmp/r --tag kda-sw-verify > /tmp/r/sw-verify.txt 2>&1  # verify at 384 / 512
grep -v RESULT_JSON /tmp/r/sw-verify.txt | tail -6; save
fi
# ---- pf: ncu of the KDA shadow step at Kimi-K3 TP8 bs256 (patched tree): the flush (k = 16) and k = 1 (full set,
# SASS source with stall samples; the flush runs at 54% of its bytes, bench/NOTES.md "Twenty-second session")
if want pf; then
echo "== pf ncu, KDA shadow flush and k = 1, Kimi bs256 $(left)s left"
mkdir -p /tmp/r/ncu
for k in ${PFK:-16 1}; do [ $(left) -gt 70 ] || break
  new timeout $(cap 90 20) ncu --clock-control none --kernel-name regex:kda_replay --launch-skip 2 --launch-count 1 --set full \
    -o /tmp/r/ncu/sh-k$k -f python3 scripts/profile_kda.py --geom kimi_k3_tp8 --batch 256 --k $k --shadow bf16 > /tmp/r/ncu/sh-k$k.log 2>&1
  new ncu -i /tmp/r/ncu/sh-k$k.ncu-rep --page source --csv --print-source sass > /tmp/r/ncu/sh-k$k.sass.csv 2>&1
  new ncu -i /tmp/r/ncu/sh-k$k.ncu-rep --page details > /tmp/r/ncu/sh-k$k.txt 2>&1; rm -f /tmp/r/ncu/sh-k$k.ncu-rep
  grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per" /tmp/r/ncu/sh-k$k.txt | head -6; save; done
fi
# ---- RO: the flush-first row order (the patched tree: bench/patches/2026-12-07_row-order-default.patch)
if want r1; then
echo "== r1 the whole GPU suite, patched $(left)s left"
mkdir -p /tmp/r/suite; l=$(cap 300 150)
[ $l -gt 60 ] && new timeout $l python3 scripts/gpu_suite.py --workers 8 --jobs 16 --out /tmp/r/suite > /tmp/r/suite/log.txt 2>&1
grep -E "^# (result|wall)" /tmp/r/suite/gpu_suite.txt; grep -E "^FAILED|^ERROR" /tmp/r/suite/log.txt | head; save
fi
if want rs; then  # ROS: the GPU tests the order touches (its kernels, the caches' and servers' steps), not the suite
echo "== rs the order's GPU tests $(left)s left"
gputests rs 220 200 -m gpu tests/test_flush_order.py tests/test_trt_plugin_gpu.py tests/test_cache_gpu.py \
  tests/test_gdn_cache_gpu.py tests/test_kda_cache_gpu.py tests/test_generation_gpu.py tests/test_generation_kda.py \
  tests/test_generation_qwen.py tests/test_e2e_standard.py
grep -E "^FAILED|^ERROR" /tmp/r/rs.txt | head
fi
if want r3; then
echo "== r3 memcheck and racecheck of the order kernel and the row-order modules $(left)s left"
for kk in "flush_order:kernel_equals_the_host" "replayssm_decode:mamba2_decode_with and not 256 and not geom4" \
          ${ROSAN:+"kda:kda_decode_with and not 256" "gdn:gdn_decode_with and not 256"}; do
  san memcheck 150 40 ${kk%%:*} tests/test_flush_order.py "${kk#*:}"
  san racecheck 140 40 ${kk%%:*} tests/test_flush_order.py "${kk#*:}"
done
fi
if want r2; then
echo "== r2 mixed / ff / ord: Mamba-2, KDA, GDN $(left)s left"
[ $(left) -gt 60 ] && new timeout $(cap 110 60) python3 scripts/bench_kernels.py --quick --mamba-path /none ${ROKERNELS:---shadows bf16,fp8 --batches 32,64,256} \
  --out /tmp/r --tag mamba2-order > /tmp/r/ro-mamba2.txt 2>&1; grep -v RESULT_JSON /tmp/r/ro-mamba2.txt | tail -12; save
[ $(left) -gt 50 ] && new timeout $(cap 90 40) python3 scripts/bench_kda.py --batches ${ROKDA:-32,256} --fla-path /none --out /tmp/r \
  --tag kda-order > /tmp/r/ro-kda.txt 2>&1; grep -v RESULT_JSON /tmp/r/ro-kda.txt | tail -7; save
[ $(left) -gt 40 ] && new timeout $(cap 80 5) python3 scripts/bench_gdn.py --batches ${ROGDN:-32,64,256} --fla-path /none --out /tmp/r \
  --tag gdn-order > /tmp/r/ro-gdn.txt 2>&1; grep -v RESULT_JSON /tmp/r/ro-gdn.txt | tail -6; save
fi
# ---- OL: the longest-first order (bench/patches/2026-12-08_order-longest-first.patch)
if want ol1; then
echo "== ol1 the order's GPU tests and sanitizers, patched $(left)s left"
gputests ol1 150 300 -m gpu tests/test_flush_order.py tests/test_trt_plugin_gpu.py tests/test_cache_gpu.py \
  tests/test_gdn_cache_gpu.py tests/test_kda_cache_gpu.py
grep -E "^FAILED|^ERROR" /tmp/r/ol1.txt | head
san memcheck 280 40 flush_order tests/test_flush_order.py kernel_equals
san racecheck 260 40 flush_order tests/test_flush_order.py kernel_equals
fi
if want ol2; then
echo "== ol2 the ord columns, main then the patch $(left)s left"
pair olm bench_kernels.py 100 --quick --mamba-path /none --shadows bf16,fp8 --batches 32,64,256
pair olk bench_kda.py 90 --batches 32,256 --fla-path /none
pair olg bench_gdn.py 80 --batches 32,64,256 --fla-path /none
fi
# ---- OC: the row-order modules at small batch (this tree: --ordered-cycle)
if want oc; then
echo "== oc ordered cycles at small batch $(left)s left"
[ $(left) -gt 60 ] && new timeout $(cap 200 60) python3 scripts/bench_kda.py --ordered-cycle --batches ${OCKDA:-1,8,32} \
  --fla-path /none --out /tmp/r --tag kda-ordered-cycle > /tmp/r/oc-kda.txt 2>&1; grep -v RESULT_JSON /tmp/r/oc-kda.txt | tail -8; save
[ $(left) -gt 45 ] && new timeout $(cap 150 5) python3 scripts/bench_gdn.py --ordered-cycle --batches ${OCGDN:-1,8,32} \
  --fla-path /none --out /tmp/r --tag gdn-ordered-cycle > /tmp/r/oc-gdn.txt 2>&1; grep -v RESULT_JSON /tmp/r/oc-gdn.txt | tail -6; save
fi
# ---- LS: the ring length at small batch (issue 37's "where replay loses (batch, L)"; main's tree, same call as OC's L = 16)
if want ls; then
echo "== ls ring length ${LSL:-4 8} at batch ${LSBATCH:-1,8,32} $(left)s left"
for L in ${LSL:-4 8}; do
[ $(left) -gt 50 ] && new timeout $(cap 110 40) python3 scripts/bench_kda.py --L $L --batches ${LSBATCH:-1,8,32} \
  --fla-path /none --out /tmp/r --tag kda-L$L > /tmp/r/ls-kda-L$L.txt 2>&1; grep -v RESULT_JSON /tmp/r/ls-kda-L$L.txt | tail -7; save
[ $(left) -gt 40 ] && new timeout $(cap 80 5) python3 scripts/bench_gdn.py --L $L --batches ${LSBATCH:-1,8,32} \
  --fla-path /none --out /tmp/r --tag gdn-L$L > /tmp/r/ls-gdn-L$L.txt 2>&1; grep -v RESULT_JSON /tmp/r/ls-gdn-L$L.txt | tail -6; save
done
fi
# ---- CB: the conventional KDA step as a persistent stream (KDASpec.bulk; main's tree)
if want cb; then
echo "== cb the bulk streams: tests, sanitizers, conventional timing $(left)s left"
gputests cb-tests 120 200 tests/test_kda_gpu.py -k "bulk or conventional"
grep -E "^FAILED|^ERROR" /tmp/r/cb-tests.txt | head
san memcheck 150 50 bulk tests/test_kda_gpu.py bulk
san racecheck 100 60 bulk tests/test_kda_gpu.py bulk
[ $(left) -gt 50 ] && new timeout $(cap 200 5) python3 scripts/bench_kda.py --conv-only --conv-bulk ${CBSHAPES:-2:4,2:4:640,2:2} \
  --batches ${CBBATCH:-64,128,256} --geoms kimi_k3_tp8,glm5_3_flash_tp8,kimi_k3_tp1,glm5_3_flash_tp1 --fla-path /none \
  --out /tmp/r --tag kda-conv-bulk > /tmp/r/cb-bench.txt 2>&1; grep -v RESULT_JSON /tmp/r/cb-bench.txt | grep "^conv" | tail -40; save
fi
if want cr; then
echo "== cr the non-flush replay stream $(left)s left"
[ $(left) -gt 50 ] && new timeout $(cap 300 5) python3 scripts/bench_kda.py --replay-bulk ${CRSHAPES:-2:4} \
  --batches ${CRBATCH:-128,256} --fla-path /none --out /tmp/r --tag kda-replay-bulk > /tmp/r/cr-bench.txt 2>&1
grep -v RESULT_JSON /tmp/r/cr-bench.txt | tail -24; save
fi
echo "== done $(left)s left"; save
