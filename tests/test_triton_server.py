# SPDX-License-Identifier: Apache-2.0
"""A real Triton Inference Server (the tritonserver 2.51 that nvidia-pytriton 0.7.0 bundles, Python backend)
serving the repository of ``scripts/make_triton_repo.py --backend python`` for the tiny Nemotron-H and
the tiny Qwen3-Next, on 127.0.0.1, driven through tritonclient gRPC streams.

Started once per module (random free ports, readiness bounded by STARTUP_S, stopped by its PID in
the fixture's teardown, also when a test fails); three models in one repository: ``nh`` (5 slots,
max_seq_len 16, L = 4 so every long sequence folds its ring several times), ``nh_idle`` (1 slot,
1 s idle timeout) and ``qwen`` (Qwen3-Next with its Gated DeltaNet layers on the cache's GDN rings
and its sparse MoE, 2 slots, L = 4). On this machine it runs on the CPU: the model's SSM is the float64 reference
through ReplayStateCache (the kernels on CUDA are the same code path with CUDA tensors).

Oracle: the patched transformers model (``builders.nemotron_h.patch_replayssm`` /
``builders.qwen3_next.patch_gdn_replayssm``, float64 reference backend, fp32 weights) fed each
sequence's tokens one at a time; every logit of every response is
compared with it. Tolerance 1e-4 absolute on logits of std ~1: both sides run the same fp32 weights
and float64 SSM math, so what differs is fp32 rounding in a different order (our conv window and
attention vs transformers' causal_conv1d_update and sdpa, the first token through transformers'
chunked prefill) over 8 layers and <= 16 steps; measured max 4e-6, so 1e-4 is 25x that and still
100x below the smallest difference between two sequences' logits at one position (checked below,
the test's teeth: a slot mix-up or a stale state would fail).
"""

import contextlib
import importlib.util
import os
import queue
import signal
import socket
import subprocess
import threading
import time

import pytest
import torch

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton is not installed (pip install --no-deps nvidia-pytriton==0.7.0: its tritonserver)",
                allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is not installed")

import numpy as np  # noqa: E402  (tritonclient's own dependency)

from builders import triton_repo as tr  # noqa: E402  (the writer behind scripts/make_triton_repo.py)

STARTUP_S = 180  # three stubs import torch + transformers and build the tiny models (~7 s each here)
RESPONSE_S = 60
MAX_SEQ, L, SLOTS, VOCAB = 16, 4, 5, 256  # 4 streams + 1 slot for the bad requests
TOL = 1e-4  # module docstring
IDLE_S = 1  # nh_idle's timeout: far above a step of the tiny model (~30 ms here) even on a loaded machine


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton")
    repo = tmp / "repo"
    tr.make_python_repo(repo, "nh", device="cpu", max_slots=SLOTS, max_seq_len=MAX_SEQ, buffer_len=L,
                         idle_us=120_000_000, max_queue_delay_us=5000)  # 5 ms: rows of several sequences batch together
    tr.make_python_repo(repo, "nh_idle", device="cpu", max_slots=1, max_seq_len=MAX_SEQ, buffer_len=L,
                         idle_us=IDLE_S * 1_000_000)
    tr.make_python_repo(repo, "qwen", tiny="qwen3_next", device="cpu", max_slots=2, max_seq_len=MAX_SEQ,
                         buffer_len=L, idle_us=120_000_000, max_queue_delay_us=5000)
    with _serve(tmp, repo, ("nh", "nh_idle", "qwen")) as (url, tail, _):
        yield url, tail


@pytest.fixture(scope="module")
def reference():
    """logits(tokens) of the patched transformers model, one token at a time (fp32, float64 SSM backend)."""
    from transformers import DynamicCache

    from builders.nemotron_h import load_nemotron_h, patch_replayssm

    model = load_nemotron_h(tiny="nemotron_h", seed=0)  # the weights the server's model.py builds
    dec = patch_replayssm(model, buffer_len=L)

    @torch.no_grad()
    def run(tokens):
        dec.reset()
        cache = DynamicCache(config=model.config)
        return torch.stack([model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1].float()
                            for t in tokens])

    return run


@pytest.fixture(scope="module")
def qwen_reference():
    """As ``reference`` for the tiny Qwen3-Next (``builders.qwen3_next.patch_gdn_replayssm``)."""
    from transformers import DynamicCache

    from builders.qwen3_next import patch_gdn_replayssm, tiny_model

    model = tiny_model("qwen3_next", seed=0)  # the weights the server's model.py builds

    @torch.no_grad()
    def run(tokens):
        dec = patch_gdn_replayssm(model, buffer_len=L)
        try:
            cache = DynamicCache(config=model.config)
            return torch.stack([model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1].float()
                                for t in tokens])
        finally:
            dec.unpatch()

    return run


def _inputs(token):
    i = grpcclient.InferInput("input_ids", [1, 1], "INT64")
    i.set_data_from_numpy(np.array([[token]], dtype=np.int64))
    return [i]


