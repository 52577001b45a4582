#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A few eager launches of one decode kernel configuration, for a profiler (ncu) to look at.

Usage (on the GPU machine):
  ncu --clock-control none --kernel-name regex:replayssm --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats python3 scripts/profile_step.py --shadow bf16 --k 1
"""

import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtllm_replayssm import config  # noqa: E402
from trtllm_replayssm.families.mamba2 import ops  # noqa: E402
from trtllm_replayssm.geometries import GEOMETRIES  # noqa: E402
from trtllm_replayssm.problems import make_inputs, make_params  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geom", default="nemotron_h_8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--k", type=int, default=1, help="buffer position of the step (L = flush)")
    ap.add_argument("--shadow", default="none", choices=("none", "bf16", "fp8"))
    ap.add_argument("--conventional", action="store_true")
    ap.add_argument("--variant", default="", help='e.g. "kind=persistent,min_blocks=5" (default: the shipped plan)')
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    H, P, N, G = GEOMETRIES[args.geom]
    b, L = args.batch, args.L
    gen = torch.Generator().manual_seed(0)
    prm = make_params(H, gen, "cuda")
    state = torch.randn(b, H, P, N, device="cuda") * 0.1
    xc = torch.randn(b, H, L, P, device="cuda").bfloat16()
    Bc = (torch.randn(b, G, L, N, device="cuda") * 0.3).bfloat16()
    dtc = torch.rand(b, H, L, device="cuda") * 0.05
    cursor = torch.full((b,), args.k - 1, dtype=torch.int32, device="cuda")
    sbi = torch.randperm(b, generator=gen).to(torch.int32).cuda()
    x, B, C, dt, _ = make_inputs(b, H, P, N, G, torch.bfloat16, gen, "cuda")
    sh = sc = None
    if args.shadow != "none":
        sh = state.to(config.SHADOW_DTYPES[args.shadow])
        sc = torch.ones(b, H, P, device="cuda") if args.shadow == "fp8" else None
    variant = config.parse_variant(args.variant, "--variant") if args.variant else config.current_variant()
    with config.override_variant(variant):
        for _ in range(args.launches):
            if args.conventional:
                ops.conventional_step(x, B, C, dt, prm.dt_bias, prm.A, prm.D, state, sbi)
            else:
                ops.replay_decode(x, B, C, dt, prm.dt_bias, prm.A, prm.D, state, xc, Bc, dtc, cursor, sbi,
                                  shadow=sh, shadow_scale=sc, check_values=False)
    torch.cuda.synchronize()
    print(f"# {args.launches} launches done: {args}")


if __name__ == "__main__":
    main()
