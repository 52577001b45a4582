# SPDX-License-Identifier: Apache-2.0
"""trtllm-serve custom module: Nemotron-H / Nemotron 3 Mamba-2 single-token decode through ReplaySSM, and the Kimi Delta
Attention models (Kimi-Linear, GLM-5 Next: :mod:`.kda`, registered next to it where TensorRT-LLM defines them).

Only the Mamba-2 ("M") layers are routed; Nemotron 3's MoE ("E"), the attention ("*") and MLP ("-")
layers stay TensorRT-LLM's own (see :mod:`.install` for how TRT-LLM names them).

Load with ``trtllm-serve MODEL --backend pytorch --custom_module_dirs serve/trtllm_replayssm_module`` after
``pip install`` of the repository, which installs this package, ``trtllm_replayssm`` and ``builders`` by name
(pyproject.toml; from a checkout that is not installed, the repository root and ``serve/`` on ``PYTHONPATH``;
docs/trtllm-serve.md). This package imports ``trtllm_replayssm`` by name and nothing else of the checkout: without
it the import fails with an ImportError that says how to install it. What TensorRT-LLM does with that flag
(tensorrt_llm/commands/serve.py, read at 00209af1; tensorrt_llm/tools/importlib_utils.py): ``serve()``
calls ``import_custom_module_from_dir(dir)`` for each directory before it builds the LLM; that inserts
the directory's parent into ``sys.path`` and ``importlib.import_module(<directory name>)``. serve.py has
imported ``tensorrt_llm`` by then, so on import we call :func:`.model.load` when ``tensorrt_llm`` is
already in ``sys.modules`` (or ``TRTLLM_REPLAYSSM_INSTALL=1``; ``TRTLLM_REPLAYSSM_DISABLE=1`` turns it
off). :data:`ROUTE` says which route was taken (also logged):

* ``"registration"`` (primary, :mod:`.model`): ``ReplaySSMNemotronHForCausalLM``, a subclass of
  TensorRT-LLM's ``NemotronHForCausalLM``, registered with ``register_auto_model`` for the architecture
  ``NemotronHForCausalLM``; TensorRT-LLM's classes are not modified. Workers and TP ranks construct it
  because the registry passes external registrations to them by module name (see :mod:`.model`).
* ``"monkeypatch"`` (fallback, :mod:`.install`): only where ``register_auto_model`` is missing.

Before either, :func:`.check.check_mixer_class` reads the installed Mamba2Mixer's source and refuses
(RuntimeError naming the TensorRT-LLM version) a mixer whose decode no longer calls the attribute we
replace; the first decode step is checked again at run time (:func:`.install.replay_step`).

Per mixer, ``selective_state_update_func`` becomes :func:`.adapter.replay_selective_state_update`
(ReplaySSM: TRT-LLM's state tensor is the checkpoint, we own the replay buffers and the cursor, flush
when the buffer is full), and the model's forward advances the cursor once per step. Prefill is
TRT-LLM's own chunked scan, unchanged; its final state is the checkpoint (the prefill rows' cursors
are zeroed). :mod:`.adapter` needs only torch and trtllm_replayssm; only :func:`.model.load` needs
tensorrt_llm.

TensorRT-LLM facts this relies on (read from source, commits are of the files named):

* mamba2_mixer.py (02140fd4): non-MTP decode calls ``self.selective_state_update_func(ssm_states,
  x_d, dt_d, A, B_d, C_d, D, z=None, dt_bias=dt_bias, dt_softplus=self.delta_softplus,
  state_batch_indices=state_indices_d, out=preallocated_ssm_out_d.view(num_decodes, -1, head_dim))``
  with x_d/B_d/C_d made contiguous, ``dt_d`` = fp32 dt repeated over head_dim, and A/dt_bias/D the
  ``_A_expanded`` (h p n) / ``_dt_bias_expanded`` (h p) / ``_D_expanded`` (h p) repeats of per-head
  fp32 parameters built in ``post_load_weights``. Prefill writes ``ssm_states[state_indices_p]``.
  ``ssm_states`` is ``kv_cache_manager.get_ssm_states(layer_idx)`` or ``mamba_layer_cache(...).temporal``.
* mamba_cache_manager.py (00bce92c): SSM states are (slot_size, num_heads, head_dim, d_state) per layer;
  CUDA-graph padding rows use persistent dummy requests (real slots), not -1.
* modules/mamba/__init__.py: ``PAD_SLOT_ID = -1``; selective_state_update.py (1d2bb3b7): the native
  kernel skips rows whose slot equals ``pad_slot_id`` and takes tie_hdim from zero strides of A/dt/dt_bias.
* mamba2_metadata.py (04fa7c4c): ``Mamba2Metadata.state_indices`` is a persistent (max_batch_size,)
  int32 CUDA tensor (stable pointer for CUDA-graph replay).
* checkpoints/hf/nemotron_h_weight_mapper.py (05b033ac): ``A_log`` is loaded as ``A = -exp(A_log)`` in
  fp32; ``D`` and ``dt_bias`` in fp32 (so A reaches us negative, as our kernels expect).
* modeling_nemotron_h.py (00620eb0): ``NemotronHModel.forward(attn_metadata, ...)`` runs all layers of a
  step; one layer per letter of ``hybrid_override_pattern``, "M" layers are ``Mamba2Mixer(...,
  layer_idx=layer_idx, ...)`` with the letter's position as ``layer_idx``, "E" layers ``NemotronHMOE``.
* pyexecutor/cuda_graph_runner.py (000a01de): ``capture()`` runs the forward twice eagerly, then once
  under ``torch.cuda.graph``; so our buffers are allocated before any capture, and the Python step
  hooks run at capture time while the cursor-advance kernel they launch is replayed with the graph.
* llmapi/utils.py + executor/executor.py: a TP1 model runs in a spawned worker unless
  ``TLLM_WORKER_USE_SINGLE_PROCESS=1``.
* kv_cache/mamba_cache_manager/mamba_cache_manager_v2.py + common.py (28295084): the V2 hybrid manager moves live
  requests between slots between steps and announces it through ``get_state_update_strategy().relocate_slots(old,
  new)``; both routes follow it (:func:`.install.follow_relocation`; the contract is written out there). Its per-layer
  state views are strided, which the Mamba-2 kernels refuse by name (:class:`.adapter.ReplaySSMAdapter`).
"""

