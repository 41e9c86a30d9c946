"""The data classes, enums and small operations of ``jax.experimental.pallas.mosaic_gpu`` that
ported code passes around (``OOBFillMode``, ``TraceScope``, ``RefType``, ``PipelinePipeline``,
``Replicated``, ``Tiling``, ``Transform``, ``TMEMLayout``, ``WGMMAAccumulatorRef``,
``PeerMemRef``, ``RefUnion``, ``REGS``, ``print_layout``, ``transform_ref``): fields and
members against JAX's own objects, and kernels using them against ``jax.numpy`` on random
inputs."""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct


def _rand(shape: tuple[int, ...], seed: int, dtype: Any = jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("name", ["OOBFillMode", "TraceScope", "PipelinePipeline",
                                  "TMEMLayout"])
def test_enum_members_are_jaxs(name: str) -> None:
    ours, theirs = getattr(plgpu, name), getattr(jgpu, name)
    assert issubclass(ours, enum.Enum)
    assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]
    assert issubclass(ours, enum.IntEnum) == issubclass(theirs, enum.IntEnum)


@pytest.mark.parametrize("name", ["RefType", "Replicated", "Tiling", "WGMMAAccumulatorRef",
                                  "PeerMemRef"])
def test_dataclass_fields_are_jaxs(name: str) -> None:
    ours, theirs = getattr(plgpu, name), getattr(jgpu, name)
    assert [f.name for f in dataclasses.fields(ours)] == [
        f.name for f in dataclasses.fields(theirs)]
    assert list(inspect.signature(ours).parameters) == list(
        inspect.signature(theirs).parameters)


def test_transform_and_ref_union_signatures_are_jaxs() -> None:
    methods = {"transform_type", "undo", "pretty_print"}
    assert methods <= set(vars(plgpu.Transform)) and methods <= set(vars(jgpu.Transform))
    def params(cls: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.kind) for p in inspect.signature(cls).parameters.values()]

    assert params(plgpu.RefUnion) == params(jgpu.RefUnion)
    assert plgpu.MemorySpace.REGS is plgpu.REGS
    assert [m.name for m in plgpu.MemorySpace] == [m.name.upper() for m in jgpu.MemorySpace]


def test_tiling_tiles_as_jax() -> None:
    tiling = plgpu.Tiling(((64, 32), (8, 8)))
    assert tiling.tile_shape((128, 64)) == (2, 2, 8, 4, 8, 8)
    assert plgpu.Replicated(4).times == 4


def test_trace_scope_in_compiler_params_changes_nothing() -> None:
    x = _rand((64, 128), 1)
    for scope in plgpu.TraceScope:
        params = plgpu.CompilerParams(profile_trace_scope=scope)
        fn = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2.0),
                            S(x.shape, x.dtype), compiler_params=params, backend="interpret")
        np.testing.assert_allclose(fn(x), x * 2.0)
    with pytest.raises(pl.PallasError, match="profile_trace_scope"):
        plgpu.CompilerParams(profile_trace_scope="warp")
    with pytest.raises(pl.UnsupportedError, match="profile_space"):
        plgpu.CompilerParams(profile_space=1024)


def _copy_kernel(oob_mode: Any, backend: str) -> Any:
    @functools.partial(plgpu.kernel, out_type=S((64, 128), jnp.float16), backend=backend)
    def kernel(x_ref: Any, o_ref: Any) -> None:
        def scope(smem: Any, bar: Any) -> None:
            plgpu.copy_gmem_to_smem(x_ref, smem, bar, oob_mode=oob_mode)
            plgpu.barrier_wait(bar)
            o_ref[...] = smem[...] + 1

        pl.run_scoped(scope, plgpu.SMEM((64, 128), jnp.float16),
                      plgpu.Barrier(num_arrivals=1))

    return kernel


@pytest.mark.parametrize("mode", [None, *plgpu.OOBFillMode])
def test_copy_gmem_to_smem_takes_oob_mode(mode: Any) -> None:
    x = _rand((64, 128), 2, jnp.float16)
    np.testing.assert_allclose(_copy_kernel(mode, "interpret")(x), x + 1)
    text = jax.jit(_copy_kernel(mode, "mosaic_gpu")).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert len(inspection.kernels(text)) == 1


def test_copy_gmem_to_smem_refuses_a_bad_oob_mode() -> None:
    with pytest.raises(pl.PallasError, match="oob_mode"):
        _copy_kernel("zeros", "interpret")(jnp.zeros((64, 128), jnp.float16))


