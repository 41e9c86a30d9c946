"""The Mosaic GPU backend's compiler parameters, memory spaces, scratch types and meshes."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import MemoryRef
from pallas_core.backend import CompilerParams as _CompilerParams
from pallas_core.backend import MemorySpace, PallasError, UnsupportedError

NAME = "mosaic_gpu"

GMEM = MemorySpace("GMEM", backend=NAME)
"""Global memory: whole arrays, read and written by TMA copies (or directly)."""


@dataclasses.dataclass(frozen=True)
class SharedMemorySpace(MemorySpace):
    """Shared memory (``plgpu.SMEM``); its scratch buffers take JAX's ``transforms=``."""

    tiled: bool = False
    """Buffers of an 8-bit or 32-bit dtype whose ``transforms`` asked for the tiled, 128-byte
    swizzled layout (``pallas_mosaic_gpu.transforms.asked_layout``); such buffers are
    otherwise plain. The space carries it so that the kernel's scratch avals keep it."""

    def __call__(self, shape: Sequence[int], dtype: Any, *,
                 transforms: Sequence[Any] = ()) -> MemoryRef:
        """A scratch buffer of ``shape`` and ``dtype``; ``transforms`` (``TilingTransform``,
        ``SwizzleTransform``) are checked against the layout the backend gives it."""
        from pallas_mosaic_gpu.transforms import check_transforms

        ref = super().__call__(shape, dtype)
        if check_transforms(tuple(transforms), ref.shape, ref.dtype,
                            f"plgpu.SMEM({ref.shape}, {ref.dtype.name})"):
            return MemorySpace.__call__(TILED_SMEM, ref.shape, ref.dtype)
        return ref


SMEM = SharedMemorySpace("SMEM", backend=NAME, shared=True)
"""Shared memory of one thread block: pipelined blocks and scratch buffers."""
TILED_SMEM = SharedMemorySpace("SMEM", backend=NAME, shared=True, tiled=True)
"""SMEM of an 8-bit or 32-bit buffer whose ``transforms`` ask for the tiled layout."""


def asks_tiling(mref: Any) -> bool:
    """Whether a scratch buffer (a ``MemoryRef`` or a Ref's aval) is in :data:`TILED_SMEM`."""
    return bool(getattr(getattr(mref, "memory_space", None), "tiled", False))
