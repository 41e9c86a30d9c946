"""The fast path: grid axes along which no output block is revisited run batched.

``plan`` proves, from the index maps evaluated on every grid point, which grid axes are
*parallel*: every output has a dimension whose block index is that grid index, so two steps
that differ along the axis never touch the same output block. Those axes run as one batched
(vmapped) evaluation; the remaining *sequential* axes (a matmul's K axis, say) loop in their
lexicographic order. The result is the same as stepping through the grid one point at a time.

Whenever safety cannot be proven, ``plan`` returns ``None`` and the exact path runs instead:
scratch buffers (they carry state from one step to the next), aliased outputs, writes to input
blocks, atomics, prints and other side effects, primitives a plugin added (their semantics may
have effects), index maps that are not a grid index or a constant in every dimension (or that
read scalar-prefetch operands), element-indexed block dimensions (``pl.Element``,
``pl.BoundedSlice``), dynamic grids, and grids too large to check. Kernels whose loops run a
number of times that depends on the grid position (causal attention) also step through the
grid: batched, every lane would run the longest lane's loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import backend as plb
from pallas_core.backend import BlockMapping, KernelCall, ReferenceContext, uninitialized

# Primitives with reference semantics that are pure functions of the block values and the grid
# position; any other primitive with registered semantics sends the kernel down the exact path.
_BATCHABLE = frozenset({plb.program_id_p, plb.axis_index_p, plb.multiple_of_p,
                        plb.masked_load_p, plb.masked_swap_p, plb.run_scoped_p})


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to run one call batched.

    ``dims[k][d]`` says what the block index of operand ``k`` along dimension ``d`` is: a grid
    axis (``("axis", a)``) or a constant (``("const", c)``).
    """

    parallel: tuple[int, ...]
    sequential: tuple[int, ...]
    dims: tuple[tuple[tuple[str, int], ...], ...]


def plan(call: KernelCall) -> Plan | None:
    """The batched plan for ``call``, or ``None`` when only the exact path is safe."""
    gm = call.grid_mapping
    if gm.dynamic_axes or not all(bm.block_indexed for bm in gm.block_mappings):
        return None  # steps unknown ahead of time, or blocks not laid out on a block grid
    if gm.num_steps <= 1 or gm.scratch_avals or call.input_output_aliases:
        return None
    if not _batchable_kernel(call) or _loops_follow_the_grid(call.jaxpr.jaxpr):
        return None
    tables = plb.block_index_tables(gm)
    if tables is None:
        return None
    points, per_operand = tables
    dims = []
    for table in per_operand:
        operand_dims = _classify(table, points)
        if operand_dims is None:
            return None
        dims.append(operand_dims)
    outputs = dims[gm.num_inputs:]
    parallel = tuple(a for a in range(len(gm.grid))
                     if all(("axis", a) in out for out in outputs))
    sequential = tuple(a for a in range(len(gm.grid)) if a not in parallel)
    for operand_dims in dims:
        used = [v for kind, v in operand_dims if kind == "axis" and v in parallel]
        if len(used) != len(set(used)):
            return None  # two dimensions follow the same parallel axis (a diagonal)
    return Plan(parallel, sequential, tuple(dims))


def _batchable_kernel(call: KernelCall) -> bool:
    closed = call.jaxpr
    if any(not (plb.is_ref_effect(e) or e is plb.internal_mutable_array_effect)
           for e in closed.jaxpr.effects):
        return False  # prints, callbacks: their order would change
    unsafe = plb.registered_primitives() - _BATCHABLE
    if plb.find_eqn(closed.jaxpr, unsafe) is not None:
        return False
    # A write to an input block stays visible to the next step that reads the same block.
    written = plb.written_invars(closed.jaxpr)
    return not any(v in written for v in closed.jaxpr.invars[:call.grid_mapping.num_inputs])


def _loops_follow_the_grid(jaxpr: Any) -> bool:
    """Whether a ``while`` loop's trip count may depend on the grid position (causal
    attention's inner loop, say). Batched, every lane would run the longest lane's trip count
    with the others masked off: about twice the work of stepping through the grid for a
    triangular mask, more than the batching saves. Found by a taint analysis from
    ``program_id`` and ``axis_index`` (see :func:`_taint`)."""
    try:
        _taint(jaxpr, set())
    except _FollowsGridError:
        return True
    return False


class _FollowsGridError(Exception):
    pass


