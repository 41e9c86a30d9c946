"""``jnp.argmax`` and ``jnp.argmin`` in Mosaic TPU kernels (a top-k router picks its experts
so): lowered to ``tpu.reduce_index`` as JAX lowers them (float32 to int32, bfloat16 to int16
widened to int32; 1-D inputs as one row), agreeing with JAX's module; the emitted module run by
the emulator and the kernel run by the interpreter match ``jax.numpy`` on random inputs."""

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


def _kernel(m: Any, fn: Any, shape: tuple[int, ...], axis: int, **kw: Any) -> Any:
    """``fn(x, axis)`` of a whole (unblocked) VMEM block, as int32 (the index of a 1-D
    block broadcast over an (8, 128) block)."""
    out = shape[:axis] + shape[axis + 1:] or (8, 128)

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.broadcast_to(fn(x_ref[...], axis=axis).astype(jnp.int32), out)

    return m.pallas_call(kernel, jax.ShapeDtypeStruct(out, jnp.int32), **kw)


CASES = [(jnp.argmax, (8, 128), 1, jnp.float32), (jnp.argmin, (8, 128), 0, jnp.float32),
         (jnp.argmax, (16, 256), 1, jnp.bfloat16), (jnp.argmin, (256,), 0, jnp.float32)]


@pytest.mark.parametrize("fn, shape, axis, dtype", CASES,
                         ids=["max-rows-f32", "min-cols-f32", "max-rows-bf16", "min-1d"])
def test_lowers_like_jax_and_matches_jnp(fn: Any, shape: tuple[int, ...], axis: int,
                                         dtype: Any) -> None:
    if dtype == jnp.bfloat16 and jax.__version_info__ < (0, 11):
        pytest.skip("tpu.reduce_index of bfloat16 is new in JAX 0.11 (its lowering refuses "
                    "it before, as this backend's does)")
    # Distinct values, so that the index of the extreme is unique.
    x = jax.random.permutation(jax.random.key(0), np.prod(shape)).reshape(shape)
    x = (x.astype(jnp.float32) / 8.0).astype(dtype)
    want = np.broadcast_to(np.asarray(fn(x, axis=axis)), shape[:axis] + shape[axis + 1:]
                           or (8, 128))
    got = _kernel(pl, fn, shape, axis, backend="interpret")(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        pl.emulate(_kernel(pl, fn, shape, axis), backend="mosaic_tpu")(x), want)
    _, ours = _lower(_kernel(pl, fn, shape, axis), x)
    with plb.assume_device("TPU v5 lite", "tpu"):
        _, theirs = _lower(_kernel(jax_pl, fn, shape, axis), x)
    inspection.assert_same_kernel(ours, theirs)
    kind = "arg_max" if fn is jnp.argmax else "arg_min"
    assert f"#tpu.reduction_kind<{kind}>" in str(ours)


def test_other_dtypes_are_refused_by_name() -> None:
    x = jnp.arange(8 * 128, dtype=jnp.int32).reshape(8, 128)
    with pytest.raises(pl.UnsupportedError, match=r"jnp\.argmax of int32"):
        _lower(_kernel(pl, jnp.argmax, (8, 128), 1), x)
