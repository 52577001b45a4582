#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""End-to-end speculative decoding benchmark: T-token verify steps through the whole hybrid model.

Model: as scripts/bench_decode.py (Nemotron-H-8B geometry, seeded random bf16 weights, ``--tiny``
for the CPU smoke path). One speculative step (:class:`builders.spec_step.HybridSpecStep`) feeds
T = 1 + num_draft tokens per row through every layer (attention with T causal queries over the KV
cache, MLPs and projections on batch*T tokens, conv1d over the (K-1+num_draft)-wide window, the SSM
verify per Mamba layer), then accepts, commits and gathers the next drafts on the device; the whole
step is one CUDA graph. Modes, everything but the SSM identical:

  standard      one-token ReplaySSM decode (bench_decode's ``replay`` mode): the baseline
  replay_spec   ReplaySSM spec: ``ops.replay_verify`` per layer + one ``ops.spec_commit`` per step
  native_spec   ``ops.native_spec_verify`` per layer (T state snapshots) + ``ops.native_spec_commit``
  spec_noop     the spec step without SSM work (timed once, at the acceptance closest to 0.8): the
                SSM share of a spec step = 1 - t(spec_noop) / t(mode)

Drafts with controlled acceptance: the target's own greedy continuation G (batch, n) is computed once
per batch with the conventional standard step; the draft table keeps each G token with probability
alpha (``--acceptances``, per position) and replaces the others by a different token. Acceptance is
the longest matching prefix plus the bonus token (the target's token at the first mismatch); the
expected tokens per step are sum_{k<T} alpha^k (T=4: 2.18 / 2.95 / 3.71 at alpha 0.6 / 0.8 / 0.95).
In the timed runs the drafts are compared with G, not with the live argmax (``--timed-target ref``,
default): a random bf16 model forks from its own greedy continuation on rounding noise within a few
steps (bench/NOTES.md), after which a live comparison would reject almost every draft and the
acceptance would no longer be controlled. The step still computes its argmax (same work); the
fraction of accepted positions where the bf16 argmax equals G is reported (``live_agreement``).
``--timed-target live`` compares with the live argmax instead (acceptance then measured, not set).

Exactness check (before anything is timed, per batch): on an fp32 twin of the model (same seeded
weights), every spec mode runs ``--check-steps`` live-target steps (drafts at ``--check-acceptance``,
so rejections, conv rollbacks and ReplaySSM flushes all happen) and the tokens it emits must equal
plain greedy decoding's (the conventional standard step's) tokens; the standard ReplaySSM baseline is
checked the same way. A row may fork only at a near tie of the reference (top-2 margin below
``--tie-rel`` x std(logits)), in at most ``--max-tie-frac`` of the rows (bench_decode's rule;
``--strict-check``: none). Anything else aborts, naming rows and positions. fp32 because in bf16 two
correct kernels (or one kernel at different GEMM shapes) give different tokens after a few steps.

Timing: per (mode, acceptance), restore the post-prompt snapshot, one warm-up run, then ``--reps``
samples of ``--steps`` graph replays between two CUDA events, each from the restored snapshot (same
path every sample); ms/step = median / steps. The standard mode times one flush cycle (L steps) per
sample. Tokens/s = accepted tokens of all rows per step / ms per step. CPU: eager, ``perf_counter``.

Memory (:func:`memory_model`, bytes per mode at serving time: weights + SSM state (+ rings for
ReplaySSM, + T fp32 snapshots per layer for native spec) + conv windows + KV cache + step scratch)
gives the largest batch within ``--mem-budget-gib`` (``max_batch``), reported per mode and context.
Before running, :func:`run_plan` (serving memory + the snapshot + the twin's weights) is printed for
every (batch, mode); pairs that do not fit the free GPU memory are skipped with the GiB they need.
``--time-budget-s`` skips the remaining batches when the next one would not finish in time (rows are
written after every batch, so a cut run keeps what it measured).

Bytes per step (:func:`step_bytes`; b rows, a = 2, s = 4, M Mamba / A attention layers, W weights):
  common      W + A*b*2*kvh*kv_len*hd*a (K, V dense) + conv windows + logits (b*T*V*(2+4+4))
  standard    bench_decode.step_bytes("replay")
  replay_spec + M*b*(state*(1 + f) + (m + T)*entry + T*entry),  f = flush share of steps,
              m = mean committed history (~(L - 2T)/2)
  native_spec + M*b*(state*(1 + T) + 2*state)   (verify: read + T snapshots; commit: copy)

Usage:
  python scripts/bench_spec_decode.py [--batches 1,32,64,128,256] [--acceptances 0.6,0.8,0.95]
         [--modes standard,replay_spec,native_spec,spec_noop] [--tiny] [--plot] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.graph_step import Conventional, HybridDecodeStep, Replay  # noqa: E402
from builders.spec_step import (  # noqa: E402
    HybridSpecStep,
    NativeSpec,
    NoOpSpec,
    ReplaySpec,
    designed_accepted_per_step,
    make_drafts,
)
from scripts import bench_decode as bd  # noqa: E402

MODES = ("standard", "replay_spec", "native_spec", "spec_noop")
SPEC_MODES = ("replay_spec", "native_spec", "spec_noop")
CHECKED = ("standard", "replay_spec", "native_spec")
GiB = 1 << 30
GateError = bd.GateError


# ---- memory ------------------------------------------------------------------------------------------------
def _geom(config):
    c = config
    kinds = list(c.layers_block_type)
    return dict(H=c.mamba_num_heads, P=c.mamba_head_dim, N=c.ssm_state_size, G=c.n_groups, K=c.conv_kernel,
                M=kinds.count("linear_attention"), A=kinds.count("full_attention"),
                conv_dim=c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size)


def memory_model(config, batch: int, kv_len: int, T: int, L: int, mode: str, weight_bytes: int,
                 act_bytes: int = 2) -> dict:
    """Bytes one mode needs on the GPU to serve ``batch`` rows of ``kv_len`` positions (fp32 SSM state).

    ssm: state (+ L-entry rings for ReplaySSM, + T fp32 snapshots per layer for native spec);
    conv: K columns (standard) or K-1+num_draft (spec); kv: dense K and V caches; scratch: the step's
    largest live activations (logits in bf16 and fp32 twice, the widest projection, attention scores)
    for b (standard) or b*T (spec) tokens, plus 1 GiB of workspace."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    g, c, a, b = _geom(config), config, act_bytes, batch
    H, P, N, G, M = g["H"], g["P"], g["N"], g["G"], g["M"]
    state = M * b * H * P * N * 4
    rings = M * b * (H * L * P * a + G * L * N * a + H * L * 4)
    ssm = {"standard": state + rings, "replay_spec": state + rings, "native_spec": state * (1 + T),
           "spec_noop": 0}[mode]
    spec = mode != "standard"
    conv = M * b * g["conv_dim"] * ((g["K"] - 2 + T) if spec else g["K"]) * a
    kv = g["A"] * 2 * b * c.num_key_value_heads * kv_len * c.head_dim * a
    tokens = b * (T if spec else 1)
    widest = max(2 * H * P + 2 * G * N + H, c.intermediate_size)
    scratch = (tokens * (c.vocab_size * (a + 4 + 4) + widest * a * 4)
               + 3 * b * c.num_attention_heads * (T if spec else 1) * kv_len * 4 + GiB)
    total = weight_bytes + ssm + conv + kv + scratch
    return dict(weights=weight_bytes, ssm=ssm, conv=conv, kv=kv, scratch=scratch, total=total)


def max_batch(config, budget_bytes: int, kv_len: int, T: int, L: int, mode: str, weight_bytes: int,
              act_bytes: int = 2, limit: int = 1 << 20) -> int:
    """Largest batch whose :func:`memory_model` total fits ``budget_bytes`` (0 if none)."""
    def fits(b):
        return memory_model(config, b, kv_len, T, L, mode, weight_bytes, act_bytes)["total"] <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def run_plan(config, batch: int, kv_len: int, T: int, L: int, mode: str, act_bytes: int = 2) -> dict:
    """Bytes besides the resident weights that the benchmark needs for one (batch, mode) on the GPU:
    the post-prompt snapshot (conventional state, K-wide conv, KV) + the larger of the prompt's
    conventional step and the mode's step. ``gpu_snapshot``: snapshot on the GPU; ``cpu_snapshot``:
    in host memory (restores then cross PCIe)."""
    g, a = _geom(config), act_bytes
    feed = memory_model(config, batch, kv_len, T, L, "standard", 0, a)
    state = g["M"] * batch * g["H"] * g["P"] * g["N"] * 4
    snapshot = state + feed["conv"] + feed["kv"]
    step = memory_model(config, batch, kv_len, T, L, mode, 0, a)["total"]
    live = max(step, feed["total"])
    return dict(gpu_snapshot=live + snapshot, cpu_snapshot=live, snapshot_bytes=snapshot)


def step_bytes(config, batch: int, kv_len: int, T: int, L: int, mode: str, weight_bytes: int,
               accepted: float | None = None, a: int = 2) -> int:
    """The bytes model of the module docstring for one step of ``mode`` (``accepted``: mean tokens per step)."""
    g, c, b = _geom(config), config, batch
    if mode == "standard":
        return bd.step_bytes(config, batch, kv_len, L, weight_bytes, "replay", a)
    H, P, N, G, M = g["H"], g["P"], g["N"], g["G"], g["M"]
    W = g["K"] - 2 + T
    common = (weight_bytes + g["A"] * b * 2 * c.num_key_value_heads * kv_len * c.head_dim * a
              + M * b * g["conv_dim"] * 4 * W * a + b * T * c.vocab_size * (2 + 4 + 4))
    state = H * P * N * 4
    entry = H * P * a + G * N * a + 4 * H
    acc = accepted if accepted is not None else float(T)
    flush_share = min(1.0, acc / (L - 2 * T + 1))
    ssm = {"replay_spec": state * (1 + flush_share) + ((L - 2 * T) / 2 + T) * entry + T * entry,
           "native_spec": state * (1 + T) + 2 * state, "spec_noop": 0}[mode]
    return int(common + M * b * ssm)


# ---- one batch ---------------------------------------------------------------------------------------------
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def capture(fn, restore, cuda: bool):
    """``fn`` itself on the CPU; on CUDA one eager warm-up call (compilation, host checks, cuBLAS
    handles: never inside the capture) on a side stream, then a graph of one call. State restored after."""
    if not cuda:
        return fn, None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    restore()
    return graph.replay, graph


def time_samples(run, restore, steps: int, warmup: int, reps: int, cuda: bool) -> list[float]:
    """ms per step of ``reps`` samples, each ``steps`` runs from a fresh ``restore()`` (not timed)."""
    for _ in range(warmup):
        restore()
        for _ in range(steps):
            run()
    out = []
    for _ in range(reps):
        restore()
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(steps):
                run()
            e1.record()
            e1.synchronize()
            out.append(e0.elapsed_time(e1) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            out.append((time.perf_counter() - t0) * 1e3 / steps)
    return out


def _spread(xs):
    xs = sorted(xs)
    return xs[max(0, int(0.9 * len(xs)) - 1)] - xs[int(0.1 * len(xs))]


def _backend(name, L, backends):
    if backends and name in backends:
        return backends[name]
    return {"replay_spec": lambda: ReplaySpec(L), "native_spec": NativeSpec, "spec_noop": NoOpSpec}[name]()


def prepare(model, batch: int, prompt: torch.Tensor, kv_len: int, table_len: int, snapshot_device=None):
    """Prompt through the conventional standard step, snapshot, then the greedy continuation.

    Returns (step, snap, G, margin): G (batch, table_len) int64 on the device, G[:, 0] = the first greedy
    token (the snapshot's ids); margin (batch, table_len) = top-2 logit gap / std of the logits that
    produced each G token (the near-tie rule of the check). The step is left after the continuation."""
    dev = next(model.parameters()).device
    step = HybridDecodeStep(model, batch, kv_len, Conventional())
    step.feed(prompt.to(dev))
    snap = step.snapshot(snapshot_device)
    G = torch.empty(batch, table_len, dtype=torch.int64, device=dev)
    margin = torch.empty(batch, table_len, dtype=torch.float32, device=dev)

    def record(t):
        G[:, t] = step.ids
        top = step.logits.topk(2, dim=-1).values
        margin[:, t] = (top[:, 0] - top[:, 1]) / step.logits.std(dim=-1)

    record(0)
    run, graph = capture(step, lambda: step.restore(snap), dev.type == "cuda")
    for t in range(1, table_len):
        run()
        record(t)
    del graph
    return step, snap, G, margin


def check_tokens(name, G, margin, got, n_valid, tie_rel, max_tie_frac, strict) -> dict:
    """Tokens a mode emitted (got, first n_valid[b] of row b) against the greedy reference G (CPU tensors)."""
    cols = torch.arange(G.shape[1])[None, :]
    merged = torch.where(cols < n_valid[:, None], got[:, :G.shape[1]], G)
    return bd.check_gate(name, G, margin, merged, tie_rel, max_tie_frac, strict)


def _free(cuda: bool) -> None:
    if cuda:
        torch.cuda.empty_cache()


def check_standard(std, snap, G, margin, L, check_steps, tie_rel, max_tie_frac, strict, cuda) -> dict:
    """The standard ReplaySSM step's greedy tokens from the snapshot against G (CPU tensors)."""
    std.set_ssm(Replay(L))
    std.restore(snap)
    run, graph = capture(std, lambda: std.restore(snap), cuda)
    n = check_steps + 1
    got = torch.empty(G.shape[0], n, dtype=torch.int64)
    got[:, 0] = G[:, 0]
    for t in range(check_steps):
        run()
        got[:, t + 1] = std.ids.cpu()
    return check_tokens("standard", G[:, :n], margin[:, :n], got, torch.full((G.shape[0],), n), tie_rel,
                        max_tie_frac, strict)


def check_spec(model, name, backend, snap, G, margin, drafts, kv_len, T, table_len, check_steps, tie_rel,
               max_tie_frac, strict, cuda) -> dict:
    """``check_steps`` live-target spec steps from the snapshot; the emitted tokens against G (margin: CPU)."""
    batch = G.shape[0]
    spec = HybridSpecStep(model, batch, kv_len, T, table_len, backend, live=True)
    try:
        spec.set_tables(G, drafts)
        spec.restore(snap)
        run, graph = capture(spec, lambda: spec.restore(snap), cuda)
        for _ in range(check_steps):
            run()
        pos = spec.pos.cpu()
        n = check_steps * T + 1
        r = check_tokens(name, G.cpu()[:, :n], margin[:, :n], spec.out.cpu(), pos.clamp(max=n), tie_rel,
                         max_tie_frac, strict)
        r.update(check_accepted_per_step=float((pos - 1).sum()) / (batch * check_steps),
                 check_partial_steps=int(spec.partial.sum()), check_min_emitted=int(pos.min()))
        return r
    finally:
        spec.free()


def time_standard(std, snap, L, warmup, reps, cuda) -> dict:
    std.set_ssm(Replay(L))
    std.restore(snap)
    run, graph = capture(std, lambda: std.restore(snap), cuda)
    ms = time_samples(run, lambda: std.restore(snap), L, warmup, reps, cuda)
    return dict(ms=statistics.median(ms), spread=_spread(ms), accepted_per_step=1.0, tokens_per_step=float(std.batch),
                steps=L, partial=None, agree=None)


def time_spec(model, backend, snap, G, tables: dict, kv_len, T, table_len, steps, warmup, reps, live, cuda) -> dict:
    """{alpha: timing} of one spec mode: one graph, the draft table swapped per acceptance."""
    batch = G.shape[0]
    spec = HybridSpecStep(model, batch, kv_len, T, table_len, backend, live=live)
    out = {}
    try:
        spec.set_tables(G, next(iter(tables.values())))
        spec.restore(snap)
        run, graph = capture(spec, lambda: spec.restore(snap), cuda)
        for a, drafts in tables.items():
            spec.set_tables(G, drafts)
            ms = time_samples(run, lambda: spec.restore(snap), steps, warmup, reps, cuda)
            pos = spec.pos.cpu()
            acc = int((pos - 1).sum())
            out[a] = dict(ms=statistics.median(ms), spread=_spread(ms), accepted_per_step=acc / (batch * steps),
                          tokens_per_step=acc / steps, steps=steps, partial=int(spec.partial.sum()) / (batch * steps),
                          agree=int(spec.agree.sum()) / max(1, acc))
        return out
    finally:
        spec.free()


def run_batch(model, batch: int, modes, *, T: int = 4, L: int = 16, acceptances=(0.8,), prompt_len: int = 32,
              steps: int = 16, warmup: int = 1, reps: int = 5, check_steps: int = 6, check_acceptance: float = 0.7,
              context: int = 1024, seed: int = 0, tie_rel: float = 1e-3, max_tie_frac: float = 0.05,
              strict_check: bool = False, timed_target: str = "ref", check_model=None, do_check: bool = True,
              backends: dict | None = None, snapshot_device=None, skip_modes=(), log=print) -> list[dict]:
    """Check (on ``check_model``, default ``model``) then time every mode at one batch size; returns rows.

    ``backends`` overrides a spec mode's backend object (the tests break one on purpose);
    ``skip_modes`` {mode: reason} are reported, not run. Raises :class:`GateError` when a check fails."""
    skip_modes = dict(skip_modes) if isinstance(skip_modes, dict) else {m: "skipped" for m in skip_modes}
    run_modes = [m for m in modes if m not in skip_modes]
    vocab = model.config.vocab_size
    table_len = max(steps, check_steps) * T + T + 1
    kv_len = max(context, prompt_len + table_len + T + 1, prompt_len + max(L, check_steps) + 1)
    gen = torch.Generator().manual_seed(seed + batch)
    prompt = torch.randint(2, vocab, (batch, prompt_len), generator=gen)
    draft_seed = seed * 7919 + batch
    cuda = next(model.parameters()).device.type == "cuda"
    checks = {}
    if do_check:  # live targets on the check model, before anything is timed
        cm = check_model if check_model is not None else model
        std, snap, G, margin = prepare(cm, batch, prompt, kv_len, table_len, snapshot_device)
        Gc, Mc = G.cpu(), margin.cpu()
        if "standard" in run_modes:
            checks["standard"] = check_standard(std, snap, Gc, Mc, L, check_steps, tie_rel, max_tie_frac, strict_check,
                                                cuda)
        std.ssm.free()
        _free(cuda)
        drafts = make_drafts(G, check_acceptance, vocab, torch.Generator().manual_seed(draft_seed))
        for name in run_modes:
            if name in ("replay_spec", "native_spec"):
                checks[name] = check_spec(cm, name, _backend(name, L, backends), snap, G, Mc, drafts, kv_len, T,
                                          table_len, check_steps, tie_rel, max_tie_frac, strict_check, cuda)
                _free(cuda)
        log(f"# batch {batch}: check passed: " + ", ".join(
            f"{k} {v['exact']}/{batch} exact" + (f" ({v['ties']} near-tie forks)" if v["ties"] else "")
            for k, v in checks.items()))
        std = snap = G = margin = None
        _free(cuda)

    std, snap, G, _ = prepare(model, batch, prompt, kv_len, table_len, snapshot_device)
    results = {}
    if "standard" in run_modes:
        results[("standard", None)] = time_standard(std, snap, L, warmup, reps, cuda)
    std.ssm.free()
    std = None
    _free(cuda)
    tables = {a: make_drafts(G, a, vocab, torch.Generator().manual_seed(draft_seed + int(a * 1000)))
              for a in acceptances}
    noop_alpha = min(acceptances, key=lambda a: abs(a - 0.8))
    for name in run_modes:
        if name == "standard":
            continue
        tab = {noop_alpha: tables[noop_alpha]} if name == "spec_noop" else tables
        for a, r in time_spec(model, _backend(name, L, backends), snap, G, tab, kv_len, T, table_len, steps, warmup,
                              reps, timed_target == "live", cuda).items():
            results[(name, a)] = r
        _free(cuda)
    snap = G = None
    _free(cuda)

    # ---- rows -----------------------------------------------------------------------------------------
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    std_r = results.get(("standard", None))
    rows = []
    for (name, a), r in results.items():
        tps = r["tokens_per_step"] / (r["ms"] * 1e-3)
        nat = results.get(("native_spec", a)) if name == "replay_spec" else None
        noop = results.get(("spec_noop", noop_alpha)) if name in ("replay_spec", "native_spec") else None
        nbytes = step_bytes(cfg, batch, kv_len, T, L, name, weight_bytes, r["accepted_per_step"])
        chk = checks.get(name)
        row = dict(batch=batch, mode=name, acceptance=a, T=T if name != "standard" else 1, num_draft=T - 1,
                   ms_step=r["ms"], spread_ms=r["spread"], steps_per_sample=r["steps"], reps=reps,
                   accepted_per_step=r["accepted_per_step"],
                   designed_accepted_per_step=None if a is None else designed_accepted_per_step(a, T),
                   tokens_per_s=tps,
                   speedup_vs_standard=None if std_r is None else tps / (std_r["tokens_per_step"] / (std_r["ms"] * 1e-3)),
                   step_time_vs_standard=None if std_r is None else r["ms"] / std_r["ms"],
                   speedup_vs_native=None if nat is None else tps / (nat["tokens_per_step"] / (nat["ms"] * 1e-3)),
                   ssm_share=None if noop is None else 1 - noop["ms"] / r["ms"],
                   partial_step_frac=r["partial"], live_agreement=r["agree"],
                   timed_target=None if name == "standard" else timed_target,
                   bytes_step=nbytes, tbps=nbytes / (r["ms"] * 1e-3) / 1e12,
                   timing="cuda-graph" if cuda else "eager-cpu (perf_counter)", buffer_len=L, kv_len=kv_len,
                   prompt_len=prompt_len,
                   check=("not checked (no SSM)" if name == "spec_noop" else
                          "not run" if chk is None else "exact" if chk["ties"] == 0 else f"{chk['ties']} near-tie forks"),
                   check_exact=None if chk is None else chk["exact"], check_ties=None if chk is None else chk["ties"],
                   check_steps=check_steps if chk else None, check_acceptance=check_acceptance if chk else None,
                   check_accepted_per_step=None if chk is None else chk.get("check_accepted_per_step"),
                   check_partial_steps=None if chk is None else chk.get("check_partial_steps"))
        rows.append(row)
    for name, why in skip_modes.items():
        if name in modes:
            rows.append(dict(batch=batch, mode=name, skipped=True, reason=why))
    return rows


# ---- driver -------------------------------------------------------------------------------------------------
def print_plan(config, batches, modes, kv_len, T, L, act_bytes, check_act_bytes, free, weights_resident):
    print(f"# memory plan (GiB besides {weights_resident / GiB:.1f} GiB of resident weights; free {free / GiB:.1f} GiB):")
    print(f"# {'batch':>5s} " + " ".join(f"{m:>22s}" for m in modes))
    for b in batches:
        cells = []
        for m in modes:
            p = run_plan(config, b, kv_len, T, L, m, act_bytes)
            q = run_plan(config, b, kv_len, T, L, m, check_act_bytes) if m in CHECKED else p
            need = max(p["gpu_snapshot"], q["gpu_snapshot"])
            cells.append(f"{need / GiB:8.1f}" + (" fits" if need <= free else " host-snap" if
                                                   max(p["cpu_snapshot"], q["cpu_snapshot"]) <= free else " SKIP") + "        ")
        print(f"# {b:5d} " + " ".join(f"{c:>22s}" for c in cells))


def print_table(rows):
    print(f"{'batch':>5s} {'mode':12s} {'alpha':>5s} {'ms/step':>8s} {'acc/step':>8s} {'tok/s':>10s} {'x std':>6s} "
          f"{'x native':>8s} {'SSM':>6s} {'agree':>6s}  check")
    for r in rows:
        if r.get("skipped"):
            print(f"{r['batch']:5d} {r['mode']:12s} skipped: {r['reason']}")
            continue
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        print(f"{r['batch']:5d} {r['mode']:12s} {f(r['acceptance'], '5.2f'):>5s} {r['ms_step']:8.3f} "
              f"{r['accepted_per_step']:8.2f} {r['tokens_per_s']:10.0f} {f(r['speedup_vs_standard'], '6.2f'):>6s} "
              f"{f(r['speedup_vs_native'], '8.2f'):>8s} "
              f"{f(None if r['ssm_share'] is None else 100 * r['ssm_share'], '5.1f'):>6s} "
              f"{f(r['live_agreement'], '6.3f'):>6s}  {r['check']}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("skipped") and r.get("mode")]
    alphas = sorted({r["acceptance"] for r in ok if r["acceptance"] is not None and r["mode"] != "spec_noop"})
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    pts = sorted((r["batch"], r["tokens_per_s"]) for r in ok if r["mode"] == "standard")
    if pts:
        ax0.plot(*zip(*pts), "k-o", label="standard (1 token/step)")
    colors = {a: plt.cm.viridis(i / max(1, len(alphas) - 1)) for i, a in enumerate(alphas)}
    for mode, style in (("replay_spec", "-o"), ("native_spec", "--s")):
        for a in alphas:
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in ok if r["mode"] == mode and r["acceptance"] == a)
            if pts:
                ax0.plot(*zip(*pts), style, color=colors[a], label=f"{mode} a={a}")
            key = "speedup_vs_standard" if mode == "replay_spec" else None
            sp = sorted((r["batch"], r[key]) for r in ok if key and r["mode"] == mode and r["acceptance"] == a
                        and r[key] is not None)
            if sp:
                ax1.plot(*zip(*sp), "-o", color=colors[a], label=f"ReplaySSM spec vs standard, a={a}")
            sn = sorted((r["batch"], r["speedup_vs_native"]) for r in ok if mode == "replay_spec" and r["mode"] == mode
                        and r["acceptance"] == a and r["speedup_vs_native"] is not None)
            if sn:
                ax1.plot(*zip(*sn), "--s", color=colors[a], label=f"ReplaySSM spec vs native spec, a={a}")
    for ax in (ax0, ax1):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.grid(alpha=0.3)
    ax0.set_yscale("log")
    ax0.set_ylabel("accepted tokens / s")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_ylabel("throughput speedup")
    ax0.legend(fontsize=7)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,64,128,256")
    ap.add_argument("--acceptances", default="0.6,0.8,0.95", help="per-position draft acceptance probabilities")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--num-tokens", "-T", type=int, default=4, help="T = 1 + num_draft tokens per verify step")
    ap.add_argument("--tiny", action="store_true", help="the small embedded config (CPU smoke test)")
    ap.add_argument("--layers", type=int, default=None, help="first N layers of the hybrid pattern")
    ap.add_argument("--vocab", type=int, default=None, help="reduce the vocabulary (default: the config's)")
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16, help="spec steps per timed sample")
    ap.add_argument("--warmup", type=int, default=1, help="untimed samples before timing")
    ap.add_argument("--reps", type=int, default=5, help="timed samples (median)")
    ap.add_argument("--context", type=int, default=1024, help="KV cache positions (attention reads all of them)")
    ap.add_argument("--check-steps", type=int, default=6, help="live spec steps of the exactness check")
    ap.add_argument("--check-acceptance", type=float, default=0.7)
    ap.add_argument("--check-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="activation dtype of the model the check runs on (float32: a twin of the timed bf16 model)")
    ap.add_argument("--no-check", action="store_true", help="skip the exactness check (timing only)")
    ap.add_argument("--tie-rel", type=float, default=1e-3)
    ap.add_argument("--max-tie-frac", type=float, default=0.05)
    ap.add_argument("--strict-check", action="store_true")
    ap.add_argument("--timed-target", choices=("ref", "live"), default="ref",
                    help="timed runs: accept against the greedy reference (controlled acceptance) or the live argmax")
    ap.add_argument("--mem-budget-gib", type=float, default=139.0)
    ap.add_argument("--fit-contexts", default="1024,8192", help="contexts of the max-batch table")
    ap.add_argument("--time-budget-s", type=float, default=280.0,
                    help="skip the remaining batches when the next one is predicted to end past this")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: expected names from {MODES}, got {m!r}")
    modes = [m for m in MODES if m in modes]
    T, L = args.num_tokens, args.buffer_len
    if T < 2 or L < 2 * T:
        ap.error(f"--num-tokens {T}, --buffer-len {L}: expected T >= 2 and L >= 2T")
    alphas = [float(a) for a in args.acceptances.split(",") if a]
    if not alphas or any(not 0 <= a <= 1 for a in alphas):
        ap.error(f"--acceptances: expected values in [0, 1], got {args.acceptances!r}")
    batches = [int(b) for b in args.batches.split(",") if b]
    dtype = torch.bfloat16 if cuda else torch.float32
    config = bd.model_config(args.tiny, args.layers, args.vocab)
    t0 = time.perf_counter()
    model = bd.build_model(config, dev, dtype, args.seed)
    check_dtype = getattr(torch, args.check_dtype)
    check_model = None
    if not args.no_check and check_dtype != dtype:
        check_model = bd.build_model(config, dev, check_dtype, args.seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    resident = weight_bytes + (0 if check_model is None else sum(p.numel() * p.element_size()
                                                                 for p in check_model.parameters()))
    kinds = list(config.layers_block_type)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    budget = int(args.mem_budget_gib * GiB)
    table_len = max(args.steps, args.check_steps) * T + T + 1
    kv_len = max(args.context, args.prompt_len + table_len + T + 1, args.prompt_len + max(L, args.check_steps) + 1)
    fit = {f"ctx{ctx}": {m: max_batch(config, budget, ctx, T, L, m, weight_bytes) for m in MODES if m != "spec_noop"}
           for ctx in (int(c) for c in args.fit_contexts.split(",") if c)}
    meta = dict(device=torch.cuda.get_device_name(dev) if cuda else "cpu", date=now, commit=bd._commit(args.commit),
                torch=torch.__version__, model="tiny" if args.tiny else "nemotron_h_8b_geometry",
                pattern=config.hybrid_override_pattern, layers=len(kinds), mamba_layers=kinds.count("linear_attention"),
                attention_layers=kinds.count("full_attention"), vocab=config.vocab_size,
                dtype=str(dtype).replace("torch.", ""), state_dtype="float32", weights_gb=weight_bytes / 1e9,
                weights="seeded random (no checkpoint)", T=T, num_draft=T - 1, buffer_len=L, acceptances=alphas,
                modes=modes, steps=args.steps, reps=args.reps, warmup=args.warmup, prompt_len=args.prompt_len,
                kv_len=kv_len, timed_target=args.timed_target,
                check=("off" if args.no_check else f"{args.check_steps} live steps at acceptance "
                       f"{args.check_acceptance} on {args.check_dtype if check_model is not None else meta_dtype(dtype)}"),
                mem_budget_gib=args.mem_budget_gib, max_batch_at_budget=fit, build_s=time.perf_counter() - t0)
    if cuda:
        from scripts.bench_kernels import copy_ceiling_tbps

        meta["copy_ceiling_tbps"] = copy_ceiling_tbps()
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    print("RESULT_JSON " + json.dumps({"kind": "meta", **meta}), flush=True)
    print(f"# max batch within {args.mem_budget_gib:g} GiB (memory_model; weights {weight_bytes / GiB:.1f} GiB): "
          + "; ".join(f"{c}: " + ", ".join(f"{m} {b}" for m, b in v.items()) for c, v in fit.items()), flush=True)
    free = None
    if cuda:
        torch.cuda.empty_cache()
        free = min(torch.cuda.mem_get_info(dev)[0] - GiB, budget - resident)
        check_act = check_dtype.itemsize if check_model is not None else dtype.itemsize
        print_plan(config, batches, modes, kv_len, T, L, dtype.itemsize, check_act, free, resident)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("spec-decode-tiny" if args.tiny else "spec-decode")
    path = out / f"{meta['date'][:10]}_{tag}_{meta['commit'][:10]}.json"
    rows, last = [], None
    for batch in batches:
        if last is not None:
            b0, wall0 = last
            predicted = wall0 * max(1.0, batch / b0)
            elapsed = time.perf_counter() - t_start
            if elapsed + predicted > args.time_budget_s:
                row = dict(batch=batch, skipped=True, mode="all",
                           reason=f"time budget: {elapsed:.0f} s elapsed + ~{predicted:.0f} s predicted > "
                                  f"{args.time_budget_s:.0f} s")
                print(f"# skip batch {batch}: {row['reason']}", file=sys.stderr, flush=True)
                rows.append(row)
                continue
        skip, snap_dev = {}, None
        if cuda:
            act, cact = dtype.itemsize, (check_dtype.itemsize if check_model is not None else dtype.itemsize)
            need_gpu = 0
            for m in modes:
                p = run_plan(config, batch, kv_len, T, L, m, act)
                q = run_plan(config, batch, kv_len, T, L, m, cact) if (m in CHECKED and not args.no_check) else p
                if max(p["cpu_snapshot"], q["cpu_snapshot"]) > free:
                    skip[m] = (f"does not fit: needs {max(p['cpu_snapshot'], q['cpu_snapshot']) / GiB:.1f} GiB besides "
                               f"the weights, {free / GiB:.1f} GiB available")
                    continue
                need_gpu = max(need_gpu, p["gpu_snapshot"], q["gpu_snapshot"])
            snap_dev = dev if need_gpu <= free else torch.device("cpu")
            if snap_dev.type == "cpu":
                print(f"# batch {batch}: snapshot kept in host memory (restores cross PCIe)", file=sys.stderr)
            for m, why in skip.items():
                print(f"# batch {batch}, {m}: {why}", file=sys.stderr, flush=True)
            if all(m in skip for m in modes):
                rows += [dict(batch=batch, mode=m, skipped=True, reason=skip[m]) for m in modes]
                continue
        t1 = time.perf_counter()
        batch_rows = run_batch(model, batch, modes, T=T, L=L, acceptances=alphas, prompt_len=args.prompt_len,
                               steps=args.steps, warmup=args.warmup, reps=args.reps, check_steps=args.check_steps,
                               check_acceptance=args.check_acceptance, context=args.context, seed=args.seed,
                               tie_rel=args.tie_rel, max_tie_frac=args.max_tie_frac, strict_check=args.strict_check,
                               timed_target=args.timed_target, check_model=check_model, do_check=not args.no_check,
                               snapshot_device=snap_dev, skip_modes=skip,
                               log=lambda s: print(s, file=sys.stderr, flush=True))
        wall = time.perf_counter() - t1
        last = (batch, wall)
        for r in batch_rows:
            r["batch_wall_s"] = wall
            if cuda and not r.get("skipped"):
                r["peak_gib"] = torch.cuda.max_memory_allocated(dev) / GiB
                r["snapshot"] = str(snap_dev)
                r["pct_ceiling"] = 100 * r["tbps"] / meta["copy_ceiling_tbps"]
            if not r.get("skipped"):
                p = memory_model(config, batch, kv_len, T, L, r["mode"], weight_bytes)
                r["memory_model_gib"] = p["total"] / GiB
            print("RESULT_JSON " + json.dumps({"kind": "row", **meta, **r}), flush=True)
        rows += batch_rows
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))  # after every batch
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
    meta["wall_s"] = time.perf_counter() - t_start
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"# {meta['device']}, {meta['model']} ({meta['layers']} layers, vocab {meta['vocab']}), T={T}, L={L}, "
          f"timed target {args.timed_target}; {meta['wall_s']:.0f} s; results in {path}")
    print_table(rows)
    if args.plot:
        png = path.with_suffix(".png")
        plot(rows, png)
        print(f"# plot: {png}")
    return rows


def meta_dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


if __name__ == "__main__":
    try:
        main()
    except GateError as e:
        sys.exit(f"ABORT: {e}")
