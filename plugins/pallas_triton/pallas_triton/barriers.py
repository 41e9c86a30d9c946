"""Barriers between a program's accesses to one array, so that a Ref reads what was last written.

A Pallas kernel reads its Refs as memory read in program order: ``o_ref[...] = 0`` then
``o_ref[...] += x`` adds to zeros. A Triton program is many threads, and each global load or
store is spread over them in a layout that Triton picks per operation; a store and a later load
of the same elements can fall to different threads, and nothing orders global memory between
threads but a barrier. Triton's pipeliner also moves the ``pl.when`` store that starts one
step of a sequential loop to the end of the step before it. Without a barrier the load reads
what was there before the store: on an H100 the 3-D grid matmul that zeroes its output block at
``k == 0`` came back wrong in every element.

:func:`insert_barriers` walks the finished ``tt.func`` in program order and puts a
``gpu.barrier`` before an access that conflicts with one made since the last barrier: a load
after a store or atomic to the same array, a store after any access to it, an atomic after a
load or store. Loops are walked to a fixed point (an access at the top of an iteration follows
the accesses at the bottom of the previous one); both branches of an ``scf.if`` start from the
state before it and join. The array an access touches is the kernel argument its pointers are
computed from; arguments that alias (``input_output_aliases``) are one array, and a pointer whose
origin is not known conflicts with every array. Kernels that read their inputs and write their
outputs once get no barrier. Conditions and trip counts in Triton are scalars, the same for every
thread of a program, so a barrier inside a branch or loop is reached by all of them.

A loop that writes an array it also reads or writes elsewhere in its body (the sequential grid
steps of a matmul that accumulates in its output block) is marked ``tt.num_stages = 1``: Triton's
software pipeliner does not keep such a loop's memory order. Given the 3-D grid matmul, it moved
the ``pl.when(k == 0)`` store of zeros after the step's accumulating store, with the condition of
the step before, so the output block was zeroed after the first step and held only the last
step's product (seen on an H100, and in the TTGIR the ``triton`` package makes on CPU). Loops
that only read what they do not write (a flash attention's K and V) keep their pipelining.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import gpu

READ, WRITE, ATOMIC = "r", "w", "a"
_ACCESS = {"tt.load": READ, "tt.store": WRITE, "tt.atomic_rmw": ATOMIC,
           "tt.atomic_cas": ATOMIC}
_CONFLICTS = {READ: {WRITE, ATOMIC}, WRITE: {READ, WRITE, ATOMIC}, ATOMIC: {READ, WRITE}}
"""What each access conflicts with, among those made since the last barrier (atomics among
themselves are ordered by the hardware)."""
# Ops whose pointer result comes from these operands' pointers.
_POINTER_FROM = {"tt.addptr": (0,), "tt.splat": (0,), "tt.broadcast": (0,),
                 "tt.expand_dims": (0,), "tt.reshape": (0,), "tt.bitcast": (0,),
                 "tt.trans": (0,), "arith.select": (1, 2)}
UNKNOWN = -1
"""The array of a pointer whose origin the walk does not know: it conflicts with every array."""

State = dict[int, frozenset[str]]


def insert_barriers(func: Any, same_array: Mapping[int, int]) -> int:
    """Inserts the barriers into ``func`` (a ``tt.func``); returns how many.

    ``same_array`` maps a kernel argument's index to the index of the array it is (aliases); an
    argument not in it is its own array.
    """
    entry = func.regions[0].blocks[0]
    reader = _Reader(entry, dict(same_array))
    tree = reader.block(entry)  # MLIR is read once: each op visited costs Python binding calls
    for op in reader.dead_loads:
        op.erase()  # a load nothing uses (a store's old value): no access at all
    walk = _Walk()
    walk.nodes(tree, {}, insert=True)
    return walk.inserted


@dataclasses.dataclass
class _Access:
    op: Any
    arrays: frozenset[int]
    kind: str


@dataclasses.dataclass
class _If:
    branches: list[list[Any]]


@dataclasses.dataclass
class _Loop:
    op: Any
    is_for: bool
    blocks: list[list[Any]]


class _Barrier:
    pass


class _Reader:
    """The memory accesses, barriers, branches and loops of a function, as a Python tree."""

    def __init__(self, entry: ir.Block, same_array: dict[int, int]) -> None:
        self.entry = entry
        self.same_array = same_array
        self.dead_loads: list[Any] = []

    def block(self, block: ir.Block) -> list[Any]:
        out: list[Any] = []
        for op in block.operations:
            name = op.name
            if name == "gpu.barrier":
                out.append(_Barrier())
                continue
            kind = _ACCESS.get(name)
            if kind is not None:
                if kind == READ and not any(True for _ in op.result.uses):
                    self.dead_loads.append(op)
                else:
                    out.append(_Access(op, self.array_of(op.operands[0]), kind))
            elif name == "scf.if":
                out.append(_If([self.block(r.blocks[0]) for r in op.regions if len(r.blocks)]))
            elif name in ("scf.for", "scf.while"):
                out.append(_Loop(op, name == "scf.for",
                                 [self.block(r.blocks[0]) for r in op.regions if len(r.blocks)]))
        return out

    def array_of(self, value: ir.Value, depth: int = 0) -> frozenset[int]:
        """The arrays a pointer (or tensor of pointers) may point into."""
        if depth > 64:
            return frozenset({UNKNOWN})
        if isinstance(value.owner, ir.Block):
            arg = ir.BlockArgument(value)
            if value.owner == self.entry:
                return frozenset({self.same_array.get(arg.arg_number, arg.arg_number)})
            return frozenset({UNKNOWN})  # a loop-carried pointer
        op = value.owner
        sources = _POINTER_FROM.get(op.name)
        if sources is None:
            return frozenset({UNKNOWN})
        out: frozenset[int] = frozenset()
        for i in sources:
            out |= self.array_of(op.operands[i], depth + 1)
        return out


class _Walk:
    def __init__(self) -> None:
        self.inserted = 0
        self.unpipelined = 0

    def nodes(self, nodes: list[Any], state: State, *, insert: bool) -> State:
        for node in nodes:
            state = self.node(node, state, insert=insert)
        return state

    def node(self, node: Any, state: State, *, insert: bool) -> State:
        if isinstance(node, _Barrier):
            return {}
        if isinstance(node, _Access):
            if _conflicts(state, node.arrays, node.kind):
                if insert:
                    with ir.InsertionPoint(node.op), node.op.location:
                        gpu.BarrierOp()
                    self.inserted += 1
                state = {}
            state = dict(state)
            for a in node.arrays:
                state[a] = state.get(a, frozenset()) | {node.kind}
            return state
        if isinstance(node, _If):
            ends = [self.nodes(b, dict(state), insert=insert) for b in node.branches]
            if len(ends) < 2:
                ends.append(dict(state))  # no else: the state before it goes on
            return _join(*ends)
        return self.loop(node, state, insert=insert)

    def loop(self, loop: _Loop, state: State, *, insert: bool) -> State:
        """A loop's body runs after the state before it, or after its own last iteration."""
        entry = dict(state)
        while True:  # the state at the top of an iteration, to a fixed point (it only grows)
            exit_state = entry
            for b in loop.blocks:
                exit_state = self.nodes(b, exit_state, insert=False)
            grown = _join(entry, exit_state)
            if grown == entry:
                break
            entry = grown
        exit_state = entry
        for b in loop.blocks:
            exit_state = self.nodes(b, exit_state, insert=insert)
        if insert and loop.is_for and _carries_memory(loop.blocks):
            with loop.op.location:
                loop.op.attributes["tt.num_stages"] = ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(32), 1)
            self.unpipelined += 1
        # An scf.while leaves from its condition (the first region); an scf.for may run no
        # iteration: either way the state after it joins what came before with the body's end.
        return _join(entry, exit_state)


