# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_gdn.py on the CPU: the committed counts its --spec rows time and interpolate, for every (T, L) the
flags accept, and its flag checks (before any GPU work)."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_gdn", ROOT / "scripts" / "bench_gdn.py")
bg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bg)


def test_spec_counts_cover_both_sides_of_the_fold_rule_for_every_window():
    assert bg.spec_counts(4, 16) == (0, 4, 8, 9, 12)  # the counts of the published runs
    for T in (2, 4, 6, 8):
        for L in range(2 * T, 33):
            counts = bg.spec_counts(T, L)
            assert all(0 <= m <= L - T for m in counts), (T, L, counts)
            assert any(m + 2 * T <= L for m in counts) and any(m + 2 * T > L for m in counts), (T, L, counts)
            weights, tokens = bg.count_weights(T, L, 0.8)
            assert sum(weights.values()) == pytest.approx(1.0) and tokens == pytest.approx(sum(0.8 ** k for k in range(T)))
            assert max(weights) <= L - T  # every count a verify starts from is inside the timed range
            pts = {m: float(m) for m in counts}  # times linear in m: the interpolation must give m back
            assert all(bg.interp(pts, m, T, L) == pytest.approx(m) for m in weights), (T, L)


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
    weights, _ = bg.count_weights(T, L, p)
    for m in range(L + 1):
        assert seen.count(m) / len(seen) == pytest.approx(weights.get(m, 0.0), abs=0.01), m


@pytest.mark.parametrize("args, what", [
    (["--batches", "1,x"], "--batches: expected comma-separated integers >= 1"),
    (["--L", "40"], "--L: expected 1..32"),
    (["--spec", "--T", "4", "--L", "6"], "expected T in (1, 2, 4, 6, 8) and L >= 2T"),
    (["--spec", "--T", "3"], "expected T in"),
])
def test_bad_flags_stop_before_any_gpu_work(args, what):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gdn.py"), *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and what in r.stderr, r.stderr[-500:]
