"""Operations of ``jax.experimental.pallas.mosaic_gpu`` that JAX added late or that compose
what this backend has: ``barrier_test`` (a non-blocking ``barrier_wait``),
``async_copy_smem_to_tmem`` (an SMEM buffer into TMEM), ``format_tcgen05_sparse_metadata``
``async_store_smem`` and ``cluster_ref`` (another block's SMEM, in the interpreter).
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic import gpu as mgpu

from pallas_core import backend as plb
from pallas_core.backend import PallasError, RefViews, UnsupportedError, bind_views
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu import registry
from pallas_mosaic_gpu.multidevice import RefView

barrier_test_p = plb.Primitive("gpu_barrier_test")
barrier_test_p.multiple_results = True


@barrier_test_p.def_effectful_abstract_eval
def _test_abstract(*avals: Any, **_: Any) -> Any:
    return [plb.ShapedArray((), np.dtype(np.bool_))], {plb.ReadEffect(0), plb.WriteEffect(0)}


def barrier_test(barrier: Any) -> jax.Array:
    """Whether ``barrier`` has completed the phase a ``barrier_wait`` would wait for now
    (a bool), without blocking; when it has, the test counts as that wait (the next wait or
    test is for the phase after). JAX allows it in a warp context (``pl.core_map`` over
    ``plgpu.WarpMesh``); here a warpgroup may test too."""
    gp._check_barrier(barrier, "barrier_test")
    (done,) = bind_views(barrier_test_p, [barrier], [], "barrier_test", test=True)
    return done  # type: ignore[no-any-return]


def _test(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
          test: bool = True) -> Any:
    # Where one point runs alone: copies and arrivals have all happened by now, and the
    # counter holds the arrivals of the phases completed (as barrier_wait reads it).
    state = RefViews(args, tree, roles)
    need = int(getattr(in_avals[0].memory_space, "num_arrivals", 1) or 1)
    return state.new_values(), [jnp.all(state.read(0) >= need)]


@registry.rule(barrier_test_p, lazy=True)
def _test_rule(state: Any, eqn: Any, *args: Any, **_: Any) -> Any:
    from pallas_mosaic_gpu.rules_memory import _orders_tensor_core, _views

    (bar,) = _views(state, eqn, args)
    test = bar.barrier.test
    kwargs: dict[str, Any] = {}
    if "scope" in inspect.signature(test).parameters:  # JAX 0.11 on: warp or warpgroup
        kwargs["scope"] = (mgpu.ThreadSubset.WARP if state.warp_axis is not None
                           else mgpu.ThreadSubset.WARPGROUP)
    return [test(orders_tensor_core=_orders_tensor_core(eqn), **kwargs)]


def async_copy_smem_to_tmem(smem_ref: Any, tmem_ref: Any, collective_axis: Any = None) -> None:
    """Copies the SMEM Ref ``smem_ref`` into the TMEM Ref ``tmem_ref`` (of one shape and
    dtype), asynchronously: a later ``tcgen05_mma`` of the same thread sees it, and
    ``tcgen05_commit_arrive(barrier)`` completes ``barrier`` once it is done (wait for that
    before reading ``tmem_ref`` with ``async_load_tmem``). A tiled SMEM buffer (``transforms``
    ``TilingTransform((8, 128 // itemsize))`` + ``SwizzleTransform(128)``, or 16-bit with
    dimensions multiples of 64) is copied by ``tcgen05.cp`` from one thread, as in JAX; an
    untiled one through the warpgroup's registers (complete on return). A 16-bit or 8-bit
    buffer is copied by ``tcgen05.cp`` into a ``plgpu.TMEM(..., packed=True)`` buffer only
    (as the ``a`` of a ``tcgen05_mma`` is kept).
    ``collective_axis`` (a copy into both blocks' TMEM of a cluster) is refused."""
    from pallas_mosaic_gpu.blackwell import copy_smem_to_tmem_p, smem_to_tmem_avals

    fn = "async_copy_smem_to_tmem"
    src, dst = smem_to_tmem_avals(smem_ref, tmem_ref, collective_axis, fn)
    if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
        raise PallasError(f"plgpu.{fn}: source {src.dtype}{list(src.shape)} and destination "
                          f"{dst.dtype}{list(dst.shape)} differ. Fix: slice them to match.")
    bind_views(copy_smem_to_tmem_p, [smem_ref, tmem_ref], [], fn)


def format_tcgen05_sparse_metadata(meta: Any, operand_dtype: Any) -> jax.Array:
    """Lays out 2:4 sparsity metadata for ``tcgen05_mma(a_sparse_metadata=...)``: ``meta``
    (uint2, shape (M, K // 4, 2): two 2-bit indices per group of four elements of the sparse
    operand's rows) becomes (M // 128, K // 64, 128, 64): tiles of 128 rows by 64 indices, in
    the order PTX's sparse ``tcgen05.mma`` reads for operands of 8 bits (the tile as it is) or
    16 bits (within a tile, the row's 8-row half and the index's 8-wide half in each 16 are
    exchanged)."""
    meta = jnp.asarray(meta)
    fn = "plgpu.format_tcgen05_sparse_metadata"
    if meta.dtype != jnp.uint2:
        raise PallasError(f"{fn}: expected uint2 metadata, found {meta.dtype}.")
    if meta.ndim != 3 or meta.shape[-1] != 2:
        raise PallasError(f"{fn}: expected metadata of shape (M, K // 4, 2), found "
                          f"{meta.shape}.")
    m, k = meta.shape[0], meta.shape[1] * 2
    if m % 128 or k % 64:
        raise PallasError(f"{fn}: metadata {meta.shape} does not split into tiles of 128 rows "
                          "and 64 indices (M a multiple of 128, K of 256).")
    bits = np.dtype(operand_dtype).itemsize * 8
    tiles = jnp.swapaxes(meta.reshape(m // 128, 128, k // 64, 64), 1, 2)
    if bits == 8:
        return tiles
    if bits != 16:
        raise UnsupportedError(f"{fn}: operands of {np.dtype(operand_dtype).name} have no "
                               "sparse metadata layout (8-bit and 16-bit ones do).")
    # Row r = 16 a + 8 b + c and index q = 16 d + 8 e + f of a tile: b and e trade places.
    split = tiles.reshape(m // 128, k // 64, 8, 2, 8, 4, 2, 8)
    return jnp.swapaxes(split, 3, 6).reshape(m // 128, k // 64, 128, 64)


def alloc_semaphore(shape: tuple[int, ...] = ()) -> Any:
    """A zeroed array of GMEM semaphores that outlives a kernel: a ``jax.Ref`` of int32
    counters, made outside any kernel, that kernels take as an operand (their signals and
    waits on it persist from one kernel to the next, as the ``jax.Ref`` holds them). As in
    JAX, nothing synchronises devices here: the first kernel using it on several devices
    should not skip the device barrier. For semaphores of one kernel, use scratch
    (``plgpu.SemaphoreType.REGULAR``)."""
    from pallas_core.backend import current_kernel_context

    fn = "plgpu.alloc_semaphore"
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        raise PallasError(f"{fn}(shape={shape!r}): expected a tuple of sizes, e.g. (4,).")
    if current_kernel_context() is not None:
        raise PallasError(f"{fn} inside a kernel: it makes semaphores that outlive kernels. "
                          "Fix: call it outside, or allocate scratch "
                          "(plgpu.SemaphoreType.REGULAR((n,))) for semaphores of this kernel.")
    return jax.new_ref(jnp.zeros(tuple(int(d) for d in shape), jnp.int32))


async_store_smem_p = gp._primitive("gpu_async_store_smem")

_COMBINE: dict[Any, Any] = {
    None: lambda old, new: new, "add": jnp.add, "max": jnp.maximum, "min": jnp.minimum,
    "and": jnp.bitwise_and, "or": jnp.bitwise_or, "xor": jnp.bitwise_xor}


def async_store_smem(src: Any, ref: Any, barrier: Any, *, cluster_idx: Any,
                     cluster_dim: Any, optimized: bool = True, atomic: Any = None) -> None:
    """Stores the array ``src`` into the SMEM Ref ``ref`` of block ``cluster_idx`` (along the
    cluster axis ``cluster_dim``) of this block's cluster, combining it with what is there by
    ``atomic`` ("add", "max", "min", "and", "or", "xor"; ``None`` overwrites); when the bytes
    have landed, ``barrier`` of that block completes the phase (an arrival, as a copy's).
    ``optimized`` only changes speed. The interpreter runs it (the blocks of a cluster run
    together there); lowering it is refused."""
    from pallas_mosaic_gpu.cluster import axes_tuple

    fn = "async_store_smem"
    if atomic not in _COMBINE:
        raise PallasError(f"plgpu.{fn}(atomic={atomic!r}): expected None or one of 'add', "
                          "'max', 'min', 'and', 'or', 'xor'.")
    if isinstance(cluster_dim, int) or len(axes_tuple(cluster_dim)) != 1:
        raise UnsupportedError(f"plgpu.{fn}(cluster_dim={cluster_dim!r}): name one cluster "
                               "axis (plgpu.kernel(cluster_names=...)); dimension numbers "
                               "are not supported by mosaic_gpu.")
    aval, base = gp._aval(ref, fn)
    if gp._space_name(base) != "SMEM":
        raise PallasError(f"plgpu.{fn}: the destination must be an SMEM Ref, found a Ref in "
                          f"{gp._space_name(base)}.")
    value = jnp.asarray(src)
    if value.shape != tuple(aval.shape) or value.dtype != aval.dtype:
        raise PallasError(f"plgpu.{fn}: an array {value.dtype}{list(value.shape)} into a Ref "
                          f"{aval.dtype}{list(aval.shape)}. Fix: store a whole Ref (ref.at[...])"
                          " of the array's dtype.")
    if atomic is not None and atomic not in ("add", "max", "min") and not jnp.issubdtype(
            value.dtype, jnp.integer):
        raise PallasError(f"plgpu.{fn}(atomic={atomic!r}) of {value.dtype}: bitwise "
                          "reductions take integers.")
    gp._check_barrier(barrier, fn)
    bind_views(async_store_smem_p, [ref, barrier],
               [value, jnp.asarray(cluster_idx, jnp.int32)], fn,
               cluster_dim=axes_tuple(cluster_dim)[0], atomic=atomic)


def _store_alone(*_: Any, **__: Any) -> Any:
    from pallas_mosaic_gpu.cluster import refused_in_interpreter

    raise refused_in_interpreter("plgpu.async_store_smem")


def _store_axes(in_avals: Any, *, cluster_dim: Any, **_: Any) -> tuple[Any, ...]:
    return (cluster_dim,)


def _store_cross(in_avals: Any, out_avals: Any, *args: Any, stacked: Any, marks: Any,
                 block: Any, tree: Any, roles: Any, cluster_dim: Any, atomic: Any) -> Any:
    """The store into block ``cluster_idx``'s buffer, and an arrival on its barrier."""
    from pallas_mosaic_gpu import cluster

    state = RefViews(args, tree, roles)
    views = cluster.block_views(state, stacked)
    value, target = state.rest[0], state.rest[1]
    combine = _COMBINE[atomic]
    for c, v in enumerate(views):
        here = target == c
        old = v.read(0)
        v.write(0, jnp.where(here, combine(old, value), old))
        count = v.read(1)
        v.write(1, jnp.where(here, count + 1, count))
    return cluster.restack(state, stacked, views), [None] * len(marks), []


@registry.rule(async_store_smem_p, lazy=True)
def _store_rule(state: Any, eqn: Any, *args: Any, **_: Any) -> Any:
    raise state.fail("plgpu.async_store_smem (a store into another block's SMEM is not "
                     "lowered by this backend; run the kernel in the interpreter, or exchange "
                     "the data through GMEM)")


cluster_get_p = plb.Primitive("gpu_cluster_get")
cluster_get_p.multiple_results = True
cluster_swap_p = gp._primitive("gpu_cluster_swap")


@cluster_get_p.def_effectful_abstract_eval
def _cluster_get_abstract(*avals: Any, shape: Any, dtype: Any, **_: Any) -> Any:
    return [plb.ShapedArray(shape, dtype)], {plb.ReadEffect(0)}


class ClusterRef(RefView):
    """``plgpu.cluster_ref(ref, {axis: idx})``: the SMEM Ref ``ref`` of block ``idx`` along the
    cluster axis ``axis`` of this block's cluster. ``view[...]`` reads that block's buffer,
    ``view[...] = x`` writes it, ``view.at[...]`` narrows the view. The interpreter runs it
    (the blocks of a cluster run together there); lowering it is refused."""

    def __init__(self, ref: Any, axis: Any, index: Any) -> None:
        self.ref, self.axis, self.index = ref, axis, index

    def _rewrap(self, ref: Any) -> ClusterRef:
        return ClusterRef(ref, self.axis, self.index)

    def _narrowed(self, idx: Any) -> Any:
        return self.ref if idx is Ellipsis or idx == () else self.ref.at[idx]

    def __getitem__(self, idx: Any) -> jax.Array:
        view = self._narrowed(idx)
        aval, _ = gp._aval(view, "cluster_ref")
        (value,) = bind_views(cluster_get_p, [view], [jnp.asarray(self.index, jnp.int32)],
                              "cluster_ref", axis=self.axis, shape=tuple(aval.shape),
                              dtype=aval.dtype)
        return value  # type: ignore[no-any-return]

    def __setitem__(self, idx: Any, value: Any) -> None:
        view = self._narrowed(idx)
        aval, _ = gp._aval(view, "cluster_ref")
        value = jnp.broadcast_to(jnp.asarray(value, aval.dtype), tuple(aval.shape))
        bind_views(cluster_swap_p, [view], [value, jnp.asarray(self.index, jnp.int32)],
                   "cluster_ref", axis=self.axis)

    def __repr__(self) -> str:
        return f"plgpu.cluster_ref({self.ref!r}, {{{self.axis!r}: {self.index!r}}})"


def cluster_ref(ref: Any, block_id: dict[Any, Any]) -> ClusterRef:
    """The SMEM Ref ``ref`` of the block of this block's cluster that ``block_id`` (one
    cluster axis name -> index) names (see :class:`ClusterRef`)."""
    if not isinstance(block_id, dict) or len(block_id) != 1:
        raise UnsupportedError(f"plgpu.cluster_ref(block_id={block_id!r}): name one cluster "
                               "axis and the block's index along it, e.g. {'x': 1} (as JAX's "
                               "lowering asks).")
    _, base = gp._aval(ref, "cluster_ref")
    if gp._space_name(base) != "SMEM":
        raise PallasError(f"plgpu.cluster_ref: expected an SMEM Ref, found a Ref in "
                          f"{gp._space_name(base)}.")
    ((axis, index),) = block_id.items()
    return ClusterRef(ref, axis, index)


def _cluster_axes(in_avals: Any, *, axis: Any, **_: Any) -> tuple[Any, ...]:
    return (axis,)


def _cluster_alone(*_: Any, **__: Any) -> Any:
    from pallas_mosaic_gpu.cluster import refused_in_interpreter

    raise refused_in_interpreter("plgpu.cluster_ref")


def _get_cross(in_avals: Any, out_avals: Any, *args: Any, stacked: Any, marks: Any,
               block: Any, tree: Any, roles: Any, **_: Any) -> Any:
    from pallas_mosaic_gpu import cluster

    state = RefViews(args, tree, roles)
    views = cluster.block_views(state, stacked)
    value = jnp.stack([v.read(0) for v in views])[state.rest[0]]
    return cluster.restack(state, stacked, views), [None] * len(marks), [value]


def _swap_cross(in_avals: Any, out_avals: Any, *args: Any, stacked: Any, marks: Any,
                block: Any, tree: Any, roles: Any, **_: Any) -> Any:
    from pallas_mosaic_gpu import cluster

    state = RefViews(args, tree, roles)
    views = cluster.block_views(state, stacked)
    value, target = state.rest[0], state.rest[1]
    for c, v in enumerate(views):
        old = v.read(0)
        v.write(0, jnp.where(target == c, value, old))
    return cluster.restack(state, stacked, views), [None] * len(marks), []


@registry.rule(cluster_get_p, cluster_swap_p, lazy=True)
def _cluster_rule(state: Any, eqn: Any, *args: Any, **_: Any) -> Any:
    raise state.fail("plgpu.cluster_ref (reads and writes of another block's SMEM are not "
                     "lowered by this backend; run the kernel in the interpreter, or use "
                     "plgpu.async_store_smem there and exchange data through GMEM here)")


SEMANTICS: tuple[plb.PrimitiveSemantics, ...] = (
    plb.PrimitiveSemantics(barrier_test_p, discharge=_test, phase_wait=True),
    plb.PrimitiveSemantics(async_store_smem_p, discharge=_store_alone, cluster=_store_axes,
                                 cross=_store_cross),
    plb.PrimitiveSemantics(cluster_get_p, discharge=_cluster_alone, cluster=_cluster_axes,
                                 cross=_get_cross),
    plb.PrimitiveSemantics(cluster_swap_p, discharge=_cluster_alone,
                                 cluster=_cluster_axes, cross=_swap_cross),
)
