# SPDX-License-Identifier: Apache-2.0
"""The ``replayssm::*`` plugin ops for onnxruntime on the CPU, through onnxruntime-extensions' Python ops.

* ``mamba2_decode``: :func:`builders.nemotron_h.reference_backend` (``reference.replay_decode`` in
  float64), applied to copies of the state inputs, which become the outputs: (y, state_out,
  x_cache_out, B_cache_out, dt_cache_out).
* ``mamba2_decode_shadow``: the same with a bf16 or fp8 shadow of the checkpoint (inputs 13 shadow, 14 the
  fp8 row scales or the bf16 (1,) placeholder; outputs then shadow_out, shadow_scale_out), the shadow rewritten
  on flush steps.
* ``mamba2_verify_shadow``: ``mamba2_verify`` with the shadow inputs and outputs of ``mamba2_decode_shadow``.
* ``mamba2_verify``: :func:`builders.decode_step.verify_reference_backend` (``spec_reference`` flush +
  verify in float64), same outputs; the cursor is read only.
* ``spec_commit``: :func:`builders.spec_step.commit_reference_backend` on a copy of the cursor.
* ``flush_order``: the host rule :func:`trtllm_replayssm.cursor.flush_order` (the decode ops read its (b, 4) output as
  their rows: the order changes no value).
* ``gdn_decode``: :func:`builders.qwen3_next.reference_backend` (``gdn_reference.replay_decode``), on
  copies of the six GDN state inputs, which become the outputs after y.
* ``gdn_decode_shadow``, ``gdn_verify_shadow``: the same with a bf16 shadow of the checkpoint last in and out.
* ``gdn_verify``: :func:`builders.qwen_export.verify_reference_backend` (``gdn_reference`` flush + verify),
  same outputs; the cursor is read only.
* the ops a family folder declares (:func:`family_ops`: ``trtllm_replayssm/families/<name>/onnx_ops.py``'s
  ``ORT_OPS``, e.g. Kimi Delta Attention's ``kda_decode``), registered as they are declared (below).
Declared for fp32 activations and an fp32 state (the graphs the CPU tests export); attributes are
accepted and checked against the input shapes.

A family's ``ORT_OPS`` maps its op type to a dict: ``inputs`` / ``outputs`` (type names per position: "float",
"int32", "int64"), ``attrs`` (attribute name -> "int" or "string", after the ``plugin_namespace`` and ``aot`` every
plugin node carries), ``low`` ({input index: output index} of the states the graph declares in a low-precision dtype
(bfloat16) that the CPU session carries as float32: :func:`_float_low_io`) and ``run`` (numpy inputs and the
attributes as keywords -> numpy outputs, the family's reference on copies of the states).
"""

from __future__ import annotations

import numpy as np
import torch

from .decode_step import (
    DOMAIN,
    OP_TYPE,
    ORDER_OP_TYPE,
    SHADOW_OP_TYPE,
    VERIFY_OP_TYPE,
    VERIFY_SHADOW_OP_TYPE,
    verify_reference_backend,
)
from .nemotron_h import reference_backend
from .qwen_export import GDN_OP_TYPE, GDN_SHADOW_OP_TYPE, GDN_VERIFY_OP_TYPE, GDN_VERIFY_SHADOW_OP_TYPE
from .qwen_export import verify_reference_backend as gdn_verify_backend
from .spec_step import COMMIT_OP_TYPE, commit_reference_backend

_registered = False


def _op(x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache, **attrs):
    return _mamba2_decode(OP_TYPE, (x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache),
                          None, None, attrs)


def _op_shadow(x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache, shadow, shadow_scale,
               **attrs):
    return _mamba2_decode(SHADOW_OP_TYPE, (x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache,
                                           dt_cache), shadow, shadow_scale, attrs)


