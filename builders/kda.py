# SPDX-License-Identifier: Apache-2.0
"""Kimi-Linear and GLM-5 Next (transformers' ``KimiLinearForCausalLM`` / ``Glm5NextForConditionalGeneration``) with
ReplaySSM Kimi Delta Attention (KDA) single-token decode.

Both models (transformers >= 5.25, ``models/kimi_linear``, ``models/glm5_next``) are hybrids of KDA layers
(``config.layer_types`` ``linear_attention``: ``KimiLinearDeltaAttention`` / ``Glm5NextTextLinearAttention`` at
``layers[i].self_attn``) and attention (Kimi: MLA, ``full_attention``; GLM-5 Next: DSA, ``indexed_attention``), with
MoE feed-forwards (and in GLM-5 Next hyper-connections around every block). Only the KDA layers are patched;
attention, MoE, hyper-connections, norms and the head stay transformers' own modules. GLM-5 Next's text model is
``model.model.language_model`` (transformers ships it inside the vision-language class only; text-only prompts run
through it unchanged).

Patching (:func:`patch_kda_replayssm`), per KDA layer, mirroring the layer's own decode path:

    q, k, v = silu(conv1d([q_proj(h) | k_proj(h) | v_proj(h)]))   (the model's causal_conv1d_forward: one depthwise
                                                                  conv over q | k | v and its conv state, width 4)
    f = f_b(f_a(h)) (H, K) raw;  b = b_proj(h) (H,) raw          (the forget gate's and beta's logits)
    y = cache.verify(layer, q, k, v, f, b, A_log, dt_bias)       (g and beta inside the step: Kimi's
                                                                  -exp(A_log) softplus(f + dt_bias), or GLM-5 Next's
                                                                  lower_bound sigmoid(exp(A_log) (f + dt_bias)))
    out = o_proj(o_norm(y, g_b(g_a(h))))                          (the layer's sigmoid-gated RMSNorm)

State: a standard-cursor :class:`~trtllm_replayssm.cache.ReplayStateCache` of the KDA layers
(``ReplayStateCache.for_family("kda", ...)``, the family's :class:`~trtllm_replayssm.families.kda.layers.KDALayers`;
``conv_dim=0``: the conv windows stay in the transformers cache). Its step on CPU tensors is
:func:`trtllm_replayssm.families.kda.reference.replay_decode` (float64): q and k l2-normalised in the step, q scaled
by K^-1/2, as transformers' ``recurrent_kimi_delta_attention(use_qk_l2norm_in_kernel=True)``; the u ring is bf16
(DESIGN §5) unless the checkpoint is float64. Prefill (more than one token) is the model's own chunked path; its
final recurrent state, which transformers keeps as (batch, H, K, V) fp32, is already the checkpoint layout
(S, H, K, V) (the fla layout, y = S^T q): ``cache.load_prefill`` takes it unchanged, with an empty ring (cursor 0).
A continuation prefill, another conversation's prefill and ``unpatch()`` first fold every layer's ring back into the
transformers cache (``cache.committed_state``: the exact recurrence) at the step's first KDA layer (load_prefill
zeroes the shared cursor). The cursor advances once per model step. Beam search, switching between caches and a
forward raising mid-step are builders/nemotron_h.py's ``MixerPatch`` (shared). Not covered: caches that record the
past. On CUDA the cache's KDA layers run the family's fused decode kernel (families/kda/ops.py).

The embedded tiny configs keep the published structure at toy sizes: :data:`TINY_KIMI_LINEAR` (Kimi-Linear-48B's
layout: 3 KDA + 1 MLA, KDA heads of K = V = 64, conv 4, MLA with a latent KV and NoPE/RoPE split, first layer dense
then MoE with sigmoid top-k routing and a shared expert; its ``linear_attn_config`` spelled as in the published
config.json) and :data:`TINY_GLM5_NEXT` (GLM-5.3-Flash's: 3 KDA + 1 DSA, forget gate bounded at -5, hyper-connections
of 4 streams, DSA indexer with k-pools, MoE; a one-block vision tower the text path never runs).
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch

from trtllm_replayssm.cache import ReplayStateCache

from .nemotron_h import CheckpointError, LinearAttentionPatch, from_pretrained_checked

_TEXT = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    num_experts_per_tok=2,
    n_shared_experts=1,
    rms_norm_eps=1e-5,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    eos_token_id=None,  # greedy runs always produce the requested number of tokens
    pad_token_id=0,
    bos_token_id=1,
)
# Kimi-Linear-48B-A3B's published config.json spells the KDA geometry and the layer pattern (1-indexed) in
# linear_attn_config, and the dense prefix as first_k_dense_replace: the tiny config does the same.
TINY_KIMI_LINEAR = dict(
    _TEXT,
    q_lora_rank=None,
    qk_rope_head_dim=16,
    num_experts=4,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    linear_attn_config=dict(head_dim=64, num_heads=2, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
                            full_attn_layers=[4]),
)
TINY_GLM5_NEXT = dict(
    text_config=dict(
        _TEXT,
        q_lora_rank=32,
        qk_rope_head_dim=0,  # DSA layers are NoPE
        n_routed_experts=4,
        index_topk=8,  # 2 pools of 4: prompts of 7+ tokens make the indexer choose
        index_kpool=4,
        index_head_dim=32,
        index_n_heads=2,
        hc_mult=4,
        linear_head_dim=64,
        linear_num_heads=2,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    ),
    vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=128,
                       projection_intermediate_size=64),
)
FAMILIES = {"kimi_linear": TINY_KIMI_LINEAR, "glm5_next": TINY_GLM5_NEXT}
MODEL_TYPES = ("kimi_linear", "glm5_next")  # config.json model_type of the checkpoints we load
# config.layer_types the two models build: KDA (patched), Kimi's MLA, GLM-5 Next's DSA (transformers' own)
LAYER_TYPES = ("linear_attention", "full_attention", "indexed_attention")


def _classes(model_type: str):
    """(config class, model class) of a model type of :data:`MODEL_TYPES`."""
    if model_type == "kimi_linear":
        from transformers import KimiLinearConfig, KimiLinearForCausalLM

        return KimiLinearConfig, KimiLinearForCausalLM
    if model_type == "glm5_next":
        from transformers.models.glm5_next import Glm5NextConfig, Glm5NextForConditionalGeneration

        return Glm5NextConfig, Glm5NextForConditionalGeneration
    raise ValueError(f"model_type: expected one of {MODEL_TYPES}, got {model_type!r}")


def text_model(model):
    """The decoder stack: ``model.model`` (Kimi-Linear) or ``model.model.language_model`` (GLM-5 Next)."""
    return getattr(model.model, "language_model", model.model)


def kda_layers(model) -> list[int]:
    return [i for i, t in enumerate(model.config.get_text_config().layer_types) if t == "linear_attention"]


def is_kda_checkpoint(model_dir) -> bool:
    """True when ``model_dir``/config.json names a Kimi-Linear / GLM-5 Next model (False if unreadable)."""
    try:
        kind = json.loads((pathlib.Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return kind in MODEL_TYPES


def tiny_model(family: str = "kimi_linear", dtype=torch.float32, seed: int = 0, device="cpu", **overrides):
    """transformers' own model class with an embedded tiny config and seeded random weights; ``overrides`` go to
    the text config. The forget gate gets a data-dependent decay that matters: f_b_proj std 0.5 (f = O(1) against
    dt_bias in (-7, -2)), and GLM-5 Next's A_log (zero at transformers' init) spread over (-1, 1); GLM-5 Next's
    hyper-connection biases (zero at init: pre, post and comb nearly uniform) standard normal and its indexers'
    k-pool compress gates and position embeddings (ones and zeros at init) random, so that stream mixing and pool
    weighting matter."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    cfg = FAMILIES[family]
    cfg = dict(cfg, **overrides) if family == "kimi_linear" else dict(cfg, text_config=dict(cfg["text_config"],
                                                                                             **overrides))
    config_cls, cls = _classes(family)
    torch.manual_seed(seed)
    model = cls(config_cls(**cfg)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i in kda_layers(model):
            fg = text_model(model).layers[i].self_attn.forget_gate
            fg.f_b_proj.weight.copy_(torch.randn(fg.f_b_proj.weight.shape, generator=gen) * 0.5)
            if family == "glm5_next":
                fg.A_log.copy_(torch.empty(fg.A_log.shape).uniform_(-1.0, 1.0, generator=gen))
        if family == "glm5_next":
            for layer in text_model(model).layers:
                for hc in (layer.attn_hc, layer.ffn_hc):  # init: base 0, scale 1: pre, post and comb nearly uniform
                    hc.base.copy_(torch.randn(hc.base.shape, generator=gen))
                ix = getattr(layer.self_attn, "indexer", None)
                if ix is not None:  # init: gate ones, ape zeros: every channel of a pool weighted alike
                    ix.index_kpool_compress_gate.copy_(torch.randn(ix.index_kpool_compress_gate.shape,
                                                                   generator=gen) * 0.1)
                    ix.index_kpool_compress_ape.copy_(torch.randn(ix.index_kpool_compress_ape.shape, generator=gen))
    return model.to(dtype=dtype, device=device)


def load_kda_model(model_dir=None, tiny: str = "kimi_linear", dtype=torch.float32, seed: int = 0, device="cpu"):
    """A Kimi-Linear / GLM-5 Next model: the checkpoint ``model_dir`` (config.json + safetensors, the published
    layouts: transformers' loader renames and stacks their per-projection conv and per-expert tensors), or without
    one the embedded tiny config ``tiny`` with seeded weights. A missing or unreadable config.json, another model
    type, layer types other than KDA and :data:`LAYER_TYPES`, or tensors missing, mis-shaped or unreadable raise
    :class:`builders.nemotron_h.CheckpointError` naming the key (transformers' loader itself only warns about
    missing tensors and initialises them at random)."""
    if model_dir is None:
        return tiny_model(tiny, dtype=dtype, seed=seed, device=device)
    cfg_path = pathlib.Path(model_dir) / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read the model config ({type(e).__name__}: {e})") from e
    kind = raw.get("model_type")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"{cfg_path}: model_type: expected one of {MODEL_TYPES}, got {kind!r}")
    config_cls, cls = _classes(kind)
    try:
        config = config_cls.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises several types for a bad config
        raise CheckpointError(f"{cfg_path}: not a valid {kind} config ({type(e).__name__}: {e})") from e
    types = list(config.get_text_config().layer_types or [])
    bad = [(i, t) for i, t in enumerate(types) if t not in LAYER_TYPES]
    if bad or "linear_attention" not in types:
        what = f"{bad[0][1]!r} at layer {bad[0][0]}" if bad else "no linear_attention (KDA) layer"
        raise CheckpointError(f"{cfg_path}: layer_types: expected KDA layers and others among {LAYER_TYPES}, got "
                              f"{what}")
    _check_tensors(pathlib.Path(model_dir), config, cls)
    return from_pretrained_checked(cls, model_dir, config=config, dtype=dtype).to(device)


