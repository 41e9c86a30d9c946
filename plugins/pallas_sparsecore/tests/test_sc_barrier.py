"""``plsc.subcore_barrier`` in the interpreter: the subcores of a core run in lockstep, phase by
phase, each with its own values and per-subcore VMEM, sharing ``plsc.VMEM_SHARED`` and the
operands. Every kernel here exchanges data between subcores through shared memory, so it gives
wrong results if any subcore ran past a barrier before the others reached it (as running the
subcores one after another would). Points that disagree on reaching a barrier are reported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plsc = pytest.importorskip("pallas_sparsecore")
import pallas_interpret as pli  # noqa: E402
import pallas_mosaic_tpu as pltpu  # noqa: E402
from pallas_interpret.lockstep import BarrierDivergenceError  # noqa: E402
from pallas_mosaic_tpu import inspection  # noqa: E402

L = 16


def mesh(cores=2, subcores=4):
    return plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=cores,
                                  num_subcores=subcores, target="v7x")


def rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def rotate(cores, subcores, interpret=True, compiler_params=None):
    """Each subcore doubles its row into VMEM, publishes it in shared VMEM, waits, then writes
    its neighbour's row plus its own (kept in its private VMEM across the barrier)."""
    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh(cores, subcores),
                   interpret=interpret, compiler_params=compiler_params,
                   scratch_types=[plsc.VMEM_SHARED((subcores, L), x.dtype),
                                  pltpu.VMEM((L,), x.dtype), pltpu.VMEM((L,), x.dtype)])
        def k(x_hbm, o_hbm, shared, mine, theirs):
            s = lax.axis_index("s")
            row = lax.axis_index("c") * subcores + s
            pltpu.sync_copy(x_hbm.at[row], mine)
            mine[...] = mine[...] * 2
            pltpu.sync_copy(mine, shared.at[s])
            plsc.subcore_barrier()
            pltpu.sync_copy(shared.at[(s + 1) % subcores], theirs)
            theirs[...] = theirs[...] + mine[...]
            pltpu.sync_copy(theirs, o_hbm.at[row])
        return k(x)
    return fn


def rotate_reference(x, cores, subcores):
    x2 = np.asarray(x).reshape(cores, subcores, L) * 2
    return (np.roll(x2, -1, axis=1) + x2).reshape(cores * subcores, L)


@pytest.mark.parametrize("cores,subcores", [(1, 2), (2, 4), (2, 16)])
def test_subcores_exchange_rows_through_shared_vmem(cores, subcores) -> None:
    x = rand(cores * 10 + subcores, (cores * subcores, L))
    out = rotate(cores, subcores)(x)
    np.testing.assert_allclose(out, rotate_reference(x, cores, subcores), rtol=1e-6)


def test_the_same_kernel_lowers_with_its_barrier() -> None:
    x = rand(0, (8, L))
    lowered = jax.jit(rotate(2, 4, interpret=False)).trace(x).lower(lowering_platforms=("tpu",))
    (_, module), = inspection.kernels(lowered.as_text())
    assert str(module).count("tpu.barrier") == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shuffled_subcore_order_gives_the_same_result(seed) -> None:
    x = rand(seed, (8, L))
    out = rotate(2, 4, interpret=pli.InterpretParams(shuffle_seed=seed))(x)
    np.testing.assert_allclose(out, rotate_reference(x, 2, 4), rtol=1e-6)


def test_batched_under_vmap() -> None:
    xs = rand(3, (3, 8, L))
    out = jax.vmap(rotate(2, 4))(xs)
    for b in range(3):
        np.testing.assert_allclose(out[b], rotate_reference(xs[b], 2, 4), rtol=1e-6)


def ring_sum(cores, subcores, trips=None):
    """All-reduce over a core's subcores by passing partial vectors round a ring: subcores-1
    rounds of publish, barrier, receive, barrier, inside a fori_loop. ``trips`` (a function of
    the subcore index) overrides the number of rounds."""
    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh(cores, subcores),
                   interpret=True,
                   scratch_types=[plsc.VMEM_SHARED((subcores, L), x.dtype),
                                  pltpu.VMEM((L,), x.dtype)])
        def k(x_hbm, o_hbm, shared, v):
            s = lax.axis_index("s")
            row = lax.axis_index("c") * subcores + s
            pltpu.sync_copy(x_hbm.at[row], v)

            def round_(_, carry):
                passing, total = carry
                v[...] = passing
                pltpu.sync_copy(v, shared.at[s])
                plsc.subcore_barrier()
                pltpu.sync_copy(shared.at[(s + subcores - 1) % subcores], v)
                plsc.subcore_barrier()  # everyone has read before the next round writes
                return v[...], total + v[...]

            mine = v[...]
            n = subcores - 1 if trips is None else trips(s)
            _, total = lax.fori_loop(0, n, round_, (mine, mine))
            v[...] = total
            pltpu.sync_copy(v, o_hbm.at[row])
        return k(x)
    return fn


@pytest.mark.parametrize("cores,subcores", [(1, 4), (2, 8)])
def test_barriers_inside_a_loop(cores, subcores) -> None:
    x = jax.random.randint(jax.random.key(7), (cores * subcores, L), -1000, 1000, jnp.int32)
    out = ring_sum(cores, subcores)(x)
    sums = np.asarray(x).reshape(cores, subcores, L).sum(axis=1, keepdims=True)
    expected = np.broadcast_to(sums, (cores, subcores, L)).reshape(-1, L)
    np.testing.assert_array_equal(out, expected)


