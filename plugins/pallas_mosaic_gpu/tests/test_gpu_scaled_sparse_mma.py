"""Block-scaled and 2:4 sparse ``tcgen05_mma`` (Blackwell), and the copies that fill their TMEM.

``plgpu.async_copy_scales_to_tmem`` and ``plgpu.async_copy_sparse_metadata_to_tmem`` move the
scales and the metadata from SMEM, laid out as PTX's ``tcgen05.cp`` reads them, into TMEM
buffers of ``plgpu.TMEMLayout.SCALES_LAYOUT`` and ``SPARSE_METADATA_LAYOUT``; ``tcgen05_mma``
takes them as ``a_scale``/``b_scale`` and ``a_sparse_metadata``. Each kernel (the ones of JAX's
own Mosaic GPU tests, written here against both modules) is run in the interpreter against
``jax.numpy`` on random operands, scales and sparsity patterns, and lowered for ``cuda`` next to
JAX's lowering of the same kernel: the launch, shared memory and call config agree, and so do
the tcgen05 instructions, counted by kind (``kind::mxf8f6f4.block_scale``, ``.sp``, ...).
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jplgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

F32 = jnp.float32
S = jax.ShapeDtypeStruct
OURS, JAXS = (pl, plgpu), (None, jplgpu)


def _transforms(gpu: Any, dtype: Any) -> tuple[Any, ...]:
    """Tiles of 8 rows by 128 bytes, swizzled by 128 bytes (as JAX's tests spell them)."""
    bits = jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating) else \
        jnp.iinfo(dtype).bits
    return (gpu.TilingTransform((8, 128 * 8 // bits)), gpu.SwizzleTransform(128))


def _transposed(gpu: Any, ref: Any) -> Any:
    return ref.transpose((1, 0)) if hasattr(ref, "transpose") else \
        gpu.transpose_ref(ref, (1, 0))


def _kernel(mods: Any, mma: Any, operands: list[tuple[Any, ...]], out: S, tmem: list[Any],
            backend: str) -> Any:
    """A kernel of JAX's form (``plgpu.kernel``): each operand copied by TMA into an SMEM
    buffer (``(shape, dtype, tiled)``), then ``mma(*smem buffers, acc, *tmem)``, the
    accumulator read back into SMEM and copied out."""
    pallas, gpu = mods
    n = len(operands)

    def body(*refs: Any) -> None:
        gmem, out_gmem, smem = refs[:n], refs[n], refs[n + 1:2 * n + 1]
        out_smem, tma_bar, mma_bar, acc, *more = refs[2 * n + 1:]
        for src, dst in zip(gmem, smem):
            gpu.copy_gmem_to_smem(src, dst, tma_bar)
        gpu.barrier_wait(tma_bar)
        mma(*smem, acc, *more)
        gpu.tcgen05_commit_arrive(mma_bar)
        gpu.barrier_wait(mma_bar)
        out_smem[...] = gpu.async_load_tmem(acc)
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(out_smem, out_gmem)
        gpu.wait_smem_to_gmem(0)

    smem = [gpu.SMEM(shape, dtype, transforms=_transforms(gpu, dtype) if tiled else ())
            for shape, dtype, tiled in operands]
    scratch = [*smem, gpu.SMEM(out.shape, out.dtype, transforms=_transforms(gpu, out.dtype)),
               gpu.Barrier(num_arrivals=n), gpu.Barrier(orders_tensor_core=True),
               gpu.TMEM(out.shape, F32), *tmem]
    new = "out_type" in inspect.signature(gpu.kernel).parameters  # JAX 0.12's names
    kw = {"out_type" if new else "out_shape": out,
          "scratch_types" if new else "scratch_shapes": scratch}
    if pallas is pl:
        kw["backend"] = backend
    return gpu.kernel(body, **kw)


def _scaled_kernel(mods: Any, m: int, n: int, k: int, a_type: Any, b_type: Any, block: int,
                   backend: str = "mosaic_gpu", sparse: bool = False) -> Any:
    """``x (M, K) * scales @ (y (N, K) * scales).T`` (``x`` (M, K // 2) with metadata, if
    ``sparse``), one tcgen05_mma."""
    gpu = mods[1]
    layout, scale = gpu.TMEMLayout, jnp.float8_e8m0fnu

    def mma(a: Any, b: Any, *rest: Any) -> None:
        meta, a_scale, b_scale = rest[:3] if sparse else (None, *rest[:2])
        acc, *tmem = rest[3:] if sparse else rest[2:]
        meta_t = tmem.pop(0) if sparse else None
        a_scale_t, b_scale_t = tmem
        if sparse:
            gpu.async_copy_sparse_metadata_to_tmem(meta, meta_t)
        gpu.async_copy_scales_to_tmem(a_scale, a_scale_t)
        gpu.async_copy_scales_to_tmem(b_scale, b_scale_t)
        gpu.tcgen05_mma(acc, a, _transposed(gpu, b), a_scale=a_scale_t, b_scale=b_scale_t,
                        a_sparse_metadata=meta_t, accumulate=False)

    operands = [((m, k // 2 if sparse else k), a_type, True), ((n, k), b_type, True)]
    if sparse:
        operands.append(((m // 128, k // 128, 128, 64), jnp.uint2, False))
    operands += [((m // 128, k // block // 4, 32, 16), scale, False),
                 ((n // 128, k // block // 4, 32, 16), scale, False)]
    tmem = [gpu.TMEM((m, k // 2), jnp.uint2, layout=layout.SPARSE_METADATA_LAYOUT)] \
        if sparse else []
    tmem += [gpu.TMEM((m, k // block), scale, layout=layout.SCALES_LAYOUT),
             gpu.TMEM((n, k // block), scale, layout=layout.SCALES_LAYOUT)]
    return _kernel(mods, mma, operands, S((m, n), F32), tmem, backend)


def _sparse_kernel(mods: Any, m: int, n: int, k: int, dtype: Any,
                   backend: str = "mosaic_gpu") -> Any:
    """``x (M, K // 2) with metadata @ y (N, K).T``, one sparse tcgen05_mma."""
    gpu = mods[1]

    def mma(a: Any, b: Any, meta: Any, acc: Any, meta_t: Any) -> None:
        gpu.async_copy_sparse_metadata_to_tmem(meta, meta_t)
        gpu.tcgen05_mma(acc, a, _transposed(gpu, b), a_sparse_metadata=meta_t,
                        accumulate=False)

    operands = [((m, k // 2), dtype, True), ((n, k), dtype, True),
                ((m // 128, k // 128, 128, 64), jnp.uint2, False)]
    tmem = [gpu.TMEM((m, k // 2), jnp.uint2, layout=gpu.TMEMLayout.SPARSE_METADATA_LAYOUT)]
    return _kernel(mods, mma, operands, S((m, n), F32), tmem, backend)


def _format_scales(scales: jax.Array) -> jax.Array:
    """(MN, C) scales as ``tcgen05.cp`` reads them: (MN // 128, C // 4, 32, 16)."""
    mn, c = scales.shape
    return scales.reshape(mn // 128, 4, 32, c // 4, 4).transpose(0, 3, 2, 1, 4).reshape(
        mn // 128, c // 4, 32, 16)


def _scales(seed: int, shape: tuple[int, int]) -> jax.Array:
    """Powers of two from 2**-5 to 2**4 (float8_e8m0fnu)."""
    bits = jax.random.randint(jax.random.key(seed), shape, 122, 132, dtype=jnp.uint8)
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)


def _sparsity(seed: int, m: int, k: int) -> np.ndarray:
    """For each group of four along K, two distinct increasing positions: (M, K // 4, 2)."""
    pairs = np.array([(i, j) for i in range(4) for j in range(4) if i < j])
    return pairs[np.asarray(jax.random.randint(jax.random.key(seed), (m, k // 4), 0, 6))]


def _densify(x: jax.Array, positions: np.ndarray) -> np.ndarray:
    """The dense (M, K) operand: each group's two kept values at their positions."""
    m = x.shape[0]
    dense = np.zeros((m, positions.shape[1], 4), np.float32)
    np.put_along_axis(dense, positions, np.asarray(x, np.float32).reshape(positions.shape),
                      axis=-1)
    return dense.reshape(m, -1)


def _uniform(seed: int, shape: tuple[int, int], dtype: Any) -> jax.Array:
    return jax.random.uniform(jax.random.key(seed), shape, F32, -1.0, 1.0).astype(dtype)


_tcgen05 = inspection.tcgen05_counts
_lower = inspection.blackwell_kernel


def _agree(ours: Any, theirs: Any, *args: Any) -> Any:
    """Both lowered for cuda: the same kernel (launch, SMEM, config) and tcgen05 instructions;
    or, where the installed JAX's Mosaic GPU library cannot build the matmul (JAX 0.10 takes
    neither two 8-bit dtypes at once nor 4-bit operands with blocks of 16), both refuse it,
    ours with an UnsupportedError. Returns the instructions, or ``None`` for a refusal."""
    try:
        expected = _lower(theirs, *args)
    except Exception as e:  # JAX's error types vary by version
        with pytest.raises(pl.UnsupportedError, match="tcgen05_mma"):
            _lower(ours, *args)
        return print(f"refused, as JAX's lowering: {e!s:.200}")
    found = _lower(ours, *args)
    inspection.assert_same_kernel(found, expected)
    assert _tcgen05(found[1]) == _tcgen05(expected[1])
    return _tcgen05(found[1])


SCALED = [  # (m, n, k, a dtype, b dtype, block)
    (128, 128, 256, jnp.float8_e5m2, jnp.float8_e5m2, 32),
    (128, 256, 128, jnp.float8_e4m3fn, jnp.float8_e5m2, 32),
    (128, 256, 256, jnp.float4_e2m1fn, jnp.float4_e2m1fn, 32),
    (128, 128, 256, jnp.float4_e2m1fn, jnp.float4_e2m1fn, 16),
]


@pytest.mark.parametrize("m, n, k, a_type, b_type, block", SCALED,
                         ids=["e5m2", "e4m3xe5m2", "e2m1", "e2m1-block16"])
def test_block_scaled_matmul(m: int, n: int, k: int, a_type: Any, b_type: Any,
                             block: int) -> None:
    x, y = _uniform(1, (m, k), a_type), _uniform(2, (n, k), b_type)
    xs, ys = _scales(3, (m, k // block)), _scales(4, (n, k // block))
    args = (x, y, _format_scales(xs), _format_scales(ys))
    got = _scaled_kernel(OURS, m, n, k, a_type, b_type, block, backend="interpret")(*args)
    scaled_x = x.astype(F32) * jnp.repeat(xs.astype(F32), block, axis=1)
    scaled_y = y.astype(F32) * jnp.repeat(ys.astype(F32), block, axis=1)
    want = jnp.dot(scaled_x, scaled_y.T, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ops = _agree(_scaled_kernel(OURS, m, n, k, a_type, b_type, block),
                 _scaled_kernel(JAXS, m, n, k, a_type, b_type, block), *args)
    if ops is None:
        assert (a_type != b_type or block == 16) and jax.__version_info__ < (0, 11)
        return
    assert any(".block_scale" in op for op in ops), ops
    copies = sum(count for op, count in ops.items() if op.startswith("tcgen05.cp"))
    assert copies == (m // 128 + n // 128) * (k // block // 4)  # one per tile of scales


@pytest.mark.parametrize("n", [128, 256])
def test_sparse_matmul(n: int) -> None:
    m, k, dtype = 128, 128, jnp.float16
    x, y = _uniform(5, (m, k // 2), dtype), _uniform(6, (n, k), dtype)
    positions = _sparsity(7, m, k)
    meta = plgpu.format_tcgen05_sparse_metadata(positions.astype(jnp.uint2), dtype)
    got = _sparse_kernel(OURS, m, n, k, dtype, backend="interpret")(x, y, meta)
    want = _densify(x, positions) @ np.asarray(y, np.float32).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ops = _agree(_sparse_kernel(OURS, m, n, k, dtype), _sparse_kernel(JAXS, m, n, k, dtype),
                 x, y, meta)
    assert any(".sp." in op for op in ops), ops


def test_block_scaled_sparse_matmul() -> None:
    m, n, k, block, dtype = 128, 128, 256, 64, jnp.float8_e5m2
    x, y = _uniform(8, (m, k // 2), dtype), _uniform(9, (n, k), dtype)
    positions = _sparsity(10, m, k)
    meta = plgpu.format_tcgen05_sparse_metadata(positions.astype(jnp.uint2), dtype)
    xs, ys = _scales(11, (m, k // block)), _scales(12, (n, k // block))
    args = (x, y, meta, _format_scales(xs), _format_scales(ys))
    got = _scaled_kernel(OURS, m, n, k, dtype, dtype, block, backend="interpret",
                         sparse=True)(*args)
    dense = _densify(x, positions) * np.repeat(np.asarray(xs, np.float32), block, axis=1)
    scaled_y = np.asarray(y, np.float32) * np.repeat(np.asarray(ys, np.float32), block, axis=1)
    np.testing.assert_allclose(got, dense @ scaled_y.T, rtol=1e-5, atol=1e-5)
    _agree(_scaled_kernel(OURS, m, n, k, dtype, dtype, block, sparse=True),
           _scaled_kernel(JAXS, m, n, k, dtype, dtype, block, sparse=True), *args)


def _refused(build: Any) -> None:
    def body(x_ref: Any, o_ref: Any, acc: Any, scales: Any, meta: Any, smem: Any) -> None:
        build(acc, scales, meta, smem)

    scratch = [plgpu.TMEM((128, 128), F32),
               plgpu.TMEM((128, 8), jnp.float8_e8m0fnu, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
               plgpu.TMEM((128, 64), jnp.uint2,
                          layout=plgpu.TMEMLayout.SPARSE_METADATA_LAYOUT),
               plgpu.SMEM((128, 128), jnp.float8_e5m2)]
    plgpu.kernel(body, out_shape=S((128,), F32), scratch_shapes=scratch,
                 backend="interpret")(jnp.zeros((128,), F32))


@pytest.mark.parametrize("build, match", [
    (lambda acc, sc, meta, s: plgpu.tcgen05_mma(acc, s, s, a_scale=sc), "go together"),
    (lambda acc, sc, meta, s: plgpu.tcgen05_mma(acc, s, s, a_scale=acc, b_scale=sc),
     "a_scale is a TMEM Ref of the default layout, expected one of SCALES_LAYOUT"),
    (lambda acc, sc, meta, s: plgpu.tcgen05_mma(acc, s, s, a_sparse_metadata=meta),
     r"a \(M, K // 2\)"),
    (lambda acc, sc, meta, s: plgpu.async_copy_scales_to_tmem(s, sc),
     r"expected an SMEM Ref float8_e8m0fnu\[1, 2, 32, 16\]"),
    (lambda acc, sc, meta, s: plgpu.async_copy_scales_to_tmem(s, meta),
     "a TMEM Ref of SCALES_LAYOUT"),
])
def test_misuse_is_named(build: Any, match: str) -> None:
    with pytest.raises(pl.PallasError, match=match):
        _refused(build)


def test_tmem_layouts_check_their_buffers() -> None:
    layout = plgpu.TMEMLayout
    with pytest.raises(pl.PallasError, match="holds float8_e8m0fnu or float8_e4m3fn"):
        plgpu.TMEM((128, 8), F32, layout=layout.SCALES_LAYOUT)
    with pytest.raises(pl.PallasError, match="columns of 64"):
        plgpu.TMEM((128, 32), jnp.uint2, layout=layout.SPARSE_METADATA_LAYOUT)
    with pytest.raises(pl.UnsupportedError, match="SCALES_M64_COLLECTIVE_LAYOUT"):
        plgpu.TMEM((256, 4), jnp.float8_e8m0fnu, layout=layout.SCALES_M64_COLLECTIVE_LAYOUT)
    with pytest.raises(pl.PallasError, match="packed= and layout="):
        plgpu.TMEM((128, 8), jnp.float8_e8m0fnu, layout=layout.SCALES_LAYOUT, packed=True)
