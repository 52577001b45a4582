# SPDX-License-Identifier: Apache-2.0
"""Bad input a new user met (issue 39, section 3) and the command-line items of section 5: every one is answered
before anything is written, by a message that names the argument (no traceback), and the commands say what to do
next. scripts/make_triton_repo.py (--repo naming a file; --engine-dir with --backend python and the python-only
flags with tensorrt_plan; a truncated or incomplete --model; --device cuda without CUDA; the install hint),
the model_type message, scripts/fetch_peers.py (pip download, no index URL of its own) and scripts/build_engine.py
(the summary it ends with; --dtype spelled as make_triton_repo's).
"""

import hashlib
import importlib.util
import io
import json
import pathlib
import re
import subprocess
import tarfile

import pytest
import torch

pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] is not installed")

from builders import triton_generate as tg  # noqa: E402  (make_triton_repo.py --backend python's writer)
from builders import triton_repo as tr  # noqa: E402  (the writer behind make_triton_repo.py)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mtr = _script("make_triton_repo")


def _listing(d: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _fake_engine_dir(d: pathlib.Path) -> pathlib.Path:
    """An engine directory whose config.json gets as far as the repository target (the checks on --repo and on
    the flags come before the engine description is read in full)."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"format": "trtllm-replayssm-decode-step/1"}))
    return d


def _nemotron_checkpoint(d: pathlib.Path) -> pathlib.Path:
    """The tiny Nemotron-H as an HF directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from builders.nemotron_h import load_nemotron_h

    model = load_nemotron_h(seed=0)
    d.mkdir()
    model.config.to_json_file(str(d / "config.json"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    return d


# ---- make_triton_repo.py ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["repo", "parent"])
def test_repo_naming_a_file_is_refused_by_name(tmp_path, capsys, where):
    """--repo naming an existing file (or a path under one) was a FileExistsError / NotADirectoryError traceback;
    now both routes answer naming --repo, exit 2, and write nothing (no backends directory either)."""
    afile = tmp_path / "repo.txt"
    afile.write_text("not a directory")
    repo = afile if where == "repo" else afile / "sub"
    eng = _fake_engine_dir(tmp_path / "engine")
    before = _listing(tmp_path)
    for argv in (["--backend", "python", "--device", "cpu", "--repo", str(repo)],
                 ["--engine-dir", str(eng), "--repo", str(repo)]):
        assert mtr.main(argv) == 2
        err = capsys.readouterr().err
        assert "--repo: expected a directory" in err and "which is not a directory" in err and str(afile) in err, err
        assert "Traceback" not in err
    with pytest.raises(tr.RepoError, match="--repo: expected a directory"):
        tg.make_generate_repo(repo, device="cpu")
    assert _listing(tmp_path) == before and afile.read_text() == "not a directory"


def test_engine_dir_and_backend_flags_are_refused_across_routes(tmp_path, capsys):
    """--backend python took --engine-dir and ignored it; tensorrt_plan took the python-only flags (--model,
    --dtype, --max-slots, ...) and ignored them: each is refused by name. --tiny / --seed with --model too."""
    eng = _fake_engine_dir(tmp_path / "engine")
    repo = tmp_path / "repo"
    assert mtr.main(["--backend", "python", "--device", "cpu", "--engine-dir", str(eng), "--repo", str(repo)]) == 2
    assert "--engine-dir: only with --backend tensorrt_plan" in capsys.readouterr().err
    assert mtr.main(["--engine-dir", str(eng), "--repo", str(repo), "--dtype", "bf16", "--max-slots", "4"]) == 2
    assert "--dtype, --max-slots: only with --backend python" in capsys.readouterr().err
    assert mtr.main(["--engine-dir", str(eng), "--repo", str(repo), "--model", str(tmp_path)]) == 2
    assert "--model: only with --backend python" in capsys.readouterr().err
    assert mtr.main(["--backend", "python", "--device", "cpu", "--repo", str(repo), "--model", str(tmp_path),
                     "--tiny", "nemotron3"]) == 2
    assert "--tiny: the embedded tiny model's, used only without --model" in capsys.readouterr().err
    assert not repo.exists()


def test_truncated_or_incomplete_checkpoint_is_refused_at_write_time(tmp_path, capsys):
    """A truncated safetensors file (and a Qwen checkpoint missing a tensor) was written into the repository and
    failed only when the server loaded it; now the writer loads it with the server's own loader (the checkers of
    builders/nemotron_h.py and builders/qwen3_next.py) and refuses it naming --model. A good one is written."""
    from safetensors.torch import load_file, save_file

    from builders.qwen3_next import tiny_model

    good = _nemotron_checkpoint(tmp_path / "good")
    repo = tmp_path / "repo"
    assert mtr.main(["--backend", "python", "--device", "cpu", "--repo", str(repo), "--model", str(good)]) == 0
    assert (repo / "nemotron_h_replayssm" / "1" / "model.py").is_file()

    cut = _nemotron_checkpoint(tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])  # a download cut short
    argv = ["--backend", "python", "--device", "cpu", "--repo", str(tmp_path / "r2"), "--model", str(cut)]
    assert mtr.main(argv) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "model.safetensors: cannot read safetensors" in err and "Traceback" not in err, err

    qwen = tmp_path / "qwen"
    tiny_model("qwen3_5").save_pretrained(qwen)
    key = "model.layers.1.linear_attn.in_proj_qkv.weight"
    for f in qwen.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(f).items() if k != key}, f, metadata={"format": "pt"})
    with pytest.raises(tr.RepoError, match=rf"--model: .*missing.*{re.escape(key)}"):
        tg.make_generate_repo(tmp_path / "r3", model_dir=qwen, device="cpu")
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


