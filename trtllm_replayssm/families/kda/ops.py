# SPDX-License-Identifier: Apache-2.0
"""Validated launchers of the KDA decode kernels (``plugins/kda/kda_decode.cu``) on torch tensors.

The math and the state contract are :mod:`.reference`'s (the float64 spec); the checks are :mod:`...launch`'s, so
errors read as every family's: the tensor named, got and expected, before any launch.

Shapes (batch rows, H heads, K key dim, V value dim, L ring length, S slots):

=====================  ====================  =================  ==========================================
tensor                 shape                 dtype              mutated
=====================  ====================  =================  ==========================================
q, k                   (batch, H, K)         act (bf16/f16/f32) (raw; l2-normalised inside when asked)
v                      (batch, H, V)         act
f                      (batch, H, K)         act                (raw forget-gate projection f_b(f_a(x)))
b                      (batch, H)            act                (raw beta logit: beta = sigmoid(b) inside)
A_log                  (H,)                  f32
dt_bias                (H, K)                f32
state                  (S, H, K, V)          f32                conventional: always; replay: on flush
k_cache                (S, H, L, K)          act                replay: raw k appended at cursor
u_cache                (S, H, L, V)          f32 / bf16         replay: u appended at cursor (bf16 with a shadow)
g_cache                (S, H, L, K)          f32                replay: per-channel log decay appended
v_cache                (S, H, L, V)          act                replay: v appended at cursor
beta_cache             (S, H, L)             f32                replay: beta appended at cursor
cursor                 (S,)                  int32              by :func:`advance_cursor` only
shadow (optional)      (S, H, K, V)          bf16               replay: on flush; read on the other steps
state_batch_indices    (batch,)              int32              slot per row, -1 = padding
y (output)             (batch, H, V)         act                padding rows left untouched
=====================  ====================  =================  ==========================================

Gates: Kimi's g = -exp(A_log) softplus(f + dt_bias) (``lower_bound`` None) or GLM-5 Next's
g = lower_bound sigmoid(exp(A_log) (f + dt_bias)); ``use_qk_l2norm``, ``scale`` (default K^-1/2) and
``lower_bound`` are compiled into the module (its cache key). 2 <= L <= 16; K a multiple of 16 up to 256; V a
multiple of 8. state, shadow (16-byte vectors) and the row-major tensors are contiguous. Values (``check_values``;
default unless capturing a CUDA graph; a device->host copy): slots in [-1, S), no slot in two rows, the rows'
cursors in [0, L). Unchecked, the kernels write nothing outside a row's own slot: a row with an out-of-range slot
is skipped, one with an out-of-range cursor gets NaN outputs and leaves state and rings as they are.

Per model step: :func:`kda_replay_decode` for every KDA layer, then one :func:`advance_cursor` (the shared cursor
kernel, :func:`trtllm_replayssm.cursor_ops.advance_cursor`).

Speculative decoding (T = 1 + num_draft tokens a window, ``plugins/kda/kda_spec.cu``; the ring cursor and "flush
one window early" of every family, :mod:`trtllm_replayssm.families.mamba2.spec_reference`): q, k, f (batch, T, H, K), v (batch, T,
H, V), b (batch, T, H), y (batch, T, H, V); cursor (S, 2) int32 (ring start, committed count), read by
:func:`kda_replay_verify`, moved by :func:`kda_spec_commit`; T in ``SUPPORTED_NUM_TOKENS`` with 2 T <= L <= 16.
Values (``check_values``): start in [0, L) and count in [0, L - T] for the rows' slots. Per model step:
:func:`kda_replay_verify` for every KDA layer, then one :func:`kda_spec_commit` (the shared
``replayssm_spec_commit`` kernel: the flush the verify kernels did, then count += n_accepted).
"""

from __future__ import annotations

import numpy as np
import torch

