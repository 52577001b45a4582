# SPDX-License-Identifier: Apache-2.0
"""trtllm_replayssm.costs: the memory model against what ReplayStateCache really allocates, the bytes model
against the numbers plugins/mamba2/replayssm_spec.cuh states, and the forms the module docstring says are one."""

import pytest
import torch

from trtllm_replayssm import costs
from trtllm_replayssm.cache import ReplayStateCache
from trtllm_replayssm.families.gdn import reference as gref
from trtllm_replayssm.geometries import GDN_GEOMETRIES, GEOMETRIES

BF, F8 = torch.bfloat16, torch.float8_e4m3fn
MAMBA = dict(num_layers=3, num_slots=2, nheads=8, headdim=16, dstate=32, ngroups=2, buffer_len=16)
MAMBA_LAYERS = {"mamba2": (3, (8, 16, 32, 2))}
GDN = {"gdn": (2, (4, 2, 8, 16))}
KDA = {"kda": (2, (4, 16, 8))}


def _layers(*parts, **kw) -> dict:
    """The layers= form: num_slots / buffer_len from MAMBA, the families' layers in order."""
    return dict(num_slots=MAMBA["num_slots"], buffer_len=MAMBA["buffer_len"], layers={k: v for p in parts for k, v in p.items()},
                **kw)


CASES = {
    "standard": dict(MAMBA),
    "spec_d3": dict(MAMBA, num_draft=3),
    "bf16_shadow_d1": dict(MAMBA, num_draft=1, shadow_dtype=BF),
    "fp8_shadow_d3": dict(MAMBA, num_draft=3, shadow_dtype=F8),
    "fp32_act_k3_conv_dim": dict(MAMBA, num_draft=2, act_dtype=torch.float32, conv_kernel=3, conv_dim=100),
    "gdn_only": dict(num_slots=3, buffer_len=8, num_draft=1, layers=GDN),
    "gdn_bf16_shadow": dict(num_slots=3, buffer_len=8, shadow_dtype=BF, layers=GDN),
    "gdn_conv_dim": dict(num_slots=3, buffer_len=8, layers={"gdn": (2, (4, 2, 8, 16), 0)}),
    "mixed_bf16_shadow": _layers(MAMBA_LAYERS, GDN, num_draft=2, shadow_dtype=BF),
    "standard_cursor_no_conv": dict(MAMBA, cursor="standard", conv_dim=0, shadow_dtype=BF),
    "float64": _layers(MAMBA_LAYERS, GDN, state_dtype=torch.float64, act_dtype=torch.float64, dt_dtype=torch.float64),
    "kda_bf16_shadow": dict(num_slots=3, buffer_len=8, num_draft=1, shadow_dtype=BF, layers=KDA),
    "kda_standard": dict(num_slots=3, buffer_len=8, cursor="standard", layers=KDA),
}


def _allocated(cache) -> int:
    """Bytes of every tensor the cache holds (its attributes and its groups'), each storage once (conv is a view of
    the scratch-slot tensor)."""
    seen, total = set(), 0
    held = [*vars(cache).values()] + [t for g in cache.groups for t in (*g.t.values(), g._conv)]
    for t in held:
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


@pytest.mark.parametrize("name", sorted(CASES))
def test_cache_allocation_matches_model(name):
    kw = CASES[name]
    cache = ReplayStateCache(**kw)
    model = costs.cache_bytes(**kw)
    assert _allocated(cache) == model["total"]
    assert cache.bytes_per_slot() == model["slot"]


def test_memory_per_request_is_the_cache_slot():
    """memory_per_request's ReplaySSM column = cache_bytes' slot for a Mamba-2 cache, for every shadow."""
    for q, dt in ((0, None), (2, BF), (1, F8)):
        for d in (0, 1, 3):
            kw = dict(MAMBA, num_draft=d, shadow_dtype=dt)
            assert costs.memory_per_request(8, 16, 32, 2, 3, 16, d, shadow_bytes=q)["replay"] == \
                costs.cache_bytes(**kw)["slot"] == ReplayStateCache(**kw).bytes_per_slot()


