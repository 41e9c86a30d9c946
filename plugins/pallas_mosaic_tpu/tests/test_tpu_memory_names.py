"""The memory-space names of ``jax.experimental.pallas.tpu`` and ``.pallas`` (issue 28):
``pltpu.MemorySpace`` as JAX's enum, ``CMEM``, ``VMEM_SHARED``, ``SUBCORE_PARALLEL``,
``dma_semaphore``, ``with_memory_space_constraint``, ``has_memory_space``, ``trace_value``,
``annotate``, ``LoweringException``, ``core``, ``reciprocal``, and the core's ``pl.HOST``,
``pl.semaphore`` and ``pl.select_ref`` in TPU kernels.

Each kernel runs on the interpreter against ``jax.numpy`` on random inputs; lowered for TPU on
CPU its Mosaic module must decode and verify and hold what JAX emits for the same name.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core.testing.deprecations import warns_from

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

F32 = jnp.float32


def _module(f: Any, *args: Any) -> str:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    return str(module)


def _x(shape: tuple[int, ...] = (8, 128), seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


# --- MemorySpace ---------------------------------------------------------------------------


def test_memory_space_is_jaxs_enum() -> None:
    assert [m.name for m in pltpu.MemorySpace] == [m.name for m in jax_pltpu.MemorySpace]
    assert [m.value for m in pltpu.MemorySpace] == [m.value for m in jax_pltpu.MemorySpace]
    for m in jax_pltpu.MemorySpace:
        ours = getattr(pltpu.MemorySpace, m.name)
        assert ours is getattr(pltpu, m.name) is pltpu.MemorySpace(m.value)
        assert pltpu.MemorySpace[m.name] is ours and ours in pltpu.MemorySpace
        assert isinstance(ours, pl.MemorySpace) and isinstance(ours, pltpu.MemorySpace)
    assert len(pltpu.MemorySpace) == len(jax_pltpu.MemorySpace)
    assert pltpu.VMEM.memory_kind == "device"  # JAX 0.12's property
    assert pltpu.MemorySpace.ANY is pl.ANY
    with pytest.raises(ValueError, match="not a valid"):
        pltpu.MemorySpace("nowhere")


@pytest.mark.parametrize("space", ["VMEM", "CMEM", "VMEM_SHARED", "SMEM"])
def test_memory_space_members_make_scratch_that_runs(space: str) -> None:
    mem = getattr(pltpu.MemorySpace, space)
    ref_shape = (8, 128) if space != "SMEM" else (8,)
    x = _x(ref_shape)

    def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
        s_ref[...] = x_ref[...] * 2.0
        o_ref[...] = s_ref[...] + 1.0

    spec = pl.BlockSpec(memory_space=pltpu.SMEM) if space == "SMEM" else pl.BlockSpec(ref_shape)
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(ref_shape, F32), in_specs=[spec],
                       out_specs=spec, scratch_shapes=[mem(ref_shape, F32)], backend="interpret")
    np.testing.assert_allclose(f(x), x * 2.0 + 1.0, rtol=1e-6)
    assert mem.like(x) == mem(ref_shape, F32)


@pytest.mark.parametrize("space", ["CMEM", "VMEM_SHARED"])
def test_cmem_and_vmem_shared_scratch_lower_to_their_mosaic_spaces(space: str) -> None:
    def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), F32),
                       scratch_shapes=[getattr(pltpu, space)((8, 128), F32)])
    text = _module(f, _x())
    assert f"#tpu.memory_space<{getattr(jax_pltpu, space).value}>" in text


def test_subcore_parallel_runs_and_lowers_as_jax_names_it() -> None:
    assert pltpu.SUBCORE_PARALLEL.value == jax_pltpu.SUBCORE_PARALLEL.value
    x = _x((16, 128))
    f = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] - 3.0),
                       jax.ShapeDtypeStruct(x.shape, F32), grid=(2,),
                       in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                       out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       compiler_params=pltpu.CompilerParams(
                           dimension_semantics=(pltpu.SUBCORE_PARALLEL,)))
    np.testing.assert_allclose(_interpret(f, x), x - 3.0)
    assert "#tpu.dimension_semantics<subcore_parallel>" in _module(f, x)


def _interpret(f: Any, *args: Any) -> Any:
    with pltpu.force_tpu_interpret_mode():
        return f(*args)


# --- semaphores ----------------------------------------------------------------------------


def test_semaphore_dtypes_are_jaxs_kinds() -> None:
    assert jnp.issubdtype(pltpu.dma_semaphore, jax.dtypes.extended)
    assert jnp.issubdtype(pl.semaphore, jax.dtypes.extended)
    assert not jnp.issubdtype(pltpu.dma_semaphore, pl.semaphore)
    assert pltpu.SEMAPHORE((2,), pltpu.dma_semaphore) == pltpu.SemaphoreType.DMA((2,))
    assert pltpu.SEMAPHORE((), pl.semaphore) == pltpu.SemaphoreType.REGULAR(())


def test_dma_semaphore_scratch_counts_copies() -> None:
    x = _x()

    def kernel(x_hbm: Any, o_ref: Any, sems: Any) -> None:
        pltpu.async_copy(x_hbm, o_ref, sems.at[1]).wait()
        o_ref[...] += 1.0

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32),
                       in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                       scratch_shapes=[pltpu.SEMAPHORE((2,), pltpu.dma_semaphore)],
                       backend="interpret")
    np.testing.assert_allclose(f(x), x + 1.0)
    assert "!tpu.dma_semaphore" in _module(_lowerable(kernel, x), x)


def _lowerable(kernel: Any, x: Any) -> Any:
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          scratch_shapes=[pltpu.SEMAPHORE((2,), pltpu.dma_semaphore)])


def test_regular_semaphore_from_pl_semaphore_dtype() -> None:
    x = _x()

    def kernel(x_ref: Any, o_ref: Any, sem: Any) -> None:
        pl.semaphore_signal(sem, 3)
        pl.semaphore_wait(sem, 3)
        o_ref[...] = x_ref[...] * 3.0

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32),
                       scratch_shapes=[pltpu.SEMAPHORE((), pl.semaphore)], backend="interpret")
    np.testing.assert_allclose(f(x), x * 3.0, rtol=1e-6)


# --- select_ref in a TPU kernel ------------------------------------------------------------


def _select_kernel(i_ref: Any, a_hbm: Any, b_hbm: Any, o_ref: Any, sem: Any) -> None:
    src = pl.select_ref(i_ref[0], a_hbm, b_hbm.at[1])
    pltpu.async_copy(src, o_ref, sem).wait()


@pytest.mark.parametrize("which", [0, 1])
def test_select_ref_copies_from_the_chosen_ref(which: int) -> None:
    a, b = _x((8, 128), 1), _x((2, 8, 128), 2)
    gs = pltpu.PrefetchScalarGridSpec(1, grid=(), in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
                                      scratch_shapes=[pltpu.SemaphoreType.DMA])
    f = pl.pallas_call(_select_kernel, jax.ShapeDtypeStruct(a.shape, F32), grid_spec=gs,
                       backend="interpret")
    idx = jnp.array([which], jnp.int32)
    np.testing.assert_array_equal(f(idx, a, b), [a, b[1]][which])
    lowered = pl.pallas_call(_select_kernel, jax.ShapeDtypeStruct(a.shape, F32), grid_spec=gs)
    assert "tpu.enqueue_dma" in _module(lowered, idx, a, b)


def test_select_ref_reads_and_writes_the_chosen_ref() -> None:
    x = _x()

    def kernel(i_ref: Any, x_ref: Any, o_ref: Any, p_ref: Any, q_ref: Any) -> None:
        p_ref[...] = jnp.zeros_like(p_ref)
        q_ref[...] = jnp.zeros_like(q_ref)
        sel = pl.select_ref(i_ref[0], p_ref, q_ref)
        sel[...] = x_ref[...]
        o_ref[...] = sel[...] + q_ref[...]

    gs = pltpu.PrefetchScalarGridSpec(1, grid=(), scratch_shapes=[pltpu.VMEM((8, 128), F32)] * 2)
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), grid_spec=gs,
                       backend="interpret")
    np.testing.assert_allclose(f(jnp.array([0], jnp.int32), x), x)
    np.testing.assert_allclose(f(jnp.array([1], jnp.int32), x), 2 * x)
    with pytest.raises(pl.PallasError, match="at least two"):
        pl.select_ref(0, x)


# --- HOST ----------------------------------------------------------------------------------


def test_host_operands_are_whole_and_lower_to_host_memrefs() -> None:
    x = _x()

    def kernel(x_host: Any, o_ref: Any, sem: Any) -> None:
        pltpu.async_copy(x_host, o_ref, sem).wait()
        o_ref[...] = o_ref[...] * 2.0

    kw: dict[str, Any] = {"in_specs": [pl.BlockSpec(memory_space=pl.HOST)],
                          "scratch_shapes": [pltpu.SemaphoreType.DMA]}
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), backend="interpret", **kw)
    np.testing.assert_allclose(f(x), 2 * x)
    assert "#tpu.memory_space<host>" in _module(
        pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), **kw), x)
    with pytest.raises(pl.BlockSpecError, match="HOST"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), backend="interpret",
                       in_specs=[pl.BlockSpec((4, 128), lambda: (0, 0),
                                              memory_space=pl.HOST)],
                       scratch_shapes=[pltpu.SemaphoreType.DMA])(x)


# --- with_memory_space_constraint, has_memory_space ----------------------------------------


def test_with_memory_space_constraint_keeps_the_value() -> None:
    x = _x()
    f = jax.jit(lambda a: pltpu.with_memory_space_constraint(a, pltpu.VMEM) * 2.0)
    np.testing.assert_allclose(f(x), 2 * x)
    assert pltpu.with_memory_space_constraint(x, pl.ANY) is x
    with pytest.raises(pl.PallasError, match="memory_space must be"):
        pltpu.with_memory_space_constraint(x, pltpu.SEMAPHORE)


def _has_space_kernel(space: Any) -> Any:
    def kernel(x_hbm: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.full(o_ref.shape, pltpu.has_memory_space(x_hbm, space), jnp.int32)
    return kernel


@pytest.mark.parametrize(("space", "expected"), [("HBM", 1), ("VMEM", 0), ("SMEM", 0)])
def test_has_memory_space_on_the_interpreter(space: str, expected: int) -> None:
    f = pl.pallas_call(_has_space_kernel(getattr(pltpu, space)),
                       jax.ShapeDtypeStruct((8, 128), jnp.int32),
                       in_specs=[pl.BlockSpec(memory_space=pl.ANY)], backend="interpret")
    np.testing.assert_array_equal(f(_x()), np.full((8, 128), expected))


def test_has_memory_space_refuses_blocked_refs_and_pl_any() -> None:
    def blocked(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * pltpu.has_memory_space(x_ref, pltpu.HBM)

    with pytest.raises(pl.PallasError, match=r"pl\.ANY"):
        pl.pallas_call(blocked, jax.ShapeDtypeStruct((8, 128), F32), backend="interpret")(_x())
    with pytest.raises(pl.PallasError, match="concrete"):
        pl.pallas_call(_has_space_kernel(pl.ANY), jax.ShapeDtypeStruct((8, 128), jnp.int32),
                       in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                       backend="interpret")(_x())


def test_has_memory_space_lowering_names_the_op_or_emits_it() -> None:
    f = pl.pallas_call(_has_space_kernel(pltpu.VMEM), jax.ShapeDtypeStruct((8, 128), jnp.int32),
                       in_specs=[pl.BlockSpec(memory_space=pl.ANY)])
    from jaxlib.mosaic.python import tpu

    if hasattr(tpu, "MemRefMemorySpaceIsOp"):
        assert "tpu.memref_memory_space_is" in _module(f, _x())
    else:
        with pytest.raises(pltpu.LoweringException, match="has_memory_space"):
            _module(f, _x())


# --- LoweringException, trace_value, annotate, reciprocal, core ---------------------------


def test_lowering_failures_are_lowering_exceptions_of_their_own_kind() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.fft.fft(x_ref[...]).real

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), F32))
    with pytest.raises(pltpu.LoweringException) as info:
        _module(f, _x())
    assert isinstance(info.value, pl.UnsupportedError)
    assert issubclass(pltpu.LoweringException, pl.PallasError)


def test_trace_value_records_nothing_on_the_interpreter_and_lowers() -> None:
    x = _x()

    def kernel(x_ref: Any, o_ref: Any) -> None:
        pltpu.trace_value("total", jnp.sum(x_ref[...]))
        pltpu.trace_value("steps", pl.program_id(0))
        o_ref[...] = x_ref[...] + 1.0

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), grid=(1,))
    np.testing.assert_allclose(_interpret(f, x), x + 1.0)
    text = _module(f, x)
    assert text.count("tpu.trace_value") == 2 and '"total"' in text
    with pytest.raises(pl.PallasError, match="scalar"):
        pl.pallas_call(lambda x_ref, o_ref: pltpu.trace_value("v", x_ref[...]),
                       jax.ShapeDtypeStruct(x.shape, F32), backend="interpret")(x)


def test_annotate_returns_the_ref_and_changes_nothing() -> None:
    x = _x()

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.annotate(x_ref, no_store=True, no_bank_conflict=True)[...] * 4.0

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), backend="interpret")
    np.testing.assert_allclose(f(x), 4.0 * x)
    with pytest.raises(pl.PallasError, match="exclude"):
        pltpu.annotate(x, no_store=True, no_hazard=True)


def test_reciprocal_moved_to_pltpu_and_the_old_spelling_warns() -> None:
    x = _x() + 4.0
    k = lambda r: lambda x_ref, o_ref: o_ref.__setitem__(..., r(x_ref[...], approx=True))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = pl.pallas_call(k(pltpu.reciprocal), jax.ShapeDtypeStruct(x.shape, F32),
                              backend="interpret")(x)
    np.testing.assert_allclose(ours, 1.0 / x, rtol=1e-6)
    with warns_from((0, 11), "pltpu.reciprocal"):  # where JAX warns
        old = pl.reciprocal
    assert old is pltpu.reciprocal and "reciprocal" in dir(pl)


def test_core_module_holds_jaxs_core_names() -> None:
    jax_core_module = jax_pltpu.core
    for name in ("MemorySpace", "GridDimensionSemantics", "SemaphoreType", "dma_semaphore",
                 "CompilerParams", "CoreType", "PrefetchScalarGridSpec", "SideEffectType"):
        assert hasattr(jax_core_module, name)
        assert getattr(pltpu.core, name) is getattr(pltpu, name)


def test_plain_pallas_errors_of_lowering_become_lowering_exceptions() -> None:
    x = _x((16, 128))
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    call = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                          jax.ShapeDtypeStruct(x.shape, F32), grid=(2,), in_specs=[spec],
                          out_specs=spec, compiler_params=pltpu.CompilerParams(
                              dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY)))
    with pytest.raises(pltpu.LoweringException, match="2 entries"):
        _module(call, x)
