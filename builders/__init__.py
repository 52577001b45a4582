# SPDX-License-Identifier: Apache-2.0
"""Builders: patch model definitions for ReplaySSM decode and export the decode step.

* :mod:`.nemotron_h` loads transformers' Nemotron-H (an HF directory or an embedded tiny config)
  and patches its Mamba-2 mixers so single-token decode runs through ReplaySSM.
* :mod:`.decode_step` is the export form: one decode step as a module with explicit state I/O,
  exported to ONNX with one ``replayssm::mamba2_decode`` node per Mamba layer.
* :mod:`.spec_step` is the speculative form: a verify graph of T = 1 + num_draft tokens with one
  ``replayssm::mamba2_verify`` node per Mamba layer, and a commit graph with one
  ``replayssm::spec_commit`` node (cursor, lengths, conv-window rollback) run after sampling.
* :mod:`.engine_format` is the engine-directory format (files, config.json, the per-layer state table the
  steps build their state I/O from); :mod:`.engine` builds such a directory (ONNX, PTX, config.json,
  trtexec command, TensorRT plan); :mod:`.triton_repo` writes Triton model repositories from it (or a
  Python-backend model). scripts/build_engine.py and scripts/make_triton_repo.py are their command lines.

Builders contain no kernel code (STYLE.md): the SSM step is a pluggable backend with the signature
of :func:`trtllm_replayssm.reference.replay_decode`, called with keyword arguments.
"""
