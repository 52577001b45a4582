# SPDX-License-Identifier: Apache-2.0
"""Builders: patch model definitions for ReplaySSM decode and export the decode step.

* :mod:`.nemotron_h` loads transformers' Nemotron-H (an HF directory or an embedded tiny config)
  and patches its Mamba-2 mixers so single-token decode runs through ReplaySSM.
* :mod:`.decode_step` is the export form: one step of T = 1 + num_draft tokens per row as a module with
  explicit state I/O (:class:`~.decode_step.NemotronHDecodeStep`; :mod:`.qwen_export`'s
  :class:`~.qwen_export.QwenGDNDecodeStep` for Qwen3-Next / Qwen3.5). num_draft = 0 (T = 1) is the standard
  decode step, one ``replayssm::mamba2_decode`` node per Mamba layer; num_draft > 0 is the speculative verify
  graph, one ``replayssm::mamba2_verify`` node per Mamba layer. Its :func:`~.decode_step.export_onnx`
  (``export_onnx(step, path, commit_path=None)``) is the one ONNX export of every step: model.onnx, or
  verify.onnx + commit.onnx.
* :mod:`.spec_step` holds only the speculative commit graph: one ``replayssm::spec_commit`` node (cursor,
  lengths, conv-window rollback) run after sampling, for either family.
* :mod:`.engine_format` is the engine-directory format (files, config.json, the per-layer state table the
  steps build their state I/O from); :mod:`.engine` builds such a directory (ONNX, PTX, config.json,
  trtexec.sh, TensorRT plan); :mod:`.triton_repo` writes Triton model repositories from it (or a
  Python-backend model). scripts/build_engine.py and scripts/make_triton_repo.py are their command lines.

Builders contain no kernel code (STYLE.md): the SSM step is a pluggable backend with the signature
of :func:`trtllm_replayssm.families.mamba2.reference.replay_decode`, called with keyword arguments.
"""
