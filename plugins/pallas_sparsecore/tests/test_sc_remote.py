"""Remote copies and signals from SparseCore kernels under ``shard_map``.

Every vector subcore of every device sends its row to the same subcore of another device:
a ring shift (``make_async_remote_copy`` from VMEM into the next device's HBM output) and an
all-gather (into every other device's VMEM, then out to HBM), after a handshake on the barrier
semaphore (``pl.semaphore_signal(..., device_id=...)``). On 2 and 4 CPU devices, for several
dtypes, on random inputs:

* the module lowered here has JAX's DMA and semaphore operations, with their attributes, and
  the same ``has_communication``/``collective_id`` configuration (JAX's kernel lowered on this
  host for a ``TPU7x``);
* our module, run by the SparseCore emulator (every subcore of every device together), and
  JAX's module, run by it too, equal ``np.roll`` / the gathered rows;
* the interpreter gives the same.
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core.emulation.call import EmulateOptions

plsc = pytest.importorskip("pallas_sparsecore")
jplsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")
import pallas_mosaic_tpu as pltpu  # noqa: E402
import test_sc_differential as D  # noqa: E402, N812
from jax.experimental import pallas as jpl  # noqa: E402
from jax.experimental.pallas import tpu as jpltpu  # noqa: E402
from pallas_mosaic_tpu import inspection  # noqa: E402
from pallas_sparsecore import emulator  # noqa: E402

SUBCORES = 2
W = 64
DTYPES = [jnp.float32, jnp.int32, jnp.bfloat16]
OPS = ("tpu.enqueue_dma", "tpu.wait_dma", "tpu.wait_dma2", "tpu.sem_signal", "tpu.sem_wait",
       "tpu.sem_barrier", "tpu.device_id")


def _mesh(sc: Any, subcores: int) -> Any:
    """One SparseCore's vector subcores (``sc``: this project's ``plsc`` or JAX's)."""
    return sc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                num_subcores=subcores)


def _need(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _namespaces(ours: bool) -> tuple[Any, Any, Any]:
    return (pl, pltpu, plsc) if ours else (jpl, jpltpu, jplsc)


def _params(ours: bool) -> Any:
    """The barrier semaphore's collective id: ``plsc.CompilerParams`` here, JAX's TPU params
    there."""
    return (plsc if ours else jpltpu).CompilerParams(collective_id=0)


def _handshake(p: Any, barrier: Any, peers: list[Any]) -> None:
    """Signal the barrier semaphore of the same subcore on each peer; wait for theirs."""
    for peer in peers:
        p.semaphore_signal(barrier, 1, device_id=(peer,))
    p.semaphore_wait(barrier, len(peers))


def ring(ours: bool, n: int, dtype: Any, abstract: bool = False, **kw: Any) -> Any:
    """Device ``d``'s subcore ``s`` sends its row to row ``s`` of device ``d + 1``'s output
    (``kw``: more arguments of ``pl.kernel``; ``abstract``: for lowering only)."""
    p, tpu, sc = _namespaces(ours)

    def per_device(x: Any) -> Any:
        mesh = _mesh(sc, SUBCORES)

        @p.kernel(out_type=jax.ShapeDtypeStruct((SUBCORES, W), dtype), mesh=mesh,
                  scratch_types=[tpu.VMEM((W,), dtype), tpu.SemaphoreType.DMA,
                                 tpu.SemaphoreType.DMA],
                  compiler_params=_params(ours), **kw)
        def k(x_hbm: Any, o_hbm: Any, buf: Any, send: Any, recv: Any) -> None:
            barrier = tpu.get_barrier_semaphore()
            me, s = lax.axis_index("x"), lax.axis_index("s")
            right, left = lax.rem(me + 1, n), lax.rem(me + n - 1, n)
            tpu.sync_copy(x_hbm.at[s], buf)
            _handshake(p, barrier, [left, right])
            copy = tpu.make_async_remote_copy(buf, o_hbm.at[s], send, recv,
                                              device_id=(right,))
            copy.start()
            copy.wait()
        return k(x)
    return _sharded(per_device, n, abstract)


def all_gather(ours: bool, n: int, dtype: Any, abstract: bool = False, **kw: Any) -> Any:
    """Device ``d``'s subcore ``s`` sends its row into row ``d`` of the same subcore's VMEM
    on every other device, keeps its own there, and writes the gathered rows out."""
    p, tpu, sc = _namespaces(ours)

    def per_device(x: Any) -> Any:
        mesh = _mesh(sc, SUBCORES)

        @p.kernel(out_type=jax.ShapeDtypeStruct((SUBCORES, n, W), dtype), mesh=mesh,
                  scratch_types=[tpu.VMEM((W,), dtype), tpu.VMEM((n, W), dtype),
                                 tpu.SemaphoreType.DMA, tpu.SemaphoreType.DMA],
                  compiler_params=_params(ours), **kw)
        def k(x_hbm: Any, o_hbm: Any, buf: Any, got: Any, send: Any, recv: Any) -> None:
            barrier = tpu.get_barrier_semaphore()
            me, s = lax.axis_index("x"), lax.axis_index("s")
            tpu.sync_copy(x_hbm.at[s], buf)
            tpu.sync_copy(buf, got.at[me])
            peers = [lax.rem(me + j, n) for j in range(1, n)]
            _handshake(p, barrier, peers)
            copies = [tpu.make_async_remote_copy(buf, got.at[me], send, recv,
                                                 device_id=(peer,))
                      for peer in peers]
            for c in copies:
                c.start()
            for c in copies:
                c.wait_send()
            for c in copies:  # each arrival is one row, whoever sent it
                c.wait_recv()
            tpu.sync_copy(got, o_hbm.at[s])
        return k(x)
    return _sharded(per_device, n, abstract)


def _abstract_mesh(n: int) -> Any:
    """A mesh of ``n`` TPU7x devices: JAX asks its abstract device which chip it lowers for
    (no TPU is attached here)."""
    device = jax.sharding.AbstractDevice(device_kind=D.DEVICE_KIND, num_cores=1,
                                         platform="tpu")
    return jax.sharding.AbstractMesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)


