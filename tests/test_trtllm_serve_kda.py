# SPDX-License-Identifier: Apache-2.0
"""The trtllm-serve module's KDA route (serve/trtllm_replayssm_module/kda.py) on the CPU: Kimi-Linear and GLM-5 Next.

tensorrt_llm cannot be installed here, so the route is driven through a stand-in of the call site it routes, written
from TensorRT-LLM's source (kimi_kda_mixer.py 0790edf6): ``KimiKDALinearAttention`` keeps a per-instance ``_dispatch``
and its single-token decode (``forward_decode``) calls ``self._dispatch.decode_kda(...)`` with the pre-conv projections
(1, B, H, D), transposed conv weights (W, H D), the live conv pool's section views [slots, H D, W - 1] and
``update_conv_cache=True``, raw forget-gate and beta projections, the V-first fp32 state pool [slots, H, V, K] with
``ssm_state_indices``, the output gate and o_norm weight, and a preallocated ``out`` (B, 1, H, D); its prefill writes
the pools of the prefill rows' slots (here: given states and windows). The model's ``forward(attn_metadata)`` runs its
layers (KDA layers 0 and 2; layer 1 is another kind that never decodes through a dispatch).

Oracle: the same stand-in left unrouted, whose dispatch is ``trtllm::kda_decode``'s semantics written out per row and
head in float64 on the V-first state (conv over the window, silu; the gate g = -exp(A_log) softplus(f + dt_bias)
(Kimi) or lower sigmoid(exp(A_log) (f + dt_bias)) (GLM-5 Next); beta = sigmoid(b); q, k l2-normalised, q scaled;
S <- exp(g) S; u = beta (v - S k); S <- S + u k^T; y = S q; the gated RMSNorm), not our reference. Both run in float64
(the adapter's checkpoint and rings in float64, as the pool; A_log and dt_bias fp32 values), so agreement is ~1e-13
and 1e-10 leaves room over 3L+2 steps with rows prefilled at different steps. Conv pools and untouched slots are
compared exactly. Teeth: a corrupted
ring entry is caught. The registration route runs against a stand-in tensorrt_llm tree (test_trtllm_serve_module.py's
model registry, the KDA mixer module and the two model modules); what needs the real tensorrt_llm skips, saying why.
"""

from __future__ import annotations

import pathlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "serve"))
import trtllm_replayssm_module as mod  # noqa: E402
from trtllm_replayssm_module import kda  # noqa: E402

from .test_trtllm_serve_module import FAKE_VERSION, ZOO, make_registry  # noqa: E402

F64 = torch.float64
L, H, D, W, S = 4, 2, 8, 4, 5
KDA_LAYERS = (0, 2)
TOL = 1e-10  # module docstring: float64 on both sides, sums reordered
SENTINEL = 77.5


# ---- the oracle: trtllm::kda_decode's semantics, per row and head, V-first --------------------------------------
def conventional_decode_kda(*, x_q, x_k, x_v, w_q_t, w_k_t, w_v_t, cs_q, cs_k, cs_v, A_log, g, dt_bias, beta, state,
                            onorm_g, onorm_weight, out=None, ssm_state_indices=None, scale=None, onorm_eps=1e-6,
                            lower_bound=None, use_beta_sigmoid_in_kernel=True, update_conv_cache=True, **_):
    B, d = x_q.shape[1], x_q.shape[2] * x_q.shape[3]
    o = torch.empty(B, 1, H, D, dtype=x_q.dtype)
    for b, s in enumerate(ssm_state_indices.tolist()):
        qkv = []
        for x, w_t, cs in ((x_q, w_q_t, cs_q), (x_k, w_k_t, cs_k), (x_v, w_v_t, cs_v)):
            win = torch.cat([cs[s], x[0, b].reshape(d, 1)], dim=1)  # (d, W): the last W-1 inputs, then the new one
            c = (win * w_t.t()).sum(-1)
            qkv.append((c * torch.sigmoid(c)).reshape(H, D))
            if update_conv_cache:
                cs[s] = win[:, 1:]
        q, k, v = qkv
        for h in range(H):
            a = g[0, b, h] + dt_bias.reshape(H, D)[h]
            gate = (lower_bound * torch.sigmoid(A_log[h].exp() * a) if lower_bound is not None
                    else -A_log[h].exp() * F.softplus(a))
            bt = torch.sigmoid(beta[0, b, h])
            qh = q[h] / torch.sqrt((q[h] * q[h]).sum() + 1e-6) * (scale if scale is not None else D ** -0.5)
            kh = k[h] / torch.sqrt((k[h] * k[h]).sum() + 1e-6)
            Svk = state[s, h] * gate.exp()[None, :]  # (V, K): the decay is per key channel
            u = bt * (v[h] - Svk @ kh)
            Svk = Svk + u[:, None] * kh[None, :]
            state[s, h] = Svk
            y = Svk @ qh
            y = y / torch.sqrt((y * y).mean() + onorm_eps) * onorm_weight
            o[b, 0, h] = y * torch.sigmoid(onorm_g[0, b, h])
    if out is not None:
        out.copy_(o)
        return out
    return o


