# SPDX-License-Identifier: Apache-2.0
"""KDA's conventional step on a (V, K) state, GDN's row layout (issue 37; bench/NOTES.md "KDA in GDN's row layout").

An experiment, not a supported path: the KDA state contract stays (S, H, K, V) (:mod:`.reference`). The same math as
:func:`.ops.kda_conventional_step` on the transposed state (S, H, V, K): KDA is Gated DeltaNet with a per-key-channel
decay, so the kernel (``plugins/kda/kda_vk.cuh``) is GDN's conventional step (``plugins/gdn/gdn.cuh``, its launch
shape from :func:`..gdn.config.gdn_plan`) with the decay a per-lane vector. ``scripts/bench_kda.py --vk`` times it
beside the (K, V) kernel on the same inputs; if it reaches GDN's share of the copy ceiling where the (K, V) kernel
does not, the family moves to this layout (the plan in NOTES).
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import DTYPE_CODES
from ...launch import F32, I32, Arg, arch, check_args, check_indices, check_rank, launch, require_cuda, values_checked
from .config import KDAVKSpec, kda_vk_spec
from .ops import _check_options, _check_sizes


def kda_conventional_step_vk(q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out=None,
                             use_qk_l2norm=True, scale=None, lower_bound=None, check_values: bool | None = None):
    """:func:`.ops.kda_conventional_step` on a (slots, H, V, K) state: returns y (batch, H, V); state updated in
    place. K and V in 64, 128, 256 (GDN's row layout)."""
    _check_options(use_qk_l2norm, scale, lower_bound)
    check_rank(q, "q", 3, "(batch, H, K)")
    check_rank(v, "v", 3, "(batch, H, V)")
    check_rank(state, "state", 4, "(slots, H, V, K)")
    batch, H, K = q.shape
    V, S = v.shape[2], state.shape[0]
    args = [
        Arg("q", q, ("batch", "H", "K"), "act", None),
        Arg("k", k, ("batch", "H", "K"), "act", None),
        Arg("v", v, ("batch", "H", "V"), "act", None),
        Arg("f", f, ("batch", "H", "K"), "act", None),
        Arg("b", b, ("batch", "H"), "act", None),
        Arg("A_log", A_log, ("H",), F32, None),
        Arg("dt_bias", dt_bias, ("H", "K"), F32, None),
        Arg("state", state, ("slots", "H", "V", "K"), F32),
        Arg("state_batch_indices", state_batch_indices, ("batch",), I32, None),
        Arg("out", out, ("batch", "H", "V"), "act", None, optional=True),
    ]
    _, dev = check_args(args, _check_sizes)
    if K not in (64, 128, 256) or V not in (64, 128, 256):
        raise ValueError(f"state: (V, K) expected in 64, 128, 256 (GDN's row layout), got ({V}, {K})")
    if values_checked(check_values):
        check_indices(state_batch_indices, S, None, 1)
    require_cuda(q, "q")
    y = torch.empty_like(v) if out is None else out
    if batch == 0:
        return y
    spec = kda_vk_spec(DTYPE_CODES[q.dtype], H, K, V, batch, use_qk_l2norm, scale, lower_bound, arch(dev))
    ptrs = [t.data_ptr() for t in (q, k, v, f, b, A_log, dt_bias, state_batch_indices, state)]
    ptrs += [np.int32(batch), np.int32(S), y.data_ptr(), state.data_ptr()]
    launch(spec, "kda_conventional_vk", dev, spec.grid(batch), (spec.threads, 1, 1), ptrs)
    return y


__all__ = ["KDAVKSpec", "kda_vk_spec", "kda_conventional_step_vk"]
