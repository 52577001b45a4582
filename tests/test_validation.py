# SPDX-License-Identifier: Apache-2.0
"""Launcher validation: bad input is rejected before any launch, naming the tensor.

Shape, dtype, alignment and value checks run before the device check, so they are exercised here on
CPU tensors (a device mismatch on meta tensors: the vote is the same as with CUDA ones). Issue 17's
holes and the CPU tests that close them (tests/test_validation_gpu.py has the device side: unchecked
values on the H200 with guard allocations around every tensor):

1. advance_cursor values: test_advance_cursor_rejects, test_advance_cursor_unchecked_values_reach_the_device
2. unsupported headdim / dstate: test_unsupported_headdim_dstate_rejected, test_supported_geometries_pass
3. 16-byte alignment: test_misaligned_vector_tensors_rejected, test_offset_views_of_scalar_tensors_accepted
4. buffer length from the rings: test_buffer_len_taken_from_x_cache
5. the offending tensor named: test_device_mismatch_names_the_odd_tensor, test_shape_dtype_mismatch_names_the_odd_tensor
"""

import itertools

import pytest
import torch

from trtllm_replayssm import cursor_ops
from trtllm_replayssm.cache import ReplayStateCache
from trtllm_replayssm.config import SUPPORTED_DSTATE, SUPPORTED_HEADDIM
from trtllm_replayssm.families.mamba2 import ops

H, P, N, G, L, S, BATCH = 4, 64, 64, 2, 4, 5, 3


def good(P=P, N=N, **over):
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


# ---- issue 17 -----------------------------------------------------------------------------------------------------
I32, BF, FP8 = torch.int32, torch.bfloat16, torch.float8_e4m3fn
T2, L2 = 2, 8  # window and ring of the speculative cases (L >= 2T)


def good_spec(P=P, N=N, **over):
    t = dict(
        x=torch.zeros(BATCH, T2, H, P, dtype=BF), B=torch.zeros(BATCH, T2, G, N, dtype=BF),
        C=torch.zeros(BATCH, T2, G, N, dtype=BF), dt=torch.zeros(BATCH, T2, H, dtype=BF),
        dt_bias=torch.zeros(H), A=-torch.ones(H), D=torch.ones(H), state=torch.zeros(S, H, P, N),
        x_cache=torch.zeros(S, H, L2, P, dtype=BF), B_cache=torch.zeros(S, G, L2, N, dtype=BF),
        dt_cache=torch.zeros(S, H, L2), cursor=torch.zeros(S, 2, dtype=I32),
        state_batch_indices=torch.arange(BATCH, dtype=I32),
    )
    t.update(over)
    return t


def good_native(P=P, N=N, **over):
    t = {k: v for k, v in good_spec(P, N).items() if k not in ("x_cache", "B_cache", "dt_cache", "cursor")}
    t["snapshots"] = torch.zeros(S, T2, H, P, N)
    t.update(over)
    return t


def native_commit_args(P=P, N=N, **over):
    t = dict(state=torch.zeros(S, H, P, N), snapshots=torch.zeros(S, T2, H, P, N),
             n_accepted=torch.ones(BATCH, dtype=I32), state_batch_indices=torch.arange(BATCH, dtype=I32))
    t.update(over)
    return t


def full_decode(**over):
    """Every tensor a decode launch can take: gate, output and an fp8 shadow with its row scales."""
    return good(z=torch.zeros(BATCH, H, P, dtype=BF), out=torch.zeros(BATCH, H, P, dtype=BF),
                shadow=torch.zeros(S, H, P, N, dtype=FP8), shadow_scale=torch.ones(S, H, P), **over)


def full_verify(**over):
    return good_spec(z=torch.zeros(BATCH, T2, H, P, dtype=BF), out=torch.zeros(BATCH, T2, H, P, dtype=BF),
                     shadow=torch.zeros(S, H, P, N, dtype=FP8), shadow_scale=torch.ones(S, H, P), **over)


