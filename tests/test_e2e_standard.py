# SPDX-License-Identifier: Apache-2.0
"""CPU smoke test of the standard step of scripts/bench_e2e.py (scripts/e2e_standard.py) on the tiny config.

Oracles:
* transformers' own ``generate`` (fp32, greedy) for the hand-written graph step
  (:mod:`builders.model_step`): the same greedy tokens. Only fp32 summation order differs; the
  config sets ``time_step_min=0`` so transformers' prefill does not clamp dt (its decode never does).
* the conventional mode (float64 reference SSM on the CPU) for every other mode: greedy tokens equal
  exactly (float64 replay and conventional forms agree to ~1e-15, far from any near tie).
* teeth: a ReplaySSM whose cursor never advances must fail the gate.
* shadow modes (lossy by design): the teacher-forced gate against the conventional mode, with the
  thresholds of ``SHADOW_GATE`` (measured on this tiny config at L = 4: max logit error 0.003 std
  bf16, 0.024 std fp8, argmax agreement 100%; a shadow never rewritten at flush: 1.1 std, 89%).
  Their bookkeeping is compared exactly: the shadow must equal, bit for bit,
  ``reference.Shadow.of(checkpoint)`` after load, after every step (the checkpoint only changes at a
  flush, which rewrites the shadow from the stored fp32 values) and after restore.
L = 4 and 2L+1 gate tokens, so every row crosses two flushes.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parent.parent

from builders.model_step import Conventional, DecodeStep, Replay  # noqa: E402
from builders.random_model import build_model, model_config  # noqa: E402
from scripts import bench_e2e  # noqa: E402
from scripts import e2e_standard as bd  # noqa: E402
from trtllm_replayssm import costs  # noqa: E402
from trtllm_replayssm.backend import write_shadow  # noqa: E402
from trtllm_replayssm.shadow import Shadow  # noqa: E402

L = 4
RUN = dict(L=L, prompt_len=5, gate_tokens=2 * L + 1, warmup=0, reps=1, context=16)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # tiny float64 ops: one thread is much faster on a loaded host
    return build_model(model_config(tiny=True, time_step_min=0.0), "cpu", torch.float32, seed=0)


def test_rows_and_gate_across_modes(model):
    rows = bd.run_batch(model, 3, ["conventional", "replay", "noop"], **RUN)
    assert [r["mode"] for r in rows] == ["conventional", "replay", "noop"]
    by = {r["mode"]: r for r in rows}
    assert by["replay"]["gate"] == "exact" and by["replay"]["gate_exact"] == 3
    assert by["conventional"]["gate"] == "reference"
    for r in rows:
        assert r["timing"].startswith("eager-cpu")
        assert r["batch"] == 3 and r["buffer_len"] == L and r["kv_len"] >= 16
        assert r["ms_step"] > 0 and r["tokens_per_s"] == pytest.approx(3 / (r["ms_step"] * 1e-3))
        assert r["speedup_vs_conventional"] == pytest.approx(by["conventional"]["ms_step"] / r["ms_step"])
    assert by["noop"]["ssm_share"] is None
    assert by["replay"]["ssm_share"] == pytest.approx(1 - by["noop"]["ms_step"] / by["replay"]["ms_step"])


def test_gate_has_teeth(model):
    broken = Replay(L, advance=lambda cursor, sbi, n: None)  # buffer never fills, entry 0 overwritten
    with pytest.raises(bd.GateError, match="replay"):
        bd.run_batch(model, 3, ["conventional", "replay"], backends={"replay": broken}, **RUN)


def test_twin_weights_are_the_rounded_fp32_weights():
    cfg = model_config(tiny=True)
    lo, hi = build_model(cfg, "cpu", torch.bfloat16), build_model(cfg, "cpu", torch.float32)
    assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(lo.parameters(), hi.parameters()))


def test_gate_on_a_twin_runs_first(model):
    twin = build_model(model_config(tiny=True, time_step_min=0.0), "cpu", torch.float32, seed=0)
    rows = bd.run_batch(model, 2, ["conventional", "replay", "noop"], gate_model=twin, **RUN)
    assert {r["mode"]: r["gate"] for r in rows}["replay"] == "exact"
    assert all(r["gate_dtype"] == "float32" for r in rows)
    broken = Replay(L, advance=lambda cursor, sbi, n: None)
    with pytest.raises(bd.GateError, match="replay"):  # raised by the gate phase, before the timed model runs
        bd.run_batch(model, 2, ["conventional", "replay"], gate_model=twin, backends={"replay": broken}, **RUN)


def _assert_greedy_equals_generate(model, buffer_len: int) -> None:
    """The step's greedy tokens (conventional and ReplaySSM) equal transformers' generate over 2L+1 steps."""
    prompt = torch.randint(2, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    n = 2 * buffer_len + 1
    want = model.generate(prompt, max_new_tokens=n, do_sample=False, min_new_tokens=n)[:, prompt.shape[1]:]
    for ssm in (Conventional(), Replay(buffer_len)):
        step = DecodeStep(model, 2, 16, ssm)
        step.feed(prompt)
        got = [step.ids.clone()]
        for _ in range(n - 1):
            step()
            got.append(step.ids.clone())
        assert torch.equal(torch.stack(got, 1), want), ssm.name


def test_step_matches_transformers_generate(model):
    _assert_greedy_equals_generate(model, L)


def test_check_gate_near_ties():
    ref = torch.tensor([[5, 6, 7], [1, 2, 3]])
    margin = torch.tensor([[1.0, 0.001, 1.0], [1.0, 1.0, 1.0]])
    fork = torch.tensor([[5, 9, 9], [1, 2, 3]])  # row 0 forks at a near tie (step 1)
    assert bd.check_gate("m", ref, margin, fork, 0.02, 0.5, False) == dict(exact=1, ties=1)
    with pytest.raises(bd.GateError, match="strict gate"):
        bd.check_gate("m", ref, margin, fork, 0.02, 0.5, True)
    both = torch.tensor([[5, 9, 9], [0, 2, 3]])  # and row 1 at step 0, a near tie too: 2 forks > 1 allowed
    with pytest.raises(bd.GateError, match="allowed 1"):
        bd.check_gate("m", ref, torch.tensor([[1.0, 0.001, 1.0], [0.001, 1.0, 1.0]]), both, 0.02, 0.0, False)
    with pytest.raises(bd.GateError, match="row 1 step 0"):
        bd.check_gate("m", ref, margin, torch.tensor([[5, 6, 7], [0, 2, 3]]), 0.02, 0.5, False)


def test_8b_geometry_and_memory_model():
    cfg = model_config()
    kinds = list(cfg.layers_block_type)
    assert len(kinds) == 52 and kinds.count("linear_attention") == 24 and kinds.count("full_attention") == 4
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups) == (128, 64, 128, 8)
    b = 256
    conv = costs.decode_step_bytes(cfg, b, 1024, 16, "conventional", 0)
    noop = costs.decode_step_bytes(cfg, b, 1024, 16, "noop", 0)
    assert conv - noop == 24 * b * 2 * 128 * 64 * 128 * 4  # state read + write per Mamba layer
    assert 1.7 < (conv - noop) / (costs.decode_step_bytes(cfg, b, 1024, 16, "replay", 0) - noop) < 1.9  # docs/DESIGN.md ceiling
    plan = costs.decode_run_plan(cfg, b, 1024, 16, 16 * 10**9)
    assert plan["gpu_snapshot"] - plan["cpu_snapshot"] == plan["snapshot_bytes"]
    assert plan["gpu_snapshot"] < 139 * bd.GiB  # batch 256 fits an H200 with the snapshot on the GPU
    assert costs.decode_run_plan(cfg, 1024, 1024, 16, 16 * 10**9)["cpu_snapshot"] > 139 * bd.GiB  # 1024 would not


def test_main_writes_json_and_plot(tmp_path):
    rows = bench_e2e.main(["standard", "--tiny", "--batches", "2", "--buffer-len", str(L), "--prompt-len", "3",
                           "--gate-tokens", "5", "--warmup", "0", "--reps", "1", "--context", "16", "--device", "cpu",
                           "--out", str(tmp_path), "--plot", "--commit", "abc123"])
    assert {r["mode"] for r in rows} == {"conventional", "replay", "replay_bf16", "replay_fp8", "noop"}
    files = sorted(tmp_path.glob("*_decode-tiny_abc123.json"))
    assert len(files) == 1 and files[0].with_suffix(".png").exists()
    data = json.loads(files[0].read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["commit"] == "abc123" and data["meta"]["date"]
    for r in data["rows"]:
        for key in ("batch", "mode", "ms_step", "tokens_per_s", "ssm_share", "speedup_vs_conventional", "timing",
                    "gate"):
            assert key in r


@pytest.mark.gpu
def test_cuda_graph_route_tiny():
    """The H200 route on the tiny config: eager warm-up, one captured step per mode, gate, graph timing."""
    model = build_model(model_config(tiny=True), "cuda", torch.bfloat16, seed=0)
    twin = build_model(model_config(tiny=True), "cuda", torch.float32, seed=0)
    fn = bd._load_mamba(ROOT / "third_party" / "mamba_ssm_peer")
    modes = ["conventional", "replay", "replay_bf16", "replay_fp8", "noop"] + (["mamba_ssm"] if fn is not None else [])
    rows = bd.run_batch(model, 4, modes, mamba_fn=fn, gate_model=twin, **RUN)
    assert {r["mode"] for r in rows} == set(modes)
    for r in rows:
        assert r["timing"] == "cuda-graph" and r["ms_step"] > 0 and r["gate_dtype"] == "float32"
    broken = Replay(L, advance=lambda cursor, sbi, n: None)
    with pytest.raises(bd.GateError, match="replay"):
        bd.run_batch(model, 4, ["conventional", "replay"], backends={"replay": broken}, gate_model=twin, **RUN)
    for r in rows:
        if r["mode"] in bd.SHADOW_MODES:
            assert r["gate_logit_err_max"] <= r["gate_max_logit_err"] and r["gate_agree"] >= r["gate_min_agree"]
    stale = StaleShadow(L, shadow="bf16")
    with pytest.raises(bd.GateError, match="replay_bf16"):
        bd.run_batch(model, 4, ["conventional", "replay_bf16"], backends={"replay_bf16": stale}, gate_model=twin, **RUN)


# ---- shadow modes ------------------------------------------------------------------------------------
class StaleShadow(Replay):
    """Planted bug: the shadow is never rewritten at a flush (restored after every layer step), so
    after the first flush the non-flush steps read the prompt's checkpoint instead of the current one."""

    def step(self, i, *args):
        q = self.shadow[i].clone()
        sc = self.shadow_scale[i].clone() if self.shadow_scale else None
        y = super().step(i, *args)
        self.shadow[i].copy_(q)
        if sc is not None:
            self.shadow_scale[i].copy_(sc)
        return y


