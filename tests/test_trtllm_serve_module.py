# SPDX-License-Identifier: Apache-2.0
"""The trtllm-serve custom module (serve/trtllm_replayssm_module): adapter logic on the CPU.

tensorrt_llm cannot be installed here, so the module is driven through a stand-in of the two
TensorRT-LLM call sites it patches, written from their source (see the module docstring):
``Mamba2Mixer`` stores ``selective_state_update_func`` in ``__init__`` and calls it in decode with
TRT-LLM's arguments (x (b, h, p); dt fp32 repeated over head_dim; A (h, p, n), dt_bias and D (h, p)
broadcasts; B, C (b, g, n); ``state_batch_indices`` with -1 padding; a preallocated ``out``), and
writes ``ssm_states[state_indices_p]`` in prefill; ``NemotronHModel`` builds one layer per letter of
``hybrid_override_pattern`` (``layer_idx`` = the position; "M" Mamba2Mixer, "E" NemotronHMOE in
Nemotron 3, "*" attention, "-" MLP: the stand-ins of the last three run but never call the SSM
update) and ``forward`` runs the layers of a step. Patterns: a Nemotron-H one (``M*M``) and the
tiny Nemotron 3 one (``MEM*EM*E``, Mamba layers 0, 2, 5).

Oracle: the same stand-in left unpatched, whose ``selective_state_update_func`` is the conventional
Mamba-2 step written out per (head, dim) like TRT-LLM's native kernel without tie_hdim (not our
reference), in float64. Both sides run in float64 on identical inputs; the ReplaySSM side reorganises
the sums (exp(c_k - c_j) products vs repeated multiplication), so agreement is ~1e-13 relative and the
1e-10 tolerance (as in test_reference.py) leaves room over 3L+ steps. Parameters are fp32 values
(TRT-LLM keeps A, D, dt_bias in fp32 and the adapter passes them on as fp32). Bookkeeping (padding
rows of ``out``, slots no request uses, cursors) is compared exactly.

The registration route is driven through a stand-in ``tensorrt_llm`` module tree put in
``sys.modules`` (as tests/test_trt_plugin.py does for tensorrt.plugin): a model registry with the
documented behaviour of both versions read (2025: last registration wins; 2026 lazy zoo: built-in
modules fill only empty slots, external ones overwrite, the driver exports them to workers by module
name and a worker imports that module on lookup), a NemotronHForCausalLM / NemotronHModel with one
layer per pattern letter, and mixers with and without the hooked call. Tests that need the real
tensorrt_llm skip, saying why.
"""

from __future__ import annotations

import math
import pathlib
import re
import sys
import types

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "serve"))
import trtllm_replayssm_module as mod  # noqa: E402
from trtllm_replayssm_module import ReplaySSMAdapter, patch_classes, uninstall  # noqa: E402

F64 = torch.float64
SENTINEL = 123.25


# ---- the oracle: TRT-LLM's selective_state_update semantics, per (head, dim) ---------------------------
def conventional_ssu(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None, pad_slot_id=-1, out=None):
    H = x.shape[1]
    rep = H // B.shape[1]
    dtf = dt + dt_bias if dt_bias is not None else dt.clone()  # (b, h, p)
    if dt_softplus:
        dtf = torch.where(dtf > 20.0, dtf, torch.log1p(torch.exp(dtf)))
    for b, s in enumerate(state_batch_indices.tolist()):
        if s == pad_slot_id:
            continue
        Bh, Ch = B[b].repeat_interleave(rep, 0), C[b].repeat_interleave(rep, 0)  # (h, n)
        dA = torch.exp(A * dtf[b][:, :, None])  # (h, p, n)
        state[s] = state[s] * dA + (dtf[b] * x[b])[:, :, None] * Bh[:, None, :]
        y = (state[s] * Ch[:, None, :]).sum(-1)
        if D is not None:
            y = y + x[b] * D
        if z is not None:
            y = y * z[b] * torch.sigmoid(z[b])
        out[b] = y
    return out


# ---- stand-in of the two TRT-LLM call sites ----------------------------------------------------------
def make_fake_trtllm():
    class Mamba2Mixer:
        def __init__(self, *, layer_idx, A, D, dt_bias, head_dim, d_state):
            self.layer_idx, self.head_dim = layer_idx, head_dim
            self.selective_state_update_func = conventional_ssu
            H = A.shape[0]
            # post_load_weights: repeat(A, "h -> h p n"), repeat(dt_bias / D, "h -> h p") (views, stride 0)
            self._A_expanded = A[:, None, None].expand(H, head_dim, d_state)
            self._dt_bias_expanded = dt_bias[:, None].expand(H, head_dim)
            self._D_expanded = D[:, None].expand(H, head_dim)

        def forward(self, md):
            n_p, n_d = md.num_contexts, md.num_seqs - md.num_contexts
            si_p, si_d = torch.split(md.mamba_metadata.state_indices[:n_p + n_d], [n_p, n_d])
            ssm = md.ssm_states[self.layer_idx]
            inp = md.inputs[self.layer_idx]
            if n_p:
                ssm[si_p.long()] = inp["prefill_state"]
            if n_d:
                dt_d = inp["dt"][:, :, None].expand(n_d, inp["dt"].shape[1], self.head_dim)
                self.selective_state_update_func(
                    ssm, inp["x"].contiguous(), dt_d, self._A_expanded, inp["B"].contiguous(), inp["C"].contiguous(),
                    self._D_expanded, z=None, dt_bias=self._dt_bias_expanded, dt_softplus=True,
                    state_batch_indices=si_d, out=md.out[self.layer_idx].view(n_d, -1, self.head_dim))

    class NemotronHModel:
        def __init__(self, mixers, pattern=None):
            self.mixers = mixers
            if pattern is not None:  # NemotronHModel reads it from model_config.pretrained_config
                self.model_config = types.SimpleNamespace(
                    pretrained_config=types.SimpleNamespace(hybrid_override_pattern=pattern))

        def forward(self, attn_metadata, input_ids=None):
            for m in self.mixers:
                m.forward(attn_metadata)

    return Mamba2Mixer, NemotronHModel


class OtherMixer:
    """Stand-in of NemotronHMOE ("E"), TransformerLayer ("*"), MLPLayer ("-"): runs, no SSM update."""

    def __init__(self, layer_idx, kind):
        self.layer_idx, self.kind, self.calls = layer_idx, kind, 0

    def forward(self, md):
        self.calls += 1


def build_model(mixer_cls, model_cls, pattern, prm, P, N):
    """NemotronHModel of ``pattern`` as TRT-LLM builds it: layer i gets layer_idx i; prm[i] for each "M"."""
    mixers = [mixer_cls(layer_idx=i, head_dim=P, d_state=N, **prm[i]) if c == "M" else OtherMixer(i, c)
              for i, c in enumerate(pattern)]
    return model_cls(mixers, pattern)


@pytest.fixture
def fake_trtllm():
    mixer_cls, model_cls = make_fake_trtllm()
    yield mixer_cls, model_cls
    uninstall()


