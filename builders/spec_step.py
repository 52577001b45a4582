# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding of Nemotron-H / Nemotron 3 as two exported graphs: verify (every layer) and commit
(after sampling).

One speculative step of T = 1 + num_draft tokens per row (row b is slot b; state_batch_indices =
arange(batch) inside both graphs) is

    logits, states = verify(input_ids, lengths, cursor, states)   # outputs of all T positions
    n = accept(logits, input_ids)                                 # sampling: outside the graphs
    cursor, lengths, conv windows = commit(n, cursor, lengths, conv windows)

Verify graph (:class:`NemotronHSpecStep`). Inputs:

 1. input_ids       (batch, T) int64     the last sampled token, then the num_draft draft tokens
 2. lengths         (batch,) int32       tokens in the KV caches; the T new ones are written at
                                         lengths .. lengths + T - 1 (the caller keeps lengths + T <= max_seq_len)
 3. cursor          (batch, 2) int32     ReplaySSM ring (start, count) shared by all Mamba layers; read only here
 4. per attention layer i: k_cache_i, v_cache_i  (batch, kv_heads, max_seq_len, head_dim)  act
 5. per Mamba layer i:     conv_window_i (batch, conv_dim, K - 1 + num_draft) act,
                           ssm_state_i (batch, H, P, N) state dtype (checkpoint S0),
                           x_cache_i (batch, H, L, P) act, B_cache_i (batch, G, L, N) act,
                           dt_cache_i (batch, H, L) fp32 (processed dt)
