"""Checked reads and writes of Refs: where each element of an access lies, and what an access
that leaves its Ref does (checked mode).

An access through a chain of indexers (``ref.at[pl.ds(i, 8)][j]``) that uses only slices and
scalar indices places each of its elements at one position of the Ref; :func:`locate` computes
those positions from the chain. Reads gather at them, reading uninitialized memory where a
position is outside the Ref; writes scatter at them, dropping what falls outside. Whether an
access outside is an error is decided by the caller against the Ref's *limit*: its shape, or,
with ``buffer_bounds="padded"``, its shape padded to the TPU's tiling (:func:`limit_shape`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import backend as plb
from pallas_core.backend import UnsupportedError


@dataclasses.dataclass(frozen=True)
class Access:
    """The elements an access touches: ``positions[d]`` is, per dimension ``d`` of the Ref, an
    int32 array (or scalar) that broadcasts to ``shape``, the shape of the accessed value.
    ``starts``/``sizes`` describe the access per Ref dimension, for messages."""

    positions: tuple[Any, ...]
    shape: tuple[int, ...]
    starts: tuple[Any, ...]
    sizes: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...] | None
    """Per Ref dimension, the first and last position touched, when no start or index is
    traced (first > last for an empty access); else ``None``."""


def _is_static(v: Any) -> bool:
    return isinstance(v, (int, np.integer))


def locate(transforms: Sequence[Any], ref_shape: Sequence[int]) -> Access | None:
    """Where the access through ``transforms`` (indexers applied in turn) lies in a Ref of
    ``ref_shape``; ``None`` for transforms other than slices and scalar indices, and for a
    Ref of symbolic shape (exported with ``jax.export``), whose accesses are not checked."""
    if not plb.is_static_shape(ref_shape):  # a block of symbolic shape (jax.export)
        return None
    # Each dimension of the current view: (Ref dimension, first position, step, size).
    view: list[tuple[int, Any, int, int]] = [(d, 0, 1, int(n)) for d, n in enumerate(ref_shape)]
    fixed: dict[int, Any] = {}
    static = True
    for t in transforms:
        if not isinstance(t, plb.NDIndexer) or tuple(t.int_indexer_shape) != ():
            return None
        if len(t.indices) != len(view):
            return None
        new_view = []
        for (d, first, step, _), idx in zip(view, t.indices):
            if isinstance(idx, plb.Slice):
                if not isinstance(idx.size, (int, np.integer)):
                    return None
                static = static and _is_static(idx.start)
                new_view.append((d, first + idx.start * step, step * idx.stride, int(idx.size)))
            elif jnp.ndim(idx) == 0:
                static = static and _is_static(idx)
                fixed[d] = first + idx * step
            else:
                return None
        view = new_view
    rank = len(view)
    positions: list[Any] = [None] * len(ref_shape)
    starts: list[Any] = [None] * len(ref_shape)
    sizes = [1] * len(ref_shape)
    ranges = [(0, 0)] * len(ref_shape)
    for k, (d, first, step, size) in enumerate(view):
        if static:
            ranges[d] = (int(first), int(first) + (size - 1) * int(step))
        iota = lax.broadcasted_iota(jnp.int32, tuple(size if j == k else 1 for j in range(rank)),
                                    k)
        positions[d] = jnp.asarray(first, jnp.int32) + iota * jnp.int32(step)
        starts[d], sizes[d] = first, size
    for d, p in fixed.items():
        positions[d] = jnp.asarray(p, jnp.int32)
        starts[d] = p
        if static:
            ranges[d] = (int(p), int(p))
    return Access(tuple(positions), tuple(n for _, _, _, n in view), tuple(starts),
                  tuple(sizes), tuple(ranges) if static else None)


def inside(acc: Access, shape: Sequence[int]) -> Any:
    """Per element of the access, whether it lies inside ``shape`` (a bool array)."""
    ok = jnp.ones(acc.shape, jnp.bool_)
    for p, n in zip(acc.positions, shape):
        ok = ok & (p >= 0) & (p < n)
    return ok


def statically_inside(acc: Access, shape: Sequence[int]) -> bool:
    """The access is known at trace time to lie inside ``shape``."""
    return acc.ranges is not None and all(
        lo > hi or (lo >= 0 and hi < n) for (lo, hi), n in zip(acc.ranges, shape))


def _indices(acc: Access, shape: Sequence[int], keep: Any = None) -> tuple[Any, ...]:
    """Gather/scatter indices: positions outside ``shape`` (or where ``keep`` is False) are
    moved to ``shape[d]``, where ``fill`` reads and ``drop`` writes treat them as outside."""
    ok = inside(acc, shape)
    if keep is not None:
        ok = ok & keep
    return tuple(jnp.where(ok, p, n) for p, n in zip(acc.positions, shape))


def read(x: Any, acc: Access, fill: Any) -> Any:
    """The accessed elements of ``x``; ``fill`` where they lie outside it."""
    idx = _indices(acc, x.shape)
    value = x.at[idx].get(mode="fill", fill_value=0).reshape(acc.shape)
    return jnp.where(inside(acc, x.shape), value, fill)


def write(x: Any, acc: Access, value: Any, mask: Any = None) -> Any:
    """``x`` with the accessed elements set to ``value`` (only where ``mask``); elements that
    lie outside ``x`` are dropped."""
    idx = _indices(acc, x.shape, mask)
    value = jnp.broadcast_to(jnp.asarray(value, x.dtype), acc.shape)
    return x.at[idx].set(value, mode="drop")


# --- padding to the TPU's tiling -------------------------------------------------------------


def tpu_generation() -> int:
    """The TPU generation of the abstract mesh in use (``jax.sharding.use_abstract_mesh``)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    kind = getattr(device, "device_kind", None) or ""
    found = re.search(r"TPU\s*v?(\d+)", kind)
    if found is None:
        raise UnsupportedError(
            "InterpretParams(buffer_bounds='padded') pads buffers to the tiling of a TPU "
            f"generation, but the abstract mesh in use names no TPU (device kind {kind!r}). Fix: "
            "run the kernel inside jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), "
            "(), abstract_device=jax.sharding.AbstractDevice('TPU v6e', 1, 'tpu'))), or use "
            "buffer_bounds='logical'.")
    return int(found.group(1))


