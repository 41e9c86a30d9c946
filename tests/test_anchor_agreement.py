"""Kernels whose meaning is subtle, run both here and by ``jax.experimental.pallas``.

Each kernel is written once against a Pallas module argument (``pallas_core`` or
``jax.experimental.pallas``: only the import differs) and both results must agree; where JAX's
interpreter cannot run a kernel, the reference is plain jax.numpy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl

import pallas_core as pl


def _rand(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def both(build: Any, *args: Any) -> tuple[Any, Any]:
    """``build(pallas_module, **kw)(*args)`` with this project and with JAX's interpreter."""
    return build(pl)(*args), build(jax_pl, interpret=True)(*args)


def test_pytree_operands_and_dict_outputs() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(pair: Any, scale_ref: Any, outs: Any) -> None:
            a_ref, b_ref = pair
            outs["sum"][...] = (a_ref[...] + b_ref[...]) * scale_ref[...]
            outs["diff"][...] = a_ref[...] - b_ref[...]

        sds = jax.ShapeDtypeStruct((16, 8), jnp.float32)
        spec = m.BlockSpec((8, 8), lambda i: (i, 0))
        return m.pallas_call(kernel, {"sum": sds, "diff": sds}, grid=(2,),
                             in_specs=[(spec, spec), spec],
                             out_specs={"sum": spec, "diff": spec}, **kw)

    a, b, s = _rand((16, 8)), _rand((16, 8), 1), _rand((16, 8), 2)
    ours, theirs = both(build, (a, b), s)
    for key in ("sum", "diff"):
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6)
    np.testing.assert_allclose(ours["sum"], (a + b) * s, rtol=1e-6)


def test_in_specs_nested_differently_from_operands_is_an_error() -> None:
    spec = pl.BlockSpec((4,), lambda i: (i,))

    def kernel(a_ref: Any, bc: Any, o_ref: Any) -> None:
        o_ref[...] = a_ref[...] + bc[0][...] + bc[1][...]

    x = jnp.arange(8.0)
    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
                          in_specs=[(spec, spec), spec], out_specs=spec)
    with pytest.raises(pl.BlockSpecError, match=r"(?s)structure.*\(\(\*, \*\), \*\).*"
                                                 r"\(\*, \(\*, \*\)\).*Fix"):
        call(x, (x, x))


def test_writes_to_an_input_block_persist_across_steps() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            x_ref[...] = x_ref[...] + 100.0 * m.program_id(0)
            o_ref[...] = x_ref[...]

        return m.pallas_call(kernel, jax.ShapeDtypeStruct((3, 4), jnp.float32), grid=(3,),
                             in_specs=[m.BlockSpec((4,), lambda i: (0,))],
                             out_specs=m.BlockSpec((None, 4), lambda i: (i, 0)), **kw)

    x = _rand((4,))
    ours, theirs = both(build, x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours[2], x + 300.0, rtol=1e-6)


def test_run_scoped_touching_only_its_own_buffer() -> None:
    def build(m: Any, **kw: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            def body(tmp_ref: Any) -> None:
                tmp_ref[...] = x_ref[...] * 2.0
                o_ref[...] = tmp_ref[...] + 1.0

            m.run_scoped(body, jax.ShapeDtypeStruct((4,), jnp.float32))

        return m.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
                             in_specs=[m.BlockSpec((4,), lambda i: (i,))],
                             out_specs=m.BlockSpec((4,), lambda i: (i,)), **kw)

    x = _rand((8,))
    np.testing.assert_allclose(build(pl)(x), x * 2.0 + 1.0, rtol=1e-6)

    def own_buffer_only(o_ref: Any) -> None:
        def body(tmp_ref: Any) -> None:
            tmp_ref[...] = jnp.arange(4.0)
            tmp_ref[...] = tmp_ref[...] * 3.0

        pl.run_scoped(body, jax.ShapeDtypeStruct((4,), jnp.float32))
        o_ref[...] = jnp.ones(4)

    out = pl.pallas_call(own_buffer_only, jax.ShapeDtypeStruct((4,), jnp.float32))()
    np.testing.assert_allclose(out, np.ones(4))


def test_printing_kernel_runs_even_when_its_output_is_unused(capfd: Any) -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.debug_print("step {}", pl.program_id(0))
        o_ref[...] = x_ref[...]

    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
                          in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                          out_specs=pl.BlockSpec((4,), lambda i: (i,)))

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        call(x)
        return x + 1.0

    f(jnp.zeros(8)).block_until_ready()
    jax.effects_barrier()
    out = capfd.readouterr().out
    assert "step 0" in out and "step 1" in out


@pytest.mark.parametrize("lower,upper,step", [(9, 0, -3), (0, 10, 3), (2, 3, 5)])
def test_loop_matches_range_with_traced_bounds(lower: int, upper: int, step: int) -> None:
    def kernel(o_ref: Any) -> None:
        o_ref[...] = jnp.zeros(8, jnp.int32)
        count = pl.loop(jnp.int32(lower) + 0 * pl.program_id(0), upper, step=step,
                        init_carry=jnp.int32(0))(lambda i, c: c + 1)
        o_ref[0] = count

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.int32), grid=(1,))()
    assert int(out[0]) == len(range(lower, upper, step))


def test_kernel_called_again_is_not_recompiled() -> None:
    call = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                          jax.ShapeDtypeStruct((8,), jnp.float32))
    x = _rand((8,))
    np.testing.assert_allclose(call(x), x * 2, rtol=1e-6)
    traced = call._cache_size()
    np.testing.assert_allclose(call(x + 1), (x + 1) * 2, rtol=1e-6)
    assert call._cache_size() == traced
