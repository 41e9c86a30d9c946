"""What the Triton backend refuses, before lowering, with the fix in the message."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_core as pl

pallas_triton = pytest.importorskip("pallas_triton")


def _copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


def _lower(fn: Any, *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_block_sizes_must_be_powers_of_two() -> None:
    x = jnp.ones((96, 100))
    call = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[pl.BlockSpec((48, 100), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((48, 100), lambda i: (i, 0)), backend="triton")
    with pytest.raises(pl.BlockSpecError, match=r"block shape \(48, 100\).*power-of-two.*"
                                                 r"Fix: use block_shape \(64, 128\)"):
        call(x)


def test_scratch_is_refused() -> None:
    with pytest.raises(pl.UnsupportedError, match=r"scratch_shapes.*'triton'.*Fix"):
        pl.pallas_call(lambda x_ref, o_ref, s_ref: None, jax.ShapeDtypeStruct((8,), jnp.float32),
                       scratch_shapes=[pl.ANY((8,), jnp.float32)], backend="triton")(jnp.ones(8))


def test_primitive_without_a_rule_names_itself_and_the_line() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.cumsum(x_ref[...])

    x = jnp.ones((128,))
    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="triton")
    with pytest.raises(pl.UnsupportedError, match=r"cumsum.*'triton' backend.*test_validation"
                                                   r"\.py:\d+.*Fix"):
        _lower(fn, x)


def test_semaphores_are_refused_by_name() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.semaphore_signal(x_ref.at[0])
        o_ref[...] = x_ref[...]

    with pytest.raises(pl.UnsupportedError, match=r"semaphore_signal.*'triton'.*Fix"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.int32),
                       backend="triton")(jnp.zeros(8, jnp.int32))


def test_compiler_params_select_the_backend_and_validate() -> None:
    x = jnp.ones((128,))
    fn = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        compiler_params=pallas_triton.CompilerParams(num_warps=8, num_stages=2))
    text = _lower(fn, x)
    assert "__gpu$xla.gpu.triton" in text and "num_warps = 8" in text
    with pytest.raises(pl.PallasError, match=r"num_warps=3.*power of two.*Fix"):
        pallas_triton.CompilerParams(num_warps=3)


def test_lowering_for_cpu_is_refused_with_the_fix() -> None:
    x = jnp.ones((128,))
    fn = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="triton")
    with pytest.raises(pl.UnsupportedError, match=r"'triton'.*lowers for \('cuda',\).*'cpu'.*"
                                                   r"Fix"):
        jax.block_until_ready(fn(x))


def test_bad_target_is_explained() -> None:
    x = jnp.ones((128,))
    fn = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="triton")
    with pytest.raises(pl.PallasError, match=r"target 'hopper'.*sm_XY.*Fix"):
        pl.stages(fn, x, backend="triton", target="hopper")
