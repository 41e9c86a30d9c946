"""Reference kernels written for the Mosaic GPU backend on Hopper (sm_90a: TMA, barriers,
``wgmma``), used by the tests, the examples and ``benchmarks/gpu_mosaic.py``; those without
``wgmma`` lower for Blackwell too, whose own (TMEM, ``tcgen05``) kernels are in
:mod:`pallas_mosaic_gpu.blackwell_kernels`. Each runs on the ``mosaic_gpu`` backend unless
``backend=`` names another; pass ``backend="interpret"`` to run it on a CPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from pallas_mosaic_gpu import params as plgpu
from pallas_mosaic_gpu import primitives as gpu


def add_one(x: jax.Array, *, backend: str | None = None) -> jax.Array:
    """``x + 1`` over a 1-D array of 256 elements, two thread blocks of 128 (``plgpu.kernel``,
    reading and writing GMEM directly)."""
    n = x.shape[0] // 2

    @functools.partial(plgpu.kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(2,), grid_names=("x",), backend=backend or plgpu.NAME)
    def kernel(x_ref: Any, o_ref: Any) -> None:
        window = pl.ds(lax.axis_index("x") * n, n)
        o_ref[window] = x_ref[window] + 1.0

    return kernel(x)  # type: ignore[no-any-return]


def add_one_tma(x: jax.Array, *, backend: str | None = None) -> jax.Array:
    """``x + 1`` with explicit TMA copies, a barrier and ``commit_smem`` (``plgpu.kernel``)."""
    n = x.shape[0] // 2

    @functools.partial(plgpu.kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(2,), grid_names=("x",), backend=backend or plgpu.NAME,
                       scratch_shapes=[plgpu.SMEM((n,), x.dtype), plgpu.Barrier(num_arrivals=1)])
    def kernel(x_ref: Any, o_ref: Any, smem: Any, barrier: Any) -> None:
        window = pl.ds(lax.axis_index("x") * n, n)
        gpu.copy_gmem_to_smem(x_ref.at[window], smem, barrier.at[0])
        gpu.barrier_wait(barrier.at[0])
        smem[...] = smem[...] + 1.0
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(smem, o_ref.at[window])
        gpu.wait_smem_to_gmem(0)

    return kernel(x)  # type: ignore[no-any-return]


def blocked_add(x: jax.Array, y: jax.Array, *, block: tuple[int, int] = (64, 128),
                backend: str | None = None) -> jax.Array:
    """``x + y`` in (64, 128) blocks over a 2-D grid (``pl.pallas_call``)."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + y_ref[...]

    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    return pl.pallas_call(  # type: ignore[no-any-return]
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(x.shape[0], block[0]), pl.cdiv(x.shape[1], block[1])),
        in_specs=[spec, spec], out_specs=spec, backend=backend or plgpu.NAME)(x, y)


