# SPDX-License-Identifier: Apache-2.0
"""Mamba-2's validated launchers on torch tensors, and the torch.library custom ops that wrap them.

Every tensor is checked once, here, before launch (shape, dtype, device, contiguity; slot and
cursor ranges when not capturing a CUDA graph); errors name the tensor with what was expected and
what was given. Kernels are compiled by :mod:`.compile` (NVRTC) for the device's arch, loaded and
launched with ``cuda.core`` on torch's current stream, so the launches are CUDA-graph safe.
The cursor kernels every family shares (``advance_cursor``, ``spec_commit``, ``native_spec_commit``) are
launched by :mod:`trtllm_replayssm.cursor_ops`, with the rules below; the tables describe their tensors too.

Shapes (batch rows, H heads, P headdim, N dstate, G groups, L buffer length, S slots):

=====================  ==================  =================  ==========================
tensor                 shape               dtype              mutated
=====================  ==================  =================  ==========================
x, z (optional)        (batch, H, P)       act (bf16/f16/f32)
B, C                   (batch, G, N)       act
dt                     (batch, H)          act (raw; softplus(dt + dt_bias) inside)
dt_bias, A, D          (H,)                f32                (A = -exp(A_log))
state                  (S, H, P, N)        f32 / bf16 / f16   replay: on flush; conv: always
x_cache                (S, H, L, P)        act                replay (append)
B_cache                (S, G, L, N)        act                replay (append)
dt_cache               (S, H, L)           f32 (processed)    replay (append)
cursor                 (S,)                int32              by advance_cursor only
shadow (optional)      (S, H, P, N)        bf16 / fp8-e4m3fn  replay: on flush (needs an f32 state)
shadow_scale (fp8)     (S, H, P)           f32                replay: on flush (max |S[row]| / 448)
state_batch_indices    (batch,)            int32              slot per row, -1 = padding
y (output)             (batch, H, P)       act                padding rows left untouched
=====================  ==================  =================  ==========================

8-bit checkpoint (``state`` float8_e4m3fn; shadow.Checkpoint8; replay_decode only, staged kernel, no shadow):

=====================  ==================  =================  ==========================================
state                  (S, H, P, N)        float8_e4m3fn      on flush: q = SR(S / scale), seeded
ckpt_scale             (S, H, P)           f32                on flush: max |S[row]| / 448
ckpt_flushes           (S,)                int32              read on flush (the hash's flush count);
                                                              advance_cursor(flushes=) adds 1 at a wrap
ckpt_seed              int                                    the layer's seed (the hash has no layer)
=====================  ==================  =================  ==========================================

Speculative decoding (T = 1 + num_draft tokens per window; ring cursor, spec_reference.py):

=====================  ==================  =================  ==========================================
tensor                 shape               dtype              mutated
=====================  ==================  =================  ==========================================
x, z (optional)        (batch, T, H, P)    act
B, C                   (batch, T, G, N)    act
dt                     (batch, T, H)       act (raw)
state                  (S, H, P, N)        f32 / bf16 / f16   replay_verify: on flush (count + 2T > L);
                                                              native_spec_commit: snapshot n-1 copied in
x_cache, B_cache,      as above            as above           replay_verify: window appended at ring
dt_cache                                                      index (start + count + t) % L
cursor                 (S, 2)              int32              (start, count); by spec_commit only
shadow, shadow_scale   as above            as above           replay_verify: on flush; read on the other
                                                              steps instead of state (f32 state only)
n_accepted             (batch,)            int32              accepted tokens of the window, 0..T
snapshots              (S, T, H, P, N)     state dtype        native_spec_verify: state after token t
y (output)             (batch, T, H, P)    act                padding rows left untouched
=====================  ==================  =================  ==========================================
Needs L >= 2T. Per model step: replay_verify for every layer, then one spec_commit (the flush the
verify kernels did, start += count and count = 0 when count + 2T > L, then count += n_accepted).

Rules every launcher checks before a launch (TypeError / ValueError naming the tensor, got and expected):

- Sizes shared by several tensors (batch, T, nheads, headdim, dstate, ngroups, buffer_len, slots), their
  activation or state dtype and their device are those most of the tensors carrying them agree on, so
  an error names the tensor that differs, not the one it was compared with (x on the CPU next to CUDA
  tensors is reported as x). headdim in SUPPORTED_HEADDIM, dstate in SUPPORTED_DSTATE (config.py).
- x, z, B, C, state, shadow, shadow_scale, x_cache, B_cache and snapshots are moved in 16-byte vectors:
  their data pointers must be 16-byte aligned (a contiguous view at an odd offset would fault). The
  others are read as scalars and need only torch's element alignment.
- The buffer length of advance_cursor / spec_commit is x_cache's (dim 2) when x_cache is given (a
  buffer_len given as well must equal it): a cursor moved with another L than the rings' is corrupt.
- Values (``check_values``; default: unless capturing a CUDA graph; a device->host copy): slots in
  [-1, slots) and no slot in two rows, the rows' cursors and n_accepted in range. Unchecked, the
  kernels still write nothing outside a row's own slot: a row whose slot is out of range is skipped,
  a row whose cursor is out of range gets NaN outputs and leaves every state, ring and cursor as it is
  (advance_cursor and spec_commit do not move it), n_accepted is clamped to [0, T]; rows sharing a
  slot race on that slot only.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import torch

from ...config import (
    CKPT8,
    CKPT8_DTYPE,
    DTYPE_CODES,
    SHADOW_DTYPES,
    SUPPORTED_DSTATE,
    SUPPORTED_HEADDIM,
    SUPPORTED_NUM_TOKENS,
    KernelSpec,
    plan,
    spec_grid,
    verify_spec,
)
from ...launch import (
    F32,
    I32,
    Arg,
    arch,
    check_args,
    check_indices,
    check_rank,
    check_spec_values,
    check_window,
    launch,
    ptr,
    require_cuda,
    row_order_arg,
    sm_count,
    values_checked,
)


# ---- validation -----------------------------------------------------------------------------------
def _check_sizes(args: list, shapes: list, sizes: dict) -> None:
    """Agreed sizes no kernel supports (headdim, dstate: config.py; ngroups must divide nheads), named on
    the first tensor that holds them. The first tensor carrying ngroups (B) is checked with its own value
    too: a B whose groups cannot divide the heads is reported as that, not as a shape mismatch."""
    def holders(lab):
        return [(a, a.dims.index(lab), shape[a.dims.index(lab)]) for a, shape in zip(args, shapes)
                if lab in a.dims and len(shape) == len(a.dims)]

    H = sizes.get("nheads")
    if H is not None and "ngroups" in sizes:
        for a, _, v in holders("ngroups")[:1] + [h for h in holders("ngroups") if h[2] == sizes["ngroups"]][:1]:
            if v < 1 or H % v:
                raise ValueError(f"{a.name}: ngroups={v} must divide nheads={H}")
    for lab, supported in (("headdim", SUPPORTED_HEADDIM), ("dstate", SUPPORTED_DSTATE)):
        if lab in sizes and sizes[lab] not in supported:
            a, i, v = next(h for h in holders(lab) if h[2] == sizes[lab])
            raise ValueError(f"{a.name}: {lab} (dim {i}) expected one of {supported}, got {v}")


def _checked(args: list) -> tuple[dict, torch.device]:
    """launch.check_args with Mamba-2's supported sizes (_check_sizes)."""
    return check_args(args, _check_sizes)


