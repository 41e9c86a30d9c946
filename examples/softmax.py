"""Row-wise softmax, one block of rows per grid step.

Each block holds complete rows, so the max and the sum are local to the block.
Run with ``python examples/softmax.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def softmax_kernel(x_ref, o_ref):
    """Softmax of every row of the block, computed in float32."""
    x = x_ref[...].astype(jnp.float32)
    x = x - jnp.max(x, axis=1, keepdims=True)  # for numerical stability
    e = jnp.exp(x)
    o_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype)


def softmax(x: jax.Array, *, block_rows: int = 64) -> jax.Array:
    """``jax.nn.softmax(x, axis=-1)`` for a 2-D ``x``; the row count need not divide."""
    rows, cols = x.shape
    spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
    return pl.pallas_call(
        softmax_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[spec],
        out_specs=spec,
    )(x)


def main() -> None:
    """Checks ``softmax`` against ``jax.nn.softmax`` on a random (500, 256) matrix."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((500, 256)) * 4, jnp.float32)
    got, want = softmax(x), jax.nn.softmax(x, axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    print(f"softmax: OK (max abs err {float(jnp.max(jnp.abs(got - want)))})")


if __name__ == "__main__":
    main()
