"""Lowering rules JAX's TPU kernel library needs: ``tile`` / ``pltpu.repeat``, reshapes to and
from scalars, masked stores, chained Ref views (``ref.at[a].at[b]``) and squeezed block
dimensions. Each kernel runs in the interpreter against ``jax.numpy`` and lowers for TPU; where
JAX lowers the same kernel, the two agree (``inspection.assert_same_kernel``)."""

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
from pallas_core.errors import UnsupportedError

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

F32 = jnp.float32


def _x(shape: tuple[int, ...], seed: int = 0, dtype: Any = F32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _lower(f: Callable[..., Any], *args: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found


def _agree(build: Callable[[Any], Callable[..., Any]], *args: Any) -> str:
    """Lowers ``build(pl)`` and ``build(jax_pl)``; asserts they agree; our module's text."""
    config, ours = _lower(build(pl), *args)
    with plb.assume_device("TPU v5 lite", "tpu"):
        their_config, theirs = _lower(build(jax_pl), *args)
    inspection.assert_same_config(config, their_config)
    inspection.assert_same_kernel(ours, theirs)
    return str(ours)


def _one_block(m: Any, kernel: Callable[..., None], out: Any, block: tuple[Any, ...],
               **kw: Any) -> Callable[..., Any]:
    spec = m.BlockSpec(block, lambda i: (i,) + (0,) * (len(block) - 1))
    return m.pallas_call(kernel, out, grid=(2,), in_specs=[spec], out_specs=spec, **kw)


def tiled(m: Any, **kw: Any) -> Callable[..., Any]:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.tile(x_ref[:, :128], (1, 2)) + x_ref[...]

    return _one_block(m, kernel, jax.ShapeDtypeStruct((16, 256), F32), (8, 256), **kw)


def test_tile_and_repeat() -> None:
    x = _x((16, 256))
    want = (x.reshape(2, 8, 256) + jnp.tile(x.reshape(2, 8, 256)[:, :, :128], (1, 1, 2)))
    np.testing.assert_allclose(tiled(pl, backend="interpret")(x), want.reshape(16, 256),
                               rtol=1e-6)
    assert "tpu.concatenate" in _agree(tiled, x)

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.repeat(x_ref[:, :128], 2, axis=1) + x_ref[...]

    out = jax.ShapeDtypeStruct((16, 256), F32)
    np.testing.assert_allclose(_one_block(pl, kernel, out, (8, 256), backend="interpret")(x),
                               want.reshape(16, 256), rtol=1e-6)
    assert "tpu.concatenate" in str(_lower(_one_block(pl, kernel, out, (8, 256)), x)[1])
    with pytest.raises(pl.PallasError, match="repeats must be a positive"):
        pltpu.repeat(x, 0, axis=0)


def scalar_reshapes(m: Any, **kw: Any) -> Callable[..., Any]:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        corner = x_ref[0:1, 0:1].reshape(())  # a vector of one element to a scalar
        o_ref[...] = x_ref[...] * corner.reshape(1, 1)  # and back

    return _one_block(m, kernel, jax.ShapeDtypeStruct((16, 128), F32), (8, 128), **kw)


def test_reshapes_to_and_from_scalars() -> None:
    x = _x((16, 128), 1)
    blocks = x.reshape(2, 8, 128)
    want = (blocks * blocks[:, :1, :1]).reshape(16, 128)
    np.testing.assert_allclose(scalar_reshapes(pl, backend="interpret")(x), want, rtol=1e-6)
    text = _agree(scalar_reshapes, x)
    assert "vector.extract" in text and "vector.broadcast" in text


def masked_store(m: Any, **kw: Any) -> Callable[..., Any]:
    """Zeros, then ``x`` stored where the column is below 37 (``pltpu.store`` with a mask)."""
    tpu = pltpu if m is pl else jax_pltpu

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.zeros_like(o_ref)
        tpu.store(o_ref, x_ref[...], mask=jax.lax.broadcasted_iota(jnp.int32, (8, 128), 1) < 37)

    return _one_block(m, kernel, jax.ShapeDtypeStruct((16, 128), F32), (8, 128), **kw)


def test_masked_store() -> None:
    x = _x((16, 128), 2)
    want = jnp.where(jnp.arange(128) < 37, x, 0.0)
    np.testing.assert_array_equal(masked_store(pl, backend="interpret")(x), want)
    text = _agree(masked_store, x)
    assert "tpu.vector_store" in text and "masks" not in text
    store = [ln for ln in text.splitlines() if "tpu.vector_store" in ln][-1]
    assert "vector<8x128xi1>" in store  # the mask operand

    def core_form(x_ref: Any, o_ref: Any) -> None:  # pl.store(ref, idx, val, mask=)
        o_ref[...] = jnp.zeros_like(o_ref)
        pl.store(o_ref, ..., x_ref[...], mask=jax.lax.broadcasted_iota(jnp.int32, (8, 128), 1)
                 < 37)

    out = jax.ShapeDtypeStruct((16, 128), F32)
    np.testing.assert_array_equal(
        _one_block(pl, core_form, out, (8, 128), backend="interpret")(x), want)
    core_text = str(_lower(_one_block(pl, core_form, out, (8, 128)), x)[1])
    assert [ln for ln in core_text.splitlines() if "tpu.vector_store" in ln][-1] == store


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.int32])
def test_masked_loads_and_narrow_masked_stores(dtype: Any) -> None:
    """Masked loads (JAX's lowering refuses them): the view read whole from VMEM, ``other``
    where the mask is False. Masked stores of 8- and 16-bit data (which Mosaic does not
    mask): merged with the view's contents and stored whole. Emulated and interpreted against
    jax.numpy on random data and masks."""
    def kernel(x_ref: Any, m_ref: Any, o_ref: Any) -> None:
        mask = m_ref[...] > 0
        o_ref[...] = jnp.full(o_ref.shape, 3, o_ref.dtype)
        loaded = pltpu.load(x_ref, mask=mask)  # masked lanes undefined: stored under mask
        pltpu.store(o_ref, loaded, mask=mask)
        other = pl.load(x_ref, (slice(None), slice(None)), mask=~mask, other=7)
        o_ref[...] = o_ref[...] + other

    x = (_x((16, 128), 4) * 20).astype(dtype)
    m = jax.random.randint(jax.random.key(9), (16, 128), 0, 2, jnp.int32)
    want = jnp.where(m > 0, x, 3).astype(dtype) + jnp.where(m > 0, 7, x).astype(dtype)
    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), dtype),
                          grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))] * 2,
                          out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))
    np.testing.assert_array_equal(pl.emulate(call, backend="mosaic_tpu")(x, m), want)
    interpreted = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), dtype), grid=(2,),
                                 in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))] * 2,
                                 out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                                 backend="interpret")(x, m)
    np.testing.assert_array_equal(interpreted, want)