from ... import cursor_ops
from ...config import DTYPE_CODES, SUPPORTED_NUM_TOKENS
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
    launch,
    require_cuda,
    row_order_arg,
    sm_count,
    values_checked,
)
from .config import BULK_KERNEL_NAME, BULK_REPLAY_KERNEL_NAME, kda_spec

_BF16 = (torch.bfloat16,)


def _check_options(use_qk_l2norm, scale, lower_bound) -> None:
    check_flag(use_qk_l2norm, "use_qk_l2norm")
    check_float(scale, "scale", lambda x: x > 0, "a finite positive float or None (K^-1/2)")
    check_float(lower_bound, "lower_bound", lambda x: x < 0, "a finite negative float or None (Kimi's gate)")


def _geometry(q, v, state, u_cache=None, state_dims=("slots", "H", "K", "V")):
    check_rank(q, "q", 3, "(batch, H, K)")
    check_rank(v, "v", 3, "(batch, H, V)")
    check_rank(state, "state", 4, "(" + ", ".join(state_dims) + ")")
    batch, H, K = q.shape
    V, S = v.shape[2], state.shape[0]
    L = None
    if u_cache is not None:
        check_rank(u_cache, "u_cache", 4, "(slots, H, L, V)")
        L = u_cache.shape[2]
        if not 2 <= L <= 16:
            raise ValueError(f"u_cache: ring length L (dim 2) must be in 2..16, got {L}")
    return batch, H, K, V, S, L


def _check_sizes(given, shapes, sizes) -> None:
    K, V = sizes.get("K"), sizes.get("V")
    if K is not None and (K % 16 or not 16 <= K <= 256):
        raise ValueError(f"q: K (last dim) expected a multiple of 16 in 16..256, got {K}")
    if V is not None and V % 8:
        raise ValueError(f"v: V (last dim) expected a multiple of 8, got {V}")


def _step_args(q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out, lead=("batch",),
               state_dims=("slots", "H", "K", "V")) -> list:
    return [
        Arg("q", q, (*lead, "H", "K"), "act", None),
        Arg("k", k, (*lead, "H", "K"), "act", None),
        Arg("v", v, (*lead, "H", "V"), "act", None),
        Arg("f", f, (*lead, "H", "K"), "act", None),
        Arg("b", b, (*lead, "H"), "act", None),
        Arg("A_log", A_log, ("H",), F32, None),
        Arg("dt_bias", dt_bias, ("H", "K"), F32, None),
        Arg("state", state, state_dims, F32),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        Arg("out", out, (*lead, "H", "V"), "act", None, optional=True),
    ]


def _ring_args(k_cache, u_cache, g_cache, v_cache, beta_cache, cursor, shadow, cursor_dims=("slots",),
               shadow_dims=("slots", "H", "K", "V")) -> list:
    return [
        Arg("k_cache", k_cache, ("slots", "H", "L", "K"), "act", VECTOR_BYTES),  # cp.async (the non-flush step)
        # config.RING_TYPES; 16-byte aligned: the u-sum flush stages its tiles by cp.async
        Arg("u_cache", u_cache, ("slots", "H", "L", "V"), F32 if shadow is None else _BF16, VECTOR_BYTES),
        Arg("g_cache", g_cache, ("slots", "H", "L", "K"), F32, VECTOR_BYTES),  # cp.async (the non-flush step)
        Arg("v_cache", v_cache, ("slots", "H", "L", "V"), "act", None),
        Arg("beta_cache", beta_cache, ("slots", "H", "L"), F32, None),
        Arg("cursor", cursor, cursor_dims, I32, None),
        Arg("shadow", shadow, shadow_dims, _BF16, optional=True),
    ]


