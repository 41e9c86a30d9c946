"""The hand-driven MXU of ``jax.experimental.pallas.tpu`` (issue 28): ``matmul_push_rhs``,
``matmul_acc_lhs``, ``matmul_pop`` (JAX 0.11's ``ACC`` Refs and JAX 0.10's addresses),
``matmul_lhs_fifo``/``matmul_pop_fifo``, and ``conv``; on the interpreter against
``jax.numpy``/``lax`` on random inputs, and lowered for TPU."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
RNG = np.random.default_rng(11)


def _x(shape: tuple[int, ...], dtype: Any = F32) -> jax.Array:
    return jnp.asarray(RNG.standard_normal(shape), dtype)


def _acc_ref_kernel(x_ref: Any, w_ref: Any, o_ref: Any, acc: Any) -> None:
    acc[...] = jnp.zeros_like(acc)

    def step(k: Any, carry: Any) -> Any:
        pltpu.matmul_push_rhs(w_ref[k], staging_register=0, mxu_index=0)
        pltpu.matmul_acc_lhs(acc, x_ref[k], load_staged_rhs=0)
        return carry

    lax.fori_loop(0, x_ref.shape[0], step, 0)
    o_ref[...] = pltpu.matmul_pop(acc)
    o_ref[...] += pltpu.matmul_pop(acc)  # popping zeroed it


def _acc_call(backend: str | None) -> Any:
    return pl.pallas_call(_acc_ref_kernel, jax.ShapeDtypeStruct((16, 128), F32),
                          scratch_shapes=[pltpu.ACC(0)((16, 128), F32)], backend=backend)


def test_accumulating_in_an_acc_ref_across_a_loop() -> None:
    x, w = _x((3, 16, 128), BF16), _x((3, 128, 128), BF16)
    expected = sum(jnp.dot(x[k], w[k], preferred_element_type=F32) for k in range(3))
    np.testing.assert_allclose(_acc_call("interpret")(x, w), expected, rtol=1e-5, atol=1e-4)
    text = jax.jit(_acc_call(None)).trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    assert "tpu.matmul" in str(module)


def test_jax_010_addresses_transpose_and_reloading() -> None:
    x, w = _x((16, 128)), _x((128, 128))

    def kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        pltpu.matmul_push_rhs(w_ref[...], 1, 0, transpose=True)
        pltpu.matmul_acc_lhs(3, x_ref[...], 0, load_staged_rhs=1)
        pltpu.matmul_acc_lhs(3, x_ref[...] * 2.0, 0)  # the loaded RHS is reused
        o_ref[...] = pltpu.matmul_pop(3, (16, 128), F32, 0)

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), F32), backend="interpret")(x, w)
    np.testing.assert_allclose(out, 3.0 * jnp.dot(x, w.T, precision="highest"), rtol=2e-2,
                               atol=2e-2)


def test_result_fifo_is_first_in_first_out() -> None:
    x, w = _x((2, 8, 128)), _x((128, 128))

    def kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        pltpu.matmul_push_rhs(w_ref[...], 0, 1)
        pltpu.matmul_lhs_fifo(x_ref[0], 1, load_staged_rhs=0)
        pltpu.matmul_lhs_fifo(x_ref[1], 1)
        o_ref[0] = pltpu.matmul_pop_fifo((8, 128), F32, 1)
        o_ref[1] = pltpu.matmul_pop_fifo((8, 128), F32, 1)

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 8, 128), F32), backend="interpret")(x, w)
    np.testing.assert_allclose(out, jnp.einsum("bmk,kn->bmn", x, w, precision="highest"),
                               rtol=2e-2, atol=2e-2)


def test_registers_do_not_cross_control_flow_and_misuse_is_named() -> None:
    x, w = _x((8, 128)), _x((128, 128))

    def crossing(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        pltpu.matmul_push_rhs(w_ref[...], 0, 0)

        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)

        o_ref[...] = x_ref[...]

    with pytest.raises(pl.UnsupportedError, match="control-flow scope"):
        pl.pallas_call(crossing, jax.ShapeDtypeStruct((8, 128), F32), grid=(1,),
                       backend="interpret")(x, w)

    def twice(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        pltpu.matmul_push_rhs(w_ref[...], 0, 0)
        pltpu.matmul_push_rhs(w_ref[...], 0, 0)

    with pytest.raises(pl.PallasError, match="already holds"):
        pl.pallas_call(twice, jax.ShapeDtypeStruct((8, 128), F32), backend="interpret")(x, w)
    with pytest.raises(pl.PallasError, match="float32 or int32"):
        pltpu.ACC(0)((8, 128), BF16)
    assert pltpu.ACC(1) == pltpu.ACC(1) != pltpu.ACC(0)


@pytest.mark.parametrize("reverse", [False, True])
def test_conv_matches_lax_with_accumulator(reverse: bool) -> None:
    x, k = _x((2, 10, 10, 4)), _x((3, 3, 4, 8))
    acc = _x((2, 8, 8, 8))

    def kernel(x_ref: Any, k_ref: Any, a_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.conv(x_ref[...], k_ref[...], a_ref[...],
                                dimension_numbers=("NHWC", "HWIO", "NHWC"), padding="VALID",
                                window_reversal=(reverse, False))

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(acc.shape, F32),
                         backend="interpret")(x, k, acc)
    kk = jnp.flip(k, 0) if reverse else k
    expected = acc + lax.conv_general_dilated(x, kk, (1, 1), "VALID",
                                              dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="tpu.conv is new in JAX 0.11")
def test_conv_with_accumulator_lowers_and_emulates() -> None:
    """pltpu.conv lowers to tpu.conv (lax.conv_general_dilated's rule) plus the accumulator;
    the emulated module matches lax."""
    x, k, acc = _x((1, 10, 130, 4)), _x((3, 3, 4, 8)), _x((1, 8, 128, 8))

    def kernel(x_ref: Any, k_ref: Any, a_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.conv(x_ref[...], k_ref[...], a_ref[...],
                                dimension_numbers=("NHWC", "HWIO", "NHWC"))

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(acc.shape, F32))
    expected = acc + lax.conv_general_dilated(x, k, (1, 1), "VALID",
                                              dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                              precision=lax.Precision.HIGHEST)
    np.testing.assert_allclose(pl.emulate(f, backend="mosaic_tpu")(x, k, acc), expected,
                               rtol=1e-4, atol=1e-4)
    text = jax.jit(f).trace(x, k, acc).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
