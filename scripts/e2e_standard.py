#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The standard (T = 1) step of the end-to-end benchmark: one full Nemotron-H decode step per SSM mode.

Run through ``scripts/bench_e2e.py standard`` (the common flags, the model of
:mod:`builders.random_model` and the results file are that CLI's).

Route, per batch: random prompts are fed token by token through the conventional step (the
"prefill"; its final SSM state is what a real prefill hands over), everything is snapshotted,
then for every mode the snapshot is restored, one step is run eagerly (compilation, autotuning),
one full step (all layers, greedy argmax written back into the input ids) is captured in a CUDA
graph, the greedy gate runs (``--gate-tokens`` replays), then timing: ``--warmup`` flush cycles,
then ``--reps`` samples of one flush cycle each (L replays between two CUDA events); ms/step =
median sample / L. On the CPU there are no graphs: plain ``perf_counter`` around eager steps,
labelled ``timing: eager-cpu``. No L2 rotation is needed: one step streams the weights (16 GB)
and every layer's state, far more than the H200's 60 MB L2, at every batch size.

Modes (everything but the SSM step identical, :mod:`builders.model_step`):
  conventional  our conventional kernel (reads and writes S every step)
  replay        ReplaySSM: ``replay_decode`` per Mamba layer + one ``advance_cursor`` per step
  replay_bf16   replay whose non-flush steps read a bf16 shadow of the fp32 checkpoint (flushes
                rewrite it; written from the checkpoint at the prefill hand-off)
  replay_fp8    the same with an fp8-e4m3 shadow and an fp32 scale per (slot, head, row)
  mamba_ssm     mamba_ssm's Triton ``selective_state_update`` (if importable from --mamba-path)
  noop          the SSM step removed (y = 0): SSM share of a mode = 1 - t(noop) / t(mode)

Gate (before anything is timed): each mode's first ``--gate-tokens`` greedy tokens must equal the
conventional mode's, for every row. It runs on an fp32 twin of the timed bf16 model (same seeded
weights, ``--gate-dtype float32``, same route: prompt, snapshot, captured step): with bf16
activations a random 52-layer model amplifies rounding-level differences between two correct SSM
kernels into different tokens within a few steps (measured on the CPU, 20 layers: logits differ by
up to 0.06 std after one step and the first token forks at the second; fp32: 5e-6 std, flat over 16
steps, tokens equal). The timed bf16 run's own tokens are reported (``timed_rows_identical``), not
gated. A row may fork only where the conventional top-2 margin is below ``--tie-rel`` (default 1e-3,
200x the fp32 noise) x the logits' standard deviation, in at most ``--max-tie-frac`` of the rows
(``--strict-gate``: no forks). Anything else aborts, naming the rows and steps.

Shadow modes are lossy by design (y relative error ~7e-4 bf16, ~1e-2 fp8 against fp32 math,
bench/results/precision_drift.json), so "the same greedy tokens" is the wrong test for them: a
single near tie forks a row and every later token of that row then compares different contexts,
so the count of equal rows measures the luck of the ties, not the kernel. Their gate is
teacher-forced instead: on the same twin, from the same snapshot, the shadow mode is fed the
conventional mode's tokens (gate step t's input is the conventional token of step t-1, written
into the graph's input buffer before the replay), so both see the same contexts and every
(row, step) position is a paired comparison. Two checks, both before timing:
  logit error  max over (row, step) of max_v |logit - conventional logit| / std(conventional
               logits) <= ``SHADOW_GATE[kind]["max_logit_err"]`` (bf16 0.05, fp8 0.25)
  agreement    fraction of (row, step) positions whose argmax is the conventional token >=
               ``min_agree`` (bf16 0.97, fp8 0.9)
The first is the sharp one: a bounded shadow error bounds every logit, a bug (a shadow never
rewritten at a flush, a stale or unscaled read) moves them by O(1) std. The second bounds the
token-level cost (a flip needs a top-2 margin below 2x the logit error). Thresholds come from
CPU measurements (tiny config, and Nemotron-H-8B geometry truncated to 8 layers, vocab 8192,
fp32 activations; bench/NOTES.md "Shadow modes end to end"): measured max errors are
bf16 <= 0.005 std, fp8 <= 0.07 std, and a stale shadow >= 1 std; the thresholds sit ~4-10x above
the former (24 Mamba layers and 8192 positions instead of 4 and <= 530) and >= 4x below the latter.
Rows report ``gate_agree``, ``gate_logit_err_max`` / ``_median`` and the thresholds.
MoE models (Nemotron 3): a shadow's small error can move a token's expert choice at a router near
tie, a discrete change of O(1) std (measured on the Nano geometry: 1.1 std bf16, 1.5 std fp8 in one
row of eight, the other rows near 0). So the routing is teacher-forced too: the gate step records
each token's experts per MoE layer (:meth:`builders.model_step.HybridStep.record_routing`), and the
shadow mode's gate step t uses the conventional run's experts (its routing weights are its own), so
the logit limit measures the shadow, not the router's margin. ``gate_route_flip_rate``: the fraction
of (row, step) positions where the shadow mode's own choice would have differed (information, not a
gate; the quality cost that routing adds on top).

