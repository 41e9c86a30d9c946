"""Operands, specs, outputs and scratch buffers as pytrees, as ``jax.experimental.pallas`` takes
them: ``None`` operands with ``None`` specs, ``None`` outputs with ``None`` out_specs, ``None``
and nested scratch entries, dict scratch by keyword, and ``out_shape=()``.

The forms are those of JAX's kernel library (ops/tpu/flash_attention.py passes ``ab=None``,
splash attention appends ``None`` to ``out_shape``/``out_specs``, paged attention puts ``None``
in ``scratch_shapes``, all_gather nests its semaphores). Each kernel runs here and in JAX's
interpreter, and both are checked against jax.numpy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core.plugins import manager

SHAPE, BLOCK = (16, 128), (8, 128)


def _rand(seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), SHAPE, jnp.float32)


def _sds() -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(SHAPE, jnp.float32)


def _scratch(m: Any) -> Any:
    """A (8, 128) float32 scratch buffer: JAX's needs a memory space, ours takes either."""
    if m is jax_pl:
        return jax_pltpu.VMEM(BLOCK, jnp.float32)
    return jax.ShapeDtypeStruct(BLOCK, jnp.float32)


def both(build: Any, *args: Any) -> tuple[Any, Any]:
    return build(pl)(*args), build(jax_pl, interpret=True)(*args)


def _spec(m: Any) -> Any:
    return m.BlockSpec(BLOCK, lambda i: (i, 0))


def test_none_operand_with_none_spec_reaches_the_kernel_as_none() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref, bias_ref, y_ref, o_ref):
            assert bias_ref is None
            o_ref[...] = x_ref[...] * 2.0 + y_ref[...]

        return m.pallas_call(kernel, _sds(), grid=(2,), in_specs=[_spec(m), None, _spec(m)],
                             out_specs=_spec(m), **kw)

    x, y = _rand(), _rand(1)
    ours, theirs = both(build, x, None, y)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours, x * 2.0 + y, rtol=1e-6)


def test_none_entries_in_operand_pytrees() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(pair, o_ref):
            a_ref, none, b_ref = pair
            assert none is None
            o_ref[...] = a_ref[...] - b_ref[...]

        return m.pallas_call(kernel, _sds(), grid=(2,),
                             in_specs=[(_spec(m), None, _spec(m))], out_specs=_spec(m), **kw)

    a, b = _rand(), _rand(1)
    ours, theirs = both(build, (a, None, b))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours, a - b, rtol=1e-6)


def test_none_output_with_none_out_spec() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref, o_ref, none, p_ref):
            assert none is None
            o_ref[...] = x_ref[...] + 1.0
            p_ref[...] = x_ref[...] * 3.0

        return m.pallas_call(kernel, [_sds(), None, _sds()], grid=(2,), in_specs=[_spec(m)],
                             out_specs=[_spec(m), None, _spec(m)], **kw)

    x = _rand()
    ours, theirs = both(build, x)
    assert ours[1] is None and theirs[1] is None and len(ours) == len(theirs) == 3
    for a, b, want in ((ours[0], theirs[0], x + 1.0), (ours[2], theirs[2], x * 3.0)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(a, want, rtol=1e-6)


def test_none_entries_in_scratch_shapes() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref, o_ref, acc_ref, none, tmp_ref):
            assert none is None
            acc_ref[...] = x_ref[...] * 2.0
            tmp_ref[...] = acc_ref[...] + 1.0
            o_ref[...] = tmp_ref[...] * acc_ref[...]

        return m.pallas_call(kernel, _sds(), grid=(2,), in_specs=[_spec(m)], out_specs=_spec(m),
                             scratch_shapes=(_scratch(m), None, _scratch(m)), **kw)

    x = _rand()
    ours, theirs = both(build, x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours, (x * 2.0 + 1.0) * (x * 2.0), rtol=1e-6)


def test_nested_scratch_shapes_reach_the_kernel_nested() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref, o_ref, pair, single):
            first, (second, third) = pair
            first[...] = x_ref[...] + 1.0
            second[...] = first[...] * 2.0
            third[...] = second[...] - x_ref[...]
            single[...] = third[...] * first[...]
            o_ref[...] = single[...]

        s = _scratch(m)
        return m.pallas_call(kernel, _sds(), grid=(2,), in_specs=[_spec(m)], out_specs=_spec(m),
                             scratch_shapes=((s, [s, s]), s), **kw)

    x = _rand()
    ours, theirs = both(build, x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours, ((x + 1.0) * 2.0 - x) * (x + 1.0), rtol=1e-5)


