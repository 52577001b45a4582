# SPDX-License-Identifier: Apache-2.0
"""GPU tests of builders/model_step.py's fusion: the torch.compile'd regions against the same functions
run eagerly, standard decode and speculative verify, eager and inside a CUDA graph.

Oracles: the eager step (fuse=False) on the same weights and inputs. fp32 models: fused and eager
differ only in the order of fp32 sums inside a region, so logits agree to <= 1e-4 of their std and
the greedy tokens are equal; bf16 models: logits within 0.05 std (one bf16 rounding of differently
ordered sums per region; a wrong region moves logits by O(1) std). Teeth: a fused speculative step
whose conv offset is dropped after every commit (the committed inputs read from the wrong columns
after a rejection) must disagree with the eager step.

MoE (bf16): the grouped-GEMM experts against the dense experts, both fused and captured, under the one
compiled routing: the routing is compared exactly, the expert outputs within MOE_TOL (the same bf16
products, summed in another order); teeth: rolled expert matrices under the same routing must
disagree. Fused against eager, the routing is compiled against eager: bf16 rounding of the normed
tokens may flip a near-tie top-k choice, an O(1) change of that row, so such rows are left out
(and counted).
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent

from builders.decode_attention import decode_attention  # noqa: E402
from builders.model_step import Conventional, DecodeStep, NoOp, Replay, SpecStep, make_drafts  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 0.05}
# fused vs eager, bf16 with MoE layers (one step from the same state, rows routed alike): the fused step's
# compiled routing and expert GEMMs round in another order than the eager ones, and every MoE layer adds a
# routed-weight combine of two bf16 GEMM chains. Measured on the H200 (this test, 2026-12-03): 0.067 std
# (Nemotron-H without MoE: 0.047 under TOL), 3 of 60 rows flipped by near ties. A wrong router or expert
# flips most rows (asserted) or moves the logits by O(1) std (test_grouped_moe_..._has_teeth: 5.9 std).
MOE_STEP_TOL = 0.1
MOE_TOL = 0.02  # grouped vs dense bf16 expert outputs, max |diff| / std: both round the same fp32 products to bf16


def _model(dtype, layers=None):
    if layers == "nemotron3":  # tiny Nemotron 3: MoE layers (grouped experts in bf16)
        cfg = model_config(tiny="nemotron3")
    elif layers is None:
        cfg = model_config(tiny=True)
    else:
        cfg = model_config(layers=layers, vocab=2048)
    return build_model(cfg, "cuda", dtype, seed=0)


def _err(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().amax() / b.std())


def _graph(step):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g


def _record(step, region: str, pick) -> list:
    """Wraps one region of the step: each call appends ``pick(args, outputs)``. Tensors recorded while a
    graph is captured stay alive, so they hold every replay's values."""
    calls, real = [], step.f[region]

    def wrapped(*args):
        out = real(*args)
        calls.append(pick(args, out))
        return out

    step.f = {**step.f, region: wrapped}
    return calls


def _routing(step) -> list:
    """Records each MoE layer's routing: (pair order, each sorted pair's expert) from moe_in."""
    return _record(step, "moe_in", lambda args, out: (out[4], out[5]))


