"""Lowering of a traced kernel (a :class:`pallas_core.KernelCall`) to a Mosaic TPU module.

The module holds the kernel ``func.func`` and one ``transform_<i>`` function per windowed
operand (its index map). The kernel takes the grid indices (``i32``), the scalar-prefetch
operands (SMEM), one memref per input and output block (VMEM; whole arrays for ``ANY``), then
the scratch buffers. Attributes on the kernel carry what the TPU runtime pipelines: the
``iteration_bounds`` (grid), ``dimension_semantics``, ``window_params`` (block shapes and index
maps), ``scalar_prefetch`` and ``scratch_operands``.

This first version lowers elementwise math, casts, ``iota``, ``where``, broadcasts,
reductions, 2-D ``jnp.dot`` on the MXU, ``pl.when``/``cond``, ``fori_loop``, ``program_id``
and reads/writes of whole blocks or static/dynamic slices of them. Anything else raises an
``UnsupportedError`` naming the primitive and the kernel's source line.
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, cf, func, memref, vector
from jaxlib.mosaic.python import tpu

from pallas_core import backend as plb
from pallas_core import copies, extras, mlir_lowering, mlir_rules
from pallas_core import primitives as prims
from pallas_core.errors import PallasError, UnsupportedError
from pallas_core.grid_mapping import BlockMapping
from pallas_core.mlir_lowering import LoweringState
from pallas_core.request import KernelCall
from pallas_core.spec import BARRIER_SEMAPHORE, HOST
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.params import (
    CMEM,
    DMA_SEMAPHORE,
    HBM,
    SEMAPHORE,
    SMEM,
    VMEM_SHARED,
    AccMemorySpace,
    TPUCompilerParams,
)


@dataclasses.dataclass
class Lowering(LoweringState):
    """Lowering state of one Mosaic kernel: also the ``shard_map`` mesh it runs under."""

    mesh_axes: tuple[tuple[str, int], ...] = ()
    """``(name, size)`` of the mesh axes, major to minor; device ids are linear over them."""
    rules: Any = None
    """The rules to lower with (``None``: this backend's; the SparseCore backend extends them)."""
    scratch_type: Any = None
    """``(shape, dtype, memory_space) -> memref type`` of scratch and ``run_scoped`` buffers
    (``None``: this backend's; the SparseCore backend adds its shared VMEM)."""
    accumulators: dict[int, int] = dataclasses.field(default_factory=dict)
    """Entries of each MXU's accumulator memory given out so far (``pltpu.ACC`` Refs)."""

    def alloc_accumulator(self, shape: Sequence[int], dtype: Any, space: AccMemorySpace,
                          eqn: Any = None) -> AccRef:
        """An ``ACC`` Ref's place in its MXU's accumulator memory, as JAX's lowering gives it:
        the next free entries (``num_sublanes`` rows by the MXU's columns each), addressed in
        vector registers. Entries are never given back, as in JAX."""
        from pallas_mosaic_tpu import tpu_info

        # The chip lowered for, else (lowering on a machine without a TPU, no target named)
        # Mosaic TPU's default chip, v5e.
        info = (tpu_info.get_tpu_info() if tpu_info.is_tpu_device()
                else tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1))
        what = f"a pltpu.ACC({space.mxu_id}) Ref of shape {tuple(shape)}"
        if not info.num_accumulators:
            raise self.fail(f"{what} on TPU {info.chip_version} (its MXUs have no accumulator "
                            "memory; TPU 7 and later have: lower with target='v7x', or "
                            "multiply with jnp.dot)", eqn)
        rows = math.prod(shape[:-1])
        if (space.mxu_id >= info.num_mxus or shape[-1] != info.mxu_column_size
                or rows % info.num_sublanes):
            raise self.fail(f"{what} on TPU {info.chip_version} (an accumulator has "
                            f"{info.mxu_column_size} columns, a multiple of "
                            f"{info.num_sublanes} rows, and an mxu_id below {info.num_mxus})",
                            eqn)
        base = self.accumulators.get(space.mxu_id, 0)
        entries = rows // info.num_sublanes
        if base + entries > info.num_accumulators:
            raise self.fail(f"{what}: MXU {space.mxu_id}'s accumulator memory is full "
                            f"({info.num_accumulators} entries of {info.num_sublanes} rows, "
                            f"{base} in use, {entries} more asked for; fewer or smaller ACC "
                            "Refs fit)", eqn)
        self.accumulators[space.mxu_id] = base + entries
        return AccRef(base * (info.mxu_column_size // info.num_lanes), tuple(shape),
                      np.dtype(dtype), space.mxu_id)


@dataclasses.dataclass(frozen=True)
class AccRef:
    """An ``ACC`` Ref while a kernel is lowered: no memref, an address in the accumulator
    memory of MXU ``mxu_id`` (in vector registers), which the ``tpu.matmul_*`` ops name."""

    base_address: int
    shape: tuple[int, ...]
    dtype: np.dtype
    mxu_id: int


Rule = mlir_lowering.Rule


DIALECT = mlir_rules.Dialect(
    constant=mir.constant, broadcast_to=mir.broadcast_to, value_type=mir.value_type,
    lower_jaxpr=lambda *a: lower_jaxpr(*a), reduce=lambda *a: _reduce(*a))
"""Mosaic's values: scalars, and vectors for arrays."""
RULES = mlir_lowering.Rules(mlir_rules.table(DIALECT))
"""The shared rules (``pallas_core.mlir_rules``) and Mosaic TPU's own."""
rule = RULES.rule


def _space(bm: BlockMapping, prefetch: bool) -> str:
    if prefetch or bm.memory_space is SMEM:
        return "smem"
    if bm.memory_space is HBM:
        return "hbm"
    if bm.memory_space is HOST:
        return "host"
    if bm.memory_space is CMEM or bm.memory_space is VMEM_SHARED:
        return str(bm.memory_space.value)
    return "any" if bm.is_whole_array else "vmem"


def _scratch_type(shape: Sequence[int], dtype: Any, space: Any) -> ir.Type:
    """The memref of a scratch buffer (or semaphores) in its memory space."""
    if space is SEMAPHORE or space is DMA_SEMAPHORE:
        kind = "dma_semaphore" if space is DMA_SEMAPHORE else "semaphore"
        return ir.MemRefType.get(list(shape), ir.Type.parse(f"!tpu.{kind}"),
                                 memory_space=mir.memory_space("semaphore_mem"))
    names = {SMEM: "smem", HBM: "hbm", CMEM: "cmem", VMEM_SHARED: "vmem_shared", HOST: "host"}
    return mir.memref(shape, dtype, names.get(space, "vmem"))


def lower_kernel(call: KernelCall, mesh_axes: tuple[tuple[str, int], ...] = ()
                 ) -> tuple[ir.Module, str]:
    """The Mosaic module of ``call`` (in a fresh context) and its kernel function's name.

    ``mesh_axes`` are the ``shard_map`` mesh axes the call runs under (for device ids).
    """
    gm = call.grid_mapping
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in call.name) or "kernel"
    n_pf = gm.num_scalar_prefetch
    ctx = mir.new_context()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        i32 = ir.IntegerType.get_signless(32)
        grid_types = [i32] * len(gm.grid)
        operand_types = []
        for k, bm in enumerate(gm.block_mappings):
            space = _space(bm, k < n_pf)
            # Squeezed block dimensions (``None``) stay in the operand as size 1, as JAX has
            # them; the kernel body sees the operand squeezed (below).
            # Scalar prefetch and ANY/HBM operands come whole; VMEM and SMEM ones by block.
            whole = k < n_pf or space in ("any", "hbm")
            shape = bm.array_shape if whole else bm.full_block_shape
            operand_types.append(mir.memref(shape, bm.dtype, space))
        # The barrier semaphore and accumulators are not operands of the kernel function.
        scratch = [a for a in gm.scratch_avals if a.memory_space is not BARRIER_SEMAPHORE
                   and not isinstance(a.memory_space, AccMemorySpace)]
        scratch_types = [_scratch_type(a.inner_aval.shape, a.inner_aval.dtype, a.memory_space)
                         for a in scratch]
        windows = []
        with ir.InsertionPoint(module.body):
            kernel = func.FuncOp(name, (grid_types + operand_types + scratch_types, []))
            for j, bm in enumerate(gm.block_mappings[n_pf:]):
                if _space(bm, False) not in ("vmem", "smem"):
                    windows.append(ir.DictAttr.get({}))
                    continue
                _transform(call, bm, f"transform_{j}", grid_types + operand_types[:n_pf])
                windows.append(ir.DictAttr.get({
                    "transform_indices": ir.FlatSymbolRefAttr.get(f"transform_{j}"),
                    "window_bounds": ir.DenseI64ArrayAttr.get(list(bm.full_block_shape)),
                    **_pipeline_mode(call, bm),
                }))
        _set_attributes(kernel, call, windows, len(scratch))
        entry = kernel.add_entry_block()
        with ir.InsertionPoint(entry):
            args = list(entry.arguments)
            for k, bm in enumerate(gm.block_mappings):
                args[len(gm.grid) + k] = _squeezed(args[len(gm.grid) + k], bm)
            lowering = Lowering(call, "mosaic_tpu", args[:len(gm.grid)], mesh_axes=mesh_axes)
            n_args = len(gm.grid) + len(gm.block_mappings)
            given = iter(args[n_args:])
            scratch_args = []
            for a in gm.scratch_avals:
                if a.memory_space is BARRIER_SEMAPHORE:  # the kernel's barrier semaphore
                    scratch_args.append(tpu.GetBarrierSemaphoreOp(
                        _scratch_type((), np.int32, SEMAPHORE)).result)
                elif isinstance(a.memory_space, AccMemorySpace):
                    scratch_args.append(lowering.alloc_accumulator(
                        a.inner_aval.shape, a.inner_aval.dtype, a.memory_space))
                else:
                    scratch_args.append(next(given))
            lower_jaxpr(lowering, call.jaxpr.jaxpr, call.jaxpr.consts,
                        [*args[len(gm.grid):n_args], *scratch_args])
            func.ReturnOp([])
        mlir_lowering.verify(module, "mosaic_tpu", call.name)
    return module, name


