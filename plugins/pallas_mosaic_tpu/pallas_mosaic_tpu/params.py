"""The Mosaic TPU backend's compiler parameters, memory spaces and grid specs."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from pallas_core import GridSpec, MemoryRef, Mesh
from pallas_core.backend import CompilerParams as _CompilerParams
from pallas_core.backend import MemorySpace as CoreMemorySpace
from pallas_core.backend import PallasError, semaphore_dtype

NAME = "mosaic_tpu"


class GridDimensionSemantics(enum.Enum):
    """Whether the steps along a grid axis may run in parallel (on several cores)."""

    PARALLEL = "parallel"
    ARBITRARY = "arbitrary"
    CORE_PARALLEL = "core_parallel"
    SUBCORE_PARALLEL = "subcore_parallel"
    """Steps spread over the subcores of a SparseCore (as in JAX); the interpreter runs them
    like ``PARALLEL`` ones."""


PARALLEL = GridDimensionSemantics.PARALLEL
ARBITRARY = GridDimensionSemantics.ARBITRARY
CORE_PARALLEL = GridDimensionSemantics.CORE_PARALLEL
SUBCORE_PARALLEL = GridDimensionSemantics.SUBCORE_PARALLEL


class dma_semaphore(semaphore_dtype):  # noqa: N801 (JAX's name)
    """The dtype of DMA semaphores (``jax.experimental.pallas.tpu.dma_semaphore``): names the
    kind when allocating one, ``pltpu.SEMAPHORE((2,), pltpu.dma_semaphore)`` being
    ``SemaphoreType.DMA((2,))``. Semaphore Refs here hold int32 counts."""


class _MemorySpaceClass(type):
    """Makes :class:`MemorySpace` behave as JAX's enum: iteration over the members,
    ``MemorySpace["VMEM"]``, ``MemorySpace("vmem")``, ``len``, ``in``."""

    _members: dict[str, Any]

    def __iter__(cls) -> Iterator[Any]:
        return iter(cls._members.values())

    def __len__(cls) -> int:
        return len(cls._members)

    def __contains__(cls, item: object) -> bool:
        return any(item is m for m in cls._members.values())

    def __getitem__(cls, name: str) -> Any:
        return cls._members[name]

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], str):
            for member in cls._members.values():
                if args[0] in (member.value, member.name):
                    return member
            raise ValueError(f"{args[0]!r} is not a valid pltpu.MemorySpace: one of "
                             f"{[m.value for m in cls._members.values()]}.")
        return super().__call__(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class MemorySpace(CoreMemorySpace, metaclass=_MemorySpaceClass):
    """The TPU's memory spaces, as JAX's ``pltpu.MemorySpace`` enum: ``MemorySpace.VMEM``
    (also ``pltpu.VMEM``), ``VMEM_SHARED``, ``SMEM``, ``CMEM``, ``SEMAPHORE``, ``HBM``; each
    has JAX's ``value`` (``"vmem"``, ...) and is a ``pl.MemorySpace``.

    Use one as ``BlockSpec(memory_space=...)``, or call it to describe a scratch buffer:
    ``pltpu.VMEM((8, 128), jnp.float32)``, ``pltpu.SEMAPHORE((2,), pltpu.dma_semaphore)``,
    ``pltpu.VMEM.like(x)``. ``MemorySpace.ANY`` is ``pl.ANY``.
    """

    value: str = ""
    """JAX's value of the member (the Mosaic memory space it lowers to)."""

    @property
    def memory_kind(self) -> str:
        """Where XLA places arrays of this space (JAX's property): on the device."""
        return "device"

    def __call__(self, shape: Sequence[int], dtype: Any) -> MemoryRef:
        if isinstance(dtype, type) and issubclass(dtype, semaphore_dtype):
            space = DMA_SEMAPHORE if issubclass(dtype, dma_semaphore) else SEMAPHORE
            return MemoryRef(tuple(int(d) for d in shape), np.dtype(np.int32), space)
        return super().__call__(shape, dtype)

    def from_type(self, ty: Any) -> MemoryRef:
        """A buffer of ``ty`` (anything with ``shape`` and ``dtype``) in this space."""
        return self(ty.shape, ty.dtype)

    def like(self, x: Any) -> MemoryRef:
        """A buffer shaped like ``x`` (an array, aval or ``ShapeDtypeStruct``) here."""
        return self(x.shape, x.dtype)


