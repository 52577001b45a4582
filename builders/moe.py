# SPDX-License-Identifier: Apache-2.0
"""The Nemotron 3 MoE layer (transformers' ``NemotronHMoE``) as plain torch ops: routing, routed
experts, shared expert, latent projections. Used where transformers' own module cannot go: the
ONNX export of the decode / verify step (its expert loop calls ``.item()`` and ``nonzero``, so a
trace would freeze the experts that the tracing input happened to hit) and benchmarks that bring
their own expert GEMMs (:func:`route` gives the routing alone).

The math, as ``transformers.models.nemotron_h.modeling_nemotron_h`` (5.24) defines it, per token h:

    logits = h W_gᵀ  (fp32; W_g is kept in fp32)          s = sigmoid(logits)  (E,)
    choice = s + b  (b = e_score_correction_bias, used for the choice only)
    groups (n_group > 1): group score = sum of the 2 best choices in the group; keep the
           topk_group best groups, the other experts' choices become -inf
    I = top-k of choice;  w_i = s_i (i in I);  w /= (sum w + 1e-20) if norm_topk_prob;  w *= routed_scaling_factor
    x = fc1_latent(h) if moe_latent_size else h
    y = sum_i w_i · down_i(act(up_i x))   (expert products in the activation dtype, the weighted sum in fp32)
    out = fc2_latent(y) + shared(h),  shared(h) = down_s(act(up_s h))     (act: mlp_hidden_act, relu2)

Two formulations of the routed sum, both standard ONNX ops that TensorRT's parser takes (MatMul,
TopK, GatherElements / Gather, Where, Sigmoid, ReduceSum; every shape static but the batch):

* ``"dense"`` (the default; what the exported graphs use): every expert runs on every token,
  ``(E, T, Din) @ (E, Din, I)`` batched GEMMs, and the routing enters as a (T, E) combine matrix
  that is zero off the top-k. Why: it is two plain batched GEMMs that TensorRT builds as such,
  it reads each expert matrix once per step whatever the batch, and its intermediates are
  E·T·I (Nano at T = 256: 61 M elements). Its cost is E/k times the routed FLOPs (Nano 21x,
  Super 23x): at batch 256 a Nano MoE layer is ~0.65 TFLOP, about 1.5x the time of reading all
  its expert weights (2.55 GB) on an H200.
* ``"gather"``: each token gathers its k expert matrices, ``W_up[I]`` (T, k, I, Din), then
  batched mat-vecs. TensorRT materialises the gathered copies: 2·T·k matrices per projection
  written and read, against E read by the dense form, so it wins only while 2·T·k < E
  (Nano: T <= 10, Super: T <= 11) and grows without bound with the batch.

Neither is what a serving engine does at scale (tokens sorted by expert, one grouped GEMM;
TensorRT-LLM's fused MoE): standard ONNX has no grouped GEMM, and sorting tokens by expert needs
data-dependent shapes (NonZero, per-expert token counts), which TensorRT supports in few layers and
which break the static-shape optimisation profile these engines are built with. These engines
exist to carry the ReplaySSM plugin, so the MoE is expressed in the form TensorRT builds without a
plugin. In the exported graph (tests/test_builder.py checks it): per MoE layer one TopK with a
constant k on the last axis (TensorRT's ITopKLayer), GatherElements of the sigmoid scores, the
combine matrix from an Equal one-hot (no ScatterElements), and the expert matrices as (E, ., .)
constants of two broadcast MatMuls; no NonZero, Loop, If or Scatter anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

FORMULATIONS = ("dense", "gather")


@dataclasses.dataclass
class MoEWeights:
    """The tensors and routing constants of one MoE layer (shapes as transformers stores them).

    gate_weight (E, D) and correction_bias (E,) are used in fp32; up (E, I, Din), down (E, Din, I)
    with Din = moe_latent_size or D; shared_up (S, D), shared_down (D, S); fc1_latent (Din, D) and
    fc2_latent (D, Din) or None; the ``*_bias`` fields are None without ``mlp_bias``.
    """

    gate_weight: torch.Tensor
    correction_bias: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    shared_up: torch.Tensor
    shared_down: torch.Tensor
    act: Callable
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_act: Callable | None = None  # None: act
    fc1_latent: torch.Tensor | None = None
    fc2_latent: torch.Tensor | None = None
    shared_up_bias: torch.Tensor | None = None
    shared_down_bias: torch.Tensor | None = None
    fc1_latent_bias: torch.Tensor | None = None
    fc2_latent_bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    @classmethod
    def from_module(cls, moe) -> MoEWeights:
        """The weights of a transformers ``NemotronHMoE`` (shared, not copied)."""
        lat1, lat2 = moe.fc1_latent_proj, moe.fc2_latent_proj
        latent = isinstance(lat1, torch.nn.Linear)
        g = moe.gate
        return cls(
            gate_weight=g.weight, correction_bias=g.e_score_correction_bias, up=moe.experts.up_proj,
            down=moe.experts.down_proj, shared_up=moe.shared_experts.up_proj.weight,
            shared_down=moe.shared_experts.down_proj.weight, act=moe.experts.act_fn,
            shared_act=moe.shared_experts.act_fn, top_k=g.top_k,
            n_group=g.num_group, topk_group=g.topk_group, norm_topk_prob=g.norm_topk_prob,
            routed_scaling_factor=g.routed_scaling_factor,
            fc1_latent=lat1.weight if latent else None, fc2_latent=lat2.weight if latent else None,
            shared_up_bias=moe.shared_experts.up_proj.bias, shared_down_bias=moe.shared_experts.down_proj.bias,
            fc1_latent_bias=lat1.bias if latent else None, fc2_latent_bias=lat2.bias if latent else None,
        )


def _weights(moe) -> MoEWeights:
    return moe if isinstance(moe, MoEWeights) else MoEWeights.from_module(moe)


def route(hidden: torch.Tensor, moe, idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights (T, k) fp32, topk_indices (T, k) int64) of ``hidden`` (T, D), as ``NemotronHTopkRouter``.

    The index order within a row is TopK's (descending choice score); transformers' is unspecified
    (``sorted=False``); every consumer sums over k. ``idx`` (T, k): the experts are given (teacher-forced
    routing, a benchmark gate's), only the weights come from ``hidden``."""
    w = _weights(moe)
    E = w.num_experts
    logits = F.linear(hidden.float(), w.gate_weight.float())
    scores = torch.sigmoid(logits)
    choice = scores + w.correction_bias.float()
    if w.n_group > 1:
        per = E // w.n_group
        group_scores = choice.reshape(-1, w.n_group, per).topk(2, dim=-1)[0].sum(-1)  # (T, n_group)
        group_idx = group_scores.topk(w.topk_group, dim=-1)[1]  # (T, topk_group)
        # group mask by comparison (no ScatterElements): group j is kept when some selected index equals j
        keep = (group_idx[:, :, None] == torch.arange(w.n_group, device=hidden.device)).sum(1) > 0
        keep = keep[:, :, None].expand(-1, -1, per).reshape(-1, E)
        choice = torch.where(keep, choice, torch.full_like(choice, float("-inf")))
    if idx is None:
        idx = choice.topk(w.top_k, dim=-1)[1]
    weights = scores.gather(1, idx)
    if w.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * w.routed_scaling_factor, idx


