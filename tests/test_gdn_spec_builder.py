# SPDX-License-Identifier: Apache-2.0
"""Speculative export of Qwen3-Next / Qwen3.5 on the CPU: the verify + commit graphs in onnxruntime
against sequential decoding.

Graphs: builders/qwen_export.py's :class:`QwenGDNDecodeStep` with num_draft > 0 (one ``replayssm::gdn_verify``
node per GDN layer) and builders/spec_step.py's commit graph (one ``replayssm::spec_commit`` node), the plugin ops
supplied in Python (builders/ort_reference.py: gdn_reference flush + verify in float64, and commit).
Rows have different prompt lengths and are handed off after prefill + 2 standard ReplaySSM GDN decode
steps (a committed history of 2, ring starts that wrap).

Oracles, as tests/test_spec_builder.py argues them for Nemotron-H:
* the PyTorch modules for the ONNX graphs (same float64 GDN spec; projections, conv, attention and
  the MoE are fp32 ops of two runtimes): rtol 1e-4, atol 2e-5; cursor, lengths and conv windows exact.
* the patched transformers model (builders/qwen3_next.py, float64 ReplaySSM GDN reference with its own
  L = 4 buffer and flush points) fed the committed tokens one at a time, one row at a time: the verify
  logits of every accepted position equal the sequential ones (rtol 1e-4, atol 2e-5: fp32 summation
  orders and where the fp32 checkpoint is rounded; a corrupted committed u entry moves them by far
  more, the teeth test). At the end: committed GDN state (float64 fold of checkpoint + committed ring)
  vs the oracle's current state to 1e-5 relative, the last K-1 conv inputs and the K/V positions.
* plain greedy decoding of the unpatched model: greedy acceptance of drafts from the greedy
  continuation (30% corrupted) reproduces it token for token.
Random acceptance: every row crosses >= 2 flushes (count + 2T > L) in 12 steps. Both embedded tiny
configs (Qwen3-Next with its sparse MoE, Qwen3.5 dense).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from builders.decode_step import DOMAIN, export_onnx  # noqa: E402
from builders.qwen3_next import FAMILIES, gdn_layers, patch_gdn_replayssm, tiny_model  # noqa: E402
from builders.qwen_export import GDN_OP_TYPE, GDN_VERIFY_OP_TYPE, QwenGDNDecodeStep  # noqa: E402
from builders.spec_step import COMMIT_OP_TYPE, NemotronHSpecCommit  # noqa: E402
from trtllm_replayssm.families.gdn import reference as gref  # noqa: E402

from .spec_driver import (  # noqa: E402
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
STARTS = (0, 11, 15)
RTOL, ATOL = 1e-4, 2e-5
VOCAB = 256

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("onnxruntime_extensions") is None,
                       reason="onnxruntime-extensions is not installed (pip install onnxruntime onnxruntime-extensions)"),
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def graphs(model, tmp_path_factory):
    from builders.ort_reference import session

    step = QwenGDNDecodeStep(model, L_SPEC, MAX_SEQ, num_draft=NUM_DRAFT)
    commit = NemotronHSpecCommit(step)
    d = tmp_path_factory.mktemp("gdn_spec_onnx")
    export_onnx(step, d / "verify.onnx", d / "commit.onnx")
    return step, commit, d, session(d / "verify.onnx"), session(d / "commit.onnx")


def _prompts(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]


def _decode(model, step, prompts=None):
    return SpecDecode(model, step, prompts or _prompts(), patch_gdn_replayssm, PRE_DECODE, STARTS)


def _drafts(gen):
    return torch.randint(0, VOCAB, (len(PROMPT_LENS), NUM_DRAFT), generator=gen)


_GDN_BUFFERS = ("gdn_state", "gdn_u", "gdn_v", "gdn_k", "gdn_g", "gdn_beta")


def _gdn_state(st, run, dec, b, i):
    """(committed state of row b, GDN layer i from the graphs' state outputs, the patched model's current state)."""
    buf = gref.GDNBuffers(*(st[f"{n}_{i}"] for n in _GDN_BUFFERS))
    return gref.committed_state(buf, run.cursor, b), gref.replay_state(dec.bufs[i], dec.cursor, 0)


def _sequential_check(model, step, run: SpecDecode, check_state: bool = True) -> int:
    """Each row's committed tokens one at a time through the patched model (spec_driver.sequential_check)."""
    kinds = model.config.layer_types
    return sequential_check(model, run, patch_gdn_replayssm, L_SEQ, PRE_DECODE, RTOL, ATOL, gdn_layers(model),
                            model.config.linear_conv_kernel_dim,
                            [i for i, k in enumerate(kinds) if k == "full_attention"], _gdn_state, check_state)


