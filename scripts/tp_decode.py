#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel ReplaySSM decode of one Mamba-2 mixer step, one process per rank.

Each rank owns its heads' shard (trtllm_replayssm.tp), runs the SSM step on it (CUDA kernels on
GPUs with NCCL, the float64 reference on CPUs with gloo), multiplies its output by its column
slice of out_proj and all-reduces the partial products. Rank 0 checks every step against a TP=1
run over >= 3L steps crossing flushes and prints the worst relative error.

GPUs (nvidia-h200-x2): torchrun --nproc_per_node 2 scripts/tp_decode.py --device cuda
CPUs (any machine):    torchrun --nproc_per_node 2 scripts/tp_decode.py --device cpu
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set before NCCL starts).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtllm_replayssm import cursor as cursors  # noqa: E402
from trtllm_replayssm import tp  # noqa: E402
from trtllm_replayssm.families.mamba2 import reference as ref  # noqa: E402


def run(nheads=256, headdim=64, dstate=128, ngroups=8, buffer_len=4, batch=2, hidden=64, device="cpu",
        seed=0) -> float:
    """Worst relative error of the all-reduced output against TP=1 (meaningful on rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    H, P, N, G, L = nheads, headdim, dstate, ngroups, buffer_len
    gpu = device == "cuda"
    dev = torch.device(f"cuda:{rank}") if gpu else torch.device("cpu")
    dtype = torch.float32 if gpu else torch.float64
    gen = torch.Generator().manual_seed(seed)  # every rank draws the same full problem
    A = -(torch.rand(H, generator=gen, dtype=torch.float64) * 15 + 1)
    D = torch.randn(H, generator=gen, dtype=torch.float64) * 0.5 + 1
    dt_bias = torch.randn(H, generator=gen, dtype=torch.float64) * 0.5 - 3
    W = torch.randn(hidden, H * P, generator=gen, dtype=torch.float64) / (H * P) ** 0.5
    S0 = torch.randn(batch, H, P, N, generator=gen, dtype=torch.float64) * 0.1
    full = [S0.clone(), torch.zeros(batch, H, L, P, dtype=torch.float64), torch.zeros(batch, G, L, N, dtype=torch.float64),
            torch.zeros(batch, H, L, dtype=torch.float64)]
    full_cursor = torch.zeros(batch, dtype=torch.int32)
    shard = tp.shard_plan(H, G, world)[rank]
    local = [t.to(dev, dtype) for t in tp.shard_cache(shard, *full)]
    cursor = torch.zeros(batch, dtype=torch.int32, device=dev)
    sbi = torch.arange(batch, dtype=torch.int32)
    bias, a, d = (t.to(dev, torch.float32 if gpu else dtype) for t in tp.shard_params(shard, dt_bias, A, D))
    w_local = W[:, shard.head0 * P:(shard.head0 + shard.nheads) * P].to(dev, dtype)
    if gpu:
        from trtllm_replayssm import cursor_ops
        from trtllm_replayssm.families.mamba2 import ops
    worst = 0.0
    for _ in range(3 * L + 2):
        x = torch.randn(batch, H, P, generator=gen, dtype=torch.float64)
        B = torch.randn(batch, G, N, generator=gen, dtype=torch.float64) * 4 / N**0.5
        C = torch.randn(batch, G, N, generator=gen, dtype=torch.float64) * 4 / N**0.5
        dt = torch.randn(batch, H, generator=gen, dtype=torch.float64)
        y_full = ref.replay_decode(*full, full_cursor, x, B, C, dt, dt_bias, A, D, None, sbi)
        cursors.advance_cursor(full_cursor, sbi, L)
        xs, Bs, Cs, dts, _ = (None if t is None else t.to(dev, dtype) for t in tp.shard_step(shard, x, B, C, dt))
        if gpu:
            y = ops.replay_decode(xs, Bs, Cs, dts, bias, a, d, *local, cursor, sbi.to(dev))
            cursor_ops.advance_cursor(cursor, sbi.to(dev), L)
        else:
            y = ref.replay_decode(*local, cursor, xs, Bs, Cs, dts, bias, a, d, None, sbi)
            cursors.advance_cursor(cursor, sbi, L)
        out = y.flatten(1) @ w_local.T
        dist.all_reduce(out)
        expect = (y_full.flatten(1) @ W.T).to(out)
        worst = max(worst, float((out - expect).norm() / expect.norm()))
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--geometry", default="256,64,128,8", help="nheads,headdim,dstate,ngroups")
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    H, P, N, G = (int(v) for v in args.geometry.split(","))
    worst = run(H, P, N, G, device=args.device)
    if dist.get_rank() == 0:
        tol = 1e-5 if args.device == "cuda" else 1e-12  # fp32 kernels vs float64; float64 both sides
        print(f"TP={dist.get_world_size()} vs TP=1, geometry {args.geometry}: worst relative error {worst:.3e} "
              f"({'PASS' if worst < tol else 'FAIL'}, tolerance {tol:g})")
    dist.barrier()  # no rank tears gloo down while a peer still talks (SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
