#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The speculative step of the end-to-end benchmark: T-token verify steps through the whole hybrid model.

Run through ``scripts/bench_e2e.py spec`` (the common flags, the model of :mod:`builders.random_model`,
Nemotron-H-8B, a Nemotron 3 (Mamba-2 + MoE) stack with ``--model-geometry``, or ``--tiny``, and the results
file are that CLI's). MoE layers route each of the batch x T tokens; the bytes model counts the experts the
last timed step read (``weights_read_gb``). One speculative step
(:class:`builders.model_step.SpecStep`) feeds
T = 1 + num_draft tokens per row through every layer (attention with T causal queries over the KV
cache, MLPs and projections on batch*T tokens, conv1d over the (K-1+num_draft)-wide window, the SSM
verify per Mamba layer), then accepts, commits and gathers the next drafts on the device; the whole
step is one CUDA graph. Modes, everything but the SSM identical:

  standard      one-token ReplaySSM decode (the standard step's ``replay`` mode): the baseline
  replay_spec   ReplaySSM spec: ``ops.replay_verify`` per layer + one ``cursor_ops.spec_commit`` per step
  native_spec   ``ops.native_spec_verify`` per layer (T state snapshots) + ``cursor_ops.native_spec_commit``
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

Exactness check (phase 1: every batch is checked before anything is timed, with only the fp32 twin
resident; phase 2 then builds the bf16 model and times): on the fp32 twin (same seeded weights),
every spec mode runs ``--check-steps`` live-target steps (drafts at ``--check-acceptance``,
so rejections, conv rollbacks and ReplaySSM flushes all happen) and the tokens it emits must equal
plain greedy decoding's (the conventional standard step's) tokens; the standard ReplaySSM baseline is
checked the same way. A row may fork only at a near tie of the reference (top-2 margin below
``--tie-rel`` x std(logits)), in at most ``--max-tie-frac`` of the rows (the standard step's rule;
``--strict-check``: none). Anything else aborts, naming rows and positions. fp32 because in bf16 two
correct kernels (or one kernel at different GEMM shapes) give different tokens after a few steps.

Timing: per (mode, acceptance), restore the post-prompt snapshot, one warm-up run, then ``--reps``
samples of ``--steps`` graph replays between two CUDA events, each from the restored snapshot (same
path every sample); ms/step = median / steps. The standard mode times one flush cycle (L steps) per
sample. Tokens/s = accepted tokens of all rows per step / ms per step. CPU: eager, ``perf_counter``.

Memory (``trtllm_replayssm.costs.serving_memory``, bytes per mode at serving time: weights + SSM state
(+ rings for ReplaySSM, + T fp32 snapshots per layer for native spec) + conv windows + KV cache + step
scratch; the formulas in costs' module docstring) gives the largest batch within ``--mem-budget-gib``
(``costs.max_batch``), reported per mode and context (``memory_model_gib`` in the rows).
Before running, ``costs.spec_run_plan`` (the mode's memory + the post-prompt snapshot, besides the phase's
resident model) is printed for every (batch, mode) and phase; pairs that do not fit the free GPU
memory (capped at the budget) are skipped with the GiB they need.
Batches run largest first. ``--time-budget-s`` skips the remaining batches when the next one would
not finish in time (checks may use ``--check-share`` of it; a batch whose check was cut is timed and
labelled "not run"); rows are written after every batch, so a cut run keeps what it measured. A mode
that fails at one batch (e.g. out of memory) is reported in a row and the run goes on; a failed
exactness check aborts.

Bytes per step (``bytes_step``): ``trtllm_replayssm.costs.spec_step_bytes`` (formulas in costs' module
docstring): weights + K, V of the filled positions (which the fused step's attention reads; fill = prompt +
accepted_per_step * steps / 2, the mean over a timed run from the snapshot, reported as ``kv_fill_mean``)
+ conv windows + logits + per Mamba layer the mode's SSM bytes: standard = the standard step's replay mode;
replay_spec state * (1 + fold share) + history and window entries, averaged over the committed counts of the
acceptance (``costs.spec_count_distribution``); native_spec state * (1 + T) + 2 state (verify: read + T
snapshots; commit: copy). Weights: ``costs.config_weight_bytes`` (meta, the timed dtype) for the memory model,
the built model's parameters as a step reads them (``costs.weights_read_bytes``: the embedding rows of the
batch x T tokens, not the table) for the bytes.

Usage:
  python scripts/bench_e2e.py spec [--batches 1,32,64,128,256] [--acceptances 0.6,0.8,0.95]
         [--modes standard,replay_spec,native_spec,spec_noop] [--tiny] [--plot] [--out DIR]
"""

from __future__ import annotations

import gc
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.model_step import (  # noqa: E402
    Conventional,
    DecodeStep,
    NativeSpec,
    NoOp,
    Replay,
    SpecStep,
    designed_accepted_per_step,
    make_drafts,
)
from builders.random_model import build_model, model_config  # noqa: E402
from scripts.e2e_standard import GateError, check_gate  # noqa: E402
from trtllm_replayssm import costs, timing  # noqa: E402

MODES = costs.SPEC_MODES  # the modes the memory and bytes models know
CHECKED = ("standard", "replay_spec", "native_spec")
GiB = 1 << 30


# ---- one batch ---------------------------------------------------------------------------------------------
def _backend(name, L, backends):
    if backends and name in backends:
        return backends[name]
    return {"replay_spec": lambda: Replay(L), "native_spec": NativeSpec, "spec_noop": NoOp}[name]()


def prepare(model, batch: int, prompt: torch.Tensor, kv_len: int, table_len: int, snapshot_device=None):
    """Prompt through the conventional standard step, snapshot, then the greedy continuation.

    Returns (step, snap, G, margin): G (batch, table_len) int64 on the device, G[:, 0] = the first greedy
    token (the snapshot's ids); margin (batch, table_len) = top-2 logit gap / std of the logits that
    produced each G token (the near-tie rule of the check). The step is left after the continuation."""
    dev = next(model.parameters()).device
    step = DecodeStep(model, batch, kv_len, Conventional())
    step.feed(prompt.to(dev))
    snap = step.snapshot(snapshot_device)
    G = torch.empty(batch, table_len, dtype=torch.int64, device=dev)
    margin = torch.empty(batch, table_len, dtype=torch.float32, device=dev)

    def record(t):
        G[:, t] = step.ids
        lg = step.logits.float()  # bf16 logits in a bf16 model: margins and errors in fp32
        top = lg.topk(2, dim=-1).values
        margin[:, t] = (top[:, 0] - top[:, 1]) / lg.std(dim=-1)

    record(0)
    run, graph = timing.capture(step, lambda: step.restore(snap), dev.type == "cuda")
    for t in range(1, table_len):
        run()
        record(t)
    del graph
    return step, snap, G, margin


def check_tokens(name, G, margin, got, n_valid, tie_rel, max_tie_frac, strict) -> dict:
    """Tokens a mode emitted (got, first n_valid[b] of row b) against the greedy reference G (CPU tensors)."""
    cols = torch.arange(G.shape[1])[None, :]
    merged = torch.where(cols < n_valid[:, None], got[:, :G.shape[1]], G)
    return check_gate(name, G, margin, merged, tie_rel, max_tie_frac, strict)


def _free(cuda: bool) -> None:
    if cuda:  # graphs, steps and failed frames of the last mode: their blocks back to the driver
        gc.collect()
        torch.cuda.empty_cache()


def check_standard(std, snap, G, margin, L, check_steps, tie_rel, max_tie_frac, strict, cuda) -> dict:
    """The standard ReplaySSM step's greedy tokens from the snapshot against G (CPU tensors)."""
    std.set_ssm(Replay(L))
    std.restore(snap)
    run, graph = timing.capture(std, lambda: std.restore(snap), cuda)
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
    spec = SpecStep(model, batch, kv_len, T, table_len, backend, live=True)
    try:
        spec.set_tables(G, drafts)
        spec.restore(snap)
        run, graph = timing.capture(spec, lambda: spec.restore(snap), cuda)
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
    run, graph = timing.capture(std, lambda: std.restore(snap), cuda)
    ms = timing.time_samples(run, lambda: std.restore(snap), L, warmup, reps, cuda)
    return dict(ms=statistics.median(ms), spread=timing.spread(ms), accepted_per_step=1.0, tokens_per_step=float(std.batch),
                steps=L, partial=None, agree=None, idle_expert_bytes=std.idle_expert_bytes())


def time_spec(model, backend, snap, G, tables: dict, kv_len, T, table_len, steps, warmup, reps, live, cuda) -> dict:
    """{alpha: timing} of one spec mode: one graph, the draft table swapped per acceptance."""
    batch = G.shape[0]
    spec = SpecStep(model, batch, kv_len, T, table_len, backend, live=live)
    out = {}
    try:
        spec.set_tables(G, next(iter(tables.values())))
        spec.restore(snap)
        run, graph = timing.capture(spec, lambda: spec.restore(snap), cuda)
        for a, drafts in tables.items():
            spec.set_tables(G, drafts)
            ms = timing.time_samples(run, lambda: spec.restore(snap), steps, warmup, reps, cuda)
            pos = spec.pos.cpu()
            acc = int((pos - 1).sum())
            out[a] = dict(ms=statistics.median(ms), spread=timing.spread(ms), accepted_per_step=acc / (batch * steps),
                          tokens_per_step=acc / steps, steps=steps, partial=int(spec.partial.sum()) / (batch * steps),
                          agree=int(spec.agree.sum()) / max(1, acc), idle_expert_bytes=spec.idle_expert_bytes())
        return out
    finally:
        spec.free()


def lengths(T: int, L: int, steps: int, check_steps: int, prompt_len: int, context: int) -> tuple[int, int, int]:
    """(check table, timing table, KV positions): tables of steps*T + T + 1 tokens (first greedy token,
    every token a run can emit, the targets and drafts of one more window); KV for the prompt and them."""
    check_len, time_len = check_steps * T + T + 1, steps * T + T + 1
    return check_len, time_len, max(context, prompt_len + max(check_len, time_len) + T + 1, prompt_len + L + 1)


def _prompt(batch: int, vocab: int, prompt_len: int, seed: int) -> torch.Tensor:
    return torch.randint(2, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed + batch))


def _error(e: BaseException) -> str:
    kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
    return f"{kind}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def check_batch(check_model, batch: int, modes, *, T: int = 4, L: int = 16, prompt_len: int = 32, check_steps: int = 6,
                check_acceptance: float = 0.7, context: int = 1024, seed: int = 0, tie_rel: float = 1e-3,
                max_tie_frac: float = 0.05, strict_check: bool = False, backends: dict | None = None,
                snapshot_device=None, skip_modes=(), steps: int = 16, log=print) -> dict:
    """Exactness check of every mode at one batch size with live targets: {mode: {exact, ties, ...}} or
    {mode: {"error": why}} when a mode could not run (e.g. out of memory). Raises :class:`GateError`."""
    check_len, _, kv_len = lengths(T, L, steps, check_steps, prompt_len, context)
    cfg = check_model.config
    cuda = next(check_model.parameters()).device.type == "cuda"
    run_modes = [m for m in modes if m in CHECKED and m not in dict.fromkeys(skip_modes)]
    std, snap, G, margin = prepare(check_model, batch, _prompt(batch, cfg.vocab_size, prompt_len, seed), kv_len,
                                   check_len, snapshot_device)
    Gc, Mc = G.cpu(), margin.cpu()
    checks = {}
    if "standard" in run_modes:
        try:
            checks["standard"] = check_standard(std, snap, Gc, Mc, L, check_steps, tie_rel, max_tie_frac,
                                                strict_check, cuda)
        except GateError:
            raise
        except Exception as e:  # a mode that cannot run is reported, the others still run
            checks["standard"] = dict(error=_error(e))
    std.ssm.free()
    std = None
    _free(cuda)
    drafts = make_drafts(G, check_acceptance, cfg.vocab_size, torch.Generator().manual_seed(seed * 7919 + batch))
    for name in run_modes:
        if name == "standard":
            continue
        try:
            checks[name] = check_spec(check_model, name, _backend(name, L, backends), snap, G, Mc, drafts, kv_len, T,
                                      check_len, check_steps, tie_rel, max_tie_frac, strict_check, cuda)
        except GateError:
            raise
        except Exception as e:
            checks[name] = dict(error=_error(e))
        _free(cuda)
    log(f"# batch {batch}: check: " + ", ".join(
        f"{k} " + (v["error"] if "error" in v else f"{v['exact']}/{batch} exact"
                   + (f" ({v['ties']} near-tie forks)" if v["ties"] else "")) for k, v in checks.items()))
    return checks


