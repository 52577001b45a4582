# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism of the builder's patched transformers model (builders/tp_model.py), two gloo
processes on the CPU.

Oracle: the same seeded fp32 tiny Nemotron-H, unsharded, in the same process. Both run transformers'
own ``generate`` (greedy, prompt prefill through the model's torch path, then 3L+2 decode steps so
every row crosses two ReplaySSM flushes), once unpatched and once patched with ReplaySSM
(``patch_replayssm(..., tp=2, rank=r)``; float64 reference SSM on the CPU). TP changes only the fp32
summation order of the row-parallel products (and of a shared norm group's sum of squares), so the
tokens must be equal and max |dlogit| / std <= 1e-4; the two ranks must hold bit-identical logits
(the same all-reduced hidden state, replicated lm_head). Teeth: a norm group split across ranks but
normalised per rank must fail.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from .helpers import end_rank, spawn_ranks  # noqa: E402

if not hasattr(DynamicCache, "get_conv_state"):  # pragma: no cover - e.g. the H200 image's 5.17
    pytest.skip(f"transformers {transformers.__version__}: the patched model needs >= 5.24", allow_module_level=True)

L = 4


def _model(n_groups):
    from transformers import NemotronHForCausalLM

    from builders.nemotron_h import randomize_, tiny_config

    return randomize_(NemotronHForCausalLM(tiny_config(n_groups=n_groups)), seed=0).float().eval()


def _generate(model, ids):
    out = model.generate(ids, max_new_tokens=3 * L + 2, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1)


def _rank_main(rank, world, init_file, out_file, n_groups, teeth):
    import torch.distributed as dist

    from builders import tp_model
    from builders.nemotron_h import patch_replayssm

    torch.set_num_threads(1)
    if teeth:  # each rank normalises its part of a shared norm group alone
        tp_model.TPGatedRMSNorm.forward = lambda self, h, gate=None: _local_norm(self, h, gate)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ids = torch.randint(2, 256, (3, 7), generator=torch.Generator().manual_seed(1))
    rows = {}
    with torch.no_grad():
        for patched in (False, True):
            full, shard = _model(n_groups), _model(n_groups)
            if patched:
                patch_replayssm(full, buffer_len=L)
                patch_replayssm(shard, buffer_len=L, tp=world, rank=rank)
            else:
                tp_model.shard_nemotron_h_(shard, rank, world)
            (t_ref, s_ref), (t, s) = _generate(full, ids), _generate(shard, ids)
            gathered = [torch.empty_like(s) for _ in range(world)]
            dist.all_gather(gathered, s)
            std = s_ref.std(-1, keepdim=True)
            rows["replay" if patched else "plain"] = dict(
                tokens_equal=bool(torch.equal(t, t_ref)),
                err_max=float(((s - s_ref).abs() / std).max()),
                rank_spread=float(max((g - gathered[0]).abs().max() for g in gathered)),
                local_heads=[m.num_heads for m in (layer.mixer for layer in shard.model.layers)
                             if hasattr(m, "A_log")],
                steps=s.shape[1],
            )
    if rank == 0:
        pathlib.Path(out_file).write_text(json.dumps(rows))
    end_rank()


def _local_norm(self, h, gate=None):
    dtype = h.dtype
    h = h.float() * torch.nn.functional.silu(gate.float())
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def _spawn(tmp_path, n_groups, teeth=False):
    outs = [tmp_path / f"rows{a}.json" for a in range(2)]
    attempt = spawn_ranks(_rank_main, lambda a: (2, str(tmp_path / f"rdzv{a}"), str(outs[a]), n_groups, teeth))
    return json.loads(outs[attempt].read_text())


@pytest.mark.parametrize("n_groups", [2, 1], ids=["groups-owned", "group-replicated"])
def test_tp2_model_generates_as_tp1(tmp_path, n_groups):
    rows = _spawn(tmp_path, n_groups)
    assert set(rows) == {"plain", "replay"}
    for name, r in rows.items():
        assert r["steps"] == 3 * L + 2
        assert r["local_heads"] == [2, 2, 2], (name, r)  # 4 Mamba heads, half on each rank
        assert r["tokens_equal"], (name, r)
        assert r["err_max"] <= 1e-4, (name, r)  # fp32 summation order only (module docstring)
        assert r["rank_spread"] == 0.0, (name, r)


def test_tp2_model_teeth_norm_groups(tmp_path):
    rows = _spawn(tmp_path, 1, teeth=True)
    assert all(r["err_max"] > 1e-2 for r in rows.values()), rows


def _rank_main_tp4(rank, world, init_file, out_file):
    import torch.distributed as dist
    from transformers import NemotronHForCausalLM

    from builders import tp_model
    from builders.nemotron_h import randomize_, tiny_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    def make():
        cfg = tiny_config(n_groups=2, num_key_value_heads=4, mamba_num_heads=8)
        return randomize_(NemotronHForCausalLM(cfg), seed=0).float().eval()

    full, shard = make(), make()
    tp_model.shard_nemotron_h_(shard, rank, world)
    ids = torch.randint(2, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = full(ids).logits, shard(ids).logits
    if rank == 0:
        pathlib.Path(out_file).write_text(json.dumps(dict(err=float(((a - b).abs() / a.std(-1, keepdim=True)).max()))))
    end_rank()


def test_tp4_two_norm_groups_each_over_two_ranks(tmp_path):
    """2 norm groups over 4 ranks (each group replicated on two): each rank's variance is its own group's (the
    all-reduce of plain sums mixed the groups: 1.67 std of logit error)."""
    outs = [tmp_path / f"tp4_{a}.json" for a in range(2)]
    attempt = spawn_ranks(_rank_main_tp4, lambda a: (4, str(tmp_path / f"rdzv4_{a}"), str(outs[a])), nprocs=4)
    assert json.loads(outs[attempt].read_text())["err"] <= 1e-4


def test_tp_model_errors():
    from builders.nemotron_h import patch_replayssm
    from builders.tp_model import shard_nemotron_h_

    with pytest.raises(ValueError, match="num_key_value_heads=2 must be divisible by tp"):
        shard_nemotron_h_(_model(4), 0, 4)  # 4 Mamba heads and 4 groups split, 2 KV heads not
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < tp=2"):
        patch_replayssm(_model(2), buffer_len=L, tp=2, rank=2)
    m = _model(2)
    assert shard_nemotron_h_(m, 0, 1) is m and m.model.layers[0].mixer.num_heads == 4  # tp=1: untouched
