"""What a kernel must satisfy before it is lowered for a TPU TensorCore, with the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pallas_core import BlockSpecError
from pallas_core import backend as plb
from pallas_core.backend import (
    BARRIER_SEMAPHORE,
    KernelCall,
    PallasError,
    UnsupportedError,
    run_scoped_p,
)
from pallas_mosaic_tpu.params import DMA_SEMAPHORE, HBM, SEMAPHORE, SMEM, VMEM

SUBLANES, LANES = 8, 128


def check(call: KernelCall) -> None:
    """Raises a ``PallasError`` for blocks the TPU cannot tile and unsupported features."""
    gm = call.grid_mapping
    where = f"kernel {call.name!r} ({call.source})"
    plb.refuse_empty_operands(where, gm, "mosaic_tpu")
    for bm in gm.block_mappings[gm.num_scalar_prefetch:]:
        _check_rank(bm, where)
        if bm.is_whole_array:
            continue
        block, shape = bm.full_block_shape, bm.array_shape
        if bm.memory_space is HBM:
            if tuple(block) != tuple(shape):
                raise BlockSpecError(
                    f"{where}: {bm.origin} is in HBM with block shape {block}, but HBM operands "
                    f"are passed whole (shape {shape}); the kernel copies what it needs. Fix: "
                    "drop the block shape (BlockSpec(memory_space=pltpu.HBM)).")
            continue
        if len(block) >= 2:
            fixed = tiled_block(block, shape)
            if fixed is not None:
                raise BlockSpecError(
                    f"{where}: {bm.origin} has block shape {block} for an array of shape "
                    f"{shape}; on a TPU the last two block dimensions must be divisible by "
                    f"({SUBLANES}, {LANES}) or equal the array's. Fix: use block shape {fixed}, "
                    "or the array's full size in those dimensions.")
        elif len(block) == 1 and not _one_d_block_fits(block[0], shape[0], bm.dtype):
            smallest = LANES * _packing(bm.dtype)
            raise BlockSpecError(
                f"{where}: {bm.origin} has 1-D block {block} for an array of shape {shape}; a "
                f"1-D block on a TPU must equal the array, be a multiple of "
                f"{LANES * SUBLANES}, or be a power of two of at least {smallest} (128 lanes "
                f"of {np.dtype(bm.dtype).name} packed into 32 bits). Fix: use block "
                f"({max(smallest, LANES * SUBLANES)},) or reshape to 2-D.")
    for bm in gm.block_mappings:
        _check_dtype(bm.dtype, f"{where}: {bm.origin}")
    for k, a in enumerate(gm.scratch_avals):
        _check_dtype(a.inner_aval.dtype, f"{where}: scratch {k}")
    params = call.compiler_params
    _check_vmem(call, where)
    if any(a.memory_space is BARRIER_SEMAPHORE for a in gm.scratch_avals) and getattr(
            params, "collective_id", None) is None:
        raise PallasError(
            f"{where} uses the barrier semaphore (pltpu.get_barrier_semaphore()) but gives no "
            "collective_id. Fix: pass compiler_params=pltpu.CompilerParams(collective_id=0) "
            "(a different id for kernels that synchronise different groups of devices).")
    plugin_prims = plb.registered_primitives()
    eqn = plb.find_eqn(call.jaxpr.jaxpr, plugin_prims - _lowered())
    if eqn is not None:
        raise UnsupportedError(
            f"the primitive {eqn.primitive.name!r} ({where}) is not supported by the "
            "'mosaic_tpu' backend yet. Fix: rewrite that part of the kernel, or pass "
            "backend='interpret'.")


def _check_rank(bm: Any, where: str) -> None:
    """A 0-d block (a scalar) lives only in SMEM or a semaphore space: vector memory holds
    vectors, and Mosaic's verifier refuses a ``vector.load`` of a scalar."""
    if len(bm.full_block_shape) or bm.memory_space in (SMEM, SEMAPHORE, DMA_SEMAPHORE):
        return
    space = "VMEM" if bm.memory_space in (None, VMEM) else str(bm.memory_space)
    raise BlockSpecError(
        f"{where}: {bm.origin} is a 0-d block (a scalar) in {space}; Mosaic TPU keeps 0-d "
        "operands only in SMEM (JAX's TPU lowering refuses them too: it supports only blocks "
        "of rank >= 1 outside SMEM). Fix: put the operand in SMEM "
        "(pl.BlockSpec(memory_space=pltpu.SMEM)), or give the array a dimension (shape (1,) "
        "in SMEM, or a lane-sized 1-D block in VMEM).")


def _lowered() -> frozenset[object]:
    from pallas_mosaic_tpu.lowering import lowering_rules

    return frozenset(lowering_rules())


