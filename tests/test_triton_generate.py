# SPDX-License-Identifier: Apache-2.0
"""The streaming (decoupled) Triton model of builders/triton_generate.py, served by the real tritonserver 2.51 that
nvidia-pytriton 0.7.0 bundles (Python backend, CPU), driven through tritonclient gRPC streams and the HTTP
generate_stream endpoint; and its parts in process.

One server for the module (:func:`_serve`: random free ports on 127.0.0.1, readiness bounded, stopped by its PID),
two models in its repository: the tiny Nemotron-H (seed 0) saved as a checkpoint directory with a byte-level
tokenizer of its 256 tokens (so text goes in and out), ``SLOTS`` = 2 slots of ``MAX_SEQ`` tokens, ReplaySSM with
L = 4; and the embedded tiny Qwen3-Next (seed 0: Gated DeltaNet layers, gated attention, sparse MoE; builders/
qwen_step.py's step) with the same slots and mode. Oracle: transformers' own ``generate(do_sample=False)`` on the
same weights, token for token. The last test stops the server with SIGTERM while a stream is open.
"""

import contextlib
import importlib.util
import inspect
import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton is not installed (pip install --no-deps nvidia-pytriton==0.7.0: its tritonserver)",
                allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is not installed")

import numpy as np  # noqa: E402  (tritonclient's own dependency)

from builders import triton_generate as tg  # noqa: E402
from builders import triton_repo as tr  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = "nemotron_h_replayssm"  # the default name of a nemotron_h checkpoint's repository (the README's too)
QWEN = "qwen3_next_replayssm"  # the default name of the tiny Qwen3-Next's repository
SLOTS, MAX_SEQ, L = 2, 4096, 4
LONG = 4000  # tokens: tens of seconds of decode here, far longer than any test waits
RESPONSE_S = 60
STARTUP_S = 180  # two stubs import torch + transformers and build their models (~7 s each here)


# ---- the server -----------------------------------------------------------------------------------------------------
def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def _serve(tmp, repo, models, **serve_kw):
    """The wheel's tritonserver on ``repo`` (scripts/make_triton_repo.py's serve command: serve_command), on free
    ports of 127.0.0.1, until every model in ``models`` is ready; yields (url, tail of its log, the process). Stopped
    by its PID (SIGTERM, then SIGKILL after 30 s) on the way out, also when the body fails."""
    backends = tr.write_backend_dir(tmp / "backends")
    grpc_port, http_port, metrics_port = _free_ports(3)
    argv, env = tr.serve_command(repo, backends, grpc_port, http_port, metrics_port, **serve_kw)
    log = open(tmp / "tritonserver.log", "wb")
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    url = f"127.0.0.1:{grpc_port}"

    def tail():
        log.flush()
        return (tmp / "tritonserver.log").read_text(errors="replace")[-4000:]

    try:
        client = grpcclient.InferenceServerClient(url)
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tritonserver exited with {proc.returncode} during startup:\n{tail()}")
            try:
                if client.is_server_ready() and all(client.is_model_ready(m) for m in models):
                    break
            except Exception:  # not listening yet
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tritonserver not ready after {STARTUP_S} s:\n{tail()}")
            time.sleep(0.2)
        client.close()
        yield url, tail, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # graceful: unloads the models, stops their stubs
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        log.close()


