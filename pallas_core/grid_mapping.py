"""Normalisation of grids and BlockSpecs into a ``GridMapping``, checked against the operands.

A ``GridMapping`` is what every backend receives: the grid, and per operand its array shape,
block shape, index map (as a closed jaxpr of the grid indices) and memory space.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import _jax
from pallas_core.errors import BlockSpecError, OutOfBoundsError
from pallas_core.spec import ANY, BlockSpec, MemorySpace, Squeezed, no_block_spec

# Index maps are checked on every grid point ahead of time up to this many points.
MAX_STATIC_CHECK_POINTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class BlockMapping:
    """How one operand is blocked: ``index_map(*grid_indices)`` gives its block indices."""

    origin: str
    """The operand, for messages: e.g. ``"input 0 (x_ref)"`` or ``"output 1"``."""
    array_shape: tuple[int, ...]
    dtype: np.dtype
    block_shape: tuple[int | None, ...]
    """Per array dimension the block size; ``None`` marks a squeezed dimension (size 1)."""
    index_map: Any
    """Closed jaxpr: ``len(grid)`` int32 scalars (then one Ref per scalar-prefetch operand)
    -> one int32 block index per dimension."""
    memory_space: MemorySpace | None = None
    num_prefetch: int = 0
    """How many scalar-prefetch Refs the index map takes after the grid indices."""
    pipeline_mode: Any = None
    """The BlockSpec's ``pl.Buffered`` (``None``: the backend's default buffering)."""

    @property
    def ref_shape(self) -> tuple[int, ...]:
        """The shape of the Ref the kernel sees (squeezed dimensions dropped)."""
        return tuple(b for b in self.block_shape if b is not None)

    @property
    def full_block_shape(self) -> tuple[int, ...]:
        """The block shape with squeezed dimensions as 1."""
        return tuple(1 if b is None else b for b in self.block_shape)

    @property
    def is_whole_array(self) -> bool:
        """The kernel sees the whole array (memory space ``ANY``, no blocking)."""
        return self.memory_space is ANY

    def block_indices(self, *args: Any) -> list[Any]:
        """Evaluates the index map on grid indices (then scalar-prefetch Refs or arrays)."""
        prefetch = args[len(args) - self.num_prefetch:] if self.num_prefetch else ()
        if prefetch and not isinstance(_jax.typeof(prefetch[0]), _jax.AbstractRef):
            pure = _discharged_index_map(self.index_map)
            return _jax.eval_jaxpr(pure.jaxpr, pure.consts, *args)[:len(self.array_shape)]
        return _jax.eval_jaxpr(self.index_map.jaxpr, self.index_map.consts, *args)


@functools.lru_cache(maxsize=256)
def _discharged_index_map(index_map: Any) -> Any:
    return _jax.discharge_state(index_map)


@dataclasses.dataclass(frozen=True)
class GridMapping:
    """The grid and the blocking of every operand of one ``pallas_call``."""

    grid: tuple[int, ...]
    """The full grid, leading batch axes (added by ``vmap``) included."""
    block_mappings: tuple[BlockMapping, ...]
    """Inputs first, then outputs."""
    num_inputs: int
    num_outputs: int
    scratch_avals: tuple[Any, ...] = ()
    num_batch_axes: int = 0
    """Leading grid axes added by ``vmap``; ``program_id(i)`` in the kernel is axis
    ``i + num_batch_axes`` of ``grid``."""
    grid_names: tuple[str, ...] | None = None
    """Mesh axis names of the user grid when launched through ``pl.kernel``."""
    num_scalar_prefetch: int = 0
    """The first inputs are scalar-prefetch operands: passed whole to the kernel and to every
    index map, so index maps depend on data (no ahead-of-time evaluation)."""

    @property
    def user_grid(self) -> tuple[int, ...]:
        """The grid the kernel was written for (without batch axes)."""
        return self.grid[self.num_batch_axes:]

    @property
    def axis_env(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of each named mesh axis (for ``lax.axis_index``); else empty."""
        return tuple(zip(self.grid_names, self.user_grid)) if self.grid_names else ()

    @property
    def inputs(self) -> tuple[BlockMapping, ...]:
        return self.block_mappings[: self.num_inputs]

    @property
    def outputs(self) -> tuple[BlockMapping, ...]:
        return self.block_mappings[self.num_inputs:]

    @property
    def num_steps(self) -> int:
        return int(np.prod(self.grid, dtype=np.int64))


