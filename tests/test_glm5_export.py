# SPDX-License-Identifier: Apache-2.0
"""The GLM-5 Next engine directory (``scripts/build_engine.py --tiny glm5_next``) on the CPU: the exported decode step
(builders/glm5_export.py ``Glm5KDADecodeStep``: one ``replayssm::kda_decode`` node per KDA layer, the DSA attention,
its indexer's top-k, the hyper-connection streams and the MoE in standard ops) run under onnxruntime with the KDA
family's reference op (trtllm_replayssm/families/kda/onnx_ops.py, registered by builders/ort_reference.py).

Oracles:
- the generation engine's step, builders/glm5_step.py's ``Glm5Step`` (transformers' own DSA, hyper-connection and MoE
  modules over per-row caches) in the same SSM mode (replay / replay_bf16), one instance per row, and transformers'
  ``generate`` (greedy) on each prompt: five prompts of 1 to 11 tokens fed one token a step, rows joining two steps
  apart (rows at different lengths in one batch), ring of L = 4 (every row folds 3 to 5 times), then their greedy
  continuations. The KDA node and Glm5Step's cache run the same float64 spec on inputs that the two runtimes round
  differently in fp32 and the DSA sums its products in another order, so the logits agree to fp32 rounding (ATOL)
  and the greedy tokens exactly; generate's prefill (chunked KDA, fp32 state, no bf16 u ring) is compared by tokens.
- the patched transformers model (builders/kda.py) after its own prefill (``states_from_patched``), each following
  its own greedy tokens.
- teeth: a corrupted KDA ring entry or DSA latent breaks the agreement at that step; positions past a row's length
  filled with garbage change nothing (bit for bit).

Ties in the indexer's top-k: its pool scores are sums of relu'd head scores, so with the tiny model's 2 indexer heads
whole pools score exactly 0 and tie at the selection boundary (the trajectories below meet such ties: counted).
transformers' ``index_scores.topk`` leaves the order of equal values unspecified (torch's CPU topk is a partial sort),
ONNX TopK specifies it: the lower index first. The eager oracles run with :func:`stable_topk` (a stable descending sort:
ONNX's rule), so both sides select the same pools; TensorRT's TopK does not document its tie order.

TensorRT cannot be installed here: the plan build is a GPU test that skips without it."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx", reason="onnx is not installed")

from builders import engine_format as ef  # noqa: E402
from builders.decode_step import DOMAIN  # noqa: E402
from builders.kda import text_model, tiny_model  # noqa: E402
from trtllm_replayssm.families.kda import trt_plugin as kp  # noqa: E402

from .build_cli import build_engine  # noqa: E402
from .test_generation import MAX_TOKENS, PROMPTS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = pathlib.Path(__file__).resolve().parent.parent
L, MAX_SEQ = 4, 32
STAGGER = 2  # row r joins at step STAGGER * r
# fp32 layers in two runtimes (onnxruntime's kernels and torch's reduce in other orders; the DSA expands every
# position's latent through kv_b_proj where transformers expands them in its own module) around the same float64 KDA
# node on inputs that differ by that rounding (and a bf16 u ring that may round them to neighbouring values):
# observed <= 1e-5 on logits of magnitude ~1
ATOL = 1e-4
# a DSA layer reusing the previous layer's top-k (indexer_types "shared") after one running its own indexer
SHARED = dict(layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
              indexer_types=["full", "full", "shared", "full"])

needs_ort = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("onnxruntime", "onnxruntime_extensions")),
    reason="onnxruntime and onnxruntime-extensions are needed to run the graph on the CPU")


def _stable_topk(mp: pytest.MonkeyPatch) -> dict:
    """``Tensor.topk`` as a stable descending sort (equal values: the lower index first, ONNX TopK's rule; module
    docstring) until ``mp`` is undone; returns a counter of the calls whose k-th and (k+1)-th values tie (masked
    candidates at the dtype's minimum not counted)."""
    real = torch.Tensor.topk
    ties = {"n": 0}

    def topk(self, k, dim=-1, largest=True, sorted=True):
        if not largest:
            return real(self, k, dim, largest, sorted)
        ordered = torch.sort(self, dim=dim, descending=True, stable=True)
        if k < self.shape[dim]:
            at, past = ordered.values.narrow(dim, k - 1, 1), ordered.values.narrow(dim, k, 1)
            ties["n"] += int(((at == past) & (at > torch.finfo(self.dtype).min / 2)).sum())
        idx = ordered.indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, idx), idx))

    mp.setattr(torch.Tensor, "topk", topk)
    return ties


