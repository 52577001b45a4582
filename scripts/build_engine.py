#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build a ReplaySSM decode-step engine directory for a model of a kind with an engine export (builders/models.py).

The command line over ``builders/engine.py`` (:func:`builders.engine.build`). What the output directory
holds (model.onnx, or verify.onnx + commit.onnx with ``--num-draft N``; the plugin PTX per tactic;
config.json; trtexec.sh; the plan(s) where TensorRT >= 10.9 and a GPU are present) and every field of
config.json is the engine-directory format, ``builders/engine_format.py``. The directory is written to a
temporary sibling and renamed to --out at the end.

TensorRT's Python plugins are registered by the building process (``trt_plugin.register()``; this
script does it). trtexec cannot register them, so its commands only work from a process that can, or
to run the built plans (AOT plugins need no Python at run time: ``trtexec --loadEngine=...``).

It ends by listing what it wrote (every file of --out with its size) and the next step: the
scripts/make_triton_repo.py command for a standard engine, the test command for this kind of engine and, where
no plan was built here, trtexec.sh (the trtexec command itself stays in that file).
``--dtype`` / ``--state-dtype`` take make_triton_repo.py's spellings, fp32 / bf16 / fp16 (float32 / bfloat16 /
float16 also accepted).

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
from builders.engine_format import is_speculative  # noqa: E402
from builders.models import by_model_type, kinds  # noqa: E402
from builders.triton_repo import DTYPE_ALIASES, dtype_spelling  # noqa: E402  (--dtype spelled as make_triton_repo's)
from trtllm_replayssm.config import SUPPORTED_BUFFER_LEN  # noqa: E402

DEFAULTS = {f.name: f.default for f in dataclasses.fields(BuildOptions)}  # one set of defaults: the library's


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=pathlib.Path, default=None,
                   help="HF directory (config.json + *.safetensors); default: embedded tiny config")
    tinies = "; ".join(f"{', '.join(k.tiny)} ({k.title}: {k.ssm})" for k in kinds(export=True))
    p.add_argument("--tiny", choices=TINY_NAMES, default=None,
                   help=f"embedded tiny config without --model (default {TINY_NAMES[0]}): {tinies}")
    p.add_argument("--moe-formulation", choices=MOE_FORMULATIONS, default=DEFAULTS["moe_formulation"],
                   help="routed experts of MoE layers in the graph: dense over experts with a routing mask "
                        "(default) or gathered per token (builders/moe.py says when each is cheaper)")
    p.add_argument("--out", type=pathlib.Path, required=True, help="output directory (must not exist)")
    p.add_argument("--max-batch", type=int, default=DEFAULTS["max_batch"])
    p.add_argument("--buffer-len", type=int, default=DEFAULTS["buffer_len"],
                   help=f"ReplaySSM buffer length, one of {SUPPORTED_BUFFER_LEN}")
    aliases = "/".join(DTYPE_ALIASES)
    p.add_argument("--state-dtype", type=dtype_spelling, choices=sorted(DTYPES), default=DEFAULTS["state_dtype"],
                   help=f"checkpoint state dtype ({aliases} also accepted)")
    p.add_argument("--dtype", type=dtype_spelling, choices=sorted(DTYPES), default=DEFAULTS["dtype"],
                   help="activation / weight dtype of the engine, as make_triton_repo.py's --dtype (a bf16 checkpoint "
                        f"still gives an fp32 engine unless --dtype bf16 is passed; {aliases} also accepted)")
    p.add_argument("--arch", type=int, default=DEFAULTS["arch"], choices=SUPPORTED_ARCHS,
                   help="SM architecture of the plugin PTX (90 = Hopper, tested on the H200; 100 = Blackwell, compiled in CI "
                        "only; the PTX needs a driver that reads the installed NVRTC's PTX ISA, docs/tensorrt.md)")
    p.add_argument("--sm-count", type=int, default=DEFAULTS["sm_count"], help="SMs of the target GPU (persistent-kernel grid)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULTS["max_seq_len"], help="KV cache capacity per row")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed of the tiny model's random weights")
    p.add_argument("--num-draft", type=int, default=DEFAULTS["num_draft"],
                   help="speculative decoding: draft tokens per step (T = N + 1 verified at once); exports the "
                        "verify and commit graphs instead of the decode step")
    p.add_argument("--shadow", choices=SHADOWS, default=DEFAULTS["shadow"],
                   help="a low-precision shadow of the fp32 checkpoint as one more state per SSM layer, read by "
                        "steps without a fold, rewritten by folds: bf16 or fp8 with per-row scales, those the model's "
                        "SSM family keeps (" + "; ".join(f"{k.ssm}: {', '.join(k.shadows)}" for k in kinds(export=True))
                        + "); --state-dtype fp32")
    p.add_argument("--row-order", action="store_true",
                   help="one replayssm::flush_order node a step: the decode kernels take their rows flushing rows "
                        "first (measured on the kernels with a bf16 shadow: mixed batches 10-25%% faster); standard "
                        "decode, and for Nemotron-H with a --shadow only")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    a = p.parse_args(argv)
    try:
        check_options(BuildOptions(**vars(a)))
    except BuildError as e:
        p.error(str(e))
    return a


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def summary(out: pathlib.Path) -> str:
    """What the build wrote (every file of ``out`` with its size) and the next step: the Triton repository of a
    standard engine (scripts/make_triton_repo.py) or what runs a speculative pair, the tests of this kind of
    engine, and, where no plan was built here, trtexec.sh (its command stays in that file)."""
    import json

    cfg = json.loads((out / "config.json").read_text())
    files = sorted(f for f in out.rglob("*") if f.is_file())
    lines = [f"wrote {out} ({len(files)} files):"]
    lines += [f"  {_size(f.stat().st_size):>10}  {f.relative_to(out)}" for f in files]
    spec = is_speculative(cfg)
    plans = ("verify.plan", "commit.plan") if spec else ("model.plan",)
    missing = [p for p in plans if not (out / p).is_file()]
    if missing:
        lines.append(f"{' and '.join(missing)} not built here (TensorRT >= 10.9 and a GPU): rerun this command "
                     f"there, or the trtexec command in {out / 'trtexec.sh'} from a process that registered the plugins")
    kind = by_model_type((cfg.get("model") or {}).get("model_type")) or kinds(export=True)[0]
    tests = kind.tests[spec]  # the tests of the model kind's engines (builders/models.py)
    if spec:
        lines.append("next: the verify + commit pair is driven by its caller (sampling between the two plans; "
                     "config.json 'graphs'); scripts/make_triton_repo.py serves standard engines only")
    else:
        lines.append(f"next: python scripts/make_triton_repo.py --engine-dir {out} --repo {out}-triton")
    lines.append(f"tests: python -m pytest -q {tests}   (on a GPU: python -m pytest -m gpu)")
    return "\n".join(f"[build_engine] {line}" for line in lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from builders.nemotron_h import CheckpointError

    try:
        out = build(BuildOptions(**vars(args)))
    except (BuildError, CheckpointError) as e:
        print(f"build_engine.py: error: {e}", file=sys.stderr)
        return 1
    print(summary(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
