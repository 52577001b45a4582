# SPDX-License-Identifier: Apache-2.0
"""GPU kernels against the references, step by step across several flushes.

Oracles:
- float64 reference (:mod:`trtllm_replayssm.families.mamba2.reference`) fed the very activation values the
  kernel sees, with its checkpoint rounded to the kernel's state dtype wherever the kernel stores
  one (after each flush for ReplaySSM, every step for the conventional kernel). This "mirror"
  leaves only the kernel's fp32 arithmetic and the rounding of y to the activation dtype.
- Bookkeeping exactly: x/B caches are copies of inputs (rtol = atol = 0), cursors exact, padding
  rows' y and unused slots bit-identical to what they were.
Tolerances (relative Frobenius norm over the valid rows):
- y in bf16: one rounding of 2^-9 relative per element -> 5e-3; f16 (2^-11) -> 2e-3;
  f32 with f32 state -> 2e-5 (fp32 sums of <= 3*dstate terms, exp/log1p in fp32).
- checkpoint after a flush: f32 -> 2e-5; bf16/f16 -> one storage rounding, 8e-3 / 2e-3.
- dt_cache: fp32 softplus vs float64 on the same inputs -> 1e-5 relative per element.
- Shadow (bf16 / fp8-e4m3 copy of an f32 checkpoint): after every flush the kernel's shadow must be
  bit-identical to ``reference.Shadow.write`` of the f32 checkpoint the kernel stored (bf16: one
  round-to-nearest-even; fp8: scale = max|row| / 448 and q = S / scale, IEEE fp32 divisions and RNE
  in both). The mirror then reads that very shadow, so y keeps the tolerances above.
"""

import zlib

import pytest
import torch

from trtllm_replayssm import config, cursor_ops
from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.mamba2 import ops
from trtllm_replayssm.families.mamba2 import reference as ref

from .helpers import check_shadow
from .problems import GEOMETRIES, make_inputs, make_params

pytestmark = pytest.mark.gpu
F64 = torch.float64
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
Y_TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3, torch.float32: 2e-5}
S_TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 2e-5}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


