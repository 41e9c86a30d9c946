"""The one place where pallas_core touches JAX internals (``jax._src``).

Everything the core and its plugins need from JAX that is not public API is
re-exported from here, so that a JAX upgrade is a change in this file alone. Plugins never
import this module: the names they need are re-exported by the public plugin API,
:mod:`pallas_core.backend`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import ad_util, api_util, core, dispatch, effects, source_info_util
from jax._src import callback as _jax_callback
from jax._src import config as _config
from jax._src import linear_util as lu
from jax._src.custom_derivatives import custom_jvp_call_p, custom_vjp_call_p
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as _lax_internal
from jax._src.lax.control_flow.conditionals import cond_p
from jax._src.lax.control_flow.loops import scan_p, while_p
from jax._src.lax.parallel import axis_index_p
from jax._src.pjit import jit_p, reshard_p
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types

from pallas_core import errors

__all__ = [
    "AbstractRef",
    "ClosedJaxpr",
    "Jaxpr",
    "Literal",
    "NDIndexer",
    "Primitive",
    "ShapedArray",
    "Slice",
]

# Frames inside pallas_core are internal, like JAX's own: source lines attached to a kernel's
# equations (and filtered tracebacks) point at the user's code.
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))

# A PallasError raised in a host callback (checked mode's reports, the emulators) is raised
# again by pallas' entry points; JAX's log of it, with the callback's traceback, is left out.
logging.getLogger(_jax_callback.__name__).addFilter(errors.unlogged_reports)


# --- versions ---------------------------------------------------------------------------
JAX_VERSION: tuple[int, int, int] = tuple(  # type: ignore[assignment]
    (int(p) if p.isdigit() else 0) for p in [*jax.__version__.split("."), "0", "0"][:3])
"""The installed JAX's (major, minor, patch)."""
NEWEST_TESTED_JAX = (0, 12)
"""The newest JAX minor release this version of pallas is tested with; a newer one works
through the same adapters, or fails here first, with a warning at import saying so."""


def warn_if_untested_jax() -> None:
    """A warning when the installed JAX is newer than any this release was tested with (the
    distributions put no upper bound on ``jax``, so that pip never downgrades a user's JAX)."""
    if JAX_VERSION[:2] > NEWEST_TESTED_JAX:
        import warnings

        warnings.warn(
            f"pallas_core is tested with JAX up to {NEWEST_TESTED_JAX[0]}.{NEWEST_TESTED_JAX[1]}"
            f".x, and JAX {jax.__version__} is installed. Kernels may fail in ways a tested JAX "
            "would not. Fix: upgrade pallas-core, or install a tested JAX "
            f"(pip install 'jax<={NEWEST_TESTED_JAX[0]}.{NEWEST_TESTED_JAX[1]}.*').",
            RuntimeWarning, stacklevel=3)


# --- core types -------------------------------------------------------------------------
Primitive = core.Primitive
Jaxpr = core.Jaxpr
if TYPE_CHECKING:
    # JAX 0.10/0.11's ``core.ClosedJaxpr``, a jaxpr with its constants; JAX 0.12 merged it into
    # ``core.Jaxpr`` (a ``Jaxpr`` with its constants attached). Untyped: the two differ.
    ClosedJaxpr = Any
else:
    ClosedJaxpr = getattr(core, "ClosedJaxpr", core.Jaxpr)
_CLOSED_JAXPR: type[Any] = getattr(core, "ClosedJaxpr", core.Jaxpr)
Literal = core.Literal
ShapedArray = core.ShapedArray
Effect = effects.Effect
typeof = core.typeof
Tracer = core.Tracer
eval_jaxpr = core.eval_jaxpr
is_dim = core.is_dim
pallas_enable_debug_checks = _config.jax_pallas_enable_debug_checks
"""JAX's ``jax_pallas_enable_debug_checks`` flag: a context manager, ``.value`` reads it."""
pallas_poison_buffers = _config.jax_pallas_poison_buffers
"""JAX's ``jax_pallas_poison_buffers`` flag: a context manager, ``.value`` reads it."""
"""A static size: a Python/NumPy int, a concrete integer, or a symbolic dimension."""
eval_context = core.eval_context


def is_symbolic_dim(d: Any) -> bool:
    """``d`` is a symbolic dimension (``jax.export`` with shape polymorphism), not an int."""
    return core.is_dim(d) and not core.is_constant_dim(d)


def is_static_shape(shape: Sequence[Any]) -> bool:
    """Every dimension of ``shape`` is an int (none symbolic)."""
    return core.is_constant_shape(shape)


def _dim_as_value_p() -> Any:
    from jax._src.export import shape_poly

    return shape_poly.dim_as_value_p


dim_as_value_p = _dim_as_value_p()
"""A symbolic dimension's value as an int32 scalar (``dim`` parameter: the dimension)."""


def call_exported_primitive() -> Any:
    """The primitive a call of a ``jax.export.Exported`` binds (``exported`` parameter)."""
    from jax._src.export import _export

    return _export.call_exported_p


def dimension_variables(avals: Sequence[Any]) -> tuple[str, ...]:
    """The names of the dimension variables in the shapes of ``avals``, sorted (as JAX's
    export orders them)."""
    from jax._src.export import shape_poly

    return tuple(shape_poly.all_dim_vars(list(avals)))


def dimension_program(dim: Any, names: Sequence[str], values: Sequence[int]) -> str:
    """The StableHLO module (text) computing the symbolic dimension ``dim`` from the values
    of the dimension variables ``names`` (int32 scalars, in order): ``evaluate_shape``
    exported for this machine's platform, as JAX's dynamic-shape export writes it into a
    Mosaic module. ``values`` are example values (they fix only the arguments' types)."""
    evaluate = jax.jit(core.evaluate_shape, static_argnames=("shape", "dim_vars"),
                       keep_unused=True)
    exported = jax.export.export(evaluate, platforms=[jax.devices()[0].platform])(
        (dim,), tuple(names), *values)
    return str(exported.mlir_module())


def export_dynamic_shapes(on: bool) -> Any:
    """JAX's ``pallas_export_experimental`` switch (the ``pallas_dynamic_shapes_export``
    flag), as a context manager."""
    from jax._src.pallas import core as pallas_core_jax

    return pallas_core_jax.pallas_export_experimental(on)


def dynamic_shapes_export_enabled() -> bool:
    """Whether kernels are being exported with symbolic shapes (JAX's flag is on)."""
    from jax._src.pallas import core as pallas_core_jax

    return bool(pallas_core_jax.dynamic_shapes_export_enabled())
"""Evaluates eagerly, outside whatever trace (jit, shard_map, ...) is current."""

# --- refs and indexing ------------------------------------------------------------------
AbstractRef = state_types.AbstractRef
ReadEffect = state_types.ReadEffect
WriteEffect = state_types.WriteEffect


internal_mutable_array_effect = core.internal_mutable_array_effect


def is_ref_effect(effect: Any) -> bool:
    """Whether ``effect`` is a read, write or accumulation of a Ref (not an outside effect)."""
    return isinstance(effect, state_types.RefEffect)

