"""Lowering of a traced kernel (a :class:`pallas_core.KernelCall`) to a Mosaic GPU kernel.

The kernel is built with JAX's Mosaic GPU library (``jax.experimental.mosaic.gpu``) in lane
semantics: each warpgroup (128 threads) holds arrays as ``FragmentedArray`` registers spread
over its lanes. ``mgpu.as_gpu_kernel`` wraps the body in a ``gpu.launch`` and the result is
emitted as the ``mosaic_gpu_v2`` custom call that JAX's CUDA runtime executes.

How a ``pallas_call`` runs (see docs/backends/mosaic_gpu.md):

* parallel grid axes are folded into the CUDA grid's x dimension (one thread block each);
  sequential axes (trailing) are one loop inside the block;
* every windowed input has ``max_concurrent_steps`` SMEM buffers filled by TMA copies, each
  with its mbarrier; the copy for step ``t + max_concurrent_steps`` is issued once step ``t``
  (or, with ``delay_release=d``, step ``t - d``) no longer needs the buffer;
* every windowed output has one SMEM buffer, copied out by TMA when its block index is about
  to change (or after the last step);
* ``plgpu.ACC`` accumulators live in registers and are carried through loops.

Layouts are chosen here, not by the user: SMEM buffers whose two minor dimensions are
multiples of 64 in a 16-bit dtype are tiled (8, 64) with a 128-byte swizzle, as ``wgmma``
reads them; 2-D arrays whose shape is a multiple of (64, 8) use the wgmma register layout
(row reductions give its row layout), other arrays a strided layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, nvvm, scf

from pallas_core import backend as _jax
from pallas_core import mlir_lowering, mlir_rules, reference
from pallas_core import primitives as prims
from pallas_core.errors import PallasError, UnsupportedError
from pallas_core.grid_mapping import BlockMapping
from pallas_core.mlir_lowering import LoweringState, element_type, is_float, is_unsigned
from pallas_core.request import KernelCall
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu import smem_layout, tiled_slices, tma
from pallas_mosaic_gpu.params import (
    ACC_SPACE,
    GMEM,
    PARALLEL,
    SEQUENTIAL,
    TMEM,
    BarrierSpace,
    GPUCompilerParams,
)

FA = mgpu.FragmentedArray
WGMMA = mgpu.WGMMA_LAYOUT
SWIZZLE = 128
"""Bytes of the swizzle of tiled SMEM buffers (the widest; what wgmma reads best)."""
WARPGROUP = 128
SMEM_ALIGNMENT = 1024
"""Where every shared-memory buffer starts (a multiple of this many bytes): TMA copies need
128-byte aligned buffers, and a 128-byte swizzle repeats every 1024 bytes, which the swizzled
TMA copies and the wgmma descriptors (base offset 0) assume of a buffer's start."""

RULES = mlir_lowering.Rules()
_LAZY_OK: set[Any] = set()


def rule(*primitives: Any, lazy: bool = False) -> Callable[[Any], Any]:
    """Registers a rule; unless ``lazy``, reads of whole SMEM Refs reach it as arrays."""
    def register(fn: Any) -> Any:
        def lazy_rule(state: GPULowering, eqn: Any, *args: Any) -> Any:
            return fn(state, eqn, *args, **eqn.params)

        def materialized(state: GPULowering, eqn: Any, *args: Any) -> Any:
            return fn(state, eqn, *[state.value(a) for a in args], **eqn.params)
        for p in primitives:
            RULES[p] = lazy_rule if lazy else materialized
            if lazy:
                _LAZY_OK.add(p)
        return fn
    return register


# --- values ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Ref:
    """A Ref in the kernel: a memref in GMEM or SMEM (maybe tiled), an accumulator, barriers."""

    kind: str  # "gmem", "smem", "acc", "barrier", "value" (memref holds a value)
    shape: tuple[int, ...]
    dtype: Any
    memref: Any = None
    tiled: bool = False
    """An SMEM buffer whose two minor dimensions are tiled (8, 128 // itemsize), swizzled."""
    barrier: Any = None
    acc_key: int = -1
    transposed: bool = False
    """A tiled SMEM buffer seen with its two minor dimensions swapped (``transpose_ref``):
    only wgmma reads it (as a transposed operand)."""


@dataclasses.dataclass
class Loaded:
    """A read of an SMEM Ref, not yet in registers (``wgmma`` reads SMEM); ``transposed``
    after ``.T``."""

    ref: Ref
    transposed: bool = False


@dataclasses.dataclass
class Expanded:
    """An array with unit dimensions added (``x[:, None]``): kept as the array itself until
    it is broadcast to a full shape."""

    array: Any
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    """Where the array's dimensions sit in ``shape``."""


def is_tileable(shape: Sequence[int], dtype: Any) -> bool:
    """Whether an SMEM buffer of this shape is tiled and swizzled for wgmma."""
    dt = np.dtype(dtype)
    elems = SWIZZLE // dt.itemsize
    return (len(shape) >= 2 and dt.itemsize == 2 and shape[-2] % 64 == 0
            and shape[-1] % elems == 0)


