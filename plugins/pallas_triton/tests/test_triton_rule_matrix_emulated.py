"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) lowered for Triton
and run by the Triton emulator, against jax.numpy on the same random operands.

Every entry that lowers must compute what ``jax.numpy`` computes. Divisors are kept nonzero:
integer division by zero is implementation-defined (XLA gives -1, a GPU what its instruction
gives). A subset of the dtypes keeps the run short; the full matrix is a loop over
``rule_matrix.DTYPES``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from test_triton_emulator import emulate

import pallas_core as pl
from pallas_core.testing import rule_matrix

pytest.importorskip("pallas_triton")

DTYPES = ("float32", "float16", "bfloat16", "uint32")
CASES = [c for c in rule_matrix.CASES if c.dtype in DTYPES]
DIVIDES = {"div", "rem", "floor_divide", "remainder"}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def _nonzero(x: Any) -> Any:
    one = jnp.ones((), x.dtype)
    return jnp.where(x == jnp.zeros((), x.dtype), one, x)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rule_matrix_entry_emulated_matches_jnp(case: rule_matrix.Case) -> None:
    body, out, xs = rule_matrix.call_parts(case, (8, 32))
    if case.name in DIVIDES:
        xs = [xs[0], _nonzero(xs[1])]
    fn = pl.pallas_call(body, out, backend="triton")
    try:
        got = emulate(fn, *xs, checked=True)
    except pl.UnsupportedError as e:  # refused when lowered: test_triton_rule_matrix.py checks
        assert "triton" in str(e)
        return
    want = np.asarray(case.op(*xs).astype(out.dtype))
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.name in TOL:
        tol = TOL[want.dtype.name]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                                   atol=tol, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)

