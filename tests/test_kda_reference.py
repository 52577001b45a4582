# SPDX-License-Identifier: Apache-2.0
"""The float64 spec of Kimi Delta Attention ReplaySSM (families/kda/reference.py) against the conventional recurrence.

Oracles and precision:
- transformers' own ``recurrent_kimi_delta_attention`` (``models/kimi_linear``, repeated in ``models/glm5_next``),
  which casts everything to float32: run as shipped (float32 rounding over 12 steps, ~1e-7 measured, 1e-5
  allowed) and run in float64 (its own code, with the ``torch`` of its module replaced by a proxy whose
  ``float32`` is float64, so every line of theirs runs as written, in float64): then only summation order
  differs, ~1e-16 measured, RTOL = 1e-12. Its forget-gate modules (float32 inside) against :func:`gates`:
  1e-5 relative at gate inputs of order 1.
- :func:`reference.conventional_step` in float64 (S <- Diag(exp(g)) S; u = beta (v - S^T k); S <- S + k u^T;
  y = S^T q), fed the same tokens one at a time. With float64 caches (built explicitly; ``KDABuffers.alloc``
  defaults to bf16 k / u / v and fp32 g / beta) both sides are float64 on identical values and differ only in
  summation order (the u-sum's per-channel decay products vs repeated multiplication): ~5e-16 measured,
  RTOL = 1e-12 (y every step; the current state every step both as the exact fold from v_j and as the u-sum
  the output path replays; the kernel route :func:`reference.verify_triangular` at T = 1 every step).
- The default caches (fp32 checkpoint, bf16 k / u / v, fp32 g / beta) with bf16 inputs (so k and v are stored
  exactly): the outputs carry the bf16 rounding of the buffered u_j (2^-9 relative each), 1.4e-3 measured,
  8e-3 allowed; the state the buffer stands for (the exact fold from raw k, v, g, beta) carries only fp32
  roundings of the checkpoint and of g: 4e-8 measured, 1e-6 allowed, flush after flush (the u-sum of the
  bf16 u_j is 1.7e-3 off, > 1e-4 asserted: why the fold reads v_j).
- L = 1: every step is a flush of zero entries, the same float64 operations as the conventional step: bit for
  bit (torch.equal).
- :func:`reference.verify_triangular` (the kernels' route: S0 read once for D_{t,0} k_t and D_{t,0} q_t, the
  decay-weighted entry products, T x T forward substitution) against :func:`reference.verify` (the recurrence):
  float64, another summation order, 1e-12.
- Cursors, ring contents, untouched slots, padding rows, poisoned (NaN) entries beyond the cursor and later
  NaN / inf window tokens: compared exactly (torch.equal).
- Shadow (a bf16 / fp8 copy of the checkpoint that non-flush steps read): outputs within the shadow's rounding
  (bf16 4e-3, fp8 6e-2 relative); each flush refolds from v_j and the full-precision checkpoint, so checkpoints
  equal the no-shadow run's bit for bit, while a fold by the u-sum would carry the shadow's error (shown).
Teeth: a corrupted buffered u / g / k entry, a per-head (GDN-like) decay in place of the per-channel one, and a
NaN in a committed entry are all detected; the prefix-difference form of the decays is shown to produce NaN
where the suffix sums the spec uses stay exact.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from trtllm_replayssm import costs, families
from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families import kda as kda_family
from trtllm_replayssm.families.kda import reference as kda

F64 = torch.float64
RTOL = 1e-12  # float64 both sides, summation order only (module docstring)

pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _params(H, K, gen):
    """A_log = log U[0.05, 1.5] per head; dt_bias (H, K) = softplus^-1 of dt in [1e-3, 0.1] log-uniform per channel:
    per-channel decays exp(g) mostly in [0.75, 1), so the checkpoint and old entries matter for many steps."""
    A_log = torch.log(torch.rand(H, generator=gen, dtype=F64) * 1.45 + 0.05)
    dt0 = torch.exp(torch.rand(H, K, generator=gen, dtype=F64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return A_log, dt0 + torch.log(-torch.expm1(-dt0))


def _tokens(lead, H, K, V, gen, dtype=F64):
    """q, k, f (lead, H, K), v (lead, H, V), b (lead, H): raw (before the l2 norm and the gates)."""
    def rnd(*shape, shift=0.0):
        return (torch.randn(*lead, *shape, generator=gen, dtype=F64) + shift).to(dtype)
    return rnd(H, K), rnd(H, K), rnd(H, V), rnd(H, K), rnd(H, shift=1.0)


def _buffers(slots, H, K, V, L, gen, dtype=F64, garbage=True):
    """float64 KDABuffers: random checkpoint; ring contents garbage (nothing outside the entries is read)."""
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype) if garbage else torch.zeros(*shape, dtype=dtype)
    state = (torch.randn(slots, H, K, V, generator=gen, dtype=F64) * 0.3).to(dtype)
    return kda.KDABuffers(state, r(slots, H, L, K), r(slots, H, L, V), -r(slots, H, L, K).abs(), r(slots, H, L, V),
                          r(slots, H, L).sigmoid())


def _shuffled(rows_, gen):
    perm = torch.randperm(len(rows_), generator=gen).tolist()
    return torch.tensor([rows_[i] for i in perm], dtype=torch.int32)


def _ring(cursor):
    """The standard cursor as a ring cursor (start 0, count = cursor)."""
    return torch.stack([torch.zeros_like(cursor), cursor], dim=1)


# ---- anchors: transformers' KDA -------------------------------------------------------------------------------
class _Float64Torch(types.ModuleType):
    """``torch`` with ``float32`` meaning float64: transformers' recurrence casts its inputs with
    ``x.to(torch.float32)``; under this proxy its own code runs unchanged in float64."""

    float32 = torch.float64

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)


def _hf(family):
    return pytest.importorskip(f"transformers.models.{family}.modeling_{family}",
                               reason=f"transformers with {family} is not installed")


def _hf_tokens(B, T, H, K, V, gen, lower_bound):
    A_log, dt_bias = _params(H, K, gen)
    q, k, v, f, b = _tokens((B, T), H, K, V, gen)
    g, beta = kda.gates(f, b, A_log, dt_bias, lower_bound)
    return (q, k, v, f, b, A_log, dt_bias), g, beta


@pytest.mark.parametrize("family,lower_bound", [("kimi_linear", None), ("glm5_next", -5.0)])
def test_conventional_matches_transformers_recurrence(family, lower_bound, monkeypatch):
    """conventional_step over 12 tokens (3 rows, H = 3, K = 16 != V = 8 so a transposed state cannot pass) ==
    transformers' recurrent_kimi_delta_attention from the same initial state (B, H, K, V): in float64 (its code
    under the float64 proxy) to RTOL, as shipped (float32) to 1e-5; outputs and the final state. Teeth: the
    per-head mean of the decay (GDN's form) in place of the per-channel one misses by far more."""
    hf = _hf(family)
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = 3, 12, 3, 16, 8
    (q, k, v, f, b, A_log, dt_bias), g, beta = _hf_tokens(B, T, H, K, V, gen, lower_bound)
    S_init = torch.randn(B, H, K, V, generator=gen, dtype=F64) * 0.3

    state = S_init.clone()
    y = torch.stack([kda.conventional_step(state, q[:, t], k[:, t], v[:, t], f[:, t], b[:, t], A_log, dt_bias,
                                           lower_bound=lower_bound) for t in range(T)], dim=1)
    S = state

    def theirs():
        return hf.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=S_init.clone(),
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)

    y32, S32 = theirs()  # as shipped: float32 inside
    assert _rel(y32.double(), y) < 1e-5 and _rel(S32.double(), S) < 1e-5
    with monkeypatch.context() as mp:
        mp.setattr(hf, "torch", _Float64Torch())
        y64, S64 = theirs()
    assert y64.dtype == F64 and S64.dtype == F64
    assert _rel(y64, y) < RTOL and _rel(S64, S) < RTOL
    # teeth: GDN's one decay per (head, token), the mean of the channels, is far from KDA's per-channel decay
    state = S_init.clone()
    g_head = g.mean(-1, keepdim=True).expand_as(g)
    y_head = []
    for t in range(T):
        qn, kn = kda.prep_qk(q[:, t], k[:, t])
        row = []
        for r in range(B):
            state[r], _, yr = kda._step(state[r], qn[r], kn[r], v[r, t], g_head[r, t], beta[r, t])
            row.append(yr)
        y_head.append(torch.stack(row))
    assert _rel(torch.stack(y_head, dim=1), y64) > 1e-3


