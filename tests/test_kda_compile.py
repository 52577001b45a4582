# SPDX-License-Identifier: Apache-2.0
"""Every KDA kernel variant compiles to PTX for sm_90 and sm_100 through NVRTC, and the launchers reject bad input
by name before any launch (no GPU needed).

The table: the published per-GPU geometries (families/kda GEOMETRIES) at L = 16 with both gates, shadow on and
off, at the planner's large- and small-batch launch shapes; then rows that change one field each (odd sizes, ring
lengths, activation dtypes, no l2 norm, a given scale, 4 lanes across a row, K = 256). The verify modules
(num_tokens T >= 1, plugins/kda/kda_spec.cu) likewise: the published TP8 geometries at T = 2 and 4, then one field
changed a row (every supported T, odd sizes, dtypes, the smallest ring 2T, K = 256, the shapes of both plans).
"""

import itertools
import re

import pytest
import torch

from trtllm_replayssm import compile as cc
from trtllm_replayssm.families import get
from trtllm_replayssm.families.kda import GEOMETRIES
from trtllm_replayssm.families.kda import ops as kops
from trtllm_replayssm.families.kda.config import (
    BULK_KERNEL_NAME,
    BULK_REPLAY_KERNEL_NAME,
    KERNEL_NAMES,
    SPEC_KERNEL_NAMES,
    KDASpec,
    kda_geometry,
    kda_spec,
    override,
)

ARCHS = (90, 100)
PUBLISHED = [
    kda_spec("bf16", H, K, V, 16, batch, sh, lower_bound=lb, arch=arch)
    for (H, K, V), batch, sh, lb, arch in itertools.product(
        sorted(set(GEOMETRIES.values())), (1, 256), ("none", "bf16"), (None, -5.0), ARCHS)
]
BASE = dict(act="bf16", H=12, K=128, V=128, buffer_len=16)
ROWS = [dict(), dict(act="f16"), dict(act="f32"), dict(buffer_len=2), dict(buffer_len=5), dict(buffer_len=8),
        dict(H=3, K=48, V=40, warps=1), dict(H=5, K=64, V=24, warps=1), dict(K=256, V=64, warps=2),
        dict(l2norm=False), dict(scale=0.125), dict(col_lanes=4), dict(col_lanes=4, warps=2, shadow="bf16"),
        dict(lower_bound=-3.0, shadow="bf16"), dict(warps=8), dict(col_lanes=4, warps=8, shadow="bf16"),
        dict(col_lanes=4, buffer_len=5), dict(col_lanes=4, buffer_len=2, act="f32"),
        # the staged ring (KDASpec.staged), planned at bs256 (PUBLISHED), here at the odd shapes and both rings
        dict(staged=True), dict(col_lanes=4, staged=True, shadow="bf16", lower_bound=-5.0),
        dict(H=3, K=48, V=40, warps=1, act="f32", staged=True), dict(H=5, K=64, V=24, warps=1, act="f16", staged=True),
        dict(K=256, V=64, warps=2, shadow="bf16", staged=True), dict(buffer_len=2, staged=True),
        # two passes a block (KDASpec.passes): the shadow modules at K = 128, fp32 where its rows tile fits
        dict(col_lanes=4, staged=True, passes=2, shadow="bf16"), dict(staged=True, passes=2, shadow="bf16", warps=2),
        dict(K=256, V=64, warps=4, shadow="bf16", staged=True, passes=2),
        dict(H=3, K=64, V=64, warps=2, act="f32", staged=True, passes=2),
        # the flush-first row order (KDASpec.row_order): the register ring, the staged one, two passes
        dict(row_order=True), dict(row_order=True, col_lanes=4, staged=True, shadow="bf16", passes=2),
        dict(row_order=True, H=3, K=48, V=40, warps=1, act="f32", staged=True),
        # the persistent streams (KDASpec.bulk): the conventional module, the bf16 shadow, the odd shapes, K = 256
        dict(bulk=True, buffer_len=2), dict(bulk=True, shadow="bf16", lower_bound=-5.0), dict(bulk=True, H=3, K=48,
        V=40, warps=1, act="f32"), dict(bulk=True, H=5, K=64, V=24, warps=1, act="f16", l2norm=False, buffer_len=5),
        dict(bulk=True, K=256, V=64, warps=1, buffer_len=4),
        # ... whose replay stream folds its flush items in a dynamic shared-memory tile (KDASpec.bulk_flush)
        dict(bulk=True, bulk_flush=True, shadow="bf16"), dict(bulk=True, bulk_flush=True, H=3, K=48, V=40, warps=1,
        act="f32", buffer_len=4)]
