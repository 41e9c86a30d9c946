"""Interpreter defects found by running JAX's own kernel library, and the keyword surface of
semaphores and DMAs (JAX 0.10.2): each test fails without its fix.

* ``threefry2x32`` inside a kernel on the batched (vmapped) fast path;
* remote copies and signals land where the *sender's* views address them (JAX's all-gather);
* constants folded while a kernel runs inside an eager ``shard_map``;
* ``core_index=``, dict ``device_id``, ``priority=``, ``start(add=True)``;
* reads of traced length are refused with a PallasError; copies of traced length move that
  many elements.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pallas_mosaic_tpu as pltpu
import pytest
from jax import lax
from jax.extend.random import threefry2x32_p
from jax.sharding import PartitionSpec as P
from pallas_interpret import InterpretParams

import pallas_core as pl
from tests.jax_library import porting

WHOLE = pl.BlockSpec(memory_space=pl.ANY)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:n])


# --- 1. threefry2x32 on the batched fast path ------------------------------------------------


@jax.jit
def _threefry_in_jit(*args: Any) -> Any:
    return threefry2x32_p.bind(*args)


def _threefry_kernel(key_ref: Any, o_ref: Any, *, hash_fn: Any) -> None:
    """Counts differ per block (program ids); the high half is ``zeros_like`` of the low
    half, which ``vmap`` leaves unbatched while the low half is batched."""
    rows, cols = o_ref.shape
    step = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    lo = (lax.broadcasted_iota(jnp.uint32, (rows, cols), 0) * cols
          + lax.broadcasted_iota(jnp.uint32, (rows, cols), 1)
          + (step * rows * cols).astype(jnp.uint32))
    hi = jnp.zeros_like(lo)
    k1 = jnp.reshape(key_ref[0, 0], (1, 1))
    k2 = jnp.reshape(key_ref[0, 1], (1, 1))
    a, b = hash_fn(k1, k2, hi, lo)
    o_ref[...] = a ^ b


@pytest.mark.parametrize("in_jit", [False, True])
@pytest.mark.parametrize("fast", [True, False])
def test_threefry_in_a_kernel_batched_and_step_by_step(fast: bool, in_jit: bool) -> None:
    hash_fn = _threefry_in_jit if in_jit else threefry2x32_p.bind
    key = jax.random.randint(jax.random.key(0), (1, 2), 0, 2**31 - 1).astype(jnp.uint32)
    grid, block = (2, 3), (8, 128)
    out = pl.pallas_call(
        functools.partial(_threefry_kernel, hash_fn=hash_fn),
        jax.ShapeDtypeStruct((16, 384), jnp.uint32), grid=grid,
        in_specs=[pl.BlockSpec((1, 2), lambda i, j: (0, 0))],
        out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
        compiler_params=InterpretParams(fast=fast))(key)
    # Reference: the same hash of the same counts, on whole arrays outside any kernel.
    steps = np.arange(6).reshape(grid)
    counts = (np.arange(8 * 128).reshape(block)[None, None]
              + steps[:, :, None, None] * 8 * 128).astype(np.uint32)
    k1, k2 = (jnp.full(counts.shape, key[0, c], jnp.uint32) for c in (0, 1))
    a, b = threefry2x32_p.bind(k1, k2, jnp.zeros(counts.shape, jnp.uint32), jnp.asarray(counts))
    expected = np.asarray(a ^ b).transpose(0, 2, 1, 3).reshape(16, 384)
    np.testing.assert_array_equal(out, expected)


def test_ported_threefry_matches_jax_random(monkeypatch: pytest.MonkeyPatch) -> None:
    threefry = porting.ported("tpu.random.threefry")
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, backend="interpret"))
    key = jax.random.key_data(jax.random.key(7, impl="threefry2x32"))
    bits = threefry.threefry_2x32_count(key, (16, 256), (16, 256), (8, 128))
    expected = jax.random.bits(jax.random.wrap_key_data(key, impl="threefry2x32"), (16, 256),
                               jnp.uint32)
    np.testing.assert_array_equal(bits, expected)


# --- 2. devices under shard_map --------------------------------------------------------------


SHARD_BYTES = 8 * 16 * 4
"""A device's shard, (8, 16) float32: what its copy's arrival adds to a DMA semaphore."""


def _gather_to(n_dev: int, receiver: Any) -> Any:
    """Device ``d`` sends its shard to ``receiver(d)``, into slot ``d`` (its own index) of the
    receiver's output, and counts the arrival (its bytes) on the receiver's semaphore ``d``."""

    def kernel(x_ref: Any, o_ref: Any, counts_ref: Any, send: Any, recv: Any) -> None:
        me = lax.axis_index("x")
        o_ref[...] = jnp.zeros_like(o_ref)
        copy = pltpu.make_async_remote_copy(x_ref, o_ref.at[me], send.at[0], recv.at[me],
                                            device_id=receiver(me))
        copy.start()
        for d in range(n_dev):
            counts_ref[d] = pl.semaphore_read(recv.at[d])
        copy.wait_send()

    def per_device(x: jax.Array) -> Any:
        return pl.pallas_call(
            kernel, (jax.ShapeDtypeStruct((n_dev, *x.shape), x.dtype),
                     jax.ShapeDtypeStruct((n_dev,), jnp.int32)),
            in_specs=[WHOLE], out_specs=(WHOLE, WHOLE),
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,)), pltpu.SemaphoreType.DMA((n_dev,))],
        )(x)

    mesh = _mesh((n_dev,), ("x",))
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("x"),
                                 out_specs=(P("x"), P("x"))))


def test_remote_copy_lands_where_the_sender_addresses() -> None:
    n = 4
    x = jax.random.normal(jax.random.key(1), (n * 8, 16))
    out, counts = _gather_to(n, lambda me: (me + 1) % n)(x)
    out = np.asarray(out).reshape(n, n, 8, 16)
    shards = np.asarray(x).reshape(n, 8, 16)
    counts = np.asarray(counts).reshape(n, n)
    for d in range(n):
        sender = (d - 1) % n
        np.testing.assert_array_equal(out[d, sender], shards[sender])
        assert not np.any(np.delete(out[d], sender, axis=0))
        np.testing.assert_array_equal(counts[d], SHARD_BYTES * np.eye(n, dtype=np.int32)[sender])


def test_copies_from_every_device_to_one_all_land() -> None:
    n = 4
    x = jax.random.normal(jax.random.key(2), (n * 8, 16))
    out, counts = _gather_to(n, lambda me: 0)(x)
    out = np.asarray(out).reshape(n, n, 8, 16)
    counts = np.asarray(counts).reshape(n, n)
    np.testing.assert_array_equal(out[0], np.asarray(x).reshape(n, 8, 16))
    np.testing.assert_array_equal(counts[0], SHARD_BYTES * np.ones(n))
    assert not np.any(out[1:]) and not np.any(counts[1:])


def test_remote_signal_reaches_the_semaphore_the_sender_names() -> None:
    n = 4

    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        me = lax.axis_index("x")
        pl.semaphore_signal(sems.at[me], me + 1, device_id={"x": (me + 1) % n})
        for d in range(n):
            o_ref[d] = pl.semaphore_read(sems.at[d])

    def per_device(x: jax.Array) -> jax.Array:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((n,), jnp.int32), in_specs=[WHOLE],
                              out_specs=WHOLE, scratch_shapes=[pltpu.SemaphoreType.REGULAR((n,))],
                              )(x)

    fn = jax.jit(jax.shard_map(per_device, mesh=_mesh((n,), ("x",)), in_specs=P("x"),
                               out_specs=P("x")))
    counts = np.asarray(fn(jnp.ones((n,)))).reshape(n, n)
    expected = np.zeros((n, n), np.int32)
    for d in range(n):
        expected[d, (d - 1) % n] = (d - 1) % n + 1
    np.testing.assert_array_equal(counts, expected)


def test_local_copy_into_the_device_slot_in_an_eager_shard_map() -> None:
    """Constants folded while the kernel runs must not pick up shard_map's mesh."""
    n = 2

    def kernel(x_ref: Any, o_ref: Any, sem: Any) -> None:
        o_ref[...] = jnp.zeros_like(o_ref)
        pltpu.async_copy(x_ref, o_ref.at[lax.axis_index("x")], sem).wait()

    def per_device(x: jax.Array) -> jax.Array:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((n, *x.shape), x.dtype),
                              in_specs=[WHOLE], out_specs=WHOLE,
                              scratch_shapes=[pltpu.SemaphoreType.DMA])(x)

    x = jax.random.normal(jax.random.key(3), (n * 8, 128))
    out = jax.shard_map(per_device, mesh=_mesh((n,), ("x",)), in_specs=P("x"),
                        out_specs=P("x"))(x)  # no jit around it
    out = np.asarray(out).reshape(n, n, 8, 128)
    for d in range(n):
        np.testing.assert_array_equal(out[d, d], np.asarray(x).reshape(n, 8, 128)[d])
        assert not np.any(np.delete(out[d], d, axis=0))


