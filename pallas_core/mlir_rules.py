"""Lowering rules that mean the same on every MLIR backend, written once.

Elementwise arithmetic, comparisons, casts between every pair of dtypes (bool and unsigned
included), select, shifts, powers, min/max with NaN, reductions and structured control flow
(``cond``, ``while``, ``scan``/``fori_loop``, inlined calls) are ``arith``/``math``/``scf`` ops
on whatever value a backend uses (Triton's ranked tensors, Mosaic's vectors, scalars). A
backend describes its values with a :class:`Dialect`.

Each rule is a module-level function named for what it lowers (``shift_rule``, ``cond_rule``,
...) with the signature of every backend's rules (:data:`~pallas_core.mlir_lowering.Rule`) but
for the :class:`Dialect` it takes first: ``rule(d, state, eqn, *in_values)``. A family of
primitives that lower alike is one rule reading its row of a table (:data:`BINARY_OPS`,
:data:`FLOAT_UNARY_OPS`, :data:`COMPARISONS`, ...). :data:`SHARED_RULES` maps each primitive
to its rule; :func:`table` binds them to a backend's dialect, and a backend's table is that
plus its overrides (its own rules registered over the shared ones, where its hardware
differs: Triton has no ``math.tanh``).

Every rule follows ``jax.lax``'s semantics for its primitive; where an MLIR op's meaning differs
(integer division and shifts by the bit width or more are poison in ``arith``; ``fptoui`` to
``i1`` would turn 0.5 into False) the rule emits what ``lax`` means. A primitive on a dtype the
rule cannot take is refused with an ``UnsupportedError`` naming the operation, the dtype and the
backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, scf
from jaxlib.mlir.dialects import math as mmath

from pallas_core import _jax, extras
from pallas_core.mlir_lowering import (
    CALL_PRIMITIVES,
    LoweringState,
    Rule,
    Rules,
    called_jaxpr,
    is_float,
    is_unsigned,
)


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How a backend builds values; what the shared rules need and nothing more.

    ``constant(value, dtype, shape)``: a constant (a splat for a non-empty ``shape``).
    ``broadcast_to(value, shape)``: a scalar or a value of dims 1-or-equal brought to ``shape``.
    ``value_type(shape, dtype)``: the type of a value (scalar for ``()``).
    ``lower_jaxpr(state, jaxpr, consts, args)``: emits a sub-jaxpr (control-flow bodies).
    ``reduce(state, eqn, x, axes, kind)``: a reduction of ``x`` over ``axes``, where ``kind`` is
    ``"add"``, ``"max"`` or ``"min"`` (signedness and NaN from the dtype) or ``"and"``/``"or"``.
    """

    constant: Callable[[Any, Any, Sequence[int]], ir.Value]
    broadcast_to: Callable[[ir.Value, Sequence[int]], ir.Value]
    value_type: Callable[[Sequence[int], Any], ir.Type]
    lower_jaxpr: Callable[[Any, Any, Sequence[Any], Sequence[Any]], list[Any]]
    reduce: Callable[[Any, Any, ir.Value, Sequence[int], str], ir.Value]


SharedRule = Callable[..., Any]
"""A shared rule: ``rule(d: Dialect, state, eqn, *in_values) -> out value(s)``, a
:data:`~pallas_core.mlir_lowering.Rule` once bound to a backend's dialect (:func:`table`)."""


# --- helpers


def _in(eqn: Any, i: int = 0) -> Any:
    return eqn.invars[i].aval


def _out(eqn: Any) -> Any:
    return eqn.outvars[0].aval


def _refuse(state: LoweringState, eqn: Any, dtype: Any) -> Exception:
    return state.fail(f"{eqn.primitive.name} on {np.dtype(dtype).name}", eqn)


def _bits(dtype: Any) -> int:
    return 1 if np.dtype(dtype) == np.bool_ else np.dtype(dtype).itemsize * 8


def _const(d: Dialect, value: Any, like: Any) -> ir.Value:
    """``value`` as a constant of ``like``'s dtype and shape."""
    return d.constant(value, like.dtype, like.shape)


def _bcast(d: Dialect, eqn: Any, *vals: ir.Value) -> list[ir.Value]:
    """``vals`` brought to the shape of ``eqn``'s output."""
    return [d.broadcast_to(v, _out(eqn).shape) for v in vals]


def _select(pred: ir.Value, on_true: ir.Value, on_false: ir.Value) -> ir.Value:
    return arith.SelectOp(pred, on_true, on_false).result


