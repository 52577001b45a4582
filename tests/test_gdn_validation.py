# SPDX-License-Identifier: Apache-2.0
"""GDN launcher validation (trtllm_replayssm/gdn_ops.py): bad input is rejected before any launch, naming
the tensor with got / expected.

Shape, dtype, alignment, option and value checks run before the device check, so they are exercised here
on CPU tensors; a fully valid call on CPU tensors reaches the last check ("q: expected CUDA tensors"),
which shows that every earlier check passed.
"""

import pytest
import torch

from trtllm_replayssm import gdn_ops

HV, H, V, K, L, S, BATCH = 4, 2, 64, 128, 4, 5, 3
BF, I32 = torch.bfloat16, torch.int32


def step(**over):
    t = dict(
        q=torch.zeros(BATCH, H, K, dtype=BF), k=torch.zeros(BATCH, H, K, dtype=BF), v=torch.zeros(BATCH, HV, V, dtype=BF),
        a=torch.zeros(BATCH, HV, dtype=BF), b=torch.zeros(BATCH, HV, dtype=BF), A_log=torch.zeros(HV),
        dt_bias=torch.zeros(HV), state=torch.zeros(S, HV, V, K),
        state_batch_indices=torch.arange(BATCH, dtype=I32),
    )
    t.update(over)
    return t


def replay(**over):
    t = step()
    t.update(u_cache=torch.zeros(S, HV, L, V), v_cache=torch.zeros(S, HV, L, V, dtype=BF), k_cache=torch.zeros(S, H, L, K),
             g_cache=torch.zeros(S, HV, L), beta_cache=torch.zeros(S, HV, L), cursor=torch.zeros(S, dtype=I32))
    t.update(over)
    return t


def misaligned(shape, dtype=torch.float32):
    """A contiguous view whose data pointer is one element past a 16-byte boundary."""
    n = 1
    for d in shape:
        n *= d
    return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


