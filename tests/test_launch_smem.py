# SPDX-License-Identifier: Apache-2.0
"""launch._allow_dynamic_smem on the CPU (the driver calls replaced): the opt-in a kernel needs before a launch with
more than the default dynamic shared memory (KDASpec.bulk_flush's flush tile), through the call the handle's type
takes (cuKernelSetAttribute for cuda.core's library kernels, cuFuncSetAttribute for a CUfunction), once per kernel,
device and size, and a refusal raised with its error."""

import types

import pytest
from cuda.bindings import driver

from trtllm_replayssm import launch

ATTR = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@pytest.fixture
def calls(monkeypatch):
    log = []

    def kernel_set(attrib, val, kernel, dev):
        log.append(("kernel", attrib, val, type(kernel).__name__, int(dev)))
        return (driver.CUresult.CUDA_SUCCESS,)

    def func_set(hfunc, attrib, value):
        log.append(("func", attrib, value, type(hfunc).__name__))
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuKernelSetAttribute", kernel_set)
    monkeypatch.setattr(driver, "cuFuncSetAttribute", func_set)
    monkeypatch.setattr(launch, "_dynamic_smem", set())
    return log


def test_library_kernel_is_opted_in_once_per_device_and_size(calls):
    kern = types.SimpleNamespace(handle=driver.CUkernel())
    for _ in range(3):
        launch._allow_dynamic_smem(kern, 1, 25724)
    launch._allow_dynamic_smem(kern, 0, 25724)
    launch._allow_dynamic_smem(kern, 1, 30000)
    assert calls == [("kernel", ATTR, 25724, "CUkernel", 1), ("kernel", ATTR, 25724, "CUkernel", 0),
                     ("kernel", ATTR, 30000, "CUkernel", 1)]


def test_function_handle_takes_the_function_call(calls):
    launch._allow_dynamic_smem(types.SimpleNamespace(handle=driver.CUfunction()), 0, 4096)
    assert calls == [("func", ATTR, 4096, "CUfunction")]


def test_refusal_is_raised_and_not_cached(monkeypatch, calls):
    monkeypatch.setattr(driver, "cuKernelSetAttribute",
                        lambda *a: (driver.CUresult.CUDA_ERROR_INVALID_VALUE,))
    kern = types.SimpleNamespace(handle=driver.CUkernel())
    for _ in range(2):  # not remembered as done: a second launch asks again
        with pytest.raises(RuntimeError, match="300000 bytes of dynamic shared memory refused"):
            launch._allow_dynamic_smem(kern, 0, 300000)