class OracleDispatch:
    decode_kernel_path = "fallback"  # TensorRT-LLM's own, on a GPU without its kernels

    def __init__(self):
        self.prefills = 0

    def decode_kda(self, **kw):
        return conventional_decode_kda(**kw)

    def prefill_chunk_kda(self, **kw):  # delegated by ReplayDispatch (never called in these tests)
        self.prefills += 1
        return "prefill"


# ---- stand-in of TensorRT-LLM's KDA mixer and model ----------------------------------------------------------------
def _params(gen, layer_idx):
    """One KDA layer's parameters; A_log and dt_bias hold fp32 values (TensorRT-LLM keeps them in fp32, the adapter
    passes them on as fp32)."""
    d = H * D
    return dict(w_t=[torch.randn(W, d, generator=gen, dtype=F64) * 0.5 for _ in range(3)],
                A_log=torch.empty(H, dtype=F64).uniform_(-1, 1, generator=gen).float().double(),
                dt_bias=(torch.randn(d, generator=gen, dtype=F64) - 2).float().double(),
                onorm_weight=1 + 0.1 * torch.randn(D, generator=gen, dtype=F64))


class KimiKDALinearAttention(torch.nn.Module):
    """The decode call site of TensorRT-LLM's mixer (module docstring), over the step's per-layer inputs."""

    def __init__(self, layer_idx, prm, lower_bound):
        super().__init__()
        self.layer_idx, self.prm, self.gate_lower_bound = layer_idx, prm, lower_bound
        self.o_proj = torch.nn.Linear(1, 1, dtype=F64)
        self._dispatch = OracleDispatch()

    def forward(self, md):
        cache = md.kv_cache_manager.mamba_layer_cache(self.layer_idx)
        n_ctx = md.num_contexts
        for r in range(n_ctx):  # prefill: TensorRT-LLM's chunked kernels write the slot's pools
            s = int(md.mamba_metadata.state_indices[r])
            cache.temporal[s] = md.prefill[self.layer_idx][r]
            cache.conv[s] = md.prefill_conv[self.layer_idx][r]
        if md.num_seqs == n_ctx:
            return
        inp, p, d = md.inputs[self.layer_idx], self.prm, H * D
        self._dispatch.decode_kda(
            x_q=inp["x"][:, :, :d].reshape(1, -1, H, D), x_k=inp["x"][:, :, d:2 * d].reshape(1, -1, H, D),
            x_v=inp["x"][:, :, 2 * d:].reshape(1, -1, H, D), w_q_t=p["w_t"][0], w_k_t=p["w_t"][1], w_v_t=p["w_t"][2],
            bias_q=None, bias_k=None, bias_v=None, cs_q=cache.conv[:, :d], cs_k=cache.conv[:, d:2 * d],
            cs_v=cache.conv[:, 2 * d:], A_log=p["A_log"], g=inp["g"], dt_bias=p["dt_bias"], beta=inp["beta"],
            state=cache.temporal, onorm_g=inp["onorm_g"], onorm_weight=p["onorm_weight"],
            out=md.out[self.layer_idx], ssm_state_indices=md.mamba_metadata.state_indices[n_ctx:md.num_seqs],
            scale=D ** -0.5, onorm_eps=1e-6, lower_bound=self.gate_lower_bound, use_beta_sigmoid_in_kernel=True,
            verbose=False, update_conv_cache=True)


class OtherLayer(torch.nn.Module):
    def forward(self, md):
        return None


class FakeKDAModel(torch.nn.Module):
    """KimiLinearForCausalLM / Glm5NextForCausalLM as far as the route sees them: layers, forward(attn_metadata)."""

    mixer_cls = KimiKDALinearAttention

    def __init__(self, model_config):
        super().__init__()
        self.model_config = model_config
        self.layers = torch.nn.ModuleList([self.mixer_cls(i, model_config.params[i], model_config.lower_bound)
                                           if i in KDA_LAYERS else OtherLayer() for i in range(3)])

    def forward(self, attn_metadata, input_ids=None, **kwargs):
        for layer in self.layers:
            layer(attn_metadata)
        return "hidden"


class Manager:
    def __init__(self, pools, convs):
        self.pools, self.convs = pools, convs

    def mamba_layer_cache(self, i):
        return types.SimpleNamespace(temporal=self.pools[i], conv=self.convs[i])


