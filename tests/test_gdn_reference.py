# SPDX-License-Identifier: Apache-2.0
"""The float64 spec of Gated DeltaNet ReplaySSM (gdn_reference) against the conventional recurrence.

Oracles and precision:
- :func:`gdn_reference.conventional_step` in float64 (S <- exp(g) S; u = beta (v - S k); S <- S + u k^T;
  y = S q), fed the same tokens one at a time. With float64 caches (built explicitly: ``GDNBuffers.alloc``
  defaults u/k/g/beta to fp32) both sides are float64 on identical values and differ only in summation
  order (the u-sum exp(G_m - G_j) products vs repeated multiplication): y ~4e-16 relative measured, so
  RTOL = 1e-12 (y every step; the current state every step, both as the exact fold from v_j, the same
  recurrence, and as the u-sum the output path replays).
- With the default caches (fp32 checkpoint and u/k/g/beta, bf16 v, bf16 inputs so that v is stored
  exactly) the only differences are fp32 roundings (rel 6e-8) of the cached entries and of the
  checkpoint at each flush, amplified by a few tens of steps: ~5e-8 measured, tolerance 1e-6.
- L = 1: every step is a flush of zero entries, the same float64 operations as the conventional step:
  bit for bit (torch.equal).
- :func:`gdn_reference.verify_triangular` (the verify kernel's route: forward substitution of the
  strictly lower triangular window system) against :func:`gdn_reference.verify` (the recurrence it
  equals): float64, a T-term sum in another order, 1e-12.
- transformers' own ``torch_recurrent_gated_delta_rule`` (Qwen3-Next's torch path, state (B, HV, K, V),
  computed in float32 whatever the input dtype): float32 rounding over a few steps, 1e-5.
- A pure-Python model of the cursors, ring contents, untouched slots and padding rows: compared
  exactly (torch.equal, rtol = atol = 0).
- Shadow (a bf16 / fp8 copy of the (S, HV, V, K) checkpoint that non-flush steps read): outputs within
  the shadow's rounding (bf16 4e-3, fp8 6e-2 relative); each flush refolds from v_j and the full-precision
  checkpoint, so checkpoints equal the no-shadow run's bit for bit (the fold reads nothing the shadow
  touched), while a fold by the u-sum would carry the shadow's error (shown, so the test has teeth).
"""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.gdn import reference as gdn
from trtllm_replayssm.geometries import GDN_GEOMETRIES, GDN_MODELS

F64 = torch.float64
RTOL = 1e-12  # float64 both sides, summation order only (module docstring)

pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _params(HV, gen):
    """A_log = log U[1, 16], dt_bias = softplus^-1 of dt in [1e-3, 0.1] log-uniform (Qwen3-Next's init)."""
    A_log = torch.log(torch.rand(HV, generator=gen, dtype=F64) * 15 + 1)
    dt0 = torch.exp(torch.rand(HV, generator=gen, dtype=F64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return A_log, dt0 + torch.log(-torch.expm1(-dt0))


def _tokens(lead, H, HV, V, K, gen, dtype=F64):
    """q, k (lead, H, K), v (lead, HV, V), a, b (lead, HV), raw (before l2 norm and gates)."""
    def rnd(*shape, shift=0.0):
        return (torch.randn(*lead, *shape, generator=gen, dtype=F64) + shift).to(dtype)
    return rnd(H, K), rnd(H, K), rnd(HV, V), rnd(HV), rnd(HV, shift=1.0)


def _buffers(slots, HV, H, V, K, L, gen, dtype=F64, garbage=True):
    """float64 GDNBuffers: random checkpoint; ring/array contents garbage (nothing outside the entries is read)."""
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype) if garbage else torch.zeros(*shape, dtype=dtype)
    state = torch.randn(slots, HV, V, K, generator=gen, dtype=F64).to(dtype) * 0.3
    return gdn.GDNBuffers(state, r(slots, HV, L, V), r(slots, HV, L, V), r(slots, H, L, K), -r(slots, HV, L).abs(),
                          r(slots, HV, L).sigmoid())


def _batch(active, pad, gen, p=0.85):
    """state_batch_indices of one step: a random subset of ``active`` slots plus ``pad`` -1 rows, shuffled."""
    keep = [s for s in active if float(torch.rand(1, generator=gen)) < p] or [active[0]]
    rows = keep + [-1] * pad
    perm = torch.randperm(len(rows), generator=gen).tolist()
    return torch.tensor([rows[i] for i in perm], dtype=torch.int32)


def _tensors(buf):
    return (buf.state, buf.u_cache, buf.v_cache, buf.k_cache, buf.g_cache, buf.beta_cache)


# ---- standard decode: replay == conventional ----------------------------------------------------------------
def _run_standard(HV, H, V, K, L, slots, active, pad, steps=None, seed=0, l2norm=True):
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias = _params(HV, gen)
    buf = _buffers(slots, HV, H, V, K, L, gen)
    S_conv = buf.state.clone()
    cursor = torch.zeros(slots, dtype=torch.int32)
    untouched = [t.clone() for t in _tensors(buf)]
    act = list(range(active))
    count = dict.fromkeys(act, 0)  # the cursor model: tokens seen per slot
    worst_y, worst_S = 0.0, 0.0
    flushes = dict.fromkeys(act, 0)
    scale = None if l2norm else 0.5
    for _ in range(steps or 3 * L + 4):
        sbi = _batch(act, pad, gen)
        q, k, v, a, b = _tokens((sbi.shape[0],), H, HV, V, K, gen)
        if not l2norm:  # keep the delta rule contractive without the norm: ||k|| ~ 1
            q, k = q * K ** -0.5, k * K ** -0.5
        y_conv = gdn.conventional_step(S_conv, q, k, v, a, b, A_log, dt_bias, sbi, use_qk_l2norm=l2norm, scale=scale)
        y = gdn.replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, use_qk_l2norm=l2norm, scale=scale)
        for s in sbi.tolist():
            if s >= 0 and int(cursor[s]) == L - 1:
                flushes[s] += 1
        cursors.advance_cursor(cursor, sbi, L)
        valid = sbi >= 0
        assert torch.isnan(y[~valid]).all() and torch.isnan(y_conv[~valid]).all()
        assert not torch.isnan(y[valid]).any()
        worst_y = max(worst_y, _rel(y[valid], y_conv[valid]))
        for s in sbi[valid].tolist():
            count[s] += 1
            assert int(cursor[s]) == count[s] % L  # exact bookkeeping
            # the current state both ways: the exact fold from v_j, and the u-sum the output path replays
            us, _, ks, gs, _ = gdn._entries(buf, s, torch.arange(int(cursor[s])))
            for S_now in (gdn.replay_state(buf, cursor, s), gdn._replay(buf.state[s], us, ks, gs)):
                worst_S = max(worst_S, _rel(S_now, S_conv[s]))
    for t, t0 in zip(_tensors(buf), untouched):  # slots never in a batch: bit-identical
        assert torch.equal(t[active:], t0[active:])
    assert not cursor[active:].any()
    return worst_y, worst_S, min(flushes.values())


