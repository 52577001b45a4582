# SPDX-License-Identifier: Apache-2.0
"""ReplaySSM behind TensorRT-LLM's ``selective_state_update`` call: the adapter (no tensorrt_llm needed).

Route: TRT-LLM's Mamba2Mixer decode calls ``selective_state_update(state, x, dt, A, B, C, D, z=None,
dt_bias=..., dt_softplus=..., state_batch_indices=..., out=...)`` once per Mamba layer per step
(tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py, non-MTP branch). The installer
(:mod:`.install`) replaces that call with :func:`replay_selective_state_update`, which converts the
arguments to our state contract and calls ``trtllm_replayssm.families.mamba2.ops.replay_decode`` (CUDA) or
``trtllm_replayssm.families.mamba2.reference.replay_decode`` (CPU, float64 tests).

Argument conversion (TRT-LLM layout -> ours, the state contract of trtllm_replayssm/contract.py):

=====================  ==========================================  =====================================
TRT-LLM argument       TRT-LLM layout                               ReplaySSM
=====================  ==========================================  =====================================
state                  (slots, H, P, N) ssm_states of the layer     the checkpoint S0, used in place
x                      (batch, H, P) contiguous                     x
dt                     (batch, H, P) fp32, ``repeat(dt, "b h ->     (batch, H) in x's dtype: [..., 0];
                       b h p")`` (stride 0 on P)                    exact, dt came from the bf16 in_proj
A                      (H, P, N) fp32 ``_A_expanded`` (strides 0)   (H,) fp32 = A[:, 0, 0]
dt_bias, D             (H, P) fp32 ``_dt_bias_expanded``, ...       (H,) fp32 = [:, 0]
B, C                   (batch, G, N) contiguous                     B, C
z                      None for Nemotron-H (gate is in the norm)    z (optional)
dt_softplus            True (``delta_softplus``)                    required: our kernels always apply it
state_batch_indices    (batch,) int32, pad slot -1 (PAD_SLOT_ID)   state_batch_indices, -1 = padding
out                    (batch, H, P) view of the preallocated out   written for rows with a slot
=====================  ==========================================  =====================================

tie_hdim: the kernels take one A, dt, dt_bias, D per head. A per-(head, dim) argument is accepted when
it is a broadcast (stride 0, as TRT-LLM passes it) or, outside CUDA-graph capture, when its values
are constant within each head; otherwise the error names the argument.

State the adapter owns, per Mamba layer (allocated lazily on the first decode call, sized like the
layer's TRT-LLM state pool: ``slots = state.shape[0]``): x_cache (slots, H, L, P) and B_cache
(slots, G, L, N) in the activation dtype, dt_cache (slots, H, L) fp32 (float64 when the
activations are); one cursor (slots,) int32
shared by all layers. TRT-LLM's ``state`` tensor stays the checkpoint: written only on a flush
(the step whose buffer becomes full), and by TRT-LLM's own prefill.

Checkpoint shadow (``shadow="bf16"`` or ``"fp8"``, ``TRTLLM_REPLAYSSM_SHADOW``; needs an fp32 state pool,
``mamba_ssm_cache_dtype: float32``): the adapter also owns, per Mamba layer, a low-precision copy of the
checkpoint, (slots, H, P, N) bfloat16, or float8_e4m3fn with (slots, H, P) fp32 row scales
(``shadowq.quantize_shadow``). Non-flush steps read it instead of the fp32 checkpoint (the step's state
traffic drops to half or a quarter); flushes update the fp32 checkpoint and rewrite the shadow from it, so
the shadow's rounding never enters the state. It is quantized from the whole pool when the layer's buffers
are allocated and, for the slots of each step's prefill rows, at :meth:`ReplaySSMAdapter.end_step` (after
TRT-LLM's prefill has written their checkpoints in that step's forward). Storage has one scratch slot past
the pool's (padding prefill rows write there; no host sync).

Step protocol ("once per step"): :meth:`ReplaySSMAdapter.begin_step` before the model's layers run
(zeroes the cursor of the prefill rows' slots: their prefill writes a fresh checkpoint), one decode
call per Mamba layer, :meth:`ReplaySSMAdapter.end_step` after the last layer (advances the cursor
once, for the slot tensor the step's decode calls used). The installer calls both around
``NemotronHModel.forward``, which is inside TRT-LLM's CUDA-graph capture, so the cursor advance is
recorded in the graph. A layer decoded twice in one step, or two different slot tensors in one
step, is an error (the hooks are missing or the step is not what we think).

Layers (:meth:`ReplaySSMAdapter.expect_pattern`, called by the installer with the model's
``hybrid_override_pattern``): TensorRT-LLM builds one layer per pattern letter and gives every
mixer its position in the pattern as ``layer_idx`` ("M" Mamba2Mixer, "E" NemotronHMOE in Nemotron 3,
"*" attention, "-" MLP), so the Mamba layers of ``MEM*EM*E`` are 0, 2 and 5, and only they call
``selective_state_update``; MoE, attention and MLP layers never reach the adapter. A decode call
from a ``layer_idx`` that is not an "M" of the pattern is refused before anything is written (the
naming we rely on would be wrong); a step in which some "M" layers did not call is logged once
(those mixers were built before :func:`.install.install` and run TRT-LLM's conventional kernel on
their own state, which is correct but not ReplaySSM).
"""

