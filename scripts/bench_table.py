#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Markdown tables of the committed benchmark results (bench/results/*.json), labelled by card and commit.

Each result file is classified by its rows (not its name) into one kind:

  kernels      scripts/bench_kernels.py, scripts/sweep_variants.py: Mamba-2 decode kernels per geometry / batch
  gdn          scripts/bench_gdn.py: Gated DeltaNet decode kernels (+ bf16 shadow, + fla peer)
  gdn-spec     scripts/bench_gdn.py --spec: Gated DeltaNet speculative verify vs native spec
  spec         scripts/bench_spec.py: Mamba-2 speculative verify kernels vs native spec and the standard step
  decode       scripts/bench_e2e.py standard: whole-model decode step per mode and batch
  spec-decode  scripts/bench_e2e.py spec: whole-model speculative decoding per mode, acceptance and batch
  tp-check     scripts/bench_e2e.py standard --tp N: TP=N logits vs TP=1
  profile      per-category kernel time of a model step (torch profiler)
  vllm-layout  scripts/bench_vllm_layout.py: the decode kernel on vLLM's paged layout
  shape-sweep  scripts/bench_kda.py --sweep(-only): launch shapes (col_lanes, warps) of the KDA modules, us at k = 1 / 8 / L
  other        a format without rows of a known kind or without device and commit (listed, never tabled)

One table per (kind, card, commit): files of one kind measured on the same card at the same commit share a table
(with a file column), and tables of different cards are never merged.

Usage:
  python scripts/bench_table.py [FILE ...] [--kind K ...] [--device TEXT] [--commit TEXT]   # print tables
  python scripts/bench_table.py --list                       # every result file: kind, card, commit, rows
  python scripts/bench_table.py --write [DOC ...]            # regenerate the marked blocks of docs/*.md
  python scripts/bench_table.py --check [DOC ...]            # exit 1 when a marked block is out of date

