# SPDX-License-Identifier: Apache-2.0
"""The generation engine (builders/generation.py) serving Kimi-Linear through its decode step (builders/kimi_step.py
``KimiStep``) on the CPU: in-flight batching, batched prefill, the SSM modes, sampling, cancel, preemption and the
prefill/decode hand-off.

Oracle: transformers' own ``generate`` (greedy, fp32 weights) on the seeded tiny Kimi-Linear (builders/kda.py
``TINY_KIMI_LINEAR``: 3 KDA layers + 1 MLA layer, a dense MLP then sigmoid-routed MoE), one prompt at a time. The
engine's tokens must be equal, token for token: its prefill is the model's own forward and its decode step computes
the same function in another order (the float64 KDA spec on the CPU; ReplaySSM with the bf16 u ring of DESIGN §5,
whose rounding (measured 2.5e-4 on the logits, tests/test_kda_builder.py) is far below the tiny model's top-2 logit
gaps). L = 4: requests of 5+ tokens fold their rings at least once. The batched prefill's hand-off is checked
against each prompt's own prefill (1e-5 on values of order 1: fp32 rounding of another padding; measured <= 1e-6),
bookkeeping exactly; a corrupted checkpoint must change that request's tokens and no other's (teeth). Preemption
and the hand-off: the same engine with enough slots is the oracle, exactly (a slot crosses bit for bit).
"""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from builders.generation import STEPS, Engine, Request, RequestError, make_step  # noqa: E402
from builders.kda import tiny_model  # noqa: E402
from builders.kimi_step import MODES, KimiStep  # noqa: E402

from .test_generation import (  # noqa: E402  (the engine tests' prompts, oracle and bookkeeping)
    MAX_TOKENS,
    PROMPTS,
    Collect,
    assert_idle,
    check_cuda_engine,
    check_prefix_cache,
    check_seeded_sampling,
    reference,
)
from .test_preemption import assert_no_leak, check_preemption, check_swap_round_trip  # noqa: E402,E501

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5  # module docstring
L = 4


@pytest.fixture(scope="module")
def kimi():
    """(the tiny Kimi-Linear, the greedy references of PROMPTS / MAX_TOKENS)."""
    model = tiny_model("kimi_linear", seed=0)
    return model, [reference(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_generate_with_requests_arriving_while_others_decode(kimi, mode):
    """Five requests of 1 to 11 tokens on three slots: three arrive first (prefilled together, left-padded), two more
    after three decode steps (one waits in the queue, then takes a freed slot): every request's tokens equal
    transformers' generate, in every mode; every slot free at the end."""
    model, refs = kimi
    eng = Engine(model, max_slots=3, max_seq_len=40, mode=mode, buffer_len=L)
    assert type(eng.step) is KimiStep and eng.step.ssm.name == mode and not eng.cuda_graphs
    got = Collect()
    ids = [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS[:3], MAX_TOKENS[:3])]
    for _ in range(3):
        eng.step_once()
    assert len(eng.live) == 3 and all(len(got.tokens[i]) >= 2 for i in ids)  # decoding before the others arrive
    ids += [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS[3:], MAX_TOKENS[3:])]
    eng.run_until_idle()
    for p, m, i, want in zip(PROMPTS, MAX_TOKENS, ids, refs):
        assert got.tokens[i] == want, (mode, i)
        f = got.final[i]
        assert (f.finish_reason, f.prompt_tokens, f.completion_tokens) == ("length", len(p), m)
    assert_idle(eng)


