"""``plsc.slice_subcore_vmem_from_shared``, ``plsc.SparseCorePushStreamWarning`` and
``plsc.Indices`` (names of ``jax.experimental.pallas.tpu_sc`` in JAX 0.11/0.12): a subcore's
part of shared VMEM in the interpreter against numpy, and lowered; the warning where JAX warns
(a push stream given a semaphore); Indices against JAX's class where the installed JAX has it."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plsc = pytest.importorskip("pallas_sparsecore")
import pallas_mosaic_tpu as pltpu  # noqa: E402
from jax.experimental.pallas import tpu_sc as jax_sc  # noqa: E402

L = 16
PARTS = 16  # v7x's SparseCores have 16 subcores


def _mesh(subcores: int) -> object:
    return plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                  num_subcores=subcores, target="v7x")


def _rotate_through_parts(subcores: int, interpret: bool = True):  # type: ignore[no-untyped-def]
    """Subcore s DMAs row s of x into its part of shared VMEM; after a barrier it copies the
    part of subcore (s + 1) % subcores out as row s."""
    def fn(x):  # type: ignore[no-untyped-def]
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=_mesh(subcores),
                   interpret=interpret,
                   scratch_types=[plsc.VMEM_SHARED((PARTS * L,), x.dtype)])
        def k(x_hbm, o_hbm, shared):  # type: ignore[no-untyped-def]
            s = lax.axis_index("s")
            part = plsc.slice_subcore_vmem_from_shared(shared)
            assert part.shape == (L,)
            pltpu.sync_copy(x_hbm.at[s], part)
            plsc.subcore_barrier()
            pltpu.sync_copy(shared.at[pl.ds(((s + 1) % subcores) * L, L)], o_hbm.at[s])
        return k(x)
    return fn


@pytest.mark.parametrize("subcores", [2, 4, 16])
def test_each_subcore_gets_its_part(subcores: int) -> None:
    x = jax.random.normal(jax.random.key(subcores), (subcores, L), jnp.float32)
    got = _rotate_through_parts(subcores)(x)
    np.testing.assert_allclose(np.asarray(got), np.roll(np.asarray(x), -1, axis=0), rtol=1e-6)


def test_the_parts_lower() -> None:
    x = jnp.zeros((4, L), jnp.float32)
    text = jax.jit(_rotate_through_parts(4, interpret=False)).trace(x).lower(
        lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_slicing_needs_a_shared_ref_in_a_subcore_kernel() -> None:
    x = jnp.zeros((2, L), jnp.float32)

    @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=_mesh(2), interpret=True,
               scratch_types=[pltpu.VMEM((PARTS * L,), jnp.float32),
                              plsc.VMEM_SHARED((PARTS * L + 1,), jnp.float32)])
    def not_shared(x_hbm, o_hbm, vmem, odd):  # type: ignore[no-untyped-def]
        plsc.slice_subcore_vmem_from_shared(vmem)

    with pytest.raises(pl.PallasError, match="VMEM_SHARED"):
        not_shared(x)

    @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=_mesh(2), interpret=True,
               scratch_types=[plsc.VMEM_SHARED((PARTS * L + 1,), jnp.float32)])
    def indivisible(x_hbm, o_hbm, odd):  # type: ignore[no-untyped-def]
        plsc.slice_subcore_vmem_from_shared(odd)

    with pytest.raises(pl.PallasError, match="divisible"):
        indivisible(x)


def _copy_out(interpret: bool = False):  # type: ignore[no-untyped-def]
    def fn(x):  # type: ignore[no-untyped-def]
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=_mesh(2),
                   interpret=interpret, scratch_types=[pltpu.VMEM((L,), x.dtype)])
        def k(x_hbm, o_hbm, mine):  # type: ignore[no-untyped-def]
            s = lax.axis_index("s")
            pltpu.sync_copy(x_hbm.at[s], mine)  # HBM -> VMEM: not a push stream
            mine[...] = mine[...] + 1.0
            pltpu.sync_copy(mine, o_hbm.at[s])  # VMEM -> HBM: a push stream
        return k(x)
    return fn


def test_a_push_stream_given_a_semaphore_warns_when_lowered() -> None:
    x = jnp.zeros((2, L), jnp.float32)
    with pytest.warns(plsc.SparseCorePushStreamWarning) as caught:
        jax.jit(_copy_out()).trace(x).lower(lowering_platforms=("tpu",))
    assert len([w for w in caught if w.category is plsc.SparseCorePushStreamWarning]) == 1
    assert issubclass(plsc.SparseCorePushStreamWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", plsc.SparseCorePushStreamWarning)
        got = _copy_out(interpret=True)(x + 2.0)  # the interpreter does not lower: no warning
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) + 3.0)


def test_indices_is_jaxs_data_class() -> None:
    idx = plsc.Indices(jnp.arange(8), ignored_value=-1)
    leaves, tree = jax.tree_util.tree_flatten(idx)
    assert len(leaves) == 1 and leaves[0] is idx.values  # ignored_value is static
    assert jax.tree_util.tree_unflatten(tree, [jnp.zeros(8)]).ignored_value == -1
    with pytest.raises(dataclasses.FrozenInstanceError):
        idx.values = None  # type: ignore[misc]
    if hasattr(jax_sc, "Indices"):
        ours = [(f.name, f.default) for f in dataclasses.fields(plsc.Indices)]
        theirs = [(f.name, f.default) for f in dataclasses.fields(jax_sc.Indices)]
        assert ours == theirs


def _skipping_copies(ignored: int | None, interpret: bool = True):  # type: ignore[no-untyped-def]
    """Gathers rows idx of table into a buffer holding `init` (rows of skipped indices keep
    it), then scatters the buffer + 1 to rows idx of a copy of table (skipped ones not
    written)."""
    def fn(table, idx, init):  # type: ignore[no-untyped-def]
        out = jax.ShapeDtypeStruct(table.shape, table.dtype), jax.ShapeDtypeStruct(
            init.shape, init.dtype)

        @pl.kernel(out_type=out, mesh=_mesh(1), interpret=interpret,
                   scratch_types=[pltpu.VMEM(idx.shape, jnp.int32),
                                  pltpu.VMEM(init.shape, init.dtype)])
        def k(t_hbm, i_hbm, init_hbm, o_hbm, g_hbm, iv, buf):  # type: ignore[no-untyped-def]
            pltpu.sync_copy(i_hbm, iv)
            pltpu.sync_copy(init_hbm, buf)
            pltpu.sync_copy(t_hbm.at[plsc.Indices(iv, ignored_value=ignored)], buf)
            pltpu.sync_copy(buf, g_hbm)
            buf[...] = buf[...] + 1.0
            pltpu.sync_copy(t_hbm, o_hbm)
            pltpu.sync_copy(buf, o_hbm.at[plsc.Indices(iv, ignored_value=ignored)])
        return k(table, idx, init)
    return fn


@pytest.mark.parametrize("how", ["interpret", "emulate"])
@pytest.mark.parametrize("ignored", [None, -1, 5])
def test_indices_skip_their_ignored_value(ignored: int | None, how: str) -> None:
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((32, L)), jnp.float32)
    idx = rng.permutation(32)[:L].astype(np.int32)
    if ignored is not None:
        idx[[1, 4, 9]] = ignored
    init = jnp.asarray(rng.standard_normal((L, L)), jnp.float32)
    fn = (_skipping_copies(ignored) if how == "interpret" else
          pl.emulate(_skipping_copies(ignored, interpret=False), backend="sparsecore"))
    scattered, gathered = fn(table, jnp.asarray(idx), init)
    skip = idx == ignored if ignored is not None else np.zeros(L, bool)
    want_g = np.where(skip[:, None], np.asarray(init), np.asarray(table)[idx])
    np.testing.assert_allclose(np.asarray(gathered), want_g, rtol=1e-6)
    want_s = np.asarray(table).copy()
    want_s[idx[~skip]] = want_g[~skip] + 1.0
    np.testing.assert_allclose(np.asarray(scattered), want_s, rtol=1e-6)


@pytest.mark.parametrize("ignored", [None, -1])
def test_indices_lower_with_the_offset_filter(ignored: int | None) -> None:
    from pallas_mosaic_tpu import inspection
    args = (jnp.zeros((32, L)), jnp.zeros((L,), jnp.int32), jnp.zeros((L, L)))
    text = jax.jit(_skipping_copies(ignored, interpret=False)).trace(*args).lower(
        lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    ops = [line for line in str(module).splitlines() if "tpu.enqueue_indirect_dma" in line]
    assert len(ops) == 2
    for op in ops:  # JAX passes the ignored value as the DMA's offset filter
        assert ("offset_filter(%c-1_i32" in op) == (ignored == -1), op


def _fetch_adds(other: bool = False, interpret: bool = True):  # type: ignore[no-untyped-def]
    """Subcore s starts its SMEM counter at 10 * s, adds s + 1 twice with fetch_and_add (to
    its own counter, or with ``other`` to the next subcore's) and writes what each add
    returned and the final count."""
    def fn(x):  # type: ignore[no-untyped-def]
        @pl.kernel(out_type=jax.ShapeDtypeStruct((4, L), jnp.int32), mesh=_mesh(4),
                   interpret=interpret,
                   scratch_types=[pltpu.SMEM((1,), jnp.int32), pltpu.VMEM((L,), jnp.int32)])
        def k(x_hbm, o_hbm, counter, row):  # type: ignore[no-untyped-def]
            s = lax.axis_index("s")
            counter[0] = s * 10
            plsc.subcore_barrier()
            target = (s + 1) % 4 if other else s
            first = plsc.fetch_and_add(counter, s + 1, subcore_id=target)
            second = plsc.fetch_and_add(counter.at[0], s + 1, subcore_id=target)
            lanes = lax.broadcasted_iota(jnp.int32, (L,), 0)
            row[...] = jnp.where(lanes == 0, first, jnp.where(lanes == 1, second, counter[0]))
            pltpu.sync_copy(row, o_hbm.at[s])
        return k(x)
    return fn


def test_fetch_and_add_on_the_own_subcore_matches_numpy() -> None:
    got = np.asarray(_fetch_adds()(jnp.zeros((4,), jnp.int32)))
    s = np.arange(4)
    np.testing.assert_array_equal(got[:, 0], 10 * s)
    np.testing.assert_array_equal(got[:, 1], 10 * s + s + 1)
    np.testing.assert_array_equal(got[:, 2], 10 * s + 2 * (s + 1))


def test_fetch_and_add_to_another_subcore_is_refused_by_the_interpreter() -> None:
    with pytest.raises(pl.PallasError, match="from subcore 0 to subcore 1"):
        jax.block_until_ready(_fetch_adds(other=True)(jnp.zeros((4,), jnp.int32)))


def test_fetch_and_add_lowers_as_jax() -> None:
    from pallas_mosaic_tpu import inspection
    text = jax.jit(_fetch_adds(other=True, interpret=False)).trace(
        jnp.zeros((4,), jnp.int32)).lower(lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    assert str(module).count("tpu.fetch_and_add_sync") == 2
    with pytest.raises(pl.PallasError, match="fetch_and_add"):
        jax.jit(lambda x: plsc.fetch_and_add(x, 1, subcore_id=0)).trace(jnp.zeros(2))
