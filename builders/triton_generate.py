# SPDX-License-Identifier: Apache-2.0
"""A decoupled (streaming) Triton Python-backend model for generation: prompt in, tokens streamed out, over the
generation engine of :mod:`builders.generation` (in-flight batching on the captured model step).

Route (``scripts/make_triton_repo.py --backend python`` writes the repository for every model kind the engine serves:
builders/models.py's kinds with a streaming step; :func:`make_generate_repo`; its ``1/model.py``,
builders/triton_repo.py's ``MODEL_PY``, puts the project on ``sys.path`` and hands every call to
:class:`GenerateModel`):

  config.pbtxt   ``backend: "python"``, ``model_transaction_policy { decoupled: true }``, ``max_batch_size: 0``
                 (the engine batches: requests join and leave its slots between decode steps), one instance.
  initialize     the model of the parameters (``model_dir``, or ``tiny`` + ``seed``; ``dtype``, ``device``) through
                 :func:`load_model` (the checked loader of the model kind, builders/models.py), an
                 :class:`~builders.generation.Engine` of ``max_slots`` x ``max_seq_len`` over the kind's decode step
                 in ``mode`` (conventional | replay | replay_bf16 | replay_fp8 | replay_ckpt8, those the kind's SSM
                 family keeps: ``ModelKind.modes``; ``buffer_len``) started on its thread, and
                 ``transformers.AutoTokenizer`` where the checkpoint directory has a tokenizer. Opt-in engine
                 features (issue 38; :data:`ENGINE_PARAMETERS`):
                 ``prefix_cache_tokens`` (> 0: the prefix cache of shared prompt prefixes, that budget in tokens;
                 ``prefix_block`` tokens a block) and ``preempt`` (true: requests beyond the slots take the slot of
                 one that has decoded ``preempt_quantum`` steps, swapped out to host memory, at most
                 ``max_swapped_bytes``; empty: no limit).
  execute        each request's inputs are read and submitted (nothing blocks); a bad request (the engine's
                 :class:`~builders.generation.RequestError`: prompt + max_tokens past ``max_seq_len``, a token outside
                 the vocabulary, a parameter out of range) gets one final error response before any work.
  engine thread  every output of a request is one response through ``request.get_response_sender()``: the new
                 ``output_ids`` (and ``text_output``: the whole completion decoded, the new suffix sent, a trailing
                 incomplete UTF-8 character held back), then the last one with
                 ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` and ``finish_reason`` (stop | length | cancelled),
                 ``prompt_tokens``, ``completion_tokens``; finish_reason "error" is a final
                 ``pb_utils.TritonError`` response. The request parameter ``stream: false`` sends one final
                 response with everything instead (HTTP ``generate`` expects exactly one).
                 ``request.is_cancelled()`` (a client that cancels or goes away; Triton >= 2.44) is polled by the
                 engine: the slot is freed at the next step.
  finalize       ``engine.shutdown()``: open and queued requests end with an error.

Inputs (named so that Triton's HTTP ``generate`` / ``generate_stream`` extension maps JSON fields onto them):
``input_ids`` INT64 [-1] or ``text_input`` BYTES [1] (one of them), ``max_tokens`` INT32 [1] (16),
``temperature`` FP32 [1] (0: greedy), ``top_k`` INT32 [1] (0: all), ``top_p`` FP32 [1] (1), ``seed`` INT64 [1]
(drawn when absent), ``stop_token_ids`` INT64 [-1] (absent: the checkpoint's EOS ids; given, even empty: exactly
those). Outputs: ``output_ids`` INT64 [-1], ``text_output`` BYTES [1], ``finish_reason`` BYTES [1],
``prompt_tokens`` INT32 [1], ``completion_tokens`` INT32 [1].

Tensors cross the boundary through DLPack (``Tensor.to_dlpack`` / ``Tensor.from_dlpack``), never through numpy: the
Python backend stub of Triton 2.51 (the one nvidia-pytriton 0.7.0 bundles) is built with a pybind11 that reads
numpy's pre-2.0 dtype layout, so under numpy 2.x ``as_numpy()`` of a [1, 3] fp32 input [1, 2, 3] reads [1, 1, 1]
and ``Tensor(name, ndarray)`` sends a 0-byte output, without an error (docs/triton.md, "numpy 2.x silently
corrupts tensors"); DLPack does not use numpy. DLPack cannot carry strings, so BYTES goes through numpy, and under
that stub with numpy >= 2 (its pybind11 2.10 reads a numpy 2 dtype's ``flags`` where numpy 1 kept ``elsize``) both ways
break: an input arrives as its first byte repeated (and the stub process dies parsing it) and an output is sent
empty. :class:`BytesIO` probes the stub at load and, where it is broken:

* outputs: the serialized bytes go out as a 1-element ``V<n>`` array whose fresh dtype reads ``elsize`` n at the
  place that pybind11 reads, for the length of the ``pb_utils.Tensor`` constructor only (checked against this
  numpy's layout first; the BYTES outputs, ``text_output`` and ``finish_reason``, are left out where it does not
  match);
* inputs: a BYTES tensor cannot be read (the stub copies it through the misread dtype before the model sees it),
  so the writer leaves ``text_input`` out of config.pbtxt under numpy >= 2 (``text_input="auto"``): Triton's
  generate extension then hands a JSON ``"text_input"`` to the model as a request parameter, which gRPC clients
  send as ``parameters={"text_input": ...}``; the model reads the prompt from either. A repository that declares
  the tensor anyway gets a stub that never dies on it and a clear error per such request.

Shutdown: the stub is told nothing when tritonserver is stopped (SIGINT / SIGTERM), and the model is unloaded
(``finalize``) only after its streams have ended, so a stream left open would hold the server until
``--exit-timeout-secs`` (and then ``exit()`` hangs in 2.51). The model therefore watches the server's own
liveness (:class:`ServerWatch`: ``GET /v2/health/live`` on the HTTP endpoint of the server's command line,
``parameters['health_url']`` to override or ``off``; the endpoint stops accepting at the signal) and ends every
open stream with an error within a second. A client must then close its stream: tritonserver 2.51 does not
unload a model while a gRPC stream that used it is still open, even idle.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import sys
import sysconfig
import threading
import urllib.error
import urllib.request

from . import models
from .engine_format import CONFIG_DTYPES
from .generation import MODES, Engine, Output, Request, RequestError
from .triton_repo import (
    MODEL_PY,
    RepoError,
    _check_ranges,
    _check_target,
    _pb,
    _py_version,
    _vocab,
    _write_model,
    check_dtype_device,
    check_model,
    config_text,
    default_name,
    python_paths,
)

# (name, Triton type, dims, optional) of the request inputs and the response outputs (module docstring)
INPUTS = (("input_ids", "TYPE_INT64", [-1]), ("text_input", "TYPE_STRING", [1]), ("max_tokens", "TYPE_INT32", [1]),
          ("temperature", "TYPE_FP32", [1]), ("top_k", "TYPE_INT32", [1]), ("top_p", "TYPE_FP32", [1]),
          ("seed", "TYPE_INT64", [1]), ("stop_token_ids", "TYPE_INT64", [-1]))
OUTPUTS = (("output_ids", "TYPE_INT64", [-1]), ("text_output", "TYPE_STRING", [1]),
           ("finish_reason", "TYPE_STRING", [1]), ("prompt_tokens", "TYPE_INT32", [1]),
           ("completion_tokens", "TYPE_INT32", [1]))
DEFAULT_MAX_TOKENS = 16
# config.pbtxt parameters -> the Engine keyword, its parser and the default (the Engine's), the opt-in features
ENGINE_PARAMETERS = {"prefix_cache_tokens": (int, 0), "prefix_block": (int, 16), "preempt": (None, False),
                     "preempt_quantum": (int, 16), "max_swapped_bytes": (int, None)}
TEXT_INPUT_ROUTES = ("auto", "tensor", "parameter")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# ---- BYTES tensors under the stub's numpy ----------------------------------------------------------------------
UNREADABLE = b"\x00replayssm: a BYTES input this backend stub cannot read\x00"


def _descr_layout_ok(np) -> bool:
    """True where a dtype's ``flags`` (uint64) sit at byte 32 and ``elsize`` (intp) at byte 40 of its struct
    (numpy 2 on a 64-bit CPython), the two fields the shim of :class:`BytesIO` relies on."""
    if sys.maxsize < 2**32 or int(np.__version__.split(".")[0]) < 2:
        return False
    for d in (np.dtype(object), np.dtype((np.void, 13))):
        if (ctypes.c_uint64.from_address(id(d) + 32).value != d.flags
                or ctypes.c_int64.from_address(id(d) + 40).value != d.itemsize):
            return False
    return True


class BytesIO:
    """BYTES tensors in and out of the Python backend stub ``pb`` (the module docstring's shim).

    ``sound``: the stub's numpy interop reads arrays right (a uint8 tensor built from DLPack reads back as
    itself): BYTES go through ``as_numpy()`` / ``pb.Tensor(name, object array)``. Otherwise
    ``deserialize_bytes_tensor`` is replaced for this stub process by one that never raises (the stub's own
    would take the process down on the misread bytes) and marks the tensor :data:`UNREADABLE`, and
    ``serialize_byte_tensor`` by the ``V<n>`` shim when ``text_out`` (the layout check passed)."""

    def __init__(self, pb, log=lambda msg: None):
        import numpy as np
        import torch

        self.pb, self.np = pb, np
        try:
            probe = pb.Tensor.from_dlpack("probe", torch.utils.dlpack.to_dlpack(torch.arange(1, 6, dtype=torch.uint8)))
            self.sound = [int(v) for v in probe.as_numpy().reshape(-1)] == [1, 2, 3, 4, 5]
        except Exception as e:  # a stub without as_numpy for such a tensor: treat as broken
            log(f"BYTES probe failed ({type(e).__name__}: {e})")
            self.sound = False
        self.text_out = self.sound
        self._local = threading.local()
        if not self.sound:
            pb.deserialize_bytes_tensor = self._unreadable
            self.text_out = _descr_layout_ok(np)
            if self.text_out:
                self._serialize = pb.serialize_byte_tensor
                pb.serialize_byte_tensor = self._serialize_shim

    def _unreadable(self, _arr):
        return self.np.array([UNREADABLE], dtype=object)

    def _serialize_shim(self, arr):
        raw = self._serialize(arr)
        fixes = getattr(self._local, "fixes", None)
        if fixes is None or not isinstance(raw, bytes) or not raw or len(raw) >= 2**31:
            return raw
        out = self.np.frombuffer(raw, dtype=self.np.dtype((self.np.void, len(raw))))  # a fresh dtype object
        flags = ctypes.c_uint64.from_address(id(out.dtype) + 32)
        fixes.append((flags, flags.value))
        flags.value = (flags.value & ~0xFFFFFFFF) | len(raw)  # where pybind11 2.10 reads elsize
        return out

    def tensor(self, name: str, items: list):
        """A BYTES ``pb.Tensor`` of ``items`` (bytes), shape [len(items)]."""
        arr = self.np.array(items, dtype=object)
        if self.sound:
            return self.pb.Tensor(name, arr)
        self._local.fixes = []
        try:
            return self.pb.Tensor(name, arr)
        finally:
            for flags, value in self._local.fixes:  # the dtype is numpy's own again before anything else sees it
                flags.value = value
            self._local.fixes = None

    def read(self, tensor) -> list:
        """The bytes items of a BYTES input; RequestError where this stub could not read it."""
        items = list(tensor.as_numpy().reshape(-1))
        if any(v is UNREADABLE for v in items):
            raise RequestError(
                f"{tensor.name()}: this tritonserver's Python backend stub (pybind11 < 2.12: Triton <= 2.53) cannot "
                f"read BYTES tensors under numpy {self.np.__version__}; send the prompt as the request parameter "
                f"'text_input' (gRPC: parameters={{'text_input': ...}}; HTTP generate: a repository written by "
                f"make_triton_repo.py under numpy >= 2 declares no text_input tensor, so the JSON field arrives as "
                f"that parameter)")
        return [bytes(v) if not isinstance(v, bytes) else v for v in items]


# ---- the server's liveness, seen from the stub ---------------------------------------------------------------
def _cmdline_flags(argv: list[str]) -> dict:
    """``--key=value`` and ``--key value`` options of a command line."""
    out, i = {}, 1
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a[2:].split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                k, v = a[2:], argv[i + 1]
                i += 1
            else:
                k, v = a[2:], "true"
            out[k] = v
        i += 1
    return out


def health_url_from_cmdline(argv: list[str]) -> str | None:
    """``http://HOST:PORT/v2/health/live`` of a tritonserver command line (its defaults: HTTP on, 0.0.0.0:8000),
    None where ``argv`` is not tritonserver's or HTTP is off."""
    if not argv or os.path.basename(argv[0]) != "tritonserver":
        return None
    flags = _cmdline_flags(argv)
    if flags.get("allow-http", "true").lower() in ("false", "0", "no", "off"):
        return None
    host = flags.get("http-address", "0.0.0.0")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{flags.get('http-port', '8000')}/v2/health/live"


