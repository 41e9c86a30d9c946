"""``pltpu.pack_elementwise``/``unpack_elementwise``, ``stochastic_round``, ``split_bits``/
``join_bits`` and ``pack_fp6``/``unpack_fp6`` (issue 28): on the interpreter, inside kernels,
against NumPy's views of the bits on random inputs; lowered for TPU, the ``tpu`` op JAX emits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_core as pl

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

RNG = np.random.default_rng(28)


def _module(f: Any, *args: Any) -> str:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    return str(module)


def _kernel_call(fn: Any, out: jax.ShapeDtypeStruct, n_in: int, backend: str | None) -> Any:
    def kernel(*refs: Any) -> None:
        refs[n_in][...] = fn(*(r[...] for r in refs[:n_in]))

    return pl.pallas_call(kernel, out, backend=backend)


def _ints(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


# --- pack / unpack -------------------------------------------------------------------------


@pytest.mark.parametrize(("wide", "narrow"), [(np.int16, jnp.int8), (np.int32, jnp.int8),
                                              (np.int32, jnp.int16), (np.int8, jnp.int4)])
def test_pack_elementwise_of_integers_keeps_low_bits_lowest_first(wide: Any, narrow: Any) -> None:
    k = np.dtype(wide).itemsize * 8 // jnp.iinfo(narrow).bits
    part = jnp.iinfo(narrow).bits
    xs = [_ints((8, 128), wide) for _ in range(k)]
    u = np.dtype(f"uint{np.dtype(wide).itemsize * 8}")
    expected = np.zeros((8, 128), u)
    for i, x in enumerate(xs):
        expected |= (x.view(u) & u.type((1 << part) - 1)) << u.type(i * part)
    f = _kernel_call(lambda *a: pltpu.pack_elementwise(a, packed_dtype=narrow),
                     jax.ShapeDtypeStruct((8, 128), u), k, "interpret")
    np.testing.assert_array_equal(f(*xs), expected)


def test_pack_elementwise_of_floats_rounds_to_bfloat16_and_lowers() -> None:
    xs = [RNG.standard_normal((8, 128)).astype(np.float32) for _ in range(2)]
    halves = [x.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32) for x in xs]
    f = _kernel_call(lambda a, b: pltpu.pack_elementwise([a, b], packed_dtype=jnp.bfloat16),
                     jax.ShapeDtypeStruct((8, 128), jnp.uint32), 2, None)
    with pltpu.force_tpu_interpret_mode():
        np.testing.assert_array_equal(f(*xs), halves[0] | (halves[1] << np.uint32(16)))
    assert "tpu.pack_elementwise" in _module(f, *xs)


@pytest.mark.parametrize("index", [0, 1])
def test_unpack_elementwise_reads_one_part_as_jax_documents(index: int) -> None:
    x = _ints((8, 128), np.int16)
    expected = x.view(np.int8)[:, index::2].astype(np.int16)
    f = _kernel_call(lambda a: pltpu.unpack_elementwise(a, index=index, packed_dtype=jnp.int8,
                                                        unpacked_dtype=jnp.int16),
                     jax.ShapeDtypeStruct((8, 128), jnp.int16), 1, None)
    with pltpu.force_tpu_interpret_mode():
        np.testing.assert_array_equal(f(x), expected)
    assert "tpu.unpack_elementwise" in _module(f, x)


def test_unpack_of_bfloat16_parts_and_pack_round_trip() -> None:
    xs = [RNG.standard_normal((8, 128)).astype(np.float32) for _ in range(2)]

    def both(a: Any, b: Any) -> Any:
        word = pltpu.pack_elementwise([a, b], packed_dtype=jnp.bfloat16)
        parts = [pltpu.unpack_elementwise(word, index=i, packed_dtype=jnp.bfloat16,
                                          unpacked_dtype=jnp.float32) for i in (0, 1)]
        return parts[1] - parts[0]

    f = _kernel_call(both, jax.ShapeDtypeStruct((8, 128), jnp.float32), 2, "interpret")
    rounded = [x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in xs]
    np.testing.assert_array_equal(f(*xs), rounded[1] - rounded[0])


def test_pack_and_unpack_refuse_what_jax_refuses() -> None:
    x = jnp.zeros((8, 128), jnp.int16)
    with pytest.raises(pl.PallasError, match="Fix: pass 2"):
        pltpu.pack_elementwise([x], packed_dtype=jnp.int8)
    with pytest.raises(pl.PallasError, match="float32 into bfloat16"):
        pltpu.pack_elementwise([x.astype(jnp.float32)] * 2, packed_dtype=jnp.int16)
    with pytest.raises(pl.PallasError, match="index"):
        pltpu.unpack_elementwise(x, index=2, packed_dtype=jnp.int8, unpacked_dtype=jnp.int16)


# --- stochastic_round ----------------------------------------------------------------------


def _all_values(dtype: Any) -> np.ndarray:
    """Every finite value of an 8- or 16-bit float format, sorted (NumPy's view)."""
    bits = 8 * np.dtype(dtype).itemsize
    values = np.arange(2 ** bits, dtype=f"uint{bits}").view(dtype).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


@pytest.mark.parametrize("target", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2,
                                    jnp.float8_e4m3b11fnuz])
