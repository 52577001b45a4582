#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The no-SSM step in both harnesses, in one process (issue 11: the standard e2e step's 9.28 ms and profile_decode's
8.23 ms came from two runs of different commits).

Builds the Nemotron-H-8B geometry once, then times the captured no-SSM decode step by
``profile_decode.profile_point`` (bs256 at fill 176: first with static shapes; then after a bs1 point, so
the compiled regions are dynamic in the batch), by ``e2e_standard.run_batch`` (conventional + noop at bs256,
its prefill, gate and timing route) and by ``profile_point`` once more after that. Writes ms per step and
the kernel time per category as JSON.

Usage (GPU): python scripts/harness_gap.py OUT.json
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.random_model import build_model, model_config  # noqa: E402
from scripts import e2e_standard as bd  # noqa: E402
from scripts import profile_decode as pd  # noqa: E402


def main(out_path: str) -> None:
    t0 = time.time()
    model = build_model(model_config(), "cuda", torch.bfloat16, seed=0)

    def prof(tag: str, batch: int, fill: int) -> dict:
        r = pd.profile_point(model, batch, 1, 1024, "noop", 16, 10, 3, fill)
        print(tag, f"bs{batch} fill{fill}: {r['ms_step']:.3f} ms, kernels {r['kernel_sum_ms']:.3f}, "
              f"n {r['kernels_per_step']:.0f}", {k: round(v, 3) for k, v in r["categories_ms"].items()}, flush=True)
        return dict(ms=r["ms_step"], cats=r["categories_ms"], top=r["top"][:12])

    out = {"A1": prof("A1 profile (first: static shapes)", 256, 176),
           "A0": prof("A0 profile bs1", 1, 176),
           "A2": prof("A2 profile after bs1 (dynamic batch)", 256, 176)}
    rows = bd.run_batch(model, 256, ["conventional", "noop"], L=16, warmup=1, reps=5)
    for r in rows:
        print("B bench", r["mode"], f"{r['ms_step']:.3f} ms fill {r['kv_fill_mean']}", flush=True)
    out["B"] = [dict(mode=r["mode"], ms=r["ms_step"], kv_fill_mean=r["kv_fill_mean"]) for r in rows]
    out["A3"] = prof("A3 profile after the bench batch", 256, 176)
    print("wall", time.time() - t0)
    pathlib.Path(out_path).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), **out), indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
