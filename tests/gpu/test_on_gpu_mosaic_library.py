"""JAX's Mosaic GPU kernel library (Hopper) on the GPU, as this project runs JAX's source.

The kernels of tests/jax_library/test_mgpu_library_agreement.py (hopper_matmul, its mixed-type
int8 x float16 form, ragged_dot and transposed_ragged_dot, attention plain and causal), with
that file's configurations, loaded by ``porting.ported`` (JAX's source, its Pallas imports
pointing here) and run on the GPU by the Mosaic GPU backend. Each result is compared with

* a float32 ``jax.numpy`` reference (``jnp.dot``, ``lax.ragged_dot[_general]``, attention's
  own ``attention_reference``);
* JAX's own ``jax.experimental.pallas`` running the unchanged module on the same GPU.

Mosaic GPU has no emulator (docs/backends/mosaic_gpu.md); the interpreter runs these ports in
tests/jax_library/test_mgpu_library_agreement.py, too slowly for this suite (a minute and
more each), so the interpreter's agreement with the GPU is checked on a seed example instead
(test_on_gpu_seeds.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_core.stages import kernel_calls

pytestmark = pytest.mark.gpu

pytest.importorskip("pallas_mosaic_gpu")
from tests.jax_library import test_mgpu_library_agreement as agreement  # noqa: E402

F16, F32 = jnp.float16, jnp.float32
GROUP_SIZES = (50, 0, 130, 76)
"""Uneven groups of 256 rows: one empty, one spanning blocks."""
TOLERANCE = {"attention_mgpu": 2e-2, "attention_mgpu_causal": 2e-2}
"""(rtol and atol) against the float32 reference; 0.1 where not listed (float16 products
summed over K up to 512)."""


def _normal(seed: int, shape: tuple[int, ...], dtype: Any = F16) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def case(name: str, ours: bool) -> tuple[Callable[..., Any], Callable[..., Any], list[Any]]:
    """(kernel, float32 reference, inputs) of library kernel ``name``, in JAX's module or its
    port (``ours``), with the configuration of the agreement test."""
    lib = agreement._library(name, ours)
    fn, structs = agreement._library_case(name, lib)
    if name in ("ragged_dot_mgpu", "transposed_ragged_dot_mgpu"):
        sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
        lhs, rhs = _normal(0, structs[0].shape), _normal(1, structs[1].shape)
        if name == "ragged_dot_mgpu":
            def ref(lhs: Any, rhs: Any, g: Any) -> Any:
                return lax.ragged_dot(lhs.astype(F32), rhs.astype(F32), group_sizes=g)
        else:
            numbers = lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
                rhs_group_dimensions=[])

            def ref(lhs: Any, rhs: Any, g: Any) -> Any:
                return lax.ragged_dot_general(lhs.astype(F32), rhs.astype(F32), g,
                                              ragged_dot_dimension_numbers=numbers)
        return (lambda lhs, rhs, g: fn(lhs, rhs, group_sizes=g)), ref, [lhs, rhs, sizes]
    if name == "hopper_matmul_mgpu":
        return fn, (lambda a, b: jnp.dot(a.astype(F32), b.astype(F32))), \
            [_normal(2, s.shape) for s in structs]
    if name == "hopper_mixed_type_matmul_mgpu":
        a = jax.random.randint(jax.random.key(3), structs[0].shape, -128, 128, jnp.int32)
        b = _normal(4, structs[1].shape) / 32
        return fn, (lambda a, b: jnp.dot(a.astype(F32), b.astype(F32))), \
            [a.astype(jnp.int8), b]
    causal = name.endswith("_causal")
    return fn, functools.partial(lib.attention_reference, causal=causal), \
        [_normal(5 + i, structs[i].shape) for i in range(3)]


@functools.cache
def on_gpu(name: str, ours: bool) -> np.ndarray:
    """The kernel's output computed on the GPU (once per session)."""
    fn, _, args = case(name, ours)
    return np.asarray(jax.block_until_ready(jax.jit(fn)(*args)), np.float32)


def _close(got: np.ndarray, want: Any, name: str, what: str) -> float:
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    tol = TOLERANCE.get(name, 0.1)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{name}: {what}")
    return float(np.max(np.abs(got - want)))


@pytest.mark.parametrize("name", agreement.LIBRARY)
def test_mosaic_library_kernel_on_gpu(name: str) -> None:
    """The port on the GPU (every kernel on the Mosaic GPU backend) against the reference."""
    fn, ref, args = case(name, ours=True)
    backends = {c.backend for c in kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)}
    assert backends == {"mosaic_gpu"}, backends
    worst = _close(on_gpu(name, True), ref(*args), name, "GPU vs float32 reference")
    print(f"{name}: max |GPU - reference| {worst:.3g}")


@pytest.mark.parametrize("name", agreement.LIBRARY)
def test_mosaic_library_kernel_agrees_with_jax_pallas_on_gpu(name: str) -> None:
    """The port and JAX's own module, both on the GPU."""
    worst = _close(on_gpu(name, True), on_gpu(name, False), name,
                   "ours vs jax.experimental.pallas on the GPU")
    print(f"{name}: max |ours - jax.experimental.pallas| on the GPU {worst:.3g}")
