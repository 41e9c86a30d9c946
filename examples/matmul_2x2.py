"""Matrix multiplication on a 2x2 grid of output blocks.

Step ``(i, j)`` reads row block ``i`` of ``x`` (all of K) and column block ``j`` of ``y`` and
writes output block ``(i, j)``. Run with ``python examples/matmul_2x2.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def matmul_kernel(x_ref, y_ref, o_ref):
    """One output block: ``x_block @ y_block``."""
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32).astype(
        o_ref.dtype)


def matmul_2x2(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x @ y`` computed as a 2x2 grid of blocks; M and N must be even."""
    (m, k), (_, n) = x.shape, y.shape
    if m % 2 or n % 2:
        raise ValueError(f"matmul_2x2 needs even M and N, got x {x.shape} and y {y.shape}")
    bm, bn = m // 2, n // 2
    return pl.pallas_call(
        matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(2, 2),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),  # row block i of x
            pl.BlockSpec((k, bn), lambda i, j: (0, j)),  # column block j of y
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
    )(x, y)


def main() -> None:
    """Checks ``matmul_2x2`` against ``x @ y`` on random matrices."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((128, 192)), jnp.float32)
    got, want = matmul_2x2(x, y), x @ y
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    print(f"matmul_2x2: OK (max abs err {float(jnp.max(jnp.abs(got - want)))})")


if __name__ == "__main__":
    main()