@pytest.mark.parametrize(("shape", "axis"), [((2,), "x"), ((4,), "x"), ((2, 2), "y")])
def test_ported_all_gather_matches_lax_all_gather(shape: tuple[int, ...], axis: str) -> None:
    all_gather = porting.ported("tpu.all_gather")
    names = ("x", "y")[:len(shape)]
    mesh = _mesh(shape, names)
    n = mesh.shape[axis]

    def per_device(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        def kernel(x_ref: Any, o_ref: Any, s0: Any, s1: Any, r0: Any, r1: Any) -> None:
            # JAX passes the nested scratch tuples ((send, send), (recv, recv)) as they are.
            all_gather.ag_kernel(x_ref, o_ref, (s0, s1), (r0, r1), axis_name=axis, mesh=mesh)

        out = pl.pallas_call(
            kernel, jax.ShapeDtypeStruct((n, *x.shape), x.dtype),
            compiler_params=pltpu.CompilerParams(collective_id=0), backend="interpret",
            in_specs=[WHOLE], out_specs=WHOLE, scratch_shapes=[pltpu.SemaphoreType.DMA] * 4,
        )(x)
        return out.reshape((n * x.shape[0], *x.shape[1:])), lax.all_gather(x, axis, tiled=True)

    x = jax.random.normal(jax.random.key(4), (n * 16, 128))
    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(axis),
                               out_specs=(P(), P()), check_vma=False))
    got, expected = fn(x)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, x)


