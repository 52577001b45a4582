# SPDX-License-Identifier: Apache-2.0
"""Executable specification of ReplaySSM Kimi Delta Attention (KDA) decode: Kimi-K3, Kimi-Linear, GLM-5.3-Flash.

float64 math in plain torch, any device; the tests run it on the CPU and the KDA kernels will be checked
against it. Standard decode (one token per step, cursor (slots,)) and speculative verify / commit (cursor
(slots, 2) ring, flush one window early) share the step math (:func:`_step`, :func:`_fold`, :func:`_replay`).

Math (docs: /work/shared/DESIGN.md §5; transformers ``models/kimi_linear`` ``recurrent_kimi_delta_attention``,
which ``models/glm5_next`` repeats). Per slot and head h (q, k, v, beta and the gates all per head; state S is
(K, V), the transformers / fla layout):
    g    = -exp(A_log) softplus(f + dt_bias)                (Kimi; per key channel, (K,), <= 0)
    g    = lower_bound sigmoid(exp(A_log) (f + dt_bias))      (GLM-5 Next, "safe gate": lower_bound < g < 0)
    beta = sigmoid(b)
    q, k <- x / sqrt(||x||^2 + eps) (``use_qk_l2norm``; transformers' kimi l2norm), q <- q * scale (K^-1/2)
    conventional:  S <- Diag(exp(g)) S;  u = beta (v - S^T k);  S <- S + k u^T;  y = S^T q
with f = f_b(f_a(x)) the raw forget-gate projection (H, K), dt_bias (H, K), A_log (H,), b the raw beta logit.
ReplaySSM: checkpoint S0 and a buffer of entries j = 1..m (k_j, u_j, g_j, and v_j, beta_j for the fold). With
the per-channel decay from entry j to step t, D_{t,j} = Diag(exp(sum_{j<i<=t} g_i)) (D_{t,0} from S0):
    S_m   = D_{m,0} S0 + sum_{j<=m} D_{m,j} k_j u_j^T                    (linear in the buffer)
    step t = m + 1 (D_{t,.} includes g_t):
        (D_{t,0} S0 ...)^T k_t = S0^T (D_{t,0} k_t) + sum_j (k_j . D_{t,j} k_t) u_j         (same for q_t)
        u_t = beta_t (v_t - that)
        y_t = S0^T (D_{t,0} q_t) + sum_j (k_j . D_{t,j} q_t) u_j + (k_t . q_t) u_t
so a step reads S0 once for two vectors (D_{t,0} k_t, D_{t,0} q_t), reads the buffer, and writes only its entry.
Unlike GDN the decay is a K-vector per entry: each entry's weight is a decay-weighted inner product (K
exponentials per entry and step), and the buffer holds g_j as K floats, which is what makes the entry heavier.
The decays are suffix sums of g (:func:`_suffix`), never differences of prefix sums: exp(G_t - G_j) would turn
a fully forgotten channel (g = -inf) into NaN and loses fp32 bits where |G| is large.

Flush (standard: the step whose entry is the L-th; speculative: one window early) writes the checkpoint by the
*exact* recurrence over the buffered (k_j, v_j, g_j, beta_j) from the full-precision checkpoint,
:func:`_fold`, not by the u-sum: the buffer's u_j are stored in bf16 (DESIGN §5: the output path reads a bf16
k / u ring) and, with a shadow, were computed from the shadow's S0; refolding from v_j keeps both roundings
out of the checkpoint, so they never accumulate across flushes (the u-sum fold would carry them).

Ring contents (decided here): k_j is stored *raw*, as the kernel received it (before the l2 norm), in the
activation dtype: that is exact (the input itself), and both paths normalise it again (one K-reduction per
entry, free next to the K-wide decay-weighted products the output path computes from the same values). A
bf16 copy of the normalised k would be a rounding the fold could not undo. v_j is the input (exact in act),
g_j the computed log decay (fp32), beta_j fp32, u_j the corrected update in the ``ring`` dtype (bf16).

State of one KDA layer (S slots, H heads, K key dim, V value dim, L buffer) (:data:`STATE_TABLE`, from which
:class:`KDABuffers` and the family interface allocate):

=============  ==================  ===========  ====================================================
tensor         shape               dtype        written by / meaning
=============  ==================  ===========  ====================================================
state          (S, H, K, V)        f32          checkpoint S0: prefill hand-off; the exact fold at a flush
shadow         (S, H, K, V)        bf16         optional; rewritten from the checkpoint whenever it is written
k_cache        (S, H, L, K)        act          ring of raw k_j (before the l2 norm)
u_cache        (S, H, L, V)        ring (bf16)  ring of corrected updates u_j (the output path only)
g_cache        (S, H, L, K)        f32          ring of per-channel log decays g_j
v_cache        (S, H, L, V)        act          ring of v_j (the exact fold only)
beta_cache     (S, H, L)           f32          ring of beta_j (the exact fold only)
=============  ==================  ===========  ====================================================
The conv window over q | k | v (3 H K channels at K = V) is the cache's, as for Mamba-2 and GDN. Entry j of the
standard form lives at index j - 1; of the ring form at (start + j - 1) % L, with the shared cursor rules
(:func:`..advance_cursor`, :func:`..flush_cursor`, :func:`..commit`; contract.py). Step inputs: q, k, f
(batch, [T,] H, K); v (batch, [T,] H, V); b (batch, [T,] H); A_log (H,), dt_bias (H, K). Output y (batch,
[T,] H, V) float64, before the layer's gated RMSNorm. Padding rows (slot -1) touch nothing; their y is NaN here
(kernels leave it).

Shadow: a :class:`~trtllm_replayssm.shadow.Shadow` of ``state`` ((S, H, K, V); bf16, or fp8 with a scale per (slot, h, k)
row). Non-flush steps read S0 through it; flushes read the full-precision checkpoint and rewrite it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...costs import kda_bytes_per_position as bytes_per_position  # the bytes model's home is costs (re-exported)
from ...costs import kda_bytes_per_step as bytes_per_step
from ...cursor import (
    COUNT,
    START,
    check_ring_cursor,
    check_standard_cursor,
    check_window,
    flush_cursor,
    needs_flush,
    ring_indices,
    rows,
)
from ...shadow import Shadow
from .. import StateTensor

F64 = torch.float64
L2NORM_EPS = 1e-6  # transformers' kimi_linear / glm5_next l2norm eps

GEOMETRY = ("H", "K", "V")
STATE_TABLE = (
    StateTensor("state", ("slots", "H", "K", "V"), "state", "prefill hand-off; the exact fold at a flush"),
    StateTensor("shadow", ("slots", "H", "K", "V"), "shadow", "rewritten with the checkpoint", optional=True),
    StateTensor("k_cache", ("slots", "H", "L", "K"), "act", "each step: its token's raw k"),
    StateTensor("u_cache", ("slots", "H", "L", "V"), "ring", "each step: its token's corrected update u"),
    StateTensor("g_cache", ("slots", "H", "L", "K"), "f32", "each step: its token's per-channel log decay"),
    StateTensor("v_cache", ("slots", "H", "L", "V"), "act", "each step: its token's v"),
    StateTensor("beta_cache", ("slots", "H", "L"), "f32", "each step: its token's beta"),
)
# "ring": the u ring's dtype without a shadow (layers.ring_dtype: bf16 beside a bf16 shadow)
DTYPES = {"state": torch.float32, "shadow": torch.bfloat16, "act": torch.bfloat16, "ring": torch.float32,
          "f32": torch.float32}
_RING = ("k_cache", "u_cache", "g_cache", "v_cache", "beta_cache")


@dataclass
class KDABuffers:
    """The per-layer tensors of the table above (mutated in place by the steps)."""

    state: torch.Tensor
    k_cache: torch.Tensor
    u_cache: torch.Tensor
    g_cache: torch.Tensor
    v_cache: torch.Tensor
    beta_cache: torch.Tensor

    @classmethod
    def alloc(cls, slots: int, H: int, K: int, V: int, L: int, act=torch.bfloat16, ring=torch.float32,
              state_dtype=torch.float32, f32=torch.float32, device="cpu") -> KDABuffers:
        """Zeroed buffers from :data:`STATE_TABLE` (``f32``: the g / beta ring dtype, float64 in exact tests)."""
        from . import FAMILY

        t = FAMILY.allocate(slots, L, (H, K, V), dict(state=state_dtype, act=act, ring=ring, f32=f32), device=device)
        return cls(**t)

    @property
    def geometry(self) -> tuple[int, int, int, int, int]:
        """(slots, H, K, V, L)."""
        S, H, K, V = self.state.shape
        return S, H, K, V, self.u_cache.shape[2]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(state, k, u, g, v, beta) in the table's order."""
        return (self.state,) + tuple(getattr(self, n) for n in _RING)

    def check(self) -> None:
        if self.state.dim() != 4 or self.u_cache.dim() != 4:
            raise ValueError(f"state: expected (slots, H, K, V) and u_cache (slots, H, L, V), got "
                             f"{tuple(self.state.shape)} and {tuple(self.u_cache.shape)}")
        S, H, K, V, L = self.geometry
        sizes = {"slots": S, "H": H, "K": K, "V": V, "L": L}
        for row in STATE_TABLE:
            if row.optional:
                continue
            t = getattr(self, row.name)
            if tuple(t.shape) != row.shape(sizes):
                raise ValueError(f"{row.name}: expected shape {row.shape(sizes)}, got {tuple(t.shape)}")

    def clone(self) -> KDABuffers:
        return KDABuffers(*(t.clone() for t in self.tensors()))


