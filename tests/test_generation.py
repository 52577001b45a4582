# SPDX-License-Identifier: Apache-2.0
"""The generation engine (builders/generation.py) on the CPU: in-flight batching over the model step.

Oracle: transformers' own ``generate`` (greedy, fp32 weights) on the same seeded tiny model, one prompt at a
time. The engine's tokens must be equal, token for token: its prefill is the model's own forward and its decode
step (builders/model_step.py, the float64 SSM reference on the CPU) computes the same function in another
order, and the tiny models' top-2 logit gaps are far above fp32 rounding (the e2e gates measure this margin).
Bookkeeping exactly: every slot free and every row a padding row after the requests end.
"""

import threading
import time

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from builders.generation import MODES, Engine, Output, Request, RequestError, sample, uniform_noise  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 9, 13, 200, 7], [1, 2], [100] * 11, [3, 4, 5, 6, 7, 8, 9], [250]]
MAX_TOKENS = [7, 12, 5, 9, 13]


@pytest.fixture(scope="module")
def tiny():
    return build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)


@pytest.fixture(scope="module")
def tiny3():
    return build_model(model_config(tiny="nemotron3"), "cpu", torch.float32, seed=1)


def reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class Collect:
    def __init__(self):
        self.tokens, self.final = {}, {}

    def __call__(self, o: Output):
        self.tokens.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finished:
            assert o.request_id not in self.final, "two final outputs"
            self.final[o.request_id] = o


def assert_idle(eng: Engine):
    assert sorted(eng.free) == list(range(eng.max_slots)) and not eng.live and not eng.queue and not eng.open
    assert (eng.step.sbi == -1).all()


