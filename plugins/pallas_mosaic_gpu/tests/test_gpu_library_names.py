"""The ``plgpu`` names JAX's Mosaic GPU kernel library uses (issue 17): ``nd_loop``,
``NDLoopInfo``, ``planar_snake``, ``BlockSpec`` (``transforms``, ``delay_release``),
``TilingTransform``, ``SwizzleTransform``, ``find_swizzle``, ``transpose_ref``,
``LoweringSemantics`` and ``SMEM(transforms=)``.

Each runs in the interpreter against ``jax.numpy`` (or an index table built here) and lowers
for ``cuda`` to a module that verifies; the checks of transforms against the backend's layout
raise errors naming the transform.
"""

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
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct
F16, F32, I32 = jnp.float16, jnp.float32, jnp.int32


def _module(fn: Any, *args: Any) -> Any:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    ((_, module),) = inspection.kernels(text)  # parsed back and verified
    return module


def _normal(seed: int, shape: tuple[int, ...], dtype: Any = F16) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


# --- planar_snake, nd_loop -------------------------------------------------------------------


def _snake_table(shape: tuple[int, int], minor_dim: int, width: int) -> list[tuple[int, int]]:
    """The snake's points in order, walked directly: tiles of ``width`` along ``minor_dim``
    (the last one narrower), the other dimension forwards in even tiles, backwards in odd."""
    minor_size, major_size = shape[minor_dim], shape[1 - minor_dim]
    order = []
    for t, start in enumerate(range(0, minor_size, width)):
        majors = range(major_size) if t % 2 == 0 else range(major_size - 1, -1, -1)
        for major in majors:
            for minor in range(start, min(start + width, minor_size)):
                order.append((minor, major) if minor_dim == 0 else (major, minor))
    return order


@pytest.mark.parametrize("shape,minor_dim,width", [
    ((8, 8), 0, 2), ((7, 5), 0, 3), ((5, 7), 1, 2), ((6, 4), 1, 4), ((3, 9), 1, 5)])
def test_planar_snake_walks_the_snake(shape, minor_dim, width) -> None:
    n = shape[0] * shape[1]
    got = jax.jit(jax.vmap(lambda i: plgpu.planar_snake(i, shape, minor_dim, width)))(
        jnp.arange(n, dtype=I32))
    assert list(zip(*(np.asarray(g).tolist() for g in got))) == \
        _snake_table(shape, minor_dim, width)


def _nd_loop_kernel(grid: tuple[int, int], tiling: tuple[int, int] | None, backend: str
                    ) -> Any:
    @functools.partial(plgpu.kernel, out_shape=S((*grid, 3), I32), grid=(4,),
                       grid_names=("sm",), backend=backend)
    def kernel(o_ref: Any) -> None:
        @plgpu.nd_loop(grid, collective_axes="sm", tiling=tiling)
        def _body(info: plgpu.NDLoopInfo) -> None:
            i, j = info.index
            o_ref[i, j, 0] = lax.axis_index("sm")
            o_ref[i, j, 1] = info.local_index
            o_ref[i, j, 2] = info.num_local_steps

    return kernel


@pytest.mark.parametrize("grid,tiling", [((3, 5), None), ((4, 6), (2, 3))])
def test_nd_loop_deals_points_round_robin(grid, tiling) -> None:
    walk = (*(g // t for g, t in zip(grid, tiling)), *tiling) if tiling else grid
    expected = np.zeros((*grid, 3), np.int32)
    total = int(np.prod(grid))
    for q in range(total):
        idx = np.unravel_index(q, walk)
        if tiling:
            idx = tuple(a * t + b for a, b, t in zip(idx[:2], idx[2:], tiling))
        inst = q % 4
        expected[idx] = (inst, q // 4, total // 4 + (inst < total % 4))
    got = _nd_loop_kernel(grid, tiling, "interpret")()
    np.testing.assert_array_equal(got, expected)
    assert inspection.launch(_module(_nd_loop_kernel(grid, tiling, "mosaic_gpu")))["grid"] \
        == (4, 1, 1)


def test_nd_loop_tiling_must_divide_the_grid() -> None:
    with pytest.raises(pl.PallasError, match="does not divide"):
        _nd_loop_kernel((3, 5), (2, 5), "interpret")()


# --- transforms ------------------------------------------------------------------------------

SWIZZLED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def test_find_swizzle() -> None:
    assert [plgpu.find_swizzle(n * 16) for n in (64, 128, 32, 16, 8)] == [128, 128, 64, 32, 16]
    with pytest.raises(pl.PallasError, match="48 bits"):
        plgpu.find_swizzle(48, "x")


def test_smem_transforms_are_checked_against_the_chosen_layout() -> None:
    assert plgpu.SMEM((64, 128), F16, transforms=SWIZZLED) == plgpu.SMEM((64, 128), F16)
    with pytest.raises(pl.PallasError, match=r"TilingTransform.*\(8, 64\)"):
        plgpu.SMEM((64, 64), F16, transforms=(plgpu.TilingTransform((8, 32)),))
    with pytest.raises(pl.PallasError, match="SwizzleTransform"):
        plgpu.SMEM((64, 64), F16, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(64)))
    with pytest.raises(pl.PallasError, match="plain"):
        plgpu.SMEM((128,), F32, transforms=(plgpu.SwizzleTransform(128),))
    with pytest.raises(pl.PallasError, match="swizzles are 32, 64 and 128"):
        plgpu.SwizzleTransform(16)
    with pytest.raises(pl.PallasError, match="collective"):
        plgpu.BlockSpec((64, 64), lambda k: (0, k), collective_axes=("x",))


I8_SWIZZLED = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))