# Hole 1: advance_cursor had no value checks (slots, duplicates, cursors) and took a 2-D slot index.
CUR = torch.tensor([0, 3, 1, 0, 2], dtype=I32)  # slot 1 at L - 1: the next advance wraps it
ADVANCE_CASES = [
    (dict(state_batch_indices=torch.tensor([0, 5], dtype=I32)), ValueError,
     r"state_batch_indices: expected values in \[-1, 5\), got \[5\]"),
    (dict(state_batch_indices=torch.tensor([-2, 1], dtype=I32)), ValueError,
     r"state_batch_indices: expected values in \[-1, 5\), got \[-2\]"),
    (dict(state_batch_indices=torch.tensor([2, -1, 2], dtype=I32)), ValueError,
     r"state_batch_indices: expected each slot in at most one row \(rows would race\), got slots \[2\] in more"),
    (dict(cursor=torch.tensor([0, 4, 1, 0, 0], dtype=I32)), ValueError,
     r"cursor: expected values in \[0, 4\) for the rows' slots, got \[4\] \(slots \[1\]\)"),
    (dict(cursor=torch.tensor([-1, 1, 1, 0, 0], dtype=I32)), ValueError,
     r"cursor: expected values in \[0, 4\) for the rows' slots, got \[-1\] \(slots \[0\]\)"),
    (dict(state_batch_indices=torch.tensor([[1, 0]], dtype=I32)), ValueError,
     r"state_batch_indices: expected a \(batch,\) tensor, got shape \(1, 2\)"),
    (dict(cursor=torch.zeros(S, 2, dtype=I32)), ValueError, r"cursor: expected a \(slots,\) tensor, got shape \(5, 2\)"),
    (dict(cursor=torch.zeros(S, dtype=torch.int64)), TypeError, r"cursor: expected dtype int32, got int64"),
    (dict(state_batch_indices=torch.tensor([1, 0])), TypeError, r"state_batch_indices: expected dtype int32, got int64"),
    (dict(cursor=[0] * S), TypeError, r"cursor: expected a \(slots,\) torch.Tensor, got list"),
    (dict(buffer_len=33), ValueError, r"buffer_len: expected in 1..32, got 33"),
    (dict(buffer_len=0), ValueError, r"buffer_len: expected in 1..32, got 0"),
    (dict(buffer_len=4.0), TypeError, r"buffer_len: expected an int, got float"),
    (dict(buffer_len=None), TypeError, r"buffer_len: expected an int, or x_cache to take it from; got neither"),
    ({}, ValueError, r"cursor: expected CUDA tensors, got device cpu"),  # every host check passed
]


@pytest.mark.parametrize("over, exc, match", ADVANCE_CASES, ids=[c[2][:48] for c in ADVANCE_CASES])
def test_advance_cursor_rejects(over, exc, match):
    kw = {"cursor": CUR.clone(), "state_batch_indices": torch.tensor([1, -1, 0], dtype=I32), "buffer_len": L, **over}
    with pytest.raises(exc, match=match):
        cursor_ops.advance_cursor(**kw)


def test_advance_cursor_unchecked_values_reach_the_device():
    """check_values=False (graph mode) reads no values on the host: bad slots, duplicates, cursors and n_accepted
    pass to the device check (the kernels skip or clamp them: test_validation_gpu.py); True checks them."""
    cur = torch.tensor([0, 9, -3, 0, 0], dtype=I32)
    sbi = torch.tensor([1, 7, 2, 2, -9], dtype=I32)
    with pytest.raises(ValueError, match=r"cursor: expected CUDA tensors"):
        cursor_ops.advance_cursor(cur, sbi, L, check_values=False)
    with pytest.raises(ValueError, match=r"state_batch_indices: expected values in \[-1, 5\), got \[7, -9\]"):
        cursor_ops.advance_cursor(cur, sbi, L, check_values=True)
    assert cur.tolist() == [0, 9, -3, 0, 0]
    cur2, n = torch.tensor([[9, 0]] * S, dtype=I32), torch.tensor([9, -1, 1, 1, 1], dtype=I32)
    with pytest.raises(ValueError, match=r"cursor: expected CUDA tensors"):
        cursor_ops.spec_commit(cur2, n, sbi, T2, L2, check_values=False)
    with pytest.raises(ValueError, match=r"x: expected CUDA tensors"):
        ops.replay_decode(**good(cursor=cur, state_batch_indices=torch.tensor([1, 1, 9], dtype=I32)), check_values=False)


# Hole 2: headdim / dstate outside config.SUPPORTED_* were only refused by scripts/build_engine.py.
BAD_GEOMS = [(p, N) for p in (32, 48, 96, 256)] + [(P, n) for n in (16, 32, 512)]


def _geom_match(Pq, Nq, x_dim):
    if Pq != P:
        return rf"x: headdim \(dim {x_dim}\) expected one of \(64, 80, 128\), got {Pq}"
    return rf"state: dstate \(dim 3\) expected one of \(64, 128, 256\), got {Nq}"


