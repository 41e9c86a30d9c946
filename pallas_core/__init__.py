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
    store,
    swap,
    when,
)
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.semantics import PrimitiveSemantics, ReferenceContext
from pallas_core.spec import (
    ANY,
    BlockSpec,
    CompilerParams,
    CostEstimate,
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
    "ANY", "AutodiffError", "Backend", "BackendInfo", "BackendNotFoundError", "BlockMapping",
    "BlockSpec", "BlockSpecError", "CompilerParams", "CostEstimate", "GridMapping", "GridSpec",
    "KernelCall", "KernelSignatureError", "KernelStages", "KernelTraceError", "LoweringError",
    "LoweringRequest",
    "MemoryRef", "MemorySpace", "Mesh", "OutOfBoundsError", "PallasError", "PluginLoadError",
    "PrimitiveSemantics", "ReferenceContext", "Slice", "Squeezed", "UnsupportedError",
    "atomic_add", "atomic_and", "atomic_cas", "atomic_max", "atomic_min", "atomic_or",
    "atomic_xchg", "atomic_xor", "broadcast_to", "cdiv", "core_map", "debug_print", "ds",
    "dslice", "empty", "empty_like", "kernel", "load", "loop", "multiple_of", "no_block_spec",
    "num_programs", "pallas_call", "pallas_call_p", "program_id", "register_backend",
    "run_scoped", "run_state", "squeezed", "stages", "store", "swap", "when",
]
