# SPDX-License-Identifier: Apache-2.0
"""Served generation: tokens/s, time to first token and inter-token latency at several concurrencies, per SSM mode.

Driver: in-process, the generation engine that the Triton streaming model runs (``builders.generation.Engine``:
the same admission, prefill hand-off, in-flight batching and captured step), ``concurrency`` clients submitting
at once from this process, each output timed on arrival in its callback. It measures the engine; it does not
measure Triton's gRPC path (tests/test_triton_generate.py drives that one through a real tritonserver). Each row:

  tokens_per_s         every generated token over the run's wall time (prefills included)
  decode_tokens_per_s  tokens delivered while all ``concurrency`` streams decode (after the last admission,
                       before the first finishes), over that window: the served decode throughput
  step_tokens_per_s    the same engine's captured step for ``concurrency`` rows replayed back to back (rows live),
                       rows / step time: what the server would give with no host work at all
  overhead_vs_step     1 - decode_tokens_per_s / step_tokens_per_s (the server's share)
  ttft_ms_p50/p99      submit -> first token (queueing behind other prefills included)
  itl_ms_p50/p99       gaps between a stream's successive tokens

plus ``prefill_ms`` (one forward of a ``--ttft-prompt``-token prompt, the model's own path) and ``ttft_ms_single``
(that prompt served alone: the engine's TTFT), per mode.

Workloads (``--workload``, issue 38; each row names its ``workload``):

  random         (default) the rows above: ``concurrency`` random prompts of ``--prompt-len`` tokens.
  shared-prefix  ``concurrency`` requests sharing one ``--prefix-len``-token system prompt (a fresh one per row),
                 each with its own ``--suffix-len`` tokens, served with the engine's prefix cache off and on
                 (``prefix_cache``; budget ``--prefix-cache-tokens``, blocks of ``--prefix-block``); per row the TTFT
                 p50/p99 and, counted by the engine over the row, ``prefill_tokens_computed`` / ``_reused``,
                 ``prefix_hits`` / ``prefix_misses`` and ``prefix_cache_bytes`` (the entries' bytes at the row's end).
  preempt        ``concurrency`` random-prompt streams on ``--max-slots`` slots (default: half the largest
                 concurrency), preemption off (the rest wait in the queue) and on (round robin, ``--preempt-quantum``
                 steps): TTFT p50/p99, tokens/s and ITL with ``preemptions``, ``swap_out_bytes`` and
                 ``swapped_bytes_peak`` (host memory, pinned on CUDA).

    python scripts/bench_serve.py --out bench/results                       # GPU: Nemotron-H-8B geometry, bf16
    python scripts/bench_serve.py --tiny --device cpu --concurrency 1,4 --max-tokens 8 --prompt-len 8   # smoke
    python scripts/bench_serve.py --workload shared-prefix --prefix-len 2048 --concurrency 8,32 --out bench/results
    python scripts/bench_serve.py --workload preempt --concurrency 64 --max-slots 16 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from builders.generation import MODES, Engine, Request  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402
from trtllm_replayssm import timing  # noqa: E402


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Stream:
    def __init__(self):
        self.t_submit = 0.0
        self.times: list[float] = []
        self.done = threading.Event()
        self.reason = None

    def __call__(self, out):
        now = time.perf_counter()
        self.times.extend([now] * len(out.token_ids))
        if out.finished:
            self.reason = out.finish_reason if out.error is None else f"{out.finish_reason}: {out.error}"
            self.done.set()


def serve_run(eng: Engine, concurrency: int, prompt_len: int, max_tokens: int, vocab: int, seed: int,
              prompts: list | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    streams = [Stream() for _ in range(concurrency)]
    if prompts is None:
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in streams]
    t0 = time.perf_counter()
    for s, p in zip(streams, prompts):
        s.t_submit = time.perf_counter()
        eng.submit(Request(p, max_tokens, on_output=s))
    for s in streams:
        if not s.done.wait(600):
            raise RuntimeError("a stream did not finish in 600 s")
    t1 = time.perf_counter()
    bad = [s.reason for s in streams if s.reason != "length"]
    if bad:
        raise RuntimeError(f"streams ended with {bad[:3]}")
    total = sum(len(s.times) for s in streams)
    all_in = max(s.times[0] for s in streams)  # the last stream's first token: every stream decodes from here
    first_out = min(s.times[-1] for s in streams)
    window = first_out - all_in
    in_window = sum(sum(1 for t in s.times if all_in < t <= first_out) for s in streams)
    ttft = [(s.times[0] - s.t_submit) * 1e3 for s in streams]
    itl = [(b - a) * 1e3 for s in streams for a, b in zip(s.times, s.times[1:])]
    return dict(tokens_per_s=total / (t1 - t0), decode_tokens_per_s=in_window / window if window > 0 else None,
                ttft_ms_p50=pct(ttft, 50), ttft_ms_p99=pct(ttft, 99), itl_ms_p50=pct(itl, 50), itl_ms_p99=pct(itl, 99),
                wall_s=t1 - t0, generated=total)


def step_rate(eng: Engine, rows: int, steps: int = 20, reps: int = 5) -> float:
    """rows / (ms per captured step of the engine's smallest view holding ``rows`` live rows), in tokens/s."""
    n = next(b for b in eng.views if b >= rows)
    view = eng.views[n]
    view.sbi.fill_(-1)
    view.sbi[:rows] = torch.arange(rows, dtype=torch.int32, device=eng.device)
    view.lengths.clamp_(max=eng.max_seq_len // 2)
    ms = timing.time_samples(lambda: eng._run_step(n), None, steps, 1, reps, eng.device.type == "cuda")
    view.sbi.fill_(-1)
    view.lengths.zero_()
    return rows / (statistics.median(ms) / 1e3)


def prefill_ms(model, prompt_len: int, vocab: int, reps: int = 5) -> float:
    from transformers import DynamicCache

    ids = torch.randint(0, vocab, (1, prompt_len), device=next(model.parameters()).device)
    cuda = ids.device.type == "cuda"
    out = []
    with torch.no_grad():
        for _ in range(reps + 1):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
            if cuda:
                torch.cuda.synchronize()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out[1:])


STAT_DELTAS = ("prefill_tokens_computed", "prefill_tokens_reused", "prefix_hits", "prefix_misses", "prefix_evictions",
               "preemptions", "resumes", "swap_out_bytes")
STAT_LEVELS = ("prefix_entries", "prefix_cached_tokens", "prefix_cache_bytes", "swapped_bytes_peak")


def counted(eng: Engine, before: dict) -> dict:
    """The engine's counters over a run (``before``: a copy of ``eng.stats`` at its start) and its levels at the end."""
    return {**{k: eng.stats[k] - before[k] for k in STAT_DELTAS}, **{k: eng.stats[k] for k in STAT_LEVELS}}


def shared_prefix_prompts(n: int, prefix_len: int, suffix_len: int, vocab: int, seed: int) -> list:
    """``n`` prompts: one random ``prefix_len``-token system prompt, then ``suffix_len`` random tokens each."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
    return [system + torch.randint(0, vocab, (suffix_len,), generator=g).tolist() for _ in range(n)]


def workload_rows(args, model, cfg, mode: str, conc: list, meta: dict) -> list:
    """The rows of the shared-prefix or preempt workload for one SSM mode (module docstring)."""
    rows = []
    if args.workload == "shared-prefix":
        max_seq = args.prefix_len + args.suffix_len + args.max_tokens + 16
        variants = [("prefix_cache", False, dict()),
                    ("prefix_cache", True, dict(prefix_cache_tokens=args.prefix_cache_tokens or 4 * args.prefix_len,
                                                prefix_block=args.prefix_block))]
        slots = args.max_slots or max(conc)
    else:
        max_seq = args.prompt_len + args.max_tokens + 16
        variants = [("preempt", False, dict()), ("preempt", True, dict(preempt=True, preempt_quantum=args.preempt_quantum))]
        slots = args.max_slots or max(1, max(conc) // 2)
    for key, on, kw in variants:
        eng = Engine(model, max_slots=slots, max_seq_len=max_seq, mode=mode, buffer_len=args.buffer_len, **kw).start()
        try:
            serve_run(eng, min(2, slots), 16, 4, cfg.vocab_size, args.seed + 99)  # warm-up (first prefill, caches)
            for c in conc:
                prompts = None
                if args.workload == "shared-prefix":  # a fresh system prompt per row: nothing cached from an earlier row
                    prompts = shared_prefix_prompts(c, args.prefix_len, args.suffix_len, cfg.vocab_size,
                                                    args.seed + 1000 + c)
                before = dict(eng.stats)
                r = serve_run(eng, c, args.prompt_len, args.max_tokens, cfg.vocab_size, args.seed + c, prompts)
                row = dict(meta, workload=args.workload, mode=mode, concurrency=c, max_slots=slots, **{key: on},
                           max_tokens=args.max_tokens, **r, **counted(eng, before), dtype=args.dtype,
                           layers=len(cfg.layers_block_type), buffer_len=args.buffer_len,
                           driver="in-process: builders.generation.Engine (the Triton streaming model's engine)")
                if args.workload == "shared-prefix":
                    row.update(prefix_len=args.prefix_len, suffix_len=args.suffix_len, prefix_block=args.prefix_block)
                else:
                    row.update(prompt_len=args.prompt_len, preempt_quantum=args.preempt_quantum if on else None)
                rows.append(row)
                if args.out is not None:
                    write(args.out, meta, rows, args.workload)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                  if k not in meta}), flush=True)
        finally:
            eng.shutdown()
            del eng
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_workload(rows: list, workload: str) -> None:
    key = "prefix_cache" if workload == "shared-prefix" else "preempt"
    print(f"\n{'mode':<12} {'conc':>5} {'slots':>5} {key:>12} {'tok/s':>9} {'ttft p50/p99 ms':>16} {'computed':>9} "
          f"{'reused':>8} {'cache MB':>8} {'preempt':>7} {'swap MB':>8}")
    for r in rows:
        print(f"{r['mode']:<12} {r['concurrency']:>5} {r['max_slots']:>5} {str(r[key]):>12} {r['tokens_per_s']:>9.0f} "
              f"{r['ttft_ms_p50']:>7.1f}/{r['ttft_ms_p99']:<8.1f} {r['prefill_tokens_computed']:>9} "
              f"{r['prefill_tokens_reused']:>8} {r['prefix_cache_bytes'] / 1e6:>8.2f} {r['preemptions']:>7} "
              f"{r['swap_out_bytes'] / 1e6:>8.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="conventional,replay,replay_bf16")
    ap.add_argument("--concurrency", default="1,8,64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ttft-prompt", type=int, default=512)
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny Nemotron-H (else the Nemotron-H-8B geometry)")
    ap.add_argument("--layers", type=int, default=None, help="the first N layers of the pattern")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", default="random", choices=("random", "shared-prefix", "preempt"),
                    help="random prompts (default), a shared system prompt with the prefix cache off / on, or more "
                         "streams than slots with preemption off / on (module docstring)")
    ap.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of the shared system prompt")
    ap.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: each request's own tokens after it")
    ap.add_argument("--prefix-block", type=int, default=64, help="shared-prefix: the prefix cache's block")
    ap.add_argument("--prefix-cache-tokens", type=int, default=None,
                    help="shared-prefix: the prefix cache's budget in tokens (default: 4 x --prefix-len)")
    ap.add_argument("--max-slots", type=int, default=None,
                    help="engine slots (default: the largest concurrency; preempt: half of it)")
    ap.add_argument("--preempt-quantum", type=int, default=16, help="preempt: decode steps a slot is held at least")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="directory for <date>_serve_<commit>.json")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: expected names from {MODES}, got {m!r}")
    conc = [int(c) for c in args.concurrency.split(",") if c]
    if not conc or min(conc) < 1:
        ap.error(f"--concurrency: expected positive ints, got {args.concurrency!r}")
    for name in ("prefix_len", "suffix_len", "prefix_block", "preempt_quantum"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    for name in ("max_slots", "prefix_cache_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = model_config(tiny=args.tiny, layers=args.layers)
    model = build_model(cfg, args.device, dtype, seed=args.seed)
    meta = timing.run_meta(args.device, args.commit, args.seed)
    if args.workload == "random" and args.max_slots is not None and args.max_slots < max(conc):
        ap.error(f"--max-slots: the random workload needs a slot per stream (>= {max(conc)}); more streams than "
                 f"slots is --workload preempt")
    if args.workload != "random":
        rows = [r for mode in modes for r in workload_rows(args, model, cfg, mode, conc, meta)]
        print_workload(rows, args.workload)
        if args.out is not None:
            print(f"wrote {write(args.out, meta, rows, args.workload)}")
        return 0
    max_seq = max(args.prompt_len + args.max_tokens, args.ttft_prompt + 1) + 16
    rows = []
    pre = prefill_ms(model, args.ttft_prompt, cfg.vocab_size)
    print(f"prefill of {args.ttft_prompt} tokens: {pre:.1f} ms", flush=True)
    for mode in modes:
        t = time.perf_counter()
        eng = Engine(model, max_slots=args.max_slots or max(conc), max_seq_len=max_seq, mode=mode,
                     buffer_len=args.buffer_len).start()
        print(f"{mode}: engine up in {time.perf_counter() - t:.1f} s ({len(eng.graphs)} graphs)", flush=True)
        try:
            serve_run(eng, min(2, max(conc)), 16, 4, cfg.vocab_size, args.seed + 99)  # warm-up (first prefill, caches)
            single = serve_run(eng, 1, args.ttft_prompt, 2, cfg.vocab_size, args.seed + 7)
            for c in conc:
                r = serve_run(eng, c, args.prompt_len, args.max_tokens, cfg.vocab_size, args.seed + c)
                sr = step_rate(eng, c)
                dec = r["decode_tokens_per_s"]
                row = dict(meta, workload="random", mode=mode, concurrency=c, prompt_len=args.prompt_len,
                           max_tokens=args.max_tokens,
                           **r, step_tokens_per_s=sr, overhead_vs_step=None if dec is None else 1 - dec / sr,
                           prefill_ms=pre, ttft_prompt=args.ttft_prompt, ttft_ms_single=single["ttft_ms_p50"],
                           dtype=args.dtype, layers=len(cfg.layers_block_type), buffer_len=args.buffer_len,
                           driver="in-process: builders.generation.Engine (the Triton streaming model's engine)")
                rows.append(row)
                if args.out is not None:  # after every row: a run cut short keeps what it measured
                    write(args.out, meta, rows)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                  if k not in meta}), flush=True)
        finally:
            eng.shutdown()
            del eng
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{'mode':<12} {'conc':>5} {'tok/s':>9} {'decode tok/s':>12} {'step tok/s':>10} {'overhead':>8} "
          f"{'ttft p50/p99 ms':>16} {'itl p50/p99 ms':>15}")
    for r in rows:
        ov = "-" if r["overhead_vs_step"] is None else f"{100 * r['overhead_vs_step']:.1f}%"
        dec = "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.0f}"
        print(f"{r['mode']:<12} {r['concurrency']:>5} {r['tokens_per_s']:>9.0f} {dec:>12} {r['step_tokens_per_s']:>10.0f} "
              f"{ov:>8} {r['ttft_ms_p50']:>7.1f}/{r['ttft_ms_p99']:<8.1f} {r['itl_ms_p50']:>6.2f}/{r['itl_ms_p99']:<7.2f}")
    if args.out is not None:
        print(f"wrote {write(args.out, meta, rows)}")
    return 0


def write(out: pathlib.Path, meta: dict, rows: list, workload: str = "random") -> pathlib.Path:
    """``{"meta": ..., "rows": [...]}`` as every result file (scripts/bench_table.py reads it: kind "serve"), named
    ``<date>_serve_<commit>.json`` (``_serve-shared-prefix_`` / ``_serve-preempt_`` for those workloads)."""
    out.mkdir(parents=True, exist_ok=True)
    tag = "serve" if workload == "random" else f"serve-{workload}"
    path = out / f"{meta['date'][:10]}_{tag}_{meta['commit']}.json"
    body = [{k: v for k, v in r.items() if k not in meta} for r in rows]
    path.write_text(json.dumps({"meta": meta, "rows": body}, indent=1) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
