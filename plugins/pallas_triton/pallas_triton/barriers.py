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
    walk = _Walk(func.regions[0].blocks[0], dict(same_array))
    walk.block(func.regions[0].blocks[0], {}, insert=True)
    return walk.inserted


class _Walk:
    def __init__(self, entry: ir.Block, same_array: dict[int, int]) -> None:
        self.entry = entry
        self.same_array = same_array
        self.inserted = 0
        self.unpipelined = 0

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

    def block(self, block: ir.Block, state: State, *, insert: bool) -> State:
        for op in list(block.operations):
            state = self.op(op, state, insert=insert)
        return state

    def op(self, op: Any, state: State, *, insert: bool) -> State:
        name = op.name
        if name == "gpu.barrier":
            return {}
        kind = _ACCESS.get(name)
        if kind == READ and not any(True for _ in op.result.uses):
            if insert:
                op.erase()  # a load nothing uses (a store's old value): no access at all
            return state
        if kind is not None:
            arrays = self.array_of(op.operands[0])
            if self.conflicts(state, arrays, kind):
                if insert:
                    with ir.InsertionPoint(op), op.location:
                        gpu.BarrierOp()
                    self.inserted += 1
                state = {}
            state = dict(state)
            for a in arrays:
                state[a] = state.get(a, frozenset()) | {kind}
            return state
        if name == "scf.if":
            then = self.block(op.regions[0].blocks[0], dict(state), insert=insert)
            other = (self.block(op.regions[1].blocks[0], dict(state), insert=insert)
                     if len(op.regions[1].blocks) else dict(state))
            return _join(then, other)
        if name in ("scf.for", "scf.while"):
            return self.loop(op, state, insert=insert)
        return state  # no memory access (reductions' combiners, arithmetic)

    def loop(self, op: Any, state: State, *, insert: bool) -> State:
        """A loop's body runs after the state before it, or after its own last iteration."""
        blocks = [r.blocks[0] for r in op.regions if len(r.blocks)]
        entry = dict(state)
        while True:  # the state at the top of an iteration, to a fixed point (it only grows)
            exit_state = entry
            for b in blocks:
                exit_state = self.block(b, exit_state, insert=False)
            grown = _join(entry, exit_state)
            if grown == entry:
                break
            entry = grown
        exit_state = entry
        for b in blocks:
            exit_state = self.block(b, exit_state, insert=insert)
        if insert and op.name == "scf.for" and self.carries_memory(blocks):
            with op.location:
                op.attributes["tt.num_stages"] = ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(32), 1)
            self.unpipelined += 1
        # An scf.while leaves from its condition (the first region); an scf.for may run no
        # iteration: either way the state after it joins what came before with the body's end.
        return _join(entry, exit_state)

    def accesses(self, block: ir.Block) -> list[tuple[frozenset[int], str]]:
        """The memory accesses in ``block`` and the regions of its ops, in order."""
        out = []
        for op in block.operations:
            kind = _ACCESS.get(op.name)
            if kind is not None and not (kind == READ and not any(True for _ in op.result.uses)):
                out.append((self.array_of(op.operands[0]), kind))
            for region in op.regions:
                for b in region.blocks:
                    out += self.accesses(b)
        return out

    def carries_memory(self, blocks: list[ir.Block]) -> bool:
        """Whether a loop writes an array that it also accesses elsewhere in its body."""
        found = [a for b in blocks for a in self.accesses(b)]
        for i, (arrays, kind) in enumerate(found):
            if kind == READ:
                continue
            for j, (others, other_kind) in enumerate(found):
                if kind == other_kind == ATOMIC:
                    continue  # atomics are ordered among themselves
                if j != i and (arrays & others or UNKNOWN in arrays | others):
                    return True
        return False

    @staticmethod
    def conflicts(state: State, arrays: frozenset[int], kind: str) -> bool:
        bad = _CONFLICTS[kind]
        for a, kinds in state.items():
            if (a in arrays or a == UNKNOWN or UNKNOWN in arrays) and kinds & bad:
                return True
        return False


def _join(a: State, b: State) -> State:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, frozenset()) | v
    return out
