# SPDX-License-Identifier: Apache-2.0
"""TensorRT AOT quickly-deployable plugins ``replayssm::*`` (TensorRT >= 10.9, 11.x): what every family shares.

Each family folder declares its plugins (:attr:`~.families.Family.trt_plugin`: Mamba-2's ``mamba2_decode`` /
``mamba2_verify`` (+ ``_shadow``), families/mamba2/trt_plugin.py; Gated DeltaNet's ``gdn_decode`` / ``gdn_verify``
(+ ``_shadow``), families/gdn/trt_plugin.py; Kimi Delta Attention's ``kda_decode`` (+ ``_shadow``),
families/kda/trt_plugin.py), found through :func:`family_plugins` and registered by :func:`register`. Each plugin
layer is one kernel launch. Here: the pieces every family's plugins use (the attribute form :data:`IntAttr`,
:class:`PluginInfo`, :class:`AotKernel`, the dtype / tactic / window / shadow-shape checks, the TensorRT type
names, the build device) and the two plugins of the shared cursor:

``replayssm::spec_commit``: one launch of ``replayssm_spec_commit`` per model step, after sampling
(all layers share the cursor, whatever their family): the flush the verify layers did (count + 2T > L: start =
(start + count) % L, count = 0), then count += n_accepted (clamped to [0, T]). Inputs:
  0  state_batch_indices  (b,)          int32
  1  n_accepted           (b,)          int32, accepted tokens of the window including the first
  2  cursor               (S, 2)        int32
Output: 0 cursor_out aliased to input 2. Attributes: num_tokens, buffer_len. Kernel parameters: the
3 input pointers, int32 batch, int32 slots, the output pointer. Grid ceil(b / 256), block 256.

``replayssm::flush_order``: one launch of ``replayssm_flush_order`` per model step, before the first recurrent layer
(all layers share the cursor): the step's rows in flush-first order, (row, slot, cursor, 0) each, the rows whose
cursor is L - 1 first (:func:`.cursor.flush_order` is the spec, bit for bit). Every decode plugin of the step may take
it as its ``state_batch_indices`` input, (b, 4) in place of (b,): it then runs the module built for it
(``row_order``), which reads each block's row, slot and cursor in one load, so the long flushing blocks run first.
Inputs:
  0  state_batch_indices  (b,)          int32
  1  cursor               (S,)          int32, the standard cursor, read only
Output: 0 row_order (b, 4) int32. Attributes: buffer_len. Kernel parameters: the 2 input pointers, int32 batch,
int32 slots, the output pointer. Grid 1, block 1024 (one block walks the rows).

Plugin attributes are not serialized with AOT plugins, so every size is compiled into the PTX and checked
against the input shapes (:func:`shape_attributes` + :func:`check_attributes`, each family's part in its module).
Aliased I/O needs the preview feature ``PreviewFeature.ALIASED_PLUGIN_IO_10_03`` on the builder config. Importing
this module does not need TensorRT; :func:`register` does.

Everything ``register`` hands TensorRT comes from plain functions that the CPU tests run: :func:`aot_commit_kernel`
and each family module's ``aot_*`` (PTX, kernel name, grid, block, int32 args), :func:`shape_attributes` +
:func:`check_attributes`, the family modules' ``type_combination``.
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin checks the annotations of the
# functions register() decorates with issubclass(), so they must be classes, not strings.

import dataclasses

import numpy as np
import numpy.typing as npt

from .compile import check_ptx_loadable, compile_spec
from .config import COMMIT_THREADS, ORDER_THREADS, SUPPORTED_NUM_TOKENS, KernelSpec, commit_spec, cursor_spec
from .cursor import ORDER_COLUMNS

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
TACTICS = {1: 256, 2: 1}  # tactic -> the batch its geometry is chosen for (large / small batch), every family
STATE_DTYPES = ("f32", "f16", "bf16")
ACT_DTYPES = ("f32", "f16", "bf16")

COMMIT_PLUGIN_NAME = "spec_commit"
COMMIT_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{COMMIT_PLUGIN_NAME}"
COMMIT_KERNEL_NAME = "replayssm_spec_commit"
COMMIT_ATTRIBUTES = ("num_tokens", "buffer_len")
COMMIT_INPUT_NAMES = ("state_batch_indices", "n_accepted", "cursor")
COMMIT_OUTPUT_NAMES = ("cursor_out",)
COMMIT_ALIASES = {0: 2}
COMMIT_TACTICS = (1,)  # one kernel; advertised so that TensorRT always sets a tactic

ORDER_PLUGIN_NAME = "flush_order"
ORDER_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{ORDER_PLUGIN_NAME}"
ORDER_KERNEL_NAME = "replayssm_flush_order"
ORDER_ATTRIBUTES = ("buffer_len",)
ORDER_INPUT_NAMES = ("state_batch_indices", "cursor")
ORDER_OUTPUT_NAMES = ("row_order",)
ORDER_TACTICS = (1,)



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


def with_shadow(inputs: tuple, outputs: tuple, aliases: dict, shadow: tuple = ("shadow",)) -> tuple:
    """A plugin's tensors with its shadow state appended: (inputs + shadow, outputs + <shadow>_out, aliases + each
    shadow output aliased to its input)."""
    outs = tuple(f"{n}_out" for n in shadow)
    return (inputs + shadow, outputs + outs,
            {**aliases, **{len(outputs) + j: len(inputs) + j for j in range(len(shadow))}})


def decode_verify_plugins(names: tuple, kernel: str, verify_kernel: str, tensors: tuple, shadow_tensors: tuple,
                          attributes: tuple) -> dict:
    """The four plugins of a family's ring step: ``names`` = (decode, decode_shadow, verify, verify_shadow);
    ``tensors`` / ``shadow_tensors`` = (inputs, outputs, aliases) without / with the shadow. The verify plugins take
    the same tensor names (their step inputs carry a window axis, the cursor is (slots, 2)) and the attributes plus
    ``num_tokens``."""
    verify_attributes = attributes + ("num_tokens",)
    return {names[0]: PluginInfo(names[0], kernel, *tensors, attributes),
            names[1]: PluginInfo(names[1], kernel, *shadow_tensors, attributes),
            names[2]: PluginInfo(names[2], verify_kernel, *tensors, verify_attributes),
            names[3]: PluginInfo(names[3], verify_kernel, *shadow_tensors, verify_attributes)}


PLUGINS = {  # the shared plugins; each family's are in its module (family_plugins)
    COMMIT_PLUGIN_NAME: PluginInfo(COMMIT_PLUGIN_NAME, COMMIT_KERNEL_NAME, COMMIT_INPUT_NAMES, COMMIT_OUTPUT_NAMES,
                                   COMMIT_ALIASES, COMMIT_ATTRIBUTES),
    ORDER_PLUGIN_NAME: PluginInfo(ORDER_PLUGIN_NAME, ORDER_KERNEL_NAME, ORDER_INPUT_NAMES, ORDER_OUTPUT_NAMES, {},
                                  ORDER_ATTRIBUTES),
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


def check_spec_attributes(num_tokens: int, buffer_len: int) -> None:
    """The window attributes of a verify plugin / spec_commit: T = 1 + num_draft supported, 2T <= L <= 32."""
    if num_tokens not in SUPPORTED_NUM_TOKENS:
        raise ValueError(f"num_tokens: expected one of {SUPPORTED_NUM_TOKENS} (1 + num_draft), got {num_tokens!r}")
    if not isinstance(buffer_len, int) or not 2 * num_tokens <= buffer_len <= 32:
        raise ValueError(f"buffer_len: expected in [2 * num_tokens, 32] = [{2 * num_tokens}, 32] (flush one window "
                         f"early), got {buffer_len!r}")


def aot_commit_kernel(num_tokens: int, buffer_len: int, arch: int) -> AotKernel:
    """PTX and launch parameters of the ``spec_commit`` layer (what ``cursor_ops.spec_commit`` launches)."""
    check_spec_attributes(num_tokens, buffer_len)
    spec = commit_spec(num_tokens, buffer_len, arch)
    return AotKernel(COMMIT_KERNEL_NAME, compile_spec(spec, "ptx"), 0, False, COMMIT_THREADS, 0, ("batch", "slots"),
                     spec, rows_per_block=COMMIT_THREADS)


def aot_order_kernel(buffer_len: int, arch: int) -> AotKernel:
    """PTX and launch parameters of the ``flush_order`` layer (what ``cursor_ops.flush_order`` launches)."""
    if isinstance(buffer_len, bool) or not isinstance(buffer_len, int) or not 1 <= buffer_len <= 32:
        raise ValueError(f"buffer_len: expected an int in 1..32, got {buffer_len!r}")
    spec = cursor_spec(buffer_len, arch)
    return AotKernel(ORDER_KERNEL_NAME, compile_spec(spec, "ptx"), 1, False, ORDER_THREADS, 0, ("batch", "slots"), spec)


def order_io_shapes(batch, slots) -> dict[str, tuple]:
    """Shapes of every ``flush_order`` input and output."""
    return {"state_batch_indices": (batch,), "cursor": (slots,), "row_order": (batch, ORDER_COLUMNS)}


def check_rows_input(plugin: str, shapes: dict, ordered: bool) -> None:
    """A decode plugin's ``state_batch_indices`` input: (b,) slots, or with ``ordered`` (a plugin that takes the
    step's flush-first order) also the ``flush_order`` output (b, 4); a verify plugin's: (b,)."""
    rows = shapes.get("state_batch_indices")
    if rows is None or len(rows) == 1 or (ordered and len(rows) == 2 and rows[1] in (ORDER_COLUMNS, None)):
        return
    want = f"(batch,) or the flush_order output (batch, {ORDER_COLUMNS})" if ordered else "(batch,)"
    raise ValueError(f"{all_plugins()[plugin].id}: state_batch_indices: expected {want}, got {tuple(rows)}")


def ordered_rows(desc) -> bool:
    """Whether a plugin's ``state_batch_indices`` input (a TensorDesc) is the flush-first order (b, 4)."""
    return len(tuple(desc.shape_expr)) == 2


