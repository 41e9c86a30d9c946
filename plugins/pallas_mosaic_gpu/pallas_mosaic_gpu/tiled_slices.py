"""Views of tiled SMEM buffers whose two minor dimensions are sliced along whole tiles.

A tiled buffer of logical shape ``(..., R, C)`` is held as ``(..., R // 8, C // e, 8, e)``
(``e`` elements of 128 bytes, see :func:`pallas_mosaic_gpu.values.tile_shape`). A slice of
its minor dimensions that starts and ends on tile boundaries (``b_smem.at[:, pl.ds(w * 128,
128)]``, as JAX's hopper_matmul gives each warpgroup its half of B) is a slice of the tile
grid: the view stays tiled and swizzled, so ``wgmma``, TMA copies and tiled loads and stores
read it as they read a whole buffer. A static start or size off the tiles is refused; a
dynamic start is taken to be a multiple of the tile (divided by it), as JAX's own lowering
takes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from pallas_core import backend as plb


def _index(v: Any) -> ir.Value:
    if isinstance(v.type, ir.IndexType):
        return v
    return arith.index_cast(ir.IndexType.get(), v)


def minor_tile_index(i: Any, dim: int, tile: int, value: Callable[[Any], Any],
                     fail: Callable[[str], Exception]) -> Any:
    """The indexer of the tile-grid dimension for the indexer ``i`` of a minor dimension of
    ``dim`` elements tiled by ``tile`` (``value`` turns a traced start into an MLIR value)."""
    if not isinstance(i, plb.Slice):
        raise fail("an integer index into the two minor dimensions of a tiled SMEM buffer "
                   "(slice them instead, on whole tiles)")
    if not isinstance(i.stride, int) or i.stride != 1:
        raise fail("a strided slice of a tiled SMEM buffer")
    size = int(i.size)
    if size % tile:
        raise fail(f"a slice of {size} elements of a tiled SMEM dimension of {dim} (the "
                   f"dimension is tiled by {tile}; slices must cover whole tiles)")
    if isinstance(i.start, (int, np.integer)):
        if int(i.start) % tile:
            raise fail(f"a slice of a tiled SMEM dimension starting at {int(i.start)}, not a "
                       f"multiple of its tile {tile}")
        start = int(i.start) // tile
        return slice(start, start + size // tile)
    start = _index(value(i.start))
    return mgpu.ds(arith.divui(start, arith.constant(ir.IndexType.get(), tile)), size // tile)


def tiled_view(memref: Any, lead: Sequence[Any], minor: Sequence[Any],
               shape: Sequence[int], tiling: tuple[int, int], value: Callable[[Any], Any],
               fail: Callable[[str], Exception]) -> Any:
    """The tiled memref ``memref`` indexed by ``lead`` (its leading dimensions' indexers,
    already MLIR-ready) and ``minor`` (the indexers of the logical minor dimensions, at most
    two, of sizes ``shape``)."""
    tiles = [minor_tile_index(i, d, t, value, fail)
             for i, d, t in zip(minor, shape, tiling)]
    idx = tuple(lead) + tuple(tiles)
    return mgpu.memref_slice(memref, idx) if idx else memref
