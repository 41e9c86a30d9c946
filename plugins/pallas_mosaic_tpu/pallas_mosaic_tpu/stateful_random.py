"""``jax.random``'s samplers drawing from the core's PRNG (``pltpu.stateful_uniform`` ...).

Each takes ``jax.random``'s arguments less the key, draws 32-bit words with
:func:`~pallas_mosaic_tpu.primitives.prng_random_bits` (seed it first with ``prng_seed``), and
turns them into samples as ``jax.random`` turns the bits of a key: given the same bits, the
samples are ``jax.random``'s. Only 32-bit types can be drawn, as in JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core.errors import PallasError, UnsupportedError
from pallas_mosaic_tpu.primitives import prng_random_bits


def _shape(shape: Any, what: str) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise PallasError(f"pltpu.{what}: expected a static shape of non-negative ints, "
                          f"found {shape!r}.")
    return tuple(int(d) for d in dims)


def _no_sharding(out_sharding: Any, what: str) -> None:
    if out_sharding is not None:
        raise UnsupportedError(f"pltpu.{what}(out_sharding={out_sharding!r}): samples drawn "
                               "inside a kernel have no sharding. Fix: drop out_sharding.")


def _words(shape: tuple[int, ...]) -> jax.Array:
    """``shape`` uint32 words from the core's PRNG."""
    return lax.bitcast_convert_type(prng_random_bits(shape), jnp.uint32)


def _float32(dtype: Any, what: str) -> Any:
    dt = jnp.dtype(jnp.float32 if dtype is None else dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise PallasError(f"pltpu.{what}: dtype must be a floating type, found {dt}.")
    if dt != jnp.float32:
        raise UnsupportedError(f"pltpu.{what}(dtype={dt}): the core's PRNG draws 32-bit words "
                               "only. Fix: draw float32 and convert with .astype.")
    return dt


def stateful_bits(shape: Sequence[int] = (), dtype: Any = None, *,
                  out_sharding: Any = None) -> jax.Array:
    """``jax.random.bits`` from the core's PRNG: uint32 words of ``shape``."""
    _no_sharding(out_sharding, "stateful_bits")
    dt = jnp.dtype(jnp.uint32 if dtype is None else dtype)
    if not jnp.issubdtype(dt, jnp.unsignedinteger):
        raise PallasError(f"pltpu.stateful_bits: dtype must be an unsigned integer type, "
                          f"found {dt}.")
    if dt != jnp.uint32:
        raise UnsupportedError(f"pltpu.stateful_bits(dtype={dt}): the core's PRNG draws 32-bit "
                               "words only. Fix: use dtype=jnp.uint32.")
    return _words(_shape(shape, "stateful_bits"))


def _uniform(shape: tuple[int, ...], minval: Any, maxval: Any) -> jax.Array:
    lo = jnp.asarray(minval, jnp.float32)
    hi = jnp.asarray(maxval, jnp.float32)
    # 23 random mantissa bits under the exponent of 1.0 give a float in [1, 2).
    mantissa = lax.shift_right_logical(_words(shape), jnp.uint32(32 - 23))
    one_to_two = lax.bitcast_convert_type(mantissa | jnp.uint32(0x3F800000), jnp.float32)
    unit = one_to_two - jnp.float32(1.0)
    return jnp.maximum(lo, unit * (hi - lo) + lo)


def stateful_uniform(shape: Sequence[int] = (), dtype: Any = None, minval: Any = 0.0,
                     maxval: Any = 1.0, *, out_sharding: Any = None) -> jax.Array:
    """``jax.random.uniform`` from the core's PRNG: float32 in ``[minval, maxval)``."""
    _no_sharding(out_sharding, "stateful_uniform")
    _float32(dtype, "stateful_uniform")
    return _uniform(_shape(shape, "stateful_uniform"), minval, maxval)


def stateful_normal(shape: Sequence[int] = (), dtype: Any = None, *,
                    out_sharding: Any = None) -> jax.Array:
    """``jax.random.normal`` from the core's PRNG: standard normal float32 samples."""
    _no_sharding(out_sharding, "stateful_normal")
    _float32(dtype, "stateful_normal")
    lo = np.nextafter(np.float32(-1.0), np.float32(0.0))
    u = _uniform(_shape(shape, "stateful_normal"), lo, 1.0)
    return jnp.float32(np.sqrt(2)) * lax.erf_inv(u)


def stateful_bernoulli(p: Any = 0.5, shape: Sequence[int] | None = None, mode: str = "low", *,
                       out_sharding: Any = None) -> jax.Array:
    """``jax.random.bernoulli`` from the core's PRNG: True with probability ``p``.

    ``mode="high"`` draws twice the words for finer probabilities, as in JAX.
    """
    _no_sharding(out_sharding, "stateful_bernoulli")
    if mode not in ("low", "high"):
        raise PallasError(f"pltpu.stateful_bernoulli(mode={mode!r}): expected 'low' or 'high'.")
    prob = jnp.asarray(p)
    if not jnp.issubdtype(prob.dtype, jnp.floating):
        raise PallasError(f"pltpu.stateful_bernoulli: p must be a floating value, found "
                          f"{prob.dtype}.")
    _float32(prob.dtype, "stateful_bernoulli")
    dims = tuple(prob.shape) if shape is None else _shape(shape, "stateful_bernoulli")
    if mode == "low":
        return _uniform(dims, 0.0, 1.0) < prob
    both = _uniform((2, *dims), 0.0, 1.0)
    fine = both[1] * jnp.float32(2.0 ** -23)
    return fine < prob - both[0]
