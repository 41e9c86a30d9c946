"""Checks of a SparseCore kernel against its chip before lowering, with the fix in each message."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pallas_mosaic_tpu.params import VMEM

from pallas_core import backend as plb
from pallas_core.backend import BARRIER_SEMAPHORE, KernelCall, PallasError, run_scoped_p
from pallas_sparsecore import primitives as sc
from pallas_sparsecore.params import DEFAULT_TARGET, SCCompilerParams

_VECTOR_ONLY = {sc.load_gather_p: "plsc.load_gather", sc.store_scatter_p: "plsc.store_scatter",
                sc.load_expanded_p: "plsc.load_expanded",
                sc.store_compressed_p: "plsc.store_compressed", sc.addupdate_p: "plsc.addupdate",
                sc.cumsum_p: "plsc.cumsum", sc.cummax_p: "plsc.cummax",
                sc.cummin_p: "plsc.cummin",
                sc.sort_p: "plsc.sort_key_val", sc.scan_count_p: "plsc.scan_count",
                sc.popcount_p: "plsc.all_reduce_population_count",
                sc.ffs_p: "plsc.all_reduce_ffs", sc.pack_p: "plsc.pack",
                sc.unpack_p: "plsc.unpack", sc.subcore_barrier_p: "plsc.subcore_barrier",
                sc.parallel_loop_p: "plsc.parallel_loop"}
_LANE_CHECKED = {sc.load_gather_p, sc.store_scatter_p, sc.sort_p, sc.cumsum_p, sc.cummax_p,
                 sc.cummin_p, sc.scan_count_p}


def check(call: KernelCall) -> None:
    """Raises a ``PallasError`` for what the chip cannot run: a vector-subcore primitive in a
    scalar-subcore kernel, register operands whose length is not the lane count."""
    params = call.compiler_params
    if not isinstance(params, SCCompilerParams):
        return
    if params.collective_id is None and any(
            a.memory_space is BARRIER_SEMAPHORE for a in call.grid_mapping.scratch_avals):
        raise PallasError(
            f"kernel {call.name!r} uses the barrier semaphore (pltpu.get_barrier_semaphore()) "
            "but gives no collective_id. Fix: pass compiler_params=plsc.CompilerParams("
            "collective_id=0) (a different id for kernels that synchronise different groups "
            "of devices).")
    info = params.info
    lanes = info.num_lanes
    for eqn in plb.all_eqns(call.jaxpr.jaxpr):
        name = _VECTOR_ONLY.get(eqn.primitive)
        if name is None:
            continue
        if params.kernel_type == "scalar":
            raise PallasError(
                f"kernel {call.name!r}: {name} runs on vector subcores, but this kernel runs on "
                "the scalar subcores (plsc.ScalarSubcoreMesh). Fix: run it on a "
                "plsc.VectorSubcoreMesh, or do this part in a vector-subcore kernel.")
        if eqn.primitive in _LANE_CHECKED:
            n_refs = max(eqn.params["roles"]) + 1 + eqn.params["tree"].num_leaves \
                if "roles" in eqn.params else 0
            vectors = [v.aval for v in eqn.invars[n_refs:] if getattr(v.aval, "shape", ())]
            for aval in vectors:
                if aval.shape != (lanes,):
                    raise PallasError(
                        f"kernel {call.name!r}: {name} got a vector of shape {aval.shape}, but "
                        f"a register of target {params.target or 'default'} holds {lanes} "
                        f"32-bit lanes. Fix: use vectors of exactly {lanes} elements "
                        f"(plsc.get_sparse_core_info().num_lanes), looping over longer data.")


def vmem_parts(call: KernelCall) -> list[tuple[str, int]] | None:
    """The VMEM (TileSPMEM) one vector subcore holds for ``call``, part by part, as the
    lowering declares it: each ``pltpu.VMEM`` scratch operand of the kernel function, and the
    most that its ``pl.run_scoped`` regions (``memref.alloca`` in ``tpu.region``) hold at
    once. Bytes are element counts times item sizes: the padding Mosaic adds later for the
    chip's tiling is not counted, so a kernel over the limit certainly does not fit.
    ``VMEM_SHARED`` and SMEM are not counted (no public figure gives their capacity).
    ``None`` for a scalar-subcore kernel (its memory is not the vector subcores')."""
    params = call.compiler_params
    if not isinstance(params, SCCompilerParams) or params.kernel_type != "vector":
        return None
    parts = [(f"scratch {k} {tuple(a.inner_aval.shape)} {np.dtype(a.inner_aval.dtype).name}",
              _nbytes(a.inner_aval.shape, a.inner_aval.dtype))
             for k, a in enumerate(call.grid_mapping.scratch_avals) if a.memory_space is VMEM]
    scoped = _scoped_peak(call.jaxpr.jaxpr)
    if scoped:
        parts.append(("pl.run_scoped buffers (the most held at once)", scoped))
    return parts


def vmem_limit(call: KernelCall) -> int:
    """The VMEM of one vector subcore of the kernel's chip
    (``plsc.get_sparse_core_info(target).vmem_capacity_bytes``)."""
    return _params(call).info.vmem_capacity_bytes


def check_vmem(call: KernelCall) -> None:
    """Raises a ``PallasError`` when a vector subcore's VMEM cannot hold what the kernel
    allocates in it (:func:`vmem_parts`, :func:`vmem_limit`)."""
    parts = vmem_parts(call)
    if not parts:
        return
    total, limit = sum(b for _, b in parts), vmem_limit(call)
    if total <= limit:
        return
    target = _params(call).target or DEFAULT_TARGET
    largest = ", ".join(f"{name}: {b}" for name, b in sorted(parts, key=lambda p: -p[1])[:3])
    raise PallasError(
        f"kernel {call.name!r} needs {total} bytes of VMEM per vector subcore (VMEM scratch and "
        f"pl.run_scoped buffers; largest: {largest}) but a vector subcore of {target} has "
        f"{limit}. Fix: use smaller buffers and copy the data in pieces, or keep large arrays "
        "in HBM or plsc.VMEM_SHARED.")


def _params(call: KernelCall) -> SCCompilerParams:
    params = call.compiler_params
    return params if isinstance(params, SCCompilerParams) else SCCompilerParams()


def _nbytes(shape: Any, dtype: Any) -> int:
    return math.prod(shape) * max(np.dtype(dtype).itemsize, 1)


def _scoped_peak(jaxpr: Any) -> int:
    """The most VMEM that the ``pl.run_scoped`` regions of ``jaxpr`` hold at once: a region
    holds its own buffers and the peak of the regions inside it; regions one after the other
    do not overlap."""
    peak = 0
    for eqn in jaxpr.eqns:
        here = sum(_nbytes(t.shape, t.dtype) for t in eqn.params["scoped"]
                   if t.memory_space is VMEM) if eqn.primitive is run_scoped_p else 0
        inner = max((_scoped_peak(sub) for sub in plb.sub_jaxprs(eqn.params)), default=0)
        peak = max(peak, here + inner)
    return peak
