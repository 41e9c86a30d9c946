"""Matrix multiplication on a 3-D grid ``(i, j, k)`` that accumulates over K.

Step ``(i, j, k)`` adds ``x[i, k] @ y[k, j]`` into output block ``(i, j)``. The output block
stays the same while ``k`` runs (it is the innermost grid axis), so it acts as an
accumulator: it is zeroed at ``k == 0`` under ``pl.when`` and written back once ``(i, j)``
changes. Inputs may be bfloat16 with a float32 output (float32 accumulation).
Run with ``python examples/matmul_3d_grid.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def matmul_kernel(x_ref, y_ref, o_ref):
    """Accumulates ``x_block @ y_block`` into the output block, zeroing it at ``k == 0``."""

    @pl.when(pl.program_id(2) == 0)
    def _init():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                          preferred_element_type=jnp.float32).astype(o_ref.dtype)


def matmul(x: jax.Array, y: jax.Array, *, block_m: int = 128, block_n: int = 128,
           block_k: int = 128, out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``x @ y`` in ``out_dtype``; M, N and K must be multiples of their block sizes.

    K must divide exactly: a partial K block would add padding into the accumulator.
    """
    (m, k), (_, n) = x.shape, y.shape
    if m % block_m or n % block_n or k % block_k:
        raise ValueError(f"matmul: x {x.shape} @ y {y.shape} is not a multiple of the blocks "
                         f"({block_m}, {block_n}, {block_k})")
    return pl.pallas_call(
        matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m // block_m, n // block_n, k // block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((block_k, block_n), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
    )(x, y)


def main() -> None:
    """Checks float32 and bfloat16-in/float32-out products against ``jnp.dot``."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 384)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((384, 256)), jnp.float32)
    got, want = matmul(x, y), x @ y
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    err = float(jnp.max(jnp.abs(got - want)))

    xb, yb = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
    got = matmul(xb, yb, out_dtype=jnp.float32)
    want = jnp.dot(xb, yb, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    err = max(err, float(jnp.max(jnp.abs(got - want))))
    print(f"matmul_3d_grid: OK (max abs err {err})")


if __name__ == "__main__":
    main()
