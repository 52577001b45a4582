# SPDX-License-Identifier: Apache-2.0
"""The speculative Kimi-Linear engine directory (``scripts/build_engine.py --tiny kimi_linear --num-draft 3``) on the
CPU: the verify graph (builders/kimi_step.py's ``KimiKDADecodeStep`` at T = 1 + num_draft, one
``replayssm::kda_verify[_shadow]`` node per Kimi Delta Attention layer) and the shared commit graph
(builders/spec_step.py, one ``replayssm::spec_commit`` node: the commit is a cursor move), run under onnxruntime with
the family's reference ops (trtllm_replayssm/families/kda/onnx_ops.py ``verify_node``: families/kda/reference.py's
flush + verify in float64; builders/ort_reference.py registers them) and driven by tests/spec_driver.py, the driver of
the other families' speculative graphs. Rows have different prompt lengths and ring starts that wrap; they are handed
off after transformers' prefill and 2 standard ReplaySSM decode steps of the patched model (builders/kda.py).

Oracles, each where it holds:
* the PyTorch modules for the ONNX graphs (the same float64 KDA node; projections, conv, MLA and MoE are fp32 ops of
  two runtimes): logits and states to rtol 1e-4 / atol 2e-5, the bf16 states (u ring, shadow) to one bf16 ulp (an
  input that differs in its last fp32 bits may round to the neighbouring bf16 value); cursor, lengths and conv
  windows of the commit exact.
* the patched transformers model with a float64 checkpoint and float64 rings (an exact ReplaySSM KDA oracle, its own
  L = 4 and fold points) fed the committed tokens one at a time: the verify logits of every accepted position to
  :data:`TOL`, the engine's bf16 u ring being the difference (below); at the end the committed KDA state of the first
  layer (its inputs carry no ring rounding) to 1e-5 relative, the conv windows' last K - 1 inputs and the MLA latents.
  One corrupted committed u entry must break it (teeth).
* transformers' own greedy ``generate``: greedy acceptance of drafts taken from the greedy continuation, 30% of them
  corrupted, reproduces it token for token, with and without the bf16 shadow, every row crossing >= 2 folds; the
  verify logits of every committed position stay within :data:`TOL` of generate's, and the test checks its premise:
  along these prompts' greedy paths the top-2 margin exceeds 2 TOL, so equal tokens follow from the logits bound and
  are not luck of near-ties.
TensorRT cannot be installed here: the plan build is a GPU test that skips with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from builders import engine_format as ef  # noqa: E402
from builders.decode_step import DOMAIN  # noqa: E402
from builders.kda import kda_layers, patch_kda_replayssm, text_model, tiny_model  # noqa: E402
from builders.kimi_step import KimiKDADecodeStep  # noqa: E402
from builders.spec_step import COMMIT_OP_TYPE, NemotronHSpecCommit  # noqa: E402
from trtllm_replayssm import trt_plugin  # noqa: E402
from trtllm_replayssm.families.kda import reference as kref  # noqa: E402
from trtllm_replayssm.families.kda import trt_plugin as kp  # noqa: E402

from .spec_driver import (  # noqa: E402
    ModuleRunner,
    OrtRunner,
    SpecDecode,
    check_greedy_acceptance,
    check_shadow_spec,
    random_accept,
    sequential_check,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUM_DRAFT, L_SPEC, L_SEQ = 3, 16, 4
T = NUM_DRAFT + 1
MAX_SEQ = 96
STEPS = 12
PRE_DECODE = 2
PROMPT_LENS = (5, 7, 6)
STARTS = (0, 11, 15)
PROMPT_SEED = 3  # the prompts of every run (the greedy test's premise below holds for them)
VOCAB = 256
RTOL, ATOL = 1e-4, 2e-5  # ONNX graph vs PyTorch module: the same float64 node, fp32 layers in two runtimes
# Logits vs an exact (float64-ring) ReplaySSM KDA oracle: the engine's u ring is bf16 by the format (DESIGN §5), each
# committed entry a 2^-9 relative rounding that the output path reads until the next fold; observed <= 8.1e-4 on
# logits of std ~0.2 under random acceptance, <= 2.7e-4 on the greedy paths; 2e-3 is far below what a wrong entry,
# cursor or conv window does (the teeth test's corrupted entry moves them by > 1e-1).
TOL = 2e-3
# The same with the bf16 shadow: non-fold verifies read the checkpoint rounded to bf16 (2^-9 relative of the whole
# state's contribution, not one entry's); observed <= 1.8e-3 under random acceptance, <= 4.0e-4 on the greedy paths.
SHADOW_TOL = 5e-3
# The MLA layer's cached latents (RMS-normed, entries O(1)) and rope keys behind three KDA layers: the same bf16 ring
# rounding reaches them at ~1e-3; observed <= 3.6e-3. A latent at a wrong position is O(1) off.
MLA_TOL = 1e-2

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxruntime",
                                                                         "onnxruntime_extensions")),
                       reason="onnx, onnxruntime and onnxruntime-extensions are needed to run the graphs on the CPU"),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("kimi_linear")


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    """Speculative engine directories by shadow (builders/engine.py's build, as the script runs it), built on first
    use: (step, commit module, directory, verify session, commit session)."""
    from builders.engine import BuildOptions, build
    from builders.ort_reference import session

    made = {}

    def get(shadow: str = "none"):
        if shadow not in made:
            out = build(BuildOptions(out=tmp_path_factory.mktemp(f"kda_spec_{shadow}") / "e", tiny="kimi_linear",
                                     buffer_len=L_SPEC, max_seq_len=MAX_SEQ, max_batch=4, num_draft=NUM_DRAFT,
                                     shadow=shadow))
            step = KimiKDADecodeStep(model, L_SPEC, MAX_SEQ, shadow=shadow, num_draft=NUM_DRAFT)
            made[shadow] = (step, NemotronHSpecCommit(step), out, session(out / "verify.onnx"),
                            session(out / "commit.onnx"))
        return made[shadow]

    return get


def _prompts():
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(2, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]


def _decode(model, step, prompts=None):
    return SpecDecode(model, step, prompts or _prompts(), patch_kda_replayssm, PRE_DECODE, STARTS)


def _drafts(gen):
    return torch.randint(0, VOCAB, (len(PROMPT_LENS), NUM_DRAFT), generator=gen)


def _conv_kernel(model) -> int:
    return text_model(model).layers[kda_layers(model)[0]].self_attn.conv_kernel_size


def _exact_oracle(model, buffer_len):
    """The patched model with a float64 checkpoint and float64 rings (the cache's ring role follows a float64
    state): an exact ReplaySSM KDA oracle."""
    return patch_kda_replayssm(model, buffer_len=buffer_len, state_dtype=torch.float64)


_KDA_BUFFERS = ("kda_state", "kda_k", "kda_u", "kda_g", "kda_v", "kda_beta")


def _committed(st, run, b, i):
    """The committed KDA state (float64) of row b, layer i, from the graphs' state outputs (the exact fold of the
    checkpoint and the committed ring entries)."""
    return kref.committed_state(kref.KDABuffers(*(st[f"{n}_{i}"] for n in _KDA_BUFFERS)), run.cursor, b)


def _kda_state(st, run, dec, b, i):
    return _committed(st, run, b, i), kref.replay_state(dec.bufs[i], dec.cursor, 0)


def _sequential_check(model, run: SpecDecode, tol: float = TOL) -> int:
    """Each row's committed tokens one at a time through the exact oracle: logits of every accepted position to
    ``tol`` (spec_driver.sequential_check; its state check is the 1e-5 one, for rings that round alike: ours is
    :func:`_check_end_state`)."""
    return sequential_check(model, run, _exact_oracle, L_SEQ, PRE_DECODE, 0, tol, kda_layers(model),
                            _conv_kernel(model), [], _kda_state, False)


@torch.no_grad()
def _check_end_state(model, run: SpecDecode) -> None:
    """After the run, per row, against the exact oracle fed the same committed tokens: lengths; the first KDA layer's
    committed state to 1e-5 relative (its inputs are the tokens' embeddings through fp32 ops, the fold is exact from
    the stored k, v, g, beta: no bf16 rounding reaches it); the later KDA layers' to 1e-3 relative (their inputs carry
    the earlier layers' bf16 u ring rounding, TOL-level); each conv window's last K - 1 inputs to the same bounds by
    layer; the MLA layer's latents and rope keys at the committed positions to MLA_TOL."""
    from transformers import DynamicCache

    kda = kda_layers(model)
    K = _conv_kernel(model)
    mla = [i for i, k in enumerate(model.config.layer_types) if k == "full_attention"]
    st = dict(zip(run.names, run.states))
    for b, prompt in enumerate(run.prompts):
        dec = _exact_oracle(model, L_SEQ)
        try:
            cache = DynamicCache(config=model.config)
            model(prompt[None], cache=cache, use_cache=True)
            for tok in run.tokens[b][:PRE_DECODE] + [t for t, _ in run.records[b]]:
                model(torch.tensor([[tok]]), cache=cache, use_cache=True)
            length = int(run.lengths[b])
            assert length == len(prompt) + PRE_DECODE + len(run.records[b]) == cache.get_seq_length()
            for i in kda:
                got, want = _kda_state(st, run, dec, b, i)
                tol = 1e-5 if i == kda[0] else 1e-3
                rel = float((got - want).norm() / want.norm())
                assert rel < tol, (b, i, rel)
                torch.testing.assert_close(st[f"conv_window_{i}"][b, :, -(K - 1):], cache.get_conv_state(i)[0, :, 1:],
                                           rtol=tol, atol=tol, msg=lambda m, b=b, i=i: f"row {b}, conv_window_{i}: {m}")
            for i in mla:  # transformers keeps (batch, 1, seq, .): the normed latent and the rope key
                layer = cache.layers[i]
                for name, want in (("mla_kv", layer.keys), ("mla_k_rope", layer.values)):
                    torch.testing.assert_close(st[f"{name}_{i}"][b, :length], want[0, 0, :length], rtol=0,
                                               atol=MLA_TOL, msg=lambda m, b=b, n=f"{name}_{i}": f"row {b}, {n}: {m}")
        finally:
            dec.unpatch()


