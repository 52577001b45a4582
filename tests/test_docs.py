# SPDX-License-Identifier: Apache-2.0
"""The README as a front door, and the documentation's relative links.

- README.md stays short (<= 300 lines, no line over 300 characters) and holds the two commands a new user runs,
  the second of which CI (``.ci/run``) runs as "the README's test command".
- Every relative link or image in README.md and docs/*.md names a file or directory that exists, and a
  ``#anchor`` into a markdown file names one of its headings (GitHub's heading ids).
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

SETUP_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[dev,builder]" && python scripts/build_engine.py --out build/tiny'
TEST_COMMAND = "python -m pytest -q"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def strip_code(md: str) -> str:
    """The markdown without fenced blocks and code spans (links there are examples, not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", md))


def links(md: str) -> list[str]:
    return LINK.findall(strip_code(md))


def slug(heading: str) -> str:
    """GitHub's id of a heading: markup dropped, lower case, punctuation but '-' and '_' removed, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, text in HEADING.findall(FENCE.sub("", md)):
        s = slug(text)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(path: pathlib.Path) -> list[str]:
    md = path.read_text()
    bad = []
    for target in links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


# ---------------------------------------------------------------- the checker itself


def test_links_and_anchors_parse_as_github_does():
    md = "# Title\n\n## Route 1: a built engine (`tensorrt_plan`)\n\n## Checkpoint shadows (`--shadow bf16|fp8`)\n## Title\n"
    assert anchors(md) == {"title", "route-1-a-built-engine-tensorrt_plan", "checkpoint-shadows---shadow-bf16fp8",
                           "title-1"}
    text = "see [a](docs/a.md#x), ![img](../b.png \"t\") and `[not](c.md)`\n```\n[no](d.md)\n```\n[e](https://x.y/z)"
    assert links(text) == ["docs/a.md#x", "../b.png", "https://x.y/z"]


def test_broken_links_are_found(tmp_path):
    (tmp_path / "there.md").write_text("# Here\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md#here) [gone](missing.md) [anchor](there.md#nowhere) [self](#top)\n# Top\n")
    bad = broken_links(doc)
    assert len(bad) == 2 and "missing.md" in bad[0] and "#nowhere" in bad[1]


# ---------------------------------------------------------------- the repository's documents


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_docs_pages_exist():
    names = {p.name for p in DOCS}
    for page in ("tensorrt.md", "triton.md", "trtllm-serve.md", "vllm.md", "benchmarks.md", "precision.md",
                 "tensor-parallel.md", "gdn.md", "testing.md", "layout.md", "DESIGN.md"):
        assert page in names
    readme_links = {t.partition("#")[0] for t in links(README.read_text())}
    for p in DOCS:  # every page is reachable from the README
        assert f"docs/{p.name}" in readme_links, p.name


def test_readme_is_short():
    lines = README.read_text().split("\n")
    assert len(lines) <= 300 + 1  # the text ends with a newline
    long = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > 300]
    assert long == []


def _bash_blocks(md: str) -> list[list[str]]:
    return [m.group(1).strip().split("\n") for m in re.finditer(r"^```bash\n(.*?)^```", md, re.S | re.M)]


def test_readme_holds_the_two_commands_ci_relies_on():
    md = README.read_text()
    blocks = _bash_blocks(md)
    assert [SETUP_COMMAND] in blocks
    assert [TEST_COMMAND] in blocks
    assert md.index(SETUP_COMMAND) < md.index(TEST_COMMAND) < md.index("## What runs where")

    ci = (ROOT / ".ci" / "run").read_text().split("\n")
    # CI runs the README's test command (python3 on the CI image) ...
    i = next(k for k, line in enumerate(ci) if line.startswith("# The README's test command"))
    assert ci[i + 1].strip().replace("python3 ", "python ", 1) == TEST_COMMAND
    # ... after installing what the README's setup command installs
    assert any("pip install" in line and "torch==2.13.0" in line for line in ci)
    assert any("pip install" in line and '-e ".[dev,builder]"' in line for line in ci)


def test_readme_says_what_runs_where_and_how_long_the_tests_take():
    md = README.read_text()
    timed = r"\*\*\d+ passed, \d+ skipped in [\d.]+ min\*\* \([0-9a-f]{7,}\)"  # the CPU suite's time and its commit
    assert re.search(timed, md), timed
    for needed in ("81 s", "## What runs where", "## Serving (Triton)",
                   "## GPU tests", "python -m pytest -m gpu", "docs/triton.md", "docs/testing.md",
                   "Nemotron-H", "Nemotron 3", "Qwen3.5", "from trtllm_replayssm.families.mamba2 import ops"):
        assert needed in md, needed
