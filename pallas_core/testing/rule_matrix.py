"""The dtype-by-operation matrix every MLIR backend lowers: each entry either lowers to a module
that verifies, or is refused with a ``PallasError`` naming the operation, the dtype and the
backend. No raw MLIR error, no other exception.

A backend's test module parametrizes over :data:`CASES` and calls :func:`check` with a function
that lowers one kernel for its hardware (``lower(kernel, operands)``, raising what the lowering
raises). The kernels read every operand whole and write one output whole, so what is exercised
is the operation's rule, not the backend's memory rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core.call import pallas_call
from pallas_core.errors import PallasError
from pallas_core.stages import kernel_calls

DTYPES = ("float32", "bfloat16", "float16", "int32", "int16", "int8", "uint32", "uint8",
          "bool")


@dataclasses.dataclass(frozen=True)
class Case:
    """``op`` applied to ``arity`` operands of ``dtype``; ``label`` tells cases apart, its
    part before ``(`` is the operation a refusal must name."""

    label: str
    op: Callable[..., Any]
    arity: int
    dtype: str
    out_dtype: str | None = None

    @property
    def name(self) -> str:
        return self.label.split("(")[0]

    def __str__(self) -> str:
        return f"{self.label}-{self.dtype}" + (f"-{self.out_dtype}" if self.out_dtype else "")


def _fori(x: Any) -> Any:
    return lax.fori_loop(0, 3, lambda i, c: c + x if c.dtype != jnp.bool_ else c ^ x, x)


def _any(x: Any) -> Any:
    return jnp.max((x != jnp.zeros((), x.dtype)).astype(jnp.int32)) > 0


def _while(x: Any) -> Any:
    n = _any(x).astype(jnp.int32) + 2  # a trip count known only at run time

    def body(c: Any) -> Any:
        return c[0] + 1, lax.select(c[0] > 0, c[1], x)

    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))[1]


def _cond(x: Any) -> Any:
    return lax.cond(_any(x), lambda: x, lambda: lax.full_like(x, 1))


def _switch(x: Any) -> Any:
    i = _any(x).astype(jnp.int32)
    return lax.switch(i, [lambda: x, lambda: lax.full_like(x, 1), lambda: lax.full_like(x, 0)])


UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "not": lax.bitwise_not,
    "exp": lax.exp, "exp2": lax.exp2, "log": lax.log, "log1p": lax.log1p, "expm1": lax.expm1,
    "sqrt": lax.sqrt, "rsqrt": lax.rsqrt, "cbrt": lax.cbrt, "sin": lax.sin, "cos": lax.cos,
    "tan": lax.tan, "tanh": lax.tanh, "atan": lax.atan, "floor": lax.floor, "ceil": lax.ceil,
    "round": lax.round, "erf": lax.erf, "erf_inv": lax.erf_inv,
    "logistic": lax.logistic, "is_finite": lax.is_finite,
    "square": lax.square, "population_count": lax.population_count, "clz": lax.clz,
    "integer_pow(0)": lambda x: lax.integer_pow(x, 0),
    "integer_pow(3)": lambda x: lax.integer_pow(x, 3),
    "integer_pow(-2)": lambda x: lax.integer_pow(x, -2),
    "reduce_sum": lambda x: jnp.broadcast_to(jnp.sum(x, axis=-1, keepdims=True), x.shape),
    "reduce_max": lambda x: jnp.broadcast_to(jnp.max(x, axis=-1, keepdims=True), x.shape),
    "reduce_min": lambda x: jnp.broadcast_to(jnp.min(x, axis=-1, keepdims=True), x.shape),
    "scan": _fori, "while": _while, "cond": _cond,
    "reduce_precision": lambda x: lax.reduce_precision(x, exponent_bits=5, mantissa_bits=2),
    # JAX 0.11 on: tanh's derivative.
    **({"one_minus_square": lax.one_minus_square} if hasattr(lax, "one_minus_square") else {}),
}
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "rem": lax.rem,
    "max": lax.max, "min": lax.min, "and": lax.bitwise_and, "or": lax.bitwise_or,
    "xor": lax.bitwise_xor, "pow": lax.pow, "atan2": lax.atan2, "shift_left": lax.shift_left,
    "shift_right_arithmetic": lax.shift_right_arithmetic,
    "shift_right_logical": lax.shift_right_logical, "eq": lax.eq, "ne": lax.ne, "lt": lax.lt,
    "le": lax.le, "gt": lax.gt, "ge": lax.ge,
    "floor_divide": jnp.floor_divide, "remainder": jnp.remainder, "nextafter": lax.nextafter,
    "mulhi": lax.mulhi,
}
TERNARY: dict[str, Callable[[Any, Any, Any], Any]] = {
    "select_n": lambda x, y, z: lax.select(x != z, x, y),
    "clamp": lax.clamp,
}

def _jax_takes(case: Case) -> bool:
    """Whether JAX itself accepts the operation on the dtype (``lax.atan`` of int32 is a
    TypeError before any backend sees it)."""
    try:
        jax.eval_shape(case.op, *(jax.ShapeDtypeStruct((8, 128), jnp.dtype(case.dtype))
                                  for _ in range(case.arity)))
    except TypeError:
        return False
    return True


_ALL: list[Case] = [
    *(Case(n, f, 1, d) for n, f in UNARY.items() for d in DTYPES),
    *(Case(n, f, 2, d) for n, f in BINARY.items() for d in DTYPES),
    *(Case(n, f, 3, d) for n, f in TERNARY.items() for d in DTYPES),
    *(Case("convert_element_type", lambda x, t=t: x.astype(t), 1, s, t)
      for s in DTYPES for t in DTYPES if s != t),
    Case("switch", _switch, 1, "int32"),
    *(Case("bitcast_convert_type", lambda x, t=t: lax.bitcast_convert_type(x, t), 1, s, t)
      for s, t in (("float32", "int32"), ("int32", "float32"), ("uint32", "float32"),
                   ("bfloat16", "int16"), ("float16", "uint16"), ("int8", "uint8"),
                   ("float32", "int16"))),
    Case("stop_gradient", lax.stop_gradient, 1, "float32"),
]
CASES: list[Case] = [c for c in _ALL if _jax_takes(c)]

COMPOSED = {
    "floor_divide": ("div", "rem", "sign", "select_n", "ne", "lt", "and", "sub", "floor",
                     "round"),
    "remainder": ("rem", "select_n", "ne", "lt", "and", "add"),
    "cond": ("reduce_max", "ne", "gt", "convert_element_type"),
    "switch": ("reduce_max", "ne", "gt", "convert_element_type", "clamp"),
    "while": ("reduce_max", "ne", "gt", "convert_element_type", "add", "lt", "select_n"),
    "scan": ("add", "xor"),
}
"""Cases written with ``jax.numpy`` or control flow: the primitives they are made of, any of
which a refusal may name instead of the case."""
"""Every operation on every dtype JAX takes it on, and every cast."""


def operands(case: Case, shape: Sequence[int]) -> list[jax.Array]:
    """Random operands of ``case`` (distinct seeds; integers small, so shifts stay in range)."""
    out = []
    for k in range(case.arity):
        key = jax.random.key(k)
        dtype = jnp.dtype(case.dtype)
        if dtype == jnp.bool_:
            out.append(jax.random.bernoulli(key, 0.5, shape))
        elif jnp.issubdtype(dtype, jnp.integer):
            out.append(jax.random.randint(key, shape, 0, 7).astype(dtype))
        else:
            out.append(jax.random.normal(key, shape, jnp.float32).astype(dtype))
    return out


def call_parts(case: Case, shape: Sequence[int], bools_in_memory: bool = True
               ) -> tuple[Callable[..., None], jax.ShapeDtypeStruct, list[jax.Array]]:
    """``(kernel, out_shape, operands)`` of ``case`` on arrays of ``shape``: the kernel is
    ``o_ref[...] = op(*(r[...] for r in in_refs))``. Without ``bools_in_memory`` (a backend
    whose memory holds no booleans), boolean operands and results travel as int32 and the
    kernel converts them, so that the operation still sees and makes booleans."""
    xs = operands(case, shape)
    out = jax.eval_shape(case.op, *xs)
    as_int = not bools_in_memory

    def stored(dtype: Any) -> Any:
        return jnp.dtype(jnp.int32) if as_int and dtype == jnp.bool_ else dtype

    is_bool = [x.dtype == jnp.bool_ for x in xs]

    def body(*refs: Any) -> None:
        *ins, o_ref = refs
        vals = [r[...] != 0 if as_int and b else r[...] for r, b in zip(ins, is_bool)]
        o_ref[...] = case.op(*vals).astype(o_ref.dtype)

    xs = [x.astype(stored(x.dtype)) for x in xs]
    return body, jax.ShapeDtypeStruct(out.shape, stored(out.dtype)), xs


def pallas_call_lowering(backend: str, shape: Sequence[int],
                         lower_kernel: Callable[[Any], Any]) -> Callable[[Case], None]:
    """A ``lower`` for :func:`check`: the case as a ``pallas_call`` of whole-array blocks of
    ``shape`` on ``backend``, its kernel lowered by the backend's ``lower_kernel(call)`` (which
    verifies the module)."""
    def lower(case: Case) -> None:
        body, out, xs = call_parts(case, shape)
        f = pallas_call(body, out, backend=backend)
        (call,) = kernel_calls(jax.make_jaxpr(f)(*xs).jaxpr)
        lower_kernel(call)
    return lower


_DIVIDES = ("div", "rem", "floor_divide", "remainder")
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}
"""Relative (and absolute) tolerance of an emulated float result against ``jax.numpy``: a few
units in the last place, since backends may lower transcendental functions to polynomials."""


def pallas_call_emulation(backend: str, shape: Sequence[int]) -> Callable[[Case], None]:
    """A ``lower`` for :func:`check` that does more: the case as a ``pallas_call`` on
    ``backend``, run by ``pl.emulate`` (lowered for the hardware, its module executed by the
    backend's emulator), must match the operation computed by ``jax.numpy`` on the same
    random operands: bit for bit on integers and booleans, within :data:`TOLERANCE` on
    floats."""
    from pallas_core.emulation.api import emulate

    def run(case: Case) -> None:
        body, out, xs = call_parts(case, shape)
        xs = defined_operands(case, xs)
        got = emulate(pallas_call(body, out, backend=backend), backend=backend)(*xs)
        assert_matches(case, got, xs, out, backend)
    return run


def defined_operands(case: Case, xs: list[jax.Array]) -> list[jax.Array]:
    """``xs`` with the divisor of an integer division made nonzero (a zero divisor is
    undefined: hardware and ``jax.numpy`` need not agree)."""
    if case.name in _DIVIDES and case.arity == 2 and not jnp.issubdtype(xs[1].dtype,
                                                                          jnp.floating):
        xs = [xs[0], jnp.where(xs[1] == 0, jnp.ones((), xs[1].dtype), xs[1])]
    return xs


def assert_matches(case: Case, got: Any, xs: Sequence[jax.Array], out: Any,
                   backend: str = "") -> None:
    """``got`` (an emulated result) matches ``case.op(*xs)`` by ``jax.numpy``: bit for bit on
    integers, booleans and integers converted to floats, within :data:`TOLERANCE` on
    floats."""
    want = case.op(*xs).astype(out.dtype)
    tol = TOLERANCE.get(np.dtype(out.dtype).name, 0.0)
    if not jnp.issubdtype(xs[0].dtype, jnp.floating):
        tol = 0.0  # integer and boolean operations, and their conversions, are exact
    np.testing.assert_allclose(
        np.asarray(got, np.float64) if tol else np.asarray(got),
        np.asarray(want, np.float64) if tol else np.asarray(want), rtol=tol, atol=tol,
        err_msg=f"{case} emulated on {backend!r} differs from jax.numpy")


def check(case: Case, lower: Callable[[Case], None], backend: str) -> None:
    """Lowers ``case`` with ``lower``; passes if it lowers, or if it is refused with a
    ``PallasError`` naming the operation, the dtype and ``backend``."""
    try:
        lower(case)
    except PallasError as e:
        message = str(e)
        dtypes = [np.dtype(jnp.dtype(t)).name for t in (case.dtype, case.out_dtype) if t]
        names = (case.name, *COMPOSED.get(case.name, ()))
        missing = [w for w in (backend,) if w not in message]
        if not any(n in message for n in names):
            missing.append(case.name)
        if case.name in COMPOSED:  # a part may work on an intermediate dtype
            dtypes = [np.dtype(jnp.dtype(t)).name for t in DTYPES]
        if not any(t in message for t in dtypes):
            missing.append(" or ".join(dtypes))
        if missing:
            raise AssertionError(f"{case}: refused, but the message does not name "
                                 f"{missing}: {message}") from e
    # Any other exception (a raw MLIR error, a KeyError in a rule) fails the test as it is.
