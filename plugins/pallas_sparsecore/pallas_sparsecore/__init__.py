"""The SparseCore backend of pallas (``import pallas_sparsecore as plsc``).

Kernels run with ``pl.kernel`` on a mesh of SparseCore subcores
(:func:`VectorSubcoreMesh`, :func:`ScalarSubcoreMesh`) and are lowered to a Mosaic module
for the subcores, carried by the ``tpu_custom_call`` TPU runtimes execute. The chip is a
parameter (``target=``), so lowering needs no TPU:
``jax.jit(f).trace(*a).lower(lowering_platforms=("tpu",))``.
"""

from __future__ import annotations

from pallas_sparsecore.params import (
    VMEM_SHARED,
    CompilerParams,
    ScalarSubcoreMesh,
    SCCompilerParams,
    SparseCoreInfo,
    SubcoreMesh,
    VectorSubcoreMesh,
    get_sparse_core_info,
)
from pallas_sparsecore.plugin import __version__
from pallas_sparsecore.primitives import (
    PackFormat,
    addupdate,
    addupdate_compressed,
    addupdate_scatter,
    all_reduce_ffs,
    all_reduce_population_count,
    bitcast,
    cummax,
    cummin,
    cumsum,
    load_expanded,
    load_gather,
    pack,
    parallel_loop,
    scan_count,
    sort_key_val,
    store_compressed,
    store_scatter,
    subcore_barrier,
    unpack,
)
from pallas_sparsecore.shared import (
    Indices,
    SparseCorePushStreamWarning,
    fetch_and_add,
    slice_subcore_vmem_from_shared,
)

__all__ = ["__version__", "addupdate", "addupdate_compressed", "addupdate_scatter",
           "all_reduce_ffs", "all_reduce_population_count", "bitcast", "CompilerParams",
           "cummax", "cummin", "cumsum", "get_sparse_core_info", "load_expanded", "load_gather",
           "pack",
           "PackFormat", "parallel_loop", "ScalarSubcoreMesh", "scan_count", "SCCompilerParams",
           "sort_key_val", "SparseCoreInfo", "store_compressed", "store_scatter",
           "subcore_barrier", "SubcoreMesh", "unpack", "VectorSubcoreMesh", "VMEM_SHARED"]
__all__ += ["Indices", "SparseCorePushStreamWarning", "fetch_and_add",
            "slice_subcore_vmem_from_shared"]