def tile_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
    """The memref shape of a tiled SMEM buffer."""
    elems = SWIZZLE // np.dtype(dtype).itemsize
    *lead, r, c = shape
    return (*lead, r // 8, c // elems, 8, elems)


def tile_transform(dtype: Any) -> Any:
    return mgpu.TileTransform((8, SWIZZLE // np.dtype(dtype).itemsize))


def layout_for(shape: Sequence[int]) -> Any:
    """The register layout of fresh arrays of ``shape``."""
    if len(shape) == 2 and shape[0] % 64 == 0 and shape[1] % 8 == 0:
        return WGMMA
    return mgpu.WGStridedFragLayout.from_shaped_type(
        ir.VectorType.get(list(shape), ir.F32Type.get()))


def signed(dtype: Any) -> bool | None:
    return None if is_float(dtype) else not is_unsigned(dtype)


def index(v: Any) -> ir.Value:
    """An ``index`` value of an int or an integer scalar."""
    if isinstance(v, (int, np.integer)):
        return arith.constant(ir.IndexType.get(), int(v))
    if isinstance(v.type, ir.IndexType):
        return v
    return arith.index_cast(ir.IndexType.get(), v)


def i32(v: Any) -> ir.Value:
    t = ir.IntegerType.get_signless(32)
    if isinstance(v, (int, np.integer)):
        return arith.constant(t, int(v))
    return v if not isinstance(v.type, ir.IndexType) else arith.index_cast(t, v)


def scalar_constant(value: Any, dtype: Any) -> ir.Value:
    t = element_type(dtype)
    if is_float(dtype):
        return arith.constant(t, float(value))
    return arith.constant(t, int(value))


def splat(value: ir.Value, shape: Sequence[int], dtype: Any, layout: Any = None) -> Any:
    return FA.splat(value, tuple(shape), layout, is_signed=signed(dtype))


def relayout(arr: Any, layout: Any) -> Any:
    """``arr`` in ``layout`` (splats are re-splatted; others converted by the library)."""
    if arr.layout == layout:
        return arr
    if isinstance(arr.layout, mgpu.WGSplatFragLayout):
        return FA.splat(arr.registers.flat[0], arr.shape, layout, is_signed=arr.is_signed)
    try:
        return arr.to_layout(layout)
    except (NotImplementedError, ValueError) as e:
        raise UnsupportedError(f"an array of shape {arr.shape} in layout {arr.layout} used "
                               f"where {layout} is needed ({e})") from None


# --- the lowering state ----------------------------------------------------------------------


@dataclasses.dataclass
class GPULowering(LoweringState):
    """State of lowering one kernel: axis indices, accumulators, the launch context."""

    launch: Any = None
    axes: dict[str, ir.Value] = dataclasses.field(default_factory=dict)
    accs: dict[int, Any] = dataclasses.field(default_factory=dict)
    scoped: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    """The Refs each ``pl.run_scoped`` (by equation) allocated in shared memory."""
    approx: bool = False

    def value(self, v: Any) -> Any:
        """``v`` as something arithmetic applies to (reads of SMEM Refs are done here)."""
        if isinstance(v, Unavailable):
            raise self.fail(v.what)
        if isinstance(v, Loaded):
            if v.transposed:
                raise self.fail("transposing an SMEM block other than as a dot operand")
            return load(v.ref)
        return v


def load(ref: Ref) -> Any:
    if ref.kind == "acc":
        raise PallasError("internal: accumulator read without state")
    is_signed = signed(ref.dtype)
    if ref.tiled:
        return FA.load_tiled(ref.memref, swizzle=SWIZZLE, is_signed=is_signed)
    if ref.shape == ():
        from jaxlib.mlir.dialects import memref
        return memref.load(ref.memref, [])
    layout = layout_for(ref.shape)
    if layout == WGMMA:
        return FA.load_untiled(ref.memref, layout=WGMMA, is_signed=is_signed, optimized=False)
    return FA.load_strided(ref.memref, is_signed=is_signed)


def store(ref: Ref, value: Any) -> None:
    if ref.shape == ():
        from jaxlib.mlir.dialects import memref
        memref.store(value, ref.memref, [])
        return
    if not isinstance(value, FA):
        value = splat(value, ref.shape, ref.dtype)
    if ref.tiled:
        # Arrays read from TMEM (one row per thread) are stored in their own layout.
        keep = value.layout in (mgpu.tcgen05.LAYOUT, mgpu.tcgen05.TMEM_NATIVE_LAYOUT)
        (value if keep else relayout(value, WGMMA)).store_tiled(ref.memref, swizzle=SWIZZLE)
        return
    layout = layout_for(ref.shape)
    value = relayout(value, layout) if isinstance(value.layout, mgpu.WGSplatFragLayout) else value
    if value.layout == WGMMA or (ref.kind == "gmem" and value.layout in (
            mgpu.tcgen05.LAYOUT, mgpu.tcgen05.TMEM_NATIVE_LAYOUT)):
        value.store_untiled(ref.memref, optimized=False)
    else:
        value.store_untiled(ref.memref)


def literal(value: Any, aval: Any) -> Any:
    arr = np.asarray(value)
    if arr.ndim == 0:
        return scalar_constant(arr, aval.dtype)
    if arr.size and not (arr == arr.reshape(-1)[0]).all():
        raise UnsupportedError("a non-uniform array constant in a mosaic_gpu kernel")
    return splat(scalar_constant(arr.reshape(-1)[0] if arr.size else 0, aval.dtype),
                 aval.shape, aval.dtype)


def lower_jaxpr(state: GPULowering, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]
                ) -> list[Any]:
    return mlir_lowering.lower_jaxpr(state, RULES, jaxpr, consts, args, literal)


# --- the kernel ------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """How a call is launched."""

    grid: tuple[int, int, int]
    cluster: tuple[int, int, int]
    block: tuple[int, int, int]
    parallel_axes: tuple[int, ...]
    """Grid axes folded into the CUDA grid (pallas_call) or mapped to it (plgpu.kernel)."""
    sequential_axes: tuple[int, ...]
    mesh: Any = None


def _depends_on(jaxpr: Any, n_inputs: int) -> set[int]:
    """Which of the first ``n_inputs`` inputs of ``jaxpr`` its outputs depend on."""
    deps: dict[Any, set[int]] = {v: {i} for i, v in enumerate(jaxpr.invars[:n_inputs])}
    for eqn in jaxpr.eqns:
        d: set[int] = set()
        for v in eqn.invars:
            if not isinstance(v, _jax.Literal):
                d |= deps.get(v, set())
        for o in eqn.outvars:
            deps[o] = d
    out: set[int] = set()
    for v in jaxpr.outvars:
        if not isinstance(v, _jax.Literal):
            out |= deps.get(v, set())
    return out


def plan(call: KernelCall) -> Plan:
    gm = call.grid_mapping
    params = call.compiler_params if isinstance(call.compiler_params, GPUCompilerParams) else \
        GPUCompilerParams()
    grid = tuple(gm.grid)
    if params.mesh is not None:
        mesh = params.mesh
        cluster = tuple(mesh.cluster) + (1,) * (3 - len(mesh.cluster))
        dims = tuple(g * c for g, c in zip(tuple(mesh.grid) + (1,) * (3 - len(mesh.grid)),
                                           cluster))
        threads = mesh.num_threads or 1
        return Plan(dims, cluster, (WARPGROUP * threads, 1, 1),  # type: ignore[arg-type]
                    tuple(range(len(grid))), (), mesh)
    nb = gm.num_batch_axes
    user = list(params.dimension_semantics or ())
    if user and len(user) != len(gm.user_grid):
        raise PallasError(
            f"plgpu.CompilerParams(dimension_semantics={tuple(user)}) names "
            f"{len(user)} axes but kernel {call.name!r} has grid {gm.user_grid}. Fix: one "
            "entry per grid axis.")
    if not user:
        revisited: set[int] = set()
        for bm in gm.block_mappings[len(call.jaxpr.jaxpr.invars) - len(gm.scratch_avals)
                                    - len(call.out_avals):][:len(call.out_avals)]:
            if bm.is_whole_array or bm.memory_space is GMEM:
                continue
            used = _depends_on(bm.index_map.jaxpr, len(grid))
            revisited |= {a for a in range(nb, len(grid)) if a not in used}
        first = min(revisited) if revisited else len(grid)
        user = [PARALLEL if nb + a < first else SEQUENTIAL for a in range(len(gm.user_grid))]
    sem = [PARALLEL] * nb + list(user)
    seq = tuple(a for a, s in enumerate(sem) if s == SEQUENTIAL)
    if seq and seq != tuple(range(seq[0], len(grid))):
        raise PallasError(
            f"kernel {call.name!r}: sequential grid axes must come last (found semantics "
            f"{tuple(user)}). Fix: reorder the grid so the sequential axes are trailing.")
    par = tuple(a for a in range(len(grid)) if a not in seq)
    blocks = math.prod(grid[a] for a in par)
    if blocks >= 2**31:
        raise PallasError(f"kernel {call.name!r}: {blocks} thread blocks exceed the CUDA grid.")
    return Plan((blocks, 1, 1), (1, 1, 1), (WARPGROUP, 1, 1), par, seq)


def _operands(call: KernelCall) -> tuple[list[BlockMapping], list[BlockMapping]]:
    gm = call.grid_mapping
    n_out = len(call.out_avals)
    bms = list(gm.block_mappings)
    return bms[:len(bms) - n_out], bms[len(bms) - n_out:]


def _windowed(bm: BlockMapping) -> bool:
    return not (bm.is_whole_array or bm.memory_space is GMEM)


def _check_spaces(call: KernelCall) -> tuple[int, int]:
    """The architecture to build ``call`` for (:mod:`targets`); a kernel using TMEM or tcgen05
    is refused for Hopper."""
    from pallas_mosaic_gpu import blackwell, targets

    uses = blackwell.uses_blackwell(call)
    arch, why = targets.choose(uses)
    if uses and arch < targets.BLACKWELL:
        raise UnsupportedError(
            f"kernel {call.name!r} uses TMEM or tcgen05, which only Blackwell (sm_100a) GPUs "
            f"have, but it is built for {targets.name(arch)} ({why}). Fix: use SMEM or "
            "registers (plgpu.ACC, plgpu.wgmma) on Hopper, or target sm_100a.")
    return arch


def scoped_allocations(call: KernelCall
                       ) -> list[tuple[int, list[tuple[str, tuple[int, ...], Any, int]]]]:
    """The shared memory every ``pl.run_scoped`` of the kernel allocates, one region per
    ``run_scoped`` (keyed by its equation): ``(kind, shape, dtype, num_arrivals)`` with kind
    ``"smem"``, ``"smem_plain"`` (a buffer left untiled because the kernel slices its minor
    dimensions, see :mod:`smem_layout`), ``"barrier"`` or ``"acc"`` (registers)."""
    found: list[tuple[int, list[tuple[str, tuple[int, ...], Any, int]]]] = []
    seen: set[int] = set()
    for eqn in reference.all_eqns(call.jaxpr.jaxpr):
        if eqn.primitive is not prims.run_scoped_p or id(eqn) in seen:
            continue
        seen.add(id(eqn))
        allocs = []
        for mref in eqn.params["scoped"]:
            space = mref.memory_space
            if space is ACC_SPACE:
                allocs.append(("acc", tuple(mref.shape), mref.dtype, 0))
            elif isinstance(space, BarrierSpace):
                allocs.append(("barrier", tuple(mref.shape), mref.dtype, space.num_arrivals))
            elif space is TMEM:
                raise UnsupportedError(
                    f"kernel {call.name!r}: pl.run_scoped allocates TMEM, which the "
                    "mosaic_gpu backend does not support (TMEM is allocated for the whole "
                    "kernel). Fix: allocate it in scratch_shapes, plgpu.TMEM((M, N), dtype).")
            elif space is GMEM:
                raise UnsupportedError(
                    f"kernel {call.name!r}: pl.run_scoped allocates GMEM; the mosaic_gpu "
                    "backend allocates scratch in shared memory only. Fix: allocate "
                    "plgpu.SMEM, or pass the global buffer as an operand.")
            else:
                shape = tuple(mref.shape)
                body = eqn.params["jaxpr"].jaxpr
                var = body.invars[len(body.invars) - len(eqn.params["scoped"]) + len(allocs)]
                plain = is_tileable(shape, mref.dtype) and \
                    smem_layout.minor_sliced(body, var, shape) and \
                    not smem_layout.read_by_wgmma(body, var)
                allocs.append(("smem_plain" if plain else "smem", shape, mref.dtype, 0))
        found.append((id(eqn), allocs))
    return found


def _nbytes(buf: jax.ShapeDtypeStruct) -> int:
    dt = np.dtype(buf.dtype)
    bits = (np.iinfo(dt).bits if np.issubdtype(dt, np.integer) else
            np.finfo(dt).bits if np.issubdtype(dt, np.floating) else dt.itemsize * 8)
    return math.prod(buf.shape) * bits // 8


def aligned_smem(entries: Sequence[Any]) -> tuple[tuple[Any, ...], list[int]]:
    """The shared-memory tree ``mgpu.as_gpu_kernel`` lays out (in order, without gaps) for
    ``entries`` (buffers and barriers): every buffer first, each starting at a multiple of
    :data:`SMEM_ALIGNMENT` bytes, then the barriers (8 bytes each), with ``uint8`` padding
    between them. Returns the tree and, for each entry, its index in the tree."""
    barrier_types = (mgpu.Barrier, mgpu.TMABarrier, mgpu.ClusterBarrier)
    tree: list[Any] = []
    positions = [0] * len(entries)
    offset = 0

    def pad(to: int) -> None:
        nonlocal offset
        if offset % to:
            tree.append(jax.ShapeDtypeStruct((-offset % to,), np.uint8))
            offset += -offset % to

    for i, entry in enumerate(entries):
        if not isinstance(entry, (*barrier_types, mgpu.TMEM)):
            pad(SMEM_ALIGNMENT)
            positions[i] = len(tree)
            tree.append(entry)
            offset += _nbytes(entry)
    for i, entry in enumerate(entries):
        if isinstance(entry, barrier_types):
            pad(8)
            positions[i] = len(tree)
            tree.append(entry)
            offset += 8 * entry.num_barriers
    for i, entry in enumerate(entries):
        if isinstance(entry, mgpu.TMEM):  # the TMEM address, 4 bytes, after the barriers
            positions[i] = len(tree)
            tree.append(entry)
            offset += 4
    return tuple(tree), positions


def build(call: KernelCall) -> Callable[..., Any]:
    """The Mosaic GPU kernel of ``call`` as a function of its operands (``mgpu.as_gpu_kernel``);
    it must be called inside an MLIR context (see :func:`kernel_fn`)."""
    arch = _check_spaces(call)
    gm = call.grid_mapping
    pl_ = plan(call)
    params = call.compiler_params if isinstance(call.compiler_params, GPUCompilerParams) else \
        GPUCompilerParams()
    ins, outs = _operands(call)
    slots = params.max_concurrent_steps
    seq_sizes = [gm.grid[a] for a in pl_.sequential_axes]
    steps = math.prod(seq_sizes)
    if steps <= 1:
        slots = 1
    slots = min(slots, max(steps, 1))
    smem: list[Any] = []
    buffers: list[tuple[str, int, Any]] = []  # (kind, operand index, tiled)

    def buf_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
        return tile_shape(shape, dtype) if is_tileable(shape, dtype) else tuple(shape)

    for k, bm in enumerate(ins):
        if _windowed(bm):
            smem.append(jax.ShapeDtypeStruct((slots, *buf_shape(bm.ref_shape, bm.dtype)),
                                             bm.dtype))
            smem.append(mgpu.TMABarrier(slots))
            buffers.append(("in", k, is_tileable(bm.ref_shape, bm.dtype)))
    from pallas_mosaic_gpu import smem_reuse
    reuse = smem_reuse.reused(call)  # outputs staged in an input's buffer
    for k, bm in enumerate(outs):
        if _windowed(bm) and k not in reuse:
            smem.append(jax.ShapeDtypeStruct(buf_shape(bm.ref_shape, bm.dtype), bm.dtype))
            buffers.append(("out", k, is_tileable(bm.ref_shape, bm.dtype)))
    scratch_refs: list[Any] = []
    for a in gm.scratch_avals:
        shape, dtype, space = a.inner_aval.shape, a.inner_aval.dtype, a.memory_space
        if isinstance(space, BarrierSpace):
            smem.append(mgpu.Barrier(space.num_arrivals, num_barriers=shape[0]))
            scratch_refs.append(("barrier", shape, dtype))
        elif space is ACC_SPACE:
            scratch_refs.append(("acc", shape, dtype))
        elif space is TMEM:
            smem.append(mgpu.TMEM(tuple(shape), dtype))
            scratch_refs.append(("tmem", shape, dtype))
        else:
            smem.append(jax.ShapeDtypeStruct(buf_shape(shape, dtype), dtype))
            scratch_refs.append(("smem", shape, dtype))
    n_main = len(smem)
    scoped = scoped_allocations(call)
    for _, allocs in scoped:
        for kind, shape, dtype, arrivals in allocs:
            if kind == "barrier":
                smem.append(mgpu.Barrier(arrivals, num_barriers=shape[0]))
            elif kind == "smem":
                smem.append(jax.ShapeDtypeStruct(buf_shape(shape, dtype), dtype))
            elif kind == "smem_plain":
                smem.append(jax.ShapeDtypeStruct(tuple(shape), dtype))
    smem_tree, smem_positions = aligned_smem(smem)

    # Aliased inputs are the library's in-out operands: passed after the other inputs, their
    # buffers written in place and returned after the other outputs.
    aliases = dict(call.input_output_aliases)
    plain_in = [i for i in range(len(ins)) if i not in aliases]
    alias_in = sorted(aliases)
    plain_out = [j for j in range(len(outs)) if j not in aliases.values()]

    def body(launch: Any, *args: Any) -> None:
        refs = list(args[:-1])
        gmem_in: list[Any] = [None] * len(ins)
        for i, r in zip(plain_in + alias_in, refs):
            gmem_in[i] = r
        gmem_out: list[Any] = [None] * len(outs)
        for j, r in zip(plain_out, refs[len(ins):]):
            gmem_out[j] = r
        for i in alias_in:
            gmem_out[aliases[i]] = gmem_in[i]
        gmem = gmem_in + gmem_out
        smem_refs = [args[-1][p] for p in smem_positions]
        state = GPULowering(call, "mosaic_gpu", launch=launch, approx=params.approx_math)
        rest = iter(smem_refs[n_main:])
        for key, allocs in scoped:
            state.scoped[key] = [
                Ref(kind, tuple(shape), dtype, barrier=next(rest)) if kind == "barrier" else
                Ref("smem", tuple(shape), dtype, memref=next(rest),
                    tiled=kind == "smem" and is_tileable(shape, dtype))
                if kind in ("smem", "smem_plain") else None
                for kind, shape, dtype, _ in allocs]
        _emit(state, pl_, gmem, smem_refs[:n_main], buffers, scratch_refs, slots, steps,
              params.delay_release, reuse)

    in_shapes = tuple(jax.ShapeDtypeStruct(ins[i].array_shape, ins[i].dtype) for i in plain_in)
    inout_shapes = tuple(jax.ShapeDtypeStruct(ins[i].array_shape, ins[i].dtype)
                         for i in alias_in)
    out_shapes = tuple(jax.ShapeDtypeStruct(call.out_avals[j].shape, call.out_avals[j].dtype)
                       for j in plain_out)
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in call.name) or "kernel"
    from pallas_mosaic_gpu import targets
    try:
        with targets.assume(arch):
            kernel = mgpu.as_gpu_kernel(body, pl_.grid, pl_.block, in_shapes, out_shapes,
                                        smem_tree, cluster=pl_.cluster, module_name=name,
                                        kernel_name=name, inout_shape=inout_shapes)
    except (ValueError, NotImplementedError, TypeError, IndexError) as e:
        if isinstance(e, PallasError):
            raise
        raise UnsupportedError(
            f"kernel {call.name!r} could not be lowered by the mosaic_gpu backend: "
            f"{type(e).__name__}: {e}. Fix: see docs/backends/mosaic_gpu.md for what the "
            "backend supports, or run with backend='interpret'.") from e

    def run(*operands: Any) -> list[Any]:
        res = list(kernel(*[operands[i] for i in plain_in + alias_in]))
        out: list[Any] = [None] * len(outs)
        for j, r in zip(plain_out, res):
            out[j] = r
        for i, r in zip(alias_in, res[len(plain_out):]):
            out[aliases[i]] = r
        return out

    return run


def _emit(state: GPULowering, pl_: Plan, gmem: list[Any], smem: list[Any],
          buffers: list[tuple[str, int, Any]], scratch: list[Any], slots: int, steps: int,
          delay: int, reuse: dict[int, tuple[int, int]]) -> None:
    call = state.call
    gm = call.grid_mapping
    ins, outs = _operands(call)
    smem_it = iter(smem)
    in_bufs: dict[int, tuple[Any, Any, bool]] = {}
    out_bufs: dict[int, tuple[Any, bool]] = {}
    for kind, k, tiled in buffers:
        if kind == "in":
            in_bufs[k] = (next(smem_it), next(smem_it), tiled)
        else:
            out_bufs[k] = (next(smem_it), tiled)
    for j, (k, _) in reuse.items():  # one step per block (smem_reuse): slot 0
        out_bufs[j] = (mgpu.memref_slice(in_bufs[k][0], index(0)), in_bufs[k][2])
    scratch_vals: list[Ref] = []
    for n, (kind, shape, dtype) in enumerate(scratch):
        if kind == "acc":
            key = 1000 + n
            state.accs[key] = mgpu.WGMMAAccumulator.zero(
                *shape, element_type(dtype))
            scratch_vals.append(Ref("acc", tuple(shape), dtype, acc_key=key))
        elif kind == "barrier":
            scratch_vals.append(Ref("barrier", tuple(shape), dtype, barrier=next(smem_it)))
        elif kind == "tmem":
            scratch_vals.append(Ref("tmem", tuple(shape), dtype, memref=next(smem_it)))
        else:
            scratch_vals.append(Ref("smem", tuple(shape), dtype, memref=next(smem_it),
                                    tiled=is_tileable(shape, dtype)))
    # Grid indices of the parallel axes.
    ids: dict[int, ir.Value] = {}
    if pl_.mesh is not None:
        mesh = pl_.mesh
        dims = (gpu.Dimension.x, gpu.Dimension.y, gpu.Dimension.z)
        names = list(call.grid_mapping.grid_names or ())
        for d in range(max(len(mesh.grid), len(mesh.cluster))):
            block = i32(gpu.block_id(dims[d]))
            c = mesh.cluster[d] if d < len(mesh.cluster) else 1
            ids[d] = arith.divui(block, i32(c)) if c > 1 else block
        n_grid = max(len(mesh.grid), len(mesh.cluster) and 1)
        for j in range(len(mesh.cluster)):
            ids[n_grid + j] = i32(gpu.cluster_block_id(dims[j]))
        if mesh.num_threads is not None:
            ids[len(names) - 1] = i32(mgpu.warpgroup_idx(sync=True))
        if not mesh.grid and mesh.num_threads is None:
            ids[0] = i32(0)
    else:
        linear = i32(gpu.block_id(gpu.Dimension.x))
        for a in reversed(pl_.parallel_axes):
            size = gm.grid[a]
            ids[a] = arith.remui(linear, i32(size)) if size > 1 else i32(0)
            linear = arith.divui(linear, i32(size)) if size > 1 else linear
    n_in = len(ins)

    def grid_indices(step: Any) -> list[ir.Value]:
        idx = dict(ids)
        s = i32(step)
        for a in reversed(pl_.sequential_axes):
            size = gm.grid[a]
            idx[a] = arith.remui(s, i32(size)) if size > 1 else i32(0)
            s = arith.divui(s, i32(size)) if size > 1 else s
        return [idx[a] for a in range(len(gm.grid))]

    def window(bm: BlockMapping, step: Any) -> tuple[Any, ...]:
        sub = GPULowering(call, "mosaic_gpu", launch=state.launch)
        blocks = lower_jaxpr(sub, bm.index_map.jaxpr, bm.index_map.consts, grid_indices(step))
        sl: list[Any] = []
        for b, size in zip(blocks, bm.block_shape):
            b = i32(b) if isinstance(b, (int, np.integer)) else b
            if size is None:
                sl.append(index(b))
            else:
                sl.append(mgpu.ds(index(arith.muli(b, i32(size))), size))
        return tuple(sl)

    def fetch(k: int, step: Any, slot: Any) -> None:
        buf, bars, tiled = in_bufs[k]
        bm = ins[k]
        dst = mgpu.memref_slice(buf, index(slot))
        tma.copy(state.launch, gmem=gmem[k], smem=dst, window=window(bm, step), to_smem=True,
                 barrier=bars[index(slot)], aligned=True, kernel=state.call.name,
                 tiling=tile_transform(bm.dtype) if tiled else None,
                 swizzle=SWIZZLE if tiled else None)

    def store_out(k: int, step: Any) -> None:
        buf, tiled = out_bufs[k]
        bm = outs[k]
        tma.copy(state.launch, gmem=gmem[n_in + k], smem=buf, window=window(bm, step),
                 to_smem=False, aligned=True, kernel=state.call.name,
                 tiling=tile_transform(bm.dtype) if tiled else None,
                 swizzle=SWIZZLE if tiled else None)

    for j in range(min(slots, steps)):
        for k in in_bufs:
            fetch(k, j, j)

    def step_body(step: Any) -> None:
        slot = arith.remui(i32(step), i32(slots)) if slots > 1 else i32(0)
        block_refs: list[Any] = []
        for k, bm in enumerate(ins):
            if k in in_bufs:
                buf, bars, tiled = in_bufs[k]
                bars[index(slot)].wait()
                block_refs.append(Ref("smem", bm.ref_shape, bm.dtype,
                                      mgpu.memref_slice(buf, index(slot)), tiled=tiled))
            else:
                block_refs.append(Ref("gmem", bm.array_shape, bm.dtype, gmem[k]))
        for k, bm in enumerate(outs):
            if k in out_bufs:
                buf, tiled = out_bufs[k]
                block_refs.append(Ref("smem", bm.ref_shape, bm.dtype, buf, tiled=tiled))
            else:
                block_refs.append(Ref("gmem", bm.array_shape, bm.dtype, gmem[n_in + k]))
        names = call.grid_mapping.grid_names
        full = grid_indices(step)
        state.program_ids = full[gm.num_batch_axes:]
        state.axes = dict(zip(names, full)) if names else {}
        from pallas_mosaic_gpu import smem_reuse
        smem_reuse.lower_body(state, call.jaxpr.jaxpr, call.jaxpr.consts,
                              [*block_refs, *scratch_vals], {at for _, at in reuse.values()})
        if in_bufs and steps > slots:
            # Refill the buffer step `step - delay` used with step `step - delay + slots`.
            nvvm.wgmma_wait_group_sync_aligned(delay)
            mgpu.warpgroup_barrier()
            old = arith.subi(i32(step), i32(delay))
            nxt = arith.addi(old, i32(slots))
            ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, old, i32(0)),
                            arith.cmpi(arith.CmpIPredicate.slt, nxt, i32(steps)))
            with mgpu.when(ok):
                for k in in_bufs:
                    fetch(k, nxt, arith.remui(old, i32(slots)) if slots > 1 else i32(0))
        if out_bufs:
            last = arith.cmpi(arith.CmpIPredicate.eq, i32(step), i32(steps - 1))
            for k in out_bufs:
                if steps == 1:
                    changes = last
                else:
                    here = window(outs[k], step)
                    nxt_step = arith.minui(arith.addi(i32(step), i32(1)), i32(steps - 1))
                    there = window(outs[k], nxt_step)
                    changes = last
                    for a, b in zip(here, there):
                        x = a.base if isinstance(a, mgpu.DynamicSlice) else a
                        y = b.base if isinstance(b, mgpu.DynamicSlice) else b
                        changes = arith.ori(changes, arith.cmpi(
                            arith.CmpIPredicate.ne, index(x), index(y)))
                mgpu.commit_shared()
                with mgpu.when(changes):
                    store_out(k, step)
                state.launch.await_async_copy(0, await_read_only=True)

    if steps == 1:
        step_body(0)
    else:
        def loop_body(i: ir.Value, vals: list[Any]) -> list[Any]:
            step_body(i)
            return []

        emit_for(state, steps, [], loop_body)
    if out_bufs:
        state.launch.await_async_copy(0)


