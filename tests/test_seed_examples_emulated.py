"""The seed examples (examples/*.py) as each hardware backend compiles them, emulated on CPU.

``pl.emulate(fn, backend=...)`` lowers every kernel of the example for the backend's hardware
(whatever backend the example names) and executes the emitted module in the backend's
emulator: the result must match plain ``jax.numpy`` on random inputs. Shapes are chosen to
meet each backend's block rules (TPU: last two block dims multiples of (8, 128) or whole).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from examples import (
    blocked_add_uneven,
    flash_attention,
    iota,
    matmul_2x2,
    matmul_3d_grid,
    matmul_activation,
    row_reduction,
    shard_map_add,
    softmax,
    vector_add,
    vmap_attention,
)

BACKENDS = ("mosaic_tpu", "triton")


def rand(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-1000, 1000, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _attention_inputs(seed: int, *shape: int) -> list[jax.Array]:
    return [rand(seed + i, shape) for i in range(3)]


Case = tuple[Callable[..., Any], Callable[..., Any], Callable[[], list[jax.Array]], float]
"""(example, jax.numpy reference, inputs, tolerance)."""

CASES: dict[str, Case] = {
    "vector_add": (functools.partial(vector_add.vector_add, block_size=256), jnp.add,
                   lambda: [rand(0, (1024,)), rand(1, (1024,))], 0.0),
    "vector_add_int32": (vector_add.vector_add, jnp.add,
                         lambda: [rand(0, (512,), jnp.int32), rand(1, (512,), jnp.int32)], 0.0),
    "iota_block_ids": (lambda: iota.block_ids((3, 2), (8, 128)),
                       lambda: iota.block_ids_reference((3, 2), (8, 128)), lambda: [], 0.0),
    "matmul_2x2": (matmul_2x2.matmul_2x2, jnp.dot,
                   lambda: [rand(0, (256, 128)), rand(1, (128, 256))], 1e-4),
    "blocked_add_uneven": (functools.partial(blocked_add_uneven.blocked_add, block=(128, 128)),
                           jnp.add, lambda: [rand(0, (200, 300)), rand(1, (200, 300))], 0.0),
    "matmul_activation": (
        functools.partial(matmul_activation.matmul, activation=jax.nn.relu),
        lambda x, y: jax.nn.relu(x @ y), lambda: [rand(0, (256, 128)), rand(1, (128, 256))],
        1e-4),
    "matmul_3d_grid": (matmul_3d_grid.matmul, jnp.dot,
                       lambda: [rand(0, (256, 384)), rand(1, (384, 256))], 1e-4),
    "matmul_3d_grid_bf16": (
        matmul_3d_grid.matmul, lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32),
        lambda: [rand(0, (256, 256), jnp.bfloat16), rand(1, (256, 256), jnp.bfloat16)], 1e-5),
    "softmax": (softmax.softmax, functools.partial(jax.nn.softmax, axis=-1),
                lambda: [rand(0, (128, 256))], 1e-5),
    "row_reduction": (row_reduction.row_sum_max, lambda x: (x.sum(1), x.max(1)),
                      lambda: [rand(0, (256, 256))], 1e-5),
    "flash_attention": (functools.partial(flash_attention.flash_attention, block_q=128,
                                          block_k=128),
                        flash_attention.attention_reference,
                        lambda: _attention_inputs(0, 256, 128), 1e-4),
    "multi_head_attention": (vmap_attention.multi_head_attention,
                             jax.vmap(flash_attention.attention_reference),
                             lambda: _attention_inputs(0, 2, 128, 128), 1e-4),
    "batched_multi_head_attention": (
        vmap_attention.batched_multi_head_attention,
        jax.vmap(jax.vmap(flash_attention.attention_reference)),
        lambda: _attention_inputs(0, 2, 2, 128, 128), 1e-4),
    "multi_query_attention": (
        vmap_attention.multi_query_attention,
        jax.vmap(flash_attention.attention_reference, in_axes=(0, None, None)),
        lambda: [rand(0, (2, 128, 128)), rand(1, (256, 128)), rand(2, (256, 128))], 1e-4),
    "shard_map_add": (  # the kernel inside shard_map, on rows sharded over eight CPU devices
        lambda x, y: shard_map_add.sharded_add(x, y, shard_map_add.make_mesh()), jnp.add,
        lambda: [shard_map_add.shard_rows(rand(i, (1024, 256)), shard_map_add.make_mesh())
                 for i in range(2)], 0.0),
}


TF32_DOTS = {"flash_attention", "matmul_2x2", "matmul_3d_grid", "matmul_activation",
             "multi_head_attention", "batched_multi_head_attention", "multi_query_attention"}
"""Examples with float32 dots: Triton runs them in TensorFloat-32 (inputs rounded to 10 mantissa
bits) by default, as a GPU does: they differ from jax.numpy's float32 dot by ~1e-3 of the
inputs' scale times sqrt(K)."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_seed_example_emulated(name: str, backend: str) -> None:
    example, reference, inputs, tol = CASES[name]
    if backend == "triton" and name in TF32_DOTS:
        tol = 5e-2
    args = inputs()
    got = pl.emulate(example, backend=backend)(*args)
    want = reference(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=tol, atol=tol,
                                   err_msg=f"{name} emulated on {backend}")
