"""``lax.top_k`` and ``lax.approx_max_k`` in Mosaic TPU kernels, written as the vector
operations JAX's lowering builds them from.

``top_k`` takes ``k`` maxima one after another: each round finds the largest value along the
axis and its first index (``argmax``, ``tpu.reduce_index``), records both, and masks that
element to ``-inf`` for the next round. ``approx_max_k`` first folds the axis into
``num_bins`` bins (element ``j`` goes to bin ``j % num_bins``, each bin keeping its largest
value and that value's index), then takes the top ``k`` of the bins; ``num_bins`` follows
from ``recall_target`` as JAX computes it, so both lowerings keep the same candidates.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def top_k(x: Any, k: int, axis: int, indices: Any = None) -> tuple[Any, Any]:
    """The ``k`` largest values of ``x`` along ``axis`` (descending) and their indices
    (``int32``; taken from ``indices`` at the chosen positions where given)."""
    axis %= x.ndim
    index_type = jnp.int16 if x.dtype == jnp.bfloat16 else jnp.int32
    position = lax.broadcasted_iota(index_type, x.shape, axis)
    values, where = [], []
    rest = x
    for _ in range(k):
        best = lax.argmax(rest, axis=axis, index_dtype=index_type)
        chosen = position == jnp.expand_dims(best, axis)
        values.append(jnp.max(rest, axis=axis))
        where.append(best if indices is None else
                     jnp.max(jnp.where(chosen, indices.astype(jnp.int32), -1), axis=axis))
        rest = jnp.where(chosen, jnp.array(-jnp.inf, x.dtype), rest)
    return (jnp.stack(values, axis=axis),
            jnp.stack(where, axis=axis).astype(jnp.int32))


def bins_for(n: int, k: int, recall_target: float, minor: bool) -> int:
    """How many bins ``approx_max_k`` keeps along an axis of ``n`` for ``k`` results at
    ``recall_target`` (a multiple of 128 along the minor axis, at most ``n``)."""
    if k <= 1:
        bins = 1
    elif recall_target == 1.0:
        bins = n
    else:
        bins = math.ceil((k - 1) / (1.0 - recall_target))
    if minor:
        bins = -(-bins // 128) * 128
    return min(bins, n)


def approx_max_k(x: Any, k: int, axis: int, recall_target: float) -> tuple[Any, Any]:
    """``lax.approx_max_k``: the top ``k`` of the per-bin maxima (see the module)."""
    axis %= x.ndim
    n = x.shape[axis]
    bins = bins_for(n, k, recall_target, axis == x.ndim - 1)
    if bins == n:
        return top_k(x, k, axis)
    shape = [1] * x.ndim
    shape[axis] = bins
    offsets = jnp.arange(bins, dtype=jnp.int32).reshape(shape)
    best = lax.slice_in_dim(x, 0, bins, axis=axis)
    index = jnp.broadcast_to(offsets, best.shape)
    for start in range(bins, n, bins):
        piece = lax.slice_in_dim(x, start, min(start + bins, n), axis=axis)
        if piece.shape[axis] < bins:  # the last, partial slice: -inf past the end
            pad = [(0, 0, 0)] * x.ndim
            pad[axis] = (0, bins - piece.shape[axis], 0)
            piece = lax.pad(piece, jnp.array(-jnp.inf, x.dtype), pad)
        better = piece > best
        best = jnp.where(better, piece, best)
        index = jnp.where(better, start + offsets, index)
    return top_k(best, k, axis, indices=index)


def expansion(fn: Any, aval: Any, **params: Any) -> Any:
    """``fn(x, **params)`` traced on ``aval``: the jaxpr a rule lowers in its place."""
    return jax.make_jaxpr(lambda x: fn(x, **params))(jax.ShapeDtypeStruct(aval.shape,
                                                                            aval.dtype))
