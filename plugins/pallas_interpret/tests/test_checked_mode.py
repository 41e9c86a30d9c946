"""The interpreter's checked mode (``InterpretParams(checked=True)``): poisoned uninitialised
memory, out-of-bounds accesses reported at run time, races between parallel grid steps found
ahead of time; and ``shuffle_seed``, which runs parallel steps in a shuffled order."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from pallas_interpret import InterpretParams
from pallas_interpret.checks import RaceError

import pallas_core as pl
from pallas_core.errors import PallasError

CHECKED = InterpretParams(checked=True)
INT_MIN = np.iinfo(np.int32).min
WHOLE = pl.BlockSpec(memory_space=pl.ANY)
DTYPES = [np.float32, np.int32]


def _poison(dtype: Any) -> Any:
    return np.nan if np.issubdtype(dtype, np.floating) else INT_MIN


def _run(fn: Any, *args: Any) -> Any:
    out = fn(*args)
    jax.block_until_ready(out)
    jax.effects_barrier()
    return out


# --- poisoned memory -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_uninitialised_output_read_is_poisoned(dtype: Any) -> None:
    """Reading an output block before writing it shows poison in checked mode; what the kernel
    defines is the same in both modes."""

    def kernel(x_ref: Any, o_ref: Any, seen_ref: Any) -> None:
        seen_ref[...] = o_ref[...]  # read before any write: uninitialised
        o_ref[...] = x_ref[...] * 2

    x = np.arange(24).reshape(3, 8).astype(dtype)
    row = pl.BlockSpec((None, 8), lambda i: (i, 0))

    def f(params: Any) -> Any:
        shape = jax.ShapeDtypeStruct(x.shape, dtype)
        return pl.pallas_call(kernel, (shape, shape), grid=(3,), in_specs=[row],
                              out_specs=(row, row), compiler_params=params)

    out, seen = _run(f(CHECKED), x)
    np.testing.assert_array_equal(out, x * 2)
    np.testing.assert_array_equal(seen, np.full(x.shape, _poison(dtype), dtype))
    out, _ = _run(f(None), x)
    np.testing.assert_array_equal(out, x * 2)
    out, _ = _run(f(InterpretParams(fast=False)), x)
    np.testing.assert_array_equal(out, x * 2)


def test_params_passed_as_interpret_are_honoured() -> None:
    """``interpret=InterpretParams(checked=True)`` (JAX's spelling) turns checked mode on as
    ``compiler_params=`` does; with ``interpret=True`` unwritten memory reads as JAX's
    interpret mode fills it (NaN), and ``uninitialized_memory="zero"`` makes it zeros."""

    def kernel(o_ref: Any, seen_ref: Any) -> None:
        seen_ref[...] = o_ref[...]
        o_ref[...] = jnp.ones_like(o_ref)

    shape = jax.ShapeDtypeStruct((8,), jnp.float32)
    _, seen = _run(pl.pallas_call(kernel, (shape, shape), interpret=CHECKED))
    assert np.isnan(np.asarray(seen)).all()
    _, seen = _run(pl.pallas_call(kernel, (shape, shape), interpret=True))
    assert np.isnan(np.asarray(seen)).all()
    zero = InterpretParams(uninitialized_memory="zero")
    _, seen = _run(pl.pallas_call(kernel, (shape, shape), interpret=zero))
    np.testing.assert_array_equal(seen, np.zeros(8, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unwritten_output_blocks_and_edge_padding_are_poisoned(dtype: Any) -> None:
    """Output blocks that no grid step writes, and the padding of an input's partial edge block
    (copied to a larger output), are poison in checked mode."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    x = np.arange(1, 6).astype(dtype)  # blocks of 4: the second is partial
    spec = pl.BlockSpec((4,), lambda i: (i,))
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((12,), dtype), grid=(2,),
                       in_specs=[spec], out_specs=spec, compiler_params=CHECKED)
    want = np.full((12,), _poison(dtype), dtype)
    want[:5] = x
    np.testing.assert_array_equal(_run(f, x), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scratch_is_poisoned(dtype: Any) -> None:
    """Scratch read before the first write is poison in checked mode; later steps see what the
    previous step stored, in both modes."""

    def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
        o_ref[...] = s_ref[...] + x_ref[...]
        s_ref[...] = x_ref[...]

    x = np.arange(32).reshape(4, 8).astype(dtype)
    row = pl.BlockSpec((None, 8), lambda i: (i, 0))

    def f(params: Any) -> Any:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, dtype), grid=(4,),
                              in_specs=[row], out_specs=row, compiler_params=params,
                              scratch_shapes=[jax.ShapeDtypeStruct((8,), dtype)])

    defined = x[1:] + x[:-1]
    checked = _run(f(CHECKED), x)
    np.testing.assert_array_equal(checked[1:], defined)
    if dtype == np.float32:
        assert np.isnan(checked[0]).all()
    else:  # poison + x: int min plus a small non-negative value, wrapped like int32
        np.testing.assert_array_equal(checked[0], (INT_MIN + x[0]).astype(dtype))
    np.testing.assert_array_equal(_run(f(None), x)[1:], defined)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scratch_read_directly_is_poison(dtype: Any) -> None:
    def kernel(o_ref: Any, s_ref: Any) -> None:
        o_ref[...] = s_ref[...]

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 8), dtype), grid=(1,),
                       out_specs=pl.BlockSpec((2, 8), lambda i: (0, 0)),
                       scratch_shapes=[pl.ANY((2, 8), dtype)], compiler_params=CHECKED)
    np.testing.assert_array_equal(_run(f), np.full((2, 8), _poison(dtype), dtype))


