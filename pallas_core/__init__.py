"""pallas_core: write a kernel once, run it on any installed backend.

``import pallas_core as pl`` gives the kernel-writing surface of ``jax.experimental.pallas``
(``pallas_call``, ``BlockSpec``, ``program_id``, ...) plus ``backend=`` selection among
installed plugins, ``pl.load``/``pl.store``/atomics and ``pl.stages``. The few names of
``jax.experimental.pallas`` it lacks (``docs/core_api.md``) raise an ``UnsupportedError``
saying what to write instead when looked up.
"""

from __future__ import annotations

from typing import Any

from pallas_core._jax import Slice, ds, run_state, warn_if_untested_jax
from pallas_core._jax import ds as dslice
from pallas_core.autotune import Autotuned, AutotuneResult, autotune
from pallas_core.call import pallas_call, pallas_call_p
from pallas_core.copies import select_ref
from pallas_core.cost import estimate_cost
from pallas_core.deprecations import Deprecated, Deprecations
from pallas_core.emulation.api import emulate
from pallas_core.errors import (
    ArgumentError,
    AutodiffError,
    BackendNotFoundError,
    BlockSpecError,
    KernelSignatureError,
    KernelTraceError,
    LoweringError,
    OutOfBoundsError,
    PallasError,
    PluginConfigError,
    PluginError,
    PluginLoadError,
    PluginLoadWarning,
    PluginWarning,
    UnsupportedError,
    UnsupportedNameError,
)
from pallas_core.extras import (
    debug_check,
    delay,
    empty_ref_like,
    enable_debug_checks,
    enable_poison_buffers,
    lower_as_mlir,
    pallas_export_experimental,
    with_scoped,
)
from pallas_core.grid_mapping import BlockMapping, GridMapping
from pallas_core.kernel import kernel
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
    get_global,
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
from pallas_core.report import KernelReport, Report, report
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.roofline import Chip, Roofline
from pallas_core.semantics import PrimitiveSemantics, ReferenceContext
from pallas_core.spec import (
    ANY,
    HOST,
    BlockDim,
    Blocked,
    BlockSpec,
    BoundedSlice,
    Buffered,
    CompilerParams,
    CostEstimate,
    Element,
    GridSpec,
    Indirect,
    MemoryRef,
    MemorySpace,
    Mesh,
    RevisitMode,
    Squeezed,
    no_block_spec,
    semaphore,
    squeezed,
)
from pallas_core.stages import KernelStages, stages
from pallas_core.utils import align_to, cdiv, next_power_of_2, strides_from_shape

warn_if_untested_jax()

__version__ = "0.1.0"

__all__ = [
    "align_to", "ANY", "ArgumentError", "atomic_add", "atomic_and", "atomic_cas", "atomic_max",
    "atomic_min", "atomic_or", "atomic_xchg", "atomic_xor", "AutodiffError", "Backend",
    "BackendInfo", "BackendNotFoundError", "BlockDim", "Blocked", "BlockMapping", "BlockSpec",
    "BlockSpecError", "broadcast_to", "Buffered", "cdiv", "CompilerParams",
    "CostEstimate", "debug_check", "debug_print", "delay",
    "ds", "dslice", "empty", "empty_like", "empty_ref_like", "emulate",
    "enable_debug_checks", "enable_poison_buffers", "estimate_cost", "get_global",
    "GridMapping", "GridSpec", "HOST", "Indirect", "kernel", "KernelCall",
    "KernelSignatureError", "KernelStages", "KernelTraceError", "load", "loop", "lower_as_mlir",
    "LoweringError", "LoweringRequest", "MemoryRef", "MemorySpace", "Mesh", "multiple_of",
    "next_power_of_2", "no_block_spec", "num_programs", "OutOfBoundsError", "pallas_call",
    "pallas_export_experimental",
    "pallas_call_p", "PallasError", "PluginConfigError", "PluginError", "PluginLoadError",
    "PluginLoadWarning", "PluginWarning",
    "PrimitiveSemantics", "program_id",
    "ReferenceContext", "register_backend", "RevisitMode", "run_scoped",
    "run_state", "select_ref", "semaphore", "semaphore_read", "semaphore_signal",
    "semaphore_wait", "Slice", "Squeezed", "squeezed", "stages", "store", "report", "Report",
    "KernelReport", "Chip", "Roofline", "strides_from_shape", "autotune", "Autotuned",
    "AutotuneResult",
    "swap", "UnsupportedError",
    "UnsupportedNameError", "when", "with_scoped",
    # Block dimensions of BlockSpec.block_shape.
    "BoundedSlice", "Element",
]


_MOVED = Deprecations("pallas_core", globals(), {
    "DeviceIdType": Deprecated(
        "pallas_core.primitives:DeviceIdType",
        "pl.DeviceIdType is deprecated, as in JAX 0.12, together with the device_id_type= "
        "argument of semaphore and DMA calls that it is for; it still works here.", (0, 12)),
    "reciprocal": Deprecated(
        "pallas_core.extras:reciprocal",
        "pl.reciprocal moved to the Mosaic TPU backend in JAX 0.11. Fix: write "
        "pltpu.reciprocal (import pallas_mosaic_tpu as pltpu).", (0, 11)),
    "core_map": Deprecated(
        "pallas_core.kernel:core_map",
        "pl.core_map is deprecated, as in JAX 0.11. Fix: write pl.kernel.", (0, 11)),
    "dot": Deprecated(
        "pallas_core.extras:dot",
        "pl.dot is deprecated, as in JAX 0.10 (JAX 0.12 removed it). Fix: write jnp.dot, "
        "jnp.einsum or @ (or pallas_triton.dot in Triton kernels).", (0, 10)),
    "debug_checks_enabled": Deprecated(
        "pallas_core.extras:debug_checks_enabled",
        "pl.debug_checks_enabled is deprecated, as in JAX 0.10 (JAX 0.12 removed it). Fix: "
        "read pl.enable_debug_checks.value.", (0, 10)),
}, missing=lambda name: _not_provided(name))
"""Names JAX moved or removed: they work, and warn from the JAX release that warns."""


def _not_provided(name: str) -> Any:
    # Names of jax.experimental.pallas that are not provided: say so, and what to write.
    from pallas_core.extras import not_provided

    raise not_provided(name)


__getattr__ = _MOVED.getattr
__dir__ = _MOVED.dir