@pytest.mark.parametrize("family", ["kimi_linear", "glm5_next"])
def test_gates_match_transformers_forget_gates(family):
    """gates() against the models' forget-gate modules (KimiLinearForgetGate: -exp(A_log) softplus(f + dt_bias);
    Glm5NextTextForgetGate: lower_bound sigmoid(exp(A_log) (f + dt_bias)), lower_bound -5 by default), fed the
    module's own f = f_b(f_a(x)); the modules compute in float32 (1e-5 at inputs of order 1)."""
    hf = _hf(family)
    transformers = pytest.importorskip("transformers")
    H, K, hidden = 3, 8, 32
    if family == "kimi_linear":
        cfg = transformers.KimiLinearConfig(hidden_size=hidden, linear_num_heads=H, linear_head_dim=K)
        gate, lower_bound = hf.KimiLinearForgetGate(cfg), None
    else:
        cfg = transformers.Glm5NextTextConfig(hidden_size=hidden, linear_num_heads=H, linear_head_dim=K)
        gate, lower_bound = hf.Glm5NextTextForgetGate(cfg), cfg.linear_lower_bound
        assert lower_bound == -5.0  # GLM-5.3-Flash's bound (issue 37)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        x = torch.randn(2, 5, hidden, generator=gen)
        want = gate(x)
        fproj = gate.f_b_proj(gate.f_a_proj(x)).view(2, 5, H, K)
        g, _ = kda.gates(fproj, torch.zeros(2, 5, H), gate.A_log.reshape(H), gate.dt_bias.view(H, K), lower_bound)
    assert tuple(want.shape) == (2, 5, H, K)
    assert _rel(g, want.double()) < 1e-5
    assert (g < 0).all() and (lower_bound is None or (g > lower_bound).all())


def test_kda_geometries_match_transformers_defaults():
    """families/kda's Kimi-Linear-48B and GLM-5.3-Flash rows against transformers' config defaults (Kimi-K3 has no
    transformers config: its row is issue 37's published numbers)."""
    transformers = pytest.importorskip("transformers")
    for name, cls in (("kimi_linear_48b", "KimiLinearConfig"), ("glm5_3_flash", "Glm5NextTextConfig")):
        if not hasattr(transformers, cls):
            pytest.skip(f"transformers {transformers.__version__} has no {cls}")
        c = getattr(transformers, cls)()
        types_ = list(c.layer_types)
        got = (c.linear_num_heads, c.linear_head_dim, c.linear_head_dim, types_.count("linear_attention"), len(types_))
        assert got == kda_family.MODELS[name], (name, got)
    assert kda_family.GEOMETRIES["kimi_k3_tp8"] == (12, 128, 128) and kda_family.GEOMETRIES["glm5_3_flash_tp8"] == (8, 128, 128)


# ---- standard decode: replay == conventional ----------------------------------------------------------------
def _tensors(buf):
    return buf.tensors()


def _poison_beyond(buf, cursor, slots):
    """NaN in every standard-form entry at index >= cursor (never read)."""
    L = buf.u_cache.shape[2]
    for s in slots:
        junk = list(range(int(cursor[s]), L))
        for t in _tensors(buf)[1:]:
            t[s][:, junk] = float("nan")


def _run_standard(H, K, V, L, slots, active, pad, seed=0, l2norm=True, lower_bound=None):
    """Warm-up to distinct cursors (slot s starts its 3L + 2 steps at cursor phase[s], so rows flush at different
    steps), then 3L + 2 steps of every active slot with ``pad`` padding rows, shuffled. Per step: y against the
    conventional step and against the kernel route (verify_triangular at T = 1); the current state both as the
    exact fold and as the u-sum; cursors against a model, exactly; a twin whose entries beyond the cursor are NaN
    after every step gives bit-identical outputs and entries. At the end, unused slots are bit-identical."""
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias = _params(H, K, gen)
    buf = _buffers(slots, H, K, V, L, gen)
    twin = buf.clone()
    S_conv = buf.state.clone()
    cursor = torch.zeros(slots, dtype=torch.int32)
    untouched = [t.clone() for t in _tensors(buf)]
    act = list(range(active))
    stride = max(1, L // active)
    phase = {s: (s * stride) % L for s in act}
    _poison_beyond(twin, cursor, act)
    count = dict.fromkeys(act, 0)
    flush_steps = {s: [] for s in act}
    worst_y, worst_tri, worst_S = 0.0, 0.0, 0.0
    scale = None if l2norm else 0.5
    kw = dict(use_qk_l2norm=l2norm, scale=scale, lower_bound=lower_bound)
    warm = max(phase.values())
    for step in range(warm + 3 * L + 2):
        live = [s for s in act if step >= warm or phase[s] > step]
        sbi = _shuffled(live + [-1] * pad, gen)
        q, k, v, f, b = _tokens((sbi.shape[0],), H, K, V, gen)
        if not l2norm:  # keep the delta rule contractive without the norm: ||k|| ~ 1
            q, k = q * K ** -0.5, k * K ** -0.5
        y_conv = kda.conventional_step(S_conv, q, k, v, f, b, A_log, dt_bias, sbi, **kw)
        y_tri = kda.verify_triangular(buf, _ring(cursor), q[:, None], k[:, None], v[:, None], f[:, None], b[:, None],
                                      A_log, dt_bias, sbi, **kw)[:, 0]
        for s in live:
            if int(cursor[s]) == L - 1:
                flush_steps[s].append(step)
        y = kda.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, **kw)
        y_twin = kda.replay_decode(twin, cursor, q, k, v, f, b, A_log, dt_bias, sbi, **kw)
        cursors.advance_cursor(cursor, sbi, L)
        valid = sbi >= 0
        assert torch.isnan(y[~valid]).all() and torch.isnan(y_conv[~valid]).all()
        assert not torch.isnan(y[valid]).any()
        assert torch.equal(y_twin[valid], y[valid])  # entries beyond the cursor are never read
        worst_y = max(worst_y, _rel(y[valid], y_conv[valid]))
        worst_tri = max(worst_tri, _rel(y_tri[valid], y[valid]))
        _poison_beyond(twin, cursor, live)
        for s in live:
            count[s] += 1
            assert int(cursor[s]) == count[s] % L  # exact bookkeeping
            c = int(cursor[s])
            assert torch.equal(twin.state[s], buf.state[s])
            for a, z in zip(_tensors(twin)[1:], _tensors(buf)[1:]):  # the entries up to the cursor
                assert torch.equal(a[s][:, :c], z[s][:, :c])
            ks, us, gs, _, _ = kda._entries(buf, s, torch.arange(c), l2norm)
            for S_now in (kda.replay_state(buf, cursor, s, l2norm), kda._replay(buf.state[s], ks, us, gs)):
                worst_S = max(worst_S, _rel(S_now, S_conv[s]))
    for t, t0 in zip(_tensors(buf), untouched):  # slots never in a batch: bit-identical
        assert torch.equal(t[active:], t0[active:])
    assert not cursor[active:].any()
    firsts = [fs[0] for fs in flush_steps.values() if fs]
    return worst_y, worst_tri, worst_S, min(len(fs) for fs in flush_steps.values()), len(set(firsts))


