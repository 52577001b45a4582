#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Set up the peer baselines the benchmarks compare against, in the git-ignored ``third_party/``.

mamba_ssm (Dao AI Lab): its Triton ``selective_state_update`` is the ``mamba_ssm`` column of
scripts/bench_kernels.py and the ``mamba_ssm`` mode of scripts/bench_e2e.py standard (both load it from
``third_party/mamba_ssm_peer``, ``--mamba-path`` to change). The package itself cannot be pip-installed
on a machine without nvcc and a matching torch (its setup.py builds CUDA extensions), and the Triton
kernel needs none of them. So this script downloads the pinned sdist, checks its sha256,
and extracts only the two Triton files the kernel needs (``ops/triton/selective_state_update.py``
and ``ops/triton/softplus.py``) under empty package ``__init__``s (the sdist's top-level ``__init__``
imports the CUDA extensions); einops, which the kernel imports, is unpacked beside it from its wheel.

Every file comes through ``pip download --no-deps`` (:func:`pip_download`), so pip's own configuration
(``index-url``, ``extra-index-url``, ``find-links``, proxies, certificates: pip.conf or ``PIP_*``) decides where
from; the pinned sha256s are given to pip (``--require-hashes``), which checks them before it unpacks or runs
anything, and checked again here. pip prepares an sdist's metadata by running its build backend: for mamba_ssm
that imports torch, so it runs in this environment (``--no-build-isolation``, which has torch) with
``MAMBA_SKIP_CUDA_BUILD=TRUE`` (mamba_ssm's own switch: no nvcc needed, nothing compiled).
Nothing here is committed: the folder is in .gitignore, and the files keep their own license (Apache-2.0,
the sdist's LICENSE is copied with them).

flash-linear-attention (fla-org): its Triton ``fused_recurrent_gated_delta_rule`` is the peer column of the
Gated DeltaNet kernel benchmark (scripts/bench_gdn.py, ``--fla-path``, default ``third_party/fla_peer``). The
pinned ``fla-core`` wheel (pure Python + Triton, sha256-checked) is unpacked there with einops; its Triton
kernels need a GPU and triton >= 3.3 at run time, nothing at install time. MIT license, kept with the files.

Usage: python scripts/fetch_peers.py [--dest third_party] [--force] [--only mamba_ssm|fla]
Then, for the H200 (the device tool carries ignored paths only when asked): ``carry: ["third_party"]``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAMBA_VERSION = "2.3.2.post1"
MAMBA_SHA256 = "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028"
MAMBA_FILES = ("mamba_ssm/ops/triton/selective_state_update.py", "mamba_ssm/ops/triton/softplus.py")
EINOPS_VERSION = "0.8.1"
FLA_VERSION = "0.6.0"
FLA_SHA256 = "b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd"  # fla_core-0.6.0-py3-none-any.whl


def pip_download(spec: str, dest: pathlib.Path, *, sha256: str | None = None, sdist: bool = False,
                 env: dict | None = None) -> pathlib.Path:
    """The one file of ``spec`` (``name==version``) that ``pip download --no-deps`` saves in the empty directory
    ``dest`` (a wheel, or with ``sdist`` the source archive), from the index pip is configured with. ``sha256``: pip
    refuses any other file (hash-checking mode, before it unpacks or builds it), and it is checked again here.
    ``env``: extra environment of the pip process."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    if sdist:  # pip runs the sdist's build backend for its metadata: in this environment, which has torch
        cmd += ["--no-binary", ":all:", "--no-build-isolation"]
    else:
        cmd += ["--only-binary", ":all:"]
    if sha256 is None:
        cmd.append(spec)
    else:
        req = dest / "requirements.txt"
        req.write_text(f"{spec} --hash=sha256:{sha256}\n")
        cmd += ["--require-hashes", "-r", str(req)]
    r = subprocess.run(cmd, env={**os.environ, **(env or {})})
    if r.returncode != 0:
        raise RuntimeError(f"pip download {spec} failed (exit {r.returncode}; pip's messages above); the index is "
                           f"pip's own setting (pip config list)")
    files = [f for f in dest.iterdir() if f.name != "requirements.txt"]  # --no-deps: the one file asked for
    if len(files) != 1:
        raise RuntimeError(f"pip download {spec}: expected one file in {dest}, got {sorted(f.name for f in files)}")
    if sha256 is not None:
        got = hashlib.sha256(files[0].read_bytes()).hexdigest()
        if got != sha256:
            raise RuntimeError(f"{files[0].name}: sha256 {got}, expected {sha256} (pinned in {__file__})")
    return files[0]


def fetch_mamba(dest: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sdist = pip_download(f"mamba-ssm=={MAMBA_VERSION}", pathlib.Path(tmp), sha256=MAMBA_SHA256, sdist=True,
                             env={"MAMBA_SKIP_CUDA_BUILD": "TRUE"})
        data = sdist.read_bytes()
    top = f"mamba_ssm-{MAMBA_VERSION}/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for rel in (*MAMBA_FILES, "LICENSE"):
            member = tar.getmember(top + rel)
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(member).read())
    for pkg in ("mamba_ssm", "mamba_ssm/ops", "mamba_ssm/ops/triton"):
        (dest / pkg / "__init__.py").write_text("")
    (dest / "PEER.json").write_text(json.dumps(dict(package="mamba-ssm", version=MAMBA_VERSION, sdist=sdist.name,
                                                    sha256=MAMBA_SHA256, files=list(MAMBA_FILES)), indent=1))


def fetch_einops(dest: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wheel = pip_download(f"einops=={EINOPS_VERSION}", pathlib.Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("einops/"):
                    z.extract(name, dest)


def fetch_fla(dest: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wheel = pip_download(f"fla-core=={FLA_VERSION}", pathlib.Path(tmp), sha256=FLA_SHA256)
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.startswith("fla/") or n.endswith("LICENSE")]
            for name in names:
                z.extract(name, dest)
    (dest / "PEER.json").write_text(json.dumps(dict(package="fla-core", version=FLA_VERSION, wheel=wheel.name,
                                                    sha256=FLA_SHA256), indent=1))


PEERS = {  # folder -> (fetchers, what it holds)
    "mamba_ssm_peer": ((fetch_mamba, fetch_einops),
                       f"mamba_ssm {MAMBA_VERSION} Triton selective_state_update + einops {EINOPS_VERSION}"),
    "fla_peer": ((fetch_fla, fetch_einops), f"fla-core {FLA_VERSION} (fused_recurrent_gated_delta_rule) + einops"),
}
ONLY = {"mamba_ssm": "mamba_ssm_peer", "fla": "fla_peer"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=str(ROOT / "third_party"))
    ap.add_argument("--force", action="store_true", help="replace an existing peer folder")
    ap.add_argument("--only", choices=sorted(ONLY), default=None, help="fetch one peer (default: all)")
    args = ap.parse_args(argv)
    for folder, (fetchers, what) in PEERS.items():
        if args.only is not None and ONLY[args.only] != folder:
            continue
        peer = pathlib.Path(args.dest) / folder
        if peer.exists():
            if not args.force:
                print(f"{peer} exists (--force to replace)")
                continue
            shutil.rmtree(peer)
        peer.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=peer.parent) as tmp:  # a failed fetch leaves no half folder
            part = pathlib.Path(tmp) / peer.name
            part.mkdir()
            for fetch in fetchers:
                fetch(part)
            part.rename(peer)
        print(f"{what} in {peer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
