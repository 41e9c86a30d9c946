"""``skip_floating_point_ops``: a kernel whose floating-point operations are not run.

The kernel jaxpr is rewritten before it is discharged: every floating-point value an equation
produces is replaced by an array of ``inf`` of its shape, and an equation that produces only
floating-point values and has no effects (no Ref operands, no prints) is dropped altogether.
Reads and writes of Refs, integer arithmetic and control flow still run (the bodies of loops,
conds and other nested jaxprs are rewritten the same way), so a kernel's memory traffic and
integer logic are exercised while its float math (matmuls, transcendentals) costs nothing;
every float the kernel stores is ``inf``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from pallas_core import backend as plb


def _is_float(aval: Any) -> bool:
    return (not isinstance(aval, plb.AbstractRef) and hasattr(aval, "dtype")
            and jnp.issubdtype(aval.dtype, jnp.floating))


class _Env:
    """Values of a jaxpr's variables; float values an equation produced are kept as their
    aval only, and read as ``inf``."""

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}
        self.skipped: set[Any] = set()

    def read(self, v: Any) -> Any:
        if isinstance(v, plb.Literal):
            return v.val
        if v in self.skipped:
            return jnp.full(v.aval.shape, jnp.inf, v.aval.dtype)
        return self.values[v]

    def write_results(self, outvars: Sequence[Any], values: Sequence[Any] | None) -> None:
        for k, v in enumerate(outvars):
            if _is_float(v.aval):
                self.skipped.add(v)
            elif values is not None:
                self.values[v] = values[k]


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          axis_env: Sequence[tuple[str, int]]) -> list[Any]:
    env = _Env()
    env.values.update(zip(jaxpr.constvars, consts))
    env.values.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        pure = not eqn.effects and not any(isinstance(v.aval, plb.AbstractRef)
                                           for v in eqn.invars)
        if pure and eqn.outvars and all(_is_float(v.aval) for v in eqn.outvars):
            env.write_results(eqn.outvars, None)
            continue
        params = {k: _rewrite_param(p, axis_env) for k, p in eqn.params.items()}
        with plb.user_context(eqn):
            out = eqn.primitive.bind(*[env.read(v) for v in eqn.invars],
                                     **eqn.primitive.get_bind_params(params))
        env.write_results(eqn.outvars, out if eqn.primitive.multiple_results else [out])
    return [env.read(v) for v in jaxpr.outvars]


def _rewrite_param(p: Any, axis_env: Sequence[tuple[str, int]]) -> Any:
    if isinstance(p, plb.ClosedJaxpr):
        return transform(p, axis_env)
    if isinstance(p, plb.Jaxpr):
        closed = transform(plb.ClosedJaxpr(p, []), axis_env)
        # An open jaxpr must stay open: keep the original if the rewrite needs constants.
        return closed.jaxpr if not closed.consts else p
    if isinstance(p, tuple) and p and all(isinstance(b, plb.ClosedJaxpr) for b in p):
        return tuple(transform(b, axis_env) for b in p)
    return p


def transform(closed: Any, axis_env: Sequence[tuple[str, int]] = ()) -> Any:
    """``closed`` (a kernel jaxpr, or a jaxpr nested in one) with its floating-point
    operations skipped (see the module docstring)."""
    jaxpr = closed.jaxpr

    def fn(*args: Any) -> list[Any]:
        return _eval(jaxpr, closed.consts, args, axis_env)

    new, _, consts = plb.trace_to_jaxpr(fn, [v.aval for v in jaxpr.invars],
                                         name="skip_floating_point_ops",
                                         axis_sizes=tuple(axis_env))
    return plb.ClosedJaxpr(new, consts)
