"""JAX's own TPU kernel library (``jax.experimental.pallas.ops.tpu`` of the installed jax) run on
CPU through this project, with only its Pallas imports rewritten (``porting.ported``).

Every kernel is checked on random inputs against the library module's own reference where it
has one (``flash_attention.mha_reference``, ``paged_attention.util``,
``ref_ragged_paged_attention``, splash attention's masked references) and otherwise against an
independent one: per-group ``jax.numpy`` matmuls for megablox, ``jax.random`` for threefry, a
numpy Philox4x32-10 (itself checked on Random123's known-answer vectors) for philox, the
unsharded input for the all-gather. Backward passes are compared with ``jax.vjp`` of a
reference without a custom VJP.

Kernels that take no ``interpret`` argument run under ``pltpu.force_tpu_interpret_mode()``;
the others get ``interpret=True``. Shapes are the smallest the kernels accept (TPU tiles of
(8, 128) and blocks of 128), so the module takes about two minutes of CPU time.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pallas_mosaic_tpu as pltpu
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_core as pl
from tests.jax_library import porting

interpreted = pltpu.force_tpu_interpret_mode

Library = Callable[[str], Any]
"""``"tpu.matmul"`` -> that library module: ``porting.ported`` (the default of the helpers
below, which ``test_tpu_library_emulated.py`` also runs on JAX's own modules)."""


def _keys(seed: int, n: int) -> list[jax.Array]:
    return list(jax.random.split(jax.random.key(seed), n))


def _close(got: Any, want: Any, tol: float) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


# --- example_kernel, matmul -------------------------------------------------------------------


def test_example_double() -> None:
    example = porting.ported("tpu.example_kernel")
    x = jax.random.normal(jax.random.key(0), (16, 128))
    with interpreted():
        np.testing.assert_array_equal(example.double(x), 2 * x)


@pytest.mark.parametrize(("dtype", "tol"), [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_matmul(dtype: Any, tol: float) -> None:
    matmul = porting.ported("tpu.matmul")
    k1, k2 = _keys(1, 2)
    x = jax.random.normal(k1, (256, 384), dtype)
    y = jax.random.normal(k2, (384, 256), dtype)
    with interpreted():
        out = matmul.matmul(x, y, block_shape=(128, 128), block_k=128)
    expected = jnp.dot(x, y, preferred_element_type=jnp.float32)
    assert out.dtype == dtype
    _close(out / 20, expected / 20, tol)  # entries are ~sqrt(384) = 20


# --- flash_attention --------------------------------------------------------------------------


def _flash_inputs(with_extras: bool, lib: Library = porting.ported) -> tuple[Any, ...]:
    b, h, s, d = 2, 2, 256, 128
    kq, kk, kv, kab, kseg = _keys(2, 5)
    q, k, v = (jax.random.normal(key, (b, h, s, d)) for key in (kq, kk, kv))
    if not with_extras:
        return q, k, v, None, None
    flash = lib("tpu.flash_attention")
    ab = jax.random.normal(kab, (b, h, s, s))
    # Three segments per row, boundaries not on block edges; row 0 of each is kept unmasked.
    bounds = jnp.sort(jax.random.randint(kseg, (b, 2), 1, s), axis=1)
    ids = (jnp.arange(s)[None] >= bounds[:, :1]).astype(jnp.int32) + (
        jnp.arange(s)[None] >= bounds[:, 1:]).astype(jnp.int32)
    return q, k, v, ab, flash.SegmentIds(q=ids, kv=ids)


def _flash_blocks(lib: Library = porting.ported) -> Any:
    flash = lib("tpu.flash_attention")
    return flash.BlockSizes(
        block_q=128, block_k_major=256, block_k=128, block_b=1,
        block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128, block_q_dkv=128,
        block_k_major_dq=256, block_k_dq=128, block_q_dq=128)


@pytest.mark.parametrize("with_extras", [False, True], ids=["plain", "bias+segments"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_forward(causal: bool, with_extras: bool) -> None:
    flash = porting.ported("tpu.flash_attention")
    q, k, v, ab, seg = _flash_inputs(with_extras)
    with interpreted():
        out = flash.flash_attention(q, k, v, ab, seg, causal=causal, sm_scale=0.125,
                                    block_sizes=_flash_blocks())
    expected = flash.mha_reference(q, k, v, ab, seg, causal=causal, sm_scale=0.125)
    _close(out, expected, 2e-4)


@pytest.mark.parametrize(("causal", "with_extras"), [(False, False), (True, True)],
                         ids=["full-plain", "causal-bias+segments"])
def test_flash_attention_backward(causal: bool, with_extras: bool) -> None:
    """The library's custom_vjp backward (its dq and dkv kernels) against autodiff of the
    reference without custom_vjp."""
    flash = porting.ported("tpu.flash_attention")
    q, k, v, ab, seg = _flash_inputs(with_extras)
    dout = jax.random.normal(jax.random.key(3), q.shape)
    kw = {"causal": causal, "sm_scale": 0.125}
    with interpreted():
        _, vjp = jax.vjp(lambda *a: flash.flash_attention(
            *a, seg, block_sizes=_flash_blocks(), **kw), q, k, v, ab)
        grads = vjp(dout)
    _, ref_vjp = jax.vjp(lambda *a: flash.mha_reference_no_custom_vjp(*a, seg, **kw), q, k, v, ab)
    for got, want in zip(grads, ref_vjp(dout)):
        if want is not None:
            _close(got, want, 2e-3)


# --- all_gather -------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "axis", "space"), [
    ((2,), "x", "vmem"), ((8,), "x", "any"), ((2, 4), "y", "vmem"), ((2, 4), "x", "any")])
def test_all_gather(shape: tuple[int, ...], axis: str, space: str) -> None:
    all_gather = porting.ported("tpu.all_gather")
    names = ("x", "y")[:len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:int(np.prod(shape))])
    x = jax.random.normal(jax.random.key(4), (mesh.shape[axis] * 16, 128))
    x = jax.device_put(x, NamedSharding(mesh, P(axis)))
    memory_space = pltpu.VMEM if space == "vmem" else pl.ANY
    with interpreted():
        out = all_gather.all_gather(x, mesh=mesh, axis_name=axis, memory_space=memory_space)
    np.testing.assert_array_equal(out, x)


# --- random: threefry, philox -----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(512, 512), (137, 275), (2, 256, 256), (34,), ()])
def test_threefry_matches_jax_random(shape: tuple[int, ...]) -> None:
    threefry = porting.ported("tpu.random.threefry")
    with jax.threefry_partitionable(True):
        expected = jax.random.bits(jax.random.key(0, impl="threefry2x32"), shape)
        with interpreted():
            got = jax.random.bits(jax.random.key(0, impl=threefry.plthreefry_prng_impl), shape)
    np.testing.assert_array_equal(got, expected)


def test_threefry_sharded_matches_jax_random() -> None:
    threefry = porting.ported("tpu.random.threefry")
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    generate = jax.shard_map(lambda key: jax.random.bits(key[0], (35, 113)), mesh=mesh,
                             in_specs=P("x"), out_specs=P("x"), check_vma=False)
    results = []
    with jax.threefry_partitionable(True):
        for impl in ("threefry2x32", threefry.plthreefry_prng_impl):
            keys = jax.random.split(jax.random.key(0, impl=impl), n)
            with interpreted():
                results.append(generate(jax.device_put(keys, NamedSharding(mesh, P("x")))))
    np.testing.assert_array_equal(results[1], results[0])


def test_ported_and_jax_random_modules_coexist() -> None:
    """JAX registers a PRNG name once per process: the ported modules register theirs as
    ``ported_<name>``, so JAX's own modules import beside them (in either order)."""
    import jax.experimental.pallas.ops.tpu.random.philox as jax_philox
    import jax.experimental.pallas.ops.tpu.random.threefry as jax_threefry

    threefry = porting.ported("tpu.random.threefry")
    philox = porting.ported("tpu.random.philox")
    assert jax_threefry.plthreefry_prng_impl.name == "pallas_threefry2x32"
    assert jax_philox.plphilox_prng_impl.name == "pallas_philox4x32"
    for name, impl in [("ported_pallas_threefry2x32", threefry.plthreefry_prng_impl),
                       ("ported_pallas_philox4x32", philox.plphilox_prng_impl)]:
        assert impl.name == name
        assert jax.random.key_impl(jax.random.key(1, impl=name)) == name


_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def _philox4x32_10(counter: list[Any], key: list[Any]) -> list[Any]:
    """Philox4x32-10 (Salmon et al. 2011) on numpy uint64 arrays holding 32-bit words."""
    c, k, low = list(counter), list(key), np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0, p1 = np.uint64(_PHILOX_M[0]) * c[0], np.uint64(_PHILOX_M[1]) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k[0], p1 & low,
             (p0 >> np.uint64(32)) ^ c[3] ^ k[1], p0 & low]
        k = [(k[0] + np.uint64(_PHILOX_W[0])) & low, (k[1] + np.uint64(_PHILOX_W[1])) & low]
    return c


def test_philox_reference_matches_random123() -> None:
    """The reference below reproduces Random123's known-answer vectors for philox4x32-10."""
    vectors = [
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, expected in vectors:
        got = _philox4x32_10([np.uint64(c) for c in counter], [np.uint64(x) for x in key])
        assert [int(g) for g in got] == expected


@pytest.mark.parametrize(("shape", "offset"), [((256, 512), 0), ((37, 300), 5),
                                                ((2, 256, 256), 5), ((3,), 0)])
def test_philox_counts(shape: tuple[int, ...], offset: int) -> None:
    """Element ``n`` (row-major) is Philox of counter ``(0, n + offset, 0, 0)``: fused output
    ``c0 ^ c1``, unfused ``(c0, c1)``."""
    philox = porting.ported("tpu.random.philox")
    key = [0x12345678, 0x9ABCDEF0]
    with interpreted():
        fused = philox.philox_4x32_count(jnp.array(key, jnp.uint32), shape, offset=offset)
        halves = philox.philox_4x32_count(jnp.array(key, jnp.uint32), shape, offset=offset,
                                          fuse_output=False)
    count = np.arange(int(np.prod(shape)), dtype=np.uint64).reshape(shape) + np.uint64(offset)
    zero = np.zeros_like(count)
    c = _philox4x32_10([zero, count, zero, zero], [np.uint64(x) for x in key])
    np.testing.assert_array_equal(fused, (c[0] ^ c[1]).astype(np.uint32))
    np.testing.assert_array_equal(halves, np.stack([c[0], c[1]]).astype(np.uint32))


def test_philox_prng_impl_through_jax_random() -> None:
    """jax.random on the philox implementation: bits are the fused counts from key data, and
    split/fold_in give the unfused counts (what the library defines them as)."""
    philox = porting.ported("tpu.random.philox")
    key = jax.random.key(3, impl=philox.plphilox_prng_impl)
    data = np.asarray(jax.random.key_data(key), np.uint64)
    with interpreted():
        bits = jax.random.bits(key, (16, 256))
        k1, k2 = jax.random.split(key)
        folded = jax.random.fold_in(key, 7)
    count = np.arange(16 * 256, dtype=np.uint64).reshape(16, 256)
    zero = np.zeros_like(count)
    c = _philox4x32_10([zero, count, zero, zero], list(data))
    np.testing.assert_array_equal(bits, (c[0] ^ c[1]).astype(np.uint32))
    c = _philox4x32_10([np.uint64(0), np.arange(2, dtype=np.uint64), np.uint64(0),
                        np.uint64(0)], list(data))
    np.testing.assert_array_equal(jax.random.key_data(k1), np.uint32([c[0][0], c[1][0]]))
    np.testing.assert_array_equal(jax.random.key_data(k2), np.uint32([c[0][1], c[1][1]]))
    c = _philox4x32_10([np.uint64(0), np.uint64(7), np.uint64(0), np.uint64(0)], list(data))
    np.testing.assert_array_equal(jax.random.key_data(folded), np.uint32([c[0], c[1]]))


# --- paged_attention --------------------------------------------------------------------------

_SEQ_LENS = np.asarray([0, 3, 64, 100, 128, 17], np.int32)


def _paged_inputs(num_kv: int, num_q: int, dtype: Any, quantized: bool,
                  lib: Library = porting.ported) -> tuple[Any, ...]:
    """Pages of 16 tokens, 8 per sequence, shuffled over the cache."""
    qu = lib("tpu.paged_attention.quantization_utils")
    page, per_seq, d = 16, 8, 128
    total = len(_SEQ_LENS) * per_seq
    kk, kv, kperm, kq = _keys(5, 4)
    k_pages = jax.random.normal(kk, (num_kv, total, page, d), dtype)
    v_pages = jax.random.normal(kv, (num_kv, total, page, d), dtype)
    if quantized:
        k_pages, v_pages = qu.quantize_to_int8(k_pages), qu.quantize_to_int8(v_pages)
    indices = jax.random.permutation(kperm, total).astype(jnp.int32).reshape(-1, per_seq)
    q = jax.random.normal(kq, (len(_SEQ_LENS), num_q, d), dtype)
    return q, k_pages, v_pages, indices


def _gather_pages(pages: Any, indices: Any, lib: Library = porting.ported) -> jax.Array:
    """Each sequence's pages in order, as the reference takes them. The kernel computes with
    pages rounded to bfloat16 (int8 pages: dequantized in float32), so the reference does."""
    qu = lib("tpu.paged_attention.quantization_utils")
    if isinstance(pages, qu.QuantizedTensor):
        pages = qu.unquantize_from_int8(pages, dtype=jnp.float32)
    else:
        pages = pages.astype(jnp.bfloat16)
    num_kv, _, _, d = pages.shape
    seq = jnp.take(pages, indices, axis=1)  # (num_kv, batch, per_seq, page, d)
    seq = seq.transpose(1, 0, 2, 3, 4).reshape(indices.shape[0], num_kv, -1, d)
    return seq.astype(jnp.float32)


def _check_paged(num_kv: int, ratio: int, dtype: Any, quantized: bool, **kw: Any) -> None:
    paged = porting.ported("tpu.paged_attention")
    util = porting.ported("tpu.paged_attention.util")
    q, k_pages, v_pages, indices = _paged_inputs(num_kv, num_kv * ratio, dtype, quantized)
    out = paged.paged_attention(q, k_pages, v_pages, jnp.asarray(_SEQ_LENS), indices,
                                pages_per_compute_block=4, **kw)
    expected = util.grouped_query_attention_reference(
        q.astype(jnp.float32), _gather_pages(k_pages, indices), _gather_pages(v_pages, indices),
        jnp.asarray(_SEQ_LENS), kw.get("attn_logits_soft_cap"))
    nonempty = _SEQ_LENS > 0
    _close(out[nonempty], expected[nonempty], 2e-2 if dtype == jnp.bfloat16 else 1e-3)


@pytest.mark.parametrize(("num_kv", "ratio", "dtype", "quantized", "kw"), [
    (1, 1, jnp.float32, False, {}),
    (2, 4, jnp.float32, False, {"inline_seq_dim": False, "attn_logits_soft_cap": 1.0}),
    (2, 8, jnp.bfloat16, False, {}),
    (2, 1, jnp.float32, True, {"inline_seq_dim": False}),
], ids=["mha", "gqa-grid-softcap", "gqa8-bf16", "int8-grid"])
def test_paged_attention(num_kv: int, ratio: int, dtype: Any, quantized: bool,
                         kw: dict[str, Any]) -> None:
    with interpreted():
        _check_paged(num_kv, ratio, dtype, quantized, **kw)


@pytest.mark.parametrize("megacore_mode", ["batch", "kv_head"])
def test_paged_attention_megacore(megacore_mode: str) -> None:
    with interpreted(pltpu.InterpretParams(num_cores_or_threads=2)):
        _check_paged(2, 2, jnp.float32, False, megacore_mode=megacore_mode,
                     inline_seq_dim=False)


def test_paged_attention_megacore_on_one_core_reports_the_wait() -> None:
    """On one core the second half of a megacore grid waits for a prefetch that the first
    half's last step never started (its init flag lives in the shared scalar memory): the
    interpreter says so instead of reading stale buffers."""
    with interpreted(), pytest.raises(Exception, match=r"deadlock.*no step still to run"):
        _check_paged(2, 2, jnp.float32, False, megacore_mode="kv_head", inline_seq_dim=False)
        jax.effects_barrier()


# --- ragged_paged_attention -------------------------------------------------------------------


def _ragged_inputs(seq_lens: list[tuple[int, int]], heads: tuple[int, int]) -> tuple[Any, ...]:
    """Queries of all sequences packed into 64 rows; each sequence's keys/values in pages of
    16 tokens (NaN past its length) scattered over a 24-page cache; room for 4 sequences."""
    page, d, num_pages, max_rows, max_seqs = 16, 128, 24, 64, 4
    num_q, num_kv = heads
    kq, kkv, kperm = _keys(6, 3)
    per_seq = max(pl.cdiv(kv, page) for _, kv in seq_lens)
    pages, tables = [], []
    for i, (_, kv_len) in enumerate(seq_lens):
        kv = jax.random.normal(jax.random.fold_in(kkv, i), (kv_len, 2 * num_kv, d))
        n = pl.cdiv(kv_len, page)
        kv = jnp.pad(kv, ((0, n * page - kv_len), (0, 0), (0, 0)), constant_values=jnp.nan)
        tables.append(np.pad(np.arange(n) + sum(p.shape[0] for p in pages), (0, per_seq - n)))
        pages.append(kv.reshape(n, page, 2 * num_kv, d))
    cache = jnp.concatenate(pages)
    cache = jnp.pad(cache, ((0, num_pages - cache.shape[0]), (0, 0), (0, 0), (0, 0)),
                    constant_values=jnp.nan)
    perm = np.asarray(jax.random.permutation(kperm, num_pages))
    table = np.argsort(perm)[np.stack(tables)]
    table = np.pad(table, ((0, max_seqs - len(seq_lens)), (0, 0))).astype(np.int32)
    cu_q = np.pad(np.cumsum([0] + [q for q, _ in seq_lens]), (0, max_seqs - len(seq_lens)))
    kv_lens = np.pad([kv for _, kv in seq_lens], (0, max_seqs - len(seq_lens)))
    q = jax.random.normal(kq, (max_rows, num_q, d))
    return (q, cache[perm], jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table),
            jnp.asarray(cu_q, jnp.int32), jnp.array([len(seq_lens)], jnp.int32))


@pytest.mark.parametrize(("seq_lens", "heads", "kw"), [
    ([(12, 40), (1, 20), (16, 16)], (8, 2), {}),
    ([(5, 33), (20, 50)], (4, 4), {"sliding_window": 8}),
    ([(1, 7), (1, 60), (3, 3)], (4, 2), {"soft_cap": 50.0, "k_scale": 0.5, "v_scale": 0.8}),
], ids=["mixed", "sliding-window", "decode-softcap-kv-scales"])
def test_ragged_paged_attention(seq_lens: list[tuple[int, int]], heads: tuple[int, int],
                                kw: dict[str, Any]) -> None:
    ragged = porting.ported("tpu.ragged_paged_attention")
    args = _ragged_inputs(seq_lens, heads)
    with interpreted():
        out = ragged.ragged_paged_attention(*args, num_kv_pages_per_block=2,
                                            num_queries_per_block=8, **kw)
    expected = ragged.ref_ragged_paged_attention(*args, **kw)
    rows = sum(q for q, _ in seq_lens)
    _close(out[:rows], expected[:rows], 1e-4)


# --- megablox ---------------------------------------------------------------------------------

_GROUP_SIZES = [10, 0, 30, 24]  # m = 64 rows in 4 groups, one empty, none on a tile edge


def _reference_gmm(lhs: Any, rhs: Any, sizes: list[int]) -> jax.Array:
    ends = np.cumsum([0, *sizes])
    return jnp.concatenate([lhs[a:b] @ rhs[g] for g, (a, b) in enumerate(itertools.pairwise(ends))])


def _gmm_inputs() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    k1, k2, k3 = _keys(7, 3)
    m, k, n = sum(_GROUP_SIZES), 128, 256
    return (jax.random.normal(k1, (m, k)), jax.random.normal(k2, (len(_GROUP_SIZES), k, n)),
            jnp.asarray(_GROUP_SIZES, jnp.int32), jax.random.normal(k3, (m, n)))


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_megablox_gmm(transpose_rhs: bool) -> None:
    gmm = porting.ported("tpu.megablox.gmm")
    lhs, rhs, sizes, _ = _gmm_inputs()
    out = gmm.gmm(lhs, rhs.swapaxes(1, 2) if transpose_rhs else rhs, sizes,
                  tiling=(16, 128, 128), transpose_rhs=transpose_rhs, interpret=True)
    _close(out, _reference_gmm(lhs, rhs, _GROUP_SIZES), 1e-4)


def test_megablox_tgmm() -> None:
    """tgmm: per group, lhs[:, rows of the group] @ rhs[rows of the group]."""
    gmm = porting.ported("tpu.megablox.gmm")
    lhs, _, sizes, dy = _gmm_inputs()
    out = gmm.tgmm(lhs.T, dy, sizes, tiling=(16, 128, 128), interpret=True)
    ends = np.cumsum([0, *_GROUP_SIZES])
    expected = jnp.stack([lhs[a:b].T @ dy[a:b] for a, b in itertools.pairwise(ends)])
    _close(out, expected, 1e-4)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_megablox_gmm_backward(transpose_rhs: bool) -> None:
    """ops.gmm's custom_vjp (a gmm for the lhs gradient, a tgmm for the rhs one) against
    autodiff of the per-group matmuls."""
    ops = porting.ported("tpu.megablox.ops")
    lhs, rhs, sizes, dy = _gmm_inputs()
    rhs_in = rhs.swapaxes(1, 2) if transpose_rhs else rhs
    gmm = functools.partial(ops.gmm, preferred_element_type=jnp.float32, tiling=(16, 128, 128),
                            transpose_rhs=transpose_rhs, interpret=True)
    out, vjp = jax.vjp(lambda a, b: gmm(a, b, sizes), lhs, rhs_in)
    grads = vjp(dy)

    def reference(a: Any, b: Any) -> jax.Array:
        return _reference_gmm(a, b.swapaxes(1, 2) if transpose_rhs else b, _GROUP_SIZES)

    expected, ref_vjp = jax.vjp(reference, lhs, rhs_in)
    _close(out, expected, 1e-4)
    for got, want in zip(grads, ref_vjp(dy)):
        _close(got, want, 1e-4)


# --- splash_attention -------------------------------------------------------------------------

_SPLASH_SEQ, _SPLASH_DIM = 256, 128
_SPLASH_HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (2, None)}


