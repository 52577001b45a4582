# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism of transformers' Nemotron-H model itself: :func:`shard_nemotron_h_`.

The same Megatron-style split as :class:`builders.tp_step.TPDecodeStep` (see its docstring), applied
in place to a ``NemotronHForCausalLM`` so that the model's own forward, ``generate`` and the
ReplaySSM patch (:func:`builders.nemotron_h.patch_replayssm` with ``tp=``) run on one rank's share:

  Mamba-2   heads (and their B/C groups, replicated when ngroups % tp != 0) of in_proj, conv1d,
            A_log, D, dt_bias and the gated norm; the mixer's size attributes are set to the local
            ones, so its prefill path, its cache entries (allocated from the tensors it sees) and
            the ReplaySSM checkpoint and buffers are local. out_proj is row-parallel (all-reduce).
            When a norm group spans ranks (replicated groups) the gated norm is replaced by one
            whose per-group sum of squares is all-reduced.
  attention by KV groups: q/k/v rows of the local KV heads and their query heads, o_proj
            row-parallel. The KV cache holds the local heads only.
  MLP       up_proj column-parallel, down_proj row-parallel.
  replicated  embeddings, every pre-norm, norm_f and lm_head (every rank computes the full logits).

Row-parallel outputs are summed with ``torch.distributed.all_reduce`` in a forward hook; a bias of
such a layer is kept on rank 0 only, so it is added once. ``tp=1`` leaves the model untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from trtllm_replayssm import tp as tpmod


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
    return t


def _keep_rows(linear: nn.Linear, rows) -> None:  # index tensor or slice
    linear.weight = nn.Parameter(linear.weight.detach()[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].contiguous(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, cols, rank: int, group) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, cols].contiguous(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and rank != 0:  # added once, after the sum
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.register_forward_hook(lambda _m, _inp, out: _all_reduce(out, group))


class TPGatedRMSNorm(nn.Module):
    """NemotronH's gated RMSNorm over this rank's part of one norm group (replicated B/C groups): each rank
    puts its sum of squares in its group's column of a (..., n_groups) tensor, the tensor is all-reduced, and
    the rank reads its group's column back, divided by the whole group's size. (An all-reduce of the plain
    sums mixed the groups whenever n_groups > 1, e.g. 2 groups over 4 ranks: builders/tp_step.py's _group_var
    does the same per-group reduction.)"""

    def __init__(self, weight: torch.Tensor, eps: float, group_size: int, group, group0: int = 0, n_groups: int = 1):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon, self.group_size, self.group = eps, group_size, group
        self.group0, self.n_groups = group0, n_groups

    def forward(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * nn.functional.silu(gate.to(torch.float32))
        sums = h.new_zeros(*h.shape[:-1], self.n_groups)
        sums[..., self.group0] = h.pow(2).sum(-1)
        sq = _all_reduce(sums, self.group)[..., self.group0:self.group0 + 1]
        h = h * torch.rsqrt(sq / self.group_size + self.variance_epsilon)
        return self.weight * h.to(dtype)


@torch.no_grad()
def _shard_mixer(m, config, rank: int, tp: int, group) -> None:
    H, P, N, G = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size, config.n_groups
    s = tpmod.shard_plan(H, G, tp)[rank]
    hp, xbc, rows = tpmod.mixer_channels(s, P, N, m.A_log.device)
    _keep_rows(m.in_proj, rows)
    conv = m.conv1d
    conv.weight = nn.Parameter(conv.weight.detach()[xbc].contiguous(), requires_grad=False)
    if conv.bias is not None:
        conv.bias = nn.Parameter(conv.bias.detach()[xbc].contiguous(), requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = len(xbc)
    for name in ("A_log", "D", "dt_bias"):
        setattr(m, name, nn.Parameter(getattr(m, name).detach()[s.heads].contiguous(), requires_grad=False))
    norm_w = m.norm.weight.detach()[hp].contiguous()
    if G % tp == 0:  # every norm group is one of this rank's whole B/C groups
        m.norm.weight = nn.Parameter(norm_w, requires_grad=False)
    else:
        m.norm = TPGatedRMSNorm(norm_w, m.norm.variance_epsilon, H * P // G, group, s.group0, G)
    _row_parallel(m.out_proj, hp, rank, group)
    m.num_heads, m.n_groups = s.nheads, s.ngroups
    m.intermediate_size = s.nheads * P
    m.conv_dim = len(xbc)


@torch.no_grad()
def _shard_attention(a, config, rank: int, tp: int, group) -> None:
    q, kv = tpmod.attention_slices(rank, tp, config.num_attention_heads, config.num_key_value_heads, a.head_dim)
    _keep_rows(a.q_proj, q)
    _keep_rows(a.k_proj, kv)
    _keep_rows(a.v_proj, kv)
    _row_parallel(a.o_proj, q, rank, group)


@torch.no_grad()
def _shard_mlp(mlp, rank: int, tp: int, group) -> None:
    f = tpmod.even_slice(mlp.up_proj.out_features, rank, tp)
    _keep_rows(mlp.up_proj, f)
    _row_parallel(mlp.down_proj, f, rank, group)
    mlp.intermediate_size = f.stop - f.start


def shard_nemotron_h_(model, rank: int, tp: int, group=None):
    """Keep rank ``rank``'s share of every layer of ``model`` (in place) and sum the row-parallel
    outputs over ``group`` (``torch.distributed`` must be initialised when tp > 1). Returns model."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank: expected 0 <= rank < tp={tp}, got {rank}")
    if tp == 1:
        return model
    config = model.config
    tpmod.shard_plan(config.mamba_num_heads, config.n_groups, tp)  # raises naming what does not divide
    tpmod.check_dense_split(config.num_key_value_heads, config.intermediate_size, tp)
    bad = sorted({k for k in config.layers_block_type if k not in ("linear_attention", "full_attention", "mlp")})
    if bad:  # before any layer is changed: a refused model is left whole
        raise ValueError(f"tp={tp}: layer type {bad[0]!r} cannot be sharded (supported: linear_attention, "
                         "full_attention, mlp)")
    for layer, kind in zip(model.model.layers, config.layers_block_type):
        if kind == "linear_attention":
            _shard_mixer(layer.mixer, config, rank, tp, group)
        elif kind == "full_attention":
            _shard_attention(layer.mixer, config, rank, tp, group)
        else:  # "mlp" (checked above)
            _shard_mlp(layer.mixer, rank, tp, group)
    model.replayssm_tp = (rank, tp)  # (transformers owns `tp_size`)
    return model
