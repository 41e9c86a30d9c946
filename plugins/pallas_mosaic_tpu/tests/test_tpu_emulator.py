"""The Mosaic TPU emulator: kernels lowered for TPU (by this backend and by
jax.experimental.pallas), their ``tpu_custom_call`` executed with numpy by ``pl.emulate``, and
compared with jax.numpy on random inputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core.emulation.call import EmulatedCall, EmulateOptions
from pallas_core.errors import PallasError, UnsupportedError

pltpu = pytest.importorskip("pallas_mosaic_tpu")
import test_tpu_lowering as seeds  # noqa: E402
from pallas_mosaic_tpu import emulator, inspection  # noqa: E402

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
MODULES = [pytest.param(pl, id="ours"), pytest.param(jax_pl, id="jax")]


def _tpu(m: Any) -> Any:
    return pltpu if m is pl else jax_pltpu


def _x(shape: tuple[int, ...], seed: int = 0, dtype: Any = F32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _emulate(f: Callable[..., Any], *args: Any, seed: int | None = None) -> Any:
    # JAX's lowering asks which chip it lowers for: pl.emulate tells it (a v5e by default).
    return pl.emulate(f, backend="mosaic_tpu", seed=seed)(*args)


def _params(m: Any, *semantics: str) -> dict[str, Any]:
    return {"compiler_params": _tpu(m).CompilerParams(dimension_semantics=semantics)}


# --- the seed kernels of test_tpu_lowering ---------------------------------------------------

def _seed_cases() -> dict[str, tuple[Callable[[Any], Any], list[Any], Callable[..., Any]]]:
    q, k, v = (_x((256, 128), s) for s in range(3))
    a, b = _x((256, 256), 3, BF16), _x((256, 256), 4, BF16)
    xs = _x((48, 128), 5)
    r = _x((16, 128), 6)
    rows = r.reshape(2, 8, 128)
    return {
        "blocked_add": (seeds.blocked_add, [_x((16, 256), 7), _x((16, 256), 8)],
                        lambda x, y: x + y),
        "matmul_3d_bf16": (seeds.matmul_3d, [a, b],
                           lambda x, y: jnp.dot(x, y, preferred_element_type=F32)),
        "softmax": (seeds.softmax, [_x((32, 256), 9)], lambda x: jax.nn.softmax(x, axis=1)),
        "flash_attention": (seeds.flash_attention, [q, k, v],
                            lambda q, k, v: jax.nn.softmax(q @ k.T, axis=1) @ v),
        "prefetch_gather": (seeds.prefetch_gather, [jnp.asarray(seeds.IDX), xs],
                            lambda i, x: jnp.concatenate([x[8 * j:8 * j + 8] for j in i]) * 2),
        "dma_copy": (seeds.dma_copy, [r[:8]], lambda x: x + 1.0),
        "dma_copy_hbm": (seeds.dma_copy_hbm, [r[:8]], lambda x: x + 1.0),
        "row_writes": (seeds.row_writes, [r], lambda x: jnp.concatenate(
            [rows[:, :1] * 2.0, rows[:, 1:2] + 1.0, rows[:, 2:] - 1.0], axis=1).reshape(16, 128)),
    }


SEEDS = _seed_cases()


@pytest.mark.parametrize("m", MODULES)
@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seed_kernels(name: str, m: Any) -> None:
    build, args, want = SEEDS[name]
    tol = 2e-2 if "bf16" in name else 1e-5
    np.testing.assert_allclose(_emulate(build(m), *args), want(*args), rtol=tol, atol=tol)


def test_core_kernel_of_ours() -> None:
    c = _x((8, 128), 1)
    np.testing.assert_array_equal(_emulate(seeds.core_kernel(pl), c), c)


# --- grid, windows and memory ----------------------------------------------------------------

def edge_blocks(m: Any) -> Callable[..., Any]:
    """A (20, 300) array in (8, 128) blocks: the last row and column of blocks run past the
    edge (padded when read, cut when written)."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.sin(x_ref[...]) * 2.0

    spec = m.BlockSpec((8, 128), lambda i, j: (i, j))
    return lambda x: m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   grid=(3, 3), in_specs=[spec], out_specs=spec,
                                   **_params(m, "parallel", "parallel"))(x)