def test_stochastic_round_picks_a_neighbour_with_the_right_odds(target: Any) -> None:
    values = _all_values(target)
    limit = min(values[-1], 64.0)
    x = (RNG.uniform(-limit, limit, (8, 128))).astype(np.float32)
    bits = RNG.integers(0, 2 ** 32, (8, 128), dtype=np.uint32)
    f = _kernel_call(lambda a, b: pltpu.stochastic_round(a, b, target_dtype=target),
                     jax.ShapeDtypeStruct((8, 128), target), 2, "interpret")
    out = np.asarray(f(x, bits)).astype(np.float64)
    i = np.searchsorted(values, x.astype(np.float64))
    below, above = values[np.maximum(i - 1, 0)], values[np.minimum(i, len(values) - 1)]
    exact = values[np.minimum(i, len(values) - 1)] == x
    assert np.all((out == below) | (out == above) | exact & (out == x))
    # Representable values come back unchanged, whatever the bits.
    # (float32 subnormals aside: XLA on CPU flushes them to zero.)
    normal = (np.abs(values) < limit) & ((np.abs(values) >= np.finfo(np.float32).tiny)
                                         | (values == 0))
    rep = values[normal][:: max(1, len(values) // 512)].astype(np.float32)
    same = f(np.resize(rep, (8, 128)), bits)
    np.testing.assert_array_equal(np.asarray(same).astype(np.float32), np.resize(rep, (8, 128)))
    # One value rounded with many draws: the mean is the value.
    k = int(np.searchsorted(values, 1.0)) + 3
    v = np.float32(values[k] + 0.3 * (values[k + 1] - values[k]))
    many = f(np.full((8, 128), v, np.float32), RNG.integers(0, 2 ** 32, (8, 128), np.uint32))
    mean = float(np.mean(np.asarray(many).astype(np.float64)))
    assert abs(mean - v) < 0.1 * (values[k + 1] - values[k])


def test_stochastic_round_to_int4_and_lowering() -> None:
    x = RNG.uniform(-7.5, 7.5, (8, 128)).astype(np.float32)
    bits = RNG.integers(0, 2 ** 32, (8, 128), dtype=np.uint32)
    f = _kernel_call(lambda a, b: pltpu.stochastic_round(a, b, target_dtype=jnp.int4),
                     jax.ShapeDtypeStruct((8, 128), jnp.int4), 2, None)
    with pltpu.force_tpu_interpret_mode():
        out = np.asarray(f(x, bits)).astype(np.float32)
    assert np.all((out == np.floor(x)) | (out == np.ceil(x)))
    g = _kernel_call(lambda a, b: pltpu.stochastic_round(a, b, target_dtype=jnp.bfloat16),
                     jax.ShapeDtypeStruct((8, 128), jnp.bfloat16), 2, None)
    assert "tpu.stochastic_convert" in _module(g, x, bits)
    with pytest.raises(pl.PallasError, match="uint32"):
        pltpu.stochastic_round(jnp.asarray(x), jnp.asarray(bits, jnp.int32),
                               target_dtype=jnp.bfloat16)


# --- split_bits / join_bits / fp6 ----------------------------------------------------------


def _signed(field: np.ndarray, width: int) -> np.ndarray:
    return np.where(field >= 1 << (width - 1), field - (1 << width), field)


def test_split_bits_takes_fields_lowest_first() -> None:
    x = _ints((8, 128), np.int8)
    word = x.view(np.uint8).astype(np.int32)
    low4, mid2, top2 = pltpu.split_bits(jnp.asarray(x), (4, 2, 2))
    assert (low4.dtype, mid2.dtype) == (jnp.int4, jnp.int2)
    np.testing.assert_array_equal(np.asarray(low4).astype(np.int32), _signed(word & 15, 4))
    np.testing.assert_array_equal(np.asarray(mid2).astype(np.int32), _signed((word >> 4) & 3, 2))
    np.testing.assert_array_equal(np.asarray(top2).astype(np.int32), _signed(word >> 6, 2))
    with pytest.raises(pl.PallasError, match="2 or 4"):
        pltpu.split_bits(jnp.asarray(x), (3,))


def test_fp6_split_layout_round_trips_and_join_bits_fills_low_bits() -> None:
    x = _ints((8, 128), np.int8) & np.int8(0x3F)  # 6-bit values in bytes
    two, four = pltpu.pack_fp6(jnp.asarray(x))
    np.testing.assert_array_equal(pltpu.unpack_fp6(two, four), x)
    np.testing.assert_array_equal(pltpu.join_bits(four_bits=four), x & 15)
    np.testing.assert_array_equal(pltpu.join_bits(two_bits=two), x >> 4)
    with pytest.raises(pl.PallasError, match="needs"):
        pltpu.join_bits()

    def kernel(x_ref: Any, o_ref: Any) -> None:
        t, f = pltpu.pack_fp6(x_ref[...])
        o_ref[...] = pltpu.unpack_fp6(t, f)

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, jnp.int8), backend="interpret")(x)
    np.testing.assert_array_equal(out, x)