# --- 3. the keyword surface of semaphores and DMAs --------------------------------------------


@pytest.mark.parametrize("num_cores", [1, 2, 4])
def test_core_map_signals_every_core(num_cores: int) -> None:
    """JAX's test_core_map: each core signals every core's semaphore, then waits for all."""
    mesh = pltpu.create_tensorcore_mesh("x", num_cores=num_cores)
    rows = 16 // num_cores

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        def inner(refs: Any) -> None:
            x_ref, y_ref = refs

            @pl.core_map(mesh, interpret=InterpretParams(checked=True))
            def _() -> None:
                def body(x_vmem: Any, y_vmem: Any, dma_sem: Any, sem: Any) -> None:
                    for i in range(num_cores):
                        pl.semaphore_signal(sem, 1, core_index=i)
                    pl.semaphore_wait(sem, num_cores)
                    core = lax.axis_index("x")
                    rows_here = pl.ds(core * rows, rows)
                    pltpu.async_copy(x_ref.at[rows_here], x_vmem, dma_sem).wait()
                    y_vmem[...] = x_vmem[...] + core + 1
                    pltpu.async_copy(y_vmem, y_ref.at[rows_here], dma_sem).wait()

                pl.run_scoped(body, pltpu.VMEM((rows, 128), jnp.int32),
                              pltpu.VMEM((rows, 128), jnp.int32), pltpu.SemaphoreType.DMA,
                              pltpu.SemaphoreType.REGULAR)

        return pl.run_state(inner)((x, jnp.zeros_like(x)))[1]

    x = jax.random.randint(jax.random.key(5), (16, 128), -100, 100, jnp.int32)
    expected = (x.reshape(num_cores, rows, 128) + 1
                + jnp.arange(num_cores, dtype=jnp.int32)[:, None, None]).reshape(16, 128)
    np.testing.assert_array_equal(f(x), expected)


def _semaphore_kernel(body: Any) -> Any:
    return pl.pallas_call(lambda x_ref, o_ref, sems: body(sems, o_ref),
                          jax.ShapeDtypeStruct((2,), jnp.int32), in_specs=[WHOLE],
                          out_specs=WHOLE, scratch_shapes=[pltpu.SemaphoreType.REGULAR((2,))])


