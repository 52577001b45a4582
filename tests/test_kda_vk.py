# SPDX-License-Identifier: Apache-2.0
"""KDA's conventional and ReplaySSM standard decode steps on a (V, K) state (plugins/kda/kda_vk.cu; the layout
experiment of bench/NOTES.md "KDA in GDN's row layout"): they compile for sm_90 / sm_100 at the planner's shapes with
both gates, keep TensorRT's parameter order, reject bad input by name, and on a GPU match the float64 reference
(trtllm_replayssm/families/kda/reference.py, on the transposed state) step after step, with padding rows' y left
as poisoned and unused slots bit for bit unchanged. Tolerances as tests/test_kda_gpu.py's (the same arithmetic in
another order): y by the act dtype, state, g / beta / u rings 1e-4 (conventional over 4 steps, replay over 3L + 2
steps with rows flushing at different steps), k / v rings exactly."""

import itertools
import re

import pytest
import torch

from tests.test_kda_gpu import (
    F32_TOL,
    F64,
    Y_TOL,
    _sbi,
    cuda,
    make_buffers,
    make_inputs,
    make_params,
    rel,
    to_dev,
    usum_expected,
    written_u,
)
from trtllm_replayssm import compile as cc
from trtllm_replayssm.cursor import advance_cursor as ref_advance
from trtllm_replayssm.families.gdn.config import override as gdn_override
from trtllm_replayssm.families.kda import GEOMETRIES
from trtllm_replayssm.families.kda import ops as kops
from trtllm_replayssm.families.kda import reference as kref
from trtllm_replayssm.families.kda.config import KDAVKSpec, kda_vk_spec
from trtllm_replayssm.families.kda.vk import kda_conventional_step_vk, kda_replay_decode_vk

SPECS = [kda_vk_spec(act, H, K, V, batch, lower_bound=lb, arch=arch)
         for (H, K, V), batch, lb, arch, act in itertools.product(
             sorted(set(GEOMETRIES.values())), (1, 32, 256), (None, -5.0), (90, 100), ("bf16",))]
SPECS += [kda_vk_spec(act, 3, K, V, 5, l2norm=l2, scale=sc, arch=90)
          for act, (K, V), l2, sc in (("f32", (64, 256), True, None), ("f16", (256, 64), False, 0.125))]


REPLAY_SPECS = [kda_vk_spec(act, H, K, V, batch, lower_bound=lb, arch=arch, L=L)
                for (H, K, V), batch, lb, arch, act, L in itertools.product(
                    sorted(set(GEOMETRIES.values())), (1, 32, 256), (None, -5.0), (90, 100), ("bf16",), (16,))]
REPLAY_SPECS += [kda_vk_spec(act, 3, K, V, 5, l2norm=l2, scale=sc, arch=90, L=L)
                 for act, (K, V), l2, sc, L in (("f32", (64, 256), True, None, 4), ("f16", (256, 64), False, 0.125, 2))]
with gdn_override(rt=4, warps=8, resident=512):  # GDN's R64 W8 at 2 blocks an SM (the benchmark's second shape)
    REPLAY_SPECS.append(kda_vk_spec("bf16", 12, 128, 128, 256, L=16))


@pytest.mark.parametrize("spec", SPECS + REPLAY_SPECS, ids=lambda s: s.key)
def test_compiles_to_ptx(spec):
    ptx = cc.compile_spec(spec, "ptx").decode()
    assert f".target sm_{spec.arch}" in ptx
    params = re.search(r"\.entry kda_conventional_vk\((.*?)\)", ptx, re.S).group(1)
    assert re.findall(r"\.param \.(u64|u32|b32|s32)", params) == ["u64"] * 9 + ["u32"] * 2 + ["u64"] * 2
    params = re.search(r"\.entry kda_vk_prologue\((.*?)\)", ptx, re.S).group(1)  # the two-kernel step
    assert re.findall(r"\.param \.(u64|u32|b32|s32)", params) == ["u64"] * 10 + ["u32"] * 2 + ["u64"] * 4
    params = re.search(r"\.entry kda_replay_rows_vk\((.*?)\)", ptx, re.S).group(1)
    assert re.findall(r"\.param \.(u64|u32|b32|s32)", params) == ["u64"] * 6 + ["u32"] * 2 + ["u64"] * 4
    assert "__local_depot" not in ptx, "a register array went to local memory"
    assert ("#define KDA_LOWER_BOUND 1" in cc.source(spec)) == (spec.lower_bound is not None)


