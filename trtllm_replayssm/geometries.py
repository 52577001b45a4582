# SPDX-License-Identifier: Apache-2.0
"""Named geometries of real hybrid Mamba-2 and Gated DeltaNet models: the SSM layer shape, and for the
Nemotron 3, Qwen3-Next and Qwen3.5 families the layer stack (pattern, MoE sizes), shared by the tests,
the benchmarks and the memory model.

``GEOMETRIES[name] = (nheads, headdim, dstate, ngroups)`` of one Mamba-2 layer (docs/DESIGN.md §3).
``MODELS[name]`` is a :class:`HybridModel`: the same four numbers plus the layer pattern of
``config.json`` (``hybrid_override_pattern``: M = Mamba-2, E = MoE, * = attention, - = MLP) and the
MoE sizes, for the models whose layer stack a benchmark or a memory table needs.

Sources of the Nemotron 3 rows: the published ``config.json`` files,

* https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/blob/main/config.json
* https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16/blob/main/config.json

read through verbatim copies in public repositories and model cards (the search tool's index,
2026-12): the same values in every copy (Nano: also NVIDIA's Megatron-Bridge page "Nemotron 3
Nano", 23 Mamba-2 + 23 MoE + 6 attention layers, 128 experts + 1 shared, 6 active; Super: 88
layers, 40 M + 40 E + 8 *). The Super checkpoint also carries one MTP block (pattern ``*E``,
``num_nextn_predict_layers: 1``) that is not part of the decode stack.

Gated DeltaNet models (Qwen3-Next, Qwen3.5; :mod:`.families.gdn.reference`): ``GDN_MODELS[name]`` is a
:class:`GDNModel`, the linear-attention (GDN) layer shape and the layer stack of ``config.json``
(``linear_*`` keys; every ``full_attention_interval``-th layer is gated softmax attention, the others
GDN); ``GDN_GEOMETRIES[name] = (HV, H, V, K)`` = (linear_num_value_heads, linear_num_key_heads,
linear_value_head_dim, linear_key_head_dim), the order of :meth:`.families.gdn.reference.GDNBuffers.alloc`.
Sources, the published ``config.json`` files (for the Qwen3.5 ones, their ``text_config``):

* https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json
* https://huggingface.co/Qwen/Qwen3.5-397B-A17B/blob/main/config.json
* https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json

read through verbatim copies in public repositories (the search tool's index, 2026-12; for the
397B also NVIDIA Megatron-Bridge's Qwen3.5 test fixture and MLPerf's model table: 60 layers, GDN
heads V/QK 64/16 of dim 128), all agreeing; the Qwen3-Next-80B and Qwen3.5-35B-A3B rows are also
the defaults of transformers' ``Qwen3NextConfig`` and ``Qwen3_5MoeTextConfig``, whose docstrings
name those checkpoints (tests/test_gdn_reference.py checks it). Every model also carries one MTP
layer (``mtp_num_hidden_layers: 1`` / ``num_nextn_predict_layers``) outside the decode stack.
"""

from __future__ import annotations

import dataclasses

from .costs import gdn_state_bytes


@dataclasses.dataclass(frozen=True)
class HybridModel:
    """One hybrid model's decode-relevant shape, as its config.json states it."""

    hf_id: str
    pattern: str  # hybrid_override_pattern
    hidden_size: int
    nheads: int  # mamba_num_heads
    headdim: int  # mamba_head_dim
    dstate: int  # ssm_state_size
    ngroups: int  # n_groups
    conv_kernel: int = 4
    num_attention_heads: int = 32
    num_key_value_heads: int = 2
    head_dim: int = 128
    vocab_size: int = 131072
    # MoE ("E" layers): routed experts, top-k, expert / shared-expert widths, latent projection
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    n_shared_experts: int = 0
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    mlp_hidden_act: str = "relu2"

    @property
    def geometry(self) -> tuple[int, int, int, int]:
        return (self.nheads, self.headdim, self.dstate, self.ngroups)

    def count(self, kind: str) -> int:
        """Layers of one kind: "M", "E", "*" or "-"."""
        return self.pattern.count(kind)

    @property
    def mamba_layers(self) -> int:
        return self.count("M")

    def config_overrides(self) -> dict:
        """Keyword arguments of ``transformers.NemotronHConfig`` for this stack (weights not included)."""
        return dict(
            hybrid_override_pattern=self.pattern, hidden_size=self.hidden_size, mamba_num_heads=self.nheads,
            mamba_head_dim=self.headdim, ssm_state_size=self.dstate, n_groups=self.ngroups,
            conv_kernel=self.conv_kernel, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
            n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            n_shared_experts=self.n_shared_experts, moe_latent_size=self.moe_latent_size,
            routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group, topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob, mlp_hidden_act=self.mlp_hidden_act,
        )


