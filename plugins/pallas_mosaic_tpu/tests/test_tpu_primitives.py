"""``pltpu.roll``, ``pltpu.bitcast`` and the hardware PRNG (``prng_seed``/``prng_random_bits``).

Each kernel is written once against a module pair (``pl``/``pltpu``, or JAX's
``jax.experimental.pallas``/``.tpu``): on the interpreter it must match an independent
reference (``jnp.roll``, NumPy views of the bits, JAX's own interpreter); lowered for TPU on CPU
its Mosaic module must decode, verify and hold the expected ``tpu`` op, as JAX's does.
"""

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
from pallas_core.errors import PallasError, UnsupportedError

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
OURS, JAX = (pl, pltpu), (jax_pl, jax_pltpu)


def _call(mods: tuple[Any, Any], kernel: Callable[..., None], out: Any, *, grid: int = 1,
          in_blocks: tuple[tuple[int, ...], ...] = (), out_block: tuple[int, int] | None = None,
          prefetch: int = 0, backend: str | None = None) -> Callable[..., Any]:
    """``pallas_call`` of ``kernel`` over a 1-D grid; blocks walk the rows. ``prefetch``
    leading operands are scalar-prefetch (SMEM) arrays."""
    m, tpu = mods
    out_block = out_block or out.shape

    def row_map(block: tuple[int, ...]) -> Any:
        return lambda i, *_: (i, *(0 for _ in block[1:]))

    in_specs = [m.BlockSpec(b, row_map(b)) for b in in_blocks]
    out_spec = m.BlockSpec(out_block, row_map(out_block))
    where = {} if mods is JAX else {"backend": backend}
    if mods is JAX and backend == "interpret":
        where = {"interpret": True}
    if prefetch:
        spec_cls = tpu.PrefetchScalarGridSpec
        gs = (spec_cls(prefetch, grid=(grid,), in_specs=in_specs, out_specs=out_spec)
              if mods is OURS else
              spec_cls(num_scalar_prefetch=prefetch, grid=(grid,), in_specs=in_specs,
                       out_specs=out_spec))
        return m.pallas_call(kernel, out, grid_spec=gs, **where)  # type: ignore[no-any-return]
    return m.pallas_call(kernel, out, grid=(grid,), in_specs=in_specs,  # type: ignore[no-any-return]
                         out_specs=out_spec, **where)


def _module(f: Callable[..., Any], *args: Any) -> str:
    """The text of the one Mosaic module in ``f``'s program lowered for TPU (decoded and
    verified in a fresh context)."""
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (config, module), = inspection.kernels(text)
    assert config["custom_call_config"]["serialization_format"] == 1
    return str(module)


def _jax_module(f: Callable[..., Any], *args: Any) -> str:
    try:
        return _module(f, *args)
    except ValueError as e:  # some JAX versions ask for a TPU while lowering
        if "TPU device kind" not in str(e):
            raise
        pytest.skip(f"jax.experimental.pallas {jax.__version__} cannot lower this kernel "
                    "without a TPU")


