"""The Blackwell (sm_100a) path without a GPU: kernels using TMEM and tcgen05 lower for
``cuda`` into modules built for sm_100a that parse back and verify, hold the tcgen05
operations they ask for, and match ``jax.numpy`` in the interpreter on random inputs; the target
is chosen as ``pallas_mosaic_gpu.targets`` says; what is not supported is refused by name."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import blackwell_kernels as BK  # noqa: E402, N812
from pallas_mosaic_gpu import hopper_kernels as K  # noqa: E402, N812
from pallas_mosaic_gpu import inspection, targets  # noqa: E402

S = jax.ShapeDtypeStruct
F16, F32 = jnp.float16, jnp.float32


def _module(fn: Any, *args: Any) -> tuple[dict[str, Any], str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # hash checked, parsed back and verified
    return inspection.launch(found[1]), str(found[1])


def _rand(seed: int, shape: tuple[int, ...], dtype: Any = F16) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _ops(module: str) -> set[str]:
    return set(re.findall(r"tcgen05\.\w+", module))


@pytest.mark.parametrize("shape, steps", [((256, 512, 256), 2), ((128, 64, 384), 1),
                                          ((256, 256, 128), 3)])
def test_matmul_lowers_for_sm100a_and_matches(shape: tuple[int, int, int], steps: int) -> None:
    m, k, n = shape
    a, b = _rand(m + k, (m, k)), _rand(n, (k, n))
    fn = functools.partial(BK.matmul, max_concurrent_steps=steps)
    launch, module = _module(functools.partial(fn, backend="mosaic_gpu"),
                             S(a.shape, F16), S(b.shape, F16))
    assert launch["arch"] == (10, 0) and launch["block"] == (128, 1, 1)
    assert launch["grid"] == ((m // 128) * (n // 128), 1, 1)
    assert {"tcgen05.alloc", "tcgen05.mma", "tcgen05.commit", "tcgen05.ld",
            "tcgen05.dealloc"} <= _ops(module)
    got = fn(a, b, backend="interpret")
    want = jnp.dot(a.astype(F32), b.astype(F32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                               atol=6e-2)


def _tmem_kernel(body: Any, out: S, scratch: list[Any]) -> Any:
    return functools.partial(plgpu.kernel, out_shape=out, scratch_shapes=scratch)(body)


def _tmem_round_trip(x: jax.Array, backend: str) -> jax.Array:
    """x -> SMEM -> TMEM (async_store_tmem, commit_tmem) -> a column slice back -> doubled."""
    def body(x_ref: Any, o_ref: Any, tmem: Any, smem: Any) -> None:
        smem[...] = x_ref[...]
        plgpu.async_store_tmem(tmem, smem[...])
        plgpu.commit_tmem()
        half = plgpu.async_load_tmem(tmem.at[:, pl.ds(64, 64)])
        plgpu.wait_load_tmem()
        o_ref[...] = half * 2.0

    return plgpu.kernel(body, out_shape=S((128, 64), F32),
                        scratch_shapes=[plgpu.TMEM((128, 128), F32), plgpu.SMEM((128, 128), F32)],
                        backend=backend)(x)


def test_tmem_store_and_sliced_load() -> None:
    x = _rand(3, (128, 128), F32)
    np.testing.assert_allclose(_tmem_round_trip(x, "interpret"), x[:, 64:] * 2, rtol=1e-6)
    launch, module = _module(functools.partial(_tmem_round_trip, backend="mosaic_gpu"),
                             S(x.shape, F32))
    assert launch["arch"] == (10, 0) and {"tcgen05.st", "tcgen05.ld"} <= _ops(module)


def _scoped_tmem(x: jax.Array, backend: str) -> jax.Array:
    """TMEM allocated by pl.run_scoped, written and read back in the TCGEN05 layout (as JAX's
    blackwell_ragged_dot does) into a plain SMEM buffer of float16."""
    def body(x_ref: Any, o_ref: Any) -> None:
        def scoped(acc: Any, staged: Any, out: Any) -> None:
            staged[...] = x_ref[...]
            plgpu.async_store_tmem(acc, staged[...])
            plgpu.commit_tmem()
            out[...] = plgpu.async_load_tmem(acc, layout=plgpu.Layout.TCGEN05).astype(F16)
            plgpu.wait_load_tmem()
            o_ref[...] = out[...].astype(F32) * 3

        pl.run_scoped(scoped, plgpu.TMEM((128, 64), F32), plgpu.SMEM((128, 64), F32),
                      plgpu.SMEM((128, 64), F16))

    return plgpu.kernel(body, out_shape=S((128, 64), F32), backend=backend)(x)


def test_run_scoped_tmem_read_in_the_tcgen05_layout() -> None:
    x = _rand(5, (128, 64), F32)
    expected = x.astype(F16).astype(F32) * 3
    np.testing.assert_array_equal(_scoped_tmem(x, "interpret"), expected)
    launch, module = _module(functools.partial(_scoped_tmem, backend="mosaic_gpu"),
                             S(x.shape, F32))
    assert launch["arch"] == (10, 0) and {"tcgen05.st", "tcgen05.ld"} <= _ops(module)
    with pytest.raises(pl.UnsupportedError, match=r"Layout\.TCGEN05"):
        _refusal(lambda acc, s, bar: plgpu.async_load_tmem(acc, layout=plgpu.Layout.WGMMA))


def _one_mma(a: jax.Array, b: jax.Array, *, accumulate: Any, backend: str,
             commit: bool = False) -> jax.Array:
    """One tcgen05_mma of whole SMEM operands into TMEM holding ones, read back."""
    def body(a_ref: Any, b_ref: Any, o_ref: Any, a_smem: Any, b_smem: Any, acc: Any,
             bar: Any) -> None:
        a_smem[...] = a_ref[...]
        b_smem[...] = b_ref[...]
        plgpu.async_store_tmem(acc, jnp.ones((128, 128), F32))
        plgpu.commit_tmem()
        flag = accumulate if isinstance(accumulate, bool) else lax.axis_index("x") == 0
        if commit:
            plgpu.tcgen05_mma(acc, a_smem, b_smem, accumulate=flag)
            plgpu.tcgen05_commit_arrive(bar.at[0])
        else:
            plgpu.tcgen05_mma(acc, a_smem, b_smem, bar.at[0], accumulate=flag)
        plgpu.barrier_wait(bar.at[0])
        o_ref[...] = plgpu.async_load_tmem(acc)
        plgpu.wait_load_tmem()

    return plgpu.kernel(body, out_shape=S((128, 128), F32), grid=(1,), grid_names=("x",),
                        backend=backend,
                        scratch_shapes=[plgpu.SMEM((128, 64), F16), plgpu.SMEM((64, 128), F16),
                                        plgpu.TMEM((128, 128), F32),
                                        plgpu.Barrier(orders_tensor_core=True)])(a, b)


@pytest.mark.parametrize("accumulate, commit", [(True, False), (False, False), ("traced", True)])
def test_mma_accumulate_and_barriers(accumulate: Any, commit: bool) -> None:
    a, b = _rand(4, (128, 64)), _rand(5, (64, 128))
    fn = functools.partial(_one_mma, accumulate=accumulate, commit=commit)
    prod = jnp.dot(a.astype(F32), b.astype(F32))
    want = prod + 1.0 if accumulate is not False else prod  # traced: true at block 0
    np.testing.assert_allclose(fn(a, b, backend="interpret"), want, rtol=1e-5, atol=1e-4)
    launch, module = _module(functools.partial(fn, backend="mosaic_gpu"), S(a.shape, F16),
                             S(b.shape, F16))
    assert launch["arch"] == (10, 0)
    # One tcgen05.mma per 16 of K (the instruction's K for 16-bit inputs), one commit.
    assert module.count("tcgen05.mma") == 64 // 16 and module.count("tcgen05.commit") == 1
    assert "tcgen05.fence" in module  # the barrier orders the tensor core


def test_targets() -> None:
    """The target: given to pl.stages, else the device's, else sm_100a for TMEM/tcgen05
    kernels and the library's default (sm_90a) for the others."""
    a, b = _rand(6, (128, 64)), _rand(7, (64, 128))
    mma = functools.partial(_one_mma, accumulate=True, backend="mosaic_gpu")
    (st,) = pl.stages(mma, a, b, backend="mosaic_gpu", target="sm_100a")
    assert "mosaic_gpu.arch_major = 10 : i32" in st["mosaic_gpu"]
    (st,) = pl.stages(mma, a, b, backend="mosaic_gpu", target="sm_90a")
    with pytest.raises(pl.UnsupportedError, match=r"sm_90a.*the target given to pl\.stages"):
        st["mosaic_gpu"]
    x = _rand(8, (256, 128), F32)
    for target, major in ((None, 9), ("sm_90a", 9), ("sm_100a", 10)):
        (st,) = pl.stages(K.softmax, x, backend="mosaic_gpu", target=target)
        assert f"mosaic_gpu.arch_major = {major} : i32" in st["mosaic_gpu"]
    assert targets.device_arch() is None  # this machine has no GPU
    with pytest.raises(pl.PallasError, match="sm_100a"):
        pl.stages(K.softmax, x, backend="mosaic_gpu", target="sm_120a")


