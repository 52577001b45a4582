# SPDX-License-Identifier: Apache-2.0
"""The whole GPU test suite in one command, on one card: warm the kernel cache, then the tests in parallel.

    python scripts/gpu_suite.py --out /tmp/suite           # on a machine with a CUDA GPU

1. Every kernel module the suite loads (``tests/gpu_kernel_specs.jsonl``, a spec log of an earlier run) is
   compiled by NVRTC in parallel on every core (``scripts/warm_kernels.py``), once, before any test starts;
   the tests then only read the disk cache.
2. ``pytest -m gpu`` under pytest-xdist (``--workers``); tests/conftest.py gives each worker its share of the
   cores for the float64 references, and appends each test's phases and seconds to ``test_times.tsv`` as
   they end (a run cut by a time limit still says where its time went).
3. The log (``gpu_suite.txt``: card, commit, date, counts, wall times, the slowest files and tests) and the
   spec log of this run; modules loaded that the list lacked are added to ``gpu_kernel_specs.jsonl`` in
   ``--out`` (copy it over ``tests/`` to keep the warm-up complete).

The exit status is pytest's. Commit the log under ``bench/results/<date>_gpu-suite-<card>_<commit>.txt``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.warm_kernels import read_specs, warm  # noqa: E402
from trtllm_replayssm import compile as _compile  # noqa: E402

SPEC_LIST = ROOT / "tests" / "gpu_kernel_specs.jsonl"


def commit() -> str:
    c = os.environ.get("GIT_COMMIT")
    if c:
        return c
    try:
        return subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def card() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"


def summarize_times(path: pathlib.Path, top: int = 15) -> list[str]:
    """The slowest test files and tests (all phases summed) of a test_times.tsv."""
    per_test: dict[str, float] = collections.defaultdict(float)
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 4:
                per_test[parts[0]] += float(parts[3])
    per_file: dict[str, float] = collections.defaultdict(float)
    for node, s in per_test.items():
        per_file[node.split("::")[0]] += s
    out = [f"test seconds summed over workers: {sum(per_test.values()):.1f}", "slowest files:"]
    out += [f"  {s:8.1f} s  {f}" for f, s in sorted(per_file.items(), key=lambda kv: -kv[1])[:top]]
    out.append("slowest tests:")
    out += [f"  {s:8.1f} s  {n}" for n, s in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True, help="directory for the log, times and spec log")
    ap.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="pytest-xdist workers (default: half the cores, at most 8)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes of the warm-up")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds after which pytest is interrupted (SIGINT: it still reports what ran), then killed")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. test files")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"--workers: expected >= 1, got {args.workers}")
    args.out.mkdir(parents=True, exist_ok=True)
    spec_log, times = args.out / "spec_log.jsonl", args.out / "test_times.tsv"
    for p in (spec_log, times):
        p.unlink(missing_ok=True)
    t0 = time.perf_counter()
    known = read_specs([SPEC_LIST]) if SPEC_LIST.exists() else []
    warm_s = warm(known, args.jobs)
    print(f"gpu_suite: warmed {len(known)} modules in {warm_s:.1f} s", flush=True)

    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfEs"]
    if args.workers > 1:
        cmd += ["-n", str(args.workers)]
    cmd += args.pytest_args
    env = dict(os.environ, **{_compile.SPEC_LOG_ENV: str(spec_log), "TRTLLM_REPLAYSSM_TEST_LOG": str(times)})
    t1 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = None
    if args.time_limit is not None:
        def stop():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        timer = threading.Timer(args.time_limit, stop)
        timer.daemon = True  # never keeps this process alive after pytest ends
        timer.start()
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    rc = proc.wait()
    if timer is not None:
        timer.cancel()
    pytest_s, total_s = time.perf_counter() - t1, time.perf_counter() - t0

    seen = read_specs([spec_log]) if spec_log.exists() else []
    new = [s for s in seen if s not in set(known)]
    (args.out / "gpu_kernel_specs.jsonl").write_text("".join(f"{s}\n" for s in sorted(set(known) | set(seen))))
    counts = next((ln.strip() for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), "no summary")
    head = [
        f"# GPU suite: {card()}, commit {commit()}, {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# command: python scripts/gpu_suite.py --workers {args.workers} --jobs {args.jobs} "
        + " ".join(args.pytest_args),
        f"# result: {counts}; pytest rc {rc}",
        f"# wall: {total_s:.1f} s in all = warm-up {warm_s:.1f} s ({len(known)} modules, {args.jobs} processes) "
        f"+ pytest {pytest_s:.1f} s ({args.workers} workers)",
        f"# modules loaded: {len(seen)}, of them not in tests/gpu_kernel_specs.jsonl: {len(new)}",
        *(f"# {ln}" for ln in summarize_times(times)),
        "",
    ]
    (args.out / "gpu_suite.txt").write_text("\n".join(head) + "".join(lines))
    print("\n".join(head))
    return rc


if __name__ == "__main__":
    sys.exit(main())
