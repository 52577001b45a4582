# SPDX-License-Identifier: Apache-2.0
"""The Kimi-Linear engine directory (``scripts/build_engine.py --tiny kimi_linear``) on the CPU: the exported decode
step (builders/kimi_step.py) with one ``replayssm::kda_decode`` node per Kimi Delta Attention layer, run under
onnxruntime with the family's reference op (trtllm_replayssm/families/kda/onnx_ops.py, registered by
builders/ort_reference.py), against the eager steps.

Oracles: (1) the generation engine's eager step, builders/kimi_step.py's ``KimiStep`` in the same SSM mode (replay /
replay_bf16), over a prompt fed token by token and its greedy continuation, crossing several ring folds (L = 4): the
KDA node and the cache's KDA layers run the same float64 spec (``families/kda/reference.replay_decode``) on inputs
that the two runtimes round differently in fp32, so the logits agree to fp32 rounding and the greedy tokens exactly;
(2) the patched transformers model (builders/kda.py) after its own prefill (``states_from_patched``), each following
its own greedy tokens. A corrupted ring entry must break (1) (teeth). TensorRT cannot be installed here: the plan
build is a GPU test that skips without it."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx", reason="onnx is not installed")

from builders import engine_format as ef  # noqa: E402
from builders.decode_step import DOMAIN  # noqa: E402
from builders.kda import tiny_model  # noqa: E402
from trtllm_replayssm.families.kda import trt_plugin as kp  # noqa: E402

from .build_cli import build_engine  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
L, MAX_SEQ, BATCH = 4, 32, 2  # a small ring: the 14 steps below fold it 3 times
# fp32 layers in two runtimes (onnxruntime's kernels and torch's reduce in other orders) around the same float64 KDA
# node on inputs that differ by that rounding (and a bf16 u ring that may round them to neighbouring values):
# observed <= 3e-6 on logits of magnitude ~1
ATOL = 1e-4

needs_ort = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("onnxruntime", "onnxruntime_extensions")),
    reason="onnxruntime and onnxruntime-extensions are needed to run the graph on the CPU")


_build = build_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("kda") / "engine"
    r = _build("--out", out, "--tiny", "kimi_linear", "--buffer-len", L, "--max-seq-len", MAX_SEQ, "--max-batch", 4)
    assert r.returncode == 0, r.stderr
    return out, r.stdout


@pytest.fixture(scope="module")
def model():
    return tiny_model("kimi_linear")


# ---- the format ------------------------------------------------------------------------------------------------
def test_format_states_follow_the_family_table_and_the_plugin():
    """engine_format's K rows are the family's state table (trtllm_replayssm/families/kda, the one home of the
    shapes) under ``kda_`` names, in the kda_decode plugin's input order, dtypes the family's (act: the engine's)."""
    from trtllm_replayssm import families

    fam = families.get("kda")
    sym = {"H": "num_heads", "K": "key_dim", "V": "value_dim", "L": "buffer_len"}
    rows = [t for t in fam.state_table if not t.optional]
    want = [(f"kda_{t.name.removesuffix('_cache')}", tuple(sym[d] for d in t.dims[1:]),
             t.dtype if t.dtype in ("act", "ring") else str(fam.dtypes[t.dtype]).removeprefix("torch."))
            for t in rows]
    assert [(s.prefix, s.dims, s.dtype) for s in ef.KDA_STATES[1:]] == want
    # the u ring's role resolves with the engine's shadow as the cache's does (layers.ring_dtype)
    from trtllm_replayssm.families.kda.layers import ring_dtype

    for shadow, shadow_dtype in (("none", None), ("bf16", torch.bfloat16)):
        u = next(s for s in ef.layer_states("K", shadow=shadow) if s.prefix == "kda_u")
        assert u.dtype == str(ring_dtype(torch.float32, shadow_dtype)).removeprefix("torch.")
    assert [t.name for t in rows] == list(kp.INPUT_NAMES[9:])
    shadow = next(t for t in fam.state_table if t.name == "shadow")
    sh = ef.SHADOW_STATES["K"]["bf16"][0]
    assert (sh.prefix, sh.dims, sh.dtype) == ("kda_shadow", tuple(sym[d] for d in shadow.dims[1:]), "bfloat16")
    assert [s.prefix for s in ef.layer_states("K", shadow="bf16")][:3] == ["conv_state", "kda_state", "kda_shadow"]
    with pytest.raises(ef.FormatError, match="a Kimi Delta Attention layer keeps a bf16 shadow, got 'fp8'"):
        ef.layer_states("K", shadow="fp8")


# ---- scripts/build_engine.py --tiny kimi_linear ---------------------------------------------------------------
def test_build_engine_tiny_kimi_linear(engine):
    out, stdout = engine
    assert sorted(p.name for p in out.parent.iterdir()) == ["engine"]  # no temporary directory survives
    assert "3 Kimi Delta Attention layers, heads=2 key dim=64 value dim=64; 1 MLA layers" in stdout
    assert "3 MoE layers: 4 experts, top-2, as dense" in stdout and "tests/test_kda_export.py" in stdout
    cfg = json.loads((out / "config.json").read_text())
    ef.check_layer_states(cfg)
    assert cfg["format"] == ef.DECODE_FORMAT and "shadow" not in cfg and cfg["state_dtype"] == "fp32"
    m = cfg["model"]
    assert (m["model_type"], m["pattern"], m["kda_layers"], m["attention_layers"], m["moe_layers"]) == (
        "kimi_linear", "KKKA", [0, 1, 2], [3], [1, 2, 3])
    assert m["moe"]["formulation"] == "dense" and m["moe"]["num_experts"] == 4
    plugin = cfg["plugin"]
    attrs = dict(num_heads=2, key_dim=64, value_dim=64, buffer_len=L, use_qk_l2norm=1, lower_bound_bits=0)
    assert plugin["op_type"] == kp.DECODE and plugin["nodes"] == 3 and {k: plugin[k] for k in attrs} == attrs
    assert plugin["inputs"] == list(kp.INPUT_NAMES) and plugin["outputs"] == list(kp.OUTPUT_NAMES)
    assert plugin["aliased_outputs"] == kp.PLUGINS[kp.DECODE].manifest()["aliased_outputs"]
    assert [k["tactic"] for k in plugin["kernels"]] == [1, 2]
    for k in plugin["kernels"]:  # the PTX and launch the plugin's aot_impl hands TensorRT, per tactic
        want = kp.aot_kernel(*attrs.values(), "f32", 90, k["tactic"])
        assert (out / k["ptx"]).read_bytes() == want.ptx and k["kernel"] == "kda_replay_decode"
        assert k["grid"] == [want.grid_x, "batch", 1] and k["extra_int32_args"] == ["batch", "slots"]
    states = {s["name"]: s for s in cfg["states"]}
    assert states["kda_u_0"]["dtype"] == "float32" and states["kda_u_0"]["shape"] == [-1, 2, L, 64]
    assert states["kda_state_2"]["shape"] == [-1, 2, 64, 64] and states["conv_state_1"]["shape"] == [-1, 384, 4]
    assert states["mla_kv_3"]["shape"] == [-1, MAX_SEQ, 32] and states["mla_k_rope_3"]["shape"] == [-1, MAX_SEQ, 16]
    assert "replayssm::kda_decode" in (out / "trtexec.sh").read_text()

    g = onnx.load(str(out / "model.onnx"))
    nodes = [n for n in g.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == [kp.DECODE] * 3 and all(len(n.input) == len(kp.INPUT_NAMES) for n in nodes)
    for n in nodes:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        assert a == {"plugin_namespace": b"replayssm", "aot": 1, **attrs}
    assert {s["name"] for s in cfg["states"]} | {"input_ids"} == {i.name for i in g.graph.input}
    assert {s["output"] for s in cfg["states"]} | {"logits"} == {o.name for o in g.graph.output}
    # static shapes TensorRT builds without plugins of its own (builders/moe.py): no data-dependent ops anywhere
    assert not {n.op_type for n in g.graph.node} & {"NonZero", "Loop", "If", "ScatterND", "ScatterElements"}


def test_triton_plan_repository_pairs_every_state(engine, tmp_path):
    """The tensorrt_plan Triton model of the engine (builders/triton_repo.py, format-driven): every state an implicit
    sequence state, the u ring (fp32 without a shadow) a TYPE_FP32 one."""
    pytest.importorskip("tritonclient")
    from builders import triton_repo as tr

    out, _ = engine
    target = tr.make_repo(out, tmp_path / "repo")
    text = (target / "config.pbtxt").read_text()
    assert target.name == "kimi_linear_replayssm" and (target / "1" / "MISSING_PLAN.txt").is_file()
    assert text.count("input_name: \"kda_u_") == 3 and "mla_k_rope_3" in text
    u = text[text.index('input_name: "kda_u_0"'):]
    assert u[:u.index("dims")].count("data_type: TYPE_FP32") == 1, "the fp32 u ring"


# ---- the graph under onnxruntime --------------------------------------------------------------------------------
def _ort(path):
    from builders.ort_reference import feed, session, to_torch

    sess = session(path)

    def run(step, tok, lengths, cursor, states):
        out = sess.run(None, feed(step.input_names(), [tok, lengths, cursor, *states]))
        return (torch.from_numpy(out[0]), torch.from_numpy(out[1]), torch.from_numpy(out[2]),
                [to_torch(v, s.dtype) for v, s in zip(out[3:], step.state_specs())])

    return run


@torch.no_grad()
def _against_kimi_step(model, path, shadow: str, corrupt_at: int | None = None):
    """The graph at ``path`` and KimiStep (mode replay / replay_bf16), from empty states: a 6-token prompt fed one token
    a step, then each follows the graph's greedy token, 14 steps (3 ring folds at L = 4). Returns the first step whose
    logits differ beyond ATOL (None: none did); ``corrupt_at``: before that step one live u-ring entry of layer 0 is
    changed in the graph's states."""
    from builders.kimi_step import KimiKDADecodeStep, KimiStep

    step = KimiKDADecodeStep(model, L, MAX_SEQ, shadow=shadow)
    eager = KimiStep(model, BATCH, MAX_SEQ, "replay" if shadow == "none" else f"replay_{shadow}", L)
    run = _ort(path)
    prompt = torch.randint(2, 256, (BATCH, 6), generator=torch.Generator().manual_seed(1))
    lengths, cursor = torch.zeros(BATCH, dtype=torch.int32), torch.zeros(BATCH, dtype=torch.int32)
    states, tok = step.empty_states(BATCH), prompt[:, :1]
    u0 = next(j for j, s in enumerate(step.state_specs()) if s.name == "kda_u_0")
    for s in range(14):
        if s == corrupt_at:
            assert int(cursor[0]) > 0, "the corrupted entry must be live"
            states[u0][0, 0, 0] += 1.0
        logits, lengths, cursor, states = run(step, tok, lengths, cursor, states)
        eager.ids.copy_(tok[:, 0])
        want = eager().float()
        if not torch.allclose(logits, want, rtol=0, atol=ATOL):
            return s
        assert torch.equal(logits.argmax(-1), want.argmax(-1)), f"step {s}: greedy tokens"
        assert torch.equal(lengths, torch.full((BATCH,), s + 1, dtype=torch.int32))
        assert torch.equal(cursor, torch.full((BATCH,), (s + 1) % L, dtype=torch.int32))
        if shadow != "none" and (s + 1) % L == 0:  # a fold rewrote each checkpoint's shadow from it
            for j, spec in enumerate(step.state_specs()):
                if spec.name.startswith("kda_shadow_"):
                    assert torch.equal(states[j], states[j - 1].to(torch.bfloat16)), f"step {s}: {spec.name}"
        tok = prompt[:, s + 1:s + 2] if s + 1 < prompt.shape[1] else logits.argmax(-1, keepdim=True)
    return None


@needs_ort
def test_graph_under_onnxruntime_is_the_eager_kimi_step(engine, model):
    out, _ = engine
    assert _against_kimi_step(model, out / "model.onnx", "none") is None


@needs_ort
def test_corrupted_ring_entry_breaks_the_agreement(engine, model):
    out, _ = engine
    assert _against_kimi_step(model, out / "model.onnx", "none", corrupt_at=6) == 6


@needs_ort
@torch.no_grad()
def test_graph_continues_a_patched_prefill(engine, model):
    """From the patched model's own prefill (transformers' chunked KDA, its MLA cache; states_from_patched), graph and
    patched model each follow their own greedy tokens: same logits to fp32 rounding, tokens and cursor."""
    from transformers import DynamicCache

    from builders.kda import patch_kda_replayssm
    from builders.kimi_step import KimiKDADecodeStep

    out, _ = engine
    step, run = KimiKDADecodeStep(model, L, MAX_SEQ), _ort(out / "model.onnx")
    dec = patch_kda_replayssm(model, buffer_len=L)
    try:
        batch, prompt = 3, 6
        cache = DynamicCache(config=model.config)
        ids = torch.randint(2, 256, (batch, prompt), generator=torch.Generator().manual_seed(4))
        tok = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        lengths = torch.full((batch,), prompt, dtype=torch.int32)
        cursor, states = dec.cursor.clone(), step.states_from_patched(dec, cache, prompt)
        for s in range(2 * L + 1):
            want = model(tok, cache=cache, use_cache=True).logits[:, -1]
            logits, lengths, cursor, states = run(step, tok, lengths, cursor, states)
            torch.testing.assert_close(logits, want, rtol=0, atol=ATOL, msg=f"step {s}: logits")
            assert torch.equal(cursor, dec.cursor.to(torch.int32)), f"step {s}: cursor"
            tok = want.argmax(-1, keepdim=True)
            assert torch.equal(logits.argmax(-1), tok[:, 0]), f"step {s}: greedy tokens"
    finally:
        dec.unpatch()


@needs_ort
def test_bf16_shadow_engine(model, tmp_path):
    """--shadow bf16: one kda_decode_shadow node per KDA layer, kda_shadow_i (bf16) after each checkpoint; under
    onnxruntime the graph is KimiStep in replay_bf16 (non-fold steps read the shadow) and every fold rewrites the
    shadow from the new checkpoint."""
    from builders.engine import BuildOptions, build

    out = build(BuildOptions(out=tmp_path / "e", tiny="kimi_linear", buffer_len=L, max_seq_len=MAX_SEQ, max_batch=2,
                             shadow="bf16"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["shadow"] == "bf16" and cfg["plugin"]["op_type"] == kp.DECODE_SHADOW
    assert cfg["plugin"]["inputs"] == list(kp.SHADOW_INPUT_NAMES)
    names = [s["name"] for s in cfg["states"]]
    assert names[names.index("kda_state_0") + 1] == "kda_shadow_0"
    attrs = [cfg["plugin"][a] for a in kp.ATTRIBUTES]
    for k in cfg["plugin"]["kernels"]:  # the shadow-reading kernel of the plugin's aot_impl
        assert (out / k["ptx"]).read_bytes() == kp.aot_kernel(*attrs, "f32", 90, k["tactic"], "bf16").ptx
    assert _against_kimi_step(model, out / "model.onnx", "bf16") is None


# ---- what a Kimi-Linear engine cannot be -----------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(shadow="fp8"), r"--shadow fp8: Kimi Delta Attention models \(Kimi-Linear\) take replay_bf16 \(--shadow "
                         r"bf16\); there is no fp8 KDA shadow"),
    (dict(state_dtype="bf16"), "--state-dtype: Kimi Delta Attention checkpoints are fp32"),
    (dict(buffer_len=32), r"KDASpec.buffer_len: expected 2..16, got 32 .*--buffer-len 32"),
])
def test_refused_by_name_before_anything_is_written(tmp_path, kw, match):
    from builders.engine import BuildError, BuildOptions, build

    with pytest.raises(BuildError, match=match):
        build(BuildOptions(out=tmp_path / "e", tiny="kimi_linear", max_seq_len=MAX_SEQ, **kw))
    assert list(tmp_path.iterdir()) == []


@torch.no_grad()
@pytest.mark.parametrize("formulation", ["dense", "gather"])
def test_moe_matches_transformers(model, formulation):
    """The step's static-shape MoE (builders/moe.py's route + gated_experts, the shared experts MLP) against
    transformers' KimiLinearMoE, fp32: the same products summed in another order."""
    from builders.kimi_step import KimiKDADecodeStep

    step = KimiKDADecodeStep(model, L, MAX_SEQ, moe_formulation=formulation)
    gen = torch.Generator().manual_seed(3)
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert moes
    for moe in moes:
        h = torch.randn(5, 1, model.config.hidden_size, generator=gen)
        torch.testing.assert_close(step._moe(h, moe), moe(h), rtol=0, atol=1e-5)


# ---- TensorRT (not installable here: skips with the reason) ----------------------------------------------------
@pytest.mark.gpu
def test_tensorrt_builds_the_plan(engine, tmp_path):
    """Where TensorRT >= 10.9 and a GPU are present, the engine directory's model.onnx parses with the registered
    kda_decode plugin and builds a plan (builders/engine.py's build_plan)."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it cannot be installed on the CPU machine)")
    from builders.engine import build_plan, tensorrt_status

    trt, why = tensorrt_status()
    if trt is None:
        pytest.skip(why)
    out, _ = engine
    cfg = json.loads((out / "config.json").read_text())
    io = [(i["name"], tuple(i["shape"])) for i in cfg["inputs"]]
    build_plan(trt, out / "model.onnx", tmp_path / "model.plan", io, cfg["max_batch"])
    assert (tmp_path / "model.plan").stat().st_size > 0
