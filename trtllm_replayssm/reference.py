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
move it, :func:`advance_cursor` does (once per model step, shared by all layers).

8-bit checkpoint (:class:`Checkpoint8`, issue 38): the checkpoint itself is fp8-e4m3 with one fp32 scale
per (slot, head, row p), and there is no full-precision copy behind it. Every step reads it dequantised
(q * scale); the flush folds the ring onto that, and stores the result quantised again
(:func:`quantize_ckpt8`: scale = max |S[row]| / 448, q = SR(S * (1 / scale)) with stochastic rounding by
a counter-based hash of (seed, flush count, slot, head, row, n), or round-to-nearest-even).
``flushes[slot]`` counts the flushes the slot has completed: :func:`advance_cursor` moves it when the
cursor wraps, and the flush of the step reads it before that.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0


def quantize_shadow(S: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """The one shadow quantizer (every path writes shadows through it): ``q`` and ``scale`` written in
    place from ``S`` (..., N), any leading dims. bf16 (``scale`` None): q = bf16(S), round to nearest
    even as the kernels' store. fp8: scale = max_n |S[..., n]| / 448 in fp32 (1 for an all-zero row),
    q = e4m3(S * (1 / scale)), one fp32 reciprocal per row and a product per value, as the kernels' store."""
    if scale is None:
        q.copy_(S.to(torch.bfloat16))
        return
    S32 = S.float()
    amax = S32.abs().amax(dim=-1)
    scale.copy_(torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax)))
    q.copy_((S32 * torch.reciprocal(scale)[..., None]).to(torch.float8_e4m3fn))


# ---- 8-bit checkpoint: counter-based hash and stochastic rounding ----------------------------------------
# Every function below mirrors plugins/mamba2/replayssm.cuh bit for bit (uint32 arithmetic on int64
# tensors: products wrap in int64 two's complement, their low 32 bits are the uint32 product).
CKPT8_ROUNDINGS = ("sr", "rne")
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # odd step between the element keys of one row (Weyl sequence)
E4M3_QUANTUM_MIN = 2.0 ** -9  # spacing of e4m3 below 2^-6 (subnormals) and in [2^-6, 2^-5)


def mix32(x):
    """Integer finalizer of 32-bit words (xorshift-multiply, constants 0x7feb352d / 0x846ca68b: the
    "lowbias32" of C. Wellons' hash prospector): a bijection of uint32 with good avalanche. ``x`` an int
    or an int64 tensor of values in [0, 2^32); returns the same kind."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def ckpt8_random_bits(seed: int, flush: int, slot: int, H: int, P: int, N: int) -> torch.Tensor:
    """(H, P, N) int64 of uint32 random words for the flush number ``flush`` of ``slot``:
    row key k = mix32(mix32(mix32(mix32(mix32(seed) + flush) + slot) + head) + row), element word
    r = mix32(k + n * 0x9E3779B9) (mod 2^32). Counter-based: any element of any flush is reproducible
    from its coordinates alone, in any order, on any device."""
    k = mix32(mix32(mix32(seed & _M32) + (flush & _M32)) + (slot & _M32))
    heads = mix32(k + torch.arange(H, dtype=torch.int64))
    rows = mix32(heads[:, None] + torch.arange(P, dtype=torch.int64)[None, :])
    n = (torch.arange(N, dtype=torch.int64) * _GOLDEN) & _M32
    return mix32(rows[:, :, None] + n[None, None, :])


def stochastic_round_e4m3(v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` -> the float32 e4m3 value below or above |v| (saturated at 448; NaN kept), rounding up
    with probability (|v| - lo) / (hi - lo) given uniform uint32 words ``r`` (int64 tensor).

    Bit form (the kernel's): a = bits of |v|; its e4m3 quantum is 2^max(e - 3, -9) for exponent e, i.e.
    the low d = 20 (e >= -6) or 14 - e bits of a. For d <= 23 (|v| >= 2^-9): round up iff
    r < (a mod 2^d) * 2^(32 - d), result (a - a mod 2^d) + 2^d [up] (a carry into the exponent is the
    next binade). For d >= 24 (|v| < 2^-9) the candidates are 0 and 2^-9, up iff r < floor(M 2^(32 - d))
    with M the 24-bit significand. Exact probabilities for d <= 32; below that (|v| < 2^-18) the
    probability is floored to a multiple of 2^-32."""
    if v.dtype != torch.float32:
        raise TypeError(f"v: expected float32, got {v.dtype}")
    bits = v.view(torch.int32).to(torch.int64) & _M32
    sign, a = bits & 0x80000000, bits & 0x7FFFFFFF
    a = a.clamp(max=0x43E00000)  # 448 = e4m3's largest finite value (satfinite)
    e = (a >> 23) - 127
    d = torch.where(e >= -6, torch.full_like(e, 20), 14 - e)
    d1 = d.clamp(max=23)
    mask = (torch.ones_like(d1) << d1) - 1
    up1 = r < ((a & mask) << (32 - d1))
    near = (a & ~mask) + torch.where(up1, mask + 1, torch.zeros_like(mask))
    sh = (d - 24).clamp(0, 40)
    thr = torch.where(sh < 32, (((a & 0x7FFFFF) | 0x800000) << 8) >> sh.clamp(max=31), torch.zeros_like(a))
    tiny = torch.where(r < thr, torch.full_like(a, 0x3B000000), torch.zeros_like(a))  # 2^-9 or 0
    out = torch.where(d <= 23, near, tiny) | sign
    out = torch.where(out >= 0x80000000, out - (1 << 32), out).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(v), v, out)


