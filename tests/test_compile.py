# SPDX-License-Identifier: Apache-2.0
"""Every kernel variant compiles to PTX for sm_90 and sm_100 through NVRTC (no GPU needed).

The matrix crosses every state dtype x activation dtype x (headdim, dstate) at L=16 with the
large-batch geometry, and every buffer length x gate x small-batch geometry on the main model
shape, for both archs. A compile error fails with NVRTC's log and the spec key.
"""

import contextlib
import dataclasses
import itertools
import re

import pytest

from trtllm_replayssm import compile as cc
from trtllm_replayssm.config import (
    CKPT8,
    DEFAULT_VARIANT,
    SHADOW_STAGED_BLOCKS,
    SUPPORTED_BUFFER_LEN,
    SUPPORTED_DSTATE,
    SUPPORTED_HEADDIM,
    KernelSpec,
    Layout,
    Variant,
    choose_geometry,
    override_variant,
    parse_variant,
    plan,
    replay_smem_bytes,
)

ARCHS = (90, 100)


def _spec(state, act, P, N, L, batch, has_z, arch, H=128, G=8):
    rows, warps = choose_geometry(state, P, N, H, batch, act, L)
    return KernelSpec(state, act, H, P, N, G, L, rows, warps, has_z, arch)


def plan_spec_of(state, shadow, batch, arch, H=128, P=64, N=128, G=8, L=16):
    """The shipped plan's standard decode module (config.plan) on the main geometry."""
    rows, warps, variant = plan(state, "bf16", H, P, N, L, batch, False, shadow)
    return KernelSpec(state, "bf16", H, P, N, G, L, rows, warps, False, arch, variant, shadow)


FULL = [
    _spec(s, a, P, N, 16, 256, False, arch)
    for s, a, P, N, arch in itertools.product(("f32", "bf16", "f16"), ("bf16", "f16", "f32"), SUPPORTED_HEADDIM,
                                              SUPPORTED_DSTATE, ARCHS)
]
EDGES = [
    _spec(s, "bf16", 64, 128, L, batch, z, arch)
    for s, L, batch, z, arch in itertools.product(("f32", "bf16"), SUPPORTED_BUFFER_LEN, (1, 256), (False, True), ARCHS)
]


PERSISTENT = [
    KernelSpec(s, "bf16", H, P, N, 8, L, *choose_geometry(s, P, N, H, batch, "bf16", L, True), False, arch, DEFAULT_VARIANT)
    for s, (H, P, N), L, batch, arch in itertools.product(("f32", "bf16"), ((128, 64, 128), (128, 80, 128), (256, 64, 256)),
                                                         (8, 16), (1, 256), ARCHS)
]


# Shadow variants: both kernel variants, every (headdim, dstate) on the main buffer lengths.
SHADOW = [
    KernelSpec("f32", a, H, P, N, 8, L, *choose_geometry("f32", P, N, H, batch, a, L, persistent, sh), z, arch,
               DEFAULT_VARIANT if persistent else Variant(), sh)
    for sh, a, (H, P, N), L, batch, persistent, z, arch in itertools.product(
        ("bf16", "fp8"), ("bf16",), ((128, 64, 128), (128, 80, 128), (256, 64, 256)), (8, 16), (1, 256),
        (False, True), (False,), ARCHS)
] + [KernelSpec("f32", a, 128, 64, 128, 8, 16, 32, 4, True, 90, DEFAULT_VARIANT, sh)
     for sh in ("bf16", "fp8") for a in ("f16", "f32")]


# The staged one-shot kernel (the shadow default, config.plan): with and without a shadow.
STAGED = [
    KernelSpec("f32", "bf16", H, P, N, 8, L, *choose_geometry("f32", P, N, H, batch, "bf16", L, False, sh), False, arch,
               Variant("staged", SHADOW_STAGED_BLOCKS.get(sh, 5), 2), sh)
    for sh, (H, P, N), L, batch, arch in itertools.product(
        ("none", "bf16", "fp8"), ((128, 64, 128), (128, 80, 128), (256, 64, 256)), (8, 16), (1, 256), ARCHS)
]


