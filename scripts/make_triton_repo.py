#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Triton Inference Server model repository for a ReplaySSM decode-step engine.

Reads the ``config.json`` that ``scripts/build_engine.py`` writes next to ``model.onnx`` /
``model.plan`` and writes ``REPO/NAME/config.pbtxt`` (+ ``REPO/NAME/1/model.plan`` when the plan
exists). The config is built as Triton's own ``ModelConfig`` protobuf (``tritonclient``'s
``model_config_pb2``), printed in text format and parsed back, never templated as a string.

Route: ``platform: "tensorrt_plan"`` with ``sequence_batching`` and **implicit state**: every
state tensor of the engine (per-layer checkpoint, x/B/dt buffers, conv state, attention K/V, the
shared cursor and the sequence length) is a ``state`` entry pairing the engine input with its
``*_out`` output, zero-initialised at sequence start, in place
(``use_same_buffer_for_input_output``, matching the plugin's aliased outputs). With zero state a
sequence starts empty, so a client streams the prompt token by token, then decodes; each request
carries one token (``input_ids``, shape [1]) and returns ``logits``.

Layers (``model.pattern`` in config.json, Nemotron-H / Nemotron 3 letters): every Mamba-2 layer
``M`` i has the five states conv_state_i, ssm_state_i, x_cache_i, B_cache_i, dt_cache_i, every
attention layer ``*`` i has k_cache_i and v_cache_i, MoE ``E`` and MLP ``-`` layers have none
(their weights are in the plan); anything else is refused before a file is written, naming the
layer and the state.

Usage: python scripts/make_triton_repo.py --engine-dir build/tiny --repo build/triton [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile

TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int32": "TYPE_INT32",
                "int64": "TYPE_INT64"}
REQUEST_INPUTS = ("input_ids",)  # what a client sends each step; every other input is implicit state
SHARED_STATES = ("lengths", "cursor")
LAYER_STATES = {"M": ("conv_state", "ssm_state", "x_cache", "B_cache", "dt_cache"), "*": ("k_cache", "v_cache"),
                "E": (), "-": ()}  # per layer letter of hybrid_override_pattern
LAYER_NAMES = {"M": "Mamba-2", "*": "attention", "E": "MoE", "-": "MLP"}


class RepoError(ValueError):
    """The engine directory's config.json does not describe a decode-step engine we can serve."""


def _pb():
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise RepoError("tritonclient is needed for the model config protobuf: pip install 'tritonclient[grpc]'") from e
    return model_config_pb2


def _dims(entry: dict) -> list[int]:
    shape = entry["shape"]
    if not shape or shape[0] != -1:
        raise RepoError(f"{entry['name']}: expected a leading batch dimension -1, got shape {shape}")
    if any(d <= 0 for d in shape[1:]):
        raise RepoError(f"{entry['name']}: expected static non-batch dimensions, got shape {shape}")
    return list(shape[1:])


def _dtype(entry: dict) -> str:
    try:
        return TRITON_TYPES[entry["dtype"]]
    except KeyError:
        raise RepoError(f"{entry['name']}: dtype {entry['dtype']!r} has no Triton type "
                        f"(known: {sorted(TRITON_TYPES)})") from None


def check_layer_states(cfg: dict) -> None:
    """The states are exactly the shared ones plus those of each layer of ``model.pattern``."""
    pattern = cfg.get("model", {}).get("pattern")
    if not isinstance(pattern, str):
        raise RepoError(f"config.json: model.pattern: expected the layer pattern string (e.g. 'MEM*EM*E'), "
                        f"got {pattern!r}")
    bad = [(i, c) for i, c in enumerate(pattern) if c not in LAYER_STATES]
    if bad:
        raise RepoError(f"config.json: model.pattern {pattern!r}: expected only {''.join(LAYER_STATES)}, got "
                        f"{bad[0][1]!r} at layer {bad[0][0]}")
    names = [s["name"] for s in cfg["states"]]
    have = set(names)
    for i, c in enumerate(pattern):
        missing = [f"{k}_{i}" for k in LAYER_STATES[c] if f"{k}_{i}" not in have]
        if missing:
            raise RepoError(f"layer {i} ({LAYER_NAMES[c]}, pattern {pattern!r}): states {missing} missing")
    want = set(SHARED_STATES) | {f"{k}_{i}" for i, c in enumerate(pattern) for k in LAYER_STATES[c]}
    for n in names:
        if n not in want:
            idx = n.rpartition("_")[2]
            if idx.isdigit() and int(idx) < len(pattern):
                c = pattern[int(idx)]
                raise RepoError(f"state {n!r}: layer {idx} is a {LAYER_NAMES[c]} layer ({c!r} in pattern {pattern!r}), "
                                f"which has {'no states' if not LAYER_STATES[c] else list(LAYER_STATES[c])}")
            raise RepoError(f"state {n!r}: expected {list(SHARED_STATES)} or a per-layer state of pattern {pattern!r}")
    if len(names) != len(have):
        raise RepoError(f"config.json: states: {sorted(n for n in have if names.count(n) > 1)} listed twice")


def model_config(cfg: dict, name: str, max_queue_delay_us: int = 100, idle_us: int = 60_000_000):
    """Triton ``ModelConfig`` for the decode-step engine described by build_engine's ``cfg``."""
    pb = _pb()
    if str(cfg.get("format", "")).startswith("trtllm-replayssm-spec-step"):
        raise RepoError("config.json describes a speculative engine pair (verify.plan + commit.plan, sampling in "
                        "between; scripts/build_engine.py --num-draft): one Triton sequence model cannot run it")
    for key in ("max_batch", "inputs", "outputs", "states"):
        if key not in cfg:
            raise RepoError(f"config.json: missing {key!r} (was it written by scripts/build_engine.py?)")
    check_layer_states(cfg)
    mc = pb.ModelConfig(name=name, platform="tensorrt_plan", max_batch_size=int(cfg["max_batch"]),
                        default_model_filename="model.plan")
    states = {s["name"]: s for s in cfg["states"]}
    outputs = {o["name"]: o for o in cfg["outputs"]}
    for entry in cfg["inputs"]:
        if entry["name"] in states:
            continue
        if entry["name"] not in REQUEST_INPUTS:
            raise RepoError(f"input {entry['name']!r} is neither a request input {REQUEST_INPUTS} nor a state")
        mc.input.add(name=entry["name"], data_type=_dtype(entry), dims=_dims(entry))
    state_outputs = {s["output"] for s in states.values()}
    for entry in cfg["outputs"]:
        if entry["name"] not in state_outputs:
            mc.output.add(name=entry["name"], data_type=_dtype(entry), dims=_dims(entry))
    sb = mc.sequence_batching
    sb.max_sequence_idle_microseconds = idle_us
    sb.oldest.max_candidate_sequences = int(cfg["max_batch"])
    sb.oldest.max_queue_delay_microseconds = max_queue_delay_us
    for s in states.values():
        out = outputs.get(s["output"])
        if out is None:
            raise RepoError(f"state {s['name']!r}: its output {s['output']!r} is not an engine output")
        if out["dtype"] != s["dtype"] or out["shape"] != s["shape"]:
            raise RepoError(f"state {s['name']!r}: output {s['output']!r} has {out['dtype']} {out['shape']}, "
                            f"expected {s['dtype']} {s['shape']}")
        st = sb.state.add(input_name=s["name"], output_name=s["output"], data_type=_dtype(s), dims=_dims(s),
                          use_same_buffer_for_input_output=True)
        st.initial_state.add(name=f"{s['name']}_zero", data_type=_dtype(s), dims=_dims(s), zero_data=True)
    mc.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU, count=1)
    return mc


