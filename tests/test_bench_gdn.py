# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_gdn.py on the CPU: the committed counts its --spec rows (and scripts/bench_spec.py's) time and
interpolate (trtllm_replayssm.timing), for every (T, L) the flags accept, and its flag checks (before any GPU work)."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_gdn", ROOT / "scripts" / "bench_gdn.py")
bg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bg)
from trtllm_replayssm import timing  # noqa: E402


def test_spec_counts_cover_both_sides_of_the_fold_rule_for_every_window():
    assert timing.spec_timed_counts(4, 16) == (0, 4, 8, 9, 12)  # the counts of the published runs
    for T in (2, 4, 6, 8):
        for L in range(2 * T, 33):
            counts = timing.spec_timed_counts(T, L)
            assert all(0 <= m <= L - T for m in counts), (T, L, counts)
            assert any(m + 2 * T <= L for m in counts) and any(m + 2 * T > L for m in counts), (T, L, counts)
            weights, tokens = timing.spec_count_weights(T, L, 0.8)
            assert sum(weights.values()) == pytest.approx(1.0) and tokens == pytest.approx(sum(0.8 ** k for k in range(T)))
            assert max(weights) <= L - T  # every count a verify starts from is inside the timed range
            pts = {m: float(m) for m in counts}  # times linear in m: the interpolation must give m back
            assert all(timing.interp_count(pts, m, T, L) == pytest.approx(m) for m in weights), (T, L)
            assert timing.spec_step_us(pts, T, L, 0.8)[0] == pytest.approx(sum(w * m for m, w in weights.items()))


def test_full_acceptance_cycles_T_2T_3T_not_from_zero():
    """At p = 1 the verify steps start from T, 2T, ..., L - T (after a fold the count is the step's n): the T = 4,
    L = 16 step is the mean of counts 4, 8 and 12 (one fold in three), not of 0, 4, 8, 12."""
    weights, tokens = timing.spec_count_weights(4, 16, 1.0)
    assert tokens == 4 and sorted(m for m, w in weights.items() if w > 1e-12) == [4, 8, 12]
    assert all(weights[m] == pytest.approx(1 / 3) for m in (4, 8, 12))
    pts = {0: 100.0, 4: 110.0, 8: 120.0, 9: 300.0, 12: 330.0}
    assert timing.spec_step_us(pts, 4, 16, 1.0)[0] == pytest.approx((110 + 120 + 330) / 3)


def test_count_weights_match_a_sampled_run():
    """The exact weights against the sampled cursor the published runs used (T = 4, L = 16, p = 0.8): the old
    estimator, written out here as the check, agrees within sampling noise."""
    import random

    T, L, p = 4, 16, 0.8
    rng, count, seen = random.Random(0), 0, []
    for _ in range(40000):
        seen.append(count)
        if count + 2 * T > L:
            count = 0
        n = 1
        while n < T and rng.random() < p:
            n += 1
        count += n
    weights, _ = timing.spec_count_weights(T, L, p)
    for m in range(L + 1):
        assert seen.count(m) / len(seen) == pytest.approx(weights.get(m, 0.0), abs=0.01), m


def test_geom_names_and_ad_hoc_shapes():
    assert bg.parse_geom("qwen3_next_80b") == bg.QWEN3_NEXT
    assert bg.parse_geom("12:12:128:128") == dict(HV=12, H=12, V=128, K=128)
    assert bg.parse_geom("32:16:128:128") == bg.QWEN3_NEXT


@pytest.mark.parametrize("args, what", [
    (["--batches", "1,x"], "--batches: expected comma-separated integers >= 1"),
    (["--L", "40"], "--L: expected 1..32"),
    (["--spec", "--T", "4", "--L", "6"], "expected T in (1, 2, 4, 6, 8) and L >= 2T"),
    (["--spec", "--T", "3"], "expected T in"),
    (["--geom", "12:5:128:128"], "--geom: expected one of"),
    (["--geom", "12:12:128"], "--geom: expected one of"),
    (["--geom", "12:12:128:128", "--spec"], "--spec rows time Qwen3-Next only"),
])
def test_bad_flags_stop_before_any_gpu_work(args, what):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gdn.py"), *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and what in r.stderr, r.stderr[-500:]
