# SPDX-License-Identifier: Apache-2.0
"""The model kinds the builders serve, one entry each (:data:`KINDS`): what the engine export
(builders/engine.py, scripts/build_engine.py), the generation engine (builders/generation.py) and the Triton models
(builders/triton_generate.py, builders/triton_repo.py) read instead of branching on a family or a model name
(issue 36, builders side). A new model kind is one entry here; its modules hold the rest.

A :class:`ModelKind` is one kind of checkpoint that one pair of steps serves:

- ``tiny``: its embedded tiny configs by ``--tiny`` name (seeded random weights), ``model_types``: the config.json
  ``model_type`` of its checkpoints (:meth:`ModelKind.is_checkpoint`), ``loader``: the checked loader of its model
  module, called ``loader(model_dir=, tiny=, dtype=, seed=, device=)`` (:meth:`ModelKind.load`);
- ``family``: its SSM family, ``trtllm_replayssm.families.<family>``, whose declaration says which checkpoint
  shadows and which 8-bit checkpoint the family keeps (:attr:`ModelKind.shadows`, :attr:`ModelKind.modes`: the
  refusals of ``--shadow`` / ``--mode`` are these data, :meth:`ModelKind.shadow_refusal`, :meth:`ModelKind.refusal`);
- ``export_step``: the step of its engine directory (builders/engine.py; the protocol below), ``state_dtypes`` and
  ``speculative``: what its engine plugins take (``--state-dtype``, ``--num-draft`` > 0), ``tests``: the test files of
  its standard and speculative engines (the build's closing hint);
- ``streaming_step``: the step of the generation engine, ``for_engine(model, batch, kv_len, mode, buffer_len, fuse)``
  (builders/generation.py's ``STEPS``).

Steps are named ``"module:attribute"`` and imported on first use, as :class:`~trtllm_replayssm.families.Family`
names its layer group: a step module imports the engine modules that import this registry.

The export step protocol (builders/decode_step.py ``NemotronHDecodeStep``, builders/qwen_export.py
``QwenGDNDecodeStep``, builders/kimi_step.py ``KimiKDADecodeStep``, builders/glm5_export.py ``Glm5KDADecodeStep``),
besides ``decode_step.StepIO``'s state I/O
(``state_specs``, ``input_names``, ``output_names``, ``speculative``, ``num_tokens``, ``window``) and the SSM node's
``op_type`` / ``plugin_attributes``:

  for_build(model, *, buffer_len, max_seq_len, state_dtype, moe_formulation, shadow, num_draft) -> step
  plugin_geometry() -> tuple        the geometry its plugin kernels take (ValueError naming the config key)
  plugin_kernel(tactic, arch, sm_count) -> AotKernel    the SSM node's PTX and launch, as the plugin's aot_impl
  plugin_keys(sm_count) -> dict     config.json plugin keys after the node's attributes
  ssm_layers() -> [int]             the layers with one SSM plugin node each
  describe() -> [str]               the build log's lines about the model (SSM geometry, MoE)
  model_entry() -> dict             config.json ``model`` after source, seed and model_type
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
from collections.abc import Callable, Mapping

from . import glm5_step, kda, kimi_step, nemotron_h, qwen3_next

MODES = ("conventional", "replay", "replay_bf16", "replay_fp8", "replay_ckpt8")  # the generation engine's SSM modes
SHADOW_NAMES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}  # a shadow dtype's flag spelling (--shadow, replay_<x>)


def resolve(ref: str):
    """The object of a ``"module:attribute"`` reference (imported on first use)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """One kind of model the builders serve (module docstring)."""

    name: str
    title: str  # how messages name its models: "Qwen3-Next / Qwen3.5"
    ssm: str  # how messages name its SSM layers: "Gated DeltaNet"
    family: str  # its SSM family folder, trtllm_replayssm.families.<family>
    tiny: Mapping[str, dict]  # --tiny name -> embedded config (kwargs of the config class)
    model_types: tuple[str, ...]  # config.json model_type of its checkpoints
    loader: Callable  # loader(model_dir=, tiny=, dtype=, seed=, device=) -> the model (CheckpointError naming the key)
    export_step: str = ""  # "module:Class" of its engine directory's step ("" : no engine export)
    streaming_step: str = ""  # "module:Class" of its generation engine step ("": not served)
    state_dtypes: tuple[str, ...] = ("fp32",)  # --state-dtype its engine plugins take
    speculative: bool = False  # --num-draft > 0: its engine has a speculative verify plugin
    tests: tuple[str, str] = ("", "")  # the test files of its standard / speculative engines

    # ---- what the family declares -----------------------------------------------------------------------------
    @property
    def shadows(self) -> tuple[str, ...]:
        """The checkpoint shadows its family keeps, from the family's declaration: the dtype of its optional
        ``shadow`` row (``Family.dtypes['shadow']``: bf16) and fp8, scaled, where its state table has the per-row
        ``shadow_scale`` an fp8 shadow needs."""
        from trtllm_replayssm import families

        fam = families.get(self.family)
        rows = {t.name for t in fam.state_table}
        out = (SHADOW_NAMES[str(fam.dtypes["shadow"]).removeprefix("torch.")],) if "shadow" in rows else ()
        return out + (("fp8",) if "shadow_scale" in rows and "fp8" not in out else ())

    @property
    def modes(self) -> tuple[str, ...]:
        """The generation engine's SSM modes its models run: conventional, replay, a replay per shadow and, where the
        family's state table has an 8-bit checkpoint's row scales (``ckpt_scale``), replay_ckpt8."""
        from trtllm_replayssm import families

        ckpt8 = any(t.name == "ckpt_scale" for t in families.get(self.family).state_table)
        return ("conventional", "replay") + tuple(f"replay_{s}" for s in self.shadows) + (
            ("replay_ckpt8",) if ckpt8 else ())

    def shadow_refusal(self, shadow: str) -> str | None:
        """Why its models keep no ``shadow`` ("bf16", "fp8") shadow; None when they do (or for "none")."""
        if shadow in ("none",) + self.shadows:
            return None
        take = " or ".join(f"replay_{s} (--shadow {s})" for s in self.shadows) or "replay (no checkpoint shadow)"
        return f"{self.ssm} models ({self.title}) take {take}; there is no {shadow} {self.family.upper()} shadow"

    def refusal(self, mode: str) -> str | None:
        """Why its models do not run SSM ``mode``; None when they do (an unknown mode is the caller's check)."""
        if mode in self.modes or mode not in MODES:
            return None
        if mode == "replay_ckpt8":
            keep = [k for k in KINDS if mode in k.modes]
            return (f"the 8-bit checkpoint is for {' and '.join(sorted({k.ssm for k in keep}))} models "
                    f"({', '.join(k.title for k in keep)}); {self.ssm} models ({self.title}) keep none")
        return self.shadow_refusal(mode.removeprefix("replay_"))

    # ---- checkpoints and models ---------------------------------------------------------------------------------
    def is_checkpoint(self, model_dir) -> bool:
        """True when ``model_dir``/config.json names one of its model types (False if unreadable)."""
        return _model_type(pathlib.Path(model_dir)) in self.model_types

    def load(self, model_dir=None, tiny: str | None = None, *, dtype, seed: int = 0, device="cpu"):
        """Its model: the checkpoint ``model_dir``, else the tiny config ``tiny`` (its first when None) with weights
        seeded by ``seed``, in ``dtype`` on ``device``."""
        return self.loader(model_dir=model_dir, tiny=tiny or next(iter(self.tiny)), dtype=dtype, seed=seed,
                           device=device)

    def vocab_size(self, tiny: str) -> int:
        """The vocabulary of its tiny config ``tiny`` (a composite config keeps it in its text config)."""
        cfg = self.tiny[tiny]
        return int(cfg["vocab_size"] if "vocab_size" in cfg else cfg["text_config"]["vocab_size"])

    # ---- steps ------------------------------------------------------------------------------------------------
    def streaming(self, model, batch: int, kv_len: int, mode: str, buffer_len: int, fuse: bool | None = None):
        """Its generation engine step for ``batch`` slots of ``kv_len`` positions in SSM ``mode``."""
        return resolve(self.streaming_step).for_engine(model, batch, kv_len, mode, buffer_len, fuse)

    def export(self, model, **options):
        """Its engine directory's step (``for_build`` with the build's options, module docstring)."""
        return resolve(self.export_step).for_build(model, **options)