def metadata(gen, prefill_slots, decode_slots, manager):
    """attn_metadata of one step: prefill rows first (their states and windows), then decode rows (their inputs)."""
    n_ctx, n = len(prefill_slots), len(decode_slots)
    md = types.SimpleNamespace(num_contexts=n_ctx, num_seqs=n_ctx + n, kv_cache_manager=manager,
                               mamba_metadata=types.SimpleNamespace(
                                   state_indices=torch.tensor(prefill_slots + decode_slots, dtype=torch.int32)))
    md.prefill = {i: torch.randn(n_ctx, H, D, D, generator=gen, dtype=F64) * 0.3 for i in KDA_LAYERS}
    md.prefill_conv = {i: torch.randn(n_ctx, 3 * H * D, W - 1, generator=gen, dtype=F64) for i in KDA_LAYERS}
    md.inputs = {i: dict(x=torch.randn(1, n, 3 * H * D, generator=gen, dtype=F64),
                         g=torch.randn(1, n, H, D, generator=gen, dtype=F64),
                         beta=torch.randn(1, n, H, generator=gen, dtype=F64),
                         onorm_g=torch.randn(1, n, H, D, generator=gen, dtype=F64)) for i in KDA_LAYERS}
    md.out = {i: torch.full((n, 1, H, D), SENTINEL, dtype=F64) for i in KDA_LAYERS}
    return md


def twin(md, manager):
    """The same step's metadata over another manager (the oracle's pools), inputs shared."""
    return types.SimpleNamespace(**{**vars(md), "kv_cache_manager": manager,
                                    "out": {i: torch.full_like(t, SENTINEL) for i, t in md.out.items()}})


def _config(gen, lower_bound, spec_config=None):
    return types.SimpleNamespace(params={i: _params(gen, i) for i in KDA_LAYERS}, lower_bound=lower_bound,
                                 spec_config=spec_config)


def _pools(gen):
    pools = {i: torch.randn(S, H, D, D, generator=gen, dtype=F64) for i in KDA_LAYERS}
    convs = {i: torch.randn(S, 3 * H * D, W - 1, generator=gen, dtype=F64) for i in KDA_LAYERS}
    return pools, convs


# (prefill slots, decode slots) per step: slot 3 prefilled alone, slot 1 joins while 3 decodes, slot 3 re-prefilled
# (a new request in the slot) after 3L + 2 decode steps of it; slot 2 decodes nothing (its pools never move)
SCHEDULE = ([([3], []), ([], [3]), ([1], [3])] + [([], [3, 1])] * (3 * L) + [([3], [1]), ([], [1, 3]), ([], [3, 1])])


def _pair(monkeypatch, lower_bound=None, shadow=None, seed=5):
    """(routed model, oracle model, the routed side's pools, the oracle's pools, the initial pools)."""
    monkeypatch.setenv("TRTLLM_REPLAYSSM_BUFFER_LEN", str(L))
    if shadow:
        monkeypatch.setenv("TRTLLM_REPLAYSSM_SHADOW", shadow)
    gen = torch.Generator().manual_seed(seed)
    cfg = _config(gen, lower_bound)
    routed = kda.make_kda_model_class(FakeKDAModel, KimiKDALinearAttention)(cfg)
    pools, convs = _pools(gen)
    mine = Manager({i: t.clone() for i, t in pools.items()}, {i: t.clone() for i, t in convs.items()})
    ref = Manager({i: t.clone() for i, t in pools.items()}, {i: t.clone() for i, t in convs.items()})
    return routed, FakeKDAModel(cfg), mine, ref, (pools, convs), gen


def _step(routed, oracle, mine, ref, gen, prefill, decode):
    md = metadata(gen, prefill, decode, mine)
    md2 = twin(md, ref)
    assert routed.forward(attn_metadata=md) == "hidden"  # the CUDA-graph runner passes it by keyword
    oracle.forward(md2)
    return md.out, md2.out


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["kimi_gate", "glm5_bounded_gate"])
def test_routed_decode_equals_trtllm_kernel_semantics(monkeypatch, lower_bound):
    """The routed model (make_kda_model_class over the stand-in) against the unrouted one over SCHEDULE: outputs
    (1e-10), conv pools (exact: the windows are the inputs, shifted), the state our checkpoint and rings stand for
    against the oracle's pool (1e-10), TensorRT-LLM's pool of a decoding slot left as its prefill wrote it, slot 2
    untouched, the cursor counting each slot's decode steps since its prefill mod L."""
    routed, oracle, mine, ref, (pools, convs), gen = _pair(monkeypatch, lower_bound)
    cls = type(routed)
    assert cls.__name__ == "ReplaySSMFakeKDAModel" and cls.__module__ == "trtllm_replayssm_module.kda"
    assert cls.__bases__ == (FakeKDAModel,) and routed.replayssm_layers == list(KDA_LAYERS)
    assert routed.replayssm.buffer_len == L and routed.replayssm.layers == KDA_LAYERS
    assert all(type(routed.layers[i]._dispatch) is kda.ReplayDispatch for i in KDA_LAYERS)
    assert routed.layers[0]._dispatch.prefill_chunk_kda() == "prefill"  # delegated to TensorRT-LLM's dispatch
    assert routed.layers[0]._dispatch.decode_kernel_path == "optimized"  # both decode paths reach decode_kda
    since, prefilled = {}, {}
    for prefill, decode in SCHEDULE:
        got, want = _step(routed, oracle, mine, ref, gen, prefill, decode)
        for s in decode:
            since[s] += 1
        for s in prefill:
            since[s] = 0
            prefilled[s] = {i: mine.pools[i][s].clone() for i in KDA_LAYERS}
        for i in KDA_LAYERS:
            torch.testing.assert_close(got[i], want[i], rtol=TOL, atol=TOL)
            assert torch.equal(mine.convs[i], ref.convs[i]), i
            for s in since:
                torch.testing.assert_close(routed.replayssm.current_state(i, s), ref.pools[i][s], rtol=TOL, atol=TOL)
                assert torch.equal(mine.pools[i][s], prefilled[s][i])  # decode never writes TensorRT-LLM's pool
            assert torch.equal(mine.pools[i][2], pools[i][2]) and torch.equal(mine.convs[i][2], convs[i][2])
        assert routed.replayssm.cache.cursor.tolist() == [since.get(s, 0) % L for s in range(S)]
    assert since == {3: 2, 1: 3 * L + 3}


