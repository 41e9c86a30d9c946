"""``plgpu.Barrier(num_barriers=...)`` of any shape, with the installed JAX's default.

JAX 0.11 made ``num_barriers`` a shape: ``()`` is one barrier whose Ref is indexed by nothing,
an int ``n`` is ``(n,)``, and a tuple is a multi-dimensional array indexed with one index per
dimension. ``plgpu.Barrier()`` here is JAX 0.10's ``(1,)``, which accepts both ways of using
it (JAX 0.11's default is ``()``). Each kernel copies a block
into SMEM by TMA, waits on the barrier it names, adds one and stores the block: it is lowered
for ``cuda`` and compared with JAX's own lowering of the same kernel (launch, shared memory and
call config), and run in the interpreter against ``x + 1`` on random inputs.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jplgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

from pallas_core.call import force_interpret_mode  # noqa: E402

S = jax.ShapeDtypeStruct


def _kernel(gpu: Any, num_barriers: Any, index: Any) -> Any:
    barrier = gpu.Barrier() if num_barriers is None else gpu.Barrier(num_barriers=num_barriers)

    def body(x_gmem: Any, o_gmem: Any, smem: Any, bar: Any) -> None:
        b = bar if index is None else bar.at[index]
        gpu.copy_gmem_to_smem(x_gmem, smem, b)
        gpu.barrier_wait(b)
        smem[...] = smem[...] + 1.0
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(smem, o_gmem)
        gpu.wait_smem_to_gmem(0)

    # JAX 0.12 names them ``out_type`` and ``scratch_types`` (``out_shape`` and
    # ``scratch_shapes`` before); this backend takes both spellings.
    new = "out_type" in inspect.signature(gpu.kernel).parameters
    return gpu.kernel(body, **{"out_type" if new else "out_shape": S((128, 128), jnp.float32),
                               "scratch_types" if new else "scratch_shapes":
                               [gpu.SMEM((128, 128), jnp.float32), barrier]})


def _lowered(fn: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(fn).trace(S((128, 128), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # hash checked, parsed back and verified
    return found  # type: ignore[no-any-return]


CASES = [(None, None), (1, 0), (4, 3), ((2, 3), (1, 2)), ((), None)]
"""(num_barriers, index): the default passed as is, then arrays of 1, 4, 2x3 and ()."""


def test_the_default_barrier_is_one_and_either_style_of_use_runs() -> None:
    """``plgpu.Barrier()`` is one barrier: JAX 0.10's shape ``(1,)`` (JAX 0.11 made it
    ``()``). Kernels of either style run: passing it as is (0.11+) or indexing it ``.at[0]``
    (0.10)."""
    assert plgpu.Barrier().memory_ref().shape == (1,)
    x = jax.random.normal(jax.random.key(4), (128, 128), jnp.float32)
    for index in (None, 0):
        with force_interpret_mode():
            got = _kernel(plgpu, None, index)(x)
        np.testing.assert_allclose(got, x + 1.0, rtol=1e-6)
        _lowered(_kernel(plgpu, None, index))


@pytest.mark.parametrize(("num_barriers", "index"), CASES,
                         ids=["default", "1", "4", "2x3", "scalar"])
def test_barrier_arrays_lower_like_jax_and_run(num_barriers: Any, index: Any) -> None:
    ours = _lowered(_kernel(plgpu, num_barriers, index))
    theirs = _lowered(_kernel(jplgpu, num_barriers, index))
    inspection.assert_same_kernel(ours, theirs)
    x = jax.random.normal(jax.random.key(3), (128, 128), jnp.float32)
    with force_interpret_mode():
        got = _kernel(plgpu, num_barriers, index)(x)
    np.testing.assert_allclose(got, x + 1.0, rtol=1e-6)


def test_a_malformed_shape_is_refused() -> None:
    with pytest.raises(pl.PallasError, match=r"num_barriers=\(2, 0\).*a shape"):
        plgpu.Barrier(num_barriers=(2, 0))
