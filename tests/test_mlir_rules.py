"""The shared lowering rules (``pallas_core.mlir_rules``) checked on their own: their constants,
written out in numpy, and each rule imported by name, lowering one equation into a module that
the core's emulator runs, against JAX's reference functions."""

from __future__ import annotations

import ast
import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, func

from pallas_core import backend as plb
from pallas_core import mlir_rules
from pallas_core.emulation import Compiler
from pallas_core.emulation.arith import RULES
from pallas_core.errors import UnsupportedError
from pallas_core.mlir_lowering import LoweringState, element_type, is_float, lower_jaxpr


def _horner(coeffs: tuple[float, ...], w: np.ndarray) -> np.ndarray:
    p = np.full_like(w, coeffs[0])
    for k in coeffs[1:]:
        p = np.float32(k) + p * w
    return p


def test_erf_inv_polynomial_matches_jax() -> None:
    """The two-range polynomial the ``erf_inv`` rule emits, in float32, is within 1e-5
    (relative) of ``jax.scipy.special.erfinv`` on random points of (-1, 1)."""
    x = np.asarray(jax.random.uniform(jax.random.key(0), (100_000,), jnp.float32,
                                      -0.999999, 0.999999))
    w = -np.log((np.float32(1) - x) * (np.float32(1) + x))
    central = _horner(mlir_rules._ERF_INV_CENTRAL, w - np.float32(2.5))
    tail = _horner(mlir_rules._ERF_INV_TAIL, np.sqrt(w) - np.float32(3))
    ours = np.where(w < 5, central, tail) * x
    want = np.asarray(jax.scipy.special.erfinv(jnp.asarray(x)))
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-7)


# --- each shared rule by name, on scalars, emulated against jax.numpy


def _scalar(value: Any, dtype: Any, shape: Sequence[int]) -> ir.Value:
    assert not tuple(shape), "the test dialect has scalars only"
    elt = element_type(dtype)
    attr = (ir.FloatAttr.get(elt, float(value)) if is_float(dtype)
            else ir.IntegerAttr.get(elt, int(value)))
    return arith.ConstantOp(elt, attr).result


def _no_reduce(state: Any, eqn: Any, *_: Any) -> Any:
    raise state.fail(f"{eqn.primitive.name} of a scalar", eqn)


SCALARS: mlir_rules.Dialect = mlir_rules.Dialect(
    constant=_scalar, broadcast_to=lambda v, shape: v,
    value_type=lambda shape, dtype: element_type(dtype),
    lower_jaxpr=lambda state, jaxpr, consts, args: lower_jaxpr(
        state, mlir_rules.table(SCALARS), jaxpr, consts, args,
        lambda value, aval: _scalar(value, aval.dtype, ())),
    reduce=_no_reduce)
"""Scalars as plain MLIR scalars: the smallest dialect the shared rules take."""


def _state() -> LoweringState:
    return LoweringState(call=cast(Any, types.SimpleNamespace(name="k")), backend="test")


def _emulate(rule: Any, fn: Callable[..., Any], rows: Sequence[Sequence[Any]]
             ) -> tuple[str, list[tuple[Any, ...]]]:
    """``fn`` lowered into ``@f``, its last equation by the shared ``rule`` called by name
    (any before it by the shared table); the module's text, and ``@f`` run by the core's
    emulator on each row of operands."""
    jaxpr = jax.make_jaxpr(fn)(*rows[0]).jaxpr
    shared = mlir_rules.table(SCALARS)
    with plb.make_ir_context(), ir.Location.unknown():
        module = ir.Module.create()
        ins = [element_type(v.aval.dtype) for v in jaxpr.invars]
        outs = [element_type(v.aval.dtype) for v in jaxpr.outvars]
        with ir.InsertionPoint(module.body):
            f = func.FuncOp("f", (ins, outs))
            with ir.InsertionPoint(f.add_entry_block()):
                env = dict(zip(jaxpr.invars, f.arguments))
                for eqn in jaxpr.eqns:
                    args = [_scalar(v.val, v.aval.dtype, ()) if hasattr(v, "val") else env[v]
                            for v in eqn.invars]
                    if eqn is jaxpr.eqns[-1]:
                        out = rule(SCALARS, _state(), eqn, *args)
                    else:
                        out = shared[eqn.primitive](_state(), eqn, *args)
                    env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results
                                   else [out]))
                func.ReturnOp([env[v] for v in jaxpr.outvars])
        assert module.operation.verify()
        run = Compiler(RULES, backend="test", module=module).function("f")
        return str(module), [run(*(np.asarray(a) for a in row)) for row in rows]


I32, U32, F32 = np.int32, np.uint32, np.float32
NAN = float("nan")


