# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_kda.py on the CPU: the conventional step's pinned modules a row times (``--conv-resident``,
``--conv-bulk``) and the reference each is checked against bit for bit, and the flags' checks (before any GPU work)."""

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_kda", ROOT / "scripts" / "bench_kda.py")
bk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bk)


def test_conv_variants_pair_each_bulk_module_with_its_one_shot_shape():
    assert bk.conv_variants((), ()) == []
    got = bk.conv_variants((512,), ((2, 4), (2, 4, 640)))
    assert got == [
        ("r512", dict(resident=512), {}),
        ("2x4", dict(col_lanes=2, warps=4), {}),
        ("bulk2x4", dict(col_lanes=2, warps=4, bulk=True, resident=None), dict(col_lanes=2, warps=4)),
        ("bulk2x4r640", dict(col_lanes=2, warps=4, bulk=True, resident=640), dict(col_lanes=2, warps=4)),
    ]


def test_bad_bulk_flags_are_named():
    for flag in ("--conv-bulk", "--replay-bulk"):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kda.py"), flag, "2:4:1:1"],
                           capture_output=True, text=True)
        assert r.returncode == 2 and flag in r.stderr, r.stderr[-300:]
