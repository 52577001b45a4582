# SPDX-License-Identifier: Apache-2.0
"""Executable specification of speculative decoding with ReplaySSM (docs/DESIGN.md §1, last paragraphs).

float64 math in plain torch, any device; the tests run it on the CPU and the speculative GPU kernels
are checked against it. :mod:`.reference` is the spec of the standard (one token per step) decode;
this module adds the ring buffer, verify of T = 1 + num_draft tokens, commit/rollback by cursor and
the "one window early" flush, plus the conventional native-spec baseline and the conv1d window.

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
    3. :func:`commit` once: count += n_accepted (0 <= n <= T; n counts the accepted tokens including
       the first one, whose token was already sampled, so n >= 1 in practice). No state copy.
Invariant: L >= 2T and, after step 1, count + 2T <= L, so after any commit count <= L - T: a fully
accepted step never truncates the next window and count never exceeds L.

Native-spec baseline (vLLM / TensorRT-LLM style): :func:`native_spec_verify` runs the conventional
recurrence over the window from S (= ``state``) and writes one snapshot per position into
``snapshots`` (S, T, H, P, N); :func:`native_spec_commit` copies snapshot n-1 into ``state``.

conv1d window (Mamba-2's causal depthwise conv of width K over the conv_dim channels x|B|C):
    conv_window (S, conv_dim, W), W = K - 1 + num_draft, time-ordered, column W-1 = newest input.
    Invariant between steps: the last K-1 columns are the last K-1 committed inputs (with
    num_draft = 0 this is the usual (S, conv_dim, K-1) conv state of vLLM / mamba_ssm).
    :func:`conv_window_update` computes the T outputs from the last K-1 committed inputs and the T new
    ones and shifts all T inputs in (window = last W inputs); :func:`conv_window_rollback` after
    accepting n of T shifts the window right by T - n so the newest committed input is again in column
    W-1 (vacated columns are zeroed; they are older than the last K-1 inputs and never read).
    Needs W - T + n >= K - 1, i.e. n >= 1 when T = num_draft + 1.

Low-precision shadow (optional ``shadow``: a :class:`.reference.Shadow` of ``state``, as in
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

from .reference import Shadow, _gate, buffer_weights, process_dt

F64 = torch.float64
START, COUNT = 0, 1  # columns of ``cursor``


# ---- validation -------------------------------------------------------------------------------------
def _check_shape(t, name: str, shape) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def _slots(state_batch_indices, batch: int, nslots: int) -> list[int]:
    if state_batch_indices is None:
        if batch > nslots:
            raise ValueError(f"state_batch_indices: None needs batch <= slots, got batch={batch}, slots={nslots}")
        return list(range(batch))
    _check_shape(state_batch_indices, "state_batch_indices", (batch,))
    if state_batch_indices.dtype != torch.int32:
        raise TypeError(f"state_batch_indices: expected dtype int32, got {state_batch_indices.dtype}")
    sbi = [int(s) for s in state_batch_indices.cpu().tolist()]
    bad = [s for s in sbi if not -1 <= s < nslots]
    if bad:
        raise ValueError(f"state_batch_indices: expected values in [-1, {nslots}), got {bad[:8]}")
    used = [s for s in sbi if s >= 0]
    if len(set(used)) != len(used):
        raise ValueError(f"state_batch_indices: a slot appears in more than one row, got {sbi}")
    return sbi


def _check_cursor(cursor, nslots: int) -> None:
    _check_shape(cursor, "cursor", (nslots, 2))
    if cursor.dtype != torch.int32:
        raise TypeError(f"cursor: expected dtype int32, got {cursor.dtype}")


def _check_window(num_tokens: int, L: int) -> None:
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected >= 1, got {num_tokens}")
    if L < 2 * num_tokens:
        raise ValueError(f"buffer_len: expected >= 2 * num_tokens = {2 * num_tokens} (one window early), got {L}")


def _get(cursor, s: int) -> tuple[int, int]:
    return int(cursor[s, START]), int(cursor[s, COUNT])


def ring_indices(start: int, first: int, n: int, L: int, device=None) -> torch.Tensor:
    """Ring indices of entries first+1 .. first+n after the checkpoint (entry j at (start + j - 1) % L)."""
    return (start + first + torch.arange(n, device=device)) % L


# ---- committed state and flush -----------------------------------------------------------------------
def committed_state(state, x_cache, B_cache, dt_cache, cursor, A, slot: int) -> torch.Tensor:
    """S_count of ``slot`` (checkpoint folded with its committed entries), float64, (H, P, N)."""
    H, L = state.shape[1], x_cache.shape[2]
    start, count = _get(cursor, slot)
    S0 = state[slot].to(F64)
    if count == 0:
        return S0
    idx = ring_indices(start, 0, count, L, x_cache.device)
    xs = x_cache[slot][:, idx].to(F64)  # (H, m, P)
    Bs = B_cache[slot][:, idx].to(F64).repeat_interleave(H // B_cache.shape[1], dim=0)  # (H, m, N)
    w, decay = buffer_weights(dt_cache[slot][:, idx].to(F64), A.to(F64))
    return decay[:, None, None] * S0 + torch.einsum("hk,hkp,hkn->hpn", w, xs, Bs)


def needs_flush(cursor, slot: int, num_tokens: int, buffer_len: int) -> bool:
    """The flush rule: count + 2T > L (flush one window early)."""
    return int(cursor[slot, COUNT]) + 2 * num_tokens > buffer_len


def flush_checkpoint(state, x_cache, B_cache, dt_cache, cursor, A, num_tokens: int, state_batch_indices=None,
                     shadow: Shadow | None = None):
    """One layer's part of the flush: S0 <- S_count for rows whose slot needs a flush. Cursor read only.

    Returns the list of flushed slots. Run it for every layer, then :func:`flush_cursor` once. With
    ``shadow``, each flushed slot's shadow is rewritten from the checkpoint as stored.
    """
    nslots, L = state.shape[0], x_cache.shape[2]
    _check_cursor(cursor, nslots)
    _check_window(num_tokens, L)
    batch = nslots if state_batch_indices is None else state_batch_indices.shape[0]
    flushed = []
    for s in _slots(state_batch_indices, batch, nslots):
        if s >= 0 and needs_flush(cursor, s, num_tokens, L):
            state[s] = committed_state(state, x_cache, B_cache, dt_cache, cursor, A, s).to(state.dtype)
            if shadow is not None:
                shadow.write(s, state[s])
            flushed.append(s)
    return flushed


def flush_cursor(cursor, num_tokens: int, buffer_len: int, state_batch_indices=None):
    """The cursor part of the flush (once per model step): start <- (start + count) % L, count <- 0."""
    _check_cursor(cursor, cursor.shape[0])
    _check_window(num_tokens, buffer_len)
    batch = cursor.shape[0] if state_batch_indices is None else state_batch_indices.shape[0]
    flushed = []
    for s in _slots(state_batch_indices, batch, cursor.shape[0]):
        if s >= 0 and needs_flush(cursor, s, num_tokens, buffer_len):
            start, count = _get(cursor, s)
            cursor[s, START] = (start + count) % buffer_len
            cursor[s, COUNT] = 0
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
    _check_shape(state, "state", (nslots, H, P, N))
    _check_shape(x_cache, "x_cache", (nslots, H, L, P))
    _check_shape(dt_cache, "dt_cache", (nslots, H, L))
    _check_shape(B, "B", (batch, *tok, G, N))
    _check_shape(C, "C", (batch, *tok, G, N))
    _check_shape(dt, "dt", (batch, *tok, H))
    if z is not None:
        _check_shape(z, "z", (batch, *tok, H, P))
    for name, v in (("dt_bias", dt_bias), ("A", A), ("D", D)):
        _check_shape(v, name, (H,))
    if H % G:
        raise ValueError(f"B_cache: ngroups must divide nheads={H}, got {G}")
    if standard:
        _check_shape(cursor, "cursor", (nslots,))
    else:
        _check_cursor(cursor, nslots)
        if tok[0] > L:
            raise ValueError(f"x: expected at most L={L} tokens per window, got T={tok[0]}")
    if shadow is not None:
        _check_shape(shadow.q, "shadow", (nslots, H, P, N))


def _shape_of(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def verify(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z=None, state_batch_indices=None,
           shadow: Shadow | None = None, flushed=()):
    """Verify T tokens: y (batch, T, H, P) float64; the window is appended to the ring, S0 and cursor untouched.

    Inputs: x, z (batch, T, H, P); B, C (batch, T, G, N); dt (batch, T, H) raw; dt_bias, A, D (H,).
    Window entry t is stored at ring index (start + count + t) % L (x, B in the cache dtypes, processed
    dt in the dt_cache dtype) and the outputs are computed from the ring as stored, so later steps
    replay exactly the values this step used. Needs count + T <= L (run :func:`maybe_flush` first).
    With ``shadow`` the S0 C_t term reads the shadow (:meth:`.reference.Shadow.read`, float64), except
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
    rows = [(b, s) for b, s in enumerate(_slots(state_batch_indices, batch, nslots)) if s >= 0]
    for _, s in rows:  # every row is validated before anything is written
        start, count = _get(cursor, s)
        if not (0 <= start < L and 0 <= count and count + T <= L):
            raise ValueError(f"cursor[{s}]: expected 0 <= start < {L} and count + T <= {L} (T={T}), got "
                             f"start={start}, count={count}; run maybe_flush before verify")
    for b, s in rows:
        start, count = _get(cursor, s)
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


