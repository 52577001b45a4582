# SPDX-License-Identifier: Apache-2.0
"""KDA's conventional and ReplaySSM decode steps on a (V, K) state, GDN's row layout (issue 37; bench/NOTES.md "KDA in
GDN's row layout").

An experiment, not a supported path: the KDA state contract stays (S, H, K, V) (:mod:`.reference`). The same math as
:func:`.ops.kda_conventional_step` on the transposed state (S, H, V, K): KDA is Gated DeltaNet with a per-key-channel
decay, so the kernel (``plugins/kda/kda_vk.cuh``) is GDN's conventional step (``plugins/gdn/gdn.cuh``, its launch
shape from :func:`..gdn.config.gdn_plan`) with the decay a per-lane vector. ``scripts/bench_kda.py --vk`` times it
beside the (K, V) kernel on the same inputs; if it reaches GDN's share of the copy ceiling where the (K, V) kernel
does not, the family moves to this layout (the plan in NOTES). It did (H100, 2026-12-07: 94.0% / 90.3% of the copy
ceiling at bs256 against 85.6% / 84.1%), so :func:`kda_replay_decode_vk` is the standard decode step on the same
layout (fp32 checkpoint without a shadow, on :func:`.ops.kda_replay_decode`'s fp32 ring; the flush the u-sum of the
stored u_j with this token folded in), measured the same way before the state contract moves (bench/NOTES.md "KDA
(V, K) replay").
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import DTYPE_CODES
from ...launch import arch, launch
from ..gdn.config import GDN_SUPPORTED_DIMS
from .config import kda_vk_scratch_floats, kda_vk_spec
from .ops import _check_options, _check_replay, _geometry, _launch_conventional

_VK = ("slots", "H", "V", "K")


def _check_dims(K: int, V: int) -> None:
    if K not in GDN_SUPPORTED_DIMS or V not in GDN_SUPPORTED_DIMS:
        raise ValueError(f"q, v: (K, V) expected in {', '.join(map(str, GDN_SUPPORTED_DIMS))} (GDN's row layout), "
                         f"got ({K}, {V})")


def kda_conventional_step_vk(q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out=None,
                             use_qk_l2norm=True, scale=None, lower_bound=None, check_values: bool | None = None):
    """:func:`.ops.kda_conventional_step` on a (slots, H, V, K) state: returns y (batch, H, V); state updated in
    place. K and V in 64, 128, 256 (GDN's row layout)."""
    _check_options(use_qk_l2norm, scale, lower_bound)
    batch, H, K, V, _, _ = _geometry(q, v, state, state_dims=_VK)
    _check_dims(K, V)
    return _launch_conventional(
        "kda_conventional_vk", lambda act, sm: kda_vk_spec(act, H, K, V, batch, use_qk_l2norm, scale, lower_bound, sm),
        q, k, v, f, b, A_log, dt_bias, state, state_batch_indices, out, check_values, state_dims=_VK)


def kda_replay_decode_vk(q, k, v, f, b, A_log, dt_bias, state, k_cache, u_cache, g_cache, v_cache, beta_cache, cursor,
                         state_batch_indices, out=None, use_qk_l2norm=True, scale=None, lower_bound=None,
                         check_values: bool | None = None, scratch=None):
    """:func:`.ops.kda_replay_decode` without a shadow on a (slots, H, V, K) fp32 checkpoint (the rings as there:
    u_cache fp32); returns y (batch, H, V). Two launches: ``kda_vk_prologue`` (the per-channel work once per (batch
    row, head) into a scratch record), then ``kda_replay_rows_vk`` (GDN's row stream on it) as its programmatic
    dependent. K and V in 64, 128, 256 (GDN's row layout); 2 <= L <= 16. ``scratch``: (batch, H,
    :func:`.config.kda_vk_scratch_floats`) float32 on the device, or None (allocated). The cursor is read, not moved
    (:func:`.ops.advance_cursor`)."""
    if q.dim() == 3 and v.dim() == 3:  # (ranks: _check_replay's errors)
        _check_dims(q.shape[2], v.shape[2])
    batch, H, K, V, S, L, dev, y = _check_replay(q, k, v, f, b, A_log, dt_bias, state, k_cache, u_cache, g_cache,
                                                 v_cache, beta_cache, cursor, state_batch_indices, out, None,
                                                 use_qk_l2norm, scale, lower_bound, check_values, state_dims=_VK)
    if batch == 0:
        return y
    nscr = kda_vk_scratch_floats(K, L)
    if scratch is None:
        scratch = torch.empty(batch, H, nscr, dtype=torch.float32, device=q.device)
    elif (scratch.dtype != torch.float32 or scratch.device != q.device or not scratch.is_contiguous()
          or scratch.numel() < batch * H * nscr):
        raise ValueError(f"scratch: expected a contiguous float32 tensor on {q.device} of >= {batch * H * nscr} "
                         f"elements (batch, H, {nscr}), got {scratch.dtype} {tuple(scratch.shape)} on {scratch.device}")
    spec = kda_vk_spec(DTYPE_CODES[q.dtype], H, K, V, batch, use_qk_l2norm, scale, lower_bound, arch(dev), L)
    args = [t.data_ptr() for t in (q, k, f, b, A_log, dt_bias, state_batch_indices, cursor, k_cache, g_cache)]
    args += [np.int32(batch), np.int32(S), scratch.data_ptr()]
    args += [t.data_ptr() for t in (k_cache, g_cache, beta_cache)]
    launch(spec, "kda_vk_prologue", dev, (H, batch, 1), (K, 1, 1), args)
    args = [t.data_ptr() for t in (v, state_batch_indices, cursor, state, u_cache, scratch)]
    args += [np.int32(batch), np.int32(S), y.data_ptr()] + [t.data_ptr() for t in (state, u_cache, v_cache)]
    launch(spec, "kda_replay_rows_vk", dev, spec.grid(batch), (spec.threads, 1, 1), args, pdl=True)
    return y


__all__ = ["kda_conventional_step_vk", "kda_replay_decode_vk"]
