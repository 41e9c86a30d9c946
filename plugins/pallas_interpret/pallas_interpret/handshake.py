"""Runs a mesh kernel whose cores signal one another's semaphores, each core at its own pace.

``pl.semaphore_signal(sem, n, core_index=c)`` raises core ``c``'s copy of ``sem``. On the
hardware the cores of a mesh run at once, so a core may wait for a signal that another core
sends only later in its own program. Run one core after the other (as :mod:`pallas_interpret.grid`
runs grid steps) such a kernel would wait forever. Here each core has a program counter of its
own instead:

* The kernel is compiled into a list of *steps*: the straight-line code between semaphore
  operations (discharged, and evaluated for one core with the reference semantics), each
  ``semaphore_wait``, ``semaphore_signal`` and ``semaphore_read``, and the jumps that ``cond``,
  ``while_loop``, ``fori_loop`` and ``scan`` become when they hold one of those. ``pl.run_scoped``
  and ``jax.jit``-ed functions are inlined.
* A scheduler runs the cores in turn, each until it finishes or waits on a semaphore that is
  not high enough yet, and goes round again while any core moves. When no core can move and
  some have not finished, the kernel deadlocks on the hardware too, and that is reported.

Values that live from one step to a later one are held per core, one row each. Memory is held
as :mod:`pallas_interpret.lockstep` holds it: the kernel's operands and memory spaces marked
``shared`` once, every other buffer one row per core. Semaphores are zero when the kernel starts,
and allocating one (``pl.run_scoped``) does not clear it: a signal may reach a core before that
core enters the scope, and on the hardware it counts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_core import backend as plb
from pallas_core.backend import PallasError, UnsupportedError, copy_start_p, reported
from pallas_interpret import checks, lockstep
from pallas_interpret.lockstep import _Slot, _Uniform

_SEMAPHORE_OPS = (plb.semaphore_wait_p, plb.semaphore_signal_p, plb.semaphore_read_p)


def signals_cores(call: Any) -> bool:
    """Whether ``call`` runs on more than one mesh point and signals another core's
    semaphore, so that its cores must run each at its own pace."""
    gm = call.grid_mapping
    if not gm.grid_names or gm.dynamic_axes:
        return False
    points = 1
    for a in range(gm.num_batch_axes, len(gm.grid)):
        points *= gm.grid[a]
    return points > 1 and any(
        eqn.primitive is plb.semaphore_signal_p and eqn.params.get("has_core_index")
        for eqn in plb.all_eqns(call.jaxpr.jaxpr))


@dataclasses.dataclass(frozen=True)
class _Val:
    """A value held per core: row ``p`` of ``state["vals"][key]``."""
    key: int


_Operand = _Val | _Uniform | _Slot
State = dict[str, Any]
Step = Callable[[State, Any], State]


class _Label:
    """A position in the step list, known once the steps after it are compiled."""
    at: int = -1


class _Runner(lockstep._Runner):
    """Compiles a kernel jaxpr into steps, then runs the cores of one group through them."""

    sync_ops: tuple[Any, ...] = _SEMAPHORE_OPS
    """The primitives a core may stop at (the others run in straight-line steps)."""

    def holds(self, eqn: Any) -> bool:
        """Whether ``eqn`` is, or holds, one of :attr:`sync_ops`."""
        return eqn.primitive in self.sync_ops or any(
            plb.find_eqn(sub, self.sync_ops) is not None
            for sub in plb.sub_jaxprs(eqn.params))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[Step] = []
        self.avals: dict[int, Any] = {}
        self.scoped: dict[int, Any] = {}  # slots that pl.run_scoped allocates, and their start
        self.per_block: set[int] = set()  # shared slots held once per block (see block_of)

    # --- compiling

    def call_jaxpr(self, closed: Any, ins: Sequence[Any], slots: lockstep.Slots
                   ) -> tuple[list[Any], lockstep.Slots]:
        """Runs the whole kernel ``closed`` for every core of the group (the entry point that
        :func:`lockstep.run` calls)."""
        self.steps, self.avals, self.scoped = [], {}, {}
        outs = self.compile(closed, list(ins))
        if outs:
            raise UnsupportedError(f"kernel {self.call.name!r} returns values; a kernel "
                                   "writes its outputs into Refs.")
        return [], self.schedule(slots)

    def compile(self, closed: Any, ins: list[_Operand]) -> list[_Operand]:
        jaxpr, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "consts") else (closed, ())
        env: dict[Any, _Operand] = {v: _Uniform(c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, ins))
        live_from = lockstep.live_sets(jaxpr)
        segment: list[Any] = []
        for i, eqn in enumerate(jaxpr.eqns):
            if not self.holds(eqn):
                segment.append(eqn)
                continue
            self.segment(segment, env, live_from[i])
            segment = []
            with plb.user_context(eqn):
                ins_ = [_Uniform(v.val) if isinstance(v, plb.Literal) else env[v]
                        for v in eqn.invars]
                outs = self.structured(eqn, ins_)
            env.update((v, o) for v, o in zip(eqn.outvars, outs) if plb.is_var(v))
        self.segment(segment, env, live_from[-1])
        return [_Uniform(v.val) if isinstance(v, plb.Literal) else env[v]
                for v in jaxpr.outvars]

    def new_val(self, aval: Any) -> _Val:
        if isinstance(aval, plb.AbstractRef):
            raise UnsupportedError(
                f"kernel {self.call.name!r} carries a Ref across a semaphore operation whose "
                "core another core signals; the interpreter cannot hold it per core. Fix: "
                "close over the Ref, or allocate it with pl.run_scoped around that code.")
        key = len(self.avals)
        self.avals[key] = aval
        return _Val(key)

    def emit(self, step: Callable[[State, Any], State], jump: _Label | None = None) -> None:
        """Appends ``step``; after it the core goes on at ``jump`` (default: the next step)."""
        here = len(self.steps)

        def run(state: State, p: Any) -> State:
            state = step(state, p)
            target = here + 1 if jump is None else jump.at
            return _set_pc(state, p, target)

        self.steps.append(run)

    def segment(self, eqns: list[Any], env: dict[Any, _Operand], live: set[Any]) -> None:
        if not eqns:
            return
        defined: set[Any] = set()
        free: list[Any] = []
        for eqn in eqns:
            if eqn.primitive is copy_start_p and eqn.params.get("remote"):
                raise self.refuse("a remote copy (make_async_remote_copy)")
            for v in eqn.invars:
                if plb.is_var(v) and v not in defined and v not in free:
                    free.append(v)
            defined.update(v for v in eqn.outvars if plb.is_var(v))
        outs = [v for eqn in eqns for v in eqn.outvars if plb.is_var(v) and v in live]
        keys = [self.new_val(v.aval) for v in outs]
        run = self.evaluator(plb.jaxpr_from_eqns(free, outs, eqns), [env[v] for v in free])

        def step(state: State, p: Any) -> State:
            results, state = run(state, p)
            return _store(state, p, keys, results)

        self.emit(step)
        env.update(zip(outs, keys))

    def evaluator(self, closed: Any, operands: Sequence[_Operand]
                  ) -> Callable[[State, Any], tuple[list[Any], State]]:
        """A function running ``closed`` (no semaphore operations in it) on ``operands`` for
        core ``p``: its results, and the state with the Refs it wrote updated."""
        slots = [o.id for o in operands if isinstance(o, _Slot)]
        if len(set(slots)) != len(slots):
            raise UnsupportedError(
                f"kernel {self.call.name!r} passes one Ref twice into code between semaphore "
                "operations; the interpreter cannot tell the two apart. Fix: pass it once.")
        with self.discharge_context():
            discharged = plb.discharge_state(closed, axis_sizes=self.call.grid_mapping.axis_env)
        n_out = len(closed.jaxpr.outvars)

        def run(state: State, p: Any) -> tuple[list[Any], State]:
            args = [self.value(o, state, p) for o in operands]
            res = plb.eval_jaxpr_with_rules(discharged.jaxpr, discharged.consts, args,
                                       self.context(p), self.rules)
            new = dict(state["slots"])
            for slot, x in zip(slots, res[n_out:]):
                new[slot] = self.put_row(new[slot], slot, p, x)
            return list(res[:n_out]), {**state, "slots": new}

        return run

    def block_of(self, p: Any) -> Any:
        """The block (of those that hold a slot in :attr:`per_block` once each) where core
        ``p`` is; one block unless a subclass runs several."""
        return jnp.int32(0)

    def put_row(self, buf: Any, slot: int, p: Any, x: Any) -> Any:
        """``buf`` (slot ``slot``) with what core ``p`` sees of it replaced by ``x``."""
        if slot in self.per_block:
            return buf.at[self.block_of(p)].set(x)
        return x if self.shared[slot] else buf.at[p].set(x)

    def value(self, o: _Operand, state: State, p: Any) -> Any:
        if isinstance(o, _Val):
            return lockstep._row(state["vals"][o.key], p)
        if isinstance(o, _Slot):
            buf = state["slots"][o.id]
            if o.id in self.per_block:
                return lockstep._row(buf, self.block_of(p))
            return buf if self.shared[o.id] else lockstep._row(buf, p)
        return o.value

    def refuse(self, what: str) -> UnsupportedError:
        return UnsupportedError(
            f"{what} in kernel {self.call.name!r}, whose cores signal one another's semaphores "
            "(semaphore_signal(core_index=...)): the interpreter runs such a kernel one core at "
            "a time, each at its own pace, and cannot run this there. Fix: move it into a "
            "kernel of its own.")

    # --- equations that hold a semaphore operation

    def structured(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        prim = eqn.primitive
        if prim in _SEMAPHORE_OPS:
            return self.semaphore(eqn, ins)
        if prim is plb.run_scoped_p:
            checks.check_scoped_allocation(self.call, self.params, eqn.params["scoped"])
            new = []
            for t in eqn.params["scoped"]:
                slot, value = self.fresh_buffer(t.shape, t.dtype, t.memory_space)
                self.scoped[slot] = value
                new.append(_Slot(slot))
            return self.compile(eqn.params["jaxpr"], [*ins, *new])
        if prim in plb.CALL_BODIES:
            return self.compile(eqn.params[plb.CALL_BODIES[prim]], ins)
        if prim is plb.cond_p:
            return self.cond(eqn, ins)
        if prim is plb.while_p:
            return self.while_loop(eqn, ins)
        if prim is plb.scan_p:
            return self.scan(eqn, ins)
        raise self.refuse(f"a semaphore operation inside {prim.name!r}")

    def semaphore(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        prim, params = eqn.primitive, eqn.params
        sem, *rest = ins
        if not isinstance(sem, _Slot):
            raise self.refuse(f"{prim.name} on a Ref made inside the kernel")
        tree = params["tree"]
        n = tree.num_leaves
        slot = sem.id

        def view(state: State, p: Any, row_of: Any) -> tuple[Any, list[Any]]:
            flat = [self.value(o, state, p) for o in rest[:n]]
            return lockstep._row(state["slots"][slot], row_of), flat

        def put(state: State, row_of: Any, row: Any) -> State:
            slots = dict(state["slots"])
            slots[slot] = slots[slot].at[row_of].set(row)
            return {**state, "slots": slots}

        if prim is plb.semaphore_read_p:
            key = self.new_val(eqn.outvars[0].aval)

            def read(state: State, p: Any) -> State:
                row, flat = view(state, p, p)
                old, _ = plb.read_modify_write(row, flat, tree, lambda x: x)
                return _store(state, p, [key], [old])

            self.emit(read)
            return [key]
        if prim is plb.semaphore_signal_p:
            if params["has_device_id"]:
                raise self.refuse("semaphore_signal(device_id=...)")

            def signal(state: State, p: Any) -> State:
                inc = self.value(rest[n], state, p)
                target = (jnp.clip(self.value(rest[-1], state, p), 0, self.members - 1)
                          if params.get("has_core_index") else p)
                row, flat = view(state, p, target)
                _, new = plb.read_modify_write(row, flat, tree, lambda x: x + inc)
                return put(state, target, new)

            self.emit(signal)
            return []
        here = len(self.steps)  # a wait: the core stays here until the semaphore is high enough

        def wait(state: State, p: Any) -> State:
            value = self.value(rest[n], state, p)
            row, flat = view(state, p, p)
            old, new = plb.read_modify_write(
                row, flat, tree, (lambda x: x - value) if params["decrement"] else (lambda x: x))
            ready = old >= value
            state = put(state, p, jnp.where(ready, new, row))
            pc = jnp.where(ready, here + 1, here)
            return {**_set_pc(state, p, pc), "blocked": jnp.logical_not(ready)}

        self.steps.append(wait)
        return []

    def move(self, srcs: Sequence[_Operand], dsts: Sequence[_Val], jump: _Label | None = None
             ) -> None:
        def step(state: State, p: Any) -> State:
            return _store(state, p, dsts, [self.value(o, state, p) for o in srcs])

        self.emit(step, jump)

    def cond(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        index, *ops = ins
        branches = eqn.params["branches"]
        outs = [self.new_val(v.aval) for v in eqn.outvars]
        starts = [_Label() for _ in branches]
        join = _Label()

        def branch(state: State, p: Any) -> State:
            i = jnp.clip(self.value(index, state, p), 0, len(branches) - 1)
            target = jnp.asarray([s.at for s in starts], jnp.int32)[i]
            return _set_pc(state, p, target)

        self.steps.append(branch)
        for start, b in zip(starts, branches):
            start.at = len(self.steps)
            self.move(self.compile(b, ops), outs, join)
        join.at = len(self.steps)
        return list(outs)

    def loop_test(self, closed: Any, operands: Sequence[_Operand], body: _Label, exit: _Label,
                  test: Callable[[list[Any], State, Any], Any] | None = None) -> None:
        """A step that goes on at ``body`` if ``closed`` (run on ``operands``) returns True,
        else at ``exit``."""
        if plb.find_eqn(closed.jaxpr, self.sync_ops) is not None:
            raise self.refuse("a semaphore operation in the condition of a while_loop")
        run = self.evaluator(closed, operands)

        def step(state: State, p: Any) -> State:
            (go,), state = run(state, p)
            return _set_pc(state, p, jnp.where(go, body.at, exit.at))

        self.steps.append(step)

    def while_loop(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        carry = [self.new_val(v.aval) for v in eqn.outvars]
        self.move(init, carry)
        header, body, exit = _Label(), _Label(), _Label()
        header.at = len(self.steps)
        self.loop_test(p["cond_jaxpr"], [*cconsts, *carry], body, exit)
        body.at = len(self.steps)
        self.move(self.compile(p["body_jaxpr"], [*bconsts, *carry]), carry, header)
        exit.at = len(self.steps)
        return list(carry)

    def scan(self, eqn: Any, ins: list[_Operand]) -> list[_Operand]:
        p = eqn.params
        consts, init, xs, split_out = plb.scan_parts(p, ins)
        length, reverse = p["length"], p["reverse"]
        counter = self.new_val(plb.ShapedArray((), jnp.int32))
        carry = [self.new_val(v.aval) for v in eqn.outvars[:len(init)]]
        ys = [self.new_val(v.aval) for v in eqn.outvars[len(init):]]
        xs_avals = [v.aval for v in eqn.invars[len(eqn.invars) - len(xs):]]
        x_now = [self.new_val(plb.ShapedArray(a.shape[1:], a.dtype)) for a in xs_avals]
        self.move([_Uniform(jnp.int32(0)), *init], [counter, *carry])
        header, body, exit = _Label(), _Label(), _Label()
        header.at = len(self.steps)

        def test(state: State, q: Any) -> State:
            go = self.value(counter, state, q) < length
            return _set_pc(state, q, jnp.where(go, body.at, exit.at))

        def index(state: State, q: Any) -> Any:
            i = self.value(counter, state, q)
            return length - 1 - i if reverse else i

        def take(state: State, q: Any) -> State:
            i = index(state, q)
            return _store(state, q, x_now, [
                lax.dynamic_index_in_dim(jnp.asarray(self.value(x, state, q)), i, 0,
                                         keepdims=False) for x in xs])

        self.steps.append(test)
        body.at = len(self.steps)
        self.emit(take)
        new_carry, new_ys = split_out(self.compile(p["jaxpr"], [*consts, *carry, *x_now]))

        def advance(state: State, q: Any) -> State:
            i = index(state, q)
            values = [self.value(o, state, q) for o in new_carry]
            stacked = [lax.dynamic_update_index_in_dim(self.value(y, state, q),
                                                       self.value(o, state, q), i, 0)
                       for y, o in zip(ys, new_ys)]
            return _store(state, q, [counter, *carry, *ys],
                          [self.value(counter, state, q) + 1, *values, *stacked])

        self.emit(advance, header)
        exit.at = len(self.steps)
        return [*carry, *ys]

    # --- running

    def schedule(self, slots: lockstep.Slots) -> lockstep.Slots:
        """Runs every core of the group through the steps; the memory afterwards."""
        end = len(self.steps)
        steps = self.steps
        state: State = {
            "pc": jnp.zeros((self.members,), jnp.int32),
            "vals": {k: jnp.zeros((self.members, *a.shape), a.dtype)
                     for k, a in self.avals.items()},
            "slots": {**slots, **self.scoped},
            "blocked": jnp.bool_(False),
            "moves": jnp.int32(0),
        }
        order = self.order()

        def advance(state: State, p: Any) -> State:
            """Runs core ``p`` until it finishes or waits."""
            def more(s: State) -> Any:
                return (s["pc"][p] < end) & jnp.logical_not(s["blocked"])

            def one(s: State) -> State:
                s = lax.switch(jnp.minimum(s["pc"][p], end - 1), steps, s, p)
                return {**s, "moves": s["moves"] + jnp.where(s["blocked"], 0, 1)}

            return lax.while_loop(more, one, {**state, "blocked": jnp.bool_(False)})

        def round_(carry: tuple[State, Any]) -> tuple[State, Any]:
            state, _ = carry
            before = state["moves"]

            def each(k: Any, s: State) -> State:
                return advance(s, k if order is None else order[k])

            state = lax.fori_loop(0, self.members, each, state)
            return state, state["moves"] > before

        def again(carry: tuple[State, Any]) -> Any:
            state, moved = carry
            return moved & jnp.any(state["pc"] < end)

        if end:
            state, _ = lax.while_loop(again, round_, (state, jnp.bool_(True)))
        jax.debug.callback(functools.partial(_report_stuck, kernel=self.call.name, end=end),
                           state["pc"])
        return {k: v for k, v in state["slots"].items() if k not in self.scoped}


def _set_pc(state: State, p: Any, target: Any) -> State:
    return {**state, "pc": state["pc"].at[p].set(jnp.asarray(target, jnp.int32))}


def _store(state: State, p: Any, keys: Sequence[_Val], values: Sequence[Any]) -> State:
    vals = dict(state["vals"])
    for k, x in zip(keys, values):
        vals[k.key] = vals[k.key].at[p].set(jnp.asarray(x, vals[k.key].dtype))
    return {**state, "vals": vals}


@reported
def _report_stuck(pc: Any, *, kernel: str, end: int) -> None:
    waiting = [int(i) for i in range(len(pc)) if int(pc[i]) < end]
    if waiting:
        raise PallasError(
            f"deadlock: in kernel {kernel!r}, core(s) {waiting} wait on semaphores that no core "
            "still running will signal (the interpreter ran every core as far as it could); on "
            "the hardware the kernel hangs. Fix: make every semaphore_wait match the signals "
            "other cores send (semaphore_signal(core_index=...)) and the copies they start.")


def run(call: Any, args: Sequence[Any], rules: plb.SemanticsRules, params: Any) -> list[Any]:
    """The outputs of ``call`` on ``args``, its cores run each at its own pace (see
    :func:`signals_cores`)."""
    if lockstep.barrier_axes(call) is not None:
        raise UnsupportedError(
            f"kernel {call.name!r} has barriers and signals other cores' semaphores; the "
            "interpreter runs one of the two in a kernel. Fix: synchronise with one of them.")
    gm = call.grid_mapping
    axes = tuple(range(gm.num_batch_axes, len(gm.grid)))
    return lockstep.run(call, args, rules, params, axes, runner_class=_Runner)
