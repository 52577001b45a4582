# SPDX-License-Identifier: Apache-2.0
"""The Triton model repository: built through Triton's ModelConfig protobuf and checked against
the engine description that scripts/build_engine.py writes (every state paired, nothing missing),
for the embedded tiny configs: Nemotron-H (``M*-M-M*-``), Nemotron 3 (``MEM*EM*E``: its MoE layers
carry no state, so the repository holds the states of the Mamba and attention layers only) and
Qwen3-Next (``GGG*``: seven states per Gated DeltaNet layer); and the command line's --backend python, which writes
the streaming model of builders/triton_generate.py for every family (tests/test_triton_generate.py serves it).
"""

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] is not installed")

from builders import triton_repo as tr  # noqa: E402  (the writer)
from builders.engine_format import LAYER_STATES  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("make_triton_repo", ROOT / "scripts" / "make_triton_repo.py")
mtr = importlib.util.module_from_spec(spec)  # its command line
spec.loader.exec_module(mtr)


def _tg():
    """builders/triton_generate.py (the --backend python writer; it imports torch, which the tensorrt_plan route
    does not need)."""
    from builders import triton_generate

    return triton_generate


@pytest.fixture(scope="module", params=("nemotron_h", "nemotron3", "qwen3_next"))
def engine_dir(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("engine") / request.param
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_engine.py"), "--out", str(out), "--max-batch", "4",
                    "--tiny", request.param], check=True, capture_output=True)
    return out


def test_repo_config_round_trips_and_pairs_every_state(engine_dir, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    target = tr.make_repo(engine_dir, tmp_path / "repo", "nh")
    cfg = json.loads((engine_dir / "config.json").read_text())
    mc = pb.ModelConfig()
    text_format.Parse((target / "config.pbtxt").read_text(), mc)
    assert mc.platform == "tensorrt_plan" and mc.max_batch_size == 4
    assert [i.name for i in mc.input] == ["input_ids"] and list(mc.input[0].dims) == [1]
    assert [o.name for o in mc.output] == ["logits"]
    states = {s.input_name: s for s in mc.sequence_batching.state}
    assert set(states) == {s["name"] for s in cfg["states"]}
    for s in cfg["states"]:
        st = states[s["name"]]
        assert st.output_name == s["output"] and list(st.dims) == s["shape"][1:]
        assert st.use_same_buffer_for_input_output and st.initial_state[0].zero_data
    for name in ("cursor", "lengths"):
        assert states[name].data_type == pb.TYPE_INT32
    pattern = cfg["model"]["pattern"]
    per_layer = {"M": 5, "*": 2, "E": 0, "-": 0, "G": 7}
    assert len(states) == 2 + sum(per_layer[c] for c in pattern)
    for i, c in enumerate(pattern):
        mine = {n for n in states if n.endswith(f"_{i}")}
        assert len(mine) == per_layer[c], (i, c, mine)
        if c == "M":
            assert list(states[f"ssm_state_{i}"].dims) == [4, 64, 64] and states[f"ssm_state_{i}"].data_type == pb.TYPE_FP32
        if c == "G":  # the tiny Qwen3-Next: 4 value heads of 64 x 64, 2 key heads, L = 16
            assert list(states[f"gdn_state_{i}"].dims) == [4, 64, 64] and list(states[f"gdn_k_{i}"].dims) == [2, 16, 64]
    assert (target / "1" / "MISSING_PLAN.txt").is_file()  # no TensorRT here


def test_repo_takes_a_built_plan(engine_dir, tmp_path):
    """Where the engine directory holds model.plan, the repository gets a copy of it (same bytes) as 1/model.plan
    and no MISSING_PLAN.txt; the engine directory is left as it was."""
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "config.json").write_text((engine_dir / "config.json").read_text())
    blob = bytes(range(256)) * 64  # stands in for a serialized engine: the writer copies bytes, it does not parse
    (eng / "model.plan").write_bytes(blob)
    target = tr.make_repo(eng, tmp_path / "repo", "nh")
    assert (target / "1" / "model.plan").read_bytes() == blob and not (target / "1" / "MISSING_PLAN.txt").exists()
    assert (eng / "model.plan").read_bytes() == blob
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["nh"]  # no staging directory left behind


