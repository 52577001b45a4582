# SPDX-License-Identifier: Apache-2.0
"""KDA's TensorRT AOT plugins (``replayssm::kda_decode`` (+ ``_shadow``), families/kda/trt_plugin.py) on the CPU.

The plugin hands TensorRT exactly what ``families.kda.ops.kda_replay_decode`` launches: the module the planner
picks for the tactic's batch, its PTX (NVRTC, no GPU), the kernel name, the grid and the int32 extra args in
TensorRT's parameter order (inputs, batch, slots, outputs). ``register`` runs through tests/test_trt_plugin.py's
stand-in of ``tensorrt.plugin`` (TensorRT cannot be installed here); the family's plugins are registered by the
shared ``trt_plugin.register`` through the family interface (``Family.trt_plugin``), not by name."""

import dataclasses

import numpy as np
import pytest

from tests.test_trt_plugin import _descs, _entry_params, _ev, fake_trt  # noqa: F401  (fake_trt: a fixture)
from trtllm_replayssm import trt_plugin as tp
from trtllm_replayssm.families.kda import config as kcfg
from trtllm_replayssm.families.kda import trt_plugin as kp

ATTRS = dict(num_heads=4, key_dim=64, value_dim=128, buffer_len=8, use_qk_l2norm=1, lower_bound_bits=0)


@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
@pytest.mark.parametrize("shadow, lower_bound", [("none", None), ("bf16", -5.0)])
def test_aot_kernel_is_what_ops_launches_in_tensorrt_order(tactic, shadow, lower_bound):
    k = kp.aot_kernel(12, 128, 128, 16, 1, kp.lower_bound_bits(lower_bound), "bf16", 90, tactic, shadow)
    assert k.kernel_name == "kda_replay_decode" and ".target sm_90" in k.ptx.decode()
    info = kp.PLUGINS[kp.DECODE_SHADOW if shadow != "none" else kp.DECODE]
    assert _entry_params(k) == ["u64"] * len(info.inputs) + ["u32"] * 2 + ["u64"] * len(info.outputs)
    assert k.extra_args == ("batch", "slots") and k.extra_values(3, 5) == [3, 5]
    # the launcher plans the same module for this batch and launches spec.grid(batch)
    assert k.spec == kcfg.kda_spec("bf16", 12, 128, 128, 16, tp.TACTICS[tactic], shadow, True, None, lower_bound, 90)
    assert k.grid(7) == k.spec.grid(7) and k.block_x == k.spec.threads and k.shared_mem == 0


def test_io_contract_types_and_attributes():
    for name, shadow in ((kp.DECODE, "none"), (kp.DECODE_SHADOW, "bf16")):
        info = tp.all_plugins()[name]
        assert info.id == f"replayssm::{name}" and info.attributes == kp.ATTRIBUTES
        m = info.manifest()["aliased_outputs"]
        assert m["state_out"] == "state" and m["u_cache_out"] == "u_cache" and m["beta_cache_out"] == "beta_cache"
        assert ("shadow_out" in m) == (shadow != "none")
        shapes = kp.io_shapes(3, 5, *list(ATTRS.values())[:4], shadow)
        assert set(shapes) == set(info.inputs) | set(info.outputs)
        assert all(shapes[o] == shapes[info.inputs[i]] for o, i in ((info.outputs[o], i) for o, i in info.aliases.items()))
        types = kp.type_combination("bf16", shadow)
        assert len(types) == len(info.inputs) + len(info.outputs)
        ring = "FP32" if shadow == "none" else "BF16"  # layers.ring_dtype
        assert types[info.inputs.index("u_cache")] == ring and types[info.inputs.index("g_cache")] == "FP32"
        tp.check_attributes(name, ATTRS, shapes)
    shapes = kp.io_shapes(3, 5, *list(ATTRS.values())[:4])
    with pytest.raises(ValueError, match="key_dim=66 but the inputs have 64"):
        tp.check_attributes(kp.DECODE, {**ATTRS, "key_dim": 66}, shapes)
    with pytest.raises(ValueError, match="buffer_len: expected 2..16"):
        tp.check_attributes(kp.DECODE, {**ATTRS, "buffer_len": 32}, kp.io_shapes(3, 5, 4, 64, 128, 32))
    with pytest.raises(ValueError, match="lower_bound_bits: expected 0 .Kimi's gate. or the bits of a negative"):
        tp.check_attributes(kp.DECODE, {**ATTRS, "lower_bound_bits": kp.lower_bound_bits(-5.0) & 0x7FFFFFFF}, shapes)
    with pytest.raises(ValueError, match=r"shadow: expected the state's shape"):
        tp.check_attributes(kp.DECODE_SHADOW, ATTRS, {**kp.io_shapes(3, 5, 4, 64, 128, 8, "bf16"),
                                                      "shadow": (5, 4, 128, 64)})
    assert kp.lower_bound_of(kp.lower_bound_bits(-5.0)) == -5.0 and kp.lower_bound_of(0) is None
    with pytest.raises(ValueError, match="lower_bound: expected a negative float"):
        kp.lower_bound_bits(0.5)