def _splash_mask(kind: str, heads: int, lib: Library = porting.ported) -> Any:
    masks = lib("tpu.splash_attention.splash_attention_mask")
    shape = (_SPLASH_SEQ, _SPLASH_SEQ)
    one = {"causal": masks.CausalMask(shape), "full": masks.FullMask(shape),
           "local": masks.LocalMask(shape, (64, 16), offset=0)}[kind]
    return masks.MultiHeadMask([one] * heads)


def _splash_call(kind: str, form: str, lib: Library = porting.ported,
                 **kw: Any) -> tuple[Any, Any, tuple[jax.Array, ...]]:
    """The kernel, the library's masked reference and inputs (q, k, v)."""
    splash = lib("tpu.splash_attention.splash_attention_kernel")
    num_q, num_kv = _SPLASH_HEADS[form]
    kq, kk, kv = _keys(8, 3)
    kv_shape = (_SPLASH_SEQ, _SPLASH_DIM) if num_kv is None else (num_kv, _SPLASH_SEQ,
                                                                  _SPLASH_DIM)
    q = jax.random.uniform(kq, (num_q, _SPLASH_SEQ, _SPLASH_DIM))
    k, v = jax.random.uniform(kk, kv_shape), jax.random.uniform(kv, kv_shape)
    mask = _splash_mask(kind, num_q, lib)
    blocks = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128,
                               block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128,
                               block_q_dq=128, block_kv_dq=128)
    blocks = kw.pop("block_sizes", blocks)
    if num_kv is None:
        kernel = splash.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=True,
                                                      **kw)
        reference = splash.make_masked_mqa_reference(mask)
    else:
        kernel = splash.make_splash_mha_single_device(mask, block_sizes=blocks, interpret=True,
                                                      **kw)
        reference = splash.make_masked_mha_reference(mask)
    return kernel, reference, (q, k, v)


