"""Grid and block-dimension forms of JAX 0.10: named grids, dynamic grids, ``pl.Element``,
``pl.Blocked``, ``pl.BoundedSlice``, ``pl.Squeezed``; each checked against jax.numpy and,
where JAX's interpreter runs the form, against ``jax.experimental.pallas`` (interpret=True)."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pallas_mosaic_tpu as pltpu
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from pallas_interpret import InterpretParams

import pallas_core as pl

F32 = jnp.float32
# The exact (step by step) and the default interpreter paths must agree on every form.
PATHS = [pytest.param(True, id="default"), pytest.param(InterpretParams(fast=False), id="exact")]


def _rand(shape: tuple[int, ...], seed: int = 0, dtype: Any = F32) -> jax.Array:
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-100, 100, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _raises(exc: type[Exception], *phrases: str) -> Any:
    return pytest.raises(exc, match="(?s)" + ".*".join(re.escape(p) for p in phrases))


def _close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# --- named grids ---------------------------------------------------------------------------


def _named_grid_kernel(m: Any, x: jax.Array, names: bool, interpret: Any = True) -> jax.Array:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        i, j = m.program_id(0), m.program_id(1)
        o_ref[...] = (x_ref[...] * 2.0 + (10 * i + j).astype(F32)
                      + (m.num_programs(0) * 100 + m.num_programs(1) * 1000))

    grid = (("i", 2), ("j", 3)) if names else (2, 3)
    spec = m.BlockSpec((8, 16), lambda i, j: (i, j))
    return m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
                         in_specs=[spec], out_specs=spec, interpret=interpret)(x)


def _named_grid_reference(x: jax.Array) -> jax.Array:
    step = 10 * jnp.arange(2)[:, None] + jnp.arange(3)[None, :]
    return x * 2.0 + jnp.repeat(jnp.repeat(step, 8, 0), 16, 1) + 3200.0


@pytest.mark.parametrize("interpret", PATHS)
def test_named_grid_matches_jax_and_jnp(interpret: Any) -> None:
    x = _rand((16, 48))
    got = _named_grid_kernel(pl, x, names=True, interpret=interpret)
    _close(got, _named_grid_reference(x))
    _close(got, _named_grid_kernel(jpl, x, names=True))


@pytest.mark.parametrize("interpret", PATHS)
def test_axis_index_of_a_named_grid_is_the_step(interpret: Any) -> None:
    # JAX's own interpreter does not run lax.axis_index on a named grid; jnp is the reference.
    def kernel(x_ref: Any, o_ref: Any) -> None:
        i, j = lax.axis_index("i"), lax.axis_index("j")
        assert lax.axis_size("i") == 4 and lax.axis_size("j") == 2
        o_ref[...] = x_ref[...] + (100 * i + 10 * j + pl.program_id(0)).astype(F32)

    x = _rand((2, 4, 8, 128), 1)
    spec = pl.BlockSpec((None, None, 8, 128), lambda j, i: (j, i, 0, 0))
    got = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(("j", 2), ("i", 4)), in_specs=[spec], out_specs=spec,
                         interpret=interpret)(x)
    j, i = jnp.arange(2)[:, None], jnp.arange(4)[None, :]
    _close(got, x + (100 * i + 10 * j + j).astype(F32)[:, :, None, None])


def test_named_grid_under_vmap() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + lax.axis_index("k").astype(F32)

    def f(x: jax.Array) -> jax.Array:
        spec = pl.BlockSpec((4, 8), lambda k: (k, 0))
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(("k", 3),), in_specs=[spec], out_specs=spec)(x)

    xs = _rand((5, 12, 8), 2)
    _close(jax.vmap(f)(xs), xs + jnp.repeat(jnp.arange(3.0), 4)[None, :, None])


def test_named_pallas_call_grid_is_arbitrary_on_tpu() -> None:
    # Only pl.kernel meshes make their axes parallel; a named grid keeps the default.
    x = _rand((16, 128))
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

    def f(x: jax.Array) -> jax.Array:
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                              jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(("i", 2),),
                              in_specs=[spec], out_specs=spec, backend="mosaic_tpu")(x)

    (stages,) = pl.stages(f, x, backend="mosaic_tpu")
    mosaic = str(stages["mosaic"])
    assert "dimension_semantics<arbitrary>" in mosaic
    assert "dimension_semantics<parallel>" not in mosaic


# --- dynamic grids -------------------------------------------------------------------------


def _accumulate(m: Any, x: jax.Array, n: Any, interpret: Any = True) -> jax.Array:
    """Sums the first ``n`` column blocks of ``x`` (in reverse order, through num_programs in
    the index map), plus ``num_programs`` on every step."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        @m.when(m.program_id(1) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += x_ref[...] + jnp.asarray(m.num_programs(1), F32)

    rows = x.shape[0] // 8
    return m.pallas_call(
        kernel, jax.ShapeDtypeStruct((x.shape[0], 128), x.dtype), grid=(rows, n),
        in_specs=[m.BlockSpec((8, 128), lambda i, k: (i, m.num_programs(1) - 1 - k))],
        out_specs=m.BlockSpec((8, 128), lambda i, k: (i, 0)), interpret=interpret)(x)


