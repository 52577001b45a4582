# SPDX-License-Identifier: Apache-2.0
"""Speculative-decoding kernels (plugins/mamba2/replayssm_spec.cu) against spec_reference, step by step.

Oracles:
- "mirror": :mod:`trtllm_replayssm.families.mamba2.spec_reference` in float64 on CPU copies of every cache, fed the
  very activation values the kernel sees: ``maybe_flush`` (with the new checkpoint rounded to the
  kernel's state dtype, which the kernel stores and computes the window from) then ``verify``, then
  ``commit``. This leaves only the kernel's fp32 arithmetic and the rounding of y to the activation
  dtype. The native baseline is mirrored the same way (snapshot rounded to the state dtype on commit).
- Bookkeeping exactly: cursors, the committed ring entries of x/B (copies of inputs, rtol = atol = 0),
  native commit = a bit copy of the snapshot, padding rows' y (NaN-poisoned output stays NaN), slots
  outside the batch bit-identical. Rings start as NaN: an entry outside the committed range that the
  kernel read would make y NaN.
- The standard kernels (ReplaySSM decode and the conventional step) fed the accepted tokens one at a
  time: equivalence of a verify + commit step with sequential decoding of the accepted prefix.
Tolerances (relative Frobenius norm over the valid rows), as tests/test_kernels_gpu.py:
- y in bf16: one rounding of 2^-9 relative per element -> 5e-3; f16 (2^-11) -> 2e-3; f32 with an
  f32 state -> 2e-5 (fp32 sums of <= dstate + L terms, exp/log1p in fp32).
- checkpoint after a flush, snapshots, native state: f32 -> 2e-5; bf16/f16 -> one storage rounding.
- dt_cache: fp32 softplus vs float64 on the same inputs -> 1e-5 relative per element.
- Shadow (bf16 / fp8-e4m3 copy of the f32 checkpoint, RSSM_SHADOW): after every flush the kernel's
  shadow must be bit-identical to ``shadow.Shadow.write`` of the f32 checkpoint it stored (bf16:
  one round-to-nearest-even; fp8: scale = max|row| / 448, q = S / scale, IEEE fp32 division and RNE),
  and slots that did not flush keep their shadow bit for bit. The mirror then reads that very shadow
  (spec_reference.verify(shadow=, flushed=)), so y keeps the tolerances above.
- equivalence (all fp32, three kernels with different summation orders and state roundings over
  ~100 tokens): 2e-5, the f32 y tolerance; a wrong weight or a missed entry is >= 1e-3.
"""

import zlib

import pytest
import torch

from trtllm_replayssm import cursor as cursors
from trtllm_replayssm import cursor_ops
from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.families.mamba2 import ops
from trtllm_replayssm.families.mamba2 import spec_reference as sr

from .helpers import check_shadow
from .problems import GEOMETRIES, make_params

pytestmark = pytest.mark.gpu
DEV = "cuda"
F64 = torch.float64
NAN = float("nan")
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
Y_TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3, torch.float32: 2e-5}
S_TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 2e-5}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bits(t):
    return t if t.dtype == torch.int32 else t.view(torch.uint8)


