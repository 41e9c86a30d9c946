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


# Emulating all entries takes about two minutes: one 32-bit entry per operation here (the
# vector registers hold 32-bit lanes). All of them passed when this test was written, except
# floor_divide of bools, whose random divisor holds zeros (undefined).
EMULATED = list({c.name: c for c in reversed(rule_matrix.CASES)
                 if str(c.dtype) in ("float32", "int32")}.values())


@pytest.mark.parametrize("case", EMULATED, ids=str)
def test_rule_matrix_emulated(case: rule_matrix.Case) -> None:
    """The entry run by ``pl.emulate`` on a vector subcore matches ``jax.numpy``."""
    import jax.numpy as jnp
    import numpy as np

    body, out, xs = rule_matrix.call_parts(case, (16,))
    if case.name in ("div", "rem", "floor_divide", "remainder") and len(xs) == 2 and \
            jnp.issubdtype(xs[1].dtype, jnp.integer):
        xs[1] = jnp.where(xs[1] == 0, jnp.ones((), xs[1].dtype), xs[1])
    got = pl.emulate(_kernel(body, out, xs), backend="sparsecore")(*xs)
    want = case.op(*xs).astype(out.dtype)
    tol = rule_matrix.TOLERANCE.get(np.dtype(out.dtype).name, 0.0)
    if not jnp.issubdtype(xs[0].dtype, jnp.floating):
        tol = 0.0
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=tol, atol=tol, err_msg=str(case))
