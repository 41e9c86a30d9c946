"""The StableHLO programs JAX writes to compute a symbolic dimension, run with numpy.

``jax.export`` with shape polymorphism computes each symbolic dimension (``floordiv(m, 8)``,
``2*m + n``, ...) from the values of its dimension variables with a small program of integer
scalar operations (``jax._src.core.evaluate_shape``, exported). A backend that exports
kernels with symbolic shapes (Mosaic TPU) carries such programs in its module, and its
runtime runs them for each call's shapes; an emulator does the same with :func:`run`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pallas_core import _jax
from pallas_core.emulation.arith import _divsi, _remsi
from pallas_core.emulation.machine import Compiler, Rule
from pallas_core.emulation.types import attribute_array, dtype_of
from pallas_core.errors import PallasError

_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}


def _binary(fn: Callable[[Any, Any], Any]) -> Rule:
    def rule(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        dtype = dtype_of(op.results[0].type)
        return lambda a, b: np.asarray(fn(np.asarray(a), np.asarray(b))).astype(dtype)
    return rule


def _unary(fn: Callable[[Any], Any]) -> Rule:
    def rule(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        dtype = dtype_of(op.results[0].type)
        return lambda a: np.asarray(fn(np.asarray(a))).astype(dtype)
    return rule


def _constant(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    value = attribute_array(op.attributes["value"], op.results[0].type)
    return lambda: value


def _compare(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    found = re.search(r"comparison_direction\s+(\w+)", str(op.attributes["comparison_direction"]))
    assert found is not None
    fn = _COMPARE[found.group(1)]
    return lambda a, b: fn(np.asarray(a), np.asarray(b))


def _select(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    return lambda p, a, b: np.where(p, a, b)


def _logical(fn: Callable[[Any, Any], Any]) -> Rule:
    return lambda c, op: lambda a, b: fn(np.asarray(a), np.asarray(b))


RULES: dict[str, Rule] = {
    "stablehlo.constant": _constant,
    "stablehlo.convert": _unary(lambda a: a),
    "stablehlo.reshape": _unary(lambda a: a),
    "stablehlo.add": _binary(np.add),
    "stablehlo.subtract": _binary(np.subtract),
    "stablehlo.multiply": _binary(np.multiply),
    "stablehlo.divide": _binary(_divsi),
    "stablehlo.remainder": _binary(_remsi),
    "stablehlo.maximum": _binary(np.maximum),
    "stablehlo.minimum": _binary(np.minimum),
    "stablehlo.negate": _unary(np.negative),
    "stablehlo.abs": _unary(np.abs),
    "stablehlo.sign": _unary(np.sign),
    "stablehlo.not": _unary(np.logical_not),
    "stablehlo.and": _logical(np.logical_and),
    "stablehlo.or": _logical(np.logical_or),
    "stablehlo.compare": _compare,
    "stablehlo.select": _select,
}
"""The integer scalar operations of a dimension program (``func.call`` comes with every
machine)."""


def run(program: str, dims: Sequence[int]) -> int:
    """The dimension ``program`` (StableHLO text, ``@main`` taking one int32 per dimension
    variable) computes from the values ``dims``."""
    with _jax.make_ir_context():
        module = ir.Module.parse(program)
        compiler = Compiler(RULES, backend="symbolic dimension", module=module)
        (value,) = compiler.function("main")(*[np.int32(d) for d in dims])
    value = int(np.asarray(value))
    if value < 0:
        raise PallasError(f"a symbolic dimension computed from dimension values {list(dims)} "
                          f"is {value}, below 0. Fix: call the exported function with shapes "
                          "that meet its polymorphic shape constraints.")
    return value