BASE = dict(HV=4, H=2, V=8, K=16, L=4, slots=6, active=4, pad=2)
CASES = [
    BASE,
    {**BASE, "L": 2},
    {**BASE, "L": 16},
    {**BASE, "L": 7},  # odd capacity
    {**BASE, "HV": 2, "H": 2},  # HV / H = 1
    {**BASE, "HV": 4, "H": 1},  # HV / H = 4
    {**BASE, "HV": 8, "H": 2, "L": 8},
    {**BASE, "V": 5, "K": 7},  # odd head dims
    {**BASE, "V": 24, "K": 12, "L": 5},
    {**BASE, "pad": 0},
    {**BASE, "l2norm": False},  # use_qk_l2norm=False, explicit scale
]


def _id(c, base=BASE):
    return ",".join(f"{k}={v}" for k, v in c.items() if base.get(k) != v) or "base"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_replay_equals_conventional(case):
    worst_y, worst_S, flushes = _run_standard(**case)
    assert worst_y < RTOL, worst_y
    assert worst_S < RTOL, worst_S
    assert flushes >= 2  # every slot went through several flush cycles


def test_default_fp32_caches_track_float64_oracle():
    """GDNBuffers.alloc's dtypes (fp32 checkpoint and u/k/g/beta, bf16 v), bf16 inputs (so v is stored
    exactly): only fp32 roundings separate the spec from a float64 oracle; ~5e-8 measured, 1e-6 allowed
    (far below a real bug, ~1e-2)."""
    gen = torch.Generator().manual_seed(31)
    HV, H, V, K, L, slots = 4, 2, 16, 16, 8, 3
    A_log, dt_bias = (t.float() for t in _params(HV, gen))
    buf = gdn.GDNBuffers.alloc(slots, HV, H, V, K, L)
    assert buf.u_cache.dtype == torch.float32 and buf.v_cache.dtype == torch.bfloat16
    buf.state.copy_(torch.randn(slots, HV, V, K, generator=gen) * 0.3)
    S_conv = buf.state.double()
    cursor = torch.zeros(slots, dtype=torch.int32)
    worst = 0.0
    for _ in range(3 * L + 3):
        sbi = _batch(list(range(slots)), 1, gen)
        q, k, v, a, b = _tokens((sbi.shape[0],), H, HV, V, K, gen, dtype=torch.bfloat16)
        y_conv = gdn.conventional_step(S_conv, q, k, v, a, b, A_log, dt_bias, sbi)
        y = gdn.replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi)
        cursors.advance_cursor(cursor, sbi, L)
        valid = sbi >= 0
        worst = max(worst, _rel(y[valid], y_conv[valid]))
        for s in sbi[valid].tolist():
            worst = max(worst, _rel(gdn.replay_state(buf, cursor, s), S_conv[s]))
    assert 0 < worst < 1e-6, worst  # > 0: the fp32 caches do round


def test_L1_is_the_conventional_step_bit_for_bit():
    """L = 1: each step folds zero entries then takes the conventional step: the same float64 operations, so
    y and the state (float64 or float32 storage) are bit-identical; the buffers are never written."""
    gen = torch.Generator().manual_seed(2)
    HV, H, V, K, slots = 4, 2, 8, 16, 5
    A_log, dt_bias = _params(HV, gen)
    for dtype in (F64, torch.float32):
        buf = gdn.GDNBuffers.alloc(slots, HV, H, V, K, 1, act=dtype, state_dtype=dtype)
        buf.state.copy_(torch.randn(slots, HV, V, K, generator=gen) * 0.3)
        S_conv = buf.state.clone()
        caches = [t.clone() for t in _tensors(buf)[1:]]
        cursor = torch.zeros(slots, dtype=torch.int32)
        for _ in range(6):
            sbi = _batch(list(range(slots)), 1, gen)
            q, k, v, a, b = _tokens((sbi.shape[0],), H, HV, V, K, gen, dtype=dtype)
            y_conv = gdn.conventional_step(S_conv, q, k, v, a, b, A_log, dt_bias, sbi)
            y = gdn.replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi)
            cursors.advance_cursor(cursor, sbi, 1)
            valid = sbi >= 0
            assert torch.equal(y[valid], y_conv[valid])
            assert torch.equal(buf.state, S_conv)
            assert not cursor.any()
        for t, t0 in zip(_tensors(buf)[1:], caches):  # a flush never writes the buffers
            assert torch.equal(t, t0)


def test_flush_writes_the_checkpoint_and_only_it():
    """At cursor = L - 1 the checkpoint becomes the conventional state after the L tokens and no buffer
    entry is written; before it, the checkpoint is the one of L - 1 tokens ago (exact statements)."""
    gen = torch.Generator().manual_seed(3)
    HV, H, V, K, L = 4, 2, 8, 16, 4
    A_log, dt_bias = _params(HV, gen)
    buf = _buffers(1, HV, H, V, K, L, gen)
    S_conv = buf.state.clone()
    S0 = buf.state.clone()
    cursor = torch.zeros(1, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    for step in range(L):
        q, k, v, a, b = _tokens((1,), H, HV, V, K, gen)
        gdn.conventional_step(S_conv, q, k, v, a, b, A_log, dt_bias, sbi)
        caches = [t.clone() for t in _tensors(buf)[1:]]
        gdn.replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi)
        if step < L - 1:
            assert torch.equal(buf.state, S0)  # non-flush: the checkpoint is not written
            qn, kn = gdn.prep_qk(q, k)
            g, beta = gdn.gates(a, b, A_log, dt_bias)
            assert torch.equal(buf.v_cache[0, :, step], v[0]) and torch.equal(buf.k_cache[0, :, step], kn[0])
            assert torch.equal(buf.g_cache[0, :, step], g[0]) and torch.equal(buf.beta_cache[0, :, step], beta[0])
            for t, t0 in zip(_tensors(buf)[1:], caches):  # only entry ``step`` changed
                keep = [i for i in range(L) if i != step]
                assert torch.equal(t[0][:, keep], t0[0][:, keep])
        else:
            assert not torch.equal(buf.state, S0)
            assert _rel(buf.state, S_conv) < RTOL
            for t, t0 in zip(_tensors(buf)[1:], caches):
                assert torch.equal(t, t0)
        cursors.advance_cursor(cursor, sbi, L)
    assert int(cursor[0]) == 0