def _geometry(x, B, state, x_cache=None):
    """(batch, H, P, N, G, S, L) of a decode call, from the tensors that define them (L None without x_cache)."""
    check_rank(x, "x", 3, "(batch, nheads, headdim)")
    check_rank(state, "state", 4, "(slots, nheads, headdim, dstate)")
    check_rank(B, "B", 3, "(batch, ngroups, dstate)")
    batch, H, P = x.shape
    S, N = state.shape[0], state.shape[3]
    G = B.shape[1]
    L = None
    if x_cache is not None:
        check_rank(x_cache, "x_cache", 4, "(slots, nheads, buffer_len, headdim)")
        L = x_cache.shape[2]
        if not 1 <= L <= 32:
            raise ValueError(f"x_cache: buffer_len (dim 2) must be in 1..32, got {L}")
    return batch, H, P, N, G, S, L


def _step_args(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, out, lead=("batch",)) -> list:
    """The tensors every decode / verify launch takes: step inputs, parameters, checkpoint, slots, output."""
    rows = lead + ("nheads", "headdim")
    return [
        Arg("x", x, rows, "act"),
        Arg("state", state, ("slots", "nheads", "headdim", "dstate"), "state"),
        Arg("B", B, lead + ("ngroups", "dstate"), "act"),
        Arg("C", C, lead + ("ngroups", "dstate"), "act"),
        Arg("dt", dt, lead + ("nheads",), "act", None),
        *(Arg(name, t, ("nheads",), F32, None) for name, t in (("dt_bias", dt_bias), ("A", A), ("D", D))),
        Arg("z", z, rows, "act", optional=True),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        Arg("out", out, rows, "act", None, optional=True),
    ]