def test_teeth_a_corrupted_ring_entry_is_caught(monkeypatch):
    """One u entry of slot 3's ring scaled mid-window (a step that does not fold: the output path reads u): the next
    outputs leave the oracle's (so the comparison above can fail), the other slot's do not."""
    routed, oracle, mine, ref, _, gen = _pair(monkeypatch)
    for prefill, decode in SCHEDULE[:3]:
        _step(routed, oracle, mine, ref, gen, prefill, decode)
    c = routed.replayssm.cache
    assert int(c.cursor[3]) == 2 and int(c.cursor[1]) == 0
    c.layer(0).buf.u_cache[3, :, 0].mul_(1.5)
    got, want = _step(routed, oracle, mine, ref, gen, [], [3, 1])
    assert not torch.allclose(got[0][0], want[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0][1], want[0][1], rtol=TOL, atol=TOL)


def test_bf16_shadow_is_read_and_stays_out_of_the_state(monkeypatch):
    """TRTLLM_REPLAYSSM_SHADOW=bf16: outputs within the shadow's rounding of the oracle's (not equal), and after a
    flush the state is the oracle's to 1e-10 again (the checkpoint is folded from full precision)."""
    routed, oracle, mine, ref, _, gen = _pair(monkeypatch, shadow="bf16")
    diffs = []
    for prefill, decode in SCHEDULE[:2 + L]:
        got, want = _step(routed, oracle, mine, ref, gen, prefill, decode)
        if decode:
            diffs.append(float((got[0] - want[0]).abs().max()))
    assert routed.replayssm.cache.layer(0).shadow is not None
    # bf16 rounding (2^-9 relative) of an O(1) checkpoint, through the gated norm of O(1) outputs
    assert 0 < max(diffs) < 5e-2, diffs
    for i in KDA_LAYERS:
        torch.testing.assert_close(routed.replayssm.current_state(i, 3), ref.pools[i][3], rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="no fp8 KDA shadow"):
        kda.KDAReplayAdapter(shadow="fp8")


def test_gated_norm_is_the_models_own():
    """gated_rms_norm equals transformers' GLM-5 Next / Kimi-Linear output norm module (fp32)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextRMSNormGated
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated

    gen = torch.Generator().manual_seed(1)
    y, gate = torch.randn(3, H, D, generator=gen), torch.randn(3, H, D, generator=gen)
    for cls in (Glm5NextTextRMSNormGated, KimiLinearRMSNormGated):
        norm = cls(D, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(D, generator=gen))
            want = norm(y, gate)
        torch.testing.assert_close(kda.gated_rms_norm(y, gate, norm.weight, 1e-5, torch.float32), want, rtol=1e-6,
                                   atol=1e-6)


# ---- refusals, each before anything is written ---------------------------------------------------------------------
def _decode_kw(md, layer_idx, mixer):
    """The keyword arguments the stand-in's decode passes, captured."""
    seen = {}
    real = mixer._dispatch
    mixer._dispatch = types.SimpleNamespace(decode_kda=lambda **kw: seen.update(kw), decode_kernel_path="optimized")
    try:
        mixer(md)
    finally:
        mixer._dispatch = real
    return seen


