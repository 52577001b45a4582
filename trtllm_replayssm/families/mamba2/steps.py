# SPDX-License-Identifier: Apache-2.0
"""Mamba-2's steps on each executor (:mod:`trtllm_replayssm.backend`): the float64 spec and the CUDA kernels.

Tensors in the layouts of the state contract (:mod:`trtllm_replayssm.contract`; the launchers' table in
:mod:`trtllm_replayssm.families.mamba2.ops`), the same arguments on both executors:

  conventional_step(state, x, B, C, dt, dt_bias, A, D, sbi) -> y          S read and written
  replay_decode(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                shadow=None, shadow_scale=None) -> y                       (slots,) cursor read only
  replay_verify(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                shadow=None, shadow_scale=None) -> y (batch, T, H, P)      (slots, 2) ring cursor read only
  native_spec_verify(state, snapshots, x, B, C, dt, dt_bias, A, D, sbi) -> y
  native_spec_commit(state, snapshots, n_accepted, sbi)                    per layer

``replay_decode`` / ``replay_verify`` also take ``z``, ``out``, ``check_values`` and ``read_shadow`` (keywords);
``replay_decode`` an 8-bit checkpoint's ``ckpt_scale``, ``ckpt_flushes``, ``ckpt_seed`` (state float8_e4m3fn) and a
flush-first ``row_order`` (batch, 4) (the kernels' block order; the spec checks it).
:func:`replay_decode_kw` / :func:`replay_verify_kw`: an executor's step in the launchers' keyword form (the
builders' graph nodes, the trtllm-serve adapter); :class:`Injected`: that keyword form as an executor's steps.
"""

from __future__ import annotations

from ... import cursor as cursors
from ... import shadow as shadowq
from ...backend import (
    Steps,
    check_decode_rows,
    check_rows_out,
    into,
    reads_its_shadow,
    rewrite_shadows,
    run_into,
    wide,
)
from ...config import CKPT8_DTYPE
from ...shadow import Shadow
from . import reference, spec_reference


class Reference(Steps):
    """The float64 specs of :mod:`.reference` and :mod:`.spec_reference` (this folder), and :mod:`trtllm_replayssm.cursor`."""

    def conventional_step(self, state, x, B, C, dt, dt_bias, A, D, sbi):
        w = state.double()
        y = reference.conventional_step(w, *map(wide, (x, B, C, dt, dt_bias, A, D)), state_batch_indices=sbi)
        state.copy_(w)
        return y.to(x.dtype)

    def replay_decode(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True,
                      ckpt_scale=None, ckpt_flushes=None, ckpt_seed=0, row_order=None):
        if row_order is not None:  # the order of the kernels' blocks: no row's result depends on it
            cursors.check_row_order(row_order, sbi, cursor)
        if state.dtype == CKPT8_DTYPE:  # an 8-bit checkpoint: the spec reads and writes it in place
            check_rows_out(sbi, out, x.shape)
            check_decode_rows(cursor, x_cache.shape[2], state.shape[0], x.shape[0], sbi)
            ck = shadowq.Checkpoint8.wrap(state, ckpt_scale, ckpt_flushes, "sr", ckpt_seed)
            rings = [x_cache, B_cache, dt_cache]
            wides = [c.double() for c in rings]
            y = reference.replay_decode(None, *wides, cursor, *map(wide, (x, B, C, dt, dt_bias, A, D, z)),
                                        state_batch_indices=sbi, ckpt8=ck)
            for c, w in zip(rings, wides):
                c.copy_(w)
            return into(y, x.dtype, out, sbi)
        sh = None if shadow is None or not read_shadow else Shadow.wrap(shadow, shadow_scale)
        # every input, out and the rows checked before anything is written (as the kernel launchers do)
        spec_reference.check_verify_inputs(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z,
                                           standard=True)
        if shadow is not None:  # also when it is not read: a fold rewrites it
            cursors.check_shape(shadow, "shadow", tuple(state.shape))
        check_rows_out(sbi, out, x.shape)
        L = x_cache.shape[2]
        check_decode_rows(cursor, L, state.shape[0], x.shape[0], sbi)
        caches = [state, x_cache, B_cache, dt_cache]
        wides = [c.double() for c in caches]
        rows = sbi[sbi >= 0].long()
        flushed = rows[cursor[rows] == L - 1].tolist()  # the step that fills the buffer folds it
        y = reference.replay_decode(*wides, cursor, *map(wide, (x, B, C, dt, dt_bias, A, D, z)),
                                    state_batch_indices=sbi, shadow=sh)
        for c, w in zip(caches, wides):
            c.copy_(w)
        rewrite_shadows(state, shadow, shadow_scale, flushed)  # from the fp32 checkpoint as stored
        return into(y, x.dtype, out, sbi)

    def replay_verify(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True):
        sh = None if shadow is None or not read_shadow else Shadow.wrap(shadow, shadow_scale)
        # every input checked before the fold writes the checkpoint (as the kernel launchers do before launching)
        spec_reference.check_verify_inputs(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, z, sh)
        check_rows_out(sbi, out, x.shape)
        T, L = x.shape[1], x_cache.shape[2]
        flushed = spec_reference.flush_checkpoint(state, x_cache, B_cache, dt_cache, cursor, A, T, sbi)
        rewrite_shadows(state, shadow, shadow_scale, flushed)
        after = cursor.clone()  # the fold's cursor; the shared cursor itself moves once, in spec_commit
        cursors.flush_cursor(after, T, L, sbi)
        y = spec_reference.verify(state, x_cache, B_cache, dt_cache, after, x, B, C, dt, dt_bias, A, D, z,
                                  state_batch_indices=sbi, shadow=sh, flushed=flushed)
        return into(y, x.dtype, out, sbi)

    def native_spec_verify(self, state, snapshots, x, B, C, dt, dt_bias, A, D, sbi):
        return spec_reference.native_spec_verify(state, snapshots, x, B, C, dt, dt_bias, A, D,
                                                 state_batch_indices=sbi).to(x.dtype)

    def native_spec_commit(self, state, snapshots, n_accepted, sbi):
        cursors.native_spec_commit(state, snapshots, n_accepted, sbi)


