# SPDX-License-Identifier: Apache-2.0
"""The flush-first row order (cursor.flush_order, the replayssm_flush_order kernel, KDASpec.row_order).

CPU: the host rule (a stable three-way partition: flushing rows, the other rows with a slot, the rest), the check of
a given order, and the launchers' errors before any launch. GPU (marker ``gpu``): the kernel against the host rule
bit for bit (batches of one tile and of several, padding rows, out-of-range slots unchecked, a poisoned output); the
KDA and Gated DeltaNet decode modules built with the order against the plain modules bit for bit (y, checkpoint,
every ring, the shadow, padding rows' NaN, unused slots) over a flush cycle at spread cursors, planned shapes
included (KDA's staged modules with two passes, GDN's two-pass shadow modules).
"""

import pytest
import torch

from trtllm_replayssm import cursor, cursor_ops
from trtllm_replayssm.families.gdn import ops as gops
from trtllm_replayssm.families.gdn.reference import GDNBuffers
from trtllm_replayssm.families.kda import ops as kops
from trtllm_replayssm.families.mamba2 import ops as mops

I32 = torch.int32


def test_flush_order_is_a_stable_three_way_partition():
    L = 4
    cur = torch.tensor([3, 0, 3, 1, 2, 3, 0, 3], dtype=I32)  # slots 0, 2, 5, 7 at L - 1: they flush
    sbi = torch.tensor([1, 2, -1, 0, 4, 9, 5, 3], dtype=I32)  # slot 9: out of range (8 slots)
    got = cursor.flush_order(cur, sbi, L)
    assert got.dtype == I32 and got.tolist() == [[1, 2, 3, 0], [3, 0, 3, 0], [6, 5, 3, 0],  # flushing, in row order
                                                 [0, 1, 0, 0], [4, 4, 2, 0], [7, 3, 1, 0],  # the other rows with a slot
                                                 [2, -1, 0, 0], [5, 9, 0, 0]]  # padding, out of range
    cursor.check_row_order(got, sbi, cur)
    assert cursor.flush_order(cur, sbi[:0], L).shape == (0, 4)
    same = torch.tensor([0, 1, 3], dtype=I32)  # nobody flushes: the identity order
    assert cursor.flush_order(cur, same, L)[:, 0].tolist() == [0, 1, 2]


def _col(o, j, x):
    o = o.clone()
    o[:, j] = x(o[:, j])
    return o


@pytest.mark.parametrize("bad, match", [
    (lambda o: o[:-1], r"shape \(5, 4\)"),
    (lambda o: o[:, :2], r"shape \(5, 4\)"),
    (lambda o: _col(o, 0, lambda c: c * 0), "each row 0..4 once"),
    (lambda o: _col(o, 1, lambda c: c.roll(1)), "row's slot"),
    (lambda o: _col(o, 2, lambda c: c + 1), "slot's cursor"),
    (lambda o: _col(o, 3, lambda c: c + 1), "slot's cursor"),
])
def test_check_row_order_names_what_is_wrong(bad, match):
    sbi, cur = torch.tensor([4, 0, -1, 2, 1], dtype=I32), torch.tensor([0, 3, 3, 0, 3], dtype=I32)
    order = cursor.flush_order(cur, sbi, 4)
    cursor.check_row_order(order, sbi, cur)
    with pytest.raises(ValueError, match=match):
        cursor.check_row_order(bad(order), sbi, cur)


