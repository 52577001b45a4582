# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet plugins verified by proxy: launch exactly what ``aot_impl`` returns, as TensorRT would.

``gdn_decode[_shadow]``, ``gdn_verify[_shadow]`` and ``spec_commit``: the kernel name and PTX (loaded by
the driver from PTX, as TensorRT does), grid, block, shared memory and int32 extra args come from
:func:`families/gdn/trt_plugin.aot_kernel` / :func:`families/gdn/trt_plugin.aot_verify_kernel` /
:func:`trt_plugin.aot_commit_kernel`; pointers are passed in TensorRT's order, built from the plugins'
input and output names in ``trt_plugin.PLUGINS`` (inputs, extra args, outputs; aliased outputs get their
inputs' pointers), after checking every tensor against :func:`families/gdn/trt_plugin.io_shapes`. The launches
stand in for ``gdn_ops.gdn_replay_decode`` / ``gdn_ops.gdn_replay_verify`` / ``gdn_ops.gdn_spec_commit``
inside :class:`tests.test_gdn_gpu.Problem` (3L + 1 steps crossing flushes) and
:class:`tests.test_gdn_spec_gpu.SpecProblem` (40 steps of random acceptance), which mirror every step
with :mod:`gdn_reference` in float64 and check y, checkpoints, buffers, cursors, the bf16 shadow bit for
bit after each flush, padding rows' y and unused slots untouched. Both tactics; rows as in an engine
(state_batch_indices = arange, slots = batch) and a padded batch over more slots. Tolerances: see
tests/test_gdn_gpu.py.
"""

import zlib

import numpy as np
import pytest
import torch

from trtllm_replayssm import trt_plugin as tp
from trtllm_replayssm.config import DTYPE_CODES
from trtllm_replayssm.families.gdn import ops as gdn_ops
from trtllm_replayssm.families.gdn import trt_plugin as gp

from .test_gdn_gpu import Problem
from .test_gdn_spec_gpu import STEPS, SpecProblem

pytestmark = pytest.mark.gpu


class GDNPluginLaunches:
    """The GDN ops replaced by launches of the plugins' AOT kernels (``T`` = 0: decode, else verify)."""

    def __init__(self, pb, tactic, T, shadow):
        from cuda.core import Device, ObjectCode

        major, minor = torch.cuda.get_device_capability()
        arch = major * 10 + minor
        act = DTYPE_CODES[pb.act]
        self.T, self.L, self.shadow = T, pb.L, shadow
        self.geom = (pb.H, pb.HV, pb.K, pb.V, pb.L)
        if T:
            self.step_kernel = gp.aot_verify_kernel(*self.geom, 1, T, act, arch, tactic, shadow)
            self.plugin = tp.all_plugins()[gp.VERIFY_SHADOW if shadow != "none" else gp.VERIFY]
            self.commit = tp.aot_commit_kernel(T, pb.L, arch)
            kernels = (self.step_kernel, self.commit)
        else:
            self.step_kernel = gp.aot_kernel(*self.geom, 1, act, arch, tactic, shadow)
            self.plugin = tp.all_plugins()[gp.DECODE_SHADOW if shadow != "none" else gp.DECODE]
            kernels = (self.step_kernel,)
        assert self.step_kernel.kernel_name == self.plugin.kernel_name
        Device().set_current()
        self.kernels = {k.kernel_name: ObjectCode.from_ptx(k.ptx).get_kernel(k.kernel_name) for k in kernels}
        self.count = {k.kernel_name: 0 for k in kernels}

    def _launch(self, k, ins, outs, batch, slots):
        from cuda.core import LaunchConfig, Stream, launch

        args = ([t.data_ptr() for t in ins] + [np.int32(v) for v in k.extra_values(batch, slots)]
                + [t.data_ptr() for t in outs])
        stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
        cfg = LaunchConfig(grid=k.grid(batch), block=(k.block_x, 1, 1), shmem_size=k.shared_mem)
        launch(stream, cfg, self.kernels[k.kernel_name], *args)
        self.count[k.kernel_name] += 1

    def step(self, q, k, v, a, b, A_log, dt_bias, state, u_cache, v_cache, k_cache, g_cache, beta_cache, cursor,
             state_batch_indices, out=None, shadow=None, use_qk_l2norm=True, scale=None, **_):
        assert out is not None and use_qk_l2norm and scale is None  # y is the plugin's first output
        assert (shadow is None) == (self.shadow == "none")
        named = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state_batch_indices=state_batch_indices,
                     cursor=cursor, state=state, u_cache=u_cache, v_cache=v_cache, k_cache=k_cache, g_cache=g_cache,
                     beta_cache=beta_cache, shadow=shadow)
        batch, slots = q.shape[0], state.shape[0]
        shapes = gp.io_shapes(batch, slots, *self.geom, shadow=self.shadow, num_tokens=self.T)
        ins = [named[n] for n in self.plugin.inputs]
        for n, t in zip(self.plugin.inputs, ins):
            assert tuple(t.shape) == shapes[n] and t.is_contiguous(), n
        assert tuple(out.shape) == shapes["y"]
        outs = [out] + [ins[i] for i in self.plugin.aliases.values()]
        assert len(outs) == len(self.plugin.outputs)
        self._launch(self.step_kernel, ins, outs, batch, slots)
        return out

    def spec_commit(self, cursor, n_accepted, state_batch_indices, num_tokens, u_cache, **_):
        assert (num_tokens, u_cache.shape[2]) == (self.T, self.L)
        named = dict(state_batch_indices=state_batch_indices, n_accepted=n_accepted, cursor=cursor)
        ins = [named[n] for n in tp.COMMIT_INPUT_NAMES]
        assert all(t.dtype == torch.int32 and t.is_contiguous() for t in ins)
        outs = [ins[i] for i in tp.COMMIT_ALIASES.values()]
        self._launch(self.commit, ins, outs, state_batch_indices.shape[0], cursor.shape[0])


