# SPDX-License-Identifier: Apache-2.0
"""Speculative export on the CPU: the verify + commit graphs in onnxruntime against sequential decoding.

Graphs: builders/decode_step.py's step with num_draft > 0 (one ``replayssm::mamba2_verify`` node per Mamba
layer) and builders/spec_step.py's commit graph (one ``replayssm::spec_commit`` node), the plugin ops
supplied in Python (builders/ort_reference.py: the float64 spec_reference flush + verify, and commit).
Rows have different prompt lengths and start from a hand-off after prefill + 2 standard ReplaySSM
decode steps (a committed history of 2 and ring starts that wrap).

Oracles, each where it holds:
* the PyTorch spec modules for the ONNX graphs (same float64 SSM spec in both; attention, conv and
  projections are fp32 ops of two runtimes): rtol 1e-4, atol 2e-5 as tests/test_builder.py; cursor,
  lengths and conv-window rollback (a gather) exactly.
* the patched transformers model (builders/nemotron_h.py, float64 ReplaySSM reference, its own L=4
  buffer and flush points) fed the committed tokens one at a time, one row at a time: the verify
  logits of every accepted position equal the sequential logits. Both sides run the float64 SSM
  recurrence on fp32 activations; they differ by fp32 summation orders (T-row vs 1-row matmuls,
  the conv, dense masked attention vs transformers' attention) and by where the fp32 checkpoint is
  rounded (different flush points), which after ~40 tokens leaves a few 1e-6 absolute on O(1)
  logits (measured max 4e-6 on |logits| <= 4.3): rtol 1e-4, atol 2e-5 as above, while a corrupted
  history entry moves the logits by ~0.1 (the teeth test). At the end, bookkeeping against the oracle's caches: committed
  SSM state S_count (float64 fold of checkpoint + committed ring entries) vs the oracle's S_k to
  1e-5 relative; the last K-1 conv inputs and the committed K/V positions to 1e-5.
* plain greedy decoding of the unpatched model: with greedy acceptance (drafts from the greedy
  continuation, 30% corrupted) the generated tokens equal plain greedy decoding.
Random acceptance: n in 1..T per row, all T every 3rd step, 1 every 4th; every row crosses >= 2
flushes (count + 2T > L) in 12 steps.
Every test runs on both embedded tiny configs: Nemotron-H (``M*-M-M*-``) and Nemotron 3 (``MEM*EM*E``,
MoE layers as standard ops in the verify graph, transformers' NemotronHMoE in the oracle; the MoE
adds fp32 summation-order differences only, within the same tolerances).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

try:
    from transformers import DynamicCache, NemotronHForCausalLM  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.skip("transformers without NemotronHForCausalLM (needs transformers >= 5.24)", allow_module_level=True)
if not hasattr(DynamicCache, "get_conv_state"):  # pragma: no cover - e.g. the H200 image's 5.17
    import transformers

    pytest.skip(f"transformers {transformers.__version__} lacks the Mamba cache API the patch uses (needs >= 5.24)",
                allow_module_level=True)

from builders.decode_step import DOMAIN, VERIFY_OP_TYPE, NemotronHDecodeStep, export_onnx
from builders.nemotron_h import load_nemotron_h, mamba_layers, patch_replayssm
from builders.spec_step import COMMIT_OP_TYPE, NemotronHSpecCommit
from trtllm_replayssm import conv_window as convw
from trtllm_replayssm import cursor as cursors
from trtllm_replayssm.families.mamba2 import reference
from trtllm_replayssm.families.mamba2 import spec_reference as sr

from .spec_driver import (
    ModuleRunner,
    OrtRunner,
    SpecDecode,
    check_greedy_acceptance,
    check_shadow_spec,
    random_accept,
    sequential_check,
)

NUM_DRAFT, L_SPEC, L_SEQ = 3, 16, 4
T = NUM_DRAFT + 1
MAX_SEQ = 96
STEPS = 12
PRE_DECODE = 2
PROMPT_LENS = (5, 7, 6)
STARTS = (0, 11, 15)  # ring starts at the hand-off: the committed history wraps for rows 1 and 2
RTOL, ATOL = 1e-4, 2e-5  # see the module docstring
VOCAB = 256

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("onnxruntime_extensions") is None,
                       reason="onnxruntime-extensions is not installed (pip install onnxruntime onnxruntime-extensions)"),
]


@pytest.fixture(scope="module", params=("nemotron_h", "nemotron3"))
def model(request):
    """Both embedded tiny configs; Nemotron 3's MoE layers route each of the batch * T window tokens."""
    return load_nemotron_h(seed=0, tiny=request.param)