# ---- teeth ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["u", "k"])
def test_teeth_corrupted_entry_is_detected(which):
    """Corrupt one buffered entry: the replay stops matching the conventional outputs. A corrupted u_j
    moves only the output path (the state the buffer stands for is the fold from v_j, still exact); a
    corrupted k_j moves both."""
    gen = torch.Generator().manual_seed(5)
    HV, H, V, K, L = 4, 2, 8, 16, 8
    A_log, dt_bias = _params(HV, gen)
    buf = _buffers(1, HV, H, V, K, L, gen, garbage=False)
    S_conv = buf.state.clone()
    cursor = torch.zeros(1, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    errs = []
    for step in range(4):
        q, k, v, a, b = _tokens((1,), H, HV, V, K, gen)
        if step == 3:  # entry 1 (index 0), hv 1 (key head 0)
            (buf.u_cache[0, 1, 0] if which == "u" else buf.k_cache[0, 0, 0]).add_(0.5)
        y_conv = gdn.conventional_step(S_conv, q, k, v, a, b, A_log, dt_bias, sbi)
        y = gdn.replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi)
        cursors.advance_cursor(cursor, sbi, L)
        errs.append(_rel(y, y_conv))
    assert max(errs[:3]) < RTOL and errs[3] > 1e-4, errs
    S_err = _rel(gdn.replay_state(buf, cursor, 0), S_conv[0])
    assert (S_err < RTOL) if which == "u" else (S_err > 1e-4), S_err


def test_teeth_spec_poison_reaches_outputs_only_through_committed_entries():
    """The NaN twin of test_spec_commit_equals_conventional is not vacuous: NaN in one committed u entry
    reaches exactly the verify outputs of its (value head, value row), at every window position (and NaN
    in a committed v entry that row of the committed state), while NaN in every non-committed ring entry
    changes nothing."""
    gen = torch.Generator().manual_seed(7)
    HV, H, V, K, L, T = 4, 2, 8, 16, 16, 4
    A_log, dt_bias = _params(HV, gen)
    buf = _buffers(1, HV, H, V, K, L, gen)
    cursor = torch.tensor([[13, 0]], dtype=torch.int32)  # the first window wraps the ring (13, 14, 15, 0)
    sbi = torch.tensor([0], dtype=torch.int32)
    q, k, v, a, b = _tokens((1, T), H, HV, V, K, gen)
    gdn.spec_step(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi)
    cursors.commit(cursor, torch.tensor([3]), T, L, sbi)  # committed at ring 13, 14, 15; rejected at 0
    q, k, v, a, b = _tokens((1, T), H, HV, V, K, gen)
    y_good = gdn.spec_step(buf.clone(), cursor.clone(), q, k, v, a, b, A_log, dt_bias, sbi)
    S_good = gdn.committed_state(buf, cursor, 0)
    junk = buf.clone()
    for t in _tensors(junk)[1:]:
        t[0][:, [i for i in range(L) if i not in (13, 14, 15)]] = float("nan")
    assert torch.equal(gdn.spec_step(junk, cursor.clone(), q, k, v, a, b, A_log, dt_bias, sbi), y_good)
    bad = buf.clone()
    bad.u_cache[0, 1, 14, 3] = float("nan")  # committed entry 2, value head 1, value row 3
    y_bad = gdn.spec_step(bad, cursor.clone(), q, k, v, a, b, A_log, dt_bias, sbi)
    hit = torch.zeros_like(y_good, dtype=torch.bool)
    hit[0, :, 1, 3] = True  # the delta rule is independent per value row: exactly (hv 1, v 3) at every position
    assert torch.isnan(y_bad[hit]).all() and torch.equal(y_bad[~hit], y_good[~hit])
    assert torch.equal(gdn.committed_state(bad, cursor, 0), S_good)  # u is the output path only
    bad = buf.clone()
    bad.v_cache[0, 2, 15, 0] = float("nan")  # committed entry 3, value head 2, value row 0: the fold
    S_bad = gdn.committed_state(bad, cursor, 0)
    assert torch.isnan(S_bad[2, 0]).all() and not torch.isnan(S_bad[2, 1:]).any()


