"""Evaluates a discharged (pure) kernel jaxpr at one grid step.

Primitives whose meaning depends on the grid step (``program_id``, ``axis_index``) or that
a plugin gave an ``evaluate`` rule are replaced by their reference semantics, also inside
the bodies of loops and conditionals, which are re-traced with the replacement applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax import lax

from pallas_core import _jax
from pallas_core.semantics import ReferenceContext

EvaluateRules = Mapping[Any, Callable[..., Any]]


def needs_rules(jaxpr: Any, rules: EvaluateRules, _cache: dict[int, bool] | None = None) -> bool:
    """Whether ``jaxpr`` (or any jaxpr nested in it) uses a primitive from ``rules``."""
    cache = {} if _cache is None else _cache
    key = id(jaxpr)
    if key in cache:
        return cache[key]
    found = False
    for eqn in jaxpr.eqns:
        if eqn.primitive in rules:
            found = True
        else:
            for sub in _sub_jaxprs(eqn.params):
                if needs_rules(sub, rules, cache):
                    found = True
                    break
        if found:
            break
    cache[key] = found
    return found


def _sub_jaxprs(params: Mapping[str, Any]) -> list[Any]:
    out = []
    for v in params.values():
        vs = v if isinstance(v, (tuple, list)) else (v,)
        for x in vs:
            if isinstance(x, _jax.ClosedJaxpr):
                out.append(x.jaxpr)
            elif isinstance(x, _jax.Jaxpr):
                out.append(x)
    return out


def evaluate(closed: Any, args: Sequence[Any], ctx: ReferenceContext,
             rules: EvaluateRules) -> list[Any]:
    """Evaluates ``closed`` (a ClosedJaxpr) on ``args`` under ``ctx``."""
    return eval_jaxpr(closed.jaxpr, closed.consts, args, ctx, rules)


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], ctx: ReferenceContext,
               rules: EvaluateRules) -> list[Any]:
    """Like ``jax.core.eval_jaxpr``, with ``rules`` applied at every depth."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _jax.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with _jax.user_context(eqn):
            outs = _eval_eqn(eqn, invals, ctx, rules)
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        else:
            env[eqn.outvars[0]] = outs
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn: Any, invals: list[Any], ctx: ReferenceContext, rules: EvaluateRules) -> Any:
    prim, params = eqn.primitive, eqn.params
    rule = rules.get(prim)
    if rule is not None:
        return rule(ctx, *invals, **params)
    if not any(needs_rules(j, rules) for j in _sub_jaxprs(params)):
        return prim.bind(*invals, **prim.get_bind_params(params))
    handler = _STRUCTURED.get(prim)
    if handler is None:
        from pallas_core.errors import UnsupportedError

        raise UnsupportedError(
            f"the interpreter cannot evaluate {prim.name!r} around grid-dependent primitives "
            "such as program_id. Fix: call program_id outside of it and pass the value in."
        )
    return handler(invals, params, ctx, rules)


def _call_closed(closed: Any, ctx: ReferenceContext, rules: EvaluateRules) -> Callable[..., Any]:
    def fn(*args: Any) -> list[Any]:
        return evaluate(closed, args, ctx, rules)
    return fn


def _cond(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
          rules: EvaluateRules) -> Any:
    index, *ops = invals
    branches = [_call_closed(b, ctx, rules) for b in params["branches"]]
    return lax.switch(index, branches, *ops)


def _while(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
           rules: EvaluateRules) -> Any:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cconsts, bconsts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    cond_fn = _call_closed(params["cond_jaxpr"], ctx, rules)
    body_fn = _call_closed(params["body_jaxpr"], ctx, rules)
    return lax.while_loop(lambda c: cond_fn(*cconsts, *c)[0],
                          lambda c: body_fn(*bconsts, *c), list(init))


def _scan(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
          rules: EvaluateRules) -> Any:
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                        invals[n_consts + n_carry:])
    body = _call_closed(params["jaxpr"], ctx, rules)

    def step(carry: Any, x: Any) -> Any:
        out = body(*consts, *carry, *x)
        return out[:n_carry], out[n_carry:]

    carry, ys = lax.scan(step, list(init), list(xs), length=params["length"],
                         reverse=params["reverse"], unroll=params["unroll"])
    return [*carry, *ys]


def _inline(key: str) -> Callable[..., Any]:
    def handler(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
                rules: EvaluateRules) -> Any:
        sub = params[key]
        if isinstance(sub, _jax.Jaxpr):
            return eval_jaxpr(sub, (), invals, ctx, rules)
        return evaluate(sub, invals, ctx, rules)
    return handler


_STRUCTURED: dict[Any, Callable[..., Any]] = {
    _jax.cond_p: _cond,
    _jax.while_p: _while,
    _jax.scan_p: _scan,
    _jax.jit_p: _inline("jaxpr"),
    _jax.closed_call_p: _inline("call_jaxpr"),
    _jax.custom_jvp_call_p: _inline("call_jaxpr"),
    _jax.custom_vjp_call_p: _inline("call_jaxpr"),
}
