# SPDX-License-Identifier: Apache-2.0
"""The generation engine's decode step for GLM-5 Next (transformers' ``Glm5NextForConditionalGeneration``, text
path; GLM-5.3-Flash): :class:`builders.kimi_step.KimiStep` (rows = slots, its KDA layers, SSM modes, conv windows,
slot hand-off and host save / load) with GLM-5 Next's DSA attention and hyper-connection streams.

State beyond KimiStep's: per DSA (``indexed_attention``) layer, ``k[i]`` the kv_a_layernorm'd latent (batch, 1,
kv_len, kv_lora_rank) and ``v[i]`` the rest of what the layer keeps per position, (batch, 1, kv_len, W): the rope
part of the key (qk_rope_head_dim, 0 in GLM-5.3-Flash: its DSA is NoPE), then, where the layer runs its own indexer
(``indexer_types`` "full"), the indexer's packed per-position state as transformers' ``DynamicIndexedLayer`` keeps
it: key (index_head_dim) | k-pool compress-gate score (index_head_dim) | valid flag (1). One tensor per layer and
position, so KimiStep's rows, hand-off, swap and saved_spec carry it unchanged; positions past a row's length are
zero (valid 0), as ``load_slot`` / ``load_saved`` leave them.

Per call (as ``Glm5NextTextModel`` / ``Glm5NextTextDecoderLayer`` run one token):

  embed    transformers' ``embed_tokens``, copied into ``hc_mult`` streams (n, 1, hc, hidden)
  block    ``attn_hc`` (then ``ffn_hc``) gives post, comb and the collapsed block input; the block's output y leaves
           as ``post * y + comb^T @ streams`` (:func:`_mix`, the decoder layer's own expression)
  KDA      KimiStep's KDA layer (``_kda``) with GLM-5 Next's bounded gate g = lower sigmoid(exp(A_log) (f + dt_bias))
           (``lower_bound``, passed by the SSM modes)
  DSA      transformers' ``Glm5NextTextAttention`` module itself, handed a per-row cache (:class:`_RowCache`): its
           ``update`` writes the new latent at each row's position and returns every position's, its
           ``update_indexer`` does the same for the indexer's packed state; the module's indexer scores the k-pools
           of each row's valid positions (its own ``get_pooled_states`` / ``get_visible_tokens`` /
           ``append_visible_tail``: pools start at the row's position 0, positions past the row's length are not
           valid, so rows at different lengths select only their own tokens), builds the sparse mask
           (``build_attention_mask_from_topk``) and attends through the model's attention interface. A layer with
           ``indexer_types`` "shared" reuses the previous layer's top-k, reset after a KDA layer as the model does.
  FFN      post-attention norm and transformers' MLP / MoE module
  head     ``hc_head`` (the streams' mean), norm, lm_head

The prefill hand-off (:meth:`Glm5Step.load_prefill_row`) reads row r of transformers' cache after the model's own
(left-padded) forward: the KDA layers' conv windows and recurrent states as KimiStep does, and per DSA layer the
prompt's latents, rope keys and indexer states (``keys``, ``values``, ``indexer_keys`` of its DynamicIndexedLayer;
the indexer starts its pools at a row's first valid position, so left padding and our position 0 agree).

Eager only (``capturable = False``), as KimiStep: the MoE and the indexer's selection have data-dependent shapes.
The engine directory's step (the same decode in static-shape standard ops over explicit state I/O, for TensorRT) is
builders/glm5_export.py's ``Glm5KDADecodeStep``.
"""

from __future__ import annotations

import torch

from .kda import text_model
from .kimi_step import KimiStep

MODEL_TYPES = ("glm5_next",)


