# SPDX-License-Identifier: Apache-2.0
"""TensorRT AOT quickly-deployable plugin ``replayssm::mamba2_decode`` (TensorRT >= 10.9, 11.x).

One plugin layer = one launch of ``replayssm_decode`` (plugins/replayssm_decode.cu): the fused
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
compiled into the PTX): nheads, headdim, dstate, ngroups, buffer_len (int).
Kernel parameters, in TensorRT's order: the 13 input pointers, int32 batch, int32 slots, the
5 output pointers (aliased outputs receive their inputs' pointers).
Tactics: 1 = large-batch geometry, 2 = small-batch geometry (smaller row chunks, more warps).
Grid: (heads * chunks, batch) for one-shot blocks, or (SMs * blocks per SM, 1) for the persistent
pipelined kernel, which walks batch * heads * chunks work items itself.
Aliased I/O needs the preview feature ``PreviewFeature.ALIASED_PLUGIN_IO_10_03`` on the builder
config. Importing this module does not need TensorRT; :func:`register` does.

``replayssm::mamba2_decode_shadow``: the same step with a low-precision shadow of an fp32 checkpoint
that non-flush steps read (DESIGN.md §1); the shadow kind is the shadow input's dtype (BF16 or FP8
e4m3), so it is compiled into the PTX like every other type. Two more inputs and aliased outputs:
  13 shadow               (S, H, P, N)  bf16 or fp8-e4m3 (written on flush steps)
  14 shadow_scale         (S, H, P)     fp32 row scales of an fp8 shadow; with a bf16 shadow a
                                        (1,) placeholder, never read or written
  outputs 5 shadow_out -> input 13, 6 shadow_scale_out -> input 14
Kernel parameters: the 15 input pointers, int32 batch, int32 slots, the 7 output pointers.
"""

from __future__ import annotations

import dataclasses

from .compile import check_ptx_loadable, compile_spec
from .config import KernelSpec, plan

PLUGIN_NAMESPACE = "replayssm"
PLUGIN_NAME = "mamba2_decode"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
KERNEL_NAME = "replayssm_decode"
ATTRIBUTES = ("nheads", "headdim", "dstate", "ngroups", "buffer_len")
INPUT_NAMES = ("x", "B", "C", "dt", "dt_bias", "A", "D", "state_batch_indices", "cursor", "state", "x_cache",
               "B_cache", "dt_cache")
OUTPUT_NAMES = ("y", "state_out", "x_cache_out", "B_cache_out", "dt_cache_out")
ALIASES = {1: 9, 2: 10, 3: 11, 4: 12}  # output index -> input index
TACTICS = {1: 256, 2: 1}  # tactic -> the batch its geometry is chosen for
STATE_DTYPES = ("f32", "f16", "bf16")
ACT_DTYPES = ("f32", "f16", "bf16")

