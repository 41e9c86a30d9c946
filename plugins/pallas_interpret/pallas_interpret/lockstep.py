"""Runs a kernel whose mesh points meet at barriers (e.g. ``plsc.subcore_barrier``) in lockstep.

The points that a barrier synchronises form a *group* (the subcores of one SparseCore). A group
runs phase by phase: every point runs up to its next barrier before any point goes past it.
Within a phase the points run one after another (in an order shuffled by ``shuffle_seed``, to
expose kernels that depend on it); groups run one after another.

Each point keeps its own values and its own memory (``run_scoped`` buffers, scratch) from one
phase to the next: they are held stacked, one row per point. Memory that is shared (the
kernel's operands, and memory spaces marked ``shared`` such as SparseCore's ``VMEM_SHARED``)
is one buffer that every point reads and writes in turn.

The kernel is split at its barriers. A barrier may sit at the top of the kernel or inside
``pl.run_scoped``, ``jax.jit``-ed functions, loops (``fori_loop``, ``while_loop``, ``scan``)
and ``cond``; there, every point of a group must take the same path (the same trip count, the
same branch), as the hardware needs: points that disagree would wait forever, and the
interpreter reports that. The code between barriers is discharged and evaluated with the
reference semantics, as :mod:`pallas_interpret.grid` evaluates whole kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import backend as plb
from pallas_core.backend import (
    KernelCall,
    PallasError,
    ReferenceContext,
    UnsupportedError,
    fresh_buffer,
    reported,
)
from pallas_interpret import blocks, checks
from pallas_interpret.params import InterpretParams


class BarrierDivergenceError(PallasError):
    """The points of a group disagree on whether (or how often) to reach a barrier."""


def barrier_axes(call: KernelCall) -> tuple[int, ...] | None:
    """The full-grid axes that ``call``'s barriers synchronise; ``None`` without barriers.

    Raises ``PallasError`` if barriers name axes that are not the kernel's, or disagree.
    """
    rules = plb.barrier_rules()
    gm = call.grid_mapping
    found: set[tuple[int, ...]] = set()
    for eqn in plb.all_eqns(call.jaxpr.jaxpr):
        if eqn.primitive not in rules:
            continue
        names = rules[eqn.primitive](**eqn.params)
        user = gm.grid_names or ()
        if names is None:
            axes = tuple(range(len(gm.user_grid)))
        else:
            missing = [n for n in names if n not in user]
            if missing:
                raise PallasError(
                    f"{eqn.primitive.name} in kernel {call.name!r} synchronises mesh axes "
                    f"{tuple(names)}, but the kernel's axes are {tuple(user)}. Fix: run the "
                    "kernel on the mesh the barrier belongs to.")
            axes = tuple(sorted(user.index(n) for n in names))
        found.add(tuple(a + gm.num_batch_axes for a in axes))
    if len(found) > 1:
        raise UnsupportedError(
            f"kernel {call.name!r} has barriers over different mesh axes {sorted(found)}; the "
            "interpreter runs one kind of barrier group per kernel.")
    return next(iter(found)) if found else None


def lockstep_axes(call: KernelCall) -> tuple[int, ...] | None:
    """The axes to run in lockstep: those of ``call``'s barriers, when more than one point
    waits at them; ``None`` when the kernel can run step by step."""
    axes = barrier_axes(call)
    if axes is None or math.prod(call.grid_mapping.grid[a] for a in axes) == 1:
        return None
    return axes


# --- what the environment holds -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A value that differs between the points of a group: one row per point."""
    value: Any


@dataclasses.dataclass(frozen=True)
class _Uniform:
    """A value that is the same for every point of a group (a constant)."""
    value: Any


@dataclasses.dataclass(frozen=True)
class _Slot:
    """A Ref: the buffer ``slots[id]`` (stacked per point unless shared)."""
    id: int


_Entry = _Stacked | _Uniform | _Slot
Slots = dict[int, Any]


def live_sets(jaxpr: Any) -> list[set[Any]]:
    """Entry ``i``: the variables that equation ``i`` or a later one reads, or that ``jaxpr``
    returns (the last entry: those it returns)."""
    live_from: list[set[Any]] = [set()] * (len(jaxpr.eqns) + 1)
    live = {v for v in jaxpr.outvars if plb.is_var(v)}
    live_from[-1] = set(live)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        live = live | {v for v in jaxpr.eqns[i].invars if plb.is_var(v)}
        live_from[i] = live
    return live_from


