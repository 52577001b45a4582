# SPDX-License-Identifier: Apache-2.0
"""Nemotron-H and Nemotron 3 (transformers' ``NemotronHForCausalLM``) with ReplaySSM single-token decode.

Layer types (``config.layers_block_type``; pattern letters of ``hybrid_override_pattern``):
``linear_attention`` (M, Mamba-2), ``full_attention`` (*), ``mlp`` (-) and, in Nemotron 3,
``moe`` (E: transformers' ``NemotronHMoE``, sigmoid top-k routing with a correction bias, routed
experts, one shared expert, latent projections where the config has ``moe_latent_size``). Only
the Mamba-2 mixers are patched; every other layer is transformers' own module.

Loading: :func:`load_nemotron_h` reads an HF directory (``config.json`` + ``*.safetensors``,
checked for model type, layer types, MoE sizes, missing, unexpected and mis-shaped tensors; NVIDIA's
per-expert tensors ``experts.<e>.up_proj.weight`` are stacked into transformers' (E, I, D) expert
parameters as transformers' own loader does) or, without a directory, builds an embedded tiny
config with seeded random weights: :data:`TINY_CONFIG` (Nemotron-H: ``M*-M-M*-``) or
:data:`TINY3_CONFIG` (Nemotron 3: ``MEM*EM*E``, 8 experts, top-2, one shared expert); both with the
Mamba geometry the GPU kernels support (headdim 64, dstate 64, 4 heads in 2 groups). The MoE
router (``gate.weight``, ``e_score_correction_bias``) stays fp32 in every dtype, as transformers
keeps it (``_keep_in_fp32_modules_strict``).

Patching (:func:`patch_replayssm`), per Mamba-2 mixer, mirroring the mixer's own decode path:

    zxbcdt = in_proj(h);  z, xBC, dt = split(zxbcdt, [H*P, H*P + 2*G*N, H])
    xBC    = silu(conv1d over the conv state window)        (the model's causal_conv1d_update)
    x, B, C = split(xBC);  y = backend(x, B, C, dt raw, dt_bias, A = -exp(A_log), D, z=None)
    out    = out_proj(norm(y, z))                            (gated RMSNorm: y * silu(z), grouped)

``backend`` is the SSM step with the signature of :func:`trtllm_replayssm.families.mamba2.reference.replay_decode`
(called with keywords): the float64 reference on the CPU, :func:`trtllm_replayssm.families.mamba2.ops.replay_decode`
on CUDA. Prefill (more than one token) is the model's own chunked path; its final SSM state becomes
the checkpoint with an empty buffer (cursor 0). A continuation prefill after decode steps first folds
the buffer into the model's recurrent state (:func:`~trtllm_replayssm.families.mamba2.reference.replay_state`).
The cursor is shared by all Mamba layers and advanced once per model step (``advance_cursor``).
Beam search reorders our slots with the cache's (``reorder_cache``); switching between transformers caches
(several conversations) folds the buffers back into the cache held until then (``MixerPatch``). Not covered:
assisted decoding (caches that record the past: refused).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import sys
import weakref

import torch

from trtllm_replayssm import backend as executors
from trtllm_replayssm.backend import InjectedExecutor as StepExecutor
from trtllm_replayssm.cache import ReplayStateCache
from trtllm_replayssm.families.mamba2 import steps as mamba2_steps

# Layers: M = Mamba-2, * = attention, - = MLP.
TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    hybrid_override_pattern="M*-M-M*-",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    mamba_num_heads=4,
    mamba_head_dim=64,
    ssm_state_size=64,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    max_position_embeddings=1024,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    eos_token_id=None,  # greedy runs always produce the requested number of tokens
    pad_token_id=0,
    bos_token_id=1,
)
# Layers: M = Mamba-2, E = MoE, * = attention. The Mamba geometry is the tiny Nemotron-H's; the MoE
# follows Nemotron 3 Nano (sigmoid routing, routed_scaling_factor 2.5, one shared expert, relu2).
TINY3_CONFIG = dict(
    TINY_CONFIG,
    hybrid_override_pattern="MEM*EM*E",
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    moe_shared_expert_intermediate_size=128,
    n_shared_experts=1,
    moe_latent_size=None,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    mlp_hidden_act="relu2",
)
TINY_CONFIGS = {"nemotron_h": TINY_CONFIG, "nemotron3": TINY3_CONFIG}
SUPPORTED_LAYERS = ("linear_attention", "full_attention", "mlp", "moe")
PATTERN_LETTERS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# config.json spellings of layers_block_type transformers accepts (its legacy names remapped)
LAYER_NAMES = ("linear_attention", "full_attention", "mlp", "moe", "mamba", "attention")


class CheckpointError(ValueError):
    """A model directory that is not a loadable Nemotron-H checkpoint; the message says what is wrong."""


def read_config(model_dir) -> tuple[pathlib.Path, pathlib.Path, object]:
    """(directory, its config.json, the parsed JSON) of a checkpoint directory; CheckpointError naming the file when
    there is none or it is not JSON (the Nemotron-H loader's first read, and builders.models.for_checkpoint's)."""
    root = pathlib.Path(model_dir)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"model: expected a directory with config.json, got {str(root)!r} without one")
    try:
        return root, cfg_path, json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e


def from_pretrained_checked(cls, model_dir, **kw):
    """``cls.from_pretrained(model_dir, **kw)`` in eval mode, with every missing or mis-shaped tensor refused by name
    (:class:`CheckpointError`): transformers' loader only warns about missing tensors and initialises them at random,
    and reports mis-shaped ones without their names."""
    try:  # mis-shaped tensors come back in info (refused below, by name), not as transformers' nameless error
        model, info = cls.from_pretrained(str(model_dir), output_loading_info=True, ignore_mismatched_sizes=True, **kw)
    except Exception as e:  # no weights, unreadable tensors
        raise CheckpointError(f"model: cannot load {str(model_dir)!r} ({type(e).__name__}: {e})") from e
    for what, key in (("missing from", "missing_keys"), ("mis-shaped in", "mismatched_keys")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            raise CheckpointError(f"model: {len(names)} tensors {what} {str(model_dir)!r}: {names[:8]}")
    return model.eval()


def _require_transformers():
    try:
        from transformers import DynamicCache, NemotronHConfig, NemotronHForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the installed version
        raise ImportError(
            "transformers with NemotronHConfig / NemotronHForCausalLM is required (pip install 'transformers>=5.24')"
        ) from e
    if not hasattr(DynamicCache, "get_conv_state"):  # pragma: no cover
        import transformers

        raise ImportError(f"transformers {transformers.__version__}: expected >= 5.24 (the Mamba cache API this patch uses)")
    return NemotronHConfig, NemotronHForCausalLM


def _check_layers(config) -> None:
    """Layer types we support and, with MoE layers, MoE sizes transformers' router can run; the
    error names the config key."""
    bad = sorted({t for t in config.layers_block_type if t not in SUPPORTED_LAYERS})
    if bad:
        raise CheckpointError(f"layers_block_type: expected only {SUPPORTED_LAYERS}, got {bad}")
    if "moe" in config.layers_block_type:
        _check_moe(config)


def _check_moe(config) -> None:
    def num(key, lo=1):
        v = getattr(config, key, None)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise CheckpointError(f"{key}: expected an integer >= {lo} for the MoE layers, got {v!r}")
        return v

    E, k = num("n_routed_experts"), num("num_experts_per_tok")
    groups, top_groups = num("n_group"), num("topk_group")
    num("moe_intermediate_size")
    num("moe_shared_expert_intermediate_size")
    if config.moe_latent_size is not None:
        num("moe_latent_size")
    shared = getattr(config, "n_shared_experts", 1)
    if shared != 1:  # transformers builds one shared MLP of moe_shared_expert_intermediate_size whatever this says
        raise CheckpointError(f"n_shared_experts: expected 1 (transformers' NemotronHMoE has one shared expert of "
                              f"moe_shared_expert_intermediate_size; TensorRT-LLM would size it n_shared_experts "
                              f"times that), got {shared!r}")
    if E % groups:
        raise CheckpointError(f"n_group: expected a divisor of n_routed_experts={E}, got {groups}")
    if E // groups < 2:  # the router scores each group by its two best experts
        raise CheckpointError(f"n_group: expected >= 2 experts per group (n_routed_experts={E}), got {groups} groups")
    if top_groups > groups:
        raise CheckpointError(f"topk_group: expected <= n_group={groups}, got {top_groups}")
    if k > top_groups * (E // groups):
        raise CheckpointError(f"num_experts_per_tok: expected <= the experts of the topk_group={top_groups} kept groups "
                              f"({top_groups * (E // groups)}), got {k}")


def _check_raw_layers(raw: dict, cfg_path) -> None:
    """Layer types in config.json itself (transformers' own messages for these are a bare KeyError)."""
    pattern = raw.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise CheckpointError(f"{cfg_path}: hybrid_override_pattern: expected a string, got {pattern!r}")
        bad = sorted({(i, c) for i, c in enumerate(pattern) if c not in PATTERN_LETTERS})
        if bad:
            raise CheckpointError(f"{cfg_path}: hybrid_override_pattern: expected only {''.join(PATTERN_LETTERS)}, "
                                  f"got {bad[0][1]!r} at position {bad[0][0]} (of {len(bad)} unknown)")
    types = raw.get("layers_block_type")
    if types is not None:
        if not isinstance(types, list):
            raise CheckpointError(f"{cfg_path}: layers_block_type: expected a list, got {types!r}")
        bad = [(i, t) for i, t in enumerate(types) if t not in LAYER_NAMES]
        if bad:
            raise CheckpointError(f"{cfg_path}: layers_block_type: expected names in {LAYER_NAMES}, got {bad[0][1]!r} "
                                  f"at layer {bad[0][0]} (of {len(bad)} unknown)")


def tiny_config(tiny: str = "nemotron_h", **overrides):
    """The embedded tiny config ``tiny`` ("nemotron_h" or "nemotron3") with ``overrides``."""
    NemotronHConfig, _ = _require_transformers()
    if tiny not in TINY_CONFIGS:
        raise ValueError(f"tiny: expected one of {sorted(TINY_CONFIGS)}, got {tiny!r}")
    return NemotronHConfig(**{**TINY_CONFIGS[tiny], **overrides})


def has_moe(config) -> bool:
    return "moe" in config.layers_block_type


def _fp32_names(model) -> list[str]:
    """Parameters and buffers transformers keeps in fp32 whatever the dtype (the MoE router)."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return [n for n in names if any(k in n for k in keep)]


def _to(model, dtype, device, fp32: dict):
    """``model.to(device, dtype)``, then the router tensors back in fp32 from ``fp32`` (name -> tensor)."""
    model = model.to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, t in fp32.items():
            mod_name, _, leaf = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            cur = getattr(mod, leaf)
            new = t.detach().to(device=device, dtype=torch.float32)
            if isinstance(cur, torch.nn.Parameter):
                setattr(mod, leaf, torch.nn.Parameter(new, requires_grad=cur.requires_grad))
            else:
                setattr(mod, leaf, new)
    return model


@torch.no_grad()
def randomize_(model, seed: int = 0):
    """Seeded random weights with O(1) activations (so greedy decoding is not degenerate)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":  # A = -exp(A_log) in [-16, -1]
            v = torch.log(torch.rand(p.shape, generator=gen) * 15 + 1)
        elif leaf == "dt_bias":  # softplus(dt_bias) log-uniform in [1e-3, 0.1]
            dt = torch.exp(torch.rand(p.shape, generator=gen) * math.log(0.1 / 1e-3) + math.log(1e-3))
            v = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "D" or name.endswith(("norm.weight", "norm_f.weight")):
            v = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif leaf == "bias":
            v = 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() >= 2:  # (out, in), conv (C, 1, K), experts (E, out, in): the last dim is the fan-in
            fan_in = p.shape[-1] if "embeddings" not in name else 1
            v = torch.randn(p.shape, generator=gen) * fan_in ** -0.5
        else:
            v = torch.randn(p.shape, generator=gen)
        p.copy_(v.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
            b.copy_((0.1 * torch.randn(b.shape, generator=gen)).to(b.dtype))
    return model


def load_nemotron_h(model_dir=None, dtype: torch.dtype = torch.float32, seed: int = 0, device="cpu",
                    tiny: str = "nemotron_h"):
    """``NemotronHForCausalLM`` in eval mode: from ``model_dir`` or the tiny config ``tiny`` ("nemotron_h"
    or "nemotron3") with random weights."""
    NemotronHConfig, NemotronHForCausalLM = _require_transformers()
    if model_dir is None:
        model = randomize_(NemotronHForCausalLM(tiny_config(tiny)), seed)
        sd = model.state_dict()
        return _to(model, dtype, device, {n: sd[n].clone() for n in _fp32_names(model)}).eval()
    root, cfg_path, raw = read_config(model_dir)
    if raw.get("model_type") != "nemotron_h":
        from .qwen3_next import ACCEPTED_MODEL_TYPES, MODEL_TYPES

        if raw.get("model_type") in MODEL_TYPES:
            raise CheckpointError(f"{cfg_path}: model_type {raw['model_type']!r} is a Qwen3-Next / Qwen3.5 checkpoint: "
                                  f"load it with builders.qwen3_next.load_gdn_model (the scripts choose by model_type)")
        raise CheckpointError(f"{cfg_path}: model_type: expected one of {list(ACCEPTED_MODEL_TYPES)} (Nemotron-H / "
                              f"Nemotron 3, Qwen3-Next / Qwen3.5), got {raw.get('model_type')!r}")
    _check_raw_layers(raw, cfg_path)
    try:
        config = NemotronHConfig.from_pretrained(str(root))
    except Exception as e:  # transformers raises several types for a bad config
        raise CheckpointError(f"{cfg_path}: not a valid NemotronHConfig ({type(e).__name__}: {e})") from e
    _check_layers(config)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model: expected *.safetensors files in {str(root)!r}, found none")
    with torch.device("meta"):
        model = NemotronHForCausalLM(config)
    expected = model.state_dict()
    # names and shapes only: every error comes before any tensor is read
    index = _stack_experts(_index_safetensors(files), expected)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(index) - optional)
    if missing:
        raise CheckpointError(f"model: {len(missing)} tensors missing from {str(root)!r}: {missing[:8]}")
    unexpected = sorted(set(index) - set(expected))
    if unexpected:
        raise CheckpointError(f"model: {len(unexpected)} unexpected tensors in {str(root)!r}: {unexpected[:8]}")
    for name, (_, shape, _) in index.items():
        if shape != tuple(expected[name].shape):
            raise CheckpointError(f"{name}: expected shape {tuple(expected[name].shape)}, got {shape}")
    fp32 = set(_fp32_names(model))
    tensors = _read_tensors(index, dtype, fp32)
    model.load_state_dict(tensors, strict=not optional, assign=True)
    if config.tie_word_embeddings and "lm_head.weight" not in tensors:
        # transformers' tie_weights() does nothing here (NemotronHForCausalLM declares no tied keys), which left the
        # head on the meta device: tie it by hand, as transformers' own loader does for this config
        model.lm_head.weight = model.model.embeddings.weight
    return _to(model, dtype, device, {n: tensors[n] for n in fp32 if n in tensors}).eval()


_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.mixer\.experts)\.(?P<e>\d+)\.(?P<proj>up_proj|down_proj)\.weight$")


