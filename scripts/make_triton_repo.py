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
(their weights are in the plan), every Gated DeltaNet layer ``G`` i (Qwen3-Next / Qwen3.5 engines,
builders/gdn_step.py) has conv_state_i, gdn_state_i, gdn_u_i, gdn_v_i, gdn_k_i, gdn_g_i, gdn_beta_i;
anything else is refused before a file is written, naming the layer and the state.

Usage: python scripts/make_triton_repo.py --engine-dir build/tiny --repo build/triton [--name NAME]
       [--idle-ms 60000] [--max-queue-delay-us 100]
(the model, dtype and sizes are the engine's: the --backend python flags below are refused here by name)

``--backend python`` (no engine): a Python-backend model that runs the checkpoint itself; everything it needs is a
``parameters`` entry of config.pbtxt (the checkpoint: ``model_dir``, or ``tiny`` + ``seed``; dtype, device, sizes;
``python_path`` / ``python_version``: the backend stub embeds libpython with an isolated configuration that ignores
PYTHONPATH, so model.py puts this interpreter's project root and site-packages on ``sys.path`` itself and refuses
another Python version). Which model depends on the family:

* Nemotron-H / Nemotron 3 (``--tiny nemotron_h|nemotron3``, or a ``--model`` whose config.json says nemotron_h): the
  **streaming** model (builders/triton_generate.py): decoupled, a prompt in (``input_ids`` or ``text_input``),
  the completion streamed back (``output_ids``, ``text_output``, then ``finish_reason`` and token counts), over the
  generation engine of builders/generation.py (in-flight batching of ``--max-slots`` sequences on the captured model
  step, ``--mode`` conventional | replay | replay_bf16 | replay_fp8); Triton's HTTP generate_stream works too.
* Qwen3-Next / Qwen3.5 (``--tiny qwen3_next|qwen3_5|qwen3_5_moe``, or a ``--model`` whose config.json says
  qwen3_next / qwen3_5 / qwen3_5_moe or their *_text): the **per-token** model (trtllm_replayssm/triton_model.py;
  the captured model step has no Gated DeltaNet layers yet): sequence_batching ``oldest`` with the controls START,
  END, READY and CORRID maps each sequence to a slot of its ``ReplayStateCache``; a request carries one token
  (``input_ids`` [1]) and returns ``logits`` [vocab] and ``slot`` [1]; ``--shadow`` (or ``--mode replay_bf16``).

:func:`pytriton_server` finds the tritonserver that the nvidia-pytriton wheel bundles, :func:`serve_command` gives
the command that serves the repository with it (printed; ``--serve`` runs it).

Usage: python scripts/make_triton_repo.py --backend python --repo build/triton-py [--tiny nemotron_h | --model DIR]
       [--dtype fp32|bf16|fp16] [--device auto|cpu|cuda] [--max-slots 8] [--max-seq-len 1024] [--buffer-len 16]
       [--mode conventional|replay|replay_bf16|replay_fp8] [--text-input auto|tensor|parameter] [--serve]
       (per-token model only: [--idle-ms 60000] [--max-queue-delay-us 100] [--shadow none|bf16|fp8])
Refused before a file is written, naming the flag: --engine-dir (tensorrt_plan only); --device cuda where torch
sees no CUDA device; a --model that the server's own loader refuses (it is loaded once here, on the CPU: a truncated
safetensors file, a missing or mis-shaped tensor); a --repo that is a file.

