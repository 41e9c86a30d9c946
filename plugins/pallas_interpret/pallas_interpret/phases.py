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
  point counts its own waits per counter, as each GPU thread tracks a barrier's phase); a
  test (a ``phase_wait`` with param ``test=True``: ``plgpu.barrier_test``) answers whether
  that wait would return now, counts as the wait when it would, and never stops the point
  (one told "not yet" lets the other points run before it goes on);
* ``pl.run_state`` around such a wait (an accumulator started at a value, ``plgpu.ACC.init``)
  gets a buffer per point, set to the value, read back at its end.

Everything between waits runs with the reference semantics, as elsewhere in the interpreter.

A point may split into sub-points for a region of its code (``PrimitiveSemantics.fork``: the
4 warps of a warpgroup, ``pl.core_map`` over ``plgpu.WarpMesh``, where one warp issues TMA
copies and another tensor-core matmuls, each waiting on barriers the other arrives on). Each
point has 4 more members held for that, parked (finished) outside such regions. At a region's
start the point hands the values the region reads to its sub-points, starts them at the
region's first step and waits until all of them reach its end (where they park again); each
sub-point runs at its own pace, counting its own barrier waits, with ``lax.axis_index`` of the
region's axis giving its position. Buffers a region touches must be shared by the group (the
block's memory), as the warps of a warpgroup share them.