def test_graphs_have_the_plugin_nodes(model, graphs):
    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    step, commit, d, _, _ = graphs
    c = model.config
    g = onnx.load(str(d / "verify.onnx"))
    onnx.checker.check_model(g)
    nodes = [n for n in g.graph.node if n.domain == DOMAIN]
    assert len(nodes) == len(gdn_layers(model)) and all(n.op_type == GDN_VERIFY_OP_TYPE for n in nodes)
    for n, i in zip(nodes, gdn_layers(model)):
        attrs = {a.name: (a.s.decode() if a.type == onnx.AttributeProto.STRING else a.i) for a in n.attribute}
        assert attrs == dict(plugin_namespace=DOMAIN, aot=1, num_k_heads=c.linear_num_key_heads,
                             num_v_heads=c.linear_num_value_heads, key_dim=c.linear_key_head_dim,
                             value_dim=c.linear_value_head_dim, buffer_len=L_SPEC, use_qk_l2norm=1, num_tokens=T)
        names = ("gdn_state", "gdn_u", "gdn_v", "gdn_k", "gdn_g", "gdn_beta")
        assert list(n.input[8:]) == ["cursor"] + [f"{s}_{i}" for s in names]
        assert list(n.output[1:]) == [f"{s}_{i}_out" for s in names]
    assert [i.name for i in g.graph.input] == step.input_names()
    assert [o.name for o in g.graph.output] == step.output_names()
    assert not {n.op_type for n in g.graph.node} & {"NonZero", "Loop", "If", "Scan", "ScatterND", "ScatterElements"}
    windows = {i.name: [dd.dim_value or dd.dim_param for dd in i.type.tensor_type.shape.dim] for i in g.graph.input
               if i.name.startswith("conv_window_")}
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    assert len(windows) == len(gdn_layers(model))
    assert all(s == ["batch", conv_dim, c.linear_conv_kernel_dim - 1 + NUM_DRAFT] for s in windows.values()), windows
    cg = onnx.load(str(d / "commit.onnx"))
    onnx.checker.check_model(cg)
    assert [n.op_type for n in cg.graph.node if n.domain == DOMAIN] == [COMMIT_OP_TYPE]
    assert [i.name for i in cg.graph.input] == commit.input_names()


def test_onnx_graphs_match_the_modules(model, graphs):
    step, commit, _, sv, sc = graphs
    ort, mod = OrtRunner(step, commit, sv, sc), ModuleRunner(step, commit, sv, sc)
    gen = torch.Generator().manual_seed(3)
    a, b = (_decode(model, step) for _ in range(2))
    accept = random_accept(torch.Generator().manual_seed(4), T)
    for s in range(4):
        drafts = _drafts(gen)
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
    run = _decode(model, step)
    ort = OrtRunner(step, commit, sv, sc)
    gen = torch.Generator().manual_seed(5)
    accept = random_accept(torch.Generator().manual_seed(6), T)
    for _ in range(STEPS):
        run.run_step(ort, _drafts(gen), accept)
    assert min(run.flushes) >= 2, run.flushes
    compared = _sequential_check(model, step, run)
    assert compared == sum(len(r) for r in run.records) >= STEPS * len(PROMPT_LENS)


def test_sequential_comparison_has_teeth(model, graphs):
    """One corrupted committed u entry (row 1, the first GDN layer's ring) must be caught by the oracle."""
    step, commit, _, sv, sc = graphs
    run = _decode(model, step)
    ort = OrtRunner(step, commit, sv, sc)
    gen = torch.Generator().manual_seed(5)
    accept = random_accept(torch.Generator().manual_seed(6), T)
    run.run_step(ort, _drafts(gen), accept)
    start, count = (int(v) for v in run.cursor[1])
    assert count + 2 * T <= L_SPEC  # the next verify reads the history (no flush first)
    u = run.states[run.names.index(f"gdn_u_{gdn_layers(model)[0]}")]
    u[1, :, (start + count - 1) % L_SPEC] += 1.0
    run.run_step(ort, _drafts(gen), accept)
    with pytest.raises(AssertionError):
        _sequential_check(model, step, run, check_state=False)