NDIndexer: type[Any] = state_indexing.NDIndexer  # abstract in JAX 0.12's annotations
BitcastTransform = state_types.BitcastTransform
"""``ref.bitcast(dtype)``: a view of a Ref's bits as another dtype."""
ReshapeTransform = state_types.ReshapeTransform
"""``ref.reshape(*shape)``: a view of a Ref in another shape."""
Slice = state_indexing.Slice
ds = state_indexing.ds
get_p = state_primitives.get_p
swap_p = state_primitives.swap_p
addupdate_p = state_primitives.addupdate_p
"""``ref[idx] += value`` (what a Ref's ``+=`` becomes)."""
broadcast_to_p = state_primitives.broadcast_to_p
"""JAX's equal-rank broadcast, which indexing a Ref with several index arrays binds."""
get_ref_and_transforms = state_primitives.get_ref_and_transforms
_UNVALIDATED = threading.Lock()


def get_ref_and_transforms_past_the_end(ref: Any, idx: Any, fn: str) -> tuple[Any, Any]:
    """:func:`get_ref_and_transforms` for a masked access, whose static slices may run past the
    Ref's end (the mask keeps the lanes past it from being touched, as Triton's masked loads
    and JAX's Triton kernels rely on). JAX checks static slices when it builds the indexer
    (JAX 0.10 skipped a start of 0; 0.11 on check it too): here the check is skipped."""
    try:
        return get_ref_and_transforms(ref, idx, fn)  # type: ignore[no-any-return]
    except ValueError as e:
        if not out_of_bound_slice(e):
            raise
        refused = e
    indexer = state_indexing.NDIndexer
    checked = indexer.__post_init__

    def unchecked(self: Any) -> None:
        object.__setattr__(self, "validate", False)
        checked(self)

    with _UNVALIDATED:
        indexer.__post_init__ = unchecked  # type: ignore[method-assign]
        try:
            found, transforms = get_ref_and_transforms(ref, idx, fn)
        finally:
            indexer.__post_init__ = checked  # type: ignore[method-assign]
    last = transforms[-1] if transforms else None
    if isinstance(last, indexer):  # a start past the end is refused still
        for i, size in zip(last.indices, last.shape):
            start = core.to_concrete_value(i.start) if isinstance(i, Slice) else None
            if start is not None and isinstance(size, int) and start >= size:
                raise refused
    return found, transforms
transform_array = state_discharge.transform_array
transform_swap_array = state_discharge.transform_swap_array
run_state = state_discharge.run_state
run_state_p = state_discharge.run_state_p


ConcretizationTypeError = jax.errors.ConcretizationTypeError
"""A traced value used where Python needs a concrete one (``if``, ``bool``, ``int``)."""


def out_of_bound_slice(error: BaseException) -> bool:
    """Whether ``error`` is JAX's own refusal of a static slice past a Ref's end (raised while
    the Ref is indexed)."""
    return isinstance(error, ValueError) and str(error).startswith("Out of bound slice")


@dataclasses.dataclass(frozen=True)
class StoreMismatch:
    """What JAX's refusal of a Ref store (``ref[...] = value``, ``ref[...] += value``) found:
    ``kind`` is ``"dtype"`` or ``"shape"``; ``expected`` is the Ref's (or the view's) and
    ``found`` the value's, as JAX prints them (``int32``, ``(16, 128)``), or ``None`` where
    its message does not say."""

    kind: str
    expected: str | None
    found: str | None


_STORE_REFUSED = re.compile(r"Invalid (dtype|shape) for `(?:swap|addupdate)`")
_STORE_PARTS = {
    # What JAX 0.10 to 0.12 print, first found first: the shape of the view stored into (a
    # Ref's own where there is no view); ``addupdate`` prints its value's dtype as a shape.
    "dtype": ((r"Ref dtype: ([^\s.]+)",), (r"Value (?:dtype|shape): ([^\s.]+)",)),
    "shape": ((r"Expected shape: (\([^)]*\))", r"Ref shape: (\([^)]*\))"),
              (r"Value shape: (\([^)]*\))",)),
}


def store_mismatch(error: BaseException) -> StoreMismatch | None:
    """The mismatch of dtype or shape for which JAX refused to store a value into a Ref
    while a kernel was traced, or ``None`` where ``error`` is something else."""
    if not isinstance(error, ValueError):
        return None
    text = str(error)
    refused = _STORE_REFUSED.search(text)
    if refused is None:
        return None
    kind = refused.group(1)

    def first(patterns: Sequence[str]) -> str | None:
        found = (re.search(p, text) for p in patterns)
        return next((m.group(1) for m in found if m is not None), None)

    expected, found = (first(p) for p in _STORE_PARTS[kind])
    return StoreMismatch(kind, expected, found)


def _plain_memory_space(x: Any) -> Any:
    """``x`` as a value in the default memory space when its type carries a backend's own
    memory space. JAX 0.12's ``run_state`` discharges a Ref into a value that keeps the Ref's
    memory space, and every ``lax`` primitive then refuses a memory space that is not one of
    JAX's (a Mosaic GPU ``SMEM`` operand read by a ``wgmma`` under ``pl.run_state``)."""
    aval = core.typeof(x) if isinstance(x, core.Tracer) else None
    space = getattr(aval, "memory_space", None)
    if (not isinstance(aval, core.ShapedArray) or space is None
            or isinstance(space, getattr(core, "MemorySpace", ()))):
        return x
    return state_primitives.with_memory_space_constraint(x, core.MemorySpace.Device)


def register_discharge_rule(prim: Primitive) -> Callable[[Callable[..., Any]], Any]:
    """Decorator registering ``rule(in_avals, out_avals, *args, **params)`` for ``prim``.

    The rule returns ``(new values of Ref operands or None, outputs)``. JAX 0.11 passes a
    context object in place of the two aval lists; this adapts it.
    """
    def register(rule: Callable[..., Any]) -> Any:
        if hasattr(state_discharge, "DischargeContext"):
            def adapted(ctx: Any, *args: Any, **params: Any) -> Any:
                return rule(ctx.in_avals, ctx.out_avals, *map(_plain_memory_space, args),
                            **params)
            state_discharge.register_discharge_rule(prim)(adapted)
        else:
            state_discharge.register_discharge_rule(prim)(rule)
        return rule
    return register


_JAX_SWAP_DISCHARGE = state_discharge._discharge_rules[state_primitives.swap_p]
_JAX_GET_DISCHARGE = state_discharge._discharge_rules[state_primitives.get_p]


def apply_leading_reshapes(x: Any, transforms: Sequence[Any]) -> tuple[Any, list[Any]]:
    """``(y, rest)``: ``x`` reshaped by the ``ref.reshape(...)`` transforms that lead
    ``transforms`` (a view ``ref.reshape(...).at[...]``), and the transforms after them.

    JAX 0.10's ``transform_swap_array`` cannot write back through a reshape, so a discharge
    that writes a view applies the leading reshapes here, indexes ``y`` with ``rest``, and
    reshapes the written ``y`` back to ``x.shape``."""
    rest = list(transforms)
    y = x
    while rest and isinstance(rest[0], ReshapeTransform):
        y = y.reshape(tuple(rest.pop(0).shape))
    return y, rest


def _swap_discharge(*args: Any, tree: Any) -> Any:
    """JAX's discharge of ``ref[...] = val`` (its rule, whichever its signature), also for
    views that reshape the Ref before indexing it (``ref.reshape(...).at[...]``), which JAX
    0.10's ``transform_swap_array`` indexes in the Ref's own shape: the leading reshapes are
    applied here (``apply_leading_reshapes``), and the written array reshaped back. Remote
    views are refused."""
    n = tree.num_leaves
    x, val, idx = args[-n - 2], args[-n - 1], args[len(args) - n:]
    transforms = list(jax.tree_util.tree_unflatten(tree, idx))
    _refuse_peer_views(transforms)
    if not (len(transforms) > 1 and isinstance(transforms[0], ReshapeTransform)):
        return _JAX_SWAP_DISCHARGE(*args, tree=tree)
    y, rest = apply_leading_reshapes(x, transforms)
    old, y_new = state_discharge.transform_swap_array(y, rest, val)
    return (y_new.reshape(x.shape), None) + (None,) * n, old


