# SPDX-License-Identifier: Apache-2.0
"""scripts/profile_kda.py on the CPU: its launch-shape flag and its flag checks, which stop before any GPU work."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("profile_kda", ROOT / "scripts" / "profile_kda.py")
pk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pk)


def test_shape_is_the_overrides_keywords():
    from trtllm_replayssm.families.kda.config import kda_geometry, override

    assert pk.parse_shape("") == {}
    assert pk.parse_shape("4:8") == dict(col_lanes=4, warps=8)
    assert pk.parse_shape("2:4:512") == dict(col_lanes=2, warps=4, resident=512)
    with override(**pk.parse_shape("2:2")):  # the pin reaches the planner the launchers ask
        assert kda_geometry(12, 128, 128, 256, conventional=True) == (2, 2)
    for bad in ("4", "4:8:1:2", "4:x", "a:b"):
        with pytest.raises(ValueError, match="col_lanes:warps"):
            pk.parse_shape(bad)


@pytest.mark.parametrize("args, what", [
    (["--shape", "4:x"], "--shape: expected col_lanes:warps[:resident]"),
    (["--k", "17"], "--k: expected 0..16"),
    (["--L", "8", "--k", "9"], "--k: expected 0..8"),
    (["--batch", "0"], "expected >= 1"),
    (["--geom", "nope"], "invalid choice"),
])
def test_bad_flags_stop_before_any_gpu_work(args, what):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_kda.py"), *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and what in r.stderr, r.stderr[-500:]
