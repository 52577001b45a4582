#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The end-to-end benchmark: one whole hybrid-model step (all layers, greedy argmax written back into the
input ids) per SSM mode, through the shared model step (:mod:`builders.model_step`: T = 1 is standard
decode, T > 1 speculative verify with acceptance and commit on the device), captured in a CUDA graph.

Two steps, one CLI (the common flags, the model, the meta, the results file and the timing harness
:mod:`trtllm_replayssm.timing` are shared; the memory and bytes models are :mod:`trtllm_replayssm.costs`):

  standard  T = 1 decode (:mod:`scripts.e2e_standard`): conventional / ReplaySSM (+ bf16 / fp8 shadow) /
            mamba_ssm / no SSM, gated on greedy tokens against the conventional mode (shadow modes:
            teacher-forced logit gate); ``--tp N`` under torchrun for tensor parallelism
  spec      T-token speculative decoding (:mod:`scripts.e2e_spec`): the standard ReplaySSM step,
            ReplaySSM verify + commit, native spec (T state snapshots), spec without SSM, at controlled
            draft acceptances; exactness checked against plain greedy decoding before timing

Model (:mod:`builders.random_model`): Nemotron-H-8B geometry through transformers' ``NemotronHConfig``
(52 layers, 24 Mamba-2 / 4 attention / 24 MLP, real vocab 131072 unless ``--vocab``) or a Nemotron 3
layer stack (``--model-geometry``, Mamba-2 + MoE), bf16 weights from a seeded generator (no checkpoint);
``--tiny``: a small embedded config (CPU smoke test); ``--layers N``: the first N layers of the pattern.
On the CPU there are no graphs: eager steps timed with ``perf_counter``, labelled so in the rows.

Results: ``RESULT_JSON`` lines (meta, then one per row) on stdout and ``{out}/{date}_{tag}_{commit}.json``
rewritten after every batch (a cut run keeps what it measured); ``--plot`` adds a PNG.

Usage:
  python scripts/bench_e2e.py standard [--batches 1,8,32,64,128,256] [--modes ...] [--plot]
  python scripts/bench_e2e.py standard --tiny --device cpu           # CPU smoke path
  torchrun --nproc_per_node 2 scripts/bench_e2e.py standard --tp 2 [--batches 64,256]
  python scripts/bench_e2e.py spec [--batches 1,32,64,128,256] [--acceptances 0.6,0.8,0.95] [--plot]
  python scripts/bench_e2e.py <step> --help                          # every flag of a step
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

# NVLink multicast stays off for NCCL (standard --tp): set before torch.distributed / NCCL start.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.random_model import MODEL_GEOMETRIES, model_config  # noqa: E402
from scripts import e2e_spec, e2e_standard  # noqa: E402
from trtllm_replayssm import timing  # noqa: E402

STEPS = {"standard": e2e_standard, "spec": e2e_spec}
GateError = e2e_standard.GateError