SHADOWS = ["replay_bf16", "replay_fp8"]


def test_shadow_modes_end_to_end(model):
    modes = ["conventional", "replay", *SHADOWS, "noop"]
    rows = bd.run_batch(model, 3, modes, **RUN)
    by = {r["mode"]: r for r in rows}
    assert [r["mode"] for r in rows] == modes and by["replay"]["gate"] == "exact"
    for name in SHADOWS:
        r = by[name]
        assert r["gate"].startswith("teacher-forced") and r["shadow"] == bd.SHADOW_MODES[name]
        assert r["gate_agree"] >= r["gate_min_agree"] and 0 < r["gate_logit_err_max"] <= r["gate_max_logit_err"]
        assert r["gate_logit_err_median"] <= r["gate_logit_err_max"]
        assert r["ms_step"] > 0 and r["timing"].startswith("eager-cpu") and "timed_rows_identical" in r
        assert r["ssm_share"] == pytest.approx(1 - by["noop"]["ms_step"] / r["ms_step"])
    # lossy, but far from the thresholds: bf16 well below fp8 (measured 0.003 and 0.024 std)
    assert by["replay_bf16"]["gate_logit_err_max"] < by["replay_fp8"]["gate_logit_err_max"] < 0.1


@pytest.mark.parametrize("name", SHADOWS)
def test_shadow_gate_has_teeth(model, name):
    stale = StaleShadow(L, shadow=bd.SHADOW_MODES[name])
    with pytest.raises(bd.GateError, match=f"teacher-forced gate: mode '{name}'"):
        bd.run_batch(model, 3, ["conventional", name], backends={name: stale}, **RUN)
    twin = build_model(model_config(tiny=True, time_step_min=0.0), "cpu", torch.float32, seed=0)
    with pytest.raises(bd.GateError, match=name):  # the twin's gate phase, before the timed model runs
        bd.run_batch(model, 2, ["conventional", name], gate_model=twin,
                     backends={name: StaleShadow(L, shadow=bd.SHADOW_MODES[name])}, **RUN)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_write_shadow_matches_reference_bits(kind):
    g = torch.Generator().manual_seed(3)
    S = torch.randn(3, 4, 8, 16, generator=g) * torch.logspace(-30, 5, 16)  # wide range: subnormal fp8 codes
    S[1, 2, 3] = 0  # an all-zero row: scale 1
    S[2, 0, 0, 5] = float(torch.finfo(torch.float32).max) / 2
    want = Shadow.of(S, kind)
    q = torch.zeros_like(want.q)
    scale = torch.zeros(3, 4, 8) if kind == "fp8" else None
    write_shadow(S, q, scale)
    assert torch.equal(q.view(torch.uint8), want.q.view(torch.uint8))  # compared as bits (fp8 has no ==)
    if kind == "fp8":
        assert torch.equal(scale, want.scale) and float(scale[1, 2, 3]) == 1.0


