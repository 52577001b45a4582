# SPDX-License-Identifier: Apache-2.0
"""Build a ReplaySSM engine directory: the ONNX export of one decode (or speculative) step, the plugin PTX,
``config.json``, ``trtexec.sh`` and, where TensorRT can build here, the plan(s). What the directory holds
is the format of :mod:`builders.engine_format`; ``scripts/build_engine.py`` is the command line over
:func:`build`.

Route: the model kind of :attr:`BuildOptions.model` (a checkpoint directory, by its config.json ``model_type``) or of
the embedded tiny config :attr:`BuildOptions.tiny` (seeded random weights; ``nemotron_h`` by default), from the
registry of :mod:`builders.models`, which is all this module knows of a model: load it with the kind's checked
loader; refuse what its engine cannot take (:func:`check_kind`: a shadow its SSM family does not keep, a checkpoint
dtype or a speculative step its plugins lack); build its export step of T = 1 + ``num_draft`` tokens (MoE layers as
standard ONNX ops, ``moe_formulation``, builders/moe.py) and check the geometry its plugin kernels take; export it
through the one export (``decode_step.export_onnx``) with one plugin node per SSM layer: model.onnx, or with
``num_draft`` the verify graph and builders/spec_step.py's commit graph (:func:`_step_artifacts`, the one path of
both formats); compile the plugin kernels to PTX with NVRTC (no GPU needed); describe every input, output and state
tensor in config.json (checked against the format's state table before it is written); and build the plan(s) where
TensorRT >= 10.9, a GPU and the plugin registration are available (:func:`tensorrt_status`, :func:`build_plan`);
otherwise the trtexec command(s) that finish the build elsewhere (:func:`trtexec_command`) are in trtexec.sh, which
the log names.

The directory is written to a temporary sibling and renamed to ``out`` at the end (``overwrite``: swapped
with the old one), so an interrupted build leaves no half-written engine.

TensorRT's Python plugins are registered by the building process (``trt_plugin.register()``, which
:func:`tensorrt_status` calls). trtexec cannot register them, so its commands only work from a process
that can, or to run the built plans (AOT plugins need no Python at run time: ``trtexec --loadEngine=...``).

API: :class:`BuildOptions` (the fields of the script's flags, same defaults), :func:`check_options`
(raises :class:`BuildError` naming the flag), :func:`check_kind` (the same for the model kind's engine),
:func:`build` (returns ``out``; raises :class:`BuildError` or ``builders.nemotron_h.CheckpointError``), and the
pieces: :func:`trtexec_command`, :func:`build_plan`, :func:`tensorrt_status`, :func:`model_entry` (config.json's
``model``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time

import torch

from trtllm_replayssm import trt_plugin
from trtllm_replayssm.compile import CompileError
from trtllm_replayssm.config import SUPPORTED_BUFFER_LEN, SUPPORTED_NUM_TOKENS

from . import models
from .engine_format import DECODE_FORMAT, SHADOWS, SPEC_FORMAT, FormatError, check_layer_states, staging_dir
from .moe import FORMULATIONS as MOE_FORMULATIONS

TINY_NAMES = models.tiny_names(export=True)  # --tiny: the embedded tiny configs of the kinds with an engine export
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIN_TRT = (10, 9)
SUPPORTED_ARCHS = (90, 100)  # the SM targets every kernel is compiled for in CI (tests/test_*compile.py)


class BuildError(RuntimeError):
    """The options, the model or the toolchain cannot give this engine; the message names the flag or key."""


def log(msg: str) -> None:
    """Progress on stdout, under the script's name (the build's output is the script's output)."""
    print(f"[build_engine] {msg}", flush=True)