def _member(name: str, value: str, **kw: Any) -> MemorySpace:
    return MemorySpace(name, backend=NAME, value=value, **kw)


VMEM = _member("VMEM", "vmem")
VMEM_SHARED = _member("VMEM_SHARED", "vmem_shared", shared=True)
"""VMEM that the subcores of one SparseCore share (one buffer per core); SparseCore kernels
(``pallas_sparsecore``) allocate it."""
SMEM = _member("SMEM", "smem")
CMEM = _member("CMEM", "cmem")
"""The common memory of chips that have one (v4, v5p); lowered as Mosaic's ``cmem`` space.
The interpreter treats it as any other buffer."""
SEMAPHORE = _member("SEMAPHORE", "semaphore_mem", zeroed=True)
HBM = _member("HBM", "hbm")
_MemorySpaceClass._members = {m.name: m for m in (VMEM, VMEM_SHARED, SMEM, CMEM, SEMAPHORE, HBM)}
for _m in _MemorySpaceClass._members.values():
    setattr(MemorySpace, _m.name, _m)
DMA_SEMAPHORE = CoreMemorySpace("DMA_SEMAPHORE", backend=NAME, zeroed=True)
"""Where DMA semaphores live (``SemaphoreType.DMA``); JAX tells them apart by dtype."""


class AccMemorySpace(CoreMemorySpace):
    """The accumulators of MXU ``mxu_id`` (``pltpu.ACC(mxu_id)``): call it with a shape and a
    dtype (float32 or int32, rank >= 2) for an accumulator Ref, in ``pl.run_scoped`` or as
    scratch. ``matmul_acc_lhs`` adds into it and ``matmul_pop`` reads and zeroes it; it starts
    at zero. Mosaic TPU gives it an address in the MXU's accumulator memory (chips with
    accumulators: TPU 7 and later), as JAX's lowering does; the interpreter keeps it as an
    ordinary buffer."""

    mxu_id: int

    def __init__(self, mxu_id: int) -> None:
        if isinstance(mxu_id, bool) or not isinstance(mxu_id, (int, np.integer)) or mxu_id < 0:
            raise PallasError(f"pltpu.ACC(mxu_id={mxu_id!r}): expected a non-negative int.")
        super().__init__(f"ACC{int(mxu_id)}", backend=NAME, zeroed=True)
        object.__setattr__(self, "mxu_id", int(mxu_id))

    def __call__(self, shape: Sequence[int], dtype: Any) -> MemoryRef:
        shape = tuple(int(d) for d in shape)
        if len(shape) < 2 or np.dtype(dtype) not in (np.float32, np.int32):
            raise PallasError(f"pltpu.ACC({self.mxu_id})({shape}, {np.dtype(dtype)}): an "
                              "accumulator is float32 or int32 of rank >= 2.")
        return super().__call__(shape, dtype)

    def __str__(self) -> str:
        return f"ACC(mxu_id={self.mxu_id})"


class SemaphoreType(enum.Enum):
    """Semaphore scratch: ``SemaphoreType.DMA`` (one), ``SemaphoreType.DMA((4,))`` (an array).

    Semaphores are int32 Refs that start at zero; ``REGULAR`` ones count signals, ``DMA`` ones
    the bytes of copies (``pltpu.async_copy``) started and not yet waited for.
    """

    REGULAR = "regular"
    DMA = "dma"

    def __call__(self, shape: tuple[int, ...] = ()) -> Any:
        space = DMA_SEMAPHORE if self is SemaphoreType.DMA else SEMAPHORE
        return space(tuple(shape), np.int32)

    def memory_ref(self) -> Any:
        """One semaphore (what ``pl.run_scoped`` and ``scratch_shapes`` allocate)."""
        return self(())


