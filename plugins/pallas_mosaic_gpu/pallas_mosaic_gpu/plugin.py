"""Hook implementations of the Mosaic GPU backend (entry point ``mosaic_gpu``)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from pallas_core.backend import RuleTable, pallas_use_mosaic_gpu
from pallas_core.hookspecs import hookimpl
from pallas_core.plugins import BackendInfo
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.spec import ANY
from pallas_mosaic_gpu import (
    blackwell,
    im2col,
    inline,
    inspection,
    layouts,
    more_ops,
    multidevice,
    primitives,
    rules,
    schedule,
    scheduling,
    targets,
    validation,
    warp_specialized,
)
from pallas_mosaic_gpu.params import ACC_SPACE, GMEM, NAME, SMEM, TMEM, GPUCompilerParams

__version__ = "0.1.0"
TARGETS = targets.TARGETS
"""GPUs ``pl.stages(..., target=...)`` accepts (Hopper sm_90a, Blackwell sm_100a)."""


def lowering_rules() -> RuleTable:
    """This backend's full lowering-rule table (primitive -> rule), read-only. Each entry is
    registered by ``pallas_mosaic_gpu.rules.rule`` with the signature all backends share
    (``pallas_core.backend.Rule``: ``(state, eqn, *in_values)``), the rule body receiving the
    equation's parameters as keywords."""
    return types.MappingProxyType(rules.RULES)


@hookimpl
def pallas_describe() -> BackendInfo:
    return BackendInfo(name=NAME, version=__version__, platforms=("cuda",),
                       compiler_params_type=GPUCompilerParams, default_for=("cuda",),
                       default_priority=_default_priority,
                       package="pallas-mosaic-gpu", capabilities=frozenset())


def _default_priority(platform: str) -> int:
    # Ahead of Triton (priority 0) on cuda where JAX's jax_pallas_use_mosaic_gpu says so.
    return 1 if pallas_use_mosaic_gpu() else -1


@hookimpl
def pallas_memory_spaces() -> Any:
    return (SMEM, GMEM, ANY, TMEM, ACC_SPACE)


@hookimpl
def pallas_primitives() -> Any:
    return (primitives.SEMANTICS + layouts.SEMANTICS + warp_specialized.SEMANTICS
            + blackwell.SEMANTICS + scheduling.SEMANTICS + multidevice.SEMANTICS
            + more_ops.SEMANTICS + im2col.SEMANTICS + inline.SEMANTICS)


@hookimpl
def pallas_validate(call: KernelCall) -> None:
    validation.check(call)


@hookimpl
def pallas_lower(request: LoweringRequest) -> Any:
    with request.device_mesh():  # Mosaic GPU sizes its cross-device metadata by the mesh
        fn = schedule.kernel_fn(request.call, request.device_axes)
    return request.lower_jax(fn)


@hookimpl
def pallas_stages(call: KernelCall, target: str | None) -> Mapping[str, Any]:
    if target is not None:
        targets.parse(target)  # a PallasError naming the targets if unknown

    def text() -> str:
        with targets.targeting(target):
            return inspection.module_text(call)

    def data() -> bytes:
        with targets.targeting(target):
            return inspection.module_bytes(call)

    return {"mosaic_gpu": text, "mosaic_gpu_bytecode": data}
