"""Lowering rules of the Mosaic GPU backend for values (registered in
:data:`pallas_mosaic_gpu.registry.RULES`, with its rule signature): elementwise ops, ``select_n``,
``iota``, broadcasts, reshapes, concatenation and reductions of register arrays
(``FragmentedArray``), and scalars through the rules ``pallas_core.mlir_rules`` shares among
backends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu

from pallas_core import backend as plb
from pallas_core.backend import UnsupportedError, mlir_element_type
from pallas_mosaic_gpu.registry import lower_jaxpr, rule
from pallas_mosaic_gpu.values import (
    FA,
    Expanded,
    GPULowering,
    layout_for,
    relayout,
    scalar_constant,
    signed,
    splat,
)

# --- elementwise -----------------------------------------------------------------------------


def _splat_like(x: Any, like: Any, dtype: Any) -> Any:
    if isinstance(x, FA) or not isinstance(like, FA):
        return x
    return splat(x, like.shape, dtype)


def _unexpand(state: GPULowering, eqn: Any, args: Sequence[Any]) -> tuple[list[Any], Any]:
    """Operands of an elementwise op, with :class:`Expanded` ones unwrapped (all alike)."""
    exp = [a for a in args if isinstance(a, Expanded)]
    if not exp:
        return list(args), None
    first = exp[0]
    out_shape = tuple(eqn.outvars[0].aval.shape)
    if any(isinstance(a, FA) for a in args) or any(e.shape != out_shape for e in exp):
        # (m, 1) against (m, n): the unit dimensions broadcast.
        return [_broadcast(state, a, out_shape) if isinstance(a, Expanded) else a
                for a in args], None
    if any(e.dims != first.dims for e in exp):
        raise state.fail("an elementwise op between arrays with unit dimensions in different "
                         "places")
    return [a.array if isinstance(a, Expanded) else a for a in args], first


def _broadcast(state: GPULowering, x: Expanded, shape: tuple[int, ...]) -> Any:
    try:
        return x.array.broadcast_in_dim(shape, x.dims, layout_for(shape))
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"broadcasting {x.array.shape} in layout {x.array.layout} to {shape} "
                         f"({e})") from None


def _rewrap(out: Any, like: Any) -> Any:
    return Expanded(out, like.shape, like.dims) if like is not None else out


# Scalars (SMEM values, loop indices) take the shared rules (``pallas_core.mlir_rules``);
# register arrays (FragmentedArray) take the rules below, which hand scalars to the shared ones.


def _no_reduction(state: GPULowering, eqn: Any, *_: Any) -> Any:
    raise state.fail(f"{eqn.primitive.name} of a scalar")


DIALECT = plb.Dialect(
    constant=lambda value, dtype, shape: (scalar_constant(value, dtype) if not tuple(shape)
                                          else _splat_constant(value, dtype, shape)),
    broadcast_to=lambda v, shape: v,
    value_type=lambda shape, dtype: mlir_element_type(dtype),
    lower_jaxpr=lambda state, jaxpr, consts, args: lower_jaxpr(state, jaxpr, consts, args),
    reduce=_no_reduction)
"""Mosaic GPU's scalars, for the shared rules."""
SHARED = plb.shared_rules_table(DIALECT)


def _splat_constant(value: Any, dtype: Any, shape: Sequence[int]) -> Any:
    raise UnsupportedError(f"a {np.dtype(dtype).name} constant of shape {tuple(shape)} in a "
                           "scalar rule of the 'mosaic_gpu' backend")


def _is_array(v: Any) -> bool:
    return isinstance(v, (FA, Expanded))