EDGES = [KDASpec(**{**BASE, **row, "arch": arch}) for row, arch in itertools.product(ROWS, ARCHS)]
VERIFY_PUBLISHED = [
    kda_spec("bf16", *GEOMETRIES[g], 16, batch, sh, lower_bound=lb, arch=arch, num_tokens=T)
    for g, (T, batch, sh, lb) in itertools.product(
        ("kimi_k3_tp8", "kimi_linear_48b_tp8", "glm5_3_flash_tp8"),
        ((2, 256, "none", None), (4, 1, "bf16", -5.0)))
    for arch in ARCHS
]
VERIFY_ROWS = [dict(num_tokens=4), dict(num_tokens=1), dict(num_tokens=6), dict(num_tokens=8),
               dict(num_tokens=2, buffer_len=4, act="f32", H=3, K=48, V=40, warps=1),
               dict(num_tokens=2, buffer_len=5, act="f16", H=5, K=64, V=24, warps=1, l2norm=False),
               dict(num_tokens=2, buffer_len=4, K=256, V=64, warps=4, shadow="bf16"),
               dict(num_tokens=4, col_lanes=4, shadow="bf16", lower_bound=-3.0), dict(num_tokens=8, col_lanes=4),
               dict(num_tokens=1, buffer_len=2, col_lanes=4, scale=0.125)]
VERIFY_EDGES = [KDASpec(**{**BASE, **row, "arch": arch}) for row, arch in itertools.product(VERIFY_ROWS, ARCHS)]


@pytest.mark.parametrize("spec", PUBLISHED + EDGES + VERIFY_PUBLISHED + VERIFY_EDGES, ids=lambda s: s.key)
def test_compiles_to_ptx(spec):
    ptx = cc.compile_spec(spec, "ptx").decode()
    assert f".target sm_{spec.arch}" in ptx
    for name in spec.kernel_names:
        assert re.search(rf"\.entry {name}\(", ptx), name
    assert (".entry kda_conventional_bulk(" in ptx) == (".entry kda_replay_bulk(" in ptx) == spec.bulk
    if spec.bulk:  # the static shared memory model of the two streams (KDASpec.bulk_smem_bytes) is the PTX's
        sizes = re.findall(r"\.shared \.align 16 \.b8 \S*(?:conventional|replay)_bulk\S*\[(\d+)\]", ptx)
        assert len(sizes) == 2 and max(map(int, sizes)) == spec.bulk_smem_bytes
        assert ("%dynamic_smem_size" in ptx) == spec.bulk_flush
        if spec.bulk_flush:  # the flush tile it asks for holds the one-shot kernel's (kFoldBytes <= its static tile)
            one_shot = re.search(r"\.shared \.align 16 \.b8 \S*replay_decode\S*\[(\d+)\]", ptx)
            assert int(one_shot.group(1)) <= spec.flush_tile_bytes
    assert "__local_depot" not in ptx, "a register array went to local memory"
    assert f"#define KDA_TOKENS {spec.num_tokens}" in cc.source(spec) if spec.num_tokens else True


@pytest.mark.parametrize("shadow, n_sh", [("none", 0), ("bf16", 1)])
def test_parameter_lists_are_tensorrt_order(shadow, n_sh):
    """Replay: 9 step inputs + 6 in-place inputs (+ shadow), 2 int32 scalars, y + 6 aliased outputs (+ shadow).
    Conventional: 8 step inputs + state, 2 int32 scalars, y + state."""
    ptx = cc.compile_spec(KDASpec(**BASE, shadow=shadow), "ptx").decode()
    for name, want in (("kda_replay_decode", ["u64"] * (15 + n_sh) + ["u32"] * 2 + ["u64"] * (7 + n_sh)),
                       ("kda_conventional", ["u64"] * 9 + ["u32"] * 2 + ["u64"] * 2)):
        params = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S).group(1)
        assert re.findall(r"\.param \.(u64|u32|b32|s32)", params) == want, name
    # verify: the replay step's list (cursor (slots, 2) is one pointer as the (slots,) one was)
    ptx = cc.compile_spec(KDASpec(**BASE, shadow=shadow, num_tokens=4), "ptx").decode()
    params = re.search(r"\.entry kda_verify\((.*?)\)", ptx, re.S).group(1)
    assert re.findall(r"\.param \.(u64|u32|b32|s32)", params) == ["u64"] * (15 + n_sh) + ["u32"] * 2 + ["u64"] * (7 + n_sh)