# --- out-of-bounds accesses ----------------------------------------------------------------------


def _oob_read(params: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 3, 4)]  # step 2 reads [6, 10) of 8

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((3, 4), jnp.float32), grid=(3,),
                          in_specs=[WHOLE], out_specs=pl.BlockSpec((None, 4), lambda i: (i, 0)),
                          compiler_params=params, name="oob_read")


def _oob_write(params: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[pl.ds(pl.program_id(1) + 3, 2)] = x_ref[...]  # step (*, 2) writes [5, 7) of 6

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 6), jnp.float32), grid=(2, 3),
                          in_specs=[pl.BlockSpec((None, 2), lambda i, j: (i, 0))],
                          out_specs=pl.BlockSpec((None, 6), lambda i, j: (i, 0)),
                          compiler_params=params, name="oob_write")


def test_out_of_bounds_read_is_reported() -> None:
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(pl.OutOfBoundsError, match=r"Out-of-bounds read of input 0 \(x_ref\) in "
                       r"kernel "
                       r"'oob_read' at grid step \(2,\): index starting at \(6,\) with sizes "
                       r"\(4,\) does not fit in the Ref's shape \(8,\)"):
        _run(_oob_read(CHECKED), x)


def test_out_of_bounds_write_is_reported() -> None:
    x = np.ones((2, 2), np.float32)
    with pytest.raises(pl.OutOfBoundsError, match=r"Out-of-bounds write to output 0 \(o_ref\) "
                       r"in kernel "
                       r"'oob_write' at grid step \(0, 2\): index starting at \(5,\)"):
        _run(_oob_write(CHECKED), x)


def test_out_of_bounds_in_jit_is_reported() -> None:
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(Exception, match=r"input 0 \(x_ref\).*grid step \(2,\).*\(6,\)"):
        _run(jax.jit(_oob_read(CHECKED)), x)


def _oob_scratch_write() -> Any:
    def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
        s_ref[pl.ds(pl.program_id(0), 4)] = x_ref[...]  # step 1 writes [1, 5) of 4
        o_ref[...] = s_ref[...]

    row = pl.BlockSpec((None, 4), lambda i: (i, 0))
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 4), jnp.float32), grid=(2,),
                       in_specs=[row], out_specs=row, compiler_params=CHECKED,
                       scratch_shapes=[pl.ANY((4,), jnp.float32)])
    return f, np.ones((2, 4), np.float32)


def _oob_scalar_index() -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[pl.program_id(0) + 1]  # step 1 reads row 2 of a (2, 4) block

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 4), jnp.float32), grid=(2,),
                       in_specs=[pl.BlockSpec((2, 4), lambda i: (0, 0))],
                       out_specs=pl.BlockSpec((None, 4), lambda i: (i, 0)),
                       compiler_params=CHECKED)
    return f, np.ones((2, 4), np.float32)


