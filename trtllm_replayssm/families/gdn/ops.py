# SPDX-License-Identifier: Apache-2.0
"""Validated launchers of the Gated DeltaNet decode kernels (``plugins/gdn/gdn_decode.cu``) on torch tensors.

The math and the state contract are :mod:`.reference`'s (the float64 spec); validation is
:mod:`trtllm_replayssm.launch`'s (the one host boundary), so errors read the same: the tensor named, got and expected,
before any launch.

Shapes (batch rows, H key heads, HV value heads, K key dim, V value dim, L buffer length, S slots):

=====================  ====================  =================  ==========================================
tensor                 shape                 dtype              mutated
=====================  ====================  =================  ==========================================
q, k                   (batch, H, K)         act (bf16/f16/f32) (raw; l2-normalised inside when asked)
v                      (batch, HV, V)        act
a, b                   (batch, HV)           act                (raw: g = -exp(A_log) softplus(a + dt_bias),
                                                                beta = sigmoid(b) inside)
A_log, dt_bias         (HV,)                 f32
state                  (S, HV, V, K)         f32                conventional: always; replay: on flush
u_cache                (S, HV, L, V)         f32                replay: entry appended at cursor
v_cache                (S, HV, L, V)         act                replay: entry appended at cursor
k_cache                (S, H, L, K)          f32                replay: entry appended at cursor
g_cache, beta_cache    (S, HV, L)            f32                replay: entry appended at cursor
cursor                 (S,)                  int32              by :func:`advance_cursor` only
shadow (optional)      (S, HV, V, K)         bf16               replay: on flush; read on the other steps
state_batch_indices    (batch,)              int32              slot per row, -1 = padding
y (output)             (batch, HV, V)        act                padding rows left untouched
=====================  ====================  =================  ==========================================

H divides HV (value head hv reads key head hv // (HV / H)); V, K in GDN_SUPPORTED_DIMS; 1 <= L <= 32.
q, k, state, shadow, u_cache, v_cache and k_cache are moved as vectors of 4 elements: 16-byte aligned data pointers.
``use_qk_l2norm`` and ``scale`` (default K^-1/2) are compiled into the module (part of its cache key).
Values (``check_values``; default unless capturing a CUDA graph; a device->host copy): slots in
[-1, S), no slot in two rows, the rows' cursors in [0, L). Unchecked, the kernels write nothing outside
a row's own slot: a row with an out-of-range slot is skipped, one with an out-of-range cursor gets
NaN outputs and leaves state and buffers as they are.

Per model step: :func:`gdn_replay_decode` for every GDN layer, then one :func:`advance_cursor` (shared
with the Mamba-2 layers' cursor op; all layers of a model share the cursor).

Speculative decoding (T = 1 + num_draft tokens per window, ``plugins/gdn/gdn_spec.cu``; ring cursor and
"flush one window early" exactly as the Mamba-2 speculative ops, :mod:`.spec_reference`):

=====================  ====================  =================  ==========================================
tensor                 shape                 dtype              mutated
=====================  ====================  =================  ==========================================
q, k                   (batch, T, H, K)      act
v                      (batch, T, HV, V)     act
a, b                   (batch, T, HV)        act (raw)
state                  (S, HV, V, K)         f32                gdn_replay_verify: where count + 2T > L
                                                                (the exact fold of the committed entries);
                                                                gdn_native_spec_commit: snapshot n-1
u/v/k/g/beta_cache     as above              as above           gdn_replay_verify: window appended at ring
                                                                index (start + count + t) % L
cursor                 (S, 2)                int32              (start, count); by :func:`gdn_spec_commit`
shadow (optional)      (S, HV, V, K)         bf16               gdn_replay_verify: where it flushes; read
                                                                on the other steps instead of state
n_accepted             (batch,)              int32              accepted tokens of the window, 0..T
snapshots              (S, T, HV, V, K)      f32                gdn_native_spec_verify: state after token t
y (output)             (batch, T, HV, V)     act                padding rows left untouched
=====================  ====================  =================  ==========================================
T in SUPPORTED_NUM_TOKENS, 2T <= L <= 32. Per model step: :func:`gdn_replay_verify` for every GDN layer,
then one :func:`gdn_spec_commit` (the Mamba-2 ``replayssm_spec_commit`` kernel through
:func:`trtllm_replayssm.cursor_ops.spec_commit`, shared with the Mamba-2 layers: the flush the verify kernels did, start +=
count and count = 0 where count + 2T > L, then count += n_accepted). Values checked unless capturing:
slots as above, the rows' cursors start in [0, L) and count in [0, L - T], n_accepted in [0, T];
unchecked, a row with an out-of-range cursor gets NaN outputs and nothing else is written.
"""

