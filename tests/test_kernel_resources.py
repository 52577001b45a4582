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


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) is not on PATH")
@pytest.mark.parametrize("shadow", ["none", "bf16", "fp8"])
def test_rows64_warps4_keeps_its_partials_in_registers(shadow):
    """16 rows a thread (64-row items of 4 warps): the row butterfly's levels are template instances, so the
    per-row partials stay in registers; as one loop over the offsets NVRTC left it rolled and put them in a
    64-byte local array (bench/NOTES.md "Next for the shadow steps")."""
    spec = config.KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 4, False, 90,
                             variant=config.Variant("staged", 8, 2), shadow=shadow)
    r = kr.report(spec)
    assert r["local_array_bytes"] == 0 and r["spill_stores"] == 0, r
