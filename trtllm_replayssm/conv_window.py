# SPDX-License-Identifier: Apache-2.0
"""The conv1d window of a speculative step, shared by every family's cache (float64 spec in plain torch).

A causal depthwise conv of width K over conv_dim channels (the mixer's channels before the recurrence,
e.g. Mamba-2's x|B|C):
    conv_window (S, conv_dim, W), W = K - 1 + num_draft, time-ordered, column W-1 = newest input.
    Invariant between steps: the last K-1 columns are the last K-1 committed inputs (with
    num_draft = 0 this is the usual (S, conv_dim, K-1) conv state of vLLM / mamba_ssm).
    :func:`conv_window_update` computes the T outputs from the last K-1 committed inputs and the T new
    ones and shifts all T inputs in (window = last W inputs); :func:`conv_window_rollback` after
    accepting n of T shifts the window right by T - n so the newest committed input is again in column
    W-1 (vacated columns are zeroed; they are older than the last K-1 inputs and never read).
    Needs W - T + n >= K - 1, i.e. n >= 1 when T = num_draft + 1.
Padding rows (slot -1) are not touched; their outputs are NaN.
"""

from __future__ import annotations

import torch

from .cursor import check_n_accepted, check_shape, rows

F64 = torch.float64


def conv_window_update(conv_window, u, weight, bias=None, state_batch_indices=None, activation: str | None = "silu"):
    """Causal depthwise conv of T new inputs; shifts them into the window. Returns (batch, T, conv_dim) float64.

    conv_window (S, conv_dim, W) mutated; u (batch, T, conv_dim); weight (conv_dim, K); bias (conv_dim,).
    out_t = act(bias + sum_{i<K} weight[:, i] * seq[:, t + i]), seq = [last K-1 committed inputs, u_0..u_{T-1}].
    Needs T <= W - K + 2 so that any n >= 1 can be rolled back.
    """
    batch, T, Dc = u.shape
    nslots, _, W = conv_window.shape
    K = weight.shape[1]
    check_shape(conv_window, "conv_window", (nslots, Dc, W))
    check_shape(weight, "weight", (Dc, K))
    if bias is not None:
        check_shape(bias, "bias", (Dc,))
    if W < K - 1:
        raise ValueError(f"conv_window: expected width >= K-1 = {K - 1}, got {W}")
    if T > W - K + 2:
        raise ValueError(f"u: expected at most W - K + 2 = {W - K + 2} tokens (num_draft + 1), got T={T}")
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
    w64 = weight.to(F64)
    out = torch.full((batch, T, Dc), float("nan"), dtype=F64, device=u.device)
    for b, s in enumerate(rows(state_batch_indices, batch, nslots)):
        if s < 0:
            continue
        new = u[b].transpose(0, 1)  # (conv_dim, T)
        seq = torch.cat([conv_window[s][:, W - (K - 1):].to(F64), new.to(F64)], dim=1)  # (conv_dim, K-1+T)
        for t in range(T):
            o = (w64 * seq[:, t:t + K]).sum(dim=1)
            if bias is not None:
                o = o + bias.to(F64)
            out[b, t] = o * torch.sigmoid(o) if activation == "silu" else o
        conv_window[s] = torch.cat([conv_window[s], new.to(conv_window.dtype)], dim=1)[:, -W:]
    return out


def conv_window_rollback(conv_window, n_accepted, num_tokens: int, conv_kernel: int, state_batch_indices):
    """Drop the T - n rejected inputs: shift the window right by T - n, zero-fill the front (in place)."""
    batch = state_batch_indices.shape[0]
    nacc = check_n_accepted(n_accepted, batch)
    W = conv_window.shape[2]
    for b, s in enumerate(rows(state_batch_indices, batch, conv_window.shape[0])):
        if s < 0:
            continue
        n = nacc[b]
        if not 0 <= n <= num_tokens:
            raise ValueError(f"n_accepted[{b}]: expected 0 <= n <= T={num_tokens}, got {n}")
        if W - num_tokens + n < conv_kernel - 1:
            raise ValueError(f"n_accepted[{b}]: window width {W} keeps K-1={conv_kernel - 1} inputs only for "
                             f"n >= {conv_kernel - 1 - W + num_tokens}, got {n}")
        r = num_tokens - n
        if r:
            conv_window[s] = torch.cat([torch.zeros_like(conv_window[s][:, :r]), conv_window[s][:, :W - r]], dim=1)
    return conv_window
