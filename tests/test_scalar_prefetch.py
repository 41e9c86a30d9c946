"""Scalar prefetch: index maps that choose blocks by data, checked against jax.numpy."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl


def _gather_rows(idx: jax.Array, x: jax.Array) -> jax.Array:
    """Output block i is ``2 * x[idx[i]] + idx[i]``: the input block is chosen by data."""

    def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + idx_ref[pl.program_id(0)].astype(jnp.float32)

    n, rows, cols = idx.shape[0], x.shape[1], x.shape[2]
    grid_spec = pl.GridSpec(
        grid=(n,),
        in_specs=[pl.BlockSpec((None, rows, cols), lambda i, idx_ref: (idx_ref[i], 0, 0))],
        out_specs=pl.BlockSpec((None, rows, cols), lambda i, idx_ref: (i, 0, 0)),
        num_scalar_prefetch=1,
    )
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((n, rows, cols), x.dtype),
                          grid_spec=grid_spec)(idx, x)


def _reference(idx: jax.Array, x: jax.Array) -> jax.Array:
    return x[idx] * 2.0 + idx[:, None, None].astype(jnp.float32)


@pytest.fixture
def data() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((8, 16, 32)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 8, size=6), jnp.int32)
    return idx, x


def test_blocks_chosen_by_prefetched_indices(data: tuple[jax.Array, jax.Array]) -> None:
    idx, x = data
    np.testing.assert_allclose(_gather_rows(idx, x), _reference(idx, x), rtol=1e-6)


def test_under_jit(data: tuple[jax.Array, jax.Array]) -> None:
    idx, x = data
    np.testing.assert_allclose(jax.jit(_gather_rows)(idx, x), _reference(idx, x), rtol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_vmap_over_the_other_operands(data: tuple[jax.Array, jax.Array], axis: int) -> None:
    idx, x = data
    xs = jnp.stack([x, -x, x * 3.0], axis=axis)
    got = jax.vmap(_gather_rows, in_axes=(None, axis), out_axes=axis)(idx, xs)
    want = jax.vmap(_reference, in_axes=(None, axis), out_axes=axis)(idx, xs)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("axes", [(0, None), (1, 0), (0, 2)])
def test_vmap_over_the_prefetch_operand_loops_over_the_batch(
        data: tuple[jax.Array, jax.Array], axes: tuple[int | None, int | None]) -> None:
    """As in JAX, a batched scalar-prefetch operand makes one call per batch element."""
    idx, x = data
    idxs = jnp.stack([idx, idx[::-1], (idx + 3) % 8], axis=axes[0])
    xs = x if axes[1] is None else jnp.stack([x, -x, x * 3.0], axis=axes[1])
    got = jax.jit(jax.vmap(_gather_rows, in_axes=axes))(idxs, xs)
    want = jax.vmap(_reference, in_axes=axes)(idxs, xs)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_index_map_without_the_prefetch_parameter_is_explained() -> None:
    grid_spec = pl.GridSpec(grid=(2,), in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                            out_specs=pl.BlockSpec((4,), lambda i: (i,)), num_scalar_prefetch=1)

    def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    with pytest.raises(pl.BlockSpecError, match=r"scalar-prefetch.*Fix.*scalar-prefetch"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       grid_spec=grid_spec)(jnp.zeros((2,), jnp.int32), jnp.ones((8,)))
