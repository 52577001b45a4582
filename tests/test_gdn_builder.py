# SPDX-License-Identifier: Apache-2.0
"""The Qwen3-Next / Qwen3.5 builder (builders/qwen3_next.py) on the CPU: transformers' own models, patched.

Oracle: the unpatched model's own decode (transformers' recurrent gated delta rule in fp32). The
patched GDN layers run the float64 ReplaySSM reference, so logits agree to fp32 rounding and the
greedy tokens exactly; a corrupted buffer must break the agreement (teeth)."""

import pytest
import torch

pytest.importorskip("transformers")

from builders.qwen3_next import FAMILIES, gdn_layers, patch_gdn_replayssm, reference_backend, tiny_model  # noqa: E402

L = 4  # small buffer: 39 decode steps cross 9 flushes


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return tiny_model(request.param)


def _prompt(batch, length, seed=1):
    return torch.randint(2, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, n, patched, backend=None):
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True)
    dec = patch_gdn_replayssm(model, buffer_len=L, backend=backend) if patched else None
    try:
        out = model.generate(ids, **kw)
    finally:
        if dec is not None:
            dec.unpatch()
    return out, dec


@torch.no_grad()
def test_greedy_tokens_and_logits_match_unpatched_model(model):
    ids = _prompt(2, 7)
    ref, _ = _generate(model, ids, 40, False)
    out, dec = _generate(model, ids, 40, True)
    again, _ = _generate(model, ids, 40, True)  # a fresh cache: the previous buffers must not leak in
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(again.sequences, ref.sequences)
    assert dec.cursor.tolist() == [39 % L] * 2  # 39 decode steps went through ReplaySSM
    assert len(dec.bufs) == len(gdn_layers(model)) == 3
    s_ref, s_out = torch.stack(ref.scores), torch.stack(out.scores)
    # float64 replay vs the model's fp32 recurrence: fp32 rounding of O(0.2)-std logits (measured 3e-7)
    assert torch.allclose(s_out, s_ref, rtol=0, atol=1e-5)
    assert (s_ref.std(-1) > 0.1).all()  # random weights are not degenerate


@torch.no_grad()
def test_corrupted_buffer_breaks_the_agreement(model):
    """Teeth: the same run with one buffered u entry of one layer scaled each step must differ."""
    first = gdn_layers(model)[0]

    def corrupting(buf, cursor, **kw):
        y = reference_backend(buf, cursor, **kw)
        if buf.u_cache.data_ptr() == dec_holder["dec"].bufs[first].u_cache.data_ptr():  # views of the cache
            buf.u_cache[:, :, 0] *= 3.0
        return y

    dec_holder = {}
    ids = _prompt(2, 7)
    ref, _ = _generate(model, ids, 12, False)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    dec_holder["dec"] = patch_gdn_replayssm(model, buffer_len=L, backend=corrupting)
    try:
        out = model.generate(ids, **kw)
    finally:
        dec_holder["dec"].unpatch()
    err = (torch.stack(out.scores) - torch.stack(ref.scores)).abs().max()
    assert err > 1e-3


@torch.no_grad()
def test_prefill_after_decode_folds_the_buffer(model):
    """A multi-token chunk after some decode steps sees the current state S_k, not the stale checkpoint."""
    from transformers import DynamicCache

    ids, more = _prompt(2, 5), _prompt(2, 3, seed=2)
    logits = []
    for patched in (False, True):
        dec = patch_gdn_replayssm(model, buffer_len=L) if patched else None
        try:
            cache = DynamicCache(config=model.config)
            tok = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(L + 2):  # one flush, then cursor 2
                tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            logits.append(model(more, cache=cache, use_cache=True).logits)
        finally:
            if dec is not None:
                dec.unpatch()
    assert dec.cursor.tolist() == [0, 0]  # the prefill handed a fresh checkpoint over
    assert torch.allclose(logits[1], logits[0], rtol=0, atol=1e-5)


def test_rejects_other_models_and_bad_buffer_len(model):
    with pytest.raises(ValueError, match="buffer_len: expected 1..32, got 0"):
        patch_gdn_replayssm(model, buffer_len=0)
    from builders.nemotron_h import load_nemotron_h

    with pytest.raises(ValueError, match="model: expected a Qwen3-Next or Qwen3.5"):
        patch_gdn_replayssm(load_nemotron_h(seed=0), buffer_len=L)