@pytest.mark.parametrize("name, shadow", [(kp.DECODE, "none"), (kp.DECODE_SHADOW, "bf16")])
def test_register_through_a_tensorrt_stand_in(fake_trt, name, shadow):  # noqa: F811
    attrs = {**ATTRS, "lower_bound_bits": kp.lower_bound_bits(-5.0)}
    _check_registered(fake_trt, name, shadow, attrs, kp.io_shapes("b", "s", *list(attrs.values())[:4], shadow),
                      ("num_heads", 6, "num_heads=6 but the inputs have 4"), kp.aot_kernel)


@pytest.mark.parametrize("name, shadow", [(kp.DECODE, "none"), (kp.DECODE_SHADOW, "bf16")])
def test_decode_plugins_take_the_flush_order_output(fake_trt, name, shadow):  # noqa: F811
    """With the step's flush_order output (b, 4) as its state_batch_indices input, kda_decode[_shadow] runs the module
    built for it (KDASpec.row_order); verify refuses it."""
    attrs = {**ATTRS, "lower_bound_bits": 0}
    shapes = kp.io_shapes("b", "s", *list(attrs.values())[:4], shadow, row_order=True)
    assert shapes["state_batch_indices"] == ("b", 4)

    def aot(*args):
        k = kp.aot_kernel(*args, row_order=True)
        assert k.spec.row_order and k.spec == dataclasses.replace(kp.aot_kernel(*args).spec, row_order=True)
        return k

    _check_registered(fake_trt, name, shadow, attrs, shapes, ("num_heads", 6, "num_heads=6 but the inputs have 4"), aot)
    trt, trtp, registry = fake_trt
    vshapes = dict(kp.io_shapes("b", "s", *list(attrs.values())[:4], shadow, num_tokens=4), state_batch_indices=("b", 4))
    verify = kp.VERIFY_SHADOW if shadow != "none" else kp.VERIFY
    back = {"FP32": "f32", "BF16": "bf16", "FP16": "f16", "INT32": "i32"}
    dtypes = {n: back[t] for n, t in zip(tp.all_plugins()[verify].inputs, kp.type_combination("bf16", shadow))}
    with pytest.raises(ValueError, match=r"kda_verify(_shadow)?: state_batch_indices: expected \(batch,\)"):
        registry[tp.all_plugins()[verify].id]["desc"](*_descs(trtp, verify, vshapes, dtypes), **attrs, num_tokens=4)


def _check_registered(trt_stand_in, name, shadow, attrs, shapes, bad, aot):
    """A plugin registered through the TensorRT stand-in: its tensors and attributes, the aliased outputs, a wrong
    attribute (``bad`` = (name, value, message)) refused by desc, the tune's type combination, and per tactic the
    AOT kernel, grid and extra arguments equal to ``aot(*attrs, "bf16", 90, tactic, shadow)``'s."""
    trt, trtp, registry = trt_stand_in
    info = tp.all_plugins()[name]
    reg = registry[info.id]
    assert reg["tensors"] == list(info.inputs) and reg["attrs"] == list(info.attributes)
    back = {"FP32": "f32", "BF16": "bf16", "FP16": "f16", "INT32": "i32"}
    dtypes = {n: back[t] for n, t in zip(info.inputs, kp.type_combination("bf16", shadow))}
    fields = {k: np.array([v], dtype=np.int32) for k, v in attrs.items()}
    ins = _descs(trtp, name, shapes, dtypes)
    outs = reg["desc"](*ins, **fields)
    for o, desc in enumerate(outs):
        assert (desc.aliased_to is ins[info.aliases[o]]) if o in info.aliases else desc.aliased_to is None
    with pytest.raises(ValueError, match=bad[2]):
        reg["desc"](*ins, **{**attrs, bad[0]: bad[1]})
    combos = reg["tune"](*ins, outs)
    assert ", ".join(kp.type_combination("bf16", shadow)) in [c.io_types for c in combos]
    env = dict(batch=5, slots=7)
    for tactic in sorted(tp.TACTICS):
        kname, ptx, launch, extra = reg["aot"](*ins, *fields.values(), outs, tactic)
        want = aot(*attrs.values(), "bf16", 90, tactic, shadow)
        assert (kname, ptx) == (want.kernel_name, want.ptx)
        assert tuple(_ev(getattr(launch, f"grid_{a}"), env) for a in "xyz") == want.grid(5)
        assert [_ev(e, env) for e in extra] == [5, 7]


