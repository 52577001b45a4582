# SPDX-License-Identifier: Apache-2.0
"""Fallback route (monkeypatch) and the step protocol shared by both routes.

The primary route is :mod:`.model` (a registered model class). This module keeps the older route for
a TensorRT-LLM whose model registry cannot be used (no ``register_auto_model``): it patches the
classes in this process only. Either way the step wrapper is :func:`replay_step`, and the mixer is
checked first (:func:`.check.check_mixer_class`).

Route (facts from TensorRT-LLM's source, read, not run; see the package docstring for commits):

* ``Mamba2Mixer.__init__`` (tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py) stores the decode kernel
  in the instance attribute ``selective_state_update_func`` (FlashInfer's
  ``flashinfer.mamba.selective_state_update`` or the native Triton ``selective_state_update``; the
  attribute exists since PR #10757, merged 2026-01). ``Mamba2Mixer.forward`` calls it in the non-MTP
  decode branch as ``func(ssm_states, x_d, dt_d, A, B_d, C_d, D, z=None, dt_bias=..., dt_softplus=
  self.delta_softplus, state_batch_indices=state_indices_d, out=...)``. We wrap ``__init__`` so every
  mixer built afterwards carries :func:`.adapter.replay_selective_state_update` bound to its
  ``layer_idx``; the MTP / speculative-verify branch calls the same attribute with 4-D x and
  ``cache_steps`` / ``intermediate_states_buffer`` and gets a NotImplementedError.
* ``NemotronHModel.forward(attn_metadata, ...)`` (tensorrt_llm/_torch/models/modeling_nemotron_h.py)
  runs every decoder layer of one step and reads ``attn_metadata.mamba_metadata``. We wrap it:
  ``begin_step(prefill slots)`` before, ``end_step()`` after (the cursor advance). Prefill rows come
  first in the batch: their slots are ``mamba_metadata.state_indices[:attn_metadata.num_contexts]``
  (the same split Mamba2Mixer.forward makes).
* Layer naming (modeling_nemotron_h.py 00620eb0): ``NemotronHModel.__init__`` builds one
  ``NemotronHLayer`` per letter of ``model_config.pretrained_config.hybrid_override_pattern`` with
  ``layer_idx`` = the letter's position: "M" ``Mamba2Mixer(..., layer_idx=layer_idx)``, "E"
  ``NemotronHMOE`` (Nemotron 3: DeepseekV3Gate routing, ``create_moe`` fused experts, a shared-expert
  MLP, latent projections; no SSM state, no ``selective_state_update`` call), "*" ``TransformerLayer``,
  "-" ``MLPLayer``; ``forward`` runs ``self.layers[:self.num_hidden_layers]``. MTP layers
  (``NemotronHMTP``, ``mtp_hybrid_override_pattern``) are appended only with an MTP spec config and
  run in the speculative worker, outside that loop. mamba_cache_manager.py (00bce92c) maps the same
  global ``layer_idx`` to the layer's offset among the Mamba layers (``mamba_layer_offsets``), so
  ``get_ssm_states(layer_idx)`` is one (slots, H, P, N) pool per "M". The forward wrapper hands the
  pattern to :meth:`.adapter.ReplaySSMAdapter.expect_pattern`: decode calls come only from "M"
  positions (MoE / attention / MLP layers are never routed).

Only mixers constructed after :func:`install` are routed, in the process that ran it: trtllm-serve
imports ``--custom_module_dirs`` in its own process before it builds the LLM; with the default
single-GPU executor the model runs in a spawned worker process instead, so set
``TLLM_WORKER_USE_SINGLE_PROCESS=1`` (tensorrt_llm/llmapi/utils.py,
``enable_worker_single_process_for_tp1``; tensorrt_llm/executor/executor.py then builds the worker
in-process).
"""

from __future__ import annotations

import functools
import logging
import os

from .adapter import SHADOWS, ReplaySSMAdapter, replay_selective_state_update
from .check import HOOK_ATTR, VERIFIED_AGAINST, bypass_message, check_mixer_class, verified_summary

log = logging.getLogger("trtllm_replayssm_module")

__all__ = ["VERIFIED_AGAINST", "install", "uninstall", "patch_classes", "replay_step", "new_adapter",
           "check_cache_manager", "follow_relocation", "relocation_moves", "relocation_hook"]

_installed: dict = {}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


def _env_choice(name: str, choices: tuple, default: str) -> str:
    raw = os.environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {raw!r}")
    return raw


