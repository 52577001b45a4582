#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Per-kernel time of one captured model step (builders/model_step.py), by the torch profiler.

For each batch size and T (1: standard decode, > 1: speculative verify), the step with the given SSM
mode (default ``noop``: the step without the SSM, the part issue 11 is about) is warmed up, captured
in a CUDA graph, timed by CUDA events over ``--reps`` replays (ms/step), then ``--prof-reps`` replays
run under ``torch.profiler`` (CUPTI records the kernels of a graph replay with their names). Kernels
are summed per step and grouped by name:

  gemm       cuBLAS / cuBLASLt / CUTLASS matrix products (nvjet, sm90_xmma, cutlass, gemm, gemv)
  attention  scaled_dot_product_attention kernels (fmha, flash, efficient_attention)
  fused      inductor's generated Triton kernels (triton_)
  ssm        our kernels (replayssm) and mamba_ssm's
  other      everything else (copies, scatter, index, reductions, argmax)

``kernel_sum_ms`` vs ``ms_step``: the gap is what the GPU spends between kernels inside the graph.

Usage (GPU): python scripts/profile_decode.py [--batches 1,256] [--tokens 1,4] [--mode noop] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.model_step import DecodeStep, NoOp, Replay, SpecStep  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402
from trtllm_replayssm import timing  # noqa: E402

CATEGORIES = (
    ("ssm", ("replayssm", "selective", "_state_update")),
    ("attention", ("fmha", "flash", "efficient_attention", "attention")),  # incl. decode_attention_kernel
    ("gemm", ("nvjet", "xmma", "cutlass", "gemm", "gemv", "cublas")),
    ("fused", ("triton_",)),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def make_step(model, batch, T, kv_len, mode, L):
    ssm = NoOp() if mode == "noop" else Replay(L)
    if T == 1:
        return DecodeStep(model, batch, kv_len, ssm)
    table = 64 * T + T + 1
    step = SpecStep(model, batch, kv_len, T, table, ssm, live=False)
    ref = torch.randint(2, model.config.vocab_size, (batch, table), generator=torch.Generator().manual_seed(0))
    step.set_tables(ref.cuda(), ref.cuda())  # every draft accepted: the path is fixed
    return step


def profile_point(model, batch, T, kv_len, mode, L, reps, prof_reps, fill=0) -> dict:
    step = make_step(model, batch, T, kv_len, mode, L)
    step.lengths.fill_(fill)  # positions already in the KV caches (attention reads those)
    run, graph = timing.capture(step, lambda: None, True)  # the state runs on from the warm-up: no restore
    times = timing.time_samples(run, None, L, 1, reps, True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        k = kernels.setdefault(ev.name, [0.0, 0])
        k[0] += ev.device_time / 1e3 / prof_reps  # ms per step
        k[1] += 1
    cats = {c: 0.0 for c, _ in CATEGORIES}
    cats["other"] = 0.0
    for name, (ms, _) in kernels.items():
        cats[category(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    step.free()
    del graph
    return dict(batch=batch, T=T, mode=mode, kv_len=kv_len, fill=fill, ms_step=statistics.median(times),
                kernel_sum_ms=sum(v[0] for v in kernels.values()),
                kernels_per_step=sum(v[1] for v in kernels.values()) / prof_reps,
                categories_ms=cats,
                top=[dict(name=n[:120], ms=v[0], calls_per_step=v[1] / prof_reps, category=category(n))
                     for n, v in top])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--tokens", default="1,4", help="T per step: 1 = standard decode, > 1 = speculative verify")
    ap.add_argument("--mode", default="noop", choices=("noop", "replay"))
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024, help="KV positions allocated (as bench_e2e.py standard)")
    ap.add_argument("--fill", type=int, default=256,
                    help="KV positions filled before the first replay (attention reads those; the standard e2e step's "
                         "timed steps sit at ~prompt + gate + warmup cycles, 32 + 32 + 2*16 ... 256)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prof-reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="default: $GIT_COMMIT, else git HEAD")
    args = ap.parse_args(argv)
    model = build_model(model_config(layers=args.layers), "cuda", torch.bfloat16, seed=0)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            r = profile_point(model, b, T, args.context, args.mode, args.buffer_len, args.reps, args.prof_reps,
                              args.fill)
            rows.append(r)
            c = r["categories_ms"]
            print(f"T={T} bs={b:4d} {args.mode}: {r['ms_step']:.3f} ms/step, kernels {r['kernel_sum_ms']:.3f} ms "
                  f"({r['kernels_per_step']:.0f}/step): " + ", ".join(f"{k} {v:.3f}" for k, v in c.items()), flush=True)
            torch.cuda.empty_cache()
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(**timing.run_meta(commit=args.commit), context=args.context, fill=args.fill, layers=args.layers)
        path = out / f"{meta['date'][:10]}_profile-{args.mode}_{meta['commit'][:10]}.json"
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
