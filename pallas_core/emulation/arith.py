"""``arith`` and ``math`` operations as numpy, on whole vectors.

Integers are held signed (see :mod:`pallas_core.emulation.types`); the ``u`` forms view their
operands as unsigned. ``i1`` arithmetic is arithmetic modulo 2 (``addi`` is exclusive or), and the
signed operations (``maxsi``, ``cmpi slt``, ``extsi``, ``sitofp``, ...) read ``true`` as -1, as
MLIR does.

Where MLIR leaves a result undefined the emulator gives a defined value and does not report it:
``x / 0`` and ``x % 0`` are 0 (all division forms), ``MIN / -1`` wraps to ``MIN``, shifts by the
bit width or more give 0 (``shrsi``: the sign bits), ``fptosi``/``fptoui`` saturate and give 0
for NaN, ``ipowi`` of 0 to a negative power is 0, and ``clampf`` with ``min > max`` is what its
formula gives. ``atan2(+-0, +-0)`` is C's (+-0 or +-pi), where MLIR's constant folder says NaN.

Sub-32-bit floats are computed in float32 and rounded once, which is the correctly rounded result
for the basic operations; conversions from float64 or from integers to them round once too (a
cast through float32 would round twice). ``tests/test_emulation_folding.py`` checks every rule
against MLIR's constant folding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith as arith_dialect

from pallas_core.emulation.machine import Compiler, Rule
from pallas_core.emulation.types import (
    attribute_array,
    bit_width,
    dtype_of,
    signed,
    unsigned,
)
from pallas_core.errors import PallasError, UnsupportedError

_Fn = Callable[..., Any]


def _result_dtype(op: ir.Operation) -> np.dtype:
    return dtype_of(op.results[0].type)


def _ints(fn: Callable[..., Any], *, unsigned_operands: bool = False) -> Rule:
    """An integer operation computed in the operands' width (``i1`` read as 0 and -1, or as 0
    and 1 by the unsigned operations, with the result taken modulo 2)."""
    def rule(c: Compiler, op: ir.Operation) -> _Fn:
        dtype = _result_dtype(op)
        if dtype == np.bool_:
            def widen(x: Any) -> Any:
                x = np.asarray(x)
                return x.astype(np.uint8) if unsigned_operands else -x.astype(np.int8)
            return lambda *xs: (np.asarray(fn(*[widen(x) for x in xs])) & 1).astype(np.bool_)
        if unsigned_operands:
            return lambda *xs: signed(np.asarray(fn(*[unsigned(x) for x in xs])), dtype)
        return lambda *xs: np.asarray(fn(*xs)).astype(dtype, copy=False)
    return rule


def _floats(fn: Callable[..., Any]) -> Rule:
    """A float operation, computed in float32 for narrower floats and rounded once."""
    def rule(c: Compiler, op: ir.Operation) -> _Fn:
        dtype = _result_dtype(op)
        if dtype.itemsize < 4:
            return lambda *xs: np.asarray(
                fn(*[np.asarray(x).astype(np.float32) for x in xs])).astype(dtype)
        return lambda *xs: np.asarray(fn(*xs)).astype(dtype, copy=False)
    return rule


def _safe(b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, np.ones_like(b), b)


def _divsi(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    b1 = _safe(b)
    r = np.fmod(a, b1)
    return np.where(b == 0, 0, (a - r) // b1)


def _remsi(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, 0, np.fmod(a, _safe(b)))


def _divui(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, 0, a // _safe(b))


def _remui(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, 0, a % _safe(b))


def _floordivsi(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, 0, a // _safe(b))


def _ceildivsi(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    q = _divsi(a, b)
    r = np.fmod(a, _safe(b))
    return np.where((r != 0) & ((r < 0) == (b < 0)), q + 1, q)


def _ceildivui(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    q = _divui(a, b)
    return np.where((b != 0) & (a % _safe(b) != 0), q + 1, q)


def _shift(kind: str) -> Rule:
    def rule(c: Compiler, op: ir.Operation) -> _Fn:
        dtype = _result_dtype(op)
        bits = bit_width(op.results[0].type)

        def run(a: Any, b: Any) -> Any:
            a, b = np.asarray(a), np.asarray(b)
            if dtype == np.bool_:
                keep = unsigned(b) == 0
                return np.where(keep, a, False) if kind != "shrsi" else a
            ub = unsigned(b)
            big = ub >= bits
            amount = np.where(big, 0, ub).astype(unsigned(a).dtype)
            if kind == "shli":
                out = signed(unsigned(a) << amount, dtype)
                return np.where(big, np.zeros_like(out), out)
            if kind == "shrui":
                out = signed(unsigned(a) >> amount, dtype)
                return np.where(big, np.zeros_like(out), out)
            out = a >> amount.astype(a.dtype)
            return np.where(big, np.where(a < 0, -1, 0).astype(dtype), out)
        return run
    return rule


_CMPI: Mapping[int, tuple[Callable[[Any, Any], Any], bool]] = {
    0: (np.equal, False), 1: (np.not_equal, False), 2: (np.less, False),
    3: (np.less_equal, False), 4: (np.greater, False), 5: (np.greater_equal, False),
    6: (np.less, True), 7: (np.less_equal, True), 8: (np.greater, True),
    9: (np.greater_equal, True),
}


def _cmpi(c: Compiler, op: ir.Operation) -> _Fn:
    pred = ir.IntegerAttr(op.attributes["predicate"]).value
    fn, uns = _CMPI[pred]
    is_bool = dtype_of(op.operands[0].type) == np.bool_
    if is_bool and not uns and pred >= 2:
        # i1 read as signed: true is -1.
        return lambda a, b: fn(-np.asarray(a).astype(np.int8), -np.asarray(b).astype(np.int8))
    if uns:
        return lambda a, b: fn(unsigned(a), unsigned(b))
    return lambda a, b: fn(a, b)


def _cmpf(c: Compiler, op: ir.Operation) -> _Fn:
    pred = ir.IntegerAttr(op.attributes["predicate"]).value

    def run(a: Any, b: Any) -> Any:
        a = np.asarray(a).astype(np.float64) if np.asarray(a).dtype.itemsize < 4 else a
        b = np.asarray(b).astype(np.float64) if np.asarray(b).dtype.itemsize < 4 else b
        unordered = np.isnan(a) | np.isnan(b)
        if pred == 0:
            return np.zeros(np.broadcast(a, b).shape, np.bool_)
        if pred == 15:
            return np.ones(np.broadcast(a, b).shape, np.bool_)
        if pred == 7:
            return ~unordered
        if pred == 14:
            return unordered
        base = {1: np.equal, 2: np.greater, 3: np.greater_equal, 4: np.less,
                5: np.less_equal, 6: np.not_equal}[pred if pred < 8 else pred - 7]
        with np.errstate(invalid="ignore"):
            r = base(a, b)
        return (r & ~unordered) if pred < 8 else (r | unordered)
    return run


def _max_min_f(maximum: bool, propagate_nan: bool) -> Rule:
    def fn(a: Any, b: Any) -> Any:
        if propagate_nan:
            out = np.maximum(a, b) if maximum else np.minimum(a, b)
        else:
            out = np.fmax(a, b) if maximum else np.fmin(a, b)
        both_zero = (a == 0) & (b == 0)
        if np.any(both_zero):
            neg = np.signbit(a) & np.signbit(b) if maximum else np.signbit(a) | np.signbit(b)
            out = np.where(both_zero, np.where(neg, -0.0, 0.0).astype(out.dtype), out)
        return out
    return _floats(fn)


def _constant(c: Compiler, op: ir.Operation) -> _Fn:
    value = attribute_array(op.attributes["value"], op.results[0].type)
    value.flags.writeable = False
    return lambda: value


def _select(c: Compiler, op: ir.Operation) -> _Fn:
    return lambda cond, a, b: np.where(cond, a, b)


def _cast(fn: Callable[[Any, np.dtype, np.dtype], Any]) -> Rule:
    def rule(c: Compiler, op: ir.Operation) -> _Fn:
        src = dtype_of(op.operands[0].type)
        dst = _result_dtype(op)
        return lambda x: np.asarray(fn(np.asarray(x), src, dst))
    return rule


def _narrow(x: Any, dst: np.dtype) -> Any:
    """float64 values rounded once (to nearest, ties to even) to a float type narrower than
    float32. numpy's and ml_dtypes' casts from float64 go through float32 for some types and
    would round twice; float32 rounded to odd keeps enough bits for the second rounding to be
    exact."""
    x = np.asarray(x, np.float64)
    if dst.itemsize >= 4:
        return x.astype(dst)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
        back = f.astype(np.float64)
        f = np.where(np.abs(back) > np.abs(x), np.nextafter(f, np.float32(0)), f)
        inexact = (f.astype(np.float64) != x) & np.isfinite(x)
    bits = f.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32).astype(dst)


def _int_to_float(magnitude: Any, negative: Any, dst: np.dtype) -> Any:
    """Integers given as a uint64 magnitude and a sign, rounded once to ``dst``."""
    u = np.asarray(magnitude, np.uint64)
    if dst.itemsize < 4:
        # Keep the top 32 significant bits and a sticky bit: exact in float64.
        _, exp = np.frexp(u.astype(np.float64))
        shift = np.maximum(exp - 32, 0).astype(np.uint64)
        dropped = u & ((np.uint64(1) << shift) - np.uint64(1))
        kept = (u >> shift) | (dropped != 0).astype(np.uint64)
        f = np.ldexp(kept.astype(np.float64), shift.astype(np.int64))
        return _narrow(np.where(negative, -f, f), dst)
    f = u.astype(dst)
    return np.where(negative, -f, f).astype(dst)


def _extsi(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    if src == np.bool_:
        return -(x.astype(dst))
    return x.astype(dst)


def _extui(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    return signed(unsigned(x).astype(np.dtype(f"u{dst.itemsize}")), dst) if dst != np.bool_ \
        else x


def _trunci(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    if dst == np.bool_:
        return (x & 1).astype(np.bool_)
    return signed(unsigned(x).astype(np.dtype(f"u{dst.itemsize}")), dst)


def _sitofp(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    if src == np.bool_:
        return -(x.astype(np.float32)).astype(dst)
    wide = x.astype(np.int64)
    magnitude = np.where(wide < 0, ~wide.view(np.uint64) + np.uint64(1), wide.view(np.uint64))
    return _int_to_float(magnitude, wide < 0, dst)


def _uitofp(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    return _int_to_float(unsigned(x).astype(np.uint64), False, dst)


def _fptosi(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    f = np.trunc(x.astype(np.float64))
    info = np.iinfo(dst) if dst != np.bool_ else None
    if info is None:
        return f != 0
    f = np.where(np.isnan(f), 0, np.clip(f, info.min, info.max))
    return f.astype(dst)


def _fptoui(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    f = np.trunc(x.astype(np.float64))
    if dst == np.bool_:
        return f != 0
    udst = np.dtype(f"u{dst.itemsize}")
    info = np.iinfo(udst)
    f = np.where(np.isnan(f), 0, np.clip(f, 0, info.max))
    return signed(f.astype(udst), dst)


def _float_cast(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    if dst.itemsize < 4 and src.itemsize > 4:
        return _narrow(x, dst)
    return x.astype(dst)


def _bitcast(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    if src == np.bool_ or dst == np.bool_:
        return x.astype(dst)
    return x.view(dst)


def _index_cast(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    return _trunci(x.astype(np.int64), np.dtype(np.int64), dst) if dst.itemsize < 8 \
        else _extsi(x, src, dst)


def _index_castui(x: Any, src: np.dtype, dst: np.dtype) -> Any:
    if dst.itemsize < src.itemsize or dst == np.bool_:
        return _trunci(x, src, dst)
    return _extui(x, src, dst)


def _round_half_away(x: Any) -> Any:
    t = np.trunc(x)
    with np.errstate(invalid="ignore"):
        up = np.abs(x - t) >= 0.5
    return np.where(up, t + np.sign(x), t)


def _bits(fn: Callable[[Any, int], Any]) -> Rule:
    """A bit-counting operation: ``fn(uint64 values, width)`` -> uint64 counts."""
    def rule(c: Compiler, op: ir.Operation) -> _Fn:
        dtype = _result_dtype(op)
        bits = bit_width(op.results[0].type)

        def run(x: Any) -> Any:
            out = fn(unsigned(np.asarray(x)).astype(np.uint64), bits)
            return signed(out.astype(np.dtype(f"u{max(dtype.itemsize, 1)}")), dtype)
        return run
    return rule


def _bit_length(u: Any) -> Any:
    n = np.zeros(u.shape, np.uint64)
    for s in (32, 16, 8, 4, 2, 1):
        big = u >= np.uint64(1 << s)
        n += np.where(big, np.uint64(s), np.uint64(0))
        u = np.where(big, u >> np.uint64(s), u)
    return n + (u > 0).astype(np.uint64)


def _ctlz(u: Any, bits: int) -> Any:
    return np.uint64(bits) - _bit_length(u)


def _cttz(u: Any, bits: int) -> Any:
    lowest = u & (~u + np.uint64(1))
    return np.where(u == 0, np.uint64(bits), _bit_length(lowest) - np.uint64(1))


def _ctpop(u: Any, bits: int) -> Any:
    per_byte = np.unpackbits(u[..., None].view(np.uint8), axis=-1).sum(axis=-1)
    return per_byte.astype(np.uint64)


def _per_element(fn: Callable[[float], float]) -> Callable[[Any], Any]:
    ufunc = np.frompyfunc(fn, 1, 1)
    return lambda x: np.asarray(ufunc(np.asarray(x, np.float64)), dtype=np.float64)


def _absi(x: Any) -> Any:
    return np.abs(x)


def _ipowi(a: Any, b: Any) -> Any:
    a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
    out = np.ones_like(a)
    base = a.copy()
    e = b.copy()
    zero_neg = e < 0
    e = np.where(zero_neg, 0, e)
    while np.any(e > 0):
        out = np.where(e & 1, out * base, out)
        base = base * base
        e = e >> 1
    # a ** negative: 1 for a == 1, +-1 for a == -1, 0 otherwise (division by zero for a == 0).
    neg = np.where(a == 1, 1, np.where(a == -1, np.where(b & 1, -1, 1), 0)).astype(a.dtype)
    return np.where(zero_neg, neg, out)


def _carry(subtract: bool) -> Rule:
    """``addui_extended`` / ``subui_extended``: the wrapped result and the unsigned carry out
    (borrow)."""
    def rule(c: Compiler, op: ir.Operation) -> _Fn:
        wrapped = _ints(np.subtract if subtract else np.add)(c, op)

        def run(a: Any, b: Any) -> Any:
            out = wrapped(a, b)
            ua, ub = unsigned(a), unsigned(b)
            flag = ua < ub if subtract else unsigned(out) < ua
            return out, np.asarray(flag, np.bool_)
        return run
    return rule


def _mul_extended(is_signed: bool) -> Rule:
    """``mulsi_extended`` / ``mului_extended``: the low and high halves of the double-width
    product."""
    def rule(c: Compiler, op: ir.Operation) -> _Fn:
        dtype = _result_dtype(op)
        bits = bit_width(op.results[0].type)
        mask = np.uint64((1 << bits) - 1) if bits < 64 else np.uint64(2 ** 64 - 1)

        def wide(x: Any) -> Any:
            x = np.asarray(x)
            if x.dtype == np.bool_:
                x = -x.astype(np.int64) if is_signed else x.astype(np.int64)
            return x.astype(np.int64) if is_signed else unsigned(x).astype(np.uint64)

        def halves(a: Any, b: Any) -> tuple[Any, Any]:
            if bits <= 32:
                p = (wide(a) * wide(b)).astype(np.int64).view(np.uint64)
                return p & mask, (p >> np.uint64(bits)) & mask
            ua, ub = unsigned(a).astype(np.uint64), unsigned(b).astype(np.uint64)
            m32 = np.uint64(0xFFFFFFFF)
            s32 = np.uint64(32)
            a0, a1, b0, b1 = ua & m32, ua >> s32, ub & m32, ub >> s32
            low = a0 * b0
            mid1 = a1 * b0 + (low >> s32)
            mid2 = a0 * b1 + (mid1 & m32)
            high = a1 * b1 + (mid1 >> s32) + (mid2 >> s32)
            if is_signed:  # the unsigned high half less b where a < 0, less a where b < 0
                high = high - np.where(np.asarray(a) < 0, ub, 0).astype(np.uint64) \
                    - np.where(np.asarray(b) < 0, ua, 0).astype(np.uint64)
            return ua * ub, high

        def run(a: Any, b: Any) -> Any:
            with np.errstate(over="ignore"):
                low, high = halves(a, b)
            return signed(low, dtype), signed(high, dtype)
        return run
    return rule


def _flush_denormals(c: Compiler, op: ir.Operation) -> _Fn:
    dtype = _result_dtype(op)
    tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
    zero = np.zeros((), dtype)

    def run(x: Any) -> Any:
        x = np.asarray(x)
        wide = x.astype(np.float64)
        sub = (np.abs(wide) < tiny) & (wide != 0)
        return np.where(sub, np.copysign(zero.astype(np.float64), wide).astype(dtype), x)
    return run


def _clampf(c: Compiler, op: ir.Operation) -> _Fn:
    minimum = _max_min_f(False, True)(c, op)
    maximum = _max_min_f(True, True)(c, op)
    return lambda x, lo, hi: maximum(minimum(x, hi), lo)


def _isnormal(c: Compiler, op: ir.Operation) -> _Fn:
    tiny = float(ml_dtypes.finfo(dtype_of(op.operands[0].type)).smallest_normal)

    def run(x: Any) -> Any:
        wide = np.asarray(x).astype(np.float64)
        return np.isfinite(wide) & (np.abs(wide) >= tiny)
    return run


def _sincos(c: Compiler, op: ir.Operation) -> _Fn:
    sin, cos = _floats(np.sin)(c, op), _floats(np.cos)(c, op)
    return lambda x: (sin(x), cos(x))


def _nearest_even_only(rule: Rule) -> Rule:
    """``rule`` for an operation whose optional ``roundingmode`` must be to nearest even."""
    def checked(c: Compiler, op: ir.Operation) -> _Fn:
        if "roundingmode" in op.attributes:
            mode = str(op.attributes["roundingmode"])
            if "to_nearest_even" not in mode:
                raise UnsupportedError(f"the {c.backend} emulator supports only rounding to "
                                       f"nearest even in {op.name}, not {mode}")
        return rule(c, op)
    return checked


def _quiet(rule: Rule) -> Rule:
    """``rule`` computing without numpy's floating-point warnings: overflow, division by zero
    and invalid operations are values here (inf, NaN, wrapped integers), not events."""
    def quiet_rule(c: Compiler, op: ir.Operation) -> _Fn:
        fn = rule(c, op)

        def run(*xs: Any) -> Any:
            with np.errstate(all="ignore"):
                return fn(*xs)
        return run
    return quiet_rule


class CheckFailedError(PallasError, AssertionError):
    """A ``cf.assert`` of an emulated kernel (a ``pl.debug_check`` or ``checkify.debug_check``
    lowered for the hardware) failed."""


def _cf_assert(c: Compiler, op: ir.Operation) -> _Fn:
    message = ir.StringAttr(op.attributes["msg"]).value

    def run(ok: Any) -> None:
        if not np.asarray(ok).all():
            raise CheckFailedError(f"a check in the emulated kernel failed: {message}")
    return run


ASSERT_RULES: dict[str, Rule] = {"cf.assert": _cf_assert}
"""``cf.assert`` (how Mosaic TPU lowers a debug check) -> rule."""

RULES: dict[str, Rule] = {
    "arith.constant": _constant,
    "arith.addi": _ints(np.add), "arith.subi": _ints(np.subtract),
    "arith.muli": _ints(np.multiply),
    "arith.divsi": _ints(_divsi), "arith.remsi": _ints(_remsi),
    "arith.divui": _ints(_divui, unsigned_operands=True),
    "arith.remui": _ints(_remui, unsigned_operands=True),
    "arith.floordivsi": _ints(_floordivsi), "arith.ceildivsi": _ints(_ceildivsi),
    "arith.ceildivui": _ints(_ceildivui, unsigned_operands=True),
    "arith.andi": _ints(np.bitwise_and), "arith.ori": _ints(np.bitwise_or),
    "arith.xori": _ints(np.bitwise_xor),
    "arith.maxsi": _ints(np.maximum), "arith.minsi": _ints(np.minimum),
    "arith.maxui": _ints(np.maximum, unsigned_operands=True),
    "arith.minui": _ints(np.minimum, unsigned_operands=True),
    "arith.shli": _shift("shli"), "arith.shrui": _shift("shrui"),
    "arith.shrsi": _shift("shrsi"),
    "arith.addf": _floats(np.add), "arith.subf": _floats(np.subtract),
    "arith.mulf": _floats(np.multiply), "arith.divf": _floats(np.divide),
    "arith.remf": _floats(np.fmod), "arith.negf": _floats(np.negative),
    "arith.maximumf": _max_min_f(True, True), "arith.minimumf": _max_min_f(False, True),
    "arith.maxnumf": _max_min_f(True, False), "arith.minnumf": _max_min_f(False, False),
    "arith.cmpi": _cmpi, "arith.cmpf": _cmpf, "arith.select": _select,
    "arith.extsi": _cast(_extsi), "arith.extui": _cast(_extui),
    "arith.trunci": _cast(_trunci), "arith.sitofp": _cast(_sitofp),
    "arith.uitofp": _cast(_uitofp), "arith.fptosi": _cast(_fptosi),
    "arith.fptoui": _cast(_fptoui), "arith.extf": _cast(_float_cast),
    "arith.truncf": _nearest_even_only(_cast(_float_cast)),
    "arith.convertf": _nearest_even_only(_cast(_float_cast)),
    "arith.addui_extended": _carry(False), "arith.subui_extended": _carry(True),
    "arith.mulsi_extended": _mul_extended(True),
    "arith.mului_extended": _mul_extended(False),
    "arith.flush_denormals": _flush_denormals, "arith.bitcast": _cast(_bitcast),
    "arith.index_cast": _cast(_index_cast), "arith.index_castui": _cast(_index_castui),
    # math
    "math.absf": _floats(np.abs), "math.absi": _ints(_absi),
    "math.ceil": _floats(np.ceil), "math.floor": _floats(np.floor),
    "math.trunc": _floats(np.trunc), "math.roundeven": _floats(np.rint),
    "math.round": _floats(_round_half_away),
    "math.sqrt": _floats(np.sqrt), "math.rsqrt": _floats(lambda x: 1 / np.sqrt(x)),
    "math.cbrt": _floats(np.cbrt),
    "math.exp": _floats(np.exp), "math.exp2": _floats(np.exp2),
    "math.expm1": _floats(np.expm1),
    "math.log": _floats(np.log), "math.log2": _floats(np.log2),
    "math.log10": _floats(np.log10), "math.log1p": _floats(np.log1p),
    "math.sin": _floats(np.sin), "math.cos": _floats(np.cos), "math.tan": _floats(np.tan),
    "math.asin": _floats(np.arcsin), "math.acos": _floats(np.arccos),
    "math.atan": _floats(np.arctan), "math.atan2": _floats(np.arctan2),
    "math.sinh": _floats(np.sinh), "math.cosh": _floats(np.cosh),
    "math.tanh": _floats(np.tanh), "math.asinh": _floats(np.arcsinh),
    "math.acosh": _floats(np.arccosh), "math.atanh": _floats(np.arctanh),
    "math.erf": _floats(_per_element(math.erf)),
    "math.erfc": _floats(_per_element(math.erfc)),
    "math.powf": _floats(np.power), "math.fpowi": _floats(np.power),
    "math.ipowi": _ints(_ipowi),
    "math.copysign": _floats(np.copysign),
    "math.fma": _floats(lambda a, b, c: a * b + c),
    "math.ctlz": _bits(_ctlz), "math.cttz": _bits(_cttz),
    "math.ctpop": _bits(_ctpop),
    "math.isnan": lambda c, op: np.isnan, "math.isinf": lambda c, op: np.isinf,
    "math.isfinite": lambda c, op: np.isfinite,
    "math.isnormal": _isnormal, "math.clampf": _clampf, "math.sincos": _sincos,
}
# IEEE 754-2019 maximumNumber/minimumNumber: like maxnumf/minnumf (a NaN operand gives the
# other operand) on the quiet NaNs that numpy makes. The arith dialect has them from the MLIR of
# JAX 0.12 on, so the rules exist where the dialect does.
if hasattr(arith_dialect, "MaximumNumFOp"):
    RULES["arith.maximumnumf"] = _max_min_f(True, False)
    RULES["arith.minimumnumf"] = _max_min_f(False, False)
RULES = {name: rule if name == "arith.constant" else _quiet(rule) for name, rule in RULES.items()}
"""``arith`` and ``math`` operation name -> rule."""