def prefill_slots(attn_metadata):
    """Slots of this step's prefill rows (prefill rows come first), or None."""
    n = int(getattr(attn_metadata, "num_contexts", 0) or 0)
    if n == 0:
        return None
    idx = getattr(getattr(attn_metadata, "mamba_metadata", None), "state_indices", None)
    if idx is None:  # older layout: the Python Mamba cache manager hands out the indices
        idx = attn_metadata.kv_cache_manager.get_state_indices()
    return idx[:n]


def model_pattern(model) -> str | None:
    """``hybrid_override_pattern`` of a NemotronHModel (``model_config.pretrained_config``), or None."""
    cfg = getattr(getattr(model, "model_config", None), "pretrained_config", None)
    return getattr(cfg, "hybrid_override_pattern", None)


def decode_rows(attn_metadata) -> int:
    """Decode rows of this step: all sequences after the ``num_contexts`` prefill rows (as Mamba2Mixer splits)."""
    n = getattr(attn_metadata, "num_seqs", None)
    if n is None:
        seq_lens = getattr(attn_metadata, "seq_lens", None)
        n = 0 if seq_lens is None else int(seq_lens.shape[0])
    return int(n) - int(getattr(attn_metadata, "num_contexts", 0) or 0)


def new_adapter() -> ReplaySSMAdapter:
    """An adapter configured from the environment (``TRTLLM_REPLAYSSM_BUFFER_LEN``, ``..._CHECK_VALUES``,
    ``..._SHADOW``: none, bf16 or fp8)."""
    return ReplaySSMAdapter(buffer_len=_env_int("TRTLLM_REPLAYSSM_BUFFER_LEN", 16),
                            check_values=os.environ.get("TRTLLM_REPLAYSSM_CHECK_VALUES") == "1",
                            shadow=_env_choice("TRTLLM_REPLAYSSM_SHADOW", SHADOWS, "none"))


# ---- cache managers that relocate live requests (TensorRT-LLM's V2 hybrid Mamba manager) -------------------------
# Read at mamba_cache_manager_v2.py / common.py 28295084 (tensorrt_llm/_torch/pyexecutor/kv_cache/mamba_cache_manager/):
# a V2 request's state slot is its SSM page (``kv_cache.get_ssm_block_base_index``), which can change between steps
# while the request lives; V2 moves the pool pages itself (ssm and conv states), so the request's TensorRT-LLM state is
# at its new slot. ``MambaHybridCacheManagerV2._setup_state_indices`` (run by ``prepare_resources`` before each step's
# forward, and by ``add_dummy_requests``) records each generation request's previous slot (-1: none yet), sets the new
# ones, then calls ``self._cache_features.state_update.relocate_slots(old_slots, new_slots)`` (host int lists, one
# entry per generation request) and ``reset_slots`` for entries with old < 0; ``get_state_update_strategy()`` (common.py)
# returns that strategy. Its contract, as TensorRT-LLM's own strategies implement it (kimi_kda/cache_manager.py
# 28295084, ``KDAReplayStateUpdateStrategy.relocate_slots``): the moves are the pairs with ``old >= 0 and old != new``;
# every source row is gathered (``index_select``) before the destinations are written (``index_copy_``), so swaps and
# cycles move whole slots and slots that are no destination keep their rows. An earlier V2 manager (same
# ``_setup_state_indices``) called the instance method ``self._on_state_slots_relocated(old_slots, new_slots)`` instead.
RELOCATION_HOOKS = ("get_state_update_strategy().relocate_slots", "_on_state_slots_relocated")
_FOLLOWERS = "replayssm_followers"  # attribute of our wrapper: the callbacks it runs after TensorRT-LLM's hook


def relocation_moves(old_slots, new_slots) -> tuple[list[int], list[int]]:
    """(sources, destinations) of one ``relocate_slots(old_slots, new_slots)`` call, by TensorRT-LLM's contract (the
    comment above): pairs with old >= 0 and old != new. ValueError when the lists differ in length or two moves
    share a destination (no gather-then-scatter order could honour both)."""
    old, new = [int(s) for s in old_slots], [int(s) for s in new_slots]
    if len(old) != len(new):
        raise ValueError(f"relocate_slots: expected one new slot per old slot, got {len(old)} old and {len(new)} new")
    moves = [(o, n) for o, n in zip(old, new) if o >= 0 and o != n]
    dst = [n for _, n in moves]
    if any(n < 0 for n in dst) or len(set(dst)) != len(dst):
        raise ValueError(f"relocate_slots: expected distinct destination slots >= 0, got moves {moves}")
    return [o for o, _ in moves], dst


