"""Lowering to MLIR: registering lowering rules, inlining plain JAX (``lower_fun``), emitting a
``stablehlo.custom_call``, the platforms and ``shard_map`` axes a lowering runs under, and
the contexts that take JAX back to its top level (no mesh, no trace)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jax._src import config as _config
from jax._src import core, dispatch, effects
from jax._src.interpreters import mlir

from pallas_core._jax.base import Primitive

register_lowering = mlir.register_lowering


def lower_fun(fun: Callable[..., Any], multiple_results: bool = True) -> Callable[..., Any]:
    """A lowering rule that inlines the plain JAX function ``fun``.

    ``fun`` is traced with ``shard_map``'s varying-axes checks off: the primitive's abstract
    eval has already typed its outputs, and a kernel body mixing varying operands with
    constants would otherwise be rejected while it is inlined.
    """
    rule = mlir.lower_fun(fun, multiple_results=multiple_results)

    def lowered(ctx: Any, *args: Any, **params: Any) -> Any:
        with _config._check_vma(False), core.extend_axis_env_nd(list(manual_axes(ctx))):
            return rule(ctx, *args, **params)

    return lowered


def make_ir_context() -> Any:
    """A fresh MLIR context with every dialect JAX's lowering registers (for backends that
    build modules with JAX's own kernel libraries outside a lowering)."""
    return mlir.make_ir_context()


def emit_custom_call(ctx: Any, target: str, operands: Sequence[Any], out_avals: Sequence[Any], *,
                     backend_config: dict[str, Any] | str | bytes, api_version: int = 4,
                     operand_output_aliases: dict[int, int] | None = None,
                     extra_attributes: dict[str, Any] | None = None,
                     has_side_effect: bool = False,
                     frontend_attributes: dict[str, str] | None = None) -> list[Any]:
    """Emits a row-major ``stablehlo.custom_call`` into the program being lowered.

    A dict ``backend_config`` maps names to Python values (``str``, ``bytes``, ``bool``,
    ``int``) and becomes the ``mhlo.backend_config`` dictionary (``api_version=4``); a string
    or bytes is passed as it is (``api_version=1``). ``extra_attributes`` (Python values too)
    are set on the call; ``frontend_attributes`` (strings) become its
    ``mhlo.frontend_attributes``.
    """
    def attr(v: Any) -> Any:
        if isinstance(v, bool):
            return mlir.ir.BoolAttr.get(v)
        if isinstance(v, int):
            return mlir.ir.IntegerAttr.get(mlir.ir.IntegerType.get_signless(32), v)
        return mlir.ir.StringAttr.get(v)

    in_ranks = [len(mlir.ir.RankedTensorType(o.type).shape) for o in operands]
    config = ({k: attr(v) for k, v in backend_config.items()}
              if isinstance(backend_config, dict) else backend_config)
    dynamic = mlir.ir.ShapedType.get_dynamic_size()
    # A symbolic dimension (jax.export with shape polymorphism) is dynamic in the program,
    # and the call is told each result's shape as computed from the dimension variables.
    symbolic = not all(core.is_constant_shape(a.shape) for a in out_avals)
    call = mlir.custom_call(
        target,
        result_types=[mlir.ir.RankedTensorType.get(
            [d if core.is_constant_dim(d) else dynamic for d in a.shape],
            mlir.dtype_to_ir_type(a.dtype)) for a in out_avals],
        result_shapes=([mlir.eval_dynamic_shape_as_tensor(ctx, a.shape) for a in out_avals]
                       if symbolic else None),
        operands=list(operands),
        backend_config=config,
        api_version=api_version,
        has_side_effect=has_side_effect,
        extra_attributes={k: attr(v) for k, v in (extra_attributes or {}).items()},
        operand_output_aliases=operand_output_aliases,
        operand_layouts=[list(reversed(range(r))) for r in in_ranks],
        result_layouts=[list(reversed(range(len(a.shape)))) for a in out_avals],
    )
    if frontend_attributes:
        call.attributes["mhlo.frontend_attributes"] = mlir.ir.DictAttr.get(
            {k: mlir.ir.StringAttr.get(v) for k, v in frontend_attributes.items()})
    return list(call.results)


