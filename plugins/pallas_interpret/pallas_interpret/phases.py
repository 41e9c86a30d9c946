"""Runs a kernel whose points share memory and wait for each other's arrivals, each point at
its own pace: the warpgroups of a GPU thread block at their mbarriers.

A Mosaic GPU kernel may specialise its warpgroups (``plgpu.kernel(num_threads=3,
thread_name="wg")``): one copies blocks into shared memory that all of them allocated together
(``pl.run_scoped(..., collective_axes="wg")``) and arrives on a barrier, the others wait on it,
compute, and arrive on another barrier that the first waits on before it reuses the buffer
(JAX's attention_mgpu). Run one warpgroup after the other, the first waiting one would read a
buffer nobody has filled yet. Here they run as :mod:`pallas_interpret.handshake` runs cores
that signal each other's semaphores, each with a program counter of its own:

* the *group* is the points along the axes that ``pl.run_scoped(collective_axes=...)`` names
  (the thread axis); groups (thread blocks) run one after another;
* buffers allocated by such a ``run_scoped`` are one buffer for the group; others are one per
  point, as in :mod:`pallas_interpret.lockstep`;
* a wait (``PrimitiveSemantics.phase_wait``: ``plgpu.barrier_wait``) is where a point may stop:
  the Ref counts arrivals (``barrier_arrive``, and a copy completing it, add one each), and
  the point's ``k``-th wait on that counter returns once it holds ``k * num_arrivals`` (each
  point counts its own waits per counter, as each GPU thread tracks a barrier's phase);
* ``pl.run_state`` around such a wait (an accumulator started at a value, ``plgpu.ACC.init``)
  gets a buffer per point, set to the value, read back at its end.

Everything between waits runs with the reference semantics, as elsewhere in the interpreter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from pallas_core import backend as plb
from pallas_core import primitives as prims
from pallas_core import reference
from pallas_core.copies import RefViews
from pallas_core.semantics import fresh_buffer
from pallas_interpret import checks, handshake, lockstep
from pallas_interpret.handshake import State, _Operand, _set_pc, _store, _Val
from pallas_interpret.lockstep import _Slot


def group_axes(call: Any) -> tuple[int, ...] | None:
    """The full-grid axes along which ``call``'s points share memory
    (``pl.run_scoped(collective_axes=...)``), when the kernel also waits for arrivals
    (``phase_wait`` primitives) and more than one point shares; else ``None``."""
    waits = reference.phase_waits()
    gm = call.grid_mapping
    if not waits or not gm.grid_names or gm.dynamic_axes:
        return None
    names: set[Any] = set()
    found = False
    for eqn in reference.all_eqns(call.jaxpr.jaxpr):
        found = found or eqn.primitive in waits
        if eqn.primitive is prims.run_scoped_p:
            names.update(eqn.params.get("collective_axes", ()))
    user = list(gm.grid_names)
    names &= set(user)
    if not found or not names:
        return None
    axes = tuple(sorted(gm.num_batch_axes + user.index(n) for n in names))
    return axes if math.prod(gm.grid[a] for a in axes) > 1 else None


class _Runner(handshake._Runner):
    """The handshake runner, stopping at phase waits as well as at semaphore operations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits = reference.phase_waits()
        self.sync_ops = (*handshake._SEMAPHORE_OPS, *self.waits)
        gm = self.call.grid_mapping
        names = gm.grid_names or ()
        self.axis_names = {names[a - gm.num_batch_axes] for a in self.axes}
        self.seen: dict[int, _Val] = {}  # per counter slot: the waits of each point

    def call_jaxpr(self, closed: Any, ins: Sequence[Any], slots: lockstep.Slots
                   ) -> tuple[list[Any], lockstep.Slots]:
        self.seen = {}
        return super().call_jaxpr(closed, ins, slots)

    def structured(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        prim = eqn.primitive
        if prim in self.waits:
            return self.phase_wait(eqn, ins)
        if prim is prims.run_scoped_p:
            return self.scope(eqn, ins)
        if prim is plb.run_state_p:
            return self.run_state(eqn, ins)
        return super().structured(eqn, ins)

    def scope(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        """``pl.run_scoped``: one buffer for the whole group where it is collective along the
        group's axes, else one per point, fresh each time the point enters the scope (an
        accumulator starts at zero, a barrier with no arrivals and no waits)."""
        checks.check_scoped_allocation(self.call, self.params, eqn.params["scoped"])
        shared = self.axis_names <= set(eqn.params.get("collective_axes", ()))
        new, fresh = [], []
        for t in eqn.params["scoped"]:
            slot = self.new_slot(shared)
            shape = tuple(t.shape) if shared else (self.members, *t.shape)
            self.scoped[slot] = fresh_buffer(shape, t.dtype, t.memory_space, self.params.poison)
            new.append(_Slot(slot))
            if not shared:
                fresh.append((slot, fresh_buffer(tuple(t.shape), t.dtype, t.memory_space,
                                                 self.params.poison)))

        def enter(state: State, p: Any) -> State:
            slots = dict(state["slots"])
            for slot, value in fresh:
                slots[slot] = slots[slot].at[p].set(value)
            waited = [self.seen[slot] for slot, _ in fresh if slot in self.seen]
            state = _store(state, p, waited, [jnp.zeros(self.avals[k.key].shape, jnp.int32)
                                              for k in waited])
            return {**state, "slots": slots}

        if fresh:
            self.emit(enter)
        return self.compile(eqn.params["jaxpr"], [*ins, *new])

    def phase_wait(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        counter, *rest = ins
        if not isinstance(counter, _Slot):
            raise self.refuse(f"{eqn.primitive.name} on a Ref made inside the kernel")
        params = eqn.params
        tree, roles = params["tree"], params.get("roles", (0,))
        aval = eqn.invars[0].aval
        need = int(getattr(aval.memory_space, "num_arrivals", 1) or 1)
        seen = self.seen.get(counter.id)
        if seen is None:
            seen = self.seen[counter.id] = self.new_val(plb.ShapedArray(aval.shape,
                                                                         jnp.int32))
        here = len(self.steps)

        def wait(state: State, p: Any) -> State:
            flat = [self.value(o, state, p) for o in rest[:tree.num_leaves]]
            views = RefViews([self.value(counter, state, p), *flat], tree, roles)
            mine = views.with_values([self.value(seen, state, p)])
            waited = mine.read(0)
            ready = jnp.all(views.read(0) >= (waited + 1) * need)
            mine.write(0, jnp.where(ready, waited + 1, waited))
            state = _store(state, p, [seen], [mine.values[0]])
            return {**_set_pc(state, p, jnp.where(ready, here + 1, here)),
                    "blocked": jnp.logical_not(ready)}

        self.steps.append(wait)
        return []

    def run_state(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        """``pl.run_state`` holding a wait: a buffer per point for each Ref it starts."""
        jaxpr = eqn.params["jaxpr"]
        given = iter(ins)
        refs: list[_Slot] = []
        inits: list[tuple[int, _Operand]] = []
        fresh: list[tuple[int, Any]] = []  # (position, aval) of the Refs made here
        for k, (var, ready) in enumerate(zip(jaxpr.invars, eqn.params["is_initialized"])):
            op = next(given) if ready else None
            if isinstance(op, _Slot):  # a Ref the body closes over
                refs.append(op)
                continue
            aval = var.aval
            slot = self.new_slot(False)
            self.scoped[slot] = fresh_buffer((self.members, *aval.shape), aval.dtype,
                                             aval.memory_space, self.params.poison)
            refs.append(_Slot(slot))
            fresh.append((k, aval))
            if op is not None:
                inits.append((slot, op))

        def start(state: State, p: Any) -> State:
            slots = dict(state["slots"])
            for slot, op in inits:
                slots[slot] = slots[slot].at[p].set(
                    jnp.asarray(self.value(op, state, p), slots[slot].dtype))
            return {**state, "slots": slots}

        if inits:
            self.emit(start)
        self.compile(jaxpr, list(refs))
        keys = [self.new_val(plb.ShapedArray(a.shape, a.dtype)) for _, a in fresh]

        def finish(state: State, p: Any) -> State:
            return _store(state, p, keys, [lockstep._row(state["slots"][refs[k].id], p)
                                           for k, _ in fresh])

        self.emit(finish)
        outs: list[_Operand] = list(refs)
        for (k, _), key in zip(fresh, keys):
            outs[k] = key
        return outs


def run(call: Any, args: Sequence[Any], rules: reference.Rules, params: Any,
        axes: tuple[int, ...]) -> list[Any]:
    """The outputs of ``call`` on ``args``, the points along ``axes`` (see
    :func:`group_axes`) run each at its own pace."""
    return lockstep.run(call, args, rules, params, axes, runner_class=_Runner)