@dataclasses.dataclass(frozen=True)
class TensorMemorySpace(MemorySpace):
    """Tensor memory (``plgpu.TMEM``); its scratch buffers take JAX's keyword arguments."""

    collective: bool = False
    """Allocated by the two blocks of a cluster together (``cta_group::2``), as the
    accumulator of collective ``tcgen05_mma`` needs; each block still sees its own rows."""

    layout: str | None = None
    """The name of the buffer's ``plgpu.TMEMLayout`` member (``"SCALES_LAYOUT"``,
    ``"SPARSE_METADATA_LAYOUT"``, ``"M64_COLLECTIVE_LAYOUT"``), or ``None`` for the library's
    layout of the buffer's shape (:func:`tmem_layout`)."""

    layout_args: tuple[int, ...] = ()
    """The arguments of a parameterised layout (``M64_COLLECTIVE_LAYOUT(columns, packing)``)."""

    packing: int = 1
    """Elements per 32-bit TMEM column: 1, or ``32 // bits`` for a ``packed=True`` buffer of a
    narrower dtype (the layout a 16-bit or 8-bit ``a`` of ``tcgen05_mma`` must have)."""

    def __call__(self, shape: Sequence[int], dtype: Any, *, transforms: Sequence[Any] = (),
                 packed: bool | None = None, collective: bool | None = None,
                 layout: Any = None) -> MemoryRef:
        """A TMEM buffer of ``shape`` (rows: 128, or 64 for the M=64 matmuls; columns);
        ``collective``: allocated by the two blocks of a cluster together, for collective
        ``tcgen05_mma``. A dtype narrower than 32 bits needs ``packed``: ``True`` puts
        ``32 // bits`` elements in each column (as ``a`` of ``tcgen05_mma`` must be), ``False``
        one. ``layout``: ``plgpu.TMEMLayout.SCALES_LAYOUT`` (block-scaling factors of a scaled
        ``tcgen05_mma``: float8_e8m0fnu or float8_e4m3fn, (MN, K // block)),
        ``SPARSE_METADATA_LAYOUT`` (2:4 sparsity metadata: uint2, (M, K // 2)) or
        ``M64_COLLECTIVE_LAYOUT(columns, packing=1)`` (64 rows of a collective M=128 matmul,
        the layout such a buffer gets anyway). ``SCALES_M64_COLLECTIVE_LAYOUT`` is refused."""
        shape = tuple(shape)
        what = f"plgpu.TMEM({shape}, {np.dtype(dtype).name})"
        if transforms:
            raise PallasError(f"{what}: TMEM buffers take no transforms. Fix: drop them.")
        if len(shape) != 2:
            raise UnsupportedError(f"{what}: TMEM buffers here are 2-D (rows, columns). Fix: "
                                   "e.g. plgpu.TMEM((128, 128), jnp.float32).")
        bits = _bits(dtype)
        if layout is not None:
            if packed is not None:
                raise PallasError(f"{what}: packed= and layout= together; a layout says how "
                                  "the buffer is packed. Fix: drop packed=.")
            name, args = _tmem_layout_name(layout, what)
            if name == "M64_COLLECTIVE_LAYOUT":
                args = _check_m64_layout(args, shape, bits, what)
            else:
                _check_tmem_layout(name, shape, dtype, what)
            space = dataclasses.replace(self, collective=bool(collective), layout=name,
                                        layout_args=args,
                                        packing=args[1] if args else 1)
            return MemorySpace.__call__(space, shape, dtype)
        if bits < 32 and packed is None:
            raise PallasError(f"{what}: a TMEM buffer of a dtype narrower than 32 bits needs "
                              "packed= (True: 32 // bits elements per column, as a tcgen05_mma "
                              "operand must be; False: one) or layout=. Fix: pass packed=True.")
        packing = 32 // bits if packed and bits < 32 else 1
        if bits > 32 or packing > 8 or shape[0] not in (64, 128) or shape[1] % packing:
            raise UnsupportedError(
                f"{what}{' packed' if packing > 1 else ''}: TMEM buffers have 128 rows (or 64, "
                f"for M=64 matmuls), elements of at most 32 bits and columns a multiple of "
                f"{packing} (the elements per column). Fix: e.g. plgpu.TMEM((128, 128), "
                "jnp.float32).")
        space = TMEM_COLLECTIVE if collective else TMEM
        if packing != 1:
            space = dataclasses.replace(space, packing=packing)
        return MemorySpace.__call__(space, shape, dtype)


def _bits(dtype: Any) -> int:
    from pallas_mosaic_gpu.values import bits

    return bits(dtype)


def tmem_layout(space: TensorMemorySpace, shape: tuple[int, ...]) -> Any:
    """The Mosaic GPU library's TMEM layout of a buffer of ``shape`` in ``space``: the named
    layout, or the one the library infers for the shape, collectiveness and packing (as JAX's
    ``plgpu.TMEM`` chooses)."""
    from jax.experimental.mosaic.gpu import tcgen05

    if space.layout is not None:
        make = {"SCALES_LAYOUT": tcgen05.scales_layout,
                "SPARSE_METADATA_LAYOUT": tcgen05.sparse_meta_layout,
                "M64_COLLECTIVE_LAYOUT": tcgen05.tmem_m64_collective_layout}[space.layout]
        return make(*space.layout_args)
    return tcgen05._infer_tmem_layout(tuple(shape), space.collective, space.packing)


TMEM_LAYOUTS = {"SCALES_LAYOUT": (("float8_e8m0fnu", "float8_e4m3fn"), 4),
                "SPARSE_METADATA_LAYOUT": (("uint2",), 64)}
"""The TMEM layouts of scales and metadata: their dtypes, and the multiple their columns must
be (the rows one of 128, the lanes of TMEM)."""

NAMED_LAYOUTS = (*TMEM_LAYOUTS, "M64_COLLECTIVE_LAYOUT")
"""The ``plgpu.TMEMLayout`` members ``plgpu.TMEM(layout=)`` takes."""