def test_greedy_acceptance_reproduces_greedy_decoding(model, graphs):
    step, commit, _, sv, sc = graphs
    make_run = lambda p: _decode(model, step, p)  # noqa: E731
    check_greedy_acceptance(model, _prompts(), make_run, OrtRunner(step, commit, sv, sc), STEPS, NUM_DRAFT, VOCAB,
                            PRE_DECODE)


def test_spec_step_rejects_bad_windows(model):
    with pytest.raises(ValueError, match=r"buffer_len: expected in \[2 \(num_draft \+ 1\), 32\] = \[8, 32\]"):
        QwenGDNDecodeStep(model, 6, MAX_SEQ, num_draft=3)
    with pytest.raises(ValueError, match=r"num_draft: expected >= 0 \(0: standard decode\), got -1"):
        QwenGDNDecodeStep(model, 8, MAX_SEQ, num_draft=-1)
    standard = QwenGDNDecodeStep(model, 8, MAX_SEQ, num_draft=0)  # T = 1: the standard decode step
    assert (standard.speculative, standard.num_tokens, standard.op_type) == (False, 1, GDN_OP_TYPE)
    assert standard.window == model.config.linear_conv_kernel_dim
    step = QwenGDNDecodeStep(model, 8, MAX_SEQ, num_draft=1)
    assert (step.speculative, step.num_tokens, step.op_type) == (True, 2, GDN_VERIFY_OP_TYPE)
    assert step.window == model.config.linear_conv_kernel_dim
    with pytest.raises(ValueError, match=r"input_ids: expected \(batch, 2\)"):
        step(torch.ones(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
             torch.zeros(2, 2, dtype=torch.int32), *step.empty_states(2))


def test_shadow_verify_graph_follows_the_module_and_the_checkpoint_stays_exact(model, tmp_path):
    """``build_engine --shadow bf16 --num-draft N`` on a GDN model: one ``gdn_verify_shadow`` node per layer and
    a gdn_shadow_i state. In onnxruntime under random acceptance across folds: logits == the PyTorch verify step
    (same shadow math); the shadow is bf16(checkpoint) after every fold and passes through otherwise; the
    states follow the module too; the logits stay within bf16-level distance of sequential fp32 decoding (the
    shadow is what non-fold verifies read; its rounding reaches later layers' inputs, so their states are
    compared to the module, not to the fp32 sequence)."""
    import onnx

    from builders.ort_reference import session

    step = QwenGDNDecodeStep(model, L_SPEC, MAX_SEQ, shadow="bf16", num_draft=NUM_DRAFT)
    commit = NemotronHSpecCommit(step)
    export_onnx(step, tmp_path / "verify.onnx", tmp_path / "commit.onnx")
    g = onnx.load(str(tmp_path / "verify.onnx"))
    assert [n.op_type for n in g.graph.node if n.domain == "replayssm"] == ["gdn_verify_shadow"] * len(gdn_layers(model))
    ort = OrtRunner(step, commit, session(tmp_path / "verify.onnx"), session(tmp_path / "commit.onnx"))
    run = _decode(model, step)
    gen = torch.Generator().manual_seed(5)
    check_shadow_spec(run, ort, ModuleRunner(step, commit, None, None), lambda: _drafts(gen),
                      random_accept(torch.Generator().manual_seed(6), T), STEPS, "gdn_shadow")
    assert min(run.flushes) >= 2, run.flushes
    kinds = model.config.layer_types
    compared = sequential_check(model, run, patch_gdn_replayssm, L_SEQ, PRE_DECODE, 2e-2, 2e-2, gdn_layers(model),
                                model.config.linear_conv_kernel_dim,
                                [i for i, k in enumerate(kinds) if k == "full_attention"], _gdn_state, False)
    assert compared >= STEPS * len(PROMPT_LENS)