def _mamba2_decode(op_type, ins, shadow, shadow_scale, attrs, verify: bool = False):
    """``mamba2_decode`` (shadow None) or ``mamba2_decode_shadow`` on copies of the state inputs; ``verify``:
    ``mamba2_verify_shadow`` (a window axis, the verify backend)."""
    x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache = ins
    w = 1 if verify else 0
    got = (x.shape[1 + w], x.shape[2 + w], B.shape[2 + w], B.shape[1 + w], x_cache.shape[2]) + ((x.shape[1],) if w else ())
    want = tuple(attrs[k] for k in ("nheads", "headdim", "dstate", "ngroups", "buffer_len")
                 + (("num_tokens",) if w else ()))
    if got != want:
        names = ("nheads", "headdim", "dstate", "ngroups", "buffer_len") + (("num_tokens",) if w else ())
        raise ValueError(f"{DOMAIN}::{op_type}: attributes ({', '.join(names)}) = {want}, inputs have {got}")
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731  (copies: the outputs must not alias the inputs)
    caches = dict(state=t(state), x_cache=t(x_cache), B_cache=t(B_cache), dt_cache=t(dt_cache))
    sh = scale = None
    if shadow is not None:
        # float32 values of the bf16 / fp8 shadow (:func:`_float_low_io`); which one: the scale says, a (1,)
        # placeholder for bf16 and (slots, H, P) row scales for fp8
        fp8 = np.asarray(shadow_scale).ndim == 3
        kind = torch.float8_e4m3fn if fp8 else torch.bfloat16
        sh, scale = t(shadow).to(kind), t(shadow_scale)
        if not torch.equal(sh.float(), t(shadow)):
            raise ValueError(f"{DOMAIN}::{op_type}: shadow: expected {kind} values")
    backend = verify_reference_backend if verify else reference_backend
    y = backend(x=t(x), B=t(B), C=t(C), dt=t(dt), dt_bias=t(dt_bias), A=t(A), D=t(D), z=None,
                state_batch_indices=t(sbi), cursor=t(cursor), shadow=sh,
                shadow_scale=scale if sh is not None and sh.dtype == torch.float8_e4m3fn else None, **caches)
    out = (y.numpy(), *(caches[k].numpy() for k in ("state", "x_cache", "B_cache", "dt_cache")))
    return out if sh is None else (*out, sh.float().numpy(), scale.numpy())


_SHADOW_IO = {SHADOW_OP_TYPE: (13, 5), VERIFY_SHADOW_OP_TYPE: (13, 5),  # op -> (shadow input, shadow output)
              GDN_SHADOW_OP_TYPE: (15, 7), GDN_VERIFY_SHADOW_OP_TYPE: (15, 7)}


def family_ops() -> dict:
    """{op type: declaration} of the ops the family folders declare (module docstring), imported on first use."""
    import importlib
    import importlib.util

    from trtllm_replayssm import families

    out = {}
    for name in families.names():
        module = f"{families.__name__}.{name}.onnx_ops"
        if importlib.util.find_spec(module) is not None:
            out.update(importlib.import_module(module).ORT_OPS)
    return out


def _low_io() -> dict:
    """{op type: {input index: output index}} of every op's low-precision states (:func:`_float_low_io`)."""
    return {**{op: dict([io]) for op, io in _SHADOW_IO.items()},
            **{op: dict(d.get("low", {})) for op, d in family_ops().items() if d.get("low")}}