def _parent_cmdline() -> list[str]:
    try:
        raw = pathlib.Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


class ServerWatch:
    """Calls ``on_stop()`` once when the server at ``url`` stops being live after it was (two failed probes in
    a row: connection refused or a non-200 answer; a timeout proves nothing), probing every ``period_s`` on a
    daemon thread (module docstring: why the stub must look for itself)."""

    def __init__(self, url: str, on_stop, period_s: float = 0.5, timeout_s: float = 2.0, log=lambda msg: None):
        self.url, self.on_stop, self.period_s, self.timeout_s, self.log = url, on_stop, period_s, timeout_s, log
        self.seen_live, self.misses, self.fired = False, 0, False
        self._stop = threading.Event()
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open  # loopback: no proxy
        self.thread = threading.Thread(target=self._run, name="replayssm-server-watch", daemon=True)

    def start(self) -> ServerWatch:
        self.thread.start()
        return self

    def probe(self) -> bool | None:
        """True: live; False: refused or not live; None: no answer in time."""
        try:
            with self._open(self.url, timeout=self.timeout_s) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False
        except urllib.error.URLError as e:
            return False if isinstance(e.reason, ConnectionRefusedError) else None
        except ConnectionRefusedError:
            return False
        except OSError:
            return None

    def check(self, live: bool | None) -> bool:
        """Account one probe; True when the server has just been seen to stop."""
        if live:
            self.seen_live, self.misses = True, 0
        elif live is False and self.seen_live:
            self.misses += 1
        return self.seen_live and self.misses >= 2 and not self.fired

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.check(self.probe()):
                self.fired = True
                self.log(f"the server stopped ({self.url} is not live): ending every open stream")
                self.on_stop()
                return

    def stop(self) -> None:
        self._stop.set()


