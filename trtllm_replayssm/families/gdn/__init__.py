# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the family declaration of the family interface (issue 36).

State of one layer (:data:`STATE_TABLE`; the contract's table, :mod:`trtllm_replayssm.contract`, checked against
this one by tests/test_families.py): the checkpoint S0 (S, HV, V, K) with an optional bf16 shadow, and the rings
the exact fold and the output path read: the corrected updates u_j and v_j per value head, the l2-normalised k_j
per key head, the log decays g_j and beta_j. The float64 spec is :mod:`.reference`; kernels ``plugins/gdn/``, spec
:class:`.config.GDNSpec`, launchers :mod:`.ops`, executor steps :mod:`.steps`, cache layers
:mod:`.layers`, TensorRT plugins :mod:`.trt_plugin`, bytes model ``costs.gdn_*``. The declaration is the family's one
entry point for code that must not branch on a family's name.
"""

from __future__ import annotations

import torch

from ... import costs
from ...geometries import GDN_GEOMETRIES
from .. import Family, StateTensor
from .config import GDNSpec

GEOMETRY = ("HV", "Hk", "V", "K")  # value heads, key heads, value dim, key dim
STATE_TABLE = (
    StateTensor("state", ("slots", "HV", "V", "K"), "state", "prefill hand-off; the exact fold at a flush"),
    StateTensor("shadow", ("slots", "HV", "V", "K"), "shadow", "rewritten with the checkpoint", optional=True),
    StateTensor("u_cache", ("slots", "HV", "L", "V"), "f32", "each step: its token's corrected update u"),
    StateTensor("v_cache", ("slots", "HV", "L", "V"), "act", "each step: its token's v"),
    StateTensor("k_cache", ("slots", "Hk", "L", "K"), "f32", "each step: its token's l2-normalised k"),
    StateTensor("g_cache", ("slots", "HV", "L"), "f32", "each step: its token's log decay"),
    StateTensor("beta_cache", ("slots", "HV", "L"), "f32", "each step: its token's beta"),
)
DTYPES = {"state": torch.float32, "shadow": torch.bfloat16, "act": torch.bfloat16, "f32": torch.float32}

FAMILY = Family(
    name="gdn",
    title="GDN",
    geometry=GEOMETRY,
    state_table=STATE_TABLE,
    dtypes=DTYPES,
    reference="trtllm_replayssm.families.gdn.reference",
    bytes_per_step=costs.gdn_bytes_per_step,
    geometries=GDN_GEOMETRIES,
    steps="trtllm_replayssm.families.gdn.steps",
    layer_group="trtllm_replayssm.families.gdn.layers:GDNLayers",
    trt_plugin="trtllm_replayssm.families.gdn.trt_plugin",
    spec_types=(GDNSpec,),
)

__all__ = ["FAMILY", "GEOMETRY", "STATE_TABLE", "DTYPES"]