def test_wgmma_accumulator_ref_as_scratch_and_initial_value() -> None:
    keys = jax.random.split(jax.random.key(3), 3)
    a = jax.random.normal(keys[0], (64, 64), jnp.float16)
    b = jax.random.normal(keys[1], (64, 128), jnp.float16)
    c = jax.random.normal(keys[2], (64, 128), jnp.float32)

    @functools.partial(plgpu.kernel, out_type=S((64, 128), jnp.float32), backend="interpret",
                       scratch_shapes=[plgpu.WGMMAAccumulatorRef((64, 128), jnp.float32)])
    def kernel(a_ref: Any, b_ref: Any, c_ref: Any, o_ref: Any, acc: Any) -> None:
        def scope(a_smem: Any, b_smem: Any, bar: Any) -> None:
            plgpu.copy_gmem_to_smem(a_ref, a_smem, bar)
            plgpu.copy_gmem_to_smem(b_ref, b_smem, bar)
            plgpu.barrier_wait(bar)
            plgpu.wgmma(acc, a_smem, b_smem)

            def body(acc2: Any) -> None:
                plgpu.wgmma(acc2, a_smem, b_smem)

            started = pl.run_state(body)(plgpu.WGMMAAccumulatorRef.init(c_ref[...]))
            o_ref[...] = acc[...] + started

        pl.run_scoped(scope, plgpu.SMEM(a.shape, a.dtype), plgpu.SMEM(b.shape, b.dtype),
                      plgpu.Barrier(num_arrivals=2))

    prod = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
    np.testing.assert_allclose(kernel(a, b, c), 2 * prod + c, rtol=2e-2, atol=2e-2)


def test_regs_allocates_an_accumulator() -> None:
    assert plgpu.REGS((64, 128), jnp.float32) == plgpu.ACC((64, 128), jnp.float32)
    assert plgpu.MemorySpace.REGS((64, 8)) == plgpu.ACC((64, 8))


def test_ref_union_gives_each_group_its_buffers() -> None:
    x, y = _rand((64, 128), 4), _rand((32,), 5)

    @functools.partial(plgpu.kernel, out_type=(S((64, 128), jnp.float32), S((32,), jnp.float32)),
                       backend="interpret",
                       scratch_shapes=[plgpu.RefUnion(
                           plgpu.SMEM((64, 128), jnp.float32),
                           (plgpu.SMEM((32,), jnp.float32), plgpu.SMEM((32,), jnp.float32)))])
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any, p_ref: Any, union: Any) -> None:
        big, (small, small2) = union
        big[...] = x_ref[...] * 2.0
        o_ref[...] = big[...]
        small[...] = y_ref[...]
        small2[...] = small[...] - 1.0
        p_ref[...] = small2[...]

    o, p = kernel(x, y)
    np.testing.assert_allclose(o, x * 2.0)
    np.testing.assert_allclose(p, y - 1.0)
    with pytest.raises(pl.PallasError, match="RefUnion"):
        plgpu.RefUnion(plgpu.SMEM((8,), jnp.float32), plgpu.GMEM((8,), jnp.float32))


def test_print_layout_prints_the_chosen_layouts(capsys: Any) -> None:
    x = _rand((64, 128), 6, jnp.float16)

    @functools.partial(plgpu.kernel, out_type=S((64, 128), jnp.float16), backend="interpret",
                       scratch_shapes=[plgpu.SMEM((64, 128), jnp.float16)])
    def kernel(x_ref: Any, o_ref: Any, smem: Any) -> None:
        plgpu.print_layout("smem: {}", smem)
        value = x_ref[...]
        plgpu.print_layout("value: {}", value)
        o_ref[...] = value

    np.testing.assert_allclose(kernel(x), x)
    out = capsys.readouterr().out
    assert "smem: SMEM float16[64, 128]: TilingTransform((8, 64)), SwizzleTransform(128)" in out
    assert "value: float16[64, 128]: WGMMA" in out


def test_transform_ref_views_as_jax() -> None:
    x = _rand((64, 128), 7)
    views: list[Any] = []

    @functools.partial(plgpu.kernel, out_type=S((64, 128), jnp.float32), backend="interpret")
    def kernel(x_ref: Any, o_ref: Any) -> None:
        with pytest.warns(DeprecationWarning, match="transform_ref"):
            same = plgpu.transform_ref(x_ref, plgpu.SwizzleTransform(128))
        o_ref[...] = same[...] * 3.0
        with pytest.warns(DeprecationWarning):
            peer = plgpu.transform_ref(x_ref, plgpu.PeerMemRef(1, pl.DeviceIdType.MESH))
        views.append((peer, plgpu.remote_ref(x_ref, 1)))
        with pytest.warns(DeprecationWarning), pytest.raises(pl.UnsupportedError,
                                                             match="TilingTransform"):
            plgpu.transform_ref(x_ref, plgpu.TilingTransform((8, 64)))

    np.testing.assert_allclose(kernel(x), x * 3.0)
    (peer, remote), = views
    assert peer.ref is remote.ref
    assert [type(t) for t in peer.transforms] == [type(t) for t in remote.transforms]
    assert str(peer.transforms) == str(remote.transforms)
