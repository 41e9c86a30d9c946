"""Evaluating index maps with numpy, over many grid points at once.

Index maps are small integer functions of the grid indices. Checking them on every grid point
ahead of time with JAX's eager evaluation would compile one executable per primitive and per
number of points (memory that stays behind for every distinct grid). Here an index map's jaxpr
is evaluated with numpy instead: every variable holds one value per grid point (a 1-d array,
or a 0-d array where it does not depend on the grid), with the integer semantics of XLA
(wrapping arithmetic, division rounding towards zero, ``x // 0 == -1`` and ``x % 0 == x``).

:func:`evaluate` raises :class:`NotVectorisableError` for an equation it has no rule for (a
``lax.cond``, a gather from an ``iota``, a read of a scalar-prefetch Ref, ...); callers then
evaluate with JAX on fixed-size chunks of points. :func:`output_axes` says which grid axes each
output of an index map depends on, so that an index depending on one axis of a huge grid is
checked on that axis alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pallas_core import _jax


class NotVectorisableError(Exception):
    """An index map has an equation that :func:`evaluate` cannot run with numpy."""


CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
         "custom_vjp_call", "custom_vjp_call_jaxpr")
"""Primitives that call one jaxpr, their operands flowing into it and their outputs coming from
it: evaluated by evaluating it (derivative rules ignored). Shared with ``report_prefetch``."""


def _call_jaxpr(params: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in params:
            return params[key]
    raise NotVectorisableError("a call without a jaxpr")


def _bits(x: np.ndarray) -> int:
    return np.dtype(x.dtype).itemsize * 8


def _div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if not np.issubdtype(x.dtype, np.integer):
        return np.true_divide(x, y)
    safe = np.where(y == 0, 1, y)
    q = np.abs(x.astype(np.int64)) // np.abs(safe.astype(np.int64))
    q = np.where((x < 0) != (safe < 0), -q, q)
    return np.where(y == 0, -1, q)


def _rem(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if not np.issubdtype(x.dtype, np.integer):
        return np.fmod(x, y)
    safe = np.where(y == 0, 1, y)
    return np.where(y == 0, x, np.fmod(x.astype(np.int64), safe.astype(np.int64)))


def _convert(x: np.ndarray, *, new_dtype: Any, **_: Any) -> np.ndarray:
    to = np.dtype(new_dtype)
    if np.issubdtype(to, np.integer) and np.issubdtype(x.dtype, np.floating):
        info = np.iinfo(to)
        x = np.clip(np.nan_to_num(np.trunc(x), nan=0.0), info.min, info.max)
    return np.asarray(x).astype(to)


def _shift_left(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    ok = (y >= 0) & (y < _bits(x))
    return np.where(ok, np.left_shift(x, np.where(ok, y, 0).astype(x.dtype)), 0)


def _shift_right_arithmetic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    amount = np.where((y >= 0) & (y < _bits(x)), y, _bits(x) - 1)
    return np.right_shift(x, amount.astype(x.dtype))


def _shift_right_logical(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    unsigned = np.dtype(f"uint{_bits(x)}")
    ok = (y >= 0) & (y < _bits(x))
    out = np.right_shift(x.astype(unsigned), np.where(ok, y, 0).astype(unsigned))
    return np.where(ok, out, 0).astype(x.dtype)


def _select_n(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    if len(cases) == 1:
        return cases[0]
    if which.dtype == np.bool_:
        return np.where(which, cases[1], cases[0])
    return np.choose(which.astype(np.int64), cases)


def _integer_pow(x: np.ndarray, *, y: int) -> np.ndarray:
    out = np.ones_like(x)
    for _ in range(abs(y)):
        out = out * x
    return out if y >= 0 else 1 / out


def _clamp(lo: np.ndarray, x: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(x, lo), hi)


def _same(x: np.ndarray, **_: Any) -> np.ndarray:
    return x


_RULES: dict[str, Callable[..., Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative,
    "max": np.maximum, "min": np.minimum, "abs": np.abs, "sign": np.sign,
    "div": _div, "rem": _rem, "clamp": _clamp, "square": lambda x: x * x,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal,
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor, "not": np.invert,
    "select_n": _select_n, "convert_element_type": _convert,
    "shift_left": _shift_left, "shift_right_arithmetic": _shift_right_arithmetic,
    "shift_right_logical": _shift_right_logical,
    "floor": lambda x: np.floor(x), "ceil": lambda x: np.ceil(x),
    # Scalars in, scalars out (every value of an index map is a scalar per grid point).
    "copy": _same, "copy_p": _same, "reshape": _same, "squeeze": _same,
    "broadcast_in_dim": _same,
}
_RULES["integer_pow"] = _integer_pow


def evaluate(closed: Any, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Evaluates the closed jaxpr ``closed`` (scalar inputs and outputs) with numpy, each
    argument holding one value per grid point (or one for all): per output a 0-d or 1-d
    array. Raises :class:`NotVectorisableError` where it cannot."""
    with np.errstate(all="ignore"):
        return _evaluate(closed.jaxpr, closed.consts, args)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[np.ndarray]:
    env: dict[Any, np.ndarray] = {}

    def read(atom: Any) -> np.ndarray:
        if isinstance(atom, _jax.Literal):
            return np.asarray(atom.val, getattr(atom.aval, "dtype", None))
        return env[atom]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = _scalar_per_point(var.aval, np.asarray(val))
    for var, val in zip(jaxpr.invars, args):
        if not isinstance(var.aval, _jax.ShapedArray):
            continue  # a Ref (scalar prefetch): reading it is refused below
        env[var] = _scalar_per_point(var.aval, np.asarray(val))
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        try:
            ins = [read(a) for a in eqn.invars]
        except KeyError:
            raise NotVectorisableError(f"{name} reads a Ref") from None
        for var, out in zip(eqn.outvars, evaluate_equation(eqn, ins)):
            env[var] = _scalar_per_point(var.aval, np.asarray(out))
    return [read(v) for v in jaxpr.outvars]


