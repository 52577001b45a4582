# SPDX-License-Identifier: Apache-2.0
"""The float64 spec of the 8-bit checkpoint (reference.Checkpoint8, issue 38), on the CPU.

Oracles:
- Stochastic rounding to e4m3 (reference.stochastic_round_e4m3) against a value-level definition built from
  torch's own e4m3 conversion: the result is always one of the two e4m3 neighbours of |v| (exactly v when v is
  representable), and over words r = 0 .. 2^32 - 1 it rounds up exactly (|v| - lo) / (hi - lo) of the time
  (checked by counting the threshold, which is exact for |v| >= 2^-18).
- Unbiasedness in expectation: the mean of many independently seeded quantisations of one state converges to
  the state at the rate of a mean of independent draws (bound: 5 standard errors of the quantisation noise).
- Determinism: the same (seed, flush, slot) gives the same bytes in any order; any coordinate changes them.
- The decode spec: with rounding "rne" and a fresh quantisation, replay_decode's flush equals the fp8 shadow
  quantizer of the folded float64 state (one home for the RNE quantizer).
"""

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.mamba2 import reference as ref

F64 = torch.float64


def e4m3_neighbours(v: torch.Tensor):
    """(lo, hi): the e4m3 values bracketing |v| (float64), from torch's conversion (round to nearest) and the
    e4m3 grid spacing 2^max(floor(log2 |v|) - 3, -9)."""
    a = v.abs().double().clamp(max=448.0)
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** -60)))
    quantum = torch.exp2(torch.clamp(e - 3, min=-9))
    lo = torch.floor(a / quantum) * quantum
    hi = torch.where(lo == a, lo, lo + quantum)
    assert torch.equal(lo.float().to(torch.float8_e4m3fn).double(), lo)  # on the grid
    return lo, hi


def test_sr_picks_a_neighbour_and_exact_values_stay():
    gen = torch.Generator().manual_seed(0)
    v = (torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-14, 9, (20000,), generator=gen).float()))
    v = v.clamp(-448, 448)
    v[:5] = torch.tensor([0.0, 448.0, -448.0, 2.0 ** -9, 3 * 2.0 ** -10])
    r = torch.randint(0, 2 ** 32, v.shape, generator=gen, dtype=torch.int64)
    out = shadowq.stochastic_round_e4m3(v, r).double()
    lo, hi = e4m3_neighbours(v)
    mag = out.abs()
    assert bool(((mag == lo) | (mag == hi)).all())
    assert bool((torch.sign(out) * torch.sign(v.double()) >= 0).all())
    exact = v.to(torch.float8_e4m3fn).float() == v
    assert torch.equal(out[exact], v.double()[exact])
    assert torch.equal(out.float().to(torch.float8_e4m3fn).float().double(), out)  # representable


def test_sr_probability_is_exact():
    """Round-up probability = the share of uint32 words below the threshold: count it directly from the
    thresholds the rounding uses, for words r = t - 1 and r = t (the boundary) of every value."""
    gen = torch.Generator().manual_seed(1)
    v = torch.rand(4000, generator=gen) * torch.exp2(torch.randint(-17, 9, (4000,), generator=gen).float())
    v = v.clamp(max=448)
    lo, hi = e4m3_neighbours(v)
    frac = torch.where(hi > lo, (v.double() - lo) / (hi - lo), torch.zeros_like(lo))
    t = torch.round(frac * 2.0 ** 32).to(torch.int64)  # exact: |v| >= 2^-18 keeps frac * 2^32 an integer
    assert torch.equal(frac * 2.0 ** 32, t.double())
    below = shadowq.stochastic_round_e4m3(v, (t - 1).clamp_min(0)).double()
    at = shadowq.stochastic_round_e4m3(v, t.clamp(max=2 ** 32 - 1)).double()
    has = t > 0
    assert torch.equal(below[has], hi[has])  # r < t rounds up ...
    full = t < 2 ** 32
    assert torch.equal(at[full], lo[full])  # ... r >= t rounds down: P(up) = t / 2^32 = frac exactly


