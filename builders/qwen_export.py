# SPDX-License-Identifier: Apache-2.0
"""One Qwen3-Next / Qwen3.5 step of T = 1 + num_draft tokens per row as a module with explicit state I/O
(:class:`QwenGDNDecodeStep`: num_draft = 0 the standard decode step, num_draft > 0 the speculative verify graph);
its ONNX export is builders/decode_step.py's :func:`~builders.decode_step.export_onnx`, the one of every step.

Graph inputs (row b of the batch is slot b: state_batch_indices = arange(batch) inside):

 1. input_ids       (batch, T) int64
 2. lengths         (batch,) int32     tokens already in the KV caches (= the first new token's position)
 3. cursor          T = 1: (batch,) int32 ReplaySSM buffer fill, shared by all GDN layers;
                    T > 1: (batch, 2) int32 ring (start, committed count), read only
 4. per attention layer i: k_cache_i, v_cache_i (batch, kv_heads, max_seq_len, head_dim) act
 5. per GDN layer i:       T = 1: conv_state_i (batch, conv_dim, K) act (the last K inputs of [q | k | v]);
                           T > 1: conv_window_i (batch, conv_dim, K - 1 + num_draft) act,
                           gdn_state_i (batch, HV, V, K) fp32 (the checkpoint S0),
                           [gdn_shadow_i (batch, HV, V, K) bf16 with a shadow],
                           gdn_u_i (batch, HV, L, V) fp32, gdn_v_i (batch, HV, L, V) act,
                           gdn_k_i (batch, H, L, Kd) fp32, gdn_g_i (batch, HV, L) fp32,
                           gdn_beta_i (batch, HV, L) fp32   (:mod:`trtllm_replayssm.families.gdn.reference`)

Graph outputs: T = 1: logits (batch, vocab) fp32, lengths_out = lengths + 1, cursor_out = (cursor + 1) % L;
T > 1: logits (batch, T, vocab) fp32; then every state tensor as ``<name>_out`` (in-place aliases in TensorRT).

Per GDN layer: the layer's projections, the causal conv1d over [the last K - 1 committed inputs, the T new
ones] (the new conv state / window), silu, then ONE plugin node (:func:`gdn_node`): T = 1 ``replayssm::gdn_decode``
on the squeezed token (raw a and b in, g and beta computed inside, the l2 norm of q and k inside), T > 1
``replayssm::gdn_verify`` (fold the committed entries first where count + 2T > L, the window's outputs, the window
appended to the rings), ``_shadow`` with a bf16 shadow; then the layer's gated RMSNorm with z and out_proj.
Attention (gated, with q/k RMSNorm and partial RoPE at positions lengths + t): the T new K/V written at
lengths + t with one-hot selects, query t attends keys j <= lengths + t, the output is
multiplied by sigmoid(gate). Qwen3-Next's sparse MoE (:func:`moe_qwen`: softmax routing, one TopK with a
constant k, the shared expert gated by a sigmoid) in the step's ``moe_formulation``, as builders/moe.py
argues them for Nemotron 3: "dense" (default; the routing mask built by Equal/Mul/ReduceSum, every expert as
a batched MatMul over (E, ., .) constants) or "gather" (each token's k expert matrices gathered): static
shapes and nothing data-dependent either way. MLPs and norms are the model's.
Export route: TorchScript with ``torch.autograd.Function.symbolic``, as builders/decode_step.py. The commit
graph of the speculative route is builders/spec_step.py's :class:`~builders.spec_step.NemotronHSpecCommit` (one
``replayssm::spec_commit`` node, lengths += n, conv windows rolled back), which holds for any step with conv
windows; ``export_onnx(step, verify_path, commit_path)`` writes both graphs.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from trtllm_replayssm import backend as executors
from trtllm_replayssm.config import DTYPE_CODES
from trtllm_replayssm.families.gdn import steps as gdn_steps
from trtllm_replayssm.families.gdn import trt_plugin as gdn_plugin
from trtllm_replayssm.families.gdn.config import GDN_SUPPORTED_DIMS

from .decode_step import (  # noqa: F401  (export_onnx: the one export of every step)
    DOMAIN,
    PluginNode,
    PluginOp,
    StateSpec,
    StepIO,
    export_onnx,
    layer_state_specs,
    window_attention,
    window_conv,
)
from .moe import FORMULATIONS, gated_experts
from .qwen3_next import gdn_layers, reference_backend

GDN_OP_TYPE = "gdn_decode"
GDN_SHADOW_OP_TYPE = "gdn_decode_shadow"
GDN_VERIFY_OP_TYPE = "gdn_verify"
GDN_VERIFY_SHADOW_OP_TYPE = "gdn_verify_shadow"
# config.json's ``model.moe`` of a Qwen3-Next engine: the sparse MoE keys of its config (and the graph formulation)
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


# ``replayssm::gdn_verify`` in float64 (what the kernel does): the committed entries folded into the checkpoint
# where count + 2T > L (stored in fp32), then the window verified on the flushed cursor and appended to the rings;
# the (slots, 2) cursor not moved; y in v's dtype. And the same through the CUDA kernel on contiguous copies of
# the views. The executors of trtllm_replayssm.backend in the builders' keyword form.
verify_reference_backend = gdn_steps.replay_verify_kw(executors.REFERENCE)
verify_kernel_backend = gdn_steps.replay_verify_kw(executors.for_device("cuda"), contiguous=True)


def gdn_op_type(speculative: bool, shadow: bool) -> str:
    """The GDN node of a step: ``gdn_decode`` (T = 1) or ``gdn_verify`` (T > 1), ``_shadow`` with the bf16 shadow;
    the name of its TensorRT plugin too (trtllm_replayssm.trt_plugin.PLUGINS)."""
    return (GDN_VERIFY_SHADOW_OP_TYPE if shadow else GDN_VERIFY_OP_TYPE) if speculative else (
        GDN_SHADOW_OP_TYPE if shadow else GDN_OP_TYPE)


def gdn_node(ins, caches, op_type: str, attrs: dict, backend):
    """One Gated DeltaNet node (``op_type``: :func:`gdn_op_type`; ``attrs``: its integer attributes) on ``ins`` (q,
    k, v, a, b, A_log, dt_bias, state_batch_indices, cursor; q, k (b[, T], H, Kd), v (b[, T], HV, V), a, b
    (b[, T], HV), the window axis in a verify node) and ``caches`` (state, u_cache, v_cache, k_cache, g_cache,
    beta_cache[, the bf16 shadow of the checkpoint (S, HV, V, K)]). ``gdn_decode``: raw a and b in, g and beta
    computed inside, the l2 norm of q and k inside; ``gdn_verify``: the same on a window with the (slots, 2) ring
    cursor; a shadow op's non-fold steps read the shadow, folds rewrite it from the checkpoint they store
    (trtllm_replayssm/families/gdn/reference.py). Outputs (y, the caches in that order); the eager run (``backend``) works
    on copies (functional, as the graph is)."""

    def run(q, k, v, a, b, A_log, dt_bias, sbi, cursor, *cs):
        from trtllm_replayssm.families.gdn.reference import GDNBuffers

        buf = GDNBuffers(*(t.clone() for t in cs[:6]))
        extra = dict(shadow=cs[6].clone()) if len(cs) == 7 else {}
        y = backend(buf=buf, cursor=cursor, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                    state_batch_indices=sbi, **extra)
        return (y.to(v.dtype), buf.state, buf.u_cache, buf.v_cache, buf.k_cache, buf.g_cache, buf.beta_cache,
                *extra.values())

    node = PluginNode(op_type, tuple(attrs.items()), (2,) + tuple(range(9, 9 + len(caches))), run)
    return PluginOp.apply(node, *ins, *caches)


def moe_qwen(hn, moe, formulation: str = "dense"):
    """Qwen3-Next's ``Qwen3NextSparseMoeBlock`` on (batch, D) tokens as static-shape ops (see the docstring):
    softmax routing, one TopK with a constant k, then the routed experts in ``formulation`` (builders/moe.py
    argues the two): "dense" runs every expert on every token and masks (reads each expert matrix once per
    step), "gather" runs each token's k experts only (TensorRT materialises the gathered matrices: 2·T·k of
    them against E, so it wins at small batch, e.g. Qwen3-Next's 512 experts at top-10 while T <= 25)."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"moe_formulation: expected one of {FORMULATIONS}, got {formulation!r}")
    gate, top_k = moe.gate, moe.gate.top_k
    probs = F.softmax(F.linear(hn, gate.weight), dim=-1, dtype=torch.float32)
    top_v, top_i = torch.topk(probs, top_k, dim=-1)
    if getattr(gate, "norm_topk_prob", True):  # Qwen3.5 MoE's router has no switch: it always renormalises
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    routed = gated_experts(hn, moe.experts, top_v.to(hn.dtype), top_i, formulation)
    shared = torch.sigmoid(moe.shared_expert_gate(hn)) * moe.shared_expert(hn)
    return routed + shared


