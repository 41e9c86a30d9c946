"""``lax.conv_general_dilated`` (and ``pltpu.conv``) in Mosaic TPU kernels, from JAX 0.11 on:
lowered to ``tpu.conv`` as JAX lowers it (its dimension numbers, strides, padding,
dilations, feature groups, precision), agreeing with JAX's module; the emulated module and
the interpreter match XLA's convolution on random inputs. Refused by name at JAX 0.10, whose
lowering has no rule for it."""

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

NEW_IN_011 = jax.__version_info__ >= (0, 11)


def _lower(f: Callable[..., Any], *args: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found


# name: (lhs shape, rhs shape, dtype, conv keyword arguments)
CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], Any, dict[str, Any]]] = {
    "1d-same": ((2, 16, 128), (3, 128, 128), jnp.float32,
                dict(window_strides=(1,), padding="SAME", dimension_numbers=("NWC", "WIO",
                                                                             "NWC"))),
    "2d-strided-dilated": ((1, 8, 16, 128), (3, 3, 128, 128), jnp.float32,
                           dict(window_strides=(2, 1), padding=((1, 1), (2, 0)),
                                rhs_dilation=(1, 2),
                                dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "grouped-nchw": ((2, 16, 8, 128), (16, 8, 2, 2), jnp.float32,
                     dict(window_strides=(1, 1), padding="VALID", feature_group_count=2,
                          dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    "bf16-to-f32": ((2, 16, 128), (3, 128, 128), jnp.bfloat16,
                    dict(window_strides=(1,), padding="VALID",
                         dimension_numbers=("NWC", "WIO", "NWC"),
                         preferred_element_type=jnp.float32)),
}


def _call(m: Any, lhs: Any, rhs: Any, kw: dict[str, Any], **call_kw: Any) -> Any:
    out = jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, **kw), lhs, rhs)

    def kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        o_ref[...] = lax.conv_general_dilated(x_ref[...], w_ref[...], **kw)

    return m.pallas_call(kernel, out, **call_kw)


def _inputs(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dtype: Any
            ) -> tuple[jax.Array, jax.Array]:
    ka, kb = jax.random.split(jax.random.key(len(lhs_shape)))
    return (jax.random.normal(ka, lhs_shape).astype(dtype),
            (jax.random.normal(kb, rhs_shape) / 16).astype(dtype))


@pytest.mark.skipif(not NEW_IN_011, reason="tpu.conv is new in JAX 0.11")
@pytest.mark.parametrize("name", list(CASES))
def test_conv_lowers_like_jax_and_matches_xla(name: str) -> None:
    lhs_shape, rhs_shape, dtype, kw = CASES[name]
    lhs, rhs = _inputs(lhs_shape, rhs_shape, dtype)
    want = np.asarray(lax.conv_general_dilated(lhs, rhs, **kw,
                                               precision=lax.Precision.HIGHEST), np.float32)
    got = pl.emulate(_call(pl, lhs, rhs, kw), backend="mosaic_tpu", target="v6e")(lhs, rhs)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-5, atol=2e-4)
    interpreted = _call(pl, lhs, rhs, kw, backend="interpret")(lhs, rhs)
    np.testing.assert_allclose(np.asarray(interpreted, np.float32), want, rtol=2e-2,
                               atol=2e-2)
    with plb.assume_device("TPU v6 lite", "tpu"):
        _, ours = _lower(_call(pl, lhs, rhs, kw), lhs, rhs)
        _, theirs = _lower(_call(jax_pl, lhs, rhs, kw), lhs, rhs)
    inspection.assert_same_kernel(ours, theirs)
    conv = [line.split("{", 1)[1] for line in str(ours).splitlines() if "tpu.conv" in line]
    jax_conv = [line.split("{", 1)[1] for line in str(theirs).splitlines()
                if "tpu.conv" in line]
    assert conv and conv == jax_conv  # the same attributes: dimension numbers, padding, ...


@pytest.mark.skipif(not NEW_IN_011, reason="tpu.conv is new in JAX 0.11")
def test_unsigned_operands_are_refused_by_name() -> None:
    lhs = jnp.ones((1, 8, 128), jnp.uint8)
    rhs = jnp.ones((1, 128, 128), jnp.uint8)
    kw = dict(window_strides=(1,), padding="VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    with plb.assume_device("TPU v6 lite", "tpu"), pytest.raises(
            pl.UnsupportedError, match="convolution of uint8"):
        _lower(_call(pl, lhs, rhs, kw), lhs, rhs)


@pytest.mark.skipif(NEW_IN_011, reason="lowers from JAX 0.11 on")
def test_conv_is_refused_by_name_before_jax_011() -> None:
    lhs_shape, rhs_shape, dtype, kw = CASES["1d-same"]
    lhs, rhs = _inputs(lhs_shape, rhs_shape, dtype)
    with plb.assume_device("TPU v6 lite", "tpu"), pytest.raises(
            pl.UnsupportedError, match=r"convolution.*JAX 0\.11"):
        _lower(_call(pl, lhs, rhs, kw), lhs, rhs)