Bytes model of one step (``bytes_step``, ``tbps``): ``trtllm_replayssm.costs.decode_step_bytes``, its
formulas written out in costs' module docstring: W (weight bytes, all read once per step but the input
embedding table, of which the batch's rows (``costs.weights_read_bytes``); MoE: less the routed experts that no
token of the last timed step chose, ``weights_read_gb`` in the rows) + the conv
windows + K and V of the filled positions (the fused step's attention reads only those; fill = the mean
over the timed steps, prompt + gate + warmup*L + reps*L/2, reported as ``kv_fill_mean``; the eager CPU
step's SDPA reads all kv_len, which the CPU timing does not claim to model) + per Mamba layer and row the
mode's SSM bytes: conventional, mamba_ssm 2 S; replay S (1 + 1/L) + the ring entries; replay_bf16 / replay_fp8 the
shadow read on L-1 steps and written on the flush (+ fp8 row scales), which also reads and writes the fp32
checkpoint S; noop 0. The run plan (GPU or host snapshot, or skip) is ``costs.decode_run_plan``.
At batch 256: W ~ 16.2 GB, conventional SSM ~ 51.5 GB, replay ~ 28.4 GB, bf16 shadow ~ 17.1 GB,
fp8 ~ 10.9 GB (the kernels are not bandwidth-bound with a shadow: bench/NOTES.md "Shadow reads").

Tensor parallelism (``--tp N``, one process per GPU under torchrun, :mod:`builders.tp_step`):
  correctness  for each ``--tp-geometries`` Mamba geometry (H,P,N,G) on the first ``--tp-layers``
               layers (vocab ``--tp-vocab``), every rank builds the same seeded model in fp32 and
               slices it; rank 0 also runs the TP=1 step on the full model. Both are fed the same
               random tokens for 3L+2 steps (teacher forcing: crosses two flushes of every row),
               for the conventional and replay backends; per step, max_v |logits - TP=1 logits| /
               std(TP=1 logits) must stay <= ``TP_TOL[dtype]``:
                 float32 1e-4  TP changes only the summation order of the row-parallel products
                               (and of replicated groups' norm sums); measured on the CPU (both
                               geometries, 8 layers, vocab 4096): <= 1.2e-5
                 bfloat16 0.25 (GPU default, with float32) the partial products are rounded to bf16
                               before the all-reduce, and bf16 reorderings are amplified through the
                               layers; measured on the CPU: 0.065 max, 0.048 median. A sharding bug
                               (wrong rows, norm groups) moves logits by O(1) std
               Any failure aborts before timing.
  timing       (GPU; the CPU runs it eagerly as a smoke test) per ``--batches`` and mode: the TP step
               fed a prompt, snapshot, captured in a CUDA graph (NCCL all-reduces inside), ms/step as
               above on every rank; rank 0 reports its median and the slowest rank's, writes JSON.
  TP=1 in the same code path: ``torchrun --nproc_per_node 1 ... --tp 1``.
  One GPU, no NCCL (``--tp-backend gloo --tp-same-device --batches ""``): every rank on cuda:0, the
  all-reduces through gloo; checks the sharded kernels (local head counts) on a single GPU.

Usage:
  python scripts/bench_e2e.py standard [--batches 1,8,32,64,128,256] [--tiny] [--layers N] [--vocab V]
         [--buffer-len 16] [--modes conventional,replay,replay_bf16,replay_fp8,mamba_ssm,noop] [--plot]
  torchrun --nproc_per_node 2 scripts/bench_e2e.py standard --tp 2 [--batches 64,256] [--modes conventional,replay]
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

# NVLink multicast stays off for NCCL (--tp): set before torch.distributed / NCCL start.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.model_step import Conventional, DecodeStep, MambaSSM, NoOp, Replay  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402
from builders.tp_step import TPDecodeStep  # noqa: E402
from trtllm_replayssm import costs, timing  # noqa: E402

MODES = costs.DECODE_MODES  # the modes the memory and bytes models know
SHADOW_MODES = {"replay_bf16": "bf16", "replay_fp8": "fp8"}
# Teacher-forced gate of the shadow modes (module docstring; measurements in bench/NOTES.md):
# max over (row, step) of max_v |logit - conventional logit| / std(conventional logits), and the
# fraction of (row, step) positions whose argmax is the conventional token.
SHADOW_GATE = {"bf16": dict(max_logit_err=0.05, min_agree=0.97), "fp8": dict(max_logit_err=0.25, min_agree=0.9)}
GiB = 1 << 30


class GateError(RuntimeError):
    """A mode's greedy tokens differ from the conventional mode's beyond near ties."""


# ---- memory ----------------------------------------------------------------------------------------------
def shadow_elem_bytes(modes) -> int:
    """Bytes per state element of the largest shadow among ``modes`` (0 without a shadow mode)."""
    return max([costs.shadow_sizes(SHADOW_MODES[m])[0] for m in modes if m in SHADOW_MODES], default=0)


# ---- gate ------------------------------------------------------------------------------------------------
def check_gate(name: str, ref: torch.Tensor, margin: torch.Tensor, got: torch.Tensor, tie_rel: float,
               max_tie_frac: float, strict: bool) -> dict:
    """ref/got (batch, T) tokens, margin (batch, T) conventional top-2 gap / std of the logits.

    Returns {exact, ties}; raises :class:`GateError` on a fork that is not a near tie, or too many."""
    diff = ref != got
    rows = diff.any(dim=1).nonzero().flatten().tolist()
    bad, ties = [], []
    for b in rows:
        t = int(diff[b].nonzero()[0])
        m = float(margin[b, t])
        (ties if (not strict and m < tie_rel) else bad).append((b, t, m))
    exact = ref.shape[0] - len(rows)
    if bad:
        shown = ", ".join(f"row {b} step {t} (margin {m:.3g} std)" for b, t, m in bad[:8])
        why = "strict gate: no forks allowed" if strict else f"not near ties (tie_rel {tie_rel})"
        raise GateError(f"greedy-token gate: mode {name!r} differs from conventional in {len(bad)} of {ref.shape[0]} "
                        f"rows ({why}): {shown}")
    allowed = max(1, int(max_tie_frac * ref.shape[0]))
    if len(ties) > allowed:
        raise GateError(f"greedy-token gate: mode {name!r} forks at near ties in {len(ties)} of {ref.shape[0]} rows "
                        f"(allowed {allowed}); first: {ties[:4]}")
    return dict(exact=exact, ties=len(ties))


def check_forced_gate(name: str, ref: torch.Tensor, got: torch.Tensor, err: torch.Tensor, max_logit_err: float,
                      min_agree: float) -> dict:
    """Teacher-forced gate of a lossy (shadow) mode: ref/got (batch, T) conventional tokens and this
    mode's argmax when fed the conventional tokens (and, MoE, the conventional experts), err (batch, T)
    max_v |logit - conventional logit| / std(conventional logits). Returns {agree, logit_err_max,
    logit_err_median, exact}; raises :class:`GateError` when err exceeds ``max_logit_err`` anywhere
    (NaN included) or the argmax agrees at fewer than ``min_agree`` of the (row, step) positions."""
    same = ref == got
    agree = float(same.float().mean())
    bad = ~(err <= max_logit_err)
    if bad.any():
        where = bad.nonzero().tolist()
        shown = ", ".join(f"row {b} step {t} ({float(err[b, t]):.3g} std)" for b, t in where[:8])
        raise GateError(f"teacher-forced gate: mode {name!r} logits differ from conventional by more than "
                        f"{max_logit_err} x std at {len(where)} of {err.numel()} (row, step) positions: {shown}")
    if agree < min_agree:
        rows = (~same).nonzero().tolist()[:8]
        raise GateError(f"teacher-forced gate: mode {name!r} argmax agrees with conventional at {agree:.4f} of the "
                        f"(row, step) positions (required {min_agree}); first differences (row, step): {rows}")
    return dict(agree=agree, logit_err_max=float(err.max()), logit_err_median=float(err.median()),
                exact=int(same.all(dim=1).sum()))


# ---- one mode --------------------------------------------------------------------------------------------
def run_mode(step: DecodeStep, ssm, snap: dict, gate_tokens: int, L: int, warmup: int, reps: int,
             on_tokens=None, force: torch.Tensor | None = None, ref_logits=None, keep_logits: bool = False,
             use_graph: bool = True, force_route: torch.Tensor | None = None) -> dict:
    """Gate tokens and timing of one SSM backend (see the module docstring for the route).

    ``on_tokens(result)`` runs after the gate steps and before any timing (it may raise); ``result``
    has ``tokens`` and ``margin`` (batch, T), ``logits`` (list of T (batch, vocab) fp32 CPU tensors,
    with ``keep_logits``) and ``err`` (batch, T, with ``ref_logits``: max |logits - ref_logits[t]| /
    std(ref_logits[t])). ``force`` (batch, T): teacher forcing, the input of gate step t > 0 is
    ``force[:, t - 1]`` instead of this mode's own argmax (timing is unaffected: the same graph).
    MoE steps that record routing (:meth:`HybridStep.record_routing`): ``result["route_idx"]`` (T, layers,
    n, k) and ``result["routing"]`` (batch, T, layers) hold each gate step's own expert choice;
    ``force_route`` (a conventional run's route_idx) makes gate step t use those experts."""
    step.set_ssm(ssm)
    if step.routing is not None:
        step.force_routing = force_route is not None
    step.restore(snap)
    cuda = step.device.type == "cuda"
    run, graph = timing.capture(step, lambda: step.restore(snap), cuda and use_graph)
    b = step.batch
    tokens = torch.empty(b, gate_tokens, dtype=torch.int64, device=step.device)
    margin = torch.empty(b, gate_tokens, dtype=torch.float32, device=step.device)
    err = torch.full((b, gate_tokens), float("nan"), dtype=torch.float32, device=step.device)
    route = route_idx = None
    if step.routing:
        route = torch.zeros(b, gate_tokens, len(step.routing), dtype=torch.int64, device=step.device)
        route_idx = torch.zeros(gate_tokens, len(step.routing), *next(iter(step.route_idx.values())).shape,
                                dtype=torch.int64, device=step.device)
    kept = []
    for t in range(gate_tokens):
        if force is not None and t > 0:
            step.ids.copy_(force[:, t - 1])  # a copy into the captured input buffer, outside the graph
        if force_route is not None:
            for j, buf in enumerate(step.forced_idx.values()):
                buf.copy_(force_route[t, j])
        run()
        tokens[:, t] = step.ids
        if route is not None:
            route[:, t] = torch.stack([r[:, 0] for r in step.routing.values()], dim=-1)
            route_idx[t] = torch.stack(list(step.route_idx.values()))
        lg = step.logits.float()  # bf16 logits in a bf16 model: margins and errors in fp32
        top = lg.topk(2, dim=-1).values
        margin[:, t] = (top[:, 0] - top[:, 1]) / lg.std(dim=-1)
        if keep_logits:
            kept.append(lg.to("cpu", copy=True))  # .cpu() of a CPU tensor would alias the buffer
        if ref_logits is not None:
            r = ref_logits[t].to(step.device)
            err[:, t] = (lg - r).abs().amax(dim=-1) / r.std(dim=-1)
            del r
    gate_res = dict(tokens=tokens.cpu(), margin=margin.cpu(), err=err.cpu(), logits=kept,
                    routing=None if route is None else route.cpu(),
                    route_idx=None if route_idx is None else route_idx.cpu())
    if on_tokens is not None:
        on_tokens(gate_res)
    times = timing.time_samples(run, None, L, warmup, reps, cuda)  # one flush cycle per sample, no restore
    graphed = graph is not None
    del graph
    return dict(tokens=gate_res["tokens"], margin=gate_res["margin"], err=gate_res["err"],
                routing=gate_res["routing"], route_idx=gate_res["route_idx"],
                ms=statistics.median(times) if times else None,
                spread_ms=timing.spread(times) if times else None,
                timing=("cuda-graph" if graphed else "eager-cuda") if cuda else "eager-cpu (no CUDA graph)")


def make_backend(name: str, L: int, mamba_fn=None):
    if name == "conventional":
        return Conventional()
    if name == "replay":
        return Replay(L)
    if name in SHADOW_MODES:
        return Replay(L, shadow=SHADOW_MODES[name])
    if name == "mamba_ssm":
        if mamba_fn is None:
            raise ValueError("mode mamba_ssm: mamba_ssm's selective_state_update is not importable")
        return MambaSSM(mamba_fn)
    if name == "noop":
        return NoOp()
    raise ValueError(f"mode: expected one of {MODES}, got {name!r}")


def _backend(name, L, mamba_fn, backends):
    return (backends or {}).get(name) or make_backend(name, L, mamba_fn)


class _Gate:
    """The gate of one phase: the conventional mode's tokens, margins and (when a shadow mode is gated)
    logits, then each other mode checked against them as soon as its gate steps are done."""

    def __init__(self, modes, batch, tie_rel, max_tie_frac, strict_gate, shadow_gate):
        self.batch, self.tie = batch, (tie_rel, max_tie_frac, strict_gate)
        self.shadow_gate = shadow_gate
        self.need_logits = any(m in SHADOW_MODES for m in modes)
        self.ref, self.out = {}, {}

    def kwargs(self, name) -> dict:
        """Extra run_mode arguments of ``name``'s gated run (the reference runs first)."""
        if name == "conventional":
            return dict(keep_logits=self.need_logits)
        if name in SHADOW_MODES:
            return dict(force=self.ref["tokens"], ref_logits=self.ref["logits"], force_route=self.ref.get("route_idx"))
        return {}

    def on_tokens(self, name):
        def f(res):
            if name == "conventional":
                self.ref.update(res)
                self.out[name] = dict(exact=self.batch, ties=0)
            elif name in SHADOW_MODES:
                g = self.shadow_gate[SHADOW_MODES[name]]
                self.out[name] = check_forced_gate(name, self.ref["tokens"], res["tokens"], res["err"],
                                                   g["max_logit_err"], g["min_agree"])
                if res.get("routing") is not None:  # MoE: (row, step) where its own choice would differ
                    flips = (res["routing"] != self.ref["routing"]).any(-1)
                    self.out[name]["route_flip_rate"] = float(flips.float().mean())
            elif name != "noop":
                self.out[name] = check_gate(name, self.ref["tokens"], self.ref["margin"], res["tokens"], *self.tie)
        return f


def gate_phase(model, batch, modes, prompt, kv_len, L, gate_tokens, tie_rel, max_tie_frac, strict_gate, mamba_fn,
               backends, snapshot_device, shadow_gate=None) -> dict:
    """Greedy tokens of every mode (noop excluded) on ``model``, each checked against the conventional
    mode's before the next mode runs (shadow modes: teacher-forced); returns {mode: gate result}.
    Raises :class:`GateError`."""
    dev = next(model.parameters()).device
    step = DecodeStep(model, batch, kv_len, Conventional())
    step.feed(prompt.to(dev))
    snap = step.snapshot(snapshot_device)
    if step.expert_load:  # MoE: the shadow gate sees routing flips (check_forced_gate); not in timed steps
        step.record_routing()
    gate = _Gate(modes, batch, tie_rel, max_tie_frac, strict_gate, shadow_gate or SHADOW_GATE)
    for name in [m for m in modes if m != "noop"]:
        run_mode(step, _backend(name, L, mamba_fn, backends), snap, gate_tokens, L, 0, 0,
                 on_tokens=gate.on_tokens(name), **gate.kwargs(name))
    step.ssm.free()
    return gate.out


def run_batch(model, batch: int, modes, L: int = 16, prompt_len: int = 32, gate_tokens: int = 32, warmup: int = 1,
              reps: int = 10, context: int = 1024, seed: int = 0, tie_rel: float = 1e-3, max_tie_frac: float = 0.05,
              strict_gate: bool = False, mamba_fn=None, backends: dict | None = None, snapshot_device=None,
              gate_model=None, shadow_gate: dict | None = None) -> list[dict]:
    """All modes at one batch size; returns one row per mode.

    The gate runs first, on ``gate_model`` (e.g. an fp32 twin of a bf16 ``model``; default: ``model``
    itself, gated during each mode's run before its timing). ``backends`` overrides a mode's backend
    object (the tests break one on purpose)."""
    if "conventional" not in modes:
        raise ValueError("modes: 'conventional' is required (it is the gate's reference and the speedup's base)")
    modes = ["conventional"] + [m for m in modes if m != "conventional"]
    kv_len = max(context, prompt_len + gate_tokens + (warmup + reps) * L + 1)
    kv_fill = prompt_len + gate_tokens + warmup * L + reps * L / 2  # mean over the timed steps
    gen = torch.Generator().manual_seed(seed + batch)
    prompt = torch.randint(2, model.config.vocab_size, (batch, prompt_len), generator=gen)
    separate = gate_model is not None and gate_model is not model
    gate_src = next((gate_model if separate else model).parameters()).dtype
    gates = {}
    if separate:
        gates = gate_phase(gate_model, batch, modes, prompt, kv_len, L, gate_tokens, tie_rel, max_tie_frac,
                           strict_gate, mamba_fn, backends, snapshot_device, shadow_gate)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the fp32 phase's blocks have other sizes than the timed phase's
    dev = next(model.parameters()).device
    step = DecodeStep(model, batch, kv_len, Conventional())
    step.feed(prompt.to(dev))
    snap = step.snapshot(snapshot_device)
    results = {}
    gk = None if separate else _Gate(modes, batch, tie_rel, max_tie_frac, strict_gate, shadow_gate or SHADOW_GATE)
    for name in modes:  # the gate (when it runs on this model) checks each mode before its timing
        kw = dict(on_tokens=gk.on_tokens(name), **gk.kwargs(name)) if gk is not None else {}
        results[name] = run_mode(step, _backend(name, L, mamba_fn, backends), snap, gate_tokens, L, warmup, reps, **kw)
    if gk is not None:
        gates = gk.out
    moe_load = None
    if step.expert_load:  # MoE: tokens per expert in the last timed step, per layer
        load = torch.stack(list(step.expert_load.values())).float()
        if load.sum() > 0:
            moe_load = dict(max_over_mean=float((load.amax(1) / load.mean(1)).mean()),
                            idle_experts=float((load == 0).float().sum(1).mean()))
    step.ssm.free()
    conv = results["conventional"]
    # the rows' embeddings, not the whole table; MoE: less the experts no token chose
    weight_bytes = costs.weights_read_bytes(model, batch) - step.idle_expert_bytes()
    rows = []
    for name in modes:
        r = results[name]
        if name == "conventional":
            gate = dict(gate="reference", gate_exact=batch, gate_ties=0)
        elif name == "noop":
            gate = dict(gate="not gated (no SSM)", gate_exact=None, gate_ties=None)
        elif name in SHADOW_MODES:
            g, lim = gates[name], (shadow_gate or SHADOW_GATE)[SHADOW_MODES[name]]
            flips = (f", routing forced (own choice differs at {100 * g['route_flip_rate']:.1f}%)"
                     if g.get("route_flip_rate") is not None else "")
            gate = dict(gate=f"teacher-forced: agree {100 * g['agree']:.2f}%, logit err {g['logit_err_max']:.2g} std"
                             f"{flips}",
                        gate_exact=g["exact"], gate_ties=None, gate_agree=g["agree"],
                        gate_logit_err_max=g["logit_err_max"], gate_logit_err_median=g["logit_err_median"],
                        gate_route_flip_rate=g.get("route_flip_rate"),
                        gate_min_agree=lim["min_agree"], gate_max_logit_err=lim["max_logit_err"],
                        shadow=SHADOW_MODES[name])
        else:
            g = gates[name]
            gate = dict(gate="exact" if g["ties"] == 0 else f"{g['ties']} near-tie forks", gate_exact=g["exact"],
                        gate_ties=g["ties"])
        gate["gate_dtype"] = str(gate_src).replace("torch.", "")
        if name != "noop":  # the timed run's own greedy tokens (informational when the gate ran on a twin)
            gate["timed_rows_identical"] = int((r["tokens"] == conv["tokens"]).all(dim=1).sum())
        noop = results.get("noop")
        nbytes = costs.decode_step_bytes(model.config, batch, kv_fill, L, name, weight_bytes)
        rows.append(dict(
            batch=batch, mode=name, ms_step=r["ms"], spread_ms=r["spread_ms"], tokens_per_s=batch / (r["ms"] * 1e-3),
            ssm_share=(None if noop is None or name == "noop" else 1 - noop["ms"] / r["ms"]),
            ssm_ms=(None if noop is None or name == "noop" else r["ms"] - noop["ms"]),
            speedup_vs_conventional=conv["ms"] / r["ms"], bytes_step=nbytes, tbps=nbytes / (r["ms"] * 1e-3) / 1e12,
            timing=r["timing"], buffer_len=L, kv_len=kv_len, kv_fill_mean=kv_fill, prompt_len=prompt_len,
            gate_tokens=gate_tokens, reps=reps, moe_load=moe_load, weights_read_gb=weight_bytes / 1e9, **gate))
    return rows


# ---- tensor parallelism -------------------------------------------------------------------------------------
TP_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.25}  # max |dlogit| / std(logits); module docstring