def _row(x: Any, m: Any) -> Any:
    return lax.dynamic_index_in_dim(x, m, 0, keepdims=False)


class _Runner:
    """Evaluates a kernel jaxpr for one group of ``members`` points, phase by phase."""

    def __init__(self, call: KernelCall, rules: plb.SemanticsRules, params: InterpretParams,
                 axes: tuple[int, ...]):
        gm = call.grid_mapping
        self.call, self.rules, self.checked = call, rules, params.checked
        self.params = params
        self.grid = gm.grid
        self.axes = axes
        self.group_axes = tuple(a for a in range(len(gm.grid)) if a not in axes)
        self.members = math.prod(gm.grid[a] for a in axes)
        self.groups = math.prod(gm.grid[a] for a in self.group_axes)
        self.shared: dict[int, bool] = {}
        self.barriers = frozenset(plb.barrier_rules())
        self.rng = (None if params.shuffle_seed is None
                    else np.random.default_rng(params.shuffle_seed))
        self.group: Any = jnp.int32(0)

    # --- slots

    def new_slot(self, shared: bool) -> int:
        slot = len(self.shared)
        self.shared[slot] = shared
        return slot

    def fresh_buffer(self, shape: Sequence[int], dtype: Any, memory_space: Any) -> tuple[int, Any]:
        shared = bool(getattr(memory_space, "shared", False))
        full = tuple(shape) if shared else (self.members, *shape)
        return self.new_slot(shared), fresh_buffer(full, dtype, memory_space,
                                                   self.params.poison)

    # --- where the points are

    def context(self, member: Any) -> ReferenceContext:
        gm = self.call.grid_mapping
        ids: list[Any] = [None] * len(self.grid)
        for a, i in zip(self.group_axes, blocks.unravel(self.group,
                                                  [self.grid[a] for a in self.group_axes])):
            ids[a] = i
        for a, i in zip(self.axes, blocks.unravel(member, [self.grid[a] for a in self.axes])):
            ids[a] = i
        return ReferenceContext(tuple(jnp.asarray(i, jnp.int32) for i in ids), gm.grid,
                                gm.num_batch_axes, gm.grid_names, self.checked)

    def order(self) -> Any:
        """The order in which the points run the next phase."""
        if self.rng is None:
            return None
        return jnp.asarray(self.rng.permutation(self.members), jnp.int32)

    # --- evaluation

    def holds_barrier(self, eqn: Any) -> bool:
        return eqn.primitive in self.barriers or any(
            plb.find_eqn(sub, self.barriers) is not None
            for sub in plb.sub_jaxprs(eqn.params))

    def run_jaxpr(self, jaxpr: Any, env: dict[Any, _Entry], slots: Slots
                  ) -> tuple[list[_Entry], Slots]:
        """Runs ``jaxpr`` (its invars and constvars bound in ``env``) for every point."""
        env = dict(env)
        live_from = live_sets(jaxpr)
        segment: list[Any] = []
        for i, eqn in enumerate(jaxpr.eqns):
            if not self.holds_barrier(eqn):
                segment.append(eqn)
                continue
            slots = self.run_segment(segment, env, slots, live_from[i])
            segment = []
            with plb.user_context(eqn):
                slots = self.run_structured(eqn, env, slots)
        slots = self.run_segment(segment, env, slots, live_from[-1])
        return [_Uniform(v.val) if isinstance(v, plb.Literal) else env[v]
                for v in jaxpr.outvars], slots

    def run_segment(self, eqns: list[Any], env: dict[Any, _Entry], slots: Slots,
                    live: set[Any]) -> Slots:
        """Runs barrier-free equations for each point in turn; binds their live results."""
        if not eqns:
            return slots
        defined: set[Any] = set()
        free: list[Any] = []
        for eqn in eqns:
            for v in eqn.invars:
                if plb.is_var(v) and v not in defined and v not in free:
                    free.append(v)
            defined.update(v for v in eqn.outvars if plb.is_var(v))
        outs = [v for eqn in eqns for v in eqn.outvars if plb.is_var(v) and v in live]
        for v in outs:
            if isinstance(v.aval, plb.AbstractRef):
                raise UnsupportedError(
                    f"kernel {self.call.name!r} makes a Ref that is used across a barrier; the "
                    "interpreter cannot carry it from one phase to the next. Fix: allocate it "
                    "with pl.run_scoped around the barrier, or as scratch.")
        ref_slots = [env[v].id for v in free if isinstance(env[v], _Slot)]  # type: ignore[union-attr]
        if len(set(ref_slots)) != len(ref_slots):
            raise UnsupportedError(
                f"kernel {self.call.name!r} passes one Ref twice into code between barriers; "
                "the interpreter cannot tell the two apart. Fix: pass it once.")
        closed = plb.jaxpr_from_eqns(free, outs, eqns)
        with self.discharge_context():
            discharged = plb.discharge_state(closed,
                                              axis_sizes=self.call.grid_mapping.axis_env)
        order = self.order()

        def point(k: Any, carry: tuple[list[Any], Slots]) -> tuple[list[Any], Slots]:
            results, slots = carry
            m = k if order is None else order[k]
            args = []
            for v in free:
                entry = env[v]
                if isinstance(entry, _Slot):
                    buf = slots[entry.id]
                    args.append(buf if self.shared[entry.id] else _row(buf, m))
                elif isinstance(entry, _Stacked):
                    args.append(_row(entry.value, m))
                else:
                    args.append(entry.value)
            res = plb.eval_jaxpr_with_rules(discharged.jaxpr, discharged.consts, args,
                                       self.context(m), self.rules)
            results = [r.at[m].set(x) for r, x in zip(results, res[:len(outs)])]
            slots = dict(slots)
            for slot, x in zip(ref_slots, res[len(outs):]):
                slots[slot] = x if self.shared[slot] else slots[slot].at[m].set(x)
            return results, slots

        init = [jnp.zeros((self.members, *v.aval.shape), v.aval.dtype) for v in outs]
        results, slots = lax.fori_loop(0, self.members, point, (init, slots))
        env.update((v, _Stacked(r)) for v, r in zip(outs, results))
        return slots

    def discharge_context(self) -> contextlib.AbstractContextManager[None]:
        if not self.checked:
            return contextlib.nullcontext()
        return checks.checked_rules(self.call, self.params)

    # --- equations that hold a barrier

    def run_structured(self, eqn: Any, env: dict[Any, _Entry], slots: Slots) -> Slots:
        prim = eqn.primitive
        ins = [_Uniform(v.val) if isinstance(v, plb.Literal) else env[v] for v in eqn.invars]
        if prim in self.barriers:
            return slots  # the segments on either side are the phases it separates
        handler = _STRUCTURED.get(prim)
        if handler is None:
            raise UnsupportedError(
                f"a barrier inside {prim.name!r} in kernel {self.call.name!r}: the interpreter "
                "runs barriers at the top of a kernel or inside pl.run_scoped, jit, loops and "
                "cond. Fix: move the barrier out of it.")
        outs, slots = handler(self, eqn, ins, slots)
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if plb.is_var(v))
        return slots

    def stacked(self, entry: _Entry) -> Any:
        if isinstance(entry, _Stacked):
            return entry.value
        if isinstance(entry, _Uniform):
            x = jnp.asarray(entry.value)
            return jnp.broadcast_to(x[None], (self.members, *x.shape))
        raise UnsupportedError(
            f"kernel {self.call.name!r} carries a Ref through a loop or cond that holds a "
            "barrier. Fix: close over the Ref instead.")

    def agreed(self, entry: _Entry, what: str) -> Any:
        """The value every point of the group has; reports points that disagree."""
        if isinstance(entry, _Uniform):
            return entry.value
        x = self.stacked(entry)
        same = jnp.all(x == x[0])
        ids = jnp.arange(self.members, dtype=jnp.int32)
        first = jnp.min(jnp.where(x != x[0], ids, self.members))
        jax.debug.callback(functools.partial(_report_divergence, kernel=self.call.name,
                                             what=what), same, first)
        return x[0]

    def call_jaxpr(self, closed: Any, ins: Sequence[_Entry], slots: Slots
                   ) -> tuple[list[_Entry], Slots]:
        jaxpr, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "consts") else (closed, ())
        env: dict[Any, _Entry] = {v: _Uniform(c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, ins))
        return self.run_jaxpr(jaxpr, env, slots)


