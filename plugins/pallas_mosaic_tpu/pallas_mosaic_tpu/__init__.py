"""The Mosaic TPU backend of pallas (``import pallas_mosaic_tpu as pltpu``).

Kernels are lowered to a Mosaic module (the ``tpu`` MLIR dialect with ``arith``, ``vector``,
``memref``, ``scf``, ``math``) carried by the ``tpu_custom_call`` that TPU runtimes execute.
Lowering needs no TPU: ``jax.jit(f).trace(*a).lower(lowering_platforms=("tpu",))``.
"""

from __future__ import annotations

from pallas_core.copies import async_copy, make_async_copy, make_async_remote_copy
from pallas_core.spec import ANY
from pallas_mosaic_tpu.params import (
    ARBITRARY,
    CORE_PARALLEL,
    DMA_SEMAPHORE,
    HBM,
    PARALLEL,
    SEMAPHORE,
    SMEM,
    VMEM,
    GridDimensionSemantics,
    PrefetchScalarGridSpec,
    SemaphoreType,
    TPUCompilerParams,
    create_tensorcore_mesh,
    sync_copy,
)
from pallas_mosaic_tpu.plugin import __version__

CompilerParams = TPUCompilerParams

__all__ = ["ANY", "ARBITRARY", "CORE_PARALLEL", "CompilerParams", "DMA_SEMAPHORE",
           "GridDimensionSemantics", "HBM", "PARALLEL", "PrefetchScalarGridSpec", "SEMAPHORE",
           "SMEM", "SemaphoreType", "TPUCompilerParams", "VMEM", "__version__", "async_copy",
           "create_tensorcore_mesh", "make_async_copy", "make_async_remote_copy", "sync_copy"]