def _cmp(pred: str, dtype: Any, x: ir.Value, y: ir.Value) -> ir.Value:
    """``pred`` one of eq ne lt le gt ge, ordered for floats (ne: unordered)."""
    if is_float(dtype):
        f = {"eq": "OEQ", "ne": "UNE", "lt": "OLT", "le": "OLE", "gt": "OGT", "ge": "OGE"}
        return arith.CmpFOp(getattr(arith.CmpFPredicate, f[pred]), x, y).result
    name = pred if pred in ("eq", "ne") else ("u" if is_unsigned(dtype) else "s") + pred
    return arith.CmpIOp(getattr(arith.CmpIPredicate, name), x, y).result


def _types(d: Dialect, avals: Sequence[Any]) -> list[ir.Type]:
    physical = [_jax.physical_aval(a) for a in avals]  # a key array as its words
    return [d.value_type(a.shape, a.dtype) for a in physical]


# --- elementwise: families lowered from a table


BINARY_OPS: dict[Any, tuple[Any, Any, Any]] = {
    lax.add_p: (arith.AddFOp, arith.AddIOp, arith.AddIOp),
    lax.sub_p: (arith.SubFOp, arith.SubIOp, arith.SubIOp),
    lax.mul_p: (arith.MulFOp, arith.MulIOp, arith.MulIOp),
    lax.div_p: (arith.DivFOp, arith.DivSIOp, arith.DivUIOp),
    lax.rem_p: (arith.RemFOp, arith.RemSIOp, arith.RemUIOp),
    lax.max_p: (arith.MaximumFOp, arith.MaxSIOp, arith.MaxUIOp),
    lax.min_p: (arith.MinimumFOp, arith.MinSIOp, arith.MinUIOp),
    lax.and_p: (None, arith.AndIOp, arith.AndIOp),
    lax.or_p: (None, arith.OrIOp, arith.OrIOp),
    lax.xor_p: (None, arith.XOrIOp, arith.XOrIOp),
    lax.pow_p: (mmath.PowFOp, None, None),
    lax.atan2_p: (mmath.Atan2Op, None, None),
    _jax.add_any_p: (arith.AddFOp, arith.AddIOp, arith.AddIOp),  # the sum of two cotangents
}
"""Binary primitive -> its op on (floats, signed integers, unsigned integers and booleans);
``None`` where it takes no such dtype."""


def binary_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value,
                y: ir.Value) -> ir.Value:
    """A primitive of :data:`BINARY_OPS`: its op for the operands' dtype."""
    dtype = _in(eqn).dtype
    float_op, signed_op, unsigned_op = BINARY_OPS[eqn.primitive]
    op = float_op if is_float(dtype) else unsigned_op if is_unsigned(dtype) else signed_op
    if op is None:
        raise _refuse(state, eqn, dtype)
    return op(*_bcast(d, eqn, x, y)).result


FLOAT_UNARY_OPS: dict[Any, Any] = {
    lax.exp_p: mmath.ExpOp, lax.exp2_p: mmath.Exp2Op, lax.log_p: mmath.LogOp,
    lax.log1p_p: mmath.Log1pOp, lax.expm1_p: mmath.ExpM1Op, lax.sqrt_p: mmath.SqrtOp,
    lax.rsqrt_p: mmath.RsqrtOp, lax.cbrt_p: mmath.CbrtOp, lax.sin_p: mmath.SinOp,
    lax.cos_p: mmath.CosOp, lax.tan_p: mmath.TanOp, lax.tanh_p: mmath.TanhOp,
    lax.atan_p: mmath.AtanOp, lax.floor_p: mmath.FloorOp, lax.ceil_p: mmath.CeilOp,
    lax.erf_p: mmath.ErfOp, lax.asin_p: mmath.AsinOp, lax.acos_p: mmath.AcosOp,
    lax.sinh_p: mmath.SinhOp, lax.cosh_p: mmath.CoshOp, lax.asinh_p: mmath.AsinhOp,
    lax.acosh_p: mmath.AcoshOp, lax.atanh_p: mmath.AtanhOp,
    **({lax.log2_p: mmath.Log2Op} if hasattr(lax, "log2_p") else {}),  # JAX 0.11 on
}
"""Unary primitive on floats only -> its ``math`` op."""


