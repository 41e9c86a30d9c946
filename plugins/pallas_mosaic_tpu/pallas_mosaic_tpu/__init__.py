"""The Mosaic TPU backend of pallas (``import pallas_mosaic_tpu as pltpu``).

Kernels are lowered to a Mosaic module (the ``tpu`` MLIR dialect with ``arith``, ``vector``,
``memref``, ``scf``, ``math``) carried by the ``tpu_custom_call`` that TPU runtimes execute.
Lowering needs no TPU: ``jax.jit(f).trace(*a).lower(lowering_platforms=("tpu",))``.
"""

from __future__ import annotations

import pallas_core.backend as plb
from pallas_core import ANY
from pallas_core.backend import async_copy, make_async_copy, make_async_remote_copy, reciprocal
from pallas_mosaic_tpu import core
from pallas_mosaic_tpu.elementwise import (
    join_bits,
    pack_elementwise,
    pack_fp6,
    split_bits,
    stochastic_round,
    unpack_elementwise,
    unpack_fp6,
)
from pallas_mosaic_tpu.errors import LoweringException
from pallas_mosaic_tpu.helpers import (
    CoreType,
    TensorCoreMesh,
    core_barrier,
    einshape,
    run_on_first_core,
    touch,
)
from pallas_mosaic_tpu.interpret import (
    InterpretParams,
    force_tpu_interpret_mode,
    reset_tpu_interpret_mode_state,
    set_tpu_interpret_mode,
)
from pallas_mosaic_tpu.memory import (
    annotate,
    has_memory_space,
    trace_value,
    with_memory_space_constraint,
)
from pallas_mosaic_tpu.mxu import (
    ACC,
    conv,
    matmul_acc_lhs,
    matmul_lhs_fifo,
    matmul_pop,
    matmul_pop_fifo,
    matmul_push_rhs,
)
from pallas_mosaic_tpu.params import (
    ARBITRARY,
    CMEM,
    CORE_PARALLEL,
    DMA_SEMAPHORE,
    HBM,
    PARALLEL,
    SEMAPHORE,
    SMEM,
    SUBCORE_PARALLEL,
    VMEM,
    VMEM_SHARED,
    GridDimensionSemantics,
    MemorySpace,
    PrefetchScalarGridSpec,
    SemaphoreType,
    SideEffectType,
    TPUCompilerParams,
    async_remote_copy,
    dma_semaphore,
    get_barrier_semaphore,
    sync_copy,
)
from pallas_mosaic_tpu.pipeline import (
    BufferedRef,
    BufferType,
    PipelineStep,
    emit_pipeline,
    emit_pipeline_with_allocations,
    emit_pipeline_with_async_prefetch,
)
from pallas_mosaic_tpu.plugin import __version__
from pallas_mosaic_tpu.primitives import (
    bitcast,
    load,
    prng_random_bits,
    prng_seed,
    repeat,
    roll,
    store,
)
from pallas_mosaic_tpu.stateful_random import (
    sample_block,
    stateful_bernoulli,
    stateful_bits,
    stateful_normal,
    stateful_uniform,
    to_pallas_key,
)
from pallas_mosaic_tpu.tpu_info import (
    ChipVersion,
    Tiling,
    TpuInfo,
    get_tpu_info,
    get_tpu_info_for_chip,
    is_tpu_device,
)

CompilerParams = TPUCompilerParams

__all__ = ["__version__", "ANY", "ARBITRARY", "async_copy", "async_remote_copy", "bitcast",
           "CompilerParams", "CORE_PARALLEL", "DMA_SEMAPHORE",
           "emit_pipeline", "force_tpu_interpret_mode", "get_barrier_semaphore",
           "GridDimensionSemantics", "HBM", "InterpretParams", "load", "make_async_copy",
           "make_async_remote_copy", "PARALLEL", "PrefetchScalarGridSpec", "prng_random_bits",
           "prng_seed", "repeat", "reset_tpu_interpret_mode_state", "roll", "SEMAPHORE",
           "SemaphoreType", "set_tpu_interpret_mode", "SideEffectType", "SMEM", "store",
           "sync_copy", "TPUCompilerParams", "VMEM",
           "ChipVersion", "CoreType", "core_barrier", "einshape", "get_tpu_info",
           "get_tpu_info_for_chip", "is_tpu_device", "run_on_first_core", "TensorCoreMesh",
           "Tiling", "TpuInfo", "stateful_bernoulli", "stateful_bits", "stateful_normal",
           "stateful_uniform", "touch",
           "annotate", "CMEM", "core", "dma_semaphore", "has_memory_space", "LoweringException",
           "MemorySpace", "reciprocal", "SUBCORE_PARALLEL", "trace_value", "VMEM_SHARED",
           "with_memory_space_constraint", "join_bits", "pack_elementwise", "pack_fp6",
           "split_bits", "stochastic_round", "unpack_elementwise", "unpack_fp6",
           "sample_block", "to_pallas_key", "BufferedRef", "BufferType", "PipelineStep",
           "emit_pipeline_with_allocations", "emit_pipeline_with_async_prefetch", "ACC", "conv",
           "matmul_acc_lhs", "matmul_lhs_fifo", "matmul_pop", "matmul_pop_fifo",
           "matmul_push_rhs"]

_MOVED = plb.Deprecations("pallas_mosaic_tpu", globals(), {
    "BufferedRefBase": plb.Deprecated(
        "pallas_mosaic_tpu.pipeline:BufferedRefBase",
        "pltpu.BufferedRefBase is deprecated, as in JAX 0.12: it is internal to the pipelines. "
        "Fix: use pltpu.BufferedRef.", (0, 12)),
    "create_tensorcore_mesh": plb.Deprecated(
        "pallas_mosaic_tpu.params:create_tensorcore_mesh",
        "pltpu.create_tensorcore_mesh is deprecated, as in JAX 0.11. Fix: write "
        "pltpu.TensorCoreMesh(...).", (0, 11)),
    "HOST": plb.Deprecated(
        "pallas_core:HOST",
        "pltpu.HOST is deprecated, as in JAX 0.10 (JAX 0.12 removed it). Fix: write pl.HOST.",
        (0, 10)),
})
"""Names JAX moved or removed: they work, and warn from the JAX release that warns."""

__getattr__ = _MOVED.getattr
__dir__ = _MOVED.dir
