"""Mosaic TPU's rule table :data:`RULES` and :func:`rule`, which registers into it, with what
every rule module shares: the lowering state :class:`Lowering` (and :class:`AccRef`, an ``ACC``
Ref while a kernel is lowered), Mosaic's :data:`DIALECT` for the shared rules,
:func:`lower_jaxpr` and the avals of an equation's operands and result.

This module imports no rule module: the rule modules (``rules_*``, ``primitives``,
``elementwise``, ``memory``, ``mxu``) import it and register their rules when imported;
:mod:`pallas_mosaic_tpu.lowering` imports them, so the table is full once
:func:`pallas_mosaic_tpu.lowering.lowering_rules` has been called. :data:`RULES` starts as the
shared rules (``pallas_core.mlir_rules``) for :data:`DIALECT`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import vector

from pallas_core import backend as plb
from pallas_core.backend import LoweringState
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.params import AccMemorySpace


@dataclasses.dataclass
class Lowering(LoweringState):
    """Lowering state of one Mosaic kernel: also the ``shard_map`` mesh it runs under."""

    mesh_axes: tuple[tuple[str, int], ...] = ()
    """``(name, size)`` of the mesh axes, major to minor; device ids are linear over them."""
    rules: Any = None
    """The rules to lower with (``None``: this backend's; the SparseCore backend extends them)."""
    scratch_type: Any = None
    """``(shape, dtype, memory_space) -> memref type`` of scratch and ``run_scoped`` buffers
    (``None``: this backend's; the SparseCore backend adds its shared VMEM)."""
    accumulators: dict[int, int] = dataclasses.field(default_factory=dict)
    """Entries of each MXU's accumulator memory given out so far (``pltpu.ACC`` Refs)."""

    def alloc_accumulator(self, shape: Sequence[int], dtype: Any, space: AccMemorySpace,
                          eqn: Any = None) -> AccRef:
        """An ``ACC`` Ref's place in its MXU's accumulator memory, as JAX's lowering gives it:
        the next free entries (``num_sublanes`` rows by the MXU's columns each), addressed in
        vector registers. Entries are never given back, as in JAX."""
        from pallas_mosaic_tpu import tpu_info

        # The chip lowered for, else (lowering on a machine without a TPU, no target named)
        # Mosaic TPU's default chip, v5e.
        info = (tpu_info.get_tpu_info() if tpu_info.is_tpu_device()
                else tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1))
        what = f"a pltpu.ACC({space.mxu_id}) Ref of shape {tuple(shape)}"
        if not info.num_accumulators:
            raise self.fail(f"{what} on TPU {info.chip_version} (its MXUs have no accumulator "
                            "memory; TPU 7 and later have: lower with target='v7x', or "
                            "multiply with jnp.dot)", eqn)
        rows = math.prod(shape[:-1])
        if (space.mxu_id >= info.num_mxus or shape[-1] != info.mxu_column_size
                or rows % info.num_sublanes):
            raise self.fail(f"{what} on TPU {info.chip_version} (an accumulator has "
                            f"{info.mxu_column_size} columns, a multiple of "
                            f"{info.num_sublanes} rows, and an mxu_id below {info.num_mxus})",
                            eqn)
        base = self.accumulators.get(space.mxu_id, 0)
        entries = rows // info.num_sublanes
        if base + entries > info.num_accumulators:
            raise self.fail(f"{what}: MXU {space.mxu_id}'s accumulator memory is full "
                            f"({info.num_accumulators} entries of {info.num_sublanes} rows, "
                            f"{base} in use, {entries} more asked for; fewer or smaller ACC "
                            "Refs fit)", eqn)
        self.accumulators[space.mxu_id] = base + entries
        return AccRef(base * (info.mxu_column_size // info.num_lanes), tuple(shape),
                      np.dtype(dtype), space.mxu_id)


@dataclasses.dataclass(frozen=True)
class AccRef:
    """An ``ACC`` Ref while a kernel is lowered: no memref, an address in the accumulator
    memory of MXU ``mxu_id`` (in vector registers), which the ``tpu.matmul_*`` ops name."""

    base_address: int
    shape: tuple[int, ...]
    dtype: np.dtype
    mxu_id: int


Rule = plb.Rule


DIALECT = plb.Dialect(
    constant=mir.constant, broadcast_to=mir.broadcast_to, value_type=mir.value_type,
    lower_jaxpr=lambda *a: lower_jaxpr(*a), reduce=lambda *a: reduction(*a))
"""Mosaic's values: scalars, and vectors for arrays."""
RULES = plb.Rules(plb.shared_rules_table(DIALECT))
"""The shared rules (``pallas_core.mlir_rules``) and Mosaic TPU's own."""
rule = RULES.rule


def lower_jaxpr(lowering: Lowering, jaxpr: Any, consts: Sequence[Any],
                args: Sequence[Any]) -> list[Any]:
    """Emits ``jaxpr`` at the current insertion point; returns its outputs' values."""
    return plb.lower_jaxpr(lowering, lowering.rules or RULES, jaxpr, consts, args,
                                     _literal)


_literal = plb.splat_literal(mir.constant, "Mosaic")


def in_aval(eqn: Any, i: int = 0) -> Any:
    """The aval of operand ``i`` of ``eqn``."""
    return eqn.invars[i].aval


def out_aval(eqn: Any) -> Any:
    """The aval of the (first) result of ``eqn``."""
    return eqn.outvars[0].aval


def reduction(lowering: Lowering, eqn: Any, x: ir.Value, axes: Sequence[int],
              kind: str) -> ir.Value:
    """A ``vector.multi_reduction`` of ``kind`` (as ``mlir_rules.Dialect.reduce`` says)."""
    dtype, out = in_aval(eqn).dtype, out_aval(eqn)
    name = kind
    if kind in ("max", "min"):
        name = (kind + "imumf" if mir.is_float(dtype)
                else kind + ("ui" if mir.is_unsigned(dtype) else "si"))
    acc = mir.constant(plb.reduction_identity(kind, dtype), dtype, out.shape)
    return vector.MultiDimReductionOp(ir.Attribute.parse(f"#vector.kind<{name}>"), x, acc,
                                      list(axes)).result
