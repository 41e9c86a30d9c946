"""Register layouts a kernel asks for (``plgpu.Layout``, ``layout_cast``, ``load(layout=)``,
``broadcasted_iota(layout=)``), ``set_max_registers``, ``commit_smem_to_gmem_group`` and
``plgpu.ACC.init`` with ``pl.run_state``, as JAX's attention_mgpu uses them: each kernel lowers
for ``cuda`` into a module that verifies and holds the operation asked for, and runs in the
interpreter against ``jax.numpy`` on random inputs."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.mosaic import gpu as mgpu

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

S = jax.ShapeDtypeStruct
F32, F16 = jnp.float32, jnp.float16
L = plgpu.Layout


def rand(seed: int, shape: tuple[int, ...], dtype=F32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def module_text(fn, *args) -> str:
    """The verified Mosaic GPU module of ``fn``'s single kernel, as text."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    ((_, module),) = inspection.kernels(text)  # hash checked, parsed back, verified
    return str(module)


def row_max_shift(x: jax.Array, backend: str = "mosaic_gpu", whole: bool = False) -> jax.Array:
    """x - rowmax(x) + column index: a running maximum started in the row layout, the row
    maxima stored to SMEM and read back in the row layout, an iota in the wgmma layout."""
    @functools.partial(plgpu.kernel, out_type=S(x.shape, F32), backend=backend,
                       scratch_types=[plgpu.SMEM((x.shape[0],), F32)])
    def kernel(x_ref, o_ref, rows):
        m = plgpu.layout_cast(jnp.full((x.shape[0],), -jnp.inf, F32), L.WGMMA.reduce(1))
        v = plgpu.layout_cast(x_ref[...], L.WGMMA)
        rows[...] = jnp.maximum(m, v.max(axis=1))
        # JAX 0.12's spelling reads the whole Ref (no index); JAX 0.10's takes one.
        r = (plgpu.load(rows, layout=L.WGMMA.reduce(1)) if whole
             else plgpu.load(rows, (), layout=L.WGMMA.reduce(1)))
        cols = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=L.WGMMA)
        o_ref[...] = v - lax.broadcast_in_dim(r, x.shape, [0]) + cols.astype(F32)

    return kernel(x)  # type: ignore[no-any-return]


def row_max_shift_ref(x: jax.Array) -> jax.Array:
    return x - x.max(axis=1, keepdims=True) + jnp.arange(x.shape[1], dtype=F32)[None]


def test_layout_cast_load_and_iota_lower() -> None:
    text = module_text(row_max_shift, S((64, 128), F32))
    assert "shfl.sync" in text  # the row maximum reduces across the lanes of a row


def test_layout_cast_load_and_iota_in_the_interpreter() -> None:
    x = rand(0, (64, 128))
    got = row_max_shift(x, backend="interpret")
    np.testing.assert_allclose(got, row_max_shift_ref(x), rtol=1e-6)


def test_load_without_an_index_reads_the_whole_ref() -> None:
    """``plgpu.load(ref, layout=...)`` (JAX 0.12) is ``plgpu.load(ref, (), layout=...)``."""
    x = rand(1, (64, 128))
    got = row_max_shift(x, backend="interpret", whole=True)
    np.testing.assert_allclose(got, row_max_shift_ref(x), rtol=1e-6)
    whole = module_text(lambda a: row_max_shift(a, whole=True), S((64, 128), F32))
    assert whole == module_text(row_max_shift, S((64, 128), F32))


def test_iota_without_layout_is_lax_iota() -> None:
    a = plgpu.broadcasted_iota(jnp.int32, (4, 8), 0)
    np.testing.assert_array_equal(a, lax.broadcasted_iota(jnp.int32, (4, 8), 0))
    with pytest.raises(pl.PallasError, match="dimension 2"):
        plgpu.broadcasted_iota(jnp.int32, (4, 8), 2, layout=L.WGMMA)


