# SPDX-License-Identifier: Apache-2.0
"""One Qwen3-Next / Qwen3.5 decode step as a module with explicit state I/O, and its ONNX export.

Graph inputs (row b of the batch is slot b: state_batch_indices = arange(batch) inside):

 1. input_ids       (batch, 1) int64
 2. lengths         (batch,) int32     tokens already in the KV caches (= the new token's position)
 3. cursor          (batch,) int32     ReplaySSM buffer fill, shared by all GDN layers
 4. per attention layer i: k_cache_i, v_cache_i (batch, kv_heads, max_seq_len, head_dim) act
 5. per GDN layer i:       conv_state_i (batch, conv_dim, K) act (the last K inputs of [q | k | v]),
                           gdn_state_i (batch, HV, V, K) fp32 (the checkpoint S0),
                           gdn_u_i (batch, HV, L, V) fp32, gdn_v_i (batch, HV, L, V) act,
                           gdn_k_i (batch, H, L, Kd) fp32, gdn_g_i (batch, HV, L) fp32,
                           gdn_beta_i (batch, HV, L) fp32   (:mod:`trtllm_replayssm.gdn_reference`)

Graph outputs: logits (batch, vocab) fp32, lengths_out = lengths + 1, cursor_out = (cursor + 1) % L,
then every state tensor as ``<name>_out`` (in-place aliases in TensorRT).

Per GDN layer: the layer's projections, conv1d over [conv_state[:, :, 1:], qkv] (the new conv
state), silu, then ONE ``replayssm::gdn_decode`` node (:class:`GDNDecode`: raw a and b in, g and
beta computed inside, the l2 norm of q and k inside), then the layer's gated RMSNorm with z and
out_proj. Attention (gated, with q/k RMSNorm and partial RoPE at position ``lengths``): the new K/V is
written at ``lengths[b]`` with a one-hot select, keys j <= lengths[b] are attended, the output is
multiplied by sigmoid(gate). Qwen3-Next's sparse MoE runs dense over the experts (softmax routing,
one TopK with a constant k, the routing mask built by Equal/Mul/ReduceSum, every expert as a batched
MatMul over (E, ., .) constants, the shared expert gated by a sigmoid): static shapes and nothing
data-dependent, the formulation builders/moe.py argues for Nemotron 3. MLPs and norms are the model's.
Export route: TorchScript with ``torch.autograd.Function.symbolic``, as builders/decode_step.py.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .decode_step import DOMAIN, StateSpec, StepIO, export_onnx  # noqa: F401  (export_onnx: any step with state I/O)
from .qwen3_next import gdn_layers, reference_backend

GDN_OP_TYPE = "gdn_decode"
_GDN_STATES = ("gdn_state", "gdn_u", "gdn_v", "gdn_k", "gdn_g", "gdn_beta")


class GDNDecode(torch.autograd.Function):
    """``replayssm::gdn_decode``: inputs (q, k, v, a, b, A_log, dt_bias, state_batch_indices, cursor, state,
    u_cache, v_cache, k_cache, g_cache, beta_cache), outputs (y, state_out, u_out, v_out, k_out, g_out, beta_out).

    Eager: the backend runs on copies of the caches (functional, as the graph is)."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, A_log, dt_bias, sbi, cursor, state, u, vc, kc, gc, bc, sizes, backend):
        from trtllm_replayssm.gdn_reference import GDNBuffers

        buf = GDNBuffers(*(t.clone() for t in (state, u, vc, kc, gc, bc)))
        y = backend(buf=buf, cursor=cursor, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                    state_batch_indices=sbi)
        return (y.to(v.dtype), buf.state, buf.u_cache, buf.v_cache, buf.k_cache, buf.g_cache, buf.beta_cache)

    @staticmethod
    def symbolic(g, q, k, v, a, b, A_log, dt_bias, sbi, cursor, state, u, vc, kc, gc, bc, sizes, backend):
        num_k_heads, num_v_heads, key_dim, value_dim, buffer_len = sizes
        outs = g.op(f"{DOMAIN}::{GDN_OP_TYPE}", q, k, v, a, b, A_log, dt_bias, sbi, cursor, state, u, vc, kc, gc, bc,
                    plugin_namespace_s=DOMAIN, aot_i=1, num_k_heads_i=num_k_heads, num_v_heads_i=num_v_heads,
                    key_dim_i=key_dim, value_dim_i=value_dim, buffer_len_i=buffer_len, use_qk_l2norm_i=1, outputs=7)
        for o, like in zip(outs, (v, state, u, vc, kc, gc, bc)):
            o.setType(like.type())
        return outs