def _tp_config(geometry, layers, vocab, tiny=False, **overrides):
    H, P, N, G = geometry
    return model_config(tiny, layers, vocab, mamba_num_heads=H, mamba_head_dim=P, ssm_state_size=N, n_groups=G,
                        **overrides)


@torch.no_grad()
def tp_check(config, modes, rank: int, tp: int, device="cpu", dtype=torch.float32, batch: int = 2, L: int = 4,
             seed: int = 0, group=None) -> list[dict]:
    """TP=``tp`` logits vs TP=1 (rank 0) over 3L+2 teacher-forced steps, per mode (module docstring).
    Returns one dict per mode on every rank (errors only meaningful on rank 0): err_max / err_median
    (max_v |dlogit| / std), rank_spread (max |logits - rank 0's logits|, 0 when all ranks agree)."""
    import torch.distributed as dist

    model = build_model(config, device, dtype, seed)
    steps = 3 * L + 2
    gen = torch.Generator().manual_seed(seed + 7)
    tokens = torch.randint(2, config.vocab_size, (batch, steps), generator=gen).to(device)
    out = []
    for name in modes:
        step = TPDecodeStep(model, batch, steps + 1, make_backend(name, L), rank, tp, group)
        ref = DecodeStep(model, batch, steps + 1, make_backend(name, L)) if rank == 0 else None
        errs, spread = [], 0.0
        for t in range(steps):
            step.ids.copy_(tokens[:, t])
            step()
            if tp > 1:
                r0 = step.logits.clone()
                dist.broadcast(r0, 0, group=group)
                spread = max(spread, float((step.logits - r0).abs().max()))
            if ref is not None:
                ref.ids.copy_(tokens[:, t])
                ref()
                errs.append(float(((step.logits - ref.logits).abs().amax(-1) / ref.logits.std(-1)).max()))
        step.ssm.free()
        del step, ref
        errs_t = torch.tensor(errs or [float("nan")])
        out.append(dict(mode=name, steps=steps, buffer_len=L, batch=batch, dtype=str(dtype).replace("torch.", ""),
                        err_max=float(errs_t.max()), err_median=float(errs_t.median()), rank_spread=spread,
                        tol=TP_TOL[dtype], passed=bool(errs_t.max() <= TP_TOL[dtype]) if errs else None))
    return out


