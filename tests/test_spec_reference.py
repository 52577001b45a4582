# SPDX-License-Identifier: Apache-2.0
"""Speculative ReplaySSM (spec_reference) against a conventional sequential oracle.

Oracles and precision:
- :func:`reference.conventional_step` in float64, fed the committed tokens one at a time. Every
  verify output y_t must equal the oracle's output for window token t when started from the committed
  state (all T positions, not only the accepted prefix: the output of a position does not depend on
  whether it is later accepted), and the committed state after each commit must equal the oracle's
  state after the accepted tokens. Both sides are float64 on the same inputs; agreement is ~1e-13
  relative, and RTOL = 1e-10 leaves room for the different summation order (exp(c_k - c_j) products
  vs repeated multiplication) over 40 steps with flushes.
- A pure-Python model of the cursor (start, count) and of the committed entries: bookkeeping
  (cursor, ring contents of committed entries, slots not in the batch) is compared exactly (rtol = atol = 0).
- The native-spec baseline against the same conventional oracle (same 1e-10 tolerance, same reason).
- conv1d window: torch.nn.functional.conv1d over the full committed input history (float64, 1e-12:
  a K-term sum in a different order).
"""

import pytest
import torch
import torch.nn.functional as F

from trtllm_replayssm import conv_window as convw
from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.mamba2 import reference as ref
from trtllm_replayssm.families.mamba2 import spec_reference as sr

from .problems import make_params

F64 = torch.float64
RTOL = 1e-10  # float64 both sides; different summation order only (see module docstring)


pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _window(batch, T, H, P, N, G, gen, has_z=False):
    def rnd(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=gen, dtype=F64) * scale + shift
    x = rnd(batch, T, H, P)
    B = rnd(batch, T, G, N, scale=N ** -0.5 * 4)
    C = rnd(batch, T, G, N, scale=N ** -0.5 * 4)
    dt = rnd(batch, T, H, shift=-2.0)
    z = rnd(batch, T, H, P) if has_z else None
    return x, B, C, dt, z


class CursorModel:
    """Independent model of the cursor and the committed entries of one slot (plain Python)."""

    def __init__(self, L):
        self.L, self.start, self.count, self.entries = L, 0, 0, []

    def step(self, T, n, window):  # window: list of T (x, B, dtp) tuples
        if self.count + 2 * T > self.L:
            self.start, self.count, self.entries = (self.start + self.count) % self.L, 0, []
        assert self.count + T <= self.L  # the window always fits after the flush rule
        self.count += n
        self.entries += window[:n]
        assert self.count <= self.L - T  # a fully accepted step leaves room for the next window


