"""``pallas_triton`` offers what ``jax.experimental.pallas.triton`` exports, with JAX's meaning.

``load``/``store`` (whole Ref or view, masks, cache and eviction hints), ``dot``, the atomics
and ``CompilerParams`` with ``None`` fields, as JAX's own GPU kernel library uses them; and
blocks whose dimensions span their whole array may have any size on the Triton backend (the
tensors a kernel reads from them must still be powers of two).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as jax_triton

import pallas_core as pl

pallas_triton = pytest.importorskip("pallas_triton")


def _lower(fn: Any, *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_every_name_of_jax_pallas_triton_is_provided() -> None:
    public = {n for n in dir(jax_triton) if not n.startswith("_")}
    assert public - set(pallas_triton.__all__) == set()


def _gather_scale(x: jax.Array, n: int, interpret: bool = False) -> jax.Array:
    """Layer-norm style: a whole row of ``n`` (not a power of two) read through a 128-wide
    index vector and a mask, with hints; the masked-off lanes lie past the row's end."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        cols = jnp.arange(128)
        mask = cols < n
        row = pallas_triton.load(x_ref.at[cols], mask=mask, other=0.0,
                                 eviction_policy="evict_last", cache_modifier=".cg",
                                 volatile=True)
        total = jnp.sum(row)
        pallas_triton.store(o_ref.at[cols], row / total, mask=mask,
                            eviction_policy="evict_first")

    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((n,), x.dtype), grid=(),
                          compiler_params=pallas_triton.CompilerParams(num_warps=None),
                          interpret=interpret)
    return jax.vmap(call)(x)


def test_load_store_with_masks_and_hints_in_the_interpreter() -> None:
    x = jax.random.uniform(jax.random.key(0), (3, 100), minval=0.5, maxval=1.5)
    np.testing.assert_allclose(_gather_scale(x, 100, interpret=True),
                               x / x.sum(-1, keepdims=True), rtol=1e-6)


def test_whole_row_blocks_of_any_size_lower_for_cuda() -> None:
    """A block dimension equal to its array dimension (here 100) is not a tile: the Triton
    backend lowers it; only the tensors read or written must have power-of-two sizes."""
    text = _lower(lambda x: _gather_scale(x, 100), jnp.ones((3, 100)))
    assert "__gpu$xla.gpu.triton" in text


def test_reading_a_whole_row_of_any_size_is_refused_when_lowered() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0

    def call(interpret: bool) -> Any:
        return jax.vmap(pl.pallas_call(kernel, jax.ShapeDtypeStruct((100,), jnp.float32),
                                       grid=(), compiler_params=pallas_triton.CompilerParams(),
                                       interpret=interpret))

    with pytest.raises(pl.BlockSpecError, match=r"block shape \(100,\).*power-of-two.*Fix: use "
                                                 r"block_shape \(128,\).*read or write of shape "
                                                 r"\(100,\)"):
        _lower(call(False), jnp.ones((3, 100)))
    x = jnp.arange(300.0).reshape(3, 100)
    np.testing.assert_allclose(call(True)(x), x * 2.0)  # the interpreter runs it


@pytest.mark.parametrize("kw,match", [
    ({"cache_modifier": ".cv"}, r"cache_modifier='.cv' is not one of '.ca', '.cg'"),
    ({"eviction_policy": "evict_soon"}, r"eviction_policy='evict_soon' is not one of"),
])
def test_unknown_hints_are_refused(kw: dict[str, Any], match: str) -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pallas_triton.load(x_ref, **kw)

    with pytest.raises(pl.ArgumentError, match=match + r".*Fix"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       interpret=True)(jnp.ones(8))


def test_store_eviction_policy_is_checked() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pallas_triton.store(o_ref, x_ref[...], eviction_policy="evict_always")

    with pytest.raises(pl.ArgumentError, match=r"store: eviction_policy='evict_always'"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       interpret=True)(jnp.ones(8))


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
def test_dot_transposes_and_accumulates_in_float32(trans_a: bool, trans_b: bool) -> None:
    a = jax.random.normal(jax.random.key(1), (16, 32), jnp.float16)
    b = jax.random.normal(jax.random.key(2), (32, 16), jnp.float16)
    a_in, b_in = (a.T if trans_a else a), (b.T if trans_b else b)

    def kernel(a_ref: Any, b_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pallas_triton.dot(a_ref[...], b_ref[...], trans_a=trans_a,
                                       trans_b=trans_b)

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 16), jnp.float32),
                         interpret=True)(a_in, b_in)
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
    np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3)


def test_atomic_add_under_the_triton_name() -> None:
    x = jax.random.normal(jax.random.key(3), (4, 8))

    start = jax.random.normal(jax.random.key(4), (8,))

    def kernel(x_ref: Any, start_ref: Any, o_ref: Any) -> None:
        pallas_triton.atomic_add(o_ref, (slice(None),), x_ref[...])

    whole = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=(4,),
                         in_specs=[pl.BlockSpec((None, 8), lambda i: (i, 0)), whole],
                         out_specs=whole, input_output_aliases={1: 0}, interpret=True)(x, start)
    np.testing.assert_allclose(out, start + x.sum(0), rtol=1e-5, atol=1e-6)


def test_compiler_params_none_means_the_default() -> None:
    params = pallas_triton.CompilerParams(num_warps=None, num_stages=None)
    assert (params.num_warps, params.num_stages) == (4, None)
    assert params == pallas_triton.CompilerParams()
    # None stages: the platform's default, as in JAX (3 on CUDA, 1 on ROCm).
    assert [pallas_triton.compile.default_num_stages(p) for p in ("cuda", "rocm")] == [3, 1]