def _infer(url, model, seq, token, start=False, end=False):
    """(logits (vocab,), slot) or the InferenceServerException."""
    with grpcclient.InferenceServerClient(url) as c:
        try:
            r = c.infer(model, _inputs(token), sequence_id=seq, sequence_start=start, sequence_end=end)
        except grpcclient.InferenceServerException as e:
            return e
    return torch.from_numpy(r.as_numpy("logits")[0].copy()), int(r.as_numpy("slot")[0, 0])


class Stream:
    """One sequence decoded through its own gRPC stream: a prompt, then greedy tokens from the server's
    logits; waits at ``pause`` after ``pause_after`` steps (the bad requests run meanwhile)."""

    def __init__(self, url, seq_id, prompt, length, pause, pause_after, model="nh"):
        self.url, self.seq_id, self.prompt, self.length, self.model = url, seq_id, prompt, length, model
        self.pause, self.pause_after = pause, pause_after
        self.tokens, self.logits, self.slots, self.error = [], [], [], None

    def run(self, go: threading.Event):
        got = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        try:
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            token = self.prompt[0]
            for t in range(self.length):
                if t == self.pause_after:
                    self.pause.wait(RESPONSE_S)
                    go.wait(RESPONSE_S)
                client.async_stream_infer(self.model, _inputs(token), sequence_id=self.seq_id, sequence_start=t == 0,
                                          sequence_end=t == self.length - 1)
                result, error = got.get(timeout=RESPONSE_S)
                if error is not None:
                    raise error
                logits = torch.from_numpy(result.as_numpy("logits")[0].copy())
                self.tokens.append(token)
                self.logits.append(logits)
                self.slots.append(int(result.as_numpy("slot")[0, 0]))
                token = self.prompt[t + 1] if t + 1 < len(self.prompt) else int(logits.argmax())
        except BaseException as e:  # reported by the test
            self.error = e
            self.pause.abort()
        finally:
            client.stop_stream()
            client.close()


def _error(result, *needles):
    assert isinstance(result, Exception), f"expected an error response, got {result!r}"
    for n in needles:
        assert n in str(result), str(result)


