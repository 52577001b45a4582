# SPDX-License-Identifier: Apache-2.0
"""The family-interface counts of issue 36, re-taken on a tree: how far the code is from "a new family is one folder".

Counted (static text, no imports):

- ``method_pairs``: methods of ``ReplayStateCache`` (trtllm_replayssm/cache.py) named ``gdn_<x>`` / ``_<x>_gdn_<y>``
  next to a method of the plain name: a family's twin of a shared call.
- ``family_branches``: lines outside ``trtllm_replayssm/families/`` that branch on a family: ``isinstance(.., <Spec>)``
  with a family's spec class, or a comparison with a family's name (``== "gdn"``, ``in ("mamba2", ...)``), in the
  library, builders/, serve/ and scripts/; listed per file.
- ``family_names``: identifiers (code tokens, not strings or comments) naming one family (``gdn_*``, ``GDN*``,
  ``kda_*``, ``KDA*``) in the modules every family shares: the cache, the executors, compile, the launch boundary,
  the TensorRT registration, the engine export, the generation engine and the Triton model; listed per file.
- ``upward_imports``: library modules importing ``builders``.
- ``prefixed_files``: library / plugin / builder files whose name carries a family prefix (``gdn_*``, ``kda_*``)
  instead of living in the family's folder.

``python scripts/layout_counts.py [--root .] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

FAMILIES = ("mamba2", "gdn", "kda")
SPEC_CLASSES = ("KernelSpec", "GDNSpec", "KDASpec")
_NAME = "|".join(FAMILIES)
BRANCH = re.compile(rf"isinstance\([^)]*\b({'|'.join(SPEC_CLASSES)})\b|[=!]=\s*[\"'](?:{_NAME})[\"']|"
                    rf"[\"'](?:{_NAME})[\"']\s*[=!]=|\bin\s*\((?:\s*[\"'](?:{_NAME})[\"']\s*,?)+\)")


def method_pairs(root: pathlib.Path) -> list[str]:
    src = (root / "trtllm_replayssm" / "cache.py").read_text()
    body = src[src.index("class ReplayStateCache"):]
    names = set(re.findall(r"^    def (\w+)\(", body, re.M))
    pairs = []
    for n in sorted(names):
        plain = re.sub(r"(^_?)gdn_", r"\1", n).replace("_gdn_", "_")
        if plain != n and plain in names:
            pairs.append(f"{plain}/{n}")
    return pairs


def family_branches(root: pathlib.Path) -> dict[str, int]:
    out = {}
    for folder in ("trtllm_replayssm", "builders", "serve", "scripts"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("trtllm_replayssm/families/") or rel == "scripts/layout_counts.py":
                continue
            n = sum(1 for line in path.read_text().splitlines()
                    if BRANCH.search(line) and not line.lstrip().startswith("#"))
            if n:
                out[rel] = n
    return out


SHARED = ("trtllm_replayssm/cache.py", "trtllm_replayssm/backend.py", "trtllm_replayssm/compile.py",
          "trtllm_replayssm/launch.py", "trtllm_replayssm/layer_group.py", "trtllm_replayssm/trt_plugin.py",
          "builders/engine.py", "builders/generation.py", "builders/triton_generate.py", "scripts/build_engine.py")
_FAMILY_ID = re.compile(r"^_?(gdn|GDN|kda|KDA|Gdn|Kda)|_(gdn|kda)(_|$)")


def family_names(root: pathlib.Path) -> dict[str, int]:
    import io
    import tokenize

    out = {}
    for rel in SHARED:
        path = root / rel
        if not path.is_file():
            continue
        toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        n = sum(1 for t in toks if t.type == tokenize.NAME and _FAMILY_ID.search(t.string))
        out[rel] = n
    return out


def upward_imports(root: pathlib.Path) -> list[str]:
    pat = re.compile(r"^\s*(from\s+builders\b|import\s+builders\b)", re.M)
    return sorted(p.relative_to(root).as_posix() for p in (root / "trtllm_replayssm").rglob("*.py")
                  if pat.search(p.read_text()))


def prefixed_files(root: pathlib.Path) -> list[str]:
    pat = re.compile(rf"^(?:{'|'.join(f for f in FAMILIES if f != 'mamba2')})_")
    out = []
    for folder in ("trtllm_replayssm", "plugins", "builders"):
        for p in sorted((root / folder).rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and pat.match(p.name) and "/families/" not in rel and p.suffix in (".py", ".cu", ".cuh") \
                    and not any(part in FAMILIES for part in p.relative_to(root).parts[1:-1]):
                out.append(rel)
    return out


def counts(root: pathlib.Path) -> dict:
    branches, names = family_branches(root), family_names(root)
    return {"method_pairs": method_pairs(root), "family_branches": sum(branches.values()),
            "family_branches_by_file": branches, "family_names": sum(names.values()), "family_names_by_file": names,
            "upward_imports": upward_imports(root),
            "prefixed_files": prefixed_files(root)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    c = counts(args.root)
    if args.json:
        print(json.dumps(c, indent=1))
        return 0
    print(f"method pairs in ReplayStateCache: {len(c['method_pairs'])} {c['method_pairs']}")
    print(f"family-name branches outside families/: {c['family_branches']}")
    for f, n in sorted(c["family_branches_by_file"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {f}")
    print(f"family-named identifiers in the shared modules: {c['family_names']}")
    for f, n in sorted(c["family_names_by_file"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {f}")
    print(f"upward imports (library -> builders): {len(c['upward_imports'])} {c['upward_imports']}")
    print(f"family-prefixed files outside family folders: {len(c['prefixed_files'])}")
    for f in c["prefixed_files"]:
        print(f"        {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
