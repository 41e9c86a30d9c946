"""Names ``jax.experimental.pallas.mosaic_gpu`` lists from JAX 0.11/0.12 that are compositions here:
``plgpu.sum``/``max``/``min``/``prod``, ``store``, ``barrier_arrive_and_wait``,
``wait_gmem_to_smem``, ``mma`` and GPU interpret mode (``InterpretGPUParams``,
``force_gpu_interpret_mode``, ``set_gpu_interpret_mode``), each against ``jax.numpy`` on random
inputs (and JAX's own class's fields where the installed JAX has it)."""

from __future__ import annotations

import dataclasses
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


def _rand(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _reduced(fn: Any, axis: Any, backend: str, shape: tuple[int, ...] = (64, 128)) -> Any:
    out = jax.eval_shape(lambda x: jnp.sum(x, axis=axis), S(shape, jnp.float32))

    @functools.partial(plgpu.kernel, out_type=S(out.shape, jnp.float32), backend=backend)
    def kernel(x_ref: Any, o_ref: Any) -> None:
        plgpu.store(o_ref, fn(x_ref[...], axis))

    return kernel


@pytest.mark.parametrize("name", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("axis", [0, 1, None, (0, 1)], ids=str)
def test_reductions_match_jnp(name: str, axis: Any) -> None:
    x = _rand((64, 128), 1) * (0.1 if name == "prod" else 1.0) + (1.0 if name == "prod" else 0)
    got = _reduced(getattr(plgpu, name), axis, "interpret")(x)
    want = getattr(jnp, name)(x, axis=axis)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_reduction_arguments_as_jax() -> None:
    x = _rand((8, 8))
    with pytest.raises(pl.UnsupportedError, match=r"plgpu\.sum\(keepdims=True\)"):
        plgpu.sum(x, 0, keepdims=True)
    with pytest.raises(pl.PallasError, match="accumulator_ilp"):
        plgpu.max(x, 0, accumulator_ilp=0)
    np.testing.assert_allclose(plgpu.min(x, 1, accumulator_ilp=2), jnp.min(x, 1))


@pytest.mark.parametrize("name", ["sum", "max"])
def test_reductions_lower_for_mosaic_gpu(name: str) -> None:
    x = _rand((64, 128))

    def kernel(x_ref: Any, o_ref: Any) -> None:  # blocks in SMEM
        o_ref[...] = getattr(plgpu, name)(x_ref[...], 1)

    fn = pl.pallas_call(kernel, S((64,), jnp.float32), backend="mosaic_gpu")
    text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert len(inspection.kernels(text)) == 1


def test_store_and_barrier_arrive_and_wait() -> None:
    x = _rand((128,), 2)

    @functools.partial(plgpu.kernel, out_type=S((128,), jnp.float32), backend="interpret",
                       scratch_shapes=[plgpu.Barrier(num_arrivals=1)])
    def kernel(x_ref: Any, o_ref: Any, barrier: Any) -> None:
        plgpu.wait_gmem_to_smem(0)
        plgpu.barrier_arrive_and_wait(barrier)  # completes its phase: the wait returns
        plgpu.store(o_ref, x_ref[...] * 3.0 - 1.0)

    np.testing.assert_allclose(kernel(x), x * 3.0 - 1.0, rtol=1e-6)
    with pytest.raises(pl.PallasError, match="non-negative int"):
        plgpu.wait_gmem_to_smem(-1)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_mma_matches_jnp(dtype: Any) -> None:
    a, b, acc = _rand((64, 32), 3).astype(dtype), _rand((32, 16), 4).astype(dtype), _rand(
        (64, 16), 5)

    @functools.partial(plgpu.kernel, out_type=S((64, 16), jnp.float32), backend="interpret")
    def kernel(acc_ref: Any, a_ref: Any, b_ref: Any, o_ref: Any) -> None:
        o_ref[...] = plgpu.mma(acc_ref[...], a_ref[...], b_ref[...])

    want = acc + jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
    np.testing.assert_allclose(kernel(acc, a, b), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(pl.PallasError, match="incompatible shapes"):
        plgpu.mma(acc, b, a)


def test_interpret_gpu_params_fields_are_jaxs() -> None:
    if not hasattr(jgpu, "InterpretGPUParams"):
        pytest.skip("this JAX has no InterpretGPUParams")
    ours = {f.name: f.default for f in dataclasses.fields(plgpu.InterpretGPUParams)}
    theirs = {f.name: f.default for f in dataclasses.fields(jgpu.InterpretGPUParams)}
    # The class is JAX 0.12's; JAX 0.11's lacks the fields 0.12 added.
    newer = {"on_race"} if jax.__version_info__ < (0, 12) else set()
    assert {k: v for k, v in ours.items() if k not in newer} == theirs


def test_interpret_gpu_params_checks_its_fields() -> None:
    for bad in ({"vector_clock_size": 4}, {"num_tma_threads_per_device": 0},
                {"out_of_bounds_reads": "ignore"}):
        with pytest.raises(pl.PallasError, match="InterpretGPUParams"):
            plgpu.InterpretGPUParams(**bad)  # type: ignore[arg-type]


def _double(x: jax.Array, **kw: Any) -> jax.Array:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + 0.5

    return pl.pallas_call(kernel, S(x.shape, x.dtype), **kw)(x)


def _backends(fn: Any, *args: Any) -> set[Any]:
    from pallas_core.stages import kernel_calls
    return {c.backend for c in kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)}


def test_gpu_interpret_mode_runs_gpu_kernels_in_the_interpreter() -> None:
    x = _rand((256,), 6)
    gpu = functools.partial(_double, compiler_params=plgpu.CompilerParams())
    assert _backends(gpu, x) == {"mosaic_gpu"}
    got = _double(x, interpret=plgpu.InterpretGPUParams(uninitialized_memory="zero"))
    np.testing.assert_allclose(got, x * 2.0 + 0.5, rtol=1e-6)
    with plgpu.force_gpu_interpret_mode():
        assert _backends(gpu, x) == {"interpret"}
        np.testing.assert_allclose(gpu(x), x * 2.0 + 0.5, rtol=1e-6)
        with plgpu.force_gpu_interpret_mode(None):
            assert _backends(gpu, x) == {"mosaic_gpu"}
    assert _backends(gpu, x) == {"mosaic_gpu"}
    try:
        plgpu.set_gpu_interpret_mode()
        assert _backends(gpu, x) == {"interpret"}
    finally:
        plgpu.set_gpu_interpret_mode(None)
    assert _backends(gpu, x) == {"mosaic_gpu"}


def _semaphores(signal: Any, wait: Any, backend: str = "interpret") -> Any:
    """Signals 3 then 4, waits for 5 (taking it), waits for 1 without taking it: the
    semaphore ends at 2, which the kernel adds to ``x``."""
    @functools.partial(plgpu.kernel, out_type=S((128,), jnp.float32), backend=backend,
                       scratch_shapes=[plgpu.SemaphoreType.REGULAR])
    def kernel(x_ref: Any, o_ref: Any, sem: Any) -> None:
        signal(sem, 3)
        signal(sem, 4)
        wait(sem, 5)
        wait(sem, 1, decrement=False)
        o_ref[...] = x_ref[...] + pl.semaphore_read(sem).astype(jnp.float32)

    return kernel


def test_semaphore_signal_and_wait_as_the_cores() -> None:
    x = _rand((128,), 7)
    ours = _semaphores(functools.partial(plgpu.semaphore_signal, memory_scope="gpu"),
                       functools.partial(plgpu.semaphore_wait, memory_scope="sys"))(x)
    core = _semaphores(pl.semaphore_signal, pl.semaphore_wait)(x)
    np.testing.assert_allclose(ours, x + 2.0, rtol=1e-6)
    np.testing.assert_allclose(core, x + 2.0, rtol=1e-6)
    with pytest.raises(pl.PallasError, match="memory_scope"):
        _semaphores(functools.partial(plgpu.semaphore_signal, memory_scope="cta"),
                    plgpu.semaphore_wait)(x)


def test_hints_change_nothing() -> None:
    x = _rand((64, 128), 8)

    def make(backend: str) -> Any:
        @functools.partial(plgpu.kernel, out_type=S((64, 128), jnp.float32), backend=backend)
        def kernel(x_ref: Any, o_ref: Any) -> None:
            plgpu.griddepcontrol_wait()
            plgpu.async_prefetch(x_ref)
            o_ref[...] = x_ref[...] * 2.0
            plgpu.griddepcontrol_launch_dependents()
        return kernel

    np.testing.assert_allclose(make("interpret")(x), x * 2.0, rtol=1e-6)
    hinted = jax.jit(make("mosaic_gpu")).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert len(inspection.kernels(hinted)) == 1


def test_semaphore_signal_parallel_as_signals_one_by_one() -> None:
    x = _rand((128,), 9)

    @functools.partial(plgpu.kernel, out_type=S((128,), jnp.float32), backend="interpret",
                       scratch_shapes=[plgpu.SemaphoreType.REGULAR((2,))])
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        plgpu.semaphore_signal_parallel(
            plgpu.SemaphoreSignal(sems.at[0], device_id=None, inc=3),
            plgpu.SemaphoreSignal(sems.at[1], device_id=None))
        total = pl.semaphore_read(sems.at[0]) * 10 + pl.semaphore_read(sems.at[1])
        o_ref[...] = x_ref[...] + total.astype(jnp.float32)

    np.testing.assert_allclose(kernel(x), x + 31.0, rtol=1e-6)
    ours = [(f.name, f.kw_only, f.default) for f in dataclasses.fields(plgpu.SemaphoreSignal)]
    theirs = [(f.name, f.kw_only, f.default) for f in dataclasses.fields(jgpu.SemaphoreSignal)]
    assert ours == theirs
    with pytest.raises(TypeError):
        plgpu.SemaphoreSignal(None)  # type: ignore[call-arg] # device_id is required


def _warp_handoff(x: jax.Array, backend: str, use_warp_map: bool) -> jax.Array:
    """Warp 0 of warpgroup 0 copies x into SMEM; warp 1 waits for it and copies it out."""
    def per_warp(x_ref: Any, o_ref: Any, buf: Any, full: Any, warp: Any) -> None:
        @pl.when(warp == 0)
        def _() -> None:
            plgpu.copy_gmem_to_smem(x_ref, buf, full)

        @pl.when(warp == 1)
        def _() -> None:
            plgpu.barrier_wait(full)
            plgpu.copy_smem_to_gmem(buf, o_ref)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def body(x_ref: Any, o_ref: Any, buf: Any, full: Any) -> None:
        @pl.when(jax.lax.axis_index("wg") == 0)
        def _() -> None:
            f = functools.partial(per_warp, x_ref, o_ref, buf, full)
            if use_warp_map:
                plgpu.warp_map(f)
            else:
                @pl.core_map(plgpu.WarpMesh(axis_name="w"))
                def _() -> None:
                    f(jax.lax.axis_index("w"))

    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.run_scoped(functools.partial(body, x_ref, o_ref), plgpu.SMEM(x.shape, x.dtype),
                      plgpu.Barrier(num_arrivals=1), collective_axes="wg")

    return plgpu.kernel(kernel, out_type=S(x.shape, x.dtype), num_threads=2, thread_name="wg",
                        backend=backend)(x)  # type: ignore[no-any-return]


def test_warp_map_is_core_map_over_a_warp_mesh() -> None:
    x = _rand((64, 64), 11)
    np.testing.assert_array_equal(_warp_handoff(x, "interpret", True), x)
    np.testing.assert_array_equal(_warp_handoff(x, "interpret", False), x)
    for use in (True, False):
        text = jax.jit(functools.partial(_warp_handoff, backend="mosaic_gpu",
                                         use_warp_map=use)).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
        assert len(inspection.kernels(text)) == 1


@pytest.mark.parametrize("wait_n", [0, 1, None])
def test_wgmma_accumulator_load_reads_the_product(wait_n: Any) -> None:
    keys = jax.random.split(jax.random.key(12))
    a = jax.random.normal(keys[0], (64, 64), jnp.float16)
    b = jax.random.normal(keys[1], (64, 128), jnp.float16)

    @functools.partial(plgpu.kernel, out_type=S((64, 128), jnp.float32), backend="interpret",
                       scratch_shapes=[plgpu.ACC((64, 128), jnp.float32)])
    def kernel(a_ref: Any, b_ref: Any, o_ref: Any, acc: Any) -> None:
        def scope(a_smem: Any, b_smem: Any, bar: Any) -> None:
            plgpu.copy_gmem_to_smem(a_ref, a_smem, bar)
            plgpu.copy_gmem_to_smem(b_ref, b_smem, bar)
            plgpu.barrier_wait(bar)
            plgpu.wgmma(acc, a_smem, b_smem)
            o_ref[...] = plgpu.wgmma_accumulator_load(acc, wait_n=wait_n)

        pl.run_scoped(scope, plgpu.SMEM(a.shape, a.dtype), plgpu.SMEM(b.shape, b.dtype),
                      plgpu.Barrier(num_arrivals=2))

    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
    np.testing.assert_allclose(kernel(a, b), want, rtol=1e-2, atol=1e-2)
    with pytest.raises(pl.PallasError, match="wait_n"):
        plgpu.wgmma_accumulator_load(None, wait_n=-1)
