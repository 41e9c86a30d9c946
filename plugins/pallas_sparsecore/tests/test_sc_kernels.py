"""The SparseCore backend without a TPU: the example kernels (embedding lookup, scatter-add of
its gradient with repeated indices, straight into HBM or through shared VMEM between subcore
barriers, a segment sum over a ragged batch, a key-value sort) lower
for ``tpu`` into a ``tpu_custom_call`` whose Mosaic module deserialises and verifies, runs on
the vector subcores of the named chip and holds the operations the kernel asks for; and the
same kernels run in the interpreter on random inputs (duplicates included) and match
``jax.numpy``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

plsc = pytest.importorskip("pallas_sparsecore")
from pallas_mosaic_tpu import inspection  # noqa: E402
from pallas_sparsecore import kernels as K  # noqa: E402, N812


def _ints(seed, shape, hi, lo=0):
    return jax.random.randint(jax.random.key(seed), shape, lo, hi, jnp.int32)


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _stable_sort(k, v, descending=False):
    order = jnp.argsort(k, axis=1, stable=True, descending=descending)
    return jnp.take_along_axis(k, order, 1), jnp.take_along_axis(v, order, 1)


# name: (kernel, arguments, reference, operations the module must hold)
CASES = {
    "embedding_lookup": (
        K.embedding_lookup, lambda: (_normal(0, (96, 128)), _ints(1, (512,), 96)),
        lambda t, i: t[i], ("tpu.enqueue_indirect_dma", "tpu.wait_indirect_dma",
                            "tpu.enqueue_dma")),
    "scatter_add": (
        functools.partial(K.scatter_add, num_rows=48),
        # 512 updates into 48 rows: every row is hit many times.
        lambda: (_normal(2, (512, 128)), _ints(3, (512,), 48)),
        lambda u, i: jnp.zeros((48, 128), jnp.float32).at[i].add(u),
        ("tpu.enqueue_indirect_dma", "add = true")),
    "scatter_add_shared": (
        functools.partial(K.scatter_add_shared, num_rows=256),
        lambda: (_normal(8, (1024, 128)), _ints(9, (1024,), 256)),
        lambda u, i: jnp.zeros((256, 128), jnp.float32).at[i].add(u),
        ("vmem_shared", "tpu.barrier", "tpu.enqueue_indirect_dma", "add = true")),
    "segment_sum": (
        functools.partial(K.segment_sum, num_segments=64),
        lambda: (_normal(4, (2048,)), jnp.sort(_ints(5, (2048,), 64))),
        lambda v, s: jax.ops.segment_sum(v, s, 64),
        ("tpu.vector_store_idx", "sc.parallel_access", "sc.loop_unroll_factor",
         "tpu.enqueue_indirect_dma")),
    "sort_key_val": (
        K.sort_key_val, lambda: (_ints(6, (64, 16), 20, -20), _normal(7, (64, 16))),
        _stable_sort, ("tpu.sort",)),
}


@functools.cache
def lowered(name: str, target: str = "v7x"):
    fn, args, *_ = CASES[name]
    return jax.jit(functools.partial(fn, target=target)).trace(*args()).lower(
        lowering_platforms=("tpu",))


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_for_tpu_and_verifies(name: str) -> None:
    (config, module), = inspection.kernels(lowered(name).as_text())
    assert config["device_type"] == "DEVICE_TYPE_SPARSECORE"
    assert config["sparse_core_config"] == {"tiling": "TILING_COMPACT"}
    summary = inspection.summary(module)
    text = str(module)
    assert "#tpu.core_type<sc_vector_subcore>" in text
    assert summary["iteration_bounds"] == (2, 16)
    assert "core_parallel" in str(summary["dimension_semantics"])
    assert "subcore_parallel" in str(summary["dimension_semantics"])
    for op in CASES[name][3]:
        assert op in text, f"{name}: {op} missing from the module"


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_jax_numpy(name: str) -> None:
    fn, args, ref, _ = CASES[name]
    a = args()
    out = fn(*a, interpret=True)
    expected = ref(*a)
    for o, e in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        assert o.shape == e.shape and o.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(o), np.asarray(e), rtol=1e-5, atol=1e-5)


def test_the_chip_sets_the_mesh_and_lanes() -> None:
    """v5p: 4 cores of 16 subcores with 8 lanes; the sort then works on rows of 8."""
    keys, vals = _ints(8, (128, 8), 100), _normal(9, (128, 8))
    low = jax.jit(functools.partial(K.sort_key_val, target="v5p")).trace(keys, vals).lower(
        lowering_platforms=("tpu",))
    (_config, module), = inspection.kernels(low.as_text())
    assert inspection.summary(module)["iteration_bounds"] == (4, 16)
    assert "vector<8xi32>" in str(module)
    sk, sv = K.sort_key_val(keys, vals, target="v5p", interpret=True)
    ek, ev = _stable_sort(keys, vals)
    np.testing.assert_array_equal(sk, ek)
    np.testing.assert_array_equal(sv, ev)


def test_one_core_mesh_is_pinned_to_a_core() -> None:
    idx = _ints(10, (64,), 32)
    low = jax.jit(functools.partial(K.embedding_lookup, num_cores=1, num_subcores=4)).trace(
        _normal(11, (32, 128)), idx).lower(lowering_platforms=("tpu",))
    (config, module), = inspection.kernels(low.as_text())
    assert config["megachip_parallelism_config"] == {"cores": ["0"]}
    assert inspection.summary(module)["iteration_bounds"] == (1, 4)


def test_descending_sort() -> None:
    keys, vals = _ints(12, (32, 16), 5), _normal(13, (32, 16))
    sk, sv = K.sort_key_val(keys, vals, descending=True, interpret=True)
    ek, ev = _stable_sort(keys, vals, descending=True)
    np.testing.assert_array_equal(sk, ek)
    np.testing.assert_array_equal(sv, ev)
    low = jax.jit(functools.partial(K.sort_key_val, descending=True)).trace(keys, vals).lower(
        lowering_platforms=("tpu",))
    assert "descending" in str(inspection.kernels(low.as_text())[0][1])
