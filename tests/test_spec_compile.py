# SPDX-License-Identifier: Apache-2.0
"""Speculative-decoding module (plugins/mamba2/replayssm_spec.cu) on the CPU: NVRTC compiles, keys, the
static shared memory mirror, the launch geometry table, and launcher validation before any CUDA use.

The compile matrix is a table: every (T, L >= 2T) on the main geometry, every state x activation
dtype on every named geometry at T=4, L=16, then gate, small-batch geometry and T=1 rows, then the
shadow variants (bf16, fp8-e4m3: every geometry at two (T, L, gate) rows, small batch, other
activation dtypes); all for sm_90 and sm_100.
"""

import itertools
import re

import pytest
import torch

from trtllm_replayssm import compile as cc
from trtllm_replayssm import cursor_ops
from trtllm_replayssm.config import (
    SMEM_LIMIT,
    SUPPORTED_DSTATE,
    SUPPORTED_HEADDIM,
    SUPPORTED_NUM_TOKENS,
    KernelSpec,
    plan_spec,
    spec_smem_bytes,
)
from trtllm_replayssm.families.mamba2 import ops

ARCHS = (90, 100)
MAIN = (128, 64, 128, 8)
GEOMS = [MAIN, (128, 80, 128, 8), (256, 64, 256, 8), (4, 64, 64, 2)]
TL = [(T, L) for T in (2, 4, 6, 8) for L in (8, 16, 32) if L >= 2 * T]


def _spec(state="f32", act="bf16", geom=MAIN, T=4, L=16, batch=256, has_z=False, arch=90, shadow="none"):
    H, P, N, G = geom
    rows, warps = plan_spec(state, act, H, P, N, L, T, batch, has_z)
    return KernelSpec(state, act, H, P, N, G, L, rows, warps, has_z, arch, shadow=shadow, num_tokens=T)


MATRIX = (
    [_spec(T=T, L=L, arch=a) for (T, L), a in itertools.product(TL, ARCHS)]
    + [_spec(s, act, g, arch=a) for s, act, g, a in itertools.product(("f32", "bf16"), ("bf16", "f16", "f32"), GEOMS, ARCHS)]
    + [_spec(T=T, L=L, has_z=True, arch=a) for (T, L), a in itertools.product(((2, 8), (8, 32)), ARCHS)]
    + [_spec(geom=g, batch=1, arch=a) for g, a in itertools.product(GEOMS[:3], ARCHS)]
    + [_spec(geom=GEOMS[3], T=1, L=4, arch=a) for a in ARCHS]
    # the module cursor_ops.spec_commit loads (any spec with this (T, L) carries the commit kernel)
    + [KernelSpec("f32", "f32", 1, 8, 128, 1, L, 8, 1, False, a, num_tokens=T)
       for (T, L), a in itertools.product(((1, 2), (8, 16)), ARCHS)]
)
SHADOW = (
    [_spec(geom=g, T=T, L=L, has_z=z, arch=a, shadow=sh)
     for sh, g, (T, L, z), a in itertools.product(("bf16", "fp8"), GEOMS[:3], ((4, 16, False), (8, 32, True)), ARCHS)]
    + [_spec(batch=1, arch=a, shadow=sh) for sh, a in itertools.product(("bf16", "fp8"), ARCHS)]
    + [_spec(geom=(128, 80, 256, 8), batch=1, shadow="fp8")]  # 10 rows a block: fp8 scales read one by one
    + [_spec(act=act, geom=GEOMS[3], T=2, L=8, shadow=sh) for sh, act in itertools.product(("bf16", "fp8"), ("f16", "f32"))]
)


@pytest.mark.parametrize("spec", MATRIX + SHADOW, ids=lambda s: s.key)
def test_compiles_to_ptx(spec):
    ptx = cc.compile_spec(spec, "ptx").decode()
    assert f".target sm_{spec.arch}" in ptx
    for name in cc.SPEC_KERNEL_NAMES:
        assert re.search(rf"\.entry {name}\(", ptx), name
    # The verify kernel's static shared memory is what config.spec_smem_bytes says (the geometry table's mirror).
    smem = re.search(r"\.shared \.align 16 \.b8 \w*spec_verify\w*\[(\d+)\]", ptx)
    assert int(smem.group(1)) == spec_smem_bytes(spec.act, spec.rows, spec.dstate, spec.buffer_len, spec.num_tokens,
                                                 spec.has_z)