@pytest.mark.parametrize("dim", [0, 1])
def test_iota_in_the_wgmma_layout(dim: int) -> None:
    def f(x, backend="mosaic_gpu"):
        @functools.partial(plgpu.kernel, out_type=S(x.shape, jnp.int32), backend=backend)
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * plgpu.broadcasted_iota(jnp.int32, x.shape, dim,
                                                               layout=L.WGMMA)
        return kernel(x)

    x = jax.random.randint(jax.random.key(dim), (64, 64), -50, 50, jnp.int32)
    module_text(f, x)
    np.testing.assert_array_equal(f(x, backend="interpret"),
                                  x * lax.broadcasted_iota(jnp.int32, x.shape, dim))


def test_layouts_map_to_the_library() -> None:
    assert L.WGMMA.to_mgpu() == mgpu.WGMMA_LAYOUT
    assert L.WGMMA.reduce(1).to_mgpu() == mgpu.WGMMA_ROW_LAYOUT
    assert L.WGMMA.reduce(0).to_mgpu() == mgpu.WGMMA_COL_LAYOUT
    assert L.WGMMA_TRANSPOSED.to_mgpu() == mgpu.WGMMA_TRANSPOSED_LAYOUT
    assert L.WG_STRIDED((256,), 2).to_mgpu() == mgpu.WGStridedFragLayout((256,), 2)
    assert L.WG_SPLAT((64,)).to_mgpu() == mgpu.WGSplatFragLayout((64,))
    assert L.WGMMA.reduce(1) == L.WGMMA.reduce((1,))  # hashable, equal: a primitive param
    with pytest.raises(pl.PallasError, match="takes no arguments"):
        L.WGMMA(1).to_mgpu()
    with pytest.raises(pl.UnsupportedError, match="only tiled layouts"):
        L.WG_SPLAT((64,)).reduce(0).to_mgpu()


@pytest.mark.parametrize("member", ["TCGEN05", "TCGEN05_TRANSPOSED", "TMA_INDICES",
                                    "SMEM_GMEM_COPY"])
def test_other_layouts_are_refused_by_name(member: str) -> None:
    def kernel(x_ref, o_ref):
        o_ref[...] = plgpu.layout_cast(x_ref[...], getattr(L, member))

    f = plgpu.kernel(kernel, out_type=S((128, 128), F32), backend="mosaic_gpu")
    with pytest.raises(pl.UnsupportedError, match=rf"plgpu\.Layout\.{member}\b"):
        jax.jit(f).trace(S((128, 128), F32)).lower(lowering_platforms=("cuda",))


def test_layout_cast_refuses_a_conversion_the_library_lacks() -> None:
    def kernel(x_ref, o_ref):
        o_ref[...] = plgpu.layout_cast(x_ref[...], L.WGMMA.reduce(1)) * 2.0

    f = plgpu.kernel(kernel, out_type=S((256,), F32), backend="mosaic_gpu")
    with pytest.raises(pl.UnsupportedError, match=r"layout_cast into plgpu\.Layout\.WGMMA"):
        jax.jit(f).trace(S((256,), F32)).lower(lowering_platforms=("cuda",))
    with pytest.raises(pl.PallasError, match=r"expected a plgpu\.Layout"):
        plgpu.layout_cast(jnp.zeros(3), "WGMMA")


def registers(n: int, action: str, backend: str = "mosaic_gpu"):
    @functools.partial(plgpu.kernel, out_type=S((256,), F32), backend=backend,
                       num_threads=2, thread_name="wg")
    def kernel(x_ref, o_ref):
        plgpu.set_max_registers(n, action=action)
        w = lax.axis_index("wg")
        window = pl.ds(w * 128, 128)
        o_ref[window] = x_ref[window] * 3.0

    return kernel


@pytest.mark.parametrize("action", ["increase", "decrease"])
def test_set_max_registers(action: str) -> None:
    n = 232 if action == "increase" else 40
    text = module_text(registers(n, action), S((256,), F32))
    assert re.search(rf"setmaxregister\s*{action}\s*{n}|setmaxnreg.*{n}", text), text[-2000:]
    x = rand(1, (256,))
    np.testing.assert_allclose(registers(n, action, "interpret")(x), x * 3.0)