def _assert_shadow_is_of_checkpoint(ssm):
    for i in ssm.layers:
        want = Shadow.of(ssm.state[i], ssm.shadow_kind)
        assert torch.equal(ssm.shadow[i].view(torch.uint8), want.q.view(torch.uint8)), i
        if ssm.shadow_kind == "fp8":
            assert torch.equal(ssm.shadow_scale[i], want.scale), i


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_shadow_follows_checkpoint_and_snapshot_restore(model, kind):
    prompt = torch.randint(2, model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(2))
    step = DecodeStep(model, 2, 32, Conventional())
    step.feed(prompt)
    snap0 = step.snapshot()
    ssm = Replay(L, shadow=kind)
    step.set_ssm(ssm)
    step.restore(snap0)
    assert all(len(d) == len(step.mamba) for d in (ssm.shadow, ssm.shadow_scale if kind == "fp8" else ssm.shadow))
    _assert_shadow_is_of_checkpoint(ssm)  # load: the prefill hand-off
    for _ in range(L + 2):  # through one flush, then mid-buffer
        step()
        _assert_shadow_is_of_checkpoint(ssm)  # the checkpoint moves only at a flush, which rewrites the shadow
    assert int(ssm.cursor[0]) == 2
    snap = step.snapshot()
    logits = step().clone()
    for _ in range(L):
        step()
    step.restore(snap)
    _assert_shadow_is_of_checkpoint(ssm)
    assert int(ssm.cursor.abs().sum()) == 0
    for i in step.mamba:  # the folded state of the snapshot is the new checkpoint
        assert torch.equal(ssm.state[i], snap["ssm"][i])
    assert torch.equal(step.snapshot()["ssm"][step.mamba[0]], snap["ssm"][step.mamba[0]])
    # the same next step as before the restore, up to the shadow of a re-based checkpoint
    again = step()
    assert torch.equal(again.argmax(-1), logits.argmax(-1))
    assert float((again - logits).abs().max() / logits.std()) < bd.SHADOW_GATE[kind]["max_logit_err"]