class QwenGDNDecodeStep(StepIO, torch.nn.Module):
    """The step of T = 1 + ``num_draft`` tokens of a (loaded, unpatched or patched) Qwen3-Next / Qwen3.5 text
    model; shares its weights. ``num_draft = 0``: standard decode; ``num_draft`` > 0: the speculative verify
    graph (module docstring), whose commit graph is ``spec_step.NemotronHSpecCommit(step)``. ``backend``: the GDN
    node's eager computation (default: the float64 reference of the node, decode or verify)."""

    def __init__(self, model, buffer_len: int, max_seq_len: int, backend=None, moe_formulation: str = "dense",
                 shadow: str = "none", num_draft: int = 0):
        super().__init__()
        if shadow not in ("none", "bf16"):
            raise ValueError(f"shadow: expected none or bf16 (a bf16 shadow of the fp32 checkpoint; no fp8 GDN shadow), "
                             f"got {shadow!r}")
        self.shadow = shadow
        self._set_tokens(num_draft, buffer_len, model.config.linear_conv_kernel_dim)
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
        if moe_formulation not in FORMULATIONS:
            raise ValueError(f"moe_formulation: expected one of {FORMULATIONS}, got {moe_formulation!r}")
        self.moe_formulation = moe_formulation
        self.model, self.config = model, model.config
        self.buffer_len, self.max_seq_len = buffer_len, max_seq_len
        self.backend = backend or (verify_reference_backend if self.speculative else reference_backend)
        self.act_dtype = next(model.parameters()).dtype
        self.kinds = list(model.config.layer_types)
        self.gdn = set(gdn_layers(model))

    @classmethod
    def for_build(cls, model, *, buffer_len: int, max_seq_len: int, state_dtype: torch.dtype, moe_formulation: str,
                  shadow: str, num_draft: int) -> QwenGDNDecodeStep:
        """The step of an engine build (builders/models.py's export step protocol; the checkpoint is fp32)."""
        if state_dtype != torch.float32:
            raise ValueError(f"state_dtype: the gdn_decode / gdn_verify plugins keep an fp32 checkpoint, got {state_dtype}")
        return cls(model, buffer_len, max_seq_len, moe_formulation=moe_formulation, shadow=shadow, num_draft=num_draft)

    # ---- the engine directory (builders/models.py's export step protocol) -------------------------------------
    def ssm_layers(self) -> list[int]:
        return sorted(self.gdn)

    def plugin_geometry(self) -> tuple[int, int, int, int]:
        """(key heads, value heads, key dim, value dim) of the GDN plugin kernels; ValueError naming the config key."""
        cfg = self.config
        H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        for name, v in (("linear_key_head_dim", K), ("linear_value_head_dim", V)):
            if v not in GDN_SUPPORTED_DIMS:
                raise ValueError(f"{name}: the gdn_decode plugin supports {GDN_SUPPORTED_DIMS}, got {v}")
        if HV % H:
            raise ValueError(f"linear_num_key_heads: expected a divisor of linear_num_value_heads={HV}, got {H}")
        return H, HV, K, V

    def plugin_kernel(self, tactic: int, arch: int, sm_count: int):
        """The PTX and launch of the step's GDN node for ``tactic`` (the family's aot_impl; no persistent grid)."""
        H, HV, K, V = self.plugin_geometry()
        act, L = DTYPE_CODES[self.act_dtype], self.buffer_len
        if self.speculative:
            return gdn_plugin.aot_verify_kernel(H, HV, K, V, L, 1, self.num_tokens, act, arch, tactic, self.shadow)
        return gdn_plugin.aot_kernel(H, HV, K, V, L, 1, act, arch, tactic, self.shadow, self.row_order)

    def plugin_keys(self, sm_count: int) -> dict:
        return {}

    def _moe_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.model.model.layers) if hasattr(layer.mlp, "experts")]

    def describe(self) -> list[str]:
        cfg = self.config
        H, HV, K, V = self.plugin_geometry()
        lines = [f"{cfg.model_type}: {len(self.gdn)} Gated DeltaNet layers, key heads={H} value heads={HV} key dim={K} "
                 f"value dim={V}"]
        if self._moe_layers():
            lines.append(f"sparse MoE layers: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, as "
                         f"{self.moe_formulation} standard ONNX ops (builders/qwen_export.moe_qwen)")
        return lines

    def model_entry(self) -> dict:
        """config.json's ``model`` after source, seed and model_type: pattern (G per Gated DeltaNet layer, * for
        attention), sizes, the layers by type; with sparse MoE layers (Qwen3-Next) their indices and config keys."""
        cfg = self.config
        kinds = list(cfg.layer_types)
        entry = dict(pattern="".join("G" if k == "linear_attention" else "*" for k in kinds),
                     vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, layer_types=kinds,
                     gdn_layers=self.ssm_layers(),
                     attention_layers=[i for i, k in enumerate(kinds) if k == "full_attention"])
        moe = self._moe_layers()
        if moe:  # the config keys and the graph formulation (moe_qwen)
            entry["moe_layers"] = moe
            entry["moe"] = dict({k: getattr(cfg, k, None) for k in MOE_KEYS}, formulation=self.moe_formulation)
        return entry

    # ---- the state contract ---------------------------------------------------------------------
    def state_specs(self) -> list[StateSpec]:
        c = self.config
        H, HV, Kd, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        sizes = dict(num_k_heads=H, num_v_heads=HV, key_dim=Kd, value_dim=V, buffer_len=self.buffer_len,
                     conv_dim=2 * H * Kd + HV * V, conv_width=self.window, kv_heads=c.num_key_value_heads,
                     max_seq_len=self.max_seq_len, head_dim=c.head_dim)
        specs = []
        for i, kind in enumerate(self.kinds):  # every layer that is not attention is a GDN layer
            specs += layer_state_specs("*" if kind == "full_attention" else "G", i, sizes, dict(act=self.act_dtype),
                                       self.speculative, self.shadow)
        return specs

    def _patched_ssm(self, decoder, i: int):
        """GDN layer i of a patched model (GDNReplayDecoder): (checkpoint, standard buffers u, v, k, g, beta)."""
        b = decoder.bufs[i]
        return b.state, (b.u_cache, b.v_cache, b.k_cache, b.g_cache, b.beta_cache)

    # ---- the SSM node --------------------------------------------------------------------------------
    @property
    def op_type(self) -> str:
        """The op type of the step's GDN nodes, the name of their TensorRT plugin (:func:`gdn_op_type`)."""
        return gdn_op_type(self.speculative, self.shadow != "none")

    def plugin_attributes(self) -> dict:
        """The integer attributes of the step's GDN nodes in the plugin's order (config.json's too)."""
        c = self.config
        return dict(num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads,
                    key_dim=c.linear_key_head_dim, value_dim=c.linear_value_head_dim, buffer_len=self.buffer_len,
                    use_qk_l2norm=1, **({"num_tokens": self.num_tokens} if self.speculative else {}))

    # ---- the layers, on (batch, T, D) -----------------------------------------------------------------
    def _attention(self, layer, h, k_cache, v_cache, lengths, cos_sin):
        att = layer.self_attn
        m = sys.modules[type(att).__module__]
        batch, T, hd = h.shape[0], self.num_tokens, att.head_dim
        q, gate = att.q_proj(h).view(batch, T, -1, hd * 2).chunk(2, dim=-1)  # (batch, T, nh, hd) each
        q = att.q_norm(q).transpose(1, 2)  # (batch, nh, T, hd)
        k = att.k_norm(att.k_proj(h).view(batch, T, -1, hd)).transpose(1, 2)
        v = att.v_proj(h).view(batch, T, -1, hd).transpose(1, 2)
        q, k = m.apply_rotary_pos_emb(q, k, *cos_sin)
        o, k_cache, v_cache = window_attention(q, k, v, k_cache, v_cache, lengths, att.scaling, T, self.max_seq_len)
        o = o.transpose(1, 2).reshape(batch, T, -1) * torch.sigmoid(gate.reshape(batch, T, -1))
        return att.o_proj(o), k_cache, v_cache

    def _gdn(self, layer, h, conv_window, st, cursor, sbi):
        from .qwen3_next import _projections

        mx, batch, T = layer.linear_attn, h.shape[0], self.num_tokens
        H, HV, Kd, V = mx.num_k_heads, mx.num_v_heads, mx.head_k_dim, mx.head_v_dim
        mixed, z, b, a = _projections(mx, h)
        conv, window = window_conv(conv_window, mixed, mx.conv1d, self.config.linear_conv_kernel_dim, T)
        q, k, v = F.silu(conv).to(h.dtype).split([mx.key_dim, mx.key_dim, mx.value_dim], dim=-1)
        y, *new = self._gdn_op(q.reshape(batch, T, H, Kd), k.reshape(batch, T, H, Kd), v.reshape(batch, T, HV, V),
                               a.reshape(batch, T, HV), b.reshape(batch, T, HV), mx.A_log.float(), mx.dt_bias.float(),
                               sbi, cursor, st)
        core = mx.norm(y.reshape(batch * T * HV, V).to(h.dtype), z.reshape(batch * T * HV, V))
        return mx.out_proj(core.reshape(batch, T, HV * V)), [window, *new]

    def _gdn_op(self, q, k, v, a, b, A_log, dt_bias, sbi, cursor, st):
        """One GDN plugin node (:func:`gdn_node`: decode on the squeezed token at T = 1, verify of the window at
        T > 1): y (batch, T, HV, V), then the layer's states in state order (checkpoint[, shadow], u, v, k, g,
        beta)."""
        ins = (q, k, v, a, b) if self.speculative else (q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0])
        state, *rings = st
        shadow = () if self.shadow == "none" else (rings.pop(0),)
        y, state, *rest = gdn_node((*ins, A_log, dt_bias, sbi, cursor), (state, *rings, *shadow), self.op_type,
                                   self.plugin_attributes(), self.backend)
        return (y if self.speculative else y[:, None], state, *rest[5:], *rest[:5])

    def _rope(self, positions):
        """(cos, sin) (batch, T, rotary_dim) at ``positions`` (batch, T), in the activation dtype. Text positions
        are equal in Qwen3.5's three mrope sections, so its section recomposition (slice writes, ScatterND in
        ONNX) is the identity and both families reduce to the standard rotary table of ``rotary_emb``."""
        rot = self.model.model.rotary_emb
        freqs = positions.float()[:, :, None] * rot.inv_freq.float()[None, None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return ((emb.cos() * rot.attention_scaling).to(self.act_dtype),
                (emb.sin() * rot.attention_scaling).to(self.act_dtype))

    def _layers(self, input_ids, lengths, cursor, states):
        """(logits (batch, T, vocab) fp32, new states) of the T tokens ``input_ids`` (batch, T)."""
        m = self.model.model
        h = m.embed_tokens(input_ids)
        batch, T = input_ids.shape[0], self.num_tokens
        cos_sin = self._rope(lengths[:, None] + torch.arange(T, dtype=lengths.dtype, device=h.device)[None, :])
        sbi = self._rows(batch, cursor, h.device)
        new_states, j = [], 0
        for kind, layer in zip(self.kinds, m.layers):
            res = h
            hn = layer.input_layernorm(h)
            if kind == "full_attention":
                out, kc, vc = self._attention(layer, hn, states[j], states[j + 1], lengths, cos_sin)
                new_states += [kc, vc]
                j += 2
            else:
                n = 7 + (self.shadow != "none")  # conv, checkpoint[, shadow], u, v, k, g, beta
                out, st = self._gdn(layer, hn, states[j], states[j + 1:j + n], cursor, sbi)
                new_states += st
                j += n
            h = res + out
            hn = layer.post_attention_layernorm(h)
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                h = h + moe_qwen(hn.reshape(batch * T, -1), mlp, self.moe_formulation).reshape(batch, T, -1)
            else:
                h = h + mlp(hn)
        return self.model.lm_head(m.norm(h)).float(), new_states