class SpecProblem:
    """Kernel-side state and rings on the device, float64 mirrors on the CPU, evolving together."""

    def __init__(self, geom, state, act, T, L, batch, slots, pad_rows=(), has_z=False, seed=0, shadow="none"):
        H, P, N, G = GEOMETRIES[geom] if isinstance(geom, str) else geom
        self.H, self.P, self.N, self.G, self.T, self.L = H, P, N, G, T, L
        self.sdt, self.act, self.has_z, self.batch = DT[state], DT[act], has_z, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.prm = make_params(H, self.gen, DEV)
        self.prm64 = [t.cpu().double() for t in (self.prm.dt_bias, self.prm.A, self.prm.D)]
        S0 = torch.randn(slots, H, P, N, generator=self.gen).to(self.sdt)
        self.state = S0.to(DEV)
        self.ref_state = S0.to(F64)
        self.shadow_kind = shadow
        self.ref_shadow = self.shadow = self.scale = None
        if shadow != "none":  # written at the hand-off, from the stored checkpoint
            self.ref_shadow = shadowq.Shadow.of(S0, shadow)
            self.shadow = self.ref_shadow.q.to(DEV, copy=True)
            self.scale = None if self.ref_shadow.scale is None else self.ref_shadow.scale.to(DEV, copy=True)
        # Rings start poisoned: entries outside the committed range must never be read.
        self.xc = torch.full((slots, H, L, P), NAN, dtype=self.act, device=DEV)
        self.Bc = torch.full((slots, G, L, N), NAN, dtype=self.act, device=DEV)
        self.dtc = torch.full((slots, H, L), NAN, device=DEV)
        self.ref_xc, self.ref_Bc, self.ref_dtc = (t.cpu().to(F64) for t in (self.xc, self.Bc, self.dtc))
        start = torch.randint(0, L, (slots,), generator=self.gen)  # any ring start: wrap-around from step 1
        cursor = torch.stack([start, torch.zeros_like(start)], dim=1).to(torch.int32)
        self.cursor, self.ref_cursor = cursor.to(DEV), cursor.clone()
        sbi = torch.randperm(slots, generator=self.gen)[:batch].to(torch.int32)
        sbi[list(pad_rows)] = -1
        self.sbi_cpu, self.sbi = sbi, sbi.to(DEV)
        self.valid = sbi >= 0
        self.used = sbi[self.valid].tolist()
        self.unused = sorted(set(range(slots)) - set(self.used))

    def window(self):
        """Random window inputs x, B, C, dt, z (batch, T, ...) in the activation dtype."""
        b, T, H, P, N, G = self.batch, self.T, self.H, self.P, self.N, self.G

        def rnd(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=self.gen) * scale + shift).to(self.act).to(DEV)

        x, B, C = rnd(b, T, H, P), rnd(b, T, G, N, scale=N ** -0.5 * 4), rnd(b, T, G, N, scale=N ** -0.5 * 4)
        dt = rnd(b, T, H, shift=-2.0)
        return x, B, C, dt, rnd(b, T, H, P) if self.has_z else None

    def accepted(self, step):
        """n_accepted in [1, T], with some rows 0 every 5th step and all T every 7th."""
        n = torch.randint(1, self.T + 1, (self.batch,), generator=self.gen, dtype=torch.int32)
        if step % 5 == 4:
            n[::2] = 0
        if step % 7 == 6:
            n[:] = self.T
        return n

    def snapshot_unused(self):
        extra = [t for t in (self.shadow, self.scale) if t is not None]
        return [t[self.unused].clone() for t in (self.state, self.xc, self.Bc, self.dtc, self.cursor, *extra)]

    def verify(self, inputs=None):
        """One verify launch and its mirror; returns (y, y_ref, flushed slots)."""
        x, B, C, dt, z = inputs or self.window()
        y = torch.full_like(x, NAN)
        before = self.cursor.clone()
        ops.replay_verify(x, B, C, dt, *self.prm_args(), self.state, self.xc, self.Bc, self.dtc, self.cursor,
                          self.sbi, z=z, out=y, shadow=self.shadow, shadow_scale=self.scale)
        assert torch.equal(self.cursor, before), "verify moved the cursor"
        cpu = [None if t is None else t.cpu().to(F64) for t in (x, B, C, dt, z)]
        A64 = self.prm64[1]
        flushed = sr.maybe_flush(self.ref_state, self.ref_xc, self.ref_Bc, self.ref_dtc, self.ref_cursor, A64, self.T,
                                 self.sbi_cpu, shadow=self.ref_shadow)
        for s in flushed:  # the kernel stores the new checkpoint in its state dtype and reads it back
            self.ref_state[s] = self.ref_state[s].to(self.sdt).to(F64)
            if self.shadow is not None:
                self.check_shadow(s)
        if self.shadow is not None:  # slots that did not flush keep their shadow, bit for bit
            for s in self.used:
                assert torch.equal(self.shadow[s].cpu().view(torch.uint8), self.ref_shadow.q[s].view(torch.uint8)), s
        y_ref = sr.verify(self.ref_state, self.ref_xc, self.ref_Bc, self.ref_dtc, self.ref_cursor, *cpu[:4],
                          *self.prm64, cpu[4], self.sbi_cpu, shadow=self.ref_shadow, flushed=flushed)
        return y, y_ref, flushed

    check_shadow = check_shadow  # tests/helpers.py

    def commit(self, n):
        cursor_ops.spec_commit(self.cursor, n.to(DEV), self.sbi, self.T, self.L)
        cursors.commit(self.ref_cursor, n, self.T, self.L, self.sbi_cpu)

    def prm_args(self):
        return self.prm.dt_bias, self.prm.A, self.prm.D

    def check_y(self, y, y_ref, tol=None):
        v = self.valid.to(DEV)
        assert torch.isnan(y[~v]).all(), "padding rows' output was written"
        assert not torch.isnan(y[v]).any(), "some outputs were not written (or read a poisoned ring entry)"
        err = rel(y[v].cpu(), y_ref[self.valid])
        assert err < (tol or Y_TOL[self.act]), f"y relative error {err:.3e}"
        return err

    def check_rings(self):
        assert torch.equal(self.cursor.cpu(), self.ref_cursor), (self.cursor.cpu(), self.ref_cursor)
        for s in self.used:
            start, count = (int(v) for v in self.ref_cursor[s])
            idx = (start + torch.arange(count)) % self.L
            assert torch.equal(self.xc[s][:, idx.to(DEV)].cpu().to(F64), self.ref_xc[s][:, idx])
            assert torch.equal(self.Bc[s][:, idx.to(DEV)].cpu().to(F64), self.ref_Bc[s][:, idx])
            torch.testing.assert_close(self.dtc[s][:, idx.to(DEV)].cpu().double(), self.ref_dtc[s][:, idx], rtol=1e-5, atol=0)

    def check_state(self, slots):
        for s in slots:
            err = rel(self.state[s].cpu(), self.ref_state[s])
            assert err < S_TOL[self.sdt], f"checkpoint of slot {s}: relative error {err:.3e}"


