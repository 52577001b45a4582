# SPDX-License-Identifier: Apache-2.0
"""``scripts/build_engine.py`` as the user runs it (a subprocess, warnings off): one helper for the engine tests."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def build_engine(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``build_engine.py *args``; the completed process (returncode, stdout, stderr as text), never raising."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "build_engine.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout, check=False)
