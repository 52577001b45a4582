# SPDX-License-Identifier: Apache-2.0
"""Launch one GDN ReplaySSM decode point for a profiler (Nsight Compute): Qwen3-Next geometry, bf16
activations, fp32 checkpoint, optional bf16 shadow, every row at buffer position k (cursor = k - 1).

    ncu --clock-control none --kernel-name gdn_replay_decode --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python scripts/profile_gdn.py --batch 256 --k 1 --shadow bf16

It launches ``--reps`` identical steps (the cursor is not advanced, so each is the same k) after one
warm-up that compiles the module, and prints the mean time per step from CUDA events and the bytes the
model (trtllm_replayssm.costs.gdn_bytes_per_position, as bench_gdn.py) charges that step, so a profile can
be read against both.
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from trtllm_replayssm import costs  # noqa: E402
from trtllm_replayssm.families.gdn import ops as gdn_ops  # noqa: E402
from trtllm_replayssm.geometries import GDN_GEOMETRIES  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--k", type=int, default=1, help="buffer position 1..L (L: the flush step)")
    ap.add_argument("--shadow", choices=("none", "bf16"), default="none")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--replay-shape", default="",
                    help="LANES:RT:WARPS[:RESIDENT]: pin the replay module's launch shape (bench_gdn.py --replay-shape)")
    args = ap.parse_args()
    if args.replay_shape:
        from bench_gdn import parse_replay_shape, pin_replay

        try:
            pin_replay(**parse_replay_shape(args.replay_shape))
        except ValueError as e:
            ap.error(str(e))
    if not 1 <= args.k <= args.L:
        ap.error(f"--k: expected 1..{args.L}, got {args.k}")
    HV, H, V, K = GDN_GEOMETRIES["qwen3_next_80b"]
    b, L, act = args.batch, args.L, torch.bfloat16
    dev = dict(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = torch.randn(b, HV, V, K, generator=gen, **dev) * 0.05
    shadow = state.to(torch.bfloat16) if args.shadow == "bf16" else None
    u = torch.randn(b, HV, L, V, generator=gen, **dev) * 0.1
    v_c = torch.randn(b, HV, L, V, generator=gen, **dev).to(act)
    k_c = torch.nn.functional.normalize(torch.randn(b, H, L, K, generator=gen, **dev), dim=-1)
    g_c = -torch.rand(b, HV, L, generator=gen, **dev) * 0.5
    beta_c = torch.rand(b, HV, L, generator=gen, **dev)
    cursor = torch.full((b,), args.k - 1, dtype=torch.int32, **dev)
    A_log = torch.log(torch.rand(HV, generator=gen, **dev) * 15 + 1)
    dt_bias = torch.rand(HV, generator=gen, **dev) * 0.1 - 3.0
    sbi = torch.randperm(b, generator=gen, **dev).to(torch.int32)
    q, k = (torch.randn(b, H, K, generator=gen, **dev).to(act) for _ in range(2))
    v = torch.randn(b, HV, V, generator=gen, **dev).to(act)
    a, bb = (torch.randn(b, HV, generator=gen, **dev).to(act) for _ in range(2))
    y = torch.empty(b, HV, V, dtype=act, **dev)

    def step():
        gdn_ops.gdn_replay_decode(q, k, v, a, bb, A_log, dt_bias, state, u, v_c, k_c, g_c, beta_c, cursor, sbi, out=y,
                                  shadow=shadow, check_values=False)

    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.reps):
        step()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / args.reps
    _, per_k = costs.gdn_bytes_per_position(HV, H, V, K, L, 2, 4, 2 if shadow is not None else None)
    nbytes = per_k[args.k] * b
    print(f"batch {b} k {args.k} shadow {args.shadow}: {us:.1f} us per step (events, {args.reps} reps, includes the "
          f"profiler's replay when run under ncu), bytes model {nbytes / 1e6:.1f} MB = {nbytes / us / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