STEP_CASES = [
    (dict(q=torch.zeros(BATCH, H, K, dtype=torch.float64)), TypeError,
     r"q: expected dtype bfloat16 or float16 or float32, got float64"),
    (dict(k=torch.zeros(BATCH, H, K, dtype=torch.float16)), TypeError, r"k: expected dtype bfloat16, got float16"),
    (dict(k=torch.zeros(BATCH, H, K + 4, dtype=BF)), ValueError, r"k: expected shape \(3, 2, 128\), got \(3, 2, 132\)"),
    (dict(v=torch.zeros(BATCH, HV, V, dtype=torch.float32)), TypeError, r"v: expected dtype bfloat16, got float32"),
    (dict(a=torch.zeros(BATCH, HV + 1, dtype=BF)), ValueError, r"a: expected shape \(3, 4\), got \(3, 5\)"),
    (dict(b=torch.zeros(BATCH, HV, 1, dtype=BF)), ValueError, r"b: expected shape \(3, 4\)"),
    (dict(A_log=torch.zeros(HV, dtype=BF)), TypeError, r"A_log: expected dtype float32, got bfloat16"),
    (dict(dt_bias=torch.zeros(HV + 1)), ValueError, r"dt_bias: expected shape \(4,\), got \(5,\)"),
    (dict(state=torch.zeros(S, HV, V, K, dtype=BF)), TypeError, r"state: expected dtype float32, got bfloat16"),
    (dict(state=torch.zeros(S, HV, K, V).transpose(2, 3)), ValueError, r"state: expected a contiguous tensor"),
    (dict(state=torch.zeros(S, HV + 1, V, K)), ValueError, r"state: expected shape \(5, 4, 64, 128\), got \(5, 5, 64, 128\)"),
    (dict(state=misaligned((S, HV, V, K))), ValueError, r"state: expected a 16-byte aligned data pointer"),
    (dict(q=misaligned((BATCH, H, K), BF)), ValueError, r"q: expected a 16-byte aligned data pointer"),
    (dict(state_batch_indices=torch.arange(BATCH)), TypeError, r"state_batch_indices: expected dtype int32, got int64"),
    (dict(state_batch_indices=torch.arange(BATCH + 1, dtype=I32)), ValueError, r"state_batch_indices: expected shape \(3,\)"),
    (dict(q=torch.zeros(BATCH, 3, K, dtype=BF), k=torch.zeros(BATCH, 3, K, dtype=BF)), ValueError,
     r"q: key heads H=3 \(dim 1\) must divide value heads HV=4"),
    (dict(q=torch.zeros(BATCH, H, 96, dtype=BF), k=torch.zeros(BATCH, H, 96, dtype=BF), state=torch.zeros(S, HV, V, 96)),
     ValueError, r"q: K \(dim 2\) expected one of \(64, 128, 256\), got 96"),
    (dict(v=torch.zeros(BATCH, HV, 80, dtype=BF), state=torch.zeros(S, HV, 80, K)), ValueError,
     r"v: V \(dim 2\) expected one of \(64, 128, 256\), got 80"),
    (dict(q=torch.zeros(BATCH, H * K, dtype=BF)), ValueError, r"q: expected a \(batch, H, K\) tensor, got shape \(3, 256\)"),
    (dict(state=torch.zeros(S, HV, V * K)), ValueError, r"state: expected a \(slots, HV, V, K\) tensor"),
    (dict(out=torch.zeros(BATCH, HV, V)), TypeError, r"out: expected dtype bfloat16, got float32"),
    (dict(out=torch.zeros(BATCH, HV, V + 1, dtype=BF)), ValueError, r"out: expected shape \(3, 4, 64\)"),
    (dict(use_qk_l2norm=1), TypeError, r"use_qk_l2norm: expected a bool, got int"),
    (dict(scale="0.1"), TypeError, r"scale: expected a float or None"),
    (dict(scale=-0.1), ValueError, r"scale: expected a finite positive float, got -0.1"),
    (dict(scale=float("nan")), ValueError, r"scale: expected a finite positive float, got nan"),
    (dict(state_batch_indices=torch.tensor([0, 5, -1], dtype=I32)), ValueError,
     r"state_batch_indices: expected values in \[-1, 5\), got \[5\]"),
    (dict(state_batch_indices=torch.tensor([-2, 0, 1], dtype=I32)), ValueError,
     r"state_batch_indices: expected values in \[-1, 5\), got \[-2\]"),
    (dict(state_batch_indices=torch.tensor([1, -1, 1], dtype=I32)), ValueError,
     r"state_batch_indices: expected each slot in at most one row \(rows would race\), got slots \[1\]"),
    ({}, ValueError, r"q: expected CUDA tensors, got device cpu"),  # every host check passed
    (dict(state_batch_indices=torch.tensor([-1, -1, -1], dtype=I32), scale=0.5, use_qk_l2norm=False), ValueError,
     r"q: expected CUDA tensors"),
]


@pytest.mark.parametrize("over, exc, match", STEP_CASES, ids=[c[2][:48] for c in STEP_CASES])
def test_conventional_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_conventional_step(**step(**over))


@pytest.mark.parametrize("over, exc, match", STEP_CASES, ids=[c[2][:48] for c in STEP_CASES])
def test_replay_rejects_step_inputs(over, exc, match):
    kw = replay(**over)
    q, v = kw["q"], kw["v"]
    if q.dim() == 3 and q.shape[1:] != (H, K):  # a geometry change, not a mismatch: the buffers follow it
        kw["k_cache"] = torch.zeros(S, q.shape[1], L, q.shape[2])
    if v.dim() == 3 and v.shape[1:] == (HV, 80):
        kw["u_cache"], kw["v_cache"] = torch.zeros(S, HV, L, 80), torch.zeros(S, HV, L, 80, dtype=BF)
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_replay_decode(**kw)


