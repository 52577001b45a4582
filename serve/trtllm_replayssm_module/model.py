# SPDX-License-Identifier: Apache-2.0
"""Primary route: a Nemotron-H model class registered in TensorRT-LLM's model registry.

:func:`register` subclasses TensorRT-LLM's ``NemotronHForCausalLM`` as
``ReplaySSMNemotronHForCausalLM`` (this module's global once registered) and registers it for the
architectures ``NemotronHForCausalLM`` (Nemotron-H and Nemotron 3 checkpoints both name it) and
``NemotronHPuzzleForCausalLM`` (TensorRT-LLM builds the same class for it) with ``register_auto_model``.
The subclass changes instances only, never TensorRT-LLM's classes:

* ``__init__``: refuses a ``spec_config`` (ReplaySSM routes single-token decode only), builds the model
  as TensorRT-LLM does, then sets, on every "M" layer's mixer (``self.model.layers[i].mixer``, a
  Mamba2Mixer), the instance attribute ``selective_state_update_func`` to
  :func:`.adapter.replay_selective_state_update` bound to that mixer's ``layer_idx`` and to this
  model's own :class:`.adapter.ReplaySSMAdapter`. The routed layers must be exactly the "M" positions
  of ``hybrid_override_pattern``.
* ``forward(attn_metadata, ...)``: :func:`.install.replay_step` around TensorRT-LLM's forward (cursor
  reset for prefill slots, one cursor advance, and the check that decode rows reached the adapter).

TensorRT-LLM facts (read, not run; commits are of the files named):

* models/modeling_nemotron_h.py (00620eb0): ``@register_auto_model("NemotronHPuzzleForCausalLM")``,
  ``@register_auto_model("NemotronHForCausalLM")`` on ``class NemotronHForCausalLM(
  SpecDecOneEngineForCausalLM[NemotronHModel, ...])`` with ``__init__(self, model_config)``; it builds
  ``NemotronHModel(model_config)`` whose ``layers`` hold one ``NemotronHLayer`` per pattern letter
  (``.layer_type``, ``.mixer``); with an MTP spec config it appends the draft model's MTP layers to
  ``self.model.layers`` (we only route ``layers[:num_hidden_layers]`` and refuse spec configs anyway).
* models/modeling_utils.py (cb4c622c, 2025): ``register_auto_model(name)`` stores the class in
  ``MODEL_CLASS_MAPPING[name]``, last registration wins; we import modeling_nemotron_h first, so ours
  is last. The lazy-zoo version (with models/_arch_index.py 065ff9e9, 2026) keeps that for external
  modules ("built-in registrations only fill empty slots ... external registrations always
  overwrite"; external = module outside ``tensorrt_llm._torch.models``) and resolves lookups through
  ``get_registered_model_class``.
* Worker processes and TP ranks. ``trtllm-serve --custom_module_dirs DIR`` imports DIR only in the
  serve process (commands/serve.py 00209af1; tools/importlib_utils.py prepends DIR's parent to that
  process's ``sys.path``). In the lazy-zoo registry, the driver hands its workers the external
  registrations as architecture -> module name (``export_external_model_modules``; the worker side
  ``register_external_model_modules`` + ``_ensure_model_registered`` imports that module on lookup),
  so each worker / TP rank imports ``trtllm_replayssm_module.model``, which runs this package's
  ``__init__`` and registers the class there too. That import needs this package and ``trtllm_replayssm`` (which
  it imports by name) on the worker's path: ``pip install`` of the repository (``-e`` too) provides both; a
  checkout that is not installed needs ``PYTHONPATH=$PWD:$PWD/serve`` (the repository root and ``serve/``); we
  warn when a fresh interpreter would miss either of them. We read
  this propagation in modeling_utils.py's own comments and functions; the executor code that calls
  them was not in the stored sources. A registry without ``export_external_model_modules`` (the 2025
  version) has no propagation we could find: there, spawned workers would build TensorRT-LLM's own
  class, so we warn unless ``TLLM_WORKER_USE_SINGLE_PROCESS=1`` (TP1 in-process); TP > 1 is then
  unsupported.
* When ``register_auto_model`` is missing, :func:`load` falls back to :func:`.install.install`
  (monkeypatch, this process only). Both routes log which one is used.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import subprocess
import sys
import tempfile

from .adapter import mamba_layer_indices, replay_selective_state_update
from .check import HOOK_ATTR, bypass_message, check_mixer_class, tensorrt_llm_version, verified_summary
from .install import install, model_pattern, new_adapter, replay_step

log = logging.getLogger("trtllm_replayssm_module")

# TensorRT-LLM registers its NemotronHForCausalLM under both names (models/modeling_nemotron_h.py); a Puzzle
# checkpoint left on TensorRT-LLM's class would silently run without ReplaySSM.
ARCHITECTURES = ("NemotronHForCausalLM", "NemotronHPuzzleForCausalLM")
ReplaySSMNemotronHForCausalLM = None  # the registered class, once register() ran


class RegistrationUnavailable(RuntimeError):
    """This TensorRT-LLM has no usable model registry (the monkeypatch fallback applies)."""


def route_mixers(model, mixer_cls, adapter) -> list[int]:
    """Point every "M" layer's mixer of ``model`` (a NemotronHForCausalLM) at ``adapter``; returns the layer_idx."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise RuntimeError(f"{type(model).__name__}: expected .model.layers (NemotronHModel's decoder layers), found "
                           f"none; TensorRT-LLM {tensorrt_llm_version()} is outside {verified_summary()}")
    n = getattr(inner, "num_hidden_layers", None) or len(layers)
    routed = []
    for layer in list(layers)[:n]:
        mixer = getattr(layer, "mixer", None)
        if not isinstance(mixer, mixer_cls):
            continue
        if not hasattr(mixer, HOOK_ATTR):
            raise RuntimeError(bypass_message(mixer_cls, f"instance (layer {mixer.layer_idx}) has no attribute "
                                              f"{HOOK_ATTR} after __init__"))
        mixer.replayssm_conventional_func = getattr(mixer, HOOK_ATTR)
        setattr(mixer, HOOK_ATTR, functools.partial(replay_selective_state_update, adapter=adapter,
                                                    layer_idx=mixer.layer_idx))
        routed.append(mixer.layer_idx)
    pattern = model_pattern(model)
    if pattern is not None and routed != mamba_layer_indices(pattern):
        raise RuntimeError(f"{type(model).__name__}: routed Mamba2Mixer layers {routed}, but hybrid_override_pattern "
                           f"{pattern!r} has Mamba-2 layers {mamba_layer_indices(pattern)}; the layer naming this "
                           "module relies on does not hold")
    if not routed:
        raise RuntimeError(f"{type(model).__name__}: found no {mixer_cls.__name__} in model.layers; nothing to route")
    return routed


