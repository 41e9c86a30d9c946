"""Checks of a SparseCore kernel against its chip before lowering, with the fix in each message."""

from __future__ import annotations

from pallas_core import reference
from pallas_core.errors import PallasError
from pallas_core.request import KernelCall
from pallas_core.spec import BARRIER_SEMAPHORE
from pallas_sparsecore import primitives as sc
from pallas_sparsecore.params import SCCompilerParams

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
    for eqn in reference.all_eqns(call.jaxpr.jaxpr):
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