def _tmem_layout_name(layout: Any, what: str) -> tuple[str, tuple[Any, ...]]:
    """The member name of a ``plgpu.TMEMLayout`` (called or not) and its arguments."""
    member = getattr(layout, "layout", layout)
    name = getattr(member, "name", None)
    if type(member).__name__ != "TMEMLayout" or name is None:
        raise PallasError(f"{what}: layout={layout!r} is not a plgpu.TMEMLayout. Fix: pass "
                          "plgpu.TMEMLayout.SCALES_LAYOUT or SPARSE_METADATA_LAYOUT, or no "
                          "layout for 32-bit data.")
    if name not in NAMED_LAYOUTS:
        raise UnsupportedError(
            f"{what}: layout=plgpu.TMEMLayout.{name} (the B scales of a block-scaled "
            "collective matmul with M=64 per block) is not supported by the mosaic_gpu "
            "backend, which refuses scales with collective_axis=. Fix: use blocks of 128 rows, "
            f"with {' or '.join(NAMED_LAYOUTS)}.")
    args, kwargs = tuple(getattr(layout, "args", ())), dict(getattr(layout, "kwargs", {}))
    if name == "M64_COLLECTIVE_LAYOUT":
        if layout is member:
            raise PallasError(f"{what}: layout=plgpu.TMEMLayout.M64_COLLECTIVE_LAYOUT takes the "
                              "number of columns. Fix: M64_COLLECTIVE_LAYOUT(columns).")
        return str(name), (*args, *kwargs.values())
    if args or kwargs:
        raise PallasError(f"{what}: layout={layout!r} takes no arguments. Fix: pass the "
                          "member itself, e.g. plgpu.TMEMLayout.SCALES_LAYOUT.")
    return str(name), ()


