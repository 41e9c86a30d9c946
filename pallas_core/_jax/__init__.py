"""The one place where pallas_core touches JAX internals (``jax._src``): this package.

Everything the core and its plugins need from JAX that is not public API is re-exported from
here, so that a JAX upgrade is a change in this package alone; no other module of the core
imports ``jax._src``. Plugins never import it: the names they need are re-exported by the
public plugin API, :mod:`pallas_core.backend`. Its modules, by topic:

- ``base``: the installed JAX's version, the core types (jaxprs, primitives, avals), and
  JAX's words for two tree structures that differ;
- ``shapes``: symbolic dimensions (``jax.export`` with shape polymorphism);
- ``state``: Refs, indexers and views, and the discharge of stateful jaxprs;
- ``jaxprs``: tracing into jaxprs, and walking and evaluating them;
- ``transforms``: batching and autodiff rules of primitives, symbolic-zero tangents;
- ``lowering``: lowering rules, custom calls, the context a lowering runs in;
- ``primitives``: JAX's own primitives beyond ``lax``'s that kernels may hold;
- ``settings``: JAX's settings, and the chip JAX is told it compiles for;
- ``jax_pallas``: what JAX's own Pallas says (for the backends agreeing with it).
"""

from __future__ import annotations

import logging
import os

import jax
from jax._src import callback as _jax_callback

from pallas_core import errors
from pallas_core._jax.base import (
    JAX_VERSION,
    NEWEST_TESTED_JAX,
    ClosedJaxpr,
    ConcretizationTypeError,
    Effect,
    Jaxpr,
    Literal,
    Primitive,
    ShapedArray,
    Tracer,
    eval_context,
    eval_jaxpr,
    is_dim,
    pytree_mismatches,
    typeof,
)
from pallas_core._jax.jax_pallas import (
    jax_lowering_rule_names,
    jax_mosaic_primitive,
    jax_pallas_primitives,
    jax_params_backend,
    mosaic_serde_version,
    mosaic_waits_name_both_ends,
    sparsecore_adds_only_into_shared_vmem,
)
from pallas_core._jax.jaxprs import (
    being_staged,
    bind_rewriting,
    convert_constvars,
    dce,
    evaluate_replacing,
    extend_axis_env,
    hide_frames_in,
    input_effects_by_position,
    is_var,
    jaxpr_from_eqns,
    scan_parts,
    shard_map_mesh,
    source_line,
    sub_jaxpr_consts,
    sub_jaxprs,
    trace_to_jaxpr,
    user_context,
    varying_axes,
    with_varying_axes,
)
from pallas_core._jax.lowering import (
    def_eager_impl,
    effect_primitive,
    emit_custom_call,
    lower_fun,
    lowering_platforms,
    make_ir_context,
    manual_axes,
    no_mesh,
    register_lowering,
    register_side_effect,
    shard_map_device_mesh,
    top_level,
)
from pallas_core._jax.primitives import (
    KEY_PRIMITIVES,
    auto_layout,
    axis_index_p,
    check_p,
    closed_call_p,
    cond_p,
    custom_fusion_p,
    custom_jvp_call_p,
    custom_vjp_call_p,
    debug_callback_p,
    empty_ref_p,
    explicit_layout,
    failed_check,
    iota_2x32_shape_p,
    jit_p,
    key_expansion,
    mosaic_gpu_explicit_layout,
    mosaic_gpu_tiled_layout,
    physical_aval,
    platform_branch,
    platform_index_p,
    random_bits_p,
    random_fold_in_p,
    random_seed_p,
    random_unwrap_p,
    random_wrap_p,
    relayout_p,
    remat_p,
    reshard_p,
    scan_p,
    stack_p,
    stage_p,
    threefry2x32_expansion,
    unstack_p,
    while_p,
)
from pallas_core._jax.settings import (
    assume_device,
    assumed_device,
    chip_answers,
    jit_keyed_setting,
    pallas_enable_debug_checks,
    pallas_poison_buffers,
    pallas_use_mosaic_gpu,
    platform_attached,
    settle_runtime_tokens,
)
from pallas_core._jax.shapes import (
    call_exported_primitive,
    dim_as_value_p,
    dimension_program,
    dimension_variables,
    dynamic_shapes_export_enabled,
    export_dynamic_shapes,
    is_static_shape,
    is_symbolic_dim,
    map_dims,
)
from pallas_core._jax.state import (
    AbstractRef,
    BitcastTransform,
    NDIndexer,
    PeerRefTransform,
    ReadEffect,
    ReshapeTransform,
    Slice,
    StoreMismatch,
    WriteEffect,
    addupdate_p,
    apply_leading_reshapes,
    broadcast_to_p,
    discharge_rules_wrapped,
    discharge_state,
    ds,
    get_p,
    get_ref_and_transforms,
    get_ref_and_transforms_past_the_end,
    internal_mutable_array_effect,
    is_ref_effect,
    make_ref_aval,
    out_of_bound_slice,
    peer_view,
    ref_type_of,
    register_discharge_rule,
    register_initial_ref,
    run_state,
    run_state_p,
    shape_after_transforms,
    store_mismatch,
    swap_p,
    transform_array,
    transform_swap_array,
    written_invars,
)
from pallas_core._jax.transforms import (
    add_any_p,
    instantiate_zero,
    is_zero,
    jvp_jaxpr,
    primitive_jvps,
    primitive_transposes,
    register_batching_rule,
    register_linearization,
    tangent_aval,
    zero_tangent,
)