class Kernels(Steps):
    """The CUDA kernels through the validated launchers of :mod:`.ops` and :mod:`trtllm_replayssm.cursor_ops` (graph-safe)."""

    def __init__(self, executor):
        super().__init__(executor)
        from ... import cursor_ops  # cuda.core is imported only where the kernels run
        from . import ops

        self.ops, self.cursor_ops = ops, cursor_ops

    def conventional_step(self, state, x, B, C, dt, dt_bias, A, D, sbi):
        return self.ops.conventional_step(x, B, C, dt, dt_bias, A, D, state, sbi)

    def replay_decode(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True,
                      ckpt_scale=None, ckpt_flushes=None, ckpt_seed=0, row_order=None):
        reads_its_shadow(shadow, read_shadow)
        return self.ops.replay_decode(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, sbi,
                                      z=z, out=out, check_values=check_values, shadow=shadow,
                                      shadow_scale=shadow_scale, ckpt_scale=ckpt_scale, ckpt_flushes=ckpt_flushes,
                                      ckpt_seed=ckpt_seed, row_order=row_order)

    def replay_verify(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi,
                      shadow=None, shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True):
        reads_its_shadow(shadow, read_shadow)
        return self.ops.replay_verify(x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, sbi,
                                      z=z, out=out, check_values=check_values, shadow=shadow,
                                      shadow_scale=shadow_scale)

    def native_spec_verify(self, state, snapshots, x, B, C, dt, dt_bias, A, D, sbi):
        return self.ops.native_spec_verify(x, B, C, dt, dt_bias, A, D, state, snapshots, sbi)

    def native_spec_commit(self, state, snapshots, n_accepted, sbi):
        self.cursor_ops.native_spec_commit(state, snapshots, n_accepted, sbi)


class Injected(Steps):
    """The standard step as ``step(*, x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor,
    state_batch_indices, z=None)`` (:func:`replay_decode_kw`'s form; backend.InjectedExecutor)."""

    def __init__(self, executor, step):
        super().__init__(executor)
        self.step = step

    def replay_decode(self, state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, sbi, shadow=None,
                      shadow_scale=None, *, z=None, out=None, check_values=None, read_shadow=True):
        return run_into(out, self.step(state=state, x_cache=x_cache, B_cache=B_cache, dt_cache=dt_cache,
                                       cursor=cursor, x=x, B=B, C=C, dt=dt, dt_bias=dt_bias, A=A, D=D, z=z,
                                       state_batch_indices=sbi))


STEPS = {"reference": Reference, "kernels": Kernels}


# ---- the launchers' keyword form ---------------------------------------------------------------------------
def _kw(method, executor, decode: bool = False):
    def step(*, x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor, state_batch_indices, z=None,
             out=None, check_values=None, shadow=None, shadow_scale=None):
        order = {}
        if decode:  # the rows: (b,) slots, or the step's flush_order output (b, 4) (mamba2_decode_shadow's input 7)
            state_batch_indices, ro = cursors.split_rows(state_batch_indices)
            order = {} if ro is None else {"row_order": ro}
        return method(state, x_cache, B_cache, dt_cache, cursor, x, B, C, dt, dt_bias, A, D, state_batch_indices,
                      shadow, shadow_scale, z=z, out=out, check_values=check_values, **order)

    step.executor = executor
    return step


def replay_decode_kw(executor):
    """The executor's Mamba-2 ``replay_decode`` as ``fn(*, x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache,
    dt_cache, cursor, state_batch_indices, z=None, out=None, check_values=None, shadow=None, shadow_scale=None) ->
    y`` (the signature of ``ops.replay_decode``; ``state_batch_indices`` may be the step's flush-first order (b, 4),
    as the plugin's rows input may)."""
    return _kw(executor.steps("mamba2").replay_decode, executor, decode=True)


def replay_verify_kw(executor):
    """The executor's Mamba-2 ``replay_verify`` in the keyword form of :func:`replay_decode_kw` (x (batch, T, H,
    P), ...)."""
    return _kw(executor.steps("mamba2").replay_verify, executor)


__all__ = ["Reference", "Kernels", "Injected", "STEPS", "replay_decode_kw", "replay_verify_kw"]
