"""Hook implementations of the Mosaic TPU backend (entry point ``mosaic_tpu``)."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from pallas_core import ANY, HOST
from pallas_core import backend as plb
from pallas_core.backend import (
    BackendInfo,
    EmulatedCall,
    KernelCall,
    LoweringRequest,
    PallasError,
    RuleTable,
    hookimpl,
)
from pallas_core.backend import Capability as Cap
from pallas_mosaic_tpu import elementwise, lowering, memory, mxu, primitives, symbolic, validation
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.errors import as_lowering_exception
from pallas_mosaic_tpu.params import (
    CMEM,
    DMA_SEMAPHORE,
    HBM,
    NAME,
    SEMAPHORE,
    SMEM,
    VMEM,
    VMEM_SHARED,
    SideEffectType,
    TPUCompilerParams,
)
from pallas_mosaic_tpu.tpu_info import roofline_chips

__version__ = "0.1.0"
CUSTOM_CALL_TARGET = "tpu_custom_call"
CHIPS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5p", "v6e": "TPU v6 lite",
         "v7x": "TPU7x"}
"""TPU generations ``pl.stages(..., target=...)`` accepts, with their JAX device kinds."""


def estimated_cost(call: KernelCall, has_communication: bool = False) -> plb.CostEstimate | None:
    """The cost estimate a TensorCore kernel's custom call carries for XLA's scheduler: the
    user's (``pallas_call(cost_estimate=...)``), else the one ``pl.report`` counts
    (``plb.kernel_cost``: flops of the body times the grid, transcendentals, HBM bytes the
    pipeline and the kernel's own copies move).

    ``None`` (no estimate, as JAX emits without one) where that count would be wrong: a grid
    or shapes known only at run time, a kernel that talks to other devices (its remote bytes
    are not counted), or a kernel the count fails on."""
    if call.cost_estimate is not None:
        return call.cost_estimate
    if has_communication or call.grid_mapping.dynamic_axes or call.symbolic_dims:
        return None
    try:
        return plb.kernel_cost(call, backend=NAME)
    except Exception:  # a hint to the scheduler: a count that fails never fails a lowering
        return None


def custom_call_config(call: KernelCall, body: bytes, has_communication: bool = False,
                       needs_layout_passes: bool = True,
                       cost: plb.CostEstimate | None = None) -> dict[str, Any]:
    """The ``custom_call_config`` part of a ``tpu_custom_call``'s configuration (key order as
    TPU runtimes expect); the SparseCore backend builds on it. ``cost`` is the estimate to
    write (default: the user's, if any)."""
    config: dict[str, Any] = {"body": base64.b64encode(body).decode("ascii")}
    params = call.compiler_params
    tpu_params = params if isinstance(params, TPUCompilerParams) else None
    if has_communication:
        config["has_communication"] = True
    if tpu_params is not None and tpu_params.collective_id is not None:
        config["collective_id"] = tpu_params.collective_id
    ce = cost if cost is not None else call.cost_estimate
    if ce is not None:  # keys sorted, as JAX writes them
        config["cost_estimate"] = {"bytes_accessed": ce.bytes_accessed, "flops": ce.flops,
                                   "remote_bytes_transferred": ce.remote_bytes_transferred,
                                   "transcendentals": ce.transcendentals}
    config["serialization_format"] = (1 if tpu_params is None
                                      else tpu_params.serialization_format)
    if needs_layout_passes and (tpu_params is None or tpu_params.needs_layout_passes):
        config["needs_layout_passes"] = True
    if tpu_params is None:
        return config
    if not tpu_params.shape_invariant_numerics:
        config["shape_invariant_numerics"] = False
    if tpu_params.allow_input_fusion is not None:
        config["allow_input_fusion"] = list(tpu_params.allow_input_fusion)
    if tpu_params.internal_scratch_in_bytes is not None:
        config["internal_scratch_in_bytes"] = tpu_params.internal_scratch_in_bytes
    for flag in ("disable_bounds_checks", "disable_semaphore_checks", "skip_device_barrier"):
        if getattr(tpu_params, flag):
            config[flag] = True
    return config


def _flag_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolean_value": value}
    if isinstance(value, int):
        return {"integer_value": value}
    return {"double_value": value}


def backend_config(call: KernelCall, body: bytes, has_communication: bool = False) -> str:
    """The JSON configuration of the ``tpu_custom_call`` of a TensorCore kernel, with its
    :func:`estimated_cost`."""
    params = call.compiler_params
    cost = estimated_cost(call, has_communication)
    full: dict[str, Any] = {"custom_call_config": custom_call_config(
        call, body, has_communication, cost=cost)}
    if isinstance(params, TPUCompilerParams) and params.vmem_limit_bytes is not None:
        full["scoped_memory_configs"] = [
            {"memory_space": 1, "offset": 0, "size": params.vmem_limit_bytes}]
    if isinstance(params, TPUCompilerParams) and params.flags is not None:
        full["flag_configs"] = [{"flag_type": k, "value": _flag_value(v)}
                                for k, v in params.flags.items()]
    return json.dumps(full)


def emit_tpu_custom_call(request: LoweringRequest, config: str, kernel_name: str) -> Any:
    """The ``tpu_custom_call`` running a Mosaic kernel on the request's operands, marked as
    side-effecting as ``CompilerParams(has_side_effects=...)`` asks."""
    call = request.call
    params = call.compiler_params
    effect = (params.side_effect_type if isinstance(params, TPUCompilerParams)
              else SideEffectType.PURE)
    frontend = ({"xla_allow_dce_side_effecting_op": "true"}
                if effect is SideEffectType.DATAFLOW_SIDE_EFFECTING else None)
    # Dynamic grid sizes (the call's last operands) go first, as the TPU runtime reads them.
    n = call.grid_mapping.num_dynamic_grid_bounds
    operands = list(request.operands)
    if n:
        operands = operands[len(operands) - n:] + operands[:len(operands) - n]
    aliases = {i + n: o for i, o in call.input_output_aliases}
    return plb.emit_custom_call(
        request.ctx, CUSTOM_CALL_TARGET, operands, call.out_avals,
        backend_config=config, api_version=1, extra_attributes={"kernel_name": kernel_name},
        operand_output_aliases=aliases or None,
        has_side_effect=effect is not SideEffectType.PURE, frontend_attributes=frontend)


def lowering_rules() -> RuleTable:
    """This backend's full lowering-rule table (primitive -> rule), read-only; every rule has
    the signature all backends share (``pallas_core.backend.Rule``)."""
    return lowering.lowering_rules()


@hookimpl
def pallas_describe() -> BackendInfo:
    return BackendInfo(name=NAME, version=__version__, platforms=("tpu",),
                       compiler_params_type=TPUCompilerParams, default_for=("tpu",),
                       package="pallas-mosaic-tpu",
                       capabilities=frozenset({
                           Cap.SCALAR_PREFETCH, Cap.PIPELINE_MODE, Cap.DYNAMIC_GRID,
                           Cap.SYMBOLIC_BLOCKS, Cap.SCRATCH, Cap.ALIASING, Cap.RUN_SCOPED,
                           Cap.VMAP, Cap.SEMAPHORES, Cap.ASYNC_COPY, Cap.DEBUG_PRINT}),
                       device_kinds={"v5e": CHIPS["v5e"], **CHIPS},
                       chips=roofline_chips(validation.DEFAULT_VMEM_LIMIT))


@hookimpl
def pallas_footprint(call: KernelCall) -> Any:
    """VMEM as the lowering counts it (``validation.vmem_parts``) and the limit it refuses
    beyond (the same on every chip: the smallest default scoped VMEM)."""
    return validation.vmem_parts(call), validation.vmem_limit(call)


@hookimpl
def pallas_memory_spaces() -> Any:
    return (VMEM, ANY, HBM, SMEM, SEMAPHORE, DMA_SEMAPHORE, CMEM, VMEM_SHARED, HOST)


@hookimpl
def pallas_primitives() -> Any:
    return primitives.SEMANTICS + memory.SEMANTICS + elementwise.SEMANTICS + mxu.SEMANTICS


@hookimpl
def pallas_validate(call: KernelCall) -> None:
    validation.check(call)


@hookimpl
def pallas_lower(request: LoweringRequest) -> Any:
    call = request.call
    try:
        axes = plb.manual_axes(request.ctx)
        module, name = symbolic.lower(call, lambda c: lowering.lower_kernel(c, axes))
    except PallasError as e:
        raise as_lowering_exception(e).with_traceback(e.__traceback__) from None
    config = backend_config(call, mir.serialize(module), mir.has_communication(module))
    return emit_tpu_custom_call(request, config, name)


@hookimpl
def pallas_stages(call: KernelCall, target: str | None) -> Mapping[str, Any]:
    if target is not None and target not in CHIPS and target not in CHIPS.values():
        raise PallasError(
            f"pl.stages(backend='mosaic_tpu', target={target!r}): unknown TPU generation. Fix: "
            f"use one of {sorted(CHIPS)} (or a device kind such as 'TPU v5 lite').")
    # The Mosaic module does not depend on the chip: the TPU runtime's Mosaic compiler
    # specialises it for the device it runs on, so no TPU is needed here.
    module, _ = symbolic.lower(call, lowering.lower_kernel)
    return {"mosaic": lowering.module_text(module)}


@hookimpl
def pallas_emulate(call: EmulatedCall) -> Any:
    from pallas_mosaic_tpu import emulator  # numpy machinery, loaded on first use

    return emulator.emulate(call)
