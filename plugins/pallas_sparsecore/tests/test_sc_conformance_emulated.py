"""The conformance suite in emulate mode on SparseCore.

SparseCore runs kernels only as ``pl.kernel`` on a subcore mesh (``plsc.VectorSubcoreMesh``),
its operands in HBM and copied to VMEM by DMA; the suite's features are written as
``pallas_call`` grids or on a generic mesh reading HBM directly, so each must raise a
``PallasError`` naming what SparseCore needs. What SparseCore does run is emulated, against
``jax.numpy`` and the interpreter, here (the unknown-primitive check on a subcore mesh) and in
``test_sc_emulator.py`` (every kernel of this plugin's tests).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pallas_mosaic_tpu as pltpu
import pallas_sparsecore as plsc
import pytest

import pallas_core as pl
from pallas_core.testing import FEATURES, ConformanceSuite
from pallas_core.testing.conformance import unknown_p

MESH = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                              num_subcores=1, target="v7x")


def _on_subcore(body: Any, x: jax.Array) -> Any:
    """``body(x_vmem, o_vmem)`` on one vector subcore, operands copied through VMEM."""
    @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=MESH, backend="sparsecore",
               scratch_types=[pltpu.VMEM(x.shape, x.dtype), pltpu.VMEM(x.shape, x.dtype)])
    def k(x_hbm: Any, o_hbm: Any, x_vmem: Any, o_vmem: Any) -> None:
        pltpu.sync_copy(x_hbm, x_vmem)
        body(x_vmem, o_vmem)
        pltpu.sync_copy(o_vmem, o_hbm)
    return k(x)


class TestSparseCoreEmulated(ConformanceSuite):
    backend = "sparsecore"
    emulate = True
    unsupported = frozenset(FEATURES)

    def test_unknown_primitive_raises(self) -> None:
        def body(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = unknown_p.bind(x_ref[...])

        x = self.random((16,))
        with pytest.raises(pl.PallasError, match=unknown_p.name):
            pl.emulate(lambda x: _on_subcore(body, x), backend=self.backend)(x)

    def test_subcore_kernel_emulated(self) -> None:
        """The shape of every SparseCore kernel: HBM -> VMEM, compute, VMEM -> HBM."""
        def body(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = jnp.exp(x_ref[...]) * 2.0 - x_ref[...]

        x = self.random((16,))
        got = pl.emulate(lambda x: _on_subcore(body, x), backend=self.backend)(x)
        np.testing.assert_allclose(got, jnp.exp(x) * 2.0 - x, rtol=1e-6, atol=1e-6)
