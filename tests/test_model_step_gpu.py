# SPDX-License-Identifier: Apache-2.0
"""GPU tests of builders/model_step.py's fusion: the torch.compile'd regions against the same functions
run eagerly, standard decode and speculative verify, eager and inside a CUDA graph.

Oracles: the eager step (fuse=False) on the same weights and inputs. fp32 models: fused and eager
differ only in the order of fp32 sums inside a region, so logits agree to <= 1e-4 of their std and
the greedy tokens are equal; bf16 models: logits within 0.05 std (one bf16 rounding of differently
ordered sums per region; a wrong region moves logits by O(1) std). Teeth: a fused speculative step
whose conv offset is dropped after every commit (the committed inputs read from the wrong columns
after a rejection) must disagree with the eager step.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "scripts" / "bench_decode.py")
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)

from builders.decode_attention import decode_attention  # noqa: E402
from builders.model_step import Conventional, DecodeStep, NoOp, Replay, SpecStep, make_drafts  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 0.05}


def _model(dtype, layers=None):
    if layers == "nemotron3":  # tiny Nemotron 3: MoE layers (grouped experts in bf16)
        cfg = bd.model_config(tiny="nemotron3")
    elif layers is None:
        cfg = bd.model_config(tiny=True)
    else:
        cfg = bd.model_config(layers=layers, vocab=2048)
    return bd.build_model(cfg, "cuda", dtype, seed=0)


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
    one's snapshot), so the error is one step's rounding-order difference, not a drift."""
    model = _model(torch.bfloat16, layers)
    batch = 5
    prompt = torch.randint(2, model.config.vocab_size, (batch, 4), generator=torch.Generator().manual_seed(1))
    eager, fused = DecodeStep(model, batch, 64, Conventional(), fuse=False), DecodeStep(model, batch, 64, Conventional())
    eager.feed(prompt.cuda())
    fused.restore(eager.snapshot())
    g = _graph(fused)
    worst = 0.0
    for _ in range(12):
        fused.restore(eager.snapshot())
        fused.logits.fill_(float("nan"))
        g.replay()
        eager()
        worst = max(worst, _err(fused.logits, eager.logits))
    assert worst <= TOL[torch.bfloat16], worst


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


@pytest.mark.xfail(strict=True, reason="grouped MoE on CUDA differs from dense by 0.9-1.8 std (H200, 5cc22d2); "
                   "off by default (model_step.GROUPED_MOE_ON_CUDA) until found")
def test_grouped_moe_step_in_a_graph_equals_dense():
    """Tiny Nemotron 3, bf16, fused and captured: the grouped-GEMM experts against the dense formulation
    (eager) step by step from the same state; every step routes rows * top_k pairs."""
    model = _model(torch.bfloat16, "nemotron3")
    batch = 9
    prompt = torch.randint(2, model.config.vocab_size, (batch, 3), generator=torch.Generator().manual_seed(5))
    dense = DecodeStep(model, batch, 64, Conventional(), fuse=False)
    dense.grouped = False
    dense.feed(prompt.cuda())
    fused = DecodeStep(model, batch, 64, Conventional())
    fused.grouped = True  # forced on: the path under investigation
    assert fused.fuse
    fused.restore(dense.snapshot())
    g = _graph(fused)
    k = model.config.num_experts_per_tok
    for t in range(6):
        fused.restore(dense.snapshot())  # one step from the same state (the tiny bf16 model is chaotic)
        fused.logits.fill_(float("nan"))
        g.replay()
        dense()
        assert _err(fused.logits, dense.logits) <= TOL[torch.bfloat16], t
        assert all(int(v.sum()) == batch * k for v in fused.expert_load.values())


def test_noop_step_runs_fused_in_a_graph():
    model = _model(torch.bfloat16)
    step = DecodeStep(model, 7, 32, NoOp())
    assert step.fuse
    g = _graph(step)
    step.logits.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(step.logits).all()
