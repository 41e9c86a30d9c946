"""pallas_core: write a kernel once, run it on any installed backend.

``import pallas_core as pl`` gives the kernel-writing surface of ``jax.experimental.pallas``
(``pallas_call``, ``BlockSpec``, ``program_id``, ...) plus ``backend=`` selection among
installed plugins, ``pl.load``/``pl.store``/atomics and ``pl.stages``.
"""

from __future__ import annotations

from pallas_core._jax import Slice, ds, run_state
from pallas_core._jax import ds as dslice
from pallas_core.call import pallas_call, pallas_call_p
from pallas_core.errors import (
    AutodiffError,
    BackendNotFoundError,
    BlockSpecError,
    KernelSignatureError,
    KernelTraceError,
    LoweringError,
    OutOfBoundsError,
    PallasError,
    PluginLoadError,
    UnsupportedError,
)
from pallas_core.grid_mapping import BlockMapping, GridMapping
from pallas_core.kernel import core_map, kernel
from pallas_core.plugins import Backend, BackendInfo, register_backend
from pallas_core.primitives import (
    DeviceIdType,
    atomic_add,
    atomic_and,
    atomic_cas,
    atomic_max,
    atomic_min,
    atomic_or,
    atomic_xchg,
    atomic_xor,
    broadcast_to,
    debug_print,
    empty,
    empty_like,
    load,
    loop,
    multiple_of,
    num_programs,
    program_id,
    run_scoped,
    semaphore_read,
    semaphore_signal,
    semaphore_wait,
    store,
    swap,
    when,
)
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.semantics import PrimitiveSemantics, ReferenceContext
from pallas_core.spec import (
    ANY,
    BlockDim,
    Blocked,
    BlockSpec,
    BoundedSlice,
    CompilerParams,
    CostEstimate,
    Element,
    GridSpec,
    MemoryRef,
    MemorySpace,
    Mesh,
    Squeezed,
    cdiv,
    no_block_spec,
    squeezed,
)
from pallas_core.stages import KernelStages, stages

__version__ = "0.1.0"

__all__ = [
    "ANY", "atomic_add", "atomic_and", "atomic_cas", "atomic_max", "atomic_min", "atomic_or",
    "atomic_xchg", "atomic_xor", "AutodiffError", "Backend", "BackendInfo",
    "BackendNotFoundError", "BlockMapping", "BlockSpec", "BlockSpecError", "broadcast_to",
    "cdiv", "CompilerParams", "core_map", "CostEstimate", "debug_print", "DeviceIdType", "ds",
    "dslice", "empty", "empty_like", "GridMapping", "GridSpec", "kernel", "KernelCall",
    "KernelSignatureError", "KernelStages", "KernelTraceError", "load", "loop",
    "LoweringError", "LoweringRequest", "MemoryRef", "MemorySpace", "Mesh", "multiple_of",
    "no_block_spec", "num_programs", "OutOfBoundsError", "pallas_call", "pallas_call_p",
    "PallasError", "PluginLoadError", "PrimitiveSemantics", "program_id", "ReferenceContext",
    "register_backend", "run_scoped", "run_state", "semaphore_read", "semaphore_signal",
    "semaphore_wait", "Slice", "Squeezed", "squeezed", "stages", "store", "swap",
    "UnsupportedError", "when",
    # Block dimensions of BlockSpec.block_shape.
    "BlockDim", "Blocked", "BoundedSlice", "Element",
]