@pytest.mark.parametrize("n,action,match", [(20, "increase", "multiple of 8"),
                                            (236, "increase", "multiple of 8"),
                                            (64, "up", "'increase' or 'decrease'")])
def test_set_max_registers_checks_its_arguments(n: int, action: str, match: str) -> None:
    with pytest.raises(pl.PallasError, match=match):
        plgpu.set_max_registers(n, action=action)


def two_stores(x: jax.Array, grouped: bool, backend: str = "mosaic_gpu") -> jax.Array:
    """Both halves of x + 1 stored by TMA: one bulk group for both copies (``grouped``:
    commit_group=False, then commit_smem_to_gmem_group) or one group each."""
    half = x.shape[0] // 2

    @functools.partial(plgpu.kernel, out_type=S(x.shape, F32), backend=backend,
                       scratch_types=[plgpu.SMEM(x.shape, F32)])
    def kernel(x_ref, o_ref, smem):
        smem[...] = x_ref[...] + 1.0
        plgpu.commit_smem()
        for i in range(2):
            plgpu.copy_smem_to_gmem(smem.at[pl.ds(i * half, half)],
                                    o_ref.at[pl.ds(i * half, half)], commit_group=not grouped)
        if grouped:
            plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    return kernel(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("grouped", [True, False])
def test_commit_smem_to_gmem_group(grouped: bool) -> None:
    text = module_text(functools.partial(two_stores, grouped=grouped), S((256,), F32))
    assert text.count("cp.async.bulk.tensor.global.shared.cta") == 2
    assert text.count("cp.async.bulk.commit.group") == (1 if grouped else 2)
    x = rand(2, (256,))
    np.testing.assert_allclose(two_stores(x, grouped, backend="interpret"), x + 1.0)


def acc_init(c: jax.Array, a: jax.Array, b: jax.Array, backend: str = "mosaic_gpu"
             ) -> jax.Array:
    """c + a @ b, the accumulator started at c with plgpu.ACC.init and pl.run_state, its
    result read back after lax.optimization_barrier."""
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    @functools.partial(plgpu.kernel, out_type=S(c.shape, F32), backend=backend,
                       scratch_types=[plgpu.SMEM(a.shape, F16, transforms=tiled),
                                      plgpu.SMEM(b.shape, F16, transforms=tiled),
                                      plgpu.Barrier(num_barriers=2)])
    def kernel(c_ref, a_ref, b_ref, o_ref, a_smem, b_smem, bars):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(b_ref, b_smem, bars.at[1])
        start = plgpu.layout_cast(c_ref[...], L.WGMMA)
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])
        scale = c_ref[0, 0]  # a value the body closes over

        def body(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, b_smem)

            @pl.when(scale > 1e30)
            def _never():
                plgpu.wgmma_wait(0)

        out = pl.run_state(body)(plgpu.ACC.init(start))
        (out,) = lax.optimization_barrier((out,))
        o_ref[...] = out

    return kernel(c, a, b)  # type: ignore[no-any-return]


def test_acc_init_with_run_state() -> None:
    c, a, b = rand(3, (64, 128)), rand(4, (64, 64), F16), rand(5, (64, 128), F16)
    text = module_text(acc_init, c, a, b)
    assert "wgmma.mma_async" in text and "wgmma.wait.group" in text
    expected = c + jnp.dot(a.astype(F32), b.astype(F32))
    np.testing.assert_allclose(acc_init(c, a, b, backend="interpret"), expected,
                               rtol=1e-5, atol=1e-4)


def test_acc_init_checks_its_shape() -> None:
    with pytest.raises(pl.PallasError, match=r"plgpu\.ACC\(\(60, 128\)\)"):
        plgpu.ACC.init(jnp.zeros((60, 128)))