def test_model_directory_has_the_umask_mode(engine_dir, tmp_path):
    """The model directory is staged in a temporary sibling and renamed: it must not keep mkdtemp's 0700, which
    would hide it from a tritonserver running under another uid (containers); both writers."""
    import os

    old = os.umask(0o022)
    try:
        target = tr.make_repo(engine_dir, tmp_path / "repo", "nh")
        python = _tg().make_generate_repo(tmp_path / "py", "nh_py", tiny="nemotron_h", device="cpu")
    finally:
        os.umask(old)
    assert (target.stat().st_mode & 0o777) == 0o755 and (python.stat().st_mode & 0o777) == 0o755


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c["states"][0].update(output="nope"), "is not an engine output"),
    (lambda c: c["states"][1].update(dtype="float16"), r"state 'cursor': dtype: expected 'int32'.*got 'float16'"),
    (lambda c: next(o for o in c["outputs"] if o["name"] == c["states"][1]["output"]).update(dtype="float16"),
     r"state 'cursor': output 'cursor_out' has float16 \[-1\], expected int32"),
    (lambda c: c["inputs"].append({"name": "extra", "shape": [-1], "dtype": "int32"}), "neither a request input"),
    (lambda c: c["outputs"][0].update(dtype="complex64"), "has no Triton type"),
    (lambda c: c.pop("states"), "missing 'states'"),
    (lambda c: c.update(format="trtllm-replayssm-spec-step/1"), "speculative engine pair"),
    (lambda c: c.update(format="trtllm-replayssm-decode-step/2"),
     r"format: expected 'trtllm-replayssm-decode-step/1' \(this writer's engine-directory format\), got 'trtllm-rep"),
    (lambda c: c.pop("format"), "format: expected 'trtllm-replayssm-decode-step/1'.*got None"),
    (lambda c: c["states"].pop(), r"layer \d \(attention, pattern '.*'\): states \['v_cache_\d'\] missing"),
    (lambda c: c["states"].append(dict(c["states"][-1], name="k_cache_4", output="k_cache_4_out")),  # E / -
     r"state 'k_cache_4': layer 4 is a (MoE|MLP) layer \('[E-]' in pattern '.*'\), which has no states"),
    (lambda c: c["states"].append(dict(c["states"][-1])), r"states: \['v_cache_\d'\] listed twice"),
    (lambda c: c["model"].update(pattern="M?"),  # the message names every letter of the format (LAYER_STATES)
     rf"model.pattern 'M\?': expected only {re.escape(''.join(LAYER_STATES))}, got '\?' at layer 1"),
    (lambda c: c["states"].append(dict(c["states"][-1], name="conv_state_99")), "'conv_state_99': expected"),
])
def test_bad_engine_description_is_rejected(engine_dir, mutate, match):
    if "k_cache_4" in match and engine_dir.name == "qwen3_next":
        pytest.skip("the tiny Qwen3-Next (GGG*) has no stateless layer 4")
    cfg = json.loads((engine_dir / "config.json").read_text())
    mutate(cfg)
    with pytest.raises(tr.RepoError, match=match):
        tr.model_config(cfg, "nh")


def test_cli_refuses_to_overwrite_and_reports(engine_dir, tmp_path):
    args = ["--engine-dir", str(engine_dir), "--repo", str(tmp_path / "r")]
    assert mtr.main(args) == 0
    assert mtr.main(args) == 2  # exists: refused, nothing half-written
    family = "qwen3_next" if engine_dir.name == "qwen3_next" else "nemotron_h"  # the engine's model_type
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [f"{family}_replayssm"]
    assert mtr.main(["--engine-dir", str(tmp_path / "none"), "--repo", str(tmp_path / "r2")]) == 2