def _oob_negative_start() -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[pl.ds(pl.program_id(0) - 1, 4)]  # step 0 starts at -1

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 4), jnp.float32), grid=(2,),
                       in_specs=[WHOLE], out_specs=pl.BlockSpec((None, 4), lambda i: (i, 0)),
                       compiler_params=CHECKED)
    return f, np.ones((8,), np.float32)


def _oob_under_vmap() -> Any:
    return jax.vmap(_oob_read(CHECKED)), np.ones((2, 8), np.float32)


@pytest.mark.parametrize(("make", "message"), [
    (_oob_scratch_write, r"write to scratch 0 .* grid step \(1,\): index starting at \(1,\)"),
    (_oob_scalar_index, r"read of input 0 \(x_ref\) .* grid step \(1,\): index starting at "
     r"\(2, 0\) with sizes \(1, 4\) does not fit in the Ref's shape \(2, 4\)"),
    (_oob_negative_start, r"input 0 \(x_ref\) .* grid step \(0,\): index starting at \(-1,\)"),
    (_oob_under_vmap, r"input 0 \(x_ref\) .* grid step \(2,\): index starting at \(6,\)"),
], ids=["scratch_write", "scalar_index", "negative_start", "vmap"])
def test_out_of_bounds_kinds_are_reported(make: Any, message: str) -> None:
    fn, x = make()
    with pytest.raises(Exception, match=message):
        _run(fn, x)


def test_out_of_bounds_unchecked_does_not_raise() -> None:
    _run(_oob_read(None), np.arange(8, dtype=np.float32))
    _run(_oob_write(InterpretParams(fast=False)), np.ones((2, 2), np.float32))


