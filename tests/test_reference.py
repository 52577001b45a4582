# SPDX-License-Identifier: Apache-2.0
"""The float64 reference: ReplaySSM is the conventional recurrence, reorganised.

Oracle: :func:`reference.conventional_step` in float64. Both sides run in float64 on the same
inputs, so agreement is to ~1e-12 relative; the tolerance 1e-10 leaves room for the different
summation order (exp(c_k - c_j) products vs repeated multiplication) over 3L+ steps.
"""

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.mamba2 import reference as ref

from .problems import make_inputs, make_params

F64 = torch.float64


def _run(H, P, N, G, L, batch, slots, steps, has_z, pad_rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prm = make_params(H, gen)
    S_conv = torch.randn(slots, H, P, N, generator=gen, dtype=F64)
    S_rep = S_conv.clone()
    xc = torch.zeros(slots, H, L, P, dtype=F64)
    Bc = torch.zeros(slots, G, L, N, dtype=F64)
    dtc = torch.zeros(slots, H, L, dtype=F64)
    cursor = torch.zeros(slots, dtype=torch.int32)
    sbi = torch.randperm(slots, generator=gen)[:batch].to(torch.int32)
    sbi[list(pad_rows)] = -1
    worst = 0.0
    for _ in range(steps):
        x, B, C, dt, z = (None if t is None else t.to(F64) for t in make_inputs(batch, H, P, N, G, F64, gen, has_z=has_z))
        y_conv = ref.conventional_step(S_conv, x, B, C, dt, prm.dt_bias, prm.A, prm.D, z, sbi)
        y_rep = ref.replay_decode(S_rep, xc, Bc, dtc, cursor, x, B, C, dt, prm.dt_bias, prm.A, prm.D, z, sbi)
        cursors.advance_cursor(cursor, sbi, L)
        valid = sbi >= 0
        assert torch.isnan(y_rep[~valid]).all() and torch.isnan(y_conv[~valid]).all()
        err = (y_rep[valid] - y_conv[valid]).norm() / y_conv[valid].norm()
        worst = max(worst, float(err))
        for s in sbi[valid].tolist():  # the state the buffer stands for is the conventional state
            S_now = ref.replay_state(S_rep, xc, Bc, dtc, cursor, prm.A, s)
            assert torch.allclose(S_now, S_conv[s], rtol=1e-10, atol=1e-10)
    return worst, cursor, sbi


BASE = dict(H=4, P=64, N=64, G=2, L=4, batch=3, slots=5, steps=13, has_z=False, pad_rows=())
CASES = [
    BASE,
    {**BASE, "has_z": True},
    {**BASE, "pad_rows": (1,)},
    {**BASE, "L": 1},
    {**BASE, "L": 8, "steps": 25},
    {**BASE, "G": 1},
    {**BASE, "G": 4},
    {**BASE, "P": 80, "N": 128},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v) or "base")
def test_replay_equals_conventional(case):
    worst, cursor, sbi = _run(**case)
    assert worst < 1e-10, worst
    steps, L = case["steps"], case["L"]
    for s in sbi.tolist():
        if s >= 0:
            assert int(cursor[s]) == steps % L


