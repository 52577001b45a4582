# SPDX-License-Identifier: Apache-2.0
"""The cursor kernels' launchers every family's cache shares, and the torch.library custom ops that wrap them.

:func:`advance_cursor` (the standard cursor's move, once per model step for all layers of every family),
:func:`spec_commit` (the ring cursor's flush and commit, once per speculative step) and :func:`native_spec_commit`
(the native-spec baseline's snapshot copy, any (slots, a, b, c) state) follow the host rules of :mod:`.cursor`
bit for bit. Their kernels are entry points of the Mamba-2 modules (``plugins/mamba2/replayssm_decode.cu``,
``replayssm_spec.cu``: any spec with the right L / T carries them), so the specs and the tensor checks come from
:mod:`.families.mamba2.ops` (whose module docstring tabulates every tensor, cursor ones included); Gated DeltaNet's
and KDA's caches call them unchanged. Checked once here before launch (errors name the tensor, got / expected;
values unless capturing a CUDA graph), launched on torch's current stream (CUDA-graph safe).

Importing this module registers ``torch.ops.trtllm_replayssm.advance_cursor`` / ``spec_commit`` /
``native_spec_commit`` (and, through :mod:`.families.mamba2.ops`, the Mamba-2 step ops).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .config import (
    COMMIT_THREADS,
    ORDER_THREADS,
    SUPPORTED_NUM_TOKENS,
    commit_grid,
    commit_spec,
    cursor_spec,
    spec_grid,
)
from .cursor import ORDER_COLUMNS
from .families.mamba2.ops import _SNAPSHOT_DIMS, _checked, make_verify_spec
from .launch import (
    I32,
    Arg,
    arch,
    check_indices,
    check_rank,
    check_spec_values,
    check_window,
    launch,
    require_cuda,
    row_order_arg,
    values_checked,
)


def _buffer_len(buffer_len, x_cache) -> tuple[int, str]:
    """(L, the argument it came from) of a cursor op: x_cache's buffer length (dim 2) when x_cache is
    given, which a buffer_len given as well must equal; else buffer_len."""
    if buffer_len is not None and (isinstance(buffer_len, bool) or not isinstance(buffer_len, numbers.Integral)):
        raise TypeError(f"buffer_len: expected an int, got {type(buffer_len).__name__}")
    if x_cache is None:
        if buffer_len is None:
            raise TypeError("buffer_len: expected an int, or x_cache to take it from; got neither")
        return int(buffer_len), "buffer_len"
    check_rank(x_cache, "x_cache", 4, "(slots, nheads, buffer_len, headdim)")
    L = x_cache.shape[2]
    if buffer_len is not None and buffer_len != L:
        raise ValueError(f"buffer_len: expected {L} (the buffer length of x_cache, dim 2), got {buffer_len}")
    return L, "x_cache: buffer_len (dim 2)"


def advance_cursor(cursor, state_batch_indices, buffer_len: int | None = None, check_values: bool | None = None,
                   x_cache=None, flushes=None) -> None:
    """cursor[slot] = (cursor[slot] + 1) % L for every row with a slot, on the GPU (in place).

    cursor (slots,) int32, mutated; state_batch_indices (batch,) int32. L: x_cache's buffer length
    (dim 2) when the (slots, nheads, L, headdim) ring of any layer is given (then ``buffer_len``, if
    given too, must equal it), else ``buffer_len``. ``check_values`` (default: unless capturing a
    graph): slots in [-1, slots), no slot in two rows, the rows' cursors in [0, L). Unchecked, the
    kernel skips out-of-range slots and leaves a cursor outside [0, L) as it is. ``flushes`` (slots,) int32 (an
    8-bit checkpoint's ``ckpt_flushes``, shared by its layers): flushes[slot] += 1 where the cursor wraps.
    """
    L, what = _buffer_len(buffer_len, x_cache)
    if not 1 <= L <= 32:
        raise ValueError(f"{what}: expected in 1..32, got {L}")
    check_rank(cursor, "cursor", 1, "(slots,)")
    check_rank(state_batch_indices, "state_batch_indices", 1, "(batch,)")
    _, dev = _checked([
        Arg("cursor", cursor, ("slots",), I32, None),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        Arg("x_cache", x_cache, ("slots", "nheads", "buffer_len", "headdim"), "act", None, optional=True),
        Arg("flushes", flushes, ("slots",), I32, None, optional=True),
    ])
    S, batch = cursor.shape[0], state_batch_indices.shape[0]
    if values_checked(check_values):
        check_indices(state_batch_indices, S, cursor, L)
    require_cuda(cursor, "cursor")
    if batch == 0:
        return
    # An 8-bit checkpoint's module also counts the flushes.
    spec = cursor_spec(L, arch(dev), ckpt8=flushes is not None)
    launch(spec, "replayssm_advance_cursor", dev, ((batch + 255) // 256, 1, 1), (256, 1, 1),
           [state_batch_indices.data_ptr(), np.int32(batch), np.int32(S), cursor.data_ptr()]
           + ([] if flushes is None else [flushes.data_ptr()]))


def flush_order(cursor, state_batch_indices, buffer_len: int, out=None, check_values: bool | None = None):
    """The flush-first row order of one standard decode step, on the GPU: (batch, 4) int32 (row, slot, cursor, 0), the
    rows that flush in this step (cursor L - 1) first, then the other rows with a slot, then padding, each class in
    row order (:func:`.cursor.flush_order` is the spec, bit for bit). A decode module built with ``row_order``
    reads it in place of ``state_batch_indices``. Once per model step, after the previous step's cursor move, for
    all layers (their cursor is shared). ``out`` (batch, 4) int32 to write into (a graph's fixed buffer)."""
    if isinstance(buffer_len, bool) or not isinstance(buffer_len, numbers.Integral) or not 1 <= buffer_len <= 32:
        raise ValueError(f"buffer_len: expected an int in 1..32, got {buffer_len!r}")
    check_rank(cursor, "cursor", 1, "(slots,)")
    check_rank(state_batch_indices, "state_batch_indices", 1, "(batch,)")
    batch = state_batch_indices.shape[0]
    if out is None:
        out = torch.empty((batch, ORDER_COLUMNS), dtype=torch.int32, device=state_batch_indices.device)
    _, dev = _checked([
        Arg("cursor", cursor, ("slots",), I32, None),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        row_order_arg(out, "out"),
    ])
    S = cursor.shape[0]
    if values_checked(check_values):
        check_indices(state_batch_indices, S, cursor, buffer_len)
    require_cuda(cursor, "cursor")
    if batch == 0:
        return out
    launch(cursor_spec(int(buffer_len), arch(dev)), "replayssm_flush_order", dev, (1, 1, 1), (ORDER_THREADS, 1, 1),
           [state_batch_indices.data_ptr(), cursor.data_ptr(), np.int32(batch), np.int32(S), out.data_ptr()])
    return out


# ---- speculative decoding: the ring cursor's commit, the native-spec baseline's commit copy -----------------
def spec_commit(cursor, n_accepted, state_batch_indices, num_tokens: int, buffer_len: int | None = None,
                check_values: bool | None = None, x_cache=None) -> None:
    """Commit n_accepted[row] tokens of the window for every row with a slot, on the GPU (in place).

    Once per model step after sampling, shared by all layers: the flush the verify kernels did
    (count + 2T > L: start = (start + count) % L, count = 0), then count += n (n clamped to [0, T]
    on the device; checked on the host unless capturing a graph). cursor (slots, 2) int32, mutated;
    n_accepted and state_batch_indices (batch,) int32. L: x_cache's buffer length (dim 2) when the
    (slots, nheads, L, headdim) ring of any layer is given (``buffer_len``, if given too, must equal
    it), else ``buffer_len``. Unchecked, the kernel skips out-of-range slots and leaves a cursor out of
    range as it is.
    """
    if num_tokens not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"num_tokens: expected one of {SUPPORTED_NUM_TOKENS}, got {num_tokens}")
    L, what = _buffer_len(buffer_len, x_cache)
    check_window(num_tokens, L, what)
    if not isinstance(cursor, torch.Tensor):
        raise TypeError(f"cursor: expected a torch.Tensor, got {type(cursor).__name__}")
    if cursor.dim() != 2 or cursor.shape[1] != 2:
        raise ValueError(f"cursor: expected shape (slots, 2), got {tuple(cursor.shape)}")
    check_rank(state_batch_indices, "state_batch_indices", 1, "(batch,)")
    _, dev = _checked([
        Arg("cursor", cursor, ("slots", 2), I32, None),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        Arg("n_accepted", n_accepted, ("batch",), I32, None),
        Arg("x_cache", x_cache, ("slots", "nheads", "buffer_len", "headdim"), "act", None, optional=True),
    ])
    S, batch = cursor.shape[0], state_batch_indices.shape[0]
    if values_checked(check_values):
        check_spec_values(state_batch_indices, S, num_tokens, cursor, L, n_accepted)
    require_cuda(cursor, "cursor")
    if batch == 0:
        return
    spec = commit_spec(num_tokens, L, arch(dev))
    # TensorRT's order: inputs (the cursor is the aliased input of the in-place cursor output), int32s, outputs.
    launch(spec, "replayssm_spec_commit", dev, commit_grid(batch), (COMMIT_THREADS, 1, 1),
           [state_batch_indices.data_ptr(), n_accepted.data_ptr(), cursor.data_ptr(), np.int32(batch), np.int32(S),
            cursor.data_ptr()])


def native_spec_commit(state, snapshots, n_accepted, state_batch_indices, check_values: bool | None = None) -> None:
    """Native-spec baseline commit: state[slot] = snapshots[slot, n - 1] for rows with n >= 1 (a copy)."""
    check_rank(state, "state", 4, "(slots, nheads, headdim, dstate)")
    check_rank(snapshots, "snapshots", 5, "(slots, T, nheads, headdim, dstate)")
    check_rank(state_batch_indices, "state_batch_indices", 1, "(batch,)")
    S, H, P, N = state.shape
    T = snapshots.shape[1]
    if T not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"snapshots: expected T (dim 1) in {SUPPORTED_NUM_TOKENS}, got {T}")
    _, dev = _checked([
        Arg("state", state, ("slots", "nheads", "headdim", "dstate"), "state"),
        Arg("snapshots", snapshots, _SNAPSHOT_DIMS, "state"),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        Arg("n_accepted", n_accepted, ("batch",), I32, None),
    ])
    batch = state_batch_indices.shape[0]
    if values_checked(check_values):
        check_spec_values(state_batch_indices, S, T, n_accepted=n_accepted)
    require_cuda(state, "state")
    if batch == 0:
        return
    spec = make_verify_spec(state.dtype, state.dtype, H, P, N, 1, 2 * T, T, batch, False, dev)
    launch(spec, "replayssm_native_commit", dev, spec_grid(spec, batch), (spec.threads, 1, 1),
           [state_batch_indices.data_ptr(), n_accepted.data_ptr(), np.int32(batch), np.int32(S), snapshots.data_ptr(),
            state.data_ptr()])


