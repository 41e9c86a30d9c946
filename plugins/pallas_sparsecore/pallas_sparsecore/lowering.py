"""Lowering of a SparseCore kernel (``pl.kernel`` on a subcore mesh) to a Mosaic module whose
kernel function runs on the vector (or scalar) subcores.

The kernel takes the core and subcore indices (``i32``), every operand whole in HBM, then its
scratch (VMEM per subcore, VMEM_SHARED per core, SMEM, semaphores). Its attributes name the
core type (``#tpu.core_type<sc_vector_subcore>``), the mesh (``iteration_bounds``, one
``core_parallel`` and one ``subcore_parallel`` dimension) and a trivial window per operand.
Elementwise math, control flow and plain DMAs use the Mosaic TPU backend's rules; VMEM reads
and writes, gather/scatter DMAs and the SparseCore primitives have rules here.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, func, memref, scf
from jaxlib.mosaic.python import tpu
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu import lowering as tl
from pallas_mosaic_tpu.lowering import Lowering
from pallas_mosaic_tpu.params import DMA_SEMAPHORE, HBM, SEMAPHORE, SMEM

from pallas_core import ANY
from pallas_core import backend as plb
from pallas_core.backend import BARRIER_SEMAPHORE, KernelCall, PallasError, UnsupportedError
from pallas_sparsecore import primitives as sc
from pallas_sparsecore import shared
from pallas_sparsecore.params import NAME, VMEM_SHARED, SCCompilerParams

RULES = plb.Rules(tl.lowering_rules())
"""Mosaic TPU's rules, then the SparseCore rules below (read it through :func:`lowering_rules`)."""
rule = RULES.rule


def params_of(call: KernelCall) -> SCCompilerParams:
    params = call.compiler_params
    if not isinstance(params, SCCompilerParams):
        raise PallasError(
            f"kernel {call.name!r}: the sparsecore backend runs pl.kernel on a SparseCore mesh "
            "(plsc.VectorSubcoreMesh or plsc.ScalarSubcoreMesh). Fix: pass such a mesh.")
    return params


def _space_name(space: Any) -> str:
    if space is VMEM_SHARED:
        return "vmem_shared"
    if space is SMEM:
        return "smem"
    if space is HBM or space is None or space is ANY:
        return "hbm"
    return "vmem"


def _scratch_type(shape: Sequence[int], dtype: Any, space: Any) -> ir.Type:
    if space is SEMAPHORE or space is DMA_SEMAPHORE:
        return tl.scratch_memref_type(shape, dtype, space)
    return mir.memref(shape, dtype, _space_name(space))


def lower_kernel(call: KernelCall, mesh_axes: tuple[tuple[str, int], ...] = ()
                 ) -> tuple[ir.Module, str]:
    """The Mosaic module of the SparseCore kernel ``call`` and its function's name.

    ``mesh_axes`` are the ``shard_map`` mesh axes the call runs under (device ids of remote
    copies and signals are linear over them)."""
    params = params_of(call)
    gm = call.grid_mapping
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in call.name) or "kernel"
    ctx = mir.new_context()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        i32 = ir.IntegerType.get_signless(32)
        grid_types = [i32] * len(gm.grid)
        operand_types = [mir.memref(bm.array_shape, bm.dtype, _space_name(bm.memory_space))
                         for bm in gm.block_mappings]
        scratch = [a for a in gm.scratch_avals if a.memory_space is not BARRIER_SEMAPHORE]
        barrier = len(scratch) < len(gm.scratch_avals)
        scratch_types = [_scratch_type(a.inner_aval.shape, a.inner_aval.dtype, a.memory_space)
                         for a in scratch]
        with ir.InsertionPoint(module.body):
            kernel = func.FuncOp(name, (grid_types + operand_types + scratch_types, []))
        attrs = kernel.attributes
        kinds = ["core_parallel", "subcore_parallel"][:len(gm.grid)]
        attrs["dimension_semantics"] = ir.ArrayAttr.get(
            [ir.Attribute.parse(f"#tpu.dimension_semantics<{k}>") for k in kinds])
        attrs["iteration_bounds"] = ir.DenseI64ArrayAttr.get(list(gm.grid))
        dims = ", ".join(f"d{i}" for i in range(len(gm.grid)))
        attrs["window_params"] = ir.ArrayAttr.get([ir.DictAttr.get({
            "transform_indices": ir.Attribute.parse(
                f"affine_map<({dims}) -> ({', '.join(['0'] * len(bm.array_shape))})>")})
            for bm in gm.block_mappings])
        i64 = ir.IntegerType.get_signless(64)
        attrs["scalar_prefetch"] = ir.IntegerAttr.get(i64, 0)
        attrs["scratch_operands"] = ir.IntegerAttr.get(i64, len(scratch_types))
        attrs["tpu.core_type"] = ir.Attribute.parse(
            f"#tpu.core_type<sc_{params.kernel_type}_subcore>")
        entry = kernel.add_entry_block()
        with ir.InsertionPoint(entry):
            args = list(entry.arguments)
            if barrier:  # the hidden last scratch operand: pltpu.get_barrier_semaphore()
                args.append(tpu.GetBarrierSemaphoreOp(
                    _scratch_type((), np.int32, SEMAPHORE)).result)
            lowering = Lowering(call, NAME, args[:len(gm.grid)], rules=RULES,
                                scratch_type=_scratch_type, mesh_axes=mesh_axes)
            tl.lower_jaxpr(lowering, call.jaxpr.jaxpr, call.jaxpr.consts, args[len(gm.grid):])
            func.ReturnOp([])
        plb.verify_module(module, "sparsecore", call.name)
    return module, name