def _ring_args(x_cache, B_cache, dt_cache, cursor, cursor_dims, shadow, shadow_scale) -> list:
    """The replay tensors: x / B / dt rings, cursor, optional shadow of the checkpoint and its row scales."""
    return [
        Arg("x_cache", x_cache, ("slots", "nheads", "buffer_len", "headdim"), "act"),
        Arg("B_cache", B_cache, ("slots", "ngroups", "buffer_len", "dstate"), "act"),
        Arg("dt_cache", dt_cache, ("slots", "nheads", "buffer_len"), F32, None),
        Arg("cursor", cursor, cursor_dims, I32, None),
        Arg("shadow", shadow, ("slots", "nheads", "headdim", "dstate"), tuple(SHADOW_DTYPES.values()), optional=True),
        Arg("shadow_scale", shadow_scale, ("slots", "nheads", "headdim"), F32, optional=True),
    ]


def make_spec(state, x, H, P, N, G, L, batch, has_z, device, conventional: bool = False,
              shadow: str = "none") -> KernelSpec:
    sd, ad = CKPT8 if state.dtype == CKPT8_DTYPE else DTYPE_CODES[state.dtype], DTYPE_CODES[x.dtype]
    rows, warps, variant = plan(sd, ad, H, P, N, L or 1, batch, conventional, shadow)
    return KernelSpec(sd, ad, H, P, N, G, L or 1, rows, warps, has_z, arch(device), variant=variant, shadow=shadow)


def shadow_kind(shadow, shadow_scale, state) -> str:
    """Name the kind of the optional shadow of ``state`` ("none", "bf16" or "fp8"); shapes, dtypes and
    devices are checked with the other tensors of the launch (_ring_args)."""
    if shadow is None:
        if shadow_scale is not None:
            raise ValueError("shadow_scale: given without a shadow")
        return "none"
    if state.dtype != torch.float32:
        raise TypeError(f"state: a shadow needs a float32 checkpoint, got {str(state.dtype).replace('torch.', '')}")
    kind = {v: k for k, v in SHADOW_DTYPES.items()}[shadow.dtype]
    if kind == "fp8" and shadow_scale is None:
        raise ValueError("shadow_scale: an fp8 shadow needs its (slots, nheads, headdim) float32 row scales")
    if kind != "fp8" and shadow_scale is not None:
        raise ValueError("shadow_scale: only an fp8 shadow has row scales, got one with a bfloat16 shadow")
    return kind


