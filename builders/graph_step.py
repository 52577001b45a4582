# SPDX-License-Identifier: Apache-2.0
"""A CUDA-graph-capturable Nemotron-H decode step with in-place state and a pluggable SSM step.

:class:`HybridDecodeStep` runs one token for every row of a batch over the weights of a
transformers ``NemotronHForCausalLM`` (the module tree is only a weight container: every op is
written here with plain torch, so transformers 5.17 and 5.24 give the same step). All state lives
in tensors allocated once, updated in place, so one call can be captured in a CUDA graph and
replayed: greedy decoding then needs no host work at all (the step writes its argmax back into
``ids``).

Per step, row b (slot b), in order of the layers (M = Mamba-2, * = attention, - = MLP; each block
is ``h <- h + mixer(rmsnorm(h))``):

  embed       h = E[ids]
  M           in_proj -> (z, xBC, dt); conv window [conv_state[1:], xBC] (in place), silu;
              y = ssm.step(layer, x, B, C, dt, dt_bias, A, D, sbi)      <- the only pluggable part
              gated RMSNorm(y, z) per group; out_proj
  *           q, k, v; k, v written at lengths[b] (scatter); dense attention over the whole cache
              (positions > lengths[b] masked), no positional encoding (Nemotron-H is NoPE); o_proj
  -           down(relu(up(h))^2)
  head        norm_f, lm_head -> logits (fp32, a static buffer); ids <- argmax; lengths += 1;
              ssm.end_step(sbi) (ReplaySSM: the one cursor advance of the step)

SSM backends (:class:`SSMBackend`) own their state. They all start from the same conventional
state (a snapshot taken after the prompt), so the tokens of every backend can be compared:

  conventional   S (batch, H, P, N) fp32, read and written every step
  replay         checkpoint S0 = S, cursor 0, x/B/dt buffers; one fused ``replay_decode`` per layer
  replay + shadow  the same, plus a bf16 (or fp8-e4m3 + per-(slot, head, row) scale) copy of S0 that
                 non-flush steps read instead of S0; written from S0 at ``load`` (prefill hand-off)
                 with :class:`~trtllm_replayssm.reference.Shadow`'s rounding, rewritten by every flush
  mamba_ssm      mamba_ssm's Triton ``selective_state_update`` on the same S (CUDA only)
  noop           no SSM work at all (y = 0): the step without the SSM, for the SSM's share of time

CPU: the conventional and replay backends run the float64 reference (:mod:`trtllm_replayssm.reference`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtllm_replayssm.reference import FP8_E4M3_MAX, Shadow

from .nemotron_h import reference_backend

SUPPORTED = ("linear_attention", "full_attention", "mlp")


# ---- SSM backends -------------------------------------------------------------------------------------
class SSMBackend:
    """Interface: ``alloc`` per-layer state, ``load`` it from conventional fp32 states, ``step`` one
    layer (returns y (batch, H, P) in x's dtype), ``end_step`` once per model step."""

    name = "?"
    needs_cuda = False

    def alloc(self, layers, batch, H, P, N, G, device, act_dtype):
        self.batch, self.layers = batch, list(layers)
        self.state = {i: torch.zeros(batch, H, P, N, dtype=torch.float32, device=device) for i in layers}

    def load(self, states: dict) -> None:
        for i, s in states.items():
            self.state[i].copy_(s)

    def states(self) -> dict:
        """Current recurrent state per layer (conventional layout, fp32)."""
        return self.state

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        raise NotImplementedError

    def end_step(self, sbi) -> None:
        pass

    def free(self) -> None:
        self.state = {}


def _conventional_reference(state, x, B, C, dt, dt_bias, A, D, sbi):
    from trtllm_replayssm import reference

    wide = state.double()
    y = reference.conventional_step(wide, x.double(), B.double(), C.double(), dt.double(), dt_bias.double(),
                                    A.double(), D.double(), state_batch_indices=sbi)
    state.copy_(wide)
    return y.to(x.dtype)


class Conventional(SSMBackend):
    name = "conventional"

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        if x.device.type != "cuda":
            return _conventional_reference(self.state[i], x, B, C, dt, dt_bias, A, D, sbi)
        from trtllm_replayssm import ops

        return ops.conventional_step(x, B, C, dt, dt_bias, A, D, self.state[i], sbi)


class Replay(SSMBackend):
    """ReplaySSM: ``replay_decode`` per layer, one ``advance_cursor`` per step. ``advance`` may be
    replaced (the tests break it on purpose)."""

    name = "replay"

    def __init__(self, buffer_len: int = 16, advance=None, shadow: str | None = None):
        if not 1 <= buffer_len <= 32:
            raise ValueError(f"buffer_len: expected 1..32, got {buffer_len}")
        if shadow not in (None, "bf16", "fp8"):
            raise ValueError(f"shadow: expected None, 'bf16' or 'fp8', got {shadow!r}")
        self.L = buffer_len
        self.advance = advance
        self.shadow_kind = shadow
        if shadow is not None:
            self.name = f"replay_{shadow}"

    def alloc(self, layers, batch, H, P, N, G, device, act_dtype):
        super().alloc(layers, batch, H, P, N, G, device, act_dtype)
        L = self.L
        self.x_cache = {i: torch.zeros(batch, H, L, P, dtype=act_dtype, device=device) for i in layers}
        self.B_cache = {i: torch.zeros(batch, G, L, N, dtype=act_dtype, device=device) for i in layers}
        self.dt_cache = {i: torch.zeros(batch, H, L, dtype=torch.float32, device=device) for i in layers}
        self.cursor = torch.zeros(batch, dtype=torch.int32, device=device)
        self.shadow, self.shadow_scale = {}, {}
        if self.shadow_kind is not None:
            dtype = torch.bfloat16 if self.shadow_kind == "bf16" else torch.float8_e4m3fn
            self.shadow = {i: torch.zeros(batch, H, P, N, dtype=dtype, device=device) for i in layers}
            if self.shadow_kind == "fp8":
                self.shadow_scale = {i: torch.ones(batch, H, P, dtype=torch.float32, device=device) for i in layers}

    def load(self, states: dict) -> None:
        super().load(states)  # the prompt's final state becomes the checkpoint, the buffers are empty
        self.cursor.zero_()
        for i in self.shadow:  # prefill hand-off: the shadow of the new checkpoint
            write_shadow(self.state[i], self.shadow[i], self.shadow_scale.get(i))

    def states(self) -> dict:
        from trtllm_replayssm import reference

        out = {}
        for i in self.layers:
            A = getattr(self, "A_for_states", {}).get(i)
            if A is None:
                raise RuntimeError("Replay.states: set A_for_states[layer] first")
            out[i] = torch.stack([reference.replay_state(self.state[i], self.x_cache[i], self.B_cache[i],
                                                         self.dt_cache[i], self.cursor, A, s).float()
                                  for s in range(self.batch)])
        return out

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        kw = dict(state=self.state[i], x_cache=self.x_cache[i], B_cache=self.B_cache[i], dt_cache=self.dt_cache[i],
                  cursor=self.cursor, x=x, B=B, C=C, dt=dt, dt_bias=dt_bias, A=A, D=D, state_batch_indices=sbi)
        q, scale = self.shadow.get(i), self.shadow_scale.get(i)
        if x.device.type != "cuda":
            if q is None:
                return reference_backend(z=None, **kw)
            # The float64 reference reads Shadow.read(slot) and rewrites the shadow of a flushed slot
            # from its float64 state; the kernel rewrites it from the stored fp32 checkpoint, so the
            # flushed slots (cursor L-1 before the step, as the kernel decides) are rewritten here
            # from self.state once reference_backend has stored it back in fp32.
            rows = sbi[sbi >= 0].long()
            flushed = rows[self.cursor[rows] == self.L - 1]
            y = reference_backend(z=None, shadow=Shadow.wrap(q, scale), **kw)
            if flushed.numel():
                sq = q[flushed]
                ss = None if scale is None else scale[flushed]
                write_shadow(self.state[i][flushed], sq, ss)
                q[flushed] = sq
                if scale is not None:
                    scale[flushed] = ss
            return y
        from trtllm_replayssm import ops

        return ops.replay_decode(**kw, shadow=q, shadow_scale=scale)

    def end_step(self, sbi) -> None:
        if self.advance is not None:
            self.advance(self.cursor, sbi, self.L)
        elif self.cursor.device.type == "cuda":
            from trtllm_replayssm import ops

            ops.advance_cursor(self.cursor, sbi, self.L)
        else:
            from trtllm_replayssm import reference

            reference.advance_cursor(self.cursor, sbi, self.L)

    def free(self) -> None:
        super().free()
        self.x_cache = self.B_cache = self.dt_cache = {}
        self.shadow, self.shadow_scale = {}, {}


def write_shadow(state: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None) -> None:
    """``Shadow.write`` for every slot at once, in place: q = bf16(S), or (fp8, ``scale`` given)
    scale = max_n |S[slot, h, p, n]| / 448 (1 for an all-zero row), q = e4m3(S / scale). The same
    elementwise ops in the same order as :meth:`trtllm_replayssm.reference.Shadow.write`, so the
    bits are the same (tests/test_bench_decode.py compares them)."""
    if scale is None:
        q.copy_(state.to(torch.bfloat16))
        return
    S32 = state.float()
    amax = S32.abs().amax(dim=-1)
    scale.copy_(torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax)))
    q.copy_((S32 / scale[..., None]).to(torch.float8_e4m3fn))


