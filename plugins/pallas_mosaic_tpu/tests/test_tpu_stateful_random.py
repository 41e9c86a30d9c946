"""``pltpu.stateful_bits/uniform/normal/bernoulli`` and ``pltpu.touch``.

JAX's TPU interpret mode draws zeros from the core's PRNG, so the samplers are checked against
``jax.random`` itself: a kernel draws samples after ``prng_seed(s)``, another draws the raw
words after the same seed, and ``jax.random``'s sampler is run outside any kernel on a key
whose bits are those words (a PRNG implementation defined with ``jax.extend.random``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core.errors import PallasError, UnsupportedError

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

SHAPE = (16, 128)


def _replaying_key(words: jax.Array) -> jax.Array:
    """A ``jax.random`` key whose one 32-bit draw is ``words`` (uint32)."""
    def random_bits(key: Any, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
        assert bit_width == 32 and tuple(shape) == words.shape, (bit_width, shape)
        return words

    def unused(*args: Any) -> Any:
        raise AssertionError("only random_bits is used")

    impl = jex_random.define_prng_impl(
        key_shape=(1,), seed=lambda s: jnp.zeros((1,), jnp.uint32), split=unused,
        random_bits=random_bits, fold_in=unused, name="replay", tag="replay")
    return jax.random.key(0, impl=impl)


def _draw(sample: Callable[[], jax.Array], out: jax.ShapeDtypeStruct, seed: int,
          backend: str = "interpret") -> Any:
    def kernel(o_ref: Any) -> None:
        pltpu.prng_seed(seed)
        o_ref[...] = sample()

    return pl.pallas_call(kernel, out, backend=backend)


def _words(shape: tuple[int, ...], seed: int) -> jax.Array:
    out = jax.ShapeDtypeStruct(shape, jnp.int32)
    bits = _draw(lambda: pltpu.prng_random_bits(shape), out, seed)()
    return jax.lax.bitcast_convert_type(bits, jnp.uint32)


Case = tuple[str, Callable[[], jax.Array], Callable[[Any], jax.Array], Any, tuple[int, ...]]
CASES: list[Case] = [
    ("bits", lambda: pltpu.stateful_bits(SHAPE), lambda k: jax.random.bits(k, SHAPE),
     jnp.uint32, SHAPE),
    ("uniform", lambda: pltpu.stateful_uniform(SHAPE),
     lambda k: jax.random.uniform(k, SHAPE), jnp.float32, SHAPE),
    ("uniform_range", lambda: pltpu.stateful_uniform(SHAPE, minval=-3.0, maxval=5.5),
     lambda k: jax.random.uniform(k, SHAPE, minval=-3.0, maxval=5.5), jnp.float32, SHAPE),
    ("normal", lambda: pltpu.stateful_normal(SHAPE, jnp.float32),
     lambda k: jax.random.normal(k, SHAPE, jnp.float32), jnp.float32, SHAPE),
    ("bernoulli", lambda: pltpu.stateful_bernoulli(0.3, SHAPE).astype(jnp.int32),
     lambda k: jax.random.bernoulli(k, 0.3, SHAPE).astype(jnp.int32), jnp.int32, SHAPE),
    ("bernoulli_high", lambda: pltpu.stateful_bernoulli(0.7, SHAPE, mode="high").astype(
        jnp.int32), lambda k: jax.random.bernoulli(k, 0.7, SHAPE, mode="high").astype(
            jnp.int32), jnp.int32, (2, *SHAPE)),
]


@pytest.mark.parametrize("name,ours,theirs,dtype,drawn", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [1, 12345])
def test_stateful_samplers_are_jax_random_on_the_same_bits(
        name: str, ours: Callable[[], jax.Array], theirs: Callable[[Any], jax.Array],
        dtype: Any, drawn: tuple[int, ...], seed: int) -> None:
    got = _draw(ours, jax.ShapeDtypeStruct(SHAPE, dtype), seed)()
    want = theirs(_replaying_key(_words(drawn, seed)))
    if name == "normal":  # erf_inv compiled in another program: may differ in the last ulp
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)
    assert len(np.unique(np.asarray(got))) > 1


def _lower(sample: Callable[[], jax.Array], dtype: Any) -> str:
    f = _draw(sample, jax.ShapeDtypeStruct(SHAPE, dtype), 3, backend="mosaic_tpu")
    (_, module), = inspection.kernels(
        jax.jit(f).trace().lower(lowering_platforms=("tpu",)).as_text())
    return str(module)


def test_stateful_samplers_lower_to_the_hardware_prng() -> None:
    module = _lower(lambda: pltpu.stateful_uniform(SHAPE, minval=-1.0), jnp.float32)
    assert "tpu.prng_random_bits" in module and "tpu.prng_set_seed_32" in module
    module = _lower(lambda: pltpu.stateful_bernoulli(0.25, SHAPE).astype(jnp.int32), jnp.int32)
    assert "tpu.prng_random_bits" in module


def test_stateful_normal_lowers_with_the_shared_erf_inv_rule() -> None:
    """``jax.random.normal``'s transform needs ``erf_inv``: the shared rule's polynomial
    (a ``math.log``, a ``math.sqrt`` and no call to anything MLIR lacks)."""
    module = _lower(lambda: pltpu.stateful_normal(SHAPE), jnp.float32)
    assert "tpu.prng_random_bits" in module and "math.log" in module and "math.sqrt" in module


@pytest.mark.parametrize("call,error", [
    (lambda: pltpu.stateful_uniform(SHAPE, jnp.bfloat16), UnsupportedError),
    (lambda: pltpu.stateful_uniform(SHAPE, jnp.int32), PallasError),
    (lambda: pltpu.stateful_bits(SHAPE, jnp.int32), PallasError),
    (lambda: pltpu.stateful_bits(SHAPE, jnp.uint16), UnsupportedError),
    (lambda: pltpu.stateful_bernoulli(0.5, SHAPE, mode="mid"), PallasError),
    (lambda: pltpu.stateful_normal(SHAPE, out_sharding="x"), UnsupportedError),
])
def test_stateful_samplers_refuse_what_the_prng_cannot_draw(call: Callable[[], Any],
                                                            error: type) -> None:
    with pytest.raises(error):
        call()


def test_touch_changes_nothing_and_lowers() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pltpu.touch(x_ref)
        pltpu.touch((x_ref, o_ref))
        o_ref[...] = x_ref[...] * 3.0

    x = jax.random.normal(jax.random.key(0), SHAPE, jnp.float32)
    out = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    np.testing.assert_array_equal(pl.pallas_call(kernel, out, backend="interpret")(x), x * 3.0)
    jax.jit(pl.pallas_call(kernel, out, backend="mosaic_tpu")).trace(x).lower(
        lowering_platforms=("tpu",))
