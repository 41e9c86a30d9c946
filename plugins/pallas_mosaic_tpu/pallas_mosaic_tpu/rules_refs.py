"""Mosaic TPU's rules for Refs: views (``ref.at[...]``, bitcasts and reshapes, as memrefs),
loads and stores of VMEM and SMEM (strided, masked), and scoped allocation (``pl.run_scoped``,
``jax.empty_ref``) in the memory spaces whose memref types :func:`scratch_memref_type` gives.
HBM (``ANY``) is reached only by DMA (:mod:`pallas_mosaic_tpu.rules_devices`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector
from jaxlib.mosaic.python import tpu

from pallas_core import HOST
from pallas_core import backend as plb
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.params import (
    CMEM,
    DMA_SEMAPHORE,
    HBM,
    SEMAPHORE,
    SMEM,
    VMEM_SHARED,
    AccMemorySpace,
)
from pallas_mosaic_tpu.registry import AccRef, Lowering, in_aval, lower_jaxpr, out_aval, rule


def scratch_memref_type(shape: Sequence[int], dtype: Any, space: Any) -> ir.Type:
    """The memref of a scratch buffer (or semaphores) in its memory space."""
    if space is SEMAPHORE or space is DMA_SEMAPHORE:
        kind = "dma_semaphore" if space is DMA_SEMAPHORE else "semaphore"
        return ir.MemRefType.get(list(shape), ir.Type.parse(f"!tpu.{kind}"),
                                 memory_space=mir.memory_space("semaphore_mem"))
    names = {SMEM: "smem", HBM: "hbm", CMEM: "cmem", VMEM_SHARED: "vmem_shared", HOST: "host"}
    return mir.memref(shape, dtype, names.get(space, "vmem"))


def _strides(transforms: Sequence[Any]) -> list[int] | None:
    """The strides of the one indexer in ``transforms``, if any slice of it has one."""
    if not transforms or not isinstance(transforms[0], plb.NDIndexer):
        return None
    strides = [idx.stride if isinstance(idx, plb.Slice) else 1
               for idx in transforms[0].indices]
    return strides if any(s != 1 for s in strides) else None


def view_indices(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any],
                 strided: bool = False) -> tuple[list[ir.Value], list[int], list[int]]:
    """Start indices, sizes, and which dimensions an integer index drops (of the one indexer
    in ``transforms``: see :func:`accessed_view`); ``strided``: slices may have strides (the
    caller takes them from :func:`_strides`)."""
    shape = list(ir.MemRefType(ref.type).shape)
    if not transforms:
        return [mir.index(0) for _ in shape], shape, []
    if not isinstance(transforms[0], plb.NDIndexer):
        raise lowering.fail("Ref transforms other than indexing")
    starts, sizes, dropped = [], [], []
    for d, idx in enumerate(transforms[0].indices):
        if isinstance(idx, plb.Slice):
            if (idx.stride != 1 and not strided) or not isinstance(idx.size, int):
                raise lowering.fail("strided or dynamically sized slices of a Ref")
            starts.append(mir.index(idx.start))
            sizes.append(idx.size)
        else:
            if isinstance(idx, ir.Value) and mir.shape_of(idx):
                raise lowering.fail("indexing a Ref with an array (gather)")
            starts.append(mir.index(idx))
            sizes.append(1)
            dropped.append(d)
    return starts, sizes, dropped


def accessed_view(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any]
                  ) -> tuple[ir.Value, Sequence[Any]]:
    """``ref.at[a].at[b][c]``: the view ``ref.at[a].at[b]`` and the last indexer ``[c]``."""
    if isinstance(ref, AccRef):
        raise lowering.fail("reading or writing a pltpu.ACC Ref with ref[...] (an accumulator "
                            "is read with pltpu.matmul_pop and written with "
                            "pltpu.matmul_acc_lhs, as in JAX)")
    if transforms and not isinstance(transforms[-1], plb.NDIndexer):
        return ref_view(lowering, ref, transforms), ()  # a reshaped or bitcast view, read whole
    if len(transforms) > 1:
        return ref_view(lowering, ref, transforms[:-1]), transforms[-1:]
    return ref, transforms


def _is_smem(ref: ir.Value) -> bool:
    return "smem" in str(ir.MemRefType(ref.type).memory_space)


def _check_direct(lowering: Lowering, ref: ir.Value, what: str) -> None:
    """Kernels load and store VMEM and SMEM only; HBM (``pl.ANY``) is reached by DMA."""
    space = str(ir.MemRefType(ref.type).memory_space)
    if "any" in space or "hbm" in space:
        raise lowering.fail(
            f"{what} a Ref in {'HBM' if 'hbm' in space else 'ANY'} memory directly (a TPU "
            "kernel reaches HBM only by DMA: copy the data into VMEM with pltpu.sync_copy or "
            "pltpu.async_copy, or give the operand a BlockSpec with a VMEM block)")


def _read(lowering: Lowering, eqn: Any, ref: ir.Value, transforms: Sequence[Any]) -> ir.Value:
    ref, transforms = accessed_view(lowering, ref, transforms)
    out = out_aval(eqn)
    raw = _read_raw(lowering, ref, transforms, out.shape, mir.memory_dtype(out.dtype))
    return mir.from_memory(raw, out.dtype)


def _read_raw(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any],
              shape: Sequence[int], dtype: Any) -> ir.Value:
    _check_direct(lowering, ref, "reading")
    strides = _strides(transforms)
    starts, sizes, dropped = view_indices(lowering, ref, transforms, strided=strides is not None)
    if _is_smem(ref):
        if any(s != 1 for s in sizes) or strides is not None:
            raise lowering.fail("vector reads from SMEM")
        return memref.LoadOp(ref, starts).result
    if strides is not None:  # every stride-th row (or column), as JAX lowers ref[a::k]
        full = tpu.StridedLoadOp(mir.value_type(sizes, dtype), ref, starts, strides).result
    else:
        full = vector.LoadOp(mir.value_type(sizes, dtype), ref, starts).result
    if dropped:
        if not shape:
            raise lowering.fail("reading a single element of a VMEM Ref")
        return vector.ShapeCastOp(mir.value_type(shape, dtype), full).result
    return full


def _write(lowering: Lowering, eqn: Any, ref: ir.Value, value: ir.Value,
           transforms: Sequence[Any], mask: ir.Value | None = None) -> None:
    ref, transforms = accessed_view(lowering, ref, transforms)
    _check_direct(lowering, ref, "writing")
    strides = _strides(transforms)
    starts, sizes, dropped = view_indices(lowering, ref, transforms, strided=strides is not None)
    if strides is not None and (mask is not None or _is_smem(ref)):
        raise lowering.fail("a strided store with a mask, or to SMEM (as in JAX's lowering: "
                            "store the strided rows unmasked, or a contiguous view)")
    value = mir.to_memory(value, in_aval(eqn, 1).dtype)
    dtype = mir.memory_dtype(in_aval(eqn, 1).dtype)
    if _is_smem(ref):
        if mask is not None:
            raise lowering.fail("a masked store to SMEM (store scalars under pl.when instead)")
        memref.StoreOp(value, ref, starts)
        return
    # The value has the indexed shape (integer-indexed dimensions dropped); the store takes
    # the slice's full rank.
    kept = [s for d, s in enumerate(sizes) if d not in dropped]
    value = mir.broadcast_to(value, kept)
    if list(mir.shape_of(value)) != sizes:
        value = vector.ShapeCastOp(mir.value_type(sizes, dtype), value).result
    if mask is not None:
        mask = mir.broadcast_to(mask, kept)
        if list(mir.shape_of(mask)) != sizes:
            mask = vector.ShapeCastOp(mir.value_type(sizes, np.bool_), mask).result
    if strides is not None:  # every stride-th row (or column), as JAX lowers ref[a::k] = v
        tpu.StridedStoreOp(value, ref, starts, strides)
        return
    tpu.VectorStoreOp(value, ref, starts, strides=[], mask=mask)


def eqn_transforms(eqn: Any, args: Sequence[Any]) -> Sequence[Any]:
    """The Ref transforms of a state primitive's equation (``get``, ``swap``, masked
    loads and stores), unflattened from its operands ``args`` after the Ref."""
    tree = eqn.params["tree"]
    return jax.tree_util.tree_unflatten(tree, args[:tree.num_leaves])  # type: ignore[no-any-return]


@rule(plb.get_p)
def _get(lowering: Lowering, eqn: Any, ref: ir.Value, *args: Any) -> ir.Value:
    return _read(lowering, eqn, ref, eqn_transforms(eqn, args))


@rule(plb.swap_p)
def _swap(lowering: Lowering, eqn: Any, ref: ir.Value, value: ir.Value, *args: Any) -> ir.Value:
    transforms = eqn_transforms(eqn, args)
    old = _read(lowering, eqn, ref, transforms)
    _write(lowering, eqn, ref, value, transforms)
    return old


@rule(plb.masked_swap_p)
def _masked_swap(lowering: Lowering, eqn: Any, ref: ir.Value, value: ir.Value,
                 *args: Any) -> ir.Value:
    """``pl.store``/``pltpu.store`` with ``mask=``: a VMEM store of the lanes the mask sets
    (32-bit data, as JAX lowers it); narrower data, whose stores Mosaic does not mask, is
    merged with the view's contents and stored whole (the view belongs to this core)."""
    transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], args[:-1])
    old = _read(lowering, eqn, ref, transforms)
    if np.dtype(in_aval(eqn, 1).dtype).itemsize == 4:
        _write(lowering, eqn, ref, value, transforms, mask=args[-1])
        return old
    shape = out_aval(eqn).shape
    merged = arith.SelectOp(mir.broadcast_to(args[-1], shape), mir.broadcast_to(value, shape),
                            old).result
    _write(lowering, eqn, ref, merged, transforms)
    return old