def check_n_accepted(n_accepted, batch: int | None = None) -> list[int]:
    """n_accepted as ints, after checking it is an integer (batch,) tensor (batch None: any length); a float
    would be truncated here and rounded elsewhere, so the cursor and the conv window would disagree. The
    values are checked by the callers."""
    if not isinstance(n_accepted, torch.Tensor):
        raise TypeError(f"n_accepted: expected a torch.Tensor, got {type(n_accepted).__name__}")
    if n_accepted.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"n_accepted: expected dtype int32 (or int64), got {n_accepted.dtype}")
    if n_accepted.dim() != 1:
        raise ValueError(f"n_accepted: expected shape (batch,), got {tuple(n_accepted.shape)}")
    if batch is not None:
        _check_shape(n_accepted, "n_accepted", (batch,))
    return [int(v) for v in n_accepted.cpu().tolist()]


def commit(cursor, n_accepted, num_tokens: int, buffer_len: int, state_batch_indices=None):
    """count += n_accepted[row] for every row with a slot (in place): a cursor move, no state copy.

    n_accepted (batch,) int: accepted tokens of the window including the first one, 0 <= n <= T.
    All rows are validated before any cursor moves.
    """
    _check_cursor(cursor, cursor.shape[0])
    nacc = check_n_accepted(n_accepted, None if state_batch_indices is None else state_batch_indices.shape[0])
    batch = len(nacc)
    rows = [(b, s) for b, s in enumerate(_slots(state_batch_indices, batch, cursor.shape[0])) if s >= 0]
    for b, s in rows:
        n, count = nacc[b], int(cursor[s, COUNT])
        if not 0 <= n <= num_tokens:
            raise ValueError(f"n_accepted[{b}]: expected 0 <= n <= T={num_tokens}, got {n}")
        if count + n > buffer_len:
            raise ValueError(f"cursor[{s}]: count + n_accepted = {count} + {n} exceeds L={buffer_len}")
    for b, s in rows:
        cursor[s, COUNT] = int(cursor[s, COUNT]) + nacc[b]
    return cursor


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
    _check_shape(state, "state", (nslots, H, P, N))
    if snapshots.dim() != 5 or snapshots.shape[0] != nslots or snapshots.shape[1] < T or tuple(snapshots.shape[2:]) != (H, P, N):
        raise ValueError(f"snapshots: expected shape ({nslots}, >= {T}, {H}, {P}, {N}), got {tuple(snapshots.shape)}")
    _check_shape(B, "B", (batch, T, G, N))
    _check_shape(C, "C", (batch, T, G, N))
    _check_shape(dt, "dt", (batch, T, H))
    hpg = H // G
    dtp = process_dt(dt.to(F64), dt_bias.to(F64))
    A64, D64 = A.to(F64), D.to(F64)
    y = torch.full((batch, T, H, P), float("nan"), dtype=F64, device=x.device)
    for b, s in enumerate(_slots(state_batch_indices, batch, nslots)):
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


