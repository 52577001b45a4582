# SPDX-License-Identifier: Apache-2.0
"""Qwen3-Next, Qwen3.5 and Qwen3.5 MoE (transformers' ``Qwen3NextForCausalLM`` / ``Qwen3_5ForCausalLM`` /
``Qwen3_5MoeForCausalLM``) with ReplaySSM Gated DeltaNet single-token decode.

Layer types (``config.layer_types``): ``linear_attention`` (Gated DeltaNet, the module
``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet`` at ``layers[i].linear_attn``) and
``full_attention`` (gated attention). Only the GDN layers are patched; attention, MoE / MLP, norms
and the head stay transformers' own modules.

Patching (:func:`patch_gdn_replayssm`), per GDN layer, mirroring the layer's own decode path:

    q, k, v, z, b, a = projections(h)              (Qwen3-Next: in_proj_qkvz + in_proj_ba, interleaved
                                                    per key head; Qwen3.5: four separate projections)
    q, k, v = split(silu(conv1d([q | k | v])))      (the model's causal_conv1d_forward and its conv state)
    y = backend(buf, cursor, q, k, v, a, b, A_log, dt_bias)   (raw a, b: g and beta inside the step)
    out = out_proj(norm(y, z))                      (the layer's gated RMSNorm)

``backend`` has the signature of :func:`trtllm_replayssm.families.gdn.reference.replay_decode` (keywords):
the float64 reference on the CPU, the GDN kernel (:mod:`trtllm_replayssm.families.gdn.ops`) on CUDA.
Prefill (more than one token) is the model's own chunked path; its final recurrent state, stored
by transformers as (batch, HV, K, V), becomes the checkpoint in our (batch, HV, V, K) layout with an
empty buffer (cursor 0). A continuation prefill after decode steps first writes the current state
(:func:`~trtllm_replayssm.families.gdn.reference.replay_state`) back into the model's cache. The cursor is
shared by all GDN layers and advanced once per model step. Beam search and switching between transformers
caches as builders/nemotron_h.py's ``MixerPatch`` (shared). Not covered: caches that record the past.

The embedded tiny configs (:data:`TINY_QWEN3_NEXT`, :data:`TINY_QWEN3_5`) keep the published models'
structure at toy sizes: layer pattern 3 GDN + 1 attention (full_attention_interval 4), value heads
= 2 x key heads, head dims 64, conv kernel 4, Qwen3-Next's MoE with a shared expert.
"""

from __future__ import annotations

import pathlib
import sys

import torch

from trtllm_replayssm import backend as executors
from trtllm_replayssm.cache import ReplayStateCache
from trtllm_replayssm.families.gdn import steps as gdn_steps

from .nemotron_h import LinearAttentionPatch, StepExecutor

_COMMON = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=None,  # greedy runs always produce the requested number of tokens
    pad_token_id=0,
    bos_token_id=1,
)
TINY_QWEN3_NEXT = dict(_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True)
TINY_QWEN3_5 = dict(_COMMON)
# Qwen3.5 MoE (e.g. Qwen3.5-397B-A17B): Qwen3-Next's sparse MoE block in every layer, top-k always renormalised
TINY_QWEN3_5_MOE = dict(_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=64)
FAMILIES = {"qwen3_next": TINY_QWEN3_NEXT, "qwen3_5": TINY_QWEN3_5, "qwen3_5_moe": TINY_QWEN3_5_MOE}
# config.json model_type of the checkpoints we load: the text models, and the published Qwen3.5 directories, whose
# config is the vision-language wrapper's (qwen3_5 / qwen3_5_moe; AutoModelForCausalLM takes its text model)
MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
# every config.json model_type this project loads: Nemotron-H / Nemotron 3 (builders/nemotron_h.py), then the above.
# The one list the loaders' and the writers' messages name.
ACCEPTED_MODEL_TYPES = ("nemotron_h",) + MODEL_TYPES


