"""Primitives only the Triton backend offers, each with reference semantics for the interpreter.

``approx_tanh`` (the GPU's fast tanh), ``elementwise_inline_asm`` (PTX applied elementwise),
``debug_barrier`` (synchronise the threads of a program) and ``max_contiguous`` (a hint that
runs of values are contiguous). The interpreter runs kernels that use them through the
semantics registered here; inline assembly needs a ``reference`` function for that.

``load`` and ``store`` are JAX's ``pallas.triton`` spellings of the core's masked access: the
whole Ref (or view) is accessed, and the cache and eviction hints are checked but do not
change results, so they are the core's ``pl.load``/``pl.store`` with every backend's rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import pallas_core as pl
from pallas_core import ArgumentError
from pallas_core import backend as plb
from pallas_core.backend import PallasError, PrimitiveSemantics, ReferenceContext, UnsupportedError

approx_tanh_p = plb.Primitive("triton_approx_tanh")
approx_tanh_p.def_abstract_eval(lambda x: x)

max_contiguous_p = plb.Primitive("triton_max_contiguous")
max_contiguous_p.def_abstract_eval(lambda x, *, values: x)


class BarrierEffect(plb.Effect):
    """Keeps ``debug_barrier`` in the kernel although it has no outputs."""


barrier_effect = BarrierEffect()
debug_barrier_p = plb.effect_primitive("triton_debug_barrier", barrier_effect)

inline_asm_p = plb.Primitive("triton_elementwise_inline_asm")
inline_asm_p.multiple_results = True


@inline_asm_p.def_abstract_eval
def _inline_asm_abstract_eval(*args: Any, asm: str, constraints: str, pack: int,
                              result_shape_dtypes: tuple[Any, ...], reference: Any) -> Any:
    return [plb.ShapedArray(s.shape, s.dtype) for s in result_shape_dtypes]


def approx_tanh(x: jax.Array) -> jax.Array:
    """``tanh`` with the GPU's approximate instruction (``tanh.approx``, float32 and below)."""
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise PallasError(f"approx_tanh needs float32, float16 or bfloat16, found {x.dtype}. "
                          "Fix: cast, or use jnp.tanh.")
    return approx_tanh_p.bind(x)  # type: ignore[no-any-return]


def max_contiguous(x: jax.Array, values: int | Sequence[int]) -> jax.Array:
    """Tells Triton that ``x`` has runs of ``values`` contiguous values; returns ``x``."""
    values = (values,) if isinstance(values, int) else tuple(values)
    return max_contiguous_p.bind(jnp.asarray(x), values=values)  # type: ignore[no-any-return]


def debug_barrier() -> None:
    """Synchronises the threads of the current program (``__syncthreads``)."""
    debug_barrier_p.bind()


def elementwise_inline_asm(asm: str, *, args: Sequence[Any], constraints: str, pack: int,
                           result_shape_dtypes: Sequence[Any],
                           reference: Callable[..., Any] | None = None) -> list[jax.Array]:
    """Applies the PTX ``asm`` elementwise to ``args`` (broadcast to one shape).

    ``reference(*args) -> results`` gives the meaning in plain JAX, so the interpreter can run
    the kernel; without it, the interpreter refuses the kernel.
    """
    outs = inline_asm_p.bind(*(jnp.asarray(a) for a in args), asm=asm, constraints=constraints,
                             pack=pack, result_shape_dtypes=tuple(
                                 jax.ShapeDtypeStruct(s.shape, s.dtype)
                                 for s in result_shape_dtypes), reference=reference)
    return list(outs)


LOAD_CACHE_MODIFIERS = (".ca", ".cg")
"""The cache modifiers a Triton load may name (JAX's Triton lowering accepts these)."""
EVICTION_POLICIES = ("evict_normal", "evict_first", "evict_last")
"""The eviction policies a Triton load or store may name."""


def _check_hint(fn: str, name: str, value: Any, allowed: Sequence[str]) -> None:
    if value is not None and value not in allowed:
        raise ArgumentError(f"pallas_triton.{fn}: {name}={value!r} is not one of "
                            f"{', '.join(map(repr, allowed))}. Fix: pass one of them, or None.")


def load(ref: Any, *, mask: Any = None, other: Any = None, cache_modifier: str | None = None,
         eviction_policy: str | None = None, volatile: bool = False) -> jax.Array:
    """Reads all of ``ref`` (a Ref or a view such as ``ref.at[idx]``).

    Where ``mask`` is False the result is ``other`` (undefined without it) and nothing is read,
    so masked-off indices may lie outside the Ref. ``cache_modifier`` (``".ca"``, ``".cg"``),
    ``eviction_policy`` and ``volatile`` are hints to the GPU's memory system: checked here,
    without effect on the values.
    """
    _check_hint("load", "cache_modifier", cache_modifier, LOAD_CACHE_MODIFIERS)
    _check_hint("load", "eviction_policy", eviction_policy, EVICTION_POLICIES)
    del volatile  # Only orders memory between programs; one program reads the same values.
    return pl.load(ref, ..., mask=mask, other=other)


def store(ref: Any, val: Any, *, mask: Any = None, eviction_policy: str | None = None) -> None:
    """Writes ``val`` to all of ``ref`` (a Ref or a view), only where ``mask`` is True.

    ``eviction_policy`` is a hint to the GPU's caches: checked, without effect on the values.
    """
    _check_hint("store", "eviction_policy", eviction_policy, EVICTION_POLICIES)
    pl.store(ref, ..., val, mask=mask)


def _inline_asm_reference(ctx: ReferenceContext, *args: Any, asm: str, constraints: str,
                          pack: int, result_shape_dtypes: tuple[Any, ...],
                          reference: Any) -> Any:
    if reference is None:
        raise UnsupportedError(
            "elementwise_inline_asm without reference= cannot run outside a GPU. Fix: pass "
            "reference=<a jax.numpy function of the same arguments>.")
    out = reference(*args)
    return list(out) if isinstance(out, (tuple, list)) else [out]


SEMANTICS: tuple[PrimitiveSemantics, ...] = (
    PrimitiveSemantics(approx_tanh_p, evaluate=lambda ctx, x: jnp.tanh(x)),
    PrimitiveSemantics(max_contiguous_p, evaluate=lambda ctx, x, *, values: x),
    PrimitiveSemantics(debug_barrier_p, evaluate=lambda ctx: []),
    PrimitiveSemantics(inline_asm_p, evaluate=_inline_asm_reference),
)
