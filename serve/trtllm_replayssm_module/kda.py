# SPDX-License-Identifier: Apache-2.0
"""Kimi Delta Attention (KDA) models under trtllm-serve: Kimi-Linear / Kimi-K3 text (``KimiLinearForCausalLM``) and
GLM-5 Next (GLM-5.3-Flash, ``Glm5NextForCausalLM`` / ``Glm5NextForConditionalGeneration``) with ReplaySSM decode.

Both TensorRT-LLM models build their KDA layers from one mixer class, ``KimiKDALinearAttention``
(tensorrt_llm/_torch/modules/kimi_kda/kimi_kda_mixer.py, read at 0790edf6; modeling_glm5_next.py 044d703d imports it
for GLM-5 Next), whose single-token decode calls ``self._dispatch.decode_kda(...)`` (a per-instance
``KDAKernelDispatch``) in both its fast path (``forward_decode``: fused projections, the live pools addressed by slot,
``update_conv_cache=True``) and its unfused fallback (``forward_decode_fallback``, optimized branch: batch-dense conv
windows, ``update_conv_cache=False``); the fallback's other branch (``decode_kernel_path != "optimized"``) calls fla's
``fused_recurrent_kda`` itself. Route: :func:`route_kda_mixers` gives every such mixer a :class:`ReplayDispatch`, which
delegates everything to TensorRT-LLM's dispatch except ``decode_kda`` (:meth:`KDAReplayAdapter.decode_kda`) and
``decode_kernel_path`` (always "optimized", so both decode paths reach ``decode_kda`` on any GPU our kernels run on).
Prefill (``prefill_chunk_kda``), speculative verify and everything else stay TensorRT-LLM's.

``decode_kda``'s arguments (TensorRT-LLM's, as both call sites pass them) and what we do with them:

=====================  ==============================================  ==========================================
argument               TensorRT-LLM                                     ReplaySSM
=====================  ==============================================  ==========================================
x_q, x_k, x_v          (1, B, H, D) pre-conv projections                the conv input u = q | k | v
w_q_t, w_k_t, w_v_t    (W, H D) transposed depthwise conv weights       (3 H D, W) conv weight
bias_q, bias_k, bias_v None (the checkpoint has none)                   the conv bias if given
cs_q, cs_k, cs_v       the last W - 1 conv inputs: pool section views   ``cache.conv_update_rows`` over the
                       [slots, H D, W - 1] (update_conv_cache=True, the gathered windows (silu); the new window
                       kernel rolls them) or batch-dense [B, ...]        written back when update_conv_cache
A_log, dt_bias         (H,) fp32, (H D,) fp32                           A_log, dt_bias (H, D)
g, beta                (1, B, H, D) raw f_b(f_a(x)); (1, B, H) raw      f, b (gates computed inside our step:
                       b_proj(x), ``use_beta_sigmoid_in_kernel``         Kimi softplus, or GLM's bounded sigmoid
                       True; ``lower_bound`` GLM-5 Next's gate bound     with ``lower_bound``)
state                  the recurrent-state pool [slots, H, V, K] fp32   read only at the prefill hand-off
                       (V-first), ``ssm_state_indices`` (B,) int32       (transposed into our checkpoint)
scale                  D^-1/2                                           scale (q, k l2-normalised inside)
onorm_g, onorm_weight  (1, B, H, D) output gate, (D,) fp32 weight,     y -> RMSNorm(y) * weight * sigmoid(gate)
onorm_eps              the gated RMSNorm after the core                 (the layer's o_norm), in x's dtype
out                    (B, 1, H, D) or None                             written (or a new tensor), returned
=====================  ==============================================  ==========================================

State (:class:`KDAReplayAdapter`): a standard-cursor :class:`~trtllm_replayssm.cache.ReplayStateCache` of every
routed KDA layer (``for_family("kda", ..., conv_dim=0)``: fp32 checkpoint (S, H, K, V), rings of L entries, an
optional bf16 shadow), one slot per row of TensorRT-LLM's pool, allocated at the first use (before any CUDA-graph
capture: TensorRT-LLM's warm-up runs eagerly). Our checkpoint is the fla / transformers (K, V) layout while
TensorRT-LLM's pool is V-first, so the pool cannot be the checkpoint in place (as it is for Mamba-2): the pool is
read once per prefill, at :meth:`KDAReplayAdapter.end_step` of the step whose prefill (or prefill chunk) wrote it
(``ReplayStateCache.load_prefill`` of the transposed state: checkpoint, empty rings, cursor 0), and never written
by decode. That is one more fp32 state per slot and layer (a V-first checkpoint in the KDA kernels would remove it).
The conv windows stay TensorRT-LLM's (its pool; we roll them as its kernel does).

Step protocol (:func:`kda_replay_step`, around the model's ``forward(attn_metadata, ...)``): the first KDA layer's
``decode_kda`` of a step opens the cache step on its slot tensor (every later layer must be handed the same one),
each layer's call verifies that layer, ``end_step`` commits (the cursor advances once) and then hands the step's
prefill slots over (a host read of ``state_indices[:num_contexts]``: prefill steps are never graph-captured). A step
with decode rows in which no KDA layer reached the adapter raises (the mixer decodes some other way). Every decode row
has a slot (TensorRT-LLM's CUDA-graph padding rows are dummy requests with real slots); ``check_values`` refuses -1.

Refused, by name: a speculative config (verify is TensorRT-LLM's and would read its pool, which decode no longer
updates), a bf16 state pool or a batch-dense state (``ssm_state_indices`` None: no slots to find our rings by;
``TLLM_KDA_ENABLE_INDEXED_STATE_POOL=1`` and ``mamba_ssm_cache_dtype: float32``), multi-token decode, block reuse, a
cache manager that moves live requests between slots but exposes no relocation hook we follow
(:func:`.install.check_cache_manager`), a fp8 shadow (no fp8 KDA shadow).

Relocation (the V2 managers, which GLM-5 Next's TensorRT-LLM class prefers): :func:`.install.follow_relocation` wraps
the manager's hook (its strategy's ``relocate_slots``, 28295084) so that :meth:`KDAReplayAdapter.relocate` moves the
moved slots' checkpoint, shadow, rings and cursor (``ReplayStateCache.move_slots``) right after TensorRT-LLM moved the
request's pages, between steps. The V2 per-layer views are strided (a slot stride of several states); nothing here
assumes otherwise (the pool is read per slot, the conv windows through index_select / index_copy_).

Load-time check (:func:`check_kda_mixer_class`): the mixer's source must call ``self._dispatch.decode_kda(...)`` and
no KDA decode kernel directly (``torch.ops.trtllm.kda_decode``); ``fused_recurrent_kda`` is allowed (the branch our
``decode_kernel_path`` turns off). Only this module needs tensorrt_llm, and only in :func:`register_kda`.
"""

