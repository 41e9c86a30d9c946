"""Hook implementations of the Mosaic GPU backend (entry point ``mosaic_gpu``)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from pallas_core import ANY
from pallas_core.backend import (
    GPU_CHIPS,
    BackendInfo,
    Chip,
    KernelCall,
    LoweringRequest,
    OpCost,
    RuleTable,
    hookimpl,
    pallas_use_mosaic_gpu,
)
from pallas_mosaic_gpu import (
    blackwell,
    call_lowering,
    cost,
    dynamic_scheduling,
    im2col,
    inline,
    inspection,
    layouts,
    more_ops,
    multidevice,
    primitives,
    rules,
    targets,
    validation,
    warp_specialized,
)
from pallas_mosaic_gpu.params import ACC_SPACE, GMEM, NAME, SMEM, TMEM, GPUCompilerParams

__version__ = "0.1.0"
TARGETS = targets.TARGETS
"""GPUs ``pl.stages(..., target=...)`` accepts (Hopper sm_90a, Blackwell sm_100a)."""

CHIPS = ("h100", "h200", "b200")
"""The chips of ``pl.report`` this backend compiles for (Hopper and Blackwell, from the core's
GPU datasheets), its default first."""


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
                       package="pallas-mosaic-gpu", capabilities=frozenset(),
                       chips={name: GPU_CHIPS[name] for name in CHIPS})


def _default_priority(platform: str) -> int:
    # Ahead of Triton (priority 0) on cuda where JAX's jax_pallas_use_mosaic_gpu says so.
    return 1 if pallas_use_mosaic_gpu() else -1


@hookimpl
def pallas_memory_spaces() -> Any:
    return (SMEM, GMEM, ANY, TMEM, ACC_SPACE)


@hookimpl
def pallas_primitives() -> Any:
    return (primitives.SEMANTICS + layouts.SEMANTICS + warp_specialized.SEMANTICS
            + blackwell.SEMANTICS + dynamic_scheduling.SEMANTICS + multidevice.SEMANTICS
            + more_ops.SEMANTICS + im2col.SEMANTICS + inline.SEMANTICS)


@hookimpl
def pallas_validate(call: KernelCall) -> None:
    validation.check(call)


@hookimpl
def pallas_footprint(call: KernelCall, chip: Chip | None) -> Any:
    """Shared memory as the lowering allocates it (``validation.smem_parts``: the dynamic
    shared memory of the launch, part by part) and the per-block limit: ``chip``'s, else the
    one the lowering refuses beyond (``validation.smem_limit``)."""
    limit = chip.onchip_default_limit if chip is not None else validation.smem_limit()
    return validation.smem_parts(call), limit


@hookimpl
def pallas_op_cost(eqn: Any) -> OpCost | None:
    """Matrix flops of ``wgmma``/``tcgen05_mma`` and HBM bytes of TMA copies (``cost.py``)."""
    return cost.op_cost(eqn)


@hookimpl
def pallas_op_value(eqn: Any) -> Any:
    """On the GPU, warpgroups run concurrently (the lowering folds the query to true)."""
    return True if eqn.primitive is warp_specialized.concurrent_p else None


@hookimpl
def pallas_lower(request: LoweringRequest) -> Any:
    with request.device_mesh():  # Mosaic GPU sizes its cross-device metadata by the mesh
        fn = call_lowering.kernel_fn(request.call, request.device_axes)
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
