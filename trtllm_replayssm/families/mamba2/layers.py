# SPDX-License-Identifier: Apache-2.0
"""Mamba-2 layers in a :class:`~trtllm_replayssm.cache.ReplayStateCache` (:mod:`trtllm_replayssm.layer_group`).

Step inputs per layer: x (batch, T, H, P), B, C (batch, T, G, N), dt (batch, T, H) raw, dt_bias, A, D (H,), z
(batch, T, H, P) or None; outputs (batch, T, H, P). The family's steps (:mod:`.steps`) on the cache's executor:
``replay_decode`` (standard cursor, T = 1) or ``replay_verify`` (ring cursor) with the layer's shadow (bf16, or fp8
with row scales)."""

from __future__ import annotations

import dataclasses

import torch

from ... import cursor as cursors
from ... import shadow as shadowq
from ...config import CKPT8_DTYPE
from ...layer_group import Bound, LayerGroup
from . import reference
from . import spec_reference as sr


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
    ckpt8 = True  # an 8-bit checkpoint on the standard cursor (cache.ckpt_flushes / ckpt_seed: LayerGroup)
    row_order_layers = "Mamba-2 layers with a shadow or an 8-bit checkpoint"

    @property
    def reads_row_order(self) -> bool:
        """KernelSpec.row_order: the one-shot and staged kernels, which a shadow or an 8-bit checkpoint always runs; an
        fp32 checkpoint without one runs the persistent kernel above batch 4, which walks items, not rows."""
        return "shadow" in self.t or "ckpt_scale" in self.t

    # the largest batch a bf16 shadow's launch was measured faster behind the order (bench/NOTES.md)
    ROW_ORDER_BF16_MAX_BATCH = 64

    def row_order_pays(self, batch: int) -> bool:
        """With a shadow (the staged kernel; its flushing blocks fold the fp32 rows while the others read the shadow),
        a serving batch's launch ran faster behind the device's order (H100, 546673db3e, Nemotron-H 8B, x conv, the
        mixed launch -> the same launch behind one order launch each): fp8 shadow bs32 2.55 -> 3.13, bs64 3.23 ->
        3.50, bs256 3.90 -> 3.96; bf16 shadow bs32 2.20 -> 2.45, bs64 2.55 -> 2.57, but bs256 2.91 -> 2.82 (its
        flush is short against the launch there): a bf16 shadow orders up to batch 64. The 8-bit checkpoint is not
        measured (off)."""
        if "shadow" not in self.t:
            return False
        return self.t["shadow"].dtype != torch.bfloat16 or batch <= self.ROW_ORDER_BF16_MAX_BATCH

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
        if state_dtype == CKPT8_DTYPE and shadow_dtype is not None:
            raise ValueError(f"shadow_dtype: an 8-bit checkpoint (state_dtype float8_e4m3fn) is its own fp8 read copy; "
                             f"expected no shadow, got {shadow_dtype}")
        if cuda:  # the kernels' geometries, named here rather than at the first launch
            for name, v, ok in (("headdim", P, SUPPORTED_HEADDIM), ("dstate", N, SUPPORTED_DSTATE)):
                if v not in ok:
                    raise ValueError(f"{name}: expected one of {ok} on CUDA (the kernels' geometries), got {v}")

    @staticmethod
    def roles(state_dtype, act_dtype, dt_dtype, shadow_dtype) -> tuple[dict, tuple]:
        d = dict(state=state_dtype, act=act_dtype, dt=dt_dtype)
        if state_dtype == CKPT8_DTYPE:  # the 8-bit checkpoint and its row scales (no shadow: it is the fp8 copy)
            return d, ("ckpt_scale",)
        if shadow_dtype is None:
            return d, ()
        return d | {"shadow": shadow_dtype}, ("shadow", "shadow_scale") if shadow_dtype == torch.float8_e4m3fn \
            else ("shadow",)

    def cache_attributes(self) -> dict:
        """The cache's attributes of its Mamba-2 layers (the names callers have read since the first models)."""
        t = self.t
        H, P, N, G = self.geometry
        return dict(num_layers=self.num_layers, nheads=H, headdim=P, dstate=N, ngroups=G, conv_dim=self.conv_dim,
                    state=t["state"], x_cache=t["x_cache"], B_cache=t["B_cache"], dt_cache=t["dt_cache"],
                    shadow=t.get("shadow"), shadow_scale=t.get("shadow_scale"), _conv=self._conv, conv=self.conv)

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

    # An 8-bit checkpoint (state float8_e4m3fn, ``ckpt_scale``): the cache sets ``ckpt_flushes`` (its (slots,) flush
    # counts, shared by the layers) and ``ckpt_seed`` (layer l draws with seed + l: the hash has no layer coordinate).
    def _ckpt8(self, l: int) -> dict:
        if "ckpt_scale" not in self.t:
            return {}
        return dict(ckpt_scale=self.t["ckpt_scale"][l], ckpt_flushes=self.ckpt_flushes, ckpt_seed=self.ckpt_seed + l)

    def step(self, executor, view: LayerState, cursor, bound: Bound, *, standard: bool, check: bool,
             read_shadow: bool, row_order=None):
        x, B, C, dt, dt_bias, A, D, z = bound.inputs
        sbi, out = bound.state_batch_indices, bound.out
        steps = executor.steps(self.family)
        if standard:  # T = 1 on the (slots,) cursor: the standard decode kernel
            y = steps.replay_decode(view.state, view.x_cache, view.B_cache, view.dt_cache, cursor, x[:, 0], B[:, 0],
                                    C[:, 0], dt[:, 0], dt_bias, A, D, sbi, view.shadow, view.shadow_scale,
                                    z=None if z is None else z[:, 0], out=None if out is None else out[:, 0],
                                    check_values=check, read_shadow=read_shadow, **self._ckpt8(self._layer_of(view)),
                                    **({} if row_order is None else {"row_order": row_order}))
            return y[:, None] if out is None else out
        return steps.replay_verify(view.state, view.x_cache, view.B_cache, view.dt_cache, cursor, x, B, C, dt, dt_bias,
                                   A, D, sbi, view.shadow, view.shadow_scale, z=z, out=out, check_values=check,
                                   read_shadow=read_shadow)

    def _layer_of(self, view: LayerState) -> int:
        """The group's index of the layer ``view`` looks at (views share storage with the group's tensors)."""
        per = self.t["state"][0].numel() * self.t["state"].element_size()
        return (view.state.data_ptr() - self.t["state"].data_ptr()) // per if per else 0

    def committed_state(self, view: LayerState, cursor, slot: int, standard: bool, A) -> torch.Tensor:
        """S after the committed tokens, float64 (H, P, N); needs the layer's A (the cache does not hold it)."""
        fold = reference.replay_state if standard else sr.committed_state
        state = view.state
        if state.dtype == CKPT8_DTYPE:  # the 8-bit checkpoint as the steps read it: q * scale in fp32
            state = view.state.float() * self.t["ckpt_scale"][self._layer_of(view)][..., None]
        return fold(state, view.x_cache, view.B_cache, view.dt_cache, cursor, A, slot)

    def load_state(self, l: int, slot: int, state: torch.Tensor, conv_state, conv_kernel: int, conv_width: int):
        if "ckpt_scale" not in self.t:
            return super().load_state(l, slot, state, conv_state, conv_kernel, conv_width)
        cursors.check_shape(state, "state", self.prefill_shape())
        super().load_state(l, slot, torch.zeros(self.prefill_shape(), dtype=state.dtype, device=state.device),
                           conv_state, conv_kernel, conv_width)  # rings and conv window as every family's
        self.ckpt_flushes[slot] = 0  # a new sequence's rounding stream (the cursor is zeroed with it)
        ck = shadowq.Checkpoint8.wrap(self.t["state"][l], self.t["ckpt_scale"][l], self.ckpt_flushes, "sr",
                                        self.ckpt_seed + l)
        ck.write(slot, state)


__all__ = ["LayerState", "Mamba2Layers"]
