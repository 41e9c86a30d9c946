"""``jax.vmap`` of TPU kernels batches in place, as JAX does: each operand stays where it is,
its BlockSpec gains a squeezed dimension at the batched axis, and the batch is a new leading
"parallel" grid axis. Checked three ways: results in the interpreter against ``jax.numpy``; no
``stablehlo.transpose`` around a kernel vmapped over a non-leading axis; and the TPU module
agrees with JAX's (``inspection.assert_same_kernel``: grid, window shapes, dimension semantics,
every index map at every grid point), with and without scalar prefetch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

F32 = jnp.float32
B = 3  # the batch size
AXES = (0, 1, -1)


def _tpu(m: Any) -> Any:
    return pltpu if m is pl else jax_pltpu


def scaled_add(m: Any, **kw: Any) -> Callable[..., Any]:
    """``2 x + y`` on (2, 16, 256) arrays in (8, 128) blocks of each leading slice, on a
    (2, 2, 2) grid with user dimension semantics (vmap adds a "parallel" axis in front)."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + y_ref[...]

    spec = m.BlockSpec((None, 8, 128), lambda s, i, j: (s, i, j))
    params = _tpu(m).CompilerParams(dimension_semantics=("parallel", "arbitrary", "parallel"))
    return lambda x, y: m.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2, 2, 2), in_specs=[spec, spec],
        out_specs=spec, compiler_params=params, **kw)(x, y)


def gather(m: Any, **kw: Any) -> Callable[..., Any]:
    """Output block i is ``2 * x[idx[i]] + idx[i]``: blocks chosen by prefetched data."""
    def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + idx_ref[m.program_id(0)].astype(F32)

    spec_in = m.BlockSpec((None, 8, 128), lambda i, idx_ref: (idx_ref[i], 0, 0))
    spec_out = m.BlockSpec((None, 8, 128), lambda i, idx_ref: (i, 0, 0))
    grid_spec = _tpu(m).PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(4,),
                                               in_specs=[spec_in], out_specs=spec_out)
    return lambda idx, x: m.pallas_call(
        kernel, jax.ShapeDtypeStruct((4, 8, 128), x.dtype), grid_spec=grid_spec, **kw)(idx, x)


def _scaled_add_reference(x: jax.Array, y: jax.Array) -> jax.Array:
    return x * 2.0 + y


def _gather_reference(idx: jax.Array, x: jax.Array) -> jax.Array:
    return x[idx] * 2.0 + idx[:, None, None].astype(F32)


