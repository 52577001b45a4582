# SPDX-License-Identifier: Apache-2.0
"""KDA kernels (plugins/kda/kda_decode.cu) against trtllm_replayssm/families/kda/reference.py, step by step.

Oracles:
- float64 reference evolving on its own from the same initial checkpoint and rings (random k, v, g, beta; the u_j
  those the non-flush steps would have written, written_u: without a shadow the flush sums the stored u_j, the
  reference refolds from v_j, and the two agree only on such rings), fed the very activation values the kernel
  sees and storing into tensors of the kernel's dtypes (f32 state, g, beta; act k, v; the u ring fp32, bf16
  beside a shadow). What is left between the two is the kernel's fp32 arithmetic and the roundings to bf16 / the
  act dtype.
- Bookkeeping exactly (rtol = atol = 0): the k and v rings (copies of the inputs), cursors, padding rows' y still
  NaN, unused slots of every tensor as they were, the shadow equal to the bf16 rounding of the fp32 checkpoint.
Tolerances (relative Frobenius norm over the compared values):
- y: bf16 output rounding 2^-9 relative per element (with a shadow also the bf16 u ring's rounding, which can fall
  on either side of a rounding boundary and then feed up to L - 1 later outputs) -> 1e-2; f16 -> 4e-3 (its own
  2^-11); f32 act -> 4e-3.
- state (fp32 arithmetic: the u-sum of fp32 u_j, or with a shadow the exact refold from k, v, g, beta, where no
  bf16 u enters) and the g / beta rings (expf, log1pf in fp32 of a few ulp each): 1e-4, compounded over 3L + 2
  steps of a contractive recurrence (|exp g| <= 1, the delta rule's I - beta k k^T of norm <= 1).
- u ring: fp32 1e-4; bf16 (with a shadow) 1e-2 (its rounding as for y).
- y with a bf16 shadow: 2e-2 (S0 read through one bf16 rounding, 2^-9 relative per element, averaged over K terms).
"""

import math

import pytest
import torch

from trtllm_replayssm import cursor_ops
from trtllm_replayssm.cursor import advance_cursor as ref_advance
from trtllm_replayssm.families.kda import GEOMETRIES
from trtllm_replayssm.families.kda import ops as kops
from trtllm_replayssm.families.kda import reference as kref
from trtllm_replayssm.families.kda.config import override
from trtllm_replayssm.shadow import Shadow

pytestmark = pytest.mark.gpu
F64 = torch.float64
Y_TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3, torch.float32: 4e-3}
F32_TOL = 1e-4
SHADOW_Y_TOL = 2e-2


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda")


