# SPDX-License-Identifier: Apache-2.0
"""Mamba-2 (Nemotron-H, Nemotron 3): the family declaration of the family interface (issue 36).

State of one layer (:data:`STATE_TABLE`; the contract's table, :mod:`trtllm_replayssm.contract`, checked against
this one by tests/test_families.py): the checkpoint S0 (S, H, P, N), its optional bf16 / fp8 shadow (fp8 with one
fp32 scale per (slot, head, row)), and the rings of x_j, B_j (C is never cached) and the processed dt_j. The
float64 spec is :mod:`.reference` (standard decode) with :mod:`.spec_reference` (speculative verify); kernels
``plugins/mamba2/``, spec :class:`~trtllm_replayssm.config.KernelSpec`, launchers :mod:`.ops`, bytes model
``costs.mamba2_*``. The rules every family shares (cursor, shadow, conv window, the cursor kernels' launchers)
are the root modules :mod:`trtllm_replayssm.cursor`, :mod:`~trtllm_replayssm.shadow`,
:mod:`~trtllm_replayssm.conv_window`, :mod:`~trtllm_replayssm.cursor_ops`.
"""

from __future__ import annotations

import torch

from ... import costs
from ...config import KernelSpec
from ...geometries import GEOMETRIES
from .. import Family, StateTensor

GEOMETRY = ("H", "P", "N", "G")  # nheads, headdim, dstate, ngroups
STATE_TABLE = (
    StateTensor("state", ("slots", "H", "P", "N"), "state", "prefill hand-off; a flush (the L-th entry / count + 2T > L)"),
    StateTensor("shadow", ("slots", "H", "P", "N"), "shadow", "rewritten with the checkpoint", optional=True),
    StateTensor("shadow_scale", ("slots", "H", "P"), "f32", "with an fp8 shadow: rewritten with it", optional=True),
    StateTensor("ckpt_scale", ("slots", "H", "P"), "f32", "with an 8-bit checkpoint: rewritten with it at a flush",
                optional=True),
    StateTensor("x_cache", ("slots", "H", "L", "P"), "act", "each step: its token's x"),
    StateTensor("B_cache", ("slots", "G", "L", "N"), "act", "each step: its token's B"),
    StateTensor("dt_cache", ("slots", "H", "L"), "dt", "each step: its token's processed dt"),
)
DTYPES = {"state": torch.float32, "shadow": torch.bfloat16, "act": torch.bfloat16, "dt": torch.float32,
          "f32": torch.float32}

FAMILY = Family(
    name="mamba2",
    title="Mamba-2",
    geometry=GEOMETRY,
    state_table=STATE_TABLE,
    dtypes=DTYPES,
    reference="trtllm_replayssm.families.mamba2.reference",
    bytes_per_step=costs.mamba2_bytes_per_step,
    geometries=GEOMETRIES,
    steps="trtllm_replayssm.families.mamba2.steps",
    layer_group="trtllm_replayssm.families.mamba2.layers:Mamba2Layers",
    trt_plugin="trtllm_replayssm.families.mamba2.trt_plugin",
    spec_types=(KernelSpec,),
)

__all__ = ["FAMILY", "GEOMETRY", "STATE_TABLE", "DTYPES"]