def _pairs(dtype: Any, xs: Sequence[float], ys: Sequence[float]) -> list[tuple[Any, Any]]:
    return [(dtype(x), dtype(y)) for x in xs for y in ys]


NAMED_CASES: list[tuple[str, Callable[..., Any], list[Any], tuple[str, ...]]] = [
    ("binary_rule", lax.div, _pairs(I32, [7, -7], [2, -2]), ("arith.divsi",)),
    ("binary_rule", lax.div, _pairs(U32, [7, 4000000000], [2, 3]), ("arith.divui",)),
    ("compare_rule", lax.ne, _pairs(F32, [1.0, NAN], [1.0, NAN]), ("arith.cmpf une",)),
    ("compare_rule", lax.lt, _pairs(U32, [1, 4000000000], [2]), ("arith.cmpi ult",)),
    ("shift_rule", lax.shift_left, _pairs(I32, [-8, 5], [0, 3, 31, 32, 40]),
     ("arith.shli", "arith.cmpi uge", "arith.select")),
    ("shift_rule", lax.shift_right_arithmetic, _pairs(I32, [-8, 5], [0, 3, 32, 40]),
     ("arith.shrsi",)),
    ("shift_rule", lax.shift_right_logical, _pairs(I32, [-8, 5], [0, 3, 32, 40]),
     ("arith.shrui",)),
    ("clamp_rule", lax.clamp, [(I32(0), I32(x), I32(5)) for x in (-3, 2, 9)],
     ("arith.maxsi", "arith.minsi")),
    ("mulhi_rule", lax.mulhi, _pairs(I32, [-7, 2**30], [3, -(2**31)]), ("arith.mulsi_extended",)),
    ("mulhi_rule", lax.mulhi, _pairs(U32, [7, 4000000000], [3000000000]),
     ("arith.mului_extended",)),
    ("nextafter_rule", lax.nextafter, _pairs(F32, [0.0, 1.0, -1.0, NAN], [-1.0, 1.0, 2.0, NAN]),
     ("arith.bitcast",)),
    ("float_unary_rule", lax.exp, [(F32(x),) for x in (-1.0, 0.0, 2.0)], ("math.exp",)),
    ("integer_unary_rule", lax.population_count, [(I32(x),) for x in (0, 7, -1)],
     ("math.ctpop",)),
    ("integer_unary_rule", lax.clz, [(I32(x),) for x in (0, 1, -1)], ("math.ctlz",)),
    ("round_rule", lax.round, [(F32(x),) for x in (0.5, 1.5, -2.5)], ("math.round",)),
    ("neg_rule", lax.neg, [(I32(x),) for x in (0, 3, -3)], ("arith.subi",)),
    ("abs_rule", lax.abs, [(F32(x),) for x in (-2.0, -0.0, 3.0)], ("math.absf",)),
    ("sign_rule", lax.sign, [(F32(x),) for x in (-2.0, -0.0, 0.0, NAN, 3.0)],
     ("arith.cmpf ueq",)),
    ("sign_rule", lax.sign, [(I32(x),) for x in (-2, 0, 3)], ("arith.cmpi sgt",)),
    ("not_rule", lax.bitwise_not, [(I32(x),) for x in (0, 5, -1)], ("arith.xori",)),
    ("not_rule", lax.bitwise_not, [(np.bool_(x),) for x in (False, True)], ("arith.xori",)),
    ("logistic_rule", lax.logistic, [(F32(x),) for x in (-3.0, 0.0, 3.0)], ("math.exp",)),
    ("is_finite_rule", lax.is_finite, [(F32(x),) for x in (1.0, np.inf, -np.inf, NAN)],
     ("arith.cmpf one",)),
    ("square_rule", lax.square, [(I32(x),) for x in (-3, 4)], ("arith.muli",)),
    ("integer_pow_rule", lambda x: lax.integer_pow(x, 5), [(I32(x),) for x in (-2, 3)],
     ("arith.muli",)),
    ("integer_pow_rule", lambda x: lax.integer_pow(x, -2), [(F32(x),) for x in (-2.0, 0.5)],
     ("arith.divf",)),
    ("integer_pow_rule", lambda x: lax.integer_pow(x, 0), [(F32(x),) for x in (NAN, 3.0)],
     ("arith.constant",)),
    ("erf_inv_rule", lax.erf_inv, [(F32(x),) for x in (-0.999, -0.5, 0.0, 0.3, 0.9999, 1.0)],
     ("math.log", "math.sqrt")),
    ("bitcast_rule", lambda x: lax.bitcast_convert_type(x, I32), [(F32(x),) for x in (1.0, -0.0)],
     ("arith.bitcast",)),
    ("convert_rule", lambda x: x.astype(np.bool_), [(F32(x),) for x in (0.5, 0.0, -0.0, NAN)],
     ("arith.cmpf une",)),
    ("convert_rule", lambda x: x.astype(np.uint8), [(I32(x),) for x in (3, 255, 256)],
     ("arith.trunci",)),
    ("convert_rule", lambda x: x.astype(F32), [(np.bool_(x),) for x in (False, True)],
     ("arith.uitofp",)),
    ("select_n_rule", lambda i, a, b, c: lax.select_n(i, a, b, c),
     [(I32(i), F32(1.0), F32(2.0), F32(3.0)) for i in (0, 1, 2)], ("arith.cmpi eq",)),
    ("cond_rule", lambda i, x: lax.switch(i, [lambda: x, lambda: -x, lambda: x * 2]),
     [(I32(i), F32(3.0)) for i in (-1, 0, 1, 2, 7)], ("scf.if",)),
    ("while_rule", lambda n: lax.while_loop(lambda c: c < n, lambda c: c * 2 + 1, I32(1)),
     [(I32(n),) for n in (0, 5, 100)], ("scf.while", "scf.condition")),
    ("scan_rule", lambda x: lax.fori_loop(0, 4, lambda i, c: c * x, F32(1.0)),
     [(F32(x),) for x in (2.0, -0.5)], ("scf.for",)),
    ("inline_rule", jax.jit(lambda x, y: x * y + 1), _pairs(I32, [2, -3], [5]), ("arith.muli",)),
]
"""``(rule's name, function of one primitive, rows of operands, ops the rule emits)``."""