# --- Ref reads and writes --------------------------------------------------------------------


def _space(ref: ir.Value) -> str:
    text = str(ir.MemRefType(ref.type).memory_space)
    for s in ("vmem_shared", "vmem", "smem", "hbm"):
        if f"<{s}>" in text:
            return s
    return "vmem"


def _access(lowering: Lowering, eqn: Any, ref: ir.Value, transforms: Sequence[Any]
            ) -> tuple[ir.Value, list[ir.Value], list[int], list[int]]:
    """The view accessed (``ref.at[a].at[b]`` of ``ref.at[a].at[b][c]``) and the starts,
    sizes and dropped dimensions of the last indexer ``[c]``."""
    space = _space(ref)
    if space in ("hbm", "vmem_shared"):
        raise lowering.fail(
            f"reading or writing {space.upper()} directly (the vector subcores access VMEM "
            "and SMEM; copy the data with pltpu.sync_copy first)")
    ref, transforms = tl.accessed_view(lowering, ref, transforms)
    return (ref, *tl.view_indices(lowering, ref, transforms))


@rule(plb.get_p)
def _get(lowering: Lowering, eqn: Any, ref: ir.Value, *args: Any) -> ir.Value:
    transforms = tl.eqn_transforms(eqn, args)
    ref, starts, sizes, dropped = _access(lowering, eqn, ref, transforms)
    out = eqn.outvars[0].aval
    if _space(ref) == "smem":
        if any(s != 1 for s in sizes):
            raise lowering.fail("vector reads from SMEM")
        return memref.LoadOp(ref, starts).result
    if not out.shape:
        raise lowering.fail("reading a single element of a VMEM Ref (read a vector, "
                            "ref[pl.ds(i, num_lanes)], and take its element)")
    stored = mir.memory_dtype(out.dtype)
    full = tpu.VectorLoadOp(mir.value_type(sizes, stored), ref, starts, []).result
    if dropped:
        from jaxlib.mlir.dialects import vector
        full = vector.ShapeCastOp(mir.value_type(out.shape, stored), full).result
    return mir.from_memory(full, out.dtype)


@rule(plb.swap_p)
def _swap(lowering: Lowering, eqn: Any, ref: ir.Value, value: ir.Value, *args: Any) -> Any:
    transforms = tl.eqn_transforms(eqn, args)
    ref, starts, sizes, dropped = _access(lowering, eqn, ref, transforms)
    value_dtype = eqn.invars[1].aval.dtype
    value, dtype = mir.to_memory(value, value_dtype), mir.memory_dtype(value_dtype)
    if _space(ref) == "smem":
        old = memref.LoadOp(ref, starts).result
        memref.StoreOp(value, ref, starts)
        return mir.from_memory(old, value_dtype)
    if not sizes or (all(s == 1 for s in sizes) and not mir.shape_of(value)):
        raise lowering.fail("writing a single element of a VMEM Ref")
    value = mir.broadcast_to(value, [s for d, s in enumerate(sizes) if d not in dropped])
    from jaxlib.mlir.dialects import vector
    if list(mir.shape_of(value)) != sizes:
        value = vector.ShapeCastOp(mir.value_type(sizes, dtype), value).result
    old = tpu.VectorLoadOp(mir.value_type(sizes, dtype), ref, starts, []).result
    tpu.VectorStoreOp(value, ref, starts, [])
    if dropped:
        out = eqn.outvars[0].aval
        old = vector.ShapeCastOp(mir.value_type(out.shape, dtype), old).result
    return mir.from_memory(old, value_dtype)