def test_row_order_module():
    """KDASpec.row_order: its own key and macro, the same parameter list (input 8 is read as (row, slot, cursor, 0)), the
    decode module's option only; kda_spec(row_order=True) is the planned module with the flag."""
    s = KDASpec(**BASE, row_order=True)
    assert s.key.endswith("_ro_sm90") and "#define KDA_ROW_ORDER 1" in s.prelude()
    assert "KDA_ROW_ORDER" not in KDASpec(**BASE).prelude()
    plain = cc.compile_spec(KDASpec(**BASE), "ptx").decode()
    ptx = cc.compile_spec(s, "ptx").decode()
    lists = [re.search(r"\.entry kda_replay_decode\((.*?)\)", p, re.S).group(1) for p in (plain, ptx)]
    assert [re.findall(r"\.param \.(u64|u32|b32|s32)", x) for x in lists] == [
        ["u64"] * 15 + ["u32"] * 2 + ["u64"] * 7] * 2
    v4 = r"ld\.global(\.nc)?\.v4\.(u32|b32|s32)"  # (row, slot, cursor, 0): one 16-byte integer load, not in the plain
    bodies = [p[p.index(".entry kda_replay_decode("):p.index(".entry kda_conventional(")] for p in (plain, ptx)]
    assert [len(re.findall(v4, b)) for b in bodies] == [0, 1]
    with pytest.raises(ValueError, match="row_order"):
        KDASpec(**BASE, row_order=True, num_tokens=4)
    with pytest.raises(TypeError, match="row_order"):
        KDASpec(**BASE, row_order=1)
    for batch, sh in ((1, "none"), (256, "bf16")):
        planned = kda_spec("bf16", 12, 128, 128, 16, batch, sh)
        assert kda_spec("bf16", 12, 128, 128, 16, batch, sh, row_order=True) == \
            KDASpec(**{**planned.__dict__, "row_order": True})


def test_bulk_module():
    """KDASpec.bulk: its own key, macro and entries (kda_conventional's and kda_replay_decode's parameter lists), a
    one-pass decode module's option that reads the slots and fits both streams' two stages in the static shared
    memory; override(bulk=True) plans the decode modules with it (512 resident threads), and its grid is the
    resident blocks of the card's SMs at most."""
    s = KDASpec(**{**BASE, "buffer_len": 2}, bulk=True)
    assert s.key.endswith("_bk_sm90") and "#define KDA_BULK 1" in s.prelude() and "KDA_BULK" not in KDASpec(**BASE).prelude()
    assert s.kernel_names == KERNEL_NAMES + (BULK_KERNEL_NAME, BULK_REPLAY_KERNEL_NAME)
    assert cc.spec_from_json(cc.spec_to_json(s, "ptx")) == (s, "ptx")
    ptx = cc.compile_spec(s, "ptx").decode()
    lists = [re.findall(r"\.param \.(u64|u32|b32|s32)", re.search(rf"\.entry {n}\((.*?)\)", ptx, re.S).group(1))
             for n in ("kda_conventional", BULK_KERNEL_NAME, "kda_replay_decode", BULK_REPLAY_KERNEL_NAME)]
    assert lists == [["u64"] * 9 + ["u32"] * 2 + ["u64"] * 2] * 2 + [["u64"] * 15 + ["u32"] * 2 + ["u64"] * 7] * 2
    with override(col_lanes=2, warps=4, bulk=True):
        planned = kda_spec("bf16", 12, 128, 128, 2, 256, conventional=True)
        shadow = kda_spec("bf16", 12, 128, 128, 16, 256, "bf16")
    assert kda_spec("bf16", 12, 128, 128, 16, 256).bulk is False  # only inside the pin
    assert planned.bulk and planned.min_blocks == 4 and planned.cols == 32
    assert shadow.bulk and not shadow.staged and shadow.passes == 1 and shadow.bulk_smem_bytes <= 48 * 1024
    assert planned.bulk_grid(256, 132) == (528, 1, 1) and planned.bulk_grid(1, 132) == (48, 1, 1)
    with pytest.raises(ValueError, match="bulk"):
        KDASpec(**BASE, bulk=True, num_tokens=4)
    with pytest.raises(ValueError, match="bulk"):
        KDASpec(**BASE, bulk=True, shadow="bf16", row_order=True)
    with pytest.raises(ValueError, match="bulk.*static shared memory"):
        KDASpec(**BASE, bulk=True)  # fp32 rows of 32 columns beside 15 ring entries: two stages of 35 KB
    with pytest.raises(TypeError, match="bulk"):
        KDASpec(**BASE, bulk=1)
    with pytest.raises(ValueError, match="bulk_flush"):
        KDASpec(**BASE, shadow="bf16", bulk_flush=True)
    f = KDASpec(**BASE, shadow="bf16", bulk=True, bulk_flush=True, resident=512)
    assert f.key.endswith("_r512_bkf_sm90") and "#define KDA_BULK_FLUSH 1" in f.prelude() and "KDA_BULK_FLUSH" not in s.prelude()
    assert f.flush_tile_bytes == f.smem_bytes and s.flush_tile_bytes == 0
    with override(col_lanes=2, warps=4, bulk=True, bulk_flush=True):
        assert kda_spec("bf16", 12, 128, 128, 16, 256, "bf16") == f
        assert not kda_spec("bf16", 12, 128, 128, 2, 256, conventional=True).bulk_flush  # the conventional module