def _scalar_only(prim: Any) -> Any:
    shared = SHARED[prim]

    def lower(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
        if any(_is_array(a) for a in args):
            dtype = np.dtype(eqn.invars[0].aval.dtype).name
            raise state.fail(f"{eqn.primitive.name} on {dtype} arrays")
        return shared(state, eqn, *args)
    return lower


for _p in SHARED:
    if _p not in (plb.cond_p, plb.while_p, plb.scan_p, *plb.CALL_PRIMITIVES):
        rule(_p)(_scalar_only(_p))


def _shared(state: GPULowering, eqn: Any, *args: Any) -> Any:
    return SHARED[eqn.primitive](state, eqn, *args)


def _binary(fa_op: Any) -> Any:
    def lower(state: GPULowering, eqn: Any, x: Any, y: Any, **_: Any) -> Any:
        (x, y), exp = _unexpand(state, eqn, [x, y])
        if not (isinstance(x, FA) or isinstance(y, FA)):
            return _rewrap(_shared(state, eqn, x, y), exp)
        dtype = eqn.invars[0].aval.dtype
        x, y = _splat_like(x, y, dtype), _splat_like(y, x, dtype)
        return _rewrap(fa_op(x, y), exp)
    return lower


for _p, _op in {
    lax.add_p: lambda a, b: a + b, lax.sub_p: lambda a, b: a - b,
    lax.mul_p: lambda a, b: a * b, lax.div_p: lambda a, b: a / b,
    lax.rem_p: lambda a, b: a % b, lax.max_p: lambda a, b: a.max(b),
    lax.min_p: lambda a, b: a.min(b), lax.and_p: lambda a, b: a & b,
    lax.or_p: lambda a, b: a | b, lax.xor_p: lambda a, b: a ^ b,
    lax.eq_p: lambda a, b: a == b, lax.ne_p: lambda a, b: a != b,
    lax.lt_p: lambda a, b: a < b, lax.le_p: lambda a, b: a <= b,
    lax.gt_p: lambda a, b: a > b, lax.ge_p: lambda a, b: a >= b,
}.items():
    rule(_p)(_binary(_op))


def _unary(array_op: Callable[[GPULowering, Any, Any], Any]) -> Any:
    """A rule applying ``array_op(state, eqn, x)`` to register arrays, the shared rule to
    scalars."""
    def lower(state: GPULowering, eqn: Any, x: Any, **_: Any) -> Any:
        (x,), exp = _unexpand(state, eqn, [x])
        if not isinstance(x, FA):
            return _rewrap(_shared(state, eqn, x), exp)
        return _rewrap(array_op(state, eqn, x), exp)
    return lower


def _method(name: str, approx_ok: bool = False) -> Any:
    def apply(state: GPULowering, eqn: Any, x: Any) -> Any:
        fn = getattr(x, name)
        return fn(approx=state.approx) if approx_ok else fn()
    return apply


for _p, _name in ((lax.exp_p, "exp"), (lax.exp2_p, "exp2"), (lax.log_p, "log"),
                  (lax.tanh_p, "tanh"), (lax.rsqrt_p, "rsqrt"), (lax.sin_p, "sin"),
                  (lax.cos_p, "cos")):
    rule(_p)(_unary(_method(_name, approx_ok=True)))
rule(lax.abs_p)(_unary(_method("abs")))
rule(lax.neg_p)(_unary(lambda state, eqn, x: -x))
rule(lax.not_p)(_unary(lambda state, eqn, x: ~x))


@rule(lax.logistic_p)
@_unary
def _logistic(state: GPULowering, eqn: Any, x: Any) -> Any:
    one = splat(scalar_constant(1.0, eqn.invars[0].aval.dtype), x.shape,
                eqn.invars[0].aval.dtype)
    return one / ((-x).exp(approx=state.approx) + 1.0)


@rule(lax.integer_pow_p)
@_unary
def _integer_pow(state: GPULowering, eqn: Any, x: Any) -> Any:
    y = eqn.params["y"]
    if y < 1:
        raise state.fail(f"integer_pow with exponent {y} on "
                         f"{np.dtype(eqn.invars[0].aval.dtype).name} arrays")
    out = x
    for _step in range(y - 1):
        out = out * x
    return out


@rule(lax.convert_element_type_p)
@_unary
def _convert(state: GPULowering, eqn: Any, x: Any) -> Any:
    dst = eqn.outvars[0].aval.dtype
    return x.astype(mlir_element_type(dst), is_signed=signed(dst))


@rule(lax.select_n_p)
def _select(state: GPULowering, eqn: Any, pred: Any, *cases: Any, **_: Any) -> Any:
    unwrapped, exp = _unexpand(state, eqn, [pred, *cases])
    pred, cases = unwrapped[0], tuple(unwrapped[1:])
    if not any(isinstance(v, FA) for v in (pred, *cases)):
        return _rewrap(_shared(state, eqn, pred, *cases), exp)
    if len(cases) != 2 or eqn.invars[0].aval.dtype != np.bool_:
        raise state.fail(f"select_n on {np.dtype(eqn.outvars[0].aval.dtype).name} arrays with "
                         "more than two cases or an integer selector")
    on_false, on_true = cases
    dtype = eqn.outvars[0].aval.dtype
    like = next(v for v in (pred, on_true, on_false) if isinstance(v, FA))
    pred = _splat_like(pred, like, np.bool_)
    on_true, on_false = _splat_like(on_true, like, dtype), _splat_like(on_false, like, dtype)
    return _rewrap(pred.select(on_true, on_false), exp)


@rule(lax.iota_p)
def _iota(state: GPULowering, eqn: Any, *, dtype: Any, shape: Any, dimension: int,
          **_: Any) -> Any:
    return FA.broadcasted_iota(mlir_element_type(dtype), tuple(shape), dimension,
                               layout_for(shape), is_signed=signed(dtype))


@rule(lax.broadcast_in_dim_p)
def _broadcast_in_dim(state: GPULowering, eqn: Any, x: Any, *dyn: Any, shape: Any,
                      broadcast_dimensions: Any, **_: Any) -> Any:
    shape, dims = tuple(shape), tuple(broadcast_dimensions)
    dtype = eqn.outvars[0].aval.dtype
    if isinstance(x, Expanded):
        x, dims = x.array, tuple(dims[d] for d in x.dims)
    if not isinstance(x, FA):
        return splat(x, shape, dtype)
    if isinstance(x.layout, mgpu.WGSplatFragLayout):
        return FA.splat(x.registers.flat[0], shape, is_signed=x.is_signed)
    if tuple(x.shape) == shape:
        return x
    full = [d for d in range(len(shape)) if d not in dims]
    if all(shape[d] == 1 for d in full):
        return Expanded(x, shape, dims)
    try:
        return x.broadcast_in_dim(shape, dims, layout_for(shape))
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"broadcasting {x.shape} in layout {x.layout} to {shape} ({e})"
                         ) from None


