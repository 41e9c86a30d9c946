"""Evaluating a kernel with the reference semantics of its primitives.

Backends that run kernels as plain JAX (the interpreter, or a third party's XLA backend) share
this machinery: :func:`semantics_rules` gathers the ``evaluate`` rules of every loaded plugin
(and hands their discharge rules to JAX), and :func:`eval_jaxpr` evaluates a *discharged*
kernel jaxpr with those rules applied at every depth: inside the bodies of ``cond``, ``while``,
``scan`` and nested calls, which are re-traced with the rules applied. Values that are known
at trace time (e.g. a constant ``program_id``) are folded, so a ``pl.when`` on them picks its
branch statically.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p

from pallas_core import _jax
from pallas_core.errors import UnsupportedError
from pallas_core.plugins import manager
from pallas_core.semantics import ReferenceContext

SemanticsRules = Mapping[Any, Callable[..., Any]]
"""Primitive -> ``evaluate`` rule ``(ctx, *args, **params) -> output(s)``."""


@functools.cache
def _all_semantics() -> tuple[Any, ...]:
    """Every :class:`PrimitiveSemantics` the loaded plugins (and the core) declare, in one
    sequence: the tables below are each a view of it."""
    return tuple(sem for _, group in manager.broadcast("pallas_primitives") for sem in group)


manager.add_listener(_all_semantics.cache_clear)


@functools.cache
def registered_primitives() -> frozenset[Any]:
    """Every primitive to which a loaded plugin (or the core) gives reference semantics."""
    return frozenset(sem.primitive for sem in _all_semantics())


manager.add_listener(registered_primitives.cache_clear)


@functools.cache
def semantics_rules() -> SemanticsRules:
    """``evaluate`` rules of every loaded plugin's primitives; discharge rules go to JAX."""
    rules: dict[Any, Any] = {}
    for sem in _all_semantics():
        if sem.evaluate is not None:
            rules[sem.primitive] = sem.evaluate
        elif sem.barrier is not None:
            # Where the points of a mesh run in lockstep, a barrier is where one phase
            # ends; where one point runs alone it has nothing to wait for.
            rules[sem.primitive] = _no_op
        else:
            _jax.register_discharge_rule(sem.primitive)(sem.discharge)
    return rules


def _no_op(ctx: ReferenceContext, *args: Any, **params: Any) -> list[Any]:
    return []


manager.add_listener(semantics_rules.cache_clear)


@functools.cache
def barrier_rules() -> Mapping[Any, Callable[..., Any]]:
    """Barrier primitive -> its ``barrier`` rule (params -> synchronised mesh axis names)."""
    return {sem.primitive: sem.barrier for sem in _all_semantics() if sem.barrier is not None}


manager.add_listener(barrier_rules.cache_clear)


@functools.cache
def phase_waits() -> frozenset[Any]:
    """The primitives that wait for another point's arrivals (``PrimitiveSemantics.
    phase_wait``: GPU mbarrier waits)."""
    return frozenset(sem.primitive for sem in _all_semantics() if sem.phase_wait)


manager.add_listener(phase_waits.cache_clear)


@functools.cache
def claims() -> frozenset[Any]:
    """The primitives that decode a claimed grid point (``PrimitiveSemantics.claim``)."""
    return frozenset(sem.primitive for sem in _all_semantics() if sem.claim)


manager.add_listener(claims.cache_clear)


@functools.cache
def forks() -> Mapping[Any, Callable[..., tuple[Any, int, bool]]]:
    """Marker primitive -> its ``fork`` rule (params -> (axis name, sub-points, begins)): where
    a point splits into sub-points and joins again (``PrimitiveSemantics.fork``)."""
    return {sem.primitive: sem.fork for sem in _all_semantics() if sem.fork is not None}


manager.add_listener(forks.cache_clear)


@functools.cache
def cluster_rules() -> Mapping[Any, tuple[Callable[..., Any], Callable[..., Any]]]:
    """Primitive -> its ``(cluster, cross)`` rules: primitives whose meaning may reach across
    the blocks of a cluster (``PrimitiveSemantics.cluster``)."""
    return {sem.primitive: (sem.cluster, sem.cross) for sem in _all_semantics()
            if sem.cluster is not None}


