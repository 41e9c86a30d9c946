"""The interpreter under hostile input (issue 18): no silent wrong result, no raw exception.

Block indices computed from scalar-prefetch operands are checked in every mode (checked mode
at each step, the default once per call over all steps, issue 34); checked mode's reports
reach the caller as the ``PallasError`` itself, also when the callbacks run in the runtime's
threads under ``shard_map``; ``parallel_axes`` must name axes of the grid.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pallas_mosaic_tpu as pltpu
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pallas_interpret import InterpretParams

import pallas_core as pl

CHECKED = InterpretParams(checked=True)


def _gather_rows(params: Any, rows: int, out_rows: int, *, output: bool = False) -> Any:
    """``o[i] = 2 * x[idx[i]]`` by an input index map reading ``idx``; with ``output`` it
    scatters instead: ``o[idx[i]] = 2 * x[i]``."""
    def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2

    by_idx = pl.BlockSpec((1, 8), lambda i, idx: (idx[i], 0))
    by_step = pl.BlockSpec((1, 8), lambda i, idx: (i, 0))
    grid = (rows,) if output else (out_rows,)
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((out_rows, 8), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=[by_step if output else by_idx],
            out_specs=by_idx if output else by_step),
        compiler_params=params, name="gather_rows")


def _random_case(seed: int, rows: int = 6, out_rows: int = 5) -> tuple[Any, np.ndarray, int]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype(np.float32)
    idx = rng.integers(0, rows, out_rows).astype(np.int32)
    return x, idx, int(rng.integers(0, out_rows))


@pytest.mark.parametrize("seed", range(3))
def test_prefetch_block_index_outside_the_array_is_reported(seed: int) -> None:
    x, idx, step = _random_case(seed)
    np.testing.assert_allclose(_gather_rows(CHECKED, 6, 5)(idx, x), 2 * x[idx])
    idx[step] = 6 + seed  # one past the last block, or further
    with pytest.raises(pl.OutOfBoundsError,
                       match=rf"block index \({6 + seed}, 0\) for input 1 \(x_ref\) in kernel "
                             rf"'gather_rows' at grid step \({step},\): its index map "
                             rf"\(.*test_hostile_input\.py:\d+\) .* shape \(6, 8\) \(valid block "
                             r"indices: 0\.\.5, 0\.\.0\)\. The hardware would read or write "
                             r"memory outside it.*Fix: keep"):
        _gather_rows(CHECKED, 6, 5)(idx, x)


def test_negative_prefetch_block_index_of_an_output_is_reported() -> None:
    x, _, _ = _random_case(3, rows=4, out_rows=4)
    idx = np.array([3, 1, -1, 0], np.int32)
    with pytest.raises(pl.OutOfBoundsError, match=r"block index \(-1, 0\) for output 0 "
                                                  r"\(o_ref\).*grid step \(2,\)"):
        _gather_rows(CHECKED, 4, 4, output=True)(idx, x)


@pytest.mark.parametrize("seed", range(3))
def test_unchecked_mode_reports_it_too(seed: int) -> None:
    """Without checked mode the block indices of every step are checked once per call (they
    were clamped back inside the array before; JAX's TPU interpret mode raises)."""
    x, idx, step = _random_case(seed)
    np.testing.assert_allclose(_gather_rows(InterpretParams(), 6, 5)(idx, x), 2 * x[idx])
    bad = [-3, 6, -40][seed]
    idx[step] = bad
    with pytest.raises(pl.OutOfBoundsError,
                       match=rf"block index \({bad}, 0\) for input 1 \(x_ref\) in kernel "
                             rf"'gather_rows' at grid step \({step},\)"):
        _gather_rows(InterpretParams(), 6, 5)(idx, x)
    # The first step that leaves is named.
    idx[:] = 0
    idx[1:] = 7
    with pytest.raises(pl.OutOfBoundsError, match=r"at grid step \(1,\)"):
        _gather_rows(InterpretParams(), 6, 5)(idx, x)


def test_uninitialized_reads_allow_input_blocks_outside() -> None:
    x, idx, step = _random_case(4)
    idx[step] = 9
    params = InterpretParams(checked=True, out_of_bounds_reads="uninitialized")
    out = np.asarray(_gather_rows(params, 6, 5)(idx, x))
    assert np.isnan(out[step]).all()
    keep = np.arange(5) != step
    np.testing.assert_allclose(out[keep], 2 * x[idx[keep]])


# --- reports reach the caller as themselves -------------------------------------------------


def _oob_read() -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 3, 4)]  # step 2 reads [6, 10) of 8

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((3, 4), jnp.float32), grid=(3,),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          out_specs=pl.BlockSpec((None, 4), lambda i: (i, 0)),
                          compiler_params=CHECKED, name="oob_read")