# 64-row items of 4 warps (16 rows a thread): the shadow plans above batch 4 on the main geometry (with a shadow;
# config.SHADOW_REGS_PER_THREAD), pinned here in every storage form.
ROWS64_WARPS4 = [
    KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 4, False, arch, Variant("staged", 8, 2), sh)
    for sh, arch in itertools.product(("none", "bf16", "fp8"), ARCHS)
]
# The staged kernel with bulk copies (copy="bulk", pinned, not yet planned): every storage form, the x history
# as one piece (rows = headdim) and per entry (rows < headdim), odd L, f16 / f32 activations and the z gate.
BULK = [
    KernelSpec("f32", a, H, P, N, 8, L, rows, warps, z, arch, Variant("staged", 8, 2, "bulk"), sh)
    for (sh, a, H, P, N, L, rows, warps, z), arch in itertools.product([
        ("none", "bf16", 128, 64, 128, 16, 64, 8, False), ("bf16", "bf16", 128, 64, 128, 16, 64, 8, False),
        ("fp8", "bf16", 128, 64, 128, 16, 64, 8, False), ("fp8", "bf16", 128, 64, 128, 16, 64, 4, False),
        ("fp8", "bf16", 128, 80, 128, 16, 40, 4, False), ("bf16", "f16", 128, 64, 256, 8, 32, 8, True),
        ("fp8", "f32", 128, 64, 128, 5, 16, 4, False), ("none", "bf16", 256, 64, 256, 16, 32, 8, False)], ARCHS)
]

# The flush-first row order (KernelSpec.row_order): the planned staged modules (bf16 / fp8 shadow, fp32 at batch
# <= 4), the 8-bit checkpoint, a one-shot module with z, bulk copies.
ROW_ORDER = [
    dataclasses.replace(s, row_order=True) for s in (
        *(plan_spec_of(st, sh, batch, arch) for st, sh, batch, arch in itertools.product(
            ("f32",), ("bf16", "fp8"), (1, 32, 256), ARCHS)),
        *(plan_spec_of(st, "none", batch, arch) for st, batch, arch in itertools.product(("f32", CKPT8), (2,), ARCHS)),
        plan_spec_of(CKPT8, "none", 256, 90),
        KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 32, 4, True, 90, Variant("one_shot", 4)),
        BULK[1])
]


@pytest.mark.parametrize("spec", FULL + EDGES + PERSISTENT + SHADOW + STAGED + ROWS64_WARPS4 + BULK + ROW_ORDER,
                         ids=lambda s: s.key)
def test_compiles_to_ptx(spec):
    ptx = cc.compile_spec(spec, "ptx").decode()
    assert f".target sm_{spec.arch}" in ptx
    for name in cc.KERNEL_NAMES:
        assert re.search(rf"\.entry {name}\(", ptx), name


def row_order_entries(plain, ordered, kernel: str) -> bool:
    """The row-order module's ``kernel`` entry takes the plain one's parameter list and has one 16-byte integer load
    (the order's row) where the plain entry has none (the GDN test uses it too)."""
    lists, loads = [], []
    for spec in (plain, ordered):
        ptx = cc.compile_spec(spec, "ptx").decode()
        lists.append(re.findall(r"\.param \.(u64|u32|b32|s32)", re.search(rf"\.entry {kernel}\((.*?)\)", ptx, re.S).group(1)))
        body = ptx[ptx.index(f".entry {kernel}("):]
        body = body[:body.index(".entry", 10)] if ".entry" in body[10:] else body
        loads.append(len(re.findall(r"ld\.global(\.nc)?\.v4\.(u32|b32|s32)", body)))
    return lists[0] == lists[1] and loads == [0, 1]


