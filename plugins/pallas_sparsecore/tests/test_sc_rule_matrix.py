"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) on SparseCore (a
vector subcore, 16 lanes): every entry lowers to a module that verifies and, emulated, matches
``jax.numpy``, or is refused naming the operation, the dtype and the backend."""

from __future__ import annotations

from typing import Any

import pytest

import pallas_core as pl
from pallas_core.testing import rule_matrix

plsc = pytest.importorskip("pallas_sparsecore")
import pallas_mosaic_tpu as pltpu  # noqa: E402

MESH = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                              num_subcores=1, target="v7x")


def _kernel(body: Any, out: Any, xs: Any) -> Any:
    vmem = [pltpu.VMEM(a.shape, a.dtype) for a in [*xs, out]]

    @pl.kernel(out_type=out, mesh=MESH, scratch_types=vmem, backend="sparsecore")
    def k(*refs: Any) -> None:
        n = len(xs)
        hbm_in, hbm_out, scratch = refs[:n], refs[n], refs[n + 1:]
        for h, v in zip(hbm_in, scratch[:n]):
            pltpu.sync_copy(h, v)
        body(*scratch)
        pltpu.sync_copy(scratch[n], hbm_out)
    return k


def _emulate(case: rule_matrix.Case) -> None:
    """The entry run by ``pl.emulate`` on a vector subcore matches ``jax.numpy``."""
    body, out, xs = rule_matrix.call_parts(case, (16,))
    xs = rule_matrix.defined_operands(case, xs)
    got = pl.emulate(_kernel(body, out, xs), backend="sparsecore")(*xs)
    rule_matrix.assert_matches(case, got, xs, out)


@pytest.mark.parametrize("case", rule_matrix.CASES, ids=str)
def test_rule_matrix_emulated(case: rule_matrix.Case) -> None:
    """Each entry lowers to a module that verifies and, emulated, matches ``jax.numpy``; or
    it is refused naming the operation, the dtype and the backend."""
    rule_matrix.check(case, _emulate, "sparsecore")
