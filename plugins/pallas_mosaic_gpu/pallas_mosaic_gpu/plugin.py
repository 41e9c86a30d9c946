"""Hook implementations of the Mosaic GPU backend (entry point ``mosaic_gpu``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pallas_core.errors import PallasError
from pallas_core.hookspecs import hookimpl
from pallas_core.plugins import BackendInfo
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.spec import ANY
from pallas_mosaic_gpu import (
    inspection,
    layouts,
    lowering,
    primitives,
    validation,
    warp_specialized,
)
from pallas_mosaic_gpu.params import ACC_SPACE, GMEM, NAME, SMEM, TMEM, GPUCompilerParams

__version__ = "0.1.0"
TARGETS = {"sm_90a": (9, 0), "sm_90": (9, 0)}
"""GPUs ``pl.stages(..., target=...)`` accepts (Hopper; Blackwell's sm_100a is not yet)."""


@hookimpl
def pallas_describe() -> BackendInfo:
    return BackendInfo(name=NAME, version=__version__, platforms=("cuda",),
                       compiler_params_type=GPUCompilerParams, default_for=(),
                       package="pallas-mosaic-gpu", capabilities=frozenset())


@hookimpl
def pallas_memory_spaces() -> Any:
    return (SMEM, GMEM, ANY, TMEM, ACC_SPACE)


@hookimpl
def pallas_primitives() -> Any:
    return primitives.SEMANTICS + layouts.SEMANTICS + warp_specialized.SEMANTICS


@hookimpl
def pallas_validate(call: KernelCall, backend: str) -> None:
    if backend == NAME:
        validation.check(call)


@hookimpl
def pallas_lower(request: LoweringRequest) -> Any:
    if request.backend != NAME:
        return None
    fn = lowering.kernel_fn(request.call)
    return request.lower_jax(fn)


@hookimpl
def pallas_stages(call: KernelCall, backend: str, target: str | None) -> Mapping[str, Any] | None:
    if backend != NAME:
        return None
    if target is not None and target not in TARGETS:
        raise PallasError(
            f"pl.stages(backend='mosaic_gpu', target={target!r}): unknown target. Fix: use one "
            f"of {sorted(TARGETS)} (Hopper).")
    return {"mosaic_gpu": lambda: inspection.module_text(call),
            "mosaic_gpu_bytecode": lambda: inspection.module_bytes(call)}