KINDS = (
    ModelKind("nemotron_h", "Nemotron-H / Nemotron 3", "Mamba-2", "mamba2", nemotron_h.TINY_CONFIGS, ("nemotron_h",),
              nemotron_h.load_nemotron_h, export_step="builders.decode_step:NemotronHDecodeStep",
              streaming_step="builders.generation:NemotronStep", state_dtypes=("fp32", "bf16", "fp16"),
              speculative=True, tests=("tests/test_builder.py tests/test_triton_repo.py", "tests/test_spec_builder.py")),
    ModelKind("qwen3_next", "Qwen3-Next / Qwen3.5", "Gated DeltaNet", "gdn", qwen3_next.FAMILIES,
              qwen3_next.MODEL_TYPES, qwen3_next.load_gdn_model, export_step="builders.qwen_export:QwenGDNDecodeStep",
              streaming_step="builders.qwen_step:QwenStep", speculative=True,
              tests=("tests/test_gdn_builder.py tests/test_triton_repo.py", "tests/test_gdn_spec_builder.py")),
    ModelKind("kimi_linear", "Kimi-Linear", "Kimi Delta Attention", "kda",
              {n: kda.FAMILIES[n] for n in kimi_step.MODEL_TYPES}, kimi_step.MODEL_TYPES, kda.load_kda_model,
              export_step="builders.kimi_step:KimiKDADecodeStep", streaming_step="builders.kimi_step:KimiStep",
              speculative=True, tests=("tests/test_kda_export.py", "tests/test_kda_spec_export.py")),
    ModelKind("glm5_next", "GLM-5 Next", "Kimi Delta Attention", "kda",
              {n: kda.FAMILIES[n] for n in glm5_step.MODEL_TYPES}, glm5_step.MODEL_TYPES, kda.load_kda_model,
              export_step="builders.glm5_export:Glm5KDADecodeStep", streaming_step="builders.glm5_step:Glm5Step",
              tests=("tests/test_glm5_export.py", "")),
)
DEFAULT_TINY = "nemotron_h"  # the model without --model or --tiny