BASE = dict(H=2, K=16, V=8, L=4, slots=6, active=4, pad=2)
CASES = [
    BASE,
    {**BASE, "L": 2},
    {**BASE, "L": 16},
    {**BASE, "L": 7},  # odd capacity
    {**BASE, "H": 1},
    {**BASE, "H": 4, "L": 8},
    {**BASE, "V": 5, "K": 7},  # odd head dims
    {**BASE, "V": 24, "K": 12, "L": 5},
    {**BASE, "pad": 0},
    {**BASE, "l2norm": False},  # use_qk_l2norm=False, explicit scale
    {**BASE, "lower_bound": -5.0},  # GLM-5 Next's bounded gate
]


def _id(c, base=BASE):
    return ",".join(f"{k}={v}" for k, v in c.items() if base.get(k) != v) or "base"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_replay_equals_conventional(case):
    worst_y, worst_tri, worst_S, flushes, distinct_first = _run_standard(**case)
    assert worst_y < RTOL, worst_y
    assert worst_tri < RTOL, worst_tri  # the kernel route (T = 1 triangular form) at every position
    assert worst_S < RTOL, worst_S
    assert flushes >= 2  # every slot went through several flush cycles
    assert distinct_first == min(case["L"], case["active"])  # rows flush at different steps


@pytest.mark.parametrize("ring", [torch.float32, torch.bfloat16], ids=["f32_ring", "bf16_ring"])
def test_default_caches_track_float64_oracle(ring):
    """KDABuffers.alloc's dtypes (fp32 checkpoint, bf16 k / v, fp32 g / beta; the u ring fp32 by default, bf16 beside
    a shadow: layers.ring_dtype), bf16 inputs. The state the buffer stands for (the exact fold) within fp32 roundings
    (4e-8 measured, 1e-6 allowed) at every step with either ring, so flush after flush the checkpoint does not drift.
    The fp32 ring: outputs and the u-sum of the stored u_j (what the fp32 flush stores) at fp32 rounding too (1e-6
    allowed). The bf16 ring: outputs within its rounding (1.4e-3 measured, 8e-3 allowed), its u-sum 1.7e-3 off (why a
    bf16 ring's flush must refold)."""
    gen = torch.Generator().manual_seed(31)
    H, K, V, L, slots = 2, 16, 16, 8, 3
    A_log, dt_bias = (t.float() for t in _params(H, K, gen))
    buf = kda.KDABuffers.alloc(slots, H, K, V, L) if ring == torch.float32 else kda.KDABuffers.alloc(
        slots, H, K, V, L, ring=ring)
    assert (buf.u_cache.dtype, buf.k_cache.dtype, buf.v_cache.dtype) == (ring, torch.bfloat16, torch.bfloat16)
    assert buf.g_cache.dtype == buf.beta_cache.dtype == buf.state.dtype == torch.float32
    buf.state.copy_(torch.randn(slots, H, K, V, generator=gen) * 0.3)
    S_conv = buf.state.double()
    cursor = torch.zeros(slots, dtype=torch.int32)
    worst_y, worst_S, usum = 0.0, 0.0, 0.0
    for _ in range(4 * L + 3):
        sbi = _shuffled(list(range(slots)) + [-1], gen)
        q, k, v, f, b = _tokens((sbi.shape[0],), H, K, V, gen, dtype=torch.bfloat16)
        y_conv = kda.conventional_step(S_conv, q, k, v, f, b, A_log, dt_bias, sbi)
        y = kda.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi)
        cursors.advance_cursor(cursor, sbi, L)
        valid = sbi >= 0
        worst_y = max(worst_y, _rel(y[valid], y_conv[valid]))
        for s in range(slots):
            worst_S = max(worst_S, _rel(kda.replay_state(buf, cursor, s), S_conv[s]))
            ks, us, gs, _, _ = kda._entries(buf, s, torch.arange(int(cursor[s])), True)
            usum = max(usum, _rel(kda._replay(buf.state[s].double(), ks, us, gs), S_conv[s]))
    assert 0 < worst_S < 1e-6, worst_S  # > 0: the fp32 caches do round
    if ring == torch.float32:
        assert 0 < worst_y < 1e-6 and 0 < usum < 1e-6, (worst_y, usum)
    else:
        assert 0 < worst_y < 8e-3, worst_y
        assert usum > 1e-4, usum


def test_L1_is_the_conventional_step_bit_for_bit():
    """L = 1: each step folds zero entries then takes the conventional step: the same float64 operations, so y and
    the state (float64 or float32 storage) are bit-identical; the buffers are never written."""
    gen = torch.Generator().manual_seed(2)
    H, K, V, slots = 2, 16, 8, 5
    A_log, dt_bias = _params(H, K, gen)
    for dtype in (F64, torch.float32):
        buf = kda.KDABuffers.alloc(slots, H, K, V, 1, act=dtype, ring=dtype, state_dtype=dtype)
        buf.state.copy_(torch.randn(slots, H, K, V, generator=gen) * 0.3)
        S_conv = buf.state.clone()
        caches = [t.clone() for t in _tensors(buf)[1:]]
        cursor = torch.zeros(slots, dtype=torch.int32)
        for _ in range(6):
            sbi = _shuffled(list(range(slots)) + [-1], gen)
            q, k, v, f, b = _tokens((sbi.shape[0],), H, K, V, gen, dtype=dtype)
            y_conv = kda.conventional_step(S_conv, q, k, v, f, b, A_log, dt_bias, sbi)
            y = kda.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi)
            cursors.advance_cursor(cursor, sbi, 1)
            valid = sbi >= 0
            assert torch.equal(y[valid], y_conv[valid])
            assert torch.equal(buf.state, S_conv)
            assert not cursor.any()
        for t, t0 in zip(_tensors(buf)[1:], caches):  # a flush never writes the buffers
            assert torch.equal(t, t0)


def test_flush_writes_the_checkpoint_and_only_it():
    """At cursor = L - 1 the checkpoint becomes the conventional state after the L tokens and no buffer entry is
    written; before it, the checkpoint is the one of L - 1 tokens ago and step j writes exactly entry j: the raw k
    (not normalised), u, the per-channel g, v and beta (exact statements)."""
    gen = torch.Generator().manual_seed(3)
    H, K, V, L = 2, 16, 8, 4
    A_log, dt_bias = _params(H, K, gen)
    buf = _buffers(1, H, K, V, L, gen)
    S_conv, S0 = buf.state.clone(), buf.state.clone()
    cursor = torch.zeros(1, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    for step in range(L):
        q, k, v, f, b = _tokens((1,), H, K, V, gen)
        kda.conventional_step(S_conv, q, k, v, f, b, A_log, dt_bias, sbi)
        caches = [t.clone() for t in _tensors(buf)[1:]]
        kda.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi)
        if step < L - 1:
            assert torch.equal(buf.state, S0)  # non-flush: the checkpoint is not written
            g, beta = kda.gates(f, b, A_log, dt_bias)
            assert torch.equal(buf.k_cache[0, :, step], k[0]) and torch.equal(buf.v_cache[0, :, step], v[0])
            assert torch.equal(buf.g_cache[0, :, step], g[0]) and torch.equal(buf.beta_cache[0, :, step], beta[0])
            for t, t0 in zip(_tensors(buf)[1:], caches):  # only entry ``step`` changed
                keep = [i for i in range(L) if i != step]
                assert torch.equal(t[0][:, keep], t0[0][:, keep])
        else:
            assert not torch.equal(buf.state, S0)
            assert _rel(buf.state, S_conv) < RTOL
            for t, t0 in zip(_tensors(buf)[1:], caches):
                assert torch.equal(t, t0)
        cursors.advance_cursor(cursor, sbi, L)
    assert int(cursor[0]) == 0