def _normalize_block_shape(spec: BlockSpec, shape: tuple[int, ...], origin: str,
                           kernel_name: str) -> tuple[int | None, ...]:
    if spec.block_shape is None:
        return tuple(shape)
    block = spec.block_shape
    if len(block) != len(shape):
        raise BlockSpecError(
            f"In kernel {kernel_name!r}, {origin} has shape {shape} (rank {len(shape)}) but its "
            f"BlockSpec has block_shape {tuple(block)} (rank {len(block)}). Fix: give one block "
            "size per array dimension, using None (or pl.squeezed) for dimensions to drop."
        )
    out: list[int | None] = []
    for b in block:
        if b is None or isinstance(b, Squeezed):
            out.append(None)
        elif isinstance(b, (int, np.integer)) and b > 0:
            out.append(int(b))
        else:
            raise BlockSpecError(
                f"In kernel {kernel_name!r}, {origin}: block sizes must be positive ints or None, "
                f"found {b!r} in block_shape {tuple(block)}."
            )
    return tuple(out)


def _trace_index_map(spec: BlockSpec, grid: tuple[int, ...], shape: tuple[int, ...],
                     origin: str, kernel_name: str, prefetch_avals: Sequence[Any] = ()) -> Any:
    ndim = len(shape)
    fn = spec.index_map
    if fn is None:
        def fn(*_: Any) -> tuple[int, ...]:
            return (0,) * ndim
    avals = [_jax.ShapedArray((), jnp.int32)] * len(grid) + list(prefetch_avals)

    pf_args = f" and {len(prefetch_avals)} scalar-prefetch Refs" if prefetch_avals else ""
    pf_fix = ", then one per scalar-prefetch operand" if prefetch_avals else ""

    def flat(*idx: Any) -> list[Any]:
        try:
            out = fn(*idx)
        except TypeError as e:
            if "positional argument" in str(e):
                raise BlockSpecError(
                    f"In kernel {kernel_name!r}, the index map of {origin} could not be called "
                    f"with the {len(grid)} grid indices of grid {grid}{pf_args}: {e}. Fix: the "
                    f"index map takes one argument per grid axis ({len(grid)}){pf_fix}."
                ) from e
            raise
        out = out if isinstance(out, (tuple, list)) else (out,)
        for o in out:
            dtype = getattr(o, "dtype", None)
            if o is None or isinstance(o, float) or jnp.ndim(o) != 0 or (
                    dtype is not None and not jnp.issubdtype(dtype, jnp.integer)):
                raise BlockSpecError(
                    f"In kernel {kernel_name!r}, the index map of {origin} returned {o!r}; "
                    "expected one integer scalar per array dimension (a block index). Fix: "
                    "return ints or int32 scalars, e.g. lambda i, j: (i, j).")
        if len(out) != ndim:
            raise BlockSpecError(
                f"In kernel {kernel_name!r}, the index map of {origin} returned {len(out)} "
                f"block indices but the array has rank {ndim} (shape {shape}). Fix: return "
                f"a tuple of {ndim} block indices, one per array dimension (0 for dimensions "
                "that are not blocked)."
            )
        return [jnp.asarray(o, jnp.int32) for o in out]

    jaxpr, _, consts = _jax.trace_to_jaxpr(flat, avals, name="index_map")
    return _jax.ClosedJaxpr(jaxpr, consts)