def tp_time(model, batch: int, modes, rank: int, tp: int, L: int = 16, prompt_len: int = 32, warmup: int = 2,
            reps: int = 10, context: int = 1024, seed: int = 0, group=None, use_graph: bool = True) -> list[dict]:
    """ms/step of each mode on this rank's TP step (every rank runs it; identical collectives).
    ``use_graph=False`` (``--tp-eager``): no CUDA graph, should NCCL capture fail on a machine."""
    import torch.distributed as dist

    kv_len = max(context, prompt_len + (warmup + reps + 1) * L + 1)
    gen = torch.Generator().manual_seed(seed + batch)
    prompt = torch.randint(2, model.config.vocab_size, (batch, prompt_len), generator=gen)
    dev = next(model.parameters()).device
    step = TPDecodeStep(model, batch, kv_len, Conventional(), rank, tp, group)
    step.feed(prompt.to(dev))
    snap = step.snapshot()
    rows = []
    for name in modes:
        r = run_mode(step, make_backend(name, L), snap, 1, L, warmup, reps, use_graph=use_graph)
        slowest = torch.tensor([r["ms"]], dtype=torch.float64, device=dev)
        if tp > 1:
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        rows.append(dict(batch=batch, mode=name, tp=tp, ms_step=r["ms"], ms_step_slowest_rank=float(slowest),
                         spread_ms=r["spread_ms"], tokens_per_s=batch / (r["ms"] * 1e-3), timing=r["timing"],
                         buffer_len=L, kv_len=kv_len, reps=reps))
    step.ssm.free()
    conv = next((x for x in rows if x["mode"] == "conventional"), None)
    for x in rows:
        x["speedup_vs_conventional"] = None if conv is None else conv["ms_step"] / x["ms_step"]
    return rows


