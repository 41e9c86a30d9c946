"""Triton's rules for whole-array operations: equal-rank broadcasts, joining and splitting
arrays, reductions to an index and cumulative reductions.

Triton has no general concatenate (``tt.cat`` may reorder elements), so joining arrays is built
from ``tt.join`` (two tensors side by side along a new last axis of size 2), a transpose that
moves that axis in front of the joined one, and a reshape merging the two; ``tt.split`` undoes
it. Any power-of-two number of equal-shaped pieces joins or splits along any axis this way.
``argmax``/``argmin`` are a ``tt.reduce`` over (value, index) pairs, and the cumulative
reductions a ``tt.scan``. Registered into :data:`pallas_triton.registry.RULES`; imported by
:mod:`pallas_triton.lowering`, so the table is full once that is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith
from jaxlib.triton import dialect as tt

from pallas_core import backend as plb
from pallas_triton import ir as tir
from pallas_triton.registry import Lowering, convert, rule


def _out(eqn: Any, i: int = 0) -> Any:
    return eqn.outvars[i].aval


def _reshape(x: ir.Value, shape: Sequence[int], dtype: Any) -> ir.Value:
    if tuple(shape) == tir.shape_of(x):
        return x
    if not shape:
        return tt.UnsplatOp(x).result
    if not tir.shape_of(x):
        return tir.splat(x, shape)
    return tt.ReshapeOp(tir.value_type(shape, dtype), x).result


# --- broadcasts ------------------------------------------------------------------------------


@rule(plb.broadcast_to_p)
def _broadcast_to(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """NumPy's broadcast: missing leading dimensions added, then dimensions of 1 repeated."""
    shape = tuple(eqn.params["shape"])
    if not tir.shape_of(x):
        return tir.broadcast_to(x, shape)
    while len(tir.shape_of(x)) < len(shape):
        x = tt.ExpandDimsOp(x, 0).result
    return tir.broadcast_to(x, shape)


# --- joining and splitting -------------------------------------------------------------------


def _pairs(lowering: Lowering, eqn: Any, n: int, what: str) -> None:
    if n & (n - 1) or n == 0:
        raise lowering.fail(f"{what} of {n} pieces (Triton joins and splits a power of two of "
                            "equal-shaped pieces)", eqn)


def _join(a: ir.Value, b: ir.Value, axis: int, dtype: Any) -> ir.Value:
    """``a`` and ``b`` (one shape) concatenated along ``axis``."""
    shape = list(tir.shape_of(a))
    joined = tt.JoinOp(tir.value_type([*shape, 2], dtype), a, b).result
    rank = len(shape)
    order = [*range(axis), rank, *range(axis, rank)]  # the new axis just before `axis`
    moved = tt.TransOp(joined, order).result if axis != rank else joined
    out = [*shape[:axis], 2 * shape[axis] if axis < rank else 2, *shape[axis + 1:]]
    return _reshape(moved, out, dtype)


