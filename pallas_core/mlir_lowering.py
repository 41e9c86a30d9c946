"""Shared machinery for backends that lower a kernel jaxpr to MLIR with per-primitive rules.

A backend keeps a :class:`Rules` registry (``rule(*primitives)`` decorates a function
``(state, eqn, *in_values) -> out value(s)``), a :class:`LoweringState` subclass with whatever
it tracks (program ids, refs), and calls :func:`lower_jaxpr` to emit a jaxpr at the current
insertion point. Errors name the primitive, the kernel and the user's source line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pallas_core import _jax
from pallas_core.errors import PallasError, UnsupportedError
from pallas_core.request import KernelCall

Rule = Callable[..., Any]
"""The one signature of every MLIR backend's lowering rules:
``rule(state: LoweringState, eqn: JaxprEqn, *in_values) -> out value | list of out values``.

``state`` is the backend's :class:`LoweringState` (a subclass of it), ``eqn`` the equation
being lowered (its parameters in ``eqn.params``, its abstract values in ``eqn.invars`` and
``eqn.outvars``), ``in_values`` the backend's IR values of the operands. A primitive with
``multiple_results`` returns a list. Rules refuse what they cannot lower with
``state.fail(...)`` (an ``UnsupportedError``)."""


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
            dtypes = _dtype_names(eqn)
            on = f" on {dtypes}" if dtypes else ""
            raise state.fail(f"the primitive {eqn.primitive.name!r}{on}", eqn)
        try:
            outs = fn(state, eqn, *[read(v) for v in eqn.invars])
        except PallasError:
            raise
        except Exception as e:  # a rule's or MLIR's own error: name what was being lowered
            what = f"{eqn.primitive.name} on {_dtype_names(eqn) or 'no operands'}"
            raise state.fail(f"{what} ({type(e).__name__}: {' '.join(str(e).split())})",
                             eqn) from e
        if eqn.primitive.multiple_results:
            env.update(zip(eqn.outvars, outs))
        else:
            env[eqn.outvars[0]] = outs
    return [read(v) for v in jaxpr.outvars]


# --- dtypes as MLIR types (jaxlib's bindings; imported only by backends that use them) --------


def splat_literal(constant: Callable[[Any, Any, Sequence[int]], Any], backend: str
                  ) -> Callable[[Any, Any], Any]:
    """The ``literal`` function of :func:`lower_jaxpr` for backends whose constants are splats:
    ``constant(value, dtype, shape)`` of the array's one value; other arrays are refused."""
    def literal(value: Any, aval: Any) -> Any:
        arr = np.asarray(value)
        if arr.size and not (arr == arr.reshape(-1)[0]).all():
            raise UnsupportedError(f"a non-uniform array constant in a {backend} kernel")
        return constant(arr.reshape(-1)[0] if arr.size else 0, aval.dtype, aval.shape)
    return literal


def element_type(dtype: Any) -> Any:
    """The MLIR element type of a NumPy/JAX dtype (booleans are ``i1``)."""
    from jaxlib.mlir import ir

    dt = np.dtype(dtype)
    if dt == np.bool_:
        return ir.IntegerType.get_signless(1)
    if dt.kind in "iu":
        return ir.IntegerType.get_signless(dt.itemsize * 8)
    if dt.name == "bfloat16":
        return ir.BF16Type.get()
    return {2: ir.F16Type.get, 4: ir.F32Type.get, 8: ir.F64Type.get}[dt.itemsize]()


def is_float(dtype: Any) -> bool:
    """Floating point, bfloat16 included."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def is_unsigned(dtype: Any) -> bool:
    """Unsigned integers and booleans (compared and extended without sign)."""
    return np.dtype(dtype).kind == "u" or np.dtype(dtype) == np.bool_


def called_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]]:
    """``(jaxpr, consts)`` of a call-like equation (``jit``, ``closed_call``, custom JVP/VJP,
    ``remat``)."""
    sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if isinstance(sub, _jax.ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


def _dtype_names(eqn: Any) -> str:
    """The dtypes of ``eqn``'s operands, for an error message (a key type by its name)."""
    names = set()
    for v in eqn.invars:
        dtype = getattr(v.aval, "dtype", None)
        if dtype is not None:
            try:
                names.add(np.dtype(dtype).name)
            except TypeError:  # an extended dtype, such as a jax.random key's
                names.add(str(dtype))
    return ", ".join(sorted(names))


CALL_PRIMITIVES = (_jax.jit_p, _jax.closed_call_p, _jax.custom_jvp_call_p,
                   _jax.custom_vjp_call_p, _jax.remat_p)
"""Primitives that call a jaxpr, which backends inline (``jax.checkpoint``'s only matters to
differentiation, which is done by the time a kernel lowers)."""


def walk(op: Any) -> Iterator[Any]:
    """Every operation nested in ``op`` (an MLIR operation), depth first, in order."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child
                yield from walk(child.operation)


def verify(module: Any, backend: str, kernel: str) -> None:
    """Raises a ``PallasError`` (with MLIR's diagnostics) unless ``module`` verifies: a
    backend's lowering emitted something invalid, and MLIR's own error must not reach the
    user raw."""
    from jaxlib.mlir import ir

    try:
        ok, why = module.operation.verify(), ""
    except ir.MLIRError as e:
        ok, why = False, ": " + " ".join(str(e).split())
    if not ok:
        raise PallasError(
            f"the {backend} module of kernel {kernel!r} does not verify{why}. This is a bug in "
            f"the {backend!r} backend's lowering. Fix: run the kernel with backend='interpret' "
            "and report the kernel.")