def test_fully_forgotten_channel_is_exact():
    """g = -inf on some channels (f = +inf: softplus = inf, exp(g) = 0, a channel fully forgotten) stays exact on
    every path, because the decays are suffix sums of g; the prefix-difference form exp(G_m - G_j) would be
    NaN there (shown)."""
    gen = torch.Generator().manual_seed(4)
    H, K, V, L = 2, 8, 6, 8
    A_log, dt_bias = _params(H, K, gen)
    buf = _buffers(1, H, K, V, L, gen)
    S_conv = buf.state.clone()
    cursor = torch.zeros(1, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    for step in range(2 * L):
        q, k, v, f, b = _tokens((1,), H, K, V, gen)
        if step in (1, 2, 9):
            f[0, 0, :3] = float("inf")
        y_conv = kda.conventional_step(S_conv, q, k, v, f, b, A_log, dt_bias, sbi)
        y = kda.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi)
        cursors.advance_cursor(cursor, sbi, L)
        assert torch.isfinite(y).all() and _rel(y, y_conv) < RTOL
        assert _rel(kda.replay_state(buf, cursor, 0), S_conv[0]) < RTOL
    gs = torch.zeros(1, 3, 1, dtype=F64)
    gs[0, 1, 0] = float("-inf")
    G = torch.cumsum(gs, 1)
    assert torch.isnan(torch.exp(G[:, -1:] - G)).any()  # the prefix-difference form
    after, total = kda._suffix(gs)
    assert torch.equal(torch.exp(after)[0, :, 0], torch.tensor([0.0, 1.0, 1.0], dtype=F64)) and total[0, 0] == -math.inf


# ---- teeth ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["u", "g", "k"])
def test_teeth_corrupted_entry_is_detected(which):
    """Corrupt one buffered entry: the replay stops matching the conventional outputs. A corrupted u_j moves only
    the output path (the state the buffer stands for is the fold from v_j, still exact); a corrupted g_j (one
    channel) or raw k_j moves both."""
    gen = torch.Generator().manual_seed(5)
    H, K, V, L = 2, 16, 8, 8
    A_log, dt_bias = _params(H, K, gen)
    buf = _buffers(1, H, K, V, L, gen, garbage=False)
    S_conv = buf.state.clone()
    cursor = torch.zeros(1, dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    errs = []
    for step in range(4):
        q, k, v, f, b = _tokens((1,), H, K, V, gen)
        if step == 3:  # entry 1 (index 0), head 1
            {"u": buf.u_cache[0, 1, 0], "g": buf.g_cache[0, 1, 0, 5:6], "k": buf.k_cache[0, 1, 0]}[which].add_(-0.5)
        y_conv = kda.conventional_step(S_conv, q, k, v, f, b, A_log, dt_bias, sbi)
        y = kda.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi)
        cursors.advance_cursor(cursor, sbi, L)
        errs.append(_rel(y, y_conv))
    assert max(errs[:3]) < RTOL and errs[3] > 1e-5, errs
    S_err = _rel(kda.replay_state(buf, cursor, 0), S_conv[0])
    assert (S_err < RTOL) if which == "u" else (S_err > 1e-5), S_err


def test_teeth_spec_poison_reaches_outputs_only_through_committed_entries():
    """NaN in one committed u entry reaches exactly the verify outputs of its (head, value column) at every window
    position (the delta rule is independent per value column); NaN in one channel of a committed g entry reaches
    its whole head (the channel's decay enters every decay-weighted product); NaN in a committed v entry that
    value column of the committed state; NaN in every non-committed ring entry changes nothing."""
    gen = torch.Generator().manual_seed(7)
    H, K, V, L, T = 3, 16, 8, 16, 4
    A_log, dt_bias = _params(H, K, gen)
    buf = _buffers(1, H, K, V, L, gen)
    cursor = torch.tensor([[13, 0]], dtype=torch.int32)  # the first window wraps the ring (13, 14, 15, 0)
    sbi = torch.tensor([0], dtype=torch.int32)
    q, k, v, f, b = _tokens((1, T), H, K, V, gen)
    kda.spec_step(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi)
    cursors.commit(cursor, torch.tensor([3]), T, L, sbi)  # committed at ring 13, 14, 15; rejected at 0
    q, k, v, f, b = _tokens((1, T), H, K, V, gen)

    def run(bf):
        return kda.spec_step(bf.clone(), cursor.clone(), q, k, v, f, b, A_log, dt_bias, sbi)

    y_good, S_good = run(buf), kda.committed_state(buf, cursor, 0)
    junk = buf.clone()
    for t in _tensors(junk)[1:]:
        t[0][:, [i for i in range(L) if i not in (13, 14, 15)]] = float("nan")
    assert torch.equal(run(junk), y_good)
    bad = buf.clone()
    bad.u_cache[0, 1, 14, 3] = float("nan")  # committed entry 2, head 1, value column 3
    y_bad = run(bad)
    hit = torch.zeros_like(y_good, dtype=torch.bool)
    hit[0, :, 1, 3] = True
    assert torch.isnan(y_bad[hit]).all() and torch.equal(y_bad[~hit], y_good[~hit])
    assert torch.equal(kda.committed_state(bad, cursor, 0), S_good)  # u is the output path only
    bad = buf.clone()
    bad.g_cache[0, 2, 13, 5] = float("nan")  # committed entry 1, head 2, key channel 5
    y_bad = run(bad)
    assert torch.isnan(y_bad[0, :, 2]).all() and torch.equal(y_bad[0, :, :2], y_good[0, :, :2])
    bad = buf.clone()
    bad.v_cache[0, 2, 15, 0] = float("nan")  # committed entry 3, head 2, value column 0: the fold
    S_bad = kda.committed_state(bad, cursor, 0)
    assert torch.isnan(S_bad[2, :, 0]).all() and not torch.isnan(S_bad[2, :, 1:]).any()
    assert torch.equal(S_bad[:2], S_good[:2])