def _check_m64_layout(args: tuple[Any, ...], shape: tuple[int, ...], bits: int, what: str
                      ) -> tuple[int, int]:
    """``M64_COLLECTIVE_LAYOUT(columns, packing=1)`` for a (64, columns) buffer."""
    if not 1 <= len(args) <= 2:
        raise PallasError(f"{what}: M64_COLLECTIVE_LAYOUT(columns, packing=1) takes one or two "
                          f"arguments, found {args}.")
    columns, packing = int(args[0]), int(args[1]) if len(args) == 2 else 1
    if shape != (64, columns) or columns % 16 or packing not in (1, 32 // bits) or \
            packing > 8:
        raise PallasError(f"{what}: M64_COLLECTIVE_LAYOUT({columns}, {packing}) lays out 64 "
                          "rows by `columns` (a multiple of 16) columns, with 1 or 32 // bits "
                          "elements per column. Fix: allocate (64, columns).")
    return columns, packing


def _check_tmem_layout(name: str, shape: tuple[int, ...], dtype: Any, what: str) -> None:
    dtypes, cols = TMEM_LAYOUTS[name]
    if np.dtype(dtype).name not in dtypes:
        raise PallasError(f"{what}: a TMEM buffer of {name} holds {' or '.join(dtypes)}, "
                          f"found {np.dtype(dtype).name}. Fix: allocate it with that dtype.")
    if len(shape) != 2 or shape[0] % 128 or shape[1] % cols:
        raise PallasError(f"{what}: a TMEM buffer of {name} is 2-D, its rows a multiple of "
                          f"128 and its columns of {cols}; found shape {shape}. Fix: pad it.")


TMEM = TensorMemorySpace("TMEM", backend=NAME, shared=True)
"""Tensor memory (Blackwell, sm_100a): kernels that allocate it are built for sm_100a."""
TMEM_COLLECTIVE = TensorMemorySpace("TMEM", backend=NAME, shared=True, collective=True)
"""TMEM allocated by the two blocks of a cluster together (``plgpu.TMEM(collective=True)``)."""
ACC_SPACE = MemorySpace("ACC", backend=NAME, zeroed=True)
"""Warpgroup-matmul accumulators held in registers (see :func:`ACC`)."""


SEMAPHORE = MemorySpace("GMEM_SEMAPHORE", backend=NAME, zeroed=True, per_point=True)
"""GPU semaphores: int32 counters in global memory, zero when the kernel starts, that other
blocks and devices signal (``plgpu.SemaphoreType.REGULAR``)."""


class SemaphoreType(enum.Enum):
    """Semaphore scratch: ``SemaphoreType.REGULAR`` (one), ``SemaphoreType.REGULAR((4,))``
    (an array). Each thread block of a ``plgpu.kernel`` has its own; they live in global
    memory (an operand of the kernel's call, zeroed before it), so that other devices can
    signal them (``plgpu.semaphore_signal_multicast``, ``pl.semaphore_signal(device_id=)``).
    JAX's ``BARRIER`` kind is refused."""

    REGULAR = "regular"
    BARRIER = "barrier"

    def __call__(self, shape: Sequence[int] = ()) -> MemoryRef:
        if self is SemaphoreType.BARRIER:
            from pallas_core.backend import UnsupportedError

            raise UnsupportedError(
                "plgpu.SemaphoreType.BARRIER (the barrier semaphore of JAX's Mosaic GPU "
                "backend) is not supported by the mosaic_gpu backend. Fix: use "
                "plgpu.SemaphoreType.REGULAR and signal it yourself.")
        return SEMAPHORE(tuple(int(d) for d in shape), np.int32)

    def memory_ref(self) -> MemoryRef:
        """One semaphore (what ``scratch_types`` and ``pl.run_scoped`` allocate)."""
        return self(())


@dataclasses.dataclass(frozen=True)
class BarrierSpace(MemorySpace):
    """Where mbarriers live (shared memory); each barrier completes a phase after
    ``num_arrivals`` arrivals. The interpreter counts completed phases in an int32."""

    num_arrivals: int = 1
    orders_tensor_core: bool = False
    """Waits and arrivals also order tcgen05 work (``tcgen05.fence``), as Blackwell needs of
    barriers that tcgen05 matmuls complete."""
    shared: bool = True  # one per block, for all its warpgroups
    collective_axes: tuple[str, ...] = ()
    """Cluster axes of a ``plgpu.ClusterBarrier``: an arrival reaches the barrier of every
    block of the cluster along them, and a phase completes after ``num_arrivals`` arrivals
    from each of those blocks."""
    leader_tracked: bool = False
    """A ``ClusterBarrier(leader_tracked=True)``: arrivals reach the first block's only."""


LANE = "lane"


class LoweringSemantics(enum.Enum):
    """How JAX's Mosaic GPU lowering treats array values: ``Lane`` (each thread holds its part
    of a warpgroup's array, the layouts chosen by the lowering) or ``Warpgroup`` (arrays are
    the warpgroup's, their layouts inferred by a pass over Mosaic GPU's dialect).

    Both describe the same kernel: the body says what a warpgroup computes on whole arrays,
    and the results do not depend on how the arrays are spread over threads. This backend
    always lowers as ``Lane`` with the layouts it chooses itself, so either member is
    accepted for ``CompilerParams(lowering_semantics=...)`` and lowers the same way.
    """

    Lane = "lane"
    Warpgroup = "warpgroup"
SEQUENTIAL = "sequential"
PARALLEL = "parallel"
_SEMANTICS = {"parallel": PARALLEL, "sequential": SEQUENTIAL, "arbitrary": SEQUENTIAL}


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The launch of a ``plgpu.kernel``: a grid (``grid``, named by ``grid_names``) of clusters
    of ``cluster`` thread blocks (one block each without ``cluster``), and ``num_threads``
    warpgroups per block (named ``thread_name``). The CUDA grid is ``grid * cluster``. Its
    axes are read with ``jax.lax.axis_index(name)``."""

    grid: tuple[int, ...] = ()
    grid_names: tuple[str, ...] = ()
    cluster: tuple[int, ...] = ()
    cluster_names: tuple[str, ...] = ()
    num_threads: int | None = None
    thread_name: str | None = None

    def pallas_mesh(self) -> Any:
        """This launch as the core's mesh, for ``pl.kernel(mesh=plgpu.Mesh(...))`` and
        ``pl.core_map(plgpu.Mesh(...))`` (as ``plgpu.kernel`` runs it)."""
        return _kernel_mesh(self)

    def __post_init__(self) -> None:
        for field in ("grid", "grid_names", "cluster", "cluster_names"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        if len(self.grid) > 3 or len(self.cluster) > 3:
            raise PallasError(f"plgpu.kernel(grid={self.grid}, cluster={self.cluster}): a CUDA "
                              "launch has at most 3 grid and 3 cluster dimensions. Fix: fold "
                              "axes together (e.g. grid=(b * h, n)).")
        if self.grid_names and len(self.grid_names) != len(self.grid):
            raise PallasError(f"plgpu.kernel: grid_names={self.grid_names} names "
                              f"{len(self.grid_names)} axes but grid={self.grid} has "
                              f"{len(self.grid)}. Fix: one name per grid axis.")
        if len(self.cluster_names) != len(self.cluster):
            raise PallasError(f"plgpu.kernel: cluster_names={self.cluster_names} must name each "
                              f"of the {len(self.cluster)} cluster axes.")
        if len(self.cluster) > max(len(self.grid), 1):
            raise PallasError(f"plgpu.kernel(grid={self.grid}, cluster={self.cluster}): give a "
                              "grid dimension for each cluster dimension.")
        if (self.num_threads is None) != (self.thread_name is None):
            raise PallasError("plgpu.kernel: give num_threads and thread_name together (the "
                              "number of warpgroups per block and the axis that indexes them).")
        if self.num_threads is not None and not 1 <= self.num_threads <= 4:
            raise PallasError(f"plgpu.kernel(num_threads={self.num_threads}): a block runs 1 "
                              "to 4 warpgroups of 128 threads. Fix: num_threads in [1, 4].")

    @property
    def names(self) -> tuple[str, ...]:
        """The mesh axes the core sees: grid axes, then cluster axes, then the thread axis."""
        grid = self.grid_names or tuple(f"_grid{i}" for i in range(max(len(self.grid),
                                                                        bool(self.cluster))))
        thread = (self.thread_name,) if self.thread_name is not None else ()
        return (*grid, *self.cluster_names, *thread)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes of :attr:`names`."""
        grid = tuple(self.grid) or ((1,) if self.cluster else ())
        thread = (self.num_threads,) if self.num_threads is not None else ()
        return (*grid, *self.cluster, *thread)


class TraceScope(enum.Enum):
    """What one record of JAX's in-kernel profiler covers (``CompilerParams(
    profile_trace_scope=...)``): a warp or a warpgroup. Profiling never changes results."""

    WARP = "warp"
    WARPGROUP = "warpgroup"


@dataclasses.dataclass(frozen=True)
class GPUCompilerParams(_CompilerParams):
    """Compiler parameters of the Mosaic GPU backend; passing them selects it.

    * ``dimension_semantics``: per grid axis ``"parallel"`` (a CUDA grid dimension) or
      ``"sequential"``/``"arbitrary"`` (a loop inside each thread block, its input blocks
      pipelined with TMA). Sequential axes come last. Unset: every axis along which some
      output block is revisited is sequential, the others parallel.
    * ``max_concurrent_steps``: how many steps of the sequential loop have their input blocks
      in flight (buffers per input); 1 means no overlap.
    * ``delay_release``: steps to keep an input buffer after its step (for ``wgmma`` that is
      still reading it); must be below ``max_concurrent_steps``.
    * ``lowering_semantics``: a :class:`LoweringSemantics` (or ``"lane"``/``"warpgroup"``);
      both lower alike here (see :class:`LoweringSemantics`) and are stored as ``"lane"``.
    * ``approx_math``: use the GPU's fast approximate ``exp``/``log``/``tanh``.
    * ``mesh``: set by :func:`kernel` (the launch of a ``plgpu.kernel``).
    * ``profile_space``, ``profile_dir``, ``profile_trace_scope`` (a :class:`TraceScope`):
      JAX's in-kernel profiler; ``profile_space`` must stay 0 (no profiler here), the other
      two are checked and change nothing.
    """

    BACKEND: ClassVar[str] = NAME
    dimension_semantics: Sequence[str] | None = None
    max_concurrent_steps: int = 1
    delay_release: int = 0
    lowering_semantics: str = LANE
    approx_math: bool = False
    mesh: Mesh | None = None
    profile_space: int = 0
    profile_dir: str = ""
    profile_trace_scope: TraceScope = TraceScope.WARPGROUP

    def __post_init__(self) -> None:
        if not isinstance(self.profile_trace_scope, TraceScope):
            raise PallasError(f"plgpu.CompilerParams(profile_trace_scope="
                              f"{self.profile_trace_scope!r}): expected plgpu.TraceScope.WARP "
                              "or plgpu.TraceScope.WARPGROUP.")
        if self.profile_space != 0:
            raise UnsupportedError(f"plgpu.CompilerParams(profile_space={self.profile_space!r})"
                                   ": the mosaic_gpu backend has no in-kernel profiler. Fix: "
                                   "drop profile_space and profile the kernel with "
                                   "jax.profiler.")
        if self.dimension_semantics is not None:
            sem = []
            for s in self.dimension_semantics:
                key = str(getattr(s, "value", s)).lower()
                if key not in _SEMANTICS:
                    raise PallasError(
                        f"plgpu.CompilerParams(dimension_semantics={self.dimension_semantics!r})"
                        f": each entry must be 'parallel', 'sequential' or 'arbitrary', found "
                        f"{s!r}. Fix: e.g. dimension_semantics=('parallel', 'sequential').")
                sem.append(_SEMANTICS[key])
            object.__setattr__(self, "dimension_semantics", tuple(sem))
        steps = self.max_concurrent_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise PallasError(f"plgpu.CompilerParams(max_concurrent_steps={steps!r}): expected "
                              "an int >= 1 (1: no overlap; 2: double buffering).")
        delay = self.delay_release
        if not isinstance(delay, int) or isinstance(delay, bool) or not 0 <= delay < steps:
            raise PallasError(f"plgpu.CompilerParams(delay_release={delay!r}): expected an int "
                              f"in [0, max_concurrent_steps={steps}). Fix: raise "
                              "max_concurrent_steps or lower delay_release.")
        ls = self.lowering_semantics
        name = ls.name if isinstance(ls, enum.Enum) else ls  # JAX's enum is accepted too
        if not isinstance(name, str) or name.lower() not in ("lane", "warpgroup"):
            raise PallasError(
                f"plgpu.CompilerParams(lowering_semantics={ls!r}): expected "
                "plgpu.LoweringSemantics.Lane or .Warpgroup (or 'lane'/'warpgroup').")
        object.__setattr__(self, "lowering_semantics", LANE)


CompilerParams = GPUCompilerParams


def _check_acc(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2 or shape[0] % 64 or shape[1] % 8 or shape[1] > 256:
        raise PallasError(f"plgpu.ACC({shape}): an accumulator is (M, N) with M a multiple of "
                          "64 and N a multiple of 8, at most 256. Fix: e.g. ACC((64, 128)).")
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32)):
        raise PallasError(f"plgpu.ACC(dtype={np.dtype(dtype)}): accumulators are float32, "
                          "float16 or int32.")
    return shape