def make_params(H, K, gen):
    A_log = torch.log(torch.rand(H, generator=gen, dtype=F64) * 15 + 1).float()
    dt0 = torch.exp(torch.rand(H, K, generator=gen, dtype=F64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).float()  # inverse softplus
    return A_log, dt_bias


def make_inputs(batch, H, K, V, act, gen, l2norm=True):
    ks = 1.0 if l2norm else K ** -0.5  # without the norm, |k| ~ 1 keeps the delta rule contractive
    q = (torch.randn(batch, H, K, generator=gen) * ks).to(act)
    k = (torch.randn(batch, H, K, generator=gen) * ks).to(act)
    v = torch.randn(batch, H, V, generator=gen).to(act)
    f = torch.randn(batch, H, K, generator=gen).to(act)
    b = torch.randn(batch, H, generator=gen).to(act)
    return q, k, v, f, b


def make_buffers(slots, H, K, V, L, act, gen, l2norm=True, shadow=False):
    """Random rings; the u ring in the cache's dtype (layers.ring_dtype: bf16 beside a shadow, else fp32)."""
    buf = kref.KDABuffers.alloc(slots, H, K, V, L, act=act, ring=torch.bfloat16 if shadow else torch.float32)
    buf.state.copy_(torch.randn(slots, H, K, V, generator=gen) * 0.1)
    buf.k_cache.copy_(torch.randn(slots, H, L, K, generator=gen) * (1.0 if l2norm else K ** -0.5))
    buf.u_cache.copy_(torch.randn(slots, H, L, V, generator=gen) * 0.1)
    buf.g_cache.copy_(-torch.rand(slots, H, L, K, generator=gen) * 0.3)
    buf.v_cache.copy_(torch.randn(slots, H, L, V, generator=gen))
    buf.beta_cache.copy_(torch.rand(slots, H, L, generator=gen))
    return buf


def written_u(buf, cursor, l2norm=True):
    """The u_j of every buffered entry j < cursor[s] as the non-flush steps wrote them without a shadow: from the
    checkpoint and the entries before it by the exact recurrence (float64, stored in the ring's dtype). Random rings
    become ones the state contract allows: the fp32 flush sums the stored u_j (plugins/kda/kda.cuh usum_apply), which
    agrees with the reference's exact refold from v_j on them."""
    for s in range(buf.state.shape[0]):
        S = buf.state[s].to(F64)
        for j in range(int(cursor[s])):
            k = kref.prep_k(buf.k_cache[s][:, j], l2norm)
            S, u, _ = kref._step(S, k, k, buf.v_cache[s][:, j].to(F64), buf.g_cache[s][:, j].to(F64),
                                 buf.beta_cache[s][:, j].to(F64))
            buf.u_cache[s][:, j] = u.to(buf.u_cache.dtype)


def usum_expected(buf, s, r, q, k, v, f, b, A_log, dt_bias):
    """The flush of slot s by the fp32 rule (float64): the u-sum of the stored u_j of its L - 1 entries, then row r's
    token step on it. Returns (state (H, K, V), y of row r)."""
    L = buf.u_cache.shape[2]
    ks, us, gs, _, _ = kref._entries(buf, s, torch.arange(L - 1), True)
    qn, kn = kref.prep_qk(q, k)
    g, beta = kref.gates(f, b, A_log, dt_bias)
    S, _, y = kref._step(kref._replay(buf.state[s].to(F64), ks, us, gs), qn[r], kn[r], v[r].to(F64), g[r], beta[r])
    return S, y


def to_dev(buf, dev):
    return kref.KDABuffers(*(t.to(dev) for t in buf.tensors()))


CASES = [  # (name, (H, K, V), act, L, batch, slots, gate lower bound, l2norm, shadow)
    ("kimi_k3_tp8", GEOMETRIES["kimi_k3_tp8"], torch.bfloat16, 16, 3, 6, None, True, False),
    ("kimi_k3_tp8_shadow", GEOMETRIES["kimi_k3_tp8"], torch.bfloat16, 16, 3, 6, None, True, True),
    ("glm5_3_flash_tp8", GEOMETRIES["glm5_3_flash_tp8"], torch.bfloat16, 16, 3, 5, -5.0, True, False),
    ("glm_shadow_L4", GEOMETRIES["glm5_3_flash_tp8"], torch.bfloat16, 4, 4, 7, -5.0, True, True),
    ("odd_f32_L4", (3, 48, 40), torch.float32, 4, 4, 7, None, True, False),
    ("odd_f16_nonorm_L5", (5, 64, 24), torch.float16, 5, 5, 9, -3.0, False, False),
    ("k256_L2", (2, 256, 64), torch.bfloat16, 2, 3, 4, None, True, True),
]


def _with(case, batch, slots):
    """``case`` at another batch and slot count (its name says so)."""
    name, geom, act, L, _, _, *rest = case
    return (f"{name}_bs{batch}", geom, act, L, batch, slots, *rest)


def _sbi(batch, slots, gen):
    perm = torch.randperm(slots, generator=gen)[:batch].to(torch.int32)
    perm[1] = -1  # one padding row
    return perm


# The planner's small-batch shape runs above (batch 3-5); its large-batch shapes, pinned (override), run here; a
# third entry pins the resident threads an SM (KDASpec.resident: 512 = 4 blocks of 4 warps, 128 registers with a
# spill; the wave-tail question of bench/NOTES.md "Issue 40: the wave tail").
SHAPED = [(CASES[i], shape) for i, shape in ((0, (4, 4)), (1, (4, 4)), (2, (4, 4)), (3, (4, 4)), (1, (4, 8)),
                                             (2, (4, 2)), (2, (4, 4, 512)), (3, (4, 4, 512)))]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replay_decode_against_reference(case):
    _replay_against_reference(case)


@pytest.mark.parametrize("case, shape", SHAPED, ids=[f"{c[0]}-C{s[0]}W{s[1]}" + "".join(f"R{r}" for r in s[2:])
                                                     for c, s in SHAPED])
def test_replay_decode_launch_shapes(case, shape):
    with override(*shape):
        _replay_against_reference(case)


def _replay_against_reference(case):
    dev = cuda()
    _, (H, K, V), act, L, batch, slots, lb, l2, use_shadow = case
    gen = torch.Generator().manual_seed(37)
    A_log, dt_bias = make_params(H, K, gen)
    ref = make_buffers(slots, H, K, V, L, act, gen, l2, use_shadow)
    cursor = torch.randint(0, L, (slots,), generator=gen, dtype=torch.int32)  # rows flush at different steps
    written_u(ref, cursor, l2)
    sbi = _sbi(batch, slots, gen)
    gpu = to_dev(ref, dev)
    ref_sh = Shadow.of(ref.state, "bf16") if use_shadow else None
    sh = ref_sh.q.to(dev) if use_shadow else None
    cur = cursor.to(dev)
    unused = [s for s in range(slots) if s not in sbi.tolist()]
    before = [t[unused].clone() for t in gpu.tensors()] + ([sh[unused].clone()] if use_shadow else [])
    flushed = 0
    ys = []
    for step in range(3 * L + 2):
        q, k, v, f, b = make_inputs(batch, H, K, V, act, gen, l2)
        flushed += int(((cursor[sbi[sbi >= 0].long()] + 1) == L).sum())
        y_ref = kref.replay_decode(ref, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=ref_sh, use_qk_l2norm=l2,
                                   lower_bound=lb)
        ref_advance(cursor, sbi, L)
        out = torch.full((batch, H, V), float("nan"), dtype=act, device=dev)
        kops.kda_replay_decode(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), gpu.state, gpu.k_cache,
                               gpu.u_cache, gpu.g_cache, gpu.v_cache, gpu.beta_cache, cur, sbi.to(dev), out=out,
                               shadow=sh, use_qk_l2norm=l2, lower_bound=lb)
        kops.advance_cursor(cur, sbi.to(dev), gpu.u_cache)
        live = sbi >= 0
        y = out.cpu()
        ys.append(y)
        assert torch.isnan(y[~live]).all(), "padding rows' y must stay untouched (NaN poison)"
        tol = SHADOW_Y_TOL if use_shadow else Y_TOL[act]
        assert rel(y[live], y_ref[live]) < tol, f"step {step}: y rel {rel(y[live], y_ref[live])}"
        assert torch.equal(cur.cpu(), cursor)
        assert torch.equal(gpu.k_cache.cpu(), ref.k_cache), f"step {step}: k ring must be the raw inputs, exactly"
        assert torch.equal(gpu.v_cache.cpu(), ref.v_cache), f"step {step}: v ring must be the inputs, exactly"
        assert rel(gpu.g_cache.cpu(), ref.g_cache) < F32_TOL
        assert rel(gpu.beta_cache.cpu(), ref.beta_cache) < F32_TOL
        assert rel(gpu.u_cache.cpu(), ref.u_cache) < (1e-2 if use_shadow else F32_TOL)  # bf16 / fp32 u ring
        assert rel(gpu.state.cpu(), ref.state) < F32_TOL, f"step {step}: state rel {rel(gpu.state.cpu(), ref.state)}"
        if use_shadow:  # rewritten from the fp32 checkpoint at each flush: its bf16 rounding, bit for bit
            assert torch.equal(sh.cpu(), gpu.state.cpu().to(torch.bfloat16))
    assert flushed >= 2, "the case must flush"
    after = [t[unused] for t in gpu.tensors()] + ([sh[unused]] if use_shadow else [])
    for b0, a0 in zip(before, after):
        assert torch.equal(b0, a0), "unused slots must be untouched"
    return ys + [t.cpu() for t in gpu.tensors()] + ([sh.cpu()] if use_shadow else [])