def test_mamba2_bytes_match_the_spec_kernel_comment():
    """plugins/mamba2/replayssm_spec.cuh's numbers: (128, 64, 128, 8), fp32 state, bf16, T = 4, L = 16, batch 256."""
    H, P, N, G = GEOMETRIES["nemotron_h_8b"]
    b, T, L = 256, 4, 16

    def gb(m, shadow=None):
        return costs.mamba2_verify_bytes(H, P, N, G, L, T, m, shadow=shadow) * b / 1e9

    assert [round(gb(m), 3) for m in (0, 8, 12)] == [1.131, 1.170, 2.263]
    assert [round(gb(m, "bf16"), 3) for m in (0, 8, 12)] == [0.594, 0.633, 2.800]
    assert [round(gb(m, "fp8"), 3) for m in (0, 8, 12)] == [0.334, 0.373, 2.540]
    verify, commit = costs.mamba2_native_spec_bytes(H, P, N, G, T)
    assert (round(verify * b / 1e9, 3), round(commit * b / 1e9, 3)) == (5.407, 2.147)
    conv, per_k = costs.mamba2_bytes_per_position(H, P, N, G, L)
    assert (round(per_k[1] * b / 1e9, 3), round(per_k[L] * b / 1e9, 3)) == (1.088, 2.230)
    assert round(costs.mamba2_bytes_per_step(H, P, N, G, L)["replay"] * b / 1e9, 3) == 1.191
    assert 1.7 < costs.mamba2_bytes_per_step(H, P, N, G, L)["ratio"] < 1.9  # docs/DESIGN.md's ceiling


@pytest.mark.parametrize("shadow", [None, "bf16", "fp8"])
def test_standard_decode_is_a_one_token_verify(shadow):
    """The docstring's one form: decode at k < L is the verify of T = 1 at m = k - 1; the flush writes no entry."""
    for H, P, N, G in GEOMETRIES.values():
        L = 16
        _, per_k = costs.mamba2_bytes_per_position(H, P, N, G, L, shadow=shadow)
        entry = H * P * 2 + G * N * 2 + 4 * H
        for k in range(1, L):
            assert per_k[k] == costs.mamba2_verify_bytes(H, P, N, G, L, 1, k - 1, shadow=shadow)
        assert per_k[L] == costs.mamba2_verify_bytes(H, P, N, G, L, 1, L - 1, shadow=shadow) - entry
    q = None if shadow is None else costs.shadow_sizes(shadow)[0]
    for HV, H, V, K in GDN_GEOMETRIES.values():
        L = 16
        _, per_k = costs.gdn_bytes_per_position(HV, H, V, K, L, shadow_bytes=q)
        entry = HV * V * 4 + HV * V * 2 + H * K * 4 + 2 * HV * 4
        for k in range(1, L):
            assert per_k[k] == costs.gdn_verify_bytes(HV, H, V, K, L, 1, k - 1, shadow_bytes=q)
        # the verify's flush refolds (v, k, g, beta); decode's fp32 flush (no shadow) sums (u, k, g) instead
        usum = 0 if q else (L - 1) * (HV * V * 4 - HV * V * 2 - HV * 4)
        assert per_k[L] == costs.gdn_verify_bytes(HV, H, V, K, L, 1, L - 1, shadow_bytes=q) - entry + usum
    assert gref.bytes_per_position is costs.gdn_bytes_per_position  # one home, re-exported


def test_end_to_end_layer_model_against_the_kernel_model():
    """The end-to-end step's per-layer SSM bytes = the kernel model's cycle mean less the layer io, plus the entry
    the end-to-end convention charges on the flush step too (module docstring)."""
    H, P, N, G = GEOMETRIES["nemotron_h_8b"]
    io = H * P * 2 + 2 * G * N * 2 + H * 2 + H * P * 2
    entry = H * P * 2 + G * N * 2 + 4 * H
    for L in (8, 16, 32):
        for mode, shadow in (("replay", None), ("replay_bf16", "bf16"), ("replay_fp8", "fp8")):
            kernel = costs.mamba2_bytes_per_step(H, P, N, G, L, shadow=shadow)["replay"]
            assert costs.mamba2_decode_step_ssm(H, P, N, G, L, mode) == pytest.approx(kernel - io + entry / L, rel=1e-12)
    with pytest.raises(ValueError, match="mode"):
        costs.mamba2_decode_step_ssm(H, P, N, G, 16, "standard")
    with pytest.raises(ValueError, match="mode"):
        costs.mamba2_spec_step_ssm(H, P, N, G, 4, 16, "replay")