def test_checked_report_is_the_pallas_error_itself(capfd: Any) -> None:
    x = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    with pytest.raises(pl.PallasError, match=r"Out-of-bounds read of input 0 \(x_ref\) in "
                                              r"kernel 'oob_read' at grid step \(2,\)") as info:
        _oob_read()(x)
    assert isinstance(info.value, pl.OutOfBoundsError)
    err = capfd.readouterr().err
    # Only JAX's log of the failed callback; no runtime error, nothing left for exit time.
    assert "JaxRuntimeError" not in err and "Exception ignored" not in err


def test_debug_check_failure_is_the_pallas_error_itself() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.debug_check(jnp.all(x_ref[...] < 0.5), "x must stay below 0.5")
        o_ref[...] = x_ref[...]

    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                        compiler_params=CHECKED)
    x = np.random.default_rng(1).uniform(0, 0.4, 8).astype(np.float32)
    with pl.enable_debug_checks(True):
        np.testing.assert_array_equal(fn(x), x)
    x[3] = 0.9
    with (pl.enable_debug_checks(True),
          pytest.raises(pl.PallasError, match=r"debug_check failed: x must stay below 0\.5")):
        fn(x)


def test_report_under_shard_map_is_the_pallas_error_itself() -> None:
    """Each device's callback runs in a runtime thread; the error still reaches the caller."""
    mesh = jax.make_mesh((8,), ("d",))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    idx = np.tile(rng.permutation(8).astype(np.int32), 8)
    fn = jax.shard_map(lambda i, v: _gather_rows(CHECKED, 8, 8)(i, v), mesh=mesh,
                       in_specs=(P("d"), P("d")), out_specs=P("d"))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("d")))  # noqa: E731
    want = 2 * x.reshape(8, 8, 8)[np.arange(8)[:, None], idx.reshape(8, 8)].reshape(64, 8)
    np.testing.assert_allclose(fn(put(idx), put(x)), want)
    idx[13] = 8  # device 1, step 5
    with pytest.raises(pl.OutOfBoundsError, match=r"block index \(8, 0\).*grid step \(5,\)"):
        fn(put(idx), put(x))
    idx[13] = 3  # the failure is not raised again by later calls
    want = 2 * x.reshape(8, 8, 8)[np.arange(8)[:, None], idx.reshape(8, 8)].reshape(64, 8)
    np.testing.assert_allclose(fn(put(idx), put(x)), want)


# --- parallel axes --------------------------------------------------------------------------


def _copy_rows(params: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + 1

    spec = pl.BlockSpec((2, 8), lambda i, j: (i, 0))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((4, 8), jnp.float32), grid=(2, 3),
                          in_specs=[spec], out_specs=spec, compiler_params=params,
                          name="copy_rows")


@pytest.mark.parametrize("axes", [(2,), (0, 5)])
@pytest.mark.parametrize("checked", [True, False])
def test_parallel_axes_outside_the_grid_are_refused(axes: Any, checked: bool) -> None:
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    params = InterpretParams(checked=checked, parallel_axes=axes)
    shown = re.escape(repr(axes))
    with pytest.raises(pl.PallasError, match=rf"parallel_axes={shown}.*grid axis {axes[-1]} "
                                              r"does not exist: the grid \(2, 3\) of kernel "
                                              r"'copy_rows' has 2 axes \(0\.\.1\).*Fix"):
        _copy_rows(params)(x)


def test_parallel_axes_inside_the_grid_still_find_the_race() -> None:
    x = np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(_copy_rows(InterpretParams(checked=True, parallel_axes=(0,)))(x),
                               x + 1)
    with pytest.raises(pl.PallasError, match=r"data race.*parallel grid axis 1"):
        _copy_rows(InterpretParams(checked=True, parallel_axes=(1,)))(x)
