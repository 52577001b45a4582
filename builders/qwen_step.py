# SPDX-License-Identifier: Apache-2.0
"""The generation engine's decode step for Qwen3-Next, Qwen3.5 and Qwen3.5 MoE (transformers'
``Qwen3NextForCausalLM`` / ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``): one token for every row, rows = slots,
with the step interface of :class:`builders.model_step.DecodeStep` that :class:`builders.generation.Engine` drives.

In-place state, allocated once for ``batch`` slots of ``kv_len`` positions: ``ids`` (batch,) int64 (the input token;
the greedy next token after a call), ``lengths`` (batch,) int64 (tokens in the K/V rows = the input's position),
``sbi`` (batch,) int32 (the row's slot, -1: a padding row that touches no SSM state or conv window), ``logits``
(batch, vocab), per attention layer ``k[i]`` / ``v[i]`` (batch, kv_heads, kv_len, head_dim), per Gated DeltaNet layer
a conv window (slots + 1, conv_dim, K - 1) over q | k | v (the last K - 1 inputs; slot ``batch`` is the scratch row
padding rows write), and the SSM mode's state.

Per call (pre-norm blocks with residuals, as the model runs them):

  embed   transformers' ``embed_tokens``
  G       the layer's projections -> q | k | v, z, b, a (``qwen3_next._projections``); the causal conv of the new
          input over the slot's window (``cache.conv_update_rows``, silu); the GDN step of the SSM mode (raw a, b in,
          g and beta inside, q and k l2-normalised inside); the layer's gated RMSNorm with z; out_proj
  *       the gated attention of builders/qwen_export.py (``QwenGDNDecodeStep._attention``: q / k RMSNorm, RoPE at the
          row's position from the rotary table of ``QwenGDNDecodeStep._rope``, the sigmoid output gate) over the
          row's K/V; only the new position is written back
  then    post-attention norm and transformers' MLP / MoE module, as the model calls it in decode; norm, lm_head

SSM modes (``mode``, the engine's names): "conventional" (an fp32 state (slots, HV, V, Kd) per layer read and written
every step: ``gdn_reference.conventional_step`` on the CPU, ``gdn_ops.gdn_conventional_step`` on CUDA), "replay"
(ReplaySSM on a :class:`~trtllm_replayssm.cache.ReplayStateCache` of the GDN layers, ``cursor="standard"``: the fp32
checkpoint, rings of L entries, the step that fills them folds), "replay_bf16" (the same with a bf16 shadow of the
checkpoint that non-flush steps read). There is no fp8 GDN shadow: "replay_fp8" is refused. The prefill hand-off
(:meth:`QwenStep.load_prefill_row`) reads row r of transformers' cache after the model's own forward: the last
K - 1 conv inputs, the final recurrent state (transformers' (HV, Kd, V), transposed), the K/V of the prompt
(ReplaySSM: ``ReplayStateCache.load_prefill``, the checkpoint with empty rings).

The step is eager (``capturable = False``): transformers' MoE block picks its experts with data-dependent shapes, so
the engine runs it without CUDA graphs.
"""

from __future__ import annotations

import copy

import torch

from trtllm_replayssm import backend as executors
from trtllm_replayssm.cache import ReplayStateCache, conv_update_rows
from trtllm_replayssm.families.gdn import reference as gref

from .model_step import CacheSlots, from_host, to_host
from .qwen3_next import MODEL_TYPES, _projections, gdn_layers

MODES = ("conventional", "replay", "replay_bf16")  # the engine's modes this step runs


# ---- SSM modes of the Gated DeltaNet layers -----------------------------------------------------------------------
class GDNMode:
    """Interface: ``alloc`` the state of ``layers`` for ``slots``, ``load_slot`` a prefill's final states
    {layer: (HV, V, Kd)}, ``begin_step`` / ``end_step`` around the layers of one model step (``abort_step`` where a
    layer raised), ``step`` one layer (y (batch, HV, V) in v's dtype), ``states`` the recurrent state after the
    committed tokens {layer: (slots, HV, V, Kd)}."""

    name = "?"

    def alloc(self, layers, slots, HV, H, V, Kd, device, act_dtype) -> None:
        self.j = {i: j for j, i in enumerate(layers)}
        self.slots = slots

    def begin_step(self, sbi) -> None:
        pass

    def end_step(self, sbi) -> None:
        pass

    def abort_step(self) -> None:
        pass