# --- loops -----------------------------------------------------------------------------------


def emit_for(state: GPULowering, n: Any, init: list[Any],
             body: Callable[[ir.Value, list[Any]], list[Any]], start: Any = 0) -> list[Any]:
    """An ``scf.for`` over ``[start, start + n)`` carrying ``init`` and every accumulator.

    Carried splats take the layout the body gives them (the body is emitted again if so)."""
    keys = sorted(state.accs)
    for _attempt in range(3):
        carried = [state.accs[k] for k in keys] + list(init)
        leaves, tree = jax.tree_util.tree_flatten(carried)
        lo = index(start)
        hi = arith.addi(lo, index(n))
        op = scf.ForOp(lo, hi, index(1), leaves)
        with ir.InsertionPoint(op.body):
            inner = jax.tree_util.tree_unflatten(tree, list(op.inner_iter_args))
            for k, v in zip(keys, inner[:len(keys)]):
                state.accs[k] = v
            outs = body(i32(op.induction_variable), list(inner[len(keys):]))
            result = [state.accs[k] for k in keys] + [state.value(o) for o in outs]
            out_leaves, out_tree = jax.tree_util.tree_flatten(result)
            same = bool(out_tree == tree)  # type: ignore[operator]
            if same:
                scf.YieldOp(out_leaves)
        if same:
            done = jax.tree_util.tree_unflatten(tree, list(op.results))
            for k, v in zip(keys, done[:len(keys)]):
                state.accs[k] = v
            return list(done[len(keys):])
        op.operation.erase()
        # Give splat carries the layout the body produced, then emit again.
        new_init = []
        for old, new in zip(init, result[len(keys):]):
            if isinstance(old, FA) and isinstance(new, FA) and old.layout != new.layout:
                old = relayout(old, new.layout)
            new_init.append(old)
        init = new_init
    raise UnsupportedError(
        f"a loop whose carried values change layout in kernel {state.call.name!r} "
        f"(at {state.location})")


