# SPDX-License-Identifier: Apache-2.0
"""The 8-bit checkpoint kernel (KernelSpec state "fp8") against reference.Checkpoint8 on the GPU.

Oracles:
- Bit for bit where the arithmetic is mirrored (``test_flush_bytes_bit_exact``): a flush with A = 0 (decay and
  every exp(...) are exactly 1, so w_j = dt_j), this step's x = 0 (its ring term adds exactly 0), inputs on
  small integer grids and power-of-two initial scales. Every fp32 product is then exact and every fmaf of the
  fold is the float64 sum rounded once to fp32 (all terms on a 2^-24 grid below 2^12: the float64 sum is exact),
  so the stored e4m3 bytes and fp32 scales must equal reference.quantize_ckpt8 of that fp32 state with the same
  (seed, flush, slot): the hash, the scale and the stochastic rounding are the kernel's.
- Against float64 over several flush cycles (``test_steps_against_float64``): y against the float64 spec reading
  the very checkpoint the kernel stored (tolerance: the activation dtype's rounding of y, as
  tests/test_kernels_gpu.py); after a flush, each stored value must be one of the two e4m3 neighbours (in units of
  its row scale) of the float64 folded state, allowing the fp32 fold's error (1e-5 of the row's max, fp32
  sums of <= L terms and exp in fp32) and scales within 1e-5 relative.
- Bookkeeping exactly: rings, cursors and flush counts; padding rows' y and unused slots (checkpoint bytes,
  scales, rings, flush counts) bit-identical.
"""

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import cursor_ops
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.mamba2 import ops
from trtllm_replayssm.families.mamba2 import reference as ref

from .problems import make_inputs, make_params

pytestmark = pytest.mark.gpu
F64 = torch.float64
U8 = torch.uint8


def _grid(shape, gen, lo=-127, hi=128, exp=-6, nonzero=False):
    v = torch.randint(lo, hi, shape, generator=gen)
    if nonzero:
        v = torch.where(v == 0, torch.ones_like(v), v)
    return v.double() * 2.0 ** exp


@pytest.mark.parametrize("geom,L,act", [((4, 64, 128, 2), 8, torch.bfloat16), ((8, 64, 128, 8), 16, torch.float16),
                                        ((2, 80, 64, 1), 4, torch.bfloat16)])
def test_flush_bytes_bit_exact(geom, L, act):
    H, P, N, G = geom
    slots, batch, seed = 5, 3, 1234
    gen = torch.Generator().manual_seed(7)
    q0 = _grid((slots, H, P, N), gen, -15, 16, 0, nonzero=True).float().to(torch.float8_e4m3fn)  # small e4m3 ints
    sc0 = torch.exp2(torch.randint(-8, 1, (slots, H, P), generator=gen).float())
    flushes0 = torch.randint(0, 1000, (slots,), generator=gen, dtype=torch.int32)
    xc = _grid((slots, H, L, P), gen).to(act)
    Bc = _grid((slots, G, L, N), gen).to(act)
    dtc = _grid((slots, H, L), gen, 1, 64).float()
    cursor = torch.full((slots,), L - 1, dtype=torch.int32)
    sbi = torch.tensor([3, -1, 0], dtype=torch.int32)
    x = torch.zeros(batch, H, P, dtype=act)
    B, C = _grid((batch, G, N), gen).to(act), _grid((batch, G, N), gen).to(act)
    dt = torch.randn(batch, H, generator=gen).to(act)
    zeros = torch.zeros(H, device="cuda")
    dq, dsc, dfl = q0.cuda(), sc0.cuda(), flushes0.cuda()
    dxc, dBc, ddtc, dcur = xc.cuda(), Bc.cuda(), dtc.cuda(), cursor.cuda()
    y = torch.full((batch, H, P), 7.0, dtype=act, device="cuda")
    ops.replay_decode(x.cuda(), B.cuda(), C.cuda(), dt.cuda(), zeros, zeros, zeros, dq, dxc, dBc, ddtc, dcur, sbi.cuda(),
                      out=y, ckpt_scale=dsc, ckpt_flushes=dfl, ckpt_seed=seed)
    for s in (3, 0):
        st = q0[s].float() * sc0[s][..., None]  # (q * scale) * exp(0): exact
        hpg = H // G
        for j in range(L - 1):  # the fold: fmaf(dt_j * x_j, B_j, st), exact in float64, rounded once
            sc = dtc[s, :, j][:, None] * xc[s, :, j].float()  # (H, P), exact
            b = Bc[s, :, j].float().repeat_interleave(hpg, 0)  # (H, N)
            st = (sc.double()[..., None] * b.double()[:, None, :] + st.double()).float()
        q, scale = torch.empty_like(q0[s]), torch.empty_like(sc0[s])
        shadowq.quantize_ckpt8(st, q, scale, "sr", seed, s, int(flushes0[s]))
        assert torch.equal(dq[s].cpu().view(U8), q.view(U8)), f"slot {s}: stored e4m3 bytes"
        assert torch.equal(dsc[s].cpu(), scale), f"slot {s}: stored scales"
        # the flush's y = S_k C_k (+ D x_k = 0): fp32 dots of N terms, one rounding to the activation dtype
        yk = torch.einsum("hpn,hn->hp", st.double(), C[[0, 2][s == 0]].double().repeat_interleave(hpg, 0))
        b = 2 if s == 0 else 0
        torch.testing.assert_close(y[b].cpu().double(), yk, rtol=1e-2, atol=1e-2 * float(yk.abs().max()))
    # Rows padded and slots unused: untouched, bit for bit; a flush writes no ring entry and moves no count.
    assert torch.equal(y[1].cpu(), torch.full((H, P), 7.0, dtype=act))
    for s in (1, 2, 4):
        assert torch.equal(dq[s].cpu().view(U8), q0[s].view(U8)) and torch.equal(dsc[s].cpu(), sc0[s])
    assert torch.equal(dxc.cpu(), xc) and torch.equal(dBc.cpu(), Bc) and torch.equal(ddtc.cpu(), dtc)
    assert torch.equal(dfl.cpu(), flushes0) and torch.equal(dcur.cpu(), cursor)
    # Teeth: another seed stores other bytes.
    q2, s2 = torch.empty_like(q0[0]), torch.empty_like(sc0[0])
    shadowq.quantize_ckpt8(st, q2, s2, "sr", seed + 1, 0, int(flushes0[0]))
    assert not torch.equal(dq[0].cpu().view(U8), q2.view(U8))


