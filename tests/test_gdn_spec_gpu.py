# SPDX-License-Identifier: Apache-2.0
"""GDN speculative kernels (plugins/gdn/gdn_spec.cu) against trtllm_replayssm/families/gdn/reference.py, step by step.

Each step: the kernel's ``gdn_replay_verify`` (flush decided on the pre-step cursor, folded inside the
launch) then ``gdn_spec_commit`` (the Mamba-2 ``replayssm_spec_commit`` kernel through cursor_ops.spec_commit),
against the reference's flush_checkpoint + cursor.flush_cursor + verify + cursor.commit,
with random acceptance (n in 1..T, some rows n = 0) over 40 steps, so the rings wrap and flushes happen
at every count in (L - 2T, L - T].

Oracles:
- float64 reference (:mod:`trtllm_replayssm.families.gdn.reference`) evolving on its own from the same initial
  checkpoint and rings, fed the very activation values the kernel sees, storing into tensors of the
  kernel's dtypes. What is left is the kernel's fp32 arithmetic (and its triangular route: the window
  from the 2T products S_m k_t, S_m q_t and a T x T forward substitution, where the reference runs the
  recurrence step by step; gdn_reference.verify_triangular ties the two in float64) and y's rounding.
- Bookkeeping exactly: cursors (rtol = atol = 0), v_cache a copy of the inputs, padding rows' y still
  NaN, unused slots of every tensor bit-identical. The whole ring is compared (committed entries and the
  stale window entries beyond count, which both sides wrote at the same ring indices).
- bf16 shadow: after each flush the kernel's shadow is bit-identical to bf16 of the checkpoint it stored,
  and that checkpoint equals the no-shadow kernel run's up to fp32 rounding (the fold reads v_j and the
  fp32 checkpoint, never the shadow).
- Native baseline: gdn_native_spec_verify + gdn_native_spec_commit against gdn_reference.native_spec_verify
  + spec_reference.native_spec_commit (snapshots, y, the committed state).
Tolerances (relative Frobenius norm over the valid rows), as tests/test_gdn_gpu.py and why:
- y: bf16 one rounding (<= 2^-9 relative) -> 5e-3; f16 -> 2e-3; f32 -> 5e-5 (fp32 sums of <= 2K + L + T
  terms per output, compounded over 40 steps of a contractive recurrence: exp(g) < 1, I - beta k k^T).
- state, u/k/g/beta rings, snapshots: 5e-5 (fp32 arithmetic, the same compounding; g, beta via exp / log1p).
- y with a bf16 shadow vs the no-shadow float64 run: 1.5e-2 (S0 through one bf16 rounding, 2^-9 per element).
"""

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.gdn import ops as gdn_ops
from trtllm_replayssm.families.gdn import reference as gref
from trtllm_replayssm.geometries import GDN_GEOMETRIES

from .test_gdn_gpu import F32_TOL, SHADOW_Y_TOL, Y_TOL, make_params, rel

pytestmark = pytest.mark.gpu
QWEN3_NEXT = GDN_GEOMETRIES["qwen3_next_80b"]  # (HV, H, V, K) = (32, 16, 128, 128)
STEPS = 40