# ---- speculative: flush_checkpoint + flush_cursor + verify + commit ------------------------------------------
def _run_spec(HV, H, V, K, L, T, slots, active, pad, steps=40, accept="random", seed=0):
    """40 model steps of flush_checkpoint + flush_cursor + verify + commit with random acceptance n in 0..T.

    Every verify output (all T positions, a superset of the accepted prefix: a position's output does not
    depend on whether it is later accepted) against the conventional recurrence from the committed state;
    the committed state against the conventional state after the accepted tokens; cursors and committed
    ring entries against a Python model, exactly; a twin run whose non-committed ring entries are NaN
    after every commit gives bit-identical outputs and states (rejected entries are never read)."""
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias = _params(HV, gen)
    buf = _buffers(slots, HV, H, V, K, L, gen)
    twin = buf.clone()  # the same run with every non-committed ring entry overwritten by NaN after each commit
    S_conv = buf.state.clone()
    cursor = torch.zeros(slots, 2, dtype=torch.int32)
    cur_twin = cursor.clone()
    untouched = [t.clone() for t in _tensors(buf)]
    act = list(range(active))
    model = {s: [0, 0, []] for s in act}  # start, count, committed (v, k', g, beta) per slot
    worst, worst_tri, zero_accepts = 0.0, 0.0, 0
    for _ in range(steps):
        sbi = _batch(act, pad, gen)
        batch = sbi.shape[0]
        q, k, v, a, b = _tokens((batch, T), H, HV, V, K, gen)
        if accept == "all":
            nacc = torch.full((batch,), T, dtype=torch.int32)
        else:
            nacc = torch.randint(0, T + 1, (batch,), generator=gen, dtype=torch.int32)  # n = 0 allowed by commit
        rows = [(r, s) for r, s in enumerate(sbi.tolist()) if s >= 0]
        # oracle: every window position from the committed state; advance by the accepted prefix
        y_or = torch.full((batch, T, HV, V), float("nan"), dtype=F64)
        one = torch.tensor([0], dtype=torch.int32)
        for r, s in rows:
            S_try = S_conv[s:s + 1].clone()
            for t in range(T):
                y_or[r, t] = gdn.conventional_step(S_try, q[r:r + 1, t], k[r:r + 1, t], v[r:r + 1, t], a[r:r + 1, t],
                                                   b[r:r + 1, t], A_log, dt_bias, one)[0]
                if t + 1 == int(nacc[r]):
                    S_conv[s] = S_try[0]
            zero_accepts += int(nacc[r]) == 0
        ys = []
        for bf, cur in ((buf, cursor), (twin, cur_twin)):
            flushed = gdn.flush_checkpoint(bf, cur, T, sbi)
            assert cursors.flush_cursor(cur, T, L, sbi) == flushed
            if bf is buf:
                y_tri = gdn.verify_triangular(bf, cur, q, k, v, a, b, A_log, dt_bias, sbi)
            ys.append(gdn.verify(bf, cur, q, k, v, a, b, A_log, dt_bias, sbi, flushed=flushed))
            cursors.commit(cur, nacc, T, L, sbi)
        y = ys[0]
        valid = sbi >= 0
        assert torch.isnan(y[~valid]).all() and not torch.isnan(y[valid]).any()
        assert torch.equal(ys[1][valid], y[valid])  # rejected entries (NaN in the twin) are never read
        worst = max(worst, _rel(y[valid], y_or[valid]))
        worst_tri = max(worst_tri, _rel(y_tri[valid], y[valid]))
        qn, kn = gdn.prep_qk(q, k)
        g, beta = gdn.gates(a, b, A_log, dt_bias)
        for r, s in rows:
            m = model[s]
            if m[1] + 2 * T > L:  # the flush rule, before the step
                m[0], m[1], m[2] = (m[0] + m[1]) % L, 0, []
            n = int(nacc[r])
            m[1] += n
            m[2] += [(v[r, t], kn[r, t], g[r, t], beta[r, t]) for t in range(n)]
            assert cursor[s].tolist() == [m[0], m[1]] and torch.equal(cur_twin[s], cursor[s])  # exact
            assert m[1] <= L - T  # a fully accepted step leaves room for the next window
            for j, (ve, ke, ge, be) in enumerate(m[2]):  # committed ring entries, exact
                i = (m[0] + j) % L
                assert torch.equal(buf.v_cache[s][:, i], ve) and torch.equal(buf.k_cache[s][:, i], ke)
                assert torch.equal(buf.g_cache[s][:, i], ge) and torch.equal(buf.beta_cache[s][:, i], be)
            S_now = gdn.committed_state(buf, cursor, s)
            assert _rel(S_now, S_conv[s]) < RTOL
            assert torch.equal(gdn.committed_state(twin, cur_twin, s), S_now)
            # poison every ring entry of the twin outside the committed range
            junk = [i for i in range(L) if (i - m[0]) % L >= m[1]]
            for t in _tensors(twin)[1:]:
                t[s][:, junk] = float("nan")
    for t, t0 in zip(_tensors(buf), untouched):  # slots never in a batch: bit-identical
        assert torch.equal(t[active:], t0[active:])
    assert not cursor[active:].any()
    return worst, worst_tri, zero_accepts


SBASE = dict(HV=4, H=2, V=8, K=16, L=8, T=2, slots=5, active=3, pad=1)
SCASES = [
    SBASE,
    {**SBASE, "T": 1, "L": 2},  # L = 2T: a flush at every step with history
    {**SBASE, "T": 1, "L": 4},
    {**SBASE, "T": 2, "L": 4},
    {**SBASE, "T": 4},  # L = 2T
    {**SBASE, "T": 4, "L": 16},
    {**SBASE, "T": 4, "L": 9},  # capacity not a multiple of T: the ring start wraps at every offset
    {**SBASE, "HV": 4, "H": 1},
    {**SBASE, "HV": 2, "H": 2},
    {**SBASE, "V": 5, "K": 7},
    {**SBASE, "pad": 0},
    {**SBASE, "accept": "all"},
]


@pytest.mark.parametrize("case", SCASES, ids=lambda c: _id(c, SBASE))
def test_spec_commit_equals_conventional(case):
    worst, worst_tri, zero_accepts = _run_spec(**case)
    assert worst < RTOL, worst
    assert worst_tri < RTOL, worst_tri  # the triangular algebra of verify_triangular
    if case.get("accept", "random") == "random":
        assert zero_accepts > 0  # n = 0 rows were exercised


def test_spec_step_is_flush_then_verify():
    """spec_step (single-layer convenience) == flush_checkpoint + flush_cursor + verify, exactly."""
    gen = torch.Generator().manual_seed(17)
    HV, H, V, K, L, T = 4, 2, 8, 16, 8, 2
    A_log, dt_bias = _params(HV, gen)
    a_buf = _buffers(3, HV, H, V, K, L, gen)
    b_buf = a_buf.clone()
    ca, cb = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32)
    sbi = torch.tensor([2, 0, 1], dtype=torch.int32)
    for _ in range(8):
        q, k, v, a, b = _tokens((3, T), H, HV, V, K, gen)
        y = gdn.spec_step(a_buf, ca, q, k, v, a, b, A_log, dt_bias, sbi)
        fl = gdn.flush_checkpoint(b_buf, cb, T, sbi)
        cursors.flush_cursor(cb, T, L, sbi)
        assert torch.equal(y, gdn.verify(b_buf, cb, q, k, v, a, b, A_log, dt_bias, sbi, flushed=fl))
        n = torch.randint(1, T + 1, (3,), generator=gen, dtype=torch.int32)
        cursors.commit(ca, n, T, L, sbi)
        cursors.commit(cb, n, T, L, sbi)
        for x, z in zip(_tensors(a_buf) + (ca,), _tensors(b_buf) + (cb,)):
            assert torch.equal(x, z)


def test_native_spec_baseline_equals_conventional():
    """native_spec_verify + cursor.native_spec_commit (a state copy per row) == the conventional oracle."""
    gen = torch.Generator().manual_seed(19)
    HV, H, V, K, T, slots = 4, 2, 8, 16, 3, 3
    A_log, dt_bias = _params(HV, gen)
    state = torch.randn(slots, HV, V, K, generator=gen, dtype=F64) * 0.3
    S_conv = state.clone()
    snaps = torch.zeros(slots, T + 1, HV, V, K, dtype=F64)
    sbi = torch.tensor([1, -1, 0], dtype=torch.int32)
    one = torch.tensor([0], dtype=torch.int32)
    for _ in range(6):
        q, k, v, a, b = _tokens((3, T), H, HV, V, K, gen)
        n = torch.randint(0, T + 1, (3,), generator=gen, dtype=torch.int32)
        y = gdn.native_spec_verify(state, snaps, q, k, v, a, b, A_log, dt_bias, sbi)
        assert torch.isnan(y[1]).all() and not snaps[:, T].any()
        for r, s in ((0, 1), (2, 0)):
            S_try = S_conv[s:s + 1].clone()
            for t in range(T):
                y_t = gdn.conventional_step(S_try, q[r:r + 1, t], k[r:r + 1, t], v[r:r + 1, t], a[r:r + 1, t],
                                            b[r:r + 1, t], A_log, dt_bias, one)
                assert _rel(y[r, t], y_t[0]) < RTOL  # the same recurrence (batched reductions: last-bit noise)
                if t + 1 == int(n[r]):
                    S_conv[s] = S_try[0]
        cursors.native_spec_commit(state, snaps, n, sbi)
        assert _rel(state, S_conv) < RTOL
    assert torch.equal(state[2], S_conv[2])  # never in the batch