@pytest.fixture
def stable_topk(monkeypatch):
    """The eager oracles' top-k rule for one test (:func:`_stable_topk`); the tie counter."""
    return _stable_topk(monkeypatch)


_build = build_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("glm5") / "engine"
    r = _build("--out", out, "--tiny", "glm5_next", "--buffer-len", L, "--max-seq-len", MAX_SEQ, "--max-batch", 8)
    assert r.returncode == 0, r.stderr
    return out, r.stdout


@pytest.fixture(scope="module")
def model():
    return tiny_model("glm5_next")


@pytest.fixture(scope="module")
def refs(model):
    """transformers' greedy generate of each prompt (ties in the indexer's top-k: :func:`_stable_topk`)."""
    out = []
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _stable_topk(mp)
        for p, n in zip(PROMPTS, MAX_TOKENS):
            g = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    return out


# ---- the format ------------------------------------------------------------------------------------------------
def test_format_dsa_letters():
    """engine_format's D (a DSA layer with its own indexer: latent, indexer key, gate score per position) and d (one
    sharing the previous top-k: the latent only) rows, in act dtype; KDA shadows leave them alone; the config check
    refuses a d layer with indexer states."""
    assert [(s.prefix, s.dims, s.dtype) for s in ef.layer_states("D")] == [
        ("dsa_kv", ("max_seq_len", "kv_lora_rank"), "act"), ("dsa_index_k", ("max_seq_len", "index_head_dim"), "act"),
        ("dsa_index_gate", ("max_seq_len", "index_head_dim"), "act")]
    assert [s.prefix for s in ef.layer_states("d")] == ["dsa_kv"]
    assert ef.layer_states("D", shadow="bf16") == ef.layer_states("D")
    states = [dict(name=n, shape=[-1], dtype="int32") for n in ef.SHARED_STATES]
    states += [dict(name=f"{p}_0", shape=[-1, 8, 4], dtype="float32") for p in ("dsa_kv", "dsa_index_k")]
    cfg = dict(model=dict(pattern="d"), states=states, act_dtype="fp32", state_dtype="fp32")
    with pytest.raises(ef.FormatError, match=r"state 'dsa_index_k_0': layer 0 is a DSA attention sharing the previous "
                                             r"top-k layer \('d' in pattern 'd'\), which has \['dsa_kv'\]"):
        ef.check_layer_states(cfg)
    cfg["model"]["pattern"] = "D"
    with pytest.raises(ef.FormatError, match=r"layer 0 \(DSA attention, pattern 'D'\): states \['dsa_index_gate_0'\] "
                                             "missing"):
        ef.check_layer_states(cfg)