def test_beam_search_and_interleaved_conversations_match_unpatched(model):
    """Beam search, two interleaved conversations, unpatch mid-conversation (tests/helpers.py says how)."""
    from .helpers import check_beams_and_conversations

    check_beams_and_conversations(model, patch_gdn_replayssm, L, atol=1e-5)


def test_forward_raising_mid_step_breaks_only_its_cache(model):
    """An error inside a decode step (tests/helpers.py says how) is not silently continued from."""
    from .helpers import check_forward_raising_mid_step

    check_forward_raising_mid_step(model, patch_gdn_replayssm, L, atol=1e-5)


@pytest.mark.parametrize("model_type, gdn", [("qwen3_next", True), ("qwen3_5", True), ("qwen3_5_text", True),
                                             ("qwen3_5_moe", True), ("qwen3_5_moe_text", True), ("nemotron_h", False)])
def test_published_checkpoint_model_types_are_recognised(tmp_path, model_type, gdn):
    """The published Qwen3.5 directories carry the vision-language wrapper's model_type (qwen3_5 / qwen3_5_moe):
    they are GDN checkpoints for the builder (they used to go to the Nemotron loader); the registry of model kinds
    (builders/models.py) says which kind's loader and steps take a directory."""
    import json

    from builders import models
    from builders.qwen3_next import is_gdn_checkpoint

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert is_gdn_checkpoint(tmp_path) is gdn
    kind, tiny = models.for_source(tmp_path)
    assert (kind.family == "gdn") is gdn and tiny is None and kind.is_checkpoint(tmp_path)


# ---- the decode step with explicit state I/O, and its ONNX export ------------------------------------
MAX_SEQ, STEPS = 64, 3 * L + 1


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    from builders.qwen_export import QwenGDNDecodeStep, export_onnx

    pytest.importorskip("onnx", reason="onnx is not installed")
    step = QwenGDNDecodeStep(model, L, MAX_SEQ)
    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    export_onnx(step, path)
    return step, path


