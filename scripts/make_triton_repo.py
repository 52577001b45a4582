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
builders/qwen_export.py) has conv_state_i, gdn_state_i, gdn_u_i, gdn_v_i, gdn_k_i, gdn_g_i, gdn_beta_i;
anything else is refused before a file is written, naming the layer and the state.

Usage: python scripts/make_triton_repo.py --engine-dir build/tiny --repo build/triton [--name NAME]
       [--idle-ms 60000] [--max-queue-delay-us 100]
(the model, dtype and sizes are the engine's: the --backend python flags below are refused here by name)

``--backend python`` (no engine): the **streaming** model (builders/triton_generate.py) of every family the
generation engine serves: Nemotron-H / Nemotron 3 (``--tiny nemotron_h|nemotron3``, or a ``--model`` whose
config.json says nemotron_h) and Qwen3-Next / Qwen3.5 / Qwen3.5 MoE (``--tiny qwen3_next|qwen3_5|qwen3_5_moe``, or a
``--model`` whose config.json says qwen3_next / qwen3_5 / qwen3_5_moe or their *_text). Decoupled: a prompt in
(``input_ids`` or ``text_input``), the completion streamed back (``output_ids``, ``text_output``, then
``finish_reason`` and token counts), over the generation engine of builders/generation.py (in-flight batching of
``--max-slots`` sequences on the family's decode step, ``--mode`` conventional | replay | replay_bf16 | replay_fp8 | replay_ckpt8;
no fp8 for Gated DeltaNet); Triton's HTTP generate_stream works too. Everything it needs is a ``parameters`` entry
of config.pbtxt (the checkpoint: ``model_dir``, or ``tiny`` + ``seed``; dtype, device, sizes, mode;
``python_path`` / ``python_version``: the backend stub embeds libpython with an isolated configuration that ignores
PYTHONPATH, so model.py puts this interpreter's project root and site-packages on ``sys.path`` itself and refuses
another Python version).

:func:`pytriton_server` finds the tritonserver that the nvidia-pytriton wheel bundles, :func:`serve_command` gives
the command that serves the repository with it (printed; ``--serve`` runs it).

Usage: python scripts/make_triton_repo.py --backend python --repo build/triton [--tiny nemotron_h | --model DIR]
       [--dtype fp32|bf16|fp16] [--device auto|cpu|cuda] [--max-slots 8] [--max-seq-len 1024] [--buffer-len 16]
       [--mode conventional|replay|replay_bf16|replay_fp8|replay_ckpt8 | --shadow none|bf16|fp8]
       [--text-input auto|tensor|parameter] [--prefix-cache-tokens N [--prefix-block 16]]
       [--preempt [--preempt-quantum 16] [--max-swapped-bytes B]] [--serve]
(--prefix-cache-tokens and --preempt turn on the engine's prefix cache and preemption: parameters prefix_cache_tokens,
prefix_block, preempt, preempt_quantum, max_swapped_bytes of config.pbtxt; docs/triton.md)
Refused before a file is written, naming the flag: --engine-dir, --idle-ms and --max-queue-delay-us (tensorrt_plan
only: the streaming model has no sequence batcher); --device cuda where torch sees no CUDA device; --mode replay_fp8
for a Gated DeltaNet model; a --model that the server's own loader or decode step refuses (it is loaded once here, on
the CPU: a truncated safetensors file, a missing or mis-shaped tensor); a --repo that is a file.

