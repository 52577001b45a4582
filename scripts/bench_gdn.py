#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kernel benchmark, Gated DeltaNet: conventional vs ReplaySSM (fp32 checkpoint) vs ReplaySSM with a bf16 shadow.

One GDN layer of Qwen3-Next / Qwen3.5 (HV 32 value heads, H 16 key heads, V = K = 128), bf16 activations,
fp32 state, L = 16. A sibling of bench_kernels.py (Mamba-2) sharing its timing helpers: CUDA-graph
replays timed with CUDA events after a warm-up that includes compilation; inputs rotate over enough
slot sets that one launch's state is not in L2 from the previous ones (>= 512 MB of state per graph).
ReplaySSM is timed at every buffer position k = 1..L (cursor pinned at k - 1; k = L is the flush);
the amortized step is the mean over k (one flush cycle). The cursor advance is shared by all layers
and not timed.

Bytes model per (batch row, layer) (a = activation bytes; the refinement of gdn_reference.bytes_per_step
that counts what the kernel moves at each position):
  io            q, k 2*H*K*a + v HV*V*a + a, b 2*HV*a + y HV*V*a
  conventional  state read + write 2*HV*V*K*4 + io
  replay, k<L   S0 (or shadow, 2 bytes) HV*V*K*s + io + (k-1) entries read (u HV*V*4, k H*K*4, g HV*4)
                + one entry written (u HV*V*4, v HV*V*a, k H*K*4, g, beta 2*HV*4)
  replay, k=L   state read + write 2*HV*V*K*4 (+ shadow write HV*V*K*2) + io
                + (L-1) entries read (v HV*V*a, k H*K*4, g, beta 2*HV*4)
(bytes_per_step charges (L-1)/2 entries to the mean non-flush step; the exact mean is (L-2)/2.)
Achieved TB/s = bytes / time; % of ceiling against a device-to-device copy measured in the same run.

Usage: python scripts/bench_gdn.py [--batches 1,8,32,64,128,256] [--out bench/results] [--commit SHA]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import copy_ceiling_tbps, graph_time_us  # noqa: E402

from trtllm_replayssm import gdn_ops  # noqa: E402
from trtllm_replayssm.config import gdn_geometry  # noqa: E402
from trtllm_replayssm.gdn_reference import bytes_per_step  # noqa: E402
from trtllm_replayssm.geometries import GDN_GEOMETRIES  # noqa: E402

ROTATE_BYTES = 512 << 20
MAX_ROTATIONS = 64
QWEN3_NEXT = dict(zip(("HV", "H", "V", "K"), GDN_GEOMETRIES["qwen3_next_80b"]))  # (32, 16, 128, 128)


def bytes_model(HV, H, V, K, L, a=2, shadow=False):
    io = 2 * H * K * a + HV * V * a + 2 * HV * a + HV * V * a
    state = HV * V * K * 4
    read = HV * V * K * 2 if shadow else state
    hist = HV * V * 4 + H * K * 4 + HV * 4
    entry = HV * V * 4 + HV * V * a + H * K * 4 + 2 * HV * 4
    per_k = {k: read + io + (k - 1) * hist + entry for k in range(1, L)}
    per_k[L] = 2 * state + (HV * V * K * 2 if shadow else 0) + io + (L - 1) * (HV * V * a + H * K * 4 + 2 * HV * 4)
    return 2 * state + io, per_k