# KDASpec.bulk's replay stream (kda_replay_bulk: the non-flush steps as a persistent stream, an experiment): bit for bit
# the one-shot step at the same launch shape over a few non-flush steps at spread cursors (y, checkpoint, rings,
# shadow, cursors), with batches that give every block several items; a row at the flush is refused (checked values:
# ValueError; unchecked: NaN y, its slot untouched).
BULK_REPLAY = [(_with(CASES[1], batch=40, slots=48), (2, 4)), (_with(CASES[3], batch=40, slots=44), (2, 4)),
               (_with(CASES[4], batch=200, slots=210), (2, 1)), (_with(CASES[5], batch=120, slots=130), (2, 1))]


def _nonflush_steps(case, flush_row=False, check_values=None):
    """min(3, L - 2) standard decode steps whose rows never reach the flush (cursors spread over [0, L - 2 - steps]);
    ``flush_row``: one step, with row 0's slot at L - 1. Returns (every step's y, then the buffers, shadow and
    cursors; the buffers and shadow before the steps; row 0's slot)."""
    dev = cuda()
    _, (H, K, V), act, L, batch, slots, lb, l2, use_shadow = case
    gen = torch.Generator().manual_seed(41)
    A_log, dt_bias = make_params(H, K, gen)
    buf = make_buffers(slots, H, K, V, L, act, gen, l2, use_shadow)
    steps = 1 if flush_row else min(3, L - 2)
    cursor = torch.randint(0, L - 1 - steps, (slots,), generator=gen, dtype=torch.int32)
    sbi = _sbi(batch, slots, gen)
    if flush_row:
        cursor[sbi[0]] = L - 1
    gpu = to_dev(buf, dev)
    sh = Shadow.of(buf.state, "bf16").q.to(dev) if use_shadow else None
    start = [t.cpu() for t in gpu.tensors()] + ([sh.cpu()] if use_shadow else [])
    cur, rows = cursor.to(dev), sbi.to(dev)
    ys = []
    for _ in range(steps):
        q, k, v, f, b = make_inputs(batch, H, K, V, act, gen, l2)
        out = torch.full((batch, H, V), float("nan"), dtype=act, device=dev)
        kops.kda_replay_decode(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), gpu.state, gpu.k_cache,
                               gpu.u_cache, gpu.g_cache, gpu.v_cache, gpu.beta_cache, cur, rows, out=out, shadow=sh,
                               use_qk_l2norm=l2, lower_bound=lb, check_values=check_values)
        ys.append(out.cpu())
        if not flush_row:
            live = sbi >= 0
            assert torch.isfinite(ys[-1][live].float()).all() and torch.isnan(ys[-1][~live].float()).all()
            kops.advance_cursor(cur, rows, gpu.u_cache)
    got = ys + [t.cpu() for t in gpu.tensors()] + ([sh.cpu()] if use_shadow else []) + [cur.cpu()]
    return got, start, int(sbi[0])


