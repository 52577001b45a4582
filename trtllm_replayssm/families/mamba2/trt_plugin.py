# SPDX-License-Identifier: Apache-2.0
"""TensorRT AOT plugins of Mamba-2 (Nemotron-H, Nemotron 3): ``replayssm::mamba2_decode`` / ``mamba2_verify`` (+ ``_shadow``).

The family's part of :mod:`trtllm_replayssm.trt_plugin`, which registers, lists and checks it with the others through
the family interface (:attr:`~trtllm_replayssm.families.Family.trt_plugin`); the commit is the shared ``spec_commit``.

``replayssm::mamba2_decode``: one launch of ``replayssm_decode`` (plugins/mamba2/replayssm_decode.cu): the fused
ReplaySSM step (output, append, flush when the buffer fills). The engine runs it without Python:
``aot_impl`` hands TensorRT the PTX, the kernel name, the launch geometry and int32 extra args.

Inputs (b = batch, S = slots; in an engine with per-row state S = b and state_batch_indices = arange):
  0  x                    (b, H, P)     act (fp32 / fp16 / bf16)
  1  B                    (b, G, N)     act
  2  C                    (b, G, N)     act
  3  dt                   (b, H)        act, raw (softplus(dt + dt_bias) inside)
  4  dt_bias              (H,)          fp32
  5  A                    (H,)          fp32, A = -exp(A_log)
  6  D                    (H,)          fp32
  7  state_batch_indices  (b,)          int32, -1 = padding row
  8  cursor               (S,)          int32, entries in the buffer before this step (read only;
                                        the graph advances it once per step for all layers)
  9  state                (S, H, P, N)  fp32 / fp16 / bf16 checkpoint
  10 x_cache              (S, H, L, P)  act
  11 B_cache              (S, G, L, N)  act
  12 dt_cache             (S, H, L)     fp32, processed dt
Outputs:
  0  y                    (b, H, P)     act
  1  state_out            aliased to input 9  (written on flush steps only)
  2  x_cache_out          aliased to input 10 (append)
  3  B_cache_out          aliased to input 11 (append)
  4  dt_cache_out         aliased to input 12 (append)
Attributes (checked against the shapes; not serialized with AOT plugins, so every size is also
compiled into the PTX): nheads, headdim, dstate, ngroups, buffer_len (int32; declared as one-element int32
arrays, :data:`IntAttr`, see there).
Kernel parameters, in TensorRT's order: the 13 input pointers, int32 batch, int32 slots, the
5 output pointers (aliased outputs receive their inputs' pointers).
Tactics: 1 = large-batch geometry, 2 = small-batch geometry (smaller row chunks, more warps).
Grid: (heads * chunks, batch) for one-shot blocks, or (SMs * blocks per SM, 1) for the persistent
pipelined kernel, which walks batch * heads * chunks work items itself.
Aliased I/O needs the preview feature ``PreviewFeature.ALIASED_PLUGIN_IO_10_03`` on the builder
config. Importing this module does not need TensorRT; :func:`register` does.

``replayssm::mamba2_decode_shadow``: the same step with a low-precision shadow of an fp32 checkpoint
that non-flush steps read (docs/DESIGN.md §1); the shadow kind is the shadow input's dtype (BF16 or FP8
e4m3), so it is compiled into the PTX like every other type. Two more inputs and aliased outputs:
  13 shadow               (S, H, P, N)  bf16 or fp8-e4m3 (written on flush steps)
  14 shadow_scale         (S, H, P)     fp32 row scales of an fp8 shadow; with a bf16 shadow a
                                        (1,) placeholder, never read or written
  outputs 5 shadow_out -> input 13, 6 shadow_scale_out -> input 14
Kernel parameters: the 15 input pointers, int32 batch, int32 slots, the 7 output pointers. Its input 7 may be the
step's ``replayssm::flush_order`` output (b, 4) instead of (b,): the staged module built for it reads each block's
row, slot and cursor there (``KernelSpec.row_order``; the plain ``mamba2_decode`` runs the persistent kernel, which
walks items, and takes (b,) only).

``replayssm::mamba2_verify``: one launch of ``replayssm_verify`` (plugins/mamba2/replayssm_spec.cu) per Mamba
layer of a speculative step: the outputs of the T = 1 + num_draft window tokens from the checkpoint,
the committed ring history and the causal part of the window; the window appended to the rings at
(start + count + t) % L; when count + 2T > L the committed history is first folded into the
checkpoint (spec_reference.py). The cursor is read only. Inputs (T = num_tokens):
  0  x                    (b, T, H, P)  act
  1  B                    (b, T, G, N)  act
  2  C                    (b, T, G, N)  act
  3  dt                   (b, T, H)     act, raw
  4  dt_bias              (H,)          fp32
  5  A                    (H,)          fp32
  6  D                    (H,)          fp32
  7  state_batch_indices  (b,)          int32, -1 = padding row
  8  cursor               (S, 2)        int32 (ring start, committed count), read only
  9  state                (S, H, P, N)  fp32 / fp16 / bf16 checkpoint
  10 x_cache              (S, H, L, P)  act ring
  11 B_cache              (S, G, L, N)  act ring
  12 dt_cache             (S, H, L)     fp32 ring, processed dt
Outputs: 0 y (b, T, H, P) act; 1-4 state_out, x_cache_out, B_cache_out, dt_cache_out aliased to
inputs 9-12 (state written on flush steps only, the rings at the window's entries).
Attributes: nheads, headdim, dstate, ngroups, buffer_len, num_tokens (checked against the shapes;
compiled into the PTX). Kernel parameters: the 13 input pointers, int32 batch, int32 slots, the 5
output pointers. Tactics as above; grid (heads * chunks, batch), static shared memory only.

``replayssm::mamba2_verify_shadow``: the same verify with a bf16 or fp8-e4m3 shadow of an fp32
checkpoint, the two inputs and aliased outputs of ``mamba2_decode_shadow`` (13 shadow, 14 shadow_scale;
outputs 5, 6): a verify without a fold reads the shadow, the fold rewrites it from the checkpoint it
stores. Kernel parameters: the 15 input pointers, int32 batch, int32 slots, the 7 output pointers (the
same ``replayssm_verify`` entry as ``ops.replay_verify`` launches with a shadow).

Everything ``register`` hands TensorRT comes from plain functions that the CPU tests run: :func:`aot_kernel`,
:func:`aot_verify_kernel` (PTX, kernel name, grid, block, int32 args), :func:`shape_attributes` +
:func:`check_attributes`, :func:`type_combination`.
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin checks the annotations of the functions register()
# decorates with issubclass(), so they must be classes, not strings.

from ...compile import compile_spec
from ...config import KernelSpec, plan, spec_grid, verify_spec
from ...cursor import ORDER_COLUMNS
from ...trt_plugin import (
    ACT_DTYPES,
    PLUGIN_NAMESPACE,
    STATE_DTYPES,
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

PLUGIN_NAME = "mamba2_decode"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
KERNEL_NAME = "replayssm_decode"
ATTRIBUTES = ("nheads", "headdim", "dstate", "ngroups", "buffer_len")
INPUT_NAMES = ("x", "B", "C", "dt", "dt_bias", "A", "D", "state_batch_indices", "cursor", "state", "x_cache",
               "B_cache", "dt_cache")
OUTPUT_NAMES = ("y", "state_out", "x_cache_out", "B_cache_out", "dt_cache_out")
ALIASES = {1: 9, 2: 10, 3: 11, 4: 12}  # output index -> input index

SHADOW_PLUGIN_NAME = "mamba2_decode_shadow"
SHADOW_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{SHADOW_PLUGIN_NAME}"
SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES = with_shadow(INPUT_NAMES, OUTPUT_NAMES, ALIASES,
                                                                    ("shadow", "shadow_scale"))
SHADOW_KINDS = ("bf16", "fp8")

VERIFY_PLUGIN_NAME = "mamba2_verify"
VERIFY_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{VERIFY_PLUGIN_NAME}"
VERIFY_KERNEL_NAME = "replayssm_verify"
VERIFY_ATTRIBUTES = ATTRIBUTES + ("num_tokens",)
VERIFY_INPUT_NAMES = INPUT_NAMES  # same names; x, B, C, dt carry a window axis, cursor is (S, 2)
VERIFY_OUTPUT_NAMES = OUTPUT_NAMES
VERIFY_ALIASES = ALIASES
VERIFY_SHADOW_PLUGIN_NAME = "mamba2_verify_shadow"
VERIFY_SHADOW_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{VERIFY_SHADOW_PLUGIN_NAME}"
DECODE_PLUGINS = (PLUGIN_NAME, SHADOW_PLUGIN_NAME)
VERIFY_PLUGINS = (VERIFY_PLUGIN_NAME, VERIFY_SHADOW_PLUGIN_NAME)

PLUGINS = decode_verify_plugins((PLUGIN_NAME, SHADOW_PLUGIN_NAME, VERIFY_PLUGIN_NAME, VERIFY_SHADOW_PLUGIN_NAME),
                                KERNEL_NAME, VERIFY_KERNEL_NAME, (INPUT_NAMES, OUTPUT_NAMES, ALIASES),
                                (SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES), ATTRIBUTES)


def aot_kernel(nheads: int, headdim: int, dstate: int, ngroups: int, buffer_len: int, state: str, act: str,
               arch: int, tactic: int = 1, sm_count: int = 132, shadow: str = "none",
               row_order: bool = False) -> AotKernel:
    """The PTX and launch parameters for one plugin layer (the core of ``aot_impl``); ``shadow``
    "bf16" / "fp8" for ``mamba2_decode_shadow``; ``row_order``: the module that reads its rows from the flush_order
    output (input 7 (b, 4); the one-shot and staged kernels)."""
    if state not in STATE_DTYPES:
        raise ValueError(f"state: expected one of {STATE_DTYPES}, got {state!r}")
    if shadow != "none" and (shadow not in SHADOW_KINDS or state != "f32"):
        raise ValueError(f"shadow: expected one of {SHADOW_KINDS} with an f32 state, got shadow={shadow!r}, "
                         f"state={state!r}")
    check_dtypes(state, act, tactic)
    rows, warps, variant = plan(state, act, nheads, headdim, dstate, buffer_len, TACTICS[tactic], shadow=shadow)
    spec = KernelSpec(state, act, nheads, headdim, dstate, ngroups, buffer_len, rows, warps, False, arch,
                      variant=variant, shadow=shadow, row_order=bool(row_order))
    # Persistent blocks: a fixed grid of sm_count * blocks_per_sm, the kernel walks batch*items.
    grid_x = sm_count * spec.blocks_per_sm if spec.persistent else spec.grid(1)[0]
    return AotKernel(KERNEL_NAME, compile_spec(spec, "ptx"), grid_x, not spec.persistent, spec.threads, 0,
                     ("batch", "slots"), spec)


def aot_verify_kernel(nheads: int, headdim: int, dstate: int, ngroups: int, buffer_len: int, num_tokens: int,
                      state: str, act: str, arch: int, tactic: int = 1, shadow: str = "none") -> AotKernel:
    """PTX and launch parameters of one ``mamba2_verify`` (``mamba2_verify_shadow`` with ``shadow`` "bf16" /
    "fp8") layer: the kernel ``ops.replay_verify`` launches (same spec, grid and argument order) for the
    tactic's batch geometry."""
    check_spec_attributes(num_tokens, buffer_len)
    if shadow != "none" and (shadow not in SHADOW_KINDS or state != "f32"):
        raise ValueError(f"shadow: expected one of {SHADOW_KINDS} with an f32 state, got shadow={shadow!r}, "
                         f"state={state!r}")
    check_dtypes(state, act, tactic)
    spec = verify_spec(state, act, nheads, headdim, dstate, ngroups, buffer_len, num_tokens, TACTICS[tactic], False,
                       arch, shadow)
    return AotKernel(VERIFY_KERNEL_NAME, compile_spec(spec, "ptx"), spec_grid(spec, 1)[0], True, spec.threads, 0,
                     ("batch", "slots"), spec)


