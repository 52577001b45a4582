# SPDX-License-Identifier: Apache-2.0
"""The Qwen3-Next / Qwen3.5 builders on the GPU: the CUDA GDN kernels inside transformers' own models and
inside the exported decode / verify steps, against the float64 reference paths the CPU tests check.

* Patched model on CUDA (builders/qwen3_next.py picks ``kernel_backend`` for a CUDA model): greedy
  decoding over 40 steps (L = 4, 9 flushes) equals the unpatched model's on the same GPU, token for
  token; logits within 1e-4 (fp32 kernel vs transformers' fp32 recurrence, both on O(0.2)-std logits).
* Decode step (:class:`QwenGDNDecodeStep`) with ``kernel_backend`` on CUDA vs the same step with the
  float64 ``reference_backend`` on the CPU, fed the same inputs every step (the CPU outputs carry both
  forward, so neither drifts off the other's trajectory): logits 1e-4 absolute, lengths / cursor
  exact, the GDN checkpoint and u/k/g/beta buffers to 1e-5 relative (fp32 vs float64 arithmetic stored
  in fp32), v buffers and conv windows exactly (copies of fp32 inputs computed by the same ops would
  differ only by the device's matmul rounding: 1e-5), K/V caches to 1e-5.
* Verify step (:class:`QwenGDNDecodeStep` with num_draft > 0) with ``verify_kernel_backend`` likewise, 12 steps of random
  acceptance driven by tests/spec_driver.py (every row crosses flushes); the commit graph is run on the
  CPU output for both.
Teeth: a scaled committed u entry on the GPU input must move the decode logits far past the tolerance.
"""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from builders.qwen3_next import FAMILIES, kernel_backend, patch_gdn_replayssm, tiny_model  # noqa: E402
from builders.qwen_export import QwenGDNDecodeStep, verify_kernel_backend  # noqa: E402
from builders.spec_step import NemotronHSpecCommit  # noqa: E402

from .spec_driver import ModuleRunner, SpecDecode, random_accept  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

L, MAX_SEQ = 4, 96
LOGIT_ATOL, STATE_RTOL = 1e-4, 1e-5


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def models(request):
    cpu = tiny_model(request.param)
    return cpu, copy.deepcopy(cpu).cuda()


def _prompt(batch, length, seed=1):
    return torch.randint(2, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare(names, got, want, where):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (where, name)
        if not g.is_floating_point():
            assert torch.equal(g.cpu(), w), f"{where}: {name}"
        else:
            e = _rel(g, w)
            assert e < STATE_RTOL, f"{where}: {name} rel err {e:.2e} >= {STATE_RTOL}"


@torch.no_grad()
def test_patched_model_on_cuda_matches_unpatched(models):
    _, gpu = models
    ids = _prompt(2, 7).cuda()
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = gpu.generate(ids, **kw)
    dec = patch_gdn_replayssm(gpu, buffer_len=L)
    try:
        assert dec.backend is kernel_backend
        out = gpu.generate(ids, **kw)
    finally:
        dec.unpatch()
    assert torch.equal(out.sequences, ref.sequences)
    assert dec.cursor.tolist() == [39 % L] * 2
    err = float((torch.stack(out.scores) - torch.stack(ref.scores)).abs().max())
    assert err < LOGIT_ATOL, f"logits differ by {err:.2e}"


@torch.no_grad()
def _decode_states(model, step, batch=3, prompt=6):
    from transformers import DynamicCache

    dec = patch_gdn_replayssm(model, buffer_len=L)
    try:
        cache = DynamicCache(config=model.config)
        tok = model(_prompt(batch, prompt, seed=4), cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return tok, dec.cursor.clone(), step.states_from_patched(dec, cache, prompt), prompt
    finally:
        dec.unpatch()


@torch.no_grad()
def test_decode_step_kernel_backend_matches_reference(models):
    """3L + 1 steps side by side; teeth: once entries are buffered, the same GPU step with one committed u
    entry scaled by 3 must move the logits far past the tolerance."""
    cpu, gpu = models
    ref_step = QwenGDNDecodeStep(cpu, L, MAX_SEQ)
    dev_step = QwenGDNDecodeStep(gpu, L, MAX_SEQ, backend=kernel_backend)
    tok, cursor, states, prompt = _decode_states(cpu, ref_step)
    lengths = torch.full((tok.shape[0],), prompt, dtype=torch.int32)
    names = ["lengths", "cursor"] + [s.name for s in ref_step.state_specs()]
    u = next(i for i, n in enumerate(names[2:]) if n.startswith("gdn_u_"))
    teeth = False
    for s in range(3 * L + 1):
        want = ref_step(tok, lengths, cursor, *states)
        got = dev_step(tok.cuda(), lengths.cuda(), cursor.cuda(), *(t.cuda() for t in states))
        err = float((got[0].cpu() - want[0]).abs().max())
        assert err < LOGIT_ATOL, f"step {s}: logits differ by {err:.2e}"
        _compare(names, got[1:], want[1:], f"step {s}")
        if not teeth and int(cursor.min()) > 0:
            bad = [t.cuda() for t in states]
            bad[u][:, :, 0] *= 3
            wrong = dev_step(tok.cuda(), lengths.cuda(), cursor.cuda(), *bad)
            assert float((wrong[0].cpu() - want[0]).abs().max()) > 10 * LOGIT_ATOL, "teeth: corrupted u unnoticed"
            teeth = True
        tok = want[0].argmax(-1, keepdim=True)
        lengths, cursor, states = want[1], want[2], list(want[3:])
    assert teeth


class _DeviceRunner(ModuleRunner):
    """The verify step on CUDA (kernel backend) next to the CPU reference runner, on the same inputs."""

    def __init__(self, ref_runner, dev_step, names):
        super().__init__(ref_runner.step, ref_runner.commit_m, None, None)
        self.dev_step, self.names, self.steps = dev_step, names, 0

    @torch.no_grad()
    def verify(self, ids, lengths, cursor, states):
        logits, new = super().verify(ids, lengths, cursor, states)
        got = self.dev_step(ids.cuda(), lengths.cuda(), cursor.cuda(), *(t.cuda() for t in states))
        err = float((got[0].cpu() - logits).abs().max())
        assert err < LOGIT_ATOL, f"verify step {self.steps}: logits differ by {err:.2e}"
        _compare(self.names, got[1:], new, f"verify step {self.steps}")
        self.steps += 1
        return logits, new


def test_verify_step_kernel_backend_matches_reference(models):
    cpu, gpu = models
    num_draft, L_spec = 3, 16
    ref_step = QwenGDNDecodeStep(cpu, L_spec, MAX_SEQ, num_draft=num_draft)
    dev_step = QwenGDNDecodeStep(gpu, L_spec, MAX_SEQ, backend=verify_kernel_backend, num_draft=num_draft)
    prompts = [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 7, 6)]
    run = SpecDecode(cpu, ref_step, prompts, patch_gdn_replayssm, 2, (0, 11, 15))
    runner = _DeviceRunner(ModuleRunner(ref_step, NemotronHSpecCommit(ref_step), None, None), dev_step, run.names)
    gen, accept = torch.Generator().manual_seed(5), random_accept(torch.Generator().manual_seed(6), num_draft + 1)
    for _ in range(12):
        run.run_step(runner, torch.randint(0, 256, (len(prompts), num_draft), generator=gen), accept)
    assert runner.steps == 12 and min(run.flushes) >= 2