def _index_safetensors(files) -> dict:
    """{model key: ([(file, key in the file)], shape, stacked)}; NVIDIA's ``backbone.`` prefix is read as
    ``model.``. ``stacked``: the sources are the experts of one stacked tensor (:func:`_stack_experts`)."""
    from safetensors import SafetensorError, safe_open

    index = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():  # noqa: SIM118  (safe_open is not a dict)
                    if k.startswith("mtp."):  # multi-token-prediction heads are not used for decode
                        continue
                    name = "model." + k[len("backbone."):] if k.startswith("backbone.") else k
                    if name in index:
                        raise CheckpointError(f"{name}: stored twice ({index[name][0][0][0].name} and {f.name})")
                    index[name] = ([(f, k)], tuple(st.get_slice(k).get_shape()), False)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from e
    return index


def _stack_experts(index: dict, expected: dict) -> dict:
    """Per-expert ``<layer>.mixer.experts.<e>.{up,down}_proj.weight`` entries (NVIDIA's checkpoints) become
    one stacked ``<layer>.mixer.experts.{up,down}_proj`` entry (transformers' parameter), experts in
    order; every expert 0..E-1 present, all of one shape."""
    groups: dict[str, dict[int, tuple]] = {}
    out = {}
    for name, entry in index.items():
        m = _EXPERT_KEY.match(name)
        if m is None:
            out[name] = entry
        else:
            groups.setdefault(f"{m['prefix']}.{m['proj']}", {})[int(m["e"])] = (name, entry)
    for target, by_e in sorted(groups.items()):
        if target in out:
            raise CheckpointError(f"{target}: stored both stacked and per expert ({by_e[min(by_e)][0]})")
        want = expected.get(target)
        E = want.shape[0] if want is not None else max(by_e) + 1
        absent = sorted(set(range(E)) - set(by_e))
        extra = sorted(set(by_e) - set(range(E)))
        if absent or extra:
            what = f"missing experts {absent[:8]}" if absent else f"experts beyond {E - 1}: {extra[:8]}"
            raise CheckpointError(f"{target}: expected per-expert tensors for experts 0..{E - 1} "
                                  f"({target.rsplit('.', 1)[0]}.<e>.{target.rsplit('.', 1)[1]}.weight), {what}")
        shapes = {e: by_e[e][1][1] for e in range(E)}
        odd = [e for e in range(E) if shapes[e] != shapes[0]]
        if odd:
            raise CheckpointError(f"{by_e[odd[0]][0]}: expected shape {shapes[0]} like expert 0, got {shapes[odd[0]]}")
        out[target] = ([by_e[e][1][0][0] for e in range(E)], (E, *shapes[0]), True)
    return out