def _params(ptx, name):
    body = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S).group(1)
    return re.findall(r"\.param \.(u64|u32|b32|s32)", body)


@pytest.mark.parametrize("has_z", [False, True])
def test_parameter_lists_are_tensorrt_order(has_z):
    """Inputs (pointers), int32 batch and slots, outputs (pointers; aliased ones repeat their inputs)."""
    ptx = cc.compile_spec(_spec(has_z=has_z), "ptx").decode()
    z = int(has_z)
    assert _params(ptx, "replayssm_verify") == ["u64"] * (13 + z) + ["u32"] * 2 + ["u64"] * 5
    assert _params(ptx, "replayssm_spec_commit") == ["u64"] * 3 + ["u32"] * 2 + ["u64"]  # cursor in, cursor out
    assert _params(ptx, "replayssm_native_verify") == ["u64"] * (9 + z) + ["u32"] * 2 + ["u64"] * 2
    assert _params(ptx, "replayssm_native_commit") == ["u64"] * 2 + ["u32"] * 2 + ["u64"] * 2


@pytest.mark.parametrize("shadow", ["bf16", "fp8"])
def test_verify_shadow_parameters_follow_the_rings(shadow):
    """As replayssm_decode: shadow and scales after dt_cache among the inputs and after dt_cache_out among
    the outputs; the other entry points of the module keep their lists."""
    spec = _spec(shadow=shadow)
    assert spec.key == f"replayssm_s-f32_a-bf16_H128_P64_N128_G8_L16_R64_W8_z0_sh-{shadow}_sm90_T4"
    ptx = cc.compile_spec(spec, "ptx").decode()
    assert _params(ptx, "replayssm_verify") == ["u64"] * (13 + 2) + ["u32"] * 2 + ["u64"] * (5 + 2)
    assert _params(ptx, "replayssm_spec_commit") == ["u64"] * 3 + ["u32"] * 2 + ["u64"]  # sbi, n, cursor_in; cursor_out
    assert _params(ptx, "replayssm_native_verify") == ["u64"] * 9 + ["u32"] * 2 + ["u64"] * 2


def test_keys_and_entry_files():
    spec = _spec()
    assert spec.key == "replayssm_s-f32_a-bf16_H128_P64_N128_G8_L16_R64_W8_z0_sm90_T4"
    assert cc.entry_file(spec) == "mamba2/replayssm_spec.cu" and cc.kernel_names(spec) == cc.SPEC_KERNEL_NAMES
    assert "constexpr int kT = 4;" in cc.prelude(spec)
    std = KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 8)  # num_tokens = 0: the standard module, key unchanged
    assert std.key == "replayssm_s-f32_a-bf16_H128_P64_N128_G8_L16_R64_W8_z0_sm90"
    assert cc.entry_file(std) == "mamba2/replayssm_decode.cu" and cc.kernel_names(std) == cc.KERNEL_NAMES
    assert "kT" not in cc.prelude(std)


@pytest.mark.parametrize("bad, match", [
    (dict(num_tokens=3), r"num_tokens: expected 0 \(standard decode\) or one of \(1, 2, 4, 6, 8\), got 3"),
    (dict(num_tokens=-1), "num_tokens"),
    (dict(num_tokens=8, buffer_len=8), r"buffer_len=8: expected >= 2 \* num_tokens = 16"),
    (dict(headdim=80, rows=5, warps=5), r"rows=5: x rows of a block must be a multiple of 4 bytes"),
    (dict(act="f32", dstate=256, buffer_len=32, num_tokens=8, rows=64, warps=16), r"rows=64: verify needs \d+ bytes"),
])
def test_bad_spec_modules_rejected(bad, match):
    base = dict(state="f32", act="bf16", nheads=128, headdim=64, dstate=128, ngroups=8, buffer_len=16, rows=64, warps=8,
                num_tokens=4)
    with pytest.raises(ValueError, match=match):
        KernelSpec(**{**base, **bad})


