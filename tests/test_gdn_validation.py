# SPDX-License-Identifier: Apache-2.0
"""GDN launcher validation (trtllm_replayssm/families/gdn/ops.py): bad input is rejected before any launch, naming
the tensor with got / expected.

Shape, dtype, alignment, option and value checks run before the device check, so they are exercised here
on CPU tensors; a fully valid call on CPU tensors reaches the last check ("q: expected CUDA tensors"),
which shows that every earlier check passed.
"""

import pytest
import torch

from trtllm_replayssm.families.gdn import ops as gdn_ops

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


# ---- speculative launchers (gdn_replay_verify, gdn_native_spec_verify / _commit, gdn_spec_commit) -----------
T, LS = 2, 4  # window and ring length of the speculative cases (L >= 2T)


def spec_step(**over):
    t = dict(
        q=torch.zeros(BATCH, T, H, K, dtype=BF), k=torch.zeros(BATCH, T, H, K, dtype=BF),
        v=torch.zeros(BATCH, T, HV, V, dtype=BF), a=torch.zeros(BATCH, T, HV, dtype=BF),
        b=torch.zeros(BATCH, T, HV, dtype=BF), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV),
        state=torch.zeros(S, HV, V, K), state_batch_indices=torch.arange(BATCH, dtype=I32),
    )
    t.update(over)
    return t


def verify_args(**over):
    t = spec_step()
    t.update(u_cache=torch.zeros(S, HV, LS, V), v_cache=torch.zeros(S, HV, LS, V, dtype=BF),
             k_cache=torch.zeros(S, H, LS, K), g_cache=torch.zeros(S, HV, LS), beta_cache=torch.zeros(S, HV, LS),
             cursor=torch.zeros(S, 2, dtype=I32))
    t.update(over)
    return t


def native_args(**over):
    t = spec_step(snapshots=torch.zeros(S, T, HV, V, K))
    t.update(over)
    return t


SPEC_STEP_CASES = [
    (dict(q=torch.zeros(BATCH, T, H, K, dtype=torch.float64)), TypeError, r"q: expected dtype bfloat16 or float16 or float32"),
    (dict(k=torch.zeros(BATCH, T, H, K, dtype=torch.float16)), TypeError, r"k: expected dtype bfloat16, got float16"),
    (dict(k=torch.zeros(BATCH, T + 1, H, K, dtype=BF)), ValueError, r"k: expected shape \(3, 2, 2, 128\), got \(3, 3, 2, 128\)"),
    (dict(v=torch.zeros(BATCH, T, HV, V + 1, dtype=BF)), ValueError, r"v: expected shape \(3, 2, 4, 64\)"),
    (dict(a=torch.zeros(BATCH, T, HV + 1, dtype=BF)), ValueError, r"a: expected shape \(3, 2, 4\), got \(3, 2, 5\)"),
    (dict(b=torch.zeros(BATCH, HV, dtype=BF)), ValueError, r"b: expected shape \(3, 2, 4\)"),
    (dict(A_log=torch.zeros(HV, dtype=BF)), TypeError, r"A_log: expected dtype float32, got bfloat16"),
    (dict(state=torch.zeros(S, HV, V, K, dtype=BF)), TypeError, r"state: expected dtype float32, got bfloat16"),
    (dict(state=misaligned((S, HV, V, K))), ValueError, r"state: expected a 16-byte aligned data pointer"),
    (dict(q=torch.zeros(BATCH, H, K, dtype=BF)), ValueError, r"q: expected a \(batch, T, H, K\) tensor, got shape \(3, 2, 128\)"),
    (dict(v=torch.zeros(BATCH, HV, V, dtype=BF)), ValueError, r"v: expected a \(batch, T, HV, V\) tensor"),
    (dict(q=torch.zeros(BATCH, 3, H, K, dtype=BF), k=torch.zeros(BATCH, 3, H, K, dtype=BF)), ValueError,
     r"q: expected T = 1 \+ num_draft \(dim 1\) in \(1, 2, 4, 6, 8\), got 3"),
    (dict(q=torch.zeros(BATCH, T, 3, K, dtype=BF), k=torch.zeros(BATCH, T, 3, K, dtype=BF)), ValueError,
     r"q: key heads H=3 \(dim 2\) must divide value heads HV=4"),
    (dict(v=torch.zeros(BATCH, T, HV, 80, dtype=BF), state=torch.zeros(S, HV, 80, K)), ValueError,
     r"v: V \(dim 3\) expected one of \(64, 128, 256\), got 80"),
    (dict(out=torch.zeros(BATCH, T, HV, V)), TypeError, r"out: expected dtype bfloat16, got float32"),
    (dict(out=torch.zeros(BATCH, HV, V, dtype=BF)), ValueError, r"out: expected shape \(3, 2, 4, 64\)"),
    (dict(scale=0.0), ValueError, r"scale: expected a finite positive float, got 0.0"),
    (dict(use_qk_l2norm=None), TypeError, r"use_qk_l2norm: expected a bool"),
    (dict(state_batch_indices=torch.tensor([0, 5, -1], dtype=I32)), ValueError,
     r"state_batch_indices: expected values in \[-1, 5\), got \[5\]"),
    (dict(state_batch_indices=torch.tensor([2, -1, 2], dtype=I32)), ValueError,
     r"state_batch_indices: expected each slot in at most one row"),
    ({}, ValueError, r"q: expected CUDA tensors, got device cpu"),  # every host check passed
]


