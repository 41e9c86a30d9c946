"""Warpgroups that share SMEM (``pl.run_scoped(collective_axes="wg")``) and wait on each
other's barriers run in the interpreter each at its own pace (pallas_interpret.phases): a
producer warpgroup fills a ring of SMEM slots, a consumer waits for each slot, uses it and
hands it back, against ``jax.numpy`` on random inputs; a wait no arrival completes is reported
as a deadlock."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")

S = jax.ShapeDtypeStruct
F32 = jnp.float32
BLOCK, SLOTS = 256, 2


def ring(x: jax.Array, backend: str = "interpret", hand_back: bool = True,
         consumers: int = 1) -> jax.Array:
    """Per block of ``x``: 2 * block + 1, the blocks streamed through SLOTS shared SMEM
    slots by the last warpgroup; each consumer warpgroup writes its share of the rows."""
    steps = x.shape[0] // BLOCK
    part = BLOCK // consumers

    def body(x_ref, o_ref, bufs, full, free):
        wg = lax.axis_index("wg")

        @pl.when(wg == consumers)
        def _producer():
            for i in range(SLOTS):
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * BLOCK, BLOCK)], bufs.at[i],
                                        full.at[i])

            @pl.loop(0, steps - SLOTS)
            def _refill(step):
                slot = lax.rem(step, SLOTS)
                plgpu.barrier_wait(free.at[slot])  # every consumer is done with it
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds((step + SLOTS) * BLOCK, BLOCK)],
                                        bufs.at[slot], full.at[slot])

        @pl.when(wg < consumers)
        def _consumer():
            @pl.loop(0, steps)
            def _use(step):
                slot = lax.rem(step, SLOTS)
                plgpu.barrier_wait(full.at[slot])
                rows = pl.ds(wg * part, part)
                o_ref[pl.ds(step * BLOCK + wg * part, part)] = \
                    bufs[slot, rows] * 2.0 + 1.0
                if hand_back:
                    plgpu.barrier_arrive(free.at[slot])

    def kernel(x_ref, o_ref):
        pl.run_scoped(functools.partial(body, x_ref, o_ref),
                      plgpu.SMEM((SLOTS, BLOCK), F32), plgpu.Barrier(num_barriers=SLOTS),
                      plgpu.Barrier(num_arrivals=consumers, num_barriers=SLOTS),
                      collective_axes="wg")

    return plgpu.kernel(kernel, out_type=S(x.shape, F32), num_threads=consumers + 1,
                        thread_name="wg", backend=backend)(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("consumers", [1, 2])
def test_producer_and_consumers_share_a_ring_of_slots(consumers: int) -> None:
    x = jax.random.normal(jax.random.key(consumers), (6 * BLOCK,), F32)
    got = ring(x, consumers=consumers)
    np.testing.assert_allclose(got, x * 2.0 + 1.0, rtol=1e-6)
    # The same kernel lowers for cuda.
    jax.jit(functools.partial(ring, backend="mosaic_gpu", consumers=consumers)).trace(
        x).lower(lowering_platforms=("cuda",))


def test_a_wait_no_arrival_completes_is_a_deadlock() -> None:
    x = jax.random.normal(jax.random.key(3), (6 * BLOCK,), F32)
    with pytest.raises(pl.PallasError, match="deadlock"):
        jax.block_until_ready(ring(x, hand_back=False))
