"""Strided and dynamically sized Ref access in Mosaic TPU kernels: ``ref[pl.ds(a, n,
stride=k)]`` read (``tpu.strided_load``) and written (``tpu.strided_store``), and copies of
``pl.ds(a, n)`` with ``n`` read when the kernel runs (``tpu.memref_slice`` of dynamic size),
as JAX lowers them, agreeing with JAX's module; the emulated module and the interpreter match
``jax.numpy`` on random data."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402


def _lower(f: Callable[..., Any], *args: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found


def _strided(m: Any, x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[m.ds(1, 8, stride=2), :] = x_ref[m.ds(0, 8, stride=2), :] * 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16])
def test_strided_reads_and_writes(dtype: Any) -> None:
    x = (jax.random.normal(jax.random.key(3), (16, 128)) * 50).astype(dtype)
    out = jax.ShapeDtypeStruct((16, 128), dtype)
    want = np.zeros((16, 128), dtype)
    want[1::2] = np.asarray(x[0::2] * 2)
    ours_call = pl.pallas_call(functools.partial(_strided, pl), out)
    np.testing.assert_array_equal(pl.emulate(ours_call, backend="mosaic_tpu")(x), want)
    np.testing.assert_array_equal(
        pl.pallas_call(functools.partial(_strided, pl), out, backend="interpret")(x), want)
    with plb.assume_device("TPU v5 lite", "tpu"):
        _, ours = _lower(ours_call, x)
        _, theirs = _lower(jax_pl.pallas_call(functools.partial(_strided, jax_pl), out), x)
    inspection.assert_same_kernel(ours, theirs)

    def ops(module: Any) -> list[str]:
        return sorted(ln.split("{")[1].split("}")[0] for ln in str(module).splitlines()
                      if "tpu.strided_" in ln)
    assert ops(ours) == ops(theirs) and len(ops(ours)) == 3  # two reads, one write


def test_a_masked_strided_store_is_refused_by_name() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.store(o_ref, (pl.ds(0, 8, stride=2), slice(None)), x_ref[...],
                 mask=x_ref[...] > 0)

    x = jnp.ones((8, 128), jnp.float32)
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32))
    with pytest.raises(pl.UnsupportedError, match="a strided store with a mask"):
        _lower(f, x)


def _ragged(m: Any, tpu: Any, dtype: Any, **kw: Any) -> Any:
    """``n`` rows (read from SMEM) copied from HBM row 8 on into a zeroed VMEM buffer, as
    ragged attention copies its pages: views of dynamic size."""
    def kernel(n_ref: Any, x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
        n = n_ref[0]
        buf[...] = jnp.zeros_like(buf)
        tpu.async_copy(x_hbm.at[m.ds(8, n)], buf.at[m.ds(0, n)], sem).wait()
        o_ref[...] = buf[...]

    return m.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), dtype),
                         in_specs=[m.BlockSpec(memory_space=tpu.SMEM),
                                   m.BlockSpec(memory_space=m.ANY)],
                         scratch_shapes=[tpu.VMEM((32, 128), dtype), tpu.SemaphoreType.DMA],
                         **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16])
def test_copies_of_dynamic_size(dtype: Any) -> None:
    from jax.experimental.pallas import tpu as jax_pltpu

    x = (jax.random.normal(jax.random.key(5), (64, 128)) * 50).astype(dtype)
    emulated = pl.emulate(_ragged(pl, pltpu, dtype), backend="mosaic_tpu")
    for n in (0, 5, 24, 32):
        want = np.zeros((32, 128), dtype)
        want[:n] = np.asarray(x)[8:8 + n]
        count = jnp.array([n], jnp.int32)
        np.testing.assert_array_equal(emulated(count, x), want)
        np.testing.assert_array_equal(_ragged(pl, pltpu, dtype, backend="interpret")(count, x),
                                      want)
    count = jnp.array([5], jnp.int32)
    with plb.assume_device("TPU v5 lite", "tpu"):
        _, ours = _lower(_ragged(pl, pltpu, dtype), count, x)
        _, theirs = _lower(_ragged(jax_pl, jax_pltpu, dtype), count, x)
    inspection.assert_same_kernel(ours, theirs)

    def slices(module: Any) -> list[str]:  # the memref types of each dynamic slice
        return [ln.split(":", 1)[1].strip() for ln in str(module).splitlines()
                if "tpu.memref_slice" in ln]
    assert sorted(slices(ours)) == sorted(slices(theirs))
    assert all("?x128" in t for t in slices(ours))