@pytest.mark.parametrize("Pq, Nq", BAD_GEOMS, ids=[f"P{p}_N{n}" for p, n in BAD_GEOMS])
def test_unsupported_headdim_dstate_rejected(Pq, Nq):
    with pytest.raises(ValueError, match=_geom_match(Pq, Nq, 2)):
        ops.replay_decode(**good(Pq, Nq))
    conv = {k: v for k, v in good(Pq, Nq).items() if k not in ("x_cache", "B_cache", "dt_cache", "cursor")}
    with pytest.raises(ValueError, match=_geom_match(Pq, Nq, 2)):
        ops.conventional_step(**conv)
    with pytest.raises(ValueError, match=_geom_match(Pq, Nq, 3)):
        ops.replay_verify(**good_spec(Pq, Nq))
    with pytest.raises(ValueError, match=_geom_match(Pq, Nq, 3)):
        ops.native_spec_verify(**good_native(Pq, Nq))
    what = rf"state: headdim \(dim 2\) expected one of \(64, 80, 128\), got {Pq}" if Pq != P else _geom_match(Pq, Nq, 2)
    with pytest.raises(ValueError, match=what):
        cursor_ops.native_spec_commit(**native_commit_args(Pq, Nq))
    # The float64 CPU cache (the spec) takes any geometry; a CUDA one refuses these (test_validation_gpu.py).
    ReplayStateCache(1, 2, H, Pq, Nq, G, L2, num_draft=1)


@pytest.mark.parametrize("Pq, Nq", list(itertools.product(SUPPORTED_HEADDIM, SUPPORTED_DSTATE)))
def test_supported_geometries_pass(Pq, Nq):
    with pytest.raises(ValueError, match=r"x: expected CUDA tensors"):
        ops.replay_decode(**good(Pq, Nq))
    with pytest.raises(ValueError, match=r"x: expected CUDA tensors"):
        ops.replay_verify(**good_spec(Pq, Nq))


# Hole 3: the kernels move these tensors in 16-byte vectors; a contiguous view at an odd offset would fault.
def offset(t, elems=1):
    """A contiguous copy of ``t`` starting ``elems`` elements into a larger buffer."""
    buf = torch.zeros(t.numel() + elems, dtype=t.dtype)
    view = buf[elems:].view(t.shape)
    view.copy_(t)
    return view


VECTOR = ("x", "z", "B", "C", "state", "x_cache", "B_cache", "shadow", "shadow_scale")
SCALAR = ("dt", "dt_bias", "A", "D", "dt_cache", "cursor", "state_batch_indices", "out")
LAUNCHERS = {"replay_decode": (ops.replay_decode, full_decode), "replay_verify": (ops.replay_verify, full_verify)}


def _misaligned(name):
    return rf"^{name}: expected a 16-byte aligned data pointer \(vector loads\), got 0x[0-9a-f]+ \(storage offset 1 elements\)$"


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("name", VECTOR)
def test_misaligned_vector_tensors_rejected(launcher, name):
    fn, args = LAUNCHERS[launcher]
    t = args()
    with pytest.raises(ValueError, match=_misaligned(name)):
        fn(**{**t, name: offset(t[name])})


def test_misaligned_native_tensors_rejected():
    for name in ("x", "B", "C", "state", "snapshots"):
        t = good_native()
        with pytest.raises(ValueError, match=_misaligned(name)):
            ops.native_spec_verify(**{**t, name: offset(t[name])})
    for name in ("state", "snapshots"):
        t = native_commit_args()
        with pytest.raises(ValueError, match=_misaligned(name)):
            cursor_ops.native_spec_commit(**{**t, name: offset(t[name])})


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_offset_views_of_scalar_tensors_accepted(launcher):
    """Tensors read as scalars need only element alignment; vector tensors at a 16-byte offset are fine."""
    fn, args = LAUNCHERS[launcher]
    t = args()
    for name in SCALAR:
        with pytest.raises(ValueError, match=r"x: expected CUDA tensors"):
            fn(**{**t, name: offset(t[name])})
    with pytest.raises(ValueError, match=r"x: expected CUDA tensors"):
        fn(**{**t, "state": offset(t["state"], 4), "x": offset(t["x"], 8), "shadow": offset(t["shadow"], 16)})
    with pytest.raises(ValueError, match=r"cursor: expected CUDA tensors"):
        cursor_ops.advance_cursor(offset(CUR), offset(torch.tensor([1, -1, 0], dtype=I32)), L)