# ---- scripts/build_engine.py --tiny glm5_next -----------------------------------------------------------------
def test_build_engine_tiny_glm5_next(engine):
    out, stdout = engine
    assert sorted(p.name for p in out.parent.iterdir()) == ["engine"]  # no temporary directory survives
    assert ("3 Kimi Delta Attention layers, heads=2 key dim=64 value dim=64, gate lower bound -5.0; 1 DSA layers (0 "
            "sharing the previous top-k), top-8 in pools of 4; 4 hyper-connection streams") in stdout
    assert "3 MoE layers: 4 experts, top-2, as dense" in stdout and "tests/test_glm5_export.py" in stdout
    cfg = json.loads((out / "config.json").read_text())
    ef.check_layer_states(cfg)
    assert cfg["format"] == ef.DECODE_FORMAT and "shadow" not in cfg and cfg["state_dtype"] == "fp32"
    m = cfg["model"]
    assert (m["model_type"], m["pattern"], m["kda_layers"], m["attention_layers"], m["moe_layers"], m["hc_mult"]) == (
        "glm5_next", "KKKD", [0, 1, 2], [3], [1, 2, 3], 4)
    assert m["moe"]["formulation"] == "dense" and m["moe"]["n_routed_experts"] == 4 and m["moe"]["swiglu_limit"] == 10
    assert {k: m["dsa"][k] for k in ("index_topk", "index_kpool", "index_head_dim", "index_n_heads")} == dict(
        index_topk=8, index_kpool=4, index_head_dim=32, index_n_heads=2)
    plugin = cfg["plugin"]
    attrs = dict(num_heads=2, key_dim=64, value_dim=64, buffer_len=L, use_qk_l2norm=1,
                 lower_bound_bits=kp.lower_bound_bits(-5.0))
    assert plugin["op_type"] == kp.DECODE and plugin["nodes"] == 3 and {k: plugin[k] for k in attrs} == attrs
    assert plugin["inputs"] == list(kp.INPUT_NAMES) and plugin["outputs"] == list(kp.OUTPUT_NAMES)
    assert [k["tactic"] for k in plugin["kernels"]] == [1, 2]
    for k in plugin["kernels"]:  # the PTX and launch the plugin's aot_impl hands TensorRT, per tactic (GLM's gate)
        want = kp.aot_kernel(*attrs.values(), "f32", 90, k["tactic"])
        assert (out / k["ptx"]).read_bytes() == want.ptx and k["kernel"] == "kda_replay_decode"
        assert "lb-5.0" in k["spec"] and k["grid"] == [want.grid_x, "batch", 1]
    states = {s["name"]: s for s in cfg["states"]}
    assert states["dsa_kv_3"]["shape"] == [-1, MAX_SEQ, 32] and states["dsa_index_k_3"]["shape"] == [-1, MAX_SEQ, 32]
    assert states["dsa_index_gate_3"]["dtype"] == "float32" and states["kda_u_0"]["dtype"] == "float32"
    assert states["kda_state_2"]["shape"] == [-1, 2, 64, 64] and states["conv_state_1"]["shape"] == [-1, 384, 4]

    g = onnx.load(str(out / "model.onnx"))
    nodes = [n for n in g.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == [kp.DECODE] * 3
    for n in nodes:
        assert {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute} == {
            "plugin_namespace": b"replayssm", "aot": 1, **attrs}
    assert {s["name"] for s in cfg["states"]} | {"input_ids"} == {i.name for i in g.graph.input}
    assert {s["output"] for s in cfg["states"]} | {"logits"} == {o.name for o in g.graph.output}
    ops = [n.op_type for n in g.graph.node]
    # one TopK per MoE router and per indexer, constant k; no data-dependent ops TensorRT would need plugins for
    assert ops.count("TopK") == 3 + 1 and ops.count("LayerNormalization") == 1  # the indexer's k_norm
    assert not set(ops) & {"NonZero", "Loop", "If", "ScatterND", "ScatterElements"}


def test_triton_plan_repository_pairs_every_state(engine, tmp_path):
    """The tensorrt_plan Triton model of the engine (builders/triton_repo.py, format-driven): every state, the DSA
    ones too, an implicit sequence state."""
    pytest.importorskip("tritonclient")
    from builders import triton_repo as tr

    out, _ = engine
    target = tr.make_repo(out, tmp_path / "repo")
    text = (target / "config.pbtxt").read_text()
    assert target.name == "glm5_next_replayssm" and (target / "1" / "MISSING_PLAN.txt").is_file()
    assert all(f'input_name: "{n}_3"' in text for n in ("dsa_kv", "dsa_index_k", "dsa_index_gate"))


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
def _staggered(model, path, shadow: str = "none", corrupt: tuple | None = None, prompts=PROMPTS, limits=MAX_TOKENS):
    """The graph at ``path`` on one batch, row r = prompts[r] joining at step STAGGER r (zero states until then), fed
    its prompt one token a step and then its own greedy tokens, ``limits[r]`` of them; each active row against its
    own Glm5Step (mode replay / replay_bf16). Returns (the first step whose logits differ beyond ATOL, None: none did;
    each row's generated tokens). ``corrupt`` (state name, index): before the first step at which row 0 has 6 tokens,
    that element of the graph's state gets + 1."""
    from builders.glm5_export import Glm5KDADecodeStep
    from builders.glm5_step import Glm5Step

    step = Glm5KDADecodeStep(model, L, MAX_SEQ, shadow=shadow)
    mode = "replay" if shadow == "none" else f"replay_{shadow}"
    rows = len(prompts)
    eager = [Glm5Step(model, 1, MAX_SEQ, mode, L) for _ in range(rows)]
    run = _ort(path)
    start = [STAGGER * r for r in range(rows)]
    end = [start[r] + len(p) + n - 1 for r, (p, n) in enumerate(zip(prompts, limits))]  # steps a row is compared
    lengths, cursor = torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
    states, tok = step.empty_states(rows), torch.zeros(rows, 1, dtype=torch.int64)
    names = [s.name for s in step.state_specs()]
    got = [[] for _ in range(rows)]
    for s in range(max(end)):
        for r in range(rows):
            if s < start[r]:  # not joined yet: an empty row
                continue
            k = s - start[r]
            tok[r, 0] = prompts[r][k] if k < len(prompts[r]) else got[r][-1]
        if corrupt is not None and s == 6:
            name, index = corrupt
            assert int(lengths[0]) == 6 and int(cursor[0]) == 2, "the corrupted entry must be live"
            states[names.index(name)][(0, *index)] += 1.0
        logits, lengths, cursor, states = run(step, tok, lengths, cursor, states)
        for r in range(rows):
            if s < start[r]:
                lengths[r], cursor[r] = 0, 0
                for t in states:
                    t[r] = 0
                continue
            if s >= end[r]:
                continue
            eager[r].ids.fill_(int(tok[r, 0]))
            want = eager[r]()[0].float()
            if not torch.allclose(logits[r], want, rtol=0, atol=ATOL):
                return s, got
            assert int(logits[r].argmax()) == int(want.argmax()), f"step {s} row {r}: greedy tokens"
            k = s - start[r]
            assert (int(lengths[r]), int(cursor[r])) == (k + 1, (k + 1) % L), f"step {s} row {r}: lengths, cursor"
            if k + 1 >= len(prompts[r]):
                got[r].append(int(logits[r].argmax()))
            if shadow != "none" and (k + 1) % L == 0:  # a fold rewrote each checkpoint's shadow from it
                for j, name in enumerate(names):
                    if name.startswith("kda_shadow_"):
                        assert torch.equal(states[j][r], states[j - 1][r].to(torch.bfloat16)), f"step {s}: {name}"
    return None, got


@needs_ort
def test_graph_is_the_eager_step_and_generate(engine, model, refs, stable_topk):
    """Five rows at different lengths, 3-5 ring folds each: the graph's logits are Glm5Step's (replay) to fp32
    rounding and its greedy tokens transformers' generate's; the indexer met ties at its selection boundary."""
    out, _ = engine
    first_bad, got = _staggered(model, out / "model.onnx")
    assert first_bad is None
    assert got == refs
    assert stable_topk["n"] > 0, "the trajectory should meet tied pool scores (module docstring)"


@needs_ort
@pytest.mark.parametrize("name, index", [("kda_u_0", (0, 0, 0)), ("dsa_kv_3", (5, 0))])
def test_corrupted_state_breaks_the_agreement(engine, model, stable_topk, name, index):
    """Teeth: + 1 on a live u-ring entry of layer 0, or on the DSA latent of position 5 (in the open pool, which the
    indexer always selects), before step 6 moves that step's logits beyond ATOL."""
    out, _ = engine
    first_bad, _ = _staggered(model, out / "model.onnx", corrupt=(name, index), prompts=PROMPTS[:2],
                              limits=MAX_TOKENS[:2])
    assert first_bad == 6


@needs_ort
def test_bf16_shadow_engine(model, monkeypatch, tmp_path):
    """--shadow bf16: one kda_decode_shadow node per KDA layer, kda_shadow_i (bf16) after each checkpoint, its PTX the
    plugin's shadow kernel; under onnxruntime the graph is Glm5Step in replay_bf16 (non-fold steps read the shadow)
    and every fold rewrites the shadow from the new checkpoint."""
    from builders.engine import BuildOptions, build

    out = build(BuildOptions(out=tmp_path / "e", tiny="glm5_next", buffer_len=L, max_seq_len=MAX_SEQ, max_batch=8,
                             shadow="bf16"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["shadow"] == "bf16" and cfg["plugin"]["op_type"] == kp.DECODE_SHADOW
    names = [s["name"] for s in cfg["states"]]
    assert names[names.index("kda_state_0") + 1] == "kda_shadow_0" and "dsa_kv_3" in names
    attrs = [cfg["plugin"][a] for a in kp.ATTRIBUTES]
    for k in cfg["plugin"]["kernels"]:
        assert (out / k["ptx"]).read_bytes() == kp.aot_kernel(*attrs, "f32", 90, k["tactic"], "bf16").ptx
    _stable_topk(monkeypatch)  # after the export: the graph's TopK is torch.topk's
    first_bad, _ = _staggered(model, out / "model.onnx", "bf16", prompts=PROMPTS[:3], limits=MAX_TOKENS[:3])
    assert first_bad is None


@needs_ort
@torch.no_grad()
def test_graph_continues_a_patched_prefill(engine, model, stable_topk):
    """From the patched model's own prefill (transformers' chunked KDA, its DSA cache and packed indexer state;
    states_from_patched), graph and patched model each follow their own greedy tokens: same logits to fp32 rounding,
    tokens and cursor, over 2 L + 1 steps."""
    from transformers import DynamicCache

    from builders.glm5_export import Glm5KDADecodeStep
    from builders.kda import patch_kda_replayssm

    out, _ = engine
    step, run = Glm5KDADecodeStep(model, L, MAX_SEQ), _ort(out / "model.onnx")
    dec = patch_kda_replayssm(model, buffer_len=L)
    try:
        batch, prompt = 3, 9
        cache = DynamicCache(config=model.config)
        ids = torch.randint(2, 256, (batch, prompt), generator=torch.Generator().manual_seed(4))
        tok = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        lengths = torch.full((batch,), prompt, dtype=torch.int32)
        cursor, states = dec.cursor.to(torch.int32).clone(), step.states_from_patched(dec, cache, prompt)
        for s in range(2 * L + 1):
            want = model(tok, cache=cache, use_cache=True).logits[:, -1]
            logits, lengths, cursor, states = run(step, tok, lengths, cursor, states)
            torch.testing.assert_close(logits, want, rtol=0, atol=ATOL, msg=f"step {s}: logits")
            assert torch.equal(cursor, dec.cursor.to(torch.int32)), f"step {s}: cursor"
            tok = want.argmax(-1, keepdim=True)
            assert torch.equal(logits.argmax(-1), tok[:, 0]), f"step {s}: greedy tokens"
    finally:
        dec.unpatch()


@torch.no_grad()
def test_hand_off_refuses_a_left_padded_prefill(model):
    """The engine's rows start at position 0: a patched prefill whose DSA indexer state marks padding positions (a
    left-padded batch) is refused by name, not handed over shifted."""
    from transformers import DynamicCache

    from builders.glm5_export import Glm5KDADecodeStep
    from builders.kda import patch_kda_replayssm

    step = Glm5KDADecodeStep(model, L, MAX_SEQ)
    dec = patch_kda_replayssm(model, buffer_len=L)
    try:
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([[5, 9, 13, 200, 7, 3], [0, 0, 4, 5, 6, 7]])
        model(ids, attention_mask=torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="cache: layer 3's indexer state has padding positions"):
            step.states_from_patched(dec, cache, 6)
    finally:
        dec.unpatch()


@needs_ort
@torch.no_grad()
def test_positions_past_a_rows_length_are_not_read(engine, model):
    """Garbage (finite, large) in every DSA state past each row's length changes neither the logits nor any state
    below it, bit for bit; the written position is the new token's and nothing past it moves."""
    from builders.glm5_export import Glm5KDADecodeStep

    out, _ = engine
    step, run = Glm5KDADecodeStep(model, L, MAX_SEQ), _ort(out / "model.onnx")
    prompt = torch.tensor([[5, 9, 13, 200, 7, 3, 3, 8, 1, 2, 3, 4, 60, 61], [100] * 14])
    lengths, cursor, states = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), step.empty_states(2)
    gen = torch.Generator().manual_seed(7)
    dsa = [j for j, s in enumerate(step.state_specs()) if s.name.startswith("dsa_")]
    for s in range(prompt.shape[1]):
        poisoned = [t.clone() for t in states]
        for j in dsa:
            for r in range(2):
                n = int(lengths[r])
                poisoned[j][r, n:] = torch.randn(poisoned[j][r, n:].shape, generator=gen) * 1e3
        clean = run(step, prompt[:, s:s + 1], lengths, cursor, states)
        dirty = run(step, prompt[:, s:s + 1], lengths, cursor, poisoned)
        assert torch.equal(clean[0], dirty[0]), f"step {s}: logits"
        for j in dsa:
            for r in range(2):
                n = int(lengths[r])
                assert torch.equal(clean[3][j][r, :n + 1], dirty[3][j][r, :n + 1]), f"step {s}: {step.state_specs()[j]}"
                assert torch.equal(dirty[3][j][r, n + 1:], poisoned[j][r, n + 1:]), "past the new position: untouched"
        _, lengths, cursor, states = clean


@needs_ort
def test_shared_topk_layer(monkeypatch, tmp_path):
    """A DSA layer reusing the previous layer's top-k (pattern KDdK: indexer_types full, full, shared): the d layer
    keeps only its latent, and the graph is Glm5Step on that model (which runs transformers' shared-top-k path)."""
    from builders.decode_step import export_onnx
    from builders.glm5_export import Glm5KDADecodeStep

    shared = tiny_model("glm5_next", **SHARED)
    step = Glm5KDADecodeStep(shared, L, MAX_SEQ)
    assert step.model_entry()["pattern"] == "KDdK"
    assert [s.name for s in step.state_specs() if s.name.startswith("dsa_")] == [
        "dsa_kv_1", "dsa_index_k_1", "dsa_index_gate_1", "dsa_kv_2"]
    export_onnx(step, tmp_path / "model.onnx")
    _stable_topk(monkeypatch)  # after the export: the graph's TopK is torch.topk's
    first_bad, _ = _staggered(shared, tmp_path / "model.onnx", prompts=PROMPTS[2:4], limits=MAX_TOKENS[2:4])
    assert first_bad is None


@torch.no_grad()
@pytest.mark.parametrize("formulation", ["dense", "gather"])
def test_moe_matches_transformers(model, formulation):
    """The step's static-shape MoE (builders/moe.py's route + gated_experts with GLM-5 Next's swiglu limit, the shared
    experts MLP) against transformers' Glm5NextTextMoE, fp32 (the same products summed in another order), on inputs
    large enough that the limit clamps some routed expert's gate and up projections."""
    from builders.glm5_export import Glm5KDADecodeStep

    step = Glm5KDADecodeStep(model, L, MAX_SEQ, moe_formulation=formulation)
    gen = torch.Generator().manual_seed(3)
    moes = [layer.mlp for layer in text_model(model).layers if hasattr(layer.mlp, "experts")]
    assert len(moes) == 3
    for moe in moes:
        h = torch.randn(5, 1, model.config.text_config.hidden_size, generator=gen) * 30
        gu = torch.matmul(h[:, 0], moe.experts.gate_up_proj.transpose(1, 2))  # (E, 5, 2I)
        assert float(gu.abs().max()) > moe.experts.swiglu_limit  # the clamp is exercised
        torch.testing.assert_close(step._moe(h, moe), moe(h), rtol=0, atol=1e-4)


# ---- --model on a GLM-5 Next checkpoint directory ----------------------------------------------------------
@needs_ort
def test_checkpoint_directory_builds_the_same_engine(engine, model, tmp_path):
    """``--model DIR`` of the tiny model saved in the published layout (save_pretrained): the same states and, under
    onnxruntime, the tiny engine's logits bit for bit (the same weights in the same graph)."""
    from builders.glm5_export import Glm5KDADecodeStep

    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    r = _build("--out", tmp_path / "e", "--model", ckpt, "--buffer-len", L, "--max-seq-len", MAX_SEQ)
    assert r.returncode == 0, r.stderr
    tiny, _ = engine
    cfg, ref = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "e", tiny))
    assert cfg["model"]["source"] == str(ckpt) and cfg["model"]["model_type"] == "glm5_next"
    assert cfg["states"] == ref["states"] and cfg["model"]["pattern"] == "KKKD"
    step = Glm5KDADecodeStep(model, L, MAX_SEQ)
    a, b = _ort(tmp_path / "e" / "model.onnx"), _ort(tiny / "model.onnx")
    args = (torch.tensor([[7], [11]]), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    sa = sb = step.empty_states(2)
    for _ in range(3):
        la, *ra, sa = a(step, *args, sa)
        lb, *rb, sb = b(step, *args, sb)
        assert torch.equal(la, lb)
        args = (la.argmax(-1, keepdim=True), *ra)


# ---- what a GLM-5 Next engine cannot be --------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(shadow="fp8"), r"--shadow fp8: Kimi Delta Attention models \(GLM-5 Next\) take replay_bf16 \(--shadow "
                         r"bf16\); there is no fp8 KDA shadow"),
    (dict(state_dtype="bf16"), "--state-dtype: Kimi Delta Attention checkpoints are fp32"),
    (dict(num_draft=1, buffer_len=8), r"--num-draft: Kimi Delta Attention engines \(GLM-5 Next\) are standard decode "
                                      "only"),
    (dict(buffer_len=32), r"KDASpec.buffer_len: expected 2..16, got 32 .*--buffer-len 32"),
])
def test_refused_by_name_before_anything_is_written(tmp_path, kw, match):
    from builders.engine import BuildError, BuildOptions, build

    with pytest.raises(BuildError, match=match):
        build(BuildOptions(out=tmp_path / "e", tiny="glm5_next", max_seq_len=MAX_SEQ, **kw))
    assert list(tmp_path.iterdir()) == []


