# SPDX-License-Identifier: Apache-2.0
"""Kimi Delta Attention (KDA): Gated DeltaNet with a per-key-channel decay (Kimi-K3, Kimi-Linear, GLM-5.3-Flash).

The family folder (issue 37, the first of the family interface of issue 36): :mod:`.reference` is the float64
executable spec (conventional step, ReplaySSM standard decode, speculative verify / commit, bf16 shadow) and
holds the state table; the bytes model is :mod:`trtllm_replayssm.costs`' ``kda_*`` functions. Kernels, cache,
plugins and builders come next (issue 37's later deliverables) and join :data:`FAMILY` as fields.

:data:`GEOMETRIES`: one KDA layer's (H, K, V) per GPU, from the published configs (issue 37; DESIGN.md §5):
Kimi-K3 96 heads of K = V = 128 (69 of 93 layers), Kimi-Linear-48B-A3B 32 heads of 128 (transformers'
``KimiLinearConfig`` defaults, 21 of 27 layers), GLM-5.3-Flash 64 heads of 128 (34 of 45 layers; forget gate bounded
at -5), at tensor parallelism 1 and 8 (heads split across GPUs).
"""

from __future__ import annotations

from ... import costs
from .. import Family
from . import reference
from .config import KDASpec, KDAVKSpec

MODELS = {  # name: (KDA heads, K, V, KDA layers, all layers)
    "kimi_k3": (96, 128, 128, 69, 93),
    "kimi_linear_48b": (32, 128, 128, 21, 27),  # transformers' KimiLinearConfig defaults
    "glm5_3_flash": (64, 128, 128, 34, 45),
}
GEOMETRIES = {f"{name}_tp{tp}": (H // tp, K, V) for name, (H, K, V, *_) in MODELS.items() for tp in (1, 8)}

FAMILY = Family(
    name="kda",
    title="KDA",
    geometry=reference.GEOMETRY,
    state_table=reference.STATE_TABLE,
    dtypes=reference.DTYPES,
    reference=reference.__name__,
    bytes_per_step=costs.kda_bytes_per_step,
    geometries=GEOMETRIES,
    steps="trtllm_replayssm.families.kda.steps",
    layer_group="trtllm_replayssm.families.kda.layers:KDALayers",
    trt_plugin="trtllm_replayssm.families.kda.trt_plugin",
    spec_types=(KDASpec, KDAVKSpec),
)

__all__ = ["FAMILY", "GEOMETRIES", "MODELS", "KDASpec", "reference"]
