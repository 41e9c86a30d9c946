"""Which runner runs a kernel (``pallas_interpret.grid.RUNNERS``): for kernels that each runner
is for, the table picks the runner that the interpreter's former chain of ``if``s picked
(written out here as :func:`former_choice`), refuses what it refused with the same error, and
every row says why it is there."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pallas_mosaic_tpu as pltpu
import pytest
from jax import lax
from pallas_interpret import InterpretParams, fast, grid, handshake, lockstep, phases

import pallas_core as pl
from pallas_core.errors import UnsupportedError
from pallas_core.stages import kernel_calls

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def former_choice(call: pl.KernelCall, params: InterpretParams) -> str:
    """The runner ``grid.run`` chose before the table, as its chain of ``if``s chose it."""
    if call.grid_mapping.dynamic_axes:
        if lockstep.barrier_axes(call) is not None:
            raise UnsupportedError("barriers and a dynamic grid")
        return "exact"
    if handshake.signals_cores(call):
        return "handshake"
    if phases.group_axes(call) is not None:
        return "phases"
    phases.check_no_fork(call)
    if lockstep.lockstep_axes(call) is not None:
        if params.num_cores > 1 or params.grid_point_recorder is not None:
            raise UnsupportedError("has barriers, so the interpreter runs its points in lockstep")
        return "lockstep"
    batch = params.fast and not (params.checked or params.tpu_memory or params.num_cores > 1
                                 or params.shuffle_seed is not None or params.grid_point_recorder)
    return "fast" if batch and fast.plan(call) is not None else "exact"


def the_call(fn: Any, *args: Any) -> pl.KernelCall:
    (call,) = kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    return call


def check(call: pl.KernelCall, params: InterpretParams, expected: str) -> None:
    runner, fit = grid.choose(call, params)
    assert runner.name == former_choice(call, params) == expected
    assert fit is not None


def check_refused(call: pl.KernelCall, params: InterpretParams, match: str) -> None:
    with pytest.raises(UnsupportedError, match=match):
        former_choice(call, params)
    with pytest.raises(UnsupportedError, match=match):
        grid.choose(call, params)


# --- kernels ---------------------------------------------------------------------------------


def elementwise(scratch: bool = False) -> Any:
    """x + 1 over a (4, 2) grid of (8, 128) blocks; with ``scratch``, through a VMEM buffer."""
    def kernel(x_ref: Any, o_ref: Any, *scratch_refs: Any) -> None:
        if scratch_refs:
            scratch_refs[0][...] = x_ref[...]
            o_ref[...] = scratch_refs[0][...] + 1.0
        else:
            o_ref[...] = x_ref[...] + 1.0

    spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    return pl.pallas_call(kernel, S((32, 256), F32), grid=(4, 2), in_specs=[spec],
                          out_specs=spec, interpret=True,
                          scratch_shapes=[pltpu.VMEM((8, 128), F32)] if scratch else ())


def dynamic_grid(x: jax.Array, n: Any) -> jax.Array:
    """Sums the first ``n`` column blocks of ``x``: a grid whose second size is traced."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(1) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += x_ref[...]

    return pl.pallas_call(
        kernel, S((x.shape[0], 128), F32), grid=(x.shape[0] // 8, n),
        in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
        out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)), interpret=True)(x)


def two_cores(core_index: bool) -> Any:
    """Two TensorCores: core 0 copies x to the output and signals a semaphore, core 1 waits on
    it. With ``core_index``, core 0 signals core 1's semaphore (core 1 waits for core 0);
    without, each core signals its own before waiting on it."""
    mesh = pltpu.TensorCoreMesh(axis_name="x", num_cores=2)

    def body(x_ref: Any, o_ref: Any, sem: Any) -> None:
        core = lax.axis_index("x")

        @pl.when(core == 0)
        def _() -> None:
            pltpu.sync_copy(x_ref, o_ref)

        if core_index:
            @pl.when(core == 0)
            def _() -> None:
                pl.semaphore_signal(sem, 1, core_index=1)

            @pl.when(core == 1)
            def _() -> None:
                pl.semaphore_wait(sem, 1)
        else:
            pl.semaphore_signal(sem, 1)
            pl.semaphore_wait(sem, 1)

    return pl.kernel(body, out_type=S((8, 128), F32), mesh=mesh, interpret=True,
                     scratch_types=[pltpu.SemaphoreType.REGULAR])


def subcores_at_a_barrier(x: jax.Array) -> jax.Array:
    """Four SparseCore subcores, each copying its row through its VMEM, meet at a barrier."""
    plsc = pytest.importorskip("pallas_sparsecore")
    mesh = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                  num_subcores=4, target="v7x")

    @pl.kernel(out_type=S((4, 16), F32), mesh=mesh, interpret=True,
               scratch_types=[pltpu.VMEM((16,), F32)])
    def k(x_hbm: Any, o_hbm: Any, row: Any) -> None:
        pltpu.sync_copy(x_hbm.at[lax.axis_index("s")], row)
        plsc.subcore_barrier()
        pltpu.sync_copy(row, o_hbm.at[lax.axis_index("s")])

    return k(x)  # type: ignore[no-any-return]


