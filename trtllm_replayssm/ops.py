# SPDX-License-Identifier: Apache-2.0
"""Validated launchers on torch tensors, and the torch.library custom ops that wrap them.

Every tensor is checked once, here, before launch (shape, dtype, device, contiguity; slot and
cursor ranges when not capturing a CUDA graph); errors name the tensor with what was expected and
what was given. Kernels are compiled by :mod:`.compile` (NVRTC) for the device's arch, loaded and
launched with ``cuda.core`` on torch's current stream, so the launches are CUDA-graph safe.

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
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from . import compile as _compile
from .config import (
    COMMIT_THREADS,
    DTYPE_CODES,
    SHADOW_DTYPES,
    SUPPORTED_NUM_TOKENS,
    KernelSpec,
    commit_grid,
    commit_spec,
    plan,
    spec_grid,
    verify_spec,
)

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- validation -----------------------------------------------------------------------------------
def _fmt_dtypes(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(t, name: str, shape: tuple | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_fmt_dtypes(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_indices(state_batch_indices: torch.Tensor, nslots: int, cursor: torch.Tensor | None, L: int) -> None:
    """Value checks that need a device->host copy (skipped while capturing a CUDA graph)."""
    sbi = state_batch_indices.cpu()
    bad = sbi[(sbi < -1) | (sbi >= nslots)]
    if bad.numel():
        raise ValueError(f"state_batch_indices: expected values in [-1, {nslots}), got {bad.tolist()[:8]}")
    used = sbi[sbi >= 0]
    if used.unique().numel() != used.numel():
        raise ValueError("state_batch_indices: a slot appears in more than one row (rows would race)")
    if cursor is not None and used.numel():
        cur = cursor.cpu()[used.long()]
        if ((cur < 0) | (cur >= L)).any():
            raise ValueError(f"cursor: expected values in [0, {L}) for the rows' slots, got {cur.tolist()[:8]}")


def _geometry(x, B, state, x_cache=None):
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x: expected a (batch, nheads, headdim) tensor, got {getattr(x, 'shape', type(x))}")
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        raise ValueError(f"state: expected a (slots, nheads, headdim, dstate) tensor, got {getattr(state, 'shape', type(state))}")
    if not isinstance(B, torch.Tensor) or B.dim() != 3:
        raise ValueError(f"B: expected a (batch, ngroups, dstate) tensor, got {getattr(B, 'shape', type(B))}")
    batch, H, P = x.shape
    S, N = state.shape[0], state.shape[3]
    G = B.shape[1]
    if G < 1 or H % G:
        raise ValueError(f"B: ngroups={G} must divide nheads={H}")
    L = None
    if x_cache is not None:
        if not isinstance(x_cache, torch.Tensor) or x_cache.dim() != 4:
            got = getattr(x_cache, "shape", type(x_cache))
            raise ValueError(f"x_cache: expected a (slots, nheads, buffer_len, headdim) tensor, got {got}")
        L = x_cache.shape[2]
        if not 1 <= L <= 32:
            raise ValueError(f"x_cache: buffer_len (dim 2) must be in 1..32, got {L}")
    return batch, H, P, N, G, S, L


def _check_common(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, batch, H, P, N, G, S):
    check_tensor(x, "x", (batch, H, P), _ACT_DTYPES)
    dev, act = x.device, (x.dtype,)
    check_tensor(state, "state", (S, H, P, N), _STATE_DTYPES, dev)
    check_tensor(B, "B", (batch, G, N), act, dev)
    check_tensor(C, "C", (batch, G, N), act, dev)
    check_tensor(dt, "dt", (batch, H), act, dev)
    for name, t in (("dt_bias", dt_bias), ("A", A), ("D", D)):
        check_tensor(t, name, (H,), (torch.float32,), dev)
    if z is not None:
        check_tensor(z, "z", (batch, H, P), act, dev)
    check_tensor(state_batch_indices, "state_batch_indices", (batch,), (torch.int32,), dev)


def _require_cuda(x, name: str = "x") -> None:
    # Last, so that shape and dtype errors are reported (and testable) on any device.
    if x.device.type != "cuda":
        raise ValueError(f"{name}: expected CUDA tensors, got device {x.device}")


# ---- loading and launching ---------------------------------------------------------------------------
_lock = threading.Lock()
_kernels: dict = {}


def _arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def get_kernel(spec: KernelSpec, name: str, device: torch.device):
    """Load (once) the cubin of ``spec`` on ``device`` and return the cuda.core kernel ``name``."""
    key = (spec, name, device.index)
    kern = _kernels.get(key)
    if kern is None:
        from cuda.core import Device, ObjectCode

        with _lock:
            Device(device.index).set_current()
            obj = ObjectCode.from_cubin(_compile.compile_spec(spec, "cubin"))
            for n in _compile.kernel_names(spec):
                _kernels[(spec, n, device.index)] = obj.get_kernel(n)
        kern = _kernels[key]
    return kern


def launch(spec: KernelSpec, name: str, device, grid, block, args) -> None:
    """Launch kernel ``name`` of ``spec`` on torch's current stream. ``args``: ints for pointers,
    numpy.int32 for the int32 scalars, in the kernel's parameter order."""
    from cuda.core import LaunchConfig, Stream
    from cuda.core import launch as _launch

    kern = get_kernel(spec, name, device)
    stream = Stream.from_handle(torch.cuda.current_stream(device).cuda_stream)
    _launch(stream, LaunchConfig(grid=grid, block=block), kern, *args)


