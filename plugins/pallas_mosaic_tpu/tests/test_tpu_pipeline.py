"""``pltpu.emit_pipeline``: the blog's matmul through ``pl.kernel`` + ``create_tensorcore_mesh``.

The same kernel is written once against a Pallas module (this project's or JAX's); ours runs in
the interpreter against ``jax.numpy`` (so the DMA double-buffering is exercised with the
semantics the Mosaic lowering gives it: copies complete on wait), lowers for TPU into a module
that verifies, and agrees with what ``jax.experimental.pallas`` emits where the runtime looks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_interpret import InterpretParams  # noqa: E402
from pallas_mosaic_tpu import inspection  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def blog_matmul(m: Any, tpu: Any, *, bm: int = 128, bk: int = 128, bn: int = 128,
                num_cores: int = 1, backend: str | None = None, compiler_params: Any = None,
                **pipeline_kw: Any) -> Callable[..., Any]:
    """x @ y with float32 accumulation, blocks fetched from HBM by an inner pipeline."""
    def matmul(x: jax.Array, y: jax.Array) -> jax.Array:
        (mm, kk), (_, nn) = x.shape, y.shape

        def kernel(x_hbm: Any, y_hbm: Any, o_hbm: Any) -> None:
            def inner(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
                @m.when(m.program_id(2) == 0)
                def _() -> None:
                    o_ref[...] = jnp.zeros_like(o_ref)

                o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=F32)

            tpu.emit_pipeline(
                inner, grid=(mm // bm, nn // bn, kk // bk),
                in_specs=[m.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                          m.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
                out_specs=m.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
                core_axis_name="core",
                dimension_semantics=(tpu.PARALLEL, tpu.PARALLEL, tpu.ARBITRARY),
                **pipeline_kw)(x_hbm, y_hbm, o_hbm)

        kw: dict[str, Any] = {"backend": backend} if backend else {}
        if compiler_params is not None:
            kw["compiler_params"] = compiler_params
        return m.kernel(kernel, out_type=jax.ShapeDtypeStruct((mm, nn), F32),
                        mesh=tpu.create_tensorcore_mesh("core", num_cores=num_cores),
                        **kw)(x, y)

    return matmul


def _operands(seed: int = 0, m: int = 256, k: int = 384, n: int = 256) -> tuple[Any, Any]:
    kx, ky = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (m, k), F32).astype(BF16),
            jax.random.normal(ky, (k, n), F32).astype(BF16))


@pytest.mark.parametrize("num_cores", [1, 2])
@pytest.mark.parametrize("no_pipelining", [False, True])
def test_blog_matmul_runs_in_the_interpreter(num_cores: int, no_pipelining: bool) -> None:
    x, y = _operands()
    got = blog_matmul(pl, pltpu, num_cores=num_cores, backend="interpret",
                      no_pipelining=no_pipelining)(x, y)
    np.testing.assert_allclose(got, jnp.dot(x, y, preferred_element_type=F32),
                               rtol=1e-2, atol=1e-2)


def test_blog_matmul_in_checked_mode_has_no_races_or_deadlocks() -> None:
    """Checked mode poisons buffers and tracks every DMA: a fetch waited late, a buffer
    reused before its write-back finished, or a block read before its copy landed shows."""
    x, y = _operands(seed=1, m=256, k=256, n=384)
    got = blog_matmul(pl, pltpu, compiler_params=InterpretParams(checked=True))(x, y)
    np.testing.assert_allclose(got, jnp.dot(x, y, preferred_element_type=F32),
                               rtol=1e-2, atol=1e-2)


def _lowered(fn: Callable[..., Any], *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("num_cores", [1, 2])
def test_blog_matmul_lowers_for_tpu_like_jax_experimental_pallas(num_cores: int) -> None:
    x, y = _operands()
    (config, module), = inspection.kernels(_lowered(
        blog_matmul(pl, pltpu, num_cores=num_cores), x, y))
    text = str(module)
    for op in ("tpu.region", "tpu.sem_alloc", "memref.alloca", "scf.for", "tpu.enqueue_dma",
               "tpu.wait_dma", "tpu.matmul"):
        assert op in text, op
    # JAX's pipeline asks which chip it tiles for; name one (no TPU is attached here).
    with plb.assume_device("TPU v5 lite", "tpu", num_cores):
        (theirs_config, theirs), = inspection.kernels(_lowered(
            blog_matmul(jax_pl, jax_pltpu, num_cores=num_cores), x, y))
    inspection.assert_same_config(config, theirs_config)
    ours, reference = inspection.summary(module), inspection.summary(theirs)
    assert ours == reference


def test_pipeline_blocks_must_tile_the_array() -> None:
    x, y = _operands(m=201)  # 201 rows: not whole (8, 128) tiles
    with pytest.raises(pl.PallasError, match=r"does not divide.*Fix"):
        blog_matmul(pl, pltpu, backend="interpret")(x, y)
    x, y = _operands()
    with pytest.raises(pl.PallasError, match=r"\(8, 128\).*Fix"):
        blog_matmul(pl, pltpu, bn=64, backend="interpret")(x, y)


def _prologue_kernel(m: Any, tpu: Any) -> Callable[..., Any]:
    """Each step's body scales its block by a factor the prologue computes from the step's
    program ids (JAX's ``body_prologue``: run in the grid environment before the body)."""
    def kernel(x_hbm: Any, o_hbm: Any, factor: Any) -> None:
        def prologue() -> None:
            factor[0] = m.program_id(0) * 10 + m.program_id(1) + 1

        def body(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * factor[0].astype(x_ref.dtype)

        spec = m.BlockSpec((8, 128), lambda i, j: (i, j))
        tpu.emit_pipeline(body, grid=(2, 3), in_specs=[spec], out_specs=spec)(
            x_hbm, o_hbm, body_prologue=prologue)

    return m.pallas_call(kernel, jax.ShapeDtypeStruct((16, 384), F32),
                         in_specs=[m.BlockSpec(memory_space=m.ANY)],
                         out_specs=m.BlockSpec(memory_space=m.ANY),
                         scratch_shapes=[tpu.SMEM((1,), jnp.int32)])


def test_body_prologue_runs_before_each_step_in_its_grid_environment() -> None:
    x = jax.random.normal(jax.random.key(3), (16, 384), F32)
    factors = np.repeat(np.repeat(np.arange(2)[:, None] * 10 + np.arange(3) + 1, 8, 0), 128, 1)
    want = np.asarray(x) * factors
    f = _prologue_kernel(pl, pltpu)
    np.testing.assert_allclose(f(x), want, rtol=1e-6)
    np.testing.assert_allclose(pl.emulate(f, backend="mosaic_tpu")(x), want, rtol=1e-6)
    text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    (_, ours), = inspection.kernels(text)
    if jax.__version_info__ >= (0, 12):  # JAX 0.12's pipeline has no body_prologue
        return
    with plb.assume_device("TPU v5 lite", "tpu"):
        text = jax.jit(_prologue_kernel(jax_pl, jax_pltpu)).trace(x).lower(
            lowering_platforms=("tpu",)).as_text()
    (_, theirs), = inspection.kernels(text)
    inspection.assert_same_kernel(ours, theirs)


def _edge_kernel(m: Any, tpu: Any, shape: tuple[int, ...], block: tuple[int, ...],
                 dtype: Any) -> Any:
    grid = tuple(-(-n // b) for n, b in zip(shape, block))

    def kernel(x_hbm: Any, o_hbm: Any) -> None:
        def body(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 2 + 1

        spec = m.BlockSpec(block, lambda *i: i)
        tpu.emit_pipeline(body, grid=grid, in_specs=[spec], out_specs=spec)(x_hbm, o_hbm)

    return m.pallas_call(kernel, jax.ShapeDtypeStruct(shape, dtype),
                         in_specs=[m.BlockSpec(memory_space=m.ANY)],
                         out_specs=m.BlockSpec(memory_space=m.ANY))


def _op_kinds(module: Any) -> set[str]:
    """The operations of a module, without the profiler's trace scopes."""
    return set(re.findall(r"\b(tpu\.\w+|memref\.\w+|scf\.\w+)", str(module))) - {
        "tpu.trace_start", "tpu.trace_stop"}


@pytest.mark.parametrize("shape, block, dtype", [
    ((40, 384), (16, 256), F32), ((48, 384), (32, 256), BF16), ((5, 16, 128), (2, 16, 128), F32),
], ids=["f32-both-minor", "bf16-both-minor", "f32-leading"])
def test_partial_edge_blocks_are_cut_at_the_array_end_as_in_jax(
        shape: tuple[int, ...], block: tuple[int, ...], dtype: Any) -> None:
    """Blocks that do not divide the array: the edge block is copied cut to the array's end
    (rounded up to the tiling, which here stays inside the array), as JAX's pipeline cuts it;
    the interpreter and the emulated module match jax.numpy, and the module agrees with
    JAX's (kernel configuration, and the same operations)."""
    x = jax.random.normal(jax.random.key(5), shape, dtype)
    want = np.asarray(x * 2 + 1, np.float32)
    f = _edge_kernel(pl, pltpu, shape, block, dtype)
    np.testing.assert_array_equal(np.asarray(f(x), np.float32), want)
    np.testing.assert_array_equal(np.asarray(pl.emulate(f, backend="mosaic_tpu")(x), np.float32),
                                  want)
    text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    (_, ours), = inspection.kernels(text)
    with plb.assume_device("TPU v5 lite", "tpu"):
        text = jax.jit(_edge_kernel(jax_pl, jax_pltpu, shape, block, dtype)).trace(x).lower(
            lowering_platforms=("tpu",)).as_text()
    (_, theirs), = inspection.kernels(text)
    inspection.assert_same_kernel(ours, theirs)
    assert _op_kinds(ours) == _op_kinds(theirs)
    assert "tpu.assume_multiple" in str(ours)


def test_an_edge_block_past_the_tiles_is_refused_by_name() -> None:
    f = _edge_kernel(pl, pltpu, (601, 384), (256, 128), F32)
    with pytest.raises(pl.UnsupportedError, match=r"whole tiles of 8 .*pad it to a multiple"):
        f(jnp.ones((601, 384), F32))


def _buffered_kernel(m: Any, counts: tuple[int, int, int], steps: int = 5) -> Any:
    """Two inputs and an output with ``pl.Buffered`` counts, over ``steps`` blocks of rows."""
    def kernel(x_hbm: Any, y_hbm: Any, o_hbm: Any) -> None:
        def body(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 3 - y_ref[...]

        specs = [m.BlockSpec((8, 128), lambda i: (i, 0), pipeline_mode=m.Buffered(n))
                 for n in counts]
        tpu = pltpu if m is pl else jax_pltpu
        tpu.emit_pipeline(body, grid=(steps,), in_specs=specs[:2], out_specs=specs[2])(
            x_hbm, y_hbm, o_hbm)

    any_spec = m.BlockSpec(memory_space=m.ANY)
    return m.pallas_call(kernel, jax.ShapeDtypeStruct((8 * steps, 128), F32),
                         in_specs=[any_spec, any_spec], out_specs=any_spec)


@pytest.mark.parametrize("counts", [(3, 1, 2), (4, 2, 1), (1, 1, 1)],
                         ids=["3-1-2", "4-2-1", "sync"])
def test_buffer_counts_prefetch_deeper_and_compute_the_same(counts: tuple[int, int, int]
                                                            ) -> None:
    """``pl.Buffered(n)`` on emit_pipeline's specs: an input is fetched ``n - 1`` steps ahead
    into ``n`` VMEM buffers (1: synchronously), an output drains through up to two; the
    interpreter and the emulated module match jax.numpy, and the kernel's VMEM buffers have
    the counts asked for."""
    kx, ky = jax.random.split(jax.random.key(9))
    x, y = (jax.random.normal(k, (40, 128), F32) for k in (kx, ky))
    want = np.asarray(x * 3 - y)
    f = _buffered_kernel(pl, counts)
    np.testing.assert_allclose(f(x, y), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pl.emulate(f, backend="mosaic_tpu")(x, y), want, rtol=1e-6,
                               atol=1e-6)
    text = jax.jit(f).trace(x, y).lower(lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    allocs = sorted(int(n) for n in re.findall(r"memref\.alloca\(\) : memref<(\d+)x8x128xf32",
                                               str(module)))
    assert allocs == sorted([counts[0], counts[1], min(counts[2], 2)])
