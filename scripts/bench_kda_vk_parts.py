#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The two-kernel (V, K) KDA step's parts timed apart (issue 37; bench/NOTES.md "KDA (V, K) replay"): at batch 256,
positions 1 and 8, ``kda_vk_prologue`` alone, ``kda_replay_rows_vk`` alone (records precomputed), and both, with and
without the programmatic dependent launch; each in a captured graph over 2 rotations of slots. Writes
``<out>/<date>_<tag>_<commit>.json`` (tag default ``kda-vk-parts``) (meta + one row per geometry and position).

Usage: python scripts/bench_kda_vk_parts.py [--geoms kimi_k3_tp8,glm5_3_flash_tp8] [--batch 256] [--out DIR] [--tag T]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtllm_replayssm import timing  # noqa: E402
from trtllm_replayssm.config import DTYPE_CODES  # noqa: E402
from trtllm_replayssm.families.kda import GEOMETRIES  # noqa: E402
from trtllm_replayssm.families.kda.config import kda_vk_scratch_floats, kda_vk_spec  # noqa: E402
from trtllm_replayssm.launch import launch  # noqa: E402
from trtllm_replayssm.timing import graph_time_us  # noqa: E402

LOWER_BOUND = {"glm5_3_flash_tp8": -5.0, "glm5_3_flash_tp1": -5.0}


def parts(geom: str, batch: int, L: int = 16, R: int = 2) -> list[dict]:
    H, K, V = GEOMETRIES[geom]
    lb = LOWER_BOUND.get(geom)
    slots, dev, act = batch * R, torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    st, kc, uc = rnd(slots, H, V, K, scale=0.05), rnd(slots, H, L, K, dtype=act), rnd(slots, H, L, V, scale=0.1)
    gc = -torch.rand(slots, H, L, K, generator=g, device=dev) * 0.3
    vc, bc = rnd(slots, H, L, V, dtype=act), torch.rand(slots, H, L, generator=g, device=dev)
    cur = torch.zeros(slots, dtype=torch.int32, device=dev)
    A_log = torch.log(torch.rand(H, generator=g, device=dev) * 15 + 1)
    dtb = torch.rand(H, K, generator=g, device=dev) * 0.1 - 3
    perm = torch.randperm(slots, generator=g, device=dev).to(torch.int32)
    sbis = [perm[r * batch:(r + 1) * batch].contiguous() for r in range(R)]
    q, k, f = (rnd(batch, H, K, dtype=act) for _ in range(3))
    v, b, y = rnd(batch, H, V, dtype=act), rnd(batch, H, dtype=act), torch.empty(batch, H, V, dtype=act, device=dev)
    spec = kda_vk_spec(DTYPE_CODES[act], H, K, V, batch, True, None, lb, 90, L)
    scr = [torch.zeros(batch, H, kda_vk_scratch_floats(K, L), device=dev) for _ in range(R)]

    def pro(r):
        a = [t.data_ptr() for t in (q, k, f, b, A_log, dtb, sbis[r], cur, kc, gc)]
        a += [np.int32(batch), np.int32(slots), scr[r].data_ptr()] + [t.data_ptr() for t in (kc, gc, bc)]
        launch(spec, "kda_vk_prologue", dev, (H, batch, 1), (K, 1, 1), a)

    def rows(r, pdl):
        a = [t.data_ptr() for t in (v, sbis[r], cur, st, uc, scr[r])]
        a += [np.int32(batch), np.int32(slots), y.data_ptr()] + [t.data_ptr() for t in (st, uc, vc)]
        launch(spec, "kda_replay_rows_vk", dev, spec.grid(batch), (spec.threads, 1, 1), a, pdl=pdl)

    out = []
    for kpos in (1, L // 2):
        cur.fill_(kpos - 1)
        row = dict(geom=geom, H=H, K=K, V=V, L=L, batch=batch, k=kpos, rows_geometry=[spec.rows, spec.warps,
                                                                                        spec.lanes, spec.resident])
        row["prologue_us"] = graph_time_us(lambda: [pro(r) for r in range(R)], R)[0]
        for r in range(R):
            pro(r)
        row["rows_us"] = graph_time_us(lambda: [rows(r, False) for r in range(R)], R)[0]
        row["both_pdl_us"] = graph_time_us(lambda: [(pro(r), rows(r, True)) for r in range(R)], R)[0]
        row["both_us"] = graph_time_us(lambda: [(pro(r), rows(r, False)) for r in range(R)], R)[0]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geoms", default="kimi_k3_tp8,glm5_3_flash_tp8")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--tag", default="kda-vk-parts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kda_vk_parts.py needs a CUDA GPU")
    meta = dict(**timing.run_meta(commit=args.commit), copy_ceiling_tbps=timing.copy_ceiling_tbps())
    rows = [r for geom in args.geoms.split(",") for r in parts(geom, args.batch)]
    path = pathlib.Path(args.out) / f"{meta['date'][:10]}_{args.tag}_{meta['commit'][:10]}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"# results in {path}")


if __name__ == "__main__":
    main()