def test_concurrent_sequences_and_bad_requests(server, reference):
    """Four sequences of 5..16 tokens stream concurrently (prompt, then greedy); while all four are live the
    bad requests run: each gets its own error and no stream notices. Every logit matches the oracle."""
    url, tail = server
    gen = torch.Generator().manual_seed(7)
    lengths = (5, 9, 13, MAX_SEQ)  # the longest fills max_seq_len exactly
    pause = threading.Barrier(len(lengths) + 1)
    go = threading.Event()
    streams = [Stream(url, 100 + k, torch.randint(0, VOCAB, (2 + k,), generator=gen).tolist(), n, pause, 3)
               for k, n in enumerate(lengths)]
    threads = [threading.Thread(target=s.run, args=(go,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    try:
        pause.wait(RESPONSE_S)  # every stream is live with 3 tokens in its slot
    except threading.BrokenBarrierError:
        pytest.fail(f"a stream failed before the pause: {[s.error for s in streams]}\n{tail()}")
    try:
        # unknown sequence without START: refused by Triton's sequence batcher before the model
        _error(_infer(url, "nh", 999, 1), "999", "START")
        # a token outside the vocabulary for a live sequence: refused by the model, the sequence untouched
        _error(_infer(url, "nh", 101, VOCAB + 5), "sequence 101", "input_ids")
        # a sequence in the fifth slot filled to max_seq_len, one token too many, then its END (also too many:
        # refused, but the slot is freed), then a request after its end
        bad = torch.randint(0, VOCAB, (MAX_SEQ,), generator=gen).tolist()
        got = [_infer(url, "nh", 500, t, start=k == 0) for k, t in enumerate(bad)]
        assert all(not isinstance(g, Exception) for g in got), got
        torch.testing.assert_close(torch.stack([g[0] for g in got]), reference(bad), rtol=0, atol=TOL)
        _error(_infer(url, "nh", 500, 1), "sequence 500", f"max_seq_len {MAX_SEQ}")
        _error(_infer(url, "nh", 500, 1, end=True), f"max_seq_len {MAX_SEQ}")
        _error(_infer(url, "nh", 500, 1), "500", "START")
        # its slot was freed and reset: a new sequence takes it and starts from zeros
        first = _infer(url, "nh", 501, bad[0], start=True, end=True)
        assert not isinstance(first, Exception), first
        assert first[1] == got[0][1], (first[1], got[0][1])
        torch.testing.assert_close(first[0], got[0][0], rtol=0, atol=TOL)
    finally:
        go.set()
    for t in threads:
        t.join(RESPONSE_S * 4)
    assert not any(t.is_alive() for t in threads)
    errors = [(s.seq_id, s.error) for s in streams if s.error is not None]
    assert not errors, f"{errors}\n{tail()}"

    refs = []
    for s in streams:
        assert len(s.logits) == s.length and len(set(s.slots)) == 1, (s.seq_id, len(s.logits), s.slots)
        want = reference(s.tokens)
        torch.testing.assert_close(torch.stack(s.logits), want, rtol=0, atol=TOL)
        refs.append(want)
    assert len({s.slots[0] for s in streams}) == len(streams)  # live at once: distinct slots
    # teeth: at every position two sequences' logits differ by far more than TOL
    for a in range(len(refs)):
        for b in range(a + 1, len(refs)):
            n = min(len(refs[a]), len(refs[b]))
            assert (refs[a][:n] - refs[b][:n]).abs().amax(-1).min() > 100 * TOL
    with grpcclient.InferenceServerClient(url) as c:  # the rows were batched: fewer executions than inferences
        st = c.get_inference_statistics("nh", as_json=True)["model_stats"][0]
    assert int(st["inference_count"]) > int(st["execution_count"]), st


def test_idle_timeout_frees_and_resets_the_slot(server, reference):
    """nh_idle has one slot and a 1 s idle timeout: a sequence left idle is dropped by Triton, and the
    next sequence gets the same slot, reset (its first logits are those of a fresh sequence)."""
    url, _ = server
    assert not isinstance(_infer(url, "nh_idle", 699, 1, start=True, end=True), Exception)  # warm-up step
    toks = [11, 22, 33]
    got = [_infer(url, "nh_idle", 700, t, start=k == 0) for k, t in enumerate(toks)]
    assert all(not isinstance(g, Exception) for g in got), got
    time.sleep(IDLE_S + 1.5)  # Triton drops sequence 700 and frees its candidate slot
    _error(_infer(url, "nh_idle", 700, 44), "700", "START")
    fresh = _infer(url, "nh_idle", 701, toks[2], start=True, end=True)
    assert not isinstance(fresh, Exception), fresh
    assert fresh[1] == got[0][1] == 0
    want = reference([toks[2]])[0]  # zeros in, not sequence 700's state
    torch.testing.assert_close(fresh[0], want, rtol=0, atol=TOL)
    assert (got[2][0] - want).abs().max() > 100 * TOL  # the same token after a history: other logits


def test_qwen_gdn_sequences(server, qwen_reference):
    """Two Qwen3-Next sequences stream concurrently through their own slots (prompt, then greedy, 7 and 16
    tokens: 1 and 3 ring folds); every logit matches the oracle, the slots differ, and the two sequences'
    logits differ by far more than TOL at every position (teeth)."""
    url, tail = server
    gen = torch.Generator().manual_seed(11)
    no_pause, go = threading.Barrier(1), threading.Event()
    go.set()
    streams = [Stream(url, 300 + k, torch.randint(0, VOCAB, (3,), generator=gen).tolist(), n, no_pause, n, "qwen")
               for k, n in enumerate((7, MAX_SEQ))]
    threads = [threading.Thread(target=s.run, args=(go,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RESPONSE_S * 4)
    assert not any(t.is_alive() for t in threads)
    errors = [(s.seq_id, s.error) for s in streams if s.error is not None]
    assert not errors, f"{errors}\n{tail()}"
    refs = []
    for s in streams:
        assert len(s.logits) == s.length and len(set(s.slots)) == 1, (s.seq_id, len(s.logits), s.slots)
        want = qwen_reference(s.tokens)
        torch.testing.assert_close(torch.stack(s.logits), want, rtol=0, atol=TOL)
        refs.append(want)
    assert streams[0].slots[0] != streams[1].slots[0]
    n = min(len(r) for r in refs)
    assert (refs[0][:n] - refs[1][:n]).abs().amax(-1).min() > 100 * TOL


def test_shutdown_with_an_open_sequence_is_prompt(tmp_path):
    """A sequence left open (started, never ended) made tritonserver's shutdown wait its whole exit timeout (30 s)
    and end with "Exit timeout expired": on SIGTERM it stops taking new sequences but counts each sequence holding a
    slot as an in-flight inference until its END or its idle timeout (the writer's default, 60 s), and the backend
    is not told. The printed serve command bounds that wait (--exit-timeout-secs, triton_repo.EXIT_TIMEOUT_S).
    A server of its own, one slot, the writer's defaults otherwise: ~5 s to start, the bound to stop."""
    repo = tmp_path / "repo"
    tr.make_python_repo(repo, "open", device="cpu", max_slots=1, max_seq_len=MAX_SEQ, buffer_len=L)
    with _serve(tmp_path, repo, ("open",)) as (url, tail, proc):
        got = _infer(url, "open", 900, 7, start=True)  # no END: the sequence stays open
        assert not isinstance(got, Exception), got
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - t0
        log = tail()
    assert took < tr.EXIT_TIMEOUT_S + 5, f"shutdown took {took:.1f} s:\n{log}"
    assert "Model 'open' (version 1) has 1 in-flight inferences" in log  # the cause, as the server reports it