def make_spec(state, x, H, P, N, G, L, batch, has_z, device, conventional: bool = False,
              shadow: str = "none") -> KernelSpec:
    sd, ad = DTYPE_CODES[state.dtype], DTYPE_CODES[x.dtype]
    rows, warps, defines = plan(sd, ad, H, P, N, L or 1, batch, conventional, shadow)
    return KernelSpec(sd, ad, H, P, N, G, L or 1, rows, warps, has_z, _arch(device), defines, shadow)


def shadow_kind(shadow, shadow_scale, state) -> str:
    """Validate the optional shadow of ``state`` and name its kind ("none", "bf16" or "fp8")."""
    if shadow is None:
        if shadow_scale is not None:
            raise ValueError("shadow_scale: given without a shadow")
        return "none"
    kinds = {v: k for k, v in SHADOW_DTYPES.items()}
    check_tensor(shadow, "shadow", tuple(state.shape), tuple(kinds), state.device)
    if state.dtype != torch.float32:
        raise TypeError(f"state: a shadow needs a float32 checkpoint, got {str(state.dtype).replace('torch.', '')}")
    kind = kinds[shadow.dtype]
    if kind == "fp8":
        if shadow_scale is None:
            raise ValueError("shadow_scale: an fp8 shadow needs its (slots, nheads, headdim) float32 row scales")
        check_tensor(shadow_scale, "shadow_scale", tuple(state.shape[:3]), (torch.float32,), state.device)
    elif shadow_scale is not None:
        raise ValueError("shadow_scale: only an fp8 shadow has row scales, got one with a bfloat16 shadow")
    return kind


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _ptr(t):
    return 0 if t is None else t.data_ptr()


def _step_ptrs(x, B, C, dt, dt_bias, A, D, z) -> list[int]:
    """The step inputs every decode / verify kernel takes first, in its parameter order (z only when given)."""
    return [t.data_ptr() for t in (x, B, C, dt, dt_bias, A, D, z) if t is not None]