FILE defaults to every bench/results/*.json. A generated block in a markdown file is

  <!-- bench_table: bench/results/A.json [bench/results/B.json ...] [--kind K] -->
  ... (written by --write) ...
  <!-- /bench_table -->

and holds the tables of the files it names (paths relative to the repository root).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import shlex
import sys
from collections.abc import Callable, Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
KINDS = ("kernels", "gdn", "gdn-spec", "spec", "decode", "spec-decode", "tp-check", "profile", "vllm-layout", "serve",
         "shape-sweep", "state-error", "kda-layout", "kda-vk-parts")
BEGIN = re.compile(r"^<!-- bench_table: (?P<args>.+?) -->$")
END = "<!-- /bench_table -->"


@dataclasses.dataclass
class Result:
    path: pathlib.Path
    kind: str  # one of KINDS, or "other"
    device: str | None = None
    commit: str | None = None
    date: str | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    rows: list = dataclasses.field(default_factory=list)
    reason: str = ""  # why a file is "other"

    @property
    def name(self) -> str:
        return self.path.name


def _row_keys(rows: list) -> set:
    keys: set = set()
    for r in rows:
        if not isinstance(r, dict):
            raise ValueError(f"a row is a {type(r).__name__}, not an object")
        keys |= r.keys()
    return keys


def classify_rows(rows: list) -> str | None:
    """The kind of a list of result rows, or None when no known kind fits."""
    k = _row_keys(rows)
    if {"conv_us", "conv_vk_us"} <= k:
        return "kda-layout"
    if {"err_max", "tol"} <= k:
        return "tp-check"
    if "categories_ms" in k:
        return "profile"
    if {"concurrency", "ttft_ms_p50"} <= k:
        return "serve"
    if {"acceptance", "tokens_per_s"} <= k:
        return "spec-decode"
    if {"ms_step", "mode"} <= k:
        return "decode"
    if {"native_us_step", "f32_us_step"} <= k:
        return "gdn-spec"
    if "f32_us_amortized" in k:
        return "gdn"
    if {"verify_us_step", "native_us_step"} <= k:
        return "spec"
    if {"conv_us", "replay_us_amortized"} <= k:
        return "kernels"
    if {"dense_us_amortized", "vllm_us_amortized"} <= k:
        return "vllm-layout"
    if {"shape", "conv_us", "f32_us_at"} <= k:
        return "shape-sweep"
    if {"y_rel_mean", "state_rel_last"} <= k:
        return "state-error"
    if {"prologue_us", "rows_us"} <= k:
        return "kda-vk-parts"
    return None


def parse(path: str | pathlib.Path) -> Result:
    """Read one result file. Raises ValueError when it is not JSON of a shape this script knows (the kinds
    above, or one of the recognised "other" shapes)."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    if isinstance(data, list):
        return Result(path, "other", reason="a bare list of rows: no device or commit recorded")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level is a {type(data).__name__}")
    if isinstance(data.get("meta"), dict) and isinstance(data.get("rows"), list):
        meta, rows = data["meta"], data["rows"]
        if not rows and isinstance(data.get("sweep"), list):  # a sweep-only run (bench_kda.py --sweep-only)
            rows = data["sweep"]
    elif isinstance(data.get("rows"), list) and "device" in data:  # results whose meta sits at the top level
        meta, rows = {k: v for k, v in data.items() if k != "rows"}, data["rows"]
    else:
        return Result(path, "other", reason=f"no meta/rows (keys: {', '.join(sorted(map(str, data))[:8])})")
    try:
        kind = classify_rows(rows)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    device, commit = meta.get("device"), meta.get("commit")
    if kind is None:
        return Result(path, "other", device, commit, meta.get("date"), meta, rows, "rows of no known kind")
    if not device or not commit:
        return Result(path, "other", device, commit, meta.get("date"), meta, rows, "device or commit not recorded")
    return Result(path, kind, str(device), str(commit), str(meta.get("date", "")), meta, rows)


# ---------------------------------------------------------------- formatting


def num(v, digits: int = 1, suffix: str = "") -> str | None:
    if v is None or isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return f"{v:.{digits}f}{suffix}"


def ratio(v) -> str | None:
    return num(v, 2, "x")


def sci(v) -> str | None:
    return None if v is None else f"{v:.2e}"


def with_pct(v, pct, digits: int = 1) -> str | None:
    s = num(v, digits)
    if s is None:
        return None
    p = num(pct, 0)
    return f"{s} ({p}%)" if p is not None else s


def text(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, list | tuple):
        return " ".join(str(x) for x in v) or None
    return str(v)


Column = tuple[str, Callable[[dict], str | None]]
FILE_COLUMN: Column = ("file", lambda r: r.get("_file"))  # filled only where a table holds rows of several files


def render(columns: list[Column], rows: Iterable[dict]) -> list[str]:
    """A markdown table; a column whose cells are all empty is left out, an empty cell prints "-"."""
    rows = list(rows)
    cells = [[fn(r) for _, fn in columns] for r in rows]
    keep = [j for j in range(len(columns)) if any(c[j] is not None for c in cells)]
    out = ["| " + " | ".join(columns[j][0] for j in keep) + " |", "|" + "---|" * len(keep)]
    for c in cells:
        out.append("| " + " | ".join("-" if c[j] is None else str(c[j]).replace("|", "/") for j in keep) + " |")
    return out


def _defines(v) -> str | None:
    """sweep_variants.py's compile-time defines: [[name, value], ...] -> "NAME=value ..."."""
    if isinstance(v, list) and all(isinstance(d, list | tuple) and len(d) == 2 for d in v):
        return " ".join(f"{k}={x}" for k, x in v) or "default"
    return text(v)


def _variant(r: dict) -> str | None:
    parts = [text(r.get("variant")), _defines(r.get("defines")), text(r.get("code")), text(r.get("run"))]
    if r.get("pass") is not None:
        parts.append(f"pass {r['pass']}")
    parts = [p for p in parts if p]
    return ", ".join(parts) if parts else None


def kernels_table(rows: list[dict]) -> list[str]:
    cols: list[Column] = [
        FILE_COLUMN,
        ("geometry", lambda r: text(r.get("geom"))),
        ("variant", _variant),
        ("state", lambda r: text(r.get("state"))),
        ("shadow", lambda r: text(r.get("shadow", "none"))),
        ("L", lambda r: text(r.get("L"))),
        ("batch", lambda r: text(r.get("batch"))),
        ("conventional µs (% ceil)", lambda r: with_pct(r.get("conv_us"), r.get("pct_ceiling_conv"))),
        ("replay k=1 µs", lambda r: num(r.get("replay_us_k1"))),
        ("flush µs", lambda r: num(r.get("replay_us_flush"))),
        ("replay amortized µs (% ceil)",
         lambda r: with_pct(r.get("replay_us_amortized"), r.get("pct_ceiling_replay"))),
        ("vs conventional", lambda r: ratio(r.get("speedup_vs_conv"))),
        ("replay mixed µs", lambda r: num(r.get("replay_us_mixed"))),
        ("mixed vs conventional", lambda r: ratio(r.get("speedup_vs_conv_mixed"))),
        ("mamba_ssm µs", lambda r: num(r.get("mamba_us"))),
        ("vs mamba_ssm", lambda r: ratio(r.get("speedup_vs_mamba"))),
    ]
    return render(cols, rows)


def gdn_table(rows: list[dict]) -> list[str]:
    cols: list[Column] = [
        FILE_COLUMN,
        ("geometry", lambda r: text(r.get("geom"))),
        ("L", lambda r: text(r.get("L"))),
        ("batch", lambda r: text(r.get("batch"))),
        ("conventional µs (% ceil)", lambda r: with_pct(r.get("conv_us"), r.get("pct_ceiling_conv"))),
        ("ReplaySSM µs", lambda r: num(r.get("f32_us_amortized"))),
        ("x conv", lambda r: ratio(r.get("f32_speedup_vs_conv"))),
        ("+ bf16 shadow µs", lambda r: num(r.get("bf16shadow_us_amortized"))),
        ("shadow x conv", lambda r: ratio(r.get("bf16shadow_speedup_vs_conv"))),
        ("shadow passes", lambda r: text(r.get("shadow_passes"))),
        ("fla µs (% ceil)", lambda r: with_pct(r.get("fla_us"), r.get("pct_ceiling_fla"))),
        ("ReplaySSM / shadow x fla",
         lambda r: None if r.get("f32_speedup_vs_fla") is None
         else f"{ratio(r.get('f32_speedup_vs_fla'))} / {ratio(r.get('bf16shadow_speedup_vs_fla')) or '-'}"),
    ]
    return render(cols, rows)


def gdn_spec_table(rows: list[dict]) -> list[str]:
    cols: list[Column] = [
        FILE_COLUMN,
        ("geometry", lambda r: text(r.get("geom"))),
        ("T", lambda r: text(r.get("T"))),
        ("p accept", lambda r: text(r.get("p_accept"))),
        ("L", lambda r: text(r.get("L"))),
        ("batch", lambda r: text(r.get("batch"))),
        ("native spec µs/step (% ceil)", lambda r: with_pct(r.get("native_us_step"), r.get("native_pct_ceiling"))),
        ("ReplaySSM verify µs/step", lambda r: num(r.get("f32_us_step"))),
        ("x native", lambda r: ratio(r.get("f32_speedup_vs_native"))),
        ("+ bf16 shadow µs/step", lambda r: num(r.get("bf16shadow_us_step"))),
        ("shadow x native", lambda r: ratio(r.get("bf16shadow_speedup_vs_native"))),
    ]
    return render(cols, rows)


def _by_count(r: dict) -> str | None:
    d = r.get("verify_us_by_count")
    if not isinstance(d, dict):
        return None
    return ", ".join(f"{m}: {num(v)}" for m, v in sorted(d.items(), key=lambda kv: int(kv[0])))


def spec_table(rows: list[dict]) -> list[str]:
    cols: list[Column] = [
        FILE_COLUMN,
        ("geometry", lambda r: text(r.get("geom"))),
        ("state", lambda r: text(r.get("state"))),
        ("T", lambda r: text(r.get("T"))),
        ("L", lambda r: text(r.get("L"))),
        ("batch", lambda r: text(r.get("batch"))),
        ("standard µs/step", lambda r: num(r.get("standard_us_step"))),
        ("verify µs/step (mean over counts)", lambda r: num(r.get("verify_us_step"))),
        ("verify / standard step", lambda r: ratio(r.get("verify_over_standard_step"))),
        ("native spec µs/step", lambda r: num(r.get("native_us_step"))),
        ("verify x native", lambda r: ratio(r.get("verify_vs_native"))),
        ("verify µs by committed count", _by_count),
    ]
    return render(cols, rows)


def _skip_text(r: dict) -> str:
    reason = r.get("reason")
    if reason:
        return str(reason).split(":")[0]
    if r.get("needed_gib") is not None:
        return f"skipped (needs {r['needed_gib']:.1f} GiB, {num(r.get('free_gib')) or '?'} free)"
    return "skipped"


def _pivot(results: list[Result], key_of: Callable[[dict], object | None]) -> tuple[list[tuple], dict, dict]:
    """(row keys in order, {(file, batch): {column key: row}}, {(file, batch): batch-level skip text})."""
    order: list[tuple] = []
    cells: dict = {}
    skips: dict = {}
    for res in results:
        for r in res.rows:
            if "batch" not in r:
                continue
            rk = (res.name, r["batch"])
            if rk not in cells:
                order.append(rk)
                cells[rk] = {}
            k = key_of(r)
            if k is None:
                if r.get("skipped"):
                    skips[rk] = _skip_text(r)
                continue
            cells[rk][k] = r
    order.sort(key=lambda rk: ([res.name for res in results].index(rk[0]), rk[1]))
    return order, cells, skips


def _modes(results: list[Result], key: str = "mode") -> list[str]:
    seen: list[str] = []
    for res in results:
        for m in list(res.meta.get("modes") or []) + [r.get(key) for r in res.rows]:
            if m is not None and m not in seen:
                seen.append(m)
    return seen


def decode_table(results: list[Result]) -> list[str]:
    order, cells, skips = _pivot(results, lambda r: r.get("mode"))
    modes = _modes(results)
    ref = "conventional"

    def cell(m: str, fn, first: bool = False):
        def get(rk):
            r = cells[rk].get(m)
            if r is None:
                return skips.get(rk) if first else None  # a skipped batch is said once, in its first column
            return _skip_text(r) if r.get("skipped") else fn(r)
        return get

    cols: list[Column] = [("file", lambda rk: rk[0])] if len(results) > 1 else []
    cols.append(("batch", lambda rk: str(rk[1])))
    cols += [(f"{m} ms", cell(m, lambda r: num(r.get("ms_step"), 2), i == 0)) for i, m in enumerate(modes)]
    cols += [(f"{m} x conv", cell(m, lambda r: ratio(r.get("speedup_vs_conventional")))) for m in modes if m != ref]
    cols.append(("SSM share (conv)", cell(ref, lambda r: num(100 * r["ssm_share"], 1, "%")
                                          if isinstance(r.get("ssm_share"), int | float) else None)))
    return render(cols, order)


def spec_decode_table(results: list[Result]) -> list[str]:
    def key(r):
        if r.get("mode") is None:
            return None
        return (r["mode"], None if r.get("mode") == "standard" else r.get("acceptance"))

    order, cells, skips = _pivot(results, key)
    keys: list = []
    for res in results:
        for r in res.rows:
            k = key(r)
            if k is not None and k not in keys:
                keys.append(k)
    # standard first, then acceptance by acceptance, each in the modes' order
    modes = _modes(results)
    accs = sorted({k[1] for k in keys if k[1] is not None})
    ordered = [k for k in keys if k[1] is None and k[0] == "standard"]
    ordered += [(m, a) for a in accs for m in modes if (m, a) in keys]
    ordered += [k for k in keys if k not in ordered]

    def cell(k, first: bool = False):
        def get(rk):
            r = cells[rk].get(k)
            if r is None:
                # a skipped mode row carries no acceptance: it stands for every acceptance of that mode
                s = cells[rk].get((k[0], None))
                if s is not None and s.get("skipped"):
                    return _skip_text(s)
                return skips.get(rk) if first else None
            if r.get("skipped"):
                return _skip_text(r)
            tps = num(r.get("tokens_per_s"), 0)
            if tps is None or k[0] == "standard":
                return tps
            sp = ratio(r.get("speedup_vs_standard"))
            return f"{tps} ({sp})" if sp else tps
        return get

    cols: list[Column] = [("file", lambda rk: rk[0])] if len(results) > 1 else []
    cols.append(("batch", lambda rk: str(rk[1])))
    for k in ordered:
        if k[1] is None and k[0] != "standard":
            continue  # only a skipped row without acceptance: shown under that mode's acceptance columns
        head = "standard tokens/s" if k[0] == "standard" else f"{k[0]} {k[1]} tokens/s (x standard)"
        cols.append((head, cell(k, len(cols) == (2 if len(results) > 1 else 1))))
    return render(cols, order)


def tp_check_table(rows: list[dict]) -> list[str]:
    cols: list[Column] = [
        FILE_COLUMN,
        ("geometry", lambda r: "(" + ", ".join(map(str, r["geometry"])) + ")"
         if isinstance(r.get("geometry"), list) else text(r.get("geometry"))),
        ("layers", lambda r: text(r.get("layers"))),
        ("tp", lambda r: text(r.get("tp"))),
        ("mode", lambda r: text(r.get("mode"))),
        ("dtype", lambda r: text(r.get("dtype"))),
        ("steps", lambda r: text(r.get("steps"))),
        ("batch", lambda r: text(r.get("batch"))),
        ("max abs(dlogit) / std", lambda r: None if r.get("err_max") is None else f"{r['err_max']:.2g}"),
        ("tolerance", lambda r: text(r.get("tol"))),
        ("rank spread", lambda r: text(r.get("rank_spread"))),
        ("passed", lambda r: text(r.get("passed"))),
    ]
    return render(cols, [r for r in rows if r.get("kind", "tp_check") == "tp_check"])


def profile_table(rows: list[dict]) -> list[str]:
    cats = []
    for r in rows:
        for c in (r.get("categories_ms") or {}):
            if c not in cats:
                cats.append(c)
    cols: list[Column] = [
        FILE_COLUMN,
        ("batch", lambda r: text(r.get("batch"))),
        ("T", lambda r: text(r.get("T"))),
        ("mode", lambda r: text(r.get("mode"))),
        ("KV positions", lambda r: text(r.get("kv_len"))),
        ("filled", lambda r: text(r.get("fill"))),
        ("ms/step", lambda r: num(r.get("ms_step"), 3)),
        ("kernel sum ms", lambda r: num(r.get("kernel_sum_ms"), 3)),
        ("kernels/step", lambda r: num(r.get("kernels_per_step"), 0)),
    ]
    cols += [(f"{c} ms", lambda r, c=c: num((r.get("categories_ms") or {}).get(c), 3)) for c in cats]
    return render(cols, rows)


def vllm_layout_table(rows: list[dict]) -> list[str]:
    cols: list[Column] = [
        FILE_COLUMN,
        ("batch", lambda r: text(r.get("batch"))),
        ("conventional µs", lambda r: num(r.get("conv_us"))),
        ("ReplaySSM contiguous µs (x conv)",
         lambda r: f"{num(r.get('dense_us_amortized'))} ({ratio(r.get('dense_speedup_vs_conv'))})"
         if r.get("dense_us_amortized") is not None else None),
        ("ReplaySSM on vLLM's pages µs (x conv)",
         lambda r: f"{num(r.get('vllm_us_amortized'))} ({ratio(r.get('vllm_speedup_vs_conv'))})"
         if r.get("vllm_us_amortized") is not None else None),
        ("pages / contiguous", lambda r: num(r.get("vllm_over_dense"), 3)),
        ("adapter, contiguous / contiguous", lambda r: num(r.get("adapter_contiguous_over_dense"), 3)),
    ]
    return render(cols, rows)


def serve_table(rows: list[dict]) -> list[str]:
    cols: list[Column] = [
        FILE_COLUMN,
        ("mode", lambda r: text(r.get("mode"))),
        ("concurrency", lambda r: text(r.get("concurrency"))),
        ("decode tok/s", lambda r: num(r.get("decode_tokens_per_s"), 0)),
        ("captured step tok/s", lambda r: num(r.get("step_tokens_per_s"), 0)),
        ("server overhead", lambda r: None if r.get("overhead_vs_step") is None
         else num(100 * r["overhead_vs_step"], 1, "%")),
        ("tok/s (prefills included)", lambda r: num(r.get("tokens_per_s"), 0)),
        ("TTFT p50 / p99 ms", lambda r: None if r.get("ttft_ms_p50") is None
         else f"{num(r['ttft_ms_p50'])} / {num(r.get('ttft_ms_p99'))}"),
        ("ITL p50 / p99 ms", lambda r: None if r.get("itl_ms_p50") is None
         else f"{num(r['itl_ms_p50'], 2)} / {num(r.get('itl_ms_p99'), 2)}"),
        ("TTFT alone / prefill ms", lambda r: None if r.get("ttft_ms_single") is None
         else f"{num(r['ttft_ms_single'])} / {num(r.get('prefill_ms'))}"),
    ]
    return render(cols, rows)


def shape_sweep_table(rows: list[dict]) -> list[str]:
    def at(key, k):
        return lambda r: num((r.get(key) or {}).get(k))

    ks = sorted({k for r in rows for k in (r.get("f32_us_at") or {})}, key=int)
    cols: list[Column] = [
        FILE_COLUMN,
        ("geometry", lambda r: text(r.get("geom"))),
        ("batch", lambda r: text(r.get("batch"))),
        ("(col_lanes, warps)", lambda r: "(" + ", ".join(map(str, r["shape"])) + ")"
         if isinstance(r.get("shape"), list) else text(r.get("shape"))),
        ("conventional µs", lambda r: num(r.get("conv_us"))),
    ]
    cols += [(f"fp32 k={k} µs", at("f32_us_at", k)) for k in ks]
    cols += [(f"bf16 shadow k={k} µs", at("bf16shadow_us_at", k)) for k in ks]
    return render(cols, rows)


def state_error_table(rows: list[dict]) -> list[str]:
    """scripts/gdn_state_error.py: the checkpoint's and the outputs' error against float64 over many flushes."""
    cols: list[Column] = [
        FILE_COLUMN,
        ("y rel, mean", lambda r: sci(r.get("y_rel_mean"))),
        ("y rel, max", lambda r: sci(r.get("y_rel_max"))),
        ("state rel, first flush", lambda r: sci(r.get("state_rel_first"))),
        ("state rel, last", lambda r: sci(r.get("state_rel_last"))),
        ("state rel, max", lambda r: sci(r.get("state_rel_max"))),
    ]
    return render(cols, rows)


def kda_layout_table(rows: list[dict]) -> list[str]:
    """bench_kda.py --vk: the KDA steps on a (V, K) state beside the (K, V) ones, same inputs (bench/NOTES.md "KDA in
    GDN's row layout")."""
    cols: list[Column] = [
        FILE_COLUMN,
        ("geometry", lambda r: text(r.get("geom"))),
        ("batch", lambda r: text(r.get("batch"))),
        ("(K, V) conventional µs", lambda r: num(r.get("conv_us"))),
        ("% ceiling", lambda r: num(r.get("pct_ceiling_conv"))),
        ("(V, K) conventional µs", lambda r: num(r.get("conv_vk_us"))),
        ("% ceiling", lambda r: num(r.get("pct_ceiling_conv_vk"))),
        ("x", lambda r: ratio(r.get("conv_vk_speedup"))),
        ("(K, V) fp32 replay µs", lambda r: num(r.get("f32_us_amortized"))),
        ("(V, K) fp32 replay µs", lambda r: num(r.get("vk_f32_us_amortized"))),
        ("(V, K) replay x its conventional", lambda r: ratio(r.get("vk_f32_speedup_vs_conv_vk"))),
        ("(V, K) two-kernel replay µs", lambda r: num(r.get("vk2_f32_us_amortized"))),
        ("x its conventional", lambda r: ratio(r.get("vk2_f32_speedup_vs_conv_vk"))),
    ]
    return render(cols, rows)


def kda_vk_parts_table(rows: list[dict]) -> list[str]:
    """bench_kda_vk_parts.py: the two-kernel (V, K) KDA step's kernels timed apart."""
    cols: list[Column] = [
        FILE_COLUMN,
        ("geometry", lambda r: text(r.get("geom"))),
        ("batch", lambda r: text(r.get("batch"))),
        ("position", lambda r: text(r.get("k"))),
        ("prologue µs", lambda r: num(r.get("prologue_us"))),
        ("rows µs", lambda r: num(r.get("rows_us"))),
        ("both µs", lambda r: num(r.get("both_us"))),
        ("both, PDL µs", lambda r: num(r.get("both_pdl_us"))),
    ]
    return render(cols, rows)


ROW_TABLES = {"serve": serve_table, "shape-sweep": shape_sweep_table, "kernels": kernels_table,
              "gdn": gdn_table, "gdn-spec": gdn_spec_table, "spec": spec_table,
              "tp-check": tp_check_table, "profile": profile_table, "vllm-layout": vllm_layout_table,
              "state-error": state_error_table, "kda-layout": kda_layout_table,
              "kda-vk-parts": kda_vk_parts_table}
PIVOT_TABLES = {"decode": decode_table, "spec-decode": spec_decode_table}


# ---------------------------------------------------------------- groups


def group(results: Iterable[Result]) -> list[list[Result]]:
    """Results of a known kind grouped by (kind, card, commit), in the order of their first file."""
    groups: dict[tuple, list[Result]] = {}
    for res in results:
        if res.kind == "other":
            continue
        groups.setdefault((res.kind, res.device, res.commit), []).append(res)
    return list(groups.values())


def caption(results: list[Result]) -> str:
    first = results[0]
    parts = [f"**{first.device}**, commit {first.commit}, {first.kind}"]
    ceilings = sorted({f"{r.meta['copy_ceiling_tbps']:.2f}" for r in results
                       if isinstance(r.meta.get("copy_ceiling_tbps"), int | float)})
    if ceilings:
        parts.append(f"copy ceiling {' / '.join(ceilings)} TB/s")
    files = "; ".join(f"`bench/results/{r.name}` ({r.date})" if r.date else f"`bench/results/{r.name}`"
                      for r in results)
    return ", ".join(parts) + ": " + files


def table(results: list[Result]) -> str:
    """The markdown of one (kind, card, commit) group: a caption line naming card, commit and files, then the
    table."""
    kinds = {(r.kind, r.device, r.commit) for r in results}
    if len(kinds) != 1:
        raise ValueError(f"one table per (kind, card, commit), got {sorted(map(str, kinds))}")
    kind = results[0].kind
    if kind in PIVOT_TABLES:
        lines = PIVOT_TABLES[kind](results)
    else:
        several = len(results) > 1
        lines = ROW_TABLES[kind]([dict(r, _file=res.name) if several else r for res in results for r in res.rows])
    return "\n".join([caption(results), ""] + lines)



def tables(results: Iterable[Result], kinds: Iterable[str] | None = None, device: str | None = None,
           commit: str | None = None) -> str:
    sel = [r for r in results if r.kind != "other" and (not kinds or r.kind in kinds)
           and (device is None or device.lower() in r.device.lower())
           and (commit is None or r.commit.startswith(commit))]
    return "\n\n".join(table(g) for g in group(sel))


def result_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return sorted((root / "bench" / "results").glob("*.json"))


# ---------------------------------------------------------------- generated blocks in markdown


def _block_args(args: str) -> tuple[list[str], list[str]]:
    p = argparse.ArgumentParser(prog="bench_table block", add_help=False, exit_on_error=False)
    p.add_argument("files", nargs="+")
    p.add_argument("--kind", action="append", choices=KINDS)
    try:
        a = p.parse_args(shlex.split(args))
    except (argparse.ArgumentError, SystemExit) as e:  # exit_on_error=False still exits on unknown arguments
        raise ValueError(f"bad bench_table block arguments {args!r}: {e}") from None
    return a.files, a.kind or []


def regenerate(md: str, root: pathlib.Path = ROOT) -> str:
    """The markdown text with every bench_table block rewritten from the files its marker names."""
    lines = md.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i].strip())
        if not m:
            if lines[i].strip() == END:
                raise ValueError(f"line {i + 1}: {END} without a begin marker")
            out.append(lines[i])
            i += 1
            continue
        files, kinds = _block_args(m.group("args"))
        j = i + 1
        while j < len(lines) and lines[j].strip() != END:
            if BEGIN.match(lines[j].strip()):
                raise ValueError(f"line {j + 1}: a bench_table block opens inside the one of line {i + 1}")
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: bench_table block without {END}")
        results = [parse(root / f) for f in files]
        for f, res in zip(files, results, strict=True):
            if res.kind == "other":
                raise ValueError(f"line {i + 1}: {f} has no table ({res.reason})")
        out += [lines[i], "", tables(results, kinds), "", lines[j]]
        i = j + 1
    return "\n".join(out)


def marked_docs(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return [p for p in sorted((root / "docs").glob("*.md")) if "<!-- bench_table:" in p.read_text()]


def stale(docs: Iterable[pathlib.Path], root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The documents whose generated blocks differ from what the JSON gives now."""
    return [d for d in docs if regenerate(d.read_text(), root) != d.read_text()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Kinds: " + ", ".join(KINDS),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", help="result files (default: bench/results/*.json); with --write or "
                                            "--check: markdown files (default: docs/*.md with bench_table blocks)")
    p.add_argument("--kind", action="append", choices=KINDS, help="only this kind (repeatable)")
    p.add_argument("--device", help="only cards whose name contains this text, e.g. H100")
    p.add_argument("--commit", help="only results of commits starting with this")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="one line per result file: kind, card, commit, rows")
    mode.add_argument("--write", action="store_true", help="regenerate the bench_table blocks of markdown files")
    mode.add_argument("--check", action="store_true", help="exit 1 when a bench_table block is out of date")
    a = p.parse_args(argv)

    if a.write or a.check:
        docs = [pathlib.Path(x) for x in a.paths] or marked_docs()
        if a.check:
            bad = stale(docs)
            for d in bad:
                print(f"{d}: generated tables out of date; run python scripts/bench_table.py --write {d}")
            return 1 if bad else 0
        for d in docs:
            new = regenerate(d.read_text())
            if new != d.read_text():
                d.write_text(new)
                print(f"wrote {d}")
        return 0

    results = [parse(f) for f in (a.paths or result_files())]
    if a.list:
        for r in results:
            what = r.reason if r.kind == "other" else f"{len(r.rows)} rows"
            print(f"{r.name}\t{r.kind}\t{r.device or '-'}\t{r.commit or '-'}\t{r.date or '-'}\t{what}")
        return 0
    out = tables(results, a.kind, a.device, a.commit)
    if out:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
