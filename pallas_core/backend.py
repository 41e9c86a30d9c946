"""The public API for backend plugins: everything a plugin imports from the core.

A backend plugin (first-party or third-party) imports this module, the way pytest's plugins
import ``pytest`` and never ``_pytest``::

    from pallas_core import backend as plb

    @plb.hookimpl
    def pallas_describe() -> plb.BackendInfo: ...

Plugins may also use the core's other public modules (``pallas_core`` itself,
``pallas_core.spec``, ``pallas_core.primitives``, ``pallas_core.errors``, ...), but never a
private one (``pallas_core._jax``) or an underscored name: ``tests/test_plugin_api.py`` fails on
such an import in any plugin package. The names below are stable; each is documented where it
is defined, and grouped here by use.

**The contract** (``docs/writing-a-backend.md``): :data:`hookimpl` marks hook implementations
(specifications in :mod:`pallas_core.hookspecs`); :class:`BackendInfo` is what
``pallas_describe`` returns (its ``capabilities`` are :class:`Capability` members);
:class:`KernelCall` (the kernel as bound) and :class:`LoweringRequest` (one call to lower) are
what the hooks receive; :class:`EmulatedCall`
is what ``pallas_emulate`` receives; :func:`register_backend` registers a plugin by hand.
A call's :class:`GridMapping` has one :class:`BlockMapping` per operand. A plugin subclasses
:class:`CompilerParams` for its options and makes its :class:`MemorySpace` objects. A
:class:`Chip` describes a chip the backend compiles for (``BackendInfo.chips``, for
``pl.report``'s roofline; the ``pallas_footprint`` hook gives a kernel's on-chip memory,
``pallas_op_cost`` what the backend's own primitives cost);
:data:`GPU_CHIPS` holds the GPUs' datasheet figures once, for each GPU backend to list its own;
:func:`kernel_cost` is the cost ``pl.report`` counts, for a compiler that takes an estimate
(a :class:`CostEstimate`, as users give one).

**Reference semantics** of the primitives a plugin adds (its ``pallas_primitives`` hook):
:class:`PrimitiveSemantics`, :class:`ReferenceContext`; :func:`semantics_rules` (every
installed primitive's ``evaluate`` rules, a :data:`SemanticsRules`, for backends that run
kernels as plain JAX; it hands the discharge rules to JAX), :func:`evaluate` (a discharged
kernel at one grid step, with those rules), :func:`find_eqn`.

**Lowering rules** for backends that emit MLIR equation by equation: :data:`Rule` (the one
signature every backend's rules share), :class:`Rules` (a table), :class:`LoweringState`,
:func:`lower_jaxpr`; a plugin exposes its full table from a ``lowering_rules()`` function
(a :data:`LoweringRulesFn`) returning a :data:`RuleTable`.

**Kernel IR** (JAX's jaxpr types, re-exported from the core's JAX adapter so that a JAX upgrade
is a change in the core alone): ``Primitive``, ``Jaxpr``, ``ClosedJaxpr``, ``Literal``,
``ShapedArray``, ``Tracer``, ``typeof``, ``is_var``, ``source_line``, ``user_context``,
``jaxpr_from_eqns``, ``trace_to_jaxpr``, ``written_invars``, ``scan_parts``; the control-flow
primitives ``cond_p``, ``while_p``, ``scan_p``, ``axis_index_p``, ``stack_p``, ``unstack_p``;
JAX's own primitives that kernels may hold, for backends that lower them as JAX does:
``stage_p``, ``custom_fusion_p`` (``None`` where JAX lacks it), ``platform_index_p`` (with
``platform_branch``, the branch a platform takes), ``debug_callback_p``, ``check_p`` (with
``failed_check``, a debug check's predicate and message), ``empty_ref_p``; ``relayout_p``
(``jax.experimental.layout.explicit_layout`` in a kernel, JAX 0.11 on, else ``None``) with
``auto_layout``, ``explicit_layout`` (JAX 0.11 has it internally), ``mosaic_gpu_tiled_layout``
(its Mosaic GPU register layout's parts) and ``mosaic_gpu_explicit_layout`` (such a layout, for
tests).

**Symbolic shapes** (``jax.export`` with shape polymorphism; a backend declaring the
``symbolic_blocks`` capability receives them): ``is_symbolic_dim``, ``is_static_shape``,
``dynamic_shapes_export_enabled`` (JAX's ``pallas_dynamic_shapes_export`` flag, which
``pl.pallas_export_experimental`` sets), ``dim_as_value_p`` (a dimension's value in a kernel),
``dimension_variables`` and ``dimension_program`` (the StableHLO program computing a dimension
from its variables, as JAX's export writes it), ``run_dimension_program`` (that program run
with numpy, for emulators); ``KernelCall.symbolic_dims`` and ``KernelCall.with_dims``.

**Refs and effects**: ``AbstractRef``, ``ref_type_of``, ``shape_after_transforms``,
``NDIndexer``, ``Slice``, ``ds``, ``BitcastTransform``, ``ReshapeTransform``, the state
primitives ``get_p``, ``swap_p``, ``addupdate_p``, ``broadcast_to_p``; ``Effect``,
``ReadEffect``, ``WriteEffect``, ``is_ref_effect``, ``internal_mutable_array_effect``,
``register_side_effect``; ``discharge_state``, ``discharge_rules_wrapped``,
:func:`ref_and_transforms`; ``run_state_p`` (``pl.run_state``'s primitive),
``make_ref_aval`` and ``register_initial_ref`` (a backend's own kind of initial Ref value,
such as an accumulator); :class:`Indices` (a copy's gather/scatter index vector with a value to
skip, ``plsc.Indices``).

**Emitting a call**: ``emit_custom_call``, ``manual_axes``, ``make_ir_context``,
``assume_device``, ``assumed_device`` (the chip a trace or lowering is for where no device
of the platform is attached: what ``pltpu.get_tpu_info()`` answers for),
``mosaic_serde_version``, ``mosaic_waits_name_both_ends``,
``sparsecore_adds_only_into_shared_vmem``; ``pallas_use_mosaic_gpu`` (JAX's
choice between the two GPU backends, for ``BackendInfo.default_priority``);
``jax_lowering_rule_names`` (JAX's own rule registries, for parity tests) and
``jax_mosaic_primitive`` (one of JAX's Mosaic primitives by name, for tests comparing modules).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pallas_core import _jax
from pallas_core import primitives as _primitives
from pallas_core._jax import (
    AbstractRef,
    BitcastTransform,
    ClosedJaxpr,
    Effect,
    Jaxpr,
    Literal,
    NDIndexer,
    PeerRefTransform,
    Primitive,
    ReadEffect,
    ReshapeTransform,
    ShapedArray,
    Slice,
    Tracer,
    WriteEffect,
    addupdate_p,
    assume_device,
    assumed_device,
    auto_layout,
    axis_index_p,
    broadcast_to_p,
    check_p,
    cond_p,
    custom_fusion_p,
    debug_callback_p,
    dim_as_value_p,
    dimension_program,
    dimension_variables,
    discharge_rules_wrapped,
    discharge_state,
    ds,
    dynamic_shapes_export_enabled,
    emit_custom_call,
    empty_ref_p,
    explicit_layout,
    extend_axis_env,
    failed_check,
    get_p,
    internal_mutable_array_effect,
    is_ref_effect,
    is_static_shape,
    is_symbolic_dim,
    is_var,
    jax_lowering_rule_names,
    jax_mosaic_primitive,
    jaxpr_from_eqns,
    make_ir_context,
    make_ref_aval,
    manual_axes,
    mosaic_gpu_explicit_layout,
    mosaic_gpu_tiled_layout,
    mosaic_serde_version,
    mosaic_waits_name_both_ends,
    pallas_use_mosaic_gpu,
    platform_branch,
    platform_index_p,
    ref_type_of,
    register_initial_ref,
    register_side_effect,
    relayout_p,
    run_state_p,
    scan_p,
    scan_parts,
    shape_after_transforms,
    source_line,
    sparsecore_adds_only_into_shared_vmem,
    stack_p,
    stage_p,
    swap_p,
    trace_to_jaxpr,
    typeof,
    unstack_p,
    user_context,
    while_p,
    written_invars,
)
from pallas_core.copies import Indices
from pallas_core.datasheets import GPU_CHIPS
from pallas_core.deprecations import Deprecated, Deprecations
from pallas_core.emulation.call import EmulatedCall
from pallas_core.emulation.shape_programs import run as run_dimension_program
from pallas_core.errors import PallasError, UnsupportedError, unsupported
from pallas_core.grid_mapping import BlockMapping, GridMapping, refuse_empty_operands
from pallas_core.hookspecs import hookimpl
from pallas_core.mlir_lowering import LoweringState, Rule, Rules, lower_jaxpr
from pallas_core.plugins import Backend, BackendInfo, Capability, register_backend
from pallas_core.reference import SemanticsRules, evaluate, find_eqn, semantics_rules
from pallas_core.report import kernel_cost
from pallas_core.report_work import OpCost
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.roofline import Chip
from pallas_core.semantics import PrimitiveSemantics, ReferenceContext
from pallas_core.spec import CompilerParams, CostEstimate, MemorySpace

RuleTable = Mapping[Primitive, Rule]
"""A backend's full lowering-rule table, as its ``lowering_rules()`` function returns it:
primitive -> :data:`Rule`, read-only."""

LoweringRulesFn = Callable[[], RuleTable]
"""The type of a plugin's ``lowering_rules()``."""