def _accesses(nodes: list[Any]) -> list[_Access]:
    """The memory accesses in ``nodes`` and in the branches and loops among them, in order."""
    out: list[_Access] = []
    for node in nodes:
        if isinstance(node, _Access):
            out.append(node)
        elif isinstance(node, _If):
            for b in node.branches:
                out += _accesses(b)
        elif isinstance(node, _Loop):
            for b in node.blocks:
                out += _accesses(b)
    return out


def _carries_memory(blocks: list[list[Any]]) -> bool:
    """Whether a loop writes an array that it also accesses elsewhere in its body."""
    found = [a for b in blocks for a in _accesses(b)]
    for i, one in enumerate(found):
        if one.kind == READ:
            continue
        for j, other in enumerate(found):
            if one.kind == other.kind == ATOMIC:
                continue  # atomics are ordered among themselves
            if j != i and (one.arrays & other.arrays or UNKNOWN in one.arrays | other.arrays):
                return True
    return False


def _conflicts(state: State, arrays: frozenset[int], kind: str) -> bool:
    bad = _CONFLICTS[kind]
    for a, kinds in state.items():
        if (a in arrays or a == UNKNOWN or UNKNOWN in arrays) and kinds & bad:
            return True
    return False


def _join(*states: State) -> State:
    out: State = {}
    for state in states:
        for k, v in state.items():
            out[k] = out.get(k, frozenset()) | v
    return out
