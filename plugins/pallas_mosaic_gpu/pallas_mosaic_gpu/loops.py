"""Index helpers of persistent kernels: ``plgpu.nd_loop``, ``plgpu.NDLoopInfo`` and
``plgpu.planar_snake``, as JAX's ``jax.experimental.pallas.mosaic_gpu`` names them.

Both are index arithmetic on scalars written with ``lax`` (a ``fori_loop``, ``div``/``rem``,
``select``), so every backend that runs a ``plgpu.kernel`` (this one and the interpreter)
runs them with nothing of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core.backend import PallasError


@dataclasses.dataclass(frozen=True, eq=False)
class NDLoopInfo:
    """What the body of a :func:`nd_loop` is given at each of its iterations.

    * ``index``: the point of the loop's grid this iteration works on (one int32 per axis);
    * ``local_index``: how many iterations this instance ran before this one;
    * ``num_local_steps``: how many iterations this instance runs in all.
    """

    index: tuple[Any, ...]
    local_index: Any
    num_local_steps: Any


def _axes(collective_axes: Sequence[Hashable] | Hashable) -> tuple[Any, ...]:
    if isinstance(collective_axes, (tuple, list)):
        return tuple(collective_axes)
    return (collective_axes,)


def _check_tiling(grid: tuple[Any, ...], tiling: Sequence[int]) -> tuple[Any, ...]:
    """The grid of tiles followed by the tile: the order the loop walks a tiled grid in."""
    tiling = tuple(tiling)
    if len(tiling) != len(grid):
        raise PallasError(f"plgpu.nd_loop(grid={grid}, tiling={tiling}): give one tile size per "
                          "grid axis.")
    for dim, tile in zip(grid, tiling):
        if isinstance(dim, (int, np.integer)) and dim % tile:
            raise PallasError(f"plgpu.nd_loop(grid={grid}, tiling={tiling}): the tile {tile} "
                              f"does not divide the grid axis of size {dim}. Fix: a tiling "
                              "whose entries divide the grid's.")
    return (*(dim // tile for dim, tile in zip(grid, tiling)), *tiling)


def nd_loop(grid: Sequence[Any], *, collective_axes: Sequence[Hashable] | Hashable,
            tiling: Sequence[int] | None = None, init_carry: Any = None
            ) -> Callable[[Callable[..., Any]], Any]:
    """A loop over the points of ``grid`` shared out among the instances (thread blocks,
    warpgroups) along the mesh axes ``collective_axes``, as a decorator of its body.

    The points are numbered row-major; the instance at position ``p`` of ``n`` along the
    collective axes takes the points ``p, p + n, p + 2n, ...``, so the first
    ``prod(grid) % n`` instances run one iteration more than the others. With ``tiling``
    the grid is walked tile by tile (each tile row-major, the tiles row-major), the index
    still naming the untiled point. The body is called with an :class:`NDLoopInfo`, and
    with ``carry=`` when ``init_carry`` is given (it then returns the next carry, and the
    loop the last one).
    """
    axes = _axes(collective_axes)
    position = jnp.int32(0)
    count: Any = 1
    for axis in axes:  # the collective axes, the first one major
        size = lax.axis_size(axis)
        position = position * size + lax.axis_index(axis)
        count = count * size
    grid = tuple(grid)
    walk = _check_tiling(grid, tiling) if tiling else grid
    total: Any = 1
    for dim in walk:
        total = total * dim
    total = jnp.asarray(total, jnp.int32)
    count = jnp.asarray(count, jnp.int32)
    # Iterations of this instance: ceil of its share (the first ``total % count`` get one more).
    steps = lax.div(total, count) + (position < lax.rem(total, count)).astype(jnp.int32)

    def unravel(point: Any) -> tuple[Any, ...]:
        index = []
        for dim in reversed(walk):
            dim = jnp.asarray(dim, jnp.int32)
            index.append(lax.rem(point, dim))
            point = lax.div(point, dim)
        index.reverse()
        if tiling:
            k = len(grid)
            index = [tile * t + within
                     for tile, within, t in zip(index[:k], index[k:], tiling)]
        return tuple(index)

    def decorator(body: Callable[..., Any]) -> Any:
        def iteration(local: Any, carry: Any) -> Any:
            info = NDLoopInfo(index=unravel(local * count + position), local_index=local,
                              num_local_steps=steps)
            if init_carry is None:
                body(info)
                return None
            return body(info, carry=carry)

        return lax.fori_loop(0, steps, iteration, init_carry)

    return decorator


def _snake_coordinates(lin: Any, width: Any, tile: Any, major_size: Any,
                       minor_dim: int) -> tuple[Any, Any]:
    """The point ``lin`` positions into the ``tile``-th tile (``width`` wide along the minor
    dimension; every tile before it is ``width`` wide too, or ``lin`` counts from a narrower
    last tile whose ``width`` differs, see :func:`planar_snake`): minor coordinate fastest,
    odd tiles walking the major dimension backwards."""
    minor = lax.rem(lin, width)
    major = lax.rem(lax.div(lin, width), major_size)
    major = lax.select(lax.rem(tile, jnp.int32(2)) == 0, major, major_size - 1 - major)
    return minor, major


def planar_snake(lin_idx: Any, shape: tuple[Any, Any], minor_dim: int,
                 tile_width: int) -> tuple[Any, Any]:
    """The 2-D index into ``shape`` of the linear index ``lin_idx`` along a snaking curve.

    The dimension ``minor_dim`` is cut into tiles of ``tile_width`` (the last one may be
    narrower); the curve visits the tiles in order, each tile's points with the minor
    coordinate fastest, and walks the other (major) dimension forwards in even tiles and
    backwards in odd ones, so consecutive tiles meet at the same end. Consecutive indices
    stay close in both dimensions, which helps blocks that share operands run together.
    """
    if minor_dim not in (0, 1):
        raise PallasError(f"plgpu.planar_snake(minor_dim={minor_dim}): the shape is 2-D, so "
                          "minor_dim is 0 or 1.")
    lin_idx = jnp.asarray(lin_idx, jnp.int32)
    width = jnp.int32(tile_width)
    major_size = jnp.asarray(shape[1 - minor_dim], jnp.int32)
    minor_size = jnp.asarray(shape[minor_dim], jnp.int32)
    full_tiles = lax.div(minor_size, width)
    full_points = full_tiles * width * major_size
    tile = lax.div(lin_idx, width * major_size)
    minor, major = _snake_coordinates(lin_idx, width, tile, major_size, minor_dim)
    # The narrower last tile, when tile_width does not divide the minor size (its width is
    # kept at least 1 so that the branch not taken divides by no zero).
    rest_width = jnp.maximum(minor_size - full_tiles * width, 1)
    rest_minor, rest_major = _snake_coordinates(lin_idx - full_points, rest_width, full_tiles,
                                                major_size, minor_dim)
    in_full = lin_idx < full_points
    minor = lax.select(in_full, tile * width + minor, full_tiles * width + rest_minor)
    major = lax.select(in_full, major, rest_major)
    return (minor, major) if minor_dim == 0 else (major, minor)
