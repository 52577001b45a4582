# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache: slot lifecycle, prefill hand-off, speculative steps over several layers, memory model.

Oracles and precision:
- Per request and layer, a conventional float64 state advanced by :func:`reference.conventional_step`
  over the accepted tokens only, and the full committed conv input history fed to
  torch.nn.functional.conv1d. The cache runs with float64 state and activations, so agreement is to
  rounding: RTOL = 1e-10 (different summation order over tens of steps with flushes).
- Bookkeeping (cursors, recycled vs fresh slots, slots outside the batch, prefill hand-off) is compared
  exactly (torch.equal, i.e. rtol = atol = 0).
"""

import pytest
import torch
import torch.nn.functional as F

from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.cache import ReplayStateCache, memory_per_request
from trtllm_replayssm.families.mamba2 import reference as ref

from .problems import GEOMETRIES, make_params

F64 = torch.float64
RTOL = 1e-10  # float64 both sides; summation order only
GEOM = dict(nheads=4, headdim=8, dstate=8, ngroups=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def _cache(layers=2, slots=3, L=8, num_draft=3, K=4, cls=ReplayStateCache, **kw):
    return cls(layers, slots, **GEOM, buffer_len=L, num_draft=num_draft, conv_kernel=K,
               **{"state_dtype": F64, "act_dtype": F64, "dt_dtype": F64, **kw})


def _inputs(batch, T, c, gen):
    H, P, N, G = c.nheads, c.headdim, c.dstate, c.ngroups
    x = torch.randn(batch, T, H, P, generator=gen, dtype=F64)
    B = torch.randn(batch, T, G, N, generator=gen, dtype=F64) * N ** -0.5 * 4
    C = torch.randn(batch, T, G, N, generator=gen, dtype=F64) * N ** -0.5 * 4
    dt = torch.randn(batch, T, H, generator=gen, dtype=F64) - 2.0
    u = torch.randn(batch, T, c.conv_dim, generator=gen, dtype=F64)
    return x, B, C, dt, u


def _slot_tensors(c, slot):
    return [t[:, slot].clone() for t in c._tensors()] + [c.cursor[slot].clone()]


def test_lifecycle_and_errors():
    c = _cache()
    assert [c.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="all 3 slots are live"):
        c.allocate()
    c.free(1)
    with pytest.raises(ValueError, match="slot 1 is not allocated"):
        c.free(1)
    with pytest.raises(ValueError, match="verify: slot 1 is not allocated"):
        x, B, C, dt, _ = _inputs(1, 2, c, torch.Generator().manual_seed(0))
        p = torch.zeros(4, dtype=F64)
        c.verify(0, x, B, C, dt, p, p, p, None, torch.tensor([1], dtype=torch.int32))
    assert c.allocate() == 1 and c.num_free == 0
    with pytest.raises(ValueError, match=r"buffer_len: expected >= 2 \* \(num_draft \+ 1\) = 8"):
        _cache(L=7)
    with pytest.raises(ValueError, match="shadow_dtype"):
        _cache(shadow_dtype=torch.float32)
    with pytest.raises(ValueError, match="ngroups: expected a divisor of nheads=4, got 3"):
        ReplayStateCache(1, 1, 4, 8, 8, 3, 8)


def _spec_step(c, sbi, T, prm, weights, gen, nacc=None):
    """One model step over all layers; returns (ys, conv outs, inputs, nacc)."""
    batch = sbi.shape[0]
    c.last_flushed = c.flush(sbi, T, [p.A for p in prm])
    ys, outs, ins = [], [], []
    for l in range(c.num_layers):
        x, B, C, dt, u = _inputs(batch, T, c, gen)
        ys.append(c.verify(l, x, B, C, dt, prm[l].dt_bias, prm[l].A, prm[l].D, None, sbi))
        outs.append(c.conv_update(l, u, *weights[l], sbi))
        ins.append((x, B, C, dt, u))
    if nacc is None:
        nacc = torch.randint(1, T + 1, (batch,), generator=gen, dtype=torch.int32)
    c.commit(sbi, nacc, T)
    return ys, outs, ins, nacc


def _layer_params(layers, c, gen):
    prm = [make_params(c.nheads, gen) for _ in range(layers)]
    prm = [type(p)(*(t.to(F64) for t in (p.dt_bias, p.A, p.D))) for p in prm]
    weights = [(torch.randn(c.conv_dim, c.conv_kernel, generator=gen, dtype=F64),
                torch.randn(c.conv_dim, generator=gen, dtype=F64)) for _ in range(layers)]
    return prm, weights


def test_recycled_slot_equals_fresh_slot():
    gen = torch.Generator().manual_seed(1)
    used, fresh = _cache(), _cache()
    prm, weights = _layer_params(2, used, gen)
    s = used.allocate()
    used.load_prefill(s, 0, torch.randn(4, 8, 8, dtype=F64), torch.randn(used.conv_dim, 3, dtype=F64))
    sbi = torch.tensor([s], dtype=torch.int32)
    for _ in range(5):
        _spec_step(used, sbi, 4, prm, weights, gen)
    assert used.cursor[s].tolist() != [0, 0]
    used.free(s)
    assert used.allocate() == s and fresh.allocate() == s
    for a, b in zip(_slot_tensors(used, s), _slot_tensors(fresh, s)):
        assert torch.equal(a, b)  # exact: nothing stale survives a reset
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    r1 = _spec_step(used, sbi, 4, prm, weights, g1)
    r2 = _spec_step(fresh, sbi, 4, prm, weights, g2)
    for a, b in zip(r1[0] + r1[1], r2[0] + r2[1]):
        assert torch.equal(a, b)
    for a, b in zip(_slot_tensors(used, s), _slot_tensors(fresh, s)):
        assert torch.equal(a, b)


def test_load_prefill_hands_off_state_and_conv():
    c = _cache(shadow_dtype=torch.bfloat16)
    s = c.allocate()
    c.cursor[s] = torch.tensor([5, 2], dtype=torch.int32)  # whatever was there before
    S = torch.randn(4, 8, 8, dtype=F64)
    conv = torch.randn(c.conv_dim, 3, dtype=F64)
    c.load_prefill(s, 1, S, conv)
    lay = c.layer(1)
    assert torch.equal(lay.state[s], S) and c.cursor[s].tolist() == [0, 0]
    assert torch.equal(lay.conv[s][:, -3:], conv) and not lay.conv[s][:, :-3].any()
    assert not lay.x_cache[s].any() and not lay.B_cache[s].any() and not lay.dt_cache[s].any()
    assert torch.equal(lay.shadow[s], S.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"conv_state: expected shape \(64, 3\), got \(64, 2\)"):
        c.load_prefill(s, 1, S, conv[:, :2])
    with pytest.raises(ValueError, match="load_prefill: slot 2 is not allocated"):
        c.load_prefill(2, 0, S, conv)


@pytest.mark.parametrize("shadow", [torch.bfloat16, torch.float8_e4m3fn])
def test_shadow_follows_checkpoint_on_flush(shadow):
    gen = torch.Generator().manual_seed(2)
    c = _cache(shadow_dtype=shadow)
    prm, weights = _layer_params(2, c, gen)
    s = c.allocate()
    for l in range(2):
        c.load_prefill(s, l, torch.randn(4, 8, 8, dtype=F64))
    sbi = torch.tensor([s], dtype=torch.int32)
    flushed = False
    for _ in range(4):
        flushed |= bool(c.flush(sbi, 4, [p.A for p in prm]))
        for l in range(2):
            lay = c.layer(l)
            deq = lay.shadow[s].double() * (1.0 if lay.shadow_scale is None else lay.shadow_scale[s][..., None].double())
            # bf16: 8 mantissa bits -> rel 2^-8 per element; fp8 e4m3 with per-row amax scale: 2^-4 at worst
            # per element, ~2^-5 in norm; 0.05 bounds both
            assert (deq - lay.state[s]).norm() / lay.state[s].norm() < (4e-3 if shadow == torch.bfloat16 else 0.05)
        _spec_step(c, sbi, 4, prm, weights, gen, nacc=torch.tensor([4], dtype=torch.int32))
    assert flushed


@pytest.mark.parametrize("T, cursor, phases", [(2, "ring", False), (4, "ring", False), (1, "ring", False),
                                               (1, "standard", False), (2, "ring", True), (1, "standard", True)])
def test_continuous_batching_against_oracle(T, cursor, phases):
    """7 requests through 3 slots, 2 layers, a padding row, random acceptance, slots recycled. T = 1: standard
    decode, on the ring (num_draft = 0) and on the (slots,) cursor of the standard decode kernel. ``phases``: the
    cache's flush phases (each request's count starts over zeroed entries), against the same oracle."""
    gen = torch.Generator().manual_seed(T)
    c = _cache(layers=2, slots=3, L=9 if T > 1 else 5, num_draft=3 if T > 1 else 0, cursor=cursor,
               flush_phases=phases)
    prm, weights = _layer_params(2, c, gen)
    K = c.conv_kernel
    pending = list(range(7))
    live = {}  # slot -> dict(req, left, S (per layer), hist (per layer))
    flushes, allocations = 0, 0
    for _step in range(30):
        while pending and c.num_free:
            req = pending.pop(0)
            s = c.allocate()
            allocations += 1
            S = [torch.randn(4, 8, 8, generator=gen, dtype=F64) for _ in range(2)]
            hist = [torch.randn(c.conv_dim, K - 1, generator=gen, dtype=F64) for _ in range(2)]
            for l in range(2):
                c.load_prefill(s, l, S[l], hist[l])
            live[s] = dict(req=req, left=int(torch.randint(2, 8, (1,), generator=gen)), S=S, hist=hist)
            count = int(c.cursor[s]) if cursor == "standard" else int(c.cursor[s, 1])
            assert count == c.phase(s) == ((allocations - 1) % c.phase_span if phases else 0)
        if not live:
            break
        slots = sorted(live)
        sbi = torch.tensor(slots + [-1], dtype=torch.int32)  # one padding row at the end
        idle = [s for s in range(c.num_slots) if s not in live]
        idle_before = [_slot_tensors(c, s) for s in idle]
        ys, outs, ins, nacc = _spec_step(c, sbi, T, prm, weights, gen)
        flushes += len(c.last_flushed)
        for now, then in zip([_slot_tensors(c, s) for s in idle], idle_before):
            assert all(torch.equal(a, b) for a, b in zip(now, then))  # exact
        for l in range(2):
            assert torch.isnan(ys[l][-1]).all() and torch.isnan(outs[l][-1]).all()
            assert outs[l].is_contiguous()  # callers slice x | B | C (q | k | v) from it and hand them to the kernels
        one = torch.tensor([0], dtype=torch.int32)
        for b, s in enumerate(slots):
            r = live[s]
            n = int(nacc[b])
            for l in range(2):
                x, B, C, dt, u = ins[l]
                S_try = r["S"][l][None].clone()
                for t in range(T):
                    y_or = ref.conventional_step(S_try, x[b:b + 1, t], B[b:b + 1, t], C[b:b + 1, t], dt[b:b + 1, t],
                                                 prm[l].dt_bias, prm[l].A, prm[l].D, None, one)[0]
                    assert torch.allclose(ys[l][b, t], y_or, rtol=RTOL, atol=RTOL * float(y_or.abs().max()))
                    if t + 1 == n:
                        r["S"][l] = S_try[0].clone()
                seq = torch.cat([r["hist"][l][:, -(K - 1):], u[b].T], dim=1)
                o = F.silu(F.conv1d(seq[None], weights[l][0][:, None], weights[l][1], groups=c.conv_dim))[0].T
                assert torch.allclose(outs[l][b], o, rtol=1e-12, atol=1e-12)  # K-term sums, different order
                r["hist"][l] = torch.cat([r["hist"][l], u[b, :n].T], dim=1)
                assert torch.equal(c.conv[l, s][:, -(K - 1):], r["hist"][l][:, -(K - 1):])  # exact
                S_now = c.committed_state(l, s, prm[l].A)
                assert torch.allclose(S_now, r["S"][l], rtol=RTOL, atol=RTOL * float(r["S"][l].abs().max()))
            count = int(c.cursor[s]) if cursor == "standard" else int(c.cursor[s, 1])
            assert 0 <= count <= c.buffer_len - T
            r["left"] -= 1
            if r["left"] == 0:
                c.free(s)
                del live[s]
    assert not pending and not live and allocations == 7 and flushes >= 3


def test_standard_cursor_rules():
    """cursor='standard': the (slots,) cursor of the standard decode kernel; num_draft = 0 and Mamba-2 only; commit
    takes n_accepted = None (every row accepts its token) or ones; the ring form needs n_accepted."""
    with pytest.raises(ValueError, match="cursor: 'standard'.*num_draft=3"):
        _cache(cursor="standard")
    with pytest.raises(ValueError, match="cursor: expected 'ring' or 'standard', got 'flat'"):
        _cache(num_draft=0, cursor="flat")
    gen = torch.Generator().manual_seed(6)
    c = _cache(num_draft=0, L=1, cursor="standard")  # L = 1: every step folds
    prm, weights = _layer_params(2, c, gen)
    assert c.cursor.shape == (3,)
    s = c.allocate()
    sbi = torch.tensor([s, -1], dtype=torch.int32)
    for _ in range(3):
        assert c.flush(sbi, 1, [p.A for p in prm]) == [s]
        for l in range(2):
            x, B, C, dt, u = _inputs(2, 1, c, gen)
            y = c.verify(l, x, B, C, dt, prm[l].dt_bias, prm[l].A, prm[l].D, None, sbi)
            assert y.shape == (2, 1, 4, 8) and torch.isnan(y[1]).all() and not torch.isnan(y[0]).any()
            c.conv_update(l, u, *weights[l], sbi)
        c.commit(sbi, None, 1)
        assert int(c.cursor[s]) == 0
    c.flush(sbi, 1, [p.A for p in prm])
    with pytest.raises(ValueError, match=r"num_tokens: expected 1 <= T <= num_draft \+ 1 = 1, got 2"):
        c.commit(sbi, torch.ones(2, dtype=torch.int32), 2)
    ring = _cache()
    ring.allocate()
    with pytest.raises(TypeError, match="n_accepted: expected a"):
        ring.flush(torch.tensor([0], dtype=torch.int32), 2, [p.A for p in prm])
        for l in range(2):
            x, B, C, dt, u = _inputs(1, 2, ring, gen)
            ring.verify(l, x, B, C, dt, prm[l].dt_bias, prm[l].A, prm[l].D, None, torch.tensor([0], dtype=torch.int32))
        ring.commit(torch.tensor([0], dtype=torch.int32), None, 2)


def test_commit_rejects_bad_n_and_leaves_cache_unchanged():
    gen = torch.Generator().manual_seed(4)
    c = _cache()
    prm, weights = _layer_params(2, c, gen)
    s0, s1 = c.allocate(), c.allocate()
    sbi = torch.tensor([s0, s1], dtype=torch.int32)
    c.flush(sbi, 4, [p.A for p in prm])
    for l in range(2):
        x, B, C, dt, u = _inputs(2, 4, c, gen)
        c.verify(l, x, B, C, dt, prm[l].dt_bias, prm[l].A, prm[l].D, None, sbi)
        c.conv_update(l, u, *weights[l], sbi)
    before = [_slot_tensors(c, s) for s in (s0, s1)]
    with pytest.raises(ValueError, match=r"n_accepted\[1\]: expected 1 <= n <= T=4"):
        c.commit(sbi, torch.tensor([2, 0], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="num_tokens: expected 1 <= T <= num_draft \\+ 1 = 4, got 5"):
        c.commit(sbi, torch.tensor([2, 2], dtype=torch.int32), 5)
    for s, then in zip((s0, s1), before):
        assert all(torch.equal(a, b) for a, b in zip(_slot_tensors(c, s), then))
    # n_accepted's dtype and shape, checked on both executors before anything moves (a float used to be
    # truncated for the cursor and rounded for the conv window)
    for bad, exc, match in (
            (torch.tensor([1.5, 2.0]), TypeError, r"n_accepted: expected a \(2,\) int32 tensor, got torch.float32"),
            (torch.tensor([2, 2]), TypeError, "got torch.int64"),
            (torch.tensor([[2, 2]], dtype=torch.int32), ValueError, r"expected shape \(2,\) on cpu, got \(1, 2\)"),
            ([2, 2], TypeError, "got list")):
        with pytest.raises(exc, match=match):
            c.commit(sbi, bad, 4)
    for s, then in zip((s0, s1), before):
        assert all(torch.equal(a, b) for a, b in zip(_slot_tensors(c, s), then))


def test_a_failed_verify_leaves_the_checkpoint_and_the_step_cannot_be_reopened():
    """A bad input at a verify that folds: refused before the fold (the reference used to fold, then check), and
    a new flush() while the step holds verified layers is refused (it would fold them twice) until the step is
    committed or aborted."""
    gen = torch.Generator().manual_seed(6)
    c = _cache(L=8, num_draft=1)
    prm, weights = _layer_params(2, c, gen)
    s0 = c.allocate()
    sbi = torch.tensor([s0], dtype=torch.int32)
    for _ in range(3):  # count 6 of 8: the next T = 2 window folds first (count + 2T > L)
        _spec_step(c, sbi, 2, prm, weights, gen, nacc=torch.tensor([2], dtype=torch.int32))
    assert c.cursor[s0].tolist() == [0, 6]
    c.flush(sbi, 2)
    before = _slot_tensors(c, s0)
    x, B, C, dt, _ = _inputs(1, 2, c, gen)
    with pytest.raises(ValueError, match=r"z: expected shape \(1, 2, 4, 8\)"):
        c.verify(0, x, B, C, dt, prm[0].dt_bias, prm[0].A, prm[0].D, torch.zeros(1, 2, 4, 9, dtype=F64), sbi)
    assert all(torch.equal(a, b) for a, b in zip(_slot_tensors(c, s0), before))
    c.verify(0, x, B, C, dt, prm[0].dt_bias, prm[0].A, prm[0].D, None, sbi)  # layer 0 folds and appends
    with pytest.raises(RuntimeError, match=r"flush: the open step already verified layers \[0\]"):
        c.flush(sbi, 2)
    assert c.abort_step() == [0] and c.abort_step() == []
    c.flush(sbi, 2)  # a new step may open (the caller resets the slots the aborted step touched)


def test_a_failed_reference_step_writes_nothing():
    """The reference executor checks ``out``, the rows and (standard decode) every input before a fold writes the
    checkpoint, as the kernel launchers do: it used to fold, then fail on out / z / D / a short
    state_batch_indices, leaving a folded checkpoint that the step did not record (abort_step() said [])."""
    gen = torch.Generator().manual_seed(6)
    c = _cache(L=8, num_draft=1)
    prm, weights = _layer_params(2, c, gen)
    s0 = c.allocate()
    c.allocate()
    sbi = torch.tensor([s0], dtype=torch.int32)
    for _ in range(3):  # count 6 of 8: the next T = 2 window folds first
        _spec_step(c, sbi, 2, prm, weights, gen, nacc=torch.tensor([2], dtype=torch.int32))
    c.flush(sbi, 2)
    before = _slot_tensors(c, s0)
    x, B, C, dt, _ = _inputs(2, 2, c, gen)
    p = (prm[0].dt_bias, prm[0].A, prm[0].D, None)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, 4, 8\), got \(1, 2, 4, 9\)"):
        c.verify(0, x[:1], B[:1], C[:1], dt[:1], *p, sbi, out=torch.empty(1, 2, 4, 9, dtype=F64))
    with pytest.raises(ValueError, match=r"state_batch_indices: expected shape \(2,\), got \(1,\)"):
        c.verify(0, x, B, C, dt, *p, sbi)
    assert all(torch.equal(a, b) for a, b in zip(_slot_tensors(c, s0), before))
    assert c.abort_step() == []

    std = _cache(num_draft=0, L=1, cursor="standard")  # L = 1: every step folds
    s = std.allocate()
    std.load_prefill(s, 0, torch.randn(4, 8, 8, generator=gen, dtype=F64))
    sbi = torch.tensor([s], dtype=torch.int32)
    std.flush(sbi, 1)
    before = _slot_tensors(std, s)
    x, B, C, dt, _ = _inputs(1, 1, std, gen)
    good = dict(x=x, B=B, C=C, dt=dt, dt_bias=prm[0].dt_bias, A=prm[0].A, D=prm[0].D, state_batch_indices=sbi)
    for bad, match in ((dict(z=torch.zeros(1, 1, 4, 9, dtype=F64)), r"z: expected shape \(1, 4, 8\)"),
                       (dict(out=torch.empty(1, 1, 4, 9, dtype=F64)), r"out: expected shape \(1, 4, 8\)"),
                       (dict(D=torch.zeros(5, dtype=F64)), r"D: expected shape \(4,\)")):
        with pytest.raises(ValueError, match=match):
            std.verify(0, **{**good, **bad})
        assert all(torch.equal(a, b) for a, b in zip(_slot_tensors(std, s), before))


def test_a_layer_runs_once_per_step_and_abort_reports_shifted_conv_windows():
    """A second verify of a layer in one step would fold its checkpoint again on the unmoved cursor (it used to, and
    the committed state came out wrong); a second conv update would shift its window twice: both refused. A conv
    window shifted before a verify raised is reported by abort_step() and keeps flush() from reopening the step."""
    gen = torch.Generator().manual_seed(6)
    c = _cache(L=8, num_draft=1)
    prm, weights = _layer_params(2, c, gen)
    s0 = c.allocate()
    sbi = torch.tensor([s0], dtype=torch.int32)
    for _ in range(3):  # count 6 of 8: the next T = 2 window folds first
        _spec_step(c, sbi, 2, prm, weights, gen, nacc=torch.tensor([2], dtype=torch.int32))
    c.flush(sbi, 2)
    x, B, C, dt, u = _inputs(1, 2, c, gen)
    args = (x, B, C, dt, prm[0].dt_bias, prm[0].A, prm[0].D, None, sbi)
    c.verify(0, *args)
    folded = c.state[0, s0].clone()
    with pytest.raises(RuntimeError, match=r"verify: layer 0 already ran in this step"):
        c.verify(0, *args)
    assert torch.equal(c.state[0, s0], folded)
    c.conv_update(0, u, *weights[0], sbi)
    with pytest.raises(RuntimeError, match=r"conv_update: layer \('conv', 0\) already ran in this step"):
        c.conv_update(0, u, *weights[0], sbi)
    with pytest.raises(IndexError, match="layer: expected 0 <= layer < 2, got -1"):
        c.conv_update(-1, u, *weights[1], sbi)
    assert c.abort_step() == [("conv", 0), 0]

    c = _cache(L=8, num_draft=1)
    s0 = c.allocate()
    c.flush(sbi, 2)
    c.conv_update(0, u, *weights[0], sbi)  # the model's order: the conv, then the SSM of the same layer
    with pytest.raises(ValueError, match="z: expected shape"):
        c.verify(0, *args[:7], torch.zeros(1, 2, 4, 9, dtype=F64), sbi)
    with pytest.raises(RuntimeError, match=r"flush: the open step already verified layers \[\('conv', 0\)\]"):
        c.flush(sbi, 2)
    assert c.abort_step() == [("conv", 0)]  # the window holds the step's inputs: the slot must be reset


def test_shadow_dtypes_the_kernels_do_not_read_are_refused():
    with pytest.raises(ValueError, match="shadow_dtype: expected None, bfloat16 or float8_e4m3fn, got torch.float16"):
        _cache(shadow_dtype=torch.float16)
    with pytest.raises(ValueError, match="a model with GDN layers keeps a bfloat16 shadow only .*float8_e4m3fn"):
        ReplayStateCache.for_family("gdn", 1, 2, (2, 1, 8, 8), 4, shadow_dtype=torch.float8_e4m3fn)


def test_memory_model_matches_allocation():
    """memory_per_request's ReplaySSM column is exactly what the cache allocates per slot (bf16 act, fp32 state)."""
    c = ReplayStateCache(3, 2, 8, 16, 32, 2, 16, num_draft=3, act_dtype=torch.bfloat16)
    m = memory_per_request(8, 16, 32, 2, 3, 16, 3)
    assert c.bytes_per_slot() == m["replay"]
    cs = ReplayStateCache(3, 2, 8, 16, 32, 2, 16, num_draft=3, act_dtype=torch.bfloat16, shadow_dtype=torch.bfloat16)
    assert cs.bytes_per_slot() == memory_per_request(8, 16, 32, 2, 3, 16, 3, shadow_bytes=2)["replay"]
    c8 = ReplayStateCache(3, 2, 8, 16, 32, 2, 16, num_draft=3, act_dtype=torch.bfloat16, shadow_dtype=torch.float8_e4m3fn)
    assert c8.bytes_per_slot() == memory_per_request(8, 16, 32, 2, 3, 16, 3, shadow_bytes=1)["replay"]


