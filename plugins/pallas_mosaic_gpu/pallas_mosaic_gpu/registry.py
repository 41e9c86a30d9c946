"""The Mosaic GPU backend's rule table :data:`RULES` and :func:`rule`, which registers into
it. This module imports no rule module: each rule module imports it and registers its rules
when imported, and :mod:`pallas_mosaic_gpu.rules` imports every rule module, so the table is
full once that is imported (the plugin's lowering does so), whichever is imported first.

Every entry of :data:`RULES` has the one rule signature all MLIR backends share,
``pallas_core.backend.Rule``: ``rule(state, eqn, *in_values)``, with ``state`` the
:class:`~pallas_mosaic_gpu.values.GPULowering` of the kernel, ``eqn`` the equation and
``in_values`` its operands' values (:mod:`pallas_mosaic_gpu.values`); it returns the output's
value, or a list of them. :func:`rule` adapts a rule body, which also takes the equation's
parameters as keywords, to that signature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pallas_core import backend as plb
from pallas_mosaic_gpu.values import GPULowering, literal

RULES = plb.Rules()
LAZY_OK: set[Any] = set()
"""The primitives registered with ``rule(..., lazy=True)``: their rules take reads of whole
SMEM Refs (:class:`~pallas_mosaic_gpu.values.Loaded`) unmaterialised."""


def rule(*primitives: Any, lazy: bool = False) -> Callable[[Any], Any]:
    """Registers ``fn(state, eqn, *in_values, **eqn.params)`` in :data:`RULES` for each of
    ``primitives``, as a callable of the shared signature ``pallas_core.backend.Rule``
    (``rule(state, eqn, *in_values)``); unless ``lazy``, reads of whole SMEM Refs
    (:class:`~pallas_mosaic_gpu.values.Loaded`) reach it as arrays."""
    def register(fn: Any) -> Any:
        def lazy_rule(state: GPULowering, eqn: Any, *args: Any) -> Any:
            return fn(state, eqn, *args, **eqn.params)

        def materialized(state: GPULowering, eqn: Any, *args: Any) -> Any:
            return fn(state, eqn, *[state.value(a) for a in args], **eqn.params)
        for p in primitives:
            RULES[p] = lazy_rule if lazy else materialized
            if lazy:
                LAZY_OK.add(p)
        return fn
    return register


def lower_jaxpr(state: GPULowering, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]
                ) -> list[Any]:
    """Emits ``jaxpr`` at the current insertion point by the rules of :data:`RULES`."""
    return plb.lower_jaxpr(state, RULES, jaxpr, consts, args, literal)