def test_check_forced_gate():
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    err = torch.full((2, 4), 0.01)
    got = ref.clone()
    got[1, 3] = 0
    g = bd.check_forced_gate("m", ref, got, err, 0.05, 0.8)
    assert g == dict(agree=0.875, logit_err_max=pytest.approx(0.01), logit_err_median=pytest.approx(0.01), exact=1)
    with pytest.raises(bd.GateError, match="agrees .* at 0.8750"):
        bd.check_forced_gate("m", ref, got, err, 0.05, 0.9)
    err[0, 2] = 0.5
    with pytest.raises(bd.GateError, match="row 0 step 2"):
        bd.check_forced_gate("m", ref, got, err, 0.05, 0.8)
    err[0, 2] = float("nan")
    with pytest.raises(bd.GateError, match="row 0 step 2"):
        bd.check_forced_gate("m", ref, got, err, 0.05, 0.8)


def test_record_and_force_routing():
    """The tiny Nemotron 3 step's routing record: the experts builders.moe.route picks and their set code;
    forcing the step's own choice changes nothing, forcing other experts changes the logits while the
    record still shows the own choice; run_mode carries both per gate step."""
    from builders import moe as moe_ops

    model = build_model(model_config("nemotron3"), "cpu", torch.float32, seed=0)
    step = DecodeStep(model, 3, 64, Conventional())
    step.record_routing()
    step.feed(torch.tensor([[5, 9], [7, 2], [11, 4]]))
    snap = step.snapshot()
    i = next(iter(step.routing))
    w = step.w[i]["moe"]
    seen = []
    orig = moe_ops.route

    def spy(hn, ww, idx=None):
        out = orig(hn, ww, idx)
        if ww is w and idx is None:
            seen.append(out[1].clone())
        return out

    moe_ops.route = spy
    try:
        logits = step().clone()
    finally:
        moe_ops.route = orig
    own = step.route_idx[i].clone()
    assert torch.equal(own.sort(-1).values, seen[0].sort(-1).values)
    assert torch.equal(step.routing[i][:, 0], step._route_code[i][seen[0]].sum(-1))
    step.force_routing = True
    for j, buf in step.forced_idx.items():
        buf.copy_(step.route_idx[j])
    step.restore(snap)
    assert torch.equal(step(), logits)
    E = w.num_experts
    step.forced_idx[i].copy_((own + 1) % E)  # other experts
    step.restore(snap)
    forced = step()
    assert float((forced - logits).abs().max()) > 1e-3 * float(logits.std())
    assert torch.equal(step.route_idx[i], own)  # the record is the step's own choice
    step.force_routing = False
    res = bd.run_mode(step, Conventional(), snap, 3, 4, 0, 0)
    assert res["route_idx"].shape == (3, len(step.routing), 3, w.top_k) and res["routing"].shape == (3, 3, len(step.routing))
    assert torch.equal(res["route_idx"][0, 0], own)
    again = bd.run_mode(step, Conventional(), snap, 3, 4, 0, 0, force_route=res["route_idx"])
    assert torch.equal(again["tokens"], res["tokens"]) and torch.equal(again["routing"], res["routing"])