def test_memory_per_request_named_geometries():
    H, P, N, G = GEOMETRIES["nemotron_h_8b"]
    m = memory_per_request(H, P, N, G, num_layers=1, buffer_len=16, num_draft=3)
    state = 128 * 64 * 128 * 4  # 4 MiB fp32 state per layer
    conv_dim = 128 * 64 + 2 * 8 * 128
    assert m["native"] == 4 * state + 4 * conv_dim * 3 * 2
    assert m["replay"] == state + 16 * (128 * 64 + 8 * 128) * 2 + 128 * 16 * 4 + conv_dim * 6 * 2 + 8
    for name in ("nemotron_h_8b", "nano_9b_v2", "h_56b"):
        H, P, N, G = GEOMETRIES[name]
        ratios = [memory_per_request(H, P, N, G, 10, 16, d)["ratio"] for d in (1, 3, 7)]
        assert 1.5 < ratios[0] < ratios[1] < ratios[2] < 8  # native grows with the drafts, replay barely


def test_teeth_cache_corrupted_ring_entry_is_detected():
    """Corrupting one committed x entry of one layer changes that layer's committed state, not the other's."""
    gen = torch.Generator().manual_seed(6)
    c = _cache()
    prm, weights = _layer_params(2, c, gen)
    s = c.allocate()
    sbi = torch.tensor([s], dtype=torch.int32)
    _spec_step(c, sbi, 4, prm, weights, gen, nacc=torch.tensor([3], dtype=torch.int32))
    good = [c.committed_state(l, s, prm[l].A) for l in range(2)]
    start = int(c.cursor[s, 0])
    c.x_cache[1, s, 2, (start + 1) % c.buffer_len, 5] += 0.25
    assert torch.equal(c.committed_state(0, s, prm[0].A), good[0])
    assert (c.committed_state(1, s, prm[1].A) - good[1]).norm() / good[1].norm() > 1e-6


