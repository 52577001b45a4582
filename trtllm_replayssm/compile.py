# SPDX-License-Identifier: Apache-2.0
"""NVRTC compilation of the kernels in ``plugins/`` for one kernel spec.

Route: a generated prelude (``using`` dtypes, sizes as ``constexpr``) is prepended to the spec's entry file and
compiled by NVRTC through ``cuda.bindings.nvrtc``. That needs no GPU and no driver, so CI compiles every variant
for sm_90 and sm_100. Headers come from the ``nvidia-cuda-runtime`` wheel (``cuda_bf16.h`` is not built into
NVRTC). Results are cached on disk under the spec's readable key plus a hash of source, options and NVRTC version.
Loading and launching (``cuda.core``) live in the launchers (every family's ``ops``, and :mod:`.cursor_ops`).

Kernel sources: ``plugins/common/`` (conversions, warp scans: every family) and ``plugins/<family>/``
(``mamba2/``, ``gdn/``, ...); the include path is ``plugins/``, so a family header includes
``"common/scan.cuh"`` and its own files by their plain names. A spec names its module through three members:
``entry_file`` (path under ``plugins/``), ``kernel_names`` (the module's entry points) and ``prelude()`` (the
generated lines). :class:`~.config.KernelSpec` (Mamba-2: ``mamba2/replayssm_decode.cu``, speculative specs
``mamba2/replayssm_spec.cu`` with ``constexpr int kT``) and :class:`~.families.gdn.config.GDNSpec` (Gated DeltaNet:
``gdn/gdn_decode.cu``, ``gdn/gdn_spec.cu``) get theirs below; a family folder's spec type declares its own and is
listed in its :class:`~.families.Family` (``spec_types``), which is also how :func:`spec_from_json` finds it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import tempfile

from .config import (  # noqa: F401  (the module names re-exported: tests and scripts read them here)
    ENTRY_FILE,  # noqa: F401
    KERNEL_NAMES,
    SPEC_ENTRY_FILE,
    SPEC_KERNEL_NAMES,
    KernelSpec,
    Layout,
    Variant,
)

PLUGIN_DIR = pathlib.Path(__file__).resolve().parent.parent / "plugins"
if not PLUGIN_DIR.is_dir():  # installed as a wheel: the kernels ship inside the package
    PLUGIN_DIR = pathlib.Path(__file__).resolve().parent / "plugins"
# Another kernel source tree (an A/B benchmark of two versions on one warm card: one process per tree). The cache
# key hashes the sources, so the two trees never share a cache entry.
if os.environ.get("TRTLLM_REPLAYSSM_PLUGIN_DIR"):
    PLUGIN_DIR = pathlib.Path(os.environ["TRTLLM_REPLAYSSM_PLUGIN_DIR"]).resolve()
    if not any(PLUGIN_DIR.rglob("replayssm.cuh")):
        raise RuntimeError(f"TRTLLM_REPLAYSSM_PLUGIN_DIR: {PLUGIN_DIR} is not a directory of kernel sources")


def entry_file(spec) -> str:
    """The spec's entry file (its ``entry_file``), a path under ``plugins/``. A kernel tree of the flat layout (before
    the family folders; ``TRTLLM_REPLAYSSM_PLUGIN_DIR`` naming an old checkout for an A/B run) has it at its base
    name."""
    rel = spec.entry_file
    if not (PLUGIN_DIR / rel).is_file() and (PLUGIN_DIR / pathlib.PurePath(rel).name).is_file():
        return pathlib.PurePath(rel).name
    return rel


def kernel_names(spec) -> tuple[str, ...]:
    """The entry points of the module ``spec`` compiles (its ``kernel_names``)."""
    return tuple(spec.kernel_names)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries the spec key and the compiler log."""


def cache_dir() -> pathlib.Path:
    root = os.environ.get("TRTLLM_REPLAYSSM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trtllm_replayssm"
    )
    path = pathlib.Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def prelude(spec) -> str:
    """The generated lines before the entry file: the spec's own (``spec.prelude()``)."""
    return spec.prelude()


def source(spec) -> str:
    return prelude(spec) + f'#include "{entry_file(spec)}"\n'


@functools.lru_cache(maxsize=1)
def _include_dirs() -> tuple[str, ...]:
    import cuda.pathfinder

    cudart = cuda.pathfinder.find_nvidia_header_directory("cudart")
    if cudart is None:
        raise CompileError("CUDA runtime headers not found: install the 'nvidia-cuda-runtime' wheel")
    return (str(PLUGIN_DIR), cudart)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


def driver_version() -> tuple[int, int] | None:
    """CUDA version the installed driver supports, or None where there is no driver (CI)."""
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
    except Exception:  # no libcuda on this machine
        return None
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    return v // 1000, (v % 1000) // 10


