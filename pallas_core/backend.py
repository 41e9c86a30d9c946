"""The public API for backend plugins: everything a plugin imports from the core.

A backend plugin (first-party or third-party) imports this module, the way pytest's plugins
import ``pytest`` and never ``_pytest``::

    from pallas_core import backend as plb

    @plb.hookimpl
    def pallas_describe() -> plb.BackendInfo: ...

Besides this module, a plugin uses only the kernel-author API, ``import pallas_core as pl``
and the names of its ``__all__`` (``pl.BlockSpec``, ``pl.ANY``, ``pl.when``, ...), and, where it
ships test support, the conformance suite ``pallas_core.testing``. It never imports the core's
other modules (``pallas_core.primitives``, ``pallas_core.errors``, ...: what a plugin needs of
them is here), a private module (``pallas_core._jax``), an underscored name, or another plugin's
private module or name: ``tests/test_plugin_api.py`` fails on such an import in any plugin
package. The names below are stable; each is documented where it is defined, and grouped here
by use. A few are exported under a name of their own where the defining module's name would be
ambiguous here (the emulator's ``Rule`` is :data:`EmulatorRule`, beside the lowering
:data:`Rule`).

**The contract** (``docs/writing-a-backend.md``): :data:`hookimpl` marks hook implementations
(specifications in :mod:`pallas_core.hookspecs`); :class:`BackendInfo` is what
``pallas_describe`` returns (its ``capabilities`` are :class:`Capability` members);
:class:`KernelCall` (the kernel as bound) and :class:`LoweringRequest` (one call to lower) are
what the hooks receive; :class:`EmulatedCall`
is what ``pallas_emulate`` receives; :func:`register_backend` registers a plugin by hand.
A call's :class:`GridMapping` has one :class:`BlockMapping` per operand
(:func:`block_index_tables`: every operand's block indices on every grid point, ahead of time;
:func:`block_dim_size` and :func:`plain_block_dim` read a block dimension). A plugin subclasses
:class:`CompilerParams` for its options and makes its :class:`MemorySpace` objects
(:data:`BARRIER_SEMAPHORE` is the core's space of the barrier semaphore; semaphore dtypes
derive from :class:`semaphore_dtype`). :func:`force_interpret_mode` and
:func:`set_interpret_mode` make every ``pallas_call`` run interpreted (a backend's
``interpret`` option); :func:`reported` wraps a host callback so that the ``PallasError`` it
raises reaches the user. A
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
kernel at one grid step, with those rules), :func:`eval_jaxpr_with_rules` (a jaxpr with those
rules at every depth), :func:`find_eqn`, :func:`all_eqns`, :func:`sub_jaxprs`,
:data:`CALL_BODIES` (call primitives and the parameter holding their jaxpr);
what the installed semantics declare, for runners that schedule grid points:
:func:`registered_primitives`, :func:`barrier_rules`, :func:`claim_primitives`,
:func:`phase_wait_primitives`, :func:`fork_rules`, :func:`cluster_rules`, :func:`cluster_axes`.
Helpers for writing ``evaluate``/discharge rules: :func:`read_modify_write`,
:func:`fresh_buffer`, :func:`uninitialized` (within :func:`uninitialized_memory`),
:func:`checked_discharge` and :func:`check_wait` (checked mode), :func:`device_axes` and
:func:`gather_devices` (cross-device primitives inside ``shard_map``).

**The core's primitives**, for backends that lower or interpret them: ``program_id_p``,
``num_programs_p``, ``masked_load_p``, ``masked_swap_p``, ``atomic_rmw_p`` (its
:class:`AtomicOp`), ``atomic_cas_p``, ``semaphore_signal_p``, ``semaphore_wait_p``,
``semaphore_read_p``, ``get_global_p``, ``run_scoped_p``, ``multiple_of_p``, ``debug_print_p``,
``debug_check_p``, ``delay_p``, ``reciprocal_p``, and the asynchronous copies' ``copy_start_p``
and ``copy_wait_p``; :class:`DeviceIdType`; :func:`current_kernel_context` (the grid of the
kernel being traced), :func:`grid_env` (``program_id``/``num_programs`` inside a software
pipeline's body), :func:`barrier_semaphore`; the functions a backend's kernel API re-exports
under its own name: :func:`dot`, :func:`reciprocal`, :func:`core_map`.

**Copies**: :func:`async_copy`, :func:`make_async_copy`, :func:`make_async_remote_copy`, and for
a backend's own copy-like primitives :func:`bind_views` (bind a primitive on views of Refs) with
:class:`RefViews` (those views in its discharge rule) and :func:`copy_bytes`.

**Lowering rules** for backends that emit MLIR equation by equation: :data:`Rule` (the one
signature every backend's rules share), :class:`Rules` (a table), :class:`LoweringState`,
:func:`lower_jaxpr`; a plugin exposes its full table from a ``lowering_rules()`` function
(a :data:`LoweringRulesFn`) returning a :data:`RuleTable`. :func:`splat_literal` makes the
walker's ``literal`` function, :data:`CALL_PRIMITIVES` and :func:`called_jaxpr` are the calls
a backend inlines, :func:`verify_module` turns an invalid module into a ``PallasError``,
:func:`walk_operations` visits every operation of a module; :func:`mlir_element_type` (a
dtype's MLIR element type), :func:`is_float`, :func:`is_unsigned`. The rules shared by every
MLIR backend: :data:`SHARED_RULES` maps each primitive to its module-level rule (which takes
the :class:`Dialect` first), :func:`shared_rules_table` binds them to a backend's dialect;
:func:`convert_dtype`, :func:`reduction_op`, :func:`reduction_identity` and
:func:`debug_check_to_assert` are their parts a backend's own rules reuse.

**Emulation** (``pl.emulate``; a backend's ``pallas_emulate`` hook receives an
:class:`EmulatedCall` with its :class:`EmulateOptions`): an emulator compiles MLIR functions
with an :class:`EmulatorCompiler` into :class:`EmulatorFunction` objects from a table of
:data:`EmulatorRule` (per operation name), starting from the shared :data:`EMULATOR_ARITH_RULES`
(``arith``/``math``) and :data:`EMULATOR_ASSERT_RULES` (``cf.assert``); programs that wait for
each other run in :class:`Turns`. MLIR types as numpy: :func:`dtype_of`, :func:`shape_of`,
:func:`element_type_of` (the element type of a shaped MLIR type), :func:`bit_width`,
:func:`as_unsigned`, :func:`as_signed`.

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
``register_side_effect``, ``effect_primitive`` (a primitive without results that carries an
effect); ``discharge_state``, ``discharge_rules_wrapped``,
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
    effect_primitive,
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
from pallas_core.call import force_interpret_mode, set_interpret_mode
from pallas_core.copies import (
    Indices,
    RefViews,
    async_copy,
    bind_views,
    copy_bytes,
    copy_start_p,
    copy_wait_p,
    make_async_copy,
    make_async_remote_copy,
)
from pallas_core.datasheets import GPU_CHIPS
from pallas_core.deprecations import Deprecated, Deprecations
from pallas_core.emulation.arith import ASSERT_RULES as EMULATOR_ASSERT_RULES
from pallas_core.emulation.arith import RULES as EMULATOR_ARITH_RULES
from pallas_core.emulation.call import EmulatedCall, EmulateOptions
from pallas_core.emulation.machine import Compiler as EmulatorCompiler
from pallas_core.emulation.machine import Function as EmulatorFunction
from pallas_core.emulation.machine import Rule as EmulatorRule
from pallas_core.emulation.shape_programs import run as run_dimension_program
from pallas_core.emulation.turns import Turns
from pallas_core.emulation.types import bit_width, dtype_of, shape_of
from pallas_core.emulation.types import element_type as element_type_of
from pallas_core.emulation.types import signed as as_signed
from pallas_core.emulation.types import unsigned as as_unsigned
from pallas_core.errors import PallasError, UnsupportedError, reported, unsupported
from pallas_core.extras import debug_check_p, delay_p, dot, reciprocal, reciprocal_p
from pallas_core.grid_mapping import (
    BlockMapping,
    GridMapping,
    block_index_tables,
    refuse_empty_operands,
)
from pallas_core.hookspecs import hookimpl
from pallas_core.kernel import core_map
from pallas_core.mlir_lowering import (
    CALL_PRIMITIVES,
    LoweringState,
    Rule,
    Rules,
    called_jaxpr,
    is_float,
    is_unsigned,
    lower_jaxpr,
    splat_literal,
)
from pallas_core.mlir_lowering import element_type as mlir_element_type
from pallas_core.mlir_lowering import verify as verify_module
from pallas_core.mlir_lowering import walk as walk_operations
from pallas_core.mlir_rules import (
    SHARED_RULES,
    Dialect,
    debug_check_to_assert,
    reduction_identity,
    reduction_op,
)
from pallas_core.mlir_rules import convert as convert_dtype
from pallas_core.mlir_rules import table as shared_rules_table
from pallas_core.plugins import Backend, BackendInfo, Capability, register_backend
from pallas_core.primitives import (
    AtomicOp,
    DeviceIdType,
    atomic_cas_p,
    atomic_rmw_p,
    barrier_semaphore,
    current_kernel_context,
    debug_print_p,
    get_global_p,
    grid_env,
    masked_load_p,
    masked_swap_p,
    multiple_of_p,
    num_programs_p,
    program_id_p,
    run_scoped_p,
    semaphore_read_p,
    semaphore_signal_p,
    semaphore_wait_p,
)
from pallas_core.reference import (
    CALL_BODIES,
    SemanticsRules,
    all_eqns,
    barrier_rules,
    cluster_axes,
    cluster_rules,
    evaluate,
    find_eqn,
    registered_primitives,
    semantics_rules,
    sub_jaxprs,
)
from pallas_core.reference import claims as claim_primitives
from pallas_core.reference import eval_jaxpr as eval_jaxpr_with_rules
from pallas_core.reference import forks as fork_rules
from pallas_core.reference import phase_waits as phase_wait_primitives
from pallas_core.report import kernel_cost
from pallas_core.report_work import OpCost
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.roofline import Chip
from pallas_core.semantics import (
    PrimitiveSemantics,
    ReferenceContext,
    check_wait,
    checked_discharge,
    fresh_buffer,
    gather_devices,
    read_modify_write,
    uninitialized,
    uninitialized_memory,
)
from pallas_core.semantics import devices as device_axes
from pallas_core.spec import (
    BARRIER_SEMAPHORE,
    CompilerParams,
    CostEstimate,
    MemorySpace,
    block_dim_size,
    plain_block_dim,
    semaphore_dtype,
)

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
    "discharge_state", "ds", "effect_primitive", "get_p", "internal_mutable_array_effect",
    "is_ref_effect",
    "make_ref_aval", "ref_and_transforms", "ref_type_of", "register_initial_ref",
    "register_side_effect", "run_state_p", "shape_after_transforms", "swap_p",
    # emitting a call
    "assume_device", "assumed_device", "emit_custom_call", "jax_lowering_rule_names",
    "jax_mosaic_primitive",
    "make_ir_context", "manual_axes", "mosaic_serde_version", "mosaic_waits_name_both_ends",
    "pallas_use_mosaic_gpu", "sparsecore_adds_only_into_shared_vmem",
    # the contract, continued
    "BARRIER_SEMAPHORE", "block_dim_size", "block_index_tables", "force_interpret_mode",
    "plain_block_dim", "reported", "semaphore_dtype", "set_interpret_mode",
    # reference semantics, continued
    "CALL_BODIES", "all_eqns", "barrier_rules", "check_wait", "checked_discharge",
    "claim_primitives", "cluster_axes", "cluster_rules", "device_axes", "eval_jaxpr_with_rules",
    "fork_rules", "fresh_buffer", "gather_devices", "phase_wait_primitives", "read_modify_write",
    "registered_primitives", "sub_jaxprs", "uninitialized", "uninitialized_memory",
    # the core's primitives
    "AtomicOp", "DeviceIdType", "atomic_cas_p", "atomic_rmw_p", "barrier_semaphore", "core_map",
    "current_kernel_context", "debug_check_p", "debug_print_p", "delay_p", "dot", "get_global_p",
    "grid_env", "masked_load_p", "masked_swap_p", "multiple_of_p", "num_programs_p",
    "program_id_p", "reciprocal", "reciprocal_p", "run_scoped_p", "semaphore_read_p",
    "semaphore_signal_p", "semaphore_wait_p",
    # copies
    "RefViews", "async_copy", "bind_views", "copy_bytes", "copy_start_p", "copy_wait_p",
    "make_async_copy", "make_async_remote_copy",
    # lowering rules, continued
    "CALL_PRIMITIVES", "Dialect", "called_jaxpr", "convert_dtype", "debug_check_to_assert",
    "is_float", "is_unsigned", "mlir_element_type", "reduction_identity", "reduction_op",
    "SHARED_RULES", "shared_rules_table", "splat_literal", "verify_module", "walk_operations",
    # emulation
    "EMULATOR_ARITH_RULES", "EMULATOR_ASSERT_RULES", "EmulateOptions", "EmulatorCompiler",
    "EmulatorFunction", "EmulatorRule", "Turns", "as_signed", "as_unsigned", "bit_width",
    "dtype_of", "element_type_of", "shape_of",
]
