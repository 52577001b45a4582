# SPDX-License-Identifier: Apache-2.0
"""Kimi Delta Attention layers in a :class:`~trtllm_replayssm.cache.ReplayStateCache` (:mod:`trtllm_replayssm.layer_group`).

Step inputs per layer (:mod:`.reference`): q, k, f (batch, T, H, K), v (batch, T, H, V), b (batch, T, H) raw,
A_log (H,), dt_bias (H, K); options ``use_qk_l2norm``, ``scale``, ``lower_bound`` (GLM-5 Next's bounded gate);
outputs (batch, T, H, V). A prefill hands over the final recurrent state in the (H, K, V) layout (transformers'
and fla's). The float64 spec runs the steps on CPU tensors; on CUDA the family's launchers (``families/kda/ops.py``:
the fused standard decode step; speculative verify on CUDA is not there yet).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import spec_reference as sr
from ...layer_group import Bound, LayerGroup
from ...reference import Shadow
from . import reference as kref
from .reference import KDABuffers


@dataclasses.dataclass(frozen=True)
class KDALayerState:
    """Views of one KDA layer's tensors (no copies)."""

    buf: KDABuffers
    conv: torch.Tensor
    shadow: torch.Tensor | None


def _into(y, dtype, out, sbi):
    if out is None:
        return y.to(dtype)
    rows = sbi >= 0
    out[rows] = y[rows].to(out.dtype)
    return out


class KDALayers(LayerGroup):
    family = "kda"
    snapshot_prefix = "kda_"
    standard_reads_shadow = True  # the standard step always reads the shadow it keeps (as the kernel does)

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
        return d | {"ring": torch.float64 if state_dtype == torch.float64 else torch.bfloat16}, opt

    def view(self, l: int) -> KDALayerState:
        t = self.t
        buf = KDABuffers(t["state"][l], t["k_cache"][l], t["u_cache"][l], t["g_cache"][l], t["v_cache"][l],
                         t["beta_cache"][l])
        return KDALayerState(buf, self.conv[l], None if "shadow" not in t else t["shadow"][l])

    def window(self, bound: Bound) -> int:
        return bound.inputs[2].shape[1]

    def step(self, executor, view: KDALayerState, cursor, bound: Bound, *, standard: bool, check: bool,
             read_shadow: bool):
        q, k, v, f, b, A_log, dt_bias = bound.inputs
        sbi, out, opt = bound.state_batch_indices, bound.out, bound.options
        if executor.name == "kernels":  # the family's launchers (families/kda/ops.py)
            if not standard:
                raise NotImplementedError("KDA speculative verify on CUDA: the KDA verify kernel is not there yet "
                                          "(issue 37); use cursor='standard' (one token per step) on CUDA")
            from . import ops as kops

            y = kops.kda_replay_decode(q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], A_log, dt_bias, view.buf.state,
                                       view.buf.k_cache, view.buf.u_cache, view.buf.g_cache, view.buf.v_cache,
                                       view.buf.beta_cache, cursor, sbi, out=None if out is None else out[:, 0],
                                       shadow=view.shadow, check_values=check, **opt)
            return y[:, None] if out is None else out
        sh = None if view.shadow is None else Shadow.wrap(view.shadow, None)
        if out is not None:
            sr._check_shape(out, "out", tuple(v.shape))
        if standard:  # the step that fills the ring folds it (and rewrites the shadow); the shadow is always read
            y = kref.replay_decode(view.buf, cursor, q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], A_log, dt_bias, sbi,
                                   shadow=sh, **opt)
            return _into(y[:, None], v.dtype, out, sbi)
        T, L = v.shape[1], view.buf.u_cache.shape[2]
        # every input checked before the fold writes the checkpoint
        kref.check_inputs(*view.buf.geometry[1:4], q, k, v, f, b, A_log, dt_bias, tuple(v.shape[:2]))
        flushed = kref.flush_checkpoint(view.buf, cursor, T, sbi, sh, opt["use_qk_l2norm"])
        after = cursor.clone()  # the fold's cursor; the shared cursor moves once, in commit
        sr.flush_cursor(after, T, L, sbi)
        y = kref.verify(view.buf, after, q, k, v, f, b, A_log, dt_bias, sbi, shadow=sh if read_shadow else None,
                        flushed=flushed, **opt)
        return _into(y, v.dtype, out, sbi)

    def committed_state(self, view: KDALayerState, cursor, slot: int, standard: bool,
                        use_qk_l2norm: bool = True) -> torch.Tensor:
        """S after the committed tokens, float64 (H, K, V)."""
        fold = kref.replay_state if standard else kref.committed_state
        return fold(view.buf, cursor, slot, use_qk_l2norm)


__all__ = ["KDALayerState", "KDALayers"]