class Problem:
    """Kernel-side caches on the GPU and float64 mirrors on the CPU, evolving together."""

    def __init__(self, geom, state, act, L, batch, slots, pad_rows=(), has_z=False, seed=0, shadow="none"):
        H, P, N, G = GEOMETRIES[geom] if isinstance(geom, str) else geom
        self.H, self.P, self.N, self.G, self.L = H, P, N, G, L
        self.sdt, self.act, self.has_z, self.batch = DT[state], DT[act], has_z, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.prm = make_params(H, self.gen, "cuda")
        S0 = torch.randn(slots, H, P, N, generator=self.gen).to(self.sdt)
        self.state = S0.cuda()
        self.ref_state = S0.to(F64)
        self.shadow_kind = shadow
        self.ref_shadow = self.shadow = self.scale = None
        if shadow != "none":  # written at the hand-off, from the stored checkpoint
            self.ref_shadow = shadowq.Shadow.of(S0, shadow)
            self.shadow = self.ref_shadow.q.cuda()
            self.scale = None if self.ref_shadow.scale is None else self.ref_shadow.scale.cuda()
        # Buffers start poisoned: entries beyond the cursor must never be read.
        self.xc = torch.full((slots, H, L, P), float("nan"), dtype=self.act, device="cuda")
        self.Bc = torch.full((slots, G, L, N), float("nan"), dtype=self.act, device="cuda")
        self.dtc = torch.full((slots, H, L), float("nan"), device="cuda")
        self.ref_xc, self.ref_Bc, self.ref_dtc = self.xc.cpu(), self.Bc.cpu(), self.dtc.cpu().to(F64)
        self.cursor = torch.zeros(slots, dtype=torch.int32, device="cuda")
        self.ref_cursor = self.cursor.cpu()
        sbi = torch.randperm(slots, generator=self.gen)[:batch].to(torch.int32)
        sbi[list(pad_rows)] = -1
        self.sbi = sbi.cuda()
        self.valid = sbi >= 0
        self.unused = sorted(set(range(slots)) - set(sbi[self.valid].tolist()))

    def inputs(self):
        t = make_inputs(self.batch, self.H, self.P, self.N, self.G, self.act, self.gen, "cuda", self.has_z)
        return t

    def prm_args(self):
        p = self.prm
        return p.dt_bias, p.A, p.D

    def snapshot_unused(self):
        u = self.unused
        extra = [t for t in (self.shadow, self.scale) if t is not None]
        return [t[u].clone() for t in (self.state, self.xc, self.Bc, self.dtc, self.cursor, *extra)]

    def replay_step(self):
        x, B, C, dt, z = self.inputs()
        flushing = [s for s in self.sbi.cpu().tolist() if s >= 0 and int(self.ref_cursor[s]) == self.L - 1]
        y = torch.full_like(x, float("nan"))
        ops.replay_decode(x, B, C, dt, *self.prm_args(), self.state, self.xc, self.Bc, self.dtc, self.cursor,
                          self.sbi, z=z, out=y, shadow=self.shadow, shadow_scale=self.scale)
        cursor_ops.advance_cursor(self.cursor, self.sbi, self.L)
        cpu = [None if t is None else t.cpu().to(F64) for t in (x, B, C, dt, z)]
        y_ref = ref.replay_decode(self.ref_state, self.ref_xc, self.ref_Bc, self.ref_dtc, self.ref_cursor,
                                  *cpu[:4], *(t.cpu().double() for t in self.prm_args()), cpu[4], self.sbi.cpu(),
                                  shadow=self.ref_shadow)
        cursors.advance_cursor(self.ref_cursor, self.sbi.cpu(), self.L)
        for s in flushing:  # the kernel stores the new checkpoint in its state dtype
            self.ref_state[s] = self.ref_state[s].to(self.sdt).to(F64)
            if self.shadow is not None:
                self.check_shadow(s)
        return y, y_ref, flushing

    check_shadow = check_shadow  # tests/helpers.py

    def conventional_step(self):
        x, B, C, dt, z = self.inputs()
        y = torch.full_like(x, float("nan"))
        ops.conventional_step(x, B, C, dt, *self.prm_args(), self.state, self.sbi, z=z, out=y)
        cpu = [None if t is None else t.cpu().to(F64) for t in (x, B, C, dt, z)]
        y_ref = ref.conventional_step(self.ref_state, *cpu[:4], *(t.cpu().double() for t in self.prm_args()),
                                      cpu[4], self.sbi.cpu())
        used = self.sbi.cpu()[self.valid].long()
        self.ref_state[used] = self.ref_state[used].to(self.sdt).to(F64)
        return y, y_ref

    def check_y(self, y, y_ref):
        v = self.valid.cuda()
        assert torch.isnan(y[~v]).all(), "padding rows' output was written"
        assert not torch.isnan(y[v]).any(), "some output elements were not written"
        err = rel(y[v].cpu(), y_ref[self.valid])
        assert err < Y_TOL[self.act], f"y relative error {err:.3e}"
        return err

    def check_buffers(self):
        used = self.sbi.cpu()[self.valid].long()
        assert torch.equal(self.cursor.cpu(), self.ref_cursor)
        for s in used.tolist():
            k = int(self.ref_cursor[s])
            assert torch.equal(self.xc[s, :, :k].cpu(), self.ref_xc[s, :, :k])
            assert torch.equal(self.Bc[s, :, :k].cpu(), self.ref_Bc[s, :, :k])
            torch.testing.assert_close(self.dtc[s, :, :k].cpu().double(), self.ref_dtc[s, :, :k], rtol=1e-5, atol=0)

    def check_state(self, slots):
        for s in slots:
            err = rel(self.state[s].cpu(), self.ref_state[s])
            assert err < S_TOL[self.sdt], f"checkpoint of slot {s}: relative error {err:.3e}"


