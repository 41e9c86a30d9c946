"""Work shared by the blocks of a cluster (``plgpu.kernel(cluster=..., cluster_names=...)``).

The blocks of a cluster run at once on neighbouring SMs and can reach each other's shared
memory. Kernels use that through:

* ``plgpu.ClusterBarrier(collective_axes=...)``: an arrival reaches the barrier of every
  block along those cluster axes (:class:`pallas_mosaic_gpu.params.ClusterBarrier`);
* ``copy_gmem_to_smem(..., collective_axes=...)``: one TMA copy issued by every block along
  the axes, multicast to all of them, or with ``leader_tracked=CopyPartition.PARTITIONED(d)``
  split along dimension ``d`` so that each block receives its part, the first block's
  barrier tracking the whole transfer (``CopyPartition.REPLICATED``: each receives all of it,
  tracked by the first);
* ``plgpu.TMEM(..., collective=True)``, ``tcgen05_mma(..., collective_axis=...)`` and
  ``tcgen05_commit_arrive(..., collective_axis=...)``: a matmul of the two blocks of a
  cluster (``cta_group::2``), issued by the first, whose operands and accumulator are split
  between them by rows (:mod:`pallas_mosaic_gpu.blackwell`).

Lowering uses JAX's Mosaic GPU library (``CollectiveBarrierRef``, ``async_copy(collective=,
leader_tracked=)``, ``tcgen05.mma(collective=True)``).

Reference semantics: these primitives declare ``PrimitiveSemantics.cluster`` (the cluster
axes an equation reaches along) and ``cross`` (its meaning given every block's buffers).
In a kernel using any of them the interpreter runs the blocks of a cluster together, each
warpgroup at its own pace (``pallas_interpret.phases``), with one SMEM, TMEM and barrier
buffer per block; clusters run one after another. There:

* an arrival on a ClusterBarrier adds one to the barrier of every block along its axes (the
  first block's alone with ``leader_tracked``), whose phase needs ``num_arrivals`` times the
  number of those blocks;
* a leader-tracked copy gives the issuing block its part of the window (all of it where
  ``REPLICATED``); the ``k``-th such copy of each block on a barrier meet, and the first
  block's barrier gets the arrival once every block issued it (on the hardware it waits for
  every block's bytes); a multicast copy is each block's own copy;
* a collective ``tcgen05_mma`` issued by the first block multiplies every block's ``a``
  stacked by rows with every block's ``b`` side by side, block ``c``'s accumulator taking
  rows ``[c*M, (c+1)*M)``; its barrier and a collective ``tcgen05_commit_arrive`` get an
  arrival in every block (issued by another block, they do nothing here);
* with ``dynamic_scheduling_loop(cluster_axes=)`` the first cluster claims every grid point
  and both its blocks run them.

The stacked block order is row-major over the cluster axes these forms name, so the leader
is block 0: exact for one cluster axis (what the partitioned forms allow). The discharge
rules, used where the blocks run one after another (e.g. a kernel with dynamic grid axes),
still refuse these forms by name (:func:`refused_in_interpreter`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu

from pallas_core.backend import PallasError, RefViews, UnsupportedError

DIMS = (gpu.Dimension.x, gpu.Dimension.y, gpu.Dimension.z)


def axes_tuple(axes: Any) -> tuple[Any, ...]:
    """``axes`` (one name or several) as a tuple."""
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def cluster_dims(mesh: Any, axes: Sequence[Any], what: str,
                 fail: Callable[[str], Exception] | None = None) -> tuple[Any, ...]:
    """The CUDA cluster dimensions (``gpu.Dimension``) of the cluster axes named ``axes`` of
    the ``plgpu.kernel`` launch ``mesh``; ``fail`` makes the error for a name that is not one
    (a ``PallasError`` by default)."""
    names = tuple(getattr(mesh, "cluster_names", ()) or ())
    dims = []
    for axis in axes:
        if axis not in names:
            message = (f"{what} names the cluster axis {axis!r}, but the kernel's cluster axes "
                       f"are {names}. Fix: launch with plgpu.kernel(cluster=(2,), "
                       f"cluster_names=({axis!r},)) or name one of {names}")
            raise fail(message) if fail is not None else PallasError(message + ".")
        dims.append(DIMS[names.index(axis)])
    return tuple(dims)


def cluster_size(mesh: Any, dims: Sequence[Any]) -> int:
    """How many blocks of a cluster lie along ``dims``."""
    size = 1
    for d in dims:
        i = DIMS.index(d)
        size *= mesh.cluster[i] if i < len(mesh.cluster) else 1
    return size


def is_first_block(dim: Any) -> Any:
    """Whether this block is the first of its cluster along ``dim`` (an ``i1`` value)."""
    return arith.cmpi(arith.CmpIPredicate.eq, mgpu.utils.cluster_idx(dim),
                      arith.constant(ir.IndexType.get(), 0))


def block_views(state: RefViews, stacked: Sequence[bool]) -> list[RefViews]:
    """In a ``cross`` rule (``PrimitiveSemantics.cross``): the views of each block of the
    cluster, the Refs whose buffers are stacked per block taken at that block."""
    refs = range(state.n_refs)
    n = next(state.values[i].shape[0] for i in refs if stacked[i])
    return [state.with_values([state.values[i][c] if stacked[i] else state.values[i]
                               for i in refs]) for c in range(n)]


def restack(state: RefViews, stacked: Sequence[bool], views: Sequence[RefViews]) -> list[Any]:
    """The new values of ``state``'s Refs (as a discharge rule returns them) after each
    block's ``views`` were written (the Refs not stacked per block are left as they were)."""
    out = [jnp.stack([v.values[i] for v in views]) if stacked[i] else state.values[i]
           for i in range(state.n_refs)]
    return [*out, *([None] * (state.n_args - state.n_refs))]


def refused_in_interpreter(what: str) -> UnsupportedError:
    """The interpreter's refusal of a form that shares work between the blocks of a cluster,
    where it runs them one after another (it runs them together where it can: see the
    module docstring)."""
    return UnsupportedError(
        f"{what} is not supported by the interpreter here: it runs the blocks of this "
        "kernel's clusters one after another (e.g. its grid has dynamic axes), so a block "
        "cannot see what the others of its cluster write into its shared memory, barriers or "
        "TMEM. Fix: run it with backend='mosaic_gpu' on a GPU, give the kernel a static "
        "grid, or test its non-collective form (one block per tile) in the interpreter.")