@pytest.mark.parametrize("change, exc, match", [
    (dict(ssm_state_indices=None), NotImplementedError, "ssm_state_indices: None .* TLLM_KDA_ENABLE_INDEXED_STATE_POOL"),
    (dict(use_beta_sigmoid_in_kernel=False), NotImplementedError, "use_beta_sigmoid_in_kernel: expected True"),
    (dict(x_q=torch.zeros(2, 1, H, D, dtype=F64)), NotImplementedError, "multi-token / speculative verify"),
    (dict(rand_seed=3), TypeError, "unexpected argument 'rand_seed'"),
    (dict(beta=torch.zeros(1, 1, H + 1, dtype=F64)), ValueError, r"beta: expected \(1, 1, 2\)"),
    (dict(out=torch.zeros(3, dtype=F64)), ValueError, "out: expected 16 elements"),
])
def test_unsupported_arguments_are_named(monkeypatch, change, exc, match):
    routed, _, mine, _, _, gen = _pair(monkeypatch)
    kw = _decode_kw(metadata(gen, [], [3], mine), 0, routed.layers[0])
    ad = routed.replayssm
    with pytest.raises(exc, match=match):
        ad.decode_kda(0, **{**kw, **change})
    assert ad._sbi is None or not ad._decoded  # nothing was verified


def test_state_pool_dtype_activations_and_layers_are_checked(monkeypatch):
    routed, _, mine, _, _, gen = _pair(monkeypatch)
    ad = routed.replayssm
    kw = _decode_kw(metadata(gen, [], [3], mine), 0, routed.layers[0])
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype: float32"):
        ad.decode_kda(0, **{**kw, "state": kw["state"].to(torch.bfloat16)})
    with pytest.raises(RuntimeError, match=r"layer 1: a decode_kda call from a layer that was not routed"):
        ad.decode_kda(1, **kw)
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == F64 and k != "state" else v)
           for k, v in kw.items()}
    with pytest.raises(ValueError, match="x_q: expected torch.float64 activations"):
        ad.decode_kda(0, **f32)
    ad.abort_step()
    ad.decode_kda(0, **kw)
    with pytest.raises(RuntimeError, match="layer 0: decoded twice in one model step"):
        ad.decode_kda(0, **kw)
    with pytest.raises(RuntimeError, match=r"end_step: KDA layers \[2\] made no decode_kda call"):
        ad.end_step()
    assert ad._sbi is None and int(ad.cache.cursor[3]) == 0  # aborted: nothing committed
    with pytest.raises(ValueError, match="buffer_len: expected an int in 1..32"):
        kda.KDAReplayAdapter(buffer_len=0)


def test_cache_managers_that_move_slots_without_a_hook_or_reuse_blocks_are_refused(monkeypatch):
    """A manager that can move slots but has none of the relocation hooks we follow (here a relocate_slots of its
    own, which no TensorRT-LLM manager has), block reuse, and a speculative config are refused by name."""
    routed, _, mine, _, _, gen = _pair(monkeypatch)
    md = metadata(gen, [], [3], mine)

    class V2Like(Manager):
        def relocate_slots(self, old_slots, new_slots):
            pass

    md.kv_cache_manager = V2Like(mine.pools, mine.convs)
    with pytest.raises(RuntimeError, match="exposes no relocation hook.*relocate_slots.* use_kv_cache_manager_v2=False"):
        routed.forward(md)
    md.kv_cache_manager = Manager(mine.pools, mine.convs)
    md.kv_cache_manager.enable_block_reuse = True
    with pytest.raises(RuntimeError, match="enable_block_reuse is on"):
        routed.forward(md)
    with pytest.raises(RuntimeError, match="a speculative_config is set"):
        type(routed)(types.SimpleNamespace(**{**vars(routed.model_config), "spec_config": object()}))


# ---- V2 managers: live requests relocated between slots -------------------------------------------------------------
class Strategy:
    """The state-update strategy of a non-speculative V2 manager (common.py 28295084, ``MambaStateUpdateStrategy``):
    ``relocate_slots`` / ``reset_slots`` own nothing to move. Records its calls (TensorRT-LLM's own runs first)."""

    def __init__(self):
        self.calls = []

    def relocate_slots(self, old_slots, new_slots):
        self.calls.append((list(old_slots), list(new_slots)))

    def reset_slots(self, slots, host_slots):
        pass


def _strided_pools(pools, convs):
    """V2's state views (mamba_cache_manager_v2.py 28295084, ``_get_state_buffer``): the KDA layers' same-size states
    share one page per slot, so each layer's view is ``as_strided`` with slot stride 2 x one state (here KDA_LAYERS
    interleaved in one buffer, ssm and conv alike); values copied from ``pools`` / ``convs``."""
    out = []
    for src in (pools, convs):
        raw = torch.empty(2 * S, *src[KDA_LAYERS[0]].shape[1:], dtype=F64)
        views = {i: raw[j::2] for j, i in enumerate(KDA_LAYERS)}
        for i, v in views.items():
            assert not v.is_contiguous()
            v.copy_(src[i])
        out.append(views)
    return out