def kda_conventional_step(q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out=None, use_qk_l2norm=True,
                          scale=None, lower_bound=None, check_values: bool | None = None):
    """One conventional KDA decode step (reads and writes the whole state); returns y (batch, H, V).

    :func:`.reference.conventional_step` is the spec: S <- Diag(exp g) S; u = beta (v - S^T k); S <- S + k u^T;
    y = S^T q."""
    _check_options(use_qk_l2norm, scale, lower_bound)
    batch, H, K, V, S, _ = _geometry(q, v, state)
    return _launch_conventional(
        "kda_conventional", lambda act, sm: kda_spec(act, H, K, V, 2, batch, "none", use_qk_l2norm, scale, lower_bound,
                                                     sm, conventional=True),
        q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out, check_values)


def _launch_conventional(kernel, make_spec, q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out,
                         check_values, state_dims=("slots", "H", "K", "V")):
    """Check and launch one conventional step's kernel (``kda_conventional`` or the (V, K) experiment's,
    vk.py): ``make_spec(act, arch)`` gives its module."""
    batch, S = q.shape[0], state.shape[0]
    _, dev = check_args(_step_args(q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out,
                                   state_dims=state_dims), _check_sizes)
    if values_checked(check_values):
        check_indices(state_batch_indices, S, None, 1)
    require_cuda(q, "q")
    y = torch.empty_like(v) if out is None else out
    if batch == 0:
        return y
    spec = make_spec(DTYPE_CODES[q.dtype], arch(dev))
    args = [t.data_ptr() for t in (q, k, v, f, b, A_log, dt_bias, state_batch_indices, state)]
    args += [np.int32(batch), np.int32(S), y.data_ptr(), state.data_ptr()]
    if getattr(spec, "bulk", False):  # the persistent stream (config.override(bulk=True))
        _launch_stream(spec, BULK_KERNEL_NAME, dev, batch, q, k, f, args)
        return y
    launch(spec, kernel, dev, spec.grid(batch), (spec.threads, 1, 1), args)
    return y


def _launch_stream(spec, kernel, dev, batch, q, k, f, args, shmem: int = 0) -> None:
    """Launch one of the persistent streams (KDASpec.bulk) over the card's resident blocks. They stage q, k and f by
    16-byte cp.async (the state and the rings: their Args check them)."""
    for name, t in (("q", q), ("k", k), ("f", f)):
        if t.data_ptr() % VECTOR_BYTES:
            raise ValueError(f"{name}: expected a {VECTOR_BYTES}-byte aligned data pointer (the bulk stream stages it "
                             f"by cp.async), got {t.data_ptr():#x}")
    launch(spec, kernel, dev, spec.bulk_grid(batch, sm_count(dev.index)), (spec.threads, 1, 1), args, shmem=shmem)


def _check_replay(q, k, v, f, b, A_log, dt_bias, state, k_cache, u_cache, g_cache, v_cache, beta_cache, cursor,
                  state_batch_indices, out, shadow, use_qk_l2norm, scale, lower_bound, check_values,
                  state_dims=("slots", "H", "K", "V"), row_order=None):
    """The checks of one standard decode call, before any launch (the options; shapes and dtypes by name; the rows'
    slots and cursors unless ``check_values`` is off), shared by :func:`kda_replay_decode` and the (V, K) step
    (vk.py: ``state_dims`` (slots, H, V, K), the shadow's too). Returns (batch, H, K, V, S, L, device, y)."""
    _check_options(use_qk_l2norm, scale, lower_bound)
    batch, H, K, V, S, L = _geometry(q, v, state, u_cache, state_dims)
    _, dev = check_args(_step_args(q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out,
                                   state_dims=state_dims)
                        + _ring_args(k_cache, u_cache, g_cache, v_cache, beta_cache, cursor, shadow,
                                     shadow_dims=state_dims)
                        + [row_order_arg(row_order)], _check_sizes)
    if values_checked(check_values):
        check_indices(state_batch_indices, S, cursor, L, row_order)
    require_cuda(q, "q")
    return batch, H, K, V, S, L, dev, torch.empty_like(v) if out is None else out