def test_row_order_module():
    """KernelSpec.row_order: its own key and macro, the same parameter list (state_batch_indices read as (row, slot,
    cursor, 0) int4 rows, one 16-byte load a block), the contiguous standard decode module's one-shot and staged
    kernels only."""
    planned = plan_spec_of("f32", "bf16", 32, 90)
    ro = dataclasses.replace(planned, row_order=True)
    assert ro.key == planned.key + "_ro" and planned.variant.kind == "staged"
    assert "#define RSSM_ROW_ORDER 1" in ro.prelude() and "RSSM_ROW_ORDER" not in planned.prelude()
    assert row_order_entries(planned, ro, "replayssm_decode")
    with pytest.raises(ValueError, match="row_order: .*persistent"):
        dataclasses.replace(plan_spec_of("f32", "none", 256, 90), row_order=True)
    with pytest.raises(ValueError, match="row_order"):
        dataclasses.replace(plan_spec_of("f32", "none", 2, 90), row_order=True, layout=Layout(*range(1, 12)))
    with pytest.raises(TypeError, match="row_order"):
        dataclasses.replace(planned, row_order=1)


def test_decode_parameter_list_is_tensorrt_order():
    """9 inputs (10 with z), the 4 in-place inputs, 2 int32 scalars, then 5 outputs."""
    for has_z, n_ptr_in in ((False, 13), (True, 14)):
        ptx = cc.compile_spec(_spec("f32", "bf16", 64, 128, 16, 256, has_z, 90), "ptx").decode()
        params = re.search(r"\.entry replayssm_decode\((.*?)\)", ptx, re.S).group(1)
        kinds = re.findall(r"\.param \.(u64|u32|b32|s32)", params)
        assert kinds == ["u64"] * n_ptr_in + ["u32"] * 2 + ["u64"] * 5, kinds


@pytest.mark.parametrize("shadow, n_sh", [("bf16", 2), ("fp8", 2)])
def test_shadow_parameters_follow_the_buffers(shadow, n_sh):
    """The shadow and its scales come after dt_cache among the inputs and after dt_cache_out among the outputs."""
    rows, warps = choose_geometry("f32", 64, 128, 128, 256, "bf16", 16, True, shadow)
    spec = KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, rows, warps, False, 90, DEFAULT_VARIANT, shadow)
    assert spec.key.endswith(f"_z0_sh-{shadow}_sm90_PERSISTENT1_MIN_BLOCKS5")
    params = re.search(r"\.entry replayssm_decode\((.*?)\)", cc.compile_spec(spec, "ptx").decode(), re.S).group(1)
    kinds = re.findall(r"\.param \.(u64|u32|b32|s32)", params)
    assert kinds == ["u64"] * (13 + n_sh) + ["u32"] * 2 + ["u64"] * (5 + n_sh), kinds


def test_cache_key_is_readable_and_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTLLM_REPLAYSSM_CACHE", str(tmp_path))
    spec = _spec("f32", "bf16", 64, 128, 16, 256, False, 90)
    assert spec.key == "replayssm_s-f32_a-bf16_H128_P64_N128_G8_L16_R64_W8_z0_sm90"
    first = cc.compile_spec(spec, "ptx")
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith(spec.key)
    files[0].write_bytes(b"// cached")
    assert cc.compile_spec(spec, "ptx") == b"// cached"  # served from disk, not recompiled
    assert cc.compile_spec(spec, "ptx", use_cache=False) == first


def test_cache_key_follows_the_cuda_headers(tmp_path, monkeypatch):
    """An edit of the CUDA headers (an upgraded nvidia-cuda-runtime wheel: same path, same NVRTC) misses the cache."""
    import shutil

    monkeypatch.setenv("TRTLLM_REPLAYSSM_CACHE", str(tmp_path / "cache"))
    inc = tmp_path / "include"
    shutil.copytree(cc._include_dirs()[1], inc)
    monkeypatch.setattr(cc, "_include_dirs", lambda: (str(cc.PLUGIN_DIR), str(inc)))
    spec = KernelSpec("f32", "f32", 1, 8, 128, 1, 8, 8, 1, False, 90, num_tokens=1)
    assert b"rssm_header_probe" not in cc.compile_spec(spec, "ptx")
    with open(inc / "cuda_fp16.h", "a") as f:
        f.write('\n#ifndef RSSM_PROBE\n#define RSSM_PROBE\nextern "C" __device__ int rssm_header_probe = 1;\n#endif\n')
    assert b"rssm_header_probe" in cc.compile_spec(spec, "ptx")


