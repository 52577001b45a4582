# SPDX-License-Identifier: Apache-2.0
"""The generation engine (builders/generation.py) serving GLM-5 Next through its decode step (builders/glm5_step.py
``Glm5Step``: KimiStep's KDA layers, transformers' DSA attention module over per-row latents and indexer states,
the hyper-connection streams, MoE) on the CPU.

Oracles:
- transformers' own ``generate`` (greedy, fp32 weights) on the seeded tiny GLM-5 Next (builders/kda.py
  ``TINY_GLM5_NEXT``: 3 KDA layers with the gate bounded at -5, 1 DSA layer whose indexer picks 2 pools of 4 plus the
  open tail, so prompts of 7+ tokens attend sparsely; hyper-connections of 4 streams; a dense MLP then MoE), one prompt
  at a time: the engine's tokens must be equal, token for token (the float64 KDA spec on the CPU; ReplaySSM's bf16 u
  ring (DESIGN §5) moves the logits by ~2e-4, far below the tiny model's top-2 gaps).
- the model's own forward over prompt + generated tokens: the step's logits at every position. Conventional mode
  1e-5 (fp32 rounding of another summation order; measured 4.5e-7); ReplaySSM 2e-3 (the bf16 u ring; measured 2e-4).
- teeth: a hyper-connection mix without comb's transpose moves the logits by 1.3e-2 (the logits oracle catches it,
  greedy tokens alone do not); a dense DSA (the indexer's top-k widened to every pool) or an indexer without the
  open tail changes the long requests' tokens (the selection is exercised).
- the batched prefill's hand-off against each prompt's own prefill (1e-5: fp32 rounding of another padding),
  bookkeeping exactly; preemption, swap and the prefill/decode hand-off against the same engine with enough slots,
  exactly (a slot crosses bit for bit).
"""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from builders.generation import STEPS, Engine, Request, RequestError, make_step  # noqa: E402
from builders.glm5_step import Glm5Step  # noqa: E402
from builders.kda import text_model, tiny_model  # noqa: E402
from builders.kimi_step import MODES  # noqa: E402

from .test_generation import (  # noqa: E402
    MAX_TOKENS,
    PROMPTS,
    Collect,
    assert_idle,
    check_cuda_engine,
    check_prefix_cache,
    reference,
)
from .test_preemption import assert_no_leak, check_preemption, check_swap_round_trip  # noqa: E402,E501

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5  # module docstring
L = 4
# a DSA layer sharing the previous one's top-k (indexer_types "shared") after one that runs its own
SHARED = dict(layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
              indexer_types=["full", "full", "shared", "full"])


@pytest.fixture(scope="module")
def glm():
    """(the tiny GLM-5 Next, the greedy references of PROMPTS / MAX_TOKENS)."""
    model = tiny_model("glm5_next", seed=0)
    return model, [reference(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def _staggered(eng, got):
    """Three requests first (prefilled together, left-padded), two more after three decode steps (one waits for a
    freed slot on a 3-slot engine); returns their ids."""
    ids = [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS[:3], MAX_TOKENS[:3])]
    for _ in range(3):
        eng.step_once()
    assert len(eng.live) == 3 and all(len(got.tokens[i]) >= 2 for i in ids)  # decoding before the others arrive
    ids += [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS[3:], MAX_TOKENS[3:])]
    eng.run_until_idle()
    return ids


@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_generate_with_requests_arriving_while_others_decode(glm, mode):
    """Five requests of 1 to 11 tokens on three slots, rows joining at different steps: every request's tokens equal
    transformers' generate, in every mode; every slot free at the end."""
    model, refs = glm
    eng = Engine(model, max_slots=3, max_seq_len=40, mode=mode, buffer_len=L)
    assert type(eng.step) is Glm5Step and eng.step.ssm.name == mode and not eng.cuda_graphs
    assert eng.vocab == 256  # from the composite config's text config
    got = Collect()
    ids = _staggered(eng, got)
    for p, m, i, want in zip(PROMPTS, MAX_TOKENS, ids, refs):
        assert got.tokens[i] == want, (mode, i)
        f = got.final[i]
        assert (f.finish_reason, f.prompt_tokens, f.completion_tokens) == ("length", len(p), m)
    assert_idle(eng)


def _decode_logits(model, prompt, n, mode):
    """(tokens, the step's logits of n decode steps) of one request."""
    eng = Engine(model, max_slots=2, max_seq_len=40, mode=mode, buffer_len=L)
    eng.submit(Request(prompt, n + 1))
    eng._admit()
    toks, rows = [int(eng.step.ids[0])], []
    for _ in range(n):
        eng.step_once()
        rows.append(eng.step.logits[0].clone())
        toks.append(int(eng.step.ids[0]))
    return toks, torch.stack(rows)


