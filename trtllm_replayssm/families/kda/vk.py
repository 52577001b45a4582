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

from ...launch import check_rank
from ..gdn.config import GDN_SUPPORTED_DIMS
from .config import kda_vk_spec
from .ops import _check_options, _launch_conventional


def kda_conventional_step_vk(q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out=None,
                             use_qk_l2norm=True, scale=None, lower_bound=None, check_values: bool | None = None):
    """:func:`.ops.kda_conventional_step` on a (slots, H, V, K) state: returns y (batch, H, V); state updated in
    place. K and V in 64, 128, 256 (GDN's row layout)."""
    _check_options(use_qk_l2norm, scale, lower_bound)
    check_rank(q, "q", 3, "(batch, H, K)")
    check_rank(v, "v", 3, "(batch, H, V)")
    check_rank(state, "state", 4, "(slots, H, V, K)")
    batch, H, K = q.shape
    V = v.shape[2]
    if K not in GDN_SUPPORTED_DIMS or V not in GDN_SUPPORTED_DIMS:
        raise ValueError(f"q, v: (K, V) expected in {', '.join(map(str, GDN_SUPPORTED_DIMS))} (GDN's row layout), "
                         f"got ({K}, {V})")
    return _launch_conventional(
        "kda_conventional_vk", lambda act, sm: kda_vk_spec(act, H, K, V, batch, use_qk_l2norm, scale, lower_bound, sm),
        q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out, check_values, state_dims=("slots", "H", "V", "K"))


__all__ = ["kda_conventional_step_vk"]
