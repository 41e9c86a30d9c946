"""The installed JAX's version and the core types the rest of the adapter builds on: jaxprs
(``ClosedJaxpr`` is JAX 0.10/0.11's class of a jaxpr with its constants, merged into ``Jaxpr``
by 0.12; ``CLOSED_JAXPR`` is whichever class closed jaxprs have at run time), primitives,
avals, tracers; and JAX's words for two tree structures that differ."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from jax._src import core, effects

JAX_VERSION: tuple[int, int, int] = tuple(  # type: ignore[assignment]
    (int(p) if p.isdigit() else 0) for p in [*jax.__version__.split("."), "0", "0"][:3])
"""The installed JAX's (major, minor, patch)."""
NEWEST_TESTED_JAX = (0, 12)
"""The newest JAX minor release this version of pallas is tested with; a newer one works
through the same adapters, or fails here first, with a warning at import saying so."""


Primitive = core.Primitive
Jaxpr = core.Jaxpr
if TYPE_CHECKING:
    # JAX 0.10/0.11's ``core.ClosedJaxpr``, a jaxpr with its constants; JAX 0.12 merged it into
    # ``core.Jaxpr`` (a ``Jaxpr`` with its constants attached). Untyped: the two differ.
    ClosedJaxpr = Any
else:
    ClosedJaxpr = getattr(core, "ClosedJaxpr", core.Jaxpr)
CLOSED_JAXPR: type[Any] = getattr(core, "ClosedJaxpr", core.Jaxpr)
Literal = core.Literal
ShapedArray = core.ShapedArray
Effect = effects.Effect
typeof = core.typeof
Tracer = core.Tracer
eval_jaxpr = core.eval_jaxpr
is_dim = core.is_dim


eval_context = core.eval_context
"""Evaluates eagerly, outside whatever trace (jit, shard_map, ...) is current."""


ConcretizationTypeError = jax.errors.ConcretizationTypeError
"""A traced value used where Python needs a concrete one (``if``, ``bool``, ``int``)."""


def pytree_mismatches(what1: str, tree1: Any, what2: str, tree2: Any) -> str:
    """JAX's description of how two tree structures differ (``Pytree for `in_specs` and
    `inputs` do not match. There are 1 mismatches, including: ...``), as JAX's Pallas words
    it; empty when JAX finds no difference."""
    from jax._src import tree_util

    # A None spec for an array operand is the default spec, not a mismatch (JAX's words
    # would count it).
    errs = [e for e in tree_util.equality_errors_pytreedef(tree1, tree2)
            if not (e[1] == "<class 'NoneType'>" and e[2] == "pytree leaf")]
    if not errs:
        return ""
    lines = [f"Pytree for {what1} and {what2} do not match. "
             f"There are {len(errs)} mismatches, including:"]
    for path, thing1, thing2, explanation in errs:
        where = f"at {jax.tree_util.keystr(path)}, " if path else ""
        lines.append(f"    * {where}{what1} is a {thing1} but {what2} is a {thing2}, "
                     f"so {explanation}")
    return "\n".join(lines)
