"""``dot_general`` in Mosaic TPU kernels beyond the 2-D matrix product: batch dimensions (a
Newton-Schulz inverse or a blockwise triangular inverse multiplies stacks of matrices),
contracting either dimension of either operand, ``precision=``, and the matrix-vector product
of narrow floats that JAX lowers as a multiply and a sum. Each lowers as JAX lowers it (the
same kernel, the same ``tpu.matmul`` dimension numbers and precision; JAX's lowering of the
matrix-vector product does not verify, so there only the form is checked), and the emitted
module run by the emulator and the kernel run by the interpreter match ``jax.numpy``."""

from __future__ import annotations

import re
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

F32, BF16 = jnp.float32, jnp.bfloat16


def _lower(f: Callable[..., Any], *args: Any) -> Any:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found[1]


def _call(m: Any, fn: Callable[..., Any], out: jax.ShapeDtypeStruct, **kw: Any) -> Any:
    def kernel(a_ref: Any, b_ref: Any, o_ref: Any) -> None:
        o_ref[...] = fn(a_ref[...], b_ref[...])

    return m.pallas_call(kernel, out, **kw)


def _dims(module: Any) -> list[str]:
    return re.findall(r"#tpu\.dot_dimension_numbers<[^>]*>|#tpu\.contract_precision<\w+>",
                      str(module))


CASES = {
    "batched": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b,
                                        preferred_element_type=F32),
                (4, 64, 128), (4, 128, 128), F32, (4, 64, 128)),
    "batched-transposed-rhs": (lambda a, b: lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))),
                                                            preferred_element_type=F32),
                               (2, 128, 128), (2, 64, 128), F32, (2, 128, 64)),
    "lhs-contracting-0": (lambda a, b: lax.dot_general(a, b, (((0,), (0,)), ((), ()))),
                          (128, 64), (128, 128), F32, (64, 128)),
    "highest": (lambda a, b: jnp.dot(a, b, precision=lax.Precision.HIGHEST),
                (64, 128), (128, 128), F32, (64, 128)),
    "matvec-bf16": (lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                 preferred_element_type=F32),
                    (64, 128), (1, 128), BF16, (64, 1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_like_jax_and_matches_jnp(name: str) -> None:
    fn, a_shape, b_shape, dtype, out_shape = CASES[name]
    a = jax.random.normal(jax.random.key(0), a_shape, F32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), b_shape, F32).astype(dtype)
    out = jax.ShapeDtypeStruct(out_shape, F32)
    want = np.asarray(fn(a.astype(F32), b.astype(F32)), np.float32)
    tol = 2e-2 if dtype == BF16 else 1e-4
    got = _call(pl, fn, out, backend="interpret")(a, b)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    emulated = pl.emulate(_call(pl, fn, out), backend="mosaic_tpu")(a, b)
    np.testing.assert_allclose(emulated, want, rtol=tol, atol=tol)
    ours = _lower(_call(pl, fn, out), a, b)
    if name == "matvec-bf16":
        # JAX's lowering broadcasts the bfloat16 operands straight to float32, which does not
        # verify (JAX 0.10.2 to 0.12); this backend widens them after broadcasting.
        assert "tpu.matmul" not in str(ours) and "vector.multi_reduction" in str(ours)
        with plb.assume_device("TPU v5 lite", "tpu"), pytest.raises(Exception,
                                                                    match=r"vector\.broadcast"):
            _lower(_call(jax_pl, fn, out), a, b)
        return
    with plb.assume_device("TPU v5 lite", "tpu"):
        theirs = _lower(_call(jax_pl, fn, out), a, b)
    inspection.assert_same_kernel(ours, theirs)
    assert _dims(ours) == _dims(theirs)


def test_unsigned_integers_are_refused_by_name() -> None:
    a = jnp.ones((64, 128), jnp.uint8)
    out = jax.ShapeDtypeStruct((64, 64), jnp.int32)
    fn = lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),  # noqa: E731
                                      preferred_element_type=jnp.int32)
    with pytest.raises(pl.UnsupportedError, match="unsigned integers"):
        _lower(_call(pl, fn, out), a, a)


@pytest.mark.parametrize("dtype", [BF16, jnp.float16, jnp.int8], ids=["bf16", "f16", "int8"])
def test_a_narrow_result_accumulates_in_32_bits(dtype: Any) -> None:
    """``jnp.dot`` of 16- or 8-bit operands into a result of their type: a ``tpu.matmul`` into
    a 32-bit accumulator, then narrowed (JAX's lowering emits a narrow accumulator, which
    does not verify); emulated and interpreted, it matches ``jax.numpy``."""
    kx, kw = jax.random.split(jax.random.key(7))
    if dtype == jnp.int8:
        x = jax.random.randint(kx, (16, 128), -4, 4).astype(dtype)
        w = jax.random.randint(kw, (128, 128), -4, 4).astype(dtype)
    else:
        x = jax.random.normal(kx, (16, 128), dtype)
        w = jax.random.normal(kw, (128, 128), dtype)
    f = _call(pl, jnp.dot, jax.ShapeDtypeStruct((16, 128), dtype))
    want = np.asarray(jnp.dot(x, w)).astype(np.float32)
    module = str(_lower(f, x, w))
    wide = "i32" if dtype == jnp.int8 else "f32"
    assert re.search(rf"tpu\.matmul .*-> vector<16x128x{wide}>", module), module
    for got in (pl.emulate(f, backend="mosaic_tpu")(x, w), f(x, w)):
        np.testing.assert_allclose(np.asarray(got).astype(np.float32), want, rtol=1e-2,
                                   atol=1e-2)
