# SPDX-License-Identifier: Apache-2.0
"""A CUDA-graph-capturable speculative verify step of the whole Nemotron-H model (T = 1 + num_draft).

:class:`HybridSpecStep` is the speculative sibling of :class:`builders.graph_step.HybridDecodeStep`:
same weights (transformers' module tree as a container only), same plain-torch ops, all state in
tensors allocated once and updated in place, so one call (verify + accept + commit + next drafts)
is captured in one CUDA graph and replayed with no host work.

Per step, row b. Inputs ``tokens[b] = [t_0, d_1 .. d_{T-1}]``: t_0 the last committed token (not yet
in any cache), d_i the draft for the i-th next token. Every layer sees the T tokens at once:

  M   in_proj on (b, T) tokens; conv1d over the window (S, conv_dim, W = K-1 + num_draft): the T
      outputs from the last K-1 committed inputs + the T new ones, then the T inputs shifted in
      (:func:`conv_window_update`, as :func:`~trtllm_replayssm.spec_reference.conv_window_update`);
      y = ssm.verify(layer, x, B, C, dt, ...)  (batch, T, H, P)      <- the pluggable part
  *   q, k, v of the T tokens; k, v written at lengths[b] + t; query t sees cache positions
      <= lengths[b] + t (causal inside the window); dense over the cache as in the standard step
  -   MLP on batch * T tokens
  head  logits (batch, T, vocab) fp32; argmax; target[b, t] = the target's token after input t

Acceptance (:func:`accept`, on the device): n_match = longest prefix i with d_{i+1} = target[i];
accepted n = n_match + 1 (the accepted drafts plus the bonus token target[n_match], the target's
token at the first mismatch, or after the last draft). Then, still inside the graph:
``ssm.commit(n)`` once (ReplaySSM: cursor move; native: copy snapshot n-1), conv windows rolled back
by T - n (:func:`conv_window_rollback`), lengths += n (rejected K/V stay beyond the length, masked,
overwritten later), emitted tokens written to ``out``, ``pos`` += n, and the next inputs
``[bonus, drafts[pos .. pos+T-2]]`` gathered from the draft table.

Targets: ``live=True`` compares drafts with the step's own argmax (speculative decoding as served;
used by the exactness check); ``live=False`` compares them with a reference table (the target's
greedy continuation, computed once): the path through the tables is then fixed, identical in every
mode and immune to bf16 forks, while the step still computes its argmax (so the timed work is the
same); ``agree`` counts accepted positions where the live argmax equals the reference token.

SSM backends (:class:`SpecBackend`), all loaded from the same conventional fp32 states:
  replay_spec   ReplaySSM: ``ops.replay_verify`` per layer (flush inside when count + 2T > L),
                one ``ops.spec_commit`` per step; cursor (slots, 2) shared by all layers
  native_spec   vLLM / TensorRT-LLM style: ``ops.native_spec_verify`` writes T state snapshots per
                layer, ``ops.native_spec_commit`` copies snapshot n-1 into the state, per layer
  spec_noop     no SSM work (y = 0): the speculative step without the SSM (its share of the time)
CPU: the float64 references of :mod:`trtllm_replayssm.spec_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .graph_step import _rmsnorm, check_step_args, mamba_constants


# ---- acceptance ------------------------------------------------------------------------------------
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


# ---- conv1d window -----------------------------------------------------------------------------------
def conv_window_update(window: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """Causal depthwise conv of the T new inputs over the window; shifts them in (in place).

    window (batch, conv_dim, W), W = K - 1 + num_draft, last K-1 columns = last K-1 committed inputs;
    u (batch, T, conv_dim); weight (conv_dim, K). Returns the pre-activation outputs (batch, T, conv_dim)
    in the window's dtype. W = K - 2 + T: the new window is the last W of [committed K-1, new T].
    """
    K, W, T = weight.shape[1], window.shape[2], u.shape[1]
    if W != K - 2 + T:
        raise ValueError(f"window: expected width K - 2 + T = {K - 2 + T}, got {W}")
    seq = torch.cat([window[:, :, W - (K - 1):], u.transpose(1, 2)], dim=2)  # (batch, conv_dim, K-1+T)
    out = (seq.unfold(2, K, 1) * weight[:, None, :]).sum(-1)  # (batch, conv_dim, T)
    if bias is not None:
        out = out + bias[:, None]
    window.copy_(seq[:, :, 1:])
    return out.transpose(1, 2)


def conv_window_rollback(windows: torch.Tensor, n_accepted: torch.Tensor, T: int, cols: torch.Tensor | None = None):
    """Drop the T - n rejected inputs of every row (in place): shift right by T - n, zero the front.

    windows (..., batch, conv_dim, W) (all Mamba layers in one tensor: one gather for the step);
    n_accepted (batch,) in [1, T]. Same result as spec_reference.conv_window_rollback per layer.
    """
    W = windows.shape[-1]
    if cols is None:
        cols = torch.arange(W, device=windows.device)
    src = cols[None, :] - (T - n_accepted.to(cols.dtype))[:, None]  # (batch, W)
    valid = src >= 0
    idx = src.clamp(min=0)[:, None, :].expand(windows.shape[-3:])
    idx = idx.expand(windows.shape)
    moved = windows.gather(-1, idx)
    windows.copy_(moved.masked_fill_(~valid[:, None, :], 0))
    return windows


# ---- SSM backends ---------------------------------------------------------------------------------------
class SpecBackend:
    """Interface: ``alloc`` per-layer tensors, ``load`` conventional fp32 states, ``verify`` one layer
    (y (batch, T, H, P) in x's dtype), ``commit`` once per model step with n_accepted (batch,) int32."""

    name = "?"
    needs_cuda = False

    def alloc(self, layers, batch, T, H, P, N, G, device, act_dtype):
        self.batch, self.T, self.layers = batch, T, list(layers)
        self.state = {i: torch.zeros(batch, H, P, N, dtype=torch.float32, device=device) for i in layers}

    def load(self, states: dict) -> None:
        for i, s in states.items():
            self.state[i].copy_(s)

    def verify(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        raise NotImplementedError

    def commit(self, n_accepted, sbi) -> None:
        pass

    def free(self) -> None:
        self.state = {}


class ReplaySpec(SpecBackend):
    """ReplaySSM: checkpoint + rings, ``replay_verify`` per layer, one ``spec_commit`` per step.
    ``commit_fn(cursor, n_accepted, sbi, T, L)`` replaces the commit (the tests break it on purpose)."""

    name = "replay_spec"

    def __init__(self, buffer_len: int = 16, commit_fn=None):
        self.L = buffer_len
        self.commit_fn = commit_fn

    def alloc(self, layers, batch, T, H, P, N, G, device, act_dtype):
        if self.L < 2 * T:
            raise ValueError(f"buffer_len: expected >= 2T = {2 * T} (flush one window early), got {self.L}")
        super().alloc(layers, batch, T, H, P, N, G, device, act_dtype)
        L = self.L
        self.x_cache = {i: torch.zeros(batch, H, L, P, dtype=act_dtype, device=device) for i in layers}
        self.B_cache = {i: torch.zeros(batch, G, L, N, dtype=act_dtype, device=device) for i in layers}
        self.dt_cache = {i: torch.zeros(batch, H, L, dtype=torch.float32, device=device) for i in layers}
        self.cursor = torch.zeros(batch, 2, dtype=torch.int32, device=device)

    def load(self, states: dict) -> None:
        super().load(states)  # the prompt's final state is the checkpoint; empty ring from index 0
        self.cursor.zero_()

    def verify(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        caches = (self.state[i], self.x_cache[i], self.B_cache[i], self.dt_cache[i], self.cursor)
        if x.device.type != "cuda":
            from trtllm_replayssm import spec_reference as sr

            # As the kernel: fold the history into this layer's checkpoint and verify from the flushed
            # cursor, which itself moves once per model step, in commit (all layers read it first).
            sr.flush_checkpoint(*caches, A, x.shape[1], sbi)
            flushed = self.cursor.clone()
            sr.flush_cursor(flushed, x.shape[1], self.L, sbi)
            return sr.verify(*caches[:4], flushed, x, B, C, dt, dt_bias, A, D, state_batch_indices=sbi).to(x.dtype)
        from trtllm_replayssm import ops

        return ops.replay_verify(x, B, C, dt, dt_bias, A, D, *caches, sbi)

    def commit(self, n_accepted, sbi) -> None:
        if self.commit_fn is not None:
            self.commit_fn(self.cursor, n_accepted, sbi, self.T, self.L)
        elif self.cursor.device.type == "cuda":
            from trtllm_replayssm import ops

            ops.spec_commit(self.cursor, n_accepted, sbi, self.T, self.L)
        else:
            from trtllm_replayssm import spec_reference as sr

            sr.flush_cursor(self.cursor, self.T, self.L, sbi)
            sr.commit(self.cursor, n_accepted, self.T, self.L, sbi)

    def free(self) -> None:
        super().free()
        self.x_cache = self.B_cache = self.dt_cache = {}


class NativeSpec(SpecBackend):
    """Native spec: T fp32 state snapshots per layer and slot, commit = copy of snapshot n-1."""

    name = "native_spec"

    def alloc(self, layers, batch, T, H, P, N, G, device, act_dtype):
        super().alloc(layers, batch, T, H, P, N, G, device, act_dtype)
        self.snapshots = {i: torch.zeros(batch, T, H, P, N, dtype=torch.float32, device=device) for i in layers}

    def verify(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        if x.device.type != "cuda":
            from trtllm_replayssm import spec_reference as sr

            return sr.native_spec_verify(self.state[i], self.snapshots[i], x, B, C, dt, dt_bias, A, D,
                                         state_batch_indices=sbi).to(x.dtype)
        from trtllm_replayssm import ops

        return ops.native_spec_verify(x, B, C, dt, dt_bias, A, D, self.state[i], self.snapshots[i], sbi)

    def commit(self, n_accepted, sbi) -> None:
        for i in self.layers:
            if n_accepted.device.type == "cuda":
                from trtllm_replayssm import ops

                ops.native_spec_commit(self.state[i], self.snapshots[i], n_accepted, sbi)
            else:
                from trtllm_replayssm import spec_reference as sr

                sr.native_spec_commit(self.state[i], self.snapshots[i], n_accepted, sbi)

    def free(self) -> None:
        super().free()
        self.snapshots = {}


class NoOpSpec(SpecBackend):
    """No SSM work: y = 0. Its tokens are meaningless; it is timed on the reference path, never checked."""

    name = "spec_noop"

    def alloc(self, layers, batch, T, H, P, N, G, device, act_dtype):
        self.batch, self.T, self.layers = batch, T, list(layers)
        self.state = {}
        self.y = torch.zeros(batch, T, H, P, dtype=act_dtype, device=device)

    def load(self, states: dict) -> None:
        pass

    def verify(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        return self.y


# ---- the step ----------------------------------------------------------------------------------------------
class HybridSpecStep:
    """One speculative verify step of T tokens for ``batch`` rows, KV caches of ``kv_len`` positions,
    greedy acceptance against draft / reference tables of ``table_len`` tokens per row.

    In-place state: ``tokens`` (batch, T) int64, ``lengths`` (batch,) int64 (committed tokens in the
    KV caches), ``pos`` (batch,) int64 (tokens emitted so far, the first greedy token included),
    ``out`` (batch, table_len + T) int64 (emitted tokens; entries >= pos are scratch), ``conv``
    (Mamba layers, batch, conv_dim, K-1+T-1), ``k``/``v``, ``logits`` (batch, T, vocab) fp32,
    ``argmax`` (batch, T), ``n_acc`` (batch,) int32, ``agree`` and ``partial`` (batch,) int64
    counters, and the SSM backend's state. ``ref`` and ``drafts`` (batch, table_len) are inputs.
    Indices into the tables and the caches are clamped so an over-long run never writes out of
    bounds; the driver sizes them so that clamping never happens (``steps * T + T + 1 <= table_len``).
    """

    def __init__(self, model, batch: int, kv_len: int, T: int, table_len: int, ssm: SpecBackend, live: bool = True):
        cfg = model.config
        check_step_args(cfg, batch, kv_len)
        if T < 2:
            raise ValueError(f"T: expected >= 2 (one token and at least one draft), got {T}")
        if table_len < T + 1:
            raise ValueError(f"table_len: expected >= T + 1 = {T + 1}, got {table_len}")
        self.model, self.cfg, self.batch, self.kv_len, self.T = model, cfg, batch, kv_len, T
        self.table_len, self.live, self.rollback_conv = table_len, live, True
        self.kinds = list(cfg.layers_block_type)
        p = next(model.parameters())
        self.device, self.act = p.device, p.dtype
        self.H, self.P, self.N, self.G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        self.K = cfg.conv_kernel
        self.mamba = [i for i, k in enumerate(self.kinds) if k == "linear_attention"]
        self.attn = [i for i, k in enumerate(self.kinds) if k == "full_attention"]
        self.eps = cfg.layer_norm_epsilon
        self.consts = mamba_constants(model, self.mamba)
        dev, b = self.device, batch
        conv_dim = self.H * self.P + 2 * self.G * self.N
        self.W = self.K - 2 + T
        kvh, hd = cfg.num_key_value_heads, cfg.head_dim
        i64 = dict(dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(b, T, **i64)
        self.lengths = torch.zeros(b, **i64)
        self.pos = torch.zeros(b, **i64)
        self.out = torch.zeros(b, table_len + T, **i64)
        self.ref = torch.zeros(b, table_len, **i64)
        self.drafts = torch.zeros(b, table_len, **i64)
        self.argmax = torch.zeros(b, T, **i64)
        self.agree = torch.zeros(b, **i64)
        self.partial = torch.zeros(b, **i64)
        self.n_acc = torch.zeros(b, dtype=torch.int32, device=dev)
        self.sbi = torch.arange(b, dtype=torch.int32, device=dev)
        self.ar_T = torch.arange(T, **i64)
        self.ar_W = torch.arange(self.W, **i64)
        self.conv_all = torch.zeros(len(self.mamba), b, conv_dim, self.W, dtype=self.act, device=dev)
        self.conv = {i: self.conv_all[j] for j, i in enumerate(self.mamba)}
        self.k = {i: torch.zeros(b, kvh, kv_len, hd, dtype=self.act, device=dev) for i in self.attn}
        self.v = {i: torch.zeros(b, kvh, kv_len, hd, dtype=self.act, device=dev) for i in self.attn}
        self.kv_pos = torch.arange(kv_len, **i64)
        self.logits = torch.zeros(b, T, cfg.vocab_size, dtype=torch.float32, device=dev)
        if ssm.needs_cuda and dev.type != "cuda":
            raise ValueError(f"SSM backend {ssm.name!r} needs CUDA tensors, the model is on {dev}")
        ssm.alloc(self.mamba, b, T, self.H, self.P, self.N, self.G, dev, self.act)
        self.ssm = ssm

    def free(self) -> None:
        self.ssm.free()

    # ---- tables and restore ------------------------------------------------------------------------------
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
        K, W = self.K, self.W
        self.lengths.copy_(snap["lengths"])
        for j, i in enumerate(self.mamba):
            self.conv_all[j].zero_()
            self.conv_all[j][:, :, W - (K - 1):].copy_(snap["conv"][i][:, :, 1:])  # the last K-1 inputs
        for name in ("k", "v"):
            for i, t in getattr(self, name).items():
                t.copy_(snap[name][i])
        self.ssm.load(snap["ssm"])
        self.pos.fill_(1)
        self.tokens[:, 0].copy_(snap["ids"])
        self.tokens[:, 1:].copy_(self.drafts[:, 1:self.T])
        self.out.zero_()
        self.out[:, 0].copy_(snap["ids"])
        self.agree.zero_()
        self.partial.zero_()

    # ---- layers -----------------------------------------------------------------------------------------
    def _mamba(self, i, mx, h):
        c, b, T = self.consts[i], self.batch, self.T
        H, P, N, G = self.H, self.P, self.N, self.G
        gate, xBC, dt = mx.in_proj(h).split([H * P, H * P + 2 * G * N, H], dim=-1)
        conv = conv_window_update(self.conv[i], xBC, c["conv_w"], c["conv_b"])
        x, B, C = F.silu(conv).split([H * P, G * N, G * N], dim=-1)
        y = self.ssm.verify(i, x.reshape(b, T, H, P).contiguous(), B.reshape(b, T, G, N).contiguous(),
                            C.reshape(b, T, G, N).contiguous(), dt.contiguous(), c["dt_bias"], c["A"], c["D"], self.sbi)
        g = y.reshape(b, T, H * P).float() * F.silu(gate.float())
        g = g.view(b, T, G, -1)
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(b, T, H * P)
        return mx.out_proj((mx.norm.weight.float() * g).to(h.dtype))

    def _attention(self, i, att, h):
        cfg, b, T = self.cfg, self.batch, self.T
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        rep = nh // kvh
        q = att.q_proj(h).view(b, T, kvh, rep, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, rep * T, hd)
        k = att.k_proj(h).view(b, T, kvh, hd).transpose(1, 2)
        v = att.v_proj(h).view(b, T, kvh, hd).transpose(1, 2)
        at = (self.lengths[:, None] + self.ar_T[None, :]).clamp(max=self.kv_len - 1)  # (b, T) cache positions
        idx = at[:, None, :, None].expand(b, kvh, T, hd)
        self.k[i].scatter_(2, idx, k)
        self.v[i].scatter_(2, idx, v)
        scores = torch.matmul(q, self.k[i].transpose(2, 3)).float() * hd ** -0.5  # (b, kvh, rep*T, S)
        hidden = self.kv_pos[None, None, :] > at[:, :, None]  # (b, T, S): beyond query t's own position
        scores = scores.view(b, kvh, rep, T, -1).masked_fill(hidden[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(h.dtype).view(b, kvh, rep * T, -1)
        o = torch.matmul(probs, self.v[i]).view(b, kvh, rep, T, hd).permute(0, 3, 1, 2, 4)
        return att.o_proj(o.reshape(b, T, nh * hd))

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        m = self.model.model
        h = F.embedding(self.tokens, m.embeddings.weight)  # (b, T, hidden)
        for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
            hn = _rmsnorm(h, layer.norm.weight, self.eps)
            if kind == "linear_attention":
                out = self._mamba(i, layer.mixer, hn)
            elif kind == "full_attention":
                out = self._attention(i, layer.mixer, hn)
            else:
                mlp = layer.mixer
                out = mlp.down_proj(torch.relu(mlp.up_proj(hn)).square())
            h = h + out
        self.logits.copy_(self.model.lm_head(_rmsnorm(h, m.norm_f.weight, self.eps)).float())
        self.argmax.copy_(self.logits.argmax(-1))
        self._accept_and_commit()
        return self.logits

    def _accept_and_commit(self) -> None:
        last = self.table_len - 1
        at = self.pos[:, None] + self.ar_T[None, :]  # output positions of the T targets
        target = self.argmax if self.live else self.ref.gather(1, at.clamp(max=last))
        n_acc, bonus = accept(self.tokens, target)
        self.n_acc.copy_(n_acc)
        within = self.ar_T[None, :] < n_acc[:, None]
        self.agree.add_(((self.argmax == target) & within).sum(1))
        self.partial.add_(n_acc < self.T)
        self.out.scatter_(1, at.clamp(max=self.out.shape[1] - 1), target)  # entries >= pos + n: scratch
        self.ssm.commit(self.n_acc, self.sbi)
        if self.rollback_conv:
            conv_window_rollback(self.conv_all, self.n_acc, self.T, self.ar_W)
        n64 = n_acc.to(torch.int64)
        self.lengths.add_(n64)
        self.pos.add_(n64)
        self.tokens[:, 0].copy_(bonus)
        nxt = (self.pos[:, None] + self.ar_T[None, :self.T - 1]).clamp(max=last)
        self.tokens[:, 1:].copy_(self.drafts.gather(1, nxt))
