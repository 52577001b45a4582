# SPDX-License-Identifier: Apache-2.0
"""The engine directory's decode step of GLM-5 Next (transformers' ``Glm5NextForConditionalGeneration``, text path;
GLM-5.3-Flash): :class:`Glm5KDADecodeStep`, the export step of its entry in builders/models.py
(``scripts/build_engine.py --tiny glm5_next``). The generation engine's step is builders/glm5_step.py's ``Glm5Step``,
which runs transformers' own modules over a per-row cache; this one is the same decode written in standard
ONNX-exportable torch ops over explicit state inputs and outputs, for TensorRT.

It is :class:`builders.kimi_step.KimiKDADecodeStep` (the KDA layers: one ``replayssm::kda_decode`` node each, GLM-5
Next's bounded gate as the node's ``lower_bound_bits``; the conv windows; the plugin PTX, attributes, MoE and
the export protocol) with GLM-5 Next's layer loop: hyper-connection streams around every block and DSA
("indexed") attention instead of Kimi's MLA.

Graph inputs (row b of the batch is slot b; every row's tokens are at positions 0 .. lengths - 1):

 1. input_ids       (batch, 1) int64
 2. lengths         (batch,) int32     tokens already in the DSA caches (= the new token's position)
 3. cursor          (batch,) int32     ReplaySSM ring fill, shared by all KDA layers
 4. per KDA layer i (pattern letter K): KimiKDADecodeStep's conv, checkpoint[, shadow] and ring states
 5. per DSA layer i with its own indexer (``indexer_types`` "full", letter D): dsa_kv_i (batch, max_seq_len,
    kv_lora_rank) act (the kv_a_layernorm'd latent; GLM-5 Next's DSA is NoPE: no rope key), dsa_index_k_i and
    dsa_index_gate_i (batch, max_seq_len, index_head_dim) act (the indexer's normed key and k-pool compress-gate
    score per position: transformers' packed indexer state without its valid flag, which is position <= lengths
    here); a DSA layer that reuses the previous layer's top-k (``indexer_types`` "shared", letter d): dsa_kv_i only

Graph outputs: logits (batch, vocab) fp32, lengths_out = lengths + 1, cursor_out = (cursor + 1) % L, then every
state tensor as ``<name>_out`` (in-place aliases in TensorRT). builders/engine_format.py's K, D and d rows.

Per call (as ``Glm5NextTextModel`` and ``Glm5NextTextDecoderLayer`` run one token; Glm5Step's route):

  embed    ``embed_tokens``, expanded onto ``hc_mult`` streams (batch, 1, hc, hidden)
  block    transformers' ``attn_hc`` (then ``ffn_hc``) module: post, comb (Sinkhorn-normalised, a fixed number of
           iterations: unrolled in the graph) and the collapsed block input, all standard ops; the block output y
           leaves as ``post * y + comb^T @ streams`` (builders/glm5_step.py's ``_mix``, a MatMul)
  KDA      KimiKDADecodeStep's ``_kda``
  DSA      the query q = q_b(q_a_layernorm(q_a(x))) and the new latent kv_a_layernorm(kv_a(x)), written at
           ``lengths`` with a one-hot select (exact copies); keys and values of every position expanded by kv_b_proj;
           the query attends the positions the indexer selected (softmax in fp32, others at the dtype's minimum: an
           exact zero weight). The indexer (``Glm5NextTextIndexer.forward`` for one query at position p, pools
           starting at position 0): its key k_norm(wk(x)) and compress-gate score x W_gate^T written at p; the
           complete k-pools j (positions j kpool .. j kpool + kpool - 1 <= p; a static reshape of the first
           floor(max_seq_len / kpool) pools) compressed to softmax_kpool(gate + ape) . key; pool scores
           sum_h w_h relu(q_h . pool_key scale), w = weights_proj(x) n_heads^-1/2 (fp32); the index_topk / kpool
           best complete pools by ``torch.topk`` (TopK with a constant k; incomplete pools at the minimum, never
           chosen over a complete one), expanded to their positions by an Equal one-hot and a constant Gather (no
           Scatter), plus the open tail (positions from kpool floor((p + 1) / kpool) to p) where
           ``index_kpool_always_select_tail``. A "shared" layer attends the previous DSA layer's selection (the
           model hands it on only from a full indexer layer to the shared layer right after it).
  FFN      post-attention norm; MoE layers as KimiKDADecodeStep's ``_moe`` (builders/moe.py's ``route`` and
           ``gated_experts``, which applies GLM-5 Next's swiglu limit; the shared experts module); dense MLPs are
           the model's module (its clamps are standard ops)
  head     ``hc_head`` (the streams' mean), norm, lm_head

Positions past a row's length are never read: their pools are incomplete and their positions unselected, so a
stale value there gets an exact zero weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode_step import StateSpec, layer_state_specs
from .glm5_step import MODEL_TYPES, _mix
from .kda import text_model
from .kimi_step import KimiKDADecodeStep

# config.json's ``model.moe`` of a GLM-5 Next engine: the MoE keys of its text config (and the graph formulation)
MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
            "topk_group", "norm_topk_prob", "routed_scaling_factor", "swiglu_limit")
# config.json's ``model.dsa``: the indexer keys of the text config
DSA_KEYS = ("index_topk", "index_kpool", "index_head_dim", "index_n_heads", "index_kpool_always_select_tail",
            "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "indexer_types")


class Glm5KDADecodeStep(KimiKDADecodeStep):
    """The decode step (T = 1) of a loaded GLM-5 Next model (module docstring); shares its weights. Arguments as
    :class:`KimiKDADecodeStep`'s."""

    MODEL_TYPES = MODEL_TYPES
    FAMILY = "a GLM-5 Next model"
    LAYER_TYPES = ("linear_attention", "indexed_attention")

    def __init__(self, model, buffer_len: int, max_seq_len: int, backend=None, moe_formulation: str = "dense",
                 shadow: str = "none", num_draft: int = 0):
        if num_draft:
            raise ValueError(f"num_draft: GLM-5 Next engines are standard decode only (the DSA layers and their "
                             f"indexer are exported for one token per row), got {num_draft}")
        super().__init__(model, buffer_len, max_seq_len, backend, moe_formulation, shadow, num_draft)
        self.text = cfg = model.config.get_text_config()  # its DSA is NoPE: the config refuses qk_rope_head_dim > 0
        self.hc = cfg.hc_mult
        self.dsa = [i for i, k in enumerate(self.kinds) if k == "indexed_attention"]
        layers = text_model(model).layers
        self.own_indexer = {i: layers[i].self_attn.indexer is not None for i in self.dsa}
        # the model hands a top-k on only from a full indexer layer to a "shared" layer right after it
        for i in self.dsa:
            if not self.own_indexer[i] and not (i > 0 and self.own_indexer.get(i - 1, False)):
                raise ValueError(f"indexer_types: DSA layer {i} is 'shared' but layer {i - 1} is not a DSA layer with "
                                 f"its own indexer ('full'): no top-k to share (transformers raises the same)")

    # ---- the engine directory (builders/models.py's export step protocol) -------------------------------------
    def letter(self, i: int) -> str:
        """Layer i's pattern letter (builders/engine_format.py): K KDA, D DSA with its own indexer, d DSA sharing."""
        if self.kinds[i] == "linear_attention":
            return "K"
        return "D" if self.own_indexer[i] else "d"

    def describe(self) -> list[str]:
        c = self.text
        H, K, V = self.plugin_geometry()
        shared = sum(not v for v in self.own_indexer.values())
        lines = [f"{self.config.model_type}: {len(self.kda)} Kimi Delta Attention layers, heads={H} key dim={K} value "
                 f"dim={V}, gate lower bound {self.lower_bound}; {len(self.dsa)} DSA layers ({shared} sharing the "
                 f"previous top-k), top-{c.index_topk} in pools of {c.index_kpool}; {self.hc} hyper-connection streams"]
        moe = self._moe_layers()
        if moe:
            lines.append(f"{len(moe)} MoE layers: {c.n_routed_experts} experts, top-{c.num_experts_per_tok}, as "
                         f"{self.moe_formulation} standard ONNX ops (builders/moe.py gated_experts)")
        return lines

    def model_entry(self) -> dict:
        """config.json's ``model`` after source, seed and model_type: pattern (K per KDA layer, D / d per DSA layer),
        sizes, the layers by type, the hyper-connection streams, the DSA indexer keys, the MoE layers and keys."""
        c = self.text
        entry = dict(pattern="".join(self.letter(i) for i in range(len(self.kinds))), vocab_size=c.vocab_size,
                     hidden_size=c.hidden_size, layer_types=self.kinds, kda_layers=self.ssm_layers(),
                     attention_layers=list(self.dsa), hc_mult=self.hc, dsa={k: getattr(c, k) for k in DSA_KEYS})
        moe = self._moe_layers()
        if moe:
            entry["moe_layers"] = moe
            entry["moe"] = dict({k: getattr(c, k, None) for k in MOE_KEYS}, formulation=self.moe_formulation)
        return entry

    # ---- the state contract ---------------------------------------------------------------------------------
    def state_specs(self) -> list[StateSpec]:
        c = self.text
        sizes = dict(num_heads=self.H, key_dim=self.Kd, value_dim=self.V, buffer_len=self.buffer_len,
                     conv_dim=3 * self.H * self.Kd, conv_width=self.window, max_seq_len=self.max_seq_len,
                     kv_lora_rank=c.kv_lora_rank, index_head_dim=c.index_head_dim)
        specs = []
        for i in range(len(self.kinds)):
            specs += layer_state_specs(self.letter(i), i, sizes, dict(act=self.act_dtype), False, self.shadow)
        return specs

    def states_from_patched(self, decoder, cache, lengths: int):
        """State inputs equivalent to a patched model (builders/kda.py's ``patch_kda_replayssm``, the same buffer
        length) after its own prefill / decode of ``lengths`` tokens in every row, unpadded (``cache`` its transformers
        cache): per KDA layer the conv state (the last K inputs), the checkpoint[, its shadow] and the rings; per DSA
        layer the latents and the indexer's keys and gate scores (transformers' packed indexer state, whose valid flag
        must be 1 at every position: left-padded rows do not start at position 0), zero past ``lengths``."""

        def padded(t):  # (batch, lengths, width) -> (batch, max_seq_len, width)
            buf = t.new_zeros((t.shape[0], self.max_seq_len, t.shape[-1]))
            buf[:, :lengths] = t[:, :lengths]
            return buf

        D, out = self.text.index_head_dim, []
        for i, kind in enumerate(self.kinds):
            if kind == "linear_attention":
                state, rings = self._patched_ssm(decoder, i)
                out += [cache.get_conv_state(i).clone(), state.clone(), *self._shadow_of(state),
                        *(t.clone() for t in rings)]
                continue
            out.append(padded(cache.layers[i].keys[:, 0]))
            if self.own_indexer[i]:
                packed = cache.layers[i].indexer_keys  # (batch, seq, key | gate score | valid)
                if not bool((packed[:, :lengths, 2 * D] == 1).all()):
                    raise ValueError(f"cache: layer {i}'s indexer state has padding positions (valid 0) among the first "
                                     f"{lengths}: the engine's rows start at position 0 (prefill unpadded)")
                out += [padded(packed[..., :D]), padded(packed[..., D:2 * D])]
        return out

    # ---- the layers, on (batch, 1, D) -----------------------------------------------------------------------
    def _indexer(self, ix, x, q_resid, keys, gates, here, lengths):
        """The DSA indexer of one query per row at position p = ``lengths`` (module docstring): (the positions it
        selects (batch, max_seq_len) bool, the new key and gate-score states)."""
        batch, S, kp, D = x.shape[0], self.max_seq_len, ix.index_kpool, ix.head_dim
        keys = torch.where(here, ix.k_norm(ix.wk(x)).to(keys.dtype), keys)
        gates = torch.where(here, F.linear(x, ix.index_kpool_compress_gate).to(gates.dtype), gates)
        p = lengths.long()[:, None]
        pos = torch.arange(S, device=x.device)
        P = S // kp  # complete pools that fit; a partial last pool is never complete
        chosen = torch.zeros(batch, S, dtype=torch.bool, device=x.device)
        if P:
            pk = keys[:, :P * kp].reshape(batch, P, kp, D)
            logits = gates[:, :P * kp].reshape(batch, P, kp, D).float() + ix.index_kpool_compress_ape.float()
            pool_keys = (logits.softmax(dim=2).to(pk.dtype) * pk).sum(2)  # (batch, P, D)
            q = ix.wq_b(q_resid).reshape(batch, ix.n_heads, D)
            scores = F.relu(torch.matmul(q.float(), pool_keys.float().transpose(1, 2)) * ix.softmax_scale)  # (b, h, P)
            w = ix.weights_proj(x.to(ix.weights_proj.weight.dtype)).float() * ix.n_heads ** -0.5  # (batch, 1, h)
            index_scores = torch.matmul(w, scores)[:, 0]  # (batch, P)
            complete = (torch.arange(P, device=x.device) * kp + kp - 1)[None, :] <= p  # (batch, P)
            index_scores = torch.where(complete, index_scores,
                                       torch.full_like(index_scores, torch.finfo(index_scores.dtype).min))
            top = index_scores.topk(min(ix.index_topk // kp, P), dim=-1).indices  # (batch, k)
            picked = (top[:, :, None] == torch.arange(P, device=x.device)).sum(1) > 0  # (batch, P), no Scatter
            picked = picked & complete
            pool_of = torch.clamp(pos // kp, max=P - 1)  # constant Gather indices
            chosen = picked[:, pool_of] & (pos < P * kp)[None, :]
        if ix.index_kpool_always_select_tail and kp > 1:
            tail = torch.div(p + 1, kp, rounding_mode="floor") * kp  # the open pool's first position
            chosen = chosen | ((pos[None, :] >= tail) & (pos[None, :] <= p))
        return chosen, keys, gates

    def _dsa(self, att, x, caches, lengths, prev):
        """DSA layer on the normed block input x (batch, 1, D) over its states ``caches`` (latent[, indexer key,
        gate score]): (out, new states, the selection a "shared" layer after it reads, or None)."""
        batch, nh, S = x.shape[0], att.num_heads, self.max_seq_len
        q_resid = att.q_a_layernorm(att.q_a_proj(x))
        q = att.q_b_proj(q_resid).view(batch, 1, nh, att.qk_head_dim).transpose(1, 2)  # (batch, nh, 1, qk_head_dim)
        here = (torch.arange(S, device=x.device)[None, :] == lengths.long()[:, None])[:, :, None]  # (batch, S, 1)
        kv_cache = torch.where(here, att.kv_a_layernorm(att.kv_a_proj_with_mqa(x)).to(caches[0].dtype), caches[0])
        new = [kv_cache]
        if att.indexer is not None:
            chosen, keys, gates = self._indexer(att.indexer, x, q_resid, caches[1], caches[2], here, lengths)
            new += [keys, gates]
        else:
            chosen = prev
        kv = att.kv_b_proj(kv_cache).view(batch, S, nh, -1).transpose(1, 2)  # (batch, nh, S, nope + v)
        keys, values = kv.split([att.qk_nope_head_dim, att.v_head_dim], dim=-1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * att.scaling  # (batch, nh, 1, S)
        scores = torch.where(chosen[:, None, None, :], scores, torch.full_like(scores, torch.finfo(scores.dtype).min))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, values)  # (batch, nh, 1, v_head_dim)
        out = att.o_proj(o.transpose(1, 2).reshape(batch, 1, -1))
        return out, new, chosen if att.next_skip_topk else None

    def _hc(self, hc, streams):
        """(post, comb, block input) of a hyper-connection module on the streams (batch, 1, hc, hidden): the module
        itself, its outputs pinned to their static shapes (its flattening view leaves the token axis to ONNX shape
        inference, which loses it)."""
        b, n, d = streams.shape[0], self.hc, streams.shape[-1]
        post, comb, x = hc(streams)
        return post.reshape(b, 1, n), comb.reshape(b, 1, n, n), x.reshape(b, 1, d)

    def _layers(self, input_ids, lengths, cursor, states):
        """(logits (batch, 1, vocab) fp32, new states) of the tokens ``input_ids`` (batch, 1)."""
        m = text_model(self.model)
        h = m.embed_tokens(input_ids)  # (batch, 1, hidden)
        streams = h[:, :, None].expand(-1, -1, self.hc, -1).contiguous()  # the hc module views it flat
        sbi = self._rows(h.shape[0], cursor, h.device)
        new_states, j, chosen = [], 0, None
        for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
            post, comb, x = self._hc(layer.attn_hc, streams)
            x = layer.input_layernorm(x)
            if kind == "linear_attention":
                n = 7 + (self.shadow != "none")  # conv, checkpoint[, shadow], k, u, g, v, beta
                y, st = self._kda(i, layer.self_attn, x, states[j], list(states[j + 1:j + n]), cursor, sbi)
                chosen = None  # the model's KDA layers hand no top-k on
            else:
                n = 3 if self.own_indexer[i] else 1
                y, st, chosen = self._dsa(layer.self_attn, x, states[j:j + n], lengths, chosen)
            new_states += st
            j += n
            streams = _mix(post, comb, y, streams)
            post, comb, x = self._hc(layer.ffn_hc, streams)
            x = layer.post_attention_layernorm(x)
            y = self._moe(x, layer.mlp) if hasattr(layer.mlp, "experts") else layer.mlp(x)
            streams = _mix(post, comb, y, streams)
        return self.model.lm_head(m.norm(m.hc_head(streams))).float(), new_states


__all__ = ["Glm5KDADecodeStep", "MOE_KEYS", "DSA_KEYS"]
