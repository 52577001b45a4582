# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding driver of the exported verify + commit graphs, shared by tests/test_spec_builder.py
(Nemotron-H / Nemotron 3) and tests/test_gdn_spec_builder.py (Qwen3-Next / Qwen3.5): runners (the graphs
in onnxruntime or the modules in PyTorch), the per-row decode loop and the acceptance rules."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class OrtRunner:
    def __init__(self, step, commit, sv, sc):
        self.step, self.commit_m, self.sv, self.sc = step, commit, sv, sc

    def verify(self, ids, lengths, cursor, states):
        from builders.ort_reference import feed, to_torch

        got = self.sv.run(None, feed(self.step.input_names(), [ids, lengths, cursor, *states]))
        return torch.from_numpy(got[0]), [to_torch(a, s.dtype) for a, s in zip(got[1:], self.step.state_specs())]

    def commit(self, n, cursor, lengths, windows):
        feed = [t.numpy().copy() for t in (n, cursor, lengths, *windows)]
        got = [torch.from_numpy(a) for a in self.sc.run(None, dict(zip(self.commit_m.input_names(), feed)))]
        return got[0], got[1], got[2:]


class ModuleRunner(OrtRunner):
    @torch.no_grad()
    def verify(self, ids, lengths, cursor, states):
        out = self.step(ids, lengths, cursor, *states)
        return out[0], list(out[1:])

    @torch.no_grad()
    def commit(self, n, cursor, lengths, windows):
        out = self.commit_m(n, cursor, lengths, *windows)
        return out[0], out[1], list(out[2:])


