"""MLIR types as numpy: element types to dtypes, shaped types to shapes, attributes to arrays.

Values in the emulator are numpy arrays (0-d for scalars). Integers are held in the signed
numpy type of their width (MLIR's integers are signless); an operation that reads them as
unsigned views them with :func:`unsigned`. ``index`` is ``int64``; ``i1`` is ``bool``.
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir

from pallas_core.errors import UnsupportedError

_FLOATS: dict[str, Any] = {
    "f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2,
    "f8E4M3B11FNUZ": ml_dtypes.float8_e4m3b11fnuz, "f8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "f8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz, "f8E4M3": ml_dtypes.float8_e4m3,
    "f8E3M4": ml_dtypes.float8_e3m4, "f4E2M1FN": ml_dtypes.float4_e2m1fn,
    "f8E8M0FNU": ml_dtypes.float8_e8m0fnu,
}
_SIGNED = {1: np.bool_, 4: ml_dtypes.int4, 8: np.int8, 16: np.int16, 32: np.int32,
           64: np.int64, 2: ml_dtypes.int2}
_UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64, 4: ml_dtypes.uint4,
             2: ml_dtypes.uint2}


def element_type(t: ir.Type) -> ir.Type:
    """The element type of a shaped type (vector, tensor, memref), or ``t`` itself."""
    if isinstance(t, ir.ShapedType):
        return ir.ShapedType(t).element_type
    return t


def shape_of(t: ir.Type) -> tuple[int, ...]:
    """The static shape of a shaped type; ``()`` for a scalar type."""
    if isinstance(t, ir.ShapedType):
        st = ir.ShapedType(t)
        if not st.has_static_shape:
            raise UnsupportedError(f"emulating a value of dynamic shape {t} is not supported")
        return tuple(st.shape)
    return ()


def dtype_of(t: ir.Type) -> np.dtype:
    """The numpy dtype holding values of ``t`` (an element type or a shaped type)."""
    e = element_type(t)
    if isinstance(e, ir.IndexType):
        return np.dtype(np.int64)
    if isinstance(e, ir.IntegerType):
        width = ir.IntegerType(e).width
        table = _UNSIGNED if ir.IntegerType(e).is_unsigned else _SIGNED
        if width in table:
            return np.dtype(table[width])
    else:
        key = str(e)
        if key in _FLOATS:
            return np.dtype(_FLOATS[key])
    raise UnsupportedError(f"the emulator has no numpy type for the MLIR type {e}")


def bit_width(t: ir.Type) -> int:
    """The bit width of ``t``'s element type (64 for ``index``)."""
    e = element_type(t)
    if isinstance(e, ir.IndexType):
        return 64
    if isinstance(e, ir.IntegerType):
        return int(ir.IntegerType(e).width)
    return int(np.dtype(dtype_of(e)).itemsize * 8) if str(e) not in ("f4E2M1FN",) else 4


def is_float_type(t: ir.Type) -> bool:
    """Whether ``t``'s element type is a floating-point type."""
    return isinstance(element_type(t), ir.FloatType)


def unsigned(x: np.ndarray) -> np.ndarray:
    """``x`` (a signed or bool array) viewed as the unsigned integers of the same width."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return x.astype(np.uint8)
    if x.dtype.kind == "u":
        return x
    if x.dtype == ml_dtypes.int4:
        return x.astype(np.int8).astype(np.uint8) & np.uint8(0xF)
    if x.dtype == ml_dtypes.int2:
        return x.astype(np.int8).astype(np.uint8) & np.uint8(0x3)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def signed(x: np.ndarray, like: np.dtype) -> np.ndarray:
    """Unsigned integers ``x`` wrapped into the signed dtype ``like`` of the same width."""
    x = np.asarray(x)
    like = np.dtype(like)
    if like == np.bool_:
        return (x & 1).astype(np.bool_)
    if like.itemsize == x.dtype.itemsize and like.kind == "i":
        return x.view(like)
    return x.astype(like)


def attribute_array(attr: ir.Attribute, t: ir.Type) -> np.ndarray:
    """The value of a constant attribute (``IntegerAttr``, ``FloatAttr``, dense elements)
    as an array of ``t``'s dtype and shape."""
    dtype = dtype_of(t)
    shape = shape_of(t)
    if isinstance(attr, ir.IntegerAttr):
        v = ir.IntegerAttr(attr).value
        return _int_scalar(v, dtype, shape)
    if isinstance(attr, ir.FloatAttr):
        return np.full(shape, ir.FloatAttr(attr).value, dtype=np.float64).astype(dtype)
    if isinstance(attr, ir.BoolAttr):
        return np.full(shape, ir.BoolAttr(attr).value, dtype=np.bool_)
    if isinstance(attr, ir.DenseElementsAttr):
        dense = ir.DenseElementsAttr(attr)
        if dense.is_splat:
            return np.broadcast_to(attribute_array(dense.get_splat_value(), element_type(t)),
                                   shape).copy()
        if (dtype.kind in "biuf" and dtype.itemsize in (1, 2, 4, 8) and dtype != np.float16) \
                or dtype == np.float16:
            try:
                return np.array(dense).astype(dtype).reshape(shape)
            except (TypeError, ValueError, RuntimeError):
                pass
        return _dense_from_text(str(dense), dtype, shape)
    raise UnsupportedError(f"the emulator cannot read the constant attribute {attr}")


def _int_scalar(v: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == np.bool_:
        return np.full(shape, bool(v & 1), dtype=np.bool_)
    bits = dtype.itemsize * 8
    v &= (1 << bits) - 1
    if dtype.kind == "i" and v >= 1 << (bits - 1):
        v -= 1 << bits
    return np.full(shape, v, dtype=dtype)


def _dense_from_text(text: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A dense attribute of a type numpy's buffer protocol lacks (bfloat16, float8), read
    from its printed form: a hex blob of the raw little-endian data, or a nested list."""
    body = text[text.index("<") + 1:text.rindex(">")]
    body = body.rsplit(":", 1)[0] if body.startswith('"') is False and ":" in body else body
    if body.startswith('"0x'):
        raw = bytes.fromhex(body[3:body.index('"', 1)])
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    numbers = re.findall(r"[-+]?(?:0x[0-9A-Fa-f]+|[0-9.]+(?:e[-+]?[0-9]+)?|inf|nan)|true|false",
                         body.split(">")[0])
    bits = np.dtype(f"u{dtype.itemsize}") if dtype.itemsize in (1, 2, 4, 8) else None
    out = np.empty(len(numbers), dtype=dtype)
    for i, n in enumerate(numbers):
        if n.startswith("0x") and dtype.kind not in "biu" and bits is not None:
            out[i] = np.array(int(n, 16), dtype=bits).view(dtype)
        else:
            out[i] = np.float64(1.0 if n == "true" else 0.0 if n == "false"
                                else int(n, 16) if n.startswith("0x") else float(n))
    return out.reshape(shape)
