# SPDX-License-Identifier: Apache-2.0
"""Test-only helpers shared by several test modules (the decode problems, shared with the benchmarks, are
trtllm_replayssm/problems.py)."""

from __future__ import annotations

import torch

from trtllm_replayssm import reference as ref


def check_shadow(pb, s: int) -> None:
    """The shadow the kernel wrote for slot s == Shadow.write of the checkpoint it stored, bit for bit.

    ``pb``: a GPU test problem with H, P, N, shadow_kind, state, shadow, scale (kernel side) and
    ref_shadow (the float64 mirror's), which is then set to what the kernel will read."""
    want = ref.Shadow(1, pb.H, pb.P, pb.N, pb.shadow_kind)
    want.write(0, pb.state[s].cpu())
    got = pb.shadow[s].cpu()
    bad = (got.view(torch.uint8) != want.q[0].view(torch.uint8)).sum()
    assert bad == 0, f"shadow of slot {s}: {int(bad)} of {got.numel() * got.element_size()} bytes differ from Shadow.write"
    if pb.scale is not None:
        assert torch.equal(pb.scale[s].cpu(), want.scale[0]), f"fp8 row scales of slot {s} differ"
        pb.ref_shadow.scale[s] = want.scale[0]
    pb.ref_shadow.q[s] = got  # the mirror reads what the kernel will read
