"""Small helpers over jaxlib's MLIR bindings and its Triton (``tt``) dialect.

Values are MLIR values: JAX scalars (shape ``()``) are plain scalars (``i32``, ``f32``), arrays
are ranked tensors. Helpers take care of splatting scalars and broadcasting tensors so that
elementwise rules can combine any two operands of one JAX shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir._mlir_libs import _jax_mlir_ext
from jaxlib.mlir.dialects import arith
from jaxlib.triton import dialect as tt

from pallas_core.backend import (  # noqa: F401 - re-exported for the rules
    UnsupportedError,
    is_float,
    is_unsigned,
)
from pallas_core.backend import mlir_element_type as element_type


def new_context() -> ir.Context:
    """A fresh MLIR context with the Triton dialect, and the upstream dialects jaxlib ships
    (``gpu`` for barriers), loaded."""
    ctx = ir.Context()
    tt.register_dialect(ctx)
    registry = ir.DialectRegistry()
    _jax_mlir_ext.register_dialects(registry)
    ctx.append_dialect_registry(registry)
    ctx.load_all_available_dialects()
    return ctx


def value_type(shape: Sequence[int], dtype: Any) -> ir.Type:
    """The type of a JAX value: a scalar for shape ``()``, else a ranked tensor."""
    elt = element_type(dtype)
    return ir.RankedTensorType.get(list(shape), elt) if shape else elt


def pointer(dtype: Any) -> ir.Type:
    """``!tt.ptr`` to elements of ``dtype`` in global memory (booleans are stored as bytes)."""
    if np.dtype(dtype) == np.bool_:
        return tt.PointerType.get(ir.IntegerType.get_signless(8), 1)
    return tt.PointerType.get(element_type(dtype), 1)


def is_tensor(t: ir.Type) -> bool:
    return t.typeid == ir.RankedTensorType.static_typeid  # type: ignore[no-any-return]


def shape_of(v: ir.Value) -> tuple[int, ...]:
    t = v.type
    return tuple(ir.RankedTensorType(t).shape) if is_tensor(t) else ()


def element_of(t: ir.Type) -> ir.Type:
    return ir.RankedTensorType(t).element_type if is_tensor(t) else t


def constant(value: Any, dtype: Any, shape: Sequence[int] = ()) -> ir.Value:
    """A constant of ``dtype`` (a scalar, or splat to ``shape``)."""
    elt = element_type(dtype)
    if is_float(dtype):
        attr: ir.Attribute = ir.FloatAttr.get(elt, float(value))
    else:
        attr = ir.IntegerAttr.get(elt, int(value))
    scalar = arith.ConstantOp(elt, attr).result
    return splat(scalar, shape) if shape else scalar


def i32(value: int) -> ir.Value:
    return constant(value, np.int32)


def splat(scalar: ir.Value, shape: Sequence[int]) -> ir.Value:
    return tt.SplatOp(ir.RankedTensorType.get(list(shape), scalar.type), scalar).result


def broadcast_to(v: ir.Value, shape: Sequence[int]) -> ir.Value:
    """``v`` (a scalar, or a tensor whose dims are 1 or equal) broadcast to ``shape``."""
    shape = tuple(shape)
    have = shape_of(v)
    if have == shape:
        return v
    if not have:
        return splat(v, shape) if shape else v
    if len(have) != len(shape):
        raise UnsupportedError(f"broadcasting a value of shape {have} to {shape} in Triton")
    out = ir.RankedTensorType.get(list(shape), element_of(v.type))
    return tt.BroadcastOp(out, v).result


def expand_to_rank(v: ir.Value, axis: int, rank: int) -> ir.Value:
    """A 1-D tensor placed along ``axis`` of a rank-``rank`` tensor (size 1 elsewhere)."""
    for _ in range(axis):
        v = tt.ExpandDimsOp(v, 0).result
    while len(shape_of(v)) < rank:
        v = tt.ExpandDimsOp(v, len(shape_of(v))).result
    return v


def arange(n: int) -> ir.Value:
    return tt.MakeRangeOp(ir.RankedTensorType.get([n], ir.IntegerType.get_signless(32)),
                          0, n).result
