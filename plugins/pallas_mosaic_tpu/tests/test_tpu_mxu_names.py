"""The hand-driven MXU of ``jax.experimental.pallas.tpu``: ``matmul_push_rhs``,
``matmul_acc_lhs``, ``matmul_pop`` (JAX 0.11's ``ACC`` Refs and JAX 0.10's addresses),
``matmul_lhs_fifo``/``matmul_pop_fifo``, and ``conv``. Lowered to JAX's ``tpu.matmul_*``
operations with JAX's attributes and accumulator addresses (compared with JAX's module for the
same kernel), and run by the interpreter and, as emitted, by the emulator against
``jax.numpy``/``lax`` on random inputs."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
RNG = np.random.default_rng(11)


def _x(shape: tuple[int, ...], dtype: Any = F32) -> jax.Array:
    return jnp.asarray(RNG.standard_normal(shape), dtype)


def _acc_ref_kernel(x_ref: Any, w_ref: Any, o_ref: Any, acc: Any) -> None:
    def step(k: Any, carry: Any) -> Any:
        pltpu.matmul_push_rhs(w_ref[k], staging_register=0, mxu_index=0)
        pltpu.matmul_acc_lhs(acc, x_ref[k], load_staged_rhs=0)
        return carry

    lax.fori_loop(0, x_ref.shape[0], step, 0)  # an ACC Ref starts at zero
    o_ref[...] = pltpu.matmul_pop(acc)
    o_ref[...] += pltpu.matmul_pop(acc)  # popping zeroed it


def test_accumulating_in_an_acc_ref_across_a_loop() -> None:
    x, w = _x((3, 16, 256), BF16), _x((3, 256, 256), BF16)
    f = pl.pallas_call(_acc_ref_kernel, jax.ShapeDtypeStruct((16, 256), F32),
                       scratch_shapes=[pltpu.ACC(0)((16, 256), F32)])
    expected = sum(jnp.dot(x[k], w[k], preferred_element_type=F32) for k in range(3))
    np.testing.assert_allclose(f(x, w), expected, rtol=1e-5, atol=1e-4)  # the interpreter
    np.testing.assert_allclose(pl.emulate(f, backend="mosaic_tpu", target="v7x")(x, w),
                               expected, rtol=1e-5, atol=1e-4)


def test_jax_010_addresses_transpose_and_reloading() -> None:
    x, w = _x((16, 128)), _x((128, 128))

    def kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        pltpu.matmul_push_rhs(w_ref[...], 1, 0, transpose=True)
        pltpu.matmul_acc_lhs(3, x_ref[...], 0, load_staged_rhs=1)
        pltpu.matmul_acc_lhs(3, x_ref[...] * 2.0, 0)  # the loaded RHS is reused
        o_ref[...] = pltpu.matmul_pop(3, (16, 128), F32, 0)

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), F32))
    expected = 3.0 * jnp.dot(x, w.T, precision="highest")
    np.testing.assert_allclose(f(x, w), expected, rtol=2e-5, atol=2e-4)
    np.testing.assert_allclose(pl.emulate(f, backend="mosaic_tpu")(x, w), expected,
                               rtol=2e-5, atol=2e-4)


def test_result_fifo_is_first_in_first_out() -> None:
    x, w = _x((2, 8, 128)), _x((128, 128))

    def kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        pltpu.matmul_push_rhs(w_ref[...], 0, 1)
        pltpu.matmul_lhs_fifo(x_ref[0], 1, load_staged_rhs=0)
        pltpu.matmul_lhs_fifo(x_ref[1], 1)
        o_ref[0] = pltpu.matmul_pop_fifo((8, 128), F32, 1)
        o_ref[1] = pltpu.matmul_pop_fifo((8, 128), F32, 1)

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 8, 128), F32))
    expected = jnp.einsum("bmk,kn->bmn", x, w, precision="highest")
    np.testing.assert_allclose(f(x, w), expected, rtol=2e-5, atol=2e-4)
    if _FIFO:
        np.testing.assert_allclose(pl.emulate(f, backend="mosaic_tpu")(x, w), expected,
                                   rtol=2e-5, atol=2e-4)
    else:
        with pytest.raises(pl.UnsupportedError, match=r"result FIFO from JAX 0\.11"):
            _module(f, x, w)


def test_registers_do_not_cross_control_flow_in_the_interpreter() -> None:
    """The interpreter refuses by name what it cannot follow; Mosaic TPU lowers it."""
    x, w = _x((8, 128)), _x((128, 128))

    def crossing(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        pltpu.matmul_push_rhs(w_ref[...], 0, 0)

        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)
            o_ref[...] = pltpu.matmul_pop_fifo((8, 128), F32, 0)

    f = pl.pallas_call(crossing, jax.ShapeDtypeStruct((8, 128), F32), grid=(1,))
    with pytest.raises(pl.UnsupportedError, match="outside the loop body or branch"):
        f(x, w)
    if _FIFO:
        np.testing.assert_allclose(pl.emulate(f, backend="mosaic_tpu")(x, w),
                                   jnp.dot(x, w, precision="highest"), rtol=2e-5, atol=2e-4)


def test_misuse_is_named() -> None:
    x, w = _x((8, 128)), _x((128, 128))

    def twice(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        pltpu.matmul_push_rhs(w_ref[...], 0, 0)
        pltpu.matmul_push_rhs(w_ref[...], 0, 0)

    with pytest.raises(pl.PallasError, match="already holds"):
        pl.pallas_call(twice, jax.ShapeDtypeStruct((8, 128), F32))(x, w)
    with pytest.raises(pl.PallasError, match="float32 or int32"):
        pltpu.ACC(0)((8, 128), BF16)
    assert pltpu.ACC(1) == pltpu.ACC(1) != pltpu.ACC(0)

    def reads_acc(x_ref: Any, w_ref: Any, o_ref: Any, acc: Any) -> None:
        o_ref[...] = acc[...]

    f = pl.pallas_call(reads_acc, jax.ShapeDtypeStruct((8, 256), F32),
                       scratch_shapes=[pltpu.ACC(0)((8, 256), F32)])
    with (pytest.raises(pl.UnsupportedError, match=r"read with pltpu\.matmul_pop"),
          plb.assume_device("TPU7x", "tpu")):
        _module(f, x, w)
    with pytest.raises(pl.UnsupportedError, match=r"TPU v5e \(its MXUs have no accumulator memory"):
        _module(f, x, w)  # the default chip, v5e, has no accumulators
    too_many = pl.pallas_call(lambda x_ref, w_ref, o_ref, acc: None,
                              jax.ShapeDtypeStruct((8, 256), F32),
                              scratch_shapes=[pltpu.ACC(0)((8 * 129, 256), F32)])
    with (pytest.raises(pl.UnsupportedError, match="accumulator memory is full"),
          plb.assume_device("TPU7x", "tpu")):
        _module(too_many, x, w)


# --- lowered as JAX lowers them, emulated against jax.numpy ----------------------------------

_FIFO = jax.__version_info__ >= (0, 11)
"""Whether the installed jaxlib's Mosaic dialect has the result FIFO (JAX 0.11 on)."""
_ACC_REFS = jax.__version_info__ >= (0, 11)
"""Whether JAX's API addresses accumulators by ACC Refs (0.11 on) or by address (0.10)."""