def _sharded(per_device: Any, n: int, abstract: bool = False) -> Any:
    """``per_device`` under ``shard_map`` over ``n`` devices (CPU devices, or for lowering
    only, TPU7x devices of an abstract mesh)."""
    mesh = _abstract_mesh(n) if abstract else jax.make_mesh(
        (n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=jax.P("x"),
                                 out_specs=jax.P("x"), check_vma=False))


KERNELS = {"ring": ring, "all_gather": all_gather}


def _rand(seed: int, n: int, dtype: Any) -> jax.Array:
    key = jax.random.key(seed)
    shape = (n * SUBCORES, W)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(key, shape, -1000, 1000, dtype)
    return jax.random.normal(key, shape, dtype)


def _want(name: str, x: Any, n: int) -> np.ndarray:
    rows = np.asarray(x).reshape(n, SUBCORES, W)
    if name == "ring":
        return np.roll(rows, 1, axis=0).reshape(n * SUBCORES, W)
    # Device d, subcore s: the rows of subcore s of every device, in device order.
    gathered = np.broadcast_to(rows.transpose(1, 0, 2)[None], (n, SUBCORES, n, W))
    return gathered.reshape(n * SUBCORES, n, W)


def _lowered(build: Any, n: int, x: Any) -> tuple[dict[str, Any], Any]:
    """The kernel ``build(n)`` makes, lowered for a TPU7x under ``shard_map``."""
    with jax.sharding.use_abstract_mesh(_abstract_mesh(n)):
        text = build(n).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    ((config, module),) = inspection.kernels(text)
    return config, module


def _ops(module: Any) -> list[tuple[str, ...]]:
    """The kernel's DMA and semaphore operations in order, with all their attributes."""
    found = []
    for op in D._walk(D._kernel_func(module)):
        if op.name in OPS:
            named = [op.attributes[i] for i in range(len(op.attributes))]
            found.append((op.name, *sorted(f"{a.name}={a.attr}" for a in named)))
    return found


def _emulate_module(config: dict[str, Any], module: Any, x: Any, n: int,
                    out: Any) -> np.ndarray:
    """``module`` (one device's kernel) run by the SparseCore emulator on every device
    together, each on its shard of ``x``."""
    assert config["custom_call_config"].get("has_communication") is True
    shards = np.asarray(x).reshape(n, SUBCORES, W)
    calls = [types.SimpleNamespace(operands=[shards[d]], results=[(out, np.dtype(x.dtype))],
                                   aliases=[], options=EmulateOptions(backend="sparsecore"),
                                   name="jax")
             for d in range(n)]
    per_device = emulator.run_devices(module, calls)  # type: ignore[arg-type]
    return np.concatenate([o for (o,) in per_device])


@pytest.mark.filterwarnings("ignore::UserWarning")  # push streams' semaphores, both sides
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_remote_copies_between_devices(name: str, n: int, dtype: Any) -> None:
    _need(n)
    build = KERNELS[name]
    x = _rand(n * 10 + len(name), n, dtype)
    want = _want(name, x, n)

    ours_config, ours_mod = _lowered(lambda k: build(True, k, dtype, abstract=True), n, x)
    jax_config, jax_mod = _lowered(lambda k: build(False, k, dtype, abstract=True), n, x)
    # The same keys, in the order the runtime reads them (the body aside).
    assert list(ours_config["custom_call_config"].items()) == \
        list(jax_config["custom_call_config"].items())
    assert ours_config["custom_call_config"]["has_communication"] is True
    found = _ops(ours_mod)
    assert any(o[0] == "tpu.enqueue_dma" for o in found)
    assert found == _ops(jax_mod)

    emulated = pl.emulate(build(True, n, dtype), backend="sparsecore")(x)
    np.testing.assert_array_equal(np.asarray(emulated), want)
    out_shape = (SUBCORES, *want.shape[1:])
    jax_emulated = _emulate_module(jax_config, jax_mod, x, n, out_shape)
    np.testing.assert_array_equal(jax_emulated, want)
    interpreted = build(True, n, dtype, interpret=True)(x)
    np.testing.assert_array_equal(np.asarray(interpreted), want)


