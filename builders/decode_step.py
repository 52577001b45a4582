# SPDX-License-Identifier: Apache-2.0
"""One Nemotron-H / Nemotron 3 step of T = 1 + num_draft tokens per row as a module with explicit state I/O, and
the one ONNX export of every step (this family's and builders/qwen_export.py's).

:class:`NemotronHDecodeStep` with ``num_draft = 0`` (T = 1) is the standard decode step; with ``num_draft`` > 0
it is the verify graph of speculative decoding, whose commit graph (run after sampling) is
builders/spec_step.py's. The layers are the same code on (batch, T, D) tokens (:func:`window_conv`,
:func:`window_attention`, :func:`mamba2_mixer`); T changes the SSM node, the conv state's width, the cursor
and the graph outputs. :func:`export_onnx` writes the step's graph (and, for T > 1, the commit graph).

Graph inputs (row b of the batch is slot b: state_batch_indices = arange(batch) inside):

 1. input_ids       (batch, T) int64    T = 1; T > 1: the last sampled token, then the num_draft drafts
 2. lengths         (batch,) int32      tokens already in the KV caches; the T new ones are written at
                                        lengths .. lengths + T - 1 (the caller keeps lengths + T <= max_seq_len)
 3. cursor          T = 1: (batch,) int32 ReplaySSM buffer fill, shared by all Mamba layers;
                    T > 1: (batch, 2) int32 ring (start, count), shared, read only (the commit graph moves it)
 4. per attention layer i: k_cache_i, v_cache_i  (batch, kv_heads, max_seq_len, head_dim)  act
 5. per Mamba layer i:     T = 1: conv_state_i (batch, conv_dim, K) act (the last K inputs);
                           T > 1: conv_window_i (batch, conv_dim, K - 1 + num_draft) act,
                           ssm_state_i (batch, H, P, N) state dtype (the checkpoint S0),
                           [with a shadow: ssm_shadow_i (batch, H, P, N) bf16 / fp8, ssm_shadow_scale_i (fp8)],
                           x_cache_i (batch, H, L, P) act, B_cache_i (batch, G, L, N) act,
                           dt_cache_i (batch, H, L) fp32 (processed dt)

Graph outputs: T = 1: logits (batch, vocab) fp32, lengths_out = lengths + 1, cursor_out = (cursor + 1) % L;
T > 1: logits (batch, T, vocab) fp32 (verify commits nothing: no lengths or cursor output); then every state
tensor of 4-5 as ``<name>_out`` with the input's shape and dtype (in-place aliases in TensorRT).
:meth:`NemotronHDecodeStep.state_specs` lists them (builders/engine_format.py's state table).

Per Mamba layer: in_proj of the T tokens, the causal depthwise conv over [the last K - 1 committed inputs, the T
new ones] (the new conv state / window), silu, then ONE plugin node, then the model's gated RMSNorm with z and
out_proj. The node: T = 1, ``replayssm::mamba2_decode`` on the squeezed token (``reference.replay_decode``);
T > 1, ``replayssm::mamba2_verify`` (window outputs from checkpoint + committed ring history + the causal part
of the window; the window appended to the rings; the committed history folded into the checkpoint first when
count + 2T > L: trtllm_replayssm/cursor.py); with a checkpoint shadow the ``_shadow`` twin of either
(inputs and outputs then (shadow, shadow_scale)). Attention (Nemotron-H uses no positional encoding): the T new
K/V written at lengths + t with one-hot selects, query t attends keys j <= lengths + t; rejected speculative
positions leave K/V and ring entries beyond the committed range, never read and overwritten by later windows.
MoE layers (Nemotron 3) carry no state: :func:`builders.moe.moe_forward` in standard ops (sigmoid routing,
TopK, the routed experts in the ``moe_formulation`` the step was built with, and the shared expert), each of
the batch * T tokens routed on its own; transformers' own MoE module cannot be traced (its expert loop reads
the routing on the host, so a trace would freeze the experts of the tracing input). The default "dense"
formulation runs every expert on every token as two batched MatMuls over (E, ., .) constants weighted by a
(batch, E) routing mask: static shapes TensorRT builds as plain GEMMs, each expert matrix read once per step
whatever the batch; "gather" copies each token's k expert matrices and is cheaper only while 2·batch·k < E
(builders/moe.py has the numbers). MLP layers are the model's.

Export route: the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) with
``torch.autograd.Function.symbolic`` (:class:`PluginOp`). It emits exactly one custom node with our domain,
attributes and outputs per plugin call, and the Python ``forward`` (the reference backend) runs while
tracing. The torch.export-based exporter would need an onnxscript translation of a torch.library op for the
same node; the TorchScript route is the smaller one and works on torch 2.13 (with a DeprecationWarning).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trtllm_replayssm import backend as executors
from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import trt_plugin
from trtllm_replayssm.config import DTYPE_CODES, SUPPORTED_DSTATE, SUPPORTED_HEADDIM
from trtllm_replayssm.cursor import ORDER_COLUMNS
from trtllm_replayssm.families.mamba2 import steps as mamba2_steps
from trtllm_replayssm.families.mamba2 import trt_plugin as mamba2_plugin

from .engine_format import SHADOWS, layer_states
from .moe import FORMULATIONS, moe_forward
from .nemotron_h import _check_layers, has_moe, mamba_layers, reference_backend

DOMAIN = "replayssm"
OP_TYPE = "mamba2_decode"
SHADOW_OP_TYPE = "mamba2_decode_shadow"
VERIFY_OP_TYPE = "mamba2_verify"
VERIFY_SHADOW_OP_TYPE = "mamba2_verify_shadow"
_ONNX_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                     torch.int32: "int32", torch.int64: "int64", torch.float8_e4m3fn: "float8_e4m3fn"}
_TORCH_DTYPES = {n: t for t, n in _ONNX_DTYPE_NAMES.items()}
# config.json's ``model.moe`` of a Nemotron 3 engine: the MoE keys of its config (and the graph formulation)
MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
            "moe_latent_size", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "mlp_hidden_act")

# ``replayssm::mamba2_verify`` in float64 (what the kernel does): fold the committed history into the checkpoint
# where count + 2T > L (stored in the state dtype), then verify the window on the flushed cursor; caches written
# back in their own dtypes, the cursor not moved, y in x's dtype: the reference executor of
# trtllm_replayssm.backend in the launchers' keyword form (``reference_backend``, the T = 1 node's, is
# builders.nemotron_h's).
verify_reference_backend = mamba2_steps.replay_verify_kw(executors.REFERENCE)


# ---- plugin nodes ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PluginNode:
    """One ``replayssm::<op_type>`` node: its integer attributes (name, value) in the plugin's order (after
    ``plugin_namespace`` and ``aot``), for each output the index of the input whose type it has, and ``run``, the
    eager computation (inputs -> outputs, functional: state inputs are not written)."""

    op_type: str
    attrs: tuple[tuple[str, int], ...]
    like: tuple[int, ...]
    run: Callable


class PluginOp(torch.autograd.Function):
    """``PluginOp.apply(node, *inputs)``: ``node.run(*inputs)`` eagerly (the Python backend runs while tracing),
    exported as one ``node.op_type`` node of our domain with ``plugin_namespace``, ``aot = 1`` and ``node.attrs``
    (every plugin node of the exported steps and the commit graph)."""

    @staticmethod
    def forward(ctx, node, *inputs):
        return node.run(*inputs)

    @staticmethod
    def symbolic(g, node, *inputs):
        outs = g.op(f"{DOMAIN}::{node.op_type}", *inputs, plugin_namespace_s=DOMAIN, aot_i=1,
                    **{f"{k}_i": v for k, v in node.attrs}, outputs=len(node.like))
        outs = list(outs) if len(node.like) > 1 else [outs]
        for o, i in zip(outs, node.like):
            if node.op_type == ORDER_OP_TYPE:  # a new (batch, 4) int32 tensor, not its input's shape
                o.setType(inputs[i].type().with_sizes([None, ORDER_COLUMNS]))
            else:
                o.setType(inputs[i].type())
        return outs if len(outs) > 1 else outs[0]


ORDER_OP_TYPE = trt_plugin.ORDER_PLUGIN_NAME


def flush_order_node(state_batch_indices, cursor, buffer_len: int):
    """One ``replayssm::flush_order`` node (trtllm_replayssm/trt_plugin.py): the step's rows (batch, 4) in flush-first
    order, (row, slot, cursor, 0) each, which the step's decode nodes take as their rows input. Eager: the order kernel
    on CUDA (cursor_ops.flush_order), its host rule elsewhere (cursor.flush_order), bit for bit the same."""

    def run(sbi, cur):
        if sbi.is_cuda:
            from trtllm_replayssm import cursor_ops

            return cursor_ops.flush_order(cur, sbi, buffer_len)
        return cursors.flush_order(cur, sbi, buffer_len)

    node = PluginNode(ORDER_OP_TYPE, (("buffer_len", buffer_len),), (0,), run)
    return PluginOp.apply(node, state_batch_indices, cursor)


def mamba2_op_type(speculative: bool, shadow: bool) -> str:
    """The Mamba-2 node of a step: ``mamba2_decode`` (T = 1) or ``mamba2_verify`` (T > 1), ``_shadow`` with a
    checkpoint shadow; the name of its TensorRT plugin too (trtllm_replayssm.trt_plugin.PLUGINS)."""
    return (VERIFY_SHADOW_OP_TYPE if shadow else VERIFY_OP_TYPE) if speculative else (
        SHADOW_OP_TYPE if shadow else OP_TYPE)


def mamba2_node(ins, caches, op_type: str, attrs: dict, backend, fp8: bool = False):
    """One Mamba-2 node (``op_type``: :func:`mamba2_op_type`; ``attrs``: its integer attributes) on ``ins`` (x, B,
    C, dt, dt_bias, A, D, state_batch_indices, cursor; x, B, C, dt with a window axis for a verify node) and
    ``caches`` (state, x_cache, B_cache, dt_cache[, shadow, shadow_scale]): a shadow node's scale is the fp8
    shadow's per-row scales (``fp8``) or the bf16 shadow's (1,) placeholder, never read or written. Outputs (y,
    state, x_cache, B_cache, dt_cache[, shadow, shadow_scale]); TensorRT aliases all but y to their inputs, the
    eager run (``backend``) works on copies."""

    def run(x, B, C, dt, dt_bias, A, D, sbi, cursor, *cs):
        state, x_cache, B_cache, dt_cache, *sh = (t.clone() for t in cs)
        extra = {} if not sh else dict(shadow=sh[0], shadow_scale=sh[1] if fp8 else None)
        y = backend(state=state, x_cache=x_cache, B_cache=B_cache, dt_cache=dt_cache, cursor=cursor, x=x, B=B,
                    C=C, dt=dt, dt_bias=dt_bias, A=A, D=D, z=None, state_batch_indices=sbi, **extra)
        return (y.to(x.dtype), state, x_cache, B_cache, dt_cache, *sh)

    node = PluginNode(op_type, tuple(attrs.items()), (0,) + tuple(range(9, 9 + len(caches))), run)
    return PluginOp.apply(node, *ins, *caches)


# ---- the T-general layer pieces (this module's step and builders/qwen_export.py's) -------------------------
def window_conv(window, inputs, conv1d, K: int, T: int):
    """Causal depthwise conv of the T window inputs ``inputs`` (batch, T, C) over [the last K - 1 committed
    inputs (the window's last K - 1 columns), the T inputs]: (conv (batch, T, C) before the activation,
    the new window = the last W columns of [window, inputs]). ``window`` (batch, C, W = K - 1 + num_draft);
    W = K, T = 1 is the standard decode step's conv state. K and T are the step's Python ints, so the
    exported slices are constants and the new window keeps a static width."""
    u = inputs.transpose(1, 2).to(window.dtype)  # (batch, C, T)
    seq = torch.cat([window[:, :, -(K - 1):], u], dim=-1) if K > 1 else u
    weight = conv1d.weight.squeeze(1)
    conv = torch.stack([(seq[:, :, t:t + K] * weight).sum(-1) for t in range(T)], dim=1)
    if conv1d.bias is not None:
        conv = conv + conv1d.bias
    return conv, torch.cat([window, u], dim=-1)[:, :, T:]


def mamba2_mixer(mx, h, T: int, conv, ssm):
    """The Nemotron-H Mamba-2 mixer around a pluggable conv update and SSM step, written once for this
    module's exported steps (standard and speculative); builders/model_step.py's fused regions are the engine-speed form of
    the same math. ``mx`` transformers' mixer module, h (batch, T, D) normed input, T the step's Python int
    (a constant in the exported graph).

    in_proj -> (z, xBC, dt); ``conv(xBC)`` -> (silu(conv) in h's dtype, conv extra); x, B, C split and shaped
    (batch, T, H, P) / (batch, T, G, N); ``ssm(x, B, C, dt)`` -> (y (batch, T, H, P), ssm extra); the gated
    RMSNorm of y by z; out_proj. Returns (out (batch, T, D), conv extra, ssm extra)."""
    b = h.shape[0]
    H, P, N, G = mx.num_heads, mx.head_dim, mx.ssm_state_size, mx.n_groups
    gate, xBC, dt = mx.in_proj(h).split([mx.intermediate_size, mx.conv_dim, H], dim=-1)
    u, conv_extra = conv(xBC)
    x, B, C = u.split([mx.intermediate_size, G * N, G * N], dim=-1)
    y, ssm_extra = ssm(x.reshape(b, T, H, P), B.reshape(b, T, G, N), C.reshape(b, T, G, N), dt)
    out = mx.out_proj(mx.norm(y.reshape(b, T, H * P), gate).to(h.dtype))
    return out, conv_extra, ssm_extra


def window_attention(q, k, v, k_cache, v_cache, lengths, scaling, T: int, max_seq_len: int):
    """Attention of T window queries over a dense KV cache: the T new K/V written at lengths + t (one-hot
    selects: exact copies, no arithmetic on the cache), query t attends keys j <= lengths + t.
    q (batch, nh, T, hd); k, v (batch, kvh, T, hd); caches (batch, kvh, max_seq_len, hd); T and max_seq_len
    the step's Python ints (constant positions in the exported graph).
    Returns (o (batch, nh, T, hd), k_cache, v_cache)."""
    pos = torch.arange(max_seq_len, device=q.device)
    at = lengths.long()[:, None] + torch.arange(T, device=q.device)[None, :]  # (batch, T) new positions
    for t in range(T):
        here = (pos[None, :] == at[:, t:t + 1])[:, None, :, None]
        k_cache = torch.where(here, k[:, :, t:t + 1].to(k_cache.dtype), k_cache)
        v_cache = torch.where(here, v[:, :, t:t + 1].to(v_cache.dtype), v_cache)
    return grouped_attention(q, k_cache, v_cache, at, scaling, pos, T), k_cache, v_cache


def grouped_attention(q, k_cache, v_cache, at, scaling, pos=None, T: int | None = None):
    """Softmax attention of queries q (batch, nh, T, hd) over caches (batch, kvh, S, hd): query t of row b sees
    positions <= at[b, t] (at (batch, T)); softmax in fp32, probabilities in q's dtype. Grouped queries: head h
    reads KV head h // (nh / kvh); the query heads of a KV head share one matmul with its cache (broadcast over a
    size-1 dim), so no copy of the KV cache per query head is made (nor put in an exported graph). ``pos``:
    arange(S) on q's device (made here if None); ``T``: the number of queries as a Python int (a constant in an
    exported graph; q.shape[2] if None). Returns (batch, nh, T, hd). The exported steps
    (:func:`window_attention`) attend here."""
    nh, hd = q.shape[1], q.shape[3]
    T = q.shape[2] if T is None else T
    kvh = k_cache.shape[1]
    rep = nh // kvh
    if pos is None:
        pos = torch.arange(k_cache.shape[2], device=q.device)
    qg = q.reshape(-1, kvh, rep, T, hd)
    scores = torch.matmul(qg, k_cache.transpose(2, 3)[:, :, None]) * scaling  # (batch, kvh, rep, T, S)
    visible = (pos[None, None, :] <= at[:, :, None])[:, None, None]  # (batch, 1, 1, T, S)
    scores = torch.where(visible, scores, torch.full_like(scores, torch.finfo(scores.dtype).min))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v_cache[:, :, None]).reshape(-1, nh, T, hd)


@dataclasses.dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple  # batch as -1
    dtype: torch.dtype
    output: str

    def to_json(self) -> dict:
        return dict(name=self.name, shape=list(self.shape), dtype=_ONNX_DTYPE_NAMES[self.dtype], output=self.output)


def layer_state_specs(letter: str, layer: int, sizes: dict, dtypes: dict, speculative: bool = False,
                      shadow: str = "none") -> list[StateSpec]:
    """The state tensors of layer ``layer`` (pattern letter ``letter``) as the engine-directory format lists them
    (builders/engine_format.py's LAYER_STATES, the one table of names, shapes and dtypes), with the sizes of
    ``sizes`` and the torch dtypes of the roles in ``dtypes`` (``act``, ``state``)."""
    return [StateSpec(s.name(layer), s.shape(sizes), dtypes[s.dtype] if s.dtype in dtypes else _TORCH_DTYPES[s.dtype],
                      s.output(layer)) for s in layer_states(letter, speculative, shadow)]


def rotate_rings(rings, start) -> list[torch.Tensor]:
    """Standard buffers (slots, heads, L, ...) (entry j at index j) as rings starting at ``start`` (slots,):
    entry j moves to index (start + j) % L, for every slot."""
    return [torch.stack([torch.roll(t[b], int(start[b]), dims=1) for b in range(t.shape[0])]) for t in rings]


def ring_cursor_and_windows(step, decoder, cache, start, conv_layers) -> tuple[torch.Tensor, dict]:
    """The verify graph's cursor (batch, 2) and conv windows equivalent to a patched model (``decoder`` with
    the step's buffer length and a (batch,) ``cursor`` = entries in its standard buffer, ``cache`` its
    transformers cache): ring start ``start`` (int or (batch,)), count = the decoder's cursor; each conv
    window (batch, conv_dim, W) holds the last K - 1 inputs of the cache's conv state (the last K inputs,
    newest last) in its last K - 1 columns. Returns (cursor, {layer: window}); ``start`` as a (batch,) tensor
    is ``cursor[:, 0]``."""
    if decoder.buffer_len != step.buffer_len:
        raise ValueError(f"decoder: buffer_len {decoder.buffer_len} differs from the step's {step.buffer_len}")
    count = decoder.cursor.to(torch.int32)
    batch = count.shape[0]
    if int(count.max()) > step.buffer_len - step.num_tokens:
        raise ValueError(f"decoder.cursor: a verify window needs count <= L - T = "
                         f"{step.buffer_len - step.num_tokens}, got {count.tolist()}")
    start = torch.as_tensor(start, dtype=torch.int32).expand(batch) % step.buffer_len
    windows = {}
    for i in conv_layers:
        conv = cache.get_conv_state(i)
        K = conv.shape[2]
        window = conv.new_zeros((batch, conv.shape[1], step.window))
        window[:, :, step.window - (K - 1):] = conv[:, :, 1:]
        windows[i] = window
    return torch.stack([start, count], dim=1), windows


def check_window(num_draft: int, buffer_len: int) -> int:
    """T = 1 + ``num_draft`` of a step, checked against its buffer length: standard decode (num_draft = 0)
    takes L in 1..32; a speculative verify flushes one window early, so 2T <= L <= 32."""
    if num_draft < 0:
        raise ValueError(f"num_draft: expected >= 0 (0: standard decode), got {num_draft}")
    T = num_draft + 1
    if num_draft == 0 and not 1 <= buffer_len <= 32:
        raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
    if num_draft and not 2 * T <= buffer_len <= 32:
        raise ValueError(f"buffer_len: expected in [2 (num_draft + 1), 32] = [{2 * T}, 32] (flush one window early), "
                         f"got {buffer_len}")
    return T


class StepIO:
    """The engine I/O and the forward every step with explicit state shares (Nemotron-H and Qwen3-Next /
    Qwen3.5, standard decode and speculative verify): the window (:meth:`_set_tokens`), names, zero states, the
    states equivalent to a patched model, the K/V of a transformers cache. Subclasses call ``_set_tokens`` and
    give ``state_specs()``, ``max_seq_len``, ``kinds`` (``"linear_attention"`` = an SSM layer), ``_layers`` and
    ``_patched_ssm`` (a layer's checkpoint and standard buffers in the patched model)."""

    # The step's decode nodes read their rows from one replayssm::flush_order node (set_row_order); a step class whose
    # plain decode plugin takes no order (Mamba-2's mamba2_decode: the persistent kernel) sets ORDER_NEEDS_SHADOW.
    row_order = False
    ORDER_NEEDS_SHADOW = False

    def set_row_order(self, on: bool) -> None:
        """With ``on``, the step's graph gets one ``replayssm::flush_order`` node before its first recurrent layer,
        whose (batch, 4) output every decode node takes as its rows (the long flushing blocks first; trt_plugin's
        module docstring). Outputs are those without it, bit for bit. Standard decode only (the verify plugins take
        (batch,) rows)."""
        if not isinstance(on, bool):
            raise TypeError(f"row_order: expected a bool, got {on!r}")
        if on and self.speculative:
            raise ValueError("row_order: the flush-first order feeds the standard decode nodes (num_draft 0); the "
                             f"verify plugins take (batch,) rows, got num_draft={self.num_draft}")
        if on and self.ORDER_NEEDS_SHADOW and self.shadow == "none":
            raise ValueError(f"row_order: {self.op_type} takes no order (its kernel walks items, not rows): the order "
                             "needs a checkpoint shadow (--shadow bf16 or fp8)")
        self.row_order = on

    def _rows(self, batch: int, cursor, device):
        """The rows input of the step's decode nodes: arange(batch) (per-row state), or its flush-first order."""
        sbi = torch.arange(batch, dtype=torch.int32, device=device)
        return flush_order_node(sbi, cursor, self.buffer_len) if self.row_order else sbi

    def _set_tokens(self, num_draft: int, buffer_len: int, conv_kernel: int) -> None:
        """``num_draft``, ``num_tokens`` = T (:func:`check_window`), ``speculative`` (T > 1) and ``window``, the
        conv state's width: the last K inputs at T = 1, a window of K - 1 + num_draft at T > 1."""
        self.num_tokens = check_window(num_draft, buffer_len)
        self.num_draft, self.speculative = num_draft, num_draft > 0
        self.window = conv_kernel - 1 + num_draft if self.speculative else conv_kernel

    def input_names(self) -> list[str]:
        return ["input_ids", "lengths", "cursor"] + [s.name for s in self.state_specs()]

    def output_names(self) -> list[str]:
        shared = ["logits"] if self.speculative else ["logits", "lengths_out", "cursor_out"]
        return shared + [s.output for s in self.state_specs()]

    def empty_states(self, batch: int, device="cpu") -> list[torch.Tensor]:
        return [torch.zeros((batch, *s.shape[1:]), dtype=s.dtype, device=device) for s in self.state_specs()]

    def forward(self, input_ids, lengths, cursor, *states):
        """Standard decode: (logits (batch, vocab), lengths + 1, (cursor + 1) % L, states). Speculative verify:
        (logits (batch, T, vocab), states); lengths and cursor are read only (the commit graph moves them)."""
        if self.speculative and input_ids.shape[1] != self.num_tokens:
            raise ValueError(f"input_ids: expected (batch, {self.num_tokens}) (1 + num_draft tokens), "
                             f"got {tuple(input_ids.shape)}")
        logits, new_states = self._layers(input_ids, lengths, cursor, states)
        if self.speculative:
            return (logits, *new_states)
        return (logits[:, 0], lengths + 1, torch.remainder(cursor + 1, self.buffer_len).to(torch.int32), *new_states)

    def states_from_patched(self, decoder, cache, lengths: int, start=0):
        """State inputs equivalent to a patched model after prefill/decode (``decoder`` = the patched model's
        ReplaySSM decoder with the same buffer length, ``cache`` its transformers cache holding ``lengths``
        tokens for every row). Speculative steps return (cursor (batch, 2), states): the standard buffer
        (entries 0..k-1) is the ring with count k, rotated to ring start ``start`` (int or (batch,); any
        start is valid); standard steps return the states (the cursor is the decoder's)."""
        ssm = [i for i, kind in enumerate(self.kinds) if kind == "linear_attention"]
        if self.speculative:
            cursor, conv = ring_cursor_and_windows(self, decoder, cache, start, ssm)
        else:
            cursor, conv = None, {i: cache.get_conv_state(i).clone() for i in ssm}
        out = []
        for i, kind in enumerate(self.kinds):
            if kind == "full_attention":
                out += self._kv_states(cache, i, lengths)
            elif kind == "linear_attention":
                state, rings = self._patched_ssm(decoder, i)
                rings = rotate_rings(rings, cursor[:, 0]) if self.speculative else [t.clone() for t in rings]
                out += [conv[i], state.clone(), *self._shadow_of(state), *rings]
        return out if cursor is None else (cursor, out)

    def _shadow_of(self, state) -> list[torch.Tensor]:
        """The checkpoint shadow state(s) of a layer whose checkpoint is ``state``: [] without a shadow, [q] for bf16,
        [q, per-row scale] for fp8 (the one quantizer, as the kernels store it)."""
        if self.shadow == "none":
            return []
        from trtllm_replayssm.shadow import Shadow

        sh = Shadow.of(state, self.shadow)
        return [sh.q] if sh.scale is None else [sh.q, sh.scale]

    def _kv_states(self, cache, i: int, lengths: int) -> list[torch.Tensor]:
        """Layer i's K and V from a transformers cache holding ``lengths`` tokens, padded to max_seq_len."""
        out = []
        for t in (cache.layers[i].keys, cache.layers[i].values):
            buf = t.new_zeros((t.shape[0], t.shape[1], self.max_seq_len, t.shape[3]))
            buf[:, :, :lengths] = t[:, :, :lengths]
            out.append(buf)
        return out


class NemotronHDecodeStep(StepIO, torch.nn.Module):
    """The step of T = 1 + ``num_draft`` tokens of a (loaded, unpatched or patched) ``NemotronHForCausalLM``;
    shares its weights. ``num_draft = 0``: standard decode; ``num_draft`` > 0: the speculative verify graph
    (module docstring), whose commit graph is ``spec_step.NemotronHSpecCommit(step)``. ``backend``: the SSM
    node's eager computation (default: the float64 reference of the node, decode or verify)."""

    ORDER_NEEDS_SHADOW = True  # mamba2_decode runs the persistent kernel; mamba2_decode_shadow reads the order

    def __init__(self, model, buffer_len: int, max_seq_len: int, state_dtype: torch.dtype = torch.float32,
                 backend=None, moe_formulation: str = "dense", shadow: str = "none", num_draft: int = 0):
        super().__init__()
        _check_layers(model.config)
        if shadow not in SHADOWS:
            raise ValueError(f"shadow: expected one of {SHADOWS} (a shadow of an fp32 checkpoint), got {shadow!r}")
        if shadow != "none" and state_dtype != torch.float32:
            raise ValueError(f"shadow: a checkpoint shadow is of an fp32 checkpoint, got state_dtype={state_dtype}")
        self.shadow = shadow
        # the shadow node's (1,) fp32 scale placeholder of a bf16 shadow (never read or written)
        self.register_buffer("shadow_scale_placeholder", torch.ones(1), persistent=False)
        if moe_formulation not in FORMULATIONS:
            raise ValueError(f"moe_formulation: expected one of {FORMULATIONS}, got {moe_formulation!r}")
        self.moe_formulation = moe_formulation
        self._set_tokens(num_draft, buffer_len, model.config.conv_kernel)
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
        self.model = model
        self.config = cfg = model.config
        self.buffer_len, self.max_seq_len, self.state_dtype = buffer_len, max_seq_len, state_dtype
        self.backend = backend or (verify_reference_backend if self.speculative else reference_backend)
        self.act_dtype = next(model.parameters()).dtype
        self.kinds = list(cfg.layers_block_type)
        # Per-head SSM constants in fp32 (constants of the graph; A is not computed in the graph).
        for i, kind in enumerate(self.kinds):
            if kind == "linear_attention":
                mx = model.model.layers[i].mixer
                self.register_buffer(f"A_{i}", -torch.exp(mx.A_log.detach().float()), persistent=False)
                self.register_buffer(f"D_{i}", mx.D.detach().float().clone(), persistent=False)
                self.register_buffer(f"dt_bias_{i}", mx.dt_bias.detach().float().clone(), persistent=False)

    @classmethod
    def for_build(cls, model, *, buffer_len: int, max_seq_len: int, state_dtype: torch.dtype, moe_formulation: str,
                  shadow: str, num_draft: int) -> NemotronHDecodeStep:
        """The step of an engine build (builders/models.py's export step protocol)."""
        return cls(model, buffer_len, max_seq_len, state_dtype, moe_formulation=moe_formulation, shadow=shadow,
                   num_draft=num_draft)

    # ---- the engine directory (builders/models.py's export step protocol) -------------------------------------
    def ssm_layers(self) -> list[int]:
        return mamba_layers(self.model)

    def plugin_geometry(self) -> tuple[int, int, int, int]:
        """(nheads, headdim, dstate, ngroups) of the Mamba-2 plugin kernels; ValueError naming the config key."""
        cfg = self.config
        H, P, N, G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        if P not in SUPPORTED_HEADDIM:
            raise ValueError(f"mamba_head_dim: the plugin supports {SUPPORTED_HEADDIM}, got {P}")
        if N not in SUPPORTED_DSTATE:
            raise ValueError(f"ssm_state_size: the plugin supports {SUPPORTED_DSTATE}, got {N}")
        if H % G:
            raise ValueError(f"n_groups: expected a divisor of mamba_num_heads={H}, got {G}")
        return H, P, N, G

    def plugin_kernel(self, tactic: int, arch: int, sm_count: int):
        """The PTX and launch of the step's Mamba-2 node for ``tactic`` (families/mamba2/trt_plugin's aot_impl; standard
        engines: the persistent grid of ``sm_count`` SMs)."""
        H, P, N, G = self.plugin_geometry()
        act, state, L = DTYPE_CODES[self.act_dtype], DTYPE_CODES[self.state_dtype], self.buffer_len
        if self.speculative:
            return mamba2_plugin.aot_verify_kernel(H, P, N, G, L, self.num_tokens, state, act, arch, tactic, self.shadow)
        return mamba2_plugin.aot_kernel(H, P, N, G, L, state, act, arch, tactic, sm_count, self.shadow, self.row_order)

    def plugin_keys(self, sm_count: int) -> dict:
        """config.json's plugin keys after the node's attributes: a standard engine's persistent grid size."""
        return {} if self.speculative else dict(sm_count=sm_count)

    def describe(self) -> list[str]:
        cfg = self.config
        H, P, N, G = self.plugin_geometry()
        lines = [f"{cfg.hybrid_override_pattern!r}: {len(self.ssm_layers())} Mamba layers, nheads={H} headdim={P} "
                 f"dstate={N} ngroups={G}"]
        if has_moe(cfg):
            lines.append(f"{list(cfg.layers_block_type).count('moe')} MoE layers: {cfg.n_routed_experts} experts, top-"
                         f"{cfg.num_experts_per_tok}, as {self.moe_formulation} standard ONNX ops (builders/moe.py)")
        return lines

    def model_entry(self) -> dict:
        """config.json's ``model`` after source, seed and model_type: pattern, sizes, the layers by type; the MoE
        configuration (its config keys and the graph formulation) where the model has MoE layers."""
        cfg = self.config
        kinds = list(cfg.layers_block_type)
        entry = dict(pattern=cfg.hybrid_override_pattern, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     layer_types=kinds, mamba_layers=self.ssm_layers(),
                     attention_layers=[i for i, k in enumerate(kinds) if k == "full_attention"],
                     moe_layers=[i for i, k in enumerate(kinds) if k == "moe"])
        if has_moe(cfg):
            entry["moe"] = dict({k: getattr(cfg, k) for k in MOE_KEYS}, formulation=self.moe_formulation)
        return entry

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
                specs += layer_state_specs(letters[kind], i, sizes, dtypes, self.speculative, self.shadow)
        return specs

    def _patched_ssm(self, decoder, i: int):
        """Mamba layer i of a patched model (ReplaySSMDecoder): (checkpoint, standard buffers x, B, dt)."""
        c = decoder.caches[i]
        return c["state"].to(self.state_dtype), (c["x_cache"], c["B_cache"], c["dt_cache"])

    # ---- the SSM node --------------------------------------------------------------------------------
    @property
    def op_type(self) -> str:
        """The op type of the step's Mamba-2 nodes, the name of their TensorRT plugin (:func:`mamba2_op_type`)."""
        return mamba2_op_type(self.speculative, self.shadow != "none")

    def plugin_attributes(self) -> dict:
        """The integer attributes of the step's Mamba-2 nodes in the plugin's order (config.json's too)."""
        cfg = self.config
        return dict(nheads=cfg.mamba_num_heads, headdim=cfg.mamba_head_dim, dstate=cfg.ssm_state_size,
                    ngroups=cfg.n_groups, buffer_len=self.buffer_len,
                    **({"num_tokens": self.num_tokens} if self.speculative else {}))

    # ---- the layers, on (batch, T, D) -----------------------------------------------------------------
    def _attention(self, layer, h, k_cache, v_cache, lengths):
        cfg, att, batch, T = self.config, layer.mixer, h.shape[0], self.num_tokens
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = att.q_proj(h).view(batch, T, nh, hd).transpose(1, 2)
        k = att.k_proj(h).view(batch, T, kvh, hd).transpose(1, 2)
        v = att.v_proj(h).view(batch, T, kvh, hd).transpose(1, 2)
        o, k_cache, v_cache = window_attention(q, k, v, k_cache, v_cache, lengths, att.scaling, T, self.max_seq_len)
        return att.o_proj(o.transpose(1, 2).reshape(batch, T, nh * hd)), k_cache, v_cache

    def _mamba(self, i, layer, h, window, ssm_states, cursor, sbi):
        """Mamba layer i: (out, [new window, *new caches]); ``ssm_states`` its states after the conv state in
        state_specs' order (checkpoint[, shadow[, scales]], x, B, dt)."""
        mx, T = layer.mixer, self.num_tokens

        def conv(xBC):
            c, new_window = window_conv(window, xBC, mx.conv1d, self.config.conv_kernel, T)
            return F.silu(c).to(h.dtype), new_window

        def ssm(x, B, C, dt):
            y, *caches = self._ssm_op(x, B, C, dt, getattr(self, f"dt_bias_{i}"), getattr(self, f"A_{i}"),
                                      getattr(self, f"D_{i}"), sbi, cursor, tuple(ssm_states))
            return y, caches

        out, new_window, caches = mamba2_mixer(mx, h, T, conv, ssm)
        return out, [new_window, *caches]

    def _ssm_op(self, x, B, C, dt, dt_bias, A, D, sbi, cursor, caches):
        """One Mamba-2 plugin node (:func:`mamba2_node`: decode on the squeezed token at T = 1, verify of the
        window at T > 1) on a layer's caches in state order (checkpoint[, shadow[, fp8 scales]], x, B, dt):
        (y (batch, T, H, P), the caches in that order). A bf16 shadow's scale input is the (1,) placeholder."""
        if self.shadow == "fp8":  # the per-row scales are a state
            state, shadow, scale, *rings = caches
        elif self.shadow == "bf16":
            (state, shadow, *rings), scale = caches, self.shadow_scale_placeholder
        else:
            state, *rings = caches
        ins = (x, B, C, dt) if self.speculative else (x[:, 0], B[:, 0], C[:, 0], dt[:, 0])
        node_caches = (state, *rings) + (() if self.shadow == "none" else (shadow, scale))
        y, state, *rest = mamba2_node((*ins, dt_bias, A, D, sbi, cursor), node_caches, self.op_type,
                                      self.plugin_attributes(), self.backend, fp8=self.shadow == "fp8")
        shadows = rest[3:4] if self.shadow == "bf16" else rest[3:]  # a bf16 shadow's placeholder is no state
        return (y if self.speculative else y[:, None], state, *shadows, *rest[:3])

    def _layers(self, input_ids, lengths, cursor, states):
        """(logits (batch, T, vocab) fp32, new states) of the T tokens ``input_ids`` (batch, T)."""
        m = self.model.model
        h = m.embeddings(input_ids)
        sbi = self._rows(h.shape[0], cursor, h.device)
        new_states, k = [], 0
        for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
            res = h
            hn = layer.norm(h.to(layer.norm.weight.dtype))
            if kind == "full_attention":
                out, kc, vc = self._attention(layer, hn, states[k], states[k + 1], lengths)
                new_states += [kc, vc]
                k += 2
            elif kind == "linear_attention":
                n = 5 + {"none": 0, "bf16": 1, "fp8": 2}[self.shadow]  # conv, checkpoint[, shadow[, scale]], x, B, dt
                out, st = self._mamba(i, layer, hn, states[k], states[k + 1:k + n], cursor, sbi)
                new_states += st
                k += n
            elif kind == "moe":
                out = moe_forward(hn, layer.mixer, self.moe_formulation)
            else:
                out = layer.mixer(hn)
            h = res + out
        return self.model.lm_head(m.norm_f(h)).float(), new_states


def export_graph(module, args, path, opset: int = 17) -> None:
    """Trace ``module`` (a step with ``input_names`` / ``output_names``) on ``args`` and write ONNX with a dynamic
    batch dimension on every input and output (TorchScript route, module docstring).

    The tracer leaves some output dims symbolic where the T-general layers reshape through traced sizes;
    ONNX shape inference with data propagation resolves them, and every state output is then checked
    against its :class:`StateSpec` (batch symbolic, every other dim and the dtype as declared), so the
    file's I/O is exactly the contract that build_engine writes to config.json."""
    import onnx

    if opset < 17:
        raise ValueError(f"opset: expected >= 17, got {opset}")
    names_in, names_out = module.input_names(), module.output_names()
    dyn = {n: {0: "batch"} for n in names_in + names_out}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings from the Python reference; DeprecationWarning of the route
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=opset, input_names=names_in,
                          output_names=names_out, dynamic_axes=dyn, custom_opsets={DOMAIN: 1},
                          do_constant_folding=True)
    # by path: a real model's graph is over protobuf's 2 GB and keeps its weights in external data files
    onnx.shape_inference.infer_shapes_path(str(path), str(path), data_prop=True)
    model = onnx.load(str(path), load_external_data=False)
    outputs = {v.name: v.type.tensor_type for v in model.graph.output}
    for spec in module.state_specs():
        got = outputs[spec.output]
        dims = [d.dim_param or d.dim_value for d in got.shape.dim]
        want = ["batch", *spec.shape[1:]]
        if dims != want or onnx.helper.tensor_dtype_to_np_dtype(got.elem_type).name != spec.to_json()["dtype"]:
            raise RuntimeError(f"export: output {spec.output} is {dims} "
                               f"{onnx.helper.tensor_dtype_to_np_dtype(got.elem_type)}, the state contract says "
                               f"{want} {spec.to_json()['dtype']}")


