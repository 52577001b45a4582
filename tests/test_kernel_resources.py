# SPDX-License-Identifier: Apache-2.0
"""scripts/kernel_resources.py: the ptxas log parser (always) and the report of real kernels (where ptxas is on
PATH, as on the CI machines and the device; NVRTC compiles without a GPU)."""

import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import kernel_resources as kr  # noqa: E402
from trtllm_replayssm import config  # noqa: E402

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'replayssm_advance_cursor' for 'sm_90'
ptxas info    : Function properties for replayssm_advance_cursor
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
ptxas info    : Compiling entry function 'replayssm_decode' for 'sm_90'
ptxas info    : Function properties for replayssm_decode
    64 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 64 bytes cumulative stack size, 15056 bytes smem
"""


def test_parse_ptxas_log():
    r = kr.parse_ptxas(LOG)
    assert r["replayssm_advance_cursor"] == dict(registers=8, stack_frame=0, spill_stores=0, spill_loads=0, smem=0)
    dec = r["replayssm_decode"]
    assert dec == dict(registers=40, stack_frame=64, spill_stores=4, spill_loads=8, smem=15056)
    assert kr.local_arrays(dec) == 60


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) is not on PATH")
def test_report_of_the_shipped_fp8_plan_respects_its_launch_bound():
    """The fp8 shadow plan at bs256 (staged, 8 blocks of 256 threads per SM): ptxas holds it to the register
    budget of its launch bound, and the static shared memory is config's mirror of the kernel's."""
    H, P, N, G = 128, 64, 128, 8
    rows, warps, var = config.plan("f32", "bf16", H, P, N, 16, 256, False, "fp8")
    spec = config.KernelSpec("f32", "bf16", H, P, N, G, 16, rows, warps, False, 90, variant=var, shadow="fp8")
    r = kr.report(spec)
    assert 0 < r["registers"] <= 65536 // (spec.blocks_per_sm * warps * 32)
    assert r["smem"] == config.replay_smem_bytes("f32", "bf16", rows, N, 16, False, "fp8", var.kind == "staged")
    assert set(r["entries"]) >= {"replayssm_decode", "replayssm_conventional", "replayssm_advance_cursor"}
