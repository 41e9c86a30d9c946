"""``pl.emulate(f, backend="sparsecore")``: every kernel of this plugin's tests lowered for a
TPU v7x's SparseCores and its Mosaic module executed by the SparseCore emulator (every subcore
of the mesh, barriers included) matches ``jax.numpy`` on random inputs and the interpreter; the
modules ``jax.experimental.pallas`` emits for the same kernels do too; a kernel that would hang
(a barrier some subcores never reach) or read outside a buffer is reported."""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plsc = pytest.importorskip("pallas_sparsecore")
import pallas_mosaic_tpu as pltpu  # noqa: E402
import test_sc_barrier as B  # noqa: E402, N812
import test_sc_kernels as KT  # noqa: E402, N812
import test_sc_primitives as P  # noqa: E402, N812

from pallas_core.emulation import api  # noqa: E402
from pallas_core.emulation.call import EmulateOptions  # noqa: E402
from pallas_core.emulation.machine import Compiler  # noqa: E402
from pallas_core.emulation.types import dtype_of, shape_of  # noqa: E402

L = 16


def emulate(fn: Any, **kwargs: Any) -> Any:
    return pl.emulate(fn, backend="sparsecore", **kwargs)


def assert_matches(got: Any, want: Any, rtol: float = 1e-5) -> None:
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol,
                                   atol=rtol)


# --- the example kernels (tests/test_sc_kernels.py, examples/sparsecore.py) ------------------


@pytest.mark.parametrize("name", sorted(KT.CASES))
def test_example_kernel(name: str) -> None:
    fn, args, ref, _ = KT.CASES[name]
    a = args()
    got = emulate(functools.partial(fn, target="v7x"))(*a)
    assert_matches(got, ref(*a))
    assert_matches(got, fn(*a, interpret=True))


def test_example_script_sizes() -> None:
    """examples/sparsecore.py's scatter-add: 100 rows, 512 updates over 32 subcores."""
    k = iter(jax.random.split(jax.random.key(0), 3))
    idx = jax.random.randint(next(k), (512,), 0, 100)
    grads = jax.random.normal(next(k), (512, 128))
    fn = functools.partial(plsc.kernels.scatter_add, num_rows=100, target="v7x")
    assert_matches(emulate(fn)(grads, idx), jnp.zeros((100, 128)).at[idx].add(grads))


def test_v5p_mesh_of_four_cores_and_eight_lanes() -> None:
    keys, vals = KT._ints(8, (128, 8), 100), KT._normal(9, (128, 8))
    got = emulate(functools.partial(plsc.kernels.sort_key_val, target="v5p"))(keys, vals)
    assert_matches(got, KT._stable_sort(keys, vals))


def test_descending_sort_and_a_small_mesh() -> None:
    keys, vals = KT._ints(12, (32, 16), 5), KT._normal(13, (32, 16))
    got = emulate(functools.partial(plsc.kernels.sort_key_val, descending=True))(keys, vals)
    assert_matches(got, KT._stable_sort(keys, vals, descending=True))
    table, idx = KT._normal(11, (32, 128)), KT._ints(10, (64,), 32)
    got = emulate(functools.partial(plsc.kernels.embedding_lookup, num_cores=1,
                                    num_subcores=4))(table, idx)
    assert_matches(got, table[idx])


# --- every primitive (tests/test_sc_primitives.py) -------------------------------------------


