# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_serve.py on the CPU with the tiny Nemotron-H: every workload runs end to end and writes its JSON rows
(the fields the lead's GPU run reports; no timing is asserted: CPU times of a tiny model mean nothing). The engine's
counters in the rows are checked exactly where the workload fixes them: with the prefix cache on, every request after
the first reuses the shared prompt's blocks; with preemption on, more streams than slots are swapped."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "scripts" / "bench_serve.py")
bs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bs)

pytestmark = pytest.mark.usefixtures("one_thread")
SMOKE = ["--tiny", "--device", "cpu", "--dtype", "fp32", "--modes", "replay", "--buffer-len", "4", "--max-tokens", "4",
         "--commit", "test"]


def rows_of(path):
    body = json.loads(path.read_text())
    assert body["meta"]["commit"] == "test" and "device" in body["meta"]
    return body["rows"]


def test_shared_prefix_workload_reports_reuse(tmp_path):
    """4 requests sharing a 64-token prompt (blocks of 16) + 5 own tokens each: cache off computes every token; on,
    the first misses and keeps the 64-token prefix, the other 3 reuse it. TTFT p50/p99 and the entries' bytes in
    each row."""
    assert bs.main([*SMOKE, "--workload", "shared-prefix", "--concurrency", "4", "--prefix-len", "64", "--suffix-len",
                    "5", "--prefix-block", "16", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_serve-shared-prefix_test.json")
    off, on = rows_of(path)
    assert (off["workload"], off["prefix_cache"], on["prefix_cache"]) == ("shared-prefix", False, True)
    assert off["prefill_tokens_computed"] == 4 * 69 and off["prefill_tokens_reused"] == 0
    assert on["prefill_tokens_reused"] == 3 * 64 and on["prefill_tokens_computed"] == 4 * 69 - 3 * 64
    assert (on["prefix_hits"], on["prefix_misses"]) == (3, 1)
    assert on["prefix_cache_bytes"] > 0 and off["prefix_cache_bytes"] == 0
    for r in (off, on):
        assert r["ttft_ms_p50"] > 0 and r["ttft_ms_p99"] >= r["ttft_ms_p50"] and r["generated"] == 16


def test_preempt_workload_swaps(tmp_path):
    """6 streams on 2 slots: without preemption nothing is swapped; with it (quantum 1) streams are swapped out and
    back (every swap-out resumed), the host bytes reported."""
    assert bs.main([*SMOKE, "--workload", "preempt", "--concurrency", "6", "--max-slots", "2", "--prompt-len", "5",
                    "--preempt-quantum", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_serve-preempt_test.json")
    off, on = rows_of(path)
    assert (off["preempt"], on["preempt"], on["max_slots"]) == (False, True, 2)
    assert off["preemptions"] == 0 and off["swap_out_bytes"] == 0
    assert on["preemptions"] > 0 and on["resumes"] == on["preemptions"] and on["swapped_bytes_peak"] > 0
    assert on["swap_out_bytes"] >= on["swapped_bytes_peak"] and on["generated"] == 24


def test_random_workload_still_runs_and_refuses_too_few_slots(tmp_path):
    assert bs.main([*SMOKE, "--concurrency", "1,2", "--prompt-len", "4", "--ttft-prompt", "8",
                    "--out", str(tmp_path)]) == 0
    rows = rows_of(next(tmp_path.glob("*_serve_test.json")))
    assert [r["concurrency"] for r in rows] == [1, 2] and all(r["workload"] == "random" for r in rows)
    with pytest.raises(SystemExit):
        bs.main([*SMOKE, "--concurrency", "4", "--max-slots", "2"])
