# SPDX-License-Identifier: Apache-2.0
"""The two executors of the SSM step, chosen once per device: the float64 reference and the kernels.

:func:`for_device` returns :data:`KERNELS` for CUDA tensors and :data:`REFERENCE` otherwise. An executor holds
what every family shares, the cursor moves, and gives each family's step functions for itself:

  executor.steps(family)            the family's steps on this executor (families/<name>/steps.py, named by
                                    its Family.steps: a class per executor name in its ``STEPS``)
  executor.advance_cursor(cursor, sbi, L)                       standard (slots,) cursor, once per model step
  executor.spec_commit(cursor, n_accepted, sbi, T, L)           ring (slots, 2) cursor, once per model step

A family's steps (:class:`Steps` subclasses) take tensors in the layouts of the family's state table, with the
same arguments on both executors, and mutate the caches they are given in the same way; the caller decides once,
when it allocates its state, and never branches per call. Every family has ``replay_decode`` (the standard step,
(slots,) cursor read only) and ``replay_verify`` (a T-token window on the ring cursor, read only); a family may
have more (Mamba-2: ``conventional_step``, ``native_spec_verify`` / ``native_spec_commit``). The steps take
``out`` (outputs written into it, rows with a slot only) and ``check_values`` (the launchers' host checks; the
reference reads the host anyway); the cursor moves take ``check_values``. ``read_shadow=False`` (reference only)
keeps the shadow rewritten at each fold without reading it, the CPU cache's default: the kernels always read the
shadow they are given. A :class:`Steps` also carries its executor's ``name`` and cursor moves, so one family's
code can hold it as its executor (``for_device(device).steps("mamba2")``). :class:`.cache.ReplayStateCache`
takes its executor here once, at construction.

The reference computes in float64 and stores every cache back in its own dtype; y comes back in the activation
dtype. Where the kernels fold the checkpoint inside the verify launch (flush one window early), the reference
does the same fold inside ``replay_verify`` and moves the ring cursor only in ``spec_commit``, so between two
model steps both leave identical bookkeeping. Shadows (bf16, or fp8 with per-row scales) are rewritten from the
fp32 checkpoint as stored, by :func:`write_shadow` (:func:`.shadow.quantize_shadow`, the one quantizer that
:class:`.shadow.Shadow` and the cache use). The kernels' arguments are validated once, at the launchers (the
one host boundary, :mod:`.launch`), whose errors name the tensor.

:class:`InjectedExecutor`: a family step given as a callable in the family's keyword form (its steps module's
``Injected``) with an injected cursor advance, the executor of a standard-cursor cache whose arithmetic a caller
supplies (the patched models' ``backend=`` / ``advance=``). :func:`spec_commit_kw`: ``spec_commit`` in the
launchers' keyword form (a family's step keyword forms live in its steps module).
"""

from __future__ import annotations

import importlib

import torch

from . import cursor as cursors
from . import families
from . import shadow as shadowq

write_shadow = shadowq.quantize_shadow  # every slot at once: write_shadow(state, shadow, shadow_scale)


# ---- helpers the families' reference steps share ------------------------------------------------------------------
def wide(t):
    """A floating tensor in float64 (anything else as it is)."""
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def rewrite_shadows(state, shadow, shadow_scale, slots) -> None:
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


def into(y, dtype, out, sbi):
    """The reference's outputs (padding rows NaN) in the activation dtype, or written into ``out`` (rows with a
    slot only, as the kernels leave padding rows of ``out`` untouched)."""
    if out is None:
        return y.to(dtype)
    rows = sbi >= 0
    out[rows] = y[rows].to(out.dtype)
    return out


def check_rows_out(sbi, out, shape) -> None:
    """The rows' slots (batch,) and ``out`` (the outputs' shape), checked before a step writes anything (as the
    kernel launchers do): the reference folds checkpoints before it computes the outputs."""
    if sbi is not None:
        cursors.check_shape(sbi, "state_batch_indices", tuple(shape[:1]))
    if out is not None:
        cursors.check_shape(out, "out", tuple(shape))


def check_decode_rows(cursor, L: int, nslots: int, batch: int, sbi) -> None:
    """The rows' slots and cursors of a standard decode step, checked before it writes (the shadow of a folding
    row is written in place)."""
    rows = [int(s) for s in (torch.arange(batch) if sbi is None else sbi).tolist() if s >= 0]
    bad = [s for s in rows if not 0 <= s < nslots or not 0 <= int(cursor[s]) < L]
    if bad:
        raise ValueError(f"state_batch_indices / cursor: slots in [0, {nslots}) with cursor in [0, {L}) expected, got "
                         f"slots {bad[:8]}")


def reads_its_shadow(shadow, read_shadow: bool) -> None:
    """The kernels read every shadow they are given: ``read_shadow=False`` with a shadow is refused."""
    if shadow is not None and not read_shadow:
        raise ValueError("read_shadow: the kernels always read the shadow they are given (pass shadow=None)")


