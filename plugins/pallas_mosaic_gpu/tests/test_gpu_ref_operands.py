"""``jax.Ref`` s in Mosaic GPU kernels, and ``plgpu.Mesh`` as the mesh of ``pl.kernel`` and
``pl.core_map``.

``plgpu.alloc_semaphore``: GMEM semaphores that outlive a kernel, as a ``jax.Ref`` kernels
take as an operand. One kernel signals each block's semaphore, the next waits on it: in the
interpreter the counts persist from one call to the next (and the waits take them back to
zero), the outputs match ``jax.numpy``, and the kernel lowers for ``cuda`` as JAX's own
lowering of the same kernel does (launch and shared memory). The custom call differs on
purpose: here the semaphore array is an operand aliased to an output, so XLA knows the kernel
writes it; JAX passes it as an operand only."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jpl = pytest.importorskip("jax.experimental.pallas")
jplgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct


def _kernel(pallas: Any, gpu: Any, wait: bool, backend: str) -> Any:
    def body(sem: Any, x_ref: Any, o_ref: Any) -> None:
        b = jax.lax.axis_index("b")
        if wait:
            pallas.semaphore_wait(sem.at[b], 1)
            o_ref[...] = x_ref[...] * 2.0
        else:
            pallas.semaphore_signal(sem.at[b], 1)
            o_ref[...] = x_ref[...] + 1.0

    new = "out_type" in inspect.signature(gpu.kernel).parameters  # JAX 0.12's name
    kw = {"out_type" if new else "out_shape": S((256,), jnp.float32)}
    if gpu is plgpu:
        kw["backend"] = backend
    return gpu.kernel(body, grid=(2,), grid_names=("b",), **kw)


def _signal_then_wait(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    sem = plgpu.alloc_semaphore((2,))
    y = _kernel(pl, plgpu, False, "interpret")(sem, x)
    signalled = sem[...]
    z = _kernel(pl, plgpu, True, "interpret")(sem, y)
    return z, signalled, sem[...]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_counts_persist_from_kernel_to_kernel(jit: bool) -> None:
    x = jax.random.normal(jax.random.key(0), (256,), jnp.float32)
    z, signalled, waited = (jax.jit(_signal_then_wait) if jit else _signal_then_wait)(x)
    np.testing.assert_allclose(z, (x + 1.0) * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(signalled, [1, 1])
    np.testing.assert_array_equal(waited, [0, 0])


def _lowered(pallas: Any, gpu: Any) -> Any:
    def run(x: jax.Array) -> jax.Array:
        return _kernel(pallas, gpu, False, "mosaic_gpu")(gpu.alloc_semaphore((2,)), x)

    text = jax.jit(run).trace(S((256,), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # hash checked, parsed back and verified
    return found


def test_lowers_like_jax_with_the_semaphores_aliased() -> None:
    if not hasattr(jplgpu, "alloc_semaphore"):
        pytest.skip("the installed JAX has no plgpu.alloc_semaphore (new in 0.12)")
    ours, theirs = _lowered(pl, plgpu), _lowered(jpl, jplgpu)
    assert inspection.launch(ours[1]) == inspection.launch(theirs[1])
    # JAX passes (semaphores, x) and returns the output only; here x comes first and the
    # semaphores, an in-out operand, come back as a second result.
    ours_call, theirs_call = ours[0]["call"], theirs[0]["call"]
    assert theirs_call["operand_types"] == ("tensor<2xi32>", "tensor<256xf32>")
    assert ours_call["operand_types"] == ("tensor<256xf32>", "tensor<2xi32>")
    assert ours_call["result_types"] == ("tensor<256xf32>", "tensor<2xi32>")
    assert "operand_index = 1" in ours_call["output_operand_aliases"]


def test_it_is_made_outside_kernels() -> None:
    with pytest.raises(pl.PallasError, match="a tuple of sizes"):
        plgpu.alloc_semaphore(("a",))

    def body(x_ref: Any, o_ref: Any) -> None:
        plgpu.alloc_semaphore((1,))

    with pytest.raises(pl.PallasError, match="inside a kernel"):
        plgpu.kernel(body, out_shape=S((8,), jnp.float32), backend="interpret")(
            jnp.zeros((8,), jnp.float32))


def _mesh_kernels(pallas: Any, gpu: Any, backend: str) -> Any:
    """``pl.kernel(mesh=plgpu.Mesh(...))`` adding one, then ``pl.core_map(plgpu.Mesh())``
    doubling into a ``jax.new_ref`` it closes over."""
    mesh = gpu.Mesh(grid=(2,), grid_names=("b",))
    kw = {} if pallas is not pl else {"backend": backend}

    def add_one(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + 1.0

    def run(x: jax.Array) -> jax.Array:
        y = pallas.kernel(add_one, out_type=S(x.shape, x.dtype), mesh=mesh, **kw)(x)
        y_ref, o_ref = jax.new_ref(y), jax.new_ref(jnp.zeros_like(y))

        @pallas.core_map(gpu.Mesh(), **kw)
        def _() -> None:
            o_ref[...] = y_ref[...] * 2.0

        return o_ref[...]

    return run


def test_plgpu_mesh_in_pl_kernel_and_core_map() -> None:
    x = jax.random.normal(jax.random.key(1), (256,), jnp.float32)
    with warnings.catch_warnings():  # pl.core_map is deprecated where JAX deprecates it
        warnings.simplefilter("ignore", DeprecationWarning)
        got = jax.jit(_mesh_kernels(pl, plgpu, "interpret"))(x)
        text = jax.jit(_mesh_kernels(pl, plgpu, "mosaic_gpu")).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
    np.testing.assert_allclose(got, (x + 1.0) * 2.0, rtol=1e-6)
    ours = inspection.kernels(text)
    assert [inspection.launch(k[1])["grid"] for k in ours] == [(2, 1, 1), (1, 1, 1)]
    if not hasattr(jpl, "core_map"):
        return  # JAX 0.12 removed pl.core_map; this backend keeps it, deprecated
    theirs = inspection.kernels(jax.jit(_mesh_kernels(jpl, jplgpu, "")).trace(x).lower(
        lowering_platforms=("cuda",)).as_text())
    for a, b in zip(ours, theirs, strict=True):
        assert inspection.launch(a[1]) == inspection.launch(b[1])