def test_flush_order_launcher_rejects_by_name():
    cur, sbi = torch.zeros(6, dtype=I32), torch.tensor([0, 1, -1], dtype=I32)
    with pytest.raises(ValueError, match="buffer_len"):
        cursor_ops.flush_order(cur, sbi, 0)
    with pytest.raises(ValueError, match="buffer_len"):
        cursor_ops.flush_order(cur, sbi, True)
    with pytest.raises((ValueError, TypeError), match="out"):
        cursor_ops.flush_order(cur, sbi, 4, out=torch.zeros(3, 3, dtype=I32))
    with pytest.raises((ValueError, TypeError), match="out"):
        cursor_ops.flush_order(cur, sbi, 4, out=torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises((ValueError, TypeError), match="cursor"):
        cursor_ops.flush_order(cur.float(), sbi, 4)
    with pytest.raises(ValueError, match="cursor"):  # the rows' values, before the CUDA check
        cursor_ops.flush_order(torch.full((6,), 7, dtype=I32), sbi, 4)


def _kda_args(batch, slots=8, H=2, K=16, V=16, L=4, device="cpu", shadow=False):
    g = torch.Generator().manual_seed(0)
    act = torch.bfloat16
    q, k, f = (torch.randn(batch, H, K, generator=g).to(act) for _ in range(3))
    v, b = torch.randn(batch, H, V, generator=g).to(act), torch.randn(batch, H, generator=g).to(act)
    ring = torch.bfloat16 if shadow else torch.float32
    t = dict(q=q, k=k, v=v, f=f, b=b, A_log=torch.zeros(H), dt_bias=torch.zeros(H, K),
             state=torch.zeros(slots, H, K, V), k_cache=torch.zeros(slots, H, L, K, dtype=act),
             u_cache=torch.zeros(slots, H, L, V, dtype=ring), g_cache=torch.zeros(slots, H, L, K),
             v_cache=torch.zeros(slots, H, L, V, dtype=act), beta_cache=torch.zeros(slots, H, L),
             cursor=torch.zeros(slots, dtype=I32), state_batch_indices=torch.arange(batch, dtype=I32))
    if shadow:
        t["shadow"] = torch.zeros(slots, H, K, V, dtype=torch.bfloat16)
    return {n: x.to(device) for n, x in t.items()}


@pytest.mark.parametrize("bad, exc, match", [
    (lambda a: torch.zeros(3, 4, dtype=I32), ValueError, "row_order"),
    (lambda a: torch.zeros(4, 2, dtype=I32), ValueError, "row_order"),
    (lambda a: torch.zeros(4, 4, dtype=torch.int64), (ValueError, TypeError), "row_order"),
    (lambda a: torch.zeros(4, 4, dtype=I32), ValueError, "row_order: column 0"),
    (lambda a: torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0], [2, 3, 0, 0], [3, 2, 0, 0]], dtype=I32), ValueError,
     "row_order: column 1"),
    (lambda a: torch.tensor([[0, 0, 1, 0], [1, 1, 0, 0], [2, 2, 0, 0], [3, 3, 0, 0]], dtype=I32), ValueError,
     "row_order: columns 2, 3"),
])
def test_kda_decode_checks_row_order_before_launch(bad, exc, match):
    a = _kda_args(4)
    with pytest.raises(exc, match=match):
        kops.kda_replay_decode(**a, row_order=bad(a))
    good = cursor.flush_order(a["cursor"], a["state_batch_indices"], 4)
    with pytest.raises(ValueError, match="q: expected CUDA"):  # a valid order passes every check; stops at CUDA
        kops.kda_replay_decode(**a, row_order=good)


# ---- GPU ------------------------------------------------------------------------------------------------------
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("batch, slots, L", [(1, 1, 16), (7, 12, 4), (1000, 1400, 16), (1500, 2000, 8),
                                             (3000, 3100, 16)])
