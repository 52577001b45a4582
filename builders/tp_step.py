# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel Nemotron-H decode step: :class:`TPDecodeStep`, one process per rank.

Megatron-style splits (Shoeybi et al. 2019, "Megatron-LM"), one all-reduce per mixer:

  Mamba-2   rank r owns the heads of :func:`trtllm_replayssm.tp.shard_plan` (H/tp contiguous heads)
            and the B/C groups they read (owned when G % tp == 0, else replicated). in_proj is
            column-parallel: its rows of z, x and dt for the local heads and of B and C for the
            local groups; the conv channels, conv weights and bias, A, D and dt_bias follow the
            same channels; the SSM backend allocates its state, checkpoint and x/B/dt buffers for
            the local (H, G) only. Gated RMSNorm: NemotronH normalises groups of H*P/G channels,
            i.e. exactly the heads of one B/C group, so with owned groups every norm group is
            local and the result is unchanged; with replicated groups a norm group spans ranks
            and its sum of squares is all-reduced first (a (batch, G) tensor). out_proj is
            row-parallel: the columns of the local heads, partial products all-reduced, bias
            (if any) added once after the sum.
  attention split by KV groups (kvh % tp == 0): q rows of the local KV groups' query heads, k/v
            rows of the local KV heads, the KV cache holds kvh/tp heads; o_proj row-parallel.
  MLP       up_proj column-parallel (intermediate / tp rows), down_proj row-parallel.
  replicated  embeddings, every pre-norm, norm_f and lm_head: each rank computes the full logits
            (no gather; lm_head costs vocab*hidden bytes per step on every rank, ~1 GB for the
            real vocab, documented in bench/NOTES.md). ids, lengths and the cursor are per-rank
            copies that stay identical (every rank sees the same all-reduced hidden state).

Per step and rank: one all-reduce of (batch, hidden) per layer (plus one (batch, G) per Mamba layer
with replicated groups). Every rank builds the full model from the same seed and slices it (the
simplest route to identical weights; memory is not the point of this TP). ``dist`` must be
initialised (gloo on the CPU, NCCL on GPUs with NVLink multicast off, see scripts/bench_e2e.py);
``tp=1`` needs no process group and reproduces :class:`~builders.model_step.DecodeStep`.
"""

from __future__ import annotations

import torch

from trtllm_replayssm import tp as tpmod

from .model_step import DecodeStep, SSMMode


class TPDecodeStep(DecodeStep):
    """:class:`DecodeStep` on rank ``rank`` of ``tp``; same attributes, local shapes:
    ``conv[i]`` (batch, Hl*P + 2*Gl*N, K-1), ``k/v[i]`` (batch, kvh/tp, kv_len, hd), logits full."""

    def __init__(self, model, batch: int, kv_len: int, ssm: SSMMode, rank: int = 0, tp: int = 1, group=None):
        self.rank, self.tp, self.group = rank, tp, group
        super().__init__(model, batch, kv_len, ssm)

    def _shard(self) -> None:
        cfg, r, n = self.cfg, self.rank, self.tp
        H, P, N, G = self.H, self.P, self.N, self.G
        tpmod.check_dense_split(cfg.num_key_value_heads, cfg.intermediate_size, n)
        self.shard = s = tpmod.shard_plan(H, G, n)[r]
        self.groups_owned = self.norm_groups_local = G % n == 0
        hp, xbc, rows = tpmod.mixer_channels(s, P, N, self.device)  # heads' channels, conv channels, in_proj rows
        for i in self.mamba:
            c = self.consts[i]
            for k in ("A", "D", "dt_bias"):
                c[k] = c[k][s.heads].contiguous()
            c["conv_w"] = c["conv_w"][xbc].contiguous()
            c["conv_b"] = None if c["conv_b"] is None else c["conv_b"][xbc].contiguous()
            w = self.w[i]
            w["in_w"] = w["in_w"][rows].contiguous()
            w["in_b"] = None if w["in_b"] is None else w["in_b"][rows].contiguous()
            w["out_w"] = w["out_w"][:, hp].contiguous()
            w["norm_w"] = w["norm_w"][hp].contiguous()
        kvh, rep = cfg.num_key_value_heads // n, cfg.num_attention_heads // cfg.num_key_value_heads
        q, kv = tpmod.attention_slices(r, n, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        for i in self.attn:
            w = self.w[i]
            for name, sl in (("q", q), ("k", kv), ("v", kv)):
                w[f"{name}_w"] = w[f"{name}_w"][sl].contiguous()
                w[f"{name}_b"] = None if w[f"{name}_b"] is None else w[f"{name}_b"][sl].contiguous()
            w["o_w"] = w["o_w"][:, q].contiguous()
        f = tpmod.even_slice(cfg.intermediate_size, r, n)
        for i, kind in enumerate(self.kinds):
            if kind == "mlp":
                w = self.w[i]
                w["up_w"] = w["up_w"][f].contiguous()
                w["up_b"] = None if w["up_b"] is None else w["up_b"][f].contiguous()
                w["down_w"] = w["down_w"][:, f].contiguous()
        self.H, self.G = s.nheads, s.ngroups
        self.nh, self.kvh = kvh * rep, kvh

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def _group_var(self, g: torch.Tensor) -> torch.Tensor:
        if self.groups_owned:  # every norm group is one of this rank's whole B/C groups
            return super()._group_var(g)
        # replicated groups: this rank's heads are part of one norm group (shard_plan guarantees it)
        b, s = g.shape[0], self.shard
        sums = torch.zeros(b, self.cfg.n_groups, dtype=g.dtype, device=g.device)
        sums[:, s.group0] = g.pow(2).sum(-1)
        self._reduce(sums)
        group_size = self.cfg.mamba_num_heads * self.P // self.cfg.n_groups
        return (sums[:, s.group0] / group_size).view(b, 1, 1)
