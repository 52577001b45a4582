#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kernel experiments: time compile-time variants (RSSM_* definitions) of the decode kernel on the
main geometry, at k = 1, 2, L/2, L-1 and the flush, in one process (bench_kernels.py's harness).

Each variant is the shipped definitions (config.DEFAULT_DEFINES) plus its own; the first row is the
shipped kernel. Usage: python scripts/sweep_variants.py --variants "STAGED=1;STAGED=1,MIN_BLOCKS=6,FLUSH_ROWS=2"
       [--shadow bf16] [--geometries "64x8;32x4"] (rows x warps, pinned with override_geometry)
       [--all-k] (every buffer position instead of five: a per-k staircase shows up)
"""

import argparse
import contextlib
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_kernels as bk  # noqa: E402

from trtllm_replayssm.config import DEFAULT_DEFINES, override_defines, override_geometry  # noqa: E402


def parse(v: str) -> tuple:
    """A variant's definitions on top of the shipped ones (DEFAULT_DEFINES): ``PERSISTENT=0`` turns one off.

    (Passing only the variant's own definitions would also drop the shipped PERSISTENT/MIN_BLOCKS, so
    the "baseline" of such a sweep would be a kernel nobody ships.)"""
    own = dict((k, int(x)) for k, x in (p.split("=") for p in v.split(",") if p))
    return tuple({**dict(DEFAULT_DEFINES), **own}.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--out", default="")
    ap.add_argument("--shadow", default="none")
    ap.add_argument("--geometries", default="", help="rows x warps per variant, e.g. 64x8;32x4 (default: planned)")
    ap.add_argument("--all-k", action="store_true", help="time every buffer position k = 1..L (default: 1, 2, L/2, L-1, L)")
    args = ap.parse_args()
    variants = [DEFAULT_DEFINES] + [parse(v) for v in args.variants.split(";") if v]
    geoms = [tuple(int(x) for x in g.split("x")) for g in args.geometries.split(";") if g] or [None]
    L = 16
    rows = []
    for d in variants:
        for geom in geoms:
            with override_defines(d), (override_geometry(*geom) if geom else contextlib.nullcontext()):
                for b in (int(x) for x in args.batches.split(",")):
                    ks = None if args.all_k else (1, 2, L // 2, L - 1, L)
                    r = bk.bench_point("nemotron_h_8b", "f32", "bf16", L, b, None, ks=ks, shadow=args.shadow)
                    r["defines"], r["geometry"] = d, geom
                    rows.append(r)
                    print(f"{str(d):34s} {str(geom):8s} {args.shadow:4s} bs{b:4d} conv {r['conv_us']:7.1f}  "
                          f"k1 {r['replay_us_k1']:7.1f}  k2 {r['replay_us_k'][1]:7.1f}  k8 {r['replay_us_k'][7]:7.1f}  "
                          f"flush {r['replay_us_flush']:7.1f}  amort {r['replay_us_amortized']:7.1f}  "
                          f"x{r['speedup_vs_conv']:.2f}", flush=True)
    if args.out:
        import datetime

        import torch

        meta = dict(device=torch.cuda.get_device_name(), commit=os.environ.get("GIT_COMMIT", "unknown"),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
