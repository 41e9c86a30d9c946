"""Blocked 2-D addition on shapes that blocks do not divide.

The grid is ``pl.cdiv(shape, block)`` per axis, so the last block along each axis hangs over
the edge: it is padded on read and only its in-bounds part is written back.
Run with ``python examples/blocked_add_uneven.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def add_kernel(x_ref, y_ref, o_ref):
    """Adds one (possibly partial) block of ``x`` and ``y``."""
    o_ref[...] = x_ref[...] + y_ref[...]


def blocked_add(x: jax.Array, y: jax.Array, *,
                block: tuple[int, int] = (128, 128)) -> jax.Array:
    """``x + y`` for 2-D arrays of any shape, in blocks of ``block``."""
    grid = (pl.cdiv(x.shape[0], block[0]), pl.cdiv(x.shape[1], block[1]))
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    return pl.pallas_call(
        add_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=grid,
        in_specs=[spec, spec],
        out_specs=spec,
    )(x, y)


def main() -> None:
    """Checks ``blocked_add`` on a (1000, 300) array with (128, 128) blocks (an 8x3 grid)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1000, 300)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((1000, 300)), jnp.float32)
    got, want = blocked_add(x, y), x + y
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
    print(f"blocked_add_uneven: OK (max abs err {float(jnp.max(jnp.abs(got - want)))})")


if __name__ == "__main__":
    main()
