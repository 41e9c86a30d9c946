"""Example SparseCore kernels (used by the tests and ``examples/sparsecore.py``). Each runs on
the ``sparsecore`` backend for ``target`` (a chip name, no TPU needed to lower), or in the
interpreter with ``interpret=True``.

The work is split over the ``workers = num_cores * num_subcores`` vector subcores of the mesh;
subcore ``w = core * num_subcores + subcore`` takes the ``w``-th contiguous share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pallas_mosaic_tpu as pltpu
from jax import lax

import pallas_core as pl
from pallas_core import backend as plb
from pallas_sparsecore import params as scp
from pallas_sparsecore import primitives as plsc


def _mesh(num_cores: int | None, num_subcores: int | None, target: str | None
          ) -> scp.SubcoreMesh:
    return scp.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore",
                                 num_cores=num_cores, num_subcores=num_subcores, target=target)


def _worker(mesh: scp.SubcoreMesh) -> Any:
    return lax.axis_index("core") * mesh.num_subcores + lax.axis_index("subcore")


def _share(total: int, mesh: scp.SubcoreMesh, what: str) -> int:
    workers = mesh.num_cores * mesh.num_subcores
    if total % workers:
        raise pl.PallasError(f"{what} ({total}) must split evenly over the {workers} subcores of "
                             "the mesh. Fix: pad it, or use a mesh with fewer subcores.")
    return total // workers


def _summed_over_cores(mesh: scp.SubcoreMesh, name: str, interpret: bool,
                       per_core: Callable[..., None], inputs: tuple[jax.Array, ...],
                       shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Runs ``per_core(*input_refs, out)`` on every subcore of ``mesh`` (a ``core_map`` named
    ``name``), where ``out`` is a zeroed HBM array of one ``shape`` total per core, each core
    writing its own (``out.at[core]``); returns the sum of the cores' totals."""

    def run(refs: Any) -> None:
        *in_refs, out = refs

        @plb.core_map(mesh, interpret=interpret, name=name)
        def _() -> None:
            per_core(*in_refs, out)

    *_, result = pl.run_state(run)((*inputs, jnp.zeros((mesh.num_cores, *shape), dtype)))
    return result.sum(axis=0)  # type: ignore[no-any-return]


def embedding_lookup(table: jax.Array, idx: jax.Array, *, num_cores: int | None = None,
                     num_subcores: int | None = None, target: str | None = None,
                     interpret: bool = False) -> jax.Array:
    """``table[idx]``: each subcore copies its share of the indices to VMEM, gathers those rows
    of the HBM table with one indirect DMA, and writes them back to HBM."""
    mesh = _mesh(num_cores, num_subcores, target)
    n = _share(idx.shape[0], mesh, "the number of lookups")
    d = table.shape[1]

    @pl.kernel(out_type=jax.ShapeDtypeStruct((idx.shape[0], d), table.dtype), mesh=mesh,
               scratch_types=[pltpu.VMEM((n,), jnp.int32), pltpu.VMEM((n, d), table.dtype)],
               interpret=interpret)
    def kernel(table_hbm: Any, idx_hbm: Any, out_hbm: Any, idx_vmem: Any, rows_vmem: Any
               ) -> None:
        rows = pl.ds(_worker(mesh) * n, n)
        pltpu.sync_copy(idx_hbm.at[rows], idx_vmem)
        pltpu.sync_copy(table_hbm.at[idx_vmem], rows_vmem)
        pltpu.sync_copy(rows_vmem, out_hbm.at[rows])

    return kernel(table, idx.astype(jnp.int32))  # type: ignore[no-any-return]


def _when_first_subcore(fn: Any) -> None:
    """Run ``fn`` on the first vector subcore of each SparseCore only."""
    pl.when(lax.axis_index("subcore") == 0)(fn)


def _add_share(mesh: scp.SubcoreMesh, n: int, upd_ref: Any, idx_ref: Any, upd_vmem: Any,
               idx_vmem: Any, acc: Any) -> None:
    """Scatter-adds this subcore's share (``n`` rows) of the HBM updates into its SparseCore's
    zeroed ``VMEM_SHARED`` accumulator ``acc``, at their indices, with one adding indirect DMA
    (repeated indices accumulate), between barriers: ``acc`` is zero before anyone adds, and
    every update is in before anyone reads the total."""
    plsc.subcore_barrier()
    share = pl.ds(_worker(mesh) * n, n)
    pltpu.sync_copy(idx_ref.at[share], idx_vmem)
    pltpu.sync_copy(upd_ref.at[share], upd_vmem)
    pltpu.sync_copy(upd_vmem, acc.at[idx_vmem], add=True)
    plsc.subcore_barrier()


