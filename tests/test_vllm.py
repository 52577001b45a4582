# SPDX-License-Identifier: Apache-2.0
"""The vLLM adapter (serve/trtllm_replayssm_vllm, ``trtllm_replayssm_vllm``) on tensors laid out as vLLM lays them out.

Layout under test (vLLM v1 with --use-replayssm, Triton backend): one raw byte page per KV-cache block
holding conv, ssm, x_cache, dt_cache, B_cache back to back (plus padding up to an attention page), each
tensor a ``torch.as_strided`` view with the page as its block stride; activations are row-strided views
of the in-projection and conv outputs; A / D / dt_bias / dt are TIE_HDIM expansions; block 0 is the null
block of padding rows; write_pos per row from (computed - prompt) tokens, so rows flush at different steps.

Oracles: a float64 run of the reference on dense copies (ReplaySSM == the conventional recurrence is
test_reference.py's), every byte of every page outside the live rows' views unchanged, padding rows'
outputs untouched; on the GPU also bit-identity with the contiguous kernel (ops.replay_decode).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest
import torch

from trtllm_replayssm import config
from trtllm_replayssm import cursor as cursors
from trtllm_replayssm.compile import compile_spec
from trtllm_replayssm.config import KernelSpec, Layout
from trtllm_replayssm.families.mamba2 import ops
from trtllm_replayssm.families.mamba2 import reference as ref

from .problems import make_params

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "serve"))  # a checkout not installed
import trtllm_replayssm_vllm as vllm  # noqa: E402

F64 = torch.float64
POISON = 0xA5


class Pages(vllm.PagedLayer):
    """vllm.PagedLayer poisoned, with a random checkpoint and empty rings."""

    def __init__(self, blocks, H, P, N, G, L, K, act, state_dtype, pad_bytes, device):
        super().__init__(blocks, H, P, N, G, L, K, act, state_dtype, pad_bytes, device, fill=POISON)
        self.live_bytes = self.offsets["B_cache"][1]

    def fill(self, gen):
        """Random checkpoint values, zero rings; conv and pad bytes keep the poison."""
        s = self.views["ssm"]
        s.copy_((torch.randn(s.shape, generator=gen) * 0.5).to(s.dtype))
        for name in ("x_cache", "dt_cache", "B_cache"):
            self.views[name].zero_()

    def dense(self):
        return {k: v.clone().contiguous() for k, v in self.views.items()}


def activations(batch, H, P, N, G, act, gen, device):
    """x, B, C, z, dt as vLLM hands them to the SSM step: views of in_proj / conv outputs (row-strided)."""
    HP, GN = H * P, G * N
    proj = (torch.randn(batch, 2 * HP + 2 * GN + H, generator=gen)).to(act).to(device)  # [z | xBC | dt]
    xbc = (torch.randn(batch, HP + 2 * GN, generator=gen)).to(act).to(device)  # the conv output
    xbc[:, HP:] *= N ** -0.5 * 4
    z = proj[:, :HP].view(batch, H, P)
    x = xbc[:, :HP].view(batch, H, P)
    B = xbc[:, HP:HP + GN].view(batch, G, N)
    C = xbc[:, HP + GN:].view(batch, G, N)
    proj[:, -H:] = (proj[:, -H:].float() - 2.0).to(act)
    dt = proj[:, -H:]  # a row-strided view too
    dt_tied = dt[:, :, None].expand(batch, H, P)
    return x, B, C, z, dt_tied


def tied(prm, H, P, N, device):
    return (prm.A.to(device)[:, None, None].expand(H, P, N), prm.D.to(device)[:, None].expand(H, P),
            prm.dt_bias.to(device)[:, None].expand(H, P))


def run_steps(device, act, state_dtype, H, P, N, G, L, rows, prompt, steps, has_z, seed, blocks=9, pad=48,
              check_dense_kernel=False):
    """Decode ``steps`` steps through the adapter; compare every step with the float64 reference on dense
    copies (and, on CUDA, the contiguous kernel bit for bit); return the max relative error of y."""
    gen = torch.Generator().manual_seed(seed)
    pages = Pages(blocks, H, P, N, G, L, 4, act, state_dtype, pad, device)
    pages.fill(gen)
    d64 = {k: v.cpu().to(F64) for k, v in pages.dense().items()}
    dk = pages.dense() if check_dense_kernel else None
    prm = make_params(H, gen)
    A, D, dtb = tied(prm, H, P, N, device)
    sbi = torch.tensor(rows, dtype=torch.int32, device=device)
    prompt_t = torch.tensor(prompt, dtype=torch.int32)
    live = [r != vllm.NULL_BLOCK_ID for r in rows]
    untouched_before = pages.raw.clone()
    worst = 0.0
    for step in range(steps):
        computed = prompt_t + step
        wp = vllm.write_pos_from_positions(computed, prompt_t, L).to(device)
        x, B, C, z, dt = activations(len(rows), H, P, N, G, act, gen, device)
        zz = z if has_z else None
        out = torch.full((len(rows), H, P), 7.0, dtype=act, device=device)
        vllm.selective_state_update_replayssm(
            pages.views["ssm"], x, dt, A, B, C, D=D, dt_bias=dtb, z=zz, dt_softplus=True,
            x_cache=pages.views["x_cache"], dt_cache=pages.views["dt_cache"], B_cache=pages.views["B_cache"],
            write_pos=wp, is_flush=(wp == L - 1), max_cache_len=L, state_batch_indices=sbi, out=out)
        # float64 oracle on dense copies, per-slot cursor
        cur = torch.zeros(blocks, dtype=torch.int32)
        sb = torch.tensor([r if ok else -1 for r, ok in zip(rows, live)], dtype=torch.int32)
        for r, ok, w in zip(rows, live, wp.cpu().tolist()):
            if ok:
                cur[r] = w
        y64 = ref.replay_decode(d64["ssm"], d64["x_cache"], d64["B_cache"], d64["dt_cache"], cur,
                                x.cpu().to(F64), B.cpu().to(F64), C.cpu().to(F64), dt[:, :, 0].cpu().to(F64),
                                prm.dt_bias.to(F64), prm.A.to(F64), prm.D.to(F64),
                                z=None if zz is None else zz.cpu().to(F64), state_batch_indices=sb)
        # the mirror: the checkpoint the kernel stores (state dtype) and its fp32 dt ring
        d64["ssm"] = d64["ssm"].to(state_dtype).to(F64)
        d64["dt_cache"] = d64["dt_cache"].float().to(F64)
        yo = out.cpu()
        for i, ok in enumerate(live):
            if not ok:  # padding row: out untouched
                assert torch.equal(yo[i], torch.full_like(yo[i], 7.0)), f"step {step}: padding row {i} written"
        ly = torch.tensor(live)
        err = ((yo[ly].to(F64) - y64[ly]).norm() / y64[ly].norm()).item()
        worst = max(worst, err)
        if check_dense_kernel:
            yk = ops.replay_decode(x.contiguous(), B.contiguous(), C.contiguous(), dt[:, :, 0].contiguous(),
                                   prm.dt_bias.to(device), prm.A.to(device), prm.D.to(device), dk["ssm"],
                                   dk["x_cache"], dk["B_cache"], dk["dt_cache"], cur.to(device), sb.to(device),
                                   z=None if zz is None else zz.contiguous())
            assert torch.equal(yk[ly], out[ly]), f"step {step}: strided y differs from the contiguous kernel's"
            for k in ("ssm", "x_cache", "B_cache", "dt_cache"):
                used = [r for r, ok in zip(rows, live) if ok]
                assert torch.equal(dk[k][used], pages.views[k][used]), f"step {step}: {k} differs from contiguous"
    # every byte outside the live rows' state / ring views is as it was: conv, padding, other blocks
    keep = torch.ones(pages.raw.numel(), dtype=torch.bool)
    for r, ok in zip(rows, live):
        if ok:
            keep[r * pages.page + pages.offsets["ssm"][0]:r * pages.page + pages.live_bytes] = False
    keep = keep.to(device)
    assert torch.equal(pages.raw[keep], untouched_before[keep]), "bytes outside the live rows' views changed"
    # the adapter's state equals the float64 run's, rounded to the state dtype
    used = [r for r, ok in zip(rows, live) if ok]
    s64 = d64["ssm"][used]
    got = pages.views["ssm"][used].cpu().to(F64)
    assert ((got - s64).norm() / s64.norm()).item() < (2e-5 if state_dtype == torch.float32 else 8e-3)
    return worst


# ---- CPU: the translation itself (reference path on the same views) -----------------------------------
def test_cpu_adapter_matches_float64_reference_across_flushes():
    L = 4
    # rows: block 3, a padding row (null block 0), block 5, block 1; prompts of different lengths so
    # the rows flush at different steps
    err = run_steps("cpu", torch.float32, torch.float32, H=4, P=64, N=64, G=2, L=L, rows=[3, 0, 5, 1],
                    prompt=[7, 3, 2, 10], steps=3 * L + 2, has_z=True, seed=1)
    assert err < 1e-5


def test_write_pos_is_the_advanced_cursor():
    L = 8
    prompt = torch.tensor([5, 0, 13], dtype=torch.int32)
    cursor = torch.zeros(3, dtype=torch.int32)
    for step in range(3 * L):
        wp = vllm.write_pos_from_positions(prompt + step, prompt, L)
        assert torch.equal(wp, cursor), step
        cursors.advance_cursor(cursor, torch.arange(3, dtype=torch.int32), L)


def _args(device="cpu", batch=3, H=4, P=64, N=64, G=2, L=4, act=torch.bfloat16, blocks=5):
    gen = torch.Generator().manual_seed(3)
    pages = Pages(blocks, H, P, N, G, L, 4, act, torch.float32, 32, device)
    pages.fill(gen)
    x, B, C, z, dt = activations(batch, H, P, N, G, act, gen, device)
    A, D, dtb = tied(make_params(H, gen), H, P, N, device)
    return dict(state=pages.views["ssm"], x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dtb, z=z,
                x_cache=pages.views["x_cache"], dt_cache=pages.views["dt_cache"], B_cache=pages.views["B_cache"],
                write_pos=torch.zeros(batch, dtype=torch.int32), max_cache_len=L,
                state_batch_indices=torch.tensor([1, 2, 3][:batch], dtype=torch.int32))


@pytest.mark.parametrize("change, err, match", [
    (lambda a: a.update(x=a["x"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "x: expected dims 1.. contiguous"),
    (lambda a: a.update(state=torch.as_strided(a["state"], a["state"].shape, (100, *a["state"].stride()[1:]))),
     ValueError, "state: dim-0 stride 100 is below"),
    (lambda a: a.update(x_cache=torch.as_strided(a["x_cache"], a["x_cache"].shape,
                                                 (a["x_cache"].stride(0) + 4, *a["x_cache"].stride()[1:]))),
     ValueError, "x_cache: expected a dim-0 stride of a multiple of 16 bytes"),
    (lambda a: a.update(A=a["A"].contiguous() + torch.arange(a["A"].shape[2])), ValueError, "A: expected per-head values tied"),
    (lambda a: a.update(dt=a["dt"].contiguous()), ValueError, "dt: expected .* tied over headdim"),
    (lambda a: a.update(dt_cache=a["dt_cache"].to(torch.bfloat16)), TypeError, "dt_cache: expected dtype float32"),
    (lambda a: a.update(B=a["B"].float()), TypeError, "B: expected dtype bfloat16"),
    (lambda a: a.update(write_pos=torch.tensor([0, 4, 1], dtype=torch.int32)), ValueError,
     r"write_pos: expected values in \[0, 4\)"),
    (lambda a: a.update(write_pos=torch.zeros(3, dtype=torch.int64)), ValueError, "write_pos: expected a contiguous"),
    (lambda a: a.update(state_batch_indices=torch.tensor([1, 1, 3], dtype=torch.int32)), ValueError,
     "more than one row"),
    (lambda a: a.update(state_batch_indices=torch.tensor([1, 9, 3], dtype=torch.int32)), ValueError, r"blocks in \[0, 5\)"),
    (lambda a: a.update(is_flush=torch.tensor([True, False, False])), ValueError, "is_flush: expected write_pos == 3"),
    (lambda a: a.update(max_cache_len=16), ValueError, "max_cache_len: 16 differs"),
    (lambda a: a.update(dt_softplus=False), ValueError, "dt_softplus"),
    (lambda a: a.update(D=None), ValueError, "D: required"),
])
def test_bad_input_is_named(change, err, match):
    a = _args()
    change(a)
    with pytest.raises(err, match=match):
        vllm.selective_state_update_replayssm(**a)


def test_null_block_rows_are_padding_and_state_batch_indices_may_be_a_table():
    a = _args()
    table = torch.tensor([[1, 4], [0, 4], [3, 4]], dtype=torch.int32)  # (batch, T): column 0 is read
    a["state_batch_indices"] = table
    before = a["state"].clone()
    out = torch.full(a["x"].shape, 3.0, dtype=a["x"].dtype)
    vllm.selective_state_update_replayssm(**a, out=out)
    assert torch.equal(out[1], torch.full_like(out[1], 3.0))
    assert torch.equal(a["state"][[0, 2, 4]], before[[0, 2, 4]])
    assert not torch.equal(out[0], torch.full_like(out[0], 3.0))


def test_registered_op_runs_the_adapter():
    a = _args()
    out = torch.empty(a["x"].shape, dtype=a["x"].dtype)
    want = vllm.selective_state_update_replayssm(**{**a, "x_cache": a["x_cache"].clone(),
                                                      "B_cache": a["B_cache"].clone(),
                                                      "dt_cache": a["dt_cache"].clone(), "state": a["state"].clone()})
    torch.ops.trtllm_replayssm.vllm_mamba2_decode(a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"],
                                                  a["dt_bias"], a["x_cache"], a["dt_cache"], a["B_cache"],
                                                  a["write_pos"], a["state_batch_indices"], out, z=a["z"])
    assert torch.equal(out, want)



def test_registered_op_refuses_a_forced_flush_eagerly():
    """vLLM's is_flush reaches the registered op too: a forced flush (is_flush set where write_pos != L - 1) is
    refused eagerly, before anything is written (the op used to have no is_flush, so it was served silently)."""
    a = _args()
    before = {k: a[k].clone() for k in ("state", "x_cache", "B_cache", "dt_cache")}
    out = torch.full(a["x"].shape, 3.0, dtype=a["x"].dtype)
    op = torch.ops.trtllm_replayssm.vllm_mamba2_decode
    args = (a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], a["x_cache"], a["dt_cache"],
            a["B_cache"], a["write_pos"], a["state_batch_indices"], out)
    with pytest.raises(ValueError, match="is_flush: expected write_pos == 3"):
        op(*args, z=a["z"], is_flush=torch.tensor([1, 0, 0], dtype=torch.int32))
    assert all(torch.equal(a[k], v) for k, v in before.items())
    assert torch.equal(out, torch.full_like(out, 3.0))
    op(*args, z=a["z"], is_flush=torch.zeros(3, dtype=torch.int32))  # consistent flags: served
    assert not torch.equal(out, torch.full_like(out, 3.0))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_cpu_path_computes_wide_whatever_the_checkpoint_dtype(state_dtype):
    """A bf16 / fp16 checkpoint: the CPU path computes in float64 as the kernel computes in fp32, not in the
    checkpoint's dtype: the dt ring holds fp32 processed dt (the contract) and the fold is rounded to the
    checkpoint dtype once (it used to run the whole step in bf16 / fp16)."""
    H, P, N, G, L, act = 4, 16, 16, 2, 2, torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    pages = Pages(5, H, P, N, G, L, 4, act, state_dtype, 32, "cpu")
    pages.fill(gen)
    prm = make_params(H, gen)
    A, D, dtb = tied(prm, H, P, N, "cpu")
    sbi = torch.tensor([1, 3, 4], dtype=torch.int32)
    d64 = {k: v.to(F64) for k, v in pages.dense().items()}
    for step in range(L):  # the second step flushes
        x, B, C, z, dt = activations(3, H, P, N, G, act, gen, "cpu")
        wp = torch.full((3,), step, dtype=torch.int32)
        out = torch.empty(3, H, P, dtype=act)
        vllm.selective_state_update_replayssm(
            pages.views["ssm"], x, dt, A, B, C, D=D, dt_bias=dtb, z=z, x_cache=pages.views["x_cache"],
            dt_cache=pages.views["dt_cache"], B_cache=pages.views["B_cache"], write_pos=wp, max_cache_len=L,
            state_batch_indices=sbi, out=out)
        cur = torch.zeros(5, dtype=torch.int32)
        cur[sbi.long()] = wp
        y64 = ref.replay_decode(d64["ssm"], d64["x_cache"], d64["B_cache"], d64["dt_cache"], cur, x.to(F64),
                                B.to(F64), C.to(F64), dt[:, :, 0].to(F64), prm.dt_bias.to(F64), prm.A.to(F64),
                                prm.D.to(F64), z=z.to(F64), state_batch_indices=sbi)
        d64["dt_cache"] = d64["dt_cache"].float().to(F64)
        if step == 0:
            got = pages.views["dt_cache"][sbi.long(), :, 0].to(F64)
            want = d64["dt_cache"][sbi.long(), :, 0]
            assert torch.allclose(got, want, rtol=1e-6, atol=0), float(((got - want) / want).abs().max())
        assert ((out.to(F64) - y64).norm() / y64.norm()).item() < 4e-3  # y rounded to bf16 once
    s = pages.views["ssm"][sbi.long()]
    assert torch.equal(s, d64["ssm"][sbi.long()].to(state_dtype))

# ---- CPU: the strided module compiles (NVRTC) ----------------------------------------------------------
LAYOUT = Layout(slot_state=128 * 64 * 128 + 96, slot_x=128 * 16 * 64 + 48, slot_B=8 * 16 * 128 + 48,
                slot_dt=128 * 16 + 24, row_x=10240, row_B=10240, row_C=10240, row_dt=18560, row_z=18560,
                row_y=8192, row_sbi=2, null_slot=0)


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("variant", [config.Variant("one_shot", 5), config.Variant("persistent", 5),
                                     config.Variant("staged", 4, 2)], ids=["one_shot", "persistent", "staged"])
@pytest.mark.parametrize("has_z", [False, True])
def test_strided_module_compiles(arch, variant, has_z):
    rows, warps, _ = config.plan("f32", "bf16", 128, 64, 128, 16, 256)
    spec = KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, rows, warps, has_z, arch, variant, layout=LAYOUT)
    ptx = compile_spec(spec, "ptx").decode()
    assert ".entry replayssm_decode" in ptx
    assert spec.key.endswith(LAYOUT.key) and "_lay" not in dataclasses.replace(spec, layout=None).key


def test_layout_is_refused_where_unsupported():
    with pytest.raises(ValueError, match="layout"):
        KernelSpec("f32", "bf16", 128, 64, 128, 8, 16, 64, 8, shadow="bf16", layout=LAYOUT)
    with pytest.raises(ValueError, match="Layout.row_x"):
        Layout(1, 1, 1, 1, -1, 1, 1, 1, 1, 1)


# ---- GPU: the kernel on vLLM's layout ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("variant", [None, config.Variant("persistent", 5), config.Variant("staged", 4, 2)],
                         ids=["plan", "persistent", "staged"])
@pytest.mark.parametrize("geom", [
    # Nemotron-H-8B per-rank heads (H=128, P=64, N=128, G=8), L=16; an odd small one with P=80, N=256
    dict(H=128, P=64, N=128, G=8, L=16, act=torch.bfloat16, state=torch.float32, has_z=False),
    dict(H=6, P=80, N=256, G=3, L=8, act=torch.float16, state=torch.bfloat16, has_z=True),
], ids=["nemotronh", "odd"])
def test_gpu_kernel_on_vllm_layout(geom, variant):
    L = geom["L"]
    rows = [5, 0, 2, 7, 0, 1]  # two padding rows (null block 0)
    prompt = [3, 1, 11, 0, 6, 2 * L - 1]
    with config.override_variant(variant):  # None: the shipped plan
        err = run_steps("cuda", geom["act"], geom["state"], geom["H"], geom["P"], geom["N"], geom["G"], L, rows,
                        prompt, steps=3 * L + 1, has_z=geom["has_z"], seed=11, blocks=9, pad=80,
                        check_dense_kernel=True)
    assert err < {torch.bfloat16: 5e-3, torch.float16: 2e-3}[geom["act"]]


@pytest.mark.gpu
def test_gpu_large_batch_and_graph_capture():
    """bs 96 (the persistent kernel by plan) through the registered op inside a CUDA graph."""
    H, P, N, G, L, act = 32, 64, 128, 4, 16, torch.bfloat16
    batch, blocks = 96, 101
    gen = torch.Generator().manual_seed(5)
    pages = Pages(blocks, H, P, N, G, L, 4, act, torch.float32, 16, "cuda")
    pages.fill(gen)
    dense = pages.dense()
    prm = make_params(H, gen)
    A, D, dtb = tied(prm, H, P, N, "cuda")
    perm = torch.randperm(blocks - 1, generator=gen)[:batch] + 1
    sbi = perm.to(torch.int32).cuda()
    sbi[::17] = vllm.NULL_BLOCK_ID
    prompt = torch.randint(0, 50, (batch,), generator=gen, dtype=torch.int32)
    x, B, C, z, dt = activations(batch, H, P, N, G, act, gen, "cuda")
    wp = vllm.write_pos_from_positions(prompt + 5, prompt, L).cuda()
    out = torch.zeros(batch, H, P, dtype=act, device="cuda")
    op = torch.ops.trtllm_replayssm.vllm_mamba2_decode
    args = (pages.views["ssm"], x, dt, A, B, C, D, dtb, pages.views["x_cache"], pages.views["dt_cache"],
            pages.views["B_cache"], wp, sbi, out)
    # warm up on scratch copies (compile + load), then capture on the real pages
    op(*(a.clone() if i in (0, 8, 9, 10) else a for i, a in enumerate(args)))
    torch.cuda.synchronize()
    out.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(*args)
    g.replay()
    torch.cuda.synchronize()
    live = (sbi != vllm.NULL_BLOCK_ID)
    sb = torch.where(live, sbi, torch.full_like(sbi, -1))
    cur = torch.zeros(blocks, dtype=torch.int32, device="cuda")
    cur[sb[live].long()] = wp[live]
    yk = ops.replay_decode(x.contiguous(), B.contiguous(), C.contiguous(), dt[:, :, 0].contiguous(),
                           prm.dt_bias.cuda(), prm.A.cuda(), prm.D.cuda(), dense["ssm"], dense["x_cache"],
                           dense["B_cache"], dense["dt_cache"], cur, sb)
    assert torch.equal(out[live], yk[live])
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    for k in ("ssm", "x_cache", "B_cache", "dt_cache"):
        assert torch.equal(pages.views[k], dense[k]), k


# vLLM's selective_state_update_replayssm_triton (vllm/model_executor/layers/mamba/ops, read 2026-12-04): its
# parameters in order, so that a positional call site can switch to the adapter unchanged.
VLLM_PARAMS = ["state", "x", "dt", "A", "B", "C", "D", "dt_bias", "z", "dt_softplus", "x_cache", "dt_cache", "B_cache",
               "bc_pre", "write_pos", "is_flush", "max_cache_len", "state_batch_indices", "null_block_id", "out"]


def test_signature_follows_vllms():
    import inspect

    names = list(inspect.signature(vllm.selective_state_update_replayssm).parameters)
    assert names[:len(VLLM_PARAMS)] == VLLM_PARAMS
