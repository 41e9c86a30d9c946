"""Memory-space helpers and compiler hints of ``jax.experimental.pallas.tpu``, each with
reference semantics for the interpreter and a Mosaic lowering rule.

* ``with_memory_space_constraint(x, memory_space)``: ``x`` unchanged; a placement hint for a
  ``pallas_call`` operand (JAX's lowering emits nothing for it either).
* ``has_memory_space(ref, memory_space)``: whether a ``pl.ANY`` Ref is in ``memory_space``
  when the kernel runs. The interpreter keeps ``pl.ANY`` operands in HBM, so it answers True
  for ``pltpu.HBM`` only; Mosaic resolves ``tpu.memref_memory_space_is`` when it compiles
  (jaxlib 0.12 and newer; older ones have no such op and the rule raises naming it).
* ``trace_value(label, value)``: an int32/float32 scalar recorded in the enclosing xprof
  trace region (``tpu.trace_value``); the interpreter has no trace and records nothing.
* ``annotate(ref, *, no_store=..., ...)``: access hints for Mosaic's scheduler; the Ref itself
  is returned, since the hints never change what a kernel computes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxlib.mlir import ir
from jaxlib.mosaic.python import tpu

from pallas_core import ANY
from pallas_core import backend as plb
from pallas_core.backend import MemorySpace, PallasError, PrimitiveSemantics, ReferenceContext
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.params import HBM, SMEM, VMEM
from pallas_mosaic_tpu.params import MemorySpace as TpuMemorySpace
from pallas_mosaic_tpu.registry import Lowering, rule


def with_memory_space_constraint(x: jax.Array, memory_space: Any) -> jax.Array:
    """``x`` itself, asking that it be placed in ``memory_space`` (``pl.ANY``, ``pltpu.HBM``,
    ``pltpu.VMEM`` or ``pltpu.SMEM``) when passed to a ``pallas_call``. Values never depend on
    it; this backend passes the operand as its ``BlockSpec`` says."""
    if memory_space is ANY:
        return x
    if not any(memory_space is s for s in (HBM, VMEM, SMEM)):
        raise PallasError(
            f"pltpu.with_memory_space_constraint: memory_space must be pl.ANY, pltpu.HBM, "
            f"pltpu.VMEM or pltpu.SMEM, found {memory_space!r}. Fix: pick one of those.")
    return x


# --- has_memory_space ----------------------------------------------------------------------

has_memory_space_p = plb.Primitive("tpu_has_memory_space")
has_memory_space_p.def_abstract_eval(
    lambda ref, *, memory_space: plb.ShapedArray((), jnp.bool_))


def _base_ref(ref: Any) -> Any:
    return getattr(ref, "ref", ref)


def has_memory_space(ref: Any, memory_space: Any) -> jax.Array:
    """A boolean scalar: whether ``ref`` (a ``pl.ANY`` Ref, or a view of one) is in
    ``memory_space`` (a ``pltpu.MemorySpace``) when the kernel runs; branch on it with
    ``pl.when`` or ``lax.cond``."""
    base = _base_ref(ref)
    space = getattr(plb.typeof(base), "memory_space", None)
    if space is not ANY:
        raise PallasError(f"pltpu.has_memory_space needs a Ref in pl.ANY, found one in "
                          f"{space}. Fix: pass an operand with BlockSpec(memory_space=pl.ANY).")
    if not isinstance(memory_space, TpuMemorySpace):
        raise PallasError(f"pltpu.has_memory_space(..., {memory_space!r}): expected a concrete "
                          "pltpu.MemorySpace (e.g. pltpu.HBM, pltpu.VMEM), not pl.ANY.")
    return has_memory_space_p.bind(base, memory_space=memory_space)  # type: ignore[no-any-return]


def _has_memory_space_discharge(in_avals: Any, out_avals: Any, ref: Any, *,
                                memory_space: MemorySpace) -> Any:
    # The Ref is only looked at, never read or written: it stays as it is.
    return (None,), jnp.asarray(memory_space is HBM)


@rule(has_memory_space_p)
def _has_memory_space_lowering(lowering: Lowering, eqn: Any, ref: ir.Value) -> ir.Value:
    op = getattr(tpu, "MemRefMemorySpaceIsOp", None)
    if op is None:
        raise lowering.fail("pltpu.has_memory_space (this jaxlib's Mosaic dialect has no "
                            "tpu.memref_memory_space_is; jaxlib 0.12 has it)", eqn)
    space = eqn.params["memory_space"]
    return op(ref, mir.memory_space(space.value)).result  # type: ignore[no-any-return]


# --- trace_value ---------------------------------------------------------------------------


class TraceEffect(plb.Effect):
    """Recording into the xprof trace: keeps ``trace_value`` in the kernel, in order."""


trace_effect = TraceEffect()
trace_value_p = plb.effect_primitive("tpu_trace_value", trace_effect)


def trace_value(label: str, value: jax.Array) -> None:
    """Records ``value`` (an int32 or float32 scalar) under ``label`` in the enclosing xprof
    trace region. The interpreter has no profiler trace: it records nothing."""
    if not isinstance(label, str):
        raise PallasError(f"pltpu.trace_value: label must be a str, found {label!r}.")
    v = jnp.asarray(value)
    if v.shape != () or v.dtype not in (jnp.int32, jnp.float32):
        raise PallasError(f"pltpu.trace_value takes an int32 or float32 scalar, found "
                          f"{v.dtype}{list(v.shape)}. Fix: reduce it to a scalar and convert "
                          "it (e.g. jnp.sum(x).astype(jnp.float32)).")
    trace_value_p.bind(v, label=label)


def _trace_value_reference(ctx: ReferenceContext, value: Any, *, label: str) -> list[Any]:
    return []


@rule(trace_value_p)
def _trace_value_lowering(lowering: Lowering, eqn: Any, value: ir.Value) -> list[Any]:
    tpu.TraceValueOp(value, eqn.params["label"])
    return []


# --- annotate ------------------------------------------------------------------------------


def annotate(ref: Any, *, no_store: bool = False, no_bank_conflict: bool = False,
             no_hazard: bool = False, no_hazard_no_deps: bool = False) -> Any:
    """``ref`` with access hints for Mosaic's scheduler (JAX's meanings: ``no_store``, the
    buffer is not stored to in the kernel; ``no_bank_conflict``; ``no_hazard``;
    ``no_hazard_no_deps``). ``no_bank_conflict`` combines with at most one of the others.

    The hints never change results, so the Ref itself is returned: the interpreter and this
    backend's lowering read and write it as before (no hint is emitted yet).
    """
    exclusive = [n for n, v in (("no_store", no_store), ("no_hazard", no_hazard),
                                ("no_hazard_no_deps", no_hazard_no_deps)) if v]
    if len(exclusive) > 1:
        raise PallasError(f"pltpu.annotate: {' and '.join(exclusive)} exclude each other (only "
                          "no_bank_conflict combines with one of them). Fix: pass one.")
    return ref


SEMANTICS: tuple[PrimitiveSemantics, ...] = (
    PrimitiveSemantics(has_memory_space_p, discharge=_has_memory_space_discharge),
    PrimitiveSemantics(trace_value_p, evaluate=_trace_value_reference),
)