def replay_decode(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor,
                  state_batch_indices, z=None, out=None, check_values: bool | None = None, shadow=None,
                  shadow_scale=None):
    """One fused ReplaySSM decode step (output, append, flush when full); returns y.

    The cursor is read, not moved: call :func:`advance_cursor` once per model step (all layers
    share it). ``check_values`` (default: when not capturing a graph) checks slot and cursor values
    on the host, which synchronizes. With ``shadow`` (bf16, or fp8-e4m3fn with ``shadow_scale``),
    non-flush steps read the shadow instead of the f32 checkpoint and a flush rewrites both; the
    shadow must hold the checkpoint's current values when the call starts (see
    :class:`~.reference.Shadow`: written at prefill hand-off and by every flush).
    """
    batch, H, P, N, G, S, L = _geometry(x, B, state, x_cache)
    _check_common(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, batch, H, P, N, G, S)
    dev, act = x.device, (x.dtype,)
    check_tensor(x_cache, "x_cache", (S, H, L, P), act, dev)
    check_tensor(B_cache, "B_cache", (S, G, L, N), act, dev)
    check_tensor(dt_cache, "dt_cache", (S, H, L), (torch.float32,), dev)
    check_tensor(cursor, "cursor", (S,), (torch.int32,), dev)
    kind = shadow_kind(shadow, shadow_scale, state)
    y = _output(out, x)
    _require_cuda(x)
    if check_values if check_values is not None else not _capturing():
        check_indices(state_batch_indices, S, cursor, L)
    if batch == 0:
        return y
    spec = make_spec(state, x, H, P, N, G, L, batch, z is not None, dev, shadow=kind)
    sh = [] if shadow is None else [shadow.data_ptr(), _ptr(shadow_scale)]  # bf16: no scales (null)
    args = _step_ptrs(x, B, C, dt, dt_bias, A, D, z)
    args += [state_batch_indices.data_ptr(), cursor.data_ptr(), state.data_ptr(), x_cache.data_ptr(),
             B_cache.data_ptr(), dt_cache.data_ptr(), *sh, np.int32(batch), np.int32(S), y.data_ptr(),
             state.data_ptr(), x_cache.data_ptr(), B_cache.data_ptr(), dt_cache.data_ptr(), *sh]
    launch(spec, "replayssm_decode", dev, spec.grid(batch, sm_count(dev.index)), (spec.threads, 1, 1), args)
    return y


def conventional_step(x, B, C, dt, dt_bias, A, D, state, state_batch_indices, z=None, out=None,
                      check_values: bool | None = None):
    """One conventional Mamba-2 decode step (reads and writes the whole state); returns y."""
    batch, H, P, N, G, S, _ = _geometry(x, B, state)
    _check_common(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, batch, H, P, N, G, S)
    y = _output(out, x)
    _require_cuda(x)
    if check_values if check_values is not None else not _capturing():
        check_indices(state_batch_indices, S, None, 1)
    if batch == 0:
        return y
    spec = make_spec(state, x, H, P, N, G, None, batch, z is not None, x.device, conventional=True)
    args = _step_ptrs(x, B, C, dt, dt_bias, A, D, z)
    args += [state_batch_indices.data_ptr(), state.data_ptr(), np.int32(batch), np.int32(S), y.data_ptr(),
             state.data_ptr()]
    grid = spec.grid(batch, sm_count(x.device.index), "replayssm_conventional")
    launch(spec, "replayssm_conventional", x.device, grid, (spec.threads, 1, 1), args)
    return y