def make_block_mapping(spec: Any, x: Any, grid: tuple[int, ...], origin: str,
                       kernel_name: str, prefetch_avals: Sequence[Any] = ()) -> BlockMapping:
    """Normalises one operand's BlockSpec against its shape and the grid."""
    shape = tuple(x.shape)
    if spec is None or spec is no_block_spec:
        spec = BlockSpec()
    if not isinstance(spec, BlockSpec):
        raise BlockSpecError(
            f"In kernel {kernel_name!r}, {origin} has spec {spec!r}; expected a pl.BlockSpec."
        )
    if spec.memory_space is ANY:
        if spec.block_shape is not None and tuple(spec.block_shape) != shape:
            raise BlockSpecError(
                f"In kernel {kernel_name!r}, {origin} is in memory space ANY, which is not "
                f"blocked, but has block_shape {spec.block_shape}. Fix: drop block_shape."
            )
        block: tuple[int | None, ...] = shape
    else:
        block = _normalize_block_shape(spec, shape, origin, kernel_name)
    index_map = _trace_index_map(spec, grid, shape, origin, kernel_name, prefetch_avals)
    return BlockMapping(origin, shape, np.dtype(x.dtype), block, index_map, spec.memory_space,
                        len(prefetch_avals), spec.pipeline_mode)


def check_index_maps_in_bounds(gm: GridMapping, kernel_name: str) -> None:
    """Raises ``OutOfBoundsError`` if any index map leaves its array on any grid point.

    Evaluated ahead of time on every grid point (index maps are pure functions of the grid
    indices); grids larger than ``MAX_STATIC_CHECK_POINTS`` are not checked here.
    """
    tables = block_index_tables(gm)
    if tables is None:
        return
    points, per_operand = tables
    for bm, block_idx in zip(gm.block_mappings, per_operand):
        if bm.is_whole_array or not bm.array_shape:
            continue
        _raise_if_out_of_bounds(bm, block_idx, points, kernel_name)


def grid_points(grid: Sequence[int]) -> np.ndarray:
    """Every point of ``grid`` in lexicographic order, as an ``(num_steps, len(grid))`` array."""
    n = int(np.prod(grid, dtype=np.int64))
    return np.indices(tuple(grid), dtype=np.int32).reshape(len(grid), n).T


@functools.lru_cache(maxsize=128)
def block_index_tables(gm: GridMapping) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """Every operand's block indices on every grid point, evaluated ahead of time.

    Returns ``(points, tables)``: ``points`` as :func:`grid_points`, and per operand an
    ``(num_steps, ndim)`` int array. ``None`` for empty grids, grids larger than
    ``MAX_STATIC_CHECK_POINTS`` and index maps that read scalar-prefetch operands.
    """
    if gm.num_steps == 0 or gm.num_steps > MAX_STATIC_CHECK_POINTS or gm.num_scalar_prefetch:
        return None
    points = grid_points(gm.grid)
    tables = []
    # Concrete evaluation, even when pallas_call is traced (jit, shard_map, vmap, ...).
    with _jax.eval_context(), jax.ensure_compile_time_eval():
        cols = [jnp.asarray(points[:, k]) for k in range(len(gm.grid))]
        for bm in gm.block_mappings:
            if not bm.array_shape:
                tables.append(np.zeros((gm.num_steps, 0), np.int64))
                continue
            if gm.grid:
                idx = jax.vmap(bm.block_indices)(*cols)
            else:
                idx = [jnp.reshape(v, (1,)) for v in bm.block_indices()]
            tables.append(np.stack([np.asarray(i, np.int64) for i in idx], 1))
    return points, tables