def test_compile_error_names_the_spec(monkeypatch):
    spec = _spec("f32", "bf16", 64, 128, 16, 256, False, 90)
    monkeypatch.setattr(cc, "prelude", lambda s: "this is not C++;\n")
    with pytest.raises(cc.CompileError, match=spec.key):
        cc.compile_spec(spec, "ptx", use_cache=False)


@pytest.mark.parametrize("bad, match", [
    (dict(state="f64"), "KernelSpec.state"),
    (dict(ngroups=3), "ngroups"),
    (dict(buffer_len=33), "buffer_len"),
    (dict(rows=48), "rows"),
    (dict(shadow="fp4"), "KernelSpec.shadow"),
    (dict(state="bf16", shadow="bf16"), "needs an f32 checkpoint"),
    # fp8 row scales move as 16-byte vectors of 4 rows: the decode entry file's static_assert
    (dict(headdim=80, dstate=64, rows=10, warps=1, shadow="fp8"), "fp8"),
])
def test_bad_specs_rejected(bad, match):
    base = dict(state="f32", act="bf16", nheads=128, headdim=64, dstate=128, ngroups=8, buffer_len=16, rows=64, warps=8)
    with pytest.raises(ValueError, match=match):
        KernelSpec(**{**base, **bad})


def test_ptx_newer_than_the_driver_is_refused(monkeypatch):
    monkeypatch.setattr(cc, "driver_version", lambda: (13, 0))
    monkeypatch.setattr(cc, "nvrtc_version", lambda: (13, 5))
    with pytest.raises(cc.CompileError, match=r"NVRTC 13.5 emits PTX that this driver \(CUDA 13.0\)"):
        cc.check_ptx_loadable()
    monkeypatch.setattr(cc, "driver_version", lambda: None)  # no driver (CI): nothing to check
    cc.check_ptx_loadable()
    monkeypatch.setattr(cc, "driver_version", lambda: (13, 5))
    cc.check_ptx_loadable()


def test_small_batch_staged_fp32_plan_halves_the_warps():
    """bench/NOTES.md "Issue 40, third pass": at batch <= SMALL_BATCH the staged fp32 step keeps the small-batch
    plan's rows a block (those the shadow plans use) in half its warps; Nemotron-H 8B: R16 W4 at bs1, R32 W8 at
    bs2-4 (the measured shapes); above SMALL_BATCH and with a shadow nothing changes."""
    from trtllm_replayssm.config import SMALL_BATCH, SMALL_BATCH_VARIANT, plan
    from trtllm_replayssm.geometries import GEOMETRIES

    H, P, N, _ = GEOMETRIES["nemotron_h_8b"]
    assert [plan("f32", "bf16", H, P, N, 16, b)[:2] for b in (1, 2, 3, 4)] == [(16, 4), (32, 8), (32, 8), (32, 8)]
    for name, (H, P, N, _) in GEOMETRIES.items():
        for b in range(1, SMALL_BATCH + 1):
            rows, warps, variant = plan("f32", "bf16", H, P, N, 16, b)
            s_rows, s_warps, _ = plan("f32", "bf16", H, P, N, 16, b, shadow="bf16")
            assert variant == SMALL_BATCH_VARIANT and (rows, 2 * warps) == (s_rows, s_warps), (name, b)
    assert plan("f32", "bf16", 128, 64, 128, 16, SMALL_BATCH + 1)[2] != SMALL_BATCH_VARIANT