def run_and_check(pb):
    """3L+2 steps (three flushes per row), each checked against the mirror; unused slots bit-identical."""
    before = pb.snapshot_unused()
    flushed = 0
    for _ in range(3 * pb.L + 2):
        y, y_ref, flushing = pb.replay_step()
        pb.check_y(y, y_ref)
        pb.check_buffers()
        pb.check_state(flushing)
        flushed += len(flushing)
    assert flushed >= 3 * int(pb.valid.sum())
    for now, then in zip(pb.snapshot_unused(), before):
        assert torch.equal(now.view(torch.uint8) if now.dtype != torch.int32 else now,
                           then.view(torch.uint8) if then.dtype != torch.int32 else then)


BASE = dict(geom="tiny", state="f32", act="bf16", L=4, batch=3, slots=5, pad_rows=(1,), has_z=False)
CASES = [
    BASE,
    {**BASE, "act": "f16"},
    {**BASE, "act": "f32"},
    {**BASE, "state": "bf16"},
    {**BASE, "state": "f16", "act": "f16"},
    {**BASE, "has_z": True},
    {**BASE, "L": 8},
    {**BASE, "L": 16},
    {**BASE, "L": 32},
    {**BASE, "pad_rows": ()},
    {**BASE, "batch": 1, "slots": 2, "pad_rows": ()},
    {**BASE, "geom": (8, 128, 64, 8)},
    {**BASE, "geom": (4, 64, 256, 1)},
    {**BASE, "geom": "nemotron_h_8b", "L": 16},
    {**BASE, "geom": "nano_9b_v2", "L": 8},
    {**BASE, "geom": "h_56b", "L": 4},
    {**BASE, "geom": "nemotron_h_8b", "state": "bf16", "act": "bf16", "L": 8, "batch": 20, "slots": 24, "pad_rows": (0, 7)},
    {**BASE, "geom": "nemotron3_nano", "L": 16},  # Nemotron 3 Nano 30B-A3B Mamba layer: 64 heads, 8 per group
    {**BASE, "geom": "nemotron3_super", "L": 16, "batch": 20, "slots": 24, "pad_rows": (0, 7)},
    # the staged fp32 plan at batch <= 2 (config.STAGED_SMALL_BATCH: R16 W4 at bs1, R32 W8 at bs2 on this geometry)
    {**BASE, "geom": "nemotron_h_8b", "L": 16, "batch": 1, "slots": 2, "pad_rows": ()},
    {**BASE, "geom": "nemotron_h_8b", "L": 16, "batch": 2, "slots": 4, "pad_rows": ()},
    # headdim 80 in 20-row items at odd L: the x tile is not a multiple of 16 bytes, the stage's C must stay aligned
    {**BASE, "geom": (4, 80, 128, 2), "L": 5, "batch": 1, "slots": 2, "pad_rows": ()},
]


def _id(c):
    return ",".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v) or "base"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_replay_decode_matches_reference(case):
    run_and_check(Problem(**case, seed=zlib.crc32(_id(case).encode())))


@pytest.mark.parametrize("case", [c for c in CASES if c["L"] == 4 or c is CASES[13]], ids=_id)
def test_conventional_matches_reference(case):
    pb = Problem(**case, seed=1 + zlib.crc32(_id(case).encode()))
    before = pb.snapshot_unused()
    for _ in range(6):
        y, y_ref = pb.conventional_step()
        pb.check_y(y, y_ref)
        pb.check_state(pb.sbi.cpu()[pb.valid].tolist())
    assert torch.equal(pb.snapshot_unused()[0].view(torch.uint8), before[0].view(torch.uint8))


# The staged one-shot kernel (RSSM_STAGED: every tile by cp.async, flush folded 2 rows at a time,
# 6 resident 256-thread blocks = 40 registers) on every decode case.
STAGED = config.Variant("staged", min_blocks=6, flush_rows=2)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_staged_replay_decode_matches_reference(case):
    pb = Problem(**case, seed=2 + zlib.crc32(_id(case).encode()))
    with config.override_variant(STAGED):
        run_and_check(pb)


