#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Triton Inference Server model repository for a ReplaySSM decode-step engine.

Reads the ``config.json`` that ``scripts/build_engine.py`` writes next to ``model.onnx`` /
``model.plan`` and writes ``REPO/NAME/config.pbtxt`` (+ ``REPO/NAME/1/model.plan`` when the plan
exists). The config is built as Triton's own ``ModelConfig`` protobuf (``tritonclient``'s
``model_config_pb2``), printed in text format and parsed back, never templated as a string.

Route: ``platform: "tensorrt_plan"`` with ``sequence_batching`` and **implicit state**: every
state tensor of the engine (per-layer checkpoint, x/B/dt buffers, conv state, attention K/V, the
shared cursor and the sequence length) is a ``state`` entry pairing the engine input with its
``*_out`` output, zero-initialised at sequence start, in place
(``use_same_buffer_for_input_output``, matching the plugin's aliased outputs). With zero state a
sequence starts empty, so a client streams the prompt token by token, then decodes; each request
carries one token (``input_ids``, shape [1]) and returns ``logits``.

Layers (``model.pattern`` in config.json, Nemotron-H / Nemotron 3 letters): every Mamba-2 layer
``M`` i has the five states conv_state_i, ssm_state_i, x_cache_i, B_cache_i, dt_cache_i, every
attention layer ``*`` i has k_cache_i and v_cache_i, MoE ``E`` and MLP ``-`` layers have none
(their weights are in the plan), every Gated DeltaNet layer ``G`` i (Qwen3-Next / Qwen3.5 engines,
builders/gdn_step.py) has conv_state_i, gdn_state_i, gdn_u_i, gdn_v_i, gdn_k_i, gdn_g_i, gdn_beta_i;
anything else is refused before a file is written, naming the layer and the state.

Usage: python scripts/make_triton_repo.py --engine-dir build/tiny --repo build/triton [--name NAME]

``--backend python`` (no engine): a Python-backend model instead (``backend: "python"``,
``1/model.py``), whose instance owns a ``ReplayStateCache`` and the K/V rows of
``max_candidate_sequences`` slots on its device and runs the decode step there
(``trtllm_replayssm/triton_model.py``: kernels on CUDA, the float64 reference on the CPU). No
implicit state: sequence_batching ``oldest`` with the controls START, END, READY and CORRID maps
each sequence to a slot; a request carries one token (``input_ids`` [1], int64) and returns
``logits`` [vocab] (fp32) and ``slot`` [1] (int32). Everything the model needs is a ``parameters``
entry of config.pbtxt: the checkpoint (``model_dir``, or ``tiny`` + ``seed``), dtype, device,
buffer_len, max_seq_len, and ``python_path`` / ``python_version``: the Python backend stub embeds
libpython with an isolated configuration that ignores PYTHONPATH, so model.py puts this
interpreter's project root and site-packages on ``sys.path`` itself and refuses another Python
version. :func:`pytriton_server` finds the tritonserver that the nvidia-pytriton wheel bundles and
:func:`serve_command` gives the command that serves the repository with it.

The model is Nemotron-H / Nemotron 3 (``--tiny nemotron_h|nemotron3``) or Qwen3-Next / Qwen3.5
(``--tiny qwen3_next|qwen3_5``, or a ``--model`` whose config.json says qwen3_next / qwen3_5_text; its
Gated DeltaNet layers on the cache's GDN rings, ``triton_model.QwenSlotStep``).

Usage: python scripts/make_triton_repo.py --backend python --repo build/triton-py [--tiny nemotron_h | --model DIR]
       [--device auto|cpu|cuda] [--max-slots 8] [--max-seq-len 1024] [--buffer-len 16] [--idle-ms 60000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import site
import sys
import sysconfig
import tempfile

TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int32": "TYPE_INT32",
                "int64": "TYPE_INT64"}
REQUEST_INPUTS = ("input_ids",)  # what a client sends each step; every other input is implicit state
SHARED_STATES = ("lengths", "cursor")
LAYER_STATES = {"M": ("conv_state", "ssm_state", "x_cache", "B_cache", "dt_cache"), "*": ("k_cache", "v_cache"),
                "E": (), "-": (),
                "G": ("conv_state", "gdn_state", "gdn_u", "gdn_v", "gdn_k", "gdn_g", "gdn_beta")}  # per layer letter
LAYER_NAMES = {"M": "Mamba-2", "*": "attention", "E": "MoE", "-": "MLP", "G": "Gated DeltaNet"}


class RepoError(ValueError):
    """The engine directory's config.json does not describe a decode-step engine we can serve."""


def _pb():
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise RepoError("tritonclient is needed for the model config protobuf: pip install 'tritonclient[grpc]'") from e
    return model_config_pb2


def _dims(entry: dict) -> list[int]:
    shape = entry["shape"]
    if not shape or shape[0] != -1:
        raise RepoError(f"{entry['name']}: expected a leading batch dimension -1, got shape {shape}")
    if any(d <= 0 for d in shape[1:]):
        raise RepoError(f"{entry['name']}: expected static non-batch dimensions, got shape {shape}")
    return list(shape[1:])


def _dtype(entry: dict) -> str:
    try:
        return TRITON_TYPES[entry["dtype"]]
    except KeyError:
        raise RepoError(f"{entry['name']}: dtype {entry['dtype']!r} has no Triton type "
                        f"(known: {sorted(TRITON_TYPES)})") from None


def check_layer_states(cfg: dict) -> None:
    """The states are exactly the shared ones plus those of each layer of ``model.pattern``."""
    pattern = cfg.get("model", {}).get("pattern")
    if not isinstance(pattern, str):
        raise RepoError(f"config.json: model.pattern: expected the layer pattern string (e.g. 'MEM*EM*E'), "
                        f"got {pattern!r}")
    bad = [(i, c) for i, c in enumerate(pattern) if c not in LAYER_STATES]
    if bad:
        raise RepoError(f"config.json: model.pattern {pattern!r}: expected only {''.join(LAYER_STATES)}, got "
                        f"{bad[0][1]!r} at layer {bad[0][0]}")
    names = [s["name"] for s in cfg["states"]]
    have = set(names)
    for i, c in enumerate(pattern):
        missing = [f"{k}_{i}" for k in LAYER_STATES[c] if f"{k}_{i}" not in have]
        if missing:
            raise RepoError(f"layer {i} ({LAYER_NAMES[c]}, pattern {pattern!r}): states {missing} missing")
    want = set(SHARED_STATES) | {f"{k}_{i}" for i, c in enumerate(pattern) for k in LAYER_STATES[c]}
    for n in names:
        if n not in want:
            idx = n.rpartition("_")[2]
            if idx.isdigit() and int(idx) < len(pattern):
                c = pattern[int(idx)]
                raise RepoError(f"state {n!r}: layer {idx} is a {LAYER_NAMES[c]} layer ({c!r} in pattern {pattern!r}), "
                                f"which has {'no states' if not LAYER_STATES[c] else list(LAYER_STATES[c])}")
            raise RepoError(f"state {n!r}: expected {list(SHARED_STATES)} or a per-layer state of pattern {pattern!r}")
    if len(names) != len(have):
        raise RepoError(f"config.json: states: {sorted(n for n in have if names.count(n) > 1)} listed twice")


def model_config(cfg: dict, name: str, max_queue_delay_us: int = 100, idle_us: int = 60_000_000):
    """Triton ``ModelConfig`` for the decode-step engine described by build_engine's ``cfg``."""
    pb = _pb()
    if str(cfg.get("format", "")).startswith("trtllm-replayssm-spec-step"):
        raise RepoError("config.json describes a speculative engine pair (verify.plan + commit.plan, sampling in "
                        "between; scripts/build_engine.py --num-draft): one Triton sequence model cannot run it")
    for key in ("max_batch", "inputs", "outputs", "states"):
        if key not in cfg:
            raise RepoError(f"config.json: missing {key!r} (was it written by scripts/build_engine.py?)")
    check_layer_states(cfg)
    mc = pb.ModelConfig(name=name, platform="tensorrt_plan", max_batch_size=int(cfg["max_batch"]),
                        default_model_filename="model.plan")
    states = {s["name"]: s for s in cfg["states"]}
    outputs = {o["name"]: o for o in cfg["outputs"]}
    for entry in cfg["inputs"]:
        if entry["name"] in states:
            continue
        if entry["name"] not in REQUEST_INPUTS:
            raise RepoError(f"input {entry['name']!r} is neither a request input {REQUEST_INPUTS} nor a state")
        mc.input.add(name=entry["name"], data_type=_dtype(entry), dims=_dims(entry))
    state_outputs = {s["output"] for s in states.values()}
    for entry in cfg["outputs"]:
        if entry["name"] not in state_outputs:
            mc.output.add(name=entry["name"], data_type=_dtype(entry), dims=_dims(entry))
    sb = mc.sequence_batching
    sb.max_sequence_idle_microseconds = idle_us
    sb.oldest.max_candidate_sequences = int(cfg["max_batch"])
    sb.oldest.max_queue_delay_microseconds = max_queue_delay_us
    for s in states.values():
        out = outputs.get(s["output"])
        if out is None:
            raise RepoError(f"state {s['name']!r}: its output {s['output']!r} is not an engine output")
        if out["dtype"] != s["dtype"] or out["shape"] != s["shape"]:
            raise RepoError(f"state {s['name']!r}: output {s['output']!r} has {out['dtype']} {out['shape']}, "
                            f"expected {s['dtype']} {s['shape']}")
        st = sb.state.add(input_name=s["name"], output_name=s["output"], data_type=_dtype(s), dims=_dims(s),
                          use_same_buffer_for_input_output=True)
        st.initial_state.add(name=f"{s['name']}_zero", data_type=_dtype(s), dims=_dims(s), zero_data=True)
    mc.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU, count=1)
    return mc


def config_text(mc) -> str:
    """Text-format config, checked by parsing it back into a fresh ModelConfig."""
    from google.protobuf import text_format

    text = text_format.MessageToString(mc)
    back = _pb().ModelConfig()
    text_format.Parse(text, back)
    if back != mc:  # pragma: no cover - protobuf round trip is exact
        raise RepoError("config.pbtxt does not parse back to the same ModelConfig")
    return text


def make_repo(engine_dir: pathlib.Path, repo: pathlib.Path, name: str) -> pathlib.Path:
    cfg_path = engine_dir / "config.json"
    if not cfg_path.is_file():
        raise RepoError(f"--engine-dir: expected {cfg_path} (run scripts/build_engine.py first)")
    cfg = json.loads(cfg_path.read_text())
    text = config_text(model_config(cfg, name))
    target = repo / name
    if target.exists():
        raise RepoError(f"--repo: {target} already exists; remove it or pick another --name")
    repo.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=repo, prefix=f".{name}."))
    try:
        (tmp / "config.pbtxt").write_text(text)
        (tmp / "1").mkdir()
        plan = engine_dir / "model.plan"
        if plan.is_file():
            shutil.copy2(plan, tmp / "1" / "model.plan")
        else:
            (tmp / "1" / "MISSING_PLAN.txt").write_text(
                f"model.plan was not built in {engine_dir} (TensorRT >= 10.9 and a GPU are needed);\n"
                f"build it there with scripts/build_engine.py and copy it here as 1/model.plan.\n")
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# ---- Python backend: the model owns its state on its device ------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = ("float32", "bfloat16", "float16")
MODEL_PY = '''# SPDX-License-Identifier: Apache-2.0
"""Triton Python-backend entry point, written by scripts/make_triton_repo.py --backend python.

The backend stub embeds libpython with an isolated configuration, which ignores PYTHONPATH: the
directories of the interpreter that built this repository (config.pbtxt, parameters['python_path']:
the project root and its site-packages) go first on sys.path before anything else is imported, and
another Python version is refused (its compiled packages would not load). The rest is
trtllm_replayssm.triton_model.SequenceModel.
"""

import json
import os
import site
import sys


def _setup_path(cfg):
    params = cfg.get("parameters", {})
    want = params.get("python_version", {}).get("string_value", "")
    have = "%d.%d" % sys.version_info[:2]
    if want and want != have:
        raise RuntimeError(
            "this repository was built with Python %s, the backend stub embeds Python %s (%s): serve it with "
            "the stub for %s and LD_LIBRARY_PATH=%s so that the stub loads that libpython "
            "(scripts/make_triton_repo.py: serve_command)"
            % (want, have, sys.version.split()[0], want, params.get("python_libdir", {}).get("string_value", "?")))
    before = list(sys.path)
    for d in params.get("python_path", {}).get("string_value", "").split(os.pathsep):
        if d:
            site.addsitedir(d)  # also runs its .pth files (editable installs)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + [p for p in before if p not in added]


class TritonPythonModel:
    def initialize(self, args):
        _setup_path(json.loads(args["model_config"]))
        import triton_python_backend_utils as pb_utils

        from trtllm_replayssm.triton_model import SequenceModel

        self.impl = SequenceModel(pb_utils, args)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()
'''