SHADOW_PLUGIN_NAME = "mamba2_decode_shadow"
SHADOW_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{SHADOW_PLUGIN_NAME}"
SHADOW_INPUT_NAMES = INPUT_NAMES + ("shadow", "shadow_scale")
SHADOW_OUTPUT_NAMES = OUTPUT_NAMES + ("shadow_out", "shadow_scale_out")
SHADOW_ALIASES = {**ALIASES, 5: 13, 6: 14}
SHADOW_KINDS = ("bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class AotKernel:
    """Everything ``aot_impl`` hands TensorRT, as plain values."""

    kernel_name: str
    ptx: bytes
    grid_x: int
    grid_y_is_batch: bool  # True: grid_y = batch (symbolic in the engine); False: 1 (persistent blocks)
    block_x: int
    shared_mem: int  # dynamic shared memory (the kernel uses static shared memory only)
    extra_args: tuple[str, ...]  # int32 scalars, in order, named by the dimension they carry
    spec: KernelSpec


def aot_kernel(nheads: int, headdim: int, dstate: int, ngroups: int, buffer_len: int, state: str, act: str,
               arch: int, tactic: int = 1, sm_count: int = 132, shadow: str = "none") -> AotKernel:
    """The PTX and launch parameters for one plugin layer (the core of ``aot_impl``); ``shadow``
    "bf16" / "fp8" for ``mamba2_decode_shadow``."""
    if state not in STATE_DTYPES:
        raise ValueError(f"state: expected one of {STATE_DTYPES}, got {state!r}")
    if shadow != "none" and (shadow not in SHADOW_KINDS or state != "f32"):
        raise ValueError(f"shadow: expected one of {SHADOW_KINDS} with an f32 state, got shadow={shadow!r}, "
                         f"state={state!r}")
    if act not in ACT_DTYPES:
        raise ValueError(f"act: expected one of {ACT_DTYPES}, got {act!r}")
    if tactic not in TACTICS:
        raise ValueError(f"tactic: expected one of {sorted(TACTICS)}, got {tactic!r}")
    rows, warps, defines = plan(state, act, nheads, headdim, dstate, buffer_len, TACTICS[tactic], shadow=shadow)
    spec = KernelSpec(state, act, nheads, headdim, dstate, ngroups, buffer_len, rows, warps, False, arch, defines,
                      shadow)
    # Persistent blocks: a fixed grid of sm_count * blocks_per_sm, the kernel walks batch*items.
    grid_x = sm_count * spec.blocks_per_sm if spec.persistent else spec.grid(1)[0]
    return AotKernel(KERNEL_NAME, compile_spec(spec, "ptx"), grid_x, not spec.persistent, spec.threads, 0,
                     ("batch", "slots"), spec)


def io_shapes(batch, slots, nheads, headdim, dstate, ngroups, buffer_len, shadow: str = "none") -> dict[str, tuple]:
    """Shapes of every plugin input and output (the contract ``register`` checks); with a shadow,
    those of ``mamba2_decode_shadow``."""
    H, P, N, G, L = nheads, headdim, dstate, ngroups, buffer_len
    ins = {"x": (batch, H, P), "B": (batch, G, N), "C": (batch, G, N), "dt": (batch, H), "dt_bias": (H,),
           "A": (H,), "D": (H,), "state_batch_indices": (batch,), "cursor": (slots,), "state": (slots, H, P, N),
           "x_cache": (slots, H, L, P), "B_cache": (slots, G, L, N), "dt_cache": (slots, H, L)}
    in_names, out_names, aliases = INPUT_NAMES, OUTPUT_NAMES, ALIASES
    if shadow != "none":
        ins |= {"shadow": (slots, H, P, N), "shadow_scale": (slots, H, P) if shadow == "fp8" else (1,)}
        in_names, out_names, aliases = SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES, SHADOW_ALIASES
    outs = {"y": (batch, H, P)}
    for o, i in aliases.items():
        outs[out_names[o]] = ins[in_names[i]]
    return {**ins, **outs}


_TRT_TYPE_NAMES = {"f32": "FP32", "f16": "FP16", "bf16": "BF16", "fp8": "FP8"}


def type_combination(state: str, act: str, shadow: str = "none") -> list[str]:
    """TensorRT type names of the inputs then the outputs for one (state, act[, shadow]) combination."""
    a, s = _TRT_TYPE_NAMES[act], _TRT_TYPE_NAMES[state]
    ins = [a, a, a, a, "FP32", "FP32", "FP32", "INT32", "INT32", s, a, a, "FP32"]
    aliases = ALIASES
    if shadow != "none":
        ins += [_TRT_TYPE_NAMES[shadow], "FP32"]
        aliases = SHADOW_ALIASES
    return ins + [a] + [ins[i] for i in aliases.values()]


def current_device() -> tuple[int, int]:
    """(compute capability, multiprocessor count) of the GPU the engine is built on (TensorRT
    builds for that GPU)."""
    from cuda.bindings import runtime

    err, dev = runtime.cudaGetDevice()
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"no CUDA device to build for ({err!r})")
    attrs = runtime.cudaDeviceAttr
    vals = []
    for a in (attrs.cudaDevAttrComputeCapabilityMajor, attrs.cudaDevAttrComputeCapabilityMinor,
              attrs.cudaDevAttrMultiProcessorCount):
        err, v = runtime.cudaDeviceGetAttribute(a, dev)
        if err != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"could not read device attribute {a!r} ({err!r})")
        vals.append(v)
    return vals[0] * 10 + vals[1], vals[2]


