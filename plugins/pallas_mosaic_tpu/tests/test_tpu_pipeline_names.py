"""Pipeline names of ``jax.experimental.pallas.tpu`` (issue 28): ``emit_pipeline_with_allocations``
with ``BufferedRef``/``BufferType`` (buffers allocated once, shared by two pipeline runs),
``PipelineStep`` (``_explicit_indices``), ``emit_pipeline_with_async_prefetch`` and the
deprecated ``BufferedRefBase``; on the interpreter against ``jax.numpy``, lowered for TPU.
"""

from __future__ import annotations

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
RNG = np.random.default_rng(3)


def _x(shape: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(RNG.standard_normal(shape), F32)


def _spec() -> Any:
    return pl.BlockSpec((8, 128), lambda i, j: (i, j))


def _twice_through_shared_buffers(backend: str | None) -> Any:
    def body(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    pipeline, make_allocations = pltpu.emit_pipeline_with_allocations(
        body, grid=(2, 2), in_specs=[_spec()], out_specs=[_spec()])

    def kernel(x_hbm: Any, y_hbm: Any, o_hbm: Any, p_hbm: Any) -> None:
        def scoped(allocations: Any) -> None:
            assert [b.buffer_type for b in allocations] == [pltpu.BufferType.INPUT,
                                                            pltpu.BufferType.OUTPUT]
            pipeline(x_hbm, o_hbm, allocations=allocations)
            pipeline(y_hbm, p_hbm, allocations=allocations)

        pl.run_scoped(scoped, make_allocations(x_hbm, o_hbm))

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(kernel, [jax.ShapeDtypeStruct((16, 256), F32)] * 2,
                          in_specs=[any_spec] * 2, out_specs=[any_spec] * 2, backend=backend)


def test_allocations_made_once_serve_two_pipeline_runs() -> None:
    x, y = _x((16, 256)), _x((16, 256))
    o, p = _twice_through_shared_buffers("interpret")(x, y)
    np.testing.assert_allclose(o, x * 2.0 + 1.0, rtol=1e-6)
    np.testing.assert_allclose(p, y * 2.0 + 1.0, rtol=1e-6)
    text = jax.jit(_twice_through_shared_buffers(None)).trace(x, y).lower(
        lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    assert "tpu.enqueue_dma" in str(module)


def test_buffer_types_are_jaxs() -> None:
    assert [(t.name, t.value) for t in pltpu.BufferType] == [
        (t.name, t.value) for t in jax_pltpu.BufferType]
    assert pltpu.BufferType.INPUT_OUTPUT.is_input and pltpu.BufferType.INPUT_OUTPUT.is_output


def test_allocations_of_the_wrong_shape_are_refused() -> None:
    def body(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    pipeline, _ = pltpu.emit_pipeline_with_allocations(body, grid=(2, 2), in_specs=[_spec()],
                                                       out_specs=[_spec()])
    _, other = pltpu.emit_pipeline_with_allocations(
        body, grid=(1, 1), in_specs=[pl.BlockSpec((16, 256), lambda i, j: (0, 0))],
        out_specs=[pl.BlockSpec((16, 256), lambda i, j: (0, 0))])

    def kernel(x_hbm: Any, o_hbm: Any) -> None:
        pl.run_scoped(lambda a: pipeline(x_hbm, o_hbm, allocations=a), other(x_hbm, o_hbm))

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    with pytest.raises(pl.PallasError, match="allocation holds buffers"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 256), F32), in_specs=[any_spec],
                       out_specs=any_spec, backend="interpret")(_x((16, 256)))


def test_explicit_indices_give_the_body_a_pipeline_step() -> None:
    x = _x((16, 256))

    def body(step: Any, x_ref: Any, o_ref: Any) -> None:
        assert isinstance(step, pltpu.PipelineStep)
        i, j = step.index
        o_ref[...] = x_ref[...] + (10 * i + j + 100 * step.local_index).astype(F32)

    def kernel(x_hbm: Any, o_hbm: Any) -> None:
        pltpu.emit_pipeline(body, grid=(2, 2), in_specs=[_spec()], out_specs=[_spec()],
                            output_wait_read_only=True, _explicit_indices=True)(x_hbm, o_hbm)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), in_specs=[any_spec],
                         out_specs=any_spec, backend="interpret")(x)
    add = np.zeros((16, 256), np.float32)
    for i in range(2):
        for j in range(2):
            add[8 * i:8 * i + 8, 128 * j:128 * j + 128] = 10 * i + j + 100 * (2 * i + j)
    np.testing.assert_allclose(out, x + add, rtol=1e-6)


