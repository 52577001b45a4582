# SPDX-License-Identifier: Apache-2.0
"""The two executors of the SSM step, chosen once per device: the float64 reference and the kernels.

:func:`for_device` returns :data:`KERNELS` for CUDA tensors and :data:`REFERENCE` otherwise. Both
have the same methods with the same arguments, tensors in the layouts of the state contract
(cache.py's docstring), and mutate the caches they are given in the same way; the caller decides
once, when it allocates its state, and never branches per call:

  conventional_step(state, x, B, C, dt, dt_bias, A, D, sbi) -> y          S read and written
  replay_decode(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                shadow=None, shadow_scale=None) -> y                       (slots,) cursor read only
  advance_cursor(cursor, sbi, L)                                           once per model step
  replay_verify(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                shadow=None, shadow_scale=None) -> y (batch, T, H, P)      (slots, 2) ring cursor
  spec_commit(cursor, n_accepted, sbi, T, L)                               once per model step
  native_spec_verify(state, snapshots, x, B, C, dt, dt_bias, A, D, sbi) -> y
  native_spec_commit(state, snapshots, n_accepted, sbi)                    per layer
  gdn_replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None)
                                                 -> y (batch, HV, V)      Gated DeltaNet, (slots,) cursor
  gdn_replay_verify(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None)
                                                 -> y (batch, T, HV, V)   Gated DeltaNet, (slots, 2) cursor

The step methods also take ``out`` (outputs written into it, rows with a slot only) and ``check_values`` (the
launchers' host checks; the reference reads the host anyway), the Mamba-2 ones ``z``; the cursor moves take
``check_values``. ``read_shadow=False`` (reference only; not on ``gdn_replay_decode``, whose shadow is always
read) keeps the shadow rewritten at each fold without reading it, the CPU cache's default: the kernels always
read the shadow they are given. :class:`.cache.ReplayStateCache` takes its executor here once, at construction.

The reference computes in float64 and stores every cache back in its own dtype; y comes back in x's
dtype. Where the kernels fold the checkpoint inside the verify launch (flush one window early), the
reference does the same fold inside ``replay_verify`` and moves the ring cursor only in
``spec_commit``, so between two model steps both leave identical bookkeeping. Shadows (bf16, or fp8
with per-row scales) are rewritten from the fp32 checkpoint as stored, by :func:`write_shadow`
(:func:`.reference.quantize_shadow`, the one quantizer that :class:`.reference.Shadow` and the cache use).
"""

from __future__ import annotations

import torch

from . import gdn_reference, reference, spec_reference
from .config import CKPT8_DTYPE
from .reference import Shadow

write_shadow = reference.quantize_shadow  # every slot at once: write_shadow(state, shadow, shadow_scale)


