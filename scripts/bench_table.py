#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Markdown table of a bench_kernels.py result file (for README.md and issue notes).

Usage: python scripts/bench_table.py bench/results/2026-12-02_kernels_<commit>.json
"""

import json
import sys


def table(path: str) -> str:
    d = json.load(open(path))
    m = d["meta"]
    out = [f"{m['device']}, {m['date']}, commit {m['commit']}, copy ceiling {m['copy_ceiling_tbps']:.2f} TB/s "
           "(bf16 activations; ReplaySSM amortized over one flush cycle)", "",
           "| geometry | state | shadow | L | batch | conventional µs (% ceil) | replay k=1 µs | flush µs | replay "
           "amortized µs (% ceil) | vs conventional | mamba_ssm µs | vs mamba_ssm |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        mam = r.get("mamba_us")
        out.append(
            f"| {r['geom']} | {r['state']} | {r.get('shadow', 'none')} | {r['L']} | {r['batch']} | "
            f"{r['conv_us']:.1f} ({r['pct_ceiling_conv']:.0f}%) | "
            f"{r['replay_us_k1']:.1f} | {r['replay_us_flush']:.1f} | {r['replay_us_amortized']:.1f} "
            f"({r['pct_ceiling_replay']:.0f}%) | {r['speedup_vs_conv']:.2f}x | "
            + (f"{mam:.1f} | {r['speedup_vs_mamba']:.2f}x |" if mam else "- | - |"))
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    print(table(sys.argv[1]))
