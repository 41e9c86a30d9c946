"""Counting a kernel's work for ``pl.report``: flops (matrix and vector), transcendentals,
the bytes its own copies move, and, for a backend without a block pipeline, the bytes its body
loads and stores; over the whole grid, deciding per grid step what depends on the grid indices
alone (branches, loop trip counts). :func:`count_work` is the entry point.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from jax import lax

from pallas_core import _jax, index_eval
from pallas_core import grid_mapping as gmap
from pallas_core.copies import copy_start_p, copy_start_traffic
from pallas_core.cost import dot_general_flops, element_count, integer_pow_flops
from pallas_core.plugins import manager
from pallas_core.primitives import (
    atomic_rmw_p,
    masked_load_p,
    masked_swap_p,
    num_programs_p,
    program_id_p,
)
from pallas_core.request import KernelCall


@dataclasses.dataclass(frozen=True)
class OpCost:
    """What one equation of a kernel body costs, as a backend counts its own primitives
    (its ``pallas_op_cost`` hook): a ``wgmma``'s matrix flops, the bytes a DMA or TMA copy
    moves between HBM and the chip."""

    matmul_flops: int = 0
    vector_flops: int = 0
    transcendentals: int = 0
    hbm_bytes: int = 0
    """Bytes moved between HBM and on-chip memory by a copy the kernel makes itself."""
    matmul_dtype: str | None = None
    """The operand type of the matrix work (picks the chip's peak)."""


@dataclasses.dataclass(frozen=True)
class Work:
    matmul: int = 0
    vector: int = 0
    transcendentals: int = 0
    notes: frozenset[str] = frozenset()
    matmul_dtype: str | None = None
    copy_bytes: int = 0
    """HBM bytes of the copies the kernel makes itself (``pl.ANY`` operands)."""
    load_bytes: int = 0
    """Bytes the body loads from and stores to its operands' Refs (HBM for a backend whose
    ``block_traffic`` is ``"loads"``)."""
    integer: int = 0
    """Elementwise integer and boolean operations (index and mask arithmetic, a PRNG's
    rounds): not flops."""

    def __add__(self, o: Work) -> Work:
        return Work(self.matmul + o.matmul, self.vector + o.vector,
                     self.transcendentals + o.transcendentals, self.notes | o.notes,
                     self.matmul_dtype or o.matmul_dtype, self.copy_bytes + o.copy_bytes,
                     self.load_bytes + o.load_bytes, self.integer + o.integer)

    def times(self, n: int) -> Work:
        return Work(self.matmul * n, self.vector * n, self.transcendentals * n, self.notes,
                     self.matmul_dtype, self.copy_bytes * n, self.load_bytes * n,
                     self.integer * n)

    @property
    def total(self) -> int:
        return self.matmul + self.vector


_VECTOR_OUT = (lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.rem_p, lax.max_p, lax.min_p,
               lax.and_p, lax.or_p, lax.xor_p, lax.select_n_p, lax.pow_p)
_SHIFTS = (lax.shift_left_p, lax.shift_right_logical_p, lax.shift_right_arithmetic_p)
_VECTOR_IN = (lax.neg_p, lax.abs_p, lax.sign_p, lax.floor_p, lax.ceil_p, lax.round_p,
              lax.not_p, lax.square_p, lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p,
              lax.argmax_p, lax.argmin_p)
_TRANSCENDENTAL = (lax.exp_p, lax.exp2_p, lax.log_p, lax.log1p_p, lax.expm1_p, lax.tanh_p,
                   lax.logistic_p, lax.sqrt_p, lax.rsqrt_p, lax.cbrt_p, lax.sin_p, lax.cos_p,
                   lax.tan_p, lax.atan2_p, lax.erf_p, lax.erf_inv_p, lax.sinh_p, lax.cosh_p,
                   lax.asin_p, lax.acos_p, lax.atan_p)


def _cost_key(w: Work) -> tuple[int, int, int]:
    """Which of two branches costs more: flops, then transcendentals, then bytes moved."""
    return (w.total, w.transcendentals, w.copy_bytes + w.load_bytes)


def _dot(eqn: Any) -> Work:
    return Work(matmul=dot_general_flops(eqn),
                 matmul_dtype=np.dtype(eqn.invars[0].aval.dtype).name)


def _count(jaxpr: Any) -> Work:
    total = Work()
    for eqn in jaxpr.eqns:
        total = total + _count_eqn(eqn)
    return total


def _floating(aval: Any) -> bool:
    """Whether values of ``aval`` are floating-point (or complex): what flops count."""
    return np.dtype(aval.dtype).kind in "fcV" or "float" in str(aval.dtype)


def _count_eqn(eqn: Any) -> Work:
    p = eqn.primitive
    if p is lax.dot_general_p:
        return _dot(eqn)
    if p in _SHIFTS:
        return Work(integer=element_count(eqn.outvars[0].aval))
    if p in _VECTOR_OUT or p in _VECTOR_IN or p is lax.integer_pow_p:
        if not _floating(eqn.outvars[0].aval):  # index and mask arithmetic: not flops
            return Work(integer=element_count(eqn.outvars[0].aval))
        if p is lax.integer_pow_p:
            return Work(vector=integer_pow_flops(eqn))
        return Work(vector=element_count((eqn.outvars if p in _VECTOR_OUT
                                          else eqn.invars)[0].aval))
    if p in _TRANSCENDENTAL:
        return Work(transcendentals=element_count(eqn.invars[0].aval))
    if p is _jax.scan_p:
        return _count(eqn.params["jaxpr"].jaxpr).times(int(eqn.params["length"]))
    if p is _jax.while_p:
        body = _count(eqn.params["body_jaxpr"].jaxpr)
        if not body.total and not body.transcendentals:
            return body
        return dataclasses.replace(body, notes=body.notes | {
            "a while loop whose trip count is known only at run time is counted once"})
    if p is _jax.cond_p:
        branches = [_count(b.jaxpr) for b in eqn.params["branches"]]
        worst = max(branches, key=_cost_key)
        if any(b != worst for b in branches):
            worst = dataclasses.replace(worst, notes=worst.notes | {
                "pl.when/lax.cond: the costlier branch is counted at every step (an upper "
                "bound)"})
        return worst
    if p is copy_start_p:
        return _copy_work(eqn)
    if p in _ACCESSES:
        value = eqn.outvars[0].aval if p in (_jax.get_p, masked_load_p) else \
            eqn.invars[1].aval
        size = element_count(value) * np.dtype(value.dtype).itemsize * (
            2 if p in _READ_WRITE else 1)
        refs = _OPERAND_REFS.get()
        if refs and eqn.invars[0] in refs:
            return Work(load_bytes=size)
        space = getattr(eqn.invars[0].aval, "memory_space", None)
        if str(getattr(space, "name", space)).lower() in _OFF_CHIP:
            return Work(copy_bytes=size)  # a pipelined kernel's direct access to HBM
        return Work()
    own = _OP_COST.get()
    cost = own(eqn) if own is not None else None
    if cost is not None:
        return Work(matmul=int(cost.matmul_flops), vector=int(cost.vector_flops),
                     transcendentals=int(cost.transcendentals), matmul_dtype=cost.matmul_dtype,
                     copy_bytes=int(cost.hbm_bytes))
    total = Work()
    for sub in _jax.sub_jaxprs(eqn.params):
        total = total + _count(sub)
    return total


_ACCESSES = (_jax.get_p, _jax.swap_p, _jax.addupdate_p, masked_load_p, masked_swap_p,
             atomic_rmw_p)
_READ_WRITE = (_jax.addupdate_p, atomic_rmw_p)
_OPERAND_REFS: contextvars.ContextVar[frozenset[Any]] = contextvars.ContextVar(
    "pallas_operand_refs", default=frozenset())
"""While a kernel of a ``"loads"`` backend is counted: the variables, in its body and the
jaxprs inside, that hold its operands' Refs."""


def operand_refs(call: KernelCall) -> frozenset[Any]:
    """The variables holding ``call``'s operand Refs (not scratch), followed into the jaxprs
    of loops, branches, calls and scoped allocations."""
    jaxpr = call.jaxpr.jaxpr
    found = set(jaxpr.invars[:len(call.grid_mapping.block_mappings)])

    def walk(j: Any) -> None:
        for eqn in j.eqns:
            for sub, operands in aligned(eqn):
                found.update(v for v, a in zip(sub.invars, operands, strict=False)
                             if _jax.is_var(a) and a in found)
                walk(sub)

    walk(jaxpr)
    return frozenset(found)


def aligned(eqn: Any) -> list[tuple[Any, list[Any]]]:
    """Each jaxpr inside ``eqn`` with the operands of ``eqn`` its invars receive, in order."""
    p, params, ins = eqn.primitive, eqn.params, list(eqn.invars)
    if p is _jax.cond_p:
        return [(b.jaxpr, ins[1:]) for b in params["branches"]]
    if p is _jax.while_p:
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        return [(params["cond_jaxpr"].jaxpr, ins[:nc] + ins[nc + nb:]),
                (params["body_jaxpr"].jaxpr, ins[nc:])]
    if p is _jax.scan_p:
        consts, carry, xs, _ = _jax.scan_parts(params, ins)
        return [(params["jaxpr"].jaxpr, consts + carry + xs)]
    return [(sub, ins) for sub in _jax.sub_jaxprs(params)]


_OFF_CHIP = frozenset({"any", "hbm", "gmem"})
"""Memory spaces (by name, lower case) that live in HBM: a copy between one of them and an
on-chip space moves HBM traffic."""


def _copy_work(eqn: Any) -> Work:
    size, src, dst, remote = copy_start_traffic(eqn)
    off = [str(getattr(s, "name", s)).lower() in _OFF_CHIP for s in (src, dst)]
    if remote:
        return Work(notes=frozenset({
            "copies to other devices are not counted as HBM traffic (they move over the "
            "interconnect)"}))
    if off[0] != off[1]:
        return Work(copy_bytes=size)
    return Work()


_OP_COST: contextvars.ContextVar[Callable[[Any], OpCost | None] | None] = \
    contextvars.ContextVar("pallas_op_cost", default=None)
"""While a kernel is counted, its backend's ``pallas_op_cost`` hook."""
_OP_VALUE: contextvars.ContextVar[Callable[[Any], Any] | None] = \
    contextvars.ContextVar("pallas_op_value", default=None)
"""While a kernel is counted, its backend's ``pallas_op_value`` hook."""


@contextlib.contextmanager
def _backend_costs(backend: str | None) -> Any:
    if backend is None or backend not in manager.backends():
        yield
        return

    def cost(eqn: Any) -> OpCost | None:
        return manager.call_hook(backend, "pallas_op_cost", eqn=eqn)

    def value(eqn: Any) -> Any:
        return manager.call_hook(backend, "pallas_op_value", eqn=eqn)

    token, token_value = _OP_COST.set(cost), _OP_VALUE.set(value)
    try:
        yield
    finally:
        _OP_COST.reset(token)
        _OP_VALUE.reset(token_value)


# --- counting per grid step --------------------------------------------------------------
#
# A kernel body's scalars that depend only on the grid indices (``pl.program_id``, the grid's
# sizes, arithmetic on them) are evaluated on every grid point at once with numpy
# (``index_eval``). A ``pl.when``/``lax.cond`` whose predicate is such a scalar then counts
# each branch on exactly the steps that take it (a causal kernel's skipped blocks are not
# counted), and a ``fori_loop`` whose bounds are such scalars counts its body as many times
# as each step runs it. What cannot be evaluated falls back to the bounds of :func:`_count`.


def _count_steps(call: KernelCall) -> tuple[Work, int | None] | None:
    """The body's work summed over the grid's steps, and the flops the steps skip against
    every step running the costlier branch and the most trips of each loop (``None`` when
    nothing was decided per step); ``None`` when the grid's steps are not known ahead of
    time."""
    gm = call.grid_mapping
    if gm.dynamic_axes or not 0 < gm.num_steps <= gmap.MAX_STATIC_CHECK_POINTS:
        return None
    points = gmap.grid_points(gm.grid)
    counted = _count_masked(call.jaxpr.jaxpr, {}, np.ones(gm.num_steps, bool), points, gm)
    if not counted.decided:
        return counted.work, None
    return counted.work, counted.dense.total - counted.work.total


def _known(env: Mapping[Any, np.ndarray], atom: Any) -> np.ndarray | None:
    if isinstance(atom, _jax.Literal):
        return np.asarray(atom.val)
    return env.get(atom)


@dataclasses.dataclass(frozen=True)
class _Counted:
    work: Work
    """Summed over the steps where the code runs."""
    dense: Work
    """As if every step ran the costlier branch and the most trips of each loop."""
    decided: bool
    """A branch or a trip count was decided per grid step."""


def _count_masked(jaxpr: Any, env: dict[Any, np.ndarray], mask: np.ndarray,
                  points: np.ndarray, gm: Any) -> _Counted:
    """The work of ``jaxpr`` summed over the grid points where ``mask`` holds."""
    work, dense, decided = Work(), Work(), False
    steps = int(mask.sum())
    for eqn in jaxpr.eqns:
        p = eqn.primitive
        if p is program_id_p:
            env[eqn.outvars[0]] = points[:, eqn.params["axis"] + gm.num_batch_axes]
            continue
        if p is num_programs_p:
            env[eqn.outvars[0]] = np.asarray(gm.grid[eqn.params["axis"] + gm.num_batch_axes])
            continue
        if p is _jax.cond_p and (which := _known(env, eqn.invars[0])) is not None:
            branches = eqn.params["branches"]
            which = np.clip(np.broadcast_to(which, mask.shape).astype(np.int64), 0,
                            len(branches) - 1)
            worst = Work()
            for b, branch in enumerate(branches):
                inner = {v: x for v, a in zip(branch.jaxpr.invars, eqn.invars[1:], strict=True)
                         if (x := _known(env, a)) is not None}
                taken = _count_masked(branch.jaxpr, dict(inner), mask & (which == b), points,
                                      gm)
                every = _count_masked(branch.jaxpr, inner, mask, points, gm)
                work = work + taken.work
                worst = max(worst, every.dense, key=_cost_key)
            dense, decided = dense + worst, True
            continue
        if p is _jax.while_p and (trips := _trip_counts(eqn, env)) is not None:
            # The body on the points that run it t times, for each t; inside, the loop's
            # constants (and invariant carries) are known as they are outside.
            body = eqn.params["body_jaxpr"].jaxpr
            nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
            carries = eqn.invars[nc + nb:]
            operands = list(eqn.invars[nc:nc + nb]) + [
                a if body.outvars[k] is body.invars[nb + k] else None
                for k, a in enumerate(carries)]
            inner = {v: x for v, a in zip(body.invars, operands, strict=True)
                     if a is not None and (x := _known(env, a)) is not None}
            trips = np.broadcast_to(trips, mask.shape)
            for t in np.unique(trips[mask]):
                if t > 0:
                    sub = _count_masked(body, dict(inner), mask & (trips == t), points, gm)
                    work = work + sub.work.times(int(t))
            every = _count_masked(body, dict(inner), mask, points, gm)
            dense = dense + every.dense.times(int(trips.max(initial=0)))
            decided = True
            continue
        if p is _jax.axis_index_p and gm.grid_names and \
                eqn.params.get("axis_name") in gm.grid_names:  # a mesh kernel's core index
            axis = gm.grid_names.index(eqn.params["axis_name"])
            env[eqn.outvars[0]] = points[:, axis + gm.num_batch_axes]
            continue
        inside = _count_inside(eqn, env, mask, points, gm)
        if inside is not None:
            work, dense = work + inside.work, dense + inside.dense
            decided = decided or inside.decided
            continue
        here = _count_eqn(eqn).times(steps)
        work, dense = work + here, dense + here
        ins = [_known(env, a) for a in eqn.invars]
        if all(x is not None for x in ins) and all(
                getattr(v.aval, "shape", None) == () for v in eqn.outvars):
            outs: list[Any] | None
            try:
                outs = index_eval.evaluate_equation(eqn, [x for x in ins if x is not None])
            except (index_eval.NotVectorisableError, TypeError, ValueError):
                outs = _backend_value(eqn)
            for var, out in zip(eqn.outvars, outs or (), strict=False):
                env[var] = np.asarray(out)
    return _Counted(work, dense, decided)


def _backend_value(eqn: Any) -> list[Any] | None:
    """The value of a backend primitive the backend knows ahead of time (its
    ``pallas_op_value`` hook), as a list of outputs."""
    ask = _OP_VALUE.get()
    value = ask(eqn) if ask is not None else None
    if value is None:
        return None
    return list(value) if eqn.primitive.multiple_results else [value]


def _count_inside(eqn: Any, env: Mapping[Any, np.ndarray], mask: np.ndarray,
                  points: np.ndarray, gm: Any) -> _Counted | None:
    """An equation holding one jaxpr that its operands flow into (``jit``, ``run_scoped``,
    a ``scan``'s constants, ...), counted inside with what is known of them; ``None`` for
    others."""
    subs = _jax.sub_jaxprs(eqn.params)
    if len(subs) != 1 or eqn.primitive in (_jax.cond_p, _jax.while_p):
        return None
    (sub,) = subs
    if eqn.primitive is _jax.scan_p:  # the body takes (*consts, *carry, *xs)
        operands, times = _jax.scan_parts(eqn.params, eqn.invars)[0], int(eqn.params["length"])
    elif len(sub.invars) >= len(eqn.invars):
        operands, times = list(eqn.invars), 1
    else:
        return None
    inner = {v: x for v, a in zip(sub.invars, operands, strict=False)
             if (x := _known(env, a)) is not None}
    counted = _count_masked(sub, inner, mask, points, gm)
    return _Counted(counted.work.times(times), counted.dense.times(times), counted.decided)


def _trip_counts(eqn: Any, env: Mapping[Any, np.ndarray]) -> np.ndarray | None:
    """Per grid point, the trip count of a counted loop (a ``while`` whose condition is
    ``i < upper`` and whose body adds a positive step to ``i``: a ``fori_loop``, a persistent
    kernel's loop over tiles) with its start, bound and step known per point."""
    cond = eqn.params["cond_jaxpr"].jaxpr
    body = eqn.params["body_jaxpr"].jaxpr
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive is not lax.lt_p:
        return None
    carry = cond.invars[nc:]
    lhs, rhs = cond.eqns[0].invars
    if lhs not in carry or rhs not in carry:
        return None
    i, upper = carry.index(lhs), carry.index(rhs)
    counter, bound = body.invars[nb + i], body.invars[nb + upper]
    defs = [e for e in body.eqns if body.outvars[i] in e.outvars]
    if len(defs) != 1 or defs[0].primitive is not lax.add_p or \
            counter not in defs[0].invars or body.outvars[upper] is not bound:
        return None
    others = [a for a in defs[0].invars if a is not counter]
    if len(others) != 1:
        return None
    step_atom = others[0]
    init = eqn.invars[nc + nb:]
    consts = dict(zip(body.invars[:nb], eqn.invars[nc:nc + nb], strict=True))
    step: np.ndarray | None
    if isinstance(step_atom, _jax.Literal):
        step = np.asarray(step_atom.val)
    elif step_atom in consts:
        step = _known(env, consts[step_atom])
    else:
        return None
    lo, hi = _known(env, init[i]), _known(env, init[upper])
    if lo is None or hi is None or step is None or np.any(step <= 0):
        return None
    span = np.maximum(hi.astype(np.int64) - lo.astype(np.int64), 0)
    return -(-span // step.astype(np.int64))


def count_work(call: KernelCall, backend: str | None) -> tuple[Work, int | None]:
    """The body's work over the whole grid, per step where it can be (see
    :func:`_count_steps`), and the flops skipped against the costlier-branch bound;
    ``backend`` counts its own primitives."""
    gm = call.grid_mapping
    token = _OPERAND_REFS.set(operand_refs(call) if block_loads(backend) else frozenset())
    try:
        with _backend_costs(backend):
            return _work_counted(call, gm)
    finally:
        _OPERAND_REFS.reset(token)


def block_loads(backend: str | None) -> bool:
    """Whether ``backend``'s blocks are windows on HBM that the body loads from."""
    return backend is not None and backend in manager.backends() and getattr(
        manager.get(backend).info, "block_traffic", "pipeline") == "loads"


def _work_counted(call: KernelCall, gm: Any) -> tuple[Work, int | None]:
    per_step = _count_steps(call)
    if per_step is not None:
        return per_step
    return _count(call.jaxpr.jaxpr).times(1 if gm.dynamic_axes else gm.num_steps), None