class V2Manager(Manager):
    """MambaHybridCacheManagerV2 as far as relocation goes (mamba_cache_manager_v2.py 28295084,
    ``_setup_state_indices`` from ``prepare_resources``, before the step's forward): the generation requests' slots
    change; V2 has moved their pages (ssm and conv states: the request's pool rows are at its new slot); then the hook
    gets (old slots, new slots) of the generation requests, -1 for a request it has not seen. ``hook``: "strategy"
    (``get_state_update_strategy().relocate_slots``, 28295084) or "method" (``self._on_state_slots_relocated``, the
    earlier V2 manager)."""

    def __init__(self, pools, convs, hook="strategy"):
        super().__init__(*_strided_pools(pools, convs))
        self.hook, self.strategy, self.slot_of, self.method_calls = hook, Strategy(), {}, []
        if hook == "strategy":
            self.get_state_update_strategy = lambda: self.strategy

    def _on_state_slots_relocated(self, old_slots, new_slots):
        if self.hook != "method":
            raise AssertionError("the strategy's hook is the one called")
        self.method_calls.append((list(old_slots), list(new_slots)))

    def prepare(self, generation: dict, finished=()):
        """Slots of this step's generation requests ({request: slot}); ``finished`` requests are freed first."""
        for r in finished:
            self.slot_of.pop(r)
        old = [self.slot_of.get(r, -1) for r in generation]
        new = list(generation.values())
        moves = [(o, n) for o, n in zip(old, new) if o >= 0 and o != n]
        if moves:  # the pages move with the requests: gathered before any is written
            src, dst = (torch.tensor(v) for v in zip(*moves))
            for t in (*self.pools.values(), *self.convs.values()):
                t[dst] = t[src].clone()
        self.slot_of.update(generation)
        if self.hook == "strategy":
            self.get_state_update_strategy().relocate_slots(old, new)
        else:
            self._on_state_slots_relocated(old, new)


def _retarget(md, manager, prefill_slots, decode_slots):
    """md's inputs (row by row) over another manager and other slots; fresh outputs."""
    return types.SimpleNamespace(**{**vars(md), "kv_cache_manager": manager,
                                    "mamba_metadata": types.SimpleNamespace(state_indices=torch.tensor(
                                        prefill_slots + decode_slots, dtype=torch.int32)),
                                    "out": {i: torch.full_like(t, SENTINEL) for i, t in md.out.items()}})


# Requests A, B, C; their slots without relocation (the oracle's and the twin's) and, per step, the relocated run's.
HOME = {"A": 3, "B": 1, "C": 4}
# (prefill, decode, finished before the step, relocated slots {request: slot} of the step)
RELOCATIONS = (
    [(["A"], [], (), {"A": 3}),
     (["B", "C"], ["A"], (), {"A": 3, "B": 1, "C": 4}),
     ([], ["A", "B", "C"], (), {"A": 3, "B": 1, "C": 4}),
     ([], ["A", "B", "C"], (), {"A": 3, "B": 1, "C": 4}),
     # C done; A (cursor 3: mid-ring) moves onto C's freed slot 4, which still holds C's rings and cursor 2
     ([], ["A", "B"], ("C",), {"A": 4, "B": 1}),
     # a swap: A (cursor 0, just flushed) and B (cursor 3)
     ([], ["A", "B"], (), {"A": 1, "B": 4})]
    + [([], ["A", "B"], (), {"A": 1, "B": 4})] * (L + 1)
    # a chain: A leaves slot 1 for 0 while B takes slot 1 (a destination that is another move's source)
    + [([], ["A", "B"], (), {"A": 0, "B": 1})] * (2 * L + 2))


@pytest.mark.parametrize("hook", ["strategy", "method"])
@pytest.mark.parametrize("shadow", [None, "bf16"])
def test_relocated_requests_continue_as_if_never_moved(monkeypatch, hook, shadow):
    """A V2 manager (stand-in above, strided pools) relocating live requests between steps (RELOCATIONS: mid-ring,
    onto a slot freed earlier, a swap, a chain) against the same requests never moved: outputs, every layer's state
    and the cursors of the relocated run equal a routed twin's (V1 manager, slots HOME) bit for bit, and the unrouted
    oracle's outputs to 1e-10 (fp32 checkpoint; with the bf16 shadow the twin comparison alone)."""
    routed, oracle, mine, ref, (pools, convs), gen = _pair(monkeypatch, shadow=shadow)
    twin_model = kda.make_kda_model_class(FakeKDAModel, KimiKDALinearAttention)(routed.model_config)
    v2 = V2Manager(pools, convs, hook)
    ad, tw = routed.replayssm, twin_model.replayssm
    moved = 0
    for prefill, decode, finished, where in RELOCATIONS:
        v2.prepare({r: where[r] for r in decode}, finished)
        for r in prefill:
            v2.slot_of[r] = where[r]
        md = metadata(gen, [HOME[r] for r in prefill], [HOME[r] for r in decode], mine)
        md_v2 = _retarget(md, v2, [where[r] for r in prefill], [where[r] for r in decode])
        md_ref = _retarget(md, ref, [HOME[r] for r in prefill], [HOME[r] for r in decode])
        twin_model.forward(attn_metadata=md)
        routed.forward(attn_metadata=md_v2)
        oracle.forward(md_ref)
        moved += sum(where[r] != HOME[r] for r in decode)
        for i in KDA_LAYERS:
            assert torch.equal(md_v2.out[i], md.out[i]), i
            if shadow is None:
                torch.testing.assert_close(md_v2.out[i], md_ref.out[i], rtol=TOL, atol=TOL)
            for r in decode:
                assert torch.equal(ad.current_state(i, where[r]), tw.current_state(i, HOME[r])), (i, r)
                assert torch.equal(v2.convs[i][where[r]], mine.convs[i][HOME[r]]), (i, r)
        for r in decode:
            assert int(ad.cache.cursor[where[r]]) == int(tw.cache.cursor[HOME[r]]), r
    assert moved > 0
    calls = v2.strategy.calls if hook == "strategy" else v2.method_calls
    assert ([4, 1], [1, 4]) in calls and ([1, 4], [0, 1]) in calls  # the swap and the chain reached the hook
    if hook == "strategy":  # our follower wraps TensorRT-LLM's own hook on the instance, which still runs
        assert type(v2.strategy).relocate_slots is Strategy.relocate_slots
        assert len(v2.strategy.relocate_slots.replayssm_followers) == 1