def test_loop_trip_count_that_differs_between_subcores_is_reported() -> None:
    fn = ring_sum(1, 4, trips=lambda s: s + 1)
    # Found while the kernel runs, and raised to the caller as itself.
    with pytest.raises(BarrierDivergenceError, match=r"disagree on whether to run "
                       r"another iteration.*hangs.*Fix"):
        jax.block_until_ready(fn(rand(8, (4, L))))


def reverse_in_scope(barrier_when=None):
    """Shared VMEM allocated with pl.run_scoped around the barrier: subcore s writes out the
    row of subcore S-1-s. ``barrier_when`` (of the core and subcore indices) guards the
    barrier with pl.when."""
    cores, subcores = 2, 4

    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh(cores, subcores),
                   interpret=True)
        def k(x_hbm, o_hbm):
            c, s = lax.axis_index("c"), lax.axis_index("s")
            row = c * subcores + s

            def scoped(shared, v):
                pltpu.sync_copy(x_hbm.at[row], v)
                pltpu.sync_copy(v, shared.at[s])
                if barrier_when is None:
                    plsc.subcore_barrier()
                else:
                    pl.when(barrier_when(c, s))(plsc.subcore_barrier)
                pltpu.sync_copy(shared.at[subcores - 1 - s], o_hbm.at[row])

            pl.run_scoped(scoped, plsc.VMEM_SHARED((subcores, L), x.dtype),
                          pltpu.VMEM((L,), x.dtype))
        return k(x)
    return fn


def reversed_rows(x):
    return np.asarray(x).reshape(2, 4, L)[:, ::-1].reshape(8, L)


def test_shared_vmem_from_run_scoped_is_one_buffer_per_core() -> None:
    x = rand(9, (8, L))
    np.testing.assert_array_equal(reverse_in_scope()(x), reversed_rows(x))


def test_barrier_under_a_condition_all_subcores_share() -> None:
    x = rand(10, (8, L))
    out = reverse_in_scope(barrier_when=lambda c, s: c < 2)(x)  # true for every subcore
    np.testing.assert_array_equal(out, reversed_rows(x))


def test_barrier_that_only_some_subcores_reach_is_reported() -> None:
    with pytest.raises(BarrierDivergenceError, match=r"disagree on which branch "
                       r"of a cond.*point 0 and point 1 differ"):
        jax.block_until_ready(reverse_in_scope(barrier_when=lambda c, s: s == 0)(
            rand(11, (8, L))))


def racy(seed, via):
    """After the barrier each subcore overwrites its shared row and reads its neighbour's in
    the same phase: what it reads depends on the order in which the subcores run. The seed is
    passed ``via`` compiler_params= or interpret=."""
    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh(1, 4),
                   **{via: pli.InterpretParams(shuffle_seed=seed)},
                   scratch_types=[plsc.VMEM_SHARED((4, L), x.dtype), pltpu.VMEM((L,), x.dtype)])
        def k(x_hbm, o_hbm, shared, v):
            s = lax.axis_index("s")
            pltpu.sync_copy(x_hbm.at[s], v)
            pltpu.sync_copy(v, shared.at[s])
            plsc.subcore_barrier()
            v[...] = v[...] + 1
            pltpu.sync_copy(v, shared.at[s])
            pltpu.sync_copy(shared.at[(s + 1) % 4], o_hbm.at[s])
        return k(x)
    return fn


@pytest.mark.parametrize("via", ["compiler_params", "interpret"])
def test_shuffled_order_exposes_a_race_within_a_phase(via) -> None:
    x = rand(12, (4, L))
    results = [np.asarray(racy(seed, via)(x)) for seed in range(6)]
    assert any(not np.array_equal(results[0], r) for r in results[1:])


def test_checked_mode_poisons_shared_vmem_nobody_wrote() -> None:
    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh(1, 4),
                   compiler_params=pli.InterpretParams(checked=True),
                   scratch_types=[plsc.VMEM_SHARED((4, L), x.dtype), pltpu.VMEM((L,), x.dtype)])
        def k(x_hbm, o_hbm, shared, v):
            s = lax.axis_index("s")
            pltpu.sync_copy(x_hbm.at[s], v)

            @pl.when(s % 2 == 0)
            def _():
                pltpu.sync_copy(v, shared.at[s])

            plsc.subcore_barrier()
            pltpu.sync_copy(shared.at[(s + 1) % 4], o_hbm.at[s])
        return k(x)

    x = rand(13, (4, L))
    out = np.asarray(fn(x))
    np.testing.assert_array_equal(out[[1, 3]], np.asarray(x)[[2, 0]])
    assert np.isnan(out[[0, 2]]).all()


def test_checked_mode_reports_out_of_bounds_reads_between_barriers() -> None:
    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct((4, L), x.dtype), mesh=mesh(1, 4),
                   interpret=pli.InterpretParams(checked=True),
                   scratch_types=[plsc.VMEM_SHARED((4, L), x.dtype), pltpu.VMEM((2 * L,), x.dtype),
                                  pltpu.VMEM((L,), x.dtype)])
        def k(x_hbm, o_hbm, shared, v, w):
            s = lax.axis_index("s")
            pltpu.sync_copy(x_hbm, v)
            plsc.subcore_barrier()
            w[...] = v[pl.ds(s * 8, L)]  # subcore 3 reads past the end of v
            pltpu.sync_copy(w, o_hbm.at[s])
        return k(x)

    with pytest.raises(Exception, match=r"Out-of-bounds read of scratch 1 in kernel 'k' at grid "
                       r"step \(0, 3\).*index starting at \(24,\)"):
        jax.block_until_ready(fn(rand(14, (2 * L,))))
        jax.effects_barrier()
