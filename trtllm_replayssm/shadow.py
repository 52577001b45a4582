# SPDX-License-Identifier: Apache-2.0
"""Low-precision copies of a checkpoint, shared by every family: the bf16 / fp8 shadow and the 8-bit checkpoint.

Shadow (:class:`Shadow`, :func:`quantize_shadow`; docs/DESIGN.md §1): a bf16 or fp8-e4m3 copy of the full-precision
checkpoint that the steps which do not flush read instead of it, rewritten from the checkpoint as stored whenever
it is written (a flush, the prefill hand-off). fp8 carries one fp32 scale per row (the state's leading dims but the
last): scale = max |S[row]| / 448 (1 for an all-zero row), q = e4m3(S * (1 / scale)), as the kernels' store.

8-bit checkpoint (:class:`Checkpoint8`, issue 38): the checkpoint itself is fp8-e4m3 with one fp32 scale
per (slot, head, row p), and there is no full-precision copy behind it. Every step reads it dequantised
(q * scale); the flush folds the ring onto that, and stores the result quantised again
(:func:`quantize_ckpt8`: scale = max |S[row]| / 448, q = SR(S * (1 / scale)) with stochastic rounding by
a counter-based hash of (seed, flush count, slot, head, row, n), or round-to-nearest-even).
``flushes[slot]`` counts the flushes the slot has completed: :func:`.cursor.advance_cursor` moves it when the
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