# ---- fixtures -----------------------------------------------------------------------------------------------
def _byte_tokenizer():
    """A byte-level BPE tokenizer without merges: its 256 tokens are the 256 bytes (the tiny model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from builders.nemotron_h import load_nemotron_h

    d = tmp_path_factory.mktemp("ckpt")
    load_nemotron_h(tiny="nemotron_h", seed=0).save_pretrained(d)
    _byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def ref(ckpt):
    """(model, tokenizer, greedy(prompt, n)) of the checkpoint, in transformers."""
    from transformers import AutoTokenizer

    from builders.nemotron_h import load_nemotron_h

    model = load_nemotron_h(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)

    @torch.no_grad()
    def greedy(prompt, n):
        ids = torch.tensor([prompt])  # the mask given: generate would take token 0 (pad_token_id) for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
        return out[0, len(prompt):].tolist()

    return model, tok, greedy


@pytest.fixture(scope="module")
def server(tmp_path_factory, ckpt):
    tmp = tmp_path_factory.mktemp("triton_gen")
    tg.make_generate_repo(tmp / "repo", model_dir=ckpt, device="cpu", max_slots=SLOTS, max_seq_len=MAX_SEQ,
                          buffer_len=L, mode="replay")
    tg.make_generate_repo(tmp / "repo", tiny="qwen3_next", device="cpu", max_slots=SLOTS, max_seq_len=MAX_SEQ,
                          buffer_len=L, mode="replay")
    with _serve(tmp, tmp / "repo", (NAME, QWEN)) as (url, tail, proc):
        http = next(int(a.split("=", 1)[1]) for a in proc.args if a.startswith("--http-port="))
        yield dict(url=url, http=f"http://127.0.0.1:{http}", tail=tail, proc=proc)


# ---- a client ---------------------------------------------------------------------------------------------------
def _inputs(prompt=None, **scalars):
    """InferInputs of a request: ``prompt`` token ids, scalar fields by name, ``stop_token_ids`` a list."""
    types = {"max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_k": ("INT32", np.int32),
             "top_p": ("FP32", np.float32), "seed": ("INT64", np.int64), "stop_token_ids": ("INT64", np.int64)}
    out = []
    if prompt is not None:
        i = grpcclient.InferInput("input_ids", [len(prompt)], "INT64")
        i.set_data_from_numpy(np.array(prompt, dtype=np.int64))
        out.append(i)
    for k, v in scalars.items():
        t, dt = types[k]
        arr = np.array(v if isinstance(v, list) else [v], dtype=dt)
        i = grpcclient.InferInput(k, list(arr.shape), t)
        i.set_data_from_numpy(arr)
        out.append(i)
    return out


class Stream:
    """One request on its own gRPC stream; ``wait()`` collects every response: ``tokens`` (per response),
    ``text``, ``final`` (finish_reason, prompt_tokens, completion_tokens) or ``error``, and when each came."""

    def __init__(self, url, inputs, parameters=None, model=NAME):
        self.client = grpcclient.InferenceServerClient(url)
        self.q = queue.Queue()
        self.tokens, self.text, self.times, self.final, self.error = [], "", [], None, None
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error, time.monotonic())))
        self.client.async_stream_infer(model, inputs, parameters=parameters, enable_empty_final_response=True)

    @property
    def ids(self):
        return [t for r in self.tokens for t in r]

    def next(self, timeout=RESPONSE_S) -> bool:
        """Take one response; True once the stream has ended."""
        result, error, t = self.q.get(timeout=timeout)
        self.times.append(t)
        if error is not None:
            self.error = error
            return True
        self.tokens.append(result.as_numpy("output_ids").tolist())
        text = result.as_numpy("text_output")
        if text is not None:
            self.text += text[0].decode()
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.final = (result.as_numpy("finish_reason")[0].decode(), int(result.as_numpy("prompt_tokens")[0]),
                          int(result.as_numpy("completion_tokens")[0]))
            return True
        return False

    def wait(self, timeout=RESPONSE_S):
        deadline = time.monotonic() + timeout
        while not self.next(max(0.1, deadline - time.monotonic())):
            pass
        return self

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _run(url, inputs, parameters=None):
    s = Stream(url, inputs, parameters)
    try:
        return s.wait()
    finally:
        s.close()


def run_streams(streams, server) -> None:
    """Wait for every stream (each closed, also on failure), then none may have ended in an error."""
    try:
        for s in streams:
            s.wait()
    finally:
        for s in streams:
            s.close()
    for s in streams:
        assert s.error is None, f"{s.error}\n{server['tail']()}"


# ---- against the real server --------------------------------------------------------------------------------------
def test_concurrent_greedy_streams_match_transformers_and_queue(server, ref):
    """N = 4 greedy streams at once on 2 slots: each streams one token per response and equals transformers'
    generate token for token; the two that found no slot waited (their first token came after a final response of
    another stream) and then completed."""
    *_, greedy = ref
    gen = torch.Generator().manual_seed(3)
    jobs = [(torch.randint(0, 256, (3 + 2 * k,), generator=gen).tolist(), n) for k, n in enumerate((20, 24, 28, 32))]
    streams = [Stream(server["url"], _inputs(p, max_tokens=n)) for p, n in jobs]
    run_streams(streams, server)
    for s, (p, n) in zip(streams, jobs):
        assert s.ids == greedy(p, n), (p, n)
        assert s.final == ("length", len(p), n)
        assert all(len(r) == 1 for r in s.tokens)  # streamed: one new token per response
    first_final = min(s.times[-1] for s in streams)
    assert sum(s.times[0] < first_final for s in streams) <= SLOTS  # the others waited in the queue


def test_sampled_stream_is_reproducible_by_seed(server, ref):
    """temperature / top_k / top_p with a seed: the same tokens twice; another seed, other tokens."""
    *_, greedy = ref
    prompt = [11, 22, 33, 44]
    kw = dict(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95)
    a = _run(server["url"], _inputs(prompt, seed=1234, **kw))
    b = _run(server["url"], _inputs(prompt, seed=1234, **kw))
    c = _run(server["url"], _inputs(prompt, seed=99, **kw))
    assert a.error is None and a.final == ("length", 4, 16)
    assert a.ids == b.ids and a.ids != c.ids and a.ids != greedy(prompt, 16)


def test_stop_token_ends_the_stream(server, ref):
    """A stop token ends the stream with finish_reason "stop", the stop token emitted last."""
    *_, greedy = ref
    prompt = [7, 8, 9]
    want = greedy(prompt, 12)
    k = next(i for i in range(2, 12) if want[i] not in want[:i])  # its first occurrence
    s = _run(server["url"], _inputs(prompt, max_tokens=12, stop_token_ids=[want[k]]))
    assert s.ids == want[:k + 1] and s.final == ("stop", 3, k + 1)


def test_bad_requests_get_a_clear_error_before_any_work(server):
    """prompt + max_tokens past max_seq_len, a token outside the vocabulary, neither or both of input_ids and
    text_input: one final error response each, no tokens."""
    url = server["url"]
    cases = [(_inputs([1, 2, 3], max_tokens=MAX_SEQ - 2), None, "exceed the KV capacity of 4096"),
             (_inputs([1, 999]), None, "prompt: token ids must be ints in 0..255"),
             (_inputs(None, max_tokens=4), None, "neither"),
             (_inputs([1, 2]), {"text_input": "hi"}, "both"),
             (_inputs([1, 2], top_p=0.0), None, "top_p")]
    for inputs, params, needle in cases:
        s = _run(url, inputs, params)
        assert s.error is not None and needle in str(s.error), (needle, s.error)
        assert s.ids == [] and s.final is None


def test_text_in_and_out(server, ref):
    """A text prompt (gRPC: the request parameter text_input, or the BYTES tensor where the stub reads BYTES) is
    tokenized by the checkpoint's tokenizer; text_output streams the completion's text: its pieces join to the
    decoded tokens, a multi-byte character never split."""
    _, tok, greedy = ref
    text = "héllo wörld, ça va?"
    prompt = tok(text)["input_ids"]
    if tg.text_input_route() == "tensor":
        t = grpcclient.InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(np.array([text.encode()], dtype=object))
        s = _run(server["url"], [t, *_inputs(None, max_tokens=24)])
    else:
        s = _run(server["url"], _inputs(None, max_tokens=24), {"text_input": text})
    assert s.error is None, s.error
    assert s.ids == greedy(prompt, 24) and s.final == ("length", len(prompt), 24)
    assert s.text == tok.decode(s.ids)


def test_http_generate_stream(server, ref):
    """Triton's HTTP generate_stream extension: JSON fields onto the inputs (text_input as a tensor or, where the
    repository declares none, as a request parameter), server-sent events back; generate with "stream": false."""
    _, tok, greedy = ref
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def post(path, body):
        req = urllib.request.Request(f"{server['http']}/v2/models/{NAME}/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with opener.open(req, timeout=RESPONSE_S) as r:
            return r.read().decode()

    def flat(v):
        return v if isinstance(v, list) else [v]

    prompt = [5, 6, 7, 8]
    events = [json.loads(line[len("data: "):]) for line in post("generate_stream", {"input_ids": prompt,
                                                                                    "max_tokens": 6}).splitlines()
              if line.startswith("data: ")]
    assert [t for e in events for t in flat(e["output_ids"])] == greedy(prompt, 6)
    assert len(events) == 6 and events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 6
    events = [json.loads(line[len("data: "):]) for line in post("generate_stream", {"text_input": "abc",
                                                                                    "max_tokens": 5}).splitlines()
              if line.startswith("data: ")]
    ids = [t for e in events for t in flat(e["output_ids"])]
    assert ids == greedy(tok("abc")["input_ids"], 5) and "".join(e["text_output"] for e in events) == tok.decode(ids)
    one = json.loads(post("generate", {"input_ids": prompt, "max_tokens": 6, "stream": False}))
    assert flat(one["output_ids"]) == greedy(prompt, 6) and one["finish_reason"] == "length"


_CLIENT = """
import queue, sys, time, numpy as np, tritonclient.grpc as g
c = g.InferenceServerClient(sys.argv[1]); q = queue.Queue()
c.start_stream(callback=lambda result, error: q.put((result, error)))
i = g.InferInput("input_ids", [3], "INT64"); i.set_data_from_numpy(np.array([5, 6, 7]))
m = g.InferInput("max_tokens", [1], "INT32"); m.set_data_from_numpy(np.array([int(sys.argv[2])], dtype=np.int32))
c.async_stream_infer(sys.argv[3], [i, m])
q.get(timeout=60); print("first", flush=True); time.sleep(120)
"""


def test_cancelled_and_disconnected_streams_free_their_slots(server):
    """Both slots hold a long stream: one client cancels its stream (stop_stream(cancel_requests=True)), the other's
    process is killed (a client that went away). Both slots are free at the next steps: SLOTS short streams then
    complete at once, long before the long ones could have ended."""
    url = server["url"]
    gone = subprocess.Popen([sys.executable, "-c", _CLIENT, url, str(LONG), NAME], stdout=subprocess.PIPE, text=True)
    try:
        assert gone.stdout.readline().strip() == "first"
        kept = Stream(url, _inputs([5, 6, 7], max_tokens=LONG))
        assert not kept.next()
        t0 = time.monotonic()
        kept.close(cancel=True)
    finally:
        gone.kill()
        gone.wait()
    streams = [Stream(url, _inputs([9, 9, k], max_tokens=8)) for k in range(SLOTS)]
    try:
        for s in streams:
            s.wait(timeout=20)
    finally:
        for s in streams:
            s.close()
    assert all(s.final == ("length", 3, 8) for s in streams), [(s.final, s.error) for s in streams]
    assert time.monotonic() - t0 < 15  # a long stream needs tens of seconds (LONG tokens)


def _readme_snippet() -> str:
    md = (ROOT / "README.md").read_text()
    section = md[md.index("## Serving (Triton)"):]
    section = section[:section.index("\n## ", 3)]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_client_example_runs(server, ref):
    """The README's gRPC streaming snippet, as written (its server address pointed at this server): the greedy
    tokens of the tiny model, one response each, then the finish reason."""
    *_, greedy = ref
    code = _readme_snippet()
    assert "127.0.0.1:8001" in code and f'"{NAME}"' in code
    try:
        out = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:8001", server["url"])], capture_output=True,
                             text=True, timeout=RESPONSE_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the README client hung: {e.stdout!r}\n{server['tail']()}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    prompt = json.loads(re.search(r"np\.array\((\[[0-9, ]+\])", code).group(1))
    n = int(re.search(r"np\.array\(\[(\d+)\], dtype=np\.int32\)", code).group(1))
    assert [t for line in lines[:-1] for t in json.loads(line)] == greedy(prompt, n)
    assert lines[-1] == "finish_reason: length"


def test_qwen_streams_match_transformers(server):
    """The tiny Qwen3-Next through the same streaming model (its Gated DeltaNet layers on the engine's ReplaySSM GDN
    step, gated attention with RoPE, sparse MoE): three greedy streams at once on 2 slots (one waits, then takes a
    freed slot; two are prefilled together, left-padded) each equal transformers' generate token for token."""
    from builders.qwen3_next import tiny_model

    model = tiny_model("qwen3_next", seed=0)  # the weights the server's model.py builds
    gen = torch.Generator().manual_seed(5)
    jobs = [(torch.randint(0, 256, (2 + 3 * k,), generator=gen).tolist(), n) for k, n in enumerate((14, 9, 17))]
    streams = [Stream(server["url"], _inputs(p, max_tokens=n), model=QWEN) for p, n in jobs]
    run_streams(streams, server)
    for s, (p, n) in zip(streams, jobs):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(p):].tolist()
        assert s.ids == want and s.final == ("length", len(p), n), (p, n)
        assert all(len(r) == 1 for r in s.tokens)