def _py_version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def python_paths() -> list[str]:
    """Directories model.py puts on sys.path: the project root, then this interpreter's site-packages."""
    dirs = [str(ROOT)] + list(site.getsitepackages())
    user = site.getusersitepackages()
    if site.ENABLE_USER_SITE and os.path.isdir(user):
        dirs.append(user)
    return list(dict.fromkeys(dirs))


def _vocab(tiny: str, model_dir: pathlib.Path | None) -> int:
    from builders.nemotron_h import TINY_CONFIGS
    from builders.qwen3_next import FAMILIES, MODEL_TYPES

    if model_dir is None:
        tinies = {**TINY_CONFIGS, **FAMILIES}
        if tiny not in tinies:
            raise RepoError(f"--tiny: expected one of {sorted(tinies)}, got {tiny!r}")
        return int(tinies[tiny]["vocab_size"])
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise RepoError(f"--model: expected a checkpoint directory with config.json, got {model_dir}")
    raw = json.loads(cfg_path.read_text())
    kinds = ("nemotron_h",) + MODEL_TYPES
    if raw.get("model_type") not in kinds:
        raise RepoError(f"{cfg_path}: model_type: expected one of {kinds}, got {raw.get('model_type')!r}")
    return int(raw["vocab_size"])


def python_model_config(name: str, vocab: int, *, device: str, max_slots: int, max_seq_len: int, buffer_len: int,
                        idle_us: int, max_queue_delay_us: int, params: dict):
    """Triton ``ModelConfig`` of the Python-backend sequence model (module docstring)."""
    pb = _pb()
    if device not in ("cpu", "cuda"):
        raise RepoError(f"--device: expected cpu or cuda (auto is resolved before), got {device!r}")
    for key, v, lo, hi in (("max-slots", max_slots, 1, 4096), ("max-seq-len", max_seq_len, 1, 1 << 20),
                           ("buffer-len", buffer_len, 2, 32), ("idle-ms", idle_us // 1000, 1, 1 << 31)):
        if not lo <= v <= hi:  # buffer_len >= 2: the ring folds one step before it fills (T = 1)
            raise RepoError(f"--{key}: expected {lo}..{hi}, got {v}")
    mc = pb.ModelConfig(name=name, backend="python", max_batch_size=max_slots)
    mc.input.add(name="input_ids", data_type=pb.TYPE_INT64, dims=[1])
    mc.output.add(name="logits", data_type=pb.TYPE_FP32, dims=[vocab])
    mc.output.add(name="slot", data_type=pb.TYPE_INT32, dims=[1])
    sb = mc.sequence_batching
    sb.max_sequence_idle_microseconds = idle_us
    sb.oldest.max_candidate_sequences = max_slots  # one cache slot per candidate sequence
    sb.oldest.max_queue_delay_microseconds = max_queue_delay_us
    C = pb.ModelSequenceBatching.Control
    for ctl, kind in (("START", C.CONTROL_SEQUENCE_START), ("END", C.CONTROL_SEQUENCE_END),
                      ("READY", C.CONTROL_SEQUENCE_READY)):
        sb.control_input.add(name=ctl, control=[C(kind=kind, int32_false_true=[0, 1])])
    sb.control_input.add(name="CORRID", control=[C(kind=C.CONTROL_SEQUENCE_CORRID, data_type=pb.TYPE_UINT64)])
    kind = pb.ModelInstanceGroup.KIND_GPU if device == "cuda" else pb.ModelInstanceGroup.KIND_CPU
    mc.instance_group.add(kind=kind, count=1)  # the state lives in this one instance
    full = dict(params, device=device, buffer_len=buffer_len, max_seq_len=max_seq_len)
    for k, v in full.items():
        mc.parameters[k].string_value = str(v)
    return mc


def make_python_repo(repo: pathlib.Path, name: str, *, tiny: str = "nemotron_h", model_dir: pathlib.Path | None = None,
                     dtype: str = "float32", seed: int = 0, device: str = "auto", max_slots: int = 8,
                     max_seq_len: int = 1024, buffer_len: int = 16, idle_us: int = 60_000_000,
                     max_queue_delay_us: int = 100) -> pathlib.Path:
    """Write REPO/NAME/{config.pbtxt, 1/model.py} of the Python-backend model; returns REPO/NAME."""
    if dtype not in DTYPES:
        raise RepoError(f"--dtype: expected one of {DTYPES}, got {dtype!r}")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = _vocab(tiny, model_dir)
    params = dict(model_dir="" if model_dir is None else str(model_dir.resolve()), tiny="" if model_dir else tiny,
                  seed=seed, dtype=dtype, python_path=os.pathsep.join(python_paths()),
                  python_version=_py_version(), python_libdir=sysconfig.get_config_var("LIBDIR") or "")
    text = config_text(python_model_config(name, vocab, device=device, max_slots=max_slots, max_seq_len=max_seq_len,
                                           buffer_len=buffer_len, idle_us=idle_us,
                                           max_queue_delay_us=max_queue_delay_us, params=params))
    return _write_model(repo, name, {"config.pbtxt": text, "1/model.py": MODEL_PY})


def _write_model(repo: pathlib.Path, name: str, files: dict) -> pathlib.Path:
    target = repo / name
    if target.exists():
        raise RepoError(f"--repo: {target} already exists; remove it or pick another --name")
    repo.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=repo, prefix=f".{name}."))
    try:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# ---- serving with the tritonserver of the nvidia-pytriton wheel ------------------------------------------------
