# SPDX-License-Identifier: Apache-2.0
"""Executable specification of ReplaySSM Gated DeltaNet decode (Qwen3-Next / Qwen3.5 linear attention).

float64 math in plain torch, any device; the tests run it on the CPU and the GDN kernels are checked
against it. Standard decode (one token per step, cursor (slots,)) and speculative verify/commit
(cursor (slots, 2) ring, flush one window early) share one module: the step math is written once
(:func:`_step`, :func:`_fold`) and both forms call it.

Math (per slot and value head hv; key head h = hv // (HV / H); state S is (V, K)):
    g    = -exp(A_log) softplus(a + dt_bias)      (log decay, <= 0)
    beta = sigmoid(b)
    q, k <- q / ||q||, k / ||k|| with eps (``use_qk_l2norm``, as transformers' l2norm), q <- q * scale
    conventional:  S <- exp(g) S;  u = beta (v - S k);  S <- S + u k^T;  y = S q
ReplaySSM: checkpoint S0 and a buffer of entries j = 1..m (u_j, v_j, k_j, g_j, beta_j), G_j = sum_{i<=j} g_i:
    S_m   = exp(G_m) S0 + sum_{j<=m} exp(G_m - G_j) u_j k_j^T           (linear in the buffer)
    step k = m + 1:  S_m k_k = exp(G_m) S0 k_k + sum_j exp(G_m - G_j) (k_j . k_k) u_j   (same for q_k)
                     u_k = beta_k (v_k - exp(g_k) S_m k_k)
                     y_k = exp(g_k) S_m q_k + (k_k . q_k) u_k
so a step reads S0 once (two matrix-vector products) and writes only its buffer entry. The corrected
update u_j (the delta rule's "delta") is what the output path replays, as ROCm/ATOM #1883 and the
ReplaySSM blog's appendix A describe; S_m is linear in it.

Flush (standard: the step whose entry is the L-th; speculative: one window early) writes the
checkpoint by the *exact* recurrence over the buffered (v_j, k_j, g_j, beta_j) from the full-precision
checkpoint, :func:`_fold`, the definition. Without a shadow the u-sum S_m above is the same number (u_j
were computed from S0), and the standard decode kernel's fp32 flush folds it from the stored fp32 u_j (one
FMA per state value and entry, no chain between entries; plugins/gdn/gdn.cuh ``usum_rows``); with a
low-precision shadow the u_j of non-flush steps carry the shadow's rounding (they read S0 through it), and
refolding from v_j keeps that rounding out of the checkpoint, so, as for Mamba-2, shadow errors never
accumulate across flushes. This is why the buffer holds v_j and beta_j beside u_j, k_j, g_j (vLLM's GDN
ReplaySSM buffers d = u, k and g only and folds the u-sum). The speculative verify's flush refolds too.

State of one GDN layer (S slots, HV value heads, H key heads, V value dim, K key dim, L buffer):

=============  ==================  ===========  ====================================================
tensor         shape               dtype        meaning
=============  ==================  ===========  ====================================================
state          (S, HV, V, K)       f32          checkpoint S0 (vLLM / FlashInfer layout); flush only
u_cache        (S, HV, L, V)       f32          corrected updates u_j (output path)
v_cache        (S, HV, L, V)       act          values v_j (the exact fold)
k_cache        (S, H, L, K)        f32          keys k_j after the l2 norm (not scaled)
g_cache        (S, HV, L)          f32          log decays g_j
beta_cache     (S, HV, L)          f32          beta_j
cursor         (S,) or (S, 2)      int32        standard: entries since S0; spec: (start, count)
=============  ==================  ===========  ====================================================
Entry j of the standard form lives at index j - 1; of the ring form at (start + j - 1) % L, exactly
as the Mamba-2 caches (:mod:`..mamba2.reference`, :mod:`..mamba2.spec_reference`; the cursor helpers
:func:`trtllm_replayssm.cursor.advance_cursor`, :func:`~trtllm_replayssm.cursor.flush_cursor` and
:func:`~trtllm_replayssm.cursor.commit` apply unchanged). Step inputs: q, k (batch, [T,] H, K); v (batch,
[T,] HV, V); a, b (batch, [T,] HV) raw; A_log, dt_bias (HV,). Output y (batch, [T,] HV, V), before the
layer's gated RMSNorm. Padding rows (slot -1) touch nothing; their y is NaN here (kernels leave it).

Shadow: a :class:`trtllm_replayssm.shadow.Shadow` of ``state`` ((S, HV, V, K); fp8 row scales per (slot, hv, v)).
Non-flush steps read S0 through it; flushes read the full-precision checkpoint, then rewrite the
shadow from what they stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...costs import gdn_bytes_per_position as bytes_per_position  # the bytes model's home is costs (re-exported)
from ...costs import gdn_bytes_per_step as bytes_per_step
from ...cursor import COUNT, START, flush_cursor, needs_flush, ring_indices
from ...cursor import check_ring_cursor as _check_cursor
from ...cursor import check_window as _check_window
from ...cursor import rows as _slots
from ...shadow import Shadow
from ..mamba2.reference import softplus

F64 = torch.float64
L2NORM_EPS = 1e-6  # transformers' Qwen3-Next l2norm eps


@dataclass
class GDNBuffers:
    """The per-layer tensors of the table above (mutated in place by the steps)."""

    state: torch.Tensor
    u_cache: torch.Tensor
    v_cache: torch.Tensor
    k_cache: torch.Tensor
    g_cache: torch.Tensor
    beta_cache: torch.Tensor

    @classmethod
    def alloc(cls, slots: int, HV: int, H: int, V: int, K: int, L: int, act=torch.bfloat16,
              state_dtype=torch.float32, device="cpu") -> GDNBuffers:
        if HV % H:
            raise ValueError(f"HV: value heads must be a multiple of key heads H={H}, got {HV}")
        z = dict(device=device)
        return cls(torch.zeros(slots, HV, V, K, dtype=state_dtype, **z),
                   torch.zeros(slots, HV, L, V, dtype=torch.float32, **z),
                   torch.zeros(slots, HV, L, V, dtype=act, **z),
                   torch.zeros(slots, H, L, K, dtype=torch.float32, **z),
                   torch.zeros(slots, HV, L, dtype=torch.float32, **z),
                   torch.zeros(slots, HV, L, dtype=torch.float32, **z))

    @property
    def geometry(self) -> tuple[int, int, int, int, int, int]:
        """(slots, HV, H, V, K, L)."""
        S, HV, V, K = self.state.shape
        return S, HV, self.k_cache.shape[1], V, K, self.u_cache.shape[2]

    def check(self) -> None:
        S, HV, H, V, K, L = self.geometry
        for name, t, shape in (("u_cache", self.u_cache, (S, HV, L, V)), ("v_cache", self.v_cache, (S, HV, L, V)),
                               ("k_cache", self.k_cache, (S, H, L, K)), ("g_cache", self.g_cache, (S, HV, L)),
                               ("beta_cache", self.beta_cache, (S, HV, L))):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if HV % H:
            raise ValueError(f"k_cache: key heads must divide value heads HV={HV}, got H={H}")

    def clone(self) -> GDNBuffers:
        return GDNBuffers(*(t.clone() for t in (self.state, self.u_cache, self.v_cache, self.k_cache,
                                                self.g_cache, self.beta_cache)))


# ---- the step math, written once ------------------------------------------------------------------------
def gates(a, b, A_log, dt_bias):
    """(g, beta) float64 from raw a, b (..., HV) and A_log, dt_bias (HV,)."""
    g = -torch.exp(A_log.to(F64)) * softplus(a.to(F64) + dt_bias.to(F64))
    return g, torch.sigmoid(b.to(F64))


def prep_qk(q, k, use_qk_l2norm: bool = True, scale: float | None = None):
    """(q', k') float64: l2-normalised over the last dim when asked, q' scaled by ``scale`` (K^-1/2)."""
    q, k = q.to(F64), k.to(F64)
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def _expand(t: torch.Tensor, HV: int) -> torch.Tensor:
    """(H, ...) key-head tensor -> (HV, ...): value head hv reads key head hv // (HV / H)."""
    return t.repeat_interleave(HV // t.shape[0], dim=0)


def _step(S, q, k, v, g, beta):
    """One conventional step from S (HV, V, K) float64; q, k (HV, K), v (HV, V), g, beta (HV,).

    Returns (S_new, u, y)."""
    S = torch.exp(g)[:, None, None] * S
    u = beta[:, None] * (v - torch.einsum("hvk,hk->hv", S, k))
    S = S + u[:, :, None] * k[:, None, :]
    return S, u, torch.einsum("hvk,hk->hv", S, q)


def _fold(S0, vs, ks, gs, betas):
    """Exact recurrence over buffered entries: S0 (HV, V, K), vs (HV, m, V), ks (HV, m, K), gs/betas (HV, m)."""
    S = S0
    for j in range(vs.shape[1]):
        S, _, _ = _step(S, ks[:, j], ks[:, j], vs[:, j], gs[:, j], betas[:, j])
    return S


def _replay(S0, us, ks, gs):
    """S_m from the u-sum: exp(G_m) S0 + sum_j exp(G_m - G_j) u_j k_j^T (what the output path computes)."""
    if us.shape[1] == 0:
        return S0
    G = torch.cumsum(gs, dim=-1)
    w = torch.exp(G[:, -1:] - G)  # (HV, m)
    return torch.exp(G[:, -1])[:, None, None] * S0 + torch.einsum("hj,hjv,hjk->hvk", w, us, ks)


def _entries(buf: GDNBuffers, s: int, idx: torch.Tensor):
    """Buffered entries of slot s at ring/array indices ``idx``, float64, value-head expanded."""
    HV = buf.state.shape[1]
    return (buf.u_cache[s][:, idx].to(F64), buf.v_cache[s][:, idx].to(F64),
            _expand(buf.k_cache[s][:, idx].to(F64), HV), buf.g_cache[s][:, idx].to(F64),
            buf.beta_cache[s][:, idx].to(F64))


def _store(buf: GDNBuffers, s: int, idx, u, v, k_key, g, beta) -> None:
    """Write entries at ``idx`` (int or index tensor): u, v (HV, [n,] V), k_key (H, [n,] K), g, beta (HV, [n])."""
    buf.u_cache[s][:, idx] = u.to(buf.u_cache.dtype)
    buf.v_cache[s][:, idx] = v.to(buf.v_cache.dtype)
    buf.k_cache[s][:, idx] = k_key.to(buf.k_cache.dtype)
    buf.g_cache[s][:, idx] = g.to(buf.g_cache.dtype)
    buf.beta_cache[s][:, idx] = beta.to(buf.beta_cache.dtype)


def _read_S0(buf: GDNBuffers, s: int, shadow: Shadow | None, exact: bool):
    return buf.state[s].to(F64) if shadow is None or exact else shadow.read(s, F64)


def check_inputs(buf: GDNBuffers, q, k, v, a, b, A_log, dt_bias, lead: tuple) -> None:
    _, HV, H, V, K, _ = buf.geometry
    buf.check()
    for name, t, shape in (("q", q, lead + (H, K)), ("k", k, lead + (H, K)), ("v", v, lead + (HV, V)),
                           ("a", a, lead + (HV,)), ("b", b, lead + (HV,)), ("A_log", A_log, (HV,)),
                           ("dt_bias", dt_bias, (HV,))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


# ---- conventional baseline ------------------------------------------------------------------------------
def conventional_step(state, q, k, v, a, b, A_log, dt_bias, state_batch_indices=None, use_qk_l2norm=True,
                      scale=None):
    """One conventional GDN step; ``state`` (slots, HV, V, K) updated in place; returns y (batch, HV, V) float64."""
    batch, HV, V = v.shape
    nslots = state.shape[0]
    gq, kq = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(a, b, A_log, dt_bias)
    y = torch.full((batch, HV, V), float("nan"), dtype=F64, device=v.device)
    for r, s in enumerate(_slots(state_batch_indices, batch, nslots)):
        if s < 0:
            continue
        S, _, y[r] = _step(state[s].to(F64), _expand(gq[r], HV), _expand(kq[r], HV), v[r].to(F64), g[r], beta[r])
        state[s] = S.to(state.dtype)
    return y


# ---- standard ReplaySSM decode (cursor (slots,)) ----------------------------------------------------------
def replay_decode(buf: GDNBuffers, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices=None,
                  shadow: Shadow | None = None, use_qk_l2norm=True, scale=None):
    """One ReplaySSM GDN step without moving the cursor; returns y (batch, HV, V) float64.

    Non-flush step (cursor + 1 < L): entry cursor + 1 is appended at index cursor; nothing else is
    written. Flush step (cursor + 1 == L): the checkpoint becomes the exact fold of the L-1 buffered
    entries and this token (shadow rewritten); the buffers are not written. Move the cursor with
    :func:`trtllm_replayssm.cursor.advance_cursor` once per model step.
    """
    batch, HV, V = v.shape
    nslots, _, _, _, _, L = buf.geometry
    check_inputs(buf, q, k, v, a, b, A_log, dt_bias, (batch,))
    if tuple(cursor.shape) != (nslots,):
        raise ValueError(f"cursor: expected shape ({nslots},), got {tuple(cursor.shape)}")
    gq, kq = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(a, b, A_log, dt_bias)
    rows = [(r, s) for r, s in enumerate(_slots(state_batch_indices, batch, nslots)) if s >= 0]
    for _, s in rows:
        if not 0 <= int(cursor[s]) < L:
            raise ValueError(f"cursor[{s}] = {int(cursor[s])} is outside [0, {L})")
    y = torch.full((batch, HV, V), float("nan"), dtype=F64, device=v.device)
    for r, s in rows:
        pos = int(cursor[s])
        qh, kh, vh = _expand(gq[r], HV), _expand(kq[r], HV), v[r].to(F64)
        us, vs, ks, gs, bs = _entries(buf, s, torch.arange(pos, device=buf.state.device))
        if pos + 1 == L:
            S = _fold(buf.state[s].to(F64), vs, ks, gs, bs)
            S, _, y[r] = _step(S, qh, kh, vh, g[r], beta[r])
            buf.state[s] = S.to(buf.state.dtype)
            if shadow is not None:
                shadow.write(s, buf.state[s])
        else:
            Sm = _replay(_read_S0(buf, s, shadow, False), us, ks, gs)
            _, u, y[r] = _step(Sm, qh, kh, vh, g[r], beta[r])
            _store(buf, s, pos, u, v[r], kq[r], g[r], beta[r])
    return y


def replay_state(buf: GDNBuffers, cursor, slot: int) -> torch.Tensor:
    """The current recurrent state of ``slot`` (standard cursor): the exact fold of its entries, float64."""
    pos = int(cursor[slot])
    _, vs, ks, gs, bs = _entries(buf, slot, torch.arange(pos, device=buf.state.device))
    return _fold(buf.state[slot].to(F64), vs, ks, gs, bs)


# ---- speculative: flush one window early, verify T tokens, commit by cursor -----------------------------
def committed_state(buf: GDNBuffers, cursor, slot: int) -> torch.Tensor:
    """S_count of ``slot`` (ring cursor): the exact fold of its committed entries, float64 (HV, V, K)."""
    L = buf.u_cache.shape[2]
    start, count = int(cursor[slot, START]), int(cursor[slot, COUNT])
    _, vs, ks, gs, bs = _entries(buf, slot, ring_indices(start, 0, count, L, buf.state.device))
    return _fold(buf.state[slot].to(F64), vs, ks, gs, bs)


def flush_checkpoint(buf: GDNBuffers, cursor, num_tokens: int, state_batch_indices=None,
                     shadow: Shadow | None = None) -> list[int]:
    """One layer's part of the flush: S0 <- S_count where count + 2T > L. Cursor read only; returns the slots.

    Then run :func:`trtllm_replayssm.cursor.flush_cursor` once per model step (shared by all layers)."""
    nslots, _, _, _, _, L = buf.geometry
    _check_cursor(cursor, nslots)
    _check_window(num_tokens, L)
    batch = nslots if state_batch_indices is None else state_batch_indices.shape[0]
    flushed = []
    for s in _slots(state_batch_indices, batch, nslots):
        if s >= 0 and needs_flush(cursor, s, num_tokens, L):
            buf.state[s] = committed_state(buf, cursor, s).to(buf.state.dtype)
            if shadow is not None:
                shadow.write(s, buf.state[s])
            flushed.append(s)
    return flushed


def verify(buf: GDNBuffers, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices=None,
           shadow: Shadow | None = None, flushed=(), use_qk_l2norm=True, scale=None):
    """Verify T tokens: y (batch, T, HV, V) float64; window entries appended to the ring, S0 and cursor untouched.

    Window token t is entry count + t + 1 at ring index (start + count + t) % L. Its u_t solves the
    strictly lower triangular system of the window (computed here as the recurrence it equals):
        u_t + beta_t sum_{t'<t} exp(G_t - G_t') (k_t' . k_t) u_t' = beta_t (v_t - exp(G_t - G_m) S_m k_t)
        y_t = exp(G_t - G_m) S_m q_t + sum_{t'<=t} exp(G_t - G_t') (k_t' . q_t) u_t'
    with S_m the u-sum of the committed entries from S0 (the shadow's S0 where there is one, except
    for the slots in ``flushed``, folded this step, which read ``state``). Needs count + T <= L.
    """
    batch, T, HV, V = v.shape
    nslots, _, _, _, _, L = buf.geometry
    check_inputs(buf, q, k, v, a, b, A_log, dt_bias, (batch, T))
    _check_cursor(cursor, nslots)
    if T > L:
        raise ValueError(f"v: expected at most L={L} tokens per window, got T={T}")
    gq, kq = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(a, b, A_log, dt_bias)
    exact = {int(s) for s in flushed}
    rows = [(r, s) for r, s in enumerate(_slots(state_batch_indices, batch, nslots)) if s >= 0]
    for _, s in rows:
        start, count = int(cursor[s, START]), int(cursor[s, COUNT])
        if not (0 <= start < L and 0 <= count and count + T <= L):
            raise ValueError(f"cursor[{s}]: expected 0 <= start < {L} and count + T <= {L} (T={T}), got "
                             f"start={start}, count={count}; run flush_checkpoint/flush_cursor before verify")
    y = torch.full((batch, T, HV, V), float("nan"), dtype=F64, device=v.device)
    for r, s in rows:
        start, count = int(cursor[s, START]), int(cursor[s, COUNT])
        us, _, ks, gs, _ = _entries(buf, s, ring_indices(start, 0, count, L, buf.state.device))
        S = _replay(_read_S0(buf, s, shadow, s in exact), us, ks, gs)
        win = ring_indices(start, count, T, L, buf.state.device)
        u = torch.empty(HV, T, V, dtype=F64, device=v.device)
        for t in range(T):
            S, u[:, t], y[r, t] = _step(S, _expand(gq[r, t], HV), _expand(kq[r, t], HV), v[r, t].to(F64),
                                        g[r, t], beta[r, t])
        _store(buf, s, win, u, v[r].transpose(0, 1), kq[r].transpose(0, 1), g[r].transpose(0, 1),
               beta[r].transpose(0, 1))
    return y


def verify_triangular(buf: GDNBuffers, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices=None,
                      use_qk_l2norm=True, scale=None):
    """The same outputs as :func:`verify` (no shadow, nothing written) by the route the verify kernel takes:
    two products of S_m with the window's k and q, a T x T forward substitution, then the causal sum.
    A second oracle: its agreement with the recurrence in :func:`verify` checks the algebra above."""
    batch, T, HV, V = v.shape
    nslots, _, _, _, _, L = buf.geometry
    check_inputs(buf, q, k, v, a, b, A_log, dt_bias, (batch, T))
    gq, kq = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(a, b, A_log, dt_bias)
    y = torch.full((batch, T, HV, V), float("nan"), dtype=F64, device=v.device)
    for r, s in enumerate(_slots(state_batch_indices, batch, nslots)):
        if s < 0:
            continue
        start, count = int(cursor[s, START]), int(cursor[s, COUNT])
        us, _, ks, gs, _ = _entries(buf, s, ring_indices(start, 0, count, L, buf.state.device))
        Sm = _replay(buf.state[s].to(F64), us, ks, gs)
        qw, kw = _expand(gq[r].transpose(0, 1), HV), _expand(kq[r].transpose(0, 1), HV)  # (HV, T, K)
        Gw = torch.cumsum(g[r].transpose(0, 1), dim=-1)  # (HV, T): G_t - G_m
        bw, vw = beta[r].transpose(0, 1), v[r].to(F64).transpose(0, 1)  # (HV, T), (HV, T, V)
        SK, SQ = torch.einsum("hvk,htk->htv", Sm, kw), torch.einsum("hvk,htk->htv", Sm, qw)
        decay = torch.exp(Gw[:, :, None] - Gw[:, None, :])  # (HV, t, t')
        kk = torch.einsum("htk,hsk->hts", kw, kw) * decay
        kq_ = torch.einsum("htk,hsk->hts", qw, kw) * decay  # (q_t . k_t') exp(G_t - G_t')
        U = torch.empty(HV, T, V, dtype=F64, device=v.device)
        for t in range(T):
            rhs = bw[:, t, None] * (vw[:, t] - torch.exp(Gw[:, t])[:, None] * SK[:, t])
            if t:
                rhs = rhs - bw[:, t, None] * torch.einsum("hs,hsv->hv", kk[:, t, :t], U[:, :t])
            U[:, t] = rhs
        yw = torch.exp(Gw)[:, :, None] * SQ
        for t in range(T):  # the causal sum over t' <= t, sliced (a zero weight times a later NaN u is NaN)
            yw[:, t] = yw[:, t] + torch.einsum("hs,hsv->hv", kq_[:, t, :t + 1], U[:, :t + 1])
        y[r] = yw.transpose(0, 1)
    return y


def spec_step(buf: GDNBuffers, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices=None,
              shadow: Shadow | None = None, use_qk_l2norm=True, scale=None):
    """Single-layer convenience: flush (checkpoint + cursor) then :func:`verify`, what a fused kernel does."""
    T = v.shape[1]
    sbi = state_batch_indices
    if sbi is None:
        sbi = torch.arange(v.shape[0], dtype=torch.int32)
    flushed = flush_checkpoint(buf, cursor, T, sbi, shadow)
    flush_cursor(cursor, T, buf.u_cache.shape[2], sbi)
    return verify(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow, flushed, use_qk_l2norm, scale)


# ---- native-spec baseline ---------------------------------------------------------------------------------
def native_spec_verify(state, snapshots, q, k, v, a, b, A_log, dt_bias, state_batch_indices=None,
                       use_qk_l2norm=True, scale=None):
    """Conventional verify: snapshots[s, t] <- state after window token t; y (batch, T, HV, V) float64.

    state (S, HV, V, K) read only; snapshots (S, T_max, HV, V, K), T_max >= T. Commit with
    :func:`trtllm_replayssm.cursor.native_spec_commit` (a state copy per accepted row, what native spec pays)."""
    batch, T, HV, V = v.shape
    nslots = state.shape[0]
    if snapshots.dim() != 5 or snapshots.shape[0] != nslots or snapshots.shape[1] < T \
            or tuple(snapshots.shape[2:]) != tuple(state.shape[1:]):
        raise ValueError(f"snapshots: expected shape ({nslots}, >= {T}, {', '.join(map(str, state.shape[1:]))}), "
                         f"got {tuple(snapshots.shape)}")
    gq, kq = prep_qk(q, k, use_qk_l2norm, scale)
    g, beta = gates(a, b, A_log, dt_bias)
    y = torch.full((batch, T, HV, V), float("nan"), dtype=F64, device=v.device)
    for r, s in enumerate(_slots(state_batch_indices, batch, nslots)):
        if s < 0:
            continue
        S = state[s].to(F64)
        for t in range(T):
            S, _, y[r, t] = _step(S, _expand(gq[r, t], HV), _expand(kq[r, t], HV), v[r, t].to(F64), g[r, t], beta[r, t])
            snapshots[s, t] = S.to(snapshots.dtype)
    return y


__all__ = ["GDNBuffers", "gates", "prep_qk", "conventional_step", "replay_decode", "replay_state", "committed_state",
           "flush_checkpoint", "verify", "verify_triangular", "spec_step", "native_spec_verify", "bytes_per_position",
           "bytes_per_step", "L2NORM_EPS"]