def relocation_hook(manager) -> tuple[object, str] | None:
    """(object, method name) of the call through which ``manager`` announces relocated slots (``RELOCATION_HOOKS``:
    its state-update strategy's ``relocate_slots``, else its own ``_on_state_slots_relocated``), or None."""
    get = getattr(manager, "get_state_update_strategy", None)
    strategy = get() if callable(get) else None
    if strategy is not None and callable(getattr(strategy, "relocate_slots", None)):
        return strategy, "relocate_slots"
    if callable(getattr(manager, "_on_state_slots_relocated", None)):
        return manager, "_on_state_slots_relocated"
    return None


def follow_relocation(manager, move) -> str | None:
    """Run ``move(src, dst)`` (host int lists of :func:`relocation_moves`, only when something moves) right after
    ``manager``'s relocation hook, on every call; returns the hook's name, None when ``manager`` has none. The hook is
    wrapped on the instance (TensorRT-LLM's classes are not touched); wrapping twice adds a follower, never a second
    wrapper, and the same ``move`` is added once."""
    found = relocation_hook(manager)
    if found is None:
        return None
    target, name = found
    current = getattr(target, name)
    followers = getattr(current, _FOLLOWERS, None)
    if followers is None:
        original, followers = current, []

        @functools.wraps(original)
        def relocate(old_slots, new_slots, *args, **kwargs):
            out = original(old_slots, new_slots, *args, **kwargs)
            src, dst = relocation_moves(old_slots, new_slots)
            if src:
                for follower in followers:
                    follower(src, dst)
            return out

        setattr(relocate, _FOLLOWERS, followers)
        setattr(target, name, relocate)
    if move not in followers:
        followers.append(move)
    return f"{type(target).__qualname__}.{name}"


def _moves_slots(manager) -> bool:
    """A manager that can move live requests between slots: a V2 hybrid manager (by module) or one with a
    ``relocate_slots`` of its own."""
    return (any("mamba_cache_manager_v2" in k.__module__ for k in type(manager).__mro__)
            or callable(getattr(manager, "relocate_slots", None)))


def check_cache_manager(manager, follow=None) -> str | None:
    """Refuse the cache configurations ReplaySSM cannot follow, before a step runs; follow the relocations it can.

    Its rings and cursor are per slot and live beside TensorRT-LLM's state pool. A manager that moves live requests
    between slots (the V2 hybrid manager) is followed through its relocation hook (:func:`follow_relocation` with
    ``follow``, the adapter's slot move); returns the hook's name (None: nothing to follow). Refused:
    - a manager that moves slots but exposes none of ``RELOCATION_HOOKS`` (or ``follow`` is None): our rings would
      stay behind;
    - block reuse: it commits ``ssm_states`` for later requests, which without our buffered tokens is stale.
    Not detectable here, also unsupported: disaggregated generation servers (state transferred into a slot
    whose cursor we would not reset) and breakable / piecewise CUDA graphs (the step hooks would be frozen
    into the graph while the mixers run eagerly)."""
    if manager is None:
        return None
    if getattr(manager, "enable_block_reuse", False) is True:
        raise RuntimeError("trtllm_replayssm_module: kv_cache_config.enable_block_reuse is on; reused SSM states "
                           "would miss the tokens ReplaySSM buffers (set enable_block_reuse=False, the Nemotron-H "
                           "default)")
    hook = None if follow is None else follow_relocation(manager, follow)
    if hook is None and _moves_slots(manager):
        kind = type(manager)
        raise RuntimeError(f"trtllm_replayssm_module: the cache manager {kind.__module__}.{kind.__qualname__} moves "
                           "live requests between state slots, but exposes no relocation hook ReplaySSM can follow "
                           f"(expected one of {', '.join(RELOCATION_HOOKS)}; read at TensorRT-LLM 28295084), so its "
                           "per-slot rings would stay behind: use a V1 manager (TRTLLM_USE_PY_MAMBA=1, kv_cache_config "
                           "use_kv_cache_manager_v2=False)")
    return hook


