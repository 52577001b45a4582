# SPDX-License-Identifier: Apache-2.0
"""Every Gated DeltaNet kernel variant compiles to PTX for sm_90 and sm_100 through NVRTC (no GPU needed).

The matrix crosses activation dtype x (V, K) x shadow at L=16 with the large-batch geometry of both
kernels, then buffer lengths, small-batch geometries, head ratios and the q/k options on the Qwen3-Next
shape, for both archs. A compile error fails with NVRTC's log and the spec key.
"""

import dataclasses
import itertools
import re

import pytest

from tests.test_compile import row_order_entries
from trtllm_replayssm import compile as cc
from trtllm_replayssm.families.gdn import config
from trtllm_replayssm.families.gdn.config import GDN_SUPPORTED_DIMS, GDNSpec, gdn_geometry, gdn_spec

ARCHS = (90, 100)

FULL = [
    gdn_spec(a, 32, 16, V, K, 16, 256, replay, sh, arch=arch)
    for a, V, K, (replay, sh), arch in itertools.product(
        ("bf16", "f16", "f32"), GDN_SUPPORTED_DIMS, GDN_SUPPORTED_DIMS, ((True, "none"), (True, "bf16"), (False, "none")),
        ARCHS)
]
EDGES = [
    gdn_spec("bf16", HV, H, 128, 128, L, batch, replay, sh, l2norm, scale, arch)
    for (HV, H), L, batch, (replay, sh), (l2norm, scale), arch in itertools.product(
        ((32, 16), (4, 2)), (1, 2, 8, 32), (1, 64), ((True, "none"), (True, "bf16")),
        ((True, None), (False, 0.125)), ARCHS)
]

# the flush-first row order (GDNSpec.row_order): the planned shadow modules (two passes at bs64) and fp32 ones
ROW_ORDER = [gdn_spec("bf16", HV, H, 128, 128, 16, batch, True, sh, arch=arch, row_order=True)
             for (HV, H), batch, sh, arch in itertools.product(((32, 16), (4, 2)), (1, 64, 256), ("none", "bf16"), ARCHS)]


@pytest.mark.parametrize("spec", FULL + EDGES + ROW_ORDER, ids=lambda s: s.key)
def test_compiles_to_ptx(spec):
    ptx = cc.compile_spec(spec, "ptx").decode()
    assert f".target sm_{spec.arch}" in ptx
    for name in config.GDN_KERNEL_NAMES:
        assert re.search(rf"\.entry {name}\(", ptx), name
    assert "__local_depot" not in ptx, "a register array went to local memory"


@pytest.mark.parametrize("shadow, n_sh", [("none", 0), ("bf16", 1)])
def test_parameter_lists_are_tensorrt_order(shadow, n_sh):
    """Replay: 9 step inputs + 6 in-place inputs (+ shadow), 2 int32 scalars, y + 6 aliased outputs (+ shadow).
    Conventional: 8 step inputs + state, 2 int32 scalars, y + state."""
    ptx = cc.compile_spec(gdn_spec("bf16", 32, 16, 128, 128, 16, 64, True, shadow), "ptx").decode()
    for name, want in (("gdn_replay_decode", ["u64"] * (15 + n_sh) + ["u32"] * 2 + ["u64"] * (7 + n_sh)),
                       ("gdn_conventional", ["u64"] * 9 + ["u32"] * 2 + ["u64"] * 2)):
        params = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S).group(1)
        assert re.findall(r"\.param \.(u64|u32|b32|s32)", params) == want, name


