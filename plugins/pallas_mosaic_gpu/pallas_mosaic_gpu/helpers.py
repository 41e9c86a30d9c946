"""Index helpers of ``jax.experimental.pallas.mosaic_gpu``, in plain ``jax.numpy`` integer
arithmetic (so they work in a kernel on any backend, and outside one)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax


def planar_snake(lin_idx: Any, shape: tuple[Any, Any], minor_dim: int,
                 tile_width: int) -> tuple[Any, Any]:
    """The 2-D index into ``shape`` of the linear index ``lin_idx`` along a snaking curve, as
    JAX's ``plgpu.planar_snake``: dimension ``minor_dim`` is cut into tiles ``tile_width`` wide
    (the last one narrower when it does not divide), a tile is walked ``tile_width`` at a time
    along ``minor_dim``, and every other tile walks the other dimension backwards, so that
    consecutive indices stay close (better cache reuse across blocks).

    For ``shape=(4, 4), minor_dim=0, tile_width=2`` the indices run::

         0  2  4  6
         1  3  5  7
        14 12 10  8
        15 13 11  9
    """
    if minor_dim not in (0, 1):
        raise ValueError(f"planar_snake: minor_dim must be 0 or 1, got {minor_dim}")
    idx = jnp.asarray(lin_idx, jnp.int32)
    width = jnp.int32(tile_width)
    major = jnp.asarray(shape[1 - minor_dim], jnp.int32)
    minor = jnp.asarray(shape[minor_dim], jnp.int32)
    tile = lax.div(idx, width * major)
    full_tiles = lax.div(minor, width)
    in_full = idx < full_tiles * width * major
    # Inside the last, narrower tile, positions count from its start, in rows of its width.
    local = jnp.where(in_full, idx, idx - full_tiles * width * major)
    row = jnp.where(in_full, width, jnp.maximum(minor - full_tiles * width, 1))
    along_minor = tile * width + lax.rem(local, row)
    along_major = lax.rem(lax.div(local, row), major)
    along_major = jnp.where(lax.rem(tile, jnp.int32(2)) == 0, along_major,
                            major - 1 - along_major)
    return (along_minor, along_major) if minor_dim == 0 else (along_major, along_minor)
