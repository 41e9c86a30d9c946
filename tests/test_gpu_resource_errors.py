"""A GPU launch refused for want of shared memory is a ``BlockSpecError`` naming the kernel.

XLA reports the shortfall only when it loads the compiled kernel on the GPU
(``RESOURCE_EXHAUSTED: Shared memory size limit exceeded``); on an H100 three seed examples of
float32 blocks met it on Triton. Without a GPU the same runtime error is raised here by a host
callback inside the kernel, which XLA passes on as it passes on the launch's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_core as pl

S = jax.ShapeDtypeStruct


def _failing_kernel(message: str) -> Any:
    def fail(x: Any) -> Any:
        raise RuntimeError(message)

    def staged_kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jax.pure_callback(fail, S((8, 128), jnp.float32), x_ref[...])

    return pl.pallas_call(staged_kernel, S((8, 128), jnp.float32))


def test_shared_memory_shortfall_names_the_kernel_the_sizes_and_the_fix() -> None:
    x = jax.random.normal(jax.random.key(0), (8, 128), jnp.float32)
    fn = _failing_kernel("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested "
                         "393216, available: 232448, context: []")
    with pytest.raises(pl.BlockSpecError, match=r"kernel 'staged_kernel' \(.*test_gpu_resource"
                       r"_errors.py:\d+\) needs 393216 bytes of shared memory.*allows 232448.*"
                       r"Fix: smaller blocks.*num_stages=1") as info:
        fn(x)
    assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)


def test_other_runtime_errors_pass_through_unchanged() -> None:
    fn = _failing_kernel("something else went wrong")
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else went wrong"):
        fn(jnp.ones((8, 128), jnp.float32))
