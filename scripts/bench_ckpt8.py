#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""8-bit checkpoint (issue 38): kernel time vs the fp32 checkpoint (and the fp32 + fp8 shadow), capacity, drift.

One process, one card: at each batch the fp32 checkpoint (with the conventional fp32 step as the baseline), the
fp32 checkpoint with an fp8 shadow and the 8-bit checkpoint are timed with scripts/bench_kernels.bench_point
(CUDA-graph replays, rotating slot sets, every buffer position k measured or interpolated, the flush always
measured; amortized = mean over one flush cycle). Bytes model: costs.mamba2_bytes_per_position (an 8-bit
checkpoint reads H P (N + 4) bytes per row and layer every step, and the flush reads and writes them). The result
file also carries the capacity table (scripts/memory_table.checkpoint_rows) and the drift summary
(bench/results/precision_drift*.json, computed on the CPU by scripts/precision_drift.py).

Usage: python scripts/bench_ckpt8.py [--geom nemotron_h_8b] [--batches 1 8 32 64 256] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtllm_replayssm import timing  # noqa: E402


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


MODES = (("fp32", "f32", "none"), ("fp8_shadow", "f32", "fp8"), ("fp8_ckpt", "fp8", "none"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geom", default="nemotron_h_8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 4, 8, 12, 15, 16], help="buffer positions measured")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    bk, mt = _load("bench_kernels"), _load("memory_table")
    meta = timing.run_meta(commit=args.commit)
    ceiling = timing.copy_ceiling_tbps()
    rows = []
    for batch in args.batches:
        pts = {name: bk.bench_point(args.geom, st, "bf16", args.L, batch, None, ks=args.ks, shadow=sh)
               for name, st, sh in MODES}
        base = pts["fp32"]
        for name, p in pts.items():
            r = {k: p[k] for k in ("geom", "batch", "L", "rotations", "replay_us_k", "replay_us_k1", "replay_us_flush",
                                   "replay_us_amortized", "replay_us_mixed", "tbps_replay", "tbps_replay_k1",
                                   "tbps_replay_flush", "bytes_replay_amortized")}
            r.update(mode=name, conv_fp32_us=base["conv_us"],
                     pct_ceiling=round(100 * p["tbps_replay"] / ceiling, 1),
                     speedup_vs_fp32_ckpt=base["replay_us_amortized"] / p["replay_us_amortized"],
                     speedup_vs_fp32_ckpt_mixed=base["replay_us_mixed"] / p["replay_us_mixed"],
                     speedup_vs_conv_fp32=base["conv_us"] / p["replay_us_amortized"],
                     flush_vs_fp32_flush=p["replay_us_flush"] / base["replay_us_flush"])
            rows.append(r)
            print("RESULT_JSON " + json.dumps(r), flush=True)
    print(f"\n{meta['device']}  copy ceiling {ceiling:.2f} TB/s  geometry {args.geom}  L={args.L}")
    print(f"{'bs':>4} {'mode':>11} {'k1 us':>8} {'flush us':>9} {'amort us':>9} {'TB/s':>6} {'%ceil':>6} "
          f"{'x fp32ck':>9} {'x conv':>7}")
    for r in rows:
        print(f"{r['batch']:>4} {r['mode']:>11} {r['replay_us_k1']:8.1f} {r['replay_us_flush']:9.1f} "
              f"{r['replay_us_amortized']:9.1f} {r['tbps_replay']:6.2f} {r['pct_ceiling']:6.1f} "
              f"{r['speedup_vs_fp32_ckpt']:9.2f} {r['speedup_vs_conv_fp32']:7.2f}")
    drift = {}
    for name in ("precision_drift", "precision_drift_slow"):
        f = ROOT / "bench" / "results" / f"{name}.json"
        if f.is_file():
            d = json.loads(f.read_text())
            drift[name] = {"a_range": d.get("a_range", [1.0, 16.0]), "summary": d["summary"],
                           "granularity": d.get("granularity")}
    out = dict(meta, what="8-bit checkpoint: kernel time vs fp32 checkpoint, capacity, drift (issue 38)",
               copy_ceiling_tbps=ceiling, geometry=args.geom, kernel_times=rows,
               capacity=mt.checkpoint_rows(args.L), drift=drift)
    path = pathlib.Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    dest = path / f"{date}_fp8-ckpt_{meta['commit']}.json"
    dest.write_text(json.dumps(out, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