def _raise_if_out_of_bounds(bm: BlockMapping, block_idx: np.ndarray, points: np.ndarray,
                            kernel_name: str) -> None:
    block = np.array(bm.full_block_shape, np.int64)
    shape = np.array(bm.array_shape, np.int64)
    starts = block_idx.astype(np.int64) * block
    bad = (block_idx < 0) | (starts >= np.maximum(shape, 1))
    if not bad.any():
        return
    step, dim = (int(v) for v in np.argwhere(bad)[0])
    n_blocks = tuple(int(-(-s // b)) for s, b in zip(shape, block))
    hint = ""
    if any(block_idx[step, d] >= block[d] > 1 for d in range(len(block))):
        rest = ["0"] * (len(block) - 1)
        good = f"({', '.join(['i', *rest])}{',' if not rest else ''})"
        bad_map = f"({', '.join(['i * block_size', *rest])}{',' if not rest else ''})"
        hint = (" Index maps return block indices, not element offsets: write "
                f"lambda i: {good}, not lambda i: {bad_map}.")
    raise OutOfBoundsError(
        f"In kernel {kernel_name!r}, the index map of {bm.origin} returned block index "
        f"{tuple(int(v) for v in block_idx[step])} at grid step "
        f"{tuple(int(v) for v in points[step])}, outside the array: dimension {dim} of shape "
        f"{bm.array_shape} in blocks of "
        f"{bm.full_block_shape} has {n_blocks[dim]} blocks (valid indices 0..{n_blocks[dim] - 1})."
        f"{hint}"
    )


def _is_spec_leaf(s: Any) -> bool:
    return s is None or s is no_block_spec or isinstance(s, BlockSpec)


class _Operand:
    """A placeholder for one operand leaf, matched against the specs."""


def flatten_specs(specs: Any, tree: Any, what: str, kernel_name: str) -> list[Any]:
    """One spec per operand leaf, with ``specs`` matching the operands' structure ``tree``.

    As in JAX, ``None`` in the specs matches a ``None`` operand (an empty pytree, no leaves);
    ``None`` for an operand that is an array means its default (whole-array) spec. A lone
    BlockSpec stands for a one-operand list; lists and tuples are interchangeable.
    """
    n = tree.num_leaves
    if specs is no_block_spec or specs is None:
        return [None] * n
    if isinstance(specs, BlockSpec):
        if n == 1:
            return [specs]
        specs = (specs,)
    if n == 1 and tree.num_nodes == 1 and isinstance(specs, (list, tuple)) and len(specs) == 1:
        specs = specs[0]  # [spec] for a lone operand
    operands = _tuples(jax.tree_util.tree_unflatten(tree, [_Operand()] * n))
    try:
        # The operands' structure is a prefix of the specs': each operand leaf gets the spec
        # subtree at its place (a BlockSpec, or None), and None matches a None operand.
        per_leaf = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
            lambda _, spec: _Spec(spec), operands, _tuples(specs)))
    except ValueError:
        per_leaf = None
    if per_leaf is None or not all(_is_spec_leaf(p.spec) for p in per_leaf):
        leaves, spec_tree = jax.tree_util.tree_flatten(_tuples(specs), is_leaf=_is_spec_leaf)
        shown = jax.tree_util.tree_unflatten(spec_tree, [
            "None" if s is None else "*" for s in leaves])
        operands_word = "inputs" if what == "in_specs" else "outputs"
        raise BlockSpecError(
            f"In kernel {kernel_name!r}, {what} has "
            f"{sum(isinstance(s, BlockSpec) for s in leaves)} BlockSpecs in the structure "
            f"{_show(shown)} but there are {n} {operands_word} in the structure "
            f"{_describe(tree)}. Fix: give one BlockSpec per operand, nested like the "
            f"{operands_word} (None for a None {operands_word[:-1]})."
        )
    return [p.spec for p in per_leaf]


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Wraps the spec found for one operand leaf (a pytree leaf even when it is None)."""

    spec: Any


def _tuples(tree: Any) -> Any:
    """``tree`` with every list turned into a tuple (specs may use either)."""
    if isinstance(tree, (list, tuple)):
        return tuple(_tuples(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _tuples(v) for k, v in tree.items()}
    return tree


def _show(tree: Any) -> str:
    return str(tree).replace("'", "")


def _describe(tree: Any) -> str:
    return _show(jax.tree_util.tree_unflatten(tree, ["*"] * tree.num_leaves))


def _is_scratch_leaf(s: Any) -> bool:
    return (hasattr(s, "shape") and hasattr(s, "dtype")) or callable(
        getattr(s, "memory_ref", None))


def scratch_leaves(scratch_shapes: Any) -> tuple[list[Any], Any]:
    """The scratch descriptions of ``scratch_shapes`` (a pytree: tuples, lists, dicts, with
    ``None`` for no buffer) and its structure, which the kernel's scratch Refs take."""
    leaves, tree = jax.tree_util.tree_flatten(scratch_shapes, is_leaf=_is_scratch_leaf)
    return leaves, tree


def scratch_avals(scratch_shapes: Any) -> tuple[Any, ...]:
    """The Ref avals of the scratch buffers, flat, in the order of :func:`scratch_leaves`."""
    from pallas_core.primitives import scratch_aval

    return tuple(scratch_aval(s) for s in scratch_leaves(scratch_shapes)[0])
