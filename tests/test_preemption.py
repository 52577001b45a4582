# SPDX-License-Identifier: Apache-2.0
"""Preemption in the generation engine (builders/generation.py, issue 38, opt-in ``preempt``) on the CPU.

Oracle: the same engine with a slot for every request (no preemption), on the same seeded tiny models as
tests/test_generation.py (Nemotron-H) and tests/test_prefix_cache.py (Qwen3.5): with fewer slots and
``preempt=True`` every request is swapped out to host memory and back several times (round robin with a quantum of
2 steps), and its tokens, greedy and seeded-sampled alike, must be equal token for token. That holds exactly, not
within a margin: a swapped slot comes back bit for bit (the step's ``save_slot`` / ``load_saved``; ReplaySSM through
the cache's ``swap_out`` / ``swap_in``), and a seeded draw depends on (seed, position) only. The greedy tokens are also
compared with transformers' ``generate``. The state round trip itself is compared bit for bit per slot, with a teeth
check. Bookkeeping exactly: every slot free, every row a padding row, the cache's pool whole, no host copy left.
"""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from builders.generation import Engine, Request  # noqa: E402
from builders.qwen3_next import tiny_model  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402

from .test_generation import Collect, assert_idle, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 9, 13, 200, 7], [1, 2], [100] * 11, [3, 4, 5, 6, 7, 8, 9], [250], [17, 18]]
MAX_TOKENS = [9, 12, 7, 10, 13, 6]


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5"])
def model(request):
    if request.param == "nemotron_h":
        return build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    return tiny_model("qwen3_5", seed=0)


def requests(got, sampled=(1, 3, 4)):
    """Greedy and seeded sampled requests (each its own seed)."""
    return [Request(p, n, temperature=0.8 if k in sampled else 0.0, top_k=40 if k == 3 else 0, seed=100 + k,
                    on_output=got) for k, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]


def serve(eng, reqs_fn):
    got = Collect()
    ids = [eng.submit(r) for r in reqs_fn(got)]
    eng.run_until_idle()
    return [got.tokens[i] for i in ids], got


def assert_no_leak(eng):
    assert_idle(eng)
    st = eng.stats
    assert not eng.swapped and st["swapped_requests"] == 0 and st["swapped_bytes"] == 0
    cache = getattr(eng.step.ssm, "cache", None)
    if cache is not None:  # every engine slot stays allocated in the cache (the engine's pool is the cache's)
        assert cache.num_free == 0 and cache.live_slots == list(range(eng.max_slots))


@pytest.mark.parametrize("mode", ["replay", "conventional"])
def test_preempted_requests_equal_a_run_with_enough_slots(model, mode):
    """6 requests on 2 slots, quantum 2: every request is swapped out and back in several times, into other slots;
    its tokens equal the 6-slot run's (and generate's for the greedy ones)."""
    check_preemption(model, mode, 4)


def check_preemption(model, mode: str, buffer_len: int) -> None:
    """The preemption check of every model kind's engine (Nemotron-H here; Kimi-Linear, GLM-5 Next beside their
    steps' tests): 6 requests (greedy and seeded sampled) on 2 slots, quantum 2, each swapped out and back in, into
    other slots; tokens equal the 6-slot run's (and generate's for the greedy ones), every swap holds
    ``saved_nbytes``, no slot leaks."""
    full, _ = serve(Engine(model, max_slots=6, max_seq_len=40, mode=mode, buffer_len=buffer_len), requests)
    eng = Engine(model, max_slots=2, max_seq_len=40, mode=mode, buffer_len=buffer_len, preempt=True,
                 preempt_quantum=2)
    sizes = []
    real = eng._swap_out

    def spy(live):
        want = eng.saved_nbytes(live.length)
        real(live)
        sizes.append(live.saved.nbytes == want)

    eng._swap_out = spy
    got, col = serve(eng, requests)
    assert got == full
    for k in (0, 2, 5):  # the greedy ones
        assert got[k] == reference(model, PROMPTS[k], MAX_TOKENS[k])
    assert [col.final[i].finish_reason for i in col.final] == ["length"] * 6
    st = eng.stats
    assert st["preemptions"] >= 10 and st["resumes"] == st["preemptions"] and all(sizes), st
    assert 0 < st["swapped_bytes_peak"] <= st["swap_out_bytes"]
    assert_no_leak(eng)