def _mix(post, comb, y, streams):
    """The exit of a GLM-5 Next block (``Glm5NextTextDecoderLayer.forward``): the block output ``y`` (n, 1, hidden)
    expanded onto the streams by ``post`` (n, 1, hc), plus the input ``streams`` (n, 1, hc, hidden) mixed by the
    doubly-stochastic ``comb`` (n, 1, hc, hc)."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


class _Positions:
    """What the DSA indexer reads of a cache layer: ``keys`` (its last-but-one dim: the positions) and
    ``get_seq_length()``: every one of the step's kv_len positions (visibility is the valid flag's alone)."""

    def __init__(self, keys):
        self.keys = keys

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


class _RowCache:
    """transformers' Cache as ``Glm5NextTextAttention`` and its indexer call it for one token per row, over the step's
    per-row tensors (module docstring): ``update`` / ``update_indexer`` write the new position ``pos[r]`` of every
    row r in place and return all kv_len positions."""

    def __init__(self, step: Glm5Step, pos):
        self.step, self.pos = step, pos
        self.at = torch.arange(pos.shape[0], device=pos.device)
        self.layers = {i: _Positions(step.k[i]) for i in step.attn}

    def update(self, k_pass, k_rot, layer_idx: int, kwargs=None):
        k, v, r = self.step.k[layer_idx], self.step.v[layer_idx], self.step.rope
        k[self.at, 0, self.pos] = k_pass[:, 0, 0].to(k.dtype)
        v[self.at, 0, self.pos, :r] = k_rot[:, 0, 0].to(v.dtype)
        return k, v[..., :r]

    def update_indexer(self, packed, layer_idx: int):
        v, r = self.step.v[layer_idx], self.step.rope
        v[self.at, 0, self.pos, r:] = packed[:, 0].to(v.dtype)
        return v[:, 0, :, r:]


class Glm5Step(KimiStep):
    """Decode of one token for ``batch`` rows (= slots) of a loaded GLM-5 Next model, DSA state of ``kv_len``
    positions, SSM ``mode`` (module docstring). Everything but the layer loop, the DSA layer and the DSA layers'
    per-position width is KimiStep's."""

    MODEL_TYPES = MODEL_TYPES
    LAYER_TYPES = ("linear_attention", "indexed_attention")
    FAMILY = "a GLM-5 Next model"

    def __init__(self, model, batch: int, kv_len: int, mode: str = "replay", buffer_len: int = 16):
        super().__init__(model, batch, kv_len, mode, buffer_len)
        cfg, layers = self.cfg, text_model(model).layers
        self.hc = cfg.hc_mult
        self.rope = cfg.qk_rope_head_dim
        first = next((i for i in self.attn), None)
        if first is not None and layers[first].self_attn.indexer is None:
            raise ValueError(f"indexer_types: the first DSA layer ({first}) must run its own indexer ('full'), got "
                             f"'shared' (no earlier top-k to share)")
        for i in self.attn:  # the latent is KimiStep's k[i]; v[i] widens to rope | indexer state
            ix = layers[i].self_attn.indexer
            width = self.rope + (0 if ix is None else 2 * ix.head_dim + 1)
            self.v[i] = torch.zeros(batch, 1, kv_len, width, dtype=self.act, device=self.device)

    def load_prefill_row(self, cache, r: int, row: int, m: int, n: int) -> None:
        """Row ``r`` of transformers' cache after a prefill of ``m`` (left-padded) positions whose last ``n`` are the
        prompt, into row ``row``: KimiStep's hand-off, with the DSA layers' rope keys and indexer states next to
        their latents (module docstring)."""
        conv = {i: cache.get_conv_state(i)[r, :, 1:].transpose(0, 1) for i in self.kda}  # (K-1, conv_dim)
        k = {i: cache.layers[i].keys[r, :, m - n:] for i in self.attn}
        v = {}
        for i in self.attn:
            rest = [cache.layers[i].values[r, :, m - n:]]
            if self.v[i].shape[-1] > self.rope:  # the layer's own indexer: (m, 2 index_head_dim + 1) per row
                rest.append(cache.layers[i].indexer_keys[r, m - n:][None])
            v[i] = torch.cat(rest, dim=-1)
        ssm = {i: cache.get_recurrent_state(i)[r].float() for i in self.kda}
        self.load_slot(row, n, conv, k, v, ssm)

    def slot_geometry(self) -> dict:
        """KimiStep's, with the composite model type, the hyper-connection streams and each DSA layer's width."""
        c = self.cfg
        return dict(super().slot_geometry(), model_type=self.model.config.model_type, hc_mult=self.hc,
                    dsa=[c.index_n_heads, c.index_head_dim, c.index_topk, c.index_kpool,
                         [int(self.v[i].shape[-1]) for i in self.attn]])

    # ---- one step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        """One token for every row: ``logits`` and the greedy ``ids``; lengths += 1; the KDA state of the rows with a
        slot advanced. Raises after closing the SSM step (the engine fails these rows' requests)."""
        m = text_model(self.model)
        sbi, n = self.sbi, self.sbi.shape[0]
        pos = self.lengths.clamp(max=self.kv_len - 1)  # a padding row's length runs on; a live row's never passes
        dst = torch.where(sbi >= 0, sbi, self.conv[self.kda[0]].shape[0] - 1).long()  # padding rows: the scratch row
        streams = m.embed_tokens(self.ids)[:, None, None].expand(-1, -1, self.hc, -1).contiguous()  # (n, 1, hc, D)
        rows = _RowCache(self, pos)
        mask = torch.ones(n, 1, dtype=torch.bool, device=self.device)  # one real token per row: no padding
        self.ssm.begin_step(sbi)
        try:
            topk = None
            for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
                post, comb, x = layer.attn_hc(streams)
                x = layer.input_layernorm(x)
                if kind == "linear_attention":
                    y, topk = self._kda(i, layer.self_attn, x, dst), None  # the model's loop drops top-k here too
                else:
                    y, _, topk = layer.self_attn(x, attention_mask=mask, cache=rows, prev_topk_indices=topk)
                streams = _mix(post, comb, y, streams)
                post, comb, x = layer.ffn_hc(streams)
                streams = _mix(post, comb, layer.mlp(layer.post_attention_layernorm(x)), streams)
            logits = self.model.lm_head(m.norm(m.hc_head(streams)))[:, 0]
        except BaseException:
            self.ssm.abort_step()
            raise
        return self._finish_step(logits, sbi)


__all__ = ["MODEL_TYPES", "Glm5Step"]