def test_plan_spec_covers_every_supported_shape():
    """Every supported (headdim, dstate, dtypes, T, L >= 2T, gate, batch) gets a valid geometry within
    static shared memory (KernelSpec validates it)."""
    for P, N, s, a, T, L, z, batch in itertools.product(SUPPORTED_HEADDIM, SUPPORTED_DSTATE, ("f32", "bf16", "f16"),
                                                        ("bf16", "f16", "f32"), SUPPORTED_NUM_TOKENS, (4, 8, 16, 32),
                                                        (False, True), (1, 256)):
        if L < 2 * T:
            continue
        rows, warps = plan_spec(s, a, 128, P, N, L, T, batch, z)
        KernelSpec(s, a, 128, P, N, 8, L, rows, warps, z, 90, num_tokens=T)
        assert spec_smem_bytes(a, rows, N, L, T, z) <= SMEM_LIMIT


# ---- launcher validation on CPU tensors (checks run before the device check) ----------------------------
H, P, N, G, L, T, S, BATCH = 4, 64, 64, 2, 16, 4, 5, 3
BF = torch.bfloat16


def good(**over):
    t = dict(
        x=torch.zeros(BATCH, T, H, P, dtype=BF), B=torch.zeros(BATCH, T, G, N, dtype=BF),
        C=torch.zeros(BATCH, T, G, N, dtype=BF), dt=torch.zeros(BATCH, T, H, dtype=BF),
        dt_bias=torch.zeros(H), A=-torch.ones(H), D=torch.ones(H), state=torch.zeros(S, H, P, N),
        x_cache=torch.zeros(S, H, L, P, dtype=BF), B_cache=torch.zeros(S, G, L, N, dtype=BF), dt_cache=torch.zeros(S, H, L),
        cursor=torch.zeros(S, 2, dtype=torch.int32), state_batch_indices=torch.arange(BATCH, dtype=torch.int32),
    )
    t.update(over)
    return t