def _follow_geometry(kw):
    """A geometry change, not a mismatch: the rings follow it."""
    q, v = kw["q"], kw["v"]
    if q.dim() == 4 and q.shape[2] != H and "k_cache" in kw:
        kw["k_cache"] = torch.zeros(S, q.shape[2], LS, K)
    if v.dim() == 4 and v.shape[3] == 80:
        if "u_cache" in kw:
            kw["u_cache"], kw["v_cache"] = torch.zeros(S, HV, LS, 80), torch.zeros(S, HV, LS, 80, dtype=BF)
        if "snapshots" in kw:
            kw["snapshots"] = torch.zeros(S, T, HV, 80, K)
    if q.dim() == 4 and q.shape[1] == 3 and "snapshots" in kw:
        kw["snapshots"] = torch.zeros(S, 3, HV, V, K)
    return kw


@pytest.mark.parametrize("over, exc, match", SPEC_STEP_CASES, ids=[c[2][:48] for c in SPEC_STEP_CASES])
def test_verify_rejects_step_inputs(over, exc, match):
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_replay_verify(**_follow_geometry(verify_args(**over)))


@pytest.mark.parametrize("over, exc, match", SPEC_STEP_CASES, ids=[c[2][:48] for c in SPEC_STEP_CASES])
def test_native_verify_rejects_step_inputs(over, exc, match):
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_native_spec_verify(**_follow_geometry(native_args(**over)))


VERIFY_CASES = [
    (dict(u_cache=torch.zeros(S, HV, 3, V)), ValueError,
     r"u_cache: buffer length L \(dim 2\): expected in \[2T, 32\] = \[4, 32\] \(flush one window early, T=2\), got 3"),
    (dict(u_cache=torch.zeros(S, HV, 33, V)), ValueError, r"u_cache: buffer length L \(dim 2\): expected in \[2T, 32\]"),
    (dict(u_cache=torch.zeros(S, HV, LS, V, dtype=BF)), TypeError, r"u_cache: expected dtype float32, got bfloat16"),
    (dict(v_cache=torch.zeros(S, HV, LS + 1, V, dtype=BF)), ValueError, r"v_cache: expected shape \(5, 4, 4, 64\)"),
    (dict(k_cache=torch.zeros(S, HV, LS, K)), ValueError, r"k_cache: expected shape \(5, 2, 4, 128\), got \(5, 4, 4, 128\)"),
    (dict(k_cache=misaligned((S, H, LS, K))), ValueError, r"k_cache: expected a 16-byte aligned data pointer"),
    (dict(g_cache=torch.zeros(S, HV, LS + 1)), ValueError, r"g_cache: expected shape \(5, 4, 4\)"),
    (dict(beta_cache=torch.zeros(S, HV, LS, dtype=torch.float64)), TypeError, r"beta_cache: expected dtype float32"),
    (dict(cursor=torch.zeros(S, dtype=I32)), ValueError, r"cursor: expected shape \(5, 2\), got \(5,\)"),
    (dict(cursor=torch.zeros(S, 2, dtype=torch.int64)), TypeError, r"cursor: expected dtype int32, got int64"),
    (dict(cursor=torch.tensor([[0, 0], [4, 0], [0, 0], [0, 0], [0, 0]], dtype=I32)), ValueError,
     r"cursor: expected start \(column 0\) in \[0, 4\) for the rows' slots, got \[4\] \(slots \[1\]\)"),
    (dict(cursor=torch.tensor([[0, 0], [0, 0], [1, 3], [0, 0], [0, 0]], dtype=I32)), ValueError,
     r"cursor: expected count \(column 1\) in \[0, L - T\] = \[0, 2\] for the rows' slots, got \[3\] \(slots \[2\]\)"),
    (dict(cursor=torch.tensor([[0, 0], [0, 0], [0, 2], [9, 9], [9, 9]], dtype=I32)), ValueError,
     r"q: expected CUDA tensors"),  # unused slots: fine
    (dict(shadow=torch.zeros(S, HV, V, K, dtype=torch.float16)), TypeError, r"shadow: expected dtype bfloat16, got float16"),
    (dict(shadow=misaligned((S, HV, V, K), BF)), ValueError, r"shadow: expected a 16-byte aligned data pointer"),
    (dict(shadow=torch.zeros(S, HV, V, K, dtype=BF)), ValueError, r"q: expected CUDA tensors"),
]


