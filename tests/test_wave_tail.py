# SPDX-License-Identifier: Apache-2.0
"""The planners' resident count by the wave tail (trtllm_replayssm.config.tail_resident; bench/NOTES.md "Issue 40:
the wave tail"): the bound itself, and the modules the GDN and KDA planners pick with it."""

import pytest

from trtllm_replayssm.config import tail_resident, wave_tail_bound
from trtllm_replayssm.families.gdn import config as gc
from trtllm_replayssm.families.kda import GEOMETRIES
from trtllm_replayssm.families.kda.config import kda_spec
from trtllm_replayssm.families.kda.config import override as kda_override


def test_bound_is_waves_over_rounds():
    assert wave_tail_bound(396, 396) == 1.0 and wave_tail_bound(792, 396) == 1.0
    assert wave_tail_bound(2048, 396) == pytest.approx((2048 / 396) / 6)  # 5.17 waves in 6 rounds: 86%
    assert wave_tail_bound(198, 396) == 0.5  # under one wave: the share of slots in use
    # more blocks an SM only where the bound gains more than the margin; the default wins ties and small gains
    assert tail_resident(2048, 256, (768, 1024)) == 1024  # 86% -> 97%
    assert tail_resident(16384, 256, (768, 1024)) == 768  # 99% vs 97%
    assert tail_resident(256, 256, (768, 1024)) == 768  # one partial wave either way: fewer slots keep it fuller
    assert tail_resident(2048, 256, (768, 1024), margin=0.2) == 768


@pytest.mark.parametrize("batch, fp32, shadow", [(1, 768, 768), (4, 768, 768), (8, 768, 1024), (16, 768, 1024),
                                                 (32, 768, 1024), (64, 768, 768), (128, 768, 768), (256, 768, 768)])
def test_gdn_standard_decode_modules(batch, fp32, shadow):
    """Qwen3-Next (32 value heads of 128 x 128): the one-pass shadow modules at bs 8-32 take 4 blocks an SM (R64 W8:
    512-2048 blocks, 1.3-5.2 waves at 3); fp32 modules (they lost at 4, H100), the two-pass shadow modules (R128
    from bs64: level), verify and conventional modules keep the default."""
    got = [gc.gdn_spec("bf16", 32, 16, 128, 128, 16, batch, True, shadow=s).resident for s in ("none", "bf16")]
    assert got == [fp32, shadow]
    assert gc.gdn_spec("bf16", 32, 16, 128, 128, 16, batch, False).resident == gc.GDN_RESIDENT_THREADS
    assert gc.gdn_spec("bf16", 32, 16, 128, 128, 16, batch, True, num_tokens=4).resident == gc.GDN_RESIDENT_THREADS
    with gc.override(resident=512):  # a pin wins
        assert gc.gdn_spec("bf16", 32, 16, 128, 128, 16, batch, True).resident == 512


def test_kda_decode_modules():
    """The staged modules (bs128-256 here) run 4 blocks an SM; below them Kimi-K3 TP8 (24 blocks a row at (4, 4))
    keeps 3 at every batch, GLM-5.3-Flash TP8 (16) takes 4 from bs32 with a shadow (1.3-5.2 waves at 3) and without
    one only at bs32 (65% -> 97% of a full last wave; the fp32 module's spill costs more than the smaller gains);
    conventional and verify modules keep the default."""
    kimi, glm = GEOMETRIES["kimi_k3_tp8"], GEOMETRIES["glm5_3_flash_tp8"]
    batches = (1, 8, 32, 64, 128, 256)
    for shadow in ("none", "bf16"):
        assert [kda_spec("bf16", *kimi, 16, b, shadow=shadow).resident for b in batches] == [0] * 4 + [512] * 2
    assert [kda_spec("bf16", *glm, 16, b, "bf16", lower_bound=-5.0).resident for b in batches] == [0, 0, 512, 512, 512,
                                                                                                 512]
    assert [kda_spec("bf16", *glm, 16, b, lower_bound=-5.0).resident for b in batches] == [0, 0, 512, 0, 512, 512]
    for shadow in ("none", "bf16"):  # the staged modules (>= STAGED_MIN_WAVES waves) at STAGED_RESIDENT_THREADS
        assert all(kda_spec("bf16", *g, 16, b, shadow=shadow).resident == 512 for g in (kimi, glm) for b in (128, 256))
    assert kda_spec("bf16", *glm, 16, 64, conventional=True).resident == 0
    assert kda_spec("bf16", *glm, 16, 64, num_tokens=4).resident == 0
    with kda_override(resident=384):  # a pin wins
        assert kda_spec("bf16", *glm, 16, 64).resident == 384
