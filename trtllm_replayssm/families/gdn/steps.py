# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet's steps on each executor (:mod:`trtllm_replayssm.backend`): the float64 spec and the CUDA kernels.

``buf`` holds one layer's checkpoint and rings (:class:`~trtllm_replayssm.families.gdn.reference.GDNBuffers`), ``shadow``
its optional bf16 copy of the checkpoint; the same arguments on both executors:

  replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None) -> y (batch, HV, V)
                                                 (slots,) cursor read only; a shadow is always read
  replay_verify(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None) -> y (batch, T, HV, V)
                                                 (slots, 2) ring cursor read only

Keywords: ``out``, ``check_values``, ``use_qk_l2norm``, ``scale``; ``replay_verify`` also ``read_shadow``.
:func:`replay_decode_kw` / :func:`replay_verify_kw`: an executor's step in the builders' form ``fn(buf, cursor, q,
k, v, a, b, A_log, dt_bias, state_batch_indices, shadow=None)`` (the GDN graph nodes); :class:`Injected`: that
form as an executor's steps.
"""

from __future__ import annotations

import torch

from ... import cursor as cursors
from ...backend import Steps, check_rows_out, into, reads_its_shadow, run_into
from ...shadow import Shadow
from . import reference as gdn_reference


class Reference(Steps):
    """The float64 spec of :mod:`trtllm_replayssm.families.gdn.reference`."""

    def replay_decode(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, use_qk_l2norm=True, scale=None, row_order=None):
        if row_order is not None:  # the order of the kernels' blocks: no row's result depends on it
            cursors.check_row_order(row_order, sbi, cursor)
        sh = None if shadow is None else Shadow.wrap(shadow, None)
        if isinstance(v, torch.Tensor) and v.dim() == 3:  # the other shapes: gdn_reference's checks, before a write
            check_rows_out(sbi, out, v.shape)
        y = gdn_reference.replay_decode(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=sh,
                                        use_qk_l2norm=use_qk_l2norm, scale=scale)
        return into(y, v.dtype, out, sbi)

    def replay_verify(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, read_shadow=True, use_qk_l2norm=True, scale=None):
        sh = None if shadow is None else Shadow.wrap(shadow, None)
        if not isinstance(v, torch.Tensor) or v.dim() != 4:
            raise ValueError(f"v: expected a (batch, T, value_heads, value_dim) tensor, got "
                             f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        # every input checked before the fold writes the checkpoint (as the kernel launchers do before launching)
        gdn_reference.check_inputs(buf, q, k, v, a, b, A_log, dt_bias, tuple(v.shape[:2]))
        check_rows_out(sbi, out, v.shape)
        T, L = v.shape[1], buf.u_cache.shape[2]
        flushed = gdn_reference.flush_checkpoint(buf, cursor, T, sbi, sh)  # the shadow rewritten from what it stored
        after = cursor.clone()
        cursors.flush_cursor(after, T, L, sbi)
        y = gdn_reference.verify(buf, after, q, k, v, a, b, A_log, dt_bias, sbi, shadow=sh if read_shadow else None,
                                 flushed=set(flushed), use_qk_l2norm=use_qk_l2norm, scale=scale)
        return into(y, v.dtype, out, sbi)


class Kernels(Steps):
    """The CUDA kernels through the validated launchers of :mod:`trtllm_replayssm.families.gdn.ops` (graph-safe)."""

    def replay_decode(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, use_qk_l2norm=True, scale=None, row_order=None):
        from . import ops as gdn_ops  # cuda.core is imported only where the kernels run

        return gdn_ops.gdn_replay_decode(q, k, v, a, b, A_log, dt_bias, buf.state, buf.u_cache, buf.v_cache,
                                         buf.k_cache, buf.g_cache, buf.beta_cache, cursor, sbi, out=out,
                                         shadow=shadow, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                         check_values=check_values, row_order=row_order)

    def replay_verify(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, read_shadow=True, use_qk_l2norm=True, scale=None):
        from . import ops as gdn_ops  # cuda.core is imported only where the kernels run

        reads_its_shadow(shadow, read_shadow)
        return gdn_ops.gdn_replay_verify(q, k, v, a, b, A_log, dt_bias, buf.state, buf.u_cache, buf.v_cache,
                                         buf.k_cache, buf.g_cache, buf.beta_cache, cursor, sbi, out=out,
                                         shadow=shadow, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                         check_values=check_values)


class Injected(Steps):
    """The standard step as ``step(*, buf, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices)`` (the
    builders' form; backend.InjectedExecutor)."""

    def __init__(self, executor, step):
        super().__init__(executor)
        self.step = step

    def replay_decode(self, buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, use_qk_l2norm=True, scale=None):
        return run_into(out, self.step(buf=buf, cursor=cursor, q=q, k=k, v=v, a=a, b=b, A_log=A_log,
                                       dt_bias=dt_bias, state_batch_indices=sbi))


STEPS = {"reference": Reference, "kernels": Kernels}


# ---- the builders' form ---------------------------------------------------------------------------------------
def _kw(method, executor, contiguous: bool, decode: bool = False):
    def step(buf, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices, shadow=None):
        if contiguous:  # the builders hand views of the projections; TensorRT hands a plugin LINEAR inputs
            q, k, v, a, b = (t.contiguous() for t in (q, k, v, a, b))
        if decode:  # the rows: (b,) slots, or the step's flush_order output (b, 4) (gdn_decode's input 7)
            sbi, order = cursors.split_rows(state_batch_indices)
            return method(buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, shadow,
                          **({} if order is None else {"row_order": order}))
        return method(buf, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices, shadow)

    step.executor = executor
    return step


def replay_decode_kw(executor, contiguous: bool = False):
    """The executor's GDN ``replay_decode`` as ``fn(buf, cursor, q, k, v, a, b, A_log, dt_bias,
    state_batch_indices, shadow=None)`` (a bf16 shadow of the checkpoint: read by non-flush steps, rewritten by
    flushes) (the builders' GDN decode node; ``state_batch_indices`` may be the step's flush-first order (b, 4), as
    the plugin's rows input may); ``contiguous``: q, k, v, a, b made contiguous first (the kernels need it)."""
    return _kw(executor.steps("gdn").replay_decode, executor, contiguous, decode=True)


def replay_verify_kw(executor, contiguous: bool = False):
    """The executor's GDN ``replay_verify`` in the form of :func:`replay_decode_kw` (q (batch, T, Hk, Kd), ...)."""
    return _kw(executor.steps("gdn").replay_verify, executor, contiguous)


__all__ = ["Reference", "Kernels", "Injected", "STEPS", "replay_decode_kw", "replay_verify_kw"]