def ref_and_transforms(ref: Any, idx: Any, fn: str) -> tuple[Any, tuple[Any, ...]]:
    """Splits ``ref[idx]`` (a Ref or a view of one, and an index) into the underlying Ref and
    the transforms (indexers, bitcasts, reshapes) that make the view; what a primitive that
    takes Ref operands binds. ``fn`` names the user-facing function in error messages (an
    index that does not fit the Ref raises a ``PallasError`` naming ``pl.<fn>``)."""
    return _primitives._ref_and_transforms(ref, idx, fn)


def remote_view(ref: Any, device_id: Any,
                device_id_type: _primitives.DeviceIdType = _primitives.DeviceIdType.MESH) -> Any:
    """``ref`` (a Ref or a view of one) as the same symmetric buffer on device ``device_id``
    of the ``shard_map`` mesh (forms as for ``pl.semaphore_signal``): a view whose last
    transform is a :class:`PeerRefTransform`, for backends that address other devices'
    memory (``plgpu.remote_ref``). Reads, writes and copies through it are the backend's to
    lower, or to refuse."""
    ids, core = _primitives.device_id_operands(device_id, device_id_type, "remote_ref")
    if core is not None or not ids:
        raise PallasError("remote_ref: device_id names a core of the kernel's mesh, not a "
                          "device. Fix: name a device of the shard_map mesh.")
    return _jax.peer_view(ref, ids, device_id_type is _primitives.DeviceIdType.MESH)


