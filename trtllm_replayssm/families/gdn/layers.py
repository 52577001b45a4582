# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet layers in a :class:`~trtllm_replayssm.cache.ReplayStateCache` (:mod:`trtllm_replayssm.layer_group`).

Step inputs per layer: q, k (batch, T, Hk, K), v (batch, T, HV, V), a, b (batch, T, HV) raw, A_log, dt_bias (HV,);
options ``use_qk_l2norm``, ``scale``; outputs (batch, T, HV, V). The family's steps (:mod:`.steps`) on the cache's
executor: ``replay_decode`` (standard cursor, T = 1; a shadow is always read) or ``replay_verify`` (ring cursor).
A prefill hands over the final recurrent state in our (HV, V, K) layout (transformers keeps (HV, K, V): transpose
it)."""

from __future__ import annotations

import dataclasses

import torch

from ...layer_group import Bound, LayerGroup
from . import reference as gref
from .reference import GDNBuffers


@dataclasses.dataclass(frozen=True)
class GDNLayerState:
    """Views of one Gated DeltaNet layer's tensors (no copies)."""

    buf: GDNBuffers
    conv: torch.Tensor
    shadow: torch.Tensor | None
    shadow_scale: torch.Tensor | None


class GDNLayers(LayerGroup):
    family = "gdn"
    snapshot_prefix = "gdn_"
    standard_reads_shadow = True  # the standard step always reads the shadow it keeps (as the kernel does)
    reads_row_order = True  # GDNSpec.row_order
    row_order_layers = "GDN layers"

    def row_order_pays(self, batch: int) -> bool:
        """With a bf16 shadow (its exact refold makes the flushing blocks long): a serving batch's launch ran faster
        with the flushing rows first (H100, bbd62ef08d, x conv mixed -> flushing rows first, Qwen3-Next: bs32
        1.60 -> 1.95, bs64 1.83 -> 2.25, bs256 2.28 -> 2.44); fp32 level (bench/NOTES.md "Twenty-fourth session").
        Behind the device's order, one order launch per decode launch (H100, 546673db3e): bs32 1.61 -> 1.75, bs64
        1.84 -> 2.11, bs256 2.29 -> 2.37."""
        return "shadow" in self.t
    # the names of snapshot format version 1 (rings without the _cache suffix)
    snapshot_aliases = {"u_cache": "gdn_u", "v_cache": "gdn_v", "k_cache": "gdn_k", "g_cache": "gdn_g",
                        "beta_cache": "gdn_beta"}

    @staticmethod
    def signature(q, k, v, a, b, A_log, dt_bias, state_batch_indices=None, out=None, use_qk_l2norm: bool = True,
                  scale: float | None = None):
        """The arguments of ``cache.verify(layer, ...)`` for a Gated DeltaNet layer."""

    def default_conv_dim(self) -> int:
        HV, Hk, V, K = self.geometry
        return 2 * Hk * K + HV * V

    @staticmethod
    def check_geometry(geometry, cuda: bool, shadow_dtype, state_dtype) -> None:
        HV, Hk, V, K = geometry
        for name, v in (("value_heads", HV), ("key_heads", Hk), ("value_dim", V), ("key_dim", K)):
            if v < 1:
                raise ValueError(f"geometry: gdn {name}: expected >= 1, got {v}")
        if HV % Hk:
            raise ValueError(f"geometry: gdn key_heads: expected a divisor of value_heads={HV}, got {Hk}")
        if shadow_dtype not in (None, torch.bfloat16):  # every device: the GDN reference keeps no fp8 row scales either
            raise ValueError(f"shadow_dtype: a model with GDN layers keeps a bfloat16 shadow only (the GDN kernels read "
                             f"no other), got {shadow_dtype}")
        if not cuda:
            return
        from .config import GDN_SUPPORTED_DIMS

        for name, v in (("value_dim", V), ("key_dim", K)):
            if v not in GDN_SUPPORTED_DIMS:
                raise ValueError(f"geometry: gdn {name}: expected one of {GDN_SUPPORTED_DIMS} on CUDA (the GDN kernels), got {v}")
        if state_dtype != torch.float32:
            raise ValueError(f"state_dtype: the GDN kernels keep an fp32 checkpoint, got {state_dtype}")

    def geometry_header(self) -> dict:
        HV, Hk, V, K = self.geometry
        return dict(gdn_value_heads=HV, gdn_key_heads=Hk, gdn_value_dim=V, gdn_key_dim=K, gdn_conv_dim=self.conv_dim)

    def view(self, l: int) -> GDNLayerState:
        t = self.t
        buf = GDNBuffers(t["state"][l], t["u_cache"][l], t["v_cache"][l], t["k_cache"][l], t["g_cache"][l],
                         t["beta_cache"][l])
        return GDNLayerState(buf, self.conv[l], None if "shadow" not in t else t["shadow"][l], None)

    def window(self, bound: Bound) -> int:
        return bound.inputs[2].shape[1]

    def step(self, executor, view: GDNLayerState, cursor, bound: Bound, *, standard: bool, check: bool,
             read_shadow: bool, row_order=None):
        q, k, v, a, b, A_log, dt_bias = bound.inputs
        sbi, out, opt = bound.state_batch_indices, bound.out, bound.options
        steps = executor.steps(self.family)
        if standard:  # T = 1 on the (slots,) cursor: the standard GDN decode kernel
            y = steps.replay_decode(view.buf, cursor, q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], A_log, dt_bias, sbi,
                                    view.shadow, out=None if out is None else out[:, 0], check_values=check,
                                    **opt, **({} if row_order is None else {"row_order": row_order}))
            return y[:, None] if out is None else out
        return steps.replay_verify(view.buf, cursor, q, k, v, a, b, A_log, dt_bias, sbi, view.shadow, out=out,
                                   check_values=check, read_shadow=read_shadow, **opt)

    def committed_state(self, view: GDNLayerState, cursor, slot: int, standard: bool) -> torch.Tensor:
        """S after the committed tokens, float64 (HV, V, K)."""
        fold = gref.replay_state if standard else gref.committed_state
        return fold(view.buf, cursor, slot)


__all__ = ["GDNLayerState", "GDNLayers"]