@dataclasses.dataclass(frozen=True)
class AccumulatorInit:
    """``plgpu.ACC.init(value)``: an accumulator that starts at ``value``, for
    ``pl.run_state(f)(...)``, which gives ``f`` the accumulator Ref and returns its final
    value (after the wgmma ``f`` issued have finished)."""

    value: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> Any:
        return self.value.dtype


def _acc_init_aval(init: AccumulatorInit) -> tuple[Any, Any]:
    from pallas_core import backend as plb

    return plb.make_ref_aval(init.shape, init.dtype, ACC_SPACE), init.value


class _Accumulator:
    """``plgpu.ACC((M, N), dtype)``: a ``wgmma`` accumulator held in registers and zero at
    the start, for ``scratch_shapes`` and ``pl.run_scoped``; read it with ``acc_ref[...]``
    (which waits for pending wgmma). ``plgpu.ACC.init(value)`` starts one at ``value``, for
    ``pl.run_state``."""

    def __call__(self, shape: Sequence[int], dtype: Any = jnp.float32) -> MemoryRef:
        return ACC_SPACE(_check_acc(shape, dtype), dtype)

    @staticmethod
    def init(value: Any) -> AccumulatorInit:
        """An accumulator starting at ``value`` (an (M, N) array), for ``pl.run_state``."""
        value = jnp.asarray(value)
        _check_acc(value.shape, value.dtype)
        return AccumulatorInit(value)

    def __repr__(self) -> str:
        return "plgpu.ACC"


