# SPDX-License-Identifier: Apache-2.0
"""The generation engine's decode step for Kimi-Linear (transformers' ``KimiLinearForCausalLM``): one token for every
row, rows = slots, with the step interface of :class:`builders.qwen_step.QwenStep` (its rows, slot hand-off and
host save / load are inherited unchanged) that :class:`builders.generation.Engine` drives.

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

GLM-5 Next (``glm5_next``): builders/glm5_step.py ``Glm5Step``, this step with its DSA attention and hyper-connections.
"""

from __future__ import annotations

import sys

import torch

from trtllm_replayssm import backend as executors
from trtllm_replayssm.cache import ReplayStateCache, conv_update_rows
from trtllm_replayssm.families.kda import reference as kref

from .kda import kda_layers, text_model
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


__all__ = ["MODES", "MODEL_TYPES", "KDAConventional", "KDAReplay", "make_kda_mode", "KimiStep"]