def _wide(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _rewrite_shadows(state, shadow, shadow_scale, slots) -> None:
    """The shadow of each slot in ``slots`` from the checkpoint as stored (what the kernels do)."""
    if shadow is None or not len(slots):
        return
    idx = torch.as_tensor(slots, dtype=torch.long, device=state.device)
    q = shadow[idx]
    s = None if shadow_scale is None else shadow_scale[idx]
    write_shadow(state[idx], q, s)
    shadow[idx] = q
    if s is not None:
        shadow_scale[idx] = s


def _into(y, dtype, out, sbi):
    """The reference's outputs (padding rows NaN) in the activation dtype, or written into ``out`` (rows with a
    slot only, as the kernels leave padding rows of ``out`` untouched)."""
    if out is None:
        return y.to(dtype)
    rows = sbi >= 0
    out[rows] = y[rows].to(out.dtype)
    return out


def _check_rows_out(sbi, out, shape) -> None:
    """The rows' slots (batch,) and ``out`` (the outputs' shape), checked before a step writes anything (as the
    kernel launchers do): the reference folds checkpoints before it computes the outputs."""
    if sbi is not None:
        spec_reference._check_shape(sbi, "state_batch_indices", tuple(shape[:1]))
    if out is not None:
        spec_reference._check_shape(out, "out", tuple(shape))


def _check_decode_rows(cursor, L: int, nslots: int, batch: int, sbi) -> None:
    """The rows' slots and cursors of a standard decode step, checked before it writes (the shadow of a folding
    row is written in place)."""
    rows = [int(s) for s in (torch.arange(batch) if sbi is None else sbi).tolist() if s >= 0]
    bad = [s for s in rows if not 0 <= s < nslots or not 0 <= int(cursor[s]) < L]
    if bad:
        raise ValueError(f"state_batch_indices / cursor: slots in [0, {nslots}) with cursor in [0, {L}) expected, got "
                         f"slots {bad[:8]}")


def _reads_its_shadow(shadow, read_shadow: bool) -> None:
    if shadow is not None and not read_shadow:
        raise ValueError("read_shadow: the kernels always read the shadow they are given (pass shadow=None)")


class ReferenceBackend:
    """The float64 specs of :mod:`.reference` and :mod:`.spec_reference` (any device; CPU in practice)."""

    name = "reference"

    def conventional_step(self, state, x, B, C, dt, dt_bias, A, D, sbi):
        wide = state.double()
        y = reference.conventional_step(wide, *map(_wide, (x, B, C, dt, dt_bias, A, D)), state_batch_indices=sbi)
        state.copy_(wide)
        return y.to(x.dtype)

    def replay_decode(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True,
                      ckpt_scale=None, ckpt_flushes=None, ckpt_seed=0):
        if state.dtype == CKPT8_DTYPE:  # an 8-bit checkpoint: the spec reads and writes it in place
            _check_rows_out(sbi, out, x.shape)
            _check_decode_rows(cursor, x_cache.shape[2], state.shape[0], x.shape[0], sbi)
            ck = reference.Checkpoint8.wrap(state, ckpt_scale, ckpt_flushes, "sr", ckpt_seed)
            rings = [x_cache, B_cache, dt_cache]
            wide = [c.double() for c in rings]
            y = reference.replay_decode(None, *wide, cursor, *map(_wide, (x, B, C, dt, dt_bias, A, D, z)),
                                        state_batch_indices=sbi, ckpt8=ck)
            for c, w in zip(rings, wide):
                c.copy_(w)
            return _into(y, x.dtype, out, sbi)
        sh = None if shadow is None or not read_shadow else Shadow.wrap(shadow, shadow_scale)
        # every input, out and the rows checked before anything is written (as the kernel launchers do)
        spec_reference.check_verify_inputs(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z,
                                           standard=True)
        if shadow is not None:  # also when it is not read: a fold rewrites it
            spec_reference._check_shape(shadow, "shadow", tuple(state.shape))
        _check_rows_out(sbi, out, x.shape)
        L = x_cache.shape[2]
        _check_decode_rows(cursor, L, state.shape[0], x.shape[0], sbi)
        caches = [state, x_cache, B_cache, dt_cache]
        wide = [c.double() for c in caches]
        rows = sbi[sbi >= 0].long()
        flushed = rows[cursor[rows] == L - 1].tolist()  # the step that fills the buffer folds it
        y = reference.replay_decode(*wide, cursor, *map(_wide, (x, B, C, dt, dt_bias, A, D, z)),
                                    state_batch_indices=sbi, shadow=sh)
        for c, w in zip(caches, wide):
            c.copy_(w)
        _rewrite_shadows(state, shadow, shadow_scale, flushed)  # from the fp32 checkpoint as stored
        return _into(y, x.dtype, out, sbi)

    def advance_cursor(self, cursor, sbi, L, *, check_values=None, flushes=None):
        reference.advance_cursor(cursor, sbi, L, flushes)

    def replay_verify(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True):
        sh = None if shadow is None or not read_shadow else Shadow.wrap(shadow, shadow_scale)
        # every input checked before the fold writes the checkpoint (as the kernel launchers do before launching)
        spec_reference.check_verify_inputs(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z, sh)
        _check_rows_out(sbi, out, x.shape)
        T, L = x.shape[1], x_cache.shape[2]
        flushed = spec_reference.flush_checkpoint(state, x_cache, B_cache, dt_cache, cursor, A, T, sbi)
        _rewrite_shadows(state, shadow, shadow_scale, flushed)
        after = cursor.clone()  # the fold's cursor; the shared cursor itself moves once, in spec_commit
        spec_reference.flush_cursor(after, T, L, sbi)
        y = spec_reference.verify(state, x_cache, B_cache, dt_cache, after, x, B, C, dt, dt_bias, A, D, z,
                                  state_batch_indices=sbi, shadow=sh, flushed=flushed)
        return _into(y, x.dtype, out, sbi)

    def spec_commit(self, cursor, n_accepted, sbi, T, L, *, check_values=None):
        spec_reference.flush_cursor(cursor, T, L, sbi)
        spec_reference.commit(cursor, n_accepted, T, L, sbi)

    def gdn_replay_decode(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                          check_values=None, use_qk_l2norm=True, scale=None):
        sh = None if shadow is None else Shadow.wrap(shadow, None)
        if isinstance(v, torch.Tensor) and v.dim() == 3:  # the other shapes: gdn_reference's checks, before a write
            _check_rows_out(sbi, out, v.shape)
        y = gdn_reference.replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=sh,
                                        use_qk_l2norm=use_qk_l2norm, scale=scale)
        return _into(y, v.dtype, out, sbi)

    def gdn_replay_verify(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                          check_values=None, read_shadow=True, use_qk_l2norm=True, scale=None):
        sh = None if shadow is None else Shadow.wrap(shadow, None)
        if not isinstance(v, torch.Tensor) or v.dim() != 4:
            raise ValueError(f"v: expected a (batch, T, value_heads, value_dim) tensor, got "
                             f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        # every input checked before the fold writes the checkpoint (as the kernel launchers do before launching)
        gdn_reference.check_inputs(buf, q, k, v, a, b, A_log, dt_bias, tuple(v.shape[:2]))
        _check_rows_out(sbi, out, v.shape)
        T, L = v.shape[1], buf.u_cache.shape[2]
        flushed = gdn_reference.flush_checkpoint(buf, cursor, T, sbi, sh)  # the shadow rewritten from what it stored
        after = cursor.clone()
        spec_reference.flush_cursor(after, T, L, sbi)
        y = gdn_reference.verify(buf, after, q, k, v, a, b, A_log, dt_bias, sbi, shadow=sh if read_shadow else None,
                                 flushed=set(flushed), use_qk_l2norm=use_qk_l2norm, scale=scale)
        return _into(y, v.dtype, out, sbi)

    def native_spec_verify(self, state, snapshots, x, B, C, dt, dt_bias, A, D, sbi):
        return spec_reference.native_spec_verify(state, snapshots, x, B, C, dt, dt_bias, A, D,
                                                 state_batch_indices=sbi).to(x.dtype)

    def native_spec_commit(self, state, snapshots, n_accepted, sbi):
        spec_reference.native_spec_commit(state, snapshots, n_accepted, sbi)


class KernelBackend:
    """The CUDA kernels through the validated launchers of :mod:`.ops` (graph-safe)."""

    name = "kernels"

    def __init__(self):
        from . import ops  # cuda.core is imported only where the kernels run

        self.ops = ops

    def conventional_step(self, state, x, B, C, dt, dt_bias, A, D, sbi):
        return self.ops.conventional_step(x, B, C, dt, dt_bias, A, D, state, sbi)

    def replay_decode(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True,
                      ckpt_scale=None, ckpt_flushes=None, ckpt_seed=0):
        _reads_its_shadow(shadow, read_shadow)
        return self.ops.replay_decode(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, sbi,
                                      z=z, out=out, check_values=check_values, shadow=shadow,
                                      shadow_scale=shadow_scale, ckpt_scale=ckpt_scale, ckpt_flushes=ckpt_flushes,
                                      ckpt_seed=ckpt_seed)

    def advance_cursor(self, cursor, sbi, L, *, check_values=None, flushes=None):
        self.ops.advance_cursor(cursor, sbi, L, check_values=check_values, flushes=flushes)

    def replay_verify(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True):
        _reads_its_shadow(shadow, read_shadow)
        return self.ops.replay_verify(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, sbi,
                                      z=z, out=out, check_values=check_values, shadow=shadow,
                                      shadow_scale=shadow_scale)

    def spec_commit(self, cursor, n_accepted, sbi, T, L, *, check_values=None):
        self.ops.spec_commit(cursor, n_accepted, sbi, T, L, check_values=check_values)

    def gdn_replay_decode(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                          check_values=None, use_qk_l2norm=True, scale=None):
        from . import gdn_ops

        return gdn_ops.gdn_replay_decode(q, k, v, a, b, A_log, dt_bias, buf.state, buf.u_cache, buf.v_cache,
                                         buf.k_cache, buf.g_cache, buf.beta_cache, cursor, sbi, out=out,
                                         shadow=shadow, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                         check_values=check_values)

    def gdn_replay_verify(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                          check_values=None, read_shadow=True, use_qk_l2norm=True, scale=None):
        from . import gdn_ops

        _reads_its_shadow(shadow, read_shadow)
        return gdn_ops.gdn_replay_verify(q, k, v, a, b, A_log, dt_bias, buf.state, buf.u_cache, buf.v_cache,
                                         buf.k_cache, buf.g_cache, buf.beta_cache, cursor, sbi, out=out,
                                         shadow=shadow, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                         check_values=check_values)

    def native_spec_verify(self, state, snapshots, x, B, C, dt, dt_bias, A, D, sbi):
        return self.ops.native_spec_verify(x, B, C, dt, dt_bias, A, D, state, snapshots, sbi)

    def native_spec_commit(self, state, snapshots, n_accepted, sbi):
        self.ops.native_spec_commit(state, snapshots, n_accepted, sbi)


REFERENCE = ReferenceBackend()
_KERNELS: KernelBackend | None = None


def for_device(device) -> ReferenceBackend | KernelBackend:
    """The kernels for a CUDA device, the float64 reference for any other."""
    global _KERNELS
    if torch.device(device).type != "cuda":
        return REFERENCE
    if _KERNELS is None:
        _KERNELS = KernelBackend()
    return _KERNELS


# ---- the launchers' keyword form ---------------------------------------------------------------------------
# The graph nodes of builders/ (and the onnxruntime custom ops that mirror them) and the trtllm-serve adapter
# take injectable callables with the keyword signature of the ops launchers (ops.replay_decode(x=, ..., state=,
# ...)). These give an executor's methods that form, so the float64 reference and the kernels have one home.
def _mamba_kw(method):
    def step(*, x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, state_batch_indices, z=None,
             out=None, check_values=None, shadow=None, shadow_scale=None):
        return method(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, state_batch_indices, shadow,
                      shadow_scale, z=z, out=out, check_values=check_values)

    step.executor = method.__self__
    return step


def replay_decode_kw(executor):
    """``executor.replay_decode`` as ``fn(*, x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor,
    state_batch_indices, z=None, out=None, check_values=None, shadow=None, shadow_scale=None) -> y``."""
    return _mamba_kw(executor.replay_decode)


def replay_verify_kw(executor):
    """``executor.replay_verify`` in the keyword form of :func:`replay_decode_kw` (x (batch, T, H, P), ...)."""
    return _mamba_kw(executor.replay_verify)


def spec_commit_kw(executor):
    """``executor.spec_commit`` as ``fn(*, cursor, n_accepted, state_batch_indices, num_tokens, buffer_len) ->
    cursor`` (moved in place)."""

    def spec_commit(*, cursor, n_accepted, state_batch_indices, num_tokens: int, buffer_len: int, check_values=None):
        executor.spec_commit(cursor, n_accepted, state_batch_indices, num_tokens, buffer_len, check_values=check_values)
        return cursor

    spec_commit.executor = executor
    return spec_commit


def _gdn_kw(method, contiguous: bool):
    def step(buf, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices, shadow=None):
        if contiguous:  # the builders hand views of the projections; TensorRT hands a plugin LINEAR inputs
            q, k, v, a, b = (t.contiguous() for t in (q, k, v, a, b))
        return method(buf, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices, shadow)

    step.executor = method.__self__
    return step


def gdn_replay_decode_kw(executor, contiguous: bool = False):
    """``executor.gdn_replay_decode`` as ``fn(buf, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices,
    shadow=None)`` (a bf16 shadow of the checkpoint: read by non-flush steps, rewritten by flushes)
    (the builders' GDN decode node); ``contiguous``: q, k, v, a, b made contiguous first (the kernels need it)."""
    return _gdn_kw(executor.gdn_replay_decode, contiguous)


def gdn_replay_verify_kw(executor, contiguous: bool = False):
    """``executor.gdn_replay_verify`` in the keyword form of :func:`gdn_replay_decode_kw` (q (batch, T, Hk, Kd), ...)."""
    return _gdn_kw(executor.gdn_replay_verify, contiguous)
