# SPDX-License-Identifier: Apache-2.0
"""Executable specification of speculative decoding with ReplaySSM (docs/DESIGN.md §1, last paragraphs).

float64 math in plain torch, any device; the tests run it on the CPU and the speculative GPU kernels
are checked against it. :mod:`.reference` is the spec of the standard (one token per step) decode;
this module adds the ring buffer, verify of T = 1 + num_draft tokens, commit/rollback by cursor and
the "one window early" flush, plus the conventional native-spec baseline.

Math (per slot, Mamba layer, head; tie_hdim: A, dt, D per-head scalars). Checkpoint S0, committed
entries j = 1..m (m = ``count``), window entries j = m+1..m+T (the T tokens being verified):
    dt_j = softplus(dt_raw_j + dt_bias),  c_j = A sum_{i<=j} dt_i,  w_{j,k} = dt_j exp(c_k - c_j)
    y_t  = exp(c_k) S0 C_t + sum_{j<=k} w_{j,k} (B_j . C_t) x_j + D x_t,  k = m + t + 1, t = 0..T-1
    (y_t <- y_t silu(z_t) with a gate.) Position t sees the committed history and the causal part
    t' <= t of the window: a causal-masked (T x (m+T)) product per (group, head). Nothing is written to S0.
    S_m  = exp(c_m) S0 + sum_{j<=m} w_{j,m} x_j B_j^T      (the committed state; what a flush writes)

State of one Mamba layer (S slots, H heads, P headdim, N dstate, G groups, L ring capacity):

=====================  ==================  ===================  =========================================
tensor                 shape               dtype                meaning
=====================  ==================  ===================  =========================================
state                  (S, H, P, N)        f32 (any float)      checkpoint S0; written only by a flush
x_cache                (S, H, L, P)        act                  ring of x_j
B_cache                (S, G, L, N)        act                  ring of B_j (C is never cached)
dt_cache               (S, H, L)           f32                  ring of processed dt_j
cursor                 (S, 2)              int32                [s, 0] = start, [s, 1] = count (below)
state_batch_indices    (batch,)            int32                slot per row, -1 = padding row
=====================  ==================  ===================  =========================================

Cursor representation (one int32 pair per slot, shared by all Mamba layers of a model, one
contiguous tensor so that a kernel or TensorRT plugin aliases a single tensor):
    start = cursor[s, 0] in [0, L): ring index of committed entry j = 1 (the first entry after S0);
    count = cursor[s, 1] in [0, L - T]: committed entries since S0.
    Committed entry j (1..count) lives at ring index (start + j - 1) % L; window entry t (0..T-1)
    is written at (start + count + t) % L. Ring entries outside the committed range are garbage
    and never read (rejected entries are overwritten by a later window).

One speculative step of a model, for the rows' slots:
    1. :func:`maybe_flush` (flush rule, decided on the cursors before the step, the same for every
       layer): if count + 2T > L, fold the committed history into the checkpoint (S0 <- S_count) in
       every layer, then start <- (start + count) % L, count <- 0. Only committed entries are folded.
       Multi-layer callers run :func:`flush_checkpoint` per layer and then :func:`flush_cursor` once.
    2. :func:`verify` per layer: append the T window entries to the ring, return y (batch, T, H, P).
       The cursor is not moved.
    3. :func:`~trtllm_replayssm.cursor.commit` once: count += n_accepted (0 <= n <= T; n counts the accepted tokens including
       the first one, whose token was already sampled, so n >= 1 in practice). No state copy.
Invariant: L >= 2T and, after step 1, count + 2T <= L, so after any commit count <= L - T: a fully
accepted step never truncates the next window and count never exceeds L.

Native-spec baseline (vLLM / TensorRT-LLM style): :func:`native_spec_verify` runs the conventional
recurrence over the window from S (= ``state``) and writes one snapshot per position into
``snapshots`` (S, T, H, P, N); :func:`~trtllm_replayssm.cursor.native_spec_commit` copies snapshot n-1 into ``state``.

conv1d window (Mamba-2's causal depthwise conv of width K over the conv_dim channels x|B|C): kept, updated
and rolled back by the rules every family's cache shares, :mod:`trtllm_replayssm.conv_window`.

The cursor rules (the flush rule :func:`~trtllm_replayssm.cursor.needs_flush`, :func:`~trtllm_replayssm.cursor.
flush_cursor`, :func:`~trtllm_replayssm.cursor.commit`, the row checks) and the native-spec commit copy
(:func:`~trtllm_replayssm.cursor.native_spec_commit`) are shared by every family: :mod:`trtllm_replayssm.cursor`.

Low-precision shadow (optional ``shadow``: a :class:`~trtllm_replayssm.shadow.Shadow` of ``state``, as in
:func:`.reference.replay_decode`): :func:`flush_checkpoint` / :func:`maybe_flush` rewrite the shadow of
every slot they fold from the checkpoint they store; :func:`verify` reads S0 from the shadow for the
exp(c_k) S0 C_t term, except for the slots in ``flushed`` (folded just before, this step), whose
outputs read the full-precision checkpoint, as the fused kernel does (it holds the new checkpoint in
registers). :func:`spec_step` passes both.

Padding rows (slot -1): no slot is touched; their outputs are NaN here (the kernels leave them untouched).
Credits: ReplaySSM (Dao AI Lab + NVIDIA, 2026); ring API after FlashInfer ``checkpointing_ssu`` (>= 0.7.0,
PR #3975; its window is capped at 16).
"""