# --- Ref reads and writes --------------------------------------------------------------------


def _view(state: GPULowering, ref: Ref, transforms: Any) -> Ref:
    """``ref`` after the indexers of a Ref access (slices and integer indices)."""
    for t in transforms:
        indices = getattr(t, "indices", None)
        if type(t).__name__ == "TransposeTransform":
            ref = _transpose_view(state, ref, tuple(t.permutation))
            continue
        if indices is None:
            raise state.fail(f"the Ref transform {type(t).__name__}")
        if ref.transposed:
            raise state.fail("indexing a transposed SMEM Ref (index it, then transpose it)")
        if ref.kind not in ("smem", "gmem"):
            if ref.kind == "barrier" and len(indices) == 1:
                i = indices[0]
                if isinstance(i, _jax.Slice):
                    raise state.fail("a slice of barriers")
                ref = dataclasses.replace(ref, barrier=ref.barrier[index(state.value(i))],
                                          shape=())
                continue
            if all(_full(i, d) for i, d in zip(indices, ref.shape)):
                continue
            raise state.fail(f"indexing a {ref.kind} Ref")
        idx: list[Any] = []
        shape: list[int] = []
        for i in indices:
            if isinstance(i, _jax.Slice):
                if not isinstance(i.stride, int) or i.stride != 1:
                    raise state.fail("a strided Ref slice")
                start = i.start
                if isinstance(start, (int, np.integer)):
                    idx.append(slice(int(start), int(start) + i.size))
                else:
                    idx.append(mgpu.ds(index(start), i.size))
                shape.append(int(i.size))
            else:
                v = state.value(i)
                if isinstance(v, FA):
                    raise state.fail("gathering from a Ref with an index array")
                idx.append(index(v) if not isinstance(v, (int, np.integer)) else int(v))
        n_lead = len(ref.shape) - 2
        shape += list(ref.shape[len(indices):])
        if ref.tiled:  # minor slices on whole tiles keep the view tiled (tiled_slices)
            minor = [i for i, _ in list(zip(indices, ref.shape))[n_lead:]]
            mem = tiled_slices.tiled_view(
                ref.memref, idx[:n_lead], [] if all(
                    _full(i, d) for i, d in zip(minor, ref.shape[n_lead:])) else minor,
                ref.shape[n_lead:], (8, SWIZZLE // np.dtype(ref.dtype).itemsize),
                state.value, state.fail)
        else:
            mem = mgpu.memref_slice(ref.memref, tuple(idx))
        ref = dataclasses.replace(ref, memref=mem, shape=tuple(shape))
    return ref


def _transpose_view(state: GPULowering, ref: Ref, perm: tuple[int, ...]) -> Ref:
    """``ref`` with its two minor dimensions swapped (the only transpose wgmma reads)."""
    n = len(ref.shape)
    if perm == tuple(range(n)):
        return ref
    if ref.kind != "smem" or not ref.tiled or n < 2 or \
            perm != (*range(n - 2), n - 1, n - 2):
        raise state.fail(f"transposing a {ref.kind} Ref by {perm} (only tiled SMEM buffers, "
                         "their two minor dimensions swapped, as a wgmma operand)")
    return dataclasses.replace(ref, shape=(*ref.shape[:-2], ref.shape[-1], ref.shape[-2]),
                               transposed=not ref.transposed)


def _untransposed(ref: Ref) -> tuple[Ref, bool]:
    """The buffer under a transposed view of it (shape as allocated) and whether it was."""
    if not ref.transposed:
        return ref, False
    shape = (*ref.shape[:-2], ref.shape[-1], ref.shape[-2])
    return dataclasses.replace(ref, shape=shape, transposed=False), True


def _full(i: Any, d: int) -> bool:
    return bool(isinstance(i, _jax.Slice) and isinstance(i.start, (int, np.integer))
                and i.start == 0 and i.size == d)


def _transforms(eqn: Any, args: Sequence[Any], n_before: int) -> Any:
    tree = eqn.params["tree"]
    return jax.tree_util.tree_unflatten(tree, list(args[n_before:n_before + tree.num_leaves]))


@rule(_jax.get_p, lazy=True)
def _get(state: GPULowering, eqn: Any, ref: Ref, *flat: Any, **_: Any) -> Any:
    view = _view(state, ref, _transforms(eqn, [ref, *flat], 1))
    if view.kind == "value":  # a value pl.run_state closes over (layout_rules._run_state)
        return view.memref
    if view.kind == "acc":
        nvvm.wgmma_wait_group_sync_aligned(0)
        return state.accs[view.acc_key].value
    if view.kind == "smem" and len(view.shape) >= 1:
        return Loaded(*_untransposed(view))
    return load(view)


@rule(_jax.swap_p, lazy=True)
def _swap(state: GPULowering, eqn: Any, ref: Ref, value: Any, *flat: Any, **_: Any
          ) -> Any:
    value = state.value(value)
    view = _view(state, ref, _transforms(eqn, [ref, value, *flat], 2))
    if view.kind == "value":
        raise state.fail("writing to a Ref pl.run_state made of a value (only plgpu.ACC.init "
                         "accumulators are written there)")
    if view.kind == "acc":
        nvvm.wgmma_wait_group_sync_aligned(0)
        held = state.accs[view.acc_key].value
        state.accs[view.acc_key] = mgpu.WGMMAAccumulator.from_registers(relayout(value, WGMMA))
        return held
    if view.transposed:
        raise state.fail("storing to a transposed SMEM Ref")
    old = None
    if eqn.outvars and type(eqn.outvars[0]).__name__ != "DropVar":
        try:
            old = load(view)
        except (NotImplementedError, ValueError) as e:  # e.g. 64 floats in no strided layout
            old = Unavailable(f"the previous contents of a {np.dtype(view.dtype).name}"
                              f"{list(view.shape)} Ref returned by a swap ({e})")
    store(view, value)
    return old


@dataclasses.dataclass
class Unavailable:
    """A value this backend does not produce (the previous contents an atomic returns)."""

    what: str


_ATOMIC_OPS = {"add", "max", "min", "and", "or", "xor"}


@rule(prims.atomic_rmw_p, lazy=True)
def _atomic(state: GPULowering, eqn: Any, ref: Ref, value: Any, *rest: Any, op: Any,
            has_mask: bool, tree: Any) -> Any:
    if has_mask:
        raise state.fail("a masked atomic (mask=)")
    if op.value not in _ATOMIC_OPS:
        raise state.fail(f"pl.atomic_{op.value}")
    view = _view(state, ref, _transforms(eqn, [ref, value, *rest], 2))
    if view.kind not in ("gmem", "smem") or view.tiled:
        raise state.fail(f"an atomic on a {view.kind} Ref" +
                         (" (a tiled SMEM buffer)" if view.tiled else ""))
    if view.shape == ():
        raise state.fail("an atomic on a single element (give it a 1-D Ref of 128 or more "
                         "elements, one per thread)")
    value = state.value(value)
    if not isinstance(value, FA):
        value = splat(value, view.shape, view.dtype)
    value = relayout(value, layout_for(view.shape))
    try:
        if value.layout == WGMMA:
            value.store_untiled(view.memref, optimized=False, atomic=op.value)
        else:
            value.store_untiled(view.memref, atomic=op.value)
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"atomic_{op.value} on {view.dtype} in {view.kind.upper()} ({e})"
                         ) from e
    return Unavailable(f"the previous contents returned by pl.atomic_{op.value} (Mosaic GPU "
                       "atomics return nothing; use plgpu.atomic_" + op.value + ")")