def _read_tensors(index: dict, dtype: torch.dtype, fp32=()) -> dict:
    """Every entry of ``index`` in ``dtype`` (names in ``fp32``: float32); stacked entries stacked."""
    from safetensors import safe_open

    parts, by_file = {}, {}
    for name, (sources, _, _) in index.items():
        for j, (f, k) in enumerate(sources):
            by_file.setdefault(f, []).append((name, j, k))
    for f, keys in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for name, j, k in keys:
                parts.setdefault(name, {})[j] = st.get_tensor(k).to(torch.float32 if name in fp32 else dtype)
    out = {}
    for name, (sources, _, stacked) in index.items():
        got = parts[name]
        out[name] = torch.stack([got[j] for j in range(len(sources))]) if stacked else got[0]
    return out


# ---- SSM backends ---------------------------------------------------------------------------------
# ``reference.replay_decode`` in float64, caches written back in their own dtypes, y in x's dtype: the reference
# executor of trtllm_replayssm.backend in the launchers' keyword form (the graph node and the ORT op call it).
reference_backend = mamba2_steps.replay_decode_kw(executors.REFERENCE)


def mamba_layers(model) -> list[int]:
    return [i for i, t in enumerate(model.config.layers_block_type) if t == "linear_attention"]


# ---- patching ---------------------------------------------------------------------------------------
class MixerPatch:
    """The patching both decoders share (this one and builders/qwen3_next.py's): each patched mixer runs our
    decode for single-token steps of the cache it holds state for and the model's own forward otherwise
    (prefill, with ``_begin_prefill`` / ``_end_prefill`` around it). The state is a standard-cursor
    :class:`~trtllm_replayssm.cache.ReplayStateCache` (``cache``, made at the prefill hand-off): the first
    decoding mixer of a model step opens the cache's step, a forward hook on the model commits it (the cursor
    advances once; after a prefill it is zeroed). Subclasses give ``_mixers()``, ``_has_state(layer_idx)``,
    ``_decode`` (one ``cache.verify`` / ``gdn_verify``), ``_fold_into`` (a layer's committed state into a
    transformers recurrent state), ``_end_prefill`` (which calls ``_take`` with the transformers cache it holds
    state for) and set ``model``, ``cache``, ``buffer_len``, ``_step``, ``_cache_ref``, ``_handles``.

    One transformers cache at a time holds its newest SSM state in our buffers (the one last prefilled). When
    another cache is prefilled, or on ``unpatch()``, the buffers are first folded back into the held cache's
    recurrent state, so that cache continues correctly (through the model's own path, or after its next
    prefill, through ours again). A beam search's ``reorder_cache`` reorders our slots with the cache's.

    A model forward that raises mid-step (an error in a later layer, an interrupt) leaves the step open, some
    layers decoded and their conv windows advanced in the transformers cache, others not: the next forward
    aborts that step and marks the cache it held broken; any further use of that cache (decode, continuation
    prefill, write-back) is refused by name instead of continuing from an inconsistent state. A fresh cache
    (a new prefill) works as before."""

    _step_cache = None  # weakref of the transformers cache of the step under way
    BROKEN = "_replayssm_broken"  # the attribute that marks a transformers cache a forward left mid-step

    def _holds(self, cache) -> bool:
        return self._cache_ref is not None and self._cache_ref() is cache

    def _take(self, cache) -> None:
        """``cache`` is the one our buffers continue from now on (its prefill was just handed off)."""
        if self._holds(cache):
            return
        self._cache_ref = weakref.ref(cache)
        if "reorder_cache" not in cache.__dict__ and hasattr(cache, "reorder_cache"):
            orig, me, held = cache.reorder_cache, weakref.ref(self), weakref.ref(cache)

            def reorder_cache(beam_idx):
                d = me()
                if d is not None and d.cache is not None and d._holds(held()):
                    d.cache.gather_slots(beam_idx)  # row b continues beam beam_idx[b], as the cache's own states
                return orig(beam_idx)

            cache.reorder_cache = reorder_cache

    def _write_back(self) -> None:
        """Fold our buffers into the held transformers cache's recurrent states (if it still lives and no
        forward left it mid-step)."""
        held = None if self._cache_ref is None else self._cache_ref()
        if held is None or self.cache is None or self._is_broken(held):
            return
        for i in sorted(self._ready):
            rec = held.get_recurrent_state(i)
            if rec is not None:
                self._fold_into(i, rec)

    def _begin_prefill(self, mixer, cache) -> None:
        """A continuation prefill of the held cache starts from the state our buffers stand for."""
        if self._has_state(mixer.layer_idx) and self._holds(cache):
            rec = cache.get_recurrent_state(mixer.layer_idx)
            if rec is not None:
                self._fold_into(mixer.layer_idx, rec)

    def _is_broken(self, cache) -> bool:
        return cache is not None and getattr(cache, self.BROKEN, False)

    def _before_model_step(self, module, args) -> None:
        """A step still open here was left by a forward that raised: abort it and mark the cache that step ran
        on (a raising prefill of a new cache breaks that one, not the one our buffers held until then). The mark
        is on the transformers cache itself, so every broken cache stays refused, whatever happens after."""
        if self._step is None:
            return
        if self._step == "decode" and self.cache is not None:
            self.cache.abort_step()
        broken = None if self._step_cache is None else self._step_cache()
        if broken is not None:
            setattr(broken, self.BROKEN, True)
        self._step = None

    def _forward(self, mixer, orig, hidden_states, cache=None, attention_mask=None, **kw):
        if cache is None:
            return orig(hidden_states, cache=cache, attention_mask=attention_mask, **kw)
        if self._is_broken(cache):
            raise RuntimeError("ReplaySSM patch: an earlier forward on this cache raised in the middle of a step "
                               "(some layers had advanced their states, others not); its sequences cannot "
                               "continue: start again from a new cache (prefill the prompt again)")
        if cache.is_recording_past(mixer.layer_idx):
            raise NotImplementedError("ReplaySSM patch: caches that record the past (assisted decoding) are not supported")
        decode = (hidden_states.shape[1] == 1 and self._has_state(mixer.layer_idx) and self._holds(cache)
                  and cache.get_conv_state(mixer.layer_idx) is not None)
        self._step_cache = weakref.ref(cache)
        if decode:
            if self._step != "decode":  # the step's first decoding mixer opens the cache's step
                self.cache.flush(self._rows(), 1)
                self._step = "decode"
            return self._decode(mixer, hidden_states, cache, attention_mask)
        self._step = "prefill"
        self._begin_prefill(mixer, cache)
        out = orig(hidden_states, cache=cache, attention_mask=attention_mask, **kw)
        self._end_prefill(mixer, cache, hidden_states.dtype)
        return out

    def _after_model_step(self, module, args, output) -> None:
        if self._step == "decode":
            self._end_decode_step()
        elif self._step == "prefill":
            self.cursor.zero_()
        self._step = None

    def _rows(self) -> torch.Tensor:
        """state_batch_indices of a decode step: row b uses slot b."""
        return torch.arange(self.cache.num_slots, dtype=torch.int32, device=self.cache.cursor.device)

    def _end_decode_step(self) -> None:
        self.cache.commit(self._rows(), None, 1)  # the cursor advances once for all layers

    def patch(self):
        for mixer in self._mixers():
            orig = mixer.forward

            def fwd(hidden_states, cache=None, attention_mask=None, _mixer=mixer, _orig=orig, **kw):
                return self._forward(_mixer, _orig, hidden_states, cache, attention_mask, **kw)

            mixer.forward = fwd
            self._handles.append(lambda _m=mixer: _m.__dict__.pop("forward", None))
        h = self.model.model.register_forward_hook(self._after_model_step)
        self._handles.append(h.remove)
        h = self.model.model.register_forward_pre_hook(self._before_model_step)
        self._handles.append(h.remove)
        return self

    def unpatch(self) -> None:
        """Undo the patch; the held cache's recurrent states get what our buffers hold, so it continues unpatched
        (unless a forward left it mid-step: that step is aborted and the cache stays marked broken)."""
        self._before_model_step(None, ())
        self._write_back()
        for undo in self._handles:
            undo()
        self._handles.clear()