def kda_replay_decode(q, k, v, f, b, A_log, dt_bias, state, k_cache, u_cache, g_cache, v_cache, beta_cache, cursor,
                      state_batch_indices, out=None, shadow=None, use_qk_l2norm=True, scale=None, lower_bound=None,
                      check_values: bool | None = None, row_order=None):
    """One fused ReplaySSM KDA decode step for one layer; returns y (batch, H, V).

    :func:`.reference.replay_decode` is the spec. Non-flush step (cursor + 1 < L): y from the checkpoint (or its
    bf16 ``shadow``) and the ring, the entry (k raw, u, g, v, beta) appended at index cursor. Flush step
    (cursor + 1 == L): the fp32 checkpoint becomes the exact fold of the L - 1 ring entries and this token, the
    shadow is rewritten from it, the rings are not written. The cursor is read, not moved: call
    :func:`advance_cursor` once per model step. The shadow must hold the checkpoint's values (bf16, round to
    nearest even) when the call starts.

    ``row_order`` (batch, 4) int32: the step's rows as (row, slot, cursor, 0) in the order the blocks take them,
    :func:`trtllm_replayssm.cursor_ops.flush_order`'s flush-first order (once per model step for all layers); the
    module built for it reads each block's row, slot and cursor there in one load, instead of ``state_batch_indices``
    and ``cursor``. Every output is
    what the call without it computes; checked (``check_values``) to be a permutation of the rows with their slots."""
    batch, H, K, V, S, L, dev, y = _check_replay(q, k, v, f, b, A_log, dt_bias, state, k_cache, u_cache, g_cache,
                                                 v_cache, beta_cache, cursor, state_batch_indices, out, shadow,
                                                 use_qk_l2norm, scale, lower_bound, check_values,
                                                 row_order=row_order)
    if batch == 0:
        return y
    kind = "none" if shadow is None else "bf16"
    spec = kda_spec(DTYPE_CODES[q.dtype], H, K, V, L, batch, kind, use_qk_l2norm, scale, lower_bound, arch(dev),
                    row_order=row_order is not None)
    bufs = [t.data_ptr() for t in (state, k_cache, u_cache, g_cache, v_cache, beta_cache)]
    sh = [] if shadow is None else [shadow.data_ptr()]
    rows = state_batch_indices if row_order is None else row_order
    args = [t.data_ptr() for t in (q, k, v, f, b, A_log, dt_bias, rows, cursor)]
    args += bufs + sh + [np.int32(batch), np.int32(S), y.data_ptr()] + bufs + sh
    if spec.bulk:  # the decode step as a persistent stream (config.override(bulk=True)): an experiment
        if values_checked(check_values) and not spec.bulk_flush:
            live = state_batch_indices[state_batch_indices >= 0].long()
            if bool((cursor[live] == L - 1).any()):
                raise ValueError(f"cursor: the bulk stream (KDASpec.bulk) computes non-flush rows only (cursor < L - 1 "
                                 f"= {L - 1}); a row at the flush gets NaN y there (KDASpec.bulk_flush folds them)")
        _launch_stream(spec, BULK_REPLAY_KERNEL_NAME, dev, batch, q, k, f, args, spec.flush_tile_bytes)
        return y
    launch(spec, "kda_replay_decode", dev, spec.grid(batch), (spec.threads, 1, 1), args)
    return y


def advance_cursor(cursor, state_batch_indices, u_cache, check_values: bool | None = None) -> None:
    """cursor[slot] = (cursor[slot] + 1) % L for every row with a slot (the shared cursor kernel,
    :func:`trtllm_replayssm.cursor_ops.advance_cursor`); L is u_cache's ring length (dim 2)."""
    check_rank(u_cache, "u_cache", 4, "(slots, H, L, V)")
    cursor_ops.advance_cursor(cursor, state_batch_indices, buffer_len=u_cache.shape[2], check_values=check_values)