def test_shutdown_with_an_open_stream_is_prompt(server):
    """SIGTERM while a stream is generating (runs last: it stops the module's server): the stream ends with an
    error within a few seconds, and once its client closes it the server exits, well before tritonserver's exit
    timeout (the engine would otherwise keep generating and the server wait for it)."""
    s = Stream(server["url"], _inputs([1, 2, 3], max_tokens=LONG))
    try:
        assert not s.next()
        t0 = time.monotonic()
        server["proc"].send_signal(signal.SIGTERM)
        while not s.next(timeout=10):
            pass
        t_err = time.monotonic() - t0
    finally:
        s.close()
    assert s.error is not None and "shutting down" in str(s.error), (s.error, s.final)
    server["proc"].wait(timeout=25)
    t_exit = time.monotonic() - t0
    assert t_err < 5 and t_exit < 20, (t_err, t_exit, server["tail"]())


# ---- in process ---------------------------------------------------------------------------------------------------
def test_health_url_of_a_tritonserver_command_line():
    assert tg.health_url_from_cmdline(["/x/bin/tritonserver", "--model-repository=r", "--http-port=8123",
                                       "--http-address=127.0.0.1"]) == "http://127.0.0.1:8123/v2/health/live"
    assert tg.health_url_from_cmdline(["tritonserver", "--http-port", "9"]) == "http://127.0.0.1:9/v2/health/live"
    assert tg.health_url_from_cmdline(["tritonserver", "--http-address=::"]) == "http://[::1]:8000/v2/health/live"
    assert tg.health_url_from_cmdline(["tritonserver", "--allow-http=false"]) is None
    assert tg.health_url_from_cmdline(["python", "serve.py"]) is None


