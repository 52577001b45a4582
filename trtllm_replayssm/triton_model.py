# SPDX-License-Identifier: Apache-2.0
"""Triton Inference Server Python-backend model: Nemotron-H decode over a :class:`ReplayStateCache` that
the model instance owns on its device, one token per request, sequences mapped to cache slots.

Route (``scripts/make_triton_repo.py --backend python`` writes the repository; its ``model.py`` puts
the project on ``sys.path`` and hands every call to :class:`SequenceModel`):

  Triton sequence batcher, ``oldest`` strategy: requests of up to ``max_candidate_sequences``
  sequences are batched, at most one request per sequence per batch; every request carries the
  controls START, END, READY (int32 0/1) and CORRID (uint64), one token ``input_ids`` [1] (int64),
  and gets back ``logits`` [vocab] (fp32) and ``slot`` [1] (int32, the cache slot that holds it).
      |
  :class:`SequenceTable`   CORRID -> slot. START takes a free slot (reset: zeros everywhere, cursor 0);
                           END frees it after the step; a sequence idle longer than
                           ``max_sequence_idle_microseconds`` is freed at the next batch (Triton drops
                           it at the same timeout and tells the model nothing). Bad requests (no
                           START for an unknown CORRID, a CORRID that ended or timed out, more than
                           max_seq_len tokens, a token outside the vocabulary, READY = 0) get a Triton
                           error response of their own; no other row and no state is touched.
      |
  :class:`SlotStep`        one decode step for the batch's rows, in place on the device:
      embed; per layer (pre-norm, residual):
        M  in_proj -> z, xBC, dt;  cache.conv_update (window of the last K-1 inputs of the slot);
           cache.verify (the standard decode kernel on the cache's (slots,) cursor: output from checkpoint +
           buffer, the token appended, the buffer folded into the checkpoint by the step that fills it);
           gated RMSNorm(y, z); out_proj
        *  q, k, v; k and v written at position lengths[slot] of the slot's K/V rows; softmax over
           positions <= lengths[slot] (Nemotron-H has no positional encoding)
        -, E  the transformers module (MLP; MoE of Nemotron 3)
      norm_f, lm_head -> fp32 logits; cache.commit (cursor += 1 mod L), lengths += 1.
  cache.flush / verify / commit run the executor the cache chose once (cache.py): the float64 spec for CPU
  tensors, the kernels (``ops.replay_decode``, ``ops.advance_cursor``) for CUDA tensors.

State stays where it is: the checkpoints, rings, conv windows, K/V rows and lengths live in tensors
allocated once per model instance; a step writes one ring entry, one conv column and one K/V position
per row (and folds a checkpoint every L tokens: the step that fills the buffer). No state crosses the Triton boundary, unlike
``sequence_batching.state`` (implicit state), which hands the whole state to the backend and takes it
back every request. The attention reads its rows' K/V through a gather (a paged decode attention
kernel would read them in place); nothing of it is written back.

Tensors cross the backend boundary only through DLPack (``Tensor.to_dlpack`` / ``Tensor.from_dlpack``),
never through numpy: the Python backend stub of Triton 2.51 (the one nvidia-pytriton 0.7.0 bundles) is
built with a pybind11 that reads numpy's pre-2.0 dtype layout, so under numpy 2.x ``as_numpy()`` of a
[1, 3] fp32 input [1, 2, 3] reads [1, 1, 1] and ``Tensor(name, ndarray)`` sends a 0-byte output,
without an error (docs/triton.md, "Route 2: Python-backend model that owns its state"). DLPack does not use numpy, so
this model is correct under numpy 1.x and 2.x.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import OrderedDict

import torch

from .cache import ReplayStateCache
from .config import SHADOW_DTYPES

CONTROLS = ("START", "END", "READY", "CORRID")
INPUT_IDS, LOGITS, SLOT = "input_ids", "logits", "slot"


class RequestError(ValueError):
    """One request cannot be served; the message goes back to its client as a Triton error."""


# ---- the decode step over cache slots ------------------------------------------------------------------
class _Slots:
    """What both slot steps own besides the cache: K/V rows (slots, kv_heads, max_seq_len, head_dim) per
    attention layer in the activation dtype and ``lengths`` (slots,) int64; the slot lifecycle."""

    def _init_slots(self, num_slots: int, max_seq_len: int, kv_heads: int, head_dim: int) -> None:
        kv = (num_slots, kv_heads, max_seq_len, head_dim)
        self.k = {i: torch.zeros(kv, dtype=self.act, device=self.device) for i in self.attn}
        self.v = {i: torch.zeros(kv, dtype=self.act, device=self.device) for i in self.attn}
        self.lengths = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self.positions = torch.arange(max_seq_len, device=self.device)

    # slot lifecycle: the cache resets its tensors, the step its own
    def allocate(self) -> int:
        slot = self.cache.allocate()
        for t in (*self.k.values(), *self.v.values()):
            t[slot].zero_()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.cache.free(slot)


class SlotStep(_Slots):
    """Decode of one token for any set of live slots of a (loaded) ``NemotronHForCausalLM``.

    Owns, on the model's device: a :class:`ReplayStateCache` of every Mamba layer (num_draft = 0:
    T = 1 decode on the ring), K/V rows (slots, kv_heads, max_seq_len, head_dim) per attention layer
    in the activation dtype, ``lengths`` (slots,) int64. ``check_values`` as in the cache (CUDA: None
    syncs for host checks, False never reads the device).
    """

    def __init__(self, model, num_slots: int, max_seq_len: int, buffer_len: int = 16, check_values: bool | None = False,
                 shadow: str = "none"):
        cfg = model.config
        shadow_dtype = _shadow_dtype(shadow, ("none", "bf16", "fp8"))
        bad = sorted({t for t in cfg.layers_block_type if t not in ("linear_attention", "full_attention", "mlp", "moe")})
        if bad:
            raise ValueError(f"layers_block_type: expected linear_attention, full_attention, mlp or moe, got {bad}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
        if "linear_attention" not in cfg.layers_block_type:
            raise ValueError("layers_block_type: expected at least one Mamba-2 (linear_attention) layer")
        self.model, self.cfg = model, cfg
        p = next(model.parameters())
        self.device, self.act = p.device, p.dtype
        self.kinds = list(cfg.layers_block_type)
        self.num_slots, self.max_seq_len, self.vocab = num_slots, max_seq_len, cfg.vocab_size
        self.mamba = [i for i, k in enumerate(self.kinds) if k == "linear_attention"]
        self.attn = [i for i, k in enumerate(self.kinds) if k == "full_attention"]
        self.H, self.P, self.N, self.G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        layers = model.model.layers
        self.cache = ReplayStateCache(len(self.mamba), num_slots, self.H, self.P, self.N, self.G, buffer_len,
                                      num_draft=0, conv_kernel=cfg.conv_kernel, conv_dim=layers[self.mamba[0]].mixer.conv_dim,
                                      state_dtype=torch.float32, act_dtype=self.act, device=self.device,
                                      check_values=check_values, cursor="standard",  # the tuned decode kernel
                                      shadow_dtype=shadow_dtype, read_shadow=shadow_dtype is not None)
        self.consts = {}
        for j, i in enumerate(self.mamba):
            mx = layers[i].mixer
            self.consts[i] = dict(j=j, A=-torch.exp(mx.A_log.detach().float()), D=mx.D.detach().float().contiguous(),
                                  dt_bias=mx.dt_bias.detach().float().contiguous(),
                                  conv_w=mx.conv1d.weight.detach()[:, 0, :].contiguous(),
                                  conv_b=None if mx.conv1d.bias is None else mx.conv1d.bias.detach())
        self.A_by_layer = [self.consts[i]["A"] for i in self.mamba]
        self._init_slots(num_slots, max_seq_len, cfg.num_key_value_heads, cfg.head_dim)

    @torch.no_grad()
    def __call__(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits (rows, vocab) fp32 of ``tokens[r]`` appended to the sequence in ``slots[r]`` (distinct
        live slots, each holding < max_seq_len tokens: the caller checks). Mutates only those slots."""
        sbi = torch.tensor(slots, dtype=torch.int32, device=self.device)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        rows = sbi.long()
        pos = self.lengths.index_select(0, rows)  # (rows,): where the token goes
        m = self.model.model
        h = m.embeddings(ids)  # (n, hidden)
        self.cache.flush(sbi, 1, self.A_by_layer)
        try:
            for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
                res = h
                hn = layer.norm(h.to(layer.norm.weight.dtype))
                if kind == "linear_attention":
                    out = self._mamba(i, layer.mixer, hn, sbi)
                elif kind == "full_attention":
                    out = self._attention(i, layer.mixer, hn, rows, pos)
                else:  # MLP or MoE: transformers' module on (n, 1, hidden), as the model calls it in decode
                    out = layer.mixer(hn[:, None])[:, 0]
                h = res + out
            logits = self.model.lm_head(m.norm_f(h)).float()
        except BaseException:
            self.cache.abort_step()  # the caller drops these rows' sequences; the next step must still open
            raise
        self.cache.commit(sbi, None, 1)  # every row accepts its token: the cursor advances
        self.lengths.index_add_(0, rows, torch.ones_like(rows))
        return logits

    def _mamba(self, i, mx, hn, sbi):
        from builders.decode_step import mamba2_mixer  # the exported steps' mixer (builders/)

        c = self.consts[i]

        def conv(xBC):  # the slot's window in the cache; silu applied there
            return self.cache.conv_update(c["j"], xBC.contiguous(), c["conv_w"], c["conv_b"], sbi).to(hn.dtype), None

        def ssm(x, B, C, dt):
            y = self.cache.verify(c["j"], x.contiguous(), B.contiguous(), C.contiguous(), dt.contiguous(),
                                  c["dt_bias"], c["A"], c["D"], None, sbi)
            return y.to(hn.dtype), None

        return mamba2_mixer(mx, hn[:, None], 1, conv, ssm)[0][:, 0]

    def _attention(self, i, att, hn, rows, pos):
        from builders.decode_step import grouped_attention  # the exported step's attention (builders/)

        cfg, n = self.cfg, hn.shape[0]
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = att.q_proj(hn).view(n, nh, 1, hd)
        self.k[i][rows, :, pos] = att.k_proj(hn).view(n, kvh, hd).to(self.act)  # one position per row, in place
        self.v[i][rows, :, pos] = att.v_proj(hn).view(n, kvh, hd).to(self.act)
        keys, vals = self.k[i].index_select(0, rows), self.v[i].index_select(0, rows)  # (n, kvh, S, hd)
        o = grouped_attention(q, keys, vals, pos[:, None], att.scaling, self.positions)  # (n, nh, 1, hd)
        return att.o_proj(o.reshape(n, nh * hd))