class LinearAttentionPatch(MixerPatch):
    """What the linear-attention families' patches share (Gated DeltaNet: builders/qwen3_next.py, Kimi Delta
    Attention: builders/kda.py): the patched layers, the decode conv's presence in the model's module, the map from
    a model layer to its cache layer, and the views of a standard-cursor cache of those layers (``cursor``, ``bufs``;
    the cache is made at the first prefill hand-off). Mamba-2's patch (:class:`ReplaySSMDecoder`) keeps its own."""

    def _init_layers(self, model, layers: list[int], family: str, mixer, buffer_len: int, state_dtype,
                     check_values) -> None:
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        self.model, self.buffer_len, self.state_dtype = model, buffer_len, state_dtype
        self.check_values = check_values  # the cache's host checks (None: unless capturing a CUDA graph)
        self.layers = layers
        if not layers:
            raise ValueError(f"model: no linear_attention ({family}) layer in config.layer_types")
        mod = sys.modules[type(mixer(layers[0])).__module__]
        if not hasattr(mod, "causal_conv1d_forward"):
            import transformers

            raise RuntimeError(f"transformers {transformers.__version__}: {mod.__name__} has no causal_conv1d_forward "
                               f"(the decode conv the patch calls); needs transformers >= 5.25")
        self.j = {i: j for j, i in enumerate(layers)}
        self.cache = None  # a ReplayStateCache of these layers, from the first prefill hand-off
        self._ready: set[int] = set()
        self._step: str | None = None
        self._cache_ref = None  # weakref of the transformers cache our buffers continue
        self._handles = []

    @property
    def cursor(self) -> torch.Tensor | None:
        return None if self.cache is None else self.cache.cursor

    @property
    def bufs(self) -> dict:
        """{model layer: the cache layer's buffers (views)} of the layers handed off so far."""
        return {i: self.cache.layer(self.j[i]).buf for i in self.layers if i in self._ready}