def moe_dense(hn, moe):
    """Qwen3-Next's ``Qwen3NextSparseMoeBlock`` on (batch, D) tokens, dense over the experts (see the docstring)."""
    gate, E, top_k = moe.gate, moe.gate.num_experts, moe.gate.top_k
    probs = F.softmax(F.linear(hn, gate.weight), dim=-1, dtype=torch.float32)
    top_v, top_i = torch.topk(probs, top_k, dim=-1)
    if gate.norm_topk_prob:
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    top_v = top_v.to(hn.dtype)
    experts = torch.arange(E, device=hn.device)
    mask = ((top_i[:, :, None] == experts[None, None, :]).to(hn.dtype) * top_v[:, :, None]).sum(1)  # (batch, E)
    gu = torch.matmul(hn[None], moe.experts.gate_up_proj.transpose(1, 2))  # (E, batch, 2I)
    g, u = gu.chunk(2, dim=-1)
    ye = torch.matmul(moe.experts.act_fn(g) * u, moe.experts.down_proj.transpose(1, 2))  # (E, batch, D)
    routed = (ye * mask.transpose(0, 1)[:, :, None]).sum(0)
    shared = torch.sigmoid(moe.shared_expert_gate(hn)) * moe.shared_expert(hn)
    return routed + shared