# ---- speculative decoding -------------------------------------------------------------------------------------
def _spec_geometry(q, v, state, u_cache):
    """(batch, T, H, K, V, S, L) of a verify call."""
    check_rank(q, "q", 4, "(batch, T, H, K)")
    check_rank(v, "v", 4, "(batch, T, H, V)")
    check_rank(state, "state", 4, "(slots, H, K, V)")
    check_rank(u_cache, "u_cache", 4, "(slots, H, L, V)")
    batch, T, H, K = q.shape
    V, S, L = v.shape[3], state.shape[0], u_cache.shape[2]
    if T not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"q: expected T = 1 + num_draft (dim 1) in {SUPPORTED_NUM_TOKENS}, got {T}")
    if not 2 * T <= L <= 16:
        raise ValueError(f"u_cache: ring length L (dim 2) expected in [2T, 16] = [{2 * T}, 16] (flush one window "
                         f"early, T={T}), got {L}")
    return batch, T, H, K, V, S, L


def kda_replay_verify(q, k, v, f, b, A_log, dt_bias, state, k_cache, u_cache, g_cache, v_cache, beta_cache, cursor,
                      state_batch_indices, out=None, shadow=None, use_qk_l2norm=True, scale=None, lower_bound=None,
                      check_values: bool | None = None):
    """Verify the T tokens of a speculative window for one KDA layer; returns y (batch, T, H, V).

    :func:`.reference.flush_checkpoint`, :func:`..flush_cursor` then :func:`.reference.verify` is the spec. Where
    count + 2T > L (on the cursor as given) the committed entries are first folded exactly (from k_j, v_j, g_j,
    beta_j and the fp32 checkpoint) into ``state`` (and the bf16 ``shadow`` rewritten from it), and the window is
    computed from the folded checkpoint; elsewhere from the checkpoint (or its ``shadow``) and the committed u_j.
    The window entries (k raw, u, g, v, beta) are appended at ring index (start + count + t) % L. The cursor is
    read, not moved: call :func:`kda_spec_commit` once per model step."""
    _check_options(use_qk_l2norm, scale, lower_bound)
    batch, T, H, K, V, S, L = _spec_geometry(q, v, state, u_cache)
    _, dev = check_args(_step_args(q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out, ("batch", "T"))
                        + _ring_args(k_cache, u_cache, g_cache, v_cache, beta_cache, cursor, shadow, ("slots", 2)),
                        _check_sizes)
    if values_checked(check_values):
        check_spec_values(state_batch_indices, S, T, cursor, L)
    require_cuda(q, "q")
    y = torch.empty_like(v) if out is None else out
    if batch == 0:
        return y
    kind = "none" if shadow is None else "bf16"
    spec = kda_spec(DTYPE_CODES[q.dtype], H, K, V, L, batch, kind, use_qk_l2norm, scale, lower_bound, arch(dev),
                    num_tokens=T)
    bufs = [t.data_ptr() for t in (state, k_cache, u_cache, g_cache, v_cache, beta_cache)]
    sh = [] if shadow is None else [shadow.data_ptr()]
    args = [t.data_ptr() for t in (q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor)]
    args += bufs + sh + [np.int32(batch), np.int32(S), y.data_ptr()] + bufs + sh
    launch(spec, "kda_verify", dev, spec.grid(batch), (spec.threads, 1, 1), args)
    return y


def kda_spec_commit(cursor, n_accepted, state_batch_indices, num_tokens: int, u_cache,
                    check_values: bool | None = None) -> None:
    """Commit n_accepted[row] window tokens (in place, once per model step for every layer): the shared
    ``replayssm_spec_commit`` kernel through :func:`trtllm_replayssm.cursor_ops.spec_commit`, L from u_cache (dim 2)."""
    check_rank(u_cache, "u_cache", 4, "(slots, H, L, V)")
    cursor_ops.spec_commit(cursor, n_accepted, state_batch_indices, num_tokens, buffer_len=u_cache.shape[2],
                     check_values=check_values)


__all__ = ["kda_conventional_step", "kda_replay_decode", "advance_cursor", "kda_replay_verify", "kda_spec_commit"]