def _accumulate_reference(x: jax.Array, n: int) -> jax.Array:
    blocks = x.reshape(x.shape[0], -1, 128)[:, :n]
    return blocks.sum(axis=1) + float(n * n)


@pytest.mark.parametrize("interpret", PATHS)
def test_dynamic_grid_under_jit_with_different_sizes(interpret: Any) -> None:
    x = _rand((16, 128 * 5), 3)
    ours = jax.jit(lambda x, n: _accumulate(pl, x, n, interpret))
    theirs = jax.jit(lambda x, n: _accumulate(jpl, x, n))
    for n in (1, 3, 5):
        got = ours(x, jnp.int32(n))
        _close(got, _accumulate_reference(x, n))
        _close(got, theirs(x, jnp.int32(n)))


def test_dynamic_grid_of_zero_steps_leaves_the_output_unwritten() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.ones_like(o_ref)

    @jax.jit
    def f(x: jax.Array, n: jax.Array) -> jax.Array:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(n,),
                              in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
                              out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
                              input_output_aliases={0: 0})(x)

    x = _rand((8, 128))
    _close(f(x, jnp.int32(2)), jnp.ones_like(x))
    _close(f(x, jnp.int32(0)), x)


def test_dynamic_grid_given_a_concrete_array() -> None:
    x = _rand((8, 128 * 4), 4)
    got = _accumulate(pl, x, jnp.int32(3))
    _close(got, _accumulate_reference(x, 3))
    _close(got, _accumulate(jpl, x, jnp.int32(3)))


def test_num_programs_of_a_dynamic_axis_is_traced() -> None:
    seen: dict[str, Any] = {}

    def kernel(o_ref: Any) -> None:
        seen["static"], seen["dynamic"] = pl.num_programs(0), pl.num_programs(1)
        o_ref[...] = jnp.full(o_ref.shape, pl.num_programs(1), jnp.int32)

    @jax.jit
    def f(n: jax.Array) -> jax.Array:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.int32), grid=(2, n),
                              out_specs=pl.BlockSpec((8, 128), lambda i, j: (0, 0)))()

    np.testing.assert_array_equal(f(jnp.int32(7)), np.full((8, 128), 7))
    assert seen["static"] == 2 and isinstance(seen["static"], int)
    assert isinstance(seen["dynamic"], jax.Array)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_dynamic_grid_under_vmap_of_the_operands(axis: int) -> None:
    def f(x: jax.Array, n: jax.Array) -> jax.Array:
        return _accumulate(pl, x, n)

    xs = jnp.moveaxis(_rand((3, 8, 128 * 4), 5), 0, axis)
    got = jax.jit(jax.vmap(f, in_axes=(axis, None)))(xs, jnp.int32(2))
    _close(got, jax.vmap(lambda x: _accumulate_reference(x, 2), in_axes=axis)(xs))


def test_dynamic_grid_under_vmap_of_the_sizes() -> None:
    x = _rand((8, 128 * 4), 6)
    got = jax.jit(jax.vmap(lambda n: _accumulate(pl, x, n)))(jnp.array([1, 4, 2], jnp.int32))
    _close(got, jnp.stack([_accumulate_reference(x, n) for n in (1, 4, 2)]))