class SpecProblem:
    """Kernel-side tensors on the GPU and the reference's on the CPU, evolving side by side."""

    def __init__(self, geom, act, L, T, batch, slots, pad_rows=(), seed=0, shadow=False, p_zero=0.15):
        HV, H, V, K = geom
        self.HV, self.H, self.V, self.K, self.L, self.T, self.act, self.batch = HV, H, V, K, L, T, act, batch
        self.p_zero = p_zero
        self.gen = torch.Generator().manual_seed(seed)
        g = self.gen
        self.prm = make_params(HV, g)
        self.rbuf = gref.GDNBuffers.alloc(slots, HV, H, V, K, L, act=act)
        self.rbuf.state.copy_(torch.randn(slots, HV, V, K, generator=g) * 0.05)
        self.rbuf.u_cache.copy_(torch.randn(slots, HV, L, V, generator=g) * 0.1)
        self.rbuf.v_cache.copy_(torch.randn(slots, HV, L, V, generator=g).to(act))
        kc = torch.randn(slots, H, L, K, generator=g)
        self.rbuf.k_cache.copy_(kc / kc.norm(dim=-1, keepdim=True))
        self.rbuf.g_cache.copy_(-torch.rand(slots, HV, L, generator=g) * 0.5)
        self.rbuf.beta_cache.copy_(torch.rand(slots, HV, L, generator=g))
        self.rcursor = torch.stack([torch.randint(0, L, (slots,), generator=g),
                                    torch.randint(0, L - T + 1, (slots,), generator=g)], 1).to(torch.int32)
        perm = torch.randperm(slots, generator=g)[:batch].to(torch.int32)
        for r in pad_rows:
            perm[r] = -1
        self.sbi_cpu = perm
        self.sbi = perm.cuda()
        self.cursor = self.rcursor.cuda()
        self.buf = gref.GDNBuffers(*(t.cuda() for t in (self.rbuf.state, self.rbuf.u_cache, self.rbuf.v_cache,
                                                          self.rbuf.k_cache, self.rbuf.g_cache, self.rbuf.beta_cache)))
        self.rshadow = self.shadow = None
        if shadow:
            self.rshadow = shadowq.Shadow.of(self.rbuf.state, "bf16")
            self.shadow = self.rshadow.q.cuda()
        self.used = sorted(int(s) for s in perm if s >= 0)
        self.unused = [s for s in range(slots) if s not in self.used]
        self.valid = (perm >= 0).nonzero()[:, 0]
        self.initial_unused = self.snapshot(self.unused)
        self.flushes = 0

    def tensors(self):
        return [self.buf.state, self.buf.u_cache, self.buf.v_cache, self.buf.k_cache, self.buf.g_cache,
                self.buf.beta_cache, self.cursor] + ([self.shadow] if self.shadow is not None else [])

    def snapshot(self, slots):
        idx = torch.tensor(slots, dtype=torch.long, device="cuda")
        return [t.index_select(0, idx).clone() for t in self.tensors()]

    def inputs(self):
        g, act, b, T = self.gen, self.act, self.batch, self.T
        return (torch.randn(b, T, self.H, self.K, generator=g).to(act), torch.randn(b, T, self.H, self.K, generator=g).to(act),
                torch.randn(b, T, self.HV, self.V, generator=g).to(act), torch.randn(b, T, self.HV, generator=g).to(act),
                torch.randn(b, T, self.HV, generator=g).to(act))

    def acceptance(self):
        n = torch.randint(1, self.T + 1, (self.batch,), generator=self.gen)
        n[torch.rand(self.batch, generator=self.gen) < self.p_zero] = 0
        return n.to(torch.int32)

    def step(self, inp=None, n=None, check=True):
        """One kernel step (verify + commit) and one reference step on the same inputs; returns (y, y_ref)."""
        q, k, v, a, b = inp or self.inputs()
        n = self.acceptance() if n is None else n
        y = torch.full((self.batch, self.T, self.HV, self.V), float("nan"), dtype=self.act, device="cuda")
        gdn_ops.gdn_replay_verify(*(t.cuda() for t in (q, k, v, a, b)), self.prm.A_log.cuda(), self.prm.dt_bias.cuda(),
                                  self.buf.state, self.buf.u_cache, self.buf.v_cache, self.buf.k_cache, self.buf.g_cache,
                                  self.buf.beta_cache, self.cursor, self.sbi, out=y, shadow=self.shadow)
        gdn_ops.gdn_spec_commit(self.cursor, n.cuda(), self.sbi, self.T, self.buf.u_cache)
        flushed = gref.flush_checkpoint(self.rbuf, self.rcursor, self.T, self.sbi_cpu, self.rshadow)
        cursors.flush_cursor(self.rcursor, self.T, self.L, self.sbi_cpu)
        y_ref = gref.verify(self.rbuf, self.rcursor, q, k, v, a, b, self.prm.A_log, self.prm.dt_bias, self.sbi_cpu,
                            shadow=self.rshadow, flushed=flushed)
        cursors.commit(self.rcursor, n, self.T, self.L, self.sbi_cpu)
        self.flushes += len(flushed)
        y = y.cpu()
        if check:
            self.check(y, y_ref, flushed)
        return y, y_ref, flushed

    def check(self, y, y_ref, flushed):
        pad = (self.sbi_cpu < 0).nonzero()[:, 0]
        assert torch.isnan(y[pad]).all(), "padding rows were written"
        assert not torch.isnan(y[self.valid]).any(), "rows with a slot were left unwritten"
        e = rel(y[self.valid], y_ref[self.valid])
        assert e < Y_TOL[self.act], f"y: rel err {e:.2e} >= {Y_TOL[self.act]}"
        u = torch.tensor(self.used, dtype=torch.long)
        assert torch.equal(self.cursor.cpu(), self.rcursor), "cursor"
        assert torch.equal(self.buf.v_cache.cpu()[u], self.rbuf.v_cache[u]), "v_cache: not an exact copy of v"
        for name in ("state", "u_cache", "k_cache", "g_cache", "beta_cache"):
            got, want = getattr(self.buf, name).cpu()[u], getattr(self.rbuf, name)[u]
            err = rel(got, want)
            assert err < F32_TOL, f"{name}: rel err {err:.2e} >= {F32_TOL}"
        if self.shadow is not None:
            for s in flushed:  # the kernel's shadow is bf16 of the checkpoint it stored, bit for bit
                want = self.buf.state[s].cpu().to(torch.bfloat16)
                got = self.shadow[s].cpu()
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"shadow of slot {s}"
                self.rshadow.q[s] = got  # the reference reads what the kernel will read
        for before, after in zip(self.initial_unused, self.snapshot(self.unused)):
            assert torch.equal(before.view(torch.uint8), after.view(torch.uint8)), "an unused slot was written"


