# SPDX-License-Identifier: Apache-2.0
"""The tests' decode problems: :mod:`trtllm_replayssm.problems` (the library owns them so that scripts need
not import tests/), re-exported under the name the tests import."""

from trtllm_replayssm.problems import GEOMETRIES, Params, make_inputs, make_params  # noqa: F401