def test_sequence_batching_flags_reach_the_tensorrt_plan_config(engine_dir, tmp_path, capsys):
    """--idle-ms and --max-queue-delay-us were taken with --backend tensorrt_plan and ignored (the config kept 60 s
    and 100 us): they set its sequence batcher, range-checked by name as for --backend python; the printed serve
    command bounds a shutdown's wait for open sequences (--exit-timeout-secs)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    argv = ["--engine-dir", str(engine_dir), "--repo", str(tmp_path / "r"), "--name", "m"]
    assert mtr.main(argv + ["--idle-ms", "5000", "--max-queue-delay-us", "250"]) == 0
    assert f"--exit-timeout-secs={tr.EXIT_TIMEOUT_S}" in capsys.readouterr().out
    mc = text_format.Parse((tmp_path / "r" / "m" / "config.pbtxt").read_text(), pb.ModelConfig())
    sb = mc.sequence_batching
    assert sb.max_sequence_idle_microseconds == 5_000_000 and sb.oldest.max_queue_delay_microseconds == 250
    assert mtr.main(["--engine-dir", str(engine_dir), "--repo", str(tmp_path / "r2"), "--idle-ms", "0"]) == 2
    assert "--idle-ms: expected 1.." in capsys.readouterr().err and not (tmp_path / "r2").exists()


def test_python_repo_of_a_published_qwen3_5_directory(tmp_path):
    """The published Qwen3.5 directories carry the vision-language wrapper's config.json (model_type qwen3_5, the
    text model's vocab_size under text_config): the Python-backend repository reads its vocabulary from there (it was
    a KeyError: 'vocab_size'), loads the checkpoint as the server will and builds the engine's decode step over it."""
    from google.protobuf import text_format
    from transformers import Qwen3_5Config, Qwen3_5TextConfig
    from tritonclient.grpc import model_config_pb2 as pb

    from builders.qwen3_next import TINY_QWEN3_5, tiny_model

    ckpt = tmp_path / "ckpt"
    tiny_model("qwen3_5", vocab_size=300).save_pretrained(ckpt)  # the weights: the writer loads the checkpoint
    Qwen3_5Config(text_config=Qwen3_5TextConfig(**dict(TINY_QWEN3_5, vocab_size=300)).to_dict()).save_pretrained(ckpt)
    assert "vocab_size" not in json.loads((ckpt / "config.json").read_text())
    assert tr._vocab("qwen3_5", ckpt) == 300
    target = _tg().make_generate_repo(tmp_path / "repo", model_dir=ckpt, device="cpu", mode="replay_bf16")
    mc = text_format.Parse((target / "config.pbtxt").read_text(), pb.ModelConfig())
    assert target.name == "qwen3_5_replayssm" and mc.model_transaction_policy.decoupled
    assert mc.parameters["model_dir"].string_value == str(ckpt.resolve())


def test_bad_inputs_are_refused_by_name_before_anything_is_written(tmp_path, capsys):
    """An unreadable config.json (engine directory or checkpoint), a --name that is not one directory name, a
    negative --max-queue-delay-us (and the sequence batcher's flags with --backend python, which has none): RepoError
    naming the file or flag (they were a JSONDecodeError, AttributeError, FileNotFoundError from mkdtemp, or
    protobuf's ValueError), the CLI's exit 2, and no file written."""
    eng, ckpt, repo = tmp_path / "engine", tmp_path / "ckpt", tmp_path / "repo"
    eng.mkdir()
    ckpt.mkdir()
    (eng / "config.json").write_text('{"format": "trtllm-replayssm-decode-step/1", "sta')  # cut short
    with pytest.raises(tr.RepoError, match=r"engine/config.json: not valid JSON"):
        tr.make_repo(eng, repo)
    (eng / "config.json").write_text("[1, 2]")
    with pytest.raises(tr.RepoError, match=r"engine/config.json: expected a JSON object, got list"):
        tr.make_repo(eng, repo)
    assert mtr.main(["--engine-dir", str(eng), "--repo", str(repo)]) == 2
    (ckpt / "config.json").write_text("{")
    tg = _tg()
    with pytest.raises(tr.RepoError, match=r"ckpt/config.json: not valid JSON"):
        tg.make_generate_repo(repo, model_dir=ckpt, device="cpu")
    for name in ("a/b", "../escape"):
        with pytest.raises(tr.RepoError, match=f"--name: expected one directory name, got '{name}'"):
            tg.make_generate_repo(repo, name, device="cpu")
        assert mtr.main(["--backend", "python", "--device", "cpu", "--repo", str(repo), "--name", name]) == 2
    assert mtr.main(["--engine-dir", str(eng), "--repo", str(repo), "--max-queue-delay-us", "-5"]) == 2
    assert "--max-queue-delay-us: expected 0.." in capsys.readouterr().err
    assert mtr.main(["--backend", "python", "--device", "cpu", "--repo", str(repo), "--max-queue-delay-us", "5"]) == 2
    assert "--max-queue-delay-us: only with --backend tensorrt_plan" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "engine"]


