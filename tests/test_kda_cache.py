# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache with Kimi Delta Attention layers (the family interface's third family; CPU: the float64 spec).

The cache takes KDA layers through its one API (``for_family("kda", ...)``, ``load_prefill``, ``verify``,
``conv_update``, ``commit``, ``committed_state``, snapshots) with no KDA-named method. Oracle: the conventional
recurrence (families/kda/reference.py ``conventional_step``) on float64 state, per accepted token; both sides are
float64, so the tolerance is summation order only (1e-10 relative to the output scale). Standard and ring cursors,
random acceptance, padding rows, and a mixed cache (Mamba-2 layers first, KDA layers after) whose layer indices
run across the families."""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_replayssm.cache import ReplayStateCache, Snapshot
from trtllm_replayssm.families.kda import reference as kda

F64 = torch.float64
H, K, V, L = 2, 16, 8, 6
TOL = 1e-10  # float64 on both sides: summation order only


def _params(gen):
    A_log = torch.log(torch.rand(H, generator=gen, dtype=F64) * 1.45 + 0.05)
    dt0 = torch.exp(torch.rand(H, K, generator=gen, dtype=F64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return A_log, dt0 + torch.log(-torch.expm1(-dt0))


def _tokens(gen, batch, T):
    def rnd(*shape, shift=0.0):
        return torch.randn(batch, T, *shape, generator=gen, dtype=F64) + shift
    return rnd(H, K), rnd(H, K), rnd(H, V), rnd(H, K), rnd(H, shift=1.0)


@pytest.mark.parametrize("cursor,T,mixed,lower_bound,phases", [
    ("standard", 1, False, None, False), ("ring", 2, False, None, False), ("ring", 3, True, -5.0, False),
    ("standard", 1, True, -5.0, False), ("standard", 1, False, None, True), ("ring", 2, True, -5.0, True)])
def test_kda_layers_follow_the_recurrence(cursor, T, mixed, lower_bound, phases):
    """``phases``: the cache's flush phases (counts start at 0, 1, 2 over zeroed ring entries), same oracle."""
    gen = torch.Generator().manual_seed(11)
    slots, batch, layers = 5, 3, 2
    kw = dict(num_draft=T - 1, cursor=cursor, state_dtype=F64, act_dtype=F64, dt_dtype=F64, flush_phases=phases)
    if mixed:
        cache = ReplayStateCache(num_slots=slots, buffer_len=L, layers={"mamba2": (1, (4, 4, 6, 2)),
                                                                        "kda": (layers, (H, K, V))}, **kw)
    else:
        cache = ReplayStateCache.for_family("kda", layers, slots, (H, K, V), L, **kw)
    k0 = cache.first_layer("kda")
    assert k0 == (1 if mixed else 0) and cache.total_layers == k0 + layers
    assert [cache.layer_family(i) for i in range(cache.total_layers)] == ["mamba2"] * k0 + ["kda"] * layers
    live = [cache.allocate() for _ in range(batch)]
    assert [cache.phase(s) for s in live] == [i % cache.phase_span if phases else 0 for i in range(batch)]
    prm = [_params(gen) for _ in range(layers)]
    ref = torch.zeros(layers, slots, H, K, V, dtype=F64)
    for l in range(layers):
        for s in live:
            S0 = torch.randn(H, K, V, generator=gen, dtype=F64) * 0.3
            cache.load_prefill(s, k0 + l, S0)
            ref[l, s] = S0
    sbi = torch.tensor(live + [-1], dtype=torch.int32)  # a padding row
    worst, flushes = 0.0, 0
    for _ in range(3 * L + 2):
        folds = cache.flush(sbi, T)
        flushes += len(folds)
        x = [_tokens(gen, batch + 1, T) for _ in range(layers)]
        ys = [cache.verify(k0 + l, *x[l], *prm[l], state_batch_indices=sbi, lower_bound=lower_bound)
              for l in range(layers)]
        if mixed:  # the Mamba-2 layer must run too (a step verifies every layer once)
            m = dict(x=torch.randn(batch + 1, T, 4, 4, generator=gen, dtype=F64),
                     B=torch.randn(batch + 1, T, 2, 6, generator=gen, dtype=F64),
                     C=torch.randn(batch + 1, T, 2, 6, generator=gen, dtype=F64),
                     dt=torch.randn(batch + 1, T, 4, generator=gen, dtype=F64))
            cache.verify(0, **m, dt_bias=torch.zeros(4, dtype=F64), A=-torch.ones(4, dtype=F64),
                         D=torch.zeros(4, dtype=F64), state_batch_indices=sbi)
        for l in range(layers):
            assert torch.isnan(ys[l][batch]).all(), "the padding row's outputs stay NaN on the reference"
        n = None if cursor == "standard" else torch.randint(1, T + 1, (batch + 1,), generator=gen, dtype=torch.int32)
        for r, s in enumerate(live):
            one = torch.tensor([s], dtype=torch.int32)
            for t in range(1 if n is None else int(n[r])):
                for l in range(layers):
                    q, k, v, f, b = (a[r:r + 1, t] for a in x[l])
                    y = kda.conventional_step(ref[l], q, k, v, f, b, *prm[l], state_batch_indices=one,
                                              lower_bound=lower_bound)
                    worst = max(worst, (y[0] - ys[l][r, t]).abs().max().item())
        cache.commit(sbi, n, T)
        for l in range(layers):
            for s in live:
                worst = max(worst, (cache.committed_state(k0 + l, s) - ref[l, s]).abs().max().item())
    assert flushes > 0, "the schedule must fold checkpoints"
    assert worst < TOL, worst


