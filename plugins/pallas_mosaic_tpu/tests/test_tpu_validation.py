"""What the Mosaic TPU backend refuses before lowering, with the fix in the message."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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


def _lower(call: Any, *args: Any) -> str:
    return jax.jit(call).trace(*args).lower(  # type: ignore[no-any-return]
        lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.int64, jnp.float64])
def test_64_bit_and_complex_dtypes_are_refused(dtype: Any) -> None:
    with jax.enable_x64(True):
        x = jnp.ones((8, 128), dtype)
        call = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              backend="mosaic_tpu")
        with pytest.raises(pl.UnsupportedError, match=rf"input 0.*{np.dtype(dtype)}.*Fix: use "
                                                      "32-bit types"):
            _lower(call, x)


def test_scratch_dtypes_are_checked_too() -> None:
    def kernel(x_ref: Any, o_ref: Any, acc: Any) -> None:
        o_ref[...] = x_ref[...]

    x = jnp.ones((8, 128))
    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          scratch_shapes=[pltpu.VMEM((8, 128), jnp.complex64)],
                          backend="mosaic_tpu")
    with pytest.raises(pl.UnsupportedError, match=r"scratch 0 has dtype complex64"):
        _lower(call, x)


def _big_blocks(rows: int, **params: Any) -> Any:
    spec = pl.BlockSpec((rows, 1024), lambda i: (i, 0))
    return pl.pallas_call(_copy, jax.ShapeDtypeStruct((2 * rows, 1024), jnp.float32), grid=(2,),
                          in_specs=[spec], out_specs=spec,
                          compiler_params=pltpu.CompilerParams(**params))


def test_vmem_over_the_default_limit_is_refused_with_the_needed_limit() -> None:
    # Two operands, each double-buffered: 4 x 1024 x 1024 x 4 bytes = 16 MiB, plus a little.
    x = jnp.ones((2 * 1032, 1024), jnp.float32)
    with pytest.raises(pl.PallasError, match=r"needs 16\.12 MiB of VMEM.*may use 16\.00 MiB.*"
                                             r"vmem_limit_bytes=17825792"):
        _lower(_big_blocks(1032), x)
    # Raising the limit, as the message says, lets it lower; a smaller block fits as is.
    assert "tpu_custom_call" in _lower(_big_blocks(1032, vmem_limit_bytes=17825792), x)
    assert "tpu_custom_call" in _lower(_big_blocks(512), jnp.ones((1024, 1024)))


def test_vmem_counts_padding_scratch_and_scoped_buffers() -> None:
    from pallas_mosaic_tpu.validation import vmem_bytes

    assert vmem_bytes((8, 128), jnp.float32) == 4096
    assert vmem_bytes((1, 1), jnp.float32) == 8 * 128 * 4  # one padded tile
    assert vmem_bytes((8, 128), jnp.bfloat16) == 16 * 128 * 2  # bf16 packs 16 rows a tile

    def kernel(x_ref: Any, o_ref: Any) -> None:
        def body(a: Any, b: Any) -> None:
            a[0:8, 0:128] = x_ref[...]
            b[0:8, 0:128] = a[0:8, 0:128]
            o_ref[...] = b[0:8, 0:128]

        pl.run_scoped(body, pltpu.VMEM((2048, 1024), jnp.float32),
                      pltpu.VMEM((2048, 1024), jnp.float32))

    x = jnp.ones((8, 128))
    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="mosaic_tpu")
    with pytest.raises(pl.PallasError, match=r"pl\.run_scoped buffers: 16\.00 MiB"):
        _lower(call, x)


def test_vmem_limit_beyond_any_chip_is_refused() -> None:
    with pytest.raises(pl.PallasError, match=r"more than any TPU's VMEM.*Fix"):
        _lower(_big_blocks(8, vmem_limit_bytes=2**30), jnp.ones((16, 1024)))


def test_hbm_operands_are_whole_arrays() -> None:
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0), memory_space=pltpu.HBM)
    call = pl.pallas_call(_copy, jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2,),
                          in_specs=[spec], out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                          backend="mosaic_tpu")
    with pytest.raises(pl.BlockSpecError, match=r"in HBM with block shape \(8, 128\).*Fix: drop"):
        _lower(call, jnp.ones((16, 128)))
