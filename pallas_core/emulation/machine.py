"""The emulator's machine: MLIR functions compiled once into Python steps over numpy values.

A backend's emulator gives a table of rules, one per operation name. A rule is called once per
operation, when its function is compiled, as ``rule(compiler, op)``, and returns the function that
computes the operation's results from its operands' values (numpy arrays; ``None`` for an
operation without results, a tuple for several). Attributes are read at compile time, so running
a function is a walk over a flat list of steps, each a call of numpy on whole vectors::

    def addi(compiler, op):
        return lambda a, b: a + b

Operations with regions get them from ``compiler.region(op.regions[i])``: a callable taking the
region's block arguments and returning the operands of its terminator (``scf.yield``,
``scf.condition``, ``func.return``, ...). Values defined outside a region are visible inside it,
as in MLIR.

``scf`` and ``func`` come with every machine (:data:`CONTROL_FLOW`); ``arith`` and ``math`` are
:data:`pallas_core.emulation.arith.RULES`. An operation no rule covers makes compilation fail
with an ``UnsupportedError`` naming it, before anything runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pallas_core.errors import UnsupportedError

Rule = Callable[["Compiler", ir.Operation], Callable[..., Any]]
"""``rule(compiler, op)`` -> the function from operand values to result value(s)."""

Step = Callable[[list[Any]], None]


class _Frame(threading.local):
    """The value slots of one running function (replaced on every call, restored on return),
    one set per thread: threads may run one compiled function at once (the devices of a
    ``shard_map`` call a kernel's glue together; emulated programs run in threads)."""

    def __init__(self) -> None:
        self.env: list[Any] = []


class Region:
    """A compiled single-block region: call it with the block's arguments."""

    def __init__(self, frame: _Frame, arg_slots: Sequence[int], steps: Sequence[Step],
                 result_slots: Sequence[int]) -> None:
        self._frame = frame
        self._args = tuple(arg_slots)
        self._steps = tuple(steps)
        self._results = tuple(result_slots)

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        env = self._frame.env
        for slot, value in zip(self._args, args, strict=True):
            env[slot] = value
        for step in self._steps:
            step(env)
        return tuple(env[s] for s in self._results)


class Function:
    """A compiled ``func.func`` (or any single-region callable op): call it with numpy values."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.frame = _Frame()
        self.num_slots = 0
        self.body: Region | None = None

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        assert self.body is not None
        saved = self.frame.env
        self.frame.env = [None] * self.num_slots
        try:
            return self.body(*args)
        finally:
            self.frame.env = saved


def is_terminator(op: ir.Operation) -> bool:
    """Whether ``op`` ends a block (its operands are the region's results)."""
    name = op.name
    return (name.endswith(".yield") or name.endswith(".return") or name == "scf.condition"
            or name.endswith(".terminator"))


class Compiler:
    """Compiles the functions of one module with a rule table."""

    def __init__(self, rules: Mapping[str, Rule], *, backend: str,
                 module: ir.Module | None = None) -> None:
        self.rules = dict(CONTROL_FLOW)
        self.rules.update(rules)
        self.backend = backend
        self.module = module
        self._functions: dict[str, Function] = {}
        self._current: list[tuple[Function, dict[ir.Value, int]]] = []

    # -- functions -------------------------------------------------------------------------

    def lookup(self, name: str) -> ir.Operation:
        """The operation named ``@name`` at the top of the module."""
        if self.module is None:
            raise UnsupportedError(f"the {self.backend} emulator cannot resolve @{name}: "
                                   "no module")
        for op in self.module.body.operations:
            if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value \
                    == name:
                return op.operation
        raise UnsupportedError(f"the {self.backend} emulator found no function @{name}")

    def function(self, op_or_name: ir.Operation | str) -> Function:
        """The compiled function (a ``func.func`` op, or the name of one in the module)."""
        op = self.lookup(op_or_name) if isinstance(op_or_name, str) else op_or_name
        op = op.operation
        name = ir.StringAttr(op.attributes["sym_name"]).value if "sym_name" in op.attributes \
            else str(id(op))
        if name in self._functions:
            return self._functions[name]
        fn = Function(name)
        self._functions[name] = fn
        self._current.append((fn, {}))
        try:
            fn.body = self.region(op.regions[0])
        finally:
            self._current.pop()
        return fn

    # -- regions and operations -----------------------------------------------------------

    def slot(self, value: ir.Value) -> int:
        """The slot holding ``value`` in the function being compiled (allocated on first use)."""
        fn, slots = self._current[-1]
        found = slots.get(value)
        if found is None:
            found = slots[value] = fn.num_slots
            fn.num_slots += 1
        return found

    def region(self, region: ir.Region) -> Region:
        """Compiles a single-block region of the current function."""
        blocks = list(region.blocks)
        if len(blocks) != 1:
            raise UnsupportedError(
                f"the {self.backend} emulator runs regions of one block; found {len(blocks)}")
        block = blocks[0]
        args = [self.slot(a) for a in block.arguments]
        steps: list[Step] = []
        results: list[int] = []
        for op in block.operations:
            op = op.operation
            if is_terminator(op):
                results = [self.slot(v) for v in op.operands]
                continue
            steps.append(self.step(op))
        fn, _ = self._current[-1]
        return Region(fn.frame, args, steps, results)

    def step(self, op: ir.Operation) -> Step:
        """The step computing ``op``'s results into their slots."""
        rule = self.rules.get(op.name)
        if rule is None:
            raise UnsupportedError(
                f"the {self.backend} emulator does not implement the operation `{op.name}` "
                f"(at {op.location}). Fix: add a rule for it to the backend's emulator, or "
                "run the kernel with backend='interpret'.")
        fn = rule(self, op)
        ins = tuple(self.slot(v) for v in op.operands)
        outs = tuple(self.slot(r) for r in op.results)
        return _make_step(fn, ins, outs, op)


def _make_step(fn: Callable[..., Any], ins: tuple[int, ...], outs: tuple[int, ...],
               op: ir.Operation) -> Step:
    if len(outs) == 1:
        (o,) = outs
        if len(ins) == 1:
            (a,) = ins

            def unary(env: list[Any]) -> None:
                env[o] = fn(env[a])
            return unary
        if len(ins) == 2:
            a, b = ins

            def binary(env: list[Any]) -> None:
                env[o] = fn(env[a], env[b])
            return binary

        def one(env: list[Any]) -> None:
            env[o] = fn(*[env[i] for i in ins])
        return one
    if not outs:
        def none(env: list[Any]) -> None:
            fn(*[env[i] for i in ins])
        return none

    def many(env: list[Any]) -> None:
        values = fn(*[env[i] for i in ins])
        if len(values) != len(outs):
            raise UnsupportedError(f"emulating {op.name} gave {len(values)} results, expected "
                                   f"{len(outs)}")
        for slot, v in zip(outs, values, strict=True):
            env[slot] = v
    return many


# -- scf and func ---------------------------------------------------------------------------

def _scf_for(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    body = c.region(op.regions[0])

    def run(lb: Any, ub: Any, step: Any, *carry: Any) -> Any:
        dtype = np.asarray(lb).dtype
        i = int(lb)
        stop, stride = int(ub), int(step)
        while i < stop:
            carry = body(np.asarray(i, dtype), *carry)
            i += stride
        return _results(op, carry)
    return run


def _scf_while(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    before = c.region(op.regions[0])
    after = c.region(op.regions[1])

    def run(*carry: Any) -> Any:
        while True:
            cond, *args = before(*carry)
            if not bool(cond):
                return _results(op, tuple(args))
            carry = after(*args)
    return run


def _scf_if(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    then = c.region(op.regions[0])
    other = c.region(op.regions[1]) if len(op.regions) > 1 and op.regions[1].blocks else None

    def run(cond: Any) -> Any:
        if bool(cond):
            return _results(op, then())
        return _results(op, other() if other is not None else ())
    return run


def _scf_index_switch(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    cases = [int(v) for v in ir.DenseI64ArrayAttr(op.attributes["cases"])]
    default = c.region(op.regions[0])
    branches = {k: c.region(r) for k, r in zip(cases, list(op.regions)[1:], strict=True)}

    def run(index: Any) -> Any:
        return _results(op, branches.get(int(index), default)())
    return run


def _scf_execute_region(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    body = c.region(op.regions[0])
    return lambda: _results(op, body())


def _func_call(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
    callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
    fn = c.function(callee)
    return lambda *args: _results(op, fn(*args))


def _results(op: ir.Operation, values: Sequence[Any]) -> Any:
    n = len(op.results)
    if n == 0:
        return None
    if n == 1:
        return values[0]
    return tuple(values)


CONTROL_FLOW: Mapping[str, Rule] = {
    "scf.for": _scf_for,
    "scf.while": _scf_while,
    "scf.if": _scf_if,
    "scf.index_switch": _scf_index_switch,
    "scf.execute_region": _scf_execute_region,
    "func.call": _func_call,
}
"""The structured control flow every machine runs."""
