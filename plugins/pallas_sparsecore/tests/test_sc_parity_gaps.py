"""What closed the SparseCore rule-parity gaps (``tests/test_sc_rule_parity.py``):
``plsc.cummin`` (JAX's ``masked_cummin``), ``lax.rev`` of a register, ``plsc.scan_count``
(JAX 0.10 names its primitive ``unique``), ``pltpu.get_barrier_semaphore()`` and
``pltpu.emit_pipeline`` on the vector subcores.

Each runs in the interpreter and, lowered for a v7x and run by the SparseCore emulator,
matches ``jax.numpy`` on random inputs of every dtype JAX's rule takes; each lowers to the
operations (and their attributes) JAX's own SparseCore lowering emits for the same kernel,
lowered on this host under an abstract ``TPU7x`` mesh; and JAX's module, run by the emulator,
gives the same result.
"""

from __future__ import annotations

import collections
import functools
import types
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import backend as plb

plsc = pytest.importorskip("pallas_sparsecore")
jplsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")
import pallas_mosaic_tpu as pltpu  # noqa: E402
import test_sc_differential as D  # noqa: E402, N812
import test_sc_emulator as E  # noqa: E402, N812
import test_sc_primitives as P  # noqa: E402, N812
from jax.experimental import pallas as jpl  # noqa: E402
from jax.experimental.pallas import tpu as jpltpu  # noqa: E402
from pallas_mosaic_tpu import inspection  # noqa: E402

L = 16
DTYPES = [jnp.int32, jnp.uint32, jnp.float32]
"""What JAX's ``masked_cummin`` and SparseCore ``lax.rev`` take (32-bit lanes)."""


def rand(seed: int, dtype: Any) -> jax.Array:
    """One register of ``dtype``: integers over their whole range (the sign bit matters to
    the unsigned hardware comparison), floats normal."""
    key = jax.random.key(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return lax.bitcast_convert_type(jax.random.bits(key, (L,), jnp.uint32), dtype)
    return jax.random.normal(key, (L,), dtype)


def few(seed: int, dtype: Any) -> jax.Array:
    """One register of small values with repeats (ties in running minima)."""
    return jax.random.randint(jax.random.key(seed), (L,), 0, 5, jnp.int32).astype(dtype)


# --- lowering both sides -------------------------------------------------------------------


def ours_module(fn: Any, *args: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (config, module), = inspection.kernels(text)
    return config, module


def jax_module(fn: Any, *args: Any) -> tuple[dict[str, Any], Any]:
    with jax.sharding.use_abstract_mesh(D._abstract_mesh()):
        return ours_module(fn, *args)


def ops(module: Any, names: tuple[str, ...], attrs: tuple[str, ...] = ()) -> list[Any]:
    """The kernel's operations named ``names`` in order, with the attributes ``attrs``."""
    return [(op.name, *(str(op.attributes[a]) for a in attrs if a in op.attributes))
            for op in D._walk(D._kernel_func(module)) if op.name in names]


def jax_run(body: Any, ns: Any, ins: list[Any], outs: list[Any], **kernel: Any) -> Any:
    """``body(ns, *in_vmem, *out_vmem)`` written with ``jax.experimental.pallas`` on one vector
    subcore, as ``test_sc_primitives.run`` writes ours."""
    mesh = jplsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                   num_subcores=1)

    @jpl.kernel(out_type=tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs),
                mesh=mesh, scratch_types=[jpltpu.VMEM(a.shape, a.dtype) for a in [*ins, *outs]],
                **kernel)
    def k(*refs: Any) -> None:
        n = len(ins)
        hbm_in, hbm_out, vmem = refs[:n], refs[n:n + len(outs)], refs[n + len(outs):]
        for h, v in zip(hbm_in, vmem[:n]):
            jpltpu.sync_copy(h, v)
        body(ns, *vmem)
        for h, v in zip(hbm_out, vmem[n:]):
            jpltpu.sync_copy(v, h)
    return k(*ins)


def ours_run(body: Any, ins: list[Any], outs: list[Any], interpret: bool) -> Any:
    return P.run(functools.partial(body, plsc), ins, outs, interpret=interpret)


