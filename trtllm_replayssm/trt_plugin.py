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
               arch: int, tactic: int = 1, sm_count: int = 132) -> AotKernel:
    """The PTX and launch parameters for one plugin layer (the core of ``aot_impl``)."""
    if state not in STATE_DTYPES:
        raise ValueError(f"state: expected one of {STATE_DTYPES}, got {state!r}")
    if act not in ACT_DTYPES:
        raise ValueError(f"act: expected one of {ACT_DTYPES}, got {act!r}")
    if tactic not in TACTICS:
        raise ValueError(f"tactic: expected one of {sorted(TACTICS)}, got {tactic!r}")
    rows, warps, defines = plan(state, act, nheads, headdim, dstate, buffer_len, TACTICS[tactic])
    spec = KernelSpec(state, act, nheads, headdim, dstate, ngroups, buffer_len, rows, warps, False, arch, defines)
    # Persistent blocks: a fixed grid of sm_count * blocks_per_sm, the kernel walks batch*items.
    grid_x = sm_count * spec.blocks_per_sm if spec.persistent else spec.grid(1)[0]
    return AotKernel(KERNEL_NAME, compile_spec(spec, "ptx"), grid_x, not spec.persistent, spec.threads, 0,
                     ("batch", "slots"), spec)


def io_shapes(batch, slots, nheads, headdim, dstate, ngroups, buffer_len) -> dict[str, tuple]:
    """Shapes of every plugin input and output (the contract ``register`` checks)."""
    H, P, N, G, L = nheads, headdim, dstate, ngroups, buffer_len
    ins = {"x": (batch, H, P), "B": (batch, G, N), "C": (batch, G, N), "dt": (batch, H), "dt_bias": (H,),
           "A": (H,), "D": (H,), "state_batch_indices": (batch,), "cursor": (slots,), "state": (slots, H, P, N),
           "x_cache": (slots, H, L, P), "B_cache": (slots, G, L, N), "dt_cache": (slots, H, L)}
    outs = {"y": (batch, H, P)}
    for o, i in ALIASES.items():
        outs[OUTPUT_NAMES[o]] = ins[INPUT_NAMES[i]]
    return {**ins, **outs}


_TRT_TYPE_NAMES = {"f32": "FP32", "f16": "FP16", "bf16": "BF16"}


def type_combination(state: str, act: str) -> list[str]:
    """TensorRT type names of the 13 inputs then the 5 outputs for one (state, act) pair."""
    a, s = _TRT_TYPE_NAMES[act], _TRT_TYPE_NAMES[state]
    ins = [a, a, a, a, "FP32", "FP32", "FP32", "INT32", "INT32", s, a, a, "FP32"]
    return ins + [a] + [ins[i] for i in ALIASES.values()]


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

    @trtp.register(PLUGIN_ID)
    def _desc(x: trtp.TensorDesc, B: trtp.TensorDesc, C: trtp.TensorDesc, dt: trtp.TensorDesc,
              dt_bias: trtp.TensorDesc, A: trtp.TensorDesc, D: trtp.TensorDesc, state_batch_indices: trtp.TensorDesc,
              cursor: trtp.TensorDesc, state: trtp.TensorDesc, x_cache: trtp.TensorDesc, B_cache: trtp.TensorDesc,
              dt_cache: trtp.TensorDesc, nheads: int, headdim: int, dstate: int, ngroups: int,
              buffer_len: int) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc,
                                        trtp.TensorDesc]:
        got = (const(x.shape_expr[1], "x.shape[1]"), const(x.shape_expr[2], "x.shape[2]"),
               const(state.shape_expr[3], "state.shape[3]"), const(B.shape_expr[1], "B.shape[1]"),
               const(x_cache.shape_expr[2], "x_cache.shape[2]"))
        want = (nheads, headdim, dstate, ngroups, buffer_len)
        if got != want:
            raise ValueError(f"{PLUGIN_ID}: attributes {dict(zip(ATTRIBUTES, want))} do not match the input shapes "
                             f"{dict(zip(ATTRIBUTES, got))}")
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
        launch = trtp.KernelLaunchParams()
        launch.grid_x = k.grid_x
        launch.grid_y = x.shape_expr[0] if k.grid_y_is_batch else 1
        launch.block_x = k.block_x
        launch.shared_mem = k.shared_mem
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(x.shape_expr[0])
        extra[1] = trtp.SymInt32(state.shape_expr[0])
        return k.kernel_name, k.ptx, launch, extra

    register._done = True
