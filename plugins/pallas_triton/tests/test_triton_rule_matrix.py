"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) on Triton: every
entry lowers to a Triton module that verifies, or is refused naming the operation, the dtype and
the backend."""

from __future__ import annotations

import jax
import pytest
from pallas_triton import lowering

import pallas_core as pl
from pallas_core.stages import kernel_calls
from pallas_core.testing import rule_matrix


def _lower(case: rule_matrix.Case) -> None:
    body, out, xs = rule_matrix.call_parts(case, (16, 32))
    f = pl.pallas_call(body, out, backend="triton")
    (call,) = kernel_calls(jax.make_jaxpr(f)(*xs).jaxpr)
    lowering.lower_kernel(call)  # verifies the module


@pytest.mark.parametrize("case", rule_matrix.CASES, ids=str)
def test_rule_matrix(case: rule_matrix.Case) -> None:
    rule_matrix.check(case, _lower, "triton")