def _run(H=4, P=16, N=16, G=2, L=16, T=4, batch=3, slots=5, steps=40, has_z=False, pad_rows=(), accept="random",
         seed=0, native=False):
    gen = torch.Generator().manual_seed(seed)
    prm = make_params(H, gen)
    dt_bias, A, D = (t.to(F64) for t in (prm.dt_bias, prm.A, prm.D))
    S0 = torch.randn(slots, H, P, N, generator=gen, dtype=F64)
    S_conv = S0.clone()  # oracle: the conventional state of every slot
    state = S0.clone()
    xc = torch.randn(slots, H, L, P, generator=gen, dtype=F64)  # garbage: nothing outside count may be read
    Bc = torch.randn(slots, G, L, N, generator=gen, dtype=F64)
    dtc = torch.rand(slots, H, L, generator=gen, dtype=F64)
    cursor = torch.zeros(slots, 2, dtype=torch.int32)
    snaps = torch.zeros(slots, T, H, P, N, dtype=F64)
    sbi = torch.randperm(slots, generator=gen)[:batch].to(torch.int32)
    sbi[list(pad_rows)] = -1
    rows = [(b, int(s)) for b, s in enumerate(sbi.tolist()) if s >= 0]
    untouched = [s for s in range(slots) if s not in sbi.tolist()]
    before = [t.clone() for t in (state, xc, Bc, dtc, cursor)]
    models = {s: CursorModel(L) for _, s in rows}
    worst = 0.0
    for _ in range(steps):
        x, B, C, dt, z = _window(batch, T, H, P, N, G, gen, has_z)
        if accept == "all":
            nacc = torch.full((batch,), T, dtype=torch.int32)
        else:
            nacc = torch.randint(1, T + 1, (batch,), generator=gen, dtype=torch.int32)
        # oracle: every window position from the committed state, then advance by the accepted tokens
        y_or = torch.full((batch, T, H, P), float("nan"), dtype=F64)
        S_next = S_conv.clone()
        for b, s in rows:
            S_try = S_conv[s:s + 1].clone()
            one = torch.tensor([0], dtype=torch.int32)
            for t in range(T):
                y_or[b, t] = ref.conventional_step(S_try, x[b:b + 1, t], B[b:b + 1, t], C[b:b + 1, t], dt[b:b + 1, t], dt_bias,
                                                   A, D, None if z is None else z[b:b + 1, t], one)[0]
                if t + 1 == int(nacc[b]):
                    S_next[s] = S_try[0]
        if native:
            y = sr.native_spec_verify(state, snaps, x, B, C, dt, dt_bias, A, D, z, sbi)
            cursors.native_spec_commit(state, snaps, nacc, sbi)
        else:
            y = sr.spec_step(state, xc, Bc, dtc, cursor, x, B, C, dt, dt_bias, A, D, z, sbi)
            cursors.commit(cursor, nacc, T, L, sbi)
        S_conv = S_next
        valid = sbi >= 0
        assert torch.isnan(y[~valid]).all()
        worst = max(worst, _rel(y[valid], y_or[valid]))
        dtp = ref.process_dt(dt, dt_bias)
        for b, s in rows:
            now = state[s] if native else sr.committed_state(state, xc, Bc, dtc, cursor, A, s)
            assert torch.allclose(now, S_conv[s], rtol=RTOL, atol=RTOL * float(S_conv[s].abs().max()))
            if native:
                continue
            m = models[s]
            m.step(T, int(nacc[b]), [(x[b, t], B[b, t], dtp[b, t]) for t in range(T)])
            assert (int(cursor[s, 0]), int(cursor[s, 1])) == (m.start, m.count)  # exact
            for j, (xe, Be, de) in enumerate(m.entries):  # committed ring entries, exact (rtol = atol = 0)
                i = (m.start + j) % L
                assert torch.equal(xc[s][:, i], xe) and torch.equal(Bc[s][:, i], Be) and torch.equal(dtc[s][:, i], de)
    for t, t0 in zip((state, xc, Bc, dtc, cursor), before):  # slots outside the batch: untouched, exact
        for s in untouched:
            assert torch.equal(t[s], t0[s])
    return worst, cursor, sbi


BASE = dict(H=4, P=16, N=16, G=2, L=16, T=4, batch=3, slots=5, steps=40, has_z=False, pad_rows=(), accept="random")
CASES = [
    BASE,
    {**BASE, "T": 1, "L": 4},  # T = 1: standard decode on the ring
    {**BASE, "T": 2},
    {**BASE, "T": 6},
    {**BASE, "T": 8},
    {**BASE, "T": 2, "L": 4},  # L = 2T: flush every step that has any history
    {**BASE, "T": 8, "L": 32},
    {**BASE, "L": 9},  # capacity not a multiple of T: the ring start wraps at every offset
    {**BASE, "has_z": True},
    {**BASE, "pad_rows": (0, 2)},
    {**BASE, "G": 1},
    {**BASE, "G": 4},
    {**BASE, "accept": "all"},
    {**BASE, "P": 64, "N": 128, "H": 2, "G": 1, "steps": 12},
]


def _id(c):
    return ",".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v) or "base"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_spec_rollback_equals_conventional(case):
    worst, cursor, sbi = _run(**case)
    assert worst < RTOL, worst


@pytest.mark.parametrize("case", [BASE, {**BASE, "T": 2}, {**BASE, "T": 8, "has_z": True}, {**BASE, "pad_rows": (1,)}],
                         ids=_id)
def test_native_spec_equals_conventional(case):
    worst, _, _ = _run(**case, native=True)
    assert worst < RTOL, worst


