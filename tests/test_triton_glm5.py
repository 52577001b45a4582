# SPDX-License-Identifier: Apache-2.0
"""The streaming Triton model (builders/triton_generate.py, ``--backend python``) serving GLM-5 Next: ``--tiny
glm5_next`` and ``--model`` on a checkpoint directory in the published layout (config.json with ``text_config`` /
``vision_config``, safetensors under the published names: ``model.language_model.layers.<i>.hc_attn_fn`` ...),
loaded from config.pbtxt's parameters as the server loads it, in process under test_triton_generate.py's stand-in
stub. Oracle: transformers' greedy ``generate`` of the same weights, token for token (the engine's step:
builders/glm5_step.py, tests/test_generation_glm5.py). Refusals name the flag and the key or tensor.
"""

import importlib.util
import json
import pathlib

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("google.protobuf", reason="protobuf is not installed (the repository writer's config.pbtxt)")

from builders import triton_generate as tg  # noqa: E402
from builders.kda import tiny_model  # noqa: E402

from .test_triton_generate import _FakePb, _FakeRequest  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = pathlib.Path(__file__).resolve().parent.parent
JOBS = [([3, 1, 4, 1, 5, 9, 2, 6, 5], 9), ([9, 2, 6], 6)]  # the 9-token prompt: the DSA picks pools, L = 4 folds


def _params(**kw):
    p = dict(seed="0", dtype="float32", device="cpu", max_slots="1", max_seq_len="48", buffer_len="4",
             mode="replay", health_url="off", **kw)
    return {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in p.items()}})}


def _serve(params, want):
    """GenerateModel built from ``params`` as the server builds it; both JOBS on its one slot (one waits) must stream
    ``want``."""
    pb = _FakePb(False)
    gm = tg.GenerateModel(pb, params)
    try:
        assert type(gm.engine.step).__name__ == "Glm5Step"
        reqs = [_FakeRequest(pb, {"input_ids": p, "max_tokens": [n]}) for p, n in JOBS]
        gm.execute(reqs)
        for r, (_, n), w in zip(reqs, JOBS, want):
            assert r.done.wait(60)
            ids = [t for resp, _ in r.responses for t in resp.outputs["output_ids"].raw.tolist()]
            assert ids == w
            assert r.responses[-1][0].outputs["completion_tokens"].raw.tolist() == [n] and r.responses[-1][1] == 1
    finally:
        gm.finalize()


def _greedy(model):
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p, n in JOBS]


def test_glm5_next_tiny_repository_from_the_cli(tmp_path):
    """``make_triton_repo.py --backend python --tiny glm5_next`` writes glm5_next_replayssm; the model loads it from
    config.pbtxt's parameters (``load_model``: builders/kda.py) and streams transformers' greedy tokens; the fp8
    shadow and the 8-bit checkpoint are refused for it by name, nothing written."""
    spec = importlib.util.spec_from_file_location("make_triton_repo", ROOT / "scripts" / "make_triton_repo.py")
    mtr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mtr)
    assert mtr.main(["--backend", "python", "--repo", str(tmp_path / "r"), "--device", "cpu", "--tiny", "glm5_next",
                     "--max-slots", "1", "--buffer-len", "4"]) == 0
    assert (tmp_path / "r" / "glm5_next_replayssm" / "config.pbtxt").is_file()
    for mode, what in (("replay_fp8", r"GLM-5 Next\) take replay_bf16 .* no fp8 KDA shadow"),
                       ("replay_ckpt8", "for Mamba-2 models")):
        with pytest.raises(tg.RepoError, match=what):
            tg.make_generate_repo(tmp_path / mode, tiny="glm5_next", device="cpu", mode=mode)
        assert not (tmp_path / mode).exists()
    _serve(_params(tiny="glm5_next"), _greedy(tiny_model("glm5_next", seed=0)))


def _edit(ckpt: pathlib.Path, fn) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    fn(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_glm5_next_checkpoint_directory(tmp_path):
    """``--model DIR`` of a GLM-5 Next checkpoint (the tiny's weights saved in the published layout): the writer loads
    it as the server will and builds its decode step, the server's model serves transformers' greedy tokens. Refused
    by name, nothing written: a missing tensor (named as the checkpoint spells it), layer_types outside KDA / DSA, a
    first DSA layer that shares a top-k nobody computed (indexer_types), a text_config without vocab_size."""
    from safetensors.torch import load_file, save_file

    model = tiny_model("glm5_next", seed=3)
    ckpt = tmp_path / "glm5"
    model.save_pretrained(ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "glm5_next" and "vocab_size" in raw["text_config"] and "vocab_size" not in raw
    repo = tg.make_generate_repo(tmp_path / "repo", model_dir=ckpt, device="cpu", max_slots=1, buffer_len=4)
    assert repo.name == "glm5_next_replayssm"
    _serve(_params(model_dir=str(ckpt), tiny=""), _greedy(model))

    def copy(name):
        import shutil

        return pathlib.Path(shutil.copytree(ckpt, tmp_path / name))

    gone = "model.language_model.layers.1.hc_attn_fn"  # the published name of layers.1.attn_hc.fn
    bad = copy("missing")
    for f in bad.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(f).items() if k != gone}, f, metadata={"format": "pt"})
    cases = [(bad, rf"--model: .* does not load .*1 tensors missing .*'{gone}'")]
    bad = copy("sliding")
    _edit(bad, lambda c: c["text_config"].__setitem__("layer_types", c["text_config"]["layer_types"][:3] +
                                                      ["sliding_attention"]))
    cases.append((bad, r"layer_types: expected KDA layers .* got 'sliding_attention' at layer 3"))
    bad = copy("shared")
    _edit(bad, lambda c: c["text_config"].__setitem__("indexer_types", ["full", "full", "full", "shared"]))
    cases.append((bad, r"decode step refuses .*indexer_types: the first DSA layer \(3\) must run its own indexer"))
    bad = copy("novocab")
    _edit(bad, lambda c: c["text_config"].pop("vocab_size"))
    cases.append((bad, r"vocab_size \(or text_config.vocab_size\): expected a positive integer, got None"))
    for d, match in cases:
        with pytest.raises(tg.RepoError, match=match):
            tg.make_generate_repo(tmp_path / f"r_{d.name}", model_dir=d, device="cpu", max_slots=1)
        assert not (tmp_path / f"r_{d.name}").exists()