def time_batch(model, batch: int, modes, *, T: int = 4, L: int = 16, acceptances=(0.8,), prompt_len: int = 32,
               steps: int = 16, warmup: int = 1, reps: int = 5, check_steps: int = 6, check_acceptance: float = 0.7,
               context: int = 1024, seed: int = 0, timed_target: str = "ref", backends: dict | None = None,
               snapshot_device=None, skip_modes=(), checks: dict | None = None, log=print) -> list[dict]:
    """Time every mode at one batch size (reference path through the tables unless ``timed_target='live'``);
    returns one row per (mode, acceptance) plus rows for skipped or failed modes."""
    skip_modes = dict(skip_modes) if isinstance(skip_modes, dict) else {m: "skipped" for m in skip_modes}
    checks = checks or {}
    _, time_len, kv_len = lengths(T, L, steps, check_steps, prompt_len, context)
    vocab = model.config.vocab_size
    cuda = next(model.parameters()).device.type == "cuda"
    run_modes = [m for m in modes if m not in skip_modes]
    std, snap, G, _ = prepare(model, batch, _prompt(batch, vocab, prompt_len, seed), kv_len, time_len, snapshot_device)
    results, errors = {}, {}
    if "standard" in run_modes:
        try:
            results[("standard", None)] = time_standard(std, snap, L, warmup, reps, cuda)
        except Exception as e:
            errors["standard"] = _error(e)
    std.ssm.free()
    std = None
    _free(cuda)
    tables = {a: make_drafts(G, a, vocab, torch.Generator().manual_seed(seed * 7919 + batch + int(a * 1000)))
              for a in acceptances}
    noop_alpha = min(acceptances, key=lambda a: abs(a - 0.8))
    for name in run_modes:
        if name == "standard":
            continue
        tab = {noop_alpha: tables[noop_alpha]} if name == "spec_noop" else tables
        try:
            for a, r in time_spec(model, _backend(name, L, backends), snap, G, tab, kv_len, T, time_len, steps, warmup,
                                  reps, timed_target == "live", cuda).items():
                results[(name, a)] = r
        except Exception as e:
            errors[name] = _error(e)
        _free(cuda)
    snap = G = None
    _free(cuda)
    for name, why in errors.items():
        log(f"# batch {batch}, {name}: failed: {why}")
    return make_rows(model.config, batch, results, checks, T, L, kv_len, prompt_len, reps, check_steps,
                     check_acceptance, timed_target, noop_alpha, cuda,
                     costs.weights_read_bytes(model, batch * T),
                     {**skip_modes, **{m: f"failed: {w}" for m, w in errors.items()}}, modes)


