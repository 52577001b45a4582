# SPDX-License-Identifier: Apache-2.0
"""KDA speculative verify (plugins/kda/kda_spec.cu) against trtllm_replayssm/families/kda/reference.py, step by step.

Each step: the kernel's ``kda_replay_verify`` (flush decided on the pre-step cursor, folded inside the launch) then
``kda_spec_commit`` (the shared ``replayssm_spec_commit`` kernel), against the reference's flush_checkpoint +
flush_cursor + verify + commit, with random acceptance (n in 1..T, some rows n = 0), so the rings wrap and flushes
happen at counts across (L - 2T, L - T].

Oracles:
- float64 reference evolving on its own from the same initial checkpoint and random rings, fed the very activation
  values the kernel sees and storing into tensors of the kernel's dtypes (f32 state, g, beta; act k, v; bf16 u). What
  is left is the kernel's fp32 arithmetic and triangular route (reference.verify_triangular ties it to the
  recurrence in float64, tests/test_kda_reference.py) and the roundings to bf16 / the act dtype.
- Bookkeeping exactly (rtol = atol = 0): cursors, the k and v rings (copies of the inputs), padding rows' y still
  NaN, unused slots of every tensor bit-identical; the shadow of a folded slot equal to the bf16 rounding of the
  checkpoint the kernel stored (then copied into the reference's shadow, which the next steps read).
Tolerances (relative Frobenius norm over the rows with a slot), tests/test_kda_gpu.py's and why:
- y: bf16 output rounding 2^-9, plus the bf16 u ring (values on either side of a rounding boundary feeding up to
  L - T later outputs) -> 1e-2; f16 / f32 act -> 4e-3 (the bf16 u ring dominates).
- state, g / beta rings: 1e-4 (fp32 fold of <= L - T entries from k, v, g, beta, never from the bf16 u; expf and
  log1pf of a few ulp), compounded over the steps of a contractive recurrence.
- u ring: 1e-2 (bf16 rounding as for y).
- y with a bf16 shadow: 2e-2 (S0 read through one bf16 rounding, 2^-9 per element, averaged over K terms).
"""

import zlib

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm.families.kda import GEOMETRIES
from trtllm_replayssm.families.kda import ops as kops
from trtllm_replayssm.families.kda import reference as kref
from trtllm_replayssm.families.kda.config import override
from trtllm_replayssm.shadow import Shadow

from .test_kda_gpu import F32_TOL, SHADOW_Y_TOL, Y_TOL, make_buffers, make_params, rel

pytestmark = pytest.mark.gpu
STEPS = 24
U_TOL = 1e-2


def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda")