def advance_cursor(cursor, state_batch_indices, buffer_len: int) -> None:
    """cursor[slot] = (cursor[slot] + 1) % buffer_len for every row with a slot, on the GPU."""
    check_tensor(cursor, "cursor", None, (torch.int32,))
    if cursor.dim() != 1 or cursor.device.type != "cuda":
        raise ValueError(f"cursor: expected a 1-D CUDA tensor, got shape {tuple(cursor.shape)} on {cursor.device}")
    check_tensor(state_batch_indices, "state_batch_indices", None, (torch.int32,), cursor.device)
    if not 1 <= buffer_len <= 32:
        raise ValueError(f"buffer_len must be in 1..32, got {buffer_len}")
    batch = state_batch_indices.numel()
    if batch == 0:
        return
    # Any spec with this L carries the same advance kernel; use the smallest valid one.
    spec = KernelSpec("f32", "f32", 1, 8, 128, 1, buffer_len, 8, 1, False, _arch(cursor.device))
    launch(spec, "replayssm_advance_cursor", cursor.device, ((batch + 255) // 256, 1, 1), (256, 1, 1),
           [state_batch_indices.data_ptr(), np.int32(batch), np.int32(cursor.numel()), cursor.data_ptr()])


def _output(out, x):
    if out is None:
        return torch.empty_like(x)
    check_tensor(out, "out", tuple(x.shape), (x.dtype,), x.device)
    return out


# ---- speculative decoding -----------------------------------------------------------------------------
def _spec_geometry(x, B, state, x_cache=None):
    """(batch, T, H, P, N, G, S, L) of a speculative call; L is None without x_cache."""
    for name, t, want in (("x", x, "(batch, T, nheads, headdim)"), ("B", B, "(batch, T, ngroups, dstate)"),
                          ("state", state, "(slots, nheads, headdim, dstate)")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a {want} tensor, got {getattr(t, 'shape', type(t))}")
    batch, T, H, P = x.shape
    S, N = state.shape[0], state.shape[3]
    G = B.shape[2]
    if T not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"x: expected T = 1 + num_draft (dim 1) in {SUPPORTED_NUM_TOKENS}, got {T}")
    if G < 1 or H % G:
        raise ValueError(f"B: ngroups={G} must divide nheads={H}")
    L = None
    if x_cache is not None:
        if not isinstance(x_cache, torch.Tensor) or x_cache.dim() != 4:
            got = getattr(x_cache, "shape", type(x_cache))
            raise ValueError(f"x_cache: expected a (slots, nheads, buffer_len, headdim) tensor, got {got}")
        L = x_cache.shape[2]
        _check_window(T, L, "x_cache: buffer_len (dim 2)")
    return batch, T, H, P, N, G, S, L


def _check_window(T: int, L: int, what: str) -> None:
    if not 2 * T <= L <= 32:
        raise ValueError(f"{what}: expected in [2T, 32] = [{2 * T}, 32] (flush one window early, T={T}), got {L}")


def _check_spec_common(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, batch, T, H, P, N, G, S):
    check_tensor(x, "x", (batch, T, H, P), _ACT_DTYPES)
    dev, act = x.device, (x.dtype,)
    check_tensor(state, "state", (S, H, P, N), _STATE_DTYPES, dev)
    check_tensor(B, "B", (batch, T, G, N), act, dev)
    check_tensor(C, "C", (batch, T, G, N), act, dev)
    check_tensor(dt, "dt", (batch, T, H), act, dev)
    for name, t in (("dt_bias", dt_bias), ("A", A), ("D", D)):
        check_tensor(t, name, (H,), (torch.float32,), dev)
    if z is not None:
        check_tensor(z, "z", (batch, T, H, P), act, dev)
    check_tensor(state_batch_indices, "state_batch_indices", (batch,), (torch.int32,), dev)


def check_spec_values(state_batch_indices: torch.Tensor, nslots: int, num_tokens: int, cursor: torch.Tensor | None = None,
                      buffer_len: int | None = None, n_accepted: torch.Tensor | None = None) -> None:
    """Host value checks of the speculative ops (a device->host copy; skipped while capturing a graph):
    slots, cursor start in [0, L) and count in [0, L - T] for the rows' slots, n_accepted in [0, T]."""
    check_indices(state_batch_indices, nslots, None, 1)
    sbi = state_batch_indices.cpu()
    rows = (sbi >= 0).nonzero()[:, 0]
    T, L = num_tokens, buffer_len
    if cursor is not None and rows.numel():
        cur = cursor.cpu()[sbi[rows].long()]
        start, count = cur[:, 0], cur[:, 1]
        bad = (start < 0) | (start >= L)
        if bad.any():
            raise ValueError(f"cursor: expected start (column 0) in [0, {L}) for the rows' slots, got {start[bad].tolist()[:8]}")
        bad = (count < 0) | (count > L - T)
        if bad.any():
            raise ValueError(f"cursor: expected count (column 1) in [0, L - T] = [0, {L - T}] for the rows' slots, "
                             f"got {count[bad].tolist()[:8]}")
    if n_accepted is not None and rows.numel():
        n = n_accepted.cpu()[rows]
        bad = (n < 0) | (n > T)
        if bad.any():
            raise ValueError(f"n_accepted: expected values in [0, T] = [0, {T}] for rows with a slot, got {n[bad].tolist()[:8]}")


def make_verify_spec(state_dtype, act_dtype, H, P, N, G, L, T, batch, has_z, device, shadow: str = "none") -> KernelSpec:
    return verify_spec(DTYPE_CODES[state_dtype], DTYPE_CODES[act_dtype], H, P, N, G, L, T, batch, has_z, _arch(device),
                       shadow)


def _values(check_values: bool | None) -> bool:
    return check_values if check_values is not None else not _capturing()


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
    _check_spec_common(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, batch, T, H, P, N, G, S)
    dev, act = x.device, (x.dtype,)
    check_tensor(x_cache, "x_cache", (S, H, L, P), act, dev)
    check_tensor(B_cache, "B_cache", (S, G, L, N), act, dev)
    check_tensor(dt_cache, "dt_cache", (S, H, L), (torch.float32,), dev)
    check_tensor(cursor, "cursor", (S, 2), (torch.int32,), dev)
    kind = shadow_kind(shadow, shadow_scale, state)
    y = _output(out, x)
    _require_cuda(x)
    if _values(check_values):
        check_spec_values(state_batch_indices, S, T, cursor, L)
    if batch == 0:
        return y
    spec = make_verify_spec(state.dtype, x.dtype, H, P, N, G, L, T, batch, z is not None, dev, kind)
    sh = [] if shadow is None else [shadow.data_ptr(), _ptr(shadow_scale)]  # bf16: no scales (null)
    args = _step_ptrs(x, B, C, dt, dt_bias, A, D, z)
    args += [state_batch_indices.data_ptr(), cursor.data_ptr(), state.data_ptr(), x_cache.data_ptr(),
             B_cache.data_ptr(), dt_cache.data_ptr(), *sh, np.int32(batch), np.int32(S), y.data_ptr(),
             state.data_ptr(), x_cache.data_ptr(), B_cache.data_ptr(), dt_cache.data_ptr(), *sh]
    launch(spec, "replayssm_verify", dev, spec_grid(spec, batch), (spec.threads, 1, 1), args)
    return y


def spec_commit(cursor, n_accepted, state_batch_indices, num_tokens: int, buffer_len: int,
                check_values: bool | None = None) -> None:
    """Commit n_accepted[row] tokens of the window for every row with a slot, on the GPU (in place).

    Once per model step after sampling, shared by all layers: the flush the verify kernels did
    (count + 2T > L: start = (start + count) % L, count = 0), then count += n (n clamped to [0, T]
    on the device; checked on the host unless capturing a graph).
    """
    if num_tokens not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"num_tokens: expected one of {SUPPORTED_NUM_TOKENS}, got {num_tokens}")
    _check_window(num_tokens, buffer_len, "buffer_len")
    check_tensor(cursor, "cursor", None, (torch.int32,))
    if cursor.dim() != 2 or cursor.shape[1] != 2:
        raise ValueError(f"cursor: expected shape (slots, 2), got {tuple(cursor.shape)}")
    dev = cursor.device
    check_tensor(state_batch_indices, "state_batch_indices", None, (torch.int32,), dev)
    if state_batch_indices.dim() != 1:
        raise ValueError(f"state_batch_indices: expected shape (batch,), got {tuple(state_batch_indices.shape)}")
    batch = state_batch_indices.shape[0]
    check_tensor(n_accepted, "n_accepted", (batch,), (torch.int32,), dev)
    _require_cuda(cursor, "cursor")
    S = cursor.shape[0]
    if _values(check_values):
        check_spec_values(state_batch_indices, S, num_tokens, cursor, buffer_len, n_accepted)
    if batch == 0:
        return
    spec = commit_spec(num_tokens, buffer_len, _arch(dev))
    # TensorRT's order: inputs (the cursor is the aliased input of the in-place cursor output), int32s, outputs.
    launch(spec, "replayssm_spec_commit", dev, commit_grid(batch), (COMMIT_THREADS, 1, 1),
           [state_batch_indices.data_ptr(), n_accepted.data_ptr(), cursor.data_ptr(), np.int32(batch), np.int32(S),
            cursor.data_ptr()])


