# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache on CUDA (the kernels) against a float64 ReplayStateCache on the CPU, step by step.

Both caches run the same sequence (flush, verify and conv_update of every layer, commit) on the same
requests: continuous batching through a few slots (requests allocated, freed, recycled; some start
from a prefill hand-off, some from zeros), one padding row at a moving position, random acceptance.

Oracles:
- "mirror": the CPU cache (the float64 reference executor; activations and dt ring float64) fed the very
  activation values the CUDA cache sees (bf16 / f32 inputs widened), with an f32 checkpoint as the CUDA
  cache's: both folds store the f32 checkpoint and compute the window from it (the reference folds in
  float64 and rounds once on the store) and, with a shadow,
  ``read_shadow=True`` and the CUDA cache's shadow copied in after every step, once checked (below).
  What is left is the kernels' fp32 arithmetic and the rounding of the outputs: the tolerances of
  tests/test_spec_gpu.py.
- Bookkeeping exactly (rtol = atol = 0): cursors; the rings' x and B entries of live slots (copies of
  the inputs, written at the same ring indices by both paths, rejected entries included); conv windows
  (copies of inputs and zeros); a recycled slot reads zeros (fp8 scales 1) before its hand-off; free
  slots bit-identical across a step; padding rows' outputs untouched (NaN-poisoned y stays NaN, conv
  outputs NaN). Shadow: after a flush bit-identical to ``shadow.Shadow.write`` of the f32 checkpoint
  the kernel stored; slots that did not flush keep theirs bit for bit.