def test_row_order_module():
    """GDNSpec.row_order: its own key and macro, the same parameter list (input 8 read as (row, slot, cursor, 0) int4 rows
    by one 16-byte load), the standard decode module's option only; gdn_spec(row_order=True) is the planned module
    with it."""
    for batch, sh in ((1, "none"), (64, "bf16"), (256, "none")):
        planned = gdn_spec("bf16", 32, 16, 128, 128, 16, batch, True, sh)
        ro = gdn_spec("bf16", 32, 16, 128, 128, 16, batch, True, sh, row_order=True)
        assert ro == dataclasses.replace(planned, row_order=True) and ro.key == planned.key + "_ro"
    assert "#define GDN_ROW_ORDER 1" in ro.prelude() and "GDN_ROW_ORDER" not in planned.prelude()
    assert row_order_entries(planned, ro, "gdn_replay_decode")
    with pytest.raises(ValueError, match="row_order"):
        GDNSpec("bf16", 32, 16, 128, 128, 16, 64, 8, num_tokens=2, row_order=True)
    with pytest.raises(TypeError, match="row_order"):
        GDNSpec("bf16", 32, 16, 128, 128, 16, 64, 8, row_order=1)


def test_key_is_readable_and_mamba2_keys_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTLLM_REPLAYSSM_CACHE", str(tmp_path))
    spec = GDNSpec("bf16", 32, 16, 128, 128, 16, 64, 8)
    assert spec.key == "gdn_a-bf16_HV32_H16_V128_K128_L16_R64_W8_P32_n1_sm90"
    assert GDNSpec("bf16", 32, 16, 128, 128, 16, 64, 8, 16, "bf16", False, 0.125, 100).key == \
        "gdn_a-bf16_HV32_H16_V128_K128_L16_R64_W8_P16_n0_sh-bf16_sc0x1.0000000000000p-3_sm100"
    cc.compile_spec(spec, "ptx")
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith(spec.key)
    from trtllm_replayssm.config import KernelSpec

    mamba2 = KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 8)
    assert mamba2.key == "replayssm_s-f32_a-bf16_H128_P64_N128_G8_L16_R64_W8_z0_sm90"


def test_scale_is_compiled_exactly():
    default = cc.prelude(GDNSpec("bf16", 4, 2, 128, 128, 4, 32, 4))
    assert "constexpr float kScale = 0x1.6a09e60000000p-4f;" in default  # float32(128 ** -0.5)
    assert "constexpr float kScale = 0x1.0000000000000p-1f;" in cc.prelude(GDNSpec("bf16", 4, 2, 128, 128, 4, 32, 4, scale=0.5))


@pytest.mark.parametrize("bad, match", [
    (dict(act="f64"), "GDNSpec.act"),
    (dict(shadow="fp8"), "GDNSpec.shadow"),
    (dict(heads_k=3), "key heads"),
    (dict(V=80), "GDNSpec.V"),
    (dict(K=32), "GDNSpec.K"),
    (dict(buffer_len=33), "buffer_len"),
    (dict(rows=48), "rows"),
    (dict(rows=128, warps=4), "rows"),  # 32 rows per thread: more than lanes per row / 2
    (dict(rows=2, warps=1, lanes=32), "multiple of 4"),  # valid geometry, but u rows move as 16-byte vectors
    (dict(lanes=2), "lanes"),
    (dict(passes=3), "passes"),
    (dict(rows=128, passes=2, num_tokens=4), "one pass"),
])
def test_bad_specs_rejected(bad, match):
    base = dict(act="bf16", heads_v=32, heads_k=16, V=128, K=128, buffer_len=16, rows=64, warps=8)
    with pytest.raises(ValueError, match=match):
        GDNSpec(**{**base, **bad})


def test_geometry_table():
    """Large batches: 32 state elements per thread; 8-warp replay blocks with rows across 16 lanes (K=128)
    and 4-warp conventional blocks with rows across 32 lanes; small batches use fewer rows per thread;
    every choice is a valid spec."""
    assert gdn_geometry(128, 128, 32, 256, True) == (64, 8, 16)
    assert gdn_geometry(128, 128, 32, 256, False) == (32, 4, 32)
    assert gdn_geometry(128, 128, 32, 1, True)[0] < 64
    # Issue 40 (bench/NOTES.md): the standard-decode replay module keeps 4 rows per thread while its grid has at
    # least one block per SM (132); the verify module (num_tokens) keeps the full-wave rule.
    assert [gdn_geometry(128, 128, 32, b, True)[0] for b in (1, 2, 4, 8, 16, 32)] == [16, 32, 64, 64, 64, 64]
    assert [gdn_geometry(128, 128, 32, b, True, 4)[0] for b in (1, 8, 16, 32)] == [16, 16, 32, 64]
    for V, K, HV, batch, replay in itertools.product(GDN_SUPPORTED_DIMS, GDN_SUPPORTED_DIMS, (1, 4, 32, 64), (1, 3, 64, 512),
                                                     (True, False)):
        GDNSpec("bf16", HV, 1, V, K, 16, *gdn_geometry(V, K, HV, batch, replay))
        for shadow in ("none", "bf16"):
            gdn_spec("bf16", HV, 1, V, K, 16, batch, replay, shadow)  # every pass choice is a valid spec


