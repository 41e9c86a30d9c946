"""The lowering of a whole kernel call for Mosaic GPU (the rules of :mod:`pallas_mosaic_gpu.rules`
lower the equations of its body): how a traced kernel (a :class:`pallas_core.KernelCall`)
becomes one Mosaic GPU kernel launch, its pipeline over the grid and its shared memory.

The kernel is built with JAX's Mosaic GPU library (``jax.experimental.mosaic.gpu``) in lane
semantics: each warpgroup (128 threads) holds arrays as ``FragmentedArray`` registers spread
over its lanes (:mod:`pallas_mosaic_gpu.values`). ``mgpu.as_gpu_kernel`` wraps the body in a
``gpu.launch`` and the result is emitted as the ``mosaic_gpu_v2`` custom call that JAX's CUDA
runtime executes; the body's equations are lowered by the rules of
:mod:`pallas_mosaic_gpu.rules`.

How a ``pallas_call`` runs (see docs/backends/mosaic_gpu.md):

* parallel grid axes are folded into the CUDA grid's x dimension (one thread block each);
  sequential axes (trailing) are one loop inside the block (:func:`plan`);
* every windowed input has ``max_concurrent_steps`` SMEM buffers filled by TMA copies, each
  with its mbarrier; the copy for step ``t + max_concurrent_steps`` is issued once step ``t``
  (or, with ``delay_release=d``, step ``t - d``) no longer needs the buffer;
* every windowed output has one SMEM buffer, copied out by TMA when its block index is about
  to change (or after the last step);
* ``plgpu.ACC`` accumulators live in registers and are carried through loops;
* scratch buffers and every ``pl.run_scoped`` allocation (:func:`scoped_allocations`) get
  shared memory of their own, laid out by :func:`aligned_smem`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, nvvm

from pallas_core import backend as plb
from pallas_core.backend import (
    BlockMapping,
    KernelCall,
    PallasError,
    UnsupportedError,
    mlir_element_type,
)
from pallas_mosaic_gpu import cluster, smem_layout, tma, values
from pallas_mosaic_gpu.params import (
    ACC_SPACE,
    GMEM,
    PARALLEL,
    SEMAPHORE,
    SEQUENTIAL,
    BarrierSpace,
    GPUCompilerParams,
    TensorMemorySpace,
    asks_tiling,
    tmem_layout,
)
from pallas_mosaic_gpu.rules import lower_jaxpr
from pallas_mosaic_gpu.values import (
    SMEM_ALIGNMENT,
    SWIZZLE,
    WARPGROUP,
    GPULowering,
    Ref,
    bits,
    emit_for,
    i32,
    index,
    is_tileable,
    signed,
    tile_shape,
    tile_transform,
)

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
            if not isinstance(v, plb.Literal):
                d |= deps.get(v, set())
        for o in eqn.outvars:
            deps[o] = d
    out: set[int] = set()
    for v in jaxpr.outvars:
        if not isinstance(v, plb.Literal):
            out |= deps.get(v, set())
    return out


def _carries_scratch(call: KernelCall) -> bool:
    """Whether a step of the kernel reads a scratch buffer before it writes it, and so reads
    what the step before left there (a running sum kept in scratch, as on TPU).

    The kernel's top-level equations are taken in order. A load of a buffer not yet written
    (``get``, ``+=``, a store that is partial or whose old value is used) is such a read; a
    whole store makes the buffer written. A buffer first used in any other way (a TMA copy
    into it, a barrier, a branch or loop) is taken as written: the pipelined kernels that
    fill SMEM by copies stay parallel.
    """
    n = len(call.grid_mapping.scratch_avals)
    if not n:
        return False
    jaxpr = call.jaxpr.jaxpr
    pending = set(jaxpr.invars[len(jaxpr.invars) - n:])
    used = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, plb.Literal)}
    used |= {v for v in jaxpr.outvars if not isinstance(v, plb.Literal)}
    for eqn in jaxpr.eqns:
        touched = {v for v in eqn.invars if not isinstance(v, plb.Literal) and v in pending}
        if not touched:
            continue
        ref = eqn.invars[0]
        if ref in touched:
            if eqn.primitive is plb.get_p or eqn.primitive is plb.addupdate_p:
                return True
            if eqn.primitive is plb.swap_p and (
                    eqn.outvars[0] in used
                    or tuple(eqn.invars[1].aval.shape) != tuple(ref.aval.shape)):
                return True
        pending -= touched
    return False


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
        if _carries_scratch(call):
            # A scratch buffer read before the step writes it keeps a value from the step
            # before: the steps run in order, in one thread block (CUDA blocks share no SMEM).
            revisited |= set(range(nb, len(grid)))
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


class TmemPool:
    """The kernel's TMEM buffers as JAX's Pallas lowering allocates them: one allocation of
    128 lanes by the columns of them all (each buffer's a multiple of 4, the whole a multiple
    of 8, as the tensor memory allocator hands out), and each buffer a view of it at its column
    offset, in its layout (:func:`pallas_mosaic_gpu.params.tmem_layout`: the named one, or
    the library's for its shape and packing)."""

    def __init__(self) -> None:
        self.buffers: list[tuple[tuple[int, ...], Any, Any, int]] = []
        self.cols = 0
        self.collective: set[bool] = set()

    def add(self, shape: Any, dtype: Any, space: Any) -> None:
        shape = tuple(shape)
        layout = tmem_layout(space, shape)
        self.buffers.append((shape, dtype, layout, self.cols))
        cols = layout.cols_in_shape(shape, bits(dtype))
        self.cols += -(-cols // 4) * 4
        self.collective.add(bool(space.collective))

    def allocation(self, call: KernelCall) -> Any:
        """The one TMEM allocation (after the kernel's SMEM buffers), or ``None``."""
        if not self.buffers:
            return None
        if len(self.collective) > 1:
            raise UnsupportedError(
                f"kernel {call.name!r} allocates TMEM both with and without collective=True; "
                "its TMEM is one allocation, made by one block or by the cluster's two. Fix: "
                "allocate every TMEM buffer of the kernel the same way.")
        return mgpu.TMEM((128, -(-self.cols // 8) * 8), np.int32,
                         collective=self.collective.pop())

    def refs(self, pool: Any) -> list[Any]:
        """The buffers' views of ``pool`` (the allocation's ``TMEMRef``), in order."""
        from jax.experimental.mosaic.gpu import tcgen05, utils

        return [tcgen05.TMEMRef(arith.addi(pool.address, i32(offset)), shape,
                                utils.dtype_to_ir_type(dtype), layout)
                for shape, dtype, layout, offset in self.buffers]


def scoped_allocations(call: KernelCall
                       ) -> list[tuple[int, list[tuple[str, tuple[int, ...], Any, Any]]]]:
    """The shared memory every ``pl.run_scoped`` of the kernel allocates, one region per
    ``run_scoped`` (keyed by its equation): ``(kind, shape, dtype, space)`` with kind
    ``"smem"``, ``"smem_plain"`` (a buffer left untiled because the kernel slices its minor
    dimensions, see :mod:`smem_layout`), ``"smem_tiled"`` (an 8-bit or 32-bit buffer tiled
    because its ``transforms`` ask for it or wgmma reads it, see
    :func:`pallas_mosaic_gpu.values.is_tileable`), ``"barrier"``, ``"tmem"`` (TMEM, which the
    library allocates for the whole kernel) or ``"acc"`` (registers)."""
    found: list[tuple[int, list[tuple[str, tuple[int, ...], Any, Any]]]] = []
    seen: set[int] = set()
    for eqn in plb.all_eqns(call.jaxpr.jaxpr):
        if eqn.primitive is not plb.run_scoped_p or id(eqn) in seen:
            continue
        seen.add(id(eqn))
        allocs = []
        for mref in eqn.params["scoped"]:
            space = mref.memory_space
            if space is ACC_SPACE:
                allocs.append(("acc", tuple(mref.shape), mref.dtype, space))
            elif isinstance(space, BarrierSpace):
                allocs.append(("barrier", tuple(mref.shape), mref.dtype, space))
            elif isinstance(space, TensorMemorySpace):  # allocated for the whole kernel
                allocs.append(("tmem", tuple(mref.shape), mref.dtype, space))
            elif space is GMEM:
                raise UnsupportedError(
                    f"kernel {call.name!r}: pl.run_scoped allocates GMEM; the mosaic_gpu "
                    "backend allocates scratch in shared memory only. Fix: allocate "
                    "plgpu.SMEM, or pass the global buffer as an operand.")
            else:
                shape = tuple(mref.shape)
                body = eqn.params["jaxpr"].jaxpr
                var = body.invars[len(body.invars) - len(eqn.params["scoped"]) + len(allocs)]
                allocs.append((_scoped_kind(mref, body, var), shape, mref.dtype, space))
        found.append((id(eqn), allocs))
    return found


def _scoped_kind(mref: Any, body: Any, var: Any) -> str:
    """How a ``pl.run_scoped`` SMEM buffer is laid out (see :func:`scoped_allocations`)."""
    shape = tuple(mref.shape)
    if is_tileable(shape, mref.dtype):
        plain = smem_layout.minor_sliced(body, var, shape) and \
            not smem_layout.read_by_wgmma(body, var)
        return "smem_plain" if plain else "smem"
    if is_tileable(shape, mref.dtype, asked=True) and (
            asks_tiling(mref) or smem_layout.read_by_wgmma(body, var)):
        return "smem_tiled"
    return "smem"


def entry_bytes(entry: Any) -> int:
    """The bytes the Mosaic GPU library gives one entry of a shared-memory tree: a buffer's
    size, 8 per barrier, 4 for the TMEM allocation's address."""
    if isinstance(entry, (mgpu.Barrier, mgpu.ClusterBarrier)):
        return 8 * int(entry.num_barriers)
    if isinstance(entry, mgpu.TMEM):
        return 4
    return math.prod(entry.shape) * bits(entry.dtype) // 8


def _barriers(call: KernelCall, mesh: Any, space: BarrierSpace, n: int) -> Any:
    """What the library allocates for ``n`` barriers of ``space``: a ``plgpu.ClusterBarrier``
    (the library initialises it for the cluster, which meets before the kernel body) or a
    ``plgpu.Barrier``."""
    if not space.collective_axes:
        return mgpu.Barrier(space.num_arrivals, num_barriers=n)
    dims = cluster.cluster_dims(mesh, space.collective_axes, "plgpu.ClusterBarrier",
                                lambda m: UnsupportedError(f"kernel {call.name!r}: {m}."))
    return mgpu.ClusterBarrier(dims, space.num_arrivals, n,
                               orders_tensor_core=space.orders_tensor_core,
                               leader_tracked=space.leader_tracked)


def aligned_smem(entries: Sequence[Any]) -> tuple[tuple[Any, ...], list[int]]:
    """The shared-memory tree ``mgpu.as_gpu_kernel`` lays out (in order, without gaps) for
    ``entries`` (buffers and barriers): every buffer first, each starting at a multiple of
    :data:`SMEM_ALIGNMENT` bytes, then the barriers (8 bytes each), with ``uint8`` padding
    between them. Returns the tree and, for each entry, its index in the tree."""
    barrier_types = (mgpu.Barrier, mgpu.ClusterBarrier)
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
            offset += entry_bytes(entry)
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


@dataclasses.dataclass
class SharedMemory:
    """The shared memory :func:`build` allocates for a kernel (:func:`shared_memory`), in the
    order it allocates it; :func:`aligned_smem` lays the entries out."""

    entries: list[Any]
    """Buffers (``jax.ShapeDtypeStruct``), barriers and the one TMEM allocation's address."""
    names: list[str]
    """What each entry holds, for ``pl.report`` (``"input 0 (x_ref) (2 x block (64, 128)
    float32)"``)."""
    slots: int
    """Buffers per windowed input (``max_concurrent_steps``, at most the sequential steps)."""
    steps: int
    """Steps of the sequential loop inside a thread block."""
    buffers: list[tuple[str, int, Any]]
    """``(kind, operand index, tiled)`` of each windowed operand with a buffer of its own."""
    scratch_refs: list[Any]
    """``(kind, shape, dtype)`` of each scratch operand."""
    n_main: int
    """Entries of the operands and scratch; the ``pl.run_scoped`` ones follow."""
    scoped: list[tuple[int, list[tuple[str, tuple[int, ...], Any, Any]]]]
    tmem: TmemPool
    tmem_pool: Any
    reuse: dict[int, tuple[int, int]]
    """Outputs staged in an input's buffer (:mod:`pallas_mosaic_gpu.smem_reuse`)."""


def shared_memory(call: KernelCall, reuse: dict[int, tuple[int, int]] | None = None
                  ) -> SharedMemory:
    """What :func:`build` allocates in shared memory for ``call``: per windowed input
    ``slots`` buffers and as many barriers, per windowed output a buffer (unless ``reuse``,
    by default :func:`pallas_mosaic_gpu.smem_reuse.reused`, stages it in an input's), then
    scratch, then every ``pl.run_scoped`` allocation, and the TMEM allocation's address."""
    gm = call.grid_mapping
    pl_ = plan(call)
    params = call.compiler_params if isinstance(call.compiler_params, GPUCompilerParams) else \
        GPUCompilerParams()
    ins, outs = _operands(call)
    steps = math.prod(gm.grid[a] for a in pl_.sequential_axes)
    slots = 1 if steps <= 1 else min(params.max_concurrent_steps, steps)
    smem: list[Any] = []
    names: list[str] = []
    buffers: list[tuple[str, int, Any]] = []  # (kind, operand index, tiled)

    def add(entry: Any, name: str) -> None:
        smem.append(entry)
        names.append(name)

    def buf_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
        return tile_shape(shape, dtype) if is_tileable(shape, dtype) else tuple(shape)

    def window_tiled(pos: int, bm: BlockMapping) -> bool:
        # 16-bit blocks of whole tiles always; 8-bit and 32-bit ones that a matmul reads.
        shape, body = bm.ref_shape, call.jaxpr.jaxpr
        return is_tileable(shape, bm.dtype) or (is_tileable(shape, bm.dtype, asked=True) and
                                                smem_layout.read_by_wgmma(body, body.invars[pos]))

    def window_shape(tiled: bool, bm: BlockMapping) -> tuple[int, ...]:
        return tile_shape(bm.ref_shape, bm.dtype) if tiled else tuple(bm.ref_shape)

    def what(shape: Any, dtype: Any) -> str:
        return f"{tuple(shape)} {np.dtype(dtype).name}"

    for k, bm in enumerate(ins):
        if _windowed(bm):
            tiled = window_tiled(k, bm)
            add(jax.ShapeDtypeStruct((slots, *window_shape(tiled, bm)), bm.dtype),
                f"{bm.origin} ({slots} x block {what(bm.ref_shape, bm.dtype)})")
            add(mgpu.Barrier(1, slots), f"{bm.origin} barriers ({slots})")  # the TMA's arrival
            buffers.append(("in", k, tiled))
    if reuse is None:
        from pallas_mosaic_gpu import smem_reuse
        reuse = smem_reuse.reused(call)  # outputs staged in an input's buffer
    for k, bm in enumerate(outs):
        if _windowed(bm) and k not in reuse:
            tiled = window_tiled(len(ins) + k, bm)
            add(jax.ShapeDtypeStruct(window_shape(tiled, bm), bm.dtype),
                f"{bm.origin} (block {what(bm.ref_shape, bm.dtype)})")
            buffers.append(("out", k, tiled))
    scratch_refs: list[Any] = []
    tmem = TmemPool()
    for i, a in enumerate(gm.scratch_avals):
        shape, dtype, space = a.inner_aval.shape, a.inner_aval.dtype, a.memory_space
        name = f"scratch {i} {what(shape, dtype)}"
        if isinstance(space, BarrierSpace):
            add(_barriers(call, pl_.mesh, space, math.prod(shape)),
                f"scratch {i} ({math.prod(shape)} barriers)")
            scratch_refs.append(("barrier", shape, dtype))
        elif space is ACC_SPACE:
            scratch_refs.append(("acc", shape, dtype))
        elif isinstance(space, TensorMemorySpace):
            tmem.add(shape, dtype, space)
            scratch_refs.append(("tmem", shape, dtype))
        elif space is SEMAPHORE:
            scratch_refs.append(("sem", shape, dtype))
        elif asks_tiling(a) and is_tileable(shape, dtype, asked=True):  # 8/32-bit, asked
            add(jax.ShapeDtypeStruct(tile_shape(shape, dtype), dtype), name)
            scratch_refs.append(("smem_tiled", shape, dtype))
        else:
            add(jax.ShapeDtypeStruct(buf_shape(shape, dtype), dtype), name)
            scratch_refs.append(("smem", shape, dtype))
    n_main = len(smem)
    scoped = scoped_allocations(call)
    for _, allocs in scoped:
        for kind, shape, dtype, space in allocs:
            name = f"pl.run_scoped {what(shape, dtype)}"
            if kind == "barrier":
                add(_barriers(call, pl_.mesh, space, math.prod(shape)),
                    f"pl.run_scoped ({math.prod(shape)} barriers)")
            elif kind == "smem":
                add(jax.ShapeDtypeStruct(buf_shape(shape, dtype), dtype), name)
            elif kind == "smem_tiled":
                add(jax.ShapeDtypeStruct(tile_shape(shape, dtype), dtype), name)
            elif kind == "smem_plain":
                add(jax.ShapeDtypeStruct(tuple(shape), dtype), name)
            elif kind == "tmem":
                tmem.add(shape, dtype, space)
    tmem_pool = tmem.allocation(call)
    if tmem_pool is not None:
        add(tmem_pool, "TMEM address")
    return SharedMemory(smem, names, slots, steps, buffers, scratch_refs, n_main, scoped, tmem,
                        tmem_pool, reuse)


def build(call: KernelCall, devices: tuple[tuple[str, int], ...] = ()
          ) -> Callable[..., Any]:
    """The Mosaic GPU kernel of ``call`` as a function of its operands (``mgpu.as_gpu_kernel``);
    it must be called inside an MLIR context (see :func:`kernel_fn`). ``devices``: the
    ``shard_map`` mesh axes it runs under (``lax.axis_index`` of them reads the device id).

    Semaphore scratch (``plgpu.SemaphoreType.REGULAR``) is one int32 array in global memory,
    each thread block's semaphores side by side (block-major), zeroed before the call and
    passed as an in-out operand of it (its result is dropped), as JAX's lowering does."""
    arch = _check_spaces(call)
    pl_ = plan(call)
    params = call.compiler_params if isinstance(call.compiler_params, GPUCompilerParams) else \
        GPUCompilerParams()
    ins, outs = _operands(call)
    sm = shared_memory(call)
    slots, steps, buffers, scratch_refs = sm.slots, sm.steps, sm.buffers, sm.scratch_refs
    n_main, scoped, tmem, tmem_pool, reuse = sm.n_main, sm.scoped, sm.tmem, sm.tmem_pool, sm.reuse
    n_main_tmem = sum(kind == "tmem" for kind, _, _ in scratch_refs)
    smem_tree, smem_positions = aligned_smem(sm.entries)

    # Aliased inputs are the library's in-out operands: passed after the other inputs, their
    # buffers written in place and returned after the other outputs.
    aliases = dict(call.input_output_aliases)
    plain_in = [i for i in range(len(ins)) if i not in aliases]
    alias_in = sorted(aliases)
    plain_out = [j for j in range(len(outs)) if j not in aliases.values()]

    n_sems = sum(math.prod(shape) for kind, shape, _ in scratch_refs if kind == "sem")
    global_sems = _global_semaphores(call)
    n_global = sum(math.prod(shape) for _, shape in global_sems.values())
    if n_sems and n_global:
        raise UnsupportedError(
            f"kernel {call.name!r} has both semaphores of its own per block (scratch_types) "
            "and semaphores all blocks share (pl.get_global); the mosaic_gpu backend passes "
            "one semaphore array. Fix: use one kind.")
    sem_shapes = (jax.ShapeDtypeStruct((math.prod(pl_.grid) * n_sems,), np.int32),) \
        if n_sems else (jax.ShapeDtypeStruct((n_global,), np.int32),) if n_global else ()

    def body(launch: Any, *args: Any) -> None:
        refs = list(args[:-1])
        gmem_in: list[Any] = [None] * len(ins)
        for i, r in zip(plain_in + alias_in, refs):
            gmem_in[i] = r
        sems = refs[len(ins)] if sem_shapes else None
        gmem_out: list[Any] = [None] * len(outs)
        for j, r in zip(plain_out, refs[len(ins) + len(sem_shapes):]):
            gmem_out[j] = r
        for i in alias_in:
            gmem_out[aliases[i]] = gmem_in[i]
        gmem = gmem_in + gmem_out
        smem_refs = [args[-1][p] for p in smem_positions]
        state = GPULowering(call, "mosaic_gpu", launch=launch, approx=params.approx_math,
                            devices=tuple(devices))
        for key, (start, shape) in global_sems.items():  # pl.get_global: shared by all
            state.global_sems[key] = mgpu.memref_reshape(
                mgpu.memref_slice(sems, mgpu.ds(index(start), math.prod(shape))), shape)
        rest = iter(smem_refs[n_main:])
        tmem_refs = tmem.refs(smem_refs[-1]) if tmem_pool is not None else []
        scoped_tmem = iter(tmem_refs[n_main_tmem:])
        for key, allocs in scoped:
            state.scoped[key] = [
                Ref(kind, tuple(shape), dtype, barrier=next(rest)) if kind == "barrier" else
                Ref(kind, tuple(shape), dtype, memref=next(scoped_tmem)) if kind == "tmem" else
                Ref("smem", tuple(shape), dtype, memref=next(rest),
                    tiled=kind == "smem_tiled" or (kind == "smem" and is_tileable(shape, dtype)))
                if kind in ("smem", "smem_plain", "smem_tiled") else None
                for kind, shape, dtype, _ in allocs]
        with values.one_thread_predicates():
            _emit(state, pl_, gmem, smem_refs[:n_main], buffers, scratch_refs, slots, steps,
                  params.delay_release, reuse, (sems, n_sems), iter(tmem_refs[:n_main_tmem]))

    in_shapes = tuple(jax.ShapeDtypeStruct(ins[i].array_shape, ins[i].dtype) for i in plain_in)
    inout_shapes = tuple(jax.ShapeDtypeStruct(ins[i].array_shape, ins[i].dtype)
                         for i in alias_in) + sem_shapes
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
        zeros = [jax.numpy.zeros(s.shape, s.dtype) for s in sem_shapes]
        res = list(kernel(*[operands[i] for i in plain_in + alias_in], *zeros))
        res = res[:len(res) - len(sem_shapes)]  # the semaphores' final counts
        out: list[Any] = [None] * len(outs)
        for j, r in zip(plain_out, res):
            out[j] = r
        for i, r in zip(alias_in, res[len(plain_out):]):
            out[aliases[i]] = r
        return out

    return run


def _global_semaphores(call: KernelCall) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Where the semaphores of each ``pl.get_global`` of the kernel (by equation) start in
    the kernel's semaphore array, and their shape."""
    found: dict[int, tuple[int, tuple[int, ...]]] = {}
    start = 0
    for eqn in plb.all_eqns(call.jaxpr.jaxpr):
        if eqn.primitive is not plb.get_global_p or id(eqn) in found:
            continue
        what = eqn.params["what"]
        if what.memory_space is not SEMAPHORE:
            raise UnsupportedError(
                f"kernel {call.name!r}: pl.get_global of {what} (the mosaic_gpu backend gives "
                "global semaphores only). Fix: pl.get_global(plgpu.SemaphoreType.REGULAR).")
        shape = tuple(what.shape)
        found[id(eqn)] = (start, shape)
        start += math.prod(shape)
    return found


def _emit(state: GPULowering, pl_: Plan, gmem: list[Any], smem: list[Any],
          buffers: list[tuple[str, int, Any]], scratch: list[Any], slots: int, steps: int,
          delay: int, reuse: dict[int, tuple[int, int]],
          sems: tuple[Any, int] = (None, 0), tmem: Any = None) -> None:
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
    sem_buf, n_sems = sems
    sem_used = 0
    for n, (kind, shape, dtype) in enumerate(scratch):
        if kind == "sem":  # this block's semaphores, after those of the blocks before it
            size = math.prod(shape)
            start = arith.addi(arith.muli(index(mgpu.utils.block_idx()), index(n_sems)),
                               index(sem_used))
            mem = mgpu.memref_reshape(mgpu.memref_slice(sem_buf, mgpu.ds(start, size)),
                                      tuple(shape))
            sem_used += size
            scratch_vals.append(Ref("gmem", tuple(shape), dtype, memref=mem))
        elif kind == "acc":
            key = 1000 + n
            state.accs[key] = mgpu.WGMMAAccumulator.zero(
                *shape, mlir_element_type(dtype), is_signed=signed(dtype))
            scratch_vals.append(Ref("acc", tuple(shape), dtype, acc_key=key))
        elif kind == "barrier":
            scratch_vals.append(Ref("barrier", tuple(shape), dtype, barrier=next(smem_it)))
        elif kind == "tmem":
            scratch_vals.append(Ref("tmem", tuple(shape), dtype, memref=next(tmem)))
        else:
            scratch_vals.append(Ref("smem", tuple(shape), dtype, memref=next(smem_it),
                                    tiled=kind == "smem_tiled" or is_tileable(shape, dtype)))
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


def kernel_fn(call: KernelCall, devices: tuple[tuple[str, int], ...] = ()
              ) -> Callable[..., Any]:
    """:func:`build` in a context of its own (the module is carried as bytes from there)."""
    with plb.make_ir_context(), ir.Location.unknown():
        return build(call, devices)