def test_verify_triangular_alone():
    """verify_triangular == verify at a committed history that wraps the ring, all T positions; it writes nothing."""
    gen = torch.Generator().manual_seed(23)
    HV, H, V, K, L, T = 8, 2, 12, 16, 16, 6
    A_log, dt_bias = _params(HV, gen)
    buf = _buffers(2, HV, H, V, K, L, gen)
    cursor = torch.tensor([[13, 7], [5, 0]], dtype=torch.int32)
    sbi = torch.tensor([1, 0, -1], dtype=torch.int32)
    q, k, v, a, b = _tokens((3, T), H, HV, V, K, gen)
    before = [t.clone() for t in _tensors(buf)]
    y_tri = gdn.verify_triangular(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi)
    for t, t0 in zip(_tensors(buf), before):
        assert torch.equal(t, t0)
    y = gdn.verify(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi)
    assert torch.isnan(y_tri[2]).all()
    assert _rel(y_tri[:2], y[:2]) < RTOL


def test_verify_triangular_is_causal_for_a_non_finite_later_value():
    """Like verify (a recurrence), verify_triangular's y_t reads u_t' for t' <= t only: a NaN in v of window
    token 3 must not reach y_0..y_2 (a zero tril weight times the NaN u_3 spread it to every position)."""
    gen = torch.Generator().manual_seed(29)
    HV, H, V, K, L, T = 4, 2, 6, 8, 8, 4
    A_log, dt_bias = _params(HV, gen)
    buf = _buffers(1, HV, H, V, K, L, gen)
    cursor = torch.tensor([[6, 3]], dtype=torch.int32)
    q, k, v, a, b = _tokens((1, T), H, HV, V, K, gen)
    v[0, 3, 1, 2] = float("nan")
    y_tri = gdn.verify_triangular(buf, cursor, q, k, v, a, b, A_log, dt_bias)
    y = gdn.verify(buf.clone(), cursor, q, k, v, a, b, A_log, dt_bias)
    assert torch.isfinite(y[0, :3]).all()
    assert torch.isfinite(y_tri[0, :3]).all(), "a later token's NaN reached earlier positions"
    assert _rel(y_tri[0, :3], y[0, :3]) < RTOL


# ---- shadow ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,tol", [("bf16", 4e-3), ("fp8", 6e-2)])
def test_shadow_errors_do_not_accumulate(kind, tol):
    """Standard decode reading a bf16 / fp8 shadow of the checkpoint on non-flush steps, over 4 flushes:
    - non-flush outputs are within the shadow's rounding of the exact ones (0 < err < tol);
    - every flush refolds from v_j and the full-precision checkpoint, so checkpoints and flush-step
      outputs equal the no-shadow run's bit for bit, and the shadow is rewritten from what was stored;
    - counter-check: a fold by the u-sum of the shadow-computed u_j (vLLM's route) differs from the
      exact fold by a sizeable part of the shadow's rounding of S0 (> 5% of it, ~20% measured: what the
      L - 1 entries' decay leaves of it), while without a shadow the two agree to 1e-12."""
    gen = torch.Generator().manual_seed(29)
    HV, H, V, K, L, slots = 4, 2, 16, 16, 4, 2
    A_log, dt_bias = _params(HV, gen)
    exact = _buffers(slots, HV, H, V, K, L, gen)
    shad = exact.clone()
    sh = shadowq.Shadow.of(shad.state, kind)
    assert tuple(sh.q.shape) == (slots, HV, V, K)
    S_conv = exact.state.clone()
    cur_e, cur_s = torch.zeros(slots, dtype=torch.int32), torch.zeros(slots, dtype=torch.int32)
    sbi = torch.tensor([1, 0], dtype=torch.int32)
    nonflush, usum_gap, flushes = [], [], 0
    for _ in range(4 * L):
        q, k, v, a, b = _tokens((2,), H, HV, V, K, gen)
        pos = int(cur_e[0])
        if pos == L - 1:  # the counter-check, just before the fold: u-sum vs exact fold of the same entries
            for s in range(slots):
                idx = torch.arange(pos)
                us, _, ks, gs, _ = gdn._entries(shad, s, idx)
                u_fold = gdn._replay(shad.state[s], us, ks, gs)
                read_err = _rel(sh.read(s, F64), shad.state[s])  # the shadow's own rounding of S0
                usum_gap.append(_rel(u_fold, gdn.replay_state(shad, cur_s, s)) / read_err)
                us, _, ks, gs, _ = gdn._entries(exact, s, idx)
                assert _rel(gdn._replay(exact.state[s], us, ks, gs), gdn.replay_state(exact, cur_e, s)) < RTOL
        gdn.conventional_step(S_conv, q, k, v, a, b, A_log, dt_bias, sbi)
        y_e = gdn.replay_decode(exact, cur_e, q, k, v, a, b, A_log, dt_bias, sbi)
        y_s = gdn.replay_decode(shad, cur_s, q, k, v, a, b, A_log, dt_bias, sbi, shadow=sh)
        cursors.advance_cursor(cur_e, sbi, L)
        cursors.advance_cursor(cur_s, sbi, L)
        if pos == L - 1:
            flushes += 1
            assert torch.equal(y_s, y_e) and torch.equal(shad.state, exact.state)
            assert _rel(shad.state, S_conv) < RTOL
            for s in range(slots):
                want = shadowq.Shadow(1, HV, V, K, kind)
                want.write(0, shad.state[s])
                assert torch.equal(sh.q[s].view(torch.uint8), want.q[0].view(torch.uint8))
        else:
            nonflush.append(_rel(y_s, y_e))
            assert torch.equal(shad.v_cache, exact.v_cache) and torch.equal(shad.k_cache, exact.k_cache)
        for s in range(slots):  # the state the buffer stands for (the exact fold) is never off
            assert torch.equal(gdn.replay_state(shad, cur_s, s), gdn.replay_state(exact, cur_e, s))
    assert flushes >= 3
    assert 0 < min(nonflush) and max(nonflush) < tol, (min(nonflush), max(nonflush))
    assert min(usum_gap) > 0.05, usum_gap  # the u-sum fold would carry a good part of the shadow's error into S0
    # no accumulation: the last cycle's output error is no worse than the first cycle's, up to noise
    per = L - 1
    assert max(nonflush[-per:]) < 4 * max(nonflush[:per]) + 1e-12


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_spec_shadow_flush_is_exact(kind):
    """Speculative form with a shadow: verify reads the shadow except for the slots flushed this step;
    flush_checkpoint folds from v_j, so committed states equal the no-shadow run's bit for bit."""
    gen = torch.Generator().manual_seed(37)
    HV, H, V, K, L, T = 4, 2, 16, 16, 8, 2
    A_log, dt_bias = _params(HV, gen)
    exact = _buffers(2, HV, H, V, K, L, gen)
    shad = exact.clone()
    sh = shadowq.Shadow.of(shad.state, kind)
    ce, cs = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)
    sbi = torch.tensor([0, 1], dtype=torch.int32)
    flushes, errs = 0, []
    for _ in range(16):
        q, k, v, a, b = _tokens((2, T), H, HV, V, K, gen)
        y_e = gdn.spec_step(exact, ce, q, k, v, a, b, A_log, dt_bias, sbi)
        fl = gdn.flush_checkpoint(shad, cs, T, sbi, shadow=sh)
        cursors.flush_cursor(cs, T, L, sbi)
        y_s = gdn.verify(shad, cs, q, k, v, a, b, A_log, dt_bias, sbi, shadow=sh, flushed=fl)
        flushes += len(fl)
        for r, s in enumerate(sbi.tolist()):
            if s in fl:
                assert torch.equal(y_s[r], y_e[r])  # a flushed slot reads the checkpoint it just stored
            else:
                errs.append(_rel(y_s[r], y_e[r]))
        n = torch.randint(1, T + 1, (2,), generator=gen, dtype=torch.int32)
        cursors.commit(ce, n, T, L, sbi)
        cursors.commit(cs, n, T, L, sbi)
        assert torch.equal(shad.state, exact.state) and torch.equal(ce, cs)
        for s in range(2):
            assert torch.equal(gdn.committed_state(shad, cs, s), gdn.committed_state(exact, ce, s))
    assert flushes >= 4
    assert 0 < min(errs) and max(errs) < (4e-3 if kind == "bf16" else 6e-2)


