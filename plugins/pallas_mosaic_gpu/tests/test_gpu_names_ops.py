"""``plgpu.barrier_test``, ``async_copy_smem_to_tmem`` and ``format_tcgen05_sparse_metadata``
against ``jax.numpy`` and JAX's own functions on random inputs, in the interpreter and lowered
for cuda."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def _rand(seed: int, shape: tuple[int, ...], dtype: Any = F32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _lowered(fn: Any, *args: Any) -> str:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)
    return str(found[1])


def _tested(x: jax.Array, backend: str) -> Any:
    """Tests a barrier before and after a copy completes it; the copy's data comes out once
    the test said so."""
    @functools.partial(plgpu.kernel, out_type=(S(x.shape, x.dtype), S((2,), jnp.int32)),
                       backend=backend,
                       scratch_shapes=[plgpu.SMEM(x.shape, x.dtype),
                                       plgpu.Barrier(num_arrivals=1)])
    def kernel(x_ref: Any, o_ref: Any, flags: Any, smem: Any, bar: Any) -> None:
        before = plgpu.barrier_test(bar)
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        after = jax.lax.while_loop(lambda done: jnp.logical_not(done),
                                   lambda _: plgpu.barrier_test(bar), before)
        o_ref[...] = smem[...] * 2.0
        flags[0] = before.astype(jnp.int32)
        flags[1] = after.astype(jnp.int32)

    return kernel(x)


def test_barrier_test_tells_whether_the_phase_completed() -> None:
    x = _rand(1, (64, 64))
    out, flags = _tested(x, "interpret")
    np.testing.assert_allclose(out, x * 2.0)
    np.testing.assert_array_equal(flags, [0, 1])


def _warp_spin(x: jax.Array, backend: str) -> jax.Array:
    """Warp 1 spins on barrier_test until warp 0's copy lands (the warps run each at its own
    pace in the interpreter), then copies the buffer out."""
    def per_warp(x_ref: Any, o_ref: Any, buf: Any, full: Any) -> None:
        warp = jax.lax.axis_index("w")

        @pl.when(warp == 1)
        def _() -> None:
            jax.lax.while_loop(lambda done: jnp.logical_not(done),
                               lambda _: plgpu.barrier_test(full), jnp.bool_(False))
            plgpu.copy_smem_to_gmem(buf, o_ref)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(warp == 0)
        def _() -> None:
            plgpu.copy_gmem_to_smem(x_ref, buf, full)

    def body(x_ref: Any, o_ref: Any, buf: Any, full: Any) -> None:
        @pl.when(jax.lax.axis_index("wg") == 0)
        def _() -> None:
            pl.core_map(plgpu.WarpMesh(axis_name="w"))(
                functools.partial(per_warp, x_ref, o_ref, buf, full))

    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.run_scoped(functools.partial(body, x_ref, o_ref), plgpu.SMEM(x.shape, x.dtype),
                      plgpu.Barrier(num_arrivals=1), collective_axes="wg")

    return plgpu.kernel(kernel, out_type=S(x.shape, x.dtype),  # type: ignore[no-any-return]
                        num_threads=2, thread_name="wg", backend=backend)(x)


def test_barrier_test_in_a_warp_waits_for_another_warp() -> None:
    x = _rand(2, (64, 64))
    np.testing.assert_array_equal(_warp_spin(x, "interpret"), x)


def test_barrier_test_lowers_for_cuda() -> None:
    x = _rand(3, (64, 64))
    assert "mbarrier.test.wait" in _lowered(lambda x: _tested(x, "mosaic_gpu"), x).replace(
        "_", ".")
    assert len(_lowered(functools.partial(_warp_spin, backend="mosaic_gpu"), x)) > 0


def test_barrier_test_checks_its_barrier() -> None:
    @functools.partial(plgpu.kernel, out_type=S((8,), F32), backend="interpret")
    def kernel(o_ref: Any) -> None:
        plgpu.barrier_test(o_ref)

    with pytest.raises(pl.PallasError, match="barrier_test"):
        kernel()


def _smem_to_tmem(x: jax.Array, backend: str) -> jax.Array:
    def body(x_ref: Any, o_ref: Any, tmem: Any, smem: Any, bar: Any) -> None:
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        plgpu.barrier_wait(bar)
        plgpu.async_copy_smem_to_tmem(smem, tmem)
        value = plgpu.async_load_tmem(tmem)
        plgpu.wait_load_tmem()
        o_ref[...] = value + 1.0

    return plgpu.kernel(body, out_type=S(x.shape, F32), backend=backend,  # type: ignore
                        scratch_shapes=[plgpu.TMEM(x.shape, F32), plgpu.SMEM(x.shape, F32),
                                        plgpu.Barrier(num_arrivals=1)])(x)


def test_async_copy_smem_to_tmem_copies() -> None:
    x = _rand(4, (128, 128))
    np.testing.assert_allclose(_smem_to_tmem(x, "interpret"), x + 1.0)
    module = _lowered(functools.partial(_smem_to_tmem, backend="mosaic_gpu"), x)
    assert "tcgen05.st" in module and "tcgen05.ld" in module
    with pytest.raises(pl.UnsupportedError, match="collective_axis"):
        plgpu.async_copy_smem_to_tmem(None, None, collective_axis="x")


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8])
@pytest.mark.parametrize("m, k4", [(128, 64), (256, 32), (384, 128)])
def test_format_tcgen05_sparse_metadata_is_jaxs(dtype: Any, m: int, k4: int) -> None:
    rng = np.random.default_rng(m + k4)
    meta = jnp.asarray(rng.integers(0, 4, (m, k4, 2)).astype(jnp.uint2))
    ours = plgpu.format_tcgen05_sparse_metadata(meta, dtype)
    theirs = jgpu.format_tcgen05_sparse_metadata(meta, dtype)
    assert ours.shape == theirs.shape == (m // 128, k4 * 2 // 64, 128, 64)
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.int8)),
                                  np.asarray(theirs.astype(jnp.int8)))


def test_format_tcgen05_sparse_metadata_checks_its_input() -> None:
    with pytest.raises(pl.PallasError, match="uint2"):
        plgpu.format_tcgen05_sparse_metadata(jnp.zeros((128, 32, 2), jnp.uint8), jnp.float16)
    with pytest.raises(pl.PallasError, match="shape"):
        plgpu.format_tcgen05_sparse_metadata(jnp.zeros((128, 32), jnp.uint2), jnp.float16)
    with pytest.raises(pl.UnsupportedError, match="float32"):
        plgpu.format_tcgen05_sparse_metadata(jnp.zeros((128, 32, 2), jnp.uint2), jnp.float32)


def _im2col_reference(x: np.ndarray, window: tuple[int, ...], padding: Any, row0: int,
                      rows: int, offsets: tuple[int, ...], chan0: int, chans: int) -> np.ndarray:
    """view[r, *d, c] == padded[n, *(p + d), c] with (n, *p) = unravel(r, (N, *out)), by
    loops; zeros past the ends."""
    padded = np.pad(x, ((0, 0), *padding, (0, 0)))
    out = [padded.shape[1 + i] - k + 1 for i, k in enumerate(window)]
    total = x.shape[0] * int(np.prod(out))
    got = np.zeros((rows, chans), x.dtype)
    for i in range(rows):
        r = row0 + i
        if r >= total:
            continue
        n, *p = np.unravel_index(r, (x.shape[0], *out))
        for j in range(chans):
            c = chan0 + j
            if c < x.shape[-1]:
                got[i, j] = padded[(n, *(pi + d for pi, d in zip(p, offsets)), c)]
    return got


@pytest.mark.parametrize("shape, window, padding, row0, offsets, chan0", [
    ((2, 6, 5, 8), (3, 2), ((1, 1), (0, 1)), 50, (1, 0), 4),
    ((1, 9, 16), (3,), None, 0, (2,), 0),
    ((2, 3, 4, 4, 8), (2, 2, 3), ((0, 1), (1, 0), (1, 1)), 7, (1, 1, 2), 2),
])
def test_im2col_ref_copies_windows(shape: tuple[int, ...], window: tuple[int, ...],
                                   padding: Any, row0: int, offsets: tuple[int, ...],
                                   chan0: int) -> None:
    x = _rand(5, shape)
    rows, chans = 16, 8

    @functools.partial(plgpu.kernel, out_type=S((rows, chans), F32), backend="interpret",
                       scratch_shapes=[plgpu.SMEM((rows, chans), F32),
                                       plgpu.Barrier(num_arrivals=1)])
    def kernel(x_ref: Any, o_ref: Any, smem: Any, bar: Any) -> None:
        view = plgpu.im2col_ref(x_ref, window_shape=window, padding=padding)
        start = x_ref[0].reshape(-1)[0].astype(jnp.int32) * 0 + row0  # a traced start
        plgpu.copy_gmem_to_smem(view.at[pl.ds(start, rows), *offsets, pl.ds(chan0, chans)],
                                smem, bar)
        plgpu.barrier_wait(bar)
        o_ref[...] = smem[...]

    want = _im2col_reference(np.asarray(x), window, padding or ((0, 0),) * len(window),
                             row0, rows, offsets, chan0, chans)
    np.testing.assert_array_equal(np.asarray(kernel(x)), want)


def test_im2col_ref_view_shape_and_checks() -> None:
    seen: list[Any] = []

    @functools.partial(plgpu.kernel, out_type=S((8,), F32), backend="interpret")
    def kernel(x_ref: Any, o_ref: Any) -> None:
        view = plgpu.im2col_ref(x_ref, window_shape=(3, 3), padding=((1, 1), (1, 1)))
        seen.append(view.shape)
        with pytest.raises(pl.PallasError, match="window offset"):
            view.at[pl.ds(0, 8), pl.ds(0, 2), 0, pl.ds(0, 4)]
        with pytest.raises(pl.PallasError, match="1 to 1024 rows"):
            view.at[pl.ds(0, 2048), 0, 0, pl.ds(0, 4)]
        o_ref[...] = jnp.zeros((8,), F32)

    kernel(jnp.zeros((2, 5, 7, 4), F32))
    assert seen == [(2 * 5 * 7, 3, 3, 4)]


def test_im2col_copy_is_refused_when_lowered() -> None:
    def fn(x: jax.Array) -> jax.Array:
        @functools.partial(plgpu.kernel, out_type=S((16, 8), F32), backend="mosaic_gpu",
                           scratch_shapes=[plgpu.SMEM((16, 8), F32),
                                           plgpu.Barrier(num_arrivals=1)])
        def kernel(x_ref: Any, o_ref: Any, smem: Any, bar: Any) -> None:
            view = plgpu.im2col_ref(x_ref, window_shape=(2, 2))
            plgpu.copy_gmem_to_smem(view.at[pl.ds(0, 16), 0, 0, pl.ds(0, 8)], smem, bar)
            plgpu.barrier_wait(bar)
            o_ref[...] = smem[...]

        return kernel(x)  # type: ignore[no-any-return]

    with pytest.raises(pl.PallasError, match="im2col"):
        jax.jit(fn).trace(jnp.zeros((1, 4, 4, 8), F32)).lower(lowering_platforms=("cuda",))


def _swap_through_smem(x: jax.Array, y: jax.Array, atomic: Any, backend: str) -> jax.Array:
    """Block c of each cluster of 2 puts x's rows in its buffer, meets the other block, then
    stores y's rows into the other block's buffer (combined by ``atomic``); each block writes
    its buffer out once its barrier says the store landed."""
    def body(x_ref: Any, y_ref: Any, o_ref: Any, buf: Any, landed: Any, met: Any) -> None:
        i, c = lax.axis_index("i"), lax.axis_index("x")
        rows = pl.ds((2 * i + c) * 64, 64)
        buf[...] = x_ref[rows]
        plgpu.barrier_arrive(met.at[0])
        plgpu.barrier_wait(met.at[0])
        plgpu.async_store_smem(y_ref[rows], buf, landed.at[0], cluster_idx=1 - c,
                               cluster_dim="x", atomic=atomic)
        plgpu.barrier_wait(landed.at[0])
        o_ref[rows] = buf[...]

    return plgpu.kernel(body, out_shape=S(x.shape, x.dtype), grid=(2,),  # type: ignore
                        grid_names=("i",), cluster=(2,), cluster_names=("x",), backend=backend,
                        scratch_shapes=[plgpu.SMEM((64, 32), x.dtype), plgpu.Barrier(),
                                        plgpu.ClusterBarrier(collective_axes=("x",))])(x, y)


@pytest.mark.parametrize("atomic", [None, "add", "max", "xor"])
def test_async_store_smem_reaches_the_other_block(atomic: Any) -> None:
    dtype = jnp.int32 if atomic == "xor" else F32
    x = jax.random.randint(jax.random.key(6), (256, 32), -50, 50).astype(dtype)
    y = jax.random.randint(jax.random.key(7), (256, 32), -50, 50).astype(dtype)
    got = _swap_through_smem(x, y, atomic, "interpret")
    # Block (i, c) receives y's rows of block (i, 1 - c): swap each pair of 64-row groups.
    other = y.reshape(2, 2, 64, 32)[:, ::-1].reshape(256, 32)
    want = {None: lambda: other, "add": lambda: x + other, "max": lambda: jnp.maximum(x, other),
            "xor": lambda: jnp.bitwise_xor(x, other)}[atomic]()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_async_store_smem_checks_and_refuses_lowering() -> None:
    x = jnp.zeros((256, 32), F32)
    with pytest.raises(pl.PallasError, match="async_store_smem"):
        jax.jit(functools.partial(_swap_through_smem, atomic=None, backend="mosaic_gpu")
                ).trace(x, x).lower(lowering_platforms=("cuda",))
    with pytest.raises(pl.PallasError, match="bitwise"):
        _swap_through_smem(x, x, "or", "interpret")


def _add_one(gpu: Any, x: jax.Array, backend: str | None) -> jax.Array:
    """A kernel whose body adds one with Mosaic GPU library code (plgpu.inline_mgpu), taking
    the array in registers and a Ref as a memref (read into the sum); written once for
    ``gpu``."""
    from jax.experimental.mosaic import gpu as mgpu

    ret = (S(x.shape, x.dtype) if gpu is plgpu else
           gpu.ShapeDtypeStruct(x.shape, x.dtype, layout=gpu.Layout.WGMMA))

    @gpu.inline_mgpu(arg_types=(gpu.Layout.WGMMA,), return_type=ret)
    def add_one(ctx: Any, arr: Any) -> Any:
        return arr + mgpu.FragmentedArray.splat(mgpu.c(1.0, arr.mlir_dtype), arr.shape,
                                                arr.layout)

    @gpu.inline_mgpu(arg_types=(gpu.RefType(),))
    def double_in_place(ctx: Any, ref: Any) -> None:
        arr = mgpu.FragmentedArray.load_strided(ref)
        (arr + arr).store_untiled(ref)

    def body(x_ref: Any, o_ref: Any, smem: Any) -> None:
        smem[...] = add_one(gpu.layout_cast(x_ref[...], gpu.Layout.WGMMA))
        double_in_place(smem)
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(smem, o_ref)
        gpu.wait_smem_to_gmem(0)

    kw = {} if backend is None else {"backend": backend}
    return gpu.kernel(body, out_type=S(x.shape, x.dtype),  # type: ignore[no-any-return]
                      scratch_types=[gpu.SMEM(x.shape, x.dtype, transforms=(
                          gpu.TilingTransform((8, 64)), gpu.SwizzleTransform(128)))], **kw)(x)


def test_inline_mgpu_lowers() -> None:
    """The library code lands in the kernel: without the two inline functions the kernel has
    no floating-point addition at all. (JAX 0.10.2's own lowering of this kernel fails on
    its store of the WGMMA-layout result, so it cannot be compared here.)"""
    x = _rand(8, (64, 128), jnp.float16)
    ours = _lowered(functools.partial(_add_one, plgpu, backend="mosaic_gpu"), x)
    assert "arith.addf" in ours


def test_inline_mgpu_is_refused_in_the_interpreter() -> None:
    with pytest.raises(pl.UnsupportedError, match="inline_mgpu"):
        _add_one(plgpu, _rand(9, (64, 128), jnp.float16), "interpret")
    with pytest.raises(pl.PallasError, match="arg_types"):
        plgpu.inline_mgpu(arg_types=(3,))


def test_as_torch_kernel_hands_jaxs_bridge_one_mosaic_gpu_call() -> None:
    """JAX's bridge needs a function whose lowered module is one mosaic_gpu_v2 call whose
    results are returned; this backend's kernels lower so."""
    x = _rand(10, (64, 128))

    def fn(x: jax.Array) -> jax.Array:
        return plgpu.kernel(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1.0),
                            out_type=S(x.shape, x.dtype), backend="mosaic_gpu")(x)

    text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@mosaic_gpu_v2") == 1
    wrapped = plgpu.as_torch_kernel(fn)
    assert callable(wrapped) and wrapped.__wrapped__ is fn  # type: ignore[attr-defined]