def _step_ptrs(x, B, C, dt, dt_bias, A, D, z) -> list[int]:
    """The step inputs every decode / verify kernel takes first, in its parameter order (z only when given)."""
    return [t.data_ptr() for t in (x, B, C, dt, dt_bias, A, D, z) if t is not None]


def _ckpt8_args(state, ckpt_scale, ckpt_flushes, ckpt_seed, shadow) -> list:
    """The 8-bit checkpoint's tensors (state float8_e4m3fn): its row scales and flush counts, checked by name."""
    if shadow is not None:
        raise ValueError("shadow: an 8-bit checkpoint (state float8_e4m3fn) is its own fp8 read copy; expected no shadow")
    for name, t in (("ckpt_scale", ckpt_scale), ("ckpt_flushes", ckpt_flushes)):
        if t is None:
            raise ValueError(f"{name}: an 8-bit checkpoint (state float8_e4m3fn) needs it, got None")
    if isinstance(ckpt_seed, bool) or not isinstance(ckpt_seed, numbers.Integral) or not -2**31 <= ckpt_seed < 2**31:
        raise TypeError(f"ckpt_seed: expected an int32, got {ckpt_seed!r}")
    return [Arg("ckpt_scale", ckpt_scale, ("slots", "nheads", "headdim"), F32),
            Arg("ckpt_flushes", ckpt_flushes, ("slots",), I32, None)]


def replay_decode(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor,
                  state_batch_indices, z=None, out=None, check_values: bool | None = None, shadow=None,
                  shadow_scale=None, ckpt_scale=None, ckpt_flushes=None, ckpt_seed: int = 0, row_order=None):
    """One fused ReplaySSM decode step (output, append, flush when full); returns y.

    The cursor is read, not moved: call :func:`advance_cursor` once per model step (all layers
    share it). ``check_values`` (default: when not capturing a graph) checks slot and cursor values
    on the host, which synchronizes. With ``shadow`` (bf16, or fp8-e4m3fn with ``shadow_scale``),
    non-flush steps read the shadow instead of the f32 checkpoint and a flush rewrites both; the
    shadow must hold the checkpoint's current values when the call starts (see
    :class:`~trtllm_replayssm.shadow.Shadow`: written at prefill hand-off and by every flush).
    With an 8-bit checkpoint (``state`` float8_e4m3fn, ``ckpt_scale`` its (slots, H, P) fp32 row scales,
    ``ckpt_flushes`` the (slots,) int32 flush counts, ``ckpt_seed`` the layer's seed; no shadow): every step
    reads q * scale, the flush folds from it and stores it requantised with stochastic rounding
    (:class:`~trtllm_replayssm.shadow.Checkpoint8` is the spec, bit for bit); call :func:`..cursor_ops.advance_cursor` with
    ``flushes=ckpt_flushes`` so that each flush draws fresh random words.
    ``row_order`` (batch, 4) int32: the step's rows as (row, slot, cursor, 0) in the order the blocks take them
    (:func:`trtllm_replayssm.cursor_ops.flush_order`'s flush-first order, once per model step for all layers); the
    module built for it (``KernelSpec.row_order``: the one-shot and staged kernels, i.e. a shadow, an 8-bit
    checkpoint or batch <= 4 in the shipped plan; the persistent fp32 kernel walks items and takes none) reads each
    block's row, slot and cursor there in one load. Every output is what the call without it computes.
    """
    batch, H, P, N, G, S, L = _geometry(x, B, state, x_cache)
    ckpt8 = isinstance(state, torch.Tensor) and state.dtype == CKPT8_DTYPE
    args = _step_args(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, out)
    if ckpt8:
        args[1] = args[1]._replace(dtypes=(CKPT8_DTYPE,))
        args += _ckpt8_args(state, ckpt_scale, ckpt_flushes, ckpt_seed, shadow)
    elif ckpt_scale is not None or ckpt_flushes is not None:
        raise ValueError("ckpt_scale / ckpt_flushes: given with a state of dtype "
                         f"{str(state.dtype).replace('torch.', '')}; they belong to an 8-bit (float8_e4m3fn) checkpoint")
    _checked(args + _ring_args(x_cache, B_cache, dt_cache, cursor, ("slots",), shadow, shadow_scale)
             + [row_order_arg(row_order)])
    kind = "none" if ckpt8 else shadow_kind(shadow, shadow_scale, state)
    if values_checked(check_values):
        check_indices(state_batch_indices, S, cursor, L, row_order)
    require_cuda(x)
    y = torch.empty_like(x) if out is None else out
    if batch == 0:
        return y
    dev = x.device
    spec = make_spec(state, x, H, P, N, G, L, batch, z is not None, dev, shadow=kind)
    if row_order is not None:
        if spec.persistent:
            raise ValueError(f"row_order: this step runs the persistent kernel ({spec.key}: an fp32 checkpoint "
                             f"without a shadow at batch {batch}), which walks items and reads no row order; pass "
                             "none (the order pays with a shadow: ReplayStateCache orders where it was measured)")
        spec = dataclasses.replace(spec, row_order=True)
        state_batch_indices = row_order  # the kernel reads its rows there
    sh = [] if shadow is None else [shadow.data_ptr(), ptr(shadow_scale)]  # bf16: no scales (null)
    ck_in = [ckpt_scale.data_ptr(), ckpt_flushes.data_ptr()] if ckpt8 else []
    seed = [np.int32(ckpt_seed)] if ckpt8 else []
    args = _step_ptrs(x, B, C, dt, dt_bias, A, D, z)
    args += [state_batch_indices.data_ptr(), cursor.data_ptr(), state.data_ptr(), x_cache.data_ptr(),
             B_cache.data_ptr(), dt_cache.data_ptr(), *sh, *ck_in, np.int32(batch), np.int32(S), *seed, y.data_ptr(),
             state.data_ptr(), x_cache.data_ptr(), B_cache.data_ptr(), dt_cache.data_ptr(), *sh,
             *([ckpt_scale.data_ptr()] if ckpt8 else [])]
    launch(spec, "replayssm_decode", dev, spec.grid(batch, sm_count(dev.index)), (spec.threads, 1, 1), args)
    return y


