#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kernel benchmark: ReplaySSM decode vs our conventional kernel vs mamba_ssm's Triton kernel.

Every number comes from CUDA-graph replays timed with CUDA events, after a warm-up that includes
compilation and module loading. Inputs rotate over enough slot sets that the state read by one
launch is not in L2 from the previous ones (>= ROTATE_BYTES of state per graph).

ReplaySSM is timed at every buffer position k = 1..L (cursor pinned at k-1, so each launch is the
k-th step of a cycle; k = L is the flush step); the amortized step is the mean over k, i.e. one
full flush cycle. "mixed" (``replay_us_mixed``): one launch whose rows sit at every buffer position
(row i at k = i mod L + 1), as a serving batch of sequences that started at different tokens does, so ~1/L of
its rows flush; against the lockstep amortized time it says what the synchronized flush step costs
(bench/NOTES.md, "Spreading the flush"). The cursor advance (one tiny launch per model step, shared by all
layers) is not part of a layer's cost and is not timed here.

Bytes model (per batch row and layer): ``trtllm_replayssm.costs.mamba2_bytes_per_position`` (formulas in
costs' module docstring): conventional 2 S + io; replay at k < L the state (or its shadow, fp8 with row
scales) read once + io + k ring entries (k - 1 read, one appended); the flush k = L reads and writes the
state (+ rewrites the shadow) and reads L - 1 entries.
Achieved TB/s = bytes / time; % of ceiling against a device-to-device copy measured in the same run
(bytes read + written).

Usage: python scripts/bench_kernels.py [--quick] [--out bench/results] [--commit SHA]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtllm_replayssm import costs, cursor_ops, timing  # noqa: E402
from trtllm_replayssm.config import plan as plan_launch  # noqa: E402
from trtllm_replayssm.families.mamba2 import ops  # noqa: E402
from trtllm_replayssm.geometries import GEOMETRIES  # noqa: E402
from trtllm_replayssm.problems import make_inputs, make_params  # noqa: E402
from trtllm_replayssm.timing import copy_ceiling_tbps, graph_time_us  # noqa: E402

ROTATE_BYTES = 512 << 20  # ~8x the H200's 60 MB L2
MAX_ROTATIONS = 64
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "fp8": torch.float8_e4m3fn}


def load_mamba(path: str | None):
    if not path:
        return None
    try:
        sys.path.insert(0, path)
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update

        return selective_state_update
    except Exception as e:  # a missing peer only drops its column
        print(f"# mamba_ssm peer not available ({e}); its column is left empty", file=sys.stderr)
        return None


@dataclasses.dataclass
class Rotation:
    """Replay state for ``rotations`` disjoint slot sets of ``batch`` rows, so that one launch per set in a
    graph never finds its state in L2 from the previous launch (>= ROTATE_BYTES of state per graph).
    ``gen`` continues the seeded stream for the caller's step inputs."""

    rotations: int
    slots: int
    gen: torch.Generator
    prm: object
    state: torch.Tensor
    xc: torch.Tensor
    Bc: torch.Tensor
    dtc: torch.Tensor
    sbis: list


def rotation(H, P, N, G, L, batch, state_dtype=torch.float32, act=torch.bfloat16, seed=0) -> Rotation:
    R = max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / (costs.mamba2_state_bytes(H, P, N, state_dtype.itemsize) * batch))))
    slots = batch * R
    gen = torch.Generator().manual_seed(seed)
    prm = make_params(H, gen, "cuda")
    state = (torch.randn(slots, H, P, N, device="cuda") * 0.1).to(state_dtype)
    xc = torch.randn(slots, H, L, P, device="cuda").to(act)
    Bc = (torch.randn(slots, G, L, N, device="cuda") * 0.3).to(act)
    dtc = torch.rand(slots, H, L, device="cuda") * 0.05
    perm = torch.randperm(slots, generator=gen).to(torch.int32).cuda()
    sbis = [perm[r * batch:(r + 1) * batch].contiguous() for r in range(R)]
    return Rotation(R, slots, gen, prm, state, xc, Bc, dtc, sbis)


def fill_positions(measured: dict, L: int) -> list[float]:
    """Times at k = 1..L from the measured positions (ks given, for quick sweeps): a position not measured takes
    the linear interpolation of its measured neighbours below the flush (the step grows about linearly in k:
    each entry adds its bytes); the flush (k = L) is always measured. (A mean of the middle ones biased the
    amortized time by up to 1.75%.)"""
    xs = sorted(k for k in measured if k < L)
    out = []
    for k in range(1, L + 1):
        if k in measured:
            out.append(measured[k])
            continue
        lo = max((x for x in xs if x < k), default=xs[0])
        hi = min((x for x in xs if x > k), default=xs[-1])
        out.append(measured[lo] if hi == lo else measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo))
    return out