def _check_tensors(model_dir: pathlib.Path, config, cls) -> None:
    """Every tensor the model needs is in the directory's safetensors, in the directory's own names and shapes:
    transformers' reverse conversion of the model's state dict (built on the meta device, no memory) names them
    as the published layout does (Kimi's ``q_conv1d`` / ``block_sparse_moe.experts.<e>.w1``, GLM's ``hc_attn_fn``
    ...), so a missing one is named as the checkpoint spells it."""
    from safetensors import safe_open
    from transformers.core_model_loading import revert_weight_conversion

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model: no *.safetensors in {str(model_dir)!r}")
    have = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as h:
                have.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
        except Exception as e:  # a truncated or foreign file
            raise CheckpointError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    with torch.device("meta"):
        skeleton = cls(config)
    want = {k: tuple(t.shape) for k, t in revert_weight_conversion(skeleton, skeleton.state_dict()).items()}
    missing = sorted(set(want) - set(have))
    if missing:
        raise CheckpointError(f"model: {len(missing)} tensors missing from {str(model_dir)!r}: {missing[:8]}")
    bad = [f"{k}: expected {want[k]}, got {have[k]}" for k in sorted(want) if have[k] != want[k]]
    if bad:
        raise CheckpointError(f"model: {len(bad)} tensors mis-shaped in {str(model_dir)!r}: {bad[:8]}")