# Base row, then rows that change one field each: (geometry (HV, H, V, K), act, L, T, batch, slots, pad rows).
CASES = [
    ((4, 2, 128, 128), torch.bfloat16, 16, 4, 3, 8, ()),
    ((4, 2, 128, 128), torch.bfloat16, 8, 4, 3, 8, ()),
    ((4, 2, 128, 128), torch.bfloat16, 8, 2, 3, 8, ()),
    ((4, 2, 128, 128), torch.bfloat16, 16, 2, 3, 8, ()),
    ((4, 2, 128, 128), torch.bfloat16, 8, 1, 3, 8, ()),
    ((4, 2, 128, 128), torch.float32, 16, 4, 3, 8, ()),
    ((4, 2, 128, 128), torch.float16, 16, 4, 3, 8, ()),
    ((4, 2, 128, 128), torch.bfloat16, 16, 4, 37, 41, (0, 5, 36)),
    ((4, 4, 128, 128), torch.bfloat16, 16, 4, 3, 8, (1,)),
    ((2, 2, 64, 64), torch.float32, 8, 2, 3, 6, ()),
    ((4, 2, 64, 256), torch.float32, 16, 4, 3, 6, ()),
    ((2, 1, 256, 64), torch.float32, 16, 4, 3, 6, ()),
    ((4, 2, 128, 128), torch.float32, 32, 8, 2, 4, ()),
]


@pytest.mark.parametrize("geom, act, L, T, batch, slots, pad", CASES,
                         ids=[f"{g}-{str(a)[6:]}-L{L}-T{T}-b{b}-pad{len(p)}" for g, a, L, T, b, _, p in CASES])
def test_verify_commit_matches_reference(geom, act, L, T, batch, slots, pad):
    pb = SpecProblem(geom, act, L, T, batch, slots, pad, seed=hash((geom, L, T, batch)) % 1000)
    for _ in range(STEPS):
        pb.step()
    assert pb.flushes > 0, "no flush in 40 steps: the test did not exercise the fold"


def test_verify_qwen3_next_geometry():
    """Qwen3-Next / Qwen3.5 shapes at the shipped buffer length and window (T = 4, L = 16)."""
    pb = SpecProblem(QWEN3_NEXT, torch.bfloat16, 16, 4, 3, 6, (1,), seed=7)
    for _ in range(STEPS):
        pb.step()
    assert pb.flushes > 0