# ---- speculative: flush_checkpoint + flush_cursor + verify + commit ------------------------------------------
def _run_spec(H, K, V, L, T, slots, active, pad, steps=36, accept="random", seed=0, lower_bound=None):
    """flush_checkpoint + flush_cursor + verify + commit with random acceptance n in 0..T over ``steps`` model steps.

    Every verify output (all T positions: a position's output does not depend on whether it is later accepted)
    against the conventional recurrence from the committed state; the committed state against the conventional
    state after the accepted tokens; verify_triangular against verify; cursors and committed ring entries against
    a Python model, exactly; a twin whose non-committed ring entries are NaN after every commit gives
    bit-identical outputs and states (rejected entries are never read)."""
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias = _params(H, K, gen)
    buf = _buffers(slots, H, K, V, L, gen)
    twin = buf.clone()
    S_conv = buf.state.clone()
    cursor = torch.zeros(slots, 2, dtype=torch.int32)
    cur_twin = cursor.clone()
    untouched = [t.clone() for t in _tensors(buf)]
    act = list(range(active))
    model = {s: [0, 0, []] for s in act}  # start, count, committed (k raw, v, g, beta) per slot
    worst, worst_tri, zero_accepts, flushes = 0.0, 0.0, 0, 0
    one = torch.tensor([0], dtype=torch.int32)
    lb = dict(lower_bound=lower_bound)
    for _ in range(steps):
        keep = [s for s in act if float(torch.rand(1, generator=gen)) < 0.85] or [act[0]]
        sbi = _shuffled(keep + [-1] * pad, gen)
        batch = sbi.shape[0]
        q, k, v, f, b = _tokens((batch, T), H, K, V, gen)
        if accept == "all":
            nacc = torch.full((batch,), T, dtype=torch.int32)
        else:
            nacc = torch.randint(0, T + 1, (batch,), generator=gen, dtype=torch.int32)
        rows_ = [(r, s) for r, s in enumerate(sbi.tolist()) if s >= 0]
        y_or = torch.full((batch, T, H, V), float("nan"), dtype=F64)
        for r, s in rows_:
            S_try = S_conv[s:s + 1].clone()
            for t in range(T):
                y_or[r, t] = kda.conventional_step(S_try, q[r:r + 1, t], k[r:r + 1, t], v[r:r + 1, t], f[r:r + 1, t],
                                                   b[r:r + 1, t], A_log, dt_bias, one, **lb)[0]
                if t + 1 == int(nacc[r]):
                    S_conv[s] = S_try[0]
            zero_accepts += int(nacc[r]) == 0
        ys = []
        for bf, cur in ((buf, cursor), (twin, cur_twin)):
            flushed = kda.flush_checkpoint(bf, cur, T, sbi)
            assert cursors.flush_cursor(cur, T, L, sbi) == flushed
            if bf is buf:
                flushes += len(flushed)
                y_tri = kda.verify_triangular(bf, cur, q, k, v, f, b, A_log, dt_bias, sbi, **lb)
            ys.append(kda.verify(bf, cur, q, k, v, f, b, A_log, dt_bias, sbi, flushed=flushed, **lb))
            cursors.commit(cur, nacc, T, L, sbi)
        y = ys[0]
        valid = sbi >= 0
        assert torch.isnan(y[~valid]).all() and not torch.isnan(y[valid]).any()
        assert torch.equal(ys[1][valid], y[valid])  # rejected entries (NaN in the twin) are never read
        worst = max(worst, _rel(y[valid], y_or[valid]))
        worst_tri = max(worst_tri, _rel(y_tri[valid], y[valid]))
        g, beta = kda.gates(f, b, A_log, dt_bias, lower_bound)
        for r, s in rows_:
            m = model[s]
            if m[1] + 2 * T > L:  # the flush rule, before the step
                m[0], m[1], m[2] = (m[0] + m[1]) % L, 0, []
            n = int(nacc[r])
            m[1] += n
            m[2] += [(k[r, t], v[r, t], g[r, t], beta[r, t]) for t in range(n)]
            assert cursor[s].tolist() == [m[0], m[1]] and torch.equal(cur_twin[s], cursor[s])  # exact
            assert m[1] <= L - T  # a fully accepted step leaves room for the next window
            for j, (ke, ve, ge, be) in enumerate(m[2]):  # committed ring entries, exact
                i = (m[0] + j) % L
                assert torch.equal(buf.k_cache[s][:, i], ke) and torch.equal(buf.v_cache[s][:, i], ve)
                assert torch.equal(buf.g_cache[s][:, i], ge) and torch.equal(buf.beta_cache[s][:, i], be)
            S_now = kda.committed_state(buf, cursor, s)
            assert _rel(S_now, S_conv[s]) < RTOL
            assert torch.equal(kda.committed_state(twin, cur_twin, s), S_now)
            junk = [i for i in range(L) if (i - m[0]) % L >= m[1]]
            for t in _tensors(twin)[1:]:
                t[s][:, junk] = float("nan")
    for t, t0 in zip(_tensors(buf), untouched):  # slots never in a batch: bit-identical
        assert torch.equal(t[active:], t0[active:])
    assert not cursor[active:].any()
    return worst, worst_tri, zero_accepts, flushes


SBASE = dict(H=2, K=16, V=8, L=8, T=2, slots=5, active=3, pad=1)
SCASES = [
    SBASE,
    {**SBASE, "T": 1, "L": 2},  # L = 2T: a flush at every step with history
    {**SBASE, "T": 1, "L": 4},
    {**SBASE, "T": 4},  # L = 2T
    {**SBASE, "T": 4, "L": 16},
    {**SBASE, "T": 4, "L": 9},  # capacity not a multiple of T: the ring start wraps at every offset
    {**SBASE, "H": 1},
    {**SBASE, "V": 5, "K": 7},
    {**SBASE, "pad": 0},
    {**SBASE, "accept": "all"},
    {**SBASE, "lower_bound": -5.0},
]


@pytest.mark.parametrize("case", SCASES, ids=lambda c: _id(c, SBASE))
def test_spec_commit_equals_conventional(case):
    worst, worst_tri, zero_accepts, flushes = _run_spec(**case)
    assert worst < RTOL, worst
    assert worst_tri < RTOL, worst_tri  # the triangular algebra of verify_triangular
    assert flushes >= 3
    if case.get("accept", "random") == "random":
        assert zero_accepts > 0  # n = 0 rows were exercised


def test_spec_step_is_flush_then_verify():
    """spec_step (single-layer convenience) == flush_checkpoint + flush_cursor + verify, exactly."""
    gen = torch.Generator().manual_seed(17)
    H, K, V, L, T = 2, 16, 8, 8, 2
    A_log, dt_bias = _params(H, K, gen)
    a_buf = _buffers(3, H, K, V, L, gen)
    b_buf = a_buf.clone()
    ca, cb = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32)
    sbi = torch.tensor([2, 0, 1], dtype=torch.int32)
    for _ in range(8):
        q, k, v, f, b = _tokens((3, T), H, K, V, gen)
        y = kda.spec_step(a_buf, ca, q, k, v, f, b, A_log, dt_bias, sbi)
        fl = kda.flush_checkpoint(b_buf, cb, T, sbi)
        cursors.flush_cursor(cb, T, L, sbi)
        assert torch.equal(y, kda.verify(b_buf, cb, q, k, v, f, b, A_log, dt_bias, sbi, flushed=fl))
        n = torch.randint(1, T + 1, (3,), generator=gen, dtype=torch.int32)
        cursors.commit(ca, n, T, L, sbi)
        cursors.commit(cb, n, T, L, sbi)
        for x, z in zip(_tensors(a_buf) + (ca,), _tensors(b_buf) + (cb,)):
            assert torch.equal(x, z)