def test_kda_snapshot_restore_continues_bit_identically():
    gen = torch.Generator().manual_seed(3)
    mk = dict(num_draft=1, state_dtype=F64, act_dtype=F64, dt_dtype=F64, shadow_dtype=torch.bfloat16)
    a = ReplayStateCache.for_family("kda", 1, 3, (H, K, V), 4, **mk)
    b = ReplayStateCache.for_family("kda", 1, 3, (H, K, V), 4, **mk)
    assert a.layer(0).shadow is not None
    sa = a.allocate()
    b.allocate(), b.allocate()  # the request moves into b's slot 1
    prm = _params(gen)
    a.load_prefill(sa, 0, torch.randn(H, K, V, generator=gen, dtype=F64))
    for step in range(7):
        x = _tokens(gen, 1, 2)
        if step == 3:  # move the request from cache a to cache b, slot 1, through bytes
            snap = Snapshot.from_bytes(a.snapshot([sa]).to_bytes())
            assert set(snap.tensors) == {"kda_state", "kda_shadow", "kda_k_cache", "kda_u_cache", "kda_g_cache",
                                         "kda_v_cache", "kda_beta_cache", "kda_conv", "cursor"}
            b.restore([1], snap)
        outs = []
        for c, s in ((a, sa),) + (((b, 1),) if step >= 3 else ()):
            sbi = torch.tensor([s], dtype=torch.int32)
            c.flush(sbi, 2)
            outs.append(c.verify(0, *x, *prm, state_batch_indices=sbi))
            c.commit(sbi, torch.tensor([1 + step % 2], dtype=torch.int32), 2)
        if len(outs) == 2:
            assert torch.equal(outs[0], outs[1])
            assert torch.equal(a.committed_state(0, sa), b.committed_state(0, 1))


def test_kda_cache_errors_name_the_argument():
    cache = ReplayStateCache.for_family("kda", 1, 2, (H, K, V), L, cursor="standard", state_dtype=F64, act_dtype=F64)
    s = cache.allocate()
    with pytest.raises(ValueError, match=r"state: expected shape \(2, 16, 8\)"):
        cache.load_prefill(s, 0, torch.zeros(H, V, K, dtype=F64))
    with pytest.raises(TypeError, match="verify: kda layer: .*missing a required argument: 'dt_bias'"):
        cache.verify(0, *_tokens(torch.Generator(), 1, 1), torch.zeros(H, dtype=F64))
    with pytest.raises(ValueError, match="layers: expected families among"):
        ReplayStateCache(num_slots=2, buffer_len=L, layers={"nope": (1, (1, 1, 1))})
    with pytest.raises(ValueError, match="shadow_dtype: a model with KDA layers keeps a bfloat16 shadow only"):
        ReplayStateCache.for_family("kda", 1, 2, (H, K, V), L, shadow_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="family: the cache holds no .gdn. layers"):
        cache.first_layer("gdn")