def _squeezed(arg: ir.Value, bm: BlockMapping) -> ir.Value:
    """The block ``arg`` without its squeezed (``None``) dimensions: the Ref the body sees."""
    ty = ir.MemRefType(arg.type)
    if list(ty.shape) == list(bm.ref_shape):
        return arg
    return tpu.MemRefSqueezeOp(ir.MemRefType.get(list(bm.ref_shape), ty.element_type,
                                                 memory_space=ty.memory_space), arg).result


def _pipeline_mode(call: KernelCall, bm: BlockMapping) -> dict[str, ir.Attribute]:
    """The window attributes of a ``pl.Buffered`` pipeline mode (as JAX's lowering emits)."""
    mode = bm.pipeline_mode
    if mode is None:
        return {}
    if mode.use_lookahead or mode.buffer_count > 2:
        raise UnsupportedError(
            f"kernel {call.name!r}: {bm.origin} has pipeline_mode={mode}; the TPU pipeline "
            "takes 1 or 2 buffers and no lookahead. Fix: pl.Buffered(1) or pl.Buffered(2).")
    kind = "synchronous" if mode.buffer_count == 1 else "double_buffered"
    attrs = {"pipeline_mode": ir.Attribute.parse(f"#tpu.pipeline_mode<{kind}>")}
    if mode.revisit is not None:
        if mode.revisit.value == "any" and mode.buffer_count > 1:
            raise UnsupportedError(
                f"kernel {call.name!r}: {bm.origin} has pipeline_mode={mode}; revisiting any "
                "block needs a single buffer on TPU. Fix: pl.Buffered(1, revisit=...).")
        attrs["revisit_mode"] = ir.Attribute.parse(f"#tpu.revisit_mode<{mode.revisit.value}>")
    return attrs


def _transform(call: KernelCall, bm: BlockMapping, name: str, arg_types: list[ir.Type]) -> None:
    i32 = ir.IntegerType.get_signless(32)
    fn = func.FuncOp(name, (arg_types, [i32] * len(bm.array_shape)))
    entry = fn.add_entry_block()
    with ir.InsertionPoint(entry):
        lowering = Lowering(call, "mosaic_tpu")
        outs = lower_jaxpr(lowering, bm.index_map.jaxpr, bm.index_map.consts,
                           list(entry.arguments))
        func.ReturnOp([o if not isinstance(o, int) else mir.constant(o, np.int32) for o in outs])


def _set_attributes(kernel: Any, call: KernelCall, windows: list[ir.Attribute],
                    num_scratch: int) -> None:
    gm = call.grid_mapping
    params = call.compiler_params
    semantics = list(getattr(params, "dimension_semantics", None) or ())
    if isinstance(params, TPUCompilerParams) and semantics and len(semantics) != len(
            gm.user_grid):
        raise PallasError(
            f"kernel {call.name!r}: dimension_semantics has {len(semantics)} entries but the "
            f"grid {gm.user_grid} has {len(gm.user_grid)} axes. Fix: give one per grid axis.")
    # The cores of a mesh (pl.kernel) run in parallel; grid steps default to arbitrary.
    default = "parallel" if gm.is_mesh else "arbitrary"
    # Ours are enum members; JAX's own pltpu.CompilerParams may hold its enum or strings.
    names = ["parallel"] * gm.num_batch_axes + [
        str(getattr(s, "value", s)).lower() for s in semantics] + [
        default] * (len(gm.user_grid) - len(semantics))
    attrs = kernel.attributes
    attrs["dimension_semantics"] = ir.ArrayAttr.get(
        [ir.Attribute.parse(f"#tpu.dimension_semantics<{n}>") for n in names])
    if gm.grid:
        # A dynamic axis's size is a leading operand of the custom call (see plugin.py).
        dynamic = set(gm.dynamic_axes)
        attrs["iteration_bounds"] = ir.DenseI64ArrayAttr.get(
            [ir.ShapedType.get_dynamic_size() if a in dynamic else b
             for a, b in enumerate(gm.grid)])
        attrs["window_params"] = ir.ArrayAttr.get(windows)
    i64 = ir.IntegerType.get_signless(64)
    attrs["scalar_prefetch"] = ir.IntegerAttr.get(i64, gm.num_scalar_prefetch)
    attrs["scratch_operands"] = ir.IntegerAttr.get(i64, num_scratch)
    attrs["tpu.core_type"] = ir.Attribute.parse("#tpu.core_type<tc>")