from __future__ import annotations

import ast
import logging
import os

import torch

from trtllm_replayssm.cache import ReplayStateCache, conv_update_rows

from .check import method_calls, tensorrt_llm_version
from .install import _env_choice, _env_int, check_cache_manager, decode_rows, prefill_slots

log = logging.getLogger("trtllm_replayssm_module")

MIXER_MODULE = "tensorrt_llm._torch.modules.kimi_kda.kimi_kda_mixer"
MIXER_CLASS = "KimiKDALinearAttention"
# architecture -> TensorRT-LLM module defining it (models/_arch_index.py 065ff9e9; modeling_glm5_next.py 044d703d)
ARCHITECTURES = {"KimiLinearForCausalLM": "tensorrt_llm._torch.models.modeling_kimi_linear",
                 "Glm5NextForCausalLM": "tensorrt_llm._torch.models.modeling_glm5_next",
                 "Glm5NextForConditionalGeneration": "tensorrt_llm._torch.models.modeling_glm5_next"}
HOOK_ATTR, HOOK_CALL = "_dispatch", "decode_kda"
BYPASS_CALLS = frozenset({"kda_decode"})  # torch.ops.trtllm.kda_decode called past the dispatch
SHADOWS = ("none", "bf16")
VERIFIED_AGAINST = ("kimi_kda_mixer.py 0790edf6 (2026): forward_decode and forward_decode_fallback call "
                    "self._dispatch.decode_kda(...); modeling_kimi_linear.py 000a860d / KimiKDARuntime; "
                    "modeling_glm5_next.py 044d703d (KimiKDALinearAttention); read from source, not run")
KDA_CLASSES: dict = {}  # architecture -> the registered class, once register_kda() ran