SHADOW_BASE = {**BASE, "L": 8}
SHADOW_CASES = [
    {**SHADOW_BASE, "shadow": "bf16"},
    {**SHADOW_BASE, "shadow": "fp8"},
    {**SHADOW_BASE, "shadow": "fp8", "has_z": True, "act": "f16"},
    {**SHADOW_BASE, "shadow": "bf16", "geom": (4, 64, 256, 1), "L": 4},
    {**SHADOW_BASE, "shadow": "fp8", "geom": "nano_9b_v2", "L": 16},
    {**SHADOW_BASE, "shadow": "bf16", "geom": "nemotron_h_8b", "L": 16, "batch": 20, "slots": 24, "pad_rows": (0, 7)},
    {**SHADOW_BASE, "shadow": "fp8", "geom": "nemotron_h_8b", "L": 16, "batch": 20, "slots": 24, "pad_rows": (0, 7)},
    {**SHADOW_BASE, "shadow": "bf16", "geom": "nemotron3_nano", "L": 16},
    {**SHADOW_BASE, "shadow": "fp8", "geom": "nemotron3_super", "L": 16},
    # f32 activations, dstate 256, L = 32: the staged stage outgrows the one-shot tiles (planned by its own size)
    {**SHADOW_BASE, "shadow": "fp8", "act": "f32", "geom": (4, 80, 256, 2), "L": 32, "batch": 8, "slots": 9},
    {**SHADOW_BASE, "shadow": "bf16", "geom": (4, 80, 128, 2), "L": 3, "batch": 1, "slots": 2, "pad_rows": ()},
    # headdim 80 x dstate 64 above batch 4: 80 rows on 4 warps (planned 80 rows on 2 warps before 05e42e33bb)
    {**SHADOW_BASE, "shadow": "bf16", "geom": (32, 80, 64, 4), "L": 8, "batch": 16, "slots": 18, "pad_rows": (1,)},
    {**SHADOW_BASE, "shadow": "fp8", "geom": (32, 80, 64, 4), "L": 5, "batch": 16, "slots": 18, "pad_rows": (1,)},
]
VARIANTS = {"persistent": config.Variant("persistent", 5), "one-shot": config.Variant("one_shot", 5), "staged": STAGED}


def _sid(c):
    return ",".join(f"{k}={v}" for k, v in c.items() if SHADOW_BASE.get(k, "none") != v)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", SHADOW_CASES, ids=_sid)
def test_replay_decode_with_shadow(case, variant):
    """Non-flush steps read the shadow, flushes rewrite it exactly; both kernel variants."""
    pb = Problem(**case, seed=zlib.crc32((_sid(case) + variant).encode()))
    with config.override_variant(VARIANTS[variant]):
        run_and_check(pb)


# 64-row items of 4 warps (16 rows a thread: the template-level row butterfly, NOTES "Next for the shadow
# steps"); pinned, since no plan picks the shape yet. Every storage form, padding rows, across flushes.
W4_CASES = [
    {**BASE, "geom": (8, 64, 128, 2), "L": 16, "batch": 6, "slots": 8, "pad_rows": (2,), "shadow": sh}
    for sh in ("none", "bf16", "fp8")
] + [{**BASE, "geom": (8, 64, 128, 2), "L": 8, "batch": 6, "slots": 8, "pad_rows": (2,), "shadow": "fp8", "has_z": True}]


@pytest.mark.parametrize("min_blocks", (8, 12))
@pytest.mark.parametrize("case", W4_CASES, ids=_sid)
def test_staged_rows64_warps4(case, min_blocks):
    pb = Problem(**case, seed=min_blocks + zlib.crc32(_sid(case).encode()))
    with config.override_variant(config.Variant("staged", min_blocks, 2)), config.override_geometry(64, 4):
        run_and_check(pb)