def make_rows(cfg, batch, results, checks, T, L, kv_len, prompt_len, reps, check_steps, check_acceptance, timed_target,
              noop_alpha, cuda, weight_bytes, skipped, modes) -> list[dict]:
    std_r = results.get(("standard", None))

    def tok_s(r):
        return r["tokens_per_step"] / (r["ms"] * 1e-3)

    rows = []
    for (name, a), r in results.items():
        tps = tok_s(r)
        nat = results.get(("native_spec", a)) if name == "replay_spec" else None
        noop = results.get(("spec_noop", noop_alpha)) if name in ("replay_spec", "native_spec") else None
        kv_fill = prompt_len + r["accepted_per_step"] * r["steps"] / 2
        read = weight_bytes - r["idle_expert_bytes"]  # MoE: the routed experts no token of the last step chose
        nbytes = costs.spec_step_bytes(cfg, batch, kv_fill, T, L, name, read, r["accepted_per_step"])
        chk = checks.get(name)
        if name == "spec_noop":
            check = "not checked (no SSM)"
        elif chk is None:
            check = "not run"
        elif "error" in chk:
            check = f"not run ({chk['error']})"
        else:
            check = "exact" if chk["ties"] == 0 else f"{chk['ties']} near-tie forks"
        ok = chk is not None and "error" not in chk
        rows.append(dict(
            batch=batch, mode=name, acceptance=a, T=T if name != "standard" else 1, num_draft=T - 1,
            ms_step=r["ms"], spread_ms=r["spread"], steps_per_sample=r["steps"], reps=reps,
            accepted_per_step=r["accepted_per_step"],
            designed_accepted_per_step=None if a is None else designed_accepted_per_step(a, T), tokens_per_s=tps,
            speedup_vs_standard=None if std_r is None else tps / tok_s(std_r),
            step_time_vs_standard=None if std_r is None else r["ms"] / std_r["ms"],
            speedup_vs_native=None if nat is None else tps / tok_s(nat),
            ssm_share=None if noop is None else 1 - noop["ms"] / r["ms"],
            partial_step_frac=r["partial"], live_agreement=r["agree"],
            timed_target=None if name == "standard" else timed_target,
            bytes_step=nbytes, tbps=nbytes / (r["ms"] * 1e-3) / 1e12, weights_read_gb=read / 1e9,
            timing="cuda-graph" if cuda else "eager-cpu (perf_counter)", buffer_len=L, kv_len=kv_len,
            kv_fill_mean=kv_fill, prompt_len=prompt_len, check=check, check_exact=chk["exact"] if ok else None,
            check_ties=chk["ties"] if ok else None, check_steps=check_steps if ok else None,
            check_acceptance=check_acceptance if ok and name != "standard" else None,
            check_accepted_per_step=chk.get("check_accepted_per_step") if ok else None,
            check_partial_steps=chk.get("check_partial_steps") if ok else None,
            check_peak_gib=chk.get("peak_gib") if ok else None))
    for name, why in skipped.items():
        if name in modes:
            rows.append(dict(batch=batch, mode=name, skipped=True, reason=why))
    return rows