@pytest.mark.parametrize("T,L", [(1, 2), (2, 4), (2, 5), (4, 8), (4, 11), (4, 16), (6, 16), (8, 16), (8, 17)])
def test_flush_rule_property(T, L):
    """Cursor-only property over random acceptances: the window always fits, count never exceeds L - T."""
    gen = torch.Generator().manual_seed(T * 100 + L)
    cursor = torch.zeros(1, 2, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    for step in range(300):
        cursors.flush_cursor(cursor, T, L, sbi)
        start, count = int(cursor[0, 0]), int(cursor[0, 1])
        assert 0 <= start < L and count + 2 * T <= L
        n = T if step % 3 == 0 else int(torch.randint(0, T + 1, (1,), generator=gen))
        cursors.commit(cursor, torch.tensor([n]), T, L, sbi)
        assert int(cursor[0, 1]) <= L - T  # after a fully accepted step the next window still fits


def test_fully_accepted_never_truncates_next_window():
    """At count = L - 2T exactly no flush happens, and a full accept leaves exactly one window of room."""
    L, T = 12, 3
    cursor = torch.tensor([[5, L - 2 * T]], dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    assert cursors.flush_cursor(cursor, T, L, sbi) == []
    cursors.commit(cursor, torch.tensor([T]), T, L, sbi)
    assert cursor.tolist() == [[5, L - T]]
    assert cursors.flush_cursor(cursor, T, L, sbi) == [0]
    assert cursor.tolist() == [[(5 + L - T) % L, 0]]


def test_flush_folds_committed_history_only():
    """A flush after a partial accept writes S_count (not the rejected entries) and leaves the ring alone."""
    gen = torch.Generator().manual_seed(7)
    H, P, N, G, L, T = 2, 8, 8, 1, 8, 4
    prm = make_params(H, gen)
    dt_bias, A, D = (t.to(F64) for t in (prm.dt_bias, prm.A, prm.D))
    state = torch.randn(1, H, P, N, generator=gen, dtype=F64)
    S_conv = state.clone()
    xc, Bc, dtc = torch.zeros(1, H, L, P, dtype=F64), torch.zeros(1, G, L, N, dtype=F64), torch.zeros(1, H, L, dtype=F64)
    cursor = torch.zeros(1, 2, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    x, B, C, dt, _ = _window(1, T, H, P, N, G, gen)
    sr.spec_step(state, xc, Bc, dtc, cursor, x, B, C, dt, dt_bias, A, D, None, sbi)
    cursors.commit(cursor, torch.tensor([1]), T, L, sbi)
    ref.conventional_step(S_conv, x[:, 0], B[:, 0], C[:, 0], dt[:, 0], dt_bias, A, D, None, sbi)
    rings = [t.clone() for t in (xc, Bc, dtc)]
    assert sr.maybe_flush(state, xc, Bc, dtc, cursor, A, T, sbi) == [0]  # 1 + 2*4 > 8
    assert cursor.tolist() == [[1, 0]]
    assert torch.allclose(state, S_conv, rtol=RTOL, atol=0)
    for t, t0 in zip((xc, Bc, dtc), rings):
        assert torch.equal(t, t0)


def test_flush_does_not_change_outputs_or_window_positions():
    """Flushing before verify is invisible to the outputs (1e-12: float64, only the fold order differs) and
    the window lands at the same ring indices ((start + count + t) % L == (start' + t) % L), so a fused
    kernel can decide the flush and write the window without waiting for the cursor."""
    gen = torch.Generator().manual_seed(9)
    H, P, N, G, L, T = 4, 8, 8, 2, 12, 4
    prm = make_params(H, gen)
    dt_bias, A, D = (t.to(F64) for t in (prm.dt_bias, prm.A, prm.D))
    state = torch.randn(1, H, P, N, generator=gen, dtype=F64)
    xc, Bc, dtc = torch.randn(1, H, L, P, dtype=F64), torch.randn(1, G, L, N, dtype=F64), torch.rand(1, H, L, dtype=F64) * 0.05
    cursor = torch.tensor([[9, 6]], dtype=torch.int32)  # 6 + 8 > 12: flush due; the window still fits (6 + 4 <= 12)
    sbi = torch.tensor([0], dtype=torch.int32)
    x, B, C, dt, z = _window(1, T, H, P, N, G, gen, has_z=True)
    a = [t.clone() for t in (state, xc, Bc, dtc, cursor)]
    y_no_flush = sr.verify(*a, x, B, C, dt, dt_bias, A, D, z, sbi)
    b = [t.clone() for t in (state, xc, Bc, dtc, cursor)]
    assert sr.maybe_flush(*b, A, T, sbi) == [0] and b[4].tolist() == [[3, 0]]
    y_flush = sr.verify(*b, x, B, C, dt, dt_bias, A, D, z, sbi)
    assert _rel(y_flush, y_no_flush) < 1e-12
    for i in (1, 2, 3):
        assert torch.equal(a[i], b[i])


def test_verify_writes_only_the_window():
    """verify: the T window ring entries change, nothing else (checkpoint, other entries, cursor), exactly."""
    gen = torch.Generator().manual_seed(8)
    H, P, N, G, L, T = 4, 8, 8, 2, 12, 4
    prm = make_params(H, gen)
    dt_bias, A, D = (t.to(F64) for t in (prm.dt_bias, prm.A, prm.D))
    state = torch.randn(2, H, P, N, generator=gen, dtype=F64)
    xc, Bc, dtc = torch.randn(2, H, L, P, dtype=F64), torch.randn(2, G, L, N, dtype=F64), torch.rand(2, H, L, dtype=F64)
    cursor = torch.tensor([[10, 3], [0, 0]], dtype=torch.int32)  # window at ring 1, 2, 3, 4
    before = [t.clone() for t in (state, xc, Bc, dtc, cursor)]
    sbi = torch.tensor([0], dtype=torch.int32)
    x, B, C, dt, _ = _window(1, T, H, P, N, G, gen)
    sr.verify(state, xc, Bc, dtc, cursor, x, B, C, dt, dt_bias, A, D, None, sbi)
    win = [1, 2, 3, 4]
    keep = [i for i in range(L) if i not in win]
    assert torch.equal(state, before[0]) and torch.equal(cursor, before[4])
    for now, then, ax in ((xc, before[1], 2), (Bc, before[2], 2), (dtc, before[3], 2)):
        assert torch.equal(now[1], then[1])
        assert torch.equal(now[0].index_select(ax - 1, torch.tensor(keep)), then[0].index_select(ax - 1, torch.tensor(keep)))
    assert torch.equal(xc[0][:, win], x[0].transpose(0, 1)) and torch.equal(Bc[0][:, win], B[0].transpose(0, 1))
    assert torch.equal(dtc[0][:, win], ref.process_dt(dt, dt_bias)[0].transpose(0, 1))


def test_low_precision_caches_track_float64_oracle():
    """fp32 checkpoint, bf16 x/B rings, fp32 dt ring (the kernels' dtypes), bf16 inputs: the spec runs in
    float64 on the stored values, so against a float64 oracle fed the same bf16 inputs the only
    differences are the fp32 roundings of dt (rel 6e-8) and of the checkpoint at a flush (rel 6e-8),
    amplified by at most a few tens of steps: 1e-5 is far above that and far below any real bug (~1e-2)."""
    gen = torch.Generator().manual_seed(12)
    H, P, N, G, L, T = 4, 16, 16, 2, 8, 2
    prm = make_params(H, gen)
    state = torch.randn(1, H, P, N, generator=gen).float()
    S_conv = state.double()
    xc, Bc = torch.zeros(1, H, L, P, dtype=torch.bfloat16), torch.zeros(1, G, L, N, dtype=torch.bfloat16)
    dtc = torch.zeros(1, H, L, dtype=torch.float32)
    cursor = torch.zeros(1, 2, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    one = torch.tensor([0], dtype=torch.int32)
    for _ in range(20):
        x, B, C, dt = (t.to(torch.bfloat16) for t in _window(1, T, H, P, N, G, gen)[:4])
        n = int(torch.randint(1, T + 1, (1,), generator=gen))
        y = sr.spec_step(state, xc, Bc, dtc, cursor, x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
        S_try = S_conv.clone()
        for t in range(T):
            y_or = ref.conventional_step(S_try, x[:, t].double(), B[:, t].double(), C[:, t].double(), dt[:, t].double(),
                                         prm.dt_bias.double(), prm.A.double(), prm.D.double(), None, one)
            assert _rel(y[:, t], y_or) < 1e-5
            if t + 1 == n:
                S_conv = S_try.clone()
        cursors.commit(cursor, torch.tensor([n]), T, L, sbi)
        assert _rel(sr.committed_state(state, xc, Bc, dtc, cursor, prm.A, 0), S_conv[0]) < 1e-5


def test_padding_rows_and_unused_slots_untouched():
    gen = torch.Generator().manual_seed(3)
    H, P, N, G, L, T = 4, 8, 8, 2, 8, 4
    prm = make_params(H, gen)
    dt_bias, A, D = (t.to(F64) for t in (prm.dt_bias, prm.A, prm.D))
    state = torch.randn(4, H, P, N, generator=gen, dtype=F64)
    xc, Bc, dtc = torch.randn(4, H, L, P, dtype=F64), torch.randn(4, G, L, N, dtype=F64), torch.rand(4, H, L, dtype=F64)
    cursor = torch.tensor([[1, 4], [3, 2], [7, 1], [0, 0]], dtype=torch.int32)
    before = [t.clone() for t in (state, xc, Bc, dtc, cursor)]
    sbi = torch.tensor([-1, 2, -1], dtype=torch.int32)
    x, B, C, dt, _ = _window(3, T, H, P, N, G, gen)
    y = sr.spec_step(state, xc, Bc, dtc, cursor, x, B, C, dt, dt_bias, A, D, None, sbi)
    cursors.commit(cursor, torch.tensor([T, 2, T], dtype=torch.int32), T, L, sbi)
    assert torch.isnan(y[0]).all() and torch.isnan(y[2]).all() and not torch.isnan(y[1]).any()
    for now, then in zip((state, xc, Bc, dtc, cursor), before):
        for s in (0, 1, 3):
            assert torch.equal(now[s], then[s])
    # slot 2: count 1 + 8 > 8 -> flushed (start 7 + 1 = 0), window at ring 0..3, 2 accepted
    assert cursor[2].tolist() == [0, 2]
    assert torch.equal(xc[2][:, :T], x[1].transpose(0, 1))


def test_teeth_corrupted_committed_entry_is_detected():
    """Corrupt one committed ring entry: verify outputs and the committed state stop matching.
    Corrupting a rejected (uncommitted) ring entry changes nothing: garbage outside count is never read."""
    gen = torch.Generator().manual_seed(5)
    H, P, N, G, L, T = 2, 8, 8, 1, 16, 4
    prm = make_params(H, gen)
    dt_bias, A, D = (t.to(F64) for t in (prm.dt_bias, prm.A, prm.D))
    state = torch.randn(1, H, P, N, generator=gen, dtype=F64)
    xc, Bc, dtc = torch.zeros(1, H, L, P, dtype=F64), torch.zeros(1, G, L, N, dtype=F64), torch.zeros(1, H, L, dtype=F64)
    cursor = torch.tensor([[13, 0]], dtype=torch.int32)  # the committed range wraps the ring
    sbi = torch.tensor([0], dtype=torch.int32)
    x, B, C, dt, _ = _window(1, T, H, P, N, G, gen)
    sr.spec_step(state, xc, Bc, dtc, cursor, x, B, C, dt, dt_bias, A, D, None, sbi)
    cursors.commit(cursor, torch.tensor([2]), T, L, sbi)  # committed at ring 13, 14; rejected at 15, 0
    x2, B2, C2, dt2, _ = _window(1, T, H, P, N, G, gen)
    caches = [t.clone() for t in (state, xc, Bc, dtc, cursor)]
    y_good = sr.spec_step(*[t.clone() for t in caches], x2, B2, C2, dt2, dt_bias, A, D, None, sbi)
    S_good = sr.committed_state(*caches, A, 0)
    bad = [t.clone() for t in caches]
    bad[2][0, 0, 14, 3] += 0.5  # committed B entry
    assert _rel(sr.committed_state(*bad, A, 0), S_good) > 1e-6
    assert _rel(sr.spec_step(*bad, x2, B2, C2, dt2, dt_bias, A, D, None, sbi), y_good) > 1e-6
    junk = [t.clone() for t in caches]
    junk[1][0, :, 15] = 1e6  # rejected x entry, about to be overwritten by the next window
    assert torch.equal(sr.spec_step(*junk, x2, B2, C2, dt2, dt_bias, A, D, None, sbi), y_good)


@pytest.mark.parametrize("T,K", [(2, 4), (4, 4), (8, 4), (4, 2)])
def test_conv_window_random_rollback(T, K):
    """Conv outputs equal conv1d over the committed history; after rollback the window holds it."""
    gen = torch.Generator().manual_seed(11 * T + K)
    Dc, slots, W = 6, 3, K - 1 + T - 1
    weight = torch.randn(Dc, K, generator=gen, dtype=F64)
    bias = torch.randn(Dc, generator=gen, dtype=F64)
    win = torch.zeros(slots, Dc, W, dtype=F64)
    sbi = torch.tensor([2, -1, 0], dtype=torch.int32)
    hist = {0: torch.zeros(Dc, K - 1, dtype=F64), 2: torch.zeros(Dc, K - 1, dtype=F64)}  # zero initial conv state
    untouched = win[1].clone()
    for _ in range(25):
        u = torch.randn(3, T, Dc, generator=gen, dtype=F64)
        nacc = torch.randint(1, T + 1, (3,), generator=gen, dtype=torch.int32)
        out = convw.conv_window_update(win, u, weight, bias, sbi)
        convw.conv_window_rollback(win, nacc, T, K, sbi)
        assert torch.isnan(out[1]).all()
        for b, s in ((0, 2), (2, 0)):
            seq = torch.cat([hist[s][:, -(K - 1):] if K > 1 else hist[s][:, :0], u[b].T], dim=1)
            o = F.silu(F.conv1d(seq[None], weight[:, None], bias, groups=Dc))[0].T  # (T, Dc)
            assert torch.allclose(out[b], o, rtol=1e-12, atol=1e-12)  # K-term sums, different order
            hist[s] = torch.cat([hist[s], u[b, :int(nacc[b])].T], dim=1)
            assert torch.equal(win[s][:, W - (K - 1):], hist[s][:, -(K - 1):])  # exact bookkeeping
    assert torch.equal(win[1], untouched)


def test_conv_window_too_narrow_raises():
    win = torch.zeros(1, 2, 3, dtype=F64)  # K = 4, num_draft = 0
    sbi = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="u: expected at most"):
        convw.conv_window_update(win, torch.zeros(1, 2, 2, dtype=F64), torch.zeros(2, 4, dtype=F64), None, sbi)
    win = torch.zeros(1, 2, 5, dtype=F64)  # K = 4, num_draft = 2, T = 3
    with pytest.raises(ValueError, match="n_accepted"):
        convw.conv_window_rollback(win, torch.tensor([0]), 3, 4, sbi)


def test_errors_name_the_argument():
    H, P, N, G, L, T = 2, 8, 8, 1, 8, 4
    z = torch.zeros
    state, xc, Bc, dtc = z(1, H, P, N, dtype=F64), z(1, H, L, P, dtype=F64), z(1, G, L, N, dtype=F64), z(1, H, L, dtype=F64)
    sbi = torch.tensor([0], dtype=torch.int32)
    x, B, C, dt = z(1, T, H, P, dtype=F64), z(1, T, G, N, dtype=F64), z(1, T, G, N, dtype=F64), z(1, T, H, dtype=F64)
    p = z(H, dtype=F64)
    with pytest.raises(ValueError, match=r"cursor\[0\].*count \+ T"):
        sr.verify(state, xc, Bc, dtc, torch.tensor([[0, 5]], dtype=torch.int32), x, B, C, dt, p, p, p, None, sbi)
    xc2, cur2 = torch.zeros(2, H, L, P, dtype=F64), torch.tensor([[0, 0], [0, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cursor\[1\]"):  # row 0 is fine, row 1 is not: nothing written
        sr.verify(state.expand(2, -1, -1, -1).clone(), xc2, Bc.expand(2, -1, -1, -1).clone(), dtc.expand(2, -1, -1).clone(),
                  cur2, x.expand(2, -1, -1, -1) + 1, B.expand(2, -1, -1, -1), C.expand(2, -1, -1, -1),
                  dt.expand(2, -1, -1), p, p, p, None, torch.tensor([0, 1], dtype=torch.int32))
    assert not xc2.any()
    with pytest.raises(ValueError, match=r"C: expected shape \(1, 4, 1, 8\), got \(1, 4, 1, 7\)"):
        sr.verify(state, xc, Bc, dtc, torch.zeros(1, 2, dtype=torch.int32), x, B, C[..., :7], dt, p, p, p, None, sbi)
    with pytest.raises(TypeError, match="cursor: expected dtype int32"):
        sr.verify(state, xc, Bc, dtc, torch.zeros(1, 2, dtype=torch.int64), x, B, C, dt, p, p, p, None, sbi)
    with pytest.raises(ValueError, match="buffer_len: expected >= 2"):
        sr.maybe_flush(state, xc[:, :, :6], Bc[:, :, :6], dtc[:, :, :6], torch.zeros(1, 2, dtype=torch.int32), p, T, sbi)
    with pytest.raises(ValueError, match=r"n_accepted\[0\]"):
        cursors.commit(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([T + 1]), T, L, sbi)
    cur = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"n_accepted\[1\]: expected 0 <= n <= T=4, got 9"):
        cursors.commit(cur, torch.tensor([1, 9]), T, L, torch.tensor([0, 1], dtype=torch.int32))
    assert cur.tolist() == [[0, 1], [3, 2]]  # validated before any cursor moved
    with pytest.raises(ValueError, match="more than one row"):
        cursors.commit(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([1, 1]), T, L, torch.tensor([0, 0], dtype=torch.int32))


def test_native_snapshots_beyond_T_and_zero_accept_untouched():
    """native_spec_verify writes snapshots 0..T-1 only; native_spec_commit with n = 0 keeps the state (exact)."""
    gen = torch.Generator().manual_seed(13)
    H, P, N, G, T = 2, 8, 8, 1, 2
    prm = make_params(H, gen)
    dt_bias, A, D = (t.to(F64) for t in (prm.dt_bias, prm.A, prm.D))
    state = torch.randn(2, H, P, N, generator=gen, dtype=F64)
    snaps = torch.randn(2, 4, H, P, N, generator=gen, dtype=F64)
    s0, st0 = snaps.clone(), state.clone()
    sbi = torch.tensor([1], dtype=torch.int32)
    x, B, C, dt, _ = _window(1, T, H, P, N, G, gen)
    sr.native_spec_verify(state, snaps, x, B, C, dt, dt_bias, A, D, None, sbi)
    assert torch.equal(state, st0) and torch.equal(snaps[0], s0[0]) and torch.equal(snaps[1, T:], s0[1, T:])
    assert not torch.equal(snaps[1, :T], s0[1, :T])
    cursors.native_spec_commit(state, snaps, torch.tensor([0]), sbi)
    assert torch.equal(state, st0)
    cursors.native_spec_commit(state, snaps, torch.tensor([T]), sbi)
    assert torch.equal(state[1], snaps[1, T - 1]) and torch.equal(state[0], st0[0])


# ---- low-precision shadow (spec of the verify kernel with RSSM_SHADOW) -------------------------------
def _shadow_setup(kind, seed, slots=3, H=4, P=8, N=16, G=2, L=8):
    gen = torch.Generator().manual_seed(seed)
    prm = make_params(H, gen)
    state = torch.randn(slots, H, P, N, generator=gen).float()  # an f32 checkpoint, as the kernels require
    xc, Bc = torch.zeros(slots, H, L, P, dtype=torch.bfloat16), torch.zeros(slots, G, L, N, dtype=torch.bfloat16)
    dtc = torch.zeros(slots, H, L)
    cursor = torch.zeros(slots, 2, dtype=torch.int32)
    return gen, prm, [state, xc, Bc, dtc, cursor], shadowq.Shadow.of(state, kind)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_shadow_verify_reads_the_shadow_and_flush_rewrites_it(kind):
    """Exact statements (float64 on identical values, torch.equal): a non-flushed slot's outputs are those
    of a checkpoint equal to Shadow.read; a flushed slot's are those without a shadow; maybe_flush rewrites
    the shadow of exactly the flushed slots with Shadow.write of the checkpoint it stored; the shadow
    never reaches the checkpoint (twin caches without a shadow keep bit-identical checkpoints)."""
    gen, prm, caches, sh = _shadow_setup(kind, seed=21)
    twin = [t.clone() for t in caches]
    state, cursor = caches[0], caches[4]
    H, P, N, G, L, T = 4, 8, 16, 2, 8, 2
    sbi = torch.tensor([2, -1, 0], dtype=torch.int32)
    flushes = 0
    for _ in range(12):
        x, B, C, dt = (t.to(torch.bfloat16) for t in _window(3, T, H, P, N, G, gen)[:4])
        q_before = sh.q.clone()
        flushed = sr.maybe_flush(*caches[:5], prm.A, T, sbi, shadow=sh)
        sr.maybe_flush(*twin[:5], prm.A, T, sbi)
        assert torch.equal(state, twin[0]) and torch.equal(cursor, twin[4])
        for s in range(3):
            if s in flushed:
                want = shadowq.Shadow(1, H, P, N, kind)
                want.write(0, state[s])
                assert torch.equal(sh.q[s].view(torch.uint8), want.q[0].view(torch.uint8))
            else:
                assert torch.equal(sh.q[s].view(torch.uint8), q_before[s].view(torch.uint8))
        flushes += len(flushed)
        # the same window on three copies: with the shadow, without it, and with S0 := Shadow.read
        as_read = [t.clone() for t in caches]
        as_read[0] = torch.stack([sh.read(s, F64) if s not in flushed else state[s].double() for s in range(3)])
        plain = [t.clone() for t in caches]
        y = sr.verify(*caches[:5], x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi, shadow=sh, flushed=flushed)
        y_read = sr.verify(*as_read[:5], x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
        y_plain = sr.verify(*plain[:5], x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
        sr.verify(*twin[:5], x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
        assert torch.equal(y[[0, 2]], y_read[[0, 2]])
        for b, s in ((0, 2), (2, 0)):
            if s in flushed:
                assert torch.equal(y[b], y_plain[b])
            else:  # a shadow that is read changes y (bf16: ~1e-3, fp8: ~1e-2 relative)
                assert 0 < _rel(y[b], y_plain[b]) < (4e-3 if kind == "bf16" else 6e-2)
        n = torch.randint(1, T + 1, (3,), generator=gen, dtype=torch.int32)
        cursors.commit(cursor, n, T, L, sbi)
        cursors.commit(twin[4], n, T, L, sbi)
    assert flushes >= 4


def test_spec_step_with_shadow_and_teeth():
    """spec_step = maybe_flush(shadow) + verify(shadow, flushed); perturbing a non-flushed slot's shadow moves
    its outputs, perturbing a flushed slot's shadow does not (that step reads the checkpoint)."""
    gen, prm, caches, sh = _shadow_setup("bf16", seed=22, slots=2)
    H, P, N, G, T = 4, 8, 16, 2, 2
    sbi = torch.tensor([0, 1], dtype=torch.int32)
    caches[4][1] = torch.tensor([3, 5], dtype=torch.int32)  # slot 1 flushes at the next step (5 + 4 > 8), slot 0 does not
    x, B, C, dt = (t.to(torch.bfloat16) for t in _window(2, T, H, P, N, G, gen)[:4])
    a = [t.clone() for t in caches]
    sh_a = shadowq.Shadow.wrap(sh.q.clone())
    y = sr.spec_step(*a, x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi, shadow=sh_a)
    b = [t.clone() for t in caches]
    sh_b = shadowq.Shadow.wrap(sh.q.clone())
    sh_b.q[0] *= 2
    sh_b.q[1] *= 2
    y_b = sr.spec_step(*b, x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi, shadow=sh_b)
    assert _rel(y_b[0], y[0]) > 1e-3
    assert torch.equal(y_b[1], y[1])
    assert torch.equal(sh_b.q[1], sh_a.q[1])  # the flush rewrote slot 1's shadow from the checkpoint
    with pytest.raises(ValueError, match="scale: an fp8 shadow needs row scales"):
        shadowq.Shadow.wrap(sh.q.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("what", ["x", "B", "dt_nan", "dt_inf"])
def test_verify_is_causal_for_non_finite_later_tokens(what):
    """Position t sees window tokens t' <= t only: a NaN / inf in window token 2 (x, B or dt) must not reach
    y_0 or y_1 (as in the conventional baseline and the kernel, which sums e <= m + t only). The masked
    T x (m+T) product multiplied the NaN by a zero weight and spread it to earlier positions."""
    gen = torch.Generator().manual_seed(31)
    H, P, N, G, L, T = 2, 3, 4, 1, 8, 3
    prm = make_params(H, gen)
    S0 = torch.randn(1, H, P, N, generator=gen, dtype=F64)
    x, B, C, dt = _window(1, T, H, P, N, G, gen)[:4]
    bad = {"x": x, "B": B, "dt_nan": dt, "dt_inf": dt}[what]
    bad[0, 2] = float("inf") if what in ("B", "dt_inf") else float("nan")
    caches = (S0.clone(), torch.zeros(1, H, L, P, dtype=F64), torch.zeros(1, G, L, N, dtype=F64),
              torch.zeros(1, H, L, dtype=F64), torch.tensor([[5, 2]], dtype=torch.int32))
    y = sr.verify(*caches, x, B, C, dt, prm.dt_bias, prm.A, prm.D)
    S = sr.committed_state(*caches[:5], prm.A, 0)[None].clone()
    for t in range(2):
        y_c = ref.conventional_step(S, x[:, t], B[:, t], C[:, t], dt[:, t], prm.dt_bias, prm.A, prm.D)
        assert torch.isfinite(y[0, t]).all(), f"y_{t} took the non-finite {what} of token 2"
        assert _rel(y[0, t], y_c[0]) < RTOL
