# SPDX-License-Identifier: Apache-2.0
"""The one timing harness of every benchmark: CUDA-graph capture, timed samples, spread, the copy ceiling.

Two granularities, both on CUDA graphs so that launch overhead is what a served engine pays:

- a kernel (``scripts/bench_kernels.py``, ``bench_spec.py``, ``bench_gdn.py``, ``bench_vllm_layout.py``):
  :func:`graph_time_us` captures ``launches`` calls (the caller rotates its inputs through more memory than
  L2 holds) and returns the median and p90 - p10 spread of one launch over ``reps`` replays;
- a model step (``scripts/bench_e2e.py``, both steps): :func:`capture` makes a graph of one
  step (an eager warm-up call first, on a side stream: compilation, autotuning and host checks never run
  inside a capture), :func:`time_samples` times ``reps`` samples of ``steps`` replays each between two
  CUDA events (optionally each from a fresh ``restore()``, not timed); on the CPU both fall back to eager
  calls and ``perf_counter``.

:func:`copy_ceiling_tbps` is the measured bandwidth ceiling every "% of ceiling" column divides by (a
device-to-device copy through a kernel, bytes read + written).

Speculative verify steps cost what their committed count m says (history entries, and a fold where m + 2T > L):
the kernel benchmarks time a few counts (:func:`spec_timed_counts`), interpolate the others on their side of the
fold rule (:func:`interp_count`) and weight them by the count's stationary distribution at an acceptance
(:func:`spec_count_weights`, exact: ``costs.spec_count_distribution``): :func:`spec_step_us`.
"""

from __future__ import annotations

import statistics
import time

import torch

from . import costs


def spread(xs) -> float:
    """p90 - p10 of a list of samples (0 for a single sample)."""
    xs = sorted(xs)
    return xs[max(0, int(0.9 * len(xs)) - 1)] - xs[int(0.1 * len(xs))]


def graph_time_us(fn, launches: int, reps: int = 20) -> tuple[float, float]:
    """Median and spread (p90 - p10) in µs of one launch inside a captured graph of ``launches`` calls
    (``fn`` makes them all). One eager call first (compiles and loads the kernels)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(times), spread(times)


def spread_cursors(cursor: torch.Tensor, sbis, L: int, flush_first: bool = False) -> None:
    """Serving-like phases, in place: row i of every launch's slot list ``sbis`` at buffer position k = i mod L + 1
    (cursor i mod L), as in a batch of sequences that started at different tokens; ~1/L of a launch's rows flush.
    The kernel benchmarks' "mixed" launch, against the lockstep cycle (every row at one position, all flushing
    together) whose mean is the amortized step. ``flush_first``: the same positions sorted, longest ring first, so
    the flushing rows lead the launch (the order ``ReplayStateCache(row_order=)`` gives a serving batch: the
    kernels' grids walk the batch rows in order, and a flushing row's blocks are the long ones)."""
    for sbi in sbis:
        n = sbi.numel()
        pos = torch.arange(n, dtype=cursor.dtype, device=cursor.device) % L
        cursor[sbi.long()] = pos.sort(descending=True).values if flush_first else pos


def mixed_bytes(bytes_at: dict[int, int | float], batch: int, L: int) -> float:
    """Bytes of one mixed launch (:func:`spread_cursors`) of ``batch`` rows: row i at position i mod L + 1;
    ``bytes_at``: a row's bytes at position k = 1..L (costs.*_bytes_per_position)."""
    return sum(bytes_at[i % L + 1] for i in range(batch))