def run_batch(model, batch: int, modes, *, check_model=None, do_check: bool = True, skip_modes=(), log=print,
              **kw) -> list[dict]:
    """:func:`check_batch` (on ``check_model``, default ``model``) then :func:`time_batch` at one batch size."""
    ck = {k: v for k, v in kw.items() if k in ("T", "L", "prompt_len", "check_steps", "check_acceptance", "context",
                                                "seed", "tie_rel", "max_tie_frac", "strict_check", "backends",
                                                "snapshot_device", "steps")}
    checks = {}
    if do_check:
        checks = check_batch(check_model if check_model is not None else model, batch, modes, skip_modes=skip_modes,
                             log=log, **ck)
    tk = {k: v for k, v in kw.items() if k not in ("tie_rel", "max_tie_frac", "strict_check")}
    return time_batch(model, batch, modes, skip_modes=skip_modes, checks=checks, log=log, **tk)


# ---- driver -------------------------------------------------------------------------------------------------
def decide(config, batch: int, modes, kv_len: int, T: int, L: int, act_bytes: int, avail: int) -> tuple[dict, str]:
    """({mode: why skipped}, snapshot device "cuda" | "cpu") for one batch of one phase, from
    :func:`trtllm_replayssm.costs.spec_run_plan`
    and ``avail`` bytes of GPU memory besides the resident weights."""
    skip, need = {}, 0
    for m in modes:
        p = costs.spec_run_plan(config, batch, kv_len, T, L, m, act_bytes)
        if p["cpu_snapshot"] > avail:
            skip[m] = (f"does not fit: needs {p['cpu_snapshot'] / GiB:.1f} GiB besides the weights, "
                       f"{avail / GiB:.1f} GiB available")
        else:
            need = max(need, p["gpu_snapshot"])
    return skip, ("cuda" if need <= avail else "cpu")