@rule(plb.masked_load_p)
def _masked_load(lowering: Lowering, eqn: Any, ref: ir.Value, *args: Any) -> ir.Value:
    """``pl.load``/``pltpu.load`` with ``mask=`` (and ``other=``): the view read whole from
    VMEM, then ``other`` (or the value read: masked lanes are undefined) where the mask is
    False. (JAX's Mosaic lowering refuses masked loads; a VMEM read of the lanes the mask
    leaves out is harmless when the view lies in the block, which the static part of each
    slice is checked for.)"""
    has_other = eqn.params["has_other"]
    n = eqn.params["tree"].num_leaves
    transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], args[:n])
    mask = args[n]
    view, last = accessed_view(lowering, ref, transforms)
    if _is_smem(view):
        raise lowering.fail("a masked load from SMEM (load scalars under pl.when instead)")
    if last:
        shape = list(ir.MemRefType(view.type).shape)
        for d, idx in enumerate(last[0].indices):
            if isinstance(idx, plb.Slice) and isinstance(idx.start, int) and isinstance(
                    idx.size, int) and idx.start + (idx.size - 1) * idx.stride >= shape[d]:
                raise lowering.fail(f"a masked load reaching past the end of the Ref's "
                                    f"dimension {d} ({shape[d]}): Mosaic reads the whole "
                                    "view, so it must lie in the Ref")
    out = out_aval(eqn)
    value = _read(lowering, eqn, ref, transforms)
    if not has_other:
        return value
    mask = mir.broadcast_to(mask, out.shape)
    return arith.SelectOp(mask, value, mir.broadcast_to(args[n + 1], out.shape)).result


