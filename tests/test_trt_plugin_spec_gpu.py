# SPDX-License-Identifier: Apache-2.0
"""Speculative plugins verified by proxy: launch exactly what ``aot_impl`` returns, as TensorRT would.

``mamba2_verify`` (+ ``mamba2_verify_shadow``) and ``spec_commit``: the kernel name and PTX (loaded by the driver from PTX, as
TensorRT does), grid, block, shared memory and int32 extra args come from
:func:`families.mamba2.trt_plugin.aot_verify_kernel` / :func:`trt_plugin.aot_commit_kernel`; pointers are passed in
TensorRT's order, built from the plugins' input names (inputs, extra args, outputs; aliased outputs get
their inputs' pointers). The launches stand in for ``ops.replay_verify`` / ``cursor_ops.spec_commit`` inside
:class:`tests.test_spec_gpu.SpecProblem`, which mirrors every step with :mod:`spec_reference` in
float64 and compares y, the flushed checkpoints and the ring bookkeeping (cursor and committed
entries exactly) over 40 steps of random acceptance (some rows 0 every 5th step, all T every 7th)
crossing flushes, for both tactics. Rows: per-row state as in an engine (state_batch_indices =
arange, slots = batch) and a padded batch over more slots (padding rows' y and unused slots must stay
untouched). Tolerances: see tests/test_spec_gpu.py.
"""

import zlib

import numpy as np
import pytest
import torch

from trtllm_replayssm import cursor_ops
from trtllm_replayssm import trt_plugin as tp
from trtllm_replayssm.config import DTYPE_CODES
from trtllm_replayssm.families.mamba2 import ops
from trtllm_replayssm.families.mamba2 import trt_plugin as mp

from .test_spec_gpu import STEPS, SpecProblem, run_and_check

pytestmark = pytest.mark.gpu


class PluginLaunches:
    """``ops.replay_verify`` / ``cursor_ops.spec_commit`` replaced by launches of the plugins' AOT kernels."""

    def __init__(self, pb, tactic):
        from cuda.core import Device, ObjectCode

        major, minor = torch.cuda.get_device_capability()
        arch = major * 10 + minor
        self.T, self.L, self.shadow = pb.T, pb.L, pb.shadow_kind
        self.verify = mp.aot_verify_kernel(pb.H, pb.P, pb.N, pb.G, pb.L, pb.T, DTYPE_CODES[pb.sdt], DTYPE_CODES[pb.act],
                                           arch, tactic, pb.shadow_kind)
        self.placeholder = torch.ones(1, device="cuda")  # mamba2_verify_shadow's scale input with a bf16 shadow
        self.commit = tp.aot_commit_kernel(pb.T, pb.L, arch)
        Device().set_current()
        self.kernels = {k.kernel_name: ObjectCode.from_ptx(k.ptx).get_kernel(k.kernel_name)
                        for k in (self.verify, self.commit)}
        self.count = {k.kernel_name: 0 for k in (self.verify, self.commit)}

    def _launch(self, k, ins, outs, batch, slots):
        from cuda.core import LaunchConfig, Stream, launch

        args = ([t.data_ptr() for t in ins] + [np.int32(v) for v in k.extra_values(batch, slots)]
                + [t.data_ptr() for t in outs])
        stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
        cfg = LaunchConfig(grid=k.grid(batch), block=(k.block_x, 1, 1), shmem_size=k.shared_mem)
        launch(stream, cfg, self.kernels[k.kernel_name], *args)
        self.count[k.kernel_name] += 1

    def replay_verify(self, x, B, C, dt, dt_bias, A, D, state, x_cache, B_cache, dt_cache, cursor,
                      state_batch_indices, z=None, out=None, shadow=None, shadow_scale=None, **_):
        assert z is None and out is not None  # the plugin has no gate input; y is its first output
        assert (shadow is None) == (self.shadow == "none")
        named = dict(x=x, B=B, C=C, dt=dt, dt_bias=dt_bias, A=A, D=D, state_batch_indices=state_batch_indices,
                     cursor=cursor, state=state, x_cache=x_cache, B_cache=B_cache, dt_cache=dt_cache, shadow=shadow,
                     shadow_scale=self.placeholder if shadow_scale is None else shadow_scale)
        shapes = mp.verify_io_shapes(x.shape[0], state.shape[0], self.verify.spec.nheads, self.verify.spec.headdim,
                                     self.verify.spec.dstate, self.verify.spec.ngroups, self.L, self.T, self.shadow)
        info = tp.all_plugins()[mp.VERIFY_PLUGIN_NAME if self.shadow == "none" else mp.VERIFY_SHADOW_PLUGIN_NAME]
        ins = [named[n] for n in info.inputs]
        for n, t in zip(info.inputs, ins):
            assert tuple(t.shape) == shapes[n] and t.is_contiguous(), n
        outs = [out] + [ins[i] for i in info.aliases.values()]
        self._launch(self.verify, ins, outs, x.shape[0], state.shape[0])
        return out

    def spec_commit(self, cursor, n_accepted, state_batch_indices, num_tokens, buffer_len, **_):
        assert (num_tokens, buffer_len) == (self.T, self.L)
        named = dict(state_batch_indices=state_batch_indices, n_accepted=n_accepted, cursor=cursor)
        ins = [named[n] for n in tp.COMMIT_INPUT_NAMES]
        assert all(t.dtype == torch.int32 and t.is_contiguous() for t in ins)
        outs = [ins[i] for i in tp.COMMIT_ALIASES.values()]
        self._launch(self.commit, ins, outs, state_batch_indices.shape[0], cursor.shape[0])


