# SPDX-License-Identifier: Apache-2.0
"""Kimi Delta Attention's steps on each executor (:mod:`trtllm_replayssm.backend`): the float64 spec and the kernels.

``buf`` holds one layer's checkpoint and rings (:class:`.reference.KDABuffers`), ``shadow`` its optional bf16
copy of the checkpoint; the same arguments on both executors:

  replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=None) -> y (batch, H, V)
                                                 (slots,) cursor read only; a shadow is always read;
                                                 ``row_order`` (batch, 4): the kernel's block order
  replay_verify(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=None) -> y (batch, T, H, V)
                                                 (slots, 2) ring cursor read only

Keywords: ``out``, ``check_values``, ``use_qk_l2norm``, ``scale``, ``lower_bound``; ``replay_verify`` also
``read_shadow``. On CUDA the standard step is the fused decode kernel, the verify the verify kernel (:mod:`.ops`: it
folds where count + 2T > L and reads the shadow it is given).
"""

from __future__ import annotations

from ... import cursor as cursors
from ...backend import Steps, into, reads_its_shadow
from ...shadow import Shadow
from . import reference as kref


class Reference(Steps):
    """The float64 spec of :mod:`.reference`."""

    def replay_decode(self, buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, use_qk_l2norm=True, scale=None, lower_bound=None, row_order=None):
        if row_order is not None:  # the order of the kernels' blocks: no row's result depends on it
            cursors.check_row_order(row_order, sbi, cursor)
        sh = None if shadow is None else Shadow.wrap(shadow, None)
        if out is not None:
            cursors.check_shape(out, "out", tuple(v.shape))
        # the step that fills the ring folds it (and rewrites the shadow); the shadow is always read
        y = kref.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=sh,
                               use_qk_l2norm=use_qk_l2norm, scale=scale, lower_bound=lower_bound)
        return into(y, v.dtype, out, sbi)

    def replay_verify(self, buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, read_shadow=True, use_qk_l2norm=True, scale=None, lower_bound=None):
        sh = None if shadow is None else Shadow.wrap(shadow, None)
        if out is not None:
            cursors.check_shape(out, "out", tuple(v.shape))
        T, L = v.shape[1], buf.u_cache.shape[2]
        # every input checked before the fold writes the checkpoint
        kref.check_inputs(*buf.geometry[1:4], q, k, v, f, b, A_log, dt_bias, tuple(v.shape[:2]))
        flushed = kref.flush_checkpoint(buf, cursor, T, sbi, sh, use_qk_l2norm)
        after = cursor.clone()  # the fold's cursor; the shared cursor moves once, in commit
        cursors.flush_cursor(after, T, L, sbi)
        y = kref.verify(buf, after, q, k, v, f, b, A_log, dt_bias, sbi, shadow=sh if read_shadow else None,
                        flushed=flushed, use_qk_l2norm=use_qk_l2norm, scale=scale, lower_bound=lower_bound)
        return into(y, v.dtype, out, sbi)


class Kernels(Steps):
    """The CUDA kernels through the validated launchers of :mod:`.ops` (graph-safe)."""

    def replay_decode(self, buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, use_qk_l2norm=True, scale=None, lower_bound=None, row_order=None):
        from . import ops as kops  # cuda.core is imported only where the kernels run

        return kops.kda_replay_decode(q, k, v, f, b, A_log, dt_bias, buf.state, buf.k_cache, buf.u_cache,
                                      buf.g_cache, buf.v_cache, buf.beta_cache, cursor, sbi, out=out, shadow=shadow,
                                      check_values=check_values, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                      lower_bound=lower_bound, row_order=row_order)

    def replay_verify(self, buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=None, *, out=None,
                      check_values=None, read_shadow=True, use_qk_l2norm=True, scale=None, lower_bound=None):
        from . import ops as kops

        reads_its_shadow(shadow, read_shadow)
        return kops.kda_replay_verify(q, k, v, f, b, A_log, dt_bias, buf.state, buf.k_cache, buf.u_cache, buf.g_cache,
                                      buf.v_cache, buf.beta_cache, cursor, sbi, out=out, shadow=shadow,
                                      check_values=check_values, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                      lower_bound=lower_bound)


STEPS = {"reference": Reference, "kernels": Kernels}

__all__ = ["Reference", "Kernels", "STEPS"]