def test_a_relocation_moves_only_the_moved_slots(monkeypatch):
    """The follower alone (no model step): slots that are no destination keep everything, sources included; a move
    before the cache exists is a no-op; a relocation inside an open step is refused; bad destinations are named."""
    routed, _, mine, _, (pools, convs), gen = _pair(monkeypatch)
    ad = routed.replayssm
    ad.relocate([3], [1])  # nothing allocated yet
    for prefill, decode in SCHEDULE[:4]:
        routed.forward(attn_metadata=metadata(gen, prefill, decode, mine))
    c = ad.cache
    before = c.snapshot(range(S))
    install = sys.modules["trtllm_replayssm_module.install"]
    src, dst = install.relocation_moves([3, 1, 2, -1], [1, 3, 2, 0])  # a swap; 2 stays; -1 is a fresh request
    assert (src, dst) == ([3, 1], [1, 3])
    ad.relocate(src, dst)
    after = c.snapshot(range(S))
    for name, t in before.tensors.items():
        dim = 0 if name == "cursor" else 1
        for s_old, s_new in ((3, 1), (1, 3), (0, 0), (2, 2), (4, 4)):
            assert torch.equal(after.tensors[name].select(dim, s_new), t.select(dim, s_old)), (name, s_old)
    with pytest.raises(ValueError, match="distinct destination slots"):
        install.relocation_moves([3, 1], [0, 0])
    with pytest.raises(IndexError, match="expected slots in 0..4"):
        ad.relocate([3], [S])
    ad._sbi = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="relocate: a model step is open"):
        ad.relocate([3], [0])


def test_a_decode_step_that_never_reaches_the_adapter_raises(monkeypatch):
    """A mixer that decodes some other way (here: calls the conventional kernel itself) is caught at its first
    decode step, naming the routed call."""

    class Sneaky(KimiKDALinearAttention):
        def forward(self, md):
            real = self._dispatch
            self._dispatch = OracleDispatch()
            try:
                super().forward(md)
            finally:
                self._dispatch = real

    class SneakyModel(FakeKDAModel):
        mixer_cls = Sneaky

    monkeypatch.setenv("TRTLLM_REPLAYSSM_BUFFER_LEN", str(L))
    gen = torch.Generator().manual_seed(2)
    model = kda.make_kda_model_class(SneakyModel, Sneaky)(_config(gen, None))
    pools, convs = _pools(gen)
    mgr = Manager(pools, convs)
    model.forward(metadata(gen, [1], [], mgr))  # a prefill-only step proves nothing
    with pytest.raises(RuntimeError, match="1 decode rows in which no KDA layer called the routed _dispatch.decode_kda"):
        model.forward(metadata(gen, [], [1], mgr))


# ---- the load-time source check ------------------------------------------------------------------------------------
class DirectKernelMixer(torch.nn.Module):
    def forward_decode(self, x):
        return torch.ops.trtllm.kda_decode(x)


class NoCallMixer(torch.nn.Module):
    def forward_decode(self, x):
        return x


@pytest.mark.parametrize("mixer_cls, match", [(DirectKernelMixer, r"calls a KDA decode kernel directly at "
                                                                  r"DirectKernelMixer.forward_decode:\d+ kda_decode"),
                                               (NoCallMixer, r"never calls self._dispatch.decode_kda")])
def test_mixers_that_bypass_the_dispatch_are_refused(mixer_cls, match):
    assert kda.check_kda_mixer_class(KimiKDALinearAttention)  # the stand-in's decode call is found
    with pytest.raises(RuntimeError, match=match):
        kda.check_kda_mixer_class(mixer_cls)