class KDAReplayDecoder(LinearAttentionPatch):
    """ReplaySSM state of a patched Kimi-Linear / GLM-5 Next model: a standard-cursor
    :class:`~trtllm_replayssm.cache.ReplayStateCache` of its KDA layers (``for_family("kda", ...)``), allocated at
    the prefill hand-off (row b of the batch is slot b); the conv windows stay in the transformers cache
    (``conv_dim=0``). The cache's executor runs the step (the float64 spec on CPU tensors). ``bufs[layer_idx]``
    (KDABuffers views) and ``cursor`` are the cache's tensors."""

    def __init__(self, model, buffer_len: int, state_dtype=torch.float32, check_values: bool | None = None):
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        if model.config.model_type not in MODEL_TYPES:
            raise ValueError(f"model: expected a Kimi-Linear or GLM-5 Next model, got model_type "
                             f"{model.config.model_type!r}")
        self._init_layers(model, kda_layers(model), "KDA", lambda i: text_model(model).layers[i].self_attn,
                          buffer_len, state_dtype, check_values)
        self._folded = False  # this prefill step has folded our rings back (at its first KDA layer)

    def _mixers(self) -> list:
        return [text_model(self.model).layers[i].self_attn for i in self.layers]

    def _has_state(self, layer_idx: int) -> bool:
        return layer_idx in self._ready

    def _fold_into(self, layer_idx: int, rec) -> None:
        for s in range(rec.shape[0]):  # transformers' (H, K, V) is ours: no transpose
            rec[s] = self.cache.committed_state(self.j[layer_idx], s).to(rec.dtype)

    def _begin_prefill(self, mixer, cache) -> None:
        """At the step's first KDA layer, every layer's ring goes back into the held cache (load_prefill zeroes
        the shared cursor, so a later layer could not fold its ring after an earlier layer's hand-off)."""
        if not self._folded:
            self._write_back()
            self._folded = True

    def _before_model_step(self, module, args) -> None:
        self._folded = False
        super()._before_model_step(module, args)

    def _end_prefill(self, mixer, cache, act_dtype) -> None:
        S = cache.get_recurrent_state(mixer.layer_idx)  # (batch, H, K, V) fp32: our layout
        batch, H, K, V = S.shape
        c = self.cache
        if c is None or not self._holds(cache) or c.num_slots != batch or c.cursor.device != S.device \
                or c.layer(0).buf.k_cache.dtype != act_dtype:
            c = self.cache = ReplayStateCache.for_family(
                "kda", len(self.layers), batch, (H, K, V), self.buffer_len, conv_dim=0, cursor="standard",
                state_dtype=self.state_dtype, act_dtype=act_dtype, device=S.device, check_values=self.check_values)
            for _ in range(batch):
                c.allocate()
            self._ready = set()
        for s in range(batch):
            c.load_prefill(s, self.j[mixer.layer_idx], S[s].detach())
        self._ready.add(mixer.layer_idx)
        self._take(cache)

    def _decode(self, mixer, hidden_states, cache, attention_mask):
        m = sys.modules[type(mixer).__module__]
        batch, dtype = hidden_states.shape[0], hidden_states.dtype
        H, K = mixer.num_heads, mixer.head_dim
        hs = m.apply_mask_to_padding_states(hidden_states, attention_mask)
        mixed = torch.cat([mixer.q_proj(hs), mixer.k_proj(hs), mixer.v_proj(hs)], dim=-1).transpose(1, 2)
        mixed = m.causal_conv1d_forward(mixer.conv1d, mixed, cache, mixer.layer_idx,
                                        activation=mixer.activation).transpose(1, 2)
        q, k, v = (t.reshape(batch, 1, H, K) for t in torch.split(mixed, [mixer.qkv_dim] * 3, dim=-1))
        fg = mixer.forget_gate
        f = fg.f_b_proj(fg.f_a_proj(hs)).reshape(batch, 1, H, K)
        b = mixer.b_proj(hs).reshape(batch, 1, H)
        y = self.cache.verify(self.j[mixer.layer_idx], q, k, v, f, b, fg.A_log.float().reshape(H),
                              fg.dt_bias.float().reshape(H, K), state_batch_indices=self._rows(), use_qk_l2norm=True,
                              lower_bound=getattr(fg, "safe_gate_lower_bound", None))
        gate = mixer.g_b_proj(mixer.g_a_proj(hs)).reshape(batch, 1, H, K)
        return mixer.o_proj(mixer.o_norm(y.to(dtype), gate).reshape(batch, 1, -1))


def patch_kda_replayssm(model, buffer_len: int = 16, state_dtype=torch.float32, *, check_values: bool | None = None):
    """Patch every KDA layer of ``model`` in place; returns the :class:`KDAReplayDecoder` (``unpatch()`` undoes).
    ``check_values`` as :func:`builders.nemotron_h.patch_replayssm`'s."""
    return KDAReplayDecoder(model, buffer_len, state_dtype, check_values).patch()


__all__ = ["TINY_KIMI_LINEAR", "TINY_GLM5_NEXT", "FAMILIES", "MODEL_TYPES", "LAYER_TYPES", "text_model", "kda_layers",
           "is_kda_checkpoint", "tiny_model", "load_kda_model", "KDAReplayDecoder",
           "patch_kda_replayssm"]
