"""Hook implementations of the interpreter backend (entry point ``interpret``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pallas_core import backend as plb
from pallas_core.backend import BackendInfo, KernelCall, LoweringRequest, hookimpl
from pallas_core.backend import Capability as Cap
from pallas_interpret import grid
from pallas_interpret.params import NAME, InterpretParams, from_interpret_arg

__version__ = "0.1.0"


def _params(call: KernelCall) -> InterpretParams:
    """The interpreter's params: ``compiler_params=``, else ``interpret=`` (ours, or JAX-style
    interpret params translated), else the defaults."""
    if isinstance(call.compiler_params, InterpretParams):
        return call.compiler_params
    return from_interpret_arg(call.interpret)


@hookimpl
def pallas_describe() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        version=__version__,
        platforms=("cpu", "cuda", "rocm", "tpu"),
        compiler_params_type=InterpretParams,
        default_for=("cpu",),
        capabilities=frozenset({
            Cap.ATOMICS, Cap.MASKED_ACCESS, Cap.DEBUG_PRINT, Cap.SCRATCH, Cap.RUN_SCOPED,
            Cap.MESH, Cap.ALIASING, Cap.VMAP, Cap.FOREIGN_MEMORY_SPACES, Cap.SCALAR_PREFETCH,
            Cap.SEMAPHORES, Cap.ASYNC_COPY, Cap.REMOTE_COPY, Cap.CHECKED_MODE, Cap.DYNAMIC_GRID,
            Cap.SYMBOLIC_BLOCKS, Cap.ELEMENT_BLOCKS, Cap.BOUNDED_SLICE_BLOCKS,
            Cap.PIPELINE_MODE}),
        package="pallas-interpret",
    )


@hookimpl
def pallas_lower(request: LoweringRequest) -> Any:
    call, rules, params = request.call, plb.semantics_rules(), _params(request.call)
    with plb.uninitialized_memory(params.fill):
        return request.lower_jax(lambda *args: grid.run(call, args, rules, params))


@hookimpl
def pallas_stages(call: KernelCall, target: str | None) -> Mapping[str, Any]:
    rules = plb.semantics_rules()
    gm = call.grid_mapping
    avals = [jax.ShapeDtypeStruct(bm.array_shape, bm.dtype) for bm in gm.inputs]
    avals += [jax.ShapeDtypeStruct((), jnp.int32)] * gm.num_dynamic_grid_bounds
    lowered = grid.run_jitted(call, rules).trace(*avals).lower(lowering_platforms=("cpu",))
    return {
        "discharged_jaxpr": str(plb.discharge_state(
            call.jaxpr, axis_sizes=call.grid_mapping.axis_env)),
        "stablehlo": lowered.as_text(),
    }
