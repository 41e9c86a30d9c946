"""Primitives only the Mosaic TPU backend offers, each with reference semantics for the
interpreter and a Mosaic lowering rule.

* ``roll(x, shift, axis, *, stride=None, stride_axis=None)``: ``jnp.roll`` along one axis (the
  element at ``i`` moves to ``i + shift``), on the TPU's rotate unit (``tpu.dynamic_rotate``).
  With ``stride``, slice ``k`` along ``stride_axis`` is rolled by ``shift + k * stride``.
* ``bitcast(x, ty)``: reinterprets the bits of an array of rank >= 2 as dtype ``ty``; the
  second-to-last dimension scales by the ratio of the bit widths (``tpu.bitcast``). Going to a
  wider type packs ``p`` consecutive rows into one (row ``p*r + k`` into part ``k``, part 0 the
  least significant bits); going to a narrower one unpacks them the same way.
* ``prng_seed(*seeds)`` / ``prng_random_bits(shape)``: the TPU core's stateful hardware PRNG
  (``tpu.prng_set_seed_32`` / ``tpu.prng_random_bits``).
* ``repeat(x, repeats, axis)``: ``repeats`` copies of ``x`` along ``axis`` (``jnp.tile``).
* ``load(ref, *, mask=None)`` / ``store(ref, val, *, mask=None)``: the whole of ``ref`` (a Ref
  or a view of one, ``ref.at[...]``), read or written only where ``mask`` is set: the core's
  ``pl.load``/``pl.store`` of the full view, with their reference semantics.

The interpreter cannot reproduce the hardware's random bits. It gives the PRNG deterministic
semantics of its own: ``prng_seed`` makes a threefry key from the seeds, each draw splits it;
the bits differ from a TPU's. Its state lives for one grid step (seed in every step, e.g.
``prng_seed(seed, pl.program_id(0))``), and it is never carried into or out of a loop body or a
branch on a traced condition: a draw that would need that raises an ``UnsupportedError``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith
from jaxlib.mosaic.python import tpu

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.backend import PallasError, PrimitiveSemantics, ReferenceContext, UnsupportedError
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.registry import Lowering, rule

# --- roll ------------------------------------------------------------------------------------

roll_p = plb.Primitive("tpu_roll")
"""Operands ``x`` and, for a traced shift, an int32 scalar; params ``shift`` (the static shift
in ``[0, n)``, or ``None`` when traced), ``axis``, ``stride`` (in ``[0, n)``) and
``stride_axis`` (both ``None`` without a stride)."""


@roll_p.def_abstract_eval
def _roll_abstract_eval(x: Any, *dynamic_shift: Any, shift: int | None, axis: int,
                        stride: int | None, stride_axis: int | None) -> Any:
    return x


def _normalized_axis(axis: Any, ndim: int, what: str, fn: str = "roll") -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise PallasError(f"pltpu.{fn}: {what} must be a Python int, found {axis!r}.")
    if not -ndim <= axis < ndim:
        raise PallasError(f"pltpu.{fn}: {what}={axis} is out of range for an array of rank "
                          f"{ndim}. Fix: use an axis in [{-ndim}, {ndim}).")
    return int(axis) % ndim


def roll(x: jax.Array, shift: int | jax.Array, axis: int, *, stride: int | None = None,
         stride_axis: int | None = None) -> jax.Array:
    """Rolls ``x`` by ``shift`` along ``axis``, like ``jnp.roll(x, shift, axis)``.

    ``shift`` is a Python int (any sign) or a traced integer scalar. With ``stride`` and
    ``stride_axis`` (give both or neither), slice ``k`` along ``stride_axis`` is rolled by
    ``shift + k * stride``.
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise PallasError("pltpu.roll needs an array of rank >= 1, found a scalar.")
    axis = _normalized_axis(axis, x.ndim, "axis")
    n = x.shape[axis]
    if (stride is None) != (stride_axis is None):
        raise PallasError("pltpu.roll: give both stride and stride_axis, or neither (found "
                          f"stride={stride!r}, stride_axis={stride_axis!r}).")
    if stride is not None:
        if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)):
            raise PallasError(f"pltpu.roll: stride must be a Python int, found {stride!r}.")
        stride_axis = _normalized_axis(stride_axis, x.ndim, "stride_axis")
        if stride_axis == axis:
            raise PallasError(f"pltpu.roll: stride_axis must differ from axis (both {axis}). "
                              "Fix: stride along another dimension.")
        stride = int(stride) % n if n else 0
    params = {"axis": axis, "stride": stride, "stride_axis": stride_axis}
    if isinstance(shift, (int, np.integer)) and not isinstance(shift, (bool, np.bool_)):
        return roll_p.bind(x, shift=int(shift) % n if n else 0,  # type: ignore[no-any-return]
                           **params)
    amount = jnp.asarray(shift)
    if amount.shape != () or not jnp.issubdtype(amount.dtype, jnp.integer):
        raise PallasError(f"pltpu.roll: shift must be an int or an integer scalar, found "
                          f"{amount.dtype}{list(amount.shape)}.")
    if amount.dtype != jnp.int32:
        amount = lax.convert_element_type(amount, jnp.int32)
    return roll_p.bind(x, amount, shift=None, **params)  # type: ignore[no-any-return]