def test_spec_count_distribution_follows_the_cursor():
    """The committed counts a speculative step starts from, against the cursor itself (spec_reference's
    flush_cursor then commit on one slot, drafts accepted with the alpha of the mean): full acceptance cycles
    T, 2T, 3T (not 0, T, 2T, 3T: after a fold the count is the step's n); at alpha 0.8 the fold share and mean
    count agree with 6000 sampled steps. The end-to-end bytes average over it (they used min(1, n/(L-2T+1)))."""
    import random

    from builders.model_step import designed_accepted_per_step
    from trtllm_replayssm import cursor as cursors

    assert costs.spec_count_distribution(4, 16) == pytest.approx({4: 1 / 3, 8: 1 / 3, 12: 1 / 3})
    T, L, alpha = 4, 16, 0.8
    acc = designed_accepted_per_step(alpha, T)
    d = costs.spec_count_distribution(T, L, acc)
    assert sum(d.values()) == pytest.approx(1.0)
    rng, cursor, sbi, seen = random.Random(3), torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), []
    for _ in range(6000):
        seen.append(int(cursor[0, 1]))
        cursors.flush_cursor(cursor, T, L, sbi)
        n = 1
        while n < T and rng.random() < alpha:
            n += 1
        cursors.commit(cursor, torch.tensor([n], dtype=torch.int32), T, L, sbi)
    fold = sum(m + 2 * T > L for m in seen) / len(seen)
    assert fold == pytest.approx(sum(p for m, p in d.items() if m + 2 * T > L), abs=0.02)
    assert sum(seen) / len(seen) == pytest.approx(sum(m * p for m, p in d.items()), abs=0.2)
    H, P, N, G = GEOMETRIES["nemotron_h_8b"]
    state, entry = costs.mamba2_state_bytes(H, P, N), H * P * 2 + G * N * 2 + 4 * H
    want = state * (1 + 1 / 3) + (8 + T) * entry + T * entry  # full acceptance: counts 4, 8, 12, one fold in three
    assert costs.mamba2_spec_step_ssm(H, P, N, G, T, L, "replay_spec") == pytest.approx(want)
    with pytest.raises(ValueError, match="expected T >= 1 and L >= 2T"):
        costs.spec_count_distribution(4, 6)