def test_device_cuda_without_cuda_is_refused(tmp_path, capsys, monkeypatch):
    """--device cuda on a machine where torch sees no GPU wrote a KIND_GPU model that the server failed to load."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(tr.RepoError, match=r"--device cuda: torch sees no CUDA device on this machine"):
        tg.make_generate_repo(tmp_path / "repo", device="cuda")
    assert mtr.main(["--backend", "python", "--device", "cuda", "--repo", str(tmp_path / "repo")]) == 2
    assert "--device cuda" in capsys.readouterr().err and not (tmp_path / "repo").exists()
    with pytest.raises(tr.RepoError, match=r"--device: expected auto, cpu or cuda, got 'gpu'"):
        tg.make_generate_repo(tmp_path / "repo", device="gpu")


def test_pytriton_install_hint_has_no_deps(tmp_path, capsys, monkeypatch):
    """The hint printed where nvidia-pytriton is missing had no --no-deps, so following it would downgrade numpy to
    1.26 with ~20 packages: it carries --no-deps, here and in every Python file that prints one."""
    real = importlib.util.find_spec
    monkeypatch.setattr(tr.importlib.util, "find_spec", lambda name, *a: None if name == "pytriton" else real(name, *a))
    with pytest.raises(tr.RepoError) as e:
        tr.pytriton_server()
    assert "pip install --no-deps 'nvidia-pytriton==0.7.0'" in str(e.value)
    assert mtr.main(["--backend", "python", "--device", "cpu", "--repo", str(tmp_path / "repo")]) == 0
    assert "pip install --no-deps 'nvidia-pytriton==0.7.0'" in capsys.readouterr().out
    for d in ("builders", "scripts", "trtllm_replayssm", "serve", "tests"):
        for f in (ROOT / d).rglob("*.py"):
            for line in f.read_text().splitlines() if f != pathlib.Path(__file__).resolve() else ():
                if re.search(r"pip install\b.*nvidia-pytriton", line):
                    assert "--no-deps" in line, (f, line)


def test_unsupported_model_type_lists_every_accepted_one(tmp_path):
    """The loaders said "expected 'nemotron_h'" though Qwen3-Next / Qwen3.5 checkpoints load too: the messages name
    the one list of accepted model_types (builders/qwen3_next.py ACCEPTED_MODEL_TYPES)."""
    from builders.nemotron_h import CheckpointError, load_nemotron_h
    from builders.qwen3_next import ACCEPTED_MODEL_TYPES

    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32}))
    with pytest.raises(tr.RepoError, match="--model: .*model_type: expected one of") as e:
        tg.make_generate_repo(tmp_path / "repo", model_dir=ckpt, device="cpu")
    with pytest.raises(CheckpointError, match="model_type: expected one of") as e2:
        load_nemotron_h(ckpt)
    for err in (e, e2):
        assert all(repr(t) in str(err.value) for t in ACCEPTED_MODEL_TYPES), str(err.value)
        assert "got 'llama'" in str(err.value)


# ---- fetch_peers.py -----------------------------------------------------------------------------------------------
def test_fetch_peers_has_no_index_url_of_its_own():
    """It asked the package index's JSON API (a hard-coded host) for the sdist's URL and downloaded it with urllib,
    past the user's pip configuration (index, mirrors, proxies): every file now comes through pip download."""
    src = (ROOT / "scripts" / "fetch_peers.py").read_text()
    assert "://" not in src and "pypi." not in src.lower() and "urllib" not in src