def test_nested_scratch_shapes_in_a_grid_spec() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref, o_ref, pair):
            a_ref, b_ref = pair
            a_ref[...] = x_ref[...] * x_ref[...]
            b_ref[...] = a_ref[...] + 2.0
            o_ref[...] = b_ref[...]

        s = _scratch(m)
        spec = m.GridSpec(grid=(2,), in_specs=[_spec(m)], out_specs=_spec(m),
                          scratch_shapes=((s, s),))
        return m.pallas_call(kernel, _sds(), grid_spec=spec, **kw)

    x = _rand()
    ours, theirs = both(build, x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours, x * x + 2.0, rtol=1e-6)


def test_dict_scratch_shapes_are_passed_by_keyword() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref, o_ref, *, acc, tmp):
            acc[...] = x_ref[...] - 1.0
            tmp[...] = acc[...] * acc[...]
            o_ref[...] = tmp[...]

        s = _scratch(m)
        return m.pallas_call(kernel, _sds(), grid=(2,), in_specs=[_spec(m)], out_specs=_spec(m),
                             scratch_shapes={"tmp": s, "acc": s}, **kw)

    x = _rand()
    ours, theirs = both(build, x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours, (x - 1.0) ** 2, rtol=1e-5)


def test_out_shape_empty_tuple_means_no_outputs(capfd: pytest.CaptureFixture[str]) -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref, y_ref):
            m.debug_print("total {}", jnp.sum(x_ref[...] * y_ref[...]))

        return m.pallas_call(kernel, (), **kw)

    x, y = jnp.arange(8.0), jnp.arange(8.0) + 1.0
    ours = build(pl)(x, y)
    jax.effects_barrier()
    printed = capfd.readouterr().out
    theirs = build(jax_pl, interpret=True)(x, y)
    assert ours == () and theirs == ()
    assert f"total {float(jnp.sum(x * y))}" in printed


def test_out_shape_empty_tuple_with_wrong_kernel_arity_names_the_inputs() -> None:
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    with pytest.raises(pl.KernelSignatureError, match=r"passes 1 Refs: input 0\. Fix"):
        pl.pallas_call(kernel, ())(jnp.ones(8))


def test_nested_scratch_with_wrong_kernel_arity_counts_top_level_entries() -> None:
    def kernel(x_ref, o_ref, a, b, c):
        o_ref[...] = x_ref[...]

    s = _scratch(pl)
    with pytest.raises(pl.KernelSignatureError,
                       match=r"passes 4 Refs: input 0, output 0, scratch 0, scratch 1\. Fix"):
        pl.pallas_call(kernel, _sds(), scratch_shapes=((s, s), s))(_rand())


def test_none_spec_for_an_array_operand_passes_it_whole() -> None:
    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] + w_ref[pl.program_id(0)]

    x, w = _rand(), jnp.arange(2.0)
    out = pl.pallas_call(kernel, _sds(), grid=(2,), in_specs=[_spec(pl), None],
                         out_specs=_spec(pl))(x, w)
    np.testing.assert_allclose(out, x + jnp.repeat(w, 8)[:, None], rtol=1e-6)


def test_none_spec_against_a_pytree_operand_is_an_error() -> None:
    def kernel(x_ref, pair, o_ref):
        o_ref[...] = x_ref[...]

    x = _rand()
    with pytest.raises(pl.BlockSpecError, match=r"(?s)structure \(\*, None\).*"
                                                 r"structure \(\*, \(\*, \*\)\).*Fix"):
        pl.pallas_call(kernel, _sds(), in_specs=[_spec(pl), None])(x, (x, x))


def test_block_spec_for_a_none_operand_is_an_error() -> None:
    def kernel(x_ref, none, o_ref):
        o_ref[...] = x_ref[...]

    x = _rand()
    with pytest.raises(pl.BlockSpecError, match=r"(?s)2 BlockSpecs.*\(\*, None\).*Fix"):
        pl.pallas_call(kernel, _sds(), grid=(2,), in_specs=[_spec(pl), _spec(pl)],
                       out_specs=_spec(pl))(x, None)


@pytest.mark.skipif("mosaic_tpu" not in manager.backends(), reason="needs pallas_mosaic_tpu")
def test_nested_and_none_scratch_lowers_for_tpu() -> None:
    import pallas_mosaic_tpu as pltpu

    def kernel(x_ref, o_ref, sems, none, buf):
        assert none is None
        send, recv = sems
        pltpu.async_copy(x_ref, buf, send).wait()
        pltpu.async_copy(buf, o_ref, recv).wait()

    def fn(x, backend):
        return pl.pallas_call(
            kernel, _sds(), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=((pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA), None,
                            pltpu.VMEM(SHAPE, jnp.float32)), backend=backend)(x)

    x = _rand()
    text = jax.jit(fn, static_argnums=1).trace(x, "mosaic_tpu").lower(
        lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    np.testing.assert_array_equal(fn(x, "interpret"), x)
