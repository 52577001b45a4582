# SPDX-License-Identifier: Apache-2.0
"""Triton Inference Server model repositories for ReplaySSM: the writer behind ``scripts/make_triton_repo.py``.

Two routes, each a ``REPO/NAME/`` model directory whose ``config.pbtxt`` is built as Triton's own
``ModelConfig`` protobuf (``tritonclient``'s ``model_config_pb2``), printed in text format and parsed back
(:func:`config_text`), never templated as a string:

* :func:`make_repo` (``platform: "tensorrt_plan"``): reads a standard engine directory (its config.json,
  the format of :mod:`builders.engine_format`; the speculative pair is refused: one Triton sequence model
  runs one engine per request step) and writes config.pbtxt (:func:`model_config`) and ``1/model.plan``
  (a copy; ``1/MISSING_PLAN.txt`` where the plan was not built). ``sequence_batching`` with **implicit
  state**: every state tensor of the engine is a ``state`` entry pairing the engine input with its
  ``*_out`` output, zero-initialised at sequence start, in place (``use_same_buffer_for_input_output``,
  matching the plugin's aliased outputs); a request carries one token (``input_ids``, shape [1]) and
  returns ``logits``. The states must be exactly those of the format's table for ``model.pattern``
  (``engine_format.check_layer_states``); anything else is refused before a file is written, naming the
  layer and the state (:class:`RepoError`).
* ``--backend python`` (no engine; :func:`builders.triton_generate.make_generate_repo`): the streaming (decoupled)
  generation model of every family, config.pbtxt and ``1/model.py`` (:data:`MODEL_PY`, which hands every call to
  ``builders.triton_generate.GenerateModel``: the generation engine of builders/generation.py owns the state of its
  slots on its device). Everything the model needs is a ``parameters`` entry: the checkpoint (``model_dir``, or
  ``tiny`` + ``seed``), dtype, device, sizes, mode, and ``python_path`` / ``python_version`` / ``python_libdir``:
  the Python backend stub embeds libpython with an isolated configuration that ignores PYTHONPATH, so model.py puts
  this interpreter's project root and site-packages on ``sys.path`` itself (:func:`python_paths`) and refuses
  another Python version. This module holds what that writer shares with this one (:func:`config_text`,
  :func:`default_name`, :func:`check_dtype_device`, :func:`check_model`, :func:`_write_model`).

What the server would refuse at load is refused at write time, before a file is written, naming the flag
(:class:`RepoError`): a ``--repo`` that is not a directory, ``--device cuda`` where torch sees no CUDA device, a
checkpoint that the server's own loader or decode step refuses (:func:`check_model`: one load of it, on the CPU).
``--dtype`` is spelled as scripts/build_engine.py's (:data:`DTYPES`, the torch names accepted: :func:`dtype_spelling`).

Serving the Python-backend repository with the tritonserver that the nvidia-pytriton wheel bundles:
:func:`pytriton_server` finds its files, :func:`write_backend_dir` links its Python backend and stub,
:func:`serve_command` gives the command line and environment, with a bounded shutdown (:data:`EXIT_TIMEOUT_S`:
tritonserver waits for in-flight requests and the unloads).

Importing this module needs neither torch nor TensorRT (the ``tensorrt_plan`` route reads JSON only);
tritonclient is imported when a config is built.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import site
import sys
import sysconfig

from .engine_format import CONFIG_DTYPES, DECODE_FORMAT, FormatError, check_layer_states, is_speculative, staging_dir

TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int32": "TYPE_INT32",
                "int64": "TYPE_INT64"}
REQUEST_INPUTS = ("input_ids",)  # what a client sends each step; every other input is implicit state
# The install hint wherever one is printed: --no-deps, since the wheel's own requirements would downgrade numpy to
# 1.26 with ~20 other packages, and only its tritonserver files are used (the package itself is never imported).
PYTRITON_INSTALL = "pip install --no-deps 'nvidia-pytriton==0.7.0'"
# --dtype of both scripts (build_engine.py and make_triton_repo.py): the engine-directory format's spellings
# (builders/engine_format.py CONFIG_DTYPES), the torch names accepted as aliases (make_triton_repo's spelling before).
DTYPES = tuple(CONFIG_DTYPES)
DTYPE_ALIASES = {long: short for short, long in CONFIG_DTYPES.items()}
# tritonserver --exit-timeout-secs of the serve commands printed here. On SIGINT / SIGTERM tritonserver stops taking
# new requests and waits for in-flight inferences and then the unloads up to this many seconds (its default is 30):
# a sequence batcher (the tensorrt_plan route) counts every sequence still holding a slot as one until its END or its
# max_sequence_idle_microseconds (--idle-ms); the streaming model ends its open streams itself once the server stops
# being live (builders/triton_generate.py ServerWatch), and this bound covers the rest.
EXIT_TIMEOUT_S = 10


def dtype_spelling(value: str) -> str:
    """``value`` of a --dtype flag in :data:`DTYPES`' spelling (float32 -> fp32, ...); anything else unchanged
    (argparse's choices then name it)."""
    return DTYPE_ALIASES.get(value, value)


class RepoError(ValueError):
    """The repository cannot be written: the engine directory's config.json does not describe a decode-step engine
    we can serve, an argument is out of range, the target exists, or a tool it needs is missing; the message names
    the argument, key or state."""


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


def _check_ranges(*checks) -> None:
    """RepoError naming the flag of the first (flag, value, lo, hi) whose value is outside lo..hi."""
    for key, v, lo, hi in checks:
        if not lo <= v <= hi:
            raise RepoError(f"--{key}: expected {lo}..{hi}, got {v}")


def _batching_ranges(idle_us: int, max_queue_delay_us: int) -> tuple:
    """The sequence batcher's flags (--idle-ms and --max-queue-delay-us: the tensorrt_plan route's)."""
    return ("idle-ms", idle_us // 1000, 1, 1 << 31), ("max-queue-delay-us", max_queue_delay_us, 0, (1 << 63) - 1)


def model_config(cfg: dict, name: str, max_queue_delay_us: int = 100, idle_us: int = 60_000_000):
    """Triton ``ModelConfig`` for the standard decode-step engine whose config.json is ``cfg`` (builders/engine_format.py)."""
    pb = _pb()
    _check_ranges(*_batching_ranges(idle_us, max_queue_delay_us))
    if is_speculative(cfg):
        raise RepoError("config.json describes a speculative engine pair (verify.plan + commit.plan, sampling in "
                        "between; scripts/build_engine.py --num-draft): one Triton sequence model cannot run it")
    if cfg.get("format") != DECODE_FORMAT:  # another version may mean another layout: refuse, never misread
        raise RepoError(f"config.json: format: expected {DECODE_FORMAT!r} (this writer's engine-directory format), "
                        f"got {cfg.get('format')!r}")
    for key in ("max_batch", "inputs", "outputs", "states"):
        if key not in cfg:
            raise RepoError(f"config.json: missing {key!r} (was it written by scripts/build_engine.py?)")
    try:
        check_layer_states(cfg)
    except FormatError as e:
        raise RepoError(str(e)) from e
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


def default_name(*, engine_cfg: dict | None = None, tiny: str | None = None,
                 model_dir: pathlib.Path | None = None) -> str:
    """``<family>_replayssm``, the model's name in the repository when --name is not given: the engine's
    ``model.model_type`` (Qwen3-Next / Qwen3.5 engines; Nemotron engines have none: nemotron_h), the
    checkpoint's ``model_type``, or the embedded tiny's name."""
    if engine_cfg is not None:
        family = (engine_cfg.get("model") or {}).get("model_type") or "nemotron_h"
    elif model_dir is not None:
        try:
            family = json.loads((model_dir / "config.json").read_text()).get("model_type") or "nemotron_h"
        except (OSError, ValueError):
            family = "nemotron_h"  # _vocab names the unreadable config.json
    else:
        family = tiny or "nemotron_h"
    return f"{family}_replayssm"


def _read_json(path: pathlib.Path) -> dict:
    """The JSON object in ``path``; RepoError naming the file where it is not one."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RepoError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise RepoError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def make_repo(engine_dir: pathlib.Path, repo: pathlib.Path, name: str | None = None, *, idle_us: int = 60_000_000,
              max_queue_delay_us: int = 100) -> pathlib.Path:
    """Write REPO/NAME/{config.pbtxt, 1/model.plan} of the engine in ``engine_dir``; returns REPO/NAME."""
    cfg_path = engine_dir / "config.json"
    if not cfg_path.is_file():
        raise RepoError(f"--engine-dir: expected {cfg_path} (run scripts/build_engine.py first)")
    cfg = _read_json(cfg_path)
    name = name or default_name(engine_cfg=cfg)
    _check_target(repo, name)
    text = config_text(model_config(cfg, name, max_queue_delay_us=max_queue_delay_us, idle_us=idle_us))
    plan = engine_dir / "model.plan"
    if plan.is_file():
        return _write_model(repo, name, {"config.pbtxt": text}, copies={"1/model.plan": plan})
    return _write_model(repo, name, {"config.pbtxt": text, "1/MISSING_PLAN.txt": (
        f"model.plan was not built in {engine_dir} (TensorRT >= 10.9 and a GPU are needed);\n"
        f"build it there with scripts/build_engine.py and copy it here as 1/model.plan.\n")})


# ---- Python backend: the streaming model owns its state on its device (builders/triton_generate.py) ------------
ROOT = pathlib.Path(__file__).resolve().parent.parent  # the project root: builders/ and trtllm_replayssm/ live there
MODEL_PY = '''# SPDX-License-Identifier: Apache-2.0
"""Triton Python-backend entry point, written by scripts/make_triton_repo.py --backend python.

The backend stub embeds libpython with an isolated configuration, which ignores PYTHONPATH: the
directories of the interpreter that built this repository (config.pbtxt, parameters['python_path']:
the project root and its site-packages) go first on sys.path before anything else is imported, and
another Python version is refused (its compiled packages would not load). The rest is
builders.triton_generate.GenerateModel (decoupled: responses go through each request's sender).
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

        from builders.triton_generate import GenerateModel

        self.impl = GenerateModel(pb_utils, args)

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
    """The vocabulary size of the --tiny name or of the --model checkpoint's config.json, both checked by name."""
    from . import models

    served = models.model_types(streaming=True)  # the model types the generation engine serves
    if model_dir is None:
        try:
            return models.by_tiny(tiny, streaming=True).vocab_size(tiny)
        except ValueError as e:
            raise RepoError(str(e)) from None
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise RepoError(f"--model: expected a checkpoint directory with config.json, got {model_dir}")
    raw = _read_json(cfg_path)
    if raw.get("model_type") not in served:
        raise RepoError(f"--model: {cfg_path}: model_type: expected one of {list(served)}, got "
                        f"{raw.get('model_type')!r}")
    text = raw.get("text_config")  # the published Qwen3.5 directories: the vision-language wrapper's config
    vocab = raw.get("vocab_size", text.get("vocab_size") if isinstance(text, dict) else None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise RepoError(f"{cfg_path}: vocab_size (or text_config.vocab_size): expected a positive integer, got "
                        f"{vocab!r}")
    return vocab


def check_dtype_device(dtype: str, device: str) -> tuple[str, str]:
    """``--dtype`` in its one spelling and ``--device`` resolved ("auto": cuda where torch sees a GPU); refused by
    name where the server would fail at load."""
    if dtype_spelling(dtype) not in DTYPES:
        raise RepoError(f"--dtype: expected one of {list(DTYPES)} (or {list(DTYPE_ALIASES)}), got {dtype!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise RepoError(f"--device: expected auto, cpu or cuda, got {device!r}")
    if device != "cpu":
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif not torch.cuda.is_available():
            raise RepoError("--device cuda: torch sees no CUDA device on this machine (torch.cuda.is_available() is "
                            "False), so the model instance (KIND_GPU) would fail to load; write the repository where it "
                            "is served, or pass --device cpu (the float64 reference)")
    return dtype_spelling(dtype), device


def check_model(model_dir: pathlib.Path, dtype: str = "fp32", *, buffer_len: int = 16, mode: str = "replay") -> None:
    """Load the checkpoint ``model_dir`` as the server's model.py will (``builders.triton_generate.load_model``:
    builders/nemotron_h.py's or builders/qwen3_next.py's checked loader: config, layer types, every tensor's name,
    shape and bytes), on the CPU in ``dtype``, and build the generation engine's decode step over it for one slot in
    ``mode`` (``builders.generation.make_step``); RepoError naming --model where either refuses it (a truncated or
    missing safetensors file, a tensor missing or mis-shaped, a family or mode without a step), which the server
    would otherwise report only when it loads the model. Costs one load of the checkpoint."""
    import torch

    from .generation import make_step
    from .triton_generate import load_model

    params = dict(model_dir=str(model_dir), tiny="", seed=0, dtype=CONFIG_DTYPES[dtype_spelling(dtype)])
    try:
        model = load_model(params, torch.device("cpu"))
    except Exception as e:  # CheckpointError names the file or tensor; anything else is the loader's own
        raise RepoError(f"--model: {str(model_dir)!r} does not load as the server would load it: {e}") from e
    try:
        make_step(model, 1, 2, mode, buffer_len, fuse=False)
    except Exception as e:
        raise RepoError(f"--model: the server's decode step refuses {str(model_dir)!r}: {e}") from e


def _check_target(repo: pathlib.Path, name: str) -> None:
    """RepoError naming --name or --repo unless ``repo/name`` can be created: one directory name, ``repo`` a
    directory or a path whose first existing ancestor is one, ``repo/name`` not there yet."""
    if not name or name in (".", "..") or any(sep and sep in name for sep in (os.sep, os.altsep)):
        raise RepoError(f"--name: expected one directory name, got {name!r}")
    for p in (repo, *repo.parents):  # the first that exists must be a directory
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                where = "which is not a directory" if p == repo else f"inside {str(p)!r}, which is not a directory"
                raise RepoError(f"--repo: expected a directory (the model repository root, created if missing), got "
                                f"{str(repo)!r}, {where}")
            break
    target = repo / name
    if target.exists():
        raise RepoError(f"--repo: {target} already exists; remove it or pick another --name")


def _write_model(repo: pathlib.Path, name: str, files: dict, copies: dict | None = None) -> pathlib.Path:
    """``repo/name`` with ``files`` (relative path -> text) and ``copies`` (relative path -> a file copied in),
    written in a temporary sibling and renamed into place, so a failure leaves no half-written model."""
    _check_target(repo, name)
    target = repo / name
    try:
        repo.mkdir(parents=True, exist_ok=True)
        tmp = staging_dir(repo, f".{name}.")
    except OSError as e:  # e.g. no permission
        raise RepoError(f"--repo: cannot write in the directory {str(repo)!r} ({e.strerror or e})") from e
    try:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        for rel, src in (copies or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tmp / rel)
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
        raise RepoError(f"nvidia-pytriton is not installed ({PYTRITON_INSTALL}; it bundles tritonserver with the "
                        f"Python backend)")
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
    try:
        (dest / "python").mkdir(parents=True, exist_ok=True)
        for key, name in (("backend", "libtriton_python.so"), ("utils", "triton_python_backend_utils.py"),
                          ("stub", "triton_python_backend_stub")):
            link = dest / "python" / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(files[key])
    except OSError as e:  # e.g. a file where the directory goes
        raise RepoError(f"backend directory {str(dest)!r}: cannot write the Python backend links there ({e})") from e
    return dest


def serve_command(repo: pathlib.Path, backend_dir: pathlib.Path, grpc_port: int = 8001, http_port: int = 8000,
                  metrics_port: int = 8002, host: str = "127.0.0.1",
                  exit_timeout_s: int = EXIT_TIMEOUT_S) -> tuple[list[str], dict]:
    """(argv, environment additions) serving ``repo`` with the wheel's tritonserver on ``host``. The stub
    links libpython3.X.so by name, so LD_LIBRARY_PATH leads with this interpreter's LIBDIR: otherwise
    the dynamic linker may pick another libpython of the same version (e.g. the system's, whose
    sys.path has none of this environment's packages). ``exit_timeout_s``: the longest a shutdown waits for
    in-flight requests and the unloads (:data:`EXIT_TIMEOUT_S`)."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise RepoError(f"{sys.executable} was built without a shared libpython; the backend stub needs "
                        f"libpython{sys.version_info[0]}.{sys.version_info[1]}.so of the interpreter that built the repository")
    libdir = sysconfig.get_config_var("LIBDIR")
    ld = os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    argv = [str(pytriton_server()["server"]), f"--model-repository={repo}", f"--backend-directory={backend_dir}",
            f"--grpc-address={host}", f"--grpc-port={grpc_port}", f"--http-address={host}", f"--http-port={http_port}",
            f"--metrics-address={host}", f"--metrics-port={metrics_port}", "--exit-on-error=true",
            f"--exit-timeout-secs={exit_timeout_s}"]
    return argv, {"LD_LIBRARY_PATH": ld}