@reported
def _report_divergence(same: Any, first: Any, *, kernel: str, what: str) -> None:
    if bool(same):
        return
    raise BarrierDivergenceError(
        f"in kernel {kernel!r}, the points of a barrier group disagree on {what} (point 0 and "
        f"point {int(first)} differ), so some would wait at a barrier the others never reach; "
        "on the hardware the kernel hangs. Fix: make that decision the same for every subcore "
        "(compute it from values that do not depend on the subcore), or move the barrier out "
        "of the loop or branch.")


def _run_scoped(r: _Runner, eqn: Any, ins: list[_Entry], slots: Slots
                ) -> tuple[list[_Entry], Slots]:
    checks.check_scoped_allocation(r.call, r.params, eqn.params["scoped"])
    slots = dict(slots)
    new = []
    for t in eqn.params["scoped"]:
        slot, value = r.fresh_buffer(t.shape, t.dtype, t.memory_space)
        slots[slot] = value
        new.append(_Slot(slot))
    outs, slots = r.call_jaxpr(eqn.params["jaxpr"], [*ins, *new], slots)
    return outs, {k: v for k, v in slots.items() if k not in {s.id for s in new}}


def _inline(key: str) -> Callable[..., tuple[list[_Entry], Slots]]:
    def handler(r: _Runner, eqn: Any, ins: list[_Entry], slots: Slots
                ) -> tuple[list[_Entry], Slots]:
        return r.call_jaxpr(eqn.params[key], ins, slots)
    return handler