def manual_axes(ctx: Any) -> tuple[tuple[str, int], ...]:
    """``(name, size)`` of the mesh axes a lowering runs under ``shard_map`` over (else empty).

    Collectives over them (``lax.all_gather``, ``lax.axis_index``) work inside ``lower_fun``.
    """
    axis_context = ctx.module_context.axis_context
    manual = getattr(axis_context, "manual_axes", None)
    mesh = getattr(axis_context, "mesh", None)
    if not manual or mesh is None:
        return ()
    return tuple((n, int(mesh.shape[n])) for n in mesh.axis_names if n in manual)


@contextlib.contextmanager
def shard_map_device_mesh(ctx: Any) -> Iterator[None]:
    """Within the block the device mesh of the ``shard_map`` a lowering runs under (its
    ``ctx``) is the current concrete mesh, for libraries that read it while they build a
    kernel (Mosaic GPU sizes its cross-device metadata by it); nothing changes elsewhere."""
    from jax._src import mesh as mesh_lib

    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if not isinstance(mesh, mesh_lib.Mesh) or not manual_axes(ctx):
        yield
        return
    devices = getattr(_config, "device_context", None) or mesh_lib.device_context  # type: ignore[attr-defined]
    prev = devices.swap_local(mesh)
    try:
        yield
    finally:
        devices.set_local(prev)


@contextlib.contextmanager
def no_mesh() -> Iterator[None]:
    """Within the block no mesh is current, neither a device mesh nor an abstract one, so
    values computed eagerly there (constants folded while a kernel is evaluated) live on one
    device even while a ``shard_map`` is being lowered, whose mesh is current otherwise."""
    from jax._src import mesh as mesh_lib

    # JAX 0.10 keeps these settings in its config module, 0.11 in its mesh module.
    devices = getattr(_config, "device_context", None) or mesh_lib.device_context  # type: ignore[attr-defined]
    abstract = (getattr(_config, "abstract_mesh_context_manager", None)
                or mesh_lib.abstract_mesh_context_manager)  # type: ignore[attr-defined]
    prev_devices = devices.swap_local(mesh_lib.empty_concrete_mesh)
    prev_abstract = abstract.swap_local(mesh_lib.empty_abstract_mesh)
    try:
        yield
    finally:
        abstract.set_local(prev_abstract)
        devices.set_local(prev_devices)


@contextlib.contextmanager
def top_level() -> Iterator[None]:
    """Within the block JAX is at its top level: no trace, no named axes, no mesh (to trace
    and lower a function of its own while a ``shard_map`` body is being traced)."""
    prev = core.trace_ctx.axis_env
    core.trace_ctx.set_axis_env(core.top_axis_env)
    try:
        with core.eval_context(), no_mesh():
            yield
    finally:
        core.trace_ctx.set_axis_env(prev)


def register_side_effect(effect_type: type) -> None:
    """Lets equations carrying an (unordered) effect of ``effect_type`` be lowered, and appear
    in loops, conditionals, custom derivatives and remat; such equations are never removed as
    dead code."""
    for allowed in (effects.lowerable_effects, effects.control_flow_allowed_effects,
                    effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects):
        allowed.add_type(effect_type)


def effect_primitive(name: str, effect: Any) -> Primitive:
    """A primitive without results whose every equation carries ``effect`` (its type registered
    with :func:`register_side_effect`), so that it is never removed as dead code: a wait, a
    barrier, a print, a check."""
    register_side_effect(type(effect))
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_effectful_abstract_eval(lambda *args, **params: ([], {effect}))
    return prim


def def_eager_impl(prim: Primitive) -> None:
    """Eager (outside ``jit``) application compiles the primitive alone."""
    prim.def_impl(lambda *args, **params: dispatch.apply_primitive(prim, *args, **params))


def lowering_platforms(ctx: Any) -> tuple[str, ...]:
    """The platforms a lowering rule is lowering for (``cpu``, ``cuda``, ``tpu``, ...)."""
    platforms = ctx.platforms if ctx.platforms is not None else ctx.module_context.platforms
    return tuple(platforms)