__all__ = [
    # the contract
    "Backend", "BackendInfo", "BlockMapping", "Capability", "Chip", "CompilerParams",
    "CostEstimate", "GPU_CHIPS", "OpCost", "kernel_cost",
    "Deprecated", "Deprecations",
    "EmulatedCall", "GridMapping", "refuse_empty_operands",
    "Indices", "KernelCall", "LoweringRequest", "MemorySpace", "PallasError", "UnsupportedError",
    "hookimpl", "register_backend", "unsupported",
    # reference semantics
    "PrimitiveSemantics", "ReferenceContext", "SemanticsRules", "evaluate", "find_eqn",
    "semantics_rules",
    # lowering rules
    "LoweringRulesFn", "LoweringState", "Rule", "RuleTable", "Rules", "lower_jaxpr",
    # kernel IR
    "ClosedJaxpr", "Jaxpr", "Literal", "Primitive", "ShapedArray", "Tracer", "axis_index_p",
    "cond_p", "is_var", "jaxpr_from_eqns", "scan_p", "scan_parts", "source_line", "stack_p",
    "extend_axis_env", "trace_to_jaxpr", "typeof", "unstack_p", "user_context", "while_p",
    "written_invars",
    # symbolic shapes (jax.export with shape polymorphism)
    "dim_as_value_p", "dimension_program", "dimension_variables", "dynamic_shapes_export_enabled",
    "is_static_shape", "is_symbolic_dim", "run_dimension_program",
    "check_p", "custom_fusion_p", "debug_callback_p", "empty_ref_p", "failed_check",
    "platform_branch", "platform_index_p", "stage_p",
    "auto_layout", "explicit_layout", "mosaic_gpu_explicit_layout", "mosaic_gpu_tiled_layout",
    "relayout_p",
    # Refs and effects
    "AbstractRef", "BitcastTransform", "Effect", "NDIndexer", "PeerRefTransform",
    "ReadEffect", "ReshapeTransform", "remote_view",
    "Slice", "WriteEffect", "addupdate_p", "broadcast_to_p", "discharge_rules_wrapped",
    "discharge_state", "ds", "get_p", "internal_mutable_array_effect", "is_ref_effect",
    "make_ref_aval", "ref_and_transforms", "ref_type_of", "register_initial_ref",
    "register_side_effect", "run_state_p", "shape_after_transforms", "swap_p",
    # emitting a call
    "assume_device", "assumed_device", "emit_custom_call", "jax_lowering_rule_names",
    "jax_mosaic_primitive",
    "make_ir_context", "manual_axes", "mosaic_serde_version", "mosaic_waits_name_both_ends",
    "pallas_use_mosaic_gpu", "sparsecore_adds_only_into_shared_vmem",
]