def _cond(r: _Runner, eqn: Any, ins: list[_Entry], slots: Slots
          ) -> tuple[list[_Entry], Slots]:
    index, *ops = ins
    branches = eqn.params["branches"]
    if isinstance(index, _Uniform) and not isinstance(index.value, plb.Tracer):
        return r.call_jaxpr(branches[min(max(int(index.value), 0), len(branches) - 1)], ops,
                            slots)
    which = r.agreed(index, "which branch of a cond holding a barrier to take")

    def branch(b: Any) -> Callable[[Slots], tuple[list[Any], Slots]]:
        def run(slots: Slots) -> tuple[list[Any], Slots]:
            outs, slots = r.call_jaxpr(b, ops, slots)
            return [r.stacked(o) for o in outs], slots
        return run

    outs, slots = lax.switch(which, [branch(b) for b in branches], slots)
    return [_Stacked(o) for o in outs], slots


def _while(r: _Runner, eqn: Any, ins: list[_Entry], slots: Slots
           ) -> tuple[list[_Entry], Slots]:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]

    def cond(carry: tuple[list[Any], Slots]) -> Any:
        values, slots = carry
        (go,), _ = r.call_jaxpr(p["cond_jaxpr"], [*cconsts, *map(_Stacked, values)], slots)
        return r.agreed(go, "whether to run another iteration of a loop holding a barrier")

    def body(carry: tuple[list[Any], Slots]) -> tuple[list[Any], Slots]:
        values, slots = carry
        outs, slots = r.call_jaxpr(p["body_jaxpr"], [*bconsts, *map(_Stacked, values)], slots)
        return [r.stacked(o) for o in outs], slots

    values, slots = lax.while_loop(cond, body, ([r.stacked(e) for e in init], slots))
    return [_Stacked(v) for v in values], slots


def _scan(r: _Runner, eqn: Any, ins: list[_Entry], slots: Slots
          ) -> tuple[list[_Entry], Slots]:
    p = eqn.params
    consts, init, xs, split_out = plb.scan_parts(p, ins)
    length = p["length"]
    ys_avals = [v.aval for v in eqn.outvars[len(init):]]

    def x_at(entry: _Entry, i: Any) -> _Entry:
        if isinstance(entry, _Uniform):
            return _Uniform(lax.dynamic_index_in_dim(jnp.asarray(entry.value), i, 0,
                                                     keepdims=False))
        return _Stacked(lax.dynamic_index_in_dim(r.stacked(entry), i, 1, keepdims=False))

    def step(k: Any, carry: tuple[list[Any], list[Any], Slots]
             ) -> tuple[list[Any], list[Any], Slots]:
        values, ys, slots = carry
        i = length - 1 - k if p["reverse"] else k
        outs, slots = r.call_jaxpr(p["jaxpr"], [*consts, *map(_Stacked, values),
                                                *(x_at(x, i) for x in xs)], slots)
        new_carry, new_ys = split_out(outs)
        ys = [y.at[:, i].set(r.stacked(o)) for y, o in zip(ys, new_ys)]
        return [r.stacked(o) for o in new_carry], ys, slots

    ys0 = [jnp.zeros((r.members, *a.shape), a.dtype) for a in ys_avals]
    values, ys, slots = lax.fori_loop(0, length, step, ([r.stacked(e) for e in init], ys0, slots))
    return [_Stacked(v) for v in (*values, *ys)], slots


