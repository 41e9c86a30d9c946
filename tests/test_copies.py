"""Asynchronous copies (local, and remote under shard_map) with their reference semantics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from pallas_interpret import InterpretParams

import pallas_core as pl
from pallas_core import copies

SEM = pl.MemorySpace("semaphore", zeroed=True)
WHOLE = pl.BlockSpec(memory_space=pl.ANY)


def test_a_local_copy_counts_its_bytes_until_waited_for() -> None:
    """``start`` moves the data and adds the copy's bytes to its semaphore (32 for 8 float32);
    ``wait`` takes them back."""

    def kernel(x_ref: Any, before_ref: Any, after_ref: Any, buf: Any, sems: Any) -> None:
        buf[...] = jnp.zeros_like(buf)
        copy = copies.async_copy(x_ref, buf, sems.at[0])
        before_ref[...] = buf[...]
        before_ref[0] = pl.semaphore_read(sems.at[0]).astype(jnp.float32)  # 32 bytes in flight
        copy.wait()
        after_ref[...] = buf[...]
        after_ref[0] += pl.semaphore_read(sems.at[0]).astype(jnp.float32)  # back to zero

    x = jax.random.normal(jax.random.key(0), (8,)) + 5.0
    sds = jax.ShapeDtypeStruct((8,), jnp.float32)
    before, after = pl.pallas_call(
        kernel, (sds, sds), in_specs=[WHOLE], out_specs=(WHOLE, WHOLE),
        scratch_shapes=[pl.ANY((8,), jnp.float32), SEM((1,), jnp.int32)])(x)
    np.testing.assert_allclose(before, np.r_[32.0, x[1:]])
    np.testing.assert_allclose(after, x)


def test_one_wait_for_several_copies_of_the_same_bytes() -> None:
    """Four copies of a quarter each on one semaphore, then one wait described by the whole
    buffer (as JAX 0.12's paged attention waits for its pages); a second such wait finds no
    bytes left and is reported."""

    def kernel(x_ref: Any, idx_ref: Any, o_ref: Any, sems: Any) -> None:
        for k in range(4):
            copies.async_copy(x_ref.at[idx_ref[k]], o_ref.at[k], sems.at[0])
        copies.make_async_copy(x_ref.at[pl.ds(0, 4)], o_ref, sems.at[0]).wait()

    def run(kernel: Any, x: jax.Array, idx: jax.Array) -> jax.Array:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((4, 128), jnp.float32),
                              in_specs=[WHOLE, pl.BlockSpec(memory_space=pl.ANY)],
                              out_specs=WHOLE, scratch_shapes=[SEM((1,), jnp.int32)],
                              compiler_params=InterpretParams(checked=True))(x, idx)

    x = jax.random.normal(jax.random.key(2), (8, 128))
    idx = jax.random.permutation(jax.random.key(3), 8)[:4].astype(jnp.int32)
    np.testing.assert_allclose(run(kernel, x, idx), x[idx])

    def twice(x_ref: Any, idx_ref: Any, o_ref: Any, sems: Any) -> None:
        kernel(x_ref, idx_ref, o_ref, sems)
        copies.make_async_copy(x_ref.at[pl.ds(0, 4)], o_ref, sems.at[0]).wait()

    with pytest.raises(Exception, match=r"deadlock: the local semaphore of an async copy"):
        run(twice, x, idx)
        jax.effects_barrier()


def test_copies_of_slices_and_sync_copy() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        copies.async_copy(x_ref.at[pl.ds(4, 4)], o_ref.at[pl.ds(0, 4)], sems.at[0]).wait()
        copies.sync_copy(x_ref.at[pl.ds(0, 4)], o_ref.at[pl.ds(4, 4)])

    x = jax.random.normal(jax.random.key(1), (8,))
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), in_specs=[WHOLE],
                         out_specs=WHOLE, scratch_shapes=[SEM((1,), jnp.int32)])(x)
    np.testing.assert_allclose(out, jnp.concatenate([x[4:], x[:4]]))


def test_checked_mode_reports_a_wait_for_a_copy_never_started() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        copies.make_async_copy(x_ref, o_ref, sems.at[0]).wait()

    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), in_specs=[WHOLE],
                          out_specs=WHOLE, scratch_shapes=[SEM((1,), jnp.int32)],
                          compiler_params=InterpretParams(checked=True))
    with pytest.raises(Exception, match=r"deadlock: the local semaphore of an async copy"):
        jax.block_until_ready(call(jnp.ones(8)))
        jax.effects_barrier()


def test_mismatched_copy_is_refused() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        copies.async_copy(x_ref, o_ref.at[pl.ds(0, 4)], sems.at[0])

    with pytest.raises(pl.PallasError, match=r"same shape and dtype.*Fix"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), in_specs=[WHOLE],
                       out_specs=WHOLE, scratch_shapes=[SEM((1,), jnp.int32)])(jnp.ones(8))


def _ring(n_dev: int, signal_too: bool) -> Any:
    """Each device sends its shard to the next device in the ring (a ppermute)."""

    def kernel(x_ref: Any, o_ref: Any, counts_ref: Any, sems: Any) -> None:
        me = jax.lax.axis_index("x")
        copy = copies.make_async_remote_copy(x_ref, o_ref, sems.at[0], sems.at[1],
                                             device_id=(me + 1) % n_dev)
        copy.start()
        if signal_too:
            pl.semaphore_signal(sems.at[2], me + 1, device_id=(me + n_dev - 1) % n_dev)
        counts_ref[0] = pl.semaphore_read(sems.at[1])  # bytes arrived
        counts_ref[1] = pl.semaphore_read(sems.at[2])  # signals from the next device
        copy.wait_send()
        copy.wait_recv()

    def per_device(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return pl.pallas_call(
            kernel, (jax.ShapeDtypeStruct(x.shape, x.dtype),
                     jax.ShapeDtypeStruct((2,), jnp.int32)),
            in_specs=[WHOLE], out_specs=(WHOLE, WHOLE),
            scratch_shapes=[SEM((3,), jnp.int32)])(x)

    return per_device


@pytest.mark.parametrize("signal_too", [False, True])
def test_remote_copy_ring_under_shard_map(signal_too: bool) -> None:
    n_dev = 4
    mesh = jax.make_mesh((n_dev,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n_dev])
    fn = jax.jit(jax.shard_map(_ring(n_dev, signal_too), mesh=mesh, in_specs=P("x"),
                               out_specs=(P("x"), P("x"))))
    x = jax.random.normal(jax.random.key(2), (n_dev * 8, 16))
    out, counts = fn(x)
    np.testing.assert_allclose(out, jnp.roll(x, 8, axis=0))  # shard d came from d - 1
    counts = np.asarray(counts).reshape(n_dev, 2)
    np.testing.assert_array_equal(counts[:, 0], 8 * 16 * 4)  # a shard's bytes
    if signal_too:  # device d is signalled by d + 1 with (d + 1) + 1
        np.testing.assert_array_equal(counts[:, 1], (np.arange(n_dev) + 1) % n_dev + 1)


def test_remote_copy_outside_shard_map_is_refused() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        copies.make_async_remote_copy(x_ref, o_ref, sems.at[0], sems.at[1], device_id=1).start()

    with pytest.raises(pl.UnsupportedError, match=r"shard_map.*Fix"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), in_specs=[WHOLE],
                       out_specs=WHOLE, scratch_shapes=[SEM((2,), jnp.int32)])(jnp.ones(8))
