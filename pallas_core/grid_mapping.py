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

from pallas_core import _jax, index_eval
from pallas_core.errors import (
    BlockSpecError,
    IndexMapSignatureError,
    OutOfBoundsError,
    UnsupportedError,
)
from pallas_core.spec import (
    ANY,
    HOST,
    BlockDim,
    Blocked,
    BlockSpec,
    BoundedSlice,
    Element,
    Indirect,
    MemorySpace,
    Squeezed,
    block_dim,
    block_dim_size,
    no_block_spec,
    squeezed,
)

# Tables of every operand's index-map values (for backends) are made up to this many points.
MAX_STATIC_CHECK_POINTS = 1 << 20


class _DynamicSize:
    """The size of a grid axis that is known only when the kernel runs."""

    def __repr__(self) -> str:
        return "dynamic"


DYNAMIC: Any = _DynamicSize()
"""Stands in ``GridMapping.grid`` for a dynamic axis (its size is an operand of the call)."""


@dataclasses.dataclass(frozen=True)
class BlockMapping:
    """How one operand is blocked: ``index_map(*grid_indices)`` says where its block lies."""

    origin: str
    """The operand, for messages: e.g. ``"input 0 (x_ref)"`` or ``"output 1"``."""
    array_shape: tuple[int, ...]
    dtype: np.dtype
    block_shape: tuple[int | None, ...]
    """Per array dimension the block size; ``None`` marks a squeezed dimension (size 1)."""
    index_map: Any
    """Closed jaxpr: ``len(grid)`` int32 scalars (then one Ref per scalar-prefetch operand)
    -> one int32 per dimension (see :attr:`dims` for what it means), then the slice size of
    each ``pl.BoundedSlice`` dimension, in order."""
    memory_space: MemorySpace | None = None
    num_prefetch: int = 0
    """How many scalar-prefetch Refs the index map takes after the grid indices."""
    pipeline_mode: Any = None
    """The BlockSpec's ``pl.Buffered`` (``None``: the backend's default buffering)."""
    block_dims: tuple[BlockDim, ...] = ()
    """Per dimension how it is indexed (``pl.Blocked``, ``pl.Element``, ``pl.BoundedSlice``,
    ``pl.squeezed``); empty means what ``block_shape`` says: blocked, or squeezed for ``None``."""

    @property
    def dims(self) -> tuple[BlockDim, ...]:
        """How each dimension is indexed: the index map returns a block index for
        ``Blocked``, an element index for ``Squeezed`` and an element offset (into the padded
        array) for ``Element``; a ``BoundedSlice`` takes its start and size."""
        if self.block_dims:
            return self.block_dims
        return tuple(squeezed if b is None else Blocked(b) for b in self.block_shape)

    @property
    def block_indexed(self) -> bool:
        """Every dimension is blocked or squeezed (no element offsets or bounded slices)."""
        return all(isinstance(d, (Blocked, Squeezed)) for d in self.dims)

    @property
    def bounded_dims(self) -> tuple[int, ...]:
        """The dimensions indexed by ``pl.BoundedSlice``."""
        return tuple(k for k, d in enumerate(self.dims) if isinstance(d, BoundedSlice))

    @property
    def num_index_outputs(self) -> int:
        """How many values the index map returns."""
        return len(self.array_shape) + len(self.bounded_dims)

    @property
    def padding(self) -> tuple[tuple[int, int], ...]:
        """Per dimension the ``(low, high)`` padding of a ``pl.Element`` dimension, else 0s."""
        return tuple(d.padding if isinstance(d, Element) else (0, 0) for d in self.dims)

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
        """The kernel sees the whole array (memory space ``ANY`` or ``HOST``, no blocking)."""
        return self.memory_space is ANY or self.memory_space is HOST

    def block_indices(self, *args: Any) -> list[Any]:
        """Evaluates the index map on grid indices (then scalar-prefetch Refs or arrays):
        one value per dimension, then the size of each bounded slice."""
        prefetch = args[len(args) - self.num_prefetch:] if self.num_prefetch else ()
        if prefetch and not isinstance(_jax.typeof(prefetch[0]), _jax.AbstractRef):
            pure = self.pure_index_map
            return _jax.eval_jaxpr(pure.jaxpr, pure.consts, *args)[:self.num_index_outputs]
        return _jax.eval_jaxpr(self.index_map.jaxpr, self.index_map.consts, *args)

    @property
    def pure_index_map(self) -> Any:
        """The index map as a function of values: scalar-prefetch Refs taken as arrays (its
        outputs may be followed by the prefetch arrays)."""
        if not self.num_prefetch:
            return self.index_map
        return _discharged_index_map(self.index_map)