@pytest.fixture(scope="module")
def graphs(model, tmp_path_factory):
    from builders.ort_reference import session

    step = NemotronHDecodeStep(model, L_SPEC, MAX_SEQ, num_draft=NUM_DRAFT)
    commit = NemotronHSpecCommit(step)
    d = tmp_path_factory.mktemp("spec_onnx")
    export_onnx(step, d / "verify.onnx", d / "commit.onnx")
    return step, commit, d, session(d / "verify.onnx"), session(d / "commit.onnx")


def _prompts(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]


def _ssm_state(st, run, dec, b, i):
    """(committed state of row b, layer i from the graphs' state outputs, the patched model's current state)."""
    A = -torch.exp(dec.model.model.layers[i].mixer.A_log.detach().double())
    got = sr.committed_state(st[f"ssm_state_{i}"], st[f"x_cache_{i}"], st[f"B_cache_{i}"], st[f"dt_cache_{i}"],
                             run.cursor, A, b)
    c = dec.caches[i]
    return got, reference.replay_state(c["state"], c["x_cache"], c["B_cache"], c["dt_cache"], dec.cursor, A, 0)


def _sequential_check(model, step, run: SpecDecode, check_state: bool = True) -> int:
    """Each row's committed tokens one at a time through the patched model (spec_driver.sequential_check)."""
    kinds = model.config.layers_block_type
    return sequential_check(model, run, patch_replayssm, L_SEQ, PRE_DECODE, RTOL, ATOL, mamba_layers(model),
                            model.config.conv_kernel, [i for i, k in enumerate(kinds) if k == "full_attention"],
                            _ssm_state, check_state)


# ---- tests ----------------------------------------------------------------------------------------------------
def test_graphs_have_the_plugin_nodes(model, graphs):
    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    step, commit, d, _, _ = graphs
    cfg = model.config
    g = onnx.load(str(d / "verify.onnx"))
    onnx.checker.check_model(g)
    nodes = [n for n in g.graph.node if n.domain == DOMAIN]
    assert len(nodes) == len(mamba_layers(model)) and all(n.op_type == VERIFY_OP_TYPE for n in nodes)
    for n, i in zip(nodes, mamba_layers(model)):
        attrs = {a.name: (a.s.decode() if a.type == onnx.AttributeProto.STRING else a.i) for a in n.attribute}
        assert attrs == dict(plugin_namespace=DOMAIN, aot=1, nheads=cfg.mamba_num_heads, headdim=cfg.mamba_head_dim,
                             dstate=cfg.ssm_state_size, ngroups=cfg.n_groups, buffer_len=L_SPEC, num_tokens=T)
        assert list(n.input[8:]) == ["cursor", f"ssm_state_{i}", f"x_cache_{i}", f"B_cache_{i}", f"dt_cache_{i}"]
        assert list(n.output[1:]) == [f"ssm_state_{i}_out", f"x_cache_{i}_out", f"B_cache_{i}_out", f"dt_cache_{i}_out"]
    assert [i.name for i in g.graph.input] == step.input_names()
    assert [o.name for o in g.graph.output] == step.output_names()
    # MoE layers: standard ops with static shapes (as tests/test_builder.py checks for the decode graph)
    moe = [i for i, k in enumerate(cfg.layers_block_type) if k == "moe"]
    assert sum(n.op_type == "TopK" for n in g.graph.node) == len(moe)
    assert sum(len(t.dims) == 3 and t.dims[0] == getattr(cfg, "n_routed_experts", 0) for t in g.graph.initializer) \
        == 2 * len(moe)
    assert not {n.op_type for n in g.graph.node} & {"NonZero", "Loop", "If", "Scan", "ScatterND", "ScatterElements"}
    c = onnx.load(str(d / "commit.onnx"))
    onnx.checker.check_model(c)
    nodes = [n for n in c.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == [COMMIT_OP_TYPE]
    attrs = {a.name: (a.s.decode() if a.type == onnx.AttributeProto.STRING else a.i) for a in nodes[0].attribute}
    assert attrs == dict(plugin_namespace=DOMAIN, aot=1, num_tokens=T, buffer_len=L_SPEC)
    assert list(nodes[0].output) == ["cursor_out"] and list(nodes[0].input)[1:] != []
    assert [i.name for i in c.graph.input] == commit.input_names()
    assert [o.name for o in c.graph.output] == commit.output_names()
    windows = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in g.graph.input
               if i.name.startswith("conv_window_")}
    assert all(s == ["batch", cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.n_groups * cfg.ssm_state_size,
                     cfg.conv_kernel - 1 + NUM_DRAFT] for s in windows.values()), windows


