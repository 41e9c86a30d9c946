"""The SparseCore backend against JAX's own SparseCore Pallas (``jax.experimental.pallas.tpu_sc``),
without a TPU.

Each example kernel of ``pallas_sparsecore.kernels`` (embedding lookup, scatter-add, segment sum,
key-value sort) is written a second time below with ``jax.experimental.pallas`` -- the same
algorithm: the same per-subcore share, the same scratch shapes, the same copies in the same
order. Both are lowered for ``tpu`` on this CPU host (ours with ``target="v7x"``, JAX's inside an
abstract mesh whose device is a ``TPU7x``: the same chip, 2 SparseCores of 16 vector subcores with
16 lanes), both ``tpu_custom_call`` bodies are decoded (deserialised and verified by
``pallas_mosaic_tpu``), and their STRUCTURE is compared:

* the chip description both sides use (cores, subcores, lanes, VMEM, DMA granule);
* the ``backend_config`` besides the body (device type, SparseCore config, layout passes,
  serialisation format, megachip parallelism when present);
* the kernel function's attributes: dimension semantics, iteration bounds, core type, scalar
  prefetch, scratch operands, and the window parameters with their ``transform_indices`` maps;
* the kernel function's argument types (shapes, element types, memory spaces), with the one
  documented exception for kernels written with ``pl.run_state`` + ``pl.core_map``;
* the multiset of SparseCore-relevant operations (DMAs, indirect DMAs and their ``add``,
  ``vector_store_idx`` and its ``add``, ``sort`` and its direction, ``scan``, and the
  ``sc.parallel_access`` / ``sc.loop_unroll_factor`` marks of ``scf.for`` loops);
* the operand types of those operations (where offsets of an indirect DMA live, whether a sort
  is masked).

Textual details that do not change what the chip does (SSA names, redundant slices, how a loop
counts its trip) are not compared; the Mosaic format version the bodies declare is.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

jplsc = pytest.importorskip("jax.experimental.pallas.tpu_sc",
                            reason="this JAX has no SparseCore Pallas (tpu_sc)")
pytest.importorskip("pallas_sparsecore")
from jax.experimental import pallas as jpl  # noqa: E402
from jax.experimental.pallas import tpu as jpltpu  # noqa: E402
from jaxlib.mlir import ir  # noqa: E402
from pallas_mosaic_tpu import inspection  # noqa: E402
from pallas_sparsecore import kernels as K  # noqa: E402, N812
from pallas_sparsecore import params as scp  # noqa: E402

TARGET, DEVICE_KIND = "v7x", "TPU7x"


def _abstract_mesh():
    """JAX asks the ambient abstract mesh which chip it lowers for. The axis is ``Auto``: with
    JAX 0.11's default (``Explicit``) an array made inside the kernel's caller (the zero
    accumulator) gets a sharding that JAX's own Mosaic lowering then trips over
    ("Length of sharding.spec (2) must be equal to aval's ndim (1)")."""
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KIND, num_cores=1, platform="tpu")
    return jax.sharding.AbstractMesh((1,), ("_d",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)


try:
    with jax.sharding.use_abstract_mesh(_abstract_mesh()):
        JAX_INFO = jplsc.get_sparse_core_info()
except Exception as e:  # any failure means the trick is unavailable here
    pytest.skip(f"JAX cannot describe a {DEVICE_KIND} SparseCore on this host through an "
                f"abstract mesh ({type(e).__name__}: {e})", allow_module_level=True)

OUR_INFO = scp.get_sparse_core_info(TARGET)
NC, NS, L = JAX_INFO.num_cores, JAX_INFO.num_subcores, JAX_INFO.num_lanes


# --- The example kernels written with jax.experimental.pallas --------------------------------


def _mesh():
    return jplsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore")


def _worker():
    return lax.axis_index("core") * NS + lax.axis_index("subcore")


def jax_embedding_lookup(table, idx):
    n, d = idx.shape[0] // (NC * NS), table.shape[1]

    @jpl.kernel(out_type=jax.ShapeDtypeStruct((idx.shape[0], d), table.dtype), mesh=_mesh(),
                scratch_types=[jpltpu.VMEM((n,), jnp.int32), jpltpu.VMEM((n, d), table.dtype)])
    def kernel(table_hbm, idx_hbm, out_hbm, idx_vmem, rows_vmem):
        rows = jpl.ds(_worker() * n, n)
        jpltpu.sync_copy(idx_hbm.at[rows], idx_vmem)
        jpltpu.sync_copy(table_hbm.at[idx_vmem], rows_vmem)
        jpltpu.sync_copy(rows_vmem, out_hbm.at[rows])

    return kernel(table, idx)


# Ours runs ``pl.core_map`` inside ``pl.run_state`` over (updates, idx, zeros) and allocates
# its VMEM with ``pl.run_scoped``. JAX's ``core_map`` is deprecated (0.11), so JAX's version is
# ``pl.kernel`` over a ``jax.new_ref`` of zeros (one slice per core, aliased in and out) with
# the same ``pl.run_scoped`` allocations inside: the same body, the same scratch (allocas, no
# scratch operands), the same copies. Adding DMAs go into VMEM_SHARED (JAX 0.12 refuses them
# into HBM); each core's total is copied out to its slice and the slices summed after
# (per_core=True: the slices, unsummed).
def _first_subcore(fn):
    jpl.when(lax.axis_index("subcore") == 0)(fn)


def jax_scatter_add(updates, idx, num_rows, per_core=False):
    n, d = idx.shape[0] // (NC * NS), updates.shape[1]
    result = jax.new_ref(jnp.zeros((NC, num_rows, d), updates.dtype))

    @jpl.kernel(mesh=_mesh(), name="scatter_add")
    def kernel(upd_ref, idx_ref, out):
        core = lax.axis_index("core")

        def body(acc, idx_vmem, rows_vmem):
            _first_subcore(lambda: jpltpu.sync_copy(out.at[core], acc))
            jplsc.subcore_barrier()
            rows = jpl.ds(_worker() * n, n)
            jpltpu.sync_copy(idx_ref.at[rows], idx_vmem)
            jpltpu.sync_copy(upd_ref.at[rows], rows_vmem)
            jpltpu.sync_copy(rows_vmem, acc.at[idx_vmem], add=True)
            jplsc.subcore_barrier()
            _first_subcore(lambda: jpltpu.sync_copy(acc, out.at[core]))

        jpl.run_scoped(body, jpltpu.VMEM_SHARED((num_rows, d), updates.dtype),
                       jpltpu.VMEM((n,), jnp.int32), jpltpu.VMEM((n, d), updates.dtype))

    kernel(updates, idx, result)
    return result[...] if per_core else result[...].sum(axis=0)


# As for scatter_add; the subcores zero and copy out their own slices of the accumulator.
def jax_scatter_add_shared(updates, idx, num_rows, per_core=False):
    n, d = idx.shape[0] // (NC * NS), updates.shape[1]
    rows = num_rows // NS
    result = jax.new_ref(jnp.zeros((NC, num_rows, d), updates.dtype))

    @jpl.kernel(mesh=_mesh(), name="scatter_add_shared")
    def kernel(upd_ref, idx_ref, out):
        core, subcore = lax.axis_index("core"), lax.axis_index("subcore")

        def body(acc, idx_vmem, upd_vmem, tile):
            mine = jpl.ds(subcore * rows, rows)

            @jpl.loop(0, rows)
            def _zero(r):
                @jplsc.parallel_loop(0, d, L)
                def _(j):
                    tile[r, jpl.ds(j, L)] = jnp.zeros((L,), tile.dtype)

            jpltpu.sync_copy(tile, acc.at[mine])
            jplsc.subcore_barrier()
            share = jpl.ds(_worker() * n, n)
            jpltpu.sync_copy(idx_ref.at[share], idx_vmem)
            jpltpu.sync_copy(upd_ref.at[share], upd_vmem)
            jpltpu.sync_copy(upd_vmem, acc.at[idx_vmem], add=True)
            jplsc.subcore_barrier()
            jpltpu.sync_copy(acc.at[mine], tile)
            jpltpu.sync_copy(tile, out.at[core, mine])

        jpl.run_scoped(body, jpltpu.VMEM_SHARED((num_rows, d), updates.dtype),
                       jpltpu.VMEM((n,), jnp.int32), jpltpu.VMEM((n, d), updates.dtype),
                       jpltpu.VMEM((rows, d), updates.dtype))

    kernel(updates, idx, result)
    return result[...] if per_core else result[...].sum(axis=0)


# As for scatter_add: each subcore's VMEM sums are added into the core's VMEM_SHARED total.
def jax_segment_sum(values, segment_ids, num_segments, per_core=False):
    n = values.shape[0] // (NC * NS)
    result = jax.new_ref(jnp.zeros((NC, num_segments), jnp.float32))

    @jpl.kernel(mesh=_mesh(), name="segment_sum")
    def kernel(val_ref, seg_ref, slots_ref, out):
        core = lax.axis_index("core")

        def body(total, vals, segs, acc, slots):
            _first_subcore(lambda: jpltpu.sync_copy(out.at[core], total))
            share = jpl.ds(_worker() * n, n)
            jpltpu.sync_copy(val_ref.at[share], vals)
            jpltpu.sync_copy(seg_ref.at[share], segs)
            jpltpu.sync_copy(slots_ref, slots)

            @jplsc.parallel_loop(0, num_segments, L)
            def _zero(i):
                acc[jpl.ds(i, L)] = jnp.zeros((L,), jnp.float32)

            @jpl.loop(0, n, step=L)
            def _add(i):
                jplsc.addupdate_scatter(acc, [segs[jpl.ds(i, L)]], vals[jpl.ds(i, L)])

            jplsc.subcore_barrier()
            jpltpu.sync_copy(acc, total.at[slots], add=True)
            jplsc.subcore_barrier()
            _first_subcore(lambda: jpltpu.sync_copy(total, out.at[core]))

        jpl.run_scoped(body, jpltpu.VMEM_SHARED((num_segments,), jnp.float32),
                       jpltpu.VMEM((n,), jnp.float32), jpltpu.VMEM((n,), jnp.int32),
                       jpltpu.VMEM((num_segments,), jnp.float32),
                       jpltpu.VMEM((num_segments,), jnp.int32))

    kernel(values, segment_ids, jnp.arange(num_segments, dtype=jnp.int32), result)
    return result[...] if per_core else result[...].sum(axis=0)


def jax_sort_key_val(keys, values):
    rows = keys.shape[0] // (NC * NS)
    out = (jax.ShapeDtypeStruct(keys.shape, keys.dtype),
           jax.ShapeDtypeStruct(values.shape, values.dtype))

    @jpl.kernel(out_type=out, mesh=_mesh(),
                scratch_types=[jpltpu.VMEM((rows, L), keys.dtype),
                               jpltpu.VMEM((rows, L), values.dtype)])
    def kernel(k_hbm, v_hbm, ko_hbm, vo_hbm, k_vmem, v_vmem):
        share = jpl.ds(_worker() * rows, rows)
        jpltpu.sync_copy(k_hbm.at[share], k_vmem)
        jpltpu.sync_copy(v_hbm.at[share], v_vmem)

        @jpl.loop(0, rows)
        def _sort(r):
            sk, sv = jplsc.sort_key_val(k_vmem[r], v_vmem[r], descending=False)
            k_vmem[r] = sk
            v_vmem[r] = sv

        jpltpu.sync_copy(k_vmem, ko_hbm.at[share])
        jpltpu.sync_copy(v_vmem, vo_hbm.at[share])

    return kernel(keys, values)


F32, I32 = jnp.float32, jnp.int32
S = jax.ShapeDtypeStruct

# name: (ours, JAX's, argument shapes, written with run_state + core_map on our side)
CASES = {
    "embedding_lookup": (K.embedding_lookup, jax_embedding_lookup,
                         (S((96, 128), F32), S((512,), I32)), False),
    "scatter_add": (functools.partial(K.scatter_add, num_rows=48),
                    functools.partial(jax_scatter_add, num_rows=48),
                    (S((512, 128), F32), S((512,), I32)), True),
    "scatter_add_shared": (functools.partial(K.scatter_add_shared, num_rows=256),
                           functools.partial(jax_scatter_add_shared, num_rows=256),
                           (S((1024, 128), F32), S((1024,), I32)), True),
    "segment_sum": (functools.partial(K.segment_sum, num_segments=64),
                    functools.partial(jax_segment_sum, num_segments=64),
                    (S((2048,), F32), S((2048,), I32)), True),
    "sort_key_val": (K.sort_key_val, jax_sort_key_val,
                     (S((64, 16), I32), S((64, 16), F32)), False),
}
NAMES = sorted(CASES)
PER_CORE = ("scatter_add", "scatter_add_shared", "segment_sum")
"""The cases whose JAX kernel takes ``per_core=True`` (returns each core's total unsummed)."""


# --- Lowering and reading back ---------------------------------------------------------------


def _lower(fn, args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@functools.cache
def lowered(name):
    """``{"ours": (text, config, module), "jax": (...)}`` for one kernel."""
    ours, theirs, args, _ = CASES[name]
    ours_text = _lower(functools.partial(ours, target=TARGET), args)
    with jax.sharding.use_abstract_mesh(_abstract_mesh()):
        jax_text = _lower(theirs, args)
    found = {}
    for side, text in (("ours", ours_text), ("jax", jax_text)):
        (config, module), = inspection.kernels(text)  # decoded and verified
        found[side] = (text, config, module)
    return found


def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from _walk(inner.operation)


def _kernel_func(module):
    return next(op.operation for op in module.body.operations
                if "dimension_semantics" in op.operation.attributes)


def _flag(op, name):
    """A unit or boolean attribute, as a bool."""
    if name not in op.attributes:
        return False
    try:
        return bool(ir.BoolAttr(op.attributes[name]).value)
    except ValueError:  # a unit attribute
        return True


def _attr(op, name):
    return str(op.attributes[name]) if name in op.attributes else None


SC_OPS = ("tpu.enqueue_indirect_dma", "tpu.wait_indirect_dma", "tpu.enqueue_dma",
          "tpu.wait_dma2", "tpu.vector_store_idx", "tpu.vector_load_idx", "tpu.sort",
          "tpu.scan", "tpu.barrier", "memref.alloca")


def _op_key(op):
    """An operation's name with the attributes that change what a SparseCore does."""
    name = op.name
    if name in ("tpu.enqueue_indirect_dma", "tpu.vector_store_idx"):
        return name, f"add={_flag(op, 'add')}"
    if name == "tpu.sort":
        return name, f"descending={_flag(op, 'descending')}"
    if name == "tpu.scan":
        return name, f"kind={_attr(op, 'kind')}"
    if name == "memref.alloca":  # a run_scoped buffer: its shape, type and memory space
        return name, str(op.results[0].type)
    if name == "scf.for":
        return (name, f"sc.parallel_access={'sc.parallel_access' in op.attributes}",
                f"sc.loop_unroll_factor={_attr(op, 'sc.loop_unroll_factor')}")
    return (name,)


def sc_ops(module):
    return collections.Counter(_op_key(op) for op in _walk(_kernel_func(module))
                               if op.name in SC_OPS or op.name == "scf.for")


def sc_signatures(module):
    """The SparseCore operations in order, each with its operand types (memory spaces, and
    whether an operand is a memref or a vector register)."""
    return [(*_op_key(op), tuple(str(v.type) for v in op.operands))
            for op in _walk(_kernel_func(module))
            if op.name in ("tpu.enqueue_indirect_dma", "tpu.wait_indirect_dma",
                           "tpu.vector_store_idx", "tpu.vector_load_idx", "tpu.sort",
                           "tpu.scan", "tpu.barrier", "memref.alloca")]


def _num_operands(text):
    """How many operands the ``tpu_custom_call`` takes (the kernel's HBM inputs)."""
    args = re.search(r"@tpu_custom_call\(([^)]*)\)", text).group(1)
    return len([a for a in args.split(",") if a.strip()])


def _split_operands(text, module):
    """``(grid ids, inputs, outputs, scratch)`` of the kernel function's argument types."""
    summary = inspection.summary(module)
    types = list(summary["operand_types"])
    n_ids = len(summary["iteration_bounds"])
    n_in = _num_operands(text)
    n_scratch = summary["scratch_operands"]
    ids, rest = types[:n_ids], types[n_ids:]
    body = rest[:len(rest) - n_scratch]
    return ids, body[:n_in], body[n_in:], rest[len(rest) - n_scratch:]


# --- The comparisons -------------------------------------------------------------------------


def test_both_sides_describe_the_same_chip():
    for field in ("num_cores", "num_subcores", "num_lanes", "vmem_capacity_bytes",
                  "dma_granule_size_bytes"):
        assert getattr(OUR_INFO, field) == getattr(JAX_INFO, field), field
    assert (NC, NS, L) == (2, 16, 16)


@pytest.mark.parametrize("name", NAMES)
def test_backend_config_agrees(name):
    found = lowered(name)
    ours, theirs = found["ours"][1], found["jax"][1]  # the body is already removed
    assert ours == theirs
    assert ours["device_type"] == "DEVICE_TYPE_SPARSECORE"
    # and the bodies declare the same Mosaic format version
    assert (inspection.format_versions(found["ours"][0])
            == inspection.format_versions(found["jax"][0]))


@pytest.mark.parametrize("name", NAMES)
def test_kernel_function_attributes_agree(name):
    found = lowered(name)
    ours, theirs = (_kernel_func(found[s][2]) for s in ("ours", "jax"))
    for attr in ("dimension_semantics", "iteration_bounds", "tpu.core_type",
                 "scalar_prefetch", "scratch_operands"):
        assert _attr(ours, attr) == _attr(theirs, attr), attr
    assert _attr(ours, "tpu.core_type") == "#tpu.core_type<sc_vector_subcore>"
    assert inspection.summary(found["ours"][2])["iteration_bounds"] == (NC, NS)


@pytest.mark.parametrize("name", NAMES)
def test_window_params_agree(name):
    found = lowered(name)
    per_side = {}
    for side in ("ours", "jax"):
        text, _, module = found[side]
        summary = inspection.summary(module)
        _, inputs, outputs, _ = _split_operands(text, module)
        windows = [w["transform"] for w in summary["windows"]]
        # One window per HBM operand (inputs, then outputs), none for scratch.
        assert len(windows) == len(inputs) + len(outputs), side
        assert all(w["window_bounds"] is None for w in summary["windows"]), side
        per_side[side] = list(zip(inputs + outputs, windows))
    if not CASES[name][3]:
        assert per_side["ours"] == per_side["jax"]
    else:
        # run_state + core_map on our side: more aliased outputs, inputs in another order (see
        # test_kernel_argument_types_agree); each operand type must still get the same map.
        assert set(per_side["ours"]) == set(per_side["jax"])


@pytest.mark.parametrize("name", NAMES)
def test_kernel_argument_types_agree(name):
    found = lowered(name)
    ours = _split_operands(found["ours"][0], found["ours"][2])
    theirs = _split_operands(found["jax"][0], found["jax"][2])
    if not CASES[name][3]:
        # pl.kernel on both sides: grid ids, HBM inputs, HBM outputs, VMEM scratch, exactly.
        assert ours == theirs
        return
    # Exception (run_state + core_map on our side, pl.kernel over a new_ref on JAX's): our
    # run_state aliases EVERY ref in and out of the call (one output per input, read-only ones
    # included) and lists the inputs in the order the body first uses them; JAX's pl.kernel
    # makes outputs of the mutable refs only and keeps the call order. VMEM comes from
    # run_scoped allocas on both sides (no scratch operands). Compared: the grid ids, the HBM
    # inputs as a multiset, that every JAX output is one of ours, and that our extra outputs
    # are aliases of inputs.
    ours_ids, ours_in, ours_out, ours_scratch = ours
    jax_ids, jax_in, jax_out, jax_scratch = theirs
    assert ours_ids == jax_ids
    assert sorted(ours_in) == sorted(jax_in)
    assert ours_scratch == jax_scratch == []
    assert not collections.Counter(jax_out) - collections.Counter(ours_out)
    assert sorted(ours_out) == sorted(ours_in)
    assert all("#tpu.memory_space<hbm>" in t for t in ours_in + ours_out + jax_in + jax_out)


@pytest.mark.parametrize("name", NAMES)
def test_sparsecore_operations_agree(name):
    found = lowered(name)
    ours, theirs = sc_ops(found["ours"][2]), sc_ops(found["jax"][2])
    assert ours == theirs
    assert ours  # every kernel has some


@pytest.mark.parametrize("name", NAMES)
def test_sparsecore_operation_operands_agree(name):
    """Where an indirect DMA reads its offsets (a VMEM memref or a vector register) and which
    operands a sort or an indexed store gets (a mask or none) are part of what the chip does."""
    found = lowered(name)
    assert sc_signatures(found["ours"][2]) == sc_signatures(found["jax"][2])
