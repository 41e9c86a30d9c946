"""Arithmetic helpers for sizes and indices: ``cdiv``, ``align_to``, ``next_power_of_2``,
``strides_from_shape``.

``cdiv`` and ``align_to`` work on Python ints (grid and block sizes) and on traced integers
inside kernels and index maps; on traced values they use only ``add``, ``sub`` and ``div``
(truncating division), which every backend lowers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax import lax

from pallas_core import _jax
from pallas_core.errors import ArgumentError


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division of ``a`` by ``b``: how many blocks of size ``b`` cover ``a``.

    ``(a + b - 1) / b`` divided with truncation toward zero: ``lax.div`` on arrays, the same
    arithmetic on sizes (Python ints, or JAX's symbolic dimensions), so both agree for every
    sign. Exact for non-negative ``a`` and positive ``b`` (which is what sizes are); JAX 0.11
    defines it so for other signs too (0.10's integer form floored instead).
    """
    if _jax.is_dim(a) and _jax.is_dim(b):
        n = a + b - 1
        # Truncating division: floor when the quotient is non-negative, ceiling otherwise.
        return n // b if (n < 0) == (b < 0) else -(-n // b)
    return lax.div(a + (b - 1), b)


def align_to(a: Any, alignment: Any) -> Any:
    """``a`` rounded up to a multiple of ``alignment`` (``cdiv(a, alignment) * alignment``)."""
    return cdiv(a, alignment) * alignment


def next_power_of_2(x: int) -> int:
    """The smallest power of two that is ``>= x`` (1 for 0); ``x`` must be a non-negative int."""
    if x < 0:
        raise ArgumentError(f"pl.next_power_of_2 needs a non-negative integer, found {x!r}.")
    return 1 if x == 0 else 1 << (int(x) - 1).bit_length()


def strides_from_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major (C order) strides, in elements, of an array of ``shape``."""
    strides = []
    remaining = math.prod(shape)
    for size in shape:
        remaining = remaining // size if size else 0
        strides.append(int(remaining))
    return tuple(strides)


def check_tool_arguments(api: str, fn: Any, target: Any, **flags: Any) -> None:
    """The checks ``pl.stages``, ``pl.emulate`` and ``pl.report`` share: ``fn`` is callable,
    ``target`` a string or ``None``; ``flags`` are ``name=(value, kind)`` with ``kind``
    ``"bool"`` or ``"int or None"`` (a bool is not an int here)."""
    if not callable(fn):
        raise ArgumentError(
            f"{api}(fn, ...): expected a function (or a pallas_call) as the first argument, "
            f"found {type(fn).__name__} {fn!r:.60}. Fix: pass the function to run, e.g. "
            f"{api}(my_kernel_call, x, ...).")
    if target is not None and not isinstance(target, str):
        raise ArgumentError(
            f"{api}(target={target!r}): expected a target name (a string such as 'sm_90' or "
            "'v5e') or None for the backend's default, found "
            f"{type(target).__name__}. Fix: pass target='...' as a string.")
    for name, (value, kind) in flags.items():
        ok = isinstance(value, bool) if kind == "bool" else (
            value is None or (isinstance(value, int) and not isinstance(value, bool)))
        if not ok:
            wanted, example = (("True or False", "True") if kind == "bool"
                               else ("an int or None", "0 (any int)"))
            raise ArgumentError(
                f"{api}({name}={value!r}): expected {wanted}, found {type(value).__name__}. "
                f"Fix: pass {name}={example}.")