def make_model_class(base, mixer_cls):
    """The ReplaySSM subclass of TensorRT-LLM's ``base`` (NemotronHForCausalLM) for mixers of ``mixer_cls``."""

    class ReplaySSMNemotronHForCausalLM(base):
        replayssm_mixer_cls = mixer_cls

        def __init__(self, model_config, *args, **kwargs):
            if getattr(model_config, "spec_config", None) is not None:
                raise RuntimeError("ReplaySSMNemotronHForCausalLM: a speculative_config is set; ReplaySSM routes "
                                   "single-token decode only (remove speculative_config, or serve without "
                                   "--custom_module_dirs)")
            if getattr(getattr(model_config, "quant_config", None), "mamba_ssm_stochastic_rounding", False):
                raise RuntimeError("ReplaySSMNemotronHForCausalLM: quant_config.mamba_ssm_stochastic_rounding is set; "
                                   "ReplaySSM keeps an fp32 checkpoint and does not implement stochastic rounding "
                                   "(unset it, or serve without --custom_module_dirs)")
            super().__init__(model_config, *args, **kwargs)
            self.replayssm = new_adapter()
            self.replayssm_layers = route_mixers(self, mixer_cls, self.replayssm)
            log.info("trtllm_replayssm_module: ReplaySSM routes Mamba-2 layers %s (L=%d)", self.replayssm_layers,
                     self.replayssm.buffer_len)

        def forward(self, attn_metadata, *args, **kwargs):
            parent = super().forward
            return replay_step(self.replayssm, self, mixer_cls, attn_metadata,
                               lambda: parent(attn_metadata, *args, **kwargs))

    ReplaySSMNemotronHForCausalLM.__module__ = __name__
    ReplaySSMNemotronHForCausalLM.__qualname__ = "ReplaySSMNemotronHForCausalLM"
    return ReplaySSMNemotronHForCausalLM


WORKER_IMPORTS = (__package__, "trtllm_replayssm")  # what a worker's import of this module needs by name


