#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Error of the GDN ReplaySSM kernels' checkpoint and outputs against the float64 reference, over many flush cycles.

The kernel (plugins/gdn/gdn_decode.cu, through the torch op) and families/gdn/reference.py evolve side by side
from the same checkpoint on the same inputs (tests/test_gdn_gpu.py's Problem: the reference does float64 math and
stores into tensors of the kernel's dtypes). After every step: the relative Frobenius error of y, and after every
flush the relative error of the stored checkpoint (``state``), both over the rows with a slot. What is left between
the two is the kernel's fp32 arithmetic (and y's rounding to the activation dtype); the reference's flush is the exact
refold from v_j. It measures whether a kernel's flush costs accuracy (the u-sum of the stored u_j against the refold:
bench/NOTES.md, issue 40) and whether the error grows with the number of flushes.

A/B of kernel trees: run it twice, once with ``TRTLLM_REPLAYSSM_PLUGIN_DIR`` at the older tree's plugins.

Usage: python scripts/gdn_state_error.py [--steps 512] [--batch 4] [--L 16] [--shadow none|bf16] [--tag gdn-state-error]
       [--out bench/results]   (needs a CUDA GPU)
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

from tests.test_gdn_gpu import QWEN3_NEXT, Problem, rel  # noqa: E402
from trtllm_replayssm import timing  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--shadow", choices=("none", "bf16"), default="none")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--tag", default="gdn-state-error")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if args.steps < 1 or args.batch < 1 or not 1 <= args.L <= 32:
        ap.error("--steps, --batch: expected >= 1; --L: expected 1..32")
    if not torch.cuda.is_available():
        sys.exit("gdn_state_error.py needs a CUDA GPU")
    pb = Problem(QWEN3_NEXT, torch.bfloat16, args.L, args.batch, args.batch + 1, seed=args.seed,
                 shadow=args.shadow == "bf16", random_cursor=False)
    used = torch.tensor(pb.used, dtype=torch.long)
    y_err, state_err = [], []
    for step in range(args.steps):
        y, y_ref = pb.step(check=False)
        y_err.append(rel(y[pb.valid], y_ref[pb.valid]))
        if (step + 1) % args.L == 0:  # every row flushed at this step (all cursors started at 0)
            state_err.append(rel(pb.buf.state.cpu()[used], pb.rbuf.state[used]))
            if pb.shadow is not None:  # the reference reads the shadow the kernel wrote at the flush (as the test does)
                pb.rshadow.q.copy_(pb.shadow.cpu())
    meta = dict(**timing.run_meta(commit=args.commit), geometry=list(QWEN3_NEXT), L=args.L, batch=args.batch,
                steps=args.steps, shadow=args.shadow, seed=args.seed)
    row = dict(y_rel_mean=statistics.fmean(y_err), y_rel_max=max(y_err),
               state_rel_first=state_err[0] if state_err else None, state_rel_last=state_err[-1] if state_err else None,
               state_rel_max=max(state_err) if state_err else None, state_rel=state_err)
    print(f"# {meta['device']} {meta['commit'][:10]}: y rel {row['y_rel_mean']:.2e} mean / {row['y_rel_max']:.2e} max; "
          f"checkpoint rel after flush 1 / {len(state_err)}: {row['state_rel_first']:.2e} / {row['state_rel_last']:.2e} "
          f"(max {row['state_rel_max']:.2e})")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date'][:10]}_{args.tag}_{meta['commit'][:10]}.json"
    path.write_text(json.dumps({"meta": meta, "rows": [row]}, indent=1))
    print(f"# results in {path}")


if __name__ == "__main__":
    main()
