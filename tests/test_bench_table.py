# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_table.py: result files classified by their rows, one table per (kind, card, commit) labelled with
card and commit, cards never merged, the generated blocks of docs/*.md regenerated and checked; every committed
result file parses, and docs/benchmarks.md is what the JSON gives now."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("bench_table_under_test", ROOT / "scripts" / "bench_table.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolves the module's annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


bt = _load()

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def kernel_row(batch, conv, replay, **kw):
    r = {"geom": "nemotron_h_8b", "state": "f32", "L": 16, "batch": batch, "conv_us": conv, "pct_ceiling_conv": 95.0,
         "replay_us_k1": replay * 0.9, "replay_us_flush": conv * 1.1, "replay_us_amortized": replay,
         "pct_ceiling_replay": 80.0, "speedup_vs_conv": conv / replay}
    r.update(kw)
    return r


def write(tmp_path: pathlib.Path, name: str, data) -> pathlib.Path:
    d = tmp_path / "bench" / "results"
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text(json.dumps(data))
    return p


def meta(device=H200, commit="abc1234", **kw):
    return {"device": device, "commit": commit, "date": "2026-12-06T00:00:00+00:00", "copy_ceiling_tbps": 4.1, **kw}


# ---------------------------------------------------------------- classification


def test_every_kind_is_recognised_by_its_rows(tmp_path):
    cases = {
        "kernels": [kernel_row(256, 553.1, 349.4, mamba_us=631.1, speedup_vs_mamba=1.81)],
        "gdn": [{"geom": "qwen3_next", "L": 16, "batch": 64, "conv_us": 73.5, "f32_us_amortized": 46.9,
                 "f32_speedup_vs_conv": 1.57, "bf16shadow_us_amortized": 42.4, "bf16shadow_speedup_vs_conv": 1.73}],
        "gdn-spec": [{"geom": "qwen3_next", "T": 4, "p_accept": 0.8, "batch": 64, "native_us_step": 253.5,
                      "f32_us_step": 102.6, "f32_speedup_vs_native": 2.47}],
        "spec": [{"geom": "nemotron_h_8b", "T": 4, "batch": 256, "verify_us_step": 448.4, "native_us_step": 1981.8,
                  "standard_us_step": 325.9, "verify_us_by_count": {"0": 339.0, "12": 680.8}}],
        "decode": [{"batch": 1, "mode": "conventional", "ms_step": 4.75, "speedup_vs_conventional": 1.0}],
        "spec-decode": [{"batch": 1, "mode": "standard", "acceptance": None, "tokens_per_s": 210.4}],
        "tp-check": [{"kind": "tp_check", "geometry": [256, 64, 128, 8], "err_max": 3e-6, "tol": 1e-4}],
        "profile": [{"batch": 1, "T": 1, "mode": "noop", "ms_step": 4.6, "categories_ms": {"gemm": 4.0}}],
    }
    for kind, rows in cases.items():
        res = bt.parse(write(tmp_path, f"{kind}.json", {"meta": meta(), "rows": rows}))
        assert (res.kind, res.device, res.commit) == (kind, H200, "abc1234"), kind
        assert bt.table([res])  # renders
    top = {**meta(), "rows": [{"batch": 1, "conv_us": 4.2, "dense_us_amortized": 5.6, "vllm_us_amortized": 5.8}]}
    assert bt.parse(write(tmp_path, "vllm.json", top)).kind == "vllm-layout"


@pytest.mark.parametrize("data, reason", [
    ([kernel_row(1, 4.0, 5.0)], "bare list"),
    ({"steps": 4096, "summary": {}}, "no meta/rows"),
    ({"meta": {"commit": "abc"}, "rows": [kernel_row(1, 4.0, 5.0)]}, "device or commit"),
    ({"meta": meta(), "rows": [{"something": 1}]}, "no known kind"),
])
def test_other_files_are_listed_never_tabled(tmp_path, data, reason):
    res = bt.parse(write(tmp_path, "x.json", data))
    assert res.kind == "other" and reason in res.reason
    assert bt.tables([res]) == ""


def test_a_file_that_is_not_json_is_refused(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        bt.parse(p)


# ---------------------------------------------------------------- tables


def test_a_table_is_labelled_by_card_and_commit_and_formats_its_cells(tmp_path):
    res = bt.parse(write(tmp_path, "k.json", {"meta": meta(), "rows": [
        kernel_row(256, 553.1, 349.4, mamba_us=631.1, speedup_vs_mamba=1.806),
        kernel_row(1, 4.2, 5.8, state="bf16")]}))
    out = bt.table([res]).split("\n")
    assert out[0].startswith("**NVIDIA H200**, commit abc1234, kernels, copy ceiling 4.10 TB/s: `bench/results/k.json`")
    assert out[2].startswith("| geometry | state | shadow | L | batch | conventional µs (% ceil) |")
    assert "| nemotron_h_8b | f32 | none | 16 | 256 | 553.1 (95%) |" in out[4]
    assert out[4].endswith("| 1.58x | 631.1 | 1.81x |")
    assert out[5].endswith("| - | - |")  # no peer timing in that row
    assert "file" not in out[2]  # one file: no file column
    # a column no row fills is left out
    assert "replay mixed" not in out[2] and "variant" not in out[2]


def test_one_table_per_kind_card_and_commit_cards_never_merged(tmp_path):
    a = bt.parse(write(tmp_path, "a_h200.json", {"meta": meta(H200, "c1"), "rows": [kernel_row(64, 139.3, 92.9)]}))
    b = bt.parse(write(tmp_path, "b_h200.json", {"meta": meta(H200, "c1"), "rows": [kernel_row(256, 553.1, 349.4)]}))
    c = bt.parse(write(tmp_path, "c_h100.json", {"meta": meta(H100, "c1"), "rows": [kernel_row(256, 735.1, 422.9)]}))
    d = bt.parse(write(tmp_path, "d_h200.json", {"meta": meta(H200, "c2"), "rows": [kernel_row(256, 550.0, 340.0)]}))
    groups = bt.group([a, b, c, d])
    assert [[r.name for r in g] for g in groups] == [["a_h200.json", "b_h200.json"], ["c_h100.json"], ["d_h200.json"]]
    text = bt.tables([a, b, c, d])
    blocks = text.split("\n\n**")
    assert len(blocks) == 3
    for block in blocks:  # every table holds rows of one card only
        assert (H100 in block) != (H200 in block)
    merged = bt.table([a, b]).split("\n")
    assert merged[2].startswith("| file | geometry |")
    assert merged[4].startswith("| a_h200.json |") and merged[5].startswith("| b_h200.json |")
    with pytest.raises(ValueError, match="one table per"):
        bt.table([a, c])
    # selection by kind, card and commit
    assert "c_h100.json" in bt.tables([a, c], device="H100") and "a_h200.json" not in bt.tables([a, c], device="H100")
    assert bt.tables([a, d], commit="c2").count("| nemotron_h_8b |") == 1
    assert bt.tables([a], kinds=["gdn"]) == ""


def test_decode_pivots_modes_and_says_a_skipped_batch_once(tmp_path):
    rows = [
        {"kind": "skip", "batch": 256, "skipped": True, "needed_gib": 51.15, "free_gib": 33.26},
        {"batch": 64, "mode": "conventional", "ms_step": 11.581, "speedup_vs_conventional": 1.0, "ssm_share": 0.393},
        {"batch": 64, "mode": "replay", "ms_step": 9.698, "speedup_vs_conventional": 1.194, "ssm_share": 0.275},
    ]
    res = bt.parse(write(tmp_path, "d.json", {"meta": meta(H100, modes=["conventional", "replay"]), "rows": rows}))
    out = bt.table([res]).split("\n")
    assert out[2] == "| batch | conventional ms | replay ms | replay x conv | SSM share (conv) |"
    assert out[4] == "| 64 | 11.58 | 9.70 | 1.19x | 39.3% |"
    assert out[5] == "| 256 | skipped (needs 51.1 GiB, 33.3 free) | - | - | - |"


def test_spec_decode_pivots_acceptance_and_marks_what_does_not_fit(tmp_path):
    rows = [
        {"batch": 256, "mode": "standard", "acceptance": None, "tokens_per_s": 14613.8, "speedup_vs_standard": 1.0},
        {"batch": 256, "mode": "replay_spec", "acceptance": 0.8, "tokens_per_s": 18500.8, "speedup_vs_standard": 1.266},
        {"batch": 256, "mode": "native_spec", "skipped": True, "reason": "does not fit: needs 127.5 GiB"},
        {"batch": 1, "mode": "native_spec", "acceptance": 0.8, "tokens_per_s": 492.7, "speedup_vs_standard": 2.342},
    ]
    res = bt.parse(write(tmp_path, "s.json", {"meta": meta(modes=["standard", "replay_spec", "native_spec"]),
                                                "rows": rows}))
    out = bt.table([res]).split("\n")
    assert out[2] == ("| batch | standard tokens/s | replay_spec 0.8 tokens/s (x standard) | "
                      "native_spec 0.8 tokens/s (x standard) |")
    assert out[4] == "| 1 | - | - | 493 (2.34x) |"
    assert out[5] == "| 256 | 14614 | 18501 (1.27x) | does not fit |"


# ---------------------------------------------------------------- generated blocks


def test_blocks_are_regenerated_and_staleness_is_found(tmp_path):
    write(tmp_path, "k.json", {"meta": meta(), "rows": [kernel_row(256, 553.1, 349.4)]})
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    doc.write_text("# Page\n\nintro\n\n<!-- bench_table: bench/results/k.json -->\nold table\n<!-- /bench_table -->\n\nend\n")
    assert bt.stale([doc], tmp_path) == [doc]
    new = bt.regenerate(doc.read_text(), tmp_path)
    assert "old table" not in new and "**NVIDIA H200**, commit abc1234" in new
    assert new.startswith("# Page\n\nintro\n\n<!-- bench_table: bench/results/k.json -->\n\n**NVIDIA H200**")
    assert new.endswith("553.1 (95%) | 314.5 | 608.4 | 349.4 (80%) | 1.58x |\n\n<!-- /bench_table -->\n\nend\n")
    doc.write_text(new)
    assert bt.stale([doc], tmp_path) == []
    assert bt.regenerate(new, tmp_path) == new  # idempotent
    # the JSON changes: the block is stale again
    write(tmp_path, "k.json", {"meta": meta(), "rows": [kernel_row(256, 553.1, 300.0)]})
    assert bt.stale([doc], tmp_path) == [doc]
    assert bt.marked_docs(tmp_path) == [doc]


@pytest.mark.parametrize("text, match", [
    ("<!-- bench_table: bench/results/k.json -->\nno end\n", "without"),
    ("<!-- /bench_table -->\n", "without a begin marker"),
    ("<!-- bench_table: bench/results/k.json -->\n<!-- bench_table: bench/results/k.json -->\n<!-- /bench_table -->\n",
     "opens inside"),
    ("<!-- bench_table: bench/results/other.json -->\n<!-- /bench_table -->\n", "has no table"),
])
def test_bad_blocks_are_refused(tmp_path, text, match):
    write(tmp_path, "k.json", {"meta": meta(), "rows": [kernel_row(256, 553.1, 349.4)]})
    write(tmp_path, "other.json", [kernel_row(1, 4.0, 5.0)])
    with pytest.raises(ValueError, match=match):
        bt.regenerate(text, tmp_path)


def test_a_block_may_select_a_kind(tmp_path):
    write(tmp_path, "k.json", {"meta": meta(), "rows": [kernel_row(256, 553.1, 349.4)]})
    text = "<!-- bench_table: bench/results/k.json --kind gdn -->\n<!-- /bench_table -->\n"
    assert "**NVIDIA" not in bt.regenerate(text, tmp_path)
    with pytest.raises(ValueError, match="bad bench_table block arguments"):
        bt.regenerate("<!-- bench_table: bench/results/k.json --kind nope -->\n<!-- /bench_table -->\n", tmp_path)


def test_cli_check_and_write(tmp_path, capsys):
    src = write(tmp_path, "k.json", {"meta": meta(), "rows": [kernel_row(256, 553.1, 349.4)]})
    doc = tmp_path / "page.md"
    doc.write_text(f"<!-- bench_table: {src} -->\n<!-- /bench_table -->\n")  # an absolute path works too
    assert bt.main(["--check", str(doc)]) == 1
    assert "out of date" in capsys.readouterr().out
    assert bt.main(["--write", str(doc)]) == 0
    assert bt.main(["--check", str(doc)]) == 0
    assert bt.main(["--list", str(src)]) == 0
    assert "kernels\tNVIDIA H200\tabc1234" in capsys.readouterr().out
    assert bt.main([str(src), "--device", "H100"]) == 0 and capsys.readouterr().out == ""


# ---------------------------------------------------------------- the committed results and docs


def test_every_committed_result_file_parses():
    files = bt.result_files()
    assert len(files) > 50
    results = [bt.parse(f) for f in files]
    for res in results:
        if res.kind == "other":
            assert res.reason
            continue
        assert res.kind in bt.KINDS and res.device and res.commit and res.rows
    # every file that records its card and commit has rows of a kind this script tables
    for res in results:
        data = json.loads(res.path.read_text())
        m = data.get("meta", data) if isinstance(data, dict) else {}
        if isinstance(m, dict) and m.get("device") and m.get("commit") and isinstance(data.get("rows"), list):
            assert res.kind != "other", res.name
    kinds = {r.kind for r in results}
    assert {"kernels", "gdn", "gdn-spec", "spec", "decode", "spec-decode"} <= kinds
    # every group renders, and no table mixes cards
    for g in bt.group(results):
        assert len({r.device for r in g}) == 1
        assert bt.table(g).startswith(f"**{g[0].device}**, commit {g[0].commit}, {g[0].kind}")


def test_the_generated_docs_are_up_to_date():
    docs = bt.marked_docs()
    assert ROOT / "docs" / "benchmarks.md" in docs
    assert bt.stale(docs) == [], "run: python scripts/bench_table.py --write"
