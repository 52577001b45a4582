# SPDX-License-Identifier: Apache-2.0
"""Engines with a checkpoint shadow (``build_engine.py --shadow bf16|fp8``), on the CPU: Nemotron-H (Mamba-2;
bf16 and fp8 with its row scales) and Qwen3-Next (Gated DeltaNet; bf16). Speculative engines: the config here,
the verify graphs in tests/test_spec_builder.py and tests/test_gdn_spec_builder.py.

The exported graph has one shadow plugin node per SSM layer (``replayssm::mamba2_decode_shadow`` /
``gdn_decode_shadow``) and one more state per layer, ``ssm_shadow_i`` / ``gdn_shadow_i`` (+
``ssm_shadow_scale_i`` for fp8), after its checkpoint. In onnxruntime (the plugin ops = the float64
references with the shadow) the graph follows the PyTorch step over 3L + 1 steps; the shadow is
quantize_shadow of the checkpoint after every flush and passes through unchanged otherwise; non-flush outputs
read it (teeth); the logits stay near the engine without a
shadow. Options and format errors name what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from builders.engine import BuildError, BuildOptions, build, check_options
from builders.engine_format import FormatError, check_layer_states

L = 4
STEPS = 3 * L + 1
BATCH = 3
FAMILIES = {  # tiny -> (checkpoint state prefix, shadow state prefix, shadow plugin op, config.json layer list)
    "nemotron_h": ("ssm_state", "ssm_shadow", "mamba2_decode_shadow", "mamba_layers"),
    "qwen3_next": ("gdn_state", "gdn_shadow", "gdn_decode_shadow", "gdn_layers"),
}

pytest.importorskip("onnx", reason="onnx is not installed")
needs_ort = pytest.mark.skipif(
    __import__("importlib").util.find_spec("onnxruntime_extensions") is None,
    reason="onnxruntime-extensions is not installed (the plugin op's CPU reference runs through it)")


@pytest.fixture(scope="module", params=[("nemotron_h", "bf16"), ("nemotron_h", "fp8"), ("qwen3_next", "bf16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def engines(tmp_path_factory, request):
    family, kind = request.param
    root = tmp_path_factory.mktemp(f"shadow-{family}-{kind}")
    out = {"family": family, "kind": kind}
    for shadow in ("none", kind):
        out["shadow" if shadow != "none" else "none"] = build(BuildOptions(
            out=root / shadow, tiny=family, buffer_len=L, max_batch=BATCH, max_seq_len=48, shadow=shadow))
    return out


def _steps(family, kind):
    """(step with the shadow, step without) of the engines' tiny model (seed 0, fp32)."""
    if family == "nemotron_h":
        from builders.decode_step import NemotronHDecodeStep
        from builders.nemotron_h import load_nemotron_h

        model = load_nemotron_h(None, dtype=torch.float32, seed=0, tiny="nemotron_h")
        return NemotronHDecodeStep(model, L, 48, shadow=kind), NemotronHDecodeStep(model, L, 48)
    from builders.qwen3_next import load_gdn_model
    from builders.qwen_export import QwenGDNDecodeStep

    model = load_gdn_model(None, tiny=family, dtype=torch.float32, seed=0)
    return QwenGDNDecodeStep(model, L, 48, shadow=kind), QwenGDNDecodeStep(model, L, 48)