# --- to_pallas_key / sample_block ----------------------------------------------------------


def _sample(block: tuple[int, int], backend: str | None = "interpret") -> Any:
    def kernel(k_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.sample_block(jax.random.uniform, k_ref[...], block, (8, 128),
                                        (16, 256))

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 256), jnp.float32),
                          grid=(16 // block[0], 256 // block[1]),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
                          out_specs=pl.BlockSpec(block, lambda i, j: (i, j)), backend=backend)


def test_sample_block_is_the_same_whatever_the_block_shape() -> None:
    key = pltpu.to_pallas_key(jax.random.key(int(RNG.integers(1 << 30))))
    words = jax.random.key_data(key)
    whole = _sample((16, 256))(words)
    for block in [(16, 128), (8, 256), (8, 128)]:
        np.testing.assert_array_equal(_sample(block)(words), whole)
    # Each tile is the sampler's draw from the key folded with the tile's row-major index.
    for t, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        tile = jax.random.uniform(jax.random.fold_in(key, t), (8, 128))
        np.testing.assert_array_equal(whole[8 * r:8 * r + 8, 128 * c:128 * c + 128], tile)
    assert 0.45 < float(whole.mean()) < 0.55
    with pytest.raises(pl.PallasError):
        jax.jit(_sample((8, 128), None)).trace(words).lower(lowering_platforms=("tpu",))


def test_to_pallas_key_takes_typed_legacy_and_batched_keys() -> None:
    typed, legacy = jax.random.key(7), jax.random.PRNGKey(7)
    assert jnp.issubdtype(pltpu.to_pallas_key(typed).dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(pltpu.to_pallas_key(legacy)),
                                  jax.random.key_data(pltpu.to_pallas_key(typed)))
    batched = pltpu.to_pallas_key(jax.random.split(typed, 3))
    assert batched.shape == (3,)
    assert len({tuple(np.asarray(jax.random.key_data(k))) for k in batched}) == 3


# --- the emitted module, run by the Mosaic TPU emulator ------------------------------------


def test_packing_runs_through_the_emulator_as_lowered() -> None:
    a, b = (RNG.standard_normal((8, 128)).astype(np.float32) for _ in range(2))

    def kernel(a_ref: Any, b_ref: Any, o_ref: Any) -> None:
        word = pltpu.pack_elementwise([a_ref[...], b_ref[...]], packed_dtype=jnp.bfloat16)
        pltpu.trace_value("total", jnp.sum(a_ref[...]))
        parts = [pltpu.unpack_elementwise(word, index=i, packed_dtype=jnp.bfloat16,
                                          unpacked_dtype=jnp.float32) for i in (0, 1)]
        o_ref[...] = parts[1] - parts[0]

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))
    rounded = [x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (a, b)]
    np.testing.assert_array_equal(pl.emulate(f, backend="mosaic_tpu")(a, b),
                                  rounded[1] - rounded[0])
    x = _ints((8, 128), np.int16)
    g = _kernel_call(lambda v: pltpu.unpack_elementwise(v, index=1, packed_dtype=jnp.int8,
                                                        unpacked_dtype=jnp.int16),
                     jax.ShapeDtypeStruct((8, 128), jnp.int16), 1, None)
    np.testing.assert_array_equal(pl.emulate(g, backend="mosaic_tpu")(x),
                                  x.view(np.int8)[:, 1::2].astype(np.int16))