class GDNConventional(GDNMode):
    name = "conventional"

    def alloc(self, layers, slots, HV, H, V, Kd, device, act_dtype) -> None:
        super().alloc(layers, slots, HV, H, V, Kd, device, act_dtype)
        self.state = torch.zeros(len(layers), slots, HV, V, Kd, dtype=torch.float32, device=device)
        if executors.for_device(device).name == "kernels":
            from trtllm_replayssm.families.gdn import ops as gdn_ops

            self._step = lambda st, q, k, v, a, b, A_log, dt_bias, sbi: gdn_ops.gdn_conventional_step(
                q, k, v, a, b, A_log, dt_bias, st, sbi, check_values=False)
        else:  # the float64 reference, stored back in fp32
            self._step = lambda st, q, k, v, a, b, A_log, dt_bias, sbi: gref.conventional_step(
                st, q, k, v, a, b, A_log, dt_bias, sbi).to(v.dtype)

    def load_slot(self, slot: int, states: dict) -> None:
        for i, s in states.items():
            self.state[self.j[i], slot].copy_(s)

    def step(self, i, q, k, v, a, b, A_log, dt_bias, sbi):
        return self._step(self.state[self.j[i]], q, k, v, a, b, A_log, dt_bias, sbi)

    def states(self) -> dict:
        return {i: self.state[j] for i, j in self.j.items()}

    # one slot in host memory (preemption, the prefill/decode hand-off: builders/model_step.py SSMMode's interface)
    def saved_spec(self) -> dict:
        return {"ssm": (self.state.dtype, (self.state.shape[0], *self.state.shape[2:]))}

    def snapshot_nbytes(self) -> int:
        return 0

    def snapshot_mismatch(self, snapshot) -> list:
        return [] if snapshot is None else ["the state holds a ReplayStateCache snapshot; SSM mode 'conventional' "
                                            "keeps none"]

    def save_slot(self, slot: int) -> tuple:
        return {"ssm": to_host(self.state[:, slot])}, None

    def load_saved(self, slot: int, tensors: dict, snapshot) -> None:
        from_host(self.state[:, slot], tensors["ssm"])


class GDNReplay(CacheSlots, GDNMode):
    """ReplaySSM on a GDN-only :class:`ReplayStateCache` (``cursor="standard"``: the standard GDN decode step of the
    executor, the cursor advanced once per model step); the step keeps the conv windows (``conv_dim=0``). Every
    slot is allocated once: a slot's prefill hand-off (``load_prefill``) resets its rings and cursor."""

    def __init__(self, buffer_len: int = 16, shadow: str | None = None):
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        if shadow not in (None, "bf16"):
            raise ValueError(f"shadow: expected None or 'bf16' (there is no fp8 GDN shadow), got {shadow!r}")
        self.L, self.shadow = buffer_len, shadow
        self.name = "replay" if shadow is None else f"replay_{shadow}"

    def alloc(self, layers, slots, HV, H, V, Kd, device, act_dtype) -> None:
        super().alloc(layers, slots, HV, H, V, Kd, device, act_dtype)
        cuda = torch.device(device).type == "cuda"
        shadow = None if self.shadow is None else torch.bfloat16
        self.cache = ReplayStateCache.for_family("gdn", len(layers), slots, (HV, H, V, Kd), self.L, num_draft=0,
                                                 conv_dim=0, act_dtype=act_dtype, device=device, cursor="standard",
                                                 check_values=False if cuda else None, shadow_dtype=shadow,
                                                 read_shadow=shadow is not None)
        for _ in range(slots):
            self.cache.allocate()

    def load_slot(self, slot: int, states: dict) -> None:
        for i, s in states.items():  # the checkpoint = the prompt's final state, rings empty, cursor 0, shadow rewritten
            self.cache.load_prefill(slot, self.j[i], s)

    def begin_step(self, sbi) -> None:
        self.cache.flush(sbi, 1, [])

    def step(self, i, q, k, v, a, b, A_log, dt_bias, sbi):
        return self.cache.verify(self.j[i], q[:, None], k[:, None], v[:, None], a[:, None], b[:, None], A_log,
                                     dt_bias, sbi)[:, 0]

    def end_step(self, sbi) -> None:
        self.cache.commit(sbi, None, 1)  # every row accepts its token: the cursor advances

    def abort_step(self) -> None:
        self.cache.abort_step()  # the engine fails these rows' requests; their slots are prefilled again before use

    def states(self) -> dict:
        return {i: torch.stack([self.cache.committed_state(j, s) for s in range(self.slots)])
                for i, j in self.j.items()}