def _refusal(build: Any) -> None:
    def body(x_ref: Any, o_ref: Any, acc: Any, s: Any, bar: Any) -> None:
        build(acc, s, bar)

    plgpu.kernel(body, out_shape=S((128,), F32), backend="interpret",
                 scratch_shapes=[plgpu.TMEM((128, 128), F32), plgpu.SMEM((128, 128), F16),
                                 plgpu.Barrier()])(jnp.zeros((128,), F32))


@pytest.mark.parametrize("build, error, match", [
    (lambda acc, s, bar: plgpu.tcgen05_mma(acc, s, s, bar.at[0]), pl.PallasError,
     "orders_tensor_core=True"),
    (lambda acc, s, bar: plgpu.tcgen05_mma(acc, s, s, collective_axis="x"),
     pl.PallasError, r"expected acc \(M, 2 N\)"),
    (lambda acc, s, bar: plgpu.tcgen05_mma(s, s, s), pl.PallasError, "TMEM Ref"),
    (lambda acc, s, bar: plgpu.async_load_tmem(acc, layout="x"), pl.UnsupportedError,
     "layout"),
    (lambda acc, s, bar: plgpu.tcgen05_commit_arrive(bar.at[0]), pl.PallasError,
     "orders_tensor_core"),
])
def test_refusals_name_the_problem(build: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _refusal(build)


def test_tmem_options_refused() -> None:
    assert plgpu.TMEM((128, 128), F32, packed=True).memory_space.packing == 1
    with pytest.raises(pl.PallasError, match=r"is not a plgpu\.TMEMLayout"):
        plgpu.TMEM((128, 128), F32, layout="x")
    with pytest.raises(pl.PallasError, match="narrower than 32 bits needs packed="):
        plgpu.TMEM((128, 128), F16)
    with pytest.raises(pl.UnsupportedError, match="2-D"):
        plgpu.TMEM((2, 128, 128), F32)