@functools.lru_cache(maxsize=256)
def _discharged_index_map(index_map: Any) -> Any:
    return _jax.discharge_state(index_map)


@dataclasses.dataclass(frozen=True)
class GridMapping:
    """The grid and the blocking of every operand of one ``pallas_call``."""

    grid: tuple[int, ...]
    """The full grid, leading batch axes (added by ``vmap``) included. A dynamic axis holds
    :data:`DYNAMIC`; its size is one of the call's last ``num_dynamic_grid_bounds`` operands
    (int32 scalars, in axis order). Only backends with the ``dynamic_grid`` capability
    receive such grids."""
    block_mappings: tuple[BlockMapping, ...]
    """Inputs first, then outputs."""
    num_inputs: int
    num_outputs: int
    scratch_avals: tuple[Any, ...] = ()
    num_batch_axes: int = 0
    """Leading grid axes added by ``vmap``; ``program_id(i)`` in the kernel is axis
    ``i + num_batch_axes`` of ``grid``."""
    grid_names: tuple[str, ...] | None = None
    """Axis names of the user grid: a named grid's, or the mesh's of ``pl.kernel``."""
    num_scalar_prefetch: int = 0
    """The first inputs are scalar-prefetch operands: passed whole to the kernel and to every
    index map, so index maps depend on data (no ahead-of-time evaluation)."""
    is_mesh: bool = False
    """The user grid is a ``pl.kernel``/``pl.core_map`` mesh: its points are cores that run
    in parallel (a named ``pallas_call`` grid is not)."""
    symbolic_sizes: tuple[Any, ...] = ()
    """Per axis of the user grid, the symbolic dimension its size was given as (``jax.export``
    with shape polymorphism; the axis is dynamic), else ``None``; empty when none is."""

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
    def dynamic_axes(self) -> tuple[int, ...]:
        """The axes of ``grid`` whose sizes are known only when the kernel runs."""
        return tuple(a for a, g in enumerate(self.grid) if g is DYNAMIC)

    @property
    def num_dynamic_grid_bounds(self) -> int:
        """How many trailing operands of the call are dynamic grid sizes."""
        return len(self.dynamic_axes)

    def resolved_grid(self, sizes: Sequence[Any]) -> tuple[Any, ...]:
        """``grid`` with each dynamic axis replaced by its size from ``sizes`` (in order)."""
        it = iter(sizes)
        return tuple(next(it) if g is DYNAMIC else g for g in self.grid)

    @property
    def num_steps(self) -> int:
        if self.dynamic_axes:
            raise UnsupportedError(
                f"the grid {self.grid} has dynamic sizes, so its number of steps is known only "
                "when the kernel runs.")
        return int(np.prod(self.grid, dtype=np.int64))