def test_shadow_variant_choice():
    """A shadow runs the staged one-shot kernel by default (measured fastest); a pinned variant is used as given."""
    from trtllm_replayssm.config import override_variant, plan

    for shadow in ("bf16", "fp8"):
        rows, warps, variant = plan("f32", "bf16", 128, 64, 128, 16, 256, shadow=shadow)
        assert (rows, warps) == (64, 4)  # above SMALL_BATCH: 64 state elements a thread, 1024 threads per SM
        assert variant == Variant("staged", min_blocks=8, flush_rows=2)
        rows, warps, variant = plan("f32", "bf16", 128, 64, 128, 16, 1, shadow=shadow)  # batch 1: unchanged
        assert (rows, warps) == (16, 8)
        assert variant == Variant("staged", min_blocks=SHADOW_STAGED_BLOCKS[shadow], flush_rows=2)
        with override_variant(kind="one_shot", min_blocks=5):  # the plain one-shot kernel, on request
            assert plan("f32", "bf16", 128, 64, 128, 16, 256, shadow=shadow)[2] == Variant("one_shot", 5)
        with override_variant(kind="persistent", min_blocks=5):  # persistent wherever two stages fit
            rows, warps, variant = plan("f32", "bf16", 128, 64, 128, 16, 256, shadow=shadow)
        spec = KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, rows, warps, False, 90, variant, shadow)
        assert spec.persistent and spec.grid(256, 132)[1] == 1
    assert plan("f32", "bf16", 128, 64, 128, 16, 256)[2] == DEFAULT_VARIANT  # no shadow: unchanged
    assert plan("f32", "bf16", 128, 64, 128, 16, 4)[2] == Variant("staged", 5, 2)  # small batches: staged


def test_variant_key_and_prelude_keep_their_names():
    """The typed variant renders the RSSM_* definitions and key suffixes the cache already holds, in one order."""
    spec = KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 8, False, 90, Variant("staged", 8, 2), "fp8")
    assert spec.key == "replayssm_s-f32_a-bf16_H128_P64_N128_G8_L16_R64_W8_z0_sh-fp8_sm90_STAGED1_MIN_BLOCKS8_FLUSH_ROWS2"
    want = "#define RSSM_HAS_Z 0\n#define RSSM_STAGED 1\n#define RSSM_MIN_BLOCKS 8\n#define RSSM_FLUSH_ROWS 2\n"
    assert want in cc.prelude(spec)
    assert Variant("one_shot", 5).key == "_MIN_BLOCKS5" and Variant().key == "" and Variant().prelude() == []
    assert DEFAULT_VARIANT.key == "_PERSISTENT1_MIN_BLOCKS5"
    bulk = Variant("staged", 8, 2, "bulk")
    assert bulk.key == "_STAGED1_MIN_BLOCKS8_FLUSH_ROWS2_BULK1" and bulk.prelude()[-1] == "#define RSSM_BULK 1"
    assert parse_variant("kind=staged,copy=bulk,min_blocks=8,flush_rows=2") == bulk


def test_bulk_copy_shape_checks():
    """Bulk copies move 16-byte multiples: a block's x rows that are not one are refused before NVRTC, by name."""
    bulk = Variant("staged", 8, 2, "bulk")
    with pytest.raises(ValueError, match=r"copy='bulk': bulk copies move 16-byte multiples; x rows of a block \(4 x 2 B\)"):
        KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 4, 4, False, 90, bulk)
    KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 8, 8, False, 90, bulk)  # 8 bf16 rows: 16 bytes
    with pytest.raises(ValueError, match="cp.async.bulk needs sm_90 or newer, got arch=80"):
        KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 8, False, 80, bulk)


@pytest.mark.parametrize("bad, match", [
    (dict(kind="PERSISTENT"), r"Variant.kind: expected one of \('one_shot', 'persistent', 'staged'\)"),
    (dict(min_blocks=0), r"Variant.min_blocks: expected None or an int in 1..32, got 0"),
    (dict(min_blocks=True), "Variant.min_blocks"),
    (dict(flush_rows="2"), "Variant.flush_rows"),
    (dict(kind="staged", copy="tma"), r"Variant.copy: expected one of \('async', 'bulk'\), got 'tma'"),
    (dict(kind="persistent", copy="bulk"), "Variant.copy='bulk' stages the staged kernel's item: expected kind='staged'"),
])
def test_bad_variants_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        Variant(**bad)


def test_variant_field_and_speculative_module_checks():
    with pytest.raises(TypeError, match="KernelSpec.variant: expected a config.Variant"):
        KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 8, False, 90, (("PERSISTENT", 1),))
    with pytest.raises(ValueError, match="KernelSpec.variant: the speculative module"):
        KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 8, False, 90, Variant("staged"), num_tokens=4)