@pytest.mark.parametrize("mode, tol", [("conventional", TOL), ("replay", 2e-3)])  # module docstring
def test_step_logits_equal_the_models_forward_and_the_mix_has_teeth(glm, mode, tol, monkeypatch):
    """Every decode step's logits equal the model's own forward over prompt + generated tokens at that position (a
    12-token prompt: the DSA selects 2 of 3-5 pools plus the tail; 8 steps fold the L = 4 rings twice). Teeth: the
    block exit without comb's transpose leaves that tolerance."""
    import builders.glm5_step as gs

    model, _ = glm
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    toks, got = _decode_logits(model, prompt, 8, mode)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt):]
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    real = gs._mix
    monkeypatch.setattr(gs, "_mix", lambda post, comb, y, s: real(post, comb.transpose(-1, -2), y, s))
    _, bad = _decode_logits(model, prompt, 8, mode)
    assert float((bad - want).abs().max()) > 5 * tol


def test_dsa_selection_is_exercised(glm, monkeypatch):
    """Teeth for the sparse attention: with the indexer's top-k widened to every pool (dense attention), or without
    the open tail, some requests' tokens leave generate's (the step's DSA is the model's selection, not a dense
    stand-in that happens to agree)."""
    model, refs = glm
    ix = text_model(model).layers[3].self_attn.indexer
    for attr, value in (("index_topk", 64), ("index_kpool_always_select_tail", False)):
        with monkeypatch.context() as mp:
            mp.setattr(ix, attr, value)
            got = Collect()
            ids = _staggered(Engine(model, max_slots=3, max_seq_len=40, mode="conventional", buffer_len=L), got)
        assert [got.tokens[i] for i in ids] != refs, attr


@pytest.mark.parametrize("mode", ["conventional", "replay"])
def test_batched_prefill_hands_each_row_its_own_prefill(glm, mode):
    """Three prompts of 5, 2 and 11 tokens prefilled in one left-padded batch: each slot's length, conv window,
    DSA latents and indexer state (the prompt's, zeros past it: valid 0), recurrent state (ReplaySSM: the checkpoint,
    rings empty, cursor 0) and first token equal those of the prompt's own prefill."""
    from transformers import DynamicCache

    model, _ = glm
    eng = Engine(model, max_slots=4, max_seq_len=32, mode=mode, buffer_len=L)
    firsts = {}
    prompts = PROMPTS[:3]
    for p in prompts:
        eng.submit(Request(p, 4, on_output=lambda o, p=tuple(p): firsts.setdefault(p, o.token_ids[0])))
    eng._admit()
    step = eng.step
    assert sorted(eng.live) == [0, 1, 2] and step.sbi.tolist() == [0, 1, 2, -1]
    assert step.kda == [0, 1, 2] and step.attn == [3] and step.v[3].shape[-1] == 0 + 2 * 32 + 1
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
            layer = cache.layers[i]
            theirs = {"k": layer.keys[0], "v": torch.cat([layer.values[0], layer.indexer_keys], dim=-1)}
            for name, mine in (("k", step.k[i]), ("v", step.v[i])):
                torch.testing.assert_close(mine[slot, :, :n], theirs[name], rtol=0, atol=TOL)
                assert not mine[slot, :, n:].any()
            assert torch.equal(step.v[i][slot, 0, :n, -1], torch.ones(n))  # the indexer's valid flag
    eng.run_until_idle()
    assert_idle(eng)


