# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet kernels (plugins/gdn/gdn_decode.cu) against trtllm_replayssm/families/gdn/reference.py, step by step.

Oracles:
- float64 reference (:mod:`trtllm_replayssm.families.gdn.reference`) evolving on its own from the same initial
  checkpoint and buffers, fed the very activation values the kernel sees, storing into tensors of the
  kernel's dtypes (fp32 state and u/k/g/beta caches, act v_cache). What is left between the two is the
  kernel's fp32 arithmetic and the rounding of y to the activation dtype.
- Bookkeeping exactly: v_cache is a copy of the inputs (rtol = atol = 0), cursors exact, padding rows'
  y still NaN, unused slots of every tensor bit-identical to what they were.
- L = 1 (every step a flush without entries) is the conventional kernel: the same device code
  (gdn::conventional_rows); the replay module spreads a row over 16 lanes, the conventional one over
  32, so only the summation order differs: state within 1e-6 (fp32 sums of 2K terms), y within one
  bf16 ulp (2^-7 relative) where the fp32 values straddle a rounding boundary.
- The initial buffers hold random entries whose u_j are those the steps would have written (written_u): a flush
  that folds the stored u_j (the u-sum) and the reference's exact refold from v_j agree on them.
- bf16 shadow: the kernel's shadow after a flush is bit-identical to Shadow.write of the fp32 checkpoint
  it stored; the checkpoint equals the no-shadow run's up to fp32 rounding (the flush refolds from v_j,
  so shadow rounding never reaches the checkpoint).
