"""jaxlib's MLIR bindings with the Mosaic ``tpu`` dialect: contexts, types, serialisation."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir, passmanager
from jaxlib.mlir._mlir_libs import _jax_mlir_ext
from jaxlib.mlir.dialects import arith, vector
from jaxlib.mosaic.python import tpu

from pallas_core import backend as plb
from pallas_core.backend import (  # noqa: F401 - re-exported for the rules
    is_float,
    is_unsigned,
)
from pallas_core.backend import mlir_element_type as element_type


def new_context() -> ir.Context:
    """A fresh context with the upstream dialects jaxlib ships and Mosaic's ``tpu`` dialect."""
    registry = ir.DialectRegistry()
    _jax_mlir_ext.register_dialects(registry)
    ctx = ir.Context()
    ctx.append_dialect_registry(registry)
    ctx.load_all_available_dialects()
    tpu.register_dialect(ctx)
    return ctx


def serialize(module: ir.Module) -> bytes:
    """The module in Mosaic's stable serialised form (MLIR bytecode), as TPU runtimes read it."""
    with module.context:
        copy = ir.Module.parse(module.operation.get_asm(binary=True))
        module.context.allow_unregistered_dialects = True
        try:
            passmanager.PassManager.parse(
                "builtin.module(mosaic-serde{serialize=true "
                f"target-version={plb.mosaic_serde_version()}}})"
            ).run(copy.operation)
            buf = io.BytesIO()
            copy.operation.write_bytecode(buf, desired_version=0)
        finally:
            module.context.allow_unregistered_dialects = False
    return buf.getvalue()


def has_communication(module: ir.Module) -> bool:
    """Whether the kernel talks to other devices (remote DMAs or signals, barrier semaphore),
    which the ``tpu_custom_call`` must declare."""
    with module.context:
        return bool(tpu.private_has_communication(module.operation)[0])


def _parse_serialized(body: bytes) -> ir.Module:
    """A serialised Mosaic module (base64 of the bytecode, or the bytecode) parsed as stored,
    in a fresh context that still allows the unregistered ``stable_mosaic`` forms."""
    if not body.startswith(b"ML\xefR"):
        body = base64.b64decode(body)
    ctx = new_context()
    ctx.allow_unregistered_dialects = True
    with ctx, ir.Location.unknown():
        return ir.Module.parse(body)


def serialized_version(body: bytes) -> int:
    """The Mosaic format version a serialised module declares (``stable_mosaic.version``)."""
    module = _parse_serialized(body)
    with module.context:
        return int(ir.IntegerAttr(module.operation.attributes["stable_mosaic.version"]).value)


def deserialize(body: bytes) -> ir.Module:
    """A serialised Mosaic module (base64 of the bytecode, or the bytecode) parsed and verified
    in a fresh context."""
    module = _parse_serialized(body)
    with module.context, ir.Location.unknown():
        passmanager.PassManager.parse(
            "builtin.module(mosaic-serde{serialize=false})").run(module.operation)
        module.context.allow_unregistered_dialects = False
        module.operation.verify()
    return module


def value_type(shape: Sequence[int], dtype: Any) -> ir.Type:
    """A scalar for shape ``()``, else a vector."""
    elt = element_type(dtype)
    return ir.VectorType.get(list(shape), elt) if shape else elt


def memory_space(name: str) -> ir.Attribute:
    return ir.Attribute.parse(f"#tpu.memory_space<{name}>")


def memref(shape: Sequence[int], dtype: Any, space: str) -> ir.Type:
    elt = element_type(np.int32 if np.dtype(dtype) == np.bool_ else dtype)
    return ir.MemRefType.get(list(shape), elt, memory_space=memory_space(space))


def shape_of(v: ir.Value) -> tuple[int, ...]:
    if v.type.typeid == ir.VectorType.static_typeid:
        return tuple(ir.VectorType(v.type).shape)
    return ()


def constant(value: Any, dtype: Any, shape: Sequence[int] = ()) -> ir.Value:
    """A constant scalar, or a splat vector of ``shape``."""
    elt = element_type(dtype)
    if shape:
        attr: ir.Attribute = ir.DenseElementsAttr.get_splat(
            ir.VectorType.get(list(shape), elt),
            ir.FloatAttr.get(elt, float(value)) if is_float(dtype)
            else ir.IntegerAttr.get(elt, int(value)))
        return arith.ConstantOp(ir.VectorType.get(list(shape), elt), attr).result
    attr = ir.FloatAttr.get(elt, float(value)) if is_float(dtype) else ir.IntegerAttr.get(
        elt, int(value))
    return arith.ConstantOp(elt, attr).result


def index(v: ir.Value | int) -> ir.Value:
    """``v`` (an i32 scalar or a Python int) as an MLIR ``index``."""
    if isinstance(v, int):
        return arith.ConstantOp(ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(),
                                                                        v)).result
    return arith.IndexCastOp(ir.IndexType.get(), v).result


def broadcast_to(v: ir.Value, shape: Sequence[int]) -> ir.Value:
    """A scalar splat to, or a vector (dims 1 or equal) broadcast to, ``shape``."""
    shape = tuple(shape)
    if shape_of(v) == shape or not shape:
        return v
    elt = v.type if not shape_of(v) else ir.VectorType(v.type).element_type
    return vector.BroadcastOp(ir.VectorType.get(list(shape), elt), v).result


def memory_dtype(dtype: Any) -> Any:
    """The dtype a value of ``dtype`` has in memory: booleans are int32 (0 or 1), as JAX lays
    them out."""
    return np.int32 if np.dtype(dtype) == np.bool_ else dtype


def from_memory(v: ir.Value, dtype: Any) -> ir.Value:
    """``v`` as read from memory, as a value of ``dtype`` (a boolean is ``v != 0``)."""
    if np.dtype(dtype) != np.bool_:
        return v
    return arith.CmpIOp(arith.CmpIPredicate.ne, v, constant(0, np.int32, shape_of(v))).result


def to_memory(v: ir.Value, dtype: Any) -> ir.Value:
    """``v`` (of ``dtype``) as written to memory (a boolean becomes 0 or 1)."""
    if np.dtype(dtype) != np.bool_:
        return v
    return arith.ExtUIOp(value_type(shape_of(v), np.int32), v).result


def bit_width(t: ir.Type) -> int:
    """The bit width of a scalar MLIR type (integers and floats)."""
    try:
        return int(ir.IntegerType(t).width)
    except ValueError:
        return int(ir.FloatType(t).width)
