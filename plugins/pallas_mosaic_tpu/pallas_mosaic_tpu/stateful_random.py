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

from pallas_core.backend import PallasError, UnsupportedError
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


# --- keys for kernels: to_pallas_key, sample_block ----------------------------------------

KEY_IMPL = "threefry2x32"
"""The ``jax.random`` implementation of the keys :func:`to_pallas_key` makes. JAX's keys of
this kind draw from the TPU core's PRNG; here they are ``jax.random``'s threefry keys, so
samples are the same on every backend that runs them (the interpreter), and a TPU's bits
differ from JAX's either way."""


def to_pallas_key(key: jax.Array) -> jax.Array:
    """A key for kernels (:data:`KEY_IMPL`) made from the bits of ``key`` (a typed
    ``jax.random`` key or a legacy uint32 key; batched keys give batched keys), as JAX's
    ``to_pallas_key``; :func:`sample_block` takes it, or its two words
    (``jax.random.key_data``) read from a Ref."""
    typed = jnp.issubdtype(jnp.asarray(key).dtype if not hasattr(key, "dtype") else key.dtype,
                           jax.dtypes.prng_key)
    batched = key.ndim > (0 if typed else 1)

    def words(k: jax.Array) -> jax.Array:
        return jax.random.bits(k, (2,), jnp.uint32)

    data = jax.vmap(words)(key) if batched else words(key)
    return jax.random.wrap_key_data(data, impl=KEY_IMPL)


def _as_key(key: Any) -> jax.Array:
    if jnp.issubdtype(getattr(key, "dtype", np.float32), jax.dtypes.prng_key):
        return key  # type: ignore[no-any-return]
    data = jnp.asarray(key)
    if data.dtype != jnp.uint32 or data.size != 2:
        raise PallasError(f"pltpu.sample_block: global_key must be a key from "
                          f"pltpu.to_pallas_key or its two uint32 words, found "
                          f"{data.dtype}{list(data.shape)}.")
    return jax.random.wrap_key_data(jnp.reshape(data, (2,)), impl=KEY_IMPL)


def sample_block(sampler_fn: Any, global_key: Any, block_size: Sequence[int],
                 tile_size: Sequence[int], total_size: Sequence[int],
                 block_index: tuple[Any, ...] | None = None, **kwargs: Any) -> jax.Array:
    """The block ``block_index`` (default: ``pl.program_id`` of each axis) of a
    ``total_size`` array of samples of ``sampler_fn`` (e.g. ``jax.random.uniform``), the
    same whatever the block shape or order: the array is cut into ``tile_size`` tiles (which
    must divide every block shape used), tile ``t`` (row-major over the tiles of the whole
    array) is ``sampler_fn(jax.random.fold_in(global_key, t), shape=tile_size, **kwargs)``.

    ``global_key`` is a key from :func:`to_pallas_key`, or its two uint32 words (e.g. read
    from an SMEM Ref: ``(key_ref[0], key_ref[1])``). The interpreter runs it, and the Mosaic
    TPU lowering lowers it (``jax.random``'s key primitives inlined on the key's words, as
    JAX lowers them): the samples are the same on both.
    """
    from pallas_core import program_id

    block, tile, total = (_shape(s, "sample_block") for s in (block_size, tile_size,
                                                                total_size))
    if not len(block) == len(tile) == len(total):
        raise PallasError(f"pltpu.sample_block: block_size {block}, tile_size {tile} and "
                          f"total_size {total} must have one rank.")
    if any(t == 0 or b % t for b, t in zip(block, tile)):
        raise PallasError(f"pltpu.sample_block: tile_size {tile} must divide block_size "
                          f"{block}.")
    key = _as_key(global_key)
    if block_index is None:
        block_index = tuple(program_id(axis) for axis in range(len(block)))
    per_block = [b // t for b, t in zip(block, tile)]
    tiles_total = [-(-n // t) for n, t in zip(total, tile)]

    def tile_at(prefix: tuple[int, ...]) -> jax.Array:
        flat: Any = 0
        for axis, i in enumerate(prefix):
            flat = flat * tiles_total[axis] + block_index[axis] * per_block[axis] + i
        sub = jax.random.fold_in(key, jnp.asarray(flat, jnp.uint32))
        return sampler_fn(sub, shape=tile, **kwargs)  # type: ignore[no-any-return]

    def along(axis: int, prefix: tuple[int, ...]) -> jax.Array:
        if axis == len(block):
            return tile_at(prefix)
        return jnp.concatenate([along(axis + 1, (*prefix, i)) for i in range(per_block[axis])],
                               axis=axis)

    return along(0, ())
