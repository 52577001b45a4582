#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""How precise must the KDA flush's two GEMMs be? The checkpoint's error over many flush cycles, per GEMM precision.

The exact fold (the bf16-shadow modules' flush, bench/NOTES.md "Twenty-third session") is FFMA-bound: per flush and
chunk of value columns, the dots B = S^T W (W's column j: P_j * k_j, the decayed key of entry j) and the rank-m
update S <- P_m * S + D U^T (D's column j: (P_m / P_j) * k_j, U's row j: u_j) are two small GEMMs, ~2 x m x K x V
FMAs. On tensor cores they would be cheap, but in TF32 (10 mantissa bits) or split TF32 (3xTF32: a = hi + lo,
hi*hi + hi*lo + lo*hi). Unlike the output path, the checkpoint is folded from its own stored value every cycle, so
a GEMM's rounding accumulates: this measures how much, before any kernel is written.

Per cycle of L - 1 = m entries (k, v, f, b ~ N(0, 1) rounded to bf16 once; Kimi's or GLM-5 Next's gate, fla's
dt_bias init, as scripts/precision_drift.py --family kda), the checkpoint S (H, K, V) stored in fp32 is folded by
the chunked WY form (chunks of ``--chunk`` entries, the kernel's 4 by default) with the GEMMs in:
  fp64    every operation in float64, the result stored in fp32 (the storage rounding alone)
  fp32    fp32 operands, products and sums (the shipped kernel's arithmetic, in another summation order)
  3xtf32  GEMM operands split into TF32 hi + lo (round to nearest, ties away, as cvt.rna.tf32.f32), three products,
          accumulated in fp32; the rest in fp32
  tf32    GEMM operands rounded to TF32 once, accumulated in fp32; the rest in fp32
against the float64 sequential recurrence (families/kda/reference.py ``_fold``, the spec's) from the same inputs.
Reported per cycle: the relative Frobenius error of the checkpoint and of the output S^T q' of a random query.
Tensor cores accumulate in fp32 (the emulation sums products in float64 and rounds the GEMM's result to fp32 once,
which is at least as precise as the hardware's accumulation).

Usage: python scripts/precision_fold_gemm.py [--gate kimi|glm] [--cycles 256] [--chunk 4] [--out bench/results]
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

from precision_drift import GATES, kda_gate_params  # noqa: E402  (the KDA layer parameters of the drift runs)

from trtllm_replayssm import timing  # noqa: E402
from trtllm_replayssm.families.kda import reference as kref  # noqa: E402

F64, F32 = torch.float64, torch.float32
MODES = ("fp64", "fp32", "3xtf32", "tf32")


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to TF32 (10 explicit mantissa bits), to nearest with ties away from zero
    (cvt.rna.tf32.f32): add half an ulp of the kept bits to the magnitude's bit pattern, clear the dropped 13 bits.
    Infinities and NaNs are left alone."""
    x = x.to(F32).contiguous()
    bits = x.view(torch.int32)
    rounded = ((bits + 0x1000) & ~0x1FFF).view(F32)
    return torch.where(torch.isfinite(x), rounded, x)


def gemm(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """a @ b (batched over heads) in ``mode``'s precision (module docstring); the result in fp32 (fp64 for fp64)."""
    if mode == "fp64":
        return a.to(F64) @ b.to(F64)
    if mode == "fp32":
        return a.to(F32) @ b.to(F32)
    if mode == "tf32":
        return (tf32(a).to(F64) @ tf32(b).to(F64)).to(F32)
    if mode == "3xtf32":
        ah, bh = tf32(a), tf32(b)
        al, bl = tf32(a.to(F32) - ah), tf32(b.to(F32) - bh)
        return (ah.to(F64) @ bh.to(F64) + ah.to(F64) @ bl.to(F64) + al.to(F64) @ bh.to(F64)).to(F32)
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def wy_fold(S, ks, vs, gs, betas, mode: str, chunk: int = 4) -> torch.Tensor:
    """S (H, K, V) folded over m entries (ks (H, m, K) normalised, vs (H, m, V), gs (H, m, K) log-decays, betas
    (H, m)) by the chunked WY form: per chunk, B = S^T W, the forward substitution for u, S <- P_end S + D U^T.
    ``mode`` sets the GEMMs' precision; everything else runs in float64 for fp64, else in fp32."""
    dt = F64 if mode == "fp64" else F32
    S = S.to(dt)
    ks, vs, gs, betas = ks.to(dt), vs.to(dt), gs.to(dt), betas.to(dt)
    m = vs.shape[1]
    for c0 in range(0, m, chunk):
        sl = slice(c0, min(m, c0 + chunk))
        k, v, beta = ks[:, sl], vs[:, sl], betas[:, sl]  # (H, c, K), (H, c, V), (H, c)
        logP = torch.cumsum(gs[:, sl], dim=1)  # (H, c, K): sum_{l <= j} g_l within the chunk
        W = torch.exp(logP) * k  # (H, c, K): P_j * k_j
        B = gemm(W, S, mode).to(dt)  # (H, c, V): (S^T W)^T
        c = k.shape[1]
        U = torch.zeros_like(v)
        for j in range(c):
            t = v[:, j] - B[:, j]
            for i in range(j):
                a_ji = (k[:, i] * torch.exp(logP[:, j] - logP[:, i]) * k[:, j]).sum(-1)  # k_i . (P_j / P_i) k_j
                t = t - a_ji[:, None] * U[:, i]
            U[:, j] = beta[:, j, None] * t
        D = torch.exp(logP[:, -1:] - logP) * k  # (H, c, K): (P_end / P_j) * k_j
        S = torch.exp(logP[:, -1])[:, :, None] * S + gemm(D.transpose(1, 2), U, mode).to(dt)
    return S


def run(cycles: int = 256, H: int = 2, K: int = 128, V: int = 128, L: int = 16, gate: str = "kimi", chunk: int = 4,
        seed: int = 0, modes=MODES) -> dict[str, dict[str, list[float]]]:
    """Per mode: the relative checkpoint error ("state") and output error ("y") after each of ``cycles`` folds of
    L - 1 entries, against the float64 sequential recurrence."""
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias, lower = kda_gate_params(H, K, gate, gen)
    m = L - 1

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(torch.bfloat16)

    exact = torch.zeros(H, K, V, dtype=F64)
    states = {mode: torch.zeros(H, K, V, dtype=F32) for mode in modes}
    out = {mode: {"state": [], "y": []} for mode in modes}
    for _ in range(cycles):
        k, v, f, b = rnd(m, H, K), rnd(m, H, V), rnd(m, H, K), rnd(m, H)
        g, beta = kref.gates(f, b, A_log, dt_bias, lower_bound=lower)  # (m, H, K), (m, H)
        ks = kref.prep_k(k).transpose(0, 1)  # (H, m, K)
        vs, gs, betas = v.to(F64).transpose(0, 1), g.transpose(0, 1), beta.transpose(0, 1)
        exact = kref._fold(exact, ks, vs, gs, betas)
        q = kref.prep_k(rnd(H, K))
        y64 = torch.einsum("hkv,hk->hv", exact, q)
        for mode in modes:
            states[mode] = wy_fold(states[mode], ks, vs, gs, betas, mode, chunk).to(F32)  # the fp32 checkpoint
            S = states[mode].to(F64)
            out[mode]["state"].append(float((S - exact).norm() / exact.norm()))
            out[mode]["y"].append(float((torch.einsum("hkv,hk->hv", S, q) - y64).norm() / y64.norm()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gate", choices=sorted(GATES), default="kimi")
    ap.add_argument("--cycles", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=4, help="entries a chunk of the WY form (the kernel's kC = 4; 15: "
                    "one chunk, every dot against the checkpoint)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.cycles < 1 or args.chunk < 1:
        ap.error(f"--cycles and --chunk: expected >= 1, got {args.cycles}, {args.chunk}")
    torch.set_num_threads(1)
    res = run(args.cycles, gate=args.gate, chunk=args.chunk)
    summ = {}
    for mode, r in res.items():
        summ[mode] = {}
        for what in ("state", "y"):
            e = r[what]
            summ[mode].update({f"{what}_first16_max": max(e[:16]), f"{what}_max": max(e), f"{what}_last": e[-1]})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"precision_fold_gemm_{args.gate}_c{args.chunk}.json"
    path.write_text(json.dumps({**timing.run_meta("cpu"), "gate": args.gate, "chunk": args.chunk,
                                "cycles": args.cycles, "H": 2, "K": 128, "V": 128, "L": 16, "summary": summ,
                                "errors": res}, indent=1))
    for mode, s in summ.items():
        print(f"{mode:7s} state: first-16 max {s['state_first16_max']:.2e}, max {s['state_max']:.2e}, last "
              f"{s['state_last']:.2e} | y: max {s['y_max']:.2e}, last {s['y_last']:.2e}")
    print(f"# {path}")


if __name__ == "__main__":
    main()