def test_a_remote_gather_is_refused() -> None:
    _need(2)

    def per_device(x: Any) -> Any:
        mesh = _mesh(plsc, 1)

        @pl.kernel(out_type=jax.ShapeDtypeStruct((8, W), jnp.float32), mesh=mesh,
                   scratch_types=[pltpu.VMEM((8,), jnp.int32), pltpu.VMEM((8, W), jnp.float32),
                                  pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])
        def k(x_hbm: Any, o_hbm: Any, idx: Any, buf: Any, send: Any, recv: Any) -> None:
            idx[...] = lax.iota(jnp.int32, 8)
            pltpu.make_async_remote_copy(x_hbm.at[idx], buf, send, recv, device_id=(0,)).start()
        return k(x)

    x = jnp.zeros((16, W), jnp.float32)
    with pytest.raises(pl.UnsupportedError, match=r"remote gather or scatter.*sparsecore"):
        _lowered(lambda n: _sharded(per_device, n, abstract=True), 2, x)


def test_remote_waits_nothing_sends_are_reported() -> None:
    """A device that waits for an arrival no device sends: the emulator names the waits."""
    _need(2)

    def per_device(x: Any) -> Any:
        mesh = _mesh(plsc, 1)

        @pl.kernel(out_type=jax.ShapeDtypeStruct((1, W), jnp.float32), mesh=mesh,
                   scratch_types=[pltpu.VMEM((W,), jnp.float32), pltpu.SemaphoreType.DMA,
                                  pltpu.SemaphoreType.DMA])
        def k(x_hbm: Any, o_hbm: Any, buf: Any, send: Any, recv: Any) -> None:
            me = lax.axis_index("x")
            copy = pltpu.make_async_remote_copy(buf, o_hbm.at[0], send, recv,
                                                device_id=(lax.rem(me + 1, 2),))

            @pl.when(me == 0)
            def _() -> None:
                copy.start()
                copy.wait_send()
            copy.wait_recv()  # device 1 never sends to device 0
        return k(x)

    x = jnp.zeros((2, W), jnp.float32)
    with pytest.raises(pl.PallasError, match=r"would hang: device 0 \(core 0, subcore 0\) "
                       r"waits at tpu\.wait_dma"):
        jax.block_until_ready(pl.emulate(_sharded(per_device, 2), backend="sparsecore")(x))


def scoped_ring(n: int, **kw: Any) -> Any:
    """The ring through ``pl.run_scoped`` buffers and semaphores: each subcore sends its
    scoped VMEM row into the same subcore's scoped VMEM on the next device."""
    def per_device(x: Any) -> Any:
        mesh = _mesh(plsc, SUBCORES)

        @pl.kernel(out_type=jax.ShapeDtypeStruct((SUBCORES, W), x.dtype), mesh=mesh,
                   compiler_params=_params(True), **kw)
        def k(x_hbm: Any, o_hbm: Any) -> None:
            barrier = pltpu.get_barrier_semaphore()
            me, s = lax.axis_index("x"), lax.axis_index("s")
            right, left = lax.rem(me + 1, n), lax.rem(me + n - 1, n)

            def scoped(buf: Any, got: Any, send: Any, recv: Any) -> None:
                pltpu.sync_copy(x_hbm.at[s], buf)
                _handshake(pl, barrier, [left, right])  # both neighbours are in the scope
                copy = pltpu.make_async_remote_copy(buf, got, send, recv, device_id=(right,))
                copy.start()
                copy.wait()
                pltpu.sync_copy(got, o_hbm.at[s])
            pl.run_scoped(scoped, pltpu.VMEM((W,), x.dtype), pltpu.VMEM((W,), x.dtype),
                          pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA)
        return k(x)
    return _sharded(per_device, n)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("n", [2, 4])
def test_remote_copies_between_scoped_buffers(n: int) -> None:
    """Remote DMAs into the target subcore's ``run_scoped`` VMEM, counted on its scoped
    semaphore: emulated and interpreted, equal to ``np.roll``."""
    _need(n)
    x = _rand(n, n, jnp.float32)
    want = _want("ring", x, n)
    emulated = pl.emulate(scoped_ring(n), backend="sparsecore")(x)
    np.testing.assert_array_equal(np.asarray(emulated), want)
    np.testing.assert_array_equal(np.asarray(scoped_ring(n, interpret=True)(x)), want)