def check_everywhere(body: Any, ns: Any, ins: list[Any], want: Any,
                     names: tuple[str, ...], attrs: tuple[str, ...] = ()) -> None:
    """Interpreter, our module emulated, JAX's module emulated: all ``want``; our module's
    operations ``names`` (with ``attrs``) are JAX's."""
    outs = [jnp.zeros(np.shape(want), np.asarray(want).dtype)]
    want = np.asarray(want)
    (interpreted,) = ours_run(body, ins, outs, interpret=True)
    np.testing.assert_array_equal(np.asarray(interpreted), want)
    ours = functools.partial(ours_run, body, outs=outs, interpret=False)
    (emulated,) = pl.emulate(lambda *a: ours(list(a)), backend="sparsecore")(*ins)
    np.testing.assert_array_equal(np.asarray(emulated), want)
    theirs = functools.partial(jax_run, body, ns, outs=outs)
    (jax_emulated,) = E.emulate_jax(lambda *a: theirs(list(a)), *ins)
    np.testing.assert_array_equal(np.asarray(jax_emulated), want)
    _, ours_mod = ours_module(lambda *a: ours(list(a)), *ins)
    _, jax_mod = jax_module(lambda *a: theirs(list(a)), *ins)
    found = ops(ours_mod, names, attrs)
    assert found and found == ops(jax_mod, names, attrs)


# --- plsc.cummin: JAX's masked_cummin ------------------------------------------------------


def _jax_cummin_namespace() -> Any:
    """JAX binds ``masked_cummin`` (not exported by ``tpu_sc``) with a full mask when none."""
    prim = plb.jax_mosaic_primitive("sc_vector_subcore", "masked_cummin")
    if prim is None:
        pytest.skip("this JAX has no SparseCore masked_cummin")

    def cummin(x: Any, *, mask: Any = None) -> Any:
        return prim.bind(x, lax.full(x.shape, True) if mask is None else mask)
    return types.SimpleNamespace(cummin=cummin)


def cummin_reference(x: Any, keep: Any) -> np.ndarray:
    """The running minimum over the kept lanes; lanes before the first kept one keep their
    own value."""
    x, keep = np.asarray(x), np.asarray(keep, bool)
    out, best = x.copy(), None
    for i in range(x.size):
        if keep[i]:
            best = x[i] if best is None else min(best, x[i])
        if best is not None:
            out[i] = best
    return out


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cummin(dtype: Any, masked: bool) -> None:
    x = rand(10, dtype) if masked else few(11, dtype)
    keep = P.M if masked else jnp.ones((L,), bool)

    def body(ns: Any, x_ref: Any, m_ref: Any, o_ref: Any) -> None:
        o_ref[...] = ns.cummin(x_ref[...], mask=(m_ref[...] != 0) if masked else None)

    check_everywhere(body, _jax_cummin_namespace(), [x, keep.astype(jnp.int32)],
                     cummin_reference(x, keep), ("tpu.scan", "arith.xori"), ("kind",))


