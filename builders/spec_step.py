# SPDX-License-Identifier: Apache-2.0
"""The commit graph of speculative decoding (Nemotron-H / Nemotron 3 and Qwen3-Next / Qwen3.5 alike).

One speculative step of T = 1 + num_draft tokens per row (row b is slot b; state_batch_indices =
arange(batch) inside both graphs) is

    logits, states = verify(input_ids, lengths, cursor, states)   # outputs of all T positions
    n = accept(logits, input_ids)                                 # sampling: outside the graphs
    cursor, lengths, conv windows = commit(n, cursor, lengths, conv windows)

The verify graph is the family's step with ``num_draft`` > 0 (builders/decode_step.py's
:class:`~builders.decode_step.NemotronHDecodeStep`, builders/qwen_export.py's
:class:`~builders.qwen_export.QwenGDNDecodeStep`: the standard decode step's layers at T > 1, its I/O in
decode_step's docstring); ``decode_step.export_onnx(step, verify_path, commit_path)`` writes both graphs.

Commit graph (:class:`NemotronHSpecCommit`). Inputs: n_accepted (batch,) int32 (accepted tokens of
the window including the first one, 1..T for live rows; clamped to [0, T]), cursor (batch, 2),
lengths (batch,), conv_window_i per SSM layer. Outputs: cursor_out (ONE ``replayssm::spec_commit``
node: the flush the verify layers did, then count += n), lengths_out = lengths + n, conv_window_i_out
(shifted right by T - n, zero-filled: conv_window.conv_window_rollback; n = 0 drops the oldest
committed conv input, so use it for padding rows only).

Why two graphs: the accepted count depends on sampling the verify logits (greedy, rejection
sampling against a draft model, ...), which belongs to the serving layer, not to the engine; and the
commit is a handful of tiny ops, so a second small engine costs one launch per step. The cursor move
must follow every layer's verify (they all read the same cursor), which a separate graph guarantees.

Math and state layouts: :mod:`trtllm_replayssm.families.mamba2.spec_reference`. Export route: as
:mod:`.decode_step` (TorchScript exporter, :class:`~builders.decode_step.PluginOp`).
"""

from __future__ import annotations

import torch

from trtllm_replayssm import backend as executors

from .decode_step import PluginNode, PluginOp, StateSpec

COMMIT_OP_TYPE = "spec_commit"

# ``replayssm::spec_commit`` in the reference: the verify layers' flush (count + 2T > L), then count += n (in
# place); the reference executor of trtllm_replayssm.backend in the launchers' keyword form.
commit_reference_backend = executors.spec_commit_kw(executors.REFERENCE)


def commit_node(sbi, n_accepted, cursor, num_tokens: int, buffer_len: int, backend):
    """``replayssm::spec_commit``: inputs (state_batch_indices, n_accepted, cursor), output cursor_out (the
    backend runs on a copy of the cursor)."""

    def run(sbi, n_accepted, cursor):
        cursor = cursor.clone()
        backend(cursor=cursor, n_accepted=n_accepted, state_batch_indices=sbi, num_tokens=num_tokens,
                buffer_len=buffer_len)
        return cursor

    node = PluginNode(COMMIT_OP_TYPE, (("num_tokens", num_tokens), ("buffer_len", buffer_len)), (2,), run)
    return PluginOp.apply(node, sbi, n_accepted, cursor)


class NemotronHSpecCommit(torch.nn.Module):
    """Commit graph of any speculative step (either family): cursor (spec_commit node), lengths += n, conv
    windows rolled back by T - n."""

    def __init__(self, step, backend=None):
        super().__init__()
        if not step.speculative:
            raise ValueError("step: a commit graph follows a speculative verify step (num_draft > 0), got a standard "
                             "decode step")
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
        cursor_out = commit_node(sbi, n, cursor, T, self.buffer_len, self.backend)
        # Drop the T - n rejected inputs: out[:, :, c] = window[:, :, c - (T - n)], zero where c < T - n.
        src = torch.arange(W, device=n.device)[None, :] - (T - n.long())[:, None]  # (batch, W)
        safe = torch.maximum(src, torch.zeros_like(src))
        outs = []
        for w in windows:
            idx = safe[:, None, :].expand(-1, w.shape[1], -1)
            outs.append(torch.where((src >= 0)[:, None, :], torch.gather(w, 2, idx), torch.zeros_like(w)))
        return (cursor_out, lengths + n, *outs)