def test_shared_top_k_layer_equals_generate():
    """A DSA layer with ``indexer_types`` "shared" (it reuses the previous DSA layer's top-k; its per-position state is
    the latent alone) right after one with its own indexer: tokens equal generate in ReplaySSM mode."""
    model = tiny_model("glm5_next", seed=1, **SHARED)
    layers = text_model(model).layers
    assert layers[2].self_attn.indexer is None and layers[1].self_attn.next_skip_topk
    eng = Engine(model, max_slots=3, max_seq_len=40, mode="replay", buffer_len=L)
    assert eng.step.attn == [1, 2] and [eng.step.v[i].shape[-1] for i in (1, 2)] == [65, 0]
    got = Collect()
    ids = [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_idle()
    for p, m, i in zip(PROMPTS, MAX_TOKENS, ids):
        assert got.tokens[i] == reference(model, p, m), i
    assert_idle(eng)


def test_models_and_configs_are_checked(glm):
    """STEPS serves glm5_next with Glm5Step; Glm5Step refuses another model type and a first DSA layer that would
    share a top-k nobody computed (naming indexer_types); no fp8 KDA shadow; the KV capacity is enforced."""
    model, _ = glm
    assert type(make_step(model, 1, 8)) is Glm5Step and "glm5_next" in STEPS
    with pytest.raises(ValueError, match=r"expected a GLM-5 Next model \(model_type one of \('glm5_next',\)\), got "
                                         r"'kimi_linear'"):
        Glm5Step(tiny_model("kimi_linear", seed=0), 1, 8)
    bad = tiny_model("glm5_next", seed=0, indexer_types=["full", "full", "full", "shared"])
    with pytest.raises(ValueError, match=r"indexer_types: the first DSA layer \(3\) must run its own indexer"):
        make_step(bad, 1, 8)
    with pytest.raises(ValueError, match="no fp8 KDA shadow"):
        Engine(model, max_slots=1, max_seq_len=8, mode="replay_fp8")
    with pytest.raises(RequestError, match="exceed the KV capacity of 8"):
        Engine(model, max_slots=1, max_seq_len=8).submit(Request([1] * 5, 4))


# ---- preemption, the swap and the prefill/decode hand-off (KimiStep's, with the widened DSA state) ---------------
def test_preempted_requests_equal_a_run_with_enough_slots(glm):
    """6 requests (greedy and seeded sampled) on 2 slots, quantum 2: each swapped out and back in, into other slots;
    tokens equal the 6-slot run's (and generate's for the greedy ones); swap sizes are ``saved_nbytes``."""
    check_preemption(glm[0], "replay", L)


def test_swap_round_trip_is_bit_exact_per_slot(glm):
    """save_slot / load_saved into another row: the same bits in every per-slot tensor
    (next input, length, conv windows, DSA latents and indexer states, the cache slot);
    the saved tensors are ``saved_spec``'s; a corrupted saved state
    shows up (teeth). tests/test_preemption.py's check."""
    check_swap_round_trip(glm[0], L, next_name=lambda tensors: "v.3")


def test_prefill_here_decode_in_another_engine(glm):
    """Request(export=True) ends after its prefill with the state's bytes (its geometry names the composite model
    type and the DSA widths); another engine (3 slots, a longer K/V row, a busy slot 0) resumes it: first token +
    continuation == generate; an engine of a Kimi-Linear model refuses it, naming the model type."""
    model, _ = glm
    prompt, n = [5, 9, 13, 200, 7, 1, 2, 3, 4], 10
    src = Engine(model, max_slots=2, max_seq_len=48, mode="replay", buffer_len=L)
    pre = Collect()
    rid = src.submit(Request(prompt, n, export=True, on_output=pre))
    src.run_until_idle()
    assert pre.final[rid].finish_reason == "exported" and len(pre.tokens[rid]) == 1
    assert src.step.slot_geometry()["model_type"] == "glm5_next"
    dst = Engine(model, max_slots=3, max_seq_len=64, mode="replay", buffer_len=L)
    dst.submit(Request([1], 3))
    more = Collect()
    r = dst.submit(Request([], n, resume_from=pre.final[rid].state, on_output=more))
    dst.run_until_idle()
    assert pre.tokens[rid] + more.tokens[r] == reference(model, prompt, n)
    assert_no_leak(dst)
    kimi = Engine(tiny_model("kimi_linear", seed=0), max_slots=1, max_seq_len=48, mode="replay", buffer_len=L)
    with pytest.raises(RequestError, match="model_type: 'glm5_next' in the state"):
        kimi.submit(Request([], n, resume_from=pre.final[rid].state))


def test_prefix_cache_reuses_a_shared_prompt_prefix(glm):
    """The engine's prefix cache (deep copies of transformers' cache: the KDA layers' conv and recurrent states, the
    DSA layers' latents and indexer keys) with a shared 8-token prefix: later prompts compute only their suffix, and
    every request's tokens still equal generate."""
    check_prefix_cache(glm[0], L)


# ---- CUDA: the KDA kernels behind the same step -------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_engine_matches_generate():
    """The engine on CUDA (KimiStep's KDA modes: kda_replay_decode on the cache's rings, kda_conventional_step with
    the bounded gate; fp32 weights; eager) gives transformers' greedy tokens (computed on the CPU) in conventional
    and ReplaySSM modes, and completes in the bf16 shadow mode (whose rounding may move a token)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check_cuda_engine(tiny_model("glm5_next", seed=0), tiny_model("glm5_next", seed=0, device="cuda"), L, MODES)