@torch.no_grad()
def _against_patched(model, step, run):
    """``run(tok, lengths, cursor, states) -> outputs`` against the patched model, each following its own
    greedy tokens over 3L+1 steps from a real prefill: same logits (fp32 rounding), tokens and cursor."""
    from transformers import DynamicCache

    dec = patch_gdn_replayssm(model, buffer_len=L)
    try:
        batch, prompt = 3, 6
        cache = DynamicCache(config=model.config)
        tok = model(_prompt(batch, prompt, seed=4), cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        lengths = torch.full((batch,), prompt, dtype=torch.int32)
        cursor, states = dec.cursor.clone(), step.states_from_patched(dec, cache, prompt)
        for s in range(STEPS):
            want = model(tok, cache=cache, use_cache=True).logits[:, -1]
            got = run(tok, lengths, cursor, states)
            torch.testing.assert_close(got[0], want, rtol=0, atol=1e-5, msg=f"step {s}: logits")
            assert torch.equal(got[2], dec.cursor) and torch.equal(got[1], lengths + 1), f"step {s}"
            tok = want.argmax(-1, keepdim=True)
            assert torch.equal(got[0].argmax(-1), tok[:, 0]), f"step {s}: greedy tokens"
            lengths, cursor, states = got[1], got[2], list(got[3:])
    finally:
        dec.unpatch()


def test_decode_step_matches_patched_model(model):
    from builders.qwen_export import QwenGDNDecodeStep

    step = QwenGDNDecodeStep(model, L, MAX_SEQ)
    _against_patched(model, step, lambda tok, n, c, st: step(tok, n, c, *st))


def test_onnx_graph_has_one_plugin_node_per_gdn_layer(model, exported):
    import onnx

    from builders.decode_step import DOMAIN
    from builders.qwen_export import GDN_OP_TYPE

    step, path = exported
    g = onnx.load(str(path))
    onnx.checker.check_model(g)
    nodes = [n for n in g.graph.node if n.domain == DOMAIN]
    assert len(nodes) == len(gdn_layers(model)) and all(n.op_type == GDN_OP_TYPE for n in nodes)
    c = model.config
    for n, i in zip(nodes, gdn_layers(model)):
        attrs = {a.name: (a.s.decode() if a.type == onnx.AttributeProto.STRING else a.i) for a in n.attribute}
        assert attrs == dict(plugin_namespace=DOMAIN, aot=1, num_k_heads=c.linear_num_key_heads,
                             num_v_heads=c.linear_num_value_heads, key_dim=c.linear_key_head_dim,
                             value_dim=c.linear_value_head_dim, buffer_len=L, use_qk_l2norm=1)
        assert len(n.input) == 15 and len(n.output) == 7
        assert list(n.input[8:]) == ["cursor"] + [f"{s}_{i}" for s in ("gdn_state", "gdn_u", "gdn_v", "gdn_k",
                                                                         "gdn_g", "gdn_beta")]
    assert [i.name for i in g.graph.input] == step.input_names()
    assert [o.name for o in g.graph.output] == step.output_names()
    ops = {n.op_type for n in g.graph.node if n.domain != DOMAIN}
    assert not ops & {"NonZero", "Loop", "If", "Scan", "ScatterND", "ScatterElements"}, ops
    if any(hasattr(model.model.layers[i].mlp, "experts") for i in range(len(c.layer_types))):
        assert sum(n.op_type == "TopK" for n in g.graph.node) == len(c.layer_types)  # one per MoE layer


def test_onnx_reproduces_the_patched_model(model, exported):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions is not installed")
    import numpy as np

    from builders.ort_reference import session

    step, path = exported
    sess, names = session(path), step.input_names()

    def run(tok, lengths, cursor, states):
        feed = [t.numpy().copy() for t in (tok, lengths, cursor, *states)]
        return [torch.from_numpy(np.asarray(o)) for o in sess.run(None, dict(zip(names, feed)))]

    _against_patched(model, step, run)


@torch.no_grad()
@pytest.mark.parametrize("formulation", ["dense", "gather"])
def test_qwen_moe_formulations_match_transformers(formulation):
    """builders/qwen_export.moe_qwen, both formulations, against transformers' Qwen3NextSparseMoeBlock (fp32)."""
    from builders.qwen_export import moe_qwen

    model = tiny_model("qwen3_next")
    gen = torch.Generator().manual_seed(3)
    layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert layers
    for mlp in layers:
        h = torch.randn(7, model.config.hidden_size, generator=gen)
        torch.testing.assert_close(moe_qwen(h, mlp, formulation), mlp(h[None])[0], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="moe_formulation: expected one of \\('dense', 'gather'\\), got 'sorted'"):
        moe_qwen(h, layers[0], "sorted")


def test_onnx_gather_formulation_reproduces_the_patched_model(tmp_path):
    """The decode step of the tiny Qwen3-Next with the gather MoE: the graph gathers each token's experts
    (the dense graph does not), no data-dependent op, and onnxruntime follows the patched model."""
    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions is not installed")
    import numpy as np

    from builders.ort_reference import session
    from builders.qwen_export import QwenGDNDecodeStep, export_onnx

    model = tiny_model("qwen3_next")
    graphs = {}
    for formulation in ("dense", "gather"):
        step = QwenGDNDecodeStep(model, L, MAX_SEQ, moe_formulation=formulation)
        graphs[formulation] = (step, tmp_path / f"{formulation}.onnx")
        export_onnx(step, graphs[formulation][1])
    ops = {f: [n.op_type for n in onnx.load(str(p)).graph.node] for f, (_, p) in graphs.items()}
    assert ops["gather"].count("Gather") >= ops["dense"].count("Gather") + 2 * len(model.model.layers)
    assert not set(ops["gather"]) & {"NonZero", "Loop", "If", "Scan", "ScatterND", "ScatterElements"}
    with pytest.raises(ValueError, match="moe_formulation: expected one of"):
        QwenGDNDecodeStep(model, L, MAX_SEQ, moe_formulation="sorted")

    step, path = graphs["gather"]
    sess, names = session(path), step.input_names()

    def run(tok, lengths, cursor, states):
        feed = [t.numpy().copy() for t in (tok, lengths, cursor, *states)]
        return [torch.from_numpy(np.asarray(o)) for o in sess.run(None, dict(zip(names, feed)))]

    _against_patched(model, step, run)


# ---- scripts/build_engine.py for the GDN families -------------------------------------------------------
def _build(*args):
    from .build_cli import build_engine

    return build_engine(*args, timeout=170)


@pytest.mark.parametrize("tiny", sorted(FAMILIES))
def test_build_engine_tiny_gdn(tmp_path, tiny):
    import json

    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    from builders.decode_step import DOMAIN
    from trtllm_replayssm.families.gdn import trt_plugin as gp

    out = tmp_path / "engine"
    r = _build("--out", out, "--buffer-len", L, "--max-seq-len", MAX_SEQ, "--max-batch", 4, "--tiny", tiny)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]  # no temporary directory survives
    assert f"the trtexec command is in {out / 'trtexec.sh'}" in r.stdout and "trtexec --onnx" not in r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["pattern"] == "GGG*" and cfg["model"]["gdn_layers"] == [0, 1, 2]
    if tiny in ("qwen3_next", "qwen3_5_moe"):  # sparse MoE in every layer: its keys and the graph formulation
        from builders.qwen3_next import FAMILIES

        moe = cfg["model"]["moe"]
        assert cfg["model"]["moe_layers"] == [0, 1, 2, 3] and moe["formulation"] == "dense"
        assert moe["num_experts"] == FAMILIES[tiny]["num_experts"] and moe["num_experts_per_tok"] == 2
    else:
        assert "moe" not in cfg["model"] and "moe_layers" not in cfg["model"]
    plugin = cfg["plugin"]
    assert plugin["op_type"] == gp.DECODE and plugin["nodes"] == 3
    assert plugin["inputs"] == list(gp.INPUT_NAMES) and plugin["outputs"] == list(gp.OUTPUT_NAMES)
    for k in plugin["kernels"]:  # the PTX aot_impl hands TensorRT for each tactic
        want = gp.aot_kernel(2, 4, 64, 64, L, 1, "f32", 90, k["tactic"])
        assert (out / k["ptx"]).read_bytes() == want.ptx and k["grid"] == [want.grid_x, "batch", 1]
    g = onnx.load(str(out / "model.onnx"))
    assert sum(n.domain == DOMAIN for n in g.graph.node) == 3
    assert {s["name"] for s in cfg["states"]} | {"input_ids"} == {i.name for i in g.graph.input}
    assert {s["output"] for s in cfg["states"]} | {"logits"} == {o.name for o in g.graph.output}


