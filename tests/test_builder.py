# SPDX-License-Identifier: Apache-2.0
"""Builders on the CPU: patched Nemotron-H / Nemotron 3, the decode-step module, its ONNX graph, build_engine.py.

Every model test runs on both embedded tiny configs: Nemotron-H (``M*-M-M*-``) and Nemotron 3
(``MEM*EM*E``: MoE layers with 8 experts, top-2 sigmoid routing with a correction bias, a shared
expert; in the graph as standard ops, builders/moe.py, and in the patched model as transformers'
own NemotronHMoE).

Oracles, each where it holds:
* the unpatched transformers model (its own generate / cache path, fp32): the patched model must
  produce the same greedy tokens; logits agree to ~1e-5 because only the SSM step differs (float64
  ReplaySSM reference vs the model's fp32 conventional update).
* the patched model for the decode-step module (same weights, same float64 SSM reference; the conv
  and attention are re-expressed with plain ops, so agreement is fp32 summation order, ~1e-6).
* the decode-step module in PyTorch for the ONNX graph in onnxruntime (custom op = the same float64
  reference): fp32 kernels of two runtimes, ~1e-6 relative. Bookkeeping (cursor, lengths) exactly.
* the patched model for the ONNX graph directly (each side following its own greedy tokens): the
  same greedy tokens, logits to the tolerance above (measured max 4e-6 absolute on |logits| <= 4;
  with MoE the graph's dense-over-experts sum and transformers' per-expert loop differ only in fp32
  summation order). The routing is checked to follow the tokens (more experts used than one
  token's top-k), so a graph that froze the tracing input's experts would fail.
All runs use L = 4 and 3L+1 steps, so every row crosses at least three flushes.
"""

from __future__ import annotations

import json
import pathlib

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

from builders.decode_step import DOMAIN, OP_TYPE, NemotronHDecodeStep, export_onnx
from builders.nemotron_h import TINY3_CONFIG, TINY_CONFIGS, CheckpointError, load_nemotron_h, mamba_layers, patch_replayssm

from .build_cli import build_engine  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
L = 4
STEPS = 3 * L + 1
MAX_SEQ = 48
# fp32 graph vs fp32 module: different kernels (ORT vs torch), same math; values are O(1)-O(10).
RTOL, ATOL = 1e-4, 2e-5

needs_ort = pytest.mark.skipif(
    __import__("importlib").util.find_spec("onnxruntime_extensions") is None,
    reason="onnxruntime-extensions is not installed (pip install onnxruntime onnxruntime-extensions)",
)


TINIES = ("nemotron_h", "nemotron3")
# ONNX ops that TensorRT cannot build with static shapes, or that would make the experts data-dependent
DATA_DEPENDENT_OPS = {"NonZero", "Loop", "If", "Scan", "Unique", "Compress", "ScatterND", "ScatterElements"}


@pytest.fixture(scope="module", params=TINIES)
def model(request):
    return load_nemotron_h(seed=0, tiny=request.param)


def _moe_layers(model) -> list[int]:
    return [i for i, k in enumerate(model.config.layers_block_type) if k == "moe"]