manager.add_listener(cluster_rules.cache_clear)


def cluster_axes(eqn: Any) -> tuple[str, ...]:
    """The mesh axes along which ``eqn`` reaches other blocks' shared buffers (see
    ``PrimitiveSemantics.cluster``); empty for every other equation."""
    rules = cluster_rules().get(eqn.primitive)
    if rules is None:
        return ()
    return tuple(rules[0]([v.aval for v in eqn.invars], **eqn.params))


sub_jaxprs = _jax.sub_jaxprs
"""The jaxprs among an equation's parameters (e.g. the branches of a ``cond``)."""


def all_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr``, each followed by those of the jaxprs it holds, in order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn.params):
            yield from all_eqns(sub)


def source_line(eqn: Any) -> str:
    """``file:line`` of the user code that produced ``eqn`` (``'<unknown>'`` if none)."""
    return _jax.source_line(eqn)


def find_eqn(jaxpr: Any, primitives: Any) -> Any | None:
    """The first equation of ``jaxpr`` (nested jaxprs included) applying one of ``primitives``."""
    return next((eqn for eqn in all_eqns(jaxpr) if eqn.primitive in primitives), None)


def evaluate(closed: Any, args: Sequence[Any], ctx: ReferenceContext,
             rules: SemanticsRules) -> list[Any]:
    """Evaluates the closed jaxpr ``closed`` on ``args`` at the grid step ``ctx``."""
    return eval_jaxpr(closed.jaxpr, closed.consts, args, ctx, rules)


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], ctx: ReferenceContext,
               rules: SemanticsRules) -> list[Any]:
    """Like ``jax.core.eval_jaxpr``, with ``rules`` applied at every depth."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _jax.Literal) else env[v]

    for eqn in jaxpr.eqns:
        with _jax.user_context(eqn):
            outs = _eval_eqn(eqn, [read(v) for v in eqn.invars], ctx, rules)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn: Any, invals: list[Any], ctx: ReferenceContext, rules: SemanticsRules) -> Any:
    prim, params = eqn.primitive, eqn.params
    if prim in rules:
        return rules[prim](ctx, *invals, **params)
    if prim in _SAME_SHAPE_OPERANDS:
        return prim.bind(*_one_shape(invals), **params)
    subs = sub_jaxprs(params)
    static_branch = prim is _jax.cond_p and not isinstance(invals[0], _jax.Tracer)
    if static_branch or prim in _ALWAYS_INLINED or (subs and any(
            find_eqn(s, rules) is not None or find_eqn(s, _SAME_SHAPE_OPERANDS) is not None
            or find_eqn(s, _ALWAYS_INLINED) is not None for s in subs)):
        handler = _CONTROL_FLOW.get(prim)
        if handler is None:
            raise UnsupportedError(
                f"{prim.name!r} around grid-dependent primitives (such as program_id) cannot be "
                "evaluated by the reference semantics. Fix: compute those values outside it and "
                "pass them in."
            )
        return handler(invals, params, ctx, rules)
    static = not any(isinstance(x, _jax.Tracer) for x in invals)
    if (static and not subs and not eqn.effects and all(v.aval.shape == () for v in eqn.outvars)
            and prim is not _jax.dim_as_value_p):  # known only in the exported program
        # Scalar arithmetic on a constant grid step, folded now; outside any mesh, since
        # arrays made eagerly under shard_map's mesh are sharded over it and do not mix.
        with jax.ensure_compile_time_eval(), _jax.no_mesh():
            return prim.bind(*invals, **params)
    return prim.bind(*invals, **prim.get_bind_params(params))


_ALWAYS_INLINED = frozenset({_jax.closed_call_p})
"""Evaluated by inlining its body, also where no rule of ours is inside: the discharge of a
loop that reads Refs wraps its body in ``closed_call``, and under ``vmap`` (the interpreter's
batched path) JAX 0.10 re-binds that with a ``name`` parameter which its own jaxpr checker
(``jax_enable_checks``) then rejects."""

_SAME_SHAPE_OPERANDS = frozenset({threefry2x32_p})
"""JAX primitives whose abstract evaluation broadcasts their operands but whose CPU lowering
needs them of one shape: ``threefry2x32`` carries both count halves through one ``fori_loop``.
Under ``vmap`` (the interpreter's batched path) JAX's batching rule hands them over with the
unbatched ones given a size-1 batch dimension, which that loop rejects ("carry type mismatch")
when one count half is batched and the other is not (``zeros_like`` of a batched value)."""


def _one_shape(operands: Sequence[Any]) -> list[Any]:
    """``operands`` broadcast against each other, and batched alike under ``vmap``: a zero
    that depends on all of them is added to each."""
    zero = functools.reduce(jnp.bitwise_or, (jnp.bitwise_and(x, 0) for x in operands))
    return [jnp.bitwise_or(x, zero) for x in operands]


def _fn(sub: Any, ctx: ReferenceContext, rules: SemanticsRules) -> Callable[..., list[Any]]:
    if isinstance(sub, _jax.ClosedJaxpr):
        return lambda *args: eval_jaxpr(sub.jaxpr, sub.consts, args, ctx, rules)
    return lambda *args: eval_jaxpr(sub, (), args, ctx, rules)


def _cond(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
          rules: SemanticsRules) -> Any:
    index, *ops = invals
    branches = [_fn(b, ctx, rules) for b in params["branches"]]
    if not isinstance(index, _jax.Tracer):  # decided at trace time
        return branches[min(max(int(index), 0), len(branches) - 1)](*ops)
    return lax.switch(index, branches, *ops)


def _while(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
           rules: SemanticsRules) -> Any:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cconsts, bconsts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    cond_fn = _fn(params["cond_jaxpr"], ctx, rules)
    body_fn = _fn(params["body_jaxpr"], ctx, rules)
    return lax.while_loop(lambda c: cond_fn(*cconsts, *c)[0],
                          lambda c: body_fn(*bconsts, *c), list(init))


def _scan(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
          rules: SemanticsRules) -> Any:
    consts, init, xs, split_out = _jax.scan_parts(params, invals)
    body = _fn(params["jaxpr"], ctx, rules)

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        return split_out(body(*consts, *carry, *x))

    carry, ys = lax.scan(step, list(init), list(xs), length=params["length"],
                         reverse=params["reverse"], unroll=params["unroll"])
    return [*carry, *ys]


def _inline(key: str) -> Callable[..., Any]:
    def handler(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
                rules: SemanticsRules) -> Any:
        return _fn(params[key], ctx, rules)(*invals)
    return handler


def _run_state(invals: list[Any], params: Mapping[str, Any], ctx: ReferenceContext,
               rules: SemanticsRules) -> Any:
    """``pl.run_state`` around rules (a backend's accumulator Refs): its body discharged and
    evaluated here; the results are the Refs' final values."""
    jaxpr = params["jaxpr"]
    given = iter(invals)
    args = [next(given) if ready else jnp.zeros(v.aval.shape, v.aval.dtype)
            for v, ready in zip(jaxpr.invars, params["is_initialized"])]
    sizes = ctx.grid[ctx.num_batch_axes:]
    axis_sizes = tuple(zip(ctx.grid_names, sizes)) if ctx.grid_names else ()
    discharged = _jax.discharge_state(_jax.ClosedJaxpr(jaxpr, ()), axis_sizes=axis_sizes)
    outs = eval_jaxpr(discharged.jaxpr, discharged.consts, args, ctx, rules)
    return outs[len(jaxpr.outvars):]


CALL_BODIES: Mapping[Any, str] = {
    _jax.jit_p: "jaxpr",
    _jax.closed_call_p: "call_jaxpr",
    _jax.custom_jvp_call_p: "call_jaxpr",
    _jax.custom_vjp_call_p: "call_jaxpr",
}
"""Primitives that call a jaxpr (evaluated inline here), and the parameter holding it."""

_CONTROL_FLOW: dict[Any, Callable[..., Any]] = {
    _jax.cond_p: _cond,
    _jax.while_p: _while,
    _jax.scan_p: _scan,
    _jax.run_state_p: _run_state,
    **{prim: _inline(key) for prim, key in CALL_BODIES.items()},
}
"""Primitives whose bodies are evaluated here (with the rules) instead of bound as they are."""
