# SPDX-License-Identifier: Apache-2.0
"""Plugin verification by proxy: launch exactly what ``aot_impl`` returns, as TensorRT would.

TensorRT's builder cannot be installed here, so this test takes the kernel name, the PTX (loaded
by the driver from PTX, as TensorRT does), the grid/block/shared memory and the int32 extra args
from :func:`families.mamba2.trt_plugin.aot_kernel`, passes pointers in TensorRT's order (inputs, extra args,
outputs; aliased outputs get their inputs' pointers) and compares with the float64 mirror over
3L+2 steps crossing flushes, for both tactics, with and without a bf16 / fp8 shadow
(``mamba2_decode_shadow``). Tolerances: see test_kernels_gpu.py.
"""

import numpy as np
import pytest
import torch

from trtllm_replayssm import trt_plugin as tp
from trtllm_replayssm.families.mamba2 import trt_plugin as mp

from .test_kernels_gpu import Problem

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
@pytest.mark.parametrize("state, act, L, shadow", [("f32", "bf16", 4, "none"), ("bf16", "f16", 8, "none"),
                                                   ("f32", "bf16", 8, "bf16"), ("f32", "bf16", 8, "fp8")])
def test_aot_kernel_launched_as_tensorrt_would(tactic, state, act, L, shadow):
    from cuda.core import Device, LaunchConfig, ObjectCode, Stream, launch

    from trtllm_replayssm.families.mamba2 import ops

    pb = Problem(geom="nemotron_h_8b", state=state, act=act, L=L, batch=3, slots=3, seed=5 + tactic, shadow=shadow)
    pb.sbi = torch.arange(3, dtype=torch.int32, device="cuda")  # per-row state, as in an engine
    pb.valid = pb.sbi.cpu() >= 0
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k = mp.aot_kernel(pb.H, pb.P, pb.N, pb.G, L, state, act, major * 10 + minor, tactic, sms, shadow)
    placeholder = torch.ones(1, device="cuda")  # a bf16 shadow's scale input (never read or written)
    Device().set_current()
    kern = ObjectCode.from_ptx(k.ptx).get_kernel(k.kernel_name)

    def plugin_step(x, B, C, dt, dt_bias, A, D, state_, xc, Bc, dtc, cursor, sbi, z=None, out=None, shadow=None,
                    shadow_scale=None, **_):
        ins = [x, B, C, dt, dt_bias, A, D, sbi, cursor, state_, xc, Bc, dtc]
        aliases = mp.ALIASES
        if shadow is not None:
            ins += [shadow, placeholder if shadow_scale is None else shadow_scale]
            aliases = mp.SHADOW_ALIASES
        outs = [out] + [ins[i] for i in aliases.values()]
        extra = {"batch": x.shape[0], "slots": state_.shape[0]}
        args = [t.data_ptr() for t in ins] + [np.int32(extra[n]) for n in k.extra_args] + [t.data_ptr() for t in outs]
        stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
        grid = (k.grid_x, x.shape[0] if k.grid_y_is_batch else 1, 1)
        launch(stream, LaunchConfig(grid=grid, block=(k.block_x, 1, 1), shmem_size=k.shared_mem), kern, *args)
        return out

    real = ops.replay_decode
    ops.replay_decode = plugin_step
    try:
        for _ in range(3 * L + 2):
            y, y_ref, flushing = pb.replay_step()
            pb.check_y(y, y_ref)
            pb.check_buffers()
            pb.check_state(flushing)
    finally:
        ops.replay_decode = real
    assert torch.equal(placeholder.cpu(), torch.ones(1))


@pytest.mark.parametrize("batch, slots, L", [(5, 7, 16), (1500, 1600, 8)])
def test_flush_order_launched_as_tensorrt_would(batch, slots, L):
    """replayssm::flush_order by proxy: aot_order_kernel's PTX, grid, block and extra args in TensorRT's order
    (inputs, batch, slots, output) give the host rule's (row, slot, cursor, 0) rows bit for bit, padding and
    out-of-range slots included, into a poisoned output."""
    from cuda.core import Device, LaunchConfig, ObjectCode, Stream, launch

    from trtllm_replayssm import cursor as cursors

    g = torch.Generator().manual_seed(batch)
    sbi = torch.randperm(slots, generator=g)[:batch].to(torch.int32)
    sbi[::7] = -1
    sbi[3 % batch] = slots + 2  # out of range, unchecked: ordered with the padding
    cur = torch.randint(0, L, (slots,), generator=g, dtype=torch.int32)
    major, minor = torch.cuda.get_device_capability()
    k = tp.aot_order_kernel(L, major * 10 + minor)
    Device().set_current()
    kern = ObjectCode.from_ptx(k.ptx).get_kernel(k.kernel_name)
    sbi_d, cur_d = sbi.cuda(), cur.cuda()
    out = torch.full((batch, 4), -7, dtype=torch.int32, device="cuda")
    extra = {"batch": batch, "slots": slots}
    args = [sbi_d.data_ptr(), cur_d.data_ptr()] + [np.int32(extra[n]) for n in k.extra_args] + [out.data_ptr()]
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    launch(stream, LaunchConfig(grid=k.grid(batch), block=(k.block_x, 1, 1), shmem_size=k.shared_mem), kern, *args)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), cursors.flush_order(cur, sbi, L))
