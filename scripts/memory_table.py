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
       python scripts/memory_table.py --checkpoints [--json]

``--checkpoints`` (issue 38): standard decode, decode state per request (checkpoint, shadow, ring, conv window of
K - 1 columns, cursor) and requests per 80 GB (80e9 bytes of state memory; weights and KV cache not counted) at the
Nemotron-H-8B, Nemotron-3-Nano and Qwen3.5-35B-A3B (Gated DeltaNet) geometries, for an fp32 checkpoint, fp32 + fp8
shadow, a bf16 checkpoint and an 8-bit checkpoint (e4m3 + fp32 scale per (head, row); costs.CKPT8_BYTES).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trtllm_replayssm.costs import CKPT8_BYTES, gdn_layer_memory, memory_per_request  # noqa: E402
from trtllm_replayssm.geometries import GDN_MODELS, GEOMETRIES, MODELS  # noqa: E402

# Mamba layers per model (the rows of the table; geometries from trtllm_replayssm.geometries)
MAMBA_LAYERS = {"nemotron_h_8b": 24, "nano_9b_v2": 27, "h_56b": 54,
                **{name: m.mamba_layers for name, m in MODELS.items()}}
MIB = 2 ** 20
BUDGET = 80 * 10 ** 9  # "80 GB" of decode-state memory
# (name, state bytes, shadow bytes) of the --checkpoints table
CHECKPOINTS = (("fp32", 4, 0), ("fp32+fp8 shadow", 4, 1), ("bf16", 2, 0), ("fp8 ckpt", CKPT8_BYTES, 0))
CKPT_MODELS = ("nemotron_h_8b", "nemotron3_nano", "qwen3_5_35b")


def checkpoint_rows(buffer_len: int = 16, act_bytes: int = 2) -> list[dict]:
    """Bytes per request (standard decode) and requests per 80 GB for each checkpoint of CHECKPOINTS at the
    CKPT_MODELS geometries (Mamba-2: costs.memory_per_request with no drafts; GDN: costs.gdn_layer_memory per
    linear-attention layer + the 8-byte cursor)."""
    rows = []
    for name in CKPT_MODELS:
        for ck, s, q in CHECKPOINTS:
            if name in GDN_MODELS:
                m = GDN_MODELS[name]
                HV, Hk, V, K = m.geometry
                layer = gdn_layer_memory(HV, Hk, V, K, buffer_len, m.conv_kernel - 1, s, act_bytes, q or None,
                                         m.conv_dim)
                layers, geom = m.gdn_layers, f"GDN {m.geometry}"
                total = layers * sum(layer.values()) + 8
            else:
                H, P, N, G = GEOMETRIES[name] if name in GEOMETRIES else MODELS[name].geometry
                layers, geom = MAMBA_LAYERS[name], f"Mamba-2 {(H, P, N, G)}"
                total = memory_per_request(H, P, N, G, layers, buffer_len, 0, s, act_bytes, shadow_bytes=q)["replay"]
            rows.append(dict(model=name, geometry=geom, layers=layers, checkpoint=ck, buffer_len=buffer_len,
                             bytes_per_request=total, requests_per_80GB=BUDGET // total))
    for r in rows:  # the gain over the fp32 checkpoint of the same model
        base = next(b for b in rows if b["model"] == r["model"] and b["checkpoint"] == "fp32")
        r["x_vs_fp32"] = round(r["requests_per_80GB"] / base["requests_per_80GB"], 3)
    return rows


def print_checkpoints(args) -> None:
    rows = checkpoint_rows(args.buffer_len, args.act_bytes)
    print(f"Standard decode, L = {args.buffer_len}, {args.act_bytes}-byte activations, conv window K - 1; "
          "decode state only (weights, KV cache not counted)\n")
    print("| model | geometry | layers | checkpoint | MiB / request | requests / 80 GB | x vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['geometry']} | {r['layers']} | {r['checkpoint']} | "
              f"{r['bytes_per_request'] / MIB:.2f} | {r['requests_per_80GB']} | {r['x_vs_fp32']:.2f}x |")
    if args.json:
        for r in rows:
            print("RESULT_JSON " + json.dumps(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 3, 5, 7])
    ap.add_argument("--shadow-bytes", type=int, default=0, help="2 for a bf16 shadow, 1 for fp8")
    ap.add_argument("--act-bytes", type=int, default=2)
    ap.add_argument("--layers", nargs="*", default=[], help="NAME=COUNT overrides of the Mamba layer counts")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per row")
    ap.add_argument("--checkpoints", action="store_true",
                    help="the checkpoint-precision table (fp32 / fp8 shadow / bf16 / 8-bit) instead of the spec table")
    args = ap.parse_args()
    if args.checkpoints:
        print_checkpoints(args)
        return
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
