# SPDX-License-Identifier: Apache-2.0
"""TensorRT AOT plugins of Kimi Delta Attention: ``replayssm::kda_decode`` / ``kda_verify`` (+ ``_shadow``).

One launch of ``kda_replay_decode`` (plugins/kda/kda_decode.cu) per KDA layer (Kimi-K3, Kimi-Linear, GLM-5.3-Flash):
the fused ReplaySSM KDA step (output from the checkpoint and the ring, entry appended, the exact fold when the ring
fills; families/kda/reference.py). The family's part of :mod:`trtllm_replayssm.trt_plugin` (which registers it with
the others; the family interface: :attr:`~trtllm_replayssm.families.Family.trt_plugin`).

Inputs (b = batch, S = slots, H heads, K key dim, V value dim, L ring length):
  0  q                    (b, H, K)     act, raw (l2 norm and K^-1/2 inside)
  1  k                    (b, H, K)     act, raw
  2  v                    (b, H, V)     act
  3  f                    (b, H, K)     act, the raw forget-gate projection f_b(f_a(x))
  4  b                    (b, H)        act, the raw beta logit
  5  A_log                (H,)          fp32
  6  dt_bias              (H, K)        fp32
  7  state_batch_indices  (b,)          int32, -1 = padding row; or the step's ``replayssm::flush_order`` output
                                        (b, 4) (kda_decode[_shadow]: the module that reads its rows there)
  8  cursor               (S,)          int32, read only (advanced once per step for every layer)
  9  state                (S, H, K, V)  fp32 checkpoint
  10 k_cache              (S, H, L, K)  act       11 u_cache (S, H, L, V) fp32 (bf16 in kda_decode_shadow)
  12 g_cache              (S, H, L, K)  fp32
  13 v_cache              (S, H, L, V)  act       14 beta_cache (S, H, L) fp32
  [15 shadow              (S, H, K, V)  bf16, kda_decode_shadow only]
Outputs: 0 y (b, H, V) act; 1-6 aliased to inputs 9-14 [7 shadow_out -> 15].
Attributes (int32, checked against the shapes and compiled into the PTX): num_heads, key_dim, value_dim, buffer_len,
use_qk_l2norm (0/1), lower_bound_bits: the float32 bit pattern of GLM-5 Next's forget-gate lower bound (0: Kimi's
gate). TensorRT's AOT plugin attributes are integers only, so the one float constant travels as its bits.
Kernel parameters: the input pointers, int32 batch, int32 slots, the output pointers. Tactics: the shared large /
small batch geometries (``trt_plugin.TACTICS``); grid (H * V / cols, batch), static shared memory only.

``replayssm::kda_verify`` (+ ``kda_verify_shadow``): one launch of ``kda_verify`` (plugins/kda/kda_spec.cu) per KDA
layer of a speculative step, the KDA counterpart of ``gdn_verify``: the T window tokens' outputs from the checkpoint
(or its bf16 shadow), the committed ring and the window's triangular system; the window entries (k raw, u, g, v,
beta) appended at (start + count + t) % L; where count + 2T > L the committed entries are first folded exactly into
the checkpoint (and the shadow rewritten). The same inputs as ``kda_decode[_shadow]`` with a window axis: q, k, f
(b, T, H, K), v (b, T, H, V), b (b, T, H); cursor (S, 2) (ring start, committed count), read only. Outputs: y
(b, T, H, V) and the same aliases. Attributes: those of ``kda_decode`` + num_tokens (T = 1 + num_draft, 2T <= L).
The commit is the shared ``spec_commit`` (one cursor for every layer, any family).
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin checks the annotations of the functions register()
# decorates with issubclass(), so they must be classes, not strings.

import struct

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
from .config import RING_TYPES, kda_spec

KERNEL_NAME = "kda_replay_decode"
VERIFY_KERNEL_NAME = "kda_verify"
ATTRIBUTES = ("num_heads", "key_dim", "value_dim", "buffer_len", "use_qk_l2norm", "lower_bound_bits")
VERIFY_ATTRIBUTES = ATTRIBUTES + ("num_tokens",)
INPUT_NAMES = ("q", "k", "v", "f", "b", "A_log", "dt_bias", "state_batch_indices", "cursor", "state", "k_cache",
               "u_cache", "g_cache", "v_cache", "beta_cache")
OUTPUT_NAMES = ("y", "state_out", "k_cache_out", "u_cache_out", "g_cache_out", "v_cache_out", "beta_cache_out")
ALIASES = {1: 9, 2: 10, 3: 11, 4: 12, 5: 13, 6: 14}
SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES = with_shadow(INPUT_NAMES, OUTPUT_NAMES, ALIASES)
DECODE, DECODE_SHADOW, VERIFY, VERIFY_SHADOW = "kda_decode", "kda_decode_shadow", "kda_verify", "kda_verify_shadow"
DECODE_PLUGINS = (DECODE, DECODE_SHADOW)
VERIFY_PLUGINS = (VERIFY, VERIFY_SHADOW)
SHADOW_PLUGINS = (DECODE_SHADOW, VERIFY_SHADOW)
PLUGINS = decode_verify_plugins((DECODE, DECODE_SHADOW, VERIFY, VERIFY_SHADOW), KERNEL_NAME, VERIFY_KERNEL_NAME,
                                (INPUT_NAMES, OUTPUT_NAMES, ALIASES),
                                (SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES), ATTRIBUTES)


def lower_bound_bits(lower_bound: float | None) -> int:
    """The int32 attribute of a lower bound (None: Kimi's gate -> 0); the float32 bit pattern, read back exactly."""
    if lower_bound is None:
        return 0
    if not lower_bound < 0:
        raise ValueError(f"lower_bound: expected a negative float (GLM-5 Next's forget-gate bound) or None, got "
                         f"{lower_bound!r}")
    return struct.unpack("<i", struct.pack("<f", lower_bound))[0]


def lower_bound_of(bits: int) -> float | None:
    """:func:`lower_bound_bits` inverted: 0 -> None (Kimi's gate), else the float32 value (a negative one)."""
    if bits == 0:
        return None
    if not -2 ** 31 <= int(bits) < 2 ** 31:
        raise ValueError(f"lower_bound_bits: expected an int32, got {bits}")
    value = struct.unpack("<f", struct.pack("<i", int(bits)))[0]
    if not value < 0:
        raise ValueError(f"lower_bound_bits: expected 0 (Kimi's gate) or the bits of a negative float32, got {bits} "
                         f"({value!r})")
    return value


def aot_kernel(num_heads: int, key_dim: int, value_dim: int, buffer_len: int, use_qk_l2norm: int,
               lower_bound_bits: int, act: str, arch: int, tactic: int = 1, shadow: str = "none",
               row_order: bool = False) -> AotKernel:
    """PTX and launch parameters of one ``kda_decode[_shadow]`` layer: the module and grid that
    ``families.kda.ops.kda_replay_decode`` launches for the tactic's batch geometry (argument order: inputs, batch,
    slots, outputs); ``row_order``: the module that reads its rows from the flush_order output (input 7 (b, 4))."""
    return _aot(num_heads, key_dim, value_dim, buffer_len, use_qk_l2norm, lower_bound_bits, 0, act, arch, tactic,
                shadow, row_order)


def aot_verify_kernel(num_heads: int, key_dim: int, value_dim: int, buffer_len: int, use_qk_l2norm: int,
                      lower_bound_bits: int, num_tokens: int, act: str, arch: int, tactic: int = 1,
                      shadow: str = "none") -> AotKernel:
    """PTX and launch parameters of one ``kda_verify[_shadow]`` layer: the module and grid that
    ``families.kda.ops.kda_replay_verify`` launches (same argument order as ``kda_decode``)."""
    check_spec_attributes(num_tokens, buffer_len)
    return _aot(num_heads, key_dim, value_dim, buffer_len, use_qk_l2norm, lower_bound_bits, num_tokens, act, arch,
                tactic, shadow)


def _aot(num_heads, key_dim, value_dim, buffer_len, use_qk_l2norm, lower_bound_bits, num_tokens, act, arch, tactic,
         shadow, row_order=False) -> AotKernel:
    check_dtypes("f32", act, tactic)
    if shadow not in ("none", "bf16"):
        raise ValueError(f"shadow: expected 'none' or 'bf16' (the KDA kernels read a bf16 shadow), got {shadow!r}")
    if use_qk_l2norm not in (0, 1, True, False):
        raise ValueError(f"use_qk_l2norm: expected 0 or 1, got {use_qk_l2norm!r}")
    spec = kda_spec(act, num_heads, key_dim, value_dim, buffer_len, TACTICS[tactic], shadow, bool(use_qk_l2norm), None,
                    lower_bound_of(lower_bound_bits), arch, num_tokens=num_tokens, row_order=bool(row_order))
    name = VERIFY_KERNEL_NAME if num_tokens else KERNEL_NAME
    return AotKernel(name, compile_spec(spec, "ptx"), spec.grid(1)[0], True, spec.threads, 0, ("batch", "slots"), spec)


def io_shapes(batch, slots, num_heads, key_dim, value_dim, buffer_len, shadow: str = "none",
              num_tokens: int = 0, row_order: bool = False) -> dict[str, tuple]:
    """Shapes of every ``kda_decode[_shadow]`` input and output (``row_order``: input 7 the flush_order output);
    with ``num_tokens`` = T >= 1, those of ``kda_verify[_shadow]`` (a window axis after the batch, the (slots, 2)
    ring cursor)."""
    H, K, V, L = num_heads, key_dim, value_dim, buffer_len
    lead = (batch, num_tokens) if num_tokens else (batch,)
    ins = {"q": (*lead, H, K), "k": (*lead, H, K), "v": (*lead, H, V), "f": (*lead, H, K), "b": (*lead, H),
           "A_log": (H,), "dt_bias": (H, K), "state_batch_indices": (batch, ORDER_COLUMNS) if row_order else (batch,),
           "cursor": (slots, 2) if num_tokens else (slots,),
           "state": (slots, H, K, V), "k_cache": (slots, H, L, K), "u_cache": (slots, H, L, V),
           "g_cache": (slots, H, L, K), "v_cache": (slots, H, L, V), "beta_cache": (slots, H, L)}
    in_names, out_names, aliases = INPUT_NAMES, OUTPUT_NAMES, ALIASES
    if shadow != "none":
        ins["shadow"] = (slots, H, K, V)
        in_names, out_names, aliases = SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES
    outs = {"y": (*lead, H, V)}
    for o, i in aliases.items():
        outs[out_names[o]] = ins[in_names[i]]
    return {**ins, **outs}


def type_combination(act: str, shadow: str = "none") -> list[str]:
    """TensorRT type names of the inputs then the outputs of ``kda_decode[_shadow]`` (and ``kda_verify[_shadow]``)
    for one activation type."""
    a = TRT_TYPE_NAMES[act]
    ring = TRT_TYPE_NAMES[RING_TYPES[shadow]]  # the u ring
    ins = [a, a, a, a, a, "FP32", "FP32", "INT32", "INT32", "FP32", a, ring, "FP32", a, "FP32"]
    aliases = ALIASES
    if shadow != "none":
        ins.append(TRT_TYPE_NAMES[shadow])
        aliases = SHADOW_ALIASES
    return ins + [a] + [ins[i] for i in aliases.values()]


def shape_attributes(plugin: str, dim) -> dict:
    """The attributes the input shapes imply (``dim(name, axis)``: a known dimension or None)."""
    if plugin in DECODE_PLUGINS:
        return dict(num_heads=dim("q", 1), key_dim=dim("q", 2), value_dim=dim("v", 2), buffer_len=dim("u_cache", 2))
    return dict(num_heads=dim("q", 2), key_dim=dim("q", 3), value_dim=dim("v", 3), buffer_len=dim("u_cache", 2),
                num_tokens=dim("q", 1))


def check_attributes(plugin: str, attrs: dict, shapes: dict, check_shadow) -> None:
    """The family's checks past the shape-implied attributes (``check_shadow``: the shared shadow-shape check)."""
    pid = PLUGINS[plugin].id
    check_rows_input(plugin, shapes, plugin in DECODE_PLUGINS)
    if attrs["use_qk_l2norm"] not in (0, 1):
        raise ValueError(f"{pid}: use_qk_l2norm: expected 0 or 1, got {attrs['use_qk_l2norm']!r}")
    if not 2 <= attrs["buffer_len"] <= 16:
        raise ValueError(f"{pid}: buffer_len: expected 2..16 (the KDA kernel's ring), got {attrs['buffer_len']!r}")
    try:
        lower_bound_of(attrs["lower_bound_bits"])
    except ValueError as e:
        raise ValueError(f"{pid}: {e}") from None
    if plugin in SHADOW_PLUGINS:  # the kernels read the shadow as the state (bf16)
        check_shadow(plugin, {k: shapes.get(k) for k in ("state", "shadow")}, None)
    if plugin in VERIFY_PLUGINS:
        try:
            check_spec_attributes(attrs["num_tokens"], attrs["buffer_len"])
        except ValueError as e:
            raise ValueError(f"{pid}: {e}") from None
        cursor = shapes.get("cursor")
        if cursor is not None and (len(cursor) != 2 or cursor[1] not in (2, None)):
            raise ValueError(f"{pid}: cursor: expected shape (slots, 2), got {tuple(cursor)}")


def register(ctx) -> None:
    """Register the family's plugins through ``ctx`` (trt_plugin.register's shared pieces: trtp, Desc, IntAttr,
    AotResult, Tune, dt_code, check, result, current_device). Thin: every value comes from the functions above."""
    trtp, Desc, IntAttr, AotResult, Tune = ctx.trtp, ctx.Desc, ctx.IntAttr, ctx.AotResult, ctx.Tune

    # ---- kda_decode ----------------------------------------------------------------------------------------
    @trtp.register(PLUGINS[DECODE].id)
    def _desc(q: Desc, k: Desc, v: Desc, f: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
              cursor: Desc, state: Desc, k_cache: Desc, u_cache: Desc, g_cache: Desc, v_cache: Desc, beta_cache: Desc,
              num_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr, buffer_len: IntAttr, use_qk_l2norm: IntAttr,
              lower_bound_bits: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        ctx.check(DECODE, dict(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim, buffer_len=buffer_len,
                               use_qk_l2norm=use_qk_l2norm, lower_bound_bits=lower_bound_bits), q=q, v=v, u_cache=u_cache,
                  state_batch_indices=state_batch_indices)
        return (v.like(), state.aliased(), k_cache.aliased(), u_cache.aliased(), g_cache.aliased(), v_cache.aliased(),
                beta_cache.aliased())

    @trtp.autotune(PLUGINS[DECODE].id)
    def _tune(q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor, state, k_cache, u_cache, g_cache, v_cache,
              beta_cache, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(act)), "LINEAR", list(TACTICS))
                for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGINS[DECODE].id)
    def _aot(q: Desc, k: Desc, v: Desc, f: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
             cursor: Desc, state: Desc, k_cache: Desc, u_cache: Desc, g_cache: Desc, v_cache: Desc, beta_cache: Desc,
             num_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr, buffer_len: IntAttr, use_qk_l2norm: IntAttr,
             lower_bound_bits: IntAttr, outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, _ = ctx.current_device()
        kern = aot_kernel(*map(as_int, (num_heads, key_dim, value_dim, buffer_len, use_qk_l2norm, lower_bound_bits)),
                          ctx.dt_code[v.dtype], arch, tactic, row_order=ctx.ordered_rows(state_batch_indices))
        return ctx.result(kern, v.shape_expr[0], state.shape_expr[0])

    # ---- kda_decode_shadow ---------------------------------------------------------------------------------
    @trtp.register(PLUGINS[DECODE_SHADOW].id)
    def _desc_s(q: Desc, k: Desc, v: Desc, f: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, k_cache: Desc, u_cache: Desc, g_cache: Desc, v_cache: Desc,
                beta_cache: Desc, shadow: Desc, num_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
                buffer_len: IntAttr, use_qk_l2norm: IntAttr,
                lower_bound_bits: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        ctx.check(DECODE_SHADOW, dict(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim, buffer_len=buffer_len,
                                      use_qk_l2norm=use_qk_l2norm, lower_bound_bits=lower_bound_bits),
                  q=q, v=v, u_cache=u_cache, state=state, shadow=shadow, state_batch_indices=state_batch_indices)
        return (v.like(), state.aliased(), k_cache.aliased(), u_cache.aliased(), g_cache.aliased(), v_cache.aliased(),
                beta_cache.aliased(), shadow.aliased())

    @trtp.autotune(PLUGINS[DECODE_SHADOW].id)
    def _tune_s(q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor, state, k_cache, u_cache, g_cache,
                v_cache, beta_cache, shadow, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(act, "bf16")), "LINEAR", list(TACTICS))
                for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGINS[DECODE_SHADOW].id)
    def _aot_s(q: Desc, k: Desc, v: Desc, f: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
               cursor: Desc, state: Desc, k_cache: Desc, u_cache: Desc, g_cache: Desc, v_cache: Desc, beta_cache: Desc,
               shadow: Desc, num_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr, buffer_len: IntAttr,
               use_qk_l2norm: IntAttr, lower_bound_bits: IntAttr, outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, _ = ctx.current_device()
        kern = aot_kernel(*map(as_int, (num_heads, key_dim, value_dim, buffer_len, use_qk_l2norm, lower_bound_bits)),
                          ctx.dt_code[v.dtype], arch, tactic, "bf16", row_order=ctx.ordered_rows(state_batch_indices))
        return ctx.result(kern, v.shape_expr[0], state.shape_expr[0])

    # ---- kda_verify ----------------------------------------------------------------------------------------
    @trtp.register(PLUGINS[VERIFY].id)
    def _desc_v(q: Desc, k: Desc, v: Desc, f: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, k_cache: Desc, u_cache: Desc, g_cache: Desc, v_cache: Desc,
                beta_cache: Desc, num_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr, buffer_len: IntAttr,
                use_qk_l2norm: IntAttr, lower_bound_bits: IntAttr,
                num_tokens: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        ctx.check(VERIFY, dict(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim, buffer_len=buffer_len,
                               use_qk_l2norm=use_qk_l2norm, lower_bound_bits=lower_bound_bits, num_tokens=num_tokens),
                  q=q, v=v, u_cache=u_cache, cursor=cursor, state_batch_indices=state_batch_indices)
        return (v.like(), state.aliased(), k_cache.aliased(), u_cache.aliased(), g_cache.aliased(), v_cache.aliased(),
                beta_cache.aliased())

    @trtp.autotune(PLUGINS[VERIFY].id)
    def _tune_v(q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor, state, k_cache, u_cache, g_cache, v_cache,
                beta_cache, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(act)), "LINEAR", list(TACTICS))
                for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGINS[VERIFY].id)
    def _aot_v(q: Desc, k: Desc, v: Desc, f: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
               cursor: Desc, state: Desc, k_cache: Desc, u_cache: Desc, g_cache: Desc, v_cache: Desc,
               beta_cache: Desc, num_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr, buffer_len: IntAttr,
               use_qk_l2norm: IntAttr, lower_bound_bits: IntAttr, num_tokens: IntAttr, outputs: tuple[Desc],
               tactic: int) -> AotResult:
        arch, _ = ctx.current_device()
        kern = aot_verify_kernel(*map(as_int, (num_heads, key_dim, value_dim, buffer_len, use_qk_l2norm,
                                               lower_bound_bits, num_tokens)), ctx.dt_code[v.dtype], arch, tactic)
        return ctx.result(kern, v.shape_expr[0], state.shape_expr[0])

    # ---- kda_verify_shadow ---------------------------------------------------------------------------------
    @trtp.register(PLUGINS[VERIFY_SHADOW].id)
    def _desc_vs(q: Desc, k: Desc, v: Desc, f: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                 cursor: Desc, state: Desc, k_cache: Desc, u_cache: Desc, g_cache: Desc, v_cache: Desc,
                 beta_cache: Desc, shadow: Desc, num_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
                 buffer_len: IntAttr, use_qk_l2norm: IntAttr, lower_bound_bits: IntAttr,
                 num_tokens: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        ctx.check(VERIFY_SHADOW, dict(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim, buffer_len=buffer_len,
                                      use_qk_l2norm=use_qk_l2norm, lower_bound_bits=lower_bound_bits,
                                      num_tokens=num_tokens),
                  q=q, v=v, u_cache=u_cache, cursor=cursor, state=state, shadow=shadow,
                  state_batch_indices=state_batch_indices)
        return (v.like(), state.aliased(), k_cache.aliased(), u_cache.aliased(), g_cache.aliased(), v_cache.aliased(),
                beta_cache.aliased(), shadow.aliased())

    @trtp.autotune(PLUGINS[VERIFY_SHADOW].id)
    def _tune_vs(q, k, v, f, b, A_log, dt_bias, state_batch_indices, cursor, state, k_cache, u_cache, g_cache,
                 v_cache, beta_cache, shadow, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(act, "bf16")), "LINEAR", list(TACTICS))
                for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGINS[VERIFY_SHADOW].id)
    def _aot_vs(q: Desc, k: Desc, v: Desc, f: Desc, b: Desc, A_log: Desc, dt_bias: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, k_cache: Desc, u_cache: Desc, g_cache: Desc, v_cache: Desc,
                beta_cache: Desc, shadow: Desc, num_heads: IntAttr, key_dim: IntAttr, value_dim: IntAttr,
                buffer_len: IntAttr, use_qk_l2norm: IntAttr, lower_bound_bits: IntAttr, num_tokens: IntAttr,
                outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, _ = ctx.current_device()
        kern = aot_verify_kernel(*map(as_int, (num_heads, key_dim, value_dim, buffer_len, use_qk_l2norm,
                                               lower_bound_bits, num_tokens)), ctx.dt_code[v.dtype], arch, tactic,
                                 "bf16")
        return ctx.result(kern, v.shape_expr[0], state.shape_expr[0])


__all__ = ["PLUGINS", "DECODE", "DECODE_SHADOW", "VERIFY", "VERIFY_SHADOW", "DECODE_PLUGINS", "VERIFY_PLUGINS",
           "aot_kernel", "aot_verify_kernel", "io_shapes", "type_combination", "shape_attributes",
           "check_attributes", "register", "lower_bound_bits", "lower_bound_of"]