def _taint(jaxpr: Any, tainted: set[Any]) -> list[bool]:
    """Which outputs of ``jaxpr`` may depend on the grid position, given its ``tainted``
    invars; raises ``_FollowsGridError`` at a loop whose trip count may. An equation reading a
    tainted value taints its results and the Refs it was given (it may write the value into
    them); an equation holding a jaxpr taints it all when any input is tainted, except loops,
    whose carries are followed to a fixed point."""
    def marked(atoms: Sequence[Any]) -> list[bool]:
        return [plb.is_var(v) and v in tainted for v in atoms]

    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if plb.is_var(v)]
        if eqn.primitive is plb.while_p:
            outs = _while_taint(eqn, marked(eqn.invars))
        else:
            hit = (eqn.primitive in (plb.program_id_p, plb.axis_index_p)
                   or any(marked(ins)))
            for sub in plb.sub_jaxprs(eqn.params):
                inner = getattr(sub, "jaxpr", sub)
                _taint(inner, set(inner.invars) if hit else set())
            outs = [hit] * len(eqn.outvars)
            if hit:
                tainted.update(v for v in ins if isinstance(v.aval, plb.AbstractRef))
        tainted.update(v for v, t in zip(eqn.outvars, outs) if t and plb.is_var(v))
    return marked(jaxpr.outvars)


def _while_taint(eqn: Any, ins: list[bool]) -> list[bool]:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    carry = ins[nc + nb:]
    while True:
        new = _taint(body, {v for v, t in zip(body.invars, [*ins[nc:nc + nb], *carry]) if t})
        merged = [a or b for a, b in zip(carry, new)]
        if merged == carry:
            break
        carry = merged
    if any(_taint(cond, {v for v, t in zip(cond.invars, [*ins[:nc], *carry]) if t})):
        raise _FollowsGridError
    return carry


def _classify(table: np.ndarray, points: np.ndarray) -> tuple[tuple[str, int], ...] | None:
    out: list[tuple[str, int]] = []
    for d in range(table.shape[1]):
        col = table[:, d]
        if (col == col[0]).all():
            out.append(("const", int(col[0])))
            continue
        axis = next((a for a in range(points.shape[1]) if (col == points[:, a]).all()), None)
        if axis is None:
            return None
        out.append(("axis", axis))
    return tuple(out)


# --- execution -------------------------------------------------------------------------------