def add_replay_cycle(row: dict, name: str, per_k: list[float], bytes_at: dict, batch: int,
                     mixed_us: float | None = None, mixed_ff_us: float | None = None,
                     mixed_ord_us: float | None = None) -> dict:
    """A delta-rule kernel benchmark row (bench_gdn / bench_kda) with one replay variant's flush-cycle fields:
    ``per_k`` the times (µs) at positions k = 1..L (every row's cursor at k - 1: lockstep), ``bytes_at`` a row's
    bytes at each position. Fields ``<name>_``: ``us_k``, ``us_k1``, ``us_flush``, ``us_amortized`` (the mean over
    the cycle), ``bytes_amortized``, ``tbps`` / ``tbps_k1`` / ``tbps_flush``, ``speedup_vs_conv`` (the row's
    ``conv_us`` over the amortized step), ``flush_over_conv``; with ``mixed_us`` (one launch of spread cursors,
    :func:`spread_cursors`) also ``us_mixed``, ``bytes_mixed``, ``tbps_mixed``, ``speedup_vs_conv_mixed`` and
    ``mixed_over_amortized`` (below 1: spreading the flush over the steps saves time); with ``mixed_ff_us`` (the
    same launch with its flushing rows first, ``spread_cursors(flush_first=True)``) the same fields ending
    ``_mixed_ff``; with ``mixed_ord_us`` (the mixed launch behind the device's flush-first order kernel,
    ``cursor_ops.flush_order``, and the module that reads it) those ending ``_mixed_ord``."""
    L = len(per_k)
    if sorted(bytes_at) != list(range(1, L + 1)):
        raise ValueError(f"bytes_at: expected the positions 1..{L} of per_k, got {sorted(bytes_at)}")
    amort = _cycle_times(row, name, per_k)
    bytes_amort = sum(bytes_at.values()) / L * batch
    row[f"{name}_bytes_amortized"] = bytes_amort
    row[f"{name}_tbps"] = bytes_amort / amort / 1e6
    row[f"{name}_tbps_k1"] = bytes_at[1] * batch / per_k[0] / 1e6
    row[f"{name}_tbps_flush"] = bytes_at[L] * batch / per_k[-1] / 1e6
    for tag, us in (("mixed", mixed_us), ("mixed_ff", mixed_ff_us), ("mixed_ord", mixed_ord_us)):
        if us is None:
            continue
        mb = mixed_bytes(bytes_at, batch, L)  # the same positions in either order
        row[f"{name}_us_{tag}"], row[f"{name}_bytes_{tag}"] = us, mb
        row[f"{name}_tbps_{tag}"] = mb / us / 1e6
        row[f"{name}_speedup_vs_conv_{tag}"] = row["conv_us"] / us
        row[f"{name}_{tag}_over_amortized"] = us / amort
    return row


def _cycle_times(row: dict, prefix: str, per_k: list[float]) -> float:
    """A lockstep cycle's time fields ``<prefix>_``: ``us_k``, ``us_k1``, ``us_flush``, ``us_amortized`` (the mean),
    ``speedup_vs_conv`` and ``flush_over_conv`` (against the row's ``conv_us``); returns the amortized step."""
    amort = sum(per_k) / len(per_k)
    row[f"{prefix}_us_k"] = list(per_k)
    row[f"{prefix}_us_k1"], row[f"{prefix}_us_flush"], row[f"{prefix}_us_amortized"] = per_k[0], per_k[-1], amort
    row[f"{prefix}_speedup_vs_conv"] = row["conv_us"] / amort
    row[f"{prefix}_flush_over_conv"] = per_k[-1] / row["conv_us"]
    return amort


def add_ordered_cycle(row: dict, name: str, per_k: list[float], order_us: float, layers: int | None = None) -> dict:
    """The lockstep cycle of a variant's row-order module (``per_k``: µs at k = 1..L, its order computed before the
    timed launches, as a serving step computes it once for all its recurrent layers) beside the plain cycle of
    :func:`add_replay_cycle`: fields ``<name>_ro_us_k``, ``_ro_us_k1``, ``_ro_us_flush``, ``_ro_us_amortized``,
    ``_ro_speedup_vs_conv``, ``_ro_flush_over_conv``; ``order_us`` the order kernel's own launch (``order_us``); with
    ``layers`` (the model's recurrent layers sharing one order a step) also ``_ro_speedup_vs_conv_step``, the
    conventional step over the amortized step plus the order's share."""
    amort = _cycle_times(row, f"{name}_ro", per_k)
    row["order_us"] = order_us
    if layers:
        row["order_layers"] = layers
        row[f"{name}_ro_speedup_vs_conv_step"] = row["conv_us"] / (amort + order_us / layers)
    return row