def register():  # pragma: no cover - needs TensorRT, exercised where it is installed
    """Register the plugin with TensorRT's Python plugin registry (idempotent)."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    if getattr(register, "_done", False):
        return
    dt_code = {trt.float32: "f32", trt.float16: "f16", trt.bfloat16: "bf16"}

    def const(expr, what):
        if not expr.is_constant:
            raise ValueError(f"{PLUGIN_ID}: {what} must be a build-time constant")
        return expr.constant_value()

    def check_attributes(plugin_id, x, B, state, x_cache, want):
        got = (const(x.shape_expr[1], "x.shape[1]"), const(x.shape_expr[2], "x.shape[2]"),
               const(state.shape_expr[3], "state.shape[3]"), const(B.shape_expr[1], "B.shape[1]"),
               const(x_cache.shape_expr[2], "x_cache.shape[2]"))
        if got != want:
            raise ValueError(f"{plugin_id}: attributes {dict(zip(ATTRIBUTES, want))} do not match the input shapes "
                             f"{dict(zip(ATTRIBUTES, got))}")

    @trtp.register(PLUGIN_ID)
    def _desc(x: trtp.TensorDesc, B: trtp.TensorDesc, C: trtp.TensorDesc, dt: trtp.TensorDesc,
              dt_bias: trtp.TensorDesc, A: trtp.TensorDesc, D: trtp.TensorDesc, state_batch_indices: trtp.TensorDesc,
              cursor: trtp.TensorDesc, state: trtp.TensorDesc, x_cache: trtp.TensorDesc, B_cache: trtp.TensorDesc,
              dt_cache: trtp.TensorDesc, nheads: int, headdim: int, dstate: int, ngroups: int,
              buffer_len: int) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc,
                                        trtp.TensorDesc]:
        check_attributes(PLUGIN_ID, x, B, state, x_cache, (nheads, headdim, dstate, ngroups, buffer_len))
        return x.like(), state.aliased(), x_cache.aliased(), B_cache.aliased(), dt_cache.aliased()

    @trtp.autotune(PLUGIN_ID)
    def _tune(x, B, C, dt, dt_bias, A, D, state_batch_indices, cursor, state, x_cache, B_cache, dt_cache,
              outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(", ".join(type_combination(st, act)), "LINEAR", list(TACTICS))
                for st in STATE_DTYPES for act in ACT_DTYPES]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(x: trtp.TensorDesc, B: trtp.TensorDesc, C: trtp.TensorDesc, dt: trtp.TensorDesc,
             dt_bias: trtp.TensorDesc, A: trtp.TensorDesc, D: trtp.TensorDesc, state_batch_indices: trtp.TensorDesc,
             cursor: trtp.TensorDesc, state: trtp.TensorDesc, x_cache: trtp.TensorDesc, B_cache: trtp.TensorDesc,
             dt_cache: trtp.TensorDesc, nheads: int, headdim: int, dstate: int, ngroups: int, buffer_len: int,
             outputs: tuple[trtp.TensorDesc], tactic: int):
        check_ptx_loadable()  # the engine's driver JIT-compiles this PTX
        arch, sms = current_device()
        k = aot_kernel(nheads, headdim, dstate, ngroups, buffer_len, dt_code[state.dtype], dt_code[x.dtype],
                       arch, tactic, sms)
        return k.kernel_name, k.ptx, *_launch(k, x, state)

    def _launch(k, x, state):
        launch = trtp.KernelLaunchParams()
        launch.grid_x = k.grid_x
        launch.grid_y = x.shape_expr[0] if k.grid_y_is_batch else 1
        launch.block_x = k.block_x
        launch.shared_mem = k.shared_mem
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(x.shape_expr[0])
        extra[1] = trtp.SymInt32(state.shape_expr[0])
        return launch, extra

    shadow_code = {trt.bfloat16: "bf16", trt.fp8: "fp8"}

    @trtp.register(SHADOW_PLUGIN_ID)
    def _desc_sh(x: trtp.TensorDesc, B: trtp.TensorDesc, C: trtp.TensorDesc, dt: trtp.TensorDesc,
                 dt_bias: trtp.TensorDesc, A: trtp.TensorDesc, D: trtp.TensorDesc, state_batch_indices: trtp.TensorDesc,
                 cursor: trtp.TensorDesc, state: trtp.TensorDesc, x_cache: trtp.TensorDesc, B_cache: trtp.TensorDesc,
                 dt_cache: trtp.TensorDesc, shadow: trtp.TensorDesc, shadow_scale: trtp.TensorDesc, nheads: int,
                 headdim: int, dstate: int, ngroups: int, buffer_len: int
                 ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc,
                            trtp.TensorDesc, trtp.TensorDesc]:
        check_attributes(SHADOW_PLUGIN_ID, x, B, state, x_cache, (nheads, headdim, dstate, ngroups, buffer_len))
        return (x.like(), state.aliased(), x_cache.aliased(), B_cache.aliased(), dt_cache.aliased(), shadow.aliased(),
                shadow_scale.aliased())

    @trtp.autotune(SHADOW_PLUGIN_ID)
    def _tune_sh(x, B, C, dt, dt_bias, A, D, state_batch_indices, cursor, state, x_cache, B_cache, dt_cache, shadow,
                 shadow_scale, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(", ".join(type_combination("f32", act, sh)), "LINEAR", list(TACTICS))
                for sh in SHADOW_KINDS for act in ACT_DTYPES]

    @trtp.aot_impl(SHADOW_PLUGIN_ID)
    def _aot_sh(x: trtp.TensorDesc, B: trtp.TensorDesc, C: trtp.TensorDesc, dt: trtp.TensorDesc,
                dt_bias: trtp.TensorDesc, A: trtp.TensorDesc, D: trtp.TensorDesc, state_batch_indices: trtp.TensorDesc,
                cursor: trtp.TensorDesc, state: trtp.TensorDesc, x_cache: trtp.TensorDesc, B_cache: trtp.TensorDesc,
                dt_cache: trtp.TensorDesc, shadow: trtp.TensorDesc, shadow_scale: trtp.TensorDesc, nheads: int,
                headdim: int, dstate: int, ngroups: int, buffer_len: int, outputs: tuple[trtp.TensorDesc],
                tactic: int):
        check_ptx_loadable()
        arch, sms = current_device()
        k = aot_kernel(nheads, headdim, dstate, ngroups, buffer_len, dt_code[state.dtype], dt_code[x.dtype], arch,
                       tactic, sms, shadow_code[shadow.dtype])
        return k.kernel_name, k.ptx, *_launch(k, x, state)

    register._done = True
