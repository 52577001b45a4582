#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kernel benchmark of the KDA decode kernels (plugins/kda/kda_decode.cu): conventional step vs the fused ReplaySSM
step (fp32 checkpoint, bf16 shadow), per batch, at the Kimi-K3 and GLM-5.3-Flash per-GPU geometries at TP 8
(families/kda GEOMETRIES), L = 16.

Bytes model (costs.kda_bytes_per_position, per row and layer; H heads, K = V = 128, a = 2 (bf16), s = 4):
  conventional  2 H K V s + io,  io = (3 H K + H V + H) a + H V a  (q, k, f, v, b in; y out)
  replay, k < L H K V s (or H K V 2, the shadow) + io + (k - 1) E_r + E_w;  E_r = H (K a + V u + K 4) (k, u, g)
                E_w = H (K a + V u + K 4 + V a + 4);  u = 4 (the fp32 u ring), 2 beside a bf16 shadow
  flush, k = L  2 H K V s (+ the shadow written) + io + (L - 1) E_f;  E_f = E_r (the u-sum of k, u, g); beside a
                shadow H (K a + V a + K 4 + 4) (the refold's k, v, g, beta)
The replay time of a cycle is the mean of the L positions, each timed with every row's cursor at k - 1
(``<name>_us_k``); ratio = conventional / that mean. "mixed" (``<name>_us_mixed``, ``timing.spread_cursors``):
one launch whose row i sits at position i mod L + 1, as a serving batch of sequences that started at different
tokens, so ~1/L of its rows flush (``<name>_speedup_vs_conv_mixed``; ``<name>_mixed_over_amortized`` below 1: the
flush's compute overlaps other rows' streams, which the lockstep cycle cannot show).
Rows rotate over enough slots (>= 512 MiB of state, at most 64 rotations) that the state comes from DRAM: each
launch of a captured graph uses a fresh set of slots. Achieved TB/s = bytes / time; % of the copy ceiling against a
device-to-device copy measured in the same run.

Peer column (``fla``): flash-linear-attention's Triton ``fused_recurrent_kda`` (fla-core in the git-ignored
``third_party/fla_peer``, ``--fla-path``), one decode token per row from an initial state (N, H, K, V) fp32 with
the gate (``use_gate_in_kernel``, ``A_log``, ``dt_bias``), the beta sigmoid and the q / k l2 norm in its kernel,
the final state written to a new tensor: the conventional bytes. Its output is first checked against our
conventional kernel on the same inputs (``fla_check_rel``).

Speculative verify (``--verify T``, rows of kind "verify"; plugins/kda/kda_spec.cu): one ``kda_replay_verify`` of T
tokens per row at committed count m = 0, L - 2T (the longest history without a fold) and L - T (the fold), fp32
checkpoint and bf16 shadow; bytes costs.kda_verify_bytes (S0 or its shadow, m x (k, u, g), T io, T entries written;
the fold: S0 read and written (+ shadow), m x (k, v, g, beta)); ``x_conv_T``: T conventional steps of the same run
over this one verify (the same tokens stepped one by one without snapshots: a lower bound of the native spec).

Layout experiment (``--vk``, issue 37; bench/NOTES.md "KDA in GDN's row layout"): the conventional step on the
transposed state (S, H, V, K), GDN's row layout (``families/kda/vk.py``), on the same inputs and slots: first checked
against our (K, V) conventional kernel (``conv_vk_check_y_rel``, ``conv_vk_check_state_rel``), then timed
(``conv_vk_us``, ``tbps_conv_vk``, ``pct_ceiling_conv_vk``; ``conv_vk_speedup``: the (K, V) step's time over it). Same
bytes as the conventional step. Without ``--conv-only`` also the (V, K) standard decode step (fp32 checkpoint, fp32 u
ring; ``kda_replay_decode_vk``: two kernels, prefix ``vk``) on the (K, V) rows' rings: checked against the (K, V)
kernel at position L / 2 and at the flush (``vk_check_{k8,flush}_{y,state,u}_rel``), then timed at every position
(``vk_f32_us_k``, ``_amortized``, ``vk_f32_speedup_vs_conv_vk``: over the (V, K) conventional step,
``vk_f32_speedup_vs_kv_f32``: the (K, V) replay's amortized time over it, ``vk_f32_pct_of_bound``) and at the launch
shapes of ``--vk-shapes`` (``vk_f32_shapes_us_at``; default GDN's R64 W8 at 2 blocks an SM). At 68ae665b0a and
aa3ab1f562 the prefix ``vk`` was a fused one-kernel form (removed: 0.61-0.71x the (K, V) replay) and ``vk2`` this one.

A/B of kernel trees (``TRTLLM_REPLAYSSM_PLUGIN_DIR``, compile.py): ``--sweep-only`` skips the main rows, so a second
process over an older kernel tree times only the sweep rows for a same-card comparison.

Usage: python scripts/bench_kda.py [--batches 1,8,32,64,128,256] [--geoms kimi_k3_tp8,glm5_3_flash_tp8]
       [--out bench/results] [--commit SHA] [--fla-path third_party/fla_peer] [--sweep 4:4,4:8,2:4] [--sweep-only]
       [--verify 4] [--vk] [--conv-only]
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

from trtllm_replayssm import costs, cursor_ops, timing  # noqa: E402
from trtllm_replayssm.families.gdn.config import override as gdn_override  # noqa: E402
from trtllm_replayssm.families.kda import GEOMETRIES, MODELS  # noqa: E402
from trtllm_replayssm.families.kda import ops as kops  # noqa: E402
from trtllm_replayssm.families.kda.config import kda_geometry, kda_vk_spec, override  # noqa: E402
from trtllm_replayssm.families.kda.layers import ring_dtype  # noqa: E402
from trtllm_replayssm.families.kda.vk import kda_conventional_step_vk, kda_replay_decode_vk  # noqa: E402
from trtllm_replayssm.timing import copy_ceiling_tbps, graph_time_us  # noqa: E402

ROTATE_BYTES = 512 << 20
MAX_ROTATIONS = 64
LOWER_BOUND = {"glm5_3_flash_tp8": -5.0, "glm5_3_flash_tp1": -5.0}  # GLM-5 Next's bounded gate
FLA = None
SHADOW_PASSES = 1  # --shadow-passes
VK_SHAPES = [(4, 8, 512)]  # --vk-shapes: (rows a thread, warps, resident threads an SM) of the (V, K) replay module


def load_fla(path: pathlib.Path):
    if not (path / "fla" / "ops" / "kda").is_dir():
        print(f"# fla peer with ops/kda not found in {path}: no fla column", flush=True)
        return None
    sys.path.insert(0, str(path))
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda


def _rotations(H, K, V, batch):
    return max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / (costs.kda_state_bytes(H, K, V) * batch))))


