"""A pallas_call inside ``jax.shard_map``: every device runs the kernel on its own shard.

On CPU, XLA exposes one device unless told otherwise, so this script asks for 8 host devices
through ``XLA_FLAGS``; that must happen before jax is imported (the device count is fixed
then). The out_shape inside ``shard_map`` is the per-device shape and needs no sharding
annotations. Run with ``python examples/shard_map_add.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_core as pl


def add_kernel(x_ref, y_ref, o_ref):
    """Adds one block of the local shards of ``x`` and ``y``."""
    o_ref[...] = x_ref[...] + y_ref[...]


def local_add(x: jax.Array, y: jax.Array, *, block: tuple[int, int] = (64, 128)) -> jax.Array:
    """``x + y`` on one device's shard, in blocks of ``block``."""
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    return pl.pallas_call(
        add_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),  # the local (per-shard) shape
        grid=(pl.cdiv(x.shape[0], block[0]), pl.cdiv(x.shape[1], block[1])),
        in_specs=[spec, spec],
        out_specs=spec,
    )(x, y)


ROWS = P("x", None)
"""Rows split across the mesh axis ``"x"``, columns whole."""


def sharded_add(x: jax.Array, y: jax.Array, mesh: Mesh) -> jax.Array:
    """``x + y`` with the rows of both split across the mesh axis ``"x"``.

    ``x`` and ``y`` should already be sharded that way (see ``shard_rows``).
    """
    fn = jax.shard_map(local_add, mesh=mesh, in_specs=(ROWS, ROWS), out_specs=ROWS)
    return fn(x, y)


def shard_rows(x: jax.Array, mesh: Mesh) -> jax.Array:
    """``x`` placed on ``mesh`` with its rows split across the axis ``"x"``."""
    return jax.device_put(x, NamedSharding(mesh, ROWS))


def make_mesh() -> Mesh:
    """A 1-D mesh named ``"x"`` over every available device."""
    return jax.make_mesh((len(jax.devices()),), ("x",))


def main() -> None:
    """Checks ``sharded_add`` (eager and jitted) against ``x + y`` on every device."""
    mesh = make_mesh()
    n = mesh.shape["x"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n * 128, 256)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((n * 128, 256)), jnp.float32)
    want = x + y
    x, y = shard_rows(x, mesh), shard_rows(y, mesh)
    got = sharded_add(x, y, mesh)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
    got = jax.jit(functools.partial(sharded_add, mesh=mesh))(x, y)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
    print(f"shard_map_add: OK on {n} devices (max abs err "
          f"{float(jnp.max(jnp.abs(got - want)))})")


if __name__ == "__main__":
    main()