@pytest.mark.parametrize("mode", ["conventional", "replay"])
def test_greedy_equals_generate_with_more_requests_than_slots(tiny, mode):
    eng = Engine(tiny, max_slots=3, max_seq_len=40, mode=mode, buffer_len=4)
    got = Collect()
    ids = [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_idle()
    for p, m, i in zip(PROMPTS, MAX_TOKENS, ids):
        assert got.tokens[i] == reference(tiny, p, m), i
        f = got.final[i]
        assert (f.finish_reason, f.prompt_tokens, f.completion_tokens) == ("length", len(p), m)
    assert_idle(eng)


def test_nemotron3_moe_and_chunked_prefill(tiny3):
    eng = Engine(tiny3, max_slots=2, max_seq_len=48, mode="replay", buffer_len=8, prefill_chunk=4)
    got = Collect()
    prompts = [[7, 3, 11, 19, 2, 5, 8, 1, 4, 60, 33], [42, 17, 99]]
    ids = [eng.submit(Request(p, 9, on_output=got)) for p in prompts]
    eng.run_until_idle()
    for p, i in zip(prompts, ids):
        assert got.tokens[i] == reference(tiny3, p, 9)
    assert_idle(eng)


def test_shadow_modes_serve(tiny):
    for mode in ("replay_bf16", "replay_fp8"):
        eng = Engine(tiny, max_slots=2, max_seq_len=32, mode=mode, buffer_len=4)
        got = Collect()
        i = eng.submit(Request(PROMPTS[0], 10, on_output=got))
        eng.run_until_idle()
        assert len(got.tokens[i]) == 10 and got.final[i].finish_reason == "length"
        assert_idle(eng)
    assert set(MODES) == {"conventional", "replay", "replay_bf16", "replay_fp8", "replay_ckpt8"}


def test_stop_token_and_cancel_free_their_slots(tiny):
    ref = reference(tiny, PROMPTS[1], 12)
    eng = Engine(tiny, max_slots=2, max_seq_len=40, mode="replay", buffer_len=4)
    got = Collect()
    stop = eng.submit(Request(PROMPTS[1], 12, stop_token_ids=(ref[4],), on_output=got))
    long = eng.submit(Request(PROMPTS[0], 30, on_output=got))
    queued = eng.submit(Request(PROMPTS[2], 5, on_output=got))  # waits for a slot
    for _ in range(3):
        eng.step_once()
    assert eng.cancel(long) and not eng.cancel("nope")
    eng.run_until_idle()
    assert got.tokens[stop] == ref[:ref.index(ref[4]) + 1] and got.final[stop].finish_reason == "stop"
    assert got.final[long].finish_reason == "cancelled" and 0 < len(got.tokens[long]) < 30
    assert got.tokens[queued] == reference(tiny, PROMPTS[2], 5)  # served from a slot freed by the others
    assert_idle(eng)


def test_client_going_away_is_polled(tiny):
    gone = threading.Event()
    eng = Engine(tiny, max_slots=1, max_seq_len=40, mode="replay", buffer_len=4, poll_s=0.0)
    got = Collect()
    i = eng.submit(Request(PROMPTS[0], 30, on_output=got, is_cancelled=gone.is_set))
    eng.step_once()
    gone.set()
    eng.run_until_idle()
    assert got.final[i].finish_reason == "cancelled"
    assert_idle(eng)


def test_bad_requests_are_refused_before_any_work(tiny):
    eng = Engine(tiny, max_slots=1, max_seq_len=16, mode="replay", buffer_len=4)
    cases = [
        (Request([1] * 10, 7), r"prompt \+ max_tokens: 10 \+ 7 = 17 tokens exceed the KV capacity of 16"),
        (Request([], 3), "prompt: expected a non-empty list"),
        (Request([1, 256], 3), r"prompt: token ids must be ints in 0..255, got 256"),
        (Request([1], 0), "max_tokens: expected an int >= 1, got 0"),
        (Request([1], 2, temperature=-1.0), "temperature"),
        (Request([1], 2, temperature=float("nan")), "temperature"),
        (Request([1], 2, top_k=-2), "top_k"),
        (Request([1], 2, top_p=0.0), "top_p"),
        (Request([1], 2, seed=1.5), "seed"),
        (Request([1], 2, stop_token_ids=("a",)), "stop_token_ids"),
    ]
    for req, msg in cases:
        with pytest.raises(RequestError, match=msg):
            eng.submit(req)
    assert eng.pending() == 0 and eng.steps == 0
    eng.submit(Request([1], 2, request_id="a"))
    with pytest.raises(RequestError, match="request_id: 'a' is already open"):
        eng.submit(Request([1], 2, request_id="a"))
    eng.run_until_idle()
    assert_idle(eng)


def test_failed_step_fails_its_requests_and_the_engine_goes_on(tiny, monkeypatch):
    eng = Engine(tiny, max_slots=2, max_seq_len=32, mode="replay", buffer_len=4)
    got = Collect()
    a = eng.submit(Request(PROMPTS[0], 6, on_output=got))
    eng.step_once()
    real = eng._run_step
    monkeypatch.setattr(eng, "_run_step", lambda n: (_ for _ in ()).throw(RuntimeError("injected")))
    eng.step_once()
    assert got.final[a].finish_reason == "error" and "injected" in got.final[a].error
    assert_idle(eng)
    monkeypatch.setattr(eng, "_run_step", real)
    b = eng.submit(Request(PROMPTS[3], 6, on_output=got))
    eng.run_until_idle()
    assert got.tokens[b] == reference(tiny, PROMPTS[3], 6)


def test_raising_callback_cancels_only_its_request(tiny):
    eng = Engine(tiny, max_slots=2, max_seq_len=32, mode="replay", buffer_len=4)
    got = Collect()

    def bad(o):
        raise OSError("client gone")

    eng.submit(Request(PROMPTS[0], 20, on_output=bad))
    b = eng.submit(Request(PROMPTS[1], 8, on_output=got))
    eng.run_until_idle()
    assert got.tokens[b] == reference(tiny, PROMPTS[1], 8)
    assert_idle(eng)


def test_thread_concurrent_clients_and_shutdown_with_open_streams(tiny):
    eng = Engine(tiny, max_slots=2, max_seq_len=64, mode="replay", buffer_len=4).start()
    got = Collect()
    done = threading.Event()

    def client(k):
        got_k = eng.submit(Request(PROMPTS[k], MAX_TOKENS[k], on_output=got))
        return got_k

    ids = []
    threads = [threading.Thread(target=lambda k=k: ids.append((k, client(k)))) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 120
    while len(got.final) < 4 and time.time() < deadline:
        time.sleep(0.01)
    for k, i in ids:
        assert got.tokens[i] == reference(tiny, PROMPTS[k], MAX_TOKENS[k])
    long = eng.submit(Request(PROMPTS[0], 50, on_output=got))
    queued = [eng.submit(Request(PROMPTS[1], 50, on_output=got)) for _ in range(3)]
    time.sleep(0.05)
    t0 = time.time()
    eng.shutdown()
    done.set()
    assert time.time() - t0 < 10 and not eng.thread.is_alive()
    for i in [long, *queued]:
        assert got.final[i].finish_reason == "error" and "shutting down" in got.final[i].error
    with pytest.raises(RequestError, match="shutting down"):
        eng.submit(Request([1], 1))


# ---- sampling -----------------------------------------------------------------------------------------
def test_noise_is_uniform_and_keyed_by_seed_and_position():
    seed = torch.tensor([1, 1, 2], dtype=torch.int64)
    pos = torch.tensor([5, 6, 5], dtype=torch.int64)
    u = uniform_noise(seed, pos, 4096)
    assert ((u > 0) & (u < 1)).all()
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.var()) - 1 / 12) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(uniform_noise(seed[:1], pos[:1], 4096)[0], u[0])  # whatever else is in the batch


