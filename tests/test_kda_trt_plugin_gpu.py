# SPDX-License-Identifier: Apache-2.0
"""KDA's TensorRT plugins verified by proxy: launch exactly what ``aot_impl`` returns, as TensorRT would.

``kda_decode[_shadow]``: the kernel name and PTX (loaded by the driver from PTX, as TensorRT does), grid, block,
shared memory and int32 extra args come from ``families.kda.trt_plugin.aot_kernel``; pointers in TensorRT's order
from the plugin's input and output names (inputs, extra args, outputs; aliased outputs get their inputs' pointers),
every tensor checked against ``io_shapes``. Oracle: the family's launcher ``kda_replay_decode`` (the module compiled
to a cubin by NVRTC) on a clone of every tensor, step by step over 2L + 1 steps crossing flushes, with a padding row
and unused slots. The two run the same PTX; only the driver's JIT vs NVRTC's ptxas differ (ptxas may contract a
multiply and an add into one fma), so the fp32 tensors (checkpoint, g, beta, the u ring without a shadow) agree to
1e-5 relative (a few fp32 ulp through <= L terms) and the bf16 ones (y, the u ring beside a shadow, the shadow) to
2e-3 (a few elements whose fp32 value sits on a bf16 rounding boundary may round the other way: 2^-8 each); the
k / v rings (copies of the inputs), cursors, padding rows and unused slots bit for bit."""

import numpy as np
import pytest
import torch

from trtllm_replayssm import cursor_ops
from trtllm_replayssm import trt_plugin as tp
from trtllm_replayssm.families.kda import ops as kops
from trtllm_replayssm.families.kda import trt_plugin as kp
from trtllm_replayssm.families.kda.layers import ring_dtype

