"""Hook implementations of the Triton backend (entry point ``triton``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pallas_core import backend as plb
from pallas_core.backend import (
    BackendInfo,
    EmulatedCall,
    KernelCall,
    LoweringRequest,
    RuleTable,
    hookimpl,
)
from pallas_core.backend import Capability as Cap
from pallas_triton import compile as triton_compile
from pallas_triton import emulator, lowering, primitives, validation
from pallas_triton.gpu_info import roofline_chips
from pallas_triton.params import NAME, TritonParams

__version__ = "0.1.0"

# XLA's own Triton call, on CUDA and ROCm alike: it compiles the kernel's Triton IR for the GPU
# it runs on.
CUSTOM_CALL_TARGET = "__gpu$xla.gpu.triton"


def params_of(call: KernelCall) -> TritonParams:
    params = call.compiler_params
    return params if isinstance(params, TritonParams) else TritonParams()


def lowering_rules() -> RuleTable:
    """This backend's full lowering-rule table (primitive -> rule), read-only; every rule has
    the signature all backends share (``pallas_core.backend.Rule``)."""
    return lowering.lowering_rules()


@hookimpl
def pallas_describe() -> BackendInfo:
    return BackendInfo(
        name=NAME, version=__version__, platforms=("cuda", "rocm"),
        compiler_params_type=TritonParams, default_for=("cuda", "rocm"), package="pallas-triton",
        capabilities=frozenset({Cap.MASKED_ACCESS, Cap.ATOMICS, Cap.ALIASING, Cap.VMAP,
                                Cap.DEBUG_PRINT, Cap.MESH}),
        # What pl.emulate tells JAX it compiles for (JAX 0.11's Triton lowering asks). An AMD
        # GPU's kind is its architecture name, as JAX reads it off a ROCm device (the
        # marketing name, "AMD Instinct MI300X", tells JAX 0.11+ nothing it can lower for).
        device_kinds={"sm_90": "NVIDIA H100", "sm_80": "NVIDIA A100", "sm_100": "NVIDIA B200",
                      "gfx942": "gfx942", "gfx90a": "gfx90a", "gfx950": "gfx950"},
        chips=roofline_chips(),
        # A block is a window on HBM: the bytes are the body's loads and stores (pl.report).
        block_traffic="loads",
    )


@hookimpl
def pallas_primitives() -> Any:
    return primitives.SEMANTICS


@hookimpl
def pallas_validate(call: KernelCall) -> None:
    validation.check(call)


@hookimpl
def pallas_lower(request: LoweringRequest) -> Any:
    call = request.call
    module, name = lowering.lower_kernel(call, request.platform)
    params = params_of(call)
    parallel, _ = lowering.grid_axes(call)
    programs = math.prod(call.grid_mapping.grid[a] for a in parallel)
    num_stages = params.num_stages or triton_compile.default_num_stages(request.platform)
    config = {
        "name": name, "ir": lowering.module_bytecode(module),
        "num_stages": num_stages, "num_warps": params.num_warps,
        "grid_x": programs, "grid_y": 1, "grid_z": 1,
        "debug": params.debug,
    }
    return plb.emit_custom_call(
        request.ctx, CUSTOM_CALL_TARGET, request.operands, call.out_avals,
        backend_config=config,
        operand_output_aliases=dict(call.input_output_aliases) or None)


def _ttir(call: KernelCall, target: str | None) -> tuple[str, str]:
    """``call`` lowered for ``target``'s platform: its TTIR text and its function's name."""
    gpu = triton_compile.parse_target(target)  # an unknown target fails before lowering
    module, name = lowering.lower_kernel(call, gpu.platform)
    return lowering.module_text(module), name


@hookimpl
def pallas_stages(call: KernelCall, target: str | None) -> Mapping[str, Any]:
    ttir, name = _ttir(call, target)
    params = params_of(call)
    compiled = triton_compile.compile_stages(ttir, target, params.num_warps, params.num_stages,
                                             kernel=name)
    return {"ttir": ttir, **{k: v for k, v in compiled.items() if k != "ttir"}}


@hookimpl
def pallas_footprint(call: KernelCall, chip: plb.Chip | None) -> Any:
    """Shared memory as Triton allocates it for ``chip``'s target (its ``shared`` metadata
    after the ``llir`` stage, the number ``pl.stages`` refuses beyond) and that target's
    per-block limit; ``None`` (not reported) without the ``triton`` package, which alone
    knows the allocation."""
    if not triton_compile.available():
        return None
    target = triton_compile.target_of_chip(chip.name if chip is not None else None)
    ttir, _ = _ttir(call, target)
    params = params_of(call)
    shared = triton_compile.shared_memory(ttir, target, params.num_warps, params.num_stages)
    limit = triton_compile.parse_target(target).shared_memory
    return [("shared memory (Triton's allocation)", shared)], limit


@hookimpl
def pallas_emulate(call: EmulatedCall) -> list[Any] | None:
    """Runs XLA's Triton custom call (ours and ``jax.experimental.pallas``'s) with numpy."""
    if call.target != CUSTOM_CALL_TARGET:
        return None
    if call.options.target is not None:  # a target pl.stages would refuse is refused here too
        triton_compile.parse_target(call.options.target)
    return emulator.emulate(call)
