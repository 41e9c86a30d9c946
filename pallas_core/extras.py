"""The rest of ``jax.experimental.pallas``'s kernel surface: ``delay``, ``reciprocal``, ``dot``,
``debug_check`` (with JAX's ``enable_debug_checks``/``enable_poison_buffers`` flags),
``with_scoped`` and ``lower_as_mlir``.

Where a name means something every backend can already express, it is built from JAX
primitives (``dot`` is a ``dot_general``, an exact ``reciprocal`` is ``1 / x``), so every backend
lowers it. Where it is a hardware operation it is a primitive of its own (``delay_p``,
``reciprocal_p`` for the approximate reciprocal, ``debug_check_p``), whose reference semantics
live in :mod:`pallas_core.semantics`; a backend without a rule for it raises an
``UnsupportedError`` naming it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import _jax
from pallas_core import primitives as prims
from pallas_core.errors import (
    ArgumentError,
    PallasError,
    UnsupportedError,
    UnsupportedNameError,
    reported,
)

enable_debug_checks = _jax.pallas_enable_debug_checks
"""JAX's flag (``jax_pallas_enable_debug_checks``): while it is on, ``pl.debug_check`` is
checked; otherwise it does nothing. ``with pl.enable_debug_checks(True): ...``."""

enable_poison_buffers = _jax.pallas_poison_buffers
"""JAX's flag (``jax_pallas_poison_buffers``): while it is on, the interpreter fills buffers
nobody has written yet (scratch, ``run_scoped``) with NaN (floats) or the smallest integer."""


def debug_checks_enabled() -> bool:
    """Whether ``pl.debug_check`` is checked (deprecated: read ``enable_debug_checks.value``)."""
    return bool(enable_debug_checks.value)


# --- delay -------------------------------------------------------------------------------------


class DelayEffect(_jax.Effect):
    """Marks a kernel that waits, so that the wait is never removed as dead code."""


delay_effect = DelayEffect()
delay_p = _jax.effect_primitive("delay", delay_effect)


def delay(nanos: Any) -> None:
    """Waits about ``nanos`` nanoseconds (an int or int32 scalar) before going on.

    Timing only: the interpreter does not wait. Mosaic TPU lowers it to ``tpu.delay``, Mosaic
    GPU to ``nanosleep.u32``.
    """
    nanos = jnp.asarray(nanos)
    if nanos.shape != () or not jnp.issubdtype(nanos.dtype, jnp.integer):
        raise ArgumentError(f"pl.delay needs an integer scalar of nanoseconds, found "
                            f"{nanos.dtype}{list(nanos.shape)}.")
    delay_p.bind(nanos.astype(jnp.int32))


# --- reciprocal --------------------------------------------------------------------------------

reciprocal_p = _jax.Primitive("reciprocal")
reciprocal_p.def_abstract_eval(lambda x, *, approx, full_range: x)


def reciprocal(x: Any, *, approx: bool = False, full_range: bool = True) -> jax.Array:
    """``1 / x`` of a floating-point array.

    With ``approx=True`` the hardware may use a faster, less precise reciprocal (Mosaic TPU's
    ``tpu.reciprocal {approx}``; the interpreter computes it exactly; other backends refuse it).
    ``full_range=False`` lets it be wrong for infinities, NaN and values near 0 or the largest
    floats. Without ``approx`` it is exactly ``1 / x``, which every backend lowers.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ArgumentError(f"pl.reciprocal needs a floating-point array, found {x.dtype}. "
                            "Fix: convert it, e.g. x.astype(jnp.float32).")
    if not approx:
        return jnp.asarray(1, x.dtype) / x
    return reciprocal_p.bind(x, approx=True, full_range=bool(full_range))  # type: ignore[no-any-return]


# --- dot ---------------------------------------------------------------------------------------


