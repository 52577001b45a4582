# SPDX-License-Identifier: Apache-2.0
"""The engine's prefix cache (builders/generation.py, issue 38, opt-in ``prefix_cache_tokens``) on the CPU.

Oracle: transformers' own ``generate`` (greedy, fp32) on the same seeded tiny models as tests/test_generation.py and
tests/test_generation_qwen.py, one prompt at a time: a request whose prefill starts from a cached snapshot (a deep
copy of transformers' cache after a block-aligned prefix) must give the same tokens. Counters exactly: hits, misses,
tokens computed and reused, entries, evictions under the budget. The CPU time to first token with and without a hit
is printed (``-s``), not asserted.
"""

import time

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from builders.generation import Engine, Request, block_keys  # noqa: E402
from builders.qwen3_next import tiny_model  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402

from .test_generation import Collect, assert_idle, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SYSTEM = [(7 * i + 3) % 250 for i in range(40)]  # a shared system prompt: 2 full blocks of 16 and 8 tokens
QUESTIONS = [[5, 9, 13], [200, 7, 1, 2, 3], [100] * 6]


@pytest.fixture(scope="module", params=["nemotron_h", "nemotron3", "qwen3_next", "qwen3_5"])
def model(request):
    if request.param == "nemotron_h":
        return build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    if request.param == "nemotron3":
        return build_model(model_config(tiny="nemotron3"), "cpu", torch.float32, seed=1)
    return tiny_model(request.param, seed=0)


def serve(eng, prompts, n):
    got = Collect()
    ids = [eng.submit(Request(p, n, on_output=got)) for p in prompts]
    eng.run_until_idle()
    return [got.tokens[i] for i in ids]


def test_shared_system_prompt_hits_and_equals_generate(model):
    """Three requests sharing a 40-token system prompt: the first misses and keeps a snapshot at 32 tokens (its longest
    block-aligned prefix); the next two copy it and compute only the rest. Tokens equal generate."""
    prompts = [SYSTEM + q for q in QUESTIONS]
    eng = Engine(model, max_slots=2, max_seq_len=64, mode="replay", buffer_len=4, prefix_cache_tokens=256)
    assert serve(eng, prompts, 8) == [reference(model, p, 8) for p in prompts]
    st = eng.stats
    assert (st["prefix_hits"], st["prefix_misses"], st["prefill_tokens_reused"]) == (2, 1, 64)
    assert st["prefill_tokens_computed"] == sum(map(len, prompts)) - 64
    assert st["prefix_entries"] == 1 and st["prefix_cached_tokens"] == 32 and st["prefix_cache_bytes"] > 0
    assert_idle(eng)


def test_branch_point_snapshot_serves_a_long_suffix(model):
    """Prompts whose own part passes a block boundary: the first keeps a snapshot past the shared part (useless to the
    others); the second keeps one at the deepest boundary the first passed too (16: where they branch), so the
    third hits it (and keeps its own 32). Tokens equal generate."""
    sys20 = SYSTEM[:20]
    prompts = [sys20 + [11 + i + 5 * k for i in range(20)] for k in range(3)]
    eng = Engine(model, max_slots=1, max_seq_len=64, mode="conventional", prefix_cache_tokens=256)
    assert serve(eng, prompts, 6) == [reference(model, p, 6) for p in prompts]
    st = eng.stats
    assert (st["prefix_hits"], st["prefix_misses"], st["prefill_tokens_reused"]) == (1, 2, 16)
    assert st["prefix_entries"] == 4 and st["prefix_cached_tokens"] == 32 + (16 + 32) + 32  # each its own 32


def test_prompt_equal_to_a_cached_prefix(model):
    """A prompt that is exactly a cached prefix computes nothing: the entry's last logits give the first token; its
    state is the decode's start. Then a longer prompt over it. Tokens equal generate."""
    eng = Engine(model, max_slots=2, max_seq_len=64, mode="replay", buffer_len=4, prefix_cache_tokens=256)
    p32 = SYSTEM[:32]
    assert serve(eng, [p32], 7) == [reference(model, p32, 7)]  # a miss: the snapshot at 32
    computed = eng.stats["prefill_tokens_computed"]
    assert serve(eng, [p32], 7) == [reference(model, p32, 7)]
    assert eng.stats["prefill_tokens_computed"] == computed and eng.stats["prefill_tokens_reused"] == 32
    assert serve(eng, [SYSTEM], 5) == [reference(model, SYSTEM, 5)]
    assert eng.stats["prefix_hits"] == 2 and eng.stats["prefill_tokens_reused"] == 64
    assert_idle(eng)


