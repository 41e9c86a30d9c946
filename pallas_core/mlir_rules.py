"""Lowering rules that mean the same on every MLIR backend, written once.

Elementwise arithmetic, comparisons, casts between every pair of dtypes (bool and unsigned
included), select, shifts, powers, min/max with NaN, reductions and structured control flow
(``cond``, ``while``, ``scan``/``fori_loop``, inlined calls) are ``arith``/``math``/``scf`` ops
on whatever value a backend uses (Triton's ranked tensors, Mosaic's vectors, scalars). A
backend describes its values with a :class:`Dialect` and starts its rule table from
:func:`table`, overriding only what differs on its hardware (Triton has no ``math.tanh``).

Every rule follows ``jax.lax``'s semantics for its primitive; where an MLIR op's meaning differs
(integer division and shifts by the bit width or more are poison in ``arith``; ``fptoui`` to
``i1`` would turn 0.5 into False) the rule emits what ``lax`` means. A primitive on a dtype the
rule cannot take is refused with an ``UnsupportedError`` naming the operation, the dtype and the
backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
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


def _in(eqn: Any, i: int = 0) -> Any:
    return eqn.invars[i].aval


def _out(eqn: Any) -> Any:
    return eqn.outvars[0].aval


def _refuse(state: LoweringState, eqn: Any, dtype: Any) -> Exception:
    return state.fail(f"{eqn.primitive.name} on {np.dtype(dtype).name}", eqn)


def _bits(dtype: Any) -> int:
    return 1 if np.dtype(dtype) == np.bool_ else np.dtype(dtype).itemsize * 8


def table(d: Dialect) -> Rules:
    """The shared rules, for values built as ``d`` says."""
    rules = Rules()
    rule = rules.rule

    def const(value: Any, like: Any) -> ir.Value:
        return d.constant(value, like.dtype, like.shape)

    def bcast(eqn: Any, *vals: ir.Value) -> list[ir.Value]:
        return [d.broadcast_to(v, _out(eqn).shape) for v in vals]

    def select(pred: ir.Value, on_true: ir.Value, on_false: ir.Value) -> ir.Value:
        return arith.SelectOp(pred, on_true, on_false).result

    def cmp(pred: str, dtype: Any, x: ir.Value, y: ir.Value) -> ir.Value:
        """``pred`` one of eq ne lt le gt ge, ordered for floats (ne: unordered)."""
        if is_float(dtype):
            f = {"eq": "OEQ", "ne": "UNE", "lt": "OLT", "le": "OLE", "gt": "OGT", "ge": "OGE"}
            return arith.CmpFOp(getattr(arith.CmpFPredicate, f[pred]), x, y).result
        name = pred if pred in ("eq", "ne") else ("u" if is_unsigned(dtype) else "s") + pred
        return arith.CmpIOp(getattr(arith.CmpIPredicate, name), x, y).result

    # --- binary arithmetic

    def binary(float_op: Any, signed_op: Any, unsigned_op: Any = None) -> Any:
        def lower(state: LoweringState, eqn: Any, x: ir.Value, y: ir.Value) -> ir.Value:
            dtype = _in(eqn).dtype
            op = float_op if is_float(dtype) else (
                (unsigned_op or signed_op) if is_unsigned(dtype) else signed_op)
            if op is None:
                raise _refuse(state, eqn, dtype)
            return op(*bcast(eqn, x, y)).result
        return lower

    for prim, ops in {
        lax.add_p: (arith.AddFOp, arith.AddIOp),
        lax.sub_p: (arith.SubFOp, arith.SubIOp),
        lax.mul_p: (arith.MulFOp, arith.MulIOp),
        lax.div_p: (arith.DivFOp, arith.DivSIOp, arith.DivUIOp),
        lax.rem_p: (arith.RemFOp, arith.RemSIOp, arith.RemUIOp),
        lax.max_p: (arith.MaximumFOp, arith.MaxSIOp, arith.MaxUIOp),
        lax.min_p: (arith.MinimumFOp, arith.MinSIOp, arith.MinUIOp),
        lax.and_p: (None, arith.AndIOp),
        lax.or_p: (None, arith.OrIOp),
        lax.xor_p: (None, arith.XOrIOp),
        lax.pow_p: (mmath.PowFOp, None),
        lax.atan2_p: (mmath.Atan2Op, None),
    }.items():
        rules[prim] = binary(*ops)

    rules[_jax.add_any_p] = rules[lax.add_p]  # the sum of two cotangents

    def _identity(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        return x

    if hasattr(lax, "stop_gradient_p"):
        rules[lax.stop_gradient_p] = _identity
    # A kernel runs on one device: resharding (which JAX's tracing adds under a mesh with
    # explicit axes, or an assumed device) changes nothing there, as in JAX's lowerings.
    rules[_jax.reshard_p] = _identity

    @rule(lax.bitcast_convert_type_p)
    def _bitcast(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        src, out = _in(eqn), _out(eqn)
        if _bits(src.dtype) != _bits(out.dtype) or np.dtype(out.dtype) == np.bool_:
            raise state.fail(f"bitcast_convert_type from {np.dtype(src.dtype).name} to "
                             f"{np.dtype(out.dtype).name} (of another width)", eqn)
        return arith.BitcastOp(d.value_type(out.shape, out.dtype), x).result

    @rule(lax.shift_left_p, lax.shift_right_arithmetic_p, lax.shift_right_logical_p)
    def _shift(state: LoweringState, eqn: Any, x: ir.Value, y: ir.Value) -> ir.Value:
        # arith's shifts are poison from the bit width on; lax's give 0 (or the sign).
        aval = _out(eqn)
        if is_float(aval.dtype) or aval.dtype == np.bool_:
            raise _refuse(state, eqn, aval.dtype)
        x, y = bcast(eqn, x, y)
        prim = eqn.primitive
        op = {lax.shift_left_p: arith.ShLIOp, lax.shift_right_arithmetic_p: arith.ShRSIOp,
              lax.shift_right_logical_p: arith.ShRUIOp}[prim]
        width = const(_bits(aval.dtype), aval)
        too_far = arith.CmpIOp(arith.CmpIPredicate.uge, y, width).result
        if prim is lax.shift_right_arithmetic_p:
            y = select(too_far, const(_bits(aval.dtype) - 1, aval), y)
            return op(x, y).result
        return select(too_far, const(0, aval), op(x, y).result)

    @rule(lax.clamp_p)
    def _clamp(state: LoweringState, eqn: Any, lo: ir.Value, x: ir.Value,
               hi: ir.Value) -> ir.Value:
        lo, x, hi = bcast(eqn, lo, x, hi)
        dtype = _out(eqn).dtype
        if is_float(dtype):
            return arith.MinimumFOp(arith.MaximumFOp(x, lo).result, hi).result
        mx, mn = ((arith.MaxUIOp, arith.MinUIOp) if is_unsigned(dtype)
                  else (arith.MaxSIOp, arith.MinSIOp))
        return mn(mx(x, lo).result, hi).result

    @rule(lax.mulhi_p)
    def _mulhi(state: LoweringState, eqn: Any, x: ir.Value, y: ir.Value) -> ir.Value:
        """The high half of the double-width product of 32-bit integers (the widths JAX's
        Mosaic lowering takes), signed or not."""
        aval = _out(eqn)
        if np.dtype(aval.dtype) not in (np.dtype(np.int32), np.dtype(np.uint32)):
            raise _refuse(state, eqn, aval.dtype)
        x, y = bcast(eqn, x, y)
        op = arith.MulUIExtendedOp if is_unsigned(aval.dtype) else arith.MulSIExtendedOp
        return op(x, y).high

    if hasattr(lax, "one_minus_square_p"):  # JAX 0.11 on (tanh's derivative, for one)
        @rule(lax.one_minus_square_p)
        def _one_minus_square(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
            """``1 - x**2`` as ``(1 + x) * (1 - x)``, as JAX computes it (exact where ``x``
            is near 1, where ``x**2`` would round)."""
            aval = _out(eqn)
            if not is_float(aval.dtype):
                raise _refuse(state, eqn, aval.dtype)
            one = const(1.0, aval)
            return arith.MulFOp(arith.AddFOp(one, x).result, arith.SubFOp(one, x).result).result

    @rule(lax.nextafter_p)
    def _nextafter(state: LoweringState, eqn: Any, x: ir.Value, y: ir.Value) -> ir.Value:
        """The float after ``x`` towards ``y``: one step of the bit pattern (away from zero
        or towards it), the smallest subnormal of ``y``'s sign from zero, ``y`` where they
        are equal, NaN where either is."""
        aval = _out(eqn)
        if not is_float(aval.dtype):
            raise _refuse(state, eqn, aval.dtype)
        x, y = bcast(eqn, x, y)
        bits = _bits(aval.dtype)
        ints = aval.update(dtype=np.dtype(f"int{bits}"))
        int_type = d.value_type(aval.shape, ints.dtype)
        float_type = d.value_type(aval.shape, aval.dtype)
        ix = arith.BitcastOp(int_type, x).result
        iy = arith.BitcastOp(int_type, y).result
        zero = const(0.0, aval)
        # Towards zero when y is below a positive x or above a negative one.
        inwards = arith.XOrIOp(cmp("lt", aval.dtype, x, y),
                               cmp("gt", aval.dtype, x, zero)).result
        stepped = select(inwards, arith.SubIOp(ix, const(1, ints)).result,
                         arith.AddIOp(ix, const(1, ints)).result)
        sign = arith.AndIOp(iy, const(-(1 << (bits - 1)), ints)).result
        tiny = arith.OrIOp(sign, const(1, ints)).result
        out = select(cmp("eq", aval.dtype, x, zero), tiny, stepped)
        out = select(cmp("eq", aval.dtype, x, y), iy, out)
        out = arith.BitcastOp(float_type, out).result
        unordered = arith.CmpFOp(arith.CmpFPredicate.UNO, x, y).result
        return select(unordered, arith.AddFOp(x, y).result, out)

    # --- unary

    def float_unary(op: Any) -> Any:
        def lower(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
            if not is_float(_in(eqn).dtype):
                raise _refuse(state, eqn, _in(eqn).dtype)
            return op(x).result
        return lower

    for prim, op in ((lax.exp_p, mmath.ExpOp), (lax.exp2_p, mmath.Exp2Op),
                     (lax.log_p, mmath.LogOp), (lax.log1p_p, mmath.Log1pOp),
                     (lax.expm1_p, mmath.ExpM1Op), (lax.sqrt_p, mmath.SqrtOp),
                     (lax.rsqrt_p, mmath.RsqrtOp), (lax.cbrt_p, mmath.CbrtOp),
                     (lax.sin_p, mmath.SinOp), (lax.cos_p, mmath.CosOp),
                     (lax.tan_p, mmath.TanOp), (lax.tanh_p, mmath.TanhOp),
                     (lax.atan_p, mmath.AtanOp), (lax.floor_p, mmath.FloorOp),
                     (lax.ceil_p, mmath.CeilOp), (lax.erf_p, mmath.ErfOp),
                     (lax.asin_p, mmath.AsinOp), (lax.acos_p, mmath.AcosOp),
                     (lax.sinh_p, mmath.SinhOp), (lax.cosh_p, mmath.CoshOp),
                     (lax.asinh_p, mmath.AsinhOp), (lax.acosh_p, mmath.AcoshOp),
                     (lax.atanh_p, mmath.AtanhOp)):
        rules[prim] = float_unary(op)
    if hasattr(lax, "log2_p"):  # JAX 0.11
        rules[lax.log2_p] = float_unary(mmath.Log2Op)

    @rule(lax.round_p)
    def _round(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        if not is_float(_in(eqn).dtype):
            raise _refuse(state, eqn, _in(eqn).dtype)
        even = eqn.params["rounding_method"] == lax.RoundingMethod.TO_NEAREST_EVEN
        return (mmath.RoundEvenOp if even else mmath.RoundOp)(x).result

    @rule(lax.neg_p)
    def _neg(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        aval = _in(eqn)
        if is_float(aval.dtype):
            return arith.NegFOp(x).result
        return arith.SubIOp(const(0, aval), x).result

    @rule(lax.abs_p)
    def _abs(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        aval = _in(eqn)
        if is_float(aval.dtype):
            return mmath.AbsFOp(x).result
        return x if is_unsigned(aval.dtype) else mmath.AbsIOp(x).result

    @rule(lax.sign_p)
    def _sign(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        aval = _in(eqn)
        if aval.dtype == np.bool_:
            return x
        zero, one = const(0, aval), const(1, aval)
        positive = select(cmp("gt", aval.dtype, x, zero), one, zero)
        if is_unsigned(aval.dtype):
            return positive
        negative = cmp("lt", aval.dtype, x, zero)
        out = select(negative, const(-1, aval), positive)
        if is_float(aval.dtype):  # zeros keep their sign, NaN stays NaN
            keep = arith.CmpFOp(arith.CmpFPredicate.UEQ, x, zero).result
            out = select(keep, x, out)
        return out

    @rule(lax.not_p)
    def _not(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        aval = _in(eqn)
        if is_float(aval.dtype):
            raise _refuse(state, eqn, aval.dtype)
        return arith.XOrIOp(x, const(1 if aval.dtype == np.bool_ else -1, aval)).result

    @rule(lax.logistic_p)
    def _logistic(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        aval = _in(eqn)
        if not is_float(aval.dtype):
            raise _refuse(state, eqn, aval.dtype)
        one = const(1.0, aval)
        e = mmath.ExpOp(arith.NegFOp(x).result).result
        return arith.DivFOp(one, arith.AddFOp(one, e).result).result

    @rule(lax.is_finite_p)
    def _is_finite(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        aval = _in(eqn)
        inf = const(np.inf, aval)
        return arith.CmpFOp(arith.CmpFPredicate.ONE, mmath.AbsFOp(x).result, inf).result

    @rule(lax.square_p)
    def _square(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        return (arith.MulFOp if is_float(_in(eqn).dtype) else arith.MulIOp)(x, x).result

    @rule(lax.integer_pow_p)
    def _integer_pow(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
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
            return const(1, aval)
        return arith.DivFOp(const(1.0, aval), out).result if power < 0 else out

    @rule(lax.erf_inv_p)
    def _erf_inv(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        # Giles' single-precision approximation ("Approximating the erfinv function", GPU
        # Computing Gems, 2011): a polynomial in w = -log(1 - x^2), in two ranges of w.
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
        out = arith.MulFOp(select(near, central, tail), xf).result
        # At x = +-1 (w = inf) the tail polynomial is -inf: the answer is x * inf.
        edge = arith.CmpFOp(arith.CmpFPredicate.OEQ, w, c(np.inf)).result
        out = select(edge, arith.MulFOp(xf, c(np.inf)).result, out)
        return convert(d, out, f32, aval.dtype, shape)

    @rule(lax.population_count_p)
    def _popcount(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        if is_float(_in(eqn).dtype) or _in(eqn).dtype == np.bool_:
            raise _refuse(state, eqn, _in(eqn).dtype)
        return mmath.CtPopOp(x).result

    @rule(lax.clz_p)
    def _clz(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        if is_float(_in(eqn).dtype) or _in(eqn).dtype == np.bool_:
            raise _refuse(state, eqn, _in(eqn).dtype)
        return mmath.CountLeadingZerosOp(x).result

    # --- comparisons, select, casts

    for prim, pred in ((lax.eq_p, "eq"), (lax.ne_p, "ne"), (lax.lt_p, "lt"), (lax.le_p, "le"),
                       (lax.gt_p, "gt"), (lax.ge_p, "ge")):
        def compare(state: LoweringState, eqn: Any, x: ir.Value, y: ir.Value,
                    pred: str = pred) -> ir.Value:
            return cmp(pred, _in(eqn).dtype, *bcast(eqn, x, y))
        rules[prim] = compare

    @rule(lax.select_n_p)
    def _select_n(state: LoweringState, eqn: Any, which: ir.Value,
                  *cases: ir.Value) -> ir.Value:
        which, *values = bcast(eqn, which, *cases)
        sel = _in(eqn)
        if sel.dtype == np.bool_:
            return select(which, values[1], values[0]) if len(values) == 2 else values[0]
        out = values[-1]
        for k in range(len(values) - 2, -1, -1):  # case k where which == k, the last otherwise
            is_k = arith.CmpIOp(arith.CmpIPredicate.eq, which,
                                d.constant(k, sel.dtype, _out(eqn).shape)).result
            out = select(is_k, values[k], out)
        return out

    @rule(lax.convert_element_type_p)
    def _convert(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        return convert(d, x, _in(eqn).dtype, _out(eqn).dtype, _out(eqn).shape)

    # --- reductions

    kinds = {lax.reduce_sum_p: "add", lax.reduce_max_p: "max", lax.reduce_min_p: "min",
             lax.reduce_and_p: "and", lax.reduce_or_p: "or"}

    @rule(*kinds)
    def _reduce(state: LoweringState, eqn: Any, x: ir.Value) -> ir.Value:
        kind, dtype = kinds[eqn.primitive], _in(eqn).dtype
        if kind in ("and", "or") and is_float(dtype):
            raise _refuse(state, eqn, dtype)
        if dtype == np.bool_:
            if kind == "add":
                raise _refuse(state, eqn, dtype)
            kind = {"max": "or", "min": "and"}.get(kind, kind)
        return d.reduce(state, eqn, x, tuple(eqn.params["axes"]), kind)

    @rule(threefry2x32_p)
    def _threefry(state: LoweringState, eqn: Any, *args: ir.Value) -> list[Any]:
        expansion = _jax.threefry2x32_expansion([v.aval for v in eqn.invars])
        return d.lower_jaxpr(state, expansion.jaxpr, expansion.consts, args)

    @rule(*_jax.KEY_PRIMITIVES)
    def _keys(state: LoweringState, eqn: Any, *args: Any) -> Any:
        """``jax.random`` on a key array: the key implementation's function on the key's
        words, inlined (as JAX's TPU lowering does)."""
        expansion = _jax.key_expansion(eqn)
        if isinstance(expansion, str):
            raise state.fail(f"{eqn.primitive.name}: {expansion}", eqn)
        outs = d.lower_jaxpr(state, expansion.jaxpr, expansion.consts, args)
        return outs if eqn.primitive.multiple_results else outs[0]

    @rule(_jax.random_wrap_p, _jax.random_unwrap_p)
    def _key_words(state: LoweringState, eqn: Any, x: Any) -> Any:
        return x  # a key is held as its words: wrapping and unwrapping change the type only

    # --- control flow

    @rule(*CALL_PRIMITIVES)
    def _inline(state: LoweringState, eqn: Any, *args: Any) -> list[Any]:
        jaxpr, consts = called_jaxpr(eqn)
        return d.lower_jaxpr(state, jaxpr, consts, args)

    @rule(_jax.stage_p)
    def _stage(state: LoweringState, eqn: Any, x: Any) -> Any:
        return x  # staging a value for tracing: the value itself once traced

    if _jax.custom_fusion_p is not None:
        @rule(_jax.custom_fusion_p)
        def _custom_fusion(state: LoweringState, eqn: Any, *args: Any) -> list[Any]:
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

    def types(avals: Sequence[Any]) -> list[ir.Type]:
        physical = [_jax.physical_aval(a) for a in avals]  # a key array as its words
        return [d.value_type(a.shape, a.dtype) for a in physical]

    @rule(_jax.cond_p)
    def _cond(state: LoweringState, eqn: Any, index: ir.Value, *ops: Any) -> list[Any]:
        branches = eqn.params["branches"]
        out_types = types([v.aval for v in eqn.outvars])

        def emit(k: int) -> list[Any]:
            """Branch ``k`` if the index is ``k``, else the branches after it (the last one
            takes every index past it, as lax.switch clamps)."""
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

    @rule(_jax.while_p)
    def _while(state: LoweringState, eqn: Any, *args: Any) -> list[Any]:
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

    @rule(_jax.scan_p)
    def _scan(state: LoweringState, eqn: Any, *args: Any) -> list[Any]:
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

    return rules


_ERF_INV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06,
                    0.00021858087, -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
"""Giles' coefficients of erfinv(x) / x for w = -log(1 - x^2) < 5, in powers of w - 2.5."""
_ERF_INV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844,
                 0.00573950773, -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)
"""The same for w >= 5, in powers of sqrt(w) - 3."""


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
