"""Kernels under ``jax.export`` with shape polymorphism, run by the interpreter.

A symbolic grid size is a dynamic grid axis; inside
``pl.pallas_export_experimental(dynamic_shapes=True)`` blocks may be symbolic (whole arrays of
symbolic size) and the kernel may use the dimensions' values. The exported program, called
at several concrete sizes, must give NumPy's result on random inputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_core as pl
from pallas_core import backend as plb

M, N = export.symbolic_shape("m, n")


def _rows(x: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2 + jnp.asarray(pl.num_programs(0), x_ref.dtype)

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="interpret",
                          grid=(x.shape[0] // 8,), in_specs=[spec], out_specs=spec)(x)


def _whole(x: Any, y: Any) -> Any:
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        rows = x_ref.shape[0]
        o_ref[...] = (x_ref[...] * jnp.asarray(rows, x_ref.dtype)
                      + jnp.max(y_ref[...], axis=0, keepdims=True)
                      + jnp.asarray(rows // 8, x_ref.dtype))

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          backend="interpret")(x, y)


def _export(f: Any, *specs: Any, dynamic: bool) -> Any:
    with pl.pallas_export_experimental(dynamic_shapes=dynamic):
        # A fresh function each time: JAX 0.10's jit cache does not key on the mode.
        return export.export(jax.jit(lambda *xs: f(*xs)), platforms=["cpu"])(*specs)


def _x(rows: int, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, 128)), jnp.float32)


@pytest.mark.parametrize("dynamic", [False, True], ids=["grid-only", "export-mode"])
def test_a_symbolic_grid_runs_at_every_size(dynamic: bool) -> None:
    exported = _export(_rows, jax.ShapeDtypeStruct((M, 128), jnp.float32), dynamic=dynamic)
    for seed, rows in enumerate([8, 24, 64]):
        x = _x(rows, seed)
        np.testing.assert_allclose(exported.call(x), np.asarray(x) * 2 + rows // 8,
                                   rtol=1e-6)


def test_symbolic_blocks_and_their_values_run_at_every_size() -> None:
    exported = _export(_whole, jax.ShapeDtypeStruct((M, 128), jnp.float32),
                       jax.ShapeDtypeStruct((N, 128), jnp.float32), dynamic=True)
    for seed, (rows, other) in enumerate([(8, 16), (40, 8)]):
        x, y = _x(rows, seed), _x(other, seed + 9)
        want = (np.asarray(x) * rows + np.asarray(y).max(axis=0, keepdims=True) + rows // 8)
        np.testing.assert_allclose(exported.call(x, y), want, rtol=1e-5, atol=1e-5 * rows)


def test_the_mode_sets_jaxs_flag_only_inside() -> None:
    assert not plb.dynamic_shapes_export_enabled()
    with pl.pallas_export_experimental(dynamic_shapes=True):
        assert plb.dynamic_shapes_export_enabled()
    assert not plb.dynamic_shapes_export_enabled()


def test_a_symbolic_block_needs_the_mode() -> None:
    with pytest.raises(pl.BlockSpecError, match=r"pallas_export_experimental\(dynamic_shapes"):
        _export(_whole, jax.ShapeDtypeStruct((M, 128), jnp.float32),
                jax.ShapeDtypeStruct((N, 128), jnp.float32), dynamic=False)


def test_an_export_for_another_platform_is_not_emulated() -> None:
    """A program exported for TPU, emulated as Triton compiles: refused, naming both."""
    pytest.importorskip("pallas_mosaic_tpu")
    pytest.importorskip("pallas_triton")

    def fn(x: Any) -> Any:
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
                              jax.ShapeDtypeStruct(x.shape, x.dtype), backend="mosaic_tpu")(x)

    exported = export.export(jax.jit(fn), platforms=["tpu"])(
        jax.ShapeDtypeStruct((8, 128), jnp.float32))
    with pytest.raises(pl.UnsupportedError, match=r"exported for \['tpu'\], not 'cuda'"):
        pl.emulate(exported.call, backend="triton")(jnp.ones((8, 128)))