Tolerances (relative Frobenius norm over the rows with a slot):
- y: bf16 5e-3 (one rounding of 2^-9 per element), f32 2e-5 (fp32 sums of <= dstate + L terms).
- conv outputs: the same (fp32 sums of K = 4 terms and a sigmoid, rounded to the activation dtype).
- checkpoints of live slots: 2e-5 (f32 fold of <= L entries vs float64 from the same f32 checkpoint).
- dt ring: fp32 softplus vs float64 on the same inputs, 1e-5 per element.
"""

import zlib

import pytest
import torch

from trtllm_replayssm import shadow as shadowq
from trtllm_replayssm.cache import ReplayStateCache

from .problems import GEOMETRIES, make_params

pytestmark = pytest.mark.gpu
DEV = "cuda"
F64 = torch.float64
NAN = float("nan")
DT = {"f32": torch.float32, "bf16": torch.bfloat16}
SHADOWS = {"none": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
TOL = {torch.bfloat16: 5e-3, torch.float32: 2e-5}
K = 4


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bits(t):
    """Bit patterns of a float tensor (NaN == NaN, -0 != 0); integers as they are."""
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t  # views of the caches are strided


class CacheProblem:
    """A CUDA cache and its float64 CPU mirror, fed the same requests, windows and acceptances."""

    def __init__(self, geom, act, T, L, layers, slots, shadow, has_z=False, check_values=None, cursor="ring", seed=0):
        H, P, N, G = GEOMETRIES[geom] if isinstance(geom, str) else geom
        self.H, self.P, self.N, self.G, self.T, self.L, self.layers = H, P, N, G, T, L, layers
        self.act, self.has_z, self.shadow_kind = DT[act], has_z, shadow
        geo = dict(num_layers=layers, num_slots=slots, nheads=H, headdim=P, dstate=N, ngroups=G, buffer_len=L,
                   num_draft=T - 1, conv_kernel=K, shadow_dtype=SHADOWS[shadow], cursor=cursor)
        self.dev = ReplayStateCache(**geo, state_dtype=torch.float32, act_dtype=self.act, dt_dtype=torch.float32,
                                    device=DEV, check_values=check_values)
        self.cpu = ReplayStateCache(**geo, state_dtype=torch.float32, act_dtype=F64, dt_dtype=F64, device="cpu",
                                    read_shadow=shadow != "none")
        self.gen = torch.Generator().manual_seed(seed)
        self.prm = [make_params(H, self.gen) for _ in range(layers)]  # f32 on the CPU
        Dc = self.cpu.conv_dim
        self.weights = [(torch.randn(Dc, K, generator=self.gen) * 0.5, torch.randn(Dc, generator=self.gen) * 0.1)
                        for _ in range(layers)]
        self.live = {}  # slot -> steps left
        self.flushes = self.recycled = 0
        self.used = set()

    # ---- requests -------------------------------------------------------------------------------------
    def admit(self):
        while self.dev.num_free:
            s = self.dev.allocate()
            assert self.cpu.allocate() == s
            self.check_fresh(s)
            self.recycled += s in self.used
            self.used.add(s)
            if int(torch.randint(0, 3, (1,), generator=self.gen)):  # 2 in 3 requests hand off a prefill
                for l in range(self.layers):
                    S = torch.randn(self.H, self.P, self.N, generator=self.gen)
                    conv = torch.randn(self.cpu.conv_dim, K - 1, generator=self.gen).to(self.act)
                    self.dev.load_prefill(s, l, S.to(DEV), conv.to(DEV))
                    self.cpu.load_prefill(s, l, S.double(), conv.double())
            self.live[s] = int(torch.randint(3, 13, (1,), generator=self.gen))

    def check_fresh(self, s):
        """A (re)allocated slot reads zeros everywhere (fp8 scales 1), cursor (0, 0)."""
        for t in self.dev._tensors():
            want = 1.0 if t is self.dev.shadow_scale else 0.0
            assert (t[:, s].float() == want).all(), f"slot {s}: stale values survived the reset"
        assert not self.dev.cursor[s].any()

    def retire(self, rows):
        for s in rows:
            if s < 0:
                continue
            self.live[s] -= 1
            if not self.live[s]:
                del self.live[s]
                self.dev.free(s)
                self.cpu.free(s)

    # ---- one model step ------------------------------------------------------------------------------------
    def rnd(self, *shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=self.gen) * scale + shift).to(self.act)

    def step(self, step):
        T, H, P, N, G = self.T, self.H, self.P, self.N, self.G
        rows = list(self.live)
        rows = [rows[i] for i in torch.randperm(len(rows), generator=self.gen).tolist()]
        rows.insert(step % (len(rows) + 1), -1)  # one padding row, at a moving position
        batch = len(rows)
        sbi = torch.tensor(rows, dtype=torch.int32)
        sbi_d, valid = sbi.to(DEV), sbi >= 0
        free = [s for s in range(self.dev.num_slots) if s not in self.live]
        free_before = [bits(t[:, free].clone()) for t in self.dev._tensors()] + [self.dev.cursor[free].clone()]
        shadow_before = None if self.dev.shadow is None else self.dev.shadow.clone()

        flushed = self.cpu.flush(sbi, T, [p.A.double() for p in self.prm])
        self.flushes += len(flushed)
        assert self.dev.flush(sbi_d, T, [p.A.to(DEV) for p in self.prm]) is None
        for l in range(self.layers):
            p = self.prm[l]
            x, B, C = self.rnd(batch, T, H, P), self.rnd(batch, T, G, N, scale=N ** -0.5 * 4), \
                self.rnd(batch, T, G, N, scale=N ** -0.5 * 4)
            dt, z = self.rnd(batch, T, H, shift=-2.0), self.rnd(batch, T, H, P) if self.has_z else None
            u = self.rnd(batch, T, self.cpu.conv_dim)
            y = torch.full((batch, T, H, P), NAN, dtype=self.act, device=DEV)
            self.dev.verify(l, x.to(DEV), B.to(DEV), C.to(DEV), dt.to(DEV), p.dt_bias.to(DEV), p.A.to(DEV),
                            p.D.to(DEV), None if z is None else z.to(DEV), sbi_d, out=y)
            y_ref = self.cpu.verify(l, x.double(), B.double(), C.double(), dt.double(), p.dt_bias.double(),
                                    p.A.double(), p.D.double(), None if z is None else z.double(), sbi)
            self.check_out(y, y_ref, valid, f"y of layer {l}")
            w, b = self.weights[l]
            o = self.dev.conv_update(l, u.to(DEV), w.to(DEV), b.to(DEV), sbi_d)
            o_ref = self.cpu.conv_update(l, u.double(), w.double(), b.double(), sbi)
            self.check_out(o, o_ref, valid, f"conv output of layer {l}")
        n = torch.randint(1, T + 1, (batch,), generator=self.gen, dtype=torch.int32)
        if step % 4 == 3:
            n[:] = T  # full acceptance: the count climbs to the flush
        self.dev.commit(sbi_d, n.to(DEV), T)
        self.cpu.commit(sbi, n, T)

        self.check_bookkeeping([s for s in rows if s >= 0], flushed, shadow_before)
        now = [bits(t[:, free]) for t in self.dev._tensors()] + [self.dev.cursor[free]]
        for a, b in zip(now, free_before):
            assert torch.equal(a, b), "a free slot was written"
        self.retire(rows)

    # ---- checks ------------------------------------------------------------------------------------------------
    def check_out(self, got, want, valid, what):
        v = valid.to(got.device)
        assert torch.isnan(got[~v]).all(), f"{what}: padding rows were written"
        assert not torch.isnan(got[v]).any(), f"{what}: rows with a slot were not all written"
        err = rel(got[v].cpu(), want[valid])
        assert err < TOL[self.act], f"{what}: relative error {err:.3e}"

    def check_bookkeeping(self, slots, flushed, shadow_before):
        dev, cpu = self.dev, self.cpu
        assert torch.equal(dev.cursor.cpu(), cpu.cursor), "cursors differ"
        for s in slots:
            assert torch.equal(dev.x_cache[:, s].cpu().double(), cpu.x_cache[:, s]), f"x ring of slot {s}"
            assert torch.equal(dev.B_cache[:, s].cpu().double(), cpu.B_cache[:, s]), f"B ring of slot {s}"
            torch.testing.assert_close(dev.dt_cache[:, s].cpu().double(), cpu.dt_cache[:, s], rtol=1e-5, atol=0)
            assert torch.equal(dev.conv[:, s].cpu().double(), cpu.conv[:, s]), f"conv window of slot {s}"
            for l in range(self.layers):
                err = rel(dev.state[l, s].cpu(), cpu.state[l, s])
                assert err < 2e-5, f"checkpoint of layer {l}, slot {s}: relative error {err:.3e}"
            if dev.shadow is not None:
                self.check_shadow(s, s in flushed, shadow_before)

    def check_shadow(self, s, flushed, before):
        """After a flush: Shadow.write of the f32 checkpoint the kernel stored, bit for bit; else unchanged.
        Then the mirror takes the CUDA cache's shadow (what the kernels read next)."""
        dev, cpu = self.dev, self.cpu
        for l in range(self.layers):
            got = dev.shadow[l, s].cpu()
            if flushed:
                want = shadowq.Shadow(1, self.H, self.P, self.N, self.shadow_kind)
                want.write(0, dev.state[l, s].cpu())
                bad = int((bits(got) != bits(want.q[0])).sum())
                assert bad == 0, f"shadow of layer {l}, slot {s}: {bad} elements differ from Shadow.write"
                if dev.shadow_scale is not None:
                    assert torch.equal(dev.shadow_scale[l, s].cpu(), want.scale[0]), f"fp8 scales, layer {l}, slot {s}"
            else:
                assert torch.equal(bits(got), bits(before[l, s].cpu())), f"shadow of layer {l}, slot {s} written"
            cpu.shadow[l, s] = got
            if dev.shadow_scale is not None:
                cpu.shadow_scale[l, s] = dev.shadow_scale[l, s].cpu()


