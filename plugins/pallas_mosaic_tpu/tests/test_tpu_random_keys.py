"""``jax.random`` with key arrays inside Mosaic TPU kernels: ``random_seed``, ``random_bits``,
``random_fold_in``, ``random_wrap``/``random_unwrap`` and ``iota_2x32_shape`` lowered as JAX
lowers them (the key implementation's functions on the key's words, threefry inlined),
agreeing with JAX's module; the emitted module run by the emulator gives ``jax.random``'s
samples bit for bit, and so does ``pltpu.sample_block``."""

from __future__ import annotations

import functools
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

SEED = 1234


def _lower(f: Callable[..., Any], *args: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found


def _call(m: Any, tpu: Any, kernel: Any, dtype: Any = jnp.float32, **kw: Any) -> Any:
    return m.pallas_call(functools.partial(kernel, m), jax.ShapeDtypeStruct((16, 128), dtype),
                         grid=(2,), in_specs=[m.BlockSpec(memory_space=tpu.SMEM)],
                         out_specs=m.BlockSpec((8, 128), lambda i: (i, 0)), **kw)


def _uniform(m: Any, seed_ref: Any, o_ref: Any) -> None:
    key = jax.random.fold_in(jax.random.key(seed_ref[0]), m.program_id(0))
    o_ref[...] = jax.random.uniform(key, (8, 128))


def _bits_of_wrapped(m: Any, seed_ref: Any, o_ref: Any) -> None:
    words = jax.random.key_data(jax.random.key(seed_ref[0]))  # random_unwrap
    key = jax.random.wrap_key_data(words)  # random_wrap
    o_ref[...] = jax.random.bits(jax.random.fold_in(key, m.program_id(0)), (8, 128))


def _normal(m: Any, seed_ref: Any, o_ref: Any) -> None:
    key = jax.random.fold_in(jax.random.key(seed_ref[0]), m.program_id(0))
    o_ref[...] = jax.random.normal(key, (8, 128))


def _reference(draw: Callable[..., Any]) -> np.ndarray:
    key = jax.random.key(SEED)
    return np.concatenate([np.asarray(draw(jax.random.fold_in(key, i))) for i in range(2)])


CASES = {
    "uniform": (_uniform, jnp.float32, lambda k: jax.random.uniform(k, (8, 128))),
    "bits-wrapped": (_bits_of_wrapped, jnp.uint32, lambda k: jax.random.bits(k, (8, 128))),
    "normal": (_normal, jnp.float32, lambda k: jax.random.normal(k, (8, 128))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_keys_lower_like_jax_and_draw_jax_randoms_samples(name: str) -> None:
    kernel, dtype, draw = CASES[name]
    seed = jnp.array([SEED], jnp.int32)
    want = _reference(draw)
    emulated = pl.emulate(_call(pl, pltpu, kernel, dtype), backend="mosaic_tpu")(seed)
    if dtype == jnp.float32 and name == "normal":  # erf_inv: the emulator's float rounding
        np.testing.assert_allclose(emulated, want, rtol=2e-6, atol=2e-6)
    else:
        np.testing.assert_array_equal(emulated, want)
    np.testing.assert_array_equal(_call(pl, pltpu, kernel, dtype, backend="interpret")(seed),
                                  want)
    _, ours = _lower(_call(pl, pltpu, kernel, dtype), seed)
    with plb.assume_device("TPU v5 lite", "tpu"):
        _, theirs = _lower(_call(jax_pl, jax_pltpu, kernel, dtype), seed)
    inspection.assert_same_kernel(ours, theirs)


def test_sample_block_lowers_and_draws_the_interpreters_samples() -> None:
    """``pltpu.sample_block`` (keys from ``pltpu.to_pallas_key``, threefry here): the emulated
    module draws what the interpreter draws, block for block, whatever the block shape."""
    key = pltpu.to_pallas_key(jax.random.key(7))
    words = jax.random.key_data(key)

    def kernel(key_ref: Any, o_ref: Any) -> None:
        words = (key_ref[0], key_ref[1])  # SMEM is read a scalar at a time
        o_ref[...] = pltpu.sample_block(jax.random.uniform, words, block_size=(8, 128),
                                        tile_size=(8, 128), total_size=(16, 256))

    def call(**kw: Any) -> Any:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 256), jnp.float32),
                              grid=(2, 2), in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
                              out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)), **kw)

    want = call(backend="interpret")(words)
    np.testing.assert_array_equal(pl.emulate(call(), backend="mosaic_tpu")(words), want)
    assert len(np.unique(np.asarray(want))) > 4000  # different samples in every block


def test_a_batch_of_keys_is_refused_by_name() -> None:
    def kernel(m: Any, seed_ref: Any, o_ref: Any) -> None:
        keys = jax.random.split(jax.random.key(seed_ref[0]), 2)
        o_ref[...] = jax.random.uniform(keys[0], (8, 128)) + jax.vmap(
            lambda k: jax.random.uniform(k, ()))(keys)[0]

    seed = jnp.array([SEED], jnp.int32)
    with pytest.raises(pl.UnsupportedError, match=r"random_split|a batch of"):
        _lower(_call(pl, pltpu, kernel), seed)