class SpecProblem:
    """Kernel-side tensors on the GPU and the reference's on the CPU, evolving side by side."""

    def __init__(self, geom, act, L, T, batch, slots, pads=(1,), seed=0, shadow=False, lb=None, l2=True,
                 p_zero=0.15):
        cuda()
        H, K, V = geom
        self.H, self.K, self.V, self.L, self.T, self.act, self.batch = H, K, V, L, T, act, batch
        self.lb, self.l2, self.p_zero = lb, l2, p_zero
        self.gen = g = torch.Generator().manual_seed(seed)
        self.A_log, self.dt_bias = make_params(H, K, g)
        self.ref = make_buffers(slots, H, K, V, L, act, g, l2, shadow)
        self.rcursor = torch.stack([torch.randint(0, L, (slots,), generator=g),
                                    torch.randint(0, L - T + 1, (slots,), generator=g)], 1).to(torch.int32)
        perm = torch.randperm(slots, generator=g)[:batch].to(torch.int32)
        for r in pads:
            perm[r] = -1
        self.sbi_cpu, self.sbi = perm, perm.cuda()
        self.cursor = self.rcursor.cuda()
        self.buf = kref.KDABuffers(*(t.cuda() for t in self.ref.tensors()))
        self.rshadow = Shadow.of(self.ref.state, "bf16") if shadow else None
        self.shadow = None if self.rshadow is None else self.rshadow.q.cuda()
        self.used = sorted(int(s) for s in perm if s >= 0)
        self.unused = [s for s in range(slots) if s not in self.used]
        self.valid = (perm >= 0).nonzero()[:, 0]
        self.initial_unused = self.snapshot(self.unused)
        self.flushes = 0

    def tensors(self):
        return list(self.buf.tensors()) + [self.cursor] + ([self.shadow] if self.shadow is not None else [])

    def snapshot(self, slots):
        idx = torch.tensor(slots, dtype=torch.long, device="cuda")
        return [t.index_select(0, idx).clone() for t in self.tensors()]

    def inputs(self):
        g, act, b, T, H, K, V = self.gen, self.act, self.batch, self.T, self.H, self.K, self.V
        ks = 1.0 if self.l2 else K ** -0.5  # without the norm, |k| ~ 1 keeps the delta rule contractive
        return ((torch.randn(b, T, H, K, generator=g) * ks).to(act), (torch.randn(b, T, H, K, generator=g) * ks).to(act),
                torch.randn(b, T, H, V, generator=g).to(act), torch.randn(b, T, H, K, generator=g).to(act),
                torch.randn(b, T, H, generator=g).to(act))

    def acceptance(self):
        n = torch.randint(1, self.T + 1, (self.batch,), generator=self.gen)
        n[torch.rand(self.batch, generator=self.gen) < self.p_zero] = 0
        return n.to(torch.int32)

    def verify(self, inp, check_values=None):
        y = torch.full((self.batch, self.T, self.H, self.V), float("nan"), dtype=self.act, device="cuda")
        kops.kda_replay_verify(*(t.cuda() for t in inp), self.A_log.cuda(), self.dt_bias.cuda(), *self.buf.tensors(),
                               self.cursor, self.sbi, out=y, shadow=self.shadow, use_qk_l2norm=self.l2,
                               lower_bound=self.lb, check_values=check_values)
        return y.cpu()

    def ref_verify(self, inp):
        flushed = kref.flush_checkpoint(self.ref, self.rcursor, self.T, self.sbi_cpu, self.rshadow, self.l2)
        cursors.flush_cursor(self.rcursor, self.T, self.L, self.sbi_cpu)
        y = kref.verify(self.ref, self.rcursor, *inp, self.A_log, self.dt_bias, self.sbi_cpu, shadow=self.rshadow,
                        flushed=flushed, use_qk_l2norm=self.l2, lower_bound=self.lb)
        return y, flushed

    def step(self, inp=None, n=None, check=True):
        """One kernel step (verify + commit) and one reference step on the same inputs; returns (y, y_ref, flushed)."""
        inp = inp or self.inputs()
        n = self.acceptance() if n is None else n
        y = self.verify(inp)
        kops.kda_spec_commit(self.cursor, n.cuda(), self.sbi, self.T, self.buf.u_cache)
        y_ref, flushed = self.ref_verify(inp)
        cursors.commit(self.rcursor, n, self.T, self.L, self.sbi_cpu)
        self.flushes += len(flushed)
        if check:
            self.check(y, y_ref, flushed)
        return y, y_ref, flushed

    def check(self, y, y_ref, flushed):
        pad = (self.sbi_cpu < 0).nonzero()[:, 0]
        assert torch.isnan(y[pad]).all(), "padding rows were written"
        assert not torch.isnan(y[self.valid]).any(), "rows with a slot were left unwritten"
        tol = SHADOW_Y_TOL if self.shadow is not None else Y_TOL[self.act]
        e = rel(y[self.valid], y_ref[self.valid])
        assert e < tol, f"y: rel err {e:.2e} >= {tol}"
        u = torch.tensor(self.used, dtype=torch.long)
        assert torch.equal(self.cursor.cpu(), self.rcursor), "cursor"
        for name in ("k_cache", "v_cache"):  # copies of the inputs
            assert torch.equal(getattr(self.buf, name).cpu()[u], getattr(self.ref, name)[u]), f"{name}: not exact"
        for name, tol in (("state", F32_TOL), ("g_cache", F32_TOL), ("beta_cache", F32_TOL), ("u_cache", U_TOL)):
            err = rel(getattr(self.buf, name).cpu()[u], getattr(self.ref, name)[u])
            assert err < tol, f"{name}: rel err {err:.2e} >= {tol}"
        if self.shadow is not None:
            for s in flushed:  # the kernel's shadow is bf16 of the checkpoint it stored, bit for bit
                got = self.shadow[s].cpu()
                assert torch.equal(got.view(torch.int16), self.buf.state[s].cpu().to(torch.bfloat16).view(torch.int16))
                self.rshadow.q[s] = got  # the reference reads what the kernel will read
        for before, after in zip(self.initial_unused, self.snapshot(self.unused)):
            assert torch.equal(before.view(torch.uint8), after.view(torch.uint8)), "an unused slot was written"