def test_variant_override_and_environment(monkeypatch):
    """override_variant pins the variant (nested blocks restore it), the environment parses into the same
    fields with errors naming the variable and field, and the removed TRTLLM_REPLAYSSM_DEFINES is refused."""
    from trtllm_replayssm.config import current_variant, override_variant, parse_variant, plan

    monkeypatch.delenv("TRTLLM_REPLAYSSM_VARIANT", raising=False)
    monkeypatch.delenv("TRTLLM_REPLAYSSM_DEFINES", raising=False)
    assert current_variant() is None
    with override_variant(kind="staged", min_blocks=6, flush_rows=2):
        with override_variant(Variant()):
            assert plan("f32", "bf16", 128, 64, 128, 16, 256)[2] == Variant()
        assert current_variant() == Variant("staged", 6, 2)
        # the conventional module has no persistent kernel; a pinned staged one keeps its fields
        assert plan("f32", "bf16", 128, 64, 128, 1, 256, conventional=True)[2] == Variant("staged", 6, 2)
    assert current_variant() is None
    with override_variant(kind="persistent", min_blocks=5):
        assert plan("f32", "bf16", 128, 64, 128, 1, 256, conventional=True)[2] == Variant("one_shot", 5)
    monkeypatch.setenv("TRTLLM_REPLAYSSM_VARIANT", "kind=persistent, min_blocks=4")
    assert current_variant() == Variant("persistent", 4)
    with override_variant(None):  # the shipped plan, whatever the environment says
        assert plan("f32", "bf16", 128, 64, 128, 16, 256, shadow="bf16")[2].kind == "staged"
    for text, match in (("min_blocks=x", "TRTLLM_REPLAYSSM_VARIANT: min_blocks: expected an int"),
                        ("persistent=1", "TRTLLM_REPLAYSSM_VARIANT: expected comma-separated name=value"),
                        ("kind=fast", "TRTLLM_REPLAYSSM_VARIANT: Variant.kind"),
                        ("flush_rows=1,flush_rows=2", "flush_rows given twice")):
        with pytest.raises(ValueError, match=match):
            parse_variant(text)
    with pytest.raises(ValueError, match="override_variant: unknown field 'min_block'"):
        with override_variant(min_block=4):
            pass
    monkeypatch.setenv("TRTLLM_REPLAYSSM_DEFINES", "PERSISTENT=1")
    with pytest.raises(ValueError, match="TRTLLM_REPLAYSSM_DEFINES: replaced by TRTLLM_REPLAYSSM_VARIANT"):
        plan("f32", "bf16", 128, 64, 128, 16, 256)


def test_every_plan_fits_static_shared_memory():
    """Every standard decode plan (supported headdim x dstate, L 1..32, state / activation dtypes, shadows, small
    and large batch; shipped and pinned staged variants) is a valid KernelSpec (rows <= threads, whole warps)
    and fits 48 KiB by the mirror of the kernel it runs; the C vector of the stage stays aligned. (headdim 80 x
    dstate 64 with a shadow at batch > 4 once planned 80 rows on 64 threads.)"""
    for pinned in (None, Variant("staged", 8, 2)):
        with override_variant(pinned) if pinned else contextlib.nullcontext():
            for P, N, L, st, act, sh, b in itertools.product(SUPPORTED_HEADDIM, SUPPORTED_DSTATE, range(1, 33),
                                                            ("f32", "bf16"), ("bf16", "f16", "f32"),
                                                            ("none", "bf16", "fp8"), (1, 5, 256)):
                if sh != "none" and st != "f32":
                    continue
                rows, warps, v = plan(st, act, 128, P, N, L, b, False, sh)
                KernelSpec(st, act, 128, P, N, 8, L, rows, warps, False, 90, v, sh)  # raises if not launchable
                smem = replay_smem_bytes(st, act, rows, N, L, v.kind == "persistent", sh, v.kind == "staged")
                assert smem <= 48 * 1024, (P, N, L, st, act, sh, b, rows, v.key, smem)