# ---- the step math, written once ------------------------------------------------------------------------
def _softplus(x):
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))


def gates(f, b, A_log, dt_bias, lower_bound: float | None = None):
    """(g, beta) float64 from the raw forget-gate projection f (..., H, K), the raw beta logit b (..., H), A_log (H,)
    and dt_bias (H, K). ``lower_bound`` None: Kimi's g = -exp(A_log) softplus(f + dt_bias); a number (GLM-5 Next,
    -5 by default there): g = lower_bound sigmoid(exp(A_log) (f + dt_bias))."""
    x = f.to(F64) + dt_bias.to(F64)
    A = torch.exp(A_log.to(F64))[:, None]
    g = -A * _softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(A * x)
    return g, torch.sigmoid(b.to(F64))


def l2norm(x):
    """x / sqrt(||x||^2 + eps) over the last dim, float64 (transformers' kimi l2norm, eps 1e-6)."""
    x = x.to(F64)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def prep_k(k, use_qk_l2norm: bool = True):
    """The key the recurrence uses, float64: l2-normalised when asked (the ring stores k before this)."""
    return l2norm(k) if use_qk_l2norm else k.to(F64)


def prep_qk(q, k, use_qk_l2norm: bool = True, scale: float | None = None):
    """(q', k') float64: l2-normalised when asked, q' scaled by ``scale`` (K^-1/2 by default)."""
    q = l2norm(q) if use_qk_l2norm else q.to(F64)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), prep_k(k, use_qk_l2norm)