_STRUCTURED: dict[Any, Callable[..., tuple[list[_Entry], Slots]]] = {
    plb.run_scoped_p: _run_scoped,
    plb.cond_p: _cond,
    plb.while_p: _while,
    plb.scan_p: _scan,
    **{prim: _inline(key) for prim, key in plb.CALL_BODIES.items()},
}
"""Equations that may hold a barrier, and how the group runs them phase by phase."""


# --- the whole call -------------------------------------------------------------------------


def run(call: KernelCall, args: Sequence[Any], rules: plb.SemanticsRules,
        params: InterpretParams, axes: tuple[int, ...],
        runner_class: Callable[..., _Runner] | None = None) -> list[Any]:
    """The outputs of ``call`` on ``args``, the points along ``axes`` (see
    :func:`lockstep_axes`) run in lockstep, or as ``runner_class`` (a subclass of the lockstep
    runner, such as :mod:`pallas_interpret.handshake`'s) runs them."""
    gm = call.grid_mapping
    _check_one_block_per_group(call, axes)
    runner = (runner_class or _Runner)(call, rules, params, axes)
    ins, outs = blocks.initial_operands(call, args, params.poison)
    arrays = [*ins, *outs]
    prefetch = list(args[:gm.num_scalar_prefetch])
    block_slots = [runner.new_slot(True) for _ in gm.block_mappings]
    scratch: Slots = {}
    for aval in gm.scratch_avals:
        slot, value = runner.fresh_buffer(aval.inner_aval.shape, aval.inner_aval.dtype,
                                          aval.memory_space)
        scratch[slot] = value
    operands = [_Slot(s) for s in (*block_slots, *scratch)]

    def group(g: Any, carry: tuple[list[Any], Slots]) -> tuple[list[Any], Slots]:
        # Every point of the group sees the same block of each operand (checked above).
        arrays, scratch = carry
        runner.group = g
        ids = runner.context(jnp.int32(0)).program_ids
        where = [blocks.starts(bm, ids, prefetch) for bm in gm.block_mappings]
        slots = dict(scratch)
        slots.update((slot, blocks.read_block(a, bm, st))
                     for slot, a, bm, st in zip(block_slots, arrays, gm.block_mappings, where))
        _, slots = runner.call_jaxpr(call.jaxpr, operands, slots)
        arrays = [blocks.write_block(a, bm, st, slots[slot])
                  for slot, a, bm, st in zip(block_slots, arrays, gm.block_mappings, where)]
        return arrays, {k: slots[k] for k in scratch}

    carry = (arrays, scratch)
    carry = (group(jnp.int32(0), carry) if runner.groups == 1
             else lax.fori_loop(0, runner.groups, group, carry))
    outs = carry[0][gm.num_inputs:]
    return [blocks.unpad(o, bm) for o, bm in zip(outs, gm.outputs)]


def _check_one_block_per_group(call: KernelCall, axes: tuple[int, ...]) -> None:
    """Raises unless every operand's block is the same for all the points of a group (whole
    arrays, and blocks chosen by batch or core axes only)."""
    gm = call.grid_mapping
    if gm.num_batch_axes == 0 and all(bm.is_whole_array for bm in gm.block_mappings):
        return
    tables = plb.block_index_tables(gm)
    if tables is None:
        varying = [bm.origin for bm in gm.block_mappings if not bm.is_whole_array]
    else:
        varying = []
        for bm, table in zip(gm.block_mappings, tables[1]):
            t = table.reshape(*gm.grid, -1)
            if not all((t == t.take([0], axis=a)).all() for a in axes):
                varying.append(bm.origin)
    if varying:
        raise UnsupportedError(
            f"kernel {call.name!r} has barriers, and the blocks of {', '.join(varying)} differ "
            "between the points a barrier synchronises (or cannot be known ahead of time); "
            "the interpreter runs such kernels when those points share their operands. Fix: "
            "pass whole arrays (pl.kernel, or BlockSpec(memory_space=pl.ANY)) and index them "
            "inside the kernel.")