def _roll_reference(ctx: ReferenceContext, x: Any, *dynamic_shift: Any, shift: int | None,
                    axis: int, stride: int | None, stride_axis: int | None) -> Any:
    amount: Any = dynamic_shift[0] if dynamic_shift else shift
    if stride is None or stride_axis is None:
        return jnp.roll(x, amount, axis)
    n = x.shape[axis]
    if n == 0:
        return x
    pos = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    k = lax.broadcasted_iota(jnp.int32, x.shape, stride_axis)
    per_slice = jnp.mod(jnp.mod(amount, n) + k * stride, n)  # stride < n: no overflow
    return jnp.take_along_axis(x, jnp.mod(pos - per_slice, n), axis=axis)


@rule(roll_p)
def _roll_lowering(lowering: Lowering, eqn: Any, x: ir.Value, *dynamic_shift: ir.Value
                   ) -> ir.Value:
    p = eqn.params
    if not mir.shape_of(x):
        raise lowering.fail("pltpu.roll of a scalar")
    n = mir.shape_of(x)[p["axis"]]
    if dynamic_shift:
        # Brought into [0, n) as a static shift is: (s mod n + n) mod n, on the scalar unit.
        size = mir.constant(n, np.int32)
        rem = arith.RemSIOp(dynamic_shift[0], size).result
        negative = arith.CmpIOp(arith.CmpIPredicate.slt, rem, mir.constant(0, np.int32)).result
        amount = arith.SelectOp(negative, arith.AddIOp(rem, size).result, rem).result
    else:
        # jaxlib's Mosaic dialect has no static rotate op: a constant amount (as JAX emits).
        amount = mir.constant(p["shift"], np.int32)
    strided = {} if p["stride"] is None else {"stride": p["stride"],
                                               "stride_dimension": p["stride_axis"]}
    return tpu.DynamicRotateOp(x, amount, p["axis"], **strided).result


# --- bitcast ---------------------------------------------------------------------------------

bitcast_p = plb.Primitive("tpu_bitcast")


def _bits(dtype: Any) -> int:
    dt = jnp.dtype(dtype)
    info = jnp.finfo(dt) if jnp.issubdtype(dt, jnp.floating) else (
        jnp.iinfo(dt) if jnp.issubdtype(dt, jnp.integer) else None)
    if info is None or dt == jnp.bool_ or info.bits != dt.itemsize * 8 or info.bits not in (
            8, 16, 32):
        raise UnsupportedError(
            f"pltpu.bitcast supports 8-, 16- and 32-bit integer and floating types, found "
            f"{dt}. Fix: convert booleans with .astype(jnp.int32); TPUs have no 64-bit "
            "types; use 8-bit types for sub-byte data.")
    return int(info.bits)


def _bitcast_shape(shape: Sequence[int], src: Any, dst: Any) -> tuple[int, ...]:
    out = list(shape)
    out[-2] = out[-2] * _bits(src) // _bits(dst)
    return tuple(out)


@bitcast_p.def_abstract_eval
def _bitcast_abstract_eval(x: Any, *, ty: Any) -> Any:
    return plb.ShapedArray(_bitcast_shape(x.shape, x.dtype, ty), ty)


def bitcast(x: jax.Array, ty: Any) -> jax.Array:
    """The bits of ``x`` (rank >= 2) reinterpreted as dtype ``ty``.

    The second-to-last dimension scales by ``bits(x.dtype) / bits(ty)``: bitcasting
    ``(16, 128)`` bfloat16 to int32 gives ``(8, 128)``, rows ``2r`` and ``2r + 1`` packed into
    row ``r`` (row ``2r`` in the low 16 bits). That dimension must divide evenly.
    """
    x = jnp.asarray(x)
    ty = jnp.dtype(ty)
    if x.ndim < 2:
        raise PallasError(f"pltpu.bitcast needs an array of rank >= 2, found shape {x.shape}. "
                          "Fix: reshape to (1, n) first.")
    src_bits, dst_bits = _bits(x.dtype), _bits(ty)
    if x.shape[-2] * src_bits % dst_bits:
        raise PallasError(
            f"pltpu.bitcast from {x.dtype} to {ty}: the second-to-last dimension "
            f"({x.shape[-2]}) times {src_bits} bits is not a multiple of {dst_bits} bits, so "
            f"its rows cannot be packed. Fix: make it a multiple of {dst_bits // src_bits}.")
    return bitcast_p.bind(x, ty=ty)  # type: ignore[no-any-return]


