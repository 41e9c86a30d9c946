"""Mosaic TPU's rules for the shape and layout of vectors: ``iota``, broadcasts, reshapes and
squeezes, ``jnp.tile``, slices and splits, concatenation, ``stack``/``unstack``, ``lax.pad``
and transposes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import vector
from jaxlib.mosaic.python import tpu

from pallas_core import backend as plb
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.registry import Lowering, in_aval, out_aval, rule


@rule(lax.iota_p)
def _iota(lowering: Lowering, eqn: Any, *_: Any) -> ir.Value:
    aval = out_aval(eqn)
    return tpu.IotaOp(mir.value_type(aval.shape, aval.dtype),
                      dimensions=[eqn.params["dimension"]]).result


@rule(lax.broadcast_in_dim_p)
def _broadcast_in_dim(lowering: Lowering, eqn: Any, x: ir.Value, *_: Any) -> ir.Value:
    shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    if mir.shape_of(x):
        expanded = [1] * len(shape)
        for src_axis, dst_axis in enumerate(dims):
            expanded[dst_axis] = mir.shape_of(x)[src_axis]
        x = vector.ShapeCastOp(mir.value_type(expanded, in_aval(eqn).dtype), x).result
    return mir.broadcast_to(x, shape)


@rule(plb.broadcast_to_p)
def _broadcast_to(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """The state primitive ``broadcast_to`` (NumPy's broadcast, missing leading dimensions
    added, as the Triton backend lowers it; JAX's Mosaic lowering refuses it)."""
    shape = tuple(eqn.params["shape"])
    src = mir.shape_of(x)
    if src and len(src) < len(shape):
        x = vector.ShapeCastOp(mir.value_type((1,) * (len(shape) - len(src)) + src,
                                              in_aval(eqn).dtype), x).result
    return mir.broadcast_to(x, shape)


@rule(lax.reshape_p, lax.squeeze_p)
def _reshape(lowering: Lowering, eqn: Any, x: ir.Value, *_: Any) -> ir.Value:
    out = out_aval(eqn)
    if not mir.shape_of(x):  # a scalar becomes a vector of one element
        return mir.broadcast_to(x, out.shape) if out.shape else x
    if not out.shape:  # the one element of a vector, as a scalar
        if np.dtype(out.dtype).itemsize != 4:
            raise lowering.fail(f"reshaping a {np.dtype(out.dtype).name} vector to a scalar "
                                "(Mosaic's scalars are 32-bit: cast to a 32-bit type first)")
        return vector.ExtractOp(x, [], [0] * len(mir.shape_of(x))).result
    return vector.ShapeCastOp(mir.value_type(out.shape, out.dtype), x).result


@rule(lax.tile_p)
def _tile(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """``jnp.tile``: copies of the vector side by side, one axis at a time."""
    if not mir.shape_of(x):
        raise lowering.fail("tiling a scalar")
    for axis, reps in enumerate(eqn.params["reps"]):
        if reps > 1:
            x = tpu.ConcatenateOp([x] * reps, axis).result
    return x


def _extract(x: ir.Value, aval: Any, starts: Sequence[int], sizes: Sequence[int],
             strides: Sequence[int]) -> ir.Value:
    return vector.ExtractStridedSliceOp(mir.value_type(aval.shape, aval.dtype), x,
                                        list(starts), list(sizes), list(strides)).result


@rule(lax.slice_p)
def _slice(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    p = eqn.params
    starts, limits = p["start_indices"], p["limit_indices"]
    strides = p["strides"] or [1] * len(starts)
    if not mir.shape_of(x):
        raise lowering.fail("slicing a scalar")
    return _extract(x, out_aval(eqn), starts, [b - a for a, b in zip(starts, limits)], strides)


@rule(lax.split_p)
def _split(lowering: Lowering, eqn: Any, x: ir.Value) -> list[ir.Value]:
    axis, shape = eqn.params["axis"], list(in_aval(eqn).shape)
    outs, start = [], 0
    for size, v in zip(eqn.params["sizes"], eqn.outvars):
        starts, sizes = [0] * len(shape), list(shape)
        starts[axis], sizes[axis] = start, size
        outs.append(_extract(x, v.aval, starts, sizes, [1] * len(shape)))
        start += size
    return outs


@rule(lax.concatenate_p)
def _concatenate(lowering: Lowering, eqn: Any, *xs: ir.Value) -> ir.Value:
    if len(xs) == 1:
        return xs[0]
    return tpu.ConcatenateOp(list(xs), eqn.params["dimension"]).result


@rule(plb.stack_p)
def _stack(lowering: Lowering, eqn: Any, *xs: ir.Value) -> ir.Value:
    axis, aval = eqn.params["axis"], in_aval(eqn)
    shape = list(aval.shape)
    shape.insert(axis, 1)
    one = mir.value_type(shape, aval.dtype)
    parts = [vector.ShapeCastOp(one, x).result if aval.shape else
             vector.BroadcastOp(one, x).result for x in xs]
    if len(parts) == 1:
        return parts[0]
    return tpu.ConcatenateOp(parts, axis).result


@rule(plb.unstack_p)
def _unstack(lowering: Lowering, eqn: Any, x: ir.Value) -> list[ir.Value]:
    axis, shape = eqn.params["axis"], list(in_aval(eqn).shape)
    outs = []
    for k, v in enumerate(eqn.outvars):
        starts, sizes = [0] * len(shape), list(shape)
        starts[axis], sizes[axis] = k, 1
        one = list(shape)
        one[axis] = 1
        piece = _extract(x, plb.ShapedArray(tuple(one), v.aval.dtype), starts, sizes,
                         [1] * len(shape))
        out = v.aval
        piece = (vector.ShapeCastOp(mir.value_type(out.shape, out.dtype), piece).result
                 if out.shape else vector.ExtractOp(piece, [], [0] * len(shape)).result)
        outs.append(piece)
    return outs


@rule(lax.pad_p)
def _pad(lowering: Lowering, eqn: Any, x: ir.Value, value: ir.Value) -> ir.Value:
    aval = in_aval(eqn)
    shape = list(aval.shape)
    for axis, (low, high, interior) in enumerate(eqn.params["padding_config"]):
        if interior or low < 0 or high < 0:
            raise lowering.fail("lax.pad with interior or negative padding")
        parts = []
        for n in (low, None, high):
            if n is None:
                parts.append(x)
            elif n:
                side = list(shape)
                side[axis] = n
                parts.append(mir.broadcast_to(value, side))
        shape[axis] += low + high
        if len(parts) > 1:
            x = tpu.ConcatenateOp(parts, axis).result
    return x


@rule(lax.transpose_p)
def _transpose(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    out = out_aval(eqn)
    return vector.TransposeOp(mir.value_type(out.shape, out.dtype), x,
                              list(eqn.params["permutation"])).result
