# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache with Gated DeltaNet layers on CUDA (the GDN verify kernel + the shared commit kernel)
against a float64 ReplayStateCache on the CPU, step by step.

Oracle: the CPU cache in float64 fed the very inputs the CUDA cache sees (bf16 / f32 widened), re-synced
to the CUDA cache's GDN tensors after every step (checkpoint, rings, shadow), so each comparison is one
step's fp32-vs-float64 arithmetic: y within the tolerances of tests/test_gdn_gpu.py (bf16 5e-3: one
rounding of 2^-9 per element; f32 2e-5: fp32 sums over K plus <= L buffer terms), the checkpoint of a
flushed slot within 2e-5 (an fp32 fold of <= L entries). Bookkeeping exactly: cursors (both paths move
them), conv windows, free slots bit-identical, padding rows' outputs untouched (NaN stays NaN)."""

import pytest
import torch

from trtllm_replayssm.cache import ReplayStateCache

pytestmark = pytest.mark.gpu
F64 = torch.float64
TOL = {torch.bfloat16: 5e-3, torch.float32: 2e-5}
K_CONV = 4


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def gdn_tensors(cache) -> dict:
    """The cache's GDN tensors by state-table name (the shadow when kept), and its conv windows."""
    g = cache.group("gdn")
    return {**g.t, "conv": g.conv}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act, shadow, T, cursor, phases", [
    (torch.bfloat16, None, 4, "ring", False), (torch.float32, None, 2, "ring", False),
    (torch.bfloat16, torch.bfloat16, 4, "ring", False), (torch.bfloat16, torch.bfloat16, 1, "standard", False),
    (torch.float32, None, 1, "standard", False), (torch.bfloat16, None, 1, "standard", True),
    (torch.bfloat16, torch.bfloat16, 2, "ring", True)])
def test_gdn_cache_on_cuda_follows_the_float64_cache(act, shadow, T, cursor, phases):
    """``phases``: both caches deal flush phases (counts start over zeroed ring entries: the kernels read them)."""
    pytest.importorskip("trtllm_replayssm.families.gdn.ops")
    from trtllm_replayssm.families.gdn import ops as gdn_ops

    if not hasattr(gdn_ops, "gdn_replay_verify"):
        pytest.skip("gdn_ops.gdn_replay_verify is not built")
    HV, HK, V, KD, L, layers, slots, batch = 8, 4, 64, 128, 16, 2, 6, 4
    geo = dict(num_draft=T - 1, cursor=cursor, conv_kernel=K_CONV, shadow_dtype=shadow, flush_phases=phases)
    dev = ReplayStateCache.for_family("gdn", layers, slots, (HV, HK, V, KD), L, act_dtype=act, device="cuda", **geo)
    cpu = ReplayStateCache.for_family("gdn", layers, slots, (HV, HK, V, KD), L, state_dtype=F64, act_dtype=F64,
                                      dt_dtype=F64, read_shadow=shadow is not None, **geo)
    dev_t, cpu_t = gdn_tensors(dev), gdn_tensors(cpu)
    gen = torch.Generator().manual_seed(3)
    A_log = [torch.rand(HV, generator=gen) * 2 - 3 for _ in range(layers)]  # decays exp(g) in ~(0.6, 1)
    dt_bias = [torch.randn(HV, generator=gen) * 0.3 for _ in range(layers)]
    Dc = dev.group("gdn").conv_dim
    conv_w = [(torch.randn(Dc, K_CONV, generator=gen) * 0.5, torch.randn(Dc, generator=gen) * 0.1)
              for _ in range(layers)]
    live = [dev.allocate() for _ in range(batch - 1)]
    assert [cpu.allocate() for _ in live] == live
    for s in live:  # prefill hand-off: a checkpoint of O(1) entries
        for l in range(layers):
            S0 = torch.randn(HV, V, KD, generator=gen) * 0.2
            dev.load_prefill(s, l, S0.cuda())
            cpu.load_prefill(s, l, S0.double())
    flushed_seen = 0
    for step in range(24 if cursor == "ring" else 2 * L + 2):  # standard: a fold every L steps
        rows = live[:]
        rows.insert(step % batch, -1)  # one padding row at a moving position
        sbi = torch.tensor(rows, dtype=torch.int32)
        free = [s for s in range(slots) if s not in live]
        before = {n: t[:, free].clone() for n, t in dev_t.items()}
        dev.flush(sbi.cuda(), T, [])
        fl = cpu.flush(sbi, T, [])
        flushed_seen += len(fl)
        for l in range(layers):
            u = (torch.randn(batch, T, Dc, generator=gen)).to(act)
            w, bias = conv_w[l]
            co_dev = dev.conv_update(l, u.cuda(), w.cuda(), bias.cuda(), sbi.cuda())
            co_cpu = cpu.conv_update(l, u.double(), w.double(), bias.double(), sbi)
            ok = sbi >= 0
            assert rel(co_dev[ok.cuda()].cpu(), co_cpu[ok]) < TOL[act], (step, l, "conv")
            q, k, v = (co_cpu[..., :HK * KD], co_cpu[..., HK * KD:2 * HK * KD], co_cpu[..., 2 * HK * KD:])
            q = q.reshape(batch, T, HK, KD).nan_to_num().to(act)
            k = k.reshape(batch, T, HK, KD).nan_to_num().to(act)
            v = v.reshape(batch, T, HV, V).nan_to_num().to(act)
            a = torch.randn(batch, T, HV, generator=gen).to(act)
            b = torch.randn(batch, T, HV, generator=gen).to(act)
            out = torch.full((batch, T, HV, V), float("nan"), dtype=act, device="cuda")
            y = dev.verify(l, q.cuda(), k.cuda(), v.cuda(), a.cuda(), b.cuda(), A_log[l].cuda(),
                               dt_bias[l].cuda(), sbi.cuda(), out=out)
            want = cpu.verify(l, q.double(), k.double(), v.double(), a.double(), b.double(), A_log[l].double(),
                                  dt_bias[l].double(), sbi)
            assert rel(y[ok.cuda()].cpu(), want[ok]) < TOL[act], (step, l)
            assert torch.isnan(y[~ok.cuda()]).all()  # the padding row's output untouched
        n = torch.randint(1, T + 1, (batch,), generator=gen, dtype=torch.int32)
        dev.commit(sbi.cuda(), n.cuda(), T)
        cpu.commit(sbi, n, T)
        assert torch.equal(dev.cursor.cpu(), cpu.cursor), step
        for l in range(layers):
            for s in fl:  # a flushed slot's checkpoint: fp32 fold vs float64 from the same fp32 inputs
                assert rel(dev_t["state"][l, s].cpu(), cpu_t["state"][l, s]) < 2e-5, (step, l, s)
        assert torch.equal(dev_t["conv"].cpu().double(), cpu_t["conv"].to(act).double()), step  # input copies
        for name, t in before.items():  # free slots bit-identical
            assert torch.equal(dev_t[name][:, free], t), (step, name)
        for name, t in dev_t.items():  # re-sync the mirror: the next comparison is one step's arithmetic
            cpu_t[name].copy_(t.cpu().to(cpu_t[name].dtype))
    assert flushed_seen >= 2 * len(live)  # every live slot folded at least twice (the path under test ran)
