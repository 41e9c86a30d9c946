"""``lax.top_k`` and ``lax.approx_max_k`` in Mosaic TPU kernels (JAX 0.11 on, as JAX's own
lowering): rounds of ``argmax`` and masking, as JAX lowers them, agreeing with JAX's module;
the emulated module and the interpreter give ``lax.top_k``'s values and indices on random
inputs (float32 from TPU v4 on, bfloat16 from v6 on); ``approx_max_k`` keeps the per-bin
maxima that a NumPy model of its binning keeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402
from pallas_mosaic_tpu.topk import bins_for  # noqa: E402

pytestmark = pytest.mark.skipif(jax.__version_info__ < (0, 11),
                                reason="top_k lowers for TPU from JAX 0.11 on, as JAX's rule")
CHIP = "TPU v6 lite"  # bfloat16 top_k needs TPU v6


def _lower(f: Callable[..., Any], *args: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found


def _distinct(shape: tuple[int, ...], dtype: Any, seed: int) -> jax.Array:
    """Random values without ties (so that every index is determined)."""
    x = jax.random.permutation(jax.random.key(seed), int(np.prod(shape))).reshape(shape)
    return (x.astype(jnp.float32) / 4.0 - 100.0).astype(dtype)


def _call(m: Any, fn: Any, x: Any, k: int, axis: int, **kw: Any) -> Any:
    shape = list(x.shape)
    shape[axis] = k
    out = (jax.ShapeDtypeStruct(tuple(shape), x.dtype),
           jax.ShapeDtypeStruct(tuple(shape), jnp.int32))

    def kernel(x_ref: Any, v_ref: Any, i_ref: Any) -> None:
        v_ref[...], i_ref[...] = fn(x_ref[...])

    return m.pallas_call(kernel, out, **kw)


TOP_K = [((8, 256), 4, -1, jnp.float32), ((8, 128), 3, -1, jnp.bfloat16),
         ((16, 128), 2, 0, jnp.float32)]


@pytest.mark.parametrize("shape, k, axis, dtype", TOP_K, ids=["f32", "bf16", "rows-f32"])
def test_top_k_lowers_like_jax_and_matches_lax(shape: tuple[int, ...], k: int, axis: int,
                                               dtype: Any) -> None:
    x = _distinct(shape, dtype, seed=k)
    fn = lambda v: lax.top_k(v, k, axis=axis, is_stable=False)  # noqa: E731
    moved = jnp.moveaxis(x, axis, -1)
    want_v, want_i = (np.moveaxis(np.asarray(a), -1, axis) for a in lax.top_k(moved, k))
    got_v, got_i = pl.emulate(_call(pl, fn, x, k, axis), backend="mosaic_tpu",
                              target="v6e")(x)
    with plb.assume_device(CHIP, "tpu"):
        _, ours = _lower(_call(pl, fn, x, k, axis), x)
        _, theirs = _lower(_call(jax_pl, fn, x, k, axis), x)
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_array_equal(got_i, want_i)
    v, i = _call(pl, fn, x, k, axis, backend="interpret")(x)
    np.testing.assert_array_equal(v, want_v)
    np.testing.assert_array_equal(i, want_i)
    inspection.assert_same_kernel(ours, theirs)
    assert "tpu.reduce_index" in str(ours)


def _binned_model(x: np.ndarray, k: int, recall_target: float) -> tuple[np.ndarray, ...]:
    """approx_max_k along the last axis, in NumPy: element j in bin j % bins, each bin's
    maximum (its first index on ties), then the k largest bins."""
    n = x.shape[-1]
    bins = bins_for(n, k, recall_target, minor=True)
    padded = np.full((*x.shape[:-1], -(-n // bins) * bins), -np.inf, np.float64)
    padded[..., :n] = x
    folded = padded.reshape((*x.shape[:-1], -1, bins))
    which = np.argmax(folded, axis=-2)
    best = np.take_along_axis(folded, which[..., None, :], axis=-2)[..., 0, :]
    index = which * bins + np.arange(bins)
    order = np.argsort(-best, axis=-1, kind="stable")[..., :k]
    return (np.take_along_axis(best, order, -1).astype(x.dtype),
            np.take_along_axis(index, order, -1))


@pytest.mark.parametrize("recall", [0.95, 0.99, 1.0])
def test_approx_max_k_keeps_the_binned_maxima(recall: float) -> None:
    x = _distinct((8, 512), jnp.float32, seed=5)
    fn = lambda v: lax.approx_max_k(v, 4, recall_target=recall)  # noqa: E731
    want_v, want_i = _binned_model(np.asarray(x), 4, recall)
    got_v, got_i = pl.emulate(_call(pl, fn, x, 4, -1), backend="mosaic_tpu",
                              target="v6e")(x)
    with plb.assume_device(CHIP, "tpu"):
        _, ours = _lower(_call(pl, fn, x, 4, -1), x)
        _, theirs = _lower(_call(jax_pl, fn, x, 4, -1), x)
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_array_equal(got_i, want_i)
    inspection.assert_same_kernel(ours, theirs)
    if recall == 1.0:  # one bin per element: exactly lax.top_k
        np.testing.assert_array_equal(got_v, lax.top_k(x, 4)[0])


def test_refusals_name_what_and_why() -> None:
    x = _distinct((8, 128), jnp.float32, seed=0)
    stable = lambda v: lax.top_k(v, 2)  # noqa: E731  (is_stable=True by default)
    with pytest.raises(pl.UnsupportedError, match=r"is_stable=True.*is_stable=False"):
        _lower(_call(pl, stable, x, 2, -1), x)
    xb = x.astype(jnp.bfloat16)
    fn = lambda v: lax.top_k(v, 2, is_stable=False)  # noqa: E731
    with plb.assume_device("TPU v5 lite", "tpu"), pytest.raises(
            pl.UnsupportedError, match=r"top_k of bfloat16 on .*generation 6"):
        _lower(_call(pl, fn, xb, 2, -1), xb)
    xi = jnp.arange(8 * 128, dtype=jnp.int32).reshape(8, 128)
    with plb.assume_device(CHIP, "tpu"), pytest.raises(pl.UnsupportedError,
                                                       match=r"top_k of int32"):
        _lower(_call(pl, fn, xi, 2, -1), xi)