VERIFY_CASES = [
    (dict(x=torch.zeros(BATCH, T, H, P, dtype=torch.float64)), TypeError, r"x: expected dtype bfloat16 or float16 or float32"),
    (dict(x=torch.zeros(BATCH, H, P, dtype=BF)), ValueError, r"x: expected a \(batch, T, nheads, headdim\) tensor"),
    (dict(x=torch.zeros(BATCH, 3, H, P, dtype=BF)), ValueError,
     r"x: expected T = 1 \+ num_draft \(dim 1\) in \(1, 2, 4, 6, 8\), got 3"),
    (dict(B=torch.zeros(BATCH, T, G, N, dtype=torch.float16)), TypeError, r"B: expected dtype bfloat16, got float16"),
    (dict(B=torch.zeros(BATCH, T, 3, N, dtype=BF)), ValueError, r"B: ngroups=3 must divide nheads=4"),
    (dict(C=torch.zeros(BATCH, T + 1, G, N, dtype=BF)), ValueError, r"C: expected shape \(3, 4, 2, 64\), got \(3, 5, 2, 64\)"),
    (dict(dt=torch.zeros(BATCH, H, dtype=BF)), ValueError, r"dt: expected shape \(3, 4, 4\)"),
    (dict(z=torch.zeros(BATCH, T, H, P + 1, dtype=BF)), ValueError, r"z: expected shape \(3, 4, 4, 64\)"),
    (dict(A=-torch.ones(H, dtype=torch.float64)), TypeError, r"A: expected dtype float32"),
    (dict(state=torch.zeros(S, H, N, P).transpose(2, 3)), ValueError, r"state: expected a contiguous tensor"),
    (dict(x_cache=torch.zeros(S, H, 6, P, dtype=BF)), ValueError,
     r"x_cache: buffer_len \(dim 2\): expected in \[2T, 32\] = \[8, 32\] \(flush one window early, T=4\), got 6"),
    (dict(B_cache=torch.zeros(S, G, L + 1, N, dtype=BF)), ValueError, r"B_cache: expected shape \(5, 2, 16, 64\)"),
    (dict(dt_cache=torch.zeros(S, H, L, dtype=BF)), TypeError, r"dt_cache: expected dtype float32"),
    (dict(cursor=torch.zeros(S, dtype=torch.int32)), ValueError, r"cursor: expected shape \(5, 2\), got \(5,\)"),
    (dict(cursor=torch.zeros(S, 2, dtype=torch.int64)), TypeError, r"cursor: expected dtype int32"),
    (dict(state_batch_indices=torch.arange(BATCH)), TypeError, r"state_batch_indices: expected dtype int32"),
    (dict(out=torch.zeros(BATCH, T, H, P)), TypeError, r"out: expected dtype bfloat16"),
    (dict(shadow=torch.zeros(S, H, P, N, dtype=torch.float16)), TypeError,
     r"shadow: expected dtype bfloat16 or float8_e4m3fn, got float16"),
    (dict(shadow=torch.zeros(S, H, P, N - 1, dtype=BF)), ValueError, r"shadow: expected shape \(5, 4, 64, 64\)"),
    (dict(shadow=torch.zeros(S, H, P, N, dtype=torch.float8_e4m3fn)), ValueError,
     r"shadow_scale: an fp8 shadow needs its \(slots, nheads, headdim\) float32 row scales"),
    (dict(shadow=torch.zeros(S, H, P, N, dtype=torch.float8_e4m3fn), shadow_scale=torch.ones(S, H, P + 1)), ValueError,
     r"shadow_scale: expected shape \(5, 4, 64\)"),
    (dict(shadow=torch.zeros(S, H, P, N, dtype=BF), shadow_scale=torch.ones(S, H, P)), ValueError,
     r"shadow_scale: only an fp8 shadow has row scales"),
    (dict(shadow_scale=torch.ones(S, H, P)), ValueError, r"shadow_scale: given without a shadow"),
    (dict(state=torch.zeros(S, H, P, N, dtype=BF), shadow=torch.zeros(S, H, P, N, dtype=BF)), TypeError,
     r"state: a shadow needs a float32 checkpoint, got bfloat16"),
    (dict(shadow=torch.zeros(S, H, P, N, dtype=torch.float8_e4m3fn), shadow_scale=torch.ones(S, H, P)), ValueError,
     r"x: expected CUDA tensors, got device cpu"),
    ({}, ValueError, r"x: expected CUDA tensors, got device cpu"),
]


@pytest.mark.parametrize("over, exc, match", VERIFY_CASES, ids=[c[2][:40] for c in VERIFY_CASES])
def test_replay_verify_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        ops.replay_verify(**good(**over))


def test_spec_commit_rejects():
    cursor, n = torch.zeros(S, 2, dtype=torch.int32), torch.ones(BATCH, dtype=torch.int32)
    sbi = torch.arange(BATCH, dtype=torch.int32)
    cases = [
        (dict(num_tokens=3), r"num_tokens: expected one of \(1, 2, 4, 6, 8\), got 3"),
        (dict(buffer_len=7), r"buffer_len: expected in \[2T, 32\] = \[8, 32\]"),
        (dict(cursor=torch.zeros(S, dtype=torch.int32)), r"cursor: expected shape \(slots, 2\), got \(5,\)"),
        (dict(n_accepted=torch.ones(BATCH)), r"n_accepted: expected dtype int32"),
        (dict(n_accepted=torch.ones(BATCH + 1, dtype=torch.int32)), r"n_accepted: expected shape \(3,\)"),
        ({}, r"cursor: expected CUDA tensors, got device cpu"),
    ]
    for over, match in cases:
        kw = {**dict(cursor=cursor, n_accepted=n, state_batch_indices=sbi, num_tokens=T, buffer_len=L), **over}
        with pytest.raises((ValueError, TypeError), match=match):
            cursor_ops.spec_commit(**kw)