def test_onnx_graphs_match_the_modules(model, graphs):
    step, commit, _, sv, sc = graphs
    ort, mod = OrtRunner(step, commit, sv, sc), ModuleRunner(step, commit, sv, sc)
    gen = torch.Generator().manual_seed(3)
    a, b = (SpecDecode(model, step, _prompts(), patch_replayssm, PRE_DECODE, STARTS) for _ in range(2))
    accept = random_accept(torch.Generator().manual_seed(4), T)
    for s in range(4):
        drafts = torch.randint(0, VOCAB, (len(PROMPT_LENS), NUM_DRAFT), generator=gen)
        n = accept(drafts, None)
        _, lo, _ = a.run_step(ort, drafts, lambda ids, logits, n=n: n)
        _, lm, _ = b.run_step(mod, drafts, lambda ids, logits, n=n: n)
        np.testing.assert_allclose(lo.numpy(), lm.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"step {s}: logits")
        assert torch.equal(a.cursor, b.cursor) and torch.equal(a.lengths, b.lengths), s
        for name, x, y in zip(a.names, a.states, b.states):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"step {s}: {name}")
    assert a.tokens == b.tokens


def test_random_acceptance_matches_sequential_decoding(model, graphs):
    step, commit, _, sv, sc = graphs
    run = SpecDecode(model, step, _prompts(), patch_replayssm, PRE_DECODE, STARTS)
    ort = OrtRunner(step, commit, sv, sc)
    gen = torch.Generator().manual_seed(5)
    accept = random_accept(torch.Generator().manual_seed(6), T)
    for _ in range(STEPS):
        run.run_step(ort, torch.randint(0, VOCAB, (len(PROMPT_LENS), NUM_DRAFT), generator=gen), accept)
    assert min(run.flushes) >= 2, run.flushes
    compared = _sequential_check(model, step, run)
    assert compared == sum(len(r) for r in run.records) >= STEPS * len(PROMPT_LENS)


def test_sequential_comparison_has_teeth(model, graphs):
    """One corrupted committed x entry (row 1, a Mamba layer's ring) must be caught by the oracle."""
    step, commit, _, sv, sc = graphs
    run = SpecDecode(model, step, _prompts(), patch_replayssm, PRE_DECODE, STARTS)
    ort = OrtRunner(step, commit, sv, sc)
    gen = torch.Generator().manual_seed(5)
    accept = random_accept(torch.Generator().manual_seed(6), T)
    run.run_step(ort, torch.randint(0, VOCAB, (len(PROMPT_LENS), NUM_DRAFT), generator=gen), accept)
    start, count = (int(v) for v in run.cursor[1])
    assert count + 2 * T <= L_SPEC  # the next verify reads the history (no flush first)
    x = run.states[run.names.index(f"x_cache_{mamba_layers(model)[0]}")]
    x[1, :, (start + count - 1) % L_SPEC] += 1.0
    run.run_step(ort, torch.randint(0, VOCAB, (len(PROMPT_LENS), NUM_DRAFT), generator=gen), accept)
    with pytest.raises(AssertionError):
        _sequential_check(model, step, run, check_state=False)


def test_greedy_acceptance_reproduces_greedy_decoding(model, graphs):
    step, commit, _, sv, sc = graphs
    make_run = lambda p: SpecDecode(model, step, p, patch_replayssm, PRE_DECODE, STARTS)  # noqa: E731
    check_greedy_acceptance(model, _prompts(), make_run, OrtRunner(step, commit, sv, sc), STEPS, NUM_DRAFT, VOCAB,
                            PRE_DECODE)


