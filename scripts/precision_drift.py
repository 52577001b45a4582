#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Output error against a float64 recurrence, step by step, for each way of storing the state.

Variants (all computed in float64; only what is *stored* is rounded, as the kernels store it):
  conv_fp32           conventional step, state re-rounded to fp32 every step
  conv_bf16           conventional step, state re-rounded to bf16 every step (errors compound)
  replay_fp32         ReplaySSM, fp32 checkpoint rounded at each flush
  replay_bf16_shadow  ReplaySSM, fp32 checkpoint + bf16 shadow read by the output form
  replay_fp8_shadow   ReplaySSM, fp32 checkpoint + fp8-e4m3 shadow, fp32 scale per (head, row)
  replay_bf16         ReplaySSM, the checkpoint itself stored in bf16 at each flush
  replay_fp8_ckpt_rne ReplaySSM, 8-bit checkpoint (shadow.Checkpoint8: fp8-e4m3, fp32 scale per (head, row),
                      no fp32 copy), round to nearest even at each flush
  replay_fp8_ckpt_sr  the same with stochastic rounding (seeded counter-based hash)
The shadow is rewritten from the fp32 checkpoint at every flush, so its error should not grow
with the step count (docs/DESIGN.md §1). A low-precision checkpoint is folded from its own rounded
values, so its error can accumulate: that is what the 8-bit rows measure.
Scale granularity (``granularity``): at every flush, the float64 state quantised to e4m3 (RNE) with one
scale per (head, row p) and with one per (head, column n): relative Frobenius error of each.
Inputs: x, B, C ~ N(0, 1) (B, C scaled by 4/sqrt(N)) rounded to bf16 once and shared by every variant;
dt = softplus(N(-2, 1)) (dt_bias = 0); A = -U[1, 16] (Nemotron-H's A_log = log U[1, 16] init; ``--a-range``
for slow-decaying heads); D ~ N(1, 0.5).

