# SPDX-License-Identifier: Apache-2.0
"""Seeded random Nemotron-H / Nemotron 3 models for the benchmarks and tests: the layer stack of a real
model (transformers' ``NemotronHConfig``, published sizes), weights drawn from a seeded generator on the
target device (no checkpoint is downloaded), so every benchmark and test builds the same model.

``model_config(tiny, layers, vocab, geometry)``: the embedded tiny configs (CPU tests), Nemotron-H-8B, or a
Nemotron 3 model of :data:`trtllm_replayssm.geometries.MODELS`; ``build_model(config, device, dtype, seed)``
materializes it directly on the device (meta init, then :func:`randomize_`).
"""

from __future__ import annotations

import contextlib
import math

import torch

from trtllm_replayssm.geometries import MODELS

from .nemotron_h import TINY3_CONFIG, TINY_CONFIG

# Megatron-Bridge NemotronHModelProvider8B (hybrid_layer_pattern, hidden 4096, ffn 21504, 128 Mamba
# heads of 64, state 128, 8 groups, 32 heads, 8 query groups, kv_channels 128) + HF defaults.
NEMOTRON_H_8B = dict(
    vocab_size=131072,
    hidden_size=4096,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=21504,
    mlp_hidden_act="relu2",
    mamba_num_heads=128,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=8,
    conv_kernel=4,
    chunk_size=128,
    use_conv_bias=True,
    mamba_proj_bias=False,
    mlp_bias=False,
    attention_bias=False,
    max_position_embeddings=8192,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    eos_token_id=None,
    pad_token_id=0,
    bos_token_id=1,
)


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


MODEL_GEOMETRIES = ("nemotron_h_8b", "nemotron3_nano", "nemotron3_super")


def model_config(tiny: bool | str = False, layers: int | None = None, vocab: int | None = None,
                 geometry: str = "nemotron_h_8b", **overrides):
    """The benchmark's ``NemotronHConfig``: ``tiny`` (True or "nemotron_h": the embedded tiny Nemotron-H,
    "nemotron3": the tiny Nemotron 3 with MoE layers) or a real model's layer stack, ``geometry`` one of
    MODEL_GEOMETRIES (Nemotron-H-8B, or a Nemotron 3 model from trtllm_replayssm.geometries.MODELS, its
    published config.json sizes); ``layers``: the first N layers of the pattern."""
    from transformers import NemotronHConfig

    if tiny:
        d = dict(TINY3_CONFIG if tiny == "nemotron3" else TINY_CONFIG)
    elif geometry == "nemotron_h_8b":
        d = dict(NEMOTRON_H_8B)
    elif geometry in MODELS:
        d = {**NEMOTRON_H_8B, **MODELS[geometry].config_overrides()}
    else:
        raise ValueError(f"geometry: expected one of {MODEL_GEOMETRIES}, got {geometry!r}")
    if vocab:
        d["vocab_size"] = vocab
    if layers:
        pattern = d["hybrid_override_pattern"]
        if not 1 <= layers <= len(pattern):
            raise ValueError(f"--layers: expected 1..{len(pattern)}, got {layers}")
        d["hybrid_override_pattern"] = pattern[:layers]
    d.update(overrides)
    return NemotronHConfig(**d)


@torch.no_grad()
def randomize_(model, seed: int = 0):
    """Seeded random weights drawn on the parameters' device, O(1) activations (the distributions of
    :func:`builders.nemotron_h.randomize_`, one generator per tensor so no host round trip)."""
    for idx, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + idx)
        leaf = name.rsplit(".", 1)[-1]

        def rand(gen=g, p=p):
            return torch.rand(p.shape, generator=gen, device=p.device)

        def randn(gen=g, p=p):
            return torch.randn(p.shape, generator=gen, device=p.device)

        if leaf == "A_log":  # A = -exp(A_log) in [-16, -1]
            v = torch.log(rand() * 15 + 1)
        elif leaf == "dt_bias":  # softplus(dt_bias) log-uniform in [1e-3, 0.1]
            dt = torch.exp(rand() * math.log(100.0) + math.log(1e-3))
            v = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "D" or name.endswith(("norm.weight", "norm_f.weight")):
            v = 1 + 0.1 * randn()
        elif leaf == "bias":
            v = 0.1 * randn()
        elif p.dim() >= 2:  # (out, in), conv (C, 1, K), experts (E, out, in): the last dim is the fan-in
            fan_in = p.shape[-1] if "embeddings" not in name else 1
            v = randn() * fan_in ** -0.5
        else:
            v = randn()
        p.copy_(v.to(p.dtype))
    for idx, (name, b) in enumerate(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):  # MoE routing: large enough to move the choice
            g = torch.Generator(device=b.device).manual_seed(seed * 1_000_003 + 500_000 + idx)
            b.copy_(0.1 * torch.randn(b.shape, generator=g, device=b.device))
    return model


def build_model(config, device="cpu", dtype=torch.bfloat16, seed: int = 0):
    """``NemotronHForCausalLM`` of ``config`` materialized directly on ``device`` in ``dtype``."""
    from transformers import NemotronHForCausalLM

    with _default_dtype(dtype), torch.device("meta"):
        model = NemotronHForCausalLM(config)
    model = model.to_empty(device=device)
    for name, mod in model.named_modules():  # the MoE router stays fp32, as transformers keeps it
        if name.endswith(".mixer.gate"):
            mod.float()
    return randomize_(model, seed).eval()