@pytest.mark.parametrize("name, fn, rows, ops", NAMED_CASES,
                         ids=[f"{c[0]}-{k}" for k, c in enumerate(NAMED_CASES)])
def test_shared_rule_by_name(name: str, fn: Callable[..., Any], rows: list[Any],
                             ops: tuple[str, ...]) -> None:
    """Each shared rule, imported by name and called on one equation, emits its ops, and the
    module (run by the core's emulator) computes what ``jax.numpy`` does."""
    rule = getattr(mlir_rules, name)
    last = jax.make_jaxpr(fn)(*rows[0]).jaxpr.eqns[-1]
    assert mlir_rules.SHARED_RULES[last.primitive] is rule
    text, got = _emulate(rule, fn, rows)
    assert all(op in text for op in ops), text
    for row, outs in zip(rows, got):
        want = np.asarray(jax.jit(fn)(*row))  # MLIR's integers are signless: as JAX's dtype
        np.testing.assert_allclose(np.asarray(outs[0]).astype(want.dtype), want, rtol=1e-5,
                                   err_msg=f"{name} on {row}")


def test_shared_rule_refuses_by_name() -> None:
    """A named rule refuses a dtype it cannot take, naming the operation, the dtype and the
    backend."""
    with pytest.raises(UnsupportedError, match="mulhi on int16 is not supported by the 'test'"):
        _emulate(mlir_rules.mulhi_rule, lax.mulhi, [(np.int16(3), np.int16(4))])


def test_every_shared_rule_is_a_named_module_function() -> None:
    """Each rule of ``SHARED_RULES`` is importable from ``mlir_rules`` under its own name."""
    for prim, rule in mlir_rules.SHARED_RULES.items():
        assert rule.__name__.endswith("_rule"), prim
        assert getattr(mlir_rules, rule.__name__) is rule, prim


def test_table_is_the_shared_rules_bound_to_a_dialect() -> None:
    """``table(d)`` has every shared primitive, each rule bound to ``d``; a rule serving
    several primitives is one function there too, and a backend's override replaces its
    entry alone."""
    rules = mlir_rules.table(SCALARS)
    assert list(rules) == list(mlir_rules.SHARED_RULES)
    for prim, rule in rules.items():
        assert isinstance(rule, functools.partial)
        assert rule.func is mlir_rules.SHARED_RULES[prim] and rule.args == (SCALARS,)
    assert rules[lax.add_p] is rules[lax.sub_p]
    rules.rule(lax.tanh_p)(_no_reduce)  # a backend's own rule, over the shared one
    assert rules[lax.tanh_p] is _no_reduce and rules[lax.exp_p].func is mlir_rules.float_unary_rule


def test_no_function_over_80_lines() -> None:
    """The shared rules are small module-level functions, not one function of closures."""
    tree = ast.parse(inspect.getsource(mlir_rules))
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno is not None and n.end_lineno - n.lineno + 1 > 80}
    assert not long, f"functions over 80 lines in pallas_core.mlir_rules: {long}"