def test_8_and_32_bit_buffers_are_tiled_where_transforms_ask() -> None:
    """16-bit buffers are tiled whether or not transforms ask; 8-bit and 32-bit ones only
    where they do, (8, 128 // itemsize) with a 128-byte swizzle (as JAX tiles them)."""
    from pallas_mosaic_gpu.params import asks_tiling

    assert not asks_tiling(plgpu.SMEM((64, 128), jnp.int8))
    assert asks_tiling(plgpu.SMEM((2, 64, 128), jnp.int8, transforms=I8_SWIZZLED))
    assert asks_tiling(plgpu.SMEM((8, 32), F32, transforms=(plgpu.TilingTransform((8, 32)),
                                                            plgpu.SwizzleTransform(128))))
    with pytest.raises(pl.PallasError, match=r"TilingTransform.*\(8, 128\)"):
        plgpu.SMEM((64, 128), jnp.int8, transforms=(plgpu.TilingTransform((8, 64)),))
    with pytest.raises(pl.PallasError, match="plain"):
        plgpu.SMEM((60, 128), jnp.int8, transforms=I8_SWIZZLED)


def _int8_to_f16(a: jax.Array, backend: str, transforms: Any, layout: Any = None,
                 scratch: bool = False) -> jax.Array:
    """``a.astype(f16) * 2`` through an SMEM buffer filled by TMA (``transforms`` asking
    for its layout), read into registers (in ``layout`` with ``plgpu.load``); the buffer is
    a ``pl.run_scoped`` allocation, or with ``scratch`` one of ``scratch_shapes``."""
    buf_type = plgpu.SMEM(a.shape, a.dtype, transforms=transforms)

    def scope(a_ref: Any, o_ref: Any, buf: Any, bar: Any) -> None:
        plgpu.copy_gmem_to_smem(a_ref, buf, bar)
        plgpu.barrier_wait(bar)
        if layout is None:
            y = buf[...].astype(F16)
        else:  # converted in the layout read, then moved into wgmma's
            y = plgpu.layout_cast(plgpu.load(buf, (), layout=layout).astype(F16),
                                  plgpu.Layout.WGMMA)
        o_ref[...] = y * 2

    def kernel(a_ref: Any, o_ref: Any) -> None:
        pl.run_scoped(functools.partial(scope, a_ref, o_ref), buf_type,
                      plgpu.Barrier(num_arrivals=1))

    if scratch:
        return plgpu.kernel(scope, out_shape=S(a.shape, F16), backend=backend,  # type: ignore[no-any-return]
                            scratch_shapes=[buf_type, plgpu.Barrier(num_arrivals=1)])(a)
    return plgpu.kernel(kernel, out_shape=S(a.shape, F16), backend=backend)(a)  # type: ignore[no-any-return]