@pytest.mark.parametrize("over, exc, match", VERIFY_CASES, ids=[c[2][:48] for c in VERIFY_CASES])
def test_verify_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_replay_verify(**verify_args(**over))


def test_verify_unchecked_values_skip_the_host_copy():
    kw = verify_args(cursor=torch.full((S, 2), 7, dtype=I32), state_batch_indices=torch.tensor([1, 1, 9], dtype=I32))
    with pytest.raises(ValueError, match="q: expected CUDA tensors"):
        gdn_ops.gdn_replay_verify(**kw, check_values=False)


@pytest.mark.parametrize("over, exc, match", [
    (dict(snapshots=torch.zeros(S, T + 1, HV, V, K)), ValueError, r"snapshots: expected shape \(5, 2, 4, 64, 128\)"),
    (dict(snapshots=torch.zeros(S, T, HV, V, K, dtype=BF)), TypeError, r"snapshots: expected dtype float32"),
    (dict(snapshots=torch.zeros(S, HV, V, K)), ValueError, r"snapshots: expected a \(slots, T, HV, V, K\) tensor"),
    (dict(snapshots=misaligned((S, T, HV, V, K))), ValueError, r"snapshots: expected a 16-byte aligned data pointer"),
])
def test_native_verify_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_native_spec_verify(**native_args(**over))


def commit_args(**over):
    t = dict(state=torch.zeros(S, HV, V, K), snapshots=torch.zeros(S, T, HV, V, K), n_accepted=torch.ones(BATCH, dtype=I32),
             state_batch_indices=torch.arange(BATCH, dtype=I32))
    t.update(over)
    return t


@pytest.mark.parametrize("over, exc, match", [
    (dict(snapshots=torch.zeros(S, 3, HV, V, K)), ValueError, r"snapshots: expected T \(dim 1\) in \(1, 2, 4, 6, 8\), got 3"),
    (dict(snapshots=torch.zeros(S, T, HV, V + 1, K)), ValueError, r"snapshots: expected shape \(5, 2, 4, 64, 128\)"),
    (dict(state=torch.zeros(S, HV, V, K, dtype=BF)), TypeError, r"state: expected dtype float32"),
    (dict(state=torch.zeros(S, HV, V * K)), ValueError, r"state: expected a \(slots, HV, V, K\) tensor"),
    (dict(state=torch.zeros(S, HV, 80, K), snapshots=torch.zeros(S, T, HV, 80, K)), ValueError,
     r"state: V \(dim 2\) expected one of \(64, 128, 256\), got 80"),
    (dict(n_accepted=torch.ones(BATCH)), TypeError, r"n_accepted: expected dtype int32"),
    (dict(n_accepted=torch.tensor([1, 3, 0], dtype=I32)), ValueError, r"n_accepted: expected values in \[0, T\] = \[0, 2\]"),
    (dict(state_batch_indices=torch.tensor([0, 0, 1], dtype=I32)), ValueError, r"state_batch_indices: expected each slot"),
    ({}, ValueError, r"state: expected CUDA tensors"),
    # V = 256 (a GDN dim, not a Mamba-2 headdim): every host check passes (the copy runs on 64 x 64 rows)
    (dict(state=torch.zeros(S, HV, 256, K), snapshots=torch.zeros(S, T, HV, 256, K)), ValueError,
     r"state: expected CUDA tensors"),
    (dict(state=torch.zeros(S, HV, V, 256), snapshots=torch.zeros(S, T, HV, V, 256)), ValueError,
     r"state: expected CUDA tensors"),
])
def test_native_commit_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_native_spec_commit(**commit_args(**over))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(num_tokens=3), ValueError, r"num_tokens: expected one of \(1, 2, 4, 6, 8\), got 3"),
    (dict(num_tokens=4), ValueError, r"buffer_len: expected in \[2T, 32\] = \[8, 32\]"),
    (dict(cursor=torch.zeros(S, dtype=I32)), ValueError, r"cursor: expected shape \(slots, 2\), got \(5,\)"),
    (dict(n_accepted=torch.tensor([1, 3, 0], dtype=I32)), ValueError, r"n_accepted: expected values in \[0, T\] = \[0, 2\]"),
    (dict(u_cache=torch.zeros(S, LS)), ValueError, r"u_cache: expected a \(slots, HV, L, V\) tensor"),
    ({}, ValueError, r"cursor: expected CUDA tensors"),
])
def test_spec_commit_rejects(kw, exc, match):
    args = dict(cursor=torch.zeros(S, 2, dtype=I32), n_accepted=torch.ones(BATCH, dtype=I32),
                state_batch_indices=torch.arange(BATCH, dtype=I32), num_tokens=T, u_cache=torch.zeros(S, HV, LS, V))
    args.update(kw)
    with pytest.raises(exc, match=match):
        gdn_ops.gdn_spec_commit(**args)