def test_cli_python_backend_writes_the_streaming_model_of_every_family(tmp_path, capsys):
    """--backend python writes the streaming (decoupled) model for Nemotron-H, Nemotron 3 and the Qwen families, --mode
    or --shadow as its mode (the two must agree); a Gated DeltaNet model has no fp8 shadow (refused by name)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    def config(repo, name):
        return text_format.Parse((repo / name / "config.pbtxt").read_text(), pb.ModelConfig())

    base = ["--backend", "python", "--device", "cpu"]
    for flags, name, mode in ((["--shadow", "bf16"], "nemotron_h", "replay_bf16"),
                              (["--mode", "conventional"], "nemotron_h", "conventional"),
                              (["--tiny", "nemotron3", "--mode", "replay_fp8", "--shadow", "fp8"], "nemotron3", "replay_fp8"),
                              ([], "nemotron_h", "replay"),
                              (["--tiny", "qwen3_next", "--mode", "replay_bf16"], "qwen3_next", "replay_bf16"),
                              (["--tiny", "qwen3_5", "--mode", "conventional"], "qwen3_5", "conventional"),
                              (["--tiny", "qwen3_5_moe"], "qwen3_5_moe", "replay")):
        repo = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        assert mtr.main(base + ["--repo", str(repo), *flags]) == 0
        mc = config(repo, f"{name}_replayssm")
        assert mc.model_transaction_policy.decoupled and mc.parameters["mode"].string_value == mode, flags
        assert "GenerateModel" in (repo / f"{name}_replayssm" / "1" / "model.py").read_text()
    capsys.readouterr()
    assert mtr.main(base + ["--repo", str(tmp_path / "bad"), "--mode", "replay", "--shadow", "bf16"]) == 2
    assert "--mode replay and --shadow bf16 disagree" in capsys.readouterr().err
    assert mtr.main(base + ["--repo", str(tmp_path / "q"), "--tiny", "qwen3_5", "--shadow", "fp8"]) == 2
    assert "there is no fp8 GDN shadow" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "q").exists()


@pytest.mark.parametrize("tiny", ["qwen3_5_moe", "nemotron3"])
def test_default_name_follows_the_model(tmp_path, tiny):
    """The repository's model is named after the model it serves (was nemotron_h_replayssm for every model);
    --name still sets it."""
    assert mtr.main(["--backend", "python", "--repo", str(tmp_path / "r"), "--device", "cpu", "--tiny", tiny]) == 0
    assert (tmp_path / "r" / f"{tiny}_replayssm" / "1" / "model.py").is_file()
    assert mtr.main(["--backend", "python", "--repo", str(tmp_path / "r"), "--device", "cpu", "--tiny", tiny,
                     "--name", "m"]) == 0
    assert (tmp_path / "r" / "m" / "config.pbtxt").is_file()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "qwen3_5_moe", "vocab_size": 64}')
    assert tr.default_name(model_dir=ckpt) == "qwen3_5_moe_replayssm"
    assert tr.default_name(engine_cfg={"model": {"source": "x"}}) == "nemotron_h_replayssm"


def test_cli_streaming_flags_only_with_backend_python(tmp_path, capsys):
    eng = tmp_path / "engine"
    eng.mkdir()
    assert mtr.main(["--engine-dir", str(eng), "--repo", str(tmp_path / "r"), "--mode", "replay"]) == 2
    assert "--mode: only with --backend python" in capsys.readouterr().err
