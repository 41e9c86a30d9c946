"""Matrix multiplication fused with an activation function.

The kernel takes an extra keyword argument, ``activation``, bound with ``functools.partial``
before the kernel is handed to ``pl.pallas_call`` (kernels only receive Refs).
Run with ``python examples/matmul_activation.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def matmul_kernel(x_ref, y_ref, o_ref, *, activation: Callable[[jax.Array], jax.Array] | None):
    """One output block: ``activation(x_block @ y_block)``, accumulated in float32."""
    acc = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
    if activation is not None:
        acc = activation(acc)
    o_ref[...] = acc.astype(o_ref.dtype)


def matmul(x: jax.Array, y: jax.Array, *,
           activation: Callable[[jax.Array], jax.Array] | None = None,
           block_m: int = 128, block_n: int = 128) -> jax.Array:
    """``activation(x @ y)`` on a grid of ``(block_m, block_n)`` output blocks (full K)."""
    (m, k), (_, n) = x.shape, y.shape
    return pl.pallas_call(
        functools.partial(matmul_kernel, activation=activation),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n)),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
    )(x, y)


def main() -> None:
    """Checks ``matmul`` with no activation, ReLU and GELU against plain jax.numpy."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((128, 256)), jnp.float32)
    err = 0.0
    for activation in (None, jax.nn.relu, jax.nn.gelu):
        got = matmul(x, y, activation=activation)
        want = x @ y if activation is None else activation(x @ y)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        err = max(err, float(jnp.max(jnp.abs(got - want))))
    print(f"matmul_activation: OK (max abs err {err})")


if __name__ == "__main__":
    main()
