"""What a kernel must satisfy before it is lowered for a TPU TensorCore, with the fix."""

from __future__ import annotations

import numpy as np

from pallas_core import reference
from pallas_core.errors import BlockSpecError, PallasError, UnsupportedError
from pallas_core.request import KernelCall
from pallas_core.spec import BARRIER_SEMAPHORE

SUBLANES, LANES = 8, 128


def check(call: KernelCall) -> None:
    """Raises a ``PallasError`` for blocks the TPU cannot tile and unsupported features."""
    gm = call.grid_mapping
    where = f"kernel {call.name!r} ({call.source})"
    for bm in gm.block_mappings[gm.num_scalar_prefetch:]:
        if bm.is_whole_array:
            continue
        block, shape = bm.full_block_shape, bm.array_shape
        if len(block) >= 2:
            rows, cols = block[-2], block[-1]
            ok_rows = rows % SUBLANES == 0 or rows == shape[-2]
            ok_cols = cols % LANES == 0 or cols == shape[-1]
            if not (ok_rows and ok_cols):
                fixed = (*block[:-2], rows if ok_rows else -(-rows // SUBLANES) * SUBLANES,
                         cols if ok_cols else -(-cols // LANES) * LANES)
                raise BlockSpecError(
                    f"{where}: {bm.origin} has block shape {block} for an array of shape "
                    f"{shape}; on a TPU the last two block dimensions must be divisible by "
                    f"({SUBLANES}, {LANES}) or equal the array's. Fix: use block shape {fixed}, "
                    "or the array's full size in those dimensions.")
        elif len(block) == 1 and block[0] != shape[0] and block[0] % (LANES * SUBLANES):
            raise BlockSpecError(
                f"{where}: {bm.origin} has 1-D block {block} for an array of shape {shape}; a "
                f"1-D block on a TPU must equal the array or be a multiple of "
                f"{LANES * SUBLANES}. Fix: use block ({LANES * SUBLANES},) or reshape to 2-D.")
        if np.dtype(bm.dtype).itemsize == 8:
            raise UnsupportedError(f"{where}: {bm.origin} has 64-bit dtype {bm.dtype}, which "
                                   "TPUs do not support. Fix: use 32-bit types.")
    params = call.compiler_params
    if any(a.memory_space is BARRIER_SEMAPHORE for a in gm.scratch_avals) and getattr(
            params, "collective_id", None) is None:
        raise PallasError(
            f"{where} uses the barrier semaphore (pltpu.get_barrier_semaphore()) but gives no "
            "collective_id. Fix: pass compiler_params=pltpu.CompilerParams(collective_id=0) "
            "(a different id for kernels that synchronise different groups of devices).")
    plugin_prims = reference.registered_primitives()
    eqn = reference.find_eqn(call.jaxpr.jaxpr, plugin_prims - _lowered())
    if eqn is not None:
        raise UnsupportedError(
            f"the primitive {eqn.primitive.name!r} ({where}) is not supported by the "
            "'mosaic_tpu' backend yet. Fix: rewrite that part of the kernel, or pass "
            "backend='interpret'.")


def _lowered() -> frozenset[object]:
    from pallas_mosaic_tpu.lowering import RULES

    return frozenset(RULES)
