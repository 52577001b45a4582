# SPDX-License-Identifier: Apache-2.0
"""The ``replayssm::kda_decode`` / ``kda_verify`` nodes' reference (and their ``_shadow`` twins): what the exported
engine step's KDA node computes eagerly (builders/kimi_step.py, while tracing too) and what onnxruntime runs for it on
the CPU (builders/ort_reference.py registers :data:`ORT_OPS`, the family's onnxruntime ops).

Both nodes take the inputs, outputs and integer attributes of :mod:`.trt_plugin` (in that order; ``_shadow``: the bf16
shadow last in and out) and run on copies of the state inputs, which become the outputs after y (in v's dtype). The
cursor is read only. Attributes are checked against the shapes, as the plugin's ``register`` does.

* :func:`decode_node` (T = 1, cursor (S,)): :func:`.reference.replay_decode` in float64 (a non-flush step appends its
  entry to the rings, the step whose entry is the L-th folds them exactly into the checkpoint and rewrites the
  shadow); the step advances the cursor once for every layer. Its rows input may be the step's ``flush_order``
  output (b, 4) (checked, then read as the slots it carries: the order changes no value).
* :func:`verify_node` (T = 1 + num_draft window tokens, cursor (S, 2) ring (start, committed count)):
  :func:`.reference.spec_step` on a copy of the cursor, what the ``kda_verify`` kernel does: where count + 2T > L the
  committed entries are folded exactly into the checkpoint (the shadow rewritten from it), then the T outputs come
  from the checkpoint (its shadow where one is given, except in a slot folded this step), the committed ring and the
  window's own tokens, and the window entries are appended at (start + count + t) % L. The commit graph moves the
  shared cursor (builders/spec_step.py's ``spec_commit``: the same fold rule, then count += n accepted).

onnxruntime's CPU session carries the graph's bf16 states (the ``_shadow`` nodes' u ring and shadow; without a shadow
the u ring is fp32) as float32 (their values exact, checked here); :data:`ORT_OPS` says which (``low``: {input index:
output index}).
"""

from __future__ import annotations

import numpy as np
import torch

from ... import cursor as cursors
from ...shadow import Shadow
from . import reference
from .trt_plugin import (
    ATTRIBUTES,
    DECODE,
    DECODE_SHADOW,
    INPUT_NAMES,
    SHADOW_INPUT_NAMES,
    VERIFY,
    VERIFY_ATTRIBUTES,
    VERIFY_SHADOW,
    lower_bound_of,
)


def _copies(op: str, window: int, q, v, caches, shadow, attrs: dict):
    """The node's attributes checked against the shapes (``window`` = 1 when q and v carry a window axis), then
    copies of its states: (KDABuffers, the shadow or None)."""
    got = dict(num_heads=q.shape[1 + window], key_dim=q.shape[2 + window], value_dim=v.shape[2 + window],
               buffer_len=caches[2].shape[2], **({"num_tokens": v.shape[1]} if window else {}))
    want = {k: attrs[k] for k in got}
    if got != want:
        raise ValueError(f"replayssm::{op}: attributes {want}, inputs have {got}")
    buf = reference.KDABuffers(*(t.clone() for t in caches))
    return buf, None if shadow is None else Shadow.wrap(shadow.clone(), None)


def decode_node(q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor, state, k_cache, u_cache, g_cache,
                v_cache, beta_cache, shadow=None, *, num_heads: int, key_dim: int, value_dim: int, buffer_len: int,
                use_qk_l2norm: int, lower_bound_bits: int) -> tuple[torch.Tensor, ...]:
    """(y, state, k_cache, u_cache, g_cache, v_cache, beta_cache[, shadow]) of one ``kda_decode[_shadow]`` node
    (module docstring); the state inputs are not written."""
    attrs = dict(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim, buffer_len=buffer_len)
    buf, sh = _copies(DECODE if shadow is None else DECODE_SHADOW, 0, q, v,
                      (state, k_cache, u_cache, g_cache, v_cache, beta_cache), shadow, attrs)
    sbi, order = cursors.split_rows(state_batch_indices)  # (b,) or the step's flush_order output (b, 4)
    if order is not None:
        cursors.check_row_order(order, sbi, cursor)
    y = reference.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, shadow=sh,
                                use_qk_l2norm=bool(use_qk_l2norm), lower_bound=lower_bound_of(lower_bound_bits))
    return (y.to(v.dtype), *buf.tensors(), *(() if sh is None else (sh.q,)))


