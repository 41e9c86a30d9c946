"""Each ``plsc`` primitive on one register (16 lanes, v7x): the interpreter's result matches
a jax.numpy reference on random inputs, and the lowered module holds the Mosaic operation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plsc = pytest.importorskip("pallas_sparsecore")
import pallas_mosaic_tpu as pltpu  # noqa: E402
from pallas_mosaic_tpu import inspection  # noqa: E402

L = 16
MESH = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                              num_subcores=1, target="v7x")


def run(body, ins, outs, interpret):
    """``body(*in_vmem, *out_vmem)`` on VMEM copies of ``ins``; returns the outputs."""
    shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]

    @pl.kernel(out_type=tuple(shapes), mesh=MESH, interpret=interpret,
               scratch_types=[pltpu.VMEM(a.shape, a.dtype) for a in [*ins, *outs]])
    def k(*refs):
        n = len(ins)
        hbm_in, hbm_out, vmem = refs[:n], refs[n:n + len(outs)], refs[n + len(outs):]
        for h, v in zip(hbm_in, vmem[:n]):
            pltpu.sync_copy(h, v)
        body(*vmem)
        for h, v in zip(hbm_out, vmem[n:]):
            pltpu.sync_copy(v, h)
    return k(*ins)


def rand(seed, dtype=jnp.float32, shape=(L,), lo=-8, hi=8):
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(jax.random.key(seed), shape, lo, hi, dtype)
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def mask(seed):
    return jax.random.bernoulli(jax.random.key(seed), 0.6, (L,))


X, IDX, M = rand(0), rand(1, jnp.int32, lo=0, hi=L), mask(2)
KEYS, VALS, XI = rand(3, jnp.int32, lo=-5, hi=5), rand(4), rand(5, jnp.int32, lo=-100, hi=100)
TABLE = rand(6, shape=(4, L))


def _cases():
    def gather(t, i, o):
        o[...] = plsc.load_gather(t, [lax.div(i[...], 16), lax.rem(i[...], L)])
    def gather_ref(t, i):
        return t[i // 16, i % L]

    def scatter_add(x, i, m, o):
        o[...] = jnp.ones((L,), jnp.float32)
        plsc.addupdate_scatter(o, [lax.rem(i[...], 4)], x[...], mask=m[...] != 0)
    def scatter_add_ref(x, i, m):
        keep = m != 0
        return jnp.ones((L,)).at[jnp.where(keep, i % 4, L)].add(x, mode="drop")

    def scatter(x, o):
        o[...] = jnp.zeros((L,), jnp.float32)
        plsc.store_scatter(o, [(L - 1) - lax.iota(jnp.int32, L)], x[...])
    def scatter_ref(x):
        return x[::-1]

    def expanded(x, m, o):
        v = plsc.load_expanded(x, mask=m[...] != 0)
        o[...] = jnp.where(m[...] != 0, v, 0.0)
    def expanded_ref(x, m):
        keep = m != 0
        return jnp.where(keep, x[jnp.clip(jnp.cumsum(keep) - 1, 0)], 0.0)

    def compressed(x, m, o):
        o[...] = jnp.zeros((L,), jnp.float32)
        plsc.store_compressed(o, x[...], mask=m[...] != 0)
    def compressed_ref(x, m):
        keep = np.asarray(m) != 0
        out = np.zeros(L, np.float32)
        out[:keep.sum()] = np.asarray(x)[keep]
        return out

    def addupd(x, o):
        o[...] = jnp.full((L,), 2.0, jnp.float32)
        plsc.addupdate(o, x[...])
    def cumsum(x, m, o):
        o[...] = plsc.cumsum(x[...], mask=m[...] != 0)
    def cummax(x, m, o):
        o[...] = plsc.cummax(x[...], mask=m[...] != 0)
    def cummax_ref(x, m):
        keep = m != 0
        run_ = lax.cummax(jnp.where(keep, x, jnp.iinfo(jnp.int32).min))
        return jnp.where(jnp.cumsum(keep) > 0, run_, x)

    def sort(k, v, m, ok, ov, om):
        sk, sv, sm = plsc.sort_key_val(k[...], v[...], mask=m[...] != 0)
        ok[...], ov[...], om[...] = sk, sv, sm.astype(jnp.int32)
    def sort_ref(k, v, m):
        keep = np.asarray(m) != 0
        order = np.argsort(np.where(keep, np.asarray(k), np.iinfo(np.int32).max), kind="stable")
        n = keep.sum()
        return (np.asarray(k)[order][:n], np.asarray(v)[order][:n],
                np.arange(L) < n)

    def counts(k, o1, o2):
        c, last = plsc.scan_count(k[...])
        o1[...], o2[...] = c, last.astype(jnp.int32)
    def counts_ref(k):
        k = np.asarray(k)
        c = np.array([(k[:i + 1] == k[i]).sum() for i in range(L)])
        last = np.array([not (k[i + 1:] == k[i]).any() for i in range(L)])
        return c, last.astype(np.int32)

    def pop(m, o1, o2):
        o1[...] = plsc.all_reduce_population_count(m[...] != 0)
        o2[...] = plsc.all_reduce_ffs(m[...] != 0)
    def pop_ref(m):
        keep = np.asarray(m) != 0
        first = np.argmax(keep) if keep.any() else L
        return np.full(L, keep.sum()), np.full(L, first)

    def packs(x, y, o1, o2):
        a, b = plsc.unpack(plsc.pack(x[...], y[...], format=plsc.PackFormat.INTERLEAVED),
                           format=plsc.PackFormat.INTERLEAVED)
        o1[...], o2[...] = a, b
    def packs_ref(x, y):
        r = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
        return r(x), r(y)

    def ploop(x, o):
        @plsc.parallel_loop(0, 4, unroll=2, carry=jnp.zeros((L,), jnp.float32))
        def total(i, acc):
            return acc + x[...] * i.astype(jnp.float32)
        o[...] = total

    m_int = M.astype(jnp.int32)
    return {
        "load_gather": (gather, [TABLE, rand(8, jnp.int32, lo=0, hi=4 * L)], gather_ref,
                        "tpu.vector_load_idx"),
        "addupdate_scatter": (scatter_add, [X, IDX, m_int], scatter_add_ref,
                              "tpu.vector_store_idx"),
        "store_scatter": (scatter, [X], scatter_ref, "tpu.vector_store_idx"),
        "load_expanded": (expanded, [X, m_int], expanded_ref, "masked"),
        "store_compressed": (compressed, [X, m_int], compressed_ref, "masked"),
        "addupdate": (addupd, [X], lambda x: x + 2.0, "add = true"),
        "cumsum": (cumsum, [X, m_int], lambda x, m: jnp.cumsum(jnp.where(m != 0, x, 0.0)),
                   "tpu.scan"),
        "cummax": (cummax, [XI, m_int], cummax_ref, "tpu.scan"),
        "sort_key_val": (sort, [KEYS, VALS, m_int], sort_ref, "tpu.sort"),
        "scan_count": (counts, [KEYS], counts_ref, "tpu.scan_count"),
        "population_count_ffs": (pop, [m_int], pop_ref, "tpu.all_reduce"),
        "pack_unpack": (packs, [X, rand(7)], packs_ref, "tpu.pack_subelements"),
        "parallel_loop": (ploop, [X], lambda x: 6.0 * x, "sc.parallel_access"),
    }


CASES = _cases()
_OUT_SHAPES = {"sort_key_val": [KEYS, VALS, KEYS], "scan_count": [KEYS, KEYS],
               "population_count_ffs": [KEYS, KEYS], "pack_unpack": [X, X]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_primitive(name) -> None:
    body, ins, ref, op = CASES[name]
    outs = _OUT_SHAPES.get(name, [jnp.zeros((L,), ins[0].dtype)])
    got = run(body, ins, outs, interpret=True)
    want = ref(*ins)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if name == "sort_key_val" and g.shape != w.shape:  # only the kept lanes are defined
            g = g[:w.shape[0]]
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-6,
                                   atol=1e-6)
    low = jax.jit(lambda *a: run(body, list(a), outs, interpret=False)).trace(*ins).lower(
        lowering_platforms=("tpu",))
    (_, module), = inspection.kernels(low.as_text())
    assert op in str(module)