def test_shadow_sizes_and_max_batch_within():
    assert costs.shadow_sizes(None) is None and costs.shadow_sizes("none") is None and costs.shadow_sizes(0) is None
    assert costs.shadow_sizes("bf16") == costs.shadow_sizes(2) == (2, 0)
    assert costs.shadow_sizes("fp8") == costs.shadow_sizes(1) == (1, 4)
    with pytest.raises(ValueError, match="shadow"):
        costs.shadow_sizes("fp4")
    for budget in (0, 99, 100, 101, 12345, 10**9):
        b = costs.max_batch_within(lambda n: 100 * n + 7, budget)
        assert b == min(max(0, (budget - 7) // 100), (1 << 20) - 1)  # capped below ``limit``


def test_weights_read_count_the_embedding_rows_not_the_table():
    from builders.random_model import build_model, model_config

    m = build_model(model_config("nemotron_h"), "cpu", torch.float32, seed=0)
    emb = m.get_input_embeddings().weight
    table, row = emb.numel() * emb.element_size(), emb.shape[1] * emb.element_size()
    total = costs.model_weight_bytes(m)
    assert costs.weights_read_bytes(m, 3) == total - table + 3 * row
    assert costs.weights_read_bytes(m, 10 ** 9) == total  # more tokens than rows: the whole table at most
    m.lm_head.weight = m.get_input_embeddings().weight  # tied: the head reads the whole table anyway
    assert costs.weights_read_bytes(m, 3) == costs.model_weight_bytes(m)


# ---- Kimi Delta Attention (issue 37) ----------------------------------------------------------------------------
def test_kda_bytes_per_position_by_hand():
    """The KDA forms of the module docstring, written out: S = H K V 4; the output path reads k (bf16), u (fp32
    without a shadow, bf16 with one: layers.ring_dtype), g (fp32, per channel) per entry; the flush the u-sum's
    entries (k, u, g) without a shadow, the exact fold's (k, v, g, beta) with one; a step writes all five."""
    H, K, V, L = 12, 128, 64, 16
    conv, per_k = costs.kda_bytes_per_position(H, K, V, L)
    state, io = H * K * V * 4, (3 * H * K + H * V + H) * 2 + H * V * 2
    e = costs.kda_ring_entry_bytes(H, K, V, u_bytes=4)
    assert e == {"read": H * (2 * K + 4 * V + 4 * K), "fold": H * (2 * K + 2 * V + 4 * K + 4),
                 "write": H * (2 * K + 4 * V + 4 * K + 2 * V + 4), "hold": H * (2 * K + 4 * V + 4 * K + 2 * V + 4)}
    assert conv == 2 * state + io
    assert per_k[1] == state + io + e["write"]
    assert all(per_k[k + 1] - per_k[k] == e["read"] for k in range(1, L - 1))
    assert per_k[L] == 2 * state + io + (L - 1) * e["read"]  # the u-sum
    _, sh = costs.kda_bytes_per_position(H, K, V, L, shadow="bf16")
    e2 = costs.kda_ring_entry_bytes(H, K, V, u_bytes=2)
    assert sh[1] == H * K * V * 2 + io + e2["write"] and sh[2] - sh[1] == e2["read"]  # the shadow, a bf16 u ring
    assert sh[L] == 2 * state + H * K * V * 2 + io + (L - 1) * e2["fold"]  # the refold; the shadow rewritten
    _, f8 = costs.kda_bytes_per_position(H, K, V, L, shadow="fp8")
    assert sh[1] - f8[1] == H * K * V - H * K * 4  # fp8: one scale per (head, key row)
    step = costs.kda_bytes_per_step(H, K, V, L)
    assert step["replay"] == sum(per_k.values()) / L and step["flush"] == per_k[L]
    for k in range(1, L):  # standard decode at k < L is the verify of T = 1 at m = k - 1 ...
        assert per_k[k] == costs.kda_verify_bytes(H, K, V, L, 1, k - 1)
        assert sh[k] == costs.kda_verify_bytes(H, K, V, L, 1, k - 1, shadow="bf16")
    # ... the flush writes no entry (the verify's fold refolds from v_j; decode's fp32 flush sums the u_j)
    assert sh[L] == costs.kda_verify_bytes(H, K, V, L, 1, L - 1, shadow="bf16") - e2["write"]
    assert per_k[L] == costs.kda_verify_bytes(H, K, V, L, 1, L - 1) - e["write"] + (L - 1) * (e["read"] - e["fold"])
    assert costs.kda_native_spec_bytes(H, K, V, 4) == (state + 4 * state + 4 * io, 2 * state)


def test_kda_predicted_ceilings():
    """bench/NOTES.md "KDA bytes model (issue 37), CPU" and "The same lever for KDA": at L = 16 every published
    geometry (all K = V = 128, so the per-head ratio does not depend on the head count or the batch) has the bytes
    bound 1.615x with the fp32 u ring and its u-sum flush (1.659x with a bf16 u ring, issue 37's "about 1.65x"),
    2.589x with a bf16 shadow (bf16 u ring, refold); the best ring is L = 10 (1.644x) and replay moves more bytes
    than the conventional step from L = 100 on. A 2-byte gate in the ring (the raw bf16 forget-gate input,
    recomputed in the kernel) would give 1.659x."""
    from trtllm_replayssm.families.kda import GEOMETRIES

    assert set(GEOMETRIES) == {f"{m}_tp{tp}" for m in ("kimi_k3", "kimi_linear_48b", "glm5_3_flash") for tp in (1, 8)}
    for H, K, V in GEOMETRIES.values():
        assert round(costs.kda_bytes_per_step(H, K, V, 16)["ratio"], 3) == 1.615
        assert round(costs.kda_bytes_per_step(H, K, V, 16, u_bytes=2)["ratio"], 3) == 1.659
        assert round(costs.kda_bytes_per_step(H, K, V, 16, shadow="bf16")["ratio"], 3) == 2.589
        assert round(costs.kda_bytes_per_step(H, K, V, 16, g_bytes=2)["ratio"], 3) == 1.659
    H, K, V = GEOMETRIES["kimi_k3_tp1"]
    sweep = costs.ring_sweep(costs.kda_bytes_per_step, H, K, V)
    assert (sweep["best_L"], round(sweep["best_ratio"], 3), sweep["break_even_L"]) == (10, 1.644, 100)
    step = costs.kda_bytes_per_step(H, K, V, 16)
    assert step["flush"] > step["conventional"] > step["nonflush"]  # the flush step alone moves more bytes
    assert round(step["conventional"] * 256 / 1e9, 3) == 3.253 and round(step["replay"] * 256 / 1e9, 3) == 2.014
    # GDN through the same sweep (Qwen3-Next: 32 value heads, 16 key heads of 128): best L = 13, even at 168
    gdn = costs.ring_sweep(costs.gdn_bytes_per_step, 32, 16, 128, 128)
    assert (gdn["best_L"], gdn["break_even_L"]) == (13, 168)


def test_kda_layer_memory():
    """One slot of a KDA layer: the state, the shadow (fp8: + a scale per key row), L ring entries, the conv window."""
    H, K, V, L = 8, 128, 128, 16
    m = costs.kda_layer_memory(H, K, V, L, conv_width=3, shadow="fp8")
    assert m == {"state": H * K * V * 4, "shadow": H * K * V + H * K * 4,
                 "ring": L * H * (2 * K + 2 * V + 4 * K + 2 * V + 4), "conv": 3 * H * K * 3 * 2}