Outputs: logits (batch, T, vocab) fp32, then every state of 4-5 as ``<name>_out`` (same shape and
dtype; in-place aliases for the plugin's state tensors in TensorRT). Lengths and cursor are not
outputs: verify does not commit anything.

Per Mamba layer: in_proj of the T tokens; causal depthwise conv over [last K-1 committed inputs
(the window's last K-1 columns), the T new inputs], silu; the T new inputs shifted into the window;
ONE ``replayssm::mamba2_verify`` node (:class:`Mamba2Verify`: window outputs from checkpoint +
committed ring history + the causal part of the window; the window appended to the rings; the
committed history folded into the checkpoint first when count + 2T > L); gated RMSNorm and out_proj.
Attention (NoPE): the T new K/V written at lengths + t, query t attends keys j <= lengths + t.
Rejected positions leave K/V and ring entries beyond the committed range; they are never read and
are overwritten by later windows. MoE layers (Nemotron 3) route each of the batch * T tokens on its
own (:func:`builders.moe.moe_forward`, as in :mod:`.decode_step`) and carry no state.

Commit graph (:class:`NemotronHSpecCommit`). Inputs: n_accepted (batch,) int32 (accepted tokens of
the window including the first one, 1..T for live rows; clamped to [0, T]), cursor (batch, 2),
lengths (batch,), conv_window_i per Mamba layer. Outputs: cursor_out (ONE ``replayssm::spec_commit``
node: the flush the verify layers did, then count += n), lengths_out = lengths + n, conv_window_i_out
(shifted right by T - n, zero-filled: spec_reference.conv_window_rollback; n = 0 drops the oldest
committed conv input, so use it for padding rows only).

Why two graphs: the accepted count depends on sampling the verify logits (greedy, rejection
sampling against a draft model, ...), which belongs to the serving layer, not to the engine; and the
commit is a handful of tiny ops, so a second small engine costs one launch per step. The cursor move
must follow every layer's verify (they all read the same cursor), which a separate graph guarantees.

Math and state layouts: :mod:`trtllm_replayssm.spec_reference`. Export route: as
:mod:`.decode_step` (TorchScript exporter, ``autograd.Function.symbolic``).
"""

from __future__ import annotations

import torch

from trtllm_replayssm import backend as executors

from .decode_step import DOMAIN, Mamba2DecodeShadow, NemotronHDecodeStep, StateSpec, export_graph

VERIFY_OP_TYPE = "mamba2_verify"
VERIFY_SHADOW_OP_TYPE = "mamba2_verify_shadow"
COMMIT_OP_TYPE = "spec_commit"


# ---- reference backends (float64 spec; the ORT custom ops run the same functions) ----------------------
# ``replayssm::mamba2_verify`` in float64 (what the kernel does): fold the committed history into the checkpoint
# where count + 2T > L (stored in the state dtype), then verify the window on the flushed cursor; caches written
# back in their own dtypes, the cursor not moved, y in x's dtype. ``replayssm::spec_commit``: the verify layers'
# flush (count + 2T > L), then count += n (in place). Both are the reference executor of trtllm_replayssm.backend
# in the launchers' keyword form.
verify_reference_backend = executors.replay_verify_kw(executors.REFERENCE)
commit_reference_backend = executors.spec_commit_kw(executors.REFERENCE)


# ---- graph nodes -------------------------------------------------------------------------------------
class Mamba2Verify(torch.autograd.Function):
    """``replayssm::mamba2_verify``: inputs (x, B, C, dt, dt_bias, A, D, state_batch_indices, cursor, state,
    x_cache, B_cache, dt_cache), outputs (y, state_out, x_cache_out, B_cache_out, dt_cache_out). Eager: the
    backend runs on copies of the caches (the graph is functional; TensorRT aliases the last four outputs)."""

    @staticmethod
    def forward(ctx, x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache, sizes, backend):
        state, x_cache, B_cache, dt_cache = (t.clone() for t in (state, x_cache, B_cache, dt_cache))
        y = backend(state=state, x_cache=x_cache, B_cache=B_cache, dt_cache=dt_cache, cursor=cursor, x=x, B=B, C=C,
                    dt=dt, dt_bias=dt_bias, A=A, D=D, z=None, state_batch_indices=sbi)
        return y.to(x.dtype), state, x_cache, B_cache, dt_cache

    @staticmethod
    def symbolic(g, x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache, sizes, backend):
        nheads, headdim, dstate, ngroups, buffer_len, num_tokens = sizes
        outs = g.op(f"{DOMAIN}::{VERIFY_OP_TYPE}", x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache,
                    dt_cache, plugin_namespace_s=DOMAIN, aot_i=1, nheads_i=nheads, headdim_i=headdim,
                    dstate_i=dstate, ngroups_i=ngroups, buffer_len_i=buffer_len, num_tokens_i=num_tokens, outputs=5)
        for o, like in zip(outs, (x, state, x_cache, B_cache, dt_cache)):
            o.setType(like.type())
        return outs


class SpecCommit(torch.autograd.Function):
    """``replayssm::spec_commit``: inputs (state_batch_indices, n_accepted, cursor), output cursor_out."""

    @staticmethod
    def forward(ctx, sbi, n_accepted, cursor, num_tokens, buffer_len, backend):
        cursor = cursor.clone()
        backend(cursor=cursor, n_accepted=n_accepted, state_batch_indices=sbi, num_tokens=num_tokens,
                buffer_len=buffer_len)
        return cursor

    @staticmethod
    def symbolic(g, sbi, n_accepted, cursor, num_tokens, buffer_len, backend):
        out = g.op(f"{DOMAIN}::{COMMIT_OP_TYPE}", sbi, n_accepted, cursor, plugin_namespace_s=DOMAIN, aot_i=1,
                   num_tokens_i=num_tokens, buffer_len_i=buffer_len, outputs=1)
        out.setType(cursor.type())
        return out


class Mamba2VerifyShadow(Mamba2DecodeShadow):
    """``replayssm::mamba2_verify_shadow``: :class:`Mamba2Verify`'s inputs then (shadow, shadow_scale), outputs
    then (shadow_out, shadow_scale_out), as ``mamba2_decode_shadow``: a verify without a fold reads the shadow,
    the fold rewrites it from the checkpoint it stores."""

    @staticmethod
    def symbolic(g, x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache, shadow, shadow_scale,
                 sizes, backend):
        nheads, headdim, dstate, ngroups, buffer_len, num_tokens = sizes
        outs = g.op(f"{DOMAIN}::{VERIFY_SHADOW_OP_TYPE}", x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache,
                    B_cache, dt_cache, shadow, shadow_scale, plugin_namespace_s=DOMAIN, aot_i=1, nheads_i=nheads,
                    headdim_i=headdim, dstate_i=dstate, ngroups_i=ngroups, buffer_len_i=buffer_len,
                    num_tokens_i=num_tokens, outputs=7)
        for o, like in zip(outs, (x, state, x_cache, B_cache, dt_cache, shadow, shadow_scale)):
            o.setType(like.type())
        return outs


# ---- window pieces shared by the verify steps (Nemotron-H here, Qwen3-Next / Qwen3.5 in gdn_step; the
# T-general conv and attention, window_conv and window_attention, live in decode_step) --------------------
def _check_window(num_draft: int, buffer_len: int) -> int:
    T = num_draft + 1
    if num_draft < 1:
        raise ValueError(f"num_draft: expected >= 1, got {num_draft}")
    if not 2 * T <= buffer_len <= 32:
        raise ValueError(f"buffer_len: expected in [2 (num_draft + 1), 32] = [{2 * T}, 32] (flush one window early), "
                         f"got {buffer_len}")
    return T


# ---- verify -------------------------------------------------------------------------------------------
class NemotronHSpecStep(NemotronHDecodeStep):
    """Verify graph of a (loaded, unpatched or patched) ``NemotronHForCausalLM``; shares its weights."""

    speculative = True  # conv_window_i of K - 1 + num_draft columns instead of conv_state_i

    def __init__(self, model, buffer_len: int, max_seq_len: int, num_draft: int,
                 state_dtype: torch.dtype = torch.float32, backend=None, moe_formulation: str = "dense",
                 shadow: str = "none"):
        super().__init__(model, buffer_len, max_seq_len, state_dtype, backend or verify_reference_backend,
                         moe_formulation, shadow)
        self.num_draft = num_draft
        self.num_tokens = _check_window(num_draft, buffer_len)
        self.window = model.config.conv_kernel - 1 + num_draft

    def _ssm_op(self, x, B, C, dt, dt_bias, A, D, sbi, cursor, caches, sizes):
        """One ``mamba2_verify`` (``mamba2_verify_shadow``) node on the window's T tokens: (y (batch, T, H, P), the
        layer's caches in state order)."""
        ins, sizes = (x, B, C, dt, dt_bias, A, D, sbi, cursor), (*sizes, self.num_tokens)
        if self.shadow == "none":
            return Mamba2Verify.apply(*ins, *caches, sizes, self.backend)
        return self._with_shadow(Mamba2VerifyShadow, ins, caches, sizes)


# ---- commit -------------------------------------------------------------------------------------------
class NemotronHSpecCommit(torch.nn.Module):
    """Commit graph: cursor (spec_commit node), lengths += n, conv windows rolled back by T - n."""

    def __init__(self, step: NemotronHSpecStep, backend=None):
        super().__init__()
        self.num_tokens, self.buffer_len, self.window = step.num_tokens, step.buffer_len, step.window
        self.conv_specs = [s for s in step.state_specs() if s.name.startswith("conv_window_")]
        self.backend = backend or commit_reference_backend

    def state_specs(self) -> list[StateSpec]:
        return self.conv_specs

    def input_names(self) -> list[str]:
        return ["n_accepted", "cursor", "lengths"] + [s.name for s in self.conv_specs]

    def output_names(self) -> list[str]:
        return ["cursor_out", "lengths_out"] + [s.output for s in self.conv_specs]

    def forward(self, n_accepted, cursor, lengths, *windows):
        T, W = self.num_tokens, self.window
        sbi = torch.arange(n_accepted.shape[0], dtype=torch.int32, device=n_accepted.device)
        # n clamped to [0, T] as the commit kernel does (Max / Min, not Clip: TensorRT's integer support)
        zero = torch.zeros_like(n_accepted)
        n = torch.minimum(torch.maximum(n_accepted, zero), zero + T)
        cursor_out = SpecCommit.apply(sbi, n, cursor, T, self.buffer_len, self.backend)
        # Drop the T - n rejected inputs: out[:, :, c] = window[:, :, c - (T - n)], zero where c < T - n.
        src = torch.arange(W, device=n.device)[None, :] - (T - n.long())[:, None]  # (batch, W)
        safe = torch.maximum(src, torch.zeros_like(src))
        outs = []
        for w in windows:
            idx = safe[:, None, :].expand(-1, w.shape[1], -1)
            outs.append(torch.where((src >= 0)[:, None, :], torch.gather(w, 2, idx), torch.zeros_like(w)))
        return (cursor_out, lengths + n, *outs)


# ---- export --------------------------------------------------------------------------------------------
def export_onnx(step: NemotronHSpecStep, verify_path, commit_path, batch: int = 2, opset: int = 17) -> None:
    """Trace the verify step and the commit on zero states of ``batch`` rows; ONNX with a dynamic batch."""
    if opset < 17:
        raise ValueError(f"opset: expected >= 17, got {opset}")
    dev = next(step.parameters()).device
    T = step.num_tokens
    cursor = torch.zeros(batch, 2, dtype=torch.int32, device=dev)
    lengths = torch.zeros(batch, dtype=torch.int32, device=dev)
    states = step.empty_states(batch, dev)
    export_graph(step, (torch.ones(batch, T, dtype=torch.int64, device=dev), lengths, cursor, *states), verify_path,
                 opset)
    commit = NemotronHSpecCommit(step)
    windows = [t for s, t in zip(step.state_specs(), states) if s.name.startswith("conv_window_")]
    n = torch.ones(batch, dtype=torch.int32, device=dev)
    export_graph(commit, (n, cursor, lengths, *windows), commit_path, opset)