ACC = _Accumulator()


def _register_acc_init() -> None:
    from pallas_core import backend as plb

    plb.register_initial_ref(AccumulatorInit, _acc_init_aval)


_register_acc_init()


DEFAULT_NUM_BARRIERS = 1
"""``plgpu.Barrier()``'s size: one barrier in an array of shape ``(1,)``, as in JAX 0.10. JAX
0.11 made the default shape ``()``. A one-barrier array may be passed to ``barrier_wait`` and
the copies without an index, so kernels written for either JAX run here; ``bar.at[0]`` of a
default barrier also works here, where JAX 0.11 and later refuse it."""


@dataclasses.dataclass(frozen=True)
class Barrier:
    """``num_barriers`` mbarriers in shared memory, each completing a phase after
    ``num_arrivals`` arrivals (``plgpu.barrier_arrive``) or, for barriers given to
    ``copy_gmem_to_smem``, once the copy's bytes have landed.

    ``num_barriers`` is the shape of the barrier array, as in JAX 0.11 and later: an int ``n``
    is ``(n,)``, a tuple is a shape (``()``: one barrier, its Ref indexed by nothing;
    ``(2, 3)``: indexed ``bar.at[i, j]``). The default, ``1``, is JAX 0.10's (see
    ``DEFAULT_NUM_BARRIERS``). A barrier array of one barrier may be passed to ``barrier_wait``
    and the copies without indexing it.

    ``num_threads=`` is an older spelling of ``num_arrivals`` and means the same.
    ``orders_tensor_core=True`` (Blackwell) makes waits and arrivals order tcgen05 work too;
    barriers given to ``tcgen05_mma`` and ``tcgen05_commit_arrive`` need it.
    """

    num_arrivals: int = 1
    num_barriers: int | tuple[int, ...] = DEFAULT_NUM_BARRIERS
    num_threads: dataclasses.InitVar[int | None] = None
    orders_tensor_core: bool = False

    def __post_init__(self, num_threads: int | None) -> None:
        if num_threads is not None:
            object.__setattr__(self, "num_arrivals", num_threads)
        _check_counts(self, "Barrier")

    def memory_ref(self) -> MemoryRef:
        """The scratch description (``pl.run_scoped`` and ``scratch_shapes`` take it)."""
        return _barriers(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterBarrier:
    """``num_barriers`` mbarriers shared by the blocks of a cluster along ``collective_axes``
    (cluster axes of the ``plgpu.kernel``): each block has its own, and an arrival
    (``plgpu.barrier_arrive``, once per warpgroup) reaches the barrier of every block along
    those axes, so a phase completes once each of them has arrived ``num_arrivals`` times.
    ``leader_tracked=True``: arrivals reach only the first block's barrier along the (one)
    axis. ``orders_tensor_core`` as for :class:`Barrier`. The interpreter runs the blocks of a
    cluster together where a kernel uses it (:mod:`pallas_mosaic_gpu.cluster`)."""

    collective_axes: tuple[str, ...]
    num_barriers: int | tuple[int, ...] = DEFAULT_NUM_BARRIERS
    num_arrivals: int = 1
    orders_tensor_core: bool = False
    leader_tracked: bool = False

    def __post_init__(self) -> None:
        axes = self.collective_axes
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if not axes or not all(isinstance(a, str) for a in axes):
            raise PallasError(f"plgpu.ClusterBarrier(collective_axes={self.collective_axes!r}):"
                              " expected one or more cluster axis names (str). Fix: e.g. "
                              "collective_axes=('x',) for plgpu.kernel(cluster_names=('x',)).")
        if self.leader_tracked and len(axes) != 1:
            raise PallasError(f"plgpu.ClusterBarrier(collective_axes={axes}, leader_tracked="
                              "True): a leader-tracked barrier has one collective axis.")
        object.__setattr__(self, "collective_axes", axes)
        _check_counts(self, "ClusterBarrier")

    def memory_ref(self) -> MemoryRef:
        """The scratch description (``pl.run_scoped`` and ``scratch_shapes`` take it)."""
        return _barriers(self, collective_axes=self.collective_axes,
                         leader_tracked=bool(self.leader_tracked))


def _check_counts(barrier: Any, what: str) -> None:
    v = barrier.num_arrivals
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise PallasError(f"plgpu.{what}(num_arrivals={v!r}): expected an int >= 1.")
    n = barrier.num_barriers
    dims = (n,) if isinstance(n, (int, np.integer)) and not isinstance(n, bool) else n
    if not isinstance(dims, (tuple, list)) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1
            for d in dims):
        raise PallasError(f"plgpu.{what}(num_barriers={n!r}): expected an int >= 1 or a "
                          "shape (a tuple of ints >= 1; () for one barrier).")