def test_flush_order_kernel_equals_the_host_rule(batch, slots, L):
    dev = _cuda()
    g = torch.Generator().manual_seed(batch)
    cur = torch.randint(0, L, (slots,), generator=g, dtype=I32)
    cur[torch.randperm(slots, generator=g)[: slots // 3]] = L - 1  # plenty of flushing rows
    sbi = torch.randperm(slots, generator=g)[:batch].to(I32)
    sbi[torch.rand(batch, generator=g) < 0.1] = -1  # padding rows
    want = cursor.flush_order(cur, sbi, L)
    out = torch.full((batch, cursor.ORDER_COLUMNS), -7, dtype=I32, device=dev)  # poisoned: every entry must be written
    got = cursor_ops.flush_order(cur.to(dev), sbi.to(dev), L, out=out)
    assert got is out and torch.equal(got.cpu(), want)
    bad = sbi.clone()
    bad[0] = slots + 5  # out of range, unchecked: placed with the padding rows, as the host rule does
    got = cursor_ops.flush_order(cur.to(dev), bad.to(dev), L, check_values=False)
    assert torch.equal(got.cpu(), cursor.flush_order(cur, bad, L))


def _equal_over_a_cycle(sides, sbi_d, batch, L, y_shape, inputs, launch, advance, seed):
    """Two copies of a decode problem (``sides``: name -> tensor, with "cursor") stepped L + 2 times at spread cursors:
    side 0 plain, side 1 behind the device's flush-first order (whose leading rows must be this step's flushing
    ones); ``inputs(g)`` a step's fresh inputs, ``launch(side, inputs, y, order)``, ``advance(side)``. Every y (NaN
    padding row included) and every state tensor equal bit for bit after every step, and every live row flushed."""
    g = torch.Generator().manual_seed(seed)
    seen = 0
    for step in range(L + 2):
        ins = inputs(g)
        ys = []
        for i, side in enumerate(sides):
            y = torch.full(y_shape, float("nan"), dtype=torch.bfloat16, device=sbi_d.device)
            order = cursor_ops.flush_order(side["cursor"], sbi_d, L) if i else None
            if i:  # this step's flushing rows lead the order
                live = sbi_d[sbi_d >= 0].long()
                flushing = int((side["cursor"][live] == L - 1).sum())
                lead = order[:flushing, 1].long()
                assert (lead >= 0).all() and (side["cursor"][lead] == L - 1).all(), step
                seen += flushing
            launch(side, ins, y, order)
            advance(side)
            ys.append(y)
        assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), step  # NaN rows included, bit for bit
        assert torch.isnan(ys[1][batch // 2].float()).all()
        for n in sides[0]:
            assert torch.equal(sides[0][n].view(torch.uint8), sides[1][n].view(torch.uint8)), (step, n)
    assert seen >= batch - 1  # every live row flushed at least once in L + 2 steps (cursors 0..L-1 at the start)


def _spread(slots, batch, L, g):
    """Rows over random slots with a padding row mid-batch, and row i's slot at cursor i mod L (the plain cursor)."""
    sbi = torch.randperm(slots, generator=g)[:batch].to(I32)
    sbi[batch // 2] = -1
    cur = torch.zeros(slots, dtype=I32)
    cur[sbi[sbi >= 0].long()] = torch.arange(int((sbi >= 0).sum()), dtype=I32) % L
    return sbi, cur


@pytest.mark.gpu
@pytest.mark.parametrize("geom, batch, shadow, lb", [
    ((2, 16, 16), 9, False, None), ((3, 48, 40), 11, True, -5.0),
    ((12, 128, 128), 256, True, None),  # Kimi-K3 TP8 bs256: the planned staged module with two passes
    ((8, 128, 128), 256, False, -5.0),  # GLM-5.3-Flash TP8 bs256: staged fp32
])
def test_kda_decode_with_row_order_equals_without(geom, batch, shadow, lb):
    """One flush cycle (L + 2 steps) at spread cursors (row i at cursor i mod L, some flushing every step), padding
    rows and unused slots: the module built with the flush-first order computes every tensor bit for bit as the plain
    module does."""
    dev = _cuda()
    H, K, V = geom
    L, slots = 16, batch + 5
    g = torch.Generator().manual_seed(batch)
    act = torch.bfloat16
    ring = torch.bfloat16 if shadow else torch.float32
    state = torch.randn(slots, H, K, V, generator=g) * 0.1
    base = dict(state=state, k_cache=torch.randn(slots, H, L, K, generator=g).to(act),
                u_cache=(torch.randn(slots, H, L, V, generator=g) * 0.1).to(ring),
                g_cache=-torch.rand(slots, H, L, K, generator=g) * 0.3,
                v_cache=torch.randn(slots, H, L, V, generator=g).to(act), beta_cache=torch.rand(slots, H, L, generator=g))
    if shadow:
        base["shadow"] = state.to(torch.bfloat16)
    sbi, cur = _spread(slots, batch, L, g)
    A_log = torch.log(torch.rand(H, generator=g) * 15 + 1).to(dev)
    dt_bias = (torch.randn(H, K, generator=g) * 0.5 - 3).to(dev)
    sides = [{n: t.clone().to(dev) for n, t in base.items()} | {"cursor": cur.clone().to(dev)} for _ in range(2)]
    sbi_d = sbi.to(dev)

    def inputs(g):
        q, k, f = (torch.randn(batch, H, K, generator=g).to(act).to(dev) for _ in range(3))
        return q, k, torch.randn(batch, H, V, generator=g).to(act).to(dev), f, \
            torch.randn(batch, H, generator=g).to(act).to(dev)

    def launch(side, ins, y, order):
        kops.kda_replay_decode(*ins, A_log, dt_bias, side["state"], side["k_cache"], side["u_cache"], side["g_cache"],
                               side["v_cache"], side["beta_cache"], side["cursor"], sbi_d, out=y,
                               shadow=side.get("shadow"), lower_bound=lb, row_order=order)

    _equal_over_a_cycle(sides, sbi_d, batch, L, (batch, H, V), inputs, launch,
                        lambda side: kops.advance_cursor(side["cursor"], sbi_d, side["u_cache"]), batch)


# ---- the cache: which launches get the order, and how often (CPU tensors, the kernel executor, emulated launchers)
def _emulated_cache(monkeypatch, family, geometry, layers, slots, decode_name, **kw):
    """A standard-cursor cache of ``family`` on CPU tensors with the kernel executor, whose order and decode
    launchers are emulated: the order by the host rule, the decode recording the order it was given."""
    from trtllm_replayssm.backend import KernelBackend
    from trtllm_replayssm.cache import ReplayStateCache

    calls = {"order": 0, "decode": []}

    def flush_order(cur, sbi, L, out=None, check_values=None):
        calls["order"] += 1
        return out.copy_(cursor.flush_order(cur, sbi, L))

    def decode(*args, row_order=None, out=None, **kws):  # y has the shape of x (Mamba-2) or v (GDN, KDA)
        calls["decode"].append(None if row_order is None else row_order.clone())
        return torch.zeros_like(args[0 if family == "mamba2" else 2]) if out is None else out

    monkeypatch.setattr(cursor_ops, "flush_order", flush_order)
    monkeypatch.setattr(cursor_ops, "advance_cursor",
                        lambda cur, sbi, L, check_values=None, flushes=None: cursor.advance_cursor(cur, sbi, L))
    monkeypatch.setattr({"kda": kops, "gdn": gops, "mamba2": mops}[family], decode_name, decode)
    sh = kw.get("shadow_dtype") is not None
    cache = ReplayStateCache.for_family(family, layers, slots, geometry, 4, cursor="standard", conv_kernel=4,
                                        read_shadow=sh, executor=KernelBackend(), check_values=False, **kw)
    return cache, calls


def _ordered_cache(monkeypatch, shadow, **kw):
    return _emulated_cache(monkeypatch, "kda", (2, 16, 16), 3, 6, "kda_replay_decode", shadow_dtype=shadow, **kw)


def _steps(cache, steps=6):
    sbi = torch.tensor([cache.allocate() for _ in range(3)] + [-1], dtype=I32)
    cache.cursor[sbi[:3].long()] = torch.tensor([3, 1, 2], dtype=I32)  # slot 0 flushes first, at step 0
    orders = []
    for _ in range(steps):
        cache.flush(sbi, 1)
        for layer in range(3):
            x = torch.zeros(4, 1, 2, 16, dtype=torch.bfloat16)
            cache.verify(layer, x, x, x, x, torch.zeros(4, 1, 2, dtype=torch.bfloat16), torch.zeros(2),
                         torch.zeros(2, 16), sbi)
        orders.append(cursor.flush_order(cache.cursor, sbi, 4))
        cache.commit(sbi, None, 1)
    return orders


@pytest.mark.parametrize("shadow, row_order, want", [(torch.bfloat16, None, True), (None, None, False),
                                                     (torch.bfloat16, False, False), (None, True, True)])
def test_cache_orders_the_kda_decode_where_it_pays(monkeypatch, shadow, row_order, want):
    """row_order None: the KDA layers with a bf16 shadow read the order (measured to pay), those without do not;
    True / False force it. One order launch a step for all layers, each layer given this step's order."""
    cache, calls = _ordered_cache(monkeypatch, shadow, row_order=row_order)
    orders = _steps(cache)
    assert calls["order"] == (6 if want else 0)
    assert len(calls["decode"]) == 18
    if want:
        for step, want_order in enumerate(orders):
            for layer in range(3):
                assert torch.equal(calls["decode"][3 * step + layer], want_order), (step, layer)
        assert calls["decode"][0][0].tolist() == [0, 0, 3, 0]  # slot 0 (cursor L - 1) leads the first step
    else:
        assert all(o is None for o in calls["decode"])


def test_cache_row_order_option_is_checked():
    from trtllm_replayssm.cache import ReplayStateCache

    with pytest.raises(TypeError, match="row_order"):
        ReplayStateCache.for_family("kda", 1, 2, (2, 16, 16), 4, cursor="standard", row_order=1)
    with pytest.raises(ValueError, match="row_order: .*cursor='ring'"):
        ReplayStateCache.for_family("kda", 1, 2, (2, 16, 16), 4, cursor="ring", row_order=True)
    with pytest.raises(ValueError, match="row_order: .*KDA layers.*Mamba-2 layers with a shadow or an 8-bit"):
        ReplayStateCache.for_family("mamba2", 1, 2, (2, 16, 16, 1), 4, cursor="standard", row_order=True)
    # the float64 reference executor (CPU) takes the option and needs no order
    c = ReplayStateCache.for_family("kda", 1, 2, (2, 16, 16), 4, cursor="standard", row_order=True,
                                    state_dtype=torch.float64, act_dtype=torch.float64, dt_dtype=torch.float64)
    assert c.row_order is True and not c.uses_kernels
    # the default: where it was measured to pay
    assert ReplayStateCache.for_family("kda", 1, 2, (2, 16, 16), 4, cursor="standard").row_order is None


@pytest.mark.gpu
@pytest.mark.parametrize("geom, batch, shadow", [
    ((4, 2, 64, 64), 9, False), ((6, 3, 128, 128), 11, True),
    ((32, 16, 128, 128), 64, True),  # Qwen3-Next TP1 bs64: the planned shadow module
    ((32, 16, 128, 128), 256, False),  # bs256 fp32
])
def test_gdn_decode_with_row_order_equals_without(geom, batch, shadow):
    """The GDN standard decode module built with the flush-first order computes every tensor bit for bit as the
    plain module does, over L + 2 steps at spread cursors with a padding row and unused slots."""
    dev = _cuda()
    HV, H, V, K = geom
    L, slots = 16, batch + 3
    g = torch.Generator().manual_seed(batch + 1)
    act = torch.bfloat16
    buf = GDNBuffers.alloc(slots, HV, H, V, K, L, act=act)
    buf.state.copy_(torch.randn(slots, HV, V, K, generator=g) * 0.1)
    buf.u_cache.copy_(torch.randn(slots, HV, L, V, generator=g) * 0.1)
    buf.v_cache.copy_(torch.randn(slots, HV, L, V, generator=g))
    buf.k_cache.copy_(torch.nn.functional.normalize(torch.randn(slots, H, L, K, generator=g), dim=-1))
    buf.g_cache.copy_(-torch.rand(slots, HV, L, generator=g) * 0.3)
    buf.beta_cache.copy_(torch.rand(slots, HV, L, generator=g))
    base = {n: getattr(buf, n) for n in ("state", "u_cache", "v_cache", "k_cache", "g_cache", "beta_cache")}
    if shadow:
        base["shadow"] = buf.state.to(torch.bfloat16)
    sbi, cur = _spread(slots, batch, L, g)
    A_log = torch.log(torch.rand(HV, generator=g) * 15 + 1).to(dev)
    dt_bias = (torch.randn(HV, generator=g) * 0.5 - 3).to(dev)
    sides = [{n: t.clone().to(dev) for n, t in base.items()} | {"cursor": cur.clone().to(dev)} for _ in range(2)]
    sbi_d = sbi.to(dev)

    def inputs(g):
        q, k = (torch.randn(batch, H, K, generator=g).to(act).to(dev) for _ in range(2))
        v = torch.randn(batch, HV, V, generator=g).to(act).to(dev)
        a, b = (torch.randn(batch, HV, generator=g).to(act).to(dev) for _ in range(2))
        return q, k, v, a, b

    def launch(side, ins, y, order):
        gops.gdn_replay_decode(*ins, A_log, dt_bias, side["state"], side["u_cache"], side["v_cache"], side["k_cache"],
                               side["g_cache"], side["beta_cache"], side["cursor"], sbi_d, out=y,
                               shadow=side.get("shadow"), row_order=order)

    _equal_over_a_cycle(sides, sbi_d, batch, L, (batch, HV, V), inputs, launch,
                        lambda side: gops.advance_cursor(side["cursor"], sbi_d, side["u_cache"]), batch + 1)


# ---- Mamba-2 (KernelSpec.row_order: the one-shot and staged kernels) ----------------------------------------------
def _mamba2_args(batch, slots=6, H=2, P=64, N=128, G=1, L=4, device="cpu"):
    from trtllm_replayssm.problems import make_inputs, make_params

    g = torch.Generator().manual_seed(3)
    x, B, C, dt, _ = make_inputs(batch, H, P, N, G, torch.bfloat16, g, device)
    prm = make_params(H, g, device)
    return dict(x=x, B=B, C=C, dt=dt, dt_bias=prm.dt_bias, A=prm.A, D=prm.D,
                state=torch.zeros(slots, H, P, N, device=device),
                x_cache=torch.zeros(slots, H, L, P, dtype=torch.bfloat16, device=device),
                B_cache=torch.zeros(slots, G, L, N, dtype=torch.bfloat16, device=device),
                dt_cache=torch.zeros(slots, H, L, device=device), cursor=torch.zeros(slots, dtype=I32, device=device),
                state_batch_indices=torch.arange(batch, dtype=I32, device=device))


@pytest.mark.parametrize("bad, exc, match", [
    (lambda a: torch.zeros(3, 4, dtype=I32), ValueError, "row_order"),
    (lambda a: torch.zeros(2, 3, dtype=I32), ValueError, "row_order"),
    (lambda a: torch.zeros(2, 4, dtype=torch.int64), TypeError, "row_order"),
    (lambda a: torch.zeros(2, 4, dtype=I32), ValueError, "row_order: column 0"),
    (lambda a: torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0]], dtype=I32), ValueError, "row_order: column 1"),
    (lambda a: torch.tensor([[1, 1, 0, 0], [0, 0, 2, 0]], dtype=I32), ValueError, "row_order: columns 2, 3"),
])
def test_mamba2_decode_checks_row_order_before_launch(bad, exc, match):
    """The Mamba-2 launcher checks the order's shape, dtype and (check_values) rows before it needs CUDA."""
    a = _mamba2_args(2)
    with pytest.raises(exc, match=match):
        mops.replay_decode(**a, check_values=True, row_order=bad(a))


@pytest.mark.gpu
@pytest.mark.parametrize("geom, batch, shadow, state", [
    ((2, 64, 128, 1), 9, "bf16", "f32"), ((3, 64, 128, 1), 3, "none", "f32"),  # fp32 at batch <= 4: staged
    ((4, 64, 128, 2), 11, "fp8", "f32"), ((4, 64, 128, 2), 11, "none", "fp8"),  # the fp8 shadow, the 8-bit checkpoint
    ((128, 64, 128, 8), 32, "bf16", "f32"),  # Nemotron-H 8B bs32: the planned bf16-shadow module
    ((128, 64, 128, 8), 256, "bf16", "f32"),
])
def test_mamba2_decode_with_row_order_equals_without(geom, batch, shadow, state):
    """The Mamba-2 standard decode module built with the flush-first order computes every tensor bit for bit as the
    plain module does (y with its padding row, checkpoint, rings, shadow and scales, an 8-bit checkpoint's scales and
    flush counts), over L + 2 steps at spread cursors with a padding row and unused slots."""
    from trtllm_replayssm.problems import make_inputs, make_params

    dev = _cuda()
    H, P, N, G = geom
    L, slots = 16, batch + 3
    g = torch.Generator().manual_seed(batch + 2)
    act = torch.bfloat16
    fp32 = torch.randn(slots, H, P, N, generator=g) * 0.1
    base = dict(x_cache=torch.randn(slots, H, L, P, generator=g).to(act),
                B_cache=(torch.randn(slots, G, L, N, generator=g) * N ** -0.5 * 4).to(act),
                dt_cache=torch.rand(slots, H, L, generator=g) * 0.05)
    scale = fp32.abs().amax(-1).clamp_min(1e-6) / 448
    if state == "fp8":  # an 8-bit checkpoint: e4m3 rows with fp32 row scales, flush counts
        base |= dict(state=(fp32 / scale[..., None]).to(torch.float8_e4m3fn), ckpt_scale=scale,
                     ckpt_flushes=torch.zeros(slots, dtype=I32))
    else:
        base["state"] = fp32
        if shadow == "bf16":
            base["shadow"] = fp32.to(torch.bfloat16)
        elif shadow == "fp8":
            base |= dict(shadow=(fp32 / scale[..., None]).to(torch.float8_e4m3fn), shadow_scale=scale)
    extra = dict(ckpt_seed=7) if state == "fp8" else {}
    sbi, cur = _spread(slots, batch, L, g)
    prm = make_params(H, g, dev)
    sides = [{n: t.clone().to(dev) for n, t in base.items()} | {"cursor": cur.clone().to(dev)} for _ in range(2)]
    sbi_d = sbi.to(dev)

    def launch(side, ins, y, order):
        x, B, C, dt, _ = ins
        mops.replay_decode(x, B, C, dt, prm.dt_bias, prm.A, prm.D, side["state"], side["x_cache"], side["B_cache"],
                           side["dt_cache"], side["cursor"], sbi_d, out=y, shadow=side.get("shadow"),
                           shadow_scale=side.get("shadow_scale"), ckpt_scale=side.get("ckpt_scale"),
                           ckpt_flushes=side.get("ckpt_flushes"), row_order=order, **extra)

    _equal_over_a_cycle(sides, sbi_d, batch, L, (batch, H, P), lambda g: make_inputs(batch, H, P, N, G, act, g, dev),
                        launch, lambda side: cursor_ops.advance_cursor(side["cursor"], sbi_d, L,
                                                                       flushes=side.get("ckpt_flushes")), batch + 2)


def _gdn_layer_inputs():
    x = torch.zeros(3, 1, 2, 16, dtype=torch.bfloat16)
    gate = torch.zeros(3, 1, 4, dtype=torch.bfloat16)
    return x, x, torch.zeros(3, 1, 4, 16, dtype=torch.bfloat16), gate, gate, torch.zeros(4), torch.zeros(4)


def _mamba2_layer_inputs():
    bc = torch.zeros(3, 1, 1, 16, dtype=torch.bfloat16)
    return (torch.zeros(3, 1, 2, 16, dtype=torch.bfloat16), bc, bc, torch.zeros(3, 1, 2, dtype=torch.bfloat16),
            torch.zeros(2), -torch.ones(2), torch.ones(2), None)


@pytest.mark.parametrize("family, geometry, decode_name, layer_inputs", [
    ("gdn", (4, 2, 16, 16), "gdn_replay_decode", _gdn_layer_inputs),
    ("mamba2", (2, 16, 16, 1), "replay_decode", _mamba2_layer_inputs),
])
def test_cache_orders_the_decode_with_a_bf16_shadow(monkeypatch, family, geometry, decode_name, layer_inputs):
    """The GDN and Mamba-2 layer groups read the same order (row_order None: with a bf16 shadow), one launch a
    step: the flushing row first, padding last."""
    cache, calls = _emulated_cache(monkeypatch, family, geometry, 2, 4, decode_name, shadow_dtype=torch.bfloat16,
                                   row_order=None)
    sbi = torch.tensor([cache.allocate(), -1, cache.allocate()], dtype=I32)
    cache.cursor[sbi[2].long()] = 3  # row 2 flushes at step 0
    for _ in range(5):
        cache.flush(sbi, 1)
        for layer in range(2):
            cache.verify(layer, *layer_inputs(), sbi)
        cache.commit(sbi, None, 1)
    assert calls["order"] == 5 and len(calls["decode"]) == 10
    assert calls["decode"][0].tolist() == [[2, 1, 3, 0], [0, 0, 0, 0], [1, -1, 0, 0]]


@pytest.mark.parametrize("kw, reads", [(dict(), False), (dict(shadow_dtype=torch.bfloat16), True),
                                       (dict(shadow_dtype=torch.float8_e4m3fn), True),
                                       (dict(state_dtype=torch.float8_e4m3fn), True)])
def test_mamba2_group_reads_the_order_where_its_kernels_do(kw, reads):
    """Mamba-2's one-shot and staged kernels read the order: a shadow or an 8-bit checkpoint always runs them; an fp32
    checkpoint without one runs the persistent kernel above batch 4, so its group reads none (row_order True is
    refused there by name). The default orders where measured to pay: an fp8 shadow, a bf16 one up to batch 64."""
    from trtllm_replayssm.cache import ReplayStateCache

    c = ReplayStateCache.for_family("mamba2", 1, 2, (2, 16, 16, 1), 4, cursor="standard", **kw)
    g = c.groups[0]
    assert g.reads_row_order is reads
    sh = kw.get("shadow_dtype")
    assert [g.row_order_pays(b) for b in (1, 64, 65, 256)] == ([True, True, False, False] if sh == torch.bfloat16
                                                              else [sh is not None] * 4)
    if reads:
        assert ReplayStateCache.for_family("mamba2", 1, 2, (2, 16, 16, 1), 4, cursor="standard", row_order=True,
                                           **kw).row_order is True