def io_shapes(batch, slots, nheads, headdim, dstate, ngroups, buffer_len, shadow: str = "none",
              row_order: bool = False) -> dict[str, tuple]:
    """Shapes of every plugin input and output (the contract ``register`` checks); with a shadow,
    those of ``mamba2_decode_shadow`` (``row_order``: input 7 the flush_order output)."""
    H, P, N, G, L = nheads, headdim, dstate, ngroups, buffer_len
    ins = {"x": (batch, H, P), "B": (batch, G, N), "C": (batch, G, N), "dt": (batch, H), "dt_bias": (H,),
           "A": (H,), "D": (H,), "state_batch_indices": (batch, ORDER_COLUMNS) if row_order else (batch,),
           "cursor": (slots,), "state": (slots, H, P, N), "x_cache": (slots, H, L, P), "B_cache": (slots, G, L, N),
           "dt_cache": (slots, H, L)}
    in_names, out_names, aliases = INPUT_NAMES, OUTPUT_NAMES, ALIASES
    if shadow != "none":
        ins |= {"shadow": (slots, H, P, N), "shadow_scale": (slots, H, P) if shadow == "fp8" else (1,)}
        in_names, out_names, aliases = SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES
    outs = {"y": (batch, H, P)}
    for o, i in aliases.items():
        outs[out_names[o]] = ins[in_names[i]]
    return {**ins, **outs}