def barrier_shape(barrier: Any) -> tuple[int, ...]:
    """The shape of the barrier array of a :class:`Barrier` or :class:`ClusterBarrier`."""
    n = barrier.num_barriers
    return (int(n),) if isinstance(n, (int, np.integer)) else tuple(int(d) for d in n)


def _barriers(barrier: Any, **space: Any) -> MemoryRef:
    """The scratch of ``barrier`` (a :class:`Barrier` or :class:`ClusterBarrier`)."""
    kind = BarrierSpace("BARRIER", backend=NAME, zeroed=True, num_arrivals=barrier.num_arrivals,
                        orders_tensor_core=bool(barrier.orders_tensor_core), **space)
    return kind(barrier_shape(barrier), np.int32)


def _kernel_mesh(mesh: Mesh) -> Any:
    """The core's mesh of the blocks (and warpgroups) of ``mesh``, whose kernels get
    ``plgpu.CompilerParams`` naming ``mesh``."""
    from pallas_core import Mesh as CoreMesh

    @dataclasses.dataclass(frozen=True)
    class KernelMesh(CoreMesh):
        def compiler_params_for(self, params: Any) -> Any:
            if params is not None and not isinstance(params, GPUCompilerParams):
                raise PallasError(f"a kernel on a plgpu.Mesh takes plgpu.CompilerParams, found "
                                  f"{type(params).__name__}. Fix: pass plgpu.CompilerParams, "
                                  "or choose another backend with backend=.")
            return dataclasses.replace(params or GPUCompilerParams(), mesh=mesh)

    names, sizes = mesh.names, mesh.sizes
    if not names:  # a single block: a mesh of one point
        names, sizes = ("_grid0",), (1,)
    return KernelMesh(names, sizes, backend=NAME)


