# SPDX-License-Identifier: Apache-2.0
"""The generation engine (builders/generation.py) serving Qwen3-Next, Qwen3.5 and Qwen3.5 MoE through their decode
step (builders/qwen_step.py) on the CPU: in-flight batching, batched prefill, the SSM modes.

Oracle: transformers' own ``generate`` (greedy, fp32 weights) on the same seeded tiny model (builders/qwen3_next.py's
embedded configs: 3 Gated DeltaNet layers + 1 gated attention layer, Qwen3-Next's and Qwen3.5 MoE's sparse MoE), one
prompt at a time. The engine's tokens must be equal, token for token: its prefill is the model's own forward and its
decode step computes the same function in another order (the float64 GDN reference on the CPU; the tiny models'
top-2 logit gaps are far above fp32 rounding, as in tests/test_generation.py). The batched prefill's hand-off is
checked against each prompt's own prefill (1e-5 on values of order 1: fp32 rounding of another padding / chunking;
measured <= 1.1e-6), bookkeeping exactly.
"""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from builders.generation import MODES, STEPS, Engine, Request, RequestError, make_step  # noqa: E402
from builders.qwen3_next import FAMILIES, tiny_model  # noqa: E402

from .test_generation import (  # noqa: E402  (the engine tests' prompts, oracle and bookkeeping)
    MAX_TOKENS,
    PROMPTS,
    Collect,
    assert_idle,
    check_seeded_sampling,
    reference,
)

