"""What this backend's own primitives cost, for ``pl.report`` and ``plb.kernel_cost`` (the
``pallas_op_cost`` hook): the core counts ``dot_general``, elementwise ops, loops and its own
copies; this module counts the matrix instructions and TMA copies of Mosaic GPU kernels, from
the types of the equation alone (the shapes of the Ref views it names, after their
transforms: indexers, ``plgpu.transpose_ref``, bitcasts, reshapes).

* ``wgmma(acc, a, b)`` and ``tcgen05_mma(acc, a, b)``: ``2 * M * N * K`` matrix flops, with
  ``(M, N)`` the accumulator view and ``K`` the rows of the ``b`` view (as the lowering
  checks them: ``a`` (M, K), ``b`` (K, N)); the matrix dtype is ``a``'s. A 2:4-sparse
  ``tcgen05_mma`` (``a`` holds half of K) counts the multiplies it does, ``2 * M * N * K / 2``
  (the dense peak then gives its time). A collective ``tcgen05_mma`` (``collective_axis``, a
  cluster of 2 blocks) is one instruction over both blocks' rows, issued by the first block
  (JAX's kernels run it under ``pl.when(is_lead_block)``): ``2 * 2M * N * K`` with ``(M, N)``
  the issuing block's accumulator.
* TMA copies between GMEM and SMEM (``copy_gmem_to_smem``, ``copy_smem_to_gmem``, the
  ``im2col`` copy): the bytes of the SMEM side's view, ``hbm_bytes``. A copy the blocks of a
  cluster share (``collective_axes``) reads its GMEM window from HBM once per cluster: the
  TMA engine splits a multicast (and a ``REPLICATED``) load among the blocks, each fetching
  its part and multicasting it, so each block's equation counts ``1/n`` of the window (``n``
  the blocks along the axes); a ``PARTITIONED`` load gives each block its own part of the
  source, which is what its SMEM view holds. A copy to or from another device's GMEM
  (``plgpu.remote_ref``) moves no HBM bytes of this chip here (it crosses NVLink), as the core
  counts remote copies.
* Barriers, waits, commits, fences, copies that stay on chip (SMEM to TMEM, TMEM loads and
  stores, another block's SMEM) and register limits: nothing.
* Everything else (regions holding a jaxpr, which the core counts inside; ``inline_mgpu``,
  whose body is opaque; the multi-device ``multimem`` primitives): ``None``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

import pallas_core.backend as plb

FREE = frozenset({
    "gpu_barrier_arrive", "gpu_barrier_wait", "gpu_barrier_test", "gpu_wgmma_wait",
    "gpu_wait_smem_to_gmem", "gpu_commit_smem", "gpu_commit_smem_to_gmem_group",
    "gpu_griddepcontrol_wait", "gpu_griddepcontrol_launch_dependents",
    "gpu_tcgen05_commit_arrive", "gpu_commit_tmem", "gpu_wait_load_tmem",
    "gpu_async_load_tmem", "gpu_async_store_tmem", "gpu_async_copy_smem_to_tmem",
    "gpu_async_copy_scales_to_tmem", "gpu_async_copy_sparse_metadata_to_tmem",
    "gpu_async_store_smem", "gpu_cluster_get", "gpu_cluster_swap", "gpu_proxy_fence",
    "gpu_set_max_registers", "gpu_try_cluster_cancel", "gpu_query_cluster_cancel",
    "gpu_layout_cast", "gpu_semaphore_signal_multicast",
})
"""Primitives that cost nothing here: synchronisation, and data moved on the chip."""


def op_cost(eqn: Any) -> plb.OpCost | None:
    """The cost of one equation of a Mosaic GPU kernel body (see the module's docstring)."""
    name = eqn.primitive.name
    if name == "gpu_wgmma":
        return _wgmma(eqn)
    if name == "gpu_tcgen05_mma":
        return _tcgen05_mma(eqn)
    if name == "gpu_copy_gmem_to_smem":
        return _tma_load(eqn)
    if name == "gpu_copy_smem_to_gmem":
        return _copy_bytes(eqn, smem=0, gmem=1)
    if name == "gpu_im2col_copy":
        return _copy_bytes(eqn, smem=1, gmem=0)
    if name in FREE:
        return plb.OpCost()
    return None


def _views(eqn: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """Per view of ``eqn`` (a primitive bound with ``bind_views``): the view's type after its
    transforms, whether it names another device's memory, and the extra operands' types."""
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1 if roles else 0
    avals = [a.aval for a in eqn.invars]
    transforms = jax.tree_util.tree_unflatten(tree, avals[n_refs:n_refs + tree.num_leaves])
    views, remote = [], []
    for r, ts in zip(roles, transforms, strict=True):
        peer = [t for t in ts if isinstance(t, plb.PeerRefTransform)]
        local = [t for t in ts if not isinstance(t, plb.PeerRefTransform)]
        base = avals[r]
        views.append(plb.shape_after_transforms(plb.make_ref_aval(base.shape, base.dtype),
                                                local))
        remote.append(bool(peer))
    return views, remote, avals[n_refs + tree.num_leaves:]


def _nbytes(aval: Any) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _mma(acc: Any, a: Any, b: Any, rows: int = 1) -> plb.OpCost:
    (m, n), k = acc.shape[-2:], b.shape[-2]
    return plb.OpCost(matmul_flops=2 * rows * m * n * k, matmul_dtype=np.dtype(a.dtype).name)


def _wgmma(eqn: Any) -> plb.OpCost:
    views, _, extra = _views(eqn)
    if eqn.params.get("a_is_ref", True):
        acc, a, b = views[:3]
    else:  # ``a`` is a value in registers, the last operand
        (acc, b), a = views[:2], extra[-1]
    return _mma(acc, a, b)


def _tcgen05_mma(eqn: Any) -> plb.OpCost:
    views, _, _ = _views(eqn)
    acc, a, b = views[:3]
    cost = _mma(acc, a, b, rows=2 if eqn.params.get("collective_axis") is not None else 1)
    if eqn.params.get("sparse"):  # a holds the kept half of K: half the multiplies
        cost = plb.OpCost(matmul_flops=cost.matmul_flops // 2, matmul_dtype=cost.matmul_dtype)
    return cost


def _copy_bytes(eqn: Any, smem: int, gmem: int) -> plb.OpCost:
    views, remote, _ = _views(eqn)
    if remote[gmem]:
        return plb.OpCost()
    return plb.OpCost(hbm_bytes=_nbytes(views[smem]))


def _tma_load(eqn: Any) -> plb.OpCost:
    cost = _copy_bytes(eqn, smem=1, gmem=0)
    axes = eqn.params.get("collective_axes")
    if not axes or cost.hbm_bytes == 0:
        return cost
    leader = eqn.params.get("leader_tracked")
    if leader is not None and hasattr(leader, "axis"):  # PARTITIONED: its own part
        return cost
    # Multicast (or REPLICATED, always 2 blocks): each block fetches 1/n of the window.
    blocks = eqn.params.get("cluster_blocks") or (2 if leader is not None else 1)
    return plb.OpCost(hbm_bytes=cost.hbm_bytes // blocks)