def _module(f: Any, *args: Any) -> str:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    return str(module)


def _mxu_ops(module: str) -> list[str]:
    """The module's hand-driven MXU operations, with their attributes and types."""
    return [re.sub(r"%[\w#]+", "%", line.strip()) for line in module.splitlines()
            if "tpu.matmul_" in line]


def _mxu_kernel(m: Any, mxu: Any, dtype: Any, out: Any) -> Any:
    """Two accumulators (JAX 0.11's ACC Refs, else JAX 0.10's addresses) filled over a loop on
    two MXUs, one of them reloading its RHS halfway, and a FIFO product where there is one."""
    cols = 256

    def body(x_ref: Any, w_ref: Any, o_ref: Any, acc0: Any = None, acc1: Any = None) -> None:
        def step(k: Any, carry: Any) -> Any:
            mxu.matmul_push_rhs(w_ref[k], staging_register=0, mxu_index=0)
            mxu.matmul_push_rhs(w_ref[k], staging_register=1, mxu_index=1, transpose=True)
            if acc0 is not None:
                mxu.matmul_acc_lhs(acc0, x_ref[k], load_staged_rhs=0)
                mxu.matmul_acc_lhs(acc1, x_ref[k], load_staged_rhs=1)
                mxu.matmul_acc_lhs(acc1, x_ref[k])  # the loaded RHS again
            else:
                mxu.matmul_acc_lhs(0, x_ref[k], 0, load_staged_rhs=0)
                mxu.matmul_acc_lhs(4, x_ref[k], 1, load_staged_rhs=1)
                mxu.matmul_acc_lhs(4, x_ref[k], 1)
            return carry

        lax.fori_loop(0, x_ref.shape[0], step, 0)
        if acc0 is not None:
            o_ref[0] = mxu.matmul_pop(acc0).astype(out)
            o_ref[1] = mxu.matmul_pop(acc1).astype(out)
        else:
            o_ref[0] = mxu.matmul_pop(0, (16, cols), out, 0)
            o_ref[1] = mxu.matmul_pop(4, (16, cols), out, 1)
        if _FIFO:
            mxu.matmul_push_rhs(w_ref[0], 2, 0)
            mxu.matmul_lhs_fifo(x_ref[0], 0, load_staged_rhs=2)
            o_ref[2] = mxu.matmul_pop_fifo((16, cols), out, 0).astype(out)

    def kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        if not _ACC_REFS:
            return body(x_ref, w_ref, o_ref)
        m.run_scoped(lambda a0, a1: body(x_ref, w_ref, o_ref, a0, a1),
                     mxu.ACC(0)((16, cols), out), mxu.ACC(1)((16, cols), out))

    return m.pallas_call(kernel, jax.ShapeDtypeStruct((3, 16, cols), out))