def test_bf16_shadow():
    """Shadow steps stay within bf16 of the float64 no-shadow run, and each flush's fp32 checkpoint equals
    the no-shadow kernel run's up to fp32 rounding: shadow errors do not accumulate across flushes."""
    geom, L, T, batch, slots = (4, 2, 128, 128), 16, 4, 3, 6
    sh = SpecProblem(geom, torch.float32, L, T, batch, slots, seed=9, shadow=True)
    plain = SpecProblem(geom, torch.float32, L, T, batch, slots, seed=9)
    checked = 0
    for step in range(STEPS):
        inp, n = sh.inputs(), sh.acceptance()
        plain.inputs(), plain.acceptance()  # keep the two generators in step
        y_sh, _, flushed = sh.step(inp, n)
        y_plain, y_ref, _ = plain.step(inp, n)
        e = rel(y_sh[sh.valid], y_ref[sh.valid])
        assert e < SHADOW_Y_TOL, f"step {step}: shadow y rel err {e:.2e} vs the fp64 no-shadow run"
        if flushed:
            f = torch.tensor(flushed, dtype=torch.long)
            e = rel(sh.buf.state.cpu()[f], plain.buf.state.cpu()[f])
            assert e < F32_TOL, f"step {step}: checkpoint with shadow differs by {e:.2e} from the one without"
            checked += 1
    assert checked > 0


def test_all_rejected_then_full_acceptance():
    """n = 0 for every row (the cursor moves only by a flush), then n = T: the boundaries of commit."""
    pb = SpecProblem((4, 2, 128, 128), torch.float32, 8, 2, 3, 5, seed=17)
    for n in [0] * 4 + [2] * 8:
        pb.step(n=torch.full((3,), n, dtype=torch.int32))


def test_corrupt_cursor_gives_nan_and_writes_nothing():
    """Unchecked (check_values=False), a row whose cursor count is past L - T gets NaN y; nothing is written."""
    pb = SpecProblem((4, 2, 128, 128), torch.float32, 8, 2, 2, 4, seed=19)
    s = pb.used[0]
    pb.cursor[s, 1] = 7
    before = [t.clone() for t in pb.tensors()]
    q, k, v, a, b = pb.inputs()
    y = torch.zeros(2, 2, 4, 128, device="cuda")
    gdn_ops.gdn_replay_verify(*(t.cuda() for t in (q, k, v, a, b)), pb.prm.A_log.cuda(), pb.prm.dt_bias.cuda(),
                              *pb.tensors()[:7], pb.sbi, out=y, check_values=False)
    row = int((pb.sbi_cpu == s).nonzero()[0, 0])
    assert torch.isnan(y[row]).all() and not torch.isnan(y[1 - row]).any()
    for t0, t1 in zip(before, pb.tensors()):
        assert torch.equal(t0[s], t1[s]), "a corrupt cursor's slot was written"


def test_teeth_corrupt_one_committed_u():
    """The oracle is not vacuous: one corrupted committed u_j on the kernel side makes y fail its tolerance."""
    pb = SpecProblem((4, 2, 128, 128), torch.float32, 16, 4, 2, 4, seed=13, p_zero=0.0)
    s = pb.used[0]
    pb.cursor[s] = torch.tensor([3, 0], dtype=torch.int32, device="cuda")
    pb.rcursor[s] = torch.tensor([3, 0], dtype=torch.int32)
    pb.step(n=torch.full((2,), 4, dtype=torch.int32))  # commits 4 entries at ring 3..6; no flush next (4 + 8 <= 16)
    pb.buf.u_cache[s, 1, 4, 7] += 3.0  # committed entry 2 of slot s, value head 1, row 7
    with pytest.raises(AssertionError, match="y: rel err"):
        pb.step()


