# SPDX-License-Identifier: Apache-2.0
"""Kimi-Linear's decode steps (transformers' ``KimiLinearForCausalLM``): the generation engine's, :class:`KimiStep`,
and the engine directory's, :class:`KimiKDADecodeStep` (below), the two steps of its entry in builders/models.py.

:class:`KimiStep`: one token for every row, rows = slots, with the step interface of
:class:`builders.qwen_step.QwenStep` (its rows, slot hand-off and host save / load are inherited unchanged) that
:class:`builders.generation.Engine` drives.

In-place state, allocated once for ``batch`` slots of ``kv_len`` positions: ``ids`` (batch,) int64 (the input token;
the greedy next token after a call), ``lengths`` (batch,) int64 (tokens in the K/V rows = the input's position),
``sbi`` (batch,) int32 (the row's slot, -1: a padding row that touches no KDA state or conv window), ``logits``
(batch, vocab), per MLA layer its compressed cache as transformers keeps it: ``k[i]`` the normalised latent
(batch, 1, kv_len, kv_lora_rank), ``v[i]`` the shared rope part of the key (batch, 1, kv_len, qk_rope_head_dim),
per KDA layer a conv window (slots + 1, 3 H K, K_conv - 1) over q | k | v (slot ``batch`` is the scratch row padding
rows write), and the SSM mode's state. ``kda`` lists the KDA layers (``gdn``, the name of the recurrent layers in
the inherited QwenStep methods, is the same list).

Per call (pre-norm blocks with residuals, as ``KimiLinearDecoderLayer`` runs them):

  embed   transformers' ``embed_tokens``
  KDA     q | k | v projections; their causal conv over the slot's window (``cache.conv_update_rows``, silu: the
          conv math of every family's windows); f = f_b(f_a(x)) raw, b = b_proj(x) raw; the KDA step of the SSM
          mode (g = -exp(A_log) softplus(f + dt_bias) and beta = sigmoid(b) inside, q and k l2-normalised inside,
          q scaled by K^-1/2: transformers' ``recurrent_kimi_delta_attention(use_qk_l2norm_in_kernel=True)``);
          the layer's sigmoid-gated RMSNorm ``o_norm`` with g_b(g_a(x)); ``o_proj``
  MLA     transformers' ``KimiLinearAttention`` projections (q, or q_a / q_a_layernorm / q_b; kv_a_proj_with_mqa,
          kv_a_layernorm), the new latent written at the row's position, the keys and values of every position from
          the module's own ``expand_kv``, the model's attention interface (``config._attn_implementation``: sdpa /
          eager) with a per-row mask (positions <= the row's): the rows are at different lengths. Kimi's MLA is
          NoPE (transformers applies no rotary embedding), so a position only bounds what a row sees.
  then    post-attention norm and transformers' MLP / MoE module; norm, lm_head

SSM modes (``mode``, the engine's names): "conventional" (an fp32 state (slots, H, K, V) per layer read and written
every step: ``families/kda/reference.conventional_step`` (float64) on the CPU, ``families/kda/ops.
kda_conventional_step`` on CUDA), "replay" (ReplaySSM on a standard-cursor KDA :class:`~trtllm_replayssm.cache.
ReplayStateCache`, ``ReplayStateCache.for_family("kda", ...)``: fp32 checkpoint, rings of L entries (u in bf16,
DESIGN §5), the step that fills them folds exactly), "replay_bf16" (the same with a bf16 shadow of the checkpoint
that non-flush steps read). There is no fp8 KDA shadow: "replay_fp8" is refused. The step keeps the conv windows
(``conv_dim=0`` in the cache), as QwenStep does, so both modes share them. The prefill hand-off
(:meth:`KimiStep.load_prefill_row`) reads row r of transformers' cache after the model's own batched forward: the
last K - 1 conv inputs, the final recurrent state ((H, K, V) fp32: the checkpoint's layout, no transpose), the
prompt's MLA latents (ReplaySSM: ``ReplayStateCache.load_prefill``, the checkpoint with empty rings).

The step is eager (``capturable = False``): transformers' MoE block picks its experts with data-dependent shapes.

The engine directory's step (builders/engine.py through builders/models.py): :class:`KimiKDADecodeStep`, the step
of T = 1 + ``num_draft`` tokens per row as a module with explicit state I/O, in the form every family's export step
has (builders/decode_step.py's ``StepIO``): ``num_draft = 0`` the standard decode step (model.onnx), ``num_draft`` > 0
the verify graph of speculative decoding (verify.onnx), whose commit graph is the shared one of builders/spec_step.py
(``NemotronHSpecCommit``: one ``replayssm::spec_commit`` node, lengths += n, the conv windows rolled back; the commit
is a cursor move, rejected ring entries are overwritten by later windows). Its ONNX export is
builders/decode_step.py's :func:`~builders.decode_step.export_onnx`, the one of every step.

Graph inputs (row b of the batch is slot b: state_batch_indices = arange(batch) inside):

 1. input_ids       (batch, T) int64       T = 1; T > 1: the last sampled token, then the num_draft drafts
 2. lengths         (batch,) int32         tokens already in the latent caches; the T new ones are written at
                                           lengths .. lengths + T - 1 (the caller keeps lengths + T <= max_seq_len)
 3. cursor          T = 1: (batch,) int32  ReplaySSM ring fill, shared by all KDA layers;
                    T > 1: (batch, 2) int32 ring (start, committed count), shared, read only
 4. per KDA layer i (pattern letter K): T = 1: conv_state_i (batch, 3 H K, K_conv) act (the last K_conv inputs of
    [q | k | v]); T > 1: conv_window_i (batch, 3 H K, K_conv - 1 + num_draft) act; kda_state_i (batch, H, K, V) fp32
    (the checkpoint S0), [kda_shadow_i (batch, H, K, V) bf16 with a shadow], kda_k_i (batch, H, L, K) act,
    kda_u_i (batch, H, L, V) bf16, kda_g_i (batch, H, L, K) fp32, kda_v_i (batch, H, L, V) act,
    kda_beta_i (batch, H, L) fp32   (trtllm_replayssm/families/kda's state table)
 5. per MLA layer i (pattern letter A): mla_kv_i (batch, max_seq_len, kv_lora_rank) act (the kv_a_layernorm'd
    latent), mla_k_rope_i (batch, max_seq_len, qk_rope_head_dim) act (the shared rope part of the key)

Graph outputs: T = 1: logits (batch, vocab) fp32, lengths_out = lengths + 1, cursor_out = (cursor + 1) % L;
T > 1: logits (batch, T, vocab) fp32 (verify commits nothing: no lengths or cursor output); then every state tensor
as ``<name>_out`` (in-place aliases in TensorRT). builders/engine_format.py's K and A rows.

Per KDA layer (as KimiStep and transformers' decode): [q | k | v] projections of the T tokens, the causal conv over
[the last K_conv - 1 committed inputs, the T new ones] (``decode_step.window_conv``), silu; f = f_b(f_a(x)) and
b = b_proj(x) raw; ONE plugin node (g, beta, the l2 norm of q and k and q's K^-1/2 scale inside; ``_shadow`` with a
bf16 shadow): T = 1 ``replayssm::kda_decode`` on the squeezed token (its reference ``families/kda/onnx_ops.
decode_node``), T > 1 ``replayssm::kda_verify`` on the window (the committed entries folded into the checkpoint
first where count + 2T > L, the window's outputs, the window appended to the rings; ``onnx_ops.verify_node``); the
layer's sigmoid-gated RMSNorm with g_b(g_a(x)); o_proj. MLA (Kimi's is NoPE: a position only bounds what a row
sees): the queries (q_proj, or q_a / q_a_layernorm / q_b), the T new latents and rope keys written at lengths + t
with one-hot selects, keys and values of every position expanded by kv_b_proj, query t attends positions
<= lengths + t (softmax in fp32), o_proj; rejected speculative positions leave latents beyond the committed length,
never read and overwritten by later windows. MoE layers (sigmoid routing with the correction bias, groups, top-k,
renormalised and scaled: builders/moe.py's ``route``; the gated experts in the step's ``moe_formulation``,
``moe.gated_experts``; transformers' shared experts MLP), each of the batch * T tokens routed on its own, static
shapes; dense MLPs and norms are the model's.

GLM-5 Next (``glm5_next``): builders/glm5_step.py ``Glm5Step``, this step with its DSA attention and hyper-connections.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from trtllm_replayssm import backend as executors
from trtllm_replayssm import trt_plugin
from trtllm_replayssm.cache import ReplayStateCache, conv_update_rows
from trtllm_replayssm.config import DTYPE_CODES
from trtllm_replayssm.families.kda import onnx_ops
from trtllm_replayssm.families.kda import reference as kref
from trtllm_replayssm.families.kda import trt_plugin as kda_plugin
from trtllm_replayssm.families.kda.config import SHADOW_KINDS, kda_spec
from trtllm_replayssm.families.kda.layers import ring_dtype

from .decode_step import PluginNode, PluginOp, StateSpec, StepIO, layer_state_specs, window_conv
from .kda import kda_layers, text_model
from .moe import FORMULATIONS, MoEWeights, gated_experts, route
from .qwen_step import GDNConventional, GDNReplay, QwenStep

MODES = ("conventional", "replay", "replay_bf16")  # the engine's modes this step runs
MODEL_TYPES = ("kimi_linear",)


# ---- SSM modes of the KDA layers (QwenStep's mode interface; the slot bookkeeping is the GDN modes', shape-free) ----
class KDAConventional(GDNConventional):
    """An fp32 state (layers, slots, H, K, V) read and written every step."""

    def alloc(self, layers, slots, geometry, device, act_dtype, lower_bound=None) -> None:
        self.j = {i: j for j, i in enumerate(layers)}
        self.slots, self.lower_bound = slots, lower_bound
        self.state = torch.zeros(len(layers), slots, *geometry, dtype=torch.float32, device=device)
        self.kernels = executors.for_device(device).name == "kernels"

    def step(self, i, q, k, v, f, b, A_log, dt_bias, sbi):
        st = self.state[self.j[i]]
        if self.kernels:
            from trtllm_replayssm.families.kda import ops as kops

            return kops.kda_conventional_step(q, k, v, f, b, A_log, dt_bias, st, sbi, use_qk_l2norm=True,
                                              lower_bound=self.lower_bound, check_values=False)
        # the float64 spec, the state stored back in fp32 (as the kernel keeps it)
        return kref.conventional_step(st, q, k, v, f, b, A_log, dt_bias, sbi, use_qk_l2norm=True,
                                      lower_bound=self.lower_bound).to(v.dtype)


class KDAReplay(GDNReplay):
    """ReplaySSM on a KDA-only standard-cursor :class:`ReplayStateCache` (``for_family("kda", ..., conv_dim=0)``):
    flush opens the model step, each KDA layer's ``verify`` runs its decode (the float64 spec on CPU tensors, the
    fused KDA kernel on CUDA), commit advances the cursor once. Every slot is allocated once for good."""

    def alloc(self, layers, slots, geometry, device, act_dtype, lower_bound=None) -> None:
        self.j = {i: j for j, i in enumerate(layers)}
        self.slots, self.lower_bound = slots, lower_bound
        cuda = torch.device(device).type == "cuda"
        shadow = None if self.shadow is None else torch.bfloat16
        self.cache = ReplayStateCache.for_family("kda", len(layers), slots, tuple(geometry), self.L, conv_dim=0,
                                                 cursor="standard", act_dtype=act_dtype, device=device,
                                                 check_values=False if cuda else None, shadow_dtype=shadow,
                                                 read_shadow=shadow is not None)
        for _ in range(slots):
            self.cache.allocate()

    def step(self, i, q, k, v, f, b, A_log, dt_bias, sbi):
        return self.cache.verify(self.j[i], q[:, None], k[:, None], v[:, None], f[:, None], b[:, None], A_log,
                                 dt_bias, state_batch_indices=sbi, use_qk_l2norm=True,
                                 lower_bound=self.lower_bound)[:, 0]


def make_kda_mode(mode: str, buffer_len: int = 16):
    if mode == "conventional":
        return KDAConventional()
    if mode in ("replay", "replay_bf16"):
        return KDAReplay(buffer_len, None if mode == "replay" else "bf16")
    raise ValueError(f"mode: expected one of {MODES} for a Kimi Delta Attention model (there is no fp8 KDA shadow), "
                     f"got {mode!r}")


# ---- the step ---------------------------------------------------------------------------------------------------
class KimiStep(QwenStep):
    """Decode of one token for ``batch`` rows (= slots) of a loaded Kimi-Linear model, MLA latents of ``kv_len``
    positions, SSM ``mode`` (module docstring). ``rows(n)``, ``load_slot``, ``save_slot`` and ``load_saved`` are
    QwenStep's."""

    capturable = False  # eager only (module docstring)
    MODEL_TYPES = MODEL_TYPES

    FAMILY = "a Kimi-Linear model"

    def __init__(self, model, batch: int, kv_len: int, mode: str = "replay", buffer_len: int = 16):
        cfg = self._checked_config(model, batch, kv_len)
        ssm = make_kda_mode(mode, buffer_len)  # a bad mode refused before anything is allocated
        self.model, self.cfg, self.batch, self.kv_len = model, cfg, batch, kv_len
        p = next(model.parameters())
        self.device, self.act = p.device, p.dtype
        self.kinds = list(cfg.layer_types)
        self.kda = self.gdn = kda_layers(model)
        if not self.kda:
            raise ValueError("layer_types: expected at least one Kimi Delta Attention (linear_attention) layer")
        self.attn = [i for i, k in enumerate(self.kinds) if k != "linear_attention"]  # MLA (Kimi), DSA (GLM-5 Next)
        layers = text_model(model).layers
        mx0 = layers[self.kda[0]].self_attn
        if mx0.activation != "silu":
            raise ValueError(f"hidden_act: the KDA conv's activation must be 'silu', got {mx0.activation!r}")
        self.K = mx0.conv_kernel_size
        self.H, self.Kd = mx0.num_heads, mx0.head_dim
        self.V = self.Kd  # Kimi's KDA heads have K = V (one head_dim)
        dev, i64 = self.device, dict(dtype=torch.int64, device=self.device)
        self.ids = torch.zeros(batch, **i64)
        self.lengths = torch.zeros(batch, **i64)
        self.sbi = torch.arange(batch, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(batch, cfg.vocab_size, dtype=self.act, device=dev)
        # MLA: transformers' compressed cache (kv_a_layernorm'd latent; the shared rope part of the key)
        self.k = {i: torch.zeros(batch, 1, kv_len, cfg.kv_lora_rank, dtype=self.act, device=dev) for i in self.attn}
        self.v = {i: torch.zeros(batch, 1, kv_len, cfg.qk_rope_head_dim, dtype=self.act, device=dev)
                  for i in self.attn}
        self.consts, self.conv = {}, {}
        lower = None
        for i in self.kda:
            mx = layers[i].self_attn
            fg = mx.forget_gate
            self.consts[i] = dict(A_log=fg.A_log.detach().float().reshape(self.H).contiguous(),
                                  dt_bias=fg.dt_bias.detach().float().reshape(self.H, self.Kd).contiguous(),
                                  conv_w=mx.conv1d.weight.detach()[:, 0, :].contiguous(),
                                  conv_b=None if mx.conv1d.bias is None else mx.conv1d.bias.detach())
            lower = getattr(fg, "safe_gate_lower_bound", None)  # GLM-5 Next's bounded gate; Kimi: None
            self.conv[i] = torch.zeros(batch + 1, mx.conv_dim, self.K - 1, dtype=self.act, device=dev)
        self.ssm = ssm
        self.ssm.alloc(self.kda, batch, (self.H, self.Kd, self.V), dev, self.act, lower)
        self.mode = mode

    def load_prefill_row(self, cache, r: int, row: int, m: int, n: int) -> None:
        """Row ``r`` of transformers' cache after a prefill of ``m`` (left-padded) positions whose last ``n`` are the
        prompt, into row ``row``: the conv state's last K-1 inputs, the prompt's MLA latents, the final recurrent
        states (transformers' (H, K, V) fp32 is the checkpoint's layout)."""
        conv = {i: cache.get_conv_state(i)[r, :, 1:].transpose(0, 1) for i in self.kda}  # (K-1, conv_dim)
        k = {i: cache.layers[i].keys[r, :, m - n:] for i in self.attn}
        v = {i: cache.layers[i].values[r, :, m - n:] for i in self.attn}
        ssm = {i: cache.get_recurrent_state(i)[r].float() for i in self.kda}
        self.load_slot(row, n, conv, k, v, ssm)

    def slot_geometry(self) -> dict:
        """What a saved slot must match to be loaded into this step (JSON-able; HybridStep.slot_geometry's form)."""
        c = self.cfg
        return dict(model_type=c.model_type, layers=list(self.kinds), vocab_size=c.vocab_size,
                    hidden_size=c.hidden_size, dtype=str(self.act).removeprefix("torch."), ssm_mode=self.ssm.name,
                    tokens_per_step=1, conv_kernel=self.K, kda=[self.H, self.Kd, self.V],
                    attention=[c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                               c.v_head_dim])

    def saved_spec(self, length: int) -> dict:
        """{name: (dtype, shape)} of ``save_slot``'s tensors for a row of ``length`` tokens (the MLA latent and rope
        key have their own widths)."""
        spec = {"ids": (torch.int64, ())}
        for i in self.kda:
            spec[f"conv.{i}"] = (self.act, tuple(self.conv[i].shape[1:]))
        for i in self.attn:
            spec[f"k.{i}"] = (self.act, (1, length, self.k[i].shape[3]))
            spec[f"v.{i}"] = (self.act, (1, length, self.v[i].shape[3]))
        return {**spec, **self.ssm.saved_spec()}

    # ---- one step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        """One token for every row: ``logits`` and the greedy ``ids``; lengths += 1; the KDA state of the rows with a
        slot advanced. Raises after closing the SSM step (the engine fails these rows' requests)."""
        m = text_model(self.model)
        sbi = self.sbi
        pos = self.lengths.clamp(max=self.kv_len - 1)  # a padding row's length runs on; a live row's never passes
        dst = torch.where(sbi >= 0, sbi, self.conv[self.kda[0]].shape[0] - 1).long()  # padding rows: the scratch row
        h = m.embed_tokens(self.ids)[:, None]  # (n, 1, hidden)
        self.ssm.begin_step(sbi)
        try:
            for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
                hn = layer.input_layernorm(h)
                if kind == "linear_attention":
                    h = h + self._kda(i, layer.self_attn, hn, dst)
                else:
                    h = h + self._attention(i, layer.self_attn, hn, pos)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            logits = self.model.lm_head(m.norm(h))[:, 0]
        except BaseException:
            self.ssm.abort_step()
            raise
        return self._finish_step(logits, sbi)

    def _kda(self, i, mx, hn, dst):
        c, n, H, Kd = self.consts[i], hn.shape[0], self.H, self.Kd
        mixed = torch.cat([mx.q_proj(hn), mx.k_proj(hn), mx.v_proj(hn)], dim=-1)  # (n, 1, 3 H K)
        conv = conv_update_rows(self.conv[i], mixed, c["conv_w"], c["conv_b"], dst, self.K, "silu")[:, 0]
        q, k, v = (t.reshape(n, H, Kd).contiguous() for t in conv.to(hn.dtype).split([mx.qkv_dim] * 3, dim=-1))
        fg = mx.forget_gate
        f = fg.f_b_proj(fg.f_a_proj(hn)).reshape(n, H, Kd).contiguous()
        b = mx.b_proj(hn).reshape(n, H).contiguous()
        y = self.ssm.step(i, q, k, v, f, b, c["A_log"], c["dt_bias"], self.sbi)  # (n, H, V)
        gate = mx.g_b_proj(mx.g_a_proj(hn)).reshape(n, 1, H, Kd)
        return mx.o_proj(mx.o_norm(y[:, None].to(hn.dtype), gate).reshape(n, 1, -1))

    def _attention(self, i, att, hn, pos):
        """Kimi's MLA for one token per row over the row's latents (module docstring)."""
        mod = sys.modules[type(att).__module__]
        n = hn.shape[0]
        if att.q_lora_rank is None:
            q = att.q_proj(hn)
        else:
            q = att.q_b_proj(att.q_a_layernorm(att.q_a_proj(hn)))
        q = q.view(n, 1, -1, att.qk_head_dim).transpose(1, 2)  # (n, heads, 1, qk_head_dim)
        kv_nope, k_rot = att.kv_a_proj_with_mqa(hn).split([att.kv_lora_rank, att.qk_rope_head_dim], dim=-1)
        at = torch.arange(n, device=hn.device)
        self.k[i][at, 0, pos] = att.kv_a_layernorm(kv_nope)[:, 0].to(self.act)  # one position per row, in place
        self.v[i][at, 0, pos] = k_rot[:, 0].to(self.act)
        keys, values = att.expand_kv(self.k[i], self.v[i])  # (n, heads, kv_len, qk_head_dim / v_head_dim)
        seen = torch.arange(self.kv_len, device=hn.device)[None, :] <= pos[:, None]  # (n, kv_len)
        mask = torch.zeros(n, 1, 1, self.kv_len, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~seen[:, None, None, :], torch.finfo(q.dtype).min)  # additive: eager and sdpa alike
        attend = mod.ALL_ATTENTION_FUNCTIONS.get_interface(att.config._attn_implementation,
                                                           mod.eager_attention_forward)
        o, _ = attend(att, q, keys, values, mask, dropout=0.0, scaling=att.scaling)
        return att.o_proj(o.reshape(n, 1, -1))


# ---- the engine directory's step -------------------------------------------------------------------------
# config.json's ``model.moe`` of a Kimi-Linear engine: the MoE keys of its config (and the graph formulation)
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
            "topk_group", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace")


def kda_op_type(speculative: bool, shadow: bool) -> str:
    """The KDA node of a step: ``kda_decode`` (T = 1) or ``kda_verify`` (T > 1), ``_shadow`` with the bf16 shadow; the
    name of its TensorRT plugin too (families/kda/trt_plugin.py)."""
    if speculative:
        return kda_plugin.VERIFY_SHADOW if shadow else kda_plugin.VERIFY
    return kda_plugin.DECODE_SHADOW if shadow else kda_plugin.DECODE


def kda_node(ins, caches, op_type: str, attrs: dict, backend=None):
    """One Kimi Delta Attention node (``op_type``: :func:`kda_op_type`, ``attrs`` its integer attributes in the
    plugin's order) on ``ins`` (q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor; q, k, v, f, b with a window
    axis in a verify node) and ``caches`` (state, k, u, g, v, beta[, shadow]): outputs (y, the caches in that order).
    The eager run (``backend``, default the family's reference node of ``op_type``: ``onnx_ops.decode_node`` /
    ``verify_node``) works on copies, functional as the graph is."""
    run = backend or (onnx_ops.verify_node if op_type in kda_plugin.VERIFY_PLUGINS else onnx_ops.decode_node)

    def node_run(*inputs):
        return run(*inputs, **attrs)

    node = PluginNode(op_type, tuple(attrs.items()), (2,) + tuple(range(9, 9 + len(caches))), node_run)
    return PluginOp.apply(node, *ins, *caches)


class KimiKDADecodeStep(StepIO, torch.nn.Module):
    """The step of T = 1 + ``num_draft`` tokens of a loaded Kimi-Linear model (module docstring); shares its weights.
    ``num_draft = 0``: standard decode; ``num_draft`` > 0: the speculative verify graph, whose commit graph is
    ``spec_step.NemotronHSpecCommit(step)``. ``backend``: the KDA node's eager computation (default: the family's
    float64 reference node, decode or verify). ``MODEL_TYPES``, ``FAMILY`` and ``LAYER_TYPES`` (KDA, then the other
    layers' type) are what a subclass changes (builders/glm5_export.py)."""

    MODEL_TYPES = MODEL_TYPES
    FAMILY = "a Kimi-Linear model"
    LAYER_TYPES = ("linear_attention", "full_attention")

    def __init__(self, model, buffer_len: int, max_seq_len: int, backend=None, moe_formulation: str = "dense",
                 shadow: str = "none", num_draft: int = 0):
        super().__init__()
        cfg = model.config
        if getattr(cfg, "model_type", None) not in self.MODEL_TYPES:
            raise ValueError(f"model: expected {self.FAMILY} (model_type one of {self.MODEL_TYPES}), got "
                             f"{getattr(cfg, 'model_type', None)!r}")
        if shadow not in SHADOW_KINDS:
            raise ValueError(f"shadow: expected one of {SHADOW_KINDS} (a bf16 shadow of the fp32 "
                             f"checkpoint), got {shadow!r}")
        if moe_formulation not in FORMULATIONS:
            raise ValueError(f"moe_formulation: expected one of {FORMULATIONS}, got {moe_formulation!r}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
        self.kinds = list(cfg.get_text_config().layer_types)  # a composite (GLM-5 Next) config's text config
        bad = sorted({k for k in self.kinds if k not in self.LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types: expected {' or '.join(self.LAYER_TYPES)}, got {bad}")
        self.kda = kda_layers(model)
        if not self.kda:
            raise ValueError("layer_types: expected at least one Kimi Delta Attention (linear_attention) layer")
        self.model, self.config = model, cfg
        layers = text_model(model).layers
        mx = layers[self.kda[0]].self_attn
        self.H, self.Kd, self.V, self.K_conv = mx.num_heads, mx.head_dim, mx.head_dim, mx.conv_kernel_size
        self._set_tokens(num_draft, buffer_len, self.K_conv)
        self.shadow, self.moe_formulation = shadow, moe_formulation
        self.buffer_len, self.max_seq_len = buffer_len, max_seq_len
        self.backend = backend
        self.act_dtype = next(model.parameters()).dtype
        # GLM-5 Next's bounded gate keeps its bound on the forget gate; Kimi's gate has none (None -> bits 0)
        self.lower_bound = getattr(mx.forget_gate, "safe_gate_lower_bound", None)
        for i in self.kda:  # per-layer gate constants in fp32, as the plugin takes them (A_log (H,), dt_bias (H, K))
            fg = layers[i].self_attn.forget_gate
            self.register_buffer(f"A_log_{i}", fg.A_log.detach().float().reshape(self.H).clone(), persistent=False)
            self.register_buffer(f"dt_bias_{i}", fg.dt_bias.detach().float().reshape(self.H, self.Kd).clone(),
                                 persistent=False)

    @classmethod
    def for_build(cls, model, *, buffer_len: int, max_seq_len: int, state_dtype: torch.dtype, moe_formulation: str,
                  shadow: str, num_draft: int) -> KimiKDADecodeStep:
        """The step of an engine build (builders/models.py's export step protocol; the checkpoint is fp32)."""
        if state_dtype != torch.float32:
            raise ValueError(f"state_dtype: the kda_decode plugin keeps an fp32 checkpoint, got {state_dtype}")
        return cls(model, buffer_len, max_seq_len, moe_formulation=moe_formulation, shadow=shadow, num_draft=num_draft)

    # ---- the engine directory (builders/models.py's export step protocol) -------------------------------------
    def ssm_layers(self) -> list[int]:
        return list(self.kda)

    def plugin_geometry(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of the kda_decode / kda_verify kernels, checked by the family's kernel spec for
        both tactics' batch geometries (ValueError naming the spec field and the config key or flag behind it)."""
        for batch in trt_plugin.TACTICS.values():
            try:
                kda_spec(DTYPE_CODES[self.act_dtype], self.H, self.Kd, self.V, self.buffer_len, batch, self.shadow,
                         True, None, self.lower_bound, num_tokens=self.num_tokens if self.speculative else 0)
            except ValueError as e:
                T = f", num_tokens = --num-draft {self.num_draft} + 1" if self.speculative else ""
                raise ValueError(f"{e} (the {self.op_type} plugin's kernel: H = linear_num_heads {self.H}, K = V = "
                                 f"linear_head_dim {self.Kd}, buffer_len = --buffer-len {self.buffer_len}{T})") from None
        return self.H, self.Kd, self.V

    def plugin_kernel(self, tactic: int, arch: int, sm_count: int):
        """The PTX and launch of the step's KDA node for ``tactic`` (the family's aot_impl; no persistent grid)."""
        a = self.plugin_attributes()
        aot = kda_plugin.aot_verify_kernel if self.speculative else kda_plugin.aot_kernel
        return aot(*a.values(), DTYPE_CODES[self.act_dtype], arch, tactic, self.shadow,
                   **({"row_order": True} if self.row_order else {}))

    def plugin_keys(self, sm_count: int) -> dict:
        return {}

    def _moe_layers(self) -> list[int]:
        return [i for i, layer in enumerate(text_model(self.model).layers) if hasattr(layer.mlp, "experts")]

    def describe(self) -> list[str]:
        cfg = self.config
        H, K, V = self.plugin_geometry()
        lines = [f"{cfg.model_type}: {len(self.kda)} Kimi Delta Attention layers, heads={H} key dim={K} value dim={V}; "
                 f"{self.kinds.count('full_attention')} MLA layers"]
        if self._moe_layers():
            lines.append(f"{len(self._moe_layers())} MoE layers: {cfg.num_experts} experts, top-"
                         f"{cfg.num_experts_per_tok}, as {self.moe_formulation} standard ONNX ops "
                         f"(builders/moe.py gated_experts)")
        return lines

    def model_entry(self) -> dict:
        """config.json's ``model`` after source, seed and model_type: pattern (K per KDA layer, A per MLA layer),
        sizes, the layers by type, the MoE layers and keys."""
        cfg = self.config
        entry = dict(pattern="".join("K" if k == "linear_attention" else "A" for k in self.kinds),
                     vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, layer_types=self.kinds,
                     kda_layers=self.ssm_layers(),
                     attention_layers=[i for i, k in enumerate(self.kinds) if k == "full_attention"])
        moe = self._moe_layers()
        if moe:
            entry["moe_layers"] = moe
            entry["moe"] = dict({k: getattr(cfg, k, None) for k in MOE_KEYS}, formulation=self.moe_formulation)
        return entry

    # ---- the state contract ---------------------------------------------------------------------------------
    def state_specs(self) -> list[StateSpec]:
        c = self.config
        sizes = dict(num_heads=self.H, key_dim=self.Kd, value_dim=self.V, buffer_len=self.buffer_len,
                     conv_dim=3 * self.H * self.Kd, conv_width=self.window, max_seq_len=self.max_seq_len,
                     kv_lora_rank=c.kv_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim)
        specs = []
        for i, kind in enumerate(self.kinds):
            specs += layer_state_specs("K" if kind == "linear_attention" else "A", i, sizes, dict(act=self.act_dtype),
                                       self.speculative, self.shadow)
        return specs

    def _patched_ssm(self, decoder, i: int):
        """KDA layer i of a patched model (builders/kda.py's KDAReplayDecoder): (checkpoint, rings k, u, g, v, beta),
        the u ring in this engine's dtype (layers.ring_dtype: a patched model without a shadow keeps it in fp32, an
        engine with a shadow in bf16)."""
        b = decoder.bufs[i]
        u = b.u_cache.to(ring_dtype(b.state.dtype, None if self.shadow == "none" else torch.bfloat16))
        return b.state, (b.k_cache, u, b.g_cache, b.v_cache, b.beta_cache)

    def _kv_states(self, cache, i: int, lengths: int) -> list[torch.Tensor]:
        """MLA layer i's latent and rope key from a transformers cache holding ``lengths`` tokens ((batch, 1, seq, .)
        there), padded to max_seq_len."""
        out = []
        for t in (cache.layers[i].keys, cache.layers[i].values):
            buf = t.new_zeros((t.shape[0], self.max_seq_len, t.shape[3]))
            buf[:, :lengths] = t[:, 0, :lengths]
            out.append(buf)
        return out

    # ---- the SSM node ---------------------------------------------------------------------------------------
    @property
    def op_type(self) -> str:
        """The op type of the step's KDA nodes, the name of their TensorRT plugin (:func:`kda_op_type`)."""
        return kda_op_type(self.speculative, self.shadow != "none")

    def plugin_attributes(self) -> dict:
        """The integer attributes of the step's KDA nodes in the plugin's order (config.json's too)."""
        return dict(num_heads=self.H, key_dim=self.Kd, value_dim=self.V, buffer_len=self.buffer_len, use_qk_l2norm=1,
                    lower_bound_bits=kda_plugin.lower_bound_bits(self.lower_bound),
                    **({"num_tokens": self.num_tokens} if self.speculative else {}))

    # ---- the layers, on (batch, T, D) -----------------------------------------------------------------------
    def _kda(self, i, mx, h, conv_state, st, cursor, sbi):
        """KDA layer i on the T tokens h (batch, T, D): (out (batch, T, D), its new states in state order: conv
        state / window, checkpoint[, shadow], k, u, g, v, beta); ``st`` its states after the conv state."""
        batch, T, H, Kd = h.shape[0], self.num_tokens, self.H, self.Kd
        mixed = torch.cat([mx.q_proj(h), mx.k_proj(h), mx.v_proj(h)], dim=-1)  # (batch, T, 3 H K)
        conv, window = window_conv(conv_state, mixed, mx.conv1d, self.K_conv, T)
        q, k, v = (t.reshape(batch, T, H, Kd) for t in F.silu(conv).to(h.dtype).split([mx.qkv_dim] * 3, dim=-1))
        fg = mx.forget_gate
        f = fg.f_b_proj(fg.f_a_proj(h)).reshape(batch, T, H, Kd)
        b = mx.b_proj(h).reshape(batch, T, H)
        if not self.speculative:  # kda_decode takes the squeezed token
            q, k, v, f, b = (t[:, 0] for t in (q, k, v, f, b))
        state, *rings = st
        shadow = () if self.shadow == "none" else (rings.pop(0),)
        ins = (q, k, v, f, b, getattr(self, f"A_log_{i}"), getattr(self, f"dt_bias_{i}"), sbi, cursor)
        y, state, *rest = kda_node(ins, (state, *rings, *shadow), self.op_type, self.plugin_attributes(), self.backend)
        new = [window, state, *rest[5:], *rest[:5]]  # state order: conv, checkpoint[, shadow], k, u, g, v, beta
        y = y if self.speculative else y[:, None]  # (batch, T, H, V)
        gate = mx.g_b_proj(mx.g_a_proj(h)).reshape(batch, T, H, Kd)
        out = mx.o_proj(mx.o_norm(y.to(h.dtype), gate).reshape(batch, T, -1))
        return out, new

    def _mla(self, att, h, kv_cache, rope_cache, lengths):
        """Kimi's MLA for the T new tokens of each row over the row's cached latents (module docstring)."""
        batch, T, nh, S = h.shape[0], self.num_tokens, att.num_heads, self.max_seq_len
        q = att.q_proj(h) if att.q_lora_rank is None else att.q_b_proj(att.q_a_layernorm(att.q_a_proj(h)))
        q = q.view(batch, T, nh, att.qk_head_dim).transpose(1, 2)  # (batch, nh, T, qk_head_dim)
        kv_nope, k_rot = att.kv_a_proj_with_mqa(h).split([att.kv_lora_rank, att.qk_rope_head_dim], dim=-1)
        latent = att.kv_a_layernorm(kv_nope).to(kv_cache.dtype)  # (batch, T, kv_lora_rank)
        pos = torch.arange(S, device=h.device)
        at = lengths.long()[:, None] + torch.arange(T, device=h.device)[None, :]  # (batch, T): the new positions
        for t in range(T):  # one-hot selects: exact copies, no arithmetic on the caches
            here = (pos[None, :] == at[:, t:t + 1])[:, :, None]  # (batch, S, 1)
            kv_cache = torch.where(here, latent[:, t:t + 1], kv_cache)
            rope_cache = torch.where(here, k_rot[:, t:t + 1].to(rope_cache.dtype), rope_cache)
        kv = att.kv_b_proj(kv_cache).view(batch, S, nh, -1).transpose(1, 2)  # (batch, nh, S, .)
        k_nope, values = kv.split([att.qk_nope_head_dim, att.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, rope_cache[:, None].expand(batch, nh, S, att.qk_rope_head_dim)], dim=-1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * att.scaling  # (batch, nh, T, S)
        visible = (pos[None, None, :] <= at[:, :, None])[:, None]  # (batch, 1, T, S): query t sees <= lengths + t
        scores = torch.where(visible, scores, torch.full_like(scores, torch.finfo(scores.dtype).min))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, values)  # (batch, nh, T, v_head_dim)
        return att.o_proj(o.transpose(1, 2).reshape(batch, T, -1)), kv_cache, rope_cache

    def _moe(self, hn, moe):
        """KimiLinearMoE on (batch, T, D) as static-shape ops, each token routed on its own (module docstring)."""
        g = moe.gate
        x = hn.reshape(-1, hn.shape[-1])
        router = MoEWeights(gate_weight=g.weight, correction_bias=g.e_score_correction_bias, up=None, down=None,
                            shared_up=None, shared_down=None, act=None, top_k=g.top_k, n_group=g.num_group,
                            topk_group=g.topk_group, norm_topk_prob=g.norm_topk_prob,
                            routed_scaling_factor=g.routed_scaling_factor)
        top_w, top_i = route(x, router)
        routed = gated_experts(x, moe.experts, top_w.to(x.dtype), top_i, self.moe_formulation)
        return routed.reshape(hn.shape) + moe.shared_experts(hn)

    def _layers(self, input_ids, lengths, cursor, states):
        """(logits (batch, T, vocab) fp32, new states) of the T tokens ``input_ids`` (batch, T)."""
        m = text_model(self.model)
        h = m.embed_tokens(input_ids)
        sbi = self._rows(h.shape[0], cursor, h.device)
        new_states, j = [], 0
        for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
            hn = layer.input_layernorm(h)
            if kind == "linear_attention":
                n = 7 + (self.shadow != "none")  # conv, checkpoint[, shadow], k, u, g, v, beta
                out, st = self._kda(i, layer.self_attn, hn, states[j], list(states[j + 1:j + n]), cursor, sbi)
                new_states += st
                j += n
            else:
                out, kv, rope = self._mla(layer.self_attn, hn, states[j], states[j + 1], lengths)
                new_states += [kv, rope]
                j += 2
            h = h + out
            hn = layer.post_attention_layernorm(h)
            h = h + (self._moe(hn, layer.mlp) if hasattr(layer.mlp, "experts") else layer.mlp(hn))
        return self.model.lm_head(m.norm(h)).float(), new_states


__all__ = ["MODES", "MODEL_TYPES", "KDAConventional", "KDAReplay", "make_kda_mode", "KimiStep", "KimiKDADecodeStep",
           "kda_op_type", "kda_node", "MOE_KEYS"]