class QwenGDNDecodeStep(StepIO, torch.nn.Module):
    """Decode step of a (loaded, unpatched or patched) Qwen3-Next / Qwen3.5 text model; shares its weights."""

    def __init__(self, model, buffer_len: int, max_seq_len: int, backend=None):
        super().__init__()
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
        self.model, self.config = model, model.config
        self.buffer_len, self.max_seq_len = buffer_len, max_seq_len
        self.backend = backend or reference_backend
        self.act_dtype = next(model.parameters()).dtype
        self.kinds = list(model.config.layer_types)
        self.gdn = set(gdn_layers(model))

    # ---- the state contract ---------------------------------------------------------------------
    def state_specs(self) -> list[StateSpec]:
        c, act, L = self.config, self.act_dtype, self.buffer_len
        H, HV, Kd, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        conv_dim = 2 * H * Kd + HV * V
        f32 = torch.float32
        specs = []
        for i, kind in enumerate(self.kinds):
            if kind == "full_attention":
                kv = (-1, c.num_key_value_heads, self.max_seq_len, c.head_dim)
                specs += [StateSpec(f"k_cache_{i}", kv, act, f"k_cache_{i}_out"),
                          StateSpec(f"v_cache_{i}", kv, act, f"v_cache_{i}_out")]
            else:
                shapes = ((-1, HV, V, Kd, f32), (-1, HV, L, V, f32), (-1, HV, L, V, act), (-1, H, L, Kd, f32),
                          (-1, HV, L, f32), (-1, HV, L, f32))
                specs.append(StateSpec(f"conv_state_{i}", (-1, conv_dim, c.linear_conv_kernel_dim), act,
                                       f"conv_state_{i}_out"))
                specs += [StateSpec(f"{n}_{i}", s[:-1], s[-1], f"{n}_{i}_out") for n, s in zip(_GDN_STATES, shapes)]
        return specs

    def states_from_patched(self, decoder, cache, lengths: int) -> list[torch.Tensor]:
        """State inputs equivalent to a patched model (``decoder`` = GDNReplayDecoder, ``cache`` its transformers
        cache holding ``lengths`` tokens for every row)."""
        out = []
        for i, kind in enumerate(self.kinds):
            if kind == "full_attention":
                out += self._kv_states(cache, i, lengths)
            else:
                b = decoder.bufs[i]
                out += [cache.get_conv_state(i).clone()] + [t.clone() for t in (b.state, b.u_cache, b.v_cache,
                                                                                 b.k_cache, b.g_cache, b.beta_cache)]
        return out

    # ---- the step -------------------------------------------------------------------------------
    def _attention(self, layer, h, k_cache, v_cache, lengths, cos_sin):
        att = layer.self_attn
        m = sys.modules[type(att).__module__]
        batch, hd = h.shape[0], att.head_dim
        q, gate = att.q_proj(h).view(batch, -1, hd * 2).chunk(2, dim=-1)  # (batch, nh, hd) each
        gate = gate.reshape(batch, -1)
        q = att.q_norm(q)[:, :, None]  # (batch, nh, 1, hd)
        k = att.k_norm(att.k_proj(h).view(batch, -1, hd))[:, :, None]
        v = att.v_proj(h).view(batch, -1, 1, hd)
        q, k = m.apply_rotary_pos_emb(q, k, *cos_sin)
        pos = torch.arange(self.max_seq_len, device=h.device)
        here = (pos[None, :] == lengths.long()[:, None])[:, None, :, None]
        k_cache = torch.where(here, k.to(k_cache.dtype), k_cache)
        v_cache = torch.where(here, v.to(v_cache.dtype), v_cache)
        rep = q.shape[1] // k_cache.shape[1]
        keys = k_cache.repeat_interleave(rep, dim=1) if rep > 1 else k_cache
        vals = v_cache.repeat_interleave(rep, dim=1) if rep > 1 else v_cache
        scores = torch.matmul(q, keys.transpose(2, 3)) * att.scaling  # (batch, nh, 1, S)
        visible = (pos[None, :] <= lengths.long()[:, None])[:, None, None, :]
        scores = torch.where(visible, scores, torch.full_like(scores, torch.finfo(scores.dtype).min))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, vals).reshape(batch, -1) * torch.sigmoid(gate)
        return att.o_proj(o), k_cache, v_cache

    def _gdn(self, layer, h, conv_state, st, cursor, sbi):
        from .qwen3_next import _projections

        mx = layer.linear_attn
        batch = h.shape[0]
        H, HV, Kd, V = mx.num_k_heads, mx.num_v_heads, mx.head_k_dim, mx.head_v_dim
        mixed, z, b, a = _projections(mx, h[:, None])
        window = torch.cat([conv_state[:, :, 1:], mixed[:, 0, :, None].to(conv_state.dtype)], dim=-1)
        conv = (window * mx.conv1d.weight.squeeze(1)).sum(-1)
        if mx.conv1d.bias is not None:
            conv = conv + mx.conv1d.bias
        q, k, v = F.silu(conv).to(h.dtype).split([mx.key_dim, mx.key_dim, mx.value_dim], dim=-1)
        y, *new = GDNDecode.apply(q.reshape(batch, H, Kd), k.reshape(batch, H, Kd), v.reshape(batch, HV, V),
                                  a.reshape(batch, HV), b.reshape(batch, HV), mx.A_log.float(), mx.dt_bias.float(),
                                  sbi, cursor, *st, (H, HV, Kd, V, self.buffer_len), self.backend)
        core = mx.norm(y.reshape(batch * HV, V).to(h.dtype), z.reshape(batch * HV, V))
        return mx.out_proj(core.reshape(batch, HV * V)), [window, *new]

    def _rope(self, lengths):
        """(cos, sin) (batch, 1, rotary_dim) at the positions ``lengths``, in the activation dtype. Text positions
        are equal in Qwen3.5's three mrope sections, so its section recomposition (slice writes, ScatterND in
        ONNX) is the identity and both families reduce to the standard rotary table of ``rotary_emb``."""
        rot = self.model.model.rotary_emb
        freqs = lengths.float()[:, None, None] * rot.inv_freq.float()[None, None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return ((emb.cos() * rot.attention_scaling).to(self.act_dtype),
                (emb.sin() * rot.attention_scaling).to(self.act_dtype))

    def forward(self, input_ids, lengths, cursor, *states):
        m = self.model.model
        h = m.embed_tokens(input_ids[:, 0])
        cos, sin = self._rope(lengths)
        sbi = torch.arange(h.shape[0], dtype=torch.int32, device=h.device)
        new_states, j = [], 0
        for kind, layer in zip(self.kinds, m.layers):
            res = h
            hn = layer.input_layernorm(h)
            if kind == "full_attention":
                out, kc, vc = self._attention(layer, hn, states[j], states[j + 1], lengths, (cos, sin))
                new_states += [kc, vc]
                j += 2
            else:
                out, st = self._gdn(layer, hn, states[j], states[j + 1:j + 7], cursor, sbi)
                new_states += st
                j += 7
            h = res + out
            hn = layer.post_attention_layernorm(h)
            mlp = layer.mlp
            h = h + (moe_dense(hn, mlp) if hasattr(mlp, "experts") else mlp(hn))
        logits = self.model.lm_head(m.norm(h)).float()
        return (logits, lengths + 1, torch.remainder(cursor + 1, self.buffer_len).to(torch.int32), *new_states)