def _check_snapshots(snapshots, state, T):
    S, H, P, N = state.shape
    check_tensor(snapshots, "snapshots", (S, T, H, P, N), (state.dtype,), state.device)


def native_spec_verify(x, B, C, dt, dt_bias, A, D, state, snapshots, state_batch_indices, z=None, out=None,
                       check_values: bool | None = None):
    """Native-spec baseline (vLLM / TensorRT-LLM style): the conventional recurrence over the T window
    tokens from state[slot] (read only); snapshots[slot, t] = state after token t; returns y (batch, T, H, P)."""
    batch, T, H, P, N, G, S, _ = _spec_geometry(x, B, state)
    _check_spec_common(x, B, C, dt, dt_bias, A, D, z, state, state_batch_indices, batch, T, H, P, N, G, S)
    _check_snapshots(snapshots, state, T)
    y = _output(out, x)
    _require_cuda(x)
    if _values(check_values):
        check_spec_values(state_batch_indices, S, T)
    if batch == 0:
        return y
    spec = make_verify_spec(state.dtype, x.dtype, H, P, N, G, 2 * T, T, batch, z is not None, x.device)
    args = _step_ptrs(x, B, C, dt, dt_bias, A, D, z)
    args += [state_batch_indices.data_ptr(), state.data_ptr(), np.int32(batch), np.int32(S), y.data_ptr(),
             snapshots.data_ptr()]
    launch(spec, "replayssm_native_verify", x.device, spec_grid(spec, batch), (spec.threads, 1, 1), args)
    return y


