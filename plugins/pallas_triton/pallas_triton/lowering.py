"""Lowering of a traced kernel (a :class:`pallas_core.KernelCall`) to one Triton ``tt.func``.

The kernel takes one ``!tt.ptr`` per input and per output (whole arrays in global memory).
The grid is folded into Triton's X axis and unfolded again with div/mod, so any number of grid
axes works. Each block Ref of the kernel becomes a :class:`BlockRef`: the array's base pointer
and the element offset of the block's start in every dimension (from the index map, evaluated
in the kernel). Reading or writing a Ref computes a tensor of pointers and, for edge blocks and
user masks, a mask.

Rules are registered per primitive in ``RULES`` (:mod:`pallas_triton.registry`, which this module
and :mod:`pallas_triton.lowering_arrays` register into); a primitive without a rule raises an
``UnsupportedError`` naming it, the kernel and the source line.
"""

from __future__ import annotations

import dataclasses
import io
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, scf
from jaxlib.mlir.dialects import math as mmath
from jaxlib.triton import dialect as tt

from pallas_core import backend as plb
from pallas_core.backend import BlockMapping, KernelCall, block_index_tables
from pallas_triton import (
    barriers,
    lowering_arrays,  # noqa: F401 - its whole-array rules join RULES
    validation,
)
from pallas_triton import ir as tir
from pallas_triton import primitives as tprims
from pallas_triton.registry import RULES, Lowering, convert, lower_jaxpr, rule


@dataclasses.dataclass
class BlockRef:
    """A kernel Ref: a block of an array in global memory."""

    ptr: ir.Value
    bm: BlockMapping
    starts: list[ir.Value]
    """Element offset (i32 scalar) of the block's first element, per array dimension."""


Rule = plb.Rule


# --- the kernel function ---------------------------------------------------------------------


def lower_kernel(call: KernelCall, platform: str = "cuda") -> tuple[ir.Module, str]:
    """The Triton module of ``call`` for ``platform`` (``"cuda"`` or ``"rocm"``), in a fresh
    MLIR context, and its function's name."""
    gm = call.grid_mapping
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in call.name) or "kernel"
    ctx = tir.new_context()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        arg_types = [tir.pointer(bm.dtype) for bm in gm.block_mappings]
        i32 = ir.IntegerType.get_signless(32)
        with ir.InsertionPoint(module.body):
            fn = tt.FuncOp(name, ir.TypeAttr.get(ir.FunctionType.get(arg_types, [])),
                           sym_visibility="public")
            fn.arg_attrs = ir.ArrayAttr.get(
                [ir.DictAttr.get({"tt.divisibility": ir.IntegerAttr.get(i32, 16)})
                 for _ in arg_types])
            entry = fn.body.blocks.append(*arg_types)
        with ir.InsertionPoint(entry):
            parallel, sequential = grid_axes(call)
            pid = tt.GetProgramIdOp(tt.ProgramIDDim.X).result
            par_ids = _unravel(pid, [gm.grid[a] for a in parallel])
            if not sequential:
                _lower_step(call, platform, entry.arguments, dict(zip(parallel, par_ids)))
            else:
                # Steps along these axes share output blocks: one program runs them in order.
                n = math.prod(gm.grid[a] for a in sequential)
                loop = scf.ForOp(tir.i32(0), tir.i32(n), tir.i32(1), [])
                with ir.InsertionPoint(loop.body):
                    seq_ids = _unravel(loop.induction_variable,
                                       [gm.grid[a] for a in sequential])
                    ids = {**dict(zip(parallel, par_ids)), **dict(zip(sequential, seq_ids))}
                    _lower_step(call, platform, entry.arguments, ids)
                    scf.YieldOp([])  # barriers between steps: pallas_triton.barriers
            tt.ReturnOp([])
        # Aliased operands are one buffer: an output's pointer is its input's.
        same_array = {gm.num_inputs + o: i for i, o in call.input_output_aliases}
        barriers.insert_barriers(fn, same_array)
        plb.verify_module(module, "triton", call.name)
    return module, name


