"""TMEM as a matmul operand (Blackwell): packed TMEM buffers, ``tcgen05_mma`` with ``a`` in
TMEM, and the M=64 collective TMEM layout.

``plgpu.TMEM(shape, dtype, packed=True)`` holds ``32 // bits`` elements of a narrower dtype in
each 32-bit column, the layout ``tcgen05_mma`` reads ``a`` from TMEM in (``kind::f16`` with
``a`` at a TMEM address, ``b`` by an SMEM descriptor). ``M64_COLLECTIVE_LAYOUT(columns)`` is
the layout of 64 rows of the accumulator of a collective matmul with M=128 (64 rows per
block). Each kernel is written once against both modules (this project's and JAX's), lowered
for ``cuda`` (sm_100a) by both: the launch, shared memory and call config agree, and so do the
tcgen05 instructions, counted by kind; or, where the installed JAX's Mosaic GPU library cannot
build it, both refuse it. Each runs in the interpreter against ``jax.numpy`` on random inputs.
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jplgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
jpl = pytest.importorskip("jax.experimental.pallas")
from pallas_mosaic_gpu import inspection  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
S = jax.ShapeDtypeStruct
OURS, JAXS = (pl, plgpu), (jpl, jplgpu)
HIGHEST = lax.Precision.HIGHEST


def _bits(dtype: Any) -> int:
    return jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating) else \
        jnp.iinfo(dtype).bits


def _transforms(gpu: Any, dtype: Any) -> tuple[Any, ...]:
    """Tiles of 8 rows by 128 bytes, swizzled by 128 bytes (as JAX's tests spell them)."""
    return (gpu.TilingTransform((8, 128 * 8 // _bits(dtype))), gpu.SwizzleTransform(128))


def _kernel_kw(pallas: Any, gpu: Any, out: Any, scratch: list[Any], **kw: Any) -> dict[str, Any]:
    new = "out_type" in inspect.signature(gpu.kernel).parameters  # JAX 0.12's names
    kw.update({"out_type" if new else "out_shape": out,
               "scratch_types" if new else "scratch_shapes": scratch})
    if pallas is pl:
        kw["backend"] = kw.pop("backend", "mosaic_gpu")
    else:
        kw.pop("backend", None)
    return kw


def _lhs_in_tmem(mods: Any, m: int, n: int, k: int, dtype: Any, transpose_b: bool,
                 backend: str = "mosaic_gpu") -> Any:
    """``x (M, K) @ y`` with ``x`` copied by TMA into SMEM, from there into TMEM
    (``tcgen05.cp``, packed for 16-bit and 8-bit dtypes), and ``y`` ((K, N), or (N, K) read
    transposed) read from SMEM: one ``tcgen05_mma`` into a float32 accumulator."""
    pallas, gpu = mods
    b_shape = (n, k) if transpose_b else (k, n)

    def body(a_gmem: Any, b_gmem: Any, o_gmem: Any, a_smem: Any, b_smem: Any, o_smem: Any,
             tma_bar: Any, mma_bar: Any, acc: Any, a_tmem: Any) -> None:
        gpu.copy_gmem_to_smem(a_gmem, a_smem, tma_bar)
        gpu.copy_gmem_to_smem(b_gmem, b_smem, tma_bar)
        gpu.barrier_wait(tma_bar)
        gpu.async_copy_smem_to_tmem(a_smem, a_tmem)
        b = (b_smem.transpose((1, 0)) if hasattr(b_smem, "transpose") else
             gpu.transpose_ref(b_smem, (1, 0))) if transpose_b else b_smem
        gpu.tcgen05_mma(acc, a_tmem, b, accumulate=False)
        gpu.tcgen05_commit_arrive(mma_bar)
        gpu.barrier_wait(mma_bar)
        o_smem[...] = gpu.async_load_tmem(acc)
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(o_smem, o_gmem)
        gpu.wait_smem_to_gmem(0)

    packed = True if _bits(dtype) < 32 else None
    scratch = [gpu.SMEM((m, k), dtype, transforms=_transforms(gpu, dtype)),
               gpu.SMEM(b_shape, dtype, transforms=_transforms(gpu, dtype)),
               gpu.SMEM((m, n), F32, transforms=_transforms(gpu, F32)),
               gpu.Barrier(num_arrivals=2), gpu.Barrier(orders_tensor_core=True),
               gpu.TMEM((m, n), F32), gpu.TMEM((m, k), dtype, packed=packed)]
    return gpu.kernel(body, **_kernel_kw(pallas, gpu, S((m, n), F32), scratch,
                                         backend=backend))


def _packed_round_trip(mods: Any, shape: tuple[int, int], dtype: Any,
                       backend: str = "mosaic_gpu") -> Any:
    """``x`` through SMEM into a packed TMEM buffer (``tcgen05.cp``), read back into registers
    (``tcgen05.ld``) and out, doubled."""
    pallas, gpu = mods

    def body(x_gmem: Any, o_gmem: Any, x_smem: Any, o_smem: Any, tma_bar: Any, bar: Any,
             tmem: Any) -> None:
        gpu.copy_gmem_to_smem(x_gmem, x_smem, tma_bar)
        gpu.barrier_wait(tma_bar)
        gpu.async_copy_smem_to_tmem(x_smem, tmem)
        gpu.tcgen05_commit_arrive(bar)
        gpu.barrier_wait(bar)
        o_smem[...] = gpu.async_load_tmem(tmem).astype(F32) * 2
        gpu.wait_load_tmem()
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(o_smem, o_gmem)
        gpu.wait_smem_to_gmem(0)

    scratch = [gpu.SMEM(shape, dtype, transforms=_transforms(gpu, dtype)),
               gpu.SMEM(shape, F32), gpu.Barrier(), gpu.Barrier(orders_tensor_core=True),
               gpu.TMEM(shape, dtype, packed=True)]
    return gpu.kernel(body, **_kernel_kw(pallas, gpu, S(shape, F32), scratch,
                                         backend=backend))


def _m64_collective(mods: Any, n: int, k: int, explicit: bool,
                    backend: str = "mosaic_gpu") -> Any:
    """``a (128, K) @ b (K, 2 N)`` by the 2 blocks of a cluster, 64 rows of ``a`` and the
    accumulator and ``N`` columns of ``b`` each (partitioned copies tracked by the first
    block); the first issues one collective matmul; the accumulator (64, 2 N) per block is
    in the M=64 collective layout (given by name when ``explicit``, else inferred)."""
    pallas, gpu = mods

    def body(a_ref: Any, b_ref: Any, o_ref: Any, a_smem: Any, b_smem: Any, acc: Any,
             out_smem: Any, loaded: Any, done: Any) -> None:
        c = lax.axis_index("x")
        gpu.copy_gmem_to_smem(a_ref, a_smem, loaded, collective_axes="x",
                              leader_tracked=gpu.CopyPartition.PARTITIONED(0))
        gpu.copy_gmem_to_smem(b_ref, b_smem, loaded, collective_axes="x",
                              leader_tracked=gpu.CopyPartition.PARTITIONED(1))

        @pallas.when(c == 0)
        def _() -> None:
            gpu.barrier_wait(loaded)
            gpu.tcgen05_mma(acc, a_smem, b_smem, done, accumulate=False, collective_axis="x")

        gpu.barrier_wait(done)
        out_smem[...] = gpu.async_load_tmem(acc)
        gpu.wait_load_tmem()
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(out_smem, o_ref.at[pallas.ds(c * 64, 64)])
        gpu.wait_smem_to_gmem(0)

    layout = {"layout": gpu.TMEMLayout.M64_COLLECTIVE_LAYOUT(2 * n)} if explicit else {}
    scratch = [gpu.SMEM((64, k), F16, transforms=_transforms(gpu, F16)),
               gpu.SMEM((k, n), F16, transforms=_transforms(gpu, F16)),
               gpu.TMEM((64, 2 * n), F32, collective=True, **layout),
               gpu.SMEM((64, 2 * n), F32), gpu.Barrier(num_arrivals=2),
               gpu.Barrier(orders_tensor_core=True)]
    return gpu.kernel(body, **_kernel_kw(pallas, gpu, S((128, 2 * n), F32), scratch,
                                         backend=backend, grid=(1,), grid_names=("i",),
                                         cluster=(2,), cluster_names=("x",)))


_tcgen05 = inspection.tcgen05_counts
_lower = inspection.blackwell_kernel


def _loads_as_one(ops: collections.Counter[str]) -> collections.Counter[str]:
    """The instructions, TMEM reads (``tcgen05.ld`` of any shape) counted together."""
    return collections.Counter({("tcgen05.ld" if op.startswith("tcgen05.ld") else op): n
                                for op, n in ops.items()})


def _agree(ours: Any, theirs: Any, *args: Any, any_load_shape: bool = False) -> Any:
    """Both lowered for cuda: the same kernel (launch, SMEM, config) and tcgen05
    instructions (``any_load_shape``: TMEM reads of any shape); or, where the installed JAX's
    library cannot build it, both refuse it, ours with an UnsupportedError. Returns the
    instructions, or ``None`` for a refusal."""
    try:
        expected = _lower(theirs, *args)
    except Exception as e:  # JAX's error types vary by version
        with pytest.raises(pl.UnsupportedError):
            _lower(ours, *args)
        return print(f"refused, as JAX's lowering: {e!s:.300}")
    found = _lower(ours, *args)
    inspection.assert_same_kernel(found, expected)
    same = _loads_as_one if any_load_shape else (lambda ops: ops)
    assert same(_tcgen05(found[1])) == same(_tcgen05(expected[1]))
    return _tcgen05(found[1])


def _rand(seed: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


LHS_CASES = [  # (m, n, k, dtype, transpose_b)
    (128, 128, 128, BF16, False),
    (128, 256, 64, F16, True),
    (128, 128, 256, BF16, True),
    (128, 128, 64, F32, False),
    (128, 128, 128, jnp.float8_e5m2, True),
]


@pytest.mark.parametrize("m, n, k, dtype, transpose_b", LHS_CASES,
                         ids=["bf16", "f16-bT", "bf16-k256", "tf32", "e5m2"])
def test_tcgen05_mma_with_a_in_tmem(m: int, n: int, k: int, dtype: Any,
                                    transpose_b: bool) -> None:
    x = _rand(1, (m, k), dtype)
    y = _rand(2, (n, k) if transpose_b else (k, n), dtype)
    got = _lhs_in_tmem(OURS, m, n, k, dtype, transpose_b, backend="interpret")(x, y)
    y_kn = y.T if transpose_b else y
    want = jnp.dot(x.astype(F32), y_kn.astype(F32), precision=HIGHEST)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    ops = _agree(_lhs_in_tmem(OURS, m, n, k, dtype, transpose_b),
                 _lhs_in_tmem(JAXS, m, n, k, dtype, transpose_b), x, y)
    if ops is None:  # JAX's library takes no tf32 matmul with a in TMEM, at any version
        assert dtype == F32
        return
    # a is copied into TMEM (tcgen05.cp) and read by the matmuls from there.
    assert any(op.startswith("tcgen05.cp") for op in ops), ops
    assert any(op.startswith("tcgen05.mma") for op in ops), ops


@pytest.mark.parametrize("shape, dtype", [((128, 128), BF16), ((128, 256), F16),
                                          ((128, 128), jnp.float8_e4m3fn)],
                         ids=["bf16", "f16", "e4m3"])
def test_packed_tmem_round_trip(shape: tuple[int, int], dtype: Any) -> None:
    x = _rand(3, shape, dtype)
    got = _packed_round_trip(OURS, shape, dtype, backend="interpret")(x)
    np.testing.assert_array_equal(got, x.astype(F32) * 2)
    ops = _agree(_packed_round_trip(OURS, shape, dtype), _packed_round_trip(JAXS, shape, dtype),
                 x)
    if ops is not None:
        assert any(op.startswith("tcgen05.ld") for op in ops), ops


def test_unpacked_16bit_tmem_round_trip() -> None:
    """``packed=False``: one 16-bit element per 32-bit column, written from registers."""
    def body(x_ref: Any, o_ref: Any, tmem: Any, smem: Any) -> None:
        smem[...] = x_ref[...]
        plgpu.async_store_tmem(tmem, smem[...])
        plgpu.commit_tmem()
        o_ref[...] = plgpu.async_load_tmem(tmem).astype(F32) + 1
        plgpu.wait_load_tmem()

    def run(x: jax.Array, backend: str) -> jax.Array:
        return plgpu.kernel(body, out_shape=S((128, 64), F32), backend=backend,
                            scratch_shapes=[plgpu.TMEM((128, 64), BF16, packed=False),
                                            plgpu.SMEM((128, 64), BF16)])(x)

    x = _rand(4, (128, 64), BF16)
    np.testing.assert_array_equal(run(x, "interpret"), x.astype(F32) + 1)
    module = str(_lower(lambda v: run(v, "mosaic_gpu"), x)[1])
    assert "tcgen05.st" in module and "tcgen05.ld" in module


def test_a_in_tmem_written_from_registers() -> None:
    """``a`` stored into packed TMEM from registers (``tcgen05.st``, ``commit_tmem``), then
    read by ``tcgen05_mma`` from there, accumulating onto the accumulator's ones."""
    def body(a_ref: Any, b_ref: Any, o_ref: Any, a_smem: Any, b_smem: Any, acc: Any,
             a_tmem: Any, bar: Any) -> None:
        a_smem[...] = a_ref[...]
        b_smem[...] = b_ref[...]
        plgpu.async_store_tmem(a_tmem, a_smem[...])
        plgpu.async_store_tmem(acc, jnp.ones((128, 128), F32))
        plgpu.commit_tmem()
        plgpu.tcgen05_mma(acc, a_tmem, b_smem, bar)
        plgpu.barrier_wait(bar)
        o_ref[...] = plgpu.async_load_tmem(acc)
        plgpu.wait_load_tmem()

    def run(a: jax.Array, b: jax.Array, backend: str) -> jax.Array:
        return plgpu.kernel(body, out_shape=S((128, 128), F32), backend=backend,
                            scratch_shapes=[plgpu.SMEM((128, 64), BF16),
                                            plgpu.SMEM((64, 128), BF16),
                                            plgpu.TMEM((128, 128), F32),
                                            plgpu.TMEM((128, 64), BF16, packed=True),
                                            plgpu.Barrier(orders_tensor_core=True)])(a, b)

    a, b = _rand(7, (128, 64), BF16), _rand(8, (64, 128), BF16)
    want = jnp.dot(a.astype(F32), b.astype(F32), precision=HIGHEST) + 1
    np.testing.assert_allclose(run(a, b, "interpret"), want, rtol=1e-5, atol=1e-4)
    ops = _tcgen05(_lower(lambda x, y: run(x, y, "mosaic_gpu"), a, b)[1])
    assert sum(n for op, n in ops.items() if op.startswith("tcgen05.mma")) == 64 // 16, ops
    assert any(op.startswith("tcgen05.st") for op in ops), ops


@pytest.mark.parametrize("explicit", [True, False], ids=["named", "inferred"])
def test_m64_collective_matmul(explicit: bool) -> None:
    n, k = 64, 128
    a, b = _rand(5, (128, k), F16), _rand(6, (k, 2 * n), F16)
    got = _m64_collective(OURS, n, k, explicit, backend="interpret")(a, b)
    want = jnp.dot(a.astype(F32), b.astype(F32), precision=HIGHEST)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # JAX 0.11's lowering reads the accumulator in the TMEM's own tiled layout (tcgen05.ld
    # 32x32b); this backend, as JAX 0.10 and 0.12, in the library's register layout for it
    # (16x256b): the same number of reads.
    ops = _agree(_m64_collective(OURS, n, k, explicit), _m64_collective(JAXS, n, k, explicit),
                 a, b, any_load_shape=(0, 11) <= jax.__version_info__ < (0, 12))
    if ops is not None:
        assert any("cta_group::2" in op for op in ops), ops


def _misuse(build: Any, tmem: list[Any]) -> None:
    def body(x_ref: Any, o_ref: Any, acc: Any, s: Any, *more: Any) -> None:
        build(acc, s, *more)

    plgpu.kernel(body, out_shape=S((128,), F32), backend="interpret",
                 scratch_shapes=[plgpu.TMEM((128, 128), F32), plgpu.SMEM((128, 128), F16),
                                 *tmem])(jnp.zeros((128,), F32))


def test_misuse_is_named() -> None:
    with pytest.raises(pl.PallasError, match="packed=True"):
        _misuse(lambda acc, s, t: plgpu.tcgen05_mma(acc, t, s),
                [plgpu.TMEM((128, 128), F16, packed=False)])
    with pytest.raises(pl.PallasError, match="collective=True"):
        _misuse(lambda acc, s, t: plgpu.tcgen05_mma(acc, t, s, collective_axis="x"),
                [plgpu.TMEM((128, 128), F16, packed=True)])
    with pytest.raises(pl.PallasError, match="narrower than 32 bits needs packed="):
        plgpu.TMEM((128, 128), F16)
    with pytest.raises(pl.UnsupportedError, match="128 rows"):
        plgpu.TMEM((96, 128), F32)
    with pytest.raises(pl.PallasError, match="takes the number of columns"):
        plgpu.TMEM((64, 128), F32, layout=plgpu.TMEMLayout.M64_COLLECTIVE_LAYOUT)
    with pytest.raises(pl.PallasError, match="lays out 64 rows"):
        plgpu.TMEM((128, 128), F32, layout=plgpu.TMEMLayout.M64_COLLECTIVE_LAYOUT(128))
    with pytest.raises(pl.UnsupportedError, match="SCALES_M64_COLLECTIVE_LAYOUT"):
        plgpu.TMEM((256, 4), jnp.float8_e8m0fnu,
                   layout=plgpu.TMEMLayout.SCALES_M64_COLLECTIVE_LAYOUT)
    space = plgpu.TMEM((128, 128), BF16, packed=True).memory_space
    assert space.packing == 2 and space.name == "TMEM"
    assert plgpu.TMEM((128, 128), F32, packed=True).memory_space.packing == 1
