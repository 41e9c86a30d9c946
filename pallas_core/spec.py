"""Backend-neutral description of a kernel's operands: memory spaces, BlockSpecs, grids, meshes.

These are the names a kernel author writes (``pl.BlockSpec``, ``pl.GridSpec``, ``pl.ANY`` ...).
Nothing here knows about a particular backend; plugins add their own memory spaces,
meshes and ``CompilerParams`` subclasses.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import _jax
from pallas_core.errors import ArgumentError, BlockSpecError, UnsupportedError


@dataclasses.dataclass(frozen=True)
class MemorySpace:
    """A place where a Ref may live (``pl.ANY``; plugins add e.g. ``pltpu.VMEM``).

    Calling a memory space with a shape and dtype describes a scratch buffer there:
    ``pltpu.VMEM((8, 128), jnp.float32)``.
    """

    name: str
    backend: str | None = None
    """The backend that defines this space; ``None`` for the core's own spaces."""
    zeroed: bool = False
    """Buffers here start at zero (semaphores do); others start undefined."""
    shared: bool = False
    """One buffer serves all the points of a mesh that a barrier synchronises (SparseCore's
    shared VMEM: one per core, for all its subcores); otherwise each point has its own."""
    per_point: bool = False
    """Each grid point starts with a fresh buffer of its own (GPU semaphores: one set per
    thread block, zero when it starts), where scratch otherwise persists across the steps
    one core runs."""

    ANY: ClassVar[MemorySpace]
    HOST: ClassVar[MemorySpace]

    def __call__(self, shape: Sequence[int], dtype: Any) -> MemoryRef:
        return MemoryRef(tuple(int(d) for d in shape), np.dtype(dtype), self)

    def __str__(self) -> str:
        return self.name if self.backend is None else f"{self.backend}.{self.name}"


ANY = MemorySpace("any")
"""Wherever the backend keeps whole arrays (HBM on TPU, global memory on GPU); no blocking."""
MemorySpace.ANY = ANY
HOST = MemorySpace("host")
"""The host's memory: operands there are passed whole (no blocking), as ``pl.ANY`` ones; a
backend copies them in and out with its DMAs (``jax.experimental.pallas.HOST``)."""
MemorySpace.HOST = HOST
BARRIER_SEMAPHORE = MemorySpace("barrier_semaphore", zeroed=True)
"""The kernel's barrier semaphore (``pltpu.get_barrier_semaphore()``): one int32 semaphore
shared by the kernel instances of one collective, which other devices signal."""


class semaphore_dtype(jax.dtypes.extended):  # noqa: N801 (JAX's name)
    """The common base of semaphore dtypes, for ``jnp.issubdtype(t, ...)``; never instantiated.

    Semaphore Refs here hold int32 counts and are told apart by memory space; these classes
    name the kind of semaphore when allocating one (``pltpu.SEMAPHORE((), pl.semaphore)``).
    """


class semaphore(semaphore_dtype):  # noqa: N801 (JAX's name)
    """The dtype of regular (counting) semaphores (``jax.experimental.pallas.semaphore``)."""


