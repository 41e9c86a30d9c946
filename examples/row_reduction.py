"""Row reductions (sum and max) with a grid over blocks of rows; two outputs per kernel.

Run with ``python examples/row_reduction.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def row_reduce_kernel(x_ref, sum_ref, max_ref):
    """Writes the sum and the max of every row of the block (sum accumulated in float32)."""
    x = x_ref[...]
    sum_ref[...] = jnp.sum(x.astype(jnp.float32), axis=1).astype(sum_ref.dtype)
    max_ref[...] = jnp.max(x, axis=1)


def row_sum_max(x: jax.Array, *, block_rows: int = 128) -> tuple[jax.Array, jax.Array]:
    """``(x.sum(axis=1), x.max(axis=1))`` for a 2-D ``x``; the row count need not divide."""
    rows, cols = x.shape
    out_spec = pl.BlockSpec((block_rows,), lambda i: (i,))
    return pl.pallas_call(
        row_reduce_kernel,
        out_shape=(jax.ShapeDtypeStruct((rows,), x.dtype),
                   jax.ShapeDtypeStruct((rows,), x.dtype)),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[pl.BlockSpec((block_rows, cols), lambda i: (i, 0))],
        out_specs=(out_spec, out_spec),
    )(x)


def main() -> None:
    """Checks the row sums and maxima of a random (1000, 384) matrix."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1000, 384)), jnp.float32)
    got_sum, got_max = row_sum_max(x)
    np.testing.assert_allclose(got_sum, jnp.sum(x, axis=1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got_max, jnp.max(x, axis=1))
    err = float(jnp.max(jnp.abs(got_sum - jnp.sum(x, axis=1))))
    print(f"row_reduction: OK (max abs err {err})")


if __name__ == "__main__":
    main()