def _prompt(batch, length, seed=1):
    return torch.randint(2, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_greedy_tokens_match_unpatched_model(model):
    ids = _prompt(2, 7)
    kw = dict(max_new_tokens=64, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    dec = patch_replayssm(model, buffer_len=L)
    try:
        out = model.generate(ids, **kw)
        again = model.generate(ids, **kw)  # a fresh cache: the previous buffers must not leak in
    finally:
        dec.unpatch()
    assert out.sequences.shape[1] == 7 + 64
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(again.sequences, ref.sequences)
    # 63 decode steps went through ReplaySSM (the first new token comes from the prefill).
    assert dec.cursor.tolist() == [63 % L] * 2
    s_ref, s_out = torch.stack(ref.scores), torch.stack(out.scores)
    # only the SSM step differs (float64 replay vs fp32 conventional): fp32 rounding of O(1) logits
    assert torch.allclose(s_out, s_ref, rtol=0, atol=1e-4)
    assert (s_ref.std(-1) > 0.1).all()  # random weights are not degenerate


@torch.no_grad()
def test_prefill_after_decode_folds_the_buffer(model):
    """A multi-token chunk after some decode steps sees the state S_k, not the stale checkpoint."""
    ids, more = _prompt(2, 5), _prompt(2, 3, seed=2)
    logits = []
    for patched in (False, True):
        dec = patch_replayssm(model, buffer_len=L) if patched else None
        try:
            cache = DynamicCache(config=model.config)
            tok = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(L + 2):  # one flush, then cursor 2
                tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            logits.append(model(more, cache=cache, use_cache=True).logits)
        finally:
            if dec is not None:
                dec.unpatch()
    assert torch.allclose(logits[1], logits[0], rtol=0, atol=1e-4)


def _step_states(step, batch, gen):
    """Random but realistic states: O(1) values, processed dt in (0, 0.1] as softplus gives."""
    out = []
    for spec, z in zip(step.state_specs(), step.empty_states(batch)):
        if spec.name.startswith("dt_cache"):
            t = torch.rand(z.shape, generator=gen) * 0.1
        else:
            t = torch.randn(z.shape, generator=gen) * 0.5
        out.append(t.to(z.dtype))
    return out


@torch.no_grad()
def test_decode_step_matches_patched_model(model):
    dec = patch_replayssm(model, buffer_len=L)
    try:
        step = NemotronHDecodeStep(model, L, MAX_SEQ)
        cache = DynamicCache(config=model.config)
        prompt = 6
        out = model(_prompt(2, prompt), cache=cache, use_cache=True)
        states = step.states_from_patched(dec, cache, prompt)
        tok = out.logits[:, -1:].argmax(-1)
        lengths, cursor = torch.full((2,), prompt, dtype=torch.int32), dec.cursor.clone()
        for _ in range(STEPS):
            want = model(tok, cache=cache, use_cache=True).logits[:, -1]
            got = step(tok, lengths, cursor, *states)
            # same float64 SSM reference on both sides; conv/attention in plain fp32 ops
            torch.testing.assert_close(got[0], want, rtol=RTOL, atol=ATOL)
            assert torch.equal(got[2], dec.cursor)
            lengths, cursor, states = got[1], got[2], list(got[3:])
            tok = want.argmax(-1, keepdim=True)
        named = dict(zip([s.name for s in step.state_specs()], states))
        for i in mamba_layers(model):
            for k in ("state", "x_cache", "B_cache", "dt_cache"):
                key = "ssm_state" if k == "state" else k
                torch.testing.assert_close(named[f"{key}_{i}"], dec.caches[i][k], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(named[f"conv_state_{i}"], cache.get_conv_state(i), rtol=RTOL, atol=ATOL)
        assert lengths.tolist() == [prompt + STEPS] * 2
    finally:
        dec.unpatch()


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    step = NemotronHDecodeStep(model, L, MAX_SEQ)
    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    export_onnx(step, path)
    return step, path


def test_onnx_graph_has_one_plugin_node_per_mamba_layer(model, exported):
    onnx = pytest.importorskip("onnx", reason="onnx is not installed")

    step, path = exported
    g = onnx.load(str(path))
    onnx.checker.check_model(g)
    assert max(o.version for o in g.opset_import if o.domain in ("", "ai.onnx")) >= 17
    nodes = [n for n in g.graph.node if n.domain == DOMAIN]
    assert len(nodes) == len(mamba_layers(model)) and all(n.op_type == OP_TYPE for n in nodes)
    cfg = model.config
    for n, i in zip(nodes, mamba_layers(model)):
        attrs = {a.name: (a.s.decode() if a.type == onnx.AttributeProto.STRING else a.i) for a in n.attribute}
        assert attrs == dict(plugin_namespace=DOMAIN, aot=1, nheads=cfg.mamba_num_heads, headdim=cfg.mamba_head_dim,
                             dstate=cfg.ssm_state_size, ngroups=cfg.n_groups, buffer_len=L)
        assert len(n.input) == 13 and len(n.output) == 5
        assert list(n.input[8:]) == ["cursor", f"ssm_state_{i}", f"x_cache_{i}", f"B_cache_{i}", f"dt_cache_{i}"]
        assert list(n.output[1:]) == [f"ssm_state_{i}_out", f"x_cache_{i}_out", f"B_cache_{i}_out", f"dt_cache_{i}_out"]
    assert [i.name for i in g.graph.input] == step.input_names()
    assert [o.name for o in g.graph.output] == step.output_names()
    # MoE layers (Nemotron 3) as standard ops TensorRT's parser takes: one TopK per layer with a
    # constant k, every expert matrix a graph constant (dense over experts), nothing data-dependent.
    ops = {n.op_type for n in g.graph.node if n.domain != DOMAIN}
    assert all(n.domain in ("", "ai.onnx", DOMAIN) for n in g.graph.node)
    assert not ops & DATA_DEPENDENT_OPS, ops & DATA_DEPENDENT_OPS
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer}
    consts.update({n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in g.graph.node
                   if n.op_type == "Constant"})
    topk = [n for n in g.graph.node if n.op_type == "TopK"]
    moe = _moe_layers(model)
    assert len(topk) == len(moe)  # n_group = 1: the group TopKs are not there
    assert all(consts[n.input[1]].tolist() == [cfg.num_experts_per_tok] for n in topk)
    experts = [t for t in g.graph.initializer if len(t.dims) == 3]
    assert len(experts) == 2 * len(moe)  # up and down of every MoE layer, all E experts
    assert all(t.dims[0] == cfg.n_routed_experts for t in experts)
    if moe:
        assert {"Sigmoid", "TopK", "GatherElements", "MatMul"} <= ops


@needs_ort
def test_onnx_reproduces_the_patched_model(model, exported):
    """The graph in onnxruntime against the patched transformers model, each following its own greedy
    tokens over 3L+1 steps from a real prefill: same tokens, same logits, same cursor."""
    _ort_against_patched(model, *exported)


@needs_ort
def test_onnx_latent_group_routed_moe_reproduces_the_patched_model(tmp_path):
    """Nemotron 3 Super's LatentMoE (experts in a moe_latent_size space between fc1/fc2_latent_proj) with
    group-limited routing (n_group 2, topk_group 1: the group TopKs and the -inf mask in the graph)."""
    from transformers import NemotronHForCausalLM

    from builders.nemotron_h import randomize_, tiny_config

    cfg = tiny_config("nemotron3", moe_latent_size=32, n_group=2, topk_group=1, num_experts_per_tok=3)
    model = randomize_(NemotronHForCausalLM(cfg), seed=2).eval()
    step = NemotronHDecodeStep(model, L, MAX_SEQ)
    export_onnx(step, tmp_path / "latent.onnx")
    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    g = onnx.load(str(tmp_path / "latent.onnx"))
    assert sum(n.op_type == "TopK" for n in g.graph.node) == 3 * len(_moe_layers(model))  # best-2, groups, experts
    assert not {n.op_type for n in g.graph.node} & DATA_DEPENDENT_OPS
    _ort_against_patched(model, step, tmp_path / "latent.onnx")


@torch.no_grad()
def _ort_against_patched(model, step, path):
    from builders.ort_reference import session

    sess = session(path)
    used = {i: set() for i in _moe_layers(model)}
    hooks = [model.model.layers[i].mixer.gate.register_forward_hook(
        lambda mod, args, out, i=i: used[i].update(out[2].flatten().tolist())) for i in used]
    dec = patch_replayssm(model, buffer_len=L)
    try:
        batch, prompt = 3, 6
        cache = DynamicCache(config=model.config)
        tok = model(_prompt(batch, prompt, seed=4), cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for u in used.values():
            u.clear()  # count the experts of the decode steps only
        lengths = torch.full((batch,), prompt, dtype=torch.int32)
        feed = [t.numpy().copy() for t in (tok, lengths, dec.cursor, *step.states_from_patched(dec, cache, prompt))]
        names = step.input_names()
        for s in range(STEPS):
            want = model(tok, cache=cache, use_cache=True).logits[:, -1]
            got = sess.run(None, dict(zip(names, feed)))
            np.testing.assert_allclose(got[0], want.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"step {s}: logits")
            np.testing.assert_array_equal(got[2], dec.cursor.numpy(), err_msg=f"step {s}: cursor")
            np.testing.assert_array_equal(got[1], lengths.numpy() + s + 1, err_msg=f"step {s}: lengths")
            tok = want.argmax(-1, keepdim=True)
            np.testing.assert_array_equal(got[0].argmax(-1), tok[:, 0].numpy(), err_msg=f"step {s}: greedy tokens")
            feed = [got[0].argmax(-1)[:, None].astype(np.int64), *got[1:]]
    finally:
        dec.unpatch()
        for h in hooks:
            h.remove()
    assert all(len(u) > model.config.num_experts_per_tok for u in used.values()), used


def _run_both(step, sess, steps, corrupt=None):
    gen = torch.Generator().manual_seed(0)
    batch = 3
    tok = torch.randint(0, 256, (batch, 1), generator=gen)
    lengths = torch.tensor([0, 3, 5], dtype=torch.int32)
    cursor = torch.tensor([0, 1, 3], dtype=torch.int32)  # row 2 flushes on the first step
    states = _step_states(step, batch, gen)
    names = step.output_names()
    for s in range(steps):
        with torch.no_grad():
            want = step(tok, lengths, cursor, *states)
        feed = [t.numpy().copy() for t in (tok, lengths, cursor, *states)]
        if corrupt is not None and s == 0:
            corrupt(dict(zip(step.input_names(), feed)))
        got = sess.run(None, dict(zip(step.input_names(), feed)))
        for name, g, w in zip(names, got, want):
            if name in ("lengths_out", "cursor_out"):
                np.testing.assert_array_equal(g, w.numpy(), err_msg=name)
            else:
                np.testing.assert_allclose(g, w.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"step {s}: {name}")
        lengths, cursor, states = want[1], want[2], list(want[3:])
        tok = want[0].argmax(-1, keepdim=True)


@needs_ort
def test_onnx_matches_decode_step(exported):
    from builders.ort_reference import session

    step, path = exported
    _run_both(step, session(path), STEPS)


@needs_ort
def test_onnx_gather_formulation_matches_decode_step(model3, tmp_path):
    """The other MoE formulation (each token gathers its k experts' matrices): same graph contract."""
    from builders.ort_reference import session

    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    step = NemotronHDecodeStep(model3, L, MAX_SEQ, moe_formulation="gather")
    export_onnx(step, tmp_path / "gather.onnx")
    g = onnx.load(str(tmp_path / "gather.onnx"))
    assert not {n.op_type for n in g.graph.node} & DATA_DEPENDENT_OPS
    assert sum(n.op_type == "TopK" for n in g.graph.node) == len(_moe_layers(model3))
    _run_both(step, session(tmp_path / "gather.onnx"), STEPS)


@needs_ort
def test_onnx_comparison_has_teeth(exported):
    """One corrupted buffered x entry (row 1, position 0 < its cursor) must be caught."""
    from builders.ort_reference import session

    step, path = exported

    def corrupt(feed):
        feed[f"x_cache_{mamba_layers(step.model)[0]}"][1, :, 0] += 1.0

    with pytest.raises(AssertionError):
        _run_both(step, session(path), 1, corrupt)


# ---- loading checkpoints --------------------------------------------------------------------------
@torch.no_grad()
def test_patched_generate_leaves_a_cache_that_continues(model):
    """A decode step counts its token in the transformers cache (get_seq_length follows the sequence), so a
    second generate() that continues the returned cache sees only the new tokens, as unpatched."""
    ids = _prompt(1, 7)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    got = []
    for patched in (False, True):
        dec = patch_replayssm(model, buffer_len=L) if patched else None
        try:
            out = model.generate(ids, **kw)
            length = int(out.past_key_values.get_seq_length())
            more = torch.cat([out.sequences, _prompt(1, 2, seed=5)], dim=1)
            got.append((length, model.generate(more, cache=out.past_key_values, **kw).sequences))
        finally:
            if dec is not None:
                dec.unpatch()
    assert got[1][0] == got[0][0] == 7 + 6 - 1
    assert torch.equal(got[1][1], got[0][1])


def test_beam_search_and_interleaved_conversations_match_unpatched(model):
    """Beam search, two interleaved conversations, unpatch mid-conversation (tests/helpers.py says how)."""
    from .helpers import check_beams_and_conversations

    check_beams_and_conversations(model, patch_replayssm, L, atol=1e-4)


def test_forward_raising_mid_step_breaks_only_its_cache(model):
    """An error inside a decode step (tests/helpers.py says how) is not silently continued from."""
    from .helpers import check_forward_raising_mid_step

    check_forward_raising_mid_step(model, patch_replayssm, L, atol=1e-4)


def test_tied_embeddings_checkpoint_loads_with_the_head_tied(model, tmp_path):
    """tie_word_embeddings with no lm_head tensor: the head is the embedding (transformers' tie_weights() does
    nothing for NemotronHForCausalLM, which left the head on the meta device)."""
    loaded = load_nemotron_h(_save(model, tmp_path / "tied", drop=("lm_head.weight",),
                                   config={"tie_word_embeddings": True}))
    assert loaded.lm_head.weight.device.type == "cpu"
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embeddings.weight.data_ptr()
    with torch.no_grad():
        assert torch.isfinite(loaded(_prompt(1, 4)).logits).all()


def test_tensor_parallel_refuses_moe_before_changing_anything(model3):
    from builders.tp_model import shard_nemotron_h_

    mixer = model3.model.layers[0].mixer
    before = (tuple(mixer.in_proj.weight.shape), mixer.num_heads)
    with pytest.raises(ValueError, match="tp=2: layer type 'moe' cannot be sharded"):
        shard_nemotron_h_(model3, 0, 2)
    assert (tuple(mixer.in_proj.weight.shape), mixer.num_heads) == before


def _save(model, d: pathlib.Path, rename=lambda k: k, drop=(), reshape=(), extra=(), per_expert=False, config=None,
          dtype=None):
    """``model`` as an HF directory; ``per_expert``: NVIDIA's layout (``backbone.``, one tensor per expert,
    ``...mixer.experts.<e>.up_proj.weight``), applied before ``drop`` / ``reshape`` / ``extra``;
    ``config``: keys changed in config.json; ``dtype``: the stored dtype of the floating tensors."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(d / "config.json"))
    if config:
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**raw, **config}))
    sd = {}
    for k, v in model.state_dict().items():
        if per_expert and k.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
            prefix, proj = k.replace("model.", "backbone.", 1).rsplit(".", 1)
            sd.update({f"{prefix}.{e}.{proj}.weight": v[e] for e in range(v.shape[0])})
        else:
            sd[k.replace("model.", "backbone.", 1) if per_expert else k] = v
    sd = {rename(k): (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
          for k, v in sd.items() if k not in drop}
    for k in reshape:
        sd[k] = sd[k][:-1].contiguous()
    sd.update({k: torch.zeros(2) for k in extra})
    save_file(sd, str(d / "model.safetensors"))
    return d


def test_load_checkpoint_round_trip(model, tmp_path):
    loaded = load_nemotron_h(_save(model, tmp_path / "ok", rename=lambda k: k.replace("model.", "backbone.", 1)))
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k


def test_load_checkpoint_errors(model, tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_nemotron_h(tmp_path)
    bad = _save(model, tmp_path / "llama")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type: expected one of .*, got 'llama'") as e:
        load_nemotron_h(bad)
    from builders.qwen3_next import ACCEPTED_MODEL_TYPES

    # every model_type the project loads is named (the message said only 'nemotron_h'), from the one list
    assert str(list(ACCEPTED_MODEL_TYPES)) in str(e.value)
    assert {"nemotron_h", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"} <= set(
        ACCEPTED_MODEL_TYPES)
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5"}))  # a Qwen checkpoint: its loader
    with pytest.raises(CheckpointError, match="model_type 'qwen3_5' is a Qwen3-Next / Qwen3.5 checkpoint: load it "
                                              "with builders.qwen3_next.load_gdn_model"):
        load_nemotron_h(bad)
    with pytest.raises(CheckpointError, match="missing.*model.layers.0.mixer.A_log"):
        load_nemotron_h(_save(model, tmp_path / "missing", drop=("model.layers.0.mixer.A_log",)))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mixer.D: expected shape \(4,\), got \(3,\)"):
        load_nemotron_h(_save(model, tmp_path / "shape", reshape=("model.layers.0.mixer.D",)))
    with pytest.raises(CheckpointError, match="unexpected tensors.*model.extra"):
        load_nemotron_h(_save(model, tmp_path / "extra", extra=("model.extra",)))
    broken = _save(model, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_nemotron_h(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"expected \*.safetensors files"):
        load_nemotron_h(broken)


@pytest.fixture(scope="module")
def model3():
    return load_nemotron_h(seed=0, tiny="nemotron3")


def test_load_nvidia_moe_checkpoint(model3, tmp_path):
    """NVIDIA's per-expert tensors are stacked into transformers' expert parameters in expert order; in
    bf16 the router stays fp32 (transformers' _keep_in_fp32_modules_strict)."""
    loaded = load_nemotron_h(_save(model3, tmp_path / "ok", per_expert=True))
    for (k, a), b in zip(model3.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    bf = load_nemotron_h(_save(model3, tmp_path / "bf16", per_expert=True, dtype=torch.bfloat16), dtype=torch.bfloat16)
    moe = bf.model.layers[_moe_layers(model3)[0]].mixer
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.up_proj.dtype == torch.bfloat16
    assert torch.equal(moe.experts.up_proj[5], model3.model.layers[1].mixer.experts.up_proj[5].bfloat16())


UP1 = "backbone.layers.1.mixer.experts.{}.up_proj.weight"


@pytest.mark.parametrize("change, match", [
    (dict(drop=(UP1.format(3),)), r"model.layers.1.mixer.experts.up_proj: expected per-expert tensors for experts "
                                  r"0..7 .*missing experts \[3\]"),
    (dict(extra=(UP1.format(8),)), r"experts.up_proj: .*experts beyond 7: \[8\]"),
    (dict(reshape=(UP1.format(2),)), r"experts.2.up_proj.weight: expected shape \(64, 128\) like expert 0, "
                                     r"got \(63, 128\)"),
    (dict(extra=("model.layers.4.mixer.experts.down_proj",)), "down_proj: stored both stacked and per expert"),
    (dict(config=dict(n_routed_experts=16)), r"missing experts \[8, 9, 10, 11, 12, 13, 14, 15\]"),
    (dict(config=dict(n_group=3)), "n_group: expected a divisor of n_routed_experts=8, got 3"),
    (dict(config=dict(n_group=2, topk_group=4)), "topk_group: expected <= n_group=2, got 4"),
    (dict(config=dict(num_experts_per_tok=0)), "num_experts_per_tok: expected an integer >= 1 for the MoE layers"),
    (dict(config=dict(n_shared_experts=2)), "n_shared_experts: expected 1"),
    (dict(config=dict(hybrid_override_pattern="MEM*XM*E")), "hybrid_override_pattern: expected only ME\\*-, got 'X' "
                                                            "at position 4"),
    (dict(config=dict(layers_block_type=["mamba", "moe", "mamba", "attention", "dense_moe", "mamba", "attention",
                                         "moe"])), "layers_block_type: expected names in .* got 'dense_moe' at layer 4"),
], ids=["missing-expert", "extra-expert", "expert-shape", "stacked-and-split", "fewer-experts-than-config",
        "n_group", "topk_group", "top-k", "shared-experts", "pattern-letter", "layer-type"])
def test_moe_checkpoint_errors_name_the_key(model3, tmp_path, change, match):
    d = _save(model3, tmp_path / "bad", per_expert=True, **change)
    with pytest.raises(CheckpointError, match=match):
        load_nemotron_h(d)


# ---- scripts/build_engine.py ----------------------------------------------------------------------
def _build(*args):
    return build_engine(*args, timeout=170)


@pytest.mark.parametrize("tiny", TINIES)
def test_build_engine_tiny(tmp_path, tiny):
    out = tmp_path / "engine"
    r = _build("--out", out, "--buffer-len", L, "--max-seq-len", MAX_SEQ, "--max-batch", 4, "--tiny", tiny)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "engine"]
    assert not leftovers, leftovers  # no temporary directory survives, success or not
    assert r.returncode == 0, r.stderr
    assert "TensorRT >= 10.9" in r.stdout and f"the trtexec command is in {out / 'trtexec.sh'}" in r.stdout
    assert "trtexec --onnx" not in r.stdout  # the ~1,600-character command stays in trtexec.sh
    cfg = json.loads((out / "config.json").read_text())
    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    assert [k["tactic"] for k in cfg["plugin"]["kernels"]] == [1, 2]
    for k in cfg["plugin"]["kernels"]:  # the PTX trt_plugin.aot_impl hands TensorRT, one per tactic
        assert ".entry replayssm_decode" in (out / k["ptx"]).read_text() and k["spec"] in k["ptx"]
        assert k["extra_int32_args"] == ["batch", "slots"]
    g = onnx.load(str(out / "model.onnx"))
    inputs = {i.name for i in g.graph.input}
    outputs = {o.name for o in g.graph.output}
    assert all(s["name"] in inputs and s["output"] in outputs and s["shape"][0] == -1 for s in cfg["states"])
    assert {s["name"] for s in cfg["states"]} | {"input_ids"} == inputs
    assert sum(n.domain == DOMAIN for n in g.graph.node) == len(cfg["model"]["mamba_layers"]) == 3
    assert (out / "trtexec.sh").read_text().count("--maxShapes=input_ids:4x1") == 1
    _check_model_entry(cfg["model"], tiny)


def _check_model_entry(entry, tiny):
    """config.json's model: the layers by type from the pattern; the MoE keys where there are MoE layers."""
    letters = {"M": "mamba_layers", "*": "attention_layers", "E": "moe_layers"}
    assert entry["source"] == f"embedded-tiny-{tiny}" and entry["pattern"] == TINY_CONFIGS[tiny]["hybrid_override_pattern"]
    for letter, key in letters.items():
        assert entry[key] == [i for i, c in enumerate(entry["pattern"]) if c == letter], key
    if tiny == "nemotron3":
        assert entry["moe"] == dict({k: TINY3_CONFIG[k] for k in entry["moe"] if k != "formulation"},
                                    formulation="dense")
        assert entry["moe"]["n_routed_experts"] == 8 and entry["moe"]["num_experts_per_tok"] == 2
    else:
        assert "moe" not in entry


@pytest.mark.parametrize("tiny", TINIES)
def test_build_engine_spec(tmp_path, tiny):
    """--num-draft: verify.onnx + commit.onnx, the two plugins' PTX, config and trtexec naming both plugins."""
    out = tmp_path / "spec"
    r = _build("--out", out, "--buffer-len", 8, "--max-seq-len", MAX_SEQ, "--max-batch", 4, "--num-draft", 3,
               "--tiny", tiny)
    assert r.returncode == 0, r.stderr
    assert "verify.plan and commit.plan not built" in r.stdout and "trtexec --onnx" not in r.stdout
    assert f"the two trtexec commands are in {out / 'trtexec.sh'}" in r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["format"] == "trtllm-replayssm-spec-step/1" and (cfg["num_draft"], cfg["num_tokens"]) == (3, 4)
    plugins = {p["id"]: p for p in cfg["plugin"]["plugins"]}
    assert set(plugins) == {"replayssm::mamba2_verify", "replayssm::spec_commit"}
    verify, commit = plugins["replayssm::mamba2_verify"], plugins["replayssm::spec_commit"]
    assert verify["attributes"] == dict(nheads=4, headdim=64, dstate=64, ngroups=2, buffer_len=8, num_tokens=4)
    assert commit["attributes"] == dict(num_tokens=4, buffer_len=8) and commit["aliased_outputs"] == {
        "cursor_out": "cursor"}
    assert [k["tactic"] for k in verify["kernels"]] == [1, 2] and len(commit["kernels"]) == 1
    for p in (verify, commit):
        for k in p["kernels"]:
            assert f".entry {p['kernel']}(" in (out / k["ptx"]).read_text()
    script = (out / "trtexec.sh").read_text()
    assert "replayssm::mamba2_verify and replayssm::spec_commit" in script
    assert script.count("--maxShapes=input_ids:4x4,") == 1 and script.count("--onnx=commit.onnx") == 1
    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    for name, op, count in (("verify", "mamba2_verify", 3), ("commit", "spec_commit", 1)):
        g = onnx.load(str(out / f"{name}.onnx"))
        assert [n.op_type for n in g.graph.node if n.domain == DOMAIN] == [op] * count
        graph = cfg["graphs"][name]
        assert [i.name for i in g.graph.input] == [i["name"] for i in graph["inputs"]]
        assert [o.name for o in g.graph.output] == [o["name"] for o in graph["outputs"]]
    states = {s["name"]: s for s in cfg["states"]}
    assert states["conv_window_0"]["shape"] == [-1, 4 * 64 + 2 * 2 * 64, 3 + 3]
    assert states["conv_window_0"]["updated_by"] == {"verify": "conv_window_0_out", "commit": "conv_window_0_out"}
    assert states["cursor"]["updated_by"] == {"commit": "cursor_out"} and states["cursor"]["shape"] == [-1, 2]
    _check_model_entry(cfg["model"], tiny)
    assert sum(n.op_type == "TopK" for n in onnx.load(str(out / "verify.onnx")).graph.node) == len(
        cfg["model"]["moe_layers"])


@pytest.mark.parametrize("args, message", [
    (["--buffer-len", "5"], "--buffer-len: expected one of"),
    (["--max-batch", "0"], "--max-batch: expected >= 1, got 0"),
    (["--model", "/nonexistent"], "--model: expected an existing directory"),
    (["--num-draft", "2"], "--num-draft: expected 0 (standard decode) or one of [1, 3, 5, 7], got 2"),
    (["--num-draft", "7", "--buffer-len", "8"], "--buffer-len: speculative decoding needs >= 2 (num_draft + 1) = 16"),
    (["--tiny", "nemotron4"], "--tiny: invalid choice: 'nemotron4'"),
    (["--tiny", "nemotron3", "--model", "."], "--tiny: the embedded tiny configs are used only without --model"),
    (["--moe-formulation", "sorted"], "--moe-formulation: invalid choice: 'sorted'"),
])
def test_build_engine_bad_arguments(tmp_path, args, message):
    r = _build("--out", tmp_path / "engine", *args)
    assert r.returncode == 2 and message in r.stderr
    assert not any(tmp_path.iterdir())


def test_build_engine_overwrite_never_deletes_the_checkpoint(tmp_path):
    """--overwrite with --out the --model directory (or a directory holding it) is refused by name, before anything
    is read or written (it built the engine and then swapped it in for the checkpoint, deleting the checkpoint)."""
    ckpt = tmp_path / "models" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    for out in (ckpt, ckpt.parent, tmp_path / "models" / "." / "ckpt"):
        r = _build("--out", out, "--model", ckpt, "--overwrite")
        assert r.returncode == 2 and "--out: expected a directory that does not hold --model" in r.stderr, r.stderr
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["ckpt", "config.json", "models"]


def test_build_engine_broken_checkpoint(model, tmp_path):
    ckpt = _save(model, tmp_path / "ckpt", drop=("lm_head.weight",))
    r = _build("--out", tmp_path / "engine", "--model", ckpt)
    assert r.returncode == 1 and "missing" in r.stderr and "lm_head.weight" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_build_engine_nvidia_moe_checkpoint(model3, tmp_path):
    """A Nemotron 3 directory in NVIDIA's layout builds (--model, gather formulation recorded); one
    missing expert tensor fails naming it, before anything is written."""
    ckpt = _save(model3, tmp_path / "ckpt", per_expert=True)
    out = tmp_path / "engine"
    r = _build("--out", out, "--model", ckpt, "--buffer-len", L, "--max-seq-len", MAX_SEQ, "--max-batch", 2,
               "--moe-formulation", "gather")
    assert r.returncode == 0, r.stderr
    assert "3 MoE layers: 8 experts, top-2, as gather" in r.stdout
    entry = json.loads((out / "config.json").read_text())["model"]
    assert entry["source"] == str(ckpt) and entry["moe_layers"] == [1, 4, 7] and entry["moe"]["formulation"] == "gather"
    bad = _save(model3, tmp_path / "bad", per_expert=True, drop=("backbone.layers.7.mixer.experts.0.down_proj.weight",))
    r = _build("--out", tmp_path / "engine2", "--model", bad)
    assert r.returncode == 1 and "model.layers.7.mixer.experts.down_proj" in r.stderr and "missing experts [0]" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "ckpt", "engine"]


@pytest.mark.gpu
@torch.no_grad()
def test_greedy_tokens_match_unpatched_model_cuda():
    """Same as the CPU test with the CUDA kernel (trtllm_replayssm.families.mamba2.ops.replay_decode) as the backend."""
    model = load_nemotron_h(seed=0, device="cuda")
    ids = _prompt(2, 7).cuda()
    kw = dict(max_new_tokens=64, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    dec = patch_replayssm(model, buffer_len=L)
    try:
        out = model.generate(ids, **kw)
    finally:
        dec.unpatch()
    assert torch.equal(out.sequences, ref.sequences)
    assert dec.cursor.tolist() == [63 % L] * 2
    # fp32 kernel vs fp32 conventional update: both round in fp32, different orders
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=0, atol=1e-3)


@torch.no_grad()
def test_check_values_reaches_the_cache(model):
    """patch_replayssm(check_values=...) is the cache's (host checks of slots and cursors; False: no syncs)."""
    ids = _prompt(2, 5)
    for check in (None, False, True):
        dec = patch_replayssm(model, buffer_len=L, check_values=check)
        try:
            model.generate(ids, max_new_tokens=3, do_sample=False)
        finally:
            dec.unpatch()
        assert dec.cache.check_values is check and dec.cursor.tolist() == [2, 2]