def native_spec_commit(state, snapshots, n_accepted, state_batch_indices):
    """state[s] <- snapshots[s, n-1] for n >= 1 (n = 0: unchanged): the copy native spec pays per step."""
    batch = state_batch_indices.shape[0]
    nacc = check_n_accepted(n_accepted, batch)
    for b, s in enumerate(_slots(state_batch_indices, batch, state.shape[0])):
        n = nacc[b]
        if s < 0:
            continue
        if not 0 <= n <= snapshots.shape[1]:
            raise ValueError(f"n_accepted[{b}]: expected 0 <= n <= {snapshots.shape[1]}, got {n}")
        if n:
            state[s] = snapshots[s, n - 1].to(state.dtype)
    return state


# ---- conv1d window -------------------------------------------------------------------------------------------
def conv_window_update(conv_window, u, weight, bias=None, state_batch_indices=None, activation: str | None = "silu"):
    """Causal depthwise conv of T new inputs; shifts them into the window. Returns (batch, T, conv_dim) float64.

    conv_window (S, conv_dim, W) mutated; u (batch, T, conv_dim); weight (conv_dim, K); bias (conv_dim,).
    out_t = act(bias + sum_{i<K} weight[:, i] * seq[:, t + i]), seq = [last K-1 committed inputs, u_0..u_{T-1}].
    Needs T <= W - K + 2 so that any n >= 1 can be rolled back.
    """
    batch, T, Dc = u.shape
    nslots, _, W = conv_window.shape
    K = weight.shape[1]
    _check_shape(conv_window, "conv_window", (nslots, Dc, W))
    _check_shape(weight, "weight", (Dc, K))
    if bias is not None:
        _check_shape(bias, "bias", (Dc,))
    if W < K - 1:
        raise ValueError(f"conv_window: expected width >= K-1 = {K - 1}, got {W}")
    if T > W - K + 2:
        raise ValueError(f"u: expected at most W - K + 2 = {W - K + 2} tokens (num_draft + 1), got T={T}")
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
    w64 = weight.to(F64)
    out = torch.full((batch, T, Dc), float("nan"), dtype=F64, device=u.device)
    for b, s in enumerate(_slots(state_batch_indices, batch, nslots)):
        if s < 0:
            continue
        new = u[b].transpose(0, 1)  # (conv_dim, T)
        seq = torch.cat([conv_window[s][:, W - (K - 1):].to(F64), new.to(F64)], dim=1)  # (conv_dim, K-1+T)
        for t in range(T):
            o = (w64 * seq[:, t:t + K]).sum(dim=1)
            if bias is not None:
                o = o + bias.to(F64)
            out[b, t] = o * torch.sigmoid(o) if activation == "silu" else o
        conv_window[s] = torch.cat([conv_window[s], new.to(conv_window.dtype)], dim=1)[:, -W:]
    return out


def conv_window_rollback(conv_window, n_accepted, num_tokens: int, conv_kernel: int, state_batch_indices):
    """Drop the T - n rejected inputs: shift the window right by T - n, zero-fill the front (in place)."""
    batch = state_batch_indices.shape[0]
    nacc = check_n_accepted(n_accepted, batch)
    W = conv_window.shape[2]
    for b, s in enumerate(_slots(state_batch_indices, batch, conv_window.shape[0])):
        if s < 0:
            continue
        n = nacc[b]
        if not 0 <= n <= num_tokens:
            raise ValueError(f"n_accepted[{b}]: expected 0 <= n <= T={num_tokens}, got {n}")
        if W - num_tokens + n < conv_kernel - 1:
            raise ValueError(f"n_accepted[{b}]: window width {W} keeps K-1={conv_kernel - 1} inputs only for "
                             f"n >= {conv_kernel - 1 - W + num_tokens}, got {n}")
        r = num_tokens - n
        if r:
            conv_window[s] = torch.cat([torch.zeros_like(conv_window[s][:, :r]), conv_window[s][:, :W - r]], dim=1)
    return conv_window