def _quantize(state, kind):
    """The shadow states of a checkpoint: [bf16] or [fp8 values, row scales] (shadow.quantize_shadow)."""
    from trtllm_replayssm.shadow import quantize_shadow

    if kind == "bf16":
        return [state.to(torch.bfloat16)]
    q = torch.empty(state.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(state.shape[:-1])
    quantize_shadow(state, q, scale)
    return [q, scale]


def test_directory_lists_the_shadow_states_and_the_shadow_plugin(engines):
    kind = engines["kind"]
    cfg = json.loads((engines["shadow"] / "config.json").read_text())
    plain = json.loads((engines["none"] / "config.json").read_text())
    assert cfg["shadow"] == kind and "shadow" not in plain
    ckpt, shadow, op, layers = FAMILIES[engines["family"]]
    names = [s["name"] for s in cfg["states"]]
    ssm = cfg["model"][layers]
    for i in ssm:
        j = names.index(f"{ckpt}_{i}")
        assert names[j + 1] == f"{shadow}_{i}", names
        st = cfg["states"][j + 1]
        assert st["dtype"] == ("bfloat16" if kind == "bf16" else "float8_e4m3fn")
        assert st["shape"] == cfg["states"][j]["shape"] and st["output"] == f"{shadow}_{i}_out"
        if kind == "fp8":  # the per-row scales follow
            sc = cfg["states"][j + 2]
            assert sc["name"] == f"{shadow}_scale_{i}" and sc["dtype"] == "float32"
            assert sc["shape"] == cfg["states"][j]["shape"][:-1]
    assert len(names) == len(plain["states"]) + len(ssm) * (2 if kind == "fp8" else 1)
    p = cfg["plugin"]
    assert p["op_type"] == op and p["nodes"] == len(ssm)
    assert "shadow" in p["inputs"] and p["aliased_outputs"]["shadow_out"] == "shadow"
    assert all(f"_sh-{kind}_" in k["spec"] for k in p["kernels"])
    assert all((engines["shadow"] / k["ptx"]).is_file() for k in p["kernels"])
    assert f"{shadow}_{ssm[0]}:1x" in (engines["shadow"] / "trtexec.sh").read_text()
    check_layer_states(cfg)
    import onnx

    g = onnx.load(str(engines["shadow"] / "model.onnx"))
    ops = [n.op_type for n in g.graph.node if n.domain == "replayssm"]
    assert ops == [op] * len(ssm)
    ins = {v.name: v.type.tensor_type.elem_type for v in g.graph.input}
    want = onnx.TensorProto.BFLOAT16 if kind == "bf16" else onnx.TensorProto.FLOAT8E4M3FN
    assert all(ins[f"{shadow}_{i}"] == want for i in ssm)


def test_format_errors_name_the_shadow(engines):
    cfg = json.loads((engines["shadow"] / "config.json").read_text())
    name = f"{FAMILIES[engines['family']][1]}_0"
    with pytest.raises(FormatError, match=rf"states \['{name}'\] missing"):
        check_layer_states(dict(cfg, states=[s for s in cfg["states"] if s["name"] != name]))
    with pytest.raises(FormatError, match="shadow: expected one of"):
        check_layer_states(dict(cfg, shadow="fp4"))
    plain = json.loads((engines["none"] / "config.json").read_text())
    with pytest.raises(FormatError, match=name):  # a shadow state in an engine that says none
        check_layer_states(dict(plain, states=cfg["states"]))
    wrong = {"bfloat16": "float16", "float8_e4m3fn": "bfloat16"}  # a shadow state in another dtype than it says
    have = next(s["dtype"] for s in cfg["states"] if s["name"] == name)
    bad = [dict(s, dtype=wrong[have]) if s["name"] == name else s for s in cfg["states"]]
    with pytest.raises(FormatError, match=rf"state '{name}': dtype: expected '{have}'"):
        check_layer_states(dict(cfg, states=bad))
    ckpt = next(s for s in cfg["states"] if s["name"] == f"{FAMILIES[engines['family']][0]}_0")
    with pytest.raises(FormatError, match="dtype: expected 'float32'"):  # the fp32 checkpoint listed as bf16
        check_layer_states(dict(cfg, states=[dict(s, dtype="bfloat16") if s is ckpt else s for s in cfg["states"]]))
    with pytest.raises(FormatError, match="act_dtype: expected one of"):
        check_layer_states(dict(cfg, act_dtype="float8"))
    ckpt_name = f"{FAMILIES[engines['family']][0]}_"  # a shadow over a bf16 checkpoint, consistently described
    bf16_ckpt = [dict(s, dtype="bfloat16") if s["name"].startswith(ckpt_name) else s for s in cfg["states"]]
    with pytest.raises(FormatError, match="shadow .*: expected state_dtype 'fp32'.*got 'bf16'"):
        check_layer_states(dict(cfg, state_dtype="bf16", states=bf16_ckpt))


@pytest.mark.parametrize("kw, match", [
    (dict(shadow="fp4"), "--shadow: expected one of"),
    (dict(shadow="bf16", state_dtype="bf16"), "--state-dtype fp32"),
])
def test_bad_shadow_options_are_refused(tmp_path, kw, match):
    with pytest.raises(BuildError, match=match):
        check_options(BuildOptions(out=tmp_path / "x", **kw))


@pytest.mark.parametrize("tiny, kind, op, prefix, layers", [
    ("qwen3_next", "bf16", "gdn_verify_shadow", "gdn_shadow", "gdn_layers"),
    ("nemotron_h", "fp8", "mamba2_verify_shadow", "ssm_shadow", "mamba_layers"),
])
def test_speculative_shadow_engines(tmp_path, tiny, kind, op, prefix, layers):
    """Verify graphs carry the shadow states, updated by verify only (the graphs themselves:
    tests/test_spec_builder.py, tests/test_gdn_spec_builder.py); an fp8 GDN shadow is refused before loading."""
    out = build(BuildOptions(out=tmp_path / "q", tiny=tiny, buffer_len=L, max_batch=2, max_seq_len=48,
                             num_draft=1, shadow=kind))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["shadow"] == kind
    assert [p["op_type"] for p in cfg["plugin"]["plugins"]] == [op, "spec_commit"]
    assert all(f"_sh-{kind}_" in k["spec"] for k in cfg["plugin"]["plugins"][0]["kernels"])
    sh = [s for s in cfg["states"] if s["name"].startswith(prefix + "_")]
    assert len(sh) == len(cfg["model"][layers]) * (2 if kind == "fp8" else 1)
    assert all(s["updated_by"] == {"verify": f"{s['name']}_out"} for s in sh)
    check_layer_states(cfg)
    with pytest.raises(BuildError, match="there is no fp8 GDN shadow"):
        build(BuildOptions(out=tmp_path / "g", tiny="qwen3_next", shadow="fp8"))
    assert not (tmp_path / "g").exists()


@needs_ort
@torch.no_grad()
def test_graph_follows_the_step_and_the_shadow_follows_the_checkpoint(engines):
    from builders.ort_reference import feed, session, to_torch

    kind = engines["kind"]
    step, plain = _steps(engines["family"], kind)
    sess, sess_plain = session(engines["shadow"] / "model.onnx"), session(engines["none"] / "model.onnx")
    specs = step.state_specs()
    prefix = FAMILIES[engines["family"]][1] + "_"
    shadow_at = [j for j, s in enumerate(specs) if s.name.startswith(prefix) and "_scale_" not in s.name]
    n = 2 if kind == "fp8" else 1  # shadow states per layer
    extra = {j + k for j in shadow_at for k in range(n)}
    gen = torch.Generator().manual_seed(3)
    tok = torch.randint(2, 256, (BATCH, 1), generator=gen)
    lengths = torch.zeros(BATCH, dtype=torch.int32)
    cursor = torch.tensor([0, 1, L - 1], dtype=torch.int32)  # row 2 flushes on the first step
    states = step.empty_states(BATCH)
    for j in shadow_at:  # a non-zero checkpoint and its shadow, as a prefill hand-off leaves them
        states[j - 1] = torch.randn(states[j - 1].shape, generator=gen) * 0.3
        states[j:j + n] = _quantize(states[j - 1], kind)
    plain_states = [t for j, t in enumerate(states) if j not in extra]
    for s in range(STEPS):
        want = step(tok, lengths, cursor, *states)
        got = sess.run(None, feed(step.input_names(), [tok, lengths, cursor, *states]))
        np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-4, atol=2e-5, err_msg=f"step {s}: logits")
        new = [to_torch(v, spec.dtype) for v, spec in zip(got[3:], specs)]
        flushed = cursor == L - 1
        for j in shadow_at:
            st = new[j - 1]
            # graph vs step: the flushed checkpoints differ in the last bits (ORT vs torch upstream), so may
            # their roundings, by one ulp of the shadow's format
            ulp = 2 ** -7 if kind == "bf16" else 2 ** -2
            torch.testing.assert_close(new[j].float(), want[3 + j].float(), rtol=ulp, atol=1e-6)
            for k, q in enumerate(_quantize(st, kind)):
                got_k, old = new[j + k], states[j + k]
                assert torch.equal(got_k[flushed], q[flushed]), f"step {s}: shadow state {k} after a flush"
                assert torch.equal(got_k[~flushed], old[~flushed]), f"step {s}: shadow state {k} written off a flush"
        # the engine without a shadow, on the same checkpoint and buffers: the shadow's rounding only
        ref = sess_plain.run(None, feed(plain.input_names(), [tok, lengths, cursor, *plain_states]))
        scale = float(np.abs(ref[0]).max())
        bound = 2e-2 if kind == "bf16" else 1e-1
        assert float(np.abs(got[0] - ref[0]).max()) < bound * scale, f"step {s}: logits vs the plain engine"
        tok = torch.from_numpy(got[0]).argmax(-1, keepdim=True)
        lengths, cursor = torch.from_numpy(got[1]), torch.from_numpy(got[2])
        states = new
        plain_states = [t for j, t in enumerate(new) if j not in extra]  # the shadow run's checkpoint, buffers