@pytest.mark.parametrize("case, shape", BULK_REPLAY, ids=[c[0] for c, _ in BULK_REPLAY])
def test_replay_bulk_equals_the_one_shot_step(case, shape):
    runs = []
    for bulk in (True, False):
        with override(*shape, bulk=bulk, staged=False, passes=1):
            runs.append(_nonflush_steps(case)[0])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"item {i}: bulk and one-shot steps differ"


# KDASpec.bulk_flush: the replay stream folds its flush items too (the one-shot kernel's flush in a dynamic shared-memory
# tile), so it runs the whole cycle: against the reference over 3 L + 2 steps with rows flushing at different steps
# (flush and non-flush items in one launch), and bit for bit equal to the one-shot step at the same shape.
BULK_FLUSH = [(CASES[1], (2, 4)), (_with(CASES[3], batch=40, slots=44), (2, 4)),
              (_with(CASES[4], batch=200, slots=210), (2, 1)), (_with(CASES[5], batch=120, slots=130), (2, 1))]


@pytest.mark.parametrize("case, shape", BULK_FLUSH, ids=[c[0] for c, _ in BULK_FLUSH])
def test_replay_bulk_with_its_flush_equals_the_one_shot_step(case, shape):
    runs = []
    for bulk in (True, False):
        with override(*shape, bulk=bulk, bulk_flush=bulk, staged=False, passes=1):
            runs.append(_replay_against_reference(case))
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"item {i}: bulk and one-shot steps differ"


