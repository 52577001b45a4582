# SPDX-License-Identifier: Apache-2.0
"""One CUDA-graph-capturable Nemotron-H model step of T tokens per row: T = 1 is standard decode,
T > 1 is speculative verify. Layers are written once; the SSM step is pluggable.

The step runs over the weights of a transformers ``NemotronHForCausalLM`` (the module tree is only a
weight container: every op is written here with plain torch, so transformers 5.17 and 5.24 give the
same step). All state lives in tensors allocated once and updated in place, so one call can be
captured in a CUDA graph and replayed with no host work.

Per step, row b, T tokens at once (each block is ``h <- h + mixer(rmsnorm(h))``; the residual add of
one block is fused with the next block's norm):

  embed   h = E[tokens]                                                          (b, T, hidden)
  M       in_proj -> (z, xBC, dt); causal conv1d of the T inputs over the window of the last K-1
          committed inputs (:func:`conv_update`: the window is rewritten with the newest W = K-2+T
          inputs; after a speculative step the committed K-1 end ``shift = T - n_accepted`` rows
          before its end, so a rejection moves an offset and copies nothing), silu;
          y = ssm.step(layer, x, B, C, dt, dt_bias, A, D, sbi)   (b, T, H, P)   <- the pluggable part
          gated RMSNorm(y, z) per group; out_proj
  *       q, k, v of the T tokens; k, v written at lengths[b] + t; query t attends to the cache
          positions <= lengths[b] + t (fused: :func:`.decode_attention.decode_attention`, which reads
          only those positions; eager: ``F.scaled_dot_product_attention`` with that mask; Nemotron-H
          is NoPE); o_proj
  -       down(relu(up(h))^2)
  E       (Nemotron 3) MoE: sigmoid top-k routing with the correction bias (:func:`builders.moe.route`,
          fp32), the routed experts, the shared expert, latent projections where the config has
          them. One routing for every dtype: the batch's (token, expert) pairs sorted by expert
          (sort, counts and offsets on the device, so the step stays capturable) and one combine
          (:func:`moe_in`, :func:`moe_out`); only the expert products differ. bf16: two
          ``torch._grouped_mm`` (one grouped GEMM per projection over the sorted pairs, what a
          serving engine's fused MoE does); other dtypes (grouped_mm is bf16 only) or ``grouped``
          off: every expert on every token, then each pair's row of the result.
          ``expert_load[i]`` (E,) int32: tokens routed to each expert in the last step;
          ``routing[i]`` / ``route_idx[i]`` after :meth:`HybridStep.record_routing`: each token's expert
          set (and teacher-forced experts for a benchmark's gate)
  head    norm_f, lm_head -> logits in the activation dtype; argmax

then :class:`DecodeStep` (T = 1): ids <- argmax, lengths += 1, ``ssm.end_step`` (ReplaySSM: the one
cursor advance of the step); or :class:`SpecStep` (T > 1): greedy acceptance on the device,
``ssm.end_step(n_accepted)`` (ReplaySSM: the commit = a cursor move), conv offsets, lengths and the
next inputs from the draft table, all inside the graph.

Fusion (``fuse=True``, the default on CUDA): the glue between the GEMMs and the SSM call runs as
``torch.compile`` (inductor) regions, the way an engine fuses it: residual add + RMSNorm + in_proj +
conv update + silu + the split into contiguous x/B/C/dt; gated RMSNorm + out_proj; residual add +
RMSNorm + up_proj + relu^2 + down_proj; residual add + RMSNorm + MoE routing + the sort of the pairs;
the MoE combine + shared expert; residual add + norm_f + lm_head + argmax. The same functions
run eagerly when ``fuse=False`` (the CPU and tensor-parallel paths), so fused and eager compute the
same math (tests/test_model_step_gpu.py compares them). The SSM kernels are never inside a region.

SSM modes (:class:`SSMMode`) own their per-layer state, allocated once for the step's T; all load
the same conventional fp32 states (a snapshot after the prompt), so every mode can be compared:

  Conventional   (T = 1) S (batch, H, P, N) fp32 read and written every step
  Replay         ReplaySSM: checkpoint S0, x/B/dt buffers of L entries; T = 1: the fused decode
                 kernel and a (slots,) cursor advanced once per step; T > 1: the verify kernel (fold
                 one window early) and a (slots, 2) ring cursor committed once per step; ``shadow``:
                 a bf16 (or fp8-e4m3 + per-(slot, head, row) scale) copy of S0 that non-flush steps
                 read, rewritten by every flush and at the prefill hand-off
  NativeSpec     (T > 1) vLLM / TensorRT-LLM style: T state snapshots per layer, commit copies one
  MambaSSM       (T = 1) mamba_ssm's Triton ``selective_state_update`` on the same S (CUDA only)
  NoOp           no SSM work (y = 0): the step without the SSM, for the SSM's share of the time

Each mode takes its executor once, at ``alloc``, from :func:`trtllm_replayssm.backend.for_device`
(float64 reference on the CPU, kernels on CUDA).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from trtllm_replayssm import backend as executors
from trtllm_replayssm.cache import ReplayStateCache

from . import moe as moe_ops
from .decode_attention import decode_attention

SUPPORTED = ("linear_attention", "full_attention", "mlp", "moe")
GROUPED_MOE_ON_CUDA = True  # grouped-GEMM experts on CUDA too (see HybridStep.grouped)


# ---- one slot's state in host memory (preemption and the prefill/decode hand-off of builders/generation.py) --------
def to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in host memory: from CUDA into pinned memory, asynchronously on the current stream (a
    later write of the source on that stream is ordered after the copy; a host read of the values needs a sync); on
    the CPU a clone."""
    if t.device.type != "cuda":
        return t.detach().clone(memory_format=torch.contiguous_format)
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, asynchronous from pinned host memory to CUDA (the caching host allocator keeps ``src`` alive
    until the copy is done)."""
    dst.copy_(src, non_blocking=dst.device.type == "cuda" and src.device.type == "cpu" and src.is_pinned())


class CacheSlots:
    """One slot of a :class:`ReplayStateCache` (``self.cache``, every slot allocated for good: slot = row) out to host
    memory and back, through the cache's own ``swap_out`` / ``swap_in``: the checkpoint, shadow, rings and cursor as
    stored (bits), so a slot swapped back in continues bit-identically (tests/test_state_lifecycle.py). After
    :meth:`save_slot` the slot is allocated again at once (reset; the next prefill hand-off or :meth:`load_saved`
    writes it), so the cache's pool stays the engine's (``cache.num_free`` 0 between steps)."""

    def saved_spec(self) -> dict:
        return {}  # everything is in the snapshot

    def snapshot_nbytes(self) -> int:
        return self.cache.bytes_per_slot()

    def snapshot_mismatch(self, snapshot) -> list:
        if snapshot is None:
            return [f"the state holds no ReplayStateCache snapshot; SSM mode {self.name!r} needs one"]
        if getattr(snapshot, "num_slots", 1) != 1:
            return [f"the snapshot holds {snapshot.num_slots} slots, expected 1"]
        return self.cache.snapshot_mismatch(snapshot)

    def save_slot(self, slot: int) -> tuple:
        snap = self.cache.swap_out([slot])  # pinned, asynchronous on CUDA; the slot freed ...
        again = self.cache.allocate()  # ... and taken back (reset, queued behind the copies on the same stream)
        if again != slot:
            raise RuntimeError(f"save_slot: the cache gave slot {again} back, expected {slot} (its pool is not the "
                               "engine's)")
        return {}, snap

    def load_saved(self, slot: int, tensors: dict, snapshot) -> None:
        diffs = self.snapshot_mismatch(snapshot)
        if diffs:  # before the slot leaves the pool
            raise ValueError("load_saved: the snapshot does not fit this cache: " + "; ".join(diffs))
        self.cache.free(slot)
        try:
            self.cache.swap_in([slot], snapshot)
        except BaseException:
            if slot not in self.cache.live_slots:  # the pool stays the engine's
                self.cache.allocate()
            raise


# ---- SSM modes ----------------------------------------------------------------------------------------
class SSMMode:
    """Interface: ``alloc`` per-layer state for T tokens per step, ``load`` it from conventional fp32
    states, ``begin_step`` once per model step before the layers, ``step`` one layer (y (batch, T, H, P) in
    x's dtype), ``end_step`` once per model step (``n_accepted`` (batch,) int32 when T > 1)."""

    name = "?"
    needs_cuda = False
    tokens = (1,)  # the T it supports: (1,) standard decode only, (2,) speculative only, (1, 2) both

    def alloc(self, layers, batch, T, H, P, N, G, device, act_dtype):
        self._check_T(T)
        self.batch, self.T, self.layers = batch, T, list(layers)
        self.x = executors.for_device(device).steps("mamba2")  # Mamba-2's steps on the device's executor
        self.state = {i: torch.zeros(batch, H, P, N, dtype=torch.float32, device=device) for i in layers}

    def _check_T(self, T: int) -> None:
        allowed = {1: "T = 1 (standard decode)", 2: "T > 1 (speculative verify)"}
        if min(T, 2) not in self.tokens:
            raise ValueError(f"SSM mode {self.name!r}: expected {' or '.join(allowed[t] for t in self.tokens)}, "
                             f"got T = {T}")

    def load(self, states: dict) -> None:
        for i, s in states.items():
            self.state[i].copy_(s)

    def load_slot(self, slot: int, states: dict) -> None:
        """One slot's prefill hand-off: ``states`` {layer: (H, P, N)} become its state (a server's new request)."""
        for i, s in states.items():
            self.state[i][slot].copy_(s)

    def states(self, A: dict) -> dict:
        """Current recurrent state per layer (conventional layout, fp32); ``A`` = -exp(A_log) per layer."""
        return self.state

    def begin_step(self, sbi) -> None:
        pass

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        raise NotImplementedError

    def end_step(self, sbi, n_accepted=None) -> None:
        pass

    def free(self) -> None:
        self.state = {}

    # ---- one slot in host memory (preemption, the prefill/decode hand-off) --------------------------------------
    def saved_spec(self) -> dict:
        """{name: (dtype, shape)} of the tensors :meth:`save_slot` returns for one slot (a cache snapshot aside)."""
        return {f"ssm.{i}": (s.dtype, tuple(s.shape[1:])) for i, s in self.state.items()}

    def snapshot_nbytes(self) -> int:
        """Bytes of the ReplayStateCache snapshot :meth:`save_slot` returns (0: none)."""
        return 0

    def snapshot_mismatch(self, snapshot) -> list:
        return [] if snapshot is None else [f"the state holds a ReplayStateCache snapshot; SSM mode {self.name!r} "
                                            "keeps none"]

    def save_slot(self, slot: int) -> tuple:
        """({name: host copy}, a cache snapshot or None): the slot's state after its last committed token."""
        return {f"ssm.{i}": to_host(s[slot]) for i, s in self.state.items()}, None

    def load_saved(self, slot: int, tensors: dict, snapshot) -> None:
        for i, s in self.state.items():
            from_host(s[slot], tensors[f"ssm.{i}"])


class Conventional(SSMMode):
    name = "conventional"

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        return self.x.conventional_step(self.state[i], x[:, 0], B[:, 0], C[:, 0], dt[:, 0], dt_bias, A, D,
                                        sbi)[:, None]


class Replay(CacheSlots, SSMMode):
    """ReplaySSM for any T on a :class:`~trtllm_replayssm.cache.ReplayStateCache`, the product's state owner:
    T = 1 on its standard form (the (slots,) cursor and the tuned decode kernel), T > 1 on its ring (the
    verify kernel, one commit per step). The harness keeps the conv windows (channels innermost, fused into
    ``mamba_in``), so the cache holds none (``conv_dim=0``); every batch row is one live slot.
    ``advance(cursor, sbi, L)`` (T = 1) or ``commit_fn(cursor, n, sbi, T, L)`` (T > 1) replace the cursor
    move (the tests break it on purpose). ``state``, ``x_cache``, ``B_cache``, ``dt_cache``, ``shadow``,
    ``shadow_scale`` (per model layer) and ``cursor`` are views of the cache's tensors."""

    name = "replay"
    tokens = (1, 2)

    def __init__(self, buffer_len: int = 16, shadow: str | None = None, advance=None, commit_fn=None,
                 checkpoint: str = "f32"):
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        if shadow not in (None, "bf16", "fp8"):
            raise ValueError(f"shadow: expected None, 'bf16' or 'fp8', got {shadow!r}")
        if checkpoint not in ("f32", "fp8") or (checkpoint == "fp8" and shadow is not None):
            raise ValueError(f"checkpoint: expected 'f32', or 'fp8' (an 8-bit checkpoint, no shadow), got "
                             f"{checkpoint!r} with shadow={shadow!r}")
        self.L, self.shadow_kind, self.checkpoint = buffer_len, shadow, checkpoint
        self.advance, self.commit_fn = advance, commit_fn
        self.cache = None
        if shadow is not None:
            self.name = f"replay_{shadow}"
        if checkpoint == "fp8":  # the 8-bit checkpoint's kernel is the standard decode step
            self.name, self.tokens = "replay_ckpt8", (1,)

    def alloc(self, layers, batch, T, H, P, N, G, device, act_dtype):
        self._check_T(T)
        if T > 1 and self.L < 2 * T:
            raise ValueError(f"buffer_len: expected >= 2T = {2 * T} (flush one window early), got {self.L}")
        self.batch, self.T, self.layers = batch, T, list(layers)
        x = executors.for_device(device)
        if self.advance or self.commit_fn:
            x = _HookedExecutor(x, self.advance, self.commit_fn)
        shadow_dtype = {None: None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[self.shadow_kind]
        c = self.cache = ReplayStateCache(len(layers), batch, H, P, N, G, self.L, num_draft=T - 1, conv_dim=0,
                                          act_dtype=act_dtype, shadow_dtype=shadow_dtype, device=device,
                                          cursor="standard" if T == 1 else "ring", executor=x,
                                          read_shadow=shadow_dtype is not None,  # the reference reads it too
                                          state_dtype=torch.float8_e4m3fn if self.checkpoint == "fp8" else
                                          torch.float32)
        for _ in range(batch):
            c.allocate()
        self.j = {i: j for j, i in enumerate(self.layers)}
        self.x = x
        self.cursor = c.cursor
        for name in ("state", "x_cache", "B_cache", "dt_cache", "shadow", "shadow_scale"):
            t = getattr(c, name)
            setattr(self, name, {} if t is None else {i: t[j] for i, j in self.j.items()})

    def load(self, states: dict) -> None:
        if self.checkpoint == "fp8":  # quantised by the cache's prefill hand-off (its row scales, flush count 0)
            for s in range(self.batch):
                self.load_slot(s, {i: st[s] for i, st in states.items()})
            return
        super().load(states)  # the prompt's final state becomes the checkpoint, the buffers are empty
        self.cursor.zero_()
        for i in self.shadow:  # prefill hand-off: the shadow of the new checkpoint
            executors.write_shadow(self.state[i], self.shadow[i], self.shadow_scale.get(i))

    def load_slot(self, slot: int, states: dict) -> None:
        for i, s in states.items():  # checkpoint = the prompt's final state, ring empty, cursor 0, shadow rewritten
            self.cache.load_prefill(slot, self.j[i], s)

    def states(self, A: dict) -> dict:
        return {i: torch.stack([self.cache.committed_state(j, s, A[i]).float() for s in range(self.batch)])
                for i, j in self.j.items()}

    def begin_step(self, sbi) -> None:
        self.cache.flush(sbi, self.T)

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        return self.cache.verify(self.j[i], x, B, C, dt, dt_bias, A, D, None, sbi)

    def end_step(self, sbi, n_accepted=None) -> None:
        self.cache.commit(sbi, n_accepted, self.T)

    def free(self) -> None:
        super().free()
        self.cache = None
        self.x_cache = self.B_cache = self.dt_cache = {}
        self.shadow, self.shadow_scale = {}, {}


class _HookedExecutor:
    """An executor whose cursor move is replaced (Replay's ``advance`` / ``commit_fn``); the rest delegated."""

    def __init__(self, x, advance, commit_fn):
        self._x, self._advance, self._commit = x, advance, commit_fn

    def __getattr__(self, name):
        return getattr(self._x, name)

    def advance_cursor(self, cursor, sbi, L, *, check_values=None, flushes=None):
        if self._advance is None:
            self._x.advance_cursor(cursor, sbi, L, check_values=check_values,
                                   **({} if flushes is None else {"flushes": flushes}))
        else:
            self._advance(cursor, sbi, L)

    def spec_commit(self, cursor, n_accepted, sbi, T, L, *, check_values=None):
        (self._commit or self._x.spec_commit)(cursor, n_accepted, sbi, T, L)


class NativeSpec(SSMMode):
    """Native spec: T fp32 state snapshots per layer and slot, commit = copy of snapshot n-1."""

    name = "native_spec"
    tokens = (2,)

    def alloc(self, layers, batch, T, H, P, N, G, device, act_dtype):
        super().alloc(layers, batch, T, H, P, N, G, device, act_dtype)
        self.snapshots = {i: torch.zeros(batch, T, H, P, N, dtype=torch.float32, device=device) for i in layers}

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        return self.x.native_spec_verify(self.state[i], self.snapshots[i], x, B, C, dt, dt_bias, A, D, sbi)

    def end_step(self, sbi, n_accepted=None) -> None:
        for i in self.layers:
            self.x.native_spec_commit(self.state[i], self.snapshots[i], n_accepted, sbi)

    def free(self) -> None:
        super().free()
        self.snapshots = {}


class MambaSSM(SSMMode):
    """mamba_ssm's Triton ``selective_state_update`` (tie_hdim: dt, A, dt_bias, D broadcast over
    headdim with stride 0, as Nemotron-H calls it; D and dt_bias always passed)."""

    name = "mamba_ssm"
    needs_cuda = True

    def __init__(self, fn):
        self.fn = fn
        self._consts = {}

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        x, B, C, dt = x[:, 0], B[:, 0], C[:, 0], dt[:, 0]
        batch, H, P = x.shape
        N = self.state[i].shape[-1]
        c = self._consts.get(i)
        if c is None:  # built on the eager warm-up step, reused inside the graph
            c = self._consts[i] = (A[:, None, None].expand(H, P, N), dt_bias[:, None].expand(H, P),
                                   D[:, None].expand(H, P), sbi.long())
        A_t, bias_t, D_t, sbi_l = c
        return self.fn(self.state[i], x, dt[:, :, None].expand(batch, H, P), A_t, B, C, D=D_t, dt_bias=bias_t,
                       dt_softplus=True, state_batch_indices=sbi_l)[:, None]

    def free(self) -> None:
        super().free()
        self._consts = {}


class NoOp(SSMMode):
    """No SSM work: y = 0 (a buffer allocated once). Its tokens are meaningless; it is never gated."""

    name = "noop"
    tokens = (1, 2)

    def alloc(self, layers, batch, T, H, P, N, G, device, act_dtype):
        self.batch, self.T, self.layers = batch, T, list(layers)
        self.state = {}
        self.y = torch.zeros(batch, T, H, P, dtype=act_dtype, device=device)

    def load(self, states: dict) -> None:
        pass

    def load_slot(self, slot: int, states: dict) -> None:
        pass

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        return self.y[:x.shape[0]]


# ---- the fusable regions (pure functions of tensors; compiled as they are when fuse=True) ----------------
def rmsnorm(h, w, eps):
    v = h.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * v).to(h.dtype)


def _residual(h, delta):
    return h if delta is None else h + delta


def conv_update(window, shift, u, weight, bias):
    """Causal depthwise conv1d of the T new inputs; rewrites the window (in place). Returns silu(conv).

    window (b, W, C), W = K - 2 + T, channels innermost (the layout of u, so every access is
    coalesced): the last K-1 committed inputs end ``shift[b]`` rows before its end (``shift`` None:
    at its end); u (b, T, C); weight (C, K) fp32; bias (C,) or None. The window becomes the last W of
    [committed K-1, u] (newest in row W-1). fp32 accumulation, out (b, T, C) in u's dtype.
    """
    K, W, T = weight.shape[1], window.shape[1], u.shape[1]
    if shift is None:
        committed = window[:, W - (K - 1):]
    else:
        rows = (W - (K - 1)) - shift[:, None] + torch.arange(K - 1, device=window.device)[None, :]  # (b, K-1)
        committed = window.gather(1, rows[:, :, None].expand(window.shape[0], K - 1, window.shape[2]))
    seq = torch.cat([committed, u], dim=1)  # (b, K-1+T, C)
    s32 = seq.float()
    out = s32[:, 0:T] * weight[:, 0]
    for k in range(1, K):
        out = out + s32[:, k:k + T] * weight[:, k]
    if bias is not None:
        out = out + bias.float()
    window.copy_(seq[:, 1:])
    return F.silu(out).to(u.dtype)


def mamba_in(h, delta, norm_w, in_w, in_b, window, shift, conv_w, conv_b, eps: float, H: int, P: int, G: int, N: int):
    """Residual add + RMSNorm + in_proj + conv update + silu; x (b,T,H,P), B and C (b,T,G,N), dt (b,T,H)
    contiguous for the SSM step, the gate z (b,T,H*P), and the new residual stream h."""
    h = _residual(h, delta)
    b, T = h.shape[0], h.shape[1]
    gate, xBC, dt = F.linear(rmsnorm(h, norm_w, eps), in_w, in_b).split([H * P, H * P + 2 * G * N, H], dim=-1)
    x, B, C = conv_update(window, shift, xBC, conv_w, conv_b).split([H * P, G * N, G * N], dim=-1)
    return (h, x.reshape(b, T, H, P).contiguous(), B.reshape(b, T, G, N).contiguous(),
            C.reshape(b, T, G, N).contiguous(), dt.contiguous(), gate)


def gate_act(y, gate):
    """y * silu(z) in fp32, (b, T, H*P)."""
    b, T = y.shape[0], y.shape[1]
    return y.reshape(b, T, -1).float() * F.silu(gate.float())


def group_var(g, G: int):
    """Mean square per norm group: g (rows, H*P) -> (rows, G, 1)."""
    return g.view(g.shape[0], G, -1).pow(2).mean(-1, keepdim=True)


def gated_out(g, var, norm_w, out_w, eps: float, G: int, dtype):
    """The gated RMSNorm's scaling of g (b, T, H*P) by its group variance (b, T, G|1, 1), out_proj."""
    b, T = g.shape[0], g.shape[1]
    g = (g.view(b, T, G, -1) * torch.rsqrt(var + eps)).view(b, T, -1)
    return F.linear((norm_w.float() * g).to(dtype), out_w)


def mamba_out(y, gate, norm_w, out_w, eps: float, G: int):
    """Gated RMSNorm (groups local) + out_proj in one region."""
    g = gate_act(y, gate)
    b, T = g.shape[0], g.shape[1]
    var = group_var(g.reshape(b * T, -1), G).view(b, T, G, 1)
    return gated_out(g, var, norm_w, out_w, eps, G, gate.dtype)


def attn_in(h, delta, norm_w, q_w, q_b, k_w, k_b, v_w, v_b, eps: float):
    h = _residual(h, delta)
    hn = rmsnorm(h, norm_w, eps)
    return h, F.linear(hn, q_w, q_b), F.linear(hn, k_w, k_b), F.linear(hn, v_w, v_b)


def mlp(h, delta, norm_w, up_w, up_b, down_w, eps: float):
    h = _residual(h, delta)
    return h, F.linear(torch.relu(F.linear(rmsnorm(h, norm_w, eps), up_w, up_b)).square(), down_w)


def moe_in(h, delta, norm_w, w: moe_ops.MoEWeights, eps: float, force_idx=None):
    """Residual add + RMSNorm + routing + the (token, expert) pairs sorted by expert: returns h, the
    normed tokens hn (n, D), the expert inputs x (n, Din) and the sorted pairs' xs (n*k, Din), the pair
    order (n*k,) int64 (sorted position -> pair p: token p // k, its choice p % k), each sorted pair's
    expert (n*k,) int64, the routing weights in that order (n*k,) fp32 and the per-expert counts and
    offsets (E,) int32. ``force_idx`` (n, k): teacher-forced experts (:meth:`HybridStep.record_routing`)."""
    h = _residual(h, delta)
    hn = rmsnorm(h, norm_w, eps).reshape(-1, h.shape[-1])
    weights, idx = moe_ops.route(hn, w, force_idx)
    x = hn if w.fc1_latent is None else F.linear(hn, w.fc1_latent, w.fc1_latent_bias)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    E = w.gate_weight.shape[0]
    counts = (flat[:, None] == torch.arange(E, device=flat.device)[None, :]).sum(0).to(torch.int32)
    offs = counts.cumsum(0).to(torch.int32)
    k = idx.shape[1]
    return h, hn, x, x[order // k], order, flat[order], weights.reshape(-1)[order], counts, offs


def moe_out(y, order, wsorted, hn, w: moe_ops.MoEWeights, shape):
    """Weighted sum of each token's k expert outputs (y in sorted pair order), fc2_latent, + the shared
    expert of hn; (b, T, D) in hn's dtype."""
    n, k = hn.shape[0], order.shape[0] // hn.shape[0]
    routed = torch.empty_like(y, dtype=torch.float32).index_copy(0, order, y.float() * wsorted[:, None])
    r = routed.view(n, k, -1).sum(1).to(hn.dtype)
    if w.fc2_latent is not None:
        r = F.linear(r, w.fc2_latent, w.fc2_latent_bias)
    act = w.shared_act or w.act
    shared = F.linear(act(F.linear(hn, w.shared_up, w.shared_up_bias)), w.shared_down, w.shared_down_bias)
    return (r + shared).view(shape)


def relu2(x):
    return torch.relu(x).square()


def head(h, delta, norm_w, lm_w, eps: float):
    """Residual add + norm_f + lm_head -> logits (activation dtype) and their argmax."""
    logits = F.linear(rmsnorm(_residual(h, delta), norm_w, eps), lm_w)
    return logits, logits.argmax(-1)


REGIONS = ("mamba_in", "mamba_out", "attn_in", "mlp", "moe_in", "moe_out", "relu2", "head")
_COMPILED: dict = {}


def regions(fuse: bool) -> dict:
    """{name: function}: the plain functions, or their torch.compile'd versions (built once per process;
    the batch becomes a dynamic dim at its second size, so batch sizes share a compilation)."""
    if not fuse:
        return {n: globals()[n] for n in REGIONS}
    if not _COMPILED:
        import torch._dynamo

        # one compilation per (dtype, T, first-layer / later-layer, ...) variant of a region: more than
        # dynamo's default limit of 8 in a process that runs an fp32 twin and the bf16 model
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for n in REGIONS:  # automatic dynamic shapes: a dim becomes symbolic only once it changes (the
            # batch), so channel counts and the window width stay constants of the generated kernels
            _COMPILED[n] = torch.compile(globals()[n], fullgraph=True)
    return dict(_COMPILED)


# ---- weights ------------------------------------------------------------------------------------------------
def mamba_constants(model, layers) -> dict:
    """Per Mamba layer: A = -exp(A_log), D, dt_bias, conv weight (conv_dim, K) (fp32) and bias."""
    out = {}
    for i in layers:
        mx = model.model.layers[i].mixer
        out[i] = dict(A=-torch.exp(mx.A_log.detach().float()), D=mx.D.detach().float().contiguous(),
                      dt_bias=mx.dt_bias.detach().float().contiguous(),
                      conv_w=mx.conv1d.weight.detach()[:, 0, :].float().contiguous(),
                      conv_b=None if mx.conv1d.bias is None else mx.conv1d.bias.detach())
    return out


def layer_weights(layer, kind: str) -> dict:
    """The projections of one layer as (weight, bias) tensors (the module's own, no copies), and its
    pre-norm: Mamba in/out_w, _b, norm_w (gated norm); attention q/k/v/o; MLP up/down; ``pre`` the
    block's RMSNorm weight."""
    mx = layer.mixer
    wb = lambda name, lin: {f"{name}_w": lin.weight, f"{name}_b": lin.bias}  # noqa: E731
    if kind == "moe":
        return {"moe": moe_ops.MoEWeights.from_module(mx), "pre": layer.norm.weight}
    if kind == "linear_attention":
        w = {**wb("in", mx.in_proj), **wb("out", mx.out_proj), "norm_w": mx.norm.weight}
    elif kind == "full_attention":
        w = {**wb("q", mx.q_proj), **wb("k", mx.k_proj), **wb("v", mx.v_proj), **wb("o", mx.o_proj)}
    else:
        w = {**wb("up", mx.up_proj), **wb("down", mx.down_proj)}
    w["pre"] = layer.norm.weight
    return w


def check_step_args(cfg, batch: int, kv_len: int, T: int = 1) -> None:
    """The model's layer kinds are ones a captured step supports; batch, KV positions and T are positive."""
    bad = sorted({t for t in cfg.layers_block_type if t not in SUPPORTED})
    if bad:
        raise ValueError(f"layers_block_type: expected only {SUPPORTED}, got {bad}")
    if batch < 1 or kv_len < 1:
        raise ValueError(f"batch and kv_len: expected >= 1, got {batch} and {kv_len}")
    if T < 1:
        raise ValueError(f"T: expected >= 1, got {T}")


# ---- the step ---------------------------------------------------------------------------------------------
class HybridStep:
    """Layers and state of a T-token step for ``batch`` rows, KV caches of ``kv_len`` positions.

    In-place state: ``tokens`` (batch, T) int64 (the step's inputs), ``lengths`` (batch,) int64 (tokens
    in the KV caches), ``conv[i]`` (batch, K-2+T, conv_dim) windows, channels innermost (``conv_all``
    stacks them; snapshots hold the last K-1 rows),
    ``shift`` (batch,) int64 (T > 1: where the committed inputs end), ``k[i]``/``v[i]``, ``logits``
    (batch, T, vocab) and ``argmax`` (batch, T), and the SSM mode's state. Subclasses add the tail.
    """

    norm_groups_local = True  # every gated-norm group on this rank (False: TP with replicated groups)

    def __init__(self, model, batch: int, kv_len: int, ssm: SSMMode, T: int = 1, fuse: bool | None = None):
        cfg = model.config
        check_step_args(cfg, batch, kv_len, T)
        self.model, self.cfg, self.batch, self.kv_len, self.T = model, cfg, batch, kv_len, T
        self.kinds = list(cfg.layers_block_type)
        p = next(model.parameters())
        self.device, self.act = p.device, p.dtype
        self.fuse = self.device.type == "cuda" if fuse is None else fuse
        self.flash = self.fuse and self.device.type == "cuda"  # Triton decode attention (CUDA only)
        self.H, self.P, self.N, self.G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        self.K = cfg.conv_kernel
        self.nh, self.kvh, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.mamba = [i for i, k in enumerate(self.kinds) if k == "linear_attention"]
        self.attn = [i for i, k in enumerate(self.kinds) if k == "full_attention"]
        self.eps = cfg.layer_norm_epsilon
        self.consts = mamba_constants(model, self.mamba)
        self.w = {i: layer_weights(model.model.layers[i], k) for i, k in enumerate(self.kinds)}
        self._shard()  # tensor parallelism (builders/tp_step.py): local dims, consts and weights
        self.f = regions(self.fuse)
        dev, b = self.device, batch
        i64 = dict(dtype=torch.int64, device=dev)
        conv_dim = self.H * self.P + 2 * self.G * self.N
        self.W = self.K - 2 + T
        # aligned rows for the attention kernels; positions >= kv_len are scratch: the T - 1 rows after kv_len - 1
        # take the K/V of a window that runs past the cache, so they never overwrite a committed position
        self.kv_cap = -(-(kv_len + T - 1) // 16) * 16
        self.tokens = torch.zeros(b, T, **i64)
        self.lengths = torch.zeros(b, **i64)
        self.shift = torch.zeros(b, **i64)
        self.sbi = torch.arange(b, dtype=torch.int32, device=dev)
        self.ar_T = torch.arange(T, **i64)
        self.kv_pos = torch.arange(self.kv_cap, **i64)
        self.conv_all = torch.zeros(len(self.mamba), b, self.W, conv_dim, dtype=self.act, device=dev)
        self.conv = {i: self.conv_all[j] for j, i in enumerate(self.mamba)}
        self.k = {i: torch.zeros(b, self.kvh, self.kv_cap, self.hd, dtype=self.act, device=dev) for i in self.attn}
        self.v = {i: torch.zeros(b, self.kvh, self.kv_cap, self.hd, dtype=self.act, device=dev) for i in self.attn}
        self.logits = self.logits_all = torch.zeros(b, T, cfg.vocab_size, dtype=self.act, device=dev)
        self.argmax = torch.zeros(b, T, **i64)
        # grouped-GEMM experts: bf16 only (torch._grouped_mm); False: the dense experts under the same
        # routing and combine (tests/test_model_step_gpu.py compares the two inside CUDA graphs)
        self.grouped = (self.act == torch.bfloat16 and hasattr(torch, "_grouped_mm")
                        and (self.device.type != "cuda" or GROUPED_MOE_ON_CUDA))
        self.expert_load = {i: torch.zeros(self.w[i]["moe"].num_experts, dtype=torch.int32, device=dev)
                            for i, k in enumerate(self.kinds) if k == "moe"}
        self.routing = None  # record_routing()
        self.ssm = None
        self.set_ssm(ssm)

    def set_ssm(self, ssm: SSMMode) -> None:
        if self.ssm is not None:
            self.ssm.free()
        if ssm.needs_cuda and self.device.type != "cuda":
            raise ValueError(f"SSM mode {ssm.name!r} needs CUDA tensors, the model is on {self.device}")
        ssm.alloc(self.mamba, self.batch, self.T, self.H, self.P, self.N, self.G, self.device, self.act)
        self.ssm = ssm

    def free(self) -> None:
        self.ssm.free()

    # ---- hooks of tensor parallelism (identities at TP=1) -------------------------------------------------
    def _shard(self) -> None:
        """Replace dims, ``consts`` and ``w`` by this rank's share (before any state is allocated)."""

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of the row-parallel partial products over ranks (all-reduce), in place."""
        return t

    def _group_var(self, g: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm variance per norm group of ``g`` (rows, H*P fp32) -> (rows, G, 1)."""
        return group_var(g, self.G)

    def _out(self, partial, bias):
        out = self._reduce(partial)
        return out if bias is None else out + bias

    # ---- layers -----------------------------------------------------------------------------------------
    def _mamba(self, i, h, delta):
        c, w = self.consts[i], self.w[i]
        shift = None if self.T == 1 else self.shift
        h, x, B, C, dt, gate = self.f["mamba_in"](h, delta, w["pre"], w["in_w"], w["in_b"], self.conv[i], shift,
                                                  c["conv_w"], c["conv_b"], self.eps, self.H, self.P, self.G, self.N)
        y = self.ssm.step(i, x, B, C, dt, c["dt_bias"], c["A"], c["D"], self.sbi)
        if self.fuse and self.norm_groups_local:
            out = self.f["mamba_out"](y, gate, w["norm_w"], w["out_w"], self.eps, self.G)
        else:  # the same pieces, with the variance through the TP hook
            g = gate_act(y, gate)
            b, T = g.shape[0], g.shape[1]
            var = self._group_var(g.reshape(b * T, -1))
            out = gated_out(g, var.view(b, T, var.shape[1], 1), w["norm_w"], w["out_w"], self.eps, self.G, h.dtype)
        return h, self._out(out, w["out_b"])

    def _attention(self, i, h, delta):
        w, b, T = self.w[i], self.batch, self.T
        kvh, hd = self.kvh, self.hd
        rep = self.nh // kvh
        h, q, k, v = self.f["attn_in"](h, delta, w["pre"], w["q_w"], w["q_b"], w["k_w"], w["k_b"], w["v_w"], w["v_b"],
                                       self.eps)
        idx = self._kv_at[:, None, :, None].expand(b, kvh, T, hd)
        self.k[i].scatter_(2, idx, k.view(b, T, kvh, hd).transpose(1, 2))
        self.v[i].scatter_(2, idx, v.view(b, T, kvh, hd).transpose(1, 2))
        if self.flash:  # the filled positions only, as an engine's decode attention reads them
            o = decode_attention(q, self.k[i], self.v[i], self._kv_at)
        else:
            q = q.view(b, T, kvh, rep, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, rep * T, hd)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=self._mask)  # (b, kvh, rep*T, hd)
            o = o.view(b, kvh, rep, T, hd).permute(0, 3, 1, 2, 4).reshape(b, T, self.nh * hd)
        return h, self._out(F.linear(o, w["o_w"]), w["o_b"])

    def _mlp(self, i, h, delta):
        w = self.w[i]
        h, out = self.f["mlp"](h, delta, w["pre"], w["up_w"], w["up_b"], w["down_w"], self.eps)
        return h, self._out(out, w["down_b"])

    def record_routing(self, seed: int = 0) -> None:
        """For a benchmark's gate (off unless asked: a router call and two small kernels per MoE layer).
        From the next capture or call on, ``route_idx[i]`` (batch*T, k) int64 holds each token's own
        expert choice in MoE layer i and ``routing[i]`` (batch, T) int64 a code of that set (the sum of
        one random 58-bit code per expert: equal sets, equal sums, no int64 overflow up to 32 experts a
        token; other sets collide with probability ~2^-58). With ``force_routing`` True (before a
        capture) the experts used are ``forced_idx[i]``, written by the caller before each step, while
        route_idx/routing still record the step's own choice: a lossy mode's error is then measured
        without the router's discrete flips (the e2e standard step's shadow gate, scripts/e2e_standard.py)."""
        g = torch.Generator().manual_seed(seed)
        n, dev = self.batch * self.T, self.device
        self._route_code = {i: torch.randint(1, 1 << 58, (self.w[i]["moe"].num_experts,), generator=g,
                                             dtype=torch.int64).to(dev) for i in self.expert_load}
        self.routing = {i: torch.zeros(self.batch, self.T, dtype=torch.int64, device=dev) for i in self.expert_load}
        self.route_idx = {i: torch.zeros(n, self.w[i]["moe"].top_k, dtype=torch.int64, device=dev)
                          for i in self.expert_load}
        self.forced_idx = {i: t.clone() for i, t in self.route_idx.items()}
        self.force_routing = False

    def idle_expert_bytes(self) -> int:
        """Bytes of the routed experts that no token of the last step chose (0 without MoE layers): a step
        reads every weight but these (the bytes models' weights read; ``expert_load``)."""
        idle = 0
        for i, load in self.expert_load.items():
            w = self.w[i]["moe"]
            idle += int((load == 0).sum()) * (w.up[0].numel() + w.down[0].numel()) * w.up.element_size()
        return idle

    def _moe(self, i, h, delta):
        w = self.w[i]["moe"]
        force = self.forced_idx[i] if self.routing is not None and self.force_routing else None
        h, hn, x, xs, order, experts, wsorted, counts, offs = self.f["moe_in"](h, delta, self.w[i]["pre"], w, self.eps,
                                                                                 force)
        self.expert_load[i].copy_(counts)
        if self.routing is not None:
            if force is not None:  # the step's own choice, beside the forced one it used
                own = moe_ops.route(hn, w)[1]
            else:  # the pairs sorted by expert, back in (token, choice) order
                own = torch.empty_like(experts).index_copy_(0, order, experts).view_as(self.route_idx[i])
            self.route_idx[i].copy_(own)
            self.routing[i].copy_(self._route_code[i][own].sum(-1).view(self.batch, self.T))
        act = self.f["relu2"] if type(w.act).__name__ == "ReLUSquaredActivation" else w.act
        up_t, down_t = w.up.transpose(1, 2), w.down.transpose(1, 2)
        if self.grouped:  # each sorted pair by its expert: one grouped GEMM per projection, (n*k, Din)
            y = torch._grouped_mm(act(torch._grouped_mm(xs, up_t, offs=offs)), down_t, offs=offs)
        else:  # every expert on every token (E, n, Din), then each sorted pair's row
            y = torch.matmul(act(torch.matmul(x[None], up_t)), down_t)[experts, order // w.top_k]
        return h, self.f["moe_out"](y, order, wsorted, hn, w, h.shape)

    def _attention_positions(self) -> None:
        """Cache positions of the T tokens and the mask of every attention layer of this step: query t
        of row b sees positions <= lengths[b] + t (clamped into the cache: positions past kv_len - 1, a
        window that runs past the cache, land in the scratch rows kv_len .. kv_len + T - 2, never on a
        committed position)."""
        b, T = self.batch, self.T
        self._kv_at = (self.lengths[:, None] + self.ar_T[None, :]).clamp(max=self.kv_len + T - 2)  # (b, T)
        if self.flash:
            return  # decode_attention takes _kv_at, no mask
        seen = self.kv_pos[None, None, :] <= self._kv_at[:, :, None]  # (b, T, S)
        rep = self.nh // self.kvh
        self._mask = seen[:, None, None].expand(b, 1, rep, T, self.kv_cap).reshape(b, 1, rep * T, self.kv_cap)

    @torch.no_grad()
    def forward(self) -> None:
        """All layers and the head: ``logits`` and ``argmax`` of the T tokens of every row."""
        m = self.model.model
        h = F.embedding(self.tokens, m.embeddings.weight)  # (b, T, hidden)
        delta = None
        if self.attn:
            self._attention_positions()
        self.ssm.begin_step(self.sbi)
        layer_fn = {"linear_attention": self._mamba, "full_attention": self._attention, "mlp": self._mlp,
                    "moe": self._moe}
        for i, kind in enumerate(self.kinds):
            h, delta = layer_fn[kind](i, h, delta)
        logits, top = self.f["head"](h, delta, m.norm_f.weight, self.model.lm_head.weight, self.eps)
        self.logits_all.copy_(logits)
        self.argmax.copy_(top)

    # ---- rows of a server's batch --------------------------------------------------------------------------
    def rows(self, n: int) -> HybridStep:
        """A step over the first ``n`` rows that shares every tensor of this one (inputs, lengths, conv windows,
        K/V, logits) and its SSM mode (whose state the rows reach through ``sbi``). A server captures one graph
        per such prefix and runs the smallest that holds its live rows (builders/generation.py)."""
        if not 1 <= n <= self.batch:
            raise ValueError(f"n: expected 1..{self.batch} rows, got {n}")
        v = copy.copy(self)
        v.batch = n
        for name in ("tokens", "lengths", "shift", "sbi", "argmax", "logits_all"):
            setattr(v, name, getattr(self, name)[:n])
        v.logits = v.logits_all if self.logits is self.logits_all else v.logits_all[:, 0]
        v.conv_all = self.conv_all[:, :n]
        v.conv = {i: v.conv_all[j] for j, i in enumerate(self.mamba)}
        v.k = {i: t[:n] for i, t in self.k.items()}
        v.v = {i: t[:n] for i, t in self.v.items()}
        if hasattr(self, "ids"):
            v.ids = v.tokens[:, 0]
        return v

    def load_slot(self, row: int, length: int, conv: dict, k: dict, v: dict, ssm: dict) -> None:
        """A prefill's hand-off into row ``row`` (its slot): ``length`` tokens of K/V (``k[i]``, ``v[i]``
        (kv_heads, length, head_dim)), the last K-1 conv inputs ``conv[i]`` (K-1, conv_dim), the final SSM
        states ``ssm[i]`` (H, P, N) (the mode's hand-off: ReplaySSM's checkpoint with an empty ring)."""
        K, W = self.K, self.W
        if not 0 <= row < self.batch or not 0 < length <= self.kv_len:
            raise ValueError(f"row, length: expected 0 <= row < {self.batch} and 0 < length <= {self.kv_len}, "
                             f"got {row}, {length}")
        self.lengths[row] = length
        self.shift[row] = 0
        for j, i in enumerate(self.mamba):
            self.conv_all[j][row].zero_()
            self.conv_all[j][row, W - (K - 1):].copy_(conv[i])
        for i in self.attn:  # positions past the prompt zeroed: while its slot was free the row ran as a padding
            # row and wrote K/V there (NaN where its undefined SSM output got in); masked positions still enter the
            # unfused attention's product (0 * NaN = NaN)
            self.k[i][row, :, :length].copy_(k[i])
            self.v[i][row, :, :length].copy_(v[i])
            self.k[i][row, :, length:].zero_()
            self.v[i][row, :, length:].zero_()
        self.ssm.load_slot(row, ssm)

    # ---- one slot in host memory (builders/generation.py: preemption, the prefill/decode hand-off) ---------------
    def slot_geometry(self) -> dict:
        """What a saved slot must match to be loaded into this step (JSON-able): family, layer stack, sizes, dtype,
        SSM mode."""
        c = self.cfg
        return dict(model_type=c.model_type, layers=list(self.kinds), vocab_size=c.vocab_size,
                    hidden_size=c.hidden_size, dtype=str(self.act).removeprefix("torch."), ssm_mode=self.ssm.name,
                    tokens_per_step=self.T, conv_kernel=self.K, mamba=[self.H, self.P, self.N, self.G],
                    attention=[self.nh, self.kvh, self.hd])

    def saved_spec(self, length: int) -> dict:
        """{name: (dtype, shape)} of :meth:`save_slot`'s tensors for a row of ``length`` tokens."""
        spec = {"tokens": (torch.int64, (self.T,)), "conv": (self.act, tuple(self.conv_all.shape[:1] + self.conv_all.shape[2:]))}
        for i in self.attn:
            spec[f"k.{i}"] = spec[f"v.{i}"] = (self.act, (self.kvh, length, self.hd))
        return {**spec, **self.ssm.saved_spec()}

    def save_slot(self, row: int, length: int) -> tuple:
        """Row ``row`` (its slot, between steps, ``length`` tokens in its K/V) in host memory (pinned, asynchronous
        from CUDA): ({"tokens": the next input, "conv": the windows of every Mamba layer, "k.i" / "v.i": the K/V of
        its ``length`` positions, the SSM mode's tensors}, the SSM mode's cache snapshot or None). The slot's SSM
        state is released and taken back (ReplaySSM: ``swap_out``); its other rows are left as they are (the next
        prefill or :meth:`load_saved` overwrites them)."""
        t = {"tokens": to_host(self.tokens[row]), "conv": to_host(self.conv_all[:, row])}
        for i in self.attn:
            t[f"k.{i}"] = to_host(self.k[i][row, :, :length])
            t[f"v.{i}"] = to_host(self.v[i][row, :, :length])
        ssm, snap = self.ssm.save_slot(row)
        return {**t, **ssm}, snap

    def load_saved(self, row: int, length: int, tensors: dict, snapshot) -> None:
        """:meth:`save_slot`'s copy back into row ``row`` (any free row): the row then holds exactly what it held
        (K/V past ``length`` zeroed, as a prefill hand-off leaves it), so it continues as if it never stopped. The
        caller checked ``tensors`` against :meth:`saved_spec`."""
        if not 0 <= row < self.batch or not 0 < length <= self.kv_len:
            raise ValueError(f"row, length: expected 0 <= row < {self.batch} and 0 < length <= {self.kv_len}, "
                             f"got {row}, {length}")
        self.ssm.load_saved(row, tensors, snapshot)  # first: it checks the snapshot against the cache
        self.lengths[row] = length
        self.shift[row] = 0
        from_host(self.tokens[row], tensors["tokens"])
        from_host(self.conv_all[:, row], tensors["conv"])
        for i in self.attn:
            from_host(self.k[i][row, :, :length], tensors[f"k.{i}"])
            from_host(self.v[i][row, :, :length], tensors[f"v.{i}"])
            self.k[i][row, :, length:].zero_()
            self.v[i][row, :, length:].zero_()

    # ---- state hand-off ---------------------------------------------------------------------------------
    def load_committed(self, snap: dict) -> None:
        """KV caches, lengths, the last K-1 conv inputs and the SSM states of a standard step's snapshot."""
        K, W = self.K, self.W
        self.lengths.copy_(snap["lengths"])
        self.shift.zero_()
        for j, i in enumerate(self.mamba):
            self.conv_all[j].zero_()
            self.conv_all[j][:, W - (K - 1):].copy_(snap["conv"][i])
        for name in ("k", "v"):
            for i, t in getattr(self, name).items():
                n = min(t.shape[2], snap[name][i].shape[2])  # a T = 1 step's cache may have fewer scratch rows
                t[:, :, :n].copy_(snap[name][i][:, :, :n])
                t[:, :, n:].zero_()
        self.ssm.load(snap["ssm"])  # layer by layer (copy_ crosses devices): no second full copy on the GPU


class DecodeStep(HybridStep):
    """The standard decode step (T = 1). ``ids`` (batch,) int64: the input token, the greedy next token
    after the call; ``logits`` (batch, vocab) in the activation dtype (a view of the step's buffer)."""

    def __init__(self, model, batch: int, kv_len: int, ssm: SSMMode, fuse: bool | None = None):
        super().__init__(model, batch, kv_len, ssm, T=1, fuse=fuse)
        self.ids = self.tokens[:, 0]
        self.logits = self.logits[:, 0]

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        self.forward()
        self.ids.copy_(self.argmax[:, 0])
        self.lengths.add_(1)
        self.ssm.end_step(self.sbi)
        return self.logits

    def feed(self, tokens: torch.Tensor) -> None:
        """Prompt by stepping: ``tokens`` (batch, n); afterwards ``ids`` holds the first greedy token."""
        for t in range(tokens.shape[1]):
            self.ids.copy_(tokens[:, t])
            self()

    def snapshot(self, device=None) -> dict:
        """Copies of ids, lengths, the conv windows (last K-1 inputs), K/V and the SSM states
        (conventional layout, fp32) on ``device``."""
        dev = device or self.device
        cp = lambda t: t.detach().to(dev, copy=True)  # noqa: E731
        A = {i: self.consts[i]["A"] for i in self.mamba}
        return dict(ids=cp(self.ids), lengths=cp(self.lengths), conv={i: cp(t) for i, t in self.conv.items()},
                    k={i: cp(t) for i, t in self.k.items()}, v={i: cp(t) for i, t in self.v.items()},
                    ssm={i: cp(t) for i, t in self.ssm.states(A).items()})

    def restore(self, snap: dict) -> None:
        self.ids.copy_(snap["ids"])
        self.load_committed(snap)


# ---- speculative decoding ----------------------------------------------------------------------------------
def accept(tokens: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy speculative acceptance on the device (no host sync).

    tokens (batch, T) int64: [last committed token, draft_1 .. draft_{T-1}]; target (batch, T) int64:
    the target's token after each input. Returns n_accepted (batch,) int32 in [1, T] (the longest
    prefix of drafts equal to the target's tokens, plus the bonus token) and bonus (batch,) int64
    (target[n_accepted - 1]: the target's token at the first mismatch, or after the last draft).
    """
    match = (tokens[:, 1:] == target[:, :-1]).to(torch.int32)
    n_match = match.cumprod(dim=1).sum(dim=1)
    bonus = target.gather(1, n_match[:, None]).squeeze(1)
    return (n_match + 1).to(torch.int32), bonus


def designed_accepted_per_step(alpha: float, T: int) -> float:
    """E[n_accepted] when each draft matches independently with probability alpha: sum_{k<T} alpha^k."""
    return float(sum(alpha ** k for k in range(T)))


def make_drafts(ref: torch.Tensor, alpha: float, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Draft table from the target's greedy continuation ``ref`` (batch, n): each entry kept with
    probability ``alpha``, else replaced by a different token. Column 0 (the first greedy token, never
    a draft) is kept. Each position is compared at most once (a rejected position becomes the bonus
    token), so the per-position acceptance is alpha, independently."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: expected in [0, 1], got {alpha}")
    if vocab < 2:
        raise ValueError(f"vocab: expected >= 2, got {vocab}")
    keep = torch.rand(ref.shape, generator=gen) < alpha
    keep[:, 0] = True
    wrong = (ref.cpu() + 1 + torch.randint(0, vocab - 1, ref.shape, generator=gen)) % vocab
    return torch.where(keep, ref.cpu(), wrong).to(ref.device)


class SpecStep(HybridStep):
    """One speculative verify step of T >= 2 tokens with greedy acceptance against draft / reference
    tables of ``table_len`` tokens per row.

    Inputs ``tokens[b] = [t_0, d_1 .. d_{T-1}]``: t_0 the last committed token (not yet in any cache),
    d_i the draft for the i-th next token. Acceptance (:func:`accept`, on the device): n = longest
    prefix of matching drafts + 1 (the bonus token). Then, inside the graph: ``ssm.end_step(n)`` once
    (ReplaySSM: cursor move; native: copy snapshot n-1), ``shift = T - n`` (the conv windows' committed
    inputs), lengths += n (rejected K/V stay beyond the length, masked, overwritten later), emitted
    tokens written to ``out``, ``pos`` += n, next inputs ``[bonus, drafts[pos .. pos+T-2]]``.

    Targets: ``live=True`` compares drafts with the step's own argmax (speculative decoding as served);
    ``live=False`` with the reference table ``ref`` (the target's greedy continuation, computed once):
    the path is then fixed and identical in every mode while the step still computes its argmax;
    ``agree`` counts accepted positions where the live argmax equals the reference token.

    Extra in-place state: ``pos`` (batch,) (tokens emitted so far, the first greedy token included),
    ``out`` (batch, table_len + T) (entries >= pos are scratch), ``n_acc`` (batch,) int32, ``agree``
    and ``partial`` (batch,) counters; ``ref`` and ``drafts`` (batch, table_len) are inputs. Indices
    into the tables and caches are clamped so an over-long run never writes out of bounds; the driver
    sizes the tables so clamping never happens (``steps * T + T + 1 <= table_len``). A window that runs
    past the KV cache (lengths[b] + T > kv_len) writes its tokens beyond kv_len - 1 to scratch rows, so
    the tokens within the cache keep sequential decoding's logits.
    """

    def __init__(self, model, batch: int, kv_len: int, T: int, table_len: int, ssm: SSMMode, live: bool = True,
                 fuse: bool | None = None):
        if T < 2:
            raise ValueError(f"T: expected >= 2 (one token and at least one draft), got {T}")
        if table_len < T + 1:
            raise ValueError(f"table_len: expected >= T + 1 = {T + 1}, got {table_len}")
        super().__init__(model, batch, kv_len, ssm, T=T, fuse=fuse)
        self.table_len, self.live = table_len, live
        i64 = dict(dtype=torch.int64, device=self.device)
        b = batch
        self.pos = torch.zeros(b, **i64)
        self.out = torch.zeros(b, table_len + T, **i64)
        self.ref = torch.zeros(b, table_len, **i64)
        self.drafts = torch.zeros(b, table_len, **i64)
        self.agree = torch.zeros(b, **i64)
        self.partial = torch.zeros(b, **i64)
        self.n_acc = torch.zeros(b, dtype=torch.int32, device=self.device)

    def set_tables(self, ref: torch.Tensor, drafts: torch.Tensor) -> None:
        """Reference continuation and draft table (batch, >= table_len); column 0 = the first greedy token."""
        n = self.table_len
        if ref.shape[0] != self.batch or ref.shape[1] < n or drafts.shape != ref.shape:
            raise ValueError(f"ref, drafts: expected equal shapes ({self.batch}, >= {n}), got "
                             f"{tuple(ref.shape)} and {tuple(drafts.shape)}")
        self.ref.copy_(ref[:, :n])
        self.drafts.copy_(drafts[:, :n])

    def restore(self, snap: dict) -> None:
        """Start from a standard step's snapshot (after the prompt; ids = the first greedy token)."""
        self.load_committed(snap)
        self.pos.fill_(1)
        self.tokens[:, 0].copy_(snap["ids"])
        self.tokens[:, 1:].copy_(self.drafts[:, 1:self.T])
        self.out.zero_()
        self.out[:, 0].copy_(snap["ids"])
        self.agree.zero_()
        self.partial.zero_()

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        self.forward()
        T, last = self.T, self.table_len - 1
        at = self.pos[:, None] + self.ar_T[None, :]  # output positions of the T targets
        target = self.argmax if self.live else self.ref.gather(1, at.clamp(max=last))
        n_acc, bonus = accept(self.tokens, target)
        self.n_acc.copy_(n_acc)
        within = self.ar_T[None, :] < n_acc[:, None]
        self.agree.add_(((self.argmax == target) & within).sum(1))
        self.partial.add_(n_acc < T)
        self.out.scatter_(1, at.clamp(max=self.out.shape[1] - 1), target)  # entries >= pos + n: scratch
        self.ssm.end_step(self.sbi, self.n_acc)
        n64 = n_acc.to(torch.int64)
        self.shift.copy_(T - n64)
        self.lengths.add_(n64)
        self.pos.add_(n64)
        self.tokens[:, 0].copy_(bonus)
        nxt = (self.pos[:, None] + self.ar_T[None, :T - 1]).clamp(max=last)
        self.tokens[:, 1:].copy_(self.drafts.gather(1, nxt))
        return self.logits