def pytriton_server() -> dict:
    """Files of the tritonserver that nvidia-pytriton bundles (``pytriton/tritonserver``; the package
    itself is never imported): the server binary, the Python backend and the backend stub built for
    this interpreter's Python version. Raises RepoError naming what is missing."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RepoError("nvidia-pytriton is not installed (pip install 'nvidia-pytriton==0.7.0'; "
                        "it bundles tritonserver with the Python backend)")
    root = pathlib.Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    ver = _py_version()
    files = dict(server=root / "bin" / "tritonserver", backend=root / "backends" / "python" / "libtriton_python.so",
                 utils=root / "backends" / "python" / "triton_python_backend_utils.py",
                 stub=root / "python_backend_stubs" / ver / "triton_python_backend_stub")
    for key, path in files.items():
        if not path.is_file():
            raise RepoError(f"nvidia-pytriton: {key} {path} not found (no stub for Python {ver}?)")
    return files


def write_backend_dir(dest: pathlib.Path) -> pathlib.Path:
    """``dest/python/`` with the Python backend and this Python's stub, as symlinks into the wheel (the
    stub finds the wheel's libraries through its relative RPATH, which a copy would break). Returns dest."""
    files = pytriton_server()
    (dest / "python").mkdir(parents=True, exist_ok=True)
    for key, name in (("backend", "libtriton_python.so"), ("utils", "triton_python_backend_utils.py"),
                      ("stub", "triton_python_backend_stub")):
        link = dest / "python" / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(files[key])
    return dest


