"""Shared machinery for backends that lower a kernel jaxpr to MLIR with per-primitive rules.

A backend keeps a :class:`Rules` registry (``rule(*primitives)`` decorates a function
``(state, eqn, *in_values) -> out value(s)``), a :class:`LoweringState` subclass with whatever
it tracks (program ids, refs), and calls :func:`lower_jaxpr` to emit a jaxpr at the current
insertion point. Errors name the primitive, the kernel and the user's source line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pallas_core import _jax
from pallas_core.errors import UnsupportedError
from pallas_core.request import KernelCall

Rule = Callable[..., Any]


class Rules(dict[Any, Rule]):
    """Primitive -> lowering rule, filled with the :meth:`rule` decorator."""

    def rule(self, *primitives: Any) -> Callable[[Rule], Rule]:
        """Registers a rule ``(state, eqn, *in_values) -> out value(s)`` for ``primitives``."""
        def register(fn: Rule) -> Rule:
            for p in primitives:
                self[p] = fn
            return fn
        return register


@dataclasses.dataclass
class LoweringState:
    """The state of lowering one kernel for ``backend``."""

    call: KernelCall
    backend: str
    program_ids: Sequence[Any] = ()
    location: str = "<unknown>"
    """The user's source line of the equation being lowered (of the innermost one known)."""

    def fail(self, what: str, eqn: Any = None) -> UnsupportedError:
        """An ``UnsupportedError`` for ``what``, naming the kernel and the source line."""
        return UnsupportedError(
            f"{what} is not supported by the {self.backend!r} backend (kernel "
            f"{self.call.name!r} at {self.location}). Fix: rewrite that part of the kernel, or "
            "run it with backend='interpret'.")


def lower_jaxpr(state: LoweringState, rules: Rules, jaxpr: Any, consts: Sequence[Any],
                args: Sequence[Any], literal: Callable[[Any, Any], Any]) -> list[Any]:
    """Emits ``jaxpr`` with ``rules``; returns its outputs' values.

    ``literal(value, aval)`` makes the IR value of a constant.
    """
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return literal(v.val, v.aval) if isinstance(v, _jax.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = literal(c, v.aval)
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        line = _jax.source_line(eqn)
        if line != "<unknown>":
            state.location = line
        fn = rules.get(eqn.primitive)
        if fn is None:
            raise state.fail(f"the primitive {eqn.primitive.name!r}", eqn)
        outs = fn(state, eqn, *[read(v) for v in eqn.invars])
        if eqn.primitive.multiple_results:
            env.update(zip(eqn.outvars, outs))
        else:
            env[eqn.outvars[0]] = outs
    return [read(v) for v in jaxpr.outvars]