def warpgroups(thread_axis: bool) -> Any:
    """A Mosaic GPU kernel claiming grid points with ``dynamic_scheduling_loop``: with
    ``thread_axis``, two warpgroups share the loop's memory and wait on its barriers."""
    plgpu = pytest.importorskip("pallas_mosaic_gpu")

    def f(x: jax.Array) -> Any:
        def body(x_ref: Any, o_ref: Any) -> None:
            @plgpu.dynamic_scheduling_loop(grid_names=("i",),
                                           thread_axis="wg" if thread_axis else None)
            def _(info: Any) -> None:
                (i,) = info.index
                rows = pl.ds(i * 8, 8)
                o_ref[rows] = x_ref[rows] * 2.0

        threads = {"num_threads": 2, "thread_name": "wg"} if thread_axis else {}
        return plgpu.kernel(body, out_type=S(x.shape, F32), grid=(6,), grid_names=("i",),
                            backend="interpret", **threads)(x)

    return f


def warps_without_shared_memory(x: jax.Array) -> Any:
    """``pl.core_map`` over ``plgpu.WarpMesh`` in a kernel whose warpgroups share nothing."""
    plgpu = pytest.importorskip("pallas_mosaic_gpu")

    def body(x_ref: Any, o_ref: Any) -> None:
        @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
        def _() -> None:
            @pl.when(lax.axis_index("warp") == 0)
            def _() -> None:
                pass

    return plgpu.kernel(body, out_type=S(x.shape, F32), backend="interpret")(x)


# --- the choices -----------------------------------------------------------------------------


def test_every_row_says_why_and_the_last_takes_any_kernel() -> None:
    names = [r.name for r in grid.RUNNERS]
    assert names == ["handshake", "phases", "lockstep", "fast", "exact"]
    for runner in grid.RUNNERS:
        assert runner.reason.strip(), runner.name
    call = the_call(elementwise(), jnp.zeros((32, 256), F32))
    assert grid.RUNNERS[-1].applies(call, InterpretParams()) is not None


@pytest.mark.parametrize(("params", "expected"), [
    (InterpretParams(), "fast"),
    (InterpretParams(fast=False), "exact"),
    (InterpretParams(checked=True), "exact"),
    (InterpretParams(shuffle_seed=0), "exact"),
    (InterpretParams(tpu_memory=True), "exact"),
    (InterpretParams(num_cores=2, parallel_axes=(0,)), "exact"),
])
def test_an_elementwise_kernel_is_batched_unless_its_steps_are_asked_for(
        params: InterpretParams, expected: str) -> None:
    call = the_call(elementwise(), jnp.zeros((32, 256), F32))
    assert fast.plan(call) is not None
    check(call, params, expected)


def test_scratch_carried_across_steps_runs_step_by_step() -> None:
    call = the_call(elementwise(scratch=True), jnp.zeros((32, 256), F32))
    assert fast.plan(call) is None
    check(call, InterpretParams(), "exact")


def test_a_dynamic_grid_runs_step_by_step() -> None:
    call = the_call(dynamic_grid, jnp.zeros((16, 640), F32), jnp.int32(3))
    assert call.grid_mapping.dynamic_axes
    check(call, InterpretParams(), "exact")


def test_cores_signalling_each_other_run_each_at_its_own_pace() -> None:
    call = the_call(two_cores(core_index=True), jnp.zeros((8, 128), F32))
    assert handshake.signals_cores(call)
    check(call, InterpretParams(), "handshake")
    check(call, InterpretParams(checked=True), "handshake")
    # Semaphores a core signals for itself need no handshake: its steps run in turn.
    call = the_call(two_cores(core_index=False), jnp.zeros((8, 128), F32))
    assert not handshake.signals_cores(call)
    check(call, InterpretParams(), "exact")


def test_subcores_meeting_at_a_barrier_run_in_lockstep() -> None:
    call = the_call(subcores_at_a_barrier, jnp.zeros((4, 16), F32))
    assert lockstep.lockstep_axes(call) is not None
    check(call, InterpretParams(), "lockstep")
    check(call, InterpretParams(fast=False), "lockstep")
    check_refused(call, InterpretParams(num_cores=2, parallel_axes=()),
                  "runs its points in lockstep")
    check_refused(call, InterpretParams(grid_point_recorder=lambda *a: None),
                  "runs its points in lockstep")


def test_warpgroups_sharing_memory_run_in_phases() -> None:
    x = jnp.zeros((48, 128), F32)
    call = the_call(warpgroups(thread_axis=True), x)
    assert phases.group_axes(call) is not None
    check(call, InterpretParams(), "phases")
    # The same loop without warpgroups sharing its memory: each block on its own, in steps.
    call = the_call(warpgroups(thread_axis=False), x)
    assert phases.group_axes(call) is None
    check(call, InterpretParams(), "exact")


@pytest.mark.filterwarnings("ignore:pl.core_map is deprecated")
def test_warps_outside_the_phases_runner_are_refused() -> None:
    call = the_call(warps_without_shared_memory, jnp.zeros((128, 64), F32))
    check_refused(call, InterpretParams(), "sub-points")
