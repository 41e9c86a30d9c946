"""``plgpu.barrier_test``, ``async_copy_smem_to_tmem`` and ``format_tcgen05_sparse_metadata``
against ``jax.numpy`` and JAX's own functions on random inputs, in the interpreter and lowered
for cuda."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def _rand(seed: int, shape: tuple[int, ...], dtype: Any = F32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _lowered(fn: Any, *args: Any) -> str:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)
    return str(found[1])


def _tested(x: jax.Array, backend: str) -> Any:
    """Tests a barrier before and after a copy completes it; the copy's data comes out once
    the test said so."""
    @functools.partial(plgpu.kernel, out_type=(S(x.shape, x.dtype), S((2,), jnp.int32)),
                       backend=backend,
                       scratch_shapes=[plgpu.SMEM(x.shape, x.dtype),
                                       plgpu.Barrier(num_arrivals=1)])
    def kernel(x_ref: Any, o_ref: Any, flags: Any, smem: Any, bar: Any) -> None:
        before = plgpu.barrier_test(bar)
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        after = jax.lax.while_loop(lambda done: jnp.logical_not(done),
                                   lambda _: plgpu.barrier_test(bar), before)
        o_ref[...] = smem[...] * 2.0
        flags[0] = before.astype(jnp.int32)
        flags[1] = after.astype(jnp.int32)

    return kernel(x)


def test_barrier_test_tells_whether_the_phase_completed() -> None:
    x = _rand(1, (64, 64))
    out, flags = _tested(x, "interpret")
    np.testing.assert_allclose(out, x * 2.0)
    np.testing.assert_array_equal(flags, [0, 1])


def _warp_spin(x: jax.Array, backend: str) -> jax.Array:
    """Warp 1 spins on barrier_test until warp 0's copy lands (the warps run each at its own
    pace in the interpreter), then copies the buffer out."""
    def per_warp(x_ref: Any, o_ref: Any, buf: Any, full: Any) -> None:
        warp = jax.lax.axis_index("w")

        @pl.when(warp == 1)
        def _() -> None:
            jax.lax.while_loop(lambda done: jnp.logical_not(done),
                               lambda _: plgpu.barrier_test(full), jnp.bool_(False))
            plgpu.copy_smem_to_gmem(buf, o_ref)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(warp == 0)
        def _() -> None:
            plgpu.copy_gmem_to_smem(x_ref, buf, full)

    def body(x_ref: Any, o_ref: Any, buf: Any, full: Any) -> None:
        @pl.when(jax.lax.axis_index("wg") == 0)
        def _() -> None:
            pl.core_map(plgpu.WarpMesh(axis_name="w"))(
                functools.partial(per_warp, x_ref, o_ref, buf, full))

    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.run_scoped(functools.partial(body, x_ref, o_ref), plgpu.SMEM(x.shape, x.dtype),
                      plgpu.Barrier(num_arrivals=1), collective_axes="wg")

    return plgpu.kernel(kernel, out_type=S(x.shape, x.dtype),  # type: ignore[no-any-return]
                        num_threads=2, thread_name="wg", backend=backend)(x)


def test_barrier_test_in_a_warp_waits_for_another_warp() -> None:
    x = _rand(2, (64, 64))
    np.testing.assert_array_equal(_warp_spin(x, "interpret"), x)


def test_barrier_test_lowers_for_cuda() -> None:
    x = _rand(3, (64, 64))
    assert "mbarrier.test.wait" in _lowered(lambda x: _tested(x, "mosaic_gpu"), x).replace(
        "_", ".")
    assert len(_lowered(functools.partial(_warp_spin, backend="mosaic_gpu"), x)) > 0


def test_barrier_test_checks_its_barrier() -> None:
    @functools.partial(plgpu.kernel, out_type=S((8,), F32), backend="interpret")
    def kernel(o_ref: Any) -> None:
        plgpu.barrier_test(o_ref)

    with pytest.raises(pl.PallasError, match="barrier_test"):
        kernel()


def _smem_to_tmem(x: jax.Array, backend: str) -> jax.Array:
    def body(x_ref: Any, o_ref: Any, tmem: Any, smem: Any, bar: Any) -> None:
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        plgpu.barrier_wait(bar)
        plgpu.async_copy_smem_to_tmem(smem, tmem)
        value = plgpu.async_load_tmem(tmem)
        plgpu.wait_load_tmem()
        o_ref[...] = value + 1.0

    return plgpu.kernel(body, out_type=S(x.shape, F32), backend=backend,  # type: ignore
                        scratch_shapes=[plgpu.TMEM(x.shape, F32), plgpu.SMEM(x.shape, F32),
                                        plgpu.Barrier(num_arrivals=1)])(x)


def test_async_copy_smem_to_tmem_copies() -> None:
    x = _rand(4, (128, 128))
    np.testing.assert_allclose(_smem_to_tmem(x, "interpret"), x + 1.0)
    module = _lowered(functools.partial(_smem_to_tmem, backend="mosaic_gpu"), x)
    assert "tcgen05.st" in module and "tcgen05.ld" in module
    with pytest.raises(pl.UnsupportedError, match="collective_axis"):
        plgpu.async_copy_smem_to_tmem(None, None, collective_axis="x")


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8])
@pytest.mark.parametrize("m, k4", [(128, 64), (256, 32), (384, 128)])
def test_format_tcgen05_sparse_metadata_is_jaxs(dtype: Any, m: int, k4: int) -> None:
    rng = np.random.default_rng(m + k4)
    meta = jnp.asarray(rng.integers(0, 4, (m, k4, 2)).astype(jnp.uint2))
    ours = plgpu.format_tcgen05_sparse_metadata(meta, dtype)
    theirs = jgpu.format_tcgen05_sparse_metadata(meta, dtype)
    assert ours.shape == theirs.shape == (m // 128, k4 * 2 // 64, 128, 64)
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.int8)),
                                  np.asarray(theirs.astype(jnp.int8)))


def test_format_tcgen05_sparse_metadata_checks_its_input() -> None:
    with pytest.raises(pl.PallasError, match="uint2"):
        plgpu.format_tcgen05_sparse_metadata(jnp.zeros((128, 32, 2), jnp.uint8), jnp.float16)
    with pytest.raises(pl.PallasError, match="shape"):
        plgpu.format_tcgen05_sparse_metadata(jnp.zeros((128, 32), jnp.uint2), jnp.float16)
    with pytest.raises(pl.UnsupportedError, match="float32"):
        plgpu.format_tcgen05_sparse_metadata(jnp.zeros((128, 32, 2), jnp.uint2), jnp.float32)