Tolerances (relative Frobenius norm over the valid rows):
- y: bf16 one rounding of <= 2^-9 relative per element -> 5e-3; f16 (2^-11) -> 2e-3; f32 -> 5e-5
  (fp32 sums of <= 2K + L terms per output, compounded over 3L + 1 steps of independent evolution of a
  state whose recurrence is contractive: |exp(g)| < 1, the delta rule's (I - beta k k^T) has norm <= 1).
- state, u/k/g/beta caches: 5e-5 (fp32 arithmetic, the same compounding; g, beta through exp / log1p).
- y with a bf16 shadow vs the no-shadow float64 run: 1.5e-2 (S0 read through one bf16 rounding, 2^-9
  relative per element, plus y's own rounding; the dots over K = 64..256 terms average the roundings).
"""

import dataclasses
import math

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.gdn import ops as gdn_ops
from trtllm_replayssm.families.gdn import reference as gref
from trtllm_replayssm.geometries import GDN_GEOMETRIES

pytestmark = pytest.mark.gpu
F64 = torch.float64
Y_TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3, torch.float32: 5e-5}
F32_TOL = 5e-5
SHADOW_Y_TOL = 1.5e-2
# Qwen3-Next-80B-A3B linear attention (HV, H, V, K) = (32, 16, 128, 128), from its config.json
QWEN3_NEXT = GDN_GEOMETRIES["qwen3_next_80b"]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@dataclasses.dataclass
class Params:
    A_log: torch.Tensor
    dt_bias: torch.Tensor


def make_params(HV, gen):
    A_log = torch.log(torch.rand(HV, generator=gen, dtype=F64) * 15 + 1)
    dt0 = torch.exp(torch.rand(HV, generator=gen, dtype=F64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
    return Params(A_log.float(), dt_bias.float())


def written_u(buf, cursor):
    """The u_j of every buffered entry j < cursor[s] as the non-flush steps wrote it: from the checkpoint and the
    entries before it by the exact recurrence (float64, stored fp32). A buffer of random entries becomes one that
    the state contract allows (every later use of u_j, a flush by the u-sum included, agrees with the refold)."""
    HV = buf.state.shape[1]
    for s in range(buf.state.shape[0]):
        S = buf.state[s].to(F64)
        for j in range(int(cursor[s])):
            k = gref._expand(buf.k_cache[s][:, j].to(F64), HV)
            S, u, _ = gref._step(S, k, k, buf.v_cache[s][:, j].to(F64), buf.g_cache[s][:, j].to(F64),
                                 buf.beta_cache[s][:, j].to(F64))
            buf.u_cache[s][:, j] = u.to(buf.u_cache.dtype)


class Problem:
    """Kernel-side tensors on the GPU and the reference's on the CPU, evolving side by side. The initial buffers are
    random entries whose u_j are those the steps would have written (written_u)."""

    def __init__(self, geom, act, L, batch, slots, pad_rows=(), seed=0, shadow=False, random_cursor=True):
        HV, H, V, K = geom
        self.HV, self.H, self.V, self.K, self.L, self.act, self.batch = HV, H, V, K, L, act, batch
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
        self.rcursor = (torch.randint(0, L, (slots,), generator=g) if random_cursor
                        else torch.zeros(slots, dtype=torch.int64)).to(torch.int32)
        written_u(self.rbuf, self.rcursor)
        perm = torch.randperm(slots, generator=g)[:batch].to(torch.int32)
        for r in pad_rows:
            perm[r] = -1
        self.sbi_cpu = perm
        self.sbi = perm.cuda()
        self.cursor = self.rcursor.cuda()
        self.buf = gref.GDNBuffers(*(t.cuda() for t in (self.rbuf.state, self.rbuf.u_cache, self.rbuf.v_cache,
                                                          self.rbuf.k_cache, self.rbuf.g_cache, self.rbuf.beta_cache)))
        self.rshadow = self.shadow = None
        if shadow:  # written at the hand-off, from the stored checkpoint
            self.rshadow = shadowq.Shadow.of(self.rbuf.state, "bf16")
            self.shadow = self.rshadow.q.cuda()
        self.used = sorted(int(s) for s in perm if s >= 0)
        self.unused = [s for s in range(slots) if s not in self.used]
        self.valid = (perm >= 0).nonzero()[:, 0]
        self.initial_unused = self.snapshot(self.unused)

    def tensors(self):
        return [self.buf.state, self.buf.u_cache, self.buf.v_cache, self.buf.k_cache, self.buf.g_cache,
                self.buf.beta_cache, self.cursor] + ([self.shadow] if self.shadow is not None else [])

    def snapshot(self, slots):
        idx = torch.tensor(slots, dtype=torch.long, device="cuda")
        return [t.index_select(0, idx).clone() for t in self.tensors()]

    def inputs(self):
        g, act, b = self.gen, self.act, self.batch
        q = torch.randn(b, self.H, self.K, generator=g).to(act)
        k = torch.randn(b, self.H, self.K, generator=g).to(act)
        v = torch.randn(b, self.HV, self.V, generator=g).to(act)
        a = torch.randn(b, self.HV, generator=g).to(act)
        bb = torch.randn(b, self.HV, generator=g).to(act)
        return q, k, v, a, bb

    def step(self, inp=None, check=True):
        """One kernel step and one reference step on the same inputs; returns (y kernel, y reference)."""
        q, k, v, a, b = inp or self.inputs()
        y = torch.full((self.batch, self.HV, self.V), float("nan"), dtype=self.act, device="cuda")
        c = [t.cuda() for t in (q, k, v, a, b)]
        gdn_ops.gdn_replay_decode(*c, self.prm.A_log.cuda(), self.prm.dt_bias.cuda(), self.buf.state, self.buf.u_cache,
                                  self.buf.v_cache, self.buf.k_cache, self.buf.g_cache, self.buf.beta_cache,
                                  self.cursor, self.sbi, out=y, shadow=self.shadow)
        y_ref = gref.replay_decode(self.rbuf, self.rcursor, q, k, v, a, b, self.prm.A_log, self.prm.dt_bias,
                                   self.sbi_cpu, shadow=self.rshadow)
        flushed = [s for s in self.used if int(self.rcursor[s]) + 1 == self.L]
        gdn_ops.advance_cursor(self.cursor, self.sbi, self.buf.u_cache)
        cursors.advance_cursor(self.rcursor, self.sbi_cpu, self.L)
        y = y.cpu()
        if check:
            self.check(y, y_ref, flushed)
        return y, y_ref

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
            for s in flushed:  # the kernel's shadow is Shadow.write of the checkpoint it stored, bit for bit
                want = self.buf.state[s].cpu().to(torch.bfloat16)
                got = self.shadow[s].cpu()
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"shadow of slot {s}"
                self.rshadow.q[s] = got  # the reference reads what the kernel will read
        for before, after in zip(self.initial_unused, self.snapshot(self.unused)):
            assert torch.equal(before.view(torch.uint8), after.view(torch.uint8)), "an unused slot was written"


def run(pb: Problem, steps: int):
    for _ in range(steps):
        pb.step()


# Base row, then rows that change one field each: (geometry (HV, H, V, K), act, L, batch, slots, pad rows).
CASES = [
    ((4, 2, 128, 128), torch.bfloat16, 4, 3, 8, ()),
    ((4, 2, 128, 128), torch.float32, 4, 3, 8, ()),
    ((4, 2, 128, 128), torch.float16, 4, 3, 8, ()),
    ((4, 2, 128, 128), torch.bfloat16, 4, 1, 3, ()),
    ((4, 2, 128, 128), torch.bfloat16, 4, 37, 41, (0, 5, 36)),
    ((4, 4, 128, 128), torch.bfloat16, 4, 3, 8, (1,)),
    ((2, 2, 64, 64), torch.float32, 8, 3, 6, ()),
    ((4, 2, 64, 256), torch.float32, 4, 3, 6, ()),
    ((2, 1, 256, 64), torch.float32, 4, 3, 6, ()),
    ((4, 2, 128, 128), torch.float32, 32, 2, 4, ()),
    ((4, 2, 128, 128), torch.float32, 2, 3, 5, ()),
    ((4, 2, 128, 128), torch.bfloat16, 4, 10, 12, ()),  # 2 rows per thread (config.gdn_geometry: 160 blocks)
]


@pytest.mark.parametrize("geom, act, L, batch, slots, pad", CASES,
                         ids=[f"{g}-{str(a)[6:]}-L{L}-b{b}-pad{len(p)}" for g, a, L, b, _, p in CASES])
def test_replay_matches_reference(geom, act, L, batch, slots, pad):
    pb = Problem(geom, act, L, batch, slots, pad, seed=hash((geom, L, batch)) % 1000)
    run(pb, 3 * L + 1)


def test_replay_qwen3_next_geometry():
    """Qwen3-Next / Qwen3.5 shapes at the shipped buffer length, from an empty buffer and mid-cycle."""
    pb = Problem(QWEN3_NEXT, torch.bfloat16, 16, 3, 6, (1,), seed=7)
    run(pb, 2 * 16 + 2)


@pytest.mark.parametrize("shadow", [False, True], ids=["f32", "shadow"])
def test_replay_strong_decay_rescales_in_the_fold(shadow):
    """Decays strong enough that the fold's lazy decay falls below 2^-30 within a cycle, on every entry for some
    heads (g ~ -40 softplus(a + dt_bias)) and now and then for others: with a shadow, fold_rows' rescale branch
    (kRenorm) and its plain path in one launch; without one, the u-sum's weights exp(G_m - G_j) underflowing to 0
    for the early entries."""
    pb = Problem((4, 2, 128, 128), torch.bfloat16, 8, 3, 6, (), seed=5, shadow=shadow)
    pb.prm = Params(torch.log(torch.tensor([40.0, 1.0, 8.0, 16.0])), pb.prm.dt_bias)
    run(pb, 2 * 8 + 1)


# Replay launch shapes the planner may pick for small grids (config.override: lanes per row, rows per thread,
# warps, resident threads per SM), each from random cursors through flushes, with and without the bf16 shadow.
# (16, 4, 8, 1024): the bs 8-64 plan at 4 blocks an SM instead of 3 (64 registers, a spill; bench/NOTES.md "Issue 40:
# the wave tail"); (16, 2, 8, 1024): R32 at 4 blocks an SM (64 registers, no spill; NOTES "Issue 40 after the u-sum").
PINNED_SHAPES = [(8, 1, 8, 768), (8, 2, 4, 512), (8, 2, 8, 512), (4, 1, 4, 256), (16, 2, 8, 768), (16, 4, 8, 1024),
                 (16, 2, 8, 1024)]


@pytest.mark.parametrize("shape", PINNED_SHAPES, ids=lambda s: "l{}_rt{}_w{}_r{}".format(*s))
@pytest.mark.parametrize("shadow", [False, True], ids=["f32", "shadow"])
def test_replay_pinned_shapes(shape, shadow):
    from trtllm_replayssm.families.gdn import config

    lanes, rt, warps, resident = shape
    with config.override(lanes=lanes, rt=rt, warps=warps, resident=resident):
        HV, H, V, K = QWEN3_NEXT
        spec = config.gdn_spec("bf16", HV, H, V, K, 8, 2, True, "bf16" if shadow else "none")
        assert (spec.lanes, spec.warps, spec.resident) == (lanes, warps, resident)
        pb = Problem(QWEN3_NEXT, torch.bfloat16, 8, 2, 5, (1,) if shadow else (), seed=17 + rt, shadow=shadow)
        run(pb, 3 * 8 + 1)


def test_replay_large_batch_geometry():
    """A batch large enough for the full 8-rows-per-thread geometry (grid of > 1 wave)."""
    pb = Problem((32, 16, 128, 128), torch.bfloat16, 4, 40, 44, (3,), seed=11)
    run(pb, 5)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_replay_two_pass_shadow_geometry(act):
    """A bf16-shadow module at a batch where blocks cover a whole head in two passes (GDNSpec.passes = 2:
    one prologue, rows rb and rb + 64 per thread; bench/NOTES.md), from random cursors through flushes:
    y, checkpoint, buffers, the shadow bit for bit after each flush, padding rows and unused slots."""
    from trtllm_replayssm.families.gdn.config import gdn_spec

    HV, H, V, K = QWEN3_NEXT
    batch, L = 40, 4
    assert gdn_spec("bf16", HV, H, V, K, L, batch, True, "bf16").passes == 2
    pb = Problem(QWEN3_NEXT, act, L, batch, batch + 5, (3, 17), seed=13, shadow=True)
    run(pb, 3 * L + 1)


@pytest.mark.parametrize("geom, act, batch", [((4, 2, 128, 128), torch.bfloat16, 3), ((2, 2, 64, 256), torch.float32, 37),
                                              (QWEN3_NEXT, torch.bfloat16, 2), ((32, 16, 128, 128), torch.float32, 40)])
def test_conventional_matches_reference(geom, act, batch):
    HV, H, V, K = geom
    pb = Problem(geom, act, 1, batch, batch + 3, (0,) if batch > 2 else (), seed=3)
    state = pb.buf.state
    rstate = pb.rbuf.state
    for _ in range(6):
        q, k, v, a, b = pb.inputs()
        y = torch.full((batch, HV, V), float("nan"), dtype=act, device="cuda")
        gdn_ops.gdn_conventional_step(*(t.cuda() for t in (q, k, v, a, b)), pb.prm.A_log.cuda(), pb.prm.dt_bias.cuda(),
                                      state, pb.sbi, out=y)
        y_ref = gref.conventional_step(rstate, q, k, v, a, b, pb.prm.A_log, pb.prm.dt_bias, pb.sbi_cpu)
        y = y.cpu()
        pad = (pb.sbi_cpu < 0).nonzero()[:, 0]
        assert torch.isnan(y[pad]).all() and not torch.isnan(y[pb.valid]).any()
        assert rel(y[pb.valid], y_ref[pb.valid]) < Y_TOL[act]
        u = torch.tensor(pb.used, dtype=torch.long)
        assert rel(state.cpu()[u], rstate[u]) < F32_TOL
    for before, after in zip(pb.initial_unused[:1], pb.snapshot(pb.unused)[:1]):
        assert torch.equal(before, after), "an unused slot's state was written"


def test_l1_equals_conventional():
    """L = 1: every step is a flush with no entries, i.e. the conventional step (same device code)."""
    geom, batch = (4, 2, 128, 128), 5
    pb = Problem(geom, torch.bfloat16, 1, batch, 7, (2,), seed=5)
    conv_state = pb.buf.state.clone()
    for _ in range(4):
        q, k, v, a, b = pb.inputs()
        y, _ = pb.step((q, k, v, a, b))
        yc = torch.full_like(y, float("nan")).cuda()
        gdn_ops.gdn_conventional_step(*(t.cuda() for t in (q, k, v, a, b)), pb.prm.A_log.cuda(), pb.prm.dt_bias.cuda(),
                                      conv_state, pb.sbi, out=yc)
        yc = yc.cpu()
        assert torch.equal(torch.isnan(yc), torch.isnan(y))
        assert torch.allclose(yc[pb.valid].float(), y[pb.valid].float(), rtol=2 ** -7, atol=1e-30)
        u = torch.tensor(pb.used, dtype=torch.long)
        assert rel(conv_state.cpu()[u], pb.buf.state.cpu()[u]) < 1e-6


def test_bf16_shadow():
    """Shadow steps stay within bf16 of the float64 no-shadow run, and each flush's fp32 checkpoint
    equals the no-shadow kernel run's up to fp32 rounding: shadow errors do not accumulate."""
    geom, L, batch, slots = (4, 2, 128, 128), 4, 3, 6
    sh = Problem(geom, torch.float32, L, batch, slots, seed=9, shadow=True, random_cursor=False)
    plain = Problem(geom, torch.float32, L, batch, slots, seed=9, random_cursor=False)
    for step in range(3 * L + 1):
        inp = sh.inputs()
        y_sh, _ = sh.step(inp)  # checks the kernel's shadow against the reference with the same shadow
        y_plain, y_ref = plain.step(inp)
        e = rel(y_sh[sh.valid], y_ref[sh.valid])
        assert e < SHADOW_Y_TOL, f"step {step}: shadow y rel err {e:.2e} vs the fp64 no-shadow run"
        if (step + 1) % L == 0:  # a flush: the checkpoints agree to fp32 rounding, not to bf16
            u = torch.tensor(sh.used, dtype=torch.long)
            e = rel(sh.buf.state.cpu()[u], plain.buf.state.cpu()[u])
            assert e < F32_TOL, f"step {step}: checkpoint with shadow differs by {e:.2e} from the one without"


def test_teeth_corrupt_one_cached_u():
    """The oracle is not vacuous: one corrupted u_j on the kernel side makes y fail its tolerance."""
    pb = Problem((4, 2, 128, 128), torch.float32, 8, 2, 4, seed=13, random_cursor=False)
    for _ in range(3):
        pb.step()
    s = pb.used[0]
    pb.buf.u_cache[s, 1, 1, 7] += 3.0  # entry 2 of slot s (cursor 3), value head 1, row 7
    with pytest.raises(AssertionError, match="y: rel err"):
        pb.step()


@pytest.mark.parametrize("shadow", [False, True], ids=["f32", "shadow"])
def test_fp32_flush_folds_the_stored_u(shadow):
    """Which entries the flush reads: without a shadow it is the u-sum of the stored fp32 u_j (gdn.cuh usum_rows),
    with a bf16 shadow the exact refold from v_j. One stored u_j changed just before the flush: the fp32 flush's
    checkpoint is the reference's u-sum over the changed entries followed by this token's step (and not the
    refold); the shadow flush's is the refold's (the change is not read)."""
    L, hv, j, row = 4, 1, 1, 7
    pb = Problem((4, 2, 128, 128), torch.float32, L, 2, 4, seed=23, shadow=shadow, random_cursor=False)
    for _ in range(L - 1):
        pb.step()
    r, s = 0, int(pb.sbi_cpu[0])
    assert int(pb.rcursor[s]) == L - 1, "the next step flushes"
    pb.buf.u_cache[s, hv, j, row] += 0.5
    pb.rbuf.u_cache[s, hv, j, row] += 0.5  # the reference refolds from v_j: its u_cache is not read by the flush
    inp = pb.inputs()
    q, k, v, a, b = inp
    HV = pb.HV
    gq, kq = gref.prep_qk(q, k)
    g, beta = gref.gates(a, b, pb.prm.A_log, pb.prm.dt_bias)
    us, _, ks, gs, _ = gref._entries(pb.rbuf, s, torch.arange(L - 1))
    S_usum = gref._replay(pb.rbuf.state[s].to(F64), us, ks, gs)
    S_usum, _, y_usum = gref._step(S_usum, gref._expand(gq[r], HV), gref._expand(kq[r], HV), v[r].to(F64), g[r], beta[r])
    y, y_ref = pb.step(inp, check=False)  # the reference: the refold
    got, refold = pb.buf.state[s].cpu().double(), pb.rbuf.state[s].double()
    usum_vs_refold = rel(S_usum[hv, row], refold[hv, row])
    assert usum_vs_refold > 100 * F32_TOL, f"the change must be visible: {usum_vs_refold:.2e}"
    want = refold if shadow else S_usum
    e = rel(got, want)
    assert e < F32_TOL, f"{'shadow' if shadow else 'fp32'} flush: checkpoint rel err {e:.2e} vs the expected fold"
    e = rel(y[r], y_ref[r] if shadow else y_usum)
    assert e < Y_TOL[torch.float32], f"flush y rel err {e:.2e}"