def row_sums_with_scratch(m: Any) -> Callable[..., Any]:
    """Sums each row of a (16, 512) array over 4 column blocks in a VMEM scratch accumulator,
    writing the total at the last step: scratch persists over the grid."""
    def kernel(x_ref: Any, o_ref: Any, acc_ref: Any) -> None:
        @m.when(m.program_id(1) == 0)
        def _() -> None:
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)

        @m.when(m.program_id(1) == m.num_programs(1) - 1)
        def _() -> None:
            o_ref[...] = jnp.broadcast_to(acc_ref[...], o_ref.shape)

    return lambda x: m.pallas_call(
        kernel, jax.ShapeDtypeStruct((16, 128), F32), grid=(2, 4),
        in_specs=[m.BlockSpec((8, 128), lambda i, j: (i, j))],
        out_specs=m.BlockSpec((8, 128), lambda i, j: (i, 0)),
        scratch_shapes=[_tpu(m).VMEM((8, 1), F32)],
        **_params(m, "parallel", "arbitrary"))(x)


def aliased_update(m: Any) -> Callable[..., Any]:
    """Output 0 aliases input 1 and only its first row of blocks is written: the rest keeps
    the input's values."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + y_ref[...]

    spec = m.BlockSpec((8, 128), lambda j: (0, j))
    return lambda x, y: m.pallas_call(
        kernel, jax.ShapeDtypeStruct(y.shape, y.dtype), grid=(2,), in_specs=[spec, spec],
        out_specs=spec, input_output_aliases={1: 0})(x, y)


def loop_and_reductions(m: Any) -> Callable[..., Any]:
    """fori_loop over row slices with max/min/sum reductions, bf16 input, f32 output."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        def body(i: Any, acc: Any) -> Any:
            rows = x_ref[m.ds(i * 8, 8), :].astype(F32)
            return acc + jnp.max(rows, axis=0, keepdims=True) - jnp.min(rows, axis=0,
                                                                        keepdims=True)

        acc = jax.lax.fori_loop(0, 4, body, jnp.zeros((1, 128), F32))
        o_ref[...] = jnp.broadcast_to(acc + jnp.sum(x_ref[...].astype(F32)), o_ref.shape)

    return lambda x: m.pallas_call(
        kernel, jax.ShapeDtypeStruct((8, 128), F32),
        in_specs=[m.BlockSpec((32, 128), lambda: (0, 0))],
        out_specs=m.BlockSpec((8, 128), lambda: (0, 0)))(x)


def _loop_and_reductions_ref(x: Any) -> Any:
    r = x.astype(F32).reshape(4, 8, 128)
    acc = jnp.sum(r.max(axis=1) - r.min(axis=1), axis=0, keepdims=True)
    return jnp.broadcast_to(acc + jnp.sum(x.astype(F32)), (8, 128))


def double_buffered_dma(m: Any) -> Callable[..., Any]:
    """Manual double buffering: four (8, 128) slabs of an ANY array copied into two VMEM
    slots with two DMA semaphores, each slab scaled and copied back out."""
    tpu = _tpu(m)

    def kernel(x_hbm: Any, o_hbm: Any, buf: Any, sems: Any, out_sem: Any) -> None:
        def fetch(i: Any, slot: Any) -> Any:
            return tpu.make_async_copy(x_hbm.at[m.ds(i * 8, 8)], buf.at[slot], sems.at[slot])

        fetch(0, 0).start()

        def body(i: Any, carry: Any) -> Any:
            slot = i % 2

            @m.when(i + 1 < 4)
            def _() -> None:
                fetch(i + 1, 1 - slot).start()

            fetch(i, slot).wait()
            buf[slot] = buf[slot] * 3.0
            out = tpu.make_async_copy(buf.at[slot], o_hbm.at[m.ds(i * 8, 8)], out_sem)
            out.start()
            out.wait()
            return carry

        jax.lax.fori_loop(0, 4, body, 0)

    whole = m.BlockSpec(memory_space=m.ANY)
    return lambda x: m.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[whole], out_specs=whole,
        scratch_shapes=[tpu.VMEM((2, 8, 128), F32), tpu.SemaphoreType.DMA((2,)),
                        tpu.SemaphoreType.DMA])(x)