@pytest.mark.parametrize("mode", ["conventional", "replay"])
def test_batched_prefill_hands_each_row_its_own_prefill(kimi, mode):
    """Three prompts of 5, 2 and 11 tokens prefilled in one left-padded batch: each slot's length, conv window (the
    last K - 1 inputs), MLA latents (the prompt's, zeros past it), recurrent state (ReplaySSM: the checkpoint, rings
    empty, cursor 0) and first token equal those of the prompt's own prefill."""
    from transformers import DynamicCache

    model, _ = kimi
    eng = Engine(model, max_slots=4, max_seq_len=32, mode=mode, buffer_len=L)
    firsts = {}
    prompts = PROMPTS[:3]
    for p in prompts:
        eng.submit(Request(p, 4, on_output=lambda o, p=tuple(p): firsts.setdefault(p, o.token_ids[0])))
    eng._admit()  # the prefill of all three, no decode step
    step = eng.step
    assert sorted(eng.live) == [0, 1, 2] and step.sbi.tolist() == [0, 1, 2, -1]
    assert step.kda == [0, 1, 2] and step.attn == [3]
    states = step.ssm.states()
    if mode == "replay":
        assert step.ssm.cache.cursor[:3].tolist() == [0, 0, 0]
    for slot, p in enumerate(prompts):
        n = len(p)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        assert firsts[tuple(p)] == int(logits.argmax()) and int(step.lengths[slot]) == n
        for i in step.kda:
            torch.testing.assert_close(step.conv[i][slot], cache.get_conv_state(i)[0, :, 1:], rtol=0, atol=TOL)
            want = cache.get_recurrent_state(i)[0].double()  # (H, K, V): the checkpoint's layout
            torch.testing.assert_close(states[i][slot].double(), want, rtol=0, atol=TOL)
        for i in step.attn:
            for mine, theirs in ((step.k[i], cache.layers[i].keys), (step.v[i], cache.layers[i].values)):
                torch.testing.assert_close(mine[slot, :, :n], theirs[0], rtol=0, atol=TOL)
                assert not mine[slot, :, n:].any()
    eng.run_until_idle()
    assert_idle(eng)


@pytest.mark.parametrize("mode", ["conventional", "replay"])
def test_a_corrupted_checkpoint_changes_only_its_request(kimi, mode):
    """Teeth: after the prefill, one slot's KDA state of the first layer is scaled by 3 (conventional: the state;
    ReplaySSM: the checkpoint, which every step of the ring reads): that request's tokens leave generate's, the
    other request's do not (rows do not leak into each other)."""
    model, refs = kimi
    eng = Engine(model, max_slots=2, max_seq_len=40, mode=mode, buffer_len=L)
    got = Collect()
    a = eng.submit(Request(PROMPTS[3], MAX_TOKENS[3], on_output=got))
    b = eng.submit(Request(PROMPTS[4], MAX_TOKENS[4], on_output=got))
    eng._admit()
    ssm = eng.step.ssm
    state = ssm.state[0] if mode == "conventional" else ssm.cache.layer(0).buf.state
    state[0].mul_(3.0)
    eng.run_until_idle()
    assert got.tokens[a][0] == refs[3][0]  # the first token comes from the prefill, before the corruption
    assert got.tokens[a] != refs[3] and got.tokens[b] == refs[4]


def test_replay_folds_and_bf16_shadow_is_read(kimi):
    """ReplaySSM: after n decode steps the cursor is n mod L (the rings fold every L steps); replay_bf16 keeps a bf16
    shadow equal to the rounded fp32 checkpoint, and its logits stay within the shadow's rounding of the fp32
    ReplaySSM step's without being equal to them."""
    from trtllm_replayssm.shadow import quantize_shadow

    model, _ = kimi
    logits = {}
    for mode in ("replay", "replay_bf16"):
        eng = Engine(model, max_slots=1, max_seq_len=32, mode=mode, buffer_len=L)
        eng.submit(Request(PROMPTS[0], 12))
        eng._admit()
        rows = []
        for n in range(1, 10):  # two folds of the L = 4 ring
            eng.step_once()
            assert int(eng.step.ssm.cache.cursor[0]) == n % L
            rows.append(eng.step.logits[0].clone())
        logits[mode] = torch.stack(rows)
        c = eng.step.ssm.cache
        if mode == "replay_bf16":
            st, sh = c.layer(0).buf.state, c.layer(0).shadow
            q = torch.empty(st.shape, dtype=torch.bfloat16)
            quantize_shadow(st, q, None)
            assert torch.equal(sh[0].view(torch.uint8), q[0].view(torch.uint8))
        eng.run_until_idle()
    diff = float((logits["replay"] - logits["replay_bf16"]).abs().max())
    # bf16 shadow: relative rounding 2^-9 of the checkpoint, reaching the logits through 4 layers (measured ~1e-3)
    assert 0 < diff < 2e-2 * float(logits["replay"].abs().max()), diff


