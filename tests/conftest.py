# SPDX-License-Identifier: Apache-2.0
import os

import pytest
import torch

# scripts/gpu_suite.py sets this: one line per test phase (node id, phase, outcome, seconds), appended as
# each ends, so a run cut by a time limit still says where its time went.
TEST_LOG_ENV = "TRTLLM_REPLAYSSM_TEST_LOG"


def pytest_configure(config):
    # Under pytest-xdist every worker would start one intra-op thread per core, and the float64 references
    # of the GPU tests run on the CPU: N workers x all cores threads thrash. Share the cores instead.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_runtest_logreport(report):
    path = os.environ.get(TEST_LOG_ENV)
    # Under xdist the controller sees each worker's reports again (with .node): the worker wrote it already.
    relayed = getattr(report, "node", None) is not None
    if path and not relayed and (report.when == "call" or report.outcome != "passed" or report.duration >= 0.5):
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.3f}\n")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """For modules of thousands of tiny float64 ops: intra-op threads only spin there (10x slower on
    a loaded 2-core host). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