# ---- registration through a stand-in tensorrt_llm tree --------------------------------------------------------------
def kda_tree(monkeypatch, mixer_cls=KimiKDALinearAttention, archs=("KimiLinearForCausalLM", "Glm5NextForCausalLM")):
    mu = make_registry(lazy=True)
    mods = {name: types.ModuleType(name) for name in ("tensorrt_llm", "tensorrt_llm._torch", ZOO,
                                                      "tensorrt_llm._torch.modules",
                                                      "tensorrt_llm._torch.modules.kimi_kda")}
    mods["tensorrt_llm"].__version__ = FAKE_VERSION
    mixer_mod = types.ModuleType(kda.MIXER_MODULE)
    mixer_mod.KimiKDALinearAttention = mixer_cls
    mods.update({mu.__name__: mu, mixer_mod.__name__: mixer_mod})
    for arch in archs:
        name = kda.ARCHITECTURES[arch]
        m = mods.setdefault(name, types.ModuleType(name))
        base = type(arch, (FakeKDAModel,), {"__module__": name})
        setattr(m, arch, mu.register_auto_model(arch)(base))
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
        parent, _, leaf = name.rpartition(".")
        if parent in mods:
            setattr(mods[parent], leaf, m)
    monkeypatch.setattr(kda, "KDA_CLASSES", {})
    return mu


def test_register_kda_routes_kimi_linear_and_glm5_next(monkeypatch, caplog):
    """register_kda registers a ReplaySSM subclass for each KDA architecture the tree defines (the GLM-5 Next
    composite name is skipped where it is not defined), replacing TensorRT-LLM's in the registry without patching
    it; the registered classes route and serve; the lazy registry exports them by module name for workers."""
    mu = kda_tree(monkeypatch)
    monkeypatch.setenv("TRTLLM_REPLAYSSM_BUFFER_LEN", str(L))
    with caplog.at_level("INFO", logger="trtllm_replayssm_module"):
        done = kda.register_kda()
    assert sorted(done) == ["Glm5NextForCausalLM", "KimiLinearForCausalLM"]
    for arch, cls in done.items():
        assert mu.MODEL_CLASS_MAPPING[arch] is cls and cls.__name__ == f"ReplaySSM{arch}"
        assert cls.__bases__[0].__name__ == arch and getattr(kda, cls.__name__) is cls
    assert mu.export_external_model_modules()["Glm5NextForCausalLM"] == "trtllm_replayssm_module.kda"
    assert any("route=registration (KDA): KimiLinearForCausalLM -> trtllm_replayssm_module.kda." in r.getMessage()
               for r in caplog.records)
    gen = torch.Generator().manual_seed(4)
    cfg = _config(gen, -5.0)
    model, oracle = mu.get_registered_model_class("Glm5NextForCausalLM")(cfg), FakeKDAModel(cfg)
    pools, convs = _pools(gen)
    mine = Manager({i: t.clone() for i, t in pools.items()}, {i: t.clone() for i, t in convs.items()})
    ref = Manager({i: t.clone() for i, t in pools.items()}, {i: t.clone() for i, t in convs.items()})
    for prefill, decode in SCHEDULE[:2 + L]:
        got, want = _step(model, oracle, mine, ref, gen, prefill, decode)
        for i in KDA_LAYERS:
            torch.testing.assert_close(got[i], want[i], rtol=TOL, atol=TOL)
    assert kda.register_kda() == done  # idempotent: the same classes again


def test_register_kda_without_kda_models_or_with_a_bypassing_mixer(monkeypatch):
    kda_tree(monkeypatch, archs=())
    with pytest.raises(ImportError, match="defines none of the KDA models"):
        kda.register_kda()
    kda_tree(monkeypatch, mixer_cls=DirectKernelMixer)
    with pytest.raises(RuntimeError, match="calls a KDA decode kernel directly"):
        kda.register_kda()


def test_package_load_registers_kda_next_to_nemotron(monkeypatch):
    """The package's load() registers the KDA models too where the tree has them, and a tree without them keeps the
    Mamba-2 route alone (test_trtllm_serve_module.py drives that one)."""
    mu = kda_tree(monkeypatch)
    monkeypatch.setattr(mod.model, "register", lambda: "nemotron-class")
    assert mod.load() == ("registration", "nemotron-class")
    assert sorted(kda.KDA_CLASSES) == ["Glm5NextForCausalLM", "KimiLinearForCausalLM"]
    assert mu.MODEL_CLASS_MAPPING["KimiLinearForCausalLM"] is kda.KDA_CLASSES["KimiLinearForCausalLM"]


def test_register_against_real_tensorrt_llm():
    pytest.importorskip("tensorrt_llm", reason="tensorrt_llm is not installed (it cannot be here); register_kda is "
                                               "driven through the stand-in tree above")
    try:
        done = kda.register_kda()
    except ImportError as e:
        pytest.skip(f"this tensorrt_llm has no KDA models: {e}")
    assert done