def _get_discharge(*args: Any, tree: Any) -> Any:
    """JAX's discharge of ``ref[...]`` (its rule), refusing remote views."""
    n = tree.num_leaves
    _refuse_peer_views(jax.tree_util.tree_unflatten(tree, args[len(args) - n:]))
    return _JAX_GET_DISCHARGE(*args, tree=tree)


state_discharge.register_discharge_rule(state_primitives.swap_p)(_swap_discharge)
state_discharge.register_discharge_rule(state_primitives.get_p)(_get_discharge)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PeerRefTransform(state_types.Transform):  # type: ignore[misc]
    """The view of a Ref as the same (symmetric) buffer on another device of the
    ``shard_map`` mesh: ``device_id`` (int32 scalars: mesh coordinates, or one logical index
    when ``mesh_coordinates`` is False). It keeps the shape and dtype; indexers applied after
    it index the peer's buffer alike."""

    device_id: tuple[Any, ...]
    mesh_coordinates: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def transform_type(self, x: Any) -> Any:
        return x

    def transform_shape(self, shape: Any) -> Any:
        return shape

    def transform_dtype(self, dtype: Any) -> Any:
        return dtype

    def undo(self, x: Any) -> Any:
        raise NotImplementedError("a peer view cannot be undone")

    def commute_ndindexer(self, _: Any, indexer: Any) -> tuple[Any, Any]:
        return indexer, self


def peer_view(ref: Any, device_id: Sequence[Any], mesh_coordinates: bool) -> Any:
    """``ref`` (a Ref or a view of one) as the same buffer on another device."""
    if isinstance(ref, state_types.TransformedRef):
        base, transforms = ref.ref, tuple(ref.transforms)
    else:
        base, transforms = ref, ()
    return state_types.TransformedRef(
        base, (*transforms, PeerRefTransform(  # type: ignore[abstract]
            tuple(device_id), mesh_coordinates)))


def _refuse_peer_views(transforms: Sequence[Any]) -> None:
    if any(isinstance(t, PeerRefTransform) for t in transforms):
        from pallas_core.errors import UnsupportedError

        raise UnsupportedError(
            "reading or writing another device's memory through a remote view "
            "(plgpu.remote_ref) is not supported by the interpreter. Fix: lower the kernel for "
            "its hardware, or exchange the data with collectives (jax.lax.all_gather under "
            "shard_map).")


# --- structured primitives the reference evaluator walks into (imported above) -----------
closed_call_p = core.closed_call_p
remat_p = _ad_checkpoint.remat_p
__all__ += ["axis_index_p", "closed_call_p", "cond_p", "custom_jvp_call_p", "custom_vjp_call_p",
            "jit_p", "remat_p", "reshard_p", "scan_p", "while_p"]

# --- transformations and lowering -------------------------------------------------------


def register_batching_rule(prim: Primitive, rule: Callable[..., Any]) -> None:
    """``rule(axis_data, args, dims, **params) -> (outs, out_dims)``; ``axis_data.size``."""
    batching.fancy_primitive_batchers[prim] = rule
primitive_jvps = ad.primitive_jvps
"""``rule(primals, tangents, **params) -> (primal_outs, tangent_outs)``; tangents may be
symbolic zeros (:func:`is_zero`)."""


def register_linearization(prim: Primitive, rule: Callable[..., Any]) -> None:
    """``rule(is_vjp, nonzeros, *primals, **params) -> (primal_outs, out_nonzeros, residuals,
    linearized)`` with ``linearized(residuals, *tangents) -> tangent_outs`` (``jax.linearize``,
    ``jax.vjp`` and ``jax.grad`` linearize through it). JAX 0.11 adds structured residuals
    (none here) to the result and to ``linearized``'s arguments; this adapts it."""
    if not _LINEARIZE_HAS_STRUCTURED_RESIDUALS:
        ad.primitive_linearizations[prim] = rule
        return

    def adapted(*args: Any, **params: Any) -> Any:
        outs, nonzeros, residuals, linearized = rule(*args, **params)
        return outs, nonzeros, residuals, None, (
            lambda res, _structured, *tangents: linearized(res, *tangents))

    ad.primitive_linearizations[prim] = adapted


# JAX 0.11's linearization rules return structured residuals as a fifth value.
_LINEARIZE_HAS_STRUCTURED_RESIDUALS = JAX_VERSION[:2] >= (0, 11)
primitive_transposes = ad.primitive_transposes
"""``rule(cotangents, *args, **params)``: reverse mode of a linear equation."""
register_lowering = mlir.register_lowering


def is_zero(tangent: Any) -> bool:
    """Whether ``tangent`` is a symbolic zero (an input that is not being differentiated)."""
    return type(tangent) is ad_util.Zero


def zero_tangent(aval: Any) -> Any:
    """The symbolic zero tangent of a value of type ``aval``."""
    return ad_util.Zero(aval.to_tangent_aval())


def instantiate_zero(tangent: Any) -> Any:
    """``tangent`` as an array: a symbolic zero becomes zeros of its type."""
    return ad_util.instantiate(tangent)


def tangent_aval(aval: Any) -> Any:
    """The type of a tangent of a value (or Ref) of type ``aval`` (``float0`` for integers)."""
    return aval.to_tangent_aval()


def jvp_jaxpr(closed: ClosedJaxpr, nonzeros: Sequence[bool], *,
              axis_sizes: Sequence[tuple[str, int]] = ()) -> ClosedJaxpr:
    """The forward-mode derivative of ``closed``.

    The result takes the inputs, then the tangents of the inputs marked in ``nonzeros`` (the
    others are symbolic zeros), and returns the outputs then their nonzero tangents. For a
    kernel jaxpr (Refs in, nothing out) the tangents are Refs too, written as the primal Refs
    are.
    """
    with (_config._check_vma(False), _config.mutable_array_checks(False),
          core.extend_axis_env_nd(list(axis_sizes))):
        jvp, _ = ad.jvp_jaxpr(closed, list(nonzeros), instantiate=False)
    return ClosedJaxpr(_adds_as_lax_add(jvp.jaxpr), jvp.consts)


add_any_p = ad_util.add_jaxvals_p
"""JAX's autodiff-internal sum of two tangents (``add_any``): ``lax.add`` on arrays."""


def _adds_as_lax_add(jaxpr: Jaxpr) -> Jaxpr:
    """``jaxpr`` with JAX's autodiff-internal sum of tangents (``add_any``) written as
    ``lax.add`` (the same on arrays of one type), nested jaxprs included, so that backends
    lower derivative kernels with their ordinary rules."""
    def sub(value: Any) -> Any:
        if isinstance(value, _CLOSED_JAXPR):
            return ClosedJaxpr(_adds_as_lax_add(value.jaxpr), value.consts)
        if isinstance(value, core.Jaxpr):
            return _adds_as_lax_add(value)
        if isinstance(value, tuple):
            return tuple(sub(v) for v in value)
        return value

    eqns = [eqn.replace(
        primitive=jax.lax.add_p if eqn.primitive is ad_util.add_jaxvals_p else eqn.primitive,
        params={k: sub(v) for k, v in eqn.params.items()}) for eqn in jaxpr.eqns]
    return jaxpr.replace(eqns=eqns)


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