# ---- spec decoding driver -------------------------------------------------------------------------------------
class SpecDecode:
    """Rows with their own prompts, handed off to the spec graphs after prefill + ``pre_decode`` standard
    ReplaySSM decode steps of the model patched by ``patch(model, buffer_len=...)`` (builders'
    patch_replayssm or patch_gdn_replayssm), row b's ring rotated to start ``starts[b]``."""

    @torch.no_grad()
    def __init__(self, model, step, prompts, patch, pre_decode: int, starts):
        self.model, self.step = model, step
        T, L = step.num_tokens, step.buffer_len
        self.prompts = prompts
        self.tokens = []  # per row: tokens after the prompt, the last one sampled but not yet in the caches
        per_row = []
        for b, prompt in enumerate(prompts):
            dec = patch(model, buffer_len=L)
            try:
                cache = DynamicCache(config=model.config)
                tok = model(prompt[None], cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                toks = [int(tok)]
                for _ in range(pre_decode):
                    tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                    toks.append(int(tok))
                per_row.append(step.states_from_patched(dec, cache, len(prompt) + pre_decode, start=starts[b]))
            finally:
                dec.unpatch()
            self.tokens.append(toks)
        self.cursor = torch.cat([c for c, _ in per_row])
        self.states = [torch.cat(ts) for ts in zip(*(s for _, s in per_row))]
        self.lengths = torch.tensor([len(p) + pre_decode for p in prompts], dtype=torch.int32)
        self.names = [s.name for s in step.state_specs()]
        self.records = [[] for _ in prompts]  # per row: (token, its verify logits) of committed positions
        self.flushes = [0] * len(prompts)
        self.T, self.L = T, L

    def window_of(self, states):
        return [t for n, t in zip(self.names, states) if n.startswith("conv_window_")]

    def run_step(self, runner, drafts, accept):
        """One verify + accept + commit; ``accept(ids, logits) -> n (batch,) int32``."""
        last = torch.tensor([t[-1] for t in self.tokens])
        ids = torch.cat([last[:, None], drafts], dim=1)
        for b in range(len(self.tokens)):
            self.flushes[b] += int(self.cursor[b, 1]) + 2 * self.T > self.L
        logits, states = runner.verify(ids, self.lengths, self.cursor, self.states)
        n = accept(ids, logits)
        for b in range(len(self.tokens)):
            k = int(n[b])
            self.records[b] += [(int(ids[b, t]), logits[b, t].clone()) for t in range(k)]
            self.tokens[b] += [int(ids[b, t]) for t in range(1, k)] + [int(logits[b, k - 1].argmax())]
        cursor, lengths, windows = runner.commit(n, self.cursor, self.lengths, self.window_of(states))
        it = iter(windows)
        self.states = [next(it) if name.startswith("conv_window_") else t for name, t in zip(self.names, states)]
        self.cursor, self.lengths = cursor, lengths
        return ids, logits, n


def check_shadow_spec(run: SpecDecode, ort: OrtRunner, mod: ModuleRunner, drafts, accept, steps: int,
                      shadow_prefix: str) -> None:
    """Speculative steps of verify graphs with a checkpoint shadow (``shadow_prefix``: ssm_shadow / gdn_shadow;
    an fp8 shadow's ``<prefix>_scale_i`` follows it): the onnxruntime graphs against the PyTorch verify step on
    the same inputs (logits, every state but the commit-rolled conv windows; the shadow within one ulp of its
    format, its flushed checkpoints differing in the last bits), and the shadow states = quantize_shadow of the
    stored checkpoint after every fold, untouched without one (``drafts(gen) -> (batch, T - 1)``)."""
    from trtllm_replayssm.shadow import Shadow

    names = [s.name for s in run.step.state_specs()]
    shadows = [j for j, n in enumerate(names) if n.startswith(shadow_prefix + "_") and "_scale_" not in n]
    T, L = run.T, run.L
    for _ in range(steps):
        folds = run.cursor[:, 1] + 2 * T > L
        fp8 = run.states[shadows[0]].dtype == torch.float8_e4m3fn
        n = 2 if fp8 else 1
        before = {j + k: run.states[j + k].clone() for j in shadows for k in range(n)}
        ids = torch.cat([torch.tensor([t[-1] for t in run.tokens])[:, None], drafts()], dim=1)
        want, want_states = mod.verify(ids, run.lengths, run.cursor, run.states)
        _, logits, _ = run.run_step(ort, ids[:, 1:], accept)
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=2e-5)
        for j, (name, got, w) in enumerate(zip(names, run.states, want_states)):
            if name.startswith("conv_window_"):  # (the commit rolled the windows back)
                continue
            ulp = None if j not in before else (2 ** -2 if fp8 else 2 ** -7)
            tol = dict(rtol=1e-4, atol=2e-5) if ulp is None else dict(rtol=ulp, atol=1e-6)
            torch.testing.assert_close(got.float(), w.float(), **tol, msg=name)
        for j in shadows:
            sh = Shadow.of(run.states[j - 1], "fp8" if fp8 else "bf16")
            for k, q in enumerate([sh.q] if sh.scale is None else [sh.q, sh.scale]):
                got_k, old = run.states[j + k], before[j + k]
                assert torch.equal(got_k[folds], q[folds]), f"{names[j + k]} after a fold"
                assert torch.equal(got_k[~folds], old[~folds]), f"{names[j + k]} written without a fold"


def random_accept(gen, T: int):
    """n in 1..T per row, all T every 3rd step, 1 for row 0 every 4th."""
    step = [0]

    def accept(ids, logits):
        n = torch.randint(1, T + 1, (ids.shape[0],), generator=gen, dtype=torch.int32)
        if step[0] % 3 == 2:
            n[:] = T
        if step[0] % 4 == 3:
            n[0] = 1
        step[0] += 1
        return n

    return accept


def greedy_accept(ids, logits):
    """Accept drafts while each equals the greedy prediction of the position before it."""
    pred = logits.argmax(-1)  # (batch, T): the token each position predicts next
    n = torch.ones(ids.shape[0], dtype=torch.int32)
    for b in range(ids.shape[0]):
        while int(n[b]) < ids.shape[1] and int(ids[b, n[b]]) == int(pred[b, n[b] - 1]):
            n[b] += 1
    return n