def softmax(x: jax.Array, *, block_rows: int = 64, backend: str | None = None) -> jax.Array:
    """Row softmax of a 2-D array, ``block_rows`` rows per thread block."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...].astype(jnp.float32)
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype)

    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(  # type: ignore[no-any-return]
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // block_rows,),
        in_specs=[spec], out_specs=spec, backend=backend or plgpu.NAME)(x)


def matmul(a: jax.Array, b: jax.Array, *, tile_m: int = 128, tile_n: int = 128,
           tile_k: int = 64, max_concurrent_steps: int = 2, delay_release: int = 0,
           backend: str | None = None) -> jax.Array:
    """``a @ b`` in 16-bit floats with float32 accumulation: a grid of (M, N) tiles, the K
    axis a sequential loop whose A and B blocks arrive by TMA ``max_concurrent_steps`` steps
    ahead, multiplied with ``plgpu.wgmma`` into a register accumulator."""
    m, k = a.shape
    _, n = b.shape

    def kernel(a_ref: Any, b_ref: Any, o_ref: Any, acc_ref: Any) -> None:
        @pl.when(pl.program_id(2) == 0)
        def _init() -> None:
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        gpu.wgmma(acc_ref, a_ref, b_ref)
        gpu.wgmma_wait(delay_release)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _store() -> None:
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(  # type: ignore[no-any-return]
        kernel, jax.ShapeDtypeStruct((m, n), a.dtype),
        grid=(m // tile_m, n // tile_n, k // tile_k),
        in_specs=[pl.BlockSpec((tile_m, tile_k), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((tile_k, tile_n), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((tile_m, tile_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[plgpu.ACC((tile_m, tile_n), jnp.float32)],
        compiler_params=plgpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "sequential"),
            max_concurrent_steps=max_concurrent_steps, delay_release=delay_release),
        backend=backend or plgpu.NAME)(a, b)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int = 64,
              block_k: int = 64, backend: str | None = None) -> jax.Array:
    """Flash attention over ``(batch * heads, tokens, head_dim)`` in 16-bit floats: one thread
    block per query block; keys and values stream from GMEM through double-buffered SMEM by
    TMA copies and barriers; an online softmax keeps the running max, sum and output in
    registers across the loop."""
    bh, seq, d = q.shape
    n_kv = seq // block_k
    scale = 1.0 / math.sqrt(d)

    def kernel(q_ref: Any, k_gmem: Any, v_gmem: Any, o_ref: Any, k_smem: Any, v_smem: Any,
               barriers: Any) -> None:
        head = pl.program_id(0)

        def fetch(j: Any, slot: Any) -> None:
            window = pl.ds(j * block_k, block_k)
            gpu.copy_gmem_to_smem(k_gmem.at[head, window, :], k_smem.at[slot],
                                  barriers.at[slot])
            gpu.copy_gmem_to_smem(v_gmem.at[head, window, :], v_smem.at[slot],
                                  barriers.at[2 + slot])

        fetch(0, 0)

        def body(j: Any, carry: Any) -> Any:
            m_i, l_i, acc = carry
            slot = lax.rem(j, 2)

            @pl.when(j + 1 < n_kv)
            def _prefetch() -> None:
                fetch(j + 1, 1 - slot)

            gpu.barrier_wait(barriers.at[slot])
            s = jnp.dot(q_ref[...], k_smem[slot].T, preferred_element_type=jnp.float32) * scale
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            alpha = jnp.exp(m_i - m_new)
            p = jnp.exp(s - m_new[:, None])
            l_new = alpha * l_i + jnp.sum(p, axis=1)
            gpu.barrier_wait(barriers.at[2 + slot])
            pv = jnp.dot(p.astype(v_smem.dtype), v_smem[slot],
                         preferred_element_type=jnp.float32)
            return m_new, l_new, acc * alpha[:, None] + pv

        init = (jnp.full((block_q,), -jnp.inf, jnp.float32),
                jnp.zeros((block_q,), jnp.float32), jnp.zeros((block_q, d), jnp.float32))
        _, l_i, acc = lax.fori_loop(0, n_kv, body, init)
        o_ref[...] = (acc / l_i[:, None]).astype(o_ref.dtype)

    block = pl.BlockSpec((None, block_q, d), lambda b, i: (b, i, 0))
    whole = pl.BlockSpec(memory_space=plgpu.GMEM)
    return pl.pallas_call(  # type: ignore[no-any-return]
        kernel, jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(bh, seq // block_q),
        in_specs=[block, whole, whole], out_specs=block,
        scratch_shapes=[plgpu.SMEM((2, block_k, d), k.dtype),
                        plgpu.SMEM((2, block_k, d), v.dtype),
                        plgpu.Barrier(num_arrivals=1, num_barriers=4)],
        backend=backend or plgpu.NAME)(q, k, v)


def pipelined_add(x: jax.Array, y: jax.Array, *, block: tuple[int, int] = (64, 128),
                  max_concurrent_steps: int = 2, backend: str | None = None) -> jax.Array:
    """``x + y`` by one thread block that streams (64, 128) blocks through SMEM with
    ``plgpu.emit_pipeline`` (``plgpu.kernel`` over GMEM operands)."""
    from pallas_mosaic_gpu.pipeline import emit_pipeline
    grid = (x.shape[0] // block[0], x.shape[1] // block[1])
    spec = pl.BlockSpec(block, lambda i, j: (i, j))

    @functools.partial(plgpu.kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       backend=backend or plgpu.NAME)
    def kernel(x_gmem: Any, y_gmem: Any, o_gmem: Any) -> None:
        def body(_idx: Any, x_smem: Any, y_smem: Any, o_smem: Any) -> None:
            o_smem[...] = x_smem[...] + y_smem[...]

        emit_pipeline(body, grid=grid, in_specs=[spec, spec], out_specs=[spec],
                      max_concurrent_steps=max_concurrent_steps)(x_gmem, y_gmem, o_gmem)

    return kernel(x, y)  # type: ignore[no-any-return]


def matmul_pipeline(a: jax.Array, b: jax.Array, *, tile_m: int = 128, tile_n: int = 128,
                    tile_k: int = 64, max_concurrent_steps: int = 2,
                    backend: str | None = None) -> jax.Array:
    """``a @ b`` in 16-bit floats as JAX's Mosaic GPU examples write it: a ``plgpu.kernel``
    grid of (M, N) tiles, each running ``plgpu.emit_pipeline`` over K with the float32
    accumulator carried in registers (``init_carry``)."""
    from pallas_mosaic_gpu.pipeline import emit_pipeline
    m, k = a.shape
    _, n = b.shape

    @functools.partial(plgpu.kernel, out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
                       grid=(m // tile_m, n // tile_n), grid_names=("m", "n"),
                       scratch_shapes=[plgpu.SMEM((tile_m, tile_n), a.dtype)],
                       backend=backend or plgpu.NAME)
    def kernel(a_gmem: Any, b_gmem: Any, o_gmem: Any, o_smem: Any) -> None:
        mi, ni = lax.axis_index("m"), lax.axis_index("n")

        def body(_idx: Any, a_smem: Any, b_smem: Any, acc: Any) -> Any:
            return acc + jnp.dot(a_smem[...], b_smem[...], preferred_element_type=jnp.float32)

        acc = emit_pipeline(
            body, grid=(k // tile_k,),
            in_specs=[pl.BlockSpec((tile_m, tile_k), lambda kk: (mi, kk)),
                      pl.BlockSpec((tile_k, tile_n), lambda kk: (kk, ni))],
            max_concurrent_steps=max_concurrent_steps,
            init_carry=jnp.zeros((tile_m, tile_n), jnp.float32))(a_gmem, b_gmem)
        o_smem[...] = acc.astype(o_smem.dtype)
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(mi * tile_m, tile_m),
                                                 pl.ds(ni * tile_n, tile_n)])
        gpu.wait_smem_to_gmem(0)

    return kernel(a, b)  # type: ignore[no-any-return]


def block_reduce(x: jax.Array, *, op: str = "add", block_rows: int = 64,
                 backend: str | None = None) -> jax.Array:
    """The elementwise ``op`` ("add", "max", "min", and for integers "and", "or", "xor") of
    the ``block_rows``-row blocks of ``x``: one thread block per block, each folding its
    TMA-staged block into the GMEM result with ``plgpu.atomic_<op>``. The result starts as
    the op's identity in an input aliased to the output (``input_output_aliases``)."""
    from pallas_mosaic_gpu import pipeline
    rows, cols = x.shape
    dt = jnp.dtype(x.dtype)
    init: Any
    if op == "add":
        init = 0
    elif op in ("max", "min"):
        info = jnp.finfo(dt) if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo(dt)
        init = info.min if op == "max" else info.max
    else:
        init = {"and": -1, "or": 0, "xor": 0}[op]
    atomic = getattr(pipeline, f"atomic_{op}")

    def kernel(x_ref: Any, acc_in: Any, acc_ref: Any) -> None:
        del acc_in  # the same buffer as acc_ref
        atomic(acc_ref, x_ref[...])

    gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
    return pl.pallas_call(  # type: ignore[no-any-return]
        kernel, jax.ShapeDtypeStruct((block_rows, cols), x.dtype),
        grid=(rows // block_rows,),
        in_specs=[pl.BlockSpec((block_rows, cols), lambda i: (i, 0)), gmem],
        out_specs=gmem, input_output_aliases={1: 0},
        backend=backend or plgpu.NAME)(x, jnp.full((block_rows, cols), init, x.dtype))