BASE = dict(geom="tiny", state="f32", act="bf16", T=4, L=16, batch=3, slots=5, pad_rows=(1,), has_z=False)
CASES = [
    BASE,
    {**BASE, "T": 2, "L": 8},
    {**BASE, "T": 8, "L": 16},  # count + 2T > L whenever count > 0: a flush almost every step
    {**BASE, "T": 8, "L": 32},
    {**BASE, "T": 6, "L": 16},
    {**BASE, "T": 4, "L": 12},  # L neither a power of two nor a multiple of T: every ring offset
    {**BASE, "T": 1, "L": 4},  # standard decode on the ring
    {**BASE, "act": "f16"},
    {**BASE, "act": "f32"},
    {**BASE, "state": "bf16"},
    {**BASE, "has_z": True},
    {**BASE, "pad_rows": ()},
    {**BASE, "batch": 1, "slots": 2, "pad_rows": ()},
    {**BASE, "geom": (8, 64, 128, 2), "T": 2, "L": 8},
    {**BASE, "geom": (8, 64, 128, 2), "batch": 6, "slots": 8, "pad_rows": (2,)},  # batch > 4: 8 rows a thread
    {**BASE, "geom": "nemotron_h_8b", "batch": 6, "slots": 8},
    {**BASE, "geom": "nano_9b_v2", "T": 2, "L": 8},
    {**BASE, "geom": "h_56b", "T": 8, "L": 16},
    {**BASE, "geom": "nemotron_h_8b", "state": "bf16", "T": 8, "L": 16, "has_z": True, "batch": 6, "slots": 8,
     "pad_rows": (0, 3)},
    {**BASE, "geom": "nemotron3_nano", "batch": 6, "slots": 8},  # Nemotron 3 Nano 30B-A3B Mamba layer
    {**BASE, "geom": "nemotron3_super", "T": 2, "L": 8},
]
STEPS = 40


def _id(c):
    return ",".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v) or "base"


def run_and_check(pb):
    """STEPS verify + commit steps, each checked against the mirror; several flushes per slot, unused slots untouched."""
    before = pb.snapshot_unused()
    flushes = 0
    for step in range(STEPS):
        y, y_ref, flushed = pb.verify()
        pb.check_y(y, y_ref)
        pb.check_state(flushed)
        flushes += len(flushed)
        pb.commit(pb.accepted(step))
        pb.check_rings()
    assert flushes >= 3 * len(pb.used), flushes
    for now, then in zip(pb.snapshot_unused(), before):
        assert torch.equal(bits(now), bits(then))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_verify_and_commit_match_spec_reference(case):
    pb = SpecProblem(**case, seed=zlib.crc32(_id(case).encode()))
    run_and_check(pb)