@pytest.mark.parametrize("transforms,layout,smem_type,scratch", [
    ((), None, "memref<64x128xi8", False),  # not asked: plain, as before
    ((), None, "memref<64x128xi8", True),
    (I8_SWIZZLED, None, "memref<8x1x8x128xi8", False),
    (I8_SWIZZLED, None, "memref<8x1x8x128xi8", True),  # scratch_shapes keep the ask
    (I8_SWIZZLED, "WGMMA_UPCAST_2X", "memref<8x1x8x128xi8", False),
    (I8_SWIZZLED, "WGMMA_UPCAST_2X", "memref<8x1x8x128xi8", True),
    (I8_SWIZZLED, "WGMMA", "memref<8x1x8x128xi8", False)])
def test_int8_buffer_read_and_converted(transforms: Any, layout: Any, smem_type: str,
                                        scratch: bool) -> None:
    a = jax.random.randint(jax.random.key(3), (64, 128), -128, 128, I32).astype(jnp.int8)
    lay = None if layout is None else getattr(plgpu.Layout, layout)
    expected = a.astype(F16) * 2
    np.testing.assert_array_equal(_int8_to_f16(a, "interpret", transforms, lay, scratch),
                                  expected)
    module = _module(functools.partial(_int8_to_f16, backend="mosaic_gpu",
                                       transforms=transforms, layout=lay, scratch=scratch), a)
    types = [ty for _, ty in inspection.smem_buffers(module)]
    assert types[0].startswith(smem_type), types
    text = str(module)
    assert "arith.sitofp" in text


