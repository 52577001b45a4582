# SPDX-License-Identifier: Apache-2.0
"""The TensorRT plugin's plain parts: what aot_impl hands TensorRT, checked without TensorRT.

The GPU proxy test (tests/test_trt_plugin_gpu.py) launches exactly this PTX with these launch
parameters in TensorRT's argument order. A network-building test runs where TensorRT is installed.
"""

import re

import pytest

from trtllm_replayssm import trt_plugin as tp


def test_aot_kernel_matches_the_kernel_signature():
    k = tp.aot_kernel(128, 64, 128, 8, 16, "f32", "bf16", 90, tactic=1)
    ptx = k.ptx.decode()
    params = re.search(rf"\.entry {k.kernel_name}\((.*?)\)", ptx, re.S).group(1)
    kinds = re.findall(r"\.param \.(u64|u32)", params)
    n_in, n_out = len(tp.INPUT_NAMES), len(tp.OUTPUT_NAMES)
    assert kinds == ["u64"] * n_in + ["u32"] * len(k.extra_args) + ["u64"] * n_out
    if k.spec.persistent:
        assert k.grid_x == 132 * k.spec.blocks_per_sm and not k.grid_y_is_batch
    else:
        assert k.grid_x == 128 * (64 // k.spec.rows) and k.grid_y_is_batch
    assert k.block_x == k.spec.threads and k.shared_mem == 0
    assert ".target sm_90" in ptx


def test_tactics_choose_geometries():
    big = tp.aot_kernel(128, 64, 128, 8, 16, "f32", "bf16", 90, tactic=1)
    small = tp.aot_kernel(128, 64, 128, 8, 16, "f32", "bf16", 90, tactic=2)
    assert small.spec.rows <= big.spec.rows and small.spec.threads // small.spec.rows > big.spec.threads // big.spec.rows


@pytest.mark.parametrize("bad, match", [
    (dict(state="f64"), "state: expected one of"),
    (dict(act="i8"), "act: expected one of"),
    (dict(tactic=3), "tactic: expected one of"),
])
def test_aot_kernel_rejects(bad, match):
    args = dict(nheads=128, headdim=64, dstate=128, ngroups=8, buffer_len=16, state="f32", act="bf16", arch=90)
    with pytest.raises(ValueError, match=match):
        tp.aot_kernel(**{**args, **bad})


def test_io_contract_and_aliases():
    shapes = tp.io_shapes(4, 6, 128, 64, 128, 8, 16)
    assert list(shapes)[: len(tp.INPUT_NAMES)] == list(tp.INPUT_NAMES)
    assert shapes["state_out"] == shapes["state"] == (6, 128, 64, 128)
    assert shapes["x_cache_out"] == (6, 128, 16, 64) and shapes["B_cache_out"] == (6, 8, 16, 128)
    assert shapes["y"] == shapes["x"] == (4, 128, 64)
    for st in tp.STATE_DTYPES:
        for act in tp.ACT_DTYPES:
            types = tp.type_combination(st, act)
            assert len(types) == len(tp.INPUT_NAMES) + len(tp.OUTPUT_NAMES)
            for o, i in tp.ALIASES.items():  # an aliased output has its input's type
                assert types[len(tp.INPUT_NAMES) + o] == types[i]


def test_network_with_plugin_builds():
    trt = pytest.importorskip("tensorrt", reason="TensorRT >= 10.9 is not installed here (its builder "
                                                 "library cannot be installed on this machine)")
    pytest.importorskip("torch").cuda.is_available() or pytest.skip("needs a GPU to build an engine")
    tp.register()
    H, P, N, G, L, b = 8, 64, 64, 2, 4, 2
    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    shapes = tp.io_shapes(b, b, H, P, N, G, L)
    types = dict(zip(tp.INPUT_NAMES, (trt.float32,) * 7 + (trt.int32, trt.int32) + (trt.float32,) * 4))
    ins = [net.add_input(n, types[n], shapes[n]) for n in tp.INPUT_NAMES]
    import tensorrt.plugin as trtp

    op = getattr(getattr(trtp.op, tp.PLUGIN_NAMESPACE), tp.PLUGIN_NAME)
    layer = net.add_plugin(op(*ins, **dict(zip(tp.ATTRIBUTES, (H, P, N, G, L)))), aot=True)
    for i, name in enumerate(tp.OUTPUT_NAMES):
        layer.get_output(i).name = name
        net.mark_output(layer.get_output(i))
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    assert builder.build_serialized_network(net, config) is not None


@pytest.mark.parametrize("shadow", tp.SHADOW_KINDS)
def test_shadow_plugin_contract(shadow):
    """mamba2_decode_shadow: 15 inputs, 2 int32 args, 7 outputs; the shadow and its scales alias."""
    k = tp.aot_kernel(128, 64, 128, 8, 16, "f32", "bf16", 90, tactic=1, shadow=shadow)
    assert k.spec.shadow == shadow and f"_sh-{shadow}_" in k.spec.key
    params = re.search(rf"\.entry {k.kernel_name}\((.*?)\)", k.ptx.decode(), re.S).group(1)
    kinds = re.findall(r"\.param \.(u64|u32)", params)
    assert kinds == ["u64"] * len(tp.SHADOW_INPUT_NAMES) + ["u32"] * 2 + ["u64"] * len(tp.SHADOW_OUTPUT_NAMES)
    shapes = tp.io_shapes(4, 6, 128, 64, 128, 8, 16, shadow)
    assert list(shapes)[: len(tp.SHADOW_INPUT_NAMES)] == list(tp.SHADOW_INPUT_NAMES)
    assert shapes["shadow_out"] == shapes["shadow"] == (6, 128, 64, 128)
    assert shapes["shadow_scale_out"] == shapes["shadow_scale"] == ((6, 128, 64) if shadow == "fp8" else (1,))
    types = tp.type_combination("f32", "bf16", shadow)
    n_in = len(tp.SHADOW_INPUT_NAMES)
    assert len(types) == n_in + len(tp.SHADOW_OUTPUT_NAMES) and types[13] == {"bf16": "BF16", "fp8": "FP8"}[shadow]
    for o, i in tp.SHADOW_ALIASES.items():
        assert types[n_in + o] == types[i]


def test_shadow_plugin_rejects_a_non_f32_checkpoint():
    with pytest.raises(ValueError, match="shadow: expected one of"):
        tp.aot_kernel(128, 64, 128, 8, 16, "bf16", "bf16", 90, shadow="bf16")
