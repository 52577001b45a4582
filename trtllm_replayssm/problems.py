# SPDX-License-Identifier: Apache-2.0
"""Random but realistic Mamba-2 decode problems shared by the tests and the benchmarks.

``make_params(H, gen)`` gives one layer's per-head constants (:class:`Params`: dt_bias, A, D, fp32);
``make_inputs(batch, H, P, N, G, act, gen)`` one step's (x, B, C, dt, z) in the activation dtype. Both
draw from the caller's ``torch.Generator`` only, so a seed fixes the problem. Scripts import this module
(never tests/, which is not installed); tests/problems.py re-exports it.

Value ranges follow the Mamba-2 initialisation: A = -exp(A_log) with A_log = log U[1, 16],
dt_bias = softplus^-1 of dt in [1e-3, 0.1] (log-uniform), raw dt ~ N(-2, 1) (docs/DESIGN.md §1).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .geometries import GEOMETRIES  # noqa: F401  (re-exported: tests and benchmarks index it by name)


@dataclasses.dataclass
class Params:
    dt_bias: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor


def make_params(H: int, gen: torch.Generator, device="cpu") -> Params:
    dt0 = torch.exp(torch.rand(H, generator=gen, dtype=torch.float64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
    A = -torch.exp(torch.log(torch.rand(H, generator=gen, dtype=torch.float64) * 15 + 1))
    D = torch.randn(H, generator=gen, dtype=torch.float64) * 0.5 + 1.0
    return Params(*(t.float().to(device) for t in (dt_bias, A, D)))


def make_inputs(batch, H, P, N, G, act, gen, device="cpu", has_z=False):
    """Fresh step inputs (x, B, C, dt, z) in the activation dtype."""
    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale + shift).to(act).to(device)

    x = rnd(batch, H, P)
    B = rnd(batch, G, N, scale=N ** -0.5 * 4)
    C = rnd(batch, G, N, scale=N ** -0.5 * 4)
    dt = rnd(batch, H, scale=1.0, shift=-2.0)
    z = rnd(batch, H, P) if has_z else None
    return x, B, C, dt, z