def verify_io_shapes(batch, slots, nheads, headdim, dstate, ngroups, buffer_len, num_tokens,
                     shadow: str = "none") -> dict[str, tuple]:
    """Shapes of every ``mamba2_verify`` (``mamba2_verify_shadow``) input and output."""
    H, P, N, G, L, T = nheads, headdim, dstate, ngroups, buffer_len, num_tokens
    ins = {"x": (batch, T, H, P), "B": (batch, T, G, N), "C": (batch, T, G, N), "dt": (batch, T, H), "dt_bias": (H,),
           "A": (H,), "D": (H,), "state_batch_indices": (batch,), "cursor": (slots, 2), "state": (slots, H, P, N),
           "x_cache": (slots, H, L, P), "B_cache": (slots, G, L, N), "dt_cache": (slots, H, L)}
    in_names, out_names, aliases = VERIFY_INPUT_NAMES, VERIFY_OUTPUT_NAMES, VERIFY_ALIASES
    if shadow != "none":
        ins |= {"shadow": (slots, H, P, N), "shadow_scale": (slots, H, P) if shadow == "fp8" else (1,)}
        in_names, out_names, aliases = SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES
    outs = {"y": (batch, T, H, P)}
    for o, i in aliases.items():
        outs[out_names[o]] = ins[in_names[i]]
    return {**ins, **outs}


