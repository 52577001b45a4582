# SPDX-License-Identifier: Apache-2.0
"""PTX identity of two kernel trees: compile every spec of a spec list with NVRTC and hash the output.

A refactor of ``plugins/`` or of the spec code (moving headers into family folders, sharing a helper) should
change no machine code. This compiles each spec of the given spec lists (JSON lines of
``compile.spec_to_json``: ``tests/gpu_kernel_specs.jsonl``, or a log a test run wrote with
``TRTLLM_REPLAYSSM_SPEC_LOG``) without the disk cache and writes ``{spec key/target: sha256}``; ``--compare``
reads another tree's file and lists every spec whose output differs or that one tree cannot compile.

Run it once per tree, with that tree first on ``PYTHONPATH`` (the spec classes and compile.py of the tree)::

    PYTHONPATH=/tmp/old python scripts/ptx_identity.py specs.jsonl --arch 90,100 --out old.json
    PYTHONPATH=$PWD python scripts/ptx_identity.py specs.jsonl --arch 90,100 --out new.json --compare old.json

No GPU is needed. Exit status 1 when ``--compare`` finds a difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import sys
from concurrent.futures import ProcessPoolExecutor


def _compile_line(line: str) -> tuple[str, str]:
    from trtllm_replayssm import compile as cc

    spec, target = cc.spec_from_json(line)
    name = f"{spec.key}/{target}"
    try:
        out = cc._nvrtc_compile(cc.source(spec), spec.key, cc.options(spec, target), target)
    except Exception as e:  # a spec one tree cannot compile is a difference, reported by --compare
        return name, f"error: {type(e).__name__}: {str(e).splitlines()[0]}"
    return name, hashlib.sha256(out).hexdigest()


def spec_lines(paths: list[pathlib.Path], archs: list[int]) -> list[str]:
    """The distinct spec lines of ``paths``, each once per arch in ``archs`` (none: as written)."""
    from trtllm_replayssm import compile as cc

    seen: dict[str, None] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            spec, target = cc.spec_from_json(line)
            for arch in archs or [spec.arch]:
                seen.setdefault(cc.spec_to_json(dataclasses.replace(spec, arch=arch), target), None)
    return list(seen)


def compare(new: dict[str, str], old: dict[str, str]) -> list[str]:
    diffs = [f"{k}: {'missing' if k not in old else old[k]} -> {new.get(k, 'missing')}"
             for k in sorted(set(new) | set(old)) if new.get(k) != old.get(k)]
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", type=pathlib.Path, help="spec lists (JSON lines of compile.spec_to_json)")
    ap.add_argument("--arch", default="", help="comma-separated SM versions to compile each spec for (default: as listed)")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="where to write {key/target: sha256}")
    ap.add_argument("--compare", type=pathlib.Path, help="another tree's --out file")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",") if a]
    lines = spec_lines(args.specs, archs)
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        digests = dict(pool.map(_compile_line, lines, chunksize=8))
    args.out.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    errors = sum(v.startswith("error") for v in digests.values())
    print(f"{len(digests)} modules compiled ({errors} errors) -> {args.out}")
    if args.compare:
        diffs = compare(digests, json.loads(args.compare.read_text()))
        for d in diffs:
            print("DIFF", d)
        print(f"{len(digests) - len(diffs)} identical, {len(diffs)} different")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