from __future__ import annotations

import torch

from ...cursor import (
    check_ring_cursor,
    check_shape,
    check_window,
    flush_cursor,
    needs_flush,
    ring_indices,
    rows,
    start_count,
)
from ...shadow import Shadow
from .reference import _gate, buffer_weights, process_dt

F64 = torch.float64


# ---- committed state and flush -----------------------------------------------------------------------
def committed_state(state, x_cache, B_cache, dt_cache, cursor, A, slot: int) -> torch.Tensor:
    """S_count of ``slot`` (checkpoint folded with its committed entries), float64, (H, P, N)."""
    H, L = state.shape[1], x_cache.shape[2]
    start, count = start_count(cursor, slot)
    S0 = state[slot].to(F64)
    if count == 0:
        return S0
    idx = ring_indices(start, 0, count, L, x_cache.device)
    xs = x_cache[slot][:, idx].to(F64)  # (H, m, P)
    Bs = B_cache[slot][:, idx].to(F64).repeat_interleave(H // B_cache.shape[1], dim=0)  # (H, m, N)
    w, decay = buffer_weights(dt_cache[slot][:, idx].to(F64), A.to(F64))
    return decay[:, None, None] * S0 + torch.einsum("hk,hkp,hkn->hpn", w, xs, Bs)


def flush_checkpoint(state, x_cache, B_cache, dt_cache, cursor, A, num_tokens: int, state_batch_indices=None,
                     shadow: Shadow | None = None):
    """One layer's part of the flush: S0 <- S_count for rows whose slot needs a flush. Cursor read only.

    Returns the list of flushed slots. Run it for every layer, then :func:`flush_cursor` once. With
    ``shadow``, each flushed slot's shadow is rewritten from the checkpoint as stored.
    """
    nslots, L = state.shape[0], x_cache.shape[2]
    check_ring_cursor(cursor, nslots)
    check_window(num_tokens, L)
    batch = nslots if state_batch_indices is None else state_batch_indices.shape[0]
    flushed = []
    for s in rows(state_batch_indices, batch, nslots):
        if s >= 0 and needs_flush(cursor, s, num_tokens, L):
            state[s] = committed_state(state, x_cache, B_cache, dt_cache, cursor, A, s).to(state.dtype)
            if shadow is not None:
                shadow.write(s, state[s])
            flushed.append(s)
    return flushed


def maybe_flush(state, x_cache, B_cache, dt_cache, cursor, A, num_tokens: int, state_batch_indices=None,
                shadow: Shadow | None = None):
    """Single-layer flush: :func:`flush_checkpoint` then :func:`flush_cursor`. Returns the flushed slots."""
    flushed = flush_checkpoint(state, x_cache, B_cache, dt_cache, cursor, A, num_tokens, state_batch_indices, shadow)
    flush_cursor(cursor, num_tokens, x_cache.shape[2], state_batch_indices)
    return flushed


# ---- verify / commit -----------------------------------------------------------------------------------
def check_verify_inputs(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z=None,
                        shadow: Shadow | None = None, *, standard: bool = False) -> None:
    """Every shape :func:`verify` needs, checked without writing anything: callers that fold first
    (:func:`flush_checkpoint`) call it before the fold, so a bad input leaves the checkpoint as it was.
    ``standard``: the inputs of one standard decode step (:func:`.reference.replay_decode`): no T dim (x
    (batch, nheads, headdim)) and the (slots,) cursor."""
    rank, want = (3, "(batch, nheads, headdim)") if standard else (4, "(batch, T, nheads, headdim)")
    if not isinstance(x, torch.Tensor) or x.dim() != rank:
        raise ValueError(f"x: expected a {want} tensor, got {_shape_of(x)}")
    if not isinstance(B_cache, torch.Tensor) or B_cache.dim() != 4:
        raise ValueError(f"B_cache: expected a (slots, ngroups, L, dstate) tensor, got {_shape_of(B_cache)}")
    batch, H, P = x.shape[0], x.shape[-2], x.shape[-1]
    tok = () if standard else (x.shape[1],)  # the window's T
    nslots, G, L, N = B_cache.shape
    check_shape(state, "state", (nslots, H, P, N))
    check_shape(x_cache, "x_cache", (nslots, H, L, P))
    check_shape(dt_cache, "dt_cache", (nslots, H, L))
    check_shape(B, "B", (batch, *tok, G, N))
    check_shape(C, "C", (batch, *tok, G, N))
    check_shape(dt, "dt", (batch, *tok, H))
    if z is not None:
        check_shape(z, "z", (batch, *tok, H, P))
    for name, v in (("dt_bias", dt_bias), ("A", A), ("D", D)):
        check_shape(v, name, (H,))
    if H % G:
        raise ValueError(f"B_cache: ngroups must divide nheads={H}, got {G}")
    if standard:
        check_shape(cursor, "cursor", (nslots,))
    else:
        check_ring_cursor(cursor, nslots)
        if tok[0] > L:
            raise ValueError(f"x: expected at most L={L} tokens per window, got T={tok[0]}")
    if shadow is not None:
        check_shape(shadow.q, "shadow", (nslots, H, P, N))


def _shape_of(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def verify(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z=None, state_batch_indices=None,
           shadow: Shadow | None = None, flushed=()):
    """Verify T tokens: y (batch, T, H, P) float64; the window is appended to the ring, S0 and cursor untouched.

    Inputs: x, z (batch, T, H, P); B, C (batch, T, G, N); dt (batch, T, H) raw; dt_bias, A, D (H,).
    Window entry t is stored at ring index (start + count + t) % L (x, B in the cache dtypes, processed
    dt in the dt_cache dtype) and the outputs are computed from the ring as stored, so later steps
    replay exactly the values this step used. Needs count + T <= L (run :func:`maybe_flush` first).
    With ``shadow`` the S0 C_t term reads the shadow (:meth:`trtllm_replayssm.shadow.Shadow.read`, float64), except
    for the slots in ``flushed`` (those :func:`maybe_flush` folded this step), which read ``state``.
    """
    check_verify_inputs(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z, shadow)
    batch, T, H, P = x.shape
    nslots, G, L, N = B_cache.shape
    hpg = H // G
    A64, D64 = A.to(F64), D.to(F64)
    dtp = process_dt(dt.to(F64), dt_bias.to(F64))  # (batch, T, H)
    y = torch.full((batch, T, H, P), float("nan"), dtype=F64, device=x.device)
    exact = {int(s) for s in flushed}
    live = [(b, s) for b, s in enumerate(rows(state_batch_indices, batch, nslots)) if s >= 0]
    for _, s in live:  # every row is validated before anything is written
        start, count = start_count(cursor, s)
        if not (0 <= start < L and 0 <= count and count + T <= L):
            raise ValueError(f"cursor[{s}]: expected 0 <= start < {L} and count + T <= {L} (T={T}), got "
                             f"start={start}, count={count}; run maybe_flush before verify")
    for b, s in live:
        start, count = start_count(cursor, s)
        win = ring_indices(start, count, T, L, x_cache.device)
        x_cache[s][:, win] = x[b].transpose(0, 1).to(x_cache.dtype)
        B_cache[s][:, win] = B[b].transpose(0, 1).to(B_cache.dtype)
        dt_cache[s][:, win] = dtp[b].transpose(0, 1).to(dt_cache.dtype)
        idx = ring_indices(start, 0, count + T, L, x_cache.device)
        xs = x_cache[s][:, idx].to(F64)  # (H, m+T, P)
        Bs = B_cache[s][:, idx].to(F64)  # (G, m+T, N)
        dts = dt_cache[s][:, idx].to(F64)  # (H, m+T)
        Cw = C[b].to(F64).transpose(0, 1)  # (G, T, N)
        bc = torch.einsum("gjn,gtn->gtj", Bs, Cw).repeat_interleave(hpg, dim=0)  # (H, T, m+T), once per group
        S0 = state[s].to(F64) if shadow is None or s in exact else shadow.read(s, F64)
        S0C = torch.einsum("hpn,htn->htp", S0, Cw.repeat_interleave(hpg, dim=0))  # (H, T, P)
        # causal weights: position t (k = count + t + 1 entries) sums entries j < k only (sliced, not
        # masked: a zero weight times a later token's NaN / inf would reach earlier positions)
        cum = A64[:, None] * torch.cumsum(dts, dim=-1)  # (H, m+T): c_j
        ck = cum[:, count:]  # (H, T): c_k of each window position
        yw = torch.exp(ck)[:, :, None] * S0C
        for t in range(T):
            k = count + t + 1
            w = dts[:, :k] * torch.exp(ck[:, t, None] - cum[:, :k])  # (H, k)
            yw[:, t] = yw[:, t] + torch.einsum("hj,hjp->hp", w * bc[:, t, :k], xs[:, :k])
        yw = yw + D64[:, None, None] * xs[:, count:]
        y[b] = _gate(yw.transpose(0, 1), None if z is None else z[b].to(F64))
    return y


def spec_step(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z=None,
              state_batch_indices=None, shadow: Shadow | None = None):
    """Single-layer convenience: :func:`maybe_flush` then :func:`verify` (what a fused kernel does)."""
    sbi = state_batch_indices
    if sbi is None:
        sbi = torch.arange(x.shape[0], dtype=torch.int32)
    flushed = maybe_flush(state, x_cache, B_cache, dt_cache, cursor, A, x.shape[1], sbi, shadow)
    return verify(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z, sbi, shadow, flushed)


# ---- native-spec baseline ---------------------------------------------------------------------------------
def native_spec_verify(state, snapshots, x, B, C, dt, dt_bias, A, D, z=None, state_batch_indices=None):
    """Conventional verify: snapshots[s, t] <- state after window token t; y (batch, T, H, P) float64.

    state (S, H, P, N) is read only; snapshots (S, T_max, H, P, N) with T_max >= T, positions >= T untouched.
    """
    batch, T, H, P = x.shape
    nslots, _, _, N = state.shape
    G = B.shape[2]
    check_shape(state, "state", (nslots, H, P, N))
    if snapshots.dim() != 5 or snapshots.shape[0] != nslots or snapshots.shape[1] < T or tuple(snapshots.shape[2:]) != (H, P, N):
        raise ValueError(f"snapshots: expected shape ({nslots}, >= {T}, {H}, {P}, {N}), got {tuple(snapshots.shape)}")
    check_shape(B, "B", (batch, T, G, N))
    check_shape(C, "C", (batch, T, G, N))
    check_shape(dt, "dt", (batch, T, H))
    hpg = H // G
    dtp = process_dt(dt.to(F64), dt_bias.to(F64))
    A64, D64 = A.to(F64), D.to(F64)
    y = torch.full((batch, T, H, P), float("nan"), dtype=F64, device=x.device)
    for b, s in enumerate(rows(state_batch_indices, batch, nslots)):
        if s < 0:
            continue
        S = state[s].to(F64)
        for t in range(T):
            xt = x[b, t].to(F64)
            Bt = B[b, t].to(F64).repeat_interleave(hpg, dim=0)
            Ct = C[b, t].to(F64).repeat_interleave(hpg, dim=0)
            S = torch.exp(A64 * dtp[b, t])[:, None, None] * S + (dtp[b, t][:, None, None] * xt[:, :, None]) * Bt[:, None, :]
            snapshots[s, t] = S.to(snapshots.dtype)
            yt = torch.einsum("hpn,hn->hp", S, Ct) + D64[:, None] * xt
            y[b, t] = _gate(yt, None if z is None else z[b, t].to(F64))
    return y
