# SPDX-License-Identifier: Apache-2.0
"""The family interface (issue 36): every family folder's declaration against the one home of the state shapes.

contract.py's docstring holds one table per family (name, shape, dtype, who writes it); each family folder
(``trtllm_replayssm/families/<name>/``) declares the same rows as ``StateTensor`` rows, which is what the cache
allocates from. These tests parse the contract's tables and compare them with every declared family (names,
shapes in symbols, default dtypes), check that the cache's tensors are the families' allocations, and that the
kernel spec types a family lists are the ones compile.py reads spec lines with."""

from __future__ import annotations

import re

import pytest
import torch

from trtllm_replayssm import compile as cc
from trtllm_replayssm import contract, costs, families
from trtllm_replayssm.cache import ReplayStateCache

# The contract's section heading of each family folder.
SECTIONS = {"mamba2": "Mamba-2 layer", "gdn": "Gated DeltaNet layer", "kda": "Kimi Delta Attention layer"}
SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}


def contract_table(section: str) -> dict[str, tuple[str, str]]:
    """{tensor: (shape, first dtype word)} of the contract's table under the heading starting with ``section``."""
    doc = contract.__doc__
    start = doc.index("\n" + section) + 1
    body = doc[start:]
    rules = [m.start() for m in re.finditer(r"^=+ ", body, re.M)]
    assert len(rules) >= 3, f"no table under {section!r}"
    rows = {}
    for line in body[rules[1]:rules[2]].splitlines()[1:]:
        m = re.match(r"^(\w+)\s+(\([^)]*\))\s+(\S+)", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_every_family_folder_is_declared_and_in_the_contract():
    assert families.names() == sorted(SECTIONS)
    for name in families.names():
        assert families.get(name).name == name


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_state_table_matches_the_contract(name):
    fam = families.get(name)
    table = contract_table(SECTIONS[name])
    declared = [t.name for t in fam.state_table]
    assert [n for n in table if n != "conv"] == declared, "the contract's rows (conv is the cache's) in table order"
    for t in fam.state_table:
        shape = "(" + ", ".join("S" if d == "slots" else d for d in t.dims) + ")"
        assert table[t.name][0] == shape, t.name
        want = "act" if t.dtype == "act" else SHORT[fam.dtypes[t.dtype]]
        assert table[t.name][1] == want, (t.name, table[t.name][1], want)


def test_contract_parser_has_teeth():
    """A row whose shape differs from the declaration is found (the comparison is not vacuous)."""
    table = contract_table(SECTIONS["gdn"])
    assert table["k_cache"] == ("(S, Hk, L, K)", "f32")
    fam = families.get("gdn")
    k = next(t for t in fam.state_table if t.name == "k_cache")
    assert "(" + ", ".join("S" if d == "slots" else d for d in k.dims) + ")" == table["k_cache"][0]
    assert "(S, HV, L, K)" != table["k_cache"][0]


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_allocate_layers_and_optional(name):
    fam = families.get(name)
    geo = next(iter(fam.geometries.values()))
    t = fam.allocate(3, 4, geo, layers=2, optional=())
    assert all(x.shape[0] == 2 and x.shape[1:] == fam.shapes(3, 4, geo)[n] for n, x in t.items())
    assert not any(x.any() for x in t.values())
    with pytest.raises(ValueError, match="optional: expected names among"):
        fam.allocate(1, 2, geo, optional=("nope",))
    # the bytes model a family names takes its geometry and L, in the geometry's order
    r = fam.bytes_per_step(*geo, 16)
    assert r["conventional"] > 0 and r["replay"] > 0


def test_cache_tensors_are_the_families_allocations():
    """The cache's per-family tensors have the family tables' shapes and default dtypes (with a leading layers dim)."""
    S, L = 3, 8
    c = ReplayStateCache(2, S, 4, 64, 64, 2, L, shadow_dtype=torch.float8_e4m3fn)
    m = families.get("mamba2").shapes(S, L, (4, 64, 64, 2), optional=True)
    for name in ("state", "shadow", "shadow_scale", "x_cache", "B_cache", "dt_cache"):
        assert tuple(getattr(c, name).shape) == (2, *m[name]), name
    assert c.shadow.dtype == torch.float8_e4m3fn and bool((c.shadow_scale == 1).all())
    kw = dict(num_slots=S, buffer_len=L, shadow_dtype=torch.bfloat16,
              layers={"mamba2": (1, (4, 64, 64, 2)), "gdn": (1, (4, 2, 16, 16))})
    c = ReplayStateCache(**kw)
    g = families.get("gdn").shapes(S, L, (4, 2, 16, 16), optional=True)
    t = c.group("gdn").t
    assert list(t) == list(g)  # every row of the table, in its order
    for name in g:
        assert tuple(t[name].shape) == (1, *g[name]), name
    assert t["shadow"].dtype == torch.bfloat16 and t["u_cache"].dtype == torch.float32 and t["v_cache"].dtype == torch.bfloat16
    assert c.bytes_per_slot() == costs.cache_bytes(**kw)["slot"]


def test_spec_types_come_from_the_families():
    types = cc.spec_types()
    for name in families.names():
        for t in families.get(name).spec_types:
            assert types[t.__name__] is t
