"""The Triton backend's rule table :data:`RULES` and :func:`rule`, which registers into it,
with what every rule module shares: the lowering state :class:`Lowering`, Triton's
:data:`DIALECT` for the shared rules, :func:`lower_jaxpr` and :func:`convert`.

This module imports no rule module: :mod:`pallas_triton.lowering` and
:mod:`pallas_triton.lowering_arrays` import it and register their rules when imported, and
``lowering`` imports ``lowering_arrays``, so the table is full once ``lowering`` is imported.
:data:`RULES` starts as the shared rules (``pallas_core.mlir_rules``) for :data:`DIALECT`;
Triton's own rules override the few that differ (``tanh``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxlib.mlir import ir
from jaxlib.triton import dialect as tt

from pallas_core import backend as plb
from pallas_core.backend import LoweringState
from pallas_triton import ir as tir


@dataclasses.dataclass
class Lowering(LoweringState):
    """The lowering state, and the platform the module is for (the few rules that differ)."""

    platform: str = "cuda"


def lower_jaxpr(lowering: Lowering, jaxpr: Any, consts: Sequence[Any],
                args: Sequence[Any]) -> list[Any]:
    """Emits ``jaxpr`` at the current insertion point; returns its outputs' values."""
    return plb.lower_jaxpr(lowering, RULES, jaxpr, consts, args, _literal)


_literal = plb.splat_literal(tir.constant, "Triton")


def reduce(lowering: Lowering, eqn: Any, x: ir.Value, axes: Sequence[int],
           kind: str) -> ir.Value:
    """A ``tt.reduce`` per axis, combining with ``kind``'s op (``mlir_rules.Dialect.reduce``)."""
    dtype = eqn.invars[0].aval.dtype
    combine = plb.reduction_op(kind, dtype)
    elt = tir.element_type(dtype)
    for axis in sorted(axes, reverse=True):
        red = tt.ReduceOp([x], axis)
        body = red.regions[0].blocks.append(elt, elt)
        with ir.InsertionPoint(body):
            tt.ReduceReturnOp([combine(*body.arguments).result])
        x = red.result[0] if isinstance(red.result, list) else red.results[0]
    return x


DIALECT = plb.Dialect(
    constant=tir.constant, broadcast_to=tir.broadcast_to, value_type=tir.value_type,
    lower_jaxpr=lambda *a: lower_jaxpr(*a), reduce=lambda *a: reduce(*a))
"""Triton's values: scalars, and ranked tensors for arrays."""
RULES = plb.Rules(plb.shared_rules_table(DIALECT))
"""The shared rules (``pallas_core.mlir_rules``), then Triton's own (``tanh``, memory, dot) and
its whole-array rules as their modules register them."""
rule = RULES.rule


def convert(x: ir.Value, src: Any, dst: Any, shape: Sequence[int]) -> ir.Value:
    """``x`` (of dtype ``src``) converted to ``dst`` as ``lax.convert_element_type`` does."""
    return plb.convert_dtype(DIALECT, x, src, dst, shape)
