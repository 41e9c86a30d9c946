"""Registration of the transformation rules of a primitive (batching, JVP, linearization,
transpose) across JAX releases, symbolic-zero tangents, and the forward-mode derivative of a
jaxpr."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import ad_util, core
from jax._src import config as _config
from jax._src.interpreters import ad, batching

from pallas_core._jax.base import CLOSED_JAXPR, JAX_VERSION, ClosedJaxpr, Jaxpr, Primitive


def register_batching_rule(prim: Primitive, rule: Callable[..., Any]) -> None:
    """``rule(axis_data, args, dims, **params) -> (outs, out_dims)``; ``axis_data.size``."""
    batching.fancy_primitive_batchers[prim] = rule
primitive_jvps = ad.primitive_jvps
"""``rule(primals, tangents, **params) -> (primal_outs, tangent_outs)``; tangents may be
symbolic zeros (:func:`is_zero`)."""


def register_linearization(prim: Primitive, rule: Callable[..., Any]) -> None:
    """``rule(is_vjp, nonzeros, *primals, **params) -> (primal_outs, out_nonzeros, residuals,
    linearized)`` with ``linearized(residuals, *tangents) -> tangent_outs`` (``jax.linearize``,
    ``jax.vjp`` and ``jax.grad`` linearize through it). JAX 0.11 adds structured residuals
    (none here) to the result and to ``linearized``'s arguments; this adapts it."""
    if not _LINEARIZE_HAS_STRUCTURED_RESIDUALS:
        ad.primitive_linearizations[prim] = rule
        return

    def adapted(*args: Any, **params: Any) -> Any:
        outs, nonzeros, residuals, linearized = rule(*args, **params)
        return outs, nonzeros, residuals, None, (
            lambda res, _structured, *tangents: linearized(res, *tangents))

    ad.primitive_linearizations[prim] = adapted


# JAX 0.11's linearization rules return structured residuals as a fifth value.
_LINEARIZE_HAS_STRUCTURED_RESIDUALS = JAX_VERSION[:2] >= (0, 11)
primitive_transposes = ad.primitive_transposes
"""``rule(cotangents, *args, **params)``: reverse mode of a linear equation."""


def is_zero(tangent: Any) -> bool:
    """Whether ``tangent`` is a symbolic zero (an input that is not being differentiated)."""
    return type(tangent) is ad_util.Zero


def zero_tangent(aval: Any) -> Any:
    """The symbolic zero tangent of a value of type ``aval``."""
    return ad_util.Zero(aval.to_tangent_aval())


def instantiate_zero(tangent: Any) -> Any:
    """``tangent`` as an array: a symbolic zero becomes zeros of its type."""
    return ad_util.instantiate(tangent)


def tangent_aval(aval: Any) -> Any:
    """The type of a tangent of a value (or Ref) of type ``aval`` (``float0`` for integers)."""
    return aval.to_tangent_aval()


def jvp_jaxpr(closed: ClosedJaxpr, nonzeros: Sequence[bool], *,
              axis_sizes: Sequence[tuple[str, int]] = ()) -> ClosedJaxpr:
    """The forward-mode derivative of ``closed``.

    The result takes the inputs, then the tangents of the inputs marked in ``nonzeros`` (the
    others are symbolic zeros), and returns the outputs then their nonzero tangents. For a
    kernel jaxpr (Refs in, nothing out) the tangents are Refs too, written as the primal Refs
    are.
    """
    with (_config._check_vma(False), _config.mutable_array_checks(False),
          core.extend_axis_env_nd(list(axis_sizes))):
        jvp, _ = ad.jvp_jaxpr(closed, list(nonzeros), instantiate=False)
    return ClosedJaxpr(_adds_as_lax_add(jvp.jaxpr), jvp.consts)


add_any_p = ad_util.add_jaxvals_p
"""JAX's autodiff-internal sum of two tangents (``add_any``): ``lax.add`` on arrays."""


def _adds_as_lax_add(jaxpr: Jaxpr) -> Jaxpr:
    """``jaxpr`` with JAX's autodiff-internal sum of tangents (``add_any``) written as
    ``lax.add`` (the same on arrays of one type), nested jaxprs included, so that backends
    lower derivative kernels with their ordinary rules."""
    def sub(value: Any) -> Any:
        if isinstance(value, CLOSED_JAXPR):
            return ClosedJaxpr(_adds_as_lax_add(value.jaxpr), value.consts)
        if isinstance(value, core.Jaxpr):
            return _adds_as_lax_add(value)
        if isinstance(value, tuple):
            return tuple(sub(v) for v in value)
        return value

    eqns = [eqn.replace(
        primitive=jax.lax.add_p if eqn.primitive is ad_util.add_jaxvals_p else eqn.primitive,
        params={k: sub(v) for k, v in eqn.params.items()}) for eqn in jaxpr.eqns]
    return jaxpr.replace(eqns=eqns)