def test_sr_nan_and_saturation():
    v = torch.tensor([float("nan"), float("inf"), -1000.0, 449.0])
    out = shadowq.stochastic_round_e4m3(v, torch.zeros(4, dtype=torch.int64))
    assert torch.isnan(out[0]) and out[1:].tolist() == [448.0, -448.0, 448.0]


def test_random_bits_deterministic_and_keyed():
    a = shadowq.ckpt8_random_bits(7, 3, 5, 4, 16, 64)
    assert torch.equal(a, shadowq.ckpt8_random_bits(7, 3, 5, 4, 16, 64))
    assert bool((a >= 0).all()) and bool((a < 2 ** 32).all())
    for other in ((8, 3, 5), (7, 4, 5), (7, 3, 6)):
        assert float((shadowq.ckpt8_random_bits(*other, 4, 16, 64) == a).double().mean()) < 0.01
    assert len(set(a.flatten().tolist())) == a.numel()  # heads, rows and n all enter the key
    # The scalar hash the kernel computes per element, for one coordinate (head 1, row 2, n 9).
    k = shadowq.mix32(shadowq.mix32(shadowq.mix32(shadowq.mix32(shadowq.mix32(7) + 3) + 5) + 1) + 2)
    assert int(a[1, 2, 9]) == shadowq.mix32(k + ((9 * 0x9E3779B9) & 0xFFFFFFFF))
    # Uniform enough: each of the 32 bits is set about half the time (4096 words: sigma 0.008).
    bits = torch.stack([(a >> b) & 1 for b in range(32)]).double().mean(dim=(1, 2, 3))
    assert float((bits - 0.5).abs().max()) < 0.04


def test_mix32_known_values():
    # lowbias32 is a bijection with mix32(0) = 0; fixed values guard the kernel mirror against edits.
    assert shadowq.mix32(0) == 0
    assert shadowq.mix32(1) == int(shadowq.mix32(torch.tensor([1]))[0])
    xs = torch.arange(1 << 12, dtype=torch.int64) * 977
    assert len(set(shadowq.mix32(xs).tolist())) == xs.numel()


def test_stochastic_quantisation_is_unbiased():
    gen = torch.Generator().manual_seed(2)
    H, P, N = 2, 8, 32
    S = torch.randn(H, P, N, generator=gen, dtype=F64) * torch.logspace(-2, 1, P, dtype=F64)[:, None]
    q = torch.empty(H, P, N, dtype=torch.float8_e4m3fn)
    sc = torch.empty(H, P)
    n = 2000
    acc = torch.zeros(H, P, N, dtype=F64)
    for seed in range(n):
        shadowq.quantize_ckpt8(S, q, sc, "sr", seed=seed, slot=0, flush=0)
        acc += q.double() * sc.double()[..., None] - S
    mean = acc / n
    # The standard error of the mean of n independent roundings: sqrt(p (1 - p) / n) quanta, p the round-up
    # probability of v = S / scale (the scale is the same for every seed). Where p is tiny and no draw
    # rounded up, |mean| = p quanta <= 5 sqrt(p / n) quanta for p <= 25 / n: the bound still holds.
    scale = sc.double()[..., None]
    v = S.float() * torch.reciprocal(sc)[..., None]
    lo, hi = e4m3_neighbours(v)
    p = torch.where(hi > lo, (v.double().abs() - lo) / (hi - lo), torch.zeros_like(lo))
    sem = (p * (1 - p) / n).sqrt() * (hi - lo) * scale
    # v itself is S rounded to fp32 through a rounded reciprocal: a bias of a few 2^-24 of |S|.
    assert float((mean.abs() - 5 * sem - 2e-7 * S.abs()).max()) <= 0
    # Round to nearest is biased where the fraction is not 1/2 (teeth: the same test fails for it).
    shadowq.quantize_ckpt8(S, q, sc, "rne")
    d_rne = q.double() * sc.double()[..., None] - S
    assert float((d_rne.abs() > 5 * sem + 2e-7 * S.abs()).double().mean()) > 0.5


