"""Hook implementations of the SparseCore backend (entry point ``sparsecore``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu import plugin as tpu_plugin
from pallas_mosaic_tpu.params import DMA_SEMAPHORE, HBM, SEMAPHORE, SMEM, VMEM

from pallas_core import ANY
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
from pallas_sparsecore import lowering, primitives, shared, validation
from pallas_sparsecore.params import CHIPS, NAME, VMEM_SHARED, SCCompilerParams

__version__ = "0.1.0"


def backend_config(call: KernelCall, body: bytes, has_communication: bool = False) -> str:
    """The JSON configuration of the ``tpu_custom_call`` for a SparseCore kernel: the
    TensorCore's ``custom_call_config`` (``has_communication`` where the kernel talks to other
    devices), then the SparseCore's keys."""
    params = lowering.params_of(call)
    config = tpu_plugin.custom_call_config(call, body, has_communication,
                                           needs_layout_passes=params.needs_layout_passes)
    if params.collective_id is not None:  # after the body and has_communication, as JAX
        head: dict[str, Any] = {k: config.pop(k) for k in ("body", "has_communication")
                                if k in config}
        config = {**head, "collective_id": params.collective_id, **config}
    full: dict[str, Any] = {"custom_call_config": config}
    tiling = "TILING_SPARSE_CORE" if params.use_tc_tiling_on_sc is False else "TILING_COMPACT"
    full["sparse_core_config"] = {"tiling": tiling}
    full["device_type"] = "DEVICE_TYPE_SPARSECORE"
    if call.grid_mapping.grid[0] == 1:
        full["megachip_parallelism_config"] = {"cores": ["0"]}
    return json.dumps(full)


def lowering_rules() -> RuleTable:
    """This backend's full lowering-rule table (primitive -> rule), read-only; every rule has
    the signature all backends share (``pallas_core.backend.Rule``)."""
    return lowering.lowering_rules()


@hookimpl
def pallas_describe() -> BackendInfo:
    return BackendInfo(name=NAME, version=__version__, platforms=("tpu",),
                       compiler_params_type=SCCompilerParams, default_for=(),
                       package="pallas-sparsecore", capabilities=frozenset())


@hookimpl
def pallas_memory_spaces() -> Any:
    return (VMEM, VMEM_SHARED, ANY, HBM, SMEM, SEMAPHORE, DMA_SEMAPHORE)


@hookimpl
def pallas_primitives() -> Any:
    return primitives.SEMANTICS + shared.SEMANTICS


@hookimpl
def pallas_validate(call: KernelCall) -> None:
    """Checks a SparseCore kernel against its chip before lowering (its VMEM too)."""
    validation.check(call)
    validation.check_vmem(call)


@hookimpl
def pallas_footprint(call: KernelCall) -> Any:
    """One vector subcore's VMEM as the lowering declares it (``validation.vmem_parts``) and
    its capacity on the kernel's chip, the limit the lowering refuses beyond; not reported
    for scalar-subcore kernels. This backend lists no chips of its own (the TPU datasheets
    describe the TensorCore), so the limit is always the kernel's own target's."""
    parts = validation.vmem_parts(call)
    return None if parts is None else (parts, validation.vmem_limit(call))


@hookimpl
def pallas_validate_call(call: KernelCall, backend: str) -> None:
    """Checks a kernel given ``plsc.CompilerParams`` that another backend runs (the interpreter,
    under ``interpret=True``) against its chip too, as JAX does."""
    if backend != NAME and isinstance(call.compiler_params, SCCompilerParams):
        validation.check(call)


@hookimpl
def pallas_lower(request: LoweringRequest) -> Any:
    module, name = lowering.lower_kernel(request.call, plb.manual_axes(request.ctx))
    config = backend_config(request.call, mir.serialize(module), mir.has_communication(module))
    return tpu_plugin.emit_tpu_custom_call(request, config, name)


@hookimpl
def pallas_stages(call: KernelCall, target: str | None) -> Mapping[str, Any]:
    _check_target("pl.stages", target)
    module, _ = lowering.lower_kernel(call)
    return {"mosaic": lowering.tl.module_text(module)}


@hookimpl
def pallas_emulate(call: EmulatedCall) -> Any:
    from pallas_sparsecore import emulator  # numpy machinery, loaded on first use

    if call.options.backend == "sparsecore":
        _check_target("pl.emulate", call.options.target)
    return emulator.emulate(call)


def _check_target(api: str, target: str | None) -> None:
    """Refuses a target that is not a chip with SparseCores (as ``pl.stages`` and
    ``pl.emulate`` both do)."""
    if target is not None and target not in CHIPS:
        raise PallasError(
            f"{api}(backend='sparsecore', target={target!r}): unknown chip. Fix: use one "
            f"of {sorted(CHIPS)}.")