from __future__ import annotations

import numpy as np
import torch

from ... import cursor_ops
from ...config import DTYPE_CODES, SUPPORTED_DSTATE, SUPPORTED_HEADDIM, SUPPORTED_NUM_TOKENS
from ...launch import (
    F32,
    I32,
    VECTOR_BYTES,
    Arg,
    arch,
    check_args,
    check_flag,
    check_float,
    check_indices,
    check_rank,
    check_spec_values,
    check_window,
    launch,
    require_cuda,
    row_order_arg,
    values_checked,
)
from .config import GDN_SUPPORTED_DIMS, gdn_spec

_BF16 = (torch.bfloat16,)


def _check_options(use_qk_l2norm, scale) -> None:
    check_flag(use_qk_l2norm, "use_qk_l2norm")
    check_float(scale, "scale", lambda x: x > 0, "a finite positive float", "a float or None (K^-1/2)")


def _geometry(q, v, state, u_cache=None):
    """(batch, H, HV, V, K, S, L) of a GDN call from the tensors that define them (L None without u_cache)."""
    check_rank(q, "q", 3, "(batch, H, K)")
    check_rank(v, "v", 3, "(batch, HV, V)")
    check_rank(state, "state", 4, "(slots, HV, V, K)")
    batch, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    S = state.shape[0]
    L = None
    if u_cache is not None:
        check_rank(u_cache, "u_cache", 4, "(slots, HV, L, V)")
        L = u_cache.shape[2]
        if not 1 <= L <= 32:
            raise ValueError(f"u_cache: buffer length L (dim 2) must be in 1..32, got {L}")
    return batch, H, HV, V, K, S, L


def _step_args(q, k, v, a, b, A_log, dt_bias, state, state_batch_indices, out, lead=("batch",)) -> list:
    return [
        Arg("q", q, lead + ("heads_k", "K"), "act"),
        Arg("k", k, lead + ("heads_k", "K"), "act"),
        Arg("v", v, lead + ("heads_v", "V"), "act", None),
        Arg("a", a, lead + ("heads_v",), "act", None),
        Arg("b", b, lead + ("heads_v",), "act", None),
        Arg("A_log", A_log, ("heads_v",), F32, None),
        Arg("dt_bias", dt_bias, ("heads_v",), F32, None),
        Arg("state", state, ("slots", "heads_v", "V", "K"), F32),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        Arg("out", out, lead + ("heads_v", "V"), "act", None, optional=True),
    ]


def _buffer_args(u_cache, v_cache, k_cache, g_cache, beta_cache, cursor, shadow, cursor_dims=("slots",)) -> list:
    return [
        Arg("u_cache", u_cache, ("slots", "heads_v", "L", "V"), F32, VECTOR_BYTES),  # cp.async tiles
        Arg("v_cache", v_cache, ("slots", "heads_v", "L", "V"), "act", VECTOR_BYTES),  # cp.async tiles (flush)
        Arg("k_cache", k_cache, ("slots", "heads_k", "L", "K"), F32, VECTOR_BYTES),
        Arg("g_cache", g_cache, ("slots", "heads_v", "L"), F32, None),
        Arg("beta_cache", beta_cache, ("slots", "heads_v", "L"), F32, None),
        Arg("cursor", cursor, cursor_dims, I32, None),
        Arg("shadow", shadow, ("slots", "heads_v", "V", "K"), _BF16, optional=True),
    ]


def _check_geometry(sizes: dict, q, v) -> None:
    H, HV = sizes["heads_k"], sizes["heads_v"]
    if H < 1 or HV % H:
        raise ValueError(f"q: key heads H={H} (dim 1) must divide value heads HV={HV} (v, dim 1)")
    for lab, name, t, dim in (("K", "q", q, 2), ("V", "v", v, 2)):
        if sizes[lab] not in GDN_SUPPORTED_DIMS:
            raise ValueError(f"{name}: {lab} (dim {dim}) expected one of {GDN_SUPPORTED_DIMS}, got {t.shape[dim]}")