def _step(S, q, k, v, g, beta):
    """One conventional step from S (H, K, V) float64; q, k, g (H, K), v (H, V), beta (H,). Returns (S_new, u, y)."""
    S = torch.exp(g)[:, :, None] * S
    u = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
    S = S + k[:, :, None] * u[:, None, :]
    return S, u, torch.einsum("hkv,hk->hv", S, q)


def _fold(S0, ks, vs, gs, betas):
    """Exact recurrence over buffered entries: S0 (H, K, V), ks (H, m, K) normalised, vs (H, m, V), gs (H, m, K),
    betas (H, m)."""
    S = S0
    for j in range(vs.shape[1]):
        S, _, _ = _step(S, ks[:, j], ks[:, j], vs[:, j], gs[:, j], betas[:, j])
    return S


def _suffix(gs):
    """gs (H, m, K) -> (after (H, m, K): sum_{i>j} g_i, the decay entry j sees up to entry m; total (H, K)).
    Reverse cumulative sums, no differences (module docstring)."""
    incl = torch.flip(torch.cumsum(torch.flip(gs, (1,)), 1), (1,))  # sum_{i>=j}
    zero = gs.new_zeros(gs.shape[0], 1, gs.shape[2])
    return torch.cat([incl[:, 1:], zero], dim=1)[:, :gs.shape[1]], torch.cat([incl, zero], dim=1)[:, 0]


def _replay(S0, ks, us, gs):
    """S_m from the u-sum: D_{m,0} S0 + sum_j D_{m,j} k_j u_j^T (what the output path computes)."""
    if us.shape[1] == 0:
        return S0
    after, total = _suffix(gs)
    return torch.exp(total)[:, :, None] * S0 + torch.einsum("hjk,hjv->hkv", torch.exp(after) * ks, us)