# ---- a family's steps on one executor -------------------------------------------------------------------------
class Steps:
    """A family's step functions on one executor (subclassed in ``families/<name>/steps.py``). Carries the
    executor's ``name`` and its cursor moves, so it stands in for the executor in one family's code."""

    def __init__(self, executor):
        self.executor = executor

    @property
    def name(self) -> str:
        return self.executor.name

    def advance_cursor(self, cursor, sbi, L, **kw):
        self.executor.advance_cursor(cursor, sbi, L, **kw)

    def spec_commit(self, cursor, n_accepted, sbi, T, L, **kw):
        self.executor.spec_commit(cursor, n_accepted, sbi, T, L, **kw)


def steps_module(family: str):
    """The module of ``family``'s executor steps (its Family.steps)."""
    path = families.get(family).steps
    if not path:
        raise ValueError(f"family {family!r} declares no executor steps (Family.steps)")
    return importlib.import_module(path)


class Executor:
    """What the executors share: :meth:`steps` (each family's, made once per executor) and the cursor moves."""

    name = ""

    def __init__(self):
        self._steps: dict[str, Steps] = {}

    def steps(self, family: str) -> Steps:
        s = self._steps.get(family)
        if s is None:
            table = steps_module(family).STEPS
            if self.name not in table:
                raise ValueError(f"family {family!r} has no steps for the {self.name!r} executor (it has "
                                 f"{sorted(table)})")
            s = self._steps[family] = table[self.name](self)
        return s

    def advance_cursor(self, cursor, sbi, L, *, check_values=None, flushes=None):  # pragma: no cover - overridden
        raise NotImplementedError

    def spec_commit(self, cursor, n_accepted, sbi, T, L, *, check_values=None):  # pragma: no cover - overridden
        raise NotImplementedError


class ReferenceBackend(Executor):
    """The float64 specs of every family (any device; CPU in practice); the cursor moves of :mod:`.cursor`."""

    name = "reference"

    def advance_cursor(self, cursor, sbi, L, *, check_values=None, flushes=None):
        cursors.advance_cursor(cursor, sbi, L, flushes)

    def spec_commit(self, cursor, n_accepted, sbi, T, L, *, check_values=None):
        cursors.flush_cursor(cursor, T, L, sbi)
        cursors.commit(cursor, n_accepted, T, L, sbi)


class KernelBackend(Executor):
    """The CUDA kernels through the validated launchers (graph-safe); the shared cursor kernels of :mod:`.cursor_ops`."""

    name = "kernels"

    def __init__(self):
        super().__init__()
        from . import cursor_ops  # cuda.core is imported only where the kernels run

        self.ops = cursor_ops

    def advance_cursor(self, cursor, sbi, L, *, check_values=None, flushes=None):
        self.ops.advance_cursor(cursor, sbi, L, check_values=check_values, flushes=flushes)

    def spec_commit(self, cursor, n_accepted, sbi, T, L, *, check_values=None):
        self.ops.spec_commit(cursor, n_accepted, sbi, T, L, check_values=check_values)


class InjectedExecutor:
    """An executor whose family step is ``step`` (a callable in the family's keyword form: its steps module's
    ``Injected`` maps the step's arguments onto it) and whose standard-cursor advance is ``advance(cursor, sbi,
    L)``: the executor of a standard-cursor cache whose arithmetic the caller supplies (the cache validates and
    keeps the bookkeeping; what the patched models' ``backend=`` / ``advance=`` inject)."""

    name = "injected step"

    def __init__(self, step, advance):
        self.step, self.advance = step, advance

    def steps(self, family: str):
        injected = getattr(steps_module(family), "Injected", None)
        if injected is None:
            raise ValueError(f"family {family!r} takes no injected step (its steps module has no Injected)")
        return injected(self, self.step)

    def advance_cursor(self, cursor, sbi, L, *, check_values=None, flushes=None):
        self.advance(cursor, sbi, L)


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
# take injectable callables with the keyword signature of the launchers. A family's step keyword forms live in
# its steps module (replay_decode_kw, ...); the shared cursor move's is here.
def spec_commit_kw(executor):
    """``executor.spec_commit`` as ``fn(*, cursor, n_accepted, state_batch_indices, num_tokens, buffer_len) ->
    cursor`` (moved in place)."""

    def spec_commit(*, cursor, n_accepted, state_batch_indices, num_tokens: int, buffer_len: int, check_values=None):
        executor.spec_commit(cursor, n_accepted, state_batch_indices, num_tokens, buffer_len, check_values=check_values)
        return cursor

    spec_commit.executor = executor
    return spec_commit


def run_into(out, y):
    """An injected step's outputs ``y``, copied into ``out`` when one is given."""
    if out is None:
        return y
    out.copy_(y)
    return out


__all__ = ["write_shadow", "wide", "rewrite_shadows", "into", "check_rows_out", "check_decode_rows",
           "reads_its_shadow", "Steps", "steps_module", "Executor", "ReferenceBackend", "KernelBackend",
           "InjectedExecutor", "REFERENCE", "for_device", "spec_commit_kw", "run_into"]
