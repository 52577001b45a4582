# SPDX-License-Identifier: Apache-2.0
"""Unchecked values on the device (issue 17): nothing outside a row's own slot is ever written.

With ``check_values=False`` (what graph capture does) the host reads no values, so the kernels handle
them as the families/mamba2/ops.py module docstring promises: a row whose slot is out of range is skipped, a row whose
cursor is out of range gets NaN outputs and leaves every state, ring and cursor as it is (advance_cursor
and spec_commit do not move it), n_accepted is clamped to [0, T], rows sharing a slot race on that slot
only. Every tensor of a launch lives in the middle of a larger buffer whose GUARD bytes on each side
hold a sentinel; after the launch the guards must be unchanged.

Oracles (all exact, bit for bit):
- a "clean" launch on identical tensors in which the bad rows are padding (-1): after the bad launch
  every tensor is bit-identical to the clean one (same kernel, same batch, deterministic arithmetic)
  except the outputs of rows with a corrupt cursor, which are NaN in every element. So the good rows
  are computed as without the bad ones, and no slot but theirs changed. Slots without a good row are
  also compared with their values before the launch, and inputs with theirs.
- the good rows did real work: their window / step inputs are in the rings at the cursor's index
  (copies: exact), a flushing slot's checkpoint (and shadow) changed, their outputs are finite.
- the cursor ops against their rule written out here (advance: +1 mod L; commit: flush as the verify
  kernels do, then count += clamp(n, 0, T)); a racing duplicate slot may hold any of the sequential
  outcomes.
- teeth: the guard check and the comparison each catch one planted byte.
Host-side rejections that need CUDA tensors (a CPU tensor among CUDA ones, misaligned CUDA views,
unsupported geometry of a CUDA cache) are here too; their CPU twins are in tests/test_validation.py.
"""

import pytest
import torch
import torch.nn.functional as F

from trtllm_replayssm import config, cursor_ops
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.cache import ReplayStateCache
from trtllm_replayssm.families.mamba2 import ops

from .problems import make_params

pytestmark = pytest.mark.gpu
DEV = "cuda"
HOST = "cpu"  # the odd device of the device-mismatch tests
I32, BF, FP8 = torch.int32, torch.bfloat16, torch.float8_e4m3fn
H, P, N, G = 4, 64, 64, 2  # the "tiny" geometry: small and fast, every kernel supports it
GUARD = 512  # bytes on each side of a tensor; a multiple of 16 keeps the tensor 16-byte aligned
SENTINEL = 0xA5
BIG, INT_MIN = 2 ** 31 - 1, -(2 ** 31)
SLOT_TENSORS = ("state", "x_cache", "B_cache", "dt_cache", "cursor", "shadow", "shadow_scale", "snapshots")
INPUTS = ("x", "B", "C", "dt", "dt_bias", "A", "D", "z", "state_batch_indices")


def sync():
    torch.cuda.synchronize()


def bits(t):
    return t if t.dtype == I32 else t.contiguous().view(torch.uint8)


