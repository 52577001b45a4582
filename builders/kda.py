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

The step is :func:`trtllm_replayssm.families.kda.reference.replay_decode` (float64, CPU): q and k l2-normalised in
the step, q scaled by K^-1/2, as transformers' ``recurrent_kimi_delta_attention(use_qk_l2norm_in_kernel=True)``.
Prefill (more than one token) is the model's own chunked path; its final recurrent state, which transformers keeps
as (batch, H, K, V) fp32, is already our checkpoint layout (S, H, K, V) (the fla layout, y = S^T q): it is copied
unchanged, with an empty ring (cursor 0). A continuation prefill, another conversation's prefill and ``unpatch()``
first fold the ring back into the transformers cache (the exact recurrence, ``replay_state``). The cursor is shared
by all KDA layers and advanced once per model step. Beam search, switching between caches and a forward raising
mid-step are builders/nemotron_h.py's ``MixerPatch`` (shared). Not covered: caches that record the past.

State: :class:`KDAStepCache`, the per-layer :class:`~trtllm_replayssm.families.kda.reference.KDABuffers` of the KDA
state table behind the cache API the family-generic ``ReplayStateCache`` gets in issue 36 (``flush`` / ``verify``
/ ``commit`` / ``abort_step`` / ``gather_slots`` / ``load_prefill`` / ``committed_state``); the conv windows stay in
the transformers cache.

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

from trtllm_replayssm import families
from trtllm_replayssm.families.kda import reference as kref

