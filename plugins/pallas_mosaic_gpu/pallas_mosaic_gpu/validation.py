"""Checks of a kernel against Hopper's limits before lowering, with the fix in each message."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pallas_core.errors import BlockSpecError, UnsupportedError
from pallas_core.request import KernelCall
from pallas_mosaic_gpu import tma
from pallas_mosaic_gpu.params import (
    ACC_SPACE,
    GMEM,
    BarrierSpace,
    GPUCompilerParams,
    TensorMemorySpace,
)
from pallas_mosaic_gpu.values import SMEM_ALIGNMENT, bits, is_tileable

SMEM_BYTES = 227 * 1024
"""Shared memory one thread block may use on Hopper (sm_90)."""


def buffer_bytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes a shared-memory buffer of ``shape`` and ``dtype`` takes, rounded up to the
    alignment every buffer starts at (``values.SMEM_ALIGNMENT``)."""
    nbytes = math.prod(shape) * bits(dtype) // 8
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def check(call: KernelCall) -> None:
    gm = call.grid_mapping
    params = call.compiler_params if isinstance(call.compiler_params, GPUCompilerParams) else \
        GPUCompilerParams()
    if gm.num_scalar_prefetch:
        raise UnsupportedError(
            f"kernel {call.name!r}: scalar prefetch is a Mosaic TPU feature; the mosaic_gpu "
            "backend does not support it. Fix: pass the scalars as an input in GMEM.")
    for bm in gm.block_mappings:
        dt = np.dtype(bm.dtype)
        if dt.itemsize == 8 or dt.kind == "c":
            raise UnsupportedError(
                f"kernel {call.name!r}, {bm.origin}: {dt} is not supported by the mosaic_gpu "
                "backend. Fix: use 32-bit or narrower types.")
        if bm.is_whole_array or bm.memory_space is GMEM:
            continue
        shape = bm.ref_shape
        if shape and shape[-1] * dt.itemsize % 16:
            raise BlockSpecError(
                f"kernel {call.name!r}, {bm.origin}: block shape {bm.block_shape} has a minor "
                f"dimension of {shape[-1] * dt.itemsize} bytes; TMA copies move multiples of 16 "
                f"bytes. Fix: make the last block dimension a multiple of {16 // dt.itemsize}.")
        problem = None if is_tileable(shape, dt) else \
            tma.split_problem(shape, bm.array_shape[-1], dt.itemsize)
        if problem:
            raise BlockSpecError(
                f"kernel {call.name!r}, {bm.origin}: block shape {bm.block_shape}: {problem}.")
    for a in gm.scratch_avals:
        if a.memory_space is GMEM:
            raise UnsupportedError(
                f"kernel {call.name!r}: a GMEM scratch buffer; the mosaic_gpu backend allocates "
                "scratch in shared memory only. Fix: use plgpu.SMEM(...) scratch, or pass the "
                "global buffer as an operand.")
    from pallas_mosaic_gpu import smem_reuse
    used = smem_bytes(call) - smem_reuse.saved_bytes(call)
    if used > SMEM_BYTES:
        raise BlockSpecError(
            f"kernel {call.name!r} needs {used} bytes of shared memory (blocks times "
            f"max_concurrent_steps={params.max_concurrent_steps}, plus scratch and "
            f"pl.run_scoped buffers, less outputs staged in an input's buffer as "
            f"docs/backends/mosaic_gpu.md describes); a Hopper thread block has {SMEM_BYTES}. "
            "Fix: use smaller blocks or fewer concurrent steps.")


def smem_bytes(call: KernelCall) -> int:
    """The shared memory ``call`` needs with a buffer of its own for every block: blocks
    (inputs times ``max_concurrent_steps``), scratch and ``pl.run_scoped`` allocations, each
    buffer rounded up to its 1024-byte alignment (``values.SMEM_ALIGNMENT``)."""
    gm = call.grid_mapping
    params = call.compiler_params if isinstance(call.compiler_params, GPUCompilerParams) else \
        GPUCompilerParams()
    used = 0
    n_out = len(call.out_avals)
    bms = list(gm.block_mappings)
    for k, bm in enumerate(bms):
        if bm.is_whole_array or bm.memory_space is GMEM:
            continue
        buffers = params.max_concurrent_steps if k < len(bms) - n_out else 1
        used += buffers * buffer_bytes(bm.ref_shape, bm.dtype)
    tmem = False
    for a in gm.scratch_avals:
        if a.memory_space is GMEM or a.memory_space is ACC_SPACE:
            continue
        if isinstance(a.memory_space, TensorMemorySpace):
            tmem = True
            continue
        used += (8 * math.prod(a.inner_aval.shape) if isinstance(a.memory_space, BarrierSpace)
                 else buffer_bytes(a.inner_aval.shape, a.inner_aval.dtype))
    from pallas_mosaic_gpu.schedule import scoped_allocations
    for _, allocs in scoped_allocations(call):
        for kind, shape, dtype, _arrivals in allocs:
            if kind in ("smem", "smem_plain"):
                used += buffer_bytes(shape, dtype)
            elif kind == "barrier":
                used += 8 * math.prod(shape)
            tmem = tmem or kind == "tmem"
    # TMEM is not shared memory, but the address of its one allocation is kept there.
    return used + 4 * tmem