_EXTRA_OK = ("verbose", "cu_seqlens")  # decode_kda arguments with no effect on the math


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, dtype) -> torch.Tensor:
    """The KDA layers' output norm (transformers' ``KimiLinearRMSNormGated`` / ``Glm5NextTextRMSNormGated``, fla's
    ``FusedRMSNormGated``): RMSNorm over the head dim in fp32 (float64 if y is), times weight, times sigmoid(gate)."""
    ct = torch.promote_types(y.dtype, torch.float32)
    y = y.to(ct)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.to(ct)
    return (y * torch.sigmoid(gate.to(ct))).to(dtype)


class KDAReplayAdapter:
    """ReplaySSM state of the KDA layers behind TensorRT-LLM's ``decode_kda`` (module docstring). ``layers``: the
    routed layer_idx (set by :func:`route_kda_mixers`); ``act_dtype``: the activations' dtype (the rings of k, v)."""

    def __init__(self, buffer_len: int = 16, shadow: str = "none", check_values: bool = False):
        if not isinstance(buffer_len, int) or isinstance(buffer_len, bool) or not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected an int in 1..32, got {buffer_len!r}")
        if shadow not in SHADOWS:
            raise ValueError(f"shadow: expected one of {SHADOWS} for Kimi Delta Attention (there is no fp8 KDA "
                             f"shadow), got {shadow!r}")
        self.buffer_len, self.shadow, self.check_values = buffer_len, shadow, check_values
        self.layers: tuple[int, ...] = ()
        self.act_dtype: torch.dtype | None = None
        self.cache: ReplayStateCache | None = None
        self._pools: dict[int, tuple] = {}  # layer_idx -> identity of the pool the cache was sized from
        self.checked_manager = None
        self.abort_step()

    # ---- allocation -------------------------------------------------------------------------------------------
    def set_layers(self, layers, act_dtype: torch.dtype) -> None:
        self.layers, self.act_dtype = tuple(sorted(layers)), act_dtype
        self.index = {l: j for j, l in enumerate(self.layers)}
        self.reset()

    def reset(self) -> None:
        """Forget the cache (a new state pool: every slot starts again from its prefill)."""
        self.cache, self._pools = None, {}
        self.abort_step()

    def _check_layer(self, layer_idx: int) -> int:
        j = getattr(self, "index", {}).get(layer_idx)
        if j is None:
            raise RuntimeError(f"layer {layer_idx}: a decode_kda call from a layer that was not routed (routed KDA "
                               f"layers: {list(self.layers)})")
        return j

    def _ensure(self, layer_idx: int, pool: torch.Tensor) -> ReplayStateCache:
        """The cache, sized from ``pool`` [slots, H, V, K] at the first use; a pool that changed (TensorRT-LLM
        re-creates its cache manager after memory estimation) starts a new cache."""
        if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
            raise ValueError(f"state: expected the recurrent-state pool (slots, H, V, K), got "
                             f"{tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__}")
        key = (pool.data_ptr(), tuple(pool.shape), pool.dtype)
        if self._pools.get(layer_idx, key) != key:
            if _capturing():
                raise RuntimeError(f"state: layer {layer_idx}'s recurrent-state pool changed during CUDA-graph capture")
            self.reset()
        if pool.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"state: ReplaySSM loads its fp32 checkpoint from an fp32 state pool (kv_cache_config "
                             f"mamba_ssm_cache_dtype: float32), got {str(pool.dtype).replace('torch.', '')}")
        S, H, V, K = pool.shape
        if self.cache is None:
            if _capturing():
                raise RuntimeError("KDA ReplaySSM state would be allocated inside a CUDA-graph capture; run one eager "
                                   "step first, or disable CUDA graphs")
            cuda = pool.device.type == "cuda"
            shadow = torch.bfloat16 if self.shadow == "bf16" else None
            self.cache = ReplayStateCache.for_family(
                "kda", len(self.layers), S, (H, K, V), self.buffer_len, conv_dim=0, cursor="standard",
                state_dtype=pool.dtype, act_dtype=self.act_dtype or torch.bfloat16, device=pool.device,
                check_values=self.check_values if cuda else None, shadow_dtype=shadow, read_shadow=shadow is not None)
            for _ in range(S):  # every pool row is a slot for good: TensorRT-LLM hands them out
                self.cache.allocate()
        elif (self.cache.num_slots, *self.cache.layer(0).buf.state.shape[2:]) != (S, K, V):
            raise ValueError(f"state: layer {layer_idx}'s pool is (slots, H, V, K) = {tuple(pool.shape)}, but the "
                             f"other KDA layers' give {self.cache.num_slots} slots of (K, V) = "
                             f"{tuple(self.cache.layer(0).buf.state.shape[2:])}")
        self._pools[layer_idx] = key
        return self.cache

    def relocate(self, src: list[int], dst: list[int]) -> None:
        """Slot ``dst[i]`` takes slot ``src[i]``'s checkpoint, shadow, rings and cursor in every KDA layer
        (``ReplayStateCache.move_slots``: sources read before destinations are written). Called by
        :func:`.install.follow_relocation` between steps, after TensorRT-LLM moved the request (its conv windows and
        pool rows are TensorRT-LLM's); nothing to do before the cache exists."""
        if self._decoded or self._sbi is not None:
            raise RuntimeError("relocate: a model step is open (a decode_kda call without end_step()); TensorRT-LLM "
                               "relocates slots between steps")
        if self.cache is None or not src:
            return
        self.cache.move_slots(list(src), list(dst), "relocate")

    # ---- one model step -------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self._decoded:
            raise RuntimeError(f"begin_step: the previous step decoded KDA layers {sorted(self._decoded)} but was not "
                               "closed by end_step()")

    def abort_step(self) -> None:
        """Drop the step (the forward raised): its slots must be prefilled again before they decode."""
        if getattr(self, "cache", None) is not None:
            self.cache.abort_step()
        self._sbi, self._sbi_key, self._decoded = None, None, set()

    def _step_sbi(self, layer_idx: int, idx: torch.Tensor, batch: int) -> torch.Tensor:
        if layer_idx in self._decoded:
            raise RuntimeError(f"layer {layer_idx}: decoded twice in one model step; begin_step()/end_step() are not "
                               "being called around the model forward")
        if not isinstance(idx, torch.Tensor) or tuple(idx.shape) != (batch,):
            raise ValueError(f"ssm_state_indices: expected ({batch},) slots, got "
                             f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__}")
        key = (idx.data_ptr(), tuple(idx.shape), idx.stride(), idx.dtype)
        if self._sbi is None:
            self._sbi = idx if idx.dtype == torch.int32 else idx.int()
            self._sbi_key = key
            if self.check_values and not _capturing() and bool((self._sbi < 0).any()):
                raise ValueError(f"ssm_state_indices: expected a slot for every decode row, got {self._sbi.tolist()}")
            self.cache.flush(self._sbi, 1, None)
        elif key != self._sbi_key:
            raise RuntimeError(f"ssm_state_indices: layer {layer_idx} got a different slot tensor than the step's "
                               "first KDA layer; expected one slot tensor per step")
        self._decoded.add(layer_idx)
        return self._sbi

    def end_step(self, prefill=None, pool_of=None) -> frozenset:
        """Close a model step: commit the decode rows (the cursor advances once), then hand over the prefill slots
        ``prefill`` (a tensor or list, -1 padding) from ``pool_of(layer_idx)``, the pool TensorRT-LLM's prefill wrote.
        Returns the KDA layers that decoded."""
        decoded, sbi = frozenset(self._decoded), self._sbi
        try:
            if sbi is not None:
                missing = sorted(set(self.layers) - decoded)
                if missing:
                    raise RuntimeError(f"end_step: KDA layers {missing} made no decode_kda call this step (routed: "
                                       f"{list(self.layers)}); their rings would miss the step's token")
                self.cache.commit(sbi, None, 1)
        except BaseException:
            self.abort_step()
            raise
        self._sbi, self._sbi_key, self._decoded = None, None, set()
        slots = [] if prefill is None else [int(s) for s in
                                             (prefill.tolist() if isinstance(prefill, torch.Tensor) else prefill)]
        slots = [s for s in slots if s >= 0]
        if slots and self.layers:
            if pool_of is None:
                raise ValueError("pool_of: a step with prefill rows needs the layers' state pools")
            for layer_idx in self.layers:
                pool = pool_of(layer_idx)
                cache = self._ensure(layer_idx, pool)
                for s in slots:  # TensorRT-LLM's V-first (H, V, K) -> our (H, K, V)
                    cache.load_prefill(s, self.index[layer_idx], pool[s].transpose(-1, -2))
        return decoded

    # ---- the decode call --------------------------------------------------------------------------------------
    def decode_kda(self, layer_idx: int, *, x_q, x_k, x_v, w_q_t, w_k_t, w_v_t, cs_q, cs_k, cs_v, A_log, g, dt_bias,
                   beta, state, onorm_g, onorm_weight, out=None, ssm_state_indices=None, scale=None,
                   onorm_eps: float = 1e-6, lower_bound=None, use_beta_sigmoid_in_kernel: bool = True,
                   update_conv_cache: bool = False, bias_q=None, bias_k=None, bias_v=None, **extra):
        """One single-token KDA decode of layer ``layer_idx`` with TensorRT-LLM's ``decode_kda`` arguments (module
        docstring); returns the post-norm core (B, 1, H, D) (``out`` when given)."""
        j = self._check_layer(layer_idx)
        for k in extra:
            if k not in _EXTRA_OK:
                raise TypeError(f"decode_kda: unexpected argument {k!r}")
        if not use_beta_sigmoid_in_kernel:
            raise NotImplementedError("use_beta_sigmoid_in_kernel: expected True (beta arrives as the raw b_proj "
                                      "logit; the ReplaySSM step applies the sigmoid), got False")
        if not isinstance(x_q, torch.Tensor) or x_q.dim() != 4 or x_q.shape[0] != 1:
            raise NotImplementedError(f"x_q: expected single-token (1, batch, H, D), got "
                                      f"{tuple(x_q.shape) if isinstance(x_q, torch.Tensor) else type(x_q).__name__} "
                                      "(multi-token / speculative verify is not routed to ReplaySSM)")
        _, B, H, D = x_q.shape
        for name, t in (("x_k", x_k), ("x_v", x_v), ("g", g), ("onorm_g", onorm_g)):
            if tuple(t.shape) != (1, B, H, D):
                raise ValueError(f"{name}: expected (1, {B}, {H}, {D}) like x_q, got {tuple(t.shape)}")
        if tuple(beta.shape) != (1, B, H):
            raise ValueError(f"beta: expected (1, {B}, {H}), got {tuple(beta.shape)}")
        if ssm_state_indices is None:
            raise NotImplementedError("ssm_state_indices: None (a batch-dense state names no slots, and ReplaySSM's "
                                      "rings are per slot): serve with TLLM_KDA_ENABLE_INDEXED_STATE_POOL=1 and an fp32 "
                                      "state pool (mamba_ssm_cache_dtype: float32)")
        if isinstance(state, torch.Tensor) and state.dim() == 4 and tuple(state.shape[1:]) != (H, D, D):
            raise ValueError(f"state: expected a pool (slots, {H}, {D}, {D}) (V-first, V = K = D), got "
                             f"{tuple(state.shape)}")
        if out is not None and (not isinstance(out, torch.Tensor) or out.numel() != B * H * D):
            raise ValueError(f"out: expected {B * H * D} elements ({B}, 1, {H}, {D}), got "
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
        cache = self._ensure(layer_idx, state)
        ring = cache.layer(j).buf.k_cache.dtype
        if ring != x_q.dtype:
            raise ValueError(f"x_q: expected {ring} activations (the k / v rings', the model's dtype), got {x_q.dtype}")
        sbi = self._step_sbi(layer_idx, ssm_state_indices, B)

        d = H * D
        W = w_q_t.shape[0]  # the conv width
        if any(tuple(w.shape) != (W, d) for w in (w_q_t, w_k_t, w_v_t)):
            raise ValueError(f"w_q_t, w_k_t, w_v_t: expected ({W}, {d}) each, got "
                             f"{[tuple(w.shape) for w in (w_q_t, w_k_t, w_v_t)]}")
        rows = sbi.long().clamp(min=0) if update_conv_cache else torch.arange(B, device=x_q.device)
        # the three windows' rows, gathered once into (B + 1, 3 d, W - 1) (conv_update_rows' form: a scratch row last)
        win = torch.cat([c.index_select(0, rows) for c in (cs_q, cs_k, cs_v)], dim=1)
        win = torch.cat([win, win.new_zeros(1, *win.shape[1:])])
        u = torch.cat([x.reshape(B, d) for x in (x_q[0], x_k[0], x_v[0])], dim=-1)[:, None]  # (B, 1, 3 d)
        weight = torch.cat([w.t() for w in (w_q_t, w_k_t, w_v_t)])  # (3 d, W)
        bias = None if bias_q is None else torch.cat([bias_q, bias_k, bias_v])
        dst = torch.arange(B, device=x_q.device)
        qkv = conv_update_rows(win, u, weight, bias, dst, W, "silu")[:, 0]  # silu(conv) (B, 3 d), x's dtype
        if update_conv_cache:  # the kernel's contract: the pools' windows roll by one input
            for c, part in zip((cs_q, cs_k, cs_v), win[:B].split(d, dim=1)):
                c.index_copy_(0, rows, part.to(c.dtype))
        q, k, v = (t.reshape(B, H, D).contiguous() for t in qkv.split(d, dim=-1))
        y = cache.verify(j, q[:, None], k[:, None], v[:, None], g[0].reshape(B, 1, H, D).contiguous(),
                         beta[0].reshape(B, 1, H).contiguous(), A_log.float().contiguous(),
                         dt_bias.float().reshape(H, D).contiguous(), state_batch_indices=sbi, use_qk_l2norm=True,
                         scale=scale, lower_bound=lower_bound)[:, 0]  # (B, H, D)
        o = gated_rms_norm(y, onorm_g[0], onorm_weight, onorm_eps, x_q.dtype if out is None else out.dtype)
        if out is None:
            return o[:, None]
        out.copy_(o.reshape(out.shape))
        return out

    # ---- inspection -------------------------------------------------------------------------------------------
    def current_state(self, layer_idx: int, slot: int) -> torch.Tensor:
        """The recurrent state of ``slot`` after its committed tokens, float64, in TensorRT-LLM's (H, V, K) layout."""
        return self.cache.committed_state(self.index[layer_idx], slot).transpose(-1, -2)


class ReplayDispatch:
    """A mixer's ``_dispatch`` with ``decode_kda`` routed to ReplaySSM (module docstring); every other attribute is
    TensorRT-LLM's own dispatch's (``conventional``)."""

    decode_kernel_path = "optimized"  # both decode paths call decode_kda (the fla-only branch is never taken)

    def __init__(self, conventional, adapter: KDAReplayAdapter, layer_idx: int):
        self.conventional, self.adapter, self.layer_idx = conventional, adapter, layer_idx

    def decode_kda(self, **kwargs):
        return self.adapter.decode_kda(self.layer_idx, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["conventional"], name)


def route_kda_mixers(model, mixer_cls, adapter: KDAReplayAdapter) -> list[int]:
    """Give every ``mixer_cls`` module of ``model`` a :class:`ReplayDispatch` on ``adapter``; returns their layer_idx
    (the adapter's layers). The model's activations dtype comes from the first mixer's ``o_proj``."""
    routed, act = [], None
    for m in model.modules():
        if not isinstance(m, mixer_cls):
            continue
        disp = getattr(m, HOOK_ATTR, None)
        if disp is None or not callable(getattr(disp, HOOK_CALL, None)):
            raise RuntimeError(f"{type(m).__name__} (layer {getattr(m, 'layer_idx', '?')}): expected the instance "
                               f"attribute {HOOK_ATTR} with a {HOOK_CALL} method after __init__, found "
                               f"{type(disp).__name__}; TensorRT-LLM {tensorrt_llm_version()} is outside "
                               f"{VERIFIED_AGAINST}")
        if isinstance(disp, ReplayDispatch):
            disp = disp.conventional
        if m.layer_idx in routed:
            raise RuntimeError(f"layer {m.layer_idx}: two {mixer_cls.__name__} modules share one layer_idx")
        setattr(m, HOOK_ATTR, ReplayDispatch(disp, adapter, m.layer_idx))
        routed.append(m.layer_idx)
        if act is None:
            w = getattr(getattr(m, "o_proj", None), "weight", None)
            act = w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else torch.bfloat16
    if not routed:
        raise RuntimeError(f"{type(model).__name__}: found no {mixer_cls.__name__} module; nothing to route")
    adapter.set_layers(routed, act if act in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
                       else torch.bfloat16)
    return sorted(routed)


def check_kda_cache_manager(manager, follow=None) -> str | None:
    """:func:`.install.check_cache_manager` for the KDA route: block reuse refused; a manager that relocates live
    requests (the V2 managers, which GLM-5 Next's TensorRT-LLM class prefers) followed through its relocation hook with
    ``follow`` (:meth:`KDAReplayAdapter.relocate`), refused when it has none; returns the hook followed."""
    return check_cache_manager(manager, follow)


def kda_replay_step(adapter: KDAReplayAdapter, model, mixer_cls, attn_metadata, run):
    """One model step around ``run()``: the step protocol (module docstring) and the first-step check that decode
    rows reached the adapter."""
    manager = getattr(attn_metadata, "kv_cache_manager", None)
    if manager is not None and adapter.checked_manager is not manager:
        check_kda_cache_manager(manager, adapter.relocate)
        adapter.checked_manager = manager
    n_decode = decode_rows(attn_metadata)
    prefill = prefill_slots(attn_metadata)
    adapter.begin_step()
    try:
        out = run()
    except BaseException:
        adapter.abort_step()
        raise
    decoded = adapter.end_step(prefill, None if manager is None else
                               (lambda i: manager.mamba_layer_cache(i).temporal))
    if n_decode > 0 and not decoded:
        raise RuntimeError(_bypass_message(mixer_cls, f"ran a model step with {n_decode} decode rows in which no KDA "
                                           f"layer called the routed {HOOK_ATTR}.{HOOK_CALL}"))
    return out


def _bypass_message(mixer_cls, what: str) -> str:
    return (f"trtllm_replayssm_module: TensorRT-LLM {tensorrt_llm_version()}: {mixer_cls.__module__}."
            f"{mixer_cls.__qualname__} {what}. This module routes self.{HOOK_ATTR}.{HOOK_CALL}; with this TensorRT-LLM "
            "the KDA decode would run TensorRT-LLM's own kernel and ReplaySSM would silently not run, so loading stops "
            f"here (or serve without --custom_module_dirs). Verified against: {VERIFIED_AGAINST}")


def kda_call_sites(mixer_cls) -> tuple[list[str], list[str]]:
    """(``self._dispatch.decode_kda`` calls, direct KDA decode kernel calls) in ``mixer_cls``'s methods."""
    hooks, bypass = [], []
    for where, node in method_calls(mixer_cls):
        f = node.func
        if not isinstance(f, ast.Attribute):
            continue
        if (f.attr == HOOK_CALL and isinstance(f.value, ast.Attribute) and f.value.attr == HOOK_ATTR
                and isinstance(f.value.value, ast.Name) and f.value.value.id == "self"):
            hooks.append(where)
        elif f.attr in BYPASS_CALLS:
            bypass.append(f"{where} {f.attr}(...)")
    return hooks, bypass


def check_kda_mixer_class(mixer_cls) -> list[str]:
    """RuntimeError unless ``mixer_cls`` decodes through ``self._dispatch.decode_kda`` (module docstring); returns the
    call sites. ``TRTLLM_REPLAYSSM_SKIP_SOURCE_CHECK=1`` skips it (the first-step check still applies)."""
    if os.environ.get("TRTLLM_REPLAYSSM_SKIP_SOURCE_CHECK") == "1":
        return []
    try:
        hooks, bypass = kda_call_sites(mixer_cls)
    except (OSError, TypeError, SyntaxError) as e:
        raise RuntimeError(_bypass_message(mixer_cls, f"has no readable source ({e})")) from e
    if bypass:
        raise RuntimeError(_bypass_message(mixer_cls, f"calls a KDA decode kernel directly at {', '.join(bypass)}"))
    if not hooks:
        raise RuntimeError(_bypass_message(mixer_cls, f"never calls self.{HOOK_ATTR}.{HOOK_CALL}(...)"))
    return hooks


def new_kda_adapter() -> KDAReplayAdapter:
    """From the environment, as the Mamba-2 route: ``TRTLLM_REPLAYSSM_BUFFER_LEN`` (16), ``..._SHADOW`` (none or bf16),
    ``..._CHECK_VALUES=1``."""
    return KDAReplayAdapter(buffer_len=_env_int("TRTLLM_REPLAYSSM_BUFFER_LEN", 16),
                            shadow=_env_choice("TRTLLM_REPLAYSSM_SHADOW", SHADOWS, "none"),
                            check_values=os.environ.get("TRTLLM_REPLAYSSM_CHECK_VALUES") == "1")


def make_kda_model_class(base, mixer_cls):
    """The ReplaySSM subclass of TensorRT-LLM's KDA model class ``base`` (instances routed; ``base`` untouched)."""

    class ReplaySSMKDAModel(base):
        replayssm_mixer_cls = mixer_cls

        def __init__(self, model_config, *args, **kwargs):
            if getattr(model_config, "spec_config", None) is not None:
                raise RuntimeError(f"ReplaySSM{base.__name__}: a speculative_config is set; ReplaySSM routes "
                                   "single-token KDA decode only (remove speculative_config, or serve without "
                                   "--custom_module_dirs)")
            super().__init__(model_config, *args, **kwargs)
            self.replayssm = new_kda_adapter()
            self.replayssm_layers = route_kda_mixers(self, mixer_cls, self.replayssm)
            log.info("trtllm_replayssm_module: ReplaySSM routes KDA layers %s (L=%d)", self.replayssm_layers,
                     self.replayssm.buffer_len)

        def forward(self, attn_metadata, *args, **kwargs):
            parent = super().forward
            return kda_replay_step(self.replayssm, self, mixer_cls, attn_metadata,
                                   lambda: parent(attn_metadata, *args, **kwargs))

    ReplaySSMKDAModel.__name__ = ReplaySSMKDAModel.__qualname__ = f"ReplaySSM{base.__name__}"
    ReplaySSMKDAModel.__module__ = __name__
    return ReplaySSMKDAModel


def register_kda() -> dict:
    """Register a ReplaySSM subclass for every KDA architecture (:data:`ARCHITECTURES`) this TensorRT-LLM defines;
    returns {architecture: class}. ImportError when it has neither the KDA mixer nor a KDA model (the Mamba-2 route
    is unaffected); RuntimeError when the mixer check fails or the registry kept another class."""
    import importlib

    try:
        mixer_mod = importlib.import_module(MIXER_MODULE)
        from tensorrt_llm._torch.models import modeling_utils
    except ImportError as e:
        raise ImportError(f"trtllm_replayssm_module: no KDA mixer in this TensorRT-LLM ({MIXER_MODULE}: {e})") from e
    mixer_cls = getattr(mixer_mod, MIXER_CLASS)
    check_kda_mixer_class(mixer_cls)
    mapping = getattr(modeling_utils, "MODEL_CLASS_MAPPING", None)
    done = {}
    for arch, module in ARCHITECTURES.items():
        try:
            base = getattr(importlib.import_module(module), arch, None)
        except ImportError:
            continue
        if base is None:
            continue
        cls = KDA_CLASSES.get(arch)
        if cls is None or cls.__bases__ != (base,) or cls.replayssm_mixer_cls is not mixer_cls:
            cls = make_kda_model_class(base, mixer_cls)
        globals()[cls.__name__] = cls  # a worker resolves it by module and name
        modeling_utils.register_auto_model(arch)(cls)
        if mapping is not None and mapping.get(arch) is not cls:
            raise RuntimeError(f"trtllm_replayssm_module: registered {cls.__qualname__} for {arch}, but "
                               f"MODEL_CLASS_MAPPING kept {mapping.get(arch)}")
        done[arch] = cls
    if not done:
        raise ImportError(f"trtllm_replayssm_module: this TensorRT-LLM defines none of the KDA models "
                          f"{list(ARCHITECTURES)}")
    KDA_CLASSES.update(done)
    log.warning("trtllm_replayssm_module: route=registration (KDA): %s (TensorRT-LLM %s; mixer check passed)",
                ", ".join(f"{a} -> {__name__}.{c.__qualname__}" for a, c in done.items()), tensorrt_llm_version())
    return done


__all__ = ["ARCHITECTURES", "KDAReplayAdapter", "ReplayDispatch", "route_kda_mixers", "kda_replay_step",
           "check_kda_mixer_class", "check_kda_cache_manager", "make_kda_model_class", "register_kda",
           "gated_rms_norm", "new_kda_adapter"]