def evaluate_equation(eqn: Any, ins: Sequence[np.ndarray]) -> list[np.ndarray]:
    """One scalar equation on values per grid point (as :func:`evaluate` holds them): its
    outputs. Raises :class:`NotVectorisableError` where it cannot."""
    name = eqn.primitive.name
    if name in CALLS:
        sub = _call_jaxpr(eqn.params)
        sub_jaxpr, sub_consts = getattr(sub, "jaxpr", sub), getattr(sub, "consts", ())
        return _evaluate(sub_jaxpr, sub_consts, ins)
    if name in _RULES:
        params = eqn.params if name in ("convert_element_type", "integer_pow") else {}
        return [_RULES[name](*ins, **params)]
    raise NotVectorisableError(name)


def _scalar_per_point(aval: Any, value: np.ndarray) -> np.ndarray:
    if getattr(aval, "shape", None) != () or value.ndim > 1:
        raise NotVectorisableError(f"a value of type {aval}")
    return value.astype(aval.dtype, copy=False)


def output_axes(closed: Any, num_axes: int) -> list[frozenset[int]] | None:
    """Per output of an index map, the grid axes (its first ``num_axes`` inputs) it depends
    on; ``None`` when an output depends on another input (a scalar-prefetch Ref)."""
    jaxpr = closed.jaxpr
    deps: dict[Any, frozenset[int]] = {}
    for k, var in enumerate(jaxpr.invars):
        deps[var] = frozenset([k])
    for eqn in jaxpr.eqns:
        used = frozenset().union(*(deps.get(a, frozenset()) for a in eqn.invars
                                   if _jax.is_var(a)))
        for var in eqn.outvars:
            deps[var] = used
    out = [deps.get(v, frozenset()) if _jax.is_var(v) else frozenset() for v in jaxpr.outvars]
    if any(a >= num_axes for axes in out for a in axes):
        return None
    return out
