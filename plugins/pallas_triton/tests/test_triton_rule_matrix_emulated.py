"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) lowered for Triton
and run by the Triton emulator (``pl.emulate``), against jax.numpy on the same random operands.

Every entry that lowers must compute what ``jax.numpy`` computes (integer divisors are kept
nonzero: division by zero is implementation-defined). A subset of the dtypes keeps the run
short: float32, the two narrow floats (where this test found tanh of float16 to be NaN and
erf_inv(+-1) to have the wrong sign) and uint32.
"""

from __future__ import annotations

import pytest

from pallas_core.testing import rule_matrix

pytest.importorskip("pallas_triton")

DTYPES = ("float32", "float16", "bfloat16", "uint32")
_run = rule_matrix.pallas_call_emulation("triton", (8, 32))


@pytest.mark.parametrize("case", [c for c in rule_matrix.CASES if c.dtype in DTYPES], ids=str)
def test_rule_matrix_entry_emulated_matches_jnp(case: rule_matrix.Case) -> None:
    rule_matrix.check(case, _run, "triton")
