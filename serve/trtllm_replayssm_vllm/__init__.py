# SPDX-License-Identifier: Apache-2.0
"""vLLM adapter: ReplaySSM Mamba-2 standard decode on vLLM's own state tensors, with no copies.

A serving integration (issue 36: they sit together under ``serve/``, beside the trtllm-serve module), installed as
the top-level package ``trtllm_replayssm_vllm`` (pyproject.toml; from a checkout that is not installed,
``PYTHONPATH=$PWD:$PWD/serve``). It imports the library by name and the library imports nothing of it.

vLLM (v1, ``--use-replayssm``, PR #48018 and later) keeps five tensors per Mamba-2 layer and KV-cache
block: conv state, ssm state (the checkpoint), x_cache, dt_cache and B_cache. They are not separate
allocations: every block is one page of raw bytes, and each tensor is a ``torch.as_strided`` view
``(num_blocks, *shape)`` whose block stride is the page size over its itemsize, at its byte offset
inside the page (pages may be padded to the attention page size). Per block the shapes and dtypes are
ours (trtllm_replayssm/contract.py): ssm (H, P, N) in the ssm cache dtype, x_cache (H, L, P) and B_cache
(G, L, N) in the activation dtype, dt_cache (H, L) float32 holding processed dt. What differs:

===========================  ==============================================  ===============================
vLLM                         this adapter                                    ops.replay_decode
===========================  ==============================================  ===============================
state / ring views           slot strides compiled into the kernel           contiguous (slots, ...)
x, B, C, z, dt, out          row-strided views of the projections, as given  contiguous (batch, ...)
A (H, P, N), D, dt_bias      TIE_HDIM expansions (stride 0 over P, N): the   (H,) float32
(H, P), dt (batch, H, P)     per-head scalars are read through the view
write_pos (batch,)           cursor per batch row, as given                  cursor per slot (slots,)
is_flush (batch,)            implied (write_pos == L - 1), checked           implied
null_block_id (0)            padding slot compiled into the kernel           -1 rows
causal_conv1d_update         vLLM's, unchanged (not here)                    ReplayStateCache.conv_update
===========================  ==============================================  ===============================

The strides are constants of the compiled module (:class:`trtllm_replayssm.config.Layout`): a serving engine's page
size and projection widths are fixed per model, so one module serves every step and every layer of a
geometry, with the memory traffic of the contiguous kernel. Measured on the H200 (bench/NOTES.md "vLLM
layout"): 2-4% slower than the contiguous module at bs 64-256 and 9% at bs 8 (address arithmetic of the
strided variant and the paged placement; 1.61x the conventional step at bs256, contiguous 1.67x).
``write_pos`` is what vLLM's metadata builder computes for its own ReplaySSM kernel, per decode row
(:func:`write_pos_from_positions` gives the plain case, ``(num_computed_tokens - num_prompt_tokens) % L``).

Not supported yet: **forced flushes.** Newer vLLM also sets ``is_flush`` where ``write_pos != L - 1``: a one-token
prefill leftover with prior state becomes a decode row with ``write_pos = 0, is_flush = 1`` (chunked prefill,
uniform full-CUDA-graph batches, disaggregated serving), and align-mode prefix caching forces a flush at every
block boundary (vllm v1/attention/backends/mamba_attn.py ``_compute_common_metadata``; its kernel reads the flag
per row). Our kernel folds only when the buffer fills. Eagerly the adapter refuses such a step (the ``is_flush``
check below, naming it); inside a CUDA graph the check cannot run (no host reads) and the forced-flush token
would be appended and later overwritten: serve with chunked prefill and prefix caching off, or without the
adapter, until the kernel takes a per-row flush flag (planned for the strided layout: ``flush = k == L ||
is_flush[b]``, the fold over the k entries there are; it needs a GPU session to validate).

On CUDA tensors the kernel runs; on CPU tensors the float64-checked reference (``families/mamba2/reference.py``) runs
on the same views, so the translation itself is tested in CI. Not covered: the speculative path
(vLLM's open PR #49847 keeps a post-conv ring with a rotating origin, another layout) and shadows
(vLLM keeps none); both stay on :mod:`trtllm_replayssm.families.mamba2.ops` / :class:`trtllm_replayssm.cache.ReplayStateCache`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from trtllm_replayssm import launch as _launch
from trtllm_replayssm.config import Layout
from trtllm_replayssm.families.mamba2 import ops as _ops
from trtllm_replayssm.families.mamba2 import reference as _ref

NULL_BLOCK_ID = 0  # vLLM v1 reserves KV-cache block 0 as the null block of padding rows
_ACT = (torch.bfloat16, torch.float16, torch.float32)
_STATE = (torch.float32, torch.bfloat16, torch.float16)


def write_pos_from_positions(num_computed_tokens: torch.Tensor, num_prompt_tokens: torch.Tensor,
                             buffer_len: int) -> torch.Tensor:
    """Per decode row, the replay-buffer entries since the checkpoint: (computed - prompt) mod L, int32.

    ``num_computed_tokens``: tokens of the request already in its state before this step (the position
    of the token being decoded); ``num_prompt_tokens``: the prompt, whose last prefill chunk left the
    checkpoint. The step flushes where the result is ``buffer_len - 1``.
    """
    if num_computed_tokens.shape != num_prompt_tokens.shape or num_computed_tokens.dim() != 1:
        raise ValueError(f"num_computed_tokens, num_prompt_tokens: expected two (batch,) tensors, got "
                         f"{tuple(num_computed_tokens.shape)} and {tuple(num_prompt_tokens.shape)}")
    if not 1 <= buffer_len <= 32:
        raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
    decoded = num_computed_tokens.long() - num_prompt_tokens.long()
    return torch.remainder(decoded, buffer_len).to(torch.int32)


class PagedLayer:
    """One Mamba-2 layer's ReplaySSM state laid out as vLLM lays it out (for tests and benchmarks; vLLM
    builds its own): ``blocks`` raw byte pages, each holding conv (conv_dim, K - 1), ssm (H, P, N),
    x_cache (H, L, P), dt_cache (H, L) float32 and B_cache (G, L, N) back to back plus ``pad_bytes`` (a
    page padded to the attention page size); ``views[name]`` is the ``torch.as_strided`` view
    (blocks, *shape) with the page as block stride, at its byte offset in the page.
    """

    PARTS = ("conv", "ssm", "x_cache", "dt_cache", "B_cache")

    def __init__(self, blocks: int, H: int, P: int, N: int, G: int, L: int, conv_kernel: int, act: torch.dtype,
                 state_dtype: torch.dtype, pad_bytes: int = 0, device="cpu", fill: int = 0):
        conv_dim = H * P + 2 * G * N
        parts = [((conv_dim, conv_kernel - 1), act), ((H, P, N), state_dtype), ((H, L, P), act),
                 ((H, L), torch.float32), ((G, L, N), act)]
        size = [int(np.prod(sh)) * torch.empty(0, dtype=d).element_size() for sh, d in parts]
        self.page, self.blocks = sum(size) + pad_bytes, blocks
        self.raw = torch.full((blocks * self.page,), fill, dtype=torch.uint8, device=device)
        self.views, self.offsets, off = {}, {}, 0
        for name, (shape, dtype), nbytes in zip(self.PARTS, parts, size):
            item = torch.empty(0, dtype=dtype).element_size()
            if self.page % item or off % item:
                raise ValueError(f"pad_bytes: page {self.page} or offset {off} of {name} is not a multiple of {item}")
            inner = torch.empty(shape, device="meta").stride()
            self.views[name] = torch.as_strided(self.raw.view(dtype), (blocks, *shape), (self.page // item, *inner),
                                                off // item)
            self.offsets[name] = (off, off + nbytes)
            off += nbytes


# ---- validation ------------------------------------------------------------------------------------
def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _lead_strided(t, name: str, shape: tuple, dtypes, device, align: bool) -> int:
    """Check a view whose trailing dims are contiguous and whose dim 0 may have any stride that does not
    overlap; return that stride (elements; the dense one where dim 0 has size <= 1)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(_name, dtypes))}, got {_name(t.dtype)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    inner = int(np.prod(shape[1:], dtype=np.int64))
    dense, acc = [], 1
    for n in reversed(shape[1:]):
        dense.insert(0, acc)
        acc *= n
    got = tuple(t.stride()[1:])
    if any(n > 1 and s != d for n, s, d in zip(shape[1:], got, dense)):
        raise ValueError(f"{name}: expected dims 1.. contiguous (strides {tuple(dense)}), got strides {got}; only "
                         f"dim 0 may be strided")
    lead = t.stride(0) if shape[0] > 1 else inner
    if lead < inner:
        raise ValueError(f"{name}: dim-0 stride {lead} is below the {inner} elements of one entry (entries "
                         f"would overlap)")
    if align:
        if t.data_ptr() % _launch.VECTOR_BYTES:
            raise ValueError(f"{name}: expected a {_launch.VECTOR_BYTES}-byte aligned data pointer (vector loads), "
                             f"got {t.data_ptr():#x} (storage offset {t.storage_offset()} elements)")
        if lead * t.element_size() % _launch.VECTOR_BYTES:
            raise ValueError(f"{name}: expected a dim-0 stride of a multiple of {_launch.VECTOR_BYTES} bytes (vector "
                             f"loads), got {lead} elements = {lead * t.element_size()} bytes")
    return lead


def _per_head(t, name: str, H: int, tied: tuple, device) -> torch.Tensor:
    """A per-head parameter given as (H,) or as vLLM's TIE_HDIM expansion ``tied`` (stride 0 over the
    trailing dims): the (H,) float32 view the kernel reads."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if tuple(t.shape) == (H,):
        v = t
    elif tuple(t.shape) == (H, *tied):
        if any(s != 0 for n, s in zip(t.shape[1:], t.stride()[1:]) if n > 1):
            raise ValueError(f"{name}: expected per-head values tied over the trailing dims (stride 0, vLLM's "
                             f"TIE_HDIM), got strides {tuple(t.stride())}")
        v = t[(slice(None),) + (0,) * len(tied)]
    else:
        raise ValueError(f"{name}: expected shape ({H},) or {(H, *tied)}, got {tuple(t.shape)}")
    if v.dtype != torch.float32 or not v.is_contiguous():
        v = v.to(torch.float32).contiguous()  # (H,) floats; a real deployment passes float32 params
    return v


def _dt_view(dt, batch: int, H: int, P: int, device) -> tuple[torch.Tensor, int]:
    """dt as (batch, H) with head stride 1 (from (batch, H) or vLLM's (batch, H, P) tied over P); its row stride."""
    if not isinstance(dt, torch.Tensor):
        raise TypeError(f"dt: expected a torch.Tensor, got {type(dt).__name__}")
    if dt.dim() == 3:
        if tuple(dt.shape) != (batch, H, P) or (P > 1 and dt.stride(2) != 0):
            raise ValueError(f"dt: expected (batch, nheads) or ({batch}, {H}, {P}) tied over headdim (stride 0), "
                             f"got shape {tuple(dt.shape)} strides {tuple(dt.stride())}")
        dt = dt[:, :, 0]
    return dt, _lead_strided(dt, "dt", (batch, H), _ACT, device, align=False)


def _index_view(t, name: str, batch: int, device) -> tuple[torch.Tensor, int]:
    """state_batch_indices as (batch,) int32 (vLLM passes (batch,) or a (batch, T) table read at column 0)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 2:
        t = t[:, 0]
    if tuple(t.shape) != (batch,) or t.dtype != torch.int32 or t.device != device:
        raise ValueError(f"{name}: expected ({batch},) or ({batch}, T) int32 on {device}, got {tuple(t.shape)} "
                         f"{_name(t.dtype)} on {t.device}")
    return t, (t.stride(0) if batch > 1 else 1)


@dataclasses.dataclass
class _Call:
    x: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    dt: torch.Tensor
    dt_bias: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    z: torch.Tensor | None
    sbi: torch.Tensor
    write_pos: torch.Tensor
    out: torch.Tensor
    layout: Layout


def _prepare(state, x, dt, A, B, C, D, dt_bias, z, x_cache, dt_cache, B_cache, write_pos, is_flush,
             max_cache_len, state_batch_indices, null_block_id, out, check_values) -> _Call:
    for name, t, nd in (("state", state, 4), ("x", x, 3), ("B", B, 3), ("x_cache", x_cache, 4)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            raise ValueError(f"{name}: expected a {nd}-d tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    S, H, P, N = state.shape
    batch, G = x.shape[0], B.shape[1]
    L = x_cache.shape[2]
    dev = state.device
    if max_cache_len != L:
        raise ValueError(f"max_cache_len: {max_cache_len} differs from x_cache's buffer length (dim 2) {L}")
    if not 1 <= L <= 32:
        raise ValueError(f"x_cache: buffer_len (dim 2) must be in 1..32, got {L}")
    if H % max(G, 1):
        raise ValueError(f"B: ngroups {G} must divide nheads {H}")
    slot_state = _lead_strided(state, "state", (S, H, P, N), _STATE, dev, align=True)
    act = x.dtype
    acts = (act,) if act in _ACT else _ACT
    slot_x = _lead_strided(x_cache, "x_cache", (S, H, L, P), acts, dev, align=True)
    slot_B = _lead_strided(B_cache, "B_cache", (S, G, L, N), acts, dev, align=True)
    slot_dt = _lead_strided(dt_cache, "dt_cache", (S, H, L), (torch.float32,), dev, align=False)
    row_x = _lead_strided(x, "x", (batch, H, P), _ACT, dev, align=True)
    row_B = _lead_strided(B, "B", (batch, G, N), acts, dev, align=True)
    row_C = _lead_strided(C, "C", (batch, G, N), acts, dev, align=True)
    row_z = _lead_strided(z, "z", (batch, H, P), acts, dev, align=False) if z is not None else H * P
    dt, row_dt = _dt_view(dt, batch, H, P, dev)
    if dt.dtype != act:
        raise TypeError(f"dt: expected dtype {_name(act)} (the activations'), got {_name(dt.dtype)}")
    if out is None:
        out = torch.empty((batch, H, P), dtype=act, device=dev)
    row_y = _lead_strided(out, "out", (batch, H, P), (act,), dev, align=False)
    sbi, row_sbi = _index_view(state_batch_indices, "state_batch_indices", batch, dev)
    if not isinstance(write_pos, torch.Tensor) or tuple(write_pos.shape) != (batch,) or \
            write_pos.dtype != torch.int32 or write_pos.device != dev or not write_pos.is_contiguous():
        raise ValueError(f"write_pos: expected a contiguous ({batch},) int32 tensor on {dev} (vLLM's per-row "
                         f"cursor), got {tuple(write_pos.shape) if isinstance(write_pos, torch.Tensor) else write_pos}")
    A = _per_head(A, "A", H, (P, N), dev)
    D = _per_head(D, "D", H, (P,), dev)
    dt_bias = _per_head(dt_bias, "dt_bias", H, (P,), dev)
    if _launch.values_checked(check_values):
        _check_values(sbi, write_pos, is_flush, S, L, null_block_id)
    lay = Layout(slot_state=slot_state, slot_x=slot_x, slot_B=slot_B, slot_dt=slot_dt, row_x=row_x, row_B=row_B,
                 row_C=row_C, row_dt=row_dt, row_z=row_z, row_y=row_y, row_sbi=row_sbi, null_slot=null_block_id)
    return _Call(x, B, C, dt, dt_bias, A, D, z, sbi, write_pos, out, lay)


def _check_values(sbi, write_pos, is_flush, S: int, L: int, null: int) -> None:
    """Host checks (a device->host copy; skipped while capturing a CUDA graph)."""
    s, w = sbi.cpu(), write_pos.cpu()
    live = (s >= 0) & (s != null)
    bad = s[live & (s >= S)]
    if bad.numel():
        raise ValueError(f"state_batch_indices: expected blocks in [0, {S}) or the null block {null}, got "
                         f"{bad.tolist()[:8]}")
    used = s[live]
    blocks, counts = used.unique(return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"state_batch_indices: expected each block in at most one row (rows would race), got "
                         f"blocks {blocks[counts > 1].tolist()[:8]} in more than one row")
    wl = w[live]
    if ((wl < 0) | (wl >= L)).any():
        raise ValueError(f"write_pos: expected values in [0, {L}) on the live rows, got "
                         f"{wl[(wl < 0) | (wl >= L)].tolist()[:8]}")
    if is_flush is not None:
        f = is_flush.reshape(-1)[: s.numel()].cpu().bool()
        want = w == L - 1
        if (f[live] != want[live]).any():
            raise ValueError(f"is_flush: expected write_pos == {L - 1} (a flush when the buffer fills; forced "
                             f"flushes are not supported), got rows {torch.nonzero(f != want)[:8, 0].tolist()}")


# ---- the step -----------------------------------------------------------------------------------------
def selective_state_update_replayssm(state, x, dt, A, B, C, D=None, dt_bias=None, z=None, dt_softplus=True,
                                     x_cache=None, dt_cache=None, B_cache=None, bc_pre=None, write_pos=None,
                                     is_flush=None, max_cache_len=16, state_batch_indices=None,
                                     null_block_id=NULL_BLOCK_ID, out=None,
                                     check_values: bool | None = None) -> torch.Tensor:
    """One ReplaySSM decode step of a Mamba-2 layer on vLLM's tensors (the parameters, in order, of vLLM's
    ``selective_state_update_replayssm_triton``); writes and returns ``out`` (batch, H, P).

    Reads the checkpoint ``state`` and the rings, appends this step's x / B / processed dt at
    ``write_pos`` of each row's block, and on rows with ``write_pos == max_cache_len - 1`` writes the
    folded state back instead (the flush). Rows whose block is ``null_block_id`` (or negative) are
    padding: nothing of them is read or written, their ``out`` rows are left as they are. ``bc_pre``
    (vLLM's B.C scratch) is not needed: the kernel computes B.C itself. ``check_values`` (default:
    unless capturing a CUDA graph): block, cursor and is_flush values on the host.
    """
    if not dt_softplus:
        raise ValueError("dt_softplus: ReplaySSM buffers processed dt = softplus(dt + dt_bias); got dt_softplus=False")
    for name, t in (("D", D), ("dt_bias", dt_bias), ("x_cache", x_cache), ("dt_cache", dt_cache),
                    ("B_cache", B_cache), ("write_pos", write_pos), ("state_batch_indices", state_batch_indices)):
        if t is None:
            raise ValueError(f"{name}: required by the ReplaySSM decode step, got None")
    del bc_pre
    c = _prepare(state, x, dt, A, B, C, D, dt_bias, z, x_cache, dt_cache, B_cache, write_pos, is_flush,
                 max_cache_len, state_batch_indices, null_block_id, out, check_values)
    batch = x.shape[0]
    if batch == 0:
        return c.out
    if state.device.type != "cuda":
        _reference_step(state, x_cache, B_cache, dt_cache, c)
        return c.out
    S, H, P, N = state.shape
    spec = _ops.make_spec(state, x, H, P, N, B.shape[1], x_cache.shape[2], batch, z is not None, x.device)
    spec = dataclasses.replace(spec, layout=c.layout)
    args = [t.data_ptr() for t in (c.x, c.B, c.C, c.dt, c.dt_bias, c.A, c.D, c.z) if t is not None]
    args += [c.sbi.data_ptr(), c.write_pos.data_ptr(), state.data_ptr(), x_cache.data_ptr(), B_cache.data_ptr(),
             dt_cache.data_ptr(), np.int32(batch), np.int32(S), c.out.data_ptr(), state.data_ptr(),
             x_cache.data_ptr(), B_cache.data_ptr(), dt_cache.data_ptr()]
    dev = x.device
    _launch.launch(spec, "replayssm_decode", dev, spec.grid(batch, _launch.sm_count(dev.index)), (spec.threads, 1, 1), args)
    return c.out


def _reference_step(state, x_cache, B_cache, dt_cache, c: _Call) -> None:
    """The CPU path: reference.replay_decode in float64 on copies of the live rows' blocks (compacted, with the
    per-row cursor), stored back into the views in their own dtypes; padding rows and other blocks untouched."""
    live = (c.sbi >= 0) & (c.sbi != c.layout.null_slot)
    blocks = c.sbi[live].long()
    if not blocks.numel():
        return
    views = (state, x_cache, B_cache, dt_cache)
    wide = [v[blocks].double() for v in views]
    sbi = torch.full_like(c.sbi, -1)
    sbi[live] = torch.arange(blocks.numel(), dtype=sbi.dtype)
    act = [None if t is None else t.double() for t in (c.x, c.B, c.C, c.dt, c.dt_bias, c.A, c.D, c.z)]
    y = _ref.replay_decode(*wide, c.write_pos[live], *act[:7], z=act[7], state_batch_indices=sbi)
    for v, w in zip(views, wide):
        v[blocks] = w.to(v.dtype)
    c.out[live] = y[live].to(c.out.dtype)


@torch.library.custom_op("trtllm_replayssm::vllm_mamba2_decode",
                         mutates_args=("state", "x_cache", "B_cache", "dt_cache", "out"))
def vllm_mamba2_decode_op(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                          C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, x_cache: torch.Tensor,
                          dt_cache: torch.Tensor, B_cache: torch.Tensor, write_pos: torch.Tensor,
                          state_batch_indices: torch.Tensor, out: torch.Tensor, z: torch.Tensor | None = None,
                          null_block_id: int = NULL_BLOCK_ID, is_flush: torch.Tensor | None = None) -> None:
    """The registered op (``torch.ops.trtllm_replayssm.vllm_mamba2_decode``) a vLLM backend calls from its
    own custom op: opaque to torch.compile, capturable in a CUDA graph (no host checks while capturing).
    ``is_flush``: vLLM's per-row flag, checked eagerly as in :func:`selective_state_update_replayssm`."""
    selective_state_update_replayssm(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z, x_cache=x_cache,
                                     dt_cache=dt_cache, B_cache=B_cache, write_pos=write_pos, is_flush=is_flush,
                                     max_cache_len=x_cache.shape[2], state_batch_indices=state_batch_indices,
                                     null_block_id=null_block_id, out=out)


@vllm_mamba2_decode_op.register_fake
def _(state, x, dt, A, B, C, D, dt_bias, x_cache, dt_cache, B_cache, write_pos, state_batch_indices, out, z=None,
      null_block_id=NULL_BLOCK_ID, is_flush=None):
    return None