def _bitcast_view(lowering: Lowering, ref: ir.Value, dtype: Any) -> ir.Value:
    """``ref.bitcast(dtype)``: the same bits as ``dtype``; the second-minor dimension scales
    by the ratio of the bit widths (``tpu.memref_bitcast``, as JAX lowers it)."""
    ref_type = ir.MemRefType(ref.type)
    shape = list(ref_type.shape)
    src_bits = mir.bit_width(ref_type.element_type)
    dst_bits = np.dtype(dtype).itemsize * 8
    if len(shape) < 2 or (shape[-2] * src_bits) % dst_bits:
        raise lowering.fail(f"bitcasting a Ref of shape {tuple(shape)} from {src_bits}-bit "
                            f"to {np.dtype(dtype).name}")
    shape[-2] = shape[-2] * src_bits // dst_bits
    out = ir.MemRefType.get(shape, mir.element_type(dtype), memory_space=ref_type.memory_space)
    return tpu.MemRefBitcastOp(out, ref).result


def ref_view(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any]) -> ir.Value:
    """``ref.at[...]`` as a memref: a slice, with integer-indexed dimensions squeezed out."""
    if not transforms:
        return ref
    if len(transforms) > 1:
        ref = ref_view(lowering, ref, transforms[:-1])
    if isinstance(transforms[-1], plb.BitcastTransform):
        return _bitcast_view(lowering, ref, transforms[-1].dtype)
    if isinstance(transforms[-1], plb.ReshapeTransform):
        ref_type = ir.MemRefType(ref.type)
        shape = list(transforms[-1].shape)
        return tpu.MemRefReshapeOp(ir.MemRefType.get(shape, ref_type.element_type,
                                                     memory_space=ref_type.memory_space),
                                   ref).result
    if not isinstance(transforms[-1], plb.NDIndexer):
        raise lowering.fail("Ref transforms other than indexing")
    ref_type = ir.MemRefType(ref.type)
    starts, sizes, dropped, dynamic = [], [], [], []
    for d, idx in enumerate(transforms[-1].indices):
        if isinstance(idx, plb.Slice):
            if idx.stride != 1:
                raise lowering.fail("a strided view of a Ref (as in JAX's lowering: read or "
                                    "write it with a strided index instead, ref[pl.ds(a, n, "
                                    "stride=k)], or copy a contiguous view)")
            start, size = idx.start, idx.size
            if isinstance(size, ir.Value):  # known when the kernel runs: a dynamic dimension
                dynamic.append(size)
                size = ir.ShapedType.get_dynamic_size()
        else:
            if isinstance(idx, ir.Value) and mir.shape_of(idx):
                raise lowering.fail("a copy indexed by a vector of indices (a gather or "
                                    "scatter DMA; SparseCore only)")
            start, size = idx, 1
            dropped.append(d)
        starts.append(start if isinstance(start, ir.Value) else mir.constant(start, np.int32))
        sizes.append(size)
    if sizes == list(ref_type.shape) and not dropped:
        return ref
    sliced = tpu.MemRefSliceOp(ir.MemRefType.get(sizes, ref_type.element_type,
                                                 memory_space=ref_type.memory_space),
                               ref, starts, dynamic).result
    if not dropped:
        return sliced
    kept = [s for d, s in enumerate(sizes) if d not in dropped]
    return tpu.MemRefSqueezeOp(ir.MemRefType.get(kept, ref_type.element_type,
                                                 memory_space=ref_type.memory_space),
                               sliced).result


