"""The SparseCore primitives (``plsc.load_gather``, ``plsc.sort_key_val``, ...), each with
reference semantics that the interpreter runs; their lowering rules are in ``lowering.py``.

Register-level operations work on one vector register: 1-D arrays of the chip's lane count
(``num_lanes``: 8 on v5p/v6e, 16 on v7x) for 32-bit types; the backend checks the length when it
lowers a kernel (``validation.py``). Lanes a mask switches off are undefined on the hardware;
the interpreter makes them zero.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import backend as plb
from pallas_core.backend import (
    PallasError,
    PrimitiveSemantics,
    ReferenceContext,
    RefViews,
    bind_views,
)

REF_PRIMITIVES: list[Any] = []
"""Primitives on Ref views (their first operands are Refs, bound with ``bind_views``)."""


def _ref_effects(*avals: Any, roles: tuple[int, ...], **_: Any) -> Any:
    n_refs = max(roles) + 1
    return {e for i in range(n_refs) for e in (plb.ReadEffect(i), plb.WriteEffect(i))}


def _ref_primitive(name: str, out: Callable[..., Any] | None = None) -> Any:
    """A primitive on Ref views; ``out(*extra_avals, **params)`` gives its result aval."""
    p = plb.Primitive(f"sc_{name}")
    if out is None:
        p.multiple_results = True
        p.def_effectful_abstract_eval(lambda *a, roles, tree, **kw: ([], _ref_effects(
            *a, roles=roles)))
    else:
        def abstract(*avals: Any, roles: Any, tree: Any, **kw: Any) -> Any:
            n = max(roles) + 1 + tree.num_leaves
            return out(*avals[n:], **kw), _ref_effects(*avals, roles=roles)
        p.def_effectful_abstract_eval(abstract)
    REF_PRIMITIVES.append(p)
    return p


def _vector(x: Any, what: str, fn: str, dtypes: Sequence[Any] | None = None) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 1:
        raise PallasError(f"plsc.{fn}: {what} must be a 1-D vector (one register), found shape "
                          f"{x.shape}. Fix: work on one register of num_lanes elements at a "
                          "time (loop over longer data).")
    if dtypes is not None and x.dtype not in [jnp.dtype(d) for d in dtypes]:
        raise PallasError(f"plsc.{fn}: {what} must have dtype in "
                          f"{[str(jnp.dtype(d)) for d in dtypes]}, found {x.dtype}.")
    return x


def _mask(mask: Any, like: jax.Array, fn: str) -> jax.Array | None:
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_ or mask.shape != like.shape:
        raise PallasError(f"plsc.{fn}: mask must be a bool vector of shape {like.shape}, found "
                          f"{mask.dtype}{list(mask.shape)}.")
    return mask


def _ref_aval(ref: Any, fn: str) -> Any:
    r, t = plb.ref_and_transforms(ref, None, fn)
    return plb.shape_after_transforms(plb.ref_type_of(r), t)


_GATHER_TYPES = (jnp.int32, jnp.float32)


def _indices(ref: Any, indices: Any, fn: str) -> tuple[Any, list[jax.Array]]:
    aval = _ref_aval(ref, fn)
    if aval.dtype not in [jnp.dtype(d) for d in _GATHER_TYPES]:
        raise PallasError(f"plsc.{fn} supports int32 and float32 Refs, found {aval.dtype}.")
    if not isinstance(indices, (list, tuple)):
        indices = [indices]
    if len(indices) != len(aval.shape):
        raise PallasError(f"plsc.{fn}: a {len(aval.shape)}-D Ref needs {len(aval.shape)} index "
                          f"vectors (one per dimension), found {len(indices)}.")
    idx = [_vector(i, f"index vector {k}", fn, (jnp.int32,)) for k, i in enumerate(indices)]
    if len({i.shape for i in idx}) != 1:
        raise PallasError(f"plsc.{fn}: the index vectors have different lengths "
                          f"{[i.shape[0] for i in idx]}.")
    return aval, idx


# --- gathers and scatters on VMEM ------------------------------------------------------------

load_gather_p = _ref_primitive(
    "load_gather", lambda *idx_and_mask, dtype, n_idx, has_mask: plb.ShapedArray(
        idx_and_mask[0].shape, dtype))
store_scatter_p = _ref_primitive("store_scatter")


def load_gather(ref: Any, indices: Sequence[Any], *, mask: Any = None) -> jax.Array:
    """``out[i] = ref[indices[0][i], indices[1][i], ...]``: one index vector per dimension of
    the VMEM Ref (int32 or float32); lanes where ``mask`` is False are undefined."""
    aval, idx = _indices(ref, indices, "load_gather")
    m = _mask(mask, idx[0], "load_gather")
    bind = [*idx] + ([m] if m is not None else [])
    return bind_views(load_gather_p, [ref], bind, "load_gather", dtype=aval.dtype,
                     n_idx=len(idx), has_mask=m is not None)


def _scatter(ref: Any, indices: Any, x: Any, mask: Any, add: bool, fn: str) -> None:
    aval, idx = _indices(ref, indices, fn)
    x = _vector(x, "the value", fn)
    if x.shape != idx[0].shape:
        raise PallasError(f"plsc.{fn}: the value has {x.shape[0]} lanes but the index vectors "
                          f"{idx[0].shape[0]}.")
    m = _mask(mask, idx[0], fn)
    bind_views(store_scatter_p, [ref], [*idx, x.astype(aval.dtype)] + ([m] if m is not None
                                                                       else []),
               fn, n_idx=len(idx), has_mask=m is not None, add=add)


def store_scatter(ref: Any, indices: Sequence[Any], x: Any, *, mask: Any = None) -> None:
    """``ref[indices[0][i], ...] = x[i]`` for the lanes ``mask`` keeps (VMEM)."""
    _scatter(ref, indices, x, mask, False, "store_scatter")


def addupdate_scatter(ref: Any, indices: Sequence[Any], x: Any, *, mask: Any = None) -> None:
    """``ref[indices[0][i], ...] += x[i]`` atomically: repeated indices accumulate (VMEM)."""
    _scatter(ref, indices, x, mask, True, "addupdate_scatter")


def _load_gather_discharge(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
                           dtype: Any, n_idx: int, has_mask: bool) -> Any:
    st = RefViews(args, tree, roles)
    idx = st.rest[:n_idx]
    val = st.read(0)[tuple(idx)]
    if has_mask:
        val = jnp.where(st.rest[n_idx], val, jnp.zeros_like(val))
    return st.new_values(), val


def _store_scatter_discharge(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
                             n_idx: int, has_mask: bool, add: bool) -> Any:
    st = RefViews(args, tree, roles)
    idx, x = list(st.rest[:n_idx]), st.rest[n_idx]
    view = st.read(0)
    if has_mask:  # masked-off lanes write out of bounds, which the scatter drops
        keep = st.rest[n_idx + 1]
        idx[0] = jnp.where(keep, idx[0], view.shape[0])
    at = view.at[tuple(idx)]
    st.write(0, at.add(x, mode="drop") if add else at.set(x, mode="drop"))
    return st.new_values(), []


# --- contiguous masked accesses --------------------------------------------------------------

load_expanded_p = _ref_primitive(
    "load_expanded", lambda mask, dtype: plb.ShapedArray(mask.shape, dtype))
store_compressed_p = _ref_primitive("store_compressed")
addupdate_p = _ref_primitive("addupdate")


def load_expanded(ref: Any, *, mask: Any) -> jax.Array:
    """An expanding load: the ``k``-th lane where ``mask`` is True gets ``ref[k]``; the other
    lanes are undefined."""
    aval = _ref_aval(ref, "load_expanded")
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_ or mask.ndim != 1:
        raise PallasError("plsc.load_expanded: mask must be a 1-D bool vector, found "
                          f"{mask.dtype}{list(mask.shape)}.")
    return bind_views(load_expanded_p, [ref], [mask], "load_expanded", dtype=aval.dtype)


def store_compressed(ref: Any, x: Any, *, mask: Any) -> None:
    """A compressing store: the lanes of ``x`` where ``mask`` is True go to ``ref[0]``,
    ``ref[1]``, ... in order."""
    x = _vector(x, "the value", "store_compressed")
    m = _mask(mask, x, "store_compressed")
    bind_views(store_compressed_p, [ref], [x, m], "store_compressed", add=False)


def addupdate_compressed(ref: Any, x: Any, *, mask: Any) -> None:
    """Like :func:`store_compressed`, adding atomically into ``ref``."""
    x = _vector(x, "the value", "addupdate_compressed")
    m = _mask(mask, x, "addupdate_compressed")
    bind_views(store_compressed_p, [ref], [x, m], "addupdate_compressed", add=True)


def addupdate(ref: Any, x: Any) -> None:
    """``ref[...] += x`` atomically (``x`` has the view's shape)."""
    aval = _ref_aval(ref, "addupdate")
    x = jnp.asarray(x)
    if x.shape != aval.shape:
        raise PallasError(f"plsc.addupdate: the value has shape {x.shape} but the Ref view "
                          f"{aval.shape}. Fix: slice the Ref to the value's shape.")
    bind_views(addupdate_p, [ref], [x.astype(aval.dtype)], "addupdate")


def _load_expanded_discharge(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
                             dtype: Any) -> Any:
    st = RefViews(args, tree, roles)
    mask = st.rest[0]
    src = st.read(0).reshape(-1)
    rank = jnp.cumsum(mask.astype(jnp.int32)) - 1
    vals = src[jnp.clip(rank, 0, src.shape[0] - 1)]
    return st.new_values(), jnp.where(mask, vals, jnp.zeros_like(vals))


def _store_compressed_discharge(in_avals: Any, out_avals: Any, *args: Any, tree: Any,
                                roles: Any, add: bool) -> Any:
    st = RefViews(args, tree, roles)
    x, mask = st.rest[0], st.rest[1]
    view = st.read(0)
    flat = view.reshape(-1)
    slot = jnp.where(mask, jnp.cumsum(mask.astype(jnp.int32)) - 1, flat.shape[0])
    at = flat.at[slot]
    flat = at.add(x.astype(flat.dtype), mode="drop") if add else at.set(
        x.astype(flat.dtype), mode="drop")
    st.write(0, flat.reshape(view.shape))
    return st.new_values(), []


def _addupdate_discharge(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any
                         ) -> Any:
    st = RefViews(args, tree, roles)
    st.write(0, st.read(0) + st.rest[0])
    return st.new_values(), []


# --- register operations ---------------------------------------------------------------------

_SCAN_TYPES = (jnp.int32, jnp.uint32, jnp.float32)


def _value_primitive(name: str, abstract: Callable[..., Any], multiple: bool = False) -> Any:
    p = plb.Primitive(f"sc_{name}")
    p.multiple_results = multiple
    p.def_abstract_eval(abstract)
    return p


cumsum_p = _value_primitive("cumsum", lambda x, *m, has_mask: x)
cummax_p = _value_primitive("cummax", lambda x, *m, has_mask: x)
cummin_p = _value_primitive("cummin", lambda x, *m, has_mask: x)


def _scan_args(x: Any, mask: Any, fn: str) -> tuple[jax.Array, list[Any]]:
    x = _vector(x, "x", fn, _SCAN_TYPES)
    m = _mask(mask, x, fn)
    return x, [] if m is None else [m]


def cumsum(x: Any, *, mask: Any = None) -> jax.Array:
    """The inclusive prefix sum of a vector; lanes ``mask`` switches off count as zero."""
    x, m = _scan_args(x, mask, "cumsum")
    return cumsum_p.bind(x, *m, has_mask=bool(m))  # type: ignore[no-any-return]


def cummax(x: Any, *, mask: Any = None) -> jax.Array:
    """The prefix maximum of a vector over the lanes ``mask`` keeps; lanes before the first
    kept one keep their own value."""
    x, m = _scan_args(x, mask, "cummax")
    return cummax_p.bind(x, *m, has_mask=bool(m))  # type: ignore[no-any-return]


def cummin(x: Any, *, mask: Any = None) -> jax.Array:
    """The prefix minimum of a vector over the lanes ``mask`` keeps; lanes before the first
    kept one keep their own value (JAX's ``masked_cummin``)."""
    x, m = _scan_args(x, mask, "cummin")
    return cummin_p.bind(x, *m, has_mask=bool(m))  # type: ignore[no-any-return]


def _lowest(dtype: Any) -> Any:
    dt = jnp.dtype(dtype)
    return -jnp.inf if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo(dt).min


def _highest(dtype: Any) -> Any:
    dt = jnp.dtype(dtype)
    return jnp.inf if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo(dt).max


def _cumsum_reference(ctx: ReferenceContext, x: Any, *m: Any, has_mask: bool) -> Any:
    return jnp.cumsum(jnp.where(m[0], x, jnp.zeros_like(x)) if has_mask else x, dtype=x.dtype)


def _running(scan: Any, fill: Any) -> Any:
    """The reference of a masked running max or min (``scan``): masked-off elements count
    as ``fill`` (the identity), and elements before the first unmasked one keep their value."""
    def reference(ctx: ReferenceContext, x: Any, *m: Any, has_mask: bool) -> Any:
        if not has_mask:
            return scan(x, axis=0)
        run = scan(jnp.where(m[0], x, jnp.full_like(x, fill(x.dtype))), axis=0)
        seen = jnp.cumsum(m[0].astype(jnp.int32)) > 0
        return jnp.where(seen, run, x)
    return reference


_cummax_reference = _running(lax.cummax, _lowest)
_cummin_reference = _running(lax.cummin, _highest)


sort_p = _value_primitive(
    "sort_key_val", lambda k, v, *m, descending, has_mask: (k, v, plb.ShapedArray(
        k.shape, jnp.bool_)), multiple=True)


def sort_key_val(keys: Any, values: Any, *, mask: Any = None, descending: bool = False
                 ) -> Any:
    """Sorts one register of ``keys`` (int32, uint32 or float32) and carries ``values``
    (32-bit) along, stably; lanes ``mask`` switches off go last. Returns ``(keys, values)``,
    and with a mask also the mask of the sorted lanes that hold kept elements."""
    k = _vector(keys, "keys", "sort_key_val", _SCAN_TYPES)
    v = _vector(values, "values", "sort_key_val")
    if v.shape != k.shape or v.dtype.itemsize != 4:
        raise PallasError(f"plsc.sort_key_val: values must be a 32-bit vector of keys' shape "
                          f"{k.shape}, found {v.dtype}{list(v.shape)}.")
    m = _mask(mask, k, "sort_key_val")
    sk, sv, sm = sort_p.bind(k, v, *([] if m is None else [m]), descending=bool(descending),
                             has_mask=m is not None)
    return (sk, sv) if m is None else (sk, sv, sm)


def _sort_reference(ctx: ReferenceContext, k: Any, v: Any, *m: Any, descending: bool,
                    has_mask: bool) -> list[Any]:
    order = jnp.argsort(k, stable=True, descending=descending)
    if has_mask:
        invalid = jnp.logical_not(m[0])[order]
        order = order[jnp.argsort(invalid.astype(jnp.int32), stable=True)]
        valid = m[0][order]
    else:
        valid = jnp.ones(k.shape, jnp.bool_)
    return [k[order], v[order], valid]


scan_count_p = _value_primitive(
    "scan_count", lambda x, *m, has_mask: (plb.ShapedArray(x.shape, jnp.int32),
                                           plb.ShapedArray(x.shape, jnp.bool_)), multiple=True)


def scan_count(x: Any, mask: Any = None) -> tuple[jax.Array, jax.Array]:
    """For each lane, how many kept lanes up to it hold its value (from 1; a lane ``mask``
    switches off counts 1), and whether it is the last kept lane holding that value."""
    x, m = _scan_args(x, mask, "scan_count")
    counts, last = scan_count_p.bind(x, *m, has_mask=bool(m))
    return counts, last


def _scan_count_reference(ctx: ReferenceContext, x: Any, *m: Any, has_mask: bool) -> list[Any]:
    n = x.shape[0]
    keep = m[0] if has_mask else jnp.ones((n,), jnp.bool_)
    same = (x[:, None] == x[None, :]) & keep[None, :] & keep[:, None]
    before = jnp.tril(jnp.ones((n, n), jnp.bool_))
    # A lane the mask switches off counts 1 (tpu.scan_count's definition).
    counts = jnp.where(keep, jnp.sum(same & before, axis=1), 1).astype(jnp.int32)
    later = jnp.sum(same & ~before, axis=1)
    return [counts, (later == 0) & keep]


popcount_p = _value_primitive(
    "all_reduce_population_count",
    lambda x, *, reduce: plb.ShapedArray((x.shape[0] // reduce,), jnp.int32))
ffs_p = _value_primitive(
    "all_reduce_ffs", lambda x, *, reduce: plb.ShapedArray((x.shape[0] // reduce,), jnp.int32))


def _bool_vector(x: Any, reduce: int, fn: str) -> jax.Array:
    x = _vector(x, "x", fn, (jnp.bool_,))
    if isinstance(reduce, bool) or not isinstance(reduce, int) or reduce < 1 or \
            x.shape[0] % reduce:
        raise PallasError(f"plsc.{fn}: reduce={reduce!r} must be a positive int dividing the "
                          f"vector length {x.shape[0]}.")
    return x


def all_reduce_population_count(x: Any, *, reduce: int = 1) -> jax.Array:
    """The number of True lanes of a bool vector, in every lane of an int32 vector."""
    return popcount_p.bind(_bool_vector(x, reduce, "all_reduce_population_count"),  # type: ignore[no-any-return]
                           reduce=reduce)


def all_reduce_ffs(x: Any, *, reduce: int = 1) -> jax.Array:
    """The index of the first True lane (the length when none), in every lane."""
    return ffs_p.bind(_bool_vector(x, reduce, "all_reduce_ffs"),  # type: ignore[no-any-return]
                      reduce=reduce)


def _popcount_reference(ctx: ReferenceContext, x: Any, *, reduce: int) -> Any:
    return jnp.full((x.shape[0] // reduce,), jnp.sum(x.astype(jnp.int32)), jnp.int32)


def _ffs_reference(ctx: ReferenceContext, x: Any, *, reduce: int) -> Any:
    first = jnp.where(jnp.any(x), jnp.argmax(x), x.shape[0]).astype(jnp.int32)
    return jnp.full((x.shape[0] // reduce,), first, jnp.int32)


bitcast_p = _value_primitive(
    "bitcast", lambda x, *, dtype: plb.ShapedArray(
        (*x.shape[:-1], x.shape[-1] * x.dtype.itemsize // jnp.dtype(dtype).itemsize), dtype))


def bitcast(x: Any, dtype: Any) -> jax.Array:
    """The bits of ``x`` as ``dtype``; the last dimension scales by the ratio of widths
    (int32[16] -> int8[64], element ``i`` of the wider type holding ``4i..4i+3``)."""
    x = jnp.asarray(x)
    dt = jnp.dtype(dtype)
    if x.ndim < 1 or (x.shape[-1] * x.dtype.itemsize) % dt.itemsize:
        raise PallasError(f"plsc.bitcast of {x.dtype}{list(x.shape)} to {dt}: the last "
                          f"dimension's {x.shape[-1] * x.dtype.itemsize} bytes are not a "
                          f"multiple of {dt.itemsize}.")
    return bitcast_p.bind(x, dtype=dt)  # type: ignore[no-any-return]


def _bitcast_reference(ctx: ReferenceContext, x: Any, *, dtype: Any) -> Any:
    src, dst = x.dtype.itemsize, jnp.dtype(dtype).itemsize
    if src == dst:
        return lax.bitcast_convert_type(x, dtype)
    if src > dst:
        out = lax.bitcast_convert_type(x, dtype)  # (..., n, src // dst)
        return out.reshape(*x.shape[:-1], x.shape[-1] * (src // dst))
    parts = x.reshape(*x.shape[:-1], x.shape[-1] // (dst // src), dst // src)
    return lax.bitcast_convert_type(parts, dtype)


class PackFormat(enum.Enum):
    """How :func:`pack` lays out two vectors: ``COMPRESSED`` (``a`` then ``b``, as an
    ``(n, 2)`` array) or ``INTERLEAVED`` (``a0, b0, a1, b1, ...``)."""

    COMPRESSED = "compressed"
    INTERLEAVED = "interleaved"


def _narrow(dtype: Any, preferred: Any, fn: str) -> Any:
    if preferred is not None:
        p = jnp.dtype(preferred)
        if p.itemsize * 2 != jnp.dtype(dtype).itemsize:
            raise PallasError(f"plsc.{fn}: preferred_element_type {p} must be half as wide as "
                              f"{jnp.dtype(dtype)}.")
        return p
    table = {jnp.dtype(jnp.float32): jnp.dtype(jnp.bfloat16),
             jnp.dtype(jnp.int32): jnp.dtype(jnp.int16)}
    if jnp.dtype(dtype) not in table:
        raise PallasError(f"plsc.{fn} packs float32 or int32, found {jnp.dtype(dtype)}.")
    return table[jnp.dtype(dtype)]


pack_p = _value_primitive("pack", lambda a, b, *, format, dtype: plb.ShapedArray(
    (2 * a.shape[0],) if format is PackFormat.INTERLEAVED else (a.shape[0], 2), dtype))
unpack_p = _value_primitive("unpack", lambda ab, *, format, dtype: (
    plb.ShapedArray((ab.shape[0] // 2 if format is PackFormat.INTERLEAVED else ab.shape[0],),
                     dtype),) * 2, multiple=True)


def pack(a: Any, b: Any, /, *, format: PackFormat,
         preferred_element_type: Any = None) -> jax.Array:
    """Two 1-D float32 (int32) vectors converted to bfloat16 (int16) and packed into one
    register in ``format``."""
    a, b = _vector(a, "a", "pack"), _vector(b, "b", "pack")
    if a.shape != b.shape or a.dtype != b.dtype:
        raise PallasError(f"plsc.pack: a and b must match, found {a.dtype}{list(a.shape)} and "
                          f"{b.dtype}{list(b.shape)}.")
    return pack_p.bind(a, b, format=PackFormat(format),  # type: ignore[no-any-return]
                       dtype=_narrow(a.dtype, preferred_element_type, "pack"))


def unpack(ab: Any, /, *, format: PackFormat,
           preferred_element_type: Any = None) -> tuple[jax.Array, jax.Array]:
    """The inverse of :func:`pack`: two vectors widened to float32 (int32)."""
    ab = jnp.asarray(ab)
    fmt = PackFormat(format)
    if (fmt is PackFormat.INTERLEAVED and (ab.ndim != 1 or ab.shape[0] % 2)) or (
            fmt is PackFormat.COMPRESSED and (ab.ndim != 2 or ab.shape[1] != 2)):
        raise PallasError(f"plsc.unpack: a {fmt.value} packed array must have shape "
                          f"{'(2n,)' if fmt is PackFormat.INTERLEAVED else '(n, 2)'}, found "
                          f"{ab.shape}.")
    wide = {jnp.dtype(jnp.bfloat16): jnp.float32, jnp.dtype(jnp.int16): jnp.int32}
    dt = jnp.dtype(preferred_element_type) if preferred_element_type is not None else \
        jnp.dtype(wide.get(ab.dtype, jnp.float32))
    a, b = unpack_p.bind(ab, format=fmt, dtype=dt)
    return a, b


def _pack_reference(ctx: ReferenceContext, a: Any, b: Any, *, format: PackFormat, dtype: Any
                    ) -> Any:
    a, b = a.astype(dtype), b.astype(dtype)
    if format is PackFormat.INTERLEAVED:
        return jnp.stack([a, b], axis=-1).reshape(-1)
    return jnp.concatenate([a, b]).reshape(a.shape[0], 2)


def _unpack_reference(ctx: ReferenceContext, ab: Any, *, format: PackFormat, dtype: Any
                      ) -> list[Any]:
    if format is PackFormat.INTERLEAVED:
        pairs = ab.reshape(-1, 2)
        return [pairs[:, 0].astype(dtype), pairs[:, 1].astype(dtype)]
    flat = ab.reshape(-1)
    n = ab.shape[0]
    return [flat[:n].astype(dtype), flat[n:].astype(dtype)]


# --- synchronisation and loops ---------------------------------------------------------------


class SubcoreBarrierEffect(plb.Effect):
    """A barrier orders the subcores' memory accesses: keeps it in place."""


_barrier_effect = SubcoreBarrierEffect()
subcore_barrier_p = plb.effect_primitive("sc_subcore_barrier", _barrier_effect)


def subcore_barrier() -> None:
    """Waits until every vector subcore of this SparseCore has reached the barrier."""
    ctx = plb.current_kernel_context()
    names = ctx.grid_names if ctx is not None else None
    # A vector-subcore mesh is (core, subcore): the barrier waits for one core's subcores.
    subcore_barrier_p.bind(axis_names=(names[-1],) if names and len(names) > 1 else None)


def _barrier_axes(*, axis_names: tuple[str, ...] | None) -> tuple[str, ...] | None:
    return axis_names


parallel_loop_p = plb.Primitive("sc_parallel_loop")
parallel_loop_p.multiple_results = True
parallel_loop_p.def_abstract_eval(lambda *, unroll: [])


def parallel_loop(lower: Any, upper: Any, step: int = 1, *, unroll: int = 1,
                  carry: Any = None) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: runs ``body(i)`` (or ``carry = body(i, carry)``) for ``i`` in
    ``range(lower, upper, step)``, letting the compiler overlap iterations (which must not
    depend on each other through memory). Returns the final carry."""
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise PallasError(f"plsc.parallel_loop(unroll={unroll!r}): expected an int >= 1.")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise PallasError(f"plsc.parallel_loop(step={step!r}): expected a static int >= 1.")

    def decorate(body: Callable[..., Any]) -> Any:
        lo = jnp.asarray(lower, jnp.int32)

        def one(k: Any, c: Any) -> Any:
            parallel_loop_p.bind(unroll=unroll)
            i = lo + k * step
            if carry is None:
                body(i)
                return c
            return body(i, c)

        if isinstance(lower, int) and isinstance(upper, int):
            trips = max(0, -(-(upper - lower) // step))
            out = lax.fori_loop(0, trips, one, carry)
        else:
            span = jnp.maximum(jnp.asarray(upper, jnp.int32) - lo, 0)
            out = lax.fori_loop(0, lax.div(span + (step - 1), jnp.int32(step)), one, carry)
        return out

    return decorate


def _no_op(ctx: ReferenceContext, **_: Any) -> list[Any]:
    return []


SEMANTICS: tuple[PrimitiveSemantics, ...] = (
    PrimitiveSemantics(load_gather_p, discharge=_load_gather_discharge),
    PrimitiveSemantics(store_scatter_p, discharge=_store_scatter_discharge),
    PrimitiveSemantics(load_expanded_p, discharge=_load_expanded_discharge),
    PrimitiveSemantics(store_compressed_p, discharge=_store_compressed_discharge),
    PrimitiveSemantics(addupdate_p, discharge=_addupdate_discharge),
    PrimitiveSemantics(cumsum_p, evaluate=_cumsum_reference),
    PrimitiveSemantics(cummax_p, evaluate=_cummax_reference),
    PrimitiveSemantics(cummin_p, evaluate=_cummin_reference),
    PrimitiveSemantics(sort_p, evaluate=_sort_reference),
    PrimitiveSemantics(scan_count_p, evaluate=_scan_count_reference),
    PrimitiveSemantics(popcount_p, evaluate=_popcount_reference),
    PrimitiveSemantics(ffs_p, evaluate=_ffs_reference),
    PrimitiveSemantics(bitcast_p, evaluate=_bitcast_reference),
    PrimitiveSemantics(pack_p, evaluate=_pack_reference),
    PrimitiveSemantics(unpack_p, evaluate=_unpack_reference),
    PrimitiveSemantics(subcore_barrier_p, barrier=_barrier_axes),
    PrimitiveSemantics(parallel_loop_p, evaluate=_no_op),
)

del np
