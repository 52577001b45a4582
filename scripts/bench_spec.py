#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Speculative-decoding kernel benchmark: ReplaySSM verify vs the native-spec baseline vs one
standard ReplaySSM step, in one process (bench_kernels.py's harness: CUDA-graph replays timed with
CUDA events, warm-up including compilation, rotation over slot sets beyond L2).

ReplaySSM verify is timed at committed counts m (cursor pinned at (start 0, count m): the kernel does not
move it, so replays repeat the same step): ``timing.spec_timed_counts`` (T = 4, L = 16: 0, 4, 8 without a
fold, 9 and 12 with one) plus every count a full-acceptance run visits (0, T, 2T, ...). Per step = the
timed counts interpolated and weighted by the stationary distribution of the count (``timing.spec_step_us``,
exact): ``verify_us_step`` at full acceptance, where the counts cycle T, 2T, ..., one fold per cycle (after a
fold the count is the step's n, not 0: T = 4, L = 16 runs 4, 8, 12), and ``verify_us_step_p08`` with each
draft accepted with p = 0.8 (fewer tokens per step, later folds). Per token = per step / tokens per step.
``verify_us_cycle_from_empty`` is the plain mean over 0, T, 2T, ... up to the fold, the figure results before
2026-12-06 reported as the step (it counts a count-0 step the steady state never runs, so it understated the
fold's share). The native baseline's cost does not depend on acceptance.
Native spec (vLLM / TensorRT-LLM style): verify reads the state and writes T snapshots; commit
copies the accepted snapshot into the state (timed separately: an engine may instead remap the slot).
Standard: one ReplaySSM decode step amortized over its flush cycle (bench_kernels.bench_point).

Bytes: the full model per (row, layer) is ``trtllm_replayssm.costs.mamba2_verify_bytes`` (state + history +
window, + state on the flush step) and ``costs.mamba2_native_spec_bytes`` (the numbers of
plugins/mamba2/replayssm_spec.cuh's comment); the rows' TB/s count the state only (``costs.mamba2_state_bytes``,
fp32): ``tbps_native_verify`` state * (1 + T), ``tbps_verify_count0`` state (which dominates).

Usage: python scripts/bench_spec.py [--batches 32,256] [--tokens 2,4,8] [--out bench/results] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_kernels as bk  # noqa: E402

from trtllm_replayssm import costs, cursor_ops, timing  # noqa: E402
from trtllm_replayssm.families.mamba2 import ops  # noqa: E402
from trtllm_replayssm.geometries import GEOMETRIES  # noqa: E402


def counts_visited(T: int, L: int) -> list[int]:
    """Committed counts of a full-acceptance run, from an empty ring to its flush step."""
    out, m = [], 0
    while True:
        out.append(m)
        if m + 2 * T > L:
            return out
        m += T


def window_inputs(batch, T, H, P, N, G, act, gen):
    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(act).cuda()

    return (rnd(batch, T, H, P), rnd(batch, T, G, N, scale=N ** -0.5 * 4), rnd(batch, T, G, N, scale=N ** -0.5 * 4),
            rnd(batch, T, H, shift=-2.0))


def bench_spec_point(geom, T, L, batch, seed=0):
    H, P, N, G = GEOMETRIES[geom]
    act = torch.bfloat16
    rot = bk.rotation(H, P, N, G, L, batch, torch.float32, act, seed)
    R, slots, gen, prm = rot.rotations, rot.slots, rot.gen, rot.prm
    state, xc, Bc, dtc, sbis = rot.state, rot.xc, rot.Bc, rot.dtc, rot.sbis
    cursor = torch.zeros(slots, 2, dtype=torch.int32, device="cuda")
    win = [window_inputs(batch, T, H, P, N, G, act, gen) for _ in range(min(R, 4))]
    y = torch.empty(batch, T, H, P, dtype=act, device="cuda")

    def verify():
        for r in range(R):
            x, B, C, dt = win[r % len(win)]
            ops.replay_verify(x, B, C, dt, prm.dt_bias, prm.A, prm.D, state, xc, Bc, dtc, cursor, sbis[r], out=y,
                              check_values=False)

    row = dict(geom=geom, H=H, P=P, N=N, G=G, T=T, L=L, batch=batch, rotations=R, state="f32", act="bf16")
    per_count = {}
    for m in sorted(set(counts_visited(T, L)) | set(timing.spec_timed_counts(T, L))):
        cursor[:, 1] = m
        per_count[m] = timing.graph_time_us(verify, R)[0]
    row["verify_us_by_count"] = per_count
    row["verify_us_cycle_from_empty"] = sum(per_count[m] for m in counts_visited(T, L)) / len(counts_visited(T, L))
    row["verify_us_step"] = timing.spec_step_us(per_count, T, L, 1.0)[0]
    row["verify_us_token"] = row["verify_us_step"] / T
    row["verify_us_step_p08"], row["tokens_per_step_p08"] = timing.spec_step_us(per_count, T, L, 0.8)
    row["verify_us_token_p08"] = row["verify_us_step_p08"] / row["tokens_per_step_p08"]
    # Native spec: T snapshots per slot (vLLM keeps them in extra slots; same bytes).
    snaps = torch.empty(slots, T, H, P, N, device="cuda")
    n_acc = torch.full((batch,), T, dtype=torch.int32, device="cuda")

    def native_verify():
        for r in range(R):
            x, B, C, dt = win[r % len(win)]
            ops.native_spec_verify(x, B, C, dt, prm.dt_bias, prm.A, prm.D, state, snaps, sbis[r], out=y,
                                   check_values=False)

    def native_commit():
        for r in range(R):
            cursor_ops.native_spec_commit(state, snaps, n_acc, sbis[r], check_values=False)

    row["native_verify_us"] = timing.graph_time_us(native_verify, R)[0]
    row["native_commit_us"] = timing.graph_time_us(native_commit, R)[0]
    row["native_us_step"] = row["native_verify_us"] + row["native_commit_us"]
    std = bk.bench_point(geom, "f32", "bf16", L, batch, None, seed=seed, ks=(1, 2, L // 2, L - 1, L))
    row["standard_us_step"] = std["replay_us_amortized"]
    row["conventional_us_step"] = std["conv_us"]
    row["verify_vs_native"] = row["native_us_step"] / row["verify_us_step"]
    row["verify_vs_native_verify_only"] = row["native_verify_us"] / row["verify_us_step"]
    row["verify_over_standard_step"] = row["verify_us_step"] / row["standard_us_step"]
    row["tokens_per_us_gain_vs_standard"] = row["standard_us_step"] / row["verify_us_token"]
    row["verify_over_standard_step_p08"] = row["verify_us_step_p08"] / row["standard_us_step"]
    row["tokens_per_us_gain_vs_standard_p08"] = row["standard_us_step"] / row["verify_us_token_p08"]
    sb = costs.mamba2_state_bytes(H, P, N) * batch  # fp32 state bytes of the batch
    row["tbps_native_verify"] = sb * (1 + T) / row["native_verify_us"] / 1e6
    row["tbps_verify_count0"] = sb / per_count[0] / 1e6  # the state read dominates
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--tokens", default="2,4,8")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None, help="default: $GIT_COMMIT, else git HEAD")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_spec.py needs a CUDA GPU")
    ceiling = timing.copy_ceiling_tbps()
    meta = dict(**timing.run_meta(commit=args.commit),
                copy_ceiling_tbps=ceiling)
    rows = []
    for b in (int(v) for v in args.batches.split(",")):
        for T in (int(v) for v in args.tokens.split(",")):
            row = bench_spec_point("nemotron_h_8b", T, args.L, b)
            row["pct_ceiling_native_verify"] = 100 * row["tbps_native_verify"] / ceiling
            row["pct_ceiling_verify_count0"] = 100 * row["tbps_verify_count0"] / ceiling
            rows.append(row)
            print("RESULT_JSON " + json.dumps({"kind": "row", **meta, **row}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date'][:10]}_spec_{meta['commit'][:10]}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"# copy ceiling {ceiling:.2f} TB/s on {meta['device']}; results in {path}")
    print(f"{'bs':>4s} {'T':>2s} {'verify/step':>11s} {'by count':>28s} {'native v+c':>10s} {'x native':>8s} "
          f"{'std step':>8s} {'v/std':>5s} {'tok gain':>8s} {'v/std .8':>8s} {'conv':>7s}")
    for r in rows:
        bc = " ".join(f"{m}:{t:.0f}" for m, t in r["verify_us_by_count"].items())
        print(f"{r['batch']:4d} {r['T']:2d} {r['verify_us_step']:11.1f} {bc:>28s} {r['native_us_step']:10.1f} "
              f"{r['verify_vs_native']:8.2f} {r['standard_us_step']:8.1f} {r['verify_over_standard_step']:5.2f} "
              f"{r['tokens_per_us_gain_vs_standard']:8.2f} {r['verify_over_standard_step_p08']:8.2f} "
              f"{r['conventional_us_step']:7.1f}")


if __name__ == "__main__":
    main()