# The staged kernel with bulk copies (copy="bulk": thread 0 stages the item by cp.async.bulk on an mbarrier;
# pinned, not yet planned): every storage form, the x history as one piece (rows = headdim) and per entry
# (rows < headdim), odd L, f16 activations with the z gate, padding rows; across three flushes each.
BULK_CASES = [
    ({**BASE, "geom": (8, 64, 128, 2), "L": 16, "batch": 6, "slots": 8, "pad_rows": (2,), "shadow": sh}, (64, 8))
    for sh in ("none", "bf16", "fp8")
] + [
    ({**BASE, "geom": (8, 64, 128, 2), "L": 16, "batch": 6, "slots": 8, "pad_rows": (2,), "shadow": "fp8"}, (64, 4)),
    ({**BASE, "geom": (8, 64, 128, 2), "L": 5, "batch": 5, "slots": 7, "pad_rows": (0,), "shadow": "bf16"}, (16, 4)),
    ({**BASE, "geom": (4, 64, 256, 1), "L": 8, "act": "f16", "has_z": True, "shadow": "fp8"}, (32, 8)),
    ({**BASE, "geom": (4, 64, 128, 2), "L": 4, "act": "f32", "state": "f32"}, (32, 4)),
]


@pytest.mark.parametrize("case, shape", BULK_CASES, ids=lambda v: _sid(v) if isinstance(v, dict) else f"R{v[0]}W{v[1]}")
def test_staged_bulk_copies(case, shape):
    pb = Problem(**case, seed=3 + zlib.crc32((_sid(case) + str(shape)).encode()))
    with config.override_variant(config.Variant("staged", 8, 2, "bulk")), config.override_geometry(*shape):
        run_and_check(pb)


def test_shadow_is_what_the_output_reads():
    """Teeth: perturb the shadow (not the f32 checkpoint) of one slot and y must move."""
    pb = Problem(**{**SHADOW_BASE, "shadow": "bf16"}, seed=5)
    pb.check_y(*pb.replay_step()[:2])
    pb.shadow[int(pb.sbi[0])] *= 2
    y, y_ref, _ = pb.replay_step()
    with pytest.raises(AssertionError):
        pb.check_y(y, y_ref)


def test_teeth_corrupted_cache_fails_the_comparison():
    pb = Problem(**BASE, seed=7)
    for _ in range(2):
        pb.check_y(*pb.replay_step()[:2])
    s = int(pb.sbi[0])
    pb.xc[s, :, 1] += 4.0  # the newest used entry of every head; the mirror keeps the true values
    y, y_ref, _ = pb.replay_step()
    with pytest.raises(AssertionError):
        pb.check_y(y, y_ref)


def test_long_run_fp32_stays_within_1e5_of_float64():
    """1024 steps (64 flushes at L=16), fp32 state and activations: no drift beyond 1e-5."""
    pb = Problem(geom=(8, 64, 128, 2), state="f32", act="f32", L=16, batch=2, slots=2, seed=11)
    worst = 0.0
    for _ in range(1024):
        y, y_ref, _ = pb.replay_step()
        worst = max(worst, rel(y.cpu(), y_ref))
    assert worst < 1e-5, worst


def test_bad_indices_rejected_before_launch():
    pb = Problem(**BASE, seed=3)
    x, B, C, dt, z = pb.inputs()
    args = (x, B, C, dt, *pb.prm_args(), pb.state, pb.xc, pb.Bc, pb.dtc, pb.cursor)
    with pytest.raises(ValueError, match="state_batch_indices"):
        ops.replay_decode(*args, torch.tensor([0, 9, 1], dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="more than one row"):
        ops.replay_decode(*args, torch.tensor([0, 0, 1], dtype=torch.int32, device="cuda"))
    pb.cursor[int(pb.sbi[0])] = pb.L
    with pytest.raises(ValueError, match="cursor"):
        ops.replay_decode(*args, pb.sbi)
