"""Seed kernels lowered for TPU on CPU, verified, and compared with jax.experimental.pallas.

Each kernel is written once against a Pallas module argument (this project's, or JAX's: only
the import differs). Both are lowered with ``lowering_platforms=("tpu",)``; their Mosaic
modules are decoded and verified in a fresh context, and what a TPU runtime acts on must agree:
the grid, the dimension semantics, the window shapes, the scalar-prefetch and scratch counts,
and every index map evaluated on every grid point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
# The DMA wait the installed JAX emits (JAX 0.12's names both ends of the copy).
WAIT = "tpu.wait_dma " if plb.mosaic_waits_name_both_ends() else "tpu.wait_dma2 "


def _ours(m: Any) -> bool:
    return m is pl or getattr(m, "OURS", False)


def _params(m: Any, semantics: tuple[str, ...]) -> dict[str, Any]:
    if _ours(m):
        return {"compiler_params": pltpu.CompilerParams(dimension_semantics=semantics)}
    return {"compiler_params": jax_pltpu.CompilerParams(dimension_semantics=semantics)}


def blocked_add(m: Any) -> Callable[..., Any]:
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + y_ref[...]

    spec = m.BlockSpec((8, 128), lambda i, j: (i, j))
    return lambda x, y: m.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2, 2), in_specs=[spec, spec],
        out_specs=spec, **_params(m, ("parallel", "parallel")))(x, y)


def matmul_3d(m: Any) -> Callable[..., Any]:
    """bf16 in, float32 out, accumulating over the K grid axis (arbitrary semantics)."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        @m.when(m.program_id(2) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=F32)

    return lambda x, y: m.pallas_call(
        kernel, jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), F32), grid=(2, 2, 2),
        in_specs=[m.BlockSpec((128, 128), lambda i, j, k: (i, k)),
                  m.BlockSpec((128, 128), lambda i, j, k: (k, j))],
        out_specs=m.BlockSpec((128, 128), lambda i, j, k: (i, j)),
        **_params(m, ("parallel", "parallel", "arbitrary")))(x, y)


def softmax(m: Any) -> Callable[..., Any]:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...]
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

    spec = m.BlockSpec((8, 256), lambda i: (i, 0))
    return lambda x: m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                                   in_specs=[spec], out_specs=spec)(x)


def flash_attention(m: Any) -> Callable[..., Any]:
    def kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any) -> None:
        q = q_ref[...]

        def body(t: Any, carry: Any) -> Any:
            mx, s, acc = carry
            kb = k_ref[m.ds(t * 128, 128), :]
            vb = v_ref[m.ds(t * 128, 128), :]
            logits = jnp.dot(q, kb.T, preferred_element_type=F32)
            mx_new = jnp.maximum(mx, jnp.max(logits, axis=1, keepdims=True))
            p = jnp.exp(logits - mx_new)
            alpha = jnp.exp(mx - mx_new)
            return mx_new, s * alpha + jnp.sum(p, axis=1, keepdims=True), acc * alpha + jnp.dot(
                p, vb, preferred_element_type=F32)

        init = (jnp.full((128, 1), -jnp.inf, F32), jnp.zeros((128, 1), F32),
                jnp.zeros((128, 128), F32))
        _, s, acc = jax.lax.fori_loop(0, 2, body, init)
        o_ref[...] = acc / s

    qs = m.BlockSpec((128, 128), lambda i: (i, 0))
    kv = m.BlockSpec((256, 128), lambda i: (0, 0))
    return lambda q, k, v: m.pallas_call(
        kernel, jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(2,), in_specs=[qs, kv, kv],
        out_specs=qs)(q, k, v)


def prefetch_gather(m: Any) -> Callable[..., Any]:
    """Output block i is input block idx[i] doubled: blocks chosen by prefetched data."""
    def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0

    spec_in = m.BlockSpec((8, 128), lambda i, idx_ref: (idx_ref[i], 0))
    spec_out = m.BlockSpec((8, 128), lambda i, idx_ref: (i, 0))
    if _ours(m):
        grid_spec = pltpu.PrefetchScalarGridSpec(1, grid=(4,), in_specs=[spec_in],
                                                 out_specs=spec_out)
    else:
        grid_spec = jax_pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(4,),
                                                     in_specs=[spec_in], out_specs=spec_out)
    return lambda idx, x: m.pallas_call(
        kernel, jax.ShapeDtypeStruct((32, 128), x.dtype), grid_spec=grid_spec)(idx, x)