class MambaSSM(SSMBackend):
    """mamba_ssm's Triton ``selective_state_update`` (tie_hdim: dt, A, dt_bias, D broadcast over
    headdim with stride 0, as Nemotron-H calls it; D and dt_bias always passed)."""

    name = "mamba_ssm"
    needs_cuda = True

    def __init__(self, fn):
        self.fn = fn
        self._consts = {}

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        batch, H, P = x.shape
        N = self.state[i].shape[-1]
        c = self._consts.get(i)
        if c is None:  # built on the eager warm-up step, reused inside the graph
            c = self._consts[i] = (A[:, None, None].expand(H, P, N), dt_bias[:, None].expand(H, P),
                                   D[:, None].expand(H, P), sbi.long())
        A_t, bias_t, D_t, sbi_l = c
        return self.fn(self.state[i], x, dt[:, :, None].expand(batch, H, P), A_t, B, C, D=D_t, dt_bias=bias_t,
                       dt_softplus=True, state_batch_indices=sbi_l)

    def free(self) -> None:
        super().free()
        self._consts = {}


class NoOp(SSMBackend):
    """No SSM work: y = 0 (a buffer allocated once). Its tokens are meaningless; it is never gated."""

    name = "noop"

    def alloc(self, layers, batch, H, P, N, G, device, act_dtype):
        self.batch, self.layers = batch, list(layers)
        self.state = {}
        self.y = torch.zeros(batch, H, P, dtype=act_dtype, device=device)

    def load(self, states: dict) -> None:
        pass

    def step(self, i, x, B, C, dt, dt_bias, A, D, sbi):
        return self.y