def _float_low_io(model) -> None:
    """onnxruntime-extensions' Python ops take no bfloat16 tensors, nor does onnxruntime's numpy I/O: the bf16 (and
    fp8) states of the graph, which only the plugin ops that declare them (:func:`_low_io`: the checkpoint shadows,
    Kimi Delta Attention's bf16 u ring) read and write, are declared float32 for the CPU session (exact: the values
    are bf16; :func:`feed` and :func:`to_torch` convert, and the ops check that such an input holds bf16 values)."""
    from onnx import TensorProto

    low = _low_io()
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type in low]
    shadow_ins = {n.input[i] for n in nodes for i in low[n.op_type]}
    shadow_outs = {n.output[o] for n in nodes for o in low[n.op_type].values()}
    # After the retyping the op tells bf16 from fp8 by its scale input (the (1,) constant or (S, H, P) row
    # scales): check here, from the declared types, that each Mamba-2 shadow node's scale matches its shadow.
    graph_in = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    for n in nodes:
        if n.op_type not in (SHADOW_OP_TYPE, VERIFY_SHADOW_OP_TYPE):
            continue
        kind = graph_in.get(n.input[13])
        scale_is_input = n.input[14] in graph_in
        if kind == TensorProto.FLOAT8E4M3FN and not scale_is_input:
            raise ValueError(f"ort_reference: {n.name or n.op_type}: an fp8 shadow ({n.input[13]}) needs its row "
                             f"scales as a state input, got {n.input[14]!r}")
        if kind == TensorProto.BFLOAT16 and scale_is_input:
            raise ValueError(f"ort_reference: {n.name or n.op_type}: a bf16 shadow ({n.input[13]}) takes the (1,) "
                             f"placeholder, got the graph input {n.input[14]!r}")
    for v in list(model.graph.input) + list(model.graph.output):
        if v.type.tensor_type.elem_type not in (TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN):
            continue
        if v.name not in shadow_ins | shadow_outs:
            raise ValueError(f"ort_reference: low-precision graph I/O {v.name!r} is not a low-precision state of a "
                             f"plugin op")
        readers = [n for n in model.graph.node if v.name in n.input]
        if v.name in shadow_ins and any(n.op_type not in low for n in readers):
            raise ValueError(f"ort_reference: {v.name!r} is read by nodes other than the plugin ops that declare it")
        v.type.tensor_type.elem_type = TensorProto.FLOAT


def _verify_shadow(x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache, shadow, shadow_scale,
                   **attrs):
    """``mamba2_verify_shadow``: :func:`_verify` with the shadow of :func:`_mamba2_decode`."""
    return _mamba2_decode(VERIFY_SHADOW_OP_TYPE, (x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache,
                                                  dt_cache), shadow, shadow_scale, attrs, verify=True)


def _verify(x, B, C, dt, dt_bias, A, D, sbi, cursor, state, x_cache, B_cache, dt_cache, **attrs):
    got = (x.shape[2], x.shape[3], B.shape[3], B.shape[2], x_cache.shape[2], x.shape[1])
    want = tuple(attrs[k] for k in ("nheads", "headdim", "dstate", "ngroups", "buffer_len", "num_tokens"))
    if got != want:
        raise ValueError(f"{DOMAIN}::{VERIFY_OP_TYPE}: attributes (nheads, headdim, dstate, ngroups, buffer_len, "
                         f"num_tokens) = {want}, inputs have {got}")
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731  (copies: the outputs must not alias the inputs)
    caches = dict(state=t(state), x_cache=t(x_cache), B_cache=t(B_cache), dt_cache=t(dt_cache))
    y = verify_reference_backend(x=t(x), B=t(B), C=t(C), dt=t(dt), dt_bias=t(dt_bias), A=t(A), D=t(D), z=None,
                                 state_batch_indices=t(sbi), cursor=t(cursor), **caches)
    return (y.numpy(), *(caches[k].numpy() for k in ("state", "x_cache", "B_cache", "dt_cache")))


_GDN_ATTRS = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "buffer_len")


def _gdn_run(op_type, backend, window: int, q, k, v, a, b, A_log, dt_bias, sbi, cursor, state, u, vc, kc, gc, bc,
             attrs):
    """One GDN plugin op (``window`` = 1 when q, k, v, a, b carry a window axis) on copies of the states."""
    from trtllm_replayssm.families.gdn.reference import GDNBuffers

    got = (k.shape[1 + window], v.shape[1 + window], k.shape[2 + window], v.shape[2 + window], u.shape[2])
    names = _GDN_ATTRS + (("num_tokens",) if window else ())
    got += (v.shape[1],) if window else ()
    want = tuple(attrs[n] for n in names)
    if got != want:
        raise ValueError(f"{DOMAIN}::{op_type}: attributes ({', '.join(names)}) = {want}, inputs have {got}")
    t = lambda x: torch.from_numpy(np.array(x))  # noqa: E731  (copies: the outputs must not alias the inputs)
    buf = GDNBuffers(*(t(x) for x in (state, u, vc, kc, gc, bc)))
    y = backend(buf=buf, cursor=t(cursor), q=t(q), k=t(k), v=t(v), a=t(a), b=t(b), A_log=t(A_log),
                dt_bias=t(dt_bias), state_batch_indices=t(sbi))
    return (y.numpy(), *(x.numpy() for x in (buf.state, buf.u_cache, buf.v_cache, buf.k_cache, buf.g_cache,
                                              buf.beta_cache)))