def test_key_and_prelude():
    s = KDASpec(**BASE, shadow="bf16", lower_bound=-5.0)
    assert s.key == "kda_a-bf16_H12_K128_V128_L16_C2_W4_n1_sh-bf16_lb-5.0_sm90"
    assert KDASpec(**BASE).key == "kda_a-bf16_H12_K128_V128_L16_C2_W4_n1_sm90"
    lines = s.prelude()
    for want in ("using act_t = __nv_bfloat16;", "#define KDA_SHADOW 1", "#define KDA_LOWER_BOUND 1",
                 "constexpr float kLowerBound = -0x1.4000000000000p+2f;", "constexpr int kK = 128;",
                 "constexpr int kL = 16;", "constexpr float kScale = 0x1.6a09e60000000p-4f;  // 0.0883883461356163"):
        assert want in lines, want
    assert "kLowerBound" not in KDASpec(**BASE).prelude()
    assert cc.entry_file(s) == "kda/kda_decode.cu" and cc.kernel_names(s) == KERNEL_NAMES
    assert s.prelude() in cc.source(s)
    # the family registers its spec type: the spec log round-trips
    assert KDASpec in get("kda").spec_types
    assert cc.spec_from_json(cc.spec_to_json(s, "ptx")) == (s, "ptx")
    v = KDASpec(**BASE, num_tokens=4)
    assert v.key == "kda_T4_a-bf16_H12_K128_V128_L16_C2_W4_n1_sm90"
    assert "#define KDA_TOKENS 4" in v.prelude() and "KDA_TOKENS" not in KDASpec(**BASE).prelude()
    assert cc.entry_file(v) == "kda/kda_spec.cu" and cc.kernel_names(v) == SPEC_KERNEL_NAMES
    assert cc.spec_from_json(cc.spec_to_json(v, "ptx")) == (v, "ptx")
    # L = 16, T = 4: 2 (L - 2T) T history x window products, L - 2T history norms, T^2 window pairs, 2T window norms
    assert v.window_products == 64 + 8 + 16 + 8
    assert v.min_blocks == 3 and KDASpec(**BASE).min_blocks == 3  # verify: 168 registers (config: spills, faster)
    with override(resident=384):  # the register budget of a sweep: in the key, so modules never collide
        r = kda_spec("bf16", 12, 128, 128, 16, 256, num_tokens=4)
    assert r.min_blocks == 3 and r.key.endswith("_r384_sm90") and "_r" not in kda_spec("bf16", 12, 128, 128, 16, 64).key


