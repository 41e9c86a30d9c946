"""Hook implementations of the ``xla_unrolled`` backend (entry point ``xla_unrolled``).

The core calls these hooks only for calls it has resolved to ``xla_unrolled``. ``LOWER_CALLS``
counts the kernels this plugin lowered, so that a test can prove the backend was used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from pallas_core import backend as plb
from pallas_xla_unrolled import unrolled

NAME = "xla_unrolled"
__version__ = "0.1.0"

LOWER_CALLS = 0
"""How many kernels ``pallas_lower`` has lowered for this backend in this process."""

Cap = plb.Capability
CAPABILITIES = frozenset(
    {Cap.ALIASING, Cap.ASYNC_COPY, Cap.DEBUG_PRINT, Cap.MASKED_ACCESS, Cap.MESH, Cap.RUN_SCOPED,
     Cap.SCRATCH, Cap.SEMAPHORES, Cap.VMAP})
"""What this backend runs; atomics and scalar prefetch are missing on purpose (they raise
``UnsupportedError``)."""


@dataclasses.dataclass(frozen=True)
class XlaUnrolledParams(plb.CompilerParams):
    """Compiler parameters of ``xla_unrolled``; passing them as ``compiler_params=`` selects it.

    ``max_steps``: the largest grid, in steps (vmap's batch axes included), that the backend
    unrolls. Each step is a copy of the kernel in the XLA program, so big grids compile slowly.
    """

    BACKEND: ClassVar[str] = NAME
    max_steps: int = 64

    def __post_init__(self) -> None:
        steps = self.max_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise plb.PallasError(
                f"XlaUnrolledParams(max_steps={steps!r}): expected a positive int, found "
                f"{type(steps).__name__} {steps!r}. Fix: pass e.g. max_steps=128."
            )


# --- a primitive of this plugin, with its reference semantics -------------------------------

step_index_p = plb.Primitive("xla_unrolled_step_index")
step_index_p.def_abstract_eval(lambda: plb.ShapedArray((), jnp.int32))


def step_index() -> jax.Array:
    """The number of grid steps that run before the current one (row-major order), as int32.

    On ``xla_unrolled`` it is a constant of each unrolled step; the interpreter runs it through
    the reference semantics this plugin registers, without importing this package.
    """
    return step_index_p.bind()  # type: ignore[no-any-return]


def _step_index_semantics(ctx: plb.ReferenceContext) -> Any:
    index: Any = 0
    for axis, size in enumerate(ctx.grid[ctx.num_batch_axes:]):
        index = index * size + ctx.program_id(axis)
    return jnp.asarray(index, jnp.int32)


# --- what the backend can run ---------------------------------------------------------------

_ATOMICS = frozenset({plb.atomic_rmw_p, plb.atomic_cas_p})


def check(call: plb.KernelCall) -> None:
    """Raises ``UnsupportedError`` for what this backend cannot run: atomics, huge grids, and
    index maps that read scalar-prefetch operands (blocks are cut at offsets fixed at trace
    time)."""
    params = call.compiler_params
    if not isinstance(params, XlaUnrolledParams):
        params = XlaUnrolledParams()
    grid, steps = call.grid_mapping.grid, call.grid_mapping.num_steps
    if steps > params.max_steps:
        raise plb.unsupported(
            f"kernel {call.name!r} ({call.source}) has grid {grid} = {steps} steps, more than "
            f"max_steps={params.max_steps}; unrolling it", NAME,
            "Fix: use bigger blocks (a smaller grid), raise the limit with compiler_params="
            f"pallas_xla_unrolled.CompilerParams(max_steps={steps}), or pass "
            "backend='interpret'.",
        )
    if call.grid_mapping.num_scalar_prefetch:
        raise plb.unsupported(
            f"scalar prefetch (kernel {call.name!r}, {call.source})", NAME,
            "Fix: pass the indices as an ordinary input and index inside the kernel, or pass "
            "backend='interpret'.")
    eqn = plb.find_eqn(call.jaxpr.jaxpr, _ATOMICS)
    if eqn is not None:
        raise plb.unsupported(
            f"{eqn.primitive.name} (pl.atomic_* in kernel {call.name!r}, {call.source})",
            NAME,
            "Fix: accumulate into an output block that the grid revisits (o_ref[...] += x), "
            "or pass backend='interpret'.",
        )


# --- hooks ----------------------------------------------------------------------------------


@plb.hookimpl
def pallas_describe() -> plb.BackendInfo:
    """Names the backend: it lowers for every platform XLA runs on, never by default."""
    return plb.BackendInfo(
        name=NAME,
        version=__version__,
        platforms=("cpu", "cuda", "rocm", "tpu"),
        compiler_params_type=XlaUnrolledParams,
        capabilities=CAPABILITIES,
        package="pallas-xla-unrolled",
    )


@plb.hookimpl
def pallas_validate(call: plb.KernelCall) -> None:
    """Rejects atomics, scalar prefetch and grids over ``max_steps`` before lowering."""
    check(call)


@plb.hookimpl
def pallas_lower(request: plb.LoweringRequest) -> Sequence[Any]:
    """Inlines the unrolled kernel into the program being lowered."""
    global LOWER_CALLS
    check(request.call)  # again: vmap adds grid steps after validation
    LOWER_CALLS += 1
    call, rules = request.call, plb.semantics_rules()
    return request.lower_jax(lambda *args: unrolled.run(call, args, rules))


@plb.hookimpl
def pallas_primitives() -> Sequence[plb.PrimitiveSemantics]:
    """``step_index`` and its reference semantics, for every backend that interprets."""
    return (plb.PrimitiveSemantics(step_index_p, evaluate=_step_index_semantics),)


@plb.hookimpl
def pallas_stages(call: plb.KernelCall, target: str | None) -> Mapping[str, Any]:
    """One stage, ``unrolled_jaxpr``: the kernel with its grid unrolled, as plain JAX."""
    avals = [jax.ShapeDtypeStruct(bm.array_shape, bm.dtype) for bm in call.grid_mapping.inputs]
    rules = plb.semantics_rules()
    return {"unrolled_jaxpr": str(jax.make_jaxpr(lambda *a: unrolled.run(call, a, rules))(*avals))}
