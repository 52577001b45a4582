#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kernel benchmark, Gated DeltaNet: conventional vs ReplaySSM (fp32 checkpoint) vs ReplaySSM with a bf16 shadow.

One GDN layer of Qwen3-Next / Qwen3.5 (HV 32 value heads, H 16 key heads, V = K = 128), bf16 activations,
fp32 state, L = 16. A sibling of bench_kernels.py (Mamba-2) sharing its timing helpers: CUDA-graph
replays timed with CUDA events after a warm-up that includes compilation; inputs rotate over enough
slot sets that one launch's state is not in L2 from the previous ones (>= 512 MB of state per graph).
ReplaySSM is timed at every buffer position k = 1..L (cursor pinned at k - 1; k = L is the flush);
the amortized step is the mean over k (one flush cycle; every row flushes in the same launch). "mixed"
(``<name>_us_mixed``, ``timing.spread_cursors``): one launch whose row i sits at position i mod L + 1, as a serving
batch of sequences that started at different tokens, so ~1/L of its rows flush; ``<name>_mixed_over_amortized``
below 1 is what spreading the flush saves. The cursor advance is shared by all layers and not timed.

Bytes model per (batch row, layer): ``trtllm_replayssm.costs.gdn_bytes_per_position`` (formulas in costs'
module docstring; fp32 state, bf16 shadow): conventional 2 S + io; replay at k < L S0 (or the shadow) once
+ io + k - 1 entries read (u, k, g) + one written (u, v, k, g, beta); the flush k = L reads and writes S
(+ rewrites the shadow) and reads L - 1 entries (v, k, g, beta) for the exact fold.
Achieved TB/s = bytes / time; % of ceiling against a device-to-device copy measured in the same run.

Speculative rows (``--spec``, T = 4, L = 16): ReplaySSM ``gdn_replay_verify`` timed at pinned cursors
(count 0, 4, 8: no flush; count 9, 12: the fold of 9 / 12 committed entries inside the launch), and the
native baseline ``gdn_native_spec_verify`` + ``gdn_native_spec_commit`` (n = T). The ReplaySSM step
time at acceptance ~0.8 is the mean over the stationary distribution of the committed count
(``timing.spec_count_weights``: n = 1 + accepted drafts, each draft accepted with p = 0.8 while the previous ones were;
the commit's flush rule on the cursor; exact, ``costs.spec_count_distribution``), times interpolated
linearly in count between the measured points (the history and fold costs are linear in count). The
cursor commit (one tiny kernel shared by all layers) is not timed, as the cursor advance above.
Spec bytes model per (batch row, layer): ``costs.gdn_verify_bytes`` at count m (no fold: S0 or shadow
+ T io + m entries read + T written; fold where m + 2T > L: S read and written + the m entries the fold
reads + T io + T written) and ``costs.gdn_native_spec_bytes`` (verify S + T snapshots + T io, commit 2 S).

Peer column (``fla``): flash-linear-attention's Triton ``fused_recurrent_gated_delta_rule`` (fla-core,
``python scripts/fetch_peers.py --only fla`` puts it in the git-ignored ``third_party/fla_peer``;
``--fla-path``), one decode token per row from an initial state (N, HV, K, V) fp32 with the gates, the
beta sigmoid and the q/k l2 norm fused in its kernel (``use_gate_in_kernel``, ``A_log``, ``dt_bias``,
``use_beta_sigmoid_in_kernel``, ``use_qk_l2norm_in_kernel``), the final state written to a new tensor
(``output_final_state``): the conventional bytes. Its output is first checked against our conventional
kernel on the same inputs (``fla_check_rel``); rows report ``fla_us`` and ReplaySSM's speedup over it.

Usage: python scripts/bench_gdn.py [--batches 1,8,32,64,128,256] [--geom HV:H:V:K] [--out bench/results] [--commit SHA] [--spec]
       [--fla-path third_party/fla_peer]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