from __future__ import annotations

import functools
import logging

import torch

from trtllm_replayssm import backend as executors
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.cache import move_rows
from trtllm_replayssm.config import SHADOW_DTYPES
from trtllm_replayssm.families.mamba2 import reference
from trtllm_replayssm.families.mamba2 import steps as mamba2_steps

log = logging.getLogger("trtllm_replayssm_module")

SHADOWS = ("none", *SHADOW_DTYPES)  # the adapter's ``shadow`` values
_QUANT_SLOTS = 16  # slots quantized per call when shadows are written (the whole pool at allocation, prefilled slots)

# TRT-LLM / FlashInfer selective_state_update arguments of the multi-token (speculative verify) and
# stochastic-rounding paths. ReplaySSM single-token decode does not implement them.
UNSUPPORTED = ("disable_state_update", "intermediate_states_buffer", "cache_steps", "retrieve_parent_token",
               "intermediate_state_indices", "rand_seed", "philox_rounds")


def mamba_layer_indices(pattern: str) -> list[int]:
    """The ``layer_idx`` of the Mamba-2 mixers TensorRT-LLM builds for ``hybrid_override_pattern``."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"hybrid_override_pattern: expected a non-empty string of M, E, * and -, got {pattern!r}")
    bad = sorted({c for c in pattern if c not in "ME*-"})
    if bad:
        raise ValueError(f"hybrid_override_pattern: expected only the letters M, E, * and -, got {bad} in {pattern!r}")
    return [i for i, c in enumerate(pattern) if c == "M"]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


# The float64 reference executor in the launchers' keyword form (trtllm_replayssm.backend): widened to float64,
# caches stored back in their dtypes, y in x's dtype, rows with a slot written into ``out`` when given.
reference_backend = mamba2_steps.replay_decode_kw(executors.REFERENCE)


@functools.cache
def default_backend(device: torch.device):
    """(decode step, cursor advance) of the executor for ``device`` (backend.for_device: the kernels on CUDA),
    made once per device."""
    x = executors.for_device(device)
    return mamba2_steps.replay_decode_kw(x), x.advance_cursor


def per_head(name: str, t, H: int, tail: tuple, check: bool) -> torch.Tensor | None:
    """(H,) fp32 from TRT-LLM's per-head (H,) or per-(head, dim...) broadcast ``(H, *tail)`` argument."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) == (H,):
        return t.float().contiguous()
    if tuple(t.shape) != (H, *tail):
        raise ValueError(f"{name}: expected shape ({H},) or {(H, *tail)} (per-head values broadcast over the "
                         f"head's dims), got {tuple(t.shape)}")
    head = t[(slice(None),) + (0,) * len(tail)]
    tied = all(s == 0 for s in t.stride()[1:])
    if not tied and check and not torch.equal(t, head.reshape(H, *(1,) * len(tail)).expand_as(t)):
        raise ValueError(f"{name}: expected one value per head (tie_hdim, as Mamba-2 / Nemotron-H), got values "
                         f"that vary within a head")
    return head.float().contiguous()


