# SPDX-License-Identifier: Apache-2.0
"""trtllm_replayssm.timing on the CPU (the CUDA branches run in the benchmarks on the device): the spread,
the eager fallbacks of capture and time_samples, restore before every sample, warm-up samples untimed."""

import pathlib

import pytest
import torch

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


def test_spread_cursors_puts_row_i_of_every_launch_at_position_i_mod_L():
    L, batch = 4, 6
    cursor = torch.full((20,), -1, dtype=torch.int32)
    sbis = [torch.tensor([7, 3, 11, 0, 19, 5], dtype=torch.int32), torch.tensor([2, 4, 6, 8, 10, 12], dtype=torch.int32)]
    timing.spread_cursors(cursor, sbis, L)
    for sbi in sbis:
        assert cursor[sbi.long()].tolist() == [i % L for i in range(batch)]
    untouched = sorted(set(range(20)) - {int(x) for s in sbis for x in s})
    assert (cursor[untouched] == -1).all()  # slots no launch uses keep their cursor
    timing.spread_cursors(cursor, sbis, L, flush_first=True)  # the same positions, the flushing rows (cursor L - 1) first
    for sbi in sbis:
        assert cursor[sbi.long()].tolist() == [3, 2, 1, 1, 0, 0]
    assert (cursor[untouched] == -1).all()


def test_add_replay_cycle_fields_and_the_mixed_launch():
    L, batch = 4, 6
    bytes_at = {1: 100, 2: 110, 3: 120, 4: 400}
    per_k = [1.0, 1.1, 1.2, 4.0]
    row = timing.add_replay_cycle(dict(conv_us=2.0), "f32", per_k, bytes_at, batch, mixed_us=1.5)
    amort = sum(per_k) / L
    assert row["f32_us_k"] == per_k and (row["f32_us_k1"], row["f32_us_flush"]) == (1.0, 4.0)
    assert row["f32_us_amortized"] == pytest.approx(amort)
    assert row["f32_bytes_amortized"] == pytest.approx(730 / 4 * batch)
    assert row["f32_tbps"] == pytest.approx(730 / 4 * batch / amort / 1e6)
    assert row["f32_tbps_flush"] == pytest.approx(400 * batch / 4.0 / 1e6)
    assert row["f32_speedup_vs_conv"] == pytest.approx(2.0 / amort)
    assert row["f32_flush_over_conv"] == pytest.approx(2.0)
    # rows 0..5 at positions 1, 2, 3, 4, 1, 2 (timing.spread_cursors)
    assert row["f32_bytes_mixed"] == timing.mixed_bytes(bytes_at, batch, L) == 100 + 110 + 120 + 400 + 100 + 110
    assert row["f32_speedup_vs_conv_mixed"] == pytest.approx(2.0 / 1.5)
    assert row["f32_mixed_over_amortized"] == pytest.approx(1.5 / amort)
    timing.add_ceiling_pcts(dict(row, tbps_conv=1.0), 3.0, names=("f32",))
    assert "f32_pct_ceiling_mixed" not in timing.add_ceiling_pcts(
        timing.add_replay_cycle(dict(conv_us=2.0, tbps_conv=1.0), "f32", per_k, bytes_at, batch), 3.0, names=("f32",))
    pcts = timing.add_ceiling_pcts(dict(row, tbps_conv=1.0), 2.0, names=("f32",))
    assert pcts["f32_pct_ceiling_mixed"] == pytest.approx(100 * row["f32_tbps_mixed"] / 2.0)
    assert not any(k.endswith("_mixed_ff") for k in row)
    ff = timing.add_replay_cycle(dict(conv_us=2.0, tbps_conv=1.0), "f32", per_k, bytes_at, batch, mixed_us=1.5,
                                 mixed_ff_us=1.25)
    assert ff["f32_us_mixed"] == 1.5 and ff["f32_us_mixed_ff"] == 1.25
    assert ff["f32_bytes_mixed_ff"] == ff["f32_bytes_mixed"]  # one multiset of positions, two orders
    assert ff["f32_speedup_vs_conv_mixed_ff"] == pytest.approx(2.0 / 1.25)
    assert ff["f32_mixed_ff_over_amortized"] == pytest.approx(1.25 / amort)
    assert "f32_us_mixed_ord" not in ff and timing.mixed_cells(ff, ("f32",)) == "1.5 (1.33) ff 1.2 (1.60)"
    od = timing.add_replay_cycle(dict(conv_us=2.0, tbps_conv=1.0), "f32", per_k, bytes_at, batch, mixed_us=1.5,
                                 mixed_ord_us=1.0)
    assert od["f32_speedup_vs_conv_mixed_ord"] == 2.0 and "f32_us_mixed_ff" not in od
    assert timing.mixed_cells(od, ("f32",)) == "1.5 (1.33) ord 1.0 (2.00)"
    assert timing.add_ceiling_pcts(ff, 2.0, names=("f32",))["f32_pct_ceiling_mixed_ff"] == pytest.approx(
        100 * ff["f32_tbps_mixed_ff"] / 2.0)
    with pytest.raises(ValueError, match="bytes_at"):
        timing.add_replay_cycle(dict(conv_us=2.0), "f32", per_k, {1: 1, 2: 1, 3: 1}, batch)


def test_add_ordered_cycle_fields_and_the_orders_share():
    """The row-order module's lockstep cycle beside the plain one: its amortized step and x conv, and with the model's
    layer count the order's own launch shared by them."""
    row = timing.add_ordered_cycle(dict(conv_us=4.0), "f32", [2.0, 2.0, 4.0, 4.0], order_us=3.0, layers=30)
    assert row["order_us"] == 3.0 and row["f32_ro_us_amortized"] == 3.0 and row["f32_ro_us_flush"] == 4.0
    assert row["f32_ro_speedup_vs_conv"] == 4.0 / 3.0 and row["f32_ro_speedup_vs_conv_step"] == 4.0 / 3.1
    assert row["f32_ro_flush_over_conv"] == 1.0 and row["order_layers"] == 30
    assert timing.ordered_cells(row, ("f32",)) == "ro: order 3.0 us; f32 2.0 / 4.0 / 3.0 (1.29)"
    bare = timing.add_ordered_cycle(dict(conv_us=4.0), "f32", [2.0, 4.0], order_us=3.0)
    assert "f32_ro_speedup_vs_conv_step" not in bare and timing.ordered_cells(bare, ("f32",)).endswith("(1.33)")
    assert timing.ordered_cells(dict(conv_us=1.0)) == ""


def test_time_ordered_cycle_makes_the_order_before_each_position(monkeypatch):
    """Each position: the cursor set, the orders made (outside the timing), then the module's graph timed; the order's
    own graph last."""
    import torch

    seen = []
    cursor = torch.zeros(3, dtype=torch.int32)

    def order_all():
        seen.append(("order", int(cursor[0])))

    def replay():
        pass

    def fake_time(fn, launches, reps=20):
        seen.append(("time", "replay" if fn is replay else "order", launches))
        return (1.0 + len(seen), 0.0)

    monkeypatch.setattr(timing, "graph_time_us", fake_time)
    row = timing.time_ordered_cycle(dict(conv_us=8.0), "f32", cursor, 2, order_all, replay, 5, layers=4)
    assert seen == [("order", 0), ("time", "replay", 5), ("order", 1), ("time", "replay", 5), ("time", "order", 5)]
    assert row["f32_ro_us_k"] == [3.0, 5.0] and row["order_us"] == 6.0 and row["f32_ro_speedup_vs_conv_step"] == 8.0 / 5.5
