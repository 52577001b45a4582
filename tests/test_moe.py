# SPDX-License-Identifier: Apache-2.0
"""builders/moe.py against transformers' own ``NemotronHMoE`` on the CPU.

Oracle: the transformers module (5.24, eager expert loop) on the same weights and tokens.
* Routing (``route``): the selected experts are the same sets, their weights equal to 1e-6
  relative (the same fp32 ops; only the order of the top-k differs, TopK's vs ``sorted=False``).
* Layer output (``moe_forward``, both formulations): fp32 weights and activations agree to 1e-6
  relative to the output's max |value| (summation order of the expert sum: over all E experts
  with zero weights vs the hit experts' ``index_add_``; measured <= 2e-7); bf16 to 8e-3, two bf16
  ulps of that scale (the expert GEMMs may round to bf16 after different accumulation orders, one
  batched matmul vs per-expert subsets; measured 0 on this CPU).
Teeth: the correction bias changes the choice of experts (dropping it moves the output well beyond
the tolerance), and so does one expert's weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

try:
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE
except ImportError:  # pragma: no cover
    pytest.skip("transformers without NemotronHMoE (needs transformers >= 5.24)", allow_module_level=True)

from builders.moe import MoEWeights, combine_weights, moe_forward, route

BASE = dict(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24, moe_latent_size=None, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=1.0, mlp_bias=False, dtype="fp32")
CASES = [
    BASE,
    {**BASE, "moe_latent_size": 12},  # LatentMoE (Nemotron 3 Super)
    {**BASE, "routed_scaling_factor": 2.5, "num_experts_per_tok": 6, "n_routed_experts": 16},  # Nano-like routing
    {**BASE, "n_group": 4, "topk_group": 2, "n_routed_experts": 16, "num_experts_per_tok": 3},  # group routing
    {**BASE, "norm_topk_prob": False},
    {**BASE, "num_experts_per_tok": 1},
    {**BASE, "mlp_bias": True, "moe_latent_size": 12},
    {**BASE, "dtype": "bf16"},
    {**BASE, "dtype": "bf16", "moe_latent_size": 12, "routed_scaling_factor": 5.0},
]
TOL = {"fp32": 1e-6, "bf16": 8e-3}  # relative to the output's max |value|; see the module docstring


def _id(c):
    return ",".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v) or "base"


def make_moe(case, seed=0):
    cfg = NemotronHConfig(**{k: v for k, v in case.items() if k != "dtype"}, mlp_hidden_act="relu2",
                          hybrid_override_pattern="E")
    moe = NemotronHMoE(cfg, layer_idx=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in moe.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 if p.dim() > 1
                    else 0.1 * torch.randn(p.shape, generator=gen))
        # sigmoid scores sit in (0, 1); a bias of this size changes which experts are chosen
        moe.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_routed_experts, generator=gen))
    if case["dtype"] == "bf16":
        moe = moe.to(torch.bfloat16)
        moe.gate.float()  # transformers keeps the router in fp32 (_keep_in_fp32_modules_strict)
    return moe.eval()


def _tokens(case, shape=(3, 5), seed=1):
    dt = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    return torch.randn(*shape, case["hidden_size"], generator=torch.Generator().manual_seed(seed)).to(dt)


@pytest.mark.parametrize("case", CASES, ids=_id)
@torch.no_grad()
def test_route_matches_transformers(case):
    moe = make_moe(case)
    h = _tokens(case).reshape(-1, case["hidden_size"])
    _, w_ref, i_ref = moe.gate(h)
    w, i = route(h, moe)
    assert i.dtype == torch.int64 and i.shape == i_ref.shape
    i_ref_s, o_ref = i_ref.sort(-1)
    i_s, o = i.sort(-1)
    assert torch.equal(i_s, i_ref_s)
    torch.testing.assert_close(w.gather(1, o), w_ref.gather(1, o_ref), rtol=1e-6, atol=0)
    dense = combine_weights(w, i, case["n_routed_experts"])
    assert (dense != 0).sum(1).tolist() == [case["num_experts_per_tok"]] * h.shape[0]


@pytest.mark.parametrize("formulation", ["dense", "gather"])
@pytest.mark.parametrize("case", CASES, ids=_id)
@torch.no_grad()
def test_moe_forward_matches_transformers(case, formulation):
    moe = make_moe(case)
    h = _tokens(case)
    want = moe(h)
    got = moe_forward(h, moe, formulation)
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().item()
    assert scale > 0.5  # random weights are not degenerate
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[case["dtype"]] * scale, f"max |diff| {err:.3g} vs scale {scale:.3g}"


@torch.no_grad()
def test_weights_without_the_module_give_the_same_output():
    case = CASES[1]
    moe = make_moe(case)
    w = MoEWeights.from_module(moe)
    plain = MoEWeights(**{f.name: getattr(w, f.name) for f in __import__("dataclasses").fields(w)})
    h = _tokens(case)
    assert torch.equal(moe_forward(h, plain), moe_forward(h, moe))
    with pytest.raises(ValueError, match="formulation: expected one of"):
        moe_forward(h, moe, "sorted")


@torch.no_grad()
def test_teeth_correction_bias_and_one_expert_change_the_output():
    case = {**BASE, "n_routed_experts": 16, "num_experts_per_tok": 4}
    moe = make_moe(case)
    h = _tokens(case, shape=(4, 8))
    want = moe(h)
    scale = want.abs().max().item()
    no_bias = MoEWeights.from_module(moe)
    no_bias.correction_bias = torch.zeros_like(no_bias.correction_bias)
    assert not torch.equal(route(h.reshape(-1, 32), no_bias)[1].sort(-1)[0],
                           route(h.reshape(-1, 32), moe)[1].sort(-1)[0])
    assert (moe_forward(h, no_bias) - want).abs().max() > 100 * TOL["fp32"] * scale
    other = copy.deepcopy(moe)
    e = int(route(h.reshape(-1, 32), moe)[1][0, 0])  # an expert token 0 uses
    other.experts.up_proj[e].mul_(1.5)
    assert (moe_forward(h, other) - want).abs().max() > 100 * TOL["fp32"] * scale