def test_native_spec_baseline_equals_conventional():
    """native_spec_verify + spec_reference.native_spec_commit (a state copy per row) == the conventional oracle."""
    gen = torch.Generator().manual_seed(19)
    H, K, V, T, slots = 2, 16, 8, 3, 3
    A_log, dt_bias = _params(H, K, gen)
    state = torch.randn(slots, H, K, V, generator=gen, dtype=F64) * 0.3
    S_conv = state.clone()
    snaps = torch.zeros(slots, T + 1, H, K, V, dtype=F64)
    sbi = torch.tensor([1, -1, 0], dtype=torch.int32)
    one = torch.tensor([0], dtype=torch.int32)
    for _ in range(5):
        q, k, v, f, b = _tokens((3, T), H, K, V, gen)
        n = torch.randint(0, T + 1, (3,), generator=gen, dtype=torch.int32)
        y = kda.native_spec_verify(state, snaps, q, k, v, f, b, A_log, dt_bias, sbi)
        assert torch.isnan(y[1]).all() and not snaps[:, T].any()
        for r, s in ((0, 1), (2, 0)):
            S_try = S_conv[s:s + 1].clone()
            for t in range(T):
                y_t = kda.conventional_step(S_try, q[r:r + 1, t], k[r:r + 1, t], v[r:r + 1, t], f[r:r + 1, t],
                                            b[r:r + 1, t], A_log, dt_bias, one)
                assert _rel(y[r, t], y_t[0]) < RTOL
                if t + 1 == int(n[r]):
                    S_conv[s] = S_try[0]
        cursors.native_spec_commit(state, snaps, n, sbi)
        assert _rel(state, S_conv) < RTOL
    assert torch.equal(state[2], S_conv[2])  # never in the batch


@pytest.mark.parametrize("poison", ["v_nan", "k_inf", "q_nan", "f_nan", "b_nan", "f_inf"])
def test_later_window_token_never_reaches_earlier_outputs(poison):
    """A NaN / inf in window token 2 of 4 (history wrapping the ring): outputs 0..1 of verify and of
    verify_triangular are bit-identical to a clean run's; committing only tokens 0..1 leaves the poisoned entries
    beyond the count, and the next step is bit-identical to the clean run's too (never read). f = +inf is a
    legitimate full forget (g = -inf): there every output stays finite and exact."""
    gen = torch.Generator().manual_seed(29)
    H, K, V, L, T = 2, 8, 6, 16, 4
    A_log, dt_bias = _params(H, K, gen)
    base = _buffers(1, H, K, V, L, gen)
    cursor0 = torch.tensor([[13, 5]], dtype=torch.int32)
    sbi = torch.tensor([0], dtype=torch.int32)
    q, k, v, f, b = _tokens((1, T), H, K, V, gen)
    bad = [t.clone() for t in (q, k, v, f, b)]
    which, kind = poison.split("_")
    val = float("nan") if kind == "nan" else float("inf")
    tensor = dict(q=bad[0], k=bad[1], v=bad[2], f=bad[3], b=bad[4])[which]
    if which == "b":
        tensor[0, 2, 1] = val
    else:
        tensor[0, 2, 1, 3] = val
    nxt = _tokens((1, T), H, K, V, gen)
    outs = []
    for toks in ((q, k, v, f, b), tuple(bad)):
        buf, cur = base.clone(), cursor0.clone()
        y_tri = kda.verify_triangular(buf, cur, *toks, A_log, dt_bias, sbi)
        y = kda.spec_step(buf, cur, *toks, A_log, dt_bias, sbi)
        cursors.commit(cur, torch.tensor([2], dtype=torch.int32), T, L, sbi)
        y_next = kda.spec_step(buf, cur, *nxt, A_log, dt_bias, sbi)
        outs.append((y, y_tri, y_next, buf, cur))
    (y0, t0, n0, b0, c0), (y1, t1, n1, b1, c1) = outs
    assert torch.isfinite(y1[0, :2]).all() and torch.isfinite(t1[0, :2]).all()
    assert torch.equal(y1[0, :2], y0[0, :2]) and torch.equal(t1[0, :2], t0[0, :2])
    assert torch.equal(n1, n0) and torch.equal(c1, c0)
    assert torch.equal(kda.committed_state(b1, c1, 0), kda.committed_state(b0, c0, 0))
    if poison == "f_inf":
        assert torch.isfinite(y1).all() and _rel(t1, y1) < RTOL
    else:
        assert not torch.isfinite(y1[0, 2:]).all()  # the poison did reach its own position (not vacuous)


# ---- shadow ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,tol", [("bf16", 4e-3), ("fp8", 6e-2)])
def test_shadow_errors_do_not_accumulate(kind, tol):
    """Standard decode reading a bf16 / fp8 shadow of the checkpoint on non-flush steps, over 4 flushes:
    - non-flush outputs are within the shadow's rounding of the exact ones (0 < err < tol);
    - every flush refolds from v_j and the full-precision checkpoint, so checkpoints and flush-step outputs equal
      the no-shadow run's bit for bit, and the shadow is rewritten from what was stored;
    - counter-check: a fold by the u-sum of the shadow-computed u_j differs from the exact fold by a sizeable part
      of the shadow's rounding of S0 (> 5% of it; 17-30% measured), while without a shadow the two agree to 1e-12.
    Measured: bf16 non-flush 1.0e-3 .. 1.9e-3, fp8 1.1e-2 .. 2.2e-2."""
    gen = torch.Generator().manual_seed(29)
    H, K, V, L, slots = 2, 16, 16, 4, 2
    A_log, dt_bias = _params(H, K, gen)
    exact = _buffers(slots, H, K, V, L, gen)
    shad = exact.clone()
    sh = shadowq.Shadow.of(shad.state, kind)
    assert tuple(sh.q.shape) == (slots, H, K, V)
    S_conv = exact.state.clone()
    cur_e, cur_s = torch.zeros(slots, dtype=torch.int32), torch.zeros(slots, dtype=torch.int32)
    sbi = torch.tensor([1, 0], dtype=torch.int32)
    nonflush, usum_gap, flushes = [], [], 0
    for _ in range(4 * L):
        q, k, v, f, b = _tokens((2,), H, K, V, gen)
        pos = int(cur_e[0])
        if pos == L - 1:  # the counter-check, just before the fold: u-sum vs exact fold of the same entries
            for s in range(slots):
                idx = torch.arange(pos)
                ks, us, gs, _, _ = kda._entries(shad, s, idx, True)
                u_fold = kda._replay(shad.state[s], ks, us, gs)
                read_err = _rel(sh.read(s, F64), shad.state[s])
                usum_gap.append(_rel(u_fold, kda.replay_state(shad, cur_s, s)) / read_err)
                ks, us, gs, _, _ = kda._entries(exact, s, idx, True)
                assert _rel(kda._replay(exact.state[s], ks, us, gs), kda.replay_state(exact, cur_e, s)) < RTOL
        kda.conventional_step(S_conv, q, k, v, f, b, A_log, dt_bias, sbi)
        y_e = kda.replay_decode(exact, cur_e, q, k, v, f, b, A_log, dt_bias, sbi)
        y_s = kda.replay_decode(shad, cur_s, q, k, v, f, b, A_log, dt_bias, sbi, shadow=sh)
        cursors.advance_cursor(cur_e, sbi, L)
        cursors.advance_cursor(cur_s, sbi, L)
        if pos == L - 1:
            flushes += 1
            assert torch.equal(y_s, y_e) and torch.equal(shad.state, exact.state)
            assert _rel(shad.state, S_conv) < RTOL
            for s in range(slots):
                want = shadowq.Shadow(1, H, K, V, kind)
                want.write(0, shad.state[s])
                assert torch.equal(sh.q[s].view(torch.uint8), want.q[0].view(torch.uint8))
        else:
            nonflush.append(_rel(y_s, y_e))
            assert torch.equal(shad.v_cache, exact.v_cache) and torch.equal(shad.k_cache, exact.k_cache)
        for s in range(slots):  # the state the buffer stands for (the exact fold) is never off
            assert torch.equal(kda.replay_state(shad, cur_s, s), kda.replay_state(exact, cur_e, s))
    assert flushes >= 3
    assert 0 < min(nonflush) and max(nonflush) < tol, (min(nonflush), max(nonflush))
    assert min(usum_gap) > 0.05, usum_gap
    per = L - 1  # no accumulation: the last cycle's output error is no worse than the first's, up to noise
    assert max(nonflush[-per:]) < 4 * max(nonflush[:per]) + 1e-12


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_spec_shadow_flush_is_exact(kind):
    """Speculative form with a shadow: verify (and verify_triangular) reads the shadow except for the slots flushed
    this step; flush_checkpoint folds from v_j, so committed states equal the no-shadow run's bit for bit."""
    gen = torch.Generator().manual_seed(37)
    H, K, V, L, T = 2, 16, 16, 8, 2
    A_log, dt_bias = _params(H, K, gen)
    exact = _buffers(2, H, K, V, L, gen)
    shad = exact.clone()
    sh = shadowq.Shadow.of(shad.state, kind)
    ce, cs = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)
    sbi = torch.tensor([0, 1], dtype=torch.int32)
    flushes, errs = 0, []
    for _ in range(16):
        q, k, v, f, b = _tokens((2, T), H, K, V, gen)
        y_e = kda.spec_step(exact, ce, q, k, v, f, b, A_log, dt_bias, sbi)
        fl = kda.flush_checkpoint(shad, cs, T, sbi, shadow=sh)
        cursors.flush_cursor(cs, T, L, sbi)
        y_t = kda.verify_triangular(shad, cs, q, k, v, f, b, A_log, dt_bias, sbi, shadow=sh, flushed=fl)
        y_s = kda.verify(shad, cs, q, k, v, f, b, A_log, dt_bias, sbi, shadow=sh, flushed=fl)
        assert _rel(y_t, y_s) < RTOL  # both read the same S0 (shadow or checkpoint)
        flushes += len(fl)
        for r, s in enumerate(sbi.tolist()):
            if s in fl:
                assert torch.equal(y_s[r], y_e[r])  # a flushed slot reads the checkpoint it just stored
            else:
                errs.append(_rel(y_s[r], y_e[r]))
        n = torch.randint(1, T + 1, (2,), generator=gen, dtype=torch.int32)
        cursors.commit(ce, n, T, L, sbi)
        cursors.commit(cs, n, T, L, sbi)
        assert torch.equal(shad.state, exact.state) and torch.equal(ce, cs)
        for s in range(2):
            assert torch.equal(kda.committed_state(shad, cs, s), kda.committed_state(exact, ce, s))
    assert flushes >= 4
    assert 0 < min(errs) and max(errs) < (4e-3 if kind == "bf16" else 6e-2)