def test_server_watch_fires_once_after_live_then_down():
    w = tg.ServerWatch("http://127.0.0.1:1/v2/health/live", lambda: None)
    assert [w.check(v) for v in (False, None, False)] == [False, False, False]  # never seen live: the server starts
    assert [w.check(v) for v in (True, False, None)] == [False, False, False]  # one refusal, then no answer
    assert w.check(False)  # two in a row after live
    assert w.probe() is False  # nothing listens on port 1: refused


def test_text_delta_holds_back_an_incomplete_character():
    tok = _byte_tokenizer()
    ids = tok("aé€")["input_ids"]  # 1 + 2 + 3 bytes
    s = tg._Stream(None, tok)
    got = []
    for k, t in enumerate(ids):
        s.ids.append(t)
        got.append(s.text_delta(final=k == len(ids) - 1))
    assert got == ["a", "", "é", "", "", "€"] and "".join(got) == "aé€"


def test_repository_config(tmp_path):
    """config.pbtxt: decoupled, no batching dimension, the inputs (text_input per route) and outputs, the
    parameters model.py reads; a Qwen model or a bad mode is refused naming the flag, nothing written."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    for route in ("tensor", "parameter"):
        target = tg.make_generate_repo(tmp_path / route, device="cpu", max_slots=3, max_seq_len=64, mode="replay_bf16",
                                       text_input=route)
        mc = text_format.Parse((target / "config.pbtxt").read_text(), pb.ModelConfig())
        assert mc.model_transaction_policy.decoupled and mc.max_batch_size == 0
        names = [i.name for i in mc.input]
        assert ("text_input" in names) == (route == "tensor") and all(i.optional for i in mc.input)
        assert [o.name for o in mc.output] == [o[0] for o in tg.OUTPUTS]
        p = {k: v.string_value for k, v in mc.parameters.items()}
        assert (p["mode"], p["max_slots"], p["max_seq_len"], p["tiny"], p["dtype"]) == ("replay_bf16", "3", "64",
                                                                                       "nemotron_h", "float32")
        assert "GenerateModel" in (target / "1" / "model.py").read_text()
    for tiny in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # every family streams; Gated DeltaNet has no fp8 shadow
        target = tg.make_generate_repo(tmp_path / "q", tiny=tiny, device="cpu", mode="conventional")
        mc = text_format.Parse((target / "config.pbtxt").read_text(), pb.ModelConfig())
        assert target.name == f"{tiny}_replayssm" and mc.model_transaction_policy.decoupled
        assert mc.parameters["mode"].string_value == "conventional" and mc.parameters["tiny"].string_value == tiny
    with pytest.raises(tg.RepoError, match="--mode replay_fp8 .*there is no fp8 GDN shadow"):
        tg.make_generate_repo(tmp_path / "f", tiny="qwen3_5", device="cpu", mode="replay_fp8")
    with pytest.raises(tg.RepoError, match="--mode: expected one of"):
        tg.make_generate_repo(tmp_path / "m", device="cpu", mode="shadow")
    assert not (tmp_path / "f").exists() and not (tmp_path / "m").exists()


@pytest.mark.parametrize("kw, match", [
    (dict(buffer_len=0), "--buffer-len: expected 1..32"),
    (dict(buffer_len=33), "--buffer-len: expected 1..32"),
    (dict(max_slots=0), "--max-slots"),
    (dict(max_seq_len=1), "--max-seq-len"),
    (dict(dtype="int8"), "--dtype"),
    (dict(tiny="nope"), "--tiny: expected one of"),
    (dict(model_dir=pathlib.Path("/nonexistent")), "--model: expected a checkpoint directory"),
    (dict(text_input="bytes"), "--text-input: expected one of"),
])
def test_repository_rejects_bad_options(tmp_path, kw, match):
    with pytest.raises(tg.RepoError, match=match):
        tg.make_generate_repo(tmp_path / "r", "m", **{"device": "cpu", **kw})
    assert not (tmp_path / "r" / "m").exists()


def test_model_py_puts_the_project_first_and_refuses_another_python(tmp_path):
    """The generated model.py: the stub ignores PYTHONPATH, so it puts parameters['python_path'] first on sys.path
    (the project root leads) and refuses a repository built for another Python version, naming the fix."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    target = tg.make_generate_repo(tmp_path / "r", "m", device="cpu")
    mc = text_format.Parse((target / "config.pbtxt").read_text(), pb.ModelConfig())
    assert mc.parameters["python_path"].string_value.split(os.pathsep)[0] == str(ROOT)
    assert (target / "1" / "model.py").read_text() == tr.MODEL_PY
    ns = {}
    exec(compile(tr.MODEL_PY, "model.py", "exec"), ns)
    cfg = {"parameters": {"python_version": {"string_value": "2.7"}, "python_libdir": {"string_value": "/x/lib"}}}
    with pytest.raises(RuntimeError, match="built with Python 2.7.*LD_LIBRARY_PATH=/x/lib"):
        ns["_setup_path"](cfg)


