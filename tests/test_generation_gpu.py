# SPDX-License-Identifier: Apache-2.0
"""The generation engine on a GPU: the captured step (one CUDA graph per row prefix) serving in-flight batches.

Oracle: transformers' own ``generate`` (greedy) on the same fp32 tiny model on the same GPU, one prompt at a time;
the engine's fp32 kernels compute the same function (margins as in tests/test_generation.py). The bf16 / fp8 shadow
modes read a lossy checkpoint copy: they must serve every request to its length and leave every slot free.
"""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from builders.generation import Engine, Request  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402

from .test_generation import MAX_TOKENS, PROMPTS, Collect, assert_idle  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_cuda():
    return build_model(model_config(tiny=True), "cuda", torch.float32, seed=0)


def reference(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("mode", ["conventional", "replay", "replay_bf16", "replay_fp8"])
def test_graphs_serve_in_flight_batches(tiny_cuda, mode):
    eng = Engine(tiny_cuda, max_slots=3, max_seq_len=48, mode=mode, buffer_len=4)
    assert eng.cuda_graphs and sorted(eng.graphs) == [1, 2, 3]
    got = Collect()
    ids = [eng.submit(Request(p, m, on_output=got)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_idle()
    for p, m, i in zip(PROMPTS, MAX_TOKENS, ids):
        assert got.final[i].finish_reason == "length" and len(got.tokens[i]) == m
        if mode in ("conventional", "replay"):
            assert got.tokens[i] == reference(tiny_cuda, p, m), i
    assert_idle(eng)
    eng.shutdown()


def test_engine_thread_with_sampling_and_cancel(tiny_cuda):
    eng = Engine(tiny_cuda, max_slots=4, max_seq_len=64, mode="replay", buffer_len=4).start()
    got = Collect()
    a = eng.submit(Request(PROMPTS[0], 20, temperature=0.8, top_p=0.9, seed=3, on_output=got))
    b = eng.submit(Request(PROMPTS[1], 40, on_output=got))
    eng.cancel(b)
    import time

    deadline = time.time() + 60
    while len(got.final) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert got.final[a].finish_reason == "length" and got.final[b].finish_reason == "cancelled"
    eng.shutdown()
    assert_idle(eng)
