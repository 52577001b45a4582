# SPDX-License-Identifier: Apache-2.0
"""The GPU suite's tooling on the CPU: the spec log round trip, the warm-up and the times summary."""

import pathlib

import pytest

from scripts import gpu_suite, warm_kernels
from trtllm_replayssm import compile as _compile
from trtllm_replayssm.config import KernelSpec, Layout, Variant
from trtllm_replayssm.families.gdn.config import GDNSpec

SPECS = [
    KernelSpec("f32", "bf16", 8, 64, 128, 2, 16, 8, 1, True, 90),
    KernelSpec("f32", "bf16", 8, 64, 128, 2, 16, 64, 4, False, 100, variant=Variant("staged", 5, 2, "bulk"), shadow="bf16"),
    KernelSpec("bf16", "f16", 8, 64, 128, 2, 8, 8, 1, False, 90, num_tokens=4),
    KernelSpec("f32", "bf16", 8, 64, 128, 2, 16, 8, 1, False, 90, layout=Layout(*range(1, 12), null_slot=3)),
    GDNSpec("bf16", 4, 2, 128, 128, 16, 128, 16, shadow="bf16", scale=0.25, num_tokens=2),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key)
def test_spec_json_round_trip(spec):
    for target in ("ptx", "cubin"):
        assert _compile.spec_from_json(_compile.spec_to_json(spec, target)) == (spec, target)


def test_spec_log_written_by_compile_spec(tmp_path, monkeypatch):
    log = tmp_path / "specs.jsonl"
    monkeypatch.setenv(_compile.SPEC_LOG_ENV, str(log))
    monkeypatch.setenv("TRTLLM_REPLAYSSM_CACHE", str(tmp_path / "cache"))
    _compile.compile_spec(SPECS[0], "ptx")
    _compile.compile_spec(SPECS[0], "ptx")  # a cache hit is logged too: the run loaded it
    assert warm_kernels.read_specs([log]) == [_compile.spec_to_json(SPECS[0], "ptx")]
    # the warm-up publishes what the tests then read: the same bytes, served from the cache
    (tmp_path / "cache").joinpath("x").mkdir()
    assert warm_kernels.warm(warm_kernels.read_specs([log]), jobs=1) >= 0
    assert len(list((tmp_path / "cache").glob(f"{SPECS[0].key}_*.ptx"))) == 1


def test_read_specs_names_a_bad_line(tmp_path):
    log = tmp_path / "specs.jsonl"
    log.write_text(_compile.spec_to_json(SPECS[0], "ptx") + "\n" + '{"type": "Nope", "target": "ptx"}\n')
    with pytest.raises(ValueError, match=r"specs.jsonl:2: not a spec line"):
        warm_kernels.read_specs([log])


def test_committed_spec_list_parses():
    path = pathlib.Path(gpu_suite.SPEC_LIST)
    if not path.exists():
        pytest.skip("tests/gpu_kernel_specs.jsonl not written yet (scripts/gpu_suite.py on a GPU writes it)")
    lines = warm_kernels.read_specs([path])
    assert lines and len(lines) == len(set(lines))


def test_summarize_times(tmp_path):
    times = tmp_path / "t.tsv"
    times.write_text("tests/a.py::x\tsetup\tpassed\t2.0\ntests/a.py::x\tcall\tpassed\t1.0\ntests/b.py::y\tcall\tfailed\t0.5\n")
    out = gpu_suite.summarize_times(times)
    assert out[0] == "test seconds summed over workers: 3.5"
    assert "       3.0 s  tests/a.py" in out and "       3.0 s  tests/a.py::x" in out