class Run:
    """What every step's run shares: device, the timed model's dtype and config, the meta every row
    carries, the log, and the results file (written after every batch)."""

    def __init__(self, args, step: str):
        self.args, self.step = args, step
        self.t0 = time.perf_counter()
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.config = model_config(args.tiny or False, args.layers, args.vocab, geometry=args.model_geometry)
        kinds = list(self.config.layers_block_type)
        self.meta = dict(**timing.run_meta(self.dev, args.commit, seed=args.seed), step=step,
                         model=f"tiny_{args.tiny}" if args.tiny else f"{args.model_geometry}_geometry",
                         pattern=self.config.hybrid_override_pattern, layers=len(kinds),
                         mamba_layers=kinds.count("linear_attention"), attention_layers=kinds.count("full_attention"),
                         moe_layers=kinds.count("moe"), vocab=self.config.vocab_size,
                         dtype=str(self.dtype).replace("torch.", ""), state_dtype="float32",
                         weights="seeded random (no checkpoint)", buffer_len=args.buffer_len)
        if self.cuda:  # before anything else is resident; rows say how close the step is to it
            self.meta["copy_ceiling_tbps"] = timing.copy_ceiling_tbps()
        try:
            import transformers

            self.meta["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover
            pass
        self.path = None

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def open(self, default_tag: str) -> pathlib.Path:
        """Print the meta (complete by now) and name the results file."""
        print("RESULT_JSON " + json.dumps({"kind": "meta", **self.meta}), flush=True)
        out = pathlib.Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{self.meta['date'][:10]}_{self.args.tag or default_tag}_{self.meta['commit'][:10]}.json"
        return self.path

    def emit(self, row: dict) -> None:
        print("RESULT_JSON " + json.dumps({"kind": "row", **self.meta, **row}), flush=True)

    def save(self, rows: list[dict]) -> None:
        self.meta["wall_s"] = time.perf_counter() - self.t0
        self.path.write_text(json.dumps({"meta": self.meta, "rows": rows}, indent=1))

    def finish(self, rows: list[dict], summary: str, print_table, plot) -> list[dict]:
        self.save(rows)
        print(f"# {self.meta['device']}, {self.meta['model']} ({self.meta['layers']} layers, vocab "
              f"{self.meta['vocab']}), {summary}; {self.meta['wall_s']:.0f} s; results in {self.path}")
        print_table(rows)
        if self.args.plot:
            png = self.path.with_suffix(".png")
            plot(rows, png)
            print(f"# plot: {png}")
        return rows


def common_arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model and run (both steps)")
    g.add_argument("--tiny", nargs="?", const="nemotron_h", default=None, choices=("nemotron_h", "nemotron3"),
                   help="a small embedded config (CPU smoke test): nemotron_h (default) or nemotron3 (MoE)")
    g.add_argument("--model-geometry", default="nemotron_h_8b", choices=MODEL_GEOMETRIES,
                   help="the layer stack: Nemotron-H-8B or a Nemotron 3 model (published config.json sizes, "
                        "random bf16 weights, a seeded router)")
    g.add_argument("--layers", type=int, default=None, help="first N layers of the hybrid pattern")
    g.add_argument("--vocab", type=int, default=None, help="reduce the vocabulary (default: the config's)")
    g.add_argument("--buffer-len", type=int, default=16, help="ReplaySSM buffer length L")
    g.add_argument("--prompt-len", type=int, default=32)
    g.add_argument("--context", type=int, default=1024,
                   help="KV cache positions allocated (the fused step's attention reads only the filled ones)")
    g.add_argument("--tie-rel", type=float, default=1e-3, help="near tie: top-2 margin below this x std(logits)")
    g.add_argument("--max-tie-frac", type=float, default=0.05, help="rows that may fork at a near tie")
    g.add_argument("--strict", "--strict-gate", "--strict-check", dest="strict", action="store_true",
                   help="no forks at all, not even at near ties")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default=str(ROOT / "bench" / "results"))
    g.add_argument("--tag", default=None, help="results file tag (default: the step's)")
    g.add_argument("--commit", default=None, help="default: $GIT_COMMIT, else git HEAD")
    g.add_argument("--plot", action="store_true")
    return p


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True, metavar="{standard,spec}")
    common = common_arguments()
    for name, mod in STEPS.items():
        p = sub.add_parser(name, parents=[common], description=mod.__doc__, help=mod.__doc__.splitlines()[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
    return ap


def _int_list(text: str, flag: str, lo: int = 1) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < lo:
        raise ValueError(f"{flag}: expected comma-separated integers >= {lo}, got {text!r}")
    return vals


def check_common(args) -> None:
    """The flags both steps share, checked before any model or GPU work; raises ValueError naming the flag."""
    _int_list(args.batches, "--batches")
    if not 1 <= args.buffer_len <= 32:
        raise ValueError(f"--buffer-len: expected 1..32 (the kernels' rings), got {args.buffer_len}")
    for flag in ("reps", "prompt_len", "context"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: expected >= 1, got {v}")
    if getattr(args, "warmup", 0) < 0:
        raise ValueError(f"--warmup: expected >= 0, got {args.warmup}")
    if getattr(args, "fit_contexts", None) is not None:
        _int_list(args.fit_contexts, "--fit-contexts")
    dtypes = getattr(args, "tp_check_dtypes", None)
    names = None if dtypes is None else {d for d in dtypes.split(",") if d}
    if names is not None and (not names or not names <= {"float32", "bfloat16"}):
        raise ValueError(f"--tp-check-dtypes: expected float32 and/or bfloat16, got {dtypes!r}")
    for g in (getattr(args, "tp_geometries", None) or "").split(";"):
        if g and len(_int_list(g, "--tp-geometries")) != 4:
            raise ValueError(f"--tp-geometries: expected ';'-separated H,P,N,G, got {g!r}")


def main(argv=None) -> list[dict]:
    ap = parser()
    args = ap.parse_args(argv)
    mod = STEPS[args.step]
    try:
        check_common(args)
        mod.check_arguments(args)
    except ValueError as e:
        ap.error(f"{args.step}: {e}")
    if getattr(args, "tp", None) is not None:  # standard --tp N: one process per GPU, its own driver
        return e2e_standard.tp_main(args)
    return mod.run(args, Run(args, args.step))


if __name__ == "__main__":
    try:
        main()
    except GateError as e:
        sys.exit(f"ABORT: {e}")