def verify_node(q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor, state, k_cache, u_cache, g_cache,
                v_cache, beta_cache, shadow=None, *, num_heads: int, key_dim: int, value_dim: int, buffer_len: int,
                use_qk_l2norm: int, lower_bound_bits: int, num_tokens: int) -> tuple[torch.Tensor, ...]:
    """(y (batch, T, H, V), state, k_cache, u_cache, g_cache, v_cache, beta_cache[, shadow]) of one
    ``kda_verify[_shadow]`` node (module docstring); the state inputs and the cursor are not written."""
    attrs = dict(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim, buffer_len=buffer_len,
                 num_tokens=num_tokens)
    buf, sh = _copies(VERIFY if shadow is None else VERIFY_SHADOW, 1, q, v,
                      (state, k_cache, u_cache, g_cache, v_cache, beta_cache), shadow, attrs)
    # every input checked before the fold writes the (copied) checkpoint, as the launcher checks before the kernel
    reference.check_inputs(num_heads, key_dim, value_dim, q, k, v, f, b, A_log, dt_bias, tuple(v.shape[:2]))
    y = reference.spec_step(buf, cursor.clone(), q, k, v, f, b, A_log, dt_bias, state_batch_indices, shadow=sh,
                            use_qk_l2norm=bool(use_qk_l2norm), lower_bound=lower_bound_of(lower_bound_bits))
    return (y.to(v.dtype), *buf.tensors(), *(() if sh is None else (sh.q,)))


_LOW = {INPUT_NAMES.index("u_cache"): 3}  # the bf16 u ring of the _shadow nodes (input 11, output 3; config.RING_TYPES)
_SHADOW = SHADOW_INPUT_NAMES.index("shadow")  # the bf16 shadow (input 15, output 7)


def _ort(node, op: str):
    """``node`` on onnxruntime's numpy arrays: the bf16 states arrive and leave as float32 values."""

    def run(*inputs, **attrs):
        t = [torch.from_numpy(np.array(a)) for a in inputs]  # copies: the outputs must not alias the inputs
        for i in (list(_LOW) + [_SHADOW]) if len(t) == len(SHADOW_INPUT_NAMES) else []:
            b16 = t[i].to(torch.bfloat16)
            if not torch.equal(b16.float(), t[i]):
                raise ValueError(f"replayssm::{op}: {SHADOW_INPUT_NAMES[i]}: expected bfloat16 values")
            t[i] = b16
        return tuple(o.float().numpy() if o.dtype == torch.bfloat16 else o.numpy() for o in node(*t, **attrs))

    return run


_INPUTS = ("float",) * 7 + ("int32",) * 2 + ("float",) * 6


def _decl(node, op: str, attributes, shadow: bool) -> dict:
    return dict(attrs={a: "int" for a in attributes}, run=_ort(node, op), inputs=_INPUTS + ("float",) * shadow,
                outputs=("float",) * (7 + shadow), low={**_LOW, _SHADOW: 7} if shadow else {})


ORT_OPS = {
    DECODE: _decl(decode_node, DECODE, ATTRIBUTES, False),
    DECODE_SHADOW: _decl(decode_node, DECODE_SHADOW, ATTRIBUTES, True),
    VERIFY: _decl(verify_node, VERIFY, VERIFY_ATTRIBUTES, False),
    VERIFY_SHADOW: _decl(verify_node, VERIFY_SHADOW, VERIFY_ATTRIBUTES, True),
}

__all__ = ["decode_node", "verify_node", "ORT_OPS"]
