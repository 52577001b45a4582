# SPDX-License-Identifier: Apache-2.0
"""scripts/precision_fold_gemm.py on the CPU: its TF32 rounding, and its WY fold against the spec's sequential fold."""

import importlib.util
import pathlib

import pytest
import torch

from trtllm_replayssm.families.kda import reference as kref

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("precision_fold_gemm", ROOT / "scripts" / "precision_fold_gemm.py")
pf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pf)


def test_tf32_rounds_to_nearest_ties_away_and_keeps_10_bits():
    one = 1.0
    ulp = 2.0 ** -10  # TF32's spacing at 1
    x = torch.tensor([one, one + ulp / 2, one + ulp / 2 - 2 ** -23, -(one + ulp / 2), one + ulp, 3.0e38,
                      float("inf"), float("nan")], dtype=torch.float32)
    got = pf.tf32(x)
    assert got[0] == 1 and got[1] == one + ulp and got[2] == one and got[3] == -(one + ulp) and got[4] == one + ulp
    assert torch.isfinite(got[5]) and got[6] == float("inf") and torch.isnan(got[7])
    r = pf.tf32(torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    assert (r.view(torch.int32) & 0x1FFF).eq(0).all()  # the 13 dropped mantissa bits are zero


@pytest.mark.parametrize("chunk", [1, 4, 15])
def test_wy_fold_in_float64_is_the_sequential_fold(chunk):
    gen = torch.Generator().manual_seed(chunk)
    H, K, V, m = 2, 16, 8, 15
    S = torch.randn(H, K, V, generator=gen, dtype=torch.float64)
    ks = kref.prep_k(torch.randn(H, m, K, generator=gen, dtype=torch.float64))
    vs = torch.randn(H, m, V, generator=gen, dtype=torch.float64)
    gs = -torch.rand(H, m, K, generator=gen, dtype=torch.float64) * 0.5
    betas = torch.rand(H, m, generator=gen, dtype=torch.float64)
    want = kref._fold(S, ks, vs, gs, betas)
    got = pf.wy_fold(S, ks, vs, gs, betas, "fp64", chunk)
    assert float((got - want).abs().max()) < 1e-12 * float(want.abs().max())


def test_gemm_modes_order_by_precision():
    res = pf.run(cycles=3, H=1, K=32, V=16, gate="kimi")
    worst = {mode: max(r["state"]) for mode, r in res.items()}
    assert worst["fp64"] < 1e-7 and worst["fp32"] < 1e-6 and worst["3xtf32"] < 1e-6
    assert worst["tf32"] > 10 * worst["3xtf32"]  # one TF32 rounding of the operands shows
    with pytest.raises(ValueError, match="mode"):
        pf.gemm(torch.ones(1, 1), torch.ones(1, 1), "fp16")
