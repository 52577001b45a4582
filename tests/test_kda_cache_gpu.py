# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache with Kimi Delta Attention layers on CUDA (the family's fused decode kernel on the standard cursor,
its verify kernel on the ring cursor with T = 4 and random acceptance, through the cache's one API; the shared cursor
kernels) against a float64 ReplayStateCache on the CPU, step by step.

Oracle: the CPU cache in float64 fed the very inputs the CUDA cache sees, re-synced to the CUDA cache's KDA tensors
after every step (checkpoint, rings, shadow, conv windows), so each comparison is one step's fp32-vs-float64
arithmetic. Tolerances are tests/test_kda_gpu.py's: y 1e-2 with bf16 activations (the bf16 output and the bf16 u
ring, 2^-9 each), 2e-2 with a bf16 shadow (S0 read through one more bf16 rounding); a flushed slot's checkpoint
1e-4 (the exact fp32 fold of <= L entries). Bookkeeping exactly: cursors, conv windows, padding rows' outputs
untouched (NaN stays NaN), free slots bit-identical."""

import math

import pytest
import torch

from trtllm_replayssm.cache import ReplayStateCache

pytestmark = pytest.mark.gpu
F64 = torch.float64
K_CONV = 4


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shadow, lower_bound, T, phases", [
    (None, None, 1, False), (torch.bfloat16, None, 1, False), (None, -5.0, 1, False), (None, None, 4, False),
    (torch.bfloat16, -5.0, 4, False), (torch.bfloat16, None, 1, True), (None, None, 2, True)])
def test_kda_cache_on_cuda_follows_the_float64_cache(shadow, lower_bound, T, phases):
    """``phases``: both caches deal flush phases (counts start over zeroed ring entries: the kernels read them)."""
    H, K, V, L, layers, slots, batch = 4, 128, 128, 8, 2, 6, 4
    act = torch.bfloat16
    standard = T == 1
    kw = dict(cursor="standard" if standard else "ring", num_draft=T - 1, conv_kernel=K_CONV, shadow_dtype=shadow,
              flush_phases=phases)
    dev = ReplayStateCache.for_family("kda", layers, slots, (H, K, V), L, act_dtype=act, device="cuda", **kw)
    cpu = ReplayStateCache.for_family("kda", layers, slots, (H, K, V), L, state_dtype=F64, act_dtype=F64, dt_dtype=F64,
                                      read_shadow=shadow is not None, **kw)
    assert dev.uses_kernels and not cpu.uses_kernels
    gen = torch.Generator().manual_seed(7)
    A_log = [torch.log(torch.rand(H, generator=gen) * 1.45 + 0.05) for _ in range(layers)]
    dt0 = [torch.exp(torch.rand(H, K, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
           for _ in range(layers)]
    dt_bias = [d + torch.log(-torch.expm1(-d)) for d in dt0]
    Dc = dev.groups[-1].conv_dim
    conv_w = [(torch.randn(Dc, K_CONV, generator=gen) * 0.5, torch.randn(Dc, generator=gen) * 0.1) for _ in range(layers)]
    live = [dev.allocate() for _ in range(batch - 1)]
    assert [cpu.allocate() for _ in live] == live
    assert [dev.phase(s) for s in live] == [cpu.phase(s) for s in live] == ([0, 1, 2] if phases else [0, 0, 0])
    for s in live:
        for l in range(layers):
            S0 = torch.randn(H, K, V, generator=gen) * 0.2
            dev.load_prefill(s, l, S0.cuda())
            cpu.load_prefill(s, l, S0.double())
    g_dev, g_cpu = dev.groups[-1], cpu.groups[-1]
    names = list(g_dev.t)
    folds = 0
    for step in range(3 * L + 2):
        rows = live[:]
        rows.insert(step % batch, -1)  # one padding row at a moving position
        sbi = torch.tensor(rows, dtype=torch.int32)
        free = [s for s in range(slots) if s not in live]
        before = {n: g_dev.t[n][:, free].clone() for n in names}
        dev.flush(sbi.cuda(), T)
        folded = cpu.flush(sbi, T)
        folds += len(folded)
        ok = sbi >= 0
        for l in range(layers):
            u = torch.randn(batch, T, Dc, generator=gen).to(act)
            w, bias = conv_w[l]
            co = cpu.conv_update(l, u.double(), w.double(), bias.double(), sbi)
            dev.conv_update(l, u.cuda(), w.cuda(), bias.cuda(), sbi.cuda())
            q, k, v = co[..., :H * K], co[..., H * K:2 * H * K], co[..., 2 * H * K:]
            q = q.reshape(batch, T, H, K).nan_to_num().to(act)
            k = k.reshape(batch, T, H, K).nan_to_num().to(act)
            v = v.reshape(batch, T, H, V).nan_to_num().to(act)
            f = torch.randn(batch, T, H, K, generator=gen).to(act)
            b = (torch.randn(batch, T, H, generator=gen) + 1).to(act)
            out = torch.full((batch, T, H, V), float("nan"), dtype=act, device="cuda")
            y = dev.verify(l, q.cuda(), k.cuda(), v.cuda(), f.cuda(), b.cuda(), A_log[l].cuda(), dt_bias[l].cuda(),
                           sbi.cuda(), out=out, lower_bound=lower_bound)
            want = cpu.verify(l, q.double(), k.double(), v.double(), f.double(), b.double(), A_log[l].double(),
                              dt_bias[l].double(), sbi, lower_bound=lower_bound)
            tol = 2e-2 if shadow is not None else 1e-2
            assert rel(y[ok.cuda()].cpu(), want[ok]) < tol, (step, l, rel(y[ok.cuda()].cpu(), want[ok]))
            assert torch.isnan(y[~ok.cuda()]).all()  # the padding row's output untouched
        # n >= T - num_draft = 1: the conv window keeps K - 1 inputs past the last accepted one (cache.commit)
        acc = None if standard else torch.randint(1, T + 1, (batch,), generator=gen).to(torch.int32)
        dev.commit(sbi.cuda(), None if standard else acc.cuda(), T)
        cpu.commit(sbi, acc, T)
        assert torch.equal(dev.cursor.cpu(), cpu.cursor), step
        # standard: a slot whose count starts at its phase c folds at step L - 1 - c mod L (c = 0 without phases)
        assert not standard or sorted(folded) == sorted(s for s in live if (step + cpu.phase(s)) % L == L - 1), step
        for l in range(layers):  # the folded slots' checkpoints
            if folded:
                assert rel(g_dev.t["state"][l].cpu()[folded], g_cpu.t["state"][l][folded]) < 1e-4, (step, l)
        assert torch.equal(g_dev.conv.cpu().double(), g_cpu.conv.to(act).double()), step
        for n, t in before.items():  # free slots bit-identical
            assert torch.equal(g_dev.t[n][:, free], t), (step, n)
        for n in names:  # re-sync the mirror: the next comparison is one step's arithmetic
            g_cpu.t[n].copy_(g_dev.t[n].cpu().to(g_cpu.t[n].dtype))
    assert folds >= (3 * len(live) if standard else 2)  # standard: every live slot folded three times in 3L + 2 steps