def test_replay_bulk_refuses_a_flush_row():
    case, shape = BULK_REPLAY[0]
    with override(*shape, bulk=True):
        with pytest.raises(ValueError, match="non-flush rows only"):
            _nonflush_steps(case, flush_row=True, check_values=True)
        (y, *got), start, slot = _nonflush_steps(case, flush_row=True, check_values=False)
    with override(*shape, bulk=False, staged=False, passes=1):
        (y_want, *want), _, _ = _nonflush_steps(case, flush_row=True, check_values=False)  # it flushes row 0
    assert torch.isnan(y[0].float()).all(), "the flush row's y: NaN"
    assert torch.equal(y[2:].view(torch.uint8), y_want[2:].view(torch.uint8))  # (row 1 is the padding row)
    keep = [s for s in range(case[5]) if s != slot]
    for i, (a, b, s0) in enumerate(zip(got, want, start)):  # the cursors (last) were not advanced
        assert torch.equal(a[slot].view(torch.uint8), s0[slot].view(torch.uint8)), f"buffer {i}: flush slot written"
        assert torch.equal(a[keep].view(torch.uint8), b[keep].view(torch.uint8)), f"buffer {i}"


# KDASpec.staged (the non-flush step's ring staged in shared memory; planned for many-wave grids, e.g. bs256) at the
# test batches: each case against the reference, and bit for bit equal to the register path (same arithmetic, same
# order), outputs, checkpoint, rings and shadow, over 3 L + 2 steps.
STAGED = [(CASES[0], ()), (CASES[1], (4, 4)), (CASES[2], (4, 4)), (CASES[3], (4, 4, 512)), (CASES[4], ()),
          (CASES[5], ()), (CASES[6], ())]


@pytest.mark.parametrize("case, shape", STAGED, ids=[f"{c[0]}" + "".join(f"-{x}" for x in s) for c, s in STAGED])
def test_staged_ring_equals_the_register_ring(case, shape):
    runs = []
    for staged in (True, False):
        with override(*shape, staged=staged, passes=1):  # the one-pass staged ring (two passes: below)
            runs.append(_replay_against_reference(case))
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"item {i}: staged and register rings differ"


# KDASpec.passes 2 (a block walks two chunks of its head under one channel stage, the second chunk's rows staged in
# shared memory): against the reference, and bit for bit equal to the register ring (each column's arithmetic is the
# same in the same order). The bf16-shadow modules (where it fits 48 KB at K = 128), and an fp32 one at K = 64.
PASSES = [(CASES[1], (4, 4)), (CASES[3], (4, 4)), (CASES[3], (4, 4, 512)), (CASES[6], (2, 4)),
          (("f32_k64_L6", (3, 64, 64), torch.bfloat16, 6, 3, 5, None, True, False), (2, 2))]


@pytest.mark.parametrize("case, shape", PASSES, ids=[f"{c[0]}" + "".join(f"-{x}" for x in s) for c, s in PASSES])
def test_two_passes_equal_the_register_ring(case, shape):
    runs = []
    for passes in (2, 1):
        with override(*shape, staged=passes > 1, passes=passes):
            runs.append(_replay_against_reference(case))
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"item {i}: two passes and one differ"


