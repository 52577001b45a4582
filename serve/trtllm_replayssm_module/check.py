# SPDX-License-Identifier: Apache-2.0
"""Does TensorRT-LLM's Mamba2Mixer still decode through the attribute we hook? Checked at load time.

Both routes (:mod:`.model` registration, :mod:`.install` monkeypatch) replace one instance attribute,
``Mamba2Mixer.selective_state_update_func``. If the mixer's single-token decode calls a kernel any
other way, the replacement is never called and TensorRT-LLM's own kernel runs on the SSM state:
the answers stay right, ReplaySSM silently does nothing. Two checks turn that into an error:

1. Static, before any model is built (:func:`check_mixer_class`): parse the source of every method
   of the mixer class and require at least one call ``self.selective_state_update_func(...)`` and no
   direct call of a single-token decode kernel or op (:data:`BYPASS_CALLS`). The MTP / speculative
   verify kernels (:data:`MTP_ONLY_CALLS`) are allowed: the module refuses speculative decoding.
2. At run time, the first decode step (TensorRT-LLM's warm-up, before the server answers):
   a step with decode rows in which no Mamba-2 layer reached the adapter raises
   (:func:`bypass_message`, raised by :func:`.model.replay_step`).

History of the decode call (TensorRT-LLM's tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py; read,
not run, see :data:`VERIFIED_AGAINST`): before PR #10757 the decode called the module-level
``selective_state_update`` (e.g. 595da613); PR #10757 (merged; approved 2026-01-23) introduced the attribute
(FlashInfer's kernel or the native Triton one) and 02140fd4 still calls it in both the non-MTP and the
MTP branch. PR #18888 ("[TRTLLM-15936] Enable breakable prefill CUDA graphs (BCG) for Nemotron-H",
reviewed 2026-09-08, merged) wraps the mixer's forward in the custom op
``trtllm::mamba2_custom_op_inplace`` (its Python body calls ``mamba_layer.forward_core``; the op is a
piecewise-graph boundary, compilation/piecewise_optimizer.py 0c6a62a1) and adds a custom op
``trtllm::flashinfer_selective_state_update``. We could not read mamba2_mixer.py after that PR (the
stored copies predate it), so whether its decode still goes through the attribute is decided by
these checks on the installed source, not assumed.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
from typing import NamedTuple

HOOK_ATTR = "selective_state_update_func"

# Names of decode kernels / ops whose direct call in the mixer bypasses the attribute.
BYPASS_CALLS = frozenset({
    "selective_state_update",          # module-level call, before PR #10757
    "selective_state_update_fi",       # flashinfer.mamba.selective_state_update, as mamba2_mixer imports it
    "selective_state_update_native",   # the Triton kernel, as mamba2_mixer imports it
    "flashinfer_selective_state_update",   # torch.ops.trtllm.flashinfer_selective_state_update (PR #18888)
    "_flashinfer_selective_state_update_op",
})
# Kernels only the speculative-verify branch calls (02140fd4); ReplaySSM refuses that mode anyway.
MTP_ONLY_CALLS = frozenset({"replay_selective_state_update", "selective_state_update_mtp_ssm_cache_trtllm"})


class Verified(NamedTuple):
    what: str
    commit: str
    date: str
    verdict: str


VERIFIED_AGAINST = (
    Verified("mamba2_mixer.py", "02140fd4", "2026 (after PR #10757, approved 2026-01-23)",
             "supported: non-MTP decode calls self.selective_state_update_func(state, x, dt, A, B, C, D, ...)"),
    Verified("mamba2_mixer.py", "595da613", "2025 (before PR #10757)",
             "refused: decode calls the module-level selective_state_update"),
    Verified("mamba2_mixer.py", "after PR #18888", "2026-09",
             "not read: decided at load by the source and first-step checks"),
    Verified("modeling_nemotron_h.py", "00620eb0", "2026",
             "supported: NemotronHForCausalLM(model_config) registered for NemotronHForCausalLM; layers[i].mixer"),
    Verified("models/modeling_utils.py", "cb4c622c", "2025",
             "supported: register_auto_model fills MODEL_CLASS_MAPPING, last registration wins"),
    Verified("models/modeling_utils.py + _arch_index.py", "065ff9e9 (_arch_index.py)", "2026",
             "supported: external registrations overwrite built-ins and reach workers by module name"),
    Verified("commands/serve.py", "00209af1", "2026", "supported: imports --custom_module_dirs before the LLM"),
)


def verified_summary() -> str:
    """One line naming what this module was checked against (for error messages)."""
    return "TensorRT-LLM PyTorch backend, read from source (not run): " + "; ".join(
        f"{v.what} {v.commit} ({v.date}): {v.verdict}" for v in VERIFIED_AGAINST)


def tensorrt_llm_version() -> str:
    trt = sys.modules.get("tensorrt_llm")
    return str(getattr(trt, "__version__", "unknown")) if trt is not None else "not imported"


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def method_calls(mixer_cls):
    """(``Class.method:line``, call node) of every call in the methods ``mixer_cls`` defines or inherits (not
    ``nn.Module``'s). Raises OSError / TypeError / SyntaxError when a method's source cannot be read."""
    for klass in mixer_cls.__mro__:
        if klass is object or klass.__module__ in ("torch.nn.modules.module", "builtins"):
            continue
        for name, fn in vars(klass).items():
            fn = getattr(fn, "__func__", fn)
            if not inspect.isfunction(fn):
                continue
            src = textwrap.dedent(inspect.getsource(fn))
            first = fn.__code__.co_firstlineno
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.Call):
                    yield f"{klass.__name__}.{name}:{first + node.lineno - 1}", node


def decode_call_sites(mixer_cls) -> tuple[list[str], list[str]]:
    """(hook calls, bypass calls) in the methods of ``mixer_cls``, as ``method:line`` strings.

    Raises OSError / TypeError when the source cannot be read."""
    hooks, bypass = [], []
    for where, node in method_calls(mixer_cls):
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == HOOK_ATTR and isinstance(f.value, ast.Name)
                and f.value.id == "self"):
            hooks.append(where)
        elif _call_name(node) in BYPASS_CALLS:
            bypass.append(f"{where} {_call_name(node)}(...)")
    return hooks, bypass


def bypass_message(mixer_cls, what: str) -> str:
    return (f"trtllm_replayssm_module: TensorRT-LLM {tensorrt_llm_version()}: "
            f"{mixer_cls.__module__}.{mixer_cls.__qualname__} {what}. Both routes of this module replace "
            f"the mixer's {HOOK_ATTR}; with this TensorRT-LLM the Mamba-2 decode would run TensorRT-LLM's own "
            f"kernel and ReplaySSM would silently not run, so loading stops here. Use a TensorRT-LLM whose "
            f"Mamba2Mixer single-token decode calls self.{HOOK_ATTR}(...), or serve without "
            f"--custom_module_dirs. Verified against: {verified_summary()}")


def check_mixer_class(mixer_cls) -> list[str]:
    """Raise RuntimeError unless ``mixer_cls``'s decode goes through ``self.selective_state_update_func``.

    Returns the hook call sites. ``TRTLLM_REPLAYSSM_SKIP_SOURCE_CHECK=1`` skips the source reading (for
    installs without .py files); the first-decode-step check still applies."""
    if os.environ.get("TRTLLM_REPLAYSSM_SKIP_SOURCE_CHECK") == "1":
        return []
    try:
        hooks, bypass = decode_call_sites(mixer_cls)
    except (OSError, TypeError, SyntaxError) as e:
        raise RuntimeError(bypass_message(mixer_cls, f"has no readable source ({e}); cannot confirm its decode "
                                          "calls the hooked attribute (set TRTLLM_REPLAYSSM_SKIP_SOURCE_CHECK=1 "
                                          "to rely on the first-decode-step check alone)")) from e
    if bypass:
        raise RuntimeError(bypass_message(mixer_cls, f"calls a decode kernel directly at {', '.join(bypass)} "
                                          f"(not through self.{HOOK_ATTR})"))
    if not hooks:
        raise RuntimeError(bypass_message(mixer_cls, f"never calls self.{HOOK_ATTR}(...) (the Mamba-2 decode moved "
                                          "elsewhere, e.g. into a custom op)"))
    return hooks