# ---- padding rows, unused slots, validation --------------------------------------------------------------
def test_padding_rows_and_unused_slots_untouched():
    gen = torch.Generator().manual_seed(41)
    HV, H, V, K, L = 4, 2, 8, 16, 4
    A_log, dt_bias = _params(HV, gen)
    buf = _buffers(4, HV, H, V, K, L, gen)
    cursor = torch.tensor([3, 1, 2, 0], dtype=torch.int32)  # slot 0 flushes, slot 2 appends at index 2
    before = [t.clone() for t in _tensors(buf)]
    sbi = torch.tensor([-1, 2, -1, 0], dtype=torch.int32)
    q, k, v, a, b = _tokens((4,), H, HV, V, K, gen)
    y = gdn.replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi)
    assert torch.isnan(y[[0, 2]]).all() and not torch.isnan(y[[1, 3]]).any()
    assert cursor.tolist() == [3, 1, 2, 0]  # replay_decode does not move the cursor
    for now, then in zip(_tensors(buf), before):
        for s in (1, 3):
            assert torch.equal(now[s], then[s])
    assert torch.equal(buf.state[2], before[0][2]) and not torch.equal(buf.state[0], before[0][0])
    for now, then in zip(_tensors(buf)[1:], before[1:]):
        assert torch.equal(now[0], then[0])  # flush: no buffer written
        assert torch.equal(now[2][:, [0, 1, 3]], then[2][:, [0, 1, 3]])
    # speculative: the same for verify (+ flush_checkpoint) and commit
    ring = torch.tensor([[1, 4], [3, 2], [7, 1], [0, 0]], dtype=torch.int32)
    L2, T = 8, 2
    buf = _buffers(4, HV, H, V, K, L2, gen)
    before = [t.clone() for t in _tensors(buf)] + [ring.clone()]
    sbi = torch.tensor([-1, 2, -1], dtype=torch.int32)
    q, k, v, a, b = _tokens((3, T), H, HV, V, K, gen)
    y = gdn.spec_step(buf, ring, q, k, v, a, b, A_log, dt_bias, sbi)
    cursors.commit(ring, torch.tensor([T, 1, T], dtype=torch.int32), T, L2, sbi)
    assert torch.isnan(y[[0, 2]]).all() and not torch.isnan(y[1]).any()
    for now, then in zip(_tensors(buf) + (ring,), before):
        for s in (0, 1, 3):
            assert torch.equal(now[s], then[s])
    assert ring[2].tolist() == [7, 2]  # 1 + 4 <= 8: no flush; window at ring (7 + 1) % 8 = 0, 1; one accepted
    assert torch.equal(buf.v_cache[2][:, [0, 1]], v[1].transpose(0, 1))


def _problem(slots=2, HV=4, H=2, V=8, K=16, L=4, lead=(2,)):
    gen = torch.Generator().manual_seed(43)
    A_log, dt_bias = _params(HV, gen)
    return gen, _buffers(slots, HV, H, V, K, L, gen), _tokens(lead, H, HV, V, K, gen), A_log, dt_bias


