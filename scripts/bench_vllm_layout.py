#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The vLLM adapter's kernel on vLLM's paged layout vs the contiguous kernel, same run.

Per batch: the conventional kernel (contiguous state), ReplaySSM through ``ops.replay_decode``
(contiguous state, rings, activations) and ReplaySSM through ``vllm.selective_state_update_replayssm``
on ``vllm.PagedLayer`` pages (conv + ssm + rings per block, pages padded by 4 KiB) with row-strided
activations (views of an in-projection and a conv output) and TIE_HDIM parameters, as vLLM calls it.
Amortized over one flush cycle (cursor pinned at each k = 1..L), CUDA-graph replays, blocks rotated so
that no launch finds its state in L2 (bench_kernels.py's method; bytes from trtllm_replayssm.costs). The
question: does the strided layout cost anything (ratio vllm / contiguous), and what is the ratio against
the conventional step.

Usage: python scripts/bench_vllm_layout.py [--batches 1,8,64,256] [--out bench/results] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "serve"))  # the vLLM adapter, trtllm_replayssm_vllm (a checkout not installed)

import trtllm_replayssm_vllm as vllm  # noqa: E402

from scripts import bench_kernels as bk  # noqa: E402
from trtllm_replayssm import costs, timing  # noqa: E402
from trtllm_replayssm.families.mamba2 import ops  # noqa: E402
from trtllm_replayssm.problems import make_inputs  # noqa: E402
from trtllm_replayssm.timing import copy_ceiling_tbps, graph_time_us  # noqa: E402