def gdn_conventional_step(q, k, v, a, b, A_log, dt_bias, state, state_batch_indices, out=None, use_qk_l2norm=True,
                          scale=None, check_values: bool | None = None):
    """One conventional GDN decode step (reads and writes the whole state); returns y (batch, HV, V).

    :func:`.reference.conventional_step` is the spec: S <- exp(g) S; u = beta (v - S k);
    S <- S + u k^T; y = S q, with q, k l2-normalised (``use_qk_l2norm``) and q scaled by ``scale``."""
    _check_options(use_qk_l2norm, scale)
    batch, H, HV, V, K, S, _ = _geometry(q, v, state)
    sizes, dev = check_args(_step_args(q, k, v, a, b, A_log, dt_bias, state, state_batch_indices, out))
    _check_geometry(sizes, q, v)
    if values_checked(check_values):
        check_indices(state_batch_indices, S, None, 1)
    require_cuda(q, "q")
    y = torch.empty_like(v) if out is None else out
    if batch == 0:
        return y
    spec = gdn_spec(DTYPE_CODES[q.dtype], HV, H, V, K, 1, batch, False, "none", use_qk_l2norm, scale, arch(dev))
    args = [t.data_ptr() for t in (q, k, v, a, b, A_log, dt_bias, state_batch_indices, state)]
    args += [np.int32(batch), np.int32(S), y.data_ptr(), state.data_ptr()]
    launch(spec, "gdn_conventional", dev, spec.grid(batch), (spec.threads, 1, 1), args)
    return y


def gdn_replay_decode(q, k, v, a, b, A_log, dt_bias, state, u_cache, v_cache, k_cache, g_cache, beta_cache, cursor,
                      state_batch_indices, out=None, shadow=None, use_qk_l2norm=True, scale=None,
                      check_values: bool | None = None, row_order=None):
    """One fused ReplaySSM GDN decode step for one layer; returns y (batch, HV, V).

    :func:`.reference.replay_decode` is the spec. Non-flush step (cursor + 1 < L): y from the
    checkpoint (or its bf16 ``shadow``) and the buffered u_j, the entry (u, v, k, g, beta) appended at
    index cursor. Flush step (cursor + 1 == L): the fp32 checkpoint becomes the exact fold of the L - 1
    buffered (v_j, k_j, g_j, beta_j) and this token, the shadow is rewritten from it, the buffers are
    not written. The cursor is read, not moved: call :func:`advance_cursor` once per model step. The
    shadow must hold the checkpoint's values (bf16, round to nearest even) when the call starts.

    ``row_order`` (batch, 4) int32: the rows as (row, slot, cursor, 0) in flush-first order
    (:func:`trtllm_replayssm.cursor_ops.flush_order`, once per model step for all layers); the module built for it
    reads each block's row, slot and cursor there in one load. Every output is what the call without it computes; checked
    (``check_values``) to be a permutation of the rows with their slots."""
    _check_options(use_qk_l2norm, scale)
    batch, H, HV, V, K, S, L = _geometry(q, v, state, u_cache)
    sizes, dev = check_args(_step_args(q, k, v, a, b, A_log, dt_bias, state, state_batch_indices, out)
                             + _buffer_args(u_cache, v_cache, k_cache, g_cache, beta_cache, cursor, shadow)
                             + [row_order_arg(row_order)])
    _check_geometry(sizes, q, v)
    if values_checked(check_values):
        check_indices(state_batch_indices, S, cursor, L, row_order)
    require_cuda(q, "q")
    y = torch.empty_like(v) if out is None else out
    if batch == 0:
        return y
    kind = "none" if shadow is None else "bf16"
    spec = gdn_spec(DTYPE_CODES[q.dtype], HV, H, V, K, L, batch, True, kind, use_qk_l2norm, scale, arch(dev),
                    row_order=row_order is not None)
    bufs = [t.data_ptr() for t in (state, u_cache, v_cache, k_cache, g_cache, beta_cache)]
    sh = [] if shadow is None else [shadow.data_ptr()]
    rows = state_batch_indices if row_order is None else row_order
    args = [t.data_ptr() for t in (q, k, v, a, b, A_log, dt_bias, rows, cursor)]
    args += bufs + sh + [np.int32(batch), np.int32(S), y.data_ptr()] + bufs + sh
    launch(spec, "gdn_replay_decode", dev, spec.grid(batch), (spec.threads, 1, 1), args)
    return y


def advance_cursor(cursor, state_batch_indices, u_cache, check_values: bool | None = None) -> None:
    """cursor[slot] = (cursor[slot] + 1) % L for every row with a slot (the Mamba-2 cursor kernel);
    L is u_cache's buffer length (dim 2)."""
    check_rank(u_cache, "u_cache", 4, "(slots, HV, L, V)")
    cursor_ops.advance_cursor(cursor, state_batch_indices, buffer_len=u_cache.shape[2], check_values=check_values)