def native_spec_commit(state, snapshots, n_accepted, state_batch_indices, check_values: bool | None = None) -> None:
    """Native-spec baseline commit: state[slot] = snapshots[slot, n - 1] for rows with n >= 1 (a copy)."""
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        raise ValueError(f"state: expected a (slots, nheads, headdim, dstate) tensor, got {getattr(state, 'shape', type(state))}")
    if not isinstance(snapshots, torch.Tensor) or snapshots.dim() != 5:
        got = getattr(snapshots, "shape", type(snapshots))
        raise ValueError(f"snapshots: expected a (slots, T, nheads, headdim, dstate) tensor, got {got}")
    S, H, P, N = state.shape
    T = snapshots.shape[1]
    if T not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"snapshots: expected T (dim 1) in {SUPPORTED_NUM_TOKENS}, got {T}")
    check_tensor(state, "state", None, _STATE_DTYPES)
    dev = state.device
    _check_snapshots(snapshots, state, T)
    check_tensor(state_batch_indices, "state_batch_indices", None, (torch.int32,), dev)
    if state_batch_indices.dim() != 1:
        raise ValueError(f"state_batch_indices: expected shape (batch,), got {tuple(state_batch_indices.shape)}")
    batch = state_batch_indices.shape[0]
    check_tensor(n_accepted, "n_accepted", (batch,), (torch.int32,), dev)
    _require_cuda(state, "state")
    if _values(check_values):
        check_spec_values(state_batch_indices, S, T, n_accepted=n_accepted)
    if batch == 0:
        return
    spec = make_verify_spec(state.dtype, state.dtype, H, P, N, 1, 2 * T, T, batch, False, dev)
    launch(spec, "replayssm_native_commit", dev, spec_grid(spec, batch), (spec.threads, 1, 1),
           [state_batch_indices.data_ptr(), n_accepted.data_ptr(), np.int32(batch), np.int32(S), snapshots.data_ptr(),
            state.data_ptr()])


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


@torch.library.custom_op("trtllm_replayssm::advance_cursor", mutates_args=("cursor",))
def advance_cursor_op(cursor: torch.Tensor, state_batch_indices: torch.Tensor, buffer_len: int) -> None:
    advance_cursor(cursor, state_batch_indices, buffer_len)


@advance_cursor_op.register_fake
def _(cursor, state_batch_indices, buffer_len):
    return None


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


@torch.library.custom_op("trtllm_replayssm::spec_commit", mutates_args=("cursor",))
def spec_commit_op(cursor: torch.Tensor, n_accepted: torch.Tensor, state_batch_indices: torch.Tensor, num_tokens: int,
                   buffer_len: int) -> None:
    spec_commit(cursor, n_accepted, state_batch_indices, num_tokens, buffer_len)


@spec_commit_op.register_fake
def _(cursor, n_accepted, state_batch_indices, num_tokens, buffer_len):
    return None


@torch.library.custom_op("trtllm_replayssm::native_spec_verify", mutates_args=("snapshots",))
def native_spec_verify_op(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor,
                          A: torch.Tensor, D: torch.Tensor, state: torch.Tensor, snapshots: torch.Tensor,
                          state_batch_indices: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
    return native_spec_verify(x, B, C, dt, dt_bias, A, D, state, snapshots, state_batch_indices, z=z)


@native_spec_verify_op.register_fake
def _(x, B, C, dt, dt_bias, A, D, state, snapshots, state_batch_indices, z=None):
    return torch.empty_like(x)


@torch.library.custom_op("trtllm_replayssm::native_spec_commit", mutates_args=("state",))
def native_spec_commit_op(state: torch.Tensor, snapshots: torch.Tensor, n_accepted: torch.Tensor,
                          state_batch_indices: torch.Tensor) -> None:
    native_spec_commit(state, snapshots, n_accepted, state_batch_indices)


@native_spec_commit_op.register_fake
def _(state, snapshots, n_accepted, state_batch_indices):
    return None
