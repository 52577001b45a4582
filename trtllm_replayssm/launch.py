# SPDX-License-Identifier: Apache-2.0
"""The host boundary every family's launchers share: tensor checks, size voting, value checks, loading, launching.

A launcher lists the tensors of one launch as :class:`Arg` rows (a label per dimension: a size shared with other
tensors, or a fixed int; a dtype set or a group name of :data:`GROUPS`) and calls :func:`check_args`, which takes
each shared size, dtype group and device from what most tensors agree on, so an error names the tensor that
differs, with got and expected (the rules: :mod:`.families.mamba2.ops`' docstring). A family adds its own supported-size rule
through ``check_sizes`` (Mamba-2: headdim, dstate, ngroups | nheads). Value checks (:func:`check_indices`,
:func:`check_spec_values`; a device->host copy) run unless a CUDA graph is being captured (:func:`values_checked`).
Kernels are compiled by :mod:`.compile` for the device's arch, loaded once per (spec, device) and launched with
``cuda.core`` on torch's current stream, so launches are CUDA-graph safe. No family's geometry lives here.
"""

from __future__ import annotations

import collections
import functools
import math
import numbers
import threading
from typing import NamedTuple

import torch

from . import compile as _compile
from .cursor import ORDER_COLUMNS, check_row_order

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
F32, I32 = (torch.float32,), (torch.int32,)
# Dtype groups: the tensors of a group share one dtype of the group's set.
GROUPS = {"act": ACT_DTYPES, "state": STATE_DTYPES}
# The kernels move x, z, B, C, the checkpoint, its shadow and scales, the x / B rings and the snapshots
# in 16-byte vectors (cp.async, float4 loads and stores).
VECTOR_BYTES = 16

