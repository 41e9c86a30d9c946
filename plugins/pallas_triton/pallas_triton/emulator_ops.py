"""The Triton emulator's rules for ``tt`` operations that touch no memory.

Shape operations (``splat``, ``broadcast``, ``expand_dims``, ``reshape``, ``trans``, ``join``,
``split``, ``cat``, ``gather``), ``dot``, ``reduce`` and ``scan`` with their combine regions,
conversions, and the libdevice functions ``tt.extern_elementwise`` calls, as numpy over whole
tensors. Pointers are ``int64`` addresses (see :mod:`pallas_triton.emulator`), so the shape
operations move them like any other value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import scipy.special
from jaxlib.mlir import ir
from jaxlib.triton import dialect as tt

from pallas_core.backend import (
    EmulatorCompiler,
    EmulatorRule,
    UnsupportedError,
    as_signed,
    as_unsigned,
    dtype_of,
    element_type_of,
    shape_of,
)

_Fn = Callable[..., Any]
ADDRESS = np.dtype(np.int64)
"""The numpy type of a pointer (an address in the emulator's memory)."""


def is_pointer(t: ir.Type) -> bool:
    """Whether ``t`` (or its element type) is a ``!tt.ptr``."""
    return element_type_of(t).typeid == tt.PointerType.static_typeid  # type: ignore[no-any-return]


def pointee(t: ir.Type) -> np.dtype:
    """The numpy type of the elements a pointer (tensor) type points to."""
    return dtype_of(tt.PointerType(element_type_of(t)).pointee_type)


def value_dtype(t: ir.Type) -> np.dtype:
    """The numpy type holding values of ``t``: ``int64`` addresses for pointers."""
    return ADDRESS if is_pointer(t) else dtype_of(t)


def _int_attr(op: ir.Operation, name: str) -> int:
    return int(ir.IntegerAttr(op.attributes[name]).value)


def _i32_array(op: ir.Operation, name: str) -> list[int]:
    return [int(v) for v in ir.DenseI32ArrayAttr(op.attributes[name])]


# -- shapes -----------------------------------------------------------------------------------

def _broadcast(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``tt.splat`` (a scalar) and ``tt.broadcast`` (size-1 dimensions) to the result shape."""
    shape = shape_of(op.results[0].type)
    return lambda x: np.broadcast_to(np.asarray(x), shape)


def _unsplat(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    return lambda x: np.asarray(x).reshape(())


def _expand_dims(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    axis = _int_attr(op, "axis")
    return lambda x: np.expand_dims(np.asarray(x), axis)


def _reshape(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)
    # With allow_reorder Triton may place the elements in any order; row-major is one of them.
    return lambda x: np.reshape(np.asarray(x), shape)


def _trans(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    order = _i32_array(op, "order")
    return lambda x: np.transpose(np.asarray(x), order)


def _join(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    return lambda a, b: np.stack([np.asarray(a), np.asarray(b)], axis=-1)


def _split(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    return lambda x: (np.asarray(x)[..., 0], np.asarray(x)[..., 1])


def _cat(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    # Triton may reorder the elements of a cat; concatenating along the first axis is valid.
    return lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)], axis=0)


def _gather(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    axis = _int_attr(op, "axis")

    def run(src: Any, idx: Any) -> Any:
        src, idx = np.asarray(src), np.asarray(idx).astype(np.int64)
        n = src.shape[axis]
        return np.take_along_axis(src, np.clip(idx, 0, n - 1), axis=axis)
    return run


def _make_range(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    values = np.arange(_int_attr(op, "start"), _int_attr(op, "end"), dtype=np.int32)
    values.flags.writeable = False
    return lambda: values


# -- conversions ------------------------------------------------------------------------------

def _bitcast(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    src, dst = op.operands[0].type, op.results[0].type
    if is_pointer(src) or is_pointer(dst):
        if not (is_pointer(src) and is_pointer(dst)):
            raise UnsupportedError(f"the Triton emulator cannot bitcast {src} to {dst}")
        return lambda x: x  # an address is the same whatever it points to
    to = dtype_of(dst)
    if to == np.bool_ or dtype_of(src) == np.bool_:
        return lambda x: np.asarray(x).astype(to)
    return lambda x: np.ascontiguousarray(np.asarray(x)).view(to)


def _identity(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``tt.int_to_ptr``/``tt.ptr_to_int``: the emulator's addresses are integers already."""
    dtype = value_dtype(op.results[0].type)
    return lambda x: np.asarray(x).astype(dtype)


def _fp_to_fp(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dst = dtype_of(op.results[0].type)
    src = dtype_of(op.operands[0].type)
    toward_zero = ("rounding" in op.attributes
                   and _int_attr(op, "rounding") == int(tt.RoundingMode.RTZ))
    narrowing = np.dtype(dst).itemsize < np.dtype(src).itemsize or dst == ml_dtypes.bfloat16

    def run(x: Any) -> Any:
        x = np.asarray(x)
        y = x.astype(dst)
        if toward_zero and narrowing:
            # Round to nearest, then step one ulp toward zero where that rounded away from it.
            wide = x.astype(np.float64)
            away = np.isfinite(wide) & (np.abs(y.astype(np.float64)) > np.abs(wide))
            if away.any():
                bits = as_unsigned(y.view(f"i{y.dtype.itemsize}")).copy()
                bits[away] -= 1
                y = bits.view(dst)
        return y
    return run


def _mulhiui(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    bits = np.dtype(dtype).itemsize * 8

    def run(a: Any, b: Any) -> Any:
        ua, ub = as_unsigned(np.asarray(a)), as_unsigned(np.asarray(b))
        if bits <= 32:
            wide = ua.astype(np.uint64) * ub.astype(np.uint64)
            return as_signed((wide >> np.uint64(bits)).astype(ua.dtype), dtype)
        lo_mask = np.uint64(0xFFFFFFFF)
        a_lo, a_hi = ua & lo_mask, ua >> np.uint64(32)
        b_lo, b_hi = ub & lo_mask, ub >> np.uint64(32)
        mid = (a_lo * b_lo >> np.uint64(32)) + (a_hi * b_lo & lo_mask) + (a_lo * b_hi & lo_mask)
        hi = a_hi * b_hi + (a_hi * b_lo >> np.uint64(32)) + (a_lo * b_hi >> np.uint64(32)) \
            + (mid >> np.uint64(32))
        return as_signed(hi, dtype)
    return run


def _in_f32(fn: _Fn, dtype: np.dtype) -> _Fn:
    """``fn`` computed in float32 for narrower floats, rounded once to ``dtype``."""
    if np.dtype(dtype).itemsize < 4:
        return lambda *xs: np.asarray(fn(*[np.asarray(x).astype(np.float32) for x in xs])
                                      ).astype(dtype)
    return lambda *xs: np.asarray(fn(*xs)).astype(dtype, copy=False)


def _clampf(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    propagate = _int_attr(op, "propagateNan") != 0
    dtype = dtype_of(op.results[0].type)

    def run(x: Any, lo: Any, hi: Any) -> Any:
        out = np.minimum(np.maximum(x, lo), hi) if propagate else np.fmin(np.fmax(x, lo), hi)
        return out
    return _in_f32(run, dtype)


def _precise(fn: _Fn) -> EmulatorRule:
    def rule(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
        return _in_f32(fn, dtype_of(op.results[0].type))
    return rule


def _histogram(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    (bins,) = shape_of(op.results[0].type)
    dtype = dtype_of(op.results[0].type)

    def run(x: Any, *mask: Any) -> Any:
        x = np.asarray(x).astype(np.int64).ravel()
        keep = (x >= 0) & (x < bins)
        if mask:
            keep &= np.broadcast_to(np.asarray(mask[0]), np.asarray(x).shape).ravel()
        return np.bincount(x[keep], minlength=bins).astype(dtype)
    return run


# -- dot --------------------------------------------------------------------------------------

def _tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded (to nearest even) to TensorFloat-32's 10 mantissa bits."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) \
        & np.uint32(0xFFFFE000)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    return np.where(finite, rounded, bits).view(np.float32)


def _dot(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    out = dtype_of(op.results[0].type)
    precision = _int_attr(op, "inputPrecision") if "inputPrecision" in op.attributes \
        else int(tt.InputPrecision.IEEE)
    in_dtype = dtype_of(op.operands[0].type)
    tf32 = precision == int(tt.InputPrecision.TF32) and in_dtype == np.float32

    def run(a: Any, b: Any, acc: Any) -> Any:
        a, b, acc = np.asarray(a), np.asarray(b), np.asarray(acc)
        if out.kind in "iu":
            prod = np.matmul(a.astype(np.int64), b.astype(np.int64)) + acc.astype(np.int64)
            return prod.astype(out)
        if tf32:
            a, b = _tf32(a), _tf32(b)
        prod = np.matmul(a.astype(np.float64), b.astype(np.float64))
        if out == np.float32 or np.dtype(out).itemsize < 4:
            prod = prod.astype(np.float32)  # products summed in float32 precision
        return (prod + acc.astype(prod.dtype)).astype(out)
    return run


# -- reduce and scan --------------------------------------------------------------------------

def _combine(region: Any, a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> list[np.ndarray]:
    results = region(*a, *b)
    return [np.broadcast_to(np.asarray(r), x.shape).astype(x.dtype, copy=False)
            for r, x in zip(results, a, strict=True)]


def _reduce(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    axis = _int_attr(op, "axis")
    region = c.region(op.regions[0])

    def run(*xs: Any) -> Any:
        vals = [np.moveaxis(np.asarray(x), axis, 0) for x in xs]
        # A tree of pairwise combines of neighbours: log2(n) calls of the region on whole
        # tensors; neighbours keep their order, as an associative combine needs.
        while vals[0].shape[0] > 1:
            n = vals[0].shape[0]
            h = n // 2
            merged = _combine(region, [v[0:2 * h:2] for v in vals], [v[1:2 * h:2] for v in vals])
            if n % 2:
                merged = [np.concatenate([m, v[2 * h:]], axis=0) for m, v in zip(merged, vals,
                                                                                  strict=True)]
            vals = merged
        outs = tuple(np.asarray(v[0]) for v in vals)
        return outs[0] if len(outs) == 1 else outs
    return run


def _scan(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    axis = _int_attr(op, "axis")
    reverse = "reverse" in op.attributes and bool(ir.BoolAttr(op.attributes["reverse"]).value)
    region = c.region(op.regions[0])

    def run(*xs: Any) -> Any:
        vals = [np.moveaxis(np.asarray(x), axis, 0) for x in xs]
        if reverse:
            vals = [v[::-1] for v in vals]
        n = vals[0].shape[0]
        d = 1
        while d < n:  # Hillis-Steele: log2(n) combines of whole tensors
            merged = _combine(region, [v[:-d] for v in vals], [v[d:] for v in vals])
            vals = [np.concatenate([v[:d], m], axis=0) for v, m in zip(vals, merged,
                                                                        strict=True)]
            d *= 2
        if reverse:
            vals = [v[::-1] for v in vals]
        outs = tuple(np.ascontiguousarray(np.moveaxis(v, 0, axis)) for v in vals)
        return outs[0] if len(outs) == 1 else outs
    return run


def _map_elementwise(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    if "pack" in op.attributes and _int_attr(op, "pack") != 1:
        raise UnsupportedError("the Triton emulator runs tt.map_elementwise with pack=1 only")
    region = c.region(op.regions[0])
    shapes = [shape_of(r.type) for r in op.results]
    dtypes = [value_dtype(r.type) for r in op.results]

    def run(*xs: Any) -> Any:
        outs = tuple(np.broadcast_to(np.asarray(r), s).astype(d, copy=False)
                     for r, s, d in zip(region(*xs), shapes, dtypes, strict=True))
        return outs[0] if len(outs) == 1 else outs
    return run


# -- libdevice --------------------------------------------------------------------------------

def _clz(x: np.ndarray) -> np.ndarray:
    u = as_unsigned(x).astype(np.uint64)
    bits = x.dtype.itemsize * 8
    count = np.full(u.shape, bits, np.int32)
    nonzero = u != 0
    count[nonzero] = bits - 1 - np.floor(np.log2(u[nonzero].astype(np.float64))).astype(np.int32)
    # log2 of a float64 rounds up for values just below a power of two above 2**53: fix those.
    high = nonzero & (u >= np.uint64(1) << np.uint64(53))
    if high.any():
        top = bits - 1 - count[high]
        too_far = (u[high] >> top.astype(np.uint64)) == 0
        count[high] += too_far
    return count


def _popc(x: np.ndarray) -> np.ndarray:
    u = as_unsigned(x)
    return np.unpackbits(u.view(np.uint8).reshape((*u.shape, -1)), axis=-1).sum(
        axis=-1).astype(np.int32)


LIBDEVICE: dict[str, _Fn] = {
    "abs": np.abs, "fabs": np.abs, "llabs": np.abs,
    "acos": np.arccos, "acosh": np.arccosh, "asin": np.arcsin, "asinh": np.arcsinh,
    "atan": np.arctan, "atan2": np.arctan2, "atanh": np.arctanh, "cbrt": np.cbrt,
    "ceil": np.ceil, "floor": np.floor, "trunc": np.trunc, "round": np.round, "rint": np.rint,
    "cos": np.cos, "cosh": np.cosh, "sin": np.sin, "sinh": np.sinh, "tan": np.tan,
    "tanh": np.tanh, "exp": np.exp, "exp2": np.exp2, "exp10": lambda x: np.power(10.0, x),
    "expm1": np.expm1, "log": np.log, "log2": np.log2, "log10": np.log10, "log1p": np.log1p,
    "pow": np.power, "powi": np.power, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "erf": scipy.special.erf, "erfc": scipy.special.erfc, "erfinv": scipy.special.erfinv,
    "lgamma": scipy.special.gammaln, "tgamma": scipy.special.gamma,
    "nextafter": np.nextafter, "fmod": np.fmod, "fmax": np.fmax, "fmin": np.fmin,
    "hypot": np.hypot, "copysign": np.copysign, "isnan": np.isnan, "isinf": np.isinf,
    "signbit": np.signbit,
    "clz": _clz, "clzll": _clz, "popc": _popc, "popcll": _popc,
}
"""libdevice functions by name without ``__nv_`` and the ``f`` of their float32 forms (and
ROCm's ocml functions by name)."""

def _libdevice(symbol: str) -> _Fn | None:
    """The function of a libdevice (``__nv_expf``) or ROCm ocml (``__ocml_exp_f32``) symbol."""
    ocml = re.fullmatch(r"__ocml_([a-z0-9]+)_f(16|32|64)", symbol)
    if ocml:
        name = {"pown": "powi"}.get(ocml.group(1), ocml.group(1))
        return LIBDEVICE.get(name)
    if not symbol.startswith("__nv_"):
        return None
    name = symbol[len("__nv_"):]
    if name.startswith("fast_"):
        name = name[len("fast_"):]
    if name in LIBDEVICE:
        return LIBDEVICE[name]
    if name.endswith("f") and name[:-1] in LIBDEVICE:
        return LIBDEVICE[name[:-1]]
    return None


def _extern_elementwise(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    symbol = ir.StringAttr(op.attributes["symbol"]).value
    fn = _libdevice(symbol)
    if fn is None:
        raise UnsupportedError(
            f"the Triton emulator does not know the external function `{symbol}` "
            f"(tt.extern_elementwise at {op.location}). Fix: add it to "
            "pallas_triton.emulator_ops.LIBDEVICE.")
    dtype = dtype_of(op.results[0].type)
    if dtype.kind in "iub":
        return lambda *xs: np.asarray(fn(*[np.asarray(x) for x in xs])).astype(dtype)

    def run(*xs: Any) -> Any:
        with np.errstate(all="ignore"):
            return np.asarray(fn(*xs))
    return _in_f32(run, dtype)


_PTX: dict[str, _Fn] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "min": np.fmin, "max": np.fmax, "neg": np.negative, "abs": np.abs, "mov": lambda x: x,
    "tanh": np.tanh, "ex2": np.exp2, "lg2": np.log2, "rcp": lambda x: 1.0 / x,
    "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x), "sin": np.sin, "cos": np.cos,
}
"""Single PTX float instructions ``tt.elementwise_inline_asm`` may hold, by opcode."""
_ASM = re.compile(r"^\s*([a-z0-9]+)((?:\.[a-z0-9]+)*)\s+\$0((?:\s*,\s*\$\d+)+)\s*;\s*$")


def _inline_asm(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """One PTX float instruction over the operands (``add.f32 $0, $1, $2;``), elementwise."""
    asm = ir.StringAttr(op.attributes["asm_string"]).value
    match = _ASM.match(asm)
    fn = _PTX.get(match.group(1)) if match else None
    packed = "packed_element" in op.attributes \
        and int(ir.IntegerAttr(op.attributes["packed_element"]).value) != 1
    if fn is None or match is None or len(op.results) != 1 or packed:
        raise UnsupportedError(
            f"the Triton emulator cannot run the inline assembly {asm!r} "
            f"(tt.elementwise_inline_asm at {op.location}): it runs one PTX float "
            f"instruction of {sorted(_PTX)} with pack=1 and one result")
    refs = [int(r) - 1 for r in re.findall(r"\$(\d+)", match.group(3))]
    base = _in_f32(fn, dtype_of(op.results[0].type))
    return lambda *xs: base(*[xs[r] for r in refs])


RULES: dict[str, EmulatorRule] = {
    "tt.splat": _broadcast, "tt.unsplat": _unsplat, "tt.broadcast": _broadcast,
    "tt.expand_dims": _expand_dims, "tt.reshape": _reshape, "tt.trans": _trans,
    "tt.join": _join, "tt.split": _split, "tt.cat": _cat, "tt.gather": _gather,
    "tt.make_range": _make_range,
    "tt.bitcast": _bitcast, "tt.int_to_ptr": _identity, "tt.ptr_to_int": _identity,
    "tt.fp_to_fp": _fp_to_fp, "tt.mulhiui": _mulhiui, "tt.clampf": _clampf,
    "tt.precise_sqrt": _precise(np.sqrt), "tt.precise_divf": _precise(np.divide),
    "tt.histogram": _histogram, "tt.dot": _dot, "tt.reduce": _reduce, "tt.scan": _scan,
    "tt.map_elementwise": _map_elementwise,
    "tt.extern_elementwise": _extern_elementwise, "tt.elementwise_inline_asm": _inline_asm,
}
"""The memory-free ``tt`` operations."""