def test_shape_errors_name_the_argument():
    _, buf, (q, k, v, a, b), A_log, dt_bias = _problem()
    cur = torch.zeros(2, dtype=torch.int32)
    sbi = torch.tensor([0, 1], dtype=torch.int32)
    args = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    for name, bad, msg in (("q", q[..., :7], r"q: expected shape \(2, 2, 16\), got \(2, 2, 7\)"),
                           ("k", k[:, :1], r"k: expected shape \(2, 2, 16\), got \(2, 1, 16\)"),
                           ("a", a[:, :3], r"a: expected shape \(2, 4\), got \(2, 3\)"),
                           ("b", b[None], r"b: expected shape \(2, 4\)"),
                           ("A_log", A_log[:2], r"A_log: expected shape \(4,\), got \(2,\)"),
                           ("dt_bias", dt_bias[:, None], r"dt_bias: expected shape \(4,\)")):
        with pytest.raises(ValueError, match=msg):
            gdn.replay_decode(buf, cur, **{**args, name: bad}, state_batch_indices=sbi)
    # v sets the batch and HV: a v of the wrong V names v
    with pytest.raises(ValueError, match=r"v: expected shape \(2, 4, 8\), got \(2, 4, 5\)"):
        gdn.replay_decode(buf, cur, **{**args, "v": v[..., :5]}, state_batch_indices=sbi)
    with pytest.raises(TypeError, match="A_log: expected a torch.Tensor, got list"):
        gdn.replay_decode(buf, cur, **{**args, "A_log": A_log.tolist()}, state_batch_indices=sbi)
    with pytest.raises(ValueError, match=r"cursor: expected shape \(2,\), got \(2, 2\)"):
        gdn.replay_decode(buf, torch.zeros(2, 2, dtype=torch.int32), **args, state_batch_indices=sbi)
    bad = buf.clone()
    bad.k_cache = bad.k_cache[:, :, :3]
    with pytest.raises(ValueError, match=r"k_cache: expected shape \(2, 2, 4, 16\), got \(2, 2, 3, 16\)"):
        gdn.replay_decode(bad, cur, **args, state_batch_indices=sbi)
    with pytest.raises(ValueError, match="HV: value heads must be a multiple of key heads H=3, got 4"):
        gdn.GDNBuffers.alloc(1, 4, 3, 8, 8, 4)
    # alloc refuses H=3 for HV=4 (above); built by hand, check() refuses it too
    odd = gdn.GDNBuffers(torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 4, 8), torch.zeros(1, 4, 4, 8),
                         torch.zeros(1, 3, 4, 8), torch.zeros(1, 4, 4), torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="k_cache: key heads must divide value heads HV=4, got H=3"):
        odd.check()
    _, sbuf, (q, k, v, a, b), A_log, dt_bias = _problem(lead=(2, 2), L=4)
    with pytest.raises(ValueError, match=r"v: expected at most L=4 tokens per window, got T=5"):
        q5, k5, v5, a5, b5 = _tokens((2, 5), 2, 4, 8, 16, torch.Generator().manual_seed(0))
        gdn.verify(sbuf, torch.zeros(2, 2, dtype=torch.int32), q5, k5, v5, a5, b5, A_log, dt_bias, sbi)
    with pytest.raises(ValueError, match=r"snapshots: expected shape \(2, >= 2, 4, 8, 16\)"):
        gdn.native_spec_verify(sbuf.state, torch.zeros(2, 1, 4, 8, 16, dtype=F64), q, k, v, a, b, A_log, dt_bias, sbi)


def test_cursor_and_slot_errors_write_nothing():
    _, buf, (q, k, v, a, b), A_log, dt_bias = _problem()
    before = [t.clone() for t in _tensors(buf)]
    sbi = torch.tensor([0, 1], dtype=torch.int32)
    # standard cursor out of [0, L): row 0 is fine, row 1 is not; validated before anything is written
    with pytest.raises(ValueError, match=r"cursor\[1\] = 4 is outside \[0, 4\)"):
        gdn.replay_decode(buf, torch.tensor([1, 4], dtype=torch.int32), q, k, v, a, b, A_log, dt_bias, sbi)
    with pytest.raises(ValueError, match=r"cursor\[0\] = -1 is outside"):
        gdn.replay_decode(buf, torch.tensor([-1, 0], dtype=torch.int32), q, k, v, a, b, A_log, dt_bias, sbi)
    with pytest.raises(ValueError, match="state_batch_indices: a slot appears in more than one row"):
        gdn.replay_decode(buf, torch.zeros(2, dtype=torch.int32), q, k, v, a, b, A_log, dt_bias,
                          torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"state_batch_indices: expected values in \[-1, 2\), got \[2\]"):
        gdn.replay_decode(buf, torch.zeros(2, dtype=torch.int32), q, k, v, a, b, A_log, dt_bias,
                          torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="state_batch_indices: expected dtype int32"):
        gdn.replay_decode(buf, torch.zeros(2, dtype=torch.int32), q, k, v, a, b, A_log, dt_bias, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="more than one row"):
        gdn.conventional_step(buf.state.clone(), q, k, v, a, b, A_log, dt_bias, torch.tensor([0, 0], dtype=torch.int32))
    for t, t0 in zip(_tensors(buf), before):
        assert torch.equal(t, t0)
    # speculative: count + T > L names the slot and says what to run; row 0 valid, nothing written
    _, sbuf, (q, k, v, a, b), A_log, dt_bias = _problem(L=8, lead=(2, 2))
    before = [t.clone() for t in _tensors(sbuf)]
    with pytest.raises(ValueError, match=r"cursor\[1\]: expected 0 <= start < 8 and count \+ T <= 8 \(T=2\), got "
                                         r"start=0, count=7; run flush_checkpoint"):
        gdn.verify(sbuf, torch.tensor([[3, 2], [0, 7]], dtype=torch.int32), q, k, v, a, b, A_log, dt_bias, sbi)
    with pytest.raises(ValueError, match=r"cursor\[0\]: expected 0 <= start < 8"):
        gdn.verify(sbuf, torch.tensor([[8, 0], [0, 0]], dtype=torch.int32), q, k, v, a, b, A_log, dt_bias, sbi)
    with pytest.raises(TypeError, match="cursor: expected dtype int32"):
        gdn.flush_checkpoint(sbuf, torch.zeros(2, 2, dtype=torch.int64), 2, sbi)
    with pytest.raises(ValueError, match=r"cursor: expected shape \(2, 2\), got \(2,\)"):
        gdn.verify(sbuf, torch.zeros(2, dtype=torch.int32), q, k, v, a, b, A_log, dt_bias, sbi)
    with pytest.raises(ValueError, match="buffer_len: expected >= 2 \\* num_tokens = 10"):
        gdn.flush_checkpoint(sbuf, torch.zeros(2, 2, dtype=torch.int32), 5, sbi)
    with pytest.raises(ValueError, match="more than one row"):
        gdn.verify(sbuf, torch.zeros(2, 2, dtype=torch.int32), q, k, v, a, b, A_log, dt_bias,
                   torch.tensor([0, 0], dtype=torch.int32))
    for t, t0 in zip(_tensors(sbuf), before):
        assert torch.equal(t, t0)


