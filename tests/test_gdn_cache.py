# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache with Gated DeltaNet layers (CPU path: the float64 spec), alone and next to Mamba-2 layers.

Oracle: the conventional GDN recurrence (gdn_reference.conventional_step) fed each row's accepted tokens
in order, and for the Mamba-2 layers of a mixed cache the conventional Mamba-2 recurrence; float64
tensors throughout, so agreement is to ~1e-12. The conv windows are checked against the plain causal
conv of the accepted inputs. Both kinds share one cursor, one flush decision and one commit."""

import pytest
import torch

from trtllm_replayssm.cache import ReplayStateCache
from trtllm_replayssm.families.gdn import reference as gref
from trtllm_replayssm.families.mamba2 import reference as mref

F64 = torch.float64
HV, HK, V, KD, L, T = 4, 2, 8, 6, 8, 3


def _gdn_inputs(gen, batch, T):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    return dict(q=r(batch, T, HK, KD), k=r(batch, T, HK, KD), v=r(batch, T, HV, V), a=r(batch, T, HV),
                b=r(batch, T, HV))


def _run(mixed: bool, steps: int = 40, shadow=None, T: int = T, cursor: str = "ring", phases: bool = False):
    gen = torch.Generator().manual_seed(5)
    slots, batch = 5, 3
    kw = dict(num_draft=T - 1, cursor=cursor, state_dtype=F64, act_dtype=F64, dt_dtype=F64, shadow_dtype=shadow,
              read_shadow=shadow is not None, flush_phases=phases)
    H, P, N, G = 4, 4, 6, 2
    layers = ({"mamba2": (1, (H, P, N, G))} if mixed else {}) | {"gdn": (2, (HV, HK, V, KD))}
    cache = ReplayStateCache(num_slots=slots, buffer_len=L, layers=layers, **kw)
    g0 = cache.first_layer("gdn")  # the cache numbers its GDN layers after its Mamba-2 ones
    live = [cache.allocate() for _ in range(batch)]
    A_log = torch.randn(2, HV, generator=gen, dtype=F64) * 0.3
    dt_bias = torch.randn(2, HV, generator=gen, dtype=F64) * 0.3
    ref = torch.zeros(2, slots, HV, V, KD, dtype=F64)
    for l in range(2):  # prefill hand-off: a random checkpoint
        for s in live:
            S0 = torch.randn(HV, V, KD, generator=gen, dtype=F64)
            cache.load_prefill(s, g0 + l, S0)
            ref[l, s] = S0
    m = dict(A=-torch.rand(H, generator=gen, dtype=F64), D=torch.randn(H, generator=gen, dtype=F64),
             dt_bias=torch.randn(H, generator=gen, dtype=F64) * 0.3)
    mref_state = torch.zeros(slots, H, P, N, dtype=F64)
    sbi = torch.tensor(live, dtype=torch.int32)[torch.randperm(batch, generator=gen)]
    worst = 0.0
    for _ in range(steps):
        cache.flush(sbi, T, [m["A"]] if mixed else [])
        x = [_gdn_inputs(gen, batch, T) for _ in range(2)]
        ys = [cache.verify(g0 + l, **x[l], A_log=A_log[l], dt_bias=dt_bias[l], state_batch_indices=sbi) for l in range(2)]
        if mixed:
            mx = dict(x=torch.randn(batch, T, H, P, generator=gen, dtype=F64),
                      B=torch.randn(batch, T, G, N, generator=gen, dtype=F64),
                      C=torch.randn(batch, T, G, N, generator=gen, dtype=F64),
                      dt=torch.randn(batch, T, H, generator=gen, dtype=F64))
            ym = cache.verify(0, **mx, dt_bias=m["dt_bias"], A=m["A"], D=m["D"], state_batch_indices=sbi)
        n = torch.randint(1, T + 1, (batch,), generator=gen, dtype=torch.int32)
        for r, s in enumerate(sbi.tolist()):
            one = torch.tensor([s], dtype=torch.int32)
            for t in range(int(n[r])):
                for l in range(2):
                    y = gref.conventional_step(ref[l], **{k_: v_[r:r + 1, t] for k_, v_ in x[l].items()},
                                               A_log=A_log[l], dt_bias=dt_bias[l], state_batch_indices=one)
                    worst = max(worst, (y[0] - ys[l][r, t]).abs().max().item())
                if mixed:
                    y = mref.conventional_step(mref_state, *(mx[k_][r:r + 1, t] for k_ in ("x", "B", "C", "dt")),
                                               m["dt_bias"], m["A"], m["D"], state_batch_indices=one)
                    worst = max(worst, (y[0] - ym[r, t]).abs().max().item())
        cache.commit(sbi, n, T)
        for l in range(2):
            for s in live:
                worst = max(worst, (cache.committed_state(g0 + l, s) - ref[l, s]).abs().max().item())
        sbi = sbi[torch.randperm(batch, generator=gen)]
    return cache, worst


@pytest.mark.parametrize("mixed", [False, True])
def test_gdn_layers_follow_the_recurrence_over_40_random_acceptance_steps(mixed):
    cache, worst = _run(mixed)
    assert worst < 1e-10, worst  # float64 tensors: the replay algebra is exact to rounding
    count = cache.cursor[:, 1]
    assert int(count.min()) >= 0 and int(count.max()) <= L - T  # after any commit count <= L - T (flush rule)
    assert int(cache.cursor[:, 0].max()) < L


@pytest.mark.parametrize("mixed", [False, True])
def test_standard_cursor_follows_the_recurrence(mixed):
    """cursor='standard': T = 1 through the standard decode steps (Mamba-2 and GDN) on the (slots,) cursor."""
    cache, worst = _run(mixed, T=1, cursor="standard")
    assert worst < 1e-10, worst
    assert cache.cursor.shape == (5,) and int(cache.cursor.max()) < L


@pytest.mark.parametrize("cursor, mixed, shadow", [("standard", True, None), ("ring", False, None),
                                                   ("ring", True, torch.bfloat16)])
def test_flush_phases_follow_the_recurrence(cursor, mixed, shadow):
    """flush_phases: the requests start at counts 0, 1, 2 over zeroed ring entries (identity entries: g = 0,
    beta = 0) and still follow the conventional recurrence (with a shadow read: to its rounding)."""
    T_ = 1 if cursor == "standard" else T
    cache, worst = _run(mixed, steps=2 * L + 3, T=T_, cursor=cursor, phases=True, shadow=shadow)
    assert [cache.phase(s) for s in range(3)] == [i % cache.phase_span for i in range(3)] and cache.phase_span > 1
    assert worst < (1e-10 if shadow is None else 5e-2), worst


def test_gdn_shadow_read_stays_close_and_flushes_exactly():
    _, exact = _run(False, steps=20)
    _, shadowed = _run(False, steps=20, shadow=torch.bfloat16)
    assert exact < 1e-10 and 1e-6 < shadowed < 5e-2, (exact, shadowed)  # bf16-shadow reads, never compounded


def test_reset_and_validation():
    cache = ReplayStateCache.for_family("gdn", 2, 3, (HV, HK, V, KD), L, num_draft=1)
    s = cache.allocate()
    g = cache.group("gdn")
    g.t["u_cache"][:, s] = 1.0
    g.conv[:, s] = 1.0
    cache.free(s)
    assert cache.allocate() == s and not g.t["u_cache"][:, s].any() and not g.conv[:, s].any()
    with pytest.raises(ValueError, match="geometry: gdn key_heads: expected a divisor of value_heads=4, got 3"):
        ReplayStateCache.for_family("gdn", 1, 2, (4, 3, V, KD), L)
    with pytest.raises(ValueError, match="layers: expected at least one layer"):
        ReplayStateCache(0, 2, 1, 1, 1, 1, L)
    with pytest.raises(ValueError, match="layers: expected at least one layer"):
        ReplayStateCache(num_slots=2, buffer_len=L, layers={"gdn": (0, (HV, HK, V, KD))})
    with pytest.raises(TypeError, match="nheads: the positional form's sizes; with layers="):
        ReplayStateCache(num_slots=2, nheads=4, buffer_len=L, layers={"gdn": (1, (HV, HK, V, KD))})
    with pytest.raises(ValueError, match="state: expected shape"):
        cache.load_prefill(s, 0, torch.zeros(HV, KD, V + 1))
    with pytest.raises(ValueError, match="slot 2 is not allocated"):
        cache.flush(torch.tensor([2], dtype=torch.int32), 2, [])
    with pytest.raises(IndexError, match="layer: expected 0 <= layer < 2, got 2"):
        cache.layer(2)


def test_a_failed_gdn_verify_leaves_the_checkpoint_as_it_was():
    """A bad input at a window that folds first: refused before the fold (the reference used to fold, then check)."""
    gen = torch.Generator().manual_seed(8)
    cache = ReplayStateCache.for_family("gdn", 1, 2, (HV, HK, V, KD), L, num_draft=1, state_dtype=F64, act_dtype=F64,
                                        dt_dtype=F64)
    s = cache.allocate()
    cache.load_prefill(s, 0, torch.randn(HV, V, KD, generator=gen, dtype=F64))
    sbi = torch.tensor([s], dtype=torch.int32)
    A_log, dt_bias = torch.zeros(HV, dtype=F64), torch.zeros(HV, dtype=F64)
    for _ in range(3):  # count 6 of 8: the next T = 2 window folds first
        cache.flush(sbi, 2, [])
        cache.verify(0, **_gdn_inputs(gen, 1, 2), A_log=A_log, dt_bias=dt_bias, state_batch_indices=sbi)
        cache.commit(sbi, torch.tensor([2], dtype=torch.int32), 2)
    assert cache.cursor[s].tolist() == [0, 6]
    before = cache.group("gdn").t["state"][0, s].clone()
    cache.flush(sbi, 2, [])
    bad = {**_gdn_inputs(gen, 1, 2), "a": torch.zeros(1, 2, HV + 1, dtype=F64)}
    with pytest.raises(ValueError, match=r"a: expected shape \(1, 2, 4\)"):
        cache.verify(0, **bad, A_log=A_log, dt_bias=dt_bias, state_batch_indices=sbi)
    assert torch.equal(cache.group("gdn").t["state"][0, s], before)


@pytest.mark.parametrize("cursor", ["ring", "standard"])
def test_a_gdn_verify_with_a_bad_out_or_twice_in_a_step_leaves_the_checkpoint(cursor):
    """``out`` is checked before the fold writes the checkpoint (the reference used to fold, then fail writing the
    outputs), and a second gdn_verify of a layer in one step, which would fold it again, is refused."""
    gen = torch.Generator().manual_seed(8)
    ring = cursor == "ring"
    cache = ReplayStateCache.for_family("gdn", 1, 2, (HV, HK, V, KD), L if ring else 1, num_draft=1 if ring else 0,
                                        cursor=cursor, state_dtype=F64, act_dtype=F64, dt_dtype=F64)
    s = cache.allocate()
    cache.load_prefill(s, 0, torch.randn(HV, V, KD, generator=gen, dtype=F64))
    sbi = torch.tensor([s], dtype=torch.int32)
    A_log, dt_bias = torch.zeros(HV, dtype=F64), torch.zeros(HV, dtype=F64)
    T = 2 if ring else 1
    for _ in range(3 if ring else 0):  # count 6 of 8: the next T = 2 window folds first (standard: L = 1, every step)
        cache.flush(sbi, T, [])
        cache.verify(0, **_gdn_inputs(gen, 1, T), A_log=A_log, dt_bias=dt_bias, state_batch_indices=sbi)
        cache.commit(sbi, torch.tensor([T], dtype=torch.int32), T)
    before = cache.group("gdn").t["state"][0, s].clone()
    cache.flush(sbi, T, [])
    x = _gdn_inputs(gen, 1, T)
    with pytest.raises(ValueError, match=r"out: expected shape"):
        cache.verify(0, **x, A_log=A_log, dt_bias=dt_bias, state_batch_indices=sbi,
                         out=torch.empty(1, T, HV, V + 1, dtype=F64))
    assert torch.equal(cache.group("gdn").t["state"][0, s], before)
    cache.verify(0, **x, A_log=A_log, dt_bias=dt_bias, state_batch_indices=sbi)
    folded = cache.group("gdn").t["state"][0, s].clone()
    assert not torch.equal(folded, before)
    with pytest.raises(RuntimeError, match=r"verify: layer 0 already ran in this step"):
        cache.verify(0, **x, A_log=A_log, dt_bias=dt_bias, state_batch_indices=sbi)
    assert torch.equal(cache.group("gdn").t["state"][0, s], folded)