def _rand(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


def _batched(x: jax.Array, axis: int | None, seed: int) -> jax.Array:
    """``B`` random variants of ``x`` stacked along ``axis`` (``x`` itself for ``None``)."""
    if axis is None:
        return x
    rng = np.random.default_rng(seed)
    return jnp.stack([x * float(rng.uniform(0.5, 2.0)) + k for k in range(B)], axis=axis)


IDX = jnp.asarray([3, 0, 5, 5], jnp.int32)


def _batched_idx(axis: int | None) -> jax.Array:
    if axis is None:
        return IDX
    return jnp.stack([IDX, IDX[::-1], (IDX + 1) % 6], axis=axis)


# in_axes of (x, y) for the scaled add; (idx, x) for the gather. None mixes in an unbatched one.
ADD_AXES = [(a, a) for a in AXES] + [(0, None), (None, 1), (1, -1)]
GATHER_AXES = [(None, a) for a in AXES] + [(a, None) for a in AXES] + [(0, 1), (-1, -1)]


@pytest.mark.parametrize("out_axis", AXES)
@pytest.mark.parametrize("in_axes", ADD_AXES)
def test_interpreter_results_without_scalar_prefetch(in_axes: tuple[Any, Any],
                                                     out_axis: int) -> None:
    x, y = (_batched(_rand((2, 16, 256), k), a, k) for k, a in enumerate(in_axes))
    f = jax.vmap(scaled_add(pl, backend="interpret"), in_axes=in_axes, out_axes=out_axis)
    want = jax.vmap(_scaled_add_reference, in_axes=in_axes, out_axes=out_axis)(x, y)
    np.testing.assert_allclose(jax.jit(f)(x, y), want, rtol=1e-6)


@pytest.mark.parametrize("out_axis", AXES)
@pytest.mark.parametrize("in_axes", GATHER_AXES)
def test_interpreter_results_with_scalar_prefetch(in_axes: tuple[Any, Any],
                                                  out_axis: int) -> None:
    idx = _batched_idx(in_axes[0])
    x = _batched(_rand((6, 8, 128), 1), in_axes[1], 1)
    f = jax.vmap(gather(pl, backend="interpret"), in_axes=in_axes, out_axes=out_axis)
    want = jax.vmap(_gather_reference, in_axes=in_axes, out_axes=out_axis)(idx, x)
    np.testing.assert_allclose(jax.jit(f)(idx, x), want, rtol=1e-6)


def _lowered(f: Callable[..., Any], *args: Any) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def _both(build: Callable[..., Any], in_axes: Any, out_axis: int,
          *args: Any) -> tuple[str, str]:
    """The TPU lowerings of the vmapped kernel written with ours and with JAX's Pallas."""
    ours = _lowered(jax.vmap(build(pl), in_axes=in_axes, out_axes=out_axis), *args)
    with plb.assume_device("TPU v5 lite", "tpu"):
        theirs = _lowered(jax.vmap(build(jax_pl), in_axes=in_axes, out_axes=out_axis), *args)
    return ours, theirs


def _assert_agree(ours: str, theirs: str, prefetch: list[np.ndarray] | None = None) -> None:
    (ours_config, mine), = inspection.kernels(ours)
    (theirs_config, other), = inspection.kernels(theirs)
    inspection.assert_same_config(ours_config, theirs_config)
    inspection.assert_same_kernel(mine, other, prefetch)
    # The same data movement around the kernel: a transpose only for out_axes other than 0.
    assert ours.count("stablehlo.transpose") == theirs.count("stablehlo.transpose")


@pytest.mark.parametrize("build", [scaled_add, gather])
def test_no_transpose_for_a_vmap_over_a_non_leading_axis(build: Callable[..., Any]) -> None:
    x = _batched(_rand((2, 16, 256) if build is scaled_add else (6, 8, 128), 0), 1, 0)
    args = (x, x) if build is scaled_add else (IDX, x)
    in_axes = (1, 1) if build is scaled_add else (None, 1)
    text = _lowered(jax.vmap(build(pl), in_axes=in_axes), *args)
    assert "stablehlo.transpose" not in text
    (_, module), = inspection.kernels(text)
    info = inspection.summary(module)
    assert info["iteration_bounds"][0] == B
    assert info["dimension_semantics"][0] == "parallel"
    # The operand keeps its layout: the batch is a squeezed (size-1) window at axis 1.
    window = info["windows"][info["scalar_prefetch"]]["window_bounds"]
    assert window == (1, 1, 8, 128)


@pytest.mark.parametrize("out_axis", AXES)
@pytest.mark.parametrize("in_axes", [(0, 0), (1, 1), (0, None), (None, 1), (1, 0)])
def test_agrees_with_jax_without_scalar_prefetch(in_axes: tuple[Any, Any],
                                                 out_axis: int) -> None:
    x, y = (_batched(_rand((2, 16, 256), k), a, k) for k, a in enumerate(in_axes))
    ours, theirs = _both(scaled_add, in_axes, out_axis, x, y)
    _assert_agree(ours, theirs)
    (_, module), = inspection.kernels(ours)
    assert inspection.summary(module)["dimension_semantics"] == (
        "parallel", "parallel", "arbitrary", "parallel")


@pytest.mark.parametrize("out_axis", AXES)
@pytest.mark.parametrize("in_axes", [(None, 0), (None, 1), (0, None), (1, None), (-1, None),
                                     (0, 1), (-1, 0)])
def test_agrees_with_jax_with_scalar_prefetch(in_axes: tuple[Any, Any], out_axis: int) -> None:
    """Unbatched prefetch operands: in place. Batched ones: a loop over the batch (in both)."""
    idx = _batched_idx(in_axes[0])
    x = _batched(_rand((6, 8, 128), 1), in_axes[1], 1)
    ours, theirs = _both(gather, in_axes, out_axis, idx, x)
    _assert_agree(ours, theirs, [np.asarray(IDX)])
    looped = in_axes[0] is not None
    assert ("stablehlo.while" in ours) == looped


@pytest.mark.parametrize("in_axis", [-1, -2])
def test_batch_in_the_last_two_dimensions_is_refused_as_in_jax(in_axis: int) -> None:
    """A squeezed block dimension among the last two cannot tile a TPU's registers: JAX's
    lowering refuses it, and so do we, saying what vmap did and how to batch instead."""
    x, y = _batched(_rand((2, 16, 256), 0), in_axis, 0), _rand((2, 16, 256), 1)
    with pytest.raises(pl.BlockSpecError, match=r"(?s)batched by jax.vmap.*Fix.*in_axes=0"):
        _lowered(jax.vmap(scaled_add(pl), in_axes=(in_axis, None)), x, y)
    with plb.assume_device("TPU v5 lite", "tpu"), pytest.raises(ValueError, match="last two"):
        _lowered(jax.vmap(scaled_add(jax_pl), in_axes=(in_axis, None)), x, y)
