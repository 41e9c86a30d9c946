"""``jax.Ref`` operands of ``pallas_call`` and ``pl.kernel`` (``jax.new_ref``, and
``plgpu.alloc_semaphore``'s semaphores): the kernel sees the Ref's buffer in the operand's
place, blocked by its BlockSpec like any operand, and what it writes is in the ``jax.Ref``
when the call returns, as JAX's state discharge of ``pallas_call`` makes it. Checked in the
interpreter, eagerly and under ``jax.jit``, against ``jax.numpy`` on random inputs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

F32 = jnp.float32


def _accumulate(x_ref: Any, acc_ref: Any, o_ref: Any) -> None:
    """``o = 2 x`` and ``acc += x``, block by block."""
    o_ref[...] = x_ref[...] * 2.0
    acc_ref[...] += x_ref[...]


def _call(shape: tuple[int, int]) -> Any:
    spec = pl.BlockSpec((8, shape[1]), lambda i: (i, 0))
    return pl.pallas_call(_accumulate, jax.ShapeDtypeStruct(shape, F32),
                          grid=(shape[0] // 8,), in_specs=[spec, spec], out_specs=spec,
                          backend="interpret")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_ref_operand_is_written_in_place(jit: bool) -> None:
    x = jax.random.normal(jax.random.key(0), (32, 128), F32)
    start = jax.random.normal(jax.random.key(1), (32, 128), F32)
    call = _call(x.shape)

    def twice(x: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
        acc = jax.new_ref(start)
        out = call(x, acc)
        out = call(out, acc)
        return out, acc[...]

    out, acc = (jax.jit(twice) if jit else twice)(x, start)
    np.testing.assert_allclose(out, 4.0 * x, rtol=1e-6)
    np.testing.assert_allclose(acc, start + 3.0 * x, rtol=1e-5, atol=1e-6)


def test_a_ref_operand_of_a_mesh_kernel() -> None:
    x = jax.random.normal(jax.random.key(2), (16,), F32)
    counts = jax.new_ref(jnp.zeros((4,), jnp.int32))

    @pl.kernel(out_type=jax.ShapeDtypeStruct((16,), F32), mesh=pl.Mesh(("c",), (4,)),
               backend="interpret")
    def body(counts_ref: Any, x_ref: Any, o_ref: Any) -> None:
        c = jax.lax.axis_index("c")
        counts_ref[c] += c + 1

        @pl.when(c == 0)
        def _() -> None:
            o_ref[...] = x_ref[...] + 1.0

    for _ in range(3):
        out = body(counts, x)
    np.testing.assert_allclose(out, x + 1.0, rtol=1e-6)
    np.testing.assert_array_equal(counts[...], 3 * np.arange(1, 5))


def test_misuse_is_named() -> None:
    x = jnp.ones((16, 128), F32)
    acc = jax.new_ref(jnp.zeros((16, 128), F32))
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    aliased = pl.pallas_call(_accumulate, jax.ShapeDtypeStruct(x.shape, F32), grid=(2,),
                             in_specs=[spec, spec], out_specs=spec,
                             input_output_aliases={1: 0}, backend="interpret")
    with pytest.raises(pl.PallasError, match=r"jax\.Refs and also in input_output_aliases"):
        aliased(x, acc)

    def pair(refs: Any, o_ref: Any) -> None:
        o_ref[...] = refs[0][...]

    nested = pl.pallas_call(pair, jax.ShapeDtypeStruct(x.shape, F32), backend="interpret")
    with pytest.raises(pl.UnsupportedError, match="inside a pytree operand"):
        nested((acc, x))