def _int8_wgmma(a: jax.Array, b: jax.Array, backend: str) -> jax.Array:
    """``a @ b.T`` of int8 blocks in an int32 accumulator, both operands in SMEM buffers of
    a ``pl.run_scoped`` that name no transforms."""
    @functools.partial(plgpu.kernel, out_shape=S((a.shape[0], b.shape[0]), I32),
                       backend=backend, scratch_shapes=[plgpu.ACC((a.shape[0], b.shape[0]),
                                                                  I32)])
    def kernel(a_ref: Any, b_ref: Any, o_ref: Any, acc: Any) -> None:
        def scope(a_smem: Any, b_smem: Any, bar: Any) -> None:
            plgpu.copy_gmem_to_smem(a_ref, a_smem, bar)
            plgpu.copy_gmem_to_smem(b_ref, b_smem, bar)
            plgpu.barrier_wait(bar)
            plgpu.wgmma(acc, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
            plgpu.wgmma_wait(0)

        pl.run_scoped(scope, plgpu.SMEM(a.shape, a.dtype), plgpu.SMEM(b.shape, b.dtype),
                      plgpu.Barrier(num_arrivals=2))
        o_ref[...] = acc[...]

    return kernel(a, b)  # type: ignore[no-any-return]


def test_int8_wgmma_operands_are_tiled() -> None:
    """SMEM buffers that wgmma reads are tiled (8, 128) for int8 without transforms asking,
    as JAX tiles them; the accumulator is a signed int32 one."""
    keys = jax.random.split(jax.random.key(4))
    a = jax.random.randint(keys[0], (64, 128), -128, 128, I32).astype(jnp.int8)
    b = jax.random.randint(keys[1], (128, 128), -128, 128, I32).astype(jnp.int8)
    np.testing.assert_array_equal(_int8_wgmma(a, b, "interpret"),
                                  a.astype(I32) @ b.astype(I32).T)
    module = _module(functools.partial(_int8_wgmma, backend="mosaic_gpu"), a, b)
    types = [ty for _, ty in inspection.smem_buffers(module)]
    assert types[0].startswith("memref<8x1x8x128xi8") and \
        types[1].startswith("memref<16x1x8x128xi8"), types
    assert "wgmma.mma_async" in str(module)


# --- emit_pipeline with plgpu.BlockSpec, transpose_ref ---------------------------------------


def _pipelined_matmul(a: jax.Array, b: jax.Array, backend: str, *, delay: int = 1,
                      steps: int = 2, transforms: Any = SWIZZLED, b_t: bool = False
                      ) -> jax.Array:
    """(M, K) @ (K, N) with K streamed by emit_pipeline in (64, 64) blocks; with ``b_t`` the
    operand is given as (N, K) and read transposed (``transpose_ref``)."""
    m, k = a.shape
    n = b.shape[0] if b_t else b.shape[1]

    @functools.partial(plgpu.kernel, out_shape=S((m, n), F32), backend=backend,
                       scratch_shapes=[plgpu.ACC((m, n))])
    def kernel(a_ref: Any, b_ref: Any, o_ref: Any, acc: Any) -> None:
        def step(_: Any, a_smem: Any, b_smem: Any) -> None:
            plgpu.wgmma(acc, a_smem, plgpu.transpose_ref(b_smem, (1, 0)) if b_t else b_smem)

        b_spec = plgpu.BlockSpec((n, 64), lambda kk: (0, kk), transforms=transforms,
                                 delay_release=delay) if b_t else \
            plgpu.BlockSpec((64, n), lambda kk: (kk, 0), transforms=transforms,
                            delay_release=delay)
        plgpu.emit_pipeline(
            step, grid=(k // 64,), max_concurrent_steps=steps,
            in_specs=[plgpu.BlockSpec((m, 64), lambda kk: (0, kk), transforms=transforms,
                                      delay_release=delay), b_spec])(a_ref, b_ref)
        o_ref[...] = acc[...]

    return kernel(a, b)  # type: ignore[no-any-return]


@pytest.mark.parametrize("b_t", [False, True])
def test_pipeline_with_delay_release(b_t: bool) -> None:
    a, b = _normal(0, (64, 256)), _normal(1, (128, 256) if b_t else (256, 128))
    expected = a.astype(F32) @ (b.T if b_t else b).astype(F32)
    got = _pipelined_matmul(a, b, "interpret", b_t=b_t)
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)
    text = str(_module(functools.partial(_pipelined_matmul, backend="mosaic_gpu", b_t=b_t),
                       a, b))
    # Each step leaves the wgmma of the step before in flight (delay_release=1).
    assert "nvvm.wgmma.wait.group.sync.aligned 1" in text
    assert "wgmma.mma_async" in text


def test_pipeline_refuses_what_it_cannot_honour() -> None:
    a, b = _normal(0, (64, 256)), _normal(1, (256, 128))
    with pytest.raises(pl.PallasError, match="delay_release=2"):
        _pipelined_matmul(a, b, "interpret", delay=2, steps=2)
    with pytest.raises(pl.PallasError, match="TilingTransform"):
        _pipelined_matmul(a, b, "interpret",
                          transforms=(plgpu.TilingTransform((64, 64)),))


def test_transposed_ref_is_only_a_wgmma_operand() -> None:
    @functools.partial(plgpu.kernel, out_shape=S((64, 64), F16), backend="mosaic_gpu",
                       scratch_shapes=[plgpu.SMEM((64, 64), F16),
                                       plgpu.Barrier(num_arrivals=1)])
    def kernel(x_ref: Any, o_ref: Any, smem: Any, bar: Any) -> None:
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        plgpu.barrier_wait(bar)
        o_ref[...] = plgpu.transpose_ref(smem, (1, 0))[...] + 1

    with pytest.raises(pl.PallasError, match="transpos"):
        _module(kernel, _normal(0, (64, 64)))


# --- layouts: a buffer whose rows are sliced stays plain ------------------------------------


def _row_stores(x: jax.Array, rows: jax.Array, backend: str) -> jax.Array:
    """Copies ``rows[0]`` rows of ``x`` starting at row ``rows[1]`` (dynamic) through an SMEM
    buffer, whole rows at a time (TMA stores of 32, 16, ..., 1 rows)."""
    @functools.partial(plgpu.kernel, out_shape=S(x.shape, x.dtype), backend=backend)
    def kernel(x_ref: Any, rows_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.zeros(x.shape, x.dtype)

        def scope(buf: Any) -> None:
            buf[...] = x_ref[...] * 2
            plgpu.commit_smem()
            count, start = rows_ref[0], rows_ref[1]
            for size in (32, 16, 8, 4, 2, 1):
                @pl.when(count & size != 0)
                def _store(size: int = size, start: Any = start) -> None:
                    plgpu.copy_smem_to_gmem(buf.at[pl.ds(start, size)],
                                            o_ref.at[pl.ds(start, size)])
                start = start + (count & size)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.SMEM(x.shape, x.dtype))

    return kernel(x, rows)  # type: ignore[no-any-return]


def test_sliced_buffer_stays_plain() -> None:
    x, rows = _normal(0, (64, 64)), jnp.array([21, 5], I32)
    expected = jnp.zeros_like(x).at[5:26].set(x[5:26] * 2)
    np.testing.assert_array_equal(_row_stores(x, rows, "interpret"), expected)
    module = _module(functools.partial(_row_stores, backend="mosaic_gpu"), x, rows)
    types = [ty for _, ty in inspection.smem_buffers(module)]
    assert any(ty.startswith("memref<64x64xf16") for ty in types), types