def config_text(mc) -> str:
    """Text-format config, checked by parsing it back into a fresh ModelConfig."""
    from google.protobuf import text_format

    text = text_format.MessageToString(mc)
    back = _pb().ModelConfig()
    text_format.Parse(text, back)
    if back != mc:  # pragma: no cover - protobuf round trip is exact
        raise RepoError("config.pbtxt does not parse back to the same ModelConfig")
    return text


def make_repo(engine_dir: pathlib.Path, repo: pathlib.Path, name: str) -> pathlib.Path:
    cfg_path = engine_dir / "config.json"
    if not cfg_path.is_file():
        raise RepoError(f"--engine-dir: expected {cfg_path} (run scripts/build_engine.py first)")
    cfg = json.loads(cfg_path.read_text())
    text = config_text(model_config(cfg, name))
    target = repo / name
    if target.exists():
        raise RepoError(f"--repo: {target} already exists; remove it or pick another --name")
    repo.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=repo, prefix=f".{name}."))
    try:
        (tmp / "config.pbtxt").write_text(text)
        (tmp / "1").mkdir()
        plan = engine_dir / "model.plan"
        if plan.is_file():
            shutil.copy2(plan, tmp / "1" / "model.plan")
        else:
            (tmp / "1" / "MISSING_PLAN.txt").write_text(
                f"model.plan was not built in {engine_dir} (TensorRT >= 10.9 and a GPU are needed);\n"
                f"build it there with scripts/build_engine.py and copy it here as 1/model.plan.\n")
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True, type=pathlib.Path, help="output directory of build_engine.py")
    ap.add_argument("--repo", required=True, type=pathlib.Path, help="model repository root to write into")
    ap.add_argument("--name", default="nemotron_h_replayssm", help="model name in the repository")
    args = ap.parse_args(argv)
    try:
        target = make_repo(args.engine_dir, args.repo, args.name)
    except RepoError as e:
        print(f"make_triton_repo: {e}", file=sys.stderr)
        return 2
    has_plan = (target / "1" / "model.plan").is_file()
    note = "" if has_plan else " (no model.plan yet: see 1/MISSING_PLAN.txt)"
    print(f"[make_triton_repo] wrote {target}/config.pbtxt{note}")
    print(f"[make_triton_repo] serve with: tritonserver --model-repository={args.repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