def bench_point(batch, L=16, seed=0, geom=QWEN3_NEXT):
    HV, H, V, K = geom["HV"], geom["H"], geom["V"], geom["K"]
    act = torch.bfloat16
    R = max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / (HV * V * K * 4 * batch))))
    slots = batch * R
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")
    state = torch.randn(slots, HV, V, K, generator=gen, **dev) * 0.05
    shadow = state.to(torch.bfloat16)
    u_cache = torch.randn(slots, HV, L, V, generator=gen, **dev) * 0.1
    v_cache = torch.randn(slots, HV, L, V, generator=gen, **dev).to(act)
    k_cache = torch.nn.functional.normalize(torch.randn(slots, H, L, K, generator=gen, **dev), dim=-1)
    g_cache = -torch.rand(slots, HV, L, generator=gen, **dev) * 0.5
    beta_cache = torch.rand(slots, HV, L, generator=gen, **dev)
    cursor = torch.zeros(slots, dtype=torch.int32, **dev)
    A_log = torch.log(torch.rand(HV, generator=gen, **dev) * 15 + 1)
    dt_bias = torch.rand(HV, generator=gen, **dev) * 0.1 - 3.0
    perm = torch.randperm(slots, generator=gen, **dev).to(torch.int32)
    sbis = [perm[r * batch:(r + 1) * batch].contiguous() for r in range(R)]

    def inputs():
        return (torch.randn(batch, H, K, generator=gen, **dev).to(act), torch.randn(batch, H, K, generator=gen, **dev).to(act),
                torch.randn(batch, HV, V, generator=gen, **dev).to(act), torch.randn(batch, HV, generator=gen, **dev).to(act),
                torch.randn(batch, HV, generator=gen, **dev).to(act))

    ins = [inputs() for _ in range(min(R, 4))]
    y = torch.empty(batch, HV, V, dtype=act, **dev)

    def conv():
        for r in range(R):
            gdn_ops.gdn_conventional_step(*ins[r % len(ins)], A_log, dt_bias, state, sbis[r], out=y, check_values=False)

    def replay(sh):
        def fn():
            for r in range(R):
                gdn_ops.gdn_replay_decode(*ins[r % len(ins)], A_log, dt_bias, state, u_cache, v_cache, k_cache, g_cache,
                                          beta_cache, cursor, sbis[r], out=y, shadow=sh, check_values=False)
        return fn

    conv_b, _ = bytes_model(HV, H, V, K, L)
    row = dict(geom="qwen3_next", **geom, L=L, batch=batch, rotations=R, act="bf16",
               conv_geometry=gdn_geometry(V, K, HV, batch, False), replay_geometry=gdn_geometry(V, K, HV, batch, True))
    row["conv_us"], row["conv_spread_us"] = graph_time_us(conv, R)
    row["bytes_conv"] = conv_b * batch
    row["tbps_conv"] = row["bytes_conv"] / row["conv_us"] / 1e6
    for name, sh in (("f32", None), ("bf16shadow", shadow)):
        per_k = []
        for k in range(1, L + 1):
            cursor.fill_(k - 1)
            per_k.append(graph_time_us(replay(sh), R)[0])
        _, bk = bytes_model(HV, H, V, K, L, shadow=sh is not None)
        amort = sum(per_k) / L
        bytes_amort = sum(bk.values()) / L * batch
        row[f"{name}_us_k"] = per_k
        row[f"{name}_us_k1"], row[f"{name}_us_flush"], row[f"{name}_us_amortized"] = per_k[0], per_k[-1], amort
        row[f"{name}_bytes_amortized"] = bytes_amort
        ref_model = bytes_per_step(HV, H, V, K, L, 2, 4, 2 if sh is not None else None)
        row[f"{name}_bytes_model_reference"] = ref_model["replay"] * batch
        row[f"{name}_tbps"] = bytes_amort / amort / 1e6
        row[f"{name}_tbps_k1"] = bk[1] * batch / per_k[0] / 1e6
        row[f"{name}_tbps_flush"] = bk[L] * batch / per_k[-1] / 1e6
        row[f"{name}_speedup_vs_conv"] = row["conv_us"] / amort
        row[f"{name}_flush_over_conv"] = per_k[-1] / row["conv_us"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--tag", default="gdn-kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gdn.py needs a CUDA GPU")
    ceiling = copy_ceiling_tbps()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(device=torch.cuda.get_device_name(), date=now, commit=args.commit, torch=torch.__version__,
                copy_ceiling_tbps=ceiling)
    print("RESULT_JSON " + json.dumps({"kind": "meta", **meta}), flush=True)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        row = bench_point(b, args.L)
        row["pct_ceiling_conv"] = 100 * row["tbps_conv"] / ceiling
        for name in ("f32", "bf16shadow"):
            row[f"{name}_pct_ceiling"] = 100 * row[f"{name}_tbps"] / ceiling
            row[f"{name}_pct_ceiling_k1"] = 100 * row[f"{name}_tbps_k1"] / ceiling
        rows.append(row)
        print("RESULT_JSON " + json.dumps({"kind": "row", **meta, **row}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date'][:10]}_{args.tag}_{args.commit[:10]}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"# copy ceiling {ceiling:.2f} TB/s on {meta['device']}; results in {path}")
    print(f"{'bs':>4s} {'conv us':>8s} {'%ceil':>5s} | {'f32 k1':>7s} {'flush':>7s} {'amort':>7s} {'%ceil':>5s} {'x conv':>6s} | "
          f"{'sh k1':>7s} {'flush':>7s} {'amort':>7s} {'%ceil':>5s} {'x conv':>6s}")
    for r in rows:
        print(f"{r['batch']:4d} {r['conv_us']:8.1f} {r['pct_ceiling_conv']:5.1f} | "
              + " | ".join(f"{r[f'{n}_us_k1']:7.1f} {r[f'{n}_us_flush']:7.1f} {r[f'{n}_us_amortized']:7.1f} "
                           f"{r[f'{n}_pct_ceiling']:5.1f} {r[f'{n}_speedup_vs_conv']:6.2f}" for n in ("f32", "bf16shadow")))


if __name__ == "__main__":
    main()
