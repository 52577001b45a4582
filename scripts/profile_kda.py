#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Launch one KDA decode point for a profiler (Nsight Compute): a published per-GPU geometry (families/kda
GEOMETRIES), bf16 activations, fp32 checkpoint, optional bf16 shadow; ``--k 0`` the conventional step, ``--k``
1..L the ReplaySSM step with every row at buffer position k (cursor = k - 1; L: the flush).

    ncu --clock-control none --kernel-name regex:kda_ --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python scripts/profile_kda.py --geom kimi_k3_tp8 --batch 256 --k 0 --shape 4:8

It launches ``--reps`` identical steps (the cursor is not advanced) after one warm-up that compiles the module, over
``--rotations`` disjoint sets of slots (so the state comes from DRAM, as bench_kda.py times it), and prints the mean
time per step from CUDA events and the bytes the model (costs.kda_bytes_per_position, as bench_kda.py) charges it.
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_kda import LOWER_BOUND  # noqa: E402

from trtllm_replayssm import costs  # noqa: E402
from trtllm_replayssm.families.kda import GEOMETRIES  # noqa: E402
from trtllm_replayssm.families.kda import ops as kops  # noqa: E402
from trtllm_replayssm.families.kda.config import kda_geometry, override  # noqa: E402
from trtllm_replayssm.families.kda.layers import ring_dtype  # noqa: E402


def parse_shape(text: str) -> dict:
    """``col_lanes:warps[:resident]`` -> override()'s keywords ({} for "")."""
    if not text:
        return {}
    try:
        parts = [int(t) for t in text.split(":")]
        if len(parts) not in (2, 3):
            raise ValueError
    except ValueError:
        raise ValueError(f"--shape: expected col_lanes:warps[:resident], got {text!r}") from None
    return dict(zip(("col_lanes", "warps", "resident"), parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geom", default="kimi_k3_tp8", choices=sorted(GEOMETRIES))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--k", type=int, default=0, help="0: the conventional step; 1..L: the ReplaySSM step at position k")
    ap.add_argument("--shadow", choices=("none", "bf16"), default="none")
    ap.add_argument("--shape", default="", help="col_lanes:warps[:resident]: pin the launch shape (config.override)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rotations", type=int, default=3)
    args = ap.parse_args()
    try:
        pin = parse_shape(args.shape)
    except ValueError as e:
        ap.error(str(e))
    if not 0 <= args.k <= args.L:
        ap.error(f"--k: expected 0..{args.L}, got {args.k}")
    if args.batch < 1 or args.reps < 1 or args.rotations < 1:
        ap.error("--batch, --reps and --rotations: expected >= 1")
    if not torch.cuda.is_available():
        sys.exit("profile_kda.py needs a CUDA GPU")
    H, K, V = GEOMETRIES[args.geom]
    lb = LOWER_BOUND.get(args.geom)
    b, L, R, act = args.batch, args.L, args.rotations, torch.bfloat16
    dev = dict(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = b * R
    state = torch.randn(slots, H, K, V, generator=gen, **dev) * 0.05
    shadow = state.to(torch.bfloat16) if args.shadow == "bf16" else None
    k_c = torch.randn(slots, H, L, K, generator=gen, **dev).to(act)
    u_c = (torch.randn(slots, H, L, V, generator=gen, **dev) * 0.1).to(ring_dtype(torch.float32, None if shadow is None
                                                                                  else shadow.dtype))
    g_c = -torch.rand(slots, H, L, K, generator=gen, **dev) * 0.3
    v_c = torch.randn(slots, H, L, V, generator=gen, **dev).to(act)
    beta_c = torch.rand(slots, H, L, generator=gen, **dev)
    cursor = torch.full((slots,), max(args.k - 1, 0), dtype=torch.int32, **dev)
    A_log = torch.log(torch.rand(H, generator=gen, **dev) * 15 + 1)
    dt_bias = torch.rand(H, K, generator=gen, **dev) * 0.1 - 3.0
    perm = torch.randperm(slots, generator=gen, **dev).to(torch.int32)
    sbis = [perm[r * b:(r + 1) * b].contiguous() for r in range(R)]
    q, k, f = (torch.randn(b, H, K, generator=gen, **dev).to(act) for _ in range(3))
    v, bb = torch.randn(b, H, V, generator=gen, **dev).to(act), torch.randn(b, H, generator=gen, **dev).to(act)
    y = torch.empty(b, H, V, dtype=act, **dev)

    def step(r):
        if args.k == 0:
            kops.kda_conventional_step(q, k, v, f, bb, A_log, dt_bias, state, sbis[r], out=y, lower_bound=lb,
                                       check_values=False)
        else:
            kops.kda_replay_decode(q, k, v, f, bb, A_log, dt_bias, state, k_c, u_c, g_c, v_c, beta_c, cursor, sbis[r],
                                   out=y, shadow=shadow, lower_bound=lb, check_values=False)

    with override(**pin):
        shape = kda_geometry(H, K, V, b, conventional=args.k == 0)
        step(0)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(args.reps):
            step((i + 1) % R)
        end.record()
        torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / args.reps
    conv_b, per_k = costs.kda_bytes_per_position(H, K, V, L, shadow=args.shadow if shadow is not None else None)
    nbytes = (conv_b if args.k == 0 else per_k[args.k]) * b
    what = "conventional" if args.k == 0 else f"replay k {args.k} shadow {args.shadow}"
    print(f"{args.geom} batch {b} {what} shape (col_lanes, warps) {shape}: {us:.1f} us per step (events, {args.reps} "
          f"reps, includes the profiler's replay when run under ncu), bytes model {nbytes / 1e6:.1f} MB = "
          f"{nbytes / us / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