def test_untouched_slots_and_padding_rows():
    gen = torch.Generator().manual_seed(1)
    H, P, N, G, L = 4, 64, 64, 2, 4
    prm = make_params(H, gen)
    S = torch.randn(4, H, P, N, dtype=F64, generator=gen)
    xc, Bc, dtc = torch.randn(4, H, L, P, dtype=F64), torch.randn(4, G, L, N, dtype=F64), torch.rand(4, H, L, dtype=F64)
    cursor = torch.tensor([3, 1, 2, 0], dtype=torch.int32)
    before = [t.clone() for t in (S, xc, Bc, dtc, cursor)]
    sbi = torch.tensor([-1, 2], dtype=torch.int32)
    x, B, C, dt, _ = (t if t is None else t.to(F64) for t in make_inputs(2, H, P, N, G, F64, gen))
    ref.replay_decode(S, xc, Bc, dtc, cursor, x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
    for now, then in zip((S, xc, Bc, dtc, cursor), before):
        for s in (0, 1, 3):
            assert torch.equal(now[s], then[s])
    assert torch.equal(xc[2, :, 2], x[1]) and torch.equal(Bc[2, :, 2], B[1])  # appended at cursor
    assert torch.equal(S[2], before[0][2])  # no flush: the checkpoint is not written


def test_flush_writes_checkpoint_and_only_it():
    gen = torch.Generator().manual_seed(2)
    H, P, N, G, L = 2, 64, 64, 1, 4
    prm = make_params(H, gen)
    S = torch.randn(1, H, P, N, dtype=F64, generator=gen)
    xc, Bc, dtc = torch.randn(1, H, L, P, dtype=F64), torch.randn(1, G, L, N, dtype=F64), torch.rand(1, H, L, dtype=F64)
    cursor = torch.tensor([L - 1], dtype=torch.int32)
    xc0, Bc0 = xc.clone(), Bc.clone()
    sbi = torch.tensor([0], dtype=torch.int32)
    x, B, C, dt, _ = (t if t is None else t.to(F64) for t in make_inputs(1, H, P, N, G, F64, gen))
    S_expected = S.clone()
    ref.conventional_step(S_expected, x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
    ref.replay_decode(S, xc, Bc, dtc, cursor, x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
    assert not torch.allclose(S, S_expected)  # the checkpoint was behind by L-1 entries before
    assert torch.equal(xc, xc0) and torch.equal(Bc, Bc0)


def test_teeth_corrupted_buffer_is_detected():
    """Corrupt one cached B entry: the state the buffer stands for must stop matching."""
    gen = torch.Generator().manual_seed(3)
    H, P, N, G, L = 2, 64, 64, 1, 8
    prm = make_params(H, gen)
    S_conv = torch.randn(1, H, P, N, dtype=F64, generator=gen)
    S_rep = S_conv.clone()
    xc, Bc, dtc = torch.zeros(1, H, L, P, dtype=F64), torch.zeros(1, G, L, N, dtype=F64), torch.zeros(1, H, L, dtype=F64)
    cursor = torch.zeros(1, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    for step in range(3):
        x, B, C, dt, _ = (t if t is None else t.to(F64) for t in make_inputs(1, H, P, N, G, F64, gen))
        y_conv = ref.conventional_step(S_conv, x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
        if step == 2:
            Bc[0, 0, 0, 5] += 0.5
        y_rep = ref.replay_decode(S_rep, xc, Bc, dtc, cursor, x, B, C, dt, prm.dt_bias, prm.A, prm.D, None, sbi)
        cursors.advance_cursor(cursor, sbi, L)
    assert (y_rep - y_conv).norm() / y_conv.norm() > 1e-6


def test_bad_cursor_raises():
    H, P, N, G, L = 2, 64, 64, 1, 4
    gen = torch.Generator().manual_seed(4)
    prm = make_params(H, gen)
    x, B, C, dt, _ = (t if t is None else t.to(F64) for t in make_inputs(1, H, P, N, G, F64, gen))
    with pytest.raises(ValueError, match="cursor"):
        ref.replay_decode(torch.zeros(1, H, P, N, dtype=F64), torch.zeros(1, H, L, P, dtype=F64),
                          torch.zeros(1, G, L, N, dtype=F64), torch.zeros(1, H, L, dtype=F64),
                          torch.tensor([L], dtype=torch.int32), x, B, C, dt, prm.dt_bias, prm.A, prm.D)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_shadow_quantizer_contract(kind):
    """shadow.quantize_shadow, the one quantizer every path (kernels' flush, cache hand-off) matches bit for bit:
    bf16 = round to nearest; fp8 = e4m3 of S * (1 / scale) with scale = max |S[row]| / 448 exactly (1 for an
    all-zero row), so every row's largest value lands on +-448 (nothing saturates beyond) and the read-back
    error is an e4m3 rounding: relative <= 2^-4 of the value, or the subnormal step of the row."""
    gen = torch.Generator().manual_seed(3)
    mag = torch.logspace(-6, 6, 24, dtype=torch.float64)  # rows of every magnitude
    S = (torch.randn(2, 3, 24, 40, generator=gen, dtype=torch.float64) * mag[None, None, :, None]).float()
    S[1, 2, 5] = 0.0  # an all-zero row
    sh = shadowq.Shadow.of(S, kind)
    back = torch.stack([sh.read(s) for s in range(2)])
    if kind == "bf16":
        assert torch.equal(sh.q, S.to(torch.bfloat16))
        assert ((back - S).abs() <= S.abs() * 2.0**-8).all()
        return
    amax = S.abs().amax(-1)
    want = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    assert torch.equal(sh.scale, want) and sh.scale[1, 2, 5] == 1.0
    assert torch.equal(sh.q.float().abs().amax(-1)[amax > 0], torch.full_like(amax[amax > 0], 448.0))
    assert (sh.q[1, 2, 5].float() == 0).all() and not torch.isnan(sh.q.float()).any()
    step = sh.scale[..., None] * 2.0**-9  # the e4m3 subnormal step, scaled
    assert ((back - S).abs() <= torch.maximum(S.abs() * 2.0**-4, step)).all()
    # the kernels' order of operations: one reciprocal per row, then the product
    q32 = (S * torch.reciprocal(want)[..., None]).to(torch.float8_e4m3fn)
    assert torch.equal(sh.q.view(torch.uint8), q32.view(torch.uint8))