def _entries(buf: KDABuffers, s: int, idx: torch.Tensor, use_qk_l2norm: bool):
    """Buffered entries of slot s at ring / array indices ``idx``, float64: (k normalised, u, g, v, beta)."""
    return (prep_k(buf.k_cache[s][:, idx], use_qk_l2norm), buf.u_cache[s][:, idx].to(F64),
            buf.g_cache[s][:, idx].to(F64), buf.v_cache[s][:, idx].to(F64), buf.beta_cache[s][:, idx].to(F64))


def _store(buf: KDABuffers, s: int, idx, k_raw, u, g, v, beta) -> None:
    """Write entries at ``idx`` (int or index tensor): k_raw, g (H, [n,] K), u, v (H, [n,] V), beta (H, [n])."""
    for name, t in zip(_RING, (k_raw, u, g, v, beta)):
        cache = getattr(buf, name)
        cache[s][:, idx] = t.to(cache.dtype)


def _read_S0(buf: KDABuffers, s: int, shadow: Shadow | None, exact: bool):
    return buf.state[s].to(F64) if shadow is None or exact else shadow.read(s, F64)


def _check(name, t, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def check_inputs(H, K, V, q, k, v, f, b, A_log, dt_bias, lead: tuple) -> None:
    """Every step input's shape (names the argument): q, k, f (*lead, H, K), v (*lead, H, V), b (*lead, H),
    A_log (H,), dt_bias (H, K)."""
    for name, t, shape in (("q", q, lead + (H, K)), ("k", k, lead + (H, K)), ("v", v, lead + (H, V)),
                           ("f", f, lead + (H, K)), ("b", b, lead + (H,)), ("A_log", A_log, (H,)),
                           ("dt_bias", dt_bias, (H, K))):
        _check(name, t, shape)


def _check_buf(buf: KDABuffers, shadow: Shadow | None, v, lead_dims: int):
    buf.check()
    _, H, K, V, _ = buf.geometry
    if not isinstance(v, torch.Tensor) or v.dim() != lead_dims + 2:
        raise ValueError(f"v: expected a ({'batch, T' if lead_dims == 2 else 'batch'}, H, V) tensor, got "
                         f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    if shadow is not None:
        _check("shadow", shadow.q, buf.state.shape)
    return H, K, V


# ---- conventional baseline ------------------------------------------------------------------------------
def conventional_step(state, q, k, v, f, b, A_log, dt_bias, state_batch_indices=None, use_qk_l2norm=True,
                      scale=None, lower_bound=None):
    """One conventional KDA step; ``state`` (slots, H, K, V) updated in place; returns y (batch, H, V) float64."""
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        raise ValueError(f"state: expected a (slots, H, K, V) tensor, got "
                         f"{tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}")
    nslots, H, K, V = state.shape
    batch = v.shape[0]
    check_inputs(H, K, V, q, k, v, f, b, A_log, dt_bias, (batch,))
    slots = rows(state_batch_indices, batch, nslots)
    qn, kn = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(f, b, A_log, dt_bias, lower_bound)
    y = torch.full((batch, H, V), float("nan"), dtype=F64, device=v.device)
    for r, s in enumerate(slots):
        if s < 0:
            continue
        S, _, y[r] = _step(state[s].to(F64), qn[r], kn[r], v[r].to(F64), g[r], beta[r])
        state[s] = S.to(state.dtype)
    return y


# ---- standard ReplaySSM decode (cursor (slots,)) ----------------------------------------------------------
def replay_decode(buf: KDABuffers, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices=None,
                  shadow: Shadow | None = None, use_qk_l2norm=True, scale=None, lower_bound=None):
    """One ReplaySSM KDA step without moving the cursor; returns y (batch, H, V) float64.

    Non-flush step (cursor + 1 < L): entry cursor + 1 is appended at index cursor (its u from S_m, read through
    the shadow when given, and the cursor entries); nothing else is written. Flush step (cursor + 1 == L): the
    checkpoint becomes the exact fold of the L - 1 buffered entries and this token (shadow rewritten); the
    buffers are not written. Move the cursor with :func:`..advance_cursor` once per model step. Every row is
    validated before anything is written."""
    H, K, V = _check_buf(buf, shadow, v, 1)
    nslots, _, _, _, L = buf.geometry
    batch = v.shape[0]
    check_inputs(H, K, V, q, k, v, f, b, A_log, dt_bias, (batch,))
    slots = rows(state_batch_indices, batch, nslots)
    check_standard_cursor(cursor, nslots, slots, L)
    qn, kn = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(f, b, A_log, dt_bias, lower_bound)
    y = torch.full((batch, H, V), float("nan"), dtype=F64, device=v.device)
    for r, s in enumerate(slots):
        if s < 0:
            continue
        pos = int(cursor[s])
        ks, us, gs, vs, bs = _entries(buf, s, torch.arange(pos, device=buf.state.device), use_qk_l2norm)
        if pos + 1 == L:
            S = _fold(buf.state[s].to(F64), ks, vs, gs, bs)
            S, _, y[r] = _step(S, qn[r], kn[r], v[r].to(F64), g[r], beta[r])
            buf.state[s] = S.to(buf.state.dtype)
            if shadow is not None:
                shadow.write(s, buf.state[s])
        else:
            Sm = _replay(_read_S0(buf, s, shadow, False), ks, us, gs)
            _, u, y[r] = _step(Sm, qn[r], kn[r], v[r].to(F64), g[r], beta[r])
            _store(buf, s, pos, k[r], u, g[r], v[r], beta[r])
    return y


def replay_state(buf: KDABuffers, cursor, slot: int, use_qk_l2norm=True) -> torch.Tensor:
    """The current recurrent state of ``slot`` (standard cursor): the exact fold of its entries, float64 (H, K, V)."""
    pos = int(cursor[slot])
    ks, _, gs, vs, bs = _entries(buf, slot, torch.arange(pos, device=buf.state.device), use_qk_l2norm)
    return _fold(buf.state[slot].to(F64), ks, vs, gs, bs)


# ---- speculative: flush one window early, verify T tokens, commit by cursor -----------------------------
def committed_state(buf: KDABuffers, cursor, slot: int, use_qk_l2norm=True) -> torch.Tensor:
    """S_count of ``slot`` (ring cursor): the exact fold of its committed entries, float64 (H, K, V)."""
    L = buf.u_cache.shape[2]
    start, count = int(cursor[slot, START]), int(cursor[slot, COUNT])
    ks, _, gs, vs, bs = _entries(buf, slot, ring_indices(start, 0, count, L, buf.state.device), use_qk_l2norm)
    return _fold(buf.state[slot].to(F64), ks, vs, gs, bs)


def flush_checkpoint(buf: KDABuffers, cursor, num_tokens: int, state_batch_indices=None,
                     shadow: Shadow | None = None, use_qk_l2norm=True) -> list[int]:
    """One layer's part of the flush: S0 <- S_count where count + 2T > L. Cursor read only; returns the slots.

    Then run :func:`..flush_cursor` once per model step (shared by all layers)."""
    nslots, _, _, _, L = buf.geometry
    check_ring_cursor(cursor, nslots)
    check_window(num_tokens, L)
    batch = nslots if state_batch_indices is None else state_batch_indices.shape[0]
    flushed = []
    for s in rows(state_batch_indices, batch, nslots):
        if s >= 0 and needs_flush(cursor, s, num_tokens, L):
            buf.state[s] = committed_state(buf, cursor, s, use_qk_l2norm).to(buf.state.dtype)
            if shadow is not None:
                shadow.write(s, buf.state[s])
            flushed.append(s)
    return flushed


def _check_window_rows(cursor, slots, T, L):
    for s in slots:
        if s < 0:
            continue
        start, count = int(cursor[s, START]), int(cursor[s, COUNT])
        if not (0 <= start < L and 0 <= count and count + T <= L):
            raise ValueError(f"cursor[{s}]: expected 0 <= start < {L} and count + T <= {L} (T={T}), got "
                             f"start={start}, count={count}; run flush_checkpoint/flush_cursor before verify")


def _verify_setup(buf, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices, shadow):
    H, K, V = _check_buf(buf, shadow, v, 2)
    nslots, _, _, _, L = buf.geometry
    batch, T = v.shape[:2]
    check_inputs(H, K, V, q, k, v, f, b, A_log, dt_bias, (batch, T))
    check_ring_cursor(cursor, nslots)
    if T > L:
        raise ValueError(f"v: expected at most L={L} tokens per window, got T={T}")
    slots = rows(state_batch_indices, batch, nslots)
    _check_window_rows(cursor, slots, T, L)
    return slots, batch, T, H, V, L


def _verify_rows(buf, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices, shadow, flushed, use_qk_l2norm,
                 scale, lower_bound):
    """What both verify routes start from: the checked setup ((T, H, V, L)), the prepared q / k and gates, the
    NaN-filled output, and an iterator over the live rows: (row, slot, ring start, count, the committed entries'
    k / u / g, S0 as the step reads it: the shadow's except for the slots in ``flushed``)."""
    slots, batch, T, H, V, L = _verify_setup(buf, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices, shadow)
    qn, kn = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(f, b, A_log, dt_bias, lower_bound)
    exact = {int(s) for s in flushed}
    y = torch.full((batch, T, H, V), float("nan"), dtype=F64, device=v.device)

    def live():
        for r, s in enumerate(slots):
            if s < 0:
                continue
            start, count = int(cursor[s, START]), int(cursor[s, COUNT])
            ks, us, gs, _, _ = _entries(buf, s, ring_indices(start, 0, count, L, buf.state.device), use_qk_l2norm)
            yield r, s, start, count, ks, us, gs, _read_S0(buf, s, shadow, s in exact)

    return (T, H, V, L), qn, kn, g, beta, y, live()


def verify(buf: KDABuffers, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices=None,
           shadow: Shadow | None = None, flushed=(), use_qk_l2norm=True, scale=None, lower_bound=None):
    """Verify T tokens: y (batch, T, H, V) float64; window entries appended to the ring, S0 and cursor untouched.

    Window token t is entry count + t + 1 at ring index (start + count + t) % L. Its outputs come from S_m (the
    u-sum of the committed entries from S0: the shadow's S0 where there is one, except for the slots in
    ``flushed``, folded this step, which read ``state``) and the window's own tokens t' <= t by the recurrence,
    which :func:`verify_triangular` writes as the kernel's triangular system. The window's u_t are computed
    at full precision and stored in the ring dtype. Needs count + T <= L; every row is checked first."""
    (T, H, V, L), qn, kn, g, beta, y, live = _verify_rows(buf, cursor, q, k, v, f, b, A_log, dt_bias,
                                                          state_batch_indices, shadow, flushed, use_qk_l2norm, scale,
                                                          lower_bound)
    for r, s, start, count, ks, us, gs, S0 in live:
        S = _replay(S0, ks, us, gs)
        u = torch.empty(H, T, V, dtype=F64, device=v.device)
        for t in range(T):
            S, u[:, t], y[r, t] = _step(S, qn[r, t], kn[r, t], v[r, t].to(F64), g[r, t], beta[r, t])
        win = ring_indices(start, count, T, L, buf.state.device)
        _store(buf, s, win, k[r].transpose(0, 1), u, g[r].transpose(0, 1), v[r].transpose(0, 1),
               beta[r].transpose(0, 1))
    return y


def verify_triangular(buf: KDABuffers, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices=None,
                      shadow: Shadow | None = None, flushed=(), use_qk_l2norm=True, scale=None, lower_bound=None):
    """The same outputs as :func:`verify` by the route the kernels take, writing nothing: S0 is read once for the
    2T vectors D_{t,0} k_t and D_{t,0} q_t; each committed entry j enters through the decay-weighted products
    k_j . D_{t,j} k_t and k_j . D_{t,j} q_t; the window's u_t solve the T x T unit lower triangular system
        u_t + beta_t sum_{t'<t} (k_t' . D_{t,t'} k_t) u_t' = beta_t (v_t - S0^T D_{t,0} k_t - sum_j (k_j . D_{t,j} k_t) u_j)
    by forward substitution, and y_t = S0^T D_{t,0} q_t + sum_j (k_j . D_{t,j} q_t) u_j + sum_{t'<=t} (k_t' . D_{t,t'} q_t) u_t'.
    T = 1 at count = m is the standard decode step at position m + 1 < L. Position t reads window tokens t' <= t
    only (sliced, never masked: a zero weight times a later NaN is NaN). A second oracle: its agreement with
    :func:`verify` checks the algebra above."""
    (T, H, V, L), qn, kn, g, beta, y, live = _verify_rows(buf, cursor, q, k, v, f, b, A_log, dt_bias,
                                                          state_batch_indices, shadow, flushed, use_qk_l2norm, scale,
                                                          lower_bound)
    for r, _, _, _, ks, us, gs, S0 in live:
        after, total = _suffix(gs)  # (H, m, K), (H, K)
        qw, kw, gw = qn[r].transpose(0, 1), kn[r].transpose(0, 1), g[r].transpose(0, 1)  # (H, T, K)
        vw, bw = v[r].to(F64).transpose(0, 1), beta[r].transpose(0, 1)  # (H, T, V), (H, T)
        U = torch.empty(H, T, V, dtype=F64, device=v.device)
        for t in range(T):
            win_after, win_total = _suffix(gw[:, :t + 1])  # window decays up to t: D_{t,t'} = exp(win_after[t'])
            e0 = torch.exp(total + win_total)  # D_{t,0} (H, K)
            ej = torch.exp(after + win_total[:, None])  # D_{t,j} (H, m, K)
            dk, dq = e0 * kw[:, t], e0 * qw[:, t]
            ak = torch.einsum("hjk,hk->hj", ks * ej, kw[:, t])  # k_j . D_{t,j} k_t
            aq = torch.einsum("hjk,hk->hj", ks * ej, qw[:, t])
            wk = torch.einsum("hsk,hk->hs", kw[:, :t] * torch.exp(win_after[:, :t]), kw[:, t])  # t' < t
            wq = torch.einsum("hsk,hk->hs", kw[:, :t + 1] * torch.exp(win_after), qw[:, t])  # t' <= t
            rhs = vw[:, t] - torch.einsum("hkv,hk->hv", S0, dk) - torch.einsum("hj,hjv->hv", ak, us)
            U[:, t] = bw[:, t, None] * (rhs - torch.einsum("hs,hsv->hv", wk, U[:, :t]))
            y[r, t] = (torch.einsum("hkv,hk->hv", S0, dq) + torch.einsum("hj,hjv->hv", aq, us)
                       + torch.einsum("hs,hsv->hv", wq, U[:, :t + 1]))
    return y


def spec_step(buf: KDABuffers, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices=None,
              shadow: Shadow | None = None, use_qk_l2norm=True, scale=None, lower_bound=None):
    """Single-layer convenience: flush (checkpoint + cursor) then :func:`verify`, what a fused kernel does."""
    T = v.shape[1]
    sbi = state_batch_indices
    if sbi is None:
        sbi = torch.arange(v.shape[0], dtype=torch.int32)
    flushed = flush_checkpoint(buf, cursor, T, sbi, shadow, use_qk_l2norm)
    flush_cursor(cursor, T, buf.u_cache.shape[2], sbi)
    return verify(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow, flushed, use_qk_l2norm, scale, lower_bound)


# ---- native-spec baseline ---------------------------------------------------------------------------------
def native_spec_verify(state, snapshots, q, k, v, f, b, A_log, dt_bias, state_batch_indices=None,
                       use_qk_l2norm=True, scale=None, lower_bound=None):
    """Conventional verify: snapshots[s, t] <- state after window token t; y (batch, T, H, V) float64.

    state (S, H, K, V) read only; snapshots (S, T_max, H, K, V), T_max >= T. Commit with
    :func:`trtllm_replayssm.cursor.native_spec_commit` (a state copy per accepted row, any state shape)."""
    nslots, H, K, V = state.shape
    batch, T = v.shape[:2]
    check_inputs(H, K, V, q, k, v, f, b, A_log, dt_bias, (batch, T))
    if snapshots.dim() != 5 or snapshots.shape[0] != nslots or snapshots.shape[1] < T \
            or tuple(snapshots.shape[2:]) != tuple(state.shape[1:]):
        raise ValueError(f"snapshots: expected shape ({nslots}, >= {T}, {H}, {K}, {V}), got {tuple(snapshots.shape)}")
    slots = rows(state_batch_indices, batch, nslots)
    qn, kn = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(f, b, A_log, dt_bias, lower_bound)
    y = torch.full((batch, T, H, V), float("nan"), dtype=F64, device=v.device)
    for r, s in enumerate(slots):
        if s < 0:
            continue
        S = state[s].to(F64)
        for t in range(T):
            S, _, y[r, t] = _step(S, qn[r, t], kn[r, t], v[r, t].to(F64), g[r, t], beta[r, t])
            snapshots[s, t] = S.to(snapshots.dtype)
    return y


__all__ = ["KDABuffers", "STATE_TABLE", "GEOMETRY", "DTYPES", "gates", "l2norm", "prep_k", "prep_qk",
           "check_inputs", "conventional_step", "replay_decode", "replay_state", "committed_state", "flush_checkpoint",
           "verify", "verify_triangular", "spec_step", "native_spec_verify", "bytes_per_position", "bytes_per_step",
           "L2NORM_EPS", "F64"]