def float_unary_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """A primitive of :data:`FLOAT_UNARY_OPS`: its ``math`` op; other dtypes are refused."""
    if not is_float(_in(eqn).dtype):
        raise _refuse(state, eqn, _in(eqn).dtype)
    return FLOAT_UNARY_OPS[eqn.primitive](x).result


INTEGER_UNARY_OPS: dict[Any, Any] = {
    lax.population_count_p: mmath.CtPopOp, lax.clz_p: mmath.CountLeadingZerosOp}
"""Unary primitive on (non-boolean) integers only -> its ``math`` op."""


def integer_unary_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """A primitive of :data:`INTEGER_UNARY_OPS`: its op; floats and booleans are refused."""
    if is_float(_in(eqn).dtype) or _in(eqn).dtype == np.bool_:
        raise _refuse(state, eqn, _in(eqn).dtype)
    return INTEGER_UNARY_OPS[eqn.primitive](x).result


COMPARISONS: dict[Any, str] = {lax.eq_p: "eq", lax.ne_p: "ne", lax.lt_p: "lt", lax.le_p: "le",
                               lax.gt_p: "gt", lax.ge_p: "ge"}
"""Comparison primitive -> its predicate (ordered on floats but for ``ne``)."""


def compare_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value,
                 y: ir.Value) -> ir.Value:
    """A primitive of :data:`COMPARISONS`: ``arith.cmpf``/``cmpi``, signed as the dtype is."""
    return _cmp(COMPARISONS[eqn.primitive], _in(eqn).dtype, *_bcast(d, eqn, x, y))


SHIFT_OPS: dict[Any, Any] = {lax.shift_left_p: arith.ShLIOp,
                             lax.shift_right_arithmetic_p: arith.ShRSIOp,
                             lax.shift_right_logical_p: arith.ShRUIOp}
"""Shift primitive -> its ``arith`` op (poison from the bit width on: :func:`shift_rule`)."""


def shift_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value,
               y: ir.Value) -> ir.Value:
    """A shift of :data:`SHIFT_OPS`. ``arith``'s shifts are poison from the bit width on;
    ``lax``'s give 0 (or the sign)."""
    aval = _out(eqn)
    if is_float(aval.dtype) or aval.dtype == np.bool_:
        raise _refuse(state, eqn, aval.dtype)
    x, y = _bcast(d, eqn, x, y)
    op = SHIFT_OPS[eqn.primitive]
    width = _const(d, _bits(aval.dtype), aval)
    too_far = arith.CmpIOp(arith.CmpIPredicate.uge, y, width).result
    if eqn.primitive is lax.shift_right_arithmetic_p:
        y = _select(too_far, _const(d, _bits(aval.dtype) - 1, aval), y)
        return op(x, y).result
    return _select(too_far, _const(d, 0, aval), op(x, y).result)


# --- elementwise: one rule each


def identity_rule(d: Dialect, state: LoweringState, eqn: Any, x: Any) -> Any:
    """The operand itself: ``stop_gradient``; resharding (which JAX's tracing adds under a
    mesh with explicit axes, or an assumed device), which changes nothing where a kernel runs
    on one device, as in JAX's lowerings; wrapping and unwrapping a key (held as its words,
    so that only the type changes); staging a value for tracing (the value itself once
    traced)."""
    return x


def bitcast_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """``bitcast_convert_type`` between dtypes of one width."""
    src, out = _in(eqn), _out(eqn)
    if _bits(src.dtype) != _bits(out.dtype) or np.dtype(out.dtype) == np.bool_:
        raise state.fail(f"bitcast_convert_type from {np.dtype(src.dtype).name} to "
                         f"{np.dtype(out.dtype).name} (of another width)", eqn)
    return arith.BitcastOp(d.value_type(out.shape, out.dtype), x).result


def clamp_rule(d: Dialect, state: LoweringState, eqn: Any, lo: ir.Value, x: ir.Value,
               hi: ir.Value) -> ir.Value:
    lo, x, hi = _bcast(d, eqn, lo, x, hi)
    dtype = _out(eqn).dtype
    if is_float(dtype):
        return arith.MinimumFOp(arith.MaximumFOp(x, lo).result, hi).result
    mx, mn = ((arith.MaxUIOp, arith.MinUIOp) if is_unsigned(dtype)
              else (arith.MaxSIOp, arith.MinSIOp))
    return mn(mx(x, lo).result, hi).result


