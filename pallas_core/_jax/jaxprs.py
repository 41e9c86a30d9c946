"""Tracing functions into jaxprs and walking them: tracing with named axes in scope, the
effects and written Refs of a jaxpr, sub-jaxprs of an equation's parameters, dead-code
elimination, source lines of equations, ``shard_map``'s varying axes, and evaluation of a
jaxpr with some equations replaced (the emulators and ``pl.report`` use it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import api_util, core, effects, source_info_util
from jax._src import config as _config
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

from pallas_core._jax.base import CLOSED_JAXPR, ClosedJaxpr, Jaxpr


def scan_parts(
    params: Any, operands: Sequence[Any]
) -> tuple[list[Any], list[Any], list[Any], Callable[[Sequence[Any]], tuple[list[Any], list[Any]]]]:
    """Splits a ``scan`` equation's operands into ``(consts, carry, xs)``.

    Also returns a function splitting one body evaluation's outputs into ``(carry, ys)``.
    The body jaxpr takes ``(*consts, *carry, *xs)``; the equation returns ``[*carry, *ys]``.
    JAX 0.11 describes the split with forwarding trees, JAX 0.10 with counts.
    """
    if "ft_in" in params:
        consts, carry, xs = params["ft_in"].update(list(operands)).unpack()

        def split_out(outs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
            c, ys = params["ft_out"].update(list(outs)).unpack()
            return list(c), list(ys)

        return list(consts), list(carry), list(xs), split_out
    nc, ncarry = params["num_consts"], params["num_carry"]

    def split_counts(outs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        return list(outs[:ncarry]), list(outs[ncarry:])

    return (list(operands[:nc]), list(operands[nc:nc + ncarry]), list(operands[nc + ncarry:]),
            split_counts)


def extend_axis_env(axis_sizes: Sequence[tuple[str, int]]) -> Any:
    """A context in which the named axes ``axis_sizes`` are in scope while tracing (a backend's
    mesh that runs its body inside the kernel being traced, such as a warp mesh)."""
    return core.extend_axis_env_nd(list(axis_sizes))


def trace_to_jaxpr(
    fun: Callable[..., Any],
    in_avals: Sequence[Any],
    *,
    name: str = "kernel",
    axis_sizes: Sequence[tuple[str, int]] = (),
) -> tuple[Jaxpr, list[Any], list[Any]]:
    """Traces ``fun`` (flat args, flat list result) with abstract inputs.

    Returns ``(jaxpr, out_avals, consts)``. Named axes in ``axis_sizes`` are in scope
    during tracing so that ``lax.axis_index(name)`` works in kernel bodies.
    """
    dbg = api_util.debug_info(name, fun, tuple(in_avals), {})
    wrapped = lu.wrap_init(fun, debug_info=dbg)
    with (_config._check_vma(False), _config.mutable_array_checks(False),
          core.extend_axis_env_nd(list(axis_sizes))):
        jaxpr, out_avals, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, list(out_avals), list(consts)


def input_effects_by_position(jaxpr: Jaxpr, num_inputs: int) -> set[Any]:
    """``jaxpr``'s effects as an abstract eval rule of an equation must return them.

    Effects on the first ``num_inputs`` invars (the equation's operands) are keyed by
    position; effects on later invars (Refs the equation allocates itself) are dropped.
    """
    position = {v: i for i, v in enumerate(jaxpr.invars[:num_inputs])}
    out: set[Any] = set()
    for eff in jaxpr.effects:
        if isinstance(eff, effects.JaxprInputEffect):
            if eff.input in position:
                out.add(eff.replace(position[eff.input]))
            continue
        out.add(eff)
    return out


def jaxpr_from_eqns(invars: Sequence[Any], outvars: Sequence[Any],
                    eqns: Sequence[Any]) -> ClosedJaxpr:
    """A closed jaxpr of some equations of another jaxpr: ``invars`` must hold every variable
    the equations read that none of them defines."""
    effs = pe.make_jaxpr_effects([], list(invars), list(outvars), list(eqns))
    dbg = core.DebugInfo("part of a kernel", "", tuple(f"in{i}" for i in range(len(invars))),
                         tuple(f"out{i}" for i in range(len(outvars))))
    return ClosedJaxpr(Jaxpr([], list(invars), list(outvars), list(eqns), effs, dbg), [])


def being_staged(values: Any) -> bool:
    """Whether any leaf of ``values`` is being staged out into a jaxpr (``jit``, ``scan``, ...)
    rather than computed now (eagerly, also under eager ``vmap`` or ``shard_map``)."""
    return any(isinstance(x, pe.DynamicJaxprTracer) for x in jax.tree_util.tree_leaves(values))


def is_var(atom: Any) -> bool:
    """Whether a jaxpr atom is a variable (neither a literal nor a dropped output)."""
    return isinstance(atom, core.Var) and not isinstance(atom, core.DropVar)


def convert_constvars(jaxpr: Jaxpr) -> Jaxpr:
    """Moves a jaxpr's constvars to the front of its invars."""
    return pe.convert_constvars_jaxpr(jaxpr)


def user_context(eqn: Any) -> Any:
    """Context that attributes errors raised while evaluating ``eqn`` to its source."""
    return source_info_util.user_context(eqn.source_info.traceback)


def hide_frames_in(directory: str) -> None:
    """Makes frames of code under ``directory`` internal, as JAX's own are: the source lines
    of kernels' equations (and filtered tracebacks) skip them for the user's code. Paths
    are matched by prefix, so the directory ends in a separator (``pallas_x`` does not hide
    ``pallas_x_kernels``)."""
    source_info_util.register_exclusion(os.path.join(directory, ""))


def source_line(eqn: Any) -> str:
    """``file:line`` of the user code that produced ``eqn``, or ``'<unknown>'``."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "<unknown>"
    return f"{frame.file_name}:{frame.start_line}"


def varying_axes(aval: Any) -> frozenset[Any]:
    """Manual mesh axes along which a value varies inside ``shard_map`` (empty elsewhere)."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ())) if mat is not None else frozenset()


def with_varying_axes(aval: Any, like: Sequence[Any]) -> Any:
    """``aval`` made to vary over the manual axes that any of ``like`` varies over.

    Inside ``shard_map`` (with its checks on) a kernel's outputs vary over the mesh
    axes its inputs vary over; users need no annotation on ``out_shape`` for that.
    """
    if not _config._check_vma.value:
        return aval
    src = [a for a in like if not getattr(a, "manual_axis_type", core.empty_mat).empty]
    if not src:
        return aval
    varying = frozenset().union(*(varying_axes(a) for a in src))
    base = src[0]
    mat = core.ManualAxisType(varying=varying)
    sharding = base.sharding.update(spec=jax.sharding.PartitionSpec(*([None] * len(aval.shape))))
    return core.ShapedArray(aval.shape, aval.dtype, sharding=sharding, manual_axis_type=mat)


def evaluate_replacing(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                       replace: Callable[[Any, list[Any]], list[Any] | None],
                       touches: Callable[[Jaxpr], bool]) -> list[Any]:
    """Evaluates ``jaxpr`` (binding its primitives on ``args``, traced or not), except that an
    equation for which ``replace(eqn, in_values)`` returns values takes those; jaxprs held in
    an equation's parameters are rewritten the same way where ``touches(sub_jaxpr)``."""
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, core.Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        outs = replace(eqn, invals)
        if outs is None:
            outs = bind_rewriting(eqn, invals, replace, touches)
        for v, out in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, core.DropVar):
                env[v] = out
    return [read(a) for a in jaxpr.outvars]


