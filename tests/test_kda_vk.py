# SPDX-License-Identifier: Apache-2.0
"""KDA's conventional step on a (V, K) state (plugins/kda/kda_vk.cu; the layout experiment of bench/NOTES.md "KDA in
GDN's row layout"): it compiles for sm_90 / sm_100 at the planner's shapes with both gates, keeps TensorRT's
parameter order, rejects bad input by name, and on a GPU matches the float64 reference
(trtllm_replayssm/families/kda/reference.py, on the transposed state) step after step, with padding rows' y left
as poisoned and unused slots bit for bit unchanged. Tolerances as tests/test_kda_gpu.py's conventional test (the
same arithmetic in another order): y by the act dtype, state 1e-4 over 4 steps."""

import itertools
import re

import pytest
import torch

from tests.test_kda_gpu import F32_TOL, Y_TOL, _sbi, cuda, make_inputs, make_params, rel
from trtllm_replayssm import compile as cc
from trtllm_replayssm.families.kda import GEOMETRIES
from trtllm_replayssm.families.kda import reference as kref
from trtllm_replayssm.families.kda.config import KDAVKSpec, kda_vk_spec
from trtllm_replayssm.families.kda.vk import kda_conventional_step_vk

SPECS = [kda_vk_spec(act, H, K, V, batch, lower_bound=lb, arch=arch)
         for (H, K, V), batch, lb, arch, act in itertools.product(
             sorted(set(GEOMETRIES.values())), (1, 32, 256), (None, -5.0), (90, 100), ("bf16",))]
SPECS += [kda_vk_spec(act, 3, K, V, 5, l2norm=l2, scale=sc, arch=90)
          for act, (K, V), l2, sc in (("f32", (64, 256), True, None), ("f16", (256, 64), False, 0.125))]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key)
def test_compiles_to_ptx(spec):
    ptx = cc.compile_spec(spec, "ptx").decode()
    assert f".target sm_{spec.arch}" in ptx
    params = re.search(r"\.entry kda_conventional_vk\((.*?)\)", ptx, re.S).group(1)
    assert re.findall(r"\.param \.(u64|u32|b32|s32)", params) == ["u64"] * 9 + ["u32"] * 2 + ["u64"] * 2
    assert "__local_depot" not in ptx, "a register array went to local memory"
    assert ("#define KDA_LOWER_BOUND 1" in cc.source(spec)) == (spec.lower_bound is not None)


def test_spec_rejects():
    with pytest.raises(ValueError, match="lower_bound"):
        KDAVKSpec("bf16", 12, 128, 128, 32, 4, lower_bound=1.0)
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