def dynamic_grid(m: Any) -> Callable[..., Any]:
    """A grid whose size is a traced value: only the first ``n`` row blocks are written."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + m.program_id(0).astype(F32)

    spec = m.BlockSpec((8, 128), lambda i: (i, 0))

    def f(n: Any, x: Any) -> Any:
        return m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(n,),
                             in_specs=[spec], out_specs=spec)(x)
    return jax.jit(f)


GRID: dict[str, tuple[Callable[[Any], Any], list[Any], Callable[..., Any]]] = {
    "edge_blocks": (edge_blocks, [_x((20, 300), 10)], lambda x: jnp.sin(x) * 2.0),
    "row_sums_with_scratch": (row_sums_with_scratch, [_x((16, 512), 11)],
                              lambda x: jnp.broadcast_to(x.sum(1, keepdims=True), (16, 128))),
    "aliased_update": (aliased_update, [_x((8, 256), 12), _x((16, 256), 13)],
                       lambda x, y: y.at[:8].add(x)),
    "loop_and_reductions_bf16": (loop_and_reductions, [_x((32, 128), 14, BF16)],
                                 _loop_and_reductions_ref),
    "double_buffered_dma": (double_buffered_dma, [_x((32, 128), 15)], lambda x: x * 3.0),
}


@pytest.mark.parametrize("m", MODULES)
@pytest.mark.parametrize("name", sorted(GRID))
def test_grid_and_memory(name: str, m: Any) -> None:
    build, args, want = GRID[name]
    tol = 2e-2 if "bf16" in name else 1e-5
    np.testing.assert_allclose(_emulate(build(m), *args), want(*args), rtol=tol, atol=tol)


@pytest.mark.parametrize("m", MODULES)
def test_dynamic_grid(m: Any) -> None:
    x = _x((32, 128), 16)
    got = _emulate(dynamic_grid(m), jnp.int32(3), x)
    want = np.array(x)
    want[:24] = (x[:24].reshape(3, 8, 128) * 2.0 + jnp.arange(3.0)[:, None, None]).reshape(
        24, 128)
    np.testing.assert_allclose(got[:24], want[:24], rtol=1e-6)


@pytest.mark.parametrize("m", MODULES)
def test_parallel_axes_shuffled_give_the_same_result(m: Any) -> None:
    a, b = _x((256, 256), 17, BF16), _x((256, 256), 18, BF16)
    first = _emulate(seeds.matmul_3d(m), a, b)
    for seed in (1, 2):
        np.testing.assert_array_equal(_emulate(seeds.matmul_3d(m), a, b, seed=seed), first)


def test_shuffle_exposes_a_kernel_that_is_not_parallel() -> None:
    """A kernel that carries state from one grid step to the next over an axis it calls
    parallel gives a different result when the points run in another order."""
    def kernel(x_ref: Any, o_ref: Any, carry: Any) -> None:
        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            carry[...] = jnp.zeros_like(carry)

        carry[...] += x_ref[...]
        o_ref[...] = carry[...]

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((64, 128), F32), grid=(8,),
                       in_specs=[spec], out_specs=spec,
                       scratch_shapes=[pltpu.VMEM((8, 128), F32)],
                       compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))
    x = _x((64, 128), 19)
    want = np.cumsum(np.asarray(x).reshape(8, 8, 128), axis=0).reshape(64, 128)
    np.testing.assert_allclose(_emulate(f, x), want, rtol=1e-5)
    assert not np.allclose(_emulate(f, x, seed=3), want)


def _per_core_running_sum(m: Any) -> Any:
    """Grid (2, 4), leading axis parallel: a running sum over the steps, restarted at 100
    where a flag in scalar prefetch (cleared by the kernel) is still set."""
    tpu = _tpu(m)

    def kernel(flag_ref: Any, x_ref: Any, o_ref: Any, acc: Any) -> None:
        @pl.when(flag_ref[0] == 1)
        def _() -> None:
            acc[...] = jnp.full_like(acc, 100.0)
            flag_ref[0] = 0

        acc[...] += x_ref[...]
        o_ref[...] = acc[...]

    spec = m.BlockSpec((8, 128), lambda i, j, flag: (i * 4 + j, 0))
    grid_spec = tpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(2, 4),
                                           in_specs=[spec], out_specs=spec,
                                           scratch_shapes=[tpu.VMEM((8, 128), F32)])
    return m.pallas_call(kernel, jax.ShapeDtypeStruct((64, 128), F32), grid_spec=grid_spec,
                         **_params(m, "parallel", "arbitrary"))


@pytest.mark.parametrize("m", MODULES)
def test_megacore_chip_shares_the_parallel_axis_between_two_cores(m: Any) -> None:
    """On v5p each TensorCore runs half of the leading parallel axis with its own copy of the
    scalar prefetch and its own scratch (found emulating paged_attention's megacore modes);
    on v5e one core runs it all, so the flag it cleared stays cleared."""
    x, flag = _x((64, 128), 20), jnp.ones((1,), I32)
    steps = np.asarray(x).reshape(2, 4, 8, 128)
    two = pl.emulate(_per_core_running_sum(m), backend="mosaic_tpu", target="v5p")(flag, x)
    one = pl.emulate(_per_core_running_sum(m), backend="mosaic_tpu", target="v5e")(flag, x)
    np.testing.assert_allclose(two, 100 + np.cumsum(steps, axis=1).reshape(64, 128),
                               rtol=1e-5)
    np.testing.assert_allclose(one, 100 + np.cumsum(steps.reshape(8, 8, 128), axis=0).reshape(
        64, 128), rtol=1e-5)


def test_an_unknown_target_is_refused() -> None:
    with pytest.raises(PallasError, match=r"target='v9'.*unknown TPU generation"):
        pl.emulate(_per_core_running_sum(pl), backend="mosaic_tpu", target="v9")(
            jnp.ones((1,), I32), _x((64, 128)))

# --- what the emulator reports ---------------------------------------------------------------

# pl.emulate raises the emulator's own error, also when the kernel ran inside a callback.
_RAISED = PallasError


def test_a_wait_nothing_signals_is_reported() -> None:
    def kernel(x_hbm: Any, o_hbm: Any, sem: Any) -> None:
        pltpu.make_async_copy(x_hbm, o_hbm, sem).wait()

    whole = pl.BlockSpec(memory_space=pl.ANY)
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), F32), in_specs=[whole],
                       out_specs=whole, scratch_shapes=[pltpu.SemaphoreType.DMA])
    with pytest.raises(_RAISED, match="would hang"):
        _emulate(f, _x((8, 128)))


def test_kernels_that_talk_to_other_devices_are_refused_outside_shard_map() -> None:
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    x = _x((64, 128))
    text = seeds.ring_permute(pl, ("x",), (8,)).trace(x).lower(
        lowering_platforms=("tpu",)).as_text()
    ((config, module),) = inspection.kernels(text)
    with pytest.raises(UnsupportedError, match=r"outside a shard_map"):
        emulator.run_kernel(module, [np.asarray(x[:8])], [((8, 128), np.dtype(np.float32))],
                            [], EmulateOptions(backend="mosaic_tpu"))
    call = EmulatedCall(target="tpu_custom_call", backend_config=json.dumps(
        {"custom_call_config": {**config["custom_call_config"], "body": "?"}}),
        attributes={}, operands=[np.asarray(x[:8])], results=[((8, 128), np.dtype("f4"))],
        aliases=[], options=EmulateOptions(backend="mosaic_tpu"), name="ring")
    with pytest.raises(UnsupportedError, match=r"talks to other devices.*shard_map"):
        call.run_jointly(lambda calls: [[]])


# --- kernels of a shard_map: every device runs its kernel, together ------------------------


def _need_devices(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _mesh(shape: tuple[int, ...], axes: tuple[str, ...]) -> Any:
    _need_devices(int(np.prod(shape)))
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                         devices=jax.devices()[:int(np.prod(shape))])


def _per_device(mesh: Any, f: Callable[..., Any], spec: Any = None) -> Callable[..., Any]:
    spec = spec if spec is not None else jax.P(mesh.axis_names)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


@pytest.mark.parametrize("mesh_name", sorted(seeds.MESHES))
@pytest.mark.parametrize("m", MODULES)
def test_ring_permute_runs_on_every_device_together(m: Any, mesh_name: str) -> None:
    """Remote DMAs and barrier signals between the devices of a shard_map: the emulated
    devices' kernels run together and each shard lands on the next device of the ring."""
    axes, shape = seeds.MESHES[mesh_name]
    _need_devices(int(np.prod(shape)))
    n = int(np.prod(shape))
    x = _x((n * 8, 128), seed=5)
    out = _emulate(seeds.ring_permute(m, axes, shape), x)
    blocks = np.asarray(x).reshape(*shape, 8, 128)
    want = np.roll(blocks, 1, axis=len(shape) - 1).reshape(n * 8, 128)
    np.testing.assert_array_equal(out, want)


def _gather_to_first(m: Any, n: int) -> Callable[..., Any]:
    """Every device copies its shard into row ``d`` of device 0's output (remote DMAs into
    views at offsets), then signals device 0, which waits for all of them."""
    tpu = _tpu(m)

    def kernel(x_ref: Any, o_ref: Any, send_sem: Any, recv_sem: Any) -> None:
        me = jax.lax.axis_index("x")
        copy = tpu.make_async_remote_copy(x_ref, o_ref.at[me], send_sem, recv_sem,
                                          device_id=(0,),
                                          device_id_type=m.DeviceIdType.MESH)
        copy.start()
        copy.wait_send()

        @m.when(me == 0)
        def _() -> None:
            for _ in range(n):
                tpu.make_async_remote_copy(x_ref, o_ref.at[0], send_sem, recv_sem,
                                           device_id=(0,),
                                           device_id_type=m.DeviceIdType.MESH).wait_recv()

    def per_device(x: Any) -> Any:
        whole = m.BlockSpec(memory_space=m.ANY)
        out = m.pallas_call(
            kernel, jax.ShapeDtypeStruct((n, *x.shape), x.dtype), in_specs=[whole],
            out_specs=whole, scratch_shapes=[tpu.SemaphoreType.DMA, tpu.SemaphoreType.DMA],
            compiler_params=tpu.CompilerParams(has_side_effects=True))(x)
        return out.reshape(n * x.shape[0], *x.shape[1:])
    return per_device


@pytest.mark.parametrize("m", MODULES)
def test_remote_dmas_land_at_their_offsets_on_the_target_device(m: Any) -> None:
    n = 4
    mesh = _mesh((n,), ("x",))
    x = _x((n * 8, 128), seed=6)
    out = np.asarray(_emulate(_per_device(mesh, _gather_to_first(m, n)), x))
    # Device 0 holds every shard in order; the other devices' outputs were never written.
    np.testing.assert_array_equal(out[:n * 8 * n].reshape(n, n * 8, 128)[0], np.asarray(x))


@pytest.mark.parametrize("m", MODULES)
def test_device_ids_without_communication_run_per_device(m: Any) -> None:
    """A kernel reading lax.axis_index (the device id) but sending nothing: each device's
    kernel runs on its own, with its own id."""
    mesh = _mesh((2, 4), ("y", "x"))

    def kernel(x_ref: Any, o_ref: Any) -> None:
        where = jax.lax.axis_index("y") * 10 + jax.lax.axis_index("x")
        o_ref[...] = x_ref[...] + where.astype(jnp.float32)

    def per_device(x: Any) -> Any:
        return m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    x = _x((64, 128), seed=7)
    out = _emulate(_per_device(mesh, per_device), x)
    offsets = (np.arange(2)[:, None] * 10 + np.arange(4)[None, :]).reshape(8, 1, 1)
    want = np.asarray(x).reshape(8, 8, 128) + offsets
    np.testing.assert_allclose(np.asarray(out).reshape(8, 8, 128), want, rtol=1e-6)


def _barrier_then(m: Any, n: int, waits: int, peer: Callable[[Any], Any]) -> Callable[..., Any]:
    tpu = _tpu(m)

    def kernel(x_ref: Any, o_ref: Any) -> None:
        me = jax.lax.axis_index("x")
        barrier = tpu.get_barrier_semaphore()
        m.semaphore_signal(barrier, 1, device_id=(peer(me),),
                           device_id_type=m.DeviceIdType.MESH)
        m.semaphore_wait(barrier, waits)
        o_ref[...] = x_ref[...] * 2

    def per_device(x: Any) -> Any:
        return m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                             compiler_params=tpu.CompilerParams(collective_id=0))(x)
    return per_device