def _fresh_process_can_import(*names: str) -> bool:
    """Would a spawned worker (a fresh interpreter in this environment) find every package of ``names`` (default
    :data:`WORKER_IMPORTS`: this package and the ``trtllm_replayssm`` it imports)? Asked of one, outside the
    checkout: ``pip install`` (editable too) or PYTHONPATH both count. Once per registration."""
    names = names or WORKER_IMPORTS
    probe = f"import importlib.util, sys; sys.exit(any(importlib.util.find_spec(n) is None for n in {names!r}))"
    try:
        done = subprocess.run([sys.executable, "-c", probe], cwd=tempfile.gettempdir(), env=dict(os.environ),
                              capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def register():
    """Register ``ReplaySSMNemotronHForCausalLM`` for :data:`ARCHITECTURES`; returns the class.

    Raises ImportError without tensorrt_llm's PyTorch backend, :class:`RegistrationUnavailable` without
    ``register_auto_model``, RuntimeError when the mixer check fails or the registry kept another class."""
    global ReplaySSMNemotronHForCausalLM
    try:
        from tensorrt_llm._torch.models import modeling_nemotron_h
        from tensorrt_llm._torch.modules.mamba import mamba2_mixer
    except ImportError as e:
        raise ImportError("trtllm_replayssm_module: expected tensorrt_llm's PyTorch backend "
                          "(tensorrt_llm._torch.modules.mamba.mamba2_mixer, tensorrt_llm._torch.models."
                          f"modeling_nemotron_h); verified against {verified_summary()}; got: {e}") from e
    try:
        from tensorrt_llm._torch.models import modeling_utils
        register_auto_model = modeling_utils.register_auto_model
    except (ImportError, AttributeError) as e:
        raise RegistrationUnavailable(f"tensorrt_llm._torch.models.modeling_utils.register_auto_model: {e}") from e
    mixer_cls = mamba2_mixer.Mamba2Mixer
    check_mixer_class(mixer_cls)
    base = modeling_nemotron_h.NemotronHForCausalLM
    cls = ReplaySSMNemotronHForCausalLM
    if cls is None or cls.__bases__ != (base,) or cls.replayssm_mixer_cls is not mixer_cls:
        cls = make_model_class(base, mixer_cls)
    for arch in ARCHITECTURES:
        register_auto_model(arch)(cls)
    mapping = getattr(modeling_utils, "MODEL_CLASS_MAPPING", None)
    kept = {a: mapping.get(a) for a in ARCHITECTURES if mapping is not None and mapping.get(a) is not cls}
    if kept:
        raise RuntimeError(f"trtllm_replayssm_module: registered {cls.__qualname__} for {list(kept)}, but "
                           f"MODEL_CLASS_MAPPING kept {kept}; TensorRT-LLM {tensorrt_llm_version()} would build "
                           "its own class without ReplaySSM")
    ReplaySSMNemotronHForCausalLM = cls
    if hasattr(modeling_utils, "export_external_model_modules"):
        workers = "workers and TP ranks import it by module name"
        if not _fresh_process_can_import():
            root = pathlib.Path(__file__).resolve().parents[2]
            repo = str(root) if (root / "pyproject.toml").is_file() else "<the trtllm-replayssm repository>"
            log.warning("trtllm_replayssm_module: worker processes import %s by name, and it imports trtllm_replayssm, "
                        "but a fresh interpreter here would not find them: pip install %s (or pip install -e %s), or "
                        "for a checkout that is not installed PYTHONPATH=%s:%s/serve", __name__, repo, repo, repo, repo)
    else:
        workers = "this process only (the registry has no export_external_model_modules)"
        if os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") != "1":
            log.warning("trtllm_replayssm_module: this TensorRT-LLM's model registry does not pass custom modules to "
                        "spawned workers; they would build TensorRT-LLM's own NemotronHForCausalLM without ReplaySSM. "
                        "For TP1 set TLLM_WORKER_USE_SINGLE_PROCESS=1.")
    log.warning("trtllm_replayssm_module: route=registration: %s -> %s.%s (TensorRT-LLM %s; mixer check passed; %s)",
                ", ".join(ARCHITECTURES), __name__, cls.__qualname__, tensorrt_llm_version(), workers)
    return cls


def load():
    """Register the model class, or fall back to the monkeypatch; returns ``(route, class or adapter)``. The Kimi
    Delta Attention models (:func:`.kda.register_kda`) are registered next to it where this TensorRT-LLM defines
    them (their classes: ``kda.KDA_CLASSES``)."""
    try:
        loaded = "registration", register()
    except RegistrationUnavailable as e:
        adapter = install()
        log.warning("trtllm_replayssm_module: route=monkeypatch (fallback; model registry unavailable: %s; TensorRT-LLM "
                    "%s)", e, tensorrt_llm_version())
        return "monkeypatch", adapter
    from .kda import register_kda

    try:
        register_kda()
    except ImportError as e:  # no KDA mixer or model in this TensorRT-LLM: the Mamba-2 route alone
        log.info("trtllm_replayssm_module: KDA models not routed: %s", e)
    return loaded