def per_head_dt(dt, batch: int, H: int, P: int, dtype: torch.dtype, check: bool) -> torch.Tensor:
    """(batch, H) in the activation dtype from TRT-LLM's (batch, H, P) broadcast or (batch, H) dt."""
    if not isinstance(dt, torch.Tensor):
        raise TypeError(f"dt: expected a torch.Tensor, got {type(dt).__name__}")
    if tuple(dt.shape) == (batch, H):
        return dt.to(dtype).contiguous()
    if tuple(dt.shape) != (batch, H, P):
        raise ValueError(f"dt: expected shape ({batch}, {H}) or ({batch}, {H}, {P}), got {tuple(dt.shape)}")
    head = dt[:, :, 0]
    if dt.stride(2) != 0 and check and not torch.equal(dt, head[:, :, None].expand_as(dt)):
        raise ValueError("dt: expected one value per (row, head) (tie_hdim), got values that vary along head_dim")
    return head.to(dtype).contiguous()


class ReplaySSMAdapter:
    """Per-layer replay buffers and the shared cursor behind TRT-LLM's ``selective_state_update``.

    ``backend(x=, B=, C=, dt=, dt_bias=, A=, D=, z=, state=, x_cache=, B_cache=, dt_cache=, cursor=,
    state_batch_indices=, out=, check_values=)`` returns y (batch, H, P) and leaves padding rows of
    ``out`` untouched; ``advance(cursor, state_batch_indices, buffer_len)`` moves the cursor. Defaults:
    ``ops.replay_decode`` / ``cursor_ops.advance_cursor`` on CUDA, the reference elsewhere.
    ``check_values``: host-side slot/cursor and tie_hdim value checks (each synchronizes; off in serving).
    ``shadow`` "bf16" / "fp8": the backend is also handed ``shadow=`` and ``shadow_scale=`` (the layer's shadow and
    its fp8 row scales, None for bf16); with "none" it is called without them.
    """

    def __init__(self, buffer_len: int = 16, backend=None, advance=None, check_values: bool = False,
                 shadow: str = "none"):
        if not isinstance(buffer_len, int) or not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected an int in 1..32, got {buffer_len!r}")
        if shadow not in SHADOWS:
            raise ValueError(f"shadow: expected one of {SHADOWS}, got {shadow!r}")
        self.buffer_len = buffer_len
        self.shadow = shadow
        self._prefill_slots: torch.Tensor | None = None
        self.backend, self.advance = backend, advance
        self.check_values = check_values
        self.layers: dict[int, dict] = {}
        self.cursor: torch.Tensor | None = None
        self._step_slots: torch.Tensor | None = None
        self._step_key: tuple | None = None
        self._step_layers: set[int] = set()
        self.pattern: str | None = None
        self.checked_manager = None  # the cache manager install.check_cache_manager last accepted
        self.mamba_layers: frozenset[int] | None = None  # None: not known, every layer_idx accepted
        self._warned_unrouted = False

    # ---- bookkeeping ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every buffer and the cursor (a new state pool: every slot starts from its checkpoint)."""
        self.layers.clear()
        self.cursor = None
        self.abort_step()

    def _buffers(self, layer_idx: int, state: torch.Tensor, x: torch.Tensor, G: int) -> dict:
        S, H, P, N = state.shape
        L = self.buffer_len
        lay = self.layers.get(layer_idx)
        if lay is not None and (lay["state"].data_ptr() != state.data_ptr() or lay["state"].shape != state.shape):
            # TRT-LLM re-creates its cache manager after memory estimation: a new pool, fresh slots.
            if _capturing():
                raise RuntimeError(f"state: layer {layer_idx}'s SSM state pool changed during CUDA-graph capture")
            self.reset()
            lay = None
        if lay is None:
            if _capturing():
                raise RuntimeError(f"layer {layer_idx}: ReplaySSM buffers would be allocated (and zeroed) inside a "
                                   "CUDA-graph capture; run one eager decode step first, or disable CUDA graphs")
            if not state.is_contiguous():
                # TensorRT-LLM's V2 manager (mamba_cache_manager_v2.py 28295084, _get_state_buffer) views each
                # layer's states as_strided with slot stride page_index_scale * H*P*N (several layers' same-size
                # states share one page per slot); the kernels address slot s at s * H*P*N.
                raise NotImplementedError(
                    f"state: layer {layer_idx}'s SSM state pool has strides {tuple(state.stride())}; the ReplaySSM "
                    f"Mamba-2 kernels expect a contiguous (slots, {H}, {P}, {N}) pool (strides "
                    f"{(H * P * N, P * N, N, 1)}). TensorRT-LLM's V2 hybrid cache manager interleaves the Mamba layers' "
                    "states per slot: use the V1 manager (TRTLLM_USE_PY_MAMBA=1, kv_cache_config "
                    "use_kv_cache_manager_v2=False)")
            if self.cursor is None:
                self.cursor = torch.zeros(S, dtype=torch.int32, device=state.device)
            elif self.cursor.shape[0] != S or self.cursor.device != state.device:
                raise ValueError(f"state: expected {self.cursor.shape[0]} slots on {self.cursor.device} like the other "
                                 f"Mamba layers, got {S} on {state.device}")
            if self.shadow != "none" and state.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"state: a {self.shadow} shadow needs an fp32 SSM state pool (kv_cache_config "
                                 f"mamba_ssm_cache_dtype: float32), got {str(state.dtype).replace('torch.', '')}")
            lay = dict(state=state,
                       x_cache=torch.zeros(S, H, L, P, dtype=x.dtype, device=state.device),
                       B_cache=torch.zeros(S, G, L, N, dtype=x.dtype, device=state.device),
                       # fp32 per the contract; float64 only when the activations are (CPU tests)
                       dt_cache=torch.zeros(S, H, L, dtype=torch.promote_types(torch.float32, x.dtype),
                                            device=state.device),
                       params=None)
            if self.shadow != "none":  # one scratch slot past the pool: padding prefill rows land there
                sh = torch.empty(S + 1, H, P, N, dtype=SHADOW_DTYPES[self.shadow], device=state.device)
                sc = (torch.ones(S + 1, H, P, dtype=torch.float32, device=state.device) if self.shadow == "fp8"
                      else None)
                lay.update(shadow_storage=sh, scale_storage=sc, shadow=sh[:S], shadow_scale=None if sc is None else sc[:S])
                self._write_shadow(lay, torch.arange(S, device=state.device))
            self.layers[layer_idx] = lay
        for name, want in (("x_cache", (S, H, L, P)), ("B_cache", (S, G, L, N))):
            got = lay[name]
            if tuple(got.shape) != want or got.dtype != x.dtype:
                raise ValueError(f"layer {layer_idx}: expected activations giving {name} {want} {x.dtype}, got buffers "
                                 f"{tuple(got.shape)} {got.dtype} from an earlier step")
        return lay

    def expect_pattern(self, pattern: str | None) -> None:
        """Accept decode calls only from the "M" layers of ``pattern`` (None: from any layer)."""
        if pattern == self.pattern:
            return
        self.mamba_layers = None if pattern is None else frozenset(mamba_layer_indices(pattern))
        self.pattern = pattern
        self._warned_unrouted = False

    def _check_layer(self, layer_idx: int) -> None:
        if self.mamba_layers is not None and layer_idx not in self.mamba_layers:
            where = (f"is {self.pattern[layer_idx]!r}, not 'M'" if 0 <= layer_idx < len(self.pattern)
                     else "does not exist")
            raise RuntimeError(f"layer {layer_idx}: a selective_state_update call, but position {layer_idx} of "
                               f"hybrid_override_pattern {self.pattern!r} {where} (Mamba-2 layers "
                               f"{sorted(self.mamba_layers)}); the layer naming this module relies on does not hold")

    @staticmethod
    def _slots_key(state_batch_indices, batch: int, device) -> tuple:
        """Identity of the slot tensor a layer was handed (None: rows are slots 0..batch-1)."""
        if state_batch_indices is None:
            return ("arange", batch, str(device))
        t = state_batch_indices
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

    def _step_sbi(self, layer_idx: int, state_batch_indices, batch: int, device) -> torch.Tensor:
        """The step's int32 slot tensor, noting ``layer_idx`` as decoded: the first Mamba layer's (converted once:
        int32 as given, else an int32 copy, an arange for None), reused by the later layers, which must be handed
        the same tensor."""
        if layer_idx in self._step_layers:
            raise RuntimeError(f"layer {layer_idx}: decoded twice in one model step; begin_step()/end_step() are not "
                               "being called around the model forward")
        key = self._slots_key(state_batch_indices, batch, device)
        if self._step_slots is None:
            t = state_batch_indices
            self._step_slots = (torch.arange(batch, dtype=torch.int32, device=device) if t is None
                                else t if t.dtype == torch.int32 else t.int())
            self._step_key = key
        elif key != self._step_key:
            raise RuntimeError(f"state_batch_indices: layer {layer_idx} got a different slot tensor than the step's "
                               "first Mamba layer; expected one slot tensor per step")
        self._step_layers.add(layer_idx)
        return self._step_slots

    def begin_step(self, prefill_slots: torch.Tensor | None = None) -> None:
        """Start a model step. ``prefill_slots``: slots whose prefill (or prefill chunk) runs this step;
        their checkpoint is rewritten by TRT-LLM's prefill, so their buffers are emptied (cursor 0)."""
        if self._step_layers:
            raise RuntimeError("begin_step: the previous step decoded layers "
                               f"{sorted(self._step_layers)} but was not closed by end_step()")
        if prefill_slots is None or prefill_slots.numel() == 0:
            return
        if self.shadow != "none":  # their shadows are requantized at end_step, after the prefill wrote them
            self._prefill_slots = prefill_slots
        if self.cursor is None:
            return
        S = self.cursor.shape[0]
        idx = prefill_slots.to(device=self.cursor.device, dtype=torch.long)
        # Padding (-1) goes to a scratch entry: no host sync, CUDA-graph safe.
        ext = torch.cat([self.cursor, self.cursor.new_zeros(1)])
        ext.index_fill_(0, torch.where(idx >= 0, idx, torch.full_like(idx, S)), 0)
        self.cursor.copy_(ext[:S])

    def end_step(self) -> frozenset:
        """Close a model step: advance the cursor once for the slots the step's decode rows used.
        Returns the ``layer_idx`` of the layers that decoded this step."""
        slots = self._step_slots
        decoded = self._step_layers
        prefill = self._prefill_slots
        self.abort_step()
        if prefill is not None:
            self._requantize(prefill)
        if slots is not None and self.mamba_layers is not None and decoded != self.mamba_layers \
                and not self._warned_unrouted:
            self._warned_unrouted = True
            log.warning("trtllm_replayssm_module: Mamba-2 layers %s of pattern %r made no ReplaySSM decode call this step "
                        "(mixers built before install()?); they run TensorRT-LLM's own kernel",
                        sorted(self.mamba_layers - decoded), self.pattern)
        if slots is not None:
            advance = self.advance or default_backend(self.cursor.device)[1]
            advance(self.cursor, slots, self.buffer_len)
        return frozenset(decoded)

    def relocate(self, src: list[int], dst: list[int]) -> None:
        """Slot ``dst[i]`` takes slot ``src[i]``'s rings, shadow and cursor, every layer (TensorRT-LLM moved the
        request and its checkpoint, the pool row; :func:`.install.follow_relocation` calls this between steps, host
        lists of distinct destinations). Sources are read before destinations are written (``cache.move_rows``)."""
        if self._step_layers or self._step_slots is not None:
            raise RuntimeError("relocate: a model step is open (begin_step() without end_step()); TensorRT-LLM "
                               "relocates slots between steps")
        if self.cursor is None or not src:  # nothing allocated yet: no ring to carry
            return
        S = self.cursor.shape[0]
        bad = [s for s in (*src, *dst) if not 0 <= s < S]
        if bad:
            raise IndexError(f"relocate: expected slots in 0..{S - 1} (the state pool's), got {bad}")
        dev = self.cursor.device
        s_idx, d_idx = (torch.tensor(v, dtype=torch.long, device=dev) for v in (src, dst))
        for lay in self.layers.values():
            for name in ("x_cache", "B_cache", "dt_cache", "shadow_storage", "scale_storage"):
                if lay.get(name) is not None:
                    move_rows(lay[name], 0, s_idx, d_idx)
        move_rows(self.cursor, 0, s_idx, d_idx)

    def abort_step(self) -> None:
        """Drop the step's bookkeeping without moving the cursor (the forward raised)."""
        self._step_slots = None
        self._step_key = None
        self._step_layers = set()
        self._prefill_slots = None

    def _requantize(self, slots: torch.Tensor) -> None:
        """Rewrite every layer's shadow of ``slots`` (-1: padding) from its checkpoint, as a flush does."""
        for lay in self.layers.values():
            self._write_shadow(lay, slots)

    @staticmethod
    def _write_shadow(lay: dict, slots: torch.Tensor) -> None:
        """The layer's shadow of ``slots`` (-1: padding, written to the scratch slot) quantized from its checkpoint,
        ``_QUANT_SLOTS`` rows at a time (slices of a tensor of known shape: no host sync; the fp8 path's fp32
        temporaries stay small)."""
        state, sh, sc = lay["state"], lay["shadow_storage"], lay["scale_storage"]
        S = state.shape[0]
        idx_all = slots.to(device=state.device, dtype=torch.long)
        for r0 in range(0, idx_all.shape[0], _QUANT_SLOTS):
            idx = idx_all[r0:r0 + _QUANT_SLOTS]
            valid = idx >= 0
            src = state.index_select(0, torch.where(valid, idx, torch.zeros_like(idx)))
            q = torch.empty(src.shape, dtype=sh.dtype, device=sh.device)
            scale = None if sc is None else torch.empty(src.shape[:-1], dtype=torch.float32, device=sh.device)
            shadowq.quantize_shadow(src, q, scale)
            dst = torch.where(valid, idx, torch.full_like(idx, S))
            if sh.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernels: move the bytes
                sh.view(torch.uint8).index_copy_(0, dst, q.view(torch.uint8))
            else:
                sh.index_copy_(0, dst, q)
            if sc is not None:
                sc.index_copy_(0, dst, scale)

    # ---- the decode call ----------------------------------------------------------------------------
    def selective_state_update(self, layer_idx: int, state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                               dt_softplus: bool = False, state_batch_indices=None, pad_slot_id: int = -1,
                               out=None, **extra):
        """One single-token Mamba-2 decode step of layer ``layer_idx``, TRT-LLM's arguments; returns ``out`` (or y)."""
        self._check_layer(layer_idx)
        for k, v in extra.items():
            if k not in UNSUPPORTED:
                raise TypeError(f"selective_state_update: unexpected argument {k!r}")
            if v is not None and v is not False:
                raise NotImplementedError(f"{k}: expected None (ReplaySSM routes single-token decode only; speculative "
                                          f"verify and stochastic rounding are not supported), got {type(v).__name__}")
        if not isinstance(state, torch.Tensor) or state.dim() != 4:
            raise ValueError(f"state: expected a (slots, nheads, head_dim, d_state) tensor, got {_shape(state)}")
        S, H, P, N = state.shape
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (H, P):
            raise NotImplementedError(f"x: expected single-token (batch, {H}, {P}), got {_shape(x)} (multi-token / "
                                      "speculative verify is not routed to ReplaySSM)")
        if not dt_softplus:
            raise NotImplementedError("dt_softplus: expected True (the ReplaySSM kernels always apply "
                                      "softplus(dt + dt_bias)), got False")
        if pad_slot_id != -1:
            raise ValueError(f"pad_slot_id: expected -1 (our padding slot), got {pad_slot_id}")
        if not isinstance(B, torch.Tensor) or B.dim() != 3:
            raise ValueError(f"B: expected a (batch, ngroups, d_state) tensor, got {_shape(B)}")
        batch, G = x.shape[0], B.shape[1]
        if state_batch_indices is not None and (not isinstance(state_batch_indices, torch.Tensor)
                                                or tuple(state_batch_indices.shape) != (batch,)):
            raise ValueError(f"state_batch_indices: expected shape ({batch},), got {_shape(state_batch_indices)}")
        if out is not None:  # before anything is written: a bad out must not leave a folded checkpoint behind
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
                raise ValueError(f"out: expected shape {tuple(x.shape)}, got {_shape(out)}")
            if out.device != x.device:
                raise ValueError(f"out: expected a tensor on {x.device}, got {out.device}")
        check = self.check_values and not _capturing()

        lay = self._buffers(layer_idx, state, x, G)
        params = lay["params"]
        key = tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride()) for t in (A, dt_bias, D))
        if params is None or params[0] != key:
            # A, dt_bias, D are parameters: convert once (eagerly, before any graph capture).
            A_h = per_head("A", A, H, (P, N), check=not _capturing())
            dtb = per_head("dt_bias", dt_bias, H, (P,), check=not _capturing())
            D_h = per_head("D", D, H, (P,), check=not _capturing())
            zeros = torch.zeros(H, dtype=torch.float32, device=state.device)
            params = lay["params"] = (key, A_h, zeros if dtb is None else dtb, zeros if D_h is None else D_h)
        _, A_h, dtb, D_h = params
        dt_h = per_head_dt(dt, batch, H, P, x.dtype, check)

        sbi = self._step_sbi(layer_idx, state_batch_indices, batch, x.device)
        backend = self.backend or default_backend(x.device)[0]
        direct = (out is not None and out.is_contiguous() and tuple(out.shape) == tuple(x.shape)
                  and out.dtype == x.dtype)
        y = backend(x=x, B=B, C=C, dt=dt_h, dt_bias=dtb, A=A_h, D=D_h, z=z, state=state, x_cache=lay["x_cache"],
                    B_cache=lay["B_cache"], dt_cache=lay["dt_cache"], cursor=self.cursor, state_batch_indices=sbi,
                    out=out if direct else None, check_values=check,
                    **({} if self.shadow == "none" else dict(shadow=lay["shadow"], shadow_scale=lay["shadow_scale"])))
        if out is None:
            return y
        if not direct:
            # Padding rows keep whatever out held (no host sync: a select, not a boolean index).
            out.copy_(torch.where((sbi >= 0).to(out.device)[:, None, None], y.to(out.dtype), out))
        return out

    # ---- inspection ---------------------------------------------------------------------------------
    def current_state(self, layer_idx: int, slot: int) -> torch.Tensor:
        """The recurrent state of ``slot`` that checkpoint + buffer stand for (float64)."""
        lay = self.layers[layer_idx]
        A_h = lay["params"][1]
        return reference.replay_state(lay["state"], lay["x_cache"], lay["B_cache"], lay["dt_cache"], self.cursor,
                                      A_h, slot)


def replay_selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                  state_batch_indices=None, pad_slot_id=-1, out=None, *, adapter: ReplaySSMAdapter,
                                  layer_idx: int, **extra):
    """Drop-in for TRT-LLM's ``selective_state_update`` (same positional order: state, x, dt, A, B, C, D)
    routed to ReplaySSM; ``adapter`` and ``layer_idx`` are bound by the installer per Mamba2Mixer."""
    return adapter.selective_state_update(layer_idx, state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                          dt_softplus=dt_softplus, state_batch_indices=state_batch_indices,
                                          pad_slot_id=pad_slot_id, out=out, **extra)