def test_sample_rules():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    z = lambda v, dt=torch.float32: torch.full((6,), v, dtype=dt)  # noqa: E731
    seed, pos = torch.arange(6, dtype=torch.int64), z(3, torch.int64)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, z(0.0), z(0, torch.int64), z(1.0), seed, pos), greedy)
    assert torch.equal(sample(logits, z(1.0), z(1, torch.int64), z(1.0), seed, pos), greedy)  # top_k = 1
    assert torch.equal(sample(logits, z(1.0), z(0, torch.int64), z(1e-6), seed, pos), greedy)  # top_p -> the top token
    top5 = logits.topk(5, -1).indices
    for s in range(40):  # top_k = 5 keeps the draw among the 5 largest
        t = sample(logits, z(2.0), z(5, torch.int64), z(1.0), seed + 100 * s, pos)
        assert (top5 == t[:, None]).any(-1).all()
    # the Gumbel-max draw follows softmax(logits / T): empirical frequencies of one row over many seeds
    row = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    draws = sample(row.expand(n, 4), torch.full((n,), 1.0), torch.zeros(n, dtype=torch.int64), torch.ones(n),
                   torch.arange(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(draws, minlength=4).float() / n
    assert (freq - torch.softmax(row[0], 0)).abs().max() < 0.03


def test_seeded_sampling_is_reproducible_in_any_batch(tiny):
    check_seeded_sampling(tiny)


def check_seeded_sampling(model):
    """A seeded sampled request gives the same tokens alone and batched with others (and not the greedy ones)."""
    def run(with_others):
        eng = Engine(model, max_slots=3, max_seq_len=40, mode="replay", buffer_len=4)
        got = Collect()
        if with_others:
            eng.submit(Request(PROMPTS[2], 9, temperature=0.7, seed=5, on_output=got))
        i = eng.submit(Request(PROMPTS[0], 12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, on_output=got))
        if with_others:
            eng.submit(Request(PROMPTS[1], 4, on_output=got))
        eng.run_until_idle()
        return got.tokens[i]

    a, b = run(False), run(True)
    assert a == b and a != reference(model, PROMPTS[0], 12)


def check_cuda_engine(cpu_model, cuda_model, L: int, modes) -> None:
    """The engine on CUDA (eager) against transformers' greedy tokens of the same weights on the CPU, in every mode of
    ``modes``; the bf16 shadow mode only completes (its rounding may move a token). The Kimi-Linear and GLM-5 Next
    CUDA tests."""
    refs = [reference(cpu_model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    for mode in modes:
        eng = Engine(cuda_model, max_slots=3, max_seq_len=40, mode=mode, buffer_len=L)
        assert not eng.cuda_graphs and eng.step.device.type == "cuda"
        got = Collect()
        ids = [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS, MAX_TOKENS)]
        eng.run_until_idle()
        for m, i, want in zip(MAX_TOKENS, ids, refs):
            if mode == "replay_bf16":
                assert len(got.tokens[i]) == m and got.final[i].finish_reason == "length"
            else:
                assert got.tokens[i] == want, (mode, i)
        assert_idle(eng)


def check_prefix_cache(model, L: int) -> None:
    """The engine's prefix cache on a model kind's step (the Kimi-Linear and GLM-5 Next tests): a shared 8-token
    prefix, blocks of 4; the later prompts compute only their suffix and every request's tokens equal generate."""
    eng = Engine(model, max_slots=2, max_seq_len=64, mode="replay", buffer_len=L, prefix_cache_tokens=64,
                 prefix_block=4)
    shared = [7, 3, 11, 19, 2, 5, 8, 1]
    prompts = [shared + [4, 60], shared + [33, 9, 12], shared]
    got = Collect()
    ids = [eng.submit(Request(p, 6, on_output=got)) for p in prompts]
    eng.run_until_idle()
    for p, i in zip(prompts, ids):
        assert got.tokens[i] == reference(model, p, 6)
    st = eng.stats
    assert (st["prefix_hits"], st["prefill_tokens_reused"], st["prefill_tokens_computed"]) == (2, 16, 13), st
    assert_idle(eng)


def test_256_concurrent_streams_on_16_slots(tiny):
    """256 streams at once from 8 client threads onto 16 slots: every one served to its length in order of its own
    tokens, the queue drained, every slot free again (nothing leaks); a sample checked against generate."""
    eng = Engine(tiny, max_slots=16, max_seq_len=24, mode="replay", buffer_len=4).start()
    got = Collect()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(256)]
    ids = [None] * 256

    def client(k0):
        for k in range(k0, 256, 8):
            ids[k] = eng.submit(Request(prompts[k], 3 + k % 4, on_output=got))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 300
    while len(got.final) < 256 and time.time() < deadline:
        time.sleep(0.02)
    eng.shutdown()
    assert len(got.final) == 256
    for k in range(256):
        assert got.final[ids[k]].finish_reason == "length" and len(got.tokens[ids[k]]) == 3 + k % 4
    for k in (0, 77, 255):
        assert got.tokens[ids[k]] == reference(tiny, prompts[k], 3 + k % 4)
    assert_idle(eng)