# --- DMAs: plain ones as on a TensorCore, gathers and scatters indirect ------------------------


def _indirect_split(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any]
                    ) -> tuple[ir.Value, ir.Value, int | None] | None:
    """``(base memref, offsets vector, the offset to skip)`` when the view indexes its leading
    dimension with a vector (``plsc.Indices`` give the offset to skip), else ``None``."""
    if len(transforms) != 1:
        return None
    indices = list(getattr(transforms[0], "indices", ()))
    skip = None
    if any(isinstance(i, plb.Indices) for i in indices[1:]):
        raise lowering.fail("plsc.Indices past the leading dimension of a copy's view")
    if indices and isinstance(indices[0], plb.Indices):
        skip, indices[0] = indices[0].ignored_value, indices[0].values
    if not indices or not (isinstance(indices[0], ir.Value) and mir.shape_of(indices[0])):
        return None
    shape = ir.MemRefType(ref.type).shape
    for i, d in zip(indices[1:], shape[1:]):
        if not (isinstance(i, plb.Slice) and isinstance(i.start, int) and i.start == 0
                and i.size == d):
            raise lowering.fail("a gather or scatter DMA that also slices the trailing "
                                "dimensions (index the leading dimension only)")
    return ref, _offsets_memref(indices[0]), skip


def _offsets_memref(offsets: ir.Value) -> ir.Value:
    """The VMEM Ref an index vector was read whole from (``table.at[idx_ref]``): the DMA
    engine takes its offsets from memory, as JAX emits them; other vectors are passed as
    they are."""
    owner = offsets.owner
    if isinstance(owner, ir.Operation) or hasattr(owner, "operation"):
        op = owner.operation if hasattr(owner, "operation") else owner
        if op.name == "tpu.vector_load":
            base = op.operands[0]
            if tuple(ir.MemRefType(base.type).shape) == mir.shape_of(offsets):
                return base
    return offsets