from trtllm_replayssm import (  # noqa: E402
    costs,
    cursor_ops,
    timing,  # noqa: E402
)
from trtllm_replayssm.config import SUPPORTED_NUM_TOKENS  # noqa: E402
from trtllm_replayssm.families.gdn import config  # noqa: E402  (the GDN planner: monkeypatched by the sweeps)
from trtllm_replayssm.families.gdn import ops as gdn_ops  # noqa: E402
from trtllm_replayssm.geometries import GDN_GEOMETRIES, GDN_MODELS  # noqa: E402
from trtllm_replayssm.timing import copy_ceiling_tbps, graph_time_us  # noqa: E402

ROTATE_BYTES = 512 << 20
MAX_ROTATIONS = 64
QWEN3_NEXT = dict(zip(("HV", "H", "V", "K"), GDN_GEOMETRIES["qwen3_next_80b"]))  # (32, 16, 128, 128)


def bench_point(batch, L=16, seed=0, geom=QWEN3_NEXT, ordered_cycle: bool = False, layers: int | None = None):
    HV, H, V, K = geom["HV"], geom["H"], geom["V"], geom["K"]
    act = torch.bfloat16
    R = max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / (costs.gdn_state_bytes(HV, V, K) * batch))))
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

    orders = [torch.empty((batch, 4), dtype=torch.int32, device="cuda") for _ in range(R)]

    def replay(sh, ordered=False):
        """The replay step of every rotation; ``ordered``: each launch behind the flush-first order kernel
        (cursor_ops.flush_order, once a model step in serving; here once a launch, its cost included); "pre": the
        row-order module on the orders as they are (``order_all`` before the timing)."""
        def fn():
            for r in range(R):
                if ordered is True:
                    cursor_ops.flush_order(cursor, sbis[r], L, out=orders[r], check_values=False)
                gdn_ops.gdn_replay_decode(*ins[r % len(ins)], A_log, dt_bias, state, u_cache, v_cache, k_cache, g_cache,
                                          beta_cache, cursor, sbis[r], out=y, shadow=sh, check_values=False,
                                          row_order=orders[r] if ordered else None)
        return fn

    def order_all():
        for r in range(R):
            cursor_ops.flush_order(cursor, sbis[r], L, out=orders[r], check_values=False)

    if FLA is not None:  # the peer, on the same inputs: checked against our conventional kernel, then timed
        sts = [state[sbis[r].long()].transpose(-1, -2).contiguous() for r in range(R)]  # (batch, HV, K, V)

        def fla_step(r, st):
            q, k, v, a, b = ins[r % len(ins)]
            o, _ = FLA(q[:, None], k[:, None], v[:, None], g=a[:, None], beta=b[:, None], initial_state=st,
                       output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                       dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
            return o[:, 0]

        mine = state.clone()
        want = gdn_ops.gdn_conventional_step(*ins[0], A_log, dt_bias, mine, sbis[0], check_values=False)
        try:
            fla_check = float((fla_step(0, sts[0]).float() - want.float()).norm() / want.float().norm())
        except Exception as e:  # a peer that does not run here is reported, not fatal
            fla_check = f"{type(e).__name__}: {e}"[:300]
        del mine

        def fla_all():
            for r in range(R):
                fla_step(r, sts[r])

    conv_b, _ = costs.gdn_bytes_per_position(HV, H, V, K, L)
    name = "qwen3_next" if geom == QWEN3_NEXT else f"{HV}:{H}:{V}:{K}"
    row = dict(geom=name, **geom, L=L, batch=batch, rotations=R, act="bf16",
               conv_geometry=config.gdn_geometry(V, K, HV, batch, False),
               replay_geometry=config.gdn_plan(V, K, HV, batch, True),
               shadow_passes=config.gdn_passes(V, K, HV, batch, True, "bf16"))
    row["conv_us"], row["conv_spread_us"] = graph_time_us(conv, R)
    row["bytes_conv"] = conv_b * batch
    row["tbps_conv"] = row["bytes_conv"] / row["conv_us"] / 1e6
    for name, sh in (("f32", None), ("bf16shadow", shadow)):
        per_k = []
        for k in range(1, L + 1):
            cursor.fill_(k - 1)
            per_k.append(graph_time_us(replay(sh), R)[0])
        timing.spread_cursors(cursor, sbis, L)  # the serving-like launch: ~1/L of its rows flush
        mixed_us = graph_time_us(replay(sh), R)[0]
        mixed_ord_us = graph_time_us(replay(sh, ordered=True), R)[0]  # the same launch, ordered on the device
        timing.spread_cursors(cursor, sbis, L, flush_first=True)  # the same positions, flushing rows first
        mixed_ff_us = graph_time_us(replay(sh), R)[0]
        _, bk = costs.gdn_bytes_per_position(HV, H, V, K, L, 2, 4, 2 if sh is not None else None)
        timing.add_replay_cycle(row, name, per_k, bk, batch, mixed_us, mixed_ff_us, mixed_ord_us)
        if ordered_cycle:  # the row-order module's lockstep cycle, its order made once before (a serving step's)
            timing.time_ordered_cycle(row, name, cursor, L, order_all, replay(sh, ordered="pre"), R, layers)
    if FLA is not None and isinstance(fla_check, str):
        row["fla_error"] = fla_check
    elif FLA is not None:
        row["fla_check_rel"] = fla_check
        row["fla_us"], row["fla_spread_us"] = graph_time_us(fla_all, R)
        row["tbps_fla"] = row["bytes_conv"] / row["fla_us"] / 1e6
        for name in ("f32", "bf16shadow"):
            row[f"{name}_speedup_vs_fla"] = row["fla_us"] / row[f"{name}_us_amortized"]
    return row


_PINNED = []  # the entered overrides: a context manager dropped unreferenced would run its exit at collection


def pin_replay(**shape) -> None:
    """Pin the replay modules' launch shape for the rest of the process (config.override: lanes, rt, warps,
    resident; the sweep of the small-batch plan, issue 40)."""
    pin = config.override(**shape)
    pin.__enter__()
    _PINNED.append(pin)


def parse_geom(text: str) -> dict:
    """A name of GDN_GEOMETRIES or ``HV:H:V:K`` (integers; HV a multiple of H) -> bench_point's geometry. An ad hoc
    geometry times GDN's kernels at another family's bytes, e.g. 12:12:128:128 is a Kimi-K3 TP8 KDA layer's state
    (12 heads of K = V = 128): the same rows-first kernels on a (V, K) state, against bench_kda.py's (K, V) ones."""
    if text in GDN_GEOMETRIES:
        return dict(zip(("HV", "H", "V", "K"), GDN_GEOMETRIES[text]))
    parts = text.split(":")
    if len(parts) != 4 or not all(x.isdigit() and int(x) > 0 for x in parts) or int(parts[0]) % int(parts[1]):
        raise ValueError(f"--geom: expected one of {sorted(GDN_GEOMETRIES)} or HV:H:V:K (positive integers, H "
                         f"dividing HV), got {text!r}")
    return dict(zip(("HV", "H", "V", "K"), (int(x) for x in parts)))


def parse_replay_shape(text: str) -> dict:
    """``LANES:RT:WARPS[:RESIDENT]`` (each an integer or ``-`` for the planner's) -> pin_replay's keywords."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not all(x == "-" or x.isdigit() for x in parts):
        raise ValueError(f"--replay-shape: expected LANES:RT:WARPS[:RESIDENT] (integers or -), got {text!r}")
    return {k: None if x == "-" else int(x) for k, x in zip(("lanes", "rt", "warps", "resident"), parts)}


FLA = None  # fla's fused_recurrent_gated_delta_rule when --fla-path has it (main)


def load_fla(path: pathlib.Path):
    if not (path / "fla").is_dir():
        print(f"# fla peer not found in {path} (python scripts/fetch_peers.py --only fla): no fla column", flush=True)
        return None
    sys.path.insert(0, str(path))
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule


def bench_spec_point(batch, L=16, T=4, seed=0, geom=QWEN3_NEXT, p_accept=0.8):
    HV, H, V, K = geom["HV"], geom["H"], geom["V"], geom["K"]
    act = torch.bfloat16
    R = max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / (costs.gdn_state_bytes(HV, V, K) * batch))))
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
    cursor = torch.zeros(slots, 2, dtype=torch.int32, **dev)
    A_log = torch.log(torch.rand(HV, generator=gen, **dev) * 15 + 1)
    dt_bias = torch.rand(HV, generator=gen, **dev) * 0.1 - 3.0
    perm = torch.randperm(slots, generator=gen, **dev).to(torch.int32)
    sbis = [perm[r * batch:(r + 1) * batch].contiguous() for r in range(R)]

    def inputs():
        shapes = ((batch, T, H, K), (batch, T, H, K), (batch, T, HV, V), (batch, T, HV), (batch, T, HV))
        return tuple(torch.randn(*sh, generator=gen, **dev).to(act) for sh in shapes)

    ins = [inputs() for _ in range(min(R, 4))]
    y = torch.empty(batch, T, HV, V, dtype=act, **dev)

    def verify(sh):
        def fn():
            for r in range(R):
                gdn_ops.gdn_replay_verify(*ins[r % len(ins)], A_log, dt_bias, state, u_cache, v_cache, k_cache, g_cache,
                                          beta_cache, cursor, sbis[r], out=y, shadow=sh, check_values=False)
        return fn

    row = dict(geom="qwen3_next", **geom, L=L, T=T, batch=batch, rotations=R, act="bf16", p_accept=p_accept,
               verify_geometry=config.gdn_plan(V, K, HV, batch, True, T),
               native_geometry=config.gdn_geometry(V, K, HV, batch, False))
    weights, tokens_per_step = timing.spec_count_weights(T, L, p_accept)
    row["tokens_per_step"] = tokens_per_step
    for name, sh in (("f32", None), ("bf16shadow", shadow)):
        pts = {}
        for m in timing.spec_timed_counts(T, L):
            cursor[:, 0] = 0
            cursor[:, 1] = m
            pts[m] = graph_time_us(verify(sh), R)[0]
        row[f"{name}_verify_us"] = {str(m): t for m, t in pts.items()}
        amort = timing.spec_step_us(pts, T, L, p_accept)[0]
        q = 2 if sh is not None else None  # bf16 shadow
        by_count = {m: costs.gdn_verify_bytes(HV, H, V, K, L, T, m, shadow_bytes=q)
                    for m in range(L + 1)}
        bytes_amort = sum(w * by_count[m] for m, w in weights.items()) * batch
        row[f"{name}_us_step"] = amort
        row[f"{name}_bytes_step"] = bytes_amort
        row[f"{name}_tbps"] = bytes_amort / amort / 1e6
        row[f"{name}_tbps_c0"] = by_count[0] * batch / pts[0] / 1e6
        row[f"{name}_tbps_flush{L - T}"] = by_count[L - T] * batch / pts[L - T] / 1e6  # the last fold count
    snaps = torch.empty(slots, T, HV, V, K, **dev)
    n_acc = torch.full((batch,), T, dtype=torch.int32, **dev)

    def native_verify():
        for r in range(R):
            gdn_ops.gdn_native_spec_verify(*ins[r % len(ins)], A_log, dt_bias, state, snaps, sbis[r], out=y,
                                           check_values=False)

    def native_commit():
        for r in range(R):
            gdn_ops.gdn_native_spec_commit(state, snaps, n_acc, sbis[r], check_values=False)

    row["native_verify_us"], row["native_verify_spread_us"] = graph_time_us(native_verify, R)
    row["native_commit_us"], row["native_commit_spread_us"] = graph_time_us(native_commit, R)
    nat_verify, nat_commit = costs.gdn_native_spec_bytes(HV, H, V, K, T)
    row["native_verify_bytes"] = nat_verify * batch
    row["native_commit_bytes"] = nat_commit * batch
    row["native_us_step"] = row["native_verify_us"] + row["native_commit_us"]
    row["native_verify_tbps"] = row["native_verify_bytes"] / row["native_verify_us"] / 1e6
    row["native_commit_tbps"] = row["native_commit_bytes"] / row["native_commit_us"] / 1e6
    row["native_tbps"] = (row["native_verify_bytes"] + row["native_commit_bytes"]) / row["native_us_step"] / 1e6
    for name in ("f32", "bf16shadow"):
        row[f"{name}_speedup_vs_native"] = row["native_us_step"] / row[f"{name}_us_step"]
    return row


def main_spec(args, meta, ceiling):
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        row = bench_spec_point(b, args.L, args.T)
        for k in ("f32_tbps", "bf16shadow_tbps", "native_verify_tbps", "native_commit_tbps", "native_tbps",
                  "f32_tbps_c0", "bf16shadow_tbps_c0"):
            row[k.replace("tbps", "pct_ceiling")] = 100 * row[k] / ceiling
        rows.append(row)
        print("RESULT_JSON " + json.dumps({"kind": "row", **meta, **row}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date'][:10]}_{args.tag}-spec_{meta['commit'][:10]}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"# copy ceiling {ceiling:.2f} TB/s on {meta['device']}; results in {path}")
    print(f"{'bs':>4s} | {'nat ver':>7s} {'%ceil':>5s} {'commit':>7s} {'%ceil':>5s} {'step':>7s} | "
          f"{'f32 c0':>7s} {'c8':>7s} {'fl12':>7s} {'step':>7s} {'%ceil':>5s} {'x nat':>5s} | "
          f"{'sh c0':>7s} {'fl12':>7s} {'step':>7s} {'%ceil':>5s} {'x nat':>5s}")
    for r in rows:
        f, s = r["f32_verify_us"], r["bf16shadow_verify_us"]
        print(f"{r['batch']:4d} | {r['native_verify_us']:7.1f} {r['native_verify_pct_ceiling']:5.1f} "
              f"{r['native_commit_us']:7.1f} {r['native_commit_pct_ceiling']:5.1f} {r['native_us_step']:7.1f} | "
              f"{f['0']:7.1f} {f['8']:7.1f} {f['12']:7.1f} {r['f32_us_step']:7.1f} {r['f32_pct_ceiling']:5.1f} "
              f"{r['f32_speedup_vs_native']:5.2f} | {s['0']:7.1f} {s['12']:7.1f} {r['bf16shadow_us_step']:7.1f} "
              f"{r['bf16shadow_pct_ceiling']:5.1f} {r['bf16shadow_speedup_vs_native']:5.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None, help="default: $GIT_COMMIT, else git HEAD")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--tag", default="gdn-kernels")
    ap.add_argument("--spec", action="store_true", help="speculative rows: ReplaySSM verify vs native verify + commit")
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--geom", default="qwen3_next_80b", help="standard-decode rows' geometry: a name of "
                    "GDN_GEOMETRIES or HV:H:V:K (e.g. 12:12:128:128, a Kimi-K3 TP8 KDA layer's bytes)")
    ap.add_argument("--fla-path", type=pathlib.Path, default=ROOT / "third_party" / "fla_peer",
                    help="the fla peer (scripts/fetch_peers.py --only fla); missing: no fla column")
    ap.add_argument("--shadow-passes", choices=("auto", "1"), default="auto",
                    help="1: pin every shadow module to one pass per block (the A/B baseline of GDNSpec.passes)")
    ap.add_argument("--replay-rt", choices=("auto", "1", "2", "4"), default="auto",
                    help="pin the replay modules' state rows per thread (a sweep of the planner's small-batch rule)")
    ap.add_argument("--ordered-cycle", action="store_true",
                    help="also each variant's lockstep cycle through its row-order module, the order made once before "
                         "the timed launches (a serving step makes it once for all layers): ro fields, the order's "
                         "share over the model's GDN layers included in ro x conv step")
    ap.add_argument("--replay-shape", default="",
                    help="LANES:RT:WARPS[:RESIDENT] (- keeps the planner's): pin the replay modules' lanes per row, "
                         "rows per thread, warps per block and resident threads per SM")
    args = ap.parse_args()
    try:  # every flag before any GPU work
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--batches: expected comma-separated integers >= 1, got {args.batches!r}")
    if not 1 <= args.L <= 32:
        ap.error(f"--L: expected 1..32, got {args.L}")
    if args.spec and (args.T not in SUPPORTED_NUM_TOKENS or args.L < 2 * args.T):
        ap.error(f"--T {args.T}, --L {args.L}: expected T in {SUPPORTED_NUM_TOKENS} and L >= 2T (flush one window early)")
    try:
        geom = parse_geom(args.geom)
    except ValueError as e:
        ap.error(str(e))
    if args.spec and geom != QWEN3_NEXT:
        ap.error("--geom: the --spec rows time Qwen3-Next only")
    if args.shadow_passes == "1":  # gdn_spec reads config.gdn_passes at every call; the key says _x2 or not
        config.gdn_passes = lambda *a, **k: 1
    try:
        shape = parse_replay_shape(args.replay_shape) if args.replay_shape else {}
    except ValueError as e:
        ap.error(str(e))
    if args.replay_rt != "auto":
        shape["rt"] = int(args.replay_rt)
    if shape:
        pin_replay(**shape)
    if not torch.cuda.is_available():
        sys.exit("bench_gdn.py needs a CUDA GPU")
    ceiling = copy_ceiling_tbps()
    meta = dict(**timing.run_meta(commit=args.commit),
                copy_ceiling_tbps=ceiling, replay_rt=args.replay_rt,
                replay_shape=args.replay_shape or "planned", geom=geom)
    print("RESULT_JSON " + json.dumps({"kind": "meta", **meta}), flush=True)
    if args.spec:
        return main_spec(args, meta, ceiling)
    global FLA
    FLA = load_fla(args.fla_path)
    meta["fla"] = None if FLA is None else json.loads((args.fla_path / "PEER.json").read_text())
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        row = bench_point(b, args.L, geom=geom, ordered_cycle=args.ordered_cycle,
                          layers=GDN_MODELS[args.geom].gdn_layers if args.geom in GDN_MODELS else None)
        timing.add_ceiling_pcts(row, ceiling)
        rows.append(row)
        print("RESULT_JSON " + json.dumps({"kind": "row", **meta, **row}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date'][:10]}_{args.tag}_{meta['commit'][:10]}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"# copy ceiling {ceiling:.2f} TB/s on {meta['device']}; results in {path}")
    print(f"{'bs':>4s} {'conv us':>8s} {'%ceil':>5s} | {'f32 k1':>7s} {'flush':>7s} {'amort':>7s} {'%ceil':>5s} {'x conv':>6s} | "
          f"{'sh k1':>7s} {'flush':>7s} {'amort':>7s} {'%ceil':>5s} {'x conv':>6s} | "
          "mixed us (x conv), ff: flushing rows first; f32, shadow")
    for r in rows:
        print(f"{r['batch']:4d} {r['conv_us']:8.1f} {r['pct_ceiling_conv']:5.1f} | "
              + " | ".join(f"{r[f'{n}_us_k1']:7.1f} {r[f'{n}_us_flush']:7.1f} {r[f'{n}_us_amortized']:7.1f} "
                           f"{r[f'{n}_pct_ceiling']:5.1f} {r[f'{n}_speedup_vs_conv']:6.2f}" for n in ("f32", "bf16shadow"))
              + " | " + timing.mixed_cells(r)
              + (f" | fla {r['fla_us']:7.1f} us ({r['pct_ceiling_fla']:4.1f}%, check {r['fla_check_rel']:.1e}), "
                 f"replay x fla {r['f32_speedup_vs_fla']:.2f} / {r['bf16shadow_speedup_vs_fla']:.2f}"
                 if "fla_us" in r else "")
              + (" | " + timing.ordered_cells(r) if "order_us" in r else ""))


if __name__ == "__main__":
    main()