def make_gdn_mode(mode: str, buffer_len: int = 16) -> GDNMode:
    if mode == "conventional":
        return GDNConventional()
    if mode in ("replay", "replay_bf16"):
        return GDNReplay(buffer_len, None if mode == "replay" else "bf16")
    raise ValueError(f"mode: expected one of {MODES} for a Gated DeltaNet model (there is no fp8 GDN shadow), "
                     f"got {mode!r}")


# ---- the step ---------------------------------------------------------------------------------------------------
class QwenStep:
    """Decode of one token for ``batch`` rows (= slots) of a loaded Qwen3-Next / Qwen3.5 text model, K/V rows of
    ``kv_len`` positions, SSM ``mode`` (module docstring). ``rows(n)`` views the first n rows; ``load_slot`` /
    ``load_prefill_row`` hand a prefill to a row; a call runs one step for every row of the view."""

    capturable = False  # eager only (module docstring): the engine runs it without CUDA graphs
    MODEL_TYPES = MODEL_TYPES

    FAMILY = "a Qwen3-Next / Qwen3.5 text model"  # in the error that names a wrong model_type
    LAYER_TYPES = ("linear_attention", "full_attention")  # the config.layer_types the step runs

    @classmethod
    def for_engine(cls, model, batch: int, kv_len: int, mode: str, buffer_len: int, fuse: bool | None = None):
        """The step as the generation engine builds it (builders/models.py's streaming step); eager, no fused regions:
        ``fuse`` does not apply."""
        return cls(model, batch, kv_len, mode, buffer_len)

    @classmethod
    def _checked_config(cls, model, batch: int, kv_len: int):
        """The model's (text) config after the checks every hybrid step of this shape makes (model_type, layer types,
        sizes); a composite (vision-language) config's text config, where its decoder lives (GLM-5 Next)."""
        cfg = model.config
        if getattr(cfg, "model_type", None) not in cls.MODEL_TYPES:
            raise ValueError(f"model: expected {cls.FAMILY} (model_type one of {cls.MODEL_TYPES}), "
                             f"got {getattr(cfg, 'model_type', None)!r}")
        cfg = cfg.get_text_config()
        bad = sorted({t for t in cfg.layer_types if t not in cls.LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types: expected {' or '.join(cls.LAYER_TYPES)}, got {bad}")
        if batch < 1 or kv_len < 1:
            raise ValueError(f"batch and kv_len: expected >= 1, got {batch} and {kv_len}")
        return cfg

    def __init__(self, model, batch: int, kv_len: int, mode: str = "replay", buffer_len: int = 16):
        from .qwen_export import QwenGDNDecodeStep

        cfg = self._checked_config(model, batch, kv_len)
        self.model, self.cfg, self.batch, self.kv_len = model, cfg, batch, kv_len
        p = next(model.parameters())
        self.device, self.act = p.device, p.dtype
        self.kinds = list(cfg.layer_types)
        self.gdn = gdn_layers(model)
        if not self.gdn:
            raise ValueError("layer_types: expected at least one Gated DeltaNet (linear_attention) layer")
        self.attn = [i for i, k in enumerate(self.kinds) if k == "full_attention"]
        self.K = cfg.linear_conv_kernel_dim
        H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.H, self.HV, self.Kd, self.V = H, HV, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        # the attention and rotary table of the exported step (builders/qwen_export.py): one layer code for both routes
        self.layer_code = QwenGDNDecodeStep(model, buffer_len, kv_len)
        dev, i64 = self.device, dict(dtype=torch.int64, device=self.device)
        self.ids = torch.zeros(batch, **i64)
        self.lengths = torch.zeros(batch, **i64)
        self.sbi = torch.arange(batch, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(batch, cfg.vocab_size, dtype=self.act, device=dev)
        kv = (batch, cfg.num_key_value_heads, kv_len, cfg.head_dim)
        self.k = {i: torch.zeros(kv, dtype=self.act, device=dev) for i in self.attn}
        self.v = {i: torch.zeros(kv, dtype=self.act, device=dev) for i in self.attn}
        self.consts, self.conv = {}, {}
        for i in self.gdn:
            mx = model.model.layers[i].linear_attn
            self.consts[i] = dict(A_log=mx.A_log.detach().float().contiguous(),
                                  dt_bias=mx.dt_bias.detach().float().contiguous(),
                                  conv_w=mx.conv1d.weight.detach()[:, 0, :].contiguous(),
                                  conv_b=None if mx.conv1d.bias is None else mx.conv1d.bias.detach())
            self.conv[i] = torch.zeros(batch + 1, mx.conv_dim, self.K - 1, dtype=self.act, device=dev)
        self.ssm = make_gdn_mode(mode, buffer_len)
        self.ssm.alloc(self.gdn, batch, HV, H, self.V, self.Kd, dev, self.act)
        self.mode = mode

    # ---- rows of a server's batch ------------------------------------------------------------------------------
    def rows(self, n: int) -> QwenStep:
        """A step over the first ``n`` rows sharing every tensor of this one (the conv windows and the SSM state are
        reached through ``sbi``)."""
        if not 1 <= n <= self.batch:
            raise ValueError(f"n: expected 1..{self.batch} rows, got {n}")
        v = copy.copy(self)
        v.batch = n
        for name in ("ids", "lengths", "sbi", "logits"):
            setattr(v, name, getattr(self, name)[:n])
        v.k = {i: t[:n] for i, t in self.k.items()}
        v.v = {i: t[:n] for i, t in self.v.items()}
        return v

    def load_slot(self, row: int, length: int, conv: dict, k: dict, v: dict, ssm: dict) -> None:
        """A prefill's hand-off into row ``row`` (its slot): ``length`` tokens of K/V (``k[i]``, ``v[i]`` (kv_heads,
        length, head_dim)), the last K-1 conv inputs ``conv[i]`` (K-1, conv_dim), the final recurrent states ``ssm[i]``
        (HV, V, Kd) (ReplaySSM: the checkpoint with empty rings)."""
        if not 0 <= row < self.batch or not 0 < length <= self.kv_len:
            raise ValueError(f"row, length: expected 0 <= row < {self.batch} and 0 < length <= {self.kv_len}, "
                             f"got {row}, {length}")
        self.lengths[row] = length
        for i in self.gdn:
            self.conv[i][row].copy_(conv[i].transpose(0, 1))
        for i in self.attn:  # positions past the prompt zeroed: a padding row wrote there while the slot was free
            self.k[i][row, :, :length].copy_(k[i])
            self.v[i][row, :, :length].copy_(v[i])
            self.k[i][row, :, length:].zero_()
            self.v[i][row, :, length:].zero_()
        self.ssm.load_slot(row, ssm)

    def load_prefill_row(self, cache, r: int, row: int, m: int, n: int) -> None:
        """Row ``r`` of transformers' cache after a prefill of ``m`` (left-padded) positions whose last ``n`` are the
        prompt, into row ``row``: the conv state's last K-1 inputs, the prompt's K/V, the final recurrent states."""
        conv = {i: cache.get_conv_state(i)[r, :, 1:].transpose(0, 1) for i in self.gdn}  # (K-1, conv_dim)
        k = {i: cache.layers[i].keys[r, :, m - n:] for i in self.attn}
        v = {i: cache.layers[i].values[r, :, m - n:] for i in self.attn}
        ssm = {i: cache.get_recurrent_state(i)[r].float().transpose(-1, -2) for i in self.gdn}  # (HV, Kd, V) -> ours
        self.load_slot(row, n, conv, k, v, ssm)

    # ---- one slot in host memory (builders/generation.py: preemption, the prefill/decode hand-off) ---------------
    def slot_geometry(self) -> dict:
        """What a saved slot must match to be loaded into this step (JSON-able; HybridStep.slot_geometry's form)."""
        c = self.cfg
        return dict(model_type=c.model_type, layers=list(self.kinds), vocab_size=c.vocab_size,
                    hidden_size=c.hidden_size, dtype=str(self.act).removeprefix("torch."), ssm_mode=self.ssm.name,
                    tokens_per_step=1, conv_kernel=self.K, gdn=[self.H, self.HV, self.Kd, self.V],
                    attention=[c.num_attention_heads, c.num_key_value_heads, c.head_dim])

    def saved_spec(self, length: int) -> dict:
        """{name: (dtype, shape)} of :meth:`save_slot`'s tensors for a row of ``length`` tokens."""
        spec = {"ids": (torch.int64, ())}
        for i in self.gdn:
            spec[f"conv.{i}"] = (self.act, tuple(self.conv[i].shape[1:]))
        for i in self.attn:
            spec[f"k.{i}"] = spec[f"v.{i}"] = (self.act, (self.k[i].shape[1], length, self.k[i].shape[3]))
        return {**spec, **self.ssm.saved_spec()}

    def save_slot(self, row: int, length: int) -> tuple:
        """Row ``row`` in host memory (builders/model_step.py HybridStep.save_slot's contract): the next input, the
        conv windows, the K/V of ``length`` positions, the SSM mode's state (ReplaySSM: the cache's snapshot)."""
        t = {"ids": to_host(self.ids[row])}
        for i in self.gdn:
            t[f"conv.{i}"] = to_host(self.conv[i][row])
        for i in self.attn:
            t[f"k.{i}"] = to_host(self.k[i][row, :, :length])
            t[f"v.{i}"] = to_host(self.v[i][row, :, :length])
        ssm, snap = self.ssm.save_slot(row)
        return {**t, **ssm}, snap

    def load_saved(self, row: int, length: int, tensors: dict, snapshot) -> None:
        """:meth:`save_slot`'s copy back into row ``row`` (K/V past ``length`` zeroed, as a prefill leaves them)."""
        if not 0 <= row < self.batch or not 0 < length <= self.kv_len:
            raise ValueError(f"row, length: expected 0 <= row < {self.batch} and 0 < length <= {self.kv_len}, "
                             f"got {row}, {length}")
        self.ssm.load_saved(row, tensors, snapshot)
        self.lengths[row] = length
        from_host(self.ids[row], tensors["ids"])
        for i in self.gdn:
            from_host(self.conv[i][row], tensors[f"conv.{i}"])
        for i in self.attn:
            from_host(self.k[i][row, :, :length], tensors[f"k.{i}"])
            from_host(self.v[i][row, :, :length], tensors[f"v.{i}"])
            self.k[i][row, :, length:].zero_()
            self.v[i][row, :, length:].zero_()

    # ---- one step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        """One token for every row: ``logits`` and the greedy ``ids``; lengths += 1; the SSM state of the rows with a
        slot advanced. Raises after closing the SSM step (the engine fails these rows' requests)."""
        m = self.model.model
        sbi = self.sbi
        pos = self.lengths.clamp(max=self.kv_len - 1)  # a padding row's length runs on; a live row's never passes
        dst = torch.where(sbi >= 0, sbi, self.conv[self.gdn[0]].shape[0] - 1).long()  # padding rows: the scratch row
        h = m.embed_tokens(self.ids)[:, None]  # (n, 1, hidden)
        cos_sin = self.layer_code._rope(pos[:, None])
        self.ssm.begin_step(sbi)
        try:
            for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
                res = h
                hn = layer.input_layernorm(h)
                if kind == "linear_attention":
                    out = self._gdn(i, layer.linear_attn, hn, dst)
                else:
                    out = self._attention(i, layer, hn, pos, cos_sin)
                h = res + out
                mo = layer.mlp(layer.post_attention_layernorm(h))
                h = h + (mo[0] if isinstance(mo, tuple) else mo)  # a MoE block may return (hidden, router logits)
            logits = self.model.lm_head(m.norm(h))[:, 0]
        except BaseException:
            self.ssm.abort_step()
            raise
        return self._finish_step(logits, sbi)

    def _finish_step(self, logits, sbi) -> torch.Tensor:
        """After the layers of one step: the logits and the greedy ids in place, every row one token longer, the SSM
        step closed (the cursor moves once)."""
        self.logits.copy_(logits)
        self.ids.copy_(logits.argmax(-1))
        self.lengths.add_(1)
        self.ssm.end_step(sbi)
        return self.logits

    def _gdn(self, i, mx, hn, dst):
        c, n = self.consts[i], hn.shape[0]
        H, HV, Kd, V = self.H, self.HV, self.Kd, self.V
        mixed, z, b, a = _projections(mx, hn)
        conv = conv_update_rows(self.conv[i], mixed, c["conv_w"], c["conv_b"], dst, self.K, "silu")[:, 0]
        q, k, v = conv.to(hn.dtype).split([mx.key_dim, mx.key_dim, mx.value_dim], dim=-1)
        y = self.ssm.step(i, q.reshape(n, H, Kd).contiguous(), k.reshape(n, H, Kd).contiguous(),
                          v.reshape(n, HV, V).contiguous(), a.reshape(n, HV).contiguous(), b.reshape(n, HV).contiguous(),
                          c["A_log"], c["dt_bias"], self.sbi)
        core = mx.norm(y.reshape(n * HV, V).to(hn.dtype), z.reshape(n * HV, V))
        return mx.out_proj(core.reshape(n, 1, HV * V))

    def _attention(self, i, layer, hn, pos, cos_sin):
        out, keys, vals = self.layer_code._attention(layer, hn, self.k[i], self.v[i], pos, cos_sin)
        at = torch.arange(hn.shape[0], device=hn.device)
        self.k[i][at, :, pos] = keys[at, :, pos]  # one position per row, in place
        self.v[i][at, :, pos] = vals[at, :, pos]
        return out
