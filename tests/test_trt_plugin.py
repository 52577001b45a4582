# SPDX-License-Identifier: Apache-2.0
"""The TensorRT plugins' plain parts: what aot_impl hands TensorRT, checked without TensorRT.

Plugins: mamba2_decode, mamba2_decode_shadow, mamba2_verify, spec_commit. Checked here: the PTX
entry's parameter list is TensorRT's order (input pointers, int32 args, output pointers), the module
and grid are what ops launches, shapes, aliases, type combinations, bad attributes; and register()
itself, driven through a stand-in of ``tensorrt.plugin`` that enforces the documented signature rules
(it caught string annotations and placeholder-shape queries that real TensorRT would have refused).
The GPU proxy tests (tests/test_trt_plugin_gpu.py, tests/test_trt_plugin_spec_gpu.py) launch exactly
this PTX with these launch parameters in TensorRT's argument order. Network-building tests run where
TensorRT is installed.
"""

import inspect
import re

import numpy as np
import pytest

from trtllm_replayssm import trt_plugin as tp
from trtllm_replayssm.families.gdn import trt_plugin as gp
from trtllm_replayssm.families.mamba2 import trt_plugin as mp


def test_aot_kernel_matches_the_kernel_signature():
    k = mp.aot_kernel(128, 64, 128, 8, 16, "f32", "bf16", 90, tactic=1)
    ptx = k.ptx.decode()
    params = re.search(rf"\.entry {k.kernel_name}\((.*?)\)", ptx, re.S).group(1)
    kinds = re.findall(r"\.param \.(u64|u32)", params)
    n_in, n_out = len(mp.INPUT_NAMES), len(mp.OUTPUT_NAMES)
    assert kinds == ["u64"] * n_in + ["u32"] * len(k.extra_args) + ["u64"] * n_out
    if k.spec.persistent:
        assert k.grid_x == 132 * k.spec.blocks_per_sm and not k.grid_y_is_batch
    else:
        assert k.grid_x == 128 * (64 // k.spec.rows) and k.grid_y_is_batch
    assert k.block_x == k.spec.threads and k.shared_mem == 0
    assert ".target sm_90" in ptx


def test_tactics_choose_geometries():
    big = mp.aot_kernel(128, 64, 128, 8, 16, "f32", "bf16", 90, tactic=1)
    small = mp.aot_kernel(128, 64, 128, 8, 16, "f32", "bf16", 90, tactic=2)
    assert small.spec.rows <= big.spec.rows and small.spec.threads // small.spec.rows > big.spec.threads // big.spec.rows


@pytest.mark.parametrize("bad, match", [
    (dict(state="f64"), "state: expected one of"),
    (dict(act="i8"), "act: expected one of"),
    (dict(tactic=3), "tactic: expected one of"),
])
def test_aot_kernel_rejects(bad, match):
    args = dict(nheads=128, headdim=64, dstate=128, ngroups=8, buffer_len=16, state="f32", act="bf16", arch=90)
    with pytest.raises(ValueError, match=match):
        mp.aot_kernel(**{**args, **bad})


def test_io_contract_and_aliases():
    shapes = mp.io_shapes(4, 6, 128, 64, 128, 8, 16)
    assert list(shapes)[: len(mp.INPUT_NAMES)] == list(mp.INPUT_NAMES)
    assert shapes["state_out"] == shapes["state"] == (6, 128, 64, 128)
    assert shapes["x_cache_out"] == (6, 128, 16, 64) and shapes["B_cache_out"] == (6, 8, 16, 128)
    assert shapes["y"] == shapes["x"] == (4, 128, 64)
    for st in tp.STATE_DTYPES:
        for act in tp.ACT_DTYPES:
            types = mp.type_combination(st, act)
            assert len(types) == len(mp.INPUT_NAMES) + len(mp.OUTPUT_NAMES)
            for o, i in mp.ALIASES.items():  # an aliased output has its input's type
                assert types[len(mp.INPUT_NAMES) + o] == types[i]


def _attr_arrays(attrs: dict) -> dict:
    """Attributes as the network API takes them for IntAttr-annotated plugins: one-element int32 arrays."""
    return {k: np.array([v], dtype=np.int32) for k, v in attrs.items()}


def test_network_with_plugin_builds():
    trt = pytest.importorskip("tensorrt", reason="TensorRT >= 10.9 is not installed here (its builder "
                                                 "library cannot be installed on this machine)")
    pytest.importorskip("torch").cuda.is_available() or pytest.skip("needs a GPU to build an engine")
    tp.register()
    H, P, N, G, L, b = 8, 64, 64, 2, 4, 2
    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    shapes = mp.io_shapes(b, b, H, P, N, G, L)
    types = dict(zip(mp.INPUT_NAMES, (trt.float32,) * 7 + (trt.int32, trt.int32) + (trt.float32,) * 4))
    ins = [net.add_input(n, types[n], shapes[n]) for n in mp.INPUT_NAMES]
    import tensorrt.plugin as trtp

    op = getattr(getattr(trtp.op, tp.PLUGIN_NAMESPACE), mp.PLUGIN_NAME)
    layer = net.add_plugin(op(*ins, **_attr_arrays(dict(zip(mp.ATTRIBUTES, (H, P, N, G, L))))), aot=True)
    for i, name in enumerate(mp.OUTPUT_NAMES):
        layer.get_output(i).name = name
        net.mark_output(layer.get_output(i))
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    assert builder.build_serialized_network(net, config) is not None


def test_spec_network_with_plugins_builds():
    trt = pytest.importorskip("tensorrt", reason="TensorRT >= 10.9 is not installed here (its builder "
                                                 "library cannot be installed on this machine)")
    pytest.importorskip("torch").cuda.is_available() or pytest.skip("needs a GPU to build an engine")
    import tensorrt.plugin as trtp

    tp.register()
    H, P, N, G, L, T, b = 8, 64, 64, 2, 8, 4, 2
    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    shapes = mp.verify_io_shapes(b, b, H, P, N, G, L, T)
    types = dict(zip(mp.VERIFY_INPUT_NAMES, (trt.float32,) * 7 + (trt.int32, trt.int32) + (trt.float32,) * 4))
    ins = {n: net.add_input(n, types[n], shapes[n]) for n in mp.VERIFY_INPUT_NAMES}
    ns = getattr(trtp.op, tp.PLUGIN_NAMESPACE)
    attrs = _attr_arrays(dict(zip(mp.VERIFY_ATTRIBUTES, (H, P, N, G, L, T))))
    verify = net.add_plugin(getattr(ns, mp.VERIFY_PLUGIN_NAME)(*ins.values(), **attrs), aot=True)
    # commit in the same network on its own cursor input (engines run verify and commit as separate graphs)
    n_acc = net.add_input("n_accepted", trt.int32, (b,))
    cur = net.add_input("cursor_commit", trt.int32, (b, 2))
    commit_attrs = _attr_arrays(dict(num_tokens=T, buffer_len=L))
    commit = net.add_plugin(getattr(ns, tp.COMMIT_PLUGIN_NAME)(ins["state_batch_indices"], n_acc, cur, **commit_attrs),
                            aot=True)
    for layer, names in ((verify, mp.VERIFY_OUTPUT_NAMES), (commit, tp.COMMIT_OUTPUT_NAMES)):
        for i, name in enumerate(names):
            layer.get_output(i).name = name
            net.mark_output(layer.get_output(i))
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    assert builder.build_serialized_network(net, config) is not None


@pytest.mark.parametrize("shadow", mp.SHADOW_KINDS)
def test_shadow_plugin_contract(shadow):
    """mamba2_decode_shadow: 15 inputs, 2 int32 args, 7 outputs; the shadow and its scales alias."""
    k = mp.aot_kernel(128, 64, 128, 8, 16, "f32", "bf16", 90, tactic=1, shadow=shadow)
    assert k.spec.shadow == shadow and f"_sh-{shadow}_" in k.spec.key
    params = re.search(rf"\.entry {k.kernel_name}\((.*?)\)", k.ptx.decode(), re.S).group(1)
    kinds = re.findall(r"\.param \.(u64|u32)", params)
    assert kinds == ["u64"] * len(mp.SHADOW_INPUT_NAMES) + ["u32"] * 2 + ["u64"] * len(mp.SHADOW_OUTPUT_NAMES)
    shapes = mp.io_shapes(4, 6, 128, 64, 128, 8, 16, shadow)
    assert list(shapes)[: len(mp.SHADOW_INPUT_NAMES)] == list(mp.SHADOW_INPUT_NAMES)
    assert shapes["shadow_out"] == shapes["shadow"] == (6, 128, 64, 128)
    assert shapes["shadow_scale_out"] == shapes["shadow_scale"] == ((6, 128, 64) if shadow == "fp8" else (1,))
    types = mp.type_combination("f32", "bf16", shadow)
    n_in = len(mp.SHADOW_INPUT_NAMES)
    assert len(types) == n_in + len(mp.SHADOW_OUTPUT_NAMES) and types[13] == {"bf16": "BF16", "fp8": "FP8"}[shadow]
    for o, i in mp.SHADOW_ALIASES.items():
        assert types[n_in + o] == types[i]


def test_shadow_plugin_rejects_a_non_f32_checkpoint():
    with pytest.raises(ValueError, match="shadow: expected one of"):
        mp.aot_kernel(128, 64, 128, 8, 16, "bf16", "bf16", 90, shadow="bf16")


# ---- speculative decoding: mamba2_verify and spec_commit -------------------------------------------------
def _entry_params(k):
    params = re.search(rf"\.entry {k.kernel_name}\((.*?)\)", k.ptx.decode(), re.S).group(1)
    return re.findall(r"\.param \.(u64|u32|b32|s32)", params)


@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
def test_verify_kernel_is_what_ops_launches_in_tensorrt_order(tactic):
    from trtllm_replayssm import config

    k = mp.aot_verify_kernel(128, 64, 128, 8, 16, 4, "f32", "bf16", 90, tactic)
    assert k.kernel_name == "replayssm_verify" and ".target sm_90" in k.ptx.decode()
    n_in, n_out = len(mp.VERIFY_INPUT_NAMES), len(mp.VERIFY_OUTPUT_NAMES)
    assert _entry_params(k) == ["u64"] * n_in + ["u32"] * len(k.extra_args) + ["u64"] * n_out
    assert k.extra_args == ("batch", "slots") and k.extra_values(3, 5) == [3, 5]
    # ops.replay_verify plans the same module for this batch and launches spec_grid(spec, batch)
    assert k.spec == config.verify_spec("f32", "bf16", 128, 64, 128, 8, 16, 4, tp.TACTICS[tactic], False, 90)
    assert k.grid(7) == config.spec_grid(k.spec, 7) == (128 * 64 // k.spec.rows, 7, 1)
    assert k.block_x == k.spec.threads and k.shared_mem == 0 and not k.spec.has_z


def test_verify_tactics_choose_geometries():
    big = mp.aot_verify_kernel(128, 64, 128, 8, 16, 4, "f32", "bf16", 90, 1)
    small = mp.aot_verify_kernel(128, 64, 128, 8, 16, 4, "f32", "bf16", 90, 2)
    assert small.spec.rows <= big.spec.rows and small.spec.threads // small.spec.rows > big.spec.threads // big.spec.rows


def test_commit_kernel_is_what_ops_launches_in_tensorrt_order():
    from trtllm_replayssm import config

    k = tp.aot_commit_kernel(4, 16, 90)
    assert k.kernel_name == "replayssm_spec_commit"
    assert _entry_params(k) == ["u64"] * 3 + ["u32"] * 2 + ["u64"]  # sbi, n_accepted, cursor; batch, slots; cursor
    assert k.spec == config.commit_spec(4, 16, 90)
    for b in (1, 255, 256, 257, 1000):
        assert k.grid(b) == config.commit_grid(b) == (-(-b // 256), 1, 1)
    assert k.block_x == config.COMMIT_THREADS == 256 and k.shared_mem == 0
    assert k.extra_values(3, 5) == [3, 5]


@pytest.mark.parametrize("kernel, bad, match", [
    ("verify", dict(num_tokens=3), r"num_tokens: expected one of \(1, 2, 4, 6, 8\)"),
    ("verify", dict(num_tokens=8, buffer_len=8), r"buffer_len: expected in \[2 \* num_tokens, 32\] = \[16, 32\]"),
    ("verify", dict(buffer_len=64), r"buffer_len: expected in"),
    ("verify", dict(state="f64"), "state: expected one of"),
    ("verify", dict(act="i8"), "act: expected one of"),
    ("verify", dict(tactic=3), "tactic: expected one of"),
    ("commit", dict(num_tokens=0), "num_tokens: expected one of"),
    ("commit", dict(num_tokens=4, buffer_len=6), r"buffer_len: expected in \[2 \* num_tokens, 32\] = \[8, 32\]"),
])
def test_spec_kernels_reject(kernel, bad, match):
    if kernel == "verify":
        args = dict(nheads=128, headdim=64, dstate=128, ngroups=8, buffer_len=16, num_tokens=4, state="f32", act="bf16",
                    arch=90)
        fn = mp.aot_verify_kernel
    else:
        args, fn = dict(num_tokens=4, buffer_len=16, arch=90), tp.aot_commit_kernel
    with pytest.raises(ValueError, match=match):
        fn(**{**args, **bad})


def test_spec_io_contract_and_aliases():
    shapes = mp.verify_io_shapes(4, 6, 128, 64, 128, 8, 16, 4)
    assert list(shapes)[: len(mp.VERIFY_INPUT_NAMES)] == list(mp.VERIFY_INPUT_NAMES)
    assert list(shapes)[len(mp.VERIFY_INPUT_NAMES):] == list(mp.VERIFY_OUTPUT_NAMES)
    assert shapes["x"] == shapes["y"] == (4, 4, 128, 64) and shapes["B"] == shapes["C"] == (4, 4, 8, 128)
    assert shapes["dt"] == (4, 4, 128) and shapes["cursor"] == (6, 2)
    assert shapes["state_out"] == shapes["state"] == (6, 128, 64, 128)
    assert shapes["x_cache_out"] == (6, 128, 16, 64) and shapes["B_cache_out"] == (6, 8, 16, 128)
    assert shapes["dt_cache_out"] == (6, 128, 16)
    c = tp.commit_io_shapes(4, 6)
    assert list(c) == list(tp.COMMIT_INPUT_NAMES + tp.COMMIT_OUTPUT_NAMES) and c["cursor_out"] == c["cursor"] == (6, 2)
    assert tp.COMMIT_TYPES == ["INT32"] * 4 and tp.COMMIT_ALIASES == {0: 2}
    for info in tp.all_plugins().values():  # every aliased output has its input's shape
        m = info.manifest()
        assert m["id"] == f"replayssm::{info.name}" and len(m["aliased_outputs"]) == len(info.aliases)
    v = tp.all_plugins()[mp.VERIFY_PLUGIN_NAME].manifest()
    assert v["attributes"][-1] == "num_tokens" and v["aliased_outputs"]["state_out"] == "state"


def test_attribute_checks():
    ok = dict(nheads=128, headdim=64, dstate=128, ngroups=8, buffer_len=16, num_tokens=4)
    shapes = {k: v for k, v in mp.verify_io_shapes(None, None, 128, 64, 128, 8, 16, 4).items()
              if k in mp.VERIFY_INPUT_NAMES}
    assert tp.shape_attributes(mp.VERIFY_PLUGIN_NAME, shapes) == ok
    tp.check_attributes(mp.VERIFY_PLUGIN_NAME, ok, shapes)
    tp.check_attributes(mp.VERIFY_PLUGIN_NAME, {**ok, "nheads": 7}, {})  # nothing known yet: nothing to compare
    with pytest.raises(ValueError, match=r"mamba2_verify: attributes do not match the input shapes: num_tokens=2 but "
                                         r"the inputs have 4"):
        tp.check_attributes(mp.VERIFY_PLUGIN_NAME, {**ok, "num_tokens": 2}, shapes)
    with pytest.raises(ValueError, match=r"ngroups=4 but the inputs have 8"):
        tp.check_attributes(mp.VERIFY_PLUGIN_NAME, {**ok, "ngroups": 4}, shapes)
    with pytest.raises(ValueError, match=r"cursor: expected shape \(slots, 2\), got \(6,\)"):
        tp.check_attributes(mp.VERIFY_PLUGIN_NAME, ok, {**shapes, "cursor": (6,)})
    with pytest.raises(ValueError, match="num_tokens: expected one of"):
        tp.check_attributes(tp.COMMIT_PLUGIN_NAME, dict(num_tokens=5, buffer_len=16), {"cursor": (None, 2)})
    tp.check_attributes(tp.COMMIT_PLUGIN_NAME, dict(num_tokens=4, buffer_len=16), {"cursor": (None, 2)})
    dec = tp.shape_attributes(mp.PLUGIN_NAME, mp.io_shapes(2, 2, 128, 64, 128, 8, 16))
    assert dec == dict(nheads=128, headdim=64, dstate=128, ngroups=8, buffer_len=16)


# ---- register() against a stand-in of tensorrt.plugin ----------------------------------------------------
# TensorRT's builder cannot be installed here. The stand-in below follows tensorrt.plugin's documented
# rules (docs.nvidia.com, tensorrt.plugin.register / autotune / aot_impl): annotations are classes;
# register: TensorDescs then attributes, returns a tuple of TensorDescs; autotune: inputs, attributes,
# outputs; aot_impl: inputs, ALL attributes in order, outputs, tactic, returning (kernel name, PTX,
# KernelLaunchParams, SymIntExprs of SymInt32). Output types are first queried with placeholder
# ("fake") dimensions, whose constness may not be asked. Symbolic dimensions refuse ==.
class Sym:
    def __init__(self, fn=None, const=None):
        self.fn, self.const = fn, const

    @property
    def is_fake(self):
        return self.fn is None and self.const is None

    @property
    def is_constant(self):
        if self.is_fake:
            raise RuntimeError("Not accessible for fake 'ShapeExpr's")
        return self.const is not None

    def constant_value(self):
        if not self.is_constant:
            raise RuntimeError("not a constant")
        return self.const

    def __call__(self, env):
        return self.const if self.const is not None else self.fn(env)

    def _op(self, other, f):
        return Sym(lambda env: f(self(env), other(env) if isinstance(other, Sym) else other))

    def __add__(self, other):
        return self._op(other, lambda a, b: a + b)

    def __floordiv__(self, other):
        return self._op(other, lambda a, b: a // b)

    def __eq__(self, other):
        raise TypeError("a symbolic dimension has no truth value")

    __hash__ = None


def _fake_tensorrt():
    import inspect
    import types
    import typing

    trt = types.ModuleType("tensorrt")
    for n in ("float32", "float16", "bfloat16", "fp8", "int32", "int64"):
        setattr(trt, n, f"trt.{n}")
    trtp = types.ModuleType("tensorrt.plugin")
    trt.plugin = trtp
    registry = {}

    class TensorDesc:
        def __init__(self, dims, dtype, name=None):
            self.shape_expr, self.dtype, self.name, self.aliased_to = list(dims), dtype, name, None

        def like(self):
            return TensorDesc(self.shape_expr, self.dtype)

        def aliased(self):
            d = TensorDesc(self.shape_expr, self.dtype)
            d.aliased_to = self
            return d

    class KernelLaunchParams:
        def __init__(self):
            self.grid_x = self.grid_y = self.grid_z = self.block_x = self.block_y = self.block_z = 1
            self.shared_mem = 0

    class SymInt32:
        def __init__(self, v):
            self.v = v

    class SymIntExprs(list):
        def __init__(self, n):
            super().__init__([None] * n)

    class AutoTuneCombination:
        def __init__(self, io_types, layouts, tactics=None):
            self.io_types, self.layouts, self.tactics = io_types, layouts, tactics

    class ShapeExprs(list):
        @classmethod
        def from_tuple(cls, shape_exprs):
            assert isinstance(shape_exprs, tuple), shape_exprs
            return cls(e if isinstance(e, Sym) else Sym(const=e) for e in shape_exprs)

    def from_shape_expr(shape_expr, dtype):
        assert isinstance(shape_expr, ShapeExprs), shape_expr
        return TensorDesc(shape_expr, dtype)

    def annotations(fn):
        sig = inspect.signature(fn)
        for name, p in sig.parameters.items():
            if isinstance(p.annotation, str):
                raise TypeError(f"{fn.__name__}: annotation of {name!r} is the string {p.annotation!r}")
            if p.default is not inspect.Parameter.empty:
                raise ValueError(f"{fn.__name__}: {name!r} has a default value")
        return sig

    def register(pid):
        def deco(fn):
            sig = annotations(fn)
            tensors, attrs = [], []
            for name, p in sig.parameters.items():
                if p.annotation is TensorDesc:
                    assert not attrs, f"{pid}: TensorDescs and attributes interleaved"
                    tensors.append(name)
                else:  # built-in types or numpy arrays (npt.NDArray[...])
                    assert p.annotation in (int, float, str, bool, bytes) or \
                        typing.get_origin(p.annotation) is np.ndarray, f"{pid}: attribute {name}: {p.annotation}"
                    attrs.append(name)
            ret = sig.return_annotation
            assert typing.get_origin(ret) is tuple and all(a is TensorDesc for a in typing.get_args(ret)), ret
            registry[pid] = dict(desc=fn, tensors=tensors, attrs=attrs, n_out=len(typing.get_args(ret)))
            return fn
        return deco

    def autotune(pid):
        def deco(fn):
            sig, r = annotations(fn), registry[pid]
            names = list(sig.parameters)
            assert names[: len(r["tensors"])] == r["tensors"] and names[-1] == "outputs", names
            assert all(n in r["attrs"] for n in names[len(r["tensors"]):-1]), names
            assert typing.get_origin(sig.return_annotation) is list
            assert typing.get_args(sig.return_annotation) == (AutoTuneCombination,)
            r["tune"] = fn
            return fn
        return deco

    def aot_impl(pid):
        def deco(fn):
            sig, r = annotations(fn), registry[pid]
            assert list(sig.parameters) == r["tensors"] + r["attrs"] + ["outputs", "tactic"], list(sig.parameters)
            ret = sig.return_annotation
            assert typing.get_origin(ret) is tuple, ret
            args = typing.get_args(ret)
            assert len(args) == 4 and args[2] is KernelLaunchParams and args[3] is SymIntExprs, ret
            assert all(set(typing.get_args(a)) == {str, bytes} for a in args[:2]), ret
            r["aot"] = fn
            return fn
        return deco

    for obj in (TensorDesc, KernelLaunchParams, SymInt32, SymIntExprs, AutoTuneCombination, ShapeExprs,
                from_shape_expr, register, autotune, aot_impl):
        setattr(trtp, obj.__name__, obj)
    return trt, trtp, registry


@pytest.fixture
def fake_trt(monkeypatch):
    import sys

    trt, trtp, registry = _fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(tp.register, "_done", False, raising=False)
    monkeypatch.setattr(tp, "current_device", lambda: (90, 132))
    monkeypatch.setattr(tp, "check_ptx_loadable", lambda: None)
    tp.register()
    tp.register()  # idempotent
    return trt, trtp, registry


BATCH, SLOTS = Sym(lambda env: env["batch"]), Sym(lambda env: env["slots"])
_TRT_DT = {"f32": "trt.float32", "f16": "trt.float16", "bf16": "trt.bfloat16", "fp8": "trt.fp8", "i32": "trt.int32"}


def _descs(trtp, plugin, shapes, dtypes, fake=False):
    def dim(d):
        if fake:
            return Sym()
        return BATCH if d == "b" else SLOTS if d == "s" else Sym(const=d)

    return [trtp.TensorDesc([dim(d) for d in shapes[n]], _TRT_DT[dtypes[n]], n) for n in tp.all_plugins()[plugin].inputs]


def _ev(v, env):
    v = v.v if hasattr(v, "v") else v
    return v(env) if isinstance(v, Sym) else v


PLUGIN_CASES = {
    mp.PLUGIN_NAME: (dict(nheads=8, headdim=64, dstate=64, ngroups=2, buffer_len=4),
                     lambda a: mp.io_shapes("b", "s", *a.values()), ("f32", "bf16", None)),
    mp.SHADOW_PLUGIN_NAME: (dict(nheads=8, headdim=64, dstate=64, ngroups=2, buffer_len=4),
                            lambda a: mp.io_shapes("b", "s", *a.values(), "fp8"), ("f32", "bf16", "fp8")),
    mp.VERIFY_PLUGIN_NAME: (dict(nheads=8, headdim=64, dstate=64, ngroups=2, buffer_len=8, num_tokens=4),
                            lambda a: mp.verify_io_shapes("b", "s", *a.values()), ("bf16", "f16", None)),
    mp.VERIFY_SHADOW_PLUGIN_NAME: (dict(nheads=8, headdim=64, dstate=64, ngroups=2, buffer_len=8, num_tokens=4),
                                   lambda a: mp.verify_io_shapes("b", "s", *a.values(), "fp8"), ("f32", "bf16", "fp8")),
    tp.COMMIT_PLUGIN_NAME: (dict(num_tokens=2, buffer_len=8), lambda a: tp.commit_io_shapes("b", "s"),
                            (None, None, None)),
    gp.DECODE: (dict(num_k_heads=2, num_v_heads=4, key_dim=64, value_dim=128, buffer_len=8, use_qk_l2norm=1),
                         lambda a: gp.io_shapes("b", "s", *list(a.values())[:5]), ("f32", "bf16", None)),
    gp.DECODE_SHADOW: (dict(num_k_heads=2, num_v_heads=4, key_dim=128, value_dim=64, buffer_len=16,
                                     use_qk_l2norm=0),
                                lambda a: gp.io_shapes("b", "s", *list(a.values())[:5], "bf16"),
                                ("f32", "f16", "bf16")),
    gp.VERIFY: (dict(num_k_heads=2, num_v_heads=4, key_dim=64, value_dim=128, buffer_len=8,
                                     use_qk_l2norm=1, num_tokens=4),
                                lambda a: gp.io_shapes("b", "s", *list(a.values())[:5], num_tokens=a["num_tokens"]),
                                ("f32", "bf16", None)),
    gp.VERIFY_SHADOW: (dict(num_k_heads=2, num_v_heads=4, key_dim=128, value_dim=64, buffer_len=16,
                                            use_qk_l2norm=1, num_tokens=2),
                                       lambda a: gp.io_shapes("b", "s", *list(a.values())[:5], "bf16",
                                                                  a["num_tokens"]),
                                       ("f32", "f16", "bf16")),
}
GDN_PLUGINS = gp.DECODE_PLUGINS + gp.VERIFY_PLUGINS


def _types(plugin, state, act, shadow):
    if plugin in GDN_PLUGINS:
        return gp.type_combination(act, shadow or "none")
    return mp.type_combination(state, act, shadow or "none")


def _dtypes(plugin, state, act, shadow):
    info = tp.all_plugins()[plugin]
    if plugin == tp.COMMIT_PLUGIN_NAME:
        return dict.fromkeys(info.inputs, "i32")
    types = _types(plugin, state, act, shadow)
    back = {v: k for k, v in tp._TRT_TYPE_NAMES.items()} | {"INT32": "i32"}
    return {n: back[t] for n, t in zip(info.inputs, types)}


@pytest.mark.parametrize("plugin", list(PLUGIN_CASES))
def test_register_through_a_tensorrt_stand_in(fake_trt, plugin):
    trt, trtp, registry = fake_trt
    info = tp.all_plugins()[plugin]
    attrs, shapes_of, (state, act, shadow) = PLUGIN_CASES[plugin]
    reg = registry[info.id]
    assert set(registry) == {p.id for p in tp.all_plugins().values()}  # the families' plugins too
    assert reg["tensors"] == list(info.inputs) and reg["attrs"] == list(info.attributes)
    assert reg["n_out"] == len(info.outputs)
    shapes, dtypes = shapes_of(attrs), _dtypes(plugin, state, act, shadow)

    # every attribute is declared as a one-element int32 array: TensorRT converts such a field with astype (an
    # ``int`` one with int(array), which NumPy >= 2.4 refuses), and hands the plugin functions arrays
    fields = {k: np.array([v], dtype=np.int32) for k, v in attrs.items()}
    sig = inspect.signature(reg["desc"])
    assert all(sig.parameters[k].annotation is tp.IntAttr for k in attrs)
    # output types: placeholder dimensions; then shapes with the real (constant + symbolic) dimensions; the
    # attributes as TensorRT passes them (arrays) and as Python callers may (ints)
    for fake, given in ((True, fields), (False, fields), (False, attrs)):
        ins = _descs(trtp, plugin, shapes, dtypes, fake)
        outs = reg["desc"](*ins, **given)
        assert len(outs) == len(info.outputs)
        for o, desc in enumerate(outs):
            if o in info.aliases:
                assert desc.aliased_to is ins[info.aliases[o]], (o, info.outputs[o])
            else:
                assert desc.aliased_to is None and desc.dtype == ins[0].dtype
    name = next(iter(k for k in ("nheads", "num_tokens", "num_v_heads") if k in attrs))
    if plugin != tp.COMMIT_PLUGIN_NAME:  # a wrong attribute is refused once the shapes are known
        with pytest.raises(ValueError, match=f"{name}={attrs[name] + 2} but the inputs have {attrs[name]}"):
            reg["desc"](*_descs(trtp, plugin, shapes, dtypes), **{**attrs, name: attrs[name] + 2})
    else:
        with pytest.raises(ValueError, match="num_tokens: expected one of"):
            reg["desc"](*_descs(trtp, plugin, shapes, dtypes), **{**attrs, "num_tokens": 3})

    combos = reg["tune"](*ins, outs)
    assert all(c.layouts == "LINEAR" for c in combos)
    if plugin == tp.COMMIT_PLUGIN_NAME:
        assert [c.io_types for c in combos] == ["INT32, INT32, INT32, INT32"] and combos[0].tactics == [1]
    else:
        assert ", ".join(_types(plugin, state, act, shadow)) in [c.io_types for c in combos]
        assert all(c.tactics == sorted(tp.TACTICS) for c in combos)

    env = dict(batch=5, slots=7)
    for tactic in (tp.COMMIT_TACTICS if plugin == tp.COMMIT_PLUGIN_NAME else sorted(tp.TACTICS)):
        name_, ptx, launch, extra = reg["aot"](*ins, *fields.values(), outs, tactic)
        if plugin == tp.COMMIT_PLUGIN_NAME:
            want = tp.aot_commit_kernel(attrs["num_tokens"], attrs["buffer_len"], 90)
        elif plugin in mp.VERIFY_PLUGINS:
            want = mp.aot_verify_kernel(*attrs.values(), state, act, 90, tactic, shadow or "none")
        elif plugin in gp.VERIFY_PLUGINS:
            want = gp.aot_verify_kernel(*attrs.values(), act, 90, tactic, shadow or "none")
        elif plugin in GDN_PLUGINS:
            want = gp.aot_kernel(*attrs.values(), act, 90, tactic, shadow or "none")
        else:
            want = mp.aot_kernel(*attrs.values(), state, act, 90, tactic, 132, shadow or "none")
        assert (name_, ptx) == (want.kernel_name, want.ptx)
        grid = tuple(_ev(getattr(launch, f"grid_{a}"), env) for a in "xyz")
        assert grid == want.grid(5)
        assert (_ev(launch.block_x, env), _ev(launch.shared_mem, env)) == (want.block_x, want.shared_mem)
        assert all(isinstance(e, trtp.SymInt32) for e in extra)
        assert [_ev(e, env) for e in extra] == [5, 7]


def test_attribute_values_in_either_form():
    assert tp._int(np.array([7], dtype=np.int32)) == 7 and tp._int(5) == 5 and tp._int(np.int64(3)) == 3
    with pytest.raises(ValueError, match=r"expected one integer, got an array int32 of shape \(2,\)"):
        tp._int(np.array([1, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="expected one integer, got an array float32"):
        tp._int(np.array([1.5], dtype=np.float32))


@pytest.mark.parametrize("plugin", [mp.SHADOW_PLUGIN_NAME, mp.VERIFY_SHADOW_PLUGIN_NAME])
def test_shadow_plugins_check_the_shadow_and_its_scale(plugin):
    """The shadow has the state's shape; an fp8 shadow's scale input is its (S, H, P) row scales, a bf16 shadow's
    the (1,) placeholder (the kernel reads and writes S*H*P scales for fp8: a (1,) buffer would be overrun)."""
    attrs = dict(nheads=8, headdim=64, dstate=64, ngroups=2, buffer_len=8)
    if plugin == mp.VERIFY_SHADOW_PLUGIN_NAME:
        attrs["num_tokens"] = 4
        shapes_of = lambda sh: mp.verify_io_shapes(3, 5, *attrs.values(), sh)  # noqa: E731
    else:
        shapes_of = lambda sh: mp.io_shapes(3, 5, *attrs.values(), sh)  # noqa: E731
    for kind in ("bf16", "fp8"):
        tp.check_attributes(plugin, attrs, shapes_of(kind), kind)
        tp.check_attributes(plugin, attrs, {**shapes_of(kind), "shadow_scale": (None, None, None)}, None)
    with pytest.raises(ValueError, match=r"shadow_scale: expected \(slots, nheads, headdim\) row scales for a fp8"):
        tp.check_attributes(plugin, attrs, shapes_of("bf16"), "fp8")  # fp8 shadow on the bf16 placeholder
    with pytest.raises(ValueError, match=r"shadow_scale: expected \(1,\) \(a bf16 shadow's placeholder\)"):
        tp.check_attributes(plugin, attrs, shapes_of("fp8"), "bf16")
    with pytest.raises(ValueError, match=r"shadow: expected the state's shape \(5, 8, 64, 64\), got \(5, 8, 64, 32\)"):
        tp.check_attributes(plugin, attrs, {**shapes_of("fp8"), "shadow": (5, 8, 64, 32)}, "fp8")


@pytest.mark.parametrize("plugin", [gp.DECODE_SHADOW, gp.VERIFY_SHADOW])
def test_gdn_shadow_plugins_check_the_shadow(fake_trt, plugin):
    """The GDN kernels read and write an (S, HV, V, K) bf16 shadow like the state: one of another shape (K and V
    swapped) was accepted by check_attributes and by the registered shape function, and overrun or misread."""
    trt, trtp, registry = fake_trt
    attrs, shapes_of, (state, act, shadow) = PLUGIN_CASES[plugin]
    shapes = {**shapes_of(attrs), "state": (5, 4, 64, 128)}
    tp.check_attributes(plugin, attrs, {**shapes, "shadow": (5, 4, 64, 128)})
    bad = {**shapes, "shadow": (5, 4, 128, 64)}
    with pytest.raises(ValueError, match=r"shadow: expected the state's shape \(5, 4, 64, 128\), got \(5, 4, 128, 64\)"):
        tp.check_attributes(plugin, attrs, bad)
    with pytest.raises(ValueError, match=r"shadow: expected the state's shape \(5, 4, 64, 128\), got \(5, 4, 128, 64\)"):
        registry[tp.all_plugins()[plugin].id]["desc"](*_descs(trtp, plugin, bad, _dtypes(plugin, state, act, shadow)),
                                                **attrs)


@pytest.mark.parametrize("shadow", ["none", "bf16", "fp8"])
def test_verify_kernel_parameters_are_in_tensorrt_order(shadow):
    """mamba2_verify[_shadow]: the entry's parameters are the plugin's inputs, two int32 scalars, its outputs (the
    shadow and its scales among both with a shadow), the module ops.replay_verify launches."""
    from trtllm_replayssm.config import verify_spec

    k = mp.aot_verify_kernel(128, 64, 128, 8, 16, 4, "f32", "bf16", 90, 1, shadow)
    params = re.search(rf"\.entry {k.kernel_name}\((.*?)\)", k.ptx.decode(), re.S).group(1)
    kinds = re.findall(r"\.param \.(u64|u32)", params)
    info = tp.all_plugins()[mp.VERIFY_SHADOW_PLUGIN_NAME if shadow != "none" else mp.VERIFY_PLUGIN_NAME]
    assert kinds == ["u64"] * len(info.inputs) + ["u32"] * 2 + ["u64"] * len(info.outputs)
    assert k.spec == verify_spec("f32", "bf16", 128, 64, 128, 8, 16, 4, tp.TACTICS[1], False, 90, shadow)
    with pytest.raises(ValueError, match="with an f32 state"):
        mp.aot_verify_kernel(128, 64, 128, 8, 16, 4, "bf16", "bf16", 90, 1, "bf16")


# ---- gdn_decode ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shadow", ["none", "bf16"])
@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
def test_gdn_kernel_is_what_gdn_ops_launches_in_tensorrt_order(tactic, shadow):
    """Qwen3-Next geometry (16 key heads, 32 value heads, 128 / 128): the entry's parameters are the
    inputs, two int32 scalars, the outputs; the module is gdn_ops' for the tactic's batch."""
    from trtllm_replayssm.families.gdn.config import gdn_spec

    k = gp.aot_kernel(16, 32, 128, 128, 16, 1, "bf16", 90, tactic, shadow)
    params = re.search(rf"\.entry {k.kernel_name}\((.*?)\)", k.ptx.decode(), re.S).group(1)
    kinds = re.findall(r"\.param \.(u64|u32)", params)
    info = tp.all_plugins()[gp.DECODE_SHADOW if shadow == "bf16" else gp.DECODE]
    assert kinds == ["u64"] * len(info.inputs) + ["u32"] * 2 + ["u64"] * len(info.outputs)
    assert k.spec == gdn_spec("bf16", 32, 16, 128, 128, 16, tp.TACTICS[tactic], True, shadow, True, None, 90)
    assert k.grid(7) == k.spec.grid(7) and k.block_x == k.spec.threads and k.extra_args == ("batch", "slots")


@pytest.mark.parametrize("shadow", ["none", "bf16"])
@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
def test_gdn_verify_kernel_is_what_gdn_ops_launches_in_tensorrt_order(tactic, shadow):
    """gdn_verify at the Qwen3-Next geometry, T = 4, L = 16: the entry ``gdn_verify`` of the speculative
    module gdn_ops.gdn_replay_verify compiles, parameters in TensorRT's order."""
    from trtllm_replayssm.families.gdn.config import gdn_spec

    k = gp.aot_verify_kernel(16, 32, 128, 128, 16, 1, 4, "bf16", 90, tactic, shadow)
    assert k.kernel_name == "gdn_verify"
    params = re.search(rf"\.entry {k.kernel_name}\((.*?)\)", k.ptx.decode(), re.S).group(1)
    kinds = re.findall(r"\.param \.(u64|u32)", params)
    info = tp.all_plugins()[gp.VERIFY_SHADOW if shadow == "bf16" else gp.VERIFY]
    assert kinds == ["u64"] * len(info.inputs) + ["u32"] * 2 + ["u64"] * len(info.outputs)
    assert k.spec == gdn_spec("bf16", 32, 16, 128, 128, 16, tp.TACTICS[tactic], True, shadow, True, None, 90, 4)
    assert k.grid(7) == k.spec.grid(7) and k.block_x == k.spec.threads and k.extra_args == ("batch", "slots")


def test_gdn_verify_io_contract_attributes_and_rejects():
    shapes = gp.io_shapes(3, 5, 16, 32, 128, 64, 16, num_tokens=4)
    assert shapes["q"] == (3, 4, 16, 128) and shapes["v"] == shapes["y"] == (3, 4, 32, 64)
    assert shapes["a"] == (3, 4, 32) and shapes["cursor"] == (5, 2) and shapes["state_out"] == (5, 32, 64, 128)
    attrs = dict(num_k_heads=16, num_v_heads=32, key_dim=128, value_dim=64, buffer_len=16, use_qk_l2norm=1,
                 num_tokens=4)
    assert tp.shape_attributes(gp.VERIFY, shapes) == {k: v for k, v in attrs.items()
                                                                      if k != "use_qk_l2norm"}
    tp.check_attributes(gp.VERIFY, attrs, shapes)
    with pytest.raises(ValueError, match="num_tokens=2 but the inputs have 4"):
        tp.check_attributes(gp.VERIFY, {**attrs, "num_tokens": 2}, shapes)
    with pytest.raises(ValueError, match=r"cursor: expected shape \(slots, 2\), got \(5,\)"):
        tp.check_attributes(gp.VERIFY, attrs, {**shapes, "cursor": (5,)})
    with pytest.raises(ValueError, match=r"buffer_len: expected in \[2 \* num_tokens, 32\] = \[8, 32\]"):
        gp.aot_verify_kernel(16, 32, 128, 128, 6, 1, 4, "bf16", 90)
    with pytest.raises(ValueError, match="num_tokens: expected one of"):
        gp.aot_verify_kernel(16, 32, 128, 128, 16, 1, 3, "bf16", 90)


def test_gdn_io_contract_attributes_and_rejects():
    shapes = gp.io_shapes(3, 5, 16, 32, 128, 64, 16)
    assert list(shapes)[: len(gp.INPUT_NAMES)] == list(gp.INPUT_NAMES)
    assert shapes["state_out"] == shapes["state"] == (5, 32, 64, 128) and shapes["y"] == shapes["v"] == (3, 32, 64)
    assert shapes["k_cache_out"] == (5, 16, 16, 128) and shapes["beta_cache_out"] == (5, 32, 16)
    types = gp.type_combination("bf16")
    assert len(types) == len(gp.INPUT_NAMES) + len(gp.OUTPUT_NAMES) and types[11] == "BF16"
    assert tp.shape_attributes(gp.DECODE, shapes) == dict(num_k_heads=16, num_v_heads=32, key_dim=128,
                                                                   value_dim=64, buffer_len=16)
    attrs = dict(num_k_heads=16, num_v_heads=32, key_dim=128, value_dim=64, buffer_len=16, use_qk_l2norm=1)
    tp.check_attributes(gp.DECODE, attrs, shapes)
    with pytest.raises(ValueError, match="value_dim=128 but the inputs have 64"):
        tp.check_attributes(gp.DECODE, {**attrs, "value_dim": 128}, shapes)
    with pytest.raises(ValueError, match="use_qk_l2norm: expected 0 or 1, got 2"):
        tp.check_attributes(gp.DECODE, {**attrs, "use_qk_l2norm": 2}, shapes)
    with pytest.raises(ValueError, match="shadow: expected 'none' or 'bf16'"):
        gp.aot_kernel(16, 32, 128, 128, 16, 1, "bf16", 90, 1, "fp8")
    with pytest.raises(ValueError, match="act: expected one of"):
        gp.aot_kernel(16, 32, 128, 128, 16, 1, "i8", 90)


def test_gdn_onnx_node_matches_the_plugin_contract(tmp_path):
    """The ONNX node builders/qwen_export.py exports carries exactly the plugin's inputs and attributes."""
    onnx = pytest.importorskip("onnx", reason="onnx is not installed")
    pytest.importorskip("transformers")
    from builders.qwen3_next import tiny_model
    from builders.qwen_export import QwenGDNDecodeStep, export_onnx

    step = QwenGDNDecodeStep(tiny_model("qwen3_5"), 8, 32)
    export_onnx(step, tmp_path / "m.onnx")
    node = next(n for n in onnx.load(str(tmp_path / "m.onnx")).graph.node if n.op_type == gp.DECODE)
    attrs = [a.name for a in node.attribute if a.name not in ("plugin_namespace", "aot")]
    assert sorted(attrs) == sorted(gp.ATTRIBUTES)
    assert len(node.input) == len(gp.INPUT_NAMES) and len(node.output) == len(gp.OUTPUT_NAMES)


# ---- the flush-first row order: replayssm::flush_order and the decode plugins that read its output ------------
def test_order_kernel_is_what_cursor_ops_launches_in_tensorrt_order():
    """flush_order's PTX, grid and block are cursor_ops.flush_order's launch (one block of ORDER_THREADS), its
    parameters in TensorRT's order: the 2 input pointers, int32 batch and slots, the output pointer."""
    from trtllm_replayssm.config import ORDER_THREADS, cursor_spec

    k = tp.aot_order_kernel(16, 90)
    assert (k.kernel_name, k.spec, k.block_x, k.shared_mem) == ("replayssm_flush_order", cursor_spec(16, 90),
                                                               ORDER_THREADS, 0)
    assert k.grid(7) == k.grid(3000) == (1, 1, 1) and k.extra_args == ("batch", "slots")
    params = re.search(r"\.entry replayssm_flush_order\((.*?)\)", k.ptx.decode(), re.S).group(1)
    assert re.findall(r"\.param \.(u64|u32)", params) == ["u64"] * 2 + ["u32"] * 2 + ["u64"]
    assert tp.order_io_shapes(5, 7) == {"state_batch_indices": (5,), "cursor": (7,), "row_order": (5, 4)}
    for bad in (0, 33, True, 8.0):
        with pytest.raises(ValueError, match="buffer_len"):
            tp.aot_order_kernel(bad, 90)


ORDERED_CASES = {  # decode plugins that take the flush_order output as their rows: attrs, shapes, (state, act, shadow)
    gp.DECODE_SHADOW: (PLUGIN_CASES[gp.DECODE_SHADOW][0],
                       lambda a: gp.io_shapes("b", "s", *list(a.values())[:5], "bf16", row_order=True),
                       ("f32", "f16", "bf16")),
    gp.DECODE: (PLUGIN_CASES[gp.DECODE][0], lambda a: gp.io_shapes("b", "s", *list(a.values())[:5], row_order=True),
                ("f32", "bf16", None)),
    mp.SHADOW_PLUGIN_NAME: (PLUGIN_CASES[mp.SHADOW_PLUGIN_NAME][0],
                            lambda a: mp.io_shapes("b", "s", *a.values(), "fp8", row_order=True), ("f32", "bf16", "fp8")),
}


def test_flush_order_through_a_tensorrt_stand_in(fake_trt):
    """register(): flush_order's output is a new (b, 4) int32 tensor (no alias); its aot_impl hands TensorRT
    aot_order_kernel's PTX and launch with batch and slots as the extra args; a ring cursor is refused."""
    trt, trtp, registry = fake_trt
    reg = registry[tp.ORDER_PLUGIN_ID]
    assert (reg["tensors"], reg["attrs"], reg["n_out"]) == (["state_batch_indices", "cursor"], ["buffer_len"], 1)
    ins = [trtp.TensorDesc([BATCH], "trt.int32"), trtp.TensorDesc([SLOTS], "trt.int32")]
    L = np.array([16], dtype=np.int32)
    (out,) = reg["desc"](*ins, buffer_len=L)
    env = dict(batch=5, slots=7)
    assert [_ev(d, env) for d in out.shape_expr] == [5, 4] and out.dtype == "trt.int32" and out.aliased_to is None
    assert [c.io_types for c in reg["tune"](*ins, (out,))] == ["INT32, INT32, INT32"]
    name, ptx, launch, extra = reg["aot"](*ins, L, (out,), 1)
    want = tp.aot_order_kernel(16, 90)
    assert (name, ptx) == (want.kernel_name, want.ptx)
    assert tuple(_ev(getattr(launch, f"grid_{a}"), env) for a in "xyz") == (1, 1, 1) and launch.block_x == 1024
    assert [_ev(e, env) for e in extra] == [5, 7]
    with pytest.raises(ValueError, match="flush_order: cursor: expected shape"):
        reg["desc"](ins[0], trtp.TensorDesc([SLOTS, Sym(const=2)], "trt.int32"), buffer_len=L)
    with pytest.raises(ValueError, match="flush_order: buffer_len"):
        reg["desc"](*ins, buffer_len=np.array([0], dtype=np.int32))


@pytest.mark.parametrize("plugin", list(ORDERED_CASES))
def test_decode_plugins_take_the_flush_order_output(fake_trt, plugin):
    """A decode plugin whose state_batch_indices input is flush_order's (b, 4) output runs the module built for it
    (row_order): the same kernel name, grid and parameters, that module's PTX."""
    trt, trtp, registry = fake_trt
    info = tp.all_plugins()[plugin]
    attrs, shapes_of, (state, act, shadow) = ORDERED_CASES[plugin]
    reg = registry[info.id]
    shapes, dtypes = shapes_of(attrs), _dtypes(plugin, state, act, shadow)
    fields = {k: np.array([v], dtype=np.int32) for k, v in attrs.items()}
    ins = _descs(trtp, plugin, shapes, dtypes)
    outs = reg["desc"](*ins, **fields)
    for tactic in sorted(tp.TACTICS):
        name, ptx, launch, extra = reg["aot"](*ins, *fields.values(), outs, tactic)
        if plugin in GDN_PLUGINS:
            plain = gp.aot_kernel(*attrs.values(), act, 90, tactic, shadow or "none")
            want = gp.aot_kernel(*attrs.values(), act, 90, tactic, shadow or "none", row_order=True)
        else:
            plain = mp.aot_kernel(*attrs.values(), state, act, 90, tactic, 132, shadow)
            want = mp.aot_kernel(*attrs.values(), state, act, 90, tactic, 132, shadow, row_order=True)
        assert want.spec.row_order and want.spec.key == plain.spec.key + "_ro"
        assert (name, ptx) == (want.kernel_name, want.ptx) and ptx != plain.ptx
        assert tuple(_ev(getattr(launch, f"grid_{a}"), dict(batch=5, slots=7)) for a in "xyz") == want.grid(5) == \
            plain.grid(5)


@pytest.mark.parametrize("plugin, rows, match", [
    (mp.PLUGIN_NAME, ("b", 4), r"mamba2_decode: state_batch_indices: expected \(batch,\), got"),
    (mp.VERIFY_PLUGIN_NAME, ("b", 4), r"mamba2_verify: state_batch_indices: expected \(batch,\)"),
    (gp.VERIFY, ("b", 4), r"gdn_verify: state_batch_indices: expected \(batch,\)"),
    (gp.DECODE, ("b", 3), r"gdn_decode: state_batch_indices: expected \(batch,\) or the flush_order output"),
])
def test_rows_input_forms_are_checked(fake_trt, plugin, rows, match):
    """The flush-first order is taken by the decode plugins whose kernels read it; others, and any other shape, are
    refused by name."""
    trt, trtp, registry = fake_trt
    attrs, shapes_of, (state, act, shadow) = PLUGIN_CASES[plugin]
    shapes = dict(shapes_of(attrs), state_batch_indices=rows)
    fields = {k: np.array([v], dtype=np.int32) for k, v in attrs.items()}
    with pytest.raises(ValueError, match=match):
        registry[tp.all_plugins()[plugin].id]["desc"](*_descs(trtp, plugin, shapes, _dtypes(plugin, state, act, shadow)),
                                                      **fields)