def time_ordered_cycle(row: dict, name: str, cursor, L: int, order_all, replay, rotations: int,
                       layers: int | None = None) -> dict:
    """Time a variant's row-order cycle and add it (:func:`add_ordered_cycle`): at each position k the cursor at
    k - 1, ``order_all()`` (the orders of every rotation, outside the timing), then ``replay`` (the row-order module on
    them, a graph of ``rotations`` launches); the order kernel's own launch timed as ``order_all``'s graph."""
    per_k = []
    for k in range(1, L + 1):
        cursor.fill_(k - 1)
        order_all()
        per_k.append(graph_time_us(replay, rotations)[0])
    return add_ordered_cycle(row, name, per_k, graph_time_us(order_all, rotations)[0], layers)


def ordered_cells(row: dict, names=("f32", "bf16shadow")) -> str:
    """The benchmark tables' row-order column (:func:`add_ordered_cycle`): each variant's k = 1, flush and amortized
    µs and x conv (with the order's share where the model's layer count is known)."""
    if "order_us" not in row:
        return ""
    cells = [f"{n} {row[f'{n}_ro_us_k1']:.1f} / {row[f'{n}_ro_us_flush']:.1f} / {row[f'{n}_ro_us_amortized']:.1f} "
             f"({row.get(f'{n}_ro_speedup_vs_conv_step', row[f'{n}_ro_speedup_vs_conv']):.2f})" for n in names]
    return f"ro: order {row['order_us']:.1f} us; " + ", ".join(cells)


def mixed_cells(row: dict, names=("f32", "bf16shadow")) -> str:
    """The benchmark tables' mixed column: each variant's mixed launch, then (where timed) the same positions with
    the flushing rows first ("ff") and the launch behind the device's order kernel ("ord"), "us (x conv)"."""
    return ", ".join(f"{row[f'{n}_us_mixed']:.1f} ({row[f'{n}_speedup_vs_conv_mixed']:.2f})"
                     + "".join(f" {t} {row[f'{n}_us_mixed_{t}']:.1f} ({row[f'{n}_speedup_vs_conv_mixed_{t}']:.2f})"
                               for t in ("ff", "ord") if f"{n}_us_mixed_{t}" in row) for n in names)


def add_ceiling_pcts(row: dict, ceiling: float, names=("f32", "bf16shadow")) -> dict:
    """A delta-rule kernel benchmark row (bench_gdn / bench_kda) with the % of the copy ceiling ``ceiling`` (TB/s)
    beside its TB/s fields: the conventional step, each replay variant's amortized, k = 1 and (where timed) mixed
    step, the peer's."""
    row["pct_ceiling_conv"] = 100 * row["tbps_conv"] / ceiling
    for name in names:
        row[f"{name}_pct_ceiling"] = 100 * row[f"{name}_tbps"] / ceiling
        row[f"{name}_pct_ceiling_k1"] = 100 * row[f"{name}_tbps_k1"] / ceiling
        for tag in ("mixed", "mixed_ff", "mixed_ord"):
            if f"{name}_tbps_{tag}" in row:
                row[f"{name}_pct_ceiling_{tag}"] = 100 * row[f"{name}_tbps_{tag}"] / ceiling
    if "fla_us" in row:
        row["pct_ceiling_fla"] = 100 * row["tbps_fla"] / ceiling
    return row


def copy_ceiling_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy through a kernel (not a graph memcpy node, which runs on a copy
    engine and is slower), bytes read + written, median of 30 after warm-up."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(33):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.mul(src, 1.0, out=dst)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e12


def capture(fn, restore, cuda: bool):
    """``(run, graph)``: ``fn`` itself and None on the CPU; on CUDA one eager warm-up call on a side stream
    (compilation, autotuning, host checks, cuBLAS handles: never inside the capture), then a graph of one
    call, ``run = graph.replay``. ``restore()`` puts the state back after each of the two calls. Keep
    ``graph`` alive while ``run`` is used."""
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
    """ms per call of ``reps`` samples of ``steps`` calls each, after ``warmup`` untimed samples. With
    ``restore`` every sample starts from a fresh ``restore()`` (not timed); with None the samples follow one
    another (a decode run that keeps going, e.g. one flush cycle of L steps per sample)."""
    for _ in range(warmup):
        if restore is not None:
            restore()
        for _ in range(steps):
            run()
    out = []
    for _ in range(reps):
        if restore is not None:
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
    if cuda:
        torch.cuda.synchronize()
    return out