def bind_rewriting(eqn: Any, invals: Sequence[Any],
                   replace: Callable[[Any, list[Any]], list[Any] | None],
                   touches: Callable[[Jaxpr], bool]) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals``, with the jaxprs among its parameters rewritten
    as :func:`evaluate_replacing` rewrites (what it does with an equation ``replace`` leaves)."""
    params = eqn.params
    if any(touches(sub) for sub in sub_jaxprs(params)):
        with _body_context(eqn):
            params = {k: _rewrite_param(v, replace, touches) for k, v in params.items()}
    bind_params = eqn.primitive.get_bind_params(params)
    with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
        ans = eqn.primitive.bind(*invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _body_context(eqn: Any) -> Any:
    """The context a body of ``eqn`` is traced in: a ``shard_map``'s manual mesh axes (so
    that ``lax.axis_index`` and collectives of the body trace again), else none."""
    if eqn.primitive.name != "shard_map":
        return contextlib.nullcontext()
    from jax._src import shard_map as shard_map_lib
    from jax._src.mesh import use_abstract_mesh

    mesh, manual = eqn.params["mesh"], frozenset(eqn.params["newly_manual_axes"])
    stack = contextlib.ExitStack()
    stack.enter_context(shard_map_lib._extend_axis_env(mesh, manual))
    stack.enter_context(use_abstract_mesh(shard_map_lib._as_manual_mesh(mesh, manual)))
    stack.enter_context(_config._check_vma(eqn.params.get("check_vma", True)))
    return stack


def shard_map_mesh(eqn: Any) -> Any | None:
    """The mesh of a ``shard_map`` equation that makes every axis of its mesh manual (each
    device runs the body on its own shard), else ``None`` (also for other equations)."""
    if eqn.primitive.name != "shard_map":
        return None
    mesh = eqn.params.get("mesh")
    manual = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes"))
    if mesh is None or manual is None or set(manual) != set(mesh.axis_names):
        return None
    return mesh


def sub_jaxprs(params: Any) -> list[Jaxpr]:
    """The jaxprs among an equation's parameters (e.g. the branches of a ``cond``), open."""
    found = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, CLOSED_JAXPR):
                found.append(v.jaxpr)
            elif isinstance(v, core.Jaxpr):
                found.append(v)
    return found