CONV = [(c, None) for c in CASES[:1] + CASES[2:3] + CASES[4:6]] + [(CASES[0], (4, 4)), (CASES[2], (4, 8))]


@pytest.mark.parametrize("case, shape", CONV, ids=[c[0] + ("" if s is None else f"-C{s[0]}W{s[1]}") for c, s in CONV])
def test_conventional_against_reference(case, shape):
    with override(*(shape or ())):
        _conventional_against_reference(case)


# KDASpec.bulk (kda_conventional_bulk, the conventional step as a persistent stream): against the reference, and bit for
# bit equal to kda_conventional at the same launch shape (the same arithmetic in the same order). Batches large
# enough that every block walks several items (grid: the resident blocks of the card), padding rows among them.
BULK = [(_with(CASES[0], batch=40, slots=48), (2, 4)), (_with(CASES[2], batch=40, slots=44), (2, 4)),
        (_with(CASES[4], batch=200, slots=210), (2, 1)), (_with(CASES[5], batch=120, slots=130), (2, 1))]


@pytest.mark.parametrize("case, shape", BULK, ids=[c[0] for c, _ in BULK])
def test_conventional_bulk_equals_the_one_shot_step(case, shape):
    runs = []
    for bulk in (True, False):
        with override(*shape, bulk=bulk):
            runs.append(_conventional_against_reference(case))
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"item {i}: bulk and one-shot steps differ"


def _conventional_against_reference(case):
    """Four conventional steps against the float64 reference; returns every step's y and the final state."""
    dev = cuda()
    _, (H, K, V), act, _, batch, slots, lb, l2, _ = case
    gen = torch.Generator().manual_seed(7)
    A_log, dt_bias = make_params(H, K, gen)
    state = torch.randn(slots, H, K, V, generator=gen) * 0.1
    sbi = _sbi(batch, slots, gen)
    st = state.to(dev)
    unused = [s for s in range(slots) if s not in sbi.tolist()]
    outs = []
    for step in range(4):
        q, k, v, f, b = make_inputs(batch, H, K, V, act, gen, l2)
        y_ref = kref.conventional_step(state, q, k, v, f, b, A_log, dt_bias, sbi, use_qk_l2norm=l2, lower_bound=lb)
        out = torch.full((batch, H, V), float("nan"), dtype=act, device=dev)
        kops.kda_conventional_step(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), st, sbi.to(dev), out=out,
                                   use_qk_l2norm=l2, lower_bound=lb)
        y, live = out.cpu(), sbi >= 0
        assert torch.isnan(y[~live]).all()
        assert rel(y[live], y_ref[live]) < Y_TOL[act], f"step {step}"
        assert rel(st.cpu(), state) < F32_TOL, f"step {step}"
        assert torch.equal(st.cpu()[unused], state[unused])
        outs.append(y)
    return [*outs, st.cpu()]


def test_teeth():
    """A corrupted g entry in the kernel's ring (the newest entry of one head of one live row: every older entry and
    S0 decay through it) must be caught; the other row, untouched, still agrees."""
    dev = cuda()
    H, K, V = GEOMETRIES["kimi_k3_tp8"]
    L, batch, slots = 8, 2, 3
    gen = torch.Generator().manual_seed(3)
    A_log, dt_bias = make_params(H, K, gen)
    ref = make_buffers(slots, H, K, V, L, torch.bfloat16, gen)
    cursor = torch.full((slots,), 5, dtype=torch.int32)
    written_u(ref, cursor)
    sbi = torch.tensor([0, 2], dtype=torch.int32)
    gpu = to_dev(ref, dev)
    gpu.g_cache[2, 3, 4] = -20.0  # entry 4 < cursor 5: the output path reads it
    q, k, v, f, b = make_inputs(batch, H, K, V, torch.bfloat16, gen)
    y_ref = kref.replay_decode(ref, cursor, q, k, v, f, b, A_log, dt_bias, sbi)
    y = kops.kda_replay_decode(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), *gpu.tensors(),
                               cursor.to(dev), sbi.to(dev)).cpu()
    assert rel(y[0], y_ref[0]) < Y_TOL[torch.bfloat16]  # the untouched row still agrees
    assert rel(y[1, 3], y_ref[1, 3]) > 3 * Y_TOL[torch.bfloat16], "the oracle must see a corrupted ring entry"


