# SPDX-License-Identifier: Apache-2.0
"""8-bit checkpoint (issue 38) on the CPU: the module compiles for sm_90 / sm_100, the spec and planner rules, the
launcher's checks (each error names its argument), and the bytes / memory model."""

import importlib.util
import pathlib

import pytest
import torch

from trtllm_replayssm import compile as cc
from trtllm_replayssm import config, costs
from trtllm_replayssm.config import KernelSpec, Variant
from trtllm_replayssm.families.mamba2 import ops

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _spec(arch, act="bf16", has_z=False, batch=64, copy="async"):
    rows, warps, var = config.plan("fp8", act, 128, 64, 128, 16, batch)
    return KernelSpec("fp8", act, 128, 64, 128, 8, 16, rows, warps, has_z, arch,
                      variant=Variant(var.kind, var.min_blocks, var.flush_rows, copy))


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("act,has_z,batch,copy", [("bf16", False, 64, "async"), ("f16", True, 1, "async"),
                                                  ("bf16", False, 256, "bulk")])
def test_ckpt8_module_compiles(arch, act, has_z, batch, copy):
    spec = _spec(arch, act, has_z, batch, copy)
    ptx = cc._nvrtc_compile(cc.source(spec), spec.key, cc.options(spec, "ptx"), "ptx").decode()
    for name in cc.KERNEL_NAMES:
        assert f".entry {name}(" in ptx
    assert "#define RSSM_CKPT8 1" in cc.prelude(spec) and "_s-fp8_" in spec.key


def test_ckpt8_plan_is_the_fp8_shadows():
    for batch in (1, 8, 64, 256):
        assert config.plan("fp8", "bf16", 128, 64, 128, 16, batch) == config.plan("f32", "bf16", 128, 64, 128, 16, batch,
                                                                                  shadow="fp8")
    with pytest.raises(ValueError, match="conventional"):
        config.plan("fp8", "bf16", 128, 64, 128, 16, 8, conventional=True)
    with config.override_variant(kind="persistent"), pytest.raises(ValueError, match="staged"):
        config.plan("fp8", "bf16", 128, 64, 128, 16, 8)


@pytest.mark.parametrize("kw,match", [
    (dict(variant=Variant("one_shot")), "staged"),
    (dict(variant=Variant("staged"), shadow="fp8"), "own fp8 read copy"),
    (dict(variant=Variant("staged"), num_tokens=2), "standard decode"),
])
def test_ckpt8_spec_rules(kw, match):
    with pytest.raises(ValueError, match=match):
        KernelSpec("fp8", "bf16", 8, 64, 128, 2, 16, 64, 4, **kw)
    with pytest.raises(ValueError, match="act"):
        KernelSpec("bf16", "fp8", 8, 64, 128, 2, 16, 64, 4)


def _decode_args(slots=3, H=4, P=64, N=128, G=2, L=8, batch=2):
    z = torch.zeros
    return dict(x=z(batch, H, P, dtype=torch.bfloat16), B=z(batch, G, N, dtype=torch.bfloat16),
                C=z(batch, G, N, dtype=torch.bfloat16), dt=z(batch, H, dtype=torch.bfloat16), dt_bias=z(H), A=z(H), D=z(H),
                state=z(slots, H, P, N, dtype=torch.float8_e4m3fn), x_cache=z(slots, H, L, P, dtype=torch.bfloat16),
                B_cache=z(slots, G, L, N, dtype=torch.bfloat16), dt_cache=z(slots, H, L),
                cursor=z(slots, dtype=torch.int32), state_batch_indices=torch.tensor([0, -1], dtype=torch.int32),
                ckpt_scale=torch.ones(slots, H, P), ckpt_flushes=z(slots, dtype=torch.int32))


@pytest.mark.parametrize("change,err,match", [
    (dict(ckpt_scale=None), ValueError, "ckpt_scale"),
    (dict(ckpt_flushes=None), ValueError, "ckpt_flushes"),
    (dict(ckpt_scale=torch.ones(3, 4, 64, dtype=torch.float16)), TypeError, "ckpt_scale"),
    (dict(ckpt_scale=torch.ones(3, 4, 32)), ValueError, "ckpt_scale"),
    (dict(ckpt_flushes=torch.zeros(4, dtype=torch.int32)), ValueError, "ckpt_flushes"),
    (dict(ckpt_seed=2 ** 31), TypeError, "ckpt_seed"),
    (dict(shadow=torch.zeros(3, 4, 64, 128, dtype=torch.bfloat16)), ValueError, "shadow"),
    (dict(state=torch.zeros(3, 4, 64, 128)), ValueError, "ckpt_scale / ckpt_flushes"),
])
def test_ckpt8_launcher_checks(change, err, match):
    args = {**_decode_args(), **change}
    with pytest.raises(err, match=match):
        ops.replay_decode(**args)


def test_ckpt8_has_no_conventional_step():
    a = _decode_args()
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        ops.conventional_step(a["x"], a["B"], a["C"], a["dt"], a["dt_bias"], a["A"], a["D"], a["state"],
                              a["state_batch_indices"])


def test_ckpt8_bytes_and_memory():
    H, P, N, G, L = 128, 64, 128, 8, 16
    assert costs.mamba2_state_bytes(H, P, N, 1) == H * P * N + 4 * H * P  # e4m3 + one fp32 scale per row
    _, per_k = costs.mamba2_bytes_per_position(H, P, N, G, L, state_bytes=1)
    _, per_k_sh = costs.mamba2_bytes_per_position(H, P, N, G, L, state_bytes=4, shadow="fp8")
    assert per_k[1] == per_k_sh[1]  # a non-flush step reads the same bytes as the fp8 shadow
    # The flush reads and writes the 8-bit rows (2 R) where the shadow's moves the fp32 ones and rewrites the shadow.
    R = H * P * (N + 4)
    assert per_k[L] == per_k_sh[L] - (2 * H * P * N * 4 + R) + 2 * R
    assert costs.gdn_state_bytes(32, 128, 128, 1) == 32 * 128 * (128 + 4)
    spec = importlib.util.spec_from_file_location("memory_table", ROOT / "scripts" / "memory_table.py")
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    rows = {(r["model"], r["checkpoint"]): r for r in mt.checkpoint_rows()}
    r32, r8 = rows["nemotron_h_8b", "fp32"], rows["nemotron_h_8b", "fp8 ckpt"]
    layer = 24 * (H * P * (N + 4) + L * (H * P + G * N) * 2 + H * L * 4 + (H * P + 2 * G * N) * 3 * 2) + 8
    assert r8["bytes_per_request"] == layer and r8["requests_per_80GB"] == 80 * 10 ** 9 // layer
    assert r32["bytes_per_request"] - r8["bytes_per_request"] == 24 * H * P * (3 * N - 4)
    for m in mt.CKPT_MODELS:
        assert rows[m, "fp8 ckpt"]["requests_per_80GB"] > rows[m, "bf16"]["requests_per_80GB"] > rows[m, "fp32"][
            "requests_per_80GB"]
