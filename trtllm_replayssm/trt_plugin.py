# SPDX-License-Identifier: Apache-2.0
"""TensorRT AOT quickly-deployable plugins ``replayssm::*`` (TensorRT >= 10.9, 11.x).

``mamba2_decode`` (+ ``mamba2_decode_shadow``) for standard decode, ``mamba2_verify`` (+
``mamba2_verify_shadow``) + ``spec_commit`` for speculative decoding; each family folder's own (Gated DeltaNet:
``gdn_decode`` / ``gdn_verify`` (+ ``_shadow``), families/gdn/trt_plugin.py; Kimi Delta Attention: ``kda_decode``
(+ ``_shadow``), families/kda/trt_plugin.py) through :func:`family_plugins`. Each plugin layer is one kernel launch.

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
Kernel parameters: the 15 input pointers, int32 batch, int32 slots, the 7 output pointers.

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

``replayssm::spec_commit``: one launch of ``replayssm_spec_commit`` per model step, after sampling
(all Mamba layers share the cursor): the flush the verify layers did (count + 2T > L: start =
(start + count) % L, count = 0), then count += n_accepted (clamped to [0, T]). Inputs:
  0  state_batch_indices  (b,)          int32
  1  n_accepted           (b,)          int32, accepted tokens of the window including the first
  2  cursor               (S, 2)        int32
Output: 0 cursor_out aliased to input 2. Attributes: num_tokens, buffer_len. Kernel parameters: the
3 input pointers, int32 batch, int32 slots, the output pointer. Grid ceil(b / 256), block 256.

Everything ``register`` hands TensorRT comes from plain functions that the CPU tests run:
:func:`aot_kernel`, :func:`aot_verify_kernel`, :func:`aot_commit_kernel` and each family module's ``aot_*`` (PTX,
kernel name, grid, block, int32 args), :func:`shape_attributes` + :func:`check_attributes`, :func:`type_combination`.
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin checks the annotations of the
# functions register() decorates with issubclass(), so they must be classes, not strings.

import dataclasses

import numpy as np
import numpy.typing as npt

from .compile import check_ptx_loadable, compile_spec
from .config import (
    COMMIT_THREADS,
    SUPPORTED_NUM_TOKENS,
    KernelSpec,
    commit_spec,
    plan,
    spec_grid,
    verify_spec,
)

# The annotation of every plugin attribute. TensorRT hands an attribute to create_plugin as a one-element int32
# array (the ONNX parser's kINT32 field; the network API's likewise): for an ``int`` annotation it calls
# int(field.data), which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"),
# so no plugin node could be created; for an array annotation it converts with astype, on every NumPy. The
# plugin functions take either form through _int.
IntAttr = npt.NDArray[np.int32]


def _int(v) -> int:
    """A plugin attribute as a Python int: an int, or a one-element integer array (TensorRT's form)."""
    if isinstance(v, np.ndarray):
        if v.size != 1 or v.dtype.kind not in "iu":
            raise ValueError(f"plugin attribute: expected one integer, got an array {v.dtype} of shape {v.shape}")
        return int(v.reshape(-1)[0])
    return int(v)


def _ints(attrs: dict) -> dict:
    return {k: _int(v) for k, v in attrs.items()}


as_int = _int  # the name a family's plugin module uses (families/<name>/trt_plugin.py)


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

VERIFY_PLUGIN_NAME = "mamba2_verify"
VERIFY_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{VERIFY_PLUGIN_NAME}"
VERIFY_KERNEL_NAME = "replayssm_verify"
VERIFY_ATTRIBUTES = ATTRIBUTES + ("num_tokens",)
VERIFY_INPUT_NAMES = INPUT_NAMES  # same names; x, B, C, dt carry a window axis, cursor is (S, 2)
VERIFY_OUTPUT_NAMES = OUTPUT_NAMES
VERIFY_ALIASES = ALIASES
VERIFY_SHADOW_PLUGIN_NAME = "mamba2_verify_shadow"
VERIFY_SHADOW_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{VERIFY_SHADOW_PLUGIN_NAME}"
VERIFY_PLUGINS = (VERIFY_PLUGIN_NAME, VERIFY_SHADOW_PLUGIN_NAME)

COMMIT_PLUGIN_NAME = "spec_commit"
COMMIT_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{COMMIT_PLUGIN_NAME}"
COMMIT_KERNEL_NAME = "replayssm_spec_commit"
COMMIT_ATTRIBUTES = ("num_tokens", "buffer_len")
COMMIT_INPUT_NAMES = ("state_batch_indices", "n_accepted", "cursor")
COMMIT_OUTPUT_NAMES = ("cursor_out",)
COMMIT_ALIASES = {0: 2}
COMMIT_TACTICS = (1,)  # one kernel; advertised so that TensorRT always sets a tactic



@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """The contract of one plugin: what the build manifest lists and the CPU tests check."""

    name: str
    kernel_name: str
    inputs: tuple
    outputs: tuple
    aliases: dict  # output index -> input index
    attributes: tuple

    @property
    def id(self) -> str:
        return f"{PLUGIN_NAMESPACE}::{self.name}"

    def manifest(self) -> dict:
        return dict(id=self.id, kernel=self.kernel_name, inputs=list(self.inputs), outputs=list(self.outputs),
                    attributes=list(self.attributes),
                    aliased_outputs={self.outputs[o]: self.inputs[i] for o, i in self.aliases.items()})


PLUGINS = {
    PLUGIN_NAME: PluginInfo(PLUGIN_NAME, KERNEL_NAME, INPUT_NAMES, OUTPUT_NAMES, ALIASES, ATTRIBUTES),
    SHADOW_PLUGIN_NAME: PluginInfo(SHADOW_PLUGIN_NAME, KERNEL_NAME, SHADOW_INPUT_NAMES, SHADOW_OUTPUT_NAMES,
                                   SHADOW_ALIASES, ATTRIBUTES),
    VERIFY_PLUGIN_NAME: PluginInfo(VERIFY_PLUGIN_NAME, VERIFY_KERNEL_NAME, VERIFY_INPUT_NAMES, VERIFY_OUTPUT_NAMES,
                                   VERIFY_ALIASES, VERIFY_ATTRIBUTES),
    VERIFY_SHADOW_PLUGIN_NAME: PluginInfo(VERIFY_SHADOW_PLUGIN_NAME, VERIFY_KERNEL_NAME, SHADOW_INPUT_NAMES,
                                          SHADOW_OUTPUT_NAMES, SHADOW_ALIASES, VERIFY_ATTRIBUTES),
    COMMIT_PLUGIN_NAME: PluginInfo(COMMIT_PLUGIN_NAME, COMMIT_KERNEL_NAME, COMMIT_INPUT_NAMES, COMMIT_OUTPUT_NAMES,
                                   COMMIT_ALIASES, COMMIT_ATTRIBUTES),
}


@dataclasses.dataclass(frozen=True)
class AotKernel:
    """Everything ``aot_impl`` hands TensorRT, as plain values."""

    kernel_name: str
    ptx: bytes
    grid_x: int  # blocks in x (unused when rows_per_block > 0)
    grid_y_is_batch: bool  # True: grid_y = batch (symbolic in the engine); False: 1 (persistent blocks)
    block_x: int
    shared_mem: int  # dynamic shared memory (the kernels use static shared memory only)
    extra_args: tuple[str, ...]  # int32 scalars, in order, named by the dimension they carry
    spec: KernelSpec
    rows_per_block: int = 0  # > 0: one thread per batch row, grid_x = ceil(batch / rows_per_block)

    def grid(self, batch):
        """(x, y, z) for ``batch`` rows: an int, or TensorRT's symbolic expression (only + and // are used)."""
        if self.rows_per_block:
            return ((batch + (self.rows_per_block - 1)) // self.rows_per_block, 1, 1)
        return (self.grid_x, batch if self.grid_y_is_batch else 1, 1)

    def extra_values(self, batch, slots) -> list:
        """The int32 extra args in kernel order (ints or symbolic expressions)."""
        dims = {"batch": batch, "slots": slots}
        return [dims[n] for n in self.extra_args]


def _check_dtypes(state: str, act: str, tactic: int, tactics=TACTICS) -> None:
    if state not in STATE_DTYPES:
        raise ValueError(f"state: expected one of {STATE_DTYPES}, got {state!r}")
    if act not in ACT_DTYPES:
        raise ValueError(f"act: expected one of {ACT_DTYPES}, got {act!r}")
    if tactic not in tactics:
        raise ValueError(f"tactic: expected one of {sorted(tactics)}, got {tactic!r}")


check_dtypes = _check_dtypes  # the name a family's plugin module uses


def family_plugins() -> dict:
    """{plugin name: (the family's plugin module, PluginInfo)} of every family folder that declares TensorRT plugins
    (``Family.trt_plugin``; imported on first use)."""
    import importlib

    from . import families

    out = {}
    for name in families.names():
        path = families.get(name).trt_plugin
        if path:
            mod = importlib.import_module(path)
            out.update({n: (mod, info) for n, info in mod.PLUGINS.items()})
    return out


def all_plugins() -> dict:
    """{plugin name: PluginInfo} of every plugin: the ones defined here and the families' (:func:`family_plugins`)."""
    return {**PLUGINS, **{n: info for n, (_, info) in family_plugins().items()}}


def aot_kernel(nheads: int, headdim: int, dstate: int, ngroups: int, buffer_len: int, state: str, act: str,
               arch: int, tactic: int = 1, sm_count: int = 132, shadow: str = "none") -> AotKernel:
    """The PTX and launch parameters for one plugin layer (the core of ``aot_impl``); ``shadow``
    "bf16" / "fp8" for ``mamba2_decode_shadow``."""
    if state not in STATE_DTYPES:
        raise ValueError(f"state: expected one of {STATE_DTYPES}, got {state!r}")
    if shadow != "none" and (shadow not in SHADOW_KINDS or state != "f32"):
        raise ValueError(f"shadow: expected one of {SHADOW_KINDS} with an f32 state, got shadow={shadow!r}, "
                         f"state={state!r}")
    _check_dtypes(state, act, tactic)
    rows, warps, variant = plan(state, act, nheads, headdim, dstate, buffer_len, TACTICS[tactic], shadow=shadow)
    spec = KernelSpec(state, act, nheads, headdim, dstate, ngroups, buffer_len, rows, warps, False, arch,
                      variant=variant, shadow=shadow)
    # Persistent blocks: a fixed grid of sm_count * blocks_per_sm, the kernel walks batch*items.
    grid_x = sm_count * spec.blocks_per_sm if spec.persistent else spec.grid(1)[0]
    return AotKernel(KERNEL_NAME, compile_spec(spec, "ptx"), grid_x, not spec.persistent, spec.threads, 0,
                     ("batch", "slots"), spec)


def check_spec_attributes(num_tokens: int, buffer_len: int) -> None:
    """The window attributes of mamba2_verify / spec_commit: T = 1 + num_draft supported, 2T <= L <= 32."""
    if num_tokens not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"num_tokens: expected one of {SUPPORTED_NUM_TOKENS} (1 + num_draft), got {num_tokens!r}")
    if not isinstance(buffer_len, int) or not 2 * num_tokens <= buffer_len <= 32:
        raise ValueError(f"buffer_len: expected in [2 * num_tokens, 32] = [{2 * num_tokens}, 32] (flush one window "
                         f"early), got {buffer_len!r}")


def aot_verify_kernel(nheads: int, headdim: int, dstate: int, ngroups: int, buffer_len: int, num_tokens: int,
                      state: str, act: str, arch: int, tactic: int = 1, shadow: str = "none") -> AotKernel:
    """PTX and launch parameters of one ``mamba2_verify`` (``mamba2_verify_shadow`` with ``shadow`` "bf16" /
    "fp8") layer: the kernel ``ops.replay_verify`` launches (same spec, grid and argument order) for the
    tactic's batch geometry."""
    check_spec_attributes(num_tokens, buffer_len)
    if shadow != "none" and (shadow not in SHADOW_KINDS or state != "f32"):
        raise ValueError(f"shadow: expected one of {SHADOW_KINDS} with an f32 state, got shadow={shadow!r}, "
                         f"state={state!r}")
    _check_dtypes(state, act, tactic)
    spec = verify_spec(state, act, nheads, headdim, dstate, ngroups, buffer_len, num_tokens, TACTICS[tactic], False,
                       arch, shadow)
    return AotKernel(VERIFY_KERNEL_NAME, compile_spec(spec, "ptx"), spec_grid(spec, 1)[0], True, spec.threads, 0,
                     ("batch", "slots"), spec)


def aot_commit_kernel(num_tokens: int, buffer_len: int, arch: int) -> AotKernel:
    """PTX and launch parameters of the ``spec_commit`` layer (what ``ops.spec_commit`` launches)."""
    check_spec_attributes(num_tokens, buffer_len)
    spec = commit_spec(num_tokens, buffer_len, arch)
    return AotKernel(COMMIT_KERNEL_NAME, compile_spec(spec, "ptx"), 0, False, COMMIT_THREADS, 0, ("batch", "slots"),
                     spec, rows_per_block=COMMIT_THREADS)


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


def commit_io_shapes(batch, slots) -> dict[str, tuple]:
    """Shapes of every ``spec_commit`` input and output."""
    return {"state_batch_indices": (batch,), "n_accepted": (batch,), "cursor": (slots, 2), "cursor_out": (slots, 2)}


def shape_attributes(plugin: str, shapes: dict) -> dict:
    """The attribute values the input shapes imply (``shapes``: input name -> shape; a dimension may be
    None where it is not known yet). ``spec_commit``'s attributes are not visible in its shapes."""
    def dim(name, axis):
        shape = shapes.get(name)
        return None if shape is None or len(shape) <= axis else shape[axis]

    if plugin in (PLUGIN_NAME, SHADOW_PLUGIN_NAME):
        return dict(nheads=dim("x", 1), headdim=dim("x", 2), dstate=dim("state", 3), ngroups=dim("B", 1),
                    buffer_len=dim("x_cache", 2))
    if plugin in VERIFY_PLUGINS:
        return dict(nheads=dim("x", 2), headdim=dim("x", 3), dstate=dim("state", 3), ngroups=dim("B", 2),
                    buffer_len=dim("x_cache", 2), num_tokens=dim("x", 1))
    if plugin == COMMIT_PLUGIN_NAME:
        return {}
    fam = family_plugins()
    if plugin in fam:
        return fam[plugin][0].shape_attributes(plugin, dim)
    raise ValueError(f"plugin: expected one of {sorted(all_plugins())}, got {plugin!r}")


def check_attributes(plugin: str, attrs: dict, shapes: dict, shadow_kind: str | None = None) -> None:
    """Raise if an attribute disagrees with a known input dimension (attributes are compiled into the PTX);
    for the Mamba-2 shadow plugins also a shadow whose shape is not the state's, or a shadow_scale that is not
    the fp8 shadow's (S, H, P) row scales / the bf16 shadow's (1,) placeholder (``shadow_kind``: "bf16" or
    "fp8", the shadow input's dtype; None: not known yet)."""
    implied = shape_attributes(plugin, shapes)
    bad = {k: (attrs[k], v) for k, v in implied.items() if v is not None and v != attrs[k]}
    if bad:
        got = ", ".join(f"{k}={a} but the inputs have {v}" for k, (a, v) in bad.items())
        raise ValueError(f"{all_plugins()[plugin].id}: attributes do not match the input shapes: {got}")
    fam = family_plugins()
    if plugin in fam:  # the family's own checks (its module)
        fam[plugin][0].check_attributes(plugin, attrs, shapes, _check_shadow_shapes)
        return
    if plugin in (SHADOW_PLUGIN_NAME, VERIFY_SHADOW_PLUGIN_NAME):
        _check_shadow_shapes(plugin, shapes, shadow_kind)
    if plugin in VERIFY_PLUGINS + (COMMIT_PLUGIN_NAME,):
        check_spec_attributes(attrs["num_tokens"], attrs["buffer_len"])
        cursor = shapes.get("cursor")
        if cursor is not None and (len(cursor) != 2 or cursor[1] not in (2, None)):
            raise ValueError(f"{PLUGINS[plugin].id}: cursor: expected shape (slots, 2), got {tuple(cursor)}")


def _check_shadow_shapes(plugin: str, shapes: dict, shadow_kind: str | None) -> None:
    pid = all_plugins()[plugin].id
    def same(a, b):  # dims equal where both are known
        return a is None or b is None or (len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b)))

    state, shadow, scale = shapes.get("state"), shapes.get("shadow"), shapes.get("shadow_scale")
    if not same(shadow, state):
        raise ValueError(f"{pid}: shadow: expected the state's shape {tuple(state)}, got {tuple(shadow)}")
    if scale is None or shadow_kind is None:
        return
    want = (1,) if shadow_kind == "bf16" else (None,) * 3 if state is None else tuple(state[:3])
    if not same(scale, want):
        what = "(1,) (a bf16 shadow's placeholder)" if shadow_kind == "bf16" else "(slots, nheads, headdim) row scales"
        raise ValueError(f"{pid}: shadow_scale: expected {what} for a {shadow_kind} shadow, got "
                         f"{tuple(scale)}")


