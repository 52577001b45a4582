# SPDX-License-Identifier: Apache-2.0
"""TensorRT AOT plugins of Gated DeltaNet (Qwen3-Next / Qwen3.5): ``replayssm::gdn_decode`` / ``gdn_verify`` (+ ``_shadow``).

The family's part of :mod:`trtllm_replayssm.trt_plugin`, which registers, lists and checks it with the others through
the family interface (:attr:`~trtllm_replayssm.families.Family.trt_plugin`); the commit is the shared ``spec_commit``.

``replayssm::gdn_decode`` (+ ``gdn_decode_shadow``): one launch of ``gdn_replay_decode``
(plugins/gdn/gdn_decode.cu) per Gated DeltaNet layer (Qwen3-Next / Qwen3.5): the fused ReplaySSM GDN step
(output from the checkpoint and the buffered corrected updates, append, exact fold when the buffer
fills; trtllm_replayssm/families/gdn/reference.py). Inputs (H key heads, HV value heads, Kd key dim, V value dim):
  0  q                    (b, H, Kd)    act, raw (l2 norm and Kd^-1/2 inside)
  1  k                    (b, H, Kd)    act, raw
  2  v                    (b, HV, V)    act
  3  a                    (b, HV)       act, raw (g = -exp(A_log) softplus(a + dt_bias) inside)
  4  b                    (b, HV)       act, raw (beta = sigmoid(b) inside)
  5  A_log                (HV,)         fp32
  6  dt_bias              (HV,)         fp32
  7  state_batch_indices  (b,)          int32, -1 = padding row; or the step's ``replayssm::flush_order`` output
                                        (b, 4) (gdn_decode[_shadow]: the module that reads its rows there)
  8  cursor               (S,)          int32, read only (advanced once per step, shared with Mamba-2)
  9  state                (S, HV, V, Kd) fp32 checkpoint
  10 u_cache              (S, HV, L, V) fp32      11 v_cache (S, HV, L, V) act
  12 k_cache              (S, H, L, Kd) fp32      13 g_cache (S, HV, L) fp32     14 beta_cache (S, HV, L) fp32
  [15 shadow              (S, HV, V, Kd) bf16, gdn_decode_shadow only]
Outputs: 0 y (b, HV, V) act; 1-6 aliased to inputs 9-14 [7 shadow_out -> 15]. Attributes:
num_k_heads, num_v_heads, key_dim, value_dim, buffer_len, use_qk_l2norm (0/1; compiled into the
PTX). Kernel parameters: the input pointers, int32 batch, int32 slots, the output pointers. Tactics
as above (large / small batch geometry); grid (HV * V / rows, batch).

``replayssm::gdn_verify`` (+ ``gdn_verify_shadow``): one launch of ``gdn_verify`` (plugins/gdn/gdn_spec.cu)
per GDN layer of a speculative step, the GDN counterpart of ``mamba2_verify``: the T window tokens'
outputs from the checkpoint (or its bf16 shadow), the committed u ring and the window's triangular
system; the window entries (u, v, k, g, beta) appended at (start + count + t) % L; where count + 2T > L
the committed entries are first folded exactly into the checkpoint (and the shadow rewritten). The
same inputs as ``gdn_decode[_shadow]`` with a window axis: q, k (b, T, H, Kd), v (b, T, HV, V), a, b
(b, T, HV); cursor (S, 2) (ring start, committed count), read only. Outputs: y (b, T, HV, V) and the
same aliases. Attributes: those of ``gdn_decode`` + num_tokens. The commit is ``spec_commit`` (one
cursor for every layer, Mamba-2 or GDN).
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin checks the annotations of the functions register()
# decorates with issubclass(), so they must be classes, not strings.

from ...compile import compile_spec
from ...cursor import ORDER_COLUMNS
from ...trt_plugin import (
    ACT_DTYPES,
    TACTICS,
    TRT_TYPE_NAMES,
    AotKernel,
    as_int,
    check_dtypes,
    check_rows_input,
    check_spec_attributes,
    decode_verify_plugins,
    with_shadow,
)
from .config import gdn_spec

KERNEL_NAME = "gdn_replay_decode"
VERIFY_KERNEL_NAME = "gdn_verify"
ATTRIBUTES = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "buffer_len", "use_qk_l2norm")
VERIFY_ATTRIBUTES = ATTRIBUTES + ("num_tokens",)
INPUT_NAMES = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_batch_indices", "cursor", "state", "u_cache",
               "v_cache", "k_cache", "g_cache", "beta_cache")
OUTPUT_NAMES = ("y", "state_out", "u_cache_out", "v_cache_out", "k_cache_out", "g_cache_out", "beta_cache_out")
ALIASES = {1: 9, 2: 10, 3: 11, 4: 12, 5: 13, 6: 14}
SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES = with_shadow(INPUT_NAMES, OUTPUT_NAMES, ALIASES)
DECODE, DECODE_SHADOW, VERIFY, VERIFY_SHADOW = "gdn_decode", "gdn_decode_shadow", "gdn_verify", "gdn_verify_shadow"
DECODE_PLUGINS = (DECODE, DECODE_SHADOW)
VERIFY_PLUGINS = (VERIFY, VERIFY_SHADOW)
PLUGINS = decode_verify_plugins((DECODE, DECODE_SHADOW, VERIFY, VERIFY_SHADOW), KERNEL_NAME, VERIFY_KERNEL_NAME,
                                (INPUT_NAMES, OUTPUT_NAMES, ALIASES),
                                (SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES), ATTRIBUTES)


def aot_kernel(num_k_heads: int, num_v_heads: int, key_dim: int, value_dim: int, buffer_len: int,
                   use_qk_l2norm: int, act: str, arch: int, tactic: int = 1, shadow: str = "none",
                   row_order: bool = False) -> AotKernel:
    """PTX and launch parameters of one ``gdn_decode[_shadow]`` layer: the module and grid that
    ``gdn_ops.gdn_replay_decode`` launches for the tactic's batch geometry (argument order: inputs,
    batch, slots, outputs); ``row_order``: the module that reads its rows from the flush_order output (input 7
    (b, 4))."""
    return _aot(num_k_heads, num_v_heads, key_dim, value_dim, buffer_len, use_qk_l2norm, 0, act, arch, tactic,
                shadow, row_order)


def aot_verify_kernel(num_k_heads: int, num_v_heads: int, key_dim: int, value_dim: int, buffer_len: int,
                          use_qk_l2norm: int, num_tokens: int, act: str, arch: int, tactic: int = 1,
                          shadow: str = "none") -> AotKernel:
    """PTX and launch parameters of one ``gdn_verify[_shadow]`` layer: the module and grid that
    ``gdn_ops.gdn_replay_verify`` launches (same argument order as ``gdn_decode``)."""
    check_spec_attributes(num_tokens, buffer_len)
    return _aot(num_k_heads, num_v_heads, key_dim, value_dim, buffer_len, use_qk_l2norm, num_tokens, act, arch,
                    tactic, shadow)


def _aot(num_k_heads, num_v_heads, key_dim, value_dim, buffer_len, use_qk_l2norm, num_tokens, act, arch, tactic,
         shadow, row_order=False) -> AotKernel:
    check_dtypes("f32", act, tactic)
    if shadow not in ("none", "bf16"):
        raise ValueError(f"shadow: expected 'none' or 'bf16' (the GDN kernels read a bf16 shadow), got {shadow!r}")
    if use_qk_l2norm not in (0, 1, True, False):
        raise ValueError(f"use_qk_l2norm: expected 0 or 1, got {use_qk_l2norm!r}")
    spec = gdn_spec(act, num_v_heads, num_k_heads, value_dim, key_dim, buffer_len, TACTICS[tactic], True, shadow,
                    bool(use_qk_l2norm), None, arch, num_tokens, row_order=bool(row_order))
    name = VERIFY_KERNEL_NAME if num_tokens else KERNEL_NAME
    return AotKernel(name, compile_spec(spec, "ptx"), spec.grid(1)[0], True, spec.threads, 0, ("batch", "slots"), spec)


def io_shapes(batch, slots, num_k_heads, num_v_heads, key_dim, value_dim, buffer_len,
                  shadow: str = "none", num_tokens: int = 0, row_order: bool = False) -> dict[str, tuple]:
    """Shapes of every ``gdn_decode[_shadow]`` input and output (``row_order``: input 7 the flush_order output);
    with ``num_tokens`` = T >= 1, those of ``gdn_verify[_shadow]`` (a window axis after the batch, the (slots, 2)
    ring cursor)."""
    H, HV, K, V, L = num_k_heads, num_v_heads, key_dim, value_dim, buffer_len
    lead = (batch, num_tokens) if num_tokens else (batch,)
    ins = {"q": (*lead, H, K), "k": (*lead, H, K), "v": (*lead, HV, V), "a": (*lead, HV), "b": (*lead, HV),
           "A_log": (HV,), "dt_bias": (HV,), "state_batch_indices": (batch, ORDER_COLUMNS) if row_order else (batch,),
           "cursor": (slots, 2) if num_tokens else (slots,),
           "state": (slots, HV, V, K), "u_cache": (slots, HV, L, V), "v_cache": (slots, HV, L, V),
           "k_cache": (slots, H, L, K), "g_cache": (slots, HV, L), "beta_cache": (slots, HV, L)}
    in_names, out_names, aliases = INPUT_NAMES, OUTPUT_NAMES, ALIASES
    if shadow != "none":
        ins["shadow"] = (slots, HV, V, K)
        in_names, out_names, aliases = SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES
    outs = {"y": (*lead, HV, V)}
    for o, i in aliases.items():
        outs[out_names[o]] = ins[in_names[i]]
    return {**ins, **outs}


def type_combination(act: str, shadow: str = "none") -> list[str]:
    """TensorRT type names of the inputs then the outputs of ``gdn_decode[_shadow]`` (and ``gdn_verify[_shadow]``)
    for one activation type."""
    a = TRT_TYPE_NAMES[act]
    ins = [a, a, a, a, a, "FP32", "FP32", "INT32", "INT32", "FP32", "FP32", a, "FP32", "FP32", "FP32"]
    aliases = ALIASES
    if shadow != "none":
        ins.append(TRT_TYPE_NAMES[shadow])
        aliases = SHADOW_ALIASES
    return ins + [a] + [ins[i] for i in aliases.values()]


def shape_attributes(plugin: str, dim) -> dict:
    """The attributes the input shapes imply (``dim(name, axis)``: a known dimension or None)."""
    if plugin in DECODE_PLUGINS:
        return dict(num_k_heads=dim("q", 1), num_v_heads=dim("v", 1), key_dim=dim("q", 2), value_dim=dim("v", 2),
                    buffer_len=dim("u_cache", 2))
    return dict(num_k_heads=dim("q", 2), num_v_heads=dim("v", 2), key_dim=dim("q", 3), value_dim=dim("v", 3),
                buffer_len=dim("u_cache", 2), num_tokens=dim("q", 1))


def check_attributes(plugin: str, attrs: dict, shapes: dict, check_shadow) -> None:
    """The family's checks past the shape-implied attributes (``check_shadow``: the shared shadow-shape check)."""
    pid = PLUGINS[plugin].id
    check_rows_input(plugin, shapes, plugin in DECODE_PLUGINS)
    if plugin in (DECODE_SHADOW, VERIFY_SHADOW):  # the kernels read it as the state (bf16)
        check_shadow(plugin, {k: shapes.get(k) for k in ("state", "shadow")}, None)
    if attrs["use_qk_l2norm"] not in (0, 1):
        raise ValueError(f"{pid}: use_qk_l2norm: expected 0 or 1, got {attrs['use_qk_l2norm']!r}")
    if not 1 <= attrs["buffer_len"] <= 32:
        raise ValueError(f"{pid}: buffer_len: expected 1..32, got {attrs['buffer_len']!r}")
    if plugin in VERIFY_PLUGINS:
        check_spec_attributes(attrs["num_tokens"], attrs["buffer_len"])
        cursor = shapes.get("cursor")
        if cursor is not None and (len(cursor) != 2 or cursor[1] not in (2, None)):
            raise ValueError(f"{pid}: cursor: expected shape (slots, 2), got {tuple(cursor)}")