# ---- scripts/build_engine.py --tiny kimi_linear --num-draft 3 ----------------------------------------------------
def test_build_engine_writes_the_speculative_directory(tmp_path):
    """The command of the issue, defaults otherwise (--buffer-len 16): verify.onnx with one kda_verify node per KDA
    layer, commit.onnx with the spec_commit node, the PTX each plugin's aot_impl hands TensorRT (byte-equal), the
    states and which graph updates each, config.json in the spec format."""
    import onnx

    out = tmp_path / "spec"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_engine.py"), "--tiny", "kimi_linear",
                        "--num-draft", "3", "--out", str(out)], capture_output=True, text=True, env=env, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "exporting verify.onnx (3 replayssm::kda_verify nodes, T = 4)" in r.stdout
    assert "tests/test_kda_spec_export.py" in r.stdout and "verify.plan and commit.plan not built" in r.stdout
    cfg = json.loads((out / "config.json").read_text())
    ef.check_layer_states(cfg)
    assert cfg["format"] == ef.SPEC_FORMAT and (cfg["num_draft"], cfg["num_tokens"], cfg["conv_window"]) == (3, 4, 6)
    assert (cfg["buffer_len"], cfg["model"]["pattern"], cfg["model"]["kda_layers"]) == (16, "KKKA", [0, 1, 2])
    assert "shadow" not in cfg and cfg["step"][0] == "verify" and cfg["step"][2] == "commit"
    plugins = {p["id"]: p for p in cfg["plugin"]["plugins"]}
    assert set(plugins) == {f"{DOMAIN}::{kp.VERIFY}", f"{DOMAIN}::{COMMIT_OP_TYPE}"}
    verify = plugins[f"{DOMAIN}::{kp.VERIFY}"]
    attrs = dict(num_heads=2, key_dim=64, value_dim=64, buffer_len=16, use_qk_l2norm=1, lower_bound_bits=0,
                 num_tokens=4)
    assert verify["attributes"] == attrs and verify["nodes"] == 3 and verify["graph"] == "verify"
    assert verify["inputs"] == list(kp.INPUT_NAMES) and verify["outputs"] == list(kp.OUTPUT_NAMES)
    assert verify["aliased_outputs"] == kp.PLUGINS[kp.VERIFY].manifest()["aliased_outputs"]
    assert [k["tactic"] for k in verify["kernels"]] == sorted(trt_plugin.TACTICS)
    for k in verify["kernels"]:
        want = kp.aot_verify_kernel(*attrs.values(), "f32", 90, k["tactic"])
        assert (out / k["ptx"]).read_bytes() == want.ptx and k["kernel"] == kp.VERIFY_KERNEL_NAME
        assert k["grid"] == [want.grid_x, "batch", 1] and k["extra_int32_args"] == ["batch", "slots"]
    commit = plugins[f"{DOMAIN}::{COMMIT_OP_TYPE}"]
    assert commit["attributes"] == dict(num_tokens=4, buffer_len=16) and commit["graph"] == "commit"
    (k,) = commit["kernels"]
    assert (out / k["ptx"]).read_bytes() == trt_plugin.aot_commit_kernel(4, 16, 90).ptx
    assert f"{DOMAIN}::{kp.VERIFY} and {DOMAIN}::{COMMIT_OP_TYPE}" in (out / "trtexec.sh").read_text()
    for name, op, count in (("verify", kp.VERIFY, 3), ("commit", COMMIT_OP_TYPE, 1)):
        g = onnx.load(str(out / f"{name}.onnx"))
        assert [n.op_type for n in g.graph.node if n.domain == DOMAIN] == [op] * count
        assert [i.name for i in g.graph.input] == [i["name"] for i in cfg["graphs"][name]["inputs"]]
        assert [o.name for o in g.graph.output] == [o["name"] for o in cfg["graphs"][name]["outputs"]]
        # static shapes TensorRT builds without plugins of its own: nothing data-dependent
        assert not {n.op_type for n in g.graph.node} & {"NonZero", "Loop", "If", "Scan", "ScatterND",
                                                        "ScatterElements"}
        if name == "verify":
            for n, i in zip((n for n in g.graph.node if n.domain == DOMAIN), (0, 1, 2)):
                a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
                assert a == {"plugin_namespace": DOMAIN.encode(), "aot": 1, **attrs}
                assert list(n.input[8:]) == ["cursor"] + [f"{s}_{i}" for s in _KDA_BUFFERS]
                assert list(n.output[1:]) == [f"{s}_{i}_out" for s in _KDA_BUFFERS]
    assert cfg["graphs"]["verify"]["outputs"][0] == dict(name="logits", shape=[-1, 4, 256], dtype="float32")
    states = {s["name"]: s for s in cfg["states"]}
    assert states["cursor"]["shape"] == [-1, 2] and states["cursor"]["updated_by"] == {"commit": "cursor_out"}
    assert states["conv_window_0"]["shape"] == [-1, 3 * 2 * 64, 3 + 3]
    assert states["conv_window_0"]["updated_by"] == {"verify": "conv_window_0_out", "commit": "conv_window_0_out"}
    assert states["kda_u_1"]["updated_by"] == {"verify": "kda_u_1_out"} and states["kda_u_1"]["dtype"] == "float32"
    assert states["mla_kv_3"]["shape"] == [-1, 4096, 32] and states["mla_kv_3"]["updated_by"] == {
        "verify": "mla_kv_3_out"}