def commit_id(arg: str | None = None) -> str:
    """The commit a result is filed under: ``arg`` (a benchmark's --commit), else $GIT_COMMIT, else git's HEAD
    of this checkout (10 hex digits), else "unknown". The environment comes before git: the device machine's
    copy of the working tree sits on a stale .git (its HEAD named a days-old commit, 2026-12-05)."""
    import os
    import pathlib
    import subprocess

    if arg or os.environ.get("GIT_COMMIT"):
        return arg or os.environ["GIT_COMMIT"]
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        return subprocess.check_output(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"],
                                       stderr=subprocess.DEVNULL, text=True).strip() or "unknown"
    except Exception:
        return "unknown"


SOURCE_GLOBS = ("plugins/**/*.cu", "plugins/**/*.cuh", "trtllm_replayssm/**/*.py", "builders/*.py", "scripts/*.py")


def source_hash(root=None) -> str:
    """sha256 (16 hex digits) of the source that ran: every file of :data:`SOURCE_GLOBS`, path and content, as they
    are on disk. Unlike the commit it needs no .git (the device's copy is stale) and it sees uncommitted edits:
    ``git archive <commit> | ...`` of the named commit must give the same hash, or the result is not that commit's."""
    import hashlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent if root is None else pathlib.Path(root)
    h = hashlib.sha256()
    for f in sorted({p for g in SOURCE_GLOBS for p in root.glob(g) if p.is_file()}):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run_meta(device=None, commit: str | None = None, seed: int | None = None) -> dict:
    """What every result file starts with: device (the CUDA device's name, "cpu" for a CPU device), date (UTC,
    ISO 8601 to the second), commit (:func:`commit_id`), source_hash (:func:`source_hash`: the tree that ran),
    seed (when the benchmark has one), torch version."""
    import datetime

    dev = torch.device("cuda" if device is None else device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    meta = dict(device=name, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=commit_id(commit), source_hash=source_hash(), torch=torch.__version__)
    if seed is not None:
        meta["seed"] = seed
    return meta


def spec_timed_counts(T: int, L: int) -> tuple[int, ...]:
    """Committed counts a verify benchmark times: a verify starts from 0..L-T; those with m + 2T > L fold first.
    Three counts without a fold (0, the middle, L-2T) and the first and last with one (T = 4, L = 16: 0, 4, 8,
    9, 12); the others are interpolated on their side of the rule (:func:`interp_count`)."""
    no_fold = sorted({0, (L - 2 * T) // 2, L - 2 * T})
    fold = sorted({L - 2 * T + 1, L - T})
    return tuple(no_fold + fold)


def spec_count_weights(T: int, L: int, p: float = 0.8) -> tuple[dict, float]:
    """The committed counts a verify starts from, with their stationary weights, when each draft is accepted with
    probability p while the previous ones were (n = 1 + consecutive accepted drafts; the commit's flush rule on
    the cursor): ``costs.spec_count_distribution`` (exact, the end-to-end spec step's model too), and the
    tokens a step emits (sum_{k<T} p^k). p = 1: full acceptance, the counts cycle T, 2T, ... (after a fold the
    count is the step's n, not 0)."""
    tokens = sum(p ** k for k in range(T))
    return costs.spec_count_distribution(T, L, tokens), tokens


def interp_count(points: dict, m: int, T: int, L: int) -> float:
    """Time at count m, linear between the measured counts on the same side of the flush rule."""
    flush = m + 2 * T > L
    xs = sorted(k for k in points if (k + 2 * T > L) == flush)
    if len(xs) == 1:
        return points[xs[0]]
    if m <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif m >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        lo = max(x for x in xs if x <= m)
        hi = min(x for x in xs if x >= m)
        if lo == hi:
            return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (m - lo) / (hi - lo)


def spec_step_us(points: dict, T: int, L: int, p: float) -> tuple[float, float]:
    """(time of a verify step at acceptance p, tokens it emits): the timed counts ``points`` ({m: us}) interpolated
    and weighted by :func:`spec_count_weights`."""
    weights, tokens = spec_count_weights(T, L, p)
    return sum(w * interp_count(points, m, T, L) for m, w in weights.items()), tokens
