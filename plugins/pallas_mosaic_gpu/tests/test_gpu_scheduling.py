"""Blackwell work scheduling (pallas_mosaic_gpu.dynamic_scheduling): ``dynamic_scheduling_loop``
(cluster launch control) and ``pl.core_map`` over ``plgpu.WarpMesh``, lowered for sm_100a and
run in the interpreter against ``jax.numpy`` on random inputs; what is refused, refused with an
error naming it. JAX's blackwell_matmul, which uses both, is checked in
tests/jax_library/test_mgpu_library_agreement.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct
F32 = jnp.float32
BLOCK, SLOTS = 128, 2


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def scaled_rows(x: jax.Array, backend: str = "interpret") -> jax.Array:
    """Each grid point doubles one block of rows of ``x``, the points claimed with
    dynamic_scheduling_loop (local_index counted into the output's last column)."""
    blocks = x.shape[0] // 8

    def body(x_ref, o_ref, steps_ref):
        @plgpu.dynamic_scheduling_loop(grid_names=("i",))
        def _loop(info):
            (i,) = info.index
            rows = pl.ds(i * 8, 8)
            o_ref[rows] = x_ref[rows] * 2.0
            steps_ref[i] = info.local_index

    return plgpu.kernel(body, out_type=(S(x.shape, F32), S((blocks,), jnp.int32)),
                        grid=(blocks,), grid_names=("i",), backend=backend)(x)


def test_dynamic_scheduling_loop_lowers_and_runs() -> None:
    x = jax.random.normal(jax.random.key(0), (64, 128), F32)
    got, steps = scaled_rows(x)
    np.testing.assert_allclose(got, x * 2.0, rtol=1e-6)
    # Without warpgroups sharing memory, the interpreter runs each block on its own: no claim
    # succeeds, each block runs its own grid point.
    np.testing.assert_array_equal(steps, np.zeros(8, np.int32))
    (_, module), = inspection.kernels(_lower(functools.partial(scaled_rows,
                                                                backend="mosaic_gpu"), x))
    body = str(module)
    assert inspection.launch(module)["arch"] == (10, 0)  # cluster launch control: sm_100a
    assert "clusterlaunchcontrol.try_cancel" in body and "scf.while" in body


def test_the_first_block_claims_the_grid() -> None:
    """Warpgroups sharing the loop's memory run each at its own pace, blocks one after another
    (pallas_interpret.phases): the first block claims every other grid point, in order, both
    warpgroups getting the same answers; the other blocks never run."""
    x = jax.random.normal(jax.random.key(5), (48, 128), F32)

    def body(x_ref, o_ref, steps_ref):
        @plgpu.dynamic_scheduling_loop(grid_names=("i",), thread_axis="wg")
        def _(info):
            (i,) = info.index
            wg = lax.axis_index("wg")
            rows = pl.ds(i * 8 + wg * 4, 4)
            o_ref[rows] = x_ref[rows] * 2.0

            @pl.when(wg == 0)
            def _():
                steps_ref[i] = info.local_index

    got, steps = plgpu.kernel(body, out_type=(S(x.shape, F32), S((6,), jnp.int32)),
                              grid=(6,), grid_names=("i",), num_threads=2, thread_name="wg",
                              backend="interpret")(x)
    np.testing.assert_allclose(got, x * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(steps, np.arange(6))


def test_dynamic_scheduling_loop_carries_and_takes_2d_grids() -> None:
    x = jax.random.normal(jax.random.key(4), (4, 8, 128), F32)

    def body(x_ref, o_ref, n_ref):
        @plgpu.dynamic_scheduling_loop(grid_names=("i", "j"), init_carry=jnp.int32(0))
        def steps(info, carry):
            i, j = info.index
            o_ref[i, pl.ds(j * 4, 4)] = x_ref[i, pl.ds(j * 4, 4)] + 1.0
            return carry + 1

        n_ref[lax.axis_index("i"), lax.axis_index("j")] = steps

    def run(x: jax.Array, backend: str) -> tuple[jax.Array, jax.Array]:
        return plgpu.kernel(body, out_type=(S(x.shape, F32), S((4, 2), jnp.int32)),
                            grid=(4, 2), grid_names=("i", "j"), backend=backend)(x)

    got, steps = run(x, "interpret")
    np.testing.assert_allclose(got, x + 1.0, rtol=1e-6)
    np.testing.assert_array_equal(steps, np.ones((4, 2), np.int32))  # each block: its point
    (_, module), = inspection.kernels(_lower(functools.partial(run, backend="mosaic_gpu"), x))
    assert inspection.launch(module)["grid"] == (4, 2, 1)


def warp_copy(x: jax.Array, backend: str = "interpret", hand_back: bool = True) -> jax.Array:
    """``x`` copied through SLOTS SMEM slots by two warps of warpgroup 0: warp 0 fills a slot
    once warp 1 handed it back, warp 1 waits for it and copies it out."""
    steps = x.shape[0] // BLOCK

    def body(x_ref, o_ref, bufs, full, free):
        @pl.when(lax.axis_index("wg") == 0)
        def _():
            @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
            def _warps():
                warp = lax.axis_index("warp")

                @pl.when(warp == 0)
                def _fill():
                    @pl.loop(0, steps)
                    def _(step):
                        slot = lax.rem(step, SLOTS)

                        @pl.when(step >= SLOTS)
                        def _():
                            plgpu.barrier_wait(free.at[slot])
                        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(step * BLOCK, BLOCK)],
                                                bufs.at[slot], full.at[slot])

                @pl.when(warp == 1)
                def _drain():
                    @pl.loop(0, steps)
                    def _(step):
                        slot = lax.rem(step, SLOTS)
                        plgpu.barrier_wait(full.at[slot])
                        plgpu.copy_smem_to_gmem(bufs.at[slot],
                                                o_ref.at[pl.ds(step * BLOCK, BLOCK)])
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        if hand_back:
                            plgpu.barrier_arrive(free.at[slot])

    def kernel(x_ref, o_ref):
        pl.run_scoped(functools.partial(body, x_ref, o_ref),
                      plgpu.SMEM((SLOTS, BLOCK, 64), F32), plgpu.Barrier(num_barriers=SLOTS),
                      plgpu.Barrier(num_barriers=SLOTS), collective_axes="wg")

    return plgpu.kernel(kernel, out_type=S(x.shape, F32), num_threads=2, thread_name="wg",
                        backend=backend)(x)