pytestmark = pytest.mark.gpu
RING = {"none": ring_dtype(torch.float32, None), "bf16": ring_dtype(torch.float32, torch.bfloat16)}  # the u ring


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
@pytest.mark.parametrize("shadow, lower_bound", [("none", None), ("bf16", -5.0)])
def test_plugin_launch_equals_the_launcher(tactic, shadow, lower_bound):
    from cuda.core import Device, LaunchConfig, ObjectCode, Stream, launch

    H, K, V, L, batch, slots = 4, 128, 128, 4, 3, 5
    act = torch.bfloat16
    major, minor = torch.cuda.get_device_capability()
    bits = kp.lower_bound_bits(lower_bound)
    k_aot = kp.aot_kernel(H, K, V, L, 1, bits, "bf16", major * 10 + minor, tactic, shadow)
    info = tp.all_plugins()[kp.DECODE_SHADOW if shadow != "none" else kp.DECODE]
    Device().set_current()
    kern = ObjectCode.from_ptx(k_aot.ptx).get_kernel(k_aot.kernel_name)
    g = torch.Generator(device="cuda").manual_seed(5)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    state = rnd(slots, H, K, V, scale=0.2)
    A = dict(state=state, k_cache=rnd(slots, H, L, K, dtype=act), u_cache=rnd(slots, H, L, V, dtype=RING[shadow]),
             g_cache=-rnd(slots, H, L, K).abs(), v_cache=rnd(slots, H, L, V, dtype=act),
             beta_cache=rnd(slots, H, L).sigmoid(), cursor=torch.tensor([0, 2, 1, 3, 0], dtype=torch.int32, device="cuda"))
    if shadow != "none":
        A["shadow"] = state.to(torch.bfloat16)
    B = {n: t.clone() for n, t in A.items()}
    A_log = torch.log(torch.rand(H, generator=g, device="cuda") + 0.05)
    dt_bias = rnd(H, K, scale=0.5)
    sbi = torch.tensor([3, -1, 0], dtype=torch.int32, device="cuda")
    unused = [1, 2, 4]
    before = {n: t[unused].clone() for n, t in B.items() if n != "cursor"}
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    for step in range(2 * L + 1):
        q, k, f = (rnd(batch, H, K, dtype=act) for _ in range(3))
        v, b = rnd(batch, H, V, dtype=act), rnd(batch, H, dtype=act)
        ya = torch.full((batch, H, V), float("nan"), dtype=act, device="cuda")
        yb = ya.clone()
        kops.kda_replay_decode(q, k, v, f, b, A_log, dt_bias, A["state"], A["k_cache"], A["u_cache"], A["g_cache"],
                               A["v_cache"], A["beta_cache"], A["cursor"], sbi, out=ya, shadow=A.get("shadow"),
                               lower_bound=lower_bound)
        named = dict(q=q, k=k, v=v, f=f, b=b, A_log=A_log, dt_bias=dt_bias, state_batch_indices=sbi, **B)
        shapes = kp.io_shapes(batch, slots, H, K, V, L, shadow)
        ins = [named[n] for n in info.inputs]
        for n, t in zip(info.inputs, ins):
            assert tuple(t.shape) == shapes[n] and t.is_contiguous(), n
        outs = [yb] + [ins[i] for i in info.aliases.values()]
        args = [t.data_ptr() for t in ins] + [np.int32(x) for x in k_aot.extra_values(batch, slots)] + \
            [t.data_ptr() for t in outs]
        launch(stream, LaunchConfig(grid=k_aot.grid(batch), block=(k_aot.block_x, 1, 1), shmem_size=k_aot.shared_mem),
               kern, *args)
        for d in (A, B):
            cursor_ops.advance_cursor(d["cursor"], sbi, buffer_len=L)
        live = sbi.cpu() >= 0
        assert rel(yb[live.cuda()], ya[live.cuda()]) < 2e-3, step
        assert torch.isnan(yb[~live.cuda()]).all(), "the padding row's output stays untouched"
        for n in ("k_cache", "v_cache", "cursor"):
            assert torch.equal(A[n], B[n]), (step, n)
        low = ("u_cache", "shadow") if shadow != "none" else ()  # bf16; without a shadow the u ring is fp32
        for n in ("state", "g_cache", "beta_cache", "u_cache") + low[1:]:
            assert rel(B[n], A[n]) < (2e-3 if n in low else 1e-5), (step, n)
        for n, t in before.items():
            assert torch.equal(B[n][unused], t), (step, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shadow, lower_bound", [("none", None), ("bf16", -5.0)])
def test_verify_plugin_launch_equals_the_launcher(shadow, lower_bound):
    """``kda_verify[_shadow]`` as TensorRT would launch it against ``kda_replay_verify``, T = 2 over 3L steps with
    random acceptance (commit: the shared kernel on both cursors); the same tolerances as the decode test above."""
    from cuda.core import Device, LaunchConfig, ObjectCode, Stream, launch

    H, K, V, L, T, batch, slots = 4, 128, 128, 8, 2, 3, 5
    act = torch.bfloat16
    major, minor = torch.cuda.get_device_capability()
    bits = kp.lower_bound_bits(lower_bound)
    k_aot = kp.aot_verify_kernel(H, K, V, L, 1, bits, T, "bf16", major * 10 + minor, 2, shadow)
    info = tp.all_plugins()[kp.VERIFY_SHADOW if shadow != "none" else kp.VERIFY]
    Device().set_current()
    kern = ObjectCode.from_ptx(k_aot.ptx).get_kernel(k_aot.kernel_name)
    g = torch.Generator(device="cuda").manual_seed(11)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    state = rnd(slots, H, K, V, scale=0.2)
    cursor = torch.tensor([[0, 0], [3, 2], [7, 5], [2, 6], [5, 1]], dtype=torch.int32, device="cuda")
    A = dict(state=state, k_cache=rnd(slots, H, L, K, dtype=act), u_cache=rnd(slots, H, L, V, dtype=RING[shadow]),
             g_cache=-rnd(slots, H, L, K).abs(), v_cache=rnd(slots, H, L, V, dtype=act),
             beta_cache=rnd(slots, H, L).sigmoid(), cursor=cursor)
    if shadow != "none":
        A["shadow"] = state.to(torch.bfloat16)
    B = {n: t.clone() for n, t in A.items()}
    A_log = torch.log(torch.rand(H, generator=g, device="cuda") + 0.05)
    dt_bias = rnd(H, K, scale=0.5)
    sbi = torch.tensor([3, -1, 1], dtype=torch.int32, device="cuda")
    unused = [0, 2, 4]
    before = {n: t[unused].clone() for n, t in B.items()}
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    for step in range(3 * L):
        q, k, f = (rnd(batch, T, H, K, dtype=act) for _ in range(3))
        v, b = rnd(batch, T, H, V, dtype=act), rnd(batch, T, H, dtype=act)
        ya = torch.full((batch, T, H, V), float("nan"), dtype=act, device="cuda")
        yb = ya.clone()
        kops.kda_replay_verify(q, k, v, f, b, A_log, dt_bias, A["state"], A["k_cache"], A["u_cache"], A["g_cache"],
                               A["v_cache"], A["beta_cache"], A["cursor"], sbi, out=ya, shadow=A.get("shadow"),
                               lower_bound=lower_bound)
        named = dict(q=q, k=k, v=v, f=f, b=b, A_log=A_log, dt_bias=dt_bias, state_batch_indices=sbi, **B)
        shapes = kp.io_shapes(batch, slots, H, K, V, L, shadow, T)
        ins = [named[n] for n in info.inputs]
        for n, t in zip(info.inputs, ins):
            assert tuple(t.shape) == shapes[n] and t.is_contiguous(), n
        outs = [yb] + [ins[i] for i in info.aliases.values()]
        args = [t.data_ptr() for t in ins] + [np.int32(x) for x in k_aot.extra_values(batch, slots)] + \
            [t.data_ptr() for t in outs]
        launch(stream, LaunchConfig(grid=k_aot.grid(batch), block=(k_aot.block_x, 1, 1), shmem_size=k_aot.shared_mem),
               kern, *args)
        n_acc = torch.randint(0, T + 1, (batch,), generator=g, device="cuda").to(torch.int32)
        for d in (A, B):
            kops.kda_spec_commit(d["cursor"], n_acc, sbi, T, d["u_cache"])
        live = sbi >= 0
        assert rel(yb[live], ya[live]) < 2e-3, step
        assert torch.isnan(yb[~live]).all(), "the padding row's output stays untouched"
        for n in ("k_cache", "v_cache", "cursor"):
            assert torch.equal(A[n], B[n]), (step, n)
        low = ("u_cache", "shadow") if shadow != "none" else ()  # bf16; without a shadow the u ring is fp32
        for n in ("state", "g_cache", "beta_cache", "u_cache") + low[1:]:
            assert rel(B[n], A[n]) < (2e-3 if n in low else 1e-5), (step, n)
        for n, t in before.items():
            assert torch.equal(B[n][unused], t), (step, n)