def bench_point(geom, state_code, act_code, L, batch, mamba_fn, seed=0, ks=None, shadow="none"):
    H, P, N, G = GEOMETRIES[geom]
    sdt, act = DT[state_code], DT[act_code]
    s, a = sdt.itemsize, act.itemsize
    rot = rotation(H, P, N, G, L, batch, sdt, act, seed)
    R, slots, gen, prm = rot.rotations, rot.slots, rot.gen, rot.prm
    state, xc, Bc, dtc, sbis = rot.state, rot.xc, rot.Bc, rot.dtc, rot.sbis
    cursor = torch.zeros(slots, dtype=torch.int32, device="cuda")
    inputs = [make_inputs(batch, H, P, N, G, act, gen, "cuda") for _ in range(min(R, 4))]
    y = torch.empty(batch, H, P, dtype=act, device="cuda")
    sh = sc = None
    ckpt8 = state_code == "fp8"  # an 8-bit checkpoint (its scales and flush counts; no conventional step)
    ck = dict(ckpt_scale=torch.ones(slots, H, P, device="cuda"), ckpt_flushes=torch.zeros(slots, dtype=torch.int32,
                                                                                           device="cuda")) if ckpt8 else {}
    if shadow != "none":
        sh = state.to(torch.bfloat16 if shadow == "bf16" else torch.float8_e4m3fn)  # values do not matter here
        sc = torch.ones(slots, H, P, device="cuda") if shadow == "fp8" else None

    def conv():
        for r in range(R):
            x, B, C, dt, _ = inputs[r % len(inputs)]
            ops.conventional_step(x, B, C, dt, prm.dt_bias, prm.A, prm.D, state, sbis[r], out=y)

    orders = [torch.empty((batch, 4), dtype=torch.int32, device="cuda") for _ in range(R)]
    # the device's flush-first order is read by the one-shot and staged kernels (KernelSpec.row_order)
    orderable = plan_launch(state_code, act_code, H, P, N, L, batch, False, shadow)[2].kind != "persistent"

    def replay(ordered=False):
        """The replay step of every rotation; ``ordered``: each launch behind the flush-first order kernel
        (cursor_ops.flush_order, once a model step in serving; here once a launch, its cost included)."""
        for r in range(R):
            x, B, C, dt, _ = inputs[r % len(inputs)]
            if ordered:
                cursor_ops.flush_order(cursor, sbis[r], L, out=orders[r], check_values=False)
            ops.replay_decode(x, B, C, dt, prm.dt_bias, prm.A, prm.D, state, xc, Bc, dtc, cursor, sbis[r], out=y,
                              shadow=sh, shadow_scale=sc, check_values=False, row_order=orders[r] if ordered else None,
                              **ck)

    row = dict(geom=geom, H=H, P=P, N=N, G=G, state=state_code, act=act_code, L=L, batch=batch, rotations=R,
               shadow=shadow)
    row["conv_us"], row["conv_spread_us"] = (None, None) if ckpt8 else graph_time_us(conv, R)
    measured = {}
    for k in ks or range(1, L + 1):
        cursor.fill_(k - 1)
        measured[k] = graph_time_us(replay, R)[0]
    per_k = fill_positions(measured, L)
    row["replay_us_k"] = per_k
    row["replay_us_k_measured"] = sorted(measured)
    row["replay_us_k1"], row["replay_us_flush"] = per_k[0], per_k[-1]
    row["replay_us_amortized"] = sum(per_k) / L
    conv_b, rep_b = costs.mamba2_bytes_per_position(H, P, N, G, L, s, a, shadow)
    row["bytes_conv"] = conv_b * batch
    row["bytes_replay_amortized"] = sum(rep_b.values()) / L * batch
    row["tbps_conv"] = None if ckpt8 else row["bytes_conv"] / row["conv_us"] / 1e6
    row["tbps_replay"] = row["bytes_replay_amortized"] / row["replay_us_amortized"] / 1e6
    row["tbps_replay_k1"] = rep_b[1] * batch / per_k[0] / 1e6
    row["tbps_replay_flush"] = rep_b[L] * batch / per_k[-1] / 1e6
    row["speedup_vs_conv"] = None if ckpt8 else row["conv_us"] / row["replay_us_amortized"]
    row["flush_over_conv"] = None if ckpt8 else per_k[-1] / row["conv_us"]
    # Serving-like phases: the rows of one launch spread over the L buffer positions (row i at k = i mod L + 1),
    # as sequences that started at different tokens are; ~1/L of the rows flush in every step.
    timing.spread_cursors(cursor, sbis, L)
    row["replay_us_mixed"] = graph_time_us(replay, R)[0]
    mixed_b = timing.mixed_bytes(rep_b, batch, L)
    row["bytes_replay_mixed"] = mixed_b
    row["tbps_replay_mixed"] = mixed_b / row["replay_us_mixed"] / 1e6
    row["speedup_vs_conv_mixed"] = None if ckpt8 else row["conv_us"] / row["replay_us_mixed"]
    if orderable:  # the same launch, ordered on the device
        row["replay_us_mixed_ord"] = graph_time_us(lambda: replay(ordered=True), R)[0]
        row["speedup_vs_conv_mixed_ord"] = None if ckpt8 else row["conv_us"] / row["replay_us_mixed_ord"]
    timing.spread_cursors(cursor, sbis, L, flush_first=True)  # the same positions, flushing rows first
    row["replay_us_mixed_ff"] = graph_time_us(replay, R)[0]
    row["tbps_replay_mixed_ff"] = mixed_b / row["replay_us_mixed_ff"] / 1e6
    row["speedup_vs_conv_mixed_ff"] = None if ckpt8 else row["conv_us"] / row["replay_us_mixed_ff"]
    if mamba_fn is not None and state_code == "f32" and shadow == "none":
        # tie_hdim: dt, A, dt_bias, D broadcast over headdim with stride 0, as Nemotron-H runs it.
        A_t = prm.A[:, None, None].expand(H, P, N)
        bias_t = prm.dt_bias[:, None].expand(H, P)
        D_t = prm.D[:, None].expand(H, P)
        sbis_l = [t.long() for t in sbis]

        def mamba():
            for r in range(R):
                x, B, C, dt, _ = inputs[r % len(inputs)]
                mamba_fn(state, x, dt[:, :, None].expand(batch, H, P), A_t, B, C, D=D_t, dt_bias=bias_t,
                         dt_softplus=True, state_batch_indices=sbis_l[r])

        row["mamba_us"] = graph_time_us(mamba, R)[0]
        row["speedup_vs_mamba"] = row["mamba_us"] / row["replay_us_amortized"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="main geometry only, fp32 state, L=16")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None, help="default: $GIT_COMMIT, else git HEAD")
    ap.add_argument("--mamba-path", default=str(ROOT / "third_party" / "mamba_ssm_peer"))
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--tag", default="kernels")
    ap.add_argument("--shadows", default="none,bf16,fp8", help="checkpoint shadows for the main fp32 rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    mamba_fn = load_mamba(args.mamba_path)
    ceiling = copy_ceiling_tbps()
    meta = dict(**timing.run_meta(commit=args.commit), copy_ceiling_tbps=ceiling)
    print("RESULT_JSON " + json.dumps({"kind": "meta", **meta}), flush=True)
    plan = [("nemotron_h_8b", "f32", "bf16", 16, b, sh) for sh in args.shadows.split(",") for b in batches]
    if not args.quick:
        plan += [("nemotron_h_8b", "bf16", "bf16", 16, b, "none") for b in batches]
        plan += [("nemotron_h_8b", "f32", "bf16", L, b, "none") for L in (8, 32) for b in (1, 32, 256)]
        plan += [(g, "f32", "bf16", 16, b, "none") for g in ("nano_9b_v2", "h_56b", "nemotron3_nano", "nemotron3_super")
                 for b in (1, 32, 256)]
    rows = []
    for *p, sh in plan:
        row = bench_point(*p, mamba_fn, shadow=sh)
        row["pct_ceiling_conv"] = 100 * row["tbps_conv"] / ceiling
        row["pct_ceiling_replay"] = 100 * row["tbps_replay"] / ceiling
        row["pct_ceiling_replay_k1"] = 100 * row["tbps_replay_k1"] / ceiling
        rows.append(row)
        print("RESULT_JSON " + json.dumps({"kind": "row", **meta, **row}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = meta["date"][:10]
    path = out / f"{stamp}_{args.tag}_{meta['commit'][:10]}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    hdr = (f"{'geom':16s} {'st':4s} {'sh':4s} {'L':>2s} {'bs':>4s} {'conv us':>8s} {'%ceil':>5s} {'k=1':>7s} {'flush':>7s} "
           f"{'amort':>7s} {'%ceil':>5s} {'x conv':>6s} {'mixed':>7s} {'x conv':>6s} {'mix ff':>7s} {'x conv':>6s} "
           f"{'mix ord':>7s} {'mamba':>7s} {'x mamba':>7s}")
    print(f"# copy ceiling {ceiling:.2f} TB/s on {meta['device']}; results in {path}")
    print(hdr)
    for r in rows:
        print(f"{r['geom']:16s} {r['state']:4s} {r['shadow']:4s} {r['L']:2d} {r['batch']:4d} {r['conv_us']:8.1f} "
              f"{r['pct_ceiling_conv']:5.1f} "
              f"{r['replay_us_k1']:7.1f} {r['replay_us_flush']:7.1f} {r['replay_us_amortized']:7.1f} "
              f"{r['pct_ceiling_replay']:5.1f} {r['speedup_vs_conv']:6.2f} {r['replay_us_mixed']:7.1f} "
              f"{r['speedup_vs_conv_mixed'] or float('nan'):6.2f} {r['replay_us_mixed_ff']:7.1f} "
              f"{r['speedup_vs_conv_mixed_ff'] or float('nan'):6.2f} {r.get('replay_us_mixed_ord', float('nan')):7.1f} "
              f"{r.get('mamba_us', float('nan')):7.1f} "
              f"{r.get('speedup_vs_mamba', float('nan')):7.2f}")


if __name__ == "__main__":
    main()