def test_spec_rejects():
    with pytest.raises(ValueError, match="lower_bound"):
        KDAVKSpec("bf16", 12, 128, 128, 32, 4, lower_bound=1.0)
    for L in (0, 17, True):
        with pytest.raises(ValueError, match="KDAVKSpec.L"):
            KDAVKSpec("bf16", 12, 128, 128, 32, 4, L=L)
    with pytest.raises(ValueError, match="V"):
        KDAVKSpec("bf16", 12, 128, 96, 32, 4)  # GDN's row layout: V, K in 64, 128, 256


def test_launcher_names_bad_input():
    H, K, V = 4, 128, 128
    q = k = f = torch.zeros(2, H, K)
    v = torch.zeros(2, H, V)
    b = torch.zeros(2, H)
    A_log, dt_bias, sbi = torch.zeros(H), torch.zeros(H, K), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"state.*\(slots, H, V, K\)"):
        kda_conventional_step_vk(q, k, v, f, b, A_log, dt_bias, torch.zeros(3, H, K), sbi)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_conventional_step_vk(q, k, v, f, b, A_log, torch.zeros(H), torch.zeros(3, H, V, K), sbi)
    with pytest.raises(ValueError, match="64, 128, 256"):
        kda_conventional_step_vk(torch.zeros(2, H, 48), torch.zeros(2, H, 48), v, torch.zeros(2, H, 48), b, A_log,
                                 torch.zeros(H, 48), torch.zeros(3, H, V, 48), sbi)


def test_replay_launcher_names_bad_input():
    H, K, V, L, S = 4, 128, 128, 4, 3
    q = k = f = torch.zeros(2, H, K)
    v = torch.zeros(2, H, V)
    b = torch.zeros(2, H)
    A_log, dt_bias, sbi = torch.zeros(H), torch.zeros(H, K), torch.zeros(2, dtype=torch.int32)
    rings = [torch.zeros(S, H, L, K), torch.zeros(S, H, L, V), torch.zeros(S, H, L, K), torch.zeros(S, H, L, V),
             torch.zeros(S, H, L)]
    cursor = torch.zeros(S, dtype=torch.int32)
    state = torch.zeros(S, H, V, K)
    with pytest.raises(ValueError, match=r"state.*\(slots, H, V, K\)"):
        kda_replay_decode_vk(q, k, v, f, b, A_log, dt_bias, torch.zeros(S, H, K), *rings, cursor, sbi)
    bad = list(rings)
    bad[1] = rings[1].to(torch.bfloat16)  # the fp32 checkpoint's u ring is fp32
    with pytest.raises(TypeError, match="u_cache: expected dtype float32"):
        kda_replay_decode_vk(q, k, v, f, b, A_log, dt_bias, state, *bad, cursor, sbi)
    short = [torch.zeros(S, H, 1, K), torch.zeros(S, H, 1, V), torch.zeros(S, H, 1, K), torch.zeros(S, H, 1, V),
             torch.zeros(S, H, 1)]
    with pytest.raises(ValueError, match="2..16"):
        kda_replay_decode_vk(q, k, v, f, b, A_log, dt_bias, state, *short, cursor, sbi)
    with pytest.raises(ValueError, match="64, 128, 256"):
        kda_replay_decode_vk(q, k, torch.zeros(2, H, 96), f, b, A_log, dt_bias, torch.zeros(S, H, 96, K), *rings[:1],
                             torch.zeros(S, H, L, 96), rings[2], torch.zeros(S, H, L, 96), rings[4], cursor, sbi)


