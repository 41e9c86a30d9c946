"""Iota: each grid step writes its own index, read with ``pl.program_id``.

Run with ``python examples/iota.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def iota_kernel(o_ref):
    """Writes the step's index ``i`` into element ``i`` of the (unblocked) output."""
    i = pl.program_id(0)
    o_ref[i] = i


def iota(n: int) -> jax.Array:
    """``[0, 1, ..., n - 1]`` as int32, one grid step per element."""
    # No BlockSpec: every step sees the whole output and writes one element of it.
    return pl.pallas_call(iota_kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.int32),
                          grid=(n,))()


def block_id_kernel(o_ref):
    """Fills the output block of step ``(i, j)`` with ``i * num_programs(1) + j``."""
    i, j = pl.program_id(0), pl.program_id(1)
    o_ref[...] = jnp.full(o_ref.shape, i * pl.num_programs(1) + j, o_ref.dtype)


def block_ids(grid: tuple[int, int], block: tuple[int, int]) -> jax.Array:
    """An int32 array of ``grid`` blocks of shape ``block``, each holding its flat step index."""
    shape = (grid[0] * block[0], grid[1] * block[1])
    return pl.pallas_call(
        block_id_kernel,
        out_shape=jax.ShapeDtypeStruct(shape, jnp.int32),
        grid=grid,
        out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
    )()


def block_ids_reference(grid: tuple[int, int], block: tuple[int, int]) -> jax.Array:
    """What ``block_ids`` computes, in plain jax.numpy."""
    ids = jnp.arange(grid[0] * grid[1], dtype=jnp.int32).reshape(grid)
    return jnp.repeat(jnp.repeat(ids, block[0], axis=0), block[1], axis=1)


def main() -> None:
    """Checks ``iota`` against ``jnp.arange`` and ``block_ids`` against its reference."""
    got = iota(16)
    np.testing.assert_array_equal(got, jnp.arange(16, dtype=jnp.int32))
    np.testing.assert_array_equal(block_ids((3, 4), (8, 16)),
                                  block_ids_reference((3, 4), (8, 16)))
    print("iota: OK (max abs err 0)")


if __name__ == "__main__":
    main()