@pytest.mark.parametrize("name", sorted(P.CASES))
def test_primitive(name: str) -> None:
    body, ins, ref, _ = P.CASES[name]
    outs = P._OUT_SHAPES.get(name, [jnp.zeros((L,), ins[0].dtype)])
    got = emulate(lambda *a: P.run(body, list(a), outs, interpret=False))(*ins)
    interpreted = P.run(body, ins, outs, interpret=True)
    want = ref(*ins)
    want = want if isinstance(want, tuple) else (want,)
    for g, w, i in zip(got, want, interpreted):
        g, w, i = np.asarray(g), np.asarray(w), np.asarray(i)
        if name == "sort_key_val" and g.shape != np.shape(w):  # only kept lanes are defined
            g, i = g[:np.shape(w)[0]], i[:np.shape(w)[0]]
        np.testing.assert_allclose(g.astype(np.float64), np.asarray(w, np.float64), rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_allclose(g.astype(np.float64), i.astype(np.float64), rtol=1e-6,
                                   atol=1e-6)


def _masked_cases() -> dict[str, Any]:
    """Masked and integer variants the primitive tests do not cover."""
    x, m = P.X, P.M.astype(jnp.int32)
    xi = P.rand(20, jnp.int32, lo=-3, hi=3)

    def gather(t, i, m, o):
        v = plsc.load_gather(t, [lax.rem(i[...], 4), i[...] % L], mask=m[...] != 0)
        o[...] = jnp.where(m[...] != 0, v, -1.0)

    def gather_ref(t, i, m):
        return jnp.where(m != 0, t[i % 4, i % L], -1.0)

    def add_compressed(x, m, o):
        o[...] = jnp.full((L,), 1.0, jnp.float32)
        plsc.addupdate_compressed(o, x[...], mask=m[...] != 0)

    def add_compressed_ref(x, m):
        keep = np.asarray(m) != 0
        out = np.ones(L, np.float32)
        out[:keep.sum()] += np.asarray(x)[keep]
        return out

    def cumsum_int(x, m, o):
        o[...] = plsc.cumsum(x[...], mask=m[...] != 0)

    def cummax_float(x, m, o):
        o[...] = plsc.cummax(x[...], mask=m[...] != 0)

    def cummax_float_ref(x, m):
        keep = m != 0
        run_ = lax.cummax(jnp.where(keep, x, -jnp.inf))
        return jnp.where(jnp.cumsum(keep) > 0, run_, x)

    def sort_desc(k, v, m, ok, ov):
        sk, sv, sm = plsc.sort_key_val(k[...], v[...], mask=m[...] != 0, descending=True)
        ok[...], ov[...] = jnp.where(sm, sk, 0), jnp.where(sm, sv, 0.0)

    def sort_desc_ref(k, v, m):
        keep = np.asarray(m) != 0
        order = np.argsort(-np.asarray(k)[keep], kind="stable")
        n = keep.sum()
        ks, vs = np.zeros(L, np.int32), np.zeros(L, np.float32)
        ks[:n], vs[:n] = np.asarray(k)[keep][order], np.asarray(v)[keep][order]
        return ks, vs

    def counts(k, m, o1, o2):
        c, last = plsc.scan_count(k[...], mask=m[...] != 0)
        o1[...], o2[...] = c, last.astype(jnp.int32)

    def counts_ref(k, m):
        k, keep = np.asarray(k), np.asarray(m) != 0
        c = np.array([(k[:i + 1][keep[:i + 1]] == k[i]).sum() if keep[i] else 1
                      for i in range(L)])
        last = np.array([keep[i] and not (k[i + 1:][keep[i + 1:]] == k[i]).any()
                         for i in range(L)])
        return c, last.astype(np.int32)

    def pack_compressed(x, y, o):
        ab = plsc.pack(x[...], y[...], format=plsc.PackFormat.COMPRESSED)
        a, b = plsc.unpack(ab, format=plsc.PackFormat.COMPRESSED)
        o[...] = a - b

    def bits(x, o):
        o[...] = plsc.bitcast(plsc.bitcast(x[...], jnp.int8) + 1, jnp.int32)

    def bits_ref(x):
        return (np.asarray(x).view(np.int8) + 1).astype(np.int8).view(np.int32)

    table = P.TABLE
    idx = P.rand(21, jnp.int32, lo=0, hi=64)
    bf = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    return {
        "masked_gather": (gather, [table, idx, m], gather_ref, [x]),
        "addupdate_compressed": (add_compressed, [x, m], add_compressed_ref, [x]),
        "cumsum_int": (cumsum_int, [xi, m], lambda x, m: jnp.cumsum(jnp.where(m != 0, x, 0)),
                       [xi]),
        "cummax_float": (cummax_float, [x, m], cummax_float_ref, [x]),
        "sort_descending_masked": (sort_desc, [P.KEYS, P.VALS, m], sort_desc_ref,
                                   [P.KEYS, P.VALS]),
        "scan_count_masked": (counts, [P.KEYS, m], counts_ref, [P.KEYS, P.KEYS]),
        "pack_compressed": (pack_compressed, [x, P.rand(7)], lambda x, y: bf(x) - bf(y), [x]),
        "bitcast": (bits, [P.XI], bits_ref, [P.XI]),
    }


MASKED = _masked_cases()


@pytest.mark.parametrize("name", sorted(MASKED))
def test_masked_and_integer_variants(name: str) -> None:
    body, ins, ref, outs = MASKED[name]
    outs = [jnp.zeros_like(o) for o in outs]
    got = emulate(lambda *a: P.run(body, list(a), outs, interpret=False))(*ins)
    want = ref(*ins)
    want = want if isinstance(want, tuple) else (want,)
    for g, w, i in zip(got, want, P.run(body, ins, outs, interpret=True)):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(i, np.float64),
                                   rtol=1e-6, atol=1e-6)