def conventional_step(x, B, C, dt, dt_bias, A, D, state, state_batch_indices, z=None, out=None,
                      check_values: bool | None = None):
    """One conventional Mamba-2 decode step (reads and writes the whole state); returns y."""
    batch, H, P, N, G, S, _ = _geometry(x, B, state)
    if state.dtype == CKPT8_DTYPE:
        raise TypeError("state: the conventional step needs a float32 / bfloat16 / float16 state, got float8_e4m3fn "
                        "(an 8-bit checkpoint is replay_decode's)")
    _checked(_step_args(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, out))
    if values_checked(check_values):
        check_indices(state_batch_indices, S, None, 1)
    require_cuda(x)
    y = torch.empty_like(x) if out is None else out
    if batch == 0:
        return y
    spec = make_spec(state, x, H, P, N, G, None, batch, z is not None, x.device, conventional=True)
    args = _step_ptrs(x, B, C, dt, dt_bias, A, D, z)
    args += [state_batch_indices.data_ptr(), state.data_ptr(), np.int32(batch), np.int32(S), y.data_ptr(),
             state.data_ptr()]
    grid = spec.grid(batch, sm_count(x.device.index), "replayssm_conventional")
    launch(spec, "replayssm_conventional", x.device, grid, (spec.threads, 1, 1), args)
    return y