def _promotable(dtype: Any) -> Any:
    """Stand-ins for the dtypes that take part in no type promotion (int4, float8_e4m3b11fnuz),
    as JAX's ``pl.dot`` uses to pick the result type."""
    if dtype == jnp.int4:
        return jnp.int8
    if dtype == jnp.float8_e4m3b11fnuz:
        return jnp.bfloat16
    return dtype


def dot(a: Any, b: Any, trans_a: bool = False, trans_b: bool = False,
        allow_tf32: bool | None = None, precision: Any = None) -> jax.Array:
    """The matrix product of 2-D ``a`` and ``b``, each optionally transposed first.

    The result is int32 for integer inputs, float64 for float64 inputs and float32 otherwise.
    ``allow_tf32`` picks ``lax.Precision.HIGH`` (True) or ``HIGHEST`` (False) and excludes
    ``precision``. A ``lax.dot_general`` contracting the chosen dimensions, as in JAX.
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim != 2 or b.ndim != 2:
        raise ArgumentError(f"pl.dot multiplies 2-D arrays, found shapes {a.shape} and "
                            f"{b.shape}. Fix: reshape, or use jnp.einsum for batches.")
    if allow_tf32 is not None:
        if precision is not None:
            raise ArgumentError("pl.dot takes allow_tf32= or precision=, not both.")
        precision = lax.Precision.HIGH if allow_tf32 else lax.Precision.HIGHEST
    dtype = jnp.promote_types(_promotable(a.dtype), _promotable(b.dtype))
    if jnp.issubdtype(dtype, jnp.integer):
        out_dtype: Any = jnp.int32
    else:
        out_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                           preferred_element_type=out_dtype)


# --- debug_check -------------------------------------------------------------------------------


class DebugCheckEffect(_jax.Effect):
    """Marks a kernel that checks a condition, so that the check is never removed."""


debug_check_effect = DebugCheckEffect()
debug_check_p = _jax.effect_primitive("debug_check", debug_check_effect)


def debug_check(condition: Any, message: str) -> None:
    """Reports ``message`` where ``condition`` is False, while ``pl.enable_debug_checks`` is on
    (when the kernel is traced); otherwise does nothing.

    The interpreter raises a ``PallasError`` carrying ``message`` when the kernel runs; Mosaic
    TPU and Mosaic GPU lower the check to ``cf.assert`` as JAX does; the other hardware
    backends refuse kernels holding an enabled check.
    """
    if not isinstance(message, str):
        raise ArgumentError(f"pl.debug_check(condition, message): message must be a str, "
                            f"found {message!r}.")
    if not enable_debug_checks.value:
        return
    cond = jnp.asarray(condition)
    if cond.shape != ():
        raise ArgumentError(f"pl.debug_check needs a scalar condition, found shape "
                            f"{cond.shape}. Fix: reduce it, e.g. jnp.all(...).")
    debug_check_p.bind(cond.astype(jnp.bool_), message=message)


@reported
def report_failed_check(ok: Any, *, message: str) -> None:
    """Raises the ``PallasError`` of a failed ``pl.debug_check`` (called back from a kernel)."""
    if not bool(ok):
        raise PallasError(f"pl.debug_check failed: {message}")


# --- scoped allocation and lowering ------------------------------------------------------------


def with_scoped(*types: Any, collective_axes: Any = (),
                **kw_types: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the function runs inside ``pl.run_scoped`` with Refs of ``types``, which it
    receives after the arguments it is called with (``f(*args, *refs, **kw_refs)``)."""
    def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def inner(*args: Any) -> Any:
            return prims.run_scoped(functools.partial(f, *args), *types,
                                    collective_axes=collective_axes, **kw_types)
        return inner
    return decorator