CASES = [  # (name, (H, K, V), act, batch, slots, gate lower bound, l2norm)
    ("kimi_k3_tp8", GEOMETRIES["kimi_k3_tp8"], torch.bfloat16, 3, 6, None, True),
    ("glm5_3_flash_tp8", GEOMETRIES["glm5_3_flash_tp8"], torch.bfloat16, 5, 9, -5.0, True),
    ("kimi_k3_tp8_b40", GEOMETRIES["kimi_k3_tp8"], torch.bfloat16, 40, 50, None, True),  # the large-batch plan
    ("odd_f32_k64_v256", (3, 64, 256), torch.float32, 4, 7, None, True),
    ("odd_f16_nonorm_k256_v64", (5, 256, 64), torch.float16, 4, 7, -3.0, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case):
    dev = cuda()
    _, (H, K, V), act, batch, slots, lb, l2 = case
    gen = torch.Generator().manual_seed(11)
    A_log, dt_bias = make_params(H, K, gen)
    state = torch.randn(slots, H, K, V, generator=gen) * 0.1  # the reference's (K, V)
    sbi = _sbi(batch, slots, gen)
    st = state.transpose(2, 3).contiguous().to(dev)  # the kernel's (V, K)
    unused = [s for s in range(slots) if s not in sbi.tolist()]
    before = st[unused].clone()
    for step in range(4):
        q, k, v, f, b = make_inputs(batch, H, K, V, act, gen, l2)
        y_ref = kref.conventional_step(state, q, k, v, f, b, A_log, dt_bias, sbi, use_qk_l2norm=l2, lower_bound=lb)
        out = torch.full((batch, H, V), float("nan"), dtype=act, device=dev)
        kda_conventional_step_vk(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), st, sbi.to(dev), out=out,
                                 use_qk_l2norm=l2, lower_bound=lb)
        y, live = out.cpu(), sbi >= 0
        assert torch.isnan(y[~live]).all(), "padding rows must keep their poisoned y"
        assert rel(y[live], y_ref[live]) < Y_TOL[act], f"step {step}"
        assert rel(st.cpu().transpose(2, 3), state) < F32_TOL, f"step {step}"
        assert torch.equal(st[unused], before), "unused slots must be untouched"


@pytest.mark.gpu
def test_teeth():
    """One channel's gate changed (dt_bias of channel 17 of head 2, Kimi's gate: decay -> ~0) must move that head's
    state beyond the tolerance, and only that head's: the per-channel decay reaches the kernel's columns."""
    dev = cuda()
    H, K, V = GEOMETRIES["kimi_k3_tp8"]
    gen = torch.Generator().manual_seed(5)
    A_log, dt_bias = make_params(H, K, gen)
    q, k, v, f, b = make_inputs(2, H, K, V, torch.bfloat16, gen)
    ref = torch.randn(2, H, K, V, generator=gen) * 0.1
    sbi = torch.tensor([0, 1], dtype=torch.int32)
    st = ref.transpose(2, 3).contiguous().to(dev)
    kref.conventional_step(ref, q, k, v, f, b, A_log, dt_bias, sbi)
    bad = dt_bias.clone()
    bad[2, 17] = 20.0
    kda_conventional_step_vk(*(t.to(dev) for t in (q, k, v, f, b, A_log, bad)), st, sbi.to(dev))
    got = st.cpu().transpose(2, 3)
    assert rel(got[:, 2], ref[:, 2]) > 10 * F32_TOL
    assert rel(got[:, 3], ref[:, 3]) < F32_TOL