# --- elementwise -----------------------------------------------------------------------------


def _splat_like(x: Any, like: Any, dtype: Any) -> Any:
    if isinstance(x, FA) or not isinstance(like, FA):
        return x
    return splat(x, like.shape, dtype)


def _unexpand(state: GPULowering, eqn: Any, args: Sequence[Any]) -> tuple[list[Any], Any]:
    """Operands of an elementwise op, with :class:`Expanded` ones unwrapped (all alike)."""
    exp = [a for a in args if isinstance(a, Expanded)]
    if not exp:
        return list(args), None
    first = exp[0]
    out_shape = tuple(eqn.outvars[0].aval.shape)
    if any(isinstance(a, FA) for a in args) or any(e.shape != out_shape for e in exp):
        # (m, 1) against (m, n): the unit dimensions broadcast.
        return [_broadcast(state, a, out_shape) if isinstance(a, Expanded) else a
                for a in args], None
    if any(e.dims != first.dims for e in exp):
        raise state.fail("an elementwise op between arrays with unit dimensions in different "
                         "places")
    return [a.array if isinstance(a, Expanded) else a for a in args], first


def _broadcast(state: GPULowering, x: Expanded, shape: tuple[int, ...]) -> Any:
    try:
        return x.array.broadcast_in_dim(shape, x.dims, layout_for(shape))
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"broadcasting {x.array.shape} in layout {x.array.layout} to {shape} "
                         f"({e})") from None