def test_the_cli_modes_are_the_engines():
    from builders.generation import MODES

    spec = importlib.util.spec_from_file_location("make_triton_repo", ROOT / "scripts" / "make_triton_repo.py")
    mtr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mtr)
    assert mtr.MODES == MODES and set(mtr.SHADOW_MODE.values()) <= set(MODES)
    sig = inspect.signature(tg.make_generate_repo).parameters  # the CLI's defaults are the writer's
    assert {k: sig[k].default for k in mtr.PY_DEFAULTS} == mtr.PY_DEFAULTS
    assert set(mtr.PYTHON_ONLY.values()) <= set(sig)



def test_engine_slot_reused_after_a_padding_row_matches_generate():
    """builders/generation.py: a slot left free while another ran (a padding row, which writes NaN K/V past any
    prompt) and then taken by a new sequence gave that sequence garbage from its second token on (masked NaN
    positions in the unfused attention); the row's K/V past the prompt is now zeroed at admission."""
    from builders.generation import Engine, Request
    from builders.nemotron_h import load_nemotron_h

    model = load_nemotron_h(tiny="nemotron_h", seed=0)
    eng = Engine(model, max_slots=2, max_seq_len=64, mode="conventional", buffer_len=4)
    for p, n in (([1, 2, 3], 5), ([4, 5, 6, 7], 9)):  # slot 0 ends first: padding for the rest of slot 1's run
        eng.submit(Request(prompt=p, max_tokens=n))
    eng.run_until_idle()
    out = []
    eng.submit(Request(prompt=[7, 8, 9], max_tokens=8, on_output=out.append))
    eng.run_until_idle()
    ids = torch.tensor([[7, 8, 9]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)[0, 3:]
    assert [t for o in out for t in o.token_ids] == want.tolist()


class _FakePb:
    """A stand-in of ``triton_python_backend_utils`` that behaves as the 2.51 stub does around numpy: ``broken``
    reads a numpy array's item size where pybind11 2.10 does (4 bytes at offset 32 of the dtype: numpy 2's flags),
    so a uint8 tensor from DLPack reads back as its first byte repeated and a BYTES output takes that many bytes
    per item; BYTES inputs go through ``deserialize_bytes_tensor`` of this module (which the model may replace)."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self, broken: bool):
        import ctypes

        pb = self

        def pybind_nbytes(arr):
            size = ctypes.c_int32.from_address(id(arr.dtype) + 32).value if broken else arr.dtype.itemsize
            return arr.size * size

        class Tensor:
            def __init__(self, name, arr, raw=None):
                self._name, self.arr = name, arr
                if arr.dtype == object:  # BYTES: serialized through the module's function, sized as pybind does
                    ser = pb.serialize_byte_tensor(arr)
                    ser = ser if isinstance(ser, np.ndarray) else np.frombuffer(ser, dtype=np.uint8)
                    self.raw = ser.tobytes()[:pybind_nbytes(ser)]
                else:
                    self.raw = raw

            @classmethod
            def from_dlpack(cls, name, capsule):
                t = torch.from_dlpack(capsule).clone()
                return cls(name, t.numpy(), raw=t)

            def to_dlpack(self):
                return torch.utils.dlpack.to_dlpack(self.raw)

            def as_numpy(self):
                if self.arr.dtype == np.uint8 and broken:
                    return np.full_like(self.arr, self.arr.reshape(-1)[0])
                return self.arr

            def name(self):
                return self._name

        self.Tensor = Tensor
        self.Logger = type("L", (), {"log_info": staticmethod(lambda m: None), "log_warn": staticmethod(lambda m: None)})
        self.serialize_byte_tensor = lambda arr: b"".join(len(b).to_bytes(4, "little") + b for b in arr.reshape(-1))
        self.deserialize_bytes_tensor = None  # the stub's own would die on a misread input: the model replaces it

    class TritonError:
        INVALID_ARG = 3

        def __init__(self, msg, code=None):
            self.msg = msg

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.outputs, self.error = {t.name(): t for t in output_tensors}, error

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)


class _FakeRequest:
    def __init__(self, pb, inputs: dict, params=None, text=None):
        self.inputs = {k: pb.Tensor.from_dlpack(k, torch.utils.dlpack.to_dlpack(torch.tensor(v, dtype=torch.int32
                       if k in ("max_tokens", "top_k") else torch.int64 if k != "temperature" else torch.float32)))
                       for k, v in inputs.items()}
        if text is not None:  # as the stub loads a BYTES input: deserialize_bytes_tensor of its bytes
            raw = len(text).to_bytes(4, "little") + text
            self.inputs["text_input"] = pb.Tensor("text_input", pb.deserialize_bytes_tensor(
                np.frombuffer(raw[:1] * len(raw), dtype=np.uint8)))  # what 2.51 hands it: the first byte repeated
        self.params, self.responses, self.done = json.dumps(params or {}), [], __import__("threading").Event()

    def parameters(self):
        return self.params

    def is_cancelled(self):
        return False

    def get_response_sender(self):
        req = self

        class Sender:
            def send(self, response=None, flags=0):
                req.responses.append((response, flags))
                if flags:
                    req.done.set()
        return Sender()


@pytest.mark.parametrize("broken", [False, True], ids=["sound-stub", "numpy2-stub"])
def test_model_in_process_with_a_stand_in_stub(broken, ckpt, ref):
    """GenerateModel under a stand-in stub, sound and numpy-2-broken: token ids and text stream out (BYTES through
    the shim where the stub is broken: without it each text item would be cut to the misread size), the final
    response carries finish_reason and counts; a BYTES text_input the broken stub cannot read, and a bad request, get
    one final error each."""
    model, tok, greedy = ref
    pb = _FakePb(broken)
    cfg = {"parameters": {k: {"string_value": v} for k, v in dict(device="cpu", max_slots="2", max_seq_len="64",
                                                                    buffer_len="4", mode="replay",
                                                                    health_url="off").items()}}
    gm = tg.GenerateModel(pb, {"model_config": json.dumps(cfg)}, model=model, tokenizer=tok)
    try:
        assert gm.bytes.sound == (not broken) and gm.bytes.text_out
        text = "naïve café"
        good = _FakeRequest(pb, {"max_tokens": [10]}, params={"text_input": text})
        bad = _FakeRequest(pb, {"input_ids": [1, 2], "max_tokens": [70]})
        gm.execute([good, bad])
        for r in (good, bad):
            assert r.done.wait(30)
        prompt = tok(text)["input_ids"]
        ids = [t for resp, _ in good.responses for t in resp.outputs["output_ids"].raw.tolist()]
        pieces = [resp.outputs["text_output"].raw for resp, _ in good.responses]
        assert ids == greedy(prompt, 10) and len(good.responses) == 10 and good.responses[-1][1] == 1
        joined = b"".join(p[4:] for p in pieces).decode()  # each piece: 4-byte length, the bytes
        assert joined == tok.decode(ids) and all(int.from_bytes(p[:4], "little") == len(p) - 4 for p in pieces)
        last = good.responses[-1][0].outputs
        assert last["finish_reason"].raw == b"\x06\x00\x00\x00length" and last["completion_tokens"].raw.tolist() == [10]
        assert len(bad.responses) == 1 and "KV capacity" in bad.responses[0][0].error.msg
        if broken:
            t = _FakeRequest(pb, {"max_tokens": [4]}, text=b"hello")
            gm.execute([t])
            assert t.done.wait(5) and "send the prompt as the request parameter 'text_input'" in t.responses[0][0].error.msg
    finally:
        gm.finalize()


def test_qwen_model_in_process(tmp_path):
    """GenerateModel over the tiny Qwen3.5 MoE (loaded from the repository's parameters as the server's model.py
    loads it) under the stand-in stub: two requests on one slot stream transformers' greedy tokens in the
    conventional mode; a repository asking for the fp8 shadow of a Gated DeltaNet model fails at load, naming it."""
    from builders.qwen3_next import tiny_model

    pb = _FakePb(False)

    def args(mode):
        p = dict(tiny="qwen3_5_moe", seed="0", dtype="float32", device="cpu", max_slots="1", max_seq_len="64",
                 buffer_len="4", mode=mode, health_url="off")
        return {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in p.items()}})}

    gm = tg.GenerateModel(pb, args("conventional"))
    try:
        assert type(gm.engine.step).__name__ == "QwenStep" and gm.tokenizer is None
        jobs = [([3, 1, 4, 1, 5], 9), ([9, 2, 6], 6)]
        reqs = [_FakeRequest(pb, {"input_ids": p, "max_tokens": [n]}) for p, n in jobs]
        gm.execute(reqs)
        model = tiny_model("qwen3_5_moe", seed=0)
        for r, (p, n) in zip(reqs, jobs):
            assert r.done.wait(60)
            ids = [t for resp, _ in r.responses for t in resp.outputs["output_ids"].raw.tolist()]
            want = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(p):].tolist()
            assert ids == want and r.responses[-1][0].outputs["completion_tokens"].raw.tolist() == [n]
    finally:
        gm.finalize()
    with pytest.raises(ValueError, match="no fp8 GDN shadow"):
        tg.GenerateModel(pb, args("replay_fp8"))


def test_kimi_linear_model_in_process():
    """GenerateModel over the tiny Kimi-Linear (builders/kda.py; handed in as a loaded model) under the stand-in stub:
    the engine's KDA step (builders/kimi_step.py ``KimiStep``), two
    requests on one slot (one waits) stream transformers' greedy tokens in the replay and conventional modes, L = 4
    (the 9-token request folds its rings twice); the fp8 shadow is refused, naming KDA."""
    from builders.kda import tiny_model

    pb = _FakePb(False)
    model = tiny_model("kimi_linear", seed=0)

    def args(mode):
        p = dict(dtype="float32", device="cpu", max_slots="1", max_seq_len="64", buffer_len="4", mode=mode,
                 health_url="off")
        return {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in p.items()}})}

    jobs = [([3, 1, 4, 1, 5], 9), ([9, 2, 6], 6)]
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p, n in jobs]
    for mode in ("replay", "conventional"):
        gm = tg.GenerateModel(pb, args(mode), model=model)
        try:
            assert type(gm.engine.step).__name__ == "KimiStep" and gm.engine.step.ssm.name == mode
            reqs = [_FakeRequest(pb, {"input_ids": p, "max_tokens": [n]}) for p, n in jobs]
            gm.execute(reqs)
            for r, (_, n), w in zip(reqs, jobs, want):
                assert r.done.wait(60)
                ids = [t for resp, _ in r.responses for t in resp.outputs["output_ids"].raw.tolist()]
                assert ids == w, mode
                last = r.responses[-1][0].outputs
                assert last["completion_tokens"].raw.tolist() == [n] and r.responses[-1][1] == 1
        finally:
            gm.finalize()
    with pytest.raises(ValueError, match="no fp8 KDA shadow"):
        tg.GenerateModel(pb, args("replay_fp8"), model=model)


def test_prefix_cache_and_preemption_in_config_and_cli(tmp_path):
    """--prefix-cache-tokens / --prefix-block / --preempt / --preempt-quantum / --max-swapped-bytes: config.pbtxt
    parameters that the model turns into the Engine's keywords (defaults: both off); bad values refused naming the
    flag or the parameter, nothing written."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    spec = importlib.util.spec_from_file_location("make_triton_repo", ROOT / "scripts" / "make_triton_repo.py")
    mtr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mtr)
    assert mtr.main(["--backend", "python", "--repo", str(tmp_path / "r"), "--device", "cpu", "--prefix-cache-tokens",
                     "512", "--prefix-block", "32", "--preempt", "--preempt-quantum", "4", "--max-swapped-bytes",
                     "1000000"]) == 0
    mc = text_format.Parse((tmp_path / "r" / NAME / "config.pbtxt").read_text(), pb.ModelConfig())
    p = {k: v.string_value for k, v in mc.parameters.items()}
    assert tg.engine_parameters(p) == dict(prefix_cache_tokens=512, prefix_block=32, preempt=True, preempt_quantum=4,
                                           max_swapped_bytes=1000000)
    target = tg.make_generate_repo(tmp_path / "d", device="cpu")
    mc = text_format.Parse((target / "config.pbtxt").read_text(), pb.ModelConfig())
    p = {k: v.string_value for k, v in mc.parameters.items()}
    assert tg.engine_parameters(p) == dict(prefix_cache_tokens=0, prefix_block=16, preempt=False, preempt_quantum=16,
                                           max_swapped_bytes=None)
    for kw, match in ((dict(prefix_cache_tokens=-1), "--prefix-cache-tokens"), (dict(prefix_block=0), "--prefix-block"),
                      (dict(preempt_quantum=0), "--preempt-quantum"), (dict(max_swapped_bytes=-5), "--max-swapped-bytes")):
        with pytest.raises(tg.RepoError, match=match):
            tg.make_generate_repo(tmp_path / "bad", device="cpu", **kw)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match=r"parameters\['preempt'\]: expected true or false"):
        tg.engine_parameters({"preempt": "yes"})
    with pytest.raises(ValueError, match=r"parameters\['prefix_cache_tokens'\]: expected an integer"):
        tg.engine_parameters({"prefix_cache_tokens": "lots"})


