# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the spec step of scripts/bench_e2e.py (scripts/e2e_spec.py) and builders/model_step.py's
SpecStep (speculative decoding end to end).

Oracles:
* plain greedy decoding (the conventional standard step, float64 reference SSM) for every spec mode's
  emitted tokens: equal exactly on the tiny config in fp32 (the spec step's other arithmetic differs
  from the standard step's only in GEMM shapes, ~1e-7, far from any near tie of a 256-token vocab).
* hand-built token rows for the acceptance rule (longest matching prefix + bonus token).
* :mod:`trtllm_replayssm.families.mamba2.spec_reference` for the conv window kept with a per-row offset (update +
  rollback over random acceptances: outputs within one fp32 product-sum, committed inputs exact).
* a host-side replay of the tables for the on-device acceptance bookkeeping of the timed (reference
  target) path: accepted counts equal exactly.
* teeth: a ReplaySSM commit that never moves the cursor and a native commit that always keeps the
  last snapshot must both fail the exactness check.
* the memory model against counts written out by hand for the Nemotron-H-8B geometry.
L = 8 = 2T: every step with committed history flushes, the hardest case of the "one window early" rule.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parent.parent

from builders import model_step as ss  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402
from scripts import bench_e2e  # noqa: E402
from scripts import e2e_spec as bs  # noqa: E402
from trtllm_replayssm import conv_window as convw  # noqa: E402
from trtllm_replayssm import costs  # noqa: E402
from trtllm_replayssm.costs import memory_per_request  # noqa: E402

T, L = 4, 8
RUN = dict(T=T, L=L, prompt_len=4, steps=3, warmup=0, reps=1, check_steps=4, check_acceptance=0.7, context=48)
CHECK = {k: v for k, v in RUN.items() if k not in ("warmup", "reps")}
GiB = 1 << 30


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # tiny float64 ops: one thread is much faster on a loaded host
    return build_model(model_config(tiny=True), "cpu", torch.float32, seed=0)


# ---- acceptance -------------------------------------------------------------------------------------------
def test_accept_prefix_and_bonus():
    target = torch.tensor([[10, 11, 12, 13]] * 5)
    tokens = torch.tensor([
        [7, 10, 11, 12],  # all three drafts match: 3 + bonus target[3]
        [7, 99, 11, 12],  # first draft wrong: bonus target[0]
        [7, 10, 99, 12],  # one match, later match does not count (prefix only)
        [7, 10, 11, 99],  # two matches
        [7, 99, 99, 99],
    ])
    n, bonus = ss.accept(tokens, target)
    assert n.dtype == torch.int32 and n.tolist() == [4, 1, 2, 3, 1]
    assert bonus.tolist() == [13, 10, 11, 12, 10]
    n2, b2 = ss.accept(torch.tensor([[5, 6]]), torch.tensor([[6, 8]]))  # T = 2
    assert n2.tolist() == [2] and b2.tolist() == [8]


def test_designed_acceptance_and_draft_tables():
    assert ss.designed_accepted_per_step(1.0, 4) == 4 and ss.designed_accepted_per_step(0.0, 4) == 1
    assert ss.designed_accepted_per_step(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    ref = torch.randint(0, 100, (64, 200), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ss.make_drafts(ref, 1.0, 100, torch.Generator().manual_seed(1)), ref)
    none = ss.make_drafts(ref, 0.0, 100, torch.Generator().manual_seed(1))
    assert torch.equal(none[:, 0], ref[:, 0]) and (none[:, 1:] != ref[:, 1:]).all()
    assert none.min() >= 0 and none.max() < 100
    frac = (ss.make_drafts(ref, 0.8, 100, torch.Generator().manual_seed(2))[:, 1:] == ref[:, 1:]).float().mean()
    assert abs(float(frac) - 0.8) < 0.02  # 12736 Bernoulli(0.8) draws: 5 sigma = 0.018
    with pytest.raises(ValueError, match="alpha"):
        ss.make_drafts(ref, 1.5, 100, torch.Generator())


def simulate_acceptance(G, D, steps, T):
    """Host replay of the reference-target path: tokens emitted per row after ``steps`` steps."""
    out = []
    for g, d in zip(G.tolist(), D.tolist()):
        pos = 1
        for _ in range(steps):
            k = 0
            while k < T - 1 and d[pos + k] == g[pos + k]:
                k += 1
            pos += k + 1
        out.append(pos - 1)
    return out


# ---- conv window ------------------------------------------------------------------------------------------
def test_conv_window_offset_matches_reference_rollback():
    """The window is never rolled back: after n accepted of T, the committed K-1 inputs end T - n rows
    before its end. Against spec_reference's rolled-back window over steps of random acceptance."""
    gen = torch.Generator().manual_seed(3)
    b, C, K = 3, 10, 4
    W = K - 2 + T
    win = torch.zeros(b, W, C)  # the step's layout: channels innermost
    win[:, W - (K - 1):] = torch.randn(b, K - 1, C, generator=gen)
    ref_win = win.transpose(1, 2).double().clone()  # spec_reference's (b, C, W)
    shift = torch.zeros(b, dtype=torch.int64)
    w, bias = torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    sbi = torch.arange(b, dtype=torch.int32)
    for step in range(6):
        u = torch.randn(b, T, C, generator=gen)
        want = convw.conv_window_update(ref_win, u.double(), w.double(), bias.double(), sbi, activation="silu")
        got = ss.conv_update(win, shift if step else None, u, w, bias)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), step  # fp32 sums of K products
        n = torch.randint(1, T + 1, (b,), generator=gen, dtype=torch.int32)
        convw.conv_window_rollback(ref_win, n, T, K, sbi)
        shift = T - n.long()
        cols = (W - (K - 1)) - shift[:, None] + torch.arange(K - 1)[None, :]
        committed = win.gather(1, cols[:, :, None].expand(b, K - 1, C))
        assert torch.equal(committed.transpose(1, 2).double(), ref_win[:, :, W - (K - 1):]), step  # moved values only


def test_window_running_past_the_kv_cache_keeps_the_positions_inside(model):
    """A row whose verify window runs past max_seq_len (lengths + T > kv_len): the tokens inside the cache
    get sequential T = 1 decoding's logits. Before the fix, the positions past kv_len - 1 were clamped onto
    kv_len - 1 and their K/V overwrote that committed position's (logits off by ~0.3)."""
    b, prompt_len, kv_len = 2, 5, 12
    prompt = torch.randint(0, model.config.vocab_size, (b, prompt_len), generator=torch.Generator().manual_seed(0))
    std = ss.DecodeStep(model, b, kv_len, ss.Conventional())
    std.feed(prompt)
    snap = std.snapshot()
    G, seq = [std.ids.clone()], []
    for _ in range(kv_len - prompt_len):  # inputs at positions prompt_len .. kv_len - 1
        seq.append(std().clone())
        G.append(std.ids.clone())
    G, seq = torch.stack(G, 1), torch.stack(seq, 1)
    table = torch.cat([G, torch.zeros(b, 2 * T, dtype=torch.int64)], 1)  # drafts = the greedy tokens: all accepted
    spec = ss.SpecStep(model, b, kv_len, T, table.shape[1], ss.NativeSpec(), live=True)
    spec.set_tables(table, table)
    spec.restore(snap)
    spec()
    assert spec.lengths.tolist() == [prompt_len + T] * b
    got = spec()  # inputs at positions 9 .. 12: 9, 10, 11 inside the cache, 12 past it
    inside = kv_len - (prompt_len + T)
    torch.testing.assert_close(got[:, :inside], seq[:, T:T + inside], rtol=1e-4, atol=2e-5)
    assert torch.equal(spec.out[:, :1 + T + inside], G[:, :1 + T + inside])


# ---- the tiny path end to end --------------------------------------------------------------------------------
def test_spec_modes_equal_greedy_and_rows(model):
    rows = bs.run_batch(model, 2, list(bs.MODES), acceptances=(0.0, 1.0), **RUN)
    by = {(r["mode"], r["acceptance"]): r for r in rows}
    assert set(by) == {("standard", None), ("replay_spec", 0.0), ("replay_spec", 1.0), ("native_spec", 0.0),
                       ("native_spec", 1.0), ("spec_noop", 1.0)}
    for mode in ("standard", "replay_spec", "native_spec"):
        r = by[(mode, 1.0 if mode != "standard" else None)]
        assert r["check"] == "exact" and r["check_exact"] == 2, mode
    for mode in ("replay_spec", "native_spec"):
        assert by[(mode, 1.0)]["accepted_per_step"] == T  # every draft is the greedy token
        assert by[(mode, 0.0)]["accepted_per_step"] == 1  # only the bonus token
        assert by[(mode, 0.0)]["partial_step_frac"] == 1.0 and by[(mode, 1.0)]["partial_step_frac"] == 0.0
        assert by[(mode, 1.0)]["live_agreement"] == 1.0  # fp32 CPU: the live argmax is the greedy token
        assert by[(mode, 1.0)]["check_partial_steps"] > 0  # the check (alpha 0.7) saw rejections
    std = by[("standard", None)]
    for r in rows:
        assert r["timing"].startswith("eager-cpu") and r["ms_step"] > 0 and r["kv_len"] >= 48
        assert r["tokens_per_s"] == pytest.approx(2 * r["accepted_per_step"] / (r["ms_step"] * 1e-3))
        assert r["speedup_vs_standard"] == pytest.approx(r["tokens_per_s"] / std["tokens_per_s"])
    rs, ns = by[("replay_spec", 1.0)], by[("native_spec", 1.0)]
    assert rs["speedup_vs_native"] == pytest.approx(rs["tokens_per_s"] / ns["tokens_per_s"])
    assert rs["ssm_share"] == pytest.approx(1 - by[("spec_noop", 1.0)]["ms_step"] / rs["ms_step"])


def test_reference_path_acceptance_matches_tables(model):
    rows = bs.time_batch(model, 3, ["replay_spec"], acceptances=(0.6,), **RUN)
    check_len, time_len, kv_len = bs.lengths(T, L, RUN["steps"], RUN["check_steps"], RUN["prompt_len"], RUN["context"])
    _, _, G, _ = bs.prepare(model, 3, bs._prompt(3, model.config.vocab_size, RUN["prompt_len"], 0), kv_len, time_len)
    D = ss.make_drafts(G, 0.6, model.config.vocab_size, torch.Generator().manual_seed(3 + 600))
    want = simulate_acceptance(G, D, RUN["steps"], T)
    assert rows[0]["accepted_per_step"] == pytest.approx(sum(want) / (3 * RUN["steps"]))
    assert rows[0]["check"] == "not run"


def test_check_has_teeth(model):
    frozen = ss.Replay(L, commit_fn=lambda cursor, n, sbi, T_, L_: None)  # history overwritten, no flush
    with pytest.raises(bs.GateError, match="replay_spec"):
        bs.check_batch(model, 2, ["standard", "replay_spec"], backends={"replay_spec": frozen}, **CHECK)

    class KeepLast(ss.NativeSpec):  # commits the last snapshot whatever was accepted
        def end_step(self, sbi, n_accepted=None):
            super().end_step(sbi, torch.full_like(n_accepted, self.T))

    with pytest.raises(bs.GateError, match="native_spec"):
        bs.check_batch(model, 2, ["native_spec"], backends={"native_spec": KeepLast()}, **CHECK)


def test_main_writes_json_and_plot(tmp_path):
    rows = bench_e2e.main(["spec", "--tiny", "--device", "cpu", "--batches", "2", "--acceptances", "0.8", "--buffer-len", str(L),
                    "--prompt-len", "3", "--steps", "2", "--reps", "1", "--warmup", "0", "--check-steps", "3",
                    "--context", "32", "--out", str(tmp_path), "--plot", "--commit", "abc123"])
    assert {r["mode"] for r in rows} == set(bs.MODES)
    files = sorted(tmp_path.glob("*_spec-decode-tiny_abc123.json"))
    assert len(files) == 1 and files[0].with_suffix(".png").exists()
    data = json.loads(files[0].read_text())
    meta = data["meta"]
    assert meta["device"] == "cpu" and meta["commit"] == "abc123" and meta["date"] and meta["T"] == 4
    assert set(meta["max_batch_at_budget"]) == {"ctx1024", "ctx8192"}
    for r in data["rows"]:
        for key in ("batch", "mode", "acceptance", "ms_step", "tokens_per_s", "accepted_per_step", "speedup_vs_standard",
                    "speedup_vs_native", "check", "memory_model_gib", "timing"):
            assert key in r
        if r["mode"] != "spec_noop":
            assert r["check"] == "exact"


# ---- memory model ----------------------------------------------------------------------------------------------
def test_memory_model_nemotron_h_8b():
    cfg = model_config()
    b, kv = 256, 1024
    M, state = 24, 128 * 64 * 128 * 4  # Mamba layers; 4 MiB fp32 state per row and layer
    rings = 128 * 16 * 64 * 2 + 8 * 16 * 128 * 2 + 128 * 16 * 4  # x, B (bf16) and dt (fp32) entries, L = 16
    native = costs.serving_memory(cfg, b, kv, 4, 16, "native_spec", 0)
    replay = costs.serving_memory(cfg, b, kv, 4, 16, "replay_spec", 0)
    standard = costs.serving_memory(cfg, b, kv, 4, 16, "standard", 0)
    assert native["ssm"] == M * b * state * 5 == 120 * GiB  # state + T = 4 snapshots
    assert replay["ssm"] == standard["ssm"] == M * b * (state + rings)
    assert native["kv"] == replay["kv"] == 4 * 2 * b * 8 * kv * 128 * 2 == 4 * GiB
    assert replay["conv"] == M * b * 10240 * 6 * 2 and standard["conv"] == M * b * 10240 * 4 * 2
    one = costs.serving_memory(cfg, 1, kv, 4, 16, "replay_spec", 0)
    assert one["ssm"] + one["conv"] == memory_per_request(128, 64, 128, 8, M, 16, 3)["replay"] - 8  # 8: the cursor
    W = 16 * 10**9
    assert costs.serving_memory(cfg, b, kv, 4, 16, "native_spec", W)["total"] > 139 * GiB  # native bs256 does not fit
    assert costs.serving_memory(cfg, b, kv, 4, 16, "replay_spec", W)["total"] < 60 * GiB
    nat, rep = (costs.max_batch(cfg, 139 * GiB, kv, 4, 16, m, W) for m in ("native_spec", "replay_spec"))
    assert 200 < nat < 256 and rep > 3.5 * nat
    for m, mb in (("native_spec", nat), ("replay_spec", rep)):  # the largest batch that fits, exactly
        assert costs.serving_memory(cfg, mb, kv, 4, 16, m, W)["total"] <= 139 * GiB
        assert costs.serving_memory(cfg, mb + 1, kv, 4, 16, m, W)["total"] > 139 * GiB
    assert costs.max_batch(cfg, 10 * GiB, kv, 4, 16, "replay_spec", W) == 0  # the weights alone do not fit
    # the run's plan: native spec at 256 is skipped on an H200 besides the bf16 weights; 128 fits with the snapshot
    skip, snap = bs.decide(cfg, 256, list(bs.MODES), kv, 4, 16, 2, 139 * GiB - W)
    assert list(skip) == ["native_spec"] and snap == "cuda"
    skip, snap = bs.decide(cfg, 128, list(bs.MODES), kv, 4, 16, 4, 139 * GiB - 2 * W)  # fp32 check, twin resident
    assert skip == {} and snap == "cuda"


def test_step_bytes_model():
    cfg = model_config()
    W, b = 16 * 10**9, 256
    noop = costs.spec_step_bytes(cfg, b, 1024, 4, 16, "spec_noop", W)
    native = costs.spec_step_bytes(cfg, b, 1024, 4, 16, "native_spec", W) - noop
    replay = costs.spec_step_bytes(cfg, b, 1024, 4, 16, "replay_spec", W, accepted=4.0) - noop
    assert native == 24 * b * 128 * 64 * 128 * 4 * 7  # read S, write T = 4 snapshots, commit copy (2)
    assert 4.5 < native / replay < 5.5  # bench/NOTES.md: ~5.3x at full acceptance
    assert costs.spec_step_bytes(cfg, b, 1024, 4, 16, "standard", W) == costs.decode_step_bytes(cfg, b, 1024, 16, "replay", W)


@pytest.mark.gpu
def test_cuda_graph_route_tiny():
    """The H200 route on the tiny config: fp32-twin check, graphs, bf16 timing, and the teeth on the GPU."""
    model = build_model(model_config(tiny=True), "cuda", torch.bfloat16, seed=0)
    twin = build_model(model_config(tiny=True), "cuda", torch.float32, seed=0)
    rows = bs.run_batch(model, 4, list(bs.MODES), check_model=twin, acceptances=(0.6, 0.95), **{**RUN, "L": 16})
    for r in rows:
        assert r["timing"] == "cuda-graph" and r["ms_step"] > 0
        if r["mode"] != "spec_noop":
            assert r["check"] in ("exact",) or "near-tie" in r["check"]
    frozen = ss.Replay(16, commit_fn=lambda cursor, n, sbi, T_, L_: None)
    with pytest.raises(bs.GateError, match="replay_spec"):
        bs.check_batch(twin, 4, ["replay_spec"], backends={"replay_spec": frozen}, **{**CHECK, "L": 16})


@pytest.mark.parametrize("argv, what", [
    (["spec", "--tiny", "--num-tokens", "4", "--buffer-len", "6"], "expected T >= 2 and L >= 2T"),
    (["spec", "--tiny", "--acceptances", "1.5"], "--acceptances: expected values in [0, 1]"),
    (["spec", "--tiny", "--modes", "replay_spec,bogus"], "--modes: expected names from"),
    (["spec", "--tiny", "--check-layers", "9"], "--check-layers: expected 1..8"),
    (["standard", "--tiny", "--modes", "conventional,bogus"], "--modes: expected names from"),
    (["standard", "--tiny", "--device", "cpu", "--gate-layers", "2"], "--gate-layers: needs a twin"),
    (["decode", "--tiny"], "invalid choice: 'decode'"),
    (["standard", "--tiny", "--batches", "1,x"], "--batches: expected comma-separated integers >= 1, got '1,x'"),
    (["spec", "--tiny", "--batches", "0"], "--batches: expected comma-separated integers >= 1"),
    (["standard", "--tiny", "--reps", "0"], "--reps: expected >= 1, got 0"),
    (["spec", "--tiny", "--buffer-len", "64"], "--buffer-len: expected 1..32"),
    (["spec", "--tiny", "--fit-contexts", "abc"], "--fit-contexts: expected comma-separated integers"),
    (["standard", "--tiny", "--tp-check-dtypes", "float16"], "--tp-check-dtypes: expected float32 and/or bfloat16"),
    (["standard", "--tiny", "--tp-geometries", "128,64,128"], "--tp-geometries: expected ';'-separated H,P,N,G"),
])
def test_cli_rejects_bad_arguments(argv, what, capsys):
    """One CLI for both steps: a bad flag stops before any model is built, naming the flag."""
    with pytest.raises(SystemExit) as e:
        bench_e2e.main(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err


def test_moe_stack_spec_step_is_exact_and_counts_the_experts_it_reads():
    """Nemotron 3 (Mamba-2 + MoE): every spec mode emits plain greedy decoding's tokens, and the bytes model's
    weights are the model's less the routed experts no token of the last step chose (the standard step's rule)."""
    m = build_model(model_config("nemotron3", time_step_min=0.0), "cpu", torch.float32, seed=0)
    rows = bs.run_batch(m, 2, list(bs.MODES), acceptances=(0.8,), **RUN)
    total = costs.model_weight_bytes(m) / 1e9
    for r in rows:
        assert not r.get("skipped"), r
        assert r["check"] in ("exact", "not checked (no SSM)"), r
        assert 0 < r["weights_read_gb"] <= total
    assert any(r["weights_read_gb"] < total for r in rows)  # 2 rows x T tokens leave experts idle


def test_check_on_a_prefix_of_the_layers(tmp_path):
    """--check-layers N: the exactness check runs on the first N layers (a model whose fp32 twin does not fit),
    the timing on the whole model; the meta says which."""
    rows = bench_e2e.main(["spec", "--tiny", "nemotron3", "--device", "cpu", "--batches", "2", "--acceptances", "0.8",
                           "--buffer-len", str(L), "--prompt-len", "3", "--steps", "2", "--reps", "1", "--warmup", "0",
                           "--check-steps", "3", "--context", "32", "--check-layers", "4", "--out", str(tmp_path),
                           "--commit", "abc123"])
    meta = json.loads(next(tmp_path.glob("*_spec-decode-tiny_abc123.json")).read_text())["meta"]
    assert meta["layers"] == 8 and meta["check"].endswith("first 4 layers") and meta["moe_layers"] == 3
    assert {r["check"] for r in rows if r["mode"] != "spec_noop"} == {"exact"}