def test_teeth_corrupted_committed_entry_fails_the_comparison():
    pb = SpecProblem(**BASE, seed=7)
    full = torch.full((pb.batch,), pb.T, dtype=torch.int32)
    for _ in range(2):  # count = 2T = 8 afterwards: no flush at the next step (8 + 8 = 16 = L)
        pb.check_y(*pb.verify()[:2])
        pb.commit(full)
    s = pb.used[0]
    start, count = (int(v) for v in pb.ref_cursor[s])
    pb.xc[s, :, (start + count - 1) % pb.L] += 8.0  # the newest committed entry; the mirror keeps the true values
    y, y_ref, _ = pb.verify()
    with pytest.raises(AssertionError):
        pb.check_y(y, y_ref)


def test_equivalent_to_sequential_decoding_of_the_accepted_prefix():
    """Verify + commit of n tokens gives, for positions t < n, the outputs of the standard ReplaySSM
    kernel and of the conventional kernel fed the accepted tokens one at a time (all fp32)."""
    pb = SpecProblem(geom=(8, 64, 128, 2), state="f32", act="f32", T=4, L=16, batch=3, slots=5, pad_rows=(1,), seed=21)
    L_std = 16
    slots = pb.state.shape[0]
    st_r, st_c = pb.state.clone(), pb.state.clone()
    xc_r = torch.full((slots, pb.H, L_std, pb.P), NAN, device=DEV)
    Bc_r = torch.full((slots, pb.G, L_std, pb.N), NAN, device=DEV)
    dtc_r = torch.full((slots, pb.H, L_std), NAN, device=DEV)
    cur_r = torch.zeros(slots, dtype=torch.int32, device=DEV)
    compared = 0
    for step in range(STEPS):
        x, B, C, dt, z = pb.window()
        y, _, _ = pb.verify((x, B, C, dt, z))
        n = pb.accepted(step)
        pb.commit(n)
        for t in range(pb.T):
            take = pb.valid & (n > t)
            sbi_t = torch.where(take, pb.sbi_cpu, torch.full_like(pb.sbi_cpu, -1)).to(DEV)
            xt, Bt, Ct, dtt = (v[:, t].contiguous() for v in (x, B, C, dt))
            y_r = torch.full_like(xt, NAN)
            ops.replay_decode(xt, Bt, Ct, dtt, *pb.prm_args(), st_r, xc_r, Bc_r, dtc_r, cur_r, sbi_t, out=y_r)
            cursor_ops.advance_cursor(cur_r, sbi_t, L_std)
            y_c = torch.full_like(xt, NAN)
            ops.conventional_step(xt, Bt, Ct, dtt, *pb.prm_args(), st_c, sbi_t, out=y_c)
            if take.any():
                k = take.to(DEV)
                assert rel(y[:, t][k], y_r[k]) < Y_TOL[torch.float32], (step, t, "replay")
                assert rel(y[:, t][k], y_c[k]) < Y_TOL[torch.float32], (step, t, "conventional")
                compared += int(take.sum())
    assert compared >= STEPS * len(pb.used)


SHADOW_CASES = [
    {**BASE, "shadow": "bf16"},
    {**BASE, "shadow": "fp8"},
    {**BASE, "shadow": "fp8", "T": 8, "L": 16, "has_z": True, "act": "f16"},  # a flush almost every step
    {**BASE, "shadow": "bf16", "T": 2, "L": 8, "act": "f32"},
    {**BASE, "shadow": "fp8", "T": 4, "L": 12, "act": "f32"},
    {**BASE, "shadow": "fp8", "geom": (8, 64, 128, 2), "batch": 6, "slots": 8, "pad_rows": (2,)},  # 8 rows a thread
    {**BASE, "shadow": "fp8", "geom": (4, 80, 256, 2), "batch": 1, "slots": 2, "pad_rows": ()},  # 10 rows a block
    {**BASE, "shadow": "bf16", "geom": "nano_9b_v2", "T": 2, "L": 8},
    {**BASE, "shadow": "fp8", "geom": "nemotron_h_8b", "batch": 6, "slots": 8},
    {**BASE, "shadow": "bf16", "geom": "h_56b", "T": 8, "L": 32, "has_z": True},
]


def _shid(c):
    return ",".join(f"{k}={v}" for k, v in c.items() if BASE.get(k, "none") != v)