def dma_copy(m: Any, space: str = "ANY") -> Callable[..., Any]:
    """HBM -> VMEM -> HBM with run_scoped buffers and a DMA semaphore, adding 1 in VMEM."""
    tpu = pltpu if _ours(m) else jax_pltpu

    def kernel(x_hbm: Any, o_hbm: Any) -> None:
        def body(buf: Any, sem: Any) -> None:
            tpu.async_copy(x_hbm, buf, sem).wait()
            buf[...] = buf[...] + 1.0
            tpu.async_copy(buf, o_hbm, sem).wait()

        m.run_scoped(body, tpu.VMEM((8, 128), F32), tpu.SemaphoreType.DMA)

    whole = m.BlockSpec(memory_space=m.ANY if space == "ANY" else tpu.HBM)
    return lambda x: m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   in_specs=[whole], out_specs=whole)(x)


def dma_copy_hbm(m: Any) -> Callable[..., Any]:
    """The same copy with the operands placed in HBM explicitly (``pltpu.HBM``)."""
    return dma_copy(m, "HBM")


def core_kernel(m: Any) -> Callable[..., Any]:
    """``pl.kernel`` on a TensorCore mesh: the core copies HBM to HBM with the DMA engine."""
    tpu = pltpu if _ours(m) else jax_pltpu

    def body(x_hbm: Any, o_hbm: Any) -> None:
        tpu.sync_copy(x_hbm, o_hbm)

    mesh = tpu.create_tensorcore_mesh("core", num_cores=1)
    return lambda x: m.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              mesh=mesh)(x)


def row_writes(m: Any) -> Callable[..., Any]:
    """Reads and writes of a slice of size 1, a row by integer index, and a dynamic slice."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[0:1, :] = x_ref[0:1, :] * 2.0
        o_ref[1, :] = x_ref[1, :] + 1.0
        start = m.program_id(0) * 0 + 2
        o_ref[m.ds(start, 6), :] = x_ref[m.ds(start, 6), :] - 1.0

    spec = m.BlockSpec((8, 128), lambda i: (i, 0))
    return lambda x: m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                                   in_specs=[spec], out_specs=spec)(x)


IDX = np.array([3, 0, 5, 5], np.int32)
CASES: dict[str, tuple[Callable[[Any], Any], list[Any]]] = {
    "blocked_add": (blocked_add, [jnp.ones((16, 256), F32)] * 2),
    "matmul_3d_bf16": (matmul_3d, [jnp.ones((256, 256), BF16)] * 2),
    "softmax": (softmax, [jnp.ones((32, 256), F32)]),
    "flash_attention": (flash_attention, [jnp.ones((256, 128), F32)] * 3),
    "prefetch_gather": (prefetch_gather, [jnp.asarray(IDX), jnp.ones((48, 128), F32)]),
    "dma_copy": (dma_copy, [jnp.ones((8, 128), F32)]),
    "dma_copy_hbm": (dma_copy_hbm, [jnp.ones((8, 128), F32)]),
    "core_kernel": (core_kernel, [jnp.ones((8, 128), F32)]),
    "row_writes": (row_writes, [jnp.ones((16, 128), F32)]),
}


def _lowered(build: Callable[[Any], Any], m: Any, args: list[Any]) -> str:
    return jax.jit(build(m)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_for_tpu_and_the_module_verifies(name: str) -> None:
    build, args = CASES[name]
    found = inspection.kernels(_lowered(build, pl, args))
    assert len(found) == 1
    config, _ = found[0]  # the module was decoded and verified in a fresh context
    assert config["custom_call_config"]["serialization_format"] == 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_agrees_with_jax_experimental_pallas(name: str) -> None:
    build, args = CASES[name]
    text = _lowered(build, pl, args)
    (ours_config, ours), = inspection.kernels(text)
    # Some JAX versions ask which chip they lower for; name one (no TPU is attached here).
    with plb.assume_device("TPU v5 lite", "tpu"):
        reference = _lowered(build, jax_pl, args)
    (theirs_config, theirs), = inspection.kernels(reference)
    inspection.assert_same_config(ours_config, theirs_config)
    assert inspection.format_versions(text) == inspection.format_versions(reference)
    prefetch = [IDX] if inspection.summary(ours)["scalar_prefetch"] else []
    inspection.assert_same_kernel(ours, theirs, prefetch)


class _OnInterpreter:
    """This project's module, with every kernel sent to the interpreter."""

    OURS = True

    def __getattr__(self, name: str) -> Any:
        return getattr(pl, name)

    @staticmethod
    def pallas_call(*args: Any, **kwargs: Any) -> Any:
        return pl.pallas_call(*args, **{**kwargs, "backend": "interpret"})

    @staticmethod
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return pl.kernel(*args, **{**kwargs, "backend": "interpret"})