from .nemotron_h import CheckpointError, MixerPatch

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
    dt_bias in (-7, -2)), and GLM-5 Next's A_log (zero at transformers' init) spread over (-1, 1)."""
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
    try:  # mis-shaped tensors come back in info (refused below, by name), not as transformers' nameless error
        model, info = cls.from_pretrained(str(model_dir), config=config, dtype=dtype, output_loading_info=True,
                                          ignore_mismatched_sizes=True)
    except Exception as e:  # no weights, unreadable tensors
        raise CheckpointError(f"model: cannot load {str(model_dir)!r} ({type(e).__name__}: {e})") from e
    for what, key in (("missing from", "missing_keys"), ("mis-shaped in", "mismatched_keys")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            raise CheckpointError(f"model: {len(names)} tensors {what} {str(model_dir)!r}: {names[:8]}")
    return model.eval().to(device)


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


class KDAStepCache:
    """The ReplaySSM state of a model's KDA layers on the standard (slots,) cursor: one
    :class:`~trtllm_replayssm.families.kda.reference.KDABuffers` per layer (checkpoint (S, H, K, V) in
    ``state_dtype``; rings of raw k and v in the activation dtype, u in ``ring_dtype``, g and beta fp32) and one
    cursor, with the step protocol of ``ReplayStateCache``: ``flush(rows, 1)`` opens a step, ``verify`` runs each
    layer once (``step``, :func:`~trtllm_replayssm.families.kda.reference.replay_decode`'s signature: the flush step
    folds the ring exactly into the checkpoint), ``commit(rows, None, 1)`` advances the cursor once
    (``advance``, :func:`trtllm_replayssm.families.advance_cursor`'s). Slot s is row s; every slot is live."""

    def __init__(self, num_layers: int, num_slots: int, geometry, buffer_len: int, *, act_dtype=torch.float32,
                 state_dtype=torch.float32, ring_dtype=None, device="cpu", step=None, advance=None):
        if num_layers < 1 or num_slots < 1:
            raise ValueError(f"num_layers, num_slots: expected >= 1, got {num_layers}, {num_slots}")
        if buffer_len < 1:
            raise ValueError(f"buffer_len: expected >= 1, got {buffer_len}")
        H, K, V = geometry
        # u is the one rounded ring entry (DESIGN §5: bf16 beside a bf16 model); a float32 model keeps it in fp32
        ring = ring_dtype or (act_dtype if act_dtype.itemsize >= 4 else kref.DTYPES["ring"])
        f32 = torch.float64 if state_dtype == torch.float64 else torch.float32  # f64 only in exact tests
        self.bufs = [kref.KDABuffers.alloc(num_slots, H, K, V, buffer_len, act=act_dtype, ring=ring,
                                           state_dtype=state_dtype, f32=f32, device=device) for _ in range(num_layers)]
        self.cursor = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.num_layers, self.num_slots, self.buffer_len, self.geometry = num_layers, num_slots, buffer_len, (H, K, V)
        self.act_dtype = act_dtype
        self.step = step or kref.replay_decode
        self.advance = advance or families.advance_cursor
        self._step: set[int] | None = None  # layers verified since flush()

    def _layer(self, layer: int) -> kref.KDABuffers:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")
        return self.bufs[layer]

    def flush(self, state_batch_indices, num_tokens: int):
        """Open a step of ``num_tokens`` = 1 (the standard form folds its ring inside the step that fills it)."""
        if num_tokens != 1:
            raise ValueError(f"num_tokens: expected 1 (standard decode), got {num_tokens}")
        if self._step:
            raise RuntimeError(f"flush: the open step already verified layers {sorted(self._step)}; commit it or "
                               "abort_step() and prefill its slots again")
        self._step = set()

    def verify(self, layer: int, q, k, v, f, b, A_log, dt_bias, state_batch_indices=None, out=None,
               use_qk_l2norm: bool = True, scale: float | None = None, lower_bound: float | None = None):
        """y (batch, 1, H, V) in v's dtype (or into ``out``) of one layer's token; appends it to the ring (or folds
        the ring into the checkpoint at the step that fills it). q, k, f (batch, 1, H, K), v (batch, 1, H, V),
        b (batch, 1, H) raw, A_log (H,), dt_bias (H, K)."""
        if self._step is None:
            raise RuntimeError("verify: call flush() first (a step is flush, verify of every layer, commit)")
        if layer in self._step:
            raise RuntimeError(f"verify: layer {layer} already ran in this step; commit the step first")
        if v.dim() != 4 or v.shape[1] != 1:
            raise ValueError(f"v: expected (batch, 1, H, V) (one token), got {tuple(v.shape)}")
        y = self.step(self._layer(layer), self.cursor, q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], A_log, dt_bias,
                      state_batch_indices=state_batch_indices, use_qk_l2norm=use_qk_l2norm, scale=scale,
                      lower_bound=lower_bound)
        self._step.add(layer)
        y = y[:, None].to(v.dtype)
        if out is None:
            return y
        out.copy_(y)
        return out

    def commit(self, state_batch_indices, n_accepted, num_tokens: int) -> None:
        """Close the step: every row accepts its token, the cursor advances once for all layers."""
        if self._step is None:
            raise RuntimeError("commit: no step is open (flush() first)")
        if n_accepted is not None or num_tokens != 1:
            raise ValueError(f"n_accepted, num_tokens: expected None, 1 (standard decode), got {n_accepted}, "
                             f"{num_tokens}")
        missing = sorted(set(range(self.num_layers)) - self._step)
        if missing:
            raise RuntimeError(f"commit: layers {missing} were not verified since flush(); their history would be "
                               "dropped by the cursor move")
        self.advance(self.cursor, state_batch_indices, self.buffer_len)
        self._step = None

    def abort_step(self) -> list[int]:
        """Close an open step without committing; returns the layers it verified (their slots need a new prefill)."""
        verified = sorted(self._step or ())
        self._step = None
        return verified

    def gather_slots(self, src: torch.Tensor) -> None:
        """Slot s takes what slot ``src[s]`` held in every layer and its cursor (a beam search's reorder)."""
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != (self.num_slots,):
            raise ValueError(f"src: expected a ({self.num_slots},) integer tensor, got {src!r}")
        if self._step is not None:
            raise RuntimeError("gather_slots: a step is open (flush() without commit())")
        idx = src.to(device=self.cursor.device, dtype=torch.long)
        for t in (*(t for buf in self.bufs for t in buf.tensors()), self.cursor):
            t.copy_(t[idx])

    def load_prefill(self, slot: int, layer: int, state: torch.Tensor, conv_state=None) -> None:
        """Prefill hand-off of one slot and layer: ``state`` (H, K, V) becomes the checkpoint, the ring is emptied
        and the slot's cursor zeroed (so hand every layer off before a decode step; a continuation prefill folds
        every layer first). The conv windows stay in the transformers cache: ``conv_state`` must be None."""
        buf = self._layer(layer)
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot: expected 0 <= slot < {self.num_slots}, got {slot}")
        if conv_state is not None:
            raise ValueError("conv_state: expected None (the conv windows stay in the transformers cache)")
        if not isinstance(state, torch.Tensor) or tuple(state.shape) != tuple(buf.state.shape[1:]):
            raise ValueError(f"state: expected shape {tuple(buf.state.shape[1:])} (H, K, V), got "
                             f"{tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}")
        buf.state[slot] = state.to(buf.state.dtype)
        for t in buf.tensors()[1:]:
            t[slot].zero_()
        self.cursor[slot] = 0

    def committed_state(self, layer: int, slot: int) -> torch.Tensor:
        """Layer ``layer``'s recurrent state of ``slot`` after the committed tokens: the exact fold of its ring,
        float64 (H, K, V) (transformers' layout). Between steps only."""
        return kref.replay_state(self._layer(layer), self.cursor, slot)