@pytest.mark.parametrize("bad, match", [
    (dict(buffer_len=1), "buffer_len"), (dict(buffer_len=17), "buffer_len"), (dict(K=40), "KDASpec.K"),
    (dict(V=100), "KDASpec.V"), (dict(col_lanes=8), "col_lanes"), (dict(act="f8"), "act"),
    (dict(shadow="fp8"), "shadow"), (dict(lower_bound=1.0), "lower_bound"), (dict(warps=9), "warps"),
    (dict(K=256, col_lanes=4), "state values"),
    (dict(num_tokens=3), "num_tokens"), (dict(num_tokens=4, buffer_len=7), "num_tokens"),
    (dict(num_tokens=-1), "num_tokens"), (dict(num_tokens=2, K=256, V=64, warps=1), "2 key channels a thread"),
    (dict(resident=-1), "resident"),
    (dict(staged=True, num_tokens=4), "staged"),
    (dict(passes=2), "staged ring"), (dict(passes=3, staged=True), "passes"), (dict(passes=True, staged=True), "passes"),
    (dict(passes=2, staged=True, V=96, col_lanes=4, warps=2), "divide"),
    (dict(passes=2, staged=True, col_lanes=4), "static shared memory"),  # fp32 rows of the second pass: 32 KB more
])
def test_spec_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        KDASpec(**{**BASE, **bad})


def test_planner():
    assert kda_geometry(12, 128, 128, 256) == (4, 4)  # large grids: 4 lanes across a row, 4 warps
    assert kda_geometry(12, 128, 128, 256, conventional=True) == (4, 8)
    assert kda_geometry(12, 128, 128, 1, conventional=True)[1] < 4  # small batches: smaller blocks, more of them
    assert kda_geometry(12, 128, 128, 1) == (2, 4)  # replay: one channel a thread, 2 lanes a row for more blocks
    assert kda_geometry(2, 256, 64, 256)[0] == 2  # K = 256: 4 lanes would hold 128 state values a lane
    with override(col_lanes=4, warps=2):
        assert kda_geometry(12, 128, 128, 256) == (4, 2)
    assert kda_geometry(12, 128, 128, 256) == (4, 4)
    # the staged ring from 4 waves of blocks (STAGED_MIN_WAVES): bs256 at Kimi-K3 / GLM-5.3-Flash TP8, not bs1-64
    for H, lb in ((12, None), (8, -5.0)):
        for sh in ("none", "bf16"):
            assert kda_spec("bf16", H, 128, 128, 16, 256, sh, lower_bound=lb).staged
            assert not any(kda_spec("bf16", H, 128, 128, 16, b, sh, lower_bound=lb).staged for b in (1, 8, 32, 64))
    assert not kda_spec("bf16", 12, 128, 128, 16, 256, num_tokens=4).staged  # the verify module keeps its own step
    assert not kda_spec("bf16", 12, 128, 128, 2, 256, conventional=True).staged
    with override(staged=True):
        assert kda_spec("bf16", 12, 128, 128, 16, 1).staged
    with override(staged=False):
        assert not kda_spec("bf16", 12, 128, 128, 16, 256).staged
    # two passes a block: planned for the staged shadow modules (Kimi-K3 TP8 from bs128, GLM-5.3-Flash TP8 at bs256)
    for H, lb, first in ((12, None, 128), (8, -5.0, 256)):
        for b in (1, 8, 32, 64, 128, 256):
            sp = kda_spec("bf16", H, 128, 128, 16, b, "bf16", lower_bound=lb)
            assert sp.passes == (2 if b >= first else 1) and (sp.passes == 1 or sp.staged)
            assert kda_spec("bf16", H, 128, 128, 16, b, lower_bound=lb).passes == 1  # fp32: the rows tile does not fit
    with override(passes=1):
        assert kda_spec("bf16", 12, 128, 128, 16, 256, "bf16").passes == 1
    with override(staged=False):
        assert kda_spec("bf16", 12, 128, 128, 16, 256, "bf16").passes == 1
    with override(passes=2):  # two passes imply the staged ring and halve the grid
        p2 = kda_spec("bf16", 12, 128, 128, 16, 256, "bf16")
    assert p2.staged and p2.passes == 2 and p2.key.endswith("_st_p2_sm90")
    with override(passes=1):
        p1 = kda_spec("bf16", 12, 128, 128, 16, 256, "bf16")
    assert p2.grid(256) == (12, 256, 1) and p1.grid(256) == (24, 256, 1)
    for (H, K, V), batch in itertools.product(set(GEOMETRIES.values()), (1, 8, 64, 256)):
        kda_spec("bf16", H, K, V, 16, batch)  # every plan is a valid spec
        kda_spec("bf16", H, K, V, 2, batch, conventional=True)
        for T in (1, 2, 4, 6, 8):  # the verify module takes the replay step's plan
            v = kda_spec("bf16", H, K, V, 16, batch, num_tokens=T)
            assert (v.col_lanes, v.warps, v.num_tokens) == (*kda_geometry(H, K, V, batch), T)