def test_in_bounds_accesses_are_not_reported() -> None:
    """Slices that end exactly at the end of the Ref, and scalar indices, are fine."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        i = pl.program_id(0)
        o_ref[pl.ds(0, 1)] = x_ref[pl.ds(i * 2, 2)][1:] + x_ref[7]

    x = np.arange(8, dtype=np.float32)
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.float32), grid=(4,),
                       in_specs=[WHOLE], out_specs=pl.BlockSpec((1,), lambda i: (i,)),
                       compiler_params=CHECKED)
    np.testing.assert_array_equal(_run(f, x), x[1::2] + 7)


def test_masked_load_past_the_end_is_not_reported() -> None:
    """``pl.load``/``pl.store`` with a mask may reach past the end of a Ref."""
    n, block = 10, 4

    def kernel(x_ref: Any, o_ref: Any) -> None:
        start = pl.program_id(0) * block
        mask = start + lax.broadcasted_iota(jnp.int32, (block,), 0) < n
        v = pl.load(x_ref, (pl.ds(start, block),), mask=mask, other=-1.0)
        pl.store(o_ref, (pl.ds(start, block),), v * 2.0, mask=mask)

    x = np.arange(n, dtype=np.float32)
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((n,), jnp.float32), grid=(pl.cdiv(n, block),),
                       in_specs=[WHOLE], out_specs=WHOLE, compiler_params=CHECKED)
    np.testing.assert_array_equal(_run(f, x), x * 2.0)


# --- races -------------------------------------------------------------------------------------


def _accumulate(params: Any, grid: tuple[int, int] = (2, 3), reduce_axis: int = 1) -> Any:
    """Sums the columns of blocks over the ``reduce_axis`` of the grid into one output block
    per step of the other axis."""
    keep = 1 - reduce_axis

    def kernel(x_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(reduce_axis) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        o_ref[...] += x_ref[...]

    def x_map(*ids: Any) -> tuple[Any, Any]:
        return ids[keep], ids[reduce_axis]

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 4), jnp.float32), grid=grid,
                          in_specs=[pl.BlockSpec((4, 4), x_map)],
                          out_specs=pl.BlockSpec((4, 4), lambda *ids: (ids[keep], 0)),
                          compiler_params=params, name="acc")


X_ACC = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
WANT_ACC = X_ACC.reshape(8, 3, 4).sum(1)


def test_race_on_revisited_output_is_reported() -> None:
    params = InterpretParams(checked=True, parallel_axes="all")
    with pytest.raises(RaceError, match=r"data race in kernel 'acc': output 0 \(o_ref\) block "
                       r"\(0, 0\) is written at grid steps \(0, 0\) and \(0, 1\), which differ "
                       r"along parallel grid axis 1"):
        _run(_accumulate(params), X_ACC)
    assert issubclass(RaceError, PallasError)


@pytest.mark.parametrize("axes", [(1,), (0, 1), "all"])
def test_race_along_the_revisited_axis(axes: Any) -> None:
    params = InterpretParams(checked=True, parallel_axes=axes)
    with pytest.raises(RaceError, match="parallel grid axis 1"):
        _run(_accumulate(params), X_ACC)


@pytest.mark.parametrize("axes", [(), (0,), None])
def test_no_race_when_only_the_kept_axis_is_parallel(axes: Any) -> None:
    """Axis 0 gives every step its own output block (axes past the grid are refused:
    test_hostile_input.py)."""
    params = InterpretParams(checked=True, parallel_axes=axes)
    np.testing.assert_array_equal(_run(_accumulate(params), X_ACC), WANT_ACC)


def test_race_depends_on_which_axis_revisits() -> None:
    """On a (k, i) grid, where axis 0 revisits, parallel_axes=(1,) is fine and (0,) races."""
    fine = InterpretParams(checked=True, parallel_axes=(1,))
    np.testing.assert_array_equal(_run(_accumulate(fine, (3, 2), 0), X_ACC), WANT_ACC)
    racy = InterpretParams(checked=True, parallel_axes=(0,))
    with pytest.raises(RaceError, match="parallel grid axis 0"):
        _run(_accumulate(racy, (3, 2), 0), X_ACC)


@pytest.mark.parametrize("fast", [True, False])
def test_no_race_check_without_checked(fast: bool) -> None:
    params = InterpretParams(parallel_axes="all", fast=fast)
    np.testing.assert_array_equal(_run(_accumulate(params), X_ACC), WANT_ACC)


def test_vmap_batch_axis_is_parallel_without_race() -> None:
    """vmap adds a parallel grid axis that every output follows: no race; user axes keep
    their numbers in parallel_axes."""
    xs = np.stack([X_ACC, -X_ACC])
    ok = InterpretParams(checked=True, parallel_axes=(0,))
    np.testing.assert_array_equal(_run(jax.vmap(_accumulate(ok)), xs),
                                  np.stack([WANT_ACC, -WANT_ACC]))
    racy = InterpretParams(checked=True, parallel_axes=(1,))
    with pytest.raises(RaceError, match="parallel grid axis 1"):
        _run(jax.vmap(_accumulate(racy)), xs)


class _Semantics(enum.Enum):
    PARALLEL = "parallel"
    ARBITRARY = "arbitrary"
    CORE_PARALLEL = "core_parallel"


@dataclasses.dataclass(frozen=True)
class _OtherParams:
    """Another backend's params, as Mosaic TPU's: only ``dimension_semantics`` matters."""

    dimension_semantics: tuple[Any, ...] | None = None


@pytest.mark.parametrize(("semantics", "grid", "want"), [
    (("parallel", "arbitrary"), (2, 3), (0,)),
    (("arbitrary", "parallel"), (2, 3), (1,)),
    (("PARALLEL", "parallel", "arbitrary"), (2, 3, 4), (0, 1)),
    ((_Semantics.PARALLEL, _Semantics.ARBITRARY, _Semantics.CORE_PARALLEL), (2, 3, 4), (0, 2)),
    (None, (2, 3), ()),
])
def test_parallel_axes_from_dimension_semantics(semantics: Any, grid: Any, want: Any) -> None:
    other = _OtherParams(semantics)
    assert InterpretParams().resolved_parallel_axes(grid, other) == want
    assert InterpretParams(checked=True).resolved_parallel_axes(grid, other) == want


def test_explicit_parallel_axes_override_dimension_semantics() -> None:
    other = _OtherParams(("parallel", "arbitrary"))
    assert InterpretParams(parallel_axes=(1,)).resolved_parallel_axes((2, 3), other) == (1,)
    assert InterpretParams(parallel_axes=()).resolved_parallel_axes((2, 3), other) == ()
    assert InterpretParams(parallel_axes="all").resolved_parallel_axes((2, 3, 4), other) == (
        0, 1, 2)
    with pytest.raises(PallasError, match=r"grid axis 3 does not exist: the grid \(2, 3\) has 2"):
        InterpretParams(parallel_axes=(0, 3)).resolved_parallel_axes((2, 3), None)
    assert InterpretParams().resolved_parallel_axes((2, 3), None) == ()
    assert InterpretParams().resolved_parallel_axes((2, 3), object()) == ()


@pytest.mark.parametrize("axes", ["x", "ALL", [0, 1], (-1,), (0.5,), ("0",), 1])
def test_invalid_parallel_axes_rejected(axes: Any) -> None:
    with pytest.raises(PallasError, match=r"parallel_axes=.*expected a tuple of grid axes"):
        InterpretParams(parallel_axes=axes)


# --- shuffled order ----------------------------------------------------------------------------


def _last_step_wins(params: Any) -> Any:
    """Every step writes the same output block: the result is the last step's."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * pl.program_id(0).astype(jnp.float32)

    spec = pl.BlockSpec((8,), lambda i: (0,))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=(6,),
                          in_specs=[spec], out_specs=spec, compiler_params=params)


