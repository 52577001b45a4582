# SPDX-License-Identifier: Apache-2.0
"""The layers of one SSM family inside a :class:`~.cache.ReplayStateCache`: its tensors and its step.

A cache holds one :class:`LayerGroup` per family present (Mamba-2, Gated DeltaNet, Kimi Delta Attention, ...),
in the order the model numbers them; the cache numbers its layers across the groups (group 0's layers first)
and runs every call through the layer's group, so it never branches on a family's name. What a group owns:

- one allocation per row of its family's state table (:meth:`.families.Family.allocate`, a leading ``layers``
  dim), and the conv windows (layers, slots + 1, conv_dim, W) with one scratch slot for padding rows;
- the family's step on one layer (:meth:`LayerGroup.step`: the standard decode step on the (slots,) cursor, or
  the verify of a T-token window on the ring cursor, through the cache's executor), its prefill hand-off
  (:meth:`LayerGroup.load_state`), its float64 committed state and its shadow refresh;
- the names its tensors carry in snapshots (:attr:`LayerGroup.snapshot_prefix`) and the geometry a snapshot header
  records.

The cursor, the step bookkeeping (flush / verify once per layer / commit), slots, snapshots and the conv windows'
gathered update live once, in the cache. A family's subclass sits in its folder (``families/<name>/layers.py``)
and is named by its :class:`~.families.Family` (``layer_group``).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from . import cursor as cursors
from . import families
from .shadow import Shadow

SCALES = ("shadow_scale", "ckpt_scale")  # row-scale tensors: a fresh slot's scale is 1, not 0


@dataclasses.dataclass(frozen=True)
class Bound:
    """One call's arguments, parsed by the family's step signature: the step inputs (positional, in order), the
    rows, ``out`` and the family's options (keywords)."""

    inputs: tuple
    state_batch_indices: object
    out: object
    options: dict


