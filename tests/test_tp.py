# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism by heads, on the float64 reference in one process.

Oracle: the TP=1 ReplaySSM step. Each rank runs the same reference on its shard of heads (with
groups owned or replicated); the concatenated outputs must equal TP=1's and the row-parallel
out_proj sum must equal the full product, over 3L+2 steps crossing flushes. Both sides are
float64 with identical per-head arithmetic, so agreement is exact up to summation order in the
out_proj (rtol 1e-12). The GPU version of this test (TP=2 on nvidia-h200-x2, NCCL) is issue 6.
"""

import pathlib

import pytest
import torch

from trtllm_replayssm import tp
from trtllm_replayssm.cursor import advance_cursor
from trtllm_replayssm.families.mamba2 import reference as ref

from .helpers import end_rank, spawn_ranks
from .problems import make_inputs, make_params

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("H, P, N, G, tp_size", [
    (16, 64, 64, 8, 2),     # groups owned (G % tp == 0), the Nemotron case at small scale
    (16, 64, 64, 8, 4),
    (16, 64, 64, 1, 2),     # one group, replicated on both ranks
    (16, 64, 64, 2, 4),     # groups replicated: 8 heads per group, 4 per rank
    (256, 64, 128, 8, 2),   # Nemotron-3-Ultra Mamba geometry
    (128, 64, 128, 8, 2),   # Nemotron-H-8B
])
def test_tp_shards_equal_tp1(H, P, N, G, tp_size):
    L, batch, slots = 4, 2, 3
    gen = torch.Generator().manual_seed(H + G + tp_size)
    prm = make_params(H, gen)
    dt_bias, A, D = (t.double() for t in (prm.dt_bias, prm.A, prm.D))
    caches = [torch.randn(slots, H, P, N, generator=gen, dtype=F64), torch.zeros(slots, H, L, P, dtype=F64),
              torch.zeros(slots, G, L, N, dtype=F64), torch.zeros(slots, H, L, dtype=F64)]
    cursor = torch.zeros(slots, dtype=torch.int32)
    shards = tp.shard_plan(H, G, tp_size)
    local = [list(tp.shard_cache(s, *caches)) for s in shards]
    cursors = [cursor.clone() for _ in shards]
    W = torch.randn(32, H * P, generator=gen, dtype=F64)  # out_proj (hidden 32)
    sbi = torch.tensor([2, 0], dtype=torch.int32)
    for _ in range(3 * L + 2):
        x, B, C, dt, z = (None if t is None else t.to(F64) for t in make_inputs(batch, H, P, N, G, F64, gen, has_z=True))
        y = ref.replay_decode(*caches, cursor, x, B, C, dt, dt_bias, A, D, z, sbi)
        advance_cursor(cursor, sbi, L)
        ys, partials = [], []
        for s, lc, cur in zip(shards, local, cursors):
            xs, Bs, Cs, dts, zs = tp.shard_step(s, x, B, C, dt, z)
            yr = ref.replay_decode(*lc, cur, xs, Bs, Cs, dts, *tp.shard_params(s, dt_bias, A, D), zs, sbi)
            advance_cursor(cur, sbi, L)
            ys.append(yr)
            partials.append(yr.flatten(1) @ W[:, s.head0 * P:(s.head0 + s.nheads) * P].T)
        assert torch.equal(torch.cat(ys, dim=1), y)  # identical per-head arithmetic: bit-exact
        torch.testing.assert_close(tp.row_parallel_sum(partials), y.flatten(1) @ W.T, rtol=1e-12, atol=1e-12)
        for s, lc in zip(shards, local):  # the sharded caches are slices of the TP=1 caches
            assert torch.equal(lc[0], caches[0][:, s.heads]) and torch.equal(lc[1], caches[1][:, s.heads])
            assert torch.equal(lc[2], caches[2][:, s.groups]) and torch.equal(lc[3], caches[3][:, s.heads])
        assert all(torch.equal(c, cursor) for c in cursors)


def test_plan_errors_and_bytes():
    with pytest.raises(ValueError, match="divisible by tp=3"):
        tp.shard_plan(16, 8, 3)
    with pytest.raises(ValueError, match="straddle groups"):
        tp.shard_plan(12, 3, 2)  # 6 heads per rank, groups of 4 heads
    with pytest.raises(ValueError, match="tp: expected >= 1"):
        tp.shard_plan(16, 8, 0)
    s = tp.shard_plan(256, 8, 2)
    assert [(x.head0, x.nheads, x.group0, x.ngroups) for x in s] == [(0, 128, 0, 4), (128, 128, 4, 4)]
    full = tp.local_bytes_per_slot(tp.shard_plan(256, 8, 1)[0], 64, 128, 16)
    assert sum(tp.local_bytes_per_slot(x, 64, 128, 16) for x in s) == full


def _rank_main(rank, world, init_file, out_file, geometry):
    import importlib.util

    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("tp_decode", pathlib.Path(__file__).parent.parent / "scripts" / "tp_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    worst = mod.run(*geometry, device="cpu")
    if rank == 0:
        pathlib.Path(out_file).write_text(repr(worst))
    end_rank()


@pytest.mark.parametrize("world, geometry", [(2, (16, 64, 64, 8)), (2, (16, 64, 64, 1))])
def test_tp_decode_processes_all_reduce_to_tp1(tmp_path, world, geometry):
    """Two processes (gloo): each runs its shard, all_reduce of out_proj partials == TP=1 output."""
    outs = [tmp_path / f"worst{a}" for a in range(2)]
    attempt = spawn_ranks(_rank_main, lambda a: (world, str(tmp_path / f"rdzv{a}"), str(outs[a]), geometry), world)
    assert float(outs[attempt].read_text()) < 1e-12  # float64 on both sides
