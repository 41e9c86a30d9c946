"""The Mosaic GPU backend of pallas (``import pallas_mosaic_gpu as plgpu``).

Kernels are built with JAX's Mosaic GPU library for Hopper (sm_90a), or Blackwell (sm_100a)
when they use TMEM and tcgen05, and emitted as the
``mosaic_gpu_v2`` custom call JAX's CUDA runtime executes. Lowering needs no GPU:
``jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))``.
"""

from __future__ import annotations

import pallas_core.backend as plb
from pallas_mosaic_gpu.additions import (
    InterpretGPUParams,
    MemorySpace,
    SemaphoreSignal,
    async_prefetch,
    barrier_arrive_and_wait,
    force_gpu_interpret_mode,
    griddepcontrol_launch_dependents,
    griddepcontrol_wait,
    max,
    min,
    mma,
    prod,
    semaphore_signal,
    semaphore_signal_parallel,
    semaphore_wait,
    set_gpu_interpret_mode,
    store,
    sum,
    wait_gmem_to_smem,
    warp_map,
    wgmma_accumulator_load,
)
from pallas_mosaic_gpu.blackwell import (
    async_copy_scales_to_tmem,
    async_copy_sparse_metadata_to_tmem,
    async_load_tmem,
    async_store_tmem,
    commit_tmem,
    tcgen05_commit_arrive,
    tcgen05_mma,
    wait_load_tmem,
)
from pallas_mosaic_gpu.dynamic_scheduling import (
    TryClusterCancelResult,
    WarpMesh,
    dynamic_scheduling_loop,
    query_cluster_cancel,
    try_cluster_cancel,
)
from pallas_mosaic_gpu.im2col import im2col_ref
from pallas_mosaic_gpu.inline import as_torch_kernel, inline_mgpu
from pallas_mosaic_gpu.layouts import (
    Layout,
    broadcasted_iota,
    commit_smem_to_gmem_group,
    layout_cast,
    load,
)
from pallas_mosaic_gpu.loops import NDLoopInfo, nd_loop, planar_snake
from pallas_mosaic_gpu.more_ops import (
    alloc_semaphore,
    async_copy_smem_to_tmem,
    async_store_smem,
    barrier_test,
    cluster_ref,
    format_tcgen05_sparse_metadata,
)
from pallas_mosaic_gpu.multidevice import (
    multicast_ref,
    multimem_load_reduce,
    multimem_store,
    remote_ref,
    semaphore_signal_multicast,
)
from pallas_mosaic_gpu.names import (
    REGS,
    OOBFillMode,
    PeerMemRef,
    PipelinePipeline,
    RefType,
    RefUnion,
    Replicated,
    Tiling,
    TMEMLayout,
    TraceScope,
    Transform,
    WGMMAAccumulatorRef,
    print_layout,
    transform_ref,
)
from pallas_mosaic_gpu.params import (
    ACC,
    GMEM,
    SMEM,
    TMEM,
    Barrier,
    ClusterBarrier,
    CompilerParams,
    GPUCompilerParams,
    LoweringSemantics,
    Mesh,
    SemaphoreType,
    ShapeDtypeStruct,
    kernel,
)
from pallas_mosaic_gpu.pipeline import (
    atomic_add,
    atomic_and,
    atomic_max,
    atomic_min,
    atomic_or,
    atomic_xor,
    emit_pipeline,
)
from pallas_mosaic_gpu.plugin import __version__
from pallas_mosaic_gpu.primitives import (
    CopyPartition,
    barrier_arrive,
    barrier_wait,
    commit_smem,
    copy_gmem_to_smem,
    copy_smem_to_gmem,
    wait_smem_to_gmem,
    wgmma,
    wgmma_wait,
)
from pallas_mosaic_gpu.refused import module_getattr
from pallas_mosaic_gpu.transforms import (
    BlockSpec,
    SwizzleTransform,
    TilingTransform,
    find_swizzle,
)
from pallas_mosaic_gpu.warp_specialized import (
    WarpSpecializedPipeline,
    emit_pipeline_warp_specialized,
    set_max_registers,
)

__all__ = ["__version__", "ACC", "atomic_add", "atomic_and", "atomic_max", "atomic_min",
           "atomic_or", "atomic_xor", "Barrier", "barrier_arrive", "barrier_wait", "commit_smem",
           "CompilerParams", "copy_gmem_to_smem", "copy_smem_to_gmem", "emit_pipeline", "GMEM",
           "GPUCompilerParams", "kernel", "Mesh", "ShapeDtypeStruct", "SMEM", "TMEM",
           "wait_smem_to_gmem", "wgmma", "wgmma_wait"]
__all__ += ["BlockSpec", "find_swizzle", "LoweringSemantics", "nd_loop", "NDLoopInfo",
            "planar_snake", "SwizzleTransform", "TilingTransform"]
__all__ += ["broadcasted_iota", "commit_smem_to_gmem_group", "Layout", "layout_cast", "load"]
__all__ += ["emit_pipeline_warp_specialized", "set_max_registers", "WarpSpecializedPipeline"]
__all__ += ["async_load_tmem", "async_store_tmem", "commit_tmem", "tcgen05_commit_arrive",
            "tcgen05_mma", "wait_load_tmem"]
__all__ += ["alloc_semaphore", "async_copy_scales_to_tmem", "async_copy_sparse_metadata_to_tmem"]
__all__ += ["dynamic_scheduling_loop", "query_cluster_cancel", "try_cluster_cancel",
            "TryClusterCancelResult", "WarpMesh"]
__all__ += ["multimem_load_reduce", "multimem_store", "remote_ref", "SemaphoreType",
            "semaphore_signal_multicast"]
__all__ += ["ClusterBarrier", "CopyPartition"]
__all__ += ["barrier_arrive_and_wait", "force_gpu_interpret_mode", "InterpretGPUParams", "max",
            "min", "mma", "prod", "set_gpu_interpret_mode", "store", "sum", "wait_gmem_to_smem"]
__all__ += ["async_prefetch", "griddepcontrol_launch_dependents", "griddepcontrol_wait",
            "semaphore_signal", "semaphore_wait"]
__all__ += ["SemaphoreSignal", "semaphore_signal_parallel"]
__all__ += ["MemorySpace"]
__all__ += ["warp_map", "wgmma_accumulator_load"]
__all__ += ["OOBFillMode", "PeerMemRef", "PipelinePipeline", "print_layout", "RefType",
            "RefUnion", "REGS", "Replicated", "Tiling", "TMEMLayout", "TraceScope", "Transform",
            "transform_ref", "WGMMAAccumulatorRef"]
__all__ += ["async_copy_smem_to_tmem", "async_store_smem", "barrier_test",
            "format_tcgen05_sparse_metadata"]
__all__ += ["as_torch_kernel", "im2col_ref", "inline_mgpu"]
__all__ += ["multicast_ref"]
__all__ += ["cluster_ref"]


_MOVED = plb.Deprecations("pallas_mosaic_gpu", globals(), {
    "transpose_ref": plb.Deprecated(
        "pallas_mosaic_gpu.transforms:transpose_ref",
        "plgpu.transpose_ref is deprecated, as in JAX 0.11. Fix: write ref.transpose(...).",
        (0, 11)),
}, missing=module_getattr)
"""Names JAX moved or removed: they work, and warn from the JAX release that warns; refused
names raise (``refused.py``)."""

__getattr__ = _MOVED.getattr
__dir__ = _MOVED.dir