def _random(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.asarray(rng.integers(info.min, info.max, shape, endpoint=True), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


# --- roll ------------------------------------------------------------------------------------


def roll_static(mods: tuple[Any, Any], shift: int, axis: int, backend: str | None = None
                ) -> Callable[..., Any]:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = mods[1].roll(x_ref[...], shift, axis)

    return lambda x: _call(mods, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=2,
                           in_blocks=((8, 256),), out_block=(8, 256), backend=backend)(x)


def roll_traced(mods: tuple[Any, Any], axis: int, backend: str | None = None
                ) -> Callable[..., Any]:
    """Grid step ``i`` rolls its block by ``s[i]`` (a scalar read from SMEM)."""
    def kernel(s_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = mods[1].roll(x_ref[...], s_ref[mods[0].program_id(0)], axis)

    return lambda s, x: _call(mods, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=2,
                              in_blocks=((8, 256),), out_block=(8, 256), prefetch=1,
                              backend=backend)(s, x)


def roll_strided(mods: tuple[Any, Any], shift: int, axis: int, stride: int, stride_axis: int,
                 backend: str | None = None) -> Callable[..., Any]:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = mods[1].roll(x_ref[...], shift, axis, stride=stride,
                                  stride_axis=stride_axis)

    return lambda x: _call(mods, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                           in_blocks=(x.shape,), backend=backend)(x)


def _np_roll_strided(x: np.ndarray, shift: int, axis: int, stride: int,
                     stride_axis: int) -> np.ndarray:
    slices = [np.roll(s, shift + k * stride, axis)
              for k, s in enumerate(np.split(x, x.shape[stride_axis], stride_axis))]
    return np.concatenate(slices, stride_axis)


@pytest.mark.parametrize("shift,axis", [(3, 1), (-5, 1), (1, 0), (-3, 0), (250, 1),
                                        (17, -1), (0, 1)])
def test_roll_static_matches_jnp_roll(shift: int, axis: int) -> None:
    x = _random((16, 256), F32)
    got = roll_static(OURS, shift, axis, "interpret")(x)
    want = jnp.concatenate([jnp.roll(x[:8], shift, axis), jnp.roll(x[8:], shift, axis)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis", [0, 1])
def test_roll_traced_shift_matches_jnp_roll(axis: int) -> None:
    x = _random((16, 256), F32, seed=1)
    shifts = np.array([-3, 261], np.int32)  # negative, and more than the axis
    got = roll_traced(OURS, axis, "interpret")(jnp.asarray(shifts), x)
    want = jnp.concatenate([jnp.roll(x[:8], int(shifts[0]), axis),
                            jnp.roll(x[8:], int(shifts[1]), axis)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shift,axis,stride,stride_axis",
                         [(1, 1, 1, 0), (5, 1, 3, 0), (2, 0, 1, 1), (-4, 1, 2, 0)])
def test_roll_strided_matches_per_slice_rolls(shift: int, axis: int, stride: int,
                                              stride_axis: int) -> None:
    x = _random((8, 128), I32, seed=2)
    got = roll_strided(OURS, shift, axis, stride, stride_axis, "interpret")(x)
    want = _np_roll_strided(np.asarray(x), shift, axis, stride, stride_axis)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shift,axis", [(3, 1), (1, 0)])
def test_roll_agrees_with_jax_interpreter(shift: int, axis: int) -> None:
    x = _random((16, 256), F32, seed=3)
    ours = roll_static(OURS, shift, axis, "interpret")(x)
    theirs = roll_static(JAX, shift, axis, "interpret")(x)
    np.testing.assert_array_equal(ours, theirs)
    s = _random((8, 128), I32, seed=4)
    np.testing.assert_array_equal(roll_strided(OURS, shift, 1, 2, 0, "interpret")(s),
                                  roll_strided(JAX, shift, 1, 2, 0, "interpret")(s))


def test_roll_lowers_to_dynamic_rotate() -> None:
    x = jnp.ones((16, 256), F32)
    # A static shift is a constant amount, brought into [0, n): -5 along 256 lanes is 251.
    text = _module(roll_static(OURS, -5, 1, "mosaic_tpu"), x)
    assert "tpu.dynamic_rotate" in text and "dim 1" in text
    assert "arith.constant 251 : i32" in text
    theirs = _jax_module(roll_static(JAX, 251, 1), x)
    assert "tpu.dynamic_rotate" in theirs


def test_roll_traced_shift_lowers_to_dynamic_rotate() -> None:
    s, x = jnp.asarray([1, 2], I32), jnp.ones((16, 256), F32)
    text = _module(roll_traced(OURS, 0, "mosaic_tpu"), s, x)
    assert "tpu.dynamic_rotate" in text and "dim 0" in text
    assert "memref.load" in text and "arith.remsi" in text  # the SMEM scalar, wrapped into [0, 8)
    assert "tpu.dynamic_rotate" in _jax_module(roll_traced(JAX, 0), s, x)


def test_roll_strided_lowers_with_stride_attributes() -> None:
    x = jnp.ones((8, 128), I32)
    text = _module(roll_strided(OURS, 1, 1, 2, 0, "mosaic_tpu"), x)
    theirs = _jax_module(roll_strided(JAX, 1, 1, 2, 0), x)
    for t in (text, theirs):
        assert "tpu.dynamic_rotate" in t
        assert "stride = 2 : si32" in t and "stride_dimension = 0 : si32" in t


def test_roll_refuses_bad_arguments() -> None:
    def kernel_with(**kw: Any) -> Callable[..., Any]:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = pltpu.roll(x_ref[...], 1, **kw)
        return _call(OURS, kernel, jax.ShapeDtypeStruct((8, 128), F32), in_blocks=((8, 128),),
                     backend="interpret")

    x = _random((8, 128), F32)
    with pytest.raises(PallasError, match="both stride and stride_axis"):
        kernel_with(axis=1, stride=1)(x)
    with pytest.raises(PallasError, match="stride_axis must differ from axis"):
        kernel_with(axis=1, stride=1, stride_axis=1)(x)
    with pytest.raises(PallasError, match="out of range"):
        kernel_with(axis=2)(x)


# --- bitcast ---------------------------------------------------------------------------------


def bitcast_kernel(mods: tuple[Any, Any], shape: tuple[int, int], src: Any, dst: Any,
                   backend: str | None = None) -> Callable[..., Any]:
    src_bits, dst_bits = jnp.dtype(src).itemsize * 8, jnp.dtype(dst).itemsize * 8
    out_shape = (shape[0] * src_bits // dst_bits, shape[1])

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = mods[1].bitcast(x_ref[...], dst)

    return lambda x: _call(mods, kernel, jax.ShapeDtypeStruct(out_shape, dst),
                           in_blocks=(shape,), backend=backend)(x)


def _np_bitcast(x: np.ndarray, dst: Any) -> np.ndarray:
    """The TPU's row packing, from NumPy views: part ``k`` of output row ``r`` (from the least
    significant bits) is input row ``p*r + k``, and back."""
    src, dst = np.dtype(x.dtype), np.dtype(dst)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}
    if src.itemsize == dst.itemsize:
        return x.view(dst)
    if src.itemsize < dst.itemsize:
        p, bits = dst.itemsize // src.itemsize, src.itemsize * 8
        words = np.zeros((x.shape[0] // p, x.shape[1]), np.uint64)
        parts = x.view(unsigned[src.itemsize]).astype(np.uint64)
        for k in range(p):
            words |= parts[k::p] << np.uint64(k * bits)
        return words.astype(unsigned[dst.itemsize]).view(dst)
    p, bits = src.itemsize // dst.itemsize, dst.itemsize * 8
    words = x.view(unsigned[src.itemsize]).astype(np.uint64)
    out = np.zeros((x.shape[0] * p, x.shape[1]), unsigned[dst.itemsize])
    mask = np.uint64((1 << bits) - 1)
    for k in range(p):
        out[k::p] = ((words >> np.uint64(k * bits)) & mask).astype(unsigned[dst.itemsize])
    return out.view(dst)


BITCASTS = {
    "f32_to_i32": ((8, 128), F32, I32),
    "i32_to_f32": ((8, 128), I32, F32),
    "bf16_to_i32": ((16, 128), BF16, I32),
    "i32_to_bf16": ((8, 128), I32, BF16),
    "i8_to_f32": ((32, 128), jnp.int8, F32),
    "u32_to_i8": ((8, 128), jnp.uint32, jnp.int8),
}


@pytest.mark.parametrize("name", sorted(BITCASTS))
def test_bitcast_matches_numpy_views(name: str) -> None:
    shape, src, dst = BITCASTS[name]
    x = _random(shape, src, seed=5)
    got = bitcast_kernel(OURS, shape, src, dst, "interpret")(x)
    want = _np_bitcast(np.asarray(x), dst)
    assert got.dtype == jnp.dtype(dst) and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_bitcast_same_width_is_bitcast_convert_type() -> None:
    x = _random((8, 128), F32, seed=6)
    got = bitcast_kernel(OURS, (8, 128), F32, I32, "interpret")(x)
    np.testing.assert_array_equal(got, jax.lax.bitcast_convert_type(x, I32))


def test_bitcast_round_trips() -> None:
    x = _random((16, 128), BF16, seed=7)
    packed = bitcast_kernel(OURS, (16, 128), BF16, I32, "interpret")(x)
    back = bitcast_kernel(OURS, (8, 128), I32, BF16, "interpret")(packed)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint16),
                                  np.asarray(x).view(np.uint16))


@pytest.mark.parametrize("name", ["bf16_to_i32", "i32_to_bf16", "i8_to_f32"])
def test_bitcast_agrees_with_jax_interpreter(name: str) -> None:
    shape, src, dst = BITCASTS[name]
    x = _random(shape, src, seed=8)
    ours = bitcast_kernel(OURS, shape, src, dst, "interpret")(x)
    theirs = bitcast_kernel(JAX, shape, src, dst, "interpret")(x)
    np.testing.assert_array_equal(np.asarray(ours).view(np.uint8),
                                  np.asarray(theirs).view(np.uint8))


@pytest.mark.parametrize("name", ["f32_to_i32", "bf16_to_i32", "i32_to_bf16"])
def test_bitcast_lowers_to_tpu_bitcast(name: str) -> None:
    shape, src, dst = BITCASTS[name]
    x = jnp.ones(shape, src)
    text = _module(bitcast_kernel(OURS, shape, src, dst, "mosaic_tpu"), x)
    theirs = _jax_module(bitcast_kernel(JAX, shape, src, dst), x)
    for t in (text, theirs):
        assert "tpu.bitcast" in t
    line = next(ln for ln in text.splitlines() if "tpu.bitcast" in ln)
    assert line.split(":", 1)[1] == next(
        ln for ln in theirs.splitlines() if "tpu.bitcast" in ln).split(":", 1)[1]


def test_bitcast_refuses_what_cannot_be_packed() -> None:
    def kernel_to(dst: Any, shape: tuple[int, ...], src: Any = F32) -> Callable[..., Any]:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = pltpu.bitcast(x_ref[...], dst).sum().reshape(1, 1)
        return _call(OURS, kernel, jax.ShapeDtypeStruct((1, 1), dst), in_blocks=(shape,),
                     backend="interpret")

    with pytest.raises(PallasError, match="rank >= 2"):
        kernel_to(I32, (128,))(jnp.ones((128,), F32))
    with pytest.raises(PallasError, match="cannot be packed"):
        kernel_to(I32, (3, 128), BF16)(jnp.ones((3, 128), BF16))
    with pytest.raises(UnsupportedError, match="8-, 16- and 32-bit"):
        kernel_to(jnp.bool_, (8, 128), jnp.int8)(jnp.ones((8, 128), jnp.int8))


# --- the hardware PRNG -----------------------------------------------------------------------


def prng_blocks(mods: tuple[Any, Any], grid: int = 2, backend: str | None = None
                ) -> Callable[..., Any]:
    """Each grid step seeds with (seed, step) and draws its (8, 128) block."""
    def kernel(s_ref: Any, o_ref: Any) -> None:
        mods[1].prng_seed(s_ref[0], mods[0].program_id(0))
        o_ref[...] = mods[1].prng_random_bits(o_ref.shape)

    return lambda s: _call(mods, kernel, jax.ShapeDtypeStruct((8 * grid, 128), I32), grid=grid,
                           out_block=(8, 128), prefetch=1, backend=backend)(s)


def _interpret(kernel: Callable[..., None], seed: int = 1, rows: int = 8) -> np.ndarray:
    out = _call(OURS, kernel, jax.ShapeDtypeStruct((rows, 128), I32), prefetch=1,
                backend="interpret")(jnp.asarray([seed], I32))
    return np.asarray(out)


def test_prng_same_seed_same_bits_different_seed_different_bits() -> None:
    run = prng_blocks(OURS, backend="interpret")
    a, b, c = (np.asarray(run(jnp.asarray([s], I32))) for s in (7, 7, 8))
    assert a.dtype == np.int32 and a.shape == (16, 128)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.99
    assert (a[:8] != a[8:]).mean() > 0.99  # the grid step is part of the seed
    assert len(np.unique(a)) > 0.99 * a.size  # not constant: (nearly) all distinct
    bits = np.unpackbits(a.view(np.uint8))
    assert 0.45 < bits.mean() < 0.55


def test_prng_successive_draws_differ_and_unused_draws_advance_the_state() -> None:
    def two_draws(s_ref: Any, o_ref: Any) -> None:
        pltpu.prng_seed(s_ref[0])
        o_ref[0:8, :] = pltpu.prng_random_bits((8, 128))
        o_ref[8:16, :] = pltpu.prng_random_bits((8, 128))

    def skip_first(s_ref: Any, o_ref: Any) -> None:
        pltpu.prng_seed(s_ref[0])
        pltpu.prng_random_bits((8, 128))  # result unused: the draw still happens
        o_ref[...] = pltpu.prng_random_bits((8, 128))

    both = _interpret(two_draws, rows=16)
    assert (both[:8] != both[8:]).mean() > 0.99
    np.testing.assert_array_equal(_interpret(skip_first), both[8:])


def test_prng_seed_inside_a_loop_body_draws_there() -> None:
    def kernel(s_ref: Any, o_ref: Any) -> None:
        def body(i: Any, acc: Any) -> Any:
            pltpu.prng_seed(s_ref[0], i)
            return acc.at[i].set(pltpu.prng_random_bits((1, 128))[0])

        o_ref[...] = jax.lax.fori_loop(0, 8, body, jnp.zeros((8, 128), I32))

    out = _interpret(kernel)
    assert len({row.tobytes() for row in out}) == 8  # one stream per iteration

    def seeded_with(i: int) -> Callable[..., None]:
        def kernel(s_ref: Any, o_ref: Any) -> None:
            pltpu.prng_seed(s_ref[0], i)
            o_ref[...] = jnp.broadcast_to(pltpu.prng_random_bits((1, 128)), (8, 128))
        return kernel

    np.testing.assert_array_equal(out[3], _interpret(seeded_with(3))[0])


def test_prng_draw_before_seed_raises() -> None:
    def kernel(s_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.prng_random_bits((8, 128))
        pltpu.prng_seed(s_ref[0])

    with pytest.raises(PallasError, match=r"before pltpu\.prng_seed.*Fix: call pltpu\.prng_seed"):
        _interpret(kernel)


def test_prng_state_is_not_carried_into_a_loop() -> None:
    def kernel(s_ref: Any, o_ref: Any) -> None:
        pltpu.prng_seed(s_ref[0])

        def body(i: Any, acc: Any) -> Any:
            return acc ^ pltpu.prng_random_bits((8, 128))

        o_ref[...] = jax.lax.fori_loop(0, 3, body, jnp.zeros((8, 128), I32))

    with pytest.raises(UnsupportedError, match=r"cannot carry the PRNG state.*Fix"):
        _interpret(kernel)


def test_prng_state_is_not_carried_out_of_a_traced_branch() -> None:
    def kernel(s_ref: Any, o_ref: Any) -> None:
        @pl.when(s_ref[0] > 0)
        def _() -> None:
            pltpu.prng_seed(s_ref[0])

        o_ref[...] = pltpu.prng_random_bits((8, 128))

    with pytest.raises(UnsupportedError, match="cannot carry the PRNG state"):
        _interpret(kernel)


def test_prng_state_is_not_shared_between_branches_or_grid_steps() -> None:
    def seed_in_step_zero_only(s_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            pltpu.prng_seed(s_ref[0])
            o_ref[...] = pltpu.prng_random_bits((8, 128))

        @pl.when(pl.program_id(0) > 0)
        def _() -> None:
            o_ref[...] = pltpu.prng_random_bits((8, 128))  # no seed in this step

    def reseed_every_step(s_ref: Any, o_ref: Any) -> None:
        pltpu.prng_seed(s_ref[0])
        o_ref[...] = pltpu.prng_random_bits((8, 128))

    def build(kernel: Callable[..., None]) -> Callable[..., Any]:
        return _call(OURS, kernel, jax.ShapeDtypeStruct((16, 128), I32), grid=2,
                     out_block=(8, 128), prefetch=1, backend="interpret")

    with pytest.raises(UnsupportedError, match=r"in another branch.*Fix: call pltpu.prng_seed"):
        build(seed_in_step_zero_only)(jnp.asarray([1], I32))
    # Seeding restarts the stream: with the same seed, every step draws the same bits.
    out = np.asarray(build(reseed_every_step)(jnp.asarray([1], I32)))
    np.testing.assert_array_equal(out[:8], out[8:])
    assert len(np.unique(out[:8])) > 1000


def test_prng_seed_refuses_what_is_not_a_32_bit_integer() -> None:
    def seeded(*seeds: Any) -> Callable[..., None]:
        def kernel(s_ref: Any, o_ref: Any) -> None:
            pltpu.prng_seed(*seeds)
            o_ref[...] = pltpu.prng_random_bits((8, 128))
        return kernel

    with pytest.raises(PallasError, match="at least one seed"):
        _interpret(seeded())
    with pytest.raises(PallasError, match="integer scalars"):
        _interpret(seeded(1.5))
    with pytest.raises(PallasError, match="does not fit in 32 bits"):
        _interpret(seeded(2**40))
    # A Python int seed, uint32 range included, is accepted and deterministic.
    a, b = _interpret(seeded(2**32 - 1, 3)), _interpret(seeded(-1, 3))
    np.testing.assert_array_equal(a, b)  # the same 32 bits


def test_prng_lowers_to_the_hardware_prng() -> None:
    s = jnp.asarray([3], I32)
    text = _module(prng_blocks(OURS, backend="mosaic_tpu"), s)
    theirs = _jax_module(prng_blocks(JAX), s)
    for t in (text, theirs):
        assert "tpu.prng_set_seed_32" in t
        assert "tpu.prng_random_bits" in t and "vector<8x128xi32>" in t
    seed_line = next(ln for ln in text.splitlines() if "prng_set_seed_32" in ln)
    assert seed_line.split(":", 1)[1].strip() == "(i32, i32) -> ()"


def test_prng_draws_stay_in_the_module_in_order_even_unused() -> None:
    def kernel(s_ref: Any, o_ref: Any) -> None:
        pltpu.prng_seed(s_ref[0])
        pltpu.prng_random_bits((8, 128))  # advances the hardware state: must be kept
        o_ref[...] = pltpu.prng_random_bits((8, 128))

    f = _call(OURS, kernel, jax.ShapeDtypeStruct((8, 128), I32), prefetch=1,
              backend="mosaic_tpu")
    text = _module(f, jnp.asarray([1], I32))
    assert text.count("tpu.prng_random_bits") == 2
    assert text.index("tpu.prng_set_seed_32") < text.index("tpu.prng_random_bits")


def test_prng_draw_of_rank_one_is_refused_by_mosaic() -> None:
    def kernel(s_ref: Any, o_ref: Any) -> None:
        pltpu.prng_seed(s_ref[0])
        o_ref[...] = pltpu.prng_random_bits((8 * 128,)).reshape(8, 128)

    f = _call(OURS, kernel, jax.ShapeDtypeStruct((8, 128), I32), prefetch=1,
              backend="mosaic_tpu")
    with pytest.raises(UnsupportedError, match=r"rank 1.*draw \(1, n\) and reshape"):
        jax.jit(f).trace(jnp.asarray([1], I32)).lower(lowering_platforms=("tpu",))