def test_a_masked_load_past_the_refs_end_is_refused() -> None:
    def load(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pl.load(x_ref, (pl.ds(4, 8), slice(None)),
                             mask=jax.lax.broadcasted_iota(jnp.int32, (8, 128), 0) < 4)

    x = _x((16, 128), 3)
    with pytest.raises(UnsupportedError, match="a masked load reaching past the end"):
        _lower(_one_block(pl, load, jax.ShapeDtypeStruct((16, 128), F32), (8, 128)), x)


def chained_views(m: Any, **kw: Any) -> Callable[..., Any]:
    """Reads and writes through ``ref.at[a].at[b]`` (a view of a view), as the ragged paged
    attention kernel's DMA buffers are indexed."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]
        o_ref.at[2:6].at[1][...] = x_ref.at[4:8].at[3, :][...] * 2.0

    return _one_block(m, kernel, jax.ShapeDtypeStruct((16, 128), F32), (8, 128), **kw)


def test_chained_views() -> None:
    x = _x((16, 128), 4)
    want = np.array(x).reshape(2, 8, 128)
    want[:, 3] = want[:, 7] * 2.0
    np.testing.assert_allclose(chained_views(pl, backend="interpret")(x),
                               want.reshape(16, 128), rtol=1e-6)
    assert "tpu.memref_slice" in str(_lower(chained_views(pl), x)[1])


def squeezed_block(m: Any, **kw: Any) -> Callable[..., Any]:
    """Blocks of ``(None, 8, 128)``: the kernel sees ``(8, 128)``; the operand keeps the 1."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + 1.0

    spec = m.BlockSpec((None, 8, 128), lambda i, j: (i, j, 0))
    return m.pallas_call(kernel, jax.ShapeDtypeStruct((3, 16, 128), F32), grid=(3, 2),
                         in_specs=[spec], out_specs=spec, **kw)


def test_squeezed_block_dimensions_stay_in_the_operand_types() -> None:
    x = _x((3, 16, 128), 5)
    np.testing.assert_allclose(squeezed_block(pl, backend="interpret")(x), x + 1.0, rtol=1e-6)
    text = _agree(squeezed_block, x)
    assert "memref<1x8x128xf32, #tpu.memory_space<vmem>>" in text
    assert "tpu.memref_squeeze" in text


def reshaped_view(m: Any, **kw: Any) -> Callable[..., Any]:
    """Reads a (2, 8, 128) block through ``ref.reshape(16, 128)``."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref.reshape(16, 128)[...] * 2.0

    spec_in = m.BlockSpec((2, 8, 128), lambda i: (i, 0, 0))
    spec_out = m.BlockSpec((16, 128), lambda i: (i, 0))
    return m.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), F32), grid=(2,),
                         in_specs=[spec_in], out_specs=spec_out, **kw)


def test_reshaped_ref_view() -> None:
    x = _x((4, 8, 128), seed=3)
    np.testing.assert_allclose(reshaped_view(pl, backend="interpret")(x),
                               x.reshape(32, 128) * 2.0, rtol=1e-6)
    assert "tpu.memref_reshape" in _agree(reshaped_view, x)


def bitcast_strided(m: Any, **kw: Any) -> Callable[..., Any]:
    """Reads a bf16 block's bits as uint32 (rows pair up), every second packed row."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref.bitcast(jnp.uint32)[pl.ds(0, 8, stride=2), :]

    return m.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.uint32),
                         in_specs=[m.BlockSpec((32, 128), lambda: (0, 0))],
                         out_specs=m.BlockSpec((8, 128), lambda: (0, 0)), **kw)


