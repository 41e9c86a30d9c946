"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) on SparseCore (a
vector subcore, 16 lanes): every entry lowers to a module that verifies, or is refused naming
the operation, the dtype and the backend."""

from __future__ import annotations

from typing import Any

import jax
import pytest

import pallas_core as pl
from pallas_core.stages import kernel_calls
from pallas_core.testing import rule_matrix

plsc = pytest.importorskip("pallas_sparsecore")
import pallas_mosaic_tpu as pltpu  # noqa: E402
from pallas_sparsecore import lowering  # noqa: E402

MESH = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                              num_subcores=1, target="v7x")


def _lower(case: rule_matrix.Case) -> None:
    body, out, xs = rule_matrix.call_parts(case, (16,))
    vmem = [pltpu.VMEM(a.shape, a.dtype) for a in [*xs, out]]

    @pl.kernel(out_type=out, mesh=MESH, scratch_types=vmem, backend="sparsecore")
    def k(*refs: Any) -> None:
        n = len(xs)
        hbm_in, hbm_out, scratch = refs[:n], refs[n], refs[n + 1:]
        for h, v in zip(hbm_in, scratch[:n]):
            pltpu.sync_copy(h, v)
        body(*scratch)
        pltpu.sync_copy(scratch[n], hbm_out)

    (call,) = kernel_calls(jax.make_jaxpr(k)(*xs).jaxpr)
    lowering.lower_kernel(call)  # verifies the module


@pytest.mark.parametrize("case", rule_matrix.CASES, ids=str)
def test_rule_matrix(case: rule_matrix.Case) -> None:
    rule_matrix.check(case, _lower, "sparsecore")