# ---- the sequential oracle --------------------------------------------------------------------------------------
@torch.no_grad()
def sequential_check(model, run: SpecDecode, patch, buffer_len: int, pre_decode: int, rtol: float, atol: float,
                     ssm_layers, conv_kernel: int, attention_layers, ssm_state, check_state: bool = True) -> int:
    """Feed each row's committed tokens one at a time through the model patched by ``patch`` (the family's
    float64 ReplaySSM decode, its own ``buffer_len``); the verify logits of every accepted position must equal
    the sequential ones. With ``check_state``, at the end: the row's length, every SSM layer's committed state
    (``ssm_state(st, run, dec, row, layer) -> (got, want)``, float64) to 1e-5 relative, its last K-1 conv inputs
    and the attention layers' K/V positions to 1e-5. Returns the number of compared logits."""
    compared = 0
    for b, prompt in enumerate(run.prompts):
        dec = patch(model, buffer_len=buffer_len)
        try:
            cache = DynamicCache(config=model.config)
            tok = model(prompt[None], cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(pre_decode):
                tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            for i, (token, spec_logits) in enumerate(run.records[b]):
                want = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
                torch.testing.assert_close(spec_logits, want, rtol=rtol, atol=atol,
                                           msg=lambda m, b=b, i=i: f"row {b}, committed token {i}: {m}")
                compared += 1
            if not check_state:
                continue
            st = dict(zip(run.names, run.states))
            length = int(run.lengths[b])
            assert length == len(prompt) + pre_decode + len(run.records[b])
            K = conv_kernel
            for i in ssm_layers:
                got, want_s = ssm_state(st, run, dec, b, i)
                rel = float((got - want_s).norm() / want_s.norm())
                assert rel < 1e-5, (b, i, rel)
                torch.testing.assert_close(st[f"conv_window_{i}"][b, :, -(K - 1):], cache.get_conv_state(i)[0, :, 1:],
                                           rtol=1e-5, atol=1e-5)
            for i in attention_layers:
                layer = cache.layers[i]
                for name, want_kv in (("k_cache", layer.keys), ("v_cache", layer.values)):
                    torch.testing.assert_close(st[f"{name}_{i}"][b, :, :length], want_kv[0, :, :length],
                                               rtol=1e-5, atol=1e-5)
        finally:
            dec.unpatch()
    return compared


@torch.no_grad()
def check_greedy_acceptance(model, prompts, make_run, runner, steps: int, num_draft: int, vocab: int,
                            pre_decode: int, seed: int = 7) -> None:
    """Greedy acceptance of drafts taken from the unpatched model's greedy continuation (30% corrupted)
    reproduces plain greedy decoding token for token; accepted and rejected drafts both occur; every row
    crosses >= 2 flushes. ``make_run(prompts)`` -> :class:`SpecDecode` (built after the reference run)."""
    T = num_draft + 1
    new = pre_decode + 1 + steps * T
    ref = [model.generate(p[None], max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(p):].tolist()
           for p in prompts]
    run = make_run(prompts)
    assert all(run.tokens[b] == ref[b][:pre_decode + 1] for b in range(len(prompts)))
    gen = torch.Generator().manual_seed(seed)
    accepted = 0
    for _ in range(steps):
        drafts = torch.zeros(len(prompts), num_draft, dtype=torch.int64)
        for b, toks in enumerate(run.tokens):
            for i in range(num_draft):  # the greedy continuation, 30% corrupted
                good = ref[b][len(toks) + i]
                drafts[b, i] = good if torch.rand(1, generator=gen).item() > 0.3 else (good + 1) % vocab
        _, _, n = run.run_step(runner, drafts, greedy_accept)
        accepted += int(n.sum()) - len(prompts)
    for b in range(len(prompts)):
        assert run.tokens[b] == ref[b][:len(run.tokens[b])], b
    drafted = steps * len(prompts) * num_draft
    assert 0.2 * drafted < accepted < drafted, accepted  # both accepted and rejected drafts occurred
    assert min(run.flushes) >= 2, run.flushes