pytestmark = pytest.mark.usefixtures("one_thread")
# PROMPTS / MAX_TOKENS of the Nemotron tests (L = 4: the longer ones fold their rings three times)
QWEN_MODES = ("conventional", "replay", "replay_bf16")
TOL = 1e-5  # module docstring


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(family name, its tiny model, the greedy references of PROMPTS / MAX_TOKENS)."""
    model = tiny_model(request.param, seed=0)
    return request.param, model, [reference(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen3_next", seed=0)


@pytest.mark.parametrize("mode", QWEN_MODES)
def test_greedy_equals_generate_with_more_requests_than_slots(family, mode):
    """Five requests on three slots (two wait in the queue, then take freed slots; the first three are prefilled
    together, left-padded): every request's tokens equal transformers' generate, in every mode."""
    name, model, refs = family
    eng = Engine(model, max_slots=3, max_seq_len=40, mode=mode, buffer_len=4)
    assert type(eng.step).__name__ == "QwenStep" and eng.step.ssm.name == mode and not eng.cuda_graphs
    got = Collect()
    ids = [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_idle()
    for p, m, i, want in zip(PROMPTS, MAX_TOKENS, ids, refs):
        assert got.tokens[i] == want, (name, mode, i)
        f = got.final[i]
        assert (f.finish_reason, f.prompt_tokens, f.completion_tokens) == ("length", len(p), m)
    assert_idle(eng)


@pytest.mark.parametrize("mode", ["conventional", "replay"])
def test_batched_prefill_hands_each_row_its_own_prefill(qwen, mode):
    """Three prompts of 5, 2 and 11 tokens prefilled in one left-padded batch: each slot's length, conv window (the
    last K - 1 inputs), K/V (the prompt's, zeros past it), recurrent state (ReplaySSM: the checkpoint, rings empty)
    and first token equal those of the prompt's own prefill."""
    from transformers import DynamicCache

    eng = Engine(qwen, max_slots=4, max_seq_len=32, mode=mode, buffer_len=4)
    firsts = {}
    prompts = PROMPTS[:3]
    for p in prompts:
        eng.submit(Request(p, 4, on_output=lambda o, p=tuple(p): firsts.setdefault(p, o.token_ids[0])))
    eng._admit()  # the prefill of all three, no decode step
    step = eng.step
    assert sorted(eng.live) == [0, 1, 2] and step.sbi.tolist() == [0, 1, 2, -1]
    states = step.ssm.states()
    if mode == "replay":
        assert step.ssm.cache.cursor[:3].tolist() == [0, 0, 0]
    for slot, p in enumerate(prompts):
        n = len(p)
        cache = DynamicCache(config=qwen.config)
        with torch.no_grad():
            logits = qwen(input_ids=torch.tensor([p]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        assert firsts[tuple(p)] == int(logits.argmax()) and int(step.lengths[slot]) == n
        for i in step.gdn:
            torch.testing.assert_close(step.conv[i][slot], cache.get_conv_state(i)[0, :, 1:], rtol=0, atol=TOL)
            want = cache.get_recurrent_state(i)[0].transpose(-1, -2).double()
            torch.testing.assert_close(states[i][slot].double(), want, rtol=0, atol=TOL)
        for i in step.attn:
            for mine, theirs in ((step.k[i], cache.layers[i].keys), (step.v[i], cache.layers[i].values)):
                torch.testing.assert_close(mine[slot, :, :n], theirs[0], rtol=0, atol=TOL)
                assert not mine[slot, :, n:].any()
    eng.run_until_idle()
    assert_idle(eng)


def test_chunked_prefill_of_a_long_prompt(qwen):
    """A prompt longer than prefill_chunk is prefilled alone in chunks on one cache (the GDN layers continue their
    state and conv windows across chunks); short ones around it still batch. Tokens equal generate."""
    eng = Engine(qwen, max_slots=2, max_seq_len=48, mode="replay", buffer_len=8, prefill_chunk=4)
    got = Collect()
    prompts = [[7, 3, 11, 19, 2, 5, 8, 1, 4, 60, 33], [42, 17, 99], [9, 8]]
    ids = [eng.submit(Request(p, 9, on_output=got)) for p in prompts]
    eng.run_until_idle()
    for p, i in zip(prompts, ids):
        assert got.tokens[i] == reference(qwen, p, 9)
    assert_idle(eng)


def test_bf16_shadow_is_read_and_rewritten(qwen):
    """replay_bf16: the cache keeps a bf16 shadow of each fp32 checkpoint, rewritten at the prefill hand-off and by
    every fold, and non-flush steps read it: the logits stay within the shadow's rounding of the fp32 ReplaySSM
    step's and are not equal to them."""
    from trtllm_replayssm.shadow import quantize_shadow

    logits = {}
    for mode in ("replay", "replay_bf16"):
        eng = Engine(qwen, max_slots=1, max_seq_len=32, mode=mode, buffer_len=4)
        eng.submit(Request(PROMPTS[0], 12))
        eng._admit()
        rows = []
        for _ in range(9):  # two folds of the L = 4 ring
            eng.step_once()
            rows.append(eng.step.logits[0].clone())
        logits[mode] = torch.stack(rows)
        c = eng.step.ssm.cache
        if mode == "replay_bf16":
            t = c.group("gdn").t
            q = torch.empty(t["state"][:, 0].shape, dtype=torch.bfloat16)
            quantize_shadow(t["state"][:, 0], q, None)
            assert torch.equal(t["shadow"][:, 0].view(torch.uint8), q.view(torch.uint8))
        eng.run_until_idle()
    diff = float((logits["replay"] - logits["replay_bf16"]).abs().max())
    assert 0 < diff < 2e-2 * float(logits["replay"].abs().max()), diff


def test_modes_and_families_are_checked(qwen):
    """No fp8 GDN shadow: replay_fp8 is refused by name before anything is allocated; a model of a family without a
    step is refused naming its model_type."""
    assert set(QWEN_MODES) < set(MODES)
    with pytest.raises(ValueError, match="no fp8 GDN shadow"):
        Engine(qwen, max_slots=1, max_seq_len=8, mode="replay_fp8")

    class Other:
        config = type("C", (), {"model_type": "llama"})()

    with pytest.raises(ValueError, match="no generation step for model_type 'llama'"):
        make_step(Other(), 1, 8)
    assert {"nemotron_h", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"} <= set(STEPS)
    with pytest.raises(RequestError, match="exceed the KV capacity of 8"):
        Engine(qwen, max_slots=1, max_seq_len=8).submit(Request([1] * 5, 4))


@pytest.mark.parametrize("mode", ["conventional", "replay"])
def test_failed_step_fails_its_requests_and_the_engine_goes_on(qwen, monkeypatch, mode):
    """A step that raises in the attention layer, after the three GDN layers ran (ReplaySSM: an open cache step with
    verified layers, closed by abort_step): its requests end with the error, their slots are free, and the next
    requests are served exactly (their slots' state comes whole from their own prefill)."""
    eng = Engine(qwen, max_slots=2, max_seq_len=32, mode=mode, buffer_len=4)
    got = Collect()
    a = eng.submit(Request(PROMPTS[0], 6, on_output=got))
    b = eng.submit(Request(PROMPTS[3], 6, on_output=got))
    eng.step_once()
    code = eng.step.layer_code
    monkeypatch.setattr(code, "_attention", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    eng.step_once()
    for i in (a, b):
        assert got.final[i].finish_reason == "error" and "injected" in got.final[i].error
    assert_idle(eng)
    monkeypatch.undo()
    c = eng.submit(Request(PROMPTS[2], 6, on_output=got))
    d = eng.submit(Request(PROMPTS[1], 9, on_output=got))
    eng.run_until_idle()
    assert got.tokens[c] == reference(qwen, PROMPTS[2], 6) and got.tokens[d] == reference(qwen, PROMPTS[1], 9)
    assert_idle(eng)


def test_seeded_sampling_is_reproducible_in_any_batch(qwen):
    check_seeded_sampling(qwen)


# ---- CUDA: the GDN kernels behind the same engine ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cuda_engine_matches_generate(name):
    """The engine on CUDA (the GDN kernels: gdn_replay_decode on the rings, gdn_conventional_step; fp32 weights and
    state, TF32 off; the step runs eagerly, capturable is False) gives transformers' greedy tokens (computed on the
    CPU) in conventional and ReplaySSM modes, and completes in the bf16 shadow mode."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        cpu = tiny_model(name, seed=0)
    except ImportError as e:  # a device image with an older transformers (no Qwen3.5 classes)
        pytest.skip(f"transformers has no {name} model here: {e}")
    refs = [reference(cpu, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    model = tiny_model(name, seed=0, device="cuda")
    for mode in QWEN_MODES:
        eng = Engine(model, max_slots=3, max_seq_len=40, mode=mode, buffer_len=4)
        assert not eng.cuda_graphs
        got = Collect()
        ids = [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS, MAX_TOKENS)]
        eng.run_until_idle()
        for m, i, want in zip(MAX_TOKENS, ids, refs):
            if mode == "replay_bf16":
                assert len(got.tokens[i]) == m and got.final[i].finish_reason == "length"
            else:
                assert got.tokens[i] == want, (mode, i)
        assert_idle(eng)
