# SPDX-License-Identifier: Apache-2.0
"""The flush-first row order in the exported decode steps (``StepIO.set_row_order``): one ``replayssm::flush_order``
node a step, before the first recurrent layer, whose (batch, 4) output every decode node takes as its rows input
(trtllm_replayssm/trt_plugin.py). On the CPU: the graph's nodes and edges, and under onnxruntime (the reference ops,
builders/ort_reference.py) the graph with the order computes every output bit for bit as the graph without it, over
two ring folds with the rows at different cursors (so the order moves rows), for the three families' steps (Kimi-Linear
KDA, Qwen3-Next GDN, Nemotron-H Mamba-2, each with a bf16 shadow). The refusals come first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx", reason="onnx is not installed")

from builders.decode_step import DOMAIN, ORDER_OP_TYPE, NemotronHDecodeStep, export_onnx  # noqa: E402

L, MAX_SEQ, BATCH = 4, 16, 3

needs_ort = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("onnxruntime", "onnxruntime_extensions")),
    reason="onnxruntime and onnxruntime-extensions are needed to run the graph on the CPU")


def _step(family: str, shadow: str = "bf16", num_draft: int = 0):
    if family == "kda":
        from builders.kda import tiny_model
        from builders.kimi_step import KimiKDADecodeStep

        return KimiKDADecodeStep(tiny_model("kimi_linear"), L, MAX_SEQ, shadow=shadow, num_draft=num_draft)
    if family == "gdn":
        from builders.qwen3_next import tiny_model
        from builders.qwen_export import QwenGDNDecodeStep

        return QwenGDNDecodeStep(tiny_model("qwen3_next"), L, MAX_SEQ, shadow=shadow, num_draft=num_draft)
    from builders.nemotron_h import load_nemotron_h

    return NemotronHDecodeStep(load_nemotron_h(), L, MAX_SEQ, shadow=shadow, num_draft=num_draft)


def test_row_order_is_refused_where_no_plugin_reads_it():
    with pytest.raises(ValueError, match=r"row_order: .*verify plugins take \(batch,\) rows"):
        _step("kda", num_draft=1).set_row_order(True)
    with pytest.raises(ValueError, match=r"row_order: mamba2_decode takes no order .*--shadow bf16 or fp8"):
        _step("mamba2", shadow="none").set_row_order(True)
    with pytest.raises(TypeError, match="row_order: expected a bool"):
        _step("kda").set_row_order(1)


@needs_ort
@pytest.mark.parametrize("family", ["kda", "gdn", "mamba2"])
def test_graph_with_the_order_equals_the_graph_without(family, tmp_path):
    from builders.ort_reference import feed, session

    step = _step(family)
    export_onnx(step, tmp_path / "plain.onnx")
    step.set_row_order(True)
    export_onnx(step, tmp_path / "ordered.onnx")
    graph = onnx.load(str(tmp_path / "ordered.onnx"), load_external_data=False).graph
    order = [n for n in graph.node if n.domain == DOMAIN and n.op_type == ORDER_OP_TYPE]
    decode = [n for n in graph.node if n.domain == DOMAIN and n.op_type == step.op_type]
    assert len(order) == 1 and len(decode) == len(step.ssm_layers()) >= 2
    assert {a.name: a.i for a in order[0].attribute if a.name == "buffer_len"} == {"buffer_len": L}
    assert order[0].input[1] == "cursor" and all(n.input[7] == order[0].output[0] for n in decode)
    plain = onnx.load(str(tmp_path / "plain.onnx"), load_external_data=False).graph
    assert not any(n.op_type == ORDER_OP_TYPE for n in plain.node)

    runs = [session(tmp_path / "plain.onnx"), session(tmp_path / "ordered.onnx")]
    names = step.input_names()
    g = torch.Generator().manual_seed(7)
    lengths = torch.zeros(BATCH, dtype=torch.int32)
    cursor = torch.tensor([1, 3, 0], dtype=torch.int32)  # the rows flush at different steps
    states = [step.empty_states(BATCH), step.empty_states(BATCH)]
    for s in range(2 * L + 1):
        tok = torch.randint(2, 200, (BATCH, 1), generator=g)
        outs = [sess.run(None, feed(names, [tok, lengths, cursor, *st])) for sess, st in zip(runs, states)]
        for j, (a, b) in enumerate(zip(*outs)):  # bit for bit (NaN where NaN)
            np.testing.assert_array_equal(a, b, err_msg=f"step {s}: {step.output_names()[j]}", strict=True)
        lengths, cursor = torch.from_numpy(outs[0][1]), torch.from_numpy(outs[0][2])
        states = [[torch.from_numpy(v) for v in o[3:]] for o in outs]


def test_engine_directory_with_the_order(tmp_path):
    """build(row_order=True) (scripts/build_engine.py --row-order): model.onnx with the flush_order node, the decode
    node's PTX that of the module reading the order, flush_order's PTX and launch in config.json, both plugins named
    for trtexec; a speculative build is refused by flag."""
    import json

    from builders.engine import BuildError, BuildOptions, build
    from trtllm_replayssm import trt_plugin as tp
    from trtllm_replayssm.families.kda import trt_plugin as kp

    out = build(BuildOptions(out=tmp_path / "e", tiny="kimi_linear", buffer_len=L, max_seq_len=MAX_SEQ, max_batch=2,
                             shadow="bf16", row_order=True))
    cfg = json.loads((out / "config.json").read_text())
    plugin = cfg["plugin"]
    attrs = [plugin[a] for a in kp.ATTRIBUTES]
    for k in plugin["kernels"]:
        assert (out / k["ptx"]).read_bytes() == kp.aot_kernel(*attrs, "f32", 90, k["tactic"], "bf16", row_order=True).ptx
    order = plugin["row_order"]
    assert order["op_type"] == tp.ORDER_PLUGIN_NAME and order["inputs"] == list(tp.ORDER_INPUT_NAMES)
    (k,) = order["kernels"]
    assert (out / k["ptx"]).read_bytes() == tp.aot_order_kernel(L, 90).ptx and k["grid"] == [1, 1, 1]
    assert f"{DOMAIN}::{tp.ORDER_PLUGIN_NAME}" in (out / "trtexec.sh").read_text()
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert sum(n.op_type == ORDER_OP_TYPE for n in graph.node) == 1
    with pytest.raises(BuildError, match=r"row_order: .*num_draft=1"):
        build(BuildOptions(out=tmp_path / "s", tiny="kimi_linear", buffer_len=L, max_seq_len=MAX_SEQ, num_draft=1,
                           row_order=True))
