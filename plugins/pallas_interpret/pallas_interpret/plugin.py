"""Hook implementations of the interpreter backend (entry point ``interpret``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax

from pallas_core import _jax, reference
from pallas_core.hookspecs import hookimpl
from pallas_core.plugins import BackendInfo
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.spec import CompilerParams
from pallas_interpret import grid

NAME = "interpret"
__version__ = "0.1.0"


@dataclasses.dataclass(frozen=True)
class InterpretParams(CompilerParams):
    """Compiler parameters of the interpreter; passing them selects it.

    ``checked``: poison uninitialised memory (NaN for floats, the minimum for integers) so
    reads of it show.
    """

    BACKEND: ClassVar[str] = NAME
    checked: bool = False




def _checked(call: KernelCall) -> bool:
    params = call.compiler_params
    return bool(isinstance(params, InterpretParams) and params.checked)


@hookimpl
def pallas_describe() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        version=__version__,
        platforms=("cpu", "cuda", "rocm", "tpu"),
        compiler_params_type=InterpretParams,
        default_for=("cpu",),
        capabilities=frozenset({"atomics", "masked_access", "debug_print", "scratch",
                                "run_scoped", "mesh", "aliasing", "vmap",
                                "foreign_memory_spaces"}),
        package="pallas-interpret",
    )


@hookimpl
def pallas_lower(request: LoweringRequest) -> Any:
    if request.backend != NAME:
        return None
    call, rules, checked = request.call, reference.semantics_rules(), _checked(request.call)
    return request.lower_jax(lambda *args: grid.run(call, args, rules, checked))


@hookimpl
def pallas_stages(call: KernelCall, backend: str, target: str | None) -> Mapping[str, Any] | None:
    if backend != NAME:
        return None
    rules = reference.semantics_rules()
    avals = [jax.ShapeDtypeStruct(bm.array_shape, bm.dtype) for bm in call.grid_mapping.inputs]
    lowered = grid.run_jitted(call, rules).trace(*avals).lower(lowering_platforms=("cpu",))
    return {
        "discharged_jaxpr": str(_jax.discharge_state(
            call.jaxpr, axis_sizes=call.grid_mapping.axis_env)),
        "stablehlo": lowered.as_text(),
    }