# ---- launcher validation (CPU tensors: every check runs before require_cuda) -------------------------------
H, K, V, L, B, S = 2, 32, 16, 4, 3, 5


def _args(**kw):
    bf = torch.bfloat16
    a = dict(q=torch.zeros(B, H, K, dtype=bf), k=torch.zeros(B, H, K, dtype=bf), v=torch.zeros(B, H, V, dtype=bf),
             f=torch.zeros(B, H, K, dtype=bf), b=torch.zeros(B, H, dtype=bf), A_log=torch.zeros(H),
             dt_bias=torch.zeros(H, K), state=torch.zeros(S, H, K, V), k_cache=torch.zeros(S, H, L, K, dtype=bf),
             u_cache=torch.zeros(S, H, L, V), g_cache=torch.zeros(S, H, L, K),  # no shadow: an fp32 u ring
             v_cache=torch.zeros(S, H, L, V, dtype=bf), beta_cache=torch.zeros(S, H, L),
             cursor=torch.zeros(S, dtype=torch.int32), state_batch_indices=torch.arange(B, dtype=torch.int32))
    a.update(kw)
    return a


@pytest.mark.parametrize("kw, err, match", [
    (dict(dt_bias=torch.zeros(H)), ValueError, "dt_bias"),
    (dict(g_cache=torch.zeros(S, H, L, K, dtype=torch.bfloat16)), TypeError, "g_cache"),
    (dict(u_cache=torch.zeros(S, H, L, V, dtype=torch.bfloat16)), TypeError, "u_cache"),  # bf16 beside a shadow only
    (dict(shadow=torch.zeros(S, H, K, V, dtype=torch.bfloat16)), TypeError, "u_cache"),  # the shadow's ring is bf16
    (dict(beta_cache=torch.zeros(S, H, L + 1)), ValueError, "beta_cache"),
    (dict(k_cache=torch.zeros(S, H, L, K + 1, dtype=torch.bfloat16)), ValueError, "k_cache"),
    (dict(f=torch.zeros(B, H, K + 16, dtype=torch.bfloat16)), ValueError, "f"),
    (dict(b=torch.zeros(B, H, 1, dtype=torch.bfloat16)), ValueError, "b"),
    (dict(cursor=torch.zeros(S, dtype=torch.int64)), TypeError, "cursor"),
    (dict(cursor=torch.full((S,), L, dtype=torch.int32)), ValueError, "cursor"),
    (dict(state_batch_indices=torch.tensor([0, 0, 1], dtype=torch.int32)), ValueError, "state_batch_indices"),
    (dict(state_batch_indices=torch.tensor([0, S, 1], dtype=torch.int32)), ValueError, "state_batch_indices"),
    (dict(u_cache=torch.zeros(S, H, 17, V)), ValueError, "u_cache"),
    # the u-sum flush stages u_j by cp.async: a view one element off a 16-byte boundary is refused by name
    (dict(u_cache=torch.zeros(S * H * L * V + 1)[1:].view(S, H, L, V)), ValueError,
     "u_cache: expected a 16-byte aligned data pointer"),
    (dict(k_cache=torch.zeros(S * H * L * K + 1, dtype=torch.bfloat16)[1:].view(S, H, L, K)), ValueError,
     "k_cache: expected a 16-byte aligned data pointer"),
    (dict(g_cache=torch.zeros(S * H * L * K + 1)[1:].view(S, H, L, K)), ValueError,
     "g_cache: expected a 16-byte aligned data pointer"),
    (dict(state=torch.zeros(S, H, K, V)[..., ::2]), ValueError, "state"),
    (dict(q=torch.zeros(B, H, 40, dtype=torch.bfloat16), k=torch.zeros(B, H, 40, dtype=torch.bfloat16),
          f=torch.zeros(B, H, 40, dtype=torch.bfloat16), dt_bias=torch.zeros(H, 40)), ValueError, "K"),
])
def test_replay_validation_names_the_tensor(kw, err, match):
    with pytest.raises(err, match=match):
        kops.kda_replay_decode(**_args(**kw))