# ---- the model -------------------------------------------------------------------------------------------------
def _param(cfg: dict, key: str, default: str = "") -> str:
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v == "" else v


def load_model(params: dict, device):
    """The model of the repository's parameters: ``model_dir`` (a checkpoint directory, its kind by its config.json
    ``model_type``) or the embedded tiny config ``tiny`` with seeded weights ``seed``, in ``dtype``, on ``device``,
    through its kind's checked loader (the registry of builders/models.py)."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[params["dtype"]]
    kind, tiny = models.for_source(params.get("model_dir") or None, params.get("tiny") or None, streaming=True)
    return kind.load(params.get("model_dir") or None, tiny, dtype=dtype, seed=int(params.get("seed", 0)), device=device)


class PbModel:
    """What a Python-backend model does with ``self.pb`` (triton_python_backend_utils or a test's stand-in): log,
    and make an error response."""

    pb = None

    def _warn(self, msg: str, info: bool = False) -> None:
        logger = getattr(self.pb, "Logger", None)
        if logger is not None:
            (logger.log_info if info else logger.log_warn)(msg)

    def _error(self, msg: str):
        err = self.pb.TritonError
        code = getattr(err, "INVALID_ARG", None)
        return self.pb.InferenceResponse(error=err(msg) if code is None else err(msg, code))


class _Stream:
    """One request's response sender and what its client has been sent."""

    def __init__(self, sender, tokenizer):
        self.sender, self.tokenizer = sender, tokenizer
        self.ids: list[int] = []
        self.sent = ""  # text sent so far
        self.streaming = True  # False: one final response with everything (the request parameter stream=false)
        self.held: list[int] = []  # token ids not sent yet (not streaming)

    def text_delta(self, final: bool) -> str:
        """The new text of the completion: decoded whole, less what was sent; a trailing U+FFFD (an incomplete
        UTF-8 character of byte-level tokens) waits for the next token unless ``final``."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):  # a tokenizer whose decode of a prefix is not a prefix: send the rest
            common = os.path.commonprefix([text, self.sent])
            self.sent = common
        delta = text[len(self.sent):]
        self.sent += delta
        return delta


class GenerateModel(PbModel):
    """What the generated ``TritonPythonModel`` does, with the ``triton_python_backend_utils`` module ``pb`` passed
    in (tests pass a stand-in). ``args``: Triton's initialize() arguments. ``model`` / ``tokenizer`` skip loading
    (tests)."""

    def __init__(self, pb, args: dict, model=None, tokenizer=None, engine_kw: dict | None = None):
        import torch

        self.pb = pb
        cfg = json.loads(args["model_config"])
        p = {k: _param(cfg, k) for k in ("model_dir", "tiny", "seed", "dtype", "device", "max_slots", "max_seq_len",
                                          "buffer_len", "mode", "health_url", "cancel_poll_ms", *ENGINE_PARAMETERS)}
        self.params = p
        if p["device"] == "cuda":
            self.device = torch.device("cuda", int(args.get("model_instance_device_id", 0) or 0))
        elif p["device"] in ("cpu", ""):
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"config.pbtxt: parameters['device']: expected 'cpu' or 'cuda', got {p['device']!r}")
        mode = p["mode"] or "replay"
        if mode not in MODES:
            raise ValueError(f"config.pbtxt: parameters['mode']: expected one of {MODES}, got {mode!r}")
        if model is None:
            model = load_model(dict(p, dtype=p["dtype"] or "float32", seed=p["seed"] or "0"), self.device)
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer(p["model_dir"])
        self.eos = self._eos_ids(model, self.tokenizer)
        self.bytes = BytesIO(pb, self._warn)
        if not self.bytes.sound:
            self._warn(f"this Python backend stub misreads numpy {self.bytes.np.__version__} arrays (pybind11 < 2.12): "
                       f"BYTES inputs cannot be read (the prompt text comes as the request parameter 'text_input'), "
                       + ("text_output through the dtype shim" if self.bytes.text_out else
                          "text_output is left out (this numpy's dtype layout is not the one the shim knows)"))
        kw = dict(max_slots=int(p["max_slots"] or 8), max_seq_len=int(p["max_seq_len"] or 1024), mode=mode,
                  buffer_len=int(p["buffer_len"] or 16), poll_s=int(p["cancel_poll_ms"] or 50) / 1000,
                  **engine_parameters(p))
        kw.update(engine_kw or {})
        self.engine = Engine(model, **kw).start()  # the family's step (generation.STEPS); ValueError for another
        self.watch = None
        url = p["health_url"] or "auto"
        if url == "auto":
            url = health_url_from_cmdline(_parent_cmdline())
        if url and url != "off":
            self.watch = ServerWatch(url, self.engine.shutdown, log=self._warn).start()
        self._warn(f"ReplaySSM streaming model: {kw['max_slots']} slots x {kw['max_seq_len']} tokens, mode {mode}, "
                   f"L = {kw['buffer_len']}, on {self.device}; prefix cache: {kw['prefix_cache_tokens'] or 'off'}; "
                   f"preemption: {'on' if kw['preempt'] else 'off'}; tokenizer: "
                   f"{type(self.tokenizer).__name__ if self.tokenizer is not None else 'none (token ids only)'}; "
                   f"numpy {self.bytes.np.__version__} ({'BYTES as numpy' if self.bytes.sound else 'BYTES shim'}); "
                   f"server watch: {url or 'off'}", info=True)

    # ---- helpers --------------------------------------------------------------------------------------------
    @staticmethod
    def _load_tokenizer(model_dir: str):
        if not model_dir or not any((pathlib.Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    @staticmethod
    def _eos_ids(model, tokenizer) -> tuple:
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        if eos is None:
            return ()
        return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))

    def _values(self, request, name: str):
        """The input's values as a flat list (DLPack, not numpy), or None when absent."""
        import torch

        t = self.pb.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        return torch.from_dlpack(t.to_dlpack()).reshape(-1).tolist()

    def _scalar(self, request, name: str, cast):
        v = self._values(request, name)
        if v is None:
            return None
        if len(v) != 1:
            raise RequestError(f"{name}: expected one value, got {len(v)}")
        return cast(v[0])

    def _out(self, name: str, values, dtype):
        import torch

        t = torch.tensor(values, dtype=dtype)
        return self.pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(t.contiguous()))

    def _prompt(self, request) -> list:
        ids = self._values(request, "input_ids")
        text = None
        t = self.pb.get_input_tensor_by_name(request, "text_input")
        if t is not None:
            items = self.bytes.read(t)
            if len(items) != 1:
                raise RequestError(f"text_input: expected one string, got {len(items)}")
            text = items[0].decode("utf-8", errors="strict")
        else:
            params = self._parameters(request)
            if "text_input" in params:
                text = params["text_input"]
                if not isinstance(text, str):
                    raise RequestError(f"text_input (request parameter): expected a string, got {type(text).__name__}")
        if (ids is None) == (text is None):
            raise RequestError("expected exactly one of input_ids (token ids) and text_input (text), got "
                               + ("both" if ids is not None else "neither"))
        if text is None:
            return ids
        if self.tokenizer is None:
            raise RequestError("text_input: this model has no tokenizer (its checkpoint directory has none): send "
                               "input_ids")
        return list(self.tokenizer(text)["input_ids"])

    @staticmethod
    def _parameters(request) -> dict:
        raw = request.parameters() if hasattr(request, "parameters") else "{}"
        return json.loads(raw or "{}") if isinstance(raw, str) else dict(raw or {})

    def _request(self, request, stream: _Stream) -> Request:
        stop = self._values(request, "stop_token_ids")
        streaming = self._parameters(request).get("stream", True)
        if not isinstance(streaming, bool):
            raise RequestError(f"stream (request parameter): expected true or false, got {streaming!r}")
        stream.streaming = streaming
        return Request(
            prompt=self._prompt(request),
            max_tokens=_or(self._scalar(request, "max_tokens", int), DEFAULT_MAX_TOKENS),
            temperature=_or(self._scalar(request, "temperature", float), 0.0),
            top_k=_or(self._scalar(request, "top_k", int), 0),
            top_p=_or(self._scalar(request, "top_p", float), 1.0),
            seed=self._scalar(request, "seed", int),
            stop_token_ids=self.eos if stop is None else tuple(int(s) for s in stop),
            on_output=lambda out: self._send(stream, out),
            is_cancelled=getattr(request, "is_cancelled", None))

    # ---- Triton entry points ----------------------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            stream = _Stream(sender, self.tokenizer)
            try:
                self.engine.submit(self._request(request, stream))
            except (RequestError, UnicodeDecodeError, ValueError) as e:
                sender.send(self._error(str(e)), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as e:  # never leave a stream without its final response
                sender.send(self._error(f"{type(e).__name__}: {e}"), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _send(self, stream: _Stream, out: Output) -> None:
        """One engine output -> one response (engine thread)."""
        import torch

        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        if out.finish_reason == "error":
            stream.sender.send(self._error(out.error or "generation failed"), flags=final)
            return
        stream.ids.extend(out.token_ids)
        stream.held.extend(out.token_ids)
        if not stream.streaming and not out.finished:
            return
        tensors = [self._out("output_ids", stream.held, torch.int64)]
        stream.held = []
        if stream.tokenizer is not None and self.bytes.text_out:
            tensors.append(self.bytes.tensor("text_output", [stream.text_delta(out.finished).encode("utf-8")]))
        if out.finished:
            if self.bytes.text_out:
                tensors.append(self.bytes.tensor("finish_reason", [out.finish_reason.encode()]))
            tensors += [self._out("prompt_tokens", [out.prompt_tokens], torch.int32),
                        self._out("completion_tokens", [out.completion_tokens], torch.int32)]
        stream.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=final)

    def finalize(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.engine.shutdown()


def _or(v, default):
    return default if v is None else v


def engine_parameters(p: dict) -> dict:
    """The Engine keywords of :data:`ENGINE_PARAMETERS` from the config.pbtxt parameters ``p`` (strings; empty or
    absent: the default); ValueError naming the parameter where one does not parse."""
    out = {}
    for k, (cast, default) in ENGINE_PARAMETERS.items():
        v = (p.get(k) or "").strip()
        if not v:
            out[k] = default
        elif cast is None:  # a boolean
            if v.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"config.pbtxt: parameters['{k}']: expected true or false, got {v!r}")
            out[k] = v.lower() in ("true", "1")
        else:
            try:
                out[k] = cast(v)
            except ValueError:
                raise ValueError(f"config.pbtxt: parameters['{k}']: expected an integer, got {v!r}") from None
    return out


# ---- the repository ---------------------------------------------------------------------------------------------
def text_input_route(route: str = "auto") -> str:
    """"tensor" (a BYTES ``text_input`` input in config.pbtxt) or "parameter" (none: the prompt text comes as the
    request parameter ``text_input``); "auto": the tensor where this interpreter's numpy (the stub's) is < 2."""
    if route not in TEXT_INPUT_ROUTES:
        raise RepoError(f"--text-input: expected one of {TEXT_INPUT_ROUTES}, got {route!r}")
    if route != "auto":
        return route
    import numpy

    return "tensor" if int(numpy.__version__.split(".")[0]) < 2 else "parameter"


def generate_model_config(name: str, *, device: str, max_slots: int, max_seq_len: int, buffer_len: int, mode: str,
                          params: dict, text_input: str = "tensor", prefix_cache_tokens: int = 0, prefix_block: int = 16,
                          preempt: bool = False, preempt_quantum: int = 16, max_swapped_bytes: int | None = None):
    """Triton ``ModelConfig`` of the decoupled generation model (module docstring)."""
    pb = _pb()
    if device not in ("cpu", "cuda"):
        raise RepoError(f"--device: expected cpu or cuda (auto is resolved before), got {device!r}")
    if mode not in MODES:
        raise RepoError(f"--mode: expected one of {MODES}, got {mode!r}")
    _check_ranges(("max-slots", max_slots, 1, 4096), ("max-seq-len", max_seq_len, 2, 1 << 20),
                  ("buffer-len", buffer_len, 1, 32), ("prefix-cache-tokens", prefix_cache_tokens, 0, 1 << 40),
                  ("prefix-block", prefix_block, 1, 1 << 20), ("preempt-quantum", preempt_quantum, 1, 1 << 30),
                  *((("max-swapped-bytes", max_swapped_bytes, 0, 1 << 50),) if max_swapped_bytes is not None else ()))
    if not isinstance(preempt, bool):
        raise RepoError(f"--preempt: expected true or false, got {preempt!r}")
    mc = pb.ModelConfig(name=name, backend="python", max_batch_size=0)
    mc.model_transaction_policy.decoupled = True
    for n, t, dims in INPUTS:
        if n == "text_input" and text_input != "tensor":
            continue
        mc.input.add(name=n, data_type=getattr(pb, t), dims=dims, optional=True)
    for n, t, dims in OUTPUTS:
        mc.output.add(name=n, data_type=getattr(pb, t), dims=dims)
    kind = pb.ModelInstanceGroup.KIND_GPU if device == "cuda" else pb.ModelInstanceGroup.KIND_CPU
    mc.instance_group.add(kind=kind, count=1)  # one engine owns the slots
    full = dict(params, device=device, max_slots=max_slots, max_seq_len=max_seq_len, buffer_len=buffer_len, mode=mode,
                text_input=text_input, prefix_cache_tokens=prefix_cache_tokens, prefix_block=prefix_block,
                preempt=str(preempt).lower(), preempt_quantum=preempt_quantum,
                max_swapped_bytes="" if max_swapped_bytes is None else max_swapped_bytes)
    for k, v in full.items():
        mc.parameters[k].string_value = str(v)
    return mc


SHADOW_MODES = ("replay_bf16", "replay_fp8")  # the modes --shadow also names (scripts/make_triton_repo.py)


def _model_type(model_dir: pathlib.Path):
    return json.loads((model_dir / "config.json").read_text()).get("model_type")  # read and checked by _vocab


def make_generate_repo(repo: pathlib.Path, name: str | None = None, *, tiny: str = models.DEFAULT_TINY,
                       model_dir: pathlib.Path | None = None, dtype: str = "fp32", seed: int = 0, device: str = "auto",
                       max_slots: int = 8, max_seq_len: int = 1024, buffer_len: int = 16, mode: str = "replay",
                       text_input: str = "auto", health_url: str = "auto", prefix_cache_tokens: int = 0,
                       prefix_block: int = 16, preempt: bool = False, preempt_quantum: int = 16,
                       max_swapped_bytes: int | None = None) -> pathlib.Path:
    """Write REPO/NAME/{config.pbtxt, 1/model.py} of the streaming model; returns REPO/NAME. Refused before a file is
    written, naming the flag: a bad --dtype, --device cuda without CUDA, a --mode outside MODES or one the model
    kind's family keeps no state for (``ModelKind.refusal``: replay_fp8 for a Gated DeltaNet model, ...), a bad
    --tiny, a checkpoint the server's loader or decode step refuses, an engine option out of range
    (--prefix-cache-tokens, --prefix-block, --preempt-quantum, --max-swapped-bytes)."""
    dtype, device = check_dtype_device(dtype, device)
    if mode not in MODES:
        raise RepoError(f"--mode: expected one of {MODES}, got {mode!r}")
    _vocab(tiny, model_dir)  # the checkpoint's config.json or the tiny name, checked
    kind = models.by_model_type(_model_type(model_dir)) if model_dir is not None else models.by_tiny(tiny)
    why = kind.refusal(mode)
    if why:
        flag = f" (--shadow {mode.removeprefix('replay_')})" if mode in SHADOW_MODES else ""
        raise RepoError(f"--mode {mode}{flag}: {why}")
    route = text_input_route(text_input)
    name = name or default_name(tiny=tiny, model_dir=model_dir)
    _check_target(repo, name)
    params = dict(model_dir="" if model_dir is None else str(model_dir.resolve()), tiny="" if model_dir else tiny,
                  seed=seed, dtype=CONFIG_DTYPES[dtype], health_url=health_url,
                  python_path=os.pathsep.join(python_paths()), python_version=_py_version(),
                  python_libdir=sysconfig.get_config_var("LIBDIR") or "")
    text = config_text(generate_model_config(name, device=device, max_slots=max_slots, max_seq_len=max_seq_len,
                                             buffer_len=buffer_len, mode=mode, params=params, text_input=route,
                                             prefix_cache_tokens=prefix_cache_tokens, prefix_block=prefix_block,
                                             preempt=preempt, preempt_quantum=preempt_quantum,
                                             max_swapped_bytes=max_swapped_bytes))
    if model_dir is not None:
        check_model(model_dir, dtype, buffer_len=buffer_len, mode=mode)
    return _write_model(repo, name, {"config.pbtxt": text, "1/model.py": MODEL_PY})