@dataclasses.dataclass
class BuildOptions:
    """What to build; the fields of scripts/build_engine.py's flags (``--max-batch`` is ``max_batch``), with its
    defaults. ``model``: HF directory (config.json + *.safetensors), else the embedded tiny config ``tiny``
    (:data:`builders.models.DEFAULT_TINY` when None); ``dtype``: activations / weights of the engine,
    ``state_dtype``: the checkpoint state (keys of :data:`DTYPES`); ``arch``: SM of the PTX
    (:data:`SUPPORTED_ARCHS`); ``sm_count``: SMs of the target GPU (persistent-kernel grid); ``num_draft`` > 0: the
    speculative verify + commit pair; ``shadow`` "bf16" / "fp8": a shadow of the fp32 checkpoint per SSM layer
    (those the kind's family keeps: :attr:`builders.models.ModelKind.shadows`); ``row_order``: one
    ``replayssm::flush_order`` node a step feeding every decode node its rows, flushing rows first
    (:meth:`builders.decode_step.StepIO.set_row_order`)."""

    out: pathlib.Path
    model: pathlib.Path | None = None
    tiny: str | None = None
    moe_formulation: str = "dense"
    max_batch: int = 8
    buffer_len: int = 16
    state_dtype: str = "fp32"
    dtype: str = "fp32"
    arch: int = 90
    sm_count: int = 132
    max_seq_len: int = 4096
    seed: int = 0
    num_draft: int = 0
    shadow: str = "none"
    row_order: bool = False
    overwrite: bool = False


def check_options(opts: BuildOptions) -> None:
    """Raise :class:`BuildError` naming the first flag whose value cannot be built (the model itself is
    checked when it is loaded)."""
    for flag, value, known in (("--tiny", opts.tiny, (None,) + TINY_NAMES), ("--moe-formulation", opts.moe_formulation,
                               MOE_FORMULATIONS), ("--state-dtype", opts.state_dtype, tuple(DTYPES)),
                               ("--dtype", opts.dtype, tuple(DTYPES)), ("--arch", opts.arch, SUPPORTED_ARCHS)):
        if value not in known:  # the script's argparse choices; here for callers of the API
            raise BuildError(f"{flag}: expected one of {[k for k in known if k is not None]}, got {value!r}")
    if opts.max_batch < 1:
        raise BuildError(f"--max-batch: expected >= 1, got {opts.max_batch}")
    if opts.buffer_len not in SUPPORTED_BUFFER_LEN:
        raise BuildError(f"--buffer-len: expected one of {SUPPORTED_BUFFER_LEN}, got {opts.buffer_len}")
    if opts.num_draft:
        drafts = sorted(t - 1 for t in SUPPORTED_NUM_TOKENS if t > 1)
        if opts.num_draft + 1 not in SUPPORTED_NUM_TOKENS:
            raise BuildError(f"--num-draft: expected 0 (standard decode) or one of {drafts}, got {opts.num_draft}")
        if opts.buffer_len < 2 * (opts.num_draft + 1):
            raise BuildError(f"--buffer-len: speculative decoding needs >= 2 (num_draft + 1) = {2 * (opts.num_draft + 1)} "
                             f"(flush one window early), got {opts.buffer_len}")
    if opts.shadow not in SHADOWS:
        raise BuildError(f"--shadow: expected one of {list(SHADOWS)}, got {opts.shadow!r}")
    if opts.shadow != "none" and opts.state_dtype != "fp32":
        raise BuildError(f"--shadow {opts.shadow}: a checkpoint shadow is of an fp32 checkpoint (--state-dtype "
                         f"fp32), got --state-dtype {opts.state_dtype}")
    if opts.sm_count < 1:
        raise BuildError(f"--sm-count: expected >= 1, got {opts.sm_count}")
    if opts.max_seq_len < 1:
        raise BuildError(f"--max-seq-len: expected >= 1, got {opts.max_seq_len}")
    if opts.model is not None and opts.tiny is not None:
        raise BuildError(f"--tiny: the embedded tiny configs are used only without --model, got --tiny {opts.tiny} "
                         f"with --model")
    if opts.model is not None and not opts.model.is_dir():
        raise BuildError(f"--model: expected an existing directory, got {str(opts.model)!r}")
    if opts.model is not None:  # --overwrite would swap the engine in for the checkpoint and delete it
        model, out = opts.model.resolve(), opts.out.resolve()
        if out == model or out in model.parents:
            raise BuildError(f"--out: expected a directory that does not hold --model {str(opts.model)!r} (--overwrite "
                             f"would delete the checkpoint), got {str(opts.out)!r}")
    if opts.out.exists() and not opts.overwrite:
        raise BuildError(f"--out: {str(opts.out)!r} already exists (choose another directory or pass --overwrite)")