def test_modes_and_families_are_checked(kimi):
    """No fp8 KDA shadow: replay_fp8 is refused naming it, before anything is allocated; STEPS serves kimi_linear
    with KimiStep (GLM-5 Next: tests/test_generation_glm5.py)."""
    model, _ = kimi
    assert type(make_step(model, 1, 8)) is KimiStep and "kimi_linear" in STEPS
    with pytest.raises(ValueError, match="no fp8 KDA shadow"):
        Engine(model, max_slots=1, max_seq_len=8, mode="replay_fp8")
    with pytest.raises(RequestError, match="exceed the KV capacity of 8"):
        Engine(model, max_slots=1, max_seq_len=8).submit(Request([1] * 5, 4))


def test_seeded_sampling_is_reproducible_in_any_batch(kimi):
    check_seeded_sampling(kimi[0])


def test_stop_token_and_cancel_free_their_slots(kimi):
    """A stop token ends its request, a cancelled one ends "cancelled" at the next step; a queued request is served
    from the freed slot exactly."""
    model, _ = kimi
    ref = reference(model, PROMPTS[1], 12)
    eng = Engine(model, max_slots=2, max_seq_len=40, mode="replay", buffer_len=L)
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
    assert got.tokens[queued] == reference(model, PROMPTS[2], 5)
    assert_idle(eng)