def _normalize_block_shape(spec: BlockSpec, shape: tuple[int, ...], origin: str,
                           kernel_name: str, path: str | None = None) -> tuple[BlockDim, ...]:
    if spec.block_shape is None:
        return tuple(Blocked(d) for d in shape)
    block = spec.block_shape
    if len(block) != len(shape):
        raise BlockSpecError(
            f"In kernel {kernel_name!r}: Block shape for {path or origin} (= {tuple(block)}) "
            f"must have the same number of dimensions as the array shape {shape}: {origin} has "
            f"rank {len(shape)} but its BlockSpec's block_shape has rank {len(block)}. Fix: give "
            "one block size per array dimension, using None (or pl.squeezed) for dimensions to "
            "drop."
        )
    out: list[BlockDim] = []
    for b in block:
        if isinstance(b, Indirect):
            raise UnsupportedError(
                f"In kernel {kernel_name!r}, {origin} has block dimension {b!r} in block_shape "
                f"{tuple(block)}: pallas_call does not gather blocks through index arrays. Fix: "
                "pass the operand whole (memory_space=pl.ANY) and run pltpu.emit_pipeline with "
                "this BlockSpec inside the kernel, or copy the rows with gather copies.")
        try:
            out.append(block_dim(b))
        except BlockSpecError:
            raise BlockSpecError(
                f"In kernel {kernel_name!r}, {origin}: block sizes must be positive ints, None, "
                "pl.squeezed, pl.Blocked(n), pl.Element(n) or pl.BoundedSlice(n); found "
                f"{b!r} in block_shape {tuple(block)}."
            ) from None
    return tuple(out)