class KDAReplayDecoder(MixerPatch):
    """ReplaySSM state of a patched Kimi-Linear / GLM-5 Next model: a :class:`KDAStepCache` of its KDA layers,
    allocated at the prefill hand-off (row b of the batch is slot b). ``backend`` (the signature of
    :func:`~trtllm_replayssm.families.kda.reference.replay_decode`, the default) and ``advance`` run the step;
    ``bufs[layer_idx]`` (KDABuffers) and ``cursor`` are the cache's tensors."""

    def __init__(self, model, buffer_len: int, backend=None, advance=None, state_dtype=torch.float32,
                 ring_dtype=None):
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        if model.config.model_type not in MODEL_TYPES:
            raise ValueError(f"model: expected a Kimi-Linear or GLM-5 Next model, got model_type "
                             f"{model.config.model_type!r}")
        self.model = model
        self.buffer_len = buffer_len
        self.state_dtype, self.ring_dtype = state_dtype, ring_dtype
        self.backend, self.advance = backend, advance
        self.layers = kda_layers(model)
        if not self.layers:
            raise ValueError("model: no linear_attention (KDA) layer in config.layer_types")
        mixer = text_model(model).layers[self.layers[0]].self_attn
        mod = sys.modules[type(mixer).__module__]
        if not hasattr(mod, "causal_conv1d_forward"):
            import transformers

            raise RuntimeError(f"transformers {transformers.__version__}: {mod.__name__} has no causal_conv1d_forward "
                               f"(the decode conv the patch calls); needs transformers >= 5.25")
        self.j = {i: j for j, i in enumerate(self.layers)}
        self.cache = None  # a KDAStepCache of the KDA layers, from the first prefill hand-off
        self._ready: set[int] = set()
        self._step: str | None = None
        self._cache_ref = None  # weakref of the transformers cache our buffers continue
        self._folded = False  # this prefill step has folded our rings back (at its first KDA layer)
        self._handles = []

    @property
    def cursor(self) -> torch.Tensor | None:
        return None if self.cache is None else self.cache.cursor

    @property
    def bufs(self) -> dict[int, kref.KDABuffers]:
        return {i: self.cache.bufs[self.j[i]] for i in self.layers if i in self._ready}

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
                or c.act_dtype != act_dtype:
            c = self.cache = KDAStepCache(len(self.layers), batch, (H, K, V), self.buffer_len, act_dtype=act_dtype,
                                          state_dtype=self.state_dtype, ring_dtype=self.ring_dtype, device=S.device,
                                          step=self.backend, advance=self.advance)
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


def patch_kda_replayssm(model, buffer_len: int = 16, backend=None, advance=None, state_dtype=torch.float32,
                        ring_dtype=None):
    """Patch every KDA layer of ``model`` in place; returns the :class:`KDAReplayDecoder` (``unpatch()`` undoes)."""
    return KDAReplayDecoder(model, buffer_len, backend, advance, state_dtype, ring_dtype).patch()


__all__ = ["TINY_KIMI_LINEAR", "TINY_GLM5_NEXT", "FAMILIES", "MODEL_TYPES", "LAYER_TYPES", "text_model", "kda_layers",
           "is_kda_checkpoint", "tiny_model", "load_kda_model", "KDAStepCache", "KDAReplayDecoder",
           "patch_kda_replayssm"]