``--family kda``: the same question for Kimi Delta Attention (families/kda/reference.py, DESIGN §5), one head group
of K = V = 128 (GLM-5.3-Flash's / Kimi's head size), L = 16, variants (float64 math, stored as the kernels store):
  conv_fp32           conventional step, state (H, K, V) re-rounded to fp32 every step
  conv_bf16           conventional step, state re-rounded to bf16 every step
  replay_fp32         ReplaySSM: fp32 checkpoint (the exact fold at each flush), bf16 u ring, bf16 k / v rings
  replay_bf16_shadow  the same with a bf16 shadow of the checkpoint that the non-flush steps read (rewritten from
                      the fp32 checkpoint at each flush)
  replay_fp32_uring   replay_fp32 with an fp32 u ring (not built: the KDA u-sum flush's ring, bench/NOTES.md)
Inputs: q, k, v ~ N(0, 1), f ~ N(0, 1), b ~ N(0, 1), rounded to bf16 once and shared; ``--gate kimi``
(g = -exp(A_log) softplus(f + dt_bias), A_log = log U[1, 16]) or ``glm`` (g = -5 sigmoid(exp(A_log) (f + dt_bias)),
A_log ~ U[-1, 1]); dt_bias = inverse softplus of dt ~ logU[1e-3, 1e-1] per channel (fla's KDA init).

Usage: python scripts/precision_drift.py [--family mamba2|kda] [--gate kimi|glm] [--steps 4096] [--out bench/results]
       [--plot]
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

from trtllm_replayssm import cursor as cursors  # noqa: E402
from trtllm_replayssm import shadow as shadowq  # noqa: E402
from trtllm_replayssm.families.kda import reference as kref  # noqa: E402
from trtllm_replayssm.families.mamba2 import reference as ref  # noqa: E402

F64 = torch.float64
VARIANTS = ("conv_fp32", "conv_bf16", "replay_fp32", "replay_bf16_shadow", "replay_fp8_shadow", "replay_bf16",
            "replay_fp8_ckpt_rne", "replay_fp8_ckpt_sr")
# stored checkpoint of each replay variant: (full-precision dtype or None, shadow kind, 8-bit rounding)
REPLAY = {"replay_fp32": (torch.float32, None, None), "replay_bf16_shadow": (torch.float32, "bf16", None),
          "replay_fp8_shadow": (torch.float32, "fp8", None), "replay_bf16": (torch.bfloat16, None, None),
          "replay_fp8_ckpt_rne": (None, None, "rne"), "replay_fp8_ckpt_sr": (None, None, "sr")}


def granularity_error(S: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius error of e4m3 (RNE) quantisation of S (H, P, N) with a scale per (head, row p)
    and per (head, column n) (the scales' fp32 bytes per head: 4 P and 4 N)."""
    out = {}
    for name, T in (("per_row", S), ("per_col", S.transpose(1, 2))):
        q = torch.empty(T.shape, dtype=torch.float8_e4m3fn)
        sc = torch.empty(T.shape[:-1])
        shadowq.quantize_shadow(T, q, sc)
        back = q.double() * sc.double()[..., None]
        out[name] = float((back - T).norm() / T.norm())
    return out


def drift(steps=4096, H=8, P=64, N=128, G=2, L=16, seed=0, granularity=False,
          a_range=(1.0, 16.0)) -> dict[str, list[float]]:
    """Relative output error ||y - y64|| / ||y64|| per step for every variant (and with ``granularity`` the mean
    relative quantisation error of the float64 state at each flush, per row and per column scales, under
    ``"_granularity"``)."""
    gen = torch.Generator().manual_seed(seed)
    A = -(torch.rand(H, generator=gen, dtype=F64) * (a_range[1] - a_range[0]) + a_range[0])
    D = torch.randn(H, generator=gen, dtype=F64) * 0.5 + 1
    dt_bias = torch.zeros(H, dtype=F64)
    sbi = torch.tensor([0], dtype=torch.int32)
    S0 = torch.zeros(1, H, P, N, dtype=F64)
    exact = S0.clone()
    conv = {"conv_fp32": (S0.clone(), torch.float32), "conv_bf16": (S0.clone(), torch.bfloat16)}
    replay = {}
    for name, (store, kind, rounding) in REPLAY.items():
        caches = (None if store is None else S0.clone(), torch.zeros(1, H, L, P, dtype=F64),
                  torch.zeros(1, G, L, N, dtype=F64), torch.zeros(1, H, L, dtype=F64), torch.zeros(1, dtype=torch.int32))
        ck = None if rounding is None else shadowq.Checkpoint8.of(S0, rounding, seed=seed)
        replay[name] = (caches, None if kind is None else shadowq.Shadow.of(caches[0], kind), ck, store)
    errs = {v: [] for v in VARIANTS}
    gran = {"per_row": [], "per_col": []}

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen, dtype=F64) * scale + shift).to(torch.bfloat16).to(F64)

    for _ in range(steps):
        x, B, C = rnd(1, H, P), rnd(1, G, N, scale=4 / N**0.5), rnd(1, G, N, scale=4 / N**0.5)
        dt = rnd(1, H, shift=-2.0)
        y64 = ref.conventional_step(exact, x, B, C, dt, dt_bias, A, D, None, sbi)
        norm = float(y64.norm())
        for name, (S, store) in conv.items():
            y = ref.conventional_step(S, x, B, C, dt, dt_bias, A, D, None, sbi)
            S.copy_(S.to(store).to(F64))
            errs[name].append(float((y - y64).norm()) / norm)
        for name, ((S, xc, Bc, dtc, cur), shadow, ck, store) in replay.items():
            flushing = int(cur[0]) == L - 1
            y = ref.replay_decode(S, xc, Bc, dtc, cur, x, B, C, dt, dt_bias, A, D, None, sbi, shadow, ck)
            if flushing and S is not None:  # the kernel stores the new checkpoint in its dtype, the shadow from it
                S.copy_(S.to(store).to(F64))
                if shadow is not None:
                    shadow.write(0, S[0])
            cursors.advance_cursor(cur, sbi, L, None if ck is None else ck.flushes)
            errs[name].append(float((y - y64).norm()) / norm)
        if granularity and int(replay["replay_fp32"][0][4][0]) == 0 and float(exact.abs().max()) > 0:
            for k, v in granularity_error(exact[0]).items():
                gran[k].append(v)
    if granularity:
        errs["_granularity"] = {k: sum(v) / len(v) for k, v in gran.items()}
    return errs


KDA_VARIANTS = ("conv_fp32", "conv_bf16", "replay_fp32", "replay_bf16_shadow", "replay_fp32_uring")
GATES = {"kimi": None, "glm": -5.0}  # the gate's lower bound (None: Kimi's softplus gate)


def kda_gate_params(H: int, K: int, gate: str, gen: torch.Generator):
    """(A_log (H,), dt_bias (H, K), lower bound) of a KDA layer for ``gate`` (module docstring: Kimi's A_log =
    log U[1, 16] or GLM-5 Next's U[-1, 1]; dt_bias the inverse softplus of dt ~ logU[1e-3, 1e-1], fla's init), fp32
    as the models keep them; drawn from ``gen`` in that order."""
    if gate not in GATES:
        raise ValueError(f"gate: expected one of {sorted(GATES)}, got {gate!r}")
    lower = GATES[gate]
    A_log = (torch.rand(H, generator=gen, dtype=F64) * 2 - 1 if lower is not None
             else torch.log(torch.rand(H, generator=gen, dtype=F64) * 15 + 1))
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(torch.rand(H, K, generator=gen, dtype=F64) * (hi - lo) + lo)
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).float()  # inverse softplus
    return A_log.float(), dt_bias, lower


def drift_kda(steps=4096, H=2, K=128, V=128, L=16, seed=0, gate="glm") -> dict[str, list[float]]:
    """Relative output error ||y - y64|| / ||y64|| per step of the KDA variants (module docstring) against the
    float64 conventional recurrence on the same bf16 inputs."""
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias, lower = kda_gate_params(H, K, gate, gen)
    sbi = torch.tensor([0], dtype=torch.int32)
    exact = torch.zeros(1, H, K, V, dtype=F64)
    conv = {"conv_fp32": torch.zeros(1, H, K, V, dtype=torch.float32),
            "conv_bf16": torch.zeros(1, H, K, V, dtype=torch.bfloat16)}
    replay = {}
    for name in ("replay_fp32", "replay_bf16_shadow", "replay_fp32_uring"):
        # fp32 checkpoint, bf16 k / u / v rings, fp32 g / beta (the table); the last with an fp32 u ring
        buf = kref.KDABuffers.alloc(1, H, K, V, L, ring=torch.float32 if name.endswith("uring") else torch.bfloat16)
        shadow = shadowq.Shadow.of(buf.state, "bf16") if name.endswith("shadow") else None
        replay[name] = (buf, shadow, torch.zeros(1, dtype=torch.int32))
    errs = {v: [] for v in KDA_VARIANTS}

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(torch.bfloat16)

    for _ in range(steps):
        q, k, v, f, b = rnd(1, H, K), rnd(1, H, K), rnd(1, H, V), rnd(1, H, K), rnd(1, H)
        args = (q, k, v, f, b, A_log, dt_bias, sbi)
        y64 = kref.conventional_step(exact, *args, lower_bound=lower)
        norm = float(y64.norm())
        for name, S in conv.items():
            y = kref.conventional_step(S, *args, lower_bound=lower)
            errs[name].append(float((y - y64).norm()) / norm)
        for name, (buf, shadow, cur) in replay.items():
            y = kref.replay_decode(buf, cur, *args, shadow=shadow, lower_bound=lower)
            cursors.advance_cursor(cur, sbi, L)
            errs[name].append(float((y - y64).norm()) / norm)
    return errs


def summary(errs: dict[str, list[float]], window: int = 1024) -> dict[str, dict[str, float]]:
    return {v: {"first_max": max(e[:window]), "last_max": max(e[-window:]), "mean": sum(e) / len(e),
                "growth": max(e[-window:]) / max(e[:window])} for v, e in errs.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    ap.add_argument("--a-range", type=float, nargs=2, default=(1.0, 16.0),
                    help="-A ~ U[lo, hi] (default Nemotron-H's init; small values: slow decay, long memory, where a "
                         "low-precision checkpoint's rounding errors accumulate across flushes)")
    ap.add_argument("--name", default=None, help="base name of the JSON / PNG written under --out (default: "
                                                 "precision_drift, or precision_drift_kda_<gate> for --family kda)")
    ap.add_argument("--family", choices=sorted(EXPERIMENTS), default="mamba2")
    ap.add_argument("--gate", choices=sorted(GATES), default="glm", help="--family kda: the forget gate (GLM-5 Next's "
                                                                         "bounded gate or Kimi's softplus gate)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    EXPERIMENTS[args.family](args)


def main_mamba2(args) -> None:
    args.name = args.name or "precision_drift"
    errs = drift(args.steps, granularity=True, a_range=tuple(args.a_range))
    gran = errs.pop("_granularity")
    summ = summary(errs, min(1024, args.steps // 4))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    every = max(1, args.steps // 512)
    (out / f"{args.name}.json").write_text(json.dumps(
        {"steps": args.steps, "geometry": [8, 64, 128, 2], "buffer_len": 16, "a_range": list(args.a_range),
         "summary": summ,
         "granularity": {**gran, "scale_bytes_per_head": {"per_row": 4 * 64, "per_col": 4 * 128},
                         "checkpoint_bytes_per_head": 64 * 128},
         "every": every, "errors": {v: e[::every] for v, e in errs.items()}}, indent=1))
    for v, s in summ.items():
        print(f"{v:20s} first-1024 max {s['first_max']:.3e}  last-1024 max {s['last_max']:.3e}  growth {s['growth']:.2f}")
    if args.plot:
        _plot(errs, out / f"{args.name}.png", f"ReplaySSM output error vs float64 recurrence (H=8, P=64, N=128, L=16, "
                                              f"-A ~ U{list(args.a_range)})")


def _provenance() -> dict:
    import datetime
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"date": datetime.date.today().isoformat(), "commit": commit,
            "device": "cpu (float64 reference, families/kda/reference.py)"}


def main_kda(args) -> None:
    H, K, V, L = 2, 128, 128, 16
    errs = drift_kda(args.steps, H, K, V, L, gate=args.gate)
    window = min(1024, args.steps // 4)
    summ = summary(errs, window)
    name = args.name or f"precision_drift_kda_{args.gate}"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    every = max(1, args.steps // 512)
    (out / f"{name}.json").write_text(json.dumps(
        {**_provenance(), "family": "kda", "gate": args.gate, "lower_bound": GATES[args.gate], "steps": args.steps,
         "geometry": {"H": H, "K": K, "V": V}, "buffer_len": L, "summary_window": window, "summary": summ,
         "every": every, "errors": {v: e[::every] for v, e in errs.items()}}, indent=1))
    for v, s in summ.items():
        print(f"{v:20s} first-{window} max {s['first_max']:.3e}  last-{window} max {s['last_max']:.3e}  "
              f"mean {s['mean']:.3e}  growth {s['growth']:.2f}")
    if args.plot:
        _plot(errs, out / f"{name}.png", f"KDA ReplaySSM output error vs float64 recurrence (H={H}, K=V={K}, L={L}, "
                                         f"{args.gate} gate)")


def _plot(errs, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    win = 64  # the error within a flush cycle is a sawtooth; plot its envelope
    for v, e in errs.items():
        env = [max(e[i:i + win]) for i in range(0, len(e), win)]
        ax.semilogy([i + win for i in range(0, len(e), win)], env, label=v, lw=1.2)
    ax.set_xlabel("decode step")
    ax.set_ylabel(f"max over {win} steps of ||y - y_float64|| / ||y_float64||")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


EXPERIMENTS = {"mamba2": main_mamba2, "kda": main_kda}  # --family: each family's drift experiment (its own reference)


if __name__ == "__main__":
    main()