def test_override_pins_the_replay_shape_and_register_budget():
    """config.override pins lanes, rows per thread, warps and resident threads of replay modules inside the block
    only (conventional modules keep the planner's); a non-default ``resident`` shows in the key and in
    ``__launch_bounds__``'s min blocks; the planner's modules keep their keys (no ``_r`` suffix)."""
    from trtllm_replayssm.families.gdn import config

    planned = gdn_spec("bf16", 32, 16, 128, 128, 16, 1, True)
    conv = gdn_spec("bf16", 32, 16, 128, 128, 1, 1, False)
    assert "_r" not in planned.key.split("_sm")[-1] and planned.resident == config.GDN_RESIDENT_THREADS
    with config.override(lanes=8, rt=2, warps=4, resident=512):
        s = gdn_spec("bf16", 32, 16, 128, 128, 16, 1, True)
        assert (s.lanes, s.rows, s.warps, s.resident, s.min_blocks) == (8, 32, 4, 512, 4)
        assert s.key.endswith("_r512") and gdn_spec("bf16", 32, 16, 128, 128, 1, 1, False) == conv
        with config.override(rt=1):  # nested: the other pins stay
            assert (gdn_spec("bf16", 32, 16, 128, 128, 16, 1, True).rows, s.lanes) == (16, 8)
    assert gdn_spec("bf16", 32, 16, 128, 128, 16, 1, True) == planned
    with pytest.raises(ValueError, match="GDNSpec.resident"):
        GDNSpec("bf16", 32, 16, 128, 128, 16, 64, 8, 16, resident=128)


def test_shadow_modules_take_two_passes_at_large_batches():
    """bench/NOTES.md, "Shadow modules in two passes per block": a shadow replay module covers a whole
    128-row head in two passes of 64 rows from bs64 (Qwen3-Next geometry); fp32, conventional, verify and
    small-batch modules stay in one pass, with the same rows as before."""
    big = gdn_spec("bf16", 32, 16, 128, 128, 16, 256, True, "bf16")
    assert (big.rows, big.warps, big.passes) == (128, 8, 2) and big.key.endswith("_x2") and big.grid(256) == (32, 256, 1)
    assert "#define GDN_PASSES 2" in cc.prelude(big)
    assert gdn_spec("bf16", 32, 16, 128, 128, 16, 64, True, "bf16").passes == 2
    for kw in (dict(batch=32, shadow="bf16"), dict(batch=256, shadow="none")):
        one = gdn_spec("bf16", 32, 16, 128, 128, 16, kw["batch"], True, kw["shadow"])
        assert one.passes == 1 and "GDN_PASSES" not in cc.prelude(one)
        assert one.rows == gdn_geometry(128, 128, 32, kw["batch"], True)[0]
    assert gdn_spec("bf16", 32, 16, 128, 128, 16, 256, True, "bf16", num_tokens=4).passes == 1
    assert gdn_spec("bf16", 32, 16, 128, 128, 16, 256, False).passes == 1


