#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kernel experiments: time compile-time variants (RSSM_* definitions) of the decode kernel on the
main geometry, at k = 1, 2, L/2, L-1 and the flush, in one process (bench_kernels.py's harness).

Usage: python scripts/sweep_variants.py --variants "CURSOR_FIRST=1;PREFETCH_ALL=1,CURSOR_FIRST=1"
"""

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_kernels as bk  # noqa: E402

from trtllm_replayssm.config import override_defines  # noqa: E402


def parse(v: str) -> tuple:
    return tuple((k, int(x)) for k, x in (p.split("=") for p in v.split(",") if p))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    variants = [()] + [parse(v) for v in args.variants.split(";") if v]
    L = 16
    rows = []
    for d in variants:
        with override_defines(d):
            for b in (int(x) for x in args.batches.split(",")):
                r = bk.bench_point("nemotron_h_8b", "f32", "bf16", L, b, None, ks=(1, 2, L // 2, L - 1, L))
                r["defines"] = d
                rows.append(r)
                print(f"{str(d):40s} bs{b:4d} conv {r['conv_us']:7.1f}  k1 {r['replay_us_k1']:7.1f}  "
                      f"k2 {r['replay_us_k'][1]:7.1f}  k8 {r['replay_us_k'][7]:7.1f}  flush {r['replay_us_flush']:7.1f}  "
                      f"amort {r['replay_us_amortized']:7.1f}  x{r['speedup_vs_conv']:.2f}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
