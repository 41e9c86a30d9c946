"""``jnp.take_along_axis`` in Mosaic TPU kernels: ``lax.gather`` lowered to
``tpu.dynamic_gather`` as JAX lowers it (along one of the two minor dimensions), agreeing with
JAX's module; the emitted module run by the emulator and the kernel run by the interpreter
match ``jax.numpy`` on random inputs and random indices. Other gathers are refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402


def _lower(f: Callable[..., Any], *args: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found


def _kernel(m: Any, shape: tuple[int, ...], dtype: Any, axis: int, **kw: Any) -> Any:
    def kernel(x_ref: Any, i_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.take_along_axis(x_ref[...], i_ref[...], axis=axis)

    return m.pallas_call(kernel, jax.ShapeDtypeStruct(shape, dtype), **kw)


CASES = [((8, 128), 1, jnp.float32), ((8, 128), 0, jnp.int32),
         ((16, 128), 1, jnp.bfloat16), ((2, 8, 128), 1, jnp.float32)]


@pytest.mark.parametrize("shape, axis, dtype", CASES,
                         ids=["lanes-f32", "sublanes-i32", "lanes-bf16", "3d-sublanes-f32"])
def test_lowers_like_jax_and_matches_jnp(shape: tuple[int, ...], axis: int, dtype: Any) -> None:
    kx, ki = jax.random.split(jax.random.key(1))
    x = (jax.random.normal(kx, shape) * 100).astype(dtype)
    # Random indices, some negative (take_along_axis wraps them before its gather).
    idx = jax.random.randint(ki, shape, -shape[axis], shape[axis], jnp.int32)
    want = np.asarray(jnp.take_along_axis(x, idx, axis=axis))
    np.testing.assert_array_equal(_kernel(pl, shape, dtype, axis, backend="interpret")(x, idx),
                                  want)
    np.testing.assert_array_equal(
        pl.emulate(_kernel(pl, shape, dtype, axis), backend="mosaic_tpu")(x, idx), want)
    _, ours = _lower(_kernel(pl, shape, dtype, axis), x, idx)
    with plb.assume_device("TPU v5 lite", "tpu"):
        _, theirs = _lower(_kernel(jax_pl, shape, dtype, axis), x, idx)
    inspection.assert_same_kernel(ours, theirs)
    assert "tpu.dynamic_gather" in str(ours)


def test_a_major_axis_is_refused_by_name() -> None:
    shape = (4, 8, 128)
    x = jnp.ones(shape, jnp.float32)
    idx = jnp.zeros(shape, jnp.int32)
    with pytest.raises(pl.UnsupportedError, match=r"take_along_axis along axis 0.*swapaxes"):
        _lower(_kernel(pl, shape, jnp.float32, 0), x, idx)


def test_other_gathers_are_refused_by_name() -> None:
    def kernel(x_ref: Any, i_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...][i_ref[...][:, 0]]  # rows picked by index: a general gather

    x = jnp.ones((8, 128), jnp.float32)
    idx = jnp.zeros((8, 128), jnp.int32)
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))
    with pytest.raises(pl.UnsupportedError, match=r"lax\.gather with .*take_along_axis"):
        _lower(f, x, idx)
