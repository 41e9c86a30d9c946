"""The Mosaic TPU backend of pallas (``import pallas_mosaic_tpu as pltpu``).

Kernels are lowered to a Mosaic module (the ``tpu`` MLIR dialect with ``arith``, ``vector``,
``memref``, ``scf``, ``math``) carried by the ``tpu_custom_call`` that TPU runtimes execute.
Lowering needs no TPU: ``jax.jit(f).trace(*a).lower(lowering_platforms=("tpu",))``.
"""

from __future__ import annotations

from pallas_core.spec import ANY
from pallas_mosaic_tpu.params import (
    ARBITRARY,
    CORE_PARALLEL,
    HBM,
    PARALLEL,
    SEMAPHORE,
    SMEM,
    VMEM,
    GridDimensionSemantics,
    PrefetchScalarGridSpec,
    TPUCompilerParams,
)
from pallas_mosaic_tpu.plugin import __version__

CompilerParams = TPUCompilerParams

__all__ = ["ANY", "ARBITRARY", "CORE_PARALLEL", "CompilerParams", "GridDimensionSemantics",
           "HBM", "PARALLEL", "PrefetchScalarGridSpec", "SEMAPHORE", "SMEM",
           "TPUCompilerParams", "VMEM", "__version__"]