@pytest.mark.parametrize("tiny", sorted(FAMILIES))
def test_build_engine_gdn_spec(tmp_path, tiny):
    """--num-draft for a GDN model: verify.onnx (one gdn_verify node per GDN layer) + commit.onnx, the PTX
    aot_impl hands TensorRT for gdn_verify and spec_commit, the states and which graph updates each."""
    import json

    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    from builders.decode_step import DOMAIN
    from trtllm_replayssm.families.gdn import trt_plugin as gp

    out = tmp_path / "spec"
    r = _build("--out", out, "--buffer-len", 8, "--max-seq-len", MAX_SEQ, "--max-batch", 4, "--num-draft", 3,
               "--tiny", tiny)
    assert r.returncode == 0, r.stderr
    assert "verify.plan and commit.plan not built" in r.stdout and "trtexec --onnx" not in r.stdout
    assert f"the two trtexec commands are in {out / 'trtexec.sh'}" in r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["format"] == "trtllm-replayssm-spec-step/1" and (cfg["num_draft"], cfg["num_tokens"]) == (3, 4)
    assert cfg["model"]["pattern"] == "GGG*" and cfg["conv_window"] == 3 + 3
    plugins = {p["id"]: p for p in cfg["plugin"]["plugins"]}
    assert set(plugins) == {"replayssm::gdn_verify", "replayssm::spec_commit"}
    verify = plugins["replayssm::gdn_verify"]
    assert verify["attributes"] == dict(num_k_heads=2, num_v_heads=4, key_dim=64, value_dim=64, buffer_len=8,
                                        use_qk_l2norm=1, num_tokens=4)
    assert verify["nodes"] == 3 and verify["inputs"] == list(gp.INPUT_NAMES)
    for k in verify["kernels"]:
        want = gp.aot_verify_kernel(2, 4, 64, 64, 8, 1, 4, "f32", 90, k["tactic"])
        assert (out / k["ptx"]).read_bytes() == want.ptx and k["kernel"] == "gdn_verify"
    script = (out / "trtexec.sh").read_text()
    assert "replayssm::gdn_verify and replayssm::spec_commit" in script
    for name, op, count in (("verify", "gdn_verify", 3), ("commit", "spec_commit", 1)):
        g = onnx.load(str(out / f"{name}.onnx"))
        assert [n.op_type for n in g.graph.node if n.domain == DOMAIN] == [op] * count
        graph = cfg["graphs"][name]
        assert [i.name for i in g.graph.input] == [i["name"] for i in graph["inputs"]]
        assert [o.name for o in g.graph.output] == [o["name"] for o in graph["outputs"]]
    states = {s["name"]: s for s in cfg["states"]}
    assert states["conv_window_0"]["shape"] == [-1, 2 * 2 * 64 + 4 * 64, 6]
    assert states["conv_window_0"]["updated_by"] == {"verify": "conv_window_0_out", "commit": "conv_window_0_out"}
    assert states["gdn_u_1"]["updated_by"] == {"verify": "gdn_u_1_out"} and states["gdn_u_1"]["shape"] == [-1, 4, 8, 64]