REPLAY_CASES = [
    (dict(u_cache=torch.zeros(S, HV, L, V, dtype=BF)), TypeError, r"u_cache: expected dtype float32, got bfloat16"),
    (dict(u_cache=torch.zeros(S, HV, 40, V)), ValueError, r"u_cache: buffer length L \(dim 2\) must be in 1..32, got 40"),
    (dict(u_cache=torch.zeros(S, HV, L, V + 1)), ValueError, r"u_cache: expected shape \(5, 4, 4, 64\), got \(5, 4, 4, 65\)"),
    (dict(u_cache=torch.zeros(S, HV * L, V)), ValueError, r"u_cache: expected a \(slots, HV, L, V\) tensor"),
    (dict(v_cache=torch.zeros(S, HV, L, V)), TypeError, r"v_cache: expected dtype bfloat16, got float32"),
    (dict(v_cache=torch.zeros(S, HV, L + 1, V, dtype=BF)), ValueError, r"v_cache: expected shape \(5, 4, 4, 64\)"),
    (dict(k_cache=torch.zeros(S, HV, L, K)), ValueError, r"k_cache: expected shape \(5, 2, 4, 128\), got \(5, 4, 4, 128\)"),
    (dict(k_cache=torch.zeros(S, H, L, K, dtype=BF)), TypeError, r"k_cache: expected dtype float32, got bfloat16"),
    (dict(k_cache=misaligned((S, H, L, K))), ValueError, r"k_cache: expected a 16-byte aligned data pointer"),
    (dict(g_cache=torch.zeros(S, HV, L + 1)), ValueError, r"g_cache: expected shape \(5, 4, 4\)"),
    (dict(beta_cache=torch.zeros(S, HV, L, dtype=torch.float64)), TypeError, r"beta_cache: expected dtype float32"),
    (dict(cursor=torch.zeros(S, dtype=torch.int64)), TypeError, r"cursor: expected dtype int32, got int64"),
    (dict(cursor=torch.zeros(S + 1, dtype=I32)), ValueError, r"cursor: expected shape \(5,\), got \(6,\)"),
    (dict(cursor=torch.tensor([0, 4, 0, 0, 0], dtype=I32)), ValueError,
     r"cursor: expected values in \[0, 4\) for the rows' slots, got \[4\] \(slots \[1\]\)"),
    (dict(cursor=torch.tensor([0, 0, -1, 0, 0], dtype=I32)), ValueError,
     r"cursor: expected values in \[0, 4\) for the rows' slots, got \[-1\] \(slots \[2\]\)"),
    (dict(cursor=torch.tensor([0, 0, 0, 9, 9], dtype=I32)), ValueError, r"q: expected CUDA tensors"),  # unused slots: fine
    (dict(shadow=torch.zeros(S, HV, V, K, dtype=torch.float16)), TypeError, r"shadow: expected dtype bfloat16, got float16"),
    (dict(shadow=torch.zeros(S, HV, V, K + 4, dtype=BF)), ValueError, r"shadow: expected shape \(5, 4, 64, 128\)"),
    (dict(shadow=misaligned((S, HV, V, K), BF)), ValueError, r"shadow: expected a 16-byte aligned data pointer"),
    (dict(shadow=torch.zeros(S, HV, V, K, dtype=BF)), ValueError, r"q: expected CUDA tensors"),
    (dict(state=torch.zeros(S + 1, HV, V, K)), ValueError, r"state: expected shape \(5, 4, 64, 128\), got \(6, 4, 64, 128\)"),
]


@pytest.mark.parametrize("over, exc, match", REPLAY_CASES, ids=[c[2][:48] for c in REPLAY_CASES])
def test_replay_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_replay_decode(**replay(**over))


def test_unchecked_values_skip_the_host_copy():
    """check_values=False skips slot / cursor checks (CUDA graph capture): the call reaches the device check."""
    kw = replay(cursor=torch.full((S,), 7, dtype=I32), state_batch_indices=torch.tensor([1, 1, 9], dtype=I32))
    with pytest.raises(ValueError, match="q: expected CUDA tensors"):
        gdn_ops.gdn_replay_decode(**kw, check_values=False)


def test_advance_cursor_takes_L_from_u_cache():
    with pytest.raises(ValueError, match=r"cursor: expected values in \[0, 4\)"):
        gdn_ops.advance_cursor(torch.tensor([0, 4, 0, 0, 0], dtype=I32), torch.tensor([1], dtype=I32), torch.zeros(S, HV, L, V))
    with pytest.raises(ValueError, match=r"u_cache: expected a \(slots, HV, L, V\) tensor"):
        gdn_ops.advance_cursor(torch.zeros(S, dtype=I32), torch.tensor([1], dtype=I32), torch.zeros(S, L))