@pytest.mark.parametrize("use_shadow", [False, True], ids=["f32", "shadow"])
def test_fp32_flush_folds_the_stored_u(use_shadow):
    """Which entries the flush reads: without a shadow the u-sum of the stored fp32 u_j (kda.cuh usum_apply), with a
    bf16 shadow the exact refold from v_j. One stored u_j changed before a flush: the fp32 flush's checkpoint is the
    reference's u-sum over the changed ring followed by this token's step (not the refold); the shadow flush's is the
    refold's (the change is not read)."""
    dev = cuda()
    H, K, V = GEOMETRIES["kimi_k3_tp8"]
    L, slots, s, r, h, j, col = 4, 3, 2, 1, 3, 1, 7
    gen = torch.Generator().manual_seed(29)
    A_log, dt_bias = make_params(H, K, gen)
    ref = make_buffers(slots, H, K, V, L, torch.bfloat16, gen, True, use_shadow)
    cursor = torch.full((slots,), L - 1, dtype=torch.int32)  # every row flushes
    written_u(ref, cursor)
    ref.u_cache[s, h, j, col] += 0.5
    sbi = torch.tensor([0, s], dtype=torch.int32)
    gpu = to_dev(ref, dev)
    ref_sh = Shadow.of(ref.state, "bf16") if use_shadow else None
    sh = ref_sh.q.to(dev) if use_shadow else None
    q, k, v, f, b = make_inputs(2, H, K, V, torch.bfloat16, gen)
    S_usum, y_usum = usum_expected(ref, s, r, q, k, v, f, b, A_log, dt_bias)
    y_ref = kref.replay_decode(ref, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=ref_sh)  # the refold
    y = kops.kda_replay_decode(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), *gpu.tensors(),
                               cursor.to(dev), sbi.to(dev), shadow=sh).cpu()
    got, refold = gpu.state[s].cpu().to(F64), ref.state[s].to(F64)
    assert rel(S_usum[h], refold[h]) > 100 * F32_TOL, "the change must be visible"
    e = rel(got, refold if use_shadow else S_usum)
    assert e < F32_TOL, f"{'shadow' if use_shadow else 'fp32'} flush: checkpoint rel err {e:.2e} vs the expected fold"
    assert rel(y[r], y_ref[r] if use_shadow else y_usum) < Y_TOL[torch.bfloat16]


def test_bad_cursor_gives_nan_and_writes_nothing():
    dev = cuda()
    H, K, V, L = 2, 32, 16, 4
    gen = torch.Generator().manual_seed(5)
    A_log, dt_bias = make_params(H, K, gen)
    gpu = to_dev(make_buffers(2, H, K, V, L, torch.bfloat16, gen), dev)
    before = [t.clone() for t in gpu.tensors()]
    cursor = torch.tensor([L, 0], dtype=torch.int32, device=dev)
    q, k, v, f, b = make_inputs(1, H, K, V, torch.bfloat16, gen)
    y = kops.kda_replay_decode(*(t.to(dev) for t in (q, k, v, f, b, A_log, dt_bias)), *gpu.tensors(), cursor,
                               torch.tensor([0], dtype=torch.int32, device=dev), check_values=False)
    assert torch.isnan(y).all()
    for b0, a0 in zip(before, gpu.tensors()):
        assert torch.equal(b0, a0)


def test_shared_cursor_kernel():
    dev = cuda()
    cur = torch.tensor([0, 3, 2], dtype=torch.int32, device=dev)
    cursor_ops.advance_cursor(cur, torch.tensor([1, -1, 2], dtype=torch.int32, device=dev), buffer_len=4)
    assert cur.cpu().tolist() == [0, 0, 3]