def bench_verify(geom: str, batch: int, T: int, L: int = 16, seed: int = 1, conv_us: float | None = None) -> dict:
    """Verify rows: ``kda_replay_verify`` of T tokens at committed counts 0, L - 2T, L - T (the fold)."""
    H, K, V = GEOMETRIES[geom]
    lb = LOWER_BOUND.get(geom)
    act = torch.bfloat16
    R = _rotations(H, K, V, batch)
    slots = batch * R
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")
    state = torch.randn(slots, H, K, V, generator=gen, **dev) * 0.05
    shadow = state.to(torch.bfloat16)
    k_ring = torch.randn(slots, H, L, K, generator=gen, **dev).to(act)
    u_f32 = torch.randn(slots, H, L, V, generator=gen, **dev) * 0.1
    rest = (-torch.rand(slots, H, L, K, generator=gen, **dev) * 0.3, torch.randn(slots, H, L, V, generator=gen, **dev).to(act),
            torch.rand(slots, H, L, generator=gen, **dev))
    rings = {sh: (k_ring, u_f32.to(ring_dtype(torch.float32, sh)), *rest) for sh in (None, torch.bfloat16)}
    cursor = torch.zeros(slots, 2, dtype=torch.int32, **dev)
    A_log = torch.log(torch.rand(H, generator=gen, **dev) * 15 + 1)
    dt_bias = torch.rand(H, K, generator=gen, **dev) * 0.1 - 3.0
    perm = torch.randperm(slots, generator=gen, **dev).to(torch.int32)
    sbis = [perm[r * batch:(r + 1) * batch].contiguous() for r in range(R)]
    shapes = ((batch, T, H, K), (batch, T, H, K), (batch, T, H, V), (batch, T, H, K), (batch, T, H))
    ins = [tuple(torch.randn(*sh, generator=gen, **dev).to(act) for sh in shapes) for _ in range(min(R, 4))]
    y = torch.empty(batch, T, H, V, dtype=act, **dev)
    row = dict(geom=geom, H=H, K=K, V=V, L=L, T=T, batch=batch, rotations=R, act="bf16", lower_bound=lb,
               geometry=kda_geometry(H, K, V, batch))
    for name, sh in (("f32", None), ("bf16shadow", shadow)):
        for m in (0, L - 2 * T, L - T):
            cursor[:, 1] = m

            def fn(sh=sh):
                for r in range(R):
                    kops.kda_replay_verify(*ins[r % len(ins)], A_log, dt_bias, state,
                                           *rings[None if sh is None else sh.dtype], cursor, sbis[r], out=y,
                                           shadow=sh, lower_bound=lb, check_values=False)

            us, spread = graph_time_us(fn, R)
            b = costs.kda_verify_bytes(H, K, V, L, T, m, shadow="bf16" if sh is not None else None) * batch
            row[f"{name}_us_m{m}"], row[f"{name}_spread_us_m{m}"] = us, spread
            row[f"{name}_tbps_m{m}"] = b / us / 1e6
            if conv_us is not None:
                row[f"{name}_x_conv_T_m{m}"] = T * conv_us / us
    return row


VK_OPS = {"vk": kda_replay_decode_vk}  # prefix: op (at 68ae665b0a / aa3ab1f562 "vk" was a fused form, "vk2" this one)