def _gdn(*args, **attrs):
    from .qwen3_next import reference_backend as gdn_backend

    return _gdn_run(GDN_OP_TYPE, gdn_backend, 0, *args, attrs)


def _gdn_shadow(*args, **attrs):
    """``gdn_decode_shadow``: the bf16 shadow (as float32 values, :func:`_float_low_io`) last in and out."""
    from .qwen3_next import reference_backend as gdn_backend

    return _gdn_shadow_run(GDN_SHADOW_OP_TYPE, gdn_backend, 0, args, attrs)


def _gdn_verify_shadow(*args, **attrs):
    return _gdn_shadow_run(GDN_VERIFY_SHADOW_OP_TYPE, gdn_verify_backend, 1, args, attrs)


def _gdn_shadow_run(op_type, gdn_backend, window: int, args, attrs):
    *args, shadow = args
    sh = torch.from_numpy(np.array(shadow))
    shb = sh.to(torch.bfloat16)
    if not torch.equal(shb.float(), sh):
        raise ValueError(f"{DOMAIN}::{op_type}: shadow: expected bfloat16 values")

    def backend(**kw):
        return gdn_backend(**kw, shadow=shb)

    return (*_gdn_run(op_type, backend, window, *args, attrs), shb.float().numpy())


def _gdn_verify(*args, **attrs):
    return _gdn_run(GDN_VERIFY_OP_TYPE, gdn_verify_backend, 1, *args, attrs)


def _commit(sbi, n_accepted, cursor, **attrs):
    cur = torch.from_numpy(np.array(cursor))
    commit_reference_backend(cursor=cur, n_accepted=torch.from_numpy(np.array(n_accepted)),
                             state_batch_indices=torch.from_numpy(np.array(sbi)), num_tokens=attrs["num_tokens"],
                             buffer_len=attrs["buffer_len"])
    return cur.numpy()


def _order(sbi, cursor, **attrs):
    """``flush_order``: the host rule (cursor.flush_order), the order kernel's spec bit for bit."""
    from trtllm_replayssm import cursor as cursors

    return cursors.flush_order(torch.from_numpy(np.array(cursor)), torch.from_numpy(np.array(sbi)),
                               attrs["buffer_len"]).numpy()


