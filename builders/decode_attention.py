# SPDX-License-Identifier: Apache-2.0
"""Attention of T query tokens per row over the filled part of a dense KV cache (Triton, CUDA only).

What an engine's decode attention does (a paged KV kernel in TensorRT-LLM or vLLM): read only the
positions a row has filled, not the cache's capacity. ``F.scaled_dot_product_attention`` with a
boolean mask reads every position of the cache; at batch 256 and a 1024-position cache that was
1.57 ms of the 8B step for ~250 filled positions (bench/NOTES.md, 2026-12-03).

Layout (that of builders/model_step.py): q (b, T, nh * hd) as the q projection writes it; the caches
k, v (b, kvh, cap, hd) contiguous, grouped-query heads (nh = kvh * rep); ``last`` (b, T) int64: the
last position query t of row b sees (keys 0..last[b, t]; the step passes min(lengths[b] + t, kv_len + T - 2)).
Output o (b, T, nh * hd), ready for o_proj. Scale hd^-1/2 (Nemotron-H: NoPE, no softcap).

One program per (row, kv head): its rep * T query rows (padded to 16 for the tensor cores) walk the
keys in blocks of 64 up to max_t last[b, t] with an online softmax in fp32; fp32 models take IEEE
fp32 products, bf16/fp16 models the usual bf16 products with fp32 accumulation. No split over the
keys: at the fills the benchmarks reach (hundreds of positions) a program reads < 0.5 MB; a long-
context batch-1 run would want a split-KV (flash-decoding) reduction, not built.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, last_ptr, sm_scale, T, NH, stride_kb, stride_kh,
                                REP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                IEEE: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        t = m // REP
        valid = t < T
        head = g * REP + m % REP
        d = tl.arange(0, HD)
        rows = ((b * T + t) * NH + head).to(tl.int64) * HD  # q and o rows of (b, T, nh, hd)
        q = tl.load(q_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        last = tl.load(last_ptr + b * T + t, mask=valid, other=-1)
        n_keys = tl.load(last_ptr + b * T + T - 1) + 1  # the last token sees the most keys
        base = b.to(tl.int64) * stride_kb + g * stride_kh
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HD), tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            inside = n < n_keys
            offs = base + n[:, None] * HD + d[None, :]
            k = tl.load(k_ptr + offs, mask=inside[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=inside[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(n[None, :] <= last[:, None], s * sm_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see no key
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + rows[:, None] + d[None, :], o.to(o_ptr.dtype.element_ty), mask=valid[:, None])

    return decode_attention_kernel


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """o (b, T, nh * hd): query t of row b over keys 0..last[b, t] of its kv head (see the module docstring)."""
    b, kvh, cap, hd = k.shape
    T = last.shape[1]
    nh = q.shape[-1] // hd
    for name, t in (("q", q), ("k", k), ("v", v), ("last", last)):
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous CUDA tensor, got {t.device}, strides {tuple(t.stride())}")
    if q.shape != (b, T, nh * hd) or nh % kvh or v.shape != k.shape:
        raise ValueError(f"q, k, v: expected (b, T, nh*hd) with nh a multiple of kvh and k, v (b, kvh, cap, hd) alike, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if last.shape != (b, T) or last.dtype != torch.int64:
        raise ValueError(f"last: expected ({b}, {T}) int64, got {tuple(last.shape)} {last.dtype}")
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"head_dim: expected a power of two >= 16, got {hd}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    rep = nh // kvh
    o = torch.empty_like(q) if out is None else out
    block_m = max(16, 1 << (rep * T - 1).bit_length())
    _kernel()[(b, kvh)](q, k, v, o, last, hd ** -0.5, T, nh, k.stride(0), k.stride(1), REP=rep, HD=hd,
                        BLOCK_M=block_m, BLOCK_N=64, IEEE=q.dtype == torch.float32, num_warps=4)
    return o