def test_the_same_kernels_run_in_the_interpreter_against_jnp() -> None:
    m = _OnInterpreter()
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.standard_normal((16, 256)), F32) for _ in range(2))
    np.testing.assert_allclose(blocked_add(m)(x, y), x + y, rtol=1e-6)
    a, b = (jnp.asarray(rng.standard_normal((256, 256)), BF16) for _ in range(2))
    np.testing.assert_allclose(matmul_3d(m)(a, b), jnp.dot(a, b, preferred_element_type=F32),
                               rtol=2e-2, atol=2e-2)
    s = jnp.asarray(rng.standard_normal((32, 256)), F32)
    np.testing.assert_allclose(softmax(m)(s), jax.nn.softmax(s, axis=1), rtol=1e-5, atol=1e-6)
    q, k, v = (jnp.asarray(rng.standard_normal((256, 128)), F32) for _ in range(3))
    want = jax.nn.softmax(q @ k.T, axis=1) @ v
    np.testing.assert_allclose(flash_attention(m)(q, k, v), want, rtol=1e-4, atol=1e-4)
    xs = jnp.asarray(rng.standard_normal((48, 128)), F32)
    want = jnp.concatenate([xs[8 * i:8 * i + 8] for i in IDX]) * 2.0
    np.testing.assert_allclose(prefetch_gather(m)(jnp.asarray(IDX), xs), want, rtol=1e-6)
    c = jnp.asarray(rng.standard_normal((8, 128)), F32)
    np.testing.assert_allclose(dma_copy(m)(c), c + 1.0, rtol=1e-6)
    np.testing.assert_allclose(dma_copy_hbm(m)(c), c + 1.0, rtol=1e-6)
    np.testing.assert_allclose(core_kernel(m)(c), c, rtol=0)
    r = jnp.asarray(rng.standard_normal((16, 128)), F32).reshape(2, 8, 128)
    want = jnp.concatenate([r[:, :1] * 2.0, r[:, 1:2] + 1.0, r[:, 2:] - 1.0], axis=1)
    np.testing.assert_allclose(row_writes(m)(r.reshape(16, 128)), want.reshape(16, 128),
                               rtol=1e-6)


def test_dma_kernel_uses_the_dma_engine() -> None:
    build, args = CASES["dma_copy"]
    ((_, module),) = inspection.kernels(_lowered(build, pl, args))
    text = str(module)
    for op in ("tpu.region", "tpu.sem_alloc", "tpu.enqueue_dma", WAIT, "memref.alloca"):
        assert op in text, op


# --- collectives: a ring ppermute with remote DMAs and the barrier semaphore ----------------


def ring_permute(m: Any, axes: tuple[str, ...], shape: tuple[int, ...]) -> Callable[..., Any]:
    """Every device sends its shard to the next device along the last mesh axis, after a
    barrier handshake with both neighbours (the pattern of JAX's distributed TPU guide)."""
    tpu = pltpu if _ours(m) else jax_pltpu
    ring, n = axes[-1], shape[-1]
    mesh_ids = jax_pl if not _ours(m) else pl

    def kernel(x_ref: Any, o_ref: Any, send_sem: Any, recv_sem: Any) -> None:
        me = jax.lax.axis_index(ring)
        others = tuple(jax.lax.axis_index(a) for a in axes[:-1])
        right, left = jax.lax.rem(me + 1, n), jax.lax.rem(me + n - 1, n)
        barrier = tpu.get_barrier_semaphore()
        for peer in (left, right):
            m.semaphore_signal(barrier, 1, device_id=(*others, peer),
                               device_id_type=mesh_ids.DeviceIdType.MESH)
        m.semaphore_wait(barrier, 2)
        copy = tpu.async_remote_copy(x_ref, o_ref, send_sem, recv_sem,
                                     device_id=(*others, right),
                                     device_id_type=mesh_ids.DeviceIdType.MESH)
        copy.wait()

    def per_device(x: Any) -> Any:
        whole = m.BlockSpec(memory_space=m.ANY)
        return m.pallas_call(
            kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[whole], out_specs=whole,
            scratch_shapes=[tpu.SemaphoreType.DMA, tpu.SemaphoreType.DMA],
            compiler_params=tpu.CompilerParams(collective_id=0))(x)

    mesh = jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                         devices=jax.devices()[:int(np.prod(shape))])
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=jax.P(axes),
                                 out_specs=jax.P(axes), check_vma=False))