def test_preemption_is_off_by_default(model):
    """Without ``preempt`` a request waits in the queue for a free slot: nothing is swapped, tokens are the same."""
    full, _ = serve(Engine(model, max_slots=6, max_seq_len=40, mode="replay", buffer_len=4), requests)
    eng = Engine(model, max_slots=2, max_seq_len=40, mode="replay", buffer_len=4)
    assert serve(eng, requests)[0] == full
    assert eng.stats["preemptions"] == 0 and eng.stats["swap_out_bytes"] == 0
    assert_no_leak(eng)


def test_swap_round_trip_is_bit_exact_per_slot(model):
    """save_slot of a decoding slot, load_saved into another row: that row holds the same bits in every per-slot
    tensor (the next input, length, conv windows, K/V, SSM state / cache slot), K/V past the length zero; corrupting
    one saved value shows up (teeth)."""
    check_swap_round_trip(model, 4, next_name=lambda tensors: next(n for n in tensors if n.startswith("k.")))


def check_swap_round_trip(model, buffer_len: int, next_name) -> None:
    """The swap check of every model kind's step: a decoding slot (a prefill and 6 decode steps: the ring holds
    entries) saved and loaded into another row holds the same bits in every per-slot tensor; the saved tensors are
    ``saved_spec``'s where the step declares one; the tensor ``next_name(tensors)`` corrupted shows up (teeth)."""
    eng = Engine(model, max_slots=3, max_seq_len=40, mode="replay", buffer_len=buffer_len)
    eng.submit(Request(PROMPTS[2], 20))
    for _ in range(7):
        eng.step_once()
    step, n = eng.step, eng.live[0].length
    cache = getattr(getattr(step, "ssm", None), "cache", None)
    assert cache is None or int(cache.cursor[0]) != 0  # the ring holds entries: the swap must carry them
    before = slot_bits(step, 0, n)
    tensors, snap = step.save_slot(0, n)
    if hasattr(step, "saved_spec"):
        spec = step.saved_spec(n)
        assert {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()} == \
            {k: (d, tuple(s)) for k, (d, s) in spec.items()}
    step.load_saved(2, n, tensors, snap)
    after = slot_bits(step, 2, n)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    name = next_name(tensors)
    tensors[name].view(-1)[3] += 1.0
    step.load_saved(1, n, tensors, snap)
    assert not torch.equal(slot_bits(step, 1, n)[name], before[name])


def slot_bits(step, row, length):
    """Every per-slot tensor of ``row`` as raw bytes (the step's and, for ReplaySSM, the cache's)."""
    out = {"lengths": step.lengths[row].clone()}
    out["ids" if hasattr(step, "gdn") else "tokens"] = (step.ids if hasattr(step, "gdn") else step.tokens)[row].clone()
    conv = {f"conv.{i}": t[row] for i, t in step.conv.items()}
    for i in step.attn:
        conv[f"k.{i}"] = step.k[i][row, :, :length]
        conv[f"v.{i}"] = step.v[i][row, :, :length]
        assert not step.k[i][row, :, length:].any() and not step.v[i][row, :, length:].any()
    out.update({k: t.clone() for k, t in conv.items()})
    cache = step.ssm.cache
    for name, t in cache._snapshot_tensors():
        x = t[row] if name == "cursor" else t[:, row]
        out["cache." + name] = (x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x).clone()
    return out