# Hole 4: the buffer length of the cursor ops is the rings' (x_cache dim 2), not a second number.
def test_buffer_len_taken_from_x_cache():
    sbi = torch.tensor([1, -1, 0], dtype=I32)
    xc = torch.zeros(S, H, L, P, dtype=BF)
    with pytest.raises(ValueError, match=r"^buffer_len: expected 4 \(the buffer length of x_cache, dim 2\), got 8$"):
        cursor_ops.advance_cursor(CUR.clone(), sbi, 8, x_cache=xc)
    with pytest.raises(ValueError, match=r"^buffer_len: expected 4 \(the buffer length of x_cache, dim 2\), got 8$"):
        torch.ops.trtllm_replayssm.advance_cursor(CUR.clone(), sbi, 8, xc)
    cur = CUR.clone()
    cur[1] = L  # in range for a buffer_len of 8, not for the ring
    with pytest.raises(ValueError, match=r"cursor: expected values in \[0, 4\) for the rows' slots, got \[4\] \(slots \[1\]\)"):
        cursor_ops.advance_cursor(cur, sbi, x_cache=xc)
    with pytest.raises(ValueError, match=r"cursor: expected CUDA tensors"):  # given once, or twice and equal
        cursor_ops.advance_cursor(CUR.clone(), sbi, L, x_cache=xc)
    with pytest.raises(ValueError, match=r"x_cache: expected a \(slots, nheads, buffer_len, headdim\) tensor, got shape"):
        cursor_ops.advance_cursor(CUR.clone(), sbi, x_cache=xc[0])
    with pytest.raises(ValueError, match=r"^x_cache: buffer_len \(dim 2\): expected in 1..32, got 40$"):
        cursor_ops.advance_cursor(CUR.clone(), sbi, x_cache=torch.zeros(S, H, 40, P, dtype=BF))
    with pytest.raises(ValueError, match=r"^x_cache: expected shape \(5, 4, 4, 64\), got \(6, 4, 4, 64\)$"):
        cursor_ops.advance_cursor(CUR.clone(), sbi, x_cache=torch.zeros(S + 1, H, L, P, dtype=BF))

    cur2, n, xc8 = torch.zeros(S, 2, dtype=I32), torch.ones(BATCH, dtype=I32), torch.zeros(S, H, L2, P, dtype=BF)
    with pytest.raises(ValueError, match=r"^buffer_len: expected 8 \(the buffer length of x_cache, dim 2\), got 16$"):
        cursor_ops.spec_commit(cur2, n, sbi, T2, 16, x_cache=xc8)
    with pytest.raises(ValueError, match=r"^buffer_len: expected 8 \(the buffer length of x_cache, dim 2\), got 16$"):
        torch.ops.trtllm_replayssm.spec_commit(cur2, n, sbi, T2, 16, xc8)
    with pytest.raises(ValueError, match=r"^x_cache: buffer_len \(dim 2\): expected in \[2T, 32\] = \[8, 32\] \(flush one "
                                         r"window early, T=4\), got 6$"):
        cursor_ops.spec_commit(cur2, n, sbi, 4, x_cache=torch.zeros(S, H, 6, P, dtype=BF))
    cur2[1, 1] = L2 - T2 + 1  # in range for a buffer_len of 16, not for the ring
    with pytest.raises(ValueError, match=r"cursor: expected count \(column 1\) in \[0, L - T\] = \[0, 6\] for the rows' "
                                         r"slots, got \[7\] \(slots \[1\]\)"):
        cursor_ops.spec_commit(cur2, n, sbi, T2, x_cache=xc8)
    cur2[1, 1] = 0
    with pytest.raises(ValueError, match=r"cursor: expected CUDA tensors"):
        cursor_ops.spec_commit(cur2, n, sbi, T2, x_cache=xc8)


# Hole 5: a size / dtype / device mismatch names the tensor that differs, not the one it was compared with.
def _meta(t: dict) -> dict:
    return {k: v.to("meta") for k, v in t.items()}


DECODE_NAMES = sorted(full_decode())
VERIFY_NAMES = sorted(full_verify())


@pytest.mark.parametrize("odd", ["cpu", "meta"])
@pytest.mark.parametrize("name", DECODE_NAMES)
def test_device_mismatch_names_the_odd_tensor(name, odd):
    """Every tensor but one on one device (meta stands in for CUDA: the same vote), the odd one is named."""
    cpu = full_decode()
    t = _meta(cpu) if odd == "cpu" else dict(cpu)
    t[name] = cpu[name].to(odd)
    other = "meta" if odd == "cpu" else "cpu"
    with pytest.raises(ValueError, match=rf"^{name}: expected device {other}, got {odd}$"):
        ops.replay_decode(**t)