REPLAY_CASES = [  # (name, (H, K, V), act, L, batch, slots, gate lower bound, l2norm)
    ("kimi_k3_tp8", GEOMETRIES["kimi_k3_tp8"], torch.bfloat16, 16, 3, 6, None, True),
    ("glm5_3_flash_tp8", GEOMETRIES["glm5_3_flash_tp8"], torch.bfloat16, 16, 5, 9, -5.0, True),
    ("kimi_k3_tp8_b40", GEOMETRIES["kimi_k3_tp8"], torch.bfloat16, 8, 40, 50, None, True),  # the large-batch plan
    ("odd_f32_k64_v256_L4", (3, 64, 256), torch.float32, 4, 4, 7, None, True),
    ("odd_f16_nonorm_k256_v64_L5", (5, 256, 64), torch.float16, 5, 4, 7, -3.0, False),
]
REPLAY_SHAPED = [(REPLAY_CASES[0], None), (REPLAY_CASES[1], None), (REPLAY_CASES[2], None), (REPLAY_CASES[3], None),
                 (REPLAY_CASES[4], None), (REPLAY_CASES[2], (4, 8, 512))]  # + GDN's R64 W8 at 2 blocks an SM


@pytest.mark.gpu
@pytest.mark.parametrize("case, shape", REPLAY_SHAPED,
                         ids=[c[0] + ("" if s is None else "-rt{}w{}r{}".format(*s)) for c, s in REPLAY_SHAPED])
def test_replay_against_reference(case, shape):
    """3L + 2 steps of the (V, K) standard decode step against the float64 reference on the (K, V) buffers (fp32 u
    ring with the u_j the steps would have written: the flush sums them), rows flushing at different steps."""
    dev = cuda()
    _, (H, K, V), act, L, batch, slots, lb, l2 = case
    gen = torch.Generator().manual_seed(41)
    A_log, dt_bias = make_params(H, K, gen)
    ref = make_buffers(slots, H, K, V, L, act, gen, l2)
    cursor = torch.randint(0, L, (slots,), generator=gen, dtype=torch.int32)
    written_u(ref, cursor, l2)
    sbi = _sbi(batch, slots, gen)
    gpu = to_dev(ref, dev)
    st = ref.state.transpose(2, 3).contiguous().to(dev)  # the kernel's (V, K)
    rings = (gpu.k_cache, gpu.u_cache, gpu.g_cache, gpu.v_cache, gpu.beta_cache)
    cur = cursor.to(dev)
    unused = [s for s in range(slots) if s not in sbi.tolist()]
    before = [t[unused].clone() for t in (st, *rings)]
    flushed = 0
    pins = {} if shape is None else dict(rt=shape[0], warps=shape[1], resident=shape[2])
    for step in range(3 * L + 2):
        q, k, v, f, b = make_inputs(batch, H, K, V, act, gen, l2)
        flushed += int(((cursor[sbi[sbi >= 0].long()] + 1) == L).sum())
        y_ref = kref.replay_decode(ref, cursor, q, k, v, f, b, A_log, dt_bias, sbi, use_qk_l2norm=l2, lower_bound=lb)
        ref_advance(cursor, sbi, L)
        out = torch.full((batch, H, V), float("nan"), dtype=act, device=dev)
        with gdn_override(**pins):
            kda_replay_decode_vk(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), st, *rings, cur, sbi.to(dev),
                                 out=out, use_qk_l2norm=l2, lower_bound=lb)
        kops.advance_cursor(cur, sbi.to(dev), gpu.u_cache)
        live = sbi >= 0
        y = out.cpu()
        assert torch.isnan(y[~live]).all(), "padding rows' y must stay untouched (NaN poison)"
        assert rel(y[live], y_ref[live]) < Y_TOL[act], f"step {step}: y rel {rel(y[live], y_ref[live])}"
        assert torch.equal(cur.cpu(), cursor)
        assert torch.equal(gpu.k_cache.cpu(), ref.k_cache), f"step {step}: k ring must be the raw inputs, exactly"
        assert torch.equal(gpu.v_cache.cpu(), ref.v_cache), f"step {step}: v ring must be the inputs, exactly"
        assert rel(gpu.g_cache.cpu(), ref.g_cache) < F32_TOL
        assert rel(gpu.beta_cache.cpu(), ref.beta_cache) < F32_TOL
        assert rel(gpu.u_cache.cpu(), ref.u_cache) < F32_TOL
        got = st.cpu().transpose(2, 3)
        assert rel(got, ref.state) < F32_TOL, f"step {step}: state rel {rel(got, ref.state)}"
    assert flushed >= 2, "the case must flush"
    for b0, a0 in zip(before, [t[unused] for t in (st, *rings)]):
        assert torch.equal(b0, a0), "unused slots must be untouched"