@pytest.mark.parametrize("mode", ["conventional", "replay"])
def test_failed_step_fails_its_requests_and_the_engine_goes_on(kimi, monkeypatch, mode):
    """A step that raises in the MLA layer, after the three KDA layers ran (ReplaySSM: an open cache step with
    verified layers, closed by abort_step): its requests end with the error, their slots are free, and the next
    requests are served exactly (their slots' state comes whole from their own prefill)."""
    model, refs = kimi
    eng = Engine(model, max_slots=2, max_seq_len=32, mode=mode, buffer_len=L)
    got = Collect()
    a = eng.submit(Request(PROMPTS[0], 6, on_output=got))
    b = eng.submit(Request(PROMPTS[3], 6, on_output=got))
    eng.step_once()
    monkeypatch.setattr(KimiStep, "_attention", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    eng.step_once()
    for i in (a, b):
        assert got.final[i].finish_reason == "error" and "injected" in got.final[i].error
    assert_idle(eng)
    monkeypatch.undo()
    c = eng.submit(Request(PROMPTS[2], 5, on_output=got))
    d = eng.submit(Request(PROMPTS[1], 9, on_output=got))
    eng.run_until_idle()
    assert got.tokens[c] == refs[2] and got.tokens[d] == reference(model, PROMPTS[1], 9)
    assert_idle(eng)


# ---- preemption and the prefill/decode hand-off (QwenStep's save_slot / load_saved, KimiStep's saved_spec) ---------
@pytest.mark.parametrize("mode", ["replay", "conventional"])
def test_preempted_requests_equal_a_run_with_enough_slots(kimi, mode):
    """6 requests (greedy and seeded sampled) on 2 slots, quantum 2: every request is swapped out and back in several
    times, into other slots; its tokens equal the 6-slot run's (and generate's for the greedy ones); swap sizes are
    ``saved_nbytes``."""
    check_preemption(kimi[0], mode, L)


def test_swap_round_trip_is_bit_exact_per_slot(kimi):
    """save_slot / load_saved into another row: the same bits in every per-slot tensor
    (next input, length, conv windows, MLA latents, the cache slot);
    the saved tensors are ``saved_spec``'s; a corrupted saved state
    shows up (teeth). tests/test_preemption.py's check."""
    check_swap_round_trip(kimi[0], L, next_name=lambda tensors: "v.3")


JOBS = [dict(prompt=[5, 9, 13, 200, 7, 1, 2, 3, 4], max_tokens=10),  # greedy
        dict(prompt=[100] * 6, max_tokens=9, temperature=0.9, top_p=0.95, seed=77)]  # seeded sampling


@pytest.mark.parametrize("mode", ["replay", "conventional"])
def test_prefill_here_decode_in_another_engine(kimi, mode):
    """Request(export=True) ends after its prefill with the state's bytes; another engine (3 slots, a longer K/V
    row, a busy slot 0) resumes it: first token + continuation == one engine doing both (== generate when greedy).
    A state of one mode is refused by an engine of the other, naming it."""
    model, _ = kimi
    kw = dict(max_seq_len=48, mode=mode, buffer_len=L)
    one = Engine(model, max_slots=2, **kw)
    got = Collect()
    ids = [one.submit(Request(on_output=got, **j)) for j in JOBS]
    one.run_until_idle()
    want = [got.tokens[i] for i in ids]
    assert want[0] == reference(model, JOBS[0]["prompt"], JOBS[0]["max_tokens"])
    src = Engine(model, max_slots=2, **kw)
    pre = Collect()
    ids = [src.submit(Request(on_output=pre, export=True, **j)) for j in JOBS]
    src.run_until_idle()
    assert_no_leak(src)
    dst = Engine(model, max_slots=3, **{**kw, "max_seq_len": 64})
    dst.submit(Request([1], 3))  # takes slot 0 first: the resumed ones land elsewhere
    more = Collect()
    res = []
    for i, j in zip(ids, JOBS):
        assert pre.final[i].finish_reason == "exported" and len(pre.tokens[i]) == 1
        res.append(dst.submit(Request([], j["max_tokens"], temperature=j.get("temperature", 0.0),
                                      top_p=j.get("top_p", 1.0), resume_from=pre.final[i].state, on_output=more)))
    dst.run_until_idle()
    for k, (i, r) in enumerate(zip(ids, res)):
        assert pre.tokens[i] + more.tokens[r] == want[k], k
    assert dst.stats["imports"] == 2
    assert_no_leak(dst)
    other = Engine(model, max_slots=1, **{**kw, "mode": "conventional" if mode == "replay" else "replay"})
    with pytest.raises(RequestError, match=f"ssm_mode: '{mode}' in the state"):
        other.submit(Request([], 12, resume_from=pre.final[ids[0]].state))
    assert other.pending() == 0


def test_prefix_cache_reuses_a_shared_prompt_prefix(kimi):
    """The engine's prefix cache (snapshots of transformers' cache: the KDA layers' conv and recurrent states, the MLA
    latents) with a shared 8-token prefix: the later prompts start from it (only their suffix is computed), and every
    request's tokens still equal generate."""
    check_prefix_cache(kimi[0], L)


# ---- CUDA: the KDA kernels behind the same engine ----------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_engine_matches_generate():
    """The engine on CUDA (the KDA kernels: kda_replay_decode on the cache's rings, kda_conventional_step; fp32
    weights and state; the step runs eagerly, capturable is False) gives transformers' greedy tokens (computed on the
    CPU) in conventional and ReplaySSM modes, and completes in the bf16 shadow mode (whose rounding may move a
    token)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check_cuda_engine(tiny_model("kimi_linear", seed=0), tiny_model("kimi_linear", seed=0, device="cuda"), L, MODES)