class QwenSlotStep(_Slots):
    """Decode of one token for any set of live slots of a (loaded) Qwen3-Next / Qwen3.5 text model
    (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``).

    Owns, on the model's device: a :class:`ReplayStateCache` of every Gated DeltaNet layer
    (``ReplayStateCache.for_gdn``, ``cursor="standard"``: the standard GDN decode kernel on the (slots,)
    cursor; its conv windows over q | k | v), the K/V rows and lengths of :class:`_Slots`. Per layer (pre-norm, residual):
      G  the model's projections -> q | k | v, z, b, a; cache.gdn_conv_update (silu); cache.gdn_verify
         (output from checkpoint + buffers, the entry appended, the buffers folded by the step that fills them);
         the gated RMSNorm(y, z); out_proj
      *  the gated attention of builders/gdn_step.py (q/k norm, partial RoPE at the row's position, the
         output gate), on the rows' gathered K/V; only the new position is written back
      then post-norm and the transformers MLP / MoE module, as the model calls it in decode.
    The layer code is builders/gdn_step.py's (``QwenGDNDecodeStep``: the same attention and rotary table
    the exported engines run), so the two routes cannot drift apart.
    """

    def __init__(self, model, num_slots: int, max_seq_len: int, buffer_len: int = 16, check_values: bool | None = False,
                 shadow: str = "none"):
        from builders.gdn_step import QwenGDNDecodeStep
        from builders.qwen3_next import gdn_layers

        cfg = model.config
        shadow_dtype = _shadow_dtype(shadow, ("none", "bf16"))
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
        bad = sorted({t for t in cfg.layer_types if t not in ("linear_attention", "full_attention")})
        if bad:
            raise ValueError(f"layer_types: expected linear_attention or full_attention, got {bad}")
        self.model, self.cfg = model, cfg
        p = next(model.parameters())
        self.device, self.act = p.device, p.dtype
        self.kinds = list(cfg.layer_types)
        self.num_slots, self.max_seq_len, self.vocab = num_slots, max_seq_len, cfg.vocab_size
        self.gdn = gdn_layers(model)
        if not self.gdn:
            raise ValueError("layer_types: expected at least one Gated DeltaNet (linear_attention) layer")
        self.attn = [i for i, k in enumerate(self.kinds) if k == "full_attention"]
        self.layer_code = QwenGDNDecodeStep(model, buffer_len, max_seq_len)
        H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.H, self.HV, self.Kd, self.V = H, HV, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.cache = ReplayStateCache.for_gdn(len(self.gdn), num_slots, HV, H, self.V, self.Kd, buffer_len, num_draft=0,
                                              conv_kernel=cfg.linear_conv_kernel_dim, act_dtype=self.act,
                                              device=self.device, check_values=check_values, cursor="standard",
                                              shadow_dtype=shadow_dtype, read_shadow=shadow_dtype is not None)
        self.consts = {}
        for j, i in enumerate(self.gdn):
            mx = model.model.layers[i].linear_attn
            self.consts[i] = dict(j=j, A_log=mx.A_log.detach().float().contiguous(),
                                  dt_bias=mx.dt_bias.detach().float().contiguous(),
                                  conv_w=mx.conv1d.weight.detach()[:, 0, :].contiguous(),
                                  conv_b=None if mx.conv1d.bias is None else mx.conv1d.bias.detach())
        self._init_slots(num_slots, max_seq_len, cfg.num_key_value_heads, cfg.head_dim)

    @torch.no_grad()
    def __call__(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits (rows, vocab) fp32 of ``tokens[r]`` appended to the sequence in ``slots[r]`` (as SlotStep)."""
        sbi = torch.tensor(slots, dtype=torch.int32, device=self.device)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        rows = sbi.long()
        pos = self.lengths.index_select(0, rows)  # (n,): where the token goes
        m = self.model.model
        h = m.embed_tokens(ids)[:, None]  # (n, 1, hidden)
        cos_sin = self.layer_code._rope(pos[:, None])
        self.cache.flush(sbi, 1, [])
        try:
            for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
                res = h
                hn = layer.input_layernorm(h)
                if kind == "linear_attention":
                    out = self._gdn(i, layer.linear_attn, hn, sbi)
                else:
                    out = self._attention(i, layer, hn, rows, pos, cos_sin)
                h = res + out
                mo = layer.mlp(layer.post_attention_layernorm(h))
                h = h + (mo[0] if isinstance(mo, tuple) else mo)  # a MoE block may return (hidden, router logits)
            logits = self.model.lm_head(m.norm(h))[:, 0].float()
        except BaseException:
            self.cache.abort_step()  # the caller drops these rows' sequences; the next step must still open
            raise
        self.cache.commit(sbi, None, 1)  # every row accepts its token: the cursor advances
        self.lengths.index_add_(0, rows, torch.ones_like(rows))
        return logits

    def _gdn(self, i, mx, hn, sbi):
        from builders.qwen3_next import _projections

        c, n = self.consts[i], hn.shape[0]
        H, HV, Kd, V = self.H, self.HV, self.Kd, self.V
        mixed, z, b, a = _projections(mx, hn)
        conv = self.cache.gdn_conv_update(c["j"], mixed.contiguous(), c["conv_w"], c["conv_b"], sbi).to(hn.dtype)
        q, k, v = conv.split([mx.key_dim, mx.key_dim, mx.value_dim], dim=-1)
        y = self.cache.gdn_verify(c["j"], q.reshape(n, 1, H, Kd).contiguous(), k.reshape(n, 1, H, Kd).contiguous(),
                                  v.reshape(n, 1, HV, V).contiguous(), a.reshape(n, 1, HV).contiguous(),
                                  b.reshape(n, 1, HV).contiguous(), c["A_log"], c["dt_bias"], sbi)
        core = mx.norm(y.reshape(n * HV, V).to(hn.dtype), z.reshape(n * HV, V))
        return mx.out_proj(core.reshape(n, 1, HV * V))

    def _attention(self, i, layer, hn, rows, pos, cos_sin):
        keys, vals = self.k[i].index_select(0, rows), self.v[i].index_select(0, rows)  # (n, kvh, S, hd)
        out, keys, vals = self.layer_code._attention(layer, hn, keys, vals, pos, cos_sin)
        at = torch.arange(rows.shape[0], device=rows.device)
        self.k[i][rows, :, pos] = keys[at, :, pos]  # one position per row, in place
        self.v[i][rows, :, pos] = vals[at, :, pos]
        return out


def slot_step(model, num_slots: int, max_seq_len: int, buffer_len: int = 16, check_values: bool | None = False,
              shadow: str = "none"):
    """The slot step of the model's family: :class:`QwenSlotStep` for Qwen3-Next / Qwen3.5, else
    :class:`SlotStep` (Nemotron-H, Nemotron 3). ``shadow`` "bf16" / "fp8" (Mamba-2 only): the cache keeps a
    low-precision shadow of each checkpoint that non-flush steps read (the kernels' shadow modes; the CPU
    reference reads it too)."""
    cls = QwenSlotStep if hasattr(model.config, "linear_num_value_heads") else SlotStep
    return cls(model, num_slots, max_seq_len, buffer_len, check_values, shadow)


def _shadow_dtype(shadow: str, allowed: tuple):
    if shadow not in allowed:
        raise ValueError(f"shadow (config.pbtxt parameters['shadow'], make_triton_repo --shadow): expected one of "
                         f"{allowed} for this model (fp8: Mamba-2 models only), got {shadow!r}")
    return None if shadow == "none" else SHADOW_DTYPES[shadow]


# ---- sequences -> slots -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Sequence:
    corrid: int
    slot: int
    length: int = 0  # tokens in the cache
    last_used: float = 0.0


class SequenceTable:
    """CORRID -> :class:`Sequence`; ``allocate()`` / ``free(slot)`` are the step's. ``idle_s``: Triton's
    max_sequence_idle_microseconds in seconds. ``clock`` is injectable for the tests."""

    def __init__(self, allocate, free, num_slots: int, max_seq_len: int, idle_s: float, clock=time.monotonic,
                 log=None, remember: int = 4096):
        self._allocate, self._free = allocate, free
        self.num_slots, self.max_seq_len, self.idle_s, self.clock = num_slots, max_seq_len, idle_s, clock
        self.live: dict[int, Sequence] = {}
        self.gone: OrderedDict[int, str] = OrderedDict()  # recently ended / expired CORRIDs -> why
        self._remember, self._log = remember, log or (lambda msg: None)

    def _forget(self, corrid: int, why: str) -> None:
        seq = self.live.pop(corrid)
        self._free(seq.slot)
        self.gone[corrid] = why
        self.gone.move_to_end(corrid)
        while len(self.gone) > self._remember:
            self.gone.popitem(last=False)

    def expire(self, now: float) -> list[int]:
        """Free every sequence idle for longer than idle_s; returns their CORRIDs."""
        old = [c for c, s in self.live.items() if now - s.last_used > self.idle_s]
        for c in old:
            self._forget(c, f"idle for more than {self.idle_s:g} s (max_sequence_idle_microseconds)")
            self._log(f"sequence {c}: idle timeout, slot freed")
        return old

    def admit(self, corrid: int, start: bool, now: float) -> Sequence:
        """The sequence this request continues (START: a new one in a fresh slot). Raises RequestError."""
        if start:
            if corrid in self.live:  # a START for a live CORRID begins again from zeros
                self._log(f"sequence {corrid}: START while live, restarted in a fresh slot")
                self._forget(corrid, "restarted")
            if len(self.live) >= self.num_slots:
                # Triton keeps at most max_candidate_sequences live, so it has dropped one we still hold
                lru = min(self.live.values(), key=lambda s: s.last_used)
                self._log(f"sequence {lru.corrid}: no free slot for {corrid}; freed as timed out by Triton")
                self._forget(lru.corrid, "dropped for a new sequence after its idle timeout")
            seq = self.live[corrid] = Sequence(corrid, self._allocate(), 0, now)
            self.gone.pop(corrid, None)
            return seq
        seq = self.live.get(corrid)
        if seq is None:
            why = self.gone.get(corrid)
            if why is not None:
                raise RequestError(f"sequence {corrid} is over ({why}); send sequence_start=True to begin a new one")
            raise RequestError(f"sequence {corrid} is unknown: its first request must carry sequence_start=True")
        seq.last_used = now
        return seq

    def check_room(self, seq: Sequence, pending: int = 0) -> None:
        """Room for one more token after the ``pending`` ones this batch already holds for the sequence."""
        if seq.length + pending >= self.max_seq_len:
            held = f"{seq.length} tokens" + (f" + {pending} earlier in this batch" if pending else "")
            raise RequestError(f"sequence {seq.corrid} holds {held} = max_seq_len {self.max_seq_len}: "
                               f"no room for another; end it (sequence_end=True) and start a new one")

    def end(self, corrid: int, why: str = "ended by sequence_end") -> None:
        if corrid in self.live:
            self._forget(corrid, why)


# ---- the Triton adapter ---------------------------------------------------------------------------------------
def _param(cfg: dict, key: str, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    if v is None or v == "":
        if default is None:
            raise ValueError(f"config.pbtxt: parameters[{key!r}] is missing")
        return default
    return v


def load_model(params: dict, device: torch.device):
    """The model of the repository's parameters: ``model_dir`` (an HF checkpoint: Nemotron-H / Nemotron 3,
    or Qwen3-Next / Qwen3.5 by its config.json) or the embedded tiny config ``tiny`` (builders/nemotron_h.py's
    or builders/qwen3_next.py's) with seeded weights ``seed``, in ``dtype``, on ``device``."""
    from builders.nemotron_h import load_nemotron_h
    from builders.qwen3_next import FAMILIES, is_gdn_checkpoint, load_gdn_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[params["dtype"]]
    model_dir = params.get("model_dir") or None
    tiny, seed = params.get("tiny") or "nemotron_h", int(params.get("seed", 0))
    if (model_dir is None and tiny in FAMILIES) or (model_dir is not None and is_gdn_checkpoint(model_dir)):
        return load_gdn_model(model_dir, tiny, dtype=dtype, seed=seed, device=device)
    return load_nemotron_h(model_dir, dtype=dtype, seed=seed, device=device, tiny=tiny)


class PbModel:
    """What both Python-backend models (this one and builders/triton_generate.py's streaming one) do with ``self.pb``
    (triton_python_backend_utils or a test's stand-in): log, and make an error response."""

    pb = None

    def _warn(self, msg: str, info: bool = False) -> None:
        logger = getattr(self.pb, "Logger", None)
        if logger is not None:
            (logger.log_info if info else logger.log_warn)(msg)

    def _error(self, msg: str):
        err = self.pb.TritonError
        code = getattr(err, "INVALID_ARG", None)
        return self.pb.InferenceResponse(error=err(msg) if code is None else err(msg, code))


class SequenceModel(PbModel):
    """What ``TritonPythonModel`` does, with the ``triton_python_backend_utils`` module ``pb`` passed in
    (tests pass a stand-in). ``args``: Triton's initialize() arguments (model_config JSON, instance kind
    and device id)."""

    def __init__(self, pb, args: dict, clock=time.monotonic, model=None):
        self.pb = pb
        cfg = json.loads(args["model_config"])
        keys = ("model_dir", "tiny", "seed", "dtype", "device", "buffer_len", "max_seq_len")
        self.params = {k: _param(cfg, k, "") if k in ("model_dir", "tiny") else _param(cfg, k) for k in keys}
        if self.params["device"] == "cuda":
            self.device = torch.device("cuda", int(args.get("model_instance_device_id", 0) or 0))
        elif self.params["device"] == "cpu":
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"config.pbtxt: parameters['device']: expected 'cpu' or 'cuda', got {self.params['device']!r}")
        sb = cfg.get("sequence_batching", {})
        slots = int(sb.get("oldest", {}).get("max_candidate_sequences", 0))
        if slots < 1:
            raise ValueError("config.pbtxt: expected sequence_batching.oldest.max_candidate_sequences >= 1 (one cache "
                             "slot per candidate sequence)")
        idle_s = int(sb.get("max_sequence_idle_microseconds", 0) or 1_000_000) / 1e6  # Triton's default: 1 s
        self.model = model if model is not None else load_model(self.params, self.device)
        self.params["shadow"] = _param(cfg, "shadow", "none")  # absent in repositories written before the option
        self.step = slot_step(self.model, slots, int(self.params["max_seq_len"]), int(self.params["buffer_len"]),
                             check_values=None if self.device.type == "cpu" else False, shadow=self.params["shadow"])
        self.table = SequenceTable(self.step.allocate, self.step.free, slots, int(self.params["max_seq_len"]), idle_s,
                                   clock=clock, log=self._warn)
        self.clock = clock
        self._warn(f"ReplaySSM sequence model: {slots} slots, max_seq_len {self.params['max_seq_len']}, L = "
                   f"{self.params['buffer_len']}, {'kernels' if self.step.cache.uses_kernels else 'float64 reference'} "
                   f"on {self.device}, cache {self.step.cache.bytes_per_slot() / 2**20:.2f} MiB per slot; Python "
                   f"{sys.version.split()[0]}, numpy {getattr(sys.modules.get('numpy'), '__version__', 'not loaded')} "
                   f"(tensors through DLPack)", info=True)

    def _scalar(self, request, name: str) -> int:
        t = self.pb.get_input_tensor_by_name(request, name)
        if t is None:
            raise RequestError(f"input {name!r} is missing")
        v = torch.from_dlpack(t.to_dlpack()).reshape(-1)  # DLPack, not numpy: see the module docstring
        if v.numel() != 1:
            raise RequestError(f"input {name!r}: expected one value per request (sequence batching), got {v.numel()}")
        return int(v[0].item())

    def _out(self, name: str, t: torch.Tensor):
        return self.pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(t.contiguous()))

    def execute(self, requests) -> list:
        now = self.clock()
        self.table.expire(now)
        responses: list = [None] * len(requests)
        rows = []  # (request index, Sequence, token) admitted, not yet run
        ends = set()  # CORRIDs whose END came with a request of this batch, not yet applied
        for r, req in enumerate(requests):
            try:
                start, end, ready, corrid = (self._scalar(req, c) for c in CONTROLS)
                # A request after its sequence's END, or a START that frees a slot (a restart, or no free slot: the
                # least recently used goes), would free a sequence that earlier rows of this batch still hold and
                # hand its slot to a new one: run those rows and apply those ENDs first, in request order.
                if corrid in ends or (rows and start and (corrid in self.table.live
                                                          or len(self.table.live) >= self.table.num_slots)):
                    self._run(rows, responses)
                    rows = []
                    for c in ends:
                        self.table.end(c)
                    ends.clear()
                if end:
                    ends.add(corrid)  # the client ends the sequence whatever happens to this token
                if not ready:
                    raise RequestError(f"sequence {corrid}: READY = 0 (no input in this batch slot)")
                seq = self.table.admit(corrid, bool(start), now)
                token = self._scalar(req, INPUT_IDS)
                if not 0 <= token < self.step.vocab:
                    raise RequestError(f"sequence {corrid}: input_ids: expected a token in [0, {self.step.vocab}), "
                                       f"got {token}")
                # rows of this sequence admitted earlier in the batch run first (later rounds in _run)
                self.table.check_room(seq, sum(row[1] is seq for row in rows))
                rows.append((r, seq, token))
            except RequestError as e:
                responses[r] = self._error(str(e))
        self._run(rows, responses)
        for corrid in ends:
            self.table.end(corrid)
        return responses

    def _run(self, rows, responses) -> None:
        """Steps over ``rows`` (request index, Sequence, token): one row per sequence per step, in order."""
        while rows:  # the oldest strategy sends one request per sequence per batch; more go in later rounds
            batch, later, seen = [], [], set()
            for row in rows:
                (later if row[1].corrid in seen else batch).append(row)
                seen.add(row[1].corrid)
            rows = later
            try:
                logits = self.step([s.slot for _, s, _ in batch], [t for _, _, t in batch]).cpu()
            except Exception as e:  # the rows' state is undefined after a failed step: drop those sequences
                why = f"step failed ({type(e).__name__}: {e})"
                for r, seq, _ in batch:
                    responses[r] = self._error(f"sequence {seq.corrid}: {why}; the sequence was dropped, start it again")
                    self.table.end(seq.corrid, why)
                dropped = {id(seq) for _, seq, _ in batch}  # their later rows would run on a freed slot
                for r, seq, _ in rows:
                    if id(seq) in dropped:
                        responses[r] = self._error(f"sequence {seq.corrid}: an earlier request of this batch: {why}; "
                                                   f"the sequence was dropped, start it again")
                rows = [row for row in rows if id(row[1]) not in dropped]
                continue
            for b, (r, seq, _) in enumerate(batch):
                seq.length += 1
                slot = torch.tensor([[seq.slot]], dtype=torch.int32)
                responses[r] = self.pb.InferenceResponse(output_tensors=[self._out(LOGITS, logits[b:b + 1].clone()),
                                                                         self._out(SLOT, slot)])

    def finalize(self) -> None:
        self.table.live.clear()