@pytest.mark.parametrize("dtype", [BF16, F32, jnp.int8], ids=["bf16", "f32", "int8"])
def test_mxu_lowers_like_jax_and_emulates_to_jnp(dtype: Any) -> None:
    """The tpu.matmul_* operations with JAX's attributes, and the ACC Refs at JAX's addresses;
    the emitted module, run by the emulator with an MXU of its own, and the interpreter match
    jax.numpy on random inputs."""
    from jax.experimental import pallas as jax_pl
    from jax.experimental.pallas import tpu as jax_pltpu

    if dtype == jnp.int8:
        x = jnp.asarray(RNG.integers(-128, 128, (2, 16, 256)), dtype)
        w = jnp.asarray(RNG.integers(-128, 128, (2, 256, 256)), dtype)
    else:
        x, w = _x((2, 16, 256), dtype), _x((2, 256, 256), dtype)
    out = jnp.int32 if dtype == jnp.int8 else F32
    wide = np.int64 if dtype == jnp.int8 else np.float64
    xs, ws = np.asarray(x).astype(wide), np.asarray(w).astype(wide)
    a0 = sum(xs[k] @ ws[k] for k in range(2))
    a1 = sum(2 * xs[k] @ ws[k].T for k in range(2))
    want = np.stack([a0, a1, xs[0] @ ws[0]])[:3 if _FIFO else 2].astype(out)
    tol = {"rtol": 1e-5, "atol": 1e-3} if out == F32 else {"rtol": 0, "atol": 0}

    with plb.assume_device("TPU7x", "tpu"):
        ours = _module(_mxu_kernel(pl, pltpu, dtype, out), x, w)
        theirs = _module(_mxu_kernel(jax_pl, jax_pltpu, dtype, out), x, w)
    assert _mxu_ops(ours) == _mxu_ops(theirs)
    assert len(_mxu_ops(ours)) == (10 if _FIFO else 7)
    f = _mxu_kernel(pl, pltpu, dtype, out)
    n = len(want)
    np.testing.assert_allclose(
        np.asarray(pl.emulate(f, backend="mosaic_tpu", target="v7x")(x, w))[:n], want, **tol)
    if _ACC_REFS:  # the interpreter cannot carry JAX 0.10's addressed accumulators out of a
        np.testing.assert_allclose(np.asarray(f(x, w))[:n], want, **tol)  # loop (see mxu.py)


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