def _rewrap(out: Any, like: Any) -> Any:
    return Expanded(out, like.shape, like.dims) if like is not None else out


# Scalars (SMEM values, loop indices) take the shared rules (``pallas_core.mlir_rules``);
# register arrays (FragmentedArray) take the rules below, which hand scalars to the shared ones.


def _no_reduction(state: GPULowering, eqn: Any, *_: Any) -> Any:
    raise state.fail(f"{eqn.primitive.name} of a scalar")


DIALECT = mlir_rules.Dialect(
    constant=lambda value, dtype, shape: (scalar_constant(value, dtype) if not tuple(shape)
                                          else _splat_constant(value, dtype, shape)),
    broadcast_to=lambda v, shape: v,
    value_type=lambda shape, dtype: element_type(dtype),
    lower_jaxpr=lambda state, jaxpr, consts, args: lower_jaxpr(state, jaxpr, consts, args),
    reduce=_no_reduction)
"""Mosaic GPU's scalars, for the shared rules."""
SHARED = mlir_rules.table(DIALECT)


def _splat_constant(value: Any, dtype: Any, shape: Sequence[int]) -> Any:
    raise UnsupportedError(f"a {np.dtype(dtype).name} constant of shape {tuple(shape)} in a "
                           "scalar rule of the 'mosaic_gpu' backend")


def _is_array(v: Any) -> bool:
    return isinstance(v, (FA, Expanded))


def _scalar_only(prim: Any) -> Any:
    shared = SHARED[prim]

    def lower(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
        if any(_is_array(a) for a in args):
            dtype = np.dtype(eqn.invars[0].aval.dtype).name
            raise state.fail(f"{eqn.primitive.name} on {dtype} arrays")
        return shared(state, eqn, *args)
    return lower


for _p in SHARED:
    if _p not in (_jax.cond_p, _jax.while_p, _jax.scan_p, *mlir_lowering.CALL_PRIMITIVES):
        rule(_p)(_scalar_only(_p))


def _shared(state: GPULowering, eqn: Any, *args: Any) -> Any:
    return SHARED[eqn.primitive](state, eqn, *args)


def _binary(fa_op: Any) -> Any:
    def lower(state: GPULowering, eqn: Any, x: Any, y: Any, **_: Any) -> Any:
        (x, y), exp = _unexpand(state, eqn, [x, y])
        if not (isinstance(x, FA) or isinstance(y, FA)):
            return _rewrap(_shared(state, eqn, x, y), exp)
        dtype = eqn.invars[0].aval.dtype
        x, y = _splat_like(x, y, dtype), _splat_like(y, x, dtype)
        return _rewrap(fa_op(x, y), exp)
    return lower


for _p, _op in {
    lax.add_p: lambda a, b: a + b, lax.sub_p: lambda a, b: a - b,
    lax.mul_p: lambda a, b: a * b, lax.div_p: lambda a, b: a / b,
    lax.rem_p: lambda a, b: a % b, lax.max_p: lambda a, b: a.max(b),
    lax.min_p: lambda a, b: a.min(b), lax.and_p: lambda a, b: a & b,
    lax.or_p: lambda a, b: a | b, lax.xor_p: lambda a, b: a ^ b,
    lax.eq_p: lambda a, b: a == b, lax.ne_p: lambda a, b: a != b,
    lax.lt_p: lambda a, b: a < b, lax.le_p: lambda a, b: a <= b,
    lax.gt_p: lambda a, b: a > b, lax.ge_p: lambda a, b: a >= b,
}.items():
    rule(_p)(_binary(_op))


def _unary(array_op: Callable[[GPULowering, Any, Any], Any]) -> Any:
    """A rule applying ``array_op(state, eqn, x)`` to register arrays, the shared rule to
    scalars."""
    def lower(state: GPULowering, eqn: Any, x: Any, **_: Any) -> Any:
        (x,), exp = _unexpand(state, eqn, [x])
        if not isinstance(x, FA):
            return _rewrap(_shared(state, eqn, x), exp)
        return _rewrap(array_op(state, eqn, x), exp)
    return lower


def _method(name: str, approx_ok: bool = False) -> Any:
    def apply(state: GPULowering, eqn: Any, x: Any) -> Any:
        fn = getattr(x, name)
        return fn(approx=state.approx) if approx_ok else fn()
    return apply


for _p, _name in ((lax.exp_p, "exp"), (lax.exp2_p, "exp2"), (lax.log_p, "log"),
                  (lax.tanh_p, "tanh"), (lax.rsqrt_p, "rsqrt"), (lax.sin_p, "sin"),
                  (lax.cos_p, "cos")):
    rule(_p)(_unary(_method(_name, approx_ok=True)))
rule(lax.abs_p)(_unary(_method("abs")))
rule(lax.neg_p)(_unary(lambda state, eqn, x: -x))
rule(lax.not_p)(_unary(lambda state, eqn, x: ~x))


@rule(lax.logistic_p)
@_unary
def _logistic(state: GPULowering, eqn: Any, x: Any) -> Any:
    one = splat(scalar_constant(1.0, eqn.invars[0].aval.dtype), x.shape,
                eqn.invars[0].aval.dtype)
    return one / ((-x).exp(approx=state.approx) + 1.0)


@rule(lax.integer_pow_p)
@_unary
def _integer_pow(state: GPULowering, eqn: Any, x: Any) -> Any:
    y = eqn.params["y"]
    if y < 1:
        raise state.fail(f"integer_pow with exponent {y} on "
                         f"{np.dtype(eqn.invars[0].aval.dtype).name} arrays")
    out = x
    for _step in range(y - 1):
        out = out * x
    return out


@rule(lax.convert_element_type_p)
@_unary
def _convert(state: GPULowering, eqn: Any, x: Any) -> Any:
    dst = eqn.outvars[0].aval.dtype
    return x.astype(element_type(dst), is_signed=signed(dst))


@rule(lax.select_n_p)
def _select(state: GPULowering, eqn: Any, pred: Any, *cases: Any, **_: Any) -> Any:
    unwrapped, exp = _unexpand(state, eqn, [pred, *cases])
    pred, cases = unwrapped[0], tuple(unwrapped[1:])
    if not any(isinstance(v, FA) for v in (pred, *cases)):
        return _rewrap(_shared(state, eqn, pred, *cases), exp)
    if len(cases) != 2 or eqn.invars[0].aval.dtype != np.bool_:
        raise state.fail(f"select_n on {np.dtype(eqn.outvars[0].aval.dtype).name} arrays with "
                         "more than two cases or an integer selector")
    on_false, on_true = cases
    dtype = eqn.outvars[0].aval.dtype
    like = next(v for v in (pred, on_true, on_false) if isinstance(v, FA))
    pred = _splat_like(pred, like, np.bool_)
    on_true, on_false = _splat_like(on_true, like, dtype), _splat_like(on_false, like, dtype)
    return _rewrap(pred.select(on_true, on_false), exp)


@rule(lax.iota_p)
def _iota(state: GPULowering, eqn: Any, *, dtype: Any, shape: Any, dimension: int,
          **_: Any) -> Any:
    return FA.broadcasted_iota(element_type(dtype), tuple(shape), dimension,
                               layout_for(shape), is_signed=signed(dtype))


@rule(lax.broadcast_in_dim_p)
def _broadcast_in_dim(state: GPULowering, eqn: Any, x: Any, *dyn: Any, shape: Any,
                      broadcast_dimensions: Any, **_: Any) -> Any:
    shape, dims = tuple(shape), tuple(broadcast_dimensions)
    dtype = eqn.outvars[0].aval.dtype
    if isinstance(x, Expanded):
        x, dims = x.array, tuple(dims[d] for d in x.dims)
    if not isinstance(x, FA):
        return splat(x, shape, dtype)
    if isinstance(x.layout, mgpu.WGSplatFragLayout):
        return FA.splat(x.registers.flat[0], shape, is_signed=x.is_signed)
    if tuple(x.shape) == shape:
        return x
    full = [d for d in range(len(shape)) if d not in dims]
    if all(shape[d] == 1 for d in full):
        return Expanded(x, shape, dims)
    try:
        return x.broadcast_in_dim(shape, dims, layout_for(shape))
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"broadcasting {x.shape} in layout {x.layout} to {shape} ({e})"
                         ) from None


@rule(lax.reshape_p, lax.squeeze_p)
def _reshape(state: GPULowering, eqn: Any, x: Any, *dyn: Any, **_: Any) -> Any:
    shape = tuple(eqn.outvars[0].aval.shape)
    if not isinstance(x, (FA, Expanded)):
        return x
    if isinstance(x, Expanded):
        if math.prod(shape) == math.prod(x.array.shape) and tuple(
                d for d in shape if d != 1) == tuple(d for d in x.array.shape if d != 1):
            if shape == tuple(x.array.shape):
                return x.array
            kept = [i for i, d in enumerate(shape) if d != 1]
            return Expanded(x.array, shape, tuple(kept))
        raise state.fail(f"reshaping {x.shape} to {shape}")
    if isinstance(x.layout, mgpu.WGSplatFragLayout):
        return FA.splat(x.registers.flat[0], shape, is_signed=x.is_signed)
    if tuple(d for d in shape if d != 1) == tuple(d for d in x.shape if d != 1):
        kept_dims = tuple(i for i, d in enumerate(shape) if d != 1)
        return Expanded(x, shape, kept_dims) if len(kept_dims) == len(x.shape) else \
            x.reshape(shape)
    try:
        return x.reshape(shape)
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"reshaping {x.shape} to {shape} ({e})") from None