def _counts(bm: BlockMapping) -> tuple[int, ...]:
    return tuple(-(-d // b) for d, b in zip(bm.array_shape, bm.full_block_shape))


def _to_blocked(x: Any, bm: BlockMapping) -> Any:
    """``x`` padded to whole blocks and reshaped to ``(n_0, b_0, n_1, b_1, ...)``: block counts
    interleaved with block sizes (a reshape, no data movement)."""
    counts, block = _counts(bm), bm.full_block_shape
    padded = tuple(n * b for n, b in zip(counts, block))
    if tuple(x.shape) != padded:
        pads = [(0, p - d, 0) for d, p in zip(x.shape, padded)]
        x = lax.pad(x, uninitialized((), x.dtype), pads)
    return x.reshape(tuple(v for nb in zip(counts, block) for v in nb))


def _from_blocked(xb: Any, bm: BlockMapping) -> Any:
    x = xb.reshape(tuple(n * b for n, b in zip(_counts(bm), bm.full_block_shape)))
    if tuple(x.shape) != bm.array_shape:
        x = lax.slice(x, (0,) * x.ndim, bm.array_shape)
    return x


class _Operand:
    """Reads and writes one operand's blocks for all parallel lanes of one sequential step.

    A view keeps, for each dimension that follows a parallel axis, its block-count axis next to
    its block axis (``(n_d, b_d)``); other dimensions are indexed down to their block
    (``(b_d)``). ``vmap`` then maps the count axes where they lie, so no data is transposed.
    """

    def __init__(self, bm: BlockMapping, dims: Sequence[tuple[str, int]], p: Plan,
                 grid: Sequence[int]) -> None:
        self.bm = bm
        self.dims = dims
        self.grid = grid  # a parallel dimension's view spans grid[axis] blocks, not all blocks
        self.seq_pos = {a: i for i, a in enumerate(p.sequential)}
        # Level (position in p.parallel) of each dimension that follows a parallel axis.
        self.level_of_dim = {d: p.parallel.index(v) for d, (kind, v) in enumerate(dims)
                             if kind == "axis" and v in p.parallel}
        view_pos, pos = {}, 0
        for d in range(len(dims)):
            if d in self.level_of_dim:
                view_pos[self.level_of_dim[d]] = pos
                pos += 1
            pos += 1
        self.axes = [self._axis_at(level, view_pos) for level in range(len(p.parallel))]

    @staticmethod
    def _axis_at(level: int, view_pos: dict[int, int]) -> int | None:
        """Where the count axis of ``level`` is once the outer levels have been mapped away."""
        if level not in view_pos:
            return None
        return view_pos[level] - sum(1 for lv, ps in view_pos.items()
                                     if lv < level and ps < view_pos[level])

    def _starts_sizes(self, s_ids: Sequence[Any]) -> tuple[list[Any], list[int]]:
        block = self.bm.full_block_shape
        starts: list[Any] = []
        sizes: list[int] = []
        for d, (kind, v) in enumerate(self.dims):
            if d in self.level_of_dim:
                starts += [0, 0]
                sizes += [self.grid[v], block[d]]
            else:
                starts += [v if kind == "const" else s_ids[self.seq_pos[v]], 0]
                sizes += [1, block[d]]
        return starts, sizes

    def _view_shape(self) -> list[int]:
        block = self.bm.full_block_shape
        shape: list[int] = []
        for d, (_, v) in enumerate(self.dims):
            shape += [self.grid[v], block[d]] if d in self.level_of_dim else [block[d]]
        return shape

    def read(self, xb: Any, s_ids: Sequence[Any]) -> Any:
        starts, sizes = self._starts_sizes(s_ids)
        return lax.dynamic_slice(xb, starts, sizes).reshape(self._view_shape())

    def write(self, xb: Any, s_ids: Sequence[Any], view: Any) -> Any:
        starts, sizes = self._starts_sizes(s_ids)
        return lax.dynamic_update_slice(xb, view.reshape(sizes), starts)


def run(call: KernelCall, args: Sequence[Any], p: Plan,
        rules: plb.SemanticsRules) -> list[Any]:
    """The outputs of ``call`` on ``args``, parallel axes batched, sequential axes looped."""
    gm = call.grid_mapping
    kernel = plb.discharge_state(call.jaxpr, axis_sizes=gm.axis_env)
    ops = [_Operand(bm, dims, p, gm.grid) for bm, dims in zip(gm.block_mappings, p.dims)]
    ins = [_to_blocked(x, bm) for x, bm in zip(args, gm.inputs)]
    outs = [_to_blocked(uninitialized(bm.array_shape, bm.dtype), bm) for bm in gm.outputs]
    n_in, n_out, n_par = gm.num_inputs, gm.num_outputs, len(p.parallel)

    def lane(*ids_and_blocks: Any) -> list[Any]:
        ids: list[Any] = [None] * len(gm.grid)
        for a, v in zip((*p.parallel, *p.sequential), ids_and_blocks):
            ids[a] = v
        blocks = [b.reshape(bm.ref_shape) for b, bm in
                  zip(ids_and_blocks[len(gm.grid):], gm.block_mappings)]
        ctx = ReferenceContext(tuple(ids), gm.grid, gm.num_batch_axes, gm.grid_names)
        results = plb.evaluate(kernel, blocks, ctx, rules)[n_in:n_in + n_out]
        return [r.reshape(bm.full_block_shape) for r, bm in zip(results, gm.outputs)]

    batched = lane
    for level in reversed(range(n_par)):
        in_axes = ([0 if j == level else None for j in range(n_par)]
                   + [None] * len(p.sequential) + [op.axes[level] for op in ops])
        out_axes = [op.axes[level] for op in ops[n_in:]]
        batched = jax.vmap(batched, in_axes=in_axes, out_axes=out_axes)
    lane_ids = [jnp.arange(gm.grid[a], dtype=jnp.int32) for a in p.parallel]

    def step(s_ids: Sequence[Any], outs: list[Any]) -> list[Any]:
        blocks = [op.read(x, s_ids) for op, x in zip(ops, [*ins, *outs])]
        results = batched(*lane_ids, *s_ids, *blocks)
        return [op.write(o, s_ids, r) for op, o, r in zip(ops[n_in:], outs, results)]

    if not p.sequential:
        outs = step([], outs)
    else:
        seq_sizes = [gm.grid[a] for a in p.sequential]

        def body(k: Any, outs: list[Any]) -> list[Any]:
            s_ids, rest = [], k
            for size in reversed(seq_sizes):
                s_ids.append(rest % size)
                rest = rest // size
            return step(list(reversed(s_ids)), outs)

        outs = lax.fori_loop(0, math.prod(seq_sizes), body, outs)
    return [_from_blocked(o, bm) for o, bm in zip(outs, gm.outputs)]
