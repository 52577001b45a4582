# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache: the decode state of every Mamba layer of one model, per request slot.

Owns, for ``num_layers`` Mamba layers and ``num_slots`` request slots (H heads, P headdim, N dstate,
G groups, L ring capacity, K conv width, T_max = 1 + num_draft, W = K - 1 + num_draft):

=============  =============================  =================  ===============================================
tensor         shape                          dtype              meaning
=============  =============================  =================  ===============================================
state          (layers, slots, H, P, N)       state_dtype (f32)  checkpoint S0, written on prefill hand-off and flush
shadow         (layers, slots, H, P, N)       shadow_dtype       optional low-precision copy of S0 (None if off),
shadow_scale   (layers, slots, H, P)          f32                written with S0; scales only for fp8 (amax / 448)
x_cache        (layers, slots, H, L, P)       act_dtype          ring of x_j
B_cache        (layers, slots, G, L, N)       act_dtype          ring of B_j
dt_cache       (layers, slots, H, L)          dt_dtype (f32)     ring of processed dt_j (f64 only in tests)
cursor         (slots, 2)                     int32              [s, 0] = ring start, [s, 1] = committed count;
                                                                 shared by all layers (spec_reference docstring)
conv           (layers, slots, conv_dim, W)   act_dtype          conv1d window, newest input in column W-1
=============  =============================  =================  ===============================================