Kernel scratch (``scratch_shapes``) is one buffer for the group where its memory space is
``shared`` (a GPU block's SMEM, TMEM and barriers), else one per point; each group starts with
fresh scratch, as each thread block does.

Blocks of a cluster: where an equation reaches other blocks' shared buffers
(``PrimitiveSemantics.cluster`` names the mesh axes it reaches along: a GPU cluster's), the
group is the cluster, those axes and the axes after them (the points of a block): its blocks
run together, each point at its own pace, and clusters one after another. ``shared``
buffers (scratch, and ``pl.run_scoped`` along the other group axes) are then one per block,
stacked (:meth:`_Runner.block_of`), and such an equation is a step of its own that its
``cross`` rule runs on every block's buffers of its shared Refs (with, per Ref, a buffer of
int32 marks it keeps across steps, zero when the cluster starts). A ``phase_wait`` on a
counter whose memory space names ``collective_axes`` needs ``num_arrivals`` from each block
along them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from pallas_core import backend as plb
from pallas_core.backend import PallasError, RefViews, UnsupportedError, fresh_buffer
from pallas_interpret import checks, handshake, lockstep
from pallas_interpret.handshake import State, _Label, _Operand, _set_pc, _store, _Val
from pallas_interpret.lockstep import _Slot, _Uniform

DISAGREE = -1
"""A point's wait count on a barrier after sub-points that waited on it differently."""


def _fork_markers(jaxpr: Any) -> list[Any]:
    forks = plb.fork_rules()
    return [e for e in plb.all_eqns(jaxpr) if e.primitive in forks]


def check_no_fork(call: Any) -> None:
    """Raises ``UnsupportedError`` if ``call`` splits points into sub-points (a warp region)
    but is not run by this module (its points do not share memory and wait on barriers)."""
    found = _fork_markers(call.jaxpr.jaxpr)
    if found:
        raise UnsupportedError(
            f"kernel {call.name!r} splits a point into sub-points ({found[0].primitive.name}: "
            "e.g. pl.core_map over plgpu.WarpMesh), which the interpreter runs only in kernels "
            "whose points share memory and wait on barriers (pl.run_scoped(collective_axes=) "
            "along the thread axis, e.g. plgpu.dynamic_scheduling_loop's). Fix: run the work "
            "per warpgroup, or lower it for a GPU.")


def cluster_names(call: Any) -> tuple[str, ...]:
    """The mesh axes along which ``call``'s equations reach other blocks' shared buffers
    (``PrimitiveSemantics.cluster``), in grid order; empty if none does."""
    found: set[str] = set()
    for eqn in plb.all_eqns(call.jaxpr.jaxpr):
        found.update(plb.cluster_axes(eqn))
    user = list(call.grid_mapping.grid_names or ())
    missing = sorted(found - set(user))
    if missing:
        raise PallasError(f"kernel {call.name!r} shares work along the cluster axes "
                          f"{missing}, which are not among its mesh axes {tuple(user)}.")
    return tuple(n for n in user if n in found)


def group_axes(call: Any) -> tuple[int, ...] | None:
    """The full-grid axes along which ``call``'s points share memory
    (``pl.run_scoped(collective_axes=...)``), when the kernel also waits for arrivals
    (``phase_wait`` primitives) and more than one point shares; else ``None``. Where the
    kernel reaches across the blocks of a cluster (:func:`cluster_names`), the group is the
    cluster: those axes and the axes after them (the points of each block)."""
    waits = plb.phase_wait_primitives()
    gm = call.grid_mapping
    if not gm.grid_names or gm.dynamic_axes:
        return None
    user = list(gm.grid_names)
    cluster = cluster_names(call)
    if cluster:
        first = min(user.index(n) for n in cluster)
        names = set(cluster) | set(user[first:])
        return tuple(sorted(gm.num_batch_axes + user.index(n) for n in names))
    if not waits:
        return None
    names = set()
    found = False
    for eqn in plb.all_eqns(call.jaxpr.jaxpr):
        found = found or eqn.primitive in waits
        if eqn.primitive is plb.run_scoped_p:
            names.update(eqn.params.get("collective_axes", ()))
    names &= set(user)
    if not found or not names:
        return None
    axes = tuple(sorted(gm.num_batch_axes + user.index(n) for n in names))
    return axes if math.prod(gm.grid[a] for a in axes) > 1 else None


class _Runner(handshake._Runner):
    """The handshake runner, stopping at phase waits as well as at semaphore operations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits = plb.phase_wait_primitives()
        self.claims = plb.claim_primitives()
        found = [e for e in plb.all_eqns(self.call.jaxpr.jaxpr)
                 if e.primitive in self.claims]
        self.claimed_axes = self._claim_axes(found)
        if not self.claimed_axes:
            self.claims = frozenset()  # claims keep their own meaning: none succeeds
        self.sync_ops = (*handshake._SEMAPHORE_OPS, *self.waits, *self.claims)
        self.claimed: _Val | None = None  # per point: how many points it claimed
        gm = self.call.grid_mapping
        names = gm.grid_names or ()
        self.axis_names = {names[a - gm.num_batch_axes] for a in self.axes}
        self.seen: dict[int, _Val] = {}  # per counter slot: the waits of each point
        # Sub-points (see the module docstring): point p's are base + p * width + (0..width-1).
        self.forks = plb.fork_rules()
        sizes = {self.forks[e.primitive](**e.params)[1]
                 for e in _fork_markers(self.call.jaxpr.jaxpr)}
        if len(sizes) > 1:
            raise UnsupportedError(f"kernel {self.call.name!r} splits points into sub-points "
                                   f"of different counts {sorted(sizes)}.")
        self.width = sizes.pop() if sizes else 0
        self.base = self.members
        self.members = self.base * (1 + self.width)
        self.sub_axis: Any = None  # the axis of the region being compiled
        self.finish = _Label()  # the end of the steps, where parked sub-points wait
        self.fresh: lockstep.Slots = {}  # the kernel's scratch, as each group starts it
        # The blocks of a cluster (see the module docstring): shared buffers are one per block.
        self.cluster = cluster_names(self.call)
        self.block_axes = tuple(gm.num_batch_axes + list(names).index(n)
                                for n in self.cluster)
        self.blocks = math.prod(gm.grid[a] for a in self.block_axes)
        self.cross_rules = plb.cluster_rules()
        self.marks: dict[int, int] = {}  # slot -> the slot of its cross rules' marks

    def fresh_buffer(self, shape: Sequence[int], dtype: Any, memory_space: Any
                     ) -> tuple[int, Any]:
        """Kernel scratch: each group (a GPU thread block) starts with its own, fresh (the
        barriers with no arrivals)."""
        slot, value = super().fresh_buffer(shape, dtype, memory_space)
        if self.cluster and self.shared[slot]:
            value = jnp.broadcast_to(value[None], (self.blocks, *value.shape))
            self.per_block.add(slot)
        self.fresh[slot] = value
        return slot, value

    def block_of(self, p: Any) -> Any:
        """The block of the cluster where point (or sub-point) ``p`` is: its position along
        the cluster axes, in row-major order."""
        if not self.cluster:
            return jnp.int32(0)
        ids = self.context(p).program_ids
        block = jnp.int32(0)
        for a in self.block_axes:
            block = block * self.grid[a] + ids[a]
        return block

    def context(self, member: Any) -> Any:
        # A sub-point is where its point is.
        member = jnp.asarray(member, jnp.int32)
        point = jnp.where(member < self.base, member,
                          (member - self.base) // max(self.width, 1))
        return dataclasses.replace(super().context(point),
                                   own_pace=tuple(sorted(self.axis_names, key=str)))

    def order(self) -> Any:
        if self.rng is None:
            return None
        return jnp.asarray(self.rng.permutation(self.members), jnp.int32)

    def _claim_axes(self, found: list[Any]) -> tuple[int, ...]:
        """The grid axes whose points the first block claims (``PrimitiveSemantics.claim``):
        those its claims name, if they all name the same grid axes; else none."""
        gm = self.call.grid_mapping
        user = list(gm.grid_names or ())
        named = {tuple(e.params["grid_names"]) for e in found}
        if len(named) != 1 or not set(next(iter(named))) <= set(user):
            return ()
        return tuple(gm.num_batch_axes + user.index(n) for n in next(iter(named)))

    def claim(self, eqn: Any) -> list[_Operand]:
        """The next grid point the first block claims (the first, its own, is point 0), in
        order along the claimed axes, until none is left."""
        gm = self.call.grid_mapping
        sizes = [gm.grid[a] for a in self.claimed_axes]
        total = math.prod(sizes)
        if self.claimed is None:
            self.claimed = self.new_val(plb.ShapedArray((), jnp.int32))
        made_key = self.claimed
        outs = [self.new_val(v.aval) for v in eqn.outvars]

        def step(state: State, p: Any) -> State:
            made = self.value(made_key, state, p) + 1
            index, rest = [], made
            for size in reversed(sizes):
                index.append(rest % size)
                rest = rest // size
            return _store(state, p, [made_key, *outs],
                          [made, *reversed(index), made < total])

        self.emit(step)
        result: list[_Operand] = list(outs)
        return result

    def call_jaxpr(self, closed: Any, ins: Sequence[Any], slots: lockstep.Slots
                   ) -> tuple[list[Any], lockstep.Slots]:
        self.seen = {}
        self.claimed = None
        self.marks = {}
        slots = {**slots, **self.fresh}
        self.steps, self.avals, self.scoped = [], {}, {}
        if self.width or self.claimed_axes:
            # Sub-points start parked; so does every point of a block other than the first
            # where the first claims all grid points (cancelled before its launch).
            base, finish = self.base, self.finish
            ids = self.context(jnp.int32(0)).program_ids
            cancelled = jnp.bool_(False)
            for a in self.claimed_axes:
                cancelled = cancelled | (ids[a] != 0)

            def park_subs(state: State, q: Any) -> State:
                return _set_pc(state, q, jnp.where((q >= base) | cancelled, finish.at, 1))

            self.steps.append(park_subs)
        outs = self.compile(closed, list(ins))
        if outs:
            raise UnsupportedError(f"kernel {self.call.name!r} returns values; a kernel "
                                   "writes its outputs into Refs.")
        return [], self.schedule(slots)

    def holds(self, eqn: Any) -> bool:
        if eqn.primitive in self.forks or self._sub_index(eqn) or self._crosses(eqn):
            return True
        return super().holds(eqn) or any(
            any(self._sub_index(e) or e.primitive in self.forks or self._crosses(e)
                for e in plb.all_eqns(sub))
            for sub in plb.sub_jaxprs(eqn.params))

    def _crosses(self, eqn: Any) -> bool:
        """Whether ``eqn`` reaches across the blocks of the cluster."""
        return bool(self.cluster) and bool(plb.cluster_axes(eqn))

    def _sub_index(self, eqn: Any) -> bool:
        """Whether ``eqn`` is ``lax.axis_index`` of a sub-point axis."""
        if eqn.primitive is not plb.axis_index_p or not self.width:
            return False
        name = eqn.params["axis_name"]
        name = name[0] if isinstance(name, tuple) and len(name) == 1 else name
        return any(self.forks[e.primitive](**e.params)[0] == name
                   for e in _fork_markers(self.call.jaxpr.jaxpr))

    def compile(self, closed: Any, ins: list[_Operand]) -> list[_Operand]:
        """As the handshake runner compiles, with each region between fork markers run by the
        sub-points (see the module docstring)."""
        jaxpr, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "consts") \
            else (closed, ())
        eqns = list(jaxpr.eqns)
        begins = [i for i, e in enumerate(eqns)
                  if e.primitive in self.forks and self.forks[e.primitive](**e.params)[2]]
        if not begins:
            return super().compile(closed, ins)
        start = begins[0]
        end = next((i for i in range(start + 1, len(eqns))
                    if eqns[i].primitive in self.forks), None)
        if end is None or self.forks[eqns[end].primitive](**eqns[end].params)[2]:
            raise PallasError(f"kernel {self.call.name!r}: a sub-point region that does not "
                              "end in the jaxpr it begins in.")
        before, region, after = eqns[:start], eqns[start + 1:end], eqns[end + 1:]
        inside = {v for e in region for v in e.outvars if plb.is_var(v)}
        later = {v for e in after for v in e.invars if plb.is_var(v)} | \
            {v for v in jaxpr.outvars if plb.is_var(v)}
        if inside & later:
            raise UnsupportedError(f"kernel {self.call.name!r}: a value computed inside a "
                                   "pl.core_map over sub-points is used after it.")
        # Compile the three parts as one jaxpr each, in order.
        head_out = [v for v in {v for e in before for v in e.outvars if plb.is_var(v)}
                    if v in {u for e in region + after for u in e.invars if plb.is_var(u)}
                    or v in later]
        env: dict[Any, _Operand] = {v: _Uniform(c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, ins))

        def part(eqns_: list[Any], outs: list[Any]) -> list[_Operand]:
            free: list[Any] = []
            defined: set[Any] = set()
            for e in eqns_:
                for v in e.invars:
                    if plb.is_var(v) and v not in defined and v not in free:
                        free.append(v)
                defined.update(v for v in e.outvars if plb.is_var(v))
            free += [v for v in outs if v not in defined and v not in free]
            sub = plb.jaxpr_from_eqns(free, outs, eqns_)
            return self.compile(sub, [env[v] for v in free])

        env.update(zip(head_out, part(before, head_out)))
        self.region(eqns[start], part, region)
        tail = part(after, [v for v in jaxpr.outvars if plb.is_var(v)])
        it = iter(tail)
        return [_Uniform(v.val) if isinstance(v, plb.Literal) else next(it)
                for v in jaxpr.outvars]

    def region(self, marker: Any, part: Any, eqns: list[Any]) -> None:
        """The steps of a sub-point region: the point forks, its sub-points run ``eqns``, the
        point joins them."""
        axis, width, _ = self.forks[marker.primitive](**marker.params)
        if self.sub_axis is not None:
            raise UnsupportedError(f"kernel {self.call.name!r}: a sub-point region inside "
                                   "another one.")
        base = self.base
        start, join = _Label(), _Label()
        hand: list[_Val] = []  # the point's values the region reads
        counters: list[_Val] = []  # the wait counts (see below)

        def fork(state: State, p: Any) -> State:
            subs = base + p * width + jnp.arange(width, dtype=jnp.int32)
            vals = dict(state["vals"])
            for k in hand:
                vals[k.key] = vals[k.key].at[subs].set(vals[k.key][p])
            for k in counters:  # what the whole point waited for, every sub-point did
                mine, theirs = vals[k.key][p], vals[k.key][subs]
                vals[k.key] = vals[k.key].at[subs].set(
                    jnp.where(mine == DISAGREE, theirs, mine))
            pc = state["pc"].at[subs].set(start.at).at[p].set(join.at)
            return {**state, "vals": vals, "pc": pc}

        self.steps.append(fork)
        start.at = len(self.steps)
        self.sub_axis = axis
        n_vals = len(self.avals)
        try:
            part(eqns, [])
        finally:
            self.sub_axis = None
        # Values made before the region are handed over at the fork; wait counts are each
        # sub-point's own (each GPU thread tracks the phases it waited for): at the join the
        # point takes them where its sub-points agree, else DISAGREE, which a later wait of
        # the whole point never gets past (a hang on the hardware, reported as a deadlock).
        counters.extend(self.seen.values())
        hand.extend(_Val(k) for k in range(n_vals) if k not in self.seen_keys())
        finish = self.finish

        def park(state: State, q: Any) -> State:
            return _set_pc(state, q, finish.at)

        self.steps.append(park)
        join.at = len(self.steps)

        def wait(state: State, p: Any) -> State:
            subs = base + p * width + jnp.arange(width, dtype=jnp.int32)
            done = jnp.all(state["pc"][subs] >= finish.at)
            vals = dict(state["vals"])
            for k in counters:
                theirs = vals[k.key][subs]
                agreed = jnp.where(jnp.all(theirs == theirs[0], axis=0), theirs[0], DISAGREE)
                vals[k.key] = vals[k.key].at[p].set(jnp.where(done, agreed, vals[k.key][p]))
            return {**_set_pc({**state, "vals": vals}, p,
                              jnp.where(done, join.at + 1, join.at)),
                    "blocked": jnp.logical_not(done)}

        self.steps.append(wait)

    def seen_keys(self) -> set[int]:
        """The keys of the per-point wait counters (each sub-point keeps its own)."""
        return {v.key for v in self.seen.values()}

    def sub_index(self, eqn: Any) -> list[_Operand]:
        """``lax.axis_index`` of the region's axis: the sub-point's position."""
        base, width = self.base, self.width
        out = self.new_val(plb.ShapedArray((), jnp.int32))

        def step(state: State, q: Any) -> State:
            return _store(state, q, [out], [jnp.where(q >= base, (q - base) % width, 0)])

        self.emit(step)
        return [out]

    def schedule(self, slots: lockstep.Slots) -> lockstep.Slots:
        self.finish.at = len(self.steps)
        return super().schedule(slots)

    def structured(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        prim = eqn.primitive
        if self._sub_index(eqn):
            if self.sub_axis is None:
                raise UnsupportedError(f"kernel {self.call.name!r}: lax.axis_index of a "
                                       "sub-point axis outside its pl.core_map.")
            return self.sub_index(eqn)
        if prim in self.claims:
            return self.claim(eqn)
        if self._crosses(eqn):
            return self.cross(eqn, ins)
        if prim in self.forks:
            raise PallasError(f"kernel {self.call.name!r}: a sub-point region marker out of "
                              "place.")
        if prim in self.waits:
            return self.phase_wait(eqn, ins)
        if prim is plb.run_scoped_p:
            return self.scope(eqn, ins)
        if prim is plb.run_state_p:
            return self.run_state(eqn, ins)
        return super().structured(eqn, ins)

    def scope(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        """``pl.run_scoped``: one buffer for the whole group where it is collective along the
        group's axes, else one per point, fresh each time the point enters the scope (an
        accumulator starts at zero, a barrier with no arrivals and no waits)."""
        checks.check_scoped_allocation(self.call, self.params, eqn.params["scoped"])
        shared = self.axis_names - set(self.cluster) <= set(
            eqn.params.get("collective_axes", ()))
        new, fresh = [], []
        for t in eqn.params["scoped"]:
            slot = self.new_slot(shared)
            shape = tuple(t.shape) if shared else (self.members, *t.shape)
            if shared and self.cluster:  # one buffer per block
                shape = (self.blocks, *shape)
                self.per_block.add(slot)
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
        names = list(self.call.grid_mapping.grid_names or ())
        for n in getattr(aval.memory_space, "collective_axes", ()) or ():  # every block's
            if n in names:
                need *= self.grid[self.call.grid_mapping.num_batch_axes + names.index(n)]
        seen = self.seen.get(counter.id)
        if seen is None:
            seen = self.seen[counter.id] = self.new_val(plb.ShapedArray(aval.shape,
                                                                         jnp.int32))
        here = len(self.steps)
        test = bool(params.get("test", False))
        outs = [self.new_val(plb.ShapedArray((), jnp.bool_))] if test else []

        def wait(state: State, p: Any) -> State:
            flat = [self.value(o, state, p) for o in rest[:tree.num_leaves]]
            views = RefViews([self.value(counter, state, p), *flat], tree, roles)
            mine = views.with_values([self.value(seen, state, p)])
            waited = mine.read(0)
            ready = jnp.all((views.read(0) >= (waited + 1) * need) & (waited != DISAGREE))
            mine.write(0, jnp.where(ready, waited + 1, waited))
            state = _store(state, p, [seen, *outs], [mine.values[0], *([ready] if test else [])])
            if test:  # answers at once; a point told "not yet" lets the others run first
                return {**_set_pc(state, p, here + 1), "blocked": jnp.logical_not(ready)}
            return {**_set_pc(state, p, jnp.where(ready, here + 1, here)),
                    "blocked": jnp.logical_not(ready)}

        self.steps.append(wait)
        return list(outs)

    def cross(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        """An equation that reaches across the blocks of the cluster: its ``cross`` rule
        sees every block's buffer of the shared Refs it touches (``PrimitiveSemantics.
        cross``)."""
        rule = self.cross_rules[eqn.primitive][1]
        in_avals = [v.aval for v in eqn.invars]
        out_avals = [v.aval for v in eqn.outvars]
        slots = [o.id for o in ins if isinstance(o, _Slot)]
        if len(set(slots)) != len(slots):
            raise self.refuse(f"{eqn.primitive.name} given one Ref twice")
        stacked = tuple(isinstance(o, _Slot) and o.id in self.per_block for o in ins)
        marks: list[int | None] = []
        for o, s, aval in zip(ins, stacked, in_avals):
            if not (s and isinstance(o, _Slot)):
                marks.append(None)
                continue
            if o.id not in self.marks:
                self.marks[o.id] = self.new_slot(True)
                self.per_block.add(self.marks[o.id])
                self.scoped[self.marks[o.id]] = jnp.zeros((self.blocks, *aval.shape),
                                                          jnp.int32)
            marks.append(self.marks[o.id])
        outs = [self.new_val(a) for a in out_avals]

        def step(state: State, p: Any) -> State:
            args = [state["slots"][o.id] if isinstance(o, _Slot) and s
                    else self.value(o, state, p) for o, s in zip(ins, stacked)]
            given = [None if m is None else state["slots"][m] for m in marks]
            new, new_marks, results = rule(in_avals, out_avals, *args, stacked=stacked,
                                           marks=given, block=self.block_of(p),
                                           **eqn.params)
            buffers = dict(state["slots"])
            for o, s, x in zip(ins, stacked, new):
                if isinstance(o, _Slot) and x is not None:
                    buffers[o.id] = x if s else self.put_row(buffers[o.id], o.id, p, x)
            for m, x in zip(marks, new_marks):
                if m is not None and x is not None:
                    buffers[m] = x
            return _store({**state, "slots": buffers}, p, outs, results)

        self.emit(step)
        result: list[_Operand] = list(outs)
        return result

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


def run(call: Any, args: Sequence[Any], rules: plb.SemanticsRules, params: Any,
        axes: tuple[int, ...]) -> list[Any]:
    """The outputs of ``call`` on ``args``, the points along ``axes`` (see
    :func:`group_axes`) run each at its own pace."""
    return lockstep.run(call, args, rules, params, axes, runner_class=_Runner)
