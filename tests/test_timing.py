# SPDX-License-Identifier: Apache-2.0
"""trtllm_replayssm.timing on the CPU (the CUDA branches run in the benchmarks on the device): the spread,
the eager fallbacks of capture and time_samples, restore before every sample, warm-up samples untimed."""

import pathlib

import pytest

from trtllm_replayssm import timing


def test_spread_is_p90_minus_p10():
    assert timing.spread([5.0]) == 0.0
    assert timing.spread(list(range(11))) == 8 - 1  # sorted: p90 = xs[int(0.9 n) - 1] = xs[8], p10 = xs[1]
    assert timing.spread([3.0, 1.0, 2.0, 10.0, 4.0, 6.0, 5.0, 8.0, 7.0, 9.0]) == 9.0 - 2.0


def test_capture_on_cpu_is_the_call_itself():
    calls = []
    run, graph = timing.capture(lambda: calls.append(1), lambda: calls.append("restore"), cuda=False)
    assert graph is None and calls == []  # no warm-up, no restore: nothing runs until timed
    run()
    assert calls == [1]


@pytest.mark.parametrize("restore", [True, False])
def test_time_samples_counts_calls_and_restores(restore):
    log = []
    out = timing.time_samples(lambda: log.append("run"), (lambda: log.append("restore")) if restore else None,
                              steps=3, warmup=2, reps=4, cuda=False)
    assert len(out) == 4 and all(t >= 0 for t in out)
    per_sample = (["restore"] if restore else []) + ["run"] * 3
    assert log == per_sample * (2 + 4)  # warm-up samples first, then the timed ones, each restored when asked


def test_commit_id_order(monkeypatch):
    """--commit, then $GIT_COMMIT (the device's .git is stale), then git's HEAD of this checkout."""
    monkeypatch.setenv("GIT_COMMIT", "envsha")
    assert timing.commit_id("argsha") == "argsha"
    assert timing.commit_id(None) == "envsha"
    monkeypatch.delenv("GIT_COMMIT")
    got = timing.commit_id(None)
    assert got == "unknown" or (len(got) == 10 and all(c in "0123456789abcdef" for c in got))


def test_run_meta_on_cpu():
    m = timing.run_meta("cpu", "abc")
    assert m["device"] == "cpu" and m["commit"] == "abc" and m["date"].endswith("+00:00") and m["torch"]


def test_source_hash_names_the_tree_that_ran(tmp_path):
    """source_hash: the same for an identical tree, different when one source file changes; stamped in run_meta
    with the seed when one is given."""
    import shutil

    root = pathlib.Path(timing.__file__).resolve().parent.parent
    for d in ("plugins", "trtllm_replayssm", "builders", "scripts"):
        shutil.copytree(root / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    assert timing.source_hash(tmp_path) == timing.source_hash(root)
    for rel in ("plugins/mamba2/replayssm.cuh", "trtllm_replayssm/families/kda/ops.py"):  # family folders count
        f = tmp_path / rel
        before = timing.source_hash(tmp_path)
        f.write_text(f.read_text() + "\n// edited\n")
        assert timing.source_hash(tmp_path) != before, rel
    m = timing.run_meta("cpu", "abc", seed=7)
    assert m["source_hash"] == timing.source_hash(root) and m["seed"] == 7


def test_add_ceiling_pcts():
    row = dict(tbps_conv=1.5, f32_tbps=2.4, f32_tbps_k1=3.0, bf16shadow_tbps=0.6, bf16shadow_tbps_k1=0.3)
    assert timing.add_ceiling_pcts(row, 3.0) is row
    assert (row["pct_ceiling_conv"], row["f32_pct_ceiling"], row["f32_pct_ceiling_k1"]) == (50.0, 80.0, 100.0)
    assert (row["bf16shadow_pct_ceiling"], row["bf16shadow_pct_ceiling_k1"]) == (20.0, 10.0)
    assert "pct_ceiling_fla" not in row
    assert timing.add_ceiling_pcts(dict(tbps_conv=3.0, fla_us=1.0, tbps_fla=1.5), 3.0, names=())["pct_ceiling_fla"] == 50.0