# ---- torch.library custom ops (torch.compile / export see them as opaque, with fake shapes) --------
@torch.library.custom_op("trtllm_replayssm::advance_cursor", mutates_args=("cursor",))
def advance_cursor_op(cursor: torch.Tensor, state_batch_indices: torch.Tensor, buffer_len: int,
                      x_cache: torch.Tensor | None = None) -> None:
    advance_cursor(cursor, state_batch_indices, buffer_len, x_cache=x_cache)


@advance_cursor_op.register_fake
def _(cursor, state_batch_indices, buffer_len, x_cache=None):
    return None


@torch.library.custom_op("trtllm_replayssm::spec_commit", mutates_args=("cursor",))
def spec_commit_op(cursor: torch.Tensor, n_accepted: torch.Tensor, state_batch_indices: torch.Tensor, num_tokens: int,
                   buffer_len: int, x_cache: torch.Tensor | None = None) -> None:
    spec_commit(cursor, n_accepted, state_batch_indices, num_tokens, buffer_len, x_cache=x_cache)


@spec_commit_op.register_fake
def _(cursor, n_accepted, state_batch_indices, num_tokens, buffer_len, x_cache=None):
    return None


@torch.library.custom_op("trtllm_replayssm::native_spec_commit", mutates_args=("state",))
def native_spec_commit_op(state: torch.Tensor, snapshots: torch.Tensor, n_accepted: torch.Tensor,
                          state_batch_indices: torch.Tensor) -> None:
    native_spec_commit(state, snapshots, n_accepted, state_batch_indices)


@native_spec_commit_op.register_fake
def _(state, snapshots, n_accepted, state_batch_indices):
    return None