def _src_info(fn: Any) -> str:
    """``name at file:line`` of a function, as JAX names the functions it traces."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    code = getattr(fn, "__code__", None)
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name


def type_text(o: Any) -> str:
    """``o``'s type for a message: ``int32[4]`` for an array (or traced value), else the
    Python type's name."""
    shape, dtype = getattr(o, "shape", None), getattr(o, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{getattr(dtype, 'name', dtype)}[{','.join(str(d) for d in shape)}]"
    return type(o).__name__


def _check_index(o: Any, d: int, dim: BlockDim, origin: str, kernel_name: str,
                 subject: str) -> None:
    """Raises unless ``o`` is an integer scalar (what every dimension but a bounded slice's
    index map value is). ``subject``: the index map as JAX names it (``Index map function f
    at file:line for args[0]``)."""
    if isinstance(o, _jax.Slice):
        raise BlockSpecError(
            f"In kernel {kernel_name!r}, the index map of {origin} returned {o} for dimension "
            f"{d}, whose block dimension is {dim}; only pl.BoundedSlice dimensions take a "
            f"pl.ds(start, size). Fix: return an integer there, or make the block dimension "
            f"pl.BoundedSlice({block_dim_size(dim)}).")
    dtype = getattr(o, "dtype", None)
    if o is None or isinstance(o, float) or jnp.ndim(o) != 0 or (
            dtype is not None and not jnp.issubdtype(dtype, jnp.integer)):
        type_ = type_text(o)
        shown = (f"a{'n' if type_[:1] in 'aeiou' else ''} {type_} value"
                 if isinstance(o, _jax.Tracer) else repr(o))
        raise BlockSpecError(
            f"In kernel {kernel_name!r}: {subject} must return "
            f"integer scalars. Output[{d}] has type {type_}: the index map of {origin} "
            f"returned {shown} for dimension {d}; expected one integer scalar per array "
            "dimension (a block index). Fix: return ints or int32 scalars, e.g. "
            "lambda i, j: (i, j).")


def _slice_parts(o: Any, d: int, dim: BoundedSlice, origin: str,
                 kernel_name: str, subject: str) -> tuple[Any, Any]:
    """``(start, size)`` of the ``pl.ds`` an index map returned for a bounded-slice dim."""
    if not isinstance(o, _jax.Slice):
        raise BlockSpecError(
            f"In kernel {kernel_name!r}, the index map of {origin} returned {o!r} for dimension "
            f"{d}, whose block dimension is {dim}; expected pl.ds(start, size) with size <= "
            f"{dim.block_size}. Fix: e.g. lambda i: (pl.ds(starts_ref[i], sizes_ref[i]),).")
    if o.stride != 1:
        raise UnsupportedError(
            f"In kernel {kernel_name!r}, the index map of {origin} returned a strided slice "
            f"{o} for {dim} dimension {d}; bounded slices are contiguous. Fix: drop the stride.")
    if isinstance(o.size, (int, np.integer)) and not 0 <= o.size <= dim.block_size:
        raise BlockSpecError(
            f"In kernel {kernel_name!r}, the index map of {origin} returned {o} for {dim} "
            f"dimension {d}: the size must lie in 0..{dim.block_size}. Fix: make the block "
            "larger or the slice smaller.")
    for part in (o.start, o.size):
        _check_index(part, d, dim, origin, kernel_name, subject)
    return o.start, o.size


def _trace_index_map(spec: BlockSpec, dims: tuple[BlockDim, ...], grid: tuple[int, ...],
                     shape: tuple[int, ...], origin: str, kernel_name: str,
                     prefetch_avals: Sequence[Any] = (),
                     grid_names: tuple[str, ...] | None = None,
                     prefetch_tree: Any = None, path: str | None = None) -> Any:
    from pallas_core import primitives as prims

    ndim = len(shape)
    fn = spec.index_map
    if fn is None:
        def fn(*_: Any) -> tuple[int, ...]:
            return (0,) * ndim
    # The index map as JAX's messages name it.
    subject = f"Index map function {_src_info(fn)} for {path or origin}"
    avals = [_jax.ShapedArray((), jnp.int32)] * len(grid) + list(prefetch_avals)

    pf_args = f" and {len(prefetch_avals)} scalar-prefetch Refs" if prefetch_avals else ""
    pf_fix = ", then one per scalar-prefetch operand" if prefetch_avals else ""

    def flat(*idx: Any) -> list[Any]:
        try:
            # pl.num_programs works in index maps, as in kernels.
            args: Sequence[Any] = idx
            if prefetch_tree is not None:  # scalar-prefetch arguments may be pytrees
                args = (*idx[:len(grid)], *jax.tree_util.tree_unflatten(prefetch_tree,
                                                                       idx[len(grid):]))
            with prims.kernel_trace_context(prims.KernelTraceContext(grid, grid_names)):
                out = fn(*args)
        except _jax.ConcretizationTypeError as e:
            code = getattr(fn, "__code__", None)
            where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
            raise BlockSpecError(
                f"In kernel {kernel_name!r}, the index map of {origin}{where} uses a grid index "
                "(or a scalar-prefetch value) in Python control flow (if, while, bool(), int()), "
                "but index maps are traced: the indices are known only when the kernel runs. "
                "Fix: compute with jnp.where(cond, a, b) or lax.select instead of if/else."
            ) from e
        except TypeError as e:
            if "positional argument" in str(e):
                raise IndexMapSignatureError(
                    f"In kernel {kernel_name!r}, the index map of {origin} could not be called "
                    f"with the {len(grid)} grid indices of grid {grid}{pf_args}: {e}. Fix: the "
                    f"index map takes one argument per grid axis ({len(grid)}){pf_fix}."
                ) from e
            raise
        out = out if isinstance(out, (tuple, list)) else (out,)
        if len(out) != ndim:
            block = tuple(spec.block_shape) if spec.block_shape is not None else shape
            raise BlockSpecError(
                f"In kernel {kernel_name!r}: {subject} must return {ndim} values to match "
                f"block_shape={block}. Currently returning {len(out)} values: the index map of "
                f"{origin} returns one block index per dimension of the array, which has rank "
                f"{ndim} (shape {shape}). Fix: return a tuple of {ndim} block indices (0 for "
                "dimensions that are not blocked)."
            )
        indices, sizes = [], []
        for d, (o, dim) in enumerate(zip(out, dims)):
            if isinstance(dim, BoundedSlice):
                start, size = _slice_parts(o, d, dim, origin, kernel_name, subject)
                indices.append(start)
                sizes.append(size)
            else:
                _check_index(o, d, dim, origin, kernel_name, subject)
                indices.append(o)
        return [jnp.asarray(o, jnp.int32) for o in (*indices, *sizes)]

    jaxpr, _, consts = _jax.trace_to_jaxpr(flat, avals, name="index_map")
    shapes = captured_arrays(consts)
    if shapes:
        # Backends compile index maps into the launch (TPU) or the kernel (GPU), where there is
        # no place for arrays; JAX refuses them too.
        raise BlockSpecError(
            f"In kernel {kernel_name!r}: {subject} must not capture constants: the index map "
            f"of {origin} closes over arrays ({shapes}). Fix: pass the data as a scalar-prefetch "
            "operand (GridSpec(num_scalar_prefetch=...)) and read it from the index map's Ref "
            "argument, or compute the index from the grid indices.")
    return _jax.ClosedJaxpr(jaxpr, consts)


def captured_arrays(consts: Sequence[Any]) -> str:
    """The arrays (not scalars) among a traced function's captured constants, described for a
    message (``"float32[128], int32[4]"``); empty when there are none."""
    return ", ".join(f"{jnp.dtype(getattr(c, 'dtype', float))}{list(np.shape(c))}"
                     for c in consts if np.shape(c) != () or isinstance(c, _jax.Tracer))


def make_block_mapping(spec: Any, x: Any, grid: tuple[int, ...], origin: str,
                       kernel_name: str, prefetch_avals: Sequence[Any] = (),
                       grid_names: tuple[str, ...] | None = None,
                       prefetch_tree: Any = None, path: str | None = None) -> BlockMapping:
    """Normalises one operand's BlockSpec against its shape and the grid. ``path``: the
    operand as JAX's messages name it (``args[0]['a']``, ``outputs[1]``)."""
    shape = tuple(x.shape)
    if spec is None or spec is no_block_spec:
        spec = BlockSpec()
    if not isinstance(spec, BlockSpec):
        raise BlockSpecError(
            f"In kernel {kernel_name!r}, {origin} has spec {spec!r}; expected a pl.BlockSpec."
        )
    if spec.memory_space is ANY or spec.memory_space is HOST:
        if spec.block_shape is not None and tuple(spec.block_shape) != shape:
            raise BlockSpecError(
                f"In kernel {kernel_name!r}, {origin} is in memory space "
                f"{'ANY' if spec.memory_space is ANY else 'HOST'}, which is not "
                f"blocked, but has block_shape {spec.block_shape}. Fix: drop block_shape."
            )
        dims = _normalize_block_shape(BlockSpec(), shape, origin, kernel_name)
    else:
        dims = _normalize_block_shape(spec, shape, origin, kernel_name, path)
    block = tuple(None if isinstance(d, Squeezed) else block_dim_size(d) for d in dims)
    if not _jax.is_static_shape([b for b in block if b is not None]) and not (
            _jax.dynamic_shapes_export_enabled()):
        raise BlockSpecError(
            f"In kernel {kernel_name!r}, {origin} has the symbolic block shape {block} "
            "(jax.export with shape polymorphism); blocks of symbolic shape are exported only "
            "in JAX's dynamic-shape export mode. Fix: give the block static sizes "
            "(pl.BlockSpec((8, 128), ...)), or export inside "
            "pl.pallas_export_experimental(dynamic_shapes=True).")
    index_map = _trace_index_map(spec, dims, grid, shape, origin, kernel_name, prefetch_avals,
                                 grid_names, prefetch_tree, path)
    plain = all(isinstance(d, (Blocked, Squeezed)) for d in dims)
    return BlockMapping(origin, shape, np.dtype(x.dtype), block, index_map, spec.memory_space,
                        len(prefetch_avals), spec.pipeline_mode, () if plain else dims)


def check_index_maps_in_bounds(gm: GridMapping, kernel_name: str, inputs: bool = True) -> None:
    """Raises ``OutOfBoundsError`` if any index map leaves its array on any grid point.

    Evaluated ahead of time with numpy (:mod:`pallas_core.index_eval`) on every grid point,
    whatever the grid's size: each array dimension's index on the grid axes it depends on
    (``lambda i, j: (i, j)`` on a grid of ``(n, m)`` takes ``n + m`` evaluations), in chunks.
    Not checked here: dynamic grids, index maps that read scalar-prefetch operands (the
    interpreter's checked mode checks them when the kernel runs), and an index that depends
    jointly on grid axes with more than ``MAX_CHECK_POINTS`` points. With ``inputs=False``
    only outputs are checked (for an interpreter that reads input blocks outside their arrays
    as uninitialized memory).
    """
    if gm.dynamic_axes or gm.num_steps == 0:
        return
    for k, bm in enumerate(gm.block_mappings):
        if bm.is_whole_array or not bm.array_shape or (not inputs and k < gm.num_inputs):
            continue
        if not _jax.is_static_shape(bm.array_shape):  # its size is known when it runs
            continue
        point = _first_point_out_of_bounds(bm, gm.grid)
        if point is not None:
            table = _index_values(bm, [np.full((1,), p, np.int32) for p in point], 1)
            assert table is not None  # evaluated at this point already
            _raise_if_out_of_bounds(bm, table, np.asarray([point]), kernel_name)


# An index depending jointly on grid axes with more points than this is not checked ahead of
# time (about a second of numpy at the limit).
MAX_CHECK_POINTS = 1 << 26
_CHUNK = 1 << 16  # grid points evaluated at once by the numpy evaluator
_JAX_CHUNK = 1 << 10  # ... and by JAX, for index maps numpy cannot evaluate


def _first_point_out_of_bounds(bm: BlockMapping, grid: tuple[int, ...]
                               ) -> tuple[int, ...] | None:
    """The first grid point (in lexicographic order) where ``bm``'s index map leaves the
    array, or ``None`` (also when it cannot be known ahead of time)."""
    axes_of = index_eval.output_axes(bm.index_map, len(grid))
    if axes_of is None:
        return None  # reads scalar-prefetch operands
    ndim = len(bm.array_shape)
    groups: dict[tuple[int, ...], list[int]] = {}
    for d in range(ndim):
        outs = [d] + ([ndim + bm.bounded_dims.index(d)] if d in bm.bounded_dims else [])
        axes = tuple(sorted(frozenset().union(*(axes_of[o] for o in outs))))
        groups.setdefault(axes, []).append(d)
    found = []
    for axes, dims in groups.items():
        sub = tuple(grid[a] for a in axes)
        n = int(np.prod(sub, dtype=np.int64))
        if n > MAX_CHECK_POINTS:
            continue
        for start in range(0, n, _CHUNK):
            flat = np.arange(start, min(n, start + _CHUNK), dtype=np.int64)
            cols: list[np.ndarray] = [np.zeros((), np.int32)] * len(grid)
            for a, c in zip(axes, np.unravel_index(flat, sub) if sub else ()):
                cols[a] = c.astype(np.int32)
            table = _index_values(bm, cols, len(flat))
            if table is None:
                return None
            bad = _out_of_bounds(bm, table)[:, dims].any(1)
            if bad.any():
                step = int(np.argmax(bad))
                found.append(tuple(int(np.broadcast_to(c, flat.shape)[step]) for c in cols))
                break
    return min(found) if found else None


def _index_values(bm: BlockMapping, cols: Sequence[np.ndarray], n: int) -> np.ndarray | None:
    """``bm``'s index map on ``n`` grid points (``cols``: per grid axis the indices, or one
    index for all), as an ``(n, bm.num_index_outputs)`` int64 array; ``None`` for an index map
    that reads scalar-prefetch operands in a way numpy cannot evaluate."""
    try:
        outs = index_eval.evaluate(bm.index_map, cols)
    except index_eval.NotVectorisableError:
        if bm.num_prefetch:
            return None
        outs = _index_values_with_jax(bm, cols, n)
    columns = [np.broadcast_to(np.asarray(o, np.int64), (n,)) for o in outs]
    return np.stack(columns, 1) if columns else np.zeros((n, 0), np.int64)


def _index_values_with_jax(bm: BlockMapping, cols: Sequence[np.ndarray], n: int,
                           prefetch: Sequence[np.ndarray] = ()) -> list[np.ndarray]:
    """As :func:`_index_values`, with JAX, on chunks of a fixed size (so that JAX compiles
    the same few shapes whatever the grid); ``prefetch`` holds the scalar-prefetch values
    the index map reads, if any."""
    values = tuple(jnp.asarray(v) for v in prefetch[:bm.num_prefetch]) if bm.num_prefetch \
        else ()

    def indices(*grid_indices: Any) -> list[Any]:
        return list(bm.block_indices(*grid_indices, *values))

    # Concrete evaluation, even when pallas_call is traced (jit, shard_map, vmap, ...).
    with _jax.eval_context(), jax.ensure_compile_time_eval():
        if not cols:
            return [np.asarray(v) for v in indices()]
        parts = []
        for start in range(0, n, _JAX_CHUNK):
            chunk = [np.broadcast_to(c, (n,))[start:start + _JAX_CHUNK] for c in cols]
            size = len(chunk[0])
            padded = [jnp.asarray(np.pad(c, (0, _JAX_CHUNK - size))) for c in chunk]
            parts.append([np.asarray(v)[:size] for v in jax.vmap(indices)(*padded)])
    return [np.concatenate(vals) for vals in zip(*parts)]


def grid_points(grid: Sequence[int]) -> np.ndarray:
    """Every point of ``grid`` in lexicographic order, as an ``(num_steps, len(grid))`` array."""
    n = int(np.prod(grid, dtype=np.int64))
    return np.indices(tuple(grid), dtype=np.int32).reshape(len(grid), n).T


@functools.lru_cache(maxsize=128)
def block_index_tables(gm: GridMapping) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """Every operand's index-map values on every grid point, evaluated ahead of time.

    Returns ``(points, tables)``: ``points`` as :func:`grid_points`, and per operand an
    ``(num_steps, bm.num_index_outputs)`` int array (one column per dimension, then the size
    of each bounded slice). ``None`` for dynamic and empty grids, grids larger than
    ``MAX_STATIC_CHECK_POINTS`` and index maps that read scalar-prefetch operands.
    """
    if gm.dynamic_axes or gm.num_scalar_prefetch:
        return None
    if gm.num_steps == 0 or gm.num_steps > MAX_STATIC_CHECK_POINTS:
        return None
    points = grid_points(gm.grid)
    cols = [points[:, k] for k in range(len(gm.grid))]
    tables = []
    for bm in gm.block_mappings:
        table = _index_values(bm, cols, gm.num_steps)
        assert table is not None  # no scalar prefetch
        tables.append(table)
    return points, tables


def prefetch_index_tables(gm: GridMapping, prefetch: Sequence[np.ndarray]
                          ) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """As :func:`block_index_tables`, for a grid whose index maps read scalar-prefetch
    operands, on the values ``prefetch`` (one array per scalar-prefetch operand)."""
    if gm.dynamic_axes or gm.num_steps == 0 or gm.num_steps > MAX_STATIC_CHECK_POINTS:
        return None
    points = grid_points(gm.grid)
    cols = [points[:, k] for k in range(len(gm.grid))]
    tables = []
    for bm in gm.block_mappings:
        outs = _index_values_with_jax(bm, cols, gm.num_steps, prefetch)[:bm.num_index_outputs]
        columns = [np.broadcast_to(np.asarray(o, np.int64), (gm.num_steps,)) for o in outs]
        tables.append(np.stack(columns, 1) if columns
                      else np.zeros((gm.num_steps, 0), np.int64))
    return points, tables


def _out_of_bounds(bm: BlockMapping, table: np.ndarray) -> np.ndarray:
    """Per step and dimension, whether the index-map value there leaves the array."""
    ndim = len(bm.array_shape)
    bad = np.zeros((table.shape[0], ndim), bool)
    sizes = iter(table[:, ndim:].T)
    for d, (dim, n) in enumerate(zip(bm.dims, bm.array_shape)):
        i = table[:, d]
        if isinstance(dim, Element):
            bad[:, d] = (i < 0) | (i >= max(n + sum(dim.padding), 1))
        elif isinstance(dim, BoundedSlice):
            size = next(sizes)
            bad[:, d] = (i < 0) | (size < 0) | (size > dim.block_size) | (i + size > n)
        else:
            bad[:, d] = (i < 0) | (i * block_dim_size(dim) >= max(n, 1))
    return bad


def _raise_if_out_of_bounds(bm: BlockMapping, table: np.ndarray, points: np.ndarray,
                            kernel_name: str) -> None:
    bad = _out_of_bounds(bm, table)
    if not bad.any():
        return
    step, dim = (int(v) for v in np.argwhere(bad)[0])
    ndim = len(bm.array_shape)
    where = (f"Out-of-bounds {{what}} for {bm.origin} in kernel {kernel_name!r} at grid step "
             f"{tuple(int(v) for v in points[step])}: its index map leaves the array: "
             f"dimension {dim} of shape {bm.array_shape}")
    kind = bm.dims[dim]
    if isinstance(kind, Element):
        lo, hi = kind.padding
        raise OutOfBoundsError(
            where.format(what=f"element offset {int(table[step, dim])}")
            + f" is indexed by {kind}, so a block starts at an offset in "
            f"0..{bm.array_shape[dim] + lo + hi - 1} (the dimension with its padding).")
    if isinstance(kind, BoundedSlice):
        size = int(table[step, ndim + bm.bounded_dims.index(dim)])
        raise OutOfBoundsError(
            where.format(what=f"pl.ds({int(table[step, dim])}, {size})")
            + f" is indexed by {kind}: the slice must satisfy 0 <= start, 0 <= size <= "
            f"{kind.block_size} and start + size <= {bm.array_shape[dim]}.")
    block_idx = table[:, :ndim]
    block = np.array(bm.full_block_shape, np.int64)
    n_blocks = tuple(int(-(-s // b)) for s, b in zip(bm.array_shape, block))
    hint = ""
    if bm.block_indexed and any(block_idx[step, d] >= block[d] > 1 for d in range(ndim)):
        rest = ["0"] * (len(block) - 1)
        good = f"({', '.join(['i', *rest])}{',' if not rest else ''})"
        bad_map = f"({', '.join(['i * block_size', *rest])}{',' if not rest else ''})"
        hint = (" Index maps return block indices, not element offsets: write "
                f"lambda i: {good}, not lambda i: {bad_map}.")
    raise OutOfBoundsError(
        where.format(what=f"block index {tuple(int(v) for v in block_idx[step])}")
        + f" in blocks of {bm.full_block_shape} has {n_blocks[dim]} blocks (valid indices "
        f"0..{n_blocks[dim] - 1}).{hint}"
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
        # JAX's words first (what differs, and where), then the count and the fix.
        jax_words = _jax.pytree_mismatches(
            f"`{what}`", jax.tree_util.tree_structure(_tuples(specs)),
            "`inputs`" if what == "in_specs" else "`out_shape`",
            jax.tree_util.tree_structure(operands))
        raise BlockSpecError(
            (f"{jax_words}\n" if jax_words else "") +
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


def refuse_empty_operands(where: str, gm: GridMapping, backend: str) -> None:
    """Raises a ``BlockSpecError`` for an operand with no elements, for a backend that cannot
    hold an empty block (hardware vector and tensor types have at least one element: MLIR's
    verifier refuses a ``vector<2x0xf32>``, Triton an empty range)."""
    for bm in gm.block_mappings:
        if any(isinstance(d, (int, np.integer)) and d == 0 for d in bm.array_shape):
            raise BlockSpecError(
                f"{where}: {bm.origin} has shape {tuple(bm.array_shape)}, with no elements; "
                f"the {backend!r} backend cannot hold an empty block (its vector and tensor "
                "types have at least one element). Fix: skip the call when an array is empty "
                "(its result is empty too), or run it with backend='interpret'.")