@dataclasses.dataclass(frozen=True)
class MemoryRef:
    """The shape, dtype and memory space of a scratch buffer (see ``MemorySpace.__call__``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    memory_space: MemorySpace | None = None


@dataclasses.dataclass(frozen=True)
class Squeezed:
    """A block dimension of size 1 that is dropped from the kernel's view of the block.

    The index map returns the element index along that dimension (with a block size of 1,
    the same as a block index).
    """

    def __repr__(self) -> str:
        return "squeezed"


squeezed = Squeezed()


def _check_size(kind: str, block_size: Any, minimum: int = 1) -> Any:
    if _jax.is_symbolic_dim(block_size):  # a whole dimension of a shape-polymorphic array
        return block_size
    if (not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool)
            or block_size < minimum):
        raise BlockSpecError(
            f"pl.{kind}(block_size={block_size!r}): the block size must be an int >= "
            f"{minimum}. Fix: e.g. pl.{kind}(128).")
    return int(block_size)


@dataclasses.dataclass(frozen=True)
class Blocked:
    """A block dimension of ``block_size`` elements, indexed by block: the index map returns
    ``k`` for the block starting at element ``k * block_size`` (what a plain int means)."""

    block_size: int

    def __post_init__(self) -> None:
        # 0 only for the whole of an empty dimension.
        object.__setattr__(self, "block_size", _check_size("Blocked", self.block_size, 0))

    def __str__(self) -> str:
        return f"Blocked({self.block_size})"


@dataclasses.dataclass(frozen=True)
class Element:
    """A block dimension of ``block_size`` elements, indexed by element: the index map returns
    the offset of the block's first element, so blocks may overlap or start anywhere.

    ``padding=(low, high)`` pads the array along this dimension with ``low`` elements before
    and ``high`` after; offsets count from the start of the padded array. Padding reads as
    undefined values (the interpreter fills it with NaN for floats, the minimum for integers,
    as ``jax.experimental.pallas`` does) and writes to it are dropped.
    """

    block_size: int
    padding: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", _check_size("Element", self.block_size))
        pad = self.padding
        if not (isinstance(pad, (tuple, list)) and len(pad) == 2 and all(
                isinstance(p, (int, np.integer)) and not isinstance(p, bool) and p >= 0
                for p in pad)):
            raise BlockSpecError(
                f"pl.Element({self.block_size}, padding={pad!r}): padding must be a pair "
                "(low, high) of non-negative ints. Fix: e.g. padding=(0, 2).")
        object.__setattr__(self, "padding", (int(pad[0]), int(pad[1])))

    def __str__(self) -> str:
        if self.padding == (0, 0):
            return f"Element({self.block_size})"
        return f"Element({self.block_size}, padding={self.padding})"


@dataclasses.dataclass(frozen=True)
class BoundedSlice:
    """A block dimension of at most ``block_size`` elements: the index map returns
    ``pl.ds(start, size)`` (``size <= block_size``, both may depend on the grid and on
    scalar-prefetch data) and the block holds ``array[start:start + size]`` in its first
    ``size`` elements; the rest of the block is undefined on read and not written back."""

    block_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", _check_size("BoundedSlice", self.block_size))

    def __repr__(self) -> str:
        return f"BoundedSlice({self.block_size})"


@dataclasses.dataclass(frozen=True)
class Indirect:
    """A block dimension of ``block_size`` elements picked by an array of indices: the index
    map returns ``block_size`` integer indices for it (an array, or an array read from a
    Ref), and the block holds those rows: a gather for inputs, a scatter for outputs
    (``jax.experimental.pallas.Indirect``). Pipelines (``pltpu.emit_pipeline``) take it on
    the leading dimension; ``pallas_call`` refuses it."""

    block_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", _check_size("Indirect", self.block_size))

    def __repr__(self) -> str:
        return f"Indirect({self.block_size})"


BlockDim = Blocked | Element | BoundedSlice | Squeezed | Indirect
"""One entry of a normalised block shape (``pallas_call`` refuses ``Indirect``)."""


def block_dim(entry: Any) -> BlockDim:
    """``entry`` of a ``block_shape`` as a :data:`BlockDim`: an int is ``Blocked``, ``None``
    is ``squeezed``; raises ``BlockSpecError`` for anything else."""
    if entry is None:
        return squeezed
    if isinstance(entry, (Blocked, Element, BoundedSlice, Squeezed)):
        return entry
    if isinstance(entry, (int, np.integer)) and not isinstance(entry, bool) and entry > 0:
        return Blocked(int(entry))
    if _jax.is_symbolic_dim(entry):  # jax.export with shape polymorphism
        return Blocked(entry)
    raise BlockSpecError(
        f"block_shape entry {entry!r}: expected a positive int, None, pl.squeezed, "
        "pl.Blocked(n), pl.Element(n) or pl.BoundedSlice(n).")


def block_dim_size(dim: BlockDim) -> int:
    """The number of elements a block spans along ``dim`` (1 for squeezed)."""
    return 1 if isinstance(dim, Squeezed) else dim.block_size


def plain_block_dim(entry: Any, where: str) -> int | None:
    """``entry`` as a block size (``None`` if squeezed), for code that only indexes by block.

    Raises ``UnsupportedError`` naming ``where`` for element-indexed dimensions
    (``pl.Element``, ``pl.BoundedSlice``).
    """
    dim = block_dim(entry)
    if isinstance(dim, (Element, BoundedSlice)):
        raise UnsupportedError(
            f"{where}: block dimension {dim} is not supported here; only block-indexed "
            "dimensions (ints, pl.Blocked, None/pl.squeezed) are. Fix: use a block size and "
            "return block indices from the index map.")
    return None if isinstance(dim, Squeezed) else dim.block_size


class RevisitMode(enum.Enum):
    """Which grid steps may come back to an output block a pipeline has already written.

    ``IMMEDIATE``: only the steps right after it (the usual accumulation over the last grid
    axes); ``ANY``: any later step (costs extra copies on hardware that must restore it).
    """

    IMMEDIATE = "immediate"
    ANY = "any"


@dataclasses.dataclass(frozen=True)
class Buffered:
    """How many buffers a backend's pipeline keeps for one operand's blocks
    (``BlockSpec(..., pipeline_mode=pl.Buffered(n))``).

    It changes when blocks are copied, never what a kernel computes: the interpreter ignores
    it; Mosaic TPU takes 1 or 2 buffers; backends without pipelines refuse it.
    """

    buffer_count: int
    use_lookahead: bool = False
    """Start fetching the next block that differs as soon as a buffer is free."""
    revisit: RevisitMode | None = None

    def __post_init__(self) -> None:
        if (not isinstance(self.buffer_count, (int, np.integer))
                or isinstance(self.buffer_count, bool) or self.buffer_count < 1):
            raise BlockSpecError(
                f"pl.Buffered(buffer_count={self.buffer_count!r}): expected a positive int. "
                "Fix: pl.Buffered(2) for double buffering, pl.Buffered(1) for one buffer.")
        if self.revisit is not None and not isinstance(self.revisit, RevisitMode):
            raise BlockSpecError(
                f"pl.Buffered(revisit={self.revisit!r}): expected a pl.RevisitMode "
                "(pl.RevisitMode.IMMEDIATE or pl.RevisitMode.ANY) or None.")


def _identity_index_map(*indices: Any) -> tuple[Any, ...]:
    return indices


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """How one operand is cut into blocks, and which block each grid step sees.

    ``block_shape`` has one entry per array dimension: an int or ``pl.Blocked(n)`` (the index
    map returns a *block* index, not an element offset), ``None``/``pl.squeezed`` (a dimension
    of size 1 that the kernel does not see), ``pl.Element(n, padding=...)`` (the index map
    returns an element offset) or ``pl.BoundedSlice(n)`` (the index map returns
    ``pl.ds(start, size)``). ``index_map(*grid_indices)`` returns one value per dimension.
    ``block_shape=None`` means the whole array.
    """

    block_shape: Sequence[int | BlockDim | None] | None = None
    index_map: Callable[..., Any] | None = None
    pipeline_mode: Buffered | None = None
    """How a backend's pipeline buffers this operand's blocks (see :class:`Buffered`)."""
    memory_space: MemorySpace | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.block_shape is not None:
            if isinstance(self.block_shape, int) or not isinstance(self.block_shape, Sequence):
                raise BlockSpecError(
                    f"BlockSpec.block_shape must be a tuple of ints/None, found "
                    f"{self.block_shape!r}. Fix: write block_shape=({self.block_shape!r},) "
                    "for a 1-D block."
                )
            # Blocked(n) means what n means: BlockMappings and pipelines see the int.
            object.__setattr__(self, "block_shape", tuple(
                d.block_size if isinstance(d, Blocked) else d for d in self.block_shape))
        if self.memory_space is not None and not isinstance(self.memory_space, MemorySpace):
            raise BlockSpecError(
                f"BlockSpec.memory_space must be a pl.MemorySpace (e.g. pl.ANY, or a backend's "
                f"such as pltpu.VMEM), found {self.memory_space!r}.")
        if self.pipeline_mode is not None and not isinstance(self.pipeline_mode, Buffered):
            hint = (" (memory_space is keyword-only, as in JAX: write memory_space=...)"
                    if isinstance(self.pipeline_mode, MemorySpace) else "")
            raise BlockSpecError(
                f"BlockSpec.pipeline_mode must be a pl.Buffered, found "
                f"{self.pipeline_mode!r}{hint}. Fix: pipeline_mode=pl.Buffered(2), or drop it.")
        if self.index_map is not None and not callable(self.index_map):
            raise BlockSpecError(
                f"BlockSpec.index_map must be callable, found {self.index_map!r}. "
                "Fix: pass a function of the grid indices, e.g. lambda i, j: (i, j)."
            )

    def replace(self, **changes: Any) -> BlockSpec:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


class _NoBlockSpec:
    def __repr__(self) -> str:
        return "no_block_spec"


no_block_spec: Any = _NoBlockSpec()
"""Marks that no BlockSpecs were given: every operand is passed whole."""


def is_dynamic_size(size: Any) -> bool:
    """``size`` is a grid size known only when the kernel runs: a JAX array (traced or not),
    or a symbolic dimension (``jax.export`` with shape polymorphism)."""
    return isinstance(size, jax.Array) or _jax.is_symbolic_dim(size)


def _grid_size(g: Any, grid: Any) -> Any:
    if _jax.is_symbolic_dim(g):
        return g
    if is_dynamic_size(g):
        if g.size != 1 or not jnp.issubdtype(g.dtype, jnp.integer):
            raise BlockSpecError(
                f"grid={grid!r} has a dynamic size of shape {g.shape} and dtype {g.dtype}; "
                "expected an integer scalar. Fix: pass e.g. jnp.int32(n) or a traced int32[].")
        return g
    if not isinstance(g, (int, np.integer)) or isinstance(g, bool) or g < 0:
        raise BlockSpecError(
            f"grid sizes must be non-negative ints or integer JAX scalars, found "
            f"grid={grid!r}. Fix: compute the grid with Python ints, e.g. pl.cdiv(n, block), "
            "or pass a jax.Array for a size known only at run time.")
    return int(g)


def _split_names(grid: tuple[Any, ...]) -> tuple[tuple[str, ...] | None, tuple[Any, ...]]:
    """``((name, size), ...)`` -> names and sizes; a grid of plain sizes has no names."""
    if not any(isinstance(g, (tuple, list)) for g in grid):
        return None, grid
    if not all(isinstance(g, (tuple, list)) and len(g) == 2 and isinstance(g[0], str)
               for g in grid):
        raise BlockSpecError(
            f"grid={grid!r} mixes named and unnamed axes, or names one with something other "
            "than a (name, size) pair. Fix: name every axis, e.g. grid=(('i', 2), ('j', 3)), "
            "or none.")
    names = tuple(g[0] for g in grid)
    if len(set(names)) != len(names):
        raise BlockSpecError(f"grid={grid!r} names an axis twice. Fix: give each axis its "
                             "own name.")
    return names, tuple(g[1] for g in grid)


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """The grid, the BlockSpecs of inputs and outputs, and scratch buffers of a ``pallas_call``.

    ``grid`` is an int, a tuple of sizes, or a tuple of ``(name, size)`` pairs (a named grid:
    ``jax.lax.axis_index(name)`` in the kernel is the step's index along that axis). A size may
    be a JAX integer scalar, traced or not (a dynamic grid: the number of steps is known only
    when the kernel runs, and ``pl.num_programs`` of that axis returns a traced value).
    """

    grid: Any = ()
    in_specs: Any = no_block_spec
    out_specs: Any = no_block_spec
    scratch_shapes: Any = ()
    num_scalar_prefetch: int = 0
    """The first ``num_scalar_prefetch`` operands are small integer arrays passed whole to the
    kernel (as its leading Refs) and to every index map (after the grid indices), so that
    blocks can be chosen by data: ``index_map(i, j, idx_ref) -> (idx_ref[i], j)``."""
    grid_names: tuple[str, ...] | None = dataclasses.field(default=None, init=False)
    """The axis names of a named grid (``None`` for a grid of plain sizes)."""

    def __post_init__(self) -> None:
        if self.grid is None:
            object.__setattr__(self, "grid", ())
        raw = self.grid
        if isinstance(raw, (int, np.integer)) or is_dynamic_size(raw):
            raw = (raw,)
        elif not isinstance(raw, (tuple, list)):
            raise BlockSpecError(
                f"grid={self.grid!r}: expected an int or a tuple of sizes (or of (name, size) "
                "pairs). Fix: e.g. grid=(4, 2).")
        names, sizes = _split_names(tuple(raw))
        object.__setattr__(self, "grid", tuple(_grid_size(g, self.grid) for g in sizes))
        object.__setattr__(self, "grid_names", names)
        if not isinstance(self.num_scalar_prefetch, int) or self.num_scalar_prefetch < 0:
            raise BlockSpecError(
                f"GridSpec.num_scalar_prefetch must be a non-negative int, found "
                f"{self.num_scalar_prefetch!r}.")
        if isinstance(self.in_specs, list):
            object.__setattr__(self, "in_specs", tuple(self.in_specs))
        if isinstance(self.out_specs, list):
            object.__setattr__(self, "out_specs", tuple(self.out_specs))


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """A hint to the compiler scheduling around a kernel."""

    flops: int
    transcendentals: int
    bytes_accessed: int
    remote_bytes_transferred: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise ArgumentError(
                    f"pl.CostEstimate({field.name}={value!r}): every field must be an int. "
                    f"Fix: {field.name}=int(...).")
            object.__setattr__(self, field.name, int(value))

    def to_json(self) -> bytes:
        """The estimate as the JSON object backends attach to their custom calls."""
        return (f'{{"flops": {self.flops}, "transcendentals": {self.transcendentals}, '
                f'"bytes_accessed": {self.bytes_accessed}, '
                f'"remote_bytes_transferred": {self.remote_bytes_transferred}}}').encode("ascii")


class CompilerParams(abc.ABC):
    """Base of each backend's frozen compiler parameters.

    A plugin subclasses this as a frozen dataclass and sets ``BACKEND`` to its name; passing
    an instance as ``compiler_params=`` selects that backend.
    """

    BACKEND: ClassVar[str]


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Named axes of cores that ``pl.kernel`` and ``pl.core_map`` run a body on.

    Each point of the mesh runs the body once; ``jax.lax.axis_index(name)`` gives its
    coordinate. ``backend`` is the backend the mesh belongs to (``None``: any backend).
    Plugins provide constructors for their hardware (e.g. ``pltpu.create_tensorcore_mesh``).
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    backend: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        object.__setattr__(self, "axis_sizes", tuple(self.axis_sizes))
        if not all(isinstance(n, str) for n in self.axis_names) or not all(
                isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0
                for s in self.axis_sizes):
            raise BlockSpecError(
                f"Mesh needs string axis names and positive int sizes, found "
                f"axis_names={self.axis_names!r}, axis_sizes={self.axis_sizes!r}.")
        if len(self.axis_names) != len(self.axis_sizes):
            raise BlockSpecError(
                f"Mesh has {len(self.axis_names)} axis names but {len(self.axis_sizes)} sizes; "
                "give one size per name."
            )

    def compiler_params_for(self, params: Any) -> Any:
        """The compiler parameters a kernel on this mesh runs with, given the user's (maybe
        ``None``). A backend's mesh may add what its lowering needs (the chip, say)."""
        return params

    @property
    def shape(self) -> Mapping[str, int]:
        """Axis name to size, in order."""
        return dict(zip(self.axis_names, self.axis_sizes))