def _copy_views(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> Any:
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    refs = [args[r] for r in roles]
    src_ind = _indirect_split(lowering, refs[0], transforms[0])
    dst_ind = _indirect_split(lowering, refs[1], transforms[1])
    if src_ind and dst_ind:
        raise lowering.fail("a DMA that gathers and scatters at once")
    views = [src_ind[0] if src_ind else tl.ref_view(lowering, refs[0], transforms[0]),
             dst_ind[0] if dst_ind else tl.ref_view(lowering, refs[1], transforms[1]),
             tl.ref_view(lowering, refs[2], transforms[2])]
    found = src_ind or dst_ind
    return views, (found[1:] if found else None)


def _is_push_stream(kernel_type: str, src: str, dst: str) -> bool:
    """Whether a local copy from ``src`` to ``dst`` (memory space names) is a push stream."""
    if src == "vmem_shared" and dst == "smem":
        return True
    return kernel_type == "vector" and src == "vmem" and dst != "vmem"


def _check_adding_copy(lowering: Lowering, src: str, dst: str) -> None:
    """Refuse, as the installed JAX's SparseCore lowering does (JAX 0.12), an adding copy out
    of VMEM into anything but shared VMEM."""
    if src == "vmem" and dst != "vmem_shared" and plb.sparsecore_adds_only_into_shared_vmem():
        raise UnsupportedError(
            f"an adding copy (add=True) from VMEM into {dst.upper()} is not supported by the "
            f"{NAME!r} backend at JAX {jax.__version__} (kernel {lowering.call.name!r} at "
            f"{lowering.location}): its SparseCore lowering adds out of VMEM only into "
            "VMEM_SHARED. Fix: add into a plsc.VMEM_SHARED accumulator (pl.run_scoped), meet "
            "at plsc.subcore_barrier(), then copy the total out with a plain copy.")


@rule(plb.copy_start_p)
def _copy_start(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    if eqn.params["remote"]:
        return _remote_copy_start(lowering, eqn, args)
    (src, dst, sem), indirect = _copy_views(lowering, eqn, args)
    add = bool(eqn.params.get("add"))
    if indirect is None:
        if add:
            raise lowering.fail("an adding copy (add=True) without an index vector (SparseCore "
                                "DMAs add only when they scatter or gather)")
        if _is_push_stream(params_of(lowering.call).kernel_type, _space(src), _space(dst)):
            warnings.warn(
                "plsc: the destination semaphore of a push stream (a copy from a vector "
                "subcore's VMEM to HBM, shared VMEM or SMEM, or from shared VMEM to SMEM) is "
                "ignored; wait() already waits for the stream.",
                shared.SparseCorePushStreamWarning, stacklevel=2)
        tpu.EnqueueDMAOp(src, dst, target_semaphore=sem)
    else:
        if add:
            _check_adding_copy(lowering, _space(src), _space(dst))
        offsets, skip = indirect
        # plsc.Indices(ignored_value=v): the DMA engine skips the offsets equal to v.
        skipped = None if skip is None else mir.constant(skip, np.int32)
        tpu.EnqueueIndirectDMAOp(src, dst, offsets, sem, add=add, offset_filter=skipped)
    return []


def _refuse_remote_indirect(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> None:
    """A remote copy is a plain DMA: ``tpu.enqueue_indirect_dma`` names no device (JAX's
    SparseCore lowering refuses remote gathers and scatters too)."""
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    for k in (0, 1):
        if _indirect_split(lowering, args[roles[k]], transforms[k]) is not None:
            raise UnsupportedError(
                f"a remote gather or scatter (a copy to another device through an index "
                f"vector) is not supported by the {NAME!r} backend (kernel "
                f"{lowering.call.name!r} at {lowering.location}): the SparseCore's indirect "
                "DMA (tpu.enqueue_indirect_dma) addresses this device only, and JAX's lowering "
                "refuses it as well. Fix: gather into a VMEM buffer here, then send the buffer "
                "with make_async_remote_copy.")


def _remote_copy_start(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> list[Any]:
    """``make_async_remote_copy(...).start()``: a DMA to the device the ids name (the same
    core and subcore there), as JAX's SparseCore lowering emits it: the receive semaphore as
    the target's, the send semaphore as the source's."""
    if eqn.params.get("add"):
        raise lowering.fail("an adding remote copy (add=True; only gathers and scatters on "
                            "this device add)")
    _refuse_remote_indirect(lowering, eqn, args)
    _remember_receive_semaphore(lowering, eqn, args)
    return tl.lowering_rules()[plb.copy_start_p](lowering, eqn, *args)


_STARTED = "_sc_remote_copies_started"
"""The attribute of a :class:`Lowering` listing the remote copies started so far, as
``((src, dst, send semaphore) Refs, receive semaphore Ref)``."""


def _kernel_argument(value: Any) -> bool:
    """Whether ``value`` is an argument of the kernel function (defined before any use)."""
    if not isinstance(value, ir.Value):
        return False
    try:
        owner = ir.BlockArgument(value).owner.owner
    except (ValueError, TypeError):
        return False
    return getattr(owner, "operation", owner).name == "func.func"


def _remember_receive_semaphore(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> None:
    """Notes the receive semaphore of a remote copy whose Refs are the kernel's arguments and
    whose semaphore view is static, for the copy's ``wait_send``: JAX 0.12 names it there."""
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    refs = [args[r] for r in roles]
    if all(_kernel_argument(r) for r in refs) and not any(
            isinstance(leaf, ir.Value) for leaf in jax.tree_util.tree_leaves(transforms[2])):
        started = getattr(lowering, _STARTED, [])
        started.append(((refs[0], refs[1], refs[3]), (refs[2], transforms[2])))
        setattr(lowering, _STARTED, started)


def _receive_semaphore(lowering: Lowering, refs: Sequence[Any]) -> ir.Value | None:
    """The receive semaphore of the latest remote copy started from these Refs (``None`` when
    none was noted)."""
    for started, (sem, transforms) in reversed(getattr(lowering, _STARTED, [])):
        if all(a == b for a, b in zip(started, refs, strict=True)):
            return tl.ref_view(lowering, sem, transforms)
    return None


def _remote_wait(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> list[Any]:
    """A remote copy's ``wait_send``/``wait_recv``: the TensorCore's rule, except that where
    the installed JAX names both ends of a wait (0.12) the send's wait also names the receive
    semaphore of its copy, as JAX's SparseCore lowering does."""
    _refuse_remote_indirect(lowering, eqn, args)
    roles = eqn.params["roles"]
    if eqn.params["kind"] == "send" and plb.mosaic_waits_name_both_ends():
        recv = _receive_semaphore(lowering, [args[r] for r in roles])
        if recv is not None:
            src, dst, sem = tl.role_views(lowering, eqn, args)
            tpu.WaitDMAOp(src, dst, False, source_semaphore=sem, target_semaphore=recv,
                          device_id=tl.copy_device_id(lowering, eqn, args))
            return []
    return tl.lowering_rules()[plb.copy_wait_p](lowering, eqn, *args)


@rule(plb.copy_wait_p)
def _copy_wait(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    if eqn.params["kind"] != "local":  # a remote copy's wait_send or wait_recv
        return _remote_wait(lowering, eqn, args)
    (src, dst, sem), indirect = _copy_views(lowering, eqn, args)
    if indirect is None and plb.mosaic_waits_name_both_ends():  # as the installed JAX lowers
        tpu.WaitDMAOp(src, dst, True, target_semaphore=sem)
    elif indirect is None:
        tpu.WaitDMA2Op(sem, src, dst)
    else:
        tpu.WaitIndirectDMAOp(sem, src, dst)
    return []


# --- SparseCore primitives -------------------------------------------------------------------


def _views(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> tuple[list[ir.Value], list[Any]]:
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    views = [tl.ref_view(lowering, args[r], t) for r, t in zip(roles, transforms)]
    for v in views:
        if _space(v) != "vmem":
            raise lowering.fail(f"a register gather, scatter or masked access on "
                                f"{_space(v).upper()} (it works on VMEM)")
    return views, list(args[n_refs + tree.num_leaves:])


def _zeros(n: int) -> list[ir.Value]:
    return [mir.index(0) for _ in range(n)]


@rule(sc.load_gather_p)
def _load_gather(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    (ref,), rest = _views(lowering, eqn, args)
    p = eqn.params
    idx, mask = rest[:p["n_idx"]], rest[p["n_idx"]] if p["has_mask"] else None
    out = eqn.outvars[0].aval
    return tpu.VectorLoadIdxOp(mir.value_type(out.shape, out.dtype), ref, idx, mask=mask).result


@rule(sc.store_scatter_p)
def _store_scatter(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    (ref,), rest = _views(lowering, eqn, args)
    p = eqn.params
    idx, x = rest[:p["n_idx"]], rest[p["n_idx"]]
    mask = rest[p["n_idx"] + 1] if p["has_mask"] else None
    tpu.VectorStoreIdxOp(x, ref, idx, mask=mask, add=True if p["add"] else None)
    return []


@rule(sc.load_expanded_p)
def _load_expanded(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    (ref,), (mask,) = _views(lowering, eqn, args)
    out = eqn.outvars[0].aval
    rank = len(ir.MemRefType(ref.type).shape)
    return tpu.VectorLoadOp(mir.value_type(out.shape, out.dtype), ref, _zeros(rank), [],
                            mask=mask).result


@rule(sc.store_compressed_p)
def _store_compressed(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    (ref,), (x, mask) = _views(lowering, eqn, args)
    rank = len(ir.MemRefType(ref.type).shape)
    tpu.VectorStoreOp(x, ref, _zeros(rank), [], mask=mask,
                      add=True if eqn.params["add"] else None)
    return []


@rule(sc.addupdate_p)
def _addupdate(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    (ref,), (x,) = _views(lowering, eqn, args)
    rank = len(ir.MemRefType(ref.type).shape)
    tpu.VectorStoreOp(x, ref, _zeros(rank), [], add=True)
    return []


@rule(shared.fetch_and_add_p)
def _fetch_and_add(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    tree = eqn.params["tree"]
    transforms = jax.tree_util.tree_unflatten(tree, list(args[1:1 + tree.num_leaves]))
    view = tl.ref_view(lowering, args[0], transforms[0])
    value, subcore = args[-2], args[-1]
    rank = len(ir.MemRefType(view.type).shape)
    zeros = [mir.constant(0, np.int32) for _ in range(rank)]
    return tpu.fetch_and_add_sync(view, zeros, value, subcore)


_SIGN = 0x80000000


def _flip_sign(x: ir.Value, dtype: Any) -> ir.Value:
    """int32 lanes with the sign bit flipped: the hardware compares them unsigned."""
    if np.dtype(dtype) != np.int32:
        return x
    bit = mir.constant(np.int32(-_SIGN), np.int32, mir.shape_of(x))
    return arith.XOrIOp(x, bit).result


def _scan(kind: str, x: ir.Value, mask: ir.Value | None, dtype: Any) -> ir.Value:
    attr = ir.Attribute.parse(f"#tpu.reduction_kind<{kind}>")
    try:
        op = tpu.ScanOp(x.type, x, attr, 0, mask=mask)  # jaxlib 0.11: with the dimension
    except TypeError:
        op = tpu.ScanOp(x.type, x, attr, mask=mask)
    return op.result


def _all_true(like: ir.Value) -> ir.Value:
    t = ir.VectorType.get(list(mir.shape_of(like)), ir.IntegerType.get_signless(1))
    return arith.ConstantOp(t, ir.DenseElementsAttr.get_splat(
        t, ir.IntegerAttr.get(ir.IntegerType.get_signless(1), 1))).result


@rule(sc.cumsum_p)
def _cumsum(lowering: Lowering, eqn: Any, x: ir.Value, *m: ir.Value) -> ir.Value:
    return _scan("sum", x, m[0] if m else _all_true(x), eqn.invars[0].aval.dtype)


def _running(kind: str, eqn: Any, x: ir.Value, m: Sequence[ir.Value]) -> ir.Value:
    """A running ``max`` or ``min`` (``tpu.scan``), int32 sign-flipped around it."""
    dtype = eqn.invars[0].aval.dtype
    if hasattr(tpu.ReductionKind, "kMaxF"):  # newer Mosaic names the comparison (the int32
        kind += "f" if np.issubdtype(dtype, np.floating) else "ui"  # lanes compare unsigned)
    out = _scan(kind, _flip_sign(x, dtype), m[0] if m else _all_true(x), dtype)
    return _flip_sign(out, dtype)


@rule(sc.cummax_p)
def _cummax(lowering: Lowering, eqn: Any, x: ir.Value, *m: ir.Value) -> ir.Value:
    return _running("max", eqn, x, m)


@rule(sc.cummin_p)
def _cummin(lowering: Lowering, eqn: Any, x: ir.Value, *m: ir.Value) -> ir.Value:
    return _running("min", eqn, x, m)


@rule(lax.rev_p)
def _rev(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """``lax.rev`` of one register, as JAX lowers it: a ``tpu.dynamic_gather`` of the lanes
    ``num_lanes - 1 - iota``."""
    from jaxlib.mlir.dialects import vector
    params = params_of(lowering.call)
    aval = eqn.invars[0].aval
    lanes = params.info.num_lanes
    if params.kernel_type != "vector":
        raise lowering.fail("lax.rev in a scalar-subcore kernel (it reverses a vector "
                            "register)")
    if tuple(eqn.params["dimensions"]) != (0,) or aval.shape != (lanes,) or \
            np.dtype(aval.dtype).itemsize != 4:
        raise lowering.fail(
            f"lax.rev of {aval.dtype}{list(aval.shape)} along {eqn.params['dimensions']} (it "
            f"reverses one register: a 1-D 32-bit vector of the chip's {lanes} lanes, along "
            "dimension 0)")
    i32 = ir.IntegerType.get_signless(32)
    idx_t = ir.VectorType.get([lanes], i32)
    last = vector.BroadcastOp(idx_t, arith.ConstantOp(i32, lanes - 1).result).result
    iota = tpu.IotaOp(idx_t, dimensions=[0]).result
    return tpu.DynamicGatherOp(x, arith.SubIOp(last, iota).result, [0]).result


@rule(sc.sort_p)
def _sort(lowering: Lowering, eqn: Any, k: ir.Value, v: ir.Value, *m: ir.Value) -> list[Any]:
    dtype = eqn.invars[0].aval.dtype
    mask_t = ir.VectorType.get(list(mir.shape_of(k)), ir.IntegerType.get_signless(1))
    op = tpu.SortOp(mask_t, k.type, v.type, _flip_sign(k, dtype), v,
                    mask=m[0] if m else _all_true(k),
                    descending=True if eqn.params["descending"] else None)
    out_mask, keys, vals = op.results
    return [_flip_sign(keys, dtype), vals, out_mask]


@rule(sc.scan_count_p)
def _scan_count(lowering: Lowering, eqn: Any, x: ir.Value, *m: ir.Value) -> list[Any]:
    shape = list(mir.shape_of(x))
    mask_t = ir.VectorType.get(shape, ir.IntegerType.get_signless(1))
    counts_t = ir.VectorType.get(shape, ir.IntegerType.get_signless(32))
    op = tpu.ScanCountOp(m[0] if m else _all_true(x), x, results=[mask_t, counts_t])
    last, counts = op.results
    return [counts, last]


def _all_reduce(kind: str, eqn: Any, x: ir.Value) -> ir.Value:
    out = eqn.outvars[0].aval
    return tpu.AllReduceOp(mir.value_type(out.shape, out.dtype), x, 0,
                           ir.Attribute.parse(f"#tpu.reduction_kind<{kind}>")).result


@rule(sc.popcount_p)
def _popcount(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return _all_reduce("sum", eqn, x)


@rule(sc.ffs_p)
def _ffs(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return _all_reduce("find_first_set", eqn, x)


@rule(sc.bitcast_p)
def _bitcast(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    from jaxlib.mlir.dialects import vector
    out = eqn.outvars[0].aval
    return vector.BitCastOp(mir.value_type(out.shape, out.dtype), x).result


@rule(sc.pack_p)
def _pack(lowering: Lowering, eqn: Any, a: ir.Value, b: ir.Value) -> ir.Value:
    out = eqn.outvars[0].aval
    fmt = ir.Attribute.parse(f"#tpu.pack_format<{eqn.params['format'].value}>")
    return tpu.PackSubelementsOp(mir.value_type(out.shape, out.dtype), [a, b], [0, 1],
                                 fmt).result


@rule(sc.unpack_p)
def _unpack(lowering: Lowering, eqn: Any, ab: ir.Value) -> list[Any]:
    out = eqn.outvars[0].aval
    fmt = ir.Attribute.parse(f"#tpu.pack_format<{eqn.params['format'].value}>")
    t = mir.value_type(out.shape, out.dtype)
    return [tpu.UnpackSubelementsOp(t, ab, i, fmt).result for i in (0, 1)]


@rule(sc.subcore_barrier_p)
def _barrier(lowering: Lowering, eqn: Any) -> list[Any]:
    if params_of(lowering.call).kernel_type != "vector":
        raise lowering.fail("plsc.subcore_barrier in a scalar-subcore kernel")
    tpu.BarrierOp(mir.index(0))
    return []


@rule(sc.parallel_loop_p)
def _parallel_marker(lowering: Lowering, eqn: Any) -> list[Any]:
    return []


@rule(plb.scan_p)
def _scan_loop(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    """A ``fori_loop``; one written by ``plsc.parallel_loop`` (its body starts with the
    marker) becomes an ``scf.for`` the compiler may software-pipeline."""
    body = eqn.params["jaxpr"].jaxpr
    marker = next((e for e in body.eqns if e.primitive is sc.parallel_loop_p), None)
    block = ir.InsertionPoint.current.block
    before = len(block.operations)
    outs = tl.lowering_rules()[plb.scan_p](lowering, eqn, *args)
    if marker is not None:
        loops = [op for op in list(block.operations)[before:]
                 if isinstance(op.opview, scf.ForOp)]
        loop = loops[-1].opview
        loop.attributes["sc.parallel_access"] = ir.UnitAttr.get()
        loop.attributes["sc.loop_unroll_factor"] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(64), marker.params["unroll"])
    return outs


def lowering_rules() -> Mapping[Any, plb.Rule]:
    """SparseCore's full rule table, read-only: Mosaic TPU's (``pallas_mosaic_tpu.lowering.
    lowering_rules()``) with the SparseCore rules above added or overriding; every entry has
    the one rule signature (``pallas_core.backend.Rule``)."""
    return types.MappingProxyType(RULES)