MESHES = {"ring8": (("x",), (8,)), "mesh2x4": (("y", "x"), (2, 4))}


def _need_devices(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_ring_permute_lowers_like_jax_experimental_pallas(mesh: str) -> None:
    axes, shape = MESHES[mesh]
    _need_devices(int(np.prod(shape)))
    x = jnp.ones((int(np.prod(shape)) * 8, 128), F32)
    text = ring_permute(pl, axes, shape).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    (config, module), = inspection.kernels(text)
    assert config["custom_call_config"]["has_communication"] is True
    assert config["custom_call_config"]["collective_id"] == 0
    ops = str(module)
    for op in ("tpu.sem_barrier", "tpu.device_id", "tpu.sem_signal", "tpu.sem_wait",
               "tpu.enqueue_dma", WAIT):
        assert op in ops, op
    theirs_text = ring_permute(jax_pl, axes, shape).trace(x).lower(
        lowering_platforms=("tpu",)).as_text()
    (theirs_config, theirs), = inspection.kernels(theirs_text)
    inspection.assert_same_config(config, theirs_config)
    assert inspection.summary(module) == inspection.summary(theirs)
    for op in ("tpu.sem_signal", "tpu.enqueue_dma", WAIT, "device_id("):
        assert ops.count(op) == str(theirs).count(op), op


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_ring_permute_runs_in_the_interpreter(mesh: str) -> None:
    axes, shape = MESHES[mesh]
    _need_devices(int(np.prod(shape)))
    n_dev = int(np.prod(shape))
    x = jax.random.normal(jax.random.key(3), (n_dev * 8, 128), F32)
    out = ring_permute(_OnInterpreter(), axes, shape)(x)
    # Shard (.., d) ends up on (.., d + 1) along the ring axis.
    blocks = np.asarray(x).reshape(*shape, 8, 128)
    want = np.roll(blocks, 1, axis=len(shape) - 1).reshape(n_dev * 8, 128)
    np.testing.assert_allclose(out, want)


def test_barrier_semaphore_needs_a_collective_id() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.semaphore_wait(pltpu.get_barrier_semaphore(), 0)
        o_ref[...] = x_ref[...]

    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), F32), backend="mosaic_tpu")
    with pytest.raises(pl.PallasError, match=r"collective_id.*Fix: pass compiler_params="):
        jax.jit(call).trace(jnp.ones((8, 128), F32)).lower(lowering_platforms=("tpu",))


@pytest.mark.parametrize("target", [None, "v5e", "v6e", "TPU v4"])
def test_stages_give_the_mosaic_module_and_the_stablehlo(target: str | None) -> None:
    build, args = CASES["matmul_3d_bf16"]
    (stages,) = pl.stages(build(pl), *args, backend="mosaic_tpu", target=target)
    assert list(stages.stages) == ["jaxpr", "stablehlo", "mosaic"]
    assert "stablehlo.custom_call @tpu_custom_call" in stages["stablehlo"]
    mosaic = stages["mosaic"]
    assert "tpu.matmul" in mosaic and "iteration_bounds = array<i64: 2, 2, 2>" in mosaic
    # The StableHLO carries the same kernel (decoded from its custom call).
    ((_, module),) = inspection.kernels(str(stages["stablehlo"]))
    assert inspection.summary(module)["iteration_bounds"] == (2, 2, 2)


def test_stages_refuse_an_unknown_chip() -> None:
    build, args = CASES["blocked_add"]
    with pytest.raises(pl.PallasError, match=r"unknown TPU generation.*Fix: use one of"):
        pl.stages(build(pl), *args, backend="mosaic_tpu", target="v99")