def test_options_and_cuda_last():
    with pytest.raises(ValueError, match="lower_bound"):
        kops.kda_replay_decode(**_args(), lower_bound=0.5)
    with pytest.raises(TypeError, match="use_qk_l2norm"):
        kops.kda_conventional_step(**{k: v for k, v in _args().items() if k in (
            "q", "k", "v", "f", "b", "A_log", "dt_bias", "state", "state_batch_indices")}, use_qk_l2norm=1)
    with pytest.raises(ValueError, match="CUDA"):  # everything else was valid: only the device is left
        kops.kda_replay_decode(**_args())
    with pytest.raises(ValueError, match="shadow"):
        kops.kda_replay_decode(**_args(u_cache=torch.zeros(S, H, L, V, dtype=torch.bfloat16)),
                               shadow=torch.zeros(S, H, K, V + 8, dtype=torch.bfloat16))


# ---- verify launcher validation --------------------------------------------------------------------------------
T = 2


def _vargs(**kw):
    bf = torch.bfloat16
    a = _args()
    a.update(q=torch.zeros(B, T, H, K, dtype=bf), k=torch.zeros(B, T, H, K, dtype=bf),
             v=torch.zeros(B, T, H, V, dtype=bf), f=torch.zeros(B, T, H, K, dtype=bf), b=torch.zeros(B, T, H, dtype=bf),
             cursor=torch.zeros(S, 2, dtype=torch.int32))
    a.update(kw)
    return a


@pytest.mark.parametrize("kw, err, match", [
    (dict(cursor=torch.zeros(S, dtype=torch.int32)), ValueError, "cursor"),
    (dict(cursor=torch.zeros(S, 2, dtype=torch.int64)), TypeError, "cursor"),
    (dict(cursor=torch.tensor([[0, L - T + 1]] * S, dtype=torch.int32)), ValueError, r"count \(column 1\)"),
    (dict(cursor=torch.tensor([[L, 0]] * S, dtype=torch.int32)), ValueError, r"start \(column 0\)"),
    (dict(q=torch.zeros(B, 3, H, K, dtype=torch.bfloat16)), ValueError, "T = 1 \\+ num_draft"),
    (dict(b=torch.zeros(B, T + 1, H, dtype=torch.bfloat16)), ValueError, "b"),
    (dict(v=torch.zeros(B, H, V, dtype=torch.bfloat16)), ValueError, "v"),
    (dict(f=torch.zeros(B, T, H, K), ), TypeError, "f"),
    (dict(out=torch.zeros(B, H, V, dtype=torch.bfloat16)), ValueError, "out"),
    (dict(state_batch_indices=torch.tensor([1, 1, -1], dtype=torch.int32)), ValueError, "state_batch_indices"),
    (dict(shadow=torch.zeros(S, H, K, V), u_cache=torch.zeros(S, H, L, V, dtype=torch.bfloat16)), TypeError, "shadow"),
])
def test_verify_validation_names_the_tensor(kw, err, match):
    with pytest.raises(err, match=match):
        kops.kda_replay_verify(**_vargs(**kw))


def test_verify_window_and_cuda_last():
    small = dict(k_cache=torch.zeros(S, H, 3, K, dtype=torch.bfloat16), u_cache=torch.zeros(S, H, 3, V),
                 g_cache=torch.zeros(S, H, 3, K), v_cache=torch.zeros(S, H, 3, V, dtype=torch.bfloat16),
                 beta_cache=torch.zeros(S, H, 3))
    with pytest.raises(ValueError, match=r"u_cache: ring length L \(dim 2\) expected in \[2T, 16\]"):
        kops.kda_replay_verify(**_vargs(**small))
    with pytest.raises(ValueError, match="lower_bound"):
        kops.kda_replay_verify(**_vargs(), lower_bound=1.0)
    with pytest.raises(ValueError, match="CUDA"):  # everything else was valid: only the device is left
        kops.kda_replay_verify(**_vargs())
    with pytest.raises(ValueError, match="u_cache"):
        kops.kda_spec_commit(torch.zeros(S, 2, dtype=torch.int32), torch.ones(B, dtype=torch.int32),
                             torch.arange(B, dtype=torch.int32), T, torch.zeros(S, H, V))