def export_onnx(step, path, commit_path=None, batch: int = 2, opset: int = 17) -> None:
    """The one export of every step with explicit state I/O (this module's or builders/qwen_export.py's, any T):
    trace ``step`` on zero states of ``batch`` rows and write its graph to ``path`` (an engine's model.onnx at
    T = 1, verify.onnx at T > 1) and, for a speculative step, its commit graph (builders/spec_step.py) to
    ``commit_path``; ONNX with a dynamic batch dimension (:func:`export_graph`)."""
    if opset < 17:
        raise ValueError(f"opset: expected >= 17, got {opset}")
    if step.speculative != (commit_path is not None):
        why = ("a speculative step (num_draft > 0) writes its commit graph too" if step.speculative else
               "a standard decode step (num_draft = 0) has no commit graph")
        raise ValueError(f"commit_path: {why}, got {commit_path!r}")
    dev = next(step.parameters()).device
    ids = torch.ones(batch, step.num_tokens, dtype=torch.int64, device=dev)
    lengths = torch.zeros(batch, dtype=torch.int32, device=dev)
    cursor = torch.zeros((batch, 2) if step.speculative else (batch,), dtype=torch.int32, device=dev)
    states = step.empty_states(batch, dev)
    export_graph(step, (ids, lengths, cursor, *states), path, opset)
    if step.speculative:
        from .spec_step import NemotronHSpecCommit

        windows = [t for s, t in zip(step.state_specs(), states) if s.name.startswith("conv_window_")]
        n = torch.ones(batch, dtype=torch.int32, device=dev)
        export_graph(NemotronHSpecCommit(step), (n, cursor, lengths, *windows), commit_path, opset)
