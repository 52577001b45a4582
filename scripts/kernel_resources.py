#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Offline resource report of the decode kernels: registers, spills, local arrays and static shared memory
of each entry that ptxas builds from our NVRTC PTX, for the planned (or pinned) launch shapes. No GPU.

The numbers a kernel experiment needs before it costs device time (bench/NOTES.md quotes them: "Register
budget of the one-shot shadow step", "Next for the shadow steps"): the register cap a variant's
``min_blocks`` sets, the bytes it spills, and whether an array went to local memory (a stack frame beyond the
spill slots). ptxas comes from the CUDA toolkit on PATH; when it is older than NVRTC, the PTX's ``.version``
line is lowered to what ptxas reads (the kernels use no newer PTX feature; ptxas says so if they do).

Usage:
  python scripts/kernel_resources.py                                   # main geometry, every shadow, bs 1/64/256
  python scripts/kernel_resources.py --shadows fp8 --geometries "64x8;64x4" \\
         --variants "kind=staged,min_blocks=8,flush_rows=2;kind=staged,min_blocks=12,flush_rows=2"
  python scripts/kernel_resources.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtllm_replayssm import config  # noqa: E402
from trtllm_replayssm.compile import compile_spec  # noqa: E402
from trtllm_replayssm.geometries import GEOMETRIES  # noqa: E402

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_VERSION = re.compile(rb"^\.version (\d+)\.(\d+)", re.M)
_PTXAS_MAX = re.compile(r"current version is '(\d+)\.(\d+)'")


def parse_ptxas(log: str) -> dict[str, dict]:
    """{entry: {registers, stack_frame, spill_stores, spill_loads, smem}} from ``ptxas -v`` output."""
    out, cur = {}, None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = out.setdefault(m.group(1), dict(registers=0, stack_frame=0, spill_stores=0, spill_loads=0, smem=0))
            continue
        if cur is None:
            continue
        if m := _FRAME.search(line):
            cur.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        if m := _USED.search(line):
            cur["registers"] = int(m.group(1))
        if m := _SMEM.search(line):
            cur["smem"] = int(m.group(1))
    return out


def ptxas_report(ptx: bytes, arch: int, ptxas: str = "ptxas") -> dict[str, dict]:
    """Run ``ptxas -v`` on ``ptx`` for sm_<arch>; lowers the ``.version`` line once if ptxas is older."""
    with tempfile.TemporaryDirectory() as d:
        src = pathlib.Path(d) / "k.ptx"
        for _ in range(2):
            src.write_bytes(ptx)
            r = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", str(src), "-o", str(pathlib.Path(d) / "k.cubin")],
                               capture_output=True, text=True)
            m = _PTXAS_MAX.search(r.stderr)
            if r.returncode == 0 or m is None:
                break
            ptx = _VERSION.sub(f".version {m.group(1)}.{m.group(2)}".encode(), ptx, count=1)
        if r.returncode:
            raise RuntimeError(f"ptxas failed for sm_{arch}:\n{r.stderr[-2000:]}")
    return parse_ptxas(r.stderr)


def local_arrays(entry: dict) -> int:
    """Bytes of the stack frame beyond the spill slots: arrays the compiler put in local memory (a few bytes
    of alignment padding show up here too; an array shows up as tens of bytes)."""
    return max(0, entry["stack_frame"] - entry["spill_stores"])


def report(spec: config.KernelSpec, ptxas: str = "ptxas") -> dict:
    res = ptxas_report(compile_spec(spec, "ptx"), spec.arch, ptxas)
    dec = res.get("replayssm_decode") or res.get("replayssm_verify") or next(iter(res.values()))
    return dict(key=spec.key, rows=spec.rows, warps=spec.warps, variant=dataclasses.asdict(spec.variant),
                shadow=spec.shadow, blocks_per_sm=spec.blocks_per_sm, **dec, local_array_bytes=local_arrays(dec),
                entries=res)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geom", default="nemotron_h_8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--state", default="f32")
    ap.add_argument("--act", default="bf16")
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--shadows", default="none,bf16,fp8")
    ap.add_argument("--batches", default="1,64,256", help="plans at these batch sizes (ignored for pinned shapes)")
    ap.add_argument("--geometries", default="", help='pinned "rows x warps" shapes, ";"-separated, e.g. "64x8;64x4"')
    ap.add_argument("--variants", default="", help='pinned variants, ";"-separated (config.parse_variant syntax)')
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--ptxas", default=shutil.which("ptxas") or "ptxas")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    H, P, N, G = GEOMETRIES[args.geom]
    variants = [config.parse_variant(v, "--variants") for v in args.variants.split(";") if v.strip()] or [None]
    shapes = [tuple(int(x) for x in g.split("x")) for g in args.geometries.split(";") if g] or [None]
    rows = []
    print(f"{'shadow':6s} {'batch':>5s} {'shape':>8s} {'variant':32s} {'blk/SM':>6s} {'regs':>4s} {'spill st/ld':>11s} "
          f"{'local':>5s} {'smem':>6s}")
    for shadow in [s for s in args.shadows.split(",") if s]:
        for v in variants:
            for shape in shapes:
                for batch in [int(b) for b in args.batches.split(",") if b] if shape is None else [256]:
                    with config.override_variant(v), (config.override_geometry(*shape) if shape
                                                      else contextlib.nullcontext()):
                        r_, w_, var = config.plan(args.state, args.act, H, P, N, args.buffer_len, batch, False, shadow)
                    spec = config.KernelSpec(args.state, args.act, H, P, N, G, args.buffer_len, r_, w_, False,
                                             args.arch, variant=var, shadow=shadow)
                    row = dict(batch=batch if shape is None else None, **report(spec, args.ptxas))
                    rows.append(row)
                    name = var.kind + "".join(f",{k}={x}" for k, x in dataclasses.asdict(var).items()
                                              if k != "kind" and x is not None)
                    print(f"{shadow:6s} {str(row['batch'] or '-'):>5s} {f'R{r_} W{w_}':>8s} {name:32s} "
                          f"{spec.blocks_per_sm:6d} {row['registers']:4d} {row['spill_stores']:5d}/{row['spill_loads']:<5d} "
                          f"{row['local_array_bytes']:5d} {row['smem']:6d}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
