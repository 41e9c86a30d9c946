"""Checks of a kernel against Hopper's limits before lowering, with the fix in each message."""

from __future__ import annotations

import jax
import numpy as np

from pallas_core import BlockSpecError
from pallas_core.backend import KernelCall, UnsupportedError, refuse_empty_operands
from pallas_mosaic_gpu import tma
from pallas_mosaic_gpu.params import GMEM, GPUCompilerParams
from pallas_mosaic_gpu.values import SMEM_ALIGNMENT, is_tileable

SMEM_BYTES = 227 * 1024
"""Shared memory one thread block may use on Hopper (sm_90) and Blackwell (sm_100): CUDA's
opt-in maximum per block for compute capabilities 9.0 and 10.x, 232448 bytes, which the Mosaic
GPU library also assumes where no GPU is attached."""


def smem_limit() -> int:
    """The shared memory a thread block of this kernel may use, as the Mosaic GPU library
    checks it when it builds the launch: the opt-in maximum of the GPU JAX compiles for
    (``shared_memory_per_block_optin``), else :data:`SMEM_BYTES`."""
    device = jax.local_devices()[0]
    return int(getattr(device, "shared_memory_per_block_optin", SMEM_BYTES))


def smem_parts(call: KernelCall, reuse: dict[int, tuple[int, int]] | None = None
               ) -> list[tuple[str, int]]:
    """The shared memory ``call`` needs, part by part, exactly as the lowering allocates it
    (:func:`pallas_mosaic_gpu.call_lowering.shared_memory`, laid out by ``aligned_smem``): each
    windowed input's buffers (one per slot: ``max_concurrent_steps``, at most the steps of the
    sequential loop) and their barriers, each output's buffer (none for an output staged in an
    input's buffer, :mod:`pallas_mosaic_gpu.smem_reuse`), scratch, ``pl.run_scoped``
    allocations, the TMEM allocation's address, and the padding that aligns each buffer to
    ``values.SMEM_ALIGNMENT`` bytes and the barriers to 8. Their sum is the dynamic shared
    memory of the kernel's launch. ``reuse``: the outputs to stage (default: as lowered)."""
    from pallas_mosaic_gpu.call_lowering import aligned_smem, entry_bytes, shared_memory

    sm = shared_memory(call, reuse)
    tree, positions = aligned_smem(sm.entries)
    parts = [(name, entry_bytes(tree[p])) for name, p in zip(sm.names, positions, strict=True)]
    bms = call.grid_mapping.block_mappings
    n_in = len(bms) - len(call.out_avals)
    parts += [(f"{bms[n_in + j].origin} (staged in the buffer of {bms[k].origin})", 0)
              for j, (k, _) in sorted(sm.reuse.items())]
    placed = set(positions)
    padding = sum(entry_bytes(e) for i, e in enumerate(tree) if i not in placed)
    if padding:
        parts.append(("alignment padding", padding))
    return parts


def check(call: KernelCall) -> None:
    gm = call.grid_mapping
    params = call.compiler_params if isinstance(call.compiler_params, GPUCompilerParams) else \
        GPUCompilerParams()
    if gm.num_scalar_prefetch:
        raise UnsupportedError(
            f"kernel {call.name!r}: scalar prefetch is a Mosaic TPU feature; the mosaic_gpu "
            "backend does not support it. Fix: pass the scalars as an input in GMEM.")
    refuse_empty_operands(f"kernel {call.name!r}", gm, "mosaic_gpu")
    for bm in gm.block_mappings:
        dt = np.dtype(bm.dtype)
        if dt.itemsize == 8 or dt.kind == "c":
            raise UnsupportedError(
                f"kernel {call.name!r}, {bm.origin}: {dt} is not supported by the mosaic_gpu "
                "backend. Fix: use 32-bit or narrower types.")
        if dt.kind == "b":
            raise UnsupportedError(
                f"kernel {call.name!r}, {bm.origin}: bool operands are not supported by the "
                "mosaic_gpu backend (its layouts hold no 1-bit integers). Fix: pass the "
                "array as int8 (x.astype(jnp.int8)) and compare it with 0 in the kernel.")
        if bm.memory_space is GMEM:
            continue
        if not bm.ref_shape:
            raise BlockSpecError(
                f"kernel {call.name!r}, {bm.origin}: a 0-d block (a scalar) in shared memory; "
                "the mosaic_gpu backend copies blocks with TMA, which moves at least 16 bytes "
                "along a last dimension. Fix: give the array a dimension of 16 bytes (e.g. "
                "shape (4,) for float32, and read element 0), or keep it in global memory "
                "(pl.BlockSpec(memory_space=plgpu.GMEM)).")
        if bm.is_whole_array:
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
    parts = smem_parts(call)
    used, limit = sum(b for _, b in parts), smem_limit()
    if used > limit:
        largest = ", ".join(f"{name}: {b}" for name, b in sorted(parts, key=lambda p: -p[1])[:3])
        raise BlockSpecError(
            f"kernel {call.name!r} needs {used} bytes of shared memory (input blocks times "
            f"max_concurrent_steps={params.max_concurrent_steps} with their barriers, output "
            f"blocks, scratch and pl.run_scoped buffers, each aligned to {SMEM_ALIGNMENT} bytes, "
            f"less outputs staged in an input's buffer as docs/backends/mosaic_gpu.md "
            f"describes; largest: {largest}) but a thread block may use {limit}. Fix: use "
            "smaller blocks or fewer concurrent steps.")