def scan_parts(
    params: Any, operands: Sequence[Any]
) -> tuple[list[Any], list[Any], list[Any], Callable[[Sequence[Any]], tuple[list[Any], list[Any]]]]:
    """Splits a ``scan`` equation's operands into ``(consts, carry, xs)``.

    Also returns a function splitting one body evaluation's outputs into ``(carry, ys)``.
    The body jaxpr takes ``(*consts, *carry, *xs)``; the equation returns ``[*carry, *ys]``.
    JAX 0.11 describes the split with forwarding trees, JAX 0.10 with counts.
    """
    if "ft_in" in params:
        consts, carry, xs = params["ft_in"].update(list(operands)).unpack()

        def split_out(outs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
            c, ys = params["ft_out"].update(list(outs)).unpack()
            return list(c), list(ys)

        return list(consts), list(carry), list(xs), split_out
    nc, ncarry = params["num_consts"], params["num_carry"]

    def split_counts(outs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        return list(outs[:ncarry]), list(outs[ncarry:])

    return (list(operands[:nc]), list(operands[nc:nc + ncarry]), list(operands[nc + ncarry:]),
            split_counts)


def register_side_effect(effect_type: type) -> None:
    """Lets equations carrying an (unordered) effect of ``effect_type`` be lowered, and appear
    in loops, conditionals, custom derivatives and remat; such equations are never removed as
    dead code."""
    for allowed in (effects.lowerable_effects, effects.control_flow_allowed_effects,
                    effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects):
        allowed.add_type(effect_type)


def ref_type_of(ref: Any) -> Any:
    """The abstract value of a Ref or a view of one."""
    return core.typeof(ref)


def shape_after_transforms(ref_aval: Any, transforms: Sequence[Any]) -> Any:
    """The ShapedArray read from a Ref after applying ``transforms``."""
    return state_types.transform_type(transforms, ref_aval.inner_aval)


def make_ref_aval(shape: Sequence[int], dtype: Any, memory_space: Any = None) -> Any:
    """A Ref aval of the given shape and dtype."""
    return AbstractRef(core.ShapedArray(tuple(shape), dtype), memory_space=memory_space)


def register_initial_ref(cls: type, to_aval: Callable[[Any], tuple[Any, Any]]) -> None:
    """Values of ``cls`` given to ``run_state`` start a Ref of their own kind: ``to_aval(x)``
    returns the Ref's aval and its initial value (a backend's accumulator types)."""
    state_types._ref_type_aval_mappings[cls] = to_aval


def def_eager_impl(prim: Primitive) -> None:
    """Eager (outside ``jit``) application compiles the primitive alone."""
    prim.def_impl(lambda *args, **params: dispatch.apply_primitive(prim, *args, **params))


def extend_axis_env(axis_sizes: Sequence[tuple[str, int]]) -> Any:
    """A context in which the named axes ``axis_sizes`` are in scope while tracing (a backend's
    mesh that runs its body inside the kernel being traced, such as a warp mesh)."""
    return core.extend_axis_env_nd(list(axis_sizes))


def trace_to_jaxpr(
    fun: Callable[..., Any],
    in_avals: Sequence[Any],
    *,
    name: str = "kernel",
    axis_sizes: Sequence[tuple[str, int]] = (),
) -> tuple[Jaxpr, list[Any], list[Any]]:
    """Traces ``fun`` (flat args, flat list result) with abstract inputs.

    Returns ``(jaxpr, out_avals, consts)``. Named axes in ``axis_sizes`` are in scope
    during tracing so that ``lax.axis_index(name)`` works in kernel bodies.
    """
    dbg = api_util.debug_info(name, fun, tuple(in_avals), {})
    wrapped = lu.wrap_init(fun, debug_info=dbg)
    with (_config._check_vma(False), _config.mutable_array_checks(False),
          core.extend_axis_env_nd(list(axis_sizes))):
        jaxpr, out_avals, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, list(out_avals), list(consts)


def discharge_state(closed_jaxpr: ClosedJaxpr, *,
                    axis_sizes: Sequence[tuple[str, int]] = ()) -> ClosedJaxpr:
    """The pure form of a stateful closed jaxpr: Ref inputs become values, final Ref values
    are appended to the outputs.

    Discharging re-traces the jaxpr, so the named axes a kernel body uses
    (``lax.axis_index`` under ``pl.kernel``) must be given in ``axis_sizes``.
    """
    with core.extend_axis_env_nd(list(axis_sizes)):
        if _DISCHARGE_STRIPS_MEMORY_SPACE:
            # JAX 0.11 keeps a Ref's memory space on its discharged value unless told not to;
            # the values here are plain arrays (memory spaces are the backends' business).
            return state_discharge.discharge_state(  # type: ignore[call-arg]
                closed_jaxpr, strip_memory_space=True)
        return state_discharge.discharge_state(closed_jaxpr)


_DISCHARGE_STRIPS_MEMORY_SPACE = (
    "strip_memory_space" in inspect.signature(state_discharge.discharge_state).parameters)


@contextlib.contextmanager
def discharge_rules_wrapped(
    wrap: Callable[[Primitive, Callable[..., Any]], Callable[..., Any]],
    prims: Sequence[Primitive],
) -> Any:
    """Within the block, the discharge rule of each of ``prims`` is ``wrap(prim, rule)``.

    ``rule`` and the wrapped rule use the ``(in_avals, out_avals, *args, **params)`` form of
    :func:`register_discharge_rule`. Used by the interpreter's checked mode to add checks
    around JAX's own rules for reads and writes.
    """
    with _RULES_LOCK:
        saved = {p: state_discharge._discharge_rules[p] for p in prims}
        try:
            for p, original in saved.items():
                plain = _plain_rule(original)
                register_discharge_rule(p)(wrap(p, plain))
            yield
        finally:
            state_discharge._discharge_rules.update(saved)


_RULES_LOCK = threading.RLock()


def _plain_rule(rule: Callable[..., Any]) -> Callable[..., Any]:
    if not hasattr(state_discharge, "DischargeContext"):
        return rule

    def plain(in_avals: Any, out_avals: Any, *args: Any, **params: Any) -> Any:
        ctx = state_discharge.DischargeContext(in_avals, out_avals,  # type: ignore[attr-defined]
                                               [True] * len(in_avals), True)
        return rule(ctx, *args, **params)
    return plain


def input_effects_by_position(jaxpr: Jaxpr, num_inputs: int) -> set[Any]:
    """``jaxpr``'s effects as an abstract eval rule of an equation must return them.

    Effects on the first ``num_inputs`` invars (the equation's operands) are keyed by
    position; effects on later invars (Refs the equation allocates itself) are dropped.
    """
    position = {v: i for i, v in enumerate(jaxpr.invars[:num_inputs])}
    out: set[Any] = set()
    for eff in jaxpr.effects:
        if isinstance(eff, effects.JaxprInputEffect):
            if eff.input in position:
                out.add(eff.replace(position[eff.input]))
            continue
        out.add(eff)
    return out


def written_invars(jaxpr: Jaxpr) -> set[Any]:
    """The invars of ``jaxpr`` (Refs) that it writes or accumulates into, at any depth.

    From the jaxpr's effects, not its discharged form: a loop that only reads a Ref still
    carries it through, so discharge gives it a new variable although nothing changed.
    """
    return {eff.input for eff in jaxpr.effects
            if isinstance(eff, state_types.RefEffect) and not isinstance(eff, ReadEffect)}


def jaxpr_from_eqns(invars: Sequence[Any], outvars: Sequence[Any],
                    eqns: Sequence[Any]) -> ClosedJaxpr:
    """A closed jaxpr of some equations of another jaxpr: ``invars`` must hold every variable
    the equations read that none of them defines."""
    effs = pe.make_jaxpr_effects([], list(invars), list(outvars), list(eqns))
    dbg = core.DebugInfo("part of a kernel", "", tuple(f"in{i}" for i in range(len(invars))),
                         tuple(f"out{i}" for i in range(len(outvars))))
    return ClosedJaxpr(Jaxpr([], list(invars), list(outvars), list(eqns), effs, dbg), [])


def map_dims(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with every symbolic dimension ``d`` in it replaced by ``fn(d)``: in shapes
    and avals, in jaxprs (their variables' types and their equations' parameters, nested
    jaxprs and indexer trees included), in tuples, lists, dicts and dataclasses. What holds no
    symbolic dimension is returned as it is."""
    memo: dict[int, Any] = {}

    def go(v: Any) -> Any:
        if is_symbolic_dim(v):
            return fn(v)
        if v is None or isinstance(v, (bool, int, float, str, np.generic, np.ndarray,
                                       np.dtype, jax.Array)):
            return v
        key = id(v)
        if key in memo:
            return memo[key][1]
        out = _map_dims_node(v, go)
        memo[key] = (v, out)  # keeps v alive, so its id stays its own
        return out

    return go(value)


def _map_dims_node(v: Any, go: Callable[[Any], Any]) -> Any:
    if isinstance(v, core.Jaxpr):
        return _map_jaxpr_dims(v, go)
    if isinstance(v, _CLOSED_JAXPR):  # JAX 0.10/0.11 (0.12's jaxprs carry their constants)
        return _CLOSED_JAXPR(go(v.jaxpr), list(v.consts))
    if isinstance(v, state_types.AbstractRef):
        return v.update(inner_aval=go(v.inner_aval))
    if isinstance(v, core.ShapedArray):
        shape = tuple(go(d) for d in v.shape)
        return v if shape == v.shape else v.update(shape=shape)
    if isinstance(v, core.AbstractValue):
        return v
    if isinstance(v, jax.tree_util.PyTreeDef):
        leaves = [object() for _ in range(v.num_leaves)]
        tree = jax.tree_util.tree_unflatten(v, leaves)
        return jax.tree_util.tree_structure(go(tree))
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple
        return type(v)(*(go(x) for x in v))
    if isinstance(v, (tuple, list)):
        return type(v)(go(x) for x in v)
    if isinstance(v, dict):
        return {k: go(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        changes = {f.name: go(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        if all(changes[k] is getattr(v, k) for k in changes):
            return v
        return dataclasses.replace(v, **changes)
    return v


def _map_jaxpr_dims(jaxpr: Any, go: Callable[[Any], Any]) -> Any:
    renamed: dict[Any, Any] = {}

    def var(v: Any) -> Any:
        if isinstance(v, core.Literal):
            return core.Literal(v.val, go(v.aval))
        if isinstance(v, core.DropVar):
            return core.DropVar(go(v.aval))
        if v not in renamed:
            renamed[v] = core.Var(go(v.aval))
        return renamed[v]

    constvars = [var(v) for v in jaxpr.constvars]
    invars = [var(v) for v in jaxpr.invars]
    eqns = [e.replace(invars=[var(v) for v in e.invars], outvars=[var(v) for v in e.outvars],
                      params={k: go(p) for k, p in e.params.items()}) for e in jaxpr.eqns]
    attached = {"consts": list(jaxpr.consts)} if _CLOSED_JAXPR is core.Jaxpr else {}
    return jaxpr.replace(constvars=constvars, invars=invars, eqns=eqns,
                         outvars=[var(v) for v in jaxpr.outvars], **attached)


def settle_runtime_tokens() -> None:
    """Waits for the effectful computations dispatched so far and forgets them, ignoring their
    failures: after a failed callback has been reported, JAX would otherwise raise it again at
    every later ``jax.effects_barrier()`` and at exit."""
    tokens = dispatch.runtime_tokens
    for token in [*tokens.current_tokens.values(), *tokens.output_runtime_tokens.values()]:
        with contextlib.suppress(Exception):  # the failure already reached the caller
            token.block_until_ready()
    tokens.clear()


def being_staged(values: Any) -> bool:
    """Whether any leaf of ``values`` is being staged out into a jaxpr (``jit``, ``scan``, ...)
    rather than computed now (eagerly, also under eager ``vmap`` or ``shard_map``)."""
    return any(isinstance(x, pe.DynamicJaxprTracer) for x in jax.tree_util.tree_leaves(values))


def is_var(atom: Any) -> bool:
    """Whether a jaxpr atom is a variable (neither a literal nor a dropped output)."""
    return isinstance(atom, core.Var) and not isinstance(atom, core.DropVar)


def convert_constvars(jaxpr: Jaxpr) -> Jaxpr:
    """Moves a jaxpr's constvars to the front of its invars."""
    return pe.convert_constvars_jaxpr(jaxpr)



def user_context(eqn: Any) -> Any:
    """Context that attributes errors raised while evaluating ``eqn`` to its source."""
    return source_info_util.user_context(eqn.source_info.traceback)



def source_line(eqn: Any) -> str:
    """``file:line`` of the user code that produced ``eqn``, or ``'<unknown>'``."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "<unknown>"
    return f"{frame.file_name}:{frame.start_line}"


def varying_axes(aval: Any) -> frozenset[Any]:
    """Manual mesh axes along which a value varies inside ``shard_map`` (empty elsewhere)."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ())) if mat is not None else frozenset()


def with_varying_axes(aval: Any, like: Sequence[Any]) -> Any:
    """``aval`` made to vary over the manual axes that any of ``like`` varies over.

    Inside ``shard_map`` (with its checks on) a kernel's outputs vary over the mesh
    axes its inputs vary over; users need no annotation on ``out_shape`` for that.
    """
    if not _config._check_vma.value:
        return aval
    src = [a for a in like if not getattr(a, "manual_axis_type", core.empty_mat).empty]
    if not src:
        return aval
    varying = frozenset().union(*(varying_axes(a) for a in src))
    base = src[0]
    mat = core.ManualAxisType(varying=varying)
    sharding = base.sharding.update(spec=jax.sharding.PartitionSpec(*([None] * len(aval.shape))))
    return core.ShapedArray(aval.shape, aval.dtype, sharding=sharding, manual_axis_type=mat)


def mosaic_serde_version() -> int:
    """The Mosaic format version JAX writes into ``tpu_custom_call`` bodies when it cannot ask a
    TPU runtime which it reads (its forward-compatible version: 11 in JAX 0.10, 15 in 0.11)."""
    from jax._src import tpu_custom_call
    return int(getattr(tpu_custom_call, "_FWD_COMPAT_VERSION", 11))


@functools.cache
@functools.cache
def sparsecore_adds_only_into_shared_vmem() -> bool:
    """Whether JAX's own SparseCore lowering refuses an adding DMA (``add=True``) out of a
    vector subcore's VMEM into anything but ``VMEM_SHARED`` (JAX 0.12), rather than also
    lowering one into HBM (JAX 0.10). Reads the installed JAX's lowering."""
    try:
        from jax._src.pallas.mosaic import sc_lowering
    except ImportError:  # no SparseCore lowering in this JAX: nothing to follow
        return False
    return "supported when the destination is in VMEM_SHARED" in inspect.getsource(sc_lowering)


def mosaic_waits_name_both_ends() -> bool:
    """Whether JAX's own Pallas TPU lowering waits for a DMA with ``tpu.wait_dma`` (naming the
    copy's source and target, ``wait_target`` telling which side waits: JAX 0.12) rather than
    ``tpu.wait_dma2`` (one semaphore: JAX 0.10). Both ops exist in both jaxlibs; this reads
    which one the installed JAX's lowering emits."""
    from jax._src.pallas.mosaic import lowering as mosaic_lowering
    return "wait_dma2(" not in inspect.getsource(mosaic_lowering)


def jit_keyed_setting(name: str, default: Any = None) -> Any:
    """A thread-local setting that ``jax.jit`` includes in its cache key and trace context, so a
    function traced under one value is traced again under another. ``.value`` reads it;
    ``.swap_local(v)`` sets it for this thread and returns the previous value for
    ``.set_local``; ``.set_global(v)`` sets it for every thread. Values must be hashable."""
    return _config.config_ext.Config(name, default, include_in_jit_key=True,
                                     include_in_trace_context=True)


def pallas_use_mosaic_gpu() -> bool:
    """JAX's ``jax_pallas_use_mosaic_gpu`` setting: whether a ``pallas_call`` lowered for
    ``cuda`` with neither a backend nor compiler parameters goes to Mosaic GPU (``True``, the
    default of JAX 0.10, the one version that has the setting) or to Triton. JAX 0.11 and 0.12
    dropped the setting and always chooses Triton, so without it the answer is ``False``."""
    setting = getattr(_config, "jax_pallas_use_mosaic_gpu", None)
    return bool(setting.value) if setting is not None else False


def lowering_platforms(ctx: Any) -> tuple[str, ...]:
    """The platforms a lowering rule is lowering for (``cpu``, ``cuda``, ``tpu``, ...)."""
    platforms = ctx.platforms if ctx.platforms is not None else ctx.module_context.platforms
    return tuple(platforms)


@contextlib.contextmanager
def assume_device(device_kind: str, platform: str, num_cores: int = 1) -> Iterator[None]:
    """Inside, JAX believes it compiles for ``device_kind`` (e.g. ``"TPU v5 lite"``) on
    ``platform``, for lowerings that ask which chip they target when none is attached: the
    context mesh is one such device (and :func:`chip_answers` holds)."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind, num_cores, platform)
    with chip_answers(device_kind, platform, num_cores), jax.sharding.use_abstract_mesh(
            AbstractMesh((1,), ("_device",), (jax.sharding.AxisType.Auto,),
                         abstract_device=device)):
        yield


@contextlib.contextmanager
def chip_answers(device_kind: str, platform: str, num_cores: int = 1) -> Iterator[None]:
    """Inside, JAX's TPU code asking which chip it targets (``tpu_info.get_device_kind``,
    ``get_num_device_cores``) is told ``device_kind`` wherever the context mesh names no
    device of its own: also where no mesh is current (tracing on CPU) and where a jitted
    function inside a kernel is lowered under its own mesh. Meshes stay as they are, so
    ``shard_map`` and jitted code on CPU run unchanged (JAX 0.10 and 0.11 keep these
    functions in different modules)."""
    from jax._src.mesh import get_abstract_mesh

    previous = _ASSUMED_DEVICES.swap_local(
        (*[d for d in _ASSUMED_DEVICES.value if d[0] != platform],
         (platform, device_kind, num_cores)))
    patched = []
    for module_name in (("jax._src.tpu_info", "jax._src.pallas.mosaic.tpu_info")
                        if platform == "tpu" else ()):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr, value in (("get_device_kind", device_kind),
                            ("get_num_device_cores", num_cores)):
            asked = getattr(module, attr, None)
            if asked is None:
                continue

            def answer(asked: Any = asked, value: Any = value) -> Any:
                return asked() if get_abstract_mesh().abstract_device is not None else value
            patched.append((module, attr, asked))
            setattr(module, attr, answer)
    try:
        yield
    finally:
        for module, attr, asked in reversed(patched):
            setattr(module, attr, asked)
        _ASSUMED_DEVICES.set_local(previous)


_ASSUMED_DEVICES = jit_keyed_setting("pallas_assumed_devices", ())
"""``(platform, device_kind, num_cores)`` of each device :func:`chip_answers` holds; in
``jax.jit``'s cache key, so code traced for one chip is traced again for another."""


def assumed_device(platform: str) -> tuple[str, int] | None:
    """``(device_kind, num_cores)`` of the device JAX is told it compiles for on ``platform``
    (inside :func:`chip_answers` or :func:`assume_device`: ``pl.emulate``, ``pl.stages`` with a
    target, a kernel traced for a hardware backend with none attached), or ``None``."""
    for held, kind, cores in _ASSUMED_DEVICES.value:
        if held == platform:
            return kind, cores
    return None


@functools.cache
def platform_attached(platform: str) -> bool:
    """Whether a device of ``platform`` (``"tpu"``, ``"cuda"``, ...) is attached."""
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def jax_lowering_rule_names(backend: str) -> dict[str, frozenset[str]]:
    """The names of the primitives JAX's own Pallas lowering for ``backend`` has a rule for,
    per kernel type: what this project's backends are compared against. ``"mosaic_tpu"`` keys
    them by kernel type (``"tc"``, ``"sc_vector_subcore"``, ...); ``"triton"`` has one registry,
    under ``"triton"``; ``"mosaic_gpu"`` the union of its lowering semantics' registries, under
    ``"mosaic_gpu"``."""
    if backend == "mosaic_tpu":
        import jax.experimental.pallas.tpu
        from jax._src.pallas.mosaic import lowering as mosaic_lowering

        return {str(getattr(kind, "value", kind)): frozenset(p.name for p in rules)
                for kind, rules in mosaic_lowering.lowering_rules.items()}
    if backend == "mosaic_gpu":
        import jax.experimental.pallas.mosaic_gpu
        from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering

        return {"mosaic_gpu": frozenset(p.name for rules in
                                        mgpu_lowering.mosaic_lowering_rules.values()
                                        for p in rules)}
    if backend == "triton":
        import jax.experimental.pallas.triton  # noqa: F401 - registers its primitives' rules
        from jax._src.pallas.triton import lowering as triton_lowering

        return {"triton": frozenset(p.name for p in triton_lowering.triton_lowering_rules)}
    raise ValueError(f"no JAX rule registry known for {backend!r}")


def jax_mosaic_primitive(kind: str, name: str) -> Any:
    """JAX's own primitive named ``name`` that its Mosaic lowering has a rule for on kernels
    of ``kind`` (``"sc_vector_subcore"``, ...), or ``None``: for tests that compare a
    backend's module with JAX's for a primitive JAX does not export (the SparseCore's
    ``masked_cummin``)."""
    import jax.experimental.pallas.tpu
    import jax.experimental.pallas.tpu_sc  # noqa: F401 - registers the SparseCore rules
    from jax._src.pallas.mosaic import lowering as mosaic_lowering

    for k, rules in mosaic_lowering.lowering_rules.items():
        if str(getattr(k, "value", k)) == kind:
            return next((p for p in rules if p.name == name), None)
    return None


# --- explicit array layouts (jax.experimental.layout.explicit_layout) in kernels ----------
from jax._src import layout as _layout  # noqa: E402
from jax._src import pjit as _pjit_layouts  # noqa: E402

relayout_p = getattr(_pjit_layouts, "relayout_p", None)
"""The primitive ``explicit_layout`` binds to give a value a layout (JAX 0.11 on; else
``None``); its ``dst_layout`` is :data:`auto_layout` or a backend's register layout."""
auto_layout = _layout.AutoLayout
"""``dst_layout`` of a ``relayout`` that hands a value back to the compiler's choice."""
explicit_layout = getattr(_pjit_layouts, "explicit_layout", None)
"""``jax.experimental.layout.explicit_layout`` (public from JAX 0.12; JAX 0.11 has it
internally; ``None`` before)."""


def mosaic_gpu_tiled_layout(layout: Any) -> tuple[Any, Any, Any, int] | None:
    """``(tiling, warp_dims, lane_dims, vector_dim)`` of a ``relayout``'s ``dst_layout`` that
    is JAX's Mosaic GPU register layout (``GPUTiledLayout``, JAX 0.11 on), else ``None``."""
    if type(layout).__name__ != "GPUTiledLayout":
        return None
    return layout.tiling, layout.warp_dims, layout.lane_dims, int(layout.vector_dim)


def mosaic_gpu_explicit_layout(array: Any, jax_gpu_layout: Any) -> Any:
    """JAX's ``GPUTiledLayout`` of ``array`` in one of ``jax.experimental.pallas.mosaic_gpu``'s
    ``Layout`` members (what ``explicit_layout(in_layouts=...)`` takes in a Mosaic GPU kernel),
    for tests; ``None`` before JAX 0.11."""
    try:
        from jax._src.pallas.mosaic_gpu.layout_rules import GPUTiledLayout
    except ImportError:
        return None
    return GPUTiledLayout.for_array(array, jax_gpu_layout)


__all__ += ["auto_layout", "explicit_layout", "mosaic_gpu_explicit_layout",
            "mosaic_gpu_tiled_layout", "relayout_p"]


# --- primitives of JAX's own that kernels may hold, beyond lax's -------------------------
from jax._src import checkify as _checkify  # noqa: E402
from jax._src import debugging as _debugging  # noqa: E402
from jax._src.lax import control_flow as _control_flow  # noqa: E402

stage_p = core.stage_p
"""JAX's staging of a value (an identity once traced)."""
platform_index_p = _control_flow.platform_index_p
"""``lax.platform_dependent``'s choice of a branch by the platform lowered for."""
debug_callback_p = _debugging.debug_callback_p
"""``jax.debug.callback`` (and ``jax.debug.print``)."""
check_p = _checkify.check_p
"""``checkify.check`` and ``checkify.debug_check``."""
empty_ref_p = core.empty_ref_p
"""``jax.empty_ref``: a new mutable Ref of unspecified contents."""
try:
    from jax._src.pallas.fuser import custom_fusion_lib as _custom_fusion

    custom_fusion_p: Primitive | None = _custom_fusion.custom_fusion_p
    """JAX's ``custom_fusion`` (JAX 0.11 on): a function with a Pallas form of its own."""
except ImportError:  # JAX 0.10
    custom_fusion_p = None
__all__ += ["check_p", "custom_fusion_p", "debug_callback_p", "empty_ref_p", "platform_index_p",
            "stage_p"]


def platform_branch(eqn: Any, names: Sequence[str]) -> int | None:
    """The branch ``lax.platform_dependent`` takes (a ``platform_index`` equation) where the
    platform is one of ``names``: the first naming one of them, else the default one (a
    ``None`` entry); ``None`` if neither."""
    for i, platforms in enumerate(eqn.params["platforms"]):
        if platforms is None or any(n in platforms for n in names):
            return i
    return None


def failed_check(eqn: Any) -> tuple[int, str] | None:
    """``(operand, message)`` of a ``checkify`` check equation made with ``debug=True``: the
    index of its boolean operand, True where the check fails, and the check's message (a
    format string; its arguments are not filled in). ``None`` for a check made to be
    functionalized (``debug=False``)."""
    if not eqn.params.get("debug", False):
        return None
    error = jax.tree.unflatten(eqn.params["err_tree"], list(range(len(eqn.invars))))
    (pred,) = error._pred.values()
    (exception_tree,) = error._metadata.values()
    (payload,) = error._payload.values()
    exception = jax.tree.unflatten(exception_tree, payload)
    return int(pred), str(getattr(exception, "fmt_string", exception))


# --- jax.random's key arrays in kernels ---------------------------------------------------
from jax._src.random import prng as _prng  # noqa: E402

random_seed_p = _prng.random_seed_p
random_bits_p = _prng.random_bits_p
random_fold_in_p = _prng.random_fold_in_p
random_wrap_p = _prng.random_wrap_p
random_unwrap_p = _prng.random_unwrap_p
iota_2x32_shape_p = _prng.iota_2x32_shape_p
KEY_PRIMITIVES = (random_seed_p, random_bits_p, random_fold_in_p, iota_2x32_shape_p)
"""``jax.random``'s primitives on key arrays that backends lower as the key implementation's
functions on the keys' words (:func:`key_expansion`), as JAX's TPU lowering does;
``random_wrap_p``/``random_unwrap_p`` change the type only (a key is its words)."""
__all__ += ["KEY_PRIMITIVES", "iota_2x32_shape_p", "random_bits_p", "random_fold_in_p",
            "random_seed_p", "random_unwrap_p", "random_wrap_p"]


def physical_aval(aval: Any) -> Any:
    """``aval`` as it is held: a key array as its words (``uint32``, the key's shape plus the
    implementation's key shape); any other aval unchanged."""
    return core.physical_aval(aval)


def _iota_2x32(shape: tuple[int, ...]) -> tuple[Any, Any]:
    """``iota_2x32_shape``: the row-major index of each element as two 32-bit words (high,
    low); built from int32 iotas, as JAX's TPU lowering builds it."""
    low = jnp.zeros(shape, jnp.int32)
    step = 1
    for dim in range(len(shape) - 1, -1, -1):
        low = low + lax.broadcasted_iota(jnp.int32, shape, dim) * step
        step *= shape[dim]
    return (jnp.zeros(shape, jnp.uint32), lax.convert_element_type(low, jnp.uint32))


def key_expansion(eqn: Any) -> ClosedJaxpr | str:
    """One of :data:`KEY_PRIMITIVES`' equations as plain ``lax`` ops (and ``threefry2x32``)
    on the keys' words: the key implementation's ``seed``, ``random_bits`` or ``fold_in``,
    or the index words of ``iota_2x32_shape``. A string says why it cannot be: a batch of
    keys (a kernel holds one key at a time), or an index past 2**31."""
    p = eqn.params
    if eqn.primitive is iota_2x32_shape_p:
        shape = tuple(p["shape"])
        if math.prod(shape) > np.iinfo(np.int32).max:
            return f"iota_2x32_shape of {math.prod(shape)} elements (more than 2**31 - 1)"
        return jax.make_jaxpr(lambda: _iota_2x32(shape))()
    key = eqn.invars[0].aval
    if eqn.primitive is random_seed_p:
        fn, impl = p["impl"].seed, p["impl"]
    else:
        impl = key.dtype._impl
        fn = (impl.fold_in if eqn.primitive is random_fold_in_p else
              functools.partial(_random_bits, impl, p["bit_width"], tuple(p["shape"])))
    if tuple(key.shape) != ():
        return f"a batch of {tuple(key.shape)} keys (a kernel draws from one key at a time)"
    physical = [physical_aval(v.aval) for v in eqn.invars]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in physical]
    return jax.make_jaxpr(fn)(*structs)


def _random_bits(impl: Any, bit_width: int, shape: tuple[int, ...], key: Any) -> Any:
    return impl.random_bits(key, bit_width, shape)


def threefry2x32_expansion(avals: Sequence[Any]) -> ClosedJaxpr:
    """``threefry2x32`` on operands of ``avals`` written as plain ``lax`` ops (its rounds
    unrolled), as JAX's own TPU lowering inlines it: for backends without the primitive."""
    from jax._src.random import threefry2x32 as threefry

    fn = functools.partial(threefry._threefry2x32_lowering, use_rolled_loops=False)
    return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))


