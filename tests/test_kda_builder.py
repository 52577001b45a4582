# SPDX-License-Identifier: Apache-2.0
"""The Kimi-Linear / GLM-5 Next builder (builders/kda.py) on the CPU: transformers' own models, patched.

Oracles: (1) the unpatched model's own decode (transformers' ``recurrent_kimi_delta_attention`` in fp32): the
patched KDA layers run the float64 ReplaySSM spec through the cache (``ReplayStateCache.for_family("kda")``), so
with a float64 checkpoint and ring the logits agree to fp32 rounding, with the default fp32 checkpoint and bf16 u
ring to that ring's rounding, and the greedy tokens exactly; (2) the float64 conventional KDA recurrence
(``families/kda/reference.conventional_step``) over the very inputs the patched layers handed the cache: with a
float64 checkpoint and ring the replayed outputs, the folded state and the checkpoint written at each flush agree to
float64 rounding, and the ring holds the inputs exactly. A corrupted ring entry must break the agreement (teeth)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from builders.kda import (  # noqa: E402
    FAMILIES,
    kda_layers,
    load_kda_model,
    patch_kda_replayssm,
    text_model,
    tiny_model,
)
from builders.nemotron_h import CheckpointError  # noqa: E402
from trtllm_replayssm.families.kda import reference as kref  # noqa: E402

REPLAY_DECODE = kref.replay_decode  # the step the cache's KDA layers run on CPU tensors (tests wrap it)

L = 4  # small ring: 23 decode steps cross 5 flushes
N = 24
F64 = dict(state_dtype=torch.float64)  # float64 checkpoint and ring: the lifecycle tests compare at fp32 rounding (the
# default bf16 u ring's rounding would reach the attention layers' KV caches; the greedy test bounds it)


def _patch64(model, buffer_len):
    return patch_kda_replayssm(model, buffer_len, **F64)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return tiny_model(request.param)


def _prompt(batch, length, seed=1):
    return torch.randint(2, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, n, patched, **kw):
    gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True)
    mask = kw.pop("attention_mask", None)
    dec = patch_kda_replayssm(model, buffer_len=L, **kw) if patched else None
    try:
        out = model.generate(ids, attention_mask=mask, **gen)
    finally:
        if dec is not None:
            dec.unpatch()
    return out, dec


@torch.no_grad()
def test_greedy_tokens_and_logits_match_unpatched_model(model):
    ids = _prompt(2, 7)
    ref, _ = _generate(model, ids, N, False)
    s_ref = torch.stack(ref.scores)
    assert (s_ref.std(-1) > 0.1).all()  # random weights are not degenerate
    # default: fp32 checkpoint, fp32 u ring (layers.ring_dtype), float64 math: only the stored values' fp32
    # rounding and the model's fp32 recurrence differ; a bf16 u ring (with a shadow) rounds each entry to 2^-9
    # float64 checkpoint and ring: only the model's fp32 recurrence rounds (measured 3e-7)
    for state_dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-5)):
        out, dec = _generate(model, ids, N, True, state_dtype=state_dtype)
        assert torch.equal(out.sequences, ref.sequences)
        assert dec.cursor.tolist() == [(N - 1) % L] * 2  # N - 1 decode steps went through ReplaySSM
        assert len(dec.bufs) == len(kda_layers(model)) == 3
        assert dec.bufs[kda_layers(model)[0]].u_cache.dtype == state_dtype
        err = float((torch.stack(out.scores) - s_ref).abs().max())  # measured 4.5e-7 / 2.8e-7 (both state dtypes)
        assert err <= atol, (state_dtype, err)


@torch.no_grad()
def test_padded_batch_of_different_prompt_lengths_matches_unpatched(model):
    """Three prompts of 9, 5 and 7 tokens, left-padded (the padding is zeroed before the KDA layers' projections
    in prefill, as transformers does); a fresh cache after the previous test's (nothing leaks in)."""
    ids = _prompt(3, 9, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref, _ = _generate(model, ids, N, False, attention_mask=mask)
    out, dec = _generate(model, ids, N, True, attention_mask=mask)
    assert torch.equal(out.sequences, ref.sequences)
    assert dec.cursor.tolist() == [(N - 1) % L] * 3
    # the bf16 u ring's rounding, as above
    assert torch.allclose(torch.stack(out.scores), torch.stack(ref.scores), rtol=0, atol=2e-3)


@torch.no_grad()
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_model_keeps_a_bf16_ring_and_its_tokens(family):
    """A bf16 model: fp32 checkpoint, k / v rings in bf16 (DESIGN §5), the u ring fp32 beside the fp32 checkpoint
    without a shadow (layers.ring_dtype), g and beta fp32; same greedy tokens."""
    model = tiny_model(family, dtype=torch.bfloat16)
    ids = _prompt(2, 7)
    ref, _ = _generate(model, ids, 8, False)
    out, dec = _generate(model, ids, 8, True)
    buf = dec.bufs[kda_layers(model)[0]]
    assert (buf.state.dtype, buf.k_cache.dtype, buf.u_cache.dtype, buf.v_cache.dtype, buf.g_cache.dtype,
            buf.beta_cache.dtype) == (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32,
                                      torch.float32)
    # bf16 logits of std 0.2 (spacing 1e-3) after bf16 activations on both sides: 4-6e-3 a step
    # (measured). Two things of the bf16 model itself are compared around, not through: its top-2 logits come within
    # 0.01 of each other at some steps (a tie at bf16 resolution, 0.004-0.008 apart: Kimi-Linear row 1 step 3, GLM row
    # 1 step 1), where either greedy token is right, so each row's tokens are compared before its first such step and
    # its logits up to it; and a 1-ulp change of a bf16 hidden state can move a token's MoE routing, a jump of the
    # logits at that step alone (0.12 at Kimi-Linear row 0 step 2 on a Xeon @ 2.8 GHz, the tokens unchanged; the
    # bf16 matmuls' rounding depends on the CPU's kernels): the median step is held to 1e-2, every step to 0.25.
    s_ref, s = torch.stack(ref.scores).float(), torch.stack(out.scores).float()  # (steps, batch, vocab)
    top2 = s_ref.topk(2, dim=-1).values
    tie = (top2[..., 0] - top2[..., 1]) < 1e-2  # (steps, batch)
    n = ids.shape[1]
    for r in range(ids.shape[0]):
        t0 = int(tie[:, r].nonzero()[0]) if tie[:, r].any() else s.shape[0]
        assert torch.equal(out.sequences[r, :n + t0], ref.sequences[r, :n + t0]), f"row {r}"
        err = (s[:t0 + 1, r] - s_ref[:t0 + 1, r]).abs().amax(-1)  # per step
        assert float(err.median()) < 1e-2 and float(err.max()) < 0.25, f"row {r}: {err.tolist()}"


@torch.no_grad()
def test_ring_and_checkpoint_equal_the_conventional_recurrence(model, monkeypatch):
    """Every KDA layer's decode inputs are recorded; from the prefill's checkpoint the float64 conventional step
    over them gives each step's output, the state at each flush (the checkpoint) and now (the fold of the ring)."""
    steps = {}  # checkpoint's data_ptr (one per layer) -> [(checkpoint before, cursor before, inputs, y)]

    def recording(buf, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices=None, **kw):
        before = buf.state.clone()
        pos = cursor.clone()
        y = REPLAY_DECODE(buf, cursor, q, k, v, f, b, A_log, dt_bias, state_batch_indices, **kw)
        kw.pop("shadow", None)
        steps.setdefault(buf.state.data_ptr(), []).append((before, pos, dict(q=q, k=k, v=v, f=f, b=b, A_log=A_log,
                                                                              dt_bias=dt_bias, **kw), y))
        return y

    monkeypatch.setattr(kref, "replay_decode", recording)
    n = 2 * L + 3  # 2L + 2 decode steps: two flushes, then cursor 2
    out, dec = _generate(model, _prompt(2, 6, seed=3), n, True, state_dtype=torch.float64)
    assert dec.cursor.tolist() == [(n - 1) % L] * 2
    lower = getattr(text_model(model).layers[kda_layers(model)[0]].self_attn.forget_gate, "safe_gate_lower_bound",
                    None)
    assert (lower is None) == (model.config.model_type == "kimi_linear")
    for i, buf in dec.bufs.items():
        rec = steps[buf.state.data_ptr()]
        assert len(rec) == n - 1 and rec[0][1].tolist() == [0, 0]
        S = rec[0][0].clone()  # the prefill's final state, handed over unchanged
        for before, pos, kw, y in rec:
            assert kw["lower_bound"] == lower
            if int(pos[0]) == 0:  # a flush just wrote the checkpoint: the exact fold of the ring
                # both float64; the fold and the conventional step associate alike (measured 0; states O(1e-2))
                assert torch.allclose(before, S, rtol=0, atol=1e-15), f"layer {i}: checkpoint"
            y_conv = kref.conventional_step(S, **kw)
            # replay's decay-weighted inner products vs the conventional state update, float64 reassociation
            # (measured 1e-19 on outputs O(1e-3))
            assert torch.allclose(y, y_conv, rtol=0, atol=1e-15), f"layer {i}: outputs"
        for s in range(2):
            # the exact fold of the ring vs the conventional steps: the same operations (measured 0)
            assert torch.allclose(dec.cache.committed_state(dec.j[i], s), S[s], rtol=0, atol=1e-15), f"layer {i}"
        # the ring holds the inputs since the last flush exactly: raw k and v, fp32-exact g and beta
        m = int(dec.cursor[0])
        tail = rec[-m:]
        g, beta = zip(*(kref.gates(kw["f"], kw["b"], kw["A_log"], kw["dt_bias"], lower) for _, _, kw, _ in tail))
        for name, want in (("k_cache", [kw["k"] for _, _, kw, _ in tail]), ("v_cache", [kw["v"] for _, _, kw, _ in tail]),
                           ("g_cache", g), ("beta_cache", beta)):
            got = getattr(buf, name)[:, :, :m]
            assert torch.equal(got, torch.stack(want, 2).to(got.dtype)), f"layer {i}: {name}"


@torch.no_grad()
def test_corrupted_ring_breaks_the_agreement(model, monkeypatch):
    """Teeth: the same run with one buffered u entry of one layer scaled each step must differ."""
    first = kda_layers(model)[0]
    holder = {}

    def corrupting(buf, *args, **kw):
        y = REPLAY_DECODE(buf, *args, **kw)
        if buf.state.data_ptr() == holder["dec"].bufs[first].state.data_ptr():  # views of the cache
            buf.u_cache[:, :, 0] *= 3.0
        return y

    ids = _prompt(2, 7)
    ref, _ = _generate(model, ids, 12, False)
    monkeypatch.setattr(kref, "replay_decode", corrupting)
    holder["dec"] = patch_kda_replayssm(model, buffer_len=L)
    try:
        out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    finally:
        holder["dec"].unpatch()
    assert (torch.stack(out.scores) - torch.stack(ref.scores)).abs().max() > 1e-2


@torch.no_grad()
def test_prefill_after_decode_folds_the_ring(model):
    """A multi-token chunk after some decode steps sees the current state, not the stale checkpoint."""
    from transformers import DynamicCache

    ids, more = _prompt(2, 5), _prompt(2, 3, seed=2)
    logits = []
    for patched in (False, True):
        dec = _patch64(model, L) if patched else None
        try:
            cache = DynamicCache(config=model.config)
            tok = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(L + 2):  # one flush, then cursor 2
                tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            logits.append(model(more, cache=cache, use_cache=True).logits)
        finally:
            if dec is not None:
                dec.unpatch()
    assert dec.cursor.tolist() == [0, 0]  # the prefill handed a fresh checkpoint over
    assert torch.allclose(logits[1], logits[0], rtol=0, atol=1e-5)  # fp32 rounding, as above


@torch.no_grad()
def test_unpatch_restores_the_model_and_hands_the_state_back(model):
    """unpatch(): the layers' own forwards and no hooks again; the cache decoded so far continues unpatched from the
    state the ring stood for (the fold into transformers' (batch, H, K, V) recurrent states)."""
    from transformers import DynamicCache

    mixers = [text_model(model).layers[i].self_attn for i in kda_layers(model)]
    hooks = (len(model.model._forward_hooks), len(model.model._forward_pre_hooks))
    ids = _prompt(2, 6, seed=5)

    def run(patched):
        dec = _patch64(model, L) if patched else None
        cache = DynamicCache(config=model.config)
        tok = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(L + 1):
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if dec is not None:
            assert all("forward" in m.__dict__ for m in mixers) and dec.cursor.tolist() == [1, 1]
            dec.unpatch()
        states = [cache.get_recurrent_state(i).clone() for i in kda_layers(model)]
        out = []
        for _ in range(3):
            logits = model(tok, cache=cache, use_cache=True).logits[:, -1:]
            out.append(logits)
            tok = logits.argmax(-1)
        return states, torch.cat(out, 1)

    s_ref, y_ref = run(False)
    s_out, y_out = run(True)
    assert not any("forward" in m.__dict__ for m in mixers)
    assert (len(model.model._forward_hooks), len(model.model._forward_pre_hooks)) == hooks
    for a, b in zip(s_out, s_ref):  # the fold (float64, stored fp32) vs transformers' fp32 recurrence
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    assert torch.allclose(y_out, y_ref, rtol=0, atol=1e-5)


def test_beam_search_and_interleaved_conversations_match_unpatched(model):
    """Beam search, two interleaved conversations, unpatch mid-conversation (tests/helpers.py says how)."""
    from .helpers import check_beams_and_conversations

    check_beams_and_conversations(model, lambda m, buffer_len: _patch64(m, buffer_len), L, atol=1e-5)


class _TextView:
    """The model, with ``.model`` its decoder stack (GLM-5 Next's is model.model.language_model), for the helper
    that interrupts the last decoder layer."""

    def __init__(self, model):
        self._m, self.config, self.model = model, model.config, text_model(model)

    def __call__(self, *args, **kw):
        return self._m(*args, **kw)


def test_forward_raising_mid_step_breaks_only_its_cache(model):
    """An error inside a decode step (tests/helpers.py says how) is not silently continued from."""
    from .helpers import check_forward_raising_mid_step

    check_forward_raising_mid_step(_TextView(model), lambda _, buffer_len: _patch64(model, buffer_len), L, atol=1e-5)


def test_rejects_other_models_and_bad_buffer_len(model):
    with pytest.raises(ValueError, match="buffer_len: expected 1..32, got 0"):
        patch_kda_replayssm(model, buffer_len=0)
    from builders.qwen3_next import tiny_model as qwen

    with pytest.raises(ValueError, match="model: expected a Kimi-Linear or GLM-5 Next model"):
        patch_kda_replayssm(qwen("qwen3_5"), buffer_len=L)


@torch.no_grad()
def test_check_values_reaches_the_cache(model):
    """patch_kda_replayssm(check_values=...) is the cache's (host checks of slots and cursors)."""
    for check in (None, False):
        dec = patch_kda_replayssm(model, buffer_len=L, check_values=check)
        try:
            model.generate(_prompt(2, 5), max_new_tokens=3, min_new_tokens=3, do_sample=False)
        finally:
            dec.unpatch()
        assert dec.cache.check_values is check and dec.cursor.tolist() == [2, 2]


# ---- checkpoint directories (the published layouts: save_pretrained writes them) --------------------------------
def _save(family, path, drop=(), reshape=None):
    from safetensors.torch import load_file, save_file

    tiny_model(family).save_pretrained(path)
    for f in path.glob("*.safetensors"):
        sd = load_file(f)
        sd = {k: (torch.zeros(reshape[1]) if reshape and k == reshape[0] else v) for k, v in sd.items()
              if k not in drop}
        save_file(sd, f, metadata={"format": "pt"})
    return path


# published names (per-projection convs, Kimi's block_sparse_moe w1 / w3, the gate at self_attn, GLM's hc_*)
MISSING = {"kimi_linear": ["model.layers.1.self_attn.k_conv1d.weight", "model.layers.2.self_attn.A_log",
                           "model.layers.1.block_sparse_moe.experts.2.w3.weight"],
           "glm5_next": ["model.language_model.layers.2.self_attn.dt_bias", "model.language_model.layers.1.hc_attn_fn",
                         "model.language_model.layers.3.self_attn.indexer.wk.weight"]}


@torch.no_grad()
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_directory_loads_and_names_what_is_wrong(tmp_path, family):
    ckpt = _save(family, tmp_path / "ok")
    ids = _prompt(2, 5)
    assert torch.equal(load_kda_model(ckpt)(ids).logits, tiny_model(family)(ids).logits)
    for key in MISSING[family]:
        bad = _save(family, tmp_path / key.replace(".", "_"), drop=(key,))
        with pytest.raises(CheckpointError, match=f"1 tensors missing from .*'{key}'"):
            load_kda_model(bad)
    key = MISSING[family][1]
    odd = _save(family, tmp_path / "odd", reshape=(key, (7,)))
    with pytest.raises(CheckpointError, match=rf"mis-shaped .*{key}: expected .*, got \(7,\)"):
        load_kda_model(odd)
    cfg = json.loads((odd / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["layer_types"] = text["layer_types"][:3] + ["sliding_attention"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"layer_types: expected KDA layers .* got 'sliding_attention' at "
                                              r"layer 3"):
        load_kda_model(odd)
    (odd / "config.json").write_text('{"model_type": "qwen3_next"}')
    with pytest.raises(CheckpointError, match="model_type: expected one of .*'kimi_linear'.* got 'qwen3_next'"):
        load_kda_model(odd)
    (odd / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: cannot read"):
        load_kda_model(odd)
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_kda_model(ckpt)
