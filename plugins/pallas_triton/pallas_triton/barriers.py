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
    reader = _Reader(func.operation, dict(same_array))
    for op in reader.dead_loads:
        op.erase()  # a load nothing uses (a store's old value): no access at all
    walk = _Walk()
    walk.nodes(reader.root, {}, insert=True)
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


_CONTROL = ("scf.if", "scf.for", "scf.while")


class _Reader:
    """The memory accesses, barriers, branches and loops of a function, as a Python tree.

    The function is read with ``Operation.walk`` (parents before their regions), which hands
    over plain operations. Going through ``Block.operations`` instead makes a Python view of
    every op, and for Triton's ops each costs a failed import of a dialect module (it tripled
    the lowering's time).
    """

    def __init__(self, func: Any, same_array: dict[int, int]) -> None:
        self.func = func
        self.root: list[Any] = []
        self.dead_loads: list[Any] = []
        self.regions: dict[Any, list[list[Any]]] = {}  # control-flow op -> its regions' lists
        entry = func.regions[0].blocks[0]
        self.arrays: dict[Any, frozenset[int]] = {
            arg: frozenset({same_array.get(i, i)}) for i, arg in enumerate(entry.arguments)}
        func.walk(self.visit, ir.WalkOrder.PRE_ORDER)

    def visit(self, op: Any) -> Any:
        name = op.name
        sources = _POINTER_FROM.get(name)
        if sources is not None:
            arrays: frozenset[int] = frozenset()
            for i in sources:
                arrays |= self.arrays.get(op.operands[i], frozenset({UNKNOWN}))
            self.arrays[op.results[0]] = arrays
            return ir.WalkResult.ADVANCE
        kind = _ACCESS.get(name)
        if kind is None and name != "gpu.barrier" and name not in _CONTROL:
            return ir.WalkResult.ADVANCE
        if kind == READ and not any(True for _ in op.results[0].uses):
            self.dead_loads.append(op)
            return ir.WalkResult.ADVANCE
        if kind is not None:
            node: Any = _Access(op, self.arrays.get(op.operands[0], frozenset({UNKNOWN})), kind)
        elif name == "gpu.barrier":
            node = _Barrier()
        else:
            lists: list[list[Any]] = [[] for _ in op.regions]
            self.regions[op] = lists
            node = (_If([b for b, r in zip(lists, op.regions) if len(r.blocks)])
                    if name == "scf.if" else _Loop(op, name == "scf.for", lists))
        self.container(op).append(node)
        return ir.WalkResult.ADVANCE

    def container(self, op: Any) -> list[Any]:
        """The list of the block ``op`` is in (walks run parents before their regions)."""
        parent = op.parent
        while parent != self.func and parent not in self.regions:
            op, parent = parent, parent.parent  # inside an op the tree does not model
        if parent == self.func:
            return self.root
        block = op.block
        for lst, region in zip(self.regions[parent], parent.regions):
            if len(region.blocks) and region.blocks[0] == block:
                return lst
        raise AssertionError(f"{op.name} is in no region of its parent {parent.name}")


class _Walk:
    def __init__(self) -> None:
        self.inserted = 0

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