# ---- kda_verify[_shadow] ---------------------------------------------------------------------------------------
VATTRS = {**ATTRS, "num_tokens": 4}


@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
@pytest.mark.parametrize("shadow, lower_bound, T", [("none", None, 4), ("bf16", -5.0, 2)])
def test_aot_verify_kernel_is_what_ops_launches_in_tensorrt_order(tactic, shadow, lower_bound, T):
    k = kp.aot_verify_kernel(12, 128, 128, 16, 1, kp.lower_bound_bits(lower_bound), T, "bf16", 90, tactic, shadow)
    assert k.kernel_name == "kda_verify" and ".target sm_90" in k.ptx.decode()
    info = kp.PLUGINS[kp.VERIFY_SHADOW if shadow != "none" else kp.VERIFY]
    assert _entry_params(k) == ["u64"] * len(info.inputs) + ["u32"] * 2 + ["u64"] * len(info.outputs)
    assert k.extra_args == ("batch", "slots") and k.extra_values(3, 5) == [3, 5]
    assert k.spec == kcfg.kda_spec("bf16", 12, 128, 128, 16, tp.TACTICS[tactic], shadow, True, None, lower_bound, 90,
                                   num_tokens=T)
    assert k.grid(7) == k.spec.grid(7) and k.block_x == k.spec.threads and k.shared_mem == 0
    with pytest.raises(ValueError, match="num_tokens"):
        kp.aot_verify_kernel(12, 128, 128, 16, 1, 0, 3, "bf16", 90, tactic, shadow)


def test_verify_io_contract_types_and_attributes():
    for name, shadow in ((kp.VERIFY, "none"), (kp.VERIFY_SHADOW, "bf16")):
        info = tp.all_plugins()[name]
        assert info.id == f"replayssm::{name}" and info.attributes == kp.VERIFY_ATTRIBUTES
        assert info.kernel_name == "kda_verify"
        shapes = kp.io_shapes(3, 5, 4, 64, 128, 8, shadow, 4)
        assert shapes["q"] == (3, 4, 4, 64) and shapes["y"] == (3, 4, 4, 128) and shapes["cursor"] == (5, 2)
        assert set(shapes) == set(info.inputs) | set(info.outputs)
        assert all(shapes[info.outputs[o]] == shapes[info.inputs[i]] for o, i in info.aliases.items())
        tp.check_attributes(name, VATTRS, shapes)
    shapes = kp.io_shapes(3, 5, 4, 64, 128, 8, "none", 4)
    with pytest.raises(ValueError, match="num_tokens=2 but the inputs have 4"):
        tp.check_attributes(kp.VERIFY, {**VATTRS, "num_tokens": 2}, shapes)
    with pytest.raises(ValueError, match=r"buffer_len: expected in \[2 \* num_tokens, 32\]"):
        tp.check_attributes(kp.VERIFY, {**VATTRS, "buffer_len": 6}, kp.io_shapes(3, 5, 4, 64, 128, 6, "none", 4))
    with pytest.raises(ValueError, match=r"cursor: expected shape \(slots, 2\)"):
        tp.check_attributes(kp.VERIFY, VATTRS, {**shapes, "cursor": (5,)})
    with pytest.raises(ValueError, match="shadow: expected the state's shape"):
        tp.check_attributes(kp.VERIFY_SHADOW, VATTRS, {**kp.io_shapes(3, 5, 4, 64, 128, 8, "bf16", 4),
                                                       "shadow": (5, 4, 128, 64)})


@pytest.mark.parametrize("name, shadow", [(kp.VERIFY, "none"), (kp.VERIFY_SHADOW, "bf16")])
def test_register_verify_through_a_tensorrt_stand_in(fake_trt, name, shadow):  # noqa: F811
    _check_registered(fake_trt, name, shadow, {**VATTRS, "lower_bound_bits": kp.lower_bound_bits(-5.0)},
                      kp.io_shapes("b", "s", 4, 64, 128, 8, shadow, 4),
                      ("num_tokens", 2, "num_tokens=2 but the inputs have 4"), kp.aot_verify_kernel)