# ---- the CUDA path's bookkeeping on the CPU: kernels replaced by their float64 contract ----------------------
class _HostReadGuard:
    """Makes device->host reads (item, tolist, cpu, numpy, bool/int/float/index of a tensor) fail while on, so a
    CPU run of the CUDA path proves it never reads device values back (what graph capture needs)."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.on = False
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def guarded(t, *a, _orig=orig, _name=name, **k):
                if self.on:
                    raise AssertionError(f"host read of a tensor on the CUDA path: Tensor.{_name}")
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, guarded)

    def off(self):
        guard = self

        class _Off:
            def __enter__(self):
                self.was, guard.on = guard.on, False

            def __exit__(self, *exc):
                guard.on = self.was

        return _Off()


def _emulated_kernels(monkeypatch, guard):
    """ops.replay_verify / cursor_ops.spec_commit as their contracts say (ops.py docstrings), in float64 on the CPU:
    verify folds the checkpoint (+ shadow) of slots with count + 2T > L on the pre-step cursor, computes the
    window from the flushed cursor and leaves the cursor alone; spec_commit repeats the flush decision, then
    count += n (clamped to [0, T])."""
    from trtllm_replayssm import cursor as cursors
    from trtllm_replayssm import cursor_ops
    from trtllm_replayssm.families.mamba2 import ops
    from trtllm_replayssm.families.mamba2 import spec_reference as sr

    def replay_verify(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, sbi, z=None, out=None,
                      check_values=None, shadow=None, shadow_scale=None):
        with guard.off():
            T, L = x.shape[1], x_cache.shape[2]
            sh = None if shadow is None else shadowq.Shadow.wrap(shadow, shadow_scale)
            after = cursor.clone()
            flushed = sr.flush_checkpoint(state, x_cache, B_cache, dt_cache, cursor, A, T, sbi, shadow=sh)
            cursors.flush_cursor(after, T, L, sbi)
            y = sr.verify(state, x_cache, B_cache, dt_cache, after, x, B, C, dt, dt_bias, A, D, z, sbi, shadow=sh,
                          flushed=flushed)
            out = torch.full_like(x, float("nan")) if out is None else out
            out[sbi >= 0] = y[sbi >= 0].to(out.dtype)
            return out

    def spec_commit(cursor, n_accepted, sbi, num_tokens, buffer_len, check_values=None):
        with guard.off():
            cursors.flush_cursor(cursor, num_tokens, buffer_len, sbi)
            cursors.commit(cursor, n_accepted.clamp(0, num_tokens), num_tokens, buffer_len, sbi)

    monkeypatch.setattr(ops, "replay_verify", replay_verify)
    monkeypatch.setattr(cursor_ops, "spec_commit", spec_commit)


class _KernelPathCache(ReplayStateCache):
    """CPU tensors, the kernel executor (with the emulated launchers)."""

    def __init__(self, *a, **kw):
        from trtllm_replayssm.backend import KernelBackend

        super().__init__(*a, executor=KernelBackend(), **kw)


@pytest.mark.parametrize("shadow", [None, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("T", [2, 4])
def test_kernel_path_bookkeeping_equals_cpu_path(monkeypatch, T, shadow):
    """The kernel executor (flush = nothing, each verify folds its layer on the pre-step cursor, spec_commit
    moves the cursor; gathered conv updates) leaves every tensor of the cache bit-identical to the float64
    reference executor's after each full step, outputs equal (conv: 1e-12, the same float64 K-term sums in another
    order), over continuous batching with recycled slots and padding rows; no host read on the way.
    f32 checkpoint (the kernels' shadow needs one), float64 activations."""
    guard = _HostReadGuard(monkeypatch)
    _emulated_kernels(monkeypatch, guard)
    gen = torch.Generator().manual_seed(40 + T)
    kw = dict(layers=2, slots=3, L=9, num_draft=3, state_dtype=torch.float32, shadow_dtype=shadow)
    cpu = _cache(**kw, read_shadow=shadow is not None)
    dev = _cache(**kw, check_values=False, cls=_KernelPathCache)
    prm, weights = _layer_params(2, cpu, gen)
    live, flushes = {}, 0
    for step in range(40):
        while cpu.num_free and len(live) < 3:
            s = cpu.allocate()
            assert dev.allocate() == s
            for l in range(2):
                S, conv = torch.randn(4, 8, 8, generator=gen, dtype=F64), torch.randn(cpu.conv_dim, 3, generator=gen, dtype=F64)
                cpu.load_prefill(s, l, S, conv)
                dev.load_prefill(s, l, S, conv)
            live[s] = int(torch.randint(2, 9, (1,), generator=gen))
        rows = sorted(live)
        rows.insert(step % (len(rows) + 1), -1)  # a padding row, anywhere
        sbi = torch.tensor(rows, dtype=torch.int32)
        nacc = torch.randint(1, T + 1, (len(rows),), generator=gen, dtype=torch.int32)
        flushed = cpu.flush(sbi, T, [p.A for p in prm])
        flushes += len(flushed)
        guard.on = True
        assert dev.flush(sbi, T, [p.A for p in prm]) is None
        guard.on = False
        for l in range(2):
            x, B, C, dt, u = _inputs(len(rows), T, cpu, gen)
            args = (x, B, C, dt, prm[l].dt_bias, prm[l].A, prm[l].D, None, sbi)
            y_cpu, o_cpu = cpu.verify(l, *args), cpu.conv_update(l, u, *weights[l], sbi)
            guard.on = True
            y_dev, o_dev = dev.verify(l, *args), dev.conv_update(l, u, *weights[l], sbi)
            guard.on = False
            v = sbi >= 0
            assert torch.equal(y_dev[v], y_cpu[v])
            assert torch.isnan(o_dev[~v]).all() and torch.allclose(o_dev[v], o_cpu[v], rtol=1e-12, atol=1e-12)
        cpu.commit(sbi, nacc, T)
        guard.on = True
        dev.commit(sbi, nacc, T)
        guard.on = False
        for a, b in zip(dev._tensors() + [dev.cursor], cpu._tensors() + [cpu.cursor]):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
        for s in rows:
            if s >= 0:
                live[s] -= 1
                if not live[s]:
                    del live[s]
                    cpu.free(s)
                    dev.free(s)
    assert flushes >= 6


def test_kernel_path_step_rules(monkeypatch):
    """On CUDA a step is flush, verify of every layer with the step's T, commit: anything else is refused on the
    host before a kernel runs (a layer left out would lose its history to the cursor move)."""
    guard = _HostReadGuard(monkeypatch)
    _emulated_kernels(monkeypatch, guard)
    gen = torch.Generator().manual_seed(5)
    c = _cache(state_dtype=torch.float32, cls=_KernelPathCache)
    prm, weights = _layer_params(2, c, gen)
    s = c.allocate()
    sbi, n = torch.tensor([s], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    x, B, C, dt, u = _inputs(1, 4, c, gen)
    args = (x, B, C, dt, prm[0].dt_bias, prm[0].A, prm[0].D, None, sbi)
    with pytest.raises(RuntimeError, match=r"verify: call flush\(\) first"):
        c.verify(0, *args)
    c.flush(sbi, 4, [p.A for p in prm])
    with pytest.raises(ValueError, match="verify: num_tokens T=2 differs from the step's T=4"):
        c.verify(0, x[:, :2], B[:, :2], C[:, :2], dt[:, :2], *args[4:])
    c.verify(0, *args)
    with pytest.raises(RuntimeError, match=r"commit: layers \[1\] were not verified since flush\(\)"):
        c.commit(sbi, n, 4)
    c.verify(1, *args)
    with pytest.raises(ValueError, match=r"n_accepted\[0\]: expected 1 <= n <= T=4"):
        c.commit(sbi, torch.tensor([0], dtype=torch.int32), 4)  # host checks on (check_values=None, not capturing)
    c.commit(sbi, n, 4)
    assert c.cursor[s].tolist() == [0, 2]
    with pytest.raises(RuntimeError, match=r"commit: call flush\(\) first"):
        c.commit(sbi, n, 4)


def test_gathered_conv_updates_equal_the_spec_in_bf16():
    """conv_update_rows / conv_rollback_rows against spec_reference's per-row loops on bf16 windows: windows
    bit-identical (copies of inputs and zeros), outputs within one bf16 rounding (2^-8 relative per element:
    fp32 vs float64 math, rounded to bf16), padding rows write only the scratch slot."""
    from trtllm_replayssm import conv_window as convw
    from trtllm_replayssm.cache import conv_rollback_rows, conv_update_rows

    gen = torch.Generator().manual_seed(8)
    S, Dc, K, nd, T = 4, 24, 4, 3, 4
    W = K - 1 + nd
    full = torch.randn(S + 1, Dc, W, generator=gen).to(torch.bfloat16)
    spec = full[:S].clone()
    weight, bias = torch.randn(Dc, K, generator=gen), torch.randn(Dc, generator=gen)
    sbi = torch.tensor([2, -1, 0, 3], dtype=torch.int32)
    dst = torch.where(sbi >= 0, sbi, S).long()
    for _ in range(5):
        u = torch.randn(4, T, Dc, generator=gen).to(torch.bfloat16)
        o = conv_update_rows(full, u, weight, bias, dst, K, "silu")
        o_ref = convw.conv_window_update(spec, u, weight, bias, sbi, "silu")
        v = sbi >= 0
        assert ((o[v].double() - o_ref[v]).abs() <= 2 ** -8 * o_ref[v].abs() + 1e-6).all()
        n = torch.randint(1, T + 1, (4,), generator=gen, dtype=torch.int32)
        conv_rollback_rows(full, n, T, dst)
        convw.conv_window_rollback(spec, n, T, K, sbi)
        assert torch.equal(full[:S], spec)


@pytest.mark.parametrize("G, tp", [(2, 2), (1, 2), (2, 4)], ids=["groups-owned", "group-replicated", "tp4"])
def test_tensor_parallel_caches_are_slices_of_the_tp1_cache(G, tp):
    """Caches of every rank (ReplayStateCache.for_rank) fed their shard of each input: SSM outputs are
    TP=1's heads bit for bit (same per-head float64 arithmetic; conv outputs to 1e-12), and after every
    step each rank's checkpoint, rings, conv windows and cursors are exactly the TP=1 cache's slices."""
    from trtllm_replayssm import tp as tpmod

    gen = torch.Generator().manual_seed(7 + G + tp)
    kw = dict(buffer_len=8, num_draft=1, conv_kernel=4, state_dtype=F64, act_dtype=F64, dt_dtype=F64)
    H, P, N = GEOM["nheads"], GEOM["headdim"], GEOM["dstate"]
    full = ReplayStateCache(2, 3, H, P, N, G, **kw)
    ranks = [ReplayStateCache.for_rank(r, tp, 2, 3, H, P, N, G, **kw) for r in range(tp)]
    prm = [make_params(H, gen) for _ in range(2)]
    prm = [type(p)(*(t.to(F64) for t in (p.dt_bias, p.A, p.D))) for p in prm]
    weights = [(torch.randn(full.conv_dim, 4, generator=gen, dtype=F64), torch.randn(full.conv_dim, generator=gen, dtype=F64))
               for _ in range(2)]
    for c in [full] + ranks:
        assert [c.allocate() for _ in range(3)] == [0, 1, 2]
    chans = [tpmod.mixer_channels(c.shard, P, N) for c in ranks]
    assert [c.nheads for c in ranks] == [H // tp] * tp and ranks[0].conv_dim == len(chans[0][1])
    sbi = torch.tensor([2, -1, 0], dtype=torch.int32)
    T = 2
    for _ in range(10):  # crosses flushes (count + 2T > L)
        nacc = torch.randint(1, T + 1, (3,), generator=gen, dtype=torch.int32)
        for c in [full] + ranks:
            c.flush(sbi, T, [p.A[c.shard.heads] if c is not full else p.A for p in prm])
        for l in range(2):
            x, B, C, dt, u = _inputs(3, T, full, gen)
            p = prm[l]
            y = full.verify(l, x, B, C, dt, p.dt_bias, p.A, p.D, None, sbi)
            v = full.conv_update(l, u, *weights[l], sbi)
            for c, (_, xbc, _) in zip(ranks, chans):
                h, g = c.shard.heads, c.shard.groups
                yr = c.verify(l, x[:, :, h], B[:, :, g], C[:, :, g], dt[:, :, h], p.dt_bias[h], p.A[h], p.D[h], None, sbi)
                vr = c.conv_update(l, u[..., xbc], weights[l][0][xbc], weights[l][1][xbc], sbi)
                torch.testing.assert_close(yr, y[:, :, h], rtol=0, atol=0, equal_nan=True)  # padding rows: NaN
                # conv outputs: torch's grouped conv1d may sum in another order for another channel count
                torch.testing.assert_close(vr, v[..., xbc], rtol=1e-12, atol=1e-12, equal_nan=True)
        for c in [full] + ranks:
            c.commit(sbi, nacc, T)
        for c, (_, xbc, _) in zip(ranks, chans):
            h, g = c.shard.heads, c.shard.groups
            assert torch.equal(c.state, full.state[:, :, h]) and torch.equal(c.x_cache, full.x_cache[:, :, h])
            assert torch.equal(c.B_cache, full.B_cache[:, :, g]) and torch.equal(c.dt_cache, full.dt_cache[:, :, h])
            assert torch.equal(c.conv, full.conv[:, :, xbc]) and torch.equal(c.cursor, full.cursor)
    assert full.cursor[:, 0].any()  # some slot folded its ring at least once
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < tp=2, got 2"):
        ReplayStateCache.for_rank(2, 2, 1, 1, H, P, N, G, **kw)


@pytest.mark.parametrize("shadow", [None, torch.bfloat16, torch.float8_e4m3fn], ids=["none", "bf16", "fp8"])
def test_move_slots_and_gather_slots_move_whole_slots(shadow):
    """move_slots: a cycle and a swap move every tensor a slot owns bit for bit (sources read before destinations are
    written), slots that are no destination keep theirs; gather_slots with repeats (a beam reorder) is the same move
    onto every slot. Bad input names the argument."""
    c = ReplayStateCache(2, 5, 8, 16, 32, 2, 4, act_dtype=torch.bfloat16, shadow_dtype=shadow)
    gen = torch.Generator().manual_seed(3)
    for _, t in c._snapshot_tensors():
        raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        raw.copy_(torch.randint(0, 100, raw.shape, generator=gen).to(raw.dtype))
    before = {n: t.clone() for n, t in c._snapshot_tensors()}

    def slot(name, t, s):
        return t[s] if name in ("cursor", "ckpt_flushes") else t[:, s]

    c.move_slots([0, 1, 2, 4], [1, 2, 0, 3])  # cycle 0 -> 1 -> 2 -> 0, and 4 -> 3 (4 keeps its own)
    for name, t in c._snapshot_tensors():
        for s, d in ((0, 1), (1, 2), (2, 0), (4, 3), (4, 4)):
            got, want = slot(name, t, d), slot(name, before[name], s)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{name}: slot {d} from {s}"
    moved = {n: t.clone() for n, t in c._snapshot_tensors()}
    src = torch.tensor([3, 3, 0, 1, 1])
    c.gather_slots(src)
    for name, t in c._snapshot_tensors():
        for d in range(5):
            got, want = slot(name, t, d), slot(name, moved[name], int(src[d]))
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{name}: gathered slot {d}"
    with pytest.raises(IndexError, match="dst: expected slots in 0..4"):
        c.move_slots([0], [5])
    with pytest.raises(ValueError, match="equal lengths"):
        c.move_slots(torch.tensor([0, 1]), torch.tensor([2]))


@pytest.mark.parametrize("cursor", ["standard", "ring"])
def test_flush_phases_spread_the_flushes_of_requests_admitted_together(cursor):
    """flush_phases: L requests admitted at once (a lockstep batch) start at counts 0 .. span - 1 over zeroed ring
    entries (reset and load_prefill keep the phase), so on the standard cursor exactly one of them folds at every
    step from the first (the kernels' "mixed" launch); without phases all fold at the same step."""
    L = 6
    nd = 0 if cursor == "standard" else 1
    for phases in (False, True):
        c = _cache(layers=1, slots=L, L=L, num_draft=nd, cursor=cursor, flush_phases=phases)
        span = L if cursor == "standard" else L - 2 * (nd + 1) + 1
        assert c.phase_span == span
        slots = [c.allocate() for _ in range(L)]
        want = [i % span if phases else 0 for i in range(L)]
        assert [c.phase(s) for s in slots] == want
        gen = torch.Generator().manual_seed(0)
        for s in slots:
            c.load_prefill(s, 0, torch.randn(4, 8, 8, generator=gen, dtype=F64))
        count = c.cursor if cursor == "standard" else c.cursor[:, 1]
        assert count.tolist() == want and (cursor == "standard" or c.cursor[:, 0].eq(0).all())
        g = c.group("mamba2")
        assert all(t[:, slots].eq(0).all() for n, t in g.t.items() if n not in ("state", "shadow", "shadow_scale"))
        if cursor == "standard":  # the standard rule (the step that sees L - 1 folds, then c <- (c + 1) mod L)
            c_now, folding = count.clone(), []
            for _ in range(L):
                folding.append(int((c_now == L - 1).sum()))
                c_now = (c_now + 1) % L
            assert folding == ([1] * L if phases else [0] * (L - 1) + [L])  # one a step; lockstep: all at once
        c.reset(slots[-1])
        assert int(count[slots[-1]]) == want[-1]  # reset keeps the slot's phase
        c.free(slots[-1])
        assert c.allocate() == slots[-1] and c.phase(slots[-1]) == (L % span if phases else 0)  # the next in turn
    with pytest.raises(TypeError, match="flush_phases"):
        _cache(flush_phases=1)