def mulhi_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value,
               y: ir.Value) -> ir.Value:
    """The high half of the double-width product of 32-bit integers (the widths JAX's
    Mosaic lowering takes), signed or not."""
    aval = _out(eqn)
    if np.dtype(aval.dtype) not in (np.dtype(np.int32), np.dtype(np.uint32)):
        raise _refuse(state, eqn, aval.dtype)
    x, y = _bcast(d, eqn, x, y)
    op = arith.MulUIExtendedOp if is_unsigned(aval.dtype) else arith.MulSIExtendedOp
    return op(x, y).high


def one_minus_square_rule(d: Dialect, state: LoweringState, eqn: Any,
                          x: ir.Value) -> ir.Value:
    """``1 - x**2`` (JAX 0.11 on: tanh's derivative, for one) as ``(1 + x) * (1 - x)``, as
    JAX computes it (exact where ``x`` is near 1, where ``x**2`` would round)."""
    aval = _out(eqn)
    if not is_float(aval.dtype):
        raise _refuse(state, eqn, aval.dtype)
    one = _const(d, 1.0, aval)
    return arith.MulFOp(arith.AddFOp(one, x).result, arith.SubFOp(one, x).result).result


def nextafter_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value,
                   y: ir.Value) -> ir.Value:
    """The float after ``x`` towards ``y``: one step of the bit pattern (away from zero
    or towards it), the smallest subnormal of ``y``'s sign from zero, ``y`` where they
    are equal, NaN where either is."""
    aval = _out(eqn)
    if not is_float(aval.dtype):
        raise _refuse(state, eqn, aval.dtype)
    x, y = _bcast(d, eqn, x, y)
    bits = _bits(aval.dtype)
    ints = aval.update(dtype=np.dtype(f"int{bits}"))
    int_type = d.value_type(aval.shape, ints.dtype)
    float_type = d.value_type(aval.shape, aval.dtype)
    ix = arith.BitcastOp(int_type, x).result
    iy = arith.BitcastOp(int_type, y).result
    zero = _const(d, 0.0, aval)
    # Towards zero when y is below a positive x or above a negative one.
    inwards = arith.XOrIOp(_cmp("lt", aval.dtype, x, y),
                           _cmp("gt", aval.dtype, x, zero)).result
    stepped = _select(inwards, arith.SubIOp(ix, _const(d, 1, ints)).result,
                      arith.AddIOp(ix, _const(d, 1, ints)).result)
    sign = arith.AndIOp(iy, _const(d, -(1 << (bits - 1)), ints)).result
    tiny = arith.OrIOp(sign, _const(d, 1, ints)).result
    out = _select(_cmp("eq", aval.dtype, x, zero), tiny, stepped)
    out = _select(_cmp("eq", aval.dtype, x, y), iy, out)
    out = arith.BitcastOp(float_type, out).result
    unordered = arith.CmpFOp(arith.CmpFPredicate.UNO, x, y).result
    return _select(unordered, arith.AddFOp(x, y).result, out)


def round_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    if not is_float(_in(eqn).dtype):
        raise _refuse(state, eqn, _in(eqn).dtype)
    even = eqn.params["rounding_method"] == lax.RoundingMethod.TO_NEAREST_EVEN
    return (mmath.RoundEvenOp if even else mmath.RoundOp)(x).result


def neg_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    aval = _in(eqn)
    if is_float(aval.dtype):
        return arith.NegFOp(x).result
    return arith.SubIOp(_const(d, 0, aval), x).result


def abs_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    aval = _in(eqn)
    if is_float(aval.dtype):
        return mmath.AbsFOp(x).result
    return x if is_unsigned(aval.dtype) else mmath.AbsIOp(x).result


def sign_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """-1, 0 or 1; a float zero keeps its sign and NaN stays NaN."""
    aval = _in(eqn)
    if aval.dtype == np.bool_:
        return x
    zero, one = _const(d, 0, aval), _const(d, 1, aval)
    positive = _select(_cmp("gt", aval.dtype, x, zero), one, zero)
    if is_unsigned(aval.dtype):
        return positive
    negative = _cmp("lt", aval.dtype, x, zero)
    out = _select(negative, _const(d, -1, aval), positive)
    if is_float(aval.dtype):  # zeros keep their sign, NaN stays NaN
        keep = arith.CmpFOp(arith.CmpFPredicate.UEQ, x, zero).result
        out = _select(keep, x, out)
    return out