def test_core_index_outside_the_mesh_is_refused() -> None:
    mesh = pltpu.create_tensorcore_mesh("x", num_cores=2)

    def body(x_ref: Any, o_ref: Any, sem: Any) -> None:
        pl.semaphore_signal(sem, 1, core_index=2)

    call = pl.kernel(body, out_type=jax.ShapeDtypeStruct((8,), jnp.float32), mesh=mesh,
                     scratch_types=[pltpu.SemaphoreType.REGULAR], interpret=True)
    with pytest.raises(pl.PallasError, match=r"core_index=2.*2 cores.*Fix"):
        call(jnp.ones(8))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device_id": (0, 1), "device_id_type": pl.DeviceIdType.LOGICAL}, r"LOGICAL.*one index"),
    ({"device_id": {"x": 0}, "device_id_type": pl.DeviceIdType.LOGICAL}, r"dict.*MESH"),
    ({"device_id": {"nope": 0}}, r"axis 'nope'"),
    ({"inc": 1.5}, r"inc must be an integer"),
])
def test_malformed_signals_are_refused(kwargs: dict[str, Any], message: str) -> None:
    inc = kwargs.pop("inc", 1)

    def body(sems: Any, o_ref: Any) -> None:
        pl.semaphore_signal(sems.at[0], inc, **kwargs)
        o_ref[...] = sems[...]

    with pytest.raises(pl.PallasError, match=message):
        _semaphore_kernel(body)(jnp.ones(2))


def test_device_id_dict_over_two_axes_and_a_joint_axis() -> None:
    """``{"y": j}`` keeps this device's x; ``{("x", "y"): k}`` is a linear index."""

    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        x, y = lax.axis_index("x"), lax.axis_index("y")
        pl.semaphore_signal(sems.at[0], 1, device_id={"y": 1 - y})  # the other y, same x
        pl.semaphore_signal(sems.at[1], 10 * x + y + 1, device_id={("x", "y"): 3})
        o_ref[0] = pl.semaphore_read(sems.at[0])
        o_ref[1] = pl.semaphore_read(sems.at[1])

    def per_device(x: jax.Array) -> jax.Array:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((2,), jnp.int32), in_specs=[WHOLE],
                              out_specs=WHOLE,
                              scratch_shapes=[pltpu.SemaphoreType.REGULAR((2,))])(x)

    fn = jax.jit(jax.shard_map(per_device, mesh=_mesh((2, 2), ("x", "y")),
                               in_specs=P(("x", "y")), out_specs=P(("x", "y"))))
    counts = np.asarray(fn(jnp.ones(4))).reshape(4, 2)
    np.testing.assert_array_equal(counts[:, 0], [1, 1, 1, 1])
    np.testing.assert_array_equal(counts[:, 1], [0, 0, 0, 1 + 2 + 11 + 12])


def test_priority_is_accepted_and_checked() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        pltpu.async_copy(x_ref.at[pl.ds(0, 4)], o_ref.at[pl.ds(4, 4)], sems.at[0],
                         priority=1).wait()
        copy = pltpu.make_async_copy(x_ref.at[pl.ds(4, 4)], o_ref.at[pl.ds(0, 4)], sems.at[1])
        copy.start(priority=0)
        copy.wait()

    x = jax.random.normal(jax.random.key(6), (8,))
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), in_specs=[WHOLE],
                         out_specs=WHOLE,
                         scratch_shapes=[pltpu.SemaphoreType.DMA((2,))])(x)
    np.testing.assert_array_equal(out, jnp.roll(x, 4))

    def bad(x_ref: Any, o_ref: Any, sems: Any) -> None:
        pltpu.async_copy(x_ref, o_ref, sems.at[0], priority=-1).wait()

    with pytest.raises(pl.PallasError, match=r"priority=-1.*non-negative"):
        pl.pallas_call(bad, jax.ShapeDtypeStruct((8,), jnp.float32), in_specs=[WHOLE],
                       out_specs=WHOLE, scratch_shapes=[pltpu.SemaphoreType.DMA((2,))])(x)


def test_start_with_add_accumulates() -> None:
    def kernel(x_ref: Any, o_ref: Any, sem: Any) -> None:
        o_ref[...] = jnp.full_like(o_ref, 2.0)
        copy = pltpu.make_async_copy(x_ref, o_ref, sem)
        copy.start(add=True)
        copy.wait()

    x = jax.random.normal(jax.random.key(8), (8, 128))
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[WHOLE],
                         out_specs=WHOLE, scratch_shapes=[pltpu.SemaphoreType.DMA])(x)
    np.testing.assert_allclose(out, x + 2.0)


def _core_signal_kernel(m: Any, tpu: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any, sem: Any, dma_sem: Any) -> None:
        m.semaphore_signal(sem, 1, core_index=1 - lax.axis_index("c"))
        m.semaphore_wait(sem, 1)
        tpu.async_copy(x_ref, o_ref, dma_sem, priority=1).wait()

    return m.kernel(kernel, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                    mesh=tpu.create_tensorcore_mesh("c", num_cores=2),
                    scratch_types=[tpu.SemaphoreType.REGULAR, tpu.SemaphoreType.DMA])


