"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) on Triton: every
entry lowers to a Triton module that verifies, or is refused naming the operation, the dtype and
the backend."""

from __future__ import annotations

import pytest
from pallas_triton import lowering

from pallas_core.testing import rule_matrix

_lower = rule_matrix.pallas_call_lowering("triton", (16, 32), lowering.lower_kernel)


@pytest.mark.parametrize("case", rule_matrix.CASES, ids=str)
def test_rule_matrix(case: rule_matrix.Case) -> None:
    rule_matrix.check(case, _lower, "triton")