@needs_ort
@torch.no_grad()
def test_teeth_non_flush_outputs_read_the_shadow(engines):
    from builders.ort_reference import feed, session

    kind = engines["kind"]
    step, _ = _steps(engines["family"], kind)
    prefix = FAMILIES[engines["family"]][1] + "_"
    sess = session(engines["shadow"] / "model.onnx")
    gen = torch.Generator().manual_seed(5)
    states = step.empty_states(BATCH)
    specs = step.state_specs()
    n = 2 if kind == "fp8" else 1
    for j, spec in enumerate(specs):
        if spec.name.startswith(prefix) and "_scale_" not in spec.name:
            states[j - 1] = torch.randn(states[j - 1].shape, generator=gen)
            states[j:j + n] = _quantize(states[j - 1], kind)
    tok = torch.randint(2, 256, (BATCH, 1), generator=gen)
    lengths, cursor = torch.zeros(BATCH, dtype=torch.int32), torch.zeros(BATCH, dtype=torch.int32)  # no flush
    base = sess.run(None, feed(step.input_names(), [tok, lengths, cursor, *states]))[0]
    j = next(j for j, s in enumerate(specs) if s.name.startswith(prefix))
    states[j] = torch.zeros_like(states[j])  # the checkpoint kept, its shadow lost: the output must change
    moved = sess.run(None, feed(step.input_names(), [tok, lengths, cursor, *states]))[0]
    assert float(np.abs(moved - base).max()) > 1e-3


