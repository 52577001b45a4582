#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Set up the peer baselines the benchmarks compare against, in the git-ignored ``third_party/``.

mamba_ssm (Dao AI Lab): its Triton ``selective_state_update`` is the ``mamba_ssm`` column of
scripts/bench_kernels.py and the ``mamba_ssm`` mode of scripts/bench_e2e.py standard (both load it from
``third_party/mamba_ssm_peer``, ``--mamba-path`` to change). The package itself cannot be pip-installed
on a machine without nvcc and a matching torch (its setup.py builds CUDA extensions), and the Triton
kernel needs none of them. So this script downloads the pinned sdist from PyPI, checks its sha256,
and extracts only the two Triton files the kernel needs (``ops/triton/selective_state_update.py``
and ``ops/triton/softplus.py``) under empty package ``__init__``s (the sdist's top-level ``__init__``
imports the CUDA extensions); einops, which the kernel imports, is unpacked beside it from its wheel.
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
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAMBA_VERSION = "2.3.2.post1"
MAMBA_SHA256 = "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028"
MAMBA_FILES = ("mamba_ssm/ops/triton/selective_state_update.py", "mamba_ssm/ops/triton/softplus.py")
EINOPS_VERSION = "0.8.1"
FLA_VERSION = "0.6.0"
FLA_SHA256 = "b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd"  # fla_core-0.6.0-py3-none-any.whl


def _sdist_url(name: str, version: str) -> str:
    with urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json", timeout=60) as r:
        meta = json.load(r)
    files = meta.get("releases", {}).get(version) or (meta["urls"] if meta["info"]["version"] == version else [])
    for u in files:
        if u["packagetype"] == "sdist":
            return u["url"]
    raise RuntimeError(f"{name}=={version}: no sdist on PyPI")


def fetch_mamba(dest: pathlib.Path) -> None:
    url = _sdist_url("mamba-ssm", MAMBA_VERSION)
    with urllib.request.urlopen(url, timeout=120) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != MAMBA_SHA256:
        raise RuntimeError(f"{url}: sha256 {got}, expected {MAMBA_SHA256} (pinned in {__file__})")
    top = f"mamba_ssm-{MAMBA_VERSION}/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for rel in (*MAMBA_FILES, "LICENSE"):
            member = tar.getmember(top + rel)
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(member).read())
    for pkg in ("mamba_ssm", "mamba_ssm/ops", "mamba_ssm/ops/triton"):
        (dest / pkg / "__init__.py").write_text("")
    (dest / "PEER.json").write_text(json.dumps(dict(package="mamba-ssm", version=MAMBA_VERSION, sdist=url,
                                                    sha256=MAMBA_SHA256, files=list(MAMBA_FILES)), indent=1))


def fetch_einops(dest: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        f"einops=={EINOPS_VERSION}", "-d", tmp], check=True)
        (wheel,) = pathlib.Path(tmp).glob("einops-*.whl")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("einops/"):
                    z.extract(name, dest)


def fetch_fla(dest: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        f"fla-core=={FLA_VERSION}", "-d", tmp], check=True)
        (wheel,) = pathlib.Path(tmp).glob("fla_core-*.whl")
        got = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if got != FLA_SHA256:
            raise RuntimeError(f"{wheel.name}: sha256 {got}, expected {FLA_SHA256} (pinned in {__file__})")
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