def sub_jaxpr_consts(params: Any) -> list[tuple[Jaxpr, Sequence[Any]]]:
    """As :func:`sub_jaxprs`, each with the constants its closed jaxpr binds (none for an
    open one)."""
    found: list[tuple[Jaxpr, Sequence[Any]]] = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, CLOSED_JAXPR):
                found.append((v.jaxpr, v.consts))
            elif isinstance(v, core.Jaxpr):  # 0.12's jaxprs carry their constants
                found.append((v, tuple(getattr(v, "consts", None) or ())))
    return found


def dce(jaxpr: Jaxpr) -> tuple[Jaxpr, list[bool]]:
    """``jaxpr`` (without constvars) less the equations none of its outputs need (effect-free
    ones), and which of its inputs it still takes (JAX 0.10 drops the unused ones; later
    releases keep every input, all marked used)."""
    out, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    if len(out.invars) == len(jaxpr.invars):
        return out, [True] * len(jaxpr.invars)
    return out, list(used)


def _rewrite_param(value: Any, replace: Callable[[Any, list[Any]], list[Any] | None],
                   touches: Callable[[Jaxpr], bool]) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_rewrite_param(v, replace, touches) for v in value)
    if isinstance(value, CLOSED_JAXPR):
        if not touches(value.jaxpr):
            return value
        return _retrace(value.jaxpr, value.consts, value.in_avals, replace, touches)
    if isinstance(value, core.Jaxpr):
        if not touches(value):
            return value
        closed = _retrace(value, (), [v.aval for v in value.invars], replace, touches)
        if closed.consts:  # an open jaxpr parameter has no place for them
            raise NotImplementedError(
                "rewriting a jaxpr parameter without constants produced constants "
                f"({[getattr(c, 'shape', c) for c in closed.consts]})")
        return closed.jaxpr
    return value


def _retrace(jaxpr: Jaxpr, consts: Sequence[Any], in_avals: Sequence[Any],
             replace: Callable[[Any, list[Any]], list[Any] | None],
             touches: Callable[[Jaxpr], bool]) -> ClosedJaxpr:
    def fn(*args: Any) -> list[Any]:
        return evaluate_replacing(jaxpr, consts, args, replace, touches)
    return jax.make_jaxpr(fn)(*in_avals)
