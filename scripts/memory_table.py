#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Decode-state memory per request under speculative decoding: ReplaySSM spec vs native spec.

ReplaySSM keeps one fp32 checkpoint + a ring of L entries (x, B in the activation dtype, processed dt
in fp32) + a conv window of K - 1 + num_draft inputs per Mamba layer; native spec keeps 1 + num_draft
state snapshots and conv states (vLLM / TensorRT-LLM). Bytes model: trtllm_replayssm.costs.memory_per_request.
The "x requests" column is native / replay: how many more requests fit in the same Mamba-state memory.
Attention KV cache and weights are not counted.

Mamba layer counts: Nemotron-H-8B has 24 (hybrid pattern in NVIDIA's Megatron-Bridge docs); the
Nemotron 3 counts come from their config.json patterns (trtllm_replayssm.geometries.MODELS: Nano
30B-A3B 23, Super 120B-A12B 40); the counts for Nano-9B-v2 (27) and H-56B (54) are assumptions,
override with --layers NAME=COUNT.

Usage: python scripts/memory_table.py [--buffer-len 16] [--drafts 1 3 5 7] [--shadow-bytes 2] [--json]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trtllm_replayssm.costs import memory_per_request  # noqa: E402
from trtllm_replayssm.geometries import GEOMETRIES, MODELS  # noqa: E402

# Mamba layers per model (the rows of the table; geometries from trtllm_replayssm.geometries)
MAMBA_LAYERS = {"nemotron_h_8b": 24, "nano_9b_v2": 27, "h_56b": 54,
                **{name: m.mamba_layers for name, m in MODELS.items()}}
MIB = 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 3, 5, 7])
    ap.add_argument("--shadow-bytes", type=int, default=0, help="2 for a bf16 shadow, 1 for fp8")
    ap.add_argument("--act-bytes", type=int, default=2)
    ap.add_argument("--layers", nargs="*", default=[], help="NAME=COUNT overrides of the Mamba layer counts")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per row")
    args = ap.parse_args()
    layers = dict(MAMBA_LAYERS)
    for kv in args.layers:
        name, _, n = kv.partition("=")
        if name not in layers or not n.isdigit():
            raise SystemExit(f"--layers: expected NAME=COUNT with NAME in {sorted(layers)}, got {kv!r}")
        layers[name] = int(n)
    print(f"L = {args.buffer_len}, fp32 state, {args.act_bytes}-byte activations, conv width 4, "
          f"shadow {args.shadow_bytes or 'none'}; MiB per request over all Mamba layers\n")
    print("| geometry (H,P,N,G) | Mamba layers | num_draft | T | ReplaySSM MiB | native MiB | x requests |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in layers:
        H, P, N, G = GEOMETRIES[name]
        for d in args.drafts:
            if args.buffer_len < 2 * (d + 1):
                print(f"| {name} | {layers[name]} | {d} | {d + 1} | - (needs L >= {2 * (d + 1)}) | - | - |")
                continue
            m = memory_per_request(H, P, N, G, layers[name], args.buffer_len, d, act_bytes=args.act_bytes,
                                   shadow_bytes=args.shadow_bytes)
            print(f"| {name} ({H},{P},{N},{G}) | {layers[name]} | {d} | {d + 1} | {m['replay'] / MIB:.1f} | "
                  f"{m['native'] / MIB:.1f} | {m['ratio']:.2f}x |")
            rows.append(dict(geom=name, layers=layers[name], num_draft=d, buffer_len=args.buffer_len,
                             replay_bytes=m["replay"], native_bytes=m["native"], ratio=round(m["ratio"], 4)))
    if args.json:
        for r in rows:
            print("RESULT_JSON " + json.dumps(r))


if __name__ == "__main__":
    main()