@pytest.mark.gpu
def test_replay_flush_folds_the_stored_u():
    """The (V, K) flush reads the stored fp32 u_j (the u-sum, as the (K, V) fp32 flush): one u_j changed before a
    flush moves the checkpoint to the reference's u-sum over the changed ring followed by this token's step, and
    that head's only."""
    dev = cuda()
    H, K, V = GEOMETRIES["kimi_k3_tp8"]
    L, slots, s, r, h, j, col = 4, 3, 2, 1, 3, 1, 7
    gen = torch.Generator().manual_seed(29)
    A_log, dt_bias = make_params(H, K, gen)
    ref = make_buffers(slots, H, K, V, L, torch.bfloat16, gen, True)
    cursor = torch.full((slots,), L - 1, dtype=torch.int32)  # every row flushes
    written_u(ref, cursor)
    ref.u_cache[s, h, j, col] += 0.5
    sbi = torch.tensor([0, s], dtype=torch.int32)
    gpu = to_dev(ref, dev)
    st = ref.state.transpose(2, 3).contiguous().to(dev)
    q, k, v, f, b = make_inputs(2, H, K, V, torch.bfloat16, gen)
    S_usum, y_usum = usum_expected(ref, s, r, q, k, v, f, b, A_log, dt_bias)
    y = kda_replay_decode_vk(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), st, gpu.k_cache, gpu.u_cache,
                             gpu.g_cache, gpu.v_cache, gpu.beta_cache, cursor.to(dev), sbi.to(dev)).cpu()
    kref.replay_decode(ref, cursor, q, k, v, f, b, A_log, dt_bias, sbi)  # the refold: the unchanged ring's state
    got = st.cpu().transpose(2, 3)[s].to(F64)
    assert rel(S_usum[h], ref.state[s, h].to(F64)) > 100 * F32_TOL, "the change must be visible"
    assert rel(got, S_usum) < F32_TOL, f"checkpoint rel err {rel(got, S_usum):.2e} vs the u-sum"
    assert rel(got[h + 1:], ref.state[s, h + 1:].to(F64)) < F32_TOL, "other heads: the refold's state"
    assert rel(y[r], y_usum) < Y_TOL[torch.bfloat16]


@pytest.mark.gpu
def test_replay_bad_cursor_gives_nan_and_writes_nothing():
    dev = cuda()
    H, K, V, L = 2, 64, 64, 4
    gen = torch.Generator().manual_seed(5)
    A_log, dt_bias = make_params(H, K, gen)
    buf = to_dev(make_buffers(2, H, K, V, L, torch.bfloat16, gen), dev)
    st = buf.state.transpose(2, 3).contiguous()
    rings = (buf.k_cache, buf.u_cache, buf.g_cache, buf.v_cache, buf.beta_cache)
    before = [t.clone() for t in (st, *rings)]
    cursor = torch.tensor([L, 0], dtype=torch.int32, device=dev)
    q, k, v, f, b = make_inputs(1, H, K, V, torch.bfloat16, gen)
    y = kda_replay_decode_vk(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), st, *rings, cursor,
                             torch.tensor([0], dtype=torch.int32, device=dev), check_values=False)
    assert torch.isnan(y).all()
    for b0, a0 in zip(before, (st, *rings)):
        assert torch.equal(b0, a0)