def quantize_ckpt8(S: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rounding: str = "sr", seed: int = 0,
                   slot: int = 0, flush: int = 0) -> None:
    """The one 8-bit checkpoint quantizer: ``q`` (H, P, N) float8_e4m3fn and ``scale`` (H, P) float32 written in
    place from ``S`` (H, P, N), rounded to float32 first (the kernel folds in fp32). scale = max_n |S| / 448 (1
    for an all-zero row), v = S * (1 / scale) in fp32 (as :func:`quantize_shadow`); ``rounding`` "rne":
    q = e4m3(v) to nearest even (the fp8 shadow's quantizer), "sr": :func:`stochastic_round_e4m3` with the
    words :func:`ckpt8_random_bits` (seed, flush, slot) gives."""
    if rounding not in CKPT8_ROUNDINGS:
        raise ValueError(f"rounding: expected one of {CKPT8_ROUNDINGS}, got {rounding!r}")
    if rounding == "rne":
        quantize_shadow(S, q, scale)
        return
    S32 = S.float()
    amax = S32.abs().amax(dim=-1)
    scale.copy_(torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax)))
    v = S32 * torch.reciprocal(scale)[..., None]
    H, P, N = S.shape
    r = ckpt8_random_bits(seed, flush, slot, H, P, N).to(v.device)  # the words depend on coordinates only
    q.copy_(stochastic_round_e4m3(v, r).to(torch.float8_e4m3fn))


class Checkpoint8:
    """An 8-bit checkpoint (module docstring): ``q`` (slots, H, P, N) float8_e4m3fn, ``scale`` (slots, H, P)
    float32 (one per (slot, head, row p)), ``flushes`` (slots,) int32 flushes completed per slot, ``seed`` (one
    per layer: the hash has no layer coordinate) and ``rounding`` ("sr" or "rne")."""

    def __init__(self, slots: int, nheads: int, headdim: int, dstate: int, rounding: str = "sr", seed: int = 0,
                 device="cpu"):
        if rounding not in CKPT8_ROUNDINGS:
            raise ValueError(f"rounding: expected one of {CKPT8_ROUNDINGS}, got {rounding!r}")
        self.rounding, self.seed = rounding, int(seed)
        self.q = torch.zeros(slots, nheads, headdim, dstate, dtype=torch.float8_e4m3fn, device=device)
        self.scale = torch.ones(slots, nheads, headdim, device=device)
        self.flushes = torch.zeros(slots, dtype=torch.int32, device=device)

    @classmethod
    def wrap(cls, q: torch.Tensor, scale: torch.Tensor, flushes: torch.Tensor, rounding: str = "sr",
             seed: int = 0) -> Checkpoint8:
        """A Checkpoint8 over existing tensors (views, written in place)."""
        if q.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or flushes.dtype != torch.int32:
            raise TypeError(f"Checkpoint8.wrap: expected q float8_e4m3fn, scale float32, flushes int32, got "
                            f"{q.dtype}, {scale.dtype}, {flushes.dtype}")
        ck = cls.__new__(cls)
        ck.q, ck.scale, ck.flushes, ck.rounding, ck.seed = q, scale, flushes, rounding, int(seed)
        return ck

    @classmethod
    def of(cls, state: torch.Tensor, rounding: str = "sr", seed: int = 0) -> Checkpoint8:
        """Quantise a full-precision checkpoint (prefill hand-off; flush count 0)."""
        ck = cls(*state.shape, rounding=rounding, seed=seed, device=state.device)
        for s in range(state.shape[0]):
            ck.write(s, state[s])
        return ck

    def write(self, slot: int, S: torch.Tensor) -> None:
        quantize_ckpt8(S, self.q[slot], self.scale[slot], self.rounding, self.seed, slot, int(self.flushes[slot]))

    def read(self, slot: int, dtype=torch.float32) -> torch.Tensor:
        """q * scale: an fp32 product (the kernel's dequantisation), then ``dtype``."""
        return (self.q[slot].float() * self.scale[slot][..., None]).to(dtype)


