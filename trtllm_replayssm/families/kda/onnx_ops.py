# SPDX-License-Identifier: Apache-2.0
"""The ``replayssm::kda_decode`` / ``kda_decode_shadow`` node's reference: what the exported engine step's KDA node
computes eagerly (builders/kda_step.py, while tracing too) and what onnxruntime runs for it on the CPU
(builders/ort_reference.py registers :data:`ORT_OPS`, the family's onnxruntime ops).

:func:`decode_node`: one node, the inputs, outputs and integer attributes of :mod:`.trt_plugin` (``kda_decode``,
in that order; ``kda_decode_shadow``: the bf16 shadow last in and out), on copies of the state inputs, which
become the outputs after y: :func:`.reference.replay_decode` in float64 (a non-flush step appends its entry to the
rings, the step whose entry is the L-th folds them exactly into the checkpoint and rewrites the shadow), y in v's
dtype. The cursor is read only: the step advances it once for every layer. Attributes are checked against the
shapes, as the plugin's ``register`` does.

onnxruntime's CPU session carries the graph's bf16 states (the u ring, the shadow) as float32 (their values exact,
checked here); :data:`ORT_OPS` says which (``low``: {input index: output index}).
"""

from __future__ import annotations

import numpy as np
import torch

from ...reference import Shadow
from . import reference
from .trt_plugin import ATTRIBUTES, DECODE, DECODE_SHADOW, INPUT_NAMES, SHADOW_INPUT_NAMES, lower_bound_of


def decode_node(q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor, state, k_cache, u_cache, g_cache,
                v_cache, beta_cache, shadow=None, *, num_heads: int, key_dim: int, value_dim: int, buffer_len: int,
                use_qk_l2norm: int, lower_bound_bits: int) -> tuple[torch.Tensor, ...]:
    """(y, state, k_cache, u_cache, g_cache, v_cache, beta_cache[, shadow]) of one node (module docstring); the state
    inputs are not written."""
    op = DECODE if shadow is None else DECODE_SHADOW
    attrs = dict(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim, buffer_len=buffer_len)
    got = dict(num_heads=q.shape[1], key_dim=q.shape[2], value_dim=v.shape[2], buffer_len=u_cache.shape[2])
    if got != attrs:
        raise ValueError(f"replayssm::{op}: attributes {attrs}, inputs have {got}")
    buf = reference.KDABuffers(*(t.clone() for t in (state, k_cache, u_cache, g_cache, v_cache, beta_cache)))
    sh = None if shadow is None else Shadow.wrap(shadow.clone(), None)
    y = reference.replay_decode(buf, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices, shadow=sh,
                                use_qk_l2norm=bool(use_qk_l2norm), lower_bound=lower_bound_of(lower_bound_bits))
    return (y.to(v.dtype), *buf.tensors(), *(() if sh is None else (sh.q,)))


_LOW = {INPUT_NAMES.index("u_cache"): 3}  # the bf16 u ring (input 11, output 3)


def _ort(*inputs, **attrs):
    """:func:`decode_node` on onnxruntime's numpy arrays: the bf16 states arrive and leave as float32 values."""
    t = [torch.from_numpy(np.array(a)) for a in inputs]  # copies: the outputs must not alias the inputs
    low = list(_LOW) + ([SHADOW_INPUT_NAMES.index("shadow")] if len(t) == len(SHADOW_INPUT_NAMES) else [])
    for i in low:
        b16 = t[i].to(torch.bfloat16)
        if not torch.equal(b16.float(), t[i]):
            raise ValueError(f"replayssm::kda_decode: {SHADOW_INPUT_NAMES[i]}: expected bfloat16 values")
        t[i] = b16
    return tuple(o.float().numpy() if o.dtype == torch.bfloat16 else o.numpy() for o in decode_node(*t, **attrs))


_IO = dict(attrs={a: "int" for a in ATTRIBUTES}, run=_ort)
ORT_OPS = {
    DECODE: dict(_IO, inputs=("float",) * 7 + ("int32",) * 2 + ("float",) * 6, outputs=("float",) * 7, low=_LOW),
    DECODE_SHADOW: dict(_IO, inputs=("float",) * 7 + ("int32",) * 2 + ("float",) * 7, outputs=("float",) * 8,
                        low={**_LOW, SHADOW_INPUT_NAMES.index("shadow"): 7}),
}

__all__ = ["decode_node", "ORT_OPS"]