# ---- speculative decoding -----------------------------------------------------------------------------
def _spec_geometry(x, B, state, x_cache=None):
    """(batch, T, H, P, N, G, S, L) of a speculative call; L is None without x_cache."""
    check_rank(x, "x", 4, "(batch, T, nheads, headdim)")
    check_rank(B, "B", 4, "(batch, T, ngroups, dstate)")
    check_rank(state, "state", 4, "(slots, nheads, headdim, dstate)")
    batch, T, H, P = x.shape
    S, N = state.shape[0], state.shape[3]
    G = B.shape[2]
    if T not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"x: expected T = 1 + num_draft (dim 1) in {SUPPORTED_NUM_TOKENS}, got {T}")
    L = None
    if x_cache is not None:
        check_rank(x_cache, "x_cache", 4, "(slots, nheads, buffer_len, headdim)")
        L = x_cache.shape[2]
        check_window(T, L, "x_cache: buffer_len (dim 2)")
    return batch, T, H, P, N, G, S, L


def make_verify_spec(state_dtype, act_dtype, H, P, N, G, L, T, batch, has_z, device, shadow: str = "none") -> KernelSpec:
    return verify_spec(DTYPE_CODES[state_dtype], DTYPE_CODES[act_dtype], H, P, N, G, L, T, batch, has_z, arch(device),
                       shadow)


def replay_verify(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, state_batch_indices,
                  z=None, out=None, check_values: bool | None = None, shadow=None, shadow_scale=None):
    """Verify the T tokens of a speculative window for one layer; returns y (batch, T, H, P).

    y_t comes from the checkpoint, the committed history and the window tokens 0..t; the window is
    appended to the rings at (start + count + t) % L. When count + 2T > L the committed history is
    first folded into the checkpoint (state), as :func:`spec_reference.maybe_flush` does. The cursor
    is read, not moved: call :func:`spec_commit` once per model step after sampling.
    With ``shadow`` (bf16, or fp8-e4m3fn with ``shadow_scale``; f32 state only), as in
    :func:`replay_decode`: steps without a flush read the shadow instead of the f32 checkpoint for
    the S0 C_t dots; a flush folds the f32 checkpoint, stores it, rewrites the shadow (and scales)
    from the stored values and computes that step's window from the f32 values
    (:func:`spec_reference.verify` with ``shadow`` and ``flushed`` is the spec).
    """
    batch, T, H, P, N, G, S, L = _spec_geometry(x, B, state, x_cache)
    _checked(_step_args(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, out, ("batch", "T"))
                + _ring_args(x_cache, B_cache, dt_cache, cursor, ("slots", 2), shadow, shadow_scale))
    kind = shadow_kind(shadow, shadow_scale, state)
    if values_checked(check_values):
        check_spec_values(state_batch_indices, S, T, cursor, L)
    require_cuda(x)
    y = torch.empty_like(x) if out is None else out
    if batch == 0:
        return y
    dev = x.device
    spec = make_verify_spec(state.dtype, x.dtype, H, P, N, G, L, T, batch, z is not None, dev, kind)
    sh = [] if shadow is None else [shadow.data_ptr(), ptr(shadow_scale)]  # bf16: no scales (null)
    args = _step_ptrs(x, B, C, dt, dt_bias, A, D, z)
    args += [state_batch_indices.data_ptr(), cursor.data_ptr(), state.data_ptr(), x_cache.data_ptr(),
             B_cache.data_ptr(), dt_cache.data_ptr(), *sh, np.int32(batch), np.int32(S), y.data_ptr(),
             state.data_ptr(), x_cache.data_ptr(), B_cache.data_ptr(), dt_cache.data_ptr(), *sh]
    launch(spec, "replayssm_verify", dev, spec_grid(spec, batch), (spec.threads, 1, 1), args)
    return y


_SNAPSHOT_DIMS = ("slots", "T", "nheads", "headdim", "dstate")