def test_build_engine_gdn_moe_formulation_reaches_the_graph(tmp_path):
    """--moe-formulation gather for a Qwen3-Next: recorded in config.json and the graph differs from the dense
    one (it was ignored for GDN models before: both builds wrote the same model.onnx)."""
    import json

    pytest.importorskip("onnx", reason="onnx is not installed")
    out = {}
    for formulation in ("dense", "gather"):
        out[formulation] = tmp_path / formulation
        r = _build("--out", out[formulation], "--buffer-len", L, "--max-seq-len", MAX_SEQ, "--max-batch", 2,
                   "--tiny", "qwen3_next", "--moe-formulation", formulation)
        assert r.returncode == 0, r.stderr
        assert f"as {formulation} standard ONNX ops" in r.stdout
        cfg = json.loads((out[formulation] / "config.json").read_text())
        assert cfg["model"]["moe"]["formulation"] == formulation
    assert (out["dense"] / "model.onnx").read_bytes() != (out["gather"] / "model.onnx").read_bytes()


def test_build_engine_gdn_refuses_what_it_cannot_build(tmp_path):
    r = _build("--out", tmp_path / "e", "--tiny", "qwen3_5", "--state-dtype", "bf16")
    assert r.returncode == 1 and "--state-dtype: Gated DeltaNet checkpoints are fp32" in r.stderr
    r = _build("--out", tmp_path / "e", "--tiny", "qwen3_5", "--num-draft", 3, "--buffer-len", 4)
    assert r.returncode == 2 and "--buffer-len: speculative decoding needs >= 2 (num_draft + 1) = 8" in r.stderr
    assert not (tmp_path / "e").exists() and list(tmp_path.iterdir()) == []



def _save_qwen(path, drop=(), **overrides):
    """A Qwen3.5 checkpoint directory (save_pretrained), less the tensors in ``drop``."""
    from safetensors.torch import load_file, save_file

    tiny_model("qwen3_5", **overrides).save_pretrained(path)
    for f in path.glob("*.safetensors"):
        sd = load_file(f)
        save_file({k: v for k, v in sd.items() if k not in drop}, f, metadata={"format": "pt"})
    return path


def test_build_engine_gdn_checkpoint_missing_a_tensor_is_refused(tmp_path):
    """A Qwen checkpoint missing a tensor is refused naming it, as a Nemotron one is (transformers' loader only
    warns and initialises the tensor at random: the engine was built, with random weights, exit 0)."""
    key = "model.layers.1.linear_attn.in_proj_qkv.weight"
    ckpt = _save_qwen(tmp_path / "ckpt", drop=(key,))
    r = _build("--out", tmp_path / "engine", "--model", ckpt, "--max-seq-len", MAX_SEQ)
    assert r.returncode == 1 and "missing" in r.stderr and key in r.stderr, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_gdn_checkpoint_errors_name_the_problem(tmp_path):
    """Layer types the step cannot run, a mis-shaped tensor and a directory without weights: CheckpointError naming
    the key (they were an AttributeError in the middle of the ONNX export, or transformers' own exceptions)."""
    from safetensors.torch import load_file, save_file

    from builders.nemotron_h import CheckpointError
    from builders.qwen3_next import load_gdn_model

    odd = _save_qwen(tmp_path / "odd", layer_types=["linear_attention"] * 3 + ["sliding_attention"])
    with pytest.raises(CheckpointError, match=r"layer_types: expected only .*'sliding_attention' at layer 3"):
        load_gdn_model(odd)
    bad = _save_qwen(tmp_path / "bad")
    f = next(bad.glob("*.safetensors"))
    sd = load_file(f)
    sd["model.layers.0.linear_attn.dt_bias"] = torch.zeros(7)
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.0.linear_attn.dt_bias"):
        load_gdn_model(bad)
    f.unlink()
    with pytest.raises(CheckpointError, match="bad"):
        load_gdn_model(bad)


@torch.no_grad()
def test_check_values_reaches_the_cache(model):
    """patch_gdn_replayssm(check_values=...) is the cache's (host checks of slots and cursors)."""
    ids = _prompt(2, 5)
    for check in (None, False):
        dec = patch_gdn_replayssm(model, buffer_len=L, check_values=check)
        try:
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        finally:
            dec.unpatch()
        assert dec.cache.check_values is check and dec.cursor.tolist() == [2, 2]