def test_commit_graph_bookkeeping_is_exact(graphs):
    """Every n in 0..T (and out-of-range n, clamped as the kernel clamps): cursor = spec_reference flush +
    commit, lengths += n, conv windows = conv_window.conv_window_rollback, all bit-exact, module and ORT."""
    step, commit, _, sv, sc = graphs
    gen = torch.Generator().manual_seed(8)
    batch = T + 3
    n = torch.tensor(list(range(T + 1)) + [T + 3, -2], dtype=torch.int32)
    cursor = torch.stack([torch.randint(0, L_SPEC, (batch,), generator=gen),
                          torch.randint(0, L_SPEC - T + 1, (batch,), generator=gen)], dim=1).to(torch.int32)
    lengths = torch.randint(0, 50, (batch,), generator=gen, dtype=torch.int32)
    windows = [torch.randn((batch, *s.shape[1:]), generator=gen) for s in commit.state_specs()]
    ort, mod = OrtRunner(step, commit, sv, sc), ModuleRunner(step, commit, sv, sc)
    n_c = n.clamp(0, T)
    sbi = torch.arange(batch, dtype=torch.int32)
    want_cursor = cursor.clone()
    cursors.flush_cursor(want_cursor, T, L_SPEC, sbi)
    cursors.commit(want_cursor, n_c, T, L_SPEC, sbi)
    K = step.config.conv_kernel
    for runner in (ort, mod):
        cur, lens, wins = runner.commit(n, cursor, lengths, windows)
        assert torch.equal(cur, want_cursor) and torch.equal(lens, lengths + n_c)
        for w, got in zip(windows, wins):
            want = w.clone()
            live = n_c >= 1  # spec_reference refuses n = 0 with this window width (it would drop a kept input)
            rows = sbi[live]
            convw.conv_window_rollback(want, n_c[live], T, K, rows)
            assert torch.equal(got[live], want[live])
            r = T  # n = 0: shifted right by T, zero-filled
            assert torch.equal(got[~live], torch.cat([torch.zeros_like(w[~live][..., :r]), w[~live][..., :-r]], -1))


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_shadow_verify_graph_follows_the_module(model, tmp_path, kind):
    """``build_engine --shadow {bf16,fp8} --num-draft N``: one ``mamba2_verify_shadow`` node per Mamba layer and
    the shadow state(s) after each checkpoint; in onnxruntime under random acceptance across folds the graphs
    follow the PyTorch verify step and the shadow is requantized from the checkpoint at every fold only
    (spec_driver.check_shadow_spec); the logits stay near fp32 sequential decoding (the shadow's rounding)."""
    import onnx

    from builders.ort_reference import session

    step = NemotronHDecodeStep(model, L_SPEC, MAX_SEQ, shadow=kind, num_draft=NUM_DRAFT)
    commit = NemotronHSpecCommit(step)
    export_onnx(step, tmp_path / "verify.onnx", tmp_path / "commit.onnx")
    g = onnx.load(str(tmp_path / "verify.onnx"))
    assert [n.op_type for n in g.graph.node if n.domain == DOMAIN] == ["mamba2_verify_shadow"] * len(mamba_layers(model))
    ort = OrtRunner(step, commit, session(tmp_path / "verify.onnx"), session(tmp_path / "commit.onnx"))
    run = SpecDecode(model, step, _prompts(), patch_replayssm, PRE_DECODE, STARTS)
    gen = torch.Generator().manual_seed(5)
    check_shadow_spec(run, ort, ModuleRunner(step, commit, None, None),
                      lambda: torch.randint(0, VOCAB, (len(PROMPT_LENS), NUM_DRAFT), generator=gen),
                      random_accept(torch.Generator().manual_seed(6), T), STEPS, "ssm_shadow")
    assert min(run.flushes) >= 2, run.flushes
    kinds = model.config.layers_block_type
    tol = 2e-2 if kind == "bf16" else 1e-1
    compared = sequential_check(model, run, patch_replayssm, L_SEQ, PRE_DECODE, tol, tol, mamba_layers(model),
                                model.config.conv_kernel, [i for i, k in enumerate(kinds) if k == "full_attention"],
                                _ssm_state, False)
    assert compared >= STEPS * len(PROMPT_LENS)



def test_one_step_class_and_one_export(model, tmp_path):
    """T = 1 + num_draft: the same step class is the standard decode step at num_draft = 0 and the verify step
    above; the one export writes the commit graph exactly for the latter (refused before any tracing)."""
    K = model.config.conv_kernel
    std = NemotronHDecodeStep(model, L_SPEC, MAX_SEQ)
    spec = NemotronHDecodeStep(model, L_SPEC, MAX_SEQ, num_draft=NUM_DRAFT)
    assert (std.speculative, std.num_tokens, std.op_type, std.window) == (False, 1, "mamba2_decode", K)
    assert (spec.speculative, spec.num_tokens, spec.op_type, spec.window) == (True, T, VERIFY_OP_TYPE, K - 1 + NUM_DRAFT)
    assert std.plugin_attributes() == {k: v for k, v in spec.plugin_attributes().items() if k != "num_tokens"}
    assert spec.plugin_attributes()["num_tokens"] == T
    assert [n.replace("conv_state_", "conv_window_") for n in std.input_names()] == spec.input_names()
    assert std.output_names()[3:] == [n.replace("conv_window_", "conv_state_") for n in spec.output_names()[1:]]
    with pytest.raises(ValueError, match="commit_path: a speculative step"):
        export_onnx(spec, tmp_path / "verify.onnx")
    with pytest.raises(ValueError, match="commit_path: a standard decode step"):
        export_onnx(std, tmp_path / "model.onnx", tmp_path / "commit.onnx")
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="step: a commit graph follows a speculative verify step"):
        NemotronHSpecCommit(std)
    with pytest.raises(ValueError, match=r"num_draft: expected >= 0 \(0: standard decode\), got -1"):
        NemotronHDecodeStep(model, L_SPEC, MAX_SEQ, num_draft=-1)
    with pytest.raises(ValueError, match=r"buffer_len: expected in \[2 \(num_draft \+ 1\), 32\] = \[8, 32\]"):
        NemotronHDecodeStep(model, 6, MAX_SEQ, num_draft=3)
    with pytest.raises(ValueError, match="buffer_len: expected 1..32, got 33"):
        NemotronHDecodeStep(model, 33, MAX_SEQ)