def test_model_in_process_with_prefix_cache_and_preemption(ckpt, ref):
    """GenerateModel under the stand-in stub with the prefix cache and preemption on (1 slot, quantum 2): three
    requests sharing a 32-token prefix stream transformers' greedy tokens; the engine swapped and reused."""
    model, tok, greedy = ref
    pb = _FakePb(False)
    params = dict(device="cpu", max_slots="1", max_seq_len="64", buffer_len="4", mode="replay", health_url="off",
                  prefix_cache_tokens="256", prefix_block="16", preempt="true", preempt_quantum="2")
    cfg = {"parameters": {k: {"string_value": v} for k, v in params.items()}}
    gm = tg.GenerateModel(pb, {"model_config": json.dumps(cfg)}, model=model, tokenizer=tok)
    try:
        eng = gm.engine
        assert (eng.prefix_cache_tokens, eng.prefix_block, eng.preempt, eng.preempt_quantum) == (256, 16, True, 2)
        system = [(5 * i + 2) % 250 for i in range(32)]
        prompts = [system + [7, 8], system + [9], system + [1, 2, 3]]
        reqs = [_FakeRequest(pb, {"input_ids": p, "max_tokens": [8]}) for p in prompts]
        gm.execute(reqs)
        for r, p in zip(reqs, prompts):
            assert r.done.wait(60)
            ids = [t for resp, _ in r.responses for t in resp.outputs["output_ids"].raw.tolist()]
            assert ids == greedy(p, 8)
        assert eng.stats["prefix_hits"] >= 2 and eng.stats["preemptions"] > 0
        assert eng.stats["swapped_bytes"] == 0
    finally:
        gm.finalize()