@pytest.mark.parametrize("case", SHADOW_CASES, ids=_shid)
def test_verify_with_shadow_matches_spec_reference(case):
    """Non-flush steps read the shadow, flushes rewrite it exactly (Shadow.write of the stored f32
    checkpoint); 40 steps crossing several flushes per slot, bookkeeping exact."""
    pb = SpecProblem(**case, seed=zlib.crc32(_shid(case).encode()))
    run_and_check(pb)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_shadow_is_what_the_window_reads(kind):
    """Teeth: on a step without a flush, perturbing the f32 checkpoint leaves y bit-identical (the kernel
    reads the shadow) and perturbing the shadow moves y beyond the tolerance."""
    twins = [SpecProblem(**{**BASE, "shadow": kind}, seed=31) for _ in range(3)]
    full = torch.full((BASE["batch"],), BASE["T"], dtype=torch.int32)
    for pb in twins:  # identical histories; count = T afterwards, so the next step does not flush (T + 2T <= L)
        pb.check_y(*pb.verify()[:2])
        pb.commit(full)
    s = twins[0].used[0]
    twins[1].state[s] += 1.0
    twins[2].shadow[s] = (twins[2].shadow[s].float() * 0.5).to(twins[2].shadow.dtype)  # halved (fp8: to rounding)

    def launch(pb, inputs):
        x, B, C, dt, z = inputs
        y = torch.full_like(x, NAN)
        ops.replay_verify(x, B, C, dt, *pb.prm_args(), pb.state, pb.xc, pb.Bc, pb.dtc, pb.cursor, pb.sbi, z=z,
                          out=y, shadow=pb.shadow, shadow_scale=pb.scale)
        return y

    inputs = twins[0].window()
    y0, y_ref, flushed = twins[0].verify(inputs)
    assert not flushed
    twins[0].check_y(y0, y_ref)
    assert torch.equal(bits(launch(twins[1], inputs)), bits(y0))
    with pytest.raises(AssertionError, match="y relative error"):
        twins[0].check_y(launch(twins[2], inputs), y_ref)


class NativeProblem(SpecProblem):
    def __init__(self, **kw):
        super().__init__(**kw)
        slots = self.state.shape[0]
        self.snaps = torch.full((slots, self.T, self.H, self.P, self.N), NAN, dtype=self.sdt, device=DEV)
        self.ref_snaps = self.snaps.cpu().to(F64)

    def step(self, n):
        x, B, C, dt, z = self.window()
        y = torch.full_like(x, NAN)
        ops.native_spec_verify(x, B, C, dt, *self.prm_args(), self.state, self.snaps, self.sbi, z=z, out=y)
        cpu = [None if t is None else t.cpu().to(F64) for t in (x, B, C, dt, z)]
        y_ref = sr.native_spec_verify(self.ref_state, self.ref_snaps, *cpu[:4], *self.prm64, cpu[4], self.sbi_cpu)
        self.check_y(y, y_ref)
        for s in self.used:
            for t in range(self.T):
                err = rel(self.snaps[s, t].cpu(), self.ref_snaps[s, t])
                assert err < S_TOL[self.sdt], f"snapshot {t} of slot {s}: relative error {err:.3e}"
        state_before = self.state.clone()
        cursor_ops.native_spec_commit(self.state, self.snaps, n.to(DEV), self.sbi)
        cursors.native_spec_commit(self.ref_state, self.ref_snaps, n, self.sbi_cpu)
        for b, s in enumerate(self.sbi_cpu.tolist()):
            if s < 0:
                continue
            k = int(n[b])
            want = self.snaps[s, k - 1] if k else state_before[s]
            assert torch.equal(bits(self.state[s]), bits(want)), f"slot {s}: state is not snapshot {k - 1}"
            self.ref_state[s] = self.ref_state[s].to(self.sdt).to(F64)  # the kernel keeps the stored snapshot
        self.check_state(self.used)

    def snapshot_unused(self):
        return [t[self.unused].clone() for t in (self.state, self.snaps)]


NATIVE_CASES = [BASE, {**BASE, "T": 2, "L": 8}, {**BASE, "T": 8, "has_z": True}, {**BASE, "state": "bf16"},
                {**BASE, "act": "f32"}, {**BASE, "geom": "nemotron_h_8b", "batch": 6, "slots": 8}]


@pytest.mark.parametrize("case", NATIVE_CASES, ids=_id)
def test_native_spec_matches_spec_reference(case):
    pb = NativeProblem(**case, seed=1 + zlib.crc32(_id(case).encode()))
    before = pb.snapshot_unused()
    for _ in range(12):
        pb.step(torch.randint(0, pb.T + 1, (pb.batch,), generator=pb.gen, dtype=torch.int32))
    for now, then in zip(pb.snapshot_unused(), before):
        assert torch.equal(bits(now), bits(then))