def type_combination(state: str, act: str, shadow: str = "none") -> list[str]:
    """TensorRT type names of the inputs then the outputs for one (state, act[, shadow]) combination
    (mamba2_decode[_shadow]; mamba2_verify has the same types)."""
    a, s = TRT_TYPE_NAMES[act], TRT_TYPE_NAMES[state]
    ins = [a, a, a, a, "FP32", "FP32", "FP32", "INT32", "INT32", s, a, a, "FP32"]
    aliases = ALIASES
    if shadow != "none":
        ins += [TRT_TYPE_NAMES[shadow], "FP32"]
        aliases = SHADOW_ALIASES
    return ins + [a] + [ins[i] for i in aliases.values()]


def shape_attributes(plugin: str, dim) -> dict:
    """The attributes the input shapes imply (``dim(name, axis)``: a known dimension or None)."""
    if plugin in DECODE_PLUGINS:
        return dict(nheads=dim("x", 1), headdim=dim("x", 2), dstate=dim("state", 3), ngroups=dim("B", 1),
                    buffer_len=dim("x_cache", 2))
    return dict(nheads=dim("x", 2), headdim=dim("x", 3), dstate=dim("state", 3), ngroups=dim("B", 2),
                buffer_len=dim("x_cache", 2), num_tokens=dim("x", 1))


def check_attributes(plugin: str, attrs: dict, shapes: dict, check_shadow) -> None:
    """The family's checks past the shape-implied attributes and the shadow's shapes (both checked by
    :func:`trtllm_replayssm.trt_plugin.check_attributes`): the rows input, the verify window and its (slots, 2)
    cursor."""
    check_rows_input(plugin, shapes, plugin == SHADOW_PLUGIN_NAME)
    if plugin in VERIFY_PLUGINS:
        check_spec_attributes(attrs["num_tokens"], attrs["buffer_len"])
        cursor = shapes.get("cursor")
        if cursor is not None and (len(cursor) != 2 or cursor[1] not in (2, None)):
            raise ValueError(f"{PLUGINS[plugin].id}: cursor: expected shape (slots, 2), got {tuple(cursor)}")


