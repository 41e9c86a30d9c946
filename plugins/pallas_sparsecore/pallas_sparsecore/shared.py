"""Names of ``jax.experimental.pallas.tpu_sc`` about shared memory and DMA streams:
``plsc.slice_subcore_vmem_from_shared`` (a subcore's part of a ``VMEM_SHARED`` buffer),
``plsc.SparseCorePushStreamWarning`` (a semaphore given to a push stream, which ignores it) and
``plsc.Indices`` (index values for a gather or scatter, with a value to skip).
"""

from __future__ import annotations

from typing import Any

from jax import lax

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core import primitives as prims
from pallas_core.errors import PallasError
from pallas_sparsecore.params import VMEM_SHARED, get_sparse_core_info


class SparseCorePushStreamWarning(UserWarning):
    """A copy that is a SparseCore push stream (from a vector subcore's VMEM to HBM, shared
    VMEM or SMEM, or from shared VMEM to SMEM) was given a destination semaphore, which push
    streams ignore: ``wait()`` already waits for the stream. Pass ``sem=None``."""


Indices = plb.Indices
"""Index values for a gather or scatter copy on SparseCore (``values``: an array or a Ref),
skipping those equal to ``ignored_value`` when it is not ``None``:
``pltpu.sync_copy(table.at[plsc.Indices(idx_vmem, ignored_value=-1)], rows_vmem)``."""


def slice_subcore_vmem_from_shared(ref: Any) -> Any:
    """This vector subcore's part of ``ref``, a ``plsc.VMEM_SHARED`` Ref: its last dimension
    split into as many equal parts as the SparseCore has subcores (all of them, including
    those the mesh leaves out), part ``lax.axis_index`` of the subcore axis.

    The interpreter reads and writes the part in place; lowering copies to and from it with
    DMAs (loads and stores of shared VMEM raise an ``UnsupportedError``, as for any
    ``VMEM_SHARED`` Ref here)."""
    fn = "slice_subcore_vmem_from_shared"
    r, transforms = plb.ref_and_transforms(ref, None, fn)
    if plb.ref_type_of(r).memory_space is not VMEM_SHARED:
        raise PallasError(f"plsc.{fn}: expected a plsc.VMEM_SHARED Ref, found one in "
                          f"{plb.ref_type_of(r).memory_space}. Fix: pass the shared buffer.")
    shape = plb.shape_after_transforms(plb.ref_type_of(r), transforms).shape
    if not shape:
        raise PallasError(f"plsc.{fn}: the Ref is 0-D; the last dimension is split between "
                          "subcores. Fix: give the shared buffer at least one dimension.")
    ctx = prims.current_kernel_context()
    names = ctx.grid_names if ctx is not None else None
    if not names or len(names) < 2:
        raise PallasError(f"plsc.{fn} is called outside a vector-subcore kernel (a "
                          "pl.kernel over plsc.VectorSubcoreMesh), which names the subcore.")
    subcores = get_sparse_core_info().num_subcores
    if shape[-1] % subcores:
        raise PallasError(
            f"plsc.{fn}: the last dimension ({shape[-1]}) must be divisible by the "
            f"SparseCore's {subcores} subcores. Fix: pad it to a multiple of {subcores}.")
    part = shape[-1] // subcores
    return ref.at[(..., pl.ds(lax.axis_index(names[-1]) * part, part))]
