#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build a ReplaySSM decode-step engine directory for a Nemotron-H / Nemotron 3 or Qwen3-Next / Qwen3.5 model.

The command line over ``builders/engine.py`` (:func:`builders.engine.build`). What the output directory
holds (model.onnx, or verify.onnx + commit.onnx with ``--num-draft N``; the plugin PTX per tactic;
config.json; trtexec.sh; the plan(s) where TensorRT >= 10.9 and a GPU are present) and every field of
config.json is the engine-directory format, ``builders/engine_format.py``. The directory is written to a
temporary sibling and renamed to --out at the end.

TensorRT's Python plugins are registered by the building process (``trt_plugin.register()``; this
script does it). trtexec cannot register them, so its commands only work from a process that can, or
to run the built plans (AOT plugins need no Python at run time: ``trtexec --loadEngine=...``).

Usage: python scripts/build_engine.py --out DIR [--model HF_DIR | --tiny nemotron3] [--max-batch 8]
       [--buffer-len 16] [--moe-formulation dense] [--state-dtype fp32] [--dtype fp32] [--arch 90]
       [--max-seq-len 4096] [--num-draft N] [--shadow none|bf16|fp8] [--overwrite]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.engine import (  # noqa: E402
    DTYPES,
    MOE_FORMULATIONS,
    SHADOWS,
    SUPPORTED_ARCHS,
    TINY_NAMES,
    BuildError,
    BuildOptions,
    build,
    check_options,
)
from trtllm_replayssm.config import SUPPORTED_BUFFER_LEN  # noqa: E402

DEFAULTS = {f.name: f.default for f in dataclasses.fields(BuildOptions)}  # one set of defaults: the library's


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=pathlib.Path, default=None,
                   help="HF directory (config.json + *.safetensors); default: embedded tiny config")
    p.add_argument("--tiny", choices=TINY_NAMES, default=None,
                   help="embedded tiny config without --model: nemotron_h (default, M*-M-M*-), nemotron3 "
                        "(Mamba-2 + MoE + attention, MEM*EM*E), qwen3_next, qwen3_5 or qwen3_5_moe (Gated DeltaNet + "
                        "gated attention, 3 GDN layers then 1 attention layer; Qwen3-Next and Qwen3.5 MoE with MoE)")
    p.add_argument("--moe-formulation", choices=MOE_FORMULATIONS, default=DEFAULTS["moe_formulation"],
                   help="routed experts of MoE layers in the graph: dense over experts with a routing mask "
                        "(default) or gathered per token (builders/moe.py says when each is cheaper)")
    p.add_argument("--out", type=pathlib.Path, required=True, help="output directory (must not exist)")
    p.add_argument("--max-batch", type=int, default=DEFAULTS["max_batch"])
    p.add_argument("--buffer-len", type=int, default=DEFAULTS["buffer_len"],
                   help=f"ReplaySSM buffer length, one of {SUPPORTED_BUFFER_LEN}")
    p.add_argument("--state-dtype", choices=sorted(DTYPES), default=DEFAULTS["state_dtype"], help="checkpoint state dtype")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=DEFAULTS["dtype"],
                   help="activation / weight dtype of the engine (a bf16 checkpoint still gives an fp32 engine "
                        "unless --dtype bf16 is passed)")
    p.add_argument("--arch", type=int, default=DEFAULTS["arch"], choices=SUPPORTED_ARCHS,
                   help="SM architecture of the plugin PTX (90 = Hopper, tested on the H200; 100 = Blackwell, compiled in CI "
                        "only; the PTX needs a driver that reads the installed NVRTC's PTX ISA, README)")
    p.add_argument("--sm-count", type=int, default=DEFAULTS["sm_count"], help="SMs of the target GPU (persistent-kernel grid)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULTS["max_seq_len"], help="KV cache capacity per row")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed of the tiny model's random weights")
    p.add_argument("--num-draft", type=int, default=DEFAULTS["num_draft"],
                   help="speculative decoding: draft tokens per step (T = N + 1 verified at once); exports the "
                        "verify and commit graphs instead of the decode step")
    p.add_argument("--shadow", choices=SHADOWS, default=DEFAULTS["shadow"],
                   help="a low-precision shadow of the fp32 checkpoint as one more state per SSM layer, read by "
                        "steps without a fold, rewritten by folds: bf16 (Nemotron and Qwen engines, standard and "
                        "--num-draft) or fp8 with per-row scales (Nemotron engines); --state-dtype fp32")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    a = p.parse_args(argv)
    try:
        check_options(BuildOptions(**vars(a)))
    except BuildError as e:
        p.error(str(e))
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    from builders.nemotron_h import CheckpointError

    try:
        build(BuildOptions(**vars(args)))
    except (BuildError, CheckpointError) as e:
        print(f"build_engine.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