@pytest.mark.parametrize("name", VERIFY_NAMES)
def test_device_mismatch_names_the_odd_tensor_spec(name):
    cpu = full_verify()
    t = _meta(cpu)
    t[name] = cpu[name]
    with pytest.raises(ValueError, match=rf"^{name}: expected device meta, got cpu$"):
        ops.replay_verify(**t)


def test_device_mismatch_names_the_odd_tensor_cursor_ops():
    sbi = torch.tensor([1, -1, 0], dtype=I32)
    adv = dict(cursor=CUR.clone(), state_batch_indices=sbi, x_cache=torch.zeros(S, H, L, P, dtype=BF))
    for name in adv:
        t = _meta(adv)
        t[name] = adv[name]
        with pytest.raises(ValueError, match=rf"^{name}: expected device meta, got cpu$"):
            cursor_ops.advance_cursor(**t, check_values=False)
    com = dict(cursor=torch.zeros(S, 2, dtype=I32), n_accepted=torch.ones(BATCH, dtype=I32), state_batch_indices=sbi,
               x_cache=torch.zeros(S, H, L2, P, dtype=BF))
    for name in com:
        t = _meta(com)
        t[name] = com[name]
        with pytest.raises(ValueError, match=rf"^{name}: expected device meta, got cpu$"):
            cursor_ops.spec_commit(**t, num_tokens=T2, check_values=False)
    for name in native_commit_args():
        t = _meta(native_commit_args())
        t[name] = native_commit_args()[name]
        with pytest.raises(ValueError, match=rf"^{name}: expected device meta, got cpu$"):
            cursor_ops.native_spec_commit(**t, check_values=False)


NAMING_CASES = [
    (dict(x=torch.zeros(BATCH, H + 1, P, dtype=BF)), ValueError, r"^x: expected shape \(3, 4, 64\), got \(3, 5, 64\)$"),
    (dict(x=torch.zeros(BATCH + 1, H, P, dtype=BF)), ValueError, r"^x: expected shape \(3, 4, 64\), got \(4, 4, 64\)$"),
    (dict(x=torch.zeros(BATCH, H, 80, dtype=BF)), ValueError, r"^x: expected shape \(3, 4, 64\), got \(3, 4, 80\)$"),
    (dict(x=torch.zeros(BATCH, H, P, dtype=torch.float16)), TypeError, r"^x: expected dtype bfloat16, got float16$"),
    (dict(state=torch.zeros(S, H, P, 128)), ValueError, r"^state: expected shape \(5, 4, 64, 64\), got \(5, 4, 64, 128\)$"),
    (dict(state=torch.zeros(S + 1, H, P, N)), ValueError, r"^state: expected shape \(5, 4, 64, 64\), got \(6, 4, 64, 64\)$"),
    (dict(dt=torch.zeros(BATCH, H + 1, dtype=BF)), ValueError, r"^dt: expected shape \(3, 4\), got \(3, 5\)$"),
    (dict(x_cache=torch.zeros(S, H, L, P, dtype=torch.float16)), TypeError, r"^x_cache: expected dtype bfloat16, got float16$"),
    (dict(x_cache=torch.zeros(S, H, L + 4, P, dtype=BF)), ValueError,
     r"^x_cache: expected shape \(5, 4, 4, 64\), got \(5, 4, 8, 64\)$"),
    (dict(cursor=torch.zeros(S + 1, dtype=I32)), ValueError, r"^cursor: expected shape \(5,\), got \(6,\)$"),
    (dict(state_batch_indices=torch.arange(BATCH + 1, dtype=I32)), ValueError,
     r"^state_batch_indices: expected shape \(3,\), got \(4,\)$"),
]


@pytest.mark.parametrize("over, exc, match", NAMING_CASES, ids=[c[2][1:48] for c in NAMING_CASES])
def test_shape_dtype_mismatch_names_the_odd_tensor(over, exc, match):
    with pytest.raises(exc, match=match):
        ops.replay_decode(**good(**over))


def test_shape_mismatch_names_the_odd_tensor_spec():
    cases = [
        (dict(x=torch.zeros(BATCH, T2, H + 1, P, dtype=BF)), r"^x: expected shape \(3, 2, 4, 64\), got \(3, 2, 5, 64\)$"),
        (dict(B=torch.zeros(BATCH, 4, G, N, dtype=BF)), r"^B: expected shape \(3, 2, 2, 64\), got \(3, 4, 2, 64\)$"),
        (dict(cursor=torch.zeros(S + 1, 2, dtype=I32)), r"^cursor: expected shape \(5, 2\), got \(6, 2\)$"),
    ]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.replay_verify(**good_spec(**over))