# --- barriers (tests/test_sc_barrier.py) -----------------------------------------------------


@pytest.mark.parametrize("cores,subcores", [(1, 2), (2, 4), (2, 16)])
def test_subcores_exchange_rows_through_shared_vmem(cores: int, subcores: int) -> None:
    x = B.rand(cores * 10 + subcores, (cores * subcores, L))
    got = emulate(B.rotate(cores, subcores, interpret=False))(x)
    np.testing.assert_allclose(got, B.rotate_reference(x, cores, subcores), rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_shuffled_subcore_order_gives_the_same_result(seed: int) -> None:
    x = B.rand(seed, (8, L))
    got = emulate(B.rotate(2, 4, interpret=False), seed=seed)(x)
    np.testing.assert_allclose(got, B.rotate_reference(x, 2, 4), rtol=1e-6)


@pytest.mark.parametrize("cores,subcores", [(1, 4), (2, 8)])
def test_barriers_inside_a_loop(cores: int, subcores: int) -> None:
    x = jax.random.randint(jax.random.key(7), (cores * subcores, L), -1000, 1000, jnp.int32)
    got = emulate(B.ring_sum(cores, subcores))(x)
    sums = np.asarray(x).reshape(cores, subcores, L).sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(
        got, np.broadcast_to(sums, (cores, subcores, L)).reshape(-1, L))


def test_shared_vmem_from_run_scoped_is_one_buffer_per_core() -> None:
    x = B.rand(9, (8, L))
    np.testing.assert_array_equal(emulate(B.reverse_in_scope())(x), B.reversed_rows(x))
    guarded = B.reverse_in_scope(barrier_when=lambda c, s: c < 2)
    np.testing.assert_array_equal(emulate(guarded)(x), B.reversed_rows(x))


@pytest.mark.parametrize("kernel", ["loop", "cond"])
def test_a_barrier_some_subcores_never_reach_is_reported(kernel: str) -> None:
    fn = B.ring_sum(1, 4, trips=lambda s: s + 1) if kernel == "loop" else \
        B.reverse_in_scope(barrier_when=lambda c, s: s == 0)
    with pytest.raises(pl.PallasError, match=r"the SparseCore kernel would hang: "
                       r"subcores .* wait at a barrier.*Fix"):
        jax.block_until_ready(emulate(fn)(B.rand(8, (4 if kernel == "loop" else 8, L))))


def test_shuffled_order_exposes_a_race_within_a_phase() -> None:
    x = B.rand(12, (4, L))
    results = [np.asarray(emulate(B.racy(0, "interpret"), seed=s)(x)) for s in range(6)]
    assert any(not np.array_equal(results[0], r) for r in results[1:])


def test_shared_vmem_nobody_wrote_is_garbage() -> None:
    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=B.mesh(1, 4),
                   scratch_types=[plsc.VMEM_SHARED((4, L), x.dtype), pltpu.VMEM((L,), x.dtype)])
        def k(x_hbm, o_hbm, shared, v):
            s = lax.axis_index("s")
            pltpu.sync_copy(x_hbm.at[s], v)

            @pl.when(s % 2 == 0)
            def _():
                pltpu.sync_copy(v, shared.at[s])

            plsc.subcore_barrier()
            pltpu.sync_copy(shared.at[(s + 1) % 4], o_hbm.at[s])
        return k(x)

    x = B.rand(13, (4, L))
    got = np.asarray(emulate(fn)(x))
    np.testing.assert_array_equal(got[[1, 3]], np.asarray(x)[[2, 0]])
    assert np.isnan(got[[0, 2]]).all()


