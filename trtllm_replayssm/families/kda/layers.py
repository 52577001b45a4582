# SPDX-License-Identifier: Apache-2.0
"""Kimi Delta Attention layers in a :class:`~trtllm_replayssm.cache.ReplayStateCache` (:mod:`trtllm_replayssm.layer_group`).

Step inputs per layer (:mod:`.reference`): q, k, f (batch, T, H, K), v (batch, T, H, V), b (batch, T, H) raw,
A_log (H,), dt_bias (H, K); options ``use_qk_l2norm``, ``scale``, ``lower_bound`` (GLM-5 Next's bounded gate);
outputs (batch, T, H, V). A prefill hands over the final recurrent state in the (H, K, V) layout (transformers'
and fla's). The family's steps (:mod:`.steps`) on the cache's executor: the float64 spec on CPU tensors, on CUDA the
family's launchers (``families/kda/ops.py``: the fused standard decode step on the standard cursor, the verify kernel
(fold where count + 2T > L, window appended) on the ring cursor; the cache's commit moves the shared cursor).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import cursor as cursors
from ...config import DTYPE_CODES
from ...layer_group import Bound, LayerGroup
from . import reference as kref
from .config import RING_TYPES
from .reference import KDABuffers


def ring_dtype(state_dtype, shadow_dtype) -> torch.dtype:
    """The u ring's torch dtype for a cache's checkpoint and shadow dtypes (config.RING_TYPES: fp32 without a shadow,
    bf16 beside a bf16 one); float64 in the float64 tests."""
    if state_dtype == torch.float64:
        return torch.float64
    code = RING_TYPES["none" if shadow_dtype is None else DTYPE_CODES[shadow_dtype]]
    return next(t for t, c in DTYPE_CODES.items() if c == code)


@dataclasses.dataclass(frozen=True)
class KDALayerState:
    """Views of one KDA layer's tensors (no copies)."""

    buf: KDABuffers
    conv: torch.Tensor
    shadow: torch.Tensor | None


class KDALayers(LayerGroup):
    family = "kda"
    snapshot_prefix = "kda_"
    standard_reads_shadow = True  # the standard step always reads the shadow it keeps (as the kernel does)
    reads_row_order = True  # KDASpec.row_order
    row_order_layers = "KDA layers"

    def row_order_pays(self, batch: int) -> bool:
        """With a bf16 shadow: its flushing blocks are ~6x its others, and a serving batch's launch (rows at spread
        cursors) ran faster with them first (H100, 3598767437, x conv mixed -> flushing rows first: Kimi-K3 TP8
        bs32 1.09 -> 1.42, bs256 1.76 -> 2.00; GLM-5.3-Flash TP8 bs128 1.51 -> 1.72). Not without one: the fp32
        flush (~2.6x its k1) overlaps better interleaved (Kimi bs256 1.69 -> 1.63 first); bench/NOTES.md
        "Twenty-fourth session". Behind the device's order, one order launch per decode launch (serving pays one a
        step for all layers; H100, 546673db3e): Kimi-K3 bs32 1.10 -> 1.25, bs256 1.77 -> 1.82; GLM-5.3-Flash bs32
        0.89 -> 0.83 and bs256 1.51 -> 1.50, level or better once the ~2-3 us order launch is shared by the step's
        layers ("Twenty-fifth session")."""
        return "shadow" in self.t

    @staticmethod
    def signature(q, k, v, f, b, A_log, dt_bias, state_batch_indices=None, out=None, use_qk_l2norm: bool = True,
                  scale: float | None = None, lower_bound: float | None = None):
        """The arguments of ``cache.verify(layer, ...)`` for a KDA layer."""

    def default_conv_dim(self) -> int:
        H, K, V = self.geometry
        return 2 * H * K + H * V

    @staticmethod
    def check_geometry(geometry, cuda: bool, shadow_dtype, state_dtype) -> None:
        for name, v in zip(("kda heads", "kda key_dim", "kda value_dim"), geometry):
            if v < 1:
                raise ValueError(f"geometry: {name}: expected >= 1, got {v}")
        if shadow_dtype not in (None, torch.bfloat16):
            raise ValueError(f"shadow_dtype: a model with KDA layers keeps a bfloat16 shadow only, got {shadow_dtype}")
        if cuda and state_dtype != torch.float32:
            raise ValueError(f"state_dtype: the KDA kernels keep an fp32 checkpoint, got {state_dtype}")

    @staticmethod
    def roles(state_dtype, act_dtype, dt_dtype, shadow_dtype) -> tuple[dict, tuple]:
        d, opt = LayerGroup.roles(state_dtype, act_dtype, dt_dtype, shadow_dtype)
        return d | {"ring": ring_dtype(state_dtype, shadow_dtype)}, opt

    def view(self, l: int) -> KDALayerState:
        t = self.t
        buf = KDABuffers(t["state"][l], t["k_cache"][l], t["u_cache"][l], t["g_cache"][l], t["v_cache"][l],
                         t["beta_cache"][l])
        return KDALayerState(buf, self.conv[l], None if "shadow" not in t else t["shadow"][l])

    def window(self, bound: Bound) -> int:
        return bound.inputs[2].shape[1]

    def step(self, executor, view: KDALayerState, cursor, bound: Bound, *, standard: bool, check: bool,
             read_shadow: bool, row_order=None):
        q, k, v, f, b, A_log, dt_bias = bound.inputs
        sbi, out, opt = bound.state_batch_indices, bound.out, bound.options
        steps = executor.steps(self.family)
        if standard:  # T = 1 on the (slots,) cursor: the step that fills the ring folds it; the shadow is always read
            if out is not None:
                cursors.check_shape(out, "out", tuple(v.shape))
            y = steps.replay_decode(view.buf, cursor, q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], A_log, dt_bias, sbi,
                                    view.shadow, out=None if out is None else out[:, 0], check_values=check,
                                    row_order=row_order, **opt)
            return y[:, None] if out is None else out
        return steps.replay_verify(view.buf, cursor, q, k, v, f, b, A_log, dt_bias, sbi, view.shadow, out=out,
                                   check_values=check, read_shadow=read_shadow, **opt)

    def committed_state(self, view: KDALayerState, cursor, slot: int, standard: bool,
                        use_qk_l2norm: bool = True) -> torch.Tensor:
        """S after the committed tokens, float64 (H, K, V)."""
        fold = kref.replay_state if standard else kref.committed_state
        return fold(view.buf, cursor, slot, use_qk_l2norm)


__all__ = ["KDALayerState", "KDALayers", "ring_dtype"]