def test_eviction_under_the_budget():
    """Budget 48 tokens: entries of 32 and 16 tokens fit, a third evicts the least recently used; a prefix longer
    than the budget is not kept; an evicted prefix misses again."""
    model = build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    eng = Engine(model, max_slots=1, max_seq_len=96, mode="replay", buffer_len=4, prefix_cache_tokens=48)
    a, b, c = SYSTEM[:33], [9] * 17, [4] * 17
    serve(eng, [a, b], 3)
    st = eng.stats
    assert (st["prefix_entries"], st["prefix_cached_tokens"], st["prefix_evictions"]) == (2, 48, 0)
    serve(eng, [c], 3)  # evicts a (LRU)
    assert (st["prefix_entries"], st["prefix_cached_tokens"], st["prefix_evictions"]) == (2, 32, 1)
    assert serve(eng, [b + [1]], 4) == [reference(model, b + [1], 4)] and st["prefix_hits"] == 1
    assert serve(eng, [a], 4) == [reference(model, a, 4)] and st["prefix_hits"] == 1  # evicted: a miss
    serve(eng, [[3] * 70], 2)  # 64 block-aligned tokens > the budget: not kept
    assert st["prefix_cached_tokens"] <= 48 and all(len(e.tokens) <= 48 for e in eng._prefix.values())
    assert_idle(eng)


def test_entry_bytes_follow_the_memory_model():
    """An entry's bytes, counted on the snapshot, equal the model: per Mamba-2 layer costs.mamba2_state_bytes plus K
    conv inputs of conv_dim = H P + 2 G N (transformers keeps K, not K-1) and its int64 length, per attention layer
    K and V of the prefix's positions, and the last logits (fp32 tiny Nemotron-H: 3 Mamba-2, 2 attention layers)."""
    from trtllm_replayssm import costs

    model = build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    c = model.config
    eng = Engine(model, max_slots=1, max_seq_len=96, mode="conventional", prefix_cache_tokens=1024)
    serve(eng, [[1] * 17, [2] * 65], 1)
    kinds = c.layers_block_type
    n_ssm, n_attn = kinds.count("linear_attention"), kinds.count("full_attention")
    H, P, N, G, K = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.n_groups, c.conv_kernel
    fixed = n_ssm * (costs.mamba2_state_bytes(H, P, N) + K * (H * P + 2 * G * N) * 4 + 8) + c.vocab_size * 4
    per_token = n_attn * 2 * c.num_key_value_heads * c.head_dim * 4
    assert [e.nbytes for e in eng._prefix.values()] == [fixed + 16 * per_token, fixed + 64 * per_token]
    assert eng.stats["prefix_cache_bytes"] == 2 * fixed + 80 * per_token


def test_off_by_default():
    """No budget: no cache, no snapshots, batched prefill as before (the engine tests run this way)."""
    model = build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    eng = Engine(model, max_slots=3, max_seq_len=64, mode="replay", buffer_len=4)
    prompts = [SYSTEM + q for q in QUESTIONS]
    assert serve(eng, prompts, 4) == [reference(model, p, 4) for p in prompts]
    assert eng.prefix_cache_tokens == 0 and not eng._prefix
    assert eng.stats["prefix_hits"] == eng.stats["prefix_misses"] == 0
    assert eng.stats["prefill_tokens_computed"] == sum(map(len, prompts))
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        Engine(model, max_slots=1, max_seq_len=8, prefix_cache_tokens=-1)
    assert block_keys(SYSTEM, 16) == block_keys(SYSTEM[:32] + [1], 16) and len(block_keys(SYSTEM, 16)) == 2


def test_time_to_first_token_gain_is_printed():
    """CPU time to first token for a 256-token shared prefix + 8 tokens, with and without a hit (printed only)."""
    model = build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    sysp = [(3 * i + 1) % 250 for i in range(256)]
    eng = Engine(model, max_slots=1, max_seq_len=320, mode="replay", buffer_len=4, prefix_cache_tokens=1024,
                 prefix_block=64)

    def ttft(prompt):
        t0, first = time.perf_counter(), []
        eng.submit(Request(prompt, 1, on_output=lambda o: first.append(time.perf_counter())))
        eng.run_until_idle()
        return first[0] - t0

    cold = ttft(sysp + [1] * 8)
    warm = ttft(sysp + [2] * 8)
    assert eng.stats["prefix_hits"] == 1
    print(f"\nprefix cache, CPU time to first token (264-token prompt, 256 cached): miss {cold * 1e3:.1f} ms, "
          f"hit {warm * 1e3:.1f} ms ({cold / warm:.1f}x); entry bytes {eng.stats['prefix_cache_bytes']}")
