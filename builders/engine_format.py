# SPDX-License-Identifier: Apache-2.0
"""The engine-directory format: what :mod:`builders.engine` writes and :mod:`builders.triton_repo` reads.

One directory per engine (``scripts/build_engine.py --out DIR``), in one of two formats, named with
their version in ``config.json``'s ``format``:

**Standard decode**, ``trtllm-replayssm-decode-step/1`` (:data:`DECODE_FORMAT`), one token per row and step:

  model.onnx        the decode step, batch dimension dynamic (1..max_batch): one ``replayssm::mamba2_decode``
                    node per Mamba-2 layer (Nemotron-H / Nemotron 3, builders/decode_step.py), one
                    ``replayssm::gdn_decode`` node per Gated DeltaNet layer (Qwen3-Next / Qwen3.5,
                    builders/qwen_export.py) or one ``replayssm::kda_decode`` node per Kimi Delta Attention layer
                    (Kimi-Linear, builders/kimi_step.py; GLM-5 Next, builders/glm5_export.py)
  <spec key>.ptx    the plugin kernel shared by all those layers, one per plugin tactic (large / small
                    batch), the PTX and launch parameters ``trt_plugin``'s ``aot_impl`` hands TensorRT
  config.json       below
  trtexec.sh        the trtexec command that builds model.plan from model.onnx (plugins registered first)
  model.plan        only where TensorRT >= 10.9 and a GPU were present at build time

**Speculative**, ``trtllm-replayssm-spec-step/1`` (:data:`SPEC_FORMAT`), T = num_draft + 1 tokens per row
and step, two graphs run once each per step with sampling in between (verify: builders/decode_step.py with
num_draft > 0; commit: builders/spec_step.py):

  verify.onnx       input_ids (batch, T), lengths, cursor (batch, 2), the states -> logits (batch, T, vocab)
                    and the states; one ``replayssm::mamba2_verify`` (``replayssm::gdn_verify``) node per
                    Mamba-2 (Gated DeltaNet) layer
  commit.onnx       n_accepted, cursor, lengths, the conv windows -> cursor_out (one ``replayssm::spec_commit``
                    node), lengths_out, the conv windows rolled back
  <spec key>.ptx    the verify kernel per tactic and the spec_commit kernel
  config.json       below
  trtexec.sh        the commands for verify.plan and commit.plan
  verify.plan, commit.plan   only where TensorRT >= 10.9 and a GPU were present

config.json, both formats:

  format            :data:`DECODE_FORMAT` or :data:`SPEC_FORMAT`
  model             source (checkpoint directory or ``embedded-tiny-<name>``), seed (tiny only, else null),
                    pattern (one letter per layer, :data:`LAYER_NAMES`), vocab_size, hidden_size,
                    layer_types, attention_layers; Nemotron: mamba_layers, moe_layers and, with MoE layers,
                    moe (the MoE config keys and the graph formulation); GDN: gdn_layers and, with sparse MoE
                    layers (Qwen3-Next), moe_layers and moe (its config keys and the formulation); KDA
                    (Kimi-Linear): kda_layers, moe_layers and moe; GLM-5 Next: also hc_mult (hyper-connection
                    streams) and dsa (the indexer's config keys); model_type (the checkpoint's config.json
                    model_type; builders/models.py's registry knows the kind by it)
  max_batch, max_seq_len, buffer_len, act_dtype, state_dtype (fp32 / bf16 / fp16), arch (SM of the PTX);
                    shadow where built with one ("bf16" or "fp8": the checkpoint shadow, below; absent: none)
  states            every state tensor (below): name, shape (batch as -1), dtype (numpy / ONNX name: float32,
                    bfloat16, float16, float8_e4m3fn, int32, int64) and, standard, ``output`` (its ``<name>_out``
                    output) or, speculative, ``updated_by`` ({graph: output name})
  trtexec           the command (standard) or the two commands (speculative) of trtexec.sh

  standard only:    inputs (name, shape, dtype: input_ids (batch, 1) int64, lengths, cursor, then the
                    per-layer states), outputs (logits (batch, vocab) float32, lengths_out, cursor_out,
                    then every per-layer ``<name>_out``), plan (null or "model.plan"), plugin (op_type,
                    domain, plugin_namespace, aot, nodes, the plugin attributes, kernels, inputs, outputs,
                    aliased_outputs)
  speculative only: num_draft, num_tokens (T), conv_window (the conv window width K - 1 + num_draft),
                    graphs ({verify, commit}: onnx, plan, inputs, outputs, trtexec), step (the order:
                    verify, sample, commit), plugin (domain, plugin_namespace, aot, plugins: per plugin
                    its manifest plus op_type, graph, nodes, attributes, kernels)

  kernels           per tactic: tactic, ptx (file name), spec (its key), kernel (entry name), grid, block,
                    shared_mem, extra_int32_args (the launch TensorRT makes)

State I/O. Shared by all layers: ``lengths`` (batch,) int32 (tokens in the K/V caches) and ``cursor``
(batch,) int32 standard (ring fill, advanced by the step) or (batch, 2) int32 speculative (ring start,
committed count; moved by the commit graph). Per layer i, by its pattern letter (:data:`LAYER_STATES`;
shapes after the batch dimension, in the sizes of :class:`LayerState`):

  M  Mamba-2          conv_state_i (conv_dim = nheads headdim + 2 ngroups dstate, conv_kernel) act,
                      ssm_state_i (nheads, headdim, dstate) state dtype, x_cache_i (nheads, L, headdim) act,
                      B_cache_i (ngroups, L, dstate) act, dt_cache_i (nheads, L) float32
  G  Gated DeltaNet   conv_state_i (conv_dim = 2 H K + HV V, conv_kernel) act, gdn_state_i (HV, V, K) float32,
                      gdn_u_i (HV, L, V) float32, gdn_v_i (HV, L, V) act, gdn_k_i (H, L, K) float32,
                      gdn_g_i (HV, L) float32, gdn_beta_i (HV, L) float32
  K  Kimi Delta       conv_state_i (conv_dim = 3 H K, conv_kernel) act, kda_state_i (H, K, V) float32,
     Attention        kda_k_i (H, L, K) act, kda_u_i (H, L, V) float32 (bfloat16 in an engine with a shadow),
                      kda_g_i (H, L, K) float32,
                      kda_v_i (H, L, V) act, kda_beta_i (H, L) float32 (trtllm_replayssm/families/kda's table)
  *  attention        k_cache_i, v_cache_i (kv_heads, max_seq_len, head_dim) act
  A  MLA attention    mla_kv_i (max_seq_len, kv_lora_rank) act (the normed latent), mla_k_rope_i (max_seq_len,
                      qk_rope_head_dim) act (the shared rope part of the key)
  D  DSA attention    dsa_kv_i (max_seq_len, kv_lora_rank) act (the normed latent; NoPE: no rope key),
                      dsa_index_k_i, dsa_index_gate_i (max_seq_len, index_head_dim) act (the indexer's key and
                      k-pool compress-gate score; valid: position < lengths)   (GLM-5 Next, builders/glm5_export.py)
  d  DSA attention    dsa_kv_i only: the layer reuses the previous D layer's top-k (indexer_types "shared")
     sharing top-k
  E  MoE, - MLP       none (their weights are in the graph)

A standard engine built with a bf16 shadow of its fp32 checkpoints (config.json ``shadow``: "bf16"; absent or
"none": no shadow) has one more state per M layer, after ssm_state_i: ssm_shadow_i (nheads, headdim, dstate)
bfloat16 (``replayssm::mamba2_decode_shadow``), and per G layer, after gdn_state_i: gdn_shadow_i (HV, V, K)
bfloat16 (``replayssm::gdn_decode_shadow``), and per K layer, after kda_state_i: kda_shadow_i (H, K, V)
bfloat16 (``replayssm::kda_decode_shadow``); non-flush steps read it, flush steps rewrite it. With "fp8"
(Mamba-2 layers) the M layer's shadow is ssm_shadow_i (nheads, headdim, dstate) float8_e4m3fn (ONNX
FLOAT8E4M3FN) followed by ssm_shadow_scale_i (nheads, headdim) float32, its per-row scales. Speculative
engines carry the same shadow states (``mamba2_verify_shadow`` / ``gdn_verify_shadow`` / ``kda_verify_shadow``: the
verify graph updates them, the commit graph does not touch them).

Speculative engines name the conv state ``conv_window_i`` (width K - 1 + num_draft instead of K). Each
state's output is ``<name>_out``, same shape and dtype (in place in TensorRT: aliased plugin outputs).
The step modules build their state I/O from :data:`LAYER_STATES` (``state_specs()``), and
:func:`check_layer_states` checks a config.json's states against it (the builder before writing, the
Triton repository writer before reading).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile

FORMAT_VERSION = 1  # bump on any change a reader of an older directory would misread
DECODE_FORMAT = f"trtllm-replayssm-decode-step/{FORMAT_VERSION}"
SPEC_FORMAT = f"trtllm-replayssm-spec-step/{FORMAT_VERSION}"
SPEC_FORMAT_PREFIX = "trtllm-replayssm-spec-step"  # any version: a speculative pair, whatever else it says

SHARED_STATES = ("lengths", "cursor")
CONFIG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # act_dtype / state_dtype -> ONNX names


class FormatError(ValueError):
    """A config.json that does not follow this format."""


def staging_dir(parent: pathlib.Path, prefix: str) -> pathlib.Path:
    """A temporary sibling to write a directory in before renaming it into place (engine directories, Triton
    models), with the mode a plain mkdir would give under the current umask: mkdtemp's 0700 would survive
    the rename and hide the directory from a server running under another uid."""
    tmp = pathlib.Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


@dataclasses.dataclass(frozen=True)
class LayerState:
    """One per-layer state tensor: ``<prefix>_<layer>`` in, ``<prefix>_<layer>_out`` out.

    ``dims``: its sizes after the batch dimension, by name (``nheads``, ``headdim``, ``dstate``,
    ``ngroups``, ``buffer_len``, ``conv_dim``, ``conv_width``, ``kv_heads``, ``max_seq_len``,
    ``head_dim``, ``num_k_heads``, ``num_v_heads``, ``num_heads``, ``key_dim``, ``value_dim``,
    ``kv_lora_rank``, ``qk_rope_head_dim``, ``index_head_dim``), which the step resolves
    from its model config. ``dtype``: ``act`` (the engine's activations), ``state`` (the checkpoint dtype,
    --state-dtype) or a fixed ONNX dtype name."""

    prefix: str
    dims: tuple[str, ...]
    dtype: str

    def name(self, layer: int) -> str:
        return f"{self.prefix}_{layer}"

    def output(self, layer: int) -> str:
        return f"{self.prefix}_{layer}_out"

    def shape(self, sizes: dict) -> tuple:
        """(-1, ...) with the batch as -1 and the other dimensions from ``sizes`` (name -> int)."""
        return (-1, *(sizes[d] for d in self.dims))


CONV_STATE = LayerState("conv_state", ("conv_dim", "conv_width"), "act")
# The KDA u ring: float32 without a shadow, bfloat16 with one (trtllm_replayssm/families/kda/config.RING_TYPES);
# layer_states resolves it from the engine's shadow.
RING = "ring"
CONV_WINDOW = "conv_window"  # the speculative engines' name of the conv state (a wider window)
MAMBA2_STATES = (
    CONV_STATE,
    LayerState("ssm_state", ("nheads", "headdim", "dstate"), "state"),
    LayerState("x_cache", ("nheads", "buffer_len", "headdim"), "act"),
    LayerState("B_cache", ("ngroups", "buffer_len", "dstate"), "act"),
    LayerState("dt_cache", ("nheads", "buffer_len"), "float32"),  # processed dt
)
GDN_STATES = (  # trtllm_replayssm/families/gdn/reference.py's GDNBuffers, the checkpoint in vLLM's (HV, V, K) layout
    CONV_STATE,
    LayerState("gdn_state", ("num_v_heads", "value_dim", "key_dim"), "float32"),
    LayerState("gdn_u", ("num_v_heads", "buffer_len", "value_dim"), "float32"),
    LayerState("gdn_v", ("num_v_heads", "buffer_len", "value_dim"), "act"),
    LayerState("gdn_k", ("num_k_heads", "buffer_len", "key_dim"), "float32"),
    LayerState("gdn_g", ("num_v_heads", "buffer_len"), "float32"),
    LayerState("gdn_beta", ("num_v_heads", "buffer_len"), "float32"),
)
KDA_STATES = (  # trtllm_replayssm/families/kda's state table (checked against it: tests/test_kda_export.py), the
    CONV_STATE,  # checkpoint in the (H, K, V) layout, the plugin's input order; the u ring's dtype: layer_states
    LayerState("kda_state", ("num_heads", "key_dim", "value_dim"), "float32"),
    LayerState("kda_k", ("num_heads", "buffer_len", "key_dim"), "act"),
    LayerState("kda_u", ("num_heads", "buffer_len", "value_dim"), RING),
    LayerState("kda_g", ("num_heads", "buffer_len", "key_dim"), "float32"),
    LayerState("kda_v", ("num_heads", "buffer_len", "value_dim"), "act"),
    LayerState("kda_beta", ("num_heads", "buffer_len"), "float32"),
)
MLA_STATES = (  # multi-head latent attention (Kimi-Linear): the cached latent and the shared rope key, per position
    LayerState("mla_kv", ("max_seq_len", "kv_lora_rank"), "act"),
    LayerState("mla_k_rope", ("max_seq_len", "qk_rope_head_dim"), "act"),
)
DSA_STATES = (  # DeepSeek sparse attention (GLM-5 Next, NoPE): the cached latent, the indexer's key and k-pool
    LayerState("dsa_kv", ("max_seq_len", "kv_lora_rank"), "act"),  # compress-gate score, per position
    LayerState("dsa_index_k", ("max_seq_len", "index_head_dim"), "act"),
    LayerState("dsa_index_gate", ("max_seq_len", "index_head_dim"), "act"),
)
SHADOW_STATE = LayerState("ssm_shadow", ("nheads", "headdim", "dstate"), "bfloat16")  # with shadow "bf16"
FP8_SHADOW_STATES = (LayerState("ssm_shadow", ("nheads", "headdim", "dstate"), "float8_e4m3fn"),  # shadow "fp8"
                     LayerState("ssm_shadow_scale", ("nheads", "headdim"), "float32"))  # per-row scales
GDN_SHADOW_STATE = LayerState("gdn_shadow", ("num_v_heads", "value_dim", "key_dim"), "bfloat16")
KDA_SHADOW_STATE = LayerState("kda_shadow", ("num_heads", "key_dim", "value_dim"), "bfloat16")
SHADOWS = ("none", "bf16", "fp8")  # config.json ``shadow`` values (an SSM layer keeps those of SHADOW_STATES)
ATTENTION_STATES = (
    LayerState("k_cache", ("kv_heads", "max_seq_len", "head_dim"), "act"),
    LayerState("v_cache", ("kv_heads", "max_seq_len", "head_dim"), "act"),
)
LAYER_STATES = {"M": MAMBA2_STATES, "*": ATTENTION_STATES, "E": (), "-": (), "G": GDN_STATES,  # by pattern letter
                "K": KDA_STATES, "A": MLA_STATES, "D": DSA_STATES, "d": DSA_STATES[:1]}
LAYER_NAMES = {"M": "Mamba-2", "*": "attention", "E": "MoE", "-": "MLP", "G": "Gated DeltaNet",
               "K": "Kimi Delta Attention", "A": "MLA attention", "D": "DSA attention",
               "d": "DSA attention sharing the previous top-k"}
# the checkpoint shadows of an SSM layer by pattern letter: shadow -> its states, after the layer's checkpoint
SHADOW_STATES = {"M": {"bf16": (SHADOW_STATE,), "fp8": FP8_SHADOW_STATES}, "G": {"bf16": (GDN_SHADOW_STATE,)},
                 "K": {"bf16": (KDA_SHADOW_STATE,)}}


def layer_states(letter: str, speculative: bool = False, shadow: str = "none") -> tuple[LayerState, ...]:
    """The state tensors of a layer with pattern letter ``letter``, in engine I/O order; ``speculative``:
    the conv state is the verify graph's ``conv_window``; ``shadow`` "bf16" / "fp8": an SSM layer's checkpoint
    shadow state(s) after its checkpoint."""
    if letter not in LAYER_STATES:
        raise FormatError(f"letter: expected one of {''.join(LAYER_STATES)}, got {letter!r}")
    if shadow not in SHADOWS:
        raise FormatError(f"shadow: expected one of {SHADOWS}, got {shadow!r}")
    states = LAYER_STATES[letter]
    if speculative:
        states = tuple(dataclasses.replace(s, prefix=CONV_WINDOW) if s is CONV_STATE else s for s in states)
    if shadow != "none" and letter in SHADOW_STATES:  # after the checkpoint
        kept = SHADOW_STATES[letter]
        if shadow not in kept:
            raise FormatError(f"shadow: a {LAYER_NAMES[letter]} layer keeps a {' or '.join(kept)} shadow, got "
                              f"{shadow!r}")
        states = states[:2] + kept[shadow] + states[2:]
    ring = "float32" if shadow == "none" else "bfloat16"
    return tuple(dataclasses.replace(s, dtype=ring) if s.dtype == RING else s for s in states)


def is_speculative(cfg: dict) -> bool:
    return str(cfg.get("format", "")).startswith(SPEC_FORMAT_PREFIX)


def check_layer_states(cfg: dict) -> None:
    """The states are exactly the shared ones plus those of each layer of ``model.pattern``, each with the dtype
    the format gives it (``act`` / ``state`` states in ``act_dtype`` / ``state_dtype``, shadows in theirs)."""
    pattern = cfg.get("model", {}).get("pattern")
    if not isinstance(pattern, str):
        raise FormatError(f"config.json: model.pattern: expected the layer pattern string (e.g. 'MEM*EM*E'), "
                          f"got {pattern!r}")
    bad = [(i, c) for i, c in enumerate(pattern) if c not in LAYER_STATES]
    if bad:
        raise FormatError(f"config.json: model.pattern {pattern!r}: expected only {''.join(LAYER_STATES)}, got "
                          f"{bad[0][1]!r} at layer {bad[0][0]}")
    spec = is_speculative(cfg)
    shadow = cfg.get("shadow", "none")
    refused = [LAYER_NAMES[c] for c in dict.fromkeys(pattern) if c in SHADOW_STATES and shadow != "none"
               and shadow not in SHADOW_STATES[c]]
    if shadow not in SHADOWS or refused:
        kept = "; ".join(f"{LAYER_NAMES[c]}: none or {' or '.join(SHADOW_STATES[c])}" for c in SHADOW_STATES)
        raise FormatError(f"config.json: shadow: expected one of {SHADOWS} ({kept}), got {shadow!r}")
    by_letter = {c: layer_states(c, spec, shadow if c in pattern else "none") for c in LAYER_STATES}
    prefixes = {c: [s.prefix for s in states] for c, states in by_letter.items()}
    names = [s["name"] for s in cfg["states"]]
    have = set(names)
    for i, c in enumerate(pattern):
        missing = [f"{k}_{i}" for k in prefixes[c] if f"{k}_{i}" not in have]
        if missing:
            raise FormatError(f"layer {i} ({LAYER_NAMES[c]}, pattern {pattern!r}): states {missing} missing")
    want = set(SHARED_STATES) | {f"{k}_{i}" for i, c in enumerate(pattern) for k in prefixes[c]}
    for n in names:
        if n not in want:
            idx = n.rpartition("_")[2]
            if idx.isdigit() and int(idx) < len(pattern):
                c = pattern[int(idx)]
                raise FormatError(f"state {n!r}: layer {idx} is a {LAYER_NAMES[c]} layer ({c!r} in pattern "
                                  f"{pattern!r}), which has {'no states' if not prefixes[c] else prefixes[c]}")
            raise FormatError(f"state {n!r}: expected {list(SHARED_STATES)} or a per-layer state of pattern {pattern!r}")
    if len(names) != len(have):
        raise FormatError(f"config.json: states: {sorted(n for n in have if names.count(n) > 1)} listed twice")
    dtypes = {"act": CONFIG_DTYPES.get(cfg.get("act_dtype")), "state": CONFIG_DTYPES.get(cfg.get("state_dtype"))}
    for role, key in (("act", "act_dtype"), ("state", "state_dtype")):
        if dtypes[role] is None:
            raise FormatError(f"config.json: {key}: expected one of {sorted(CONFIG_DTYPES)}, got {cfg.get(key)!r}")
    if shadow != "none" and cfg["state_dtype"] != "fp32":
        raise FormatError(f"config.json: shadow {shadow!r}: expected state_dtype 'fp32' (a shadow is of an fp32 "
                          f"checkpoint), got {cfg['state_dtype']!r}")
    want_dtype = {n: "int32" for n in SHARED_STATES}
    for i, c in enumerate(pattern):
        for st in by_letter[c]:
            want_dtype[st.name(i)] = dtypes.get(st.dtype, st.dtype)
    for s in cfg["states"]:
        if s.get("dtype") != want_dtype[s["name"]]:
            raise FormatError(f"state {s['name']!r}: dtype: expected {want_dtype[s['name']]!r} (act_dtype "
                              f"{cfg['act_dtype']!r}, state_dtype {cfg['state_dtype']!r}, shadow {shadow!r}), "
                              f"got {s.get('dtype')!r}")