def test_out_of_bounds_read_is_reported() -> None:
    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct((4, L), x.dtype), mesh=B.mesh(1, 4),
                   scratch_types=[pltpu.VMEM((2 * L,), x.dtype), pltpu.VMEM((L,), x.dtype)])
        def k(x_hbm, o_hbm, v, w):
            s = lax.axis_index("s")
            pltpu.sync_copy(x_hbm, v)
            w[...] = v[pl.ds(s * 8, L)]  # subcore 3 reads past the end of v
            pltpu.sync_copy(w, o_hbm.at[s])
        return k(x)

    with pytest.raises(pl.PallasError, match=r"indices 24\.\.39 of dimension 0 .* out of bounds"):
        jax.block_until_ready(emulate(fn)(B.rand(14, (2 * L,))))


# --- the modules jax.experimental.pallas emits (tests/test_sc_differential.py) ---------------


def _iota(c: Compiler, op: Any) -> Any:
    shape, dtype = shape_of(op.results[0].type), dtype_of(op.results[0].type)
    d = int(op.attributes["iota_dimension"].value)
    value = np.broadcast_to(np.arange(shape[d]).reshape(
        [-1 if k == d else 1 for k in range(len(shape))]), shape).astype(dtype)
    return lambda: value


def emulate_jax(fn: Any, *args: Any) -> tuple[np.ndarray, ...]:
    """``fn`` (a ``jax.experimental.pallas`` SparseCore kernel) lowered by JAX for a v7x and
    its StableHLO run with the custom call emulated (pl.emulate does not run JAX's
    ``pl.kernel``/``core_map``)."""
    D = pytest.importorskip("test_sc_differential")
    with jax.sharding.use_abstract_mesh(D._abstract_mesh()):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
    module = lowered.compiler_ir("stablehlo")
    kernel = types.SimpleNamespace(options=EmulateOptions(backend="sparsecore"), name="jax",
                                   mesh_shape=(), devices=1, here=types.SimpleNamespace())
    with module.context:
        rules = {**api._glue_rules(kernel), "stablehlo.iota": _iota}  # type: ignore[arg-type]
        main = Compiler(rules, backend="sparsecore program", module=module).function("main")
        return main(*[np.asarray(a) for a in args])


@pytest.mark.parametrize("name", sorted(KT.CASES))
def test_module_jax_emits(name: str) -> None:
    D = pytest.importorskip("test_sc_differential")
    _, args, ref, _ = KT.CASES[name]
    a = args()
    if name in D.PER_CORE:  # the emulator runs the kernel; the cores' totals are summed here
        (per_core,) = emulate_jax(functools.partial(D.CASES[name][1], per_core=True), *a)
        got: Any = (per_core.sum(axis=0),)
    else:
        got = emulate_jax(D.CASES[name][1], *a)
    assert_matches(got, ref(*a))


def _jax_primitives() -> Any:
    """``jax.experimental.pallas.tpu_sc`` standing in for ``plsc`` in the primitive cases (its
    contiguous accesses take a Ref view, so the whole Ref is passed as ``ref.at[...]``)."""
    jplsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")

    def viewed(fn: Any) -> Any:
        return lambda ref, *a, **k: fn(ref.at[...], *a, **k)

    whole = ("load_expanded", "store_compressed", "addupdate", "addupdate_compressed")
    return types.SimpleNamespace(**{**vars(jplsc),
                                    **{n: viewed(getattr(jplsc, n)) for n in whole}})