def _order_independent(params: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + pl.program_id(0) * 10.0 + pl.program_id(1)

    spec = pl.BlockSpec((2, 4), lambda i, j: (i, j))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 12), jnp.float32), grid=(4, 3),
                          in_specs=[spec], out_specs=spec, compiler_params=params)


X8 = np.arange(1, 9, dtype=np.float32)
SEEDS = range(6)


def test_shuffle_exposes_order_dependence() -> None:
    np.testing.assert_array_equal(_run(_last_step_wins(None), X8), X8 * 5)
    results = {tuple(np.asarray(_run(_last_step_wins(
        InterpretParams(parallel_axes="all", shuffle_seed=s)), X8)).tolist()) for s in SEEDS}
    assert len(results) > 1
    # Every result is some step's: x times a program id.
    assert results <= {tuple((X8 * i).tolist()) for i in range(6)}


def test_shuffle_is_deterministic_per_seed() -> None:
    params = InterpretParams(parallel_axes=(0,), shuffle_seed=3)
    np.testing.assert_array_equal(_run(_last_step_wins(params), X8),
                                  _run(_last_step_wins(params), X8))


def test_shuffle_without_parallel_axes_keeps_order() -> None:
    for s in SEEDS:
        out = _run(_last_step_wins(InterpretParams(shuffle_seed=s)), X8)
        np.testing.assert_array_equal(out, X8 * 5)


@pytest.mark.parametrize("axes", ["all", (0,), (1,)])
def test_shuffle_keeps_order_independent_results(axes: Any) -> None:
    x = np.arange(96, dtype=np.float32).reshape(8, 12)
    want = x * 2.0 + np.repeat(np.arange(4) * 10.0, 2)[:, None] + np.repeat(np.arange(3), 4)
    for s in SEEDS:
        out = _run(_order_independent(InterpretParams(parallel_axes=axes, shuffle_seed=s)), x)
        np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(_run(_order_independent(None), x), want)


def test_shuffled_accumulation_along_sequential_axis() -> None:
    """Shuffling the parallel axis of an accumulating kernel keeps its result; checked mode
    agrees, with no race."""
    for s in SEEDS:
        for checked in (False, True):
            params = InterpretParams(checked=checked, parallel_axes=(0,), shuffle_seed=s)
            np.testing.assert_array_equal(_run(_accumulate(params), X_ACC), WANT_ACC)


def test_checked_shuffle_of_order_dependent_kernel_races() -> None:
    params = InterpretParams(checked=True, parallel_axes="all", shuffle_seed=0)
    with pytest.raises(RaceError, match=r"block \(0,\) is written at grid steps \(0,\) and "
                       r"\(1,\)"):
        _run(_last_step_wins(params), X8)