def test_bitcast_ref_view_and_strided_read() -> None:
    x = _x((32, 128), seed=4, dtype=jnp.bfloat16)
    packed = jax.lax.bitcast_convert_type(x.reshape(16, 2, 128).transpose(0, 2, 1),
                                          jnp.uint32)
    np.testing.assert_array_equal(bitcast_strided(pl, backend="interpret")(x), packed[::2])
    text = _agree(bitcast_strided, x)
    assert "tpu.memref_bitcast" in text and "tpu.strided_load" in text


def _pieces(x: Any) -> Any:
    """slice, split, concatenate, stack, unstack and pad on one block."""
    a = x[:8, :128]  # slice
    b, c = jnp.split(x[8:], 2, axis=1)  # split
    joined = jnp.concatenate([a, b + c], axis=1)  # concatenate
    padded = jnp.pad(x[:8, :128], ((0, 0), (0, 128)), constant_values=1.5)  # pad
    rows = jnp.stack([joined[0], padded[1]], axis=0)  # stack
    pair = jnp.stack([joined, padded], axis=0)
    first, second = jnp.unstack(pair, axis=0)  # unstack
    return first + second + jnp.broadcast_to(rows.sum(0), joined.shape)


def shape_pieces(m: Any, **kw: Any) -> Callable[..., Any]:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = _pieces(x_ref[...])

    return m.pallas_call(kernel, jax.ShapeDtypeStruct((8, 256), F32),
                         in_specs=[m.BlockSpec((16, 256), lambda: (0, 0))],
                         out_specs=m.BlockSpec((8, 256), lambda: (0, 0)), **kw)


def test_slice_split_concatenate_stack_pad() -> None:
    x = _x((16, 256), seed=5)
    np.testing.assert_allclose(shape_pieces(pl, backend="interpret")(x), _pieces(x), rtol=1e-6)
    text = _agree(shape_pieces, x)
    assert "vector.extract_strided_slice" in text and "tpu.concatenate" in text


def one_d_blocks(m: Any, block: int, dtype: Any = F32, **kw: Any) -> Callable[..., Any]:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2

    spec = m.BlockSpec((block,), lambda i: (i,))
    return m.pallas_call(kernel, jax.ShapeDtypeStruct((2048,), dtype),
                         grid=(2048 // block,), in_specs=[spec], out_specs=spec, **kw)


@pytest.mark.parametrize(("block", "dtype"), [(256, F32), (512, jnp.bfloat16), (1024, F32)])
def test_one_d_blocks_jax_accepts(block: int, dtype: Any) -> None:
    """1-D blocks: the whole array, a multiple of 1024, or a power of two of at least 128
    lanes of packed elements (128 float32, 256 bfloat16), as JAX's lowering accepts them."""
    x = _x((2048,), seed=6, dtype=dtype)
    np.testing.assert_array_equal(
        one_d_blocks(pl, block, dtype, backend="interpret")(x), x * 2)
    _agree(lambda m: one_d_blocks(m, block, dtype), x)


def test_one_d_block_too_small_is_refused() -> None:
    x = _x((2048,), seed=7, dtype=jnp.bfloat16)
    with pytest.raises(pl.BlockSpecError, match=r"1-D block \(128,\).*power of two of at "
                                                r"least 256.*bfloat16"):
        jax.jit(one_d_blocks(pl, 128, jnp.bfloat16)).trace(x).lower(
            lowering_platforms=("tpu",))