def print_plan(config, batches, modes, kv_len, T, L, act_bytes, avail, what):
    print(f"# memory plan, {what} (GiB besides the resident weights; {avail / GiB:.1f} GiB available):")
    print("#   batch " + " ".join(f"{m:>18s}" for m in modes))
    for b in batches:
        cells = []
        for m in modes:
            p = costs.spec_run_plan(config, b, kv_len, T, L, m, act_bytes)
            verdict = "fits" if p["gpu_snapshot"] <= avail else "host-snap" if p["cpu_snapshot"] <= avail else "SKIP"
            cells.append(f"{p['gpu_snapshot'] / GiB:7.1f} {verdict:>9s}")
        print(f"#   {b:5d} " + " ".join(f"{c:>18s}" for c in cells), flush=True)


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


MODE_ORDER = {m: i for i, m in enumerate(MODES)}


def _sort(rows):
    return sorted(rows, key=lambda r: (r["batch"], MODE_ORDER.get(r.get("mode"), -1),
                                       -1 if r.get("acceptance") is None else r["acceptance"]))


def add_arguments(p) -> None:
    """The spec step's own flags (the common ones: scripts/bench_e2e.py)."""
    p.add_argument("--batches", default="1,32,64,128,256", help="run largest first (a cut run keeps the big ones)")
    p.add_argument("--modes", default=",".join(MODES), help=f"from {MODES}")
    p.add_argument("--acceptances", default="0.6,0.8,0.95", help="per-position draft acceptance probabilities")
    p.add_argument("--num-tokens", "-T", type=int, default=4, help="T = 1 + num_draft tokens per verify step")
    p.add_argument("--steps", type=int, default=16, help="spec steps per timed sample")
    p.add_argument("--warmup", type=int, default=1, help="untimed samples before timing")
    p.add_argument("--reps", type=int, default=5, help="timed samples (median)")
    p.add_argument("--check-steps", type=int, default=6, help="live spec steps of the exactness check")
    p.add_argument("--check-acceptance", type=float, default=0.7)
    p.add_argument("--check-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="activation dtype of the model the check runs on (float32: a twin of the timed bf16 model)")
    p.add_argument("--check-layers", type=int, default=None,
                   help="the check model holds only the first N layers of the pattern (same layer geometry; for "
                        "models whose fp32 twin does not fit, e.g. Nemotron 3 Nano: 126 GB in fp32)")
    p.add_argument("--no-check", action="store_true", help="skip the exactness check (timing only)")
    p.add_argument("--timed-target", choices=("ref", "live"), default="ref",
                   help="timed runs: accept against the greedy reference (controlled acceptance) or the live argmax")
    p.add_argument("--mem-budget-gib", type=float, default=139.0)
    p.add_argument("--fit-contexts", default="1024,8192", help="contexts of the max-batch table")
    p.add_argument("--time-budget-s", type=float, default=240.0,
                   help="skip the remaining batches when the next one is predicted to end past this")
    p.add_argument("--check-share", type=float, default=0.5,
                   help="fraction of the time budget the checks may use (later batches are timed unchecked, labelled)")


def check_arguments(args) -> None:
    """Raises ValueError naming the flag and what was expected."""
    for m in [m for m in args.modes.split(",") if m]:
        if m not in MODES:
            raise ValueError(f"--modes: expected names from {MODES}, got {m!r}")
    T, L = args.num_tokens, args.buffer_len
    if T < 2 or L < 2 * T:
        raise ValueError(f"--num-tokens {T}, --buffer-len {L}: expected T >= 2 and L >= 2T")
    alphas = [float(a) for a in args.acceptances.split(",") if a]
    if not alphas or any(not 0 <= a <= 1 for a in alphas):
        raise ValueError(f"--acceptances: expected values in [0, 1], got {args.acceptances!r}")
    if args.check_layers is not None:
        n = len(model_config(args.tiny or False, args.layers, args.vocab, geometry=args.model_geometry).layers_block_type)
        if not 1 <= args.check_layers <= n:
            raise ValueError(f"--check-layers: expected 1..{n} (the layers of the timed model), got {args.check_layers}")
    # --batches, --buffer-len, --reps, --fit-contexts: bench_e2e.check_common, before this


def run(args, r) -> list[dict]:
    """The spec step over ``--batches`` (largest first); ``r``: scripts/bench_e2e.Run."""
    dev, cuda, dtype, config = r.dev, r.cuda, r.dtype, r.config
    log = r.log
    if args.tiny and not cuda:
        torch.set_num_threads(1)  # thousands of tiny float64 ops: intra-op threads only spin
    modes = [m for m in MODES if m in [m for m in args.modes.split(",") if m]]
    T, L = args.num_tokens, args.buffer_len
    alphas = [float(a) for a in args.acceptances.split(",") if a]
    order = sorted({int(b) for b in args.batches.split(",") if b}, reverse=True)
    check_dtype = getattr(torch, args.check_dtype)
    do_check = not args.no_check
    weight_bytes = costs.config_weight_bytes(config, dtype)
    check_config = config if args.check_layers is None else model_config(
        args.tiny or False, args.check_layers, args.vocab, geometry=args.model_geometry)
    check_weight_bytes = costs.config_weight_bytes(check_config, check_dtype)
    budget = int(args.mem_budget_gib * GiB)
    _, _, kv_len = lengths(T, L, args.steps, args.check_steps, args.prompt_len, args.context)
    fit = {f"ctx{ctx}": {m: costs.max_batch(config, budget, ctx, T, L, m, weight_bytes) for m in MODES if m != "spec_noop"}
           for ctx in (int(c) for c in args.fit_contexts.split(",") if c)}
    meta = r.meta
    meta.update(weights_gb=weight_bytes / 1e9, T=T, num_draft=T - 1, acceptances=alphas, modes=modes,
                steps=args.steps, reps=args.reps, warmup=args.warmup, prompt_len=args.prompt_len, kv_len=kv_len,
                timed_target=args.timed_target,
                check=(f"{args.check_steps} live steps at acceptance {args.check_acceptance} on "
                       f"{args.check_dtype if cuda else 'float32'}"
                       + (f", first {args.check_layers} layers" if args.check_layers else "") if do_check else "off"),
                mem_budget_gib=args.mem_budget_gib, max_batch_at_budget=fit)
    r.open("spec-decode-tiny" if args.tiny else "spec-decode" if args.model_geometry == "nemotron_h_8b"
           else f"spec-decode-{args.model_geometry}")
    print(f"# max batch within {args.mem_budget_gib:g} GiB (costs.serving_memory; weights {weight_bytes / GiB:.1f} GiB): "
          + "; ".join(f"{c}: " + ", ".join(f"{m} {b}" for m, b in v.items()) for c, v in fit.items()), flush=True)
    separate = do_check and (check_dtype != dtype or check_config is not config)
    avail = {}
    if cuda:
        torch.cuda.empty_cache()
        room = min(torch.cuda.mem_get_info(dev)[0] - GiB, budget)
        avail = dict(check=room - (check_weight_bytes if separate else weight_bytes), time=room - weight_bytes)
        if do_check:
            print_plan(check_config, order, [m for m in modes if m in CHECKED], kv_len, T, L, check_dtype.itemsize,
                       avail["check"], f"check on {args.check_dtype}")
        print_plan(config, order, modes, kv_len, T, L, dtype.itemsize, avail["time"], "timing")
    common = dict(T=T, L=L, prompt_len=args.prompt_len, check_steps=args.check_steps, steps=args.steps,
                  check_acceptance=args.check_acceptance, context=args.context, seed=args.seed)
    rows, checks, check_info = [], {}, {}

    def save():
        r.save(_sort(rows))

    def predicted(last, batch, floor=1.0):
        # Largest batch first: the next one is smaller. Timing keeps the last wall (a smaller batch adds
        # native spec where the larger one did not fit); checks may shrink to half (the first pays compiles).
        return None if last is None else last[1] * max(floor, batch / last[0])

    def elapsed():
        return time.perf_counter() - r.t0

    model = None
    meta["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    if do_check and meta["float32_matmul_precision"] != "highest":
        torch.set_float32_matmul_precision("highest")  # TF32 GEMMs would make the fp32 twin fork like bf16
    if do_check:  # phase 1: every check before anything is timed; only the check model resident
        t0 = time.perf_counter()
        model = build_model(check_config, dev, check_dtype if cuda else dtype, args.seed)
        meta["check_build_s"] = time.perf_counter() - t0
        last = None
        for batch in order:
            p = predicted(last, batch, 0.5)
            if p is not None and elapsed() + p > args.check_share * args.time_budget_s:
                check_info[batch] = f"not run (time budget: {elapsed():.0f} s elapsed + ~{p:.0f} s predicted)"
                log(f"batch {batch}: check {check_info[batch]}")
                continue
            skip, snap = {}, None
            if cuda:
                skip, snap = decide(check_config, batch, [m for m in modes if m in CHECKED], kv_len, T, L,
                                    check_dtype.itemsize, avail["check"])
                torch.cuda.reset_peak_memory_stats(dev)
            t1 = time.perf_counter()
            log(f"batch {batch}: check ({', '.join(m for m in modes if m in CHECKED and m not in skip)})")
            try:
                checks[batch] = check_batch(model, batch, modes, tie_rel=args.tie_rel, max_tie_frac=args.max_tie_frac,
                                            strict_check=args.strict, snapshot_device=snap, skip_modes=skip,
                                            log=log, **common)
            except GateError:
                rows.append(dict(batch=batch, mode="all", skipped=True, reason="ABORT: exactness check failed"))
                save()
                raise
            except Exception as e:  # this batch is reported, the others still run
                checks[batch] = {m: dict(error=_error(e)) for m in modes if m in CHECKED}
                log(f"batch {batch}: check failed: {_error(e)}")
            for m, why in skip.items():
                checks[batch][m] = dict(error=why)
            last = (batch, time.perf_counter() - t1)
            for v in checks[batch].values():
                v["peak_gib"] = torch.cuda.max_memory_allocated(dev) / GiB if cuda else None
            _free(cuda)
        if separate:
            model = None
            _free(cuda)
    if model is None:
        t0 = time.perf_counter()
        model = build_model(config, dev, dtype, args.seed)
        meta["build_s"] = time.perf_counter() - t0
    last = None
    for batch in order:  # phase 2: timing
        p = predicted(last, batch)
        if p is not None and elapsed() + p > args.time_budget_s:
            why = f"time budget: {elapsed():.0f} s elapsed + ~{p:.0f} s predicted > {args.time_budget_s:.0f} s"
            log(f"skip batch {batch}: {why}")
            rows.append(dict(batch=batch, mode="all", skipped=True, reason=why))
            save()
            continue
        skip, snap = {}, None
        if cuda:
            skip, snap = decide(config, batch, modes, kv_len, T, L, dtype.itemsize, avail["time"])
            torch.cuda.reset_peak_memory_stats(dev)
            if snap == "cpu":
                log(f"batch {batch}: snapshot kept in host memory (restores cross PCIe)")
        bchecks = checks.get(batch, {})
        if batch in check_info:
            bchecks = {m: dict(error=check_info[batch]) for m in modes if m in CHECKED}
        t1 = time.perf_counter()
        log(f"batch {batch}: timing ({', '.join(m for m in modes if m not in skip)})")
        try:
            batch_rows = time_batch(model, batch, modes, acceptances=alphas, warmup=args.warmup, reps=args.reps,
                                    timed_target=args.timed_target, snapshot_device=snap, skip_modes=skip,
                                    checks=bchecks, log=log, **common)
        except Exception as e:
            log(f"batch {batch}: timing failed: {_error(e)}")
            batch_rows = [dict(batch=batch, mode="all", skipped=True, reason=f"failed: {_error(e)}")]
        wall = time.perf_counter() - t1
        last = (batch, wall)
        for x in batch_rows:
            x["batch_wall_s"] = wall
            if not x.get("skipped"):
                x["memory_model_gib"] = costs.serving_memory(config, batch, kv_len, T, L, x["mode"],
                                                               weight_bytes)["total"] / GiB
                if cuda:
                    x["peak_gib"] = torch.cuda.max_memory_allocated(dev) / GiB
                    x["snapshot"] = snap
                    x["pct_ceiling"] = 100 * x["tbps"] / meta["copy_ceiling_tbps"]
            r.emit(x)
        rows += batch_rows
        save()  # after every batch: a cut run keeps its rows
        _free(cuda)
    return r.finish(_sort(rows), f"T={T}, L={L}, timed target {args.timed_target}", print_table, plot)
