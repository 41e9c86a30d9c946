"""Kernels whose cores signal one another's semaphores (``semaphore_signal(core_index=)``) run
each core at its own pace (``pallas_interpret.handshake``): the result is what the hardware
gives whichever core comes first, checked against numpy and against JAX's TPU interpret mode
(which runs the cores in threads); a real deadlock is reported."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pallas_mosaic_tpu as pltpu
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from pallas_interpret import InterpretParams

import pallas_core as pl

MODES = {
    "default": lambda mods: True,
    "checked": lambda mods: InterpretParams(checked=True) if mods[0] is pl else None,
    "tpu": lambda mods: mods[1].InterpretParams(detect_races=True,
                                                allow_hbm_allocation_in_run_scoped=True),
}


def _copy_after_handoff(mods: tuple[Any, Any], first: int, interpret: Any) -> Any:
    """Core ``first`` copies x to y through a scoped HBM buffer, then signals the other core,
    which waits for it before doing the same (JAX's test_allocate_shared_buffer_in_core_map)."""
    pl_, tpu = mods
    mesh = tpu.create_tensorcore_mesh("x", num_cores=2)

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        def inner(refs: Any) -> None:
            x_ref, y_ref = refs

            @pl_.core_map(mesh, interpret=interpret)
            def _() -> None:
                def body(sem: Any) -> None:
                    @pl_.when(lax.axis_index("x") == 1 - first)
                    def _() -> None:
                        pl_.semaphore_wait(sem, 1)

                    def copy(hbm: Any) -> None:
                        tpu.sync_copy(x_ref, hbm)
                        tpu.sync_copy(hbm, y_ref)

                    pl_.run_scoped(copy, tpu.HBM(x_ref.shape, x_ref.dtype))

                    @pl_.when(lax.axis_index("x") == first)
                    def _() -> None:
                        pl_.semaphore_signal(sem, 1, core_index=1 - first)

                pl_.run_scoped(body, tpu.SemaphoreType.REGULAR)

        return pl_.run_state(inner)((x, jnp.zeros_like(x)))[1]

    return f


@pytest.mark.parametrize("mode", ["default", "checked", "tpu"])
@pytest.mark.parametrize("first", [0, 1])
def test_a_core_waits_for_the_other_whichever_runs_first(first: int, mode: str) -> None:
    x = jax.random.randint(jax.random.key(first), (16, 128), -100, 100, jnp.int32)
    mods = (pl, pltpu)
    np.testing.assert_array_equal(_copy_after_handoff(mods, first, MODES[mode](mods))(x), x)


def _take_turns(mods: tuple[Any, Any], starter: int, turns: Any) -> Any:
    """Two cores take ``turns`` turns each, alternating (``starter`` first), each turn
    updating y in HBM from the one before: y = 3 y + (core + 1) x. A loop of traced trip
    count when ``turns`` is None (it is then an operand)."""
    pl_, tpu = mods
    mesh = tpu.create_tensorcore_mesh("x", num_cores=2)
    interpret = mods[1].InterpretParams()

    @jax.jit
    def f(x: jax.Array, n: jax.Array) -> jax.Array:
        def inner(refs: Any) -> None:
            x_ref, y_ref, n_ref = refs

            @pl_.core_map(mesh, interpret=interpret)
            def _() -> None:
                def body(x_vmem: Any, y_vmem: Any, n_smem: Any, sem: Any) -> None:
                    core = lax.axis_index("x")
                    tpu.sync_copy(n_ref, n_smem)
                    count = n_smem[0] if turns is None else turns

                    def turn(i: Any, carry: Any) -> Any:
                        @pl_.when((i > 0) | (core != starter))
                        def _() -> None:
                            pl_.semaphore_wait(sem, 1)

                        tpu.sync_copy(x_ref, x_vmem)
                        tpu.sync_copy(y_ref, y_vmem)
                        y_vmem[...] = y_vmem[...] * 3 + (core + 1) * x_vmem[...]
                        tpu.sync_copy(y_vmem, y_ref)

                        @pl_.when((i < count - 1) | (core == starter))
                        def _() -> None:
                            pl_.semaphore_signal(sem, 1, core_index=1 - core)

                        return carry + 1

                    done = lax.fori_loop(0, count, turn, jnp.int32(0))
                    y_vmem[...] = jnp.full(y_vmem.shape, done, y_vmem.dtype)

                pl_.run_scoped(body, tpu.VMEM(x_ref.shape, x_ref.dtype),
                               tpu.VMEM(x_ref.shape, x_ref.dtype), tpu.SMEM((1,), jnp.int32),
                               tpu.SemaphoreType.REGULAR)

        return pl_.run_state(inner)((x, x, n.reshape(1)))[1]

    return f


def _turns_reference(x: np.ndarray, starter: int, turns: int) -> np.ndarray:
    y = x.copy()
    for t in range(2 * turns):
        core = starter if t % 2 == 0 else 1 - starter
        y = y * 3 + (core + 1) * x
    return y


@pytest.mark.parametrize("turns", [3, None], ids=["fori", "traced"])
@pytest.mark.parametrize("starter", [0, 1])
def test_cores_take_turns_in_a_loop(starter: int, turns: int | None) -> None:
    x = np.asarray(jax.random.randint(jax.random.key(7), (8, 128), -50, 50, jnp.int32))
    n = jnp.int32(3)
    expected = _turns_reference(x, starter, 3)
    ours = _take_turns((pl, pltpu), starter, turns)(x, n)
    np.testing.assert_array_equal(ours, expected)
    theirs = _take_turns((jpl, jpltpu), starter, turns)(x, n)  # JAX: cores in threads
    np.testing.assert_array_equal(ours, theirs)


def test_cores_that_both_wait_first_are_a_deadlock() -> None:
    mesh = pltpu.create_tensorcore_mesh("x", num_cores=2)

    def body(x_ref: Any, o_ref: Any, sem: Any) -> None:
        pl.semaphore_wait(sem, 1)
        pl.semaphore_signal(sem, 1, core_index=1 - lax.axis_index("x"))

    call = pl.kernel(body, out_type=jax.ShapeDtypeStruct((8,), jnp.float32), mesh=mesh,
                     scratch_types=[pltpu.SemaphoreType.REGULAR], interpret=True)
    with pytest.raises(Exception, match=r"deadlock.*core\(s\) \[0, 1\] wait.*Fix"):
        jax.block_until_ready(call(jnp.ones(8)))
        jax.effects_barrier()


def test_a_signal_sent_before_the_wait_is_kept() -> None:
    """Each core signals the other, then waits: in one-core-at-a-time order core 1's signal
    comes after core 0 waits, so core 0 must wait until core 1 has run."""
    mesh = pltpu.create_tensorcore_mesh("x", num_cores=2)

    def body(x_ref: Any, o_ref: Any, sem: Any) -> None:
        core = lax.axis_index("x")
        pl.semaphore_signal(sem, core + 1, core_index=1 - core)
        pl.semaphore_wait(sem, 2 - core)
        o_ref[core] = pl.semaphore_read(sem) + x_ref[core]

    call = pl.kernel(body, out_type=jax.ShapeDtypeStruct((2,), jnp.int32), mesh=mesh,
                     scratch_types=[pltpu.SemaphoreType.REGULAR], interpret=True)
    x = jnp.asarray([5, 9], jnp.int32)
    np.testing.assert_array_equal(call(x), x)


def test_hbm_in_run_scoped_is_refused_as_elsewhere() -> None:
    """The semaphore's scope (run by the handshake runner) allocates HBM: TPU interpret mode
    refuses it unless allow_hbm_allocation_in_run_scoped, as it does in any other kernel."""
    mesh = pltpu.create_tensorcore_mesh("x", num_cores=2)

    def body(x_ref: Any, o_ref: Any) -> None:
        def scope(sem: Any, hbm: Any) -> None:
            core = lax.axis_index("x")
            pl.semaphore_signal(sem, 1, core_index=1 - core)
            pl.semaphore_wait(sem, 1)
            pltpu.sync_copy(x_ref, hbm)
            pltpu.sync_copy(hbm, o_ref)

        pl.run_scoped(scope, pltpu.SemaphoreType.REGULAR, pltpu.HBM((8,), jnp.float32))

    def call(**kw: Any) -> Any:
        return pl.kernel(body, out_type=jax.ShapeDtypeStruct((8,), jnp.float32), mesh=mesh,
                         interpret=pltpu.InterpretParams(**kw))

    x = jax.random.normal(jax.random.key(1), (8,), jnp.float32)
    with pytest.raises(Exception, match=r"Cannot allocate HBM in `run_scoped`.*Fix"):
        call()(x)
    np.testing.assert_array_equal(call(allow_hbm_allocation_in_run_scoped=True)(x), x)
