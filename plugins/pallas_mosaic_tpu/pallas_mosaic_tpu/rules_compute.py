"""Mosaic TPU's rules for compute beyond the shared elementwise rules: ``dot_general`` on the
MXU (and matrix-vector products as multiply and sum), ``argmax``/``argmin``
(``tpu.reduce_index``), ``jnp.take_along_axis`` (``tpu.dynamic_gather``), ``lax.top_k`` and
``lax.approx_max_k`` (expanded by :mod:`pallas_mosaic_tpu.topk`), convolutions (``tpu.conv``),
the approximate reciprocal, ``lax.reduce_precision`` and the ``pl.multiple_of`` hint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, vector
from jaxlib.mosaic.python import tpu

from pallas_core import backend as plb
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.registry import DIALECT, Lowering, in_aval, lower_jaxpr, out_aval, rule

_PRECISION = {lax.Precision.HIGH: "#tpu.contract_precision<bf16x3>",
              lax.Precision.HIGHEST: "#tpu.contract_precision<fp32>"}
"""The ``tpu.matmul`` precision of ``dot_general``'s; DEFAULT (and none) is Mosaic's own."""


@rule(lax.dot_general_p)
def _dot(lowering: Lowering, eqn: Any, a: ir.Value, b: ir.Value) -> ir.Value:
    """``dot_general`` with any contracting and batch dimensions: ``tpu.matmul`` with
    dimension numbers naming them (its result ordered batch, lhs free, rhs free, as
    ``dot_general``'s), except a product with a one-row rhs of narrow floats, which is a
    matrix-vector product: multiply and sum, as JAX's lowering does."""
    (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
    lhs, rhs, out = in_aval(eqn, 0), in_aval(eqn, 1), out_aval(eqn)
    if any(mir.is_unsigned(x.dtype) for x in (lhs, rhs)):
        raise lowering.fail("dot_general of unsigned integers (the MXU reads integers as "
                            "signed; cast them to a signed type first)")
    if (tuple(ca), tuple(cb)) == ((1,), (1,)) and len(lhs.shape) == len(rhs.shape) == 2 \
            and rhs.shape[0] == 1 and not (np.dtype(lhs.dtype) == np.dtype(rhs.dtype)
                                           == np.float32):
        return _matvec(lowering, eqn, a, b)
    lhs_free = sorted(set(range(len(lhs.shape))) - set(ca) - set(ba))
    rhs_free = sorted(set(range(len(rhs.shape))) - set(cb) - set(bb))
    order = [x for d in (*ba, *lhs_free) for x in (0, d)] + [x for d in rhs_free
                                                            for x in (1, d)]
    numbers = ir.Attribute.parse("#tpu.dot_dimension_numbers<" + ",".join(
        "[" + ", ".join(str(d) for d in dims) + "]"
        for dims in (ca, cb, lhs_free, rhs_free, order, ba, bb)) + ">")
    precision = eqn.params.get("precision")
    if isinstance(precision, tuple):
        if precision[0] != precision[1]:
            raise lowering.fail("dot_general with a precision for each operand")
        precision = precision[0]
    if precision not in (None, lax.Precision.DEFAULT, *_PRECISION):
        raise lowering.fail(f"dot_general with precision {precision}")
    # Mosaic's matmul accumulates in 32 bits (a narrower accumulator does not verify, and
    # JAX's lowering emits one): a narrower result is the 32-bit product, narrowed.
    dtype = np.dtype(out.dtype)
    wide = dtype if dtype.itemsize >= 4 else np.dtype(
        np.float32 if mir.is_float(dtype) else np.int32)
    acc = mir.constant(0, wide, out.shape)
    kw = {"precision": ir.Attribute.parse(_PRECISION[precision])} \
        if precision in _PRECISION else {}
    product = tpu.MatmulOp(mir.value_type(out.shape, wide), a, b, acc,
                           transpose_lhs_hint=False, dimension_numbers=numbers, **kw).result
    if wide == dtype:
        return product
    return plb.convert_dtype(DIALECT, product, wide, dtype, out.shape)


def _matvec(lowering: Lowering, eqn: Any, a: ir.Value, b: ir.Value) -> ir.Value:
    """(M, K) . (1, K)^T of narrow floats: both broadcast to the result's rows by K, widened to
    the result's type, multiplied and summed along K (as JAX's lowering has it)."""
    lhs, rhs, out = in_aval(eqn, 0), in_aval(eqn, 1), out_aval(eqn)
    shape = tuple(np.broadcast_shapes(lhs.shape, out.shape))
    if lhs.shape != rhs.shape:
        if tuple(lhs.shape) != shape:
            a = vector.BroadcastOp(mir.value_type(shape, lhs.dtype), a).result
        if tuple(rhs.shape) != shape:
            b = vector.BroadcastOp(mir.value_type(shape, rhs.dtype), b).result
    wide = out.dtype
    if np.dtype(wide) != np.float32 and np.dtype(wide) not in (np.dtype(lhs.dtype),
                                                               np.dtype(rhs.dtype)):
        raise lowering.fail(f"a matrix-vector dot_general into {np.dtype(wide)}")
    if np.dtype(lhs.dtype) != np.dtype(wide):
        a = arith.ExtFOp(mir.value_type(shape, wide), a).result
    if np.dtype(rhs.dtype) != np.dtype(wide):
        b = arith.ExtFOp(mir.value_type(shape, wide), b).result
    acc = mir.constant(0, wide, (lhs.shape[0],))
    summed = vector.MultiDimReductionOp(ir.Attribute.parse("#vector.kind<add>"),
                                        arith.MulFOp(a, b).result, acc, [1]).result
    return vector.ShapeCastOp(mir.value_type(out.shape, out.dtype), summed).result


_REDUCE_INDEX = {("float32", "int32")} | ({("bfloat16", "int16"), ("bfloat16", "int32")}
                                           if jax.__version_info__ >= (0, 11) else set())
"""(input, index) dtypes of ``tpu.reduce_index`` in the installed jaxlib (its own index type is
int16 for bfloat16 input, from JAX 0.11 on, and int32 for float32)."""


def _reduce_index(lowering: Lowering, eqn: Any, x: ir.Value, kind: str) -> ir.Value:
    """``jnp.argmax``/``argmin`` along one axis: ``tpu.reduce_index`` (a 1-D input is seen as
    one row), its int16 index widened where int32 is asked for."""
    src, out = in_aval(eqn), out_aval(eqn)
    axes = tuple(eqn.params["axes"])
    index = np.dtype(eqn.params["index_dtype"]).name
    if (np.dtype(src.dtype).name, index) not in _REDUCE_INDEX or len(axes) != 1:
        name = kind.replace("_", "")
        raise lowering.fail(f"jnp.{name} of {np.dtype(src.dtype).name} to {index} indices "
                            f"over axes {axes} (tpu.reduce_index takes "
                            f"{sorted(_REDUCE_INDEX)} (input, index) dtypes, along one axis)")
    axis, out_shape = axes[0], tuple(out.shape)
    if len(src.shape) == 1:
        x = vector.ShapeCastOp(mir.value_type((1, *src.shape), src.dtype), x).result
        axis, out_shape = axis + 1, (1, *out_shape)
    native = np.int16 if np.dtype(src.dtype).name == "bfloat16" else np.int32
    result = tpu.ReduceIndexOp(mir.value_type(out_shape, native), x, axis,
                               ir.Attribute.parse(f"#tpu.reduction_kind<{kind}>")).result
    if np.dtype(out.dtype) != native:
        result = arith.ExtSIOp(mir.value_type(out_shape, out.dtype), result).result
    if len(src.shape) == 1:
        result = vector.ExtractOp(result, [], [0]).result
    return result


@rule(lax.argmax_p)
def _argmax(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return _reduce_index(lowering, eqn, x, "arg_max")


@rule(lax.argmin_p)
def _argmin(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    return _reduce_index(lowering, eqn, x, "arg_min")


_GATHER_MODES = (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@rule(lax.gather_p)
def _gather(lowering: Lowering, eqn: Any, x: ir.Value, indices: ir.Value) -> ir.Value:
    """``jnp.take_along_axis`` along one of the two minor dimensions: ``tpu.dynamic_gather``
    of the indices without the trailing unit dimension that ``take_along_axis`` appends (the
    one gather form Mosaic has)."""
    src, idx, out = in_aval(eqn), in_aval(eqn, 1), out_aval(eqn)
    rank, p = len(out.shape), eqn.params
    dn = p["dimension_numbers"]
    axes = tuple(dn.collapsed_slice_dims)
    like_take_along_axis = (
        len(src.shape) == rank and tuple(idx.shape) == (*out.shape, 1)
        and tuple(p["slice_sizes"]) == (1,) * rank and p["mode"] in _GATHER_MODES
        and not dn.offset_dims and axes == tuple(dn.start_index_map) and len(axes) == 1
        and tuple(dn.operand_batching_dims) == tuple(dn.start_indices_batching_dims)
        and len(dn.operand_batching_dims) == rank - 1)
    if not like_take_along_axis:
        raise lowering.fail(
            f"lax.gather with {dn} and slice sizes {tuple(p['slice_sizes'])} (Mosaic gathers "
            "only as jnp.take_along_axis(x, indices, axis) does, with indices of x's shape "
            "and mode 'fill' or 'promise_in_bounds')")
    if axes[0] < rank - 2:
        raise lowering.fail(f"jnp.take_along_axis along axis {axes[0]} of a rank-{rank} "
                            "array (Mosaic gathers along the two minor dimensions only; "
                            "move the axis there with jnp.swapaxes)")
    recovered = vector.ShapeCastOp(mir.value_type(out.shape, idx.dtype), indices).result
    return tpu.DynamicGatherOp(x, recovered, list(axes)).result


def _top_k_dtype(lowering: Lowering, eqn: Any, what: str) -> None:
    """JAX's conditions on a top-k's input: float32 (TPU v4 on) or bfloat16 (v6 on)."""
    from pallas_mosaic_tpu.tpu_info import get_tpu_info

    dtype = np.dtype(in_aval(eqn).dtype)
    if dtype.name not in ("float32", "bfloat16"):
        raise lowering.fail(f"{what} of {dtype.name} (Mosaic takes float32 and bfloat16)")
    needs = 4 if dtype.name == "float32" else 6
    info = get_tpu_info()
    if info.generation < needs:
        raise lowering.fail(f"{what} of {dtype.name} on {info.chip_version} (from TPU "
                            f"generation {needs} on; pass target= a later chip)")


def _lower_expansion(lowering: Lowering, eqn: Any, x: ir.Value, fn: Any,
                     **params: Any) -> list[Any]:
    """``fn(x, **params)`` (``pallas_mosaic_tpu.topk``) traced on ``eqn``'s operand and
    lowered in the equation's place."""
    from pallas_mosaic_tpu import topk

    jaxpr = topk.expansion(fn, in_aval(eqn), **params)
    return lower_jaxpr(lowering, jaxpr.jaxpr, jaxpr.consts, [x])


@rule(lax.top_k_p)
def _top_k(lowering: Lowering, eqn: Any, x: ir.Value) -> list[Any]:
    """``lax.top_k(x, k, is_stable=False)``: ``k`` rounds of ``argmax`` and masking, as JAX
    lowers it (``pallas_mosaic_tpu.topk``)."""
    from pallas_mosaic_tpu import topk

    if eqn.params.get("is_stable", True):
        raise lowering.fail("lax.top_k with is_stable=True (ties at -inf can repeat an index "
                            "in the rounds of argmax Mosaic takes the top k with; JAX's "
                            "lowering asks the same). Fix: lax.top_k(x, k, is_stable=False)")
    _top_k_dtype(lowering, eqn, "lax.top_k")
    return _lower_expansion(lowering, eqn, x, topk.top_k, k=eqn.params["k"],
                            axis=eqn.params.get("axis", -1))


@rule(lax.approx_top_k_p)
def _approx_top_k(lowering: Lowering, eqn: Any, x: ir.Value) -> list[Any]:
    """``lax.approx_max_k``: the top k of per-bin maxima, as JAX lowers it."""
    from pallas_mosaic_tpu import topk

    p = eqn.params
    _top_k_dtype(lowering, eqn, "lax.approx_max_k")
    if not p["is_max_k"]:
        raise lowering.fail("lax.approx_min_k (Mosaic's lowering takes the largest k only, as "
                            "JAX's does). Fix: lax.approx_max_k(-x, k) and negate the values")
    if not p["aggregate_to_topk"]:
        raise lowering.fail("lax.approx_max_k with aggregate_to_topk=False (as JAX's lowering, "
                            "this one returns the top k themselves)")
    if not 0.0 < p["recall_target"] <= 1.0:
        raise lowering.fail(f"lax.approx_max_k with recall_target={p['recall_target']} "
                            "(expected a value in (0, 1])")
    return _lower_expansion(lowering, eqn, x, topk.approx_max_k, k=p["k"],
                            axis=p["reduction_dimension"], recall_target=p["recall_target"])


def _conv_precision(lowering: Lowering, precision: Any) -> ir.Attribute | None:
    if isinstance(precision, tuple):
        if precision[0] != precision[1]:
            raise lowering.fail(f"a convolution with per-operand precision {precision}")
        precision = precision[0]
    if precision is None or precision == lax.Precision.DEFAULT:
        return None
    if precision == lax.Precision.HIGHEST:
        return ir.Attribute.parse("#tpu.contract_precision<fp32>")
    raise lowering.fail(f"a convolution with precision {precision} (Mosaic takes DEFAULT or "
                        "HIGHEST)")


@rule(lax.conv_general_dilated_p)
def _conv(lowering: Lowering, eqn: Any, lhs: ir.Value, rhs: ir.Value) -> ir.Value:
    """``lax.conv_general_dilated`` (and ``pltpu.conv``) as JAX lowers it: ``tpu.conv`` into a
    zero accumulator, with JAX's dimension numbers, strides, padding and dilations."""
    if not hasattr(tpu, "ConvOp"):
        raise lowering.fail("a convolution with this jaxlib (tpu.conv is new in JAX 0.11, and "
                            "JAX's lowering has no rule for it before)")
    p = eqn.params
    for aval in (in_aval(eqn), in_aval(eqn, 1)):
        if mir.is_unsigned(aval.dtype):
            raise lowering.fail(f"a convolution of {np.dtype(aval.dtype).name} (Mosaic's takes "
                                "floats and signed integers)")
    out = out_aval(eqn)
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec

    def dims(ds: Sequence[int]) -> str:
        return "[" + ", ".join(str(d) for d in ds) + "]"

    dimension_numbers = ir.Attribute.parse(
        f"#tpu.conv_dimension_numbers<{lhs_spec[0]}, {lhs_spec[1]}, {dims(lhs_spec[2:])}, "
        f"{rhs_spec[1]}, {rhs_spec[0]}, {dims(rhs_spec[2:])}, {out_spec[0]}, {out_spec[1]}, "
        f"{dims(out_spec[2:])}>")
    spatial = len(lhs_spec) - 2
    acc = mir.constant(0, out.dtype, out.shape)
    return tpu.ConvOp(
        mir.value_type(out.shape, out.dtype), lhs, rhs, acc, dimension_numbers,
        [int(x) for x in p["window_strides"] or (1,) * spatial],
        [int(x) for pair in (p["padding"] or ((0, 0),) * spatial) for x in pair],
        [int(x) for x in p["lhs_dilation"] or (1,) * spatial],
        [int(x) for x in p["rhs_dilation"] or (1,) * spatial], [False] * spatial,
        feature_group_count=p["feature_group_count"],
        batch_group_count=p["batch_group_count"],
        precision=_conv_precision(lowering, p.get("precision"))).result


@rule(plb.multiple_of_p)
def _multiple_of(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    """``pl.multiple_of``: Mosaic's alignment hint, ``tpu.assume_multiple``, as JAX emits it."""
    if not isinstance(x, ir.Value):
        return x
    for multiple in eqn.params["values"]:
        x = tpu.AssumeMultipleOp(x, int(multiple)).result
    return x


@rule(plb.reciprocal_p)
def _approx_reciprocal(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    aval = in_aval(eqn)
    if np.dtype(aval.dtype) != np.float32 or not aval.shape:
        raise lowering.fail(f"pl.reciprocal(approx=True) of {aval.str_short()} (Mosaic's "
                            "approximate reciprocal takes float32 vectors)", eqn)
    full_range = {} if eqn.params["full_range"] else {"full_range": False}
    return tpu.ReciprocalOp(x, approx=True, **full_range).result


_REDUCE_PRECISION = hasattr(tpu, "ReducePrecisionOp")
"""Whether the installed jaxlib has ``tpu.reduce_precision`` (JAX 0.11 on)."""


@rule(lax.reduce_precision_p)
def _reduce_precision(lowering: Lowering, eqn: Any, x: ir.Value) -> ir.Value:
    if not _REDUCE_PRECISION:
        raise lowering.fail(f"lax.reduce_precision of {np.dtype(in_aval(eqn).dtype).name} with "
                            "this jaxlib (tpu.reduce_precision is new in JAX 0.11, and JAX's "
                            "lowering refuses it before)")
    if not mir.shape_of(x):
        raise lowering.fail("lax.reduce_precision of a scalar (tpu.reduce_precision takes "
                            "vectors; reduce a one-element array)")
    p = eqn.params
    return tpu.ReducePrecisionOp(x, p["exponent_bits"], p["mantissa_bits"]).result
