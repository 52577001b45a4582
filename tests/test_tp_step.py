# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism of the whole decode step (builders/tp_step.py), two gloo processes on the CPU.

Oracle: the TP=1 :class:`~builders.model_step.DecodeStep` on the same seeded fp32 model, fed
the same tokens (teacher forcing) for 3L+2 steps, so every row crosses two flushes of the replay
backend; compared by ``scripts/e2e_standard.py``'s ``tp_check`` (the correctness phase of
``--tp N``) for the conventional and replay backends. The SSM steps are the float64 reference on
both sides with identical per-head arithmetic; TP changes only the fp32 summation order of the
row-parallel products (and of the replicated groups' norm sums), so max |dlogit| / std <= 1e-4
(``TP_TOL``; measured 2.7e-6 tiny, 1.2e-5 at the 8B geometry). Ranks must agree bit for bit (both
compute the full logits from the same all-reduced hidden state). Teeth: replicated groups
normalised per rank instead of across ranks must fail. TP=1 of :class:`TPDecodeStep` is the
original step bit for bit. Processes start with torch.multiprocessing (no torchrun).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from .helpers import end_rank, spawn_ranks

pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _bench():
    from scripts import e2e_standard

    return e2e_standard


def _rank_main(rank, world, init_file, out_file, geometry, tiny, layers, vocab, teeth):
    import torch.distributed as dist

    from builders.tp_step import TPDecodeStep

    torch.set_num_threads(1)
    bd = _bench()
    if teeth:  # each rank normalises its part of a shared norm group alone
        TPDecodeStep.groups_owned = property(lambda self: True, lambda self, v: None)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    config = bd._tp_config(geometry, layers, vocab, tiny)
    rows = bd.tp_check(config, ["conventional", "replay"], rank, world)
    if rank == 0:
        pathlib.Path(out_file).write_text(json.dumps(rows))
    end_rank()


def _spawn(tmp_path, geometry, tiny=True, layers=None, vocab=None, teeth=False):
    outs = [tmp_path / f"rows{a}.json" for a in range(2)]
    attempt = spawn_ranks(_rank_main, lambda a: (2, str(tmp_path / f"rdzv{a}"), str(outs[a]), geometry, tiny,
                                                 layers, vocab, teeth))
    return json.loads(outs[attempt].read_text())


@pytest.mark.parametrize("geometry, tiny, layers, vocab", [
    ((4, 64, 64, 2), True, None, None),     # tiny config: groups owned (G % tp == 0)
    ((4, 64, 64, 1), True, None, None),     # one group replicated: the norm's sum of squares all-reduced
    ((128, 64, 128, 8), False, 8, 512),     # nemotron_h_8b, first 8 layers (M-M-M-M*), small vocab
])
def test_tp2_logits_equal_tp1(tmp_path, geometry, tiny, layers, vocab):
    rows = _spawn(tmp_path, geometry, tiny, layers, vocab)
    assert [r["mode"] for r in rows] == ["conventional", "replay"]
    for r in rows:
        assert r["steps"] == 3 * r["buffer_len"] + 2
        assert r["err_max"] <= 1e-4, r  # fp32 summation order only (module docstring)
        assert r["passed"] and r["rank_spread"] == 0.0  # every rank holds the same logits


def test_tp2_teeth_norm_groups(tmp_path):
    rows = _spawn(tmp_path, (4, 64, 64, 1), teeth=True)
    assert all(r["err_max"] > 1e-2 and not r["passed"] for r in rows), rows


def test_tp1_is_the_original_step():
    from builders.model_step import DecodeStep, Replay
    from builders.tp_step import TPDecodeStep

    bd = _bench()
    model = bd.build_model(bd.model_config(tiny=True), "cpu", torch.float32, seed=0)
    a, b = DecodeStep(model, 2, 12, Replay(4)), TPDecodeStep(model, 2, 12, Replay(4))
    for t in range(10):
        for s in (a, b):
            s.ids.fill_(t + 2)
            s()
        assert torch.equal(a.logits, b.logits)


def test_tp_shard_errors():
    from builders.model_step import Conventional
    from builders.tp_step import TPDecodeStep

    bd = _bench()
    model = bd.build_model(bd.model_config(tiny=True), "cpu", torch.float32, seed=0)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        TPDecodeStep(model, 1, 4, Conventional(), rank=0, tp=4)  # 4 Mamba heads split, 2 KV heads not