_TRT_TYPE_NAMES = {"f32": "FP32", "f16": "FP16", "bf16": "BF16", "fp8": "FP8"}
TRT_TYPE_NAMES = _TRT_TYPE_NAMES  # the name a family's plugin module uses


def type_combination(state: str, act: str, shadow: str = "none") -> list[str]:
    """TensorRT type names of the inputs then the outputs for one (state, act[, shadow]) combination
    (mamba2_decode[_shadow]; mamba2_verify has the same types)."""
    a, s = _TRT_TYPE_NAMES[act], _TRT_TYPE_NAMES[state]
    ins = [a, a, a, a, "FP32", "FP32", "FP32", "INT32", "INT32", s, a, a, "FP32"]
    aliases = ALIASES
    if shadow != "none":
        ins += [_TRT_TYPE_NAMES[shadow], "FP32"]
        aliases = SHADOW_ALIASES
    return ins + [a] + [ins[i] for i in aliases.values()]


COMMIT_TYPES = ["INT32"] * (len(COMMIT_INPUT_NAMES) + len(COMMIT_OUTPUT_NAMES))


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


def register():
    """Register the nine plugins here and the families' (``families/<name>/trt_plugin.py``: KDA's ``kda_decode``,
    ``kda_decode_shadow``) with TensorRT's Python plugin registry (idempotent).

    Thin on purpose: every value it hands TensorRT comes from the plain functions above. Runs only
    where TensorRT is installed; tests/test_trt_plugin.py drives it through a stand-in of
    ``tensorrt.plugin`` that checks the documented signature rules.
    """
    import tensorrt as trt
    import tensorrt.plugin as trtp

    if getattr(register, "_done", False):
        return
    Desc = trtp.TensorDesc
    AotResult = tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]
    Tune = list[trtp.AutoTuneCombination]
    dt_code = {trt.float32: "f32", trt.float16: "f16", trt.bfloat16: "bf16"}
    shadow_code = {trt.bfloat16: "bf16", trt.fp8: "fp8"}

    def shape(desc):
        """Constant dimensions; None where TensorRT has not resolved one (placeholder shapes when it
        asks for output types, the dynamic batch)."""
        return tuple(None if e.is_fake or not e.is_constant else e.constant_value() for e in desc.shape_expr)

    def check(plugin, attrs, shadow_kind=None, **descs):
        check_attributes(plugin, _ints(attrs), {name: shape(d) for name, d in descs.items()}, shadow_kind)

    def result(k, batch, slots):
        check_ptx_loadable()  # the engine's driver JIT-compiles this PTX
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = k.grid(batch)
        launch.block_x = k.block_x
        launch.shared_mem = k.shared_mem
        vals = k.extra_values(batch, slots)
        extra = trtp.SymIntExprs(len(vals))
        for i, v in enumerate(vals):
            extra[i] = trtp.SymInt32(v)
        return k.kernel_name, k.ptx, launch, extra

    # ---- mamba2_decode ----------------------------------------------------------------------------
    @trtp.register(PLUGIN_ID)
    def _desc(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
              cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, nheads: IntAttr, headdim: IntAttr,
              dstate: IntAttr, ngroups: IntAttr, buffer_len: IntAttr) -> tuple[Desc, Desc, Desc, Desc, Desc]:
        check(PLUGIN_NAME, dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups, buffer_len=buffer_len),
              x=x, B=B, state=state, x_cache=x_cache)
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
              x_cache=x_cache, shadow=shadow, shadow_scale=shadow_scale)
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
                       tactic, sms, shadow_code[shadow.dtype])
        return result(k, x.shape_expr[0], state.shape_expr[0])

    # ---- mamba2_verify ---------------------------------------------------------------------------------
    @trtp.register(VERIFY_PLUGIN_ID)
    def _desc_v(x: Desc, B: Desc, C: Desc, dt: Desc, dt_bias: Desc, A: Desc, D: Desc, state_batch_indices: Desc,
                cursor: Desc, state: Desc, x_cache: Desc, B_cache: Desc, dt_cache: Desc, nheads: IntAttr, headdim: IntAttr,
                dstate: IntAttr, ngroups: IntAttr, buffer_len: IntAttr, num_tokens: IntAttr) -> tuple[Desc, Desc,
                Desc, Desc, Desc]:
        check(VERIFY_PLUGIN_NAME, dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups,
                                       buffer_len=buffer_len, num_tokens=num_tokens),
              x=x, B=B, state=state, x_cache=x_cache, cursor=cursor)
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
              x=x, B=B, state=state, x_cache=x_cache, cursor=cursor, shadow=shadow, shadow_scale=shadow_scale)
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

    # ---- spec_commit --------------------------------------------------------------------------------------
    @trtp.register(COMMIT_PLUGIN_ID)
    def _desc_c(state_batch_indices: Desc, n_accepted: Desc, cursor: Desc, num_tokens: IntAttr,
                buffer_len: IntAttr) -> tuple[Desc]:
        check(COMMIT_PLUGIN_NAME, dict(num_tokens=num_tokens, buffer_len=buffer_len), cursor=cursor)
        return (cursor.aliased(),)

    @trtp.autotune(COMMIT_PLUGIN_ID)
    def _tune_c(state_batch_indices, n_accepted, cursor, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(COMMIT_TYPES), "LINEAR", list(COMMIT_TACTICS))]

    @trtp.aot_impl(COMMIT_PLUGIN_ID)
    def _aot_c(state_batch_indices: Desc, n_accepted: Desc, cursor: Desc, num_tokens: IntAttr, buffer_len: IntAttr,
               outputs: tuple[Desc], tactic: int) -> AotResult:
        arch, _ = current_device()
        k = aot_commit_kernel(_int(num_tokens), _int(buffer_len), arch)
        return result(k, state_batch_indices.shape_expr[0], cursor.shape_expr[0])

    # ---- the families' plugins (families/<name>/trt_plugin.py), through the shared pieces above ------------------
    import types

    ctx = types.SimpleNamespace(trtp=trtp, Desc=Desc, IntAttr=IntAttr, AotResult=AotResult, Tune=Tune, dt_code=dt_code,
                                check=check, result=result, current_device=current_device)
    for mod in {id(m): m for m, _ in family_plugins().values()}.values():
        mod.register(ctx)

    register._done = True