class Shadow:
    """Low-precision copy of the checkpoint that the output form reads (docs/DESIGN.md §1).

    ``kind`` "bf16": q = S in bfloat16. ``kind`` "fp8": q = S * (1 / scale) in float8_e4m3fn with one fp32
    scale per (slot, head, row), scale = max |S[row]| / 448 (1 for an all-zero row) (:func:`quantize_shadow`). Written from
    the stored full-precision values at every flush (and at prefill hand-off), read every step.
    """

    def __init__(self, slots: int, nheads: int, headdim: int, dstate: int, kind: str, device="cpu"):
        if kind not in ("bf16", "fp8"):
            raise ValueError(f"kind: expected 'bf16' or 'fp8', got {kind!r}")
        self.kind = kind
        dtype = torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn
        self.q = torch.zeros(slots, nheads, headdim, dstate, dtype=dtype, device=device)
        self.scale = torch.ones(slots, nheads, headdim, device=device) if kind == "fp8" else None

    @classmethod
    def wrap(cls, q: torch.Tensor, scale: torch.Tensor | None = None) -> Shadow:
        """A Shadow over existing tensors (views, no copy; written in place): q bfloat16 or
        float8_e4m3fn (slots, H, P, N), scale (slots, H, P) float32 for fp8 (None for bf16)."""
        kinds = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
        if q.dtype not in kinds:
            raise TypeError(f"shadow: expected dtype bfloat16 or float8_e4m3fn, got {q.dtype}")
        kind = kinds[q.dtype]
        if (scale is None) != (kind == "bf16"):
            raise ValueError(f"shadow_scale: an fp8 shadow needs row scales and a bf16 one has none, got {kind} with "
                             f"shadow_scale={None if scale is None else tuple(scale.shape)}")
        sh = cls.__new__(cls)
        sh.kind, sh.q, sh.scale = kind, q, scale
        return sh

    @classmethod
    def of(cls, state: torch.Tensor, kind: str) -> Shadow:
        sh = cls(*state.shape, kind, state.device)
        for s in range(state.shape[0]):
            sh.write(s, state[s])
        return sh

    def write(self, slot: int, S: torch.Tensor) -> None:
        quantize_shadow(S, self.q[slot], None if self.scale is None else self.scale[slot])

    def read(self, slot: int, dtype=torch.float32) -> torch.Tensor:
        q = self.q[slot].to(dtype)
        return q if self.kind == "bf16" else q * self.scale[slot].to(dtype)[..., None]


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


def advance_cursor(cursor, state_batch_indices, buffer_len: int, flushes=None):
    """cursor[slot] <- (cursor[slot] + 1) mod L for every row with a slot (in place); with ``flushes``
    (an 8-bit checkpoint's flush counts, :class:`Checkpoint8`) flushes[slot] += 1 where the cursor wraps."""
    for s in state_batch_indices.long().cpu().tolist():
        if s >= 0:
            if flushes is not None and int(cursor[s]) == buffer_len - 1:
                flushes[s] = int(flushes[s]) + 1
            cursor[s] = (int(cursor[s]) + 1) % buffer_len
    return cursor


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