def native_spec_verify(x, B, C, dt, dt_bias, A, D, state, snapshots, state_batch_indices, z=None, out=None,
                       check_values: bool | None = None):
    """Native-spec baseline (vLLM / TensorRT-LLM style): the conventional recurrence over the T window
    tokens from state[slot] (read only); snapshots[slot, t] = state after token t; returns y (batch, T, H, P)."""
    batch, T, H, P, N, G, S, _ = _spec_geometry(x, B, state)
    _checked(_step_args(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, out, ("batch", "T"))
                + [Arg("snapshots", snapshots, _SNAPSHOT_DIMS, "state")])
    if values_checked(check_values):
        check_spec_values(state_batch_indices, S, T)
    require_cuda(x)
    y = torch.empty_like(x) if out is None else out
    if batch == 0:
        return y
    spec = make_verify_spec(state.dtype, x.dtype, H, P, N, G, 2 * T, T, batch, z is not None, x.device)
    args = _step_ptrs(x, B, C, dt, dt_bias, A, D, z)
    args += [state_batch_indices.data_ptr(), state.data_ptr(), np.int32(batch), np.int32(S), y.data_ptr(),
             snapshots.data_ptr()]
    launch(spec, "replayssm_native_verify", x.device, spec_grid(spec, batch), (spec.threads, 1, 1), args)
    return y


# ---- torch.library custom ops (torch.compile / export see them as opaque, with fake shapes) --------
@torch.library.custom_op("trtllm_replayssm::replay_decode",
                         mutates_args=("state", "x_cache", "B_cache", "dt_cache", "shadow", "shadow_scale"))
def replay_decode_op(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor,
                     A: torch.Tensor, D: torch.Tensor, state: torch.Tensor, x_cache: torch.Tensor,
                     B_cache: torch.Tensor, dt_cache: torch.Tensor, cursor: torch.Tensor,
                     state_batch_indices: torch.Tensor, z: torch.Tensor | None = None,
                     shadow: torch.Tensor | None = None, shadow_scale: torch.Tensor | None = None) -> torch.Tensor:
    return replay_decode(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, state_batch_indices,
                         z=z, shadow=shadow, shadow_scale=shadow_scale)


@replay_decode_op.register_fake
def _(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, state_batch_indices, z=None,
      shadow=None, shadow_scale=None):
    return torch.empty_like(x)


@torch.library.custom_op("trtllm_replayssm::conventional_step", mutates_args=("state",))
def conventional_step_op(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor,
                         dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                         state_batch_indices: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
    return conventional_step(x, B, C, dt, dt_bias, A, D, state, state_batch_indices, z=z)


@conventional_step_op.register_fake
def _(x, B, C, dt, dt_bias, A, D, state, state_batch_indices, z=None):
    return torch.empty_like(x)


@torch.library.custom_op("trtllm_replayssm::replay_verify",
                         mutates_args=("state", "x_cache", "B_cache", "dt_cache", "shadow", "shadow_scale"))
def replay_verify_op(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor,
                     A: torch.Tensor, D: torch.Tensor, state: torch.Tensor, x_cache: torch.Tensor,
                     B_cache: torch.Tensor, dt_cache: torch.Tensor, cursor: torch.Tensor,
                     state_batch_indices: torch.Tensor, z: torch.Tensor | None = None,
                     shadow: torch.Tensor | None = None, shadow_scale: torch.Tensor | None = None) -> torch.Tensor:
    return replay_verify(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, state_batch_indices,
                         z=z, shadow=shadow, shadow_scale=shadow_scale)


@replay_verify_op.register_fake
def _(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, state_batch_indices, z=None,
      shadow=None, shadow_scale=None):
    return torch.empty_like(x)


@torch.library.custom_op("trtllm_replayssm::native_spec_verify", mutates_args=("snapshots",))
def native_spec_verify_op(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor,
                          A: torch.Tensor, D: torch.Tensor, state: torch.Tensor, snapshots: torch.Tensor,
                          state_batch_indices: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
    return native_spec_verify(x, B, C, dt, dt_bias, A, D, state, snapshots, state_batch_indices, z=z)


@native_spec_verify_op.register_fake
def _(x, B, C, dt, dt_bias, A, D, state, snapshots, state_batch_indices, z=None):
    return torch.empty_like(x)
