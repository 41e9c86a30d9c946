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

import numpy as np

from pallas_core.errors import ArgumentError, BlockSpecError


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

    ANY: ClassVar[MemorySpace]

    def __call__(self, shape: Sequence[int], dtype: Any) -> MemoryRef:
        return MemoryRef(tuple(int(d) for d in shape), np.dtype(dtype), self)

    def __str__(self) -> str:
        return self.name if self.backend is None else f"{self.backend}.{self.name}"


ANY = MemorySpace("any")
"""Wherever the backend keeps whole arrays (HBM on TPU, global memory on GPU); no blocking."""
MemorySpace.ANY = ANY
BARRIER_SEMAPHORE = MemorySpace("barrier_semaphore", zeroed=True)
"""The kernel's barrier semaphore (``pltpu.get_barrier_semaphore()``): one int32 semaphore
shared by the kernel instances of one collective, which other devices signal."""


@dataclasses.dataclass(frozen=True)
class MemoryRef:
    """The shape, dtype and memory space of a scratch buffer (see ``MemorySpace.__call__``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    memory_space: MemorySpace | None = None


@dataclasses.dataclass(frozen=True)
class Squeezed:
    """A block dimension of size 1 that is dropped from the kernel's view of the block."""

    def __repr__(self) -> str:
        return "squeezed"


squeezed = Squeezed()


@dataclasses.dataclass(frozen=True)
class Blocked:
    """A block dimension of ``block_size`` elements, indexed by block (what an int means)."""

    block_size: int

    def __str__(self) -> str:
        return f"Blocked({self.block_size})"

    def __int__(self) -> int:
        return int(self.block_size)


BlockDim = Squeezed | Blocked
"""What a ``BlockSpec.block_shape`` entry may be besides an int or ``None``."""


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

    ``block_shape`` entries are ints, or ``None``/``pl.squeezed`` for a dimension of size 1
    that the kernel does not see. ``index_map(*grid_indices)`` returns one *block* index per
    array dimension (not an element offset). ``block_shape=None`` means the whole array.
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


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """The grid, the BlockSpecs of inputs and outputs, and scratch buffers of a ``pallas_call``."""

    grid: int | Sequence[int] = ()
    in_specs: Any = no_block_spec
    out_specs: Any = no_block_spec
    scratch_shapes: Any = ()
    num_scalar_prefetch: int = 0
    """The first ``num_scalar_prefetch`` operands are small integer arrays passed whole to the
    kernel (as its leading Refs) and to every index map (after the grid indices), so that
    blocks can be chosen by data: ``index_map(i, j, idx_ref) -> (idx_ref[i], j)``."""

    def __post_init__(self) -> None:
        if self.grid is None:
            object.__setattr__(self, "grid", ())
        grid = (self.grid,) if isinstance(self.grid, int) else tuple(self.grid)
        for g in grid:
            if not isinstance(g, (int, np.integer)) or isinstance(g, bool) or g < 0:
                raise BlockSpecError(
                    f"grid sizes must be non-negative ints, found grid={self.grid!r}. "
                    "Fix: compute the grid with Python ints, e.g. pl.cdiv(n, block)."
                )
        object.__setattr__(self, "grid", tuple(int(g) for g in grid))
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