def scatter_add(updates: jax.Array, idx: jax.Array, num_rows: int, *,
                num_cores: int | None = None, num_subcores: int | None = None,
                target: str | None = None, interpret: bool = False) -> jax.Array:
    """``zeros((num_rows, d)).at[idx].add(updates)`` (the gradient of an embedding lookup):
    each subcore scatter-adds its share of the rows into its SparseCore's ``VMEM_SHARED``
    accumulator with one adding indirect DMA (repeated indices accumulate); each core writes
    its total to its own slice of the HBM result, and the cores' totals are summed after the
    kernel. (Adding DMAs go to ``VMEM_SHARED``, not HBM: JAX 0.12 lowers only those.)"""
    mesh = _mesh(num_cores, num_subcores, target)
    n = _share(idx.shape[0], mesh, "the number of updates")
    d = updates.shape[1]

    def per_core(upd_ref: Any, idx_ref: Any, out: Any) -> None:
        core = lax.axis_index("core")

        def body(acc: Any, idx_vmem: Any, rows_vmem: Any) -> None:
            _when_first_subcore(lambda: pltpu.sync_copy(out.at[core], acc))  # zeros
            _add_share(mesh, n, upd_ref, idx_ref, rows_vmem, idx_vmem, acc)
            _when_first_subcore(lambda: pltpu.sync_copy(acc, out.at[core]))

        pl.run_scoped(body, scp.VMEM_SHARED((num_rows, d), updates.dtype),
                      pltpu.VMEM((n,), jnp.int32), pltpu.VMEM((n, d), updates.dtype))

    return _summed_over_cores(mesh, "scatter_add", interpret, per_core,
                              (updates, idx.astype(jnp.int32)), (num_rows, d), updates.dtype)


def scatter_add_shared(updates: jax.Array, idx: jax.Array, num_rows: int, *,
                       num_cores: int | None = None, num_subcores: int | None = None,
                       target: str | None = None, interpret: bool = False) -> jax.Array:
    """``zeros((num_rows, d)).at[idx].add(updates)``, accumulated in each SparseCore's shared
    VMEM: the subcores zero their slices of a ``plsc.VMEM_SHARED`` accumulator, meet at a
    barrier, scatter-add their shares of the updates into it with adding indirect DMAs (repeated
    indices accumulate), meet again, and copy their slices of the core's total into the core's
    slice of the HBM result; the cores' totals are summed after the kernel."""
    mesh = _mesh(num_cores, num_subcores, target)
    n = _share(idx.shape[0], mesh, "the number of updates")
    subcores, lanes = mesh.num_subcores, mesh.info.num_lanes
    d = updates.shape[1]
    if num_rows % (subcores * lanes) or d % lanes:
        raise pl.PallasError(
            f"scatter_add_shared: num_rows ({num_rows}) must be a multiple of subcores x lanes "
            f"({subcores} x {lanes}) and the row width ({d}) of the lanes. Fix: pad them.")
    rows = num_rows // subcores  # each subcore's slice of the accumulator

    def per_core(upd_ref: Any, idx_ref: Any, out: Any) -> None:
        core, subcore = lax.axis_index("core"), lax.axis_index("subcore")

        def body(acc: Any, idx_vmem: Any, upd_vmem: Any, tile: Any) -> None:
            mine = pl.ds(subcore * rows, rows)

            @pl.loop(0, rows)
            def _zero(r: Any) -> None:
                @plsc.parallel_loop(0, d, lanes)
                def _(j: Any) -> None:
                    tile[r, pl.ds(j, lanes)] = jnp.zeros((lanes,), tile.dtype)

            pltpu.sync_copy(tile, acc.at[mine])
            _add_share(mesh, n, upd_ref, idx_ref, upd_vmem, idx_vmem, acc)
            pltpu.sync_copy(acc.at[mine], tile)
            pltpu.sync_copy(tile, out.at[core, mine])

        pl.run_scoped(body, scp.VMEM_SHARED((num_rows, d), updates.dtype),
                      pltpu.VMEM((n,), jnp.int32), pltpu.VMEM((n, d), updates.dtype),
                      pltpu.VMEM((rows, d), updates.dtype))

    return _summed_over_cores(mesh, "scatter_add_shared", interpret, per_core,
                              (updates, idx.astype(jnp.int32)), (num_rows, d), updates.dtype)


