# SPDX-License-Identifier: Apache-2.0
"""One Nemotron-H / Nemotron 3 decode step as a module with explicit state I/O, and its ONNX export.

Graph inputs (row b of the batch is slot b: state_batch_indices = arange(batch) inside):

 1. input_ids       (batch, 1) int64
 2. lengths         (batch,) int32     tokens already in the KV caches; the new one is written there
                                       (the caller keeps lengths < max_seq_len)
 3. cursor          (batch,) int32     ReplaySSM buffer fill, shared by all Mamba layers
 4. per attention layer i: k_cache_i, v_cache_i  (batch, kv_heads, max_seq_len, head_dim)  act
 5. per Mamba layer i:     conv_state_i (batch, conv_dim, conv_kernel) act,
                           ssm_state_i (batch, H, P, N) state dtype (the checkpoint S0),
                           x_cache_i (batch, H, L, P) act, B_cache_i (batch, G, L, N) act,
                           dt_cache_i (batch, H, L) fp32 (processed dt)

Graph outputs: logits (batch, vocab) fp32, lengths_out = lengths + 1, cursor_out = (cursor + 1) % L,
then every state tensor of 4-5 as ``<name>_out`` with the input's shape and dtype (in-place aliases
in TensorRT). :meth:`NemotronHDecodeStep.state_specs` lists them.

Per Mamba layer: in_proj, conv1d over the window [conv_state[:, :, 1:], xBC] (the new conv state),
silu, then ONE ``replayssm::mamba2_decode`` node (:class:`Mamba2Decode`), then the model's gated
RMSNorm with z and out_proj. Attention (Nemotron-H uses no positional encoding): the new K/V is
written at ``lengths[b]`` with a one-hot select, keys j <= lengths[b] are attended. MoE layers
(Nemotron 3) carry no state: :func:`builders.moe.moe_forward` in standard ops (sigmoid routing,
TopK, the routed experts in the ``moe_formulation`` the step was built with, and the shared expert);
transformers' own MoE module cannot be traced (its expert loop reads the routing on the host, so a
trace would freeze the experts of the tracing input). The default "dense" formulation runs every
expert on every token as two batched MatMuls over (E, ., .) constants weighted by a (batch, E)
routing mask: static shapes TensorRT builds as plain GEMMs, each expert matrix read once per step
whatever the batch; "gather" copies each token's k expert matrices and is cheaper only while
2·batch·k < E (builders/moe.py has the numbers). MLP layers are the model's.

Export route: the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) with
``torch.autograd.Function.symbolic``. It emits exactly one custom node with our domain, attributes
and five outputs, and the Python ``forward`` (the reference backend) runs while tracing. The
torch.export-based exporter would need an onnxscript translation of a torch.library op for the same
node; the TorchScript route is the smaller one and works on torch 2.13 (with a DeprecationWarning).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

from .engine_format import layer_states
from .moe import FORMULATIONS, moe_forward
from .nemotron_h import _check_layers, reference_backend

OP_TYPE = "mamba2_decode"
DOMAIN = "replayssm"
_ONNX_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                     torch.int32: "int32", torch.int64: "int64"}
_TORCH_DTYPES = {n: t for t, n in _ONNX_DTYPE_NAMES.items()}


class Mamba2Decode(torch.autograd.Function):
    """``replayssm::mamba2_decode``: inputs (x, B, C, dt, dt_bias, A, D, state_batch_indices, cursor,
    state, x_cache, B_cache, dt_cache), outputs (y, state_out, x_cache_out, B_cache_out, dt_cache_out).

    Eager: the backend runs on copies of the caches (functional, as the graph is); TensorRT aliases
    the last four outputs to their inputs.
    """

    @staticmethod
    def forward(ctx, x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache,
                sizes, backend):
        state, x_cache, B_cache, dt_cache = (t.clone() for t in (state, x_cache, B_cache, dt_cache))
        y = backend(state=state, x_cache=x_cache, B_cache=B_cache, dt_cache=dt_cache, cursor=cursor, x=x, B=B,
                    C=C, dt=dt, dt_bias=dt_bias, A=A, D=D, z=None, state_batch_indices=sbi)
        return y.to(x.dtype), state, x_cache, B_cache, dt_cache

    @staticmethod
    def symbolic(g, x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache, sizes, backend):
        nheads, headdim, dstate, ngroups, buffer_len = sizes
        outs = g.op(f"{DOMAIN}::{OP_TYPE}", x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache,
                    dt_cache, plugin_namespace_s=DOMAIN, aot_i=1, nheads_i=nheads, headdim_i=headdim,
                    dstate_i=dstate, ngroups_i=ngroups, buffer_len_i=buffer_len, outputs=5)
        for o, like in zip(outs, (x, state, x_cache, B_cache, dt_cache)):
            o.setType(like.type())
        return outs


@dataclasses.dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple  # batch as -1
    dtype: torch.dtype
    output: str

    def to_json(self) -> dict:
        return dict(name=self.name, shape=list(self.shape), dtype=_ONNX_DTYPE_NAMES[self.dtype], output=self.output)


def layer_state_specs(letter: str, layer: int, sizes: dict, dtypes: dict, speculative: bool = False) -> list[StateSpec]:
    """The state tensors of layer ``layer`` (pattern letter ``letter``) as the engine-directory format lists them
    (builders/engine_format.py's LAYER_STATES, the one table of names, shapes and dtypes), with the sizes of
    ``sizes`` and the torch dtypes of the roles in ``dtypes`` (``act``, ``state``)."""
    return [StateSpec(s.name(layer), s.shape(sizes), dtypes[s.dtype] if s.dtype in dtypes else _TORCH_DTYPES[s.dtype],
                      s.output(layer)) for s in layer_states(letter, speculative)]


class StepIO:
    """The engine I/O every decode step with explicit state shares (this module's and builders/gdn_step.py's):
    names, zero states, the K/V of a transformers cache; subclasses give ``state_specs()`` and ``max_seq_len``."""

    def input_names(self) -> list[str]:
        return ["input_ids", "lengths", "cursor"] + [s.name for s in self.state_specs()]

    def output_names(self) -> list[str]:
        return ["logits", "lengths_out", "cursor_out"] + [s.output for s in self.state_specs()]

    def empty_states(self, batch: int, device="cpu") -> list[torch.Tensor]:
        return [torch.zeros((batch, *s.shape[1:]), dtype=s.dtype, device=device) for s in self.state_specs()]

    def _kv_states(self, cache, i: int, lengths: int) -> list[torch.Tensor]:
        """Layer i's K and V from a transformers cache holding ``lengths`` tokens, padded to max_seq_len."""
        out = []
        for t in (cache.layers[i].keys, cache.layers[i].values):
            buf = t.new_zeros((t.shape[0], t.shape[1], self.max_seq_len, t.shape[3]))
            buf[:, :, :lengths] = t[:, :, :lengths]
            out.append(buf)
        return out


class NemotronHDecodeStep(StepIO, torch.nn.Module):
    """Decode step of a (loaded, unpatched or patched) ``NemotronHForCausalLM``; shares its weights."""

    speculative = False  # the verify step (builders/spec_step.py) keeps a wider conv window, conv_window_i

    def __init__(self, model, buffer_len: int, max_seq_len: int, state_dtype: torch.dtype = torch.float32,
                 backend=None, moe_formulation: str = "dense"):
        super().__init__()
        _check_layers(model.config)
        if moe_formulation not in FORMULATIONS:
            raise ValueError(f"moe_formulation: expected one of {FORMULATIONS}, got {moe_formulation!r}")
        self.moe_formulation = moe_formulation
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
        self.model = model
        self.config = cfg = model.config
        self.buffer_len, self.max_seq_len, self.state_dtype = buffer_len, max_seq_len, state_dtype
        self.backend = backend or reference_backend
        self.act_dtype = next(model.parameters()).dtype
        self.kinds = list(cfg.layers_block_type)
        self.window = cfg.conv_kernel  # conv state: the last K inputs
        # Per-head SSM constants in fp32 (constants of the graph; A is not computed in the graph).
        for i, kind in enumerate(self.kinds):
            if kind == "linear_attention":
                mx = model.model.layers[i].mixer
                self.register_buffer(f"A_{i}", -torch.exp(mx.A_log.detach().float()), persistent=False)
                self.register_buffer(f"D_{i}", mx.D.detach().float().clone(), persistent=False)
                self.register_buffer(f"dt_bias_{i}", mx.dt_bias.detach().float().clone(), persistent=False)

    # ---- the state contract ---------------------------------------------------------------------
    def state_specs(self) -> list[StateSpec]:
        cfg = self.config
        H, P, N, G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        sizes = dict(nheads=H, headdim=P, dstate=N, ngroups=G, buffer_len=self.buffer_len, conv_dim=H * P + 2 * G * N,
                     conv_width=self.window, kv_heads=cfg.num_key_value_heads, max_seq_len=self.max_seq_len,
                     head_dim=cfg.head_dim)
        dtypes = dict(act=self.act_dtype, state=self.state_dtype)
        letters = {"full_attention": "*", "linear_attention": "M"}  # MoE and MLP layers carry no state
        specs = []
        for i, kind in enumerate(self.kinds):
            if kind in letters:
                specs += layer_state_specs(letters[kind], i, sizes, dtypes, self.speculative)
        return specs

    def states_from_patched(self, decoder, cache, lengths: int) -> list[torch.Tensor]:
        """State inputs equivalent to a patched model after prefill/decode (``decoder`` = ReplaySSMDecoder,
        ``cache`` = its transformers cache holding ``lengths`` tokens for every row)."""
        out = []
        for i, kind in enumerate(self.kinds):
            if kind == "full_attention":
                out += self._kv_states(cache, i, lengths)
            elif kind == "linear_attention":
                c = decoder.caches[i]
                out += [cache.get_conv_state(i).clone(), c["state"].to(self.state_dtype).clone(),
                        c["x_cache"].clone(), c["B_cache"].clone(), c["dt_cache"].clone()]
        return out

    # ---- the step -------------------------------------------------------------------------------
    def _attention(self, layer, h, k_cache, v_cache, lengths):
        cfg, att = self.config, layer.mixer
        batch = h.shape[0]
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = att.q_proj(h).view(batch, nh, 1, hd)
        k = att.k_proj(h).view(batch, kvh, 1, hd)
        v = att.v_proj(h).view(batch, kvh, 1, hd)
        pos = torch.arange(self.max_seq_len, device=h.device)
        here = (pos[None, :] == lengths.long()[:, None])[:, None, :, None]  # (batch, 1, S, 1)
        k_cache = torch.where(here, k, k_cache)
        v_cache = torch.where(here, v, v_cache)
        rep = nh // kvh
        keys = k_cache.repeat_interleave(rep, dim=1) if rep > 1 else k_cache
        vals = v_cache.repeat_interleave(rep, dim=1) if rep > 1 else v_cache
        scores = torch.matmul(q, keys.transpose(2, 3)) * att.scaling  # (batch, nh, 1, S)
        visible = (pos[None, :] <= lengths.long()[:, None])[:, None, None, :]
        scores = torch.where(visible, scores, torch.full_like(scores, torch.finfo(scores.dtype).min))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, vals).reshape(batch, nh * hd)
        return att.o_proj(o), k_cache, v_cache

    def _mamba(self, i, layer, h, conv_state, state, x_cache, B_cache, dt_cache, cursor, sbi):
        mx = layer.mixer
        batch = h.shape[0]
        H, P, N, G = mx.num_heads, mx.head_dim, mx.ssm_state_size, mx.n_groups
        gate, xBC, dt = mx.in_proj(h).split([mx.intermediate_size, mx.conv_dim, H], dim=-1)
        window = torch.cat([conv_state[:, :, 1:], xBC[:, :, None].to(conv_state.dtype)], dim=-1)
        conv = (window * mx.conv1d.weight.squeeze(1)).sum(-1)
        if mx.conv1d.bias is not None:
            conv = conv + mx.conv1d.bias
        xBC = F.silu(conv).to(h.dtype)
        x, B, C = xBC.split([mx.intermediate_size, G * N, G * N], dim=-1)
        y, state, x_cache, B_cache, dt_cache = Mamba2Decode.apply(
            x.reshape(batch, H, P), B.reshape(batch, G, N), C.reshape(batch, G, N), dt,
            getattr(self, f"dt_bias_{i}"), getattr(self, f"A_{i}"), getattr(self, f"D_{i}"), sbi, cursor,
            state, x_cache, B_cache, dt_cache, (H, P, N, G, self.buffer_len), self.backend)
        out = mx.out_proj(mx.norm(y.reshape(batch, H * P), gate).to(h.dtype))
        return out, [window, state, x_cache, B_cache, dt_cache]

    def forward(self, input_ids, lengths, cursor, *states):
        logits, new_states = self._layers(self.model.model.embeddings(input_ids[:, 0]), lengths, cursor, states)
        return (logits, lengths + 1, torch.remainder(cursor + 1, self.buffer_len).to(torch.int32), *new_states)

    def _layers(self, h, lengths, cursor, states):
        """Every layer on the embedded tokens h, then the final norm and lm_head: (logits fp32, new states)."""
        m = self.model.model
        sbi = torch.arange(h.shape[0], dtype=torch.int32, device=h.device)
        new_states, k = [], 0
        for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
            res = h
            hn = layer.norm(h.to(layer.norm.weight.dtype))
            if kind == "full_attention":
                out, kc, vc = self._attention(layer, hn, states[k], states[k + 1], lengths)
                new_states += [kc, vc]
                k += 2
            elif kind == "linear_attention":
                out, st = self._mamba(i, layer, hn, *states[k:k + 5], cursor, sbi)
                new_states += st
                k += 5
            elif kind == "moe":
                out = moe_forward(hn, layer.mixer, self.moe_formulation)
            else:
                out = layer.mixer(hn)
            h = res + out
        return self.model.lm_head(m.norm_f(h)).float(), new_states


def export_onnx(step, path, batch: int = 2, opset: int = 17) -> None:
    """Trace ``step`` (a decode step with explicit state I/O: this module's, or builders/gdn_step.py's) on zero
    states of ``batch`` rows and write ONNX with a dynamic batch dimension."""
    if opset < 17:
        raise ValueError(f"opset: expected >= 17, got {opset}")
    dev = next(step.parameters()).device
    args = (torch.ones(batch, 1, dtype=torch.int64, device=dev), torch.zeros(batch, dtype=torch.int32, device=dev),
            torch.zeros(batch, dtype=torch.int32, device=dev), *step.empty_states(batch, dev))
    names_in, names_out = step.input_names(), step.output_names()
    dyn = {n: {0: "batch"} for n in names_in + names_out}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings from the Python reference; DeprecationWarning of the route
        torch.onnx.export(step, args, str(path), dynamo=False, opset_version=opset, input_names=names_in,
                          output_names=names_out, dynamic_axes=dyn, custom_opsets={DOMAIN: 1},
                          do_constant_folding=True)