# ---- padding rows, unused slots, validation --------------------------------------------------------------
def test_padding_rows_and_unused_slots_untouched():
    gen = torch.Generator().manual_seed(41)
    H, K, V, L = 2, 16, 8, 4
    A_log, dt_bias = _params(H, K, gen)
    buf = _buffers(4, H, K, V, L, gen)
    cursor = torch.tensor([3, 1, 2, 0], dtype=torch.int32)  # slot 0 flushes, slot 2 appends at index 2
    before = [t.clone() for t in _tensors(buf)]
    sbi = torch.tensor([-1, 2, -1, 0], dtype=torch.int32)
    q, k, v, f, b = _tokens((4,), H, K, V, gen)
    y = kda.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi)
    assert torch.isnan(y[[0, 2]]).all() and not torch.isnan(y[[1, 3]]).any()
    assert cursor.tolist() == [3, 1, 2, 0]  # replay_decode does not move the cursor
    for now, then in zip(_tensors(buf), before):
        for s in (1, 3):
            assert torch.equal(now[s], then[s])
    assert torch.equal(buf.state[2], before[0][2]) and not torch.equal(buf.state[0], before[0][0])
    for now, then in zip(_tensors(buf)[1:], before[1:]):
        assert torch.equal(now[0], then[0])  # flush: no buffer written
        assert torch.equal(now[2][:, [0, 1, 3]], then[2][:, [0, 1, 3]])
    # speculative: the same for verify (+ flush_checkpoint) and commit
    ring = torch.tensor([[1, 4], [3, 2], [7, 1], [0, 0]], dtype=torch.int32)
    L2, T = 8, 2
    buf = _buffers(4, H, K, V, L2, gen)
    before = [t.clone() for t in _tensors(buf)] + [ring.clone()]
    sbi = torch.tensor([-1, 2, -1], dtype=torch.int32)
    q, k, v, f, b = _tokens((3, T), H, K, V, gen)
    y = kda.spec_step(buf, ring, q, k, v, f, b, A_log, dt_bias, sbi)
    cursors.commit(ring, torch.tensor([T, 1, T], dtype=torch.int32), T, L2, sbi)
    assert torch.isnan(y[[0, 2]]).all() and not torch.isnan(y[1]).any()
    for now, then in zip(_tensors(buf) + (ring,), before):
        for s in (0, 1, 3):
            assert torch.equal(now[s], then[s])
    assert ring[2].tolist() == [7, 2]  # 1 + 4 <= 8: no flush; window at ring (7 + 1) % 8 = 0, 1; one accepted
    assert torch.equal(buf.v_cache[2][:, [0, 1]], v[1].transpose(0, 1))
    assert torch.equal(buf.k_cache[2][:, [0, 1]], k[1].transpose(0, 1))  # raw k


def _problem(slots=2, H=2, K=16, V=8, L=4, lead=(2,)):
    gen = torch.Generator().manual_seed(43)
    A_log, dt_bias = _params(H, K, gen)
    return gen, _buffers(slots, H, K, V, L, gen), _tokens(lead, H, K, V, gen), A_log, dt_bias


def test_shape_errors_name_the_argument():
    _, buf, (q, k, v, f, b), A_log, dt_bias = _problem()
    cur = torch.zeros(2, dtype=torch.int32)
    sbi = torch.tensor([0, 1], dtype=torch.int32)
    args = dict(q=q, k=k, v=v, f=f, b=b, A_log=A_log, dt_bias=dt_bias)
    for name, bad, msg in (("q", q[..., :7], r"q: expected shape \(2, 2, 16\), got \(2, 2, 7\)"),
                           ("k", k[:, :1], r"k: expected shape \(2, 2, 16\), got \(2, 1, 16\)"),
                           ("f", f[..., :3], r"f: expected shape \(2, 2, 16\), got \(2, 2, 3\)"),
                           ("b", b[None], r"b: expected shape \(2, 2\)"),
                           ("A_log", A_log[:1], r"A_log: expected shape \(2,\), got \(1,\)"),
                           ("dt_bias", dt_bias[:, 0], r"dt_bias: expected shape \(2, 16\), got \(2,\)")):
        with pytest.raises(ValueError, match=msg):
            kda.replay_decode(buf, cur, **{**args, name: bad}, state_batch_indices=sbi)
    with pytest.raises(ValueError, match=r"v: expected shape \(2, 2, 8\), got \(2, 2, 5\)"):
        kda.replay_decode(buf, cur, **{**args, "v": v[..., :5]}, state_batch_indices=sbi)
    with pytest.raises(ValueError, match=r"v: expected a \(batch, H, V\) tensor, got \(2, 1, 2, 8\)"):
        kda.replay_decode(buf, cur, **{**args, "v": v[:, None]}, state_batch_indices=sbi)
    with pytest.raises(TypeError, match="A_log: expected a torch.Tensor, got list"):
        kda.replay_decode(buf, cur, **{**args, "A_log": A_log.tolist()}, state_batch_indices=sbi)
    with pytest.raises(ValueError, match=r"cursor: expected shape \(2,\), got \(2, 2\)"):
        kda.replay_decode(buf, torch.zeros(2, 2, dtype=torch.int32), **args, state_batch_indices=sbi)
    bad = buf.clone()
    bad.g_cache = bad.g_cache[..., :3]
    with pytest.raises(ValueError, match=r"g_cache: expected shape \(2, 2, 4, 16\), got \(2, 2, 4, 3\)"):
        kda.replay_decode(bad, cur, **args, state_batch_indices=sbi)
    with pytest.raises(ValueError, match=r"shadow: expected shape \(2, 2, 16, 8\)"):
        kda.replay_decode(buf, cur, **args, state_batch_indices=sbi,
                          shadow=shadowq.Shadow(2, 2, 8, 16, "bf16"))
    _, sbuf, (q, k, v, f, b), A_log, dt_bias = _problem(lead=(2, 2), L=4)
    with pytest.raises(ValueError, match=r"v: expected at most L=4 tokens per window, got T=5"):
        q5, k5, v5, f5, b5 = _tokens((2, 5), 2, 16, 8, torch.Generator().manual_seed(0))
        kda.verify(sbuf, torch.zeros(2, 2, dtype=torch.int32), q5, k5, v5, f5, b5, A_log, dt_bias, sbi)
    with pytest.raises(ValueError, match=r"snapshots: expected shape \(2, >= 2, 2, 16, 8\)"):
        kda.native_spec_verify(sbuf.state, torch.zeros(2, 1, 2, 16, 8, dtype=F64), q, k, v, f, b, A_log, dt_bias, sbi)


