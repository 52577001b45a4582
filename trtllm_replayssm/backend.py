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

The reference computes in float64 and stores every cache back in its own dtype; y comes back in x's
dtype. Where the kernels fold the checkpoint inside the verify launch (flush one window early), the
reference does the same fold inside ``replay_verify`` and moves the ring cursor only in
``spec_commit``, so between two model steps both leave identical bookkeeping. Shadows (bf16, or fp8
with per-row scales) are rewritten from the fp32 checkpoint as stored, by :func:`write_shadow`
(:func:`.reference.quantize_shadow`, the one quantizer that :class:`.reference.Shadow` and the cache use).
"""

from __future__ import annotations

import torch

from . import reference, spec_reference
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


class ReferenceBackend:
    """The float64 specs of :mod:`.reference` and :mod:`.spec_reference` (any device; CPU in practice)."""

    name = "reference"

    def conventional_step(self, state, x, B, C, dt, dt_bias, A, D, sbi):
        wide = state.double()
        y = reference.conventional_step(wide, *map(_wide, (x, B, C, dt, dt_bias, A, D)), state_batch_indices=sbi)
        state.copy_(wide)
        return y.to(x.dtype)

    def replay_decode(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None):
        caches = [state, x_cache, B_cache, dt_cache]
        wide = [c.double() for c in caches]
        L = x_cache.shape[2]
        rows = sbi[sbi >= 0].long()
        flushed = rows[cursor[rows] == L - 1].tolist()  # the step that fills the buffer folds it
        sh = None if shadow is None else Shadow.wrap(shadow, shadow_scale)
        y = reference.replay_decode(*wide, cursor, *map(_wide, (x, B, C, dt, dt_bias, A, D)),
                                    state_batch_indices=sbi, shadow=sh)
        for c, w in zip(caches, wide):
            c.copy_(w)
        _rewrite_shadows(state, shadow, shadow_scale, flushed)  # from the fp32 checkpoint as stored
        return y.to(x.dtype)

    def advance_cursor(self, cursor, sbi, L):
        reference.advance_cursor(cursor, sbi, L)

    def replay_verify(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None):
        T, L = x.shape[1], x_cache.shape[2]
        sh = None if shadow is None else Shadow.wrap(shadow, shadow_scale)
        flushed = spec_reference.flush_checkpoint(state, x_cache, B_cache, dt_cache, cursor, A, T, sbi)
        _rewrite_shadows(state, shadow, shadow_scale, flushed)
        after = cursor.clone()  # the fold's cursor; the shared cursor itself moves once, in spec_commit
        spec_reference.flush_cursor(after, T, L, sbi)
        y = spec_reference.verify(state, x_cache, B_cache, dt_cache, after, x, B, C, dt, dt_bias, A, D,
                                  state_batch_indices=sbi, shadow=sh, flushed=flushed)
        return y.to(x.dtype)

    def spec_commit(self, cursor, n_accepted, sbi, T, L):
        spec_reference.flush_cursor(cursor, T, L, sbi)
        spec_reference.commit(cursor, n_accepted, T, L, sbi)

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
                      shadow=None, shadow_scale=None):
        return self.ops.replay_decode(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, sbi,
                                      shadow=shadow, shadow_scale=shadow_scale)

    def advance_cursor(self, cursor, sbi, L):
        self.ops.advance_cursor(cursor, sbi, L)

    def replay_verify(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None):
        return self.ops.replay_verify(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, sbi,
                                      shadow=shadow, shadow_scale=shadow_scale)

    def spec_commit(self, cursor, n_accepted, sbi, T, L):
        self.ops.spec_commit(cursor, n_accepted, sbi, T, L)

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