def lower_as_mlir(f: Callable[..., Any], *args: Any, dynamic_shapes: bool = False,
                  device: Any = None, static_argnames: Any = (), platforms: Any = None,
                  **kwargs: Any) -> str:
    """The StableHLO module (text) of ``jax.jit(f)`` exported for ``platforms`` (default
    ``["tpu"]``) on ``args``; each ``pallas_call`` lowered by its backend. For inspecting
    what a backend emits (``pl.stages`` gives every stage); no stability guarantees."""
    if dynamic_shapes:
        raise UnsupportedError(
            "pl.lower_as_mlir(dynamic_shapes=True) is not supported: kernels here have static "
            "shapes. Fix: export with concrete shapes (dynamic_shapes=False).")
    jitted = jax.jit(f, device=device, static_argnames=static_argnames)
    exported = jax.export.export(jitted, platforms=list(platforms or ["tpu"]))(*args, **kwargs)
    return str(exported.mlir_module())


# --- Refs outside kernels, exports ------------------------------------------------------------


def empty_ref_like(x: Any) -> Any:
    """A new mutable Ref (``jax.new_ref``) of unspecified contents, shaped like ``x``.

    ``x`` is a ``jax.ShapeDtypeStruct`` (the Ref is in ``pl.ANY``) or a ``pl.MemoryRef``
    (what calling a memory space returns: the Ref is in that space). Kernels of ``pl.kernel``
    and ``pl.core_map`` write such Refs in place.
    """
    from pallas_core.spec import ANY, MemoryRef

    if isinstance(x, MemoryRef):
        shape, dtype, space = x.shape, x.dtype, x.memory_space
    elif isinstance(x, jax.ShapeDtypeStruct):
        shape, dtype, space = x.shape, x.dtype, ANY
    else:
        raise ArgumentError(
            f"pl.empty_ref_like takes a jax.ShapeDtypeStruct or a pl.MemoryRef, found "
            f"{type(x).__name__}. Fix: e.g. pl.empty_ref_like(jax.ShapeDtypeStruct(shape, "
            "dtype)), or pltpu.VMEM(shape, dtype) for a Ref in a memory space.")
    value = prims.empty(shape, dtype)
    if space is None or space is ANY:
        return jax.new_ref(value)
    return jax.new_ref(value, memory_space=space)


@contextlib.contextmanager
def pallas_export_experimental(dynamic_shapes: bool) -> Iterator[None]:
    """JAX's switch for exporting kernels with symbolic (dynamic) shapes, as a context manager.

    Outside it, ``jax.export`` with shape polymorphism takes kernels whose blocks have static
    shapes: a symbolic grid size becomes a dynamic grid axis. Inside it with
    ``dynamic_shapes=True``, blocks may have symbolic shapes too (a whole array of symbolic
    shape); a backend that exports them (Mosaic TPU) writes each symbolic dimension as a
    placeholder constant and tells the runtime how to compute it (JAX's own flag,
    ``pallas_dynamic_shapes_export``, is set inside the block).
    """
    if not isinstance(dynamic_shapes, (bool, np.bool_)):
        raise ArgumentError(f"pl.pallas_export_experimental(dynamic_shapes={dynamic_shapes!r})"
                            ": expected a bool. Fix: dynamic_shapes=True.")
    with _jax.export_dynamic_shapes(bool(dynamic_shapes)):
        yield


# --- names of jax.experimental.pallas not provided here -----------------------------------------

NOT_PROVIDED: dict[str, str] = {}
"""Names of ``jax.experimental.pallas`` that ``pallas_core`` lacks: what each is, and the fix."""


def not_provided(name: str) -> AttributeError:
    """The error for looking up ``pl.<name>``: an ``UnsupportedNameError`` saying what ``name``
    is in JAX and what to write instead, for names in :data:`NOT_PROVIDED`."""
    if name in NOT_PROVIDED:
        return UnsupportedNameError(
            f"pl.{name} (jax.experimental.pallas.{name}) is not supported by pallas_core: "
            f"{NOT_PROVIDED[name]}")
    return AttributeError(f"module 'pallas_core' has no attribute {name!r}")