def _engine_rows(pb):
    """Per-row state, as in an engine: row b uses slot b (pb built with slots == batch)."""
    pb.sbi_cpu = torch.arange(pb.batch, dtype=torch.int32)
    pb.sbi = pb.sbi_cpu.cuda()
    pb.valid = (pb.sbi_cpu >= 0).nonzero()[:, 0]
    pb.used = list(range(pb.batch))
    pb.unused = []
    pb.initial_unused = pb.snapshot(pb.unused)


QWEN3_NEXT = (32, 16, 128, 128)
# (geometry (HV, H, V, K), act, L, batch, slots, pad rows, shadow, engine rows)
DECODE_CASES = [
    (QWEN3_NEXT, torch.bfloat16, 16, 3, 3, (), "none", True),
    (QWEN3_NEXT, torch.bfloat16, 8, 3, 3, (), "bf16", True),
    ((4, 2, 128, 128), torch.float16, 4, 3, 6, (1,), "none", False),
    ((2, 2, 64, 256), torch.float32, 4, 4, 7, (0,), "bf16", False),
]
# (geometry, act, L, T, batch, slots, pad rows, shadow, engine rows)
VERIFY_CASES = [
    (QWEN3_NEXT, torch.bfloat16, 16, 4, 3, 3, (), "none", True),
    (QWEN3_NEXT, torch.bfloat16, 16, 4, 3, 3, (), "bf16", True),
    ((4, 2, 128, 128), torch.bfloat16, 8, 2, 3, 5, (1,), "none", False),
    ((4, 2, 64, 256), torch.float32, 32, 8, 2, 4, (), "bf16", False),
]


def _did(c):
    g, act, L, batch, slots, pad, shadow, engine = c
    return f"{g}-{str(act)[6:]}-L{L}-b{batch}-{shadow}-{'engine' if engine else 'padded'}"


def _vid(c):
    g, act, L, T, batch, slots, pad, shadow, engine = c
    return f"{g}-{str(act)[6:]}-L{L}-T{T}-b{batch}-{shadow}-{'engine' if engine else 'padded'}"


@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
@pytest.mark.parametrize("case", DECODE_CASES, ids=_did)
def test_gdn_decode_plugin_launched_as_tensorrt_would(case, tactic, monkeypatch):
    geom, act, L, batch, slots, pad, shadow, engine = case
    pb = Problem(geom, act, L, batch, slots, pad, seed=tactic + zlib.crc32(_did(case).encode()) % 997,
                 shadow=shadow != "none")
    if engine:
        _engine_rows(pb)
    plugin = GDNPluginLaunches(pb, tactic, 0, shadow)
    monkeypatch.setattr(gdn_ops, "gdn_replay_decode", plugin.step)
    steps = 3 * L + 1
    for _ in range(steps):
        pb.step()
    assert plugin.count == {gp.KERNEL_NAME: steps}


@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
@pytest.mark.parametrize("case", VERIFY_CASES, ids=_vid)
def test_gdn_verify_plugins_launched_as_tensorrt_would(case, tactic, monkeypatch):
    geom, act, L, T, batch, slots, pad, shadow, engine = case
    pb = SpecProblem(geom, act, L, T, batch, slots, pad, seed=tactic + zlib.crc32(_vid(case).encode()) % 997,
                     shadow=shadow != "none")
    if engine:
        _engine_rows(pb)
    plugin = GDNPluginLaunches(pb, tactic, T, shadow)
    monkeypatch.setattr(gdn_ops, "gdn_replay_verify", plugin.step)
    monkeypatch.setattr(gdn_ops, "gdn_spec_commit", plugin.spec_commit)
    for _ in range(STEPS):
        pb.step()
    assert pb.flushes > 0, "no flush in 40 steps: the plugin's fold was not exercised"
    assert plugin.count == {gp.VERIFY_KERNEL_NAME: STEPS, tp.COMMIT_KERNEL_NAME: STEPS}