# ---- speculative decoding -------------------------------------------------------------------------------
def _spec_geometry(q, v, state, u_cache=None):
    """(batch, T, H, HV, V, K, S, L) of a speculative GDN call (L None without u_cache)."""
    check_rank(q, "q", 4, "(batch, T, H, K)")
    check_rank(v, "v", 4, "(batch, T, HV, V)")
    check_rank(state, "state", 4, "(slots, HV, V, K)")
    batch, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    S = state.shape[0]
    if T not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"q: expected T = 1 + num_draft (dim 1) in {SUPPORTED_NUM_TOKENS}, got {T}")
    L = None
    if u_cache is not None:
        check_rank(u_cache, "u_cache", 4, "(slots, HV, L, V)")
        L = u_cache.shape[2]
        check_window(T, L, "u_cache: buffer length L (dim 2)")
    return batch, T, H, HV, V, K, S, L


def _check_spec_geometry(sizes: dict, q, v) -> None:
    H, HV = sizes["heads_k"], sizes["heads_v"]
    if H < 1 or HV % H:
        raise ValueError(f"q: key heads H={H} (dim 2) must divide value heads HV={HV} (v, dim 2)")
    for lab, name, t in (("K", "q", q), ("V", "v", v)):
        if sizes[lab] not in GDN_SUPPORTED_DIMS:
            raise ValueError(f"{name}: {lab} (dim 3) expected one of {GDN_SUPPORTED_DIMS}, got {t.shape[3]}")


def gdn_replay_verify(q, k, v, a, b, A_log, dt_bias, state, u_cache, v_cache, k_cache, g_cache, beta_cache, cursor,
                      state_batch_indices, out=None, shadow=None, use_qk_l2norm=True, scale=None,
                      check_values: bool | None = None):
    """Verify the T tokens of a speculative window for one GDN layer; returns y (batch, T, HV, V).

    :func:`.reference.verify` after :func:`.reference.flush_checkpoint` and
    :func:`trtllm_replayssm.cursor.flush_cursor` is the spec. Where count + 2T > L (on the cursor as given) the
    committed entries are first folded exactly (from v_j, k_j, g_j, beta_j and the fp32 checkpoint) into
    ``state`` (and the bf16 ``shadow`` rewritten from it), and the window is computed from the folded
    checkpoint; elsewhere from the checkpoint (or the shadow) and the committed u_j. The window entries
    (u_t, v_t, k_t, g_t, beta_t) are appended at ring index (start + count + t) % L. The cursor is read,
    not moved: call :func:`gdn_spec_commit` (or :func:`trtllm_replayssm.cursor_ops.spec_commit`) once per model step."""
    _check_options(use_qk_l2norm, scale)
    batch, T, H, HV, V, K, S, L = _spec_geometry(q, v, state, u_cache)
    sizes, dev = check_args(_step_args(q, k, v, a, b, A_log, dt_bias, state, state_batch_indices, out, ("batch", "T"))
                             + _buffer_args(u_cache, v_cache, k_cache, g_cache, beta_cache, cursor, shadow, ("slots", 2)))
    _check_spec_geometry(sizes, q, v)
    if values_checked(check_values):
        check_spec_values(state_batch_indices, S, T, cursor, L)
    require_cuda(q, "q")
    y = torch.empty_like(v) if out is None else out
    if batch == 0:
        return y
    kind = "none" if shadow is None else "bf16"
    spec = gdn_spec(DTYPE_CODES[q.dtype], HV, H, V, K, L, batch, True, kind, use_qk_l2norm, scale, arch(dev), T)
    bufs = [t.data_ptr() for t in (state, u_cache, v_cache, k_cache, g_cache, beta_cache)]
    sh = [] if shadow is None else [shadow.data_ptr()]
    args = [t.data_ptr() for t in (q, k, v, a, b, A_log, dt_bias, state_batch_indices, cursor)]
    args += bufs + sh + [np.int32(batch), np.int32(S), y.data_ptr()] + bufs + sh
    launch(spec, "gdn_verify", dev, spec.grid(batch), (spec.threads, 1, 1), args)
    return y


def gdn_spec_commit(cursor, n_accepted, state_batch_indices, num_tokens: int, u_cache,
                    check_values: bool | None = None) -> None:
    """Commit n_accepted[row] window tokens (in place, once per model step for all layers): the Mamba-2
    ``replayssm_spec_commit`` kernel through :func:`trtllm_replayssm.cursor_ops.spec_commit`, L from u_cache (dim 2)."""
    check_rank(u_cache, "u_cache", 4, "(slots, HV, L, V)")
    cursor_ops.spec_commit(cursor, n_accepted, state_batch_indices, num_tokens, buffer_len=u_cache.shape[2],
                    check_values=check_values)