stack_p = _lax_internal.stack_p
"""``jnp.stack``'s primitive (JAX-internal name)."""
unstack_p = _lax_internal.unstack_p
"""``unstack``'s primitive, the inverse of :data:`stack_p`."""


# --- emulation: jaxprs with some equations replaced -------------------------------------
def evaluate_replacing(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                       replace: Callable[[Any, list[Any]], list[Any] | None],
                       touches: Callable[[Jaxpr], bool]) -> list[Any]:
    """Evaluates ``jaxpr`` (binding its primitives on ``args``, traced or not), except that an
    equation for which ``replace(eqn, in_values)`` returns values takes those; jaxprs held in
    an equation's parameters are rewritten the same way where ``touches(sub_jaxpr)``."""
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, core.Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        outs = replace(eqn, invals)
        if outs is None:
            outs = bind_rewriting(eqn, invals, replace, touches)
        for v, out in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, core.DropVar):
                env[v] = out
    return [read(a) for a in jaxpr.outvars]


def bind_rewriting(eqn: Any, invals: Sequence[Any],
                   replace: Callable[[Any, list[Any]], list[Any] | None],
                   touches: Callable[[Jaxpr], bool]) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals``, with the jaxprs among its parameters rewritten
    as :func:`evaluate_replacing` rewrites (what it does with an equation ``replace`` leaves)."""
    params = eqn.params
    if any(touches(sub) for sub in sub_jaxprs(params)):
        with _body_context(eqn):
            params = {k: _rewrite_param(v, replace, touches) for k, v in params.items()}
    bind_params = eqn.primitive.get_bind_params(params)
    with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
        ans = eqn.primitive.bind(*invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _body_context(eqn: Any) -> Any:
    """The context a body of ``eqn`` is traced in: a ``shard_map``'s manual mesh axes (so
    that ``lax.axis_index`` and collectives of the body trace again), else none."""
    if eqn.primitive.name != "shard_map":
        return contextlib.nullcontext()
    from jax._src import shard_map as shard_map_lib
    from jax._src.mesh import use_abstract_mesh

    mesh, manual = eqn.params["mesh"], frozenset(eqn.params["newly_manual_axes"])
    stack = contextlib.ExitStack()
    stack.enter_context(shard_map_lib._extend_axis_env(mesh, manual))
    stack.enter_context(use_abstract_mesh(shard_map_lib._as_manual_mesh(mesh, manual)))
    stack.enter_context(_config._check_vma(eqn.params.get("check_vma", True)))
    return stack


def shard_map_mesh(eqn: Any) -> Any | None:
    """The mesh of a ``shard_map`` equation that makes every axis of its mesh manual (each
    device runs the body on its own shard), else ``None`` (also for other equations)."""
    if eqn.primitive.name != "shard_map":
        return None
    mesh = eqn.params.get("mesh")
    manual = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes"))
    if mesh is None or manual is None or set(manual) != set(mesh.axis_names):
        return None
    return mesh


def sub_jaxprs(params: Any) -> list[Jaxpr]:
    """The jaxprs among an equation's parameters (e.g. the branches of a ``cond``), open."""
    found = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, _CLOSED_JAXPR):
                found.append(v.jaxpr)
            elif isinstance(v, core.Jaxpr):
                found.append(v)
    return found