def test_warps_run_each_at_its_own_pace() -> None:
    """6 steps through 2 slots: warp 0 must wait for warp 1's hand-backs, so the warps cannot
    run one after the other."""
    x = jax.random.normal(jax.random.key(1), (6 * BLOCK, 64), F32)
    np.testing.assert_array_equal(warp_copy(x), x)
    (_, module), = inspection.kernels(_lower(functools.partial(warp_copy,
                                                                backend="mosaic_gpu"), x))
    assert inspection.tma_loads(str(module)) > 0


def test_a_warp_waiting_for_nothing_is_a_deadlock() -> None:
    x = jax.random.normal(jax.random.key(2), (6 * BLOCK, 64), F32)
    with pytest.raises(pl.PallasError, match="deadlock"):
        jax.block_until_ready(warp_copy(x, hand_back=False))


def test_warp_mesh_refusals() -> None:
    x = jnp.zeros((BLOCK, 64), F32)

    def arrays_in_a_warp(x_ref, o_ref):
        @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
        def _():
            o_ref[...] = x_ref[...] + 1.0

    with pytest.raises(pl.UnsupportedError, match="holds scalars and Refs only"):
        plgpu.kernel(arrays_in_a_warp, out_type=S(x.shape, F32), backend="mosaic_gpu")(x)

    def no_shared_memory(x_ref, o_ref):
        @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
        def _():
            @pl.when(lax.axis_index("warp") == 0)
            def _():
                pass

    with pytest.raises(pl.UnsupportedError, match="sub-points"):
        plgpu.kernel(no_shared_memory, out_type=S(x.shape, F32), backend="interpret")(x)

    with pytest.raises(pl.PallasError, match="inside a kernel body"):
        @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
        def _outside() -> None:
            pass

    with pytest.raises(pl.UnsupportedError, match="scratch_shapes"):
        pl.core_map(plgpu.WarpMesh(axis_name="warp"),
                    scratch_shapes=[plgpu.SMEM((8,), F32)])


def test_a_while_loop_of_scalars_lowers() -> None:
    """A lax.while_loop other than a fori_loop (here: halving until odd) lowers as scf.while."""
    def body(n_ref, o_ref):
        def halve(c):
            return c // 2

        o_ref[0] = lax.while_loop(lambda c: c % 2 == 0, halve, n_ref[0])

    def run(n: jax.Array, backend: str) -> jax.Array:
        return plgpu.kernel(body, out_type=S((1,), jnp.int32), backend=backend,
                            scratch_types=[])(n)

    n = jnp.array([96], jnp.int32)
    np.testing.assert_array_equal(run(n, "interpret"), [3])
    (_, module), = inspection.kernels(_lower(functools.partial(run, backend="mosaic_gpu"), n))
    assert "scf.while" in str(module)


def test_a_warpgroup_wait_after_warps_waited_differently_is_a_deadlock() -> None:
    """Warp 0 waits for the copy's phase, the other warps do not; a wait of the whole
    warpgroup on that barrier afterwards has its threads disagree about the phase (a hang on
    the hardware), reported as a deadlock."""
    x = jax.random.normal(jax.random.key(3), (BLOCK, 64), F32)

    def body(x_ref, o_ref, buf, full):
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _():
            plgpu.copy_gmem_to_smem(x_ref, buf, full.at[0])

        @pl.when(wg == 0)
        def _():
            @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
            def _():
                @pl.when(lax.axis_index("warp") == 0)
                def _():
                    plgpu.barrier_wait(full.at[0])

            plgpu.barrier_wait(full.at[0])
            plgpu.copy_smem_to_gmem(buf, o_ref)
            plgpu.wait_smem_to_gmem(0)

    def kernel(x_ref, o_ref):
        pl.run_scoped(functools.partial(body, x_ref, o_ref), plgpu.SMEM((BLOCK, 64), F32),
                      plgpu.Barrier(num_barriers=1), collective_axes="wg")

    with pytest.raises(pl.PallasError, match="deadlock"):
        jax.block_until_ready(plgpu.kernel(kernel, out_type=S(x.shape, F32), num_threads=2,
                                           thread_name="wg", backend="interpret")(x))