def segment_sum(values: jax.Array, segment_ids: jax.Array, num_segments: int, *,
                num_cores: int | None = None, num_subcores: int | None = None,
                target: str | None = None, interpret: bool = False) -> jax.Array:
    """``jax.ops.segment_sum(values, segment_ids, num_segments)`` over a ragged batch of
    float32 values: each subcore walks its share one register (``num_lanes`` values) at a
    time, adds every value into its segment's slot of a VMEM accumulator with
    ``plsc.addupdate_scatter`` (lanes of one segment accumulate), then adds the accumulator
    into its SparseCore's ``VMEM_SHARED`` total with an adding DMA; each core writes its total
    to its own slice of the HBM result, and the cores' totals are summed after the kernel."""
    mesh = _mesh(num_cores, num_subcores, target)
    lanes = mesh.info.num_lanes
    n = _share(values.shape[0], mesh, "the number of values")
    if n % lanes or num_segments % lanes:
        raise pl.PallasError(
            f"segment_sum: each subcore's share ({n}) and num_segments ({num_segments}) must be "
            f"multiples of the {lanes} lanes. Fix: pad the batch and the segment count.")

    def per_core(val_ref: Any, seg_ref: Any, slots_ref: Any, out: Any) -> None:
        core = lax.axis_index("core")

        def body(total: Any, vals: Any, segs: Any, acc: Any, slots: Any) -> None:
            _when_first_subcore(lambda: pltpu.sync_copy(out.at[core], total))  # zeros
            share = pl.ds(_worker(mesh) * n, n)
            pltpu.sync_copy(val_ref.at[share], vals)
            pltpu.sync_copy(seg_ref.at[share], segs)
            pltpu.sync_copy(slots_ref, slots)

            @plsc.parallel_loop(0, num_segments, lanes)
            def _zero(i: Any) -> None:
                acc[pl.ds(i, lanes)] = jnp.zeros((lanes,), jnp.float32)

            @pl.loop(0, n, step=lanes)
            def _add(i: Any) -> None:
                plsc.addupdate_scatter(acc, [segs[pl.ds(i, lanes)]],
                                       vals[pl.ds(i, lanes)])

            plsc.subcore_barrier()  # the core's total is zero before anyone adds
            pltpu.sync_copy(acc, total.at[slots], add=True)
            plsc.subcore_barrier()  # every subcore's sums are in before it is read
            _when_first_subcore(lambda: pltpu.sync_copy(total, out.at[core]))

        pl.run_scoped(body, scp.VMEM_SHARED((num_segments,), jnp.float32),
                      pltpu.VMEM((n,), jnp.float32), pltpu.VMEM((n,), jnp.int32),
                      pltpu.VMEM((num_segments,), jnp.float32),
                      pltpu.VMEM((num_segments,), jnp.int32))

    return _summed_over_cores(mesh, "segment_sum", interpret, per_core,
                              (values.astype(jnp.float32), segment_ids.astype(jnp.int32),
                               jnp.arange(num_segments, dtype=jnp.int32)),
                              (num_segments,), jnp.float32)


def sort_key_val(keys: jax.Array, values: jax.Array, *, descending: bool = False,
                 num_cores: int | None = None, num_subcores: int | None = None,
                 target: str | None = None, interpret: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
    """Sorts each row of ``keys`` (``(rows, num_lanes)``, one register per row) carrying
    ``values`` along, with ``plsc.sort_key_val``; the rows are split over the subcores."""
    mesh = _mesh(num_cores, num_subcores, target)
    lanes = mesh.info.num_lanes
    rows = _share(keys.shape[0], mesh, "the number of rows")
    if keys.shape[1:] != (lanes,):
        raise pl.PallasError(f"sort_key_val sorts rows of {lanes} lanes, found keys of shape "
                             f"{keys.shape}. Fix: reshape to (-1, {lanes}).")
    out = (jax.ShapeDtypeStruct(keys.shape, keys.dtype),
           jax.ShapeDtypeStruct(values.shape, values.dtype))

    @pl.kernel(out_type=out, mesh=mesh, interpret=interpret,
               scratch_types=[pltpu.VMEM((rows, lanes), keys.dtype),
                              pltpu.VMEM((rows, lanes), values.dtype)])
    def kernel(k_hbm: Any, v_hbm: Any, ko_hbm: Any, vo_hbm: Any, k_vmem: Any, v_vmem: Any
               ) -> None:
        share = pl.ds(_worker(mesh) * rows, rows)
        pltpu.sync_copy(k_hbm.at[share], k_vmem)
        pltpu.sync_copy(v_hbm.at[share], v_vmem)

        @pl.loop(0, rows)
        def _sort(r: Any) -> None:
            sk, sv = plsc.sort_key_val(k_vmem[r], v_vmem[r], descending=descending)
            k_vmem[r] = sk
            v_vmem[r] = sv

        pltpu.sync_copy(k_vmem, ko_hbm.at[share])
        pltpu.sync_copy(v_vmem, vo_hbm.at[share])

    return kernel(keys, values)  # type: ignore[no-any-return]