def commit_io_shapes(batch, slots) -> dict[str, tuple]:
    """Shapes of every ``spec_commit`` input and output."""
    return {"state_batch_indices": (batch,), "n_accepted": (batch,), "cursor": (slots, 2), "cursor_out": (slots, 2)}


def shape_attributes(plugin: str, shapes: dict) -> dict:
    """The attribute values the input shapes imply (``shapes``: input name -> shape; a dimension may be
    None where it is not known yet): the plugin's family module's (``spec_commit``'s are not visible in its
    shapes)."""
    def dim(name, axis):
        shape = shapes.get(name)
        return None if shape is None or len(shape) <= axis else shape[axis]

    if plugin in PLUGINS:  # spec_commit, flush_order: no attribute shows in their shapes
        return {}
    fam = family_plugins()
    if plugin in fam:
        return fam[plugin][0].shape_attributes(plugin, dim)
    raise ValueError(f"plugin: expected one of {sorted(all_plugins())}, got {plugin!r}")


def check_attributes(plugin: str, attrs: dict, shapes: dict, shadow_kind: str | None = None) -> None:
    """Raise if an attribute disagrees with a known input dimension (attributes are compiled into the PTX); for a
    plugin with a shadow input also a shadow whose shape is not the state's, or a shadow_scale input that is not an
    fp8 shadow's (S, H, P) row scales / a bf16 shadow's (1,) placeholder (``shadow_kind``: "bf16" or "fp8", the
    shadow input's dtype; None: not known yet); then the family's own checks (its module's
    ``check_attributes``)."""
    implied = shape_attributes(plugin, shapes)
    bad = {k: (attrs[k], v) for k, v in implied.items() if v is not None and v != attrs[k]}
    if bad:
        got = ", ".join(f"{k}={a} but the inputs have {v}" for k, (a, v) in bad.items())
        raise ValueError(f"{all_plugins()[plugin].id}: attributes do not match the input shapes: {got}")
    if plugin == COMMIT_PLUGIN_NAME:
        check_spec_attributes(attrs["num_tokens"], attrs["buffer_len"])
        _check_ring_cursor(plugin, shapes)
        return
    if plugin == ORDER_PLUGIN_NAME:
        if not 1 <= attrs["buffer_len"] <= 32:
            raise ValueError(f"{ORDER_PLUGIN_ID}: buffer_len: expected 1..32, got {attrs['buffer_len']!r}")
        for name in ORDER_INPUT_NAMES:
            if shapes.get(name) is not None and len(shapes[name]) != 1:
                raise ValueError(f"{ORDER_PLUGIN_ID}: {name}: expected shape ({'batch' if name != 'cursor' else 'slots'},)"
                                 f", got {tuple(shapes[name])}")
        return
    mod, info = family_plugins()[plugin]
    if "shadow_scale" in info.inputs:  # the row scales' form follows the shadow's dtype
        _check_shadow_shapes(plugin, {k: shapes.get(k) for k in ("state", "shadow", "shadow_scale")}, shadow_kind)
    mod.check_attributes(plugin, attrs, shapes, _check_shadow_shapes)


