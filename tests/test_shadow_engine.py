# SPDX-License-Identifier: Apache-2.0
"""Standard engines with a bf16 checkpoint shadow (``build_engine.py --shadow bf16``), on the CPU: Nemotron-H
(Mamba-2) and Qwen3-Next (Gated DeltaNet).

The exported graph has one shadow plugin node per SSM layer (``replayssm::mamba2_decode_shadow`` /
``gdn_decode_shadow``) and one more state per layer, ``ssm_shadow_i`` / ``gdn_shadow_i`` (bf16), after its
checkpoint. In onnxruntime (the plugin ops = the float64 references with the shadow) the graph follows the
PyTorch step over 3L + 1 steps; the shadow is the bf16 rounding of the checkpoint after every flush and passes
through unchanged otherwise; non-flush outputs read it (teeth); the logits stay near the engine without a
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


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def engines(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"shadow-{request.param}")
    out = {"family": request.param}
    for shadow in ("none", "bf16"):
        out[shadow] = build(BuildOptions(out=root / shadow, tiny=request.param, buffer_len=L, max_batch=BATCH,
                                         max_seq_len=48, shadow=shadow))
    return out


def _steps(family):
    """(model, step with the shadow, step without) of the engines' tiny model (seed 0, fp32)."""
    if family == "nemotron_h":
        from builders.decode_step import NemotronHDecodeStep
        from builders.nemotron_h import load_nemotron_h

        model = load_nemotron_h(None, dtype=torch.float32, seed=0, tiny="nemotron_h")
        return NemotronHDecodeStep(model, L, 48, shadow="bf16"), NemotronHDecodeStep(model, L, 48)
    from builders.gdn_step import QwenGDNDecodeStep
    from builders.qwen3_next import load_gdn_model

    model = load_gdn_model(None, tiny=family, dtype=torch.float32, seed=0)
    return QwenGDNDecodeStep(model, L, 48, shadow="bf16"), QwenGDNDecodeStep(model, L, 48)


def test_directory_lists_the_shadow_states_and_the_shadow_plugin(engines):
    cfg = json.loads((engines["bf16"] / "config.json").read_text())
    plain = json.loads((engines["none"] / "config.json").read_text())
    assert cfg["shadow"] == "bf16" and "shadow" not in plain
    ckpt, shadow, op, layers = FAMILIES[engines["family"]]
    names = [s["name"] for s in cfg["states"]]
    ssm = cfg["model"][layers]
    for i in ssm:
        j = names.index(f"{ckpt}_{i}")
        assert names[j + 1] == f"{shadow}_{i}", names
        st = cfg["states"][j + 1]
        assert st["dtype"] == "bfloat16" and st["shape"] == cfg["states"][j]["shape"]
        assert st["output"] == f"{shadow}_{i}_out"
    assert len(names) == len(plain["states"]) + len(ssm)
    p = cfg["plugin"]
    assert p["op_type"] == op and p["nodes"] == len(ssm)
    assert "shadow" in p["inputs"] and p["aliased_outputs"]["shadow_out"] == "shadow"
    assert all("_sh-bf16_" in k["spec"] for k in p["kernels"])
    assert all((engines["bf16"] / k["ptx"]).is_file() for k in p["kernels"])
    assert f"{shadow}_{ssm[0]}:1x" in (engines["bf16"] / "trtexec.sh").read_text()
    check_layer_states(cfg)
    import onnx

    g = onnx.load(str(engines["bf16"] / "model.onnx"))
    ops = [n.op_type for n in g.graph.node if n.domain == "replayssm"]
    assert ops == [op] * len(ssm)
    ins = {v.name: v.type.tensor_type.elem_type for v in g.graph.input}
    assert all(ins[f"{shadow}_{i}"] == onnx.TensorProto.BFLOAT16 for i in ssm)


def test_format_errors_name_the_shadow(engines):
    cfg = json.loads((engines["bf16"] / "config.json").read_text())
    name = f"{FAMILIES[engines['family']][1]}_0"
    with pytest.raises(FormatError, match=rf"states \['{name}'\] missing"):
        check_layer_states(dict(cfg, states=[s for s in cfg["states"] if s["name"] != name]))
    with pytest.raises(FormatError, match="shadow: expected one of"):
        check_layer_states(dict(cfg, shadow="fp8"))
    plain = json.loads((engines["none"] / "config.json").read_text())
    with pytest.raises(FormatError, match=name):  # a shadow state in an engine that says none
        check_layer_states(dict(plain, states=cfg["states"]))


@pytest.mark.parametrize("kw, match", [
    (dict(shadow="fp8"), "--shadow: expected one of"),
    (dict(shadow="bf16", state_dtype="bf16"), "--state-dtype fp32"),
])
def test_bad_shadow_options_are_refused(tmp_path, kw, match):
    with pytest.raises(BuildError, match=match):
        check_options(BuildOptions(out=tmp_path / "x", **kw))