def kinds(*, export: bool = False, streaming: bool = False) -> tuple[ModelKind, ...]:
    """The kinds with an engine export (``export``) and / or a generation engine step (``streaming``)."""
    return tuple(k for k in KINDS if (k.export_step or not export) and (k.streaming_step or not streaming))


def tiny_names(**which) -> tuple[str, ...]:
    """Every --tiny name of the kinds :func:`kinds` selects."""
    return tuple(n for k in kinds(**which) for n in k.tiny)


def model_types(**which) -> tuple[str, ...]:
    """Every checkpoint model_type of the kinds :func:`kinds` selects."""
    return tuple(t for k in kinds(**which) for t in k.model_types)


def by_tiny(tiny: str, **which) -> ModelKind:
    """The kind of a --tiny name; ValueError naming --tiny and the names there are."""
    for k in kinds(**which):
        if tiny in k.tiny:
            return k
    raise ValueError(f"--tiny: expected one of {list(tiny_names(**which))}, got {tiny!r}")


def by_model_type(model_type) -> ModelKind | None:
    """The kind of a config.json model_type (None: no kind serves it)."""
    return next((k for k in KINDS if model_type in k.model_types), None)


def _model_type(model_dir: pathlib.Path):
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def for_checkpoint(model_dir, **which) -> ModelKind:
    """The kind of the checkpoint directory ``model_dir`` by its config.json ``model_type``; ``CheckpointError``
    (builders/nemotron_h.py) naming the file and the model types there are where it has none or another."""
    from .nemotron_h import CheckpointError, read_config

    _, cfg_path, raw = read_config(model_dir)
    got = raw.get("model_type") if isinstance(raw, dict) else None
    kind = next((k for k in kinds(**which) if got in k.model_types), None)
    if kind is None:
        titles = ", ".join(k.title for k in kinds(**which))
        raise CheckpointError(f"{cfg_path}: model_type: expected one of {list(model_types(**which))} ({titles}), "
                              f"got {got!r}")
    return kind


def for_source(model_dir=None, tiny: str | None = None, **which) -> tuple[ModelKind, str | None]:
    """(kind, tiny name) of a checkpoint directory or, without one, of a --tiny name (:data:`DEFAULT_TINY` when
    None); the tiny name is None for a checkpoint."""
    if model_dir is not None:
        return for_checkpoint(model_dir, **which), None
    tiny = tiny or DEFAULT_TINY
    return by_tiny(tiny, **which), tiny


__all__ = ["MODES", "ModelKind", "KINDS", "DEFAULT_TINY", "kinds", "tiny_names", "model_types", "by_tiny",
           "by_model_type", "for_checkpoint", "for_source", "resolve"]