class LayerGroup:
    """The layers of one family (module docstring). Subclasses set :attr:`family`, :attr:`snapshot_prefix`,
    :meth:`signature` (the step's arguments after the layer index) and implement :meth:`view`, :meth:`window`,
    :meth:`step`, :meth:`prefill_shape`, :meth:`committed_state` and :meth:`default_conv_dim`."""

    family = ""
    snapshot_prefix = ""  # snapshot tensor name = prefix + state-table name (conv: prefix + "conv")
    snapshot_aliases: dict = {}  # table name -> snapshot name where it is not prefix + name (older formats)
    standard_reads_shadow = False  # the standard step reads the shadow it keeps (the CPU cache needs read_shadow)
    ckpt8 = False  # the family keeps an 8-bit checkpoint (state float8_e4m3fn) on the standard cursor
    # The family's standard decode kernel reads a flush-first row order (cursor.flush_order; its step then takes
    # ``row_order``), a group's attribute (a property where it depends on the group's tensors); ``row_order_layers``
    # names those layers in errors; :meth:`row_order_pays` is the cache's default (ReplayStateCache row_order None).
    reads_row_order = False
    row_order_layers = ""

    def row_order_pays(self, batch: int) -> bool:
        """Whether this group's decode launches of ``batch`` rows were measured faster behind the flush-first order."""
        return False
    # An 8-bit checkpoint's (slots,) flush counts, shared by every layer of the cache, and its seed (layer l of the
    # group draws with seed + l): set by the cache on every group, read by the families that keep one.
    ckpt_flushes = None
    ckpt_seed = 0

    def __init__(self, num_layers: int, num_slots: int, geometry, buffer_len: int, conv_width: int, conv_dim,
                 dtypes: dict, optional, device, act_dtype):
        self.fam = families.get(self.family)
        self.num_layers, self.num_slots, self.geometry = num_layers, num_slots, tuple(int(g) for g in geometry)
        self.t = self.fam.allocate(num_slots, buffer_len, self.geometry, dtypes, optional, device, layers=num_layers)
        for name in SCALES:
            if name in self.t:
                self.t[name].fill_(1.0)  # a fresh slot's scale (reset writes the same)
        self.conv_dim = self.default_conv_dim() if conv_dim is None else int(conv_dim)
        self._conv = torch.zeros(num_layers, num_slots + 1, self.conv_dim, conv_width, dtype=act_dtype, device=device)
        self.conv = self._conv[:, :num_slots]

    # ---- what a family gives -----------------------------------------------------------------------------------
    @staticmethod
    def signature(*inputs, state_batch_indices=None, out=None):  # pragma: no cover - overridden
        raise NotImplementedError

    def default_conv_dim(self) -> int:
        raise NotImplementedError

    @staticmethod
    def check_geometry(geometry, cuda: bool, shadow_dtype, state_dtype) -> None:
        """Refuse a geometry or dtype the family's steps do not support on this device (names the argument)."""

    @staticmethod
    def roles(state_dtype, act_dtype, dt_dtype, shadow_dtype) -> tuple[dict, tuple]:
        """(dtype by state-table role, the optional tensors kept) for the cache's dtype arguments. Default: the
        checkpoint and the activations as given, every fp32 ring in float64 where the checkpoint is (tests), a
        shadow where one is asked for."""
        buf = torch.float64 if state_dtype == torch.float64 else torch.float32
        d = dict(state=state_dtype, act=act_dtype, f32=buf)
        if shadow_dtype is None:
            return d, ()
        return d | {"shadow": shadow_dtype}, ("shadow",)

    def view(self, l: int):
        """Views of layer ``l``'s tensors (no copies) in the family's per-layer form."""
        raise NotImplementedError

    def window(self, bound: Bound) -> int:
        """T, the tokens of the call's window (dim 1 of the step inputs)."""
        raise NotImplementedError

    def step(self, executor, view, cursor, bound: Bound, *, standard: bool, check: bool, read_shadow: bool):
        """Outputs (batch, T, ...) of the window; the ring appended (and the checkpoint folded where due)."""
        raise NotImplementedError

    def prefill_shape(self) -> tuple[int, ...]:
        """The shape of one slot's checkpoint as a prefill hands it over."""
        return tuple(self.t["state"].shape[2:])

    def committed_state(self, view, cursor, slot: int, standard: bool, *args, **kw) -> torch.Tensor:
        raise NotImplementedError

    def cache_attributes(self) -> dict:
        """{name: tensor or size} the cache offers as its own attributes (names callers have read from it, e.g. the
        Mamba-2 group's ``cache.state``); none by default: a family's tensors are ``cache.group(family).t``."""
        return {}

    def geometry_header(self) -> dict:
        """The geometry a snapshot header records for this group."""
        return {f"{self.family}.{k}": v for k, v in zip(self.fam.geometry, self.geometry)} | {
            f"{self.family}.conv_dim": self.conv_dim}

    # ---- shared ------------------------------------------------------------------------------------------------
    def bind(self, args: tuple, kwargs: dict, what: str) -> Bound:
        try:
            ba = inspect.signature(self.signature).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{what}: {self.family} layer: {e} (arguments: {inspect.signature(self.signature)})") from None
        ba.apply_defaults()
        a = dict(ba.arguments)
        sbi, out = a.pop("state_batch_indices"), a.pop("out")
        params = inspect.signature(self.signature).parameters
        inputs = tuple(a.pop(n) for n in list(a) if params[n].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
                       and n in self.input_names())
        return Bound(inputs, sbi, out, a)

    @classmethod
    def input_names(cls) -> tuple[str, ...]:
        """The step inputs of the signature (everything before ``state_batch_indices``)."""
        names = []
        for n in inspect.signature(cls.signature).parameters:
            if n == "state_batch_indices":
                break
            names.append(n)
        return tuple(names)

    @classmethod
    def snapshot_name(cls, name: str) -> str:
        return cls.snapshot_aliases.get(name, cls.snapshot_prefix + name)

    @classmethod
    def snapshot_names(cls, optional=True) -> dict[str, str]:
        """{table name (and "conv"): snapshot name} of the family's tensors (optional ones included if asked)."""
        fam = families.get(cls.family)
        rows = [t.name for t in fam.state_table if optional or not t.optional]
        return {n: cls.snapshot_name(n) for n in (*rows, "conv")}

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(snapshot name, tensor) of everything a slot owns in this group, the conv windows last."""
        return [(self.snapshot_name(n), t) for n, t in self.t.items()] + [(self.snapshot_name("conv"), self.conv)]

    def reset_slot(self, slot: int) -> None:
        for _, t in self.tensors():
            t[:, slot].zero_()
        for name in SCALES:
            if name in self.t:
                self.t[name][:, slot] = 1.0

    def shadow(self, l: int) -> Shadow | None:
        sh = self.t.get("shadow")
        if sh is None:
            return None
        scale = self.t.get("shadow_scale")
        return Shadow.wrap(sh[l], None if scale is None else scale[l])

    def refresh_shadow(self, l: int, slot: int) -> None:
        """The shadow of the stored checkpoint, rounded as the kernels store it (shadow.quantize_shadow)."""
        sh = self.shadow(l)
        if sh is not None:
            sh.write(slot, self.t["state"][l, slot])

    def load_state(self, l: int, slot: int, state: torch.Tensor, conv_state, conv_kernel: int, conv_width: int):
        """Prefill hand-off: ``state`` becomes the checkpoint (and its shadow), the rings and the conv window are
        emptied, ``conv_state`` (conv_dim, K - 1) fills the window's last columns. Everything checked first."""
        cursors.check_shape(state, "state", self.prefill_shape())
        if conv_state is not None:
            cursors.check_shape(conv_state, "conv_state", (self.conv_dim, conv_kernel - 1))
        self.t["state"][l, slot] = state.to(self.t["state"].dtype)
        self.refresh_shadow(l, slot)
        for n, t in self.t.items():
            if n not in ("state", "shadow", "shadow_scale"):
                t[l, slot].zero_()
        self.conv[l, slot].zero_()
        if conv_state is not None and conv_kernel > 1:
            self.conv[l, slot][:, conv_width - (conv_kernel - 1):] = conv_state.to(self.conv.dtype)


def group_class(family: str) -> type[LayerGroup]:
    """The :class:`LayerGroup` subclass of ``family`` (its folder's ``layers`` module, named by the Family)."""
    import importlib

    path = families.get(family).layer_group
    if not path:
        raise ValueError(f"family {family!r} has no cache layer group (Family.layer_group)")
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["Bound", "LayerGroup", "group_class"]