def tiled_block(block: Sequence[int], shape: Sequence[int]) -> tuple[int, ...] | None:
    """``None`` if the last two dimensions of ``block`` tile a TPU's vector registers (each
    divisible by (8, 128) or equal to the array's); else the nearest block shape that does."""
    rows, cols = block[-2], block[-1]
    ok_rows = rows % SUBLANES == 0 or rows == shape[-2]
    ok_cols = cols % LANES == 0 or cols == shape[-1]
    if ok_rows and ok_cols:
        return None
    return (*block[:-2], rows if ok_rows else -(-rows // SUBLANES) * SUBLANES,
            cols if ok_cols else -(-cols // LANES) * LANES)


def _check_dtype(dtype: Any, what: str) -> None:
    dt = np.dtype(dtype)
    if dt.kind == "c" or dt.itemsize == 8:
        raise UnsupportedError(
            f"{what} has dtype {dt}, which TPU kernels do not support (no 64-bit or complex "
            "types in Mosaic). Fix: use 32-bit types (float32/int32), or split complex values "
            "into real and imaginary float32 arrays.")


DEFAULT_VMEM_LIMIT = 16 * 2**20
"""The scoped VMEM a kernel gets unless ``CompilerParams(vmem_limit_bytes=...)`` says more
(the smallest default among TPU generations)."""
MAX_VMEM = 128 * 2**20
"""The largest VMEM of any TPU generation (v5e, v6e)."""


def vmem_bytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of a VMEM buffer, its last two dimensions padded to the (8, 128) tiles (with the
    sublane count scaled for packed types: 16 rows for bfloat16, 32 for int8)."""
    dt = np.dtype(dtype)
    itemsize = max(dt.itemsize, 1)
    dims = list(shape)
    if len(dims) >= 2:
        rows = SUBLANES * max(1, 4 // itemsize)
        dims[-2] = -(-dims[-2] // rows) * rows
    if dims:
        dims[-1] = -(-dims[-1] // LANES) * LANES
    return int(np.prod(dims, dtype=np.int64)) * itemsize


def _scoped_peak(jaxpr: Any) -> int:
    """The most VMEM that ``pl.run_scoped`` regions of ``jaxpr`` hold at once."""
    peak = 0
    for eqn in jaxpr.eqns:
        here = 0
        if eqn.primitive is run_scoped_p:
            here = sum(vmem_bytes(t.shape, t.dtype) for t in eqn.params["scoped"]
                       if t.memory_space is VMEM)
        inner = max((_scoped_peak(sub) for sub in plb.sub_jaxprs(eqn.params)), default=0)
        peak = max(peak, here + inner)
    return peak


def vmem_parts(call: KernelCall) -> list[tuple[str, int]]:
    """The VMEM the kernel needs, part by part: double-buffered blocks, scratch, and the peak
    of its ``pl.run_scoped`` buffers (blocks of symbolic shape are not counted)."""
    gm = call.grid_mapping
    parts: list[tuple[str, int]] = []
    for k, bm in enumerate(gm.block_mappings):
        if k < gm.num_scalar_prefetch or bm.is_whole_array or bm.memory_space in (SMEM, HBM):
            continue
        if not plb.is_static_shape(bm.ref_shape):
            # A symbolic block (dynamic-shape export): its size is known when it runs.
            continue
        parts.append((f"{bm.origin} (2 x block {bm.ref_shape})",
                      2 * vmem_bytes(bm.ref_shape, bm.dtype)))
    for k, a in enumerate(gm.scratch_avals):
        if a.memory_space is VMEM:
            parts.append((f"scratch {k} {tuple(a.inner_aval.shape)}",
                          vmem_bytes(a.inner_aval.shape, a.inner_aval.dtype)))
    scoped = _scoped_peak(call.jaxpr.jaxpr)
    if scoped:
        parts.append(("pl.run_scoped buffers", scoped))
    return parts


def vmem_limit(call: KernelCall) -> int:
    """The VMEM the kernel may use: ``vmem_limit_bytes``, else the default."""
    return getattr(call.compiler_params, "vmem_limit_bytes", None) or DEFAULT_VMEM_LIMIT


def _check_vmem(call: KernelCall, where: str) -> None:
    """The VMEM the kernel needs (double-buffered blocks, scratch, scoped buffers) must fit."""
    parts = vmem_parts(call)
    total = sum(b for _, b in parts)
    params = call.compiler_params
    limit = getattr(params, "vmem_limit_bytes", None)
    if limit is not None and limit > MAX_VMEM:
        raise PallasError(
            f"{where}: vmem_limit_bytes={limit} is more than any TPU's VMEM ({MAX_VMEM} bytes). "
            f"Fix: use at most {MAX_VMEM}.")
    if total <= (limit or DEFAULT_VMEM_LIMIT):
        return
    largest = ", ".join(f"{name}: {b / 2**20:.2f} MiB"
                        for name, b in sorted(parts, key=lambda p: -p[1])[:3])
    if limit is None and total <= MAX_VMEM:
        fix = (f"pass compiler_params=pltpu.CompilerParams(vmem_limit_bytes={_round_up(total)}) "
               "if the chip has that much VMEM, or use smaller blocks")
    else:
        fix = "use smaller blocks (fewer rows per block), or keep large arrays in pl.ANY"
    raise PallasError(
        f"{where} needs {total / 2**20:.2f} MiB of VMEM (inputs and outputs are double-"
        f"buffered; largest: {largest}) but may use {(limit or DEFAULT_VMEM_LIMIT) / 2**20:.2f} "
        f"MiB. Fix: {fix}.")


def _round_up(n: int) -> int:
    return -(-n // 2**20) * 2**20


def _packing(dtype: Any) -> int:
    """How many elements of ``dtype`` share a 32-bit word (booleans are stored as int32)."""
    bits = 32 if np.dtype(dtype) == np.bool_ else np.dtype(dtype).itemsize * 8
    return max(1, 32 // bits)


def _one_d_block_fits(block: int, size: int, dtype: Any) -> bool:
    """JAX's rule for 1-D blocks on a TPU: the whole array, a multiple of a (8, 128) chunk, or
    a power of two of at least 128 lanes' worth of packed elements."""
    return (block == size or block % (LANES * SUBLANES) == 0
            or (block >= LANES * _packing(dtype) and block & (block - 1) == 0))