def _bench_vk_replay(row, state_vk, state, rings, cursor, ins, sbis, A_log, dt_bias, lb, y, R):
    """The (V, K) standard decode step (fp32 checkpoint, fp32 u ring) on the transposed state and the (K, V) rows'
    rings (``kda_replay_decode_vk``, prefix ``vk``): checked against the (K, V) kernel at one non-flush
    position and at the flush (same inputs, slots and rings, cloned), then timed at every position at the planned
    launch shape, and at positions 1, L / 2, L at each of ``VK_SHAPES`` (``<prefix>_f32_shapes_us_at``: GDN's
    override pins rt:warps:resident)."""
    H, K, V, L = row["H"], row["K"], row["V"], row["L"]
    sl = sbis[0].long()
    _, bk = costs.kda_bytes_per_position(H, K, V, L, shadow=None)
    for pre, op in VK_OPS.items():  # every check before any timing: the timings move state and rings
        for m in (L // 2 - 1, L - 1):
            cursor.fill_(m)
            rk, rv = [t.clone() for t in rings], [t.clone() for t in rings]
            want_st, got_st = state.clone(), state_vk.clone()
            want = kops.kda_replay_decode(*ins[0], A_log, dt_bias, want_st, *rk, cursor, sbis[0], lower_bound=lb,
                                          check_values=False)
            got = op(*ins[0], A_log, dt_bias, got_st, *rv, cursor, sbis[0], lower_bound=lb, check_values=False)
            tag = "flush" if m == L - 1 else f"k{m + 1}"
            row[f"{pre}_check_{tag}_y_rel"] = float((got.float() - want.float()).norm() / want.float().norm())
            ws, gs = want_st[sl], got_st[sl].transpose(2, 3)
            row[f"{pre}_check_{tag}_state_rel"] = float((gs - ws).norm() / ws.norm())
            row[f"{pre}_check_{tag}_u_rel"] = float((rv[1][sl] - rk[1][sl]).norm()
                                                    / rk[1][sl].norm().clamp_min(1e-30))
            del want_st, got_st, rk, rv
    for pre, op in VK_OPS.items():

        def replay_vk(op=op):
            for r in range(R):
                op(*ins[r % len(ins)], A_log, dt_bias, state_vk, *rings, cursor, sbis[r], out=y, lower_bound=lb,
                   check_values=False)

        spec = kda_vk_spec("bf16", H, K, V, row["batch"], lower_bound=lb, L=L)
        row[f"{pre}_replay_geometry"] = [spec.rows, spec.warps, spec.lanes, spec.resident]
        per_k = []
        for k in range(1, L + 1):
            cursor.fill_(k - 1)
            per_k.append(graph_time_us(replay_vk, R)[0])
        sweep = {}
        for rt, warps, resident in VK_SHAPES:
            with gdn_override(rt=rt, warps=warps, resident=resident):
                pinned = kda_vk_spec("bf16", H, K, V, row["batch"], lower_bound=lb, L=L)
                at = {}
                for k in (1, L // 2, L):
                    cursor.fill_(k - 1)
                    at[k] = graph_time_us(replay_vk, R)[0]
            sweep[f"R{pinned.rows}W{pinned.warps}r{pinned.resident}"] = at
        row[f"{pre}_f32_shapes_us_at"] = sweep
        amort = sum(per_k) / L
        row[f"{pre}_f32_us_k"], row[f"{pre}_f32_us_k1"], row[f"{pre}_f32_us_flush"] = per_k, per_k[0], per_k[-1]
        row[f"{pre}_f32_us_amortized"] = amort
        row[f"{pre}_f32_tbps"] = sum(bk.values()) / L * row["batch"] / amort / 1e6
        row[f"{pre}_f32_speedup_vs_conv_vk"] = row["conv_vk_us"] / amort
        row[f"{pre}_f32_speedup_vs_conv"] = row["conv_us"] / amort
        row[f"{pre}_f32_flush_over_conv_vk"] = per_k[-1] / row["conv_vk_us"]
        if "f32_us_amortized" in row:
            row[f"{pre}_f32_speedup_vs_kv_f32"] = row["f32_us_amortized"] / amort
            row[f"{pre}_f32_pct_of_bound"] = 100 * row[f"{pre}_f32_speedup_vs_conv_vk"] / row["f32_bound_ratio"]


def _bench_vk(row, state, ins, sbis, A_log, dt_bias, lb, y, R, rings=None, cursor=None):
    """The (V, K) conventional step on the transposed state: checked against the (K, V) kernel on one launch's
    inputs and slots, then timed like it (fields in the module docstring); with ``rings`` (the (K, V) fp32 rows'
    ring tensors) also the (V, K) standard decode step (:func:`_bench_vk_replay`)."""
    H, K, V = row["H"], row["K"], row["V"]
    state_vk = state.transpose(2, 3).contiguous()
    sl = sbis[0].long()
    want_st = state.clone()
    want = kops.kda_conventional_step(*ins[0], A_log, dt_bias, want_st, sbis[0], lower_bound=lb, check_values=False)
    got_st = state_vk.clone()
    got = kda_conventional_step_vk(*ins[0], A_log, dt_bias, got_st, sbis[0], lower_bound=lb, check_values=False)
    row["conv_vk_check_y_rel"] = float((got.float() - want.float()).norm() / want.float().norm())
    ws, gs = want_st[sl], got_st[sl].transpose(2, 3)
    row["conv_vk_check_state_rel"] = float((gs - ws).norm() / ws.norm())
    del want_st, got_st

    def conv_vk():
        for r in range(R):
            kda_conventional_step_vk(*ins[r % len(ins)], A_log, dt_bias, state_vk, sbis[r], out=y, lower_bound=lb,
                                     check_values=False)

    spec = kda_vk_spec("bf16", H, K, V, row["batch"], lower_bound=lb)
    row["conv_vk_geometry"] = [spec.rows, spec.warps, spec.lanes, spec.resident]
    row["conv_vk_us"], row["conv_vk_spread_us"] = graph_time_us(conv_vk, R)
    row["tbps_conv_vk"] = row["bytes_conv"] / row["conv_vk_us"] / 1e6
    row["conv_vk_speedup"] = row["conv_us"] / row["conv_vk_us"]
    if rings is not None:
        _bench_vk_replay(row, state_vk, state, rings, cursor, ins, sbis, A_log, dt_bias, lb, y, R)


def conv_variants(residents: tuple[int, ...], bulk_shapes: tuple[tuple[int, ...], ...]) -> list[tuple]:
    """(tag, pins, reference pins) of the conventional step's pinned modules a row times: ``r<N>`` the planned module at
    KDASpec.resident N (reference: the planned module; only ptxas' register budget differs); for each bulk shape
    (col_lanes, warps[, resident]) the one-shot step at that shape ``<cl>x<w>`` (reference: the planned module, so not
    bit-equal where the shape differs) and ``bulk<cl>x<w>[r<N>]``, KDASpec.bulk (reference: the one-shot step at the
    same shape: the same arithmetic in the same order)."""
    out = [(f"r{res}", dict(resident=res), {}) for res in residents]
    for cl, w, *res in bulk_shapes:
        shape = dict(col_lanes=cl, warps=w)
        if f"{cl}x{w}" not in [t for t, _, _ in out]:
            out.append((f"{cl}x{w}", shape, {}))
        out.append((f"bulk{cl}x{w}" + (f"r{res[0]}" if res else ""), dict(shape, bulk=True, resident=res[0] if res
                                                                               else None), shape))
    return out


def _bench_conv_pinned(row, conv, state, ins, sbis, A_log, dt_bias, lb, R, variants):
    """The conventional step's pinned modules (:func:`conv_variants`): each one's outputs and state against its
    reference's, bit for bit (``conv_<tag>_bitequal``), then timed like the planned step: fields
    ``conv_<tag>_{us,spread_us,speedup}`` (speedup: the planned step's time over this one)."""
    def step(pins):
        st = state.clone()
        with override(**pins):
            y = kops.kda_conventional_step(*ins[0], A_log, dt_bias, st, sbis[0], lower_bound=lb, check_values=False)
        return y, st

    for tag, pins, ref in variants:
        (want, want_st), (got, got_st) = step(ref), step(pins)
        with override(**pins):
            row[f"conv_{tag}_us"], row[f"conv_{tag}_spread_us"] = graph_time_us(conv, R)
        row[f"conv_{tag}_bitequal"] = bool(torch.equal(got, want) and torch.equal(got_st, want_st))
        row[f"conv_{tag}_speedup"] = row["conv_us"] / row[f"conv_{tag}_us"]
        del want_st, got_st


def _bench_replay_bulk(row, name, sh, cursor, sbis, L, R, replay, y, k_cache, shapes):
    """The standard decode as a persistent stream (KDASpec.bulk, kda_replay_bulk) at each launch shape (col_lanes,
    warps[, resident]), in two forms: ``<name>_bulk<tag>``, its non-flush steps alone (flush rows refused; the cycle
    estimate ``_us_amortized_est`` / ``_speedup_vs_conv_est`` takes the planned module's flush), and
    ``<name>_bulkf<tag>``, KDASpec.bulk_flush (its flush items folded in a dynamic shared-memory tile, so fewer blocks
    an SM): the whole cycle, ``_us_k`` at k = 1..L, ``_us_amortized``, ``_speedup_vs_conv``, and the mixed launch
    (``_us_mixed``, ``_speedup_vs_conv_mixed``: spread cursors, as ``timing.spread_cursors``). Each form's y and the
    ring entries it appends are first checked against the one-shot step's at the same shape, bit for bit, at
    position L / 2 (the entry a step appends is the same whoever writes it). A shape the shared memory cannot take
    is recorded as ``_error``."""
    for cl, w, *res in shapes:
        sfx = f"{cl}x{w}" + (f"r{res[0]}" if res else "")
        for form, flush in (("bulk", False), ("bulkf", True)):
            tag = f"{name}_{form}{sfx}"
            pins = dict(col_lanes=cl, warps=w, bulk=True, bulk_flush=flush, resident=res[0] if res else None)
            cursor.fill_(L // 2 - 1)
            try:
                with override(col_lanes=cl, warps=w, staged=False, passes=1):
                    replay(sh)()
                want = (y.clone(), k_cache.clone())
                with override(**pins):
                    replay(sh)()
            except ValueError as e:  # e.g. two stages of fp32 rows and the ring over the static shared memory
                row[f"{tag}_error"] = str(e)[:200]
                continue
            row[f"{tag}_bitequal"] = bool(torch.equal(y, want[0]) and torch.equal(k_cache, want[1]))
            del want
            per_k = []
            for k in range(1, L + flush):
                cursor.fill_(k - 1)
                with override(**pins):
                    per_k.append(graph_time_us(replay(sh), R)[0])
            row[f"{tag}_us_k"] = per_k
            if not flush:
                row[f"{tag}_us_amortized_est"] = (sum(per_k) + row[f"{name}_us_flush"]) / L
                row[f"{tag}_speedup_vs_conv_est"] = row["conv_us"] / row[f"{tag}_us_amortized_est"]
                continue
            row[f"{tag}_us_amortized"] = sum(per_k) / L
            row[f"{tag}_speedup_vs_conv"] = row["conv_us"] / row[f"{tag}_us_amortized"]
            timing.spread_cursors(cursor, sbis, L)
            with override(**pins):
                row[f"{tag}_us_mixed"] = graph_time_us(replay(sh), R)[0]
            row[f"{tag}_speedup_vs_conv_mixed"] = row["conv_us"] / row[f"{tag}_us_mixed"]


def bench_point(geom: str, batch: int, L: int = 16, seed: int = 0, ks: list[int] | None = None,
                peer: bool = True, vk: bool = False, conv_pins: list[tuple] = (),
                ordered_cycle: bool = False, replay_bulk: tuple[tuple[int, ...], ...] = ()) -> dict:
    """One row; ``ks``: time only these positions (a launch-shape sweep: no amortized fields), ``peer``: fla;
    ``vk``: the (V, K) conventional step's fields (the layout experiment); ``ordered_cycle``: also each variant's
    lockstep cycle through its row-order module, the order made once before the timed launches
    (:func:`timing.add_ordered_cycle`, the order's share over the model's KDA layers)."""
    H, K, V = GEOMETRIES[geom]
    lb = LOWER_BOUND.get(geom)
    act = torch.bfloat16
    R = _rotations(H, K, V, batch)
    slots = batch * R
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")
    state = torch.randn(slots, H, K, V, generator=gen, **dev) * 0.05
    shadow = state.to(torch.bfloat16)
    k_cache = torch.randn(slots, H, L, K, generator=gen, **dev).to(act)
    u_f32 = torch.randn(slots, H, L, V, generator=gen, **dev) * 0.1
    u_rings = {sh: u_f32.to(ring_dtype(torch.float32, sh)) for sh in (None, torch.bfloat16)}  # by the shadow's dtype
    g_cache = -torch.rand(slots, H, L, K, generator=gen, **dev) * 0.3
    v_cache = torch.randn(slots, H, L, V, generator=gen, **dev).to(act)
    beta_cache = torch.rand(slots, H, L, generator=gen, **dev)
    cursor = torch.zeros(slots, dtype=torch.int32, **dev)
    A_log = torch.log(torch.rand(H, generator=gen, **dev) * 15 + 1)
    dt_bias = torch.rand(H, K, generator=gen, **dev) * 0.1 - 3.0
    perm = torch.randperm(slots, generator=gen, **dev).to(torch.int32)
    sbis = [perm[r * batch:(r + 1) * batch].contiguous() for r in range(R)]

    def inputs():
        shapes = ((batch, H, K), (batch, H, K), (batch, H, V), (batch, H, K), (batch, H))
        return tuple(torch.randn(*sh, generator=gen, **dev).to(act) for sh in shapes)

    ins = [inputs() for _ in range(min(R, 4))]
    y = torch.empty(batch, H, V, dtype=act, **dev)

    def conv():
        for r in range(R):
            kops.kda_conventional_step(*ins[r % len(ins)], A_log, dt_bias, state, sbis[r], out=y, lower_bound=lb,
                                       check_values=False)

    orders = [torch.empty((batch, 4), dtype=torch.int32, device="cuda") for _ in range(R)]

    def replay(sh, ordered=False):
        """The replay step of every rotation; ``ordered``: each launch behind the flush-first order kernel
        (cursor_ops.flush_order, once a model step in serving; here once a launch, its cost included); "pre": the
        row-order module on the orders as they are (``order_all`` before the timing)."""
        def fn():
            with override(passes=SHADOW_PASSES if sh is not None and SHADOW_PASSES > 1 else None):
                for r in range(R):
                    if ordered is True:
                        cursor_ops.flush_order(cursor, sbis[r], L, out=orders[r], check_values=False)
                    kops.kda_replay_decode(*ins[r % len(ins)], A_log, dt_bias, state, k_cache,
                                           u_rings[None if sh is None else sh.dtype], g_cache, v_cache,
                                           beta_cache, cursor, sbis[r], out=y, shadow=sh, lower_bound=lb,
                                           check_values=False, row_order=orders[r] if ordered else None)
        return fn

    def order_all():
        for r in range(R):
            cursor_ops.flush_order(cursor, sbis[r], L, out=orders[r], check_values=False)

    row = dict(geom=geom, H=H, K=K, V=V, L=L, batch=batch, rotations=R, act="bf16", lower_bound=lb,
               geometry=kda_geometry(H, K, V, batch), conv_geometry=kda_geometry(H, K, V, batch, conventional=True))
    if FLA is not None and peer:  # the peer on the same inputs: checked against our conventional kernel, then timed
        sts = [state[sbis[r].long()].contiguous() for r in range(R)]  # (batch, H, K, V)

        def fla_step(r, st):
            q, k, v, f, b = ins[r % len(ins)]
            o, _ = FLA(q[:, None], k[:, None], v[:, None], f[:, None], b[:, None], A_log=A_log, dt_bias=dt_bias,
                       initial_state=st, output_final_state=True, use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lb)
            return o[:, 0]

        mine = state.clone()
        want = kops.kda_conventional_step(*ins[0], A_log, dt_bias, mine, sbis[0], lower_bound=lb, check_values=False)
        try:
            fla_check = float((fla_step(0, sts[0]).float() - want.float()).norm() / want.float().norm())
        except Exception as e:  # a peer that does not run here is reported, not fatal
            fla_check = f"{type(e).__name__}: {e}"[:300]
        del mine
        if isinstance(fla_check, str):
            row["fla_error"] = fla_check
        else:
            row["fla_check_rel"] = fla_check

            def fla_all():
                for r in range(R):
                    fla_step(r, sts[r])

            row["fla_us"], row["fla_spread_us"] = graph_time_us(fla_all, R)
        del sts
    conv_b, _ = costs.kda_bytes_per_position(H, K, V, L)
    row["conv_us"], row["conv_spread_us"] = graph_time_us(conv, R)
    row["bytes_conv"] = conv_b * batch
    row["tbps_conv"] = row["bytes_conv"] / row["conv_us"] / 1e6
    _bench_conv_pinned(row, conv, state, ins, sbis, A_log, dt_bias, lb, R, conv_pins)
    for name, sh in (("f32", None), ("bf16shadow", shadow)):
        per_k = []
        for k in (range(1, L + 1) if ks is None else ks):
            cursor.fill_(k - 1)
            per_k.append(graph_time_us(replay(sh), R)[0])
        if ks is not None:
            row[f"{name}_us_at"] = dict(zip(ks, per_k))
            continue
        timing.spread_cursors(cursor, sbis, L)  # the serving-like launch: ~1/L of its rows flush
        mixed_us = graph_time_us(replay(sh), R)[0]
        mixed_ord_us = graph_time_us(replay(sh, ordered=True), R)[0]  # the same launch, ordered on the device
        timing.spread_cursors(cursor, sbis, L, flush_first=True)  # the same positions, flushing rows first
        mixed_ff_us = graph_time_us(replay(sh), R)[0]
        _, bk = costs.kda_bytes_per_position(H, K, V, L, shadow="bf16" if sh is not None else None)
        timing.add_replay_cycle(row, name, per_k, bk, batch, mixed_us, mixed_ff_us, mixed_ord_us)
        if ordered_cycle:  # the row-order module's lockstep cycle, its order made once before (a serving step's)
            layers = MODELS.get(geom.rsplit("_tp", 1)[0], (None,) * 4)[3]
            timing.time_ordered_cycle(row, name, cursor, L, order_all, replay(sh, ordered="pre"), R, layers)
        _bench_replay_bulk(row, name, sh, cursor, sbis, L, R, replay, y, k_cache, replay_bulk)
        row[f"{name}_bound_ratio"] = conv_b * batch / row[f"{name}_bytes_amortized"]
        row[f"{name}_pct_of_bound"] = 100 * row[f"{name}_speedup_vs_conv"] / row[f"{name}_bound_ratio"]
        if "fla_us" in row:
            row[f"{name}_speedup_vs_fla"] = row["fla_us"] / row[f"{name}_us_amortized"]
    if "fla_us" in row:
        row["tbps_fla"] = row["bytes_conv"] / row["fla_us"] / 1e6
        row["conv_speedup_vs_fla"] = row["fla_us"] / row["conv_us"]
    if vk:  # after the (K, V) rows, so the (V, K) replay's ratio to them is in the row
        rings = None if ks == [] else (k_cache, u_rings[None], g_cache, v_cache, beta_cache)
        _bench_vk(row, state, ins, sbis, A_log, dt_bias, lb, y, R, rings, cursor)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None, help="default: $GIT_COMMIT, else git HEAD")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--geoms", default="kimi_k3_tp8,glm5_3_flash_tp8")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--tag", default="kda-kernels")
    ap.add_argument("--fla-path", type=pathlib.Path, default=ROOT / "third_party" / "fla_peer")
    ap.add_argument("--ordered-cycle", action="store_true",
                    help="also each variant's lockstep cycle through its row-order module, the order made once before "
                         "the timed launches (a serving step makes it once for all layers): ro fields, the order's "
                         "share over the model's KDA layers included in ro x conv step")
    ap.add_argument("--sweep", default="", help="launch shapes col_lanes:warps[:resident],... timed at positions 1, "
                    "L/2, L for the first geometry at the smallest and largest batch (rows of kind 'sweep'); resident: "
                    "KDASpec.resident (threads an SM the register budget is set for), default the module's")
    ap.add_argument("--sweep-batches", default="", help="the sweep's batches (default: the smallest and largest)")
    ap.add_argument("--shadow-passes", type=int, default=1, help="KDASpec.passes of the bf16-shadow replay modules "
                    "(2: a block walks two chunks of its head; 1: the planner's)")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep rows (an A/B over another kernel tree)")
    ap.add_argument("--verify", type=int, default=0, help="T: verify rows (kind 'verify') at every geometry and batch")
    ap.add_argument("--vk", action="store_true", help="also the conventional step on a (V, K) state (the layout "
                    "experiment: fields conv_vk_*)")
    ap.add_argument("--vk-shapes", default="4:8:512", help="(V, K) replay launch shapes rt:warps:resident,... "
                    "(gdn.config.override pins) timed at positions 1, L/2, L beside the planned one")
    ap.add_argument("--conv-only", action="store_true", help="main rows of the conventional step(s) only (with --vk: "
                    "the layout experiment alone), no replay positions")
    ap.add_argument("--conv-resident", default="", help="also the conventional step's module at these "
                    "KDASpec.resident values (threads an SM its register budget is set for), comma-separated: fields "
                    "conv_r<N>_*, checked bit for bit against the planned module")
    ap.add_argument("--conv-bulk", default="", help="also the conventional step as a persistent stream (KDASpec.bulk) "
                    "at these launch shapes col_lanes:warps[:resident],... beside the one-shot step at the same shape: "
                    "fields conv_bulk<cl>x<w>_* (checked bit for bit against conv_<cl>x<w>, the one-shot step)")
    ap.add_argument("--replay-bulk", default="", help="also the standard decode as a persistent stream (KDASpec.bulk, "
                    "kda_replay_bulk) at these launch shapes col_lanes:warps[:resident],...: fields <name>_bulk<cl>x<w>_* "
                    "(its non-flush steps, the cycle estimated with the planned flush) and <name>_bulkf<cl>x<w>_* "
                    "(KDASpec.bulk_flush: the whole cycle and the mixed launch), each checked bit for bit against the "
                    "one-shot step at the same shape")
    ap.add_argument("--verify-resident", default="", help="also verify rows with these KDASpec.resident values "
                    "(threads an SM the register budget is set for), comma-separated")
    args = ap.parse_args()
    try:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--batches: expected comma-separated integers >= 1, got {args.batches!r}")
    geoms = [g for g in args.geoms.split(",") if g]
    bad = [g for g in geoms if g not in GEOMETRIES]
    if bad:
        ap.error(f"--geoms: expected names of {sorted(GEOMETRIES)}, got {bad}")
    if not 2 <= args.L <= 16:
        ap.error(f"--L: expected 2..16, got {args.L}")
    global FLA, VK_SHAPES, SHADOW_PASSES
    try:
        VK_SHAPES = [tuple(int(x) for x in t.split(":")) for t in args.vk_shapes.split(",") if t.strip()]
        if any(len(t) != 3 for t in VK_SHAPES):
            raise ValueError
    except ValueError:
        ap.error(f"--vk-shapes: expected rt:warps:resident,... got {args.vk_shapes!r}")
    try:
        conv_resident = tuple(int(x) for x in args.conv_resident.split(",") if x.strip())
        if any(r < 32 for r in conv_resident):
            raise ValueError
    except ValueError:
        ap.error(f"--conv-resident: expected comma-separated thread counts >= 32, got {args.conv_resident!r}")
    def stream_shapes(flag: str, text: str) -> tuple[tuple[int, ...], ...]:
        try:
            shapes = tuple(tuple(int(t) for t in x.split(":")) for x in text.split(",") if x.strip())
            if any(len(sh) not in (2, 3) for sh in shapes):
                raise ValueError
        except ValueError:
            ap.error(f"{flag}: expected col_lanes:warps[:resident],..., got {text!r}")
        return shapes

    conv_pins = conv_variants(conv_resident, stream_shapes("--conv-bulk", args.conv_bulk))
    replay_bulk = stream_shapes("--replay-bulk", args.replay_bulk)
    if not torch.cuda.is_available():  # after every flag's check
        sys.exit("bench_kda.py needs a CUDA GPU")
    FLA = load_fla(args.fla_path)
    if args.shadow_passes not in (1, 2):
        ap.error(f"--shadow-passes: expected 1 or 2, got {args.shadow_passes}")
    SHADOW_PASSES = args.shadow_passes
    ceiling = copy_ceiling_tbps()
    meta = dict(**timing.run_meta(commit=args.commit), copy_ceiling_tbps=ceiling, shadow_passes=SHADOW_PASSES,
                fla=None if FLA is None else json.loads((args.fla_path / "PEER.json").read_text()))
    print("RESULT_JSON " + json.dumps({"kind": "meta", **meta}), flush=True)
    rows, verify = [], []
    for geom in geoms:
        for b in ([] if args.sweep_only else batches):
            row = bench_point(geom, b, args.L, vk=args.vk, ks=[] if args.conv_only else None,
                              conv_pins=conv_pins, ordered_cycle=args.ordered_cycle, replay_bulk=replay_bulk)
            timing.add_ceiling_pcts(row, ceiling, names=() if args.conv_only else ("f32", "bf16shadow"))
            for tag, _, _ in conv_pins:
                row[f"pct_ceiling_conv_{tag}"] = 100 * row["bytes_conv"] / row[f"conv_{tag}_us"] / 1e6 / ceiling
            if args.vk:
                row["pct_ceiling_conv_vk"] = 100 * row["tbps_conv_vk"] / ceiling
            rows.append(row)
            print("RESULT_JSON " + json.dumps({"kind": "row", **row}), flush=True)
            if args.verify:
                for res in [0] + [int(x) for x in args.verify_resident.split(",") if x]:
                    with override(resident=res or None):
                        vrow = bench_verify(geom, b, args.verify, args.L, conv_us=row["conv_us"])
                    vrow["resident"] = res
                    for key in [k for k in vrow if k.startswith(("f32_tbps", "bf16shadow_tbps"))]:
                        vrow[key.replace("tbps", "pct_ceiling")] = 100 * vrow[key] / ceiling
                    verify.append(vrow)
                    print("RESULT_JSON " + json.dumps({"kind": "verify", **vrow}), flush=True)
    sweep = []
    sweep_batches = ([int(x) for x in args.sweep_batches.split(",") if x] if args.sweep_batches
                     else sorted({min(batches), max(batches)}))
    for item in [x for x in args.sweep.split(",") if x]:
        cl, w, *res = (int(t) for t in item.split(":"))
        for b in sweep_batches:
            try:
                with override(col_lanes=cl, warps=w, resident=res[0] if res else None):
                    row = bench_point(geoms[0], b, args.L, ks=[1, args.L // 2, args.L], peer=False)
            except ValueError as e:  # a shape this geometry cannot take
                row = dict(geom=geoms[0], batch=b, error=str(e)[:200])
            row["shape"] = [cl, w, *res]
            sweep.append(row)
            print("RESULT_JSON " + json.dumps({"kind": "sweep", **row}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date'][:10]}_{args.tag}_{meta['commit'][:10]}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows, "sweep": sweep, "verify": verify}, indent=1))
    print(f"# copy ceiling {ceiling:.2f} TB/s on {meta['device']}; results in {path}")
    print(f"{'geom':>16s} {'bs':>4s} {'conv us':>8s} {'%ceil':>5s} | {'f32 k1':>7s} {'flush':>7s} {'amort':>7s} "
          f"{'%ceil':>5s} {'x conv':>6s} {'%bnd':>5s} | {'sh k1':>7s} {'flush':>7s} {'amort':>7s} {'%ceil':>5s} "
          f"{'x conv':>6s} {'%bnd':>5s} | mixed us (x conv), ff: flushing rows first; f32, shadow")
    for r in (r for r in rows if "f32_us_k1" in r):
        print(f"{r['geom']:>16s} {r['batch']:4d} {r['conv_us']:8.1f} {r['pct_ceiling_conv']:5.1f} | "
              + " | ".join(f"{r[f'{n}_us_k1']:7.1f} {r[f'{n}_us_flush']:7.1f} {r[f'{n}_us_amortized']:7.1f} "
                           f"{r[f'{n}_pct_ceiling']:5.1f} {r[f'{n}_speedup_vs_conv']:6.2f} {r[f'{n}_pct_of_bound']:5.1f}"
                           for n in ("f32", "bf16shadow"))
              + " | " + timing.mixed_cells(r)
              + (f" | fla {r['fla_us']:7.1f} us (check {r['fla_check_rel']:.1e}) x fla {r['f32_speedup_vs_fla']:.2f}"
                 if "fla_us" in r else (f" | fla error {r['fla_error'][:80]}" if "fla_error" in r else ""))
              + (" | " + timing.ordered_cells(r) if "order_us" in r else ""))
    for r in rows:
        for key in sorted(k for k in r if k.endswith("_us_amortized_est")):
            tag = key[:-len("_us_amortized_est")]
            planned = r[tag.rsplit("_bulk", 1)[0] + "_us_amortized"]
            print(f"replay stream {tag} {r['geom']} bs{r['batch']}: k1 {r[f'{tag}_us_k'][0]:.1f} k{r['L'] - 1} "
                  f"{r[f'{tag}_us_k'][-1]:.1f} us, cycle with the planned flush {r[key]:.1f} us (x conv "
                  f"{r[f'{tag}_speedup_vs_conv_est']:.2f}; planned cycle {planned:.1f} us), bit-equal to the one-shot "
                  f"step {r[f'{tag}_bitequal']}")
        for key in sorted(k for k in r if k.endswith("_us_mixed") and "_bulkf" in k):
            tag = key[:-len("_us_mixed")]
            print(f"replay stream {tag} {r['geom']} bs{r['batch']}: k1 {r[f'{tag}_us_k'][0]:.1f} flush "
                  f"{r[f'{tag}_us_k'][-1]:.1f} amortized {r[f'{tag}_us_amortized']:.1f} us (x conv "
                  f"{r[f'{tag}_speedup_vs_conv']:.2f}), mixed {r[key]:.1f} us (x conv "
                  f"{r[f'{tag}_speedup_vs_conv_mixed']:.2f}), bit-equal to the one-shot step {r[f'{tag}_bitequal']}")
        for key in sorted(k for k in r if k.endswith("_error") and "_bulk" in k):
            print(f"replay stream {key[:-6]} {r['geom']} bs{r['batch']}: {r[key][:100]}")
        for tag, _, ref in conv_pins:
            print(f"conv {tag} {r['geom']} bs{r['batch']}: {r[f'conv_{tag}_us']:.1f} us "
                  f"({r[f'pct_ceiling_conv_{tag}']:.1f}% of the ceiling) vs planned {r['conv_us']:.1f} us "
                  f"({r['pct_ceiling_conv']:.1f}%): x{r[f'conv_{tag}_speedup']:.3f}, bit-equal to "
                  f"{'the ' + 'x'.join(str(ref[k]) for k in ('col_lanes', 'warps')) + ' one-shot step' if ref else 'planned'} "
                  f"{r[f'conv_{tag}_bitequal']}")
        if "conv_vk_us" in r:
            print(f"vk {r['geom']} bs{r['batch']}: (V, K) conventional {r['conv_vk_us']:.1f} us "
                  f"({r['pct_ceiling_conv_vk']:.1f}% of the ceiling) vs (K, V) {r['conv_us']:.1f} us "
                  f"({r['pct_ceiling_conv']:.1f}%): x{r['conv_vk_speedup']:.3f}; check y {r['conv_vk_check_y_rel']:.1e} "
                  f"state {r['conv_vk_check_state_rel']:.1e}")
        for pre in VK_OPS:
            if f"{pre}_f32_us_amortized" not in r:
                continue
            mid = r[f"{pre}_check_k{r['L'] // 2}_y_rel"]
            shapes = {n: [round(x, 1) for x in at.values()] for n, at in r[f"{pre}_f32_shapes_us_at"].items()}
            print(f"{pre} {r['geom']} bs{r['batch']}: (V, K) fp32 replay {r[f'{pre}_replay_geometry']} k1 "
                  f"{r[f'{pre}_f32_us_k1']:.1f} flush {r[f'{pre}_f32_us_flush']:.1f} amort "
                  f"{r[f'{pre}_f32_us_amortized']:.1f} us: x{r[f'{pre}_f32_speedup_vs_conv_vk']:.2f} its conventional, "
                  f"x{r[f'{pre}_f32_speedup_vs_conv']:.2f} the (K, V) conventional, "
                  f"x{r.get(f'{pre}_f32_speedup_vs_kv_f32', float('nan')):.2f} the (K, V) fp32 replay; at 1 / L/2 / L "
                  f"{shapes}; check {r[f'{pre}_check_flush_y_rel']:.1e} / {r[f'{pre}_check_flush_state_rel']:.1e} "
                  f"(flush), {mid:.1e} (k{r['L'] // 2})")
    for r in sweep:
        if "error" not in r:
            print(f"sweep {r['geom']} bs{r['batch']} {r['shape']}: conv {r['conv_us']:.1f} us, f32 k {r['f32_us_at']}, "
                  f"shadow k {r['bf16shadow_us_at']}")
    for r in verify:
        print(f"verify T{r['T']} r{r['resident']} {r['geom']} bs{r['batch']}: " + ", ".join(
            f"{n} m{m} {r[f'{n}_us_m{m}']:.1f} us ({r[f'{n}_pct_ceiling_m{m}']:.0f}%, x conv*T "
            f"{r.get(f'{n}_x_conv_T_m{m}', float('nan')):.2f})" for n in ("f32", "bf16shadow")
            for m in (0, r['L'] - 2 * r['T'], r['L'] - r['T'])))


if __name__ == "__main__":
    main()