KIMI, GLM = GEOMETRIES["kimi_k3_tp8"], GEOMETRIES["glm5_3_flash_tp8"]
# Base row, then rows that change one field each: (name, (H, K, V), act, L, T, batch, slots, pads, lb, l2, shadow).
CASES = [
    ("kimi_k3_tp8_T4", KIMI, torch.bfloat16, 16, 4, 3, 6, (1,), None, True, False),
    ("kimi_k3_tp8_T4_shadow", KIMI, torch.bfloat16, 16, 4, 3, 6, (1,), None, True, True),
    ("glm5_3_flash_tp8_T2_shadow", GLM, torch.bfloat16, 16, 2, 3, 5, (0,), -5.0, True, True),
    ("kimi_T1", KIMI, torch.bfloat16, 16, 1, 3, 6, (1,), None, True, False),
    ("kimi_T6", KIMI, torch.bfloat16, 16, 6, 3, 6, (1,), None, True, False),
    ("kimi_T8_L16", KIMI, torch.bfloat16, 16, 8, 2, 4, (), None, True, False),  # no history: every window folds or m=0
    ("odd_f32_L4_T2", (3, 48, 40), torch.float32, 4, 2, 4, 7, (1,), None, True, False),
    ("odd_f16_nonorm_L5_T2", (5, 64, 24), torch.float16, 5, 2, 5, 9, (1, 3), -3.0, False, False),
    ("k256_L4_T2_shadow", (2, 256, 64), torch.bfloat16, 4, 2, 3, 4, (1,), None, True, True),
    ("many_rows_T4", (4, 128, 128), torch.bfloat16, 16, 4, 21, 25, (0, 5, 20), None, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_verify_commit_matches_reference(case):
    _run(case)


# The planner's small-batch shape (2 lanes a row) runs above; its large-batch shape (4 lanes, 4 warps), pinned, here.
SHAPED = [CASES[0], CASES[2], CASES[3], CASES[9]]


@pytest.mark.parametrize("case", SHAPED, ids=[c[0] + "-C4W4" for c in SHAPED])
def test_verify_large_batch_shape(case):
    with override(col_lanes=4, warps=4):
        _run(case)


def _run(case):
    _, geom, act, L, T, batch, slots, pads, lb, l2, shadow = case
    pb = SpecProblem(geom, act, L, T, batch, slots, pads, seed=zlib.crc32(case[0].encode()) % 1000, shadow=shadow, lb=lb, l2=l2)
    for _ in range(STEPS):
        pb.step()
    assert pb.flushes > 0, "no fold in the steps: the test did not exercise the flush"


def test_all_rejected_then_full_acceptance():
    """n = 0 for every row (the cursor moves only by a flush), then n = T: the boundaries of commit."""
    pb = SpecProblem((2, 64, 64), torch.float32, 8, 2, 3, 5, seed=17)
    for n in [0] * 4 + [2] * 8:
        pb.step(n=torch.full((3,), n, dtype=torch.int32))
    assert pb.flushes > 0


def test_later_nan_does_not_reach_earlier_outputs():
    """A NaN in the last window token of one row (q, k, v, f, b) leaves that row's earlier outputs and every other row
    as the reference computes them (the reference slices the window, never masks: a zero weight times NaN is NaN)."""
    pb = SpecProblem(KIMI, torch.bfloat16, 16, 4, 3, 6, (), seed=23)
    q, k, v, f, b = pb.inputs()
    for t in (q, k, v, f, b):
        t[1, -1] = float("nan")
    y = pb.verify((q, k, v, f, b))
    y_ref, _ = pb.ref_verify((q, k, v, f, b))
    assert torch.isnan(y[1, -1]).all()
    early = y[:, :-1]
    assert not torch.isnan(early).any(), "a later token's NaN reached an earlier output"
    assert rel(early, y_ref[:, :-1]) < Y_TOL[torch.bfloat16]
    assert rel(y[[0, 2]], y_ref[[0, 2]]) < Y_TOL[torch.bfloat16]


def test_corrupt_cursor_gives_nan_and_writes_nothing():
    """Unchecked (check_values=False), a row whose count is past L - T gets NaN y; nothing of its slot is written."""
    pb = SpecProblem((2, 64, 64), torch.float32, 8, 2, 2, 4, (), seed=19)
    s = pb.used[0]
    pb.cursor[s, 1] = 7
    before = [t.clone() for t in pb.tensors()]
    y = pb.verify(pb.inputs(), check_values=False)
    row = int((pb.sbi_cpu == s).nonzero()[0, 0])
    assert torch.isnan(y[row]).all() and not torch.isnan(y[1 - row]).any()
    for t0, t1 in zip(before, pb.tensors()):
        assert torch.equal(t0[s], t1[s]), "a corrupt cursor's slot was written"


def test_teeth_corrupt_one_committed_entry():
    """The oracle is not vacuous: one corrupted committed g_j (every older entry and S0 decay through it) on the
    kernel side makes y fail its tolerance."""
    pb = SpecProblem(KIMI, torch.float32, 16, 4, 2, 4, (), seed=13, p_zero=0.0)
    s = pb.used[0]
    pb.cursor[s] = torch.tensor([3, 0], dtype=torch.int32, device="cuda")
    pb.rcursor[s] = torch.tensor([3, 0], dtype=torch.int32)
    pb.step(n=torch.full((2,), 4, dtype=torch.int32))  # commits 4 entries at ring 3..6; no fold next (4 + 8 <= 16)
    pb.buf.g_cache[s, 1, 5] = -20.0  # committed entry 2 of slot s, head 1: every channel forgets
    with pytest.raises(AssertionError, match="y: rel err"):
        pb.step()