# ---- speculative module (plugins/gdn/gdn_spec.cu: gdn_verify, gdn_native_verify) ---------------------------
SPEC_FULL = [
    gdn_spec(a, 32, 16, V, K, 16, 256, replay, sh, arch=arch, num_tokens=4)
    for a, V, K, (replay, sh), arch in itertools.product(
        ("bf16", "f16", "f32"), GDN_SUPPORTED_DIMS, GDN_SUPPORTED_DIMS, ((True, "none"), (True, "bf16"), (False, "none")),
        ARCHS)
]
SPEC_EDGES = [
    gdn_spec("bf16", HV, H, 128, 128, L, batch, replay, sh, l2norm, scale, arch, T)
    for (HV, H), (T, L), batch, (replay, sh), (l2norm, scale), arch in itertools.product(
        ((32, 16), (4, 2)), ((1, 2), (1, 32), (2, 4), (2, 8), (4, 8), (4, 32), (6, 12), (6, 16), (8, 16), (8, 32)),
        (1, 64), ((True, "none"), (True, "bf16"), (False, "none")), ((True, None), (False, 0.125)), ARCHS)
    if T == 4 or (batch == 64 and l2norm and HV == 32)
] + [gdn_spec("f32", 4, 2, V, K, 32, 1, replay, "none", arch=arch, num_tokens=T)  # the largest tiles
     for V, K, T, replay, arch in itertools.product((64, 256), (256,), (1, 8), (True, False), ARCHS)]


@pytest.mark.parametrize("spec", SPEC_FULL + SPEC_EDGES, ids=lambda s: s.key)
def test_spec_compiles_to_ptx(spec):
    ptx = cc.compile_spec(spec, "ptx").decode()
    assert f".target sm_{spec.arch}" in ptx
    for name in config.GDN_SPEC_KERNEL_NAMES:
        assert re.search(rf"\.entry {name}\(", ptx), name
    assert "__local_depot" not in ptx, "a register array went to local memory"


@pytest.mark.parametrize("shadow, n_sh", [("none", 0), ("bf16", 1)])
def test_spec_parameter_lists_are_tensorrt_order(shadow, n_sh):
    """Verify: 9 step inputs (cursor (slots, 2)) + 6 in-place inputs (+ shadow), 2 int32 scalars, y + 6 aliased
    outputs (+ shadow), as gdn_replay_decode. Native verify: 8 step inputs + state, 2 int32 scalars, y + snapshots."""
    ptx = cc.compile_spec(gdn_spec("bf16", 32, 16, 128, 128, 16, 64, True, shadow, num_tokens=4), "ptx").decode()
    for name, want in (("gdn_verify", ["u64"] * (15 + n_sh) + ["u32"] * 2 + ["u64"] * (7 + n_sh)),
                       ("gdn_native_verify", ["u64"] * 9 + ["u32"] * 2 + ["u64"] * 2)):
        params = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S).group(1)
        assert re.findall(r"\.param \.(u64|u32|b32|s32)", params) == want, name


def test_spec_key_and_entry_file():
    spec = GDNSpec("bf16", 32, 16, 128, 128, 16, 64, 8, num_tokens=4)
    assert spec.key == "gdn_a-bf16_HV32_H16_V128_K128_L16_R64_W8_P32_n1_sm90_T4"
    assert cc.entry_file(spec) == "gdn/gdn_spec.cu" and cc.kernel_names(spec) == config.GDN_SPEC_KERNEL_NAMES
    std = GDNSpec("bf16", 32, 16, 128, 128, 16, 64, 8)
    assert cc.entry_file(std) == "gdn/gdn_decode.cu" and cc.kernel_names(std) == config.GDN_KERNEL_NAMES
    assert "kT" not in cc.prelude(std) and "constexpr int kT = 4;" in cc.prelude(spec)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(num_tokens=3), ValueError, "GDNSpec.num_tokens"),
    (dict(num_tokens=4, buffer_len=6), ValueError, r"buffer_len=6: expected >= 2 \* num_tokens = 8"),
    (dict(num_tokens=True), TypeError, "GDNSpec.num_tokens: expected an int"),
    (dict(num_tokens=8, buffer_len=32, K=256, rows=256, warps=16, act="f32"), ValueError, "rows"),
])
def test_bad_spec_specs_rejected(bad, exc, match):
    base = dict(act="bf16", heads_v=32, heads_k=16, V=256, K=128, buffer_len=16, rows=64, warps=8)
    with pytest.raises(exc, match=match):
        GDNSpec(**{**base, **bad})
