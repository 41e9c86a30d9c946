"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) on Triton: every
entry lowers to a Triton module that verifies and, run by the Triton emulator (``pl.emulate``),
computes what ``jax.numpy`` computes on the same random operands (integer divisors kept
nonzero: division by zero is implementation-defined); or it is refused naming the operation,
the dtype and the backend. The emulated matrix found tanh of float16 to be NaN near zero and
erf_inv(+-1) to have the wrong sign."""

from __future__ import annotations

import pytest

from pallas_core.testing import rule_matrix

pytest.importorskip("pallas_triton")

_run = rule_matrix.pallas_call_emulation("triton", (16, 32))


@pytest.mark.parametrize("case", rule_matrix.CASES, ids=str)
def test_rule_matrix(case: rule_matrix.Case) -> None:
    rule_matrix.check(case, _run, "triton")