_SNAPSHOT_DIMS = ("slots", "T", "heads_v", "V", "K")


def gdn_native_spec_verify(q, k, v, a, b, A_log, dt_bias, state, snapshots, state_batch_indices, out=None,
                           use_qk_l2norm=True, scale=None, check_values: bool | None = None):
    """Native-spec baseline: the conventional recurrence over the T window tokens from state[slot] (read
    only); snapshots[slot, t] = state after token t; returns y (batch, T, HV, V).
    :func:`.reference.native_spec_verify` is the spec (with T_max = T)."""
    _check_options(use_qk_l2norm, scale)
    batch, T, H, HV, V, K, S, _ = _spec_geometry(q, v, state)
    check_rank(snapshots, "snapshots", 5, "(slots, T, HV, V, K)")
    sizes, dev = check_args(_step_args(q, k, v, a, b, A_log, dt_bias, state, state_batch_indices, out, ("batch", "T"))
                             + [Arg("snapshots", snapshots, _SNAPSHOT_DIMS, F32)])
    _check_spec_geometry(sizes, q, v)
    if values_checked(check_values):
        check_spec_values(state_batch_indices, S, T)
    require_cuda(q, "q")
    y = torch.empty_like(v) if out is None else out
    if batch == 0:
        return y
    spec = gdn_spec(DTYPE_CODES[q.dtype], HV, H, V, K, 2 * T, batch, False, "none", use_qk_l2norm, scale,
                    arch(dev), T)
    args = [t.data_ptr() for t in (q, k, v, a, b, A_log, dt_bias, state_batch_indices, state)]
    args += [np.int32(batch), np.int32(S), y.data_ptr(), snapshots.data_ptr()]
    launch(spec, "gdn_native_verify", dev, spec.grid(batch), (spec.threads, 1, 1), args)
    return y


def gdn_native_spec_commit(state, snapshots, n_accepted, state_batch_indices, check_values: bool | None = None) -> None:
    """Native-spec baseline commit: state[slot] = snapshots[slot, n - 1] for rows with n >= 1 (a state copy).
    The Mamba-2 ``replayssm_native_commit`` kernel through :func:`trtllm_replayssm.cursor_ops.native_spec_commit`: it copies whole
    (HV, V, K) f32 states in 16-byte vectors, whatever the trailing dims mean."""
    check_rank(state, "state", 4, "(slots, HV, V, K)")
    check_rank(snapshots, "snapshots", 5, "(slots, T, HV, V, K)")
    check_rank(state_batch_indices, "state_batch_indices", 1, "(batch,)")
    _, dev = check_args([
        Arg("state", state, ("slots", "heads_v", "V", "K"), F32),
        Arg("snapshots", snapshots, _SNAPSHOT_DIMS, F32),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        Arg("n_accepted", n_accepted, ("batch",), I32, None),
    ])
    if snapshots.shape[1] not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"snapshots: expected T (dim 1) in {SUPPORTED_NUM_TOKENS}, got {snapshots.shape[1]}")
    for lab, dim in (("V", 2), ("K", 3)):
        if state.shape[dim] not in GDN_SUPPORTED_DIMS:
            raise ValueError(f"state: {lab} (dim {dim}) expected one of {GDN_SUPPORTED_DIMS}, got {state.shape[dim]}")
    S, HV, V, K = state.shape
    if V not in SUPPORTED_HEADDIM or K not in SUPPORTED_DSTATE:
        # The copy kernel is built for the Mamba-2 module's (headdim, dstate); a slot's state is HV*V*K contiguous
        # f32 (checked above), a multiple of 64 x 64 for every GDN dim, so copy it as (HV*V*K / 4096, 64, 64) rows.
        state = state.view(S, HV * V * K // 4096, 64, 64)
        snapshots = snapshots.view(*snapshots.shape[:2], HV * V * K // 4096, 64, 64)
    cursor_ops.native_spec_commit(state, snapshots, n_accepted, state_batch_indices, check_values=check_values)


__all__ = ["gdn_conventional_step", "gdn_replay_decode", "advance_cursor", "gdn_replay_verify", "gdn_spec_commit",
           "gdn_native_spec_verify", "gdn_native_spec_commit"]