# ---- the step -------------------------------------------------------------------------------------------
def _rmsnorm(h, w, eps):
    v = h.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * v).to(h.dtype)


def mamba_constants(model, layers) -> dict:
    """Per Mamba layer: A = -exp(A_log), D, dt_bias (fp32), conv weight (conv_dim, K) and bias."""
    out = {}
    for i in layers:
        mx = model.model.layers[i].mixer
        out[i] = dict(A=-torch.exp(mx.A_log.detach().float()), D=mx.D.detach().float().contiguous(),
                      dt_bias=mx.dt_bias.detach().float().contiguous(),
                      conv_w=mx.conv1d.weight.detach()[:, 0, :].contiguous(),
                      conv_b=None if mx.conv1d.bias is None else mx.conv1d.bias.detach())
    return out


def layer_weights(layer, kind: str) -> dict:
    """The projections of one layer's mixer as (weight, bias) tensors (the module's own, no copies):
    Mamba in_w/in_b, out_w/out_b, norm_w; attention q/k/v/o_w and _b; MLP up/down_w and _b."""
    mx = layer.mixer
    wb = lambda name, lin: {f"{name}_w": lin.weight, f"{name}_b": lin.bias}  # noqa: E731
    if kind == "linear_attention":
        return {**wb("in", mx.in_proj), **wb("out", mx.out_proj), "norm_w": mx.norm.weight}
    if kind == "full_attention":
        return {**wb("q", mx.q_proj), **wb("k", mx.k_proj), **wb("v", mx.v_proj), **wb("o", mx.o_proj)}
    return {**wb("up", mx.up_proj), **wb("down", mx.down_proj)}


