# SPDX-License-Identifier: Apache-2.0
"""The registry of model kinds (builders/models.py) that the engine export, the generation engine and the Triton
models read instead of branching on a family name: one entry per kind, the entries disjoint, the shadows and modes
the family's declaration gives, the steps named by each entry resolvable and speaking the protocols the consumers
call, and the refusals that are data naming the flag and the family. No model is built here (fast)."""

from __future__ import annotations

import json

import pytest

from builders import models
from builders.nemotron_h import CheckpointError

EXPORT_PROTOCOL = ("for_build", "plugin_geometry", "plugin_kernel", "plugin_keys", "ssm_layers", "describe",
                   "model_entry", "state_specs", "input_names", "output_names", "plugin_attributes")


def test_each_name_and_model_type_has_one_kind():
    tinies = [n for k in models.KINDS for n in k.tiny]
    types = [t for k in models.KINDS for t in k.model_types]
    assert len(tinies) == len(set(tinies)) and len(types) == len(set(types))
    assert len({k.name for k in models.KINDS}) == len(models.KINDS)
    assert models.DEFAULT_TINY in tinies
    for k in models.KINDS:
        assert all(models.by_tiny(n) is k for n in k.tiny)
        assert all(models.by_model_type(t) is k for t in k.model_types)
    assert models.by_model_type("llama") is None


@pytest.mark.parametrize("kind", models.KINDS, ids=lambda k: k.name)
def test_steps_resolve_and_speak_their_protocols(kind):
    if kind.export_step:
        cls = models.resolve(kind.export_step)
        assert [m for m in EXPORT_PROTOCOL if not hasattr(cls, m)] == []
        assert set(kind.state_dtypes) <= {"fp32", "bf16", "fp16"} and kind.tests[0]
        assert bool(kind.tests[1]) == kind.speculative
    if kind.streaming_step:
        assert callable(models.resolve(kind.streaming_step).for_engine)


def test_shadows_and_modes_come_from_the_family_declaration():
    """Mamba-2 keeps a bf16 and a scaled fp8 shadow and an 8-bit checkpoint (its table's shadow_scale and ckpt_scale
    rows); Gated DeltaNet and Kimi Delta Attention a bf16 shadow only; each streaming step runs exactly its kind's
    modes (the modes its own module lists where it lists them)."""
    from builders import kimi_step, qwen_step

    by = {k.family: k for k in models.KINDS}
    assert by["mamba2"].shadows == ("bf16", "fp8") and by["mamba2"].modes == models.MODES
    assert by["gdn"].shadows == by["kda"].shadows == ("bf16",)
    assert by["gdn"].modes == qwen_step.MODES and by["kda"].modes == kimi_step.MODES
    for k in models.KINDS:
        assert set(k.modes) <= set(models.MODES)


def test_refusals_name_the_family_and_what_it_keeps():
    by = {k.family: k for k in models.KINDS}
    assert by["mamba2"].refusal("replay_fp8") is None and by["mamba2"].shadow_refusal("fp8") is None
    assert "there is no fp8 GDN shadow" in by["gdn"].refusal("replay_fp8")
    assert "Gated DeltaNet models (Qwen3-Next / Qwen3.5) take replay_bf16 (--shadow bf16)" in by["gdn"].shadow_refusal(
        "fp8")
    assert "there is no fp8 KDA shadow" in by["kda"].refusal("replay_fp8")
    assert "the 8-bit checkpoint is for Mamba-2 models (Nemotron-H / Nemotron 3)" in by["kda"].refusal("replay_ckpt8")
    assert by["gdn"].refusal("no_such_mode") is None  # an unknown mode is the caller's check (expected one of MODES)


def test_checkpoint_kind_by_model_type_and_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    kind, tiny = models.for_source(tmp_path)
    assert kind.family == "gdn" and tiny is None and kind.is_checkpoint(tmp_path)
    assert models.for_source(None, None)[1] == models.DEFAULT_TINY
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"config.json: model_type: expected one of \[.*'kimi_linear'.*\] .*"
                                              r"got 'llama'"):
        models.for_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        models.for_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="expected a directory with config.json"):
        models.for_checkpoint(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"--tiny: expected one of \[.*'nemotron_h'.*\], got 'nope'"):
        models.by_tiny("nope")
