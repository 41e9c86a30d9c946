"""The Triton backend of pallas: kernels compiled by Triton, run by JAX on NVIDIA and AMD GPUs.

Kernels are lowered to Triton IR (the ``tt`` dialect, built with jaxlib's MLIR bindings) and
emitted as XLA's Triton custom call (on ``cuda`` and ``rocm``), which compiles them for the GPU
they run on. ``pl.stages(fn, *args, backend="triton", target="sm_90")`` compiles the same IR
through the ``triton`` package to ``ttgir``, ``llir``, ``ptx`` and ``cubin`` on any machine
(``target="gfx942"``: ``amdgcn`` and ``hsaco``).
"""

from __future__ import annotations

from pallas_core import (
    atomic_add,
    atomic_and,
    atomic_cas,
    atomic_max,
    atomic_min,
    atomic_or,
    atomic_xchg,
    atomic_xor,
)
from pallas_core.backend import dot  # pl.dot moved here in JAX 0.10
from pallas_triton.gpu_info import (
    GpuInfo,
    GpuVersion,
    get_gpu_info,
    get_gpu_info_from_version,
    is_gpu_device,
)
from pallas_triton.params import TritonParams
from pallas_triton.plugin import CUSTOM_CALL_TARGET, __version__
from pallas_triton.primitives import (
    approx_tanh,
    debug_barrier,
    elementwise_inline_asm,
    load,
    max_contiguous,
    store,
)

CompilerParams = TritonParams

CUSTOM_CALL_TARGET_NAME = CUSTOM_CALL_TARGET
"""The custom call target of the calls this backend emits (XLA's Triton call)."""

__all__ = ["CUSTOM_CALL_TARGET_NAME", "CompilerParams", "GpuInfo", "GpuVersion", "TritonParams",
           "__version__", "approx_tanh", "atomic_add",
           "atomic_and", "atomic_cas", "atomic_max", "atomic_min", "atomic_or", "atomic_xchg",
           "atomic_xor", "debug_barrier", "dot", "elementwise_inline_asm", "get_gpu_info",
           "get_gpu_info_from_version", "is_gpu_device", "load",
           "max_contiguous", "store"]