def check_step_args(cfg, batch: int, kv_len: int) -> None:
    """The model's layer kinds are ones a captured step supports; batch and KV positions are positive."""
    bad = sorted({t for t in cfg.layers_block_type if t not in SUPPORTED})
    if bad:
        raise ValueError(f"layers_block_type: expected only {SUPPORTED}, got {bad}")
    if batch < 1 or kv_len < 1:
        raise ValueError(f"batch and kv_len: expected >= 1, got {batch} and {kv_len}")


class HybridDecodeStep:
    """One decode step over ``model``'s weights for ``batch`` rows, KV caches of ``kv_len`` positions.

    Attributes updated in place by :meth:`__call__`: ``ids`` (batch,) int64 (input token; the greedy
    next token after the call), ``lengths`` (batch,) int64 (tokens in the KV caches), ``conv[i]``,
    ``k[i]``, ``v[i]``, ``logits`` (batch, vocab) fp32, and the SSM backend's state.
    """

    def __init__(self, model, batch: int, kv_len: int, ssm: SSMBackend):
        cfg = model.config
        check_step_args(cfg, batch, kv_len)
        self.model, self.cfg, self.batch, self.kv_len = model, cfg, batch, kv_len
        self.kinds = list(cfg.layers_block_type)
        p = next(model.parameters())
        self.device, self.act = p.device, p.dtype
        self.H, self.P, self.N, self.G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        self.nh, self.kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.mamba = [i for i, k in enumerate(self.kinds) if k == "linear_attention"]
        self.attn = [i for i, k in enumerate(self.kinds) if k == "full_attention"]
        self.eps = cfg.layer_norm_epsilon
        self.consts = mamba_constants(model, self.mamba)
        self.w = {i: layer_weights(model.model.layers[i], k) for i, k in enumerate(self.kinds)}
        self._shard()  # tensor parallelism (builders/tp_step.py): local dims, consts and weights
        dev, b = self.device, batch
        conv_dim = self.H * self.P + 2 * self.G * self.N
        kvh, hd = self.kvh, cfg.head_dim
        self.ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.lengths = torch.zeros(b, dtype=torch.int64, device=dev)
        self.sbi = torch.arange(b, dtype=torch.int32, device=dev)
        self.conv = {i: torch.zeros(b, conv_dim, cfg.conv_kernel, dtype=self.act, device=dev) for i in self.mamba}
        self.k = {i: torch.zeros(b, kvh, kv_len, hd, dtype=self.act, device=dev) for i in self.attn}
        self.v = {i: torch.zeros(b, kvh, kv_len, hd, dtype=self.act, device=dev) for i in self.attn}
        self.pos = torch.arange(kv_len, device=dev)
        self.logits = torch.zeros(b, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.ssm = None
        self.set_ssm(ssm)

    def set_ssm(self, ssm: SSMBackend) -> None:
        if self.ssm is not None:
            self.ssm.free()
        if ssm.needs_cuda and self.device.type != "cuda":
            raise ValueError(f"SSM backend {ssm.name!r} needs CUDA tensors, the model is on {self.device}")
        ssm.alloc(self.mamba, self.batch, self.H, self.P, self.N, self.G, self.device, self.act)
        if isinstance(ssm, Replay):
            ssm.A_for_states = {i: self.consts[i]["A"] for i in self.mamba}
        self.ssm = ssm

    # ---- snapshot / restore of everything but the SSM backend's own tensors -------------------------
    def snapshot(self, device=None) -> dict:
        """Copies of ids, lengths, conv, K/V and the SSM states (conventional layout) on ``device``."""
        dev = device or self.device
        cp = lambda t: t.detach().to(dev, copy=True)  # noqa: E731
        return dict(ids=cp(self.ids), lengths=cp(self.lengths), conv={i: cp(t) for i, t in self.conv.items()},
                    k={i: cp(t) for i, t in self.k.items()}, v={i: cp(t) for i, t in self.v.items()},
                    ssm={i: cp(t) for i, t in self.ssm.states().items()})

    def restore(self, snap: dict) -> None:
        self.ids.copy_(snap["ids"])
        self.lengths.copy_(snap["lengths"])
        for name in ("conv", "k", "v"):
            for i, t in getattr(self, name).items():
                t.copy_(snap[name][i])
        self.ssm.load(snap["ssm"])  # layer by layer (copy_ crosses devices): no second full copy on the GPU

    # ---- hooks of tensor parallelism (identities at TP=1) -------------------------------------------------
    def _shard(self) -> None:
        """Replace dims, ``consts`` and ``w`` by this rank's share (before any state is allocated)."""

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of the row-parallel partial products over ranks (all-reduce), in place."""
        return t

    def _group_var(self, g: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm variance per norm group of ``g`` (b, H*P fp32) -> (b, G, 1)."""
        return g.view(g.shape[0], self.G, -1).pow(2).mean(-1, keepdim=True)

    # ---- layers -----------------------------------------------------------------------------------------
    def _mamba(self, i, h):
        c, w, b = self.consts[i], self.w[i], self.batch
        H, P, N, G = self.H, self.P, self.N, self.G
        gate, xBC, dt = F.linear(h, w["in_w"], w["in_b"]).split([H * P, H * P + 2 * G * N, H], dim=-1)
        cs = self.conv[i]
        cs.copy_(torch.cat([cs[:, :, 1:], xBC[:, :, None]], dim=-1))
        conv = (cs * c["conv_w"]).sum(-1)
        if c["conv_b"] is not None:
            conv = conv + c["conv_b"]
        x, B, C = F.silu(conv).split([H * P, G * N, G * N], dim=-1)
        y = self.ssm.step(i, x.reshape(b, H, P).contiguous(), B.reshape(b, G, N).contiguous(),
                          C.reshape(b, G, N).contiguous(), dt.contiguous(), c["dt_bias"], c["A"], c["D"], self.sbi)
        g = y.reshape(b, H * P).float() * F.silu(gate.float())
        g = (g.view(b, G, -1) * torch.rsqrt(self._group_var(g) + self.eps)).view(b, H * P)
        return self._out(F.linear((w["norm_w"].float() * g).to(h.dtype), w["out_w"]), w["out_b"])

    def _out(self, partial, bias):
        out = self._reduce(partial)
        return out if bias is None else out + bias

    def _attention(self, i, h):
        cfg, w, b = self.cfg, self.w[i], self.batch
        nh, kvh, hd = self.nh, self.kvh, cfg.head_dim
        q = F.linear(h, w["q_w"], w["q_b"]).view(b, kvh, nh // kvh, hd)
        k = F.linear(h, w["k_w"], w["k_b"]).view(b, kvh, 1, hd)
        v = F.linear(h, w["v_w"], w["v_b"]).view(b, kvh, 1, hd)
        at = self.lengths.view(b, 1, 1, 1).expand(b, kvh, 1, hd)
        self.k[i].scatter_(2, at, k)
        self.v[i].scatter_(2, at, v)
        scores = torch.matmul(q, self.k[i].transpose(2, 3)).float() * hd ** -0.5  # (b, kvh, rep, S)
        hidden = (self.pos[None, :] > self.lengths[:, None])[:, None, None, :]
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).to(h.dtype)
        return self._out(F.linear(torch.matmul(probs, self.v[i]).reshape(b, nh * hd), w["o_w"]), w["o_b"])

    def _mlp(self, i, h):
        w = self.w[i]
        return self._out(F.linear(torch.relu(F.linear(h, w["up_w"], w["up_b"])).square(), w["down_w"]), w["down_b"])

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        m = self.model.model
        h = F.embedding(self.ids, m.embeddings.weight)
        for i, (kind, layer) in enumerate(zip(self.kinds, m.layers)):
            hn = _rmsnorm(h, layer.norm.weight, self.eps)
            if kind == "linear_attention":
                out = self._mamba(i, hn)
            elif kind == "full_attention":
                out = self._attention(i, hn)
            else:
                out = self._mlp(i, hn)
            h = h + out
        self.logits.copy_(self.model.lm_head(_rmsnorm(h, m.norm_f.weight, self.eps)).float())
        self.ids.copy_(self.logits.argmax(-1))
        self.lengths.add_(1)
        self.ssm.end_step(self.sbi)
        return self.logits

    def feed(self, tokens: torch.Tensor) -> None:
        """Prompt by stepping: ``tokens`` (batch, T); afterwards ``ids`` holds the first greedy token."""
        for t in range(tokens.shape[1]):
            self.ids.copy_(tokens[:, t])
            self()