def module_text(module: ir.Module) -> str:
    with module.context:
        return module.operation.get_asm(enable_debug_info=False)  # type: ignore[no-any-return]


# --- evaluating a jaxpr into Mosaic IR --------------------------------------------------------


def lower_jaxpr(lowering: Lowering, jaxpr: Any, consts: Sequence[Any],
                args: Sequence[Any]) -> list[Any]:
    """Emits ``jaxpr`` at the current insertion point; returns its outputs' values."""
    return mlir_lowering.lower_jaxpr(lowering, lowering.rules or RULES, jaxpr, consts, args,
                                     _literal)


_literal = mlir_lowering.splat_literal(mir.constant, "Mosaic")


def _in(eqn: Any, i: int = 0) -> Any:
    return eqn.invars[i].aval


def _out(eqn: Any) -> Any:
    return eqn.outvars[0].aval


@rule(lax.iota_p)
def _iota(lowering: Lowering, eqn: Any, *_: Any) -> ir.Value:
    aval = _out(eqn)
    return tpu.IotaOp(mir.value_type(aval.shape, aval.dtype),
                      dimensions=[eqn.params["dimension"]]).result


@rule(lax.broadcast_in_dim_p)
def _broadcast_in_dim(lowering: Lowering, eqn: Any, x: ir.Value, *_: Any) -> ir.Value:
    shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    if mir.shape_of(x):
        expanded = [1] * len(shape)
        for src_axis, dst_axis in enumerate(dims):
            expanded[dst_axis] = mir.shape_of(x)[src_axis]
        x = vector.ShapeCastOp(mir.value_type(expanded, _in(eqn).dtype), x).result
    return mir.broadcast_to(x, shape)


