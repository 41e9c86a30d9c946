"""Names of ``jax.experimental.pallas.mosaic_gpu`` implemented here: ``plgpu.planar_snake``
against JAX's on every index of several shapes (and as a kernel's block order, lowered for
``cuda`` and interpreted), and ``plgpu.kernel(out_type=...)`` used as JAX's decorator factory."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("shape, minor_dim, tile_width", [
    ((8, 8), 0, 2), ((4, 4), 1, 2), ((7, 5), 1, 3), ((6, 9), 0, 4), ((5, 5), 1, 5),
    ((3, 10), 1, 4), ((12, 7), 0, 5), ((1, 6), 0, 1)])
def test_planar_snake_matches_jax(shape: tuple[int, int], minor_dim: int,
                                  tile_width: int) -> None:
    lin = jnp.arange(shape[0] * shape[1])
    ours = plgpu.planar_snake(lin, shape, minor_dim, tile_width)
    # JAX 0.12's takes one index (it branches with lax.cond); vmap maps it over all of them.
    theirs = jax.vmap(lambda i: jgpu.planar_snake(i, shape, minor_dim, tile_width))(lin)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    visited = {(int(r), int(c)) for r, c in zip(*ours)}  # every point once
    assert visited == {(r, c) for r in range(shape[0]) for c in range(shape[1])}


def test_planar_snake_docstring_order() -> None:
    rows, cols = plgpu.planar_snake(jnp.arange(16), (4, 4), 0, 2)
    order = np.zeros((4, 4), int)
    order[np.asarray(rows), np.asarray(cols)] = np.arange(16)
    np.testing.assert_array_equal(order, [[0, 2, 4, 6], [1, 3, 5, 7], [14, 12, 10, 8],
                                          [15, 13, 11, 9]])


def _snake_copy(backend: str) -> Any:
    """Block b of the (4, 3) grid of (64, 128) blocks copies block planar_snake(b) of x."""
    @functools.partial(plgpu.kernel, out_type=S((256, 384), jnp.float32), grid=(12,),
                       grid_names=("b",), backend=backend)
    def kernel(x_ref: Any, o_ref: Any) -> None:
        r, c = plgpu.planar_snake(lax.axis_index("b"), (4, 3), 1, 2)
        rows, cols = pl.ds(r * 64, 64), pl.ds(c * 128, 128)
        o_ref[rows, cols] = x_ref[rows, cols] * 2.0 + 1.0

    return kernel


def test_planar_snake_in_a_kernel() -> None:
    x = jax.random.normal(jax.random.key(3), (256, 384))
    np.testing.assert_allclose(_snake_copy("interpret")(x), x * 2.0 + 1.0, rtol=1e-6)
    text = jax.jit(_snake_copy("mosaic_gpu")).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # parsed back and verified
    assert inspection.launch(found[1])["grid"] == (12, 1, 1)


def test_kernel_out_type_as_decorator_factory() -> None:
    """JAX's spelling: ``functools.partial(plgpu.kernel, out_type=...)`` with a tuple of
    outputs; the kernel gets one Ref per output and returns a tuple."""
    x = jax.random.normal(jax.random.key(4), (256,))

    @functools.partial(plgpu.kernel, out_type=(S((256,), jnp.float32), S((256,), jnp.float32)),
                       backend="interpret")
    def kernel(x_ref: Any, a_ref: Any, b_ref: Any) -> None:
        a_ref[...] = x_ref[...] + 1.0
        b_ref[...] = x_ref[...] * 3.0

    a, b = kernel(x)
    np.testing.assert_allclose(a, x + 1.0, rtol=1e-6)
    np.testing.assert_allclose(b, x * 3.0, rtol=1e-6)