def grid_axes(call: KernelCall) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The grid axes run as parallel programs, and those run in order inside each program.

    An axis is parallel when every output has a dimension whose block index is that grid index:
    programs differing along it never share an output block. The others (a matmul's K axis)
    revisit output blocks, which on a GPU would race if they were separate programs.
    """
    gm = call.grid_mapping
    tables = block_index_tables(gm)
    if tables is None:
        return tuple(range(len(gm.grid))), ()
    points, per_operand = tables
    parallel = []
    for a in range(len(gm.grid)):
        if all(any((table[:, d] == points[:, a]).all() for d in range(table.shape[1]))
               for table in per_operand[gm.num_inputs:]):
            parallel.append(a)
    return tuple(parallel), tuple(a for a in range(len(gm.grid)) if a not in parallel)


def _lower_step(call: KernelCall, platform: str, pointers: Sequence[ir.Value],
                ids: dict[int, ir.Value]) -> None:
    gm = call.grid_mapping
    ordered = [ids[a] for a in range(len(gm.grid))]
    lowering = Lowering(call, "triton", ordered, platform=platform)
    refs = []
    for ptr, bm in zip(pointers, gm.block_mappings):
        block_idx = _eval_index_map(lowering, bm, ordered)
        starts = [arith.MulIOp(i, tir.i32(b)).result
                  for i, b in zip(block_idx, bm.full_block_shape)]
        refs.append(BlockRef(ptr, bm, starts))
    lower_jaxpr(lowering, call.jaxpr.jaxpr, call.jaxpr.consts, refs)


def module_text(module: ir.Module) -> str:
    """The module as TTIR text (what the ``ttir`` stage shows)."""
    with module.context:
        return module.operation.get_asm(enable_debug_info=False)  # type: ignore[no-any-return]


def module_bytecode(module: ir.Module) -> bytes:
    """The module as MLIR bytecode (what XLA's Triton call reads)."""
    buf = io.BytesIO()
    with module.context:
        module.operation.write_bytecode(buf)
    return buf.getvalue()


def _unravel(pid: ir.Value, grid: Sequence[int]) -> list[ir.Value]:
    ids: list[ir.Value] = []
    rest = pid
    for size in reversed(grid):
        ids.append(arith.RemSIOp(rest, tir.i32(size)).result)
        rest = arith.DivSIOp(rest, tir.i32(size)).result
    return list(reversed(ids))


def _eval_index_map(lowering: Lowering, bm: BlockMapping, ids: list[ir.Value]) -> list[ir.Value]:
    jaxpr = bm.index_map
    return lower_jaxpr(lowering, jaxpr.jaxpr, jaxpr.consts, ids)


# --- evaluating a jaxpr into Triton IR -------------------------------------------------------


def _aval_in(eqn: Any, i: int) -> Any:
    return eqn.invars[i].aval


def _aval_out(eqn: Any, i: int = 0) -> Any:
    return eqn.outvars[i].aval


def _bcast(eqn: Any, *vals: ir.Value) -> list[ir.Value]:
    shape = _aval_out(eqn).shape
    return [tir.broadcast_to(v, shape) for v in vals]


# --- elementwise arithmetic ------------------------------------------------------------------


@rule(lax.tanh_p)
def _tanh(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """``sign(x) * (1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` (a Pade approximant near 0):
    Triton has no ``math.tanh``."""
    aval = _aval_in(eqn, 0)
    if not tir.is_float(aval.dtype):
        raise lowering.fail(f"tanh on {aval.dtype}", eqn)
    if np.dtype(aval.dtype).itemsize < 4:
        # The approximant's coefficients (135135) overflow float16: compute in float32.
        x32 = convert(x, aval.dtype, np.float32, aval.shape)
        return convert(_tanh_of(x32, np.float32, aval.shape), np.float32, aval.dtype,
                       aval.shape)
    return _tanh_of(x, aval.dtype, aval.shape)


def _tanh_of(x: ir.Value, dtype: Any, shape: Sequence[int]) -> ir.Value:
    def c(v: float) -> ir.Value:
        return tir.constant(v, dtype, shape)

    def poly(coeffs: Sequence[float], z: ir.Value) -> ir.Value:
        acc = c(coeffs[0])
        for k in coeffs[1:]:
            acc = arith.AddFOp(arith.MulFOp(acc, z).result, c(k)).result
        return acc

    e = mmath.ExpOp(arith.MulFOp(c(-2.0), mmath.AbsFOp(x).result).result).result
    t = arith.DivFOp(arith.SubFOp(c(1.0), e).result, arith.AddFOp(c(1.0), e).result).result
    negative = arith.CmpFOp(arith.CmpFPredicate.OLT, x, c(0.0)).result
    far = arith.SelectOp(negative, arith.NegFOp(t).result, t).result
    # Near zero 1 - e cancels: a [7/6] Pade approximant, accurate to float32 for |x| < 0.5.
    x2 = arith.MulFOp(x, x).result
    near = arith.DivFOp(arith.MulFOp(x, poly([1.0, 378.0, 17325.0, 135135.0], x2)).result,
                        poly([28.0, 3150.0, 62370.0, 135135.0], x2)).result
    small = arith.CmpFOp(arith.CmpFPredicate.OLT, mmath.AbsFOp(x).result, c(0.5)).result
    return arith.SelectOp(small, near, far).result


# --- shapes ------------------------------------------------------------------------------------


@rule(lax.iota_p)
def _iota(lowering: Lowering, eqn: Any, *_: Any) -> ir.Value:
    aval, dim = _aval_out(eqn), eqn.params["dimension"]
    if np.dtype(aval.dtype) != np.int32:
        raise lowering.fail(f"iota of {aval.dtype} (use int32)", eqn)
    line = tir.expand_to_rank(tir.arange(aval.shape[dim]), dim, len(aval.shape))
    return tir.broadcast_to(line, aval.shape)


@rule(lax.broadcast_in_dim_p)
def _broadcast_in_dim(lowering: Lowering, eqn: Any, x: ir.Value, *dyn: ir.Value) -> ir.Value:
    shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    if not tir.shape_of(x):
        return tir.splat(x, shape) if shape else x
    for axis in range(len(shape)):  # insert size-1 dims where x has none
        if axis not in dims:
            x = tt.ExpandDimsOp(x, axis).result
    return tir.broadcast_to(x, shape)


@rule(lax.reshape_p)
def _reshape(lowering: Lowering, eqn: Any, x: ir.Value, *_: Any) -> ir.Value:
    out = _aval_out(eqn)
    if not out.shape or not tir.shape_of(x):
        raise lowering.fail("reshape to or from a scalar", eqn)
    return tt.ReshapeOp(tir.value_type(out.shape, out.dtype), x).result


@rule(lax.squeeze_p)
def _squeeze(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    out = _aval_out(eqn)
    if not out.shape:
        raise lowering.fail("squeezing a tensor to a scalar", eqn)
    return tt.ReshapeOp(tir.value_type(out.shape, out.dtype), x).result


@rule(lax.transpose_p)
def _transpose(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return tt.TransOp(x, list(eqn.params["permutation"])).result


# --- dot and reductions ---------------------------------------------------------------------


@rule(lax.dot_general_p)
def _dot(lowering: Lowering, eqn: Any, a: ir.Value, b: ir.Value) -> ir.Value:
    (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
    a_aval, b_aval, out = _aval_in(eqn, 0), _aval_in(eqn, 1), _aval_out(eqn)
    if ba or bb or len(a_aval.shape) != 2 or len(b_aval.shape) != 2:
        raise lowering.fail("dot_general other than a 2-D matrix product", eqn)
    if tuple(ca) == (0,):
        a = tt.TransOp(a, [1, 0]).result
    if tuple(cb) == (1,):
        b = tt.TransOp(b, [1, 0]).result
    acc_dtype = np.float32 if tir.is_float(out.dtype) else np.int32
    m, n = out.shape
    acc = tir.constant(0, acc_dtype, (m, n))
    precision = str(eqn.params.get("precision"))
    if not tir.is_float(a_aval.dtype) or "HIGHEST" in precision or "F32_F32_F32" in precision:
        input_precision = tt.InputPrecision.IEEE
    elif "TF32_TF32_F32_X3" in precision:
        input_precision = tt.InputPrecision.TF32x3
    else:
        input_precision = tt.InputPrecision.TF32
    if np.dtype(a_aval.dtype).itemsize < 4 and tir.is_float(a_aval.dtype):
        input_precision = tt.InputPrecision.IEEE  # bf16/f16 inputs: tensor cores either way
    res = tt.DotOp(a, b, acc, inputPrecision=input_precision, maxNumImpreciseAcc=0).result
    return convert(res, acc_dtype, out.dtype, out.shape)


# --- grid position and hints -----------------------------------------------------------------


@rule(plb.program_id_p)
def _program_id(lowering: Lowering, eqn: Any) -> ir.Value:
    axis = eqn.params["axis"]
    return lowering.program_ids[lowering.call.grid_mapping.num_batch_axes + axis]


@rule(plb.axis_index_p)
def _axis_index(lowering: Lowering, eqn: Any) -> ir.Value:
    """The program's index along a named grid axis (``grid_names``)."""
    gm = lowering.call.grid_mapping
    name = eqn.params["axis_name"]
    name = name[0] if isinstance(name, tuple) and len(name) == 1 else name
    if not gm.grid_names or name not in gm.grid_names:
        raise lowering.fail(f"lax.axis_index({name!r}) of an axis that is not one of the "
                            f"kernel's grid axes {tuple(gm.grid_names or ())}", eqn)
    return lowering.program_ids[gm.num_batch_axes + gm.grid_names.index(name)]


@rule(plb.multiple_of_p)
def _multiple_of(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return x


# --- memory ----------------------------------------------------------------------------------


UNMASKED_OUT_OF_BOUNDS = "pallas.unmasked_out_of_bounds"
"""The attribute naming an access on the ``arith.andi`` that computes its lanes outside the
array that only this lowering's bounds mask turns off (see :func:`_access`)."""


def _access(lowering: Lowering, eqn: Any, ref: BlockRef, args: Sequence[Any], what: str,
            mask_at: int | None = None) -> tuple[ir.Value, ir.Value | None, tuple[int, ...]]:
    """Pointers to the elements an access of ``ref`` names, its mask, its shape.

    The mask is the kernel's own (``args[mask_at]``, where the access takes one) and the
    array's bounds. JAX's lowering bounds only the dimensions whose blocks do not divide the
    array, where the last block is padded: a lane outside the array in any other dimension is
    an out-of-bounds access on the GPU. This lowering masks it too, so that it reads 0 and
    writes nothing, and marks which lanes those are: a dead ``arith.andi`` of the kernel's
    mask and those lanes, carrying :data:`UNMASKED_OUT_OF_BOUNDS` (the access, for the
    message). Triton's compiler drops the dead value; the checked emulator reports a lane set
    in it (``pl.emulate(..., checked=True)``), as it would report the access in JAX's module.
    """
    ptrs, bounds, outside, shape = _pointers(lowering, eqn, ref, _transforms(eqn, args))
    kernel_mask = None if mask_at is None else tir.broadcast_to(args[mask_at], shape)
    if outside is not None:
        active = kernel_mask if kernel_mask is not None else tir.constant(1, np.bool_, shape)
        marked = arith.AndIOp(outside, active)
        marked.operation.attributes[UNMASKED_OUT_OF_BOUNDS] = ir.StringAttr.get(
            f"{what} of {ref.bm.origin} (shape {tuple(ref.bm.array_shape)}) at "
            f"{lowering.location}")
    return ptrs, _and(bounds, kernel_mask), shape


def _pointers(lowering: Lowering, eqn: Any, ref: BlockRef, transforms: Sequence[Any]
              ) -> tuple[ir.Value, ir.Value | None, ir.Value | None, tuple[int, ...]]:
    """Pointers to the elements ``ref[transforms]`` names, the in-bounds mask, the lanes
    JAX's lowering would access outside the array (outside it in a dimension JAX does not
    bound, inside it in every dimension JAX bounds; see :func:`_access`), the shape.

    The shape is NumPy's: index arrays (broadcast together) give their shape once, where the
    first of them stands if they are neighbours, else in front; slices give theirs in order.
    """
    bm = ref.bm
    if len(transforms) > 1 or (transforms and not isinstance(transforms[0], plb.NDIndexer)):
        raise lowering.fail("Ref transforms other than indexing", eqn)
    kept_dims = [d for d, b in enumerate(bm.block_shape) if b is not None]
    indices: list[Any] = [None] * len(bm.array_shape)
    if transforms:
        for d, idx in zip(kept_dims, transforms[0].indices):
            indices[d] = idx
    arrays = {d: _as_i32(lowering, eqn, indices[d]) for d in kept_dims
              if indices[d] is not None and not isinstance(indices[d], plb.Slice)}
    int_shape = tuple(np.broadcast_shapes(*(tir.shape_of(v) for v in arrays.values())))
    is_int = [d in arrays for d in kept_dims]
    where = [i for i, t in enumerate(is_int) if t]
    pos = where[0] if where and where == list(range(where[0], where[-1] + 1)) else 0
    sizes = [_slice_size(lowering, eqn, indices[d], bm.block_shape[d])
             for d in kept_dims if d not in arrays]
    shape = (*sizes[:pos], *int_shape, *sizes[pos:])
    validation.check_access_shape(f"kernel {lowering.call.name!r} ({lowering.location})",
                                  bm.origin, bm.ref_shape, shape)
    rank = len(shape)
    parts: list[ir.Value] = []  # per array dimension: the element index, scalar or tensor
    n_slices = 0
    for d, b in enumerate(bm.block_shape):
        idx = indices[d]
        if b is None:
            parts.append(ref.starts[d])
        elif d in arrays:
            index = arrays[d]
            if tir.shape_of(index):
                first = pos + len(int_shape) - len(tir.shape_of(index))
                index = arith.AddIOp(tir.splat(ref.starts[d], tir.shape_of(index)),
                                     index).result
                parts.append(tir.expand_to_rank(index, first, rank))
            else:
                parts.append(arith.AddIOp(ref.starts[d], index).result)
        else:
            axis = n_slices if n_slices < pos else n_slices + len(int_shape)
            begin, stride = ref.starts[d], 1
            if isinstance(idx, plb.Slice):
                begin = arith.AddIOp(begin, _as_i32(lowering, eqn, idx.start)).result
                stride = idx.stride
            parts.append(tir.expand_to_rank(_range_from(begin, sizes[n_slices], stride),
                                            axis, rank))
            n_slices += 1
    strides = [math.prod(bm.array_shape[d + 1:]) for d in range(len(bm.array_shape))]
    offset = tir.broadcast_to(tir.i32(0), shape)
    mask: ir.Value | None = None
    outside: ir.Value | None = None  # outside the array in a dimension JAX does not bound
    bounded: ir.Value | None = None  # inside it in every dimension JAX bounds
    for d, part in enumerate(parts):
        part = tir.broadcast_to(part, shape)
        scaled = arith.MulIOp(part, tir.broadcast_to(tir.i32(strides[d]), shape)).result
        offset = arith.AddIOp(offset, scaled).result
        # Unsigned: a negative index is out of bounds too.
        size = tir.broadcast_to(tir.i32(bm.array_shape[d]), shape)
        in_bounds = arith.CmpIOp(arith.CmpIPredicate.ult, part, size).result
        mask = in_bounds if mask is None else arith.AndIOp(mask, in_bounds).result
        block = bm.block_shape[d]
        if block is None or bm.array_shape[d] % block == 0:  # JAX's lowering bounds it not
            out = arith.CmpIOp(arith.CmpIPredicate.uge, part, size).result
            outside = out if outside is None else arith.OrIOp(outside, out).result
        else:
            bounded = _and(bounded, in_bounds)
    if outside is not None and bounded is not None:
        # A lane JAX's own bounds turn off is never accessed there either.
        outside = arith.AndIOp(outside, bounded).result
    ptr_type = ir.RankedTensorType.get(list(shape), ref.ptr.type) if shape else ref.ptr.type
    base = tir.splat(ref.ptr, shape) if shape else ref.ptr
    return tt.AddPtrOp(ptr_type, base, offset).result, mask, outside, shape


def _slice_size(lowering: Lowering, eqn: Any, idx: Any, block: int | None) -> int:
    """The number of elements a slice (or a whole block dimension, for ``None``) takes."""
    if idx is None:
        assert block is not None  # only kept dimensions are sliced
        return block
    if not isinstance(idx.size, int):
        raise lowering.fail("a pl.ds slice of dynamic size", eqn)
    return idx.size


def _range_from(start: ir.Value, size: int, stride: int) -> ir.Value:
    r = tir.arange(size)
    if stride != 1:
        r = arith.MulIOp(r, tir.splat(tir.i32(stride), [size])).result
    return arith.AddIOp(tir.splat(start, [size]), r).result


def _as_i32(lowering: Lowering, eqn: Any, v: Any) -> ir.Value:
    """An index as int32 (Python ints become constants; other integer widths are cast)."""
    if not isinstance(v, ir.Value):
        return tir.i32(int(v))
    width = ir.IntegerType(tir.element_of(v.type)).width
    if width == 32:
        return v
    return convert(v, np.dtype(f"int{width}"), np.int32, tir.shape_of(v))


def _transforms(eqn: Any, args: Sequence[Any]) -> Sequence[Any]:
    tree = eqn.params["tree"]
    return jax.tree_util.tree_unflatten(tree, args[:tree.num_leaves])  # type: ignore[no-any-return]


def _and(a: ir.Value | None, b: ir.Value | None) -> ir.Value | None:
    if a is None:
        return b
    if b is None:
        return a
    return arith.AndIOp(a, b).result


def _load(ptrs: ir.Value, mask: ir.Value | None, other: ir.Value | None, dtype: Any,
          shape: tuple[int, ...]) -> ir.Value:
    """Loads; booleans live in memory as bytes (as XLA stores them) and are compared with 0."""
    if np.dtype(dtype) != np.bool_:
        if mask is None:
            return tt.LoadOp(ptrs).result
        other = other if other is not None else tir.constant(0, dtype, shape)
        return tt.LoadOp(ptrs, mask=mask, other=other).result
    if other is not None:
        other = convert(other, np.bool_, np.int8, shape)
    raw = _load(ptrs, mask, other, np.int8, shape)
    return arith.CmpIOp(arith.CmpIPredicate.ne, raw, tir.constant(0, np.int8, shape)).result


def _store(ptrs: ir.Value, value: ir.Value, mask: ir.Value | None, dtype: Any,
           shape: tuple[int, ...]) -> None:
    value = tir.broadcast_to(value, shape)
    if np.dtype(dtype) == np.bool_:
        value = convert(value, np.bool_, np.int8, shape)
    tt.StoreOp(ptrs, value, mask=mask)


@rule(plb.get_p)
def _get(lowering: Lowering, eqn: Any, ref: BlockRef, *args: Any) -> ir.Value:
    ptrs, mask, shape = _access(lowering, eqn, ref, args, "load")
    return _load(ptrs, mask, None, _aval_out(eqn).dtype, shape)


@rule(plb.masked_load_p)
def _masked_load(lowering: Lowering, eqn: Any, ref: BlockRef, *args: Any) -> ir.Value:
    n = eqn.params["tree"].num_leaves
    ptrs, mask, shape = _access(lowering, eqn, ref, args, "load", mask_at=n)
    other = tir.broadcast_to(args[n + 1], shape) if eqn.params["has_other"] else None
    return _load(ptrs, mask, other, _aval_out(eqn).dtype, shape)


@rule(plb.swap_p)
def _swap(lowering: Lowering, eqn: Any, ref: BlockRef, value: ir.Value, *args: Any) -> ir.Value:
    ptrs, mask, shape = _access(lowering, eqn, ref, args, "store")
    dtype = _aval_out(eqn).dtype
    old = _load(ptrs, mask, None, dtype, shape)
    _store(ptrs, value, mask, dtype, shape)
    return old


@rule(plb.masked_swap_p)
def _masked_swap(lowering: Lowering, eqn: Any, ref: BlockRef, value: ir.Value,
                 *args: Any) -> ir.Value:
    n = eqn.params["tree"].num_leaves
    ptrs, mask, shape = _access(lowering, eqn, ref, args, "store", mask_at=n)
    dtype = _aval_out(eqn).dtype
    old = _load(ptrs, mask, None, dtype, shape)
    _store(ptrs, value, mask, dtype, shape)
    return old


_RMW = {
    plb.AtomicOp.ADD: (tt.RMWOp.FADD, tt.RMWOp.ADD, tt.RMWOp.ADD),
    # Float max/min: see _float_atomic_max_min.
    plb.AtomicOp.MAX: (None, tt.RMWOp.MAX, tt.RMWOp.UMAX),
    plb.AtomicOp.MIN: (None, tt.RMWOp.MIN, tt.RMWOp.UMIN),
    plb.AtomicOp.AND: (None, tt.RMWOp.AND, tt.RMWOp.AND),
    plb.AtomicOp.OR: (None, tt.RMWOp.OR, tt.RMWOp.OR),
    plb.AtomicOp.XOR: (None, tt.RMWOp.XOR, tt.RMWOp.XOR),
    plb.AtomicOp.XCHG: (tt.RMWOp.XCHG, tt.RMWOp.XCHG, tt.RMWOp.XCHG),
}


@rule(plb.atomic_rmw_p)
def _atomic(lowering: Lowering, eqn: Any, ref: BlockRef, value: ir.Value, *args: Any) -> ir.Value:
    n, op = eqn.params["tree"].num_leaves, eqn.params["op"]
    ptrs, mask, shape = _access(lowering, eqn, ref, args, f"atomic_{op.value}",
                                mask_at=n if eqn.params["has_mask"] else None)
    dtype = _aval_out(eqn).dtype
    value = tir.broadcast_to(value, shape)
    if tir.is_float(dtype) and op in (plb.AtomicOp.MAX, plb.AtomicOp.MIN):
        if np.dtype(dtype) != np.float32:
            raise lowering.fail(f"atomic_{op.value} on {dtype} (float32 only)", eqn)
        return _float_atomic_max_min(ptrs, value, mask, shape, op is plb.AtomicOp.MAX)
    kinds = _RMW[op]
    kind = kinds[0] if tir.is_float(dtype) else (kinds[2] if tir.is_unsigned(dtype)
                                                   else kinds[1])
    if kind is None:
        raise lowering.fail(f"atomic_{op.value} on {dtype}", eqn)
    return _rmw(kind, ptrs, value, mask, tir.value_type(shape, dtype))


def _rmw(kind: Any, ptrs: ir.Value, value: ir.Value, mask: ir.Value | None,
         result: ir.Type) -> ir.Value:
    return tt.AtomicRMWOp(result, kind, ptrs, value, tt.MemSemantic.ACQUIRE_RELEASE,
                          tt.MemSyncScope.GPU, mask=mask).result


def _float_atomic_max_min(ptrs: ir.Value, value: ir.Value, mask: ir.Value | None,
                          shape: tuple[int, ...], is_max: bool) -> ir.Value:
    """Float32 max/min through integer atomics on the bit patterns.

    Non-negative floats order like their bits as signed ints, negative floats in reverse of
    their bits as unsigned ints: max takes a signed-int max for non-negative values and an
    unsigned-int min for negative ones (min the other way round); the old value comes from
    whichever ran.
    """
    i32 = tir.value_type(shape, np.int32)
    int_ptrs = tt.BitcastOp(ir.RankedTensorType.get(
        list(shape), tir.pointer(np.int32)) if shape else tir.pointer(np.int32), ptrs).result
    bits = tt.BitcastOp(i32, value).result
    non_negative = arith.CmpIOp(arith.CmpIPredicate.sge, bits,
                                tir.constant(0, np.int32, shape)).result
    negative = arith.XOrIOp(non_negative, tir.constant(1, np.bool_, shape)).result
    signed_kind, unsigned_kind = ((tt.RMWOp.MAX, tt.RMWOp.UMIN) if is_max
                                  else (tt.RMWOp.MIN, tt.RMWOp.UMAX))
    old_pos = _rmw(signed_kind, int_ptrs, bits, _and(mask, non_negative), i32)
    old_neg = _rmw(unsigned_kind, int_ptrs, bits, _and(mask, negative), i32)
    old = arith.SelectOp(non_negative, old_pos, old_neg).result
    return tt.BitcastOp(tir.value_type(shape, np.float32), old).result


@rule(plb.addupdate_p)
def _addupdate(lowering: Lowering, eqn: Any, ref: BlockRef, value: ir.Value,
               *args: Any) -> list[Any]:
    """``ref[idx] += value`` as an atomic add, as JAX's Triton lowering has it: programs that
    add to one element do not lose each other's sums."""
    ptrs, mask, shape = _access(lowering, eqn, ref, args, "addition")
    dtype = eqn.invars[1].aval.dtype
    if np.dtype(dtype) == np.bool_:
        raise lowering.fail("adding to a Ref of bool", eqn)
    kind = tt.RMWOp.FADD if tir.is_float(dtype) else tt.RMWOp.ADD
    _rmw(kind, ptrs, tir.broadcast_to(value, shape), mask, tir.value_type(shape, dtype))
    return []


@rule(plb.atomic_cas_p)
def _atomic_cas(lowering: Lowering, eqn: Any, ref: BlockRef, cmp: ir.Value, value: ir.Value,
                *args: Any) -> ir.Value:
    ptrs, mask, shape = _access(lowering, eqn, ref, args, "atomic_cas")
    result = tir.value_type(shape, _aval_out(eqn).dtype)
    cmp, value = tir.broadcast_to(cmp, shape), tir.broadcast_to(value, shape)
    if mask is not None:
        # tt.atomic_cas takes no mask: lanes outside the array are pointed at the array's
        # first element and swap `cmp` for `cmp`, which leaves memory as it was.
        base = tir.splat(ref.ptr, shape) if shape else ref.ptr
        ptrs = arith.SelectOp(mask, ptrs, base).result
        value = arith.SelectOp(mask, value, cmp).result
    return tt.AtomicCASOp(result, ptrs, cmp, value, tt.MemSemantic.ACQUIRE_RELEASE,
                          tt.MemSyncScope.GPU).result


# --- printing and the Triton-only primitives -------------------------------------------------


@rule(plb.debug_print_p)
def _debug_print(lowering: Lowering, eqn: Any, *args: ir.Value) -> list[Any]:
    fmt = eqn.params["fmt"]
    parts = fmt.split("{}")
    if any(p.strip() for p in parts[1:]):
        raise lowering.fail(f"pl.debug_print({fmt!r}) with values other than at the end "
                            "(Triton prints a prefix, then the values)", eqn)
    signed = [0 if tir.is_unsigned(v.aval.dtype) else 1 for v in eqn.invars]
    tt.PrintOp(parts[0], False, list(args), signed)
    return []


@rule(tprims.approx_tanh_p)
def _approx_tanh(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    aval = _aval_in(eqn, 0)
    if lowering.platform == "rocm":
        return _tanh(lowering, eqn, x)  # AMD GPUs have no tanh.approx: the exact one
    if np.dtype(aval.dtype) != np.float32:
        x32 = convert(x, aval.dtype, np.float32, aval.shape)
        return convert(_tanh_asm(x32, aval.shape), np.float32, aval.dtype, aval.shape)
    return _tanh_asm(x, aval.shape)


def _tanh_asm(x: ir.Value, shape: Sequence[int]) -> ir.Value:
    result = tir.value_type(shape, np.float32)
    op = tt.ElementwiseInlineAsmOp([result], "tanh.approx.f32 $0, $1;", "=r,r", True, 1, [x])
    return op.results[0]


@rule(tprims.inline_asm_p)
def _inline_asm(lowering: Lowering, eqn: Any, *args: ir.Value) -> list[Any]:
    shape = _aval_out(eqn).shape
    types = [tir.value_type(s.shape, s.dtype) for s in eqn.params["result_shape_dtypes"]]
    op = tt.ElementwiseInlineAsmOp(types, eqn.params["asm"], eqn.params["constraints"], True,
                                   eqn.params["pack"], [tir.broadcast_to(a, shape) for a in args])
    return list(op.results)


@rule(tprims.max_contiguous_p)
def _max_contiguous(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return x  # a hint only; Triton's own analysis sees aranges directly


@rule(tprims.debug_barrier_p)
def _debug_barrier(lowering: Lowering, eqn: Any) -> list[Any]:
    gpu.BarrierOp()
    return []


def lowering_rules() -> Mapping[Any, plb.Rule]:
    """Triton's full rule table, read-only: the shared rules, Triton's own above and the
    whole-array rules of :mod:`pallas_triton.lowering_arrays`; every entry has the one rule
    signature (``pallas_core.backend.Rule``)."""
    return types.MappingProxyType(RULES)