def test_dynamic_grid_with_scalar_prefetch() -> None:
    # Like megablox's gmm: the grid size and the blocks both come from data.
    def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 3.0

    def f(idx: jax.Array, x: jax.Array, n: jax.Array) -> jax.Array:
        spec = pl.GridSpec(
            grid=(n,), num_scalar_prefetch=1,
            in_specs=[pl.BlockSpec((None, 8, 128), lambda i, idx: (idx[i], 0, 0))],
            out_specs=pl.BlockSpec((None, 8, 128), lambda i, idx: (i, 0, 0)))
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid_spec=spec)(idx, x)

    x = _rand((6, 8, 128), 7)
    idx = jnp.array([5, 0, 3, 3, 1, 2], jnp.int32)
    got = jax.jit(f)(idx, x, jnp.int32(4))
    _close(got[:4], x[idx[:4]] * 3.0)


def _grouped_scale(m: Any, meta: tuple[jax.Array, jax.Array], offset: jax.Array,
                   x: jax.Array, n: Any) -> jax.Array:
    """As megablox's gmm calls it: the scalar-prefetch arguments are pytrees (a tuple of
    arrays), an unused operand is None with a None spec, and the grid size is traced."""
    def kernel(meta_ref: Any, offset_ref: Any, x_ref: Any, none_ref: Any, o_ref: Any) -> None:
        assert none_ref is None
        _, scales_ref = meta_ref
        o_ref[...] = x_ref[...] * scales_ref[m.program_id(0)] + offset_ref[0]

    tpu = jpltpu if m is jpl else pltpu
    spec = tpu.PrefetchScalarGridSpec(
        grid=(n,), num_scalar_prefetch=2,
        in_specs=[m.BlockSpec((None, 8, 128), lambda i, meta, off: (meta[0][i], 0, 0)), None],
        out_specs=m.BlockSpec((None, 8, 128), lambda i, meta, off: (i, 0, 0)))
    return m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid_spec=spec,
                         interpret=True)(meta, offset, x, None)


def test_pytree_scalar_prefetch_and_none_operands_with_a_dynamic_grid() -> None:
    x = _rand((5, 8, 128), 17)
    ids = jnp.array([4, 4, 0, 2, 1], jnp.int32)
    scales = jnp.array([3.0, -1.0, 0.5, 2.0, 1.5], F32)
    offset = jnp.array([0.25], F32)
    f = jax.jit(lambda meta, off, x, n: _grouped_scale(pl, meta, off, x, n))
    got = f((ids, scales), offset, x, jnp.int32(5))
    _close(got, x[ids] * scales[:, None, None] + 0.25)
    g = jax.jit(lambda meta, off, x, n: _grouped_scale(jpl, meta, off, x, n))
    _close(got, g((ids, scales), offset, x, jnp.int32(5)))
    _close(f((ids, scales), offset, x, jnp.int32(3))[:3], (x[ids] * scales[:, None, None])[:3]
           + 0.25)


# --- Element ---------------------------------------------------------------------------------