# ---- validation ----------------------------------------------------------------------------------
def fmt_dtypes(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(t, name: str, shape: tuple | None = None, dtypes=None, device=None,
                 align: int | None = VECTOR_BYTES) -> None:
    """One tensor: type, shape, dtype, device, contiguity, and a data pointer aligned to ``align`` bytes."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {fmt_dtypes(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if align and t.data_ptr() % align:
        raise ValueError(f"{name}: expected a {align}-byte aligned data pointer (vector loads), got {t.data_ptr():#x} "
                         f"(storage offset {t.storage_offset()} elements)")


class Arg(NamedTuple):
    """One tensor of a launch. ``dims``: a label per dimension (a size shared with other tensors) or an
    int (a fixed size); ``dtypes``: the allowed dtypes, or a group of GROUPS; ``align``: bytes (None:
    read as scalars, element alignment is enough)."""

    name: str
    t: object
    dims: tuple
    dtypes: tuple | str
    align: int | None = VECTOR_BYTES
    optional: bool = False


def row_order_arg(t, name: str = "row_order") -> Arg:
    """The launch check of a flush-first order tensor (:func:`.cursor.flush_order`): (batch, 4) int32, 16-byte rows
    (the decode kernels' one load a block)."""
    return Arg(name, t, ("batch", ORDER_COLUMNS), I32, 16, optional=True)


def vote(values: list, prefer=None):
    """The value most entries hold; a tie goes to a value ``prefer`` accepts, then to the first seen."""
    if values.count(values[0]) == len(values):  # the usual case: all agree
        return values[0]
    counts = collections.Counter(values)
    first: dict = {}
    for i, v in enumerate(values):
        first.setdefault(v, -i)
    return max(counts, key=lambda v: (counts[v], bool(prefer and prefer(v)), first[v]))

@functools.lru_cache(maxsize=256)
def label_positions(dims: tuple) -> tuple:
    """(label, ((tensor index, dim), ...)) for the dims of a launch's tensors (static per call site)."""
    pos: dict = {}
    for i, ds in enumerate(dims):
        for d, lab in enumerate(ds):
            if isinstance(lab, str):
                pos.setdefault(lab, []).append((i, d))
    return tuple((lab, tuple(p)) for lab, p in pos.items())


def check_args(args: list, check_sizes=None) -> tuple[dict, torch.device]:
    """Check the tensors of one launch against the sizes, dtypes and device most of them agree on (see the
    module docstring); returns (size by label, device). Callers check the rank of every tensor that alone
    carries a label first, so that every label has a size."""
    given = []
    for a in args:
        if a.t is None and a.optional:
            continue
        if not isinstance(a.t, torch.Tensor):
            raise TypeError(f"{a.name}: expected a torch.Tensor, got {type(a.t).__name__}")
        given.append(a)
    shapes = [a.t.shape for a in given]
    ranked = [len(s) == len(a.dims) for a, s in zip(given, shapes)]  # only these vote
    sizes = {lab: vote([shapes[i][d] for i, d in pos if ranked[i]])
             for lab, pos in label_positions(tuple(a.dims for a in given))}
    if check_sizes is not None:  # the family's supported sizes, named on the tensor that holds them
        check_sizes(given, shapes, sizes)
    group = {}
    for g, allowed in GROUPS.items():
        seen = [a.t.dtype for a in given if a.dtypes == g and a.t.dtype in allowed]
        if seen:
            group[g] = vote(seen)
    dev = vote([a.t.device for a in given], prefer=lambda d: d.type == "cuda")
    for a in given:
        shape = tuple(sizes[lab] if isinstance(lab, str) else lab for lab in a.dims)
        dtypes = a.dtypes
        if isinstance(dtypes, str):  # a dtype of the group's set that differs from the group's: the group's
            dtypes = (group[dtypes],) if a.t.dtype in GROUPS[dtypes] else GROUPS[dtypes]
        check_tensor(a.t, a.name, shape, dtypes, dev, a.align)
    return sizes, dev


def check_flag(value, name: str) -> None:
    """A launcher's bool option (compiled into the module: a truthy non-bool would pick a module silently)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def check_float(value, name: str, ok, want: str, type_want: str | None = None) -> None:
    """A launcher's float option: None passes (the default); else a real number, not a bool, finite, with ``ok``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {type_want or want}, got {type(value).__name__}")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name}: expected {want}, got {value}")


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def values_checked(check_values: bool | None) -> bool:
    return check_values if check_values is not None else not capturing()


def check_indices(state_batch_indices: torch.Tensor, nslots: int, cursor: torch.Tensor | None, L: int,
                  row_order: torch.Tensor | None = None) -> None:
    """Value checks that need a device->host copy (skipped while capturing a CUDA graph); with ``row_order``, also
    that it is the rows' order with their slots and cursors (:func:`.cursor.check_row_order`)."""
    sbi = state_batch_indices.cpu()
    bad = sbi[(sbi < -1) | (sbi >= nslots)]
    if bad.numel():
        raise ValueError(f"state_batch_indices: expected values in [-1, {nslots}), got {bad.tolist()[:8]}")
    used = sbi[sbi >= 0]
    slots, counts = used.unique(return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"state_batch_indices: expected each slot in at most one row (rows would race), got slots "
                         f"{slots[counts > 1].tolist()[:8]} in more than one row")
    if cursor is not None and used.numel():
        cur = cursor.cpu()[used.long()]
        bad = (cur < 0) | (cur >= L)
        if bad.any():
            raise ValueError(f"cursor: expected values in [0, {L}) for the rows' slots, got {cur[bad].tolist()[:8]} "
                             f"(slots {used[bad].tolist()[:8]})")
    if row_order is not None:
        check_row_order(row_order, state_batch_indices, cursor)

def check_rank(t, name: str, ndim: int, want: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a {want} torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")

def require_cuda(x, name: str = "x") -> None:
    # Last, so that shape, dtype and value errors are reported (and testable) on any device.
    if x.device.type != "cuda":
        raise ValueError(f"{name}: expected CUDA tensors, got device {x.device}")


# ---- loading and launching ---------------------------------------------------------------------------
_lock = threading.Lock()
_kernels: dict = {}


def arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def get_kernel(spec, name: str, device: torch.device):
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


def launch(spec, name: str, device, grid, block, args, pdl: bool = False, shmem: int = 0) -> None:
    """Launch kernel ``name`` of ``spec`` on torch's current stream. ``args``: ints for pointers,
    numpy.int32 for the int32 scalars, in the kernel's parameter order. ``pdl``: as a programmatic dependent launch
    (the kernel may start while the previous one in the stream runs, and waits for it with ``griddepcontrol.wait``
    before reading what it wrote). ``shmem``: bytes of dynamic shared memory (the kernel opted in to them first)."""
    from cuda.core import LaunchConfig, Stream
    from cuda.core import launch as _launch

    kern = get_kernel(spec, name, device)
    if shmem:
        _allow_dynamic_smem(kern, device.index, shmem)
    stream = Stream.from_handle(torch.cuda.current_stream(device).cuda_stream)
    _launch(stream, LaunchConfig(grid=grid, block=block, shmem_size=shmem, programmatic_stream_serialization=pdl),
            kern, *args)


_dynamic_smem: set = set()


def _allow_dynamic_smem(kern, index: int, nbytes: int) -> None:
    """Opt ``kern`` in to ``nbytes`` of dynamic shared memory on device ``index`` (beyond the 48 KB a block gets with its
    static part by default: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), once per kernel, device and size."""
    key = (id(kern), index, nbytes)
    if key in _dynamic_smem:
        return
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    h = kern.handle
    if isinstance(h, driver.CUkernel):  # cuda.core loads modules as libraries: a CUkernel, set per device
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, h, driver.CUdevice(index))
    else:
        (err,) = driver.cuFuncSetAttribute(h, attr, nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{nbytes} bytes of dynamic shared memory refused ({err!r}) for a kernel of {type(h).__name__}")
    _dynamic_smem.add(key)

@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def ptr(t):
    return 0 if t is None else t.data_ptr()

def check_window(T: int, L: int, what: str) -> None:
    if not 2 * T <= L <= 32:
        raise ValueError(f"{what}: expected in [2T, 32] = [{2 * T}, 32] (flush one window early, T={T}), got {L}")


def check_spec_values(state_batch_indices: torch.Tensor, nslots: int, num_tokens: int, cursor: torch.Tensor | None = None,
                      buffer_len: int | None = None, n_accepted: torch.Tensor | None = None) -> None:
    """Host value checks of the speculative ops (a device->host copy; skipped while capturing a graph):
    slots, cursor start in [0, L) and count in [0, L - T] for the rows' slots, n_accepted in [0, T]."""
    check_indices(state_batch_indices, nslots, None, 1)
    sbi = state_batch_indices.cpu()
    rows = (sbi >= 0).nonzero()[:, 0]
    T, L = num_tokens, buffer_len
    if cursor is not None and rows.numel():
        used = sbi[rows]
        cur = cursor.cpu()[used.long()]
        start, count = cur[:, 0], cur[:, 1]
        bad = (start < 0) | (start >= L)
        if bad.any():
            raise ValueError(f"cursor: expected start (column 0) in [0, {L}) for the rows' slots, got {start[bad].tolist()[:8]} "
                             f"(slots {used[bad].tolist()[:8]})")
        bad = (count < 0) | (count > L - T)
        if bad.any():
            raise ValueError(f"cursor: expected count (column 1) in [0, L - T] = [0, {L - T}] for the rows' slots, "
                             f"got {count[bad].tolist()[:8]} (slots {used[bad].tolist()[:8]})")
    if n_accepted is not None and rows.numel():
        n = n_accepted.cpu()[rows]
        bad = (n < 0) | (n > T)
        if bad.any():
            raise ValueError(f"n_accepted: expected values in [0, T] = [0, {T}] for rows with a slot, got {n[bad].tolist()[:8]} "
                             f"(rows {rows[bad].tolist()[:8]})")
