"""``pltpu.core``: the names of JAX's ``jax._src.pallas.mosaic.core`` module (what
``jax.experimental.pallas.tpu.core`` re-exports), here. Each is also ``pltpu.<name>``."""

from __future__ import annotations

from pallas_mosaic_tpu.helpers import CoreType, TensorCoreMesh
from pallas_mosaic_tpu.params import (
    ARBITRARY,
    CORE_PARALLEL,
    PARALLEL,
    SUBCORE_PARALLEL,
    AccMemorySpace,
    GridDimensionSemantics,
    MemorySpace,
    PrefetchScalarGridSpec,
    SemaphoreType,
    SideEffectType,
    TPUCompilerParams,
    create_tensorcore_mesh,
    dma_semaphore,
)

CompilerParams = TPUCompilerParams

__all__ = ["AccMemorySpace", "ARBITRARY", "CompilerParams", "CORE_PARALLEL", "CoreType",
           "create_tensorcore_mesh",
           "dma_semaphore", "GridDimensionSemantics", "MemorySpace", "PARALLEL",
           "PrefetchScalarGridSpec", "SemaphoreType", "SideEffectType", "SUBCORE_PARALLEL",
           "TensorCoreMesh"]