MODELS = {
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json (URL in the module docstring)
    "nemotron3_nano": HybridModel(
        hf_id="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        hidden_size=2688, nheads=64, headdim=64, dstate=128, ngroups=8,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_shared_experts=1, moe_latent_size=None,
        routed_scaling_factor=2.5, n_group=1, topk_group=1,
    ),
    # nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 config.json (URL in the module docstring); LatentMoE:
    # the routed experts run in a 1024-wide latent space (fc1_latent_proj / fc2_latent_proj around them)
    "nemotron3_super": HybridModel(
        hf_id="nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
        pattern="MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
        hidden_size=4096, nheads=128, headdim=64, dstate=128, ngroups=8,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, n_shared_experts=1, moe_latent_size=1024,
        routed_scaling_factor=5.0, n_group=1, topk_group=1,
    ),
}

# (nheads, headdim, dstate, ngroups) of one Mamba-2 layer (docs/DESIGN.md §3; Nemotron 3 rows: MODELS).
GEOMETRIES = {
    "tiny": (4, 64, 64, 2),
    "nemotron_h_8b": (128, 64, 128, 8),
    "nano_9b_v2": (128, 80, 128, 8),
    "nano3_4b": (96, 80, 128, 8),
    "ultra_550b": (256, 64, 128, 8),
    "h_56b": (256, 64, 256, 8),
    **{name: m.geometry for name, m in MODELS.items()},
}


@dataclasses.dataclass(frozen=True)
class GDNModel:
    """One Gated DeltaNet hybrid's decode-relevant shape, as its config.json states it."""

    hf_id: str
    hidden_size: int
    num_hidden_layers: int
    full_attention_interval: int  # layer i is full attention iff (i + 1) % interval == 0
    num_v_heads: int  # linear_num_value_heads (HV)
    num_k_heads: int  # linear_num_key_heads (H)
    head_v_dim: int  # linear_value_head_dim (V)
    head_k_dim: int  # linear_key_head_dim (K)
    conv_kernel: int = 4  # linear_conv_kernel_dim
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    vocab_size: int = 151936
    num_experts: int = 0
    num_experts_per_tok: int = 0

    @property
    def geometry(self) -> tuple[int, int, int, int]:
        """(HV, H, V, K) of one GDN layer."""
        return (self.num_v_heads, self.num_k_heads, self.head_v_dim, self.head_k_dim)

    @property
    def layer_types(self) -> list[str]:
        """config.json's ``layer_types``: "linear_attention" (GDN) or "full_attention" per layer."""
        n = self.full_attention_interval
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers)]

    @property
    def gdn_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv1d over q|k|v (2 H K + HV V)."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def state_bytes(self, state_bytes: int = 4) -> int:
        """One slot's recurrent state (HV, V, K) in one GDN layer."""
        return gdn_state_bytes(self.num_v_heads, self.head_v_dim, self.head_k_dim, state_bytes)


GDN_MODELS = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (URL in the module docstring): 48 layers, 36 GDN + 12 attention
    "qwen3_next_80b": GDNModel(
        hf_id="Qwen/Qwen3-Next-80B-A3B-Instruct", hidden_size=2048, num_hidden_layers=48, full_attention_interval=4,
        num_v_heads=32, num_k_heads=16, head_v_dim=128, head_k_dim=128, conv_kernel=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=151936,
        num_experts=512, num_experts_per_tok=10,
    ),
    # Qwen/Qwen3.5-397B-A17B config.json, text_config (URL in the module docstring): 60 layers, 45 GDN + 15 attention
    "qwen3_5_397b": GDNModel(
        hf_id="Qwen/Qwen3.5-397B-A17B", hidden_size=4096, num_hidden_layers=60, full_attention_interval=4,
        num_v_heads=64, num_k_heads=16, head_v_dim=128, head_k_dim=128, conv_kernel=4,
        num_attention_heads=32, num_key_value_heads=2, head_dim=256, vocab_size=248320,
        num_experts=512, num_experts_per_tok=10,
    ),
    # Qwen/Qwen3.5-35B-A3B config.json, text_config (URL in the module docstring): 40 layers, 30 GDN + 10 attention
    "qwen3_5_35b": GDNModel(
        hf_id="Qwen/Qwen3.5-35B-A3B", hidden_size=2048, num_hidden_layers=40, full_attention_interval=4,
        num_v_heads=32, num_k_heads=16, head_v_dim=128, head_k_dim=128, conv_kernel=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=248320,
        num_experts=256, num_experts_per_tok=8,
    ),
}

# (HV, H, V, K) of one GDN layer: a small synthetic one, then the models above.
GDN_GEOMETRIES = {
    "tiny_gdn": (4, 2, 16, 16),
    **{name: m.geometry for name, m in GDN_MODELS.items()},
}