def test_triton_repository_pairs_the_shadow_states(engines, tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
    from builders.triton_repo import RepoError, make_repo

    if engines["kind"] == "fp8":  # Triton's model config has no fp8 data type: refused by name
        with pytest.raises(RepoError, match="float8_e4m3fn' has no Triton type"):
            make_repo(engines["shadow"], tmp_path / "repo")
        return
    target = make_repo(engines["shadow"], tmp_path / "repo")
    text = (target / "config.pbtxt").read_text()
    name = f"{FAMILIES[engines['family']][1]}_0"
    assert f'input_name: "{name}"' in text and f'output_name: "{name}_out"' in text
    assert "TYPE_BF16" in text


@needs_ort
def test_ort_refuses_a_shadow_wired_to_the_wrong_scale(engines, tmp_path):
    """The CPU session tells bf16 from fp8 by the scale input: a graph whose fp8 shadow takes the (1,) placeholder
    (or whose bf16 shadow takes a row-scale input) is refused when the session is made, not run unscaled."""
    import onnx

    from builders.ort_reference import session

    if engines["family"] != "nemotron_h":
        pytest.skip("the Mamba-2 shadow nodes carry the scale input")
    g = onnx.load(str(engines["shadow"] / "model.onnx"))
    node = next(n for n in g.graph.node if n.op_type == "mamba2_decode_shadow")
    ins = {v.name for v in g.graph.input}
    if engines["kind"] == "fp8":
        placeholder = "scale_placeholder_for_test"
        g.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(1, np.float32), placeholder))
        node.input[14] = placeholder
        match = "needs its row scales as a state input"
    else:
        node.input[14] = next(n for n in ins if n.startswith("ssm_state_"))
        match = "takes the \\(1,\\) placeholder"
    onnx.save(g, str(tmp_path / "bad.onnx"))
    with pytest.raises(ValueError, match=match):
        session(tmp_path / "bad.onnx")