from __future__ import annotations

import os
import pathlib
import sys


def _install_hint() -> str:
    """How to make ``trtllm_replayssm`` importable, for the ImportError of a package that is not installed: pip
    install of the repository this directory lives in (named when it is one), or the repository root on
    PYTHONPATH."""
    root = pathlib.Path(__file__).resolve().parents[2]
    repo = str(root) if (root / "pyproject.toml").is_file() and (root / "trtllm_replayssm").is_dir() else (
        "<the trtllm-replayssm repository>")
    return (f"trtllm_replayssm_module: the trtllm_replayssm package is not installed. Install the repository, which "
            f"installs trtllm_replayssm, builders and this module by name (trtllm-serve's worker processes import "
            f"them so): pip install {repo}  (or pip install -e {repo} for a checkout you edit); from a checkout "
            f"that is not installed, put {repo} and {repo}/serve on PYTHONPATH")


try:
    import trtllm_replayssm  # noqa: F401
except ModuleNotFoundError as e:  # only the package itself missing: a broken install keeps its own error
    if e.name != "trtllm_replayssm":
        raise
    raise ImportError(_install_hint(), name=e.name) from e

from .adapter import ReplaySSMAdapter, mamba_layer_indices, replay_selective_state_update  # noqa: E402
from .check import VERIFIED_AGAINST, check_mixer_class, verified_summary  # noqa: E402
from .install import install, model_pattern, patch_classes, uninstall  # noqa: E402
from .kda import KDAReplayAdapter, register_kda  # noqa: E402
from .model import ARCHITECTURES, load, make_model_class, register  # noqa: E402

__all__ = ["ReplaySSMAdapter", "replay_selective_state_update", "mamba_layer_indices", "install", "uninstall",
           "patch_classes", "model_pattern", "VERIFIED_AGAINST", "verified_summary", "check_mixer_class",
           "ARCHITECTURES", "register", "load", "make_model_class", "ROUTE", "ADAPTER", "MODEL_CLASS",
           "KDAReplayAdapter", "register_kda"]

ROUTE = None  # "registration" or "monkeypatch" once loaded
ADAPTER = None  # the monkeypatch route's adapter (the registered class gives each model its own)
MODEL_CLASS = None  # the registered class
if os.environ.get("TRTLLM_REPLAYSSM_DISABLE") != "1" and (
        "tensorrt_llm" in sys.modules or os.environ.get("TRTLLM_REPLAYSSM_INSTALL") == "1"):
    ROUTE, _loaded = load()
    if ROUTE == "registration":
        MODEL_CLASS = _loaded
    else:
        ADAPTER = _loaded