BASE = dict(geom="tiny", act="bf16", T=4, L=16, layers=2, slots=4, shadow="none", has_z=False, check_values=None,
            cursor="ring")
CASES = [
    BASE,
    {**BASE, "shadow": "bf16"},
    {**BASE, "shadow": "fp8"},
    {**BASE, "shadow": "fp8", "T": 8, "has_z": True},  # count + 2T > L whenever count > 0
    {**BASE, "shadow": "bf16", "act": "f32", "T": 2, "L": 8, "check_values": False},  # eager without host checks
    {**BASE, "T": 1, "L": 4},  # num_draft = 0: standard decode on the ring
    {**BASE, "T": 1, "L": 4, "cursor": "standard", "shadow": "bf16", "has_z": True},  # the standard decode kernel
    {**BASE, "T": 1, "L": 6, "cursor": "standard", "shadow": "fp8", "geom": "nemotron_h_8b", "layers": 1,
     "slots": 3},
    {**BASE, "shadow": "fp8", "T": 4, "L": 12, "slots": 3},
    {**BASE, "shadow": "fp8", "geom": "nemotron_h_8b", "layers": 1, "slots": 3},
]
STEPS = 48


def _id(c):
    return ",".join(f"{k}={v}" for k, v in c.items() if BASE[k] != v) or "base"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_cuda_cache_matches_float64_cache(case):
    pb = CacheProblem(**case, seed=zlib.crc32(_id(case).encode()))
    for step in range(STEPS):
        pb.admit()
        pb.step(step)
    assert pb.recycled >= 3, pb.recycled
    assert pb.flushes >= (6 if case["T"] > 1 else 3), pb.flushes