def fp32_params(H, gen):
    dt0 = torch.exp(torch.rand(H, generator=gen, dtype=F64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
    A = -torch.exp(torch.log(torch.rand(H, generator=gen, dtype=F64) * 15 + 1))
    D = torch.randn(H, generator=gen, dtype=F64) * 0.5 + 1.0
    return {k: v.float().double() for k, v in dict(A=A, D=D, dt_bias=dt_bias).items()}



def step_inputs(gen, layers, n_prefill: int, n_decode: int, H: int, P: int, N: int, G: int) -> dict:
    """Fresh float64 inputs of one step per layer: prefill states, and x, B, C, dt of the decode rows."""
    return {i: dict(prefill_state=torch.randn(n_prefill, H, P, N, generator=gen, dtype=F64),
                    x=torch.randn(n_decode, H, P, generator=gen, dtype=F64),
                    B=torch.randn(n_decode, G, N, generator=gen, dtype=F64) * N ** -0.5 * 4,
                    C=torch.randn(n_decode, G, N, generator=gen, dtype=F64) * N ** -0.5 * 4,
                    dt=torch.randn(n_decode, H, generator=gen, dtype=F64) - 2.0) for i in layers}

def metadata(state_indices, num_contexts, ssm_states, inputs, H, P):
    n_d = len(state_indices) - num_contexts
    out = {i: torch.full((n_d, H * P), SENTINEL, dtype=F64) for i in inputs}
    return types.SimpleNamespace(num_contexts=num_contexts, num_seqs=len(state_indices),
                                 mamba_metadata=types.SimpleNamespace(
                                     state_indices=torch.tensor(state_indices, dtype=torch.int32)),
                                 ssm_states=ssm_states, inputs=inputs, out=out)


# A schedule crossing flushes: (prefill slots, decode slots) per step. Slot 0's request finishes after
# step 5; a new request is prefilled into slot 0 in two chunks (steps 7, 8) and decodes from step 9.
# Slots 1, 2, 4, 6 are never used; one padding row (-1) rides along in every decode batch.
L = 4


def schedule(steps):
    plan = [([3, 0, 5], [])]
    for t in range(1, steps):
        dec = [3, 5] + ([0] if t <= 5 or t >= 9 else [])
        pre = [0] if t in (7, 8) else []
        plan.append((pre, dec))
    return plan


@pytest.mark.parametrize("G, pattern", [(2, "M*M"), (1, "M*M"), (4, "M*M"), (2, "MEM*EM*E")])
def test_adapter_equals_conventional_through_the_trtllm_call_sites(fake_trtllm, G, pattern):
    mixer_cls, model_cls = fake_trtllm
    H, P, N, S = 4, 8, 16, 7
    layers = tuple(mod.mamba_layer_indices(pattern))
    steps = 3 * L + 3
    gen = torch.Generator().manual_seed(G)
    prm = {i: fp32_params(H, gen) for i in layers}
    oracle = [mixer_cls(layer_idx=i, head_dim=P, d_state=N, **prm[i]) for i in layers]  # built before patching
    adapter = patch_classes(mixer_cls, model_cls, ReplaySSMAdapter(buffer_len=L))
    model = build_model(mixer_cls, model_cls, pattern, prm, P, N)
    mamba = [m for m in model.mixers if isinstance(m, mixer_cls)]
    assert [m.layer_idx for m in mamba] == list(layers)
    assert all(m.selective_state_update_func.func is mod.replay_selective_state_update for m in mamba)

    init = {i: torch.randn(S, H, P, N, generator=gen, dtype=F64) for i in layers}
    ssm_rep = {i: init[i].clone() for i in layers}
    ssm_conv = {i: init[i].clone() for i in layers}
    flushed_at_zero = 0
    for t, (pre, dec) in enumerate(schedule(steps)):
        rows = [dec[j] for j in torch.randperm(len(dec), generator=gen).tolist()] if dec else []
        if rows:
            rows.insert(int(torch.randint(len(rows) + 1, (1,), generator=gen)), -1)  # padding row
        nd = len(rows)
        inputs = step_inputs(gen, layers, len(pre), nd, H, P, N, G)
        md_rep = metadata(pre + rows, len(pre), ssm_rep, inputs, H, P)
        md_conv = metadata(pre + rows, len(pre), ssm_conv, inputs, H, P)
        model.forward(md_rep)
        for m in oracle:
            m.forward(md_conv)
        if not rows:
            continue
        pad = rows.index(-1)
        valid = [b for b in range(nd) if b != pad]
        for i in layers:
            y_rep, y_conv = md_rep.out[i], md_conv.out[i]
            assert torch.equal(y_rep[pad], torch.full_like(y_rep[pad], SENTINEL))  # padding row untouched
            err = (y_rep[valid] - y_conv[valid]).norm() / y_conv[valid].norm()
            assert err < 1e-10, (t, i, float(err))
            for s in dec:  # the state checkpoint + buffer stand for is the conventional state
                assert torch.allclose(adapter.current_state(i, s), ssm_conv[i][s], rtol=1e-10, atol=1e-10), (t, i, s)
                if int(adapter.cursor[s]) == 0:  # just flushed: the checkpoint itself is current
                    assert torch.allclose(ssm_rep[i][s], ssm_conv[i][s], rtol=1e-10, atol=1e-10)
                    flushed_at_zero += 1
    assert flushed_at_zero >= 2 * len(layers) * 3  # slots 3 and 5 flushed 3 times each over 3L+2 decode steps
    assert int(adapter.cursor[3]) == (steps - 1) % L and int(adapter.cursor[5]) == (steps - 1) % L
    assert int(adapter.cursor[0]) == (steps - 9) % L  # reset by its new prefill, then decoded from step 9
    # only the "M" layers were routed; MoE / attention layers ran every step and own no buffers
    assert sorted(adapter.layers) == list(layers) and adapter.mamba_layers == set(layers)
    assert all(m.calls == steps for m in model.mixers if isinstance(m, OtherMixer))
    for i in layers:
        lay = adapter.layers[i]
        for s in (1, 2, 4, 6):  # slots no request used: checkpoint and buffers untouched
            assert torch.equal(ssm_rep[i][s], init[i][s])
            assert not lay["x_cache"][s].any() and not lay["B_cache"][s].any() and not lay["dt_cache"][s].any()
            assert int(adapter.cursor[s]) == 0


class V2Relocating:
    """MambaHybridCacheManagerV2 as far as relocation goes (mamba_cache_manager_v2.py 28295084,
    ``_setup_state_indices`` from ``prepare_resources``, before the step's forward): the generation requests' slots
    change; V2 has moved their pages (the ssm state rows are at the new slot); then
    ``get_state_update_strategy().relocate_slots(old, new)`` (common.py 28295084) with -1 for a request it has not
    seen. The default (non-speculative) strategy owns nothing to move: it records the call."""

    def __init__(self, ssm_states):
        self.ssm_states, self.slot_of, self.calls = ssm_states, {}, []
        self.strategy = types.SimpleNamespace(relocate_slots=lambda old, new: self.calls.append((old, new)))

    def get_state_update_strategy(self):
        return self.strategy

    def prepare(self, generation: dict, finished=()):
        for r in finished:
            self.slot_of.pop(r)
        old, new = [self.slot_of.get(r, -1) for r in generation], list(generation.values())
        moves = [(o, n) for o, n in zip(old, new) if o >= 0 and o != n]
        if moves:  # the pages move with the requests, gathered before any is written
            src, dst = (torch.tensor(v) for v in zip(*moves))
            for t in self.ssm_states.values():
                t[dst] = t[src].clone()
        self.slot_of.update(generation)
        self.get_state_update_strategy().relocate_slots(old, new)


# Requests A, B, C: their slots never moved, and (prefill, decode, finished before the step, the relocated run's
# slots) per step: A mid-ring onto C's freed slot, a swap of A and B, a chain (B takes the slot A leaves).
HOME = {"A": 3, "B": 5, "C": 0}
RELOCATIONS = (
    [(["A"], [], (), {"A": 3}),
     (["B", "C"], ["A"], (), {"A": 3, "B": 5, "C": 0}),
     ([], ["A", "B", "C"], (), {"A": 3, "B": 5, "C": 0}),
     ([], ["A", "B", "C"], (), {"A": 3, "B": 5, "C": 0}),
     ([], ["A", "B"], ("C",), {"A": 0, "B": 5}),
     ([], ["A", "B"], (), {"A": 5, "B": 0})]
    + [([], ["A", "B"], (), {"A": 5, "B": 0})] * (L + 1)
    + [([], ["A", "B"], (), {"A": 6, "B": 5})] * (2 * L + 2))


@pytest.mark.parametrize("shadow", ["none", "bf16", "fp8"])
def test_relocated_requests_continue_as_if_never_moved(fake_trtllm, shadow):
    """A relocating V2 manager (stand-in above) between steps (RELOCATIONS): the routed model's outputs, states
    (checkpoint + rings) and cursors equal a routed twin's whose requests never move (slots HOME), bit for bit, and
    the conventional oracle's to 1e-10 (fp32 checkpoint; the shadows' rounding is compared through the twin alone)."""
    import functools

    mixer_cls, model_cls = fake_trtllm
    H, P, N, G, S, pattern = 4, 8, 16, 2, 7, "M*M"
    layers = tuple(mod.mamba_layer_indices(pattern))
    gen = torch.Generator().manual_seed(11)
    prm = {i: fp32_params(H, gen) for i in layers}
    oracle = [mixer_cls(layer_idx=i, head_dim=P, d_state=N, **prm[i]) for i in layers]
    twin = build_model(mixer_cls, model_cls, pattern, prm, P, N)  # built before patching: routed by hand
    tw = ReplaySSMAdapter(buffer_len=L, shadow=shadow)
    for m in twin.mixers:
        if isinstance(m, mixer_cls):
            m.selective_state_update_func = functools.partial(mod.replay_selective_state_update, adapter=tw,
                                                              layer_idx=m.layer_idx)
    adapter = patch_classes(mixer_cls, model_cls, ReplaySSMAdapter(buffer_len=L, shadow=shadow))
    model = build_model(mixer_cls, model_cls, pattern, prm, P, N)
    replay_step = sys.modules["trtllm_replayssm_module.install"].replay_step

    init = {i: torch.randn(S, H, P, N, generator=gen, dtype=F64) for i in layers}
    ssm = {k: {i: init[i].clone() for i in layers} for k in ("v2", "twin", "conv")}
    v2 = V2Relocating(ssm["v2"])
    moved = 0
    for pre, dec, finished, where in RELOCATIONS:
        v2.prepare({r: where[r] for r in dec}, finished)
        v2.slot_of.update({r: where[r] for r in pre})
        nd = len(dec)
        inputs = step_inputs(gen, layers, len(pre), nd, H, P, N, G)
        home = [HOME[r] for r in pre + dec]
        md_v2 = metadata([where[r] for r in pre + dec], len(pre), ssm["v2"], inputs, H, P)
        md_v2.kv_cache_manager = v2
        md_tw = metadata(home, len(pre), ssm["twin"], inputs, H, P)
        md_conv = metadata(home, len(pre), ssm["conv"], inputs, H, P)
        model.forward(md_v2)
        replay_step(tw, twin, mixer_cls, md_tw, lambda md=md_tw: [m.forward(md) for m in twin.mixers])  # unpatched
        for m in oracle:
            m.forward(md_conv)
        moved += sum(where[r] != HOME[r] for r in dec)
        for i in layers:
            if not dec:
                continue
            assert torch.equal(md_v2.out[i], md_tw.out[i]), i
            if shadow == "none":
                err = (md_v2.out[i] - md_conv.out[i]).norm() / md_conv.out[i].norm()
                assert err < 1e-10, (i, float(err))
            for r in dec:
                a, b = where[r], HOME[r]
                assert int(adapter.cursor[a]) == int(tw.cursor[b]), r
                assert torch.equal(ssm["v2"][i][a], ssm["twin"][i][b]), (i, r)  # the checkpoint (TensorRT-LLM's)
                for name in ("x_cache", "B_cache", "dt_cache", "shadow_storage", "scale_storage"):
                    if adapter.layers[i].get(name) is not None:
                        assert torch.equal(adapter.layers[i][name][a], tw.layers[i][name][b]), (i, r, name)
                if shadow == "none":
                    torch.testing.assert_close(adapter.current_state(i, a), ssm["conv"][i][b], rtol=1e-10,
                                               atol=1e-10)
    assert moved > 0 and ([0, 5], [5, 0]) in v2.calls and ([5, 0], [6, 5]) in v2.calls
    assert len(v2.strategy.relocate_slots.replayssm_followers) == 1  # one follower, however many steps


def test_a_strided_state_pool_is_refused_by_name():
    """TensorRT-LLM's V2 per-layer state views (mamba_cache_manager_v2.py 28295084, ``_get_state_buffer``: slot
    stride page_index_scale x one state) are not what the Mamba-2 kernels address: refused before anything is
    allocated or written, naming the expected strides."""
    kw, adapter = _call_args(), ReplaySSMAdapter(buffer_len=L)
    raw = torch.randn(2 * kw["state"].shape[0], *kw["state"].shape[1:], dtype=kw["state"].dtype)
    kw["state"] = raw[::2]
    before = raw.clone()
    with pytest.raises(NotImplementedError, match=r"strides \(.*expect a contiguous \(slots, 4, 8, 16\) pool"):
        _step(adapter, kw)
    assert torch.equal(raw, before) and adapter.cursor is None and not adapter.layers


@pytest.mark.parametrize("shadow, tol", [("bf16", 1e-2), ("fp8", 1.5e-1)])
def test_shadow_is_read_between_flushes_and_never_enters_the_state(fake_trtllm, shadow, tol, monkeypatch):
    """With a checkpoint shadow (TRTLLM_REPLAYSSM_SHADOW) on the Nemotron 3 pattern, through the schedule above:
    the state checkpoint + buffer stand for is the conventional one to 1e-10 (the shadow's rounding never enters
    it); after every step each slot's shadow is exactly the quantized checkpoint (slots 0 and 6 prefilled together
    after the shadows exist: requantized at end_step, after the prefill wrote them); every non-flush row's output is
    within the shadow's rounding of the conventional one and not equal to it (the shadow is what it reads), every
    flush row's equals it (the flush reads the full-precision checkpoint)."""
    from trtllm_replayssm import shadow as shadowq

    mixer_cls, model_cls = fake_trtllm
    monkeypatch.setattr(sys.modules[ReplaySSMAdapter.__module__], "_QUANT_SLOTS", 3)  # the pool in chunks 3, 3, 1
    H, P, N, S, G, pattern = 4, 8, 16, 7, 2, "MEM*EM*E"
    layers = tuple(mod.mamba_layer_indices(pattern))
    gen = torch.Generator().manual_seed(11)
    prm = {i: fp32_params(H, gen) for i in layers}
    oracle = [mixer_cls(layer_idx=i, head_dim=P, d_state=N, **prm[i]) for i in layers]
    adapter = patch_classes(mixer_cls, model_cls, ReplaySSMAdapter(buffer_len=L, shadow=shadow))
    model = build_model(mixer_cls, model_cls, pattern, prm, P, N)
    init = {i: torch.randn(S, H, P, N, generator=gen, dtype=F64) for i in layers}
    ssm_rep = {i: init[i].clone() for i in layers}
    ssm_conv = {i: init[i].clone() for i in layers}
    plan = [([3, 0, 5], [])] + [([0, 6] if t in (7, 8) else [],  # a two-slot prefill, in two chunks
                                 [3, 5] + ([0] if t <= 5 or t >= 9 else []) + ([6] if t >= 9 else []))
                                for t in range(1, 3 * L + 3)]
    worst, least_read, flushes = 0.0, float("inf"), 0
    for t, (pre, dec) in enumerate(plan):
        rows = list(dec) + ([-1] if dec else [])
        before = None if adapter.cursor is None else adapter.cursor.clone()
        inputs = {i: dict(prefill_state=torch.randn(len(pre), H, P, N, generator=gen, dtype=F64),
                          x=torch.randn(len(rows), H, P, generator=gen, dtype=F64),
                          B=torch.randn(len(rows), G, N, generator=gen, dtype=F64) * N ** -0.5 * 4,
                          C=torch.randn(len(rows), G, N, generator=gen, dtype=F64) * N ** -0.5 * 4,
                          dt=torch.randn(len(rows), H, generator=gen, dtype=F64) - 2.0) for i in layers}
        md_rep = metadata(pre + rows, len(pre), ssm_rep, inputs, H, P)
        md_conv = metadata(pre + rows, len(pre), ssm_conv, inputs, H, P)
        model.forward(md_rep)
        for m in oracle:
            m.forward(md_conv)
        for i in layers:
            lay = adapter.layers.get(i)
            if lay is None:  # allocated by the first decode call
                assert not rows
                continue
            assert lay["shadow"].dtype == (torch.bfloat16 if shadow == "bf16" else torch.float8_e4m3fn)
            for s in range(S):  # every slot: quantized from the pool at allocation, kept since
                q = torch.empty(H, P, N, dtype=lay["shadow"].dtype)
                sc = None if shadow == "bf16" else torch.empty(H, P, dtype=torch.float32)
                shadowq.quantize_shadow(ssm_rep[i][s], q, sc)
                assert torch.equal(lay["shadow"][s].float(), q.float()), (t, i, s)
                if sc is not None:
                    assert torch.equal(lay["shadow_scale"][s], sc), (t, i, s)
            if not rows:
                continue
            for s in dec:
                assert torch.allclose(adapter.current_state(i, s), ssm_conv[i][s], rtol=1e-10, atol=1e-10), (t, i, s)
            y_rep, y_conv = md_rep.out[i][:-1], md_conv.out[i][:-1]
            assert torch.equal(md_rep.out[i][-1], torch.full_like(y_rep[0], SENTINEL))  # padding row untouched
            for b, slot in enumerate(dec):
                err = float((y_rep[b] - y_conv[b]).norm() / y_conv[b].norm())
                if before is not None and int(before[slot]) == L - 1:  # this row's step flushed
                    assert err < 1e-10, (t, i, slot, err)
                    flushes += 1
                else:  # read the shadow: its rounding is visible, and bounded
                    worst, least_read = max(worst, err), min(least_read, err)
    assert worst < tol, worst
    assert least_read > 1e-7, least_read
    assert flushes >= 3 * len(layers)


def test_only_mamba_positions_of_the_pattern_may_decode(fake_trtllm, caplog):
    """A decode call from an "E" (MoE) position is refused before anything is written; "M" layers whose
    mixers were built before install (unrouted, conventional) are logged once, the others still match."""
    mixer_cls, model_cls = fake_trtllm
    H, P, N, S, G, pattern = 4, 8, 16, 3, 2, "MEM*EM*E"
    gen = torch.Generator().manual_seed(5)
    prm = {i: fp32_params(H, gen) for i in range(len(pattern))}
    early = mixer_cls(layer_idx=5, head_dim=P, d_state=N, **prm[5])  # built before install: not routed
    oracle = {i: mixer_cls(layer_idx=i, head_dim=P, d_state=N, **prm[i]) for i in (0, 2)}
    adapter = patch_classes(mixer_cls, model_cls, ReplaySSMAdapter(buffer_len=L))
    model = build_model(mixer_cls, model_cls, pattern, prm, P, N)
    model.mixers[5] = early
    init = torch.randn(S, H, P, N, generator=gen, dtype=F64)
    ssm_rep = {i: init.clone() for i in (0, 2, 5)}
    ssm_conv = {i: init.clone() for i in (0, 2)}

    def inputs(layers):
        return {i: dict(x=torch.randn(1, H, P, generator=gen, dtype=F64), B=torch.randn(1, G, N, generator=gen, dtype=F64),
                        C=torch.randn(1, G, N, generator=gen, dtype=F64),
                        dt=torch.randn(1, H, generator=gen, dtype=F64) - 2) for i in layers}

    with caplog.at_level("WARNING", logger="trtllm_replayssm_module"):
        for _ in range(L + 2):
            inp = inputs((0, 2, 5))
            model.forward(metadata([1], 0, ssm_rep, inp, H, P))
            for i in (0, 2):
                oracle[i].forward(metadata([1], 0, ssm_conv, {i: inp[i]}, H, P))
                assert torch.allclose(adapter.current_state(i, 1), ssm_conv[i][1], rtol=1e-10, atol=1e-10)
    warnings = [r for r in caplog.records if "made no ReplaySSM decode call" in r.getMessage()]
    assert len(warnings) == 1 and "[5]" in warnings[0].getMessage()
    assert sorted(adapter.layers) == [0, 2] and int(adapter.cursor[1]) == (L + 2) % L

    # a Mamba2Mixer claiming an "E" position: refused, nothing written
    uninstall()
    wrong = patch_classes(mixer_cls, model_cls, ReplaySSMAdapter(buffer_len=L))
    bad = model_cls([mixer_cls(layer_idx=1, head_dim=P, d_state=N, **prm[1])], pattern)
    before = init.clone()
    with pytest.raises(RuntimeError, match=r"layer 1: a selective_state_update call, but position 1 of "
                                           r"hybrid_override_pattern 'MEM\*EM\*E' is 'E', not 'M' \(Mamba-2 layers "
                                           r"\[0, 2, 5\]\)"):
        bad.forward(metadata([1], 0, {1: before}, inputs((1,)), H, P))
    assert torch.equal(before, init) and wrong.cursor is None and not wrong.layers


def test_mamba_layer_indices():
    assert mod.mamba_layer_indices("MEM*EM*E") == [0, 2, 5]
    assert mod.mamba_layer_indices("M*-M-M*-") == [0, 3, 5]
    with pytest.raises(ValueError, match=r"expected only the letters M, E, \* and -, got \['X'\]"):
        mod.mamba_layer_indices("MXM")
    model = types.SimpleNamespace(model_config=types.SimpleNamespace(
        pretrained_config=types.SimpleNamespace(hybrid_override_pattern="ME")))
    assert mod.model_pattern(model) == "ME" and mod.model_pattern(object()) is None


def test_teeth_a_corrupted_buffer_entry_is_caught(fake_trtllm):
    """The state oracle is not vacuous: one changed cached x entry moves the state it stands for."""
    mixer_cls, model_cls = fake_trtllm
    H, P, N, S, G = 4, 8, 16, 3, 2
    gen = torch.Generator().manual_seed(7)
    prm = fp32_params(H, gen)
    oracle = mixer_cls(layer_idx=0, head_dim=P, d_state=N, **prm)
    adapter = patch_classes(mixer_cls, model_cls, ReplaySSMAdapter(buffer_len=L))
    model = model_cls([mixer_cls(layer_idx=0, head_dim=P, d_state=N, **prm)])
    init = torch.randn(S, H, P, N, generator=gen, dtype=F64)
    ssm_rep, ssm_conv = {0: init.clone()}, {0: init.clone()}
    for _ in range(2):
        inputs = {0: dict(x=torch.randn(1, H, P, generator=gen, dtype=F64), B=torch.randn(1, G, N, generator=gen, dtype=F64),
                          C=torch.randn(1, G, N, generator=gen, dtype=F64), dt=torch.randn(1, H, generator=gen, dtype=F64) - 2)}
        model.forward(metadata([1], 0, ssm_rep, inputs, H, P))
        oracle.forward(metadata([1], 0, ssm_conv, inputs, H, P))
    assert torch.allclose(adapter.current_state(0, 1), ssm_conv[0][1], rtol=1e-10, atol=1e-10)
    adapter.layers[0]["x_cache"][1, 2, 1, 3] += 1e-3
    assert not torch.allclose(adapter.current_state(0, 1), ssm_conv[0][1], rtol=1e-10, atol=1e-10)


# ---- argument conversion and errors ---------------------------------------------------------------
def _call_args(H=4, P=8, N=16, G=2, S=3, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prm = fp32_params(H, gen)
    return dict(state=torch.randn(S, H, P, N, generator=gen, dtype=F64),
                x=torch.randn(batch, H, P, generator=gen, dtype=F64),
                dt=(torch.randn(batch, H, generator=gen, dtype=F64) - 2)[:, :, None].expand(batch, H, P),
                A=prm["A"][:, None, None].expand(H, P, N), B=torch.randn(batch, G, N, generator=gen, dtype=F64),
                C=torch.randn(batch, G, N, generator=gen, dtype=F64), D=prm["D"][:, None].expand(H, P),
                dt_bias=prm["dt_bias"][:, None].expand(H, P), dt_softplus=True,
                state_batch_indices=torch.tensor([2, 0], dtype=torch.int32)[:batch])


def _step(adapter, kw, layer=0):
    adapter.begin_step()
    y = adapter.selective_state_update(layer, **kw)
    adapter.end_step()
    return y


def test_tie_hdim_materialized_per_dim_arguments_equal_the_broadcast_ones():
    kw = _call_args()
    y_b = _step(ReplaySSMAdapter(buffer_len=L), {**kw, "state": kw["state"].clone()})
    dense = {k: (kw[k].contiguous() if k in ("A", "D", "dt_bias", "dt") else kw[k]) for k in kw}
    dense["state"] = kw["state"].clone()
    y_d = _step(ReplaySSMAdapter(buffer_len=L, check_values=True), dense)
    assert torch.equal(y_b, y_d)
    per_head = {**kw, "state": kw["state"].clone(), "A": kw["A"][:, 0, 0], "D": kw["D"][:, 0],
                "dt_bias": kw["dt_bias"][:, 0], "dt": kw["dt"][:, :, 0]}
    assert torch.equal(_step(ReplaySSMAdapter(buffer_len=L), per_head), y_b)


@pytest.mark.parametrize("name", ["A", "D", "dt_bias", "dt"])
def test_per_dim_values_that_vary_within_a_head_are_refused(name):
    kw = _call_args()
    bad = kw[name].contiguous().clone()
    bad[(0,) * bad.dim()] += 1.0
    kw[name] = bad
    adapter = ReplaySSMAdapter(buffer_len=L, check_values=True)
    with pytest.raises(ValueError, match=rf"^{name}: expected one value per"):
        _step(adapter, kw)


@pytest.mark.parametrize("change, exc, match", [
    (dict(dt_softplus=False), NotImplementedError, r"^dt_softplus: expected True"),
    (dict(intermediate_states_buffer=torch.zeros(1)), NotImplementedError, r"^intermediate_states_buffer: expected None"),
    (dict(cache_steps=4), NotImplementedError, r"^cache_steps: expected None"),
    (dict(rand_seed=torch.zeros(1, dtype=torch.int64)), NotImplementedError, r"^rand_seed: expected None"),
    (dict(bogus=1), TypeError, r"unexpected argument 'bogus'"),
    (dict(x=torch.zeros(2, 3, 4, 8, dtype=F64)), NotImplementedError, r"^x: expected single-token \(batch, 4, 8\)"),
    (dict(state_batch_indices=torch.zeros(3, dtype=torch.int32)), ValueError, r"^state_batch_indices: expected shape \(2,\)"),
    (dict(A=torch.zeros(4, 8, dtype=F64)), ValueError, r"^A: expected shape \(4,\) or \(4, 8, 16\)"),
    (dict(pad_slot_id=0), ValueError, r"^pad_slot_id: expected -1"),
])
def test_unsupported_arguments_are_named(change, exc, match):
    with pytest.raises(exc, match=match):
        ReplaySSMAdapter(buffer_len=L).selective_state_update(0, **{**_call_args(), **change})


def test_buffer_len_is_checked():
    with pytest.raises(ValueError, match=r"^buffer_len: expected an int in 1\.\.32, got 0"):
        ReplaySSMAdapter(buffer_len=0)


def test_shadow_requantize_padding_rows_and_a_new_pool(monkeypatch):
    """end_step rewrites the shadows of exactly the prefilled slots (chunked; a -1 row goes to the scratch slot, no
    real slot); a re-created state pool is quantized whole."""
    from trtllm_replayssm import shadow as shadowq
    from trtllm_replayssm.config import SHADOW_DTYPES

    monkeypatch.setattr(sys.modules[ReplaySSMAdapter.__module__], "_QUANT_SLOTS", 2)
    for kind in ("bf16", "fp8"):
        kw = _call_args(S=5)
        adapter = ReplaySSMAdapter(buffer_len=L, shadow=kind)
        _step(adapter, kw)
        lay = adapter.layers[0]
        old = lay["shadow"].float().clone()
        kw["state"][[0, 1, 3, 4]] = torch.randn(4, *kw["state"].shape[1:], dtype=F64)  # prefill writes slots 1, 3
        adapter.begin_step(torch.tensor([3, -1, 1], dtype=torch.int32))
        adapter.end_step()

        def quantized(st, kind=kind):
            q = torch.empty(st.shape, dtype=SHADOW_DTYPES[kind])
            sc = None if kind == "bf16" else torch.empty(st.shape[:-1], dtype=torch.float32)
            shadowq.quantize_shadow(st, q, sc)
            return q.float(), sc

        for s in range(5):
            q, sc = quantized(kw["state"][s])
            if s in (1, 3):
                assert torch.equal(lay["shadow"][s].float(), q), (kind, s)
                assert sc is None or torch.equal(lay["shadow_scale"][s], sc)
            else:  # slots 0 and 4 changed too, but no prefill said so: untouched, as the others
                assert torch.equal(lay["shadow"][s].float(), old[s]), (kind, s)
        new_pool = torch.randn_like(kw["state"])
        _step(adapter, {**kw, "state": new_pool})  # TRT-LLM re-created its cache manager
        assert torch.equal(adapter.layers[0]["shadow"].float(), quantized(new_pool)[0])


def test_shadow_options_are_checked(monkeypatch):
    with pytest.raises(ValueError, match=r"^shadow: expected one of \('none', 'bf16', 'fp8'\), got 'fp4'"):
        ReplaySSMAdapter(shadow="fp4")
    monkeypatch.setenv("TRTLLM_REPLAYSSM_SHADOW", "int8")
    with pytest.raises(ValueError, match=r"^TRTLLM_REPLAYSSM_SHADOW: expected one of \('none', 'bf16', 'fp8'\)"):
        mod.install.__globals__["new_adapter"]()
    monkeypatch.setenv("TRTLLM_REPLAYSSM_SHADOW", "fp8")
    assert mod.install.__globals__["new_adapter"]().shadow == "fp8"
    kw = _call_args()
    adapter = ReplaySSMAdapter(buffer_len=L, shadow="bf16")
    with pytest.raises(ValueError, match=r"^state: a bf16 shadow needs an fp32 SSM state pool .*got bfloat16"):
        _step(adapter, {**kw, "state": kw["state"].bfloat16(), "x": kw["x"].bfloat16()})


def test_step_guards():
    kw = _call_args()
    adapter = ReplaySSMAdapter(buffer_len=L)
    adapter.begin_step()
    adapter.selective_state_update(0, **kw)
    with pytest.raises(RuntimeError, match=r"^layer 0: decoded twice in one model step"):
        adapter.selective_state_update(0, **kw)
    with pytest.raises(RuntimeError, match=r"^state_batch_indices: layer 1 got a different slot tensor"):
        adapter.selective_state_update(1, **{**kw, "state_batch_indices": kw["state_batch_indices"].clone()})
    with pytest.raises(RuntimeError, match=r"^begin_step: the previous step decoded layers \[0\]"):
        adapter.begin_step()
    adapter.end_step()
    assert adapter.cursor.tolist() == [1, 0, 1]
    adapter.begin_step()
    adapter.end_step()  # a step without decode rows does not move the cursor
    assert adapter.cursor.tolist() == [1, 0, 1]
    adapter.begin_step(torch.tensor([2, -1], dtype=torch.int32))  # prefill of slot 2: its buffer is emptied
    assert adapter.cursor.tolist() == [1, 0, 0]
    adapter.abort_step()


def test_a_new_state_pool_starts_every_slot_from_its_checkpoint():
    kw = _call_args()
    adapter = ReplaySSMAdapter(buffer_len=L)
    _step(adapter, kw)
    assert adapter.cursor.tolist() == [1, 0, 1]
    _step(adapter, {**kw, "state": kw["state"].clone()})  # TRT-LLM re-created its cache manager
    assert adapter.cursor.tolist() == [1, 0, 1] and len(adapter.layers) == 1
    assert not adapter.layers[0]["x_cache"][:, :, 1:].any()


def test_out_padding_rows_untouched_and_out_returned():
    kw = _call_args()
    kw["state_batch_indices"] = torch.tensor([-1, 1], dtype=torch.int32)
    out = torch.full_like(kw["x"], SENTINEL)
    adapter = ReplaySSMAdapter(buffer_len=L)
    adapter.begin_step()
    assert adapter.selective_state_update(0, **kw, out=out) is out
    adapter.end_step()
    assert torch.equal(out[0], torch.full_like(out[0], SENTINEL)) and not torch.isnan(out[1]).any()
    assert adapter.cursor.tolist() == [0, 1, 0]


def test_bad_out_is_refused_before_any_state_moves():
    """A wrong-shaped (or wrong-device) ``out`` at the step that would flush: refused with its name, and the
    checkpoint, the buffers and the cursor are as they were (the check used to come after the fold)."""
    kw = _call_args()
    adapter = ReplaySSMAdapter(buffer_len=L)
    for _ in range(L - 1):
        _step(adapter, kw)
    before = [kw["state"].clone(), adapter.cursor.clone(), *(adapter.layers[0][k].clone()
                                                           for k in ("x_cache", "B_cache", "dt_cache"))]
    adapter.begin_step()
    with pytest.raises(ValueError, match=r"^out: expected shape \(2, 4, 8\), got \(2, 99\)"):
        adapter.selective_state_update(0, **kw, out=torch.zeros(2, 99, dtype=F64))
    with pytest.raises(ValueError, match=r"^out: expected shape \(2, 4, 8\), got list"):
        adapter.selective_state_update(0, **kw, out=[0.0])
    adapter.abort_step()
    after = [kw["state"], adapter.cursor, *(adapter.layers[0][k] for k in ("x_cache", "B_cache", "dt_cache"))]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("form", ["none", "int64"])
def test_slot_tensor_given_as_none_or_int64_serves_every_layer(form):
    """state_batch_indices None (rows are slots) or int64: converted once per step and shared by the step's
    Mamba layers (the second layer used to be refused as "a different slot tensor"); same outputs as int32."""
    kw = _call_args(S=2, batch=2)
    kw["state_batch_indices"] = torch.tensor([0, 1], dtype=torch.int32)
    given = None if form == "none" else kw["state_batch_indices"].long()
    ref, got = ReplaySSMAdapter(buffer_len=L), ReplaySSMAdapter(buffer_len=L)
    states = {a: [kw["state"].clone() for _ in range(2)] for a in ("ref", "got")}
    for _ in range(L + 2):  # across a flush
        ys = {}
        for name, adapter, sbi in (("ref", ref, kw["state_batch_indices"]), ("got", got, given)):
            adapter.begin_step()
            ys[name] = [adapter.selective_state_update(layer, **{**kw, "state": states[name][layer],
                                                                 "state_batch_indices": sbi}) for layer in (0, 1)]
            adapter.end_step()
        assert all(torch.equal(a, b) for a, b in zip(ys["got"], ys["ref"]))
    assert torch.equal(got.cursor, ref.cursor) and all(torch.equal(a, b) for a, b in zip(states["got"], states["ref"]))


def test_cache_configurations_replayssm_cannot_follow_are_refused_before_a_step():
    """A V2 hybrid cache manager (moves live requests between slots) with no relocation hook we can follow and block
    reuse (commits ssm_states without our buffered tokens) are refused by name before anything runs; the V1 manager is
    accepted once. (A V2 manager with its hook is followed: test_relocated_requests_continue_as_if_never_moved.)"""
    import importlib

    replay_step = importlib.import_module("trtllm_replayssm_module.install").replay_step
    adapter = ReplaySSMAdapter(buffer_len=L)
    ran = []

    def step(manager):
        md = types.SimpleNamespace(kv_cache_manager=manager, num_contexts=0, num_seqs=0)
        return replay_step(adapter, types.SimpleNamespace(), object, md, lambda: ran.append(1))

    V2 = type("MambaHybridCacheManagerV2", (), {})
    V2.__module__ = "tensorrt_llm._torch.pyexecutor.mamba_cache_manager.mamba_cache_manager_v2"
    with pytest.raises(RuntimeError, match="moves live requests between state slots.*TRTLLM_USE_PY_MAMBA=1"):
        step(V2())
    with pytest.raises(RuntimeError, match="enable_block_reuse is on"):
        step(types.SimpleNamespace(enable_block_reuse=True))
    assert not ran
    v1 = types.SimpleNamespace(enable_block_reuse=False)
    step(v1)
    step(v1)
    assert ran == [1, 1] and adapter.checked_manager is v1


def test_stochastic_rounding_is_refused_at_construction(monkeypatch):
    mixer_cls, _ = make_fake_trtllm()
    fake_tree(monkeypatch, mixer_cls)
    cls = mod.register()
    cfg = model_config("M", {}, 8, 16)
    cfg.quant_config = types.SimpleNamespace(mamba_ssm_stochastic_rounding=True)
    with pytest.raises(RuntimeError, match="mamba_ssm_stochastic_rounding is set"):
        cls(cfg)


# ---- packaging: import without tensorrt_llm, installer ---------------------------------------------
def test_import_without_tensorrt_llm_installs_nothing():
    if "tensorrt_llm" in sys.modules:
        pytest.skip("tensorrt_llm is imported in this process")
    assert mod.ADAPTER is None


def test_install_without_tensorrt_llm_names_what_was_verified():
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorrt_llm is installed")
    with pytest.raises(ImportError, match=r"expected tensorrt_llm's PyTorch backend .* verified against TensorRT-LLM"):
        mod.install()


def test_install_into_real_tensorrt_llm():
    pytest.importorskip("tensorrt_llm", reason="tensorrt_llm is not installed here (its PyPI package is a stub that "
                                               "downloads from NVIDIA's index); run where it is")
    from tensorrt_llm._torch.models.modeling_nemotron_h import NemotronHModel
    from tensorrt_llm._torch.modules.mamba.mamba2_mixer import Mamba2Mixer

    init, fwd = Mamba2Mixer.__init__, NemotronHModel.forward
    if mod.ADAPTER is None:
        adapter = mod.install(ReplaySSMAdapter(buffer_len=L))
        assert isinstance(adapter, ReplaySSMAdapter)
    assert Mamba2Mixer.__init__ is not init or mod.ADAPTER is not None
    assert NemotronHModel.forward.__wrapped__ is not None
    uninstall()
    if mod.ADAPTER is None:
        assert Mamba2Mixer.__init__ is init and NemotronHModel.forward is fwd


# ---- CUDA: the ops backend behind the same adapter (runs on the device machine) ---------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shadow", ["none", "bf16", "fp8"])
def test_ops_backend_matches_reference_backend_on_cuda(shadow):
    """The kernels behind the adapter against the float64 reference executor behind another, over two flushes;
    with a shadow both read their own (quantized from the same fp32 values), and the shadows match after."""
    H, P, N, G, S, batch = 8, 64, 64, 2, 5, 3
    gen = torch.Generator().manual_seed(3)
    prm = fp32_params(H, gen)
    state = torch.randn(S, H, P, N, generator=gen)
    sbi = torch.tensor([4, -1, 1], dtype=torch.int32)
    gpu, cpu = ReplaySSMAdapter(buffer_len=L, shadow=shadow), ReplaySSMAdapter(buffer_len=L, shadow=shadow)
    st_g, st_c = state.cuda(), state.double()
    for _ in range(2 * L + 1):
        x = torch.randn(batch, H, P, generator=gen).bfloat16()
        B, C = (torch.randn(batch, G, N, generator=gen).bfloat16() * 0.5 for _ in range(2))
        dt = (torch.randn(batch, H, generator=gen) - 2).bfloat16().float()  # TRT-LLM: bf16 in_proj -> fp32
        kw = dict(dt=dt[:, :, None].expand(batch, H, P), A=prm["A"].float()[:, None, None].expand(H, P, N),
                  D=prm["D"].float()[:, None].expand(H, P), dt_bias=prm["dt_bias"].float()[:, None].expand(H, P),
                  dt_softplus=True)
        out = torch.full((batch, H, P), SENTINEL, dtype=torch.bfloat16, device="cuda")
        _step(gpu, dict(state=st_g, x=x.cuda(), B=B.cuda(), C=C.cuda(), state_batch_indices=sbi.cuda(), out=out,
                        **{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}))
        y_c = _step(cpu, dict(state=st_c, x=x.double(), B=B.double(), C=C.double(), state_batch_indices=sbi,
                              **{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}))
        assert torch.equal(out[1].cpu(), torch.full((H, P), SENTINEL, dtype=torch.bfloat16))
        # bf16 output rounding (2^-8 relative) dominates the fp32-vs-float64 arithmetic difference
        for b in (0, 2):
            assert torch.allclose(out[b].double().cpu(), y_c[b], rtol=2e-2, atol=2e-2)
    assert gpu.cursor.cpu().tolist() == cpu.cursor.tolist()
    if shadow != "none":  # rewritten by the flushes from checkpoints that agree to fp32 rounding
        for s in (1, 4):
            sh_g, sh_c = gpu.layers[0]["shadow"][s].float().cpu(), cpu.layers[0]["shadow"][s].float()
            if shadow == "fp8":
                sh_g = sh_g * gpu.layers[0]["shadow_scale"][s].cpu()[..., None]
                sh_c = sh_c * cpu.layers[0]["shadow_scale"][s][..., None]
            assert torch.allclose(sh_g, sh_c, rtol=0.07 if shadow == "fp8" else 8e-3, atol=1e-3)
            assert torch.allclose(sh_g.double(), st_g[s].double().cpu(), rtol=0.07 if shadow == "fp8" else 8e-3,
                                  atol=1e-3)


def test_the_oracle_is_the_reference_conventional_step():
    """conventional_ssu (per (head, dim), TRT-LLM's layout) equals reference.conventional_step (per head)."""
    from trtllm_replayssm.families.mamba2 import reference

    kw = _call_args(seed=5)
    kw["state_batch_indices"] = torch.tensor([2, -1], dtype=torch.int32)
    s1, s2 = kw["state"].clone(), kw["state"].clone()
    out = torch.full_like(kw["x"], SENTINEL)
    conventional_ssu(**{**kw, "state": s1}, out=out)
    y = reference.conventional_step(s2, kw["x"], kw["B"], kw["C"], kw["dt"][:, :, 0], kw["dt_bias"][:, 0],
                                    kw["A"][:, 0, 0], kw["D"][:, 0], None, kw["state_batch_indices"])
    assert torch.allclose(out[0], y[0], rtol=1e-12, atol=1e-12) and torch.allclose(s1, s2, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[1], torch.full_like(out[1], SENTINEL))


def test_rows_sharing_a_dummy_slot_leave_the_real_slots_exact(fake_trtllm):
    """CUDA-graph padding rows are dummy requests that may share one slot; real rows must not notice."""
    mixer_cls, model_cls = fake_trtllm
    H, P, N, S, G = 4, 8, 16, 4, 2
    gen = torch.Generator().manual_seed(11)
    prm = fp32_params(H, gen)
    oracle = mixer_cls(layer_idx=0, head_dim=P, d_state=N, **prm)
    adapter = patch_classes(mixer_cls, model_cls, ReplaySSMAdapter(buffer_len=L))
    model = model_cls([mixer_cls(layer_idx=0, head_dim=P, d_state=N, **prm)])
    init = torch.randn(S, H, P, N, generator=gen, dtype=F64)
    ssm_rep, ssm_conv = {0: init.clone()}, {0: init.clone()}
    rows = [1, 3, 3, 0]  # slot 3 is the dummy slot, used by two padding rows
    for _ in range(2 * L + 1):
        n = len(rows)
        inputs = {0: dict(x=torch.randn(n, H, P, generator=gen, dtype=F64), B=torch.randn(n, G, N, generator=gen, dtype=F64),
                          C=torch.randn(n, G, N, generator=gen, dtype=F64), dt=torch.randn(n, H, generator=gen, dtype=F64) - 2)}
        md_rep, md_conv = metadata(rows, 0, ssm_rep, inputs, H, P), metadata(rows, 0, ssm_conv, inputs, H, P)
        model.forward(md_rep)
        oracle.forward(md_conv)
        for b in (0, 3):
            assert torch.allclose(md_rep.out[0][b], md_conv.out[0][b], rtol=1e-10, atol=1e-10)
        for s in (0, 1):
            assert torch.allclose(adapter.current_state(0, s), ssm_conv[0][s], rtol=1e-10, atol=1e-10)
    assert torch.equal(ssm_rep[0][2], init[2]) and int(adapter.cursor[2]) == 0


# ---- the registration route, against a stand-in of TensorRT-LLM's model registry -----------------------
# Written from tensorrt_llm/_torch/models/modeling_utils.py (see serve/trtllm_replayssm_module/model.py):
# ``register_auto_model(name)`` fills MODEL_CLASS_MAPPING; in the 2025 registry (lazy=False) the last
# registration wins; in the lazy-zoo registry (lazy=True) a built-in module (under
# tensorrt_llm._torch.models) only fills an empty slot, an external one always overwrites, the driver
# exports external registrations as architecture -> module name and a worker that declared them imports
# that module when the architecture is looked up.
ZOO = "tensorrt_llm._torch.models"
FAKE_VERSION = "1.3.0rc26+stand-in"


def make_registry(lazy: bool, with_register: bool = True):
    mu = types.ModuleType(ZOO + ".modeling_utils")
    mapping, recorded, declared = {}, {}, {}
    index = {"NemotronHForCausalLM": ZOO + ".modeling_nemotron_h", "NemotronHPuzzleForCausalLM": ZOO + ".modeling_nemotron_h"}

    def builtin(name):
        return name == ZOO or name.startswith(ZOO + ".")

    def apply(arch, cls):
        if lazy and mapping.get(arch) not in (None, cls) and builtin(cls.__module__):
            return
        mapping[arch] = cls

    def register_auto_model(name):
        def decorator(cls):
            recorded.setdefault(cls.__module__, []).append((name, cls))
            apply(name, cls)
            return cls
        return decorator

    mu.MODEL_CLASS_MAPPING = mapping
    if with_register:
        mu.register_auto_model = register_auto_model
    if lazy:
        def export_external_model_modules():
            out = {a: c.__module__ for a, c in mapping.items() if not builtin(c.__module__)}
            for a, m in declared.items():
                out.setdefault(a, m)
            return out

        def register_external_model_modules(arch_to_module):
            declared.clear()
            declared.update(arch_to_module)
            mapping.clear()
            for module_name, regs in list(recorded.items()):
                for arch, cls in regs:
                    if declared.get(arch, module_name) == module_name:
                        apply(arch, cls)

        def get_registered_model_class(arch):
            if arch not in mapping:
                import importlib

                importlib.import_module(declared.get(arch) or index[arch])
            return mapping.get(arch)

        mu.export_external_model_modules = export_external_model_modules
        mu.register_external_model_modules = register_external_model_modules
        mu.get_registered_model_class = get_registered_model_class
    return mu


def make_zoo(mixer_cls, mu):
    """modeling_nemotron_h stand-in: NemotronHModel builds one layer per letter (``.layer_type``, ``.mixer``)."""
    nh = types.ModuleType(ZOO + ".modeling_nemotron_h")

    class NemotronHModel:
        def __init__(self, model_config):
            self.model_config = model_config
            pattern = model_config.pretrained_config.hybrid_override_pattern
            self.layers = [types.SimpleNamespace(layer_type=c, mixer=mixer_cls(
                layer_idx=i, head_dim=model_config.head_dim, d_state=model_config.d_state, **model_config.params[i])
                if c == "M" else OtherMixer(i, c)) for i, c in enumerate(pattern)]
            self.num_hidden_layers = len(pattern)

        def forward(self, attn_metadata, input_ids=None, **kwargs):
            for layer in self.layers[:self.num_hidden_layers]:
                layer.mixer.forward(attn_metadata)
            return "hidden"

    class NemotronHForCausalLM:
        def __init__(self, model_config):
            self.model_config = model_config
            self.model = NemotronHModel(model_config)

        def forward(self, attn_metadata, input_ids=None, position_ids=None, **kwargs):
            return self.model.forward(attn_metadata, input_ids)

    for c in (NemotronHModel, NemotronHForCausalLM):
        c.__module__ = nh.__name__
    nh.NemotronHModel = NemotronHModel
    if hasattr(mu, "register_auto_model"):  # TensorRT-LLM registers the class under both names
        NemotronHForCausalLM = mu.register_auto_model("NemotronHPuzzleForCausalLM")(NemotronHForCausalLM)
        NemotronHForCausalLM = mu.register_auto_model("NemotronHForCausalLM")(NemotronHForCausalLM)
    nh.NemotronHForCausalLM = NemotronHForCausalLM
    return nh


def fake_tree(monkeypatch, mixer_cls, lazy=True, with_register=True):
    """Put a stand-in tensorrt_llm module tree in sys.modules; returns (modeling_utils, modeling_nemotron_h)."""
    mu = make_registry(lazy, with_register)
    nh = make_zoo(mixer_cls, mu)
    mm = types.ModuleType("tensorrt_llm._torch.modules.mamba.mamba2_mixer")
    mm.Mamba2Mixer = mixer_cls
    mods = {name: types.ModuleType(name) for name in ("tensorrt_llm", "tensorrt_llm._torch", ZOO,
                                                      "tensorrt_llm._torch.modules", "tensorrt_llm._torch.modules.mamba")}
    mods["tensorrt_llm"].__version__ = FAKE_VERSION
    mods.update({mu.__name__: mu, nh.__name__: nh, mm.__name__: mm})
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(mods[parent], leaf, m)
    monkeypatch.setattr(mod.model, "ReplaySSMNemotronHForCausalLM", None)
    return mu, nh


def model_config(pattern, prm, P, N, spec_config=None):
    return types.SimpleNamespace(pretrained_config=types.SimpleNamespace(hybrid_override_pattern=pattern),
                                 spec_config=spec_config, params=prm, head_dim=P, d_state=N)


class _MixerParams:
    """What every stand-in mixer's __init__ keeps (no decode call here, so the source check sees none)."""

    def __init__(self, *, layer_idx, A, D, dt_bias, head_dim, d_state):
        self.layer_idx, self.head_dim = layer_idx, head_dim
        self.selective_state_update_func = conventional_ssu
        H = A.shape[0]
        self._A_expanded = A[:, None, None].expand(H, head_dim, d_state)
        self._dt_bias_expanded = dt_bias[:, None].expand(H, head_dim)
        self._D_expanded = D[:, None].expand(H, head_dim)

    def decode_args(self, md):
        n_d = md.num_seqs - md.num_contexts
        inp = md.inputs[self.layer_idx]
        dt_d = inp["dt"][:, :, None].expand(n_d, inp["dt"].shape[1], self.head_dim)
        return ((md.ssm_states[self.layer_idx], inp["x"], dt_d, self._A_expanded, inp["B"], inp["C"], self._D_expanded),
                dict(z=None, dt_bias=self._dt_bias_expanded, dt_softplus=True,
                     state_batch_indices=md.mamba_metadata.state_indices[md.num_contexts:md.num_seqs],
                     out=md.out[self.layer_idx].view(n_d, -1, self.head_dim)))


class OldMixer(_MixerParams):
    """Before PR #10757 (595da613): decode calls the module-level selective_state_update."""

    def forward(self, md):
        args, kw = self.decode_args(md)
        selective_state_update(*args, **kw)  # noqa: F821 - never run; read by the source check


class CustomOpMixer(_MixerParams):
    """Decode through the custom op PR #18888 added, bypassing the attribute."""

    def forward(self, md):
        args, kw = self.decode_args(md)
        torch.ops.trtllm.flashinfer_selective_state_update(*args, **kw)


class NoCallMixer(_MixerParams):
    """Decode moved out of the class entirely (e.g. into a custom op's body)."""

    def forward(self, md):
        return None


class SneakyMixer(_MixerParams):
    """Passes the source check (the hooked call survives in a branch never taken) but decodes elsewhere."""

    def forward(self, md):
        if md.num_seqs == md.num_contexts:
            return
        args, kw = self.decode_args(md)
        if md.num_seqs < 0:
            self.selective_state_update_func(*args, **kw)
        conventional_ssu(*args, **kw)


def _decode_md(gen, slots, ssm, layers, H, P, N, G, num_contexts=0):
    n = len(slots) - num_contexts
    inputs = {i: dict(prefill_state=torch.randn(num_contexts, H, P, N, generator=gen, dtype=F64),
                      x=torch.randn(n, H, P, generator=gen, dtype=F64), B=torch.randn(n, G, N, generator=gen, dtype=F64),
                      C=torch.randn(n, G, N, generator=gen, dtype=F64), dt=torch.randn(n, H, generator=gen, dtype=F64) - 2)
              for i in layers}
    return inputs


@pytest.mark.parametrize("lazy", [True, False])
def test_registered_class_routes_mamba_layers_without_patching_trtllm(monkeypatch, caplog, lazy):
    mixer_cls, _ = make_fake_trtllm()
    mu, nh = fake_tree(monkeypatch, mixer_cls, lazy=lazy)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(mod.model, "_fresh_process_can_import", lambda: False)  # a worker that would not find us
    monkeypatch.delenv("TLLM_WORKER_USE_SINGLE_PROCESS", raising=False)
    monkeypatch.setenv("TRTLLM_REPLAYSSM_BUFFER_LEN", str(L))
    init_before, fwd_before = mixer_cls.__init__, nh.NemotronHModel.forward
    with caplog.at_level("INFO", logger="trtllm_replayssm_module"):
        route, cls = mod.load()
    assert route == "registration" and cls is mod.model.ReplaySSMNemotronHForCausalLM
    assert cls.__bases__ == (nh.NemotronHForCausalLM,) and cls.__module__ == "trtllm_replayssm_module.model"
    assert mu.MODEL_CLASS_MAPPING["NemotronHForCausalLM"] is cls
    assert mu.MODEL_CLASS_MAPPING["NemotronHPuzzleForCausalLM"] is cls  # Puzzle checkpoints too
    assert mixer_cls.__init__ is init_before and nh.NemotronHModel.forward is fwd_before  # nothing patched
    msgs = [r.getMessage() for r in caplog.records]
    assert any("route=registration: NemotronHForCausalLM, NemotronHPuzzleForCausalLM -> trtllm_replayssm_module.model."
               f"ReplaySSMNemotronHForCausalLM (TensorRT-LLM {FAKE_VERSION}; mixer check passed" in m for m in msgs)
    if lazy:
        assert mu.export_external_model_modules() == dict.fromkeys(("NemotronHForCausalLM", "NemotronHPuzzleForCausalLM"),
                                                                   "trtllm_replayssm_module.model")
        # a fresh worker would not find us: the warning names both packages and both fixes
        warned = [m for m in msgs if "a fresh interpreter here would not find them" in m]
        assert len(warned) == 1 and f"PYTHONPATH={REPO}:{REPO}/serve" in warned[0]
        assert f"pip install -e {REPO}" in warned[0] and "imports trtllm_replayssm" in warned[0]
    else:
        assert any("does not pass custom modules to spawned workers" in m for m in msgs)

    H, P, N, S, G, pattern = 4, 8, 16, 5, 2, "MEM*EM*E"
    layers = mod.mamba_layer_indices(pattern)
    gen = torch.Generator().manual_seed(21)
    prm = {i: fp32_params(H, gen) for i in layers}
    lookup = mu.get_registered_model_class if lazy else mu.MODEL_CLASS_MAPPING.get
    model = lookup("NemotronHForCausalLM")(model_config(pattern, prm, P, N))
    assert model.replayssm_layers == layers
    oracle = {i: mixer_cls(layer_idx=i, head_dim=P, d_state=N, **prm[i]) for i in layers}
    assert all(oracle[i].selective_state_update_func is conventional_ssu for i in layers)  # other mixers untouched
    init = torch.randn(S, H, P, N, generator=gen, dtype=F64)
    ssm_rep, ssm_conv = {i: init.clone() for i in layers}, {i: init.clone() for i in layers}
    rows = [3, -1, 1]
    for _ in range(2 * L + 1):  # crosses two flushes
        inputs = _decode_md(gen, rows, None, layers, H, P, N, G)
        md_rep, md_conv = metadata(rows, 0, ssm_rep, inputs, H, P), metadata(rows, 0, ssm_conv, inputs, H, P)
        assert model.forward(attn_metadata=md_rep) == "hidden"  # CUDA-graph runner passes it by keyword
        for i in layers:
            oracle[i].forward(md_conv)
            assert torch.allclose(md_rep.out[i][[0, 2]], md_conv.out[i][[0, 2]], rtol=1e-10, atol=1e-10)
            assert torch.equal(md_rep.out[i][1], torch.full_like(md_rep.out[i][1], SENTINEL))
            for s in (1, 3):
                assert torch.allclose(model.replayssm.current_state(i, s), ssm_conv[i][s], rtol=1e-10, atol=1e-10)
    assert model.replayssm.cursor.tolist() == [0, (2 * L + 1) % L, 0, (2 * L + 1) % L, 0]


def test_fresh_process_probe_asks_a_new_interpreter(monkeypatch):
    """The worker check runs a fresh interpreter: the package is found through PYTHONPATH (or an install),
    a name nothing provides is not."""
    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(mod.__file__).resolve().parents[1]))
    assert mod.model._fresh_process_can_import()
    assert not mod.model._fresh_process_can_import("trtllm_replayssm_module_that_does_not_exist")
    assert not mod.model._fresh_process_can_import("trtllm_replayssm_module", "trtllm_replayssm_that_does_not_exist")


def test_fresh_process_probe_needs_trtllm_replayssm_too(monkeypatch, tmp_path):
    """A worker's import of trtllm_replayssm_module.model imports trtllm_replayssm by name (no sys.path fallback
    since afda1b3), so PYTHONPATH=serve alone is not enough for an uninstalled checkout: with no install visible
    (the fresh interpreter runs without site, so without the editable install) the check fails where only serve/ is
    on PYTHONPATH, and passes with the repository root too. Checking the module alone (the old check) passed there."""
    wrapper = tmp_path / "python-no-site"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -s "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(wrapper))
    assert mod.model.WORKER_IMPORTS == ("trtllm_replayssm_module", "trtllm_replayssm")
    monkeypatch.setenv("PYTHONPATH", str(REPO / "serve"))
    assert mod.model._fresh_process_can_import("trtllm_replayssm_module")  # what the old check asked
    assert not mod.model._fresh_process_can_import("trtllm_replayssm")
    assert not mod.model._fresh_process_can_import()
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{REPO / 'serve'}")
    assert mod.model._fresh_process_can_import()


def test_a_worker_process_resolves_the_class_by_module_name(monkeypatch):
    """A spawned worker / TP rank: fresh registry, the driver's export declared, our package not imported yet.
    Looking the architecture up imports trtllm_replayssm_module.model, whose package __init__ registers."""
    mixer_cls, _ = make_fake_trtllm()
    mu, _ = fake_tree(monkeypatch, mixer_cls)
    mod.register()
    exported = mu.export_external_model_modules()

    worker_mu, worker_nh = fake_tree(monkeypatch, mixer_cls)  # the worker's own tensorrt_llm
    for name in [n for n in sys.modules if n == "trtllm_replayssm_module" or n.startswith("trtllm_replayssm_module.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(mod.__file__).resolve().parents[1]))
    worker_mu.register_external_model_modules(exported)
    assert "NemotronHForCausalLM" not in worker_mu.MODEL_CLASS_MAPPING  # released for the declared provider
    cls = worker_mu.get_registered_model_class("NemotronHForCausalLM")
    assert cls.__name__ == "ReplaySSMNemotronHForCausalLM" and cls.__module__ == "trtllm_replayssm_module.model"
    assert cls.__bases__ == (worker_nh.NemotronHForCausalLM,)
    assert sys.modules["trtllm_replayssm_module"].ROUTE == "registration"
    assert sys.modules["trtllm_replayssm_module"].MODEL_CLASS is cls


@pytest.mark.parametrize("mixer_cls, what", [
    (OldMixer, r"calls a decode kernel directly at OldMixer\.forward:\d+ selective_state_update\(\.\.\.\)"),
    (CustomOpMixer, r"calls a decode kernel directly at CustomOpMixer\.forward:\d+ "
                    r"flashinfer_selective_state_update\(\.\.\.\)"),
    (NoCallMixer, r"never calls self\.selective_state_update_func\(\.\.\.\)"),
])
@pytest.mark.parametrize("route", ["register", "install"])
def test_a_mixer_that_bypasses_the_hook_is_refused_at_load(monkeypatch, mixer_cls, what, route):
    mu, nh = fake_tree(monkeypatch, mixer_cls)
    builtin = mu.MODEL_CLASS_MAPPING["NemotronHForCausalLM"]
    init_before = nh.NemotronHModel.forward
    with pytest.raises(RuntimeError, match=rf"^trtllm_replayssm_module: TensorRT-LLM {re.escape(FAKE_VERSION)}: "
                                           rf"(tests\.)?test_trtllm_serve_module\.{mixer_cls.__name__} {what}.*ReplaySSM would "
                                           r"silently not run, so loading stops here\..*Verified against: .*02140fd4"):
        getattr(mod, route)()
    assert mu.MODEL_CLASS_MAPPING["NemotronHForCausalLM"] is builtin and nh.NemotronHModel.forward is init_before


def test_a_decode_step_that_never_reaches_the_adapter_raises(monkeypatch):
    """The run-time check: the source still names the hook, but decode rows go elsewhere."""
    mu, _ = fake_tree(monkeypatch, SneakyMixer)
    cls = mod.register()
    H, P, N, S, G, pattern = 4, 8, 16, 3, 2, "M*M"
    gen = torch.Generator().manual_seed(4)
    prm = {i: fp32_params(H, gen) for i in (0, 2)}
    model = cls(model_config(pattern, prm, P, N))
    ssm = {i: torch.randn(S, H, P, N, generator=gen, dtype=F64) for i in (0, 2)}
    model.forward(metadata([1], 1, ssm, _decode_md(gen, [1], ssm, (0, 2), H, P, N, G, num_contexts=1), H, P))  # prefill
    md = metadata([1, 2], 0, ssm, _decode_md(gen, [1, 2], ssm, (0, 2), H, P, N, G), H, P)
    with pytest.raises(RuntimeError, match=r"SneakyMixer ran a model step with 2 decode rows in which no Mamba-2 layer "
                                           r"called the replaced selective_state_update_func\. "):
        model.forward(md)
    model.replayssm.begin_step()  # the failed step left no open step behind
    model.replayssm.abort_step()


def test_without_register_auto_model_the_monkeypatch_is_the_fallback(monkeypatch, caplog):
    mixer_cls, _ = make_fake_trtllm()
    fake_tree(monkeypatch, mixer_cls, with_register=False)
    try:
        with caplog.at_level("WARNING", logger="trtllm_replayssm_module"):
            route, adapter = mod.load()
        assert route == "monkeypatch" and isinstance(adapter, ReplaySSMAdapter)
        assert any("route=monkeypatch (fallback; model registry unavailable" in r.getMessage() for r in caplog.records)
        assert mixer_cls.__init__.__wrapped__ is not None
    finally:
        uninstall()


def test_a_speculative_config_is_refused_at_construction(monkeypatch):
    mixer_cls, _ = make_fake_trtllm()
    fake_tree(monkeypatch, mixer_cls)
    cls = mod.register()
    with pytest.raises(RuntimeError, match=r"a speculative_config is set; ReplaySSM routes single-token decode only"):
        cls(model_config("M", {}, 8, 16, spec_config=object()))


def test_register_is_idempotent_and_verified_against_names_commits(monkeypatch):
    mixer_cls, _ = make_fake_trtllm()
    mu, _ = fake_tree(monkeypatch, mixer_cls)
    assert mod.register() is mod.register() is mu.MODEL_CLASS_MAPPING["NemotronHForCausalLM"]
    assert {v.commit.split()[0] for v in mod.VERIFIED_AGAINST} >= {"02140fd4", "595da613", "00620eb0", "cb4c622c"}
    assert mod.verified_summary().startswith("TensorRT-LLM PyTorch backend, read from source (not run): ")


def test_register_against_real_tensorrt_llm():
    pytest.importorskip("tensorrt_llm", reason="tensorrt_llm is not installed here (its PyPI package is a stub that "
                                               "downloads from NVIDIA's index); run where it is")
    from tensorrt_llm._torch.models import modeling_utils
    from tensorrt_llm._torch.modules.mamba.mamba2_mixer import Mamba2Mixer

    assert mod.check_mixer_class(Mamba2Mixer)  # raises, naming the version, where the decode moved
    cls = mod.register()
    lookup = getattr(modeling_utils, "get_registered_model_class", modeling_utils.MODEL_CLASS_MAPPING.get)
    assert lookup("NemotronHForCausalLM") is cls


# ---- packaging: the module imports trtllm_replayssm by name, with no sys.path fallback -------------------------
REPO = pathlib.Path(__file__).resolve().parents[1]


def _isolated(code: str, cwd) -> str:
    """stderr + stdout of ``code`` in an interpreter without site-packages' .pth files (so no editable install),
    the user site or the working directory on sys.path."""
    import subprocess

    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300)
    return done.stderr + done.stdout


def test_without_trtllm_replayssm_the_import_says_how_to_install(tmp_path):
    """Only serve/ importable: the module's import fails with an ImportError naming the pip install of this
    repository (and no repository path lands on sys.path); where trtllm_replayssm is found but one of its own
    dependencies is not, that error is kept (not misread as a missing install)."""
    serve = str(REPO / "serve")
    out = _isolated(f"import sys; sys.path.insert(0, {serve!r}); import trtllm_replayssm_module", tmp_path)
    last = out.strip().splitlines()[-1]
    assert last.startswith("ImportError: trtllm_replayssm_module: the trtllm_replayssm package is not installed"), out
    assert f"pip install {REPO} " in last and f"pip install -e {REPO} " in last and "PYTHONPATH" in last
    out = _isolated(f"import sys; sys.path[:0] = [{serve!r}, {str(REPO)!r}]; import trtllm_replayssm_module", tmp_path)
    last = out.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named ") and "not installed" not in last, out


def test_a_non_editable_install_imports_without_the_repository(tmp_path):
    """``pip install . --target DIR --no-deps`` of a copy of the sources: trtllm_replayssm_module, trtllm_replayssm_vllm,
    trtllm_replayssm (with its plugin sources and family folders) and builders import from DIR in an interpreter that
    has neither the repository nor the editable install on sys.path (pyproject.toml's packages)."""
    import ast
    import shutil
    import subprocess
    import sysconfig

    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip("pip is not available")
    src, target = tmp_path / "src", tmp_path / "target"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for d in ("trtllm_replayssm", "plugins", "builders", "serve"):
        shutil.copytree(REPO / d, src / d, ignore=skip)
    done = subprocess.run([sys.executable, "-m", "pip", "install", str(src), "--target", str(target), "--no-deps",
                           "--no-build-isolation", "--no-index", "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    code = (f"import sys; sys.path[:0] = [{str(target)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
            "import importlib.resources, trtllm_replayssm_module, trtllm_replayssm_vllm, trtllm_replayssm, builders.engine\n"
            "import builders.decode_step, trtllm_replayssm.families.gdn.steps, trtllm_replayssm.families.mamba2.trt_plugin\n"
            "mods = [trtllm_replayssm_module, trtllm_replayssm_vllm, trtllm_replayssm, builders.decode_step, builders.engine,\n"
            "        trtllm_replayssm.families.gdn.steps, trtllm_replayssm.families.mamba2.trt_plugin]\n"
            "print([m.__file__ for m in mods])\n"
            "print(sorted(f'{d.name}/{p.name}' for d in importlib.resources.files('trtllm_replayssm.plugins').iterdir()\n"
            "             if d.is_dir() and d.name != '__pycache__' for p in d.iterdir()))\n"
            "print(sorted({m.__file__.split('/site-packages/')[0] for m in list(sys.modules.values())\n"
            f"             if {str(REPO)!r} in (getattr(m, '__file__', None) or '')}}))")
    out = _isolated(code, tmp_path).strip().splitlines()
    assert len(out) == 3, out
    files, plugin_files, from_repo = (ast.literal_eval(line) for line in out)
    assert all(f.startswith(str(target)) for f in files), files
    assert {"mamba2/replayssm_decode.cu", "mamba2/replayssm.cuh", "gdn/gdn_decode.cu", "kda/kda_decode.cu",
            "common/convert.cuh", "common/scan.cuh"} <= set(plugin_files)  # the family folders ship
    assert from_repo == [], from_repo
