# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache with an 8-bit checkpoint (issue 38: ``state_dtype=torch.float8_e4m3fn``, Mamba-2 layers, standard
decode): the cache wires the fp8-e4m3 checkpoint, its (S, H, P) row scales, the per-slot flush counts and the
per-layer seeds of the stochastic rounding into the step, so it runs exactly :class:`reference.Checkpoint8`'s spec.

Oracles: on the CPU the cache's outputs and stored bytes equal, bit for bit, the float64 spec driven directly
(``reference.replay_decode(ckpt8=...)`` with ``advance_cursor(flushes=...)``) on the same inputs; a snapshot restored
into another cache continues bit-identically (the flush counts and the seed travel with it). On CUDA (GPU test) the
kernel against a float64 CPU cache re-synced after each step: y within 1e-2 (bf16 output, fp32 vs float64 sums),
the dequantised checkpoint after a flush within 7e-2 (one e4m3 step, 2^-3 relative, where the fp32 and float64
folds land on either side of a rounding boundary; the random words are the same), cursors and flush counts exact."""

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.cache import ReplayStateCache, Snapshot
from trtllm_replayssm.families.mamba2 import reference as ref

F64, FP8 = torch.float64, torch.float8_e4m3fn
H, P, N, G, L = 4, 64, 64, 2, 4


def _inputs(gen, batch, dtype=F64, device="cpu"):
    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype).to(device)
    return (rnd(batch, 1, H, P), rnd(batch, 1, G, N, scale=N ** -0.5 * 4), rnd(batch, 1, G, N, scale=N ** -0.5 * 4),
            rnd(batch, 1, H, shift=-2.0))


def _params(gen, layers):
    return [(torch.randn(H, generator=gen, dtype=F64) * 0.3, -torch.rand(H, generator=gen, dtype=F64) - 0.2,
             torch.randn(H, generator=gen, dtype=F64)) for _ in range(layers)]


def test_cpu_cache_runs_the_spec_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    layers, slots, seed = 2, 5, 77
    cache = ReplayStateCache(layers, slots, H, P, N, G, L, cursor="standard", state_dtype=FP8, act_dtype=F64,
                             dt_dtype=F64, ckpt_seed=seed, conv_dim=0)
    assert cache.state.dtype == FP8 and cache.layer(0).shadow is None and cache.ckpt_flushes.dtype == torch.int32
    live = [cache.allocate() for _ in range(3)]
    # the spec, driven directly on its own tensors
    spec = [shadowq.Checkpoint8(slots, H, P, N, "sr", seed + l) for l in range(layers)]
    rings = [[torch.zeros(slots, H, L, P, dtype=F64), torch.zeros(slots, G, L, N, dtype=F64),
              torch.zeros(slots, H, L, dtype=F64)] for _ in range(layers)]
    cursor, flushes = torch.zeros(slots, dtype=torch.int32), torch.zeros(slots, dtype=torch.int32)
    for l in range(layers):
        for s in live:
            S0 = torch.randn(H, P, N, generator=gen, dtype=F64) * 0.5
            cache.load_prefill(s, l, S0)
            spec[l].flushes = flushes
            spec[l].write(s, S0)
    prm = _params(gen, layers)
    sbi = torch.tensor([live[1], -1, live[0], live[2]], dtype=torch.int32)
    for step in range(3 * L + 2):
        cache.flush(sbi, 1)
        for l in range(layers):
            x, B, C, dt = _inputs(gen, 4)
            y = cache.verify(l, x, B, C, dt, *prm[l], None, sbi)
            spec[l].flushes = flushes
            want = ref.replay_decode(None, *rings[l], cursor, x[:, 0], B[:, 0], C[:, 0], dt[:, 0], *prm[l],
                                     state_batch_indices=sbi, ckpt8=spec[l])
            assert torch.equal(y[:, 0].nan_to_num(7.0), want.nan_to_num(7.0)), (step, l)
        cache.commit(sbi, None, 1)
        cursors.advance_cursor(cursor, sbi, L, flushes)
        assert torch.equal(cache.cursor, cursor) and torch.equal(cache.ckpt_flushes, flushes), step
        for l in range(layers):
            assert torch.equal(cache.state[l].view(torch.uint8), spec[l].q.view(torch.uint8)), (step, l)
            assert torch.equal(cache.groups[0].t["ckpt_scale"][l], spec[l].scale), (step, l)
    assert int(flushes.max()) >= 3  # every live slot folded (3L + 2 steps)
    A = prm[0][1]
    S = cache.committed_state(0, live[0], A)  # the dequantised checkpoint folded with the ring, float64
    assert S.dtype == F64 and S.shape == (H, P, N) and torch.isfinite(S).all()


def test_snapshot_carries_the_rounding_stream():
    """A snapshot restored into the same slot index of another cache continues bit for bit (the flush counts and the
    seed travel with it). The stochastic rounding's random words are keyed by (seed, flush count, slot index, ...),
    as the kernel draws them: restored into another slot index the request continues exactly until its next flush,
    which then draws other (equally valid) random words."""
    gen = torch.Generator().manual_seed(4)
    kw = dict(cursor="standard", state_dtype=FP8, act_dtype=F64, dt_dtype=F64, ckpt_seed=5, conv_dim=0)
    a, b, c = (ReplayStateCache(1, 3, H, P, N, G, L, **kw) for _ in range(3))
    sa = a.allocate()
    assert b.allocate() == sa and c.allocate() != sa + 1 and c.allocate() == sa + 1
    a.load_prefill(sa, 0, torch.randn(H, P, N, generator=gen, dtype=F64))
    prm = _params(gen, 1)[0]
    moved = L + 1  # mid-cycle, after a flush: move the request through bytes
    for step in range(3 * L):
        x = _inputs(gen, 1)
        if step == moved:
            snap = Snapshot.from_bytes(a.snapshot([sa]).to_bytes())
            assert "ckpt_flushes" in snap.tensors and snap.header["geometry"]["ckpt_seed"] == 5
            b.restore([sa], snap)
            c.restore([sa + 1], snap)
            other = ReplayStateCache(1, 3, H, P, N, G, L, **{**kw, "ckpt_seed": 6})
            other.allocate()
            with pytest.raises(ValueError, match="ckpt_seed: 5 in the snapshot, 6 in the cache"):
                other.restore([0], snap)
        ys = []
        for cache, s in ((a, sa),) + (((b, sa), (c, sa + 1)) if step >= moved else ()):
            sbi = torch.tensor([s], dtype=torch.int32)
            cache.flush(sbi, 1)
            ys.append(cache.verify(0, *x, *prm, None, sbi))
            cache.commit(sbi, None, 1)
        if step >= moved:
            assert torch.equal(ys[0], ys[1]), step
            assert torch.equal(a.state[0, sa].view(torch.uint8), b.state[0, sa].view(torch.uint8)), step
            assert int(a.ckpt_flushes[sa]) == int(b.ckpt_flushes[sa]) >= 1
            next_flush = moved + (L - 1 - (moved % L))  # the step whose cursor is L - 1
            assert torch.equal(ys[0], ys[2]) == (step <= next_flush), step


def test_eight_bit_checkpoint_errors_name_the_argument():
    with pytest.raises(ValueError, match="an 8-bit checkpoint .float8_e4m3fn. is for Mamba-2 layers on the standard"):
        ReplayStateCache(1, 2, H, P, N, G, L, state_dtype=FP8)  # ring cursor
    with pytest.raises(ValueError, match="shadow_dtype: an 8-bit checkpoint .* is its own fp8 read copy"):
        ReplayStateCache(1, 2, H, P, N, G, L, cursor="standard", state_dtype=FP8, shadow_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="ckpt_seed: expected an int"):
        ReplayStateCache(1, 2, H, P, N, G, L, cursor="standard", state_dtype=FP8, ckpt_seed=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_follows_the_float64_cache():
    gen = torch.Generator().manual_seed(9)
    layers, slots, batch = 2, 5, 4
    kw = dict(cursor="standard", state_dtype=FP8, ckpt_seed=11, conv_dim=0)
    dev = ReplayStateCache(layers, slots, 8, 64, 128, 2, 8, act_dtype=torch.bfloat16, device="cuda", **kw)
    cpu = ReplayStateCache(layers, slots, 8, 64, 128, 2, 8, act_dtype=F64, dt_dtype=F64, **kw)
    assert dev.uses_kernels and not cpu.uses_kernels
    live = [dev.allocate() for _ in range(batch - 1)]
    assert [cpu.allocate() for _ in live] == live
    for l in range(layers):
        for s in live:
            S0 = torch.randn(8, 64, 128, generator=gen) * 0.5
            dev.load_prefill(s, l, S0.cuda())
            cpu.load_prefill(s, l, S0.double())
    prm = [(torch.randn(8, generator=gen) * 0.3, -torch.rand(8, generator=gen) - 0.2, torch.randn(8, generator=gen))
           for _ in range(layers)]
    sbi = torch.tensor(live[:1] + [-1] + live[1:], dtype=torch.int32)
    mg, cg = dev.groups[0], cpu.groups[0]
    for step in range(3 * 8 + 2):
        dev.flush(sbi.cuda(), 1)
        cpu.flush(sbi, 1)
        for l in range(layers):
            x = torch.randn(batch, 1, 8, 64, generator=gen).to(torch.bfloat16)
            B, C = (torch.randn(batch, 1, 2, 128, generator=gen) * 0.35).to(torch.bfloat16), \
                (torch.randn(batch, 1, 2, 128, generator=gen) * 0.35).to(torch.bfloat16)
            dt = (torch.randn(batch, 1, 8, generator=gen) - 2).to(torch.bfloat16)
            y = dev.verify(l, x.cuda(), B.cuda(), C.cuda(), dt.cuda(), *(t.cuda() for t in prm[l]), None, sbi.cuda())
            want = cpu.verify(l, x.double(), B.double(), C.double(), dt.double(), *(t.double() for t in prm[l]),
                              None, sbi)
            ok = sbi >= 0
            err = float((y[ok.cuda()].cpu().double() - want[ok]).norm() / want[ok].norm())
            assert err < 1e-2, (step, l, err)
        dev.commit(sbi.cuda(), None, 1)
        cpu.commit(sbi, None, 1)
        assert torch.equal(dev.cursor.cpu(), cpu.cursor) and torch.equal(dev.ckpt_flushes.cpu(), cpu.ckpt_flushes)
        if step % 8 == 7:  # every live slot folded this step
            for l in range(layers):
                d = dev.state[l].cpu().float() * mg.t["ckpt_scale"][l].cpu()[..., None]
                c = cpu.state[l].float() * cg.t["ckpt_scale"][l][..., None]
                err = float((d[live] - c[live]).norm() / c[live].norm())
                assert err < 7e-2, (step, l, err)
        for name in ("state", "ckpt_scale", "x_cache", "B_cache", "dt_cache"):  # re-sync the mirror
            t = mg.t[name].cpu()
            cg.t[name].copy_(t if t.dtype == cg.t[name].dtype else t.to(cg.t[name].dtype))