@pytest.mark.parametrize("m", MODULES)
def test_a_barrier_handshake_completes(m: Any) -> None:
    mesh = _mesh((4,), ("x",))
    x = _x((32, 128), seed=8)
    out = _emulate(_per_device(mesh, _barrier_then(m, 4, 1, lambda me: (me + 1) % 4)), x)
    np.testing.assert_allclose(out, 2 * np.asarray(x), rtol=1e-6)


@pytest.mark.parametrize("m", MODULES)
def test_a_device_waiting_for_a_signal_nobody_sends_is_reported(m: Any) -> None:
    mesh = _mesh((4,), ("x",))
    f = _per_device(mesh, _barrier_then(m, 4, 2, lambda me: (me + 1) % 4))
    with pytest.raises(_RAISED, match=r"kernel 'kernel' would hang: devices 0, 1, 2, 3 "
                       r"wait at tpu.sem_wait .* for 2 \(finished: none\)"):
        _emulate(f, _x((32, 128)))


@pytest.mark.parametrize("m", MODULES)
def test_a_signal_to_a_device_outside_the_mesh_is_reported(m: Any) -> None:
    mesh = _mesh((4,), ("x",))
    f = _per_device(mesh, _barrier_then(m, 4, 1, lambda me: me + 1))
    with pytest.raises(_RAISED, match=r"names device 4; the shard_map's mesh has 4 devices"):
        _emulate(f, _x((32, 128)))