def kernel(body: Callable[..., None] | None = None, out_shape: Any = None, *,
           scratch_shapes: Any = (), compiler_params: GPUCompilerParams | None = None,
           grid: Sequence[int] = (), grid_names: Sequence[str] = (),
           cluster: Sequence[int] = (), cluster_names: Sequence[str] = (),
           num_threads: int | None = None, thread_name: str | None = None,
           name: str | None = None, backend: str | None = None, interpret: Any = False,
           out_type: Any = None, scratch_types: Any = None, kernel_name: str | None = None,
           **kwargs: Any) -> Any:
    """Runs ``body(*in_refs, *out_refs, *scratch_refs)`` on every thread block of ``grid``
    (and every warpgroup of a block with ``num_threads``). Inputs and outputs are whole
    arrays in ``GMEM``; ``jax.lax.axis_index(name)`` reads a grid, cluster or thread axis.
    ``out_type`` and ``scratch_types`` are JAX's newer names of ``out_shape`` and
    ``scratch_shapes``, ``kernel_name`` (a field of JAX's ``plgpu.Mesh``) that of ``name``.
    Usable directly or as a decorator factory."""
    from pallas_core import kernel as core_kernel

    if kwargs:
        raise PallasError(f"plgpu.kernel got unknown arguments {sorted(kwargs)}. Fix: see "
                          "plgpu.kernel's signature (grid, grid_names, cluster, num_threads...).")
    if out_type is not None:
        if out_shape is not None:
            raise PallasError("plgpu.kernel got both out_shape and out_type, two names of the "
                              "same argument. Fix: pass only out_type.")
        out_shape = out_type
    if scratch_types is not None:
        if scratch_shapes != ():
            raise PallasError("plgpu.kernel got both scratch_shapes and scratch_types, two names "
                              "of the same argument. Fix: pass only scratch_types.")
        scratch_shapes = scratch_types
    mesh = Mesh(tuple(grid), tuple(grid_names), tuple(cluster), tuple(cluster_names),
                num_threads, thread_name)
    if compiler_params is not None and not isinstance(compiler_params, GPUCompilerParams):
        raise PallasError(f"plgpu.kernel(compiler_params=...) takes plgpu.CompilerParams, found "
                          f"{type(compiler_params).__name__}. Fix: choose another backend with "
                          "backend= (e.g. backend='interpret').")
    params = dataclasses.replace(compiler_params or GPUCompilerParams(), mesh=mesh)
    if interpret and backend is None:
        backend = "interpret"

    def decorate(fn: Callable[..., None]) -> Any:
        return core_kernel(fn, out_shape, mesh=_kernel_mesh(mesh),
                           scratch_shapes=scratch_shapes, compiler_params=params,
                           name=name or kernel_name or getattr(fn, "__name__", "kernel"),
                           backend=backend, interpret=interpret)

    return decorate if body is None else decorate(body)


ShapeDtypeStruct = jax.ShapeDtypeStruct