def test_fp8_shadow_geometry_keeps_rows_a_multiple_of_4():
    """Small batches split heads into row chunks; with an fp8 shadow the chunks stay whole 4-row scale vectors."""
    from trtllm_replayssm.config import plan

    for P, N in ((80, 256), (80, 128), (64, 128)):
        for batch in (1, 4, 32, 256):
            rows, warps, variant = plan("f32", "bf16", 128, P, N, 16, batch, shadow="fp8")
            assert rows % 4 == 0, (P, N, batch, rows)
            cc.compile_spec(KernelSpec("f32", "bf16", 128, P, N, 8, 16, rows, warps, False, 90, variant, "fp8"), "ptx")


# Plans whose x tile is not a multiple of 16 bytes (headdim 80 in 20- or 10-row items at odd L: C must still be
# 16-byte aligned) and f32-activation shadow plans whose staged stage outgrows the one-shot tiles (the planner
# sized them by the one-shot kernel and ptxas refused them: "uses too much shared data").
EDGE_CASES = (("f32", "bf16", 64, 80, 128, 5, 1, "none"), ("f32", "bf16", 128, 80, 256, 6, 256, "bf16"),
              ("f32", "bf16", 128, 80, 64, 16, 256, "bf16"), ("f32", "bf16", 128, 80, 64, 16, 256, "fp8"),
              ("f32", "bf16", 128, 80, 128, 3, 1, "fp8"), ("f32", "f32", 128, 80, 256, 32, 256, "fp8"),
              ("f32", "f32", 128, 80, 256, 24, 256, "bf16"), ("f32", "f32", 128, 64, 256, 12, 256, "bf16"))
EDGE_PLANS = [
    KernelSpec(st, act, H, P, N, 8, L, *plan(st, act, H, P, N, L, b, False, sh)[:2], False, 90,
               plan(st, act, H, P, N, L, b, False, sh)[2], sh)
    for st, act, H, P, N, L, b, sh in EDGE_CASES
]


@pytest.mark.parametrize("spec", [s for s in SHADOW + STAGED + PERSISTENT if s.arch == 90 and s.buffer_len == 16]
                         + [s for s in BULK if s.arch == 90] + EDGE_PLANS, ids=lambda s: s.key)
def test_decode_smem_mirror(spec):
    """The decode kernel's static shared memory is what config.replay_smem_bytes says, per kernel kind."""
    ptx = cc.compile_spec(spec, "ptx").decode()
    smem = re.findall(r"\.shared \.align \d+ \.b8 \w*replay_decode\w*\[(\d+)\]", ptx)
    staged = spec.variant.kind == "staged"
    assert [int(v) for v in smem] == [replay_smem_bytes(spec.state, spec.act, spec.rows, spec.dstate, spec.buffer_len,
                                                        spec.persistent, spec.shadow, staged, spec.variant.copy == "bulk")]


@pytest.mark.parametrize("rows, warps, variant", [
    (64, 4, Variant("persistent")), (64, 8, Variant("persistent")), (64, 16, Variant("persistent")),
    (64, 8, Variant("persistent", 5)), (64, 8, Variant("staged", 8, 2)), (64, 8, Variant("staged", 5, 2))])
def test_blocks_per_sm_is_the_kernels_launch_bound(rows, warps, variant):
    """KernelSpec.blocks_per_sm (the persistent grid: sm_count x blocks_per_sm, ops and trt_plugin) equals the
    resident blocks the kernel was built for, read from its PTX (.minnctapersm of __launch_bounds__): the
    default of 1024 threads per SM from 256 threads a block (1 below), min_blocks capped at 1024 or 2048
    (staged) threads per SM."""
    shadow = "bf16" if variant.kind == "staged" else "none"
    spec = KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, rows, warps, variant=variant, shadow=shadow)
    ptx = cc.compile_spec(spec, "ptx").decode()
    head = ptx[ptx.index(".entry replayssm_decode("):]
    bound = re.search(r"\.minnctapersm\s+(\d+)", head[:head.index("{")])
    assert bound is not None and spec.blocks_per_sm == int(bound.group(1))
