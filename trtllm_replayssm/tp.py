# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel sharding of a Mamba-2 layer's ReplaySSM decode by heads.

Rank r of tp owns heads [r*H/tp, (r+1)*H/tp): their rows of x, z, dt, dt_bias, A, D, of the
checkpoint and of the x/dt buffers. B and C (and the B buffer) follow the heads by group:
- ngroups % tp == 0: rank r owns groups [r*G/tp, (r+1)*G/tp) (each rank's heads cover whole groups);
- otherwise every rank keeps the groups its heads read (replicated across ranks), which must map
  uniformly onto its heads (heads per group divisible by heads per rank, or the reverse), since the
  kernels map local head h to local group h // (H_local / G_local).
The cursor is per slot and identical on every rank (each rank advances its own copy once per step).
The mixer's out_proj is row-parallel: each rank multiplies its heads' (gated, normalised) output by
its column slice of W_out and the partial results are summed (an all-reduce with NCCL in a real
deployment; :func:`row_parallel_sum` is the single-process reference of it).
"""

from __future__ import annotations

import dataclasses

import torch

from .costs import mamba2_layer_memory


@dataclasses.dataclass(frozen=True)
class HeadShard:
    rank: int
    tp: int
    head0: int
    nheads: int  # local
    group0: int
    ngroups: int  # local
    tp_nheads: int = 0  # global nheads / ngroups (0: unknown, for hand-built shards)
    tp_ngroups: int = 0

    @property
    def heads(self) -> slice:
        return slice(self.head0, self.head0 + self.nheads)

    @property
    def groups(self) -> slice:
        return slice(self.group0, self.group0 + self.ngroups)


def shard_plan(nheads: int, ngroups: int, tp: int) -> list[HeadShard]:
    """One :class:`HeadShard` per rank; raises ValueError naming what does not divide."""
    if tp < 1:
        raise ValueError(f"tp: expected >= 1, got {tp}")
    if nheads % tp:
        raise ValueError(f"nheads={nheads} must be divisible by tp={tp}")
    if nheads % ngroups:
        raise ValueError(f"ngroups={ngroups} must divide nheads={nheads}")
    hl, hpg = nheads // tp, nheads // ngroups
    if ngroups % tp and hpg % hl and hl % hpg:
        raise ValueError(f"tp={tp}: {hl} heads per rank straddle groups of {hpg} heads unevenly "
                         f"(nheads={nheads}, ngroups={ngroups})")
    shards = []
    for r in range(tp):
        h0 = r * hl
        g0, g1 = h0 // hpg, (h0 + hl - 1) // hpg + 1
        shards.append(HeadShard(r, tp, h0, hl, g0, g1 - g0, nheads, ngroups))
    return shards


def shard_step(shard: HeadShard, x, B, C, dt, z=None):
    """This rank's (x, B, C, dt, z) of one decode step (contiguous copies)."""
    h, g = shard.heads, shard.groups
    return (x[:, h].contiguous(), B[:, g].contiguous(), C[:, g].contiguous(), dt[:, h].contiguous(),
            None if z is None else z[:, h].contiguous())


def shard_params(shard: HeadShard, dt_bias, A, D):
    h = shard.heads
    return dt_bias[h].contiguous(), A[h].contiguous(), D[h].contiguous()


def shard_cache(shard: HeadShard, state, x_cache, B_cache, dt_cache):
    """This rank's checkpoint and buffers (copies; a deployment allocates them per rank directly)."""
    h, g = shard.heads, shard.groups
    return (state[:, h].contiguous(), x_cache[:, h].contiguous(), B_cache[:, g].contiguous(),
            dt_cache[:, h].contiguous())


def mixer_channels(shard: HeadShard, headdim: int, dstate: int, device=None):
    """Indices of this rank's channels in a Mamba-2 mixer laid out as NemotronH / Mamba-2 do.

    Returns (hp, xbc, in_rows): hp its x / z / norm / out_proj-column channels (local heads x
    headdim); xbc its conv channels (x of the local heads, then B and C of the local groups); in_rows
    its rows of in_proj, whose outputs are (z, xBC, dt)."""
    H, G, P, N, s = shard.tp_nheads, shard.tp_ngroups, headdim, dstate, shard
    idx = lambda a, b: torch.arange(a, b, device=device)  # noqa: E731
    hp = idx(s.head0 * P, (s.head0 + s.nheads) * P)
    gn = idx(s.group0 * N, (s.group0 + s.ngroups) * N)
    xbc = torch.cat([hp, H * P + gn, H * P + G * N + gn])
    in_rows = torch.cat([hp, H * P + xbc, 2 * H * P + 2 * G * N + idx(s.head0, s.head0 + s.nheads)])
    return hp, xbc, in_rows


def check_dense_split(num_key_value_heads: int, intermediate_size: int, tp: int) -> None:
    """Attention splits by KV heads and the MLP by columns: both must divide by tp (ValueError names which)."""
    for name, v in (("num_key_value_heads", num_key_value_heads), ("intermediate_size", intermediate_size)):
        if v % tp:
            raise ValueError(f"tp={tp}: {name}={v} must be divisible by tp")


def attention_slices(rank: int, tp: int, num_heads: int, num_key_value_heads: int, head_dim: int):
    """(q, kv): this rank's rows of q_proj (the query heads of its KV groups) and of k/v_proj."""
    kvh, rep = num_key_value_heads // tp, num_heads // num_key_value_heads
    return (slice(rank * kvh * rep * head_dim, (rank + 1) * kvh * rep * head_dim),
            slice(rank * kvh * head_dim, (rank + 1) * kvh * head_dim))


def even_slice(size: int, rank: int, tp: int) -> slice:
    """This rank's contiguous 1/tp of ``size`` (an MLP's intermediate columns)."""
    n = size // tp
    return slice(rank * n, (rank + 1) * n)


def local_bytes_per_slot(shard: HeadShard, headdim: int, dstate: int, buffer_len: int, state_bytes: int = 4,
                         act_bytes: int = 2) -> int:
    """Checkpoint + buffers of one slot on this rank, in bytes (:func:`.costs.mamba2_layer_memory`'s state + ring)."""
    m = mamba2_layer_memory(shard.nheads, headdim, dstate, shard.ngroups, buffer_len, 0, state_bytes, act_bytes)
    return m["state"] + m["ring"]


def row_parallel_sum(partials: list[torch.Tensor]) -> torch.Tensor:
    """Reference of the out_proj all-reduce: the sum of every rank's partial product."""
    out = partials[0].clone()
    for p in partials[1:]:
        out += p
    return out