Shutdown: on SIGINT / SIGTERM tritonserver waits for in-flight requests (a sequence batcher's: every sequence that
has not ended, no END yet, not idle for --idle-ms); the streaming model ends its open streams with an error once the
server stops being live. The printed serve commands bound that wait with --exit-timeout-secs
(builders/triton_repo.py EXIT_TIMEOUT_S; tritonserver's default is 30 s).
"""

# The writers are builders/triton_repo.py (make_repo) and builders/triton_generate.py (make_generate_repo); the
# docstring above is this command's --help.
from __future__ import annotations

import argparse
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
    make_repo,
    serve_command,
    write_backend_dir,
)

# --backend python's flags (dest -> builders/triton_generate.py make_generate_repo keyword) and their defaults,
# which are make_generate_repo's; argparse's are None, so that a flag the user gave is told from one left out. They
# are spelled out here, as the engine's MODES are, so that the tensorrt_plan route imports no torch
# (tests/test_triton_generate.py checks that they agree). With --backend tensorrt_plan these are refused by name (the
# engine was built with its own; scripts/build_engine.py).
PYTHON_ONLY = {"model": "model_dir", "tiny": "tiny", "seed": "seed", "dtype": "dtype", "device": "device",
               "max_slots": "max_slots", "max_seq_len": "max_seq_len", "buffer_len": "buffer_len", "mode": "mode",
               "text_input": "text_input", "prefix_cache_tokens": "prefix_cache_tokens", "prefix_block": "prefix_block",
               "preempt": "preempt", "preempt_quantum": "preempt_quantum", "max_swapped_bytes": "max_swapped_bytes"}
PY_DEFAULTS = {"tiny": "nemotron_h", "seed": 0, "dtype": "fp32", "device": "auto", "max_slots": 8,
               "max_seq_len": 1024, "buffer_len": 16, "mode": "replay", "text_input": "auto", "prefix_cache_tokens": 0,
               "prefix_block": 16, "preempt": False, "preempt_quantum": 16, "max_swapped_bytes": None}
MODES = ("conventional", "replay", "replay_bf16", "replay_fp8", "replay_ckpt8")
SHADOW_MODE = {"none": "replay", "bf16": "replay_bf16", "fp8": "replay_fp8"}  # --shadow as a --mode
# the tensorrt_plan route's sequence batcher (builders/triton_repo.py model_config's defaults)
TRT_ONLY = {"idle_ms": 60_000, "max_queue_delay_us": 100}


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
                    help="tensorrt_plan: the built engine with implicit state; python: the streaming generation "
                         "model, which owns its state")
    ap.add_argument("--engine-dir", type=pathlib.Path, help="output directory of build_engine.py (tensorrt_plan only)")
    ap.add_argument("--repo", required=True, type=pathlib.Path, help="model repository root to write into")
    ap.add_argument("--name", help="model name in the repository (default: <family>_replayssm, the family from the "
                                   "engine's or checkpoint's model_type or the --tiny name, e.g. nemotron_h_replayssm, "
                                   "qwen3_5_moe_replayssm)")
    trt = ap.add_argument_group("--backend tensorrt_plan only (its sequence batcher)")
    trt.add_argument("--idle-ms", type=int,
                     help=f"max_sequence_idle_microseconds / 1000 (default: {TRT_ONLY['idle_ms']})")
    trt.add_argument("--max-queue-delay-us", type=int,
                     help=f"oldest strategy's batching delay (default: {TRT_ONLY['max_queue_delay_us']})")
    d = PY_DEFAULTS
    py = ap.add_argument_group("--backend python only")
    py.add_argument("--model", type=pathlib.Path,
                    help="Nemotron-H / Nemotron 3 / Qwen3-Next / Qwen3.5 / Kimi-Linear / GLM-5 Next checkpoint directory "
                         "(default: the embedded tiny); loaded once here as the server will load it, so a bad "
                         "checkpoint is refused now")
    py.add_argument("--tiny", help="embedded tiny config without --model: nemotron_h, nemotron3, qwen3_next, qwen3_5, "
                                   f"qwen3_5_moe, kimi_linear, glm5_next (default: {d['tiny']})")
    py.add_argument("--seed", type=int, help=f"seed of the tiny model's weights (default: {d['seed']})")
    py.add_argument("--dtype", type=dtype_spelling, choices=DTYPES,
                    help=f"weights and activations, as build_engine.py's --dtype (float32 / bfloat16 / float16 are "
                         f"also accepted; default: {d['dtype']})")
    py.add_argument("--device", choices=("auto", "cpu", "cuda"),
                    help=f"auto: cuda where torch sees a GPU here; cuda is refused where it sees none (default: "
                         f"{d['device']})")
    py.add_argument("--max-slots", type=int, help=f"sequences decoded at once (engine slots; more wait in a queue; "
                                                  f"default: {d['max_slots']})")
    py.add_argument("--max-seq-len", type=int, help=f"prompt + max_tokens per sequence, K/V rows (default: "
                                                    f"{d['max_seq_len']})")
    py.add_argument("--buffer-len", type=int, help=f"ReplaySSM ring length L, 1..32 (default: {d['buffer_len']})")
    py.add_argument("--mode", choices=MODES,
                    help="the SSM state: conventional, replay (ReplaySSM), replay_bf16 / replay_fp8 (ReplaySSM + a "
                         "low-precision shadow of each fp32 checkpoint that non-flush steps read; fp8: Mamba-2 models "
                         "only), replay_ckpt8 (an 8-bit fp8-e4m3 checkpoint, stochastic rounding at each flush; "
                         f"Mamba-2 models only); default: {d['mode']}, or --shadow's")
    py.add_argument("--shadow", choices=("none", "bf16", "fp8"),
                    help="the same as --mode replay / replay_bf16 / replay_fp8 (the two must agree)")
    py.add_argument("--text-input", choices=("auto", "tensor", "parameter"),
                    help="how the streaming model takes a text prompt: a BYTES text_input tensor, or the request "
                         "parameter text_input (HTTP generate passes an undeclared JSON field as one); auto: the "
                         "tensor where numpy < 2 (the stub of tritonserver 2.51 cannot read BYTES under numpy 2)")
    py.add_argument("--prefix-cache-tokens", type=int,
                    help="> 0: the engine's prefix cache of shared prompt prefixes, that budget in cached tokens "
                         f"(default: {d['prefix_cache_tokens']}, off)")
    py.add_argument("--prefix-block", type=int, help=f"the prefix cache's block in tokens (default: {d['prefix_block']})")
    py.add_argument("--preempt", action="store_true", default=None,
                    help="requests beyond the slots take the slot of one that has decoded --preempt-quantum steps, "
                         "swapped out to host memory and back later (default: off, they wait in the queue)")
    py.add_argument("--preempt-quantum", type=int,
                    help=f"decode steps a request keeps its slot before it can be preempted (default: "
                         f"{d['preempt_quantum']})")
    py.add_argument("--max-swapped-bytes", type=int,
                    help="host memory the swapped-out requests may hold at once (default: no limit)")
    py.add_argument("--serve", action="store_true",
                    help="after writing, run the printed serve command (the nvidia-pytriton tritonserver on "
                         "127.0.0.1, HTTP 8000, gRPC 8001) in place of this process")
    args = ap.parse_args(argv)
    given = {dest: getattr(args, dest) for dest in (*PYTHON_ONLY, "shadow") if getattr(args, dest) is not None}
    trt_given = [dest for dest in TRT_ONLY if getattr(args, dest) is not None]
    try:
        if args.backend == "python":
            if args.engine_dir is not None:
                raise RepoError(f"--engine-dir: only with --backend tensorrt_plan (--backend python runs the "
                                f"checkpoint itself: --model DIR or --tiny NAME), got --engine-dir {args.engine_dir}")
            if trt_given:
                raise RepoError(f"{', '.join(_flag(k) for k in trt_given)}: only with --backend tensorrt_plan (its "
                                f"sequence batcher; the streaming model of --backend python batches in its engine)")
            tiny_only = [_flag(k) for k in ("tiny", "seed") if k in given]
            if args.model is not None and tiny_only:
                raise RepoError(f"{', '.join(tiny_only)}: the embedded tiny model's, used only without --model, got "
                                f"them with --model {args.model}")
            kw = {PYTHON_ONLY[k]: v for k, v in given.items() if k in PYTHON_ONLY}
            kw["mode"] = _mode(args.mode, args.shadow)
            from builders.triton_generate import make_generate_repo

            if args.model is not None:
                print(f"[make_triton_repo] checking --model {args.model}: loading it as the server will", flush=True)
            target = make_generate_repo(args.repo, args.name, **kw)
        elif given:
            flags = ", ".join(_flag(k) for k in given)
            raise RepoError(f"{flags}: only with --backend python (a tensorrt_plan repository serves the engine in "
                            f"--engine-dir, built with its own model, dtype and sizes by scripts/build_engine.py)")
        elif args.engine_dir is None:
            raise RepoError("--engine-dir is required with --backend tensorrt_plan")
        else:
            batching = dict(idle_us=(args.idle_ms if args.idle_ms is not None else TRT_ONLY["idle_ms"]) * 1000,
                            max_queue_delay_us=args.max_queue_delay_us if args.max_queue_delay_us is not None
                            else TRT_ONLY["max_queue_delay_us"])
            _check_ranges(*_batching_ranges(**batching))
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