def not_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    aval = _in(eqn)
    if is_float(aval.dtype):
        raise _refuse(state, eqn, aval.dtype)
    return arith.XOrIOp(x, _const(d, 1 if aval.dtype == np.bool_ else -1, aval)).result


def logistic_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """``1 / (1 + exp(-x))``."""
    aval = _in(eqn)
    if not is_float(aval.dtype):
        raise _refuse(state, eqn, aval.dtype)
    one = _const(d, 1.0, aval)
    e = mmath.ExpOp(arith.NegFOp(x).result).result
    return arith.DivFOp(one, arith.AddFOp(one, e).result).result


def is_finite_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    inf = _const(d, np.inf, _in(eqn))
    return arith.CmpFOp(arith.CmpFPredicate.ONE, mmath.AbsFOp(x).result, inf).result


def square_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    return (arith.MulFOp if is_float(_in(eqn).dtype) else arith.MulIOp)(x, x).result


def integer_pow_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """``x ** y`` for a constant integer ``y``, by squaring and multiplying (ones for
    ``y = 0``; a negative power of an integer is refused)."""
    aval, power = _in(eqn), eqn.params["y"]
    f = is_float(aval.dtype)
    if aval.dtype == np.bool_ or (power < 0 and not f):
        raise state.fail(f"integer_pow with exponent {power} on "
                         f"{np.dtype(aval.dtype).name}", eqn)
    mul = arith.MulFOp if f else arith.MulIOp
    out, base, n = None, x, abs(power)
    while n:  # square and multiply
        if n & 1:
            out = base if out is None else mul(out, base).result
        n >>= 1
        if n:
            base = mul(base, base).result
    if out is None:
        return _const(d, 1, aval)
    return arith.DivFOp(_const(d, 1.0, aval), out).result if power < 0 else out


_ERF_INV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06,
                    0.00021858087, -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
"""Giles' coefficients of erfinv(x) / x for w = -log(1 - x^2) < 5, in powers of w - 2.5."""
_ERF_INV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844,
                 0.00573950773, -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)
"""The same for w >= 5, in powers of sqrt(w) - 3."""


def erf_inv_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """Giles' single-precision approximation ("Approximating the erfinv function", GPU
    Computing Gems, 2011): a polynomial in w = -log(1 - x^2), in two ranges of w."""
    aval = _in(eqn)
    if not is_float(aval.dtype):
        raise _refuse(state, eqn, aval.dtype)
    f32, shape = np.float32, aval.shape
    xf = convert(d, x, aval.dtype, f32, shape)

    def c(v: float) -> ir.Value:
        return d.constant(v, f32, shape)

    def horner(coeffs: Sequence[float], w: ir.Value) -> ir.Value:
        p = c(coeffs[0])
        for k in coeffs[1:]:
            p = arith.AddFOp(c(k), arith.MulFOp(p, w).result).result
        return p

    one = c(1.0)
    w = arith.NegFOp(mmath.LogOp(arith.MulFOp(arith.SubFOp(one, xf).result,
                                               arith.AddFOp(one, xf).result).result
                                  ).result).result
    central = horner(_ERF_INV_CENTRAL, arith.SubFOp(w, c(2.5)).result)
    tail = horner(_ERF_INV_TAIL, arith.SubFOp(mmath.SqrtOp(w).result, c(3.0)).result)
    near = arith.CmpFOp(arith.CmpFPredicate.OLT, w, c(5.0)).result
    out = arith.MulFOp(_select(near, central, tail), xf).result
    # At x = +-1 (w = inf) the tail polynomial is -inf: the answer is x * inf.
    edge = arith.CmpFOp(arith.CmpFPredicate.OEQ, w, c(np.inf)).result
    out = _select(edge, arith.MulFOp(xf, c(np.inf)).result, out)
    return convert(d, out, f32, aval.dtype, shape)


# --- select, casts, reductions


def select_n_rule(d: Dialect, state: LoweringState, eqn: Any, which: ir.Value,
                  *cases: ir.Value) -> ir.Value:
    """Case ``k`` where ``which`` is ``k`` (a boolean picks between two), the last case
    otherwise."""
    which, *values = _bcast(d, eqn, which, *cases)
    sel = _in(eqn)
    if sel.dtype == np.bool_:
        return _select(which, values[1], values[0]) if len(values) == 2 else values[0]
    out = values[-1]
    for k in range(len(values) - 2, -1, -1):  # case k where which == k, the last otherwise
        is_k = arith.CmpIOp(arith.CmpIPredicate.eq, which,
                            d.constant(k, sel.dtype, _out(eqn).shape)).result
        out = _select(is_k, values[k], out)
    return out


