# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_kernels.py on the CPU: the per-position fill of a quick run (ks given)."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bk():
    spec = importlib.util.spec_from_file_location("bench_kernels_under_test", ROOT / "scripts" / "bench_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_unmeasured_positions_are_interpolated_below_the_flush(bk):
    L = 16
    full = {k: 10.0 + k for k in range(1, L)} | {L: 50.0}  # linear in k, a slow flush
    quick = {k: full[k] for k in (1, 2, L // 2, L - 1, L)}  # sweep_variants' positions
    assert bk.fill_positions(quick, L) == pytest.approx([full[k] for k in range(1, L + 1)])
    assert bk.fill_positions({1: 4.0, L: 9.0}, L) == [4.0] * (L - 1) + [9.0]  # one point below the flush: flat
