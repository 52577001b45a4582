#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kernel experiments: time kernel variants (config.Variant: kind, min_blocks, flush_rows, copy) of the decode
kernel on the main geometry, at k = 1, 2, L/2, L-1 and the flush, in one process (bench_kernels.py's harness).

The first row is the shipped plan; each variant after it is pinned with config.override_variant (fields
not named keep Variant's defaults: one_shot, the kernel's own register budget, the one-pass flush).
Usage: python scripts/sweep_variants.py --variants "kind=staged,min_blocks=6,flush_rows=2;kind=persistent,min_blocks=4"
       [--shadow bf16] [--geometries "64x8;32x4"] (rows x warps, pinned with override_geometry)
       [--all-k] (every buffer position instead of five: a per-k staircase shows up)
"""

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_kernels as bk  # noqa: E402

from trtllm_replayssm.config import override_geometry, override_variant, parse_variant  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="", help='";"-separated, e.g. "kind=staged,min_blocks=6,flush_rows=2"')
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--out", default="")
    ap.add_argument("--shadow", default="none")
    ap.add_argument("--geometries", default="", help="rows x warps per variant, e.g. 64x8;32x4 (default: planned)")
    ap.add_argument("--all-k", action="store_true", help="time every buffer position k = 1..L (default: 1, 2, L/2, L-1, L)")
    args = ap.parse_args()
    # None: the shipped plan (the baseline row)
    variants = [None] + [parse_variant(v, "--variants") for v in args.variants.split(";") if v.strip()]
    geoms = [tuple(int(x) for x in g.split("x")) for g in args.geometries.split(";") if g] or [None]
    L = 16
    rows = []
    if args.out:
        from trtllm_replayssm import timing

        meta = timing.run_meta()
    for v in variants:
        for geom in geoms:
            with override_variant(v), (override_geometry(*geom) if geom else contextlib.nullcontext()):
                for b in (int(x) for x in args.batches.split(",")):
                    ks = None if args.all_k else (1, 2, L // 2, L - 1, L)
                    r = bk.bench_point("nemotron_h_8b", "f32", "bf16", L, b, None, ks=ks, shadow=args.shadow)
                    r["variant"] = "plan" if v is None else dataclasses.asdict(v)
                    r["geometry"] = geom
                    rows.append(r)
                    name = "plan" if v is None else v.key.lstrip("_") or "one_shot"
                    print(f"{name:34s} {str(geom):8s} {args.shadow:4s} bs{b:4d} conv {r['conv_us']:7.1f}  "
                          f"k1 {r['replay_us_k1']:7.1f}  k2 {r['replay_us_k'][1]:7.1f}  k8 {r['replay_us_k'][7]:7.1f}  "
                          f"flush {r['replay_us_flush']:7.1f}  amort {r['replay_us_amortized']:7.1f}  "
                          f"x{r['speedup_vs_conv']:.2f}", flush=True)
                    if args.out:  # after every row: a run cut short by its time limit keeps what it measured
                        tmp = pathlib.Path(args.out + ".tmp")
                        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
                        os.replace(tmp, args.out)  # never a half-written file


if __name__ == "__main__":
    main()