def sub_jaxpr_consts(params: Any) -> list[tuple[Jaxpr, Sequence[Any]]]:
    """As :func:`sub_jaxprs`, each with the constants its closed jaxpr binds (none for an
    open one)."""
    found: list[tuple[Jaxpr, Sequence[Any]]] = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, _CLOSED_JAXPR):
                found.append((v.jaxpr, v.consts))
            elif isinstance(v, core.Jaxpr):  # 0.12's jaxprs carry their constants
                found.append((v, tuple(getattr(v, "consts", None) or ())))
    return found


def dce(jaxpr: Jaxpr) -> tuple[Jaxpr, list[bool]]:
    """``jaxpr`` (without constvars) less the equations none of its outputs need (effect-free
    ones), and which of its inputs it still takes (JAX 0.10 drops the unused ones; later
    releases keep every input, all marked used)."""
    out, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    if len(out.invars) == len(jaxpr.invars):
        return out, [True] * len(jaxpr.invars)
    return out, list(used)


def _rewrite_param(value: Any, replace: Callable[[Any, list[Any]], list[Any] | None],
                   touches: Callable[[Jaxpr], bool]) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_rewrite_param(v, replace, touches) for v in value)
    if isinstance(value, _CLOSED_JAXPR):
        if not touches(value.jaxpr):
            return value
        return _retrace(value.jaxpr, value.consts, value.in_avals, replace, touches)
    if isinstance(value, core.Jaxpr):
        if not touches(value):
            return value
        closed = _retrace(value, (), [v.aval for v in value.invars], replace, touches)
        if closed.consts:  # an open jaxpr parameter has no place for them
            raise NotImplementedError(
                "rewriting a jaxpr parameter without constants produced constants "
                f"({[getattr(c, 'shape', c) for c in closed.consts]})")
        return closed.jaxpr
    return value