def _decode_config(opts, model: dict, sio: dict, plugin: dict) -> dict:
    """config.json of a standard decode engine directory (either family): the fields in the format's order."""
    cfg = dict(format=DECODE_FORMAT, model=model, max_batch=opts.max_batch, max_seq_len=opts.max_seq_len,
               buffer_len=opts.buffer_len, act_dtype=opts.dtype, state_dtype=opts.state_dtype, arch=opts.arch)
    if opts.shadow != "none":  # absent: none (directories written before the option read the same)
        cfg["shadow"] = opts.shadow
    return dict(cfg, inputs=sio["inputs"], outputs=sio["outputs"], states=sio["states"], plugin=plugin, plan=None,
                trtexec=sio["trtexec"])


def shape_arg(specs, batch: int) -> str:
    return ",".join(f"{name}:" + "x".join(str(batch if d == -1 else d) for d in shape) for name, shape in specs)


def trtexec_command(io_shapes, max_batch: int) -> str:
    opt = max(1, max_batch // 2)
    return (
        "trtexec --onnx=model.onnx --saveEngine=model.plan --stronglyTyped"
        f" --minShapes={shape_arg(io_shapes, 1)} --optShapes={shape_arg(io_shapes, opt)}"
        f" --maxShapes={shape_arg(io_shapes, max_batch)}"
    )


def tensorrt_status() -> tuple[object | None, str]:
    """(tensorrt module or None, why not)."""
    try:
        import tensorrt as trt
    except ImportError:
        return None, "tensorrt is not installed"
    version = tuple(int(v) for v in trt.__version__.split(".")[:2])
    if version < MIN_TRT:
        return None, f"tensorrt {trt.__version__} is installed, {MIN_TRT[0]}.{MIN_TRT[1]} or newer is needed"
    if not torch.cuda.is_available():
        return None, "no CUDA GPU is visible"
    trt_plugin.register()
    return trt, ""


def build_plan(trt, onnx_path: pathlib.Path, plan_path: pathlib.Path, io_shapes, max_batch: int) -> None:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errs = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {onnx_path}:\n{errs}")
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    profile = builder.create_optimization_profile()
    opt = max(1, max_batch // 2)
    for name, shape in io_shapes:
        profile.set_shape(name, *([b if d == -1 else d for d in shape] for b in (1, opt, max_batch)))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError("TensorRT failed to build the engine (see the log above)")
    plan_path.write_bytes(bytes(plan))


def _kernel_entry(k, tactic) -> dict:
    return dict(tactic=tactic, ptx=f"{k.spec.key}.ptx", spec=k.spec.key, kernel=k.kernel_name,
                grid=[k.grid_x, "batch" if k.grid_y_is_batch else 1, 1] if not k.rows_per_block
                else [f"ceil(batch / {k.rows_per_block})", 1, 1],
                block=[k.block_x, 1, 1], shared_mem=k.shared_mem, extra_int32_args=list(k.extra_args))


def _write_ptx(tmp: pathlib.Path, make, what: str):
    try:
        k = make()
    except CompileError as e:
        raise BuildError(f"plugin PTX ({what}) did not compile:\n{str(e).rstrip(chr(0))}") from e
    (tmp / f"{k.spec.key}.ptx").write_bytes(k.ptx)
    return k


TRTEXEC_NOTE = ("# TensorRT >= 10.9 with {plugins} registered in the building process\n"
                "# (trtllm_replayssm.trt_plugin.register(); scripts/build_engine.py does it where TensorRT is installed).\n"
                "# trtexec cannot register Python plugins itself; the built AOT plans run without Python\n"
                "# (trtexec --loadEngine=...).\n")


def _step_io(step, opts, tmp, vocab: int, plugins: str) -> dict:
    """A decode step's engine I/O for config.json (inputs, outputs, states) and its trtexec command (also
    written to trtexec.sh): input_ids, lengths and the shared cursor, then the step's state tensors."""
    io = [("input_ids", (-1, 1), "int64"), ("lengths", (-1,), "int32"), ("cursor", (-1,), "int32")]
    states = [dict(name="lengths", shape=[-1], dtype="int32", output="lengths_out"),
              dict(name="cursor", shape=[-1], dtype="int32", output="cursor_out")]
    states += [st.to_json() for st in step.state_specs()]
    io_shapes = [(n, sh) for n, sh, _ in io] + [(st["name"], tuple(st["shape"])) for st in states[2:]]
    cmd = trtexec_command(io_shapes, opts.max_batch)
    (tmp / "trtexec.sh").write_text("#!/bin/sh\n" + TRTEXEC_NOTE.format(plugins=plugins) + cmd + "\n")
    return dict(inputs=[dict(name=n, shape=list(sh), dtype=d) for n, sh, d in io] + [
                    dict(name=st["name"], shape=st["shape"], dtype=st["dtype"]) for st in states[2:]],
                outputs=[dict(name="logits", shape=[-1, vocab], dtype="float32")] + [
                    dict(name=st["output"], shape=st["shape"], dtype=st["dtype"]) for st in states],
                states=states, io_shapes=io_shapes, trtexec=cmd)


def _step_artifacts(opts, step, entry: dict, tmp):
    """The one path of every engine directory: the kind's export step of T = 1 + num_draft tokens (``step``,
    :meth:`builders.models.ModelKind.export`), written by the one export (``decode_step.export_onnx``: model.onnx at
    T = 1; verify.onnx and the commit graph's commit.onnx at T > 1), the SSM node's PTX per tactic
    (``step.plugin_kernel``), then config.json's content (``entry``: its ``model``) and the trtexec command(s) in the
    format of the step's T (:func:`_decode_config`; :func:`_spec_graphs`, which adds the spec_commit PTX). Returns
    (config, [(onnx file, plan file, io shapes)])."""
    from .decode_step import DOMAIN, export_onnx

    nodes = len(step.ssm_layers())
    op_type, T, spec = step.op_type, step.num_tokens, step.speculative
    if spec:
        from .spec_step import COMMIT_OP_TYPE

        log(f"[2/5] exporting verify.onnx ({nodes} {DOMAIN}::{op_type} nodes, T = {T}) and commit.onnx "
            f"(one {DOMAIN}::{COMMIT_OP_TYPE} node)")
        export_onnx(step, tmp / "verify.onnx", tmp / "commit.onnx")
    else:
        log(f"[2/5] exporting model.onnx (TorchScript exporter, opset 17, {nodes} {DOMAIN}::{op_type} nodes)")
        export_onnx(step, tmp / "model.onnx")

    kernels = []
    for tactic in sorted(trt_plugin.TACTICS):
        what = f"{op_type}, tactic {tactic}" if spec else f"tactic {tactic}"
        k = _write_ptx(tmp, lambda t=tactic: step.plugin_kernel(t, opts.arch, opts.sm_count), what)
        log(f"[3/5] plugin PTX{' ' if spec else ', '}{what}: {k.spec.key} (NVRTC)")
        kernels.append(_kernel_entry(k, tactic))
    plugin = dict(op_type=op_type, nodes=nodes, attributes=step.plugin_attributes(), kernels=kernels)
    vocab = step.model.config.get_text_config().vocab_size
    if spec:
        return _spec_graphs(opts, step, tmp, plugin, entry, vocab)

    log("[4/5] writing config.json and trtexec.sh")
    order = {}
    if step.row_order:  # one flush_order node a step; the decode nodes read its (batch, 4) output as their rows
        k = _write_ptx(tmp, lambda: trt_plugin.aot_order_kernel(opts.buffer_len, opts.arch), "flush_order")
        log(f"[3/5] plugin PTX, {trt_plugin.ORDER_PLUGIN_NAME}: {k.spec.key} (NVRTC)")
        order = dict(row_order=dict(trt_plugin.PLUGINS[trt_plugin.ORDER_PLUGIN_NAME].manifest(),
                                    op_type=trt_plugin.ORDER_PLUGIN_NAME, nodes=1, buffer_len=opts.buffer_len,
                                    kernels=[_kernel_entry(k, 1)]))
    plugins = f"{DOMAIN}::{op_type}" + (f" and {DOMAIN}::{trt_plugin.ORDER_PLUGIN_NAME}" if order else "")
    sio = _step_io(step, opts, tmp, vocab, plugins)
    info = trt_plugin.all_plugins()[op_type]
    config = _decode_config(opts, entry, sio, dict(
        op_type=op_type, domain=DOMAIN, plugin_namespace=DOMAIN, aot=1, nodes=nodes, **plugin["attributes"],
        **step.plugin_keys(opts.sm_count), kernels=kernels, inputs=list(info.inputs), outputs=list(info.outputs),
        aliased_outputs=info.manifest()["aliased_outputs"], **order))
    return config, [("model.onnx", "model.plan", sio["io_shapes"])]


def _spec_graphs(opts, step, tmp, verify: dict, model: dict, vocab: int):
    """The rest of a speculative engine directory after :func:`_step_artifacts` wrote verify.onnx, commit.onnx and
    the verify PTX (``verify``: the SSM node's op_type, node count, attributes and kernels): the spec_commit PTX,
    config.json's content and the trtexec commands."""
    from .decode_step import DOMAIN
    from .spec_step import COMMIT_OP_TYPE, NemotronHSpecCommit

    T = step.num_tokens
    VERIFY_OP_TYPE = verify["op_type"]
    commit = NemotronHSpecCommit(step)
    k = _write_ptx(tmp, lambda: trt_plugin.aot_commit_kernel(T, opts.buffer_len, opts.arch), COMMIT_OP_TYPE)
    log(f"[3/5] plugin PTX {COMMIT_OP_TYPE}: {k.spec.key} (NVRTC)")
    commit_kernels = [_kernel_entry(k, trt_plugin.COMMIT_TACTICS[0])]

    log("[4/5] writing config.json and trtexec.sh")
    specs = step.state_specs()
    windows = {s.name for s in commit.state_specs()}
    states = [dict(name="cursor", shape=[-1, 2], dtype="int32", updated_by={"commit": "cursor_out"}),
              dict(name="lengths", shape=[-1], dtype="int32", updated_by={"commit": "lengths_out"})]
    for s in specs:
        j = s.to_json()
        upd = {"verify": j.pop("output")}
        if s.name in windows:
            upd["commit"] = s.output
        states.append({**j, "updated_by": upd})
    by_name = {s["name"]: s for s in states}
    verify_io = [("input_ids", (-1, T), "int64"), ("lengths", (-1,), "int32"), ("cursor", (-1, 2), "int32")]
    verify_io += [(s.name, s.shape, by_name[s.name]["dtype"]) for s in specs]
    commit_io = [("n_accepted", (-1,), "int32"), ("cursor", (-1, 2), "int32"), ("lengths", (-1,), "int32")]
    commit_io += [(n, tuple(by_name[n]["shape"]), by_name[n]["dtype"]) for n in commit.input_names()[3:]]
    graphs = {}
    cmds = []
    for name, io, module, out_first in (
            ("verify", verify_io, step, [dict(name="logits", shape=[-1, T, vocab], dtype="float32")]),
            ("commit", commit_io, commit, [])):
        shapes = [(n, tuple(sh)) for n, sh, _ in io]
        cmd = trtexec_command(shapes, opts.max_batch).replace("model.onnx", f"{name}.onnx").replace(
            "model.plan", f"{name}.plan")
        cmds.append(cmd)
        outs = out_first + [dict(name=s["updated_by"][name], shape=s["shape"], dtype=s["dtype"]) for s in states
                            if name in s["updated_by"]]
        assert [o["name"] for o in outs] == module.output_names()
        assert [n for n, _, _ in io] == module.input_names()
        graphs[name] = dict(onnx=f"{name}.onnx", plan=None, inputs=[dict(name=n, shape=list(sh), dtype=d)
                                                                    for n, sh, d in io],
                            outputs=outs, trtexec=cmd)
    plugins = [VERIFY_OP_TYPE, COMMIT_OP_TYPE]
    (tmp / "trtexec.sh").write_text(
        "#!/bin/sh\n" + TRTEXEC_NOTE.format(plugins=" and ".join(f"{DOMAIN}::{p}" for p in plugins))
        + "set -e\n" + "\n".join(cmds) + "\n")
    verify_manifest = trt_plugin.all_plugins()[VERIFY_OP_TYPE].manifest()
    commit_manifest = trt_plugin.all_plugins()[trt_plugin.COMMIT_PLUGIN_NAME].manifest()
    config = dict(
        format=SPEC_FORMAT,
        model=model,
        max_batch=opts.max_batch, max_seq_len=opts.max_seq_len, buffer_len=opts.buffer_len,
        num_draft=opts.num_draft, num_tokens=T, conv_window=step.window,
        act_dtype=opts.dtype, state_dtype=opts.state_dtype, arch=opts.arch,
        **({"shadow": opts.shadow} if opts.shadow != "none" else {}),
        graphs=graphs,
        states=states,
        step=["verify", "sample n_accepted (batch,) int32 in 1..T from the logits", "commit"],
        plugin=dict(domain=DOMAIN, plugin_namespace=DOMAIN, aot=1, plugins=[
            dict(verify_manifest, op_type=VERIFY_OP_TYPE, graph="verify", nodes=verify["nodes"],
                 attributes=verify["attributes"], kernels=verify["kernels"]),
            dict(commit_manifest, op_type=COMMIT_OP_TYPE, graph="commit", nodes=1,
                 attributes=dict(num_tokens=T, buffer_len=opts.buffer_len), kernels=commit_kernels)]),
        trtexec=cmds,
    )
    return config, [(f"{n}.onnx", f"{n}.plan", [(i, tuple(sh)) for i, sh, _ in (verify_io if n == "verify" else commit_io)])
                    for n in ("verify", "commit")]


def check_kind(kind, opts: BuildOptions) -> None:
    """Raise :class:`BuildError` naming the flag whose value the model kind's engine cannot take (its data:
    :class:`builders.models.ModelKind`): no export, a shadow its family does not keep, a checkpoint dtype or a
    speculative step its plugins do not have."""
    if not kind.export_step:
        raise BuildError(f"{'--model' if opts.model else '--tiny'}: {kind.title} models have no engine export (the "
                         f"streaming Triton model serves them: scripts/make_triton_repo.py --backend python)")
    why = kind.shadow_refusal(opts.shadow)
    if why:
        raise BuildError(f"--shadow {opts.shadow}: {why}")
    if opts.state_dtype not in kind.state_dtypes:
        raise BuildError(f"--state-dtype: {kind.ssm} checkpoints are {' / '.join(kind.state_dtypes)} in the engines "
                         f"(their plugins' checkpoint), got {opts.state_dtype}")
    if opts.num_draft and not kind.speculative:
        raise BuildError(f"--num-draft: {kind.ssm} engines ({kind.title}) are standard decode only (their export has "
                         f"no speculative verify graph yet), got {opts.num_draft}")


def model_entry(opts, tiny, step) -> dict:
    """config.json's ``model``: the source (checkpoint directory or embedded tiny config), the tiny model's seed, the
    model type, then the step's entry (pattern, sizes, the layers by type, the MoE configuration)."""
    return dict(source=str(opts.model) if opts.model else f"embedded-tiny-{tiny}",
                seed=None if opts.model else opts.seed, model_type=step.config.model_type, **step.model_entry())


def build(opts: BuildOptions) -> pathlib.Path:
    """Write the engine directory ``opts.out`` (module docstring); returns it."""
    check_options(opts)
    t0 = time.time()
    try:
        kind, tiny = models.for_source(opts.model, opts.tiny)
    except ValueError as e:  # an unknown --tiny (the API's; the script's argparse choices refuse it first)
        raise BuildError(str(e)) from None
    source = f"model from {opts.model}" if opts.model else f"embedded tiny {tiny} (seed {opts.seed})"
    log(f"[1/5] loading {source}")
    check_kind(kind, opts)
    model = kind.load(opts.model, tiny, dtype=DTYPES[opts.dtype], seed=opts.seed)
    try:  # the step of T = 1 + num_draft tokens, and the geometry its plugin kernels take (named by config key)
        step = kind.export(model, buffer_len=opts.buffer_len, max_seq_len=opts.max_seq_len,
                           state_dtype=DTYPES[opts.state_dtype], moe_formulation=opts.moe_formulation,
                           shadow=opts.shadow, num_draft=opts.num_draft)
        step.set_row_order(opts.row_order)
        step.plugin_geometry()
    except ValueError as e:
        raise BuildError(str(e)) from e
    for line in step.describe():
        log(f"      {line}")
    entry = model_entry(opts, tiny, step)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(opts.out.parent, f".{opts.out.name}.tmp-")
    try:
        config, plans = _step_artifacts(opts, step, entry, tmp)
        try:  # the states written are those the readers of the format expect (builders/engine_format.py)
            check_layer_states(config)
        except FormatError as e:
            raise BuildError(f"config.json: {e}") from e
        trt, why = tensorrt_status()
        if trt is not None:
            for onnx_name, plan_name, io_shapes in plans:
                log(f"[5/5] building {plan_name} with TensorRT {trt.__version__}")
                build_plan(trt, tmp / onnx_name, tmp / plan_name, io_shapes, opts.max_batch)
                if opts.num_draft:
                    config["graphs"][plan_name.split(".")[0]]["plan"] = plan_name
                else:
                    config["plan"] = plan_name
        else:
            names = " and ".join(p for _, p, _ in plans)
            cmds = "the trtexec command is" if isinstance(config["trtexec"], str) else "the two trtexec commands are"
            log(f"[5/5] {names} not built: {why}. TensorRT >= {MIN_TRT[0]}.{MIN_TRT[1]} with a GPU is needed "
                "for the plan. Finish there by rerunning this script (it registers the plugins through "
                f"trtllm_replayssm.trt_plugin), or in --out, with the plugins registered: {cmds} in "
                f"{opts.out / 'trtexec.sh'}")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

        if opts.out.exists():  # --overwrite: swap, then drop the old directory
            old = pathlib.Path(tempfile.mkdtemp(dir=opts.out.parent, prefix=f".{opts.out.name}.old-"))
            os.replace(opts.out, old / "x")
            os.replace(tmp, opts.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, opts.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"done in {time.time() - t0:.1f} s: {opts.out}")
    return opts.out