class Guarded:
    """Tensors placed in the middle of sentinel-filled device buffers."""

    def __init__(self):
        self.bufs = {}

    def put(self, name, t):
        if t is None:
            return None
        nbytes = t.numel() * t.element_size()
        buf = torch.full((nbytes + 2 * GUARD,), SENTINEL, dtype=torch.uint8, device=DEV)
        view = buf[GUARD:GUARD + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        self.bufs[name] = buf
        return view

    def check(self):
        sync()
        for name, buf in self.bufs.items():
            for side, g in (("before", buf[:GUARD]), ("after", buf[-GUARD:])):
                bad = int((g != SENTINEL).sum())
                assert bad == 0, f"{name}: {bad} guard bytes {side} the tensor were written"


def guarded(cpu: dict, sbi: list) -> tuple[dict, Guarded]:
    g = Guarded()
    t = {k: g.put(k, v) for k, v in cpu.items()}
    t["state_batch_indices"] = g.put("state_batch_indices", torch.tensor(sbi, dtype=I32))
    return t, g


def layout(batch: int, S: int, good: dict, corrupt: list) -> tuple[list, list, list, list]:
    """(bad, clean, nan_rows, untouched_rows): ``good`` {row: slot} rows keep their slot in both; every other
    row of the bad index cycles through padding, out-of-range slots and the slots whose cursor is corrupt."""
    cycle = [-1, S] + corrupt[:1] + [-3, BIG] + corrupt[1:] + [INT_MIN, S + 5]
    bad = [good.get(r, cycle[r % len(cycle)]) for r in range(batch)]
    clean = [good.get(r, -1) for r in range(batch)]
    nan_rows = [r for r in range(batch) if r not in good and bad[r] in corrupt]
    untouched = [r for r in range(batch) if r not in good and bad[r] not in corrupt]
    return bad, clean, nan_rows, untouched


def assert_same(got: dict, want: dict, skip_rows=(), skip_slots=(), what="the clean launch"):
    """Every tensor bit-identical, except output rows ``skip_rows`` and slots ``skip_slots`` (racing rows)."""
    for k, a in got.items():
        if a is None:
            continue
        b = want[k]
        if k == "out" and skip_rows:
            keep = [r for r in range(a.shape[0]) if r not in skip_rows]
            a, b = a[keep], b[keep]
        elif k in SLOT_TENSORS and skip_slots:
            keep = [s for s in range(a.shape[0]) if s not in skip_slots]
            a, b = a[keep], b[keep]
        assert torch.equal(bits(a.cpu()), bits(b.cpu())), f"{k} differs from {what}"


def assert_slots_unchanged(t: dict, cpu: dict, slots):
    for k in SLOT_TENSORS:
        if t.get(k) is not None and slots:
            assert torch.equal(bits(t[k].cpu()[slots]), bits(cpu[k][slots])), f"{k}: slots {slots} changed"


def assert_inputs_unchanged(t: dict, cpu: dict, sbi: list):
    for k in INPUTS:
        if t.get(k) is None:
            continue
        want = torch.tensor(sbi, dtype=I32) if k == "state_batch_indices" else cpu[k]
        assert torch.equal(bits(t[k].cpu()), bits(want)), f"{k} (an input) was written"


def assert_untouched_and_nan(out, cpu_out, nan_rows, untouched):
    y = out.cpu()
    if nan_rows:
        assert torch.isnan(y[nan_rows].float()).all(), "rows with a corrupt cursor: every output NaN"
    if untouched:
        assert torch.equal(bits(y[untouched]), bits(cpu_out[untouched])), "rows without a valid slot were written"


def _rnd(gen, *shape, dtype=BF, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype)


def _shadow(t: dict, kind: str):
    t["shadow"] = t["shadow_scale"] = None
    if kind != "none":
        sh = shadowq.Shadow.of(t["state"], kind)
        t["shadow"], t["shadow_scale"] = sh.q, sh.scale


def decode_tensors(batch, S, L, cursor, shadow="none", has_z=True, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prm = make_params(H, gen)
    t = dict(x=_rnd(gen, batch, H, P), B=_rnd(gen, batch, G, N, scale=0.5), C=_rnd(gen, batch, G, N, scale=0.5),
             dt=_rnd(gen, batch, H, shift=-2.0), dt_bias=prm.dt_bias, A=prm.A, D=prm.D,
             z=_rnd(gen, batch, H, P) if has_z else None, state=torch.randn(S, H, P, N, generator=gen),
             x_cache=_rnd(gen, S, H, L, P), B_cache=_rnd(gen, S, G, L, N, scale=0.5),
             dt_cache=torch.rand(S, H, L, generator=gen) * 0.1, cursor=torch.tensor(cursor, dtype=I32),
             out=torch.full((batch, H, P), 7.0, dtype=BF))
    _shadow(t, shadow)
    return t


def spec_tensors(batch, S, T, L, cursor, shadow="none", has_z=True, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prm = make_params(H, gen)
    t = dict(x=_rnd(gen, batch, T, H, P), B=_rnd(gen, batch, T, G, N, scale=0.5),
             C=_rnd(gen, batch, T, G, N, scale=0.5), dt=_rnd(gen, batch, T, H, shift=-2.0), dt_bias=prm.dt_bias,
             A=prm.A, D=prm.D, z=_rnd(gen, batch, T, H, P) if has_z else None,
             state=torch.randn(S, H, P, N, generator=gen), x_cache=_rnd(gen, S, H, L, P),
             B_cache=_rnd(gen, S, G, L, N, scale=0.5), dt_cache=torch.rand(S, H, L, generator=gen) * 0.1,
             cursor=torch.tensor(cursor, dtype=I32), out=torch.full((batch, T, H, P), 7.0, dtype=BF))
    _shadow(t, shadow)
    return t


def launch_bad_and_clean(fn, cpu, bad, clean, **kw):
    """``fn`` on two guarded copies of ``cpu``, once with the bad slot index (unchecked), once with the clean one."""
    runs = []
    for sbi in (bad, clean):
        t, g = guarded(cpu, sbi)
        fn(**t, **kw, check_values=False)
        g.check()
        runs.append((t, g))
    return runs


# ---- standard decode: replay_decode, then advance_cursor ------------------------------------------------------------
# "default": the shipped plan (persistent where it pays; staged with a shadow); the others pinned.
VARIANTS = {"default": None, "persistent": config.Variant("persistent", 5), "one-shot": config.Variant("one_shot", 5),
            "staged": config.Variant("staged", min_blocks=6, flush_rows=2)}
DECODE_CASES = [(v, "none") for v in VARIANTS] + [("default", "bf16"), ("default", "fp8"), ("one-shot", "fp8"),
                                                    ("persistent", "bf16")]
# 256 rows: more items than the persistent grid has blocks (132 SMs x 5), so blocks walk two items each
# (with 4 items per row, row 167 follows row 2, a corrupt cursor, in the same blocks).
DL, DS, DBATCH = 8, 8, 256
# slot: cursor. 0 appends at 2, 1 flushes (L - 1), 2 / 3 / 6 corrupt, 4 / 5 append, 7 unused
DCURSOR = [2, DL - 1, DL, -1, 5, 0, BIG, 3]
DGOOD = {0: 0, 1: 1, 167: 4, DBATCH - 1: 5}


def _decode_layout():
    return layout(DBATCH, DS, DGOOD, [2, 3, 6])


@pytest.mark.parametrize("variant, shadow", DECODE_CASES, ids=[f"{v}-{s}" for v, s in DECODE_CASES])
def test_replay_decode_unchecked_values_touch_only_their_slots(variant, shadow):
    cpu = decode_tensors(DBATCH, DS, DL, DCURSOR, shadow, has_z=shadow != "none", seed=len(variant) + len(shadow))
    bad, clean, nan_rows, untouched = _decode_layout()
    with config.override_variant(VARIANTS[variant]):
        (t, g), (tc, _) = launch_bad_and_clean(ops.replay_decode, cpu, bad, clean)
    assert_same(t | {"state_batch_indices": tc["state_batch_indices"]}, tc, skip_rows=nan_rows)
    assert_untouched_and_nan(t["out"], cpu["out"], nan_rows, untouched)
    assert_inputs_unchanged(t, cpu, bad)
    assert_slots_unchanged(t, cpu, [2, 3, 6, 7])
    # The good rows did their work: appended (copies of their inputs) or flushed.
    y = t["out"].cpu()
    for r, s in DGOOD.items():
        c = DCURSOR[s]
        assert torch.isfinite(y[r].float()).all(), f"row {r}: outputs not finite"
        if c == DL - 1:
            assert not torch.equal(t["state"][s].cpu(), cpu["state"][s]), f"slot {s}: the flush wrote no checkpoint"
            if shadow != "none":
                assert not torch.equal(bits(t["shadow"][s].cpu()), bits(cpu["shadow"][s])), f"slot {s}: shadow not rewritten"
            continue
        assert torch.equal(t["x_cache"][s, :, c].cpu(), cpu["x"][r]), f"slot {s}: x not appended at {c}"
        assert torch.equal(t["B_cache"][s, :, c].cpu(), cpu["B"][r]), f"slot {s}: B not appended at {c}"
        want_dt = F.softplus(cpu["dt"][r].float() + cpu["dt_bias"])  # fp32 softplus on both sides
        assert torch.allclose(t["dt_cache"][s, :, c].cpu(), want_dt, rtol=1e-5, atol=0), f"slot {s}: dt not appended"
    # Then the cursor advance (unchecked, L from the rings): good rows' slots move, corrupt cursors stay.
    cursor_ops.advance_cursor(t["cursor"], t["state_batch_indices"], check_values=False, x_cache=t["x_cache"])
    g.check()
    want = list(DCURSOR)
    for s in DGOOD.values():
        want[s] = (DCURSOR[s] + 1) % DL
    assert t["cursor"].cpu().tolist() == want
    assert_inputs_unchanged({"state_batch_indices": t["state_batch_indices"]}, cpu, bad)


def test_replay_decode_duplicate_slots_race_only_on_their_slot():
    S, L = 6, 8
    cursor = [2, 3, 1, 0, 5, 4]
    cpu = decode_tensors(4, S, L, cursor, seed=11)
    (t, _), (tc, _) = launch_bad_and_clean(ops.replay_decode, cpu, [0, 0, 1, -1], [-1, -1, 1, -1])
    assert_same(t | {"state_batch_indices": tc["state_batch_indices"]}, tc, skip_rows=(0, 1), skip_slots=(0,))
    assert_slots_unchanged(t, cpu, [2, 3, 4, 5])
    assert t["cursor"].cpu().tolist() == cursor


def test_advance_cursor_unchecked():
    S, L, batch = 10, 8, 300  # two blocks of 256 threads
    cursor = [2, L - 1, L, -1, 5, 3, BIG, INT_MIN, 0, 6]
    sbi = [-1] * batch
    rows = {0: 0, 1: 1, 2: 2, 3: 3, 4: S, 5: -3, 6: BIG, 7: INT_MIN, 8: 6, 9: 7, 299: 4}  # slots 5, 8, 9 unused
    for r, s in rows.items():
        sbi[r] = s
    g = Guarded()
    cur = g.put("cursor", torch.tensor(cursor, dtype=I32))
    idx = g.put("state_batch_indices", torch.tensor(sbi, dtype=I32))
    xc = g.put("x_cache", torch.zeros(S, 1, L, P, dtype=BF))
    cursor_ops.advance_cursor(cur, idx, check_values=False, x_cache=xc)
    g.check()
    want = list(cursor)
    want[0], want[1], want[4] = 3, 0, 6
    assert cur.cpu().tolist() == want
    assert idx.cpu().tolist() == sbi
    assert not xc.cpu().any()


def test_advance_cursor_duplicate_slots_race_only_on_their_slot():
    g = Guarded()
    cur = g.put("cursor", torch.tensor([1, 4, 0, 7], dtype=I32))
    idx = g.put("state_batch_indices", torch.tensor([0, 0, 1, -1], dtype=I32))
    cursor_ops.advance_cursor(cur, idx, 8, check_values=False)
    g.check()
    got = cur.cpu().tolist()
    assert got[0] in (2, 3) and got[1:] == [5, 0, 7], got


# ---- speculative decoding: replay_verify, then spec_commit ----------------------------------------------------------
T, SL, SS, SBATCH = 2, 8, 8, 40
# slot: (start, count). 0 appends (no flush), 1 folds (count + 2T > L) and wraps, 6 appends;
# 2 / 3 start out of range, 4 / 5 count out of range; 7 unused
SCURSOR = [[3, 1], [6, 5], [SL, 0], [-1, 0], [0, SL - T + 1], [0, -1], [2, 2], [BIG, BIG]]
SGOOD = {0: 0, 1: 1, SBATCH - 3: 6}
NACC = {0: T + 3, 1: -2, SBATCH - 3: 1}  # clamped to T, to 0, and in range


@pytest.mark.parametrize("shadow", ["none", "bf16", "fp8"])
def test_replay_verify_unchecked_values_touch_only_their_slots(shadow):
    cpu = spec_tensors(SBATCH, SS, T, SL, SCURSOR, shadow, has_z=shadow != "bf16", seed=20 + len(shadow))
    bad, clean, nan_rows, untouched = layout(SBATCH, SS, SGOOD, [2, 3, 4, 5])
    (t, g), (tc, _) = launch_bad_and_clean(ops.replay_verify, cpu, bad, clean)
    assert_same(t | {"state_batch_indices": tc["state_batch_indices"]}, tc, skip_rows=nan_rows)
    assert_untouched_and_nan(t["out"], cpu["out"], nan_rows, untouched)
    assert_inputs_unchanged(t, cpu, bad)
    assert_slots_unchanged(t, cpu, [2, 3, 4, 5, 7])
    y = t["out"].cpu()
    for r, s in SGOOD.items():
        start, m = SCURSOR[s]
        assert torch.isfinite(y[r].float()).all(), f"row {r}: outputs not finite"
        for tok in range(T):
            i = (start + m + tok) % SL
            assert torch.equal(t["x_cache"][s, :, i].cpu(), cpu["x"][r, tok]), f"slot {s}: x of token {tok} not at {i}"
            assert torch.equal(t["B_cache"][s, :, i].cpu(), cpu["B"][r, tok]), f"slot {s}: B of token {tok} not at {i}"
        folded = not torch.equal(t["state"][s].cpu(), cpu["state"][s])
        assert folded == (m + 2 * T > SL), f"slot {s}: checkpoint folded={folded} with count {m}"
    # Then the commit (unchecked, L from the rings): flush as the kernels did, count += clamp(n, 0, T).
    n = [NACC.get(r, (r % 13) - 4) for r in range(SBATCH)]  # other rows: any value, never used
    n_acc = g.put("n_accepted", torch.tensor(n, dtype=I32))
    cursor_ops.spec_commit(t["cursor"], n_acc, t["state_batch_indices"], T, check_values=False, x_cache=t["x_cache"])
    g.check()
    want = [list(c) for c in SCURSOR]
    for r, s in SGOOD.items():
        start, m = SCURSOR[s]
        if m + 2 * T > SL:
            start, m = (start + m) % SL, 0
        want[s] = [start, m + min(max(NACC[r], 0), T)]
    assert t["cursor"].cpu().tolist() == want
    assert n_acc.cpu().tolist() == n


def test_replay_verify_duplicate_slots_race_only_on_their_slot():
    cursor = [[1, 0], [5, 2], [0, 0], [7, 1]]
    cpu = spec_tensors(3, 4, T, SL, cursor, seed=31)
    (t, _), (tc, _) = launch_bad_and_clean(ops.replay_verify, cpu, [0, 0, 1], [-1, -1, 1])
    assert_same(t | {"state_batch_indices": tc["state_batch_indices"]}, tc, skip_rows=(0, 1), skip_slots=(0,))
    assert_slots_unchanged(t, cpu, [2, 3])
    assert t["cursor"].cpu().tolist() == cursor


def test_spec_commit_duplicate_slots_race_only_on_their_slot():
    g = Guarded()
    cur = g.put("cursor", torch.tensor([[0, 0], [1, 2], [3, 3]], dtype=I32))
    cursor_ops.spec_commit(cur, g.put("n_accepted", torch.tensor([1, 1, 2], dtype=I32)),
                    g.put("state_batch_indices", torch.tensor([0, 0, 1], dtype=I32)), T, SL, check_values=False)
    g.check()
    got = cur.cpu().tolist()
    assert got[0] in ([0, 1], [0, 2]) and got[1:] == [[1, 4], [3, 3]], got


# ---- conventional step and the native-spec baseline: out-of-range slots, n_accepted clamped -------------------------
def test_conventional_step_unchecked_slots():
    cpu = {k: v for k, v in decode_tensors(12, 6, 4, [0] * 6, seed=41).items()
           if k not in ("x_cache", "B_cache", "dt_cache", "cursor", "shadow", "shadow_scale")}
    bad, clean, _, untouched = layout(12, 6, {0: 0, 7: 3}, [])
    (t, _), (tc, _) = launch_bad_and_clean(ops.conventional_step, cpu, bad, clean)
    assert_same(t | {"state_batch_indices": tc["state_batch_indices"]}, tc)
    assert_untouched_and_nan(t["out"], cpu["out"], [], untouched)
    assert_inputs_unchanged(t, cpu, bad)
    assert_slots_unchanged(t, cpu, [1, 2, 4, 5])
    for s in (0, 3):
        assert not torch.equal(t["state"][s].cpu(), cpu["state"][s]), f"slot {s}: the step wrote no state"


def test_native_spec_unchecked_slots_and_n_accepted():
    S = 6
    cpu = {k: v for k, v in spec_tensors(12, S, T, SL, [[0, 0]] * S, seed=42).items()
           if k not in ("x_cache", "B_cache", "dt_cache", "cursor", "shadow", "shadow_scale")}
    cpu["snapshots"] = torch.randn(S, T, H, P, N)
    bad, clean, _, untouched = layout(12, S, {0: 0, 1: 1, 9: 3, 10: 4}, [])
    (t, g), (tc, _) = launch_bad_and_clean(ops.native_spec_verify, cpu, bad, clean)
    assert_same(t | {"state_batch_indices": tc["state_batch_indices"]}, tc)
    assert_untouched_and_nan(t["out"], cpu["out"], [], untouched)
    assert_inputs_unchanged(t, cpu, bad)
    assert_slots_unchanged(t, cpu, [2, 5])  # snapshots and state of slots without a row
    assert torch.equal(t["state"].cpu(), cpu["state"]), "native verify writes no state"
    # Commit: n clamped to [0, T] (T + 5 -> T, -3 and 0 -> nothing), bad slots skipped.
    snaps, before = t["snapshots"].cpu(), t["state"].cpu()
    n = [T + 5, -3, 0, 1] + [1] * 6
    rows = [0, 1, 2, 3, S, -1, BIG, INT_MIN, -3, S + 5]  # slots 4 and 5: no row
    cursor_ops.native_spec_commit(t["state"], t["snapshots"], g.put("n_accepted", torch.tensor(n, dtype=I32)),
                           g.put("commit_rows", torch.tensor(rows, dtype=I32)), check_values=False)
    g.check()
    want = before.clone()
    want[0] = snaps[0, T - 1]
    want[3] = snaps[3, 0]
    assert torch.equal(bits(t["state"].cpu()), bits(want))


# ---- host-side rejections that need CUDA tensors -----------------------------------------------------------------------
def _cuda(cpu: dict) -> dict:
    return {k: None if v is None else v.to(DEV) for k, v in cpu.items()}


def _full_decode():
    t = _cuda(decode_tensors(3, 4, 8, [2, 7, 0, 0], "fp8", has_z=True, seed=50))
    t["state_batch_indices"] = torch.tensor([0, 1, -1], dtype=I32, device=DEV)
    return t


def _full_verify():
    t = _cuda(spec_tensors(3, 4, T, SL, [[1, 1], [6, 5], [0, 0], [0, 0]], "fp8", has_z=True, seed=51))
    t["state_batch_indices"] = torch.tensor([0, 1, -1], dtype=I32, device=DEV)
    return t


LAUNCHERS = {"replay_decode": (ops.replay_decode, _full_decode), "replay_verify": (ops.replay_verify, _full_verify)}
VECTOR = ("x", "z", "B", "C", "state", "x_cache", "B_cache", "shadow", "shadow_scale")
SCALAR = ("dt", "dt_bias", "A", "D", "dt_cache", "cursor", "state_batch_indices", "out")
NAMES = sorted(set(VECTOR) | set(SCALAR))


def cuda_offset(t, elems=1):
    """A copy of ``t`` starting ``elems`` elements into a larger device buffer (contiguous, pointer moved)."""
    buf = torch.zeros(t.numel() + elems, dtype=t.dtype, device=DEV)
    view = buf[elems:].view(t.shape)
    view.copy_(t)
    return view


def _snapshot(t):
    return {k: v.clone() for k, v in t.items() if v is not None}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("name", VECTOR)
def test_misaligned_cuda_views_rejected_before_launch(launcher, name):
    fn, make = LAUNCHERS[launcher]
    t = make()
    before = _snapshot(t)
    with pytest.raises(ValueError, match=rf"^{name}: expected a 16-byte aligned data pointer \(vector loads\), "
                                         rf"got 0x[0-9a-f]+ \(storage offset 1 elements\)$"):
        fn(**{**t, name: cuda_offset(t[name])})
    sync()  # nothing launched: the rows would have appended and flushed
    assert_same({k: t[k] for k in before}, before, what="before the call")


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_offset_views_of_scalar_tensors_give_the_same_results(launcher):
    """Tensors the kernels read and write as scalars need only element alignment: offset views launch and
    give bit-identical results."""
    fn, make = LAUNCHERS[launcher]
    a, b = make(), make()
    b = {**b, **{k: cuda_offset(b[k]) for k in SCALAR}}
    fn(**a)
    fn(**b)
    sync()
    assert_same(b, a, what="the aligned launch")
    assert torch.isfinite(a["out"][:2].float()).all()


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("name", NAMES)
def test_host_tensor_among_cuda_tensors_is_named(launcher, name):
    fn, make = LAUNCHERS[launcher]
    t = make()
    dev = t["x"].device
    with pytest.raises(ValueError, match=rf"^{name}: expected device {dev}, got {HOST}$"):
        fn(**{**t, name: t[name].to(HOST)})


def test_host_tensor_among_cuda_tensors_is_named_cursor_ops():
    cur, sbi = torch.zeros(4, dtype=I32, device=DEV), torch.tensor([0, 1, -1], dtype=I32, device=DEV)
    xc = torch.zeros(4, H, 8, P, dtype=BF, device=DEV)
    adv = dict(cursor=cur, state_batch_indices=sbi, x_cache=xc)
    for name in adv:
        with pytest.raises(ValueError, match=rf"^{name}: expected device {cur.device}, got {HOST}$"):
            cursor_ops.advance_cursor(**{**adv, name: adv[name].to(HOST)})
    com = dict(cursor=torch.zeros(4, 2, dtype=I32, device=DEV), n_accepted=torch.ones(3, dtype=I32, device=DEV),
               state_batch_indices=sbi, x_cache=xc)
    for name in com:
        with pytest.raises(ValueError, match=rf"^{name}: expected device {cur.device}, got {HOST}$"):
            cursor_ops.spec_commit(**{**com, name: com[name].to(HOST)}, num_tokens=T)


def test_unsupported_geometry_rejected_on_cuda():
    t = _cuda(decode_tensors(2, 3, 8, [0, 0, 0], seed=60))
    t["state_batch_indices"] = torch.tensor([0, 1], dtype=I32, device=DEV)
    for Pq in (32, 96):
        bad = {**t, "x": torch.zeros(2, H, Pq, dtype=BF, device=DEV), "z": None, "out": None,
               "state": torch.zeros(3, H, Pq, N, device=DEV), "x_cache": torch.zeros(3, H, 8, Pq, dtype=BF, device=DEV)}
        with pytest.raises(ValueError, match=rf"^x: headdim \(dim 2\) expected one of \(64, 80, 128\), got {Pq}$"):
            ops.replay_decode(**bad)
    for Nq in (16, 512):
        bad = {**t, "B": torch.zeros(2, G, Nq, dtype=BF, device=DEV), "C": torch.zeros(2, G, Nq, dtype=BF, device=DEV),
               "state": torch.zeros(3, H, P, Nq, device=DEV), "B_cache": torch.zeros(3, G, 8, Nq, dtype=BF, device=DEV)}
        with pytest.raises(ValueError, match=rf"^state: dstate \(dim 3\) expected one of \(64, 128, 256\), got {Nq}$"):
            ops.replay_decode(**bad)
    with pytest.raises(ValueError, match=r"^headdim: expected one of \(64, 80, 128\) on CUDA \(the kernels' geometries\), "
                                         r"got 32$"):
        ReplayStateCache(1, 2, H, 32, N, G, 8, num_draft=1, device=DEV)
    with pytest.raises(ValueError, match=r"^dstate: expected one of \(64, 128, 256\) on CUDA \(the kernels' geometries\), "
                                         r"got 16$"):
        ReplayStateCache(1, 2, H, P, 16, G, 8, num_draft=1, device=DEV)
    with pytest.raises(ValueError, match=r"^buffer_len: expected <= 32 on CUDA \(the kernels' rings\), got 40$"):
        ReplayStateCache(1, 2, H, P, N, G, 40, num_draft=1, device=DEV)
    ReplayStateCache(1, 2, H, P, N, G, 8, num_draft=1, device=DEV)  # a supported one


# ---- teeth ------------------------------------------------------------------------------------------------------------
def test_teeth_guard_check_and_comparison_catch_one_byte():
    g = Guarded()
    g.put("t", torch.zeros(64))
    g.check()
    g.bufs["t"][GUARD - 1] = 0
    with pytest.raises(AssertionError, match="t: 1 guard bytes before"):
        g.check()
    g.bufs["t"][GUARD - 1] = SENTINEL
    g.bufs["t"][-1] = 0
    with pytest.raises(AssertionError, match="t: 1 guard bytes after"):
        g.check()
    cpu = decode_tensors(4, 6, 8, [2, 3, 1, 0, 5, 4], seed=70)
    (t, _), (tc, _) = launch_bad_and_clean(ops.replay_decode, cpu, [0, 6, 1, -1], [0, -1, 1, -1])
    assert_same(t | {"state_batch_indices": tc["state_batch_indices"]}, tc)
    v = t["state"].view(torch.uint8)
    v[5, 0, 0, 0] = v[5, 0, 0, 0] ^ 1  # one bit of a slot no row uses
    with pytest.raises(AssertionError, match="state differs from the clean launch"):
        assert_same(t | {"state_batch_indices": tc["state_batch_indices"]}, tc)
    with pytest.raises(AssertionError, match=r"state: slots \[5\] changed"):
        assert_slots_unchanged(t, cpu, [5])