class ReplaySSMDecoder(MixerPatch):
    """ReplaySSM state of a patched model, held by a :class:`~trtllm_replayssm.cache.ReplayStateCache` on its
    standard form (the (slots,) cursor and the standard decode step), allocated at the prefill hand-off.

    Row b of the batch uses slot b. The checkpoint S0 (batch, H, P, N) is in ``state_dtype``, x_cache / B_cache
    in the activation dtype, dt_cache fp32 (processed dt), cursor int32; the conv windows stay in the
    transformers cache (``conv_dim=0``). The cache's executor is the one for the model's device
    (backend.for_device), or wraps ``backend`` (the keyword signature of ``ops.replay_decode``) and ``advance``
    (``cursor_ops.advance_cursor``'s) when given. ``caches[layer_idx]`` and ``cursor`` are views of the cache.
    """

    def __init__(self, model, buffer_len: int, backend=None, advance=None, state_dtype=torch.float32,
                 check_values: bool | None = None):
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        self.model = model
        self.buffer_len = buffer_len
        self.state_dtype = state_dtype
        self.check_values = check_values  # the cache's host checks (None: unless capturing a CUDA graph)
        self.executor = executors.for_device(next(model.parameters()).device)
        if backend is not None or advance is not None:
            self.executor = StepExecutor(backend or mamba2_steps.replay_decode_kw(self.executor),
                                              advance or self.executor.advance_cursor)
        self.layers = mamba_layers(model)
        self.j = {i: j for j, i in enumerate(self.layers)}
        self.cache = None  # a ReplayStateCache, from the first prefill hand-off
        self._ready: set[int] = set()  # layers handed off into it
        self._step: str | None = None
        self._cache_ref = None  # weakref of the transformers cache our buffers continue
        self._handles = []

    @property
    def cursor(self) -> torch.Tensor | None:
        return None if self.cache is None else self.cache.cursor

    @property
    def caches(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per handed-off Mamba layer: views ``state``, ``x_cache``, ``B_cache``, ``dt_cache`` of the cache."""
        return {i: dict(state=lay.state, x_cache=lay.x_cache, B_cache=lay.B_cache, dt_cache=lay.dt_cache)
                for i in self.layers if i in self._ready for lay in (self.cache.layer(self.j[i]),)}

    def _mixers(self) -> list:
        return [self.model.model.layers[i].mixer for i in self.layers]

    def _has_state(self, layer_idx: int) -> bool:
        return layer_idx in self._ready

    # prefill: the model's own path, then its final state becomes the checkpoint
    def _fold_into(self, layer_idx: int, rec) -> None:
        A = -torch.exp(self.model.model.layers[layer_idx].mixer.A_log.float())
        for s in range(rec.shape[0]):
            rec[s] = self.cache.committed_state(self.j[layer_idx], s, A)

    def _end_prefill(self, mixer, cache, act_dtype) -> None:
        S = cache.get_recurrent_state(mixer.layer_idx)
        batch, H, P, N = S.shape
        if not self._holds(cache):
            self._write_back()  # the cache held until now keeps what our buffers hold
        c = self.cache
        if c is None or not self._holds(cache) or c.num_slots != batch or c.state.device != S.device \
                or c.x_cache.dtype != act_dtype or c.nheads != H:
            c = self.cache = ReplayStateCache(len(self.layers), batch, H, P, N, mixer.n_groups, self.buffer_len,
                                              conv_dim=0, state_dtype=self.state_dtype, act_dtype=act_dtype,
                                              device=S.device, cursor="standard", executor=self.executor,
                                              check_values=self.check_values)
            for _ in range(batch):
                c.allocate()
            self._ready = set()
        j = self.j[mixer.layer_idx]
        c.state[j].copy_(S.detach())  # the prefill's final state is the checkpoint; the buffers are empty
        for t in (c.x_cache, c.B_cache, c.dt_cache):
            t[j].zero_()
        self._ready.add(mixer.layer_idx)
        self._take(cache)

    def _decode(self, mixer, hidden_states, cache, attention_mask):
        from transformers.models.nemotron_h import modeling_nemotron_h as m

        batch = hidden_states.shape[0]
        dtype = hidden_states.dtype
        H, P, N, G = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
        proj = mixer.in_proj(m.apply_mask_to_padding_states(hidden_states, attention_mask))
        gate, xBC, dt = proj.split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)
        # the model's own decode conv (it also counts the token in the cache: get_seq_length follows)
        xBC = m.causal_conv1d_forward(mixer.conv1d, xBC.transpose(1, 2), cache, mixer.layer_idx,
                                      activation=mixer.activation)
        xBC = m.apply_mask_to_padding_states(xBC.transpose(1, 2), attention_mask)
        x, B, C = xBC.split([mixer.intermediate_size, G * N, G * N], dim=-1)
        sbi = self._rows()
        y = self.cache.verify(self.j[mixer.layer_idx], x.reshape(batch, 1, H, P).contiguous(),
                              B.reshape(batch, 1, G, N).contiguous(), C.reshape(batch, 1, G, N).contiguous(),
                              dt.reshape(batch, 1, H).contiguous(), mixer.dt_bias.float().contiguous(),
                              -torch.exp(mixer.A_log.float()), mixer.D.float().contiguous(), None, sbi)
        y = mixer.norm(y.reshape(batch, 1, -1).to(dtype), gate)
        return mixer.out_proj(y.to(dtype))

    def reset(self) -> None:
        self.cache = None
        self._ready = set()
        self._cache_ref = None


def patch_replayssm(model, buffer_len: int = 16, backend=None, advance=None, state_dtype=torch.float32, *,
                    tp: int = 1, rank: int = 0, group=None, check_values: bool | None = None):
    """Patch every Mamba-2 mixer of ``model`` in place; returns the :class:`ReplaySSMDecoder` (``unpatch()`` undoes).

    ``check_values``: the cache's host checks of slots and cursors (one sync per layer on CUDA); None (default)
    checks unless a CUDA graph is being captured, False serves without them (``ReplayStateCache``).

    ``tp > 1``: first keep rank ``rank``'s share of every layer (:func:`builders.tp_model.shard_nemotron_h_`,
    one process per rank, ``torch.distributed`` initialised); the checkpoint, buffers and conv state
    then hold this rank's heads only. Sharding is not undone by ``unpatch()``."""
    _check_layers(model.config)
    if tp != 1 or rank != 0:
        from .tp_model import shard_nemotron_h_

        shard_nemotron_h_(model, rank, tp, group)
    return ReplaySSMDecoder(model, buffer_len, backend, advance, state_dtype, check_values).patch()