def test_shadow_bytes_and_memory():
    cfg = model_config()
    b, H, P, N, M = 256, 128, 64, 128, 24
    noop = costs.decode_step_bytes(cfg, b, 1024, 16, "noop", 0)
    ssm = {m: costs.decode_step_bytes(cfg, b, 1024, 16, m, 0) - noop for m in ("replay", *SHADOWS)}
    entry = H * P * 2 + 8 * N * 2 + 4 * H
    buf = 7.5 * entry + entry
    assert ssm["replay_bf16"] == pytest.approx(M * b * (2 * H * P * N * 4 / 16 + H * P * N * 2 + buf), abs=1)
    assert ssm["replay_fp8"] == pytest.approx(M * b * (2 * H * P * N * 4 / 16 + H * P * N + H * P * 4 + buf), abs=1)
    assert ssm["replay"] > ssm["replay_bf16"] > ssm["replay_fp8"]
    plain = costs.decode_run_plan(cfg, b, 1024, 16, 0)
    bf16 = costs.decode_run_plan(cfg, b, 1024, 16, 0, shadow_bytes=bd.shadow_elem_bytes(["replay", *SHADOWS]))
    assert bd.shadow_elem_bytes(["replay_fp8"]) == 1 and bd.shadow_elem_bytes(["replay"]) == 0
    assert bf16["gpu_snapshot"] - plain["gpu_snapshot"] == M * b * H * P * N * 2
    # the fp32-twin gate phase with the bf16 shadow, weights 16.2 + 32.4 GB resident: fits an H200 at bs256
    twin = costs.decode_run_plan(cfg, b, 1024, 16, int(48.6e9), act_bytes=4, shadow_bytes=2)
    assert twin["gpu_snapshot"] < 139 * bd.GiB


# ---- Nemotron 3: MoE layers in the step ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model3():
    return build_model(model_config(tiny="nemotron3", time_step_min=0.0), "cpu", torch.float32, seed=0)


def test_moe_step_matches_transformers_generate(model3):
    """Tiny Nemotron 3 (MEM*EM*E, 8 experts, top-2, shared expert): the step's greedy tokens are
    transformers' own (NemotronHMoE with its router), across two flushes of L = 4."""
    assert "moe" in model3.config.layers_block_type
    _assert_greedy_equals_generate(model3, 4)