def test_step_refuses_what_it_cannot_export():
    """A shared-top-k DSA layer with no full indexer layer right before it (transformers raises at its first
    forward; the step at construction, naming the key), a speculative step, and a model of another kind."""
    from builders.glm5_export import Glm5KDADecodeStep

    bad = tiny_model("glm5_next", layer_types=["linear_attention", "indexed_attention", "linear_attention",
                                               "indexed_attention"], indexer_types=["full", "full", "full", "shared"])
    with pytest.raises(ValueError, match="indexer_types: DSA layer 3 is 'shared' but layer 2 is not a DSA layer with "
                                         "its own indexer"):
        Glm5KDADecodeStep(bad, L, MAX_SEQ)
    with pytest.raises(ValueError, match="num_draft: GLM-5 Next engines are standard decode only"):
        Glm5KDADecodeStep(tiny_model("glm5_next"), 8, MAX_SEQ, num_draft=1)
    with pytest.raises(ValueError, match=r"model: expected a GLM-5 Next model \(model_type one of \('glm5_next',\)\), "
                                         "got 'kimi_linear'"):
        Glm5KDADecodeStep(tiny_model("kimi_linear"), L, MAX_SEQ)


# ---- TensorRT (not installable here: skips with the reason) ----------------------------------------------------
@pytest.mark.gpu
def test_tensorrt_builds_the_plan(engine, tmp_path):
    """Where TensorRT >= 10.9 and a GPU are present, the engine directory's model.onnx (kda_decode plugin nodes, the
    DSA's TopK and LayerNormalization) parses and builds a plan (builders/engine.py's build_plan)."""
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