def test_checkpoint8_decode_spec():
    """Checkpoint8 through replay_decode: non-flush steps read q * scale; the flush folds from it and stores
    through Checkpoint8.write with the slot's flush count; advance_cursor moves the flush count at the wrap."""
    gen = torch.Generator().manual_seed(3)
    slots, H, P, N, G, L = 3, 4, 8, 16, 2, 4
    S = torch.randn(slots, H, P, N, generator=gen, dtype=F64)
    ck = shadowq.Checkpoint8.of(S, "sr", seed=11)
    rne = shadowq.Checkpoint8.of(S, "rne")
    caches = [(torch.zeros(slots, H, L, P, dtype=F64), torch.zeros(slots, G, L, N, dtype=F64),
               torch.zeros(slots, H, L, dtype=F64), torch.zeros(slots, dtype=torch.int32)) for _ in range(2)]
    A = -torch.rand(H, generator=gen, dtype=F64) - 0.5
    D = torch.randn(H, generator=gen, dtype=F64)
    dt_bias = torch.zeros(H, dtype=F64)
    sbi = torch.tensor([2, -1, 0], dtype=torch.int32)
    untouched = ck.q[1].clone()
    for _ in range(2 * L):
        x = torch.randn(3, H, P, generator=gen, dtype=F64)
        B, C = torch.randn(3, G, N, generator=gen, dtype=F64), torch.randn(3, G, N, generator=gen, dtype=F64)
        dt = torch.randn(3, H, generator=gen, dtype=F64)
        # The float64 expectation of this step from the dequantised checkpoint, via the fp32-state spec.
        st = torch.stack([ck.read(s, F64) for s in range(slots)])
        xc, Bc, dtc, cur = (t.clone() for t in caches[0])
        y_expect = ref.replay_decode(st, xc, Bc, dtc, cur, x, B, C, dt, dt_bias, A, D, None, sbi)
        flushing = int(caches[0][3][2]) == L - 1
        before = ck.flushes.clone()
        y = ref.replay_decode(None, *caches[0], x, B, C, dt, dt_bias, A, D, None, sbi, ckpt8=ck)
        torch.testing.assert_close(y[[0, 2]], y_expect[[0, 2]], rtol=0, atol=1e-12)  # same float64 math
        assert torch.isnan(y[1]).all()
        if flushing:  # the stored checkpoint is the SR quantisation of the folded state at the old count
            q, sc = torch.empty_like(ck.q[0]), torch.empty_like(ck.scale[0])
            for s in (0, 2):
                shadowq.quantize_ckpt8(st[s], q, sc, "sr", 11, s, int(before[s]))  # st[s]: the folded state
                assert torch.equal(q.view(torch.uint8), ck.q[s].view(torch.uint8)) and torch.equal(sc, ck.scale[s])
        ref.replay_decode(None, *caches[1], x, B, C, dt, dt_bias, A, D, None, sbi, ckpt8=rne)
        cursors.advance_cursor(caches[0][3], sbi, L, ck.flushes)
        cursors.advance_cursor(caches[1][3], sbi, L, rne.flushes)
    assert ck.flushes.tolist() == [2, 0, 2]
    assert torch.equal(ck.q[1].view(torch.uint8), untouched.view(torch.uint8))  # unused slot
    assert not torch.equal(ck.q.view(torch.uint8), rne.q.view(torch.uint8))  # SR and RNE differ (teeth)


def test_checkpoint8_refuses_a_second_checkpoint():
    ck = shadowq.Checkpoint8(1, 1, 8, 16)
    z = torch.zeros
    with pytest.raises(ValueError, match="ckpt8"):
        ref.replay_decode(z(1, 1, 8, 16), z(1, 1, 4, 8), z(1, 1, 4, 16), z(1, 1, 4), z(1, dtype=torch.int32),
                          z(1, 1, 8), z(1, 1, 16), z(1, 1, 16), z(1, 1), z(1), z(1), z(1), ckpt8=ck)
    with pytest.raises(ValueError, match="rounding"):
        shadowq.Checkpoint8(1, 1, 8, 16, rounding="nearest")
