"""Names of ``jax.experimental.pallas.tpu_sc`` about shared memory and DMA streams:
``plsc.slice_subcore_vmem_from_shared`` (a subcore's part of a ``VMEM_SHARED`` buffer),
``plsc.SparseCorePushStreamWarning`` (a semaphore given to a push stream, which ignores it),
``plsc.Indices`` (index values for a gather or scatter, with a value to skip) and
``plsc.fetch_and_add`` (an atomic add to a subcore's SMEM scalar).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from pallas_mosaic_tpu.params import SMEM

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.backend import (
    PallasError,
    PrimitiveSemantics,
    RefViews,
    UnsupportedError,
    bind_views,
    reported,
)
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
    ctx = plb.current_kernel_context()
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


def _fetch_and_add_abstract(*avals: Any, roles: Any, tree: Any, axis_name: Any) -> Any:
    return plb.ShapedArray((), jnp.int32), {plb.ReadEffect(0), plb.WriteEffect(0)}


fetch_and_add_p = plb.Primitive("sc_fetch_and_add")
fetch_and_add_p.def_effectful_abstract_eval(_fetch_and_add_abstract)


def fetch_and_add(x_ref: Any, value: Any, *, subcore_id: Any) -> jax.Array:
    """Adds ``value`` (an int32 scalar) to the one-element int32 SMEM Ref ``x_ref`` of vector
    subcore ``subcore_id``, atomically, and returns its value before the add. Synchronise the
    subcores between initialising the SMEM and adding to it (``plsc.subcore_barrier()``).

    The interpreter runs adds to the calling subcore's own ``x_ref``; an add to another
    subcore's raises a ``PallasError`` when the kernel runs there (each subcore's SMEM is its
    own in the interpreter). Lowering emits ``tpu.fetch_and_add_sync`` as JAX does."""
    fn = "fetch_and_add"
    r, transforms = plb.ref_and_transforms(x_ref, None, fn)
    aval = plb.ref_type_of(r)
    view = plb.shape_after_transforms(aval, transforms)
    if aval.memory_space is not SMEM or view.dtype != jnp.int32 or view.size != 1:
        raise PallasError(f"plsc.{fn}: expected a one-element int32 Ref in pltpu.SMEM, found "
                          f"{view.dtype}{list(view.shape)} in {aval.memory_space}. Fix: "
                          "allocate pltpu.SMEM((1,), jnp.int32) (or index one element).")
    value = jnp.asarray(value)
    if value.shape or value.dtype != jnp.int32:
        raise PallasError(f"plsc.{fn}: the value must be an int32 scalar, found "
                          f"{value.dtype}{list(value.shape)}.")
    subcore = jnp.asarray(subcore_id)
    if subcore.shape or subcore.dtype != jnp.int32:
        raise PallasError(f"plsc.{fn}(subcore_id=...) must be an int32 scalar, found "
                          f"{subcore.dtype}{list(subcore.shape)}.")
    ctx = plb.current_kernel_context()
    names = ctx.grid_names if ctx is not None else None
    if not names or len(names) < 2:
        raise PallasError(f"plsc.{fn} is called outside a vector-subcore kernel (a pl.kernel "
                          "over plsc.VectorSubcoreMesh), which names the subcores.")
    return bind_views(fetch_and_add_p, [x_ref], [value, subcore], fn,  # type: ignore[no-any-return]
                      axis_name=names[-1])


@reported
def _refuse_other_subcore(here: Any, there: Any) -> None:
    if int(here) != int(there):
        raise UnsupportedError(
            f"plsc.fetch_and_add from subcore {int(here)} to subcore {int(there)}: the "
            "interpreter gives each subcore its own SMEM and adds only to the caller's. Fix: "
            "lower the kernel for a TPU, or accumulate across subcores with a scatter-add DMA "
            "into plsc.VMEM_SHARED followed by plsc.subcore_barrier().")


def _fetch_and_add_discharge(in_avals: Any, out_avals: Any, *args: Any, tree: Any,
                             roles: tuple[int, ...], axis_name: Any) -> Any:
    state = RefViews(args, tree, roles)
    value, subcore = state.rest
    jax.debug.callback(functools.partial(_refuse_other_subcore),
                       lax.axis_index(axis_name), subcore)
    old = state.read(0)
    state.write(0, old + value)
    return state.new_values(), old.reshape(())


SEMANTICS = (PrimitiveSemantics(fetch_and_add_p, discharge=_fetch_and_add_discharge),)