# --- miscompiles the emulator exposed --------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
def test_erf_inv_of_plus_and_minus_one_is_infinite(dtype: Any) -> None:
    """The shared erf_inv rule gave -inf at 1 and +inf at -1 (its tail polynomial at w = inf),
    found by the rule matrix emulated on bfloat16."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jax.lax.erf_inv(x_ref[...])

    x = jnp.concatenate([jnp.asarray([1.0, -1.0, 0.0, 0.5, -0.999]), _x((123,), 20) * 0.3]
                        ).astype(dtype).reshape(1, 128)
    x = jnp.broadcast_to(x, (8, 128))
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, dtype))
    tol = 2e-2 if dtype == BF16 else 2e-5
    np.testing.assert_allclose(np.asarray(_emulate(f, x), np.float32),
                               np.asarray(jax.lax.erf_inv(x), np.float32), rtol=tol, atol=tol)


# --- the kernels of test_tpu_shape_and_mask_rules, test_tpu_primitives, test_tpu_pipeline ----

def _shape_cases() -> dict[str, tuple[Callable[[Any], Any], list[Any], Callable[..., Any]]]:
    import test_tpu_shape_and_mask_rules as shapes

    def chained(x: Any) -> Any:
        want = np.array(x).reshape(2, 8, 128)
        want[:, 3] = want[:, 7] * 2.0
        return want.reshape(16, 128)

    def tiled(x: Any) -> Any:
        b = x.reshape(2, 8, 256)
        return (b + jnp.tile(b[:, :, :128], (1, 1, 2))).reshape(16, 256)

    def corner(x: Any) -> Any:
        b = x.reshape(2, 8, 128)
        return (b * b[:, :1, :1]).reshape(16, 128)

    def packed_rows(x: Any) -> Any:
        words = jax.lax.bitcast_convert_type(x.reshape(16, 2, 128).transpose(0, 2, 1),
                                             jnp.uint32)
        return words[::2]

    return {
        "tiled": (shapes.tiled, [_x((16, 256), 21)], tiled),
        "scalar_reshapes": (shapes.scalar_reshapes, [_x((16, 128), 22)], corner),
        "masked_store": (shapes.masked_store, [_x((16, 128), 23)],
                         lambda x: jnp.where(jnp.arange(128) < 37, x, 0.0)),
        "chained_views": (shapes.chained_views, [_x((16, 128), 24)], chained),
        "squeezed_block": (shapes.squeezed_block, [_x((3, 16, 128), 25)], lambda x: x + 1.0),
        "reshaped_view": (shapes.reshaped_view, [_x((4, 8, 128), 26)],
                          lambda x: x.reshape(32, 128) * 2.0),
        "bitcast_strided": (shapes.bitcast_strided, [_x((32, 128), 27, BF16)], packed_rows),
        "shape_pieces": (shapes.shape_pieces, [_x((16, 256), 28)], shapes._pieces),
        "one_d_bf16": (lambda m: shapes.one_d_blocks(m, 512, BF16), [_x((2048,), 29, BF16)],
                       lambda x: x * 2),
    }


SHAPES = _shape_cases()


@pytest.mark.parametrize("m", MODULES)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_and_mask_kernels(name: str, m: Any) -> None:
    build, args, want = SHAPES[name]
    np.testing.assert_allclose(np.asarray(_emulate(build(m), *args), np.float64),
                               np.asarray(want(*args), np.float64), rtol=1e-6)


@pytest.mark.parametrize("ours", [True, False], ids=["ours", "jax"])
def test_roll_and_bitcast_primitives(ours: bool) -> None:
    import test_tpu_primitives as prims

    mods, backend = (prims.OURS, "mosaic_tpu") if ours else (prims.JAX, None)
    x = _x((16, 256), 30)
    for shift, axis in ((3, 1), (1, 0), (250, 1)):
        want = np.concatenate([np.roll(b, shift, axis) for b in np.split(np.asarray(x), 2)])
        np.testing.assert_array_equal(
            _emulate(prims.roll_static(mods, shift, axis, backend), x), want)
    np.testing.assert_array_equal(
        _emulate(prims.roll_strided(mods, 2, 1, 3, 0, backend), x[:8]),
        prims._np_roll_strided(np.asarray(x[:8]), 2, 1, 3, 0))
    for shape, src, dst in prims.BITCASTS.values():
        v = prims._random(shape, src, seed=5)
        got = _emulate(prims.bitcast_kernel(mods, shape, src, dst, backend), v)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      prims._np_bitcast(np.asarray(v), dst).view(np.uint8))


def test_emit_pipeline_matmul_of_ours() -> None:
    import test_tpu_pipeline as pipeline

    a, b = pipeline._operands()
    np.testing.assert_allclose(_emulate(pipeline.blog_matmul(pl, pltpu), a, b),
                               jnp.dot(a, b, preferred_element_type=F32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", MODULES)
def test_a_talking_kernel_only_some_devices_call_is_reported(
        m: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices 1..3 skip the kernel (a cond on the device index): device 0 waits for them at
    the meeting, and reports who did not come instead of hanging."""
    from pallas_core.emulation import api

    monkeypatch.setattr(api, "_MEETING_TIMEOUT_S", 2.0)
    mesh = _mesh((4,), ("x",))
    kernel = _barrier_then(m, 4, 1, lambda me: (me + 1) % 4)

    def per_device(x: Any) -> Any:
        return jax.lax.cond(jax.lax.axis_index("x") == 0, kernel, lambda v: v, x)

    with pytest.raises(_RAISED, match=r"devices \[0\] reached it, devices \[1, 2, 3\] did "
                       r"not within 2 s"):
        _emulate(_per_device(mesh, per_device), _x((32, 128)))


@pytest.mark.parametrize("m", MODULES)
def test_an_out_of_bounds_access_names_the_kernel_the_step_and_the_operand(m: Any) -> None:
    """The emulator's report said only ``vector.load at loc("-":24:10) ... out of bounds``
    (issue 34); it now names the kernel, the grid step and the operand, as the interpreter's
    checked mode does. Step 2 reads rows 16..23 of a 16-row scratch buffer."""
    def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
        i = m.program_id(0)
        s_ref[...] = jnp.zeros_like(s_ref)
        o_ref[...] = x_ref[...] + s_ref[m.ds(i * 8, 8), :]

    x = _x((32, 128), 7)
    f = m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                      in_specs=[m.BlockSpec((8, 128), lambda i: (i, 0))],
                      out_specs=m.BlockSpec((8, 128), lambda i: (i, 0)),
                      scratch_shapes=[_tpu(m).VMEM((16, 128), F32)], name="oob_scratch")
    with pytest.raises(PallasError, match=r"kernel 'oob_scratch' at grid step \(2,\), scratch "
                       r"operand 0: vector\.load .* indices 16\.\.23 of dimension 0 .* out of "
                       r"bounds"):
        _emulate(f, x)
