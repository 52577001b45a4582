# SPDX-License-Identifier: Apache-2.0
"""The SSM-family interface (issue 36): one folder per family, consumed without branching on its name.

A family is a subpackage ``trtllm_replayssm.families.<name>`` whose ``__init__`` defines ``FAMILY``, a
:class:`Family`. :func:`get` imports it by name and :func:`names` lists the folders, so adding a family
adds a folder and touches no registry. What a family declares today:

- its persistent state table (:class:`StateTensor` rows: name, shape in symbols, dtype role, who writes it),
  from which :meth:`Family.shapes` and :meth:`Family.allocate` give the tensors of one layer;
- its float64 executable spec (:attr:`Family.reference`, a module imported on demand);
- its bytes model (:attr:`Family.bytes_per_step`, a function of :mod:`trtllm_replayssm.costs`: one bytes
  model for every family);
- its kernel spec types (:attr:`Family.spec_types`: each names its entry file under ``plugins/``, its kernel
  names and its generated prelude, which is all :mod:`..compile` needs);
- its cache layer group (:attr:`Family.layer_group`, ``layers.py``), its steps on each executor
  (:attr:`Family.steps`, ``steps.py``: what :mod:`..backend`'s executors run for it) and its TensorRT plugins
  (:attr:`Family.trt_plugin`).

The three families: ``mamba2/``, ``gdn/`` and ``kda/``, each folder holding its declaration, cache layer group,
executor steps and TensorRT plugins, its float64 spec (``reference.py``; Mamba-2's speculative one in
``spec_reference.py``) and its launchers (``ops.py``); the ONNX / onnxruntime ops and the builders' mixer patch join
the interface next (issue 36).
Every family's state table is checked against the one home of the state shapes, :mod:`..contract` (tests/test_families.py).

Shared rules live once in the library root, and every family imports them from there: the cursor rules and row
checks (:mod:`..cursor`), the cursor kernels' launchers (:mod:`..cursor_ops`), the shadow and 8-bit checkpoint
quantizers (:mod:`..shadow`) and the conv window (:mod:`..conv_window`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StateTensor:
    """One persistent tensor of a family's layer: a leading ``slots`` dim, then symbols resolved by
    :meth:`Family.shapes` (``L`` the ring capacity, the rest the family's geometry); ``dtype`` is a role name
    that :meth:`Family.allocate` maps to a torch dtype (defaults in :attr:`Family.dtypes`)."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    written_by: str
    optional: bool = False

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        missing = [d for d in self.dims if d not in sizes]
        if missing:
            raise ValueError(f"{self.name}: sizes {missing} are not given (have {sorted(sizes)})")
        return tuple(int(sizes[d]) for d in self.dims)


@dataclass(frozen=True)
class Family:
    """What the cache, the executors and the benchmarks read from a family (module docstring)."""

    name: str
    geometry: tuple[str, ...]  # the symbols of one layer's geometry, in the order a geometry tuple gives them
    state_table: tuple[StateTensor, ...]
    dtypes: Mapping[str, torch.dtype]  # role -> default dtype
    reference: str  # module path of the float64 spec
    bytes_per_step: Callable[..., dict]
    geometries: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # published per-GPU geometries
    spec_types: tuple[type, ...] = ()  # its kernel spec classes (entry_file, kernel_names, prelude(): compile.py)
    layer_group: str = ""  # "module:Class" of its layers in a ReplayStateCache (layer_group.LayerGroup)
    trt_plugin: str = ""  # module of its TensorRT plugins (PLUGINS, aot_kernel, register(ctx)), registered by trt_plugin
    title: str = ""  # its name in messages ("Mamba-2", "GDN", ...); the folder name where empty
    steps: str = ""  # module of its steps on each executor (STEPS: executor name -> backend.Steps class; Injected)

    @property
    def label(self) -> str:
        return self.title or self.name

    def sizes(self, slots: int, L: int, geometry) -> dict[str, int]:
        if len(geometry) != len(self.geometry):
            raise ValueError(f"geometry: expected {len(self.geometry)} sizes {self.geometry}, got {tuple(geometry)}")
        return {"slots": slots, "L": L, **dict(zip(self.geometry, (int(g) for g in geometry)))}

    def shapes(self, slots: int, L: int, geometry, optional: bool = False) -> dict[str, tuple[int, ...]]:
        """{name: shape} of one layer's persistent tensors (the optional ones, e.g. a shadow, when asked)."""
        sz = self.sizes(slots, L, geometry)
        return {t.name: t.shape(sz) for t in self.state_table if optional or not t.optional}

    def allocate(self, slots: int, L: int, geometry, dtypes: Mapping[str, torch.dtype] | None = None,
                 optional=False, device="cpu", layers: int | None = None) -> dict[str, torch.Tensor]:
        """Zeroed tensors of one layer, in the table's order: a fresh slot reads zeros everywhere (contract.py).
        ``optional``: True for every optional tensor, or a collection of the optional names wanted; ``layers``:
        a leading dim of that many layers (a cache's one allocation per tensor for all its layers)."""
        dt = {**self.dtypes, **(dtypes or {})}
        unknown = sorted(set(dtypes or {}) - set(self.dtypes))
        if unknown:
            raise ValueError(f"dtypes: unknown roles {unknown} for family {self.name} (roles {sorted(self.dtypes)})")
        optional_names = {t.name for t in self.state_table if t.optional}
        want = optional_names if optional is True else set(optional or ())
        if want - optional_names:
            raise ValueError(f"optional: expected names among {sorted(optional_names)}, got {sorted(want - optional_names)}")
        sz = self.sizes(slots, L, geometry)
        lead = () if layers is None else (int(layers),)
        return {t.name: torch.zeros(lead + t.shape(sz), dtype=dt[t.dtype], device=device)
                for t in self.state_table if not t.optional or t.name in want}

    def reference_module(self):
        return importlib.import_module(self.reference)


def names() -> list[str]:
    """The family folders under this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def get(name: str) -> Family:
    """The :class:`Family` of folder ``name`` (imported on first use)."""
    if name not in names():
        raise ValueError(f"family: expected one of {names()}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}").FAMILY


__all__ = ["StateTensor", "Family", "names", "get"]