# ---- anchor: transformers' Qwen3-Next recurrence ---------------------------------------------------------------
def test_matches_transformers_qwen3_next_recurrence():
    """conventional_step over several tokens == transformers' ``torch_recurrent_gated_delta_rule`` (the
    Qwen3-Next / Qwen3.5 torch path, l2 norm in the kernel, q / sqrt(K)), state transposed: ours (V, K),
    theirs (K, V). Theirs computes in float32 whatever the input dtype: 1e-5. The gates are the module's
    own formula (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) and the norm its l2norm."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                             reason="transformers with Qwen3-Next is not installed")
    gen = torch.Generator().manual_seed(47)
    for HV, H, V, K in ((4, 2, 16, 16), (4, 4, 12, 8), (8, 2, 16, 32)):
        B, T, slots = 3, 6, 3
        A_log, dt_bias = _params(HV, gen)
        q, k, v, a, b = _tokens((B, T), H, HV, V, K, gen)
        S0 = torch.randn(slots, HV, V, K, generator=gen, dtype=F64) * 0.3
        g_hf = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
        beta_hf = b.sigmoid()
        g, beta = gdn.gates(a, b, A_log, dt_bias)
        assert torch.allclose(g, g_hf, rtol=1e-14, atol=0) and torch.allclose(beta, beta_hf, rtol=1e-14, atol=0)
        qn, kn = gdn.prep_qk(q, k)
        assert torch.allclose(kn, hf.l2norm(k, dim=-1, eps=1e-6), rtol=1e-14, atol=0)
        assert torch.allclose(qn, hf.l2norm(q, dim=-1, eps=1e-6) / math.sqrt(K), rtol=1e-14, atol=0)
        sbi = torch.tensor([2, 0, 1], dtype=torch.int32)
        y_hf, S_hf = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g_hf, beta=beta_hf,
                                                         initial_state=S0[sbi.long()].transpose(-1, -2),
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        S = S0.clone()
        y = torch.stack([gdn.conventional_step(S, q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias, sbi)
                         for t in range(T)], dim=1)
        assert y_hf.shape == y.shape and S_hf.shape == (B, HV, K, V)
        assert _rel(y_hf.double(), y) < 1e-5
        assert _rel(S_hf.double().transpose(-1, -2), S[sbi.long()]) < 1e-5
        # teeth: the un-transposed state (V == K: same shape), or dropping the l2 norm, is far off
        if V == K:
            assert _rel(S_hf.double(), S[sbi.long()]) > 0.1
        y_no_norm = gdn.conventional_step(S0.clone(), q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], A_log, dt_bias, sbi,
                                          use_qk_l2norm=False)
        assert _rel(y_no_norm, y[:, 0]) > 0.1


# ---- named geometries -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GDN_MODELS))
def test_gdn_geometry_is_self_consistent(name):
    m = GDN_MODELS[name]
    HV, H, V, K = GDN_GEOMETRIES[name]
    assert (HV, H, V, K) == m.geometry == (m.num_v_heads, m.num_k_heads, m.head_v_dim, m.head_k_dim)
    assert HV % H == 0 and HV >= H  # value heads share key heads (GVA), hv -> hv // (HV / H)
    assert m.num_hidden_layers % m.full_attention_interval == 0
    assert m.gdn_layers == m.num_hidden_layers * (m.full_attention_interval - 1) // m.full_attention_interval
    assert m.layer_types[m.full_attention_interval - 1] == "full_attention" and m.layer_types[0] == "linear_attention"
    assert m.conv_dim == 2 * H * K + HV * V and m.conv_kernel == 4
    assert m.num_attention_heads % m.num_key_value_heads == 0
    assert 0 < m.num_experts_per_tok <= m.num_experts
    assert m.hf_id.startswith("Qwen/")
    # the layer fits the reference's buffers, and ReplaySSM moves fewer bytes than the conventional step at L = 16
    buf = gdn.GDNBuffers.alloc(1, HV, H, V, K, 2)
    buf.check()
    assert buf.geometry == (1, HV, H, V, K, 2) and m.state_bytes() == buf.state[0].numel() * 4
    bytes_ = gdn.bytes_per_step(HV, H, V, K, 16)
    io = (2 * H * K + HV * V + 2 * HV) * 2 + HV * V * 2
    assert bytes_["conventional"] == 2 * HV * V * K * 4 + io
    assert bytes_["ratio"] > 1.3


def test_gdn_geometries_match_transformers_defaults():
    """transformers' Qwen3NextConfig / Qwen3_5MoeTextConfig defaults are documented as the
    Qwen3-Next-80B-A3B-Instruct / Qwen3.5-35B-A3B checkpoints: an independent copy of the numbers."""
    transformers = pytest.importorskip("transformers")
    rows = [("qwen3_next_80b", "Qwen3NextConfig"), ("qwen3_5_35b", "Qwen3_5MoeTextConfig")]
    for name, cls in rows:
        if not hasattr(transformers, cls):
            pytest.skip(f"transformers {transformers.__version__} has no {cls}")
        c, m = getattr(transformers, cls)(), GDN_MODELS[name]
        got = (c.linear_num_value_heads, c.linear_num_key_heads, c.linear_value_head_dim, c.linear_key_head_dim,
               c.linear_conv_kernel_dim, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
               c.num_key_value_heads, c.head_dim, c.num_experts, c.num_experts_per_tok, c.vocab_size)
        want = (*m.geometry, m.conv_kernel, m.hidden_size, m.num_hidden_layers, m.num_attention_heads,
                m.num_key_value_heads, m.head_dim, m.num_experts, m.num_experts_per_tok, m.vocab_size)
        assert got == want, (name, got, want)
        assert list(c.layer_types) == m.layer_types


def test_bytes_model_per_position():
    """The one GDN bytes model (bench_gdn.py divides by it): per position, and bytes_per_step its mean."""
    HV, H, V, K, L = 32, 16, 128, 128, 16
    conv, per_k = gdn.bytes_per_position(HV, H, V, K, L)
    state, io = HV * V * K * 4, (2 * H * K + HV * V + 2 * HV) * 2 + HV * V * 2
    assert conv == 2 * state + io
    assert per_k[2] - per_k[1] == HV * V * 4 + H * K * 4 + HV * 4  # one more buffered entry read: u, k, g
    assert per_k[1] == state + io + HV * V * (4 + 2) + H * K * 4 + 2 * HV * 4  # S0 + io + the entry written
    assert per_k[L] == 2 * state + io + (L - 1) * (HV * V * 4 + H * K * 4 + HV * 4)  # the u-sum: u, k, g
    _, sh = gdn.bytes_per_position(HV, H, V, K, L, shadow_bytes=2)
    assert per_k[1] - sh[1] == HV * V * K * 2  # the shadow read
    # the shadow rewritten, and the refold's entries (v, k, g, beta) instead of the u-sum's
    assert sh[L] == 2 * state + HV * V * K * 2 + io + (L - 1) * (HV * V * 2 + H * K * 4 + 2 * HV * 4)
    step = gdn.bytes_per_step(HV, H, V, K, L)
    assert step["replay"] == sum(per_k.values()) / L and step["flush"] == per_k[L]
    assert 1.70 < step["ratio"] < 1.72  # bench/NOTES.md: the bytes-model ceiling 1.709x