def _neighbours(v):
    a = v.abs().clamp(max=448.0)
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** -60)))
    quantum = torch.exp2(torch.clamp(e - 3, min=-9))
    lo = torch.floor(a / quantum) * quantum
    return lo, torch.where(lo == a, lo, lo + quantum)


@pytest.mark.parametrize("geom,L,act,batch,has_z", [((4, 64, 128, 2), 8, torch.bfloat16, 6, False),
                                                    ((128, 64, 128, 8), 16, torch.bfloat16, 5, False),
                                                    ((8, 80, 128, 2), 4, torch.float16, 9, True)])
def test_steps_against_float64(geom, L, act, batch, has_z):
    H, P, N, G = geom
    slots = batch + 3
    gen = torch.Generator().manual_seed(11)
    prm = make_params(H, gen, "cuda")
    ck = shadowq.Checkpoint8.of(torch.randn(slots, H, P, N, generator=gen, dtype=F64), "sr", seed=5)
    dq, dsc, dfl = ck.q.cuda(), ck.scale.cuda(), ck.flushes.cuda()
    # Slots at every buffer position; ring entries before the cursor hold history, the others NaN (never read).
    cur0 = torch.arange(slots, dtype=torch.int32) % L
    used = torch.arange(L)[None, :] < cur0[:, None]  # (slots, L)
    nan = torch.tensor(float("nan"))
    dxc = torch.where(used[:, None, :, None], torch.randn(slots, H, L, P, generator=gen), nan).to(act).cuda()
    dBc = torch.where(used[:, None, :, None], torch.randn(slots, G, L, N, generator=gen) * 0.3, nan).to(act).cuda()
    ddtc = torch.where(used[:, None, :], torch.rand(slots, H, L, generator=gen) * 0.1, nan).cuda()
    dcur = cur0.cuda()
    sbi = torch.randperm(slots, generator=gen)[:batch].to(torch.int32)
    sbi[1] = -1
    valid = (sbi >= 0).nonzero().flatten().tolist()
    unused = sorted(set(range(slots)) - set(sbi.tolist()))
    keep = [t.clone() for t in (dq, dsc, dfl, dxc, dBc, ddtc)]
    # The reference rings start as the kernel's, with the entries before each cursor filled in by warm-up steps.
    rxc, rBc, rdtc = dxc.cpu().clone(), dBc.cpu().clone(), ddtc.cpu().double()
    flushed = 0
    for _ in range(2 * L + 1):
        x, B, C, dt, z = make_inputs(batch, H, P, N, G, act, gen, "cuda", has_z)
        rck = shadowq.Checkpoint8.wrap(dq.cpu(), dsc.cpu(), dfl.cpu(), "sr", 5)  # the checkpoint the kernel stored
        q_before = rck.q.clone()
        rcur = dcur.cpu()
        y_ref = ref.replay_decode(None, rxc, rBc, rdtc, rcur, x.cpu(), B.cpu(), C.cpu(), dt.cpu(), prm.dt_bias.cpu(),
                                  prm.A.cpu(), prm.D.cpu(), None if z is None else z.cpu(), sbi, ckpt8=rck)
        y = torch.full((batch, H, P), 3.0, dtype=act, device="cuda")
        # float64 folded states of the rows that flush this step (the value SR rounds), before the kernel runs
        S64 = {}
        for b in valid:
            s = int(sbi[b])
            if int(rcur[s]) == L - 1:
                kk = L
                xs = torch.cat([rxc[s, :, :L - 1].double(), x[b].cpu().double()[:, None]], 1)
                Bs = torch.cat([rBc[s, :, :L - 1].double(), B[b].cpu().double()[:, None]], 1).repeat_interleave(H // G, 0)
                dt_now = ref.process_dt(dt[b].cpu().double(), prm.dt_bias.cpu().double())
                dts = torch.cat([rdtc[s, :, :kk - 1], dt_now[:, None]], 1)
                w, decay = ref.buffer_weights(dts, prm.A.cpu().double())
                S64[s] = decay[:, None, None] * (q_before[s].double() * dsc[s].cpu().double()[..., None]) + torch.einsum(
                    "hk,hkp,hkn->hpn", w, xs, Bs)
        ops.replay_decode(x, B, C, dt, prm.dt_bias, prm.A, prm.D, dq, dxc, dBc, ddtc, dcur, sbi.cuda(), z=z, out=y,
                          ckpt_scale=dsc, ckpt_flushes=dfl, ckpt_seed=5)
        yv, rv = y[valid].cpu().double(), y_ref[valid].double()
        assert float((yv - rv).norm() / rv.norm()) < (5e-3 if act == torch.bfloat16 else 2e-3)  # one y rounding
        assert torch.equal(y[1].cpu(), torch.full((H, P), 3.0, dtype=act))
        for s, S in S64.items():
            flushed += 1
            scale = dsc[s].cpu().double()
            amax = S.abs().amax(-1)
            assert float(((scale * 448 - amax).abs() / amax).max()) < 1e-5  # fp32 fold vs float64
            back = dq[s].cpu().double()
            lo, hi = _neighbours(S / scale[..., None])
            slack = 1e-5 * amax[..., None] / scale[..., None]  # the fp32 fold's error, in scaled units
            ok = (back.abs() >= lo - slack) & (back.abs() <= hi + slack) & ((back * S >= 0) | (back == 0) | (S.abs() < slack))
            assert bool(ok.all()), f"slot {s}: {int((~ok).sum())} stored values outside their e4m3 neighbours"
        # rings and flush counts exactly as the spec's
        assert torch.equal(dxc.cpu().view(torch.int16), rxc.view(torch.int16))
        assert torch.equal(dBc.cpu().view(torch.int16), rBc.view(torch.int16))
        fin = torch.isfinite(rdtc)
        assert torch.equal(torch.isfinite(ddtc.cpu()), fin)
        torch.testing.assert_close(ddtc.cpu().double()[fin], rdtc[fin], rtol=1e-5, atol=0)  # fp32 softplus
        rdtc[fin] = ddtc.cpu().double()[fin]  # continue from the kernel's values (the rings are its state)
        cursor_ops.advance_cursor(dcur, sbi.cuda(), L, flushes=dfl)
        cursors.advance_cursor(rcur, sbi, L, rck.flushes)
        assert torch.equal(dcur.cpu(), rcur) and torch.equal(dfl.cpu(), rck.flushes)
    assert flushed >= len(valid)  # every valid row flushed at least once (teeth of the neighbour check)
    for s in unused:
        for t, k in zip((dq, dsc, dfl, dxc, dBc, ddtc), keep):
            a, b = t[s].cpu(), k[s].cpu()
            assert torch.equal(a.view(U8) if a.dtype == torch.float8_e4m3fn else a.nan_to_num(),
                               b.view(U8) if b.dtype == torch.float8_e4m3fn else b.nan_to_num())
