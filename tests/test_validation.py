# SPDX-License-Identifier: Apache-2.0
"""Launcher validation: bad input is rejected before any launch, naming the tensor.

Shape and dtype checks run before the device check, so they are exercised here on CPU tensors.
"""

import pytest
import torch

from trtllm_replayssm import ops

H, P, N, G, L, S, BATCH = 4, 64, 64, 2, 4, 5, 3


def good(**over):
    t = dict(
        x=torch.zeros(BATCH, H, P, dtype=torch.bfloat16),
        B=torch.zeros(BATCH, G, N, dtype=torch.bfloat16),
        C=torch.zeros(BATCH, G, N, dtype=torch.bfloat16),
        dt=torch.zeros(BATCH, H, dtype=torch.bfloat16),
        dt_bias=torch.zeros(H), A=-torch.ones(H), D=torch.ones(H),
        state=torch.zeros(S, H, P, N),
        x_cache=torch.zeros(S, H, L, P, dtype=torch.bfloat16),
        B_cache=torch.zeros(S, G, L, N, dtype=torch.bfloat16),
        dt_cache=torch.zeros(S, H, L),
        cursor=torch.zeros(S, dtype=torch.int32),
        state_batch_indices=torch.arange(BATCH, dtype=torch.int32),
    )
    t.update(over)
    return t


CASES = [
    (dict(x=torch.zeros(BATCH, H, P, dtype=torch.float64)), TypeError,
     r"x: expected dtype bfloat16 or float16 or float32, got float64"),
    (dict(B=torch.zeros(BATCH, G, N, dtype=torch.float16)), TypeError, r"B: expected dtype bfloat16, got float16"),
    (dict(C=torch.zeros(BATCH, G, N + 1, dtype=torch.bfloat16)), ValueError, r"C: expected shape \(3, 2, 64\), got \(3, 2, 65\)"),
    (dict(dt=torch.zeros(BATCH, H, 1, dtype=torch.bfloat16)), ValueError, r"dt: expected shape"),
    (dict(A=-torch.ones(H, dtype=torch.float64)), TypeError, r"A: expected dtype float32"),
    (dict(D=torch.ones(H + 1)), ValueError, r"D: expected shape \(4,\)"),
    (dict(state=torch.zeros(S, H, P, N, dtype=torch.int8)), TypeError, r"state: expected dtype"),
    (dict(state=torch.zeros(S, H, N, P).transpose(2, 3)), ValueError, r"state: expected a contiguous tensor"),
    (dict(x_cache=torch.zeros(S, H, L, P + 8, dtype=torch.bfloat16)), ValueError, r"x_cache: expected shape"),
    (dict(x_cache=torch.zeros(S, H, 40, P, dtype=torch.bfloat16)), ValueError, r"x_cache: buffer_len \(dim 2\) must be in 1..32"),
    (dict(B_cache=torch.zeros(S, G, L + 1, N, dtype=torch.bfloat16)), ValueError, r"B_cache: expected shape \(5, 2, 4, 64\)"),
    (dict(dt_cache=torch.zeros(S, H, L, dtype=torch.bfloat16)), TypeError, r"dt_cache: expected dtype float32"),
    (dict(cursor=torch.zeros(S, dtype=torch.int64)), TypeError, r"cursor: expected dtype int32"),
    (dict(state_batch_indices=torch.arange(BATCH)), TypeError, r"state_batch_indices: expected dtype int32"),
    (dict(state_batch_indices=torch.arange(BATCH + 1, dtype=torch.int32)), ValueError, r"state_batch_indices: expected shape"),
    (dict(B=torch.zeros(BATCH, 3, N, dtype=torch.bfloat16)), ValueError, r"ngroups=3 must divide nheads=4"),
    (dict(x=torch.zeros(BATCH, H * P, dtype=torch.bfloat16)), ValueError, r"x: expected a \(batch, nheads, headdim\) tensor"),
    ({}, ValueError, r"x: expected CUDA tensors, got device cpu"),
]


@pytest.mark.parametrize("over, exc, match", CASES, ids=[c[2][:40] for c in CASES])
def test_replay_decode_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        ops.replay_decode(**good(**over))


def test_out_is_checked():
    with pytest.raises(TypeError, match="out: expected dtype bfloat16"):
        ops.replay_decode(**good(), out=torch.zeros(BATCH, H, P))


SH = (S, H, P, N)
SHADOW_CASES = [
    (dict(shadow=torch.zeros(S, H, P, N, dtype=torch.float16)), TypeError, r"shadow: expected dtype bfloat16 or float8_e4m3fn"),
    (dict(shadow=torch.zeros(S, H, P, N + 1, dtype=torch.bfloat16)), ValueError, r"shadow: expected shape \(5, 4, 64, 64\)"),
    (dict(shadow=torch.zeros(SH, dtype=torch.bfloat16), state=torch.zeros(SH, dtype=torch.bfloat16)), TypeError,
     r"state: a shadow needs a float32 checkpoint, got bfloat16"),
    (dict(shadow=torch.zeros(SH, dtype=torch.float8_e4m3fn)), ValueError, r"shadow_scale: an fp8 shadow needs"),
    (dict(shadow=torch.zeros(SH, dtype=torch.float8_e4m3fn), shadow_scale=torch.ones(S, H, P + 1)), ValueError,
     r"shadow_scale: expected shape \(5, 4, 64\)"),
    (dict(shadow=torch.zeros(SH, dtype=torch.bfloat16), shadow_scale=torch.ones(S, H, P)), ValueError,
     r"shadow_scale: only an fp8 shadow has row scales"),
    (dict(shadow_scale=torch.ones(S, H, P)), ValueError, r"shadow_scale: given without a shadow"),
    (dict(shadow=torch.zeros(SH, dtype=torch.float8_e4m3fn), shadow_scale=torch.ones(S, H, P)), ValueError,
     r"x: expected CUDA tensors"),  # a valid fp8 shadow passes every check before the device one
]


@pytest.mark.parametrize("over, exc, match", SHADOW_CASES, ids=[c[2][:40] for c in SHADOW_CASES])
def test_replay_decode_rejects_bad_shadow(over, exc, match):
    with pytest.raises(exc, match=match):
        ops.replay_decode(**good(**over))


def test_conventional_step_rejects():
    t = good()
    for k in ("x_cache", "B_cache", "dt_cache", "cursor"):
        t.pop(k)
    with pytest.raises(ValueError, match=r"state: expected shape"):
        ops.conventional_step(**{**t, "state": torch.zeros(S, H + 1, P, N)})
    with pytest.raises(ValueError, match="expected CUDA tensors"):
        ops.conventional_step(**t)


def test_index_checks():
    sbi = torch.tensor([0, 5, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"state_batch_indices: expected values in \[-1, 5\), got \[5\]"):
        ops.check_indices(sbi, S, None, L)
    with pytest.raises(ValueError, match="more than one row"):
        ops.check_indices(torch.tensor([1, 1], dtype=torch.int32), S, None, L)
    cursor = torch.tensor([0, 4, 0, 0, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cursor: expected values in \[0, 4\)"):
        ops.check_indices(torch.tensor([1, -1], dtype=torch.int32), S, cursor, L)
    ops.check_indices(torch.tensor([2, -1, 0], dtype=torch.int32), S, cursor, L)  # slot 1 unused: fine