@rule(plb.broadcast_to_p)
def _broadcast_to(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """The state primitive ``broadcast_to`` (NumPy's broadcast, missing leading dimensions
    added, as the Triton backend lowers it; JAX's Mosaic lowering refuses it)."""
    shape = tuple(eqn.params["shape"])
    src = mir.shape_of(x)
    if src and len(src) < len(shape):
        x = vector.ShapeCastOp(mir.value_type((1,) * (len(shape) - len(src)) + src,
                                              _in(eqn).dtype), x).result
    return mir.broadcast_to(x, shape)


@rule(lax.reshape_p, lax.squeeze_p)
def _reshape(lowering: Lowering, eqn: Any, x: ir.Value, *_: Any) -> ir.Value:
    out = _out(eqn)
    if not mir.shape_of(x):  # a scalar becomes a vector of one element
        return mir.broadcast_to(x, out.shape) if out.shape else x
    if not out.shape:  # the one element of a vector, as a scalar
        if np.dtype(out.dtype).itemsize != 4:
            raise lowering.fail(f"reshaping a {np.dtype(out.dtype).name} vector to a scalar "
                                "(Mosaic's scalars are 32-bit: cast to a 32-bit type first)")
        return vector.ExtractOp(x, [], [0] * len(mir.shape_of(x))).result
    return vector.ShapeCastOp(mir.value_type(out.shape, out.dtype), x).result


@rule(lax.tile_p)
def _tile(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """``jnp.tile``: copies of the vector side by side, one axis at a time."""
    if not mir.shape_of(x):
        raise lowering.fail("tiling a scalar")
    for axis, reps in enumerate(eqn.params["reps"]):
        if reps > 1:
            x = tpu.ConcatenateOp([x] * reps, axis).result
    return x


def _extract(x: ir.Value, aval: Any, starts: Sequence[int], sizes: Sequence[int],
             strides: Sequence[int]) -> ir.Value:
    return vector.ExtractStridedSliceOp(mir.value_type(aval.shape, aval.dtype), x,
                                        list(starts), list(sizes), list(strides)).result


@rule(lax.slice_p)
def _slice(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    p = eqn.params
    starts, limits = p["start_indices"], p["limit_indices"]
    strides = p["strides"] or [1] * len(starts)
    if not mir.shape_of(x):
        raise lowering.fail("slicing a scalar")
    return _extract(x, _out(eqn), starts, [b - a for a, b in zip(starts, limits)], strides)


@rule(lax.split_p)
def _split(lowering: Lowering, eqn: Any, x: ir.Value) -> list[ir.Value]:
    axis, shape = eqn.params["axis"], list(_in(eqn).shape)
    outs, start = [], 0
    for size, v in zip(eqn.params["sizes"], eqn.outvars):
        starts, sizes = [0] * len(shape), list(shape)
        starts[axis], sizes[axis] = start, size
        outs.append(_extract(x, v.aval, starts, sizes, [1] * len(shape)))
        start += size
    return outs


@rule(lax.concatenate_p)
def _concatenate(lowering: Lowering, eqn: Any, *xs: ir.Value) -> ir.Value:
    if len(xs) == 1:
        return xs[0]
    return tpu.ConcatenateOp(list(xs), eqn.params["dimension"]).result


@rule(plb.stack_p)
def _stack(lowering: Lowering, eqn: Any, *xs: ir.Value) -> ir.Value:
    axis, aval = eqn.params["axis"], _in(eqn)
    shape = list(aval.shape)
    shape.insert(axis, 1)
    one = mir.value_type(shape, aval.dtype)
    parts = [vector.ShapeCastOp(one, x).result if aval.shape else
             vector.BroadcastOp(one, x).result for x in xs]
    if len(parts) == 1:
        return parts[0]
    return tpu.ConcatenateOp(parts, axis).result


@rule(plb.unstack_p)
def _unstack(lowering: Lowering, eqn: Any, x: ir.Value) -> list[ir.Value]:
    axis, shape = eqn.params["axis"], list(_in(eqn).shape)
    outs = []
    for k, v in enumerate(eqn.outvars):
        starts, sizes = [0] * len(shape), list(shape)
        starts[axis], sizes[axis] = k, 1
        one = list(shape)
        one[axis] = 1
        piece = _extract(x, plb.ShapedArray(tuple(one), v.aval.dtype), starts, sizes,
                         [1] * len(shape))
        out = v.aval
        piece = (vector.ShapeCastOp(mir.value_type(out.shape, out.dtype), piece).result
                 if out.shape else vector.ExtractOp(piece, [], [0] * len(shape)).result)
        outs.append(piece)
    return outs


@rule(lax.pad_p)
def _pad(lowering: Lowering, eqn: Any, x: ir.Value, value: ir.Value) -> ir.Value:
    aval = _in(eqn)
    shape = list(aval.shape)
    for axis, (low, high, interior) in enumerate(eqn.params["padding_config"]):
        if interior or low < 0 or high < 0:
            raise lowering.fail("lax.pad with interior or negative padding")
        parts = []
        for n in (low, None, high):
            if n is None:
                parts.append(x)
            elif n:
                side = list(shape)
                side[axis] = n
                parts.append(mir.broadcast_to(value, side))
        shape[axis] += low + high
        if len(parts) > 1:
            x = tpu.ConcatenateOp(parts, axis).result
    return x


@rule(lax.transpose_p)
def _transpose(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    out = _out(eqn)
    return vector.TransposeOp(mir.value_type(out.shape, out.dtype), x,
                              list(eqn.params["permutation"])).result


_PRECISION = {lax.Precision.HIGH: "#tpu.contract_precision<bf16x3>",
              lax.Precision.HIGHEST: "#tpu.contract_precision<fp32>"}
"""The ``tpu.matmul`` precision of ``dot_general``'s; DEFAULT (and none) is Mosaic's own."""


@rule(lax.dot_general_p)
def _dot(lowering: Lowering, eqn: Any, a: ir.Value, b: ir.Value) -> ir.Value:
    """``dot_general`` with any contracting and batch dimensions: ``tpu.matmul`` with
    dimension numbers naming them (its result ordered batch, lhs free, rhs free, as
    ``dot_general``'s), except a product with a one-row rhs of narrow floats, which is a
    matrix-vector product: multiply and sum, as JAX's lowering does."""
    (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
    lhs, rhs, out = _in(eqn, 0), _in(eqn, 1), _out(eqn)
    if any(mir.is_unsigned(x.dtype) for x in (lhs, rhs)):
        raise lowering.fail("dot_general of unsigned integers (the MXU reads integers as "
                            "signed; cast them to a signed type first)")
    if (tuple(ca), tuple(cb)) == ((1,), (1,)) and len(lhs.shape) == len(rhs.shape) == 2 \
            and rhs.shape[0] == 1 and not (np.dtype(lhs.dtype) == np.dtype(rhs.dtype)
                                           == np.float32):
        return _matvec(lowering, eqn, a, b)
    lhs_free = sorted(set(range(len(lhs.shape))) - set(ca) - set(ba))
    rhs_free = sorted(set(range(len(rhs.shape))) - set(cb) - set(bb))
    order = [x for d in (*ba, *lhs_free) for x in (0, d)] + [x for d in rhs_free
                                                            for x in (1, d)]
    numbers = ir.Attribute.parse("#tpu.dot_dimension_numbers<" + ",".join(
        "[" + ", ".join(str(d) for d in dims) + "]"
        for dims in (ca, cb, lhs_free, rhs_free, order, ba, bb)) + ">")
    precision = eqn.params.get("precision")
    if isinstance(precision, tuple):
        if precision[0] != precision[1]:
            raise lowering.fail("dot_general with a precision for each operand")
        precision = precision[0]
    if precision not in (None, lax.Precision.DEFAULT, *_PRECISION):
        raise lowering.fail(f"dot_general with precision {precision}")
    # Mosaic's matmul accumulates in 32 bits (a narrower accumulator does not verify, and
    # JAX's lowering emits one): a narrower result is the 32-bit product, narrowed.
    dtype = np.dtype(out.dtype)
    wide = dtype if dtype.itemsize >= 4 else np.dtype(
        np.float32 if mir.is_float(dtype) else np.int32)
    acc = mir.constant(0, wide, out.shape)
    kw = {"precision": ir.Attribute.parse(_PRECISION[precision])} \
        if precision in _PRECISION else {}
    product = tpu.MatmulOp(mir.value_type(out.shape, wide), a, b, acc,
                           transpose_lhs_hint=False, dimension_numbers=numbers, **kw).result
    if wide == dtype:
        return product
    return mlir_rules.convert(DIALECT, product, wide, dtype, out.shape)


def _matvec(lowering: Lowering, eqn: Any, a: ir.Value, b: ir.Value) -> ir.Value:
    """(M, K) . (1, K)^T of narrow floats: both broadcast to the result's rows by K, widened to
    the result's type, multiplied and summed along K (as JAX's lowering has it)."""
    lhs, rhs, out = _in(eqn, 0), _in(eqn, 1), _out(eqn)
    shape = tuple(np.broadcast_shapes(lhs.shape, out.shape))
    if lhs.shape != rhs.shape:
        if tuple(lhs.shape) != shape:
            a = vector.BroadcastOp(mir.value_type(shape, lhs.dtype), a).result
        if tuple(rhs.shape) != shape:
            b = vector.BroadcastOp(mir.value_type(shape, rhs.dtype), b).result
    wide = out.dtype
    if np.dtype(wide) != np.float32 and np.dtype(wide) not in (np.dtype(lhs.dtype),
                                                               np.dtype(rhs.dtype)):
        raise lowering.fail(f"a matrix-vector dot_general into {np.dtype(wide)}")
    if np.dtype(lhs.dtype) != np.dtype(wide):
        a = arith.ExtFOp(mir.value_type(shape, wide), a).result
    if np.dtype(rhs.dtype) != np.dtype(wide):
        b = arith.ExtFOp(mir.value_type(shape, wide), b).result
    acc = mir.constant(0, wide, (lhs.shape[0],))
    summed = vector.MultiDimReductionOp(ir.Attribute.parse("#vector.kind<add>"),
                                        arith.MulFOp(a, b).result, acc, [1]).result
    return vector.ShapeCastOp(mir.value_type(out.shape, out.dtype), summed).result


def _reduce(lowering: Lowering, eqn: Any, x: ir.Value, axes: Sequence[int],
            kind: str) -> ir.Value:
    """A ``vector.multi_reduction`` of ``kind`` (as ``mlir_rules.Dialect.reduce`` says)."""
    dtype, out = _in(eqn).dtype, _out(eqn)
    name = kind
    if kind in ("max", "min"):
        name = (kind + "imumf" if mir.is_float(dtype)
                else kind + ("ui" if mir.is_unsigned(dtype) else "si"))
    acc = mir.constant(mlir_rules.reduction_identity(kind, dtype), dtype, out.shape)
    return vector.MultiDimReductionOp(ir.Attribute.parse(f"#vector.kind<{name}>"), x, acc,
                                      list(axes)).result


_REDUCE_INDEX = {("float32", "int32")} | ({("bfloat16", "int16"), ("bfloat16", "int32")}
                                           if jax.__version_info__ >= (0, 11) else set())
"""(input, index) dtypes of ``tpu.reduce_index`` in the installed jaxlib (its own index type is
int16 for bfloat16 input, from JAX 0.11 on, and int32 for float32)."""


def _reduce_index(lowering: Lowering, eqn: Any, x: ir.Value, kind: str) -> ir.Value:
    """``jnp.argmax``/``argmin`` along one axis: ``tpu.reduce_index`` (a 1-D input is seen as
    one row), its int16 index widened where int32 is asked for."""
    src, out = _in(eqn), _out(eqn)
    axes = tuple(eqn.params["axes"])
    index = np.dtype(eqn.params["index_dtype"]).name
    if (np.dtype(src.dtype).name, index) not in _REDUCE_INDEX or len(axes) != 1:
        name = kind.replace("_", "")
        raise lowering.fail(f"jnp.{name} of {np.dtype(src.dtype).name} to {index} indices "
                            f"over axes {axes} (tpu.reduce_index takes "
                            f"{sorted(_REDUCE_INDEX)} (input, index) dtypes, along one axis)")
    axis, out_shape = axes[0], tuple(out.shape)
    if len(src.shape) == 1:
        x = vector.ShapeCastOp(mir.value_type((1, *src.shape), src.dtype), x).result
        axis, out_shape = axis + 1, (1, *out_shape)
    native = np.int16 if np.dtype(src.dtype).name == "bfloat16" else np.int32
    result = tpu.ReduceIndexOp(mir.value_type(out_shape, native), x, axis,
                               ir.Attribute.parse(f"#tpu.reduction_kind<{kind}>")).result
    if np.dtype(out.dtype) != native:
        result = arith.ExtSIOp(mir.value_type(out_shape, out.dtype), result).result
    if len(src.shape) == 1:
        result = vector.ExtractOp(result, [], [0]).result
    return result


@rule(lax.argmax_p)
def _argmax(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return _reduce_index(lowering, eqn, x, "arg_max")


@rule(lax.argmin_p)
def _argmin(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return _reduce_index(lowering, eqn, x, "arg_min")


_GATHER_MODES = (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@rule(lax.gather_p)
def _gather(lowering: Lowering, eqn: Any, x: ir.Value, indices: ir.Value) -> ir.Value:
    """``jnp.take_along_axis`` along one of the two minor dimensions: ``tpu.dynamic_gather``
    of the indices without the trailing unit dimension that ``take_along_axis`` appends (the
    one gather form Mosaic has)."""
    src, idx, out = _in(eqn), _in(eqn, 1), _out(eqn)
    rank, p = len(out.shape), eqn.params
    dn = p["dimension_numbers"]
    axes = tuple(dn.collapsed_slice_dims)
    like_take_along_axis = (
        len(src.shape) == rank and tuple(idx.shape) == (*out.shape, 1)
        and tuple(p["slice_sizes"]) == (1,) * rank and p["mode"] in _GATHER_MODES
        and not dn.offset_dims and axes == tuple(dn.start_index_map) and len(axes) == 1
        and tuple(dn.operand_batching_dims) == tuple(dn.start_indices_batching_dims)
        and len(dn.operand_batching_dims) == rank - 1)
    if not like_take_along_axis:
        raise lowering.fail(
            f"lax.gather with {dn} and slice sizes {tuple(p['slice_sizes'])} (Mosaic gathers "
            "only as jnp.take_along_axis(x, indices, axis) does, with indices of x's shape "
            "and mode 'fill' or 'promise_in_bounds')")
    if axes[0] < rank - 2:
        raise lowering.fail(f"jnp.take_along_axis along axis {axes[0]} of a rank-{rank} "
                            "array (Mosaic gathers along the two minor dimensions only; "
                            "move the axis there with jnp.swapaxes)")
    recovered = vector.ShapeCastOp(mir.value_type(out.shape, idx.dtype), indices).result
    return tpu.DynamicGatherOp(x, recovered, list(axes)).result


def _top_k_dtype(lowering: Lowering, eqn: Any, what: str) -> None:
    """JAX's conditions on a top-k's input: float32 (TPU v4 on) or bfloat16 (v6 on)."""
    from pallas_mosaic_tpu.tpu_info import get_tpu_info

    dtype = np.dtype(_in(eqn).dtype)
    if dtype.name not in ("float32", "bfloat16"):
        raise lowering.fail(f"{what} of {dtype.name} (Mosaic takes float32 and bfloat16)")
    needs = 4 if dtype.name == "float32" else 6
    info = get_tpu_info()
    if info.generation < needs:
        raise lowering.fail(f"{what} of {dtype.name} on {info.chip_version} (from TPU "
                            f"generation {needs} on; pass target= a later chip)")


def _lower_expansion(lowering: Lowering, eqn: Any, x: ir.Value, fn: Any,
                     **params: Any) -> list[Any]:
    """``fn(x, **params)`` (``pallas_mosaic_tpu.topk``) traced on ``eqn``'s operand and
    lowered in the equation's place."""
    from pallas_mosaic_tpu import topk

    jaxpr = topk.expansion(fn, _in(eqn), **params)
    return lower_jaxpr(lowering, jaxpr.jaxpr, jaxpr.consts, [x])


@rule(lax.top_k_p)
def _top_k(lowering: Lowering, eqn: Any, x: ir.Value) -> list[Any]:
    """``lax.top_k(x, k, is_stable=False)``: ``k`` rounds of ``argmax`` and masking, as JAX
    lowers it (``pallas_mosaic_tpu.topk``)."""
    from pallas_mosaic_tpu import topk

    if eqn.params.get("is_stable", True):
        raise lowering.fail("lax.top_k with is_stable=True (ties at -inf can repeat an index "
                            "in the rounds of argmax Mosaic takes the top k with; JAX's "
                            "lowering asks the same). Fix: lax.top_k(x, k, is_stable=False)")
    _top_k_dtype(lowering, eqn, "lax.top_k")
    return _lower_expansion(lowering, eqn, x, topk.top_k, k=eqn.params["k"],
                            axis=eqn.params.get("axis", -1))


@rule(lax.approx_top_k_p)
def _approx_top_k(lowering: Lowering, eqn: Any, x: ir.Value) -> list[Any]:
    """``lax.approx_max_k``: the top k of per-bin maxima, as JAX lowers it."""
    from pallas_mosaic_tpu import topk

    p = eqn.params
    _top_k_dtype(lowering, eqn, "lax.approx_max_k")
    if not p["is_max_k"]:
        raise lowering.fail("lax.approx_min_k (Mosaic's lowering takes the largest k only, as "
                            "JAX's does). Fix: lax.approx_max_k(-x, k) and negate the values")
    if not p["aggregate_to_topk"]:
        raise lowering.fail("lax.approx_max_k with aggregate_to_topk=False (as JAX's lowering, "
                            "this one returns the top k themselves)")
    if not 0.0 < p["recall_target"] <= 1.0:
        raise lowering.fail(f"lax.approx_max_k with recall_target={p['recall_target']} "
                            "(expected a value in (0, 1])")
    return _lower_expansion(lowering, eqn, x, topk.approx_max_k, k=p["k"],
                            axis=p["reduction_dimension"], recall_target=p["recall_target"])


def _conv_precision(lowering: Lowering, precision: Any) -> ir.Attribute | None:
    if isinstance(precision, tuple):
        if precision[0] != precision[1]:
            raise lowering.fail(f"a convolution with per-operand precision {precision}")
        precision = precision[0]
    if precision is None or precision == lax.Precision.DEFAULT:
        return None
    if precision == lax.Precision.HIGHEST:
        return ir.Attribute.parse("#tpu.contract_precision<fp32>")
    raise lowering.fail(f"a convolution with precision {precision} (Mosaic takes DEFAULT or "
                        "HIGHEST)")


@rule(lax.conv_general_dilated_p)
def _conv(lowering: Lowering, eqn: Any, lhs: ir.Value, rhs: ir.Value) -> ir.Value:
    """``lax.conv_general_dilated`` (and ``pltpu.conv``) as JAX lowers it: ``tpu.conv`` into a
    zero accumulator, with JAX's dimension numbers, strides, padding and dilations."""
    if not hasattr(tpu, "ConvOp"):
        raise lowering.fail("a convolution with this jaxlib (tpu.conv is new in JAX 0.11, and "
                            "JAX's lowering has no rule for it before)")
    p = eqn.params
    for aval in (_in(eqn), _in(eqn, 1)):
        if mir.is_unsigned(aval.dtype):
            raise lowering.fail(f"a convolution of {np.dtype(aval.dtype).name} (Mosaic's takes "
                                "floats and signed integers)")
    out = _out(eqn)
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec

    def dims(ds: Sequence[int]) -> str:
        return "[" + ", ".join(str(d) for d in ds) + "]"

    dimension_numbers = ir.Attribute.parse(
        f"#tpu.conv_dimension_numbers<{lhs_spec[0]}, {lhs_spec[1]}, {dims(lhs_spec[2:])}, "
        f"{rhs_spec[1]}, {rhs_spec[0]}, {dims(rhs_spec[2:])}, {out_spec[0]}, {out_spec[1]}, "
        f"{dims(out_spec[2:])}>")
    spatial = len(lhs_spec) - 2
    acc = mir.constant(0, out.dtype, out.shape)
    return tpu.ConvOp(
        mir.value_type(out.shape, out.dtype), lhs, rhs, acc, dimension_numbers,
        [int(x) for x in p["window_strides"] or (1,) * spatial],
        [int(x) for pair in (p["padding"] or ((0, 0),) * spatial) for x in pair],
        [int(x) for x in p["lhs_dilation"] or (1,) * spatial],
        [int(x) for x in p["rhs_dilation"] or (1,) * spatial], [False] * spatial,
        feature_group_count=p["feature_group_count"],
        batch_group_count=p["batch_group_count"],
        precision=_conv_precision(lowering, p.get("precision"))).result


@rule(prims.program_id_p)
def _program_id(lowering: Lowering, eqn: Any) -> ir.Value:
    gm = lowering.call.grid_mapping
    return lowering.program_ids[gm.num_batch_axes + eqn.params["axis"]]


@rule(plb.axis_index_p)
def _axis_index(lowering: Lowering, eqn: Any) -> ir.Value:
    gm = lowering.call.grid_mapping
    name = eqn.params["axis_name"]
    name = name[0] if isinstance(name, tuple) and len(name) == 1 else name
    if gm.grid_names and name in gm.grid_names:
        return lowering.program_ids[gm.num_batch_axes + gm.grid_names.index(name)]
    names = [n for n, _ in lowering.mesh_axes]
    if name not in names:
        raise lowering.fail(f"lax.axis_index({name!r}) of an axis that is neither the kernel "
                            f"mesh's nor one of the shard_map mesh axes {tuple(names)}")
    # This device's coordinate along the axis, from its linear id over the mesh.
    k = names.index(name)
    device = tpu.DeviceIdOp().result
    stride = mir.constant(_mesh_stride(lowering.mesh_axes, k), np.int32)
    return arith.RemSIOp(arith.DivSIOp(device, stride).result,
                         mir.constant(lowering.mesh_axes[k][1], np.int32)).result


def _mesh_stride(axes: Sequence[tuple[str, int]], k: int) -> int:
    """How far apart, in linear device ids, neighbours along mesh axis ``k`` are."""
    return math.prod(size for _, size in axes[k + 1:])


@rule(prims.num_programs_p)
def _num_programs(lowering: Lowering, eqn: Any) -> ir.Value:
    """The size of a dynamic grid axis, as the TPU runtime knows it."""
    gm = lowering.call.grid_mapping
    return tpu.GetIterationBoundOp(gm.num_batch_axes + eqn.params["axis"]).result


@rule(plb.dim_as_value_p)
def _dim_as_value(lowering: Lowering, eqn: Any) -> ir.Value:
    """A symbolic dimension's value: its placeholder constant (see ``symbolic.py``), which
    the runtime replaces with the value for each call, as JAX lowers it."""
    dim = eqn.params["dim"]
    if plb.is_symbolic_dim(dim):
        raise lowering.fail(f"the value of the symbolic dimension {dim} outside JAX's "
                            "dynamic-shape export (pl.pallas_export_experimental"
                            "(dynamic_shapes=True))")
    return mir.constant(int(dim), np.int32)


@rule(prims.multiple_of_p)
def _multiple_of(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """``pl.multiple_of``: Mosaic's alignment hint, ``tpu.assume_multiple``, as JAX emits it."""
    if not isinstance(x, ir.Value):
        return x
    for multiple in eqn.params["values"]:
        x = tpu.AssumeMultipleOp(x, int(multiple)).result
    return x


@rule(extras.delay_p)
def _delay(lowering: Lowering, eqn: Any, nanos: ir.Value) -> list[Any]:
    tpu.DelayOp(nanos)
    return []


@rule(extras.reciprocal_p)
def _approx_reciprocal(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    aval = _in(eqn)
    if np.dtype(aval.dtype) != np.float32 or not aval.shape:
        raise lowering.fail(f"pl.reciprocal(approx=True) of {aval.str_short()} (Mosaic's "
                            "approximate reciprocal takes float32 vectors)", eqn)
    full_range = {} if eqn.params["full_range"] else {"full_range": False}
    return tpu.ReciprocalOp(x, approx=True, **full_range).result


# --- Refs ------------------------------------------------------------------------------------


def _strides(transforms: Sequence[Any]) -> list[int] | None:
    """The strides of the one indexer in ``transforms``, if any slice of it has one."""
    if not transforms or not isinstance(transforms[0], plb.NDIndexer):
        return None
    strides = [idx.stride if isinstance(idx, plb.Slice) else 1
               for idx in transforms[0].indices]
    return strides if any(s != 1 for s in strides) else None


def _indices(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any],
             strided: bool = False) -> tuple[list[ir.Value], list[int], list[int]]:
    """Start indices, sizes, and which dimensions an integer index drops (of the one indexer
    in ``transforms``: see :func:`_accessed`); ``strided``: slices may have strides (the
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


def _accessed(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any]
              ) -> tuple[ir.Value, Sequence[Any]]:
    """``ref.at[a].at[b][c]``: the view ``ref.at[a].at[b]`` and the last indexer ``[c]``."""
    if isinstance(ref, AccRef):
        raise lowering.fail("reading or writing a pltpu.ACC Ref with ref[...] (an accumulator "
                            "is read with pltpu.matmul_pop and written with "
                            "pltpu.matmul_acc_lhs, as in JAX)")
    if transforms and not isinstance(transforms[-1], plb.NDIndexer):
        return _view(lowering, ref, transforms), ()  # a reshaped or bitcast view, read whole
    if len(transforms) > 1:
        return _view(lowering, ref, transforms[:-1]), transforms[-1:]
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
    ref, transforms = _accessed(lowering, ref, transforms)
    out = _out(eqn)
    raw = _read_raw(lowering, ref, transforms, out.shape, mir.memory_dtype(out.dtype))
    return mir.from_memory(raw, out.dtype)


def _read_raw(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any],
              shape: Sequence[int], dtype: Any) -> ir.Value:
    _check_direct(lowering, ref, "reading")
    strides = _strides(transforms)
    starts, sizes, dropped = _indices(lowering, ref, transforms, strided=strides is not None)
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
    ref, transforms = _accessed(lowering, ref, transforms)
    _check_direct(lowering, ref, "writing")
    strides = _strides(transforms)
    starts, sizes, dropped = _indices(lowering, ref, transforms, strided=strides is not None)
    if strides is not None and (mask is not None or _is_smem(ref)):
        raise lowering.fail("a strided store with a mask, or to SMEM (as in JAX's lowering: "
                            "store the strided rows unmasked, or a contiguous view)")
    value = mir.to_memory(value, _in(eqn, 1).dtype)
    dtype = mir.memory_dtype(_in(eqn, 1).dtype)
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


def _transforms(eqn: Any, args: Sequence[Any]) -> Sequence[Any]:
    tree = eqn.params["tree"]
    return jax.tree_util.tree_unflatten(tree, args[:tree.num_leaves])  # type: ignore[no-any-return]


@rule(plb.get_p)
def _get(lowering: Lowering, eqn: Any, ref: ir.Value, *args: Any) -> ir.Value:
    return _read(lowering, eqn, ref, _transforms(eqn, args))


@rule(plb.swap_p)
def _swap(lowering: Lowering, eqn: Any, ref: ir.Value, value: ir.Value, *args: Any) -> ir.Value:
    transforms = _transforms(eqn, args)
    old = _read(lowering, eqn, ref, transforms)
    _write(lowering, eqn, ref, value, transforms)
    return old


@rule(prims.masked_swap_p)
def _masked_swap(lowering: Lowering, eqn: Any, ref: ir.Value, value: ir.Value,
                 *args: Any) -> ir.Value:
    """``pl.store``/``pltpu.store`` with ``mask=``: a VMEM store of the lanes the mask sets
    (32-bit data, as JAX lowers it); narrower data, whose stores Mosaic does not mask, is
    merged with the view's contents and stored whole (the view belongs to this core)."""
    transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], args[:-1])
    old = _read(lowering, eqn, ref, transforms)
    if np.dtype(_in(eqn, 1).dtype).itemsize == 4:
        _write(lowering, eqn, ref, value, transforms, mask=args[-1])
        return old
    shape = _out(eqn).shape
    merged = arith.SelectOp(mir.broadcast_to(args[-1], shape), mir.broadcast_to(value, shape),
                            old).result
    _write(lowering, eqn, ref, merged, transforms)
    return old


@rule(prims.masked_load_p)
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
    view, last = _accessed(lowering, ref, transforms)
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
    out = _out(eqn)
    value = _read(lowering, eqn, ref, transforms)
    if not has_other:
        return value
    mask = mir.broadcast_to(mask, out.shape)
    return arith.SelectOp(mask, value, mir.broadcast_to(args[n + 1], out.shape)).result


# --- scoped allocation, semaphores, DMA -------------------------------------------------------


@rule(prims.run_scoped_p)
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
            ty = (lowering.scratch_type or _scratch_type)(t.shape, t.dtype, t.memory_space)
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
    ty = (lowering.scratch_type or _scratch_type)(aval.shape, aval.dtype, space)
    if space in (SEMAPHORE, DMA_SEMAPHORE):
        return tpu.AllocaSemaphoreOp(ty).result
    return memref.AllocaOp(ty, [], []).result


@rule(plb.debug_callback_p)
def _debug_callback(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    """``jax.debug.callback`` (and ``jax.debug.print``): a TPU kernel cannot call the host,
    so nothing is emitted, as in JAX's lowering; a warning says so where the kernel is
    lowered (``pl.debug_print`` prints from a TPU kernel)."""
    warnings.warn(f"jax.debug.callback in Mosaic TPU kernel {lowering.call.name!r} at "
                  f"{plb.source_line(eqn)} does nothing on a TPU (a kernel cannot call the "
                  "host; JAX's lowering drops it too). Fix: print with pl.debug_print, or run "
                  "the kernel with backend='interpret', where the callback runs.",
                  stacklevel=2)
    return []


def _assert(ok: ir.Value, message: str) -> None:
    """``cf.assert`` of a scalar ``ok`` (an ``i1``, or a vector of one element)."""
    if mir.shape_of(ok):
        ok = vector.ExtractOp(ok, [], [0] * len(mir.shape_of(ok))).result
    cf.AssertOp(ok, message)


@rule(plb.check_p)
def _check(lowering: Lowering, eqn: Any, *args: ir.Value) -> list[Any]:
    """``checkify.debug_check`` as JAX lowers it: ``cf.assert`` that the failure predicate is
    False, while ``pl.enable_debug_checks`` is on (nothing otherwise)."""
    found = mlir_rules.debug_check_to_assert(lowering, eqn)
    if found is None:
        return []
    index, message = found
    fails = args[index]
    _assert(arith.XOrIOp(fails, mir.constant(True, np.bool_, ())).result, message)
    return []


@rule(extras.debug_check_p)
def _debug_check(lowering: Lowering, eqn: Any, ok: ir.Value) -> list[Any]:
    """``pl.debug_check`` (traced only while ``pl.enable_debug_checks`` is on): ``cf.assert``,
    as JAX lowers it."""
    _assert(ok, eqn.params["message"])
    return []


@rule(plb.platform_index_p)
def _platform_index(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    """``lax.platform_dependent`` in a kernel: the branch for ``mosaic``, else the default
    one, as JAX's lowering picks it."""
    branch = plb.platform_branch(eqn, ("mosaic",))
    if branch is None:
        raise lowering.fail(f"lax.platform_dependent with branches for "
                            f"{eqn.params['platforms']} and no default (a Mosaic TPU kernel "
                            "takes the branch named mosaic=..., else default=...)")
    return mir.constant(branch, np.int32, ())


_REDUCE_PRECISION = hasattr(tpu, "ReducePrecisionOp")
"""Whether the installed jaxlib has ``tpu.reduce_precision`` (JAX 0.11 on)."""


@rule(lax.reduce_precision_p)
def _reduce_precision(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    if not _REDUCE_PRECISION:
        raise lowering.fail(f"lax.reduce_precision of {np.dtype(_in(eqn).dtype).name} with "
                            "this jaxlib (tpu.reduce_precision is new in JAX 0.11, and JAX's "
                            "lowering refuses it before)")
    if not mir.shape_of(x):
        raise lowering.fail("lax.reduce_precision of a scalar (tpu.reduce_precision takes "
                            "vectors; reduce a one-element array)")
    p = eqn.params
    return tpu.ReducePrecisionOp(x, p["exponent_bits"], p["mantissa_bits"]).result


_TYPED_LOG = jax.__version_info__ >= (0, 11)
"""Whether ``tpu.log`` placeholders name their type (``$s0``, ``$f1``: JAX 0.11 on, which logs
floats too) or are bare (``$0``: JAX 0.10, 32-bit integers only)."""


def _log_spec(dtype: Any) -> str | None:
    """How ``tpu.log`` formats a 32-bit scalar (``f``, ``s``, ``u``; ``""`` before JAX 0.11),
    else ``None``."""
    dt = np.dtype(dtype)
    if dt.itemsize != 4 or dt.kind not in ("fiu" if _TYPED_LOG else "iu"):
        return None
    return {"f": "f", "i": "s", "u": "u"}[dt.kind] if _TYPED_LOG else ""


@rule(prims.debug_print_p)
def _debug_print(lowering: Lowering, eqn: Any, *args: ir.Value) -> list[Any]:
    """``pl.debug_print`` as JAX lowers it: scalars through ``tpu.log`` (placeholders become
    ``$s0``, ``$u1``, ``$f2``...), one array (its placeholder last) copied into a VMEM buffer
    for ``tpu.log_buffer``."""
    fmt = eqn.params["fmt"]
    avals = [v.aval for v in eqn.invars]
    if all(a.shape == () for a in avals):
        specs = [_log_spec(a.dtype) for a in avals]
        if None in specs:
            bad = next(a.dtype for a, sp in zip(avals, specs) if sp is None)
            what = "32-bit integers and floats" if _TYPED_LOG else "32-bit integers (and floats " \
                "from JAX 0.11 on)"
            raise lowering.fail(f"pl.debug_print of a {np.dtype(bad).name} scalar (TPUs log "
                                f"{what})", eqn)
        pieces = fmt.split("{}")
        tag = "".join(f"{p}${sp}{k}" for k, (p, sp) in enumerate(zip(pieces, specs)))
        tpu.LogOp(list(args), tag + pieces[-1], formatted=bool(args))
        return []
    if len(args) != 1 or not fmt.endswith("{}"):
        raise lowering.fail("pl.debug_print of an array with other values, or with its "
                            "placeholder not at the end (TPUs log scalars, or one array "
                            "after a prefix)", eqn)
    (aval,), (value,) = avals, args
    region = tpu.RegionOp([])
    with ir.InsertionPoint(region.body):
        buf = memref.AllocaOp(mir.memref(aval.shape, aval.dtype, "vmem"), [], []).result
        vector.StoreOp(value, buf, [mir.index(0)] * len(aval.shape))
        tpu.LogBufferOp(buf, list(aval.shape), fmt[:-2])
        tpu.YieldOp([])
    return []


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


def _view(lowering: Lowering, ref: ir.Value, transforms: Sequence[Any]) -> ir.Value:
    """``ref.at[...]`` as a memref: a slice, with integer-indexed dimensions squeezed out."""
    if not transforms:
        return ref
    if len(transforms) > 1:
        ref = _view(lowering, ref, transforms[:-1])
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


def _role_views(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> list[ir.Value]:
    roles = eqn.params["roles"]
    n_refs = max(roles) + 1
    tree = eqn.params["tree"]
    transforms = jax.tree_util.tree_unflatten(tree, args[n_refs:n_refs + tree.num_leaves])
    return [_view(lowering, args[r], t) for r, t in zip(roles, transforms)]


def _device_id(lowering: Lowering, ids: Sequence[Any], id_type: prims.DeviceIdType
               ) -> ir.Value:
    """The linear (logical) id of the device that ``ids`` name, as the DMA engine wants it."""
    ids = [i if isinstance(i, ir.Value) else mir.constant(i, np.int32) for i in ids]
    if id_type is not prims.DeviceIdType.MESH:
        return ids[0]
    axes = lowering.mesh_axes
    if not axes:
        raise lowering.fail("a device id outside shard_map (run the kernel under shard_map)")
    if len(ids) != len(axes):
        raise PallasError(
            f"kernel {lowering.call.name!r} ({lowering.location}): device_id has {len(ids)} "
            f"coordinates but the shard_map mesh has axes {tuple(n for n, _ in axes)}. Fix: "
            "give one coordinate per mesh axis, or DeviceIdType.LOGICAL with a single index.")
    linear: ir.Value = mir.constant(0, np.int32)
    for k, coord in enumerate(ids):
        stride = mir.constant(_mesh_stride(axes, k), np.int32)
        linear = arith.AddIOp(linear, arith.MulIOp(coord, stride).result).result
    return linear


def _copy_device_id(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> ir.Value:
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    return _device_id(lowering, args[max(roles) + 1 + tree.num_leaves:],
                      eqn.params["device_id_type"])


@rule(copies.copy_start_p)
def _copy_start(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    if eqn.params.get("add"):
        raise lowering.fail("an adding copy (add=True; a SparseCore DMA) on a TensorCore")
    priority = eqn.params.get("priority", 0)
    queue = {"priority": priority} if priority else {}
    if not eqn.params["remote"]:
        src, dst, sem = _role_views(lowering, eqn, args)
        tpu.EnqueueDMAOp(src, dst, target_semaphore=sem, **queue)
        return []
    src, dst, recv_sem, send_sem = _role_views(lowering, eqn, args)
    tpu.EnqueueDMAOp(src, dst, source_semaphore=send_sem, target_semaphore=recv_sem,
                     device_id=_copy_device_id(lowering, eqn, args), **queue)
    return []


@rule(copies.copy_wait_p)
def _copy_wait(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    src, dst, sem = _role_views(lowering, eqn, args)
    kind = eqn.params["kind"]
    if plb.mosaic_waits_name_both_ends():  # as the installed JAX lowers waits
        device = None if kind == "local" else _copy_device_id(lowering, eqn, args)
        sems = {"source_semaphore": sem} if kind == "send" else {"target_semaphore": sem}
        tpu.WaitDMAOp(src, dst, kind != "send", device_id=device, **sems)
        return []
    if kind == "local":
        tpu.WaitDMA2Op(sem, src, dst)
    elif kind == "recv":  # the data sent to this device has arrived
        tpu.WaitDMA2Op(sem, src, dst, device_id=_copy_device_id(lowering, eqn, args))
    else:  # this device's send has left: the DMA seen from the sender's side
        here = mir.constant(0, np.int32)
        tpu.WaitDMA2Op(sem, dst, src, device_id=here, core_id=here)
    return []


def _semaphore(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> ir.Value:
    tree = eqn.params["tree"]
    transforms = jax.tree_util.tree_unflatten(tree, args[1:1 + tree.num_leaves])
    return _view(lowering, args[0], transforms)


@rule(prims.semaphore_signal_p)
def _semaphore_signal(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    n = 1 + eqn.params["tree"].num_leaves
    has_core = eqn.params.get("has_core_index", False)
    ids = args[n + 1:len(args) - int(has_core)]
    device = (_device_id(lowering, ids, eqn.params["device_id_type"])
              if eqn.params["has_device_id"] else None)
    core = args[-1] if has_core else None
    tpu.SemaphoreSignalOp(_semaphore(lowering, eqn, args), args[n], device_id=device,
                          core_id=core)
    return []


@rule(prims.semaphore_wait_p)
def _semaphore_wait(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    if not eqn.params["decrement"]:
        raise lowering.fail("pl.semaphore_wait(decrement=False)")
    tpu.SemaphoreWaitOp(_semaphore(lowering, eqn, args), args[1 + eqn.params["tree"].num_leaves])
    return []


@rule(prims.semaphore_read_p)
def _semaphore_read(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    return tpu.SemaphoreReadOp(_semaphore(lowering, eqn, args)).result


def lowering_rules() -> Mapping[Any, mlir_lowering.Rule]:
    """Mosaic TPU's full rule table, read-only: the shared rules, the rules above and those of
    the TensorCore primitives (:mod:`pallas_mosaic_tpu.primitives`); every entry has the one
    rule signature (``pallas_core.backend.Rule``)."""
    from pallas_mosaic_tpu import primitives  # noqa: F401 - defines the primitives' rules

    return types.MappingProxyType(RULES)