def is_gdn_checkpoint(model_dir) -> bool:
    """True when ``model_dir``/config.json names a Qwen3-Next / Qwen3.5 text model (False if unreadable)."""
    import json

    try:
        kind = json.loads((pathlib.Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return kind in MODEL_TYPES


LAYER_TYPES = ("linear_attention", "full_attention")  # config.layer_types the patch and the step modules run


def load_gdn_model(model_dir=None, tiny: str = "qwen3_next", dtype=torch.float32, seed: int = 0, device="cpu"):
    """A Qwen3-Next / Qwen3.5 text model: the checkpoint ``model_dir`` (transformers' AutoModelForCausalLM),
    or without one the embedded tiny config ``tiny`` with seeded weights. A checkpoint whose config is not
    loadable or has layer types other than :data:`LAYER_TYPES`, or whose tensors are missing, mis-shaped or
    unreadable, raises ``builders.nemotron_h.CheckpointError`` naming the key (transformers' loader itself only
    warns about missing tensors and initialises them at random)."""
    if model_dir is None:
        return tiny_model(tiny, dtype=dtype, seed=seed, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    from .nemotron_h import CheckpointError, from_pretrained_checked

    cfg_path = pathlib.Path(model_dir) / "config.json"
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises several types for a bad config
        raise CheckpointError(f"{cfg_path}: not a valid Qwen3-Next / Qwen3.5 config ({type(e).__name__}: {e})") from e
    types = list(getattr(config.get_text_config(), "layer_types", None) or [])
    bad = [(i, t) for i, t in enumerate(types) if t not in LAYER_TYPES]
    if bad:
        raise CheckpointError(f"{cfg_path}: layer_types: expected only {LAYER_TYPES}, got {bad[0][1]!r} at layer "
                              f"{bad[0][0]} (of {len(bad)} unknown)")
    return from_pretrained_checked(AutoModelForCausalLM, model_dir, dtype=dtype).to(device)


def tiny_model(family: str = "qwen3_next", dtype=torch.float32, seed: int = 0, device="cpu", **overrides):
    """transformers' own model class with an embedded tiny config and seeded random weights."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    cfg = dict(FAMILIES[family], **overrides)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config, cls = Qwen3NextConfig(**cfg), Qwen3NextForCausalLM
    elif family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        config, cls = Qwen3_5MoeTextConfig(**cfg), Qwen3_5MoeForCausalLM
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config, cls = Qwen3_5TextConfig(**cfg), Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decays exp(g) spread over (0.5, 1): a state that remembers
                p.copy_(torch.empty(p.shape).uniform_(-4.0, 0.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=gen))
    return model.to(dtype=dtype, device=device)


def gdn_layers(model) -> list[int]:
    return [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]


# ``gdn_reference.replay_decode`` in float64 on the buffers (stored back in their dtypes), y in v's dtype; and the
# same through the CUDA kernel on contiguous copies of the step's views: the executors of trtllm_replayssm.backend
# in the builders' keyword form.
reference_backend = gdn_steps.replay_decode_kw(executors.REFERENCE)
kernel_backend = gdn_steps.replay_decode_kw(executors.for_device("cuda"), contiguous=True)


def default_backend(device):
    """(decode step, cursor advance) for ``device``: the kernels on CUDA, the float64 reference elsewhere."""
    x = executors.for_device(device)
    return (kernel_backend if x.name == "kernels" else reference_backend), x.advance_cursor


def _projections(mixer, hs):
    """(mixed_qkv (batch, 1, 2 H K + HV V), z (batch, 1, HV, V), b, a (batch, 1, HV)) as the layer computes them."""
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next: per-key-head interleaved projections
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hs), mixer.in_proj_ba(hs))
        mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v)], dim=-1)
        return mixed, z, b, a
    batch, seq = hs.shape[:2]
    z = mixer.in_proj_z(hs).reshape(batch, seq, -1, mixer.head_v_dim)
    return mixer.in_proj_qkv(hs), z, mixer.in_proj_b(hs), mixer.in_proj_a(hs)


class GDNReplayDecoder(LinearAttentionPatch):
    """ReplaySSM state of a patched model, held by a :class:`~trtllm_replayssm.cache.ReplayStateCache` of its GDN
    layers on the standard form (the (slots,) cursor, one standard decode step per layer), allocated at the
    prefill hand-off; the conv windows stay in the transformers cache (``conv_dim=0``). Row b of the batch
    uses slot b. ``backend`` (keyword form ``fn(buf, cursor, q, k, v, a, b, A_log, dt_bias, state_batch_indices)``,
    default: :data:`kernel_backend` on CUDA, :data:`reference_backend` elsewhere) and ``advance`` run the step
    through the cache; ``bufs[layer_idx]`` (GDNBuffers views) and ``cursor`` are the cache's tensors."""

    def __init__(self, model, buffer_len: int, backend=None, advance=None, state_dtype=torch.float32,
                 check_values: bool | None = None):
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        if model.config.model_type not in MODEL_TYPES:
            raise ValueError(f"model: expected a Qwen3-Next or Qwen3.5 text model, got model_type "
                             f"{model.config.model_type!r}")
        dflt = default_backend(next(model.parameters()).device)
        self.backend = backend or dflt[0]
        self.advance = advance or dflt[1]
        self._init_layers(model, gdn_layers(model), "Gated DeltaNet", lambda i: model.model.layers[i].linear_attn,
                          buffer_len, state_dtype, check_values)

    def _fold_into(self, layer_idx: int, rec) -> None:
        for s in range(rec.shape[0]):  # the model's recurrent state is (HV, K, V), ours (HV, V, K)
            rec[s] = self.cache.committed_state(self.j[layer_idx], s).transpose(-1, -2).to(rec.dtype)

    def _end_prefill(self, mixer, cache, act_dtype) -> None:
        S = cache.get_recurrent_state(mixer.layer_idx)  # (batch, HV, K, V)
        batch, HV, K, V = S.shape
        if not self._holds(cache):
            self._write_back()  # the cache held until now keeps what our buffers hold
        c = self.cache
        if c is None or not self._holds(cache) or c.num_slots != batch or c.group("gdn").t["state"].device != S.device \
                or c.group("gdn").t["v_cache"].dtype != act_dtype:
            c = self.cache = ReplayStateCache.for_family(
                "gdn", len(self.layers), batch, (HV, mixer.num_k_heads, V, K), self.buffer_len, conv_dim=0,
                state_dtype=self.state_dtype, act_dtype=act_dtype, device=S.device, cursor="standard",
                executor=StepExecutor(self.backend, self.advance), check_values=self.check_values)
            for _ in range(batch):
                c.allocate()
            self._ready = set()
        lay = c.layer(self.j[mixer.layer_idx])
        lay.buf.state.copy_(S.detach().transpose(-1, -2))  # the checkpoint; the rings are empty
        for t in (lay.buf.u_cache, lay.buf.v_cache, lay.buf.k_cache, lay.buf.g_cache, lay.buf.beta_cache):
            t.zero_()
        self._ready.add(mixer.layer_idx)
        self._take(cache)

    def _decode(self, mixer, hidden_states, cache, attention_mask):
        m = sys.modules[type(mixer).__module__]
        batch, dtype = hidden_states.shape[0], hidden_states.dtype
        H, HV, K, V = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
        hs = m.apply_mask_to_padding_states(hidden_states, attention_mask)
        mixed, z, b, a = _projections(mixer, hs)
        mixed = m.causal_conv1d_forward(mixer.conv1d, mixed.transpose(1, 2), cache, mixer.layer_idx,
                                        activation=mixer.activation).transpose(1, 2)
        q, k, v = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        sbi = self._rows()
        y = self.cache.verify(self.j[mixer.layer_idx], q.reshape(batch, 1, H, K).contiguous(),
                                  k.reshape(batch, 1, H, K).contiguous(), v.reshape(batch, 1, HV, V).contiguous(),
                                  a.reshape(batch, 1, HV).contiguous(), b.reshape(batch, 1, HV).contiguous(),
                                  mixer.A_log.float().contiguous(), mixer.dt_bias.float().contiguous(), sbi)[:, 0]
        core = mixer.norm(y.reshape(-1, V).to(dtype), z.reshape(-1, V))
        return mixer.out_proj(core.reshape(batch, 1, HV * V))

    def _mixers(self) -> list:
        return [self.model.model.layers[i].linear_attn for i in self.layers]

    def _has_state(self, layer_idx: int) -> bool:
        return layer_idx in self._ready


def patch_gdn_replayssm(model, buffer_len: int = 16, backend=None, advance=None, state_dtype=torch.float32, *,
                        check_values: bool | None = None):
    """Patch every Gated DeltaNet layer of ``model`` in place; returns the :class:`GDNReplayDecoder`
    (``unpatch()`` undoes). ``check_values`` as :func:`builders.nemotron_h.patch_replayssm`'s."""
    return GDNReplayDecoder(model, buffer_len, backend, advance, state_dtype, check_values).patch()