_REDUCE = {lax.reduce_sum_p: "add", lax.reduce_max_p: "max", lax.reduce_min_p: "min"}


@rule(*_REDUCE)
def _reduce(state: GPULowering, eqn: Any, x: Any, *, axes: Any, **_: Any) -> Any:
    what = f"{eqn.primitive.name} on {np.dtype(eqn.invars[0].aval.dtype).name}"
    if not isinstance(x, FA):
        raise state.fail(f"{what} of a scalar")
    op = _REDUCE[eqn.primitive]
    if isinstance(x.layout, mgpu.WGSplatFragLayout):
        raise state.fail(f"{what} of a constant array")
    try:
        return x.reduce(op, tuple(axes))
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"{what} over axes {tuple(axes)} of {x.shape} in "
                         f"layout {x.layout} ({e})") from None


# --- matmul ----------------------------------------------------------------------------------


@rule(lax.transpose_p, lazy=True)
def _transpose(state: GPULowering, eqn: Any, x: Any, *, permutation: Any, **_: Any) -> Any:
    if isinstance(x, Loaded) and tuple(permutation) == (1, 0):
        return Loaded(x.ref, not x.transposed)
    raise state.fail("a transpose (other than of an SMEM block used as a dot operand)")


def _operand_ref(state: GPULowering, v: Any, what: str) -> Ref:
    if not isinstance(v, Loaded) or not v.ref.tiled:
        raise state.fail(
            f"a dot whose {what} operand is not a whole SMEM block of a 16-bit dtype with both "
            "dimensions multiples of 64 (wgmma reads its B operand from such tiled SMEM)")
    return v.ref


def _transposed(ref: Ref) -> Any:
    rank = len(tile_shape(ref.shape, ref.dtype))
    perm = [*range(rank - 4), rank - 3, rank - 4, rank - 1, rank - 2]
    return mgpu.memref_transpose(ref.memref, tuple(perm))


def wgmma_into(state: GPULowering, acc: Any, a: Any, b: Any, a_t: bool = False,
               b_t: bool = False) -> Any:
    """``acc + a @ b`` (``a``/``b`` transposed when asked) issued as wgmma."""
    if isinstance(a, (Loaded, Ref)):
        a_ref = a.ref if isinstance(a, Loaded) else a
        a_op = _transposed(a_ref) if a_t else a_ref.memref
    else:
        if a_t:
            raise state.fail("a dot with a transposed register operand")
        a_op = relayout(a, WGMMA)
    b_ref = b.ref if isinstance(b, Loaded) else b
    b_op = _transposed(b_ref) if b_t else b_ref.memref
    try:
        return mgpu.wgmma(acc, a_op, b_op, swizzle=SWIZZLE)
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"this wgmma ({e})") from None


@rule(lax.dot_general_p, lazy=True)
def _dot(state: GPULowering, eqn: Any, a: Any, b: Any, *, dimension_numbers: Any,
         preferred_element_type: Any = None, **_: Any) -> Any:
    (ca, cb), (ba, bb) = dimension_numbers
    if ba or bb or len(eqn.invars[0].aval.shape) != 2 or len(eqn.invars[1].aval.shape) != 2:
        raise state.fail("a batched or non-2-D dot")
    a_t, b_t = tuple(ca) == (0,), tuple(cb) == (1,)
    if isinstance(a, Loaded) and a.transposed:
        a, a_t = Loaded(a.ref), not a_t
    if isinstance(b, Loaded) and b.transposed:
        b, b_t = Loaded(b.ref), not b_t
    if not isinstance(b, Loaded):
        raise state.fail(
            "a dot whose right operand is not read straight from an SMEM block (wgmma reads "
            "B from shared memory: write jnp.dot(x, b_ref[...]))")
    _operand_ref(state, b, "right")
    if isinstance(a, Loaded):
        _operand_ref(state, a, "left")
    out_dtype = eqn.outvars[0].aval.dtype
    m, n = eqn.outvars[0].aval.shape
    acc_dtype = np.float32 if is_float(out_dtype) else np.int32
    acc = mgpu.WGMMAAccumulator.zero(m, n, element_type(acc_dtype))
    acc = wgmma_into(state, acc, a, b, a_t, b_t)
    nvvm.wgmma_wait_group_sync_aligned(0)
    out = acc.value
    if np.dtype(out_dtype) != np.dtype(acc_dtype):
        out = out.astype(element_type(out_dtype), is_signed=signed(out_dtype))
    return out


# --- control flow ----------------------------------------------------------------------------


@rule(prims.program_id_p)
def _program_id(state: GPULowering, eqn: Any, *, axis: int, **_: Any) -> Any:
    return state.program_ids[axis]


@rule(_jax.axis_index_p)
def _axis_index(state: GPULowering, eqn: Any, *, axis_name: Any, **_: Any) -> Any:
    name = axis_name[0] if isinstance(axis_name, tuple) and len(axis_name) == 1 else axis_name
    if name not in state.axes:
        raise state.fail(f"jax.lax.axis_index({name!r}) (the kernel's axes are "
                         f"{sorted(state.axes)})")
    return state.axes[name]