def check_ptx_loadable() -> None:
    """PTX is JIT-compiled by the driver, which rejects a PTX ISA newer than itself (NVRTC 13.5
    emits ISA 9.5, a CUDA 13.0 driver reads up to 9.0). Cubins are not affected."""
    drv, rtc = driver_version(), nvrtc_version()
    if drv is not None and rtc > drv:
        raise CompileError(
            f"NVRTC {rtc[0]}.{rtc[1]} emits PTX that this driver (CUDA {drv[0]}.{drv[1]}) cannot load; "
            f"install a matching NVRTC: pip install 'nvidia-cuda-nvrtc=={drv[0]}.{drv[1]}.*'")


def _check(err, what: str, log: str = "") -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed ({err!r})" + (f"\n{log}" if log else ""))


def options(spec, target: str) -> list[str]:
    if target not in ("ptx", "cubin"):
        raise ValueError(f"target: expected 'ptx' or 'cubin', got {target!r}")
    arch = f"compute_{spec.arch}" if target == "ptx" else f"sm_{spec.arch}"
    opts = [f"--gpu-architecture={arch}", "-std=c++17"]
    if os.environ.get("TRTLLM_REPLAYSSM_LINEINFO") == "1":  # source lines in the sanitizers' and profilers' reports
        opts.append("-lineinfo")
    opts += [f"--include-path={d}" for d in _include_dirs()]
    return opts


def _plugin_sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(PLUGIN_DIR.rglob("*.cu*")):
        h.update(path.relative_to(PLUGIN_DIR).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _header_dirs_signature() -> str:
    """Name, size and mtime of every file under the CUDA header directories (``cuda_bf16.h`` and the headers
    it pulls in): an upgraded ``nvidia-cuda-runtime`` wheel changes them at the same path and NVRTC version."""
    h = hashlib.sha256()
    for d in _include_dirs():
        if pathlib.Path(d) == PLUGIN_DIR:  # hashed by content (_plugin_sources_digest)
            continue
        for root, dirs, files in os.walk(d):
            dirs.sort()
            for name in sorted(files):
                try:
                    st = os.stat(os.path.join(root, name))
                except OSError:
                    continue
                h.update(f"{os.path.relpath(os.path.join(root, name), d)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


# A process that sets this appends one JSON line per compile_spec call (spec_to_json), so a later run can
# compile the same modules ahead of time, in parallel (scripts/warm_kernels.py, tests/gpu_kernel_specs.jsonl).
SPEC_LOG_ENV = "TRTLLM_REPLAYSSM_SPEC_LOG"


def spec_to_json(spec, target: str) -> str:
    """One line naming ``spec`` and ``target``; :func:`spec_from_json` reads it back."""
    return json.dumps({"type": type(spec).__name__, "target": target, **dataclasses.asdict(spec)}, sort_keys=True)


def spec_types() -> dict[str, type]:
    """{class name: spec class} of every kernel spec: the ones each family folder lists (``Family.spec_types``)."""
    from . import families

    types = {}
    for name in families.names():
        types.update({t.__name__: t for t in families.get(name).spec_types})
    return types


def spec_from_json(line: str) -> tuple:
    d = json.loads(line)
    kind, target = d.pop("type"), d.pop("target")
    types = spec_types()
    if kind not in types:
        raise ValueError(f"spec line: type: expected one of {sorted(types)}, got {kind!r}")
    cls = types[kind]
    return (cls.from_dict(d) if hasattr(cls, "from_dict") else cls(**d)), target


def _log_spec(spec, target: str) -> None:
    path = os.environ.get(SPEC_LOG_ENV)
    if path:  # one short O_APPEND write per line: whole lines even with several processes appending
        with open(path, "a") as f:
            f.write(spec_to_json(spec, target) + "\n")


def compile_spec(spec, target: str = "ptx", use_cache: bool = True) -> bytes:
    """PTX (text, as bytes) or cubin for ``spec``; cached on disk."""
    _log_spec(spec, target)
    opts = options(spec, target)
    src = source(spec)
    digest = hashlib.sha256(
        "\x00".join([src, *opts, _plugin_sources_digest(), _header_dirs_signature(), repr(nvrtc_version())]).encode()
    ).hexdigest()[:16]
    path = cache_dir() / f"{spec.key}_{digest}.{target}"
    if use_cache and path.exists():
        return path.read_bytes()
    out = _nvrtc_compile(src, spec.key, opts, target)
    if use_cache:  # atomic publish: concurrent compilers never see a half-written file
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(out)
        os.replace(tmp, path)
    return out


def _nvrtc_compile(src: str, key: str, opts: list[str], target: str) -> bytes:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), f"{key}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            _check(err, f"NVRTC compile of {key}", log.decode(errors="replace"))
        if target == "ptx":
            err, n = nvrtc.nvrtcGetPTXSize(prog)
            _check(err, "nvrtcGetPTXSize")
            buf = b" " * n
            (err,) = nvrtc.nvrtcGetPTX(prog, buf)
            _check(err, "nvrtcGetPTX")
            return buf.rstrip(b"\x00")
        err, n = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        buf = b" " * n
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        _check(err, "nvrtcGetCUBIN")
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