def test_cursor_and_slot_errors_write_nothing():
    _, buf, (q, k, v, f, b), A_log, dt_bias = _problem()
    before = [t.clone() for t in _tensors(buf)]
    sbi = torch.tensor([0, 1], dtype=torch.int32)
    args = (q, k, v, f, b, A_log, dt_bias)
    with pytest.raises(ValueError, match=r"cursor\[1\] = 4 is outside \[0, 4\)"):
        kda.replay_decode(buf, torch.tensor([3, 4], dtype=torch.int32), *args, sbi)  # row 0 would flush: it must not
    with pytest.raises(ValueError, match=r"cursor\[0\] = -1 is outside"):
        kda.replay_decode(buf, torch.tensor([-1, 0], dtype=torch.int32), *args, sbi)
    with pytest.raises(ValueError, match="state_batch_indices: a slot appears in more than one row"):
        kda.replay_decode(buf, torch.zeros(2, dtype=torch.int32), *args, torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"state_batch_indices: expected values in \[-1, 2\), got \[2\]"):
        kda.replay_decode(buf, torch.zeros(2, dtype=torch.int32), *args, torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="state_batch_indices: expected dtype int32"):
        kda.replay_decode(buf, torch.zeros(2, dtype=torch.int32), *args, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="more than one row"):
        kda.conventional_step(buf.state.clone(), *args, torch.tensor([0, 0], dtype=torch.int32))
    for t, t0 in zip(_tensors(buf), before):
        assert torch.equal(t, t0)
    _, sbuf, (q, k, v, f, b), A_log, dt_bias = _problem(L=8, lead=(2, 2))
    before = [t.clone() for t in _tensors(sbuf)]
    args = (q, k, v, f, b, A_log, dt_bias)
    with pytest.raises(ValueError, match=r"cursor\[1\]: expected 0 <= start < 8 and count \+ T <= 8 \(T=2\), got "
                                         r"start=0, count=7; run flush_checkpoint"):
        kda.verify(sbuf, torch.tensor([[3, 2], [0, 7]], dtype=torch.int32), *args, sbi)
    with pytest.raises(ValueError, match=r"cursor\[0\]: expected 0 <= start < 8"):
        kda.verify_triangular(sbuf, torch.tensor([[8, 0], [0, 0]], dtype=torch.int32), *args, sbi)
    with pytest.raises(ValueError, match=r"buffer_len: expected >= 2 \* num_tokens = 10"):
        kda.flush_checkpoint(sbuf, torch.zeros(2, 2, dtype=torch.int32), 5, sbi)
    with pytest.raises(ValueError, match=r"cursor: expected shape \(2, 2\)"):
        kda.flush_checkpoint(sbuf, torch.zeros(2, dtype=torch.int32), 2, sbi)
    for t, t0 in zip(_tensors(sbuf), before):
        assert torch.equal(t, t0)


# ---- the family interface ---------------------------------------------------------------------------------
def _docstring_table():
    """The state table of reference.py's docstring: {name: (shape text, dtype text)}."""
    lines = kda.__doc__.splitlines()
    rules = [i for i, ln in enumerate(lines) if ln.startswith("=====")]
    out = {}
    for ln in lines[rules[1] + 1:rules[2]]:
        parts = ln.split()
        shape_end = next(i for i, p in enumerate(parts) if p.endswith(")"))
        out[parts[0]] = (" ".join(parts[1:shape_end + 1]), parts[shape_end + 1])
    return out


def test_family_interface_allocates_the_state_table():
    """families.get("kda") is the folder's FAMILY; its state table, the reference docstring's table and
    KDABuffers.alloc agree (names, shapes, dtypes); the bytes model it names is costs' one; unknown names and
    roles are refused by name."""
    assert "kda" in families.names()
    fam = families.get("kda")
    assert fam is kda_family.FAMILY and fam.reference_module() is kda and fam.bytes_per_step is costs.kda_bytes_per_step
    doc = _docstring_table()
    assert list(doc) == [t.name for t in kda.STATE_TABLE]
    sym = {"slots": "S"}
    for t in kda.STATE_TABLE:
        assert doc[t.name][0] == "(" + ", ".join(sym.get(d, d) for d in t.dims) + ")", t.name
        assert doc[t.name][1] == {"state": "f32", "shadow": "bf16", "act": "act", "ring": "ring", "f32": "f32"}[t.dtype]
    slots, L, geo = 3, 5, (2, 16, 8)
    buf = kda.KDABuffers.alloc(slots, *geo, L)
    shapes = fam.shapes(slots, L, geo)
    assert list(shapes) == ["state", "k_cache", "u_cache", "g_cache", "v_cache", "beta_cache"]
    for name, t in zip(shapes, buf.tensors()):
        assert tuple(t.shape) == shapes[name] and not t.any()
    assert fam.shapes(slots, L, geo, optional=True)["shadow"] == (slots, *geo)
    assert [t.dtype for t in buf.tensors()] == [torch.float32, torch.bfloat16, torch.float32, torch.float32,
                                                torch.bfloat16, torch.float32]  # no shadow: the fp32 u ring
    mem = costs.kda_layer_memory(*geo, L)
    assert mem["state"] + mem["ring"] == sum(t.numel() * t.element_size() for t in buf.tensors()) // slots
    sbuf = kda.KDABuffers.alloc(slots, *geo, L, ring=torch.bfloat16)  # beside a shadow: the bf16 u ring
    mem = costs.kda_layer_memory(*geo, L, shadow="bf16")
    sh = shadowq.Shadow.of(sbuf.state, "bf16")
    assert mem["state"] + mem["ring"] == sum(t.numel() * t.element_size() for t in sbuf.tensors()) // slots
    assert mem["shadow"] == sh.q.numel() * sh.q.element_size() // slots
    with pytest.raises(ValueError, match=r"family: expected one of \['gdn', 'kda', 'mamba2'\]"):
        families.get("mamba3")
    with pytest.raises(ValueError, match=r"dtypes: unknown roles \['x'\]"):
        fam.allocate(1, 2, geo, {"x": torch.float32})
    with pytest.raises(ValueError, match=r"geometry: expected 3 sizes \('H', 'K', 'V'\), got \(2, 16\)"):
        fam.shapes(1, 2, (2, 16))