def test_kimi_linear_repository_from_the_cli_parameters(tmp_path):
    """``--tiny kimi_linear`` (or a Kimi-Linear ``--model``): the repository writer takes it, the model loads it from
    config.pbtxt's parameters as the server does (``load_model``: builders/kda.py), and the engine serves
    transformers' greedy tokens; the fp8 shadow and the 8-bit checkpoint are refused for a KDA model, by name."""
    from builders.kda import tiny_model

    repo = tg.make_generate_repo(tmp_path / "repo", tiny="kimi_linear", device="cpu", max_slots=1, buffer_len=4)
    assert repo.name == "kimi_linear_replayssm" and (repo / "config.pbtxt").is_file()
    for mode, what in (("replay_fp8", "no fp8 KDA shadow"), ("replay_ckpt8", "for Mamba-2 models")):
        with pytest.raises(tg.RepoError, match=what):
            tg.make_generate_repo(tmp_path / mode, tiny="kimi_linear", device="cpu", mode=mode)
    pb = _FakePb(False)
    p = dict(tiny="kimi_linear", seed="0", dtype="float32", device="cpu", max_slots="1", max_seq_len="48",
             buffer_len="4", mode="replay", health_url="off")
    gm = tg.GenerateModel(pb, {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in p.items()}})})
    try:
        assert type(gm.engine.step).__name__ == "KimiStep"
        r = _FakeRequest(pb, {"input_ids": [3, 1, 4, 1, 5], "max_tokens": [7]})
        gm.execute([r])
        assert r.done.wait(60)
        ids = [t for resp, _ in r.responses for t in resp.outputs["output_ids"].raw.tolist()]
        want = tiny_model("kimi_linear", seed=0).generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=7,
                                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ids == want[0, 5:].tolist()
    finally:
        gm.finalize()