def test_speculative_shadow_engines(tmp_path):
    """GDN verify graphs carry the shadow (gdn_verify_shadow, updated by verify only); Nemotron's are refused."""
    out = build(BuildOptions(out=tmp_path / "q", tiny="qwen3_next", buffer_len=L, max_batch=2, max_seq_len=48,
                             num_draft=1, shadow="bf16"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["shadow"] == "bf16"
    assert [p["op_type"] for p in cfg["plugin"]["plugins"]] == ["gdn_verify_shadow", "spec_commit"]
    sh = [s for s in cfg["states"] if s["name"].startswith("gdn_shadow_")]
    assert len(sh) == len(cfg["model"]["gdn_layers"]) and all(s["updated_by"] == {"verify": f"{s['name']}_out"}
                                                                for s in sh)
    check_layer_states(cfg)
    with pytest.raises(BuildError, match="speculative Nemotron engines have no checkpoint shadow"):
        build(BuildOptions(out=tmp_path / "n", buffer_len=16, num_draft=3, shadow="bf16"))
    assert not (tmp_path / "n").exists()


@needs_ort
@torch.no_grad()
def test_graph_follows_the_step_and_the_shadow_follows_the_checkpoint(engines):
    from builders.ort_reference import feed, session, to_torch

    step, plain = _steps(engines["family"])
    sess, sess_plain = session(engines["bf16"] / "model.onnx"), session(engines["none"] / "model.onnx")
    specs = step.state_specs()
    shadow_at = [j for j, s in enumerate(specs) if s.name.startswith(FAMILIES[engines["family"]][1] + "_")]
    gen = torch.Generator().manual_seed(3)
    tok = torch.randint(2, 256, (BATCH, 1), generator=gen)
    lengths = torch.zeros(BATCH, dtype=torch.int32)
    cursor = torch.tensor([0, 1, L - 1], dtype=torch.int32)  # row 2 flushes on the first step
    states = step.empty_states(BATCH)
    for j in shadow_at:  # a non-zero checkpoint and its shadow, as a prefill hand-off leaves them
        states[j - 1] = torch.randn(states[j - 1].shape, generator=gen) * 0.3
        states[j] = states[j - 1].to(torch.bfloat16)
    for j, spec in enumerate(specs):  # GDN rings start empty
        if spec.name.startswith(("gdn_g_", "gdn_beta_", "gdn_k_")):
            states[j] = torch.zeros_like(states[j])
    plain_states = [t for j, t in enumerate(states) if j not in shadow_at]
    for s in range(STEPS):
        want = step(tok, lengths, cursor, *states)
        got = sess.run(None, feed(step.input_names(), [tok, lengths, cursor, *states]))
        np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-4, atol=2e-5, err_msg=f"step {s}: logits")
        new = [to_torch(v, spec.dtype) for v, spec in zip(got[3:], specs)]
        flushed = cursor == L - 1
        for j in shadow_at:
            sh, st, old = new[j], new[j - 1], states[j]
            # graph vs step: the flushed checkpoints differ in the last bits (ORT vs torch upstream), so may
            # their bf16 roundings, by one bf16 ulp
            torch.testing.assert_close(sh.float(), want[3 + j].float(), rtol=2 ** -7, atol=1e-6)
            assert torch.equal(sh[flushed], st[flushed].to(torch.bfloat16)), f"step {s}: shadow after a flush"
            assert torch.equal(sh[~flushed], old[~flushed]), f"step {s}: shadow written on a non-flush step"
        # the engine without a shadow, on the same checkpoint and buffers: bf16-level difference only
        ref = sess_plain.run(None, feed(plain.input_names(), [tok, lengths, cursor, *plain_states]))
        scale = float(np.abs(ref[0]).max())
        assert float(np.abs(got[0] - ref[0]).max()) < 2e-2 * scale, f"step {s}: logits vs the plain engine"
        tok = torch.from_numpy(got[0]).argmax(-1, keepdim=True)
        lengths, cursor = torch.from_numpy(got[1]), torch.from_numpy(got[2])
        states = new
        plain_states = [t for j, t in enumerate(new) if j not in shadow_at]  # the shadow run's checkpoint, buffers


@needs_ort
@torch.no_grad()
def test_teeth_non_flush_outputs_read_the_shadow(engines):
    from builders.ort_reference import feed, session

    step, _ = _steps(engines["family"])
    prefix = FAMILIES[engines["family"]][1] + "_"
    sess = session(engines["bf16"] / "model.onnx")
    gen = torch.Generator().manual_seed(5)
    states = step.empty_states(BATCH)
    specs = step.state_specs()
    for j, spec in enumerate(specs):
        if spec.name.startswith(prefix):
            states[j - 1] = torch.randn(states[j - 1].shape, generator=gen)
            states[j] = states[j - 1].to(torch.bfloat16)
    tok = torch.randint(2, 256, (BATCH, 1), generator=gen)
    lengths, cursor = torch.zeros(BATCH, dtype=torch.int32), torch.zeros(BATCH, dtype=torch.int32)  # no flush
    base = sess.run(None, feed(step.input_names(), [tok, lengths, cursor, *states]))[0]
    j = next(j for j, s in enumerate(specs) if s.name.startswith(prefix))
    states[j] = torch.zeros_like(states[j])  # the checkpoint kept, its shadow lost: the output must change
    moved = sess.run(None, feed(step.input_names(), [tok, lengths, cursor, *states]))[0]
    assert float(np.abs(moved - base).max()) > 1e-3


def test_triton_repository_pairs_the_shadow_states(engines, tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
    from builders.triton_repo import make_repo

    target = make_repo(engines["bf16"], tmp_path / "repo")
    text = (target / "config.pbtxt").read_text()
    name = f"{FAMILIES[engines['family']][1]}_0"
    assert f'input_name: "{name}"' in text and f'output_name: "{name}_out"' in text
    assert "TYPE_BF16" in text