@rule(lax.reshape_p, lax.squeeze_p)
def _reshape(state: GPULowering, eqn: Any, x: Any, *dyn: Any, **_: Any) -> Any:
    shape = tuple(eqn.outvars[0].aval.shape)
    if not isinstance(x, (FA, Expanded)):
        return x
    if isinstance(x, Expanded):
        if math.prod(shape) == math.prod(x.array.shape) and tuple(
                d for d in shape if d != 1) == tuple(d for d in x.array.shape if d != 1):
            if shape == tuple(x.array.shape):
                return x.array
            kept = [i for i, d in enumerate(shape) if d != 1]
            return Expanded(x.array, shape, tuple(kept))
        raise state.fail(f"reshaping {x.shape} to {shape}")
    if isinstance(x.layout, mgpu.WGSplatFragLayout):
        return FA.splat(x.registers.flat[0], shape, is_signed=x.is_signed)
    if tuple(d for d in shape if d != 1) == tuple(d for d in x.shape if d != 1):
        kept_dims = tuple(i for i, d in enumerate(shape) if d != 1)
        return Expanded(x, shape, kept_dims) if len(kept_dims) == len(x.shape) else \
            x.reshape(shape)
    try:
        return x.reshape(shape)
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"reshaping {x.shape} to {shape} ({e})") from None


_REDUCE = {lax.reduce_sum_p: "add", lax.reduce_max_p: "max", lax.reduce_min_p: "min",
           lax.reduce_prod_p: "prod"}


@rule(*_REDUCE)
def _reduce(state: GPULowering, eqn: Any, x: Any, *, axes: Any, **_: Any) -> Any:
    what = f"{eqn.primitive.name} on {np.dtype(eqn.invars[0].aval.dtype).name}"
    if not isinstance(x, FA):
        raise state.fail(f"{what} of a scalar")
    op = _REDUCE[eqn.primitive]
    if isinstance(x.layout, mgpu.WGSplatFragLayout):
        raise state.fail(f"{what} of a constant array")
    try:
        return x.reduce(op, tuple(axes))
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"{what} over axes {tuple(axes)} of {x.shape} in "
                         f"layout {x.layout} ({e})") from None


_CONCATENATE = getattr(mgpu, "concatenate", None)
"""The Mosaic GPU library's concatenation of register arrays (JAX 0.11 on)."""


@rule(lax.concatenate_p)
def _concatenate(state: GPULowering, eqn: Any, *args: Any, dimension: int, **_: Any) -> Any:
    """``jnp.concatenate`` of register arrays, as JAX lowers it: the registers of arrays in
    one tiled layout side by side (whole tiles along ``dimension``), or strided arrays one
    after another along their only dimension. Constant operands take the others' layout."""
    what = f"jnp.concatenate of {np.dtype(eqn.outvars[0].aval.dtype).name} arrays"
    if _CONCATENATE is None:
        raise state.fail(f"{what} with JAX's Mosaic GPU library before JAX 0.11 (it has no "
                         "concatenation of register arrays)")
    if any(isinstance(a, Expanded) for a in args):
        raise state.fail(f"{what} with unit dimensions added (x[:, None])")
    dtype = eqn.outvars[0].aval.dtype
    arrays = [a if isinstance(a, FA) else splat(a, tuple(v.aval.shape), dtype)
              for a, v in zip(args, eqn.invars)]
    like = next((a for a in arrays if not isinstance(a.layout, mgpu.WGSplatFragLayout)), None)
    if like is None:  # every operand a constant: the result is one too, in a fresh layout
        shape = tuple(eqn.outvars[0].aval.shape)
        if len({a.registers.flat[0] for a in arrays}) == 1:
            return splat(arrays[0].registers.flat[0], shape, dtype)
        arrays = [relayout(a, layout_for(a.shape)) for a in arrays]
    else:
        arrays = [_in_layout_of(a, like) for a in arrays]
    try:
        return _CONCATENATE(arrays, axis=dimension)
    except (NotImplementedError, ValueError) as e:
        layouts = sorted({str(a.layout) for a in arrays})
        raise state.fail(f"{what} of shapes {[tuple(a.shape) for a in arrays]} along "
                         f"dimension {dimension} in layouts {layouts} ({e})") from None


def _in_layout_of(x: Any, like: Any) -> Any:
    """``x`` (of its own shape) in the layout of ``like``: the strided layouts of different
    shapes share their vector width; a tiled layout is the same for every shape."""
    if not isinstance(x.layout, mgpu.WGSplatFragLayout):
        return x
    layout = like.layout
    if isinstance(layout, mgpu.WGStridedFragLayout):
        layout = mgpu.WGStridedFragLayout(shape=tuple(x.shape), vec_size=layout.vec_size)
    return relayout(x, layout)
