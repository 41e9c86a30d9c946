"""Vector addition: the smallest pallas kernel.

Run with ``python examples/vector_add.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def add_kernel(x_ref, y_ref, o_ref):
    """Adds the current block of ``x`` and ``y`` into the output block."""
    # `ref[...]` reads the whole block the grid step sees; assigning to it writes the block.
    o_ref[...] = x_ref[...] + y_ref[...]


def vector_add(x: jax.Array, y: jax.Array, *, block_size: int | None = None) -> jax.Array:
    """``x + y`` for 1-D arrays.

    With ``block_size=None`` the kernel runs once on the whole arrays; otherwise the grid has
    one step per block of ``block_size`` elements (the last block may be partial).
    """
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if block_size is None:
        return pl.pallas_call(add_kernel, out_shape=out_shape)(x, y)
    spec = pl.BlockSpec((block_size,), lambda i: (i,))
    return pl.pallas_call(
        add_kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(x.shape[0], block_size),),
        in_specs=[spec, spec],
        out_specs=spec,
    )(x, y)


def main() -> None:
    """Runs the kernel on random inputs and checks it against ``x + y``."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(4096), jnp.float32)
    y = jnp.asarray(rng.standard_normal(4096), jnp.float32)
    want = x + y
    for block_size in (None, 512):
        got = vector_add(x, y, block_size=block_size)
        np.testing.assert_allclose(got, want, rtol=0, atol=0)
    print(f"vector_add: OK (max abs err {float(jnp.max(jnp.abs(got - want)))})")


if __name__ == "__main__":
    main()
