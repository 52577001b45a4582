# SPDX-License-Identifier: Apache-2.0
"""Test-only helpers shared by several test modules (the decode problems, shared with the benchmarks, are
trtllm_replayssm/problems.py)."""

from __future__ import annotations

import torch

from trtllm_replayssm import shadow as shadowq


def check_shadow(pb, s: int) -> None:
    """The shadow the kernel wrote for slot s == Shadow.write of the checkpoint it stored, bit for bit.

    ``pb``: a GPU test problem with H, P, N, shadow_kind, state, shadow, scale (kernel side) and
    ref_shadow (the float64 mirror's), which is then set to what the kernel will read."""
    want = shadowq.Shadow(1, pb.H, pb.P, pb.N, pb.shadow_kind)
    want.write(0, pb.state[s].cpu())
    got = pb.shadow[s].cpu()
    bad = (got.view(torch.uint8) != want.q[0].view(torch.uint8)).sum()
    assert bad == 0, f"shadow of slot {s}: {int(bad)} of {got.numel() * got.element_size()} bytes differ from Shadow.write"
    if pb.scale is not None:
        assert torch.equal(pb.scale[s].cpu(), want.scale[0]), f"fp8 row scales of slot {s} differ"
        pb.ref_shadow.scale[s] = want.scale[0]
    pb.ref_shadow.q[s] = got  # the mirror reads what the kernel will read


@torch.no_grad()
def check_beams_and_conversations(model, patch, buffer_len: int, atol: float) -> None:
    """A patched model (``patch(model, buffer_len=...)`` returns a decoder with ``unpatch()``) against itself
    unpatched: beam search over left-padded rows (reorder_cache must reorder our slots too); two conversations
    on two transformers caches interleaved (A, B, A: the buffers are folded back into A's cache when B takes
    over); unpatch() in the middle of a conversation (the cache gets the state our buffers hold)."""
    from transformers import DynamicCache

    def prompt(batch, length, seed):
        return torch.randint(2, 256, (batch, length), generator=torch.Generator().manual_seed(seed))

    ids = prompt(3, 9, 1)
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=3)
    ref_beams = model.generate(ids, **kw)
    dec = patch(model, buffer_len=buffer_len)
    try:
        beams = model.generate(ids, **kw)
    finally:
        dec.unpatch()
    assert torch.equal(beams, ref_beams), "beam search"

    a, b, more = prompt(1, 7, 1), prompt(1, 5, 3), prompt(1, 3, 2)

    def talk(cache, ids, n):
        tok = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(n):
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

    def run(mode):
        dec = patch(model, buffer_len=buffer_len) if mode else None
        try:
            cache_a = DynamicCache(config=model.config)
            talk(cache_a, a, 6)
            if mode == "interleave":
                talk(DynamicCache(config=model.config), b, 3)
            if mode == "unpatch":
                dec.unpatch()
                dec = None
            return model(more, cache=cache_a, use_cache=True).logits
        finally:
            if dec is not None:
                dec.unpatch()

    want = run(None)
    for mode in ("interleave", "unpatch"):
        torch.testing.assert_close(run(mode), want, rtol=0, atol=atol, msg=mode)


def check_forward_raising_mid_step(model, patch, buffer_len: int, atol: float) -> None:
    """A forward that raises after some mixers decoded (here: the last layer) leaves that cache unusable: the
    next decode and a continuation prefill of it are refused by name, also after a second cache broke the same
    way and after the decoder's reset(); unpatch() right after a raising forward aborts its step and writes
    nothing back into that cache; a new cache decodes exactly as the unpatched model."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(7)
    a, b = torch.randint(2, 256, (2, 6), generator=gen), torch.randint(2, 256, (1, 5), generator=gen)

    def talk(cache, ids, n):
        out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        for _ in range(n):
            out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
        return out

    last = model.model.layers[-1]

    def raising(cache, ids):
        orig = last.forward

        def boom(*args, **kw):
            raise KeyboardInterrupt("interrupted mid-step")

        last.forward = boom
        try:
            model(ids, cache=cache, use_cache=True)
            raise AssertionError("the forward should have raised")
        except KeyboardInterrupt:
            pass
        finally:
            last.forward = orig

    def refused(cache, ids):
        try:
            model(ids, cache=cache, use_cache=True)
            raise AssertionError("a broken cache was continued")
        except RuntimeError as e:
            assert "raised in the middle of a step" in str(e), e

    want = talk(DynamicCache(config=model.config), b, buffer_len + 2)
    dec = patch(model, buffer_len=buffer_len)
    try:
        cache_a = DynamicCache(config=model.config)
        tok = talk(cache_a, a, 2).argmax(-1)
        raising(cache_a, tok)
        for ids in (tok, a[:, :3]):  # decode, continuation prefill
            refused(cache_a, ids)
        cache_b = DynamicCache(config=model.config)  # a second cache breaks in its prefill
        raising(cache_b, b)
        refused(cache_b, b[:, :1])
        refused(cache_a, tok)  # the first one stays refused
        if hasattr(dec, "reset"):
            dec.reset()
            refused(cache_a, tok)
        got = talk(DynamicCache(config=model.config), b, buffer_len + 2)
    finally:
        dec.unpatch()  # must not write back into the broken caches (nor raise)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)

    # unpatch() right after the raising forward (no forward in between): the step is aborted, nothing written back
    dec = patch(model, buffer_len=buffer_len)
    cache_c = DynamicCache(config=model.config)
    tok = talk(cache_c, a, 2).argmax(-1)
    raising(cache_c, tok)
    def recurrent():
        out = []
        for i in range(len(cache_c.layers)):
            try:
                t = cache_c.get_recurrent_state(i)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError):  # not an SSM layer
                t = None
            out.append(t.clone() if isinstance(t, torch.Tensor) else None)
        return out

    before = recurrent()
    assert any(t is not None for t in before)
    dec.unpatch()
    after = recurrent()
    assert all((x is None) == (y is None) and (x is None or torch.equal(x, y)) for x, y in zip(before, after))
    assert getattr(cache_c, "_replayssm_broken", False)


# --- CPU process groups (gloo) for the tensor-parallel tests -----------------------------------------------
#
# A rank has died of SIGABRT ("terminate called without an active exception", no Python traceback) in
# full-suite runs on 2-core CPU machines (2026-12-03 twice in test_tp_model, 2026-12-05 in CI in test_tp_step,
# after the rank had written its results and passed the closing barrier), never when a file runs alone. The
# message is a joinable std::thread being destroyed: gloo's worker threads torn down at process group or
# interpreter destruction (pytorch/pytorch#179291 describes the finalisation side). The tests do not test
# teardown, so a rank ends with ``end_rank``: every rank past a barrier (the results are written), then the
# process leaves without running destructors. ``spawn_ranks`` still retries once, on a fresh rendezvous, a
# rank killed by a signal; a Python error in a rank, or wrong results (asserted by the callers), never are.

def end_rank() -> None:
    """Close a test rank: barrier (no peer still talking), then exit 0 without gloo's destructors."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, args_for, nprocs: int = 2):
    """``torch.multiprocessing.spawn(fn, args_for(attempt), nprocs)``; a rank dead of a signal is retried once.

    ``args_for(attempt)`` gives the rank arguments, with a rendezvous file and output path fresh per attempt."""
    import torch.multiprocessing as mp

    for attempt in range(2):
        try:
            mp.spawn(fn, args=args_for(attempt), nprocs=nprocs, join=True)
            return attempt
        except mp.ProcessExitedException as e:
            if attempt or e.signal_name is None:
                raise