def test_cummin_is_checked() -> None:
    with pytest.raises(pl.PallasError, match=r"plsc\.cummin: x must have dtype"):
        jax.jit(lambda x: plsc.cummin(x)).trace(jnp.zeros((L,), jnp.int16))
    short = jnp.zeros((8,), jnp.int32)

    def body(ns: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = ns.cummin(x_ref[...])

    with pytest.raises(pl.PallasError, match=r"plsc.cummin got a vector of shape \(8,\)"):
        ours_run(body, [short], [short], interpret=False)


# --- lax.rev of one register -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rev(dtype: Any) -> None:
    x = rand(20, dtype)

    def body(ns: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = lax.rev(x_ref[...], (0,))

    check_everywhere(body, None, [x], np.asarray(x)[::-1],
                     ("tpu.iota", "arith.subi", "tpu.dynamic_gather"), ("dimensions",))


def test_rev_of_other_than_one_register_is_unsupported() -> None:
    x = jnp.zeros((2, L), jnp.float32)

    def body(ns: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = lax.rev(x_ref[...], (1,))

    with pytest.raises(pl.UnsupportedError, match=r"lax.rev of float32\[2, 16\] along \(1,\)"):
        ours_module(lambda a: ours_run(body, [a], [x], interpret=False), x)
    np.testing.assert_array_equal(ours_run(body, [x], [x], interpret=True)[0], x[:, ::-1])


# --- plsc.scan_count: JAX 0.10's "unique" ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_scan_count_lowers_as_jax(dtype: Any) -> None:
    """At JAX 0.10 ``tpu_sc.scan_count`` binds the primitive named ``unique``."""
    x = few(30, dtype)

    def body(ns: Any, x_ref: Any, o_ref: Any) -> None:
        counts, last = ns.scan_count(x_ref[...])
        o_ref[...] = counts * 2 + last.astype(jnp.int32)

    v = np.asarray(x)
    counts = np.array([(v[:i + 1] == v[i]).sum() for i in range(L)])
    last = np.array([not (v[i + 1:] == v[i]).any() for i in range(L)])
    check_everywhere(body, jplsc, [x], (counts * 2 + last).astype(np.int32),
                     ("tpu.scan_count",))


# --- pltpu.get_barrier_semaphore() ---------------------------------------------------------


def barrier_kernel(p: Any, mesh: Any, params: Any, n: int, **kw: Any) -> Any:
    """Each subcore signals its barrier semaphore ``s + 1`` times over, records what it reads,
    then waits it back to zero (``p``: ``pl`` or ``jax.experimental.pallas``; ``mesh()``
    makes the mesh, which JAX's makes only under the abstract mesh)."""
    ltpu = pltpu if p is pl else jpltpu

    def fn(x: Any) -> Any:
        @p.kernel(out_type=jax.ShapeDtypeStruct((n, 1), jnp.int32), mesh=mesh(),
                  compiler_params=params, scratch_types=[ltpu.SMEM((1,), jnp.int32)], **kw)
        def k(x_hbm: Any, o_hbm: Any, seen: Any) -> None:
            s = lax.axis_index("s")
            sem = ltpu.get_barrier_semaphore()
            p.semaphore_signal(sem, s + 1)
            seen[0] = p.semaphore_read(sem) + x_hbm.shape[0] * 0
            p.semaphore_wait(sem, s + 1)
            ltpu.sync_copy(seen, o_hbm.at[s])
        return k(x)
    return fn


def test_barrier_semaphore() -> None:
    x = jnp.zeros((4,), jnp.int32)
    mesh = functools.partial(plsc.VectorSubcoreMesh, core_axis_name="c",
                             subcore_axis_name="s", num_cores=1, num_subcores=2,
                             target="v7x")
    ours = barrier_kernel(pl, mesh, plsc.CompilerParams(collective_id=3), 2)
    want = np.array([[1], [2]], np.int32)
    np.testing.assert_array_equal(pl.emulate(ours, backend="sparsecore")(x), want)
    interpret = barrier_kernel(pl, mesh, plsc.CompilerParams(collective_id=3), 2,
                               interpret=True)
    np.testing.assert_array_equal(interpret(x), want)
    jax_mesh = functools.partial(jplsc.VectorSubcoreMesh, core_axis_name="c",
                                 subcore_axis_name="s", num_cores=1, num_subcores=2)
    theirs = barrier_kernel(jpl, jax_mesh, jpltpu.CompilerParams(collective_id=3), 2)
    (got,) = E.emulate_jax(theirs, x)
    np.testing.assert_array_equal(got, want)
    ours_config, ours_mod = ours_module(ours, x)
    jax_config, jax_mod = jax_module(theirs, x)
    assert ours_config["custom_call_config"]["collective_id"] == 3
    assert (ours_config["custom_call_config"]["collective_id"]
            == jax_config["custom_call_config"]["collective_id"])
    names = ("tpu.sem_barrier", "tpu.sem_signal", "tpu.sem_read", "tpu.sem_wait")
    assert ops(ours_mod, names) == ops(jax_mod, names)
    assert [str(op.results[0].type) for op in D._walk(D._kernel_func(ours_mod))
            if op.name == "tpu.sem_barrier"] == \
        [str(op.results[0].type) for op in D._walk(D._kernel_func(jax_mod))
         if op.name == "tpu.sem_barrier"]


def test_barrier_semaphore_needs_a_collective_id_and_waits_are_checked() -> None:
    x = jnp.zeros((4,), jnp.int32)
    mesh = functools.partial(plsc.VectorSubcoreMesh, core_axis_name="c",
                             subcore_axis_name="s", num_cores=1, num_subcores=2,
                             target="v7x")
    with pytest.raises(pl.PallasError, match=r"collective_id=0"):
        ours_module(barrier_kernel(pl, mesh, None, 2), x)

    def fn(x: Any) -> Any:
        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh(),
                   compiler_params=plsc.CompilerParams(collective_id=0))
        def k(x_hbm: Any, o_hbm: Any) -> None:
            sem = pltpu.get_barrier_semaphore()
            pl.semaphore_signal(sem, 1)
            pl.semaphore_wait(sem, 2)  # nothing else signals it here: the chip would hang
            pltpu.sync_copy(x_hbm, o_hbm)
        return k(x)

    with pytest.raises(pl.PallasError, match="would hang"):
        jax.block_until_ready(pl.emulate(fn, backend="sparsecore")(x))


# --- pltpu.emit_pipeline on the vector subcores ------------------------------------------


def pipeline_kernel(p: Any, mesh: Any, shape: tuple[int, int], dtype: Any, rows: int,
                    kernel: Any = None, **pipeline: Any) -> Any:
    """``out = 2 * x + y`` by blocks of ``rows`` rows, row by row in the body."""
    ltpu = pltpu if p is pl else jpltpu

    def fn(x: Any, y: Any) -> Any:
        @p.kernel(out_type=jax.ShapeDtypeStruct(shape, dtype), mesh=mesh(), **(kernel or {}))
        def k(x_hbm: Any, y_hbm: Any, o_hbm: Any) -> None:
            def body(x_v: Any, y_v: Any, o_v: Any) -> None:
                @p.loop(0, rows)
                def _(r: Any) -> None:
                    o_v[r] = x_v[r] * 2 + y_v[r]

            spec = p.BlockSpec((rows, shape[1]), lambda i: (i, 0))
            ltpu.emit_pipeline(body, grid=(shape[0] // rows,), in_specs=[spec, spec],
                               out_specs=[spec], **pipeline)(x_hbm, y_hbm, o_hbm)
        return k(x, y)
    return fn


def _pipeline_args(dtype: Any, shape: tuple[int, int]) -> list[Any]:
    k = jax.random.split(jax.random.key(40), 2)
    if jnp.issubdtype(dtype, jnp.integer):
        return [jax.random.randint(key, shape, -1000, 1000, jnp.int32).astype(dtype)
                for key in k]
    return [jax.random.normal(key, shape, dtype) for key in k]


@pytest.mark.parametrize("dtype", DTYPES)
def test_emit_pipeline_split_over_subcores(dtype: Any) -> None:
    shape = (128, L)
    x, y = _pipeline_args(dtype, shape)
    mesh = functools.partial(plsc.VectorSubcoreMesh, core_axis_name="c",
                             subcore_axis_name="s", num_cores=1, num_subcores=4,
                             target="v7x")
    fn = pipeline_kernel(pl, mesh, shape, dtype, 8, core_axis_name="s",
                         dimension_semantics=(pltpu.PARALLEL,))
    want = np.asarray(x * 2 + y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", plsc.SparseCorePushStreamWarning)
        np.testing.assert_array_equal(pl.emulate(fn, backend="sparsecore")(x, y), want)
        interpreted = pipeline_kernel(pl, mesh, shape, dtype, 8, {"interpret": True},
                                      core_axis_name="s", dimension_semantics=(pltpu.PARALLEL,))
        np.testing.assert_array_equal(interpreted(x, y), want)


PIPELINE_OPS = ("tpu.enqueue_dma", "tpu.wait_dma", "tpu.wait_dma2", "scf.for")


def _pipeline_structure(module: Any) -> Any:
    """The DMAs, loops and buffers (VMEM blocks, DMA semaphores) of a pipeline, unordered."""
    found: collections.Counter[Any] = collections.Counter(ops(module, PIPELINE_OPS))
    found.update((op.name, str(op.results[0].type)) for op in D._walk(D._kernel_func(module))
                 if op.name in ("memref.alloca", "tpu.sem_alloc"))
    return found


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_emit_pipeline_lowers_as_jax(dtype: Any) -> None:
    """One subcore: both modules fetch the first blocks, then per step wait, prefetch and
    write back, from double buffers; JAX's module emulated gives the same result."""
    shape = (64, L)
    x, y = _pipeline_args(dtype, shape)
    mesh = functools.partial(plsc.VectorSubcoreMesh, core_axis_name="c",
                             subcore_axis_name="s", num_cores=1, num_subcores=1,
                             target="v7x")
    jax_mesh = functools.partial(jplsc.VectorSubcoreMesh, core_axis_name="c",
                                 subcore_axis_name="s", num_cores=1, num_subcores=1)
    ours = pipeline_kernel(pl, mesh, shape, dtype, 8)
    theirs = pipeline_kernel(jpl, jax_mesh, shape, dtype, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", plsc.SparseCorePushStreamWarning)
        warnings.simplefilter("ignore", getattr(jplsc, "SparseCorePushStreamWarning",
                                                UserWarning))
        (got,) = E.emulate_jax(theirs, x, y)
        np.testing.assert_array_equal(got, np.asarray(x * 2 + y))
        np.testing.assert_array_equal(pl.emulate(ours, backend="sparsecore")(x, y), got)
        ours_mod, jax_mod = ours_module(ours, x, y)[1], jax_module(theirs, x, y)[1]
    wait = "tpu.wait_dma2" if "tpu.wait_dma2" in str(ours_mod) else "tpu.wait_dma"
    theirs_found = _pipeline_structure(jax_mod)
    if wait != "tpu.wait_dma" and ("tpu.wait_dma",) in theirs_found:  # as each JAX waits
        theirs_found[(wait,)] = theirs_found.pop(("tpu.wait_dma",))
    assert _pipeline_structure(ours_mod) == theirs_found


# --- plsc.fetch_and_add in the emulator ---------------------------------------------------


def fetch_add_kernel(p: Any, sc: Any, mesh: Any, other: bool, **kw: Any) -> Any:
    """Subcore ``s`` starts its SMEM counter at ``10 * s``; after a barrier it adds ``s + 1``
    twice to its own counter (or, with ``other``, to the next subcore's); after another it
    writes what the adds returned and its counter."""
    ltpu = pltpu if p is pl else jpltpu

    def fn(x: Any) -> Any:
        @p.kernel(out_type=jax.ShapeDtypeStruct((4, L), jnp.int32), mesh=mesh(),
                  scratch_types=[ltpu.SMEM((1,), jnp.int32), ltpu.VMEM((L,), jnp.int32)], **kw)
        def k(x_hbm: Any, o_hbm: Any, counter: Any, row: Any) -> None:
            s = lax.axis_index("s")
            counter[0] = s * 10
            sc.subcore_barrier()
            target = lax.rem(s + 1, 4) if other else s
            first = sc.fetch_and_add(counter, s + 1, subcore_id=target)
            second = sc.fetch_and_add(counter.at[0], s + 1, subcore_id=target)
            sc.subcore_barrier()
            lanes = lax.broadcasted_iota(jnp.int32, (L,), 0)
            row[...] = jnp.where(lanes == 0, first, jnp.where(lanes == 1, second, counter[0]))
            ltpu.sync_copy(row, o_hbm.at[s])
        return k(x)
    return fn


@pytest.mark.parametrize("other", [False, True])
def test_fetch_and_add_emulated(other: bool) -> None:
    x = jnp.zeros((4,), jnp.int32)
    s = np.arange(4)
    target, source = ((s + 1) % 4, (s - 1) % 4) if other else (s, s)
    want = np.stack([10 * target, 10 * target + s + 1, 10 * s + 2 * (source + 1)], axis=1)
    mesh = functools.partial(plsc.VectorSubcoreMesh, core_axis_name="c",
                             subcore_axis_name="s", num_cores=1, num_subcores=4,
                             target="v7x")
    ours = fetch_add_kernel(pl, plsc, mesh, other)
    for seed in (None, 1):
        got = pl.emulate(ours, backend="sparsecore", seed=seed)(x)
        np.testing.assert_array_equal(np.asarray(got)[:, :3], want)
    if not other:  # the interpreter adds only to the caller's own SMEM
        interpreted = fetch_add_kernel(pl, plsc, mesh, other, interpret=True)(x)
        np.testing.assert_array_equal(np.asarray(interpreted)[:, :3], want)
    jax_mesh = functools.partial(jplsc.VectorSubcoreMesh, core_axis_name="c",
                                 subcore_axis_name="s", num_cores=1, num_subcores=4)
    theirs = fetch_add_kernel(jpl, jplsc, jax_mesh, other)
    np.testing.assert_array_equal(E.emulate_jax(theirs, x)[0][:, :3], want)
    names = ("tpu.fetch_and_add_sync", "tpu.barrier")
    assert ops(ours_module(ours, x)[1], names) == ops(jax_module(theirs, x)[1], names)