def tpu_padded_shape(shape: Sequence[int], dtype: Any, generation: int) -> tuple[int, ...]:
    """``shape`` rounded up to the tiles a TPU of ``generation`` lays an array of ``dtype`` out
    in: the last dimension in lanes of 128, the one before in sublanes of 8 (fewer for small
    dimensions, more rows per sublane for narrow types); a 1-D array in whole vregs."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        return shape
    dtype = jnp.dtype(dtype)
    if dtype.itemsize > 4:
        raise UnsupportedError(
            f"InterpretParams(buffer_bounds='padded') with a {dtype} buffer: TPUs have no tiling "
            "for 64-bit types. Fix: use a 32-bit (or narrower) type, or buffer_bounds='logical'.")
    packing = 8 if dtype.name in ("int4", "uint4") else 4 // dtype.itemsize
    rows = (2 if generation < 4 else 1) * packing
    if len(shape) == 1:
        tile: tuple[int, ...] = (rows * 128,)
    else:
        while rows < min(shape[-2], 8):
            rows *= 2
        tile = (1,) * (len(shape) - 2) + (rows, 128)
    return tuple(-(-n // t) * t for n, t in zip(shape, tile))


def limit_shape(aval: Any, padded: bool, generation: int | None) -> tuple[int, ...]:
    """The shape accesses to a Ref of ``aval`` must stay within: its own, or, with ``padded``,
    its padded shape (never for SMEM, which TPUs do not tile)."""
    shape = tuple(aval.shape)
    space = str(getattr(getattr(aval, "memory_space", None), "name", "")).upper()
    if not padded or space == "SMEM" or generation is None:
        return shape
    return tpu_padded_shape(shape, aval.dtype, generation)