def _engine_rows(pb):
    """Per-row state, as in an engine: row b uses slot b."""
    batch = pb.batch
    pb.sbi_cpu = torch.arange(batch, dtype=torch.int32)
    pb.sbi = pb.sbi_cpu.cuda()
    pb.valid = pb.sbi_cpu >= 0
    pb.used = list(range(batch))
    pb.unused = sorted(set(range(pb.state.shape[0])) - set(pb.used))


CASES = [
    dict(geom="nemotron_h_8b", state="f32", act="bf16", T=4, L=16, batch=3, slots=3, engine=True),
    dict(geom="tiny", state="bf16", act="bf16", T=2, L=8, batch=3, slots=5, pad_rows=(1,), engine=False),
    dict(geom=(8, 64, 128, 2), state="f32", act="f32", T=8, L=16, batch=4, slots=4, engine=True),
    # mamba2_verify_shadow (the shadow read by verifies without a fold, rewritten by the fold)
    dict(geom="nemotron_h_8b", state="f32", act="bf16", T=4, L=16, batch=3, slots=3, engine=True, shadow="bf16"),
    dict(geom=(8, 64, 128, 2), state="f32", act="bf16", T=2, L=8, batch=3, slots=5, pad_rows=(1,), engine=False,
         shadow="fp8"),
]


def _id(c):
    sh = f"-sh-{c['shadow']}" if c.get("shadow", "none") != "none" else ""
    return f"{c['geom']}-{c['state']}-{c['act']}-T{c['T']}-L{c['L']}-{'engine' if c['engine'] else 'padded'}{sh}"


@pytest.mark.parametrize("tactic", sorted(tp.TACTICS))
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_spec_plugins_launched_as_tensorrt_would(case, tactic, monkeypatch):
    kw = {k: v for k, v in case.items() if k != "engine"}
    pb = SpecProblem(**kw, seed=tactic + zlib.crc32(_id(case).encode()))
    if case["engine"]:
        _engine_rows(pb)
    plugin = PluginLaunches(pb, tactic)
    monkeypatch.setattr(ops, "replay_verify", plugin.replay_verify)
    monkeypatch.setattr(cursor_ops, "spec_commit", plugin.spec_commit)
    run_and_check(pb)
    assert plugin.count == {"replayssm_verify": STEPS, "replayssm_spec_commit": STEPS}