class SideEffectType(enum.Enum):
    """How XLA may treat a kernel's custom call (``CompilerParams(has_side_effects=...)``)."""

    PURE = "pure"
    """Deduplicated or removed when its results are unused (``has_side_effects=False``)."""
    DATAFLOW_SIDE_EFFECTING = "dataflow_side_effecting"
    """Never deduplicated, but removed when its results are unused."""
    SIDE_EFFECTING = "side_effecting"
    """Never deduplicated nor removed (``has_side_effects=True``)."""


class _Flags(Mapping[str, Any]):
    """A read-only, hashable mapping (``CompilerParams(flags=...)``)."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __repr__(self) -> str:
        return repr(self._items)


@dataclasses.dataclass(frozen=True)
class TPUCompilerParams(_CompilerParams):
    """Compiler parameters of the Mosaic TPU backend; passing them selects it.

    The fields of ``jax.experimental.pallas.tpu.CompilerParams``:
    ``dimension_semantics``: per grid axis, ``PARALLEL`` (or ``"parallel"``), ``ARBITRARY``
    or ``CORE_PARALLEL``; unset axes are arbitrary (sequential). ``vmem_limit_bytes``: the
    scoped VMEM the kernel may use. ``collective_id``: the barrier semaphore's id.
    ``has_side_effects``: ``True`` (or a :class:`SideEffectType`) keeps XLA from deduplicating
    (and, unless ``DATAFLOW_SIDE_EFFECTING``, removing) the kernel's custom call.
    ``allow_input_fusion`` (per input), ``flags`` (Mosaic compiler flags, name to bool, int or
    float), ``internal_scratch_in_bytes``, ``serialization_format``,
    ``disable_bounds_checks``, ``disable_semaphore_checks``, ``skip_device_barrier``,
    ``shape_invariant_numerics`` and ``needs_layout_passes`` go into the custom call's
    configuration as JAX writes them. ``allow_collective_id_without_custom_barrier``,
    ``use_tc_tiling_on_sc`` and ``fuse_transposed_lhs_in_matmul`` are accepted and change
    nothing in this lowering.
    """

    BACKEND: ClassVar[str] = NAME
    dimension_semantics: Sequence[Any] | None = None
    allow_input_fusion: Sequence[bool] | None = None
    vmem_limit_bytes: int | None = None
    collective_id: int | None = None
    """Names the barrier semaphore of kernels that use ``get_barrier_semaphore`` (kernels
    synchronising different groups of devices need different ids)."""
    has_side_effects: bool | SideEffectType = False
    flags: Mapping[str, Any] | None = None
    internal_scratch_in_bytes: int | None = None
    serialization_format: int = 1
    disable_bounds_checks: bool = False
    disable_semaphore_checks: bool = False
    skip_device_barrier: bool = False
    allow_collective_id_without_custom_barrier: bool = False
    shape_invariant_numerics: bool = True
    use_tc_tiling_on_sc: bool | None = None
    needs_layout_passes: bool = True
    fuse_transposed_lhs_in_matmul: bool = False

    def __post_init__(self) -> None:
        if self.dimension_semantics is not None:
            try:
                sem = tuple(GridDimensionSemantics(getattr(s, "value", s))
                            for s in self.dimension_semantics)
            except ValueError as e:
                raise PallasError(
                    f"CompilerParams(dimension_semantics={self.dimension_semantics!r}): each "
                    "entry must be PARALLEL, ARBITRARY or CORE_PARALLEL (or their names). Fix: "
                    "e.g. dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY).") from e
            object.__setattr__(self, "dimension_semantics", sem)
        cid = self.collective_id
        if cid is not None and (not isinstance(cid, int) or cid < 0):
            raise PallasError(f"CompilerParams(collective_id={cid!r}): expected a non-negative "
                              "int. Fix: e.g. collective_id=0.")
        limit = self.vmem_limit_bytes
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise PallasError(f"CompilerParams(vmem_limit_bytes={limit!r}): expected a positive "
                              "int. Fix: e.g. vmem_limit_bytes=32 * 2**20.")
        if not isinstance(self.has_side_effects, (bool, SideEffectType)):
            raise PallasError(
                f"CompilerParams(has_side_effects={self.has_side_effects!r}): expected a bool or "
                "a pltpu.SideEffectType. Fix: e.g. has_side_effects=True.")
        if self.allow_input_fusion is not None:
            object.__setattr__(self, "allow_input_fusion",
                               tuple(bool(b) for b in self.allow_input_fusion))
        if self.flags is not None:
            bad = [k for k, v in self.flags.items() if not isinstance(v, (bool, int, float))]
            if bad:
                raise PallasError(
                    f"CompilerParams(flags=...): flag {bad[0]!r} has value "
                    f"{self.flags[bad[0]]!r}; Mosaic flags are bools, ints or floats.")
            object.__setattr__(self, "flags", _Flags(self.flags))

    @property
    def side_effect_type(self) -> SideEffectType:
        """``has_side_effects`` as a :class:`SideEffectType`."""
        if isinstance(self.has_side_effects, SideEffectType):
            return self.has_side_effects
        return SideEffectType.SIDE_EFFECTING if self.has_side_effects else SideEffectType.PURE


def PrefetchScalarGridSpec(num_scalar_prefetch: int, grid: Any = (), in_specs: Any = None,
                           out_specs: Any = None, scratch_shapes: Any = ()) -> GridSpec:
    """A grid spec whose first ``num_scalar_prefetch`` operands go to SMEM, whole, and are
    passed to every index map (as in ``jax.experimental.pallas.tpu``)."""
    from pallas_core import no_block_spec

    return GridSpec(grid, no_block_spec if in_specs is None else in_specs,
                    no_block_spec if out_specs is None else out_specs, scratch_shapes,
                    num_scalar_prefetch=num_scalar_prefetch)


def create_tensorcore_mesh(axis_name: str, num_cores: int = 1) -> Mesh:
    """A mesh of ``num_cores`` TensorCores along ``axis_name`` for ``pl.kernel``/``core_map``
    (no device is queried: pass the chip's core count)."""
    if not isinstance(num_cores, int) or num_cores < 1:
        raise PallasError(f"create_tensorcore_mesh(num_cores={num_cores!r}): expected a positive "
                          "int (TensorCores per chip: 1 on v5e/v6e, 2 on v4/v5p).")
    return Mesh((axis_name,), (num_cores,), backend=NAME)


def sync_copy(src: Any, dst: Any, *, add: bool = False) -> None:
    """Copies ``src`` into ``dst`` with the DMA engine and waits (HBM and VMEM alike); with
    ``add`` (SparseCore), adds ``src`` into ``dst``."""
    from pallas_core import run_scoped
    from pallas_core.backend import async_copy

    run_scoped(lambda sem: async_copy(src, dst, sem, add=add).wait(), SemaphoreType.DMA)


def get_barrier_semaphore() -> Any:
    """The kernel's barrier semaphore, which neighbouring devices signal to say they are ready
    (``pl.semaphore_signal(sem, 1, device_id=...)``; then ``pl.semaphore_wait(sem, n)``).

    Needs ``CompilerParams(collective_id=...)``; wait it back to zero before the kernel ends.
    """
    from pallas_core.backend import barrier_semaphore

    return barrier_semaphore()


def async_remote_copy(src: Any, dst: Any, send_sem: Any, recv_sem: Any, device_id: Any,
                      device_id_type: Any = None) -> Any:
    """Starts copying ``src`` here into ``dst`` on device ``device_id``; returns the copy
    (``.wait_send()``, ``.wait_recv()``, or ``.wait()`` for both)."""
    from pallas_core.backend import DeviceIdType, make_async_remote_copy

    copy = make_async_remote_copy(src, dst, send_sem, recv_sem, device_id,
                                  device_id_type or DeviceIdType.MESH)
    copy.start()
    return copy