def test_cache_step_in_a_cuda_graph_equals_eager():
    """flush + verify + conv_update of every layer + commit captured once (host checks off while capturing)
    and replayed: bit-identical to an eager twin run without host checks."""
    T, layers = 4, 2
    twins = [CacheProblem(**{**BASE, "shadow": "fp8", "check_values": cv}, seed=77) for cv in (None, False)]
    for pb in twins:
        pb.admit()
    graphed, eager = (pb.dev for pb in twins)
    pb = twins[0]
    slots = sorted(pb.live)
    sbi = torch.tensor([slots[0], -1, *slots[1:]], dtype=torch.int32, device=DEV)
    batch, H, P, N, G, Dc = sbi.shape[0], pb.H, pb.P, pb.N, pb.G, graphed.conv_dim
    prm = [[t.to(DEV) for t in (p.dt_bias, p.A, p.D)] for p in pb.prm]
    wts = [[t.to(DEV) for t in w] for w in pb.weights]

    def fresh_inputs():
        return [[pb.rnd(batch, T, H, P).to(DEV), pb.rnd(batch, T, G, N, scale=N ** -0.5 * 4).to(DEV),
                 pb.rnd(batch, T, G, N, scale=N ** -0.5 * 4).to(DEV), pb.rnd(batch, T, H, shift=-2.0).to(DEV),
                 pb.rnd(batch, T, Dc).to(DEV)] for _ in range(layers)]

    def step(cache, inputs, n, ys):
        cache.flush(sbi, T, [p[1] for p in prm])
        outs = []
        for l in range(layers):
            x, B, C, dt, u = inputs[l]
            cache.verify(l, x, B, C, dt, *prm[l], None, sbi, out=ys[l])
            outs.append(cache.conv_update(l, u, *wts[l], sbi))
        cache.commit(sbi, n, T)
        return outs

    def tensors(cache):
        return cache._tensors() + [cache.cursor]

    static = fresh_inputs()
    n_static = torch.full((batch,), T, dtype=torch.int32, device=DEV)
    y_static = [torch.full((batch, T, H, P), NAN, dtype=pb.act, device=DEV) for _ in range(layers)]
    saved = [t.clone() for t in tensors(graphed)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and loads the kernels outside the capture
        step(graphed, static, n_static, y_static)
    torch.cuda.current_stream().wait_stream(side)
    for t, v in zip(tensors(graphed), saved):
        t.copy_(v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_static = step(graphed, static, n_static, y_static)
    y_eager = [torch.full_like(y, NAN) for y in y_static]
    for i in range(12):
        inputs = fresh_inputs()
        n = torch.randint(1, T + 1, (batch,), generator=pb.gen, dtype=torch.int32).to(DEV)
        o_eager = step(eager, inputs, n, y_eager)
        for dst, src in zip(sum(static, []), sum(inputs, [])):
            dst.copy_(src)
        n_static.copy_(n)
        g.replay()
        torch.cuda.synchronize()
        for a, b in zip(y_static + o_static, y_eager + o_eager):
            assert torch.equal(bits(a), bits(b)), i
        for a, b in zip(tensors(graphed), tensors(eager)):
            assert torch.equal(bits(a), bits(b)), i
    assert not torch.equal(graphed.state, saved[0])  # flushes happened in the replays