def test_cancel_of_a_swapped_out_request_frees_its_host_copy():
    """A request cancelled while swapped out ends with "cancelled" at the next step and its host copy is dropped;
    the others still equal the run with enough slots."""
    model = build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    full, _ = serve(Engine(model, max_slots=6, max_seq_len=40, mode="replay", buffer_len=4), requests)
    eng = Engine(model, max_slots=2, max_seq_len=40, mode="replay", buffer_len=4, preempt=True, preempt_quantum=2)
    got = Collect()
    ids = [eng.submit(r) for r in requests(got)]
    while not eng.swapped:
        eng.step_once()
    victim = eng.swapped[0]
    held = eng.stats["swapped_bytes"]
    assert held >= victim.saved.nbytes > 0
    assert eng.cancel(victim.req.request_id)
    eng.step_once()
    assert victim not in eng.swapped and victim.saved is None
    assert got.final[victim.req.request_id].finish_reason == "cancelled"
    eng.run_until_idle()
    for k, i in enumerate(ids):
        if i != victim.req.request_id:
            assert got.tokens[i] == full[k], k
    assert_no_leak(eng)


def test_max_swapped_bytes_bounds_the_host_copies():
    """``saved_nbytes`` is the bytes a swap holds (the step's saved tensors and the cache's snapshot); a budget of 0
    swaps nothing; a budget of one slot holds at most that much at once; tokens equal either way."""
    model = build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    full, _ = serve(Engine(model, max_slots=6, max_seq_len=40, mode="replay", buffer_len=4), requests)
    none = Engine(model, max_slots=2, max_seq_len=40, mode="replay", buffer_len=4, preempt=True, preempt_quantum=2,
                  max_swapped_bytes=0)
    assert serve(none, requests)[0] == full and none.stats["preemptions"] == 0
    one = none.saved_nbytes(39)  # the largest slot these requests reach
    eng = Engine(model, max_slots=2, max_seq_len=40, mode="replay", buffer_len=4, preempt=True, preempt_quantum=2,
                 max_swapped_bytes=one)
    sizes = []
    real = eng._swap_out

    def spy(live):
        want = eng.saved_nbytes(live.length)
        real(live)
        assert live.saved.nbytes == want
        sizes.append(want)

    eng._swap_out = spy
    assert serve(eng, requests)[0] == full
    assert sizes and eng.stats["swap_out_bytes"] == sum(sizes)
    assert 0 < eng.stats["swapped_bytes_peak"] <= one
    assert_no_leak(eng)
    with pytest.raises(ValueError, match="preempt_quantum"):
        Engine(model, max_slots=1, max_seq_len=8, preempt=True, preempt_quantum=0)
    with pytest.raises(ValueError, match="max_swapped_bytes"):
        Engine(model, max_slots=1, max_seq_len=8, preempt=True, max_swapped_bytes=-1)


@pytest.mark.gpu
def test_preemption_on_cuda_with_graphs_uses_pinned_copies():
    """CUDA, captured graphs, bf16: host copies are pinned; tokens equal a run with enough slots."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    model = build_model(model_config(tiny=True), "cuda", torch.bfloat16, seed=0)
    full, _ = serve(Engine(model, max_slots=6, max_seq_len=40, mode="replay", buffer_len=4), requests)
    eng = Engine(model, max_slots=2, max_seq_len=40, mode="replay", buffer_len=4, preempt=True, preempt_quantum=2)
    pinned = []
    real = eng._swap_out

    def spy(live):
        real(live)
        held = [*live.saved.tensors.items(), *live.saved.snapshot.tensors.items()]
        pinned.append([k for k, t in held if t.numel() and not t.is_pinned()])  # an empty tensor has no storage

    eng._swap_out = spy
    assert eng.cuda_graphs and serve(eng, requests)[0] == full
    assert pinned and not any(pinned) and eng.stats["preemptions"] >= 10, pinned[:2]
    assert_no_leak(eng)