def test_async_prefetch_pipeline_gives_the_pipelines_results() -> None:
    x = _x((16, 256))
    mesh = pltpu.create_tensorcore_mesh("core")

    def body(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.exp(x_ref[...])

    pipeline, prefetch = pltpu.emit_pipeline_with_async_prefetch(
        body, grid=(2, 2), in_specs=[_spec()], out_specs=[_spec()], mesh=mesh)

    def kernel(x_hbm: Any, o_hbm: Any) -> None:
        pipeline(x_hbm, o_hbm, allocations=prefetch(x_hbm))

    out = pl.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, F32), mesh=mesh,
                    backend="interpret")(x)
    np.testing.assert_allclose(out, jnp.exp(x), rtol=1e-6)


def test_buffered_ref_base_is_deprecated_as_in_jax_012() -> None:
    """It warns where JAX warns: from 0.12 on."""
    with warns_from((0, 12), "BufferedRefBase"):
        base = pltpu.BufferedRefBase
    assert issubclass(pltpu.BufferedRef, base) and "BufferedRefBase" in dir(pltpu)


def _indirect_call(out_rows: int, gather: bool) -> Any:
    def kernel(idx_ref: Any, x_hbm: Any, o_hbm: Any) -> None:
        def body(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 2.0 + 1.0

        by_index = pl.BlockSpec((pl.Indirect(8), 128), lambda i: (idx_ref[i], 0))
        by_block = pl.BlockSpec((8, 128), lambda i: (i, 0))
        pltpu.emit_pipeline(body, grid=(4,), in_specs=[by_index if gather else by_block],
                            out_specs=[by_block if gather else by_index])(x_hbm, o_hbm)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((out_rows, 128), F32),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), any_spec],
                          out_specs=any_spec, backend="interpret")


def test_indirect_block_dimension_gathers_input_rows() -> None:
    x = _x((64, 128))
    idx = jnp.asarray(RNG.integers(0, 64, (4, 8)), jnp.int32)  # repeats allowed
    out = _indirect_call(32, gather=True)(idx, x)
    np.testing.assert_allclose(out, x[idx.reshape(-1)] * 2.0 + 1.0, rtol=1e-6)


def test_indirect_block_dimension_scatters_output_rows() -> None:
    x = _x((32, 128))
    idx = jnp.asarray(RNG.permutation(32).reshape(4, 8), jnp.int32)
    out = _indirect_call(32, gather=False)(idx, x)
    expected = jnp.zeros((32, 128), F32).at[idx.reshape(-1)].set(x * 2.0 + 1.0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_indirect_is_refused_by_pallas_call_and_off_the_leading_dimension() -> None:
    x = _x((16, 128))
    with pytest.raises(pl.UnsupportedError, match="Indirect"):
        pl.pallas_call(lambda x_ref, o_ref: None, jax.ShapeDtypeStruct(x.shape, F32),
                       in_specs=[pl.BlockSpec((pl.Indirect(8), 128), lambda: (0, 0))],
                       backend="interpret")(x)
    assert repr(pl.Indirect(8)) == "Indirect(8)"
    with pytest.raises(pl.BlockSpecError):
        pl.Indirect(0)