# Frames inside pallas_core are internal, like JAX's own: source lines attached to a kernel's
# equations (and filtered tracebacks) point at the user's code.
hide_frames_in(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A PallasError raised in a host callback (checked mode's reports, the emulators) is raised
# again by pallas' entry points; JAX's log of it, with the callback's traceback, is left out.
logging.getLogger(_jax_callback.__name__).addFilter(errors.unlogged_reports)


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


__all__ = [
    "AbstractRef", "add_any_p", "addupdate_p", "apply_leading_reshapes", "assume_device",
    "assumed_device", "auto_layout", "axis_index_p", "being_staged", "bind_rewriting",
    "hide_frames_in",
    "BitcastTransform", "broadcast_to_p", "call_exported_primitive", "check_p", "chip_answers",
    "closed_call_p", "ClosedJaxpr", "ConcretizationTypeError", "cond_p", "convert_constvars",
    "custom_fusion_p", "custom_jvp_call_p", "custom_vjp_call_p", "dce", "debug_callback_p",
    "def_eager_impl", "dim_as_value_p", "dimension_program", "dimension_variables",
    "discharge_rules_wrapped", "discharge_state", "ds", "dynamic_shapes_export_enabled",
    "Effect", "effect_primitive", "emit_custom_call", "empty_ref_p", "eval_context",
    "eval_jaxpr", "evaluate_replacing", "explicit_layout", "export_dynamic_shapes",
    "extend_axis_env", "failed_check", "get_p", "get_ref_and_transforms",
    "get_ref_and_transforms_past_the_end",
    "input_effects_by_position", "instantiate_zero", "internal_mutable_array_effect",
    "iota_2x32_shape_p", "is_dim", "is_ref_effect", "is_static_shape", "is_symbolic_dim",
    "is_var", "is_zero", "jax_lowering_rule_names", "jax_mosaic_primitive",
    "jax_pallas_primitives", "jax_params_backend", "JAX_VERSION", "Jaxpr", "jaxpr_from_eqns",
    "jit_keyed_setting", "jit_p", "jvp_jaxpr", "key_expansion", "KEY_PRIMITIVES", "Literal",
    "lower_fun", "lowering_platforms", "make_ir_context", "make_ref_aval", "manual_axes",
    "map_dims", "mosaic_gpu_explicit_layout", "mosaic_gpu_tiled_layout",
    "mosaic_serde_version", "mosaic_waits_name_both_ends", "NDIndexer", "NEWEST_TESTED_JAX",
    "no_mesh", "out_of_bound_slice", "pallas_enable_debug_checks", "pallas_poison_buffers",
    "pallas_use_mosaic_gpu", "peer_view", "PeerRefTransform", "physical_aval",
    "platform_attached", "platform_branch", "platform_index_p", "Primitive", "primitive_jvps",
    "primitive_transposes", "pytree_mismatches", "random_bits_p", "random_fold_in_p",
    "random_seed_p", "random_unwrap_p", "random_wrap_p", "ReadEffect", "ref_type_of",
    "register_batching_rule", "register_discharge_rule", "register_initial_ref",
    "register_linearization",
    "register_lowering", "register_side_effect", "relayout_p", "remat_p", "ReshapeTransform",
    "reshard_p", "run_state", "run_state_p", "scan_p", "scan_parts", "settle_runtime_tokens",
    "shape_after_transforms", "ShapedArray", "shard_map_device_mesh", "shard_map_mesh",
    "Slice", "source_line", "sparsecore_adds_only_into_shared_vmem", "stack_p", "stage_p",
    "store_mismatch", "StoreMismatch", "sub_jaxpr_consts", "sub_jaxprs", "swap_p",
    "tangent_aval", "threefry2x32_expansion", "top_level", "trace_to_jaxpr", "Tracer",
    "transform_array", "transform_swap_array", "typeof", "unstack_p", "user_context",
    "varying_axes", "warn_if_untested_jax", "while_p", "with_varying_axes", "WriteEffect",
    "written_invars", "zero_tangent",
]