def _halve(x: ir.Value, axis: int, dtype: Any) -> tuple[ir.Value, ir.Value]:
    """The two halves of ``x`` along ``axis``."""
    shape = list(tir.shape_of(x))
    rank = len(shape)
    pairs = _reshape(x, [*shape[:axis], 2, shape[axis] // 2, *shape[axis + 1:]], dtype)
    order = [*range(axis), *range(axis + 1, rank + 1), axis]  # the pair axis last
    last = tt.TransOp(pairs, order).result
    half = [*shape[:axis], shape[axis] // 2, *shape[axis + 1:]]
    split = tt.SplitOp(last, results=[tir.value_type(half, dtype)] * 2)
    return split.results[0], split.results[1]


def _join_all(pieces: Sequence[ir.Value], axis: int, dtype: Any) -> ir.Value:
    while len(pieces) > 1:
        pieces = [_join(a, b, axis, dtype) for a, b in zip(pieces[::2], pieces[1::2])]
    return pieces[0]


def _split_all(x: ir.Value, parts: int, axis: int, dtype: Any) -> list[ir.Value]:
    pieces = [x]
    while len(pieces) < parts:
        pieces = [h for p in pieces for h in _halve(p, axis, dtype)]
    return pieces


@rule(lax.concatenate_p)
def _concatenate(lowering: Lowering, eqn: Any, *xs: ir.Value) -> ir.Value:
    avals = [v.aval for v in eqn.invars]
    if len({a.shape for a in avals}) != 1:
        raise lowering.fail("concatenating arrays of different shapes "
                            f"{[a.shape for a in avals]}", eqn)
    _pairs(lowering, eqn, len(xs), "concatenate")
    return _join_all(xs, eqn.params["dimension"], _out(eqn).dtype)


@rule(plb.stack_p)
def _stack(lowering: Lowering, eqn: Any, *xs: ir.Value) -> ir.Value:
    _pairs(lowering, eqn, len(xs), "stack")
    axis, dtype = eqn.params["axis"], _out(eqn).dtype
    shape = list(eqn.invars[0].aval.shape)
    ones = [_reshape(x, [*shape[:axis], 1, *shape[axis:]], dtype) for x in xs]
    return _join_all(ones, axis, dtype)


@rule(lax.split_p)
def _split(lowering: Lowering, eqn: Any, x: ir.Value) -> list[ir.Value]:
    sizes, axis = eqn.params["sizes"], eqn.params["axis"]
    if len(set(sizes)) != 1:
        raise lowering.fail(f"split into unequal sizes {tuple(sizes)}", eqn)
    _pairs(lowering, eqn, len(sizes), "split")
    return _split_all(x, len(sizes), axis, _out(eqn).dtype)


@rule(plb.unstack_p)
def _unstack(lowering: Lowering, eqn: Any, x: ir.Value) -> list[ir.Value]:
    axis, dtype = eqn.params["axis"], _out(eqn).dtype
    _pairs(lowering, eqn, len(eqn.outvars), "unstack")
    pieces = _split_all(x, len(eqn.outvars), axis, dtype)
    return [_reshape(p, _out(eqn).shape, dtype) for p in pieces]


# --- reductions to an index ------------------------------------------------------------------


def _argreduce(lowering: Lowering, eqn: Any, x: ir.Value, is_max: bool) -> ir.Value:
    """The first index of the largest (smallest) value along the axis; NaN counts as the
    largest and the smallest, as ``jnp.argmax``/``jnp.argmin`` have it."""
    (axis,) = eqn.params["axes"]
    aval, out = eqn.invars[0].aval, _out(eqn)
    shape = aval.shape
    idx = tir.broadcast_to(tir.expand_to_rank(tir.arange(shape[axis]), axis, len(shape)), shape)
    red = tt.ReduceOp([x, idx], axis)
    elt, i32 = tir.element_type(aval.dtype), tir.element_type(np.int32)
    body = red.regions[0].blocks.append(elt, i32, elt, i32)
    with ir.InsertionPoint(body):
        a, ia, b, ib = body.arguments
        better, tie = _better(a, b, aval.dtype, is_max)
        earlier = arith.CmpIOp(arith.CmpIPredicate.slt, ia, ib).result
        take_a = arith.OrIOp(better, arith.AndIOp(tie, earlier).result).result
        tt.ReduceReturnOp([arith.SelectOp(take_a, a, b).result,
                           arith.SelectOp(take_a, ia, ib).result])
    index = red.results[1]
    return convert(index, np.int32, out.dtype, out.shape)


def _better(a: ir.Value, b: ir.Value, dtype: Any, is_max: bool) -> tuple[ir.Value, ir.Value]:
    """Whether ``a`` beats ``b`` strictly, and whether they tie."""
    if not tir.is_float(dtype):
        pred = ("u" if tir.is_unsigned(dtype) else "s") + ("gt" if is_max else "lt")
        beats = arith.CmpIOp(getattr(arith.CmpIPredicate, pred), a, b).result
        return beats, arith.CmpIOp(arith.CmpIPredicate.eq, a, b).result
    f = arith.CmpFPredicate
    beats = arith.CmpFOp(f.OGT if is_max else f.OLT, a, b).result
    a_nan = arith.CmpFOp(f.UNO, a, a).result
    b_nan = arith.CmpFOp(f.UNO, b, b).result
    b_num = arith.XOrIOp(b_nan, arith.ConstantOp(b_nan.type, 1).result).result
    beats = arith.OrIOp(beats, arith.AndIOp(a_nan, b_num).result).result
    tie = arith.OrIOp(arith.CmpFOp(f.OEQ, a, b).result,
                      arith.AndIOp(a_nan, b_nan).result).result
    return beats, tie


@rule(lax.argmax_p)
def _argmax(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return _argreduce(lowering, eqn, x, True)


@rule(lax.argmin_p)
def _argmin(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return _argreduce(lowering, eqn, x, False)


# --- cumulative reductions -------------------------------------------------------------------

_CUMULATIVE = {lax.cumsum_p: "add", lax.cumprod_p: "mul", lax.cummax_p: "max",
               lax.cummin_p: "min"}


@rule(*_CUMULATIVE)
def _cumulative(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """A ``tt.scan`` along the axis (from its end when ``reverse``)."""
    kind, dtype = _CUMULATIVE[eqn.primitive], eqn.invars[0].aval.dtype
    if np.dtype(dtype) == np.bool_:  # JAX itself refuses these
        raise lowering.fail(f"{eqn.primitive.name} on bool", eqn)
    if kind == "mul":
        combine = arith.MulFOp if tir.is_float(dtype) else arith.MulIOp
    else:
        combine = plb.reduction_op(kind, dtype)
    if not tir.shape_of(x):
        return x
    scan = tt.ScanOp([x], eqn.params["axis"], bool(eqn.params["reverse"]))
    elt = tir.element_type(dtype)
    body = scan.regions[0].blocks.append(elt, elt)
    with ir.InsertionPoint(body):
        tt.ScanReturnOp([combine(*body.arguments).result])
    return scan.results[0]
