"""Barriers between a program's store to an array and its later accesses to it (``barriers``).

A store and a later load of the same elements can fall to different threads of a program,
which only a barrier orders: on an H100 the seed 3-D grid matmul (its output block zeroed at
``k == 0``, then accumulated into) was wrong in every element without one. These tests read
the order of loads, stores and barriers in the TTIR each kernel lowers to; the kernels also run
in the emulator against ``jax.numpy`` on random inputs (the GPU suite runs them on the GPU).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

pytest.importorskip("pallas_triton")

S = jax.ShapeDtypeStruct


def _ttir(fn: Any, *args: Any) -> str:
    """The TTIR of the one kernel ``fn`` makes (``pl.stages``' first stage, without the
    ``triton`` package that its later stages need)."""
    from pallas_triton import lowering

    from pallas_core.stages import kernel_calls

    (call,) = kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    module, _ = lowering.lower_kernel(call)
    return lowering.module_text(module)


def _memory_ops(ttir: str) -> list[str]:
    """``load``, ``store`` and ``barrier`` in program order, with ``for{``/``}`` around loop
    bodies."""
    out = []
    for line in ttir.splitlines():
        if re.search(r"\btt\.load\b", line):
            out.append("load")
        elif re.search(r"\btt\.store\b", line):
            out.append("store")
        elif "gpu.barrier" in line:
            out.append("barrier")
        elif "scf.for" in line:
            out.append("for{")
    return out


def _rand(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _call(kernel: Any, shape: tuple[int, ...], **kw: Any) -> Any:
    return pl.pallas_call(kernel, S(shape, jnp.float32), backend="triton", **kw)


def test_a_kernel_that_reads_inputs_and_writes_outputs_once_has_no_barrier() -> None:
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * y_ref[...] + 1.0

    x = _rand((64, 128), 0)
    assert "barrier" not in _memory_ops(_ttir(_call(kernel, x.shape), x, x))


def test_store_then_load_of_one_output_is_separated_by_a_barrier() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[...] += x_ref[...] * 2.0

    x = _rand((64, 128), 1)
    fn = _call(kernel, x.shape)
    ops = _memory_ops(_ttir(fn, x))
    # store 0; barrier; load o; load x; barrier (a store after a load of o); store o
    assert ops == ["store", "barrier", "load", "load", "barrier", "store"], ops
    got = pl.emulate(fn, backend="triton", checked=True)(x)
    np.testing.assert_allclose(got, x * 2.0, rtol=1e-6)


def test_a_loop_accumulating_into_an_output_has_a_barrier_at_the_top_of_each_iteration() -> None:
    """The load at the top of an iteration follows the previous iteration's store."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

        def body(i: Any, carry: Any) -> Any:
            o_ref[...] += x_ref[...] * i.astype(jnp.float32)
            return carry

        jax.lax.fori_loop(0, 4, body, 0)

    x = _rand((32, 128), 2)
    fn = _call(kernel, x.shape)
    ops = _memory_ops(_ttir(fn, x))
    loop = ops[ops.index("for{") + 1:]
    # barrier (after the last iteration's store); load o; load x; barrier; store o
    assert loop == ["barrier", "load", "load", "barrier", "store"], ops
    got = pl.emulate(fn, backend="triton", checked=True)(x)
    np.testing.assert_allclose(got, x * 7.0, rtol=1e-6)


def test_an_output_aliased_to_an_input_is_one_array() -> None:
    """Reading the input and then writing its aliased output is a read then a write of one
    buffer: a barrier between them. Without the alias the two are different arrays."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + 1.0

    x = _rand((64, 128), 3)
    aliased = _call(kernel, x.shape, input_output_aliases={0: 0})
    assert _memory_ops(_ttir(aliased, x)) == ["load", "barrier", "store"]
    assert _memory_ops(_ttir(_call(kernel, x.shape), x)) == ["load", "store"]
    got = pl.emulate(aliased, backend="triton", checked=True)(x)
    np.testing.assert_allclose(got, x + 1.0, rtol=1e-6)


def test_the_3d_grid_matmul_zeroes_then_loads_its_output_block_across_a_barrier() -> None:
    """The seed example that was wrong on the GPU: in each step of its K loop the store of
    zeros (under ``pl.when``) and the load of the output block are separated by a barrier."""
    from examples import matmul_3d_grid

    x = _rand((256, 384), 4).astype(jnp.bfloat16)
    y = _rand((384, 256), 5).astype(jnp.bfloat16)
    ttir = _ttir(matmul_3d_grid.matmul, x, y)
    body = ttir[ttir.index("scf.for"):]
    zero_store = body.index("tt.store")  # in the scf.if of pl.when(k == 0)
    output_load = [m.start() for m in re.finditer(r"tt\.load", body)][-1]  # o_ref's
    assert zero_store < output_load
    assert "gpu.barrier" in body[zero_store:output_load]
    got = pl.emulate(matmul_3d_grid.matmul, backend="triton", checked=True)(x, y)
    want = jnp.dot(x, y, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_a_loop_that_reads_what_it_writes_is_not_software_pipelined() -> None:
    """The 3-D grid matmul's K steps read and write the output block: Triton's pipeliner did not
    keep their order on the GPU, so that loop gets ``tt.num_stages = 1``."""
    from examples import matmul_3d_grid

    x = _rand((256, 256), 6).astype(jnp.bfloat16)
    ttir = _ttir(matmul_3d_grid.matmul, x, x)
    assert ttir.count("scf.for") == 1 and "} {tt.num_stages = 1 : i32}" in ttir


def test_a_loop_that_only_reads_keeps_its_pipelining() -> None:
    """Flash attention's loop over K and V blocks reads them and writes nothing."""
    from examples import flash_attention

    q = _rand((256, 64), 7)
    ttir = _ttir(flash_attention.flash_attention, q, q, q)
    assert "scf.for" in ttir and "tt.num_stages" not in ttir


def test_a_while_loop_accumulating_into_an_output_has_barriers_in_its_body() -> None:
    """``lax.while_loop`` is an ``scf.while``: its body's load of the output follows the
    previous iteration's store across a barrier, as in a ``fori_loop``."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

        def body(i: Any) -> Any:
            o_ref[...] += x_ref[...]
            return i + 1

        jax.lax.while_loop(lambda i: i < 3, body, 0)

    x = _rand((32, 128), 8)
    fn = _call(kernel, x.shape)
    ttir = _ttir(fn, x)
    assert "scf.while" in ttir
    body = ttir[ttir.index("scf.while"):]
    first_load = body.index("tt.load")
    assert "gpu.barrier" in body[:first_load]  # after the store before the loop, or the last
    got = pl.emulate(fn, backend="triton", checked=True)(x)
    np.testing.assert_allclose(got, x * 4.0, rtol=1e-6)