def test_graph_replay_equals_eager():
    """verify + commit captured once in a CUDA graph (host checks skipped) and replayed, bit-identical
    to eager launches on a twin problem."""
    eager = SpecProblem(**BASE, seed=5)
    graphed = SpecProblem(**BASE, seed=5)
    static = [torch.empty_like(t) for t in graphed.window()[:4]]
    n_static = torch.zeros(graphed.batch, dtype=torch.int32, device=DEV)
    y_static = torch.full_like(static[0], NAN)

    def step():
        ops.replay_verify(*static, *graphed.prm_args(), graphed.state, graphed.xc, graphed.Bc, graphed.dtc,
                          graphed.cursor, graphed.sbi, out=y_static)
        cursor_ops.spec_commit(graphed.cursor, n_static, graphed.sbi, graphed.T, graphed.L)

    # Warm-up on scratch copies (compiles and loads the module), then capture.
    saved = [t.clone() for t in (graphed.state, graphed.xc, graphed.Bc, graphed.dtc, graphed.cursor)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for t, v in zip((graphed.state, graphed.xc, graphed.Bc, graphed.dtc, graphed.cursor), saved):
        t.copy_(v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for s in range(12):
        inputs = eager.window()
        y, _, _ = eager.verify(inputs)
        n = eager.accepted(s)
        eager.commit(n)
        for dst, src in zip(static, inputs[:4]):
            dst.copy_(src)
        n_static.copy_(n)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(y_static), bits(y)), s
        assert torch.equal(graphed.cursor, eager.cursor), s
        assert torch.equal(bits(graphed.state), bits(eager.state)), s


def test_values_rejected_on_the_host_and_clamped_on_the_device():
    pb = SpecProblem(**BASE, seed=3)
    x, B, C, dt, _ = pb.window()
    args = (x, B, C, dt, *pb.prm_args(), pb.state, pb.xc, pb.Bc, pb.dtc)
    s = pb.used[0]
    with pytest.raises(ValueError, match="more than one row"):
        ops.replay_verify(*args, pb.cursor, torch.tensor([s, s, -1], dtype=torch.int32, device=DEV))
    bad = pb.cursor.clone()
    bad[s, 1] = pb.L - pb.T + 1
    with pytest.raises(ValueError, match=r"cursor: expected count \(column 1\) in \[0, L - T\]"):
        ops.replay_verify(*args, bad, pb.sbi)
    bad = pb.cursor.clone()
    bad[s, 0] = pb.L
    with pytest.raises(ValueError, match=r"cursor: expected start \(column 0\)"):
        cursor_ops.spec_commit(bad, torch.ones(pb.batch, dtype=torch.int32, device=DEV), pb.sbi, pb.T, pb.L)
    with pytest.raises(ValueError, match=r"n_accepted: expected values in \[0, T\] = \[0, 4\]"):
        cursor_ops.spec_commit(pb.cursor, torch.full((pb.batch,), pb.T + 1, dtype=torch.int32, device=DEV), pb.sbi, pb.T, pb.L)
    # Unchecked (as under graph capture): n is clamped to [0, T] on the device.
    cur = pb.cursor.clone()
    n = torch.tensor([pb.T + 3, 2, -2], dtype=torch.int32, device=DEV)
    cursor_ops.spec_commit(cur, n, pb.sbi, pb.T, pb.L, check_values=False)
    want = pb.cursor.clone()
    for b, sl in enumerate(pb.sbi_cpu.tolist()):
        if sl >= 0:
            want[sl, 1] += min(max(int(n[b]), 0), pb.T)
    assert torch.equal(cur, want)
    # A corrupt cursor (unchecked): NaN outputs for that row, nothing of the slot written.
    bad = pb.cursor.clone()
    bad[s, 1] = pb.L
    keep = [t[s].clone() for t in (pb.state, pb.xc, pb.Bc, pb.dtc)]
    y = torch.zeros_like(x)
    ops.replay_verify(*args, bad, pb.sbi, out=y, check_values=False)
    row = pb.sbi_cpu.tolist().index(s)
    assert torch.isnan(y[row]).all()
    for t, k in zip((pb.state, pb.xc, pb.Bc, pb.dtc), keep):
        assert torch.equal(bits(t[s]), bits(k))