# --- scoped allocation -----------------------------------------------------------------------


@rule(plb.run_scoped_p)
def _run_scoped(lowering: Lowering, eqn: Any, *outer: Any) -> list[Any]:
    if eqn.params.get("collective_axes"):
        raise lowering.fail("pl.run_scoped(collective_axes=...) (one buffer shared by the "
                            "cores along mesh axes)")
    if eqn.outvars:
        raise lowering.fail("pl.run_scoped returning values")
    region = tpu.RegionOp([])
    block = region.body
    with ir.InsertionPoint(block):
        scoped = []
        for t in eqn.params["scoped"]:
            if isinstance(t.memory_space, AccMemorySpace):
                scoped.append(lowering.alloc_accumulator(t.shape, t.dtype, t.memory_space, eqn))
                continue
            ty = (lowering.scratch_type or scratch_memref_type)(t.shape, t.dtype, t.memory_space)
            if t.memory_space in (SEMAPHORE, DMA_SEMAPHORE):
                scoped.append(tpu.AllocaSemaphoreOp(ty).result)
            else:
                scoped.append(memref.AllocaOp(ty, [], []).result)
        body = eqn.params["jaxpr"]
        lower_jaxpr(lowering, body.jaxpr, body.consts, [*outer, *scoped])
        tpu.YieldOp([])
    return []


@rule(plb.empty_ref_p)
def _empty_ref(lowering: Lowering, eqn: Any) -> ir.Value:
    """``jax.empty_ref`` (``pl.empty_ref_like``) in a kernel: a buffer of the kernel's own, in
    its memory space (VMEM when none is named), as JAX's lowering allocates it."""
    aval, space = eqn.params["ty"], eqn.params["memory_space"]
    if space is not None and not isinstance(space, plb.MemorySpace):
        raise lowering.fail(f"jax.empty_ref in memory space {space!r} (a kernel allocates "
                            "in this backend's memory spaces: pltpu.VMEM, pltpu.SMEM, ...)")
    ty = (lowering.scratch_type or scratch_memref_type)(aval.shape, aval.dtype, space)
    if space in (SEMAPHORE, DMA_SEMAPHORE):
        return tpu.AllocaSemaphoreOp(ty).result
    return memref.AllocaOp(ty, [], []).result