def combine_weights(topk_weights: torch.Tensor, topk_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(T, E) fp32: the routing weight of every (token, expert), zero off the top-k (exact: one
    nonzero term per sum)."""
    onehot = topk_indices[:, :, None] == torch.arange(num_experts, device=topk_indices.device)
    return (onehot.to(topk_weights.dtype) * topk_weights[:, :, None]).sum(1)


def experts_dense(x: torch.Tensor, w: MoEWeights, combine: torch.Tensor) -> torch.Tensor:
    """sum_e combine[:, e] · down_e(act(up_e x)) for x (T, Din); fp32 (T, Din)."""
    h = w.act(torch.matmul(x[None], w.up.transpose(1, 2)))  # (E, T, I)
    y = torch.matmul(h, w.down.transpose(1, 2))  # (E, T, Din), activation dtype
    return (y.float() * combine.t()[:, :, None]).sum(0)


def experts_gather(x: torch.Tensor, w: MoEWeights, topk_weights: torch.Tensor,
                   topk_indices: torch.Tensor) -> torch.Tensor:
    """The same sum over the k gathered experts of each token; fp32 (T, Din)."""
    up, down = w.up[topk_indices], w.down[topk_indices]  # (T, k, I, Din), (T, k, Din, I)
    h = w.act(torch.matmul(up, x[:, None, :, None]))  # (T, k, I, 1)
    y = torch.matmul(down, h)[..., 0]  # (T, k, Din)
    return (y.float() * topk_weights[:, :, None]).sum(1)


def moe_forward(hidden: torch.Tensor, moe, formulation: str = "dense") -> torch.Tensor:
    """``NemotronHMoE.forward`` in plain ops: ``hidden`` (..., D) -> (..., D) in hidden's dtype.

    ``moe``: the transformers module or :class:`MoEWeights`; ``formulation``: "dense" or "gather"
    (module docstring)."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation: expected one of {FORMULATIONS}, got {formulation!r}")
    w = _weights(moe)
    shape = hidden.shape
    h = hidden.reshape(-1, shape[-1])
    topk_weights, topk_indices = route(h, w)
    x = h if w.fc1_latent is None else F.linear(h, w.fc1_latent, w.fc1_latent_bias)
    if formulation == "dense":
        y = experts_dense(x, w, combine_weights(topk_weights, topk_indices, w.num_experts))
    else:
        y = experts_gather(x, w, topk_weights, topk_indices)
    y = y.to(x.dtype)
    if w.fc2_latent is not None:
        y = F.linear(y, w.fc2_latent, w.fc2_latent_bias)
    act = w.shared_act or w.act
    shared = F.linear(act(F.linear(h, w.shared_up, w.shared_up_bias)), w.shared_down, w.shared_down_bias)
    return (y + shared).reshape(shape)


