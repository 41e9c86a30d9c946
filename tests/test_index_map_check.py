"""The ahead-of-time index-map check: every grid point, whatever the grid's size, evaluated
with numpy (``pallas_core.index_eval``), whose integer semantics must be XLA's."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import grid_mapping as gmap
from pallas_core import index_eval

F32 = jnp.float32


def _copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


def _trace(grid: tuple[int, ...], shape: tuple[int, ...], block: tuple[int, ...],
           in_map: Any, out_map: Any) -> None:
    f = pl.pallas_call(_copy, grid=grid, in_specs=[pl.BlockSpec(block, in_map)],
                       out_specs=pl.BlockSpec(block, out_map),
                       out_shape=jax.ShapeDtypeStruct(shape, F32))
    jax.eval_shape(f, jax.ShapeDtypeStruct(shape, F32))


def test_an_index_past_the_end_of_a_grid_over_a_million_points_is_refused() -> None:
    n = (1 << 20) + 64
    _trace((n,), (n, 8), (1, 8), lambda i: (i, 0), lambda i: (i, 0))  # in bounds
    with pytest.raises(pl.OutOfBoundsError, match=rf"output 0.*grid step \({n - 1},\)"):
        _trace((n,), (n, 8), (1, 8), lambda i: (i, 0), lambda i: (i + 1, 0))


def test_a_huge_grid_is_checked_per_axis_in_little_time() -> None:
    n = 1 << 16  # 2**32 grid points; each index depends on one axis
    start = time.perf_counter()
    _trace((n, n), (n, n), (1, 1), lambda i, j: (i, j), lambda i, j: (n - 1 - i, j))
    with pytest.raises(pl.OutOfBoundsError, match=r"input 0.*grid step \(0, 65535\)"):
        _trace((n, n), (n, n), (1, 1), lambda i, j: (i, j + 1), lambda i, j: (i, j))
    assert time.perf_counter() - start < 20


def test_an_index_of_two_axes_is_checked_on_their_product() -> None:
    # Flattened (i, j) into one dimension: in bounds except at the very last step.
    with pytest.raises(pl.OutOfBoundsError, match=r"grid step \(1023, 2047\)"):
        _trace((1024, 2048), (1 << 21, 4), (1, 4), lambda i, j: (i * 2048 + j, 0),
               lambda i, j: (i * 2048 + j + (i // 1023) * (j // 2047), 0))


def test_an_index_map_numpy_cannot_run_is_checked_with_jax() -> None:
    def cond_map(i: Any) -> tuple[Any, Any]:
        return lax.cond(i < 3000, lambda: i, lambda: i + 1), 0

    with pytest.raises(pl.OutOfBoundsError, match=r"grid step \(4999,\)"):
        _trace((5000,), (5000, 8), (1, 8), lambda i: (i, 0), cond_map)


def test_prefetch_operands_unread_by_an_index_map_do_not_stop_its_check() -> None:
    def kernel(s_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    def call(out_map: Any) -> Any:
        spec = pl.BlockSpec((8,), lambda i, s: (s[i],))
        grid_spec = pl.GridSpec(
            num_scalar_prefetch=1, grid=(4,), in_specs=[spec],
            out_specs=pl.BlockSpec((8,), out_map))
        return pl.pallas_call(kernel, grid_spec=grid_spec,
                              out_shape=jax.ShapeDtypeStruct((32,), F32))

    s = jnp.asarray([3, 2, 1, 0], jnp.int32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(32), F32)
    np.testing.assert_array_equal(np.asarray(call(lambda i, s: (i,))(s, x)),
                                  np.asarray(x.reshape(4, 8)[::-1].reshape(32)))
    with pytest.raises(pl.OutOfBoundsError, match=r"output 0.*grid step \(3,\)"):
        call(lambda i, s: (i + 1,))(s, x)
    # An index map reading the prefetch operand is known only when the kernel runs.
    jax.eval_shape(call(lambda i, s: (s[i] + 1,)), s, x)


_MAPS = {
    "floor_divide": lambda i, j: (i // 7, j // -3),
    "remainder": lambda i, j: (i % 7, j % -3),
    "lax_div_rem": lambda i, j: (lax.div(i, j), lax.rem(i, j)),
    "where_min_max": lambda i, j: (jnp.where(i < j, jnp.maximum(i, -j), jnp.minimum(i, 5)), -j),
    "shifts": lambda i, j: (lax.shift_left(i, j & 31), lax.shift_right_logical(i, j & 31)),
    "arith_shift": lambda i, j: (lax.shift_right_arithmetic(i, j), i ^ j),
    "float": lambda i, j: ((i * 0.37).astype(jnp.int32), jnp.int32(j / 3)),
    "clamp_sign_abs": lambda i, j: (lax.clamp(-5, i, 50), jnp.sign(j) * jnp.abs(i)),
    "wrap": lambda i, j: (i * 1_000_003, (i + 2_000_000_000) + j),
    "pow_bool": lambda i, j: (i ** 3, (i > j).astype(jnp.int32) | (j == 0)),
}


@pytest.mark.parametrize("name", sorted(_MAPS))
def test_numpy_evaluation_agrees_with_jax(name: str) -> None:
    bm = gmap.make_block_mapping(pl.BlockSpec((1, 1), _MAPS[name]),
                                 jax.ShapeDtypeStruct((4, 4), F32), (4, 4), "input 0", "k")
    rng = np.random.default_rng(sorted(_MAPS).index(name))
    i = rng.integers(-2**31, 2**31, 500).astype(np.int32)
    j = np.concatenate([[0, -1, 31, 32, 40, -2**31], rng.integers(-40, 40, 494)]).astype(np.int32)
    i[:3] = [-2**31, 2**31 - 1, 0]
    got = index_eval.evaluate(bm.index_map, [i, j])
    want = jax.jit(jax.vmap(bm.block_indices))(jnp.asarray(i), jnp.asarray(j))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.broadcast_to(g, (500,)), np.asarray(w))


def test_simple_index_maps_are_not_evaluated_with_jax(monkeypatch: Any) -> None:
    # Eager JAX evaluation compiled executables per primitive and grid size, which stayed.
    def refuse(*args: Any) -> None:
        raise AssertionError("evaluated with JAX")

    monkeypatch.setattr(gmap, "_index_values_with_jax", refuse)
    for n in range(300, 340):
        _trace((n, 2), (n, 16), (1, 8), lambda i, j: (i, j),
               lambda i, j, n=n: (jnp.where(i < 0, 0, n - 1 - i), j % 2))


def test_a_squeezed_dimension_of_an_empty_array_is_refused() -> None:
    # It gave the kernel one element of an empty dimension (a raw TypeError in the interpreter).
    f = pl.pallas_call(_copy, out_shape=jax.ShapeDtypeStruct((0, 4), F32),
                       in_specs=[pl.BlockSpec((None, 4), lambda: (0, 0))],
                       out_specs=pl.BlockSpec((None, 4), lambda: (0, 0)))
    with pytest.raises(pl.ArgumentError, match=r"empty along dimension 0.*size 1"):
        f(jnp.zeros((0, 4), F32))
