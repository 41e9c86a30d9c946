"""Primitives of JAX's own, beyond ``lax``'s, that kernels may hold and backends lower or walk
into: structured primitives (``cond``, ``scan``, calls, remat, ``custom_jvp``/``vjp``),
explicit layouts, staging, ``platform_dependent``, debug callbacks, ``checkify`` checks,
``jax.random``'s key primitives (with their expansion into plain ``lax`` ops) and
``stack``/``unstack``."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import checkify as _checkify
from jax._src import (
    core,
    custom_derivatives,
    pjit,
)
from jax._src import debugging as _debugging
from jax._src import layout as _layout
from jax._src.lax import control_flow as _control_flow
from jax._src.lax import lax as _lax_internal
from jax._src.lax import parallel
from jax._src.lax.control_flow import conditionals, loops
from jax._src.random import prng as _prng

from pallas_core._jax.base import ClosedJaxpr, Primitive

# --- structured primitives the reference evaluator walks into -----------------------------
axis_index_p = parallel.axis_index_p
cond_p = conditionals.cond_p
scan_p = loops.scan_p
while_p = loops.while_p
jit_p = pjit.jit_p
reshard_p = pjit.reshard_p
custom_jvp_call_p = custom_derivatives.custom_jvp_call_p
custom_vjp_call_p = custom_derivatives.custom_vjp_call_p
closed_call_p = core.closed_call_p
remat_p = _ad_checkpoint.remat_p


relayout_p = getattr(pjit, "relayout_p", None)
"""The primitive ``explicit_layout`` binds to give a value a layout (JAX 0.11 on; else
``None``); its ``dst_layout`` is :data:`auto_layout` or a backend's register layout."""
auto_layout = _layout.AutoLayout
"""``dst_layout`` of a ``relayout`` that hands a value back to the compiler's choice."""
explicit_layout = getattr(pjit, "explicit_layout", None)
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