def point(batch: int, H=128, P=64, N=128, G=8, L=16, act=torch.bfloat16, seed=0) -> dict:
    rot = bk.rotation(H, P, N, G, L, batch, torch.float32, act, seed)
    R, slots, gen, prm = rot.rotations, rot.slots, rot.gen, rot.prm
    state, xc, Bc, dtc, sbis = rot.state, rot.xc, rot.Bc, rot.dtc, rot.sbis
    cursor = torch.zeros(slots, dtype=torch.int32, device="cuda")
    inputs = [make_inputs(batch, H, P, N, G, act, gen, "cuda") for _ in range(min(R, 4))]
    y = torch.empty(batch, H, P, dtype=act, device="cuda")
    # vLLM: block 0 is the null block, live blocks 1..slots
    pages = vllm.PagedLayer(slots + 1, H, P, N, G, L, 4, act, torch.float32, pad_bytes=4096, device="cuda")
    pages.views["ssm"][1:].copy_(state)
    pages.views["x_cache"][1:].copy_(xc)
    pages.views["B_cache"][1:].copy_(Bc)
    pages.views["dt_cache"][1:].copy_(dtc)
    vsbis = [(s + 1).contiguous() for s in sbis]
    HP, GN = H * P, G * N
    vin = []
    for x, B, C, dt, _ in inputs:
        proj = torch.empty(batch, 2 * HP + 2 * GN + H, dtype=act, device="cuda")
        xbc = torch.empty(batch, HP + 2 * GN, dtype=act, device="cuda")
        xbc[:, :HP] = x.reshape(batch, HP)
        xbc[:, HP:HP + GN] = B.reshape(batch, GN)
        xbc[:, HP + GN:] = C.reshape(batch, GN)
        proj[:, -H:] = dt
        vin.append((xbc[:, :HP].view(batch, H, P), xbc[:, HP:HP + GN].view(batch, G, N),
                    xbc[:, HP + GN:].view(batch, G, N), proj[:, -H:][:, :, None].expand(batch, H, P)))
    A_t = prm.A[:, None, None].expand(H, P, N)
    D_t, b_t = prm.D[:, None].expand(H, P), prm.dt_bias[:, None].expand(H, P)
    wp = torch.zeros(batch, dtype=torch.int32, device="cuda")
    yv = torch.empty(batch, H, P, dtype=act, device="cuda")

    def conv():
        for r in range(R):
            x, B, C, dt, _ = inputs[r % len(inputs)]
            ops.conventional_step(x, B, C, dt, prm.dt_bias, prm.A, prm.D, state, sbis[r], out=y)

    def dense():
        for r in range(R):
            x, B, C, dt, _ = inputs[r % len(inputs)]
            ops.replay_decode(x, B, C, dt, prm.dt_bias, prm.A, prm.D, state, xc, Bc, dtc, cursor, sbis[r], out=y)

    def paged():
        for r in range(R):
            x, B, C, dt = vin[r % len(vin)]
            vllm.selective_state_update_replayssm(
                pages.views["ssm"], x, dt, A_t, B, C, D=D_t, dt_bias=b_t, x_cache=pages.views["x_cache"],
                dt_cache=pages.views["dt_cache"], B_cache=pages.views["B_cache"], write_pos=wp, max_cache_len=L,
                state_batch_indices=vsbis[r], out=yv)

    # attribution: the adapter on the contiguous tensors (the variant's own cost: per-row cursor, null
    # slot, strides equal to the dense ones), and on the pages with contiguous activations
    def adapter_dense():
        for r in range(R):
            x, B, C, dt, _ = inputs[r % len(inputs)]
            vllm.selective_state_update_replayssm(
                state, x, dt, prm.A, B, C, D=prm.D, dt_bias=prm.dt_bias, x_cache=xc, dt_cache=dtc, B_cache=Bc,
                write_pos=wp, max_cache_len=L, state_batch_indices=sbis[r], null_block_id=-1, out=yv)

    def paged_dense_act():
        for r in range(R):
            x, B, C, dt, _ = inputs[r % len(inputs)]
            vllm.selective_state_update_replayssm(
                pages.views["ssm"], x, dt, prm.A, B, C, D=prm.D, dt_bias=prm.dt_bias,
                x_cache=pages.views["x_cache"], dt_cache=pages.views["dt_cache"], B_cache=pages.views["B_cache"],
                write_pos=wp, max_cache_len=L, state_batch_indices=vsbis[r], out=yv)

    row = dict(batch=batch, H=H, P=P, N=N, G=G, L=L, act=str(act).replace("torch.", ""), state="float32",
               rotations=R, page_bytes=pages.page)
    row["conv_us"] = graph_time_us(conv, R)[0]
    fns = {"dense": dense, "vllm": paged, "adapter_contiguous": adapter_dense, "vllm_contiguous_act": paged_dense_act}
    per_k = {name: [] for name in fns}
    for k in range(1, L + 1):
        cursor.fill_(k - 1)
        wp.fill_(k - 1)
        for name, fn in fns.items():
            per_k[name].append(graph_time_us(fn, R)[0])
    for name, ts in per_k.items():
        row[f"{name}_us_k"] = ts
        row[f"{name}_us_amortized"] = sum(ts) / L
        row[f"{name}_speedup_vs_conv"] = row["conv_us"] / row[f"{name}_us_amortized"]
    for name in fns:
        row[f"{name}_over_dense"] = row[f"{name}_us_amortized"] / row["dense_us_amortized"]
    conv_b, rep_b = costs.mamba2_bytes_per_position(H, P, N, G, L, 4, act.itemsize)
    row["tbps_conv"] = conv_b * batch / row["conv_us"] / 1e6
    row["tbps_vllm"] = sum(rep_b.values()) / L * batch / row["vllm_us_amortized"] / 1e6
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None, help="default: $GIT_COMMIT, else git HEAD")
    args = ap.parse_args()
    ceiling = copy_ceiling_tbps()
    rows = []
    for b in map(int, args.batches.split(",")):
        r = point(b)
        torch.cuda.empty_cache()
        rows.append(r)
        print(f"bs{b:4d}: conv {r['conv_us']:8.1f} us  replay contiguous {r['dense_us_amortized']:8.1f} "
              f"({r['dense_speedup_vs_conv']:.2f}x)  vLLM layout {r['vllm_us_amortized']:8.1f} "
              f"({r['vllm_speedup_vs_conv']:.2f}x)  vllm/contiguous {r['vllm_over_dense']:.3f}  (adapter on contiguous "
              f"{r['adapter_contiguous_over_dense']:.3f}, pages + contiguous activations "
              f"{r['vllm_contiguous_act_over_dense']:.3f})", flush=True)
    meta = timing.run_meta(commit=args.commit)
    out = pathlib.Path(args.out) / f"{meta['date'][:10]}_vllm-layout_{meta['commit'][:10]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(**meta, copy_ceiling_tbps=ceiling, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
