"""Which grid axes become CUDA thread blocks and which run in order inside one.

Parallel axes are separate thread blocks, which share no shared memory: a kernel that keeps a
value in a scratch buffer from one step to the next (it reads the buffer before writing it)
must run its steps in order. On an H100 the conformance suite's running sum in scratch came
back wrong while every axis was parallel. Kernels that fill their scratch by TMA copies, or
store all of it before reading, stay parallel. Each module is lowered for ``cuda``, parsed back
and verified; the launch's block count is read from it, and the kernels are run against
``jax.numpy`` in the interpreter."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import hopper_kernels as K  # noqa: E402, N812
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct
ROW = pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))


def _thread_blocks(fn: Any, *args: Any) -> int:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # hash checked, parsed back and verified
    module = str(found[1])
    launch = re.search(r"gpu\.launch .*? in \(%\w+ = %(\w+), %\w+ = %(\w+), %\w+ = %(\w+)\)",
                       module)
    assert launch is not None, module[:2000]
    sizes = []
    for name in launch.groups():
        (value,) = re.findall(rf"%{name} = arith\.constant (\d+) : index", module)
        sizes.append(int(value))
    return int(np.prod(sizes))


def _running_sum(params: Any = None) -> Any:
    def kernel(x_ref: Any, sum_ref: Any, acc_ref: Any) -> None:
        acc_ref[...] = jnp.where(pl.program_id(0) == 0, 0.0, acc_ref[...]) + x_ref[...]
        sum_ref[...] = acc_ref[...]

    def fn(x: jax.Array, backend: str = "mosaic_gpu") -> jax.Array:
        return pl.pallas_call(kernel, S(x.shape, x.dtype), grid=(x.shape[0],), in_specs=[ROW],
                              out_specs=ROW, scratch_shapes=[plgpu.SMEM((8, 128), x.dtype)],
                              compiler_params=params, backend=backend)(x)
    return fn


def _x(seed: int = 0) -> jax.Array:
    return jnp.round(jax.random.normal(jax.random.key(seed), (4, 8, 128), jnp.float32) * 4)


def test_scratch_read_before_written_runs_the_steps_in_one_thread_block() -> None:
    x = _x()
    assert _thread_blocks(_running_sum(), S(x.shape, x.dtype)) == 1
    np.testing.assert_allclose(_running_sum()(x, backend="interpret"), jnp.cumsum(x, axis=0))


def test_dimension_semantics_given_are_kept() -> None:
    """The author's ``dimension_semantics`` decide, as in JAX: a parallel axis stays parallel."""
    fn = _running_sum(plgpu.CompilerParams(dimension_semantics=("parallel",)))
    assert _thread_blocks(fn, S((4, 8, 128), jnp.float32)) == 4


def test_scratch_stored_whole_before_it_is_read_stays_parallel() -> None:
    def kernel(x_ref: Any, o_ref: Any, tmp_ref: Any) -> None:
        tmp_ref[...] = x_ref[...] * 2.0
        o_ref[...] = tmp_ref[...] + 1.0

    def fn(x: jax.Array, backend: str = "mosaic_gpu") -> jax.Array:
        return pl.pallas_call(kernel, S(x.shape, x.dtype), grid=(4,), in_specs=[ROW],
                              out_specs=ROW, scratch_shapes=[plgpu.SMEM((8, 128), x.dtype)],
                              backend=backend)(x)

    x = _x(1)
    assert _thread_blocks(fn, S(x.shape, x.dtype)) == 4
    np.testing.assert_allclose(fn(x, backend="interpret"), x * 2.0 + 1.0)


def test_scratch_filled_by_tma_copies_stays_parallel() -> None:
    """The flash attention kernel (K and V streamed into SMEM scratch by TMA): one thread block
    per (head, block of queries)."""
    q = S((2, 256, 64), jnp.float16)
    assert _thread_blocks(lambda q, k, v: K.attention(q, k, v, block_q=64, block_k=64),
                          q, q, q) == 2 * 256 // 64
