# SPDX-License-Identifier: Apache-2.0
"""fp32 fidelity after a dt spike (issue 39 §4; bench/NOTES.md "fp32 exponents after a dt spike").

The replay kernels weigh buffer entry j by dt_j exp(A (sum of the dt after j)). They used to form that exponent
as A (c_total - c_j) from a warp-wide running (prefix) sum c of dt. After a large dt (raw dt past softplus's
threshold of 20, so processed dt of 24..100) both prefix sums are large, their difference loses ~ulp(sum dt)
and every weight that survives the spike carries a relative error of ~|A| ulp(sum dt) (1e-4 at |A| = 16): fp32
checkpoints then sit ~1e-4 (relative Frobenius per head; up to ~1e-3 of the head's std element-wise) from
float64 where the rest of the fp32 path is at ~3e-7. The kernels now form every exponent as a suffix sum (a
reverse warp scan from the newest entry backwards; in the verify window, the window's dt added one by one),
a sum of like-signed terms exact to a few ulp of itself. Gated DeltaNet formed its replay weights exp(G_m - G_j)
and its window decays exp(Γ_t - Γ_s) the same way from its per-head log gate g; fixed there too (its flush is
the exact per-entry recurrence, so there the spike reached y and the cached u_j, not the checkpoint).

CPU (always): an fp32 emulation of both exponent forms, written after the kernels' arithmetic (the Hillis-Steele
shuffle scans, the order of the sums, fp32 exp), feeds dt spikes through the Mamba-2 flush / output form, the
speculative fold and window, and the GDN history weights and window decays, against the float64 references
(:func:`trtllm_replayssm.families.mamba2.reference.buffer_weights`, the spec) fed the same fp32 dt. Bound: the no-spike level of
fp32 (:data:`FP32_LEVEL`, relative Frobenius error per head); teeth: the old prefix-difference form exceeds it
several times over on the same inputs.

GPU (``-m gpu``): the same spikes through the real kernels (ops / gdn_ops) against the float64 mirrors of the
existing GPU tests, fp32 state and activations: the standard decode crossing three flushes (every decode kernel:
planned, one-shot, persistent, staged, staged with bulk copies), the speculative verify crossing three folds,
GDN standard decode and GDN verify. Each runs beside a twin problem drawing the same inputs without the spikes
(the no-spike level of that very card and kernel); the spiked run's worst error must stay within
:data:`TWIN_FACTOR` of the twin's (floors :data:`FP32_FLOOR`, :data:`Y_FLOOR`): checkpoints per head, outputs
(and GDN's cached u_j) over all rows of a step (:func:`global_err` says why), and the Mamba-2 flushes and folds
also check that the emulated old form, on their own inputs, would have broken that bound.

Run the GPU part: ``python -m pytest -m gpu tests/test_dt_spike.py``. On the kernels before this change
(``git checkout <parent> -- plugins/``) the Mamba-2 GPU tests fail on the checkpoint (~1e-4 vs ~3e-7) and the
GDN ones on y (measured with fp32 stand-in kernels on the CPU: 6e-5 vs 3e-7).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from trtllm_replayssm import config
from trtllm_replayssm import cursor as cursors
from trtllm_replayssm.families.mamba2 import reference as ref

from .test_gdn_gpu import Problem as GDNProblem
from .test_gdn_spec_gpu import SpecProblem as GDNSpecProblem
from .test_kernels_gpu import Problem as DecodeProblem
from .test_spec_gpu import SpecProblem

F32, F64 = torch.float32, torch.float64
FORMS = ("prefix", "suffix")  # the old kernels' exponents, the new ones
# The no-spike level of fp32: relative Frobenius error per head of a flushed checkpoint (or of the state an
# output reads) against float64 on the same fp32 inputs, measured ~1e-7..3e-7 without spikes and up to 5e-7 with
# them in the suffix form; the prefix form after a spike: 1.5e-5 .. 2e-4.
FP32_LEVEL = 1.5e-6
TEETH = 5.0  # the old form must exceed FP32_LEVEL by this factor on the same inputs
# GPU: the spiked run against its no-spike twin on the same card and kernel, with floors below which any error is
# at the fp32 level anyway (checkpoints: per head; outputs: per step over all rows, see global_err).
TWIN_FACTOR = 4.0
FP32_FLOOR = 1e-6
Y_FLOOR = 2e-6


# ---- fp32 emulation of the kernels' exponent formation ------------------------------------------------------
def _shift(v: torch.Tensor, o: int, down: bool) -> torch.Tensor:
    """Lane i reads lane i - o (``__shfl_up_sync``) or i + o (``__shfl_down_sync``); out of range reads 0 here
    (the kernels mask those lanes, or their values are 0)."""
    u = torch.zeros_like(v)
    if o < v.shape[-1]:
        if down:
            u[..., :-o] = v[..., o:]
        else:
            u[..., o:] = v[..., :-o]
    return u


def warp_prefix(v: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
    """The old kernels' inclusive ``__shfl_up_sync`` scan over the last dim (a warp's lanes), fp32. ``seg``
    (per lane): the scan of lane i adds lane i - o only where i - o >= seg[i] (replayssm_spec's segmented scan)."""
    lane = torch.arange(v.shape[-1])
    seg = torch.zeros_like(lane) if seg is None else seg
    c = v.clone()
    for o in (1, 2, 4, 8, 16):
        c = torch.where(lane - o >= seg, c + _shift(c, o, False), c)
    return c


def warp_suffix_after(v: torch.Tensor) -> torch.Tensor:
    """rssm::suffix_after / gdn::suffix_after: lane j gets sum_{i>j} v_i by the reverse scan, fp32."""
    s = _shift(v, 1, True)
    for o in (1, 2, 4, 8, 16):
        s = s + _shift(s, o, True)
    return s


def decode_weights(dt: torch.Tensor, A: torch.Tensor, form: str):
    """(w (H, k), decay (H,)) of the decode kernels (replay_decode, compute_item) from fp32 processed dt (H, k)."""
    if form == "prefix":  # dtj * expf(A * (total - cum)), expf(A * total)
        cum = warp_prefix(dt)
        total = cum[:, -1:]
        return dt * torch.exp(A[:, None] * (total - cum)), torch.exp(A * total[:, 0])
    after = warp_suffix_after(dt)  # dtj * expf(A * after), expf(A * (dtj + after)) on lane 0
    return dt * torch.exp(A[:, None] * after), torch.exp(A * (dt[:, 0] + after[:, 0]))


def state_form(S0, xs, Bs, w, decay) -> torch.Tensor:
    """flush_rows in fp32: S = decay S0, then S += (w_j x_j) B_j^T entry by entry. S0 (H, P, N), xs (H, k, P),
    Bs (H, k, N), w (H, k), decay (H,). Also the state the output form reads (y = S C + D x)."""
    S = S0 * decay[:, None, None]
    for j in range(w.shape[1]):
        S = S + (w[:, j, None] * xs[:, j])[:, :, None] * Bs[:, j, None, :]
    return S


def state_form64(S0, xs, Bs, dt, A) -> torch.Tensor:
    """The float64 spec of the same state: reference.buffer_weights on the same fp32 dt."""
    w, decay = ref.buffer_weights(dt.double(), A.double())
    return decay[:, None, None] * S0.double() + torch.einsum("hk,hkp,hkn->hpn", w, xs.double(), Bs.double())


def verify_weights(dte: torch.Tensor, A: torch.Tensor, m: int, T: int, flush: bool, form: str):
    """replayssm_spec.cuh spec_verify's scalars from fp32 processed dt of the m + T entries (H, m + T):
    (W (H, T, m + T): dt_e exp(c_{m+t} - c_e) for base <= e <= m + t, else 0; decay (H, T): exp(c_{m+t});
    wf (H, m): the fold's dt_e exp(c_{m-1} - c_e); decay_f (H,): exp(c_{m-1}))."""
    H, n = dte.shape
    base = m if flush else 0
    lane = torch.arange(n)
    seg = torch.where(lane >= base, base, 0)
    cl = A[:, None] * warp_prefix(dte, seg)  # kept by the new kernel for the decays (sums, no difference)
    c_prev = cl[:, m - 1] if m > 0 else cl[:, 0]
    decay = torch.exp(cl[:, m:m + T])
    decay_f = torch.exp(c_prev)
    W = torch.zeros(H, T, n)
    if form == "prefix":
        wf = dte[:, :m] * torch.exp(c_prev[:, None] - cl[:, :m])
        for t in range(T):
            for e in range(base, m + t + 1):
                W[:, t, e] = dte[:, e] * torch.exp(cl[:, m + t] - cl[:, e])
        return W, decay, wf, decay_f
    hist_after = warp_suffix_after(torch.where(lane < m, dte, torch.zeros_like(dte)))
    c = A[:, None] * torch.where(lane < m, hist_after, dte)  # sm.c
    wf = dte[:, :m] * torch.exp(A[:, None] * hist_after[:, :m])
    for t in range(T):
        for e in range(base, m + t + 1):
            ex = c[:, e] if e < m else torch.zeros(H)
            for i in range(T):
                if i <= t and m + i > e:
                    ex = ex + c[:, m + i]
            W[:, t, e] = dte[:, e] * torch.exp(ex)
    return W, decay, wf, decay_f


def gdn_history_weights(g: torch.Tensor, form: str):
    """gdn.cuh / gdn_spec.cuh history scalars from fp32 log gates g (HV, m): (w_j = exp(G_m - G_j), exp(G_m))."""
    if form == "prefix":
        G = warp_prefix(g)
        Gm = G[:, -1]
        return torch.exp(Gm[:, None] - G), torch.exp(Gm)
    after = warp_suffix_after(g)
    return torch.exp(after), torch.exp(g[:, 0] + after[:, 0])


def gdn_window_decays(g: torch.Tensor, form: str) -> torch.Tensor:
    """gdn_spec.cuh window_pairs' exp(Γ_t - Γ_s) for s <= t (0 above the diagonal) from fp32 g (HV, T)."""
    HV, T = g.shape
    out = torch.zeros(HV, T, T)
    for t in range(T):
        for s in range(t + 1):
            if form == "prefix":
                Gt, Gs = torch.zeros(HV), torch.zeros(HV)
                for i in range(T):
                    if i <= t:
                        Gt = Gt + g[:, i]
                    if i <= s:
                        Gs = Gs + g[:, i]
                out[:, t, s] = torch.exp(Gt - Gs)
            else:
                Gst = torch.zeros(HV)
                for i in range(T):
                    if s < i <= t:
                        Gst = Gst + g[:, i]
                out[:, t, s] = torch.exp(Gst)
    return out


def head_err(got: torch.Tensor, want: torch.Tensor, lead: int = 1) -> float:
    """Worst relative Frobenius error over the first ``lead`` dims (heads; or slot, head)."""
    d = (got.double() - want.double()).flatten(lead)
    return float((d.norm(dim=-1) / want.double().flatten(lead).norm(dim=-1).clamp_min(1e-300)).max())


def global_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error of the whole tensor (the existing GPU tests' y metric). Outputs are measured so,
    not per head: after a spike a head's checkpoint is nearly rank one (x_s B_s^T of the spike entry), and its
    product with a C_t that happens to be almost orthogonal to B_s is ill-conditioned, so that head's y shows the
    fp32 rounding of the checkpoint amplified (up to ~1e-5 relative, in either exponent form); the exponents' error
    scales every term of a head alike and shows in the global error as in the checkpoints (1e-4 vs 3e-7)."""
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300))


# ---- CPU: the emulation with dt spikes ---------------------------------------------------------------------
H_CPU, P_CPU, N_CPU = 16, 32, 64


def _cpu_params(seed: int, H: int = H_CPU):
    """A = -(1 .. 16) over the heads (|A| up to 16), dt_bias as trtllm_replayssm.problems (dt in [1e-3, 0.1])."""
    gen = torch.Generator().manual_seed(seed)
    dt0 = torch.exp(torch.rand(H, generator=gen, dtype=F64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).float()
    return gen, -torch.linspace(1.0, 16.0, H), dt_bias


def spiked_dt(gen, dt_bias: torch.Tensor, k: int, spikes, H: int = H_CPU) -> torch.Tensor:
    """fp32 processed dt (H, k) as the kernels compute it: softplus(dt_raw + dt_bias) in fp32 (threshold 20),
    raw dt ~ N(-2, 1), and at the positions in ``spikes`` raw dt past the threshold: processed dt in [24, 100]."""
    raw = torch.randn(H, k, generator=gen) - 2.0
    for j in spikes:
        raw[:, j] = 24.0 + 76.0 * torch.rand(H, generator=gen) - dt_bias
    return ref.softplus(raw + dt_bias[:, None])


def _operands(gen, k: int, H: int = H_CPU, P: int = P_CPU, N: int = N_CPU):
    S0 = torch.randn(H, P, N, generator=gen)
    xs = torch.randn(H, k, P, generator=gen)
    Bs = torch.randn(H, k, N, generator=gen) * (4 * N ** -0.5)
    return S0, xs, Bs


def _decode_errors(spikes, k: int = 16, seed: int = 0) -> dict[str, float]:
    gen, A, dt_bias = _cpu_params(seed)
    dt = spiked_dt(gen, dt_bias, k, spikes)
    S0, xs, Bs = _operands(gen, k)
    want = state_form64(S0, xs, Bs, dt, A)
    return {f: head_err(state_form(S0, xs, Bs, *decode_weights(dt, A, f)), want) for f in FORMS}


def test_emulation_without_spikes_is_at_the_fp32_level():
    """Both forms agree with float64 at the fp32 level without a spike: the emulation is the kernels'
    arithmetic, and the level the spike tests bound against."""
    for k in (1, 5, 16, 32):
        err = _decode_errors((), k=k, seed=k)
        assert max(err.values()) < FP32_LEVEL / 3, (k, err)


SPIKES = [(0,), (1,), (4,), (8,), (12,), (14,), (2, 9), (0, 5, 10), (3, 4)]
DECODE_CASES = [(s, 16) for s in SPIKES] + [(s, 11) for s in SPIKES if max(s) < 10]  # spike before the newest


@pytest.mark.parametrize("spikes, k", DECODE_CASES, ids=lambda v: f"k{v}" if isinstance(v, int) else "at" + "_".join(map(str, v)))
def test_decode_state_after_dt_spike(spikes, k):
    """Mamba-2 standard decode: the flush's checkpoint (k = L = 16) and the state the output form reads at
    k = 11 entries, with dt spikes among ordinary dt: the suffix form stays at the no-spike fp32 level, the old
    prefix-difference form does not."""
    err = _decode_errors(spikes, k=k, seed=len(spikes) * 100 + spikes[0] * 7 + k)
    assert err["suffix"] < FP32_LEVEL, err
    assert err["prefix"] > TEETH * FP32_LEVEL, f"teeth: the old form should fail the bound: {err}"


def test_spike_as_the_newest_entry_is_harmless_in_both_forms():
    """A spike at the newest entry: every older weight is exp(-|A| dt_spike) ~ 0 and the newest has exponent 0
    (total - cum = 0 exactly): the old form had no error there, the new one neither."""
    err = _decode_errors((15,), k=16, seed=3)
    assert max(err.values()) < FP32_LEVEL, err


def _spec_case(m: int, T: int, spikes, seed: int):
    gen, A, dt_bias = _cpu_params(seed)
    n = m + T
    dte = spiked_dt(gen, dt_bias, n, spikes)
    S0, xs, Bs = _operands(gen, n)
    return A, dte, S0, xs, Bs


@pytest.mark.parametrize("m, T, spikes", [(12, 4, (2,)), (12, 4, (7,)), (9, 4, (0, 6)), (24, 8, (5,)),
                                          (24, 8, (20,)), (10, 6, (1, 8))],
                         ids=lambda v: str(v) if not isinstance(v, tuple) else "at" + "_".join(map(str, v)))
def test_spec_fold_after_dt_spike(m, T, spikes):
    """Speculative verify, flush step (count + 2T > L): the fold S_m = exp(c_{m-1}) S0 + sum_e wf_e x_e B_e^T
    stored as the checkpoint, spikes in the committed history; then the window positions' states from it."""
    A, dte, S0, xs, Bs = _spec_case(m, T, spikes, seed=m * 31 + T + spikes[0])
    Sm64 = state_form64(S0, xs[:, :m], Bs[:, :m], dte[:, :m], A)
    err = {}
    for f in FORMS:
        W, decay, wf, decay_f = verify_weights(dte, A, m, T, True, f)
        Sm = state_form(S0, xs[:, :m], Bs[:, :m], wf, decay_f)
        err[f] = head_err(Sm, Sm64)
    assert err["suffix"] < FP32_LEVEL, err
    assert err["prefix"] > TEETH * FP32_LEVEL, f"teeth: the old fold should fail the bound: {err}"


@pytest.mark.parametrize("flush", [False, True])
@pytest.mark.parametrize("m, T, spikes", [(4, 4, (1,)), (8, 4, (2, 9)), (6, 4, (6,)), (4, 8, (5,)), (0, 4, (0,)),
                                          (8, 8, (3, 9))],
                         ids=lambda v: str(v) if not isinstance(v, tuple) else "at" + "_".join(map(str, v)))
def test_spec_window_after_dt_spike(m, T, spikes, flush):
    """Speculative verify, the state each window position t reads, S_{m+t} = exp(c_{m+t}) S + sum_e W[t][e] x_e
    B_e^T (S = S0 from base 0 without a flush; the f64 fold S_m from base m with one), spikes in the history
    and / or inside the window: the window-internal exponents (sums of the window's dt after e) and the
    history's (suffix + window) stay at the fp32 level."""
    if flush and m == 0:
        pytest.skip("a flush folds at least one entry")
    A, dte, S0, xs, Bs = _spec_case(m, T, spikes, seed=m * 17 + T * 3 + spikes[0] + flush)
    base = m if flush else 0
    S = state_form64(S0, xs[:, :m], Bs[:, :m], dte[:, :m], A) if flush else S0.double()
    worst = {}
    for f in FORMS:
        W, decay, _, _ = verify_weights(dte, A, m, T, flush, f)
        errs = []
        for t in range(T):
            k = m + t + 1
            got = state_form(S.float(), xs[:, base:k], Bs[:, base:k], W[:, t, base:k], decay[:, t])
            want = state_form64(S, xs[:, base:k], Bs[:, base:k], dte[:, base:k], A)
            errs.append(head_err(got, want))
        worst[f] = max(errs)
    assert worst["suffix"] < FP32_LEVEL, worst
    inside = any(base <= s < m + T - 1 for s in spikes)  # a spike some later position's exponents span
    if inside:
        assert worst["prefix"] > TEETH * FP32_LEVEL, f"teeth: the old window weights should fail the bound: {worst}"


def _gdn_gates(gen, HV: int, n: int, spikes):
    """fp32 g = -exp(A_log) softplus(a + dt_bias) (A_log = log 1..16 over the heads), raw a ~ N(0, 1) and past
    the threshold at the spikes (softplus 24..100)."""
    A_log = torch.log(torch.linspace(1.0, 16.0, HV))
    _, _, dt_bias = _cpu_params(7, HV)
    a = torch.randn(HV, n, generator=gen)
    for j in spikes:
        a[:, j] = 24.0 + 76.0 * torch.rand(HV, generator=gen) - dt_bias
    return -torch.exp(A_log)[:, None] * ref.softplus(a + dt_bias[:, None])


@pytest.mark.parametrize("m, spikes", [(15, (2,)), (15, (9,)), (10, (0, 6)), (30, (12,))],
                         ids=lambda v: str(v) if not isinstance(v, tuple) else "at" + "_".join(map(str, v)))
def test_gdn_history_after_gate_spike(m, spikes):
    """Gated DeltaNet, non-flush step (standard decode and verify): S_m = exp(G_m) S0 + sum_j w_j u_j k_j^T,
    whose products with k and q every output reads, with gate spikes in the buffer."""
    gen = torch.Generator().manual_seed(m * 13 + spikes[0])
    HV, V, K = 16, 32, 64
    g = _gdn_gates(gen, HV, m, spikes)
    S0 = torch.randn(HV, V, K, generator=gen) * 0.05
    us = torch.randn(HV, m, V, generator=gen) * 0.1
    ks = torch.nn.functional.normalize(torch.randn(HV, m, K, generator=gen), dim=-1)
    G = torch.cumsum(g.double(), -1)
    want = torch.exp(G[:, -1])[:, None, None] * S0.double() + torch.einsum(
        "hj,hjv,hjk->hvk", torch.exp(G[:, -1:] - G), us.double(), ks.double())
    err = {}
    for f in FORMS:
        w, eGm = gdn_history_weights(g, f)
        S = S0 * eGm[:, None, None]
        for j in range(m):
            S = S + (w[:, j, None] * us[:, j])[:, :, None] * ks[:, j, None, :]
        err[f] = head_err(S, want)
    assert err["suffix"] < FP32_LEVEL, err
    assert err["prefix"] > TEETH * FP32_LEVEL, f"teeth: the old GDN weights should fail the bound: {err}"


@pytest.mark.parametrize("T, spikes", [(4, (0,)), (4, (1,)), (8, (2,)), (8, (0, 4))],
                         ids=lambda v: str(v) if not isinstance(v, tuple) else "at" + "_".join(map(str, v)))
def test_gdn_window_decays_after_gate_spike(T, spikes):
    """Gated DeltaNet verify window: exp(Γ_t - Γ_s) for s <= t (window_pairs), a gate spike inside the window.
    Error of each decay relative to the largest of its row t (the terms a window position sums)."""
    gen = torch.Generator().manual_seed(T * 5 + spikes[0])
    g = _gdn_gates(gen, 16, T, spikes)
    G = torch.cumsum(g.double(), -1)
    want = torch.exp(G[:, :, None] - G[:, None, :]).tril()
    err = {}
    for f in FORMS:
        d = (gdn_window_decays(g, f).double() - want).abs().amax(-1) / want.abs().amax(-1)
        err[f] = float(d.max())
    assert err["suffix"] < FP32_LEVEL, err
    assert err["prefix"] > TEETH * FP32_LEVEL, f"teeth: the old window decays should fail the bound: {err}"


# ---- GPU: the same spikes through the real kernels -------------------------------------------------------------
# Each run has a twin: the same problem (seed, inputs) without the spikes, through the same kernel on the same
# card, whose worst per-head error is the no-spike level the spiked run is bounded by.
SPIKE_SEED = 39


def _spike_values(gen, *shape) -> torch.Tensor:
    """softplus's output at a spike: 24 .. 100 (the raw input is this minus dt_bias, past the threshold 20)."""
    return 24.0 + 76.0 * torch.rand(*shape, generator=gen)


def _bound(twin: float, floor: float = FP32_FLOOR) -> float:
    return max(TWIN_FACTOR * twin, floor)


class SpikedDecode(DecodeProblem):
    """tests/test_kernels_gpu.py's Problem (kernel caches on the GPU, float64 mirror on the CPU) whose raw dt is
    replaced, at ``spike_steps``, by spikes on every head of every row; the spikes come from their own generator,
    so a twin without them draws the very same inputs otherwise."""

    def __init__(self, spike_steps=(), **kw):
        super().__init__(**kw)
        self.spike_steps, self.step_no = set(spike_steps), 0
        self.spike_gen = torch.Generator().manual_seed(SPIKE_SEED)
        self.last = None

    def inputs(self):
        x, B, C, dt, z = super().inputs()
        if self.step_no in self.spike_steps:
            raw = _spike_values(self.spike_gen, self.batch, self.H) - self.prm.dt_bias.cpu()
            dt = raw.to(dt.dtype).to(dt.device)
        self.step_no += 1
        self.last = (x, B, C, dt, z)
        return self.last


def run_decode(pb: SpikedDecode, steps: int, emulate: bool = False) -> dict[str, float]:
    """``steps`` standard decode steps (ops.replay_decode + advance_cursor) against the mirror; worst relative
    errors of y (every step, over the valid rows) and of each flushed checkpoint (per head). With ``emulate``, also the
    fp32 emulation of both exponent forms on each flush's own inputs (the kernel's checkpoint before the step, its
    cached x, B, dt and this step's token) against the mirror's checkpoint, and the kernel against the emulated
    new form (the emulation models the kernel)."""
    worst = dict(state=0.0, y=0.0, flushes=0, prefix=0.0, suffix=0.0, kernel_vs_emulation=0.0)
    sbi = pb.sbi.cpu().tolist()
    L, hpg = pb.L, pb.H // pb.G
    A, dt_bias = pb.prm.A.cpu(), pb.prm.dt_bias.cpu()
    for _ in range(steps):
        flushing = [s for s in sbi if s >= 0 and int(pb.ref_cursor[s]) == L - 1]
        before = {s: (pb.state[s].cpu(), pb.xc[s].cpu(), pb.Bc[s].cpu(), pb.dtc[s].cpu()) for s in flushing} if emulate else {}
        y, y_ref, flushed = pb.replay_step()
        assert flushed == flushing
        v = pb.valid
        worst["y"] = max(worst["y"], global_err(y.cpu()[v], y_ref[v]))
        for s in flushed:
            worst["state"] = max(worst["state"], head_err(pb.state[s].cpu(), pb.ref_state[s]))
            worst["flushes"] += 1
        x, B, _, dt, _ = pb.last
        for s, (S0, xc, Bc, dtc) in before.items():
            b = sbi.index(s)
            dt_now = ref.softplus(dt[b].cpu().float() + dt_bias)  # fp32, as the kernel
            dts = torch.cat([dtc[:, :L - 1], dt_now[:, None]], 1)  # (H, L)
            xs = torch.cat([xc[:, :L - 1].float(), x[b].cpu().float()[:, None]], 1)  # (H, L, P)
            Bs = torch.cat([Bc[:, :L - 1].float(), B[b].cpu().float()[:, None]], 1).repeat_interleave(hpg, 0)
            emu = {f: state_form(S0.float(), xs, Bs, *decode_weights(dts, A, f)) for f in FORMS}
            for f in FORMS:
                worst[f] = max(worst[f], head_err(emu[f], pb.ref_state[s]))
            worst["kernel_vs_emulation"] = max(worst["kernel_vs_emulation"], head_err(pb.state[s].cpu(), emu["suffix"]))
    return worst


# Every decode kernel that forms the weights: replay_decode (one-shot) and compute_item (persistent, staged, staged
# with bulk copies; "planned" is what ops plans for this batch, the staged kernel here).
DECODE_VARIANTS = {
    "planned": (None, None),
    "one_shot": (config.Variant("one_shot", 5), None),
    "persistent": (config.Variant("persistent", 5), None),
    "staged": (config.Variant("staged", 6, 2), None),
    "staged_bulk": (config.Variant("staged", 8, 2, "bulk"), (32, 4)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
def test_gpu_decode_after_dt_spikes(variant):
    """Standard decode, fp32 state and activations, 3L + 2 steps from an empty buffer (three flushes per row),
    dt spikes on every head at buffer positions 1, L/2, 2 and L - 4 of the successive cycles and at the first
    step after the third flush: every flushed checkpoint (per head) and every step's y within TWIN_FACTOR of the
    no-spike twin's worst error, where the old prefix-difference form, emulated on the same flush inputs, is not."""
    var, shape = DECODE_VARIANTS[variant]
    L = 16
    kw = dict(geom=(8, 64, 128, 2), state="f32", act="f32", L=L, batch=3, slots=5, pad_rows=(1,), seed=39)
    spikes = (1, L + L // 2, 2 * L + 2, 3 * L - 4, 3 * L)
    with contextlib.ExitStack() as pins:
        pins.enter_context(config.override_variant(var))
        if shape is not None:
            pins.enter_context(config.override_geometry(*shape))
        twin = run_decode(SpikedDecode(**kw), 3 * L + 2)
        spiked = run_decode(SpikedDecode(spike_steps=spikes, **kw), 3 * L + 2, emulate=True)
    msg = f"spiked {spiked}, no-spike twin {twin}"
    assert spiked["flushes"] == twin["flushes"] >= 3 * 2, msg
    assert spiked["state"] <= _bound(twin["state"]), "flushed checkpoint after a dt spike: " + msg
    assert spiked["y"] <= _bound(twin["y"], Y_FLOOR), "y after a dt spike: " + msg
    assert spiked["kernel_vs_emulation"] < FP32_LEVEL, "the emulation does not model the kernel: " + msg
    assert spiked["suffix"] <= _bound(twin["state"]), msg
    assert spiked["prefix"] > _bound(twin["state"]), "teeth: the old form would pass this bound: " + msg


class SpikedSpec(SpecProblem):
    """tests/test_spec_gpu.py's SpecProblem whose window raw dt is replaced, at the (step, token) pairs in
    ``spikes``, by spikes on every head of every row (own generator: a twin draws the same inputs otherwise)."""

    def __init__(self, spikes=(), **kw):
        super().__init__(**kw)
        self.spikes, self.step_no = set(spikes), 0
        self.spike_gen = torch.Generator().manual_seed(SPIKE_SEED)

    def window(self):
        x, B, C, dt, z = super().window()
        toks = sorted(t for s, t in self.spikes if s == self.step_no)
        if toks:
            dt = dt.clone()
            for t in toks:
                raw = _spike_values(self.spike_gen, self.batch, self.H) - self.prm.dt_bias.cpu()
                dt[:, t] = raw.to(dt.dtype).to(dt.device)
        self.step_no += 1
        return x, B, C, dt, z


def run_spec(pb: SpikedSpec, steps: int, emulate: bool = False) -> dict[str, float]:
    """``steps`` verify + full commit (n = T) steps against the mirror: worst relative errors of y (every step, over
    the valid rows) and of each folded checkpoint (per head); with ``emulate``, the fp32 emulation of the fold in
    both forms on each fold's own inputs (the kernel's checkpoint and committed ring entries) against the mirror."""
    worst = dict(state=0.0, y=0.0, folds=0, prefix=0.0, suffix=0.0)
    full = torch.full((pb.batch,), pb.T, dtype=torch.int32)
    A, hpg = pb.prm.A.cpu(), pb.H // pb.G
    for _ in range(steps):
        folding = [s for s in pb.used if cursors.needs_flush(pb.ref_cursor, s, pb.T, pb.L)]
        before = {}
        for s in folding if emulate else ():
            start, m = (int(c) for c in pb.ref_cursor[s])
            idx = ((start + torch.arange(m)) % pb.L).to(pb.xc.device)
            before[s] = (pb.state[s].cpu(), pb.xc[s][:, idx].cpu(), pb.Bc[s][:, idx].cpu(), pb.dtc[s][:, idx].cpu())
        y, y_ref, flushed = pb.verify(pb.window())
        assert sorted(flushed) == sorted(folding)
        v = pb.valid
        worst["y"] = max(worst["y"], global_err(y.cpu()[v], y_ref[v]))
        for s in flushed:
            worst["state"] = max(worst["state"], head_err(pb.state[s].cpu(), pb.ref_state[s]))
            worst["folds"] += 1
        for s, (S0, xs, Bs, dts) in before.items():
            m = dts.shape[1]
            dte = torch.cat([dts, torch.zeros(pb.H, pb.T)], 1)  # the fold's scalars read the history lanes only
            Bs = Bs.float().repeat_interleave(hpg, 0)
            for f in FORMS:
                _, _, wf, decay_f = verify_weights(dte, A, m, pb.T, True, f)
                worst[f] = max(worst[f], head_err(state_form(S0.float(), xs.float(), Bs, wf, decay_f), pb.ref_state[s]))
        pb.commit(full)
    return worst


# (T, L): (step, window token) of the spikes. Full acceptance from count 0 folds at steps 3, 6 and 9; each spike
# lands in the history of the next fold with entries after it, and inside its window with tokens after it.
SPEC_CASES = {
    "T4_L16": (4, 16, ((1, 1), (4, 0), (8, 2))),
    "T8_L32": (8, 32, ((1, 2), (4, 1), (7, 5))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_gpu_verify_after_dt_spikes(case):
    """Speculative verify, fp32 state and activations, 12 steps crossing three folds per row with dt spikes in
    the windows: every folded checkpoint (per head) and every step's window outputs within TWIN_FACTOR of the
    no-spike twin's worst error; the old form of the fold, emulated on the same inputs, is not."""
    T, L, spikes = SPEC_CASES[case]
    kw = dict(geom=(8, 64, 128, 2), state="f32", act="f32", T=T, L=L, batch=3, slots=5, pad_rows=(1,), seed=39)
    twin = run_spec(SpikedSpec(**kw), 12)
    spiked = run_spec(SpikedSpec(spikes=spikes, **kw), 12, emulate=True)
    msg = f"spiked {spiked}, no-spike twin {twin}"
    assert spiked["folds"] == twin["folds"] >= 3 * 2, msg
    assert spiked["state"] <= _bound(twin["state"]), "folded checkpoint after a dt spike: " + msg
    assert spiked["y"] <= _bound(twin["y"], Y_FLOOR), "window outputs after a dt spike: " + msg
    assert spiked["suffix"] <= _bound(twin["state"]), msg
    assert spiked["prefix"] > _bound(twin["state"]), "teeth: the old fold would pass this bound: " + msg


def _spike_gates(pb, a: torch.Tensor, spike_gen, where) -> torch.Tensor:
    """Raw GDN gate inputs ``a`` with spikes: softplus(a + dt_bias) of 24..100 at ``where`` (an index of a)."""
    a = a.clone()
    shape = a[where].shape
    a[where] = (_spike_values(spike_gen, *shape) - pb.prm.dt_bias).to(a.dtype)
    return a


class SpikedGDN(GDNProblem):
    """tests/test_gdn_gpu.py's Problem with gate spikes (every value head of every row) at ``spike_steps``."""

    def __init__(self, spike_steps=(), **kw):
        super().__init__(**kw)
        self.spike_steps, self.step_no = set(spike_steps), 0
        self.spike_gen = torch.Generator().manual_seed(SPIKE_SEED)

    def spiked_inputs(self):
        q, k, v, a, b = self.inputs()
        if self.step_no in self.spike_steps:
            a = _spike_gates(self, a, self.spike_gen, (slice(None), slice(None)))
        self.step_no += 1
        return q, k, v, a, b


def _gdn_errors(pb, worst: dict, y, y_ref) -> None:
    """y and the cached u_j over the valid rows / used slots (global_err), the checkpoint per (slot, value head)."""
    used = torch.tensor(pb.used, dtype=torch.long)
    worst["y"] = max(worst["y"], global_err(y[pb.valid], y_ref[pb.valid]))
    worst["u"] = max(worst["u"], global_err(pb.buf.u_cache.cpu()[used], pb.rbuf.u_cache[used]))
    worst["state"] = max(worst["state"], head_err(pb.buf.state.cpu()[used], pb.rbuf.state[used], lead=2))


_GDN_FLOORS = dict(y=Y_FLOOR, u=Y_FLOOR, state=FP32_FLOOR)


@pytest.mark.gpu
def test_gpu_gdn_decode_after_gate_spikes():
    """Gated DeltaNet standard decode, fp32 activations, 3L + 1 steps from an empty buffer (three flushes), gate
    spikes on every value head at steps 1, L + 4, 2L + 2 and 2L + 8: y, the cached u_j (both read the replay
    weights exp(G_m - G_j)) and the checkpoint (the exact fold, untouched by the change) within TWIN_FACTOR of the
    no-spike twin's worst error."""
    L = 16
    kw = dict(geom=(4, 2, 128, 128), act=torch.float32, L=L, batch=3, slots=6, pad_rows=(1,), seed=39,
              random_cursor=False)
    out = []
    for spikes in ((), (1, L + 4, 2 * L + 2, 2 * L + 8)):
        pb = SpikedGDN(spike_steps=spikes, **kw)
        worst = dict(y=0.0, u=0.0, state=0.0)
        for _ in range(3 * L + 1):
            y, y_ref = pb.step(pb.spiked_inputs(), check=False)
            _gdn_errors(pb, worst, y, y_ref)
        out.append(worst)
    twin, spiked = out
    msg = f"spiked {spiked}, no-spike twin {twin}"
    for name in ("y", "u", "state"):
        assert spiked[name] <= _bound(twin[name], _GDN_FLOORS[name]), f"{name} after a gate spike: " + msg


class SpikedGDNSpec(GDNSpecProblem):
    """tests/test_gdn_spec_gpu.py's SpecProblem with gate spikes at the (step, window token) pairs of ``spikes``."""

    def __init__(self, spikes=(), **kw):
        super().__init__(**kw)
        self.spikes, self.step_no = set(spikes), 0
        self.spike_gen = torch.Generator().manual_seed(SPIKE_SEED)

    def spiked_inputs(self):
        q, k, v, a, b = self.inputs()
        for t in sorted(t for s, t in self.spikes if s == self.step_no):
            a = _spike_gates(self, a, self.spike_gen, (slice(None), t))
        self.step_no += 1
        return q, k, v, a, b


@pytest.mark.gpu
def test_gpu_gdn_verify_after_gate_spikes():
    """Gated DeltaNet verify + full commit, fp32 activations, T = 4, L = 16, 12 steps from random cursors (folds
    at every count the rule allows), gate spikes inside windows with tokens after them (the window decays
    exp(Γ_t - Γ_s)) that then sit in the committed history (the weights exp(G_m - G_j)): y, the ring's u and the
    checkpoint within TWIN_FACTOR of the no-spike twin's worst error."""
    kw = dict(geom=(4, 2, 128, 128), act=torch.float32, L=16, T=4, batch=3, slots=6, pad_rows=(1,), seed=39)
    out = []
    for spikes in ((), ((1, 0), (3, 1), (6, 0), (8, 2))):
        pb = SpikedGDNSpec(spikes=spikes, **kw)
        full = torch.full((pb.batch,), pb.T, dtype=torch.int32)
        worst = dict(y=0.0, u=0.0, state=0.0)
        for _ in range(12):
            y, y_ref, _ = pb.step(pb.spiked_inputs(), full, check=False)
            _gdn_errors(pb, worst, y, y_ref)
        assert pb.flushes > 0, "no fold in 12 steps"
        out.append(worst)
    twin, spiked = out
    msg = f"spiked {spiked}, no-spike twin {twin}"
    for name in ("y", "u", "state"):
        assert spiked[name] <= _bound(twin[name], _GDN_FLOORS[name]), f"{name} after a gate spike: " + msg