@pytest.mark.parametrize("form", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", ["causal", "local", "full"])
def test_splash_attention_forward(kind: str, form: str) -> None:
    kernel, reference, args = _splash_call(kind, form)
    _close(kernel(*args), reference(*args), 1e-5)


@pytest.mark.parametrize(("kind", "form"), [("causal", "mha"), ("local", "gqa"),
                                             ("full", "mqa")])
def test_splash_attention_backward(kind: str, form: str) -> None:
    """The dq and dkv kernels against autodiff of the library's masked reference."""
    kernel, reference, args = _splash_call(kind, form)
    dout = jax.random.uniform(jax.random.key(9), args[0].shape)
    grads = jax.vjp(kernel, *args)[1](dout)
    for got, want in zip(grads, jax.vjp(reference, *args)[1](dout)):
        _close(got, want, 1e-4)


def test_splash_attention_segments_softcap_and_residuals() -> None:
    splash = porting.ported("tpu.splash_attention.splash_attention_kernel")
    kernel, reference, args = _splash_call("causal", "gqa", save_residuals=True,
                                           attn_logits_soft_cap=20.0)
    ids = (jnp.arange(_SPLASH_SEQ) >= 100).astype(jnp.int32)
    segments = splash.SegmentIds(q=ids, kv=ids)
    out, (lse,) = kernel(*args, segments)
    expected, (expected_lse,) = reference(*args, segments, save_residuals=True,
                                          attn_logits_soft_cap=20.0)
    _close(out, expected, 1e-5)
    _close(lse, expected_lse, 1e-5)


def test_splash_attention_fused_backward() -> None:
    """The fused dq+dkv backward kernel (use_fused_bwd_kernel=True)."""
    splash = porting.ported("tpu.splash_attention.splash_attention_kernel")
    blocks = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128,
                               block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128,
                               use_fused_bwd_kernel=True)
    kernel, reference, args = _splash_call("local", "mha", block_sizes=blocks)
    dout = jax.random.uniform(jax.random.key(10), args[0].shape)
    grads = jax.vjp(kernel, *args)[1](dout)
    for got, want in zip(grads, jax.vjp(reference, *args)[1](dout)):
        _close(got, want, 1e-4)