def jax_run(body: Any, ins: list[Any], outs: list[Any]) -> Any:
    """test_sc_primitives.run written with jax.experimental.pallas (one vector subcore)."""
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu

    jplsc = _jax_primitives()
    mesh = jplsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                   num_subcores=1)

    @jpl.kernel(out_type=tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs),
                mesh=mesh, scratch_types=[jpltpu.VMEM(a.shape, a.dtype) for a in [*ins, *outs]])
    def k(*refs: Any) -> None:
        n = len(ins)
        hbm_in, hbm_out, vmem = refs[:n], refs[n:n + len(outs)], refs[n + len(outs):]
        for h, v in zip(hbm_in, vmem[:n]):
            jpltpu.sync_copy(h, v)
        saved, P.plsc = P.plsc, jplsc  # the case bodies call plsc.<primitive>
        try:
            body(*vmem)
        finally:
            P.plsc = saved
        for h, v in zip(hbm_out, vmem[n:]):
            jpltpu.sync_copy(v, h)
    return k(*ins)


@pytest.mark.parametrize("name", sorted(P.CASES))
def test_primitive_module_jax_emits(name: str) -> None:
    if name == "pack_unpack" and tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 11):
        pytest.xfail("JAX 0.11's own lowering refuses plsc.pack with needs_layout_passes=True "
                     "(it asks for astype instead), so it emits no module to emulate")
    body, ins, ref, _ = P.CASES[name]
    outs = P._OUT_SHAPES.get(name, [jnp.zeros((L,), ins[0].dtype)])
    got = emulate_jax(lambda *a: jax_run(body, list(a), outs), *ins)
    want = ref(*ins)
    for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
        g = np.asarray(g)[:np.shape(w)[0]]  # a masked sort defines its kept lanes only
        np.testing.assert_allclose(g.astype(np.float64), np.asarray(w, np.float64),
                                   rtol=1e-6, atol=1e-6)


# --- the scalar subcores ---------------------------------------------------------------------


def test_scalar_subcore_kernel_with_smem() -> None:
    mesh = plsc.ScalarSubcoreMesh(axis_name="c", num_cores=2, target="v7x")

    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh,
                   scratch_types=[pltpu.SMEM((8,), x.dtype)])
        def k(x_hbm, o_hbm, s):
            c = lax.axis_index("c")
            pltpu.sync_copy(x_hbm.at[c], s)

            @pl.loop(0, 8)
            def _(i):
                s[i] = s[i] * 2 + c

            pltpu.sync_copy(s, o_hbm.at[c])
        return k(x)

    x = jax.random.randint(jax.random.key(0), (2, 8), -100, 100, jnp.int32)
    np.testing.assert_array_equal(emulate(fn)(x), np.asarray(x) * 2 + np.arange(2)[:, None])


def test_an_unknown_target_is_refused_as_pl_stages_refuses_it() -> None:
    """``pl.emulate`` ran any target before (issue 34); now it names the chips, as
    ``pl.stages`` does."""
    def fn(x):
        @pl.kernel(out_type=jax.ShapeDtypeStruct((4, L), x.dtype), mesh=B.mesh(1, 4))
        def k(x_hbm, o_hbm):
            s = lax.axis_index("s")
            pltpu.sync_copy(x_hbm.at[s], o_hbm.at[s])
        return k(x)

    x = B.rand(15, (4, L))
    with pytest.raises(pl.PallasError, match=r"pl.emulate\(backend='sparsecore', target='v99'\)"
                       r": unknown chip. Fix: use one of"):
        jax.block_until_ready(emulate(fn, target="v99")(x))
    with pytest.raises(pl.PallasError, match=r"pl.stages\(backend='sparsecore', target='v99'\)"):
        pl.stages(fn, x, backend="sparsecore", target="v99")[0]["mosaic"]
    np.testing.assert_array_equal(np.asarray(emulate(fn)(x)), np.asarray(x))
