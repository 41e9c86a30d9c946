"""Misuse of the SparseCore backend gets a PallasError that says what was expected and the fix:
on the backend (lowering for ``tpu``) and, where the chip decides, in the interpreter too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

plsc = pytest.importorskip("pallas_sparsecore")
import pallas_mosaic_tpu as pltpu  # noqa: E402
from pallas_mosaic_tpu import inspection  # noqa: E402


def lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))


def gather_kernel(lanes, mesh, interpret=False):
    """Gathers ``lanes`` elements of a VMEM copy of x with plsc.load_gather."""
    def fn(x, idx):
        @pl.kernel(out_type=jax.ShapeDtypeStruct((lanes,), x.dtype), mesh=mesh,
                   interpret=interpret,
                   scratch_types=[pltpu.VMEM(x.shape, x.dtype), pltpu.VMEM((lanes,), jnp.int32),
                                  pltpu.VMEM((lanes,), x.dtype)])
        def k(x_hbm, i_hbm, o_hbm, x_vmem, i_vmem, o_vmem):
            pltpu.sync_copy(x_hbm, x_vmem)
            pltpu.sync_copy(i_hbm, i_vmem)
            o_vmem[...] = plsc.load_gather(x_vmem, [i_vmem[...]])
            pltpu.sync_copy(o_vmem, o_hbm)
        return k(x, idx)
    return fn


def test_gather_runs_when_the_index_vector_fills_a_register() -> None:
    mesh = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                  num_subcores=1, target="v7x")
    x = jax.random.normal(jax.random.key(0), (64,), jnp.float32)
    idx = jax.random.randint(jax.random.key(1), (16,), 0, 64, jnp.int32)
    out = gather_kernel(16, mesh, interpret=True)(x, idx)
    np.testing.assert_array_equal(out, x[idx])
    (_, module), = inspection.kernels(lower(gather_kernel(16, mesh), x, idx).as_text())
    assert "tpu.vector_load_idx" in str(module)


@pytest.mark.parametrize("interpret", [False, True])
def test_index_vector_of_the_wrong_length(interpret) -> None:
    mesh = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                  num_subcores=1, target="v5p")  # 8 lanes
    x = jnp.arange(64, dtype=jnp.float32)
    idx = jnp.arange(16, dtype=jnp.int32)
    fn = gather_kernel(16, mesh, interpret=interpret)
    with pytest.raises(pl.PallasError, match=r"plsc.load_gather got a vector of shape \(16,\).*"
                       r"holds 8 32-bit lanes. Fix: use vectors of exactly 8 elements"):
        lower(fn, x, idx) if not interpret else fn(x, idx)


def test_vector_subcore_primitive_in_a_scalar_subcore_kernel() -> None:
    mesh = plsc.ScalarSubcoreMesh(axis_name="c", num_cores=1, target="v7x")

    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct((16,), jnp.int32), mesh=mesh,
                   scratch_types=[pltpu.SMEM((16,), jnp.int32)])
        def k(x_hbm, o_hbm, s):
            pltpu.sync_copy(x_hbm, s)
            plsc.cumsum(jnp.zeros((16,), jnp.int32))
            pltpu.sync_copy(s, o_hbm)
        return k(x)

    with pytest.raises(pl.PallasError, match=r"plsc.cumsum runs on vector subcores.*"
                       r"Fix: run it on a plsc.VectorSubcoreMesh"):
        lower(fn, jnp.arange(16, dtype=jnp.int32))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_cores=3), r"num_cores=3\) is larger than the chip: v7x has 2 cores"),
    (dict(num_subcores=32), r"num_subcores=32\) is larger than the chip: v7x has 16 subcores"),
])
def test_mesh_larger_than_the_chip(kwargs, match) -> None:
    with pytest.raises(pl.PallasError, match=match + r".*Fix: use"):
        plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", target="v7x",
                               **kwargs)


def test_scalar_mesh_larger_than_the_chip() -> None:
    with pytest.raises(pl.PallasError, match=r"num_cores=2\) is larger than the chip: TPU8i"):
        plsc.ScalarSubcoreMesh(axis_name="c", num_cores=2, target="TPU8i")


@pytest.mark.parametrize("target,match", [("v4", "has no SparseCores"),
                                          ("v9", "unknown SparseCore target")])
def test_unknown_or_sparsecore_less_chip(target, match) -> None:
    with pytest.raises(pl.PallasError, match=match):
        plsc.get_sparse_core_info(target)


def one_subcore_kernel(body):
    """``body(x_hbm, o_hbm, v)`` on one v7x subcore, 16 float32 in and out, a VMEM buffer."""
    mesh = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                  num_subcores=1, target="v7x")

    def fn(x):
        return pl.kernel(body, out_type=jax.ShapeDtypeStruct((16,), jnp.float32), mesh=mesh,
                         scratch_types=[pltpu.VMEM((16,), jnp.float32)])(x)
    return fn


def test_reading_hbm_directly_is_refused() -> None:
    def body(x_hbm, o_hbm, v):
        v[...] = x_hbm[...]
        pltpu.sync_copy(v, o_hbm)

    with pytest.raises(pl.UnsupportedError, match=r"reading or writing HBM directly.*sync_copy"):
        lower(one_subcore_kernel(body), jnp.ones((16,)))


def test_adding_copy_needs_an_index_vector() -> None:
    def body(x_hbm, o_hbm, v):
        pltpu.sync_copy(x_hbm, v)
        pltpu.sync_copy(v, o_hbm, add=True)

    with pytest.raises(pl.UnsupportedError, match=r"adding copy \(add=True\) without an index"):
        lower(one_subcore_kernel(body), jnp.ones((16,)))


def test_adding_copy_into_hbm_follows_the_installed_jax() -> None:
    """A scatter-adding copy out of VMEM into HBM: JAX 0.12's SparseCore lowering refuses it
    (it adds out of VMEM only into VMEM_SHARED), and so does this backend there; where the
    installed JAX lowers it (0.10), this backend lowers it to an adding indirect DMA."""
    from pallas_core import backend as plb

    mesh = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                  num_subcores=1, target="v7x")

    def fn(x, idx):
        @pl.kernel(out_type=jax.ShapeDtypeStruct((16,), jnp.float32), mesh=mesh,
                   scratch_types=[pltpu.VMEM((16,), jnp.float32), pltpu.VMEM((16,), jnp.int32)])
        def k(x_hbm, i_hbm, o_hbm, v, i_vmem):
            pltpu.sync_copy(x_hbm, v)
            pltpu.sync_copy(i_hbm, i_vmem)
            pltpu.sync_copy(v, o_hbm.at[i_vmem], add=True)
        return k(x, idx)

    args = (jnp.ones((16,)), jnp.arange(16, dtype=jnp.int32))
    if plb.sparsecore_adds_only_into_shared_vmem():
        with pytest.raises(pl.UnsupportedError,
                           match=r"adding copy \(add=True\) from VMEM into HBM.*VMEM_SHARED"):
            lower(fn, *args)
    else:
        ((_, module),) = inspection.kernels(lower(fn, *args).as_text())
        assert "tpu.enqueue_indirect_dma" in str(module) and "add = true" in str(module)