# ---- native-spec baseline ------------------------------------------------------------------------------
NATIVE_CASES = [
    ((4, 2, 128, 128), torch.bfloat16, 4, 3, 6, (1,)),
    ((4, 2, 128, 128), torch.float32, 2, 3, 6, ()),
    ((4, 2, 128, 128), torch.bfloat16, 1, 3, 6, ()),
    ((2, 2, 64, 256), torch.float32, 4, 5, 8, ()),
    ((2, 1, 256, 128), torch.float32, 2, 3, 5, (1,)),  # V = 256: the commit copies 64 x 64 rows (not a Mamba-2 headdim)
    (QWEN3_NEXT, torch.bfloat16, 4, 2, 4, ()),
]


@pytest.mark.parametrize("geom, act, T, batch, slots, pad", NATIVE_CASES,
                         ids=[f"{g}-{str(a)[6:]}-T{T}-b{b}" for g, a, T, b, _, _ in NATIVE_CASES])
def test_native_verify_commit_matches_reference(geom, act, T, batch, slots, pad):
    HV, H, V, K = geom
    pb = SpecProblem(geom, act, 2 * T, T, batch, slots, pad, seed=23)
    state, rstate = pb.buf.state, pb.rbuf.state
    snaps = torch.full((slots, T, HV, V, K), float("nan"), device="cuda")
    rsnaps = torch.zeros(slots, T, HV, V, K)
    u = torch.tensor(pb.used, dtype=torch.long)
    for _ in range(6):
        q, k, v, a, b = pb.inputs()
        y = torch.full((batch, T, HV, V), float("nan"), dtype=act, device="cuda")
        gdn_ops.gdn_native_spec_verify(*(t.cuda() for t in (q, k, v, a, b)), pb.prm.A_log.cuda(), pb.prm.dt_bias.cuda(),
                                       state, snaps, pb.sbi, out=y)
        y_ref = gref.native_spec_verify(rstate, rsnaps, q, k, v, a, b, pb.prm.A_log, pb.prm.dt_bias, pb.sbi_cpu)
        y = y.cpu()
        pad_rows = (pb.sbi_cpu < 0).nonzero()[:, 0]
        assert torch.isnan(y[pad_rows]).all() and not torch.isnan(y[pb.valid]).any()
        e = rel(y[pb.valid], y_ref[pb.valid])
        assert e < Y_TOL[act], f"native y: rel err {e:.2e}"
        e = rel(snaps.cpu()[u], rsnaps[u])
        assert e < F32_TOL, f"snapshots: rel err {e:.2e}"
        n = pb.acceptance()
        gdn_ops.gdn_native_spec_commit(state, snaps, n.cuda(), pb.sbi)
        cursors.native_spec_commit(rstate, rsnaps, n, pb.sbi_cpu)
        e = rel(state.cpu()[u], rstate[u])
        assert e < F32_TOL, f"committed state: rel err {e:.2e}"
    for before, after in zip(pb.initial_unused[:1], pb.snapshot(pb.unused)[:1]):
        assert torch.equal(before, after), "an unused slot's state was written"
    assert torch.isnan(snaps[torch.tensor(pb.unused, dtype=torch.long, device="cuda")]).all(), \
        "an unused slot's snapshots were written"


def test_native_teeth():
    """One corrupted snapshot element (past the tolerance) makes the snapshot comparison fail."""
    HV, H, V, K = 4, 2, 128, 128
    pb = SpecProblem((HV, H, V, K), torch.float32, 8, 4, 2, 4, seed=29)
    snaps = torch.zeros(4, 4, HV, V, K, device="cuda")
    rsnaps = torch.zeros(4, 4, HV, V, K)
    q, k, v, a, b = pb.inputs()
    gdn_ops.gdn_native_spec_verify(*(t.cuda() for t in (q, k, v, a, b)), pb.prm.A_log.cuda(), pb.prm.dt_bias.cuda(),
                                   pb.buf.state, snaps, pb.sbi)
    gref.native_spec_verify(pb.rbuf.state, rsnaps, q, k, v, a, b, pb.prm.A_log, pb.prm.dt_bias, pb.sbi_cpu)
    u = torch.tensor(pb.used, dtype=torch.long)
    assert rel(snaps.cpu()[u], rsnaps[u]) < F32_TOL
    snaps[pb.used[0], 2, 1, 5, 9] += 1.0
    assert rel(snaps.cpu()[u], rsnaps[u]) >= F32_TOL