def test_fetch_peers_downloads_the_pinned_sdist_with_pip(tmp_path, monkeypatch):
    """fetch_mamba runs ``python -m pip download --no-deps`` with the pinned sha256 given to pip (--require-hashes),
    mamba_ssm's own switch against a CUDA build, and extracts the two Triton files; a file of another sha256 and a
    failed pip are errors naming them."""
    peers = _script("fetch_peers")
    top = f"mamba_ssm-{peers.MAMBA_VERSION}/"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in (*peers.MAMBA_FILES, "LICENSE"):
            blob = f"# {rel}\n".encode()
            info = tarfile.TarInfo(top + rel)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    sdist = buf.getvalue()
    calls = []

    def fake_run(cmd, env=None, **kw):
        calls.append((cmd, env))
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        (dest / f"mamba_ssm-{peers.MAMBA_VERSION}.tar.gz").write_bytes(sdist)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    monkeypatch.setattr(peers, "MAMBA_SHA256", hashlib.sha256(sdist).hexdigest())
    out = tmp_path / "peer"
    out.mkdir()
    peers.fetch_mamba(out)
    (cmd, env), = calls
    assert cmd[1:5] == ["-m", "pip", "download", "-q"] and "--no-deps" in cmd and "--require-hashes" in cmd
    assert env["MAMBA_SKIP_CUDA_BUILD"] == "TRUE"
    for rel in peers.MAMBA_FILES:
        assert (out / rel).read_text() == f"# {rel}\n"
    assert json.loads((out / "PEER.json").read_text())["sdist"] == f"mamba_ssm-{peers.MAMBA_VERSION}.tar.gz"

    monkeypatch.setattr(peers, "MAMBA_SHA256", "0" * 64)  # pip's hash check stands in a fake: ours must still catch it
    with pytest.raises(RuntimeError, match=r"mamba_ssm-.*\.tar\.gz: sha256 .*, expected 0{64}"):
        peers.fetch_mamba(tmp_path)
    monkeypatch.setattr(peers.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(RuntimeError, match=rf"pip download mamba-ssm=={re.escape(peers.MAMBA_VERSION)} failed"):
        peers.fetch_mamba(tmp_path)


# ---- build_engine.py ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """scripts/build_engine.py's main for the tiny Nemotron-H, its stdout captured: (out, stdout)."""
    import contextlib

    bld = _script("build_engine")
    out = tmp_path_factory.mktemp("build") / "tiny"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bld.main(["--out", str(out), "--max-seq-len", "64"]) == 0
    return out, buf.getvalue()


def test_build_engine_ends_with_what_it_wrote_and_the_next_step(built, tmp_path):
    """It ended on the ~1,600-character trtexec line; now it ends by listing every file it wrote with its size,
    naming trtexec.sh where no plan was built, and the next step (make_triton_repo.py for this directory, which
    runs as printed, and the test command)."""
    out, stdout = built
    tail = stdout[stdout.rindex(f"[build_engine] wrote {out}"):].splitlines()
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert tail[0] == f"[build_engine] wrote {out} ({len(files)} files):"
    listed = {line.split()[-1] for line in tail[1:1 + len(files)]}
    assert listed == {str(p.relative_to(out)) for p in files}
    assert all(re.search(r"\d(\.\d)? (B|KiB|MiB|GiB)\s", line) for line in tail[1:1 + len(files)])
    rest = "\n".join(tail[1 + len(files):])
    if not (out / "model.plan").is_file():
        assert "model.plan not built here" in rest and str(out / "trtexec.sh") in rest
    nxt = f"[build_engine] next: python scripts/make_triton_repo.py --engine-dir {out} --repo {out}-triton"
    assert nxt in tail
    assert any(line.startswith("[build_engine] tests: python -m pytest -q tests/test_builder.py") for line in tail)
    assert all(len(line) < 300 for line in tail)
    argv = nxt.split("make_triton_repo.py ")[1].split()
    argv[-1] = str(tmp_path / "triton")
    assert mtr.main(argv) == 0


def test_build_engine_summary_of_a_speculative_pair(tmp_path):
    """A speculative pair has no make_triton_repo step (one Triton sequence model runs one engine per request):
    the summary says so and names its tests."""
    bld = _script("build_engine")
    out = tmp_path / "spec"
    out.mkdir()
    # a Qwen3.5 engine's config.json names its model_type, which the summary's test hint follows (builders/models.py)
    (out / "config.json").write_text(json.dumps({"format": "trtllm-replayssm-spec-step/1",
                                                 "model": {"pattern": "GGG*", "model_type": "qwen3_5"}}))
    (out / "verify.onnx").write_bytes(b"x" * 2048)
    text = bld.summary(out)
    assert "verify.plan and commit.plan not built here" in text and "make_triton_repo.py serves standard" in text
    assert "2.0 KiB  verify.onnx" in text and "tests/test_gdn_spec_builder.py" in text


def test_dtype_is_spelled_the_same_in_both_scripts(tmp_path):
    """build_engine took fp32 / bf16 / fp16, make_triton_repo float32 / bfloat16 / float16: both take the first
    (the engine-directory format's) and accept the other, with the same meaning, so no earlier command breaks."""
    from builders.engine import DTYPES as ENGINE_DTYPES

    bld = _script("build_engine")
    assert set(ENGINE_DTYPES) == set(tr.DTYPES)
    for spelling, want in (("bf16", "bf16"), ("bfloat16", "bf16"), ("float32", "fp32"), ("fp16", "fp16")):
        a = bld.parse_args(["--out", str(tmp_path / "e"), "--dtype", spelling, "--state-dtype", spelling])
        assert a.dtype == a.state_dtype == want
    params = {}
    for spelling in ("bf16", "bfloat16"):
        repo = tmp_path / spelling
        assert mtr.main(["--backend", "python", "--device", "cpu", "--repo", str(repo), "--dtype", spelling]) == 0
        text = (repo / "nemotron_h_replayssm" / "config.pbtxt").read_text()
        params[spelling] = re.search(r'key: "dtype"\s+value \{\s+string_value: "(\w+)"', text).group(1)
    assert params == {"bf16": "bfloat16", "bfloat16": "bfloat16"}  # what the server's model reads (torch's names)
    with pytest.raises(SystemExit):
        mtr.main(["--backend", "python", "--repo", str(tmp_path / "x"), "--dtype", "int8"])