def register(ctx) -> None:
    """Register the family's plugins through ``ctx`` (trt_plugin.register's shared pieces: trtp, Desc, IntAttr,
    AotResult, Tune, dt_code, check, result, current_device). Thin: every value comes from the functions above."""
    trtp, Desc, IntAttr, AotResult, Tune = ctx.trtp, ctx.Desc, ctx.IntAttr, ctx.AotResult, ctx.Tune

    # ---- gdn_decode ----------------------------------------------------------------------------------------
    @trtp.register(PLUGINS[DECODE].id)
    def _desc_g(q: Desc, k: Desc, v: Desc, a: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, u_cache: Desc, v_cache: Desc, k_cache: Desc, g_cache: Desc,
                beta_cache: Desc, num_k_heads: IntAttr, num_v_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
                buffer_len: IntAttr,
                use_qk_l2norm: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        ctx.check(DECODE, dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, key_dim=key_dim,
                                    value_dim=value_dim, buffer_len=buffer_len, use_qk_l2norm=use_qk_l2norm),
              q=q, v=v, u_cache=u_cache, state_batch_indices=state_batch_indices)
        return (v.like(), state.aliased(), u_cache.aliased(), v_cache.aliased(), k_cache.aliased(), g_cache.aliased(),
                beta_cache.aliased())

    @trtp.autotune(PLUGINS[DECODE].id)
    def _tune_g(q, k, v, a, b, A_log, dt_bias, state_batch_indices, cursor, state, u_cache, v_cache, k_cache, g_cache,
                beta_cache, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(act)), "LINEAR", list(TACTICS))
                for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGINS[DECODE].id)
    def _aot_g(q: Desc, k: Desc, v: Desc, a: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
               cursor: Desc, state: Desc, u_cache: Desc, v_cache: Desc, k_cache: Desc, g_cache: Desc,
               beta_cache: Desc, num_k_heads: IntAttr, num_v_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
               buffer_len: IntAttr,
               use_qk_l2norm: IntAttr, outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, _ = ctx.current_device()
        kern = aot_kernel(*map(as_int, (num_k_heads, num_v_heads, key_dim, value_dim, buffer_len, use_qk_l2norm)),
                          ctx.dt_code[v.dtype], arch, tactic, row_order=ctx.ordered_rows(state_batch_indices))
        return ctx.result(kern, v.shape_expr[0], state.shape_expr[0])

    # ---- gdn_decode_shadow ---------------------------------------------------------------------------------
    @trtp.register(PLUGINS[DECODE_SHADOW].id)
    def _desc_gs(q: Desc, k: Desc, v: Desc, a: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                 cursor: Desc, state: Desc, u_cache: Desc, v_cache: Desc, k_cache: Desc, g_cache: Desc,
                 beta_cache: Desc, shadow: Desc, num_k_heads: IntAttr, num_v_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
                 buffer_len: IntAttr, use_qk_l2norm: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        ctx.check(DECODE_SHADOW, dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, key_dim=key_dim,
                                           value_dim=value_dim, buffer_len=buffer_len, use_qk_l2norm=use_qk_l2norm),
              q=q, v=v, u_cache=u_cache, state=state, shadow=shadow, state_batch_indices=state_batch_indices)
        return (v.like(), state.aliased(), u_cache.aliased(), v_cache.aliased(), k_cache.aliased(), g_cache.aliased(),
                beta_cache.aliased(), shadow.aliased())

    @trtp.autotune(PLUGINS[DECODE_SHADOW].id)
    def _tune_gs(q, k, v, a, b, A_log, dt_bias, state_batch_indices, cursor, state, u_cache, v_cache, k_cache,
                 g_cache, beta_cache, shadow, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(act, "bf16")), "LINEAR", list(TACTICS))
                for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGINS[DECODE_SHADOW].id)
    def _aot_gs(q: Desc, k: Desc, v: Desc, a: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, u_cache: Desc, v_cache: Desc, k_cache: Desc, g_cache: Desc,
                beta_cache: Desc, shadow: Desc, num_k_heads: IntAttr, num_v_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
                buffer_len: IntAttr, use_qk_l2norm: IntAttr, outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, _ = ctx.current_device()
        kern = aot_kernel(*map(as_int, (num_k_heads, num_v_heads, key_dim, value_dim, buffer_len, use_qk_l2norm)),
                          ctx.dt_code[v.dtype], arch, tactic, "bf16", row_order=ctx.ordered_rows(state_batch_indices))
        return ctx.result(kern, v.shape_expr[0], state.shape_expr[0])

    # ---- gdn_verify ----------------------------------------------------------------------------------------
    @trtp.register(PLUGINS[VERIFY].id)
    def _desc_gv(q: Desc, k: Desc, v: Desc, a: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                 cursor: Desc, state: Desc, u_cache: Desc, v_cache: Desc, k_cache: Desc, g_cache: Desc,
                 beta_cache: Desc, num_k_heads: IntAttr, num_v_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
                 buffer_len: IntAttr,
                 use_qk_l2norm: IntAttr, num_tokens: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        ctx.check(VERIFY, dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, key_dim=key_dim,
                                           value_dim=value_dim, buffer_len=buffer_len, use_qk_l2norm=use_qk_l2norm,
                                           num_tokens=num_tokens), q=q, v=v, u_cache=u_cache, cursor=cursor,
              state_batch_indices=state_batch_indices)
        return (v.like(), state.aliased(), u_cache.aliased(), v_cache.aliased(), k_cache.aliased(), g_cache.aliased(),
                beta_cache.aliased())

    @trtp.autotune(PLUGINS[VERIFY].id)
    def _tune_gv(q, k, v, a, b, A_log, dt_bias, state_batch_indices, cursor, state, u_cache, v_cache, k_cache,
                 g_cache, beta_cache, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(act)), "LINEAR", list(TACTICS))
                for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGINS[VERIFY].id)
    def _aot_gv(q: Desc, k: Desc, v: Desc, a: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, u_cache: Desc, v_cache: Desc, k_cache: Desc, g_cache: Desc,
                beta_cache: Desc, num_k_heads: IntAttr, num_v_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
                buffer_len: IntAttr,
                use_qk_l2norm: IntAttr, num_tokens: IntAttr, outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, _ = ctx.current_device()
        kern = aot_verify_kernel(*map(as_int, (num_k_heads, num_v_heads, key_dim, value_dim, buffer_len,
                                                  use_qk_l2norm, num_tokens)), ctx.dt_code[v.dtype], arch, tactic)
        return ctx.result(kern, v.shape_expr[0], state.shape_expr[0])

    # ---- gdn_verify_shadow ---------------------------------------------------------------------------------
    @trtp.register(PLUGINS[VERIFY_SHADOW].id)
    def _desc_gvs(q: Desc, k: Desc, v: Desc, a: Desc, b: Desc, A_log: Desc, dt_bias: Desc,
                  state_batch_indices: Desc, cursor: Desc, state: Desc, u_cache: Desc, v_cache: Desc, k_cache: Desc,
                  g_cache: Desc, beta_cache: Desc, shadow: Desc, num_k_heads: IntAttr, num_v_heads: IntAttr, key_dim: IntAttr,
                  value_dim: IntAttr, buffer_len: IntAttr, use_qk_l2norm: IntAttr,
                  num_tokens: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        ctx.check(VERIFY_SHADOW, dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, key_dim=key_dim,
                                                  value_dim=value_dim, buffer_len=buffer_len,
                                                  use_qk_l2norm=use_qk_l2norm, num_tokens=num_tokens),
              q=q, v=v, u_cache=u_cache, cursor=cursor, state=state,
              shadow=shadow, state_batch_indices=state_batch_indices)
        return (v.like(), state.aliased(), u_cache.aliased(), v_cache.aliased(), k_cache.aliased(), g_cache.aliased(),
                beta_cache.aliased(), shadow.aliased())

    @trtp.autotune(PLUGINS[VERIFY_SHADOW].id)
    def _tune_gvs(q, k, v, a, b, A_log, dt_bias, state_batch_indices, cursor, state, u_cache, v_cache, k_cache,
                  g_cache, beta_cache, shadow, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(act, "bf16")), "LINEAR", list(TACTICS))
                for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGINS[VERIFY_SHADOW].id)
    def _aot_gvs(q: Desc, k: Desc, v: Desc, a: Desc, b: Desc, A_log: Desc, dt_bias: Desc,
                 state_batch_indices: Desc, cursor: Desc, state: Desc, u_cache: Desc, v_cache: Desc, k_cache: Desc,
                 g_cache: Desc, beta_cache: Desc, shadow: Desc, num_k_heads: IntAttr, num_v_heads: IntAttr, key_dim: IntAttr,
                 value_dim: IntAttr, buffer_len: IntAttr, use_qk_l2norm: IntAttr, num_tokens: IntAttr, outputs: tuple[Desc],
                 tactic: int) -> AotResult:
        arch, _ = ctx.current_device()
        kern = aot_verify_kernel(*map(as_int, (num_k_heads, num_v_heads, key_dim, value_dim, buffer_len,
                                                  use_qk_l2norm, num_tokens)), ctx.dt_code[v.dtype], arch, tactic, "bf16")
        return ctx.result(kern, v.shape_expr[0], state.shape_expr[0])


__all__ = ["PLUGINS", "DECODE", "DECODE_SHADOW", "VERIFY", "VERIFY_SHADOW", "DECODE_PLUGINS", "VERIFY_PLUGINS",
           "aot_kernel", "aot_verify_kernel", "io_shapes", "type_combination", "shape_attributes", "check_attributes",
           "register"]