def serve_command(repo: pathlib.Path, backend_dir: pathlib.Path, grpc_port: int = 8001, http_port: int = 8000,
                  metrics_port: int = 8002, host: str = "127.0.0.1") -> tuple[list[str], dict]:
    """(argv, environment additions) serving ``repo`` with the wheel's tritonserver on ``host``. The stub
    links libpython3.X.so by name, so LD_LIBRARY_PATH leads with this interpreter's LIBDIR: otherwise
    the dynamic linker may pick another libpython of the same version (e.g. the system's, whose
    sys.path has none of this environment's packages)."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise RepoError(f"{sys.executable} was built without a shared libpython; the backend stub needs "
                        f"libpython{sys.version_info[0]}.{sys.version_info[1]}.so of the interpreter that built the repository")
    libdir = sysconfig.get_config_var("LIBDIR")
    ld = os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    argv = [str(pytriton_server()["server"]), f"--model-repository={repo}", f"--backend-directory={backend_dir}",
            f"--grpc-address={host}", f"--grpc-port={grpc_port}", f"--http-address={host}", f"--http-port={http_port}",
            f"--metrics-address={host}", f"--metrics-port={metrics_port}", "--exit-on-error=true"]
    return argv, {"LD_LIBRARY_PATH": ld}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("tensorrt_plan", "python"), default="tensorrt_plan",
                    help="tensorrt_plan: the built engine with implicit state; python: a model that owns its state")
    ap.add_argument("--engine-dir", type=pathlib.Path, help="output directory of build_engine.py (tensorrt_plan)")
    ap.add_argument("--repo", required=True, type=pathlib.Path, help="model repository root to write into")
    ap.add_argument("--name", default="nemotron_h_replayssm", help="model name in the repository")
    py = ap.add_argument_group("--backend python")
    py.add_argument("--model", type=pathlib.Path,
                    help="Nemotron-H / Nemotron 3 / Qwen3-Next / Qwen3.5 checkpoint directory (default: the embedded tiny)")
    py.add_argument("--tiny", default="nemotron_h",
                    help="embedded tiny config without --model: nemotron_h, nemotron3, qwen3_next, qwen3_5 "
                         "(default: %(default)s)")
    py.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights (default: %(default)s)")
    py.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: %(default)s)")
    py.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: cuda where torch sees a GPU at build time (default: %(default)s)")
    py.add_argument("--max-slots", type=int, default=8, help="cache slots = max_candidate_sequences (default: %(default)s)")
    py.add_argument("--max-seq-len", type=int, default=1024, help="tokens per sequence, K/V rows (default: %(default)s)")
    py.add_argument("--buffer-len", type=int, default=16, help="ReplaySSM ring length L, 2..32 (default: %(default)s)")
    py.add_argument("--idle-ms", type=int, default=60_000, help="max_sequence_idle_microseconds / 1000 (default: %(default)s)")
    py.add_argument("--max-queue-delay-us", type=int, default=100, help="oldest strategy's batching delay (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        if args.backend == "python":
            target = make_python_repo(args.repo, args.name, tiny=args.tiny, model_dir=args.model, dtype=args.dtype,
                                      seed=args.seed, device=args.device, max_slots=args.max_slots,
                                      max_seq_len=args.max_seq_len, buffer_len=args.buffer_len,
                                      idle_us=args.idle_ms * 1000, max_queue_delay_us=args.max_queue_delay_us)
        elif args.engine_dir is None:
            raise RepoError("--engine-dir is required with --backend tensorrt_plan")
        else:
            target = make_repo(args.engine_dir, args.repo, args.name)
    except RepoError as e:
        print(f"make_triton_repo: {e}", file=sys.stderr)
        return 2
    if args.backend == "python":
        print(f"[make_triton_repo] wrote {target}/config.pbtxt and {target}/1/model.py")
        try:
            backends = write_backend_dir(args.repo.parent / f"{args.repo.name}-backends")
            cmd, env = serve_command(args.repo, backends)
            print("[make_triton_repo] serve with: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd))
        except RepoError as e:
            print(f"[make_triton_repo] {e}; or serve it with a tritonserver whose Python backend runs this Python "
                  f"(its packages and the project on the paths of parameters['python_path'])")
        return 0
    has_plan = (target / "1" / "model.plan").is_file()
    note = "" if has_plan else " (no model.plan yet: see 1/MISSING_PLAN.txt)"
    print(f"[make_triton_repo] wrote {target}/config.pbtxt{note}")
    print(f"[make_triton_repo] serve with: tritonserver --model-repository={args.repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