``layer(l)`` gives per-layer views in the layouts of :mod:`.spec_reference` / :mod:`.reference` (the
kernels' contract). The methods here run the float64 spec on whatever device the tensors live on; a
GPU build swaps in the kernels for :meth:`verify` and :meth:`flush` without changing the bookkeeping.

Slot lifecycle: :meth:`allocate` returns the lowest free slot, already reset; :meth:`free` returns it.
:meth:`reset` zeroes everything the slot owns in every layer (checkpoint, shadow, rings, conv window,
cursor start and count), so a recycled slot reads exactly what a fresh one reads: zeros, never a stale
cursor, stale history or a poison value. :meth:`load_prefill` hands off a prefill: its final SSM state
becomes the checkpoint, the ring is empty (start = count = 0), its conv state fills the last K-1
columns of the window.

One speculative step (T <= T_max tokens, rows ``state_batch_indices``, -1 = padding row):
    cache.flush(sbi, T, A_by_layer)          # flush rule on the pre-step cursors, every layer, then cursors
    y_l = cache.verify(l, x, B, C, dt, dt_bias, A, D, z, sbi)   # per layer; ring append, no state write
    u_l = cache.conv_update(l, u, weight, bias, sbi)             # per layer
    cache.commit(sbi, n_accepted, T)         # count += n; conv windows drop the T - n rejected inputs

:func:`memory_per_request` models the bytes one request holds (ReplaySSM spec vs native spec).
"""

from __future__ import annotations

import dataclasses

import torch

from . import spec_reference as sr

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class LayerState:
    """Views of one layer's tensors (no copies), in the kernels' per-layer layouts."""

    state: torch.Tensor
    x_cache: torch.Tensor
    B_cache: torch.Tensor
    dt_cache: torch.Tensor
    conv: torch.Tensor
    shadow: torch.Tensor | None
    shadow_scale: torch.Tensor | None


class ReplayStateCache:
    def __init__(self, num_layers: int, num_slots: int, nheads: int, headdim: int, dstate: int, ngroups: int,
                 buffer_len: int, num_draft: int = 0, conv_kernel: int = 4, conv_dim: int | None = None,
                 state_dtype=torch.float32, act_dtype=torch.bfloat16, shadow_dtype=None, dt_dtype=torch.float32,
                 device="cpu"):
        for name, v in (("num_layers", num_layers), ("num_slots", num_slots), ("nheads", nheads), ("headdim", headdim),
                        ("dstate", dstate), ("ngroups", ngroups), ("conv_kernel", conv_kernel)):
            if v < 1:
                raise ValueError(f"{name}: expected >= 1, got {v}")
        if num_draft < 0:
            raise ValueError(f"num_draft: expected >= 0, got {num_draft}")
        if nheads % ngroups:
            raise ValueError(f"ngroups: expected a divisor of nheads={nheads}, got {ngroups}")
        if buffer_len < 2 * (num_draft + 1):
            raise ValueError(f"buffer_len: expected >= 2 * (num_draft + 1) = {2 * (num_draft + 1)} (flush one window "
                             f"early), got {buffer_len}")
        if shadow_dtype not in (None, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            raise ValueError(f"shadow_dtype: expected None, bfloat16, float16 or float8_e4m3fn, got {shadow_dtype}")
        self.num_layers, self.num_slots = num_layers, num_slots
        self.nheads, self.headdim, self.dstate, self.ngroups = nheads, headdim, dstate, ngroups
        self.buffer_len, self.num_draft, self.conv_kernel = buffer_len, num_draft, conv_kernel
        self.conv_dim = nheads * headdim + 2 * ngroups * dstate if conv_dim is None else conv_dim
        self.conv_width = conv_kernel - 1 + num_draft
        Ly, S, H, P, N, G, L = num_layers, num_slots, nheads, headdim, dstate, ngroups, buffer_len
        kw = dict(device=device)
        self.state = torch.zeros(Ly, S, H, P, N, dtype=state_dtype, **kw)
        self.shadow = None if shadow_dtype is None else torch.zeros(Ly, S, H, P, N, dtype=shadow_dtype, **kw)
        self.shadow_scale = torch.ones(Ly, S, H, P, dtype=torch.float32, **kw) if shadow_dtype == torch.float8_e4m3fn else None
        self.x_cache = torch.zeros(Ly, S, H, L, P, dtype=act_dtype, **kw)
        self.B_cache = torch.zeros(Ly, S, G, L, N, dtype=act_dtype, **kw)
        self.dt_cache = torch.zeros(Ly, S, H, L, dtype=dt_dtype, **kw)
        self.cursor = torch.zeros(S, 2, dtype=torch.int32, **kw)
        self.conv = torch.zeros(Ly, S, self.conv_dim, self.conv_width, dtype=act_dtype, **kw)
        self._free = list(range(S))
        self._live: set[int] = set()

    # ---- views ----------------------------------------------------------------------------------------
    def layer(self, l: int) -> LayerState:
        if not 0 <= l < self.num_layers:
            raise IndexError(f"layer: expected 0 <= layer < {self.num_layers}, got {l}")
        return LayerState(self.state[l], self.x_cache[l], self.B_cache[l], self.dt_cache[l], self.conv[l],
                          None if self.shadow is None else self.shadow[l],
                          None if self.shadow_scale is None else self.shadow_scale[l])

    def _tensors(self):
        return [t for t in (self.state, self.shadow, self.shadow_scale, self.x_cache, self.B_cache, self.dt_cache,
                            self.conv) if t is not None]

    # ---- slot lifecycle ----------------------------------------------------------------------------------
    @property
    def live_slots(self) -> list[int]:
        return sorted(self._live)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the lowest free slot, reset. Raises RuntimeError when every slot is live."""
        if not self._free:
            raise RuntimeError(f"allocate: all {self.num_slots} slots are live")
        self._free.sort()
        slot = self._free.pop(0)
        self.reset(slot)
        self._live.add(slot)
        return slot

    def free(self, slot: int) -> None:
        self._check_live(slot, "free")
        self._live.remove(slot)
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Zero everything ``slot`` owns in every layer and its cursor (start = count = 0)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot: expected 0 <= slot < {self.num_slots}, got {slot}")
        for t in self._tensors():
            t[:, slot].zero_()
        if self.shadow_scale is not None:
            self.shadow_scale[:, slot] = 1.0
        self.cursor[slot].zero_()

    def _check_live(self, slot: int, what: str) -> None:
        if slot not in self._live:
            raise ValueError(f"{what}: slot {slot} is not allocated (live slots: {self.live_slots})")

    def _rows(self, state_batch_indices, what: str) -> list[int]:
        if not isinstance(state_batch_indices, torch.Tensor) or state_batch_indices.dtype != torch.int32:
            raise TypeError(f"state_batch_indices: expected an int32 tensor, got {state_batch_indices!r}")
        sbi = sr._slots(state_batch_indices, state_batch_indices.shape[0], self.num_slots)
        for s in sbi:
            if s >= 0:
                self._check_live(s, what)
        return sbi

    def _check_T(self, T: int) -> None:
        if not 1 <= T <= self.num_draft + 1:
            raise ValueError(f"num_tokens: expected 1 <= T <= num_draft + 1 = {self.num_draft + 1}, got {T}")

    # ---- prefill hand-off ------------------------------------------------------------------------------------
    def load_prefill(self, slot: int, layer: int, ssm_state: torch.Tensor, conv_state: torch.Tensor | None = None) -> None:
        """Prefill's final SSM state (H, P, N) becomes the checkpoint; ring empty; conv_state (conv_dim, K-1)."""
        self._check_live(slot, "load_prefill")
        lay = self.layer(layer)
        sr._check_shape(ssm_state, "ssm_state", lay.state.shape[1:])
        if conv_state is not None:  # validate everything before writing anything
            sr._check_shape(conv_state, "conv_state", (self.conv_dim, self.conv_kernel - 1))
        lay.state[slot] = ssm_state.to(lay.state.dtype)
        self._refresh_shadow(layer, slot)
        lay.x_cache[slot].zero_()
        lay.B_cache[slot].zero_()
        lay.dt_cache[slot].zero_()
        lay.conv[slot].zero_()
        if conv_state is not None and self.conv_kernel > 1:
            lay.conv[slot][:, self.conv_width - (self.conv_kernel - 1):] = conv_state.to(lay.conv.dtype)
        self.cursor[slot].zero_()

    def _refresh_shadow(self, layer: int, slot: int) -> None:
        if self.shadow is None:
            return
        S = self.state[layer, slot].float()
        if self.shadow_scale is None:
            self.shadow[layer, slot] = S.to(self.shadow.dtype)
            return
        scale = (S.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # per (head, row)
        self.shadow_scale[layer, slot] = scale
        self.shadow[layer, slot] = (S / scale[..., None]).to(self.shadow.dtype)

    # ---- speculative step ----------------------------------------------------------------------------------------
    def flush(self, state_batch_indices, num_tokens: int, A_by_layer) -> list[int]:
        """Flush rule on the pre-step cursors: fold committed history in every layer, then move cursors once."""
        self._check_T(num_tokens)
        self._rows(state_batch_indices, "flush")
        if len(A_by_layer) != self.num_layers:
            raise ValueError(f"A_by_layer: expected {self.num_layers} tensors, got {len(A_by_layer)}")
        flushed = []
        for l in range(self.num_layers):
            lay = self.layer(l)
            flushed = sr.flush_checkpoint(lay.state, lay.x_cache, lay.B_cache, lay.dt_cache, self.cursor, A_by_layer[l],
                                          num_tokens, state_batch_indices)
            for s in flushed:
                self._refresh_shadow(l, s)
        sr.flush_cursor(self.cursor, num_tokens, self.buffer_len, state_batch_indices)
        return flushed

    def verify(self, layer: int, x, B, C, dt, dt_bias, A, D, z=None, state_batch_indices=None) -> torch.Tensor:
        """Outputs (batch, T, H, P) of the T window tokens of one layer; appends the window to its ring."""
        self._check_T(x.shape[1])
        self._rows(state_batch_indices, "verify")
        lay = self.layer(layer)
        return sr.verify(lay.state, lay.x_cache, lay.B_cache, lay.dt_cache, self.cursor, x, B, C, dt, dt_bias, A, D, z,
                         state_batch_indices)

    def conv_update(self, layer: int, u, weight, bias=None, state_batch_indices=None, activation="silu") -> torch.Tensor:
        self._check_T(u.shape[1])
        self._rows(state_batch_indices, "conv_update")
        return sr.conv_window_update(self.layer(layer).conv, u, weight, bias, state_batch_indices, activation)

    def commit(self, state_batch_indices, n_accepted, num_tokens: int) -> None:
        """Accept n of T tokens per row: count += n (cursor move), conv windows drop T - n inputs (all layers)."""
        self._check_T(num_tokens)
        self._rows(state_batch_indices, "commit")
        # validate every row before mutating anything, so a bad n leaves the cache as it was
        nacc = n_accepted.cpu().tolist()
        for b, s in enumerate(state_batch_indices.cpu().tolist()):
            if s >= 0 and not num_tokens - self.num_draft <= nacc[b] <= num_tokens:
                raise ValueError(f"n_accepted[{b}]: expected {max(0, num_tokens - self.num_draft)} <= n <= T={num_tokens} "
                                 f"(conv window keeps K-1 inputs), got {nacc[b]}")
        sr.commit(self.cursor, n_accepted, num_tokens, self.buffer_len, state_batch_indices)
        for l in range(self.num_layers):
            sr.conv_window_rollback(self.conv[l], n_accepted, num_tokens, self.conv_kernel, state_batch_indices)

    def committed_state(self, layer: int, slot: int, A) -> torch.Tensor:
        """The recurrent state after the committed tokens (float64), e.g. for prefix caching or migration."""
        lay = self.layer(layer)
        return sr.committed_state(lay.state, lay.x_cache, lay.B_cache, lay.dt_cache, self.cursor, A, slot)

    def bytes_per_slot(self) -> int:
        """Bytes one slot holds across all layers (allocated tensors, cursor included)."""
        return sum(t[:, 0].numel() * t.element_size() for t in self._tensors()) + 2 * 4


# ---- memory model -----------------------------------------------------------------------------------------------
def memory_per_request(nheads: int, headdim: int, dstate: int, ngroups: int, num_layers: int, buffer_len: int,
                       num_draft: int, state_bytes: int = 4, act_bytes: int = 2, conv_kernel: int = 4,
                       conv_dim: int | None = None, shadow_bytes: int = 0) -> dict:
    """Bytes of decode state one request holds, ReplaySSM spec vs native spec (all Mamba layers).

    Per layer:
      ReplaySSM: state H P N s + shadow H P N sh (+ H P 4 of scales for an fp8 shadow) + ring L (H P + G N) a
                 + dt ring H L 4 + conv window conv_dim (K - 1 + num_draft) a;  plus one cursor (8 bytes).
      native:    (1 + num_draft) snapshots of the state H P N s and of the conv state conv_dim (K - 1) a
                 (vLLM / TensorRT-LLM keep a state per draft position for both).
    conv_dim defaults to Mamba-2's H P + 2 G N (the conv runs over x | B | C).
    """
    H, P, N, G, L = nheads, headdim, dstate, ngroups, buffer_len
    cd = H * P + 2 * G * N if conv_dim is None else conv_dim
    state = H * P * N * state_bytes
    replay_layer = {
        "state": state,
        "shadow": H * P * N * shadow_bytes + (H * P * 4 if shadow_bytes == 1 else 0),
        "ring": L * (H * P + G * N) * act_bytes + H * L * 4,
        "conv": cd * (conv_kernel - 1 + num_draft) * act_bytes,
    }
    native_layer = {"state": (1 + num_draft) * state, "conv": (1 + num_draft) * cd * (conv_kernel - 1) * act_bytes}
    replay = num_layers * sum(replay_layer.values()) + 8
    native = num_layers * sum(native_layer.values())
    return {"replay": replay, "native": native, "ratio": native / replay,
            "replay_layer": replay_layer, "native_layer": native_layer}