def replay_step(adapter: ReplaySSMAdapter, model, mixer_cls, attn_metadata, run):
    """One model step around ``run()``: step hooks, and the first-step check that decode reached us.

    A step with decode rows in which no Mamba-2 layer called the adapter means the mixer's decode no
    longer goes through ``selective_state_update_func``: raise rather than serve without ReplaySSM.
    TensorRT-LLM's warm-up (and CUDA-graph capture's eager passes) run such steps before serving."""
    manager = getattr(attn_metadata, "kv_cache_manager", None)
    if manager is not None and adapter.checked_manager is not manager:
        check_cache_manager(manager, adapter.relocate)
        adapter.checked_manager = manager
    adapter.expect_pattern(model_pattern(model))
    n_decode = decode_rows(attn_metadata)
    adapter.begin_step(prefill_slots(attn_metadata))
    try:
        out = run()
    except BaseException:
        adapter.abort_step()
        raise
    decoded = adapter.end_step()
    if n_decode > 0 and not decoded and adapter.mamba_layers != frozenset():
        raise RuntimeError(bypass_message(mixer_cls, f"ran a model step with {n_decode} decode rows in which no Mamba-2 "
                                          f"layer called the replaced {HOOK_ATTR}"))
    return out


def patch_classes(mixer_cls, model_cls, adapter: ReplaySSMAdapter) -> ReplaySSMAdapter:
    """Wrap ``mixer_cls.__init__`` (decode call) and ``model_cls.forward`` (step hooks) for ``adapter``."""
    if "mixer" in _installed:
        raise RuntimeError("trtllm_replayssm_module: already installed; call uninstall() first")
    orig_init, orig_forward = mixer_cls.__init__, model_cls.forward

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if not hasattr(self, HOOK_ATTR):
            raise RuntimeError(bypass_message(mixer_cls, f"has no attribute {HOOK_ATTR} after __init__"))
        self.replayssm_conventional_func = self.selective_state_update_func
        self.selective_state_update_func = functools.partial(replay_selective_state_update, adapter=adapter,
                                                             layer_idx=self.layer_idx)

    @functools.wraps(orig_forward)
    def forward(self, attn_metadata, *args, **kwargs):
        return replay_step(adapter, self, mixer_cls, attn_metadata,
                           lambda: orig_forward(self, attn_metadata, *args, **kwargs))

    mixer_cls.__init__, model_cls.forward = __init__, forward
    _installed.update(mixer=(mixer_cls, orig_init), model=(model_cls, orig_forward), adapter=adapter)
    return adapter


def uninstall() -> None:
    """Restore the original classes (mixers already constructed keep the replay function)."""
    if "mixer" in _installed:
        cls, init = _installed.pop("mixer")
        cls.__init__ = init
        cls, fwd = _installed.pop("model")
        cls.forward = fwd
        _installed.pop("adapter", None)


def install(adapter: ReplaySSMAdapter | None = None) -> ReplaySSMAdapter:
    """Fallback route: patch tensorrt_llm's Mamba2Mixer and NemotronHModel in this process; returns the adapter.

    Environment: ``TRTLLM_REPLAYSSM_BUFFER_LEN`` (L, default 16), ``TRTLLM_REPLAYSSM_CHECK_VALUES=1``
    (host-side slot/cursor checks; synchronizes every layer), ``TRTLLM_REPLAYSSM_SHADOW`` (none, bf16 or fp8: a
    low-precision checkpoint shadow the non-flush steps read; needs ``mamba_ssm_cache_dtype: float32``).
    Raises RuntimeError when the mixer's
    decode does not call the attribute we replace (:func:`.check.check_mixer_class`).
    """
    try:
        from tensorrt_llm._torch.models import modeling_nemotron_h
        from tensorrt_llm._torch.modules.mamba import mamba2_mixer
    except ImportError as e:
        raise ImportError("trtllm_replayssm_module.install: expected tensorrt_llm's PyTorch backend "
                          "(tensorrt_llm._torch.modules.mamba.mamba2_mixer, tensorrt_llm._torch.models."
                          f"modeling_nemotron_h); verified against {verified_summary()}; got: {e}") from e
    check_mixer_class(mamba2_mixer.Mamba2Mixer)
    if adapter is None:
        adapter = new_adapter()
    if os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") != "1":
        log.warning("trtllm_replayssm_module: patched this process only; a spawned executor worker does not import "
                    "--custom_module_dirs. For TP1 set TLLM_WORKER_USE_SINGLE_PROCESS=1.")
    return patch_classes(mamba2_mixer.Mamba2Mixer, modeling_nemotron_h.NemotronHModel, adapter)
