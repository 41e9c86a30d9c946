"""Elementwise bit operations of ``jax.experimental.pallas.tpu``, each with reference semantics
for the interpreter and, where JAX lowers it to one op, a Mosaic lowering rule.

* ``pack_elementwise(xs, *, packed_dtype)``: ``k`` arrays (``k`` = their bit width over
  ``packed_dtype``'s) narrowed to ``packed_dtype`` and packed into one unsigned word per
  element, ``xs[0]`` in the least significant bits (``tpu.pack_elementwise``). Floats
  (float32 -> bfloat16) round to nearest even; integers keep their low bits.
* ``unpack_elementwise(x, *, index, packed_dtype, unpacked_dtype)``: part ``index`` of each
  word of ``x`` read as ``packed_dtype`` (signed integers sign-extend) and converted to
  ``unpacked_dtype``, whose bit width is ``x``'s (``tpu.unpack_elementwise``).
* ``stochastic_round(x, random_bits, *, target_dtype)``: float32 rounded to ``target_dtype``
  (bfloat16, the 8-bit floats, int4) up or down at random (``tpu.stochastic_convert``): to
  the neighbour away from zero when ``u < (|x| - |lo|) / (|hi| - |lo|)``, ``u`` being the
  top 24 bits of ``random_bits`` over 2**24, ``lo`` and ``hi`` the representable values around
  ``x`` (towards and away from zero). Values past the largest finite one saturate to it;
  NaN and infinities convert as ``astype`` does. The TPU's own use of the bits is not
  documented, so the interpreter's draws differ from a TPU's for the same bits; the
  distribution is the same.
* ``split_bits``/``join_bits`` and ``pack_fp6``/``unpack_fp6`` (JAX 0.12's helpers): 8-bit
  words cut into, or made of, 2- and 4-bit fields, built on the above and ``jnp`` bit ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mosaic.python import tpu

from pallas_core import backend as plb
from pallas_core.backend import PallasError, PrimitiveSemantics, ReferenceContext
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.registry import Lowering, rule


def _bits(dtype: Any) -> int:
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating):
        return int(jnp.finfo(dt).bits)
    if jnp.issubdtype(dt, jnp.integer):
        return int(jnp.iinfo(dt).bits)
    raise PallasError(f"expected an integer or floating dtype, found {dt}.")


def _uint(bits: int) -> Any:
    return jnp.dtype(f"uint{bits}")


def _as_uint(x: Any) -> Any:
    """The bits of ``x`` as unsigned integers of its width."""
    bits = _bits(x.dtype)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(_uint(bits)) if bits >= 8 else x.astype(jnp.int8).astype(jnp.uint8) & (
            (1 << bits) - 1)
    return lax.bitcast_convert_type(x, _uint(bits))


def _factor(unpacked: Any, packed: Any, fn: str) -> int:
    u, p = _bits(unpacked), _bits(packed)
    if u % p:
        raise PallasError(f"pltpu.{fn}: {jnp.dtype(unpacked)} ({u} bits) is not a whole number "
                          f"of {jnp.dtype(packed)} ({p} bits).")
    return u // p


# --- pack_elementwise / unpack_elementwise -----------------------------------------------------

pack_elementwise_p = plb.Primitive("tpu_pack_elementwise")


@pack_elementwise_p.def_abstract_eval
def _pack_abstract_eval(*xs: Any, packed_dtype: Any) -> Any:
    return plb.ShapedArray(xs[0].shape, _uint(_bits(xs[0].dtype)))


def pack_elementwise(xs: Sequence[jax.Array], *, packed_dtype: Any) -> jax.Array:
    """``xs`` narrowed to ``packed_dtype`` and packed, ``xs[0]`` lowest, into one unsigned
    integer per element of their bit width (float32 -> bfloat16 or integer -> narrower
    integer; ``len(xs)`` must be the ratio of the widths)."""
    xs = [jnp.asarray(x) for x in xs]
    if not xs:
        raise PallasError("pltpu.pack_elementwise needs at least one array.")
    first = xs[0]
    if any(x.shape != first.shape or x.dtype != first.dtype for x in xs):
        raise PallasError("pltpu.pack_elementwise: the arrays must share one shape and dtype, "
                          f"found {[f'{x.dtype}{list(x.shape)}' for x in xs]}.")
    packed = jnp.dtype(packed_dtype)
    floats = first.dtype == jnp.float32 and packed == jnp.bfloat16
    ints = jnp.issubdtype(first.dtype, jnp.integer) and jnp.issubdtype(packed, jnp.integer)
    if not (floats or ints):
        raise PallasError(f"pltpu.pack_elementwise packs float32 into bfloat16 or integers into "
                          f"narrower integers, found {first.dtype} into {packed}.")
    k = _factor(first.dtype, packed, "pack_elementwise")
    if len(xs) != k:
        raise PallasError(f"pltpu.pack_elementwise: {first.dtype} holds {k} {packed} values, "
                          f"found {len(xs)} arrays. Fix: pass {k}.")
    return pack_elementwise_p.bind(*xs, packed_dtype=packed)  # type: ignore[no-any-return]


def _pack_reference(ctx: ReferenceContext, *xs: Any, packed_dtype: Any) -> Any:
    width, part = _bits(xs[0].dtype), _bits(packed_dtype)
    out = jnp.zeros(xs[0].shape, _uint(width))
    for i, x in enumerate(xs):
        if jnp.issubdtype(x.dtype, jnp.floating):
            bits = _as_uint(x.astype(packed_dtype)).astype(out.dtype)
        else:
            bits = x.astype(out.dtype) & ((1 << part) - 1)
        out = out | (bits << (i * part))
    return out


@rule(pack_elementwise_p)
def _pack_lowering(lowering: Lowering, eqn: Any, *xs: ir.Value) -> ir.Value:
    out = eqn.outvars[0].aval
    return tpu.PackElementwiseOp(  # type: ignore[no-any-return]
        mir.value_type(out.shape, out.dtype), list(xs),
        mir.element_type(eqn.params["packed_dtype"])).result


unpack_elementwise_p = plb.Primitive("tpu_unpack_elementwise")
unpack_elementwise_p.def_abstract_eval(
    lambda x, *, index, packed_dtype, unpacked_dtype: plb.ShapedArray(x.shape, unpacked_dtype))


def unpack_elementwise(x: jax.Array, *, index: int, packed_dtype: Any,
                       unpacked_dtype: Any) -> jax.Array:
    """Part ``index`` (0 the least significant) of each element of ``x``, read as
    ``packed_dtype`` and converted to ``unpacked_dtype`` (as wide as ``x``'s dtype)."""
    x = jnp.asarray(x)
    packed, unpacked = jnp.dtype(packed_dtype), jnp.dtype(unpacked_dtype)
    if _bits(x.dtype) != _bits(unpacked):
        raise PallasError(f"pltpu.unpack_elementwise: unpacked_dtype {unpacked} must be as wide "
                          f"as x ({x.dtype}).")
    k = _factor(unpacked, packed, "unpack_elementwise")
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < k:
        raise PallasError(f"pltpu.unpack_elementwise: index must be an int in [0, {k}), found "
                          f"{index!r}.")
    if jnp.issubdtype(packed, jnp.floating) and _bits(packed) < 8:
        raise PallasError(f"pltpu.unpack_elementwise: unpacking {packed} (under 8 bits) is not "
                          "supported. Fix: unpack as int4 and convert.")
    return unpack_elementwise_p.bind(  # type: ignore[no-any-return]
        x, index=int(index), packed_dtype=packed, unpacked_dtype=unpacked)


def _unpack_reference(ctx: ReferenceContext, x: Any, *, index: int, packed_dtype: Any,
                      unpacked_dtype: Any) -> Any:
    part = _bits(packed_dtype)
    word = _as_uint(x)
    field = (word >> (index * part)) & ((1 << part) - 1)
    if jnp.issubdtype(packed_dtype, jnp.floating):
        value = lax.bitcast_convert_type(field.astype(_uint(part)), packed_dtype)
    elif jnp.issubdtype(packed_dtype, jnp.signedinteger):
        wide = field.astype(jnp.int64 if part > 16 else jnp.int32)
        value = jnp.where(wide >= (1 << (part - 1)), wide - (1 << part), wide)
    else:
        value = field
    return value.astype(unpacked_dtype)


@rule(unpack_elementwise_p)
def _unpack_lowering(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    p = eqn.params
    out = eqn.outvars[0].aval
    return tpu.UnpackElementwiseOp(  # type: ignore[no-any-return]
        mir.value_type(out.shape, out.dtype), x, mir.element_type(p["packed_dtype"]),
        p["index"]).result


# --- stochastic_round --------------------------------------------------------------------------

_ROUND_TARGETS = ("bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e4m3b11fnuz", "int4")
stochastic_round_p = plb.Primitive("tpu_stochastic_round")
stochastic_round_p.def_abstract_eval(
    lambda x, bits, *, target_dtype: plb.ShapedArray(x.shape, target_dtype))


def stochastic_round(x: jax.Array, random_bits: jax.Array, *, target_dtype: Any) -> jax.Array:
    """``x`` (float32) rounded to ``target_dtype`` up or down at random, so that the mean of
    many roundings is ``x``; ``random_bits`` (uint32, ``x``'s shape) decide each element."""
    x, random_bits = jnp.asarray(x), jnp.asarray(random_bits)
    target = jnp.dtype(target_dtype)
    if x.dtype != jnp.float32:
        raise PallasError(f"pltpu.stochastic_round rounds float32, found {x.dtype}.")
    if random_bits.shape != x.shape or random_bits.dtype != jnp.uint32:
        raise PallasError(f"pltpu.stochastic_round: random_bits must be uint32 of x's shape "
                          f"{list(x.shape)}, found {random_bits.dtype}{list(random_bits.shape)}.")
    if target.name not in _ROUND_TARGETS:
        raise PallasError(f"pltpu.stochastic_round: target_dtype {target} is not supported "
                          f"(one of {', '.join(_ROUND_TARGETS)}).")
    return stochastic_round_p.bind(x, random_bits,  # type: ignore[no-any-return]
                                   target_dtype=target)


def _step_away(t: Any, away: Any) -> Any:
    """``t`` (a float of a sign-magnitude format) moved one value away from zero where
    ``away``, and one towards zero elsewhere where it rounded past ``x``."""
    ubits = _as_uint(t)
    width = _bits(t.dtype)
    sign = ubits & (1 << (width - 1))
    mag = ubits & ((1 << (width - 1)) - 1)
    mag = jnp.where(away, mag + 1, jnp.where(mag > 0, mag - 1, mag))
    # Zero is +0 (the fnuz formats have no -0: that pattern is their NaN).
    out = jnp.where(mag == 0, jnp.zeros_like(ubits), sign | mag)
    return lax.bitcast_convert_type(out.astype(ubits.dtype), t.dtype)


def _stochastic_round_reference(ctx: ReferenceContext, x: Any, bits: Any, *,
                                target_dtype: Any) -> Any:
    u = (bits >> 8).astype(jnp.float32) * np.float32(2.0 ** -24)
    if jnp.issubdtype(target_dtype, jnp.integer):
        info = jnp.iinfo(target_dtype)
        lo = jnp.trunc(x)
        frac = jnp.abs(x - lo)
        out = lo + jnp.sign(x) * (u < frac).astype(jnp.float32)
        return jnp.clip(out, info.min, info.max).astype(target_dtype)
    finite_max = jnp.asarray(jnp.finfo(target_dtype).max, jnp.float32)
    clipped = jnp.clip(x, -finite_max, finite_max)
    t = clipped.astype(target_dtype)
    past = jnp.abs(t.astype(jnp.float32)) > jnp.abs(clipped)
    lo = jnp.where(past, _step_away(t, jnp.zeros(t.shape, bool)), t)
    at_max = jnp.abs(lo.astype(jnp.float32)) >= finite_max
    hi = jnp.where(at_max, lo, _step_away(lo, jnp.ones(t.shape, bool)))
    lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
    gap = jnp.abs(hi32) - jnp.abs(lo32)
    p = jnp.where(gap > 0, (jnp.abs(clipped) - jnp.abs(lo32)) / jnp.where(gap > 0, gap, 1), 0)
    out = jnp.where(u < p, hi, lo)
    return jnp.where(jnp.isfinite(x), out, x.astype(target_dtype))


@rule(stochastic_round_p)
def _stochastic_round_lowering(lowering: Lowering, eqn: Any, x: ir.Value,
                               bits: ir.Value) -> ir.Value:
    out = eqn.outvars[0].aval
    return tpu.StochasticConvertOp(  # type: ignore[no-any-return]
        mir.value_type(out.shape, out.dtype), x, bits).result


# --- 2- and 4-bit fields of bytes (JAX 0.12's helpers) ---------------------------------------


def split_bits(x: jax.Array, bitwidths: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """The fields of the bytes of ``x`` (int8 or uint8), lowest first: one array per entry of
    ``bitwidths`` (each 2 or 4, at most 8 in all), ``int2`` or ``int4``, holding those bits
    (read as two's complement)."""
    x = jnp.asarray(x)
    if _bits(x.dtype) != 8:
        raise PallasError(f"pltpu.split_bits takes an 8-bit array, found {x.dtype}.")
    if sum(bitwidths) > 8 or any(b not in (2, 4) for b in bitwidths):
        raise PallasError(f"pltpu.split_bits: bitwidths {tuple(bitwidths)} must each be 2 or 4, "
                          "at most 8 bits in all.")
    word = x.astype(jnp.uint8).astype(jnp.int32)
    fields, shift = [], 0
    for width in bitwidths:
        field = (word >> shift) & ((1 << width) - 1)
        signed = jnp.where(field >= (1 << (width - 1)), field - (1 << width), field)
        fields.append(signed.astype(jnp.int4 if width == 4 else jnp.int2))
        shift += width
    return tuple(fields)


def _field(x: Any, width: int, name: str) -> Any:
    x = jnp.asarray(x)
    if _bits(x.dtype) != width or not jnp.issubdtype(x.dtype, jnp.integer):
        raise PallasError(f"pltpu.join_bits: {name} must be a {width}-bit integer array, found "
                          f"{x.dtype}.")
    return x.astype(jnp.int32) & ((1 << width) - 1)


def join_bits(*, two_bits: jax.Array | None = None,
              four_bits: jax.Array | None = None) -> jax.Array:
    """An int8 array whose bytes hold ``four_bits`` in bits 3..0 and ``two_bits`` in bits
    5..4, the other bits zero; given one of them, it fills the lowest bits."""
    if two_bits is None and four_bits is None:
        raise PallasError("pltpu.join_bits needs two_bits, four_bits or both.")
    if two_bits is not None and four_bits is not None and (
            jnp.shape(two_bits) != jnp.shape(four_bits)):
        raise PallasError(f"pltpu.join_bits: two_bits {jnp.shape(two_bits)} and four_bits "
                          f"{jnp.shape(four_bits)} must have one shape.")
    if four_bits is None:
        return _field(two_bits, 2, "two_bits").astype(jnp.int8)
    low = _field(four_bits, 4, "four_bits")
    if two_bits is None:
        return low.astype(jnp.int8)
    return (low | (_field(two_bits, 2, "two_bits") << 4)).astype(jnp.int8)


def unpack_fp6(two_bits: jax.Array, four_bits: jax.Array) -> jax.Array:
    """6-bit values in bytes (int8) from their split layout: ``join_bits`` of both."""
    return join_bits(two_bits=two_bits, four_bits=four_bits)


def pack_fp6(fp6_in_8b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The split layout ``(two_bits, four_bits)`` (int2, int4) of 6-bit values held in the
    low bits of bytes: bits 5..4 and 3..0."""
    four, two = split_bits(fp6_in_8b, (4, 2))
    return two, four


SEMANTICS: tuple[PrimitiveSemantics, ...] = (
    PrimitiveSemantics(pack_elementwise_p, evaluate=_pack_reference),
    PrimitiveSemantics(unpack_elementwise_p, evaluate=_unpack_reference),
    PrimitiveSemantics(stochastic_round_p, evaluate=_stochastic_round_reference),
)