def _rows_routed_alike(a: list, b: list, k: int, E: int) -> torch.Tensor:
    """(n,) bool: the token chose the same k experts in every MoE layer of the two routings."""
    same = None
    for (oa, ea), (ob, eb) in zip(a, b, strict=True):
        chosen = []
        for order, experts in ((oa, ea), (ob, eb)):
            m = torch.zeros(order.numel() // k, E, dtype=torch.bool, device=order.device)
            m[order // k, experts] = True
            chosen.append(m)
        row = (chosen[0] == chosen[1]).all(1)
        same = row if same is None else same & row
    return same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["conventional", "replay"])
@pytest.mark.parametrize("layers", [None, 8, "nemotron3"])  # tiny; Nemotron-H-8B's first 8 layers; tiny MoE
def test_fused_decode_equals_eager(dtype, mode, layers):
    if dtype == torch.bfloat16 and layers != 8:
        # measured on the H200 (66d2317): the tiny random bf16 models are chaotic, fused and eager
        # states drift apart to ~0.9 std in 20 steps from rounding-order differences alone, while the
        # 8B geometry stays within tolerance; those configs are checked one step at a time below
        pytest.skip("tiny bf16: one-step comparison in test_fused_step_from_the_same_state")
    model = _model(dtype, layers)
    batch, n = 5, 20  # odd batch; 20 steps cross the flushes of L = 8
    prompt = torch.randint(2, model.config.vocab_size, (batch, 4), generator=torch.Generator().manual_seed(1))
    make = (lambda: Conventional()) if mode == "conventional" else (lambda: Replay(8))
    eager, fused = DecodeStep(model, batch, 64, make(), fuse=False), DecodeStep(model, batch, 64, make(), fuse=True)
    for s in (eager, fused):
        s.feed(prompt.cuda())
    snap = eager.snapshot()
    fused.restore(snap)
    g = _graph(fused)
    fused.restore(snap)
    worst = 0.0
    for t in range(n):
        fused.logits.fill_(float("nan"))  # poisoned: every logit must be rewritten by the replay
        g.replay()
        eager()
        worst = max(worst, _err(fused.logits, eager.logits))
        if dtype == torch.float32:
            assert torch.equal(fused.ids, eager.ids), t
        else:
            fused.ids.copy_(eager.ids)  # teacher-forced: bf16 near ties may fork the greedy path
    assert worst <= TOL[dtype], worst


@pytest.mark.parametrize("layers", [None, "nemotron3"])
def test_fused_step_from_the_same_state(layers):
    """bf16 tiny models: every step starts the fused and the eager step from the same state (the eager
    one's snapshot), so the error is one step's rounding-order difference, not a drift. MoE: a row whose
    top-k experts differ in some MoE layer (a near tie that the compiled routing's bf16 rounding flips:
    an O(1) change of that row only, rows are independent) is left out; at most a quarter of the rows
    may flip (a wrong router flips nearly all)."""
    model = _model(torch.bfloat16, layers)
    batch = 5
    prompt = torch.randint(2, model.config.vocab_size, (batch, 4), generator=torch.Generator().manual_seed(1))
    eager, fused = DecodeStep(model, batch, 64, Conventional(), fuse=False), DecodeStep(model, batch, 64, Conventional())
    eager.feed(prompt.cuda())
    moe = len(eager.expert_load)
    if moe:
        E, k = model.config.n_routed_experts, model.config.num_experts_per_tok
        route_e, route_f = _routing(eager), _routing(fused)
    fused.restore(eager.snapshot())
    g = _graph(fused)
    worst, flipped, steps = 0.0, 0, 12
    for _ in range(steps):
        fused.restore(eager.snapshot())
        fused.logits.fill_(float("nan"))
        g.replay()
        same = torch.ones(batch, dtype=torch.bool, device="cuda")
        if moe:
            route_e.clear()
        eager()
        if moe:
            same = _rows_routed_alike(route_f[-moe:], route_e, k, E)  # the captured call's records
            flipped += int((~same).sum())
        if same.any():
            worst = max(worst, _err(fused.logits[same], eager.logits[same]))
    print(f"fused vs eager from the same state ({layers}): {worst:.4f} std, {flipped} of {steps * batch} rows "
          "routed otherwise")
    assert flipped <= steps * batch // 4, flipped
    assert worst <= (MOE_STEP_TOL if moe else TOL[torch.bfloat16]), worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_spec_step_equals_eager_and_has_teeth(dtype):
    model = _model(dtype, None if dtype == torch.float32 else 8)  # bf16: the 8B geometry (not chaotic)
    batch, T, steps = 3, 4, 8
    vocab = model.config.vocab_size
    prompt = torch.randint(2, vocab, (batch, 4), generator=torch.Generator().manual_seed(2))
    std = DecodeStep(model, batch, 96, Conventional(), fuse=False)
    std.feed(prompt.cuda())
    snap = std.snapshot()
    table = steps * T + T + 1
    ref = torch.randint(2, vocab, (batch, table), generator=torch.Generator().manual_seed(3)).cuda()
    ref[:, 0] = snap["ids"]
    drafts = make_drafts(ref, 0.6, vocab, torch.Generator().manual_seed(4))  # rejections: the conv offset matters

    def run(fuse, drop_shift=False):
        s = SpecStep(model, batch, 96, T, table, Replay(16), live=False, fuse=fuse)
        s.set_tables(ref, drafts)
        s.restore(snap)
        out = []
        for _ in range(steps):
            s()
            out.append(s.logits.clone())
            if drop_shift:
                s.shift.zero_()
        s.free()
        return out, s.pos.clone()

    eager, pos_e = run(False)
    fused, pos_f = run(True)
    assert torch.equal(pos_e, pos_f) and int((pos_e - 1).sum()) < batch * steps * T  # some drafts were rejected
    assert max(_err(f, e) for f, e in zip(fused, eager)) <= TOL[dtype]
    broken, _ = run(True, drop_shift=True)
    assert max(_err(f, e) for f, e in zip(broken, eager)) > 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,kvh,rep,hd", [(1, 8, 4, 128), (4, 8, 4, 128), (3, 2, 2, 32), (2, 1, 16, 64)])
def test_decode_attention_matches_float64(dtype, T, kvh, rep, hd):
    """Against float64 softmax attention with the causal-by-length mask; rows at 0, block edges and
    the cache's end (clamped); K/V past every row's last key are NaN (never read) and the output is
    poisoned."""
    b, cap = 6, 208
    gen = torch.Generator(device="cuda").manual_seed(T * 100 + hd)
    q = torch.randn(b, T, kvh * rep * hd, device="cuda", generator=gen).to(dtype)
    k = torch.randn(b, kvh, cap, hd, device="cuda", generator=gen).to(dtype)
    v = torch.randn(b, kvh, cap, hd, device="cuda", generator=gen).to(dtype)
    lengths = torch.tensor([0, 1, 63, 64, 150, cap - 2], device="cuda")
    last = (lengths[:, None] + torch.arange(T, device="cuda")[None, :]).clamp(max=cap - 1)
    pos = torch.arange(cap, device="cuda")
    beyond = pos[None, :] > last[:, -1:]  # (b, cap)
    k[beyond[:, None, :, None].expand_as(k)] = float("nan")
    v[beyond[:, None, :, None].expand_as(v)] = float("nan")
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, last, out=out)
    kd, vd = k.double().nan_to_num(0), v.double().nan_to_num(0)
    qd = q.double().view(b, T, kvh, rep, hd)
    s = torch.einsum("btgrd,bgsd->btgrs", qd, kd) * hd ** -0.5
    s = s.masked_fill((pos[None, None, :] > last[:, :, None])[:, :, None, None, :], float("-inf"))
    want = torch.einsum("btgrs,bgsd->btgrd", s.softmax(-1), vd).reshape(b, T, -1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_grouped_moe_step_in_a_graph_equals_dense_and_has_teeth():
    """Tiny Nemotron 3, bf16, fused and captured: the grouped-GEMM experts against the dense experts
    (every expert on every token, then each pair's row) one step at a time from the same state. Both
    share the compiled routing and combine, so the routing (pair order, per-expert counts) is compared
    exactly, each MoE layer's expert outputs within bf16 GEMM rounding. Teeth: the grouped step with its
    expert matrices rolled by one (expert e computed with e-1's) under the same routing must disagree."""
    model = _model(torch.bfloat16, "nemotron3")
    batch, k = 9, model.config.num_experts_per_tok  # 9 rows * top_k pairs: uneven per-expert groups
    prompt = torch.randint(2, model.config.vocab_size, (batch, 3), generator=torch.Generator().manual_seed(5))
    eager = DecodeStep(model, batch, 64, Conventional(), fuse=False)
    eager.feed(prompt.cuda())
    snap = eager.snapshot()

    def captured(grouped, roll=False):
        s = DecodeStep(model, batch, 64, Conventional())
        assert s.fuse
        s.grouped = grouped
        if roll:
            for w in s.w.values():
                if "moe" in w:
                    m = w["moe"]
                    w["moe"] = dataclasses.replace(m, up=m.up.roll(1, 0), down=m.down.roll(1, 0))
        calls = _record(s, "moe_out", lambda args, out: args[:2])  # (y, order): expert outputs, pair order
        s.restore(snap)
        g = _graph(s)
        s.restore(snap)  # the warm-up call of _graph stepped once
        return s, g, calls[-len(s.expert_load):]  # the captured call's records, one per MoE layer

    dense, g_dense, y_dense = captured(False)
    grouped, g_grouped, y_grouped = captured(True)
    assert grouped.grouped and not dense.grouped and len(y_dense) == len(dense.expert_load) > 0
    worst_y = worst_logits = 0.0
    for _ in range(4):
        grouped.restore(dense.snapshot())  # one step from the same state (the tiny bf16 model is chaotic)
        for s in (dense, grouped):
            s.logits.fill_(float("nan"))
        g_grouped.replay()
        g_dense.replay()
        for (yg, og), (yd, od) in zip(y_grouped, y_dense):
            assert torch.equal(og, od)  # the same routing: the pairs in the same sorted order ...
            worst_y = max(worst_y, _err(yg, yd))
        for i, load in dense.expert_load.items():  # ... and the same per-expert counts
            assert torch.equal(grouped.expert_load[i], load) and int(load.sum()) == batch * k, i
        worst_logits = max(worst_logits, _err(grouped.logits, dense.logits))
    print(f"MOE grouped vs dense: expert outputs {worst_y:.4f} std, logits {worst_logits:.4f} std")
    assert worst_y <= MOE_TOL, worst_y
    assert worst_logits <= TOL[torch.bfloat16], worst_logits

    broken, g_broken, y_broken = captured(True, roll=True)
    dense.restore(snap)
    g_broken.replay()
    g_dense.replay()
    (yb, ob), (yd, od) = y_broken[0], y_dense[0]
    assert torch.equal(ob, od)  # the first MoE layer: same inputs, same routing, other expert matrices
    print(f"MOE rolled experts vs dense: {_err(yb, yd):.3f} std")
    assert _err(yb, yd) > 10 * MOE_TOL, _err(yb, yd)


def test_noop_step_runs_fused_in_a_graph():
    model = _model(torch.bfloat16)
    step = DecodeStep(model, 7, 32, NoOp())
    assert step.fuse
    g = _graph(step)
    step.logits.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(step.logits).all()
