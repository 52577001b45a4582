# SPDX-License-Identifier: Apache-2.0
"""Executable specification of ReplaySSM Mamba-2 decode (docs/DESIGN.md §1-2), in plain torch.

Runs in any dtype on any device; tests run it in float64 on the CPU. Everything mirrors the
kernels' contract: shapes, the meaning of ``cursor``, padding rows (slot -1), what is written on
a flush and what is left alone.

Mamba-2 with tied head dims: A, dt, dt_bias and D are per-head scalars. Per (slot, head):
    dt   = softplus(dt_raw + dt_bias)                (threshold 20, as torch)
    conventional:  S <- exp(A dt) S + dt x B^T,  y = S C + D x,  y <- y silu(z)
    ReplaySSM:     checkpoint S0 + buffer (x_j, B_j, dt_j), j = 1..k (k = this step)
                   c_j = A sum_{i<=j} dt_i,  w_j = dt_j exp(c_k - c_j)
                   y_k = exp(c_k) S0 C_k + sum_j w_j (B_j . C_k) x_j + D x_k
                   when k == L: S0 <- exp(c_k) S0 + sum_j w_j x_j B_j^T, buffer emptied
``cursor[slot]`` is the number of entries already in the buffer (0..L-1); the decode step does not
move it, :func:`~trtllm_replayssm.cursor.advance_cursor` does (once per model step, shared by all layers).

Shadow and 8-bit checkpoint (:class:`~trtllm_replayssm.shadow.Shadow`, :class:`~trtllm_replayssm.shadow.Checkpoint8`,
issue 38): the quantizers every family shares live in :mod:`trtllm_replayssm.shadow`; :func:`replay_decode` reads the
shadow instead of the checkpoint, and a flush rewrites it (or stores the 8-bit checkpoint) from the folded state.
The cursor rules (:func:`~trtllm_replayssm.cursor.advance_cursor`) live in :mod:`trtllm_replayssm.cursor`.
"""

from __future__ import annotations

import torch

from ...shadow import Checkpoint8, Shadow


def softplus(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v > 20.0, v, torch.log1p(torch.exp(v)))