def test_core_index_and_priority_lower_like_jax_experimental_pallas() -> None:
    from jax.experimental import pallas as jax_pl
    from jax.experimental.pallas import tpu as jax_pltpu
    from pallas_mosaic_tpu import inspection

    def ops(m: Any, tpu: Any) -> list[str]:
        text = jax.jit(_core_signal_kernel(m, tpu)).trace(jnp.ones((8, 128))).lower(
            lowering_platforms=("tpu",)).as_text()
        (_, module), = inspection.kernels(text)
        return [line.strip() for line in str(module).splitlines()
                if "tpu.sem_signal" in line or "tpu.enqueue_dma" in line]

    ours = ops(pl, pltpu)
    assert any("core_id" in op for op in ours) and any("priority = 1" in op for op in ours)
    assert ours == ops(jax_pl, jax_pltpu)


# --- 4. slices of traced length ----------------------------------------------------------------


def _traced_length_call(kernel: Any) -> Any:
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), WHOLE],
                          out_specs=WHOLE, scratch_shapes=[pltpu.SemaphoreType.DMA])


def test_read_of_traced_length_is_refused() -> None:
    def kernel(n_ref: Any, x_ref: Any, o_ref: Any, sem: Any) -> None:
        o_ref[pl.ds(0, n_ref[0])] = x_ref[pl.ds(0, n_ref[0])]

    with pytest.raises(pl.KernelTraceError, match=r"traced length.*Fix"):
        _traced_length_call(kernel)(jnp.array([3], jnp.int32), jnp.arange(8.0))


def test_copy_of_traced_length_moves_that_many_elements() -> None:
    """A copy of ``pl.ds(start, n)`` with ``n`` read when the kernel runs (as ragged
    attention copies its pages) moves exactly ``n`` elements, for random ``n``."""
    def kernel(n_ref: Any, x_ref: Any, o_ref: Any, sem: Any) -> None:
        n = n_ref[0]
        o_ref[...] = jnp.full((8,), -1.0)
        pltpu.async_copy(x_ref.at[pl.ds(1, n)], o_ref.at[pl.ds(0, n)], sem).wait()

    x = jax.random.normal(jax.random.key(4), (8,))
    for n in np.random.default_rng(0).integers(0, 8, 4):
        want = np.full((8,), -1.0, np.float32)
        want[:n] = np.asarray(x)[1:1 + n]
        got = _traced_length_call(kernel)(jnp.array([n], jnp.int32), x)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("add", [False, True])
def test_copy_of_traced_lengths_along_two_dimensions(add: bool) -> None:
    """A copy whose view has two slices of traced length (as a pipeline's edge block), from
    one view into a view of a view, at traced starts near the arrays' ends: exactly the
    ``n x m`` block moves (or is added), the rest stays."""
    def kernel(nm_ref: Any, x_ref: Any, o_ref: Any, buf: Any, sem: Any) -> None:
        n, m, r, c = nm_ref[0], nm_ref[1], nm_ref[2], nm_ref[3]
        buf[...] = jnp.full(buf.shape, -1.0)
        copy = pltpu.make_async_copy(x_ref.at[pl.ds(r, n), pl.ds(c, m)],
                                     buf.at[1].at[pl.ds(2, n), pl.ds(0, m)], sem)
        copy.start(add=add) if add else copy.start()
        copy.wait()
        pltpu.sync_copy(buf, o_ref)

    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 12, 16), jnp.float32),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), WHOLE],
                          out_specs=WHOLE,
                          scratch_shapes=[pltpu.VMEM((2, 12, 16), jnp.float32),
                                          pltpu.SemaphoreType.DMA])
    x = jax.random.normal(jax.random.key(6), (10, 20))
    rng = np.random.default_rng(1)
    for _ in range(4):
        n, m = int(rng.integers(0, 10)), int(rng.integers(0, 16))
        r, c = int(rng.integers(0, 10 - n + 1)), int(rng.integers(0, 20 - m + 1))
        want = np.full((2, 12, 16), -1.0, np.float32)
        want[1, 2:2 + n, :m] = np.asarray(x)[r:r + n, c:c + m] + (-1.0 if add else 0.0)
        got = call(jnp.array([n, m, r, c], jnp.int32), x)
        np.testing.assert_array_equal(got, want)