def gated_experts(x: torch.Tensor, experts, top_w: torch.Tensor, top_i: torch.Tensor,
                  formulation: str = "dense") -> torch.Tensor:
    """The routed sum of gated (SwiGLU-style) experts stored as transformers fuses them, ``experts.gate_up_proj``
    (E, 2I, D), ``experts.down_proj`` (E, D, I) and ``experts.act_fn`` (Qwen3-Next's and Kimi-Linear's expert
    modules): sum_i w_i · down_i(act(gate_i x) · up_i x) over each token's k experts, for x (T, D), ``top_w`` (T, k)
    in x's dtype and ``top_i`` (T, k); (T, D) in x's dtype. The two formulations of the module docstring: "dense"
    runs every expert on every token and weights them by the (T, E) routing mask built by Equal/Mul/ReduceSum,
    "gather" runs each token's k gathered expert matrices."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"moe_formulation: expected one of {FORMULATIONS}, got {formulation!r}")
    if formulation == "dense":
        E = experts.gate_up_proj.shape[0]
        onehot = top_i[:, :, None] == torch.arange(E, device=x.device)[None, None, :]
        mask = (onehot.to(x.dtype) * top_w[:, :, None]).sum(1)  # (T, E)
        gu = torch.matmul(x[None], experts.gate_up_proj.transpose(1, 2))  # (E, T, 2I)
        g, u = gu.chunk(2, dim=-1)
        ye = torch.matmul(experts.act_fn(g) * u, experts.down_proj.transpose(1, 2))  # (E, T, D)
        return (ye * mask.transpose(0, 1)[:, :, None]).sum(0)
    gu = torch.matmul(experts.gate_up_proj[top_i], x[:, None, :, None])[..., 0]  # (T, k, 2I)
    g, u = gu.chunk(2, dim=-1)
    ye = torch.matmul(experts.down_proj[top_i], (experts.act_fn(g) * u)[..., None])[..., 0]  # (T, k, D)
    return (ye * top_w[:, :, None]).sum(1)