def _multicast_gather(backend: str) -> Any:
    """Under shard_map over 4 devices, device d copies its 128 values from SMEM into slot d of
    the output through plgpu.multicast_ref: every device's output is every device's values."""
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])

    def body(x_ref: Any, o_ref: Any, smem: Any) -> None:
        d = lax.axis_index("x")
        smem[...] = x_ref[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, plgpu.multicast_ref(o_ref.at[pl.ds(d * 128, 128)], "x"))
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=S((512,), F32), backend=backend,
                          scratch_shapes=[plgpu.SMEM((128,), F32)])
    spec = jax.sharding.PartitionSpec("x")
    return jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False)), jax.sharding.NamedSharding(mesh, spec)


def test_multicast_ref_copies_reach_every_device() -> None:
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    fn, sharding = _multicast_gather("interpret")
    x = _rand(11, (512,))
    got = fn(jax.device_put(x, sharding))
    np.testing.assert_array_equal(np.asarray(got), np.tile(np.asarray(x), 4))
    fn, sharding = _multicast_gather("mosaic_gpu")
    text = fn.trace(S(x.shape, x.dtype, sharding=sharding)).lower(
        lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)
    assert "multimem" in str(found[1])


def test_multicast_ref_refuses_reads_and_writes() -> None:
    @functools.partial(plgpu.kernel, out_type=S((8,), F32), backend="interpret")
    def kernel(o_ref: Any) -> None:
        view = plgpu.multicast_ref(o_ref, "x")
        assert view.shape == (8,) and view.at[pl.ds(0, 4)].shape == (4,)
        with pytest.raises(pl.PallasError, match="multicast_ref"):
            view[...] = jnp.zeros((8,), F32)
        o_ref[...] = jnp.zeros((8,), F32)

    kernel()


