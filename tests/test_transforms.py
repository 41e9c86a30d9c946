"""pallas_call under JAX transformations (jit, vmap, custom_vjp, shard_map) and the
mesh/state helpers (pl.kernel, pl.core_map, pl.run_state, pl.run_scoped, pl.loop, aliasing),
each checked against plain jax.numpy on random inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_core as pl


def _rand(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _close(actual, expected, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=1e-6)


ROWS = pl.BlockSpec((16, 8), lambda i: (i, 0))


def add_scaled_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + 2.0 * y_ref[...]


def add_scaled(x, y):
    """``x + 2 y`` over a (64, 8) array in four row blocks."""
    return pl.pallas_call(add_scaled_kernel, _sds(x), grid=(4,), in_specs=[ROWS, ROWS],
                          out_specs=ROWS)(x, y)


def step_kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[...] * (i + 1).astype(jnp.float32) + pl.num_programs(0)


def by_step(x):
    """Row block i of ``x`` times ``i + 1``, plus the number of blocks (4)."""
    return pl.pallas_call(step_kernel, _sds(x), grid=(4,), in_specs=[ROWS], out_specs=ROWS)(x)


def _by_step_reference(x):
    scale = jnp.repeat(jnp.arange(1.0, 5.0), 16)[:, None]
    return x * scale + 4


# --- jit and vmap -------------------------------------------------------------------------


def test_jit():
    x, y = _rand((64, 8)), _rand((64, 8), 1)
    _close(jax.jit(add_scaled)(x, y), x + 2 * y)
    _close(jax.jit(by_step)(x), _by_step_reference(x))


def test_vmap_batch_dim_not_zero():
    x, y = _rand((64, 3, 8)), _rand((64, 3, 8), 1)
    out = jax.vmap(add_scaled, in_axes=1)(x, y)
    _close(out, jnp.moveaxis(x + 2 * y, 1, 0))


def test_vmap_mixes_batched_and_unbatched_operands():
    x, y = _rand((3, 64, 8)), _rand((64, 8), 1)
    _close(jax.vmap(add_scaled, in_axes=(0, None))(x, y), x + 2 * y)
    _close(jax.vmap(add_scaled, in_axes=(None, 0))(y, x), y + 2 * x)


def test_vmap_out_axes():
    x, y = _rand((3, 64, 8)), _rand((3, 64, 8), 1)
    out = jax.vmap(add_scaled, out_axes=2)(x, y)
    assert out.shape == (64, 8, 3)
    _close(out, jnp.moveaxis(x + 2 * y, 0, 2))


def test_nested_vmap():
    x, y = _rand((2, 64, 3, 8)), _rand((3, 64, 8), 1)
    inner = jax.vmap(add_scaled, in_axes=(1, 0))
    out = jax.vmap(inner, in_axes=(0, None))(x, y)
    assert out.shape == (2, 3, 64, 8)
    _close(out, jnp.moveaxis(x, 2, 1) + 2 * y[None])


def test_vmap_of_program_id_kernel_matches_per_batch_calls():
    x = _rand((3, 64, 8))
    batched = jax.vmap(by_step)(x)
    _close(batched, jnp.stack([by_step(x[b]) for b in range(3)]))
    _close(batched, _by_step_reference(x))
    _close(jax.vmap(jax.vmap(by_step))(x[None]), batched[None])


def test_vmap_of_jit():
    x, y = _rand((3, 64, 8)), _rand((3, 64, 8), 1)
    _close(jax.jit(jax.vmap(jax.jit(add_scaled)))(x, y), x + 2 * y)


# --- autodiff ----------------------------------------------------------------------------------


def _square_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * x_ref[...]


def _square_bwd_kernel(x_ref, g_ref, o_ref):
    o_ref[...] = 2.0 * x_ref[...] * g_ref[...]


@jax.custom_vjp
def square(x):
    return pl.pallas_call(_square_kernel, _sds(x), grid=(4,), in_specs=[ROWS],
                          out_specs=ROWS)(x)


def _square_fwd(x):
    return square(x), x


def _square_bwd(x, g):
    return (pl.pallas_call(_square_bwd_kernel, _sds(x), grid=(4,), in_specs=[ROWS, ROWS],
                           out_specs=ROWS)(x, g),)


square.defvjp(_square_fwd, _square_bwd)


def test_custom_vjp_grad_matches_jnp():
    x = _rand((64, 8))

    def loss(sq, x):
        return jnp.sum(sq(x) * jnp.sin(x))

    expected = jax.grad(functools.partial(loss, lambda v: v * v))(x)
    _close(jax.grad(functools.partial(loss, square))(x), expected, rtol=1e-5)
    _close(jax.jit(jax.grad(functools.partial(loss, square)))(x), expected, rtol=1e-5)


def test_custom_vjp_grad_under_vmap():
    x = _rand((3, 64, 8))
    grads = jax.vmap(jax.grad(lambda v: square(v).sum()))(x)
    _close(grads, 2 * x)


def test_grad_without_custom_vjp_is_an_autodiff_error():
    x, y = _rand((64, 8)), _rand((64, 8), 1)
    with pytest.raises(pl.AutodiffError, match=r"add_scaled_kernel.*jax\.custom_vjp"):
        jax.grad(lambda a: add_scaled(a, y).sum())(x)
    with pytest.raises(pl.AutodiffError, match="reverse mode"):
        jax.jit(jax.grad(lambda a: add_scaled(a, y).sum()))(x)


def test_jvp_runs_a_derivative_kernel():
    """Forward mode needs no custom rule (more cases in test_autodiff.py)."""
    x, t = _rand((64, 8)), _rand((64, 8), 1)
    got = jax.jvp(by_step, (x,), (t,))
    want = jax.jvp(_by_step_reference, (x,), (t,))
    _close(got[0], want[0])
    _close(got[1], want[1])


# --- shard_map --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh8():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                    "must be set before jax is imported (tests/conftest.py does it)")
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))


def test_shard_map_without_out_shape_annotations(mesh8):
    x, y = _rand((8 * 64, 8)), _rand((8 * 64, 8), 1)
    fn = jax.shard_map(add_scaled, mesh=mesh8, in_specs=(P("d"), P("d")), out_specs=P("d"))
    _close(jax.jit(fn)(x, y), x + 2 * y)


def test_shard_map_with_replicated_operand_and_program_id(mesh8):
    x, y = _rand((8 * 64, 8)), _rand((64, 8), 1)

    def body(xs, ys):
        return by_step(xs) + add_scaled(xs, ys)

    fn = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=(P("d"), P()), out_specs=P("d")))
    shards = x.reshape(8, 64, 8)
    expected = jnp.concatenate([_by_step_reference(s) + s + 2 * y for s in shards])
    _close(fn(x, y), expected)


# --- meshes and state ------------------------------------------------------------------------


def test_kernel_on_a_mesh_with_axis_index():
    x = _rand((64, 8))

    def body(x_ref, o_ref):
        core = jax.lax.axis_index("x")
        rows = pl.ds(core * 16, 16)
        o_ref[rows] = x_ref[rows] * 2.0 + core.astype(jnp.float32)

    out = pl.kernel(body, out_type=_sds(x), mesh=pl.Mesh(("x",), (4,)))(x)
    _close(out, x * 2 + jnp.repeat(jnp.arange(4.0), 16)[:, None])


def test_kernel_as_decorator_under_jit_and_vmap():
    x = _rand((3, 64, 8))

    @pl.kernel(out_type=jax.ShapeDtypeStruct((64, 8), jnp.float32),
               mesh=pl.Mesh(("x",), (4,)))
    def negate_slices(x_ref, o_ref):
        rows = pl.ds(jax.lax.axis_index("x") * 16, 16)
        o_ref[rows] = -x_ref[rows]

    _close(jax.jit(jax.vmap(negate_slices))(x), -x)


def test_core_map_inside_run_state():
    x = _rand((64, 8))

    def stateful(refs):
        x_ref, o_ref = refs

        @pl.core_map(pl.Mesh(("core",), (4,)))
        def _():
            rows = pl.ds(jax.lax.axis_index("core") * 16, 16)
            o_ref[rows] = jnp.exp(x_ref[rows])

    _, out = pl.run_state(stateful)((x, jnp.zeros_like(x)))
    _close(out, jnp.exp(x), rtol=1e-5)


def test_run_scoped_scratch_reads_outer_refs():
    x = _rand((64, 8))

    def kernel(x_ref, o_ref):
        def body(tmp_ref, acc_ref):
            tmp_ref[...] = x_ref[...] + 1.0
            acc_ref[...] = tmp_ref[...] * 2.0
            o_ref[...] = acc_ref[...] - x_ref[...]
            return acc_ref[0, 0]

        first = pl.run_scoped(body, pl.ANY((16, 8), jnp.float32),
                              acc_ref=jax.ShapeDtypeStruct((16, 8), jnp.float32))
        o_ref[0, 0] = first

    out = pl.pallas_call(kernel, _sds(x), grid=(4,), in_specs=[ROWS], out_specs=ROWS)(x)
    expected = (x + 1) * 2 - x
    expected = expected.at[::16, 0].set((x[::16, 0] + 1) * 2)
    _close(out, expected, rtol=1e-5)


def test_loop_with_and_without_carry():
    x = _rand((64, 8))

    def kernel(x_ref, o_ref):
        @pl.loop(0, 4)
        def _(i):
            rows = pl.ds(i * 16, 16)
            o_ref[rows] = x_ref[rows] + i.astype(jnp.float32)

        def accumulate(i, carry):
            return carry + x_ref[pl.ds(i * 16, 16)]

        o_ref[pl.ds(0, 16)] = pl.loop(0, 4, init_carry=jnp.zeros((16, 8)))(accumulate)

        @pl.loop(1, 4, step=2)
        def _(i):
            o_ref[pl.ds(i * 16, 16)] = -o_ref[pl.ds(i * 16, 16)]

    out = pl.pallas_call(kernel, _sds(x))(x)
    blocks = x.reshape(4, 16, 8)
    expected = jnp.concatenate([blocks.sum(0), -(blocks[1] + 1), blocks[2] + 2,
                                -(blocks[3] + 3)])
    _close(out, expected, rtol=1e-5)


def test_input_output_aliases_under_jit():
    x, y = _rand((64, 8)), _rand((64, 8), 1)

    def kernel(x_ref, y_ref, o_ref):
        # Writes only the first two row blocks; the rest keeps the aliased input's values.
        o_ref[pl.ds(0, 32)] = x_ref[pl.ds(0, 32)] + y_ref[pl.ds(0, 32)]

    def update(x, y):
        return pl.pallas_call(kernel, _sds(x), input_output_aliases={0: 0})(x, y)

    expected = x.at[:32].add(y[:32])
    _close(jax.jit(update)(x, y), expected)
    _close(jax.jit(update, donate_argnums=0)(x + 0, y), expected)
    _close(jax.vmap(update, in_axes=(None, 0))(x, jnp.stack([y, -y])),
           jnp.stack([expected, x.at[:32].add(-y[:32])]))
    # A batched aliased input on a non-leading axis is moved to match the output (axis 0).
    _close(jax.vmap(update, in_axes=(1, None), out_axes=1)(jnp.stack([x, -x], axis=1), y),
           jnp.stack([expected, (-x).at[:32].add(y[:32])], axis=1))
