# SPDX-License-Identifier: Apache-2.0
"""Mamba-2 layers in a :class:`~trtllm_replayssm.cache.ReplayStateCache` (:mod:`trtllm_replayssm.layer_group`).

Step inputs per layer: x (batch, T, H, P), B, C (batch, T, G, N), dt (batch, T, H) raw, dt_bias, A, D (H,), z
(batch, T, H, P) or None; outputs (batch, T, H, P). The executor's ``replay_decode`` (standard cursor, T = 1) or
``replay_verify`` (ring cursor) with the layer's shadow (bf16, or fp8 with row scales)."""

from __future__ import annotations

import dataclasses

import torch

from ... import reference
from ... import spec_reference as sr
from ...layer_group import Bound, LayerGroup


@dataclasses.dataclass(frozen=True)
class LayerState:
    """Views of one Mamba-2 layer's tensors (no copies), in the kernels' per-layer layouts."""

    state: torch.Tensor
    x_cache: torch.Tensor
    B_cache: torch.Tensor
    dt_cache: torch.Tensor
    conv: torch.Tensor
    shadow: torch.Tensor | None
    shadow_scale: torch.Tensor | None


class Mamba2Layers(LayerGroup):
    family = "mamba2"
    snapshot_prefix = ""  # the first family's names are the plain table names (format version 1)

    @staticmethod
    def signature(x, B, C, dt, dt_bias, A, D, z=None, state_batch_indices=None, out=None):  # noqa: D401
        """The arguments of ``cache.verify(layer, ...)`` for a Mamba-2 layer."""

    def default_conv_dim(self) -> int:
        H, P, N, G = self.geometry
        return H * P + 2 * G * N

    @staticmethod
    def check_geometry(geometry, cuda: bool, shadow_dtype, state_dtype) -> None:
        from ...config import SUPPORTED_DSTATE, SUPPORTED_HEADDIM

        H, P, N, G = geometry
        for name, v in (("nheads", H), ("headdim", P), ("dstate", N), ("ngroups", G)):
            if v < 1:
                raise ValueError(f"{name}: expected >= 1, got {v}")
        if H % G:
            raise ValueError(f"ngroups: expected a divisor of nheads={H}, got {G}")
        if cuda:  # the kernels' geometries, named here rather than at the first launch
            for name, v, ok in (("headdim", P, SUPPORTED_HEADDIM), ("dstate", N, SUPPORTED_DSTATE)):
                if v not in ok:
                    raise ValueError(f"{name}: expected one of {ok} on CUDA (the kernels' geometries), got {v}")

    @staticmethod
    def roles(state_dtype, act_dtype, dt_dtype, shadow_dtype) -> tuple[dict, tuple]:
        d = dict(state=state_dtype, act=act_dtype, dt=dt_dtype)
        if shadow_dtype is None:
            return d, ()
        return d | {"shadow": shadow_dtype}, ("shadow", "shadow_scale") if shadow_dtype == torch.float8_e4m3fn \
            else ("shadow",)

    def geometry_header(self) -> dict:
        H, P, N, G = self.geometry
        return dict(nheads=H, headdim=P, dstate=N, ngroups=G, conv_dim=self.conv_dim)

    def view(self, l: int) -> LayerState:
        t = self.t
        return LayerState(t["state"][l], t["x_cache"][l], t["B_cache"][l], t["dt_cache"][l], self.conv[l],
                          None if "shadow" not in t else t["shadow"][l],
                          None if "shadow_scale" not in t else t["shadow_scale"][l])

    def window(self, bound: Bound) -> int:
        return bound.inputs[0].shape[1]

    def step(self, executor, view: LayerState, cursor, bound: Bound, *, standard: bool, check: bool,
             read_shadow: bool):
        x, B, C, dt, dt_bias, A, D, z = bound.inputs
        sbi, out = bound.state_batch_indices, bound.out
        if standard:  # T = 1 on the (slots,) cursor: the standard decode kernel
            y = executor.replay_decode(view.state, view.x_cache, view.B_cache, view.dt_cache, cursor, x[:, 0], B[:, 0],
                                       C[:, 0], dt[:, 0], dt_bias, A, D, sbi, view.shadow, view.shadow_scale,
                                       z=None if z is None else z[:, 0], out=None if out is None else out[:, 0],
                                       check_values=check, read_shadow=read_shadow)
            return y[:, None] if out is None else out
        return executor.replay_verify(view.state, view.x_cache, view.B_cache, view.dt_cache, cursor, x, B, C, dt,
                                      dt_bias, A, D, sbi, view.shadow, view.shadow_scale, z=z, out=out,
                                      check_values=check, read_shadow=read_shadow)

    def committed_state(self, view: LayerState, cursor, slot: int, standard: bool, A) -> torch.Tensor:
        """S after the committed tokens, float64 (H, P, N); needs the layer's A (the cache does not hold it)."""
        fold = reference.replay_state if standard else sr.committed_state
        return fold(view.state, view.x_cache, view.B_cache, view.dt_cache, cursor, A, slot)


__all__ = ["LayerState", "Mamba2Layers"]
