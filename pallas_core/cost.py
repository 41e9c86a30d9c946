"""``pl.estimate_cost``: a ``CostEstimate`` for a ``pallas_call`` from the plain JAX function
that it replaces.

The function is traced to a jaxpr and each equation counted by a rule of its primitive:

* elementwise binary arithmetic (add, sub, mul, div, min, max, and, or, xor): one flop per
  output element;
* negation, floor, ceil, round, not: one flop per element;
* exp, log, logistic, sqrt, tanh and the trigonometric functions: one transcendental per
  element;
* ``integer_pow`` by ``y``: square-and-multiply, ``floor(log2 y)`` squarings and one multiply
  per set bit of ``y``, per element (nothing for ``y`` of 0 or 1);
* ``dot_general``: two flops (a multiply and an add) per term of each output element.

Other primitives count nothing; the bodies of ``jit``, ``custom_vjp`` and ``run_state`` are
counted, those of control flow are not. ``bytes_accessed`` is what the function reads and writes:
the bytes of its arguments and its results. These are the rules of JAX's
``jax.experimental.pallas.estimate_cost``, so both give the same estimate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax

from pallas_core import _jax
from pallas_core.spec import CostEstimate


@dataclasses.dataclass(frozen=True)
class _Cost:
    flops: int = 0
    transcendentals: int = 0

    def __add__(self, other: _Cost) -> _Cost:
        return _Cost(self.flops + other.flops, self.transcendentals + other.transcendentals)


def element_count(aval: Any) -> int:
    """How many elements a value of ``aval`` has."""
    return math.prod(aval.shape)


def _nbytes(aval: Any) -> int:
    return element_count(aval) * np.dtype(aval.dtype).itemsize


def _per_output(eqn: Any) -> _Cost:
    return _Cost(flops=element_count(eqn.outvars[0].aval))


def _per_input(eqn: Any) -> _Cost:
    return _Cost(flops=element_count(eqn.invars[0].aval))


def _transcendental(eqn: Any) -> _Cost:
    return _Cost(transcendentals=element_count(eqn.invars[0].aval))


def integer_pow_flops(eqn: Any) -> int:
    """Square-and-multiply: ``floor(log2 y)`` squarings and a multiply per set bit of ``y``,
    per element (nothing for ``y`` of 0 or 1)."""
    y = abs(int(eqn.params["y"]))
    per_element = 0 if y in (0, 1) else (y.bit_length() - 1) + bin(y).count("1")
    return element_count(eqn.invars[0].aval) * per_element


def dot_general_flops(eqn: Any) -> int:
    """Two flops (a multiply and an add) per term of each output element."""
    (lhs_contract, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    terms = math.prod(lhs[d] for d in lhs_contract)
    lhs_free = math.prod(s for d, s in enumerate(lhs) if d not in lhs_contract)
    rhs_free = math.prod(s for d, s in enumerate(rhs)
                         if d not in rhs_contract and d not in rhs_batch)
    return 2 * terms * lhs_free * rhs_free


def _body(param: str, closed: bool) -> Callable[[Any], _Cost]:
    def rule(eqn: Any) -> _Cost:
        sub = eqn.params[param]
        return _jaxpr_cost(sub.jaxpr if closed else sub)
    return rule


_RULES: dict[Any, Callable[[Any], _Cost]] = {
    **{p: _per_output for p in (lax.add_p, lax.mul_p, lax.sub_p, lax.div_p, lax.min_p,
                                lax.max_p, lax.or_p, lax.and_p, lax.xor_p)},
    **{p: _per_input for p in (lax.neg_p, lax.floor_p, lax.ceil_p, lax.round_p, lax.not_p)},
    **{p: _transcendental for p in (lax.cos_p, lax.sin_p, lax.tan_p, lax.sinh_p, lax.cosh_p,
                                    lax.tanh_p, lax.acos_p, lax.asin_p, lax.atan_p, lax.exp_p,
                                    lax.log_p, lax.logistic_p, lax.sqrt_p)},
    lax.integer_pow_p: lambda eqn: _Cost(flops=integer_pow_flops(eqn)),
    lax.dot_general_p: lambda eqn: _Cost(flops=dot_general_flops(eqn)),
    _jax.jit_p: _body("jaxpr", closed=True),
    _jax.custom_vjp_call_p: _body("call_jaxpr", closed=True),
    _jax.run_state_p: _body("jaxpr", closed=False),
}


def _jaxpr_cost(jaxpr: Any) -> _Cost:
    total = _Cost()
    for eqn in jaxpr.eqns:
        rule = _RULES.get(eqn.primitive)
        if rule is not None:
            total = total + rule(eqn)
    return total


def estimate_cost(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> CostEstimate:
    """The cost of ``fun(*args, **kwargs)``, for ``pallas_call(cost_estimate=...)``.

    ``args`` are arrays or ``jax.ShapeDtypeStruct``s (pytrees of them); ``kwargs`` are passed
    as they are (static). Counts flops and transcendentals per equation of the traced function
    (see the module's documentation) and the bytes of the arguments and results.
    """
    flat = jax.tree_util.tree_leaves(args)
    specs = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in flat]
    tree = jax.tree_util.tree_structure(args)

    def flat_fun(*leaves: Any) -> Any:
        return fun(*jax.tree_util.tree_unflatten(tree, leaves), **kwargs)

    closed = jax.make_jaxpr(flat_fun)(*specs)
    cost = _jaxpr_cost(closed.jaxpr)
    read = sum(_nbytes(s) for s in specs)
    written = sum(_nbytes(v.aval) for v in closed.jaxpr.outvars)
    return CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                        bytes_accessed=read + written)