def _check_ring_cursor(plugin: str, shapes: dict) -> None:
    cursor = shapes.get("cursor")
    if cursor is not None and (len(cursor) != 2 or cursor[1] not in (2, None)):
        raise ValueError(f"{all_plugins()[plugin].id}: cursor: expected shape (slots, 2), got {tuple(cursor)}")


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


COMMIT_TYPES = ["INT32"] * (len(COMMIT_INPUT_NAMES) + len(COMMIT_OUTPUT_NAMES))
ORDER_TYPES = ["INT32"] * (len(ORDER_INPUT_NAMES) + len(ORDER_OUTPUT_NAMES))


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
    """Register ``spec_commit`` and every family's plugins (``families/<name>/trt_plugin.py``, through
    :func:`family_plugins`) with TensorRT's Python plugin registry (idempotent).

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

    # ---- flush_order ---------------------------------------------------------------------------------------
    @trtp.register(ORDER_PLUGIN_ID)
    def _desc_o(state_batch_indices: Desc, cursor: Desc, buffer_len: IntAttr) -> tuple[Desc]:
        check(ORDER_PLUGIN_NAME, dict(buffer_len=buffer_len), state_batch_indices=state_batch_indices, cursor=cursor)
        rows = trtp.ShapeExprs.from_tuple((state_batch_indices.shape_expr[0], ORDER_COLUMNS))
        return (trtp.from_shape_expr(rows, dtype=state_batch_indices.dtype),)

    @trtp.autotune(ORDER_PLUGIN_ID)
    def _tune_o(state_batch_indices, cursor, outputs) -> Tune:
        return [trtp.AutoTuneCombination(", ".join(ORDER_TYPES), "LINEAR", list(ORDER_TACTICS))]

    @trtp.aot_impl(ORDER_PLUGIN_ID)
    def _aot_o(state_batch_indices: Desc, cursor: Desc, buffer_len: IntAttr, outputs: tuple[Desc],
               tactic: int) -> AotResult:
        arch, _ = current_device()
        k = aot_order_kernel(_int(buffer_len), arch)
        return result(k, state_batch_indices.shape_expr[0], cursor.shape_expr[0])

    # ---- the families' plugins (families/<name>/trt_plugin.py), through the shared pieces above ------------------
    import types

    ctx = types.SimpleNamespace(trtp=trtp, Desc=Desc, IntAttr=IntAttr, AotResult=AotResult, Tune=Tune, dt_code=dt_code,
                                shadow_code=shadow_code, check=check, result=result, current_device=current_device,
                                ordered_rows=ordered_rows)
    for mod in {id(m): m for m, _ in family_plugins().values()}.values():
        mod.register(ctx)

    register._done = True
