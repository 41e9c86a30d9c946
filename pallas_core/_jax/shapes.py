"""Shape polymorphism (``jax.export`` with symbolic dimensions): telling symbolic dimensions
from ints, the programs that compute them, JAX's export switch for kernels, and
``map_dims``, which substitutes dimensions throughout shapes, avals and jaxprs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core
from jax._src.state import types as state_types

from pallas_core._jax.base import CLOSED_JAXPR


def is_symbolic_dim(d: Any) -> bool:
    """``d`` is a symbolic dimension (``jax.export`` with shape polymorphism), not an int."""
    return core.is_dim(d) and not core.is_constant_dim(d)


def is_static_shape(shape: Sequence[Any]) -> bool:
    """Every dimension of ``shape`` is an int (none symbolic)."""
    return core.is_constant_shape(shape)


def _dim_as_value_p() -> Any:
    from jax._src.export import shape_poly

    return shape_poly.dim_as_value_p


dim_as_value_p = _dim_as_value_p()
"""A symbolic dimension's value as an int32 scalar (``dim`` parameter: the dimension)."""


def call_exported_primitive() -> Any:
    """The primitive a call of a ``jax.export.Exported`` binds (``exported`` parameter)."""
    from jax._src.export import _export

    return _export.call_exported_p


def dimension_variables(avals: Sequence[Any]) -> tuple[str, ...]:
    """The names of the dimension variables in the shapes of ``avals``, sorted (as JAX's
    export orders them)."""
    from jax._src.export import shape_poly

    return tuple(shape_poly.all_dim_vars(list(avals)))


def dimension_program(dim: Any, names: Sequence[str], values: Sequence[int]) -> str:
    """The StableHLO module (text) computing the symbolic dimension ``dim`` from the values
    of the dimension variables ``names`` (int32 scalars, in order): ``evaluate_shape``
    exported for this machine's platform, as JAX's dynamic-shape export writes it into a
    Mosaic module. ``values`` are example values (they fix only the arguments' types)."""
    evaluate = jax.jit(core.evaluate_shape, static_argnames=("shape", "dim_vars"),
                       keep_unused=True)
    exported = jax.export.export(evaluate, platforms=[jax.devices()[0].platform])(
        (dim,), tuple(names), *values)
    return str(exported.mlir_module())


def export_dynamic_shapes(on: bool) -> Any:
    """JAX's ``pallas_export_experimental`` switch (the ``pallas_dynamic_shapes_export``
    flag), as a context manager."""
    from jax._src.pallas import core as pallas_core_jax

    return pallas_core_jax.pallas_export_experimental(on)


def dynamic_shapes_export_enabled() -> bool:
    """Whether kernels are being exported with symbolic shapes (JAX's flag is on)."""
    from jax._src.pallas import core as pallas_core_jax

    return bool(pallas_core_jax.dynamic_shapes_export_enabled())


def map_dims(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with every symbolic dimension ``d`` in it replaced by ``fn(d)``: in shapes
    and avals, in jaxprs (their variables' types and their equations' parameters, nested
    jaxprs and indexer trees included), in tuples, lists, dicts and dataclasses. What holds no
    symbolic dimension is returned as it is."""
    memo: dict[int, Any] = {}

    def go(v: Any) -> Any:
        if is_symbolic_dim(v):
            return fn(v)
        if v is None or isinstance(v, (bool, int, float, str, np.generic, np.ndarray,
                                       np.dtype, jax.Array)):
            return v
        key = id(v)
        if key in memo:
            return memo[key][1]
        out = _map_dims_node(v, go)
        memo[key] = (v, out)  # keeps v alive, so its id stays its own
        return out

    return go(value)


def _map_dims_node(v: Any, go: Callable[[Any], Any]) -> Any:
    if isinstance(v, core.Jaxpr):
        return _map_jaxpr_dims(v, go)
    if isinstance(v, CLOSED_JAXPR):  # JAX 0.10/0.11 (0.12's jaxprs carry their constants)
        return CLOSED_JAXPR(go(v.jaxpr), list(v.consts))
    if isinstance(v, state_types.AbstractRef):
        return v.update(inner_aval=go(v.inner_aval))
    if isinstance(v, core.ShapedArray):
        shape = tuple(go(d) for d in v.shape)
        return v if shape == v.shape else v.update(shape=shape)
    if isinstance(v, core.AbstractValue):
        return v
    if isinstance(v, jax.tree_util.PyTreeDef):
        leaves = [object() for _ in range(v.num_leaves)]
        tree = jax.tree_util.tree_unflatten(v, leaves)
        return jax.tree_util.tree_structure(go(tree))
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple
        return type(v)(*(go(x) for x in v))
    if isinstance(v, (tuple, list)):
        return type(v)(go(x) for x in v)
    if isinstance(v, dict):
        return {k: go(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        changes = {f.name: go(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        if all(changes[k] is getattr(v, k) for k in changes):
            return v
        return dataclasses.replace(v, **changes)
    return v


def _map_jaxpr_dims(jaxpr: Any, go: Callable[[Any], Any]) -> Any:
    renamed: dict[Any, Any] = {}

    def var(v: Any) -> Any:
        if isinstance(v, core.Literal):
            return core.Literal(v.val, go(v.aval))
        if isinstance(v, core.DropVar):
            return core.DropVar(go(v.aval))
        if v not in renamed:
            renamed[v] = core.Var(go(v.aval))
        return renamed[v]

    constvars = [var(v) for v in jaxpr.constvars]
    invars = [var(v) for v in jaxpr.invars]
    eqns = [e.replace(invars=[var(v) for v in e.invars], outvars=[var(v) for v in e.outvars],
                      params={k: go(p) for k, p in e.params.items()}) for e in jaxpr.eqns]
    attached = {"consts": list(jaxpr.consts)} if CLOSED_JAXPR is core.Jaxpr else {}
    return jaxpr.replace(constvars=constvars, invars=invars, eqns=eqns,
                         outvars=[var(v) for v in jaxpr.outvars], **attached)