def register() -> str:
    """Register the op (once per process); returns the library path for ``SessionOptions.register_custom_ops_library``."""
    global _registered
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    if not _registered:
        f, i32, i64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64
        attrs = {"plugin_namespace": PyCustomOpDef.dt_string, "aot": i64, "nheads": i64, "headdim": i64,
                 "dstate": i64, "ngroups": i64, "buffer_len": i64}
        onnx_op(op_type=f"{DOMAIN}::{OP_TYPE}", inputs=[f] * 7 + [i32, i32] + [f] * 4, outputs=[f] * 5, attrs=attrs)(_op)
        onnx_op(op_type=f"{DOMAIN}::{SHADOW_OP_TYPE}", inputs=[f] * 7 + [i32, i32] + [f] * 6, outputs=[f] * 7,
                attrs=attrs)(_op_shadow)
        onnx_op(op_type=f"{DOMAIN}::{VERIFY_SHADOW_OP_TYPE}", inputs=[f] * 7 + [i32, i32] + [f] * 6, outputs=[f] * 7,
                attrs={**attrs, "num_tokens": i64})(_verify_shadow)
        onnx_op(op_type=f"{DOMAIN}::{VERIFY_OP_TYPE}", inputs=[f] * 7 + [i32, i32] + [f] * 4, outputs=[f] * 5,
                attrs={**attrs, "num_tokens": i64})(_verify)
        onnx_op(op_type=f"{DOMAIN}::{COMMIT_OP_TYPE}", inputs=[i32] * 3, outputs=[i32],
                attrs={"plugin_namespace": PyCustomOpDef.dt_string, "aot": i64, "num_tokens": i64,
                       "buffer_len": i64})(_commit)
        onnx_op(op_type=f"{DOMAIN}::{ORDER_OP_TYPE}", inputs=[i32] * 2, outputs=[i32],
                attrs={"plugin_namespace": PyCustomOpDef.dt_string, "aot": i64, "buffer_len": i64})(_order)
        gdn_attrs = {"plugin_namespace": PyCustomOpDef.dt_string, "aot": i64, "num_k_heads": i64,
                     "num_v_heads": i64, "key_dim": i64, "value_dim": i64, "buffer_len": i64, "use_qk_l2norm": i64}
        onnx_op(op_type=f"{DOMAIN}::{GDN_OP_TYPE}", inputs=[f] * 7 + [i32, i32] + [f] * 6, outputs=[f] * 7,
                attrs=gdn_attrs)(_gdn)
        onnx_op(op_type=f"{DOMAIN}::{GDN_SHADOW_OP_TYPE}", inputs=[f] * 7 + [i32, i32] + [f] * 7, outputs=[f] * 8,
                attrs=gdn_attrs)(_gdn_shadow)
        onnx_op(op_type=f"{DOMAIN}::{GDN_VERIFY_SHADOW_OP_TYPE}", inputs=[f] * 7 + [i32, i32] + [f] * 7,
                outputs=[f] * 8, attrs={**gdn_attrs, "num_tokens": i64})(_gdn_verify_shadow)
        onnx_op(op_type=f"{DOMAIN}::{GDN_VERIFY_OP_TYPE}", inputs=[f] * 7 + [i32, i32] + [f] * 6, outputs=[f] * 7,
                attrs={**gdn_attrs, "num_tokens": i64})(_gdn_verify)
        types = {"float": f, "int32": i32, "int64": i64}
        for op_type, d in family_ops().items():
            onnx_op(op_type=f"{DOMAIN}::{op_type}", inputs=[types[t] for t in d["inputs"]],
                    outputs=[types[t] for t in d["outputs"]],
                    attrs={"plugin_namespace": PyCustomOpDef.dt_string, "aot": i64,
                           **{a: i64 if t == "int" else PyCustomOpDef.dt_string for a, t in d["attrs"].items()}},
                    )(_family_op(d["run"]))
        _registered = True
    return get_library_path()


def _family_op(run):
    """A family's op as onnxruntime-extensions calls it: the attributes every plugin node carries dropped."""

    def op(*inputs, **attrs):
        attrs.pop("plugin_namespace", None)
        attrs.pop("aot", None)
        return run(*inputs, **attrs)

    return op


def session(path):
    """An onnxruntime CPU session of ``path`` with the reference ops registered (a graph with low-precision states
    gets float32 I/O for them first, :func:`_float_low_io`)."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(register())
    model = onnx.load(str(path), load_external_data=False)
    low = _low_io()
    if any(n.domain == DOMAIN and n.op_type in low for n in model.graph.node):
        model = onnx.load(str(path))  # with its weights: the retyped graph is handed over in memory
        _float_low_io(model)
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


_LOW = (torch.bfloat16, torch.float8_e4m3fn)  # the state dtypes the CPU session carries as float32


def feed(names, values) -> dict:
    """Session inputs from torch tensors (bfloat16 / fp8 ones as float32: :func:`_float_low_io`)."""
    return {n: (v.float() if v.dtype in _LOW else v).detach().cpu().numpy() for n, v in zip(names, values)}


def to_torch(value, dtype: torch.dtype) -> torch.Tensor:
    """A session output as a torch tensor of ``dtype`` (bfloat16 / fp8 outputs arrive as float32 values, checked
    exact)."""
    t = torch.from_numpy(np.array(value))
    if dtype in _LOW:
        b = t.to(dtype)
        if not torch.equal(b.float(), t):
            raise ValueError(f"ort_reference.to_torch: a {dtype} output holds values that are not {dtype}")
        return b
    return t
