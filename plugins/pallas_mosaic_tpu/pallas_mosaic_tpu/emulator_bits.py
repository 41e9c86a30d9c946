"""Emulator rules (numpy) for the ``tpu`` ops of ``pltpu``'s bit helpers and hints:
``tpu.pack_elementwise``, ``tpu.unpack_elementwise`` and ``tpu.trace_value`` (which records
nothing here). Their meaning is the one :mod:`pallas_mosaic_tpu.elementwise` documents."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir

from pallas_core.backend import EmulatorCompiler, EmulatorRule, bit_width, dtype_of
from pallas_mosaic_tpu.emulator_ops import _unsupported, int_attribute

_Fn = Callable[..., Any]


def _type_attr(op: ir.Operation, name: str) -> ir.Type:
    return ir.TypeAttr(op.attributes[name]).value


def _bits(x: np.ndarray) -> np.ndarray:
    """``x``'s bits as unsigned integers of its width."""
    return np.ascontiguousarray(x).view(f"uint{x.dtype.itemsize * 8}")


def _pack(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    target = _type_attr(op, "target_type")
    part = bit_width(target)
    out = dtype_of(op.results[0].type)
    width = out.itemsize * 8
    floats = not isinstance(target, ir.IntegerType)
    if floats and str(target) != "bf16":
        raise _unsupported(op, f"packing into {target}")

    def run(*xs: Any) -> Any:
        word = np.zeros(np.shape(xs[0]), f"uint{width}")
        for i, x in enumerate(xs):
            x = np.asarray(x)
            field = (_bits(x.astype(ml_dtypes.bfloat16)) if floats else _bits(x)).astype(
                word.dtype) & np.array((1 << part) - 1, word.dtype)
            word |= field << np.array(i * part, word.dtype)
        return word.view(out)
    return run


def _unpack(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    source = _type_attr(op, "source_type")
    part = bit_width(source)
    index = int_attribute(op, "index")
    out = dtype_of(op.results[0].type)
    if not isinstance(source, ir.IntegerType) and str(source) != "bf16":
        raise _unsupported(op, f"unpacking {source}")

    def run(x: Any) -> Any:
        x = np.asarray(x)
        field = (_bits(x).astype(np.int64) >> (index * part)) & ((1 << part) - 1)
        if isinstance(source, ir.IntegerType):  # Mosaic's integers are signed
            value = np.where(field >= 1 << (part - 1), field - (1 << part), field)
            return value.astype(out)
        return field.astype(np.uint16).view(ml_dtypes.bfloat16).astype(out)
    return run


def _trace_value(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    return lambda value: None


RULES: dict[str, EmulatorRule] = {
    "tpu.pack_elementwise": _pack, "tpu.unpack_elementwise": _unpack,
    "tpu.trace_value": _trace_value,
}
"""The rules this module adds to the TensorCore emulator."""