def test_one_step_class_and_the_standard_step_unchanged(model):
    """T = 1 + num_draft: the same class is the standard decode step (kda_decode, conv_state_i, cursor (batch,)) at
    num_draft = 0 and the verify step (kda_verify, conv_window_i of K - 1 + num_draft) above; the commit graph is the
    shared one over the verify step's conv windows."""
    std = KimiKDADecodeStep(model, L_SPEC, MAX_SEQ)
    spec = KimiKDADecodeStep(model, L_SPEC, MAX_SEQ, num_draft=NUM_DRAFT)
    K = _conv_kernel(model)
    assert (std.speculative, std.num_tokens, std.op_type, std.window) == (False, 1, kp.DECODE, K)
    assert (spec.speculative, spec.num_tokens, spec.op_type, spec.window) == (True, T, kp.VERIFY, K - 1 + NUM_DRAFT)
    assert KimiKDADecodeStep(model, L_SPEC, MAX_SEQ, num_draft=1, shadow="bf16").op_type == kp.VERIFY_SHADOW
    assert std.plugin_attributes() == {k: v for k, v in spec.plugin_attributes().items() if k != "num_tokens"}
    assert list(spec.plugin_attributes()) == list(kp.VERIFY_ATTRIBUTES)
    assert [n.replace("conv_state_", "conv_window_") for n in std.input_names()] == spec.input_names()
    assert std.output_names()[3:] == [n.replace("conv_window_", "conv_state_") for n in spec.output_names()[1:]]
    commit = NemotronHSpecCommit(spec)
    assert [s.name for s in commit.state_specs()] == [f"conv_window_{i}" for i in kda_layers(model)]
    with pytest.raises(ValueError, match=r"input_ids: expected \(batch, 4\)"):
        spec(torch.ones(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
             torch.zeros(2, 2, dtype=torch.int32), *spec.empty_states(2))


# ---- the graphs under onnxruntime ------------------------------------------------------------------------------
def test_onnx_graphs_match_the_modules(model, engines):
    step, commit, _, sv, sc = engines("none")
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
            assert x.dtype == y.dtype, name
            # the bf16 u ring: one bf16 ulp (<= 2^-7 relative) where an fp32 input rounded to the neighbouring value
            tol = dict(rtol=2 ** -7, atol=1e-6) if x.dtype == torch.bfloat16 else dict(rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(x.float(), y.float(), **tol, msg=lambda m, s=s, n=name: f"step {s}: {n}: {m}")
    assert a.tokens == b.tokens


def test_random_acceptance_matches_sequential_decoding(model, engines):
    """Random n in 1..T per row (all T every 3rd step): every accepted position's verify logits equal the exact
    oracle's sequential ones; every row folds >= 2 times; the end states (:func:`_check_end_state`)."""
    step, commit, _, sv, sc = engines("none")
    run = _decode(model, step)
    ort = OrtRunner(step, commit, sv, sc)
    gen = torch.Generator().manual_seed(5)
    accept = random_accept(torch.Generator().manual_seed(6), T)
    for _ in range(STEPS):
        run.run_step(ort, _drafts(gen), accept)
    assert min(run.flushes) >= 2, run.flushes
    assert _sequential_check(model, run) == sum(len(r) for r in run.records) >= STEPS * len(PROMPT_LENS)
    _check_end_state(model, run)


def test_sequential_comparison_has_teeth(model, engines):
    """One corrupted committed u entry (row 1, the first KDA layer's ring) must be caught by the oracle."""
    step, commit, _, sv, sc = engines("none")
    run = _decode(model, step)
    ort = OrtRunner(step, commit, sv, sc)
    gen = torch.Generator().manual_seed(5)
    accept = random_accept(torch.Generator().manual_seed(6), T)
    run.run_step(ort, _drafts(gen), accept)
    start, count = (int(v) for v in run.cursor[1])
    assert count + 2 * T <= L_SPEC  # the next verify reads the history (no fold first)
    u = run.states[run.names.index(f"kda_u_{kda_layers(model)[0]}")]
    u[1, :, (start + count - 1) % L_SPEC] += 1.0
    run.run_step(ort, _drafts(gen), accept)
    with pytest.raises(AssertionError, match="row 1"):
        _sequential_check(model, run)


@pytest.mark.parametrize("shadow", ["none", "bf16"])
@torch.no_grad()
def test_greedy_acceptance_reproduces_greedy_decoding(model, engines, shadow):
    """Drafts from transformers' greedy continuation, 30% corrupted, accepted greedily (spec_driver): the accepted
    tokens are generate's, token for token, both accepted and rejected drafts occur, every row folds >= 2 times; the
    verify logits of every committed position are generate's to TOL (SHADOW_TOL), and every token decision had
    headroom: generate's smallest top-2 margin at a committed position exceeds twice the largest logit deviation (so
    equal tokens are not luck of a near-tie; here 4.7e-3 against <= 4.0e-4)."""
    step, commit, _, sv, sc = engines(shadow)
    prompts = _prompts()
    runs = []

    def make_run(p):
        runs.append(_decode(model, step, p))
        return runs[-1]

    check_greedy_acceptance(model, prompts, make_run, OrtRunner(step, commit, sv, sc), STEPS, NUM_DRAFT, VOCAB,
                            PRE_DECODE)
    (run,) = runs
    new = PRE_DECODE + 1 + STEPS * T
    tol = TOL if shadow == "none" else SHADOW_TOL
    margins, deviations = [], []
    for b, p in enumerate(prompts):  # committed position i (fed token PRE_DECODE + i) predicts token PRE_DECODE + 1 + i
        ref = model.generate(p[None], max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True).logits
        for i, (_, logits) in enumerate(run.records[b]):
            want = ref[PRE_DECODE + 1 + i][0]
            torch.testing.assert_close(logits, want, rtol=0, atol=tol,
                                       msg=lambda m, b=b, i=i: f"row {b}, committed position {i}: {m}")
            margins.append(float(want.topk(2).values.diff().abs()))
            deviations.append(float((logits - want).abs().max()))
    assert min(margins) > 2 * max(deviations), (min(margins), max(deviations))


def test_shadow_verify_graph_follows_the_module(model, engines):
    """``--shadow bf16 --num-draft 3``: one ``kda_verify_shadow`` node per KDA layer (its PTX the plugin's shadow
    kernel) and kda_shadow_i after each checkpoint. Under onnxruntime with random acceptance across folds the graphs
    follow the PyTorch verify step, and the shadow is bf16(checkpoint) after every fold and untouched otherwise
    (spec_driver.check_shadow_spec); the logits stay within TOL of the exact oracle (non-fold verifies read the
    shadow: its rounding is of the bf16 ring's order)."""
    import onnx

    step, commit, out, sv, sc = engines("bf16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["shadow"] == "bf16"
    (verify,) = [p for p in cfg["plugin"]["plugins"] if p["graph"] == "verify"]
    assert verify["id"] == f"{DOMAIN}::{kp.VERIFY_SHADOW}" and verify["inputs"] == list(kp.SHADOW_INPUT_NAMES)
    for k in verify["kernels"]:
        want = kp.aot_verify_kernel(*verify["attributes"].values(), "f32", 90, k["tactic"], "bf16")
        assert (out / k["ptx"]).read_bytes() == want.ptx
    names = [s["name"] for s in cfg["states"]]
    assert names[names.index("kda_state_0") + 1] == "kda_shadow_0"
    g = onnx.load(str(out / "verify.onnx"))
    assert [n.op_type for n in g.graph.node if n.domain == DOMAIN] == [kp.VERIFY_SHADOW] * 3
    run = _decode(model, step)
    gen = torch.Generator().manual_seed(5)
    check_shadow_spec(run, OrtRunner(step, commit, sv, sc), ModuleRunner(step, commit, None, None),
                      lambda: _drafts(gen), random_accept(torch.Generator().manual_seed(6), T), STEPS, "kda_shadow")
    assert min(run.flushes) >= 2, run.flushes
    assert _sequential_check(model, run, SHADOW_TOL) >= STEPS * len(PROMPT_LENS)


# ---- the verify node itself ------------------------------------------------------------------------------------
def test_verify_node_is_the_family_spec():
    """onnx_ops.verify_node (the graph's node in onnxruntime and the module's eager node) on random states: the fold
    where count + 2T > L then the window, as families/kda/reference.py spells it (flush_checkpoint, flush_cursor,
    verify: rings and checkpoint exact, the kernel's triangular route for y to 1e-12), on copies (inputs untouched, the
    cursor not moved), a padding row touching nothing; attributes that disagree with the shapes are refused by name."""
    from trtllm_replayssm.families.kda.onnx_ops import verify_node

    S, H, K, V, L, Tn = 4, 2, 8, 8, 8, 3
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    buf = kref.KDABuffers.alloc(S, H, K, V, L, act=torch.float64, ring=torch.float32, f32=torch.float32)
    buf.state.copy_(rnd(S, H, K, V))
    for t in (buf.k_cache, buf.u_cache, buf.v_cache):
        t.copy_(rnd(*t.shape))
    buf.g_cache.copy_(-rnd(S, H, L, K).abs() * 0.1)
    buf.beta_cache.copy_(torch.rand(S, H, L, generator=gen))
    cursor = torch.tensor([[3, 1], [6, 4], [0, 2], [5, 3]], dtype=torch.int32)  # rows 1, 3 fold (count + 6 > 8)
    sbi = torch.tensor([1, -1, 0, 3], dtype=torch.int32)  # slot 2 unused, one padding row
    ins = (rnd(4, Tn, H, K), rnd(4, Tn, H, K), rnd(4, Tn, H, V), rnd(4, Tn, H, K), rnd(4, Tn, H), rnd(H) * 0.5,
           rnd(H, K), sbi, cursor)
    attrs = dict(num_heads=H, key_dim=K, value_dim=V, buffer_len=L, use_qk_l2norm=1, lower_bound_bits=0,
                 num_tokens=Tn)
    before = [t.clone() for t in (*ins, *buf.tensors())]
    y, *states = verify_node(*ins, *buf.tensors(), **attrs)
    assert all(torch.equal(a, b) for a, b in zip(before, (*ins, *buf.tensors())))  # functional
    want = buf.clone()
    after = cursor.clone()
    flushed = kref.flush_checkpoint(want, after, Tn, sbi)
    assert sorted(flushed) == [1, 3]
    from trtllm_replayssm import cursor as cursors

    cursors.flush_cursor(after, Tn, L, sbi)
    tri = kref.verify_triangular(want, after, *ins[:7], sbi, flushed=flushed)
    y_ref = kref.verify(want, after, *ins[:7], sbi, flushed=flushed)
    for got, w in zip(states, want.tensors()):
        assert torch.equal(got, w)
    live = sbi >= 0
    torch.testing.assert_close(y[live], y_ref[live].to(y.dtype), rtol=0, atol=0)
    torch.testing.assert_close(y[live], tri[live], rtol=1e-12, atol=1e-12)  # float64: two routes, one algebra
    assert torch.isnan(y[~live]).all()
    for got, old in zip(states, buf.tensors()):  # the unused slot 2
        assert torch.equal(got[2], old[2])
    with pytest.raises(ValueError, match=r"replayssm::kda_verify: attributes .*'num_tokens': 4.*'num_tokens': 3"):
        verify_node(*ins, *buf.tensors(), **dict(attrs, num_tokens=4))


# ---- what a speculative Kimi-Linear engine cannot be -------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(num_draft=2), r"--num-draft: expected 0 \(standard decode\) or one of \[1, 3, 5, 7\], got 2"),
    (dict(num_draft=3, buffer_len=4), r"--buffer-len: speculative decoding needs >= 2 \(num_draft \+ 1\) = 8"),
    (dict(num_draft=3, buffer_len=32), r"KDASpec.buffer_len: expected 2..16, got 32 \(the kda_verify plugin's kernel"
                                       r".*--buffer-len 32, num_tokens = --num-draft 3 \+ 1\)"),
    (dict(num_draft=3, shadow="fp8"), r"--shadow fp8: Kimi Delta Attention models \(Kimi-Linear\) take replay_bf16"),
    (dict(num_draft=3, state_dtype="bf16"), "--state-dtype: Kimi Delta Attention checkpoints are fp32"),
])
def test_refused_by_flag_before_anything_is_written(tmp_path, kw, match):
    from builders.engine import BuildError, BuildOptions, build

    with pytest.raises(BuildError, match=match):
        build(BuildOptions(out=tmp_path / "e", tiny="kimi_linear", max_seq_len=MAX_SEQ, **kw))
    assert list(tmp_path.iterdir()) == []


def test_step_refuses_bad_windows(model):
    with pytest.raises(ValueError, match=r"buffer_len: expected in \[2 \(num_draft \+ 1\), 32\] = \[8, 32\]"):
        KimiKDADecodeStep(model, 6, MAX_SEQ, num_draft=3)
    with pytest.raises(ValueError, match=r"num_draft: expected >= 0 \(0: standard decode\), got -1"):
        KimiKDADecodeStep(model, 8, MAX_SEQ, num_draft=-1)


# ---- TensorRT (not installable here: skips with the reason) ----------------------------------------------------
@pytest.mark.gpu
def test_tensorrt_builds_the_plans(engines, tmp_path):
    """Where TensorRT >= 10.9 and a GPU are present, verify.onnx and commit.onnx parse with the registered kda_verify
    and spec_commit plugins and build plans (builders/engine.py's build_plan)."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it cannot be installed on the CPU machine)")
    from builders.engine import build_plan, tensorrt_status

    trt, why = tensorrt_status()
    if trt is None:
        pytest.skip(why)
    _, _, out, _, _ = engines("none")
    cfg = json.loads((out / "config.json").read_text())
    for name, graph in cfg["graphs"].items():
        io = [(i["name"], tuple(i["shape"])) for i in graph["inputs"]]
        build_plan(trt, out / graph["onnx"], tmp_path / f"{name}.plan", io, cfg["max_batch"])
        assert (tmp_path / f"{name}.plan").stat().st_size > 0