def _exchange(x: jax.Array, backend: str) -> jax.Array:
    """Block c of each cluster of 2 writes its rows doubled into the other block's buffer
    through plgpu.cluster_ref, meets it, then adds the other block's first 16 columns (read
    through the view) to its own buffer."""
    def body(x_ref: Any, o_ref: Any, buf: Any, met: Any) -> None:
        i, c = lax.axis_index("i"), lax.axis_index("x")
        rows = pl.ds((2 * i + c) * 64, 64)
        other = plgpu.cluster_ref(buf, {"x": 1 - c})
        other[...] = x_ref[rows] * 2.0
        plgpu.barrier_arrive(met.at[0])
        plgpu.barrier_wait(met.at[0])
        o_ref[rows] = buf[...] + jnp.pad(other.at[:, pl.ds(0, 16)][...], ((0, 0), (0, 16)))

    return plgpu.kernel(body, out_shape=S(x.shape, x.dtype), grid=(2,),  # type: ignore
                        grid_names=("i",), cluster=(2,), cluster_names=("x",), backend=backend,
                        scratch_shapes=[plgpu.SMEM((64, 32), x.dtype),
                                        plgpu.ClusterBarrier(collective_axes=("x",))])(x)


def test_cluster_ref_reads_and_writes_the_other_block() -> None:
    x = _rand(12, (256, 32))
    got = _exchange(x, "interpret")
    pairs = x.reshape(2, 2, 64, 32)
    mine = pairs[:, ::-1].reshape(256, 32) * 2.0   # what the other block wrote into mine
    theirs = x.reshape(256, 32) * 2.0              # what I wrote into the other block's
    want = mine + jnp.pad(theirs[:, :16], ((0, 0), (0, 16)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    with pytest.raises(pl.PallasError, match="cluster_ref"):
        jax.jit(functools.partial(_exchange, backend="mosaic_gpu")).trace(x).lower(
            lowering_platforms=("cuda",))
    with pytest.raises(pl.UnsupportedError, match="one cluster"):
        plgpu.cluster_ref(None, {"x": 0, "y": 1})
