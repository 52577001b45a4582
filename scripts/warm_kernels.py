# SPDX-License-Identifier: Apache-2.0
"""Compile ahead of time, in parallel, every kernel module a run will load, into the NVRTC disk cache.

NVRTC needs no GPU, and ``compile.compile_spec`` publishes each cache file atomically, so the tests or
benchmarks that follow only read the cache. The list of modules is a spec log: one JSON line per
``compile_spec`` call, written by any process run with ``TRTLLM_REPLAYSSM_SPEC_LOG=<file>`` set
(``tests/gpu_kernel_specs.jsonl`` is the GPU suite's, kept up to date by ``scripts/gpu_suite.py``).

    python scripts/warm_kernels.py tests/gpu_kernel_specs.jsonl --jobs 16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from trtllm_replayssm import compile as _compile  # noqa: E402


def read_specs(paths) -> list[str]:
    """The distinct spec lines of the logs ``paths``, in first-seen order; a malformed line fails by file and line."""
    lines: dict[str, None] = {}
    for path in paths:
        for i, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                spec, target = _compile.spec_from_json(line)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{i}: not a spec line ({e})") from None
            lines.setdefault(_compile.spec_to_json(spec, target), None)
    return list(lines)


def _compile_line(line: str) -> tuple[str, float]:
    spec, target = _compile.spec_from_json(line)
    t0 = time.perf_counter()
    _compile.compile_spec(spec, target)
    return f"{spec.key}.{target}", time.perf_counter() - t0


def warm(lines, jobs: int) -> float:
    """Compile ``lines`` with ``jobs`` processes; returns the wall time in seconds."""
    t0 = time.perf_counter()
    if jobs <= 1:
        for line in lines:
            _compile_line(line)
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            for _ in pool.map(_compile_line, lines, chunksize=1):
                pass
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=pathlib.Path, help="spec logs (JSON lines of compile.spec_to_json)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: all cores)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs: expected >= 1, got {args.jobs}")
    for path in args.logs:
        if not path.is_file():
            ap.error(f"logs: {path} is not a file")
    lines = read_specs(args.logs)
    seconds = warm(lines, args.jobs)
    print(f"warm_kernels: {len(lines)} modules in {seconds:.1f} s with {args.jobs} processes (cache {_compile.cache_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