@rule(*mlir_lowering.CALL_PRIMITIVES, lazy=True)
def _call(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
    jaxpr, consts = mlir_lowering.called_jaxpr(eqn)
    return lower_jaxpr(state, jaxpr, consts, args)


@rule(_jax.cond_p, lazy=True)
def _cond(state: GPULowering, eqn: Any, pred: Any, *args: Any, branches: Any, **_: Any) -> Any:
    pred = state.value(pred)
    if isinstance(pred, FA):
        raise state.fail("a branch on an array")
    taken = warp_specialized_lowering.static_predicate(pred)
    if taken is not None:  # a branch known here (warpgroups_run_concurrently): only it
        branch = branches[min(max(taken, 0), len(branches) - 1)]
        return lower_jaxpr(state, branch.jaxpr, branch.consts, args)
    if len(branches) != 2:
        raise state.fail("lax.switch with more than two branches")
    if eqn.outvars:
        out_avals = [v.aval for v in eqn.outvars]
        if any(a.shape for a in out_avals):
            raise state.fail("a conditional returning arrays (write them to Refs instead)")
    cond = arith.cmpi(arith.CmpIPredicate.ne, i32(pred) if not isinstance(pred.type,
                      ir.IntegerType) or ir.IntegerType(pred.type).width != 1 else
                      arith.extui(ir.IntegerType.get_signless(32), pred), i32(0))
    keys = sorted(state.accs)
    result_types = [element_type(v.aval.dtype) for v in eqn.outvars]
    before = {k: state.accs[k] for k in keys}
    acc_leaves, acc_tree = jax.tree_util.tree_flatten([before[k] for k in keys])
    leaves_types = [leaf.type for leaf in acc_leaves]
    op = scf.IfOp(cond, result_types + leaves_types, has_else=True)
    for block, branch in ((op.then_block, branches[1]), (op.else_block, branches[0])):
        with ir.InsertionPoint(block):
            for k in keys:
                state.accs[k] = before[k]
            outs = lower_jaxpr(state, branch.jaxpr, branch.consts, args)
            outs = [state.value(o) for o in outs]
            leaves = jax.tree_util.tree_flatten([state.accs[k] for k in keys])[0]
            scf.YieldOp([*outs, *leaves])
    results = list(op.results)
    n = len(result_types)
    done = jax.tree_util.tree_unflatten(acc_tree, results[n:])
    for k, v in zip(keys, done):
        state.accs[k] = v
    return results[:n]


@rule(_jax.scan_p, lazy=True)
def _scan(state: GPULowering, eqn: Any, *args: Any, jaxpr: Any, length: int,
          reverse: bool, **_: Any) -> Any:
    consts, carry, xs, split_out = _jax.scan_parts(eqn.params, args)
    if xs or reverse:
        raise state.fail("lax.scan over arrays or reversed (use lax.fori_loop)")
    carry = [state.value(c) for c in carry]

    def body(i: ir.Value, vals: list[Any]) -> list[Any]:
        outs, ys = split_out(lower_jaxpr(state, jaxpr.jaxpr, jaxpr.consts, [*consts, *vals]))
        if ys:
            raise state.fail("lax.scan with stacked outputs")
        return outs

    return emit_for(state, length, carry, body)


@rule(_jax.while_p, lazy=True)
def _while(state: GPULowering, eqn: Any, *args: Any, cond_jaxpr: Any, body_jaxpr: Any,
           cond_nconsts: int, body_nconsts: int, **_: Any) -> Any:
    cconsts = args[:cond_nconsts]
    bconsts = args[cond_nconsts:cond_nconsts + body_nconsts]
    init = [state.value(a) for a in args[cond_nconsts + body_nconsts:]]
    # fori_loop(lo, hi, f, x) with dynamic bounds: (i, hi, x) carried, i < hi tested.
    cj = cond_jaxpr.jaxpr
    fori = (len(cj.eqns) == 1 and cj.eqns[0].primitive is lax.lt_p and not cconsts
            and cj.eqns[0].invars[0] is cj.invars[0] and cj.eqns[0].invars[1] is cj.invars[1])
    if not fori:
        raise state.fail("a while loop (use lax.fori_loop)")
    lo, hi, rest = init[0], init[1], init[2:]

    def body(i: ir.Value, vals: list[Any]) -> list[Any]:
        outs = lower_jaxpr(state, body_jaxpr.jaxpr, body_jaxpr.consts,
                           [*bconsts, i, hi, *vals])
        return outs[2:]

    n = arith.maxsi(arith.subi(i32(hi), i32(lo)), i32(0))
    outs = emit_for(state, n, rest, body, start=lo)
    return [arith.maxsi(i32(hi), i32(lo)), hi, *outs]


@rule(prims.run_scoped_p, lazy=True)
def _run_scoped(state: GPULowering, eqn: Any, *consts: Any, jaxpr: Any, scoped: Any,
                **_: Any) -> Any:
    warp_specialized_lowering.enter_run_scoped(state, eqn)
    refs = []
    allocated = state.scoped.get(id(eqn))
    if allocated is None:
        raise PallasError("internal: a pl.run_scoped the shared-memory plan did not see")
    for n, mref in enumerate(scoped):
        if mref.memory_space is ACC_SPACE:
            key = id(eqn) * 100 + n
            state.accs[key] = mgpu.WGMMAAccumulator.zero(*mref.shape,
                                                         element_type(mref.dtype))
            refs.append(Ref("acc", tuple(mref.shape), mref.dtype, acc_key=key))
        else:
            refs.append(allocated[n])
    outs = lower_jaxpr(state, jaxpr.jaxpr, jaxpr.consts, [*consts, *refs])
    for r in refs:
        state.accs.pop(r.acc_key, None)
    return outs


@rule(prims.multiple_of_p)
def _multiple_of(state: GPULowering, eqn: Any, x: Any, **_: Any) -> Any:
    return x


# --- this backend's primitives -----------------------------------------------------------------


def _views(state: GPULowering, eqn: Any, args: Sequence[Any]) -> list[Ref]:
    roles = eqn.params["roles"]
    n_refs = max(roles) + 1 if roles else 0
    tree = eqn.params["tree"]
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    views = [_view(state, args[r], t) for r, t in zip(roles, transforms)]
    if eqn.primitive is not gp.wgmma_p and any(v.transposed for v in views):
        raise state.fail(f"a transposed SMEM Ref given to {eqn.primitive.name} (only wgmma "
                         "reads transposed buffers)")
    # A Barrier of one barrier may be passed without indexing it.
    return [dataclasses.replace(v, barrier=v.barrier[0], shape=())
            if v.kind == "barrier" and v.shape == (1,) else v for v in views]


def _gmem_window(state: GPULowering, eqn: Any, args: Sequence[Any], role: int
                 ) -> tuple[Any, tuple[Any, ...]]:
    """The kernel's GMEM memref and the window of it a copy's view ``role`` names (TMA
    descriptors are made for whole kernel operands; the window is the copy's box)."""
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    ref = args[roles[role]]
    if ref.kind != "gmem":
        raise state.fail(f"a TMA copy whose GMEM side is a {ref.kind} Ref")
    # Per dimension of the operand: (start, size), or (index, None) once an int indexes it;
    # successive indexers (``ref.at[g].at[rows]``) apply to the dimensions still there.
    dims: list[tuple[Any, int | None]] = [(0, d) for d in ref.shape]
    for t in transforms[role]:
        indices = getattr(t, "indices", None)
        if indices is None:
            raise state.fail("this view of a GMEM Ref in a copy (slices and ints only)")
        open_dims = [k for k, (_, size) in enumerate(dims) if size is not None]
        for k, i in zip(open_dims, indices):
            base = dims[k][0]
            if isinstance(i, _jax.Slice):
                if not isinstance(i.stride, int) or i.stride != 1:
                    raise state.fail("a strided slice of a GMEM Ref in a copy")
                start = i.start if isinstance(i.start, (int, np.integer)) else \
                    state.value(i.start)
                dims[k] = (_add_index(base, start), int(i.size))
            else:
                dims[k] = (_add_index(base, state.value(i)), None)
    window = tuple(mgpu.ds(index(start), size) if size is not None else index(start)
                   for start, size in dims) if transforms[role] else ()
    return ref.memref, window


def _add_index(a: Any, b: Any) -> Any:
    """``a + b`` of two ints or index-like scalars (an int when both are ints)."""
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return int(a) + int(b)
    if isinstance(a, (int, np.integer)) and a == 0:
        return b
    return arith.addi(index(a), index(b))


@rule(gp.copy_gmem_to_smem_p, lazy=True)
def _copy_in(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
    _src_view, dst, bar = _views(state, eqn, args)
    src, window = _gmem_window(state, eqn, args, 0)
    tma.copy(state.launch, gmem=src, smem=dst.memref, window=window, to_smem=True,
             barrier=bar.barrier, aligned=False, kernel=state.call.name,
             tiling=tile_transform(dst.dtype) if dst.tiled else None,
             swizzle=SWIZZLE if dst.tiled else None)
    return []


@rule(gp.copy_smem_to_gmem_p, lazy=True)
def _copy_out(state: GPULowering, eqn: Any, *args: Any, commit_group: bool = True,
              **_: Any) -> Any:
    src, _dst_view = _views(state, eqn, args)
    dst, window = _gmem_window(state, eqn, args, 1)
    tma.copy(state.launch, gmem=dst, smem=src.memref, window=window, to_smem=False,
             aligned=False, kernel=state.call.name, commit=commit_group,
             tiling=tile_transform(src.dtype) if src.tiled else None,
             swizzle=SWIZZLE if src.tiled else None)
    return []


@rule(gp.barrier_wait_p, lazy=True)
def _barrier_wait(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
    (bar,) = _views(state, eqn, args)
    bar.barrier.wait(orders_tensor_core=_orders_tensor_core(eqn))
    return []


def _orders_tensor_core(eqn: Any) -> bool:
    """Whether the barrier of a wait or arrival is a ``Barrier(orders_tensor_core=True)``."""
    space = getattr(eqn.invars[0].aval, "memory_space", None)
    return bool(getattr(space, "orders_tensor_core", False))


@rule(gp.barrier_arrive_p, lazy=True)
def _barrier_arrive(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
    (bar,) = _views(state, eqn, args)
    warp_specialized_lowering.arrive_once(bar.barrier, _orders_tensor_core(eqn))
    return []


@rule(gp.commit_smem_p)
def _commit(state: GPULowering, eqn: Any, **_: Any) -> Any:
    mgpu.commit_shared()
    return []


@rule(gp.wait_smem_to_gmem_p)
def _wait_out(state: GPULowering, eqn: Any, *, n: int, read_only: bool, **_: Any) -> Any:
    state.launch.await_async_copy(n, await_read_only=read_only)
    return []


@rule(gp.wgmma_wait_p)
def _wgmma_wait(state: GPULowering, eqn: Any, *, n: int, **_: Any) -> Any:
    nvvm.wgmma_wait_group_sync_aligned(n)
    return []


@rule(gp.wgmma_p, lazy=True)
def _wgmma(state: GPULowering, eqn: Any, *args: Any, a_is_ref: bool, **_: Any) -> Any:
    views = _views(state, eqn, args)
    acc = views[0]
    a_t = False
    if a_is_ref:
        (a, a_t), (b, b_t) = _untransposed(views[1]), _untransposed(views[2])
        if not a.tiled:
            raise state.fail("plgpu.wgmma with an A operand in untiled SMEM")
    else:
        a, (b, b_t) = state.value(args[-1]), _untransposed(views[1])
    if not b.tiled:
        raise state.fail("plgpu.wgmma with a B operand that is not a tiled SMEM buffer "
                         "(16-bit dtype, both dimensions multiples of 64)")
    state.accs[acc.acc_key] = wgmma_into(state, state.accs[acc.acc_key], a, b, a_t, b_t)
    return []


def kernel_fn(call: KernelCall) -> Callable[..., Any]:
    """:func:`build` in a context of its own (the module is carried as bytes from there)."""
    with _jax.make_ir_context(), ir.Location.unknown():
        return build(call)


from pallas_mosaic_gpu import layout_rules  # noqa: E402, F401, I001 - registers its rules
from pallas_mosaic_gpu import warp_specialized_lowering  # noqa: E402 - registers its rules
