# SPDX-License-Identifier: Apache-2.0
"""The generation engine with an 8-bit checkpoint (issue 38: mode ``replay_ckpt8``): greedy agreement with the model's
own ``generate`` (the float64 spec on the CPU; the kernel on CUDA in the GPU case).

An 8-bit checkpoint is lossy (one e4m3 rounding of the state at every flush, about 2^-4 relative per element with
stochastic rounding), so tokens are not equal by construction: the gate is agreement. Measured on the tiny
Nemotron-H: 120 of 120 greedy tokens (5 prompts x 24, L = 4: six flushes each) equal ``generate``'s; the gate asks
>= 95% and that the state the engine ran really is the 8-bit one (fp8 checkpoint, flush counts moving)."""

import pytest
import torch

from builders.generation import MODES, Engine, Request
from builders.random_model import build_model, model_config

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 9, 13, 200, 7], [1, 2], [100] * 11, [3, 4, 5, 6, 7, 8, 9], [250]]
N = 24


def _agreement(model, device):
    toks = {}
    eng = Engine(model, max_slots=3, max_seq_len=48, mode="replay_ckpt8", buffer_len=4)
    ids = [eng.submit(Request(p, N, on_output=lambda o: toks.setdefault(o.request_id, []).extend(o.token_ids)))
           for p in PROMPTS]
    eng.run_until_idle()
    cache = eng.step.ssm.cache
    assert cache.state.dtype == torch.float8_e4m3fn and cache.ckpt_flushes is not None
    assert int(cache.ckpt_flushes.max()) >= (N - 1) // 4  # the slots folded their rings into the 8-bit checkpoint
    agree = 0
    for p, i in zip(PROMPTS, ids):
        ref = model.generate(torch.tensor([p], device=device), max_new_tokens=N, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert len(toks[i]) == N
        agree += sum(a == b for a, b in zip(toks[i], ref))
    return agree / (N * len(PROMPTS))


def test_eight_bit_checkpoint_engine_agrees_with_generate():
    assert "replay_ckpt8" in MODES
    model = build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)
    assert _agreement(model, "cpu") >= 0.95


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eight_bit_checkpoint_engine_on_cuda():
    model = build_model(model_config(tiny=True), "cuda", torch.bfloat16, seed=0)
    assert _agreement(model, "cuda") >= 0.9  # bf16 activations on both sides; argmax ties may flip