def _bitcast_reference(ctx: ReferenceContext, x: Any, *, ty: Any) -> Any:
    src_bits, dst_bits = _bits(x.dtype), _bits(ty)
    *lead, m, n = x.shape
    if src_bits < dst_bits:  # p consecutive rows become the parts of one row
        p = dst_bits // src_bits
        parts = jnp.moveaxis(x.reshape(*lead, m // p, p, n), -2, -1)
        return lax.bitcast_convert_type(parts, ty)
    if src_bits > dst_bits:  # each row's parts become p consecutive rows
        p = src_bits // dst_bits
        parts = lax.bitcast_convert_type(x, ty)  # (..., m, n, p)
        return jnp.moveaxis(parts, -1, -2).reshape(*lead, m * p, n)
    return lax.bitcast_convert_type(x, ty)


@rule(bitcast_p)
def _bitcast_lowering(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    out = eqn.outvars[0].aval
    return tpu.BitcastOp(mir.value_type(out.shape, out.dtype), x).result


# --- the hardware PRNG -----------------------------------------------------------------------


class PRNGEffect(plb.Effect):
    """Seeding and drawing change the core's PRNG state: keeps them in the kernel, in order."""


prng_effect = PRNGEffect()
plb.register_side_effect(PRNGEffect)

prng_seed_p = plb.Primitive("tpu_prng_seed")
prng_seed_p.multiple_results = True
prng_seed_p.def_effectful_abstract_eval(lambda *seeds: ([], {prng_effect}))

prng_random_bits_p = plb.Primitive("tpu_prng_random_bits")
prng_random_bits_p.def_effectful_abstract_eval(
    lambda *, shape: (plb.ShapedArray(shape, jnp.int32), {prng_effect}))


def _seed_value(seed: Any) -> Any:
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        if not -2**31 <= int(seed) < 2**32:
            raise PallasError(f"pltpu.prng_seed: the seed {seed} does not fit in 32 bits. Fix: "
                              "split it into several 32-bit seeds.")
        return jnp.asarray(np.array(int(seed) % 2**32, np.uint32).view(np.int32))
    value = jnp.asarray(seed)
    if (value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer)
            or value.dtype.itemsize > 4):
        raise PallasError(
            f"pltpu.prng_seed takes integer scalars of at most 32 bits, found "
            f"{value.dtype}{list(value.shape)}. Fix: pass Python ints or int32 scalars (e.g. "
            "seed_ref[0], pl.program_id(0)); for a jax.random key, pass the words of "
            "jax.random.key_data(key) one by one.")
    return value if value.dtype == jnp.int32 else lax.convert_element_type(value, jnp.int32)


def prng_seed(*seeds: int | jax.Array) -> None:
    """Seeds the core's PRNG with one or more 32-bit integer scalars (mixed together).

    Seed in every grid step, with the step in the seed (``prng_seed(seed, pl.program_id(0))``)
    so that steps draw different bits whatever order and core they run on.
    """
    if not seeds:
        raise PallasError("pltpu.prng_seed needs at least one seed. Fix: prng_seed(seed).")
    prng_seed_p.bind(*(_seed_value(s) for s in seeds))


def prng_random_bits(shape: Sequence[int]) -> jax.Array:
    """An int32 array of ``shape`` of random bits from the core's PRNG (seed it first)."""
    dims = tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise PallasError(f"pltpu.prng_random_bits needs a static shape of non-negative ints, "
                          f"found {shape!r}.")
    return prng_random_bits_p.bind(  # type: ignore[no-any-return]
        shape=tuple(int(d) for d in dims))


@dataclasses.dataclass
class _Stream:
    """The interpreter's PRNG state in one grid step: a key, and the trace it lives in."""

    key: Any
    trace: Any


class _Streams:
    """The PRNG state of each grid step being evaluated, by its ``ReferenceContext``.

    The interpreter makes one context per grid step and passes it, unchanged, to every rule
    of that step (nested bodies included); a state is forgotten with its context.
    """

    def __init__(self) -> None:
        # No lock: single dict operations are atomic, and the weakref callback may run from
        # the garbage collector at any point (a lock held there could deadlock).
        self._entries: dict[int, tuple[weakref.ref[Any], _Stream]] = {}

    def get(self, ctx: Any) -> _Stream | None:
        entry = self._entries.get(id(ctx))
        return entry[1] if entry is not None and entry[0]() is ctx else None

    def set(self, ctx: Any, stream: _Stream) -> None:
        key = id(ctx)

        def forget(ref: weakref.ref[Any]) -> None:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:
                self._entries.pop(key, None)

        self._entries[key] = (weakref.ref(ctx, forget), stream)


_STREAMS = _Streams()


def _prng_seed_reference(ctx: ReferenceContext, *seeds: Any) -> list[Any]:
    key = jax.random.key(0, impl="threefry2x32")
    for s in seeds:
        key = jax.random.fold_in(key, lax.convert_element_type(s, jnp.uint32))
    _STREAMS.set(ctx, _Stream(key, jex_core.get_opaque_trace_state()))
    return []


def _prng_random_bits_reference(ctx: ReferenceContext, *, shape: tuple[int, ...]) -> Any:
    stream = _STREAMS.get(ctx)
    if stream is None:
        raise PallasError(
            f"pltpu.prng_random_bits({shape}) draws before pltpu.prng_seed in this grid step: "
            "the hardware PRNG's state is undefined until it is seeded, and the interpreter "
            "keeps the state of one grid step only. Fix: call pltpu.prng_seed(...) earlier "
            "in the kernel, in every grid step (e.g. prng_seed(seed, pl.program_id(0))).")
    if stream.trace != jex_core.get_opaque_trace_state():
        raise UnsupportedError(
            f"pltpu.prng_random_bits({shape}) draws from a PRNG state seeded in another "
            "control-flow scope: outside the loop body or branch it runs in, inside a body or "
            "branch it runs after, or in another branch (pl.when on program_id included). The "
            "interpreter runs lax.fori_loop/while_loop/scan bodies, and lax.cond/pl.when "
            "branches on a traced condition, as traced functions, and cannot carry the PRNG "
            "state into or out of them: the bits would repeat or be wrong. Fix: call "
            "pltpu.prng_seed in the same body or branch before drawing (e.g. "
            "prng_seed(seed, pl.program_id(0), i) inside a loop over i), draw the bits before "
            "the loop or branch, or use a Python for loop.")
    stream.key, sub = jax.random.split(stream.key)
    return lax.bitcast_convert_type(jax.random.bits(sub, shape, jnp.uint32), jnp.int32)


@rule(prng_seed_p)
def _prng_seed_lowering(lowering: Lowering, eqn: Any, *seeds: ir.Value) -> list[Any]:
    tpu.PRNGSeed32Op(list(seeds))
    return []


@rule(prng_random_bits_p)
def _prng_random_bits_lowering(lowering: Lowering, eqn: Any) -> ir.Value:
    shape = eqn.params["shape"]
    if len(shape) < 2:
        raise lowering.fail(f"pltpu.prng_random_bits of rank {len(shape)} (shape {shape}; "
                            "Mosaic draws rank >= 2: draw (1, n) and reshape)")
    return tpu.PRNGRandomBitsOp(mir.value_type(shape, jnp.int32)).result


# --- repeat --------------------------------------------------------------------------------


def repeat(x: jax.Array, repeats: int, axis: int) -> jax.Array:
    """``repeats`` copies of ``x`` side by side along ``axis`` (``jnp.tile`` along one axis;
    lowered to ``tpu.concatenate``, as JAX's ``pltpu.repeat``)."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise PallasError("pltpu.repeat needs an array of rank >= 1, found a scalar.")
    if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
        raise PallasError(f"pltpu.repeat: repeats must be a positive Python int, found "
                          f"{repeats!r}.")
    axis = _normalized_axis(axis, x.ndim, "axis", "repeat")
    return jnp.tile(x, [int(repeats) if d == axis else 1 for d in range(x.ndim)])


# --- masked loads and stores --------------------------------------------------------------


def load(ref: Any, *, mask: jax.Array | None = None) -> jax.Array:
    """Reads all of ``ref`` (a Ref or a view ``ref.at[...]``); with ``mask`` (a bool array of
    the view's shape), only the elements where it is True are read and the others are
    undefined. Without a mask this is ``ref[...]``."""
    return pl.load(ref, ..., mask=mask)


def store(ref: Any, val: jax.Array, *, mask: jax.Array | None = None) -> None:
    """Writes ``val`` to all of ``ref`` (a Ref or a view ``ref.at[...]``); with ``mask``, only
    where it is True (elements of the view where it is False may lie outside the Ref). Without
    a mask this is ``ref[...] = val``."""
    pl.store(ref, ..., val, mask=mask)


SEMANTICS: tuple[PrimitiveSemantics, ...] = (
    PrimitiveSemantics(roll_p, evaluate=_roll_reference),
    PrimitiveSemantics(bitcast_p, evaluate=_bitcast_reference),
    PrimitiveSemantics(prng_seed_p, evaluate=_prng_seed_reference),
    PrimitiveSemantics(prng_random_bits_p, evaluate=_prng_random_bits_reference),
)