Shutdown: on SIGINT / SIGTERM tritonserver keeps every sequence that has not ended (no END yet, not idle for
--idle-ms) as an in-flight inference and waits for it; the printed serve commands bound that wait with
--exit-timeout-secs (builders/triton_repo.py EXIT_TIMEOUT_S; tritonserver's default is 30 s), after which such
sequences are dropped with the server.
"""

# The writer is builders/triton_repo.py (config.pbtxt, model.py, make_repo); the docstring above is this
# command's --help.
from __future__ import annotations

import argparse
import inspect
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.triton_repo import (  # noqa: E402  (the writer; this script is its command line)
    DTYPES,
    EXIT_TIMEOUT_S,
    RepoError,
    _batching_ranges,
    _check_ranges,
    dtype_spelling,
    make_python_repo,
    make_repo,
    serve_command,
    write_backend_dir,
)

# --backend python's flags (dest -> make_python_repo keyword). Their defaults are make_python_repo's (one set of
# defaults); argparse's are None, so that a flag the user gave is told from one left out: with --backend
# tensorrt_plan these are refused by name (the engine was built with its own; scripts/build_engine.py).
PYTHON_ONLY = {"model": "model_dir", "tiny": "tiny", "seed": "seed", "dtype": "dtype", "device": "device",
               "max_slots": "max_slots", "max_seq_len": "max_seq_len", "buffer_len": "buffer_len", "shadow": "shadow"}
PY_DEFAULTS = {k: v.default for k, v in inspect.signature(make_python_repo).parameters.items()
               if v.default is not inspect.Parameter.empty}
# the streaming model's own flags (builders/triton_generate.py make_generate_repo); MODES is builders/generation.py's,
# spelled out here so that the tensorrt_plan route imports no torch (tests/test_triton_repo.py checks they agree)
STREAMING_ONLY = ("mode", "text_input")
MODES = ("conventional", "replay", "replay_bf16", "replay_fp8")
SHADOW_MODE = {"none": "replay", "bf16": "replay_bf16", "fp8": "replay_fp8"}  # --shadow as a --mode


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _mode(mode: str | None, shadow: str | None) -> str:
    """--mode, or --shadow's mode; RepoError where the two disagree."""
    if mode is not None and shadow is not None and SHADOW_MODE[shadow] != mode:
        raise RepoError(f"--mode {mode} and --shadow {shadow} disagree (--shadow {shadow} is --mode {SHADOW_MODE[shadow]})")
    return mode or SHADOW_MODE[shadow or "none"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("tensorrt_plan", "python"), default="tensorrt_plan",
                    help="tensorrt_plan: the built engine with implicit state; python: a model that owns its state")
    ap.add_argument("--engine-dir", type=pathlib.Path, help="output directory of build_engine.py (tensorrt_plan only)")
    ap.add_argument("--repo", required=True, type=pathlib.Path, help="model repository root to write into")
    ap.add_argument("--name", help="model name in the repository (default: <family>_replayssm, the family from the "
                                   "engine's or checkpoint's model_type or the --tiny name, e.g. nemotron_h_replayssm, "
                                   "qwen3_5_moe_replayssm)")
    both = ap.add_argument_group("sequence batching (both backends)")
    both.add_argument("--idle-ms", type=int, default=PY_DEFAULTS["idle_us"] // 1000,
                      help="max_sequence_idle_microseconds / 1000 (default: %(default)s)")
    both.add_argument("--max-queue-delay-us", type=int, default=PY_DEFAULTS["max_queue_delay_us"],
                      help="oldest strategy's batching delay (default: %(default)s)")
    d = PY_DEFAULTS
    py = ap.add_argument_group("--backend python only")
    py.add_argument("--model", type=pathlib.Path,
                    help="Nemotron-H / Nemotron 3 / Qwen3-Next / Qwen3.5 checkpoint directory (default: the embedded "
                         "tiny); loaded once here as the server will load it, so a bad checkpoint is refused now")
    py.add_argument("--tiny", help="embedded tiny config without --model: nemotron_h, nemotron3, qwen3_next, qwen3_5, "
                                   f"qwen3_5_moe (default: {d['tiny']})")
    py.add_argument("--seed", type=int, help=f"seed of the tiny model's weights (default: {d['seed']})")
    py.add_argument("--dtype", type=dtype_spelling, choices=DTYPES,
                    help=f"weights and activations, as build_engine.py's --dtype (float32 / bfloat16 / float16 are "
                         f"also accepted; default: {d['dtype']})")
    py.add_argument("--device", choices=("auto", "cpu", "cuda"),
                    help=f"auto: cuda where torch sees a GPU here; cuda is refused where it sees none (default: "
                         f"{d['device']})")
    py.add_argument("--max-slots", type=int, help=f"cache slots = max_candidate_sequences (default: {d['max_slots']})")
    py.add_argument("--max-seq-len", type=int, help=f"tokens per sequence, K/V rows (default: {d['max_seq_len']})")
    py.add_argument("--buffer-len", type=int, help=f"ReplaySSM ring length L, 1..32 (default: {d['buffer_len']})")
    py.add_argument("--shadow", choices=("none", "bf16", "fp8"),
                    help="a low-precision shadow of each fp32 checkpoint, read by non-flush steps (fp8: Mamba-2 "
                         f"models only; default: {d['shadow']}); the same as --mode replay / replay_bf16 / replay_fp8")
    py.add_argument("--mode", choices=MODES,
                    help="the SSM state of the streaming model (Nemotron-H / Nemotron 3): conventional, replay "
                         "(ReplaySSM), replay_bf16 / replay_fp8 (ReplaySSM + a shadow; default: replay, or --shadow's); "
                         "the per-token model (Qwen) runs ReplaySSM, its --shadow from this")
    py.add_argument("--text-input", choices=("auto", "tensor", "parameter"),
                    help="how the streaming model takes a text prompt: a BYTES text_input tensor, or the request "
                         "parameter text_input (HTTP generate passes an undeclared JSON field as one); auto: the "
                         "tensor where numpy < 2 (the stub of tritonserver 2.51 cannot read BYTES under numpy 2)")
    py.add_argument("--serve", action="store_true",
                    help="after writing, run the printed serve command (the nvidia-pytriton tritonserver on "
                         "127.0.0.1, HTTP 8000, gRPC 8001) in place of this process")
    args = ap.parse_args(argv)
    given = {dest: getattr(args, dest) for dest in (*PYTHON_ONLY, *STREAMING_ONLY) if getattr(args, dest) is not None}
    batching = dict(idle_us=args.idle_ms * 1000, max_queue_delay_us=args.max_queue_delay_us)
    try:
        if args.backend == "python":
            if args.engine_dir is not None:
                raise RepoError(f"--engine-dir: only with --backend tensorrt_plan (--backend python runs the "
                                f"checkpoint itself: --model DIR or --tiny NAME), got --engine-dir {args.engine_dir}")
            tiny_only = [_flag(k) for k in ("tiny", "seed") if k in given]
            if args.model is not None and tiny_only:
                raise RepoError(f"{', '.join(tiny_only)}: the embedded tiny model's, used only without --model, got "
                                f"them with --model {args.model}")
            _check_ranges(*_batching_ranges(**batching))
            from builders.triton_generate import is_streaming_family, make_generate_repo

            kw = {PYTHON_ONLY[k]: v for k, v in given.items() if k in PYTHON_ONLY}
            streaming = is_streaming_family(kw.get("tiny", PY_DEFAULTS["tiny"]), args.model)
            mode = _mode(args.mode, args.shadow)
            if args.model is not None:
                print(f"[make_triton_repo] checking --model {args.model}: loading it as the server will", flush=True)
            if streaming:
                kw.pop("shadow", None)
                target = make_generate_repo(args.repo, args.name, **kw, mode=mode,
                                            **({"text_input": args.text_input} if args.text_input else {}))
            else:
                if mode == "conventional":
                    raise RepoError("--mode conventional: the per-token model of Qwen3-Next / Qwen3.5 runs ReplaySSM "
                                    "(--mode replay, replay_bf16)")
                if args.text_input:
                    raise RepoError("--text-input: only for the streaming model (Nemotron-H / Nemotron 3)")
                kw["shadow"] = {v: k for k, v in SHADOW_MODE.items()}[mode]
                print("[make_triton_repo] note: Qwen3-Next / Qwen3.5 get the per-token model (one token in, logits "
                      "out, a sequence per correlation id): the streaming model needs the captured model step, which "
                      "has no Gated DeltaNet layers yet")
                target = make_python_repo(args.repo, args.name, **kw, **batching)
        elif given:
            flags = ", ".join(_flag(k) for k in given)
            raise RepoError(f"{flags}: only with --backend python (a tensorrt_plan repository serves the engine in "
                            f"--engine-dir, built with its own model, dtype and sizes by scripts/build_engine.py)")
        elif args.engine_dir is None:
            raise RepoError("--engine-dir is required with --backend tensorrt_plan")
        else:
            target = make_repo(args.engine_dir, args.repo, args.name, **batching)
    except RepoError as e:
        print(f"make_triton_repo: {e}", file=sys.stderr)
        return 2
    if args.backend == "python":
        print(f"[make_triton_repo] wrote {target}/config.pbtxt and {target}/1/model.py")
        try:
            backends = write_backend_dir(args.repo.parent / f"{args.repo.name}-backends")
            cmd, env = serve_command(args.repo, backends)
            print("[make_triton_repo] serve with: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd),
                  flush=True)
        except RepoError as e:
            print(f"[make_triton_repo] {e}; or serve it with a tritonserver whose Python backend runs this Python "
                  f"(its packages and the project on the paths of parameters['python_path'])")
            return 2 if args.serve else 0
        if args.serve:
            os.execvpe(cmd[0], cmd, {**os.environ, **env})
        return 0
    has_plan = (target / "1" / "model.plan").is_file()
    note = "" if has_plan else " (no model.plan yet: see 1/MISSING_PLAN.txt)"
    print(f"[make_triton_repo] wrote {target}/config.pbtxt{note}")
    print(f"[make_triton_repo] serve with: tritonserver --model-repository={args.repo} "
          f"--exit-timeout-secs={EXIT_TIMEOUT_S}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