def _element_windows(m: Any, x: jax.Array, padding: tuple[int, int],
                     interpret: Any = True) -> jax.Array:
    """Output row-block i is the sum of the two halves of the 16-row window starting at element
    ``8 * i`` of ``x`` padded by ``padding`` (overlapping windows)."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[pl.ds(0, 8)] + x_ref[pl.ds(8, 8)] * 2.0

    n_out = (x.shape[0] + sum(padding)) // 8 - 1
    return m.pallas_call(
        kernel, jax.ShapeDtypeStruct((n_out * 8, 128), x.dtype), grid=(n_out,),
        in_specs=[m.BlockSpec((m.Element(16, padding), m.Element(128)),
                              lambda i: (i * 8, 0))],
        out_specs=m.BlockSpec((8, 128), lambda i: (i, 0)), interpret=interpret)(x)


def _element_windows_reference(x: jax.Array, padding: tuple[int, int]) -> jax.Array:
    xp = jnp.pad(x, (padding, (0, 0)))
    n_out = xp.shape[0] // 8 - 1
    return jnp.concatenate([xp[8 * i:8 * i + 8] + 2.0 * xp[8 * i + 8:8 * i + 16]
                            for i in range(n_out)])


@pytest.mark.parametrize("interpret", PATHS)
def test_element_windows_overlap(interpret: Any) -> None:
    x = _rand((64, 128), 8)
    got = _element_windows(pl, x, (0, 0), interpret)
    _close(got, _element_windows_reference(x, (0, 0)))
    _close(got, _element_windows(jpl, x, (0, 0)))


@pytest.mark.parametrize("interpret", PATHS)
def test_element_padding_reads_like_jax(interpret: Any) -> None:
    # The padded rows read as JAX's interpreter fills them (NaN): compare NaN positions too.
    x = _rand((56, 128), 9)
    got = _element_windows(pl, x, (3, 5), interpret)
    want = _element_windows(jpl, x, (3, 5))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(np.asarray(got)).any()
    _close(np.nan_to_num(got, nan=7.0), np.nan_to_num(want, nan=7.0))


@pytest.mark.parametrize("dtype", [F32, jnp.int32])
def test_element_padding_fill_value(dtype: Any) -> None:
    def copy(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    def f(m: Any, x: jax.Array) -> jax.Array:
        return m.pallas_call(copy, jax.ShapeDtypeStruct((6,), dtype), grid=(1,),
                             in_specs=[m.BlockSpec((m.Element(6, (1, 2)),), lambda i: (0,))],
                             interpret=True)(x)

    x = _rand((3,), 10, dtype)
    got, want = f(pl, x), f(jpl, x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[1:4], x)


@pytest.mark.parametrize("interpret", PATHS)
def test_element_output_with_padding(interpret: Any) -> None:
    # Output windows in the padded coordinates; the padding is cut off at the end.
    def f(m: Any, x: jax.Array, interpret: Any = True) -> jax.Array:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 2.0 + m.program_id(0).astype(F32)

        return m.pallas_call(
            kernel, jax.ShapeDtypeStruct((14, 128), x.dtype), grid=(2,),
            in_specs=[m.BlockSpec((8, 128), lambda i: (i, 0))],
            out_specs=m.BlockSpec((m.Element(8, (0, 2)), m.Element(128)),
                                  lambda i: (8 * i, 0)), interpret=interpret)(x)

    x = _rand((16, 128), 11)
    got = f(pl, x, interpret)
    _close(got, x[:14] * 2.0 + (jnp.arange(14) >= 8)[:, None].astype(F32))
    _close(got, f(jpl, x))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_element_with_vmap(axis: int) -> None:
    xs = jnp.moveaxis(_rand((3, 64, 128), 12), 0, axis)
    got = np.asarray(jax.vmap(lambda x: _element_windows(pl, x, (2, 6)), in_axes=axis)(xs))
    theirs = np.asarray(jax.vmap(lambda x: _element_windows(jpl, x, (2, 6)), in_axes=axis)(xs))
    want = np.asarray(jax.vmap(lambda x: _element_windows_reference(x, (2, 6)),
                               in_axes=axis)(xs))
    finite = ~np.isnan(got)
    np.testing.assert_array_equal(finite, ~np.isnan(theirs))
    assert not finite.all()
    _close(got[finite], want[finite])


# --- Blocked and squeezed dimensions ----------------------------------------------------


def _blocked(m: Any, x: jax.Array, interpret: Any = True) -> jax.Array:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.sin(x_ref[...]) + m.program_id(1).astype(F32)

    block = (m.Blocked(8), None, m.Squeezed(), 32)
    spec = m.BlockSpec(block, lambda i, j, k: (i, j, k, 0))
    return m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(3, x.shape[1], x.shape[2]), in_specs=[spec], out_specs=spec,
                         interpret=interpret)(x)


@pytest.mark.parametrize("interpret", PATHS)
def test_blocked_none_and_squeezed_with_edge_blocks(interpret: Any) -> None:
    x = _rand((20, 3, 2, 32), 13)  # 20 rows in blocks of 8: the last block is partial
    got = _blocked(pl, x, interpret)
    _close(got, jnp.sin(x) + jnp.arange(3.0)[None, :, None, None])
    _close(got, _blocked(jpl, x))


def test_blocked_equals_int_block_size() -> None:
    assert pl.Blocked(8) == pl.Blocked(np.int64(8))
    assert pl.squeezed == pl.Squeezed()
    x = _rand((16, 128), 14)
    outs = []
    for block in [(8, 128), (pl.Blocked(8), pl.Blocked(128))]:
        spec = pl.BlockSpec(block, lambda i: (i, 0))
        outs.append(pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
                                   jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                                   in_specs=[spec], out_specs=spec)(x))
    _close(outs[0], x + 1)
    _close(outs[1], x + 1)


# --- BoundedSlice ----------------------------------------------------------------------------


def _ragged_scale(x: jax.Array, starts: jax.Array, sizes: jax.Array,
                  interpret: Any = True) -> jax.Array:
    """Group g (rows ``starts[g]:starts[g] + sizes[g]``, at most 8) is scaled by ``g + 2``;
    rows in no group keep their value (the output aliases ``x``)."""
    def kernel(starts_ref: Any, sizes_ref: Any, x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        g = pl.program_id(0)
        rows = lax.broadcasted_iota(jnp.int32, (8, 128), 0)
        # Rows past the slice are undefined on read, and dropped on write.
        o_ref[...] = jnp.where(rows < sizes_ref[g], x_ref[...], 0.0) * (g + 2).astype(F32)

    spec = pl.BlockSpec((pl.BoundedSlice(8), 128),
                        lambda g, starts, sizes: (pl.ds(starts[g], sizes[g]), 0))
    grid_spec = pl.GridSpec(grid=(starts.shape[0],), num_scalar_prefetch=2,
                            in_specs=[spec, pl.BlockSpec(memory_space=pl.ANY)],
                            out_specs=spec)
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid_spec=grid_spec,
                          input_output_aliases={3: 0}, interpret=interpret)(
                              starts, sizes, x, x)


@pytest.mark.parametrize("interpret", PATHS)
def test_bounded_slices_read_and_write_only_their_rows(interpret: Any) -> None:
    x = _rand((40, 128), 15)
    starts = jnp.array([0, 5, 13, 21, 36], jnp.int32)
    sizes = jnp.array([5, 8, 3, 8, 4], jnp.int32)
    got = _ragged_scale(x, starts, sizes, interpret)
    want = np.asarray(x).copy()
    for g, (s, n) in enumerate(zip(starts.tolist(), sizes.tolist())):
        want[s:s + n] *= g + 2
    _close(got, want)


def test_bounded_slice_with_static_index_map() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[pl.ds(0, 6)] = x_ref[pl.ds(0, 6)] + 1.0

    x = _rand((30, 128), 16)
    got = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((5, 6, 128), x.dtype), grid=(5,),
        in_specs=[pl.BlockSpec((pl.BoundedSlice(8), 128), lambda i: (pl.ds(6 * i, 6), 0))],
        out_specs=pl.BlockSpec((None, pl.BoundedSlice(8), 128),
                               lambda i: (i, pl.ds(0, 6), 0)))(x)
    _close(got, (x + 1.0).reshape(5, 6, 128))


# --- misuse ----------------------------------------------------------------------------------


def _copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


@pytest.mark.parametrize(("grid", "phrases"), [
    ((("i", 2), 3), ["mixes named and unnamed axes", "Fix: name every axis"]),
    ((("i", 2), ("i", 3)), ["names an axis twice"]),
    (((2, "i"),), ["mixes named and unnamed axes"]),
    ((2.0,), ["grid sizes must be non-negative ints or integer JAX scalars"]),
    ((jnp.float32(2),), ["expected an integer scalar", "jnp.int32(n)"]),
    ((jnp.zeros((2,), jnp.int32),), ["dynamic size of shape (2,)"]),
], ids=["mixed", "duplicate", "name_second", "float", "float_array", "vector"])
def test_malformed_grids(grid: Any, phrases: list[str]) -> None:
    with _raises(pl.BlockSpecError, *phrases):
        pl.pallas_call(_copy, jax.ShapeDtypeStruct((8,), F32), grid=grid)


def test_named_dynamic_grid_is_refused() -> None:
    with _raises(pl.UnsupportedError, "named grid ('i',) has dynamic sizes", "Fix:"):
        pl.pallas_call(_copy, jax.ShapeDtypeStruct((8,), F32), grid=(("i", jnp.int32(2)),))


@pytest.mark.parametrize(("make", "phrases"), [
    (lambda: pl.Element(8, 2), ["padding must be a pair (low, high)", "Fix:"]),
    (lambda: pl.Element(8, (1, -1)), ["non-negative ints"]),
    (lambda: pl.Element(0), ["block size must be an int >= 1"]),
    (lambda: pl.BoundedSlice(2.5), ["BoundedSlice(block_size=2.5)"]),
    (lambda: pl.Blocked(-1), ["Blocked(block_size=-1)"]),
])
def test_malformed_block_dims(make: Any, phrases: list[str]) -> None:
    with _raises(pl.BlockSpecError, *phrases):
        make()


@pytest.mark.parametrize(("block", "index_map", "exc", "phrases"), [
    ((pl.BoundedSlice(8), 128), lambda i: (i, 0), pl.BlockSpecError,
     ["returned", "for dimension 0, whose block dimension is BoundedSlice(8)",
      "expected pl.ds(start, size)"]),
    ((8, 128), lambda i: (pl.ds(i, 8), 0), pl.BlockSpecError,
     ["only pl.BoundedSlice dimensions take a pl.ds(start, size)", "pl.BoundedSlice(8)"]),
    ((pl.BoundedSlice(8), 128), lambda i: (pl.ds(i, 9), 0), pl.BlockSpecError,
     ["the size must lie in 0..8"]),
    ((pl.BoundedSlice(8), 128), lambda i: (pl.ds(i, 4, 2), 0), pl.UnsupportedError,
     ["strided slice"]),
    ((pl.Element(8), 128), lambda i: (40 * i, 0), pl.OutOfBoundsError,
     ["element offset 40", "input 0 (x_ref)", "grid step (1,)", "offset in 0..31"]),
    ((pl.Element(8, (2, 2)), 128), lambda i: (i - 1, 0), pl.OutOfBoundsError,
     ["element offset -1", "grid step (0,)", "offset in 0..35"]),
    ((pl.BoundedSlice(8), 128), lambda i: (pl.ds(28 * i, 8), 0), pl.OutOfBoundsError,
     ["pl.ds(28, 8)", "grid step (1,)", "start + size <= 32"]),
], ids=["int_for_bounded", "slice_for_blocked", "slice_too_big", "strided", "element_past_end",
        "element_negative", "slice_past_end"])
def test_index_map_misuse(block: Any, index_map: Any, exc: type[Exception],
                          phrases: list[str]) -> None:
    x = _rand((32, 128))
    call = pl.pallas_call(_copy, jax.ShapeDtypeStruct((2, 8, 128), F32), grid=(2,),
                          in_specs=[pl.BlockSpec(block, index_map)],
                          out_specs=pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0)))
    with _raises(exc, *phrases):
        call(x)


_FORMS = {
    "element": ["input 0 (x_ref) has block dimension Element(8)", "does not support"],
    "bounded": ["has block dimension BoundedSlice(8)", "does not support"],
    "dynamic": ["has dynamic sizes", "does not support", "backend='interpret'"],
}
_LOWERS = {("mosaic_tpu", "dynamic")}
"""Forms a backend lowers (Mosaic TPU takes dynamic grids, as JAX's TPU library's megablox
needs; tests/jax_library/test_tpu_library_lowering.py compares that with JAX's lowering)."""


@pytest.mark.parametrize(("backend", "form", "phrases"), [
    (b, f, p) for b in ("mosaic_tpu", "triton", "xla_unrolled") for f, p in _FORMS.items()
    if (b, f) not in _LOWERS])
def test_backends_without_the_form_refuse_it(backend: str, form: str,
                                             phrases: list[str]) -> None:
    x = _rand((16, 128))
    grid: Any = (2,)
    index_map: Any = lambda i: (i, 0)  # noqa: E731
    block: Any = (8, 128)
    if form == "element":
        block, index_map = (pl.Element(8), 128), lambda i: (8 * i, 0)
    elif form == "bounded":
        block, index_map = (pl.BoundedSlice(8), 128), lambda i: (pl.ds(8 * i, 8), 0)
    else:
        grid = (jnp.int32(2),)
    call = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
                          in_specs=[pl.BlockSpec(block, index_map)],
                          out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend)
    with _raises(pl.UnsupportedError, *phrases[:1], f"which backend {backend!r}", *phrases[1:]):
        call(x)


def test_pipelines_refuse_element_dims() -> None:
    from pallas_mosaic_tpu import emit_pipeline

    def kernel(x_hbm: Any, o_hbm: Any) -> None:
        emit_pipeline(lambda x, o: None, grid=(2,),
                      in_specs=[pl.BlockSpec((pl.Element(8), 128), lambda i: (8 * i, 0))],
                      out_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))])(x_hbm, o_hbm)

    x = _rand((16, 128))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    with _raises(pl.UnsupportedError, "Element(8) is not supported here"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[any_spec],
                       out_specs=any_spec, interpret=True)(x)
