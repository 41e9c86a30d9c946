"""What the Mosaic TPU backend refuses before lowering, with the fix in the message."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_core as pl

pltpu = pytest.importorskip("pallas_mosaic_tpu")


def _copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


def test_blocks_must_tile_by_8_and_128() -> None:
    x = jnp.ones((64, 256))
    spec = pl.BlockSpec((10, 100), lambda i: (i, 0))
    call = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[spec], out_specs=spec, backend="mosaic_tpu")
    with pytest.raises(pl.BlockSpecError, match=r"block shape \(10, 100\).*divisible by "
                                                 r"\(8, 128\).*Fix: use block shape \(16, 128\)"):
        call(x)


def test_full_array_blocks_need_no_tiling() -> None:
    x = jnp.ones((10, 100))
    call = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="mosaic_tpu")
    text = jax.jit(call).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_dimension_semantics_are_checked() -> None:
    with pytest.raises(pl.PallasError, match=r"dimension_semantics.*PARALLEL.*Fix"):
        pltpu.CompilerParams(dimension_semantics=("sideways",))
    x = jnp.ones((16, 128))
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    call = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[spec], out_specs=spec,
                          compiler_params=pltpu.CompilerParams(
                              dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY)))
    with pytest.raises(pl.PallasError, match=r"2 entries but the grid \(2,\) has 1 axes.*Fix"):
        jax.jit(call).trace(x).lower(lowering_platforms=("tpu",))


def test_unsupported_primitive_names_itself_and_the_line() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.cumsum(x_ref[...], axis=1)

    x = jnp.ones((8, 128))
    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="mosaic_tpu")
    with pytest.raises(pl.UnsupportedError, match=r"cumsum.*'mosaic_tpu'.*test_tpu_validation\.py"
                                                   r":\d+.*Fix"):
        jax.jit(call).trace(x).lower(lowering_platforms=("tpu",))