def _retrace(jaxpr: Jaxpr, consts: Sequence[Any], in_avals: Sequence[Any],
             replace: Callable[[Any, list[Any]], list[Any] | None],
             touches: Callable[[Jaxpr], bool]) -> ClosedJaxpr:
    def fn(*args: Any) -> list[Any]:
        return evaluate_replacing(jaxpr, consts, args, replace, touches)
    return jax.make_jaxpr(fn)(*in_avals)



def jax_pallas_primitives() -> dict[str, Primitive]:
    """``jax.experimental.pallas``'s kernel primitives by name (``pallas_call``, ``core_map``,
    and ``mpmd_map`` where JAX has it)."""
    from jax._src.pallas import core as pallas_core_jax
    from jax._src.pallas import pallas_call as pallas_call_jax

    found: dict[str, Primitive] = {"pallas_call": pallas_call_jax.pallas_call_p}
    if hasattr(pallas_core_jax, "core_map_p"):  # JAX 0.10 (0.11 binds mpmd_map instead)
        found["core_map"] = pallas_core_jax.core_map_p
    try:  # pl.kernel binds mpmd_map
        from jax._src.pallas import mpmd
    except ImportError:
        return found
    return {**found, "mpmd_map": mpmd.mpmd_map_p}


_JAX_PARAMS_MODULES = {"jax._src.pallas.triton.core": "triton",
                       "jax._src.pallas.mosaic.core": "mosaic_tpu",
                       "jax._src.pallas.mosaic_gpu.core": "mosaic_gpu"}


def jax_params_backend(params: Any) -> str | None:
    """The backend ``jax.experimental.pallas``'s own ``CompilerParams`` object ``params``
    belongs to (``pltpu.CompilerParams``: ``"mosaic_tpu"``), by the module JAX defines its
    class in; ``None`` for any other object."""
    cls = type(params)
    if cls.__name__ != "CompilerParams":
        return None
    return _JAX_PARAMS_MODULES.get(cls.__module__)