def test_native_spec_rejects():
    t = good()
    for k in ("x_cache", "B_cache", "dt_cache", "cursor"):
        t.pop(k)
    snaps = torch.zeros(S, T, H, P, N)
    with pytest.raises(ValueError, match=r"snapshots: expected shape \(5, 4, 4, 64, 64\), got \(5, 5, 4, 64, 64\)"):
        ops.native_spec_verify(**t, snapshots=torch.zeros(S, T + 1, H, P, N))
    with pytest.raises(TypeError, match=r"snapshots: expected dtype float32, got bfloat16"):
        ops.native_spec_verify(**t, snapshots=snaps.to(BF))
    with pytest.raises(ValueError, match="x: expected CUDA tensors"):
        ops.native_spec_verify(**t, snapshots=snaps)
    sbi, n = torch.arange(BATCH, dtype=torch.int32), torch.ones(BATCH, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"snapshots: expected a \(slots, T, nheads, headdim, dstate\) tensor"):
        cursor_ops.native_spec_commit(t["state"], snaps[:, 0], n, sbi)
    with pytest.raises(ValueError, match=r"n_accepted: expected shape \(3,\)"):
        cursor_ops.native_spec_commit(t["state"], snaps, n[:2], sbi)
    with pytest.raises(ValueError, match="state: expected CUDA tensors"):
        cursor_ops.native_spec_commit(t["state"], snaps, n, sbi)


def test_host_value_checks():
    sbi = torch.tensor([2, -1, 0], dtype=torch.int32)
    cursor = torch.tensor([[0, 0], [16, 0], [3, 12], [0, 0], [0, 0]], dtype=torch.int32)  # slot 1 unused
    ops.check_spec_values(sbi, S, T, cursor, L)
    cursor[2, 1] = L - T + 1
    with pytest.raises(ValueError, match=r"cursor: expected count \(column 1\) in \[0, L - T\] = \[0, 12\] .* got \[13\]"):
        ops.check_spec_values(sbi, S, T, cursor, L)
    cursor[2] = torch.tensor([-1, 0])
    with pytest.raises(ValueError, match=r"cursor: expected start \(column 0\) in \[0, 16\) .* got \[-1\]"):
        ops.check_spec_values(sbi, S, T, cursor, L)
    n = torch.tensor([T, 99, 0], dtype=torch.int32)  # the padding row's value is ignored
    ops.check_spec_values(sbi, S, T, n_accepted=n)
    n[2] = -1
    with pytest.raises(ValueError, match=r"n_accepted: expected values in \[0, T\] = \[0, 4\] .* got \[-1\]"):
        ops.check_spec_values(sbi, S, T, n_accepted=n)
    with pytest.raises(ValueError, match="more than one row"):
        ops.check_spec_values(torch.tensor([1, 1], dtype=torch.int32), S, T)


def test_custom_ops_fake_shapes():
    """torch.compile / export see the ops with their fake implementations (no kernel runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = {k: torch.empty_like(v) for k, v in good().items()}
        y = torch.ops.trtllm_replayssm.replay_verify(**t)
        y_sh = torch.ops.trtllm_replayssm.replay_verify(**t, shadow=torch.empty(S, H, P, N, dtype=torch.float8_e4m3fn),
                                                         shadow_scale=torch.empty(S, H, P))
        snaps = torch.empty(S, T, H, P, N)
        y2 = torch.ops.trtllm_replayssm.native_spec_verify(
            *(t[k] for k in ("x", "B", "C", "dt", "dt_bias", "A", "D", "state")), snaps, t["state_batch_indices"])
        n = torch.empty(BATCH, dtype=torch.int32)
        torch.ops.trtllm_replayssm.spec_commit(t["cursor"], n, t["state_batch_indices"], T, L)
        torch.ops.trtllm_replayssm.native_spec_commit(t["state"], snaps, n, t["state_batch_indices"])
    assert y.shape == y2.shape == y_sh.shape == (BATCH, T, H, P)