def process_dt(dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """(batch, H) raw dt -> processed dt, computed in the dtype of ``dt_bias`` promotion."""
    return softplus(dt + dt_bias)


def _group_expand(v: torch.Tensor, nheads: int) -> torch.Tensor:
    """(batch, G, N) -> (batch, H, N): heads h use group h // (H // G)."""
    return v.repeat_interleave(nheads // v.shape[1], dim=1)


def _gate(y: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    return y if z is None else y * (z * torch.sigmoid(z))


def conventional_step(state, x, B, C, dt, dt_bias, A, D, z=None, state_batch_indices=None):
    """One conventional step. ``state`` (slots, H, P, N) is updated in place; returns y (batch, H, P).

    Rows whose slot is -1 are skipped: their y is returned as NaN (the kernels leave it untouched).
    """
    batch, H, P = x.shape
    sbi = torch.arange(batch) if state_batch_indices is None else state_batch_indices.long().cpu()
    ct = state.dtype
    dtp = process_dt(dt.to(ct), dt_bias.to(ct))  # (batch, H)
    Bh, Ch = _group_expand(B.to(ct), H), _group_expand(C.to(ct), H)
    y = torch.full((batch, H, P), float("nan"), dtype=ct, device=x.device)
    for b in range(batch):
        s = int(sbi[b])
        if s < 0:
            continue
        a = torch.exp(A.to(ct) * dtp[b])  # (H,)
        S = state[s] * a[:, None, None] + (dtp[b][:, None, None] * x[b].to(ct)[:, :, None]) * Bh[b][:, None, :]
        state[s] = S
        yb = torch.einsum("hpn,hn->hp", S, Ch[b]) + D.to(ct)[:, None] * x[b].to(ct)
        y[b] = _gate(yb, None if z is None else z[b].to(ct))
    return y


def buffer_weights(dts: torch.Tensor, A: torch.Tensor):
    """dts (H, k) processed dt of entries 1..k, A (H,) -> (w (H, k), decay (H,)) = (w_j, exp(c_k))."""
    cum = torch.cumsum(dts, dim=-1)
    total = cum[:, -1:]
    w = dts * torch.exp(A[:, None] * (total - cum))
    return w, torch.exp(A * total[:, 0])


def replay_decode(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z=None,
                  state_batch_indices=None, shadow: Shadow | None = None, ckpt8: Checkpoint8 | None = None):
    """One ReplaySSM decode step without moving the cursor; returns y (batch, H, P).

    Caches (mutated in place, as the kernel does): state (slots, H, P, N), x_cache (slots, H, L, P),
    B_cache (slots, G, L, N), dt_cache (slots, H, L) processed dt, cursor (slots,) read only.
    Non-flush step: entry k = cursor+1 is appended at position cursor. Flush step (k == L): the
    state form is written as the new checkpoint; the buffers are not written.
    With ``shadow``, the output form of non-flush steps reads the low-precision shadow of the
    checkpoint; a flush updates from the full-precision checkpoint and rewrites the shadow from the
    values it stored, so rounding errors do not accumulate across flushes.
    With ``ckpt8`` (``state`` None, no shadow) the checkpoint is the 8-bit one: every step reads it
    dequantised (float64 math on q * scale), the flush stores the folded state through
    :meth:`Checkpoint8.write` with the slot's flush count (rounding errors do accumulate: each flush starts
    from the last quantised state).
    """
    batch, H, P = x.shape
    L = x_cache.shape[2]
    if ckpt8 is not None and (state is not None or shadow is not None):
        raise ValueError("ckpt8: the 8-bit checkpoint is the only checkpoint: pass state=None and no shadow")
    ct = torch.float64 if ckpt8 is not None else state.dtype
    sbi = torch.arange(batch) if state_batch_indices is None else state_batch_indices.long().cpu()
    dtp = process_dt(dt.to(ct), dt_bias.to(ct))
    Bh, Ch = _group_expand(B.to(ct), H), _group_expand(C.to(ct), H)
    y = torch.full((batch, H, P), float("nan"), dtype=ct, device=x.device)
    for b in range(batch):
        s = int(sbi[b])
        if s < 0:
            continue
        pos = int(cursor[s])
        if not 0 <= pos < L:
            raise ValueError(f"cursor[{s}] = {pos} is outside [0, {L})")
        k = pos + 1
        xs = torch.cat([x_cache[s, :, :pos].to(ct), x[b].to(ct)[:, None]], dim=1)  # (H, k, P)
        hpg = H // B.shape[1]
        Bs = torch.cat([B_cache[s, :, :pos].to(ct).repeat_interleave(hpg, dim=0), Bh[b][:, None]], dim=1)  # (H, k, N)
        dts = torch.cat([dt_cache[s, :, :pos].to(ct), dtp[b][:, None]], dim=1)  # (H, k)
        w, decay = buffer_weights(dts, A.to(ct))
        if k == L:
            S0 = ckpt8.read(s, ct) if ckpt8 is not None else state[s].to(ct)
            S = decay[:, None, None] * S0 + torch.einsum("hk,hkp,hkn->hpn", w, xs, Bs)
            if ckpt8 is not None:
                ckpt8.write(s, S)
            else:
                state[s] = S.to(state.dtype)
            if shadow is not None:
                shadow.write(s, state[s])
            yb = torch.einsum("hpn,hn->hp", S, Ch[b])
        else:
            bc = torch.einsum("hkn,hn->hk", Bs, Ch[b])
            S0 = ckpt8.read(s, ct) if ckpt8 is not None else state[s].to(ct) if shadow is None else shadow.read(s, ct)
            yb = decay[:, None] * torch.einsum("hpn,hn->hp", S0, Ch[b])
            yb = yb + torch.einsum("hk,hkp->hp", w * bc, xs)
            x_cache[s, :, pos] = x[b].to(x_cache.dtype)
            B_cache[s, :, pos] = B[b].to(B_cache.dtype)
            dt_cache[s, :, pos] = dtp[b].to(dt_cache.dtype)
        yb = yb + D.to(ct)[:, None] * x[b].to(ct)
        y[b] = _gate(yb, None if z is None else z[b].to(ct))
    return y


def replay_state(state, x_cache, B_cache, dt_cache, cursor, A, slot: int):
    """The current recurrent state S_k of ``slot`` (checkpoint folded with its buffer), float64 math."""
    H = state.shape[1]
    k = int(cursor[slot])
    ct = torch.float64
    S0 = state[slot].to(ct)
    if k == 0:
        return S0
    xs = x_cache[slot, :, :k].to(ct)
    Bs = B_cache[slot, :, :k].to(ct).repeat_interleave(H // B_cache.shape[1], dim=0)
    w, decay = buffer_weights(dt_cache[slot, :, :k].to(ct), A.to(ct))
    return decay[:, None, None] * S0 + torch.einsum("hk,hkp,hkn->hpn", w, xs, Bs)