def register(ctx) -> None:
    """Register the family's plugins through ``ctx`` (trt_plugin.register's shared pieces: trtp, Desc, IntAttr,
    AotResult, Tune, dt_code, shadow_code, check, result, current_device). Thin: every value comes from the
    functions above."""
    trtp, Desc, IntAttr, AotResult, Tune = ctx.trtp, ctx.Desc, ctx.IntAttr, ctx.AotResult, ctx.Tune
    dt_code, shadow_code, check, result, current_device = (ctx.dt_code, ctx.shadow_code, ctx.check, ctx.result,
                                                           ctx.current_device)
    _int = as_int

    # ---- mamba2_decode ----------------------------------------------------------------------------
    @trtp.register(PLUGIN_ID)
    def _desc(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
              cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, nheads: IntAttr, headdim: IntAttr,
              dstate: IntAttr, ngroups: IntAttr, buffer_len: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc]:
        check(PLUGIN_NAME, dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups, buffer_len=buffer_len),
              x=x, B=B, state=state, x_cache=x_cache, state_batch_indices=state_batch_indices)
        return x.like(), state.aliased(), x_cache.aliased(), B_cache.aliased(), dt_cache.aliased()

    @trtp.autotune(PLUGIN_ID)
    def _tune(x, B, C, dt, dt_bias, A, D, state_batch_indices, cursor, state, x_cache, B_cache, dt_cache,
              outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(st, act)), "LINEAR", list(TACTICS))
                for st in STATE_DTYPES for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
             cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, nheads: IntAttr, headdim: IntAttr,
             dstate: IntAttr, ngroups: IntAttr, buffer_len: IntAttr, outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, sms = current_device()
        k = aot_kernel(*map(_int, (nheads, headdim, dstate, ngroups, buffer_len)), dt_code[state.dtype], dt_code[x.dtype], arch,
                       tactic, sms)
        return result(k, x.shape_expr[0], state.shape_expr[0])

    # ---- mamba2_decode_shadow ------------------------------------------------------------------------
    @trtp.register(SHADOW_PLUGIN_ID)
    def _desc_sh(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
                 cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, shadow: Desc,
                 shadow_scale: Desc, nheads: IntAttr, headdim: IntAttr, dstate: IntAttr, ngroups: IntAttr, buffer_len: IntAttr
                 ) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        check(SHADOW_PLUGIN_NAME, dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups,
                                       buffer_len=buffer_len), shadow_code.get(shadow.dtype), x=x, B=B, state=state,
              x_cache=x_cache, shadow=shadow, shadow_scale=shadow_scale, state_batch_indices=state_batch_indices)
        return (x.like(), state.aliased(), x_cache.aliased(), B_cache.aliased(), dt_cache.aliased(), shadow.aliased(),
                shadow_scale.aliased())

    @trtp.autotune(SHADOW_PLUGIN_ID)
    def _tune_sh(x, B, C, dt, dt_bias, A, D, state_batch_indices, cursor, state, x_cache, B_cache, dt_cache, shadow,
                 shadow_scale, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination("f32", act, sh)), "LINEAR", list(TACTICS))
                for sh in SHADOW_KINDS for act in ACT_DTYPES]

    @trtp.aot_impl(SHADOW_PLUGIN_ID)
    def _aot_sh(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, shadow: Desc,
                shadow_scale: Desc, nheads: IntAttr, headdim: IntAttr, dstate: IntAttr, ngroups: IntAttr, buffer_len: IntAttr,
                outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, sms = current_device()
        k = aot_kernel(*map(_int, (nheads, headdim, dstate, ngroups, buffer_len)), dt_code[state.dtype], dt_code[x.dtype], arch,
                       tactic, sms, shadow_code[shadow.dtype], ctx.ordered_rows(state_batch_indices))
        return result(k, x.shape_expr[0], state.shape_expr[0])

    # ---- mamba2_verify ---------------------------------------------------------------------------------
    @trtp.register(VERIFY_PLUGIN_ID)
    def _desc_v(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, nheads: IntAttr, headdim: IntAttr,
                dstate: IntAttr, ngroups: IntAttr, buffer_len: IntAttr, num_tokens: IntAttr) -> tuple[Desc, Desc,
                Desc, Desc, Desc]:
        check(VERIFY_PLUGIN_NAME, dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups,
                                       buffer_len=buffer_len, num_tokens=num_tokens),
              x=x, B=B, state=state, x_cache=x_cache, cursor=cursor, state_batch_indices=state_batch_indices)
        return x.like(), state.aliased(), x_cache.aliased(), B_cache.aliased(), dt_cache.aliased()

    @trtp.autotune(VERIFY_PLUGIN_ID)
    def _tune_v(x, B, C, dt, dt_bias, A, D, state_batch_indices, cursor, state, x_cache, B_cache, dt_cache,
                outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination(st, act)), "LINEAR", list(TACTICS))
                for st in STATE_DTYPES for act in ACT_DTYPES]

    @trtp.aot_impl(VERIFY_PLUGIN_ID)
    def _aot_v(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
               cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, nheads: IntAttr, headdim: IntAttr,
               dstate: IntAttr, ngroups: IntAttr, buffer_len: IntAttr, num_tokens: IntAttr, outputs: tuple[Desc],
               tactic: int) -> AotResult:
        arch, _ = current_device()
        k = aot_verify_kernel(*map(_int, (nheads, headdim, dstate, ngroups, buffer_len, num_tokens)), dt_code[state.dtype],
                              dt_code[x.dtype], arch, tactic)
        return result(k, x.shape_expr[0], state.shape_expr[0])

    # ---- mamba2_verify_shadow ------------------------------------------------------------------------------
    @trtp.register(VERIFY_SHADOW_PLUGIN_ID)
    def _desc_vs(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
                 cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, shadow: Desc,
                 shadow_scale: Desc, nheads: IntAttr, headdim: IntAttr, dstate: IntAttr, ngroups: IntAttr,
                 buffer_len: IntAttr, num_tokens: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc, Desc, Desc]:
        check(VERIFY_SHADOW_PLUGIN_NAME, dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups,
                                              buffer_len=buffer_len, num_tokens=num_tokens), shadow_code.get(shadow.dtype),
              x=x, B=B, state=state, x_cache=x_cache, cursor=cursor, shadow=shadow, shadow_scale=shadow_scale,
              state_batch_indices=state_batch_indices)
        return (x.like(), state.aliased(), x_cache.aliased(), B_cache.aliased(), dt_cache.aliased(), shadow.aliased(),
                shadow_scale.aliased())

    @trtp.autotune(VERIFY_SHADOW_PLUGIN_ID)
    def _tune_vs(x, B, C, dt, dt_bias, A, D, state_batch_indices, cursor, state, x_cache, B_cache, dt_cache, shadow,
                 shadow_scale, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(type_combination("f32", act, sh)), "LINEAR", list(TACTICS))
                for sh in SHADOW_KINDS for act in ACT_DTYPES]

    @trtp.aot_impl(VERIFY_SHADOW_PLUGIN_ID)
    def _aot_vs(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, shadow: Desc,
                shadow_scale: Desc, nheads: IntAttr, headdim: IntAttr, dstate: IntAttr, ngroups: IntAttr,
                buffer_len: IntAttr, num_tokens: IntAttr, outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, _ = current_device()
        k = aot_verify_kernel(*map(_int, (nheads, headdim, dstate, ngroups, buffer_len, num_tokens)),
                              dt_code[state.dtype], dt_code[x.dtype], arch, tactic, shadow_code[shadow.dtype])
        return result(k, x.shape_expr[0], state.shape_expr[0])


__all__ = ["PLUGINS", "PLUGIN_NAME", "SHADOW_PLUGIN_NAME", "VERIFY_PLUGIN_NAME", "VERIFY_SHADOW_PLUGIN_NAME",
           "DECODE_PLUGINS", "VERIFY_PLUGINS", "SHADOW_KINDS", "aot_kernel", "aot_verify_kernel", "io_shapes",
           "verify_io_shapes", "type_combination", "shape_attributes", "check_attributes", "register"]