def tp_main(args) -> list[dict]:
    """``--tp N``: correctness phase, then timing; rank 0 prints and writes JSON."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp}: expected {args.tp} processes (torchrun --nproc_per_node {args.tp}), "
                         f"got WORLD_SIZE={world}")
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device.startswith("cuda")
    dev = torch.device(f"cuda:{0 if args.tp_same_device else local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    backend = args.tp_backend or ("nccl" if cuda else "gloo")
    if world > 1:
        dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)  # noqa: E731
    meta = dict(kind="meta", tp=args.tp, **timing.run_meta(dev, args.commit),
                backend=backend, same_device=bool(args.tp_same_device),
                nccl_env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                         "NVSHMEM_DISABLE_NVLS")})
    say("RESULT_JSON " + json.dumps(meta))
    rows, failed = [], []
    names = args.tp_check_dtypes or ("float32,bfloat16" if cuda else "float32")
    check_dtypes = [getattr(torch, d) for d in names.split(",") if d]
    for geo in [tuple(int(v) for v in g.split(",")) for g in args.tp_geometries.split(";") if g]:
        config = _tp_config(geo, args.tp_layers, args.tp_vocab, args.tiny)
        for dt in check_dtypes:
            for r in tp_check(config, ["conventional", "replay"], rank, args.tp, dev, dt, L=args.tp_check_len,
                              seed=args.seed):
                r = dict(kind="tp_check", geometry=list(geo), layers=len(config.layers_block_type), tp=args.tp, **r)
                say("RESULT_JSON " + json.dumps(r))
                rows.append(r)
                if rank == 0 and not r["passed"]:
                    failed.append(r)
    bad = torch.tensor([len(failed)], device=dev)
    if world > 1:
        dist.broadcast(bad, 0)
    if int(bad):
        say(f"ABORT: TP={args.tp} logits differ from TP=1 beyond tolerance: {failed}")
        if world > 1:
            dist.destroy_process_group()
        raise SystemExit(1)
    say(f"# TP={args.tp} vs TP=1: PASS ({len(rows)} checks, worst {max(r['err_max'] for r in rows):.3g} std)")
    batches = [int(b) for b in args.batches.split(",") if b]
    modes = [m for m in args.modes.split(",") if m in ("conventional", "replay", "replay_bf16", "replay_fp8", "noop")]
    if batches:
        config = model_config(args.tiny or False, args.layers, args.vocab)
        model = build_model(config, dev, torch.bfloat16 if cuda else torch.float32, args.seed)
        for b in batches:
            for r in tp_time(model, b, modes, rank, args.tp, L=args.buffer_len, prompt_len=args.prompt_len,
                             warmup=args.warmup, reps=args.reps, context=args.context, seed=args.seed,
                             use_graph=not args.tp_eager):
                r = dict(kind="tp_row", layers=len(config.layers_block_type), vocab=config.vocab_size, **r)
                say("RESULT_JSON " + json.dumps(r))
                rows.append(r)
                say(f"{r['batch']:5d} {r['mode']:12s} TP={r['tp']} {r['ms_step']:9.3f} ms/step "
                    f"(slowest rank {r['ms_step_slowest_rank']:.3f}) x conv {r['speedup_vs_conventional']:.2f}")
    if rank == 0:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{meta['date'][:10]}_{args.tag or f'decode-tp{args.tp}'}_{meta['commit'][:10]}.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        say(f"# results in {path}")
    if world > 1:
        dist.destroy_process_group()
    return rows


# ---- driver -----------------------------------------------------------------------------------------------
def _load_mamba(path):
    if not path or not torch.cuda.is_available():
        return None
    try:
        sys.path.insert(0, str(path))
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update

        return selective_state_update
    except Exception as e:  # a missing peer only drops its mode
        print(f"# mamba_ssm peer not available ({type(e).__name__}: {e}); mode mamba_ssm skipped", file=sys.stderr)
        return None


def print_table(rows):
    print(f"{'batch':>5s} {'mode':12s} {'ms/step':>9s} {'spread':>7s} {'tok/s':>10s} {'SSM share':>9s} "
          f"{'x conv':>7s} {'TB/s':>6s}  gate")
    for r in rows:
        if r.get("skipped"):
            print(f"{r['batch']:5d} skipped: needs {r['needed_gib']:.1f} GiB, {r['free_gib']:.1f} GiB free")
            continue
        share = "-" if r["ssm_share"] is None else f"{100 * r['ssm_share']:.1f}%"
        print(f"{r['batch']:5d} {r['mode']:12s} {r['ms_step']:9.3f} {r['spread_ms']:7.3f} {r['tokens_per_s']:10.0f} "
              f"{share:>9s} {r['speedup_vs_conventional']:7.2f} {r['tbps']:6.2f}  {r['gate']}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("replay", "replay_bf16", "replay_fp8", "mamba_ssm", "noop"):
        pts = [(r["batch"], r["speedup_vs_conventional"]) for r in rows if r.get("mode") == mode]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode if mode != "noop" else "no SSM (bound)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("decode step speedup vs conventional")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(p) -> None:
    """The standard step's own flags (the common ones: scripts/bench_e2e.py)."""
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--modes", default=",".join(MODES), help=f"from {MODES}")
    p.add_argument("--gate-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2, help="flush cycles before timing")
    p.add_argument("--reps", type=int, default=10, help="timed flush cycles (median)")
    p.add_argument("--gate-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="activation dtype of the model the gate runs on (float32: a twin of the bf16 timed model "
                        "with the same seeded weights; bf16 greedy tokens fork at rounding level, see bench/NOTES.md)")
    p.add_argument("--gate-layers", type=int, default=None,
                   help="the gate's twin holds only the first N layers of the pattern (same Mamba/MoE/attention "
                        "geometry; for models whose fp32 twin does not fit beside the bf16 one, e.g. Nemotron 3 Nano: "
                        "63 GB bf16 + 126 GB fp32 > one H200). Default on CUDA: every layer, or the longest prefix "
                        "that fits beside the timed model at the largest batch (auto_gate_layers)")
    p.add_argument("--mamba-path", default=str(ROOT / "third_party" / "mamba_ssm_peer"))
    t = p.add_argument_group("tensor parallelism (torchrun, one process per GPU)")
    t.add_argument("--tp", type=int, default=None, help="tensor parallelism degree")
    t.add_argument("--tp-geometries", default="256,64,128,8;128,64,128,8",
                   help="--tp correctness: Mamba (H,P,N,G) geometries, ';'-separated (empty: skip)")
    t.add_argument("--tp-layers", type=int, default=8, help="--tp correctness: first N layers of the pattern")
    t.add_argument("--tp-backend", choices=("nccl", "gloo"), default=None,
                   help="--tp: process-group backend (default: nccl on CUDA, gloo on the CPU)")
    t.add_argument("--tp-same-device", action="store_true",
                   help="--tp: every rank on cuda:0 (with --tp-backend gloo: the sharded kernels checked on one GPU; "
                        "timings then mean nothing)")
    t.add_argument("--tp-vocab", type=int, default=4096, help="--tp correctness: vocabulary")
    t.add_argument("--tp-check-len", type=int, default=4, help="--tp correctness: buffer length L (3L+2 steps)")
    t.add_argument("--tp-check-dtypes", default=None,
                   help="--tp correctness: float32 and/or bfloat16 (default: both on CUDA, float32 on the CPU)")
    t.add_argument("--tp-eager", action="store_true", help="--tp timing without CUDA graphs")


def check_arguments(args) -> None:
    """Raises ValueError naming the flag and what was expected."""
    for m in [m for m in args.modes.split(",") if m]:
        if m not in MODES:
            raise ValueError(f"--modes: expected names from {MODES}, got {m!r}")
    timed = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.gate_layers is not None and args.gate_dtype == timed:
        raise ValueError("--gate-layers: needs a twin (--gate-dtype other than the timed model's dtype)")


def kv_positions(args) -> int:
    """KV positions one batch's run allocates: the context, or prompt + gate + every timed step if longer."""
    return max(args.context, args.prompt_len + args.gate_tokens + (args.warmup + args.reps) * args.buffer_len + 1)


def auto_gate_layers(args, modes, free: int, gate_dtype, timed_act_bytes: int) -> int | None:
    """The gate twin's layers when ``--gate-layers`` is not given and the whole twin would not fit beside the
    resident timed model (``free`` bytes): the longest prefix of the pattern whose twin weights plus the
    larger of the two phases' plans at the largest batch (costs.decode_run_plan) fit. None: the whole twin
    fits, or no prefix does (the batch is then skipped with the GiB it needs, as before)."""
    batch = max(int(b) for b in args.batches.split(",") if b)
    kv_len, sb, L = kv_positions(args), shadow_elem_bytes(modes), args.buffer_len
    full = model_config(args.tiny or False, args.layers, args.vocab, geometry=args.model_geometry)
    timed = costs.decode_run_plan(full, batch, kv_len, L, 0, act_bytes=timed_act_bytes, shadow_bytes=sb)["cpu_snapshot"]
    n_full = len(full.layers_block_type)
    for n in range(n_full, 0, -1):
        cfg = model_config(args.tiny or False, n, args.vocab, geometry=args.model_geometry)
        gate = costs.decode_run_plan(cfg, batch, kv_len, L, 0, act_bytes=gate_dtype.itemsize, shadow_bytes=sb)
        if costs.config_weight_bytes(cfg, gate_dtype) + max(timed, gate["cpu_snapshot"]) <= free:
            return None if n == n_full else n
    return None


def run(args, r) -> list[dict]:
    """The standard step over ``--batches``; ``r``: scripts/bench_e2e.Run (device, config, meta, results)."""
    dev, cuda, dtype, config = r.dev, r.cuda, r.dtype, r.config
    modes = [m for m in args.modes.split(",") if m]
    mamba_fn = _load_mamba(args.mamba_path) if "mamba_ssm" in modes and cuda else None
    if "mamba_ssm" in modes and mamba_fn is None:
        modes.remove("mamba_ssm")
        print("# mode mamba_ssm dropped (needs CUDA and mamba_ssm's Triton kernel)", file=sys.stderr)
    t0 = time.perf_counter()
    model = build_model(config, dev, dtype, args.seed)
    gate_dtype = getattr(torch, args.gate_dtype)
    gate_config = config
    gate_layers = args.gate_layers
    if gate_layers is None and cuda and gate_dtype != dtype:  # e.g. the 8B at bs256 on an 80 GB card
        torch.cuda.empty_cache()
        gate_layers = auto_gate_layers(args, modes, torch.cuda.mem_get_info(dev)[0], gate_dtype, dtype.itemsize)
        if gate_layers is not None:
            r.meta["gate_layers_auto"] = True
            print(f"# the gate's {args.gate_dtype} twin holds the first {gate_layers} layers (the whole twin does not "
                  f"fit beside the timed model at the largest batch; --gate-layers sets it)",
                  file=sys.stderr)
    if gate_layers is not None and gate_dtype != dtype:
        gate_config = model_config(args.tiny or False, gate_layers, args.vocab, geometry=args.model_geometry)
    gate_model = build_model(gate_config, dev, gate_dtype, args.seed) if gate_dtype != dtype else None
    weight_bytes = costs.model_weight_bytes(model)
    r.meta.update(weights_gb=weight_bytes / 1e9, modes=modes, build_s=time.perf_counter() - t0,
                  gate_dtype=args.gate_dtype if gate_model is not None else str(dtype).replace("torch.", ""),
                  gate_layers=len(gate_config.layers_block_type), gate_pattern=gate_config.hybrid_override_pattern)
    r.open("decode-tiny" if args.tiny else "decode" if args.model_geometry == "nemotron_h_8b"
           else f"decode-{args.model_geometry}")
    rows = []
    for batch in [int(b) for b in args.batches.split(",") if b]:
        snap_dev = None
        if cuda:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(dev)[0]  # the weights are already resident
            kv_len = kv_positions(args)
            sb = shadow_elem_bytes(modes)
            plan_ = costs.decode_run_plan(config, batch, kv_len, args.buffer_len, 0, shadow_bytes=sb)
            if gate_model is not None:  # the gate phase (fp32 activations) runs before the timed one
                gplan = costs.decode_run_plan(gate_config, batch, kv_len, args.buffer_len, 0,
                                              act_bytes=gate_dtype.itemsize, shadow_bytes=sb)
                plan_ = {k: max(v, gplan[k]) for k, v in plan_.items()}
            if plan_["gpu_snapshot"] <= free:
                snap_dev = dev
            elif plan_["cpu_snapshot"] <= free:
                snap_dev = torch.device("cpu")
                print(f"# batch {batch}: snapshot ({plan_['snapshot_bytes'] / GiB:.1f} GiB) kept in host memory",
                      file=sys.stderr)
            else:
                row = dict(kind="skip", batch=batch, skipped=True, needed_gib=plan_["cpu_snapshot"] / GiB,
                           free_gib=free / GiB)
                print(f"# skip batch {batch}: needs {row['needed_gib']:.1f} GiB besides the weights, "
                      f"{row['free_gib']:.1f} GiB free", file=sys.stderr)
                r.emit(row)
                rows.append(row)
                continue
        t1 = time.perf_counter()
        batch_rows = run_batch(model, batch, modes, L=args.buffer_len, prompt_len=args.prompt_len,
                               gate_tokens=args.gate_tokens, warmup=args.warmup, reps=args.reps, context=args.context,
                               seed=args.seed, tie_rel=args.tie_rel, max_tie_frac=args.max_tie_frac,
                               strict_gate=args.strict, mamba_fn=mamba_fn, snapshot_device=snap_dev,
                               gate_model=gate_model)
        for x in batch_rows:
            x["batch_wall_s"] = time.perf_counter() - t1
            if cuda:
                x["peak_gib"] = torch.cuda.max_memory_allocated(dev) / GiB
                x["planned_gib"] = (plan_["gpu_snapshot"] if snap_dev == dev else plan_["cpu_snapshot"]) / GiB
                x["snapshot"] = str(snap_dev)
                x["pct_ceiling"] = 100 * x["tbps"] / r.meta["copy_ceiling_tbps"]
            r.emit(x)
        rows += batch_rows
        r.save(rows)  # after every batch: a cut run keeps its rows
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
    return r.finish(rows, f"L={args.buffer_len}", print_table, plot)