def convert_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """``convert_element_type``, as :func:`convert` does it."""
    return convert(d, x, _in(eqn).dtype, _out(eqn).dtype, _out(eqn).shape)


REDUCTIONS: dict[Any, str] = {lax.reduce_sum_p: "add", lax.reduce_max_p: "max",
                              lax.reduce_min_p: "min", lax.reduce_and_p: "and",
                              lax.reduce_or_p: "or"}
"""Reduction primitive -> the ``kind`` of :meth:`Dialect.reduce` it is."""


def reduce_rule(d: Dialect, state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
    """A reduction of :data:`REDUCTIONS`, by the dialect's ``reduce`` (booleans' max and min
    as ``or`` and ``and``)."""
    kind, dtype = REDUCTIONS[eqn.primitive], _in(eqn).dtype
    if kind in ("and", "or") and is_float(dtype):
        raise _refuse(state, eqn, dtype)
    if dtype == np.bool_:
        if kind == "add":
            raise _refuse(state, eqn, dtype)
        kind = {"max": "or", "min": "and"}.get(kind, kind)
    return d.reduce(state, eqn, x, tuple(eqn.params["axes"]), kind)


# --- random keys, calls


def threefry_rule(d: Dialect, state: LoweringState, eqn: Any, *args: ir.Value) -> list[Any]:
    """``threefry2x32`` as its expansion into integer ops, inlined."""
    expansion = _jax.threefry2x32_expansion([v.aval for v in eqn.invars])
    return d.lower_jaxpr(state, expansion.jaxpr, expansion.consts, args)


def key_rule(d: Dialect, state: LoweringState, eqn: Any, *args: Any) -> Any:
    """``jax.random`` on a key array: the key implementation's function on the key's
    words, inlined (as JAX's TPU lowering does)."""
    expansion = _jax.key_expansion(eqn)
    if isinstance(expansion, str):
        raise state.fail(f"{eqn.primitive.name}: {expansion}", eqn)
    outs = d.lower_jaxpr(state, expansion.jaxpr, expansion.consts, args)
    return outs if eqn.primitive.multiple_results else outs[0]


def inline_rule(d: Dialect, state: LoweringState, eqn: Any, *args: Any) -> list[Any]:
    """A call (``jit``, ``closed_call``, custom JVP/VJP, ``remat``): the callee, inlined."""
    jaxpr, consts = called_jaxpr(eqn)
    return d.lower_jaxpr(state, jaxpr, consts, args)


def custom_fusion_rule(d: Dialect, state: LoweringState, eqn: Any, *args: Any) -> list[Any]:
    """A ``custom_fusion`` in a kernel: its Pallas form, where it has one (its
    ``pallas_jaxpr``), else its ordinary one, inlined (as JAX's lowering does)."""
    p = eqn.params
    n, m = p["num_consts"], p["pallas_num_consts"]
    consts, pallas_consts, rest = args[:n], args[n:n + m], args[n + m:]
    jaxpr, these = ((p["jaxpr"], consts) if p["pallas_jaxpr"] is None
                    else (p["pallas_jaxpr"], pallas_consts))
    if isinstance(jaxpr, _jax.ClosedJaxpr):
        return d.lower_jaxpr(state, jaxpr.jaxpr, jaxpr.consts, [*these, *rest])
    return d.lower_jaxpr(state, jaxpr, (), [*these, *rest])


# --- control flow


def cond_rule(d: Dialect, state: LoweringState, eqn: Any, index: ir.Value,
              *ops: Any) -> list[Any]:
    """``cond``/``switch`` as nested ``scf.if``s (the last branch takes every index past
    it, as ``lax.switch`` clamps)."""
    branches = eqn.params["branches"]
    out_types = _types(d, [v.aval for v in eqn.outvars])

    def emit(k: int) -> list[Any]:
        """Branch ``k`` if the index is ``k``, else the branches after it."""
        b = branches[k]
        if k == len(branches) - 1:
            return d.lower_jaxpr(state, b.jaxpr, b.consts, ops)
        if _in(eqn).dtype == np.bool_:  # two branches: branch 0 where the index is False
            pred = arith.XOrIOp(index, d.constant(1, np.bool_, ())).result
        else:
            pred = arith.CmpIOp(arith.CmpIPredicate.sle if k == 0 else
                                arith.CmpIPredicate.eq, index,
                                d.constant(k, _in(eqn).dtype, ())).result
        if_op = scf.IfOp(pred, out_types, has_else=True)
        with ir.InsertionPoint(if_op.then_block):
            scf.YieldOp(d.lower_jaxpr(state, b.jaxpr, b.consts, ops))
        with ir.InsertionPoint(if_op.else_block):
            scf.YieldOp(emit(k + 1))
        return list(if_op.results)

    return emit(0)


def while_rule(d: Dialect, state: LoweringState, eqn: Any, *args: Any) -> list[Any]:
    """``while_loop`` as ``scf.while``."""
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cconsts, bconsts, init = args[:nc], args[nc:nc + nb], args[nc + nb:]
    carry_types = [a.type for a in init]
    loop = scf.WhileOp(carry_types, list(init))
    before = loop.before.blocks.append(*carry_types)
    with ir.InsertionPoint(before):
        cj = eqn.params["cond_jaxpr"]
        (go,) = d.lower_jaxpr(state, cj.jaxpr, cj.consts, [*cconsts, *before.arguments])
        scf.ConditionOp(go, list(before.arguments))
    after = loop.after.blocks.append(*carry_types)
    with ir.InsertionPoint(after):
        bj = eqn.params["body_jaxpr"]
        scf.YieldOp(d.lower_jaxpr(state, bj.jaxpr, bj.consts, [*bconsts, *after.arguments]))
    return list(loop.results)


def scan_rule(d: Dialect, state: LoweringState, eqn: Any, *args: Any) -> list[Any]:
    """A ``scan`` over no arrays and stacking no outputs (``fori_loop``) as ``scf.for``."""
    consts, init, xs, split_out = _jax.scan_parts(eqn.params, args)
    if xs or len(eqn.outvars) > len(init):
        raise state.fail("lax.scan over arrays or with stacked outputs (fori_loop-style "
                         "loops lower)", eqn)
    body = eqn.params["jaxpr"]
    zero, length = d.constant(0, np.int32, ()), d.constant(eqn.params["length"], np.int32, ())
    loop = scf.ForOp(zero, length, d.constant(1, np.int32, ()), list(init))
    with ir.InsertionPoint(loop.body):
        carry, _ = split_out(d.lower_jaxpr(state, body.jaxpr, body.consts,
                                           [*consts, *loop.inner_iter_args]))
        scf.YieldOp(carry)
    return list(loop.results)


# --- the table


def _if_present(prim: Any, rule: SharedRule) -> dict[Any, SharedRule]:
    """``{prim: rule}`` where this JAX has ``prim`` (not ``None``), else no row."""
    return {} if prim is None else {prim: rule}


SHARED_RULES: Mapping[Any, SharedRule] = {
    **dict.fromkeys(BINARY_OPS, binary_rule),
    **_if_present(getattr(lax, "stop_gradient_p", None), identity_rule),
    _jax.reshard_p: identity_rule,
    lax.bitcast_convert_type_p: bitcast_rule,
    **dict.fromkeys(SHIFT_OPS, shift_rule),
    lax.clamp_p: clamp_rule,
    lax.mulhi_p: mulhi_rule,
    **_if_present(getattr(lax, "one_minus_square_p", None), one_minus_square_rule),  # JAX 0.11
    lax.nextafter_p: nextafter_rule,
    **dict.fromkeys(FLOAT_UNARY_OPS, float_unary_rule),
    lax.round_p: round_rule,
    lax.neg_p: neg_rule,
    lax.abs_p: abs_rule,
    lax.sign_p: sign_rule,
    lax.not_p: not_rule,
    lax.logistic_p: logistic_rule,
    lax.is_finite_p: is_finite_rule,
    lax.square_p: square_rule,
    lax.integer_pow_p: integer_pow_rule,
    lax.erf_inv_p: erf_inv_rule,
    **dict.fromkeys(INTEGER_UNARY_OPS, integer_unary_rule),
    **dict.fromkeys(COMPARISONS, compare_rule),
    lax.select_n_p: select_n_rule,
    lax.convert_element_type_p: convert_rule,
    **dict.fromkeys(REDUCTIONS, reduce_rule),
    threefry2x32_p: threefry_rule,
    **dict.fromkeys(_jax.KEY_PRIMITIVES, key_rule),
    _jax.random_wrap_p: identity_rule,
    _jax.random_unwrap_p: identity_rule,
    **dict.fromkeys(CALL_PRIMITIVES, inline_rule),
    _jax.stage_p: identity_rule,
    **_if_present(_jax.custom_fusion_p, custom_fusion_rule),
    _jax.cond_p: cond_rule,
    _jax.while_p: while_rule,
    _jax.scan_p: scan_rule,
}
"""Primitive -> its shared rule (``rule(d, state, eqn, *in_values)``), every backend's
starting point; :func:`table` binds it to a dialect."""


def table(d: Dialect) -> Rules:
    """The shared rules, for values built as ``d`` says: :data:`SHARED_RULES`, each bound to
    ``d`` (a rule serving several primitives is one function in the table). A backend
    registers its own rules over these where its hardware differs."""
    bound: dict[SharedRule, Rule] = {}
    for fn in SHARED_RULES.values():
        bound.setdefault(fn, functools.partial(fn, d))
    return Rules({p: bound[fn] for p, fn in SHARED_RULES.items()})


# --- helpers backends call


def convert(d: Dialect, x: ir.Value, src: Any, dst: Any, shape: Sequence[int]) -> ir.Value:
    """``x`` (of dtype ``src``) converted to ``dst`` as ``lax.convert_element_type`` does:
    to bool by comparing with zero (0.5 and 2 are True), from bool as 0 or 1, between float16
    and bfloat16 through float32."""
    if np.dtype(src) == np.dtype(dst):
        return x
    out = d.value_type(shape, dst)
    if np.dtype(dst) == np.bool_:
        zero = d.constant(0, src, shape)
        if is_float(src):
            return arith.CmpFOp(arith.CmpFPredicate.UNE, x, zero).result
        return arith.CmpIOp(arith.CmpIPredicate.ne, x, zero).result
    sbits, dbits = _bits(src), _bits(dst)
    if is_float(src) and is_float(dst):
        if sbits == dbits:
            return convert(d, convert(d, x, src, np.float32, shape), np.float32, dst, shape)
        return (arith.ExtFOp if dbits > sbits else arith.TruncFOp)(out, x).result
    if is_float(src):
        return (arith.FPToUIOp if is_unsigned(dst) else arith.FPToSIOp)(out, x).result
    if is_float(dst):
        return (arith.UIToFPOp if is_unsigned(src) else arith.SIToFPOp)(out, x).result
    if dbits > sbits:
        return (arith.ExtUIOp if is_unsigned(src) else arith.ExtSIOp)(out, x).result
    if dbits < sbits:
        return arith.TruncIOp(out, x).result
    return x  # the same width: only the signedness differs


def reduction_op(kind: str, dtype: Any) -> Any:
    """The ``arith`` op combining two values in a reduction of ``kind`` (see :class:`Dialect`)."""
    if kind == "and":
        return arith.AndIOp
    if kind == "or":
        return arith.OrIOp
    if is_float(dtype):
        return {"add": arith.AddFOp, "max": arith.MaximumFOp, "min": arith.MinimumFOp}[kind]
    u = is_unsigned(dtype)
    return {"add": arith.AddIOp, "max": arith.MaxUIOp if u else arith.MaxSIOp,
            "min": arith.MinUIOp if u else arith.MinSIOp}[kind]


def reduction_identity(kind: str, dtype: Any) -> Any:
    """The starting value of a reduction of ``kind`` over ``dtype``."""
    if kind == "add" or kind == "or":
        return 0
    if kind == "and":
        return 1 if np.dtype(dtype) == np.bool_ else -1
    if is_float(dtype):
        return -np.inf if kind == "max" else np.inf
    info = np.iinfo(dtype)
    return info.min if kind == "max" else info.max


def debug_check_to_assert(state: LoweringState, eqn: Any) -> tuple[int, str] | None:
    """What a backend asserts for ``checkify.debug_check`` (``check_p``), as JAX's lowerings
    do: ``(operand index of the failure predicate, message)``, or ``None`` while
    ``pl.enable_debug_checks`` is off (nothing is emitted then). A functionalized
    ``checkify.check`` is refused by name."""
    found = _jax.failed_check(eqn)
    if found is None:
        raise state.fail("checkify.check in a kernel (kernels assert debug checks only; use "
                         "checkify.debug_check, or functionalize the check with "
                         "checkify.checkify around the kernel's call)", eqn)
    if not extras.enable_debug_checks.value:
        return None
    return found
