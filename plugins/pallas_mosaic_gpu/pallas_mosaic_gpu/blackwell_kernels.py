"""Blackwell (sm_100a) kernels of this backend, used by its tests and documentation."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
import pallas_mosaic_gpu as plgpu


def matmul(a: jax.Array, b: jax.Array, *, tile_m: int = 128, tile_n: int = 128,
           tile_k: int = 64, max_concurrent_steps: int = 2,
           backend: str | None = None) -> jax.Array:
    """``a @ b`` (16-bit floats, float32 accumulation, result in ``a``'s dtype) with one
    warpgroup per (tile_m, tile_n) output tile: TMA copies fill ``max_concurrent_steps`` SMEM
    slots of A and B, ``tcgen05_mma`` accumulates into TMEM and completes the slot's barrier
    when it has read them, and the TMEM tile is read into registers, stored to SMEM and copied
    out by TMA. (JAX's blackwell_matmul_mgpu splits the same work over a TMA warp, an MMA warp
    and a store warpgroup, and schedules tiles dynamically.)"""
    (m, k), (_, n) = a.shape, b.shape
    m_iters, n_iters, k_iters = m // tile_m, n // tile_n, k // tile_k
    steps = max_concurrent_steps

    def kernel(a_gmem: Any, b_gmem: Any, out_gmem: Any, a_smem: Any, b_smem: Any,
               acc_tmem: Any, out_smem: Any, loaded: Any, consumed: Any, done: Any) -> None:
        idx = lax.axis_index("tiles")
        rows = pl.ds((idx // n_iters) * tile_m, tile_m)
        cols = pl.ds((idx % n_iters) * tile_n, tile_n)

        def fetch(ki: Any, slot: Any) -> None:
            ks = pl.ds(ki * tile_k, tile_k)
            plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(b_gmem.at[ks, cols], b_smem.at[slot], loaded.at[slot])

        for s in range(min(steps, k_iters)):
            fetch(s, s)

        def step(ki: Any, carry: Any) -> Any:
            slot = lax.rem(ki, steps)
            plgpu.barrier_wait(loaded.at[slot])
            plgpu.tcgen05_mma(acc_tmem, a_smem.at[slot], b_smem.at[slot], consumed.at[slot],
                              accumulate=ki > 0)

            @pl.when(ki + steps < k_iters)
            def _refill() -> None:
                plgpu.barrier_wait(consumed.at[slot])  # the MMA has read this slot
                fetch(ki + steps, slot)
            return carry

        lax.fori_loop(0, k_iters, step, None)
        plgpu.tcgen05_commit_arrive(done.at[0])
        plgpu.barrier_wait(done.at[0])
        out_smem[...] = plgpu.async_load_tmem(acc_tmem).astype(out_smem.dtype)
        plgpu.wait_load_tmem()
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
        grid=(m_iters * n_iters,), grid_names=("tiles",), backend=backend,
        scratch_shapes=[
            plgpu.SMEM((steps, tile_m, tile_k), a.dtype),
            plgpu.SMEM((steps, tile_k, tile_n), a.dtype),
            plgpu.TMEM((tile_m, tile_n), jnp.float32),
            plgpu.SMEM((tile_m, tile_n), a.dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=steps),
            plgpu.Barrier(num_barriers=steps, orders_tensor_core=True),
            plgpu.Barrier(orders_tensor_core=True),
        ])
    return call(a, b)  # type: ignore[no-any-return]


matmul_sm100 = functools.partial(matmul, backend="mosaic_gpu")