def test_grouped_moe_equals_dense_and_counts_the_load():
    """bf16: the grouped-GEMM experts (tokens sorted by expert, torch._grouped_mm) give the dense
    formulation's logits (the same bf16 products, fp32 sums); expert_load counts rows * top_k pairs.
    A wrong inverse permutation of the sorted pairs breaks the equality."""
    m = build_model(model_config(tiny="nemotron3", time_step_min=0.0), "cpu", torch.bfloat16, seed=0)
    prompt = torch.randint(2, m.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(2))
    grouped, dense = DecodeStep(m, 3, 16, Conventional()), DecodeStep(m, 3, 16, Conventional())
    assert grouped.grouped
    dense.grouped = False
    for s in (grouped, dense):
        s.feed(prompt)
    err = float((grouped.logits.float() - dense.logits.float()).abs().amax() / dense.logits.float().std())
    assert err <= 1e-2, err
    assert all(int(v.sum()) == 3 * m.config.num_experts_per_tok for v in grouped.expert_load.values())
    import builders.model_step as ms

    real = ms.moe_out

    def shuffled(y, order, *a):
        return real(y, order.flip(0), *a)

    ms_f = dict(grouped.f)
    grouped.f = {**ms_f, "moe_out": shuffled}
    grouped.restore(dense.snapshot())
    grouped(), dense()
    err = float((grouped.logits.float() - dense.logits.float()).abs().amax() / dense.logits.float().std())
    assert err > 0.05, err


def test_gate_phase_moe_forces_routing():
    """The twin's gate phase on the tiny Nemotron 3: the shadow modes run with the conventional experts and
    report how often their own choice would differ."""
    model = build_model(model_config("nemotron3"), "cpu", torch.float32, seed=0)
    prompt = torch.randint(2, model.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    out = bd.gate_phase(model, 4, ["conventional", "replay", "replay_bf16"], prompt, 64, 4, 8, 1e-3, 0.05, False,
                        None, None, None)
    assert set(out) == {"conventional", "replay", "replay_bf16"}
    assert 0.0 <= out["replay_bf16"]["route_flip_rate"] <= 1.0
    assert out["replay_bf16"]["logit_err_max"] < bd.SHADOW_GATE["bf16"]["max_logit_err"]


def test_moe_bytes_model_counts_only_the_experts_read():
    """MoE rows: the bytes model's weights leave out the experts no token chose (batch 1, top-2 of 8) and the
    embedding rows no token gathered (the table is read one row per token)."""
    model = build_model(model_config("nemotron3"), "cpu", torch.float32, seed=0)
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters()) - (emb.shape[0] - 1) * emb.shape[1] * 4
    rows = bd.run_batch(model, 1, ["conventional"], L=4, prompt_len=2, gate_tokens=2, warmup=0, reps=1, context=32)
    n_moe = sum(k == "moe" for k in model.config.layers_block_type)
    cfg = model.config
    per_expert = 2 * cfg.moe_intermediate_size * cfg.hidden_size * 4  # up + down, fp32
    idle = n_moe * (cfg.n_routed_experts - cfg.num_experts_per_tok)
    assert idle > 0 and rows[0]["weights_read_gb"] * 1e9 == pytest.approx(total - idle * per_expert)


def test_auto_gate_layers_cuts_the_twin_only_where_it_does_not_fit():
    """The 8B's fp32 gate twin (32 GB) beside the bf16 model at bs256: cut on an 80 GB card, whole on a big one,
    left alone where no prefix fits (that batch is then skipped, naming the GiB it needs)."""
    args = bench_e2e.parser().parse_args(["standard", "--batches", "64,256"])
    modes = ["conventional", "replay", "replay_bf16", "noop"]
    weights = costs.config_weight_bytes(model_config(), torch.bfloat16)
    n = bd.auto_gate_layers(args, modes, 79 * bd.GiB - weights, torch.float32, 2)  # an H100 after the timed model
    assert n is not None and 1 <= n < 52
    cut = model_config(layers=n)
    need = costs.config_weight_bytes(cut, torch.float32) + costs.decode_run_plan(cut, 256, bd.kv_positions(args), 16, 0, 4)[
        "cpu_snapshot"]
    assert need <= 79 * bd.GiB - weights
    assert bd.auto_gate_layers(args, modes, 1000 * bd.GiB, torch.float32, 2) is None  # the whole twin fits
    assert bd.auto_gate_layers(args, modes, 1 * bd.GiB, torch.float32, 2) is None  # nothing fits: left to the plan
